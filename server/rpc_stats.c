/* Stats: per-shard and per-tensor figures (unary). Each tensor is read
 * under its own lock, briefly, so Stats never stalls pushes for long. */
#include <stdlib.h>
#include <string.h>

#include "wire.h"

typedef struct fps_stats_call_s {
  fps_call_t base;
} fps_stats_call_t;

static void fps__stats_destroy(fps_call_t *c) { free(c); }

static int fps__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void fps__state_fill(Factorps__V1__StateSize *o, const fps_state_size_t *s) {
  factorps__v1__state_size__init(o);
  o->row_elements = s->row;
  o->col_elements = s->col;
  o->var_elements = s->var;
  o->momentum_elements = s->mom;
  o->elements = s->elements;
  o->bytes = s->bytes;
  o->adamw_elements = s->adamw_elements;
  o->adamw_bytes = s->adamw_bytes;
}

static void fps__stats_run(fps_stats_call_t *sc, const Factorps__V1__StatsRequest *req) {
  fps_server_t *srv = sc->base.srv;
  fps_shard_t *shard = &srv->shard;
  Factorps__V1__StatsResponse resp = FACTORPS__V1__STATS_RESPONSE__INIT;
  Factorps__V1__ShardStats sh = FACTORPS__V1__SHARD_STATS__INIT;
  Factorps__V1__StateSize sh_state;
  Factorps__V1__TensorStats *ts = NULL, **tsp = NULL;
  Factorps__V1__StateSize *tstate = NULL;
  Factorps__V1__ApplyRecord *recs = NULL, **recp = NULL;
  uint64_t *shapes = NULL;
  size_t nt = 0, nrec = 0;
  fps_state_size_t total;
  memset(&total, 0, sizeof total);

  pthread_rwlock_rdlock(&shard->store.mu);
  uint64_t count = shard->store.count;
  if (req->include_tensors && count) {
    uint32_t lim = req->apply_log_limit < srv->cfg.apply_log ? req->apply_log_limit : srv->cfg.apply_log;
    ts = calloc(count, sizeof *ts);
    tsp = calloc(count, sizeof *tsp);
    tstate = calloc(count, sizeof *tstate);
    shapes = calloc(count * FPS_MAX_DIMS, sizeof *shapes);
    if (lim) {
      recs = calloc(count * lim, sizeof *recs);
      recp = calloc(count * lim, sizeof *recp);
    }
    if (!ts || !tsp || !tstate || !shapes || (lim && (!recs || !recp))) {
      pthread_rwlock_unlock(&shard->store.mu);
      fps_call_fail(&sc->base, GRPC_STATUS_RESOURCE_EXHAUSTED, "Stats: out of memory for %llu tensors",
                    (unsigned long long)count);
      goto out;
    }
  }
  uint64_t param_elements = 0;
  for (fps_tensor_t *t = shard->store.first; t; t = t->next) {
    param_elements += t->numel;
    total.row += t->size.row;
    total.col += t->size.col;
    total.var += t->size.var;
    total.mom += t->size.mom;
    total.elements += t->size.elements;
    total.bytes += t->size.bytes;
    total.adamw_elements += t->size.adamw_elements;
    total.adamw_bytes += t->size.adamw_bytes;
    if (!ts) continue;
    Factorps__V1__TensorStats *o = &ts[nt];
    factorps__v1__tensor_stats__init(o);
    o->name = t->name;
    o->n_shape = t->shape.ndim;
    o->shape = shapes + nt * FPS_MAX_DIMS;
    memcpy(o->shape, t->shape.dim, t->shape.ndim * sizeof(uint64_t));
    o->factored = t->st.factored;
    o->flavor = t->hp.flavor == FPS_FLAVOR_TORCH ? FACTORPS__V1__FLAVOR__FLAVOR_TORCH : FACTORPS__V1__FLAVOR__FLAVOR_HF;
    o->param_elements = t->numel;
    o->param_bytes = t->numel * 4;
    fps__state_fill(&tstate[nt], &t->size);
    o->state = &tstate[nt];
    uint32_t lim = req->apply_log_limit < srv->cfg.apply_log ? req->apply_log_limit : srv->cfg.apply_log;
    pthread_mutex_lock(&t->mu);
    o->version = t->version;
    o->ready = t->ready;
    if (lim && t->log_len) {
      uint32_t take = t->log_len < lim ? t->log_len : lim;
      o->apply_log = recp + nrec;
      for (uint32_t k = 0; k < take; k++) {
        /* Oldest first among the last `take` records. */
        const fps_apply_rec_t *a = &t->log[(t->log_head + t->log_len - take + k) % t->log_cap];
        factorps__v1__apply_record__init(&recs[nrec]);
        recs[nrec].worker_id = a->worker_id;
        recs[nrec].step = a->step;
        recs[nrec].version = a->version;
        recs[nrec].lr = a->lr;
        recs[nrec].weight_decay = a->weight_decay;
        recp[nrec] = &recs[nrec];
        nrec++;
      }
      o->n_apply_log = take;
    }
    pthread_mutex_unlock(&t->mu);
    tsp[nt] = o;
    nt++;
  }
  pthread_rwlock_unlock(&shard->store.mu);

  fps_counters_t *c = &shard->counters;
  sh.shard_id = srv->cfg.shard_id;
  sh.shard_count = srv->cfg.shard_count;
  sh.mode = (Factorps__V1__Mode)srv->cfg.mode;
  sh.workers = srv->cfg.workers;
  sh.staleness = srv->cfg.mode == FPS_MODE_SSP ? srv->cfg.staleness : 0;
  sh.simd = (char *)fps_kernels_name(shard->kernels);
  sh.version = (char *)FPS_VERSION;
  sh.tensors = count;
  sh.param_elements = param_elements;
  sh.param_bytes = param_elements * 4;
  fps__state_fill(&sh_state, &total);
  sh.state = &sh_state;
  sh.pushes = atomic_load(&c->pushes);
  sh.push_errors = atomic_load(&c->push_errors);
  sh.updates = atomic_load(&c->updates);
  sh.bytes_received = atomic_load(&c->bytes_received);
  sh.bytes_sent = atomic_load(&c->bytes_sent);
  sh.update_bytes = atomic_load(&c->update_bytes);
  double lat[FPS_LATENCY_RING];
  pthread_mutex_lock(&c->mu);
  sh.push_seconds_sum = c->push_seconds_sum;
  sh.update_seconds_sum = c->update_seconds_sum;
  uint32_t nl = c->latency_n;
  memcpy(lat, c->latency, sizeof lat);
  pthread_mutex_unlock(&c->mu);
  if (nl) {
    qsort(lat, nl, sizeof lat[0], fps__cmp_double);
    sh.push_seconds_p50 = lat[(nl - 1) / 2];
    sh.push_seconds_p99 = lat[(size_t)((nl - 1) * 0.99)];
  }
  sh.uptime_seconds = (double)(fps_now_ns() - shard->started_ns) / 1e9;
  resp.shard = &sh;
  resp.n_tensors = nt;
  resp.tensors = tsp;
  grpc_byte_buffer *bb = fps_pack_message(&resp);
  if (!bb) fps_call_fail(&sc->base, GRPC_STATUS_RESOURCE_EXHAUSTED, "Stats: out of memory packing the reply");
  else
    fps_call_send(&sc->base, bb, true); /* final: on failure the call is already released */
out:
  free(ts);
  free(tsp);
  free(tstate);
  free(shapes);
  free(recs);
  free(recp);
}

void fps_rpc_stats_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                         grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  Factorps__V1__StatsRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_stats_call_t),
      fps__stats_destroy, NULL, "Stats", &factorps__v1__stats_request__descriptor, &c);
  if (!req) return;
  fps__stats_run((fps_stats_call_t *)c, req);
  protobuf_c_message_free_unpacked(&req->base, NULL);
}

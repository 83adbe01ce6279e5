/* Stats: per-shard and per-tensor figures (unary). The core reads them
 * (fps_shard_view: each tensor under its own lock, briefly, so Stats never
 * stalls pushes for long); this handler encodes them. */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "replica.h"
#include "wire.h"

typedef struct fps_stats_call_s {
  fps_call_t base;
} fps_stats_call_t;

static void fps__stats_destroy(fps_call_t *c) { fps_free(c); }


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
  fps_shard_t *shard = srv->shard;
  Factorps__V1__StatsResponse resp = FACTORPS__V1__STATS_RESPONSE__INIT;
  Factorps__V1__ShardStats sh = FACTORPS__V1__SHARD_STATS__INIT;
  Factorps__V1__StateSize sh_state;
  Factorps__V1__TensorStats *ts = NULL, **tsp = NULL;
  Factorps__V1__StateSize *tstate = NULL;
  Factorps__V1__SplitBlock *tsplit = NULL;
  Factorps__V1__ApplyRecord *recs = NULL, **recp = NULL;
  uint64_t *shapes = NULL;
  size_t nt = 0, nrec = 0;
  fps_shard_view_t v;
  if (fps_shard_view(shard, req->include_tensors, req->apply_log_limit, &v) < 0) {
    fps_call_error(&sc->base, FPS_ENOMEM, "Stats: out of memory for the shard's tensors");
    return;
  }
  size_t logs = 0;
  for (size_t i = 0; i < v.n; i++) logs += v.t[i].nlog;
  if (v.n) {
    ts = fps_calloc(v.n, sizeof *ts);
    tsp = fps_calloc(v.n, sizeof *tsp);
    tstate = fps_calloc(v.n, sizeof *tstate);
    tsplit = fps_calloc(v.n, sizeof *tsplit);
    shapes = fps_calloc(v.n * FPS_MAX_DIMS, sizeof *shapes);
    recs = fps_calloc(logs ? logs : 1, sizeof *recs);
    recp = fps_calloc(logs ? logs : 1, sizeof *recp);
    if (!ts || !tsp || !tstate || !tsplit || !shapes || !recs || !recp) {
      fps_call_error(&sc->base, FPS_ENOMEM, "Stats: out of memory for %zu tensors", v.n);
      goto out;
    }
  }
  for (; nt < v.n; nt++) {
    const fps_tensor_view_t *tv = &v.t[nt];
    Factorps__V1__TensorStats *o = &ts[nt];
    factorps__v1__tensor_stats__init(o);
    o->name = (char *)tv->name;
    o->n_shape = tv->shape->ndim;
    o->shape = shapes + nt * FPS_MAX_DIMS;
    memcpy(o->shape, tv->shape->dim, tv->shape->ndim * sizeof(uint64_t));
    o->factored = tv->factored;
    if (tv->split) {
      factorps__v1__split_block__init(&tsplit[nt]);
      tsplit[nt].block_index = tv->map.block_index;
      tsplit[nt].n_bounds = tv->map.n_bounds;
      tsplit[nt].bounds = (uint64_t *)tv->map.bounds;
      tsplit[nt].n_block_shards = tv->map.n_block_shards;
      tsplit[nt].block_shards = (uint32_t *)tv->map.block_shards;
      tsplit[nt].shard_count = tv->map.shard_count;
      o->split = &tsplit[nt];
      o->split_lost_steps = tv->split_lost_steps;
    }
    o->flavor = tv->flavor == FPS_FLAVOR_TORCH ? FACTORPS__V1__FLAVOR__FLAVOR_TORCH : FACTORPS__V1__FLAVOR__FLAVOR_HF;
    o->param_elements = tv->numel;
    o->param_bytes = tv->numel * 4;
    fps__state_fill(&tstate[nt], &tv->size);
    o->state = &tstate[nt];
    o->version = tv->version;
    o->ready = tv->ready;
    /* At the tensor's version now (maybe newer than the view's). */
    fps_tensor_t *tt = NULL;
    fps_snap_t *snap = NULL;
    char cwhy[FPS_WHY_MAX];
    if (tv->ready && fps_shard_snapshot(shard, tv->name, &tt, &snap, cwhy, sizeof cwhy) == 0) {
      fps_snap_unref(snap);
      uint64_t cv;
      if (fps_shard_checksum(shard, tt, &cv, &o->checksum) == 0) o->version = cv;
    }
    if (tv->nlog) {
      o->apply_log = recp + nrec;
      for (uint32_t k = 0; k < tv->nlog; k++) {
        const fps_apply_rec_t *a = &tv->log[k];
        factorps__v1__apply_record__init(&recs[nrec]);
        recs[nrec].worker_id = a->worker_id;
        recs[nrec].step = a->step;
        recs[nrec].version = a->version;
        recs[nrec].lr = a->lr;
        recs[nrec].weight_decay = a->weight_decay;
        recp[nrec] = &recs[nrec];
        nrec++;
      }
      o->n_apply_log = tv->nlog;
    }
    tsp[nt] = o;
  }
  uint64_t count = v.tensors;
  uint64_t param_elements = v.param_elements;
  fps_state_size_t total = v.state;

  sh.shard_id = srv->cfg.shard_id;
  sh.shard_count = srv->cfg.shard_count;
  sh.mode = (Factorps__V1__Mode)srv->cfg.mode;
  sh.workers = srv->cfg.workers;
  sh.staleness = srv->cfg.mode == FPS_MODE_SSP ? srv->cfg.staleness : 0;
  sh.simd = (char *)v.simd;
  sh.version = (char *)FPS_VERSION;
  sh.tensors = count;
  sh.param_elements = param_elements;
  sh.param_bytes = param_elements * 4;
  fps__state_fill(&sh_state, &total);
  sh.state = &sh_state;
  sh.pushes = v.pushes;
  sh.push_errors = v.push_errors;
  sh.updates = v.updates;
  sh.bytes_received = v.bytes_received;
  sh.bytes_sent = v.bytes_sent;
  sh.update_bytes = v.update_bytes;
  sh.push_seconds_sum = v.push_seconds_sum;
  sh.update_seconds_sum = v.update_seconds_sum;
  sh.push_seconds_p50 = v.push_seconds_p50;
  sh.push_seconds_p99 = v.push_seconds_p99;
  sh.uptime_seconds = v.uptime_seconds;
  sh.split_blocks = v.split_blocks;
  sh.split_param_bytes = v.split_elements * 4;
  sh.exchange_sent_bytes = v.xbytes_sent;
  sh.exchange_received_bytes = v.xbytes_received;
  sh.exchange_steps = v.xsteps;
  sh.exchange_failures = v.xfailures;
  sh.exchange_seconds_sum = v.xseconds_sum;
  /* A server built without a replica (the allocation sweep, the fuzz
   * targets) reports solo, as a process without --replica-peer does. */
  fps_role_view_t rv = {.role = FPS_REPLICA_SOLO};
  if (srv->replica) fps_role_get(fps_replica_role(srv->replica), &rv);
  sh.replica_role = (char *)fps_replica_role_name(rv.role);
  sh.term = rv.term;
  sh.replica_peer = srv->cfg.replica_peer;
  sh.standby_joined = rv.role == FPS_REPLICA_PRIMARY ? rv.joined : rv.joined && rv.streaming;
  if (req->include_tensors || req->include_checksum) sh.state_checksum = fps_shard_state_checksum(shard);
  resp.shard = &sh;
  resp.n_tensors = nt;
  resp.tensors = tsp;
  grpc_byte_buffer *bb = fps_pack_message(&resp);
  if (!bb) fps_call_error(&sc->base, FPS_ENOMEM, "Stats: out of memory packing the reply");
  else
    fps_call_send(&sc->base, bb, true); /* final: on failure the call is already released */
out:
  fps_shard_view_free(&v);
  fps_free(ts);
  fps_free(tsp);
  fps_free(tstate);
  fps_free(tsplit);
  fps_free(shapes);
  fps_free(recs);
  fps_free(recp);
}

void fps_rpc_stats_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                         grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__StatsRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_stats_call_t),
      fps__stats_destroy, NULL, "Stats", &factorps__v1__stats_request__descriptor, &c, &held);
  if (!req) return;
  fps__stats_run((fps_stats_call_t *)c, req);
  fps_wire_request_free(&srv->decode, &req->base, held);
}

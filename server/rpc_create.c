/* Create: registers tensors, idempotently, and fills their initial values
 * from sliced `init` data (see TensorCreate in the proto).
 *
 * The whole request is validated before anything changes (phase 1), under
 * the store's write lock, so a failed Create leaves the shard exactly as it
 * was; phase 2 allocates, inserts and writes. Create is a set-up call, so
 * holding the write lock for its duration costs nothing that matters. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "wire.h"

typedef struct fps_create_call_s {
  fps_call_t base;
} fps_create_call_t;

/* Per request item. Items naming the same tensor form a group led by the
 * first of them, which owns the group's plan. */
typedef struct fps_plan_s {
  const Factorps__V1__TensorCreate *tc;
  fps_shape_t shape;
  uint64_t numel;
  fps_adafactor_hparams_t hp;
  size_t lead;                 /* index of the group's first item */
  fps_tensor_t *t;             /* existing tensor (lead), or the new one */
  bool is_new;                 /* lead: tensor created by this call */
  bool was_ready;              /* lead: tensor ready before this call */
  fps_ranges_t ranges;         /* lead: initialised ranges after this call */
  uint64_t off, count;         /* this item's init slice */
} fps_plan_t;

static void fps__create_destroy(fps_call_t *c) { free(c); }

static int fps__cmp_item(const void *a, const void *b, void *arg) {
  const Factorps__V1__CreateRequest *req = arg;
  size_t i = *(const size_t *)a, j = *(const size_t *)b;
  int c = strcmp(req->tensors[i]->name ? req->tensors[i]->name : "",
                 req->tensors[j]->name ? req->tensors[j]->name : "");
  if (c) return c;
  return i < j ? -1 : i > j;
}

/* Phase 1 for item i. Returns a status and fills why. */
static grpc_status_code fps__create_check(fps_server_t *srv, fps_plan_t *p, size_t i, char *why, size_t wl) {
  fps_plan_t *it = &p[i];
  const Factorps__V1__TensorCreate *tc = it->tc;
  const char *name = tc->name ? tc->name : "";
  grpc_status_code code;
  if ((code = fps_wire_name(name, why, wl)) != GRPC_STATUS_OK) return code;
  if ((code = fps_wire_shape(name, tc->shape, tc->n_shape, &it->shape, &it->numel, why, wl)) != GRPC_STATUS_OK)
    return code;
  if ((code = fps_wire_hparams(name, tc->optimizer, &it->hp, why, wl)) != GRPC_STATUS_OK) return code;

  fps_plan_t *lead = &p[it->lead];
  /* What this item must agree with: the existing tensor, or the group's
   * first item. */
  const fps_shape_t *want_shape = NULL;
  const fps_adafactor_hparams_t *want_hp = NULL;
  if (it->lead == i) {
    it->t = fps__store_find_locked(&srv->store, name, strlen(name));
    if (it->t) {
      want_shape = &it->t->shape;
      want_hp = &it->t->hp;
    }
  } else {
    want_shape = &lead->shape;
    want_hp = &lead->hp;
  }
  if (want_shape) {
    if (!fps_shape_equal(want_shape, &it->shape)) {
      char a[256], b[256];
      fps_shape_format(want_shape, a, sizeof a);
      fps_shape_format(&it->shape, b, sizeof b);
      snprintf(why, wl,
               "tensor '%s' already exists with shape %s, not %s: a tensor's shape (and with it whether its "
               "optimizer state is factored) is fixed when it is first created",
               name, a, b);
      return GRPC_STATUS_ALREADY_EXISTS;
    }
    char d[256] = "";
    /* lr and weight_decay may differ: a schedule changes them, and they
     * travel with each push (TensorPush); the existing tensor keeps its
     * first Create's values as the defaults. */
    if (fps_adafactor_hparams_diff_fixed(want_hp, &it->hp, d, sizeof d) != 0) {
      snprintf(why, wl,
               "tensor '%s' already exists with different optimizer settings: %s (existing vs requested); "
               "the flavor and every setting but lr and weight_decay are fixed when a tensor is first created "
               "(its optimizer state was built for them); lr and weight_decay may change per push",
               name, d);
      return GRPC_STATUS_ALREADY_EXISTS;
    }
  }
  if (it->lead == i) {
    if (it->t) {
      pthread_mutex_lock(&it->t->mu);
      it->was_ready = it->t->ready;
      int rc = it->was_ready ? 0 : fps_ranges_copy(&it->ranges, &it->t->init);
      pthread_mutex_unlock(&it->t->mu);
      if (rc < 0) {
        snprintf(why, wl, "tensor '%s': out of memory", name);
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
      }
    } else {
      it->is_new = true;
    }
  }

  const Factorps__V1__TensorSlice *s = tc->init;
  if (!s || (s->data.len == 0 && s->n_shape == 0 && (!s->name || !*s->name))) return GRPC_STATUS_OK;
  if (s->name && *s->name && strcmp(s->name, name) != 0) {
    snprintf(why, wl, "tensor '%s': init slice names a different tensor '%.64s'", name, s->name);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if ((code = fps_wire_slice(name, s, &it->shape, it->numel, false, &it->count, why, wl)) != GRPC_STATUS_OK)
    return code;
  it->off = s->offset;
  if (lead->was_ready) {
    it->count = 0; /* the first values win: ignored */
    return GRPC_STATUS_OK;
  }
  uint64_t bad = fps_wire_first_nonfinite((int)s->dtype, s->data.data, it->count);
  if (bad < it->count) {
    snprintf(why, wl, "tensor '%s': initial value at element %" PRIu64 " is NaN or Inf", name, it->off + bad);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  int rc = fps_ranges_add(&lead->ranges, it->off, it->off + it->count);
  if (rc == FPS_EEXISTS) {
    snprintf(why, wl,
             "tensor '%s': init slice [%" PRIu64 ", %" PRIu64 ") overlaps elements that are already initialised",
             name, it->off, it->off + it->count);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (rc < 0) {
    snprintf(why, wl, "tensor '%s': out of memory", name);
    return GRPC_STATUS_RESOURCE_EXHAUSTED;
  }
  return GRPC_STATUS_OK;
}

static void fps__create_run(fps_create_call_t *cc, const Factorps__V1__CreateRequest *req) {
  fps_server_t *srv = cc->base.srv;
  char why[FPS_WHY_MAX] = "";
  grpc_status_code code = GRPC_STATUS_OK;
  size_t n = req->n_tensors;
  fps_plan_t *p = calloc(n ? n : 1, sizeof *p);
  size_t *order = calloc(n ? n : 1, sizeof *order);
  Factorps__V1__TensorInfo *info = calloc(n ? n : 1, sizeof *info);
  Factorps__V1__TensorInfo **infop = calloc(n ? n : 1, sizeof *infop);
  bool locked = false;
  if (!p || !order || !info || !infop) {
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, sizeof why, "Create: out of memory for %zu tensors", n);
    goto done;
  }
  if (req->shard_id != srv->cfg.shard_id || req->shard_count != srv->cfg.shard_count) {
    code = GRPC_STATUS_FAILED_PRECONDITION;
    snprintf(why, sizeof why,
             "Create: the client placed these tensors on shard %u of %u, but this is shard %u of %u "
             "(check the client's shard list)",
             req->shard_id, req->shard_count, srv->cfg.shard_id, srv->cfg.shard_count);
    goto done;
  }
  /* Group items by name: sort indices, the first of each run leads. */
  for (size_t i = 0; i < n; i++) {
    order[i] = i;
    p[i].tc = req->tensors[i];
  }
  qsort_r(order, n, sizeof *order, fps__cmp_item, (void *)req);
  for (size_t k = 0; k < n; k++) {
    size_t i = order[k];
    bool same = k > 0 && !strcmp(req->tensors[order[k - 1]]->name ? req->tensors[order[k - 1]]->name : "",
                                 req->tensors[i]->name ? req->tensors[i]->name : "");
    p[i].lead = same ? p[order[k - 1]].lead : i;
  }

  pthread_rwlock_wrlock(&srv->store.mu);
  locked = true;
  uint64_t new_count = 0, new_bytes = 0;
  for (size_t i = 0; i < n && code == GRPC_STATUS_OK; i++) {
    code = fps__create_check(srv, p, i, why, sizeof why);
    if (code == GRPC_STATUS_OK && p[i].lead == i && p[i].is_new) {
      new_count++;
      new_bytes += p[i].numel * 4;
    }
  }
  if (code != GRPC_STATUS_OK) goto done;
  if (srv->store.count + new_count > srv->cfg.max_tensors) {
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, sizeof why, "Create: %" PRIu64 " new tensors would exceed this shard's limit of %" PRIu64
             " tensors (--max-tensors)", new_count, srv->cfg.max_tensors);
    goto done;
  }
  if (srv->store.param_bytes + new_bytes > srv->cfg.max_bytes) {
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, sizeof why, "Create: %" PRIu64 " new parameter bytes would exceed this shard's limit of %" PRIu64
             " bytes (--max-bytes; %" PRIu64 " in use)", new_bytes, srv->cfg.max_bytes, srv->store.param_bytes);
    goto done;
  }

  /* Phase 2: allocate every new tensor before touching the map. */
  for (size_t i = 0; i < n; i++) {
    if (p[i].lead != i || !p[i].is_new) continue;
    const char *name = p[i].tc->name;
    p[i].t = fps_tensor_create(name, strlen(name), &p[i].shape, p[i].numel, &p[i].hp, srv->cfg.workers,
                               srv->cfg.apply_log);
    if (!p[i].t) {
      code = GRPC_STATUS_RESOURCE_EXHAUSTED;
      snprintf(why, sizeof why, "tensor '%s': out of memory allocating %" PRIu64 " parameters", name, p[i].numel);
      break;
    }
  }
  if (code == GRPC_STATUS_OK && fps__store_reserve_locked(&srv->store, srv->store.count + new_count) < 0) {
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, sizeof why, "Create: out of memory growing the tensor map");
  }
  if (code != GRPC_STATUS_OK) {
    for (size_t i = 0; i < n; i++)
      if (p[i].lead == i && p[i].is_new) {
        fps_tensor_destroy(p[i].t);
        p[i].t = NULL;
      }
    goto done;
  }
  for (size_t i = 0; i < n; i++)
    if (p[i].lead == i && p[i].is_new) fps__store_insert_locked(&srv->store, p[i].t);
  /* Write the initial values, then publish each group's coverage. */
  uint64_t received = 0;
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    if (p[i].count == 0 || lead->was_ready) continue;
    const Factorps__V1__TensorSlice *s = p[i].tc->init;
    pthread_mutex_lock(&lead->t->mu);
    fps_dtype_decode((int)s->dtype, s->data.data, p[i].count, lead->t->param + p[i].off, NULL);
    pthread_mutex_unlock(&lead->t->mu);
    received += s->data.len;
  }
  atomic_fetch_add(&srv->counters.bytes_received, received);
  fps_metrics_rpc_bytes(FPS_METRICS_CREATE, received, 0);
  for (size_t i = 0; i < n; i++) {
    if (p[i].lead != i || p[i].was_ready) continue;
    fps_tensor_t *t = p[i].t;
    pthread_mutex_lock(&t->mu);
    fps_ranges_free(&t->init);
    t->init = p[i].ranges;
    memset(&p[i].ranges, 0, sizeof p[i].ranges);
    if (t->init.covered == t->numel) {
      t->ready = true;
      fps_ranges_free(&t->init);
      FPS_SLOG(FPS_LOG_DEBUG, "tensor '%s' is ready", t->name);
    }
    pthread_mutex_unlock(&t->mu);
  }
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    fps_tensor_t *t = lead->t;
    factorps__v1__tensor_info__init(&info[i]);
    info[i].name = t->name;
    pthread_mutex_lock(&t->mu);
    info[i].version = t->version;
    info[i].ready = t->ready;
    info[i].initialised_elements = t->ready ? t->numel : t->init.covered;
    pthread_mutex_unlock(&t->mu);
    info[i].created = lead->is_new && p[i].lead == i;
    infop[i] = &info[i];
  }

done:
  if (locked) pthread_rwlock_unlock(&srv->store.mu);
  if (code == GRPC_STATUS_OK) {
    Factorps__V1__CreateResponse resp = FACTORPS__V1__CREATE_RESPONSE__INIT;
    resp.n_tensors = n;
    resp.tensors = infop;
    /* Names point into tensors, which are never freed while serving. */
    grpc_byte_buffer *bb = fps_pack_message(&resp);
    if (!bb) fps_call_fail(&cc->base, GRPC_STATUS_RESOURCE_EXHAUSTED, "Create: out of memory packing the reply");
    else
      fps_call_send(&cc->base, bb, true); /* final: on failure the call is already released */
  } else {
    fps_call_fail(&cc->base, code, "%s", why);
  }
  if (p)
    for (size_t i = 0; i < n; i++) fps_ranges_free(&p[i].ranges);
  free(p);
  free(order);
  free(info);
  free(infop);
}

void fps_rpc_create_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                          grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  Factorps__V1__CreateRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_create_call_t),
      fps__create_destroy, NULL, "Create", &factorps__v1__create_request__descriptor, &c);
  if (!req) return;
  fps__create_run((fps_create_call_t *)c, req);
  protobuf_c_message_free_unpacked(&req->base, NULL);
}

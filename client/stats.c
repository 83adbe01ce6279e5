/* fps_client_stats(), fps_client_tensor_stats(), fps_client_discover():
 * Stats calls to the shards in parallel, decoded with protobuf-c (small
 * messages; no tensor data). Read-only, so retried on UNAVAILABLE. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

typedef struct stats_shard_s {
  fps__stream_t s;
  int include_tensors;
  uint32_t log_limit;
  Factorps__V1__StatsResponse *resp;   /* owned, freed by the caller */
} stats_shard_t;

static int stats_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  stats_shard_t *sh = s->ctx;
  Factorps__V1__StatsRequest req = FACTORPS__V1__STATS_REQUEST__INIT;
  req.include_tensors = sh->include_tensors;
  req.apply_log_limit = sh->log_limit;
  *out = fps__pack(&req);
  *last = 1;
  return 0;
}

static int stats_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  stats_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__stats_response__free_unpacked(sh->resp, NULL);
  sh->resp = factorps__v1__stats_response__unpack(NULL, len, data);
  if (!sh->resp) return fps__stream_fail(s, FPS_CODE_INTERNAL, "malformed StatsResponse");
  return 0;
}

static void stats_reset(fps__stream_t *s) {
  stats_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__stats_response__free_unpacked(sh->resp, NULL);
  sh->resp = NULL;
}

static const fps__stream_ops_t stats_ops = {stats_next, stats_reply, stats_reset, NULL};

static void free_shards(stats_shard_t *sh, size_t n) {
  if (!sh) return;
  for (size_t i = 0; i < n; i++)
    if (sh[i].resp) factorps__v1__stats_response__free_unpacked(sh[i].resp, NULL);
  free(sh);
}

/* Calls Stats on every shard; on success each sh[i].resp is set. */
static int stats_all(fps_client_t *c, int include_tensors, uint32_t log_limit,
                     stats_shard_t **out, fps_status_t *status) {
  stats_shard_t *sh = calloc(c->n_shards, sizeof *sh);
  fps__stream_t **run = calloc(c->n_shards, sizeof *run);
  int rc;
  *out = NULL;
  if (!sh || !run) {
    free(sh);
    free(run);
    return fps__status_set(status, FPS_CODE_RESOURCE_EXHAUSTED, -1, "out of memory");
  }
  for (size_t i = 0; i < c->n_shards; i++) {
    sh[i].s.shard = (int)i;
    sh[i].s.ops = &stats_ops;
    sh[i].s.ctx = &sh[i];
    sh[i].include_tensors = include_tensors;
    sh[i].log_limit = log_limit;
    run[i] = &sh[i].s;
  }
  rc = fps__streams_run(c, FPS__METHOD_STATS, run, c->n_shards, FPS__RETRY_IDEMPOTENT, status);
  for (size_t i = 0; !rc && i < c->n_shards; i++)
    if (!sh[i].resp || !sh[i].resp->shard)
      rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i,
                           "shard %zu (%s): Stats reply without shard figures", i, c->addrs[i]);
  free(run);
  if (rc) {
    free_shards(sh, c->n_shards);
    return rc;
  }
  *out = sh;
  return 0;
}

static const char *mode_name(int mode) {
  switch (mode) {
    case FACTORPS__V1__MODE__MODE_SYNC: return "sync";
    case FACTORPS__V1__MODE__MODE_ASYNC: return "async";
    case FACTORPS__V1__MODE__MODE_SSP: return "ssp";
    default: return "?";
  }
}

int fps_client_stats(fps_client_t *c, fps_shard_stats_t *out, size_t n, fps_status_t *status) {
  stats_shard_t *sh;
  if (!c || !out)
    return fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "client or out is NULL");
  if (n != c->n_shards)
    return fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1,
                           "out has %zu entries, the client has %zu shards", n, c->n_shards);
  int rc = stats_all(c, 0, 0, &sh, status);
  if (rc) return rc;
  for (size_t i = 0; i < n; i++) {
    const Factorps__V1__ShardStats *s = sh[i].resp->shard;
    const Factorps__V1__StateSize *z = s->state;
    fps_shard_stats_t *o = &out[i];
    memset(o, 0, sizeof *o);
    o->shard_id = s->shard_id;
    o->shard_count = s->shard_count;
    snprintf(o->mode, sizeof o->mode, "%s", mode_name(s->mode));
    snprintf(o->simd, sizeof o->simd, "%s", s->simd ? s->simd : "");
    snprintf(o->version, sizeof o->version, "%s", s->version ? s->version : "");
    o->workers = s->workers;
    o->staleness = s->staleness;
    o->tensors = s->tensors;
    o->param_elements = s->param_elements;
    o->param_bytes = s->param_bytes;
    if (z) {
      o->state_row = z->row_elements;
      o->state_col = z->col_elements;
      o->state_var = z->var_elements;
      o->state_mom = z->momentum_elements;
      o->state_elements = z->elements;
      o->state_bytes = z->bytes;
      o->adamw_elements = z->adamw_elements;
      o->adamw_bytes = z->adamw_bytes;
    }
    o->pushes = s->pushes;
    o->push_errors = s->push_errors;
    o->updates = s->updates;
    o->bytes_received = s->bytes_received;
    o->bytes_sent = s->bytes_sent;
    o->push_seconds_sum = s->push_seconds_sum;
    o->push_seconds_p50 = s->push_seconds_p50;
    o->push_seconds_p99 = s->push_seconds_p99;
    o->update_seconds_sum = s->update_seconds_sum;
    o->update_bytes = s->update_bytes;
    o->uptime_seconds = s->uptime_seconds;
  }
  free_shards(sh, n);
  fps__status_ok(status);
  return 0;
}

static void fill_tensor(fps_tensor_stats_t *o, const Factorps__V1__TensorStats *t, int shard) {
  memset(o, 0, sizeof *o);
  snprintf(o->name, sizeof o->name, "%s", t->name ? t->name : "");
  o->shard = shard;
  o->ndim = t->n_shape > FPS_CLIENT_MAX_DIMS ? FPS_CLIENT_MAX_DIMS : (uint32_t)t->n_shape;
  if (o->ndim) memcpy(o->shape, t->shape, o->ndim * sizeof *o->shape);
  o->version = t->version;
  o->ready = t->ready;
  o->factored = t->factored;
  o->flavor = t->flavor;
  o->param_elements = t->param_elements;
  o->param_bytes = t->param_bytes;
  if (t->state) {
    o->state_row = t->state->row_elements;
    o->state_col = t->state->col_elements;
    o->state_var = t->state->var_elements;
    o->state_mom = t->state->momentum_elements;
    o->state_elements = t->state->elements;
    o->state_bytes = t->state->bytes;
    o->adamw_elements = t->state->adamw_elements;
    o->adamw_bytes = t->state->adamw_bytes;
  }
}

int fps_client_tensor_stats(fps_client_t *c, const char *name, fps_tensor_stats_t *out,
                            fps_apply_record_t *log, size_t log_cap, size_t *log_len,
                            fps_status_t *status) {
  stats_shard_t *sh;
  if (!c || !name || !out || (log_cap && !log))
    return fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "NULL argument");
  if (log_cap > UINT32_MAX) log_cap = UINT32_MAX;
  /* Every shard is asked: Stats has no name filter, and asking all also
   * finds a tensor that sits on an unexpected shard. */
  int rc = stats_all(c, 1, (uint32_t)log_cap, &sh, status);
  if (rc) return rc;
  rc = fps__status_set(status, FPS_CODE_NOT_FOUND, -1, "no shard holds tensor '%s'", name);
  for (size_t i = 0; i < c->n_shards && rc; i++) {
    const Factorps__V1__StatsResponse *r = sh[i].resp;
    for (size_t j = 0; j < r->n_tensors; j++) {
      const Factorps__V1__TensorStats *t = r->tensors[j];
      if (!t->name || strcmp(t->name, name)) continue;
      fill_tensor(out, t, (int)i);
      size_t k = t->n_apply_log < log_cap ? t->n_apply_log : log_cap;
      /* Keep the newest k records if the shard sent more than asked. */
      size_t first = t->n_apply_log - k;
      for (size_t m = 0; m < k; m++) {
        const Factorps__V1__ApplyRecord *a = t->apply_log[first + m];
        log[m] = (fps_apply_record_t){a->worker_id, a->step, a->version, a->lr, a->weight_decay};
      }
      if (log_len) *log_len = k;
      rc = 0;
      fps__status_ok(status);
      break;
    }
  }
  free_shards(sh, c->n_shards);
  return rc;
}

int fps_client_discover(fps_client_t *c, size_t *n_found, fps_status_t *status) {
  stats_shard_t *sh;
  fps__tensor_list_t list = {0};
  size_t total = 0;
  int rc;
  if (!c) return fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "client is NULL");
  if ((rc = stats_all(c, 1, 0, &sh, status))) return rc;
  for (size_t i = 0; i < c->n_shards; i++) total += sh[i].resp->n_tensors;
  list.t = calloc(total ? total : 1, sizeof *list.t);
  if (!list.t) {
    rc = fps__status_set(status, FPS_CODE_RESOURCE_EXHAUSTED, -1, "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < c->n_shards; i++) {
    const Factorps__V1__StatsResponse *r = sh[i].resp;
    for (size_t j = 0; j < r->n_tensors; j++) {
      const Factorps__V1__TensorStats *t = r->tensors[j];
      fps__tensor_t *x = &list.t[list.n];
      char err[64];
      if (!fps__name_valid(t->name) || t->n_shape > FPS_CLIENT_MAX_DIMS) {
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i,
                             "shard %zu reports a tensor with a bad name or shape", i);
        goto fail;
      }
      x->ndim = (uint32_t)t->n_shape;
      if (t->n_shape) memcpy(x->shape, t->shape, t->n_shape * sizeof *t->shape);
      x->numel = fps__shape_numel(x->ndim, x->shape, err, sizeof err);
      if (!x->numel) {
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i,
                             "shard %zu reports tensor '%s' with a bad shape: %s", i, t->name,
                             err);
        goto fail;
      }
      x->bytes = x->numel * 4;
      x->shard = (int)i;
      if (!(x->name = strdup(t->name))) {
        rc = fps__status_set(status, FPS_CODE_RESOURCE_EXHAUSTED, -1, "out of memory");
        goto fail;
      }
      list.n++;
    }
  }
  long dup = fps__tensor_list_sort(&list);
  if (dup >= 0) {
    rc = fps__status_set(status, FPS_CODE_DATA_LOSS, list.t[dup].shard,
                         "tensor '%s' is held by shards %d and %d", list.t[dup].name,
                         list.t[dup - 1].shard, list.t[dup].shard);
    goto fail;
  }
  pthread_rwlock_wrlock(&c->lock);
  fps__tensor_list_free(&c->tensors);
  c->tensors = list;
  pthread_rwlock_unlock(&c->lock);
  if (n_found) *n_found = list.n;
  list = (fps__tensor_list_t){0};
  fps__status_ok(status);
  rc = 0;
fail:
  fps__tensor_list_free(&list);
  free_shards(sh, c->n_shards);
  return rc;
}

/* fps_client_stats(), fps_client_tensor_stats(), fps_client_discover():
 * Stats calls to the shards in parallel, decoded with protobuf-c (small
 * messages; no tensor data). Read-only, so retried on UNAVAILABLE.
 *
 * A row block of a split tensor is reported by its shard with
 * its map (TensorStats.split); discover rebuilds the tensor's blocks from
 * every shard's reports and checks they form one consistent map. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

typedef struct stats_shard_s {
  fps__stream_t s;
  int include_tensors;
  int include_checksum;
  uint32_t log_limit;
  Factorps__V1__StatsResponse *resp;   /* owned, freed by the caller */
} stats_shard_t;

static int stats_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  stats_shard_t *sh = s->ctx;
  Factorps__V1__StatsRequest req = FACTORPS__V1__STATS_REQUEST__INIT;
  req.include_tensors = sh->include_tensors;
  req.include_checksum = sh->include_checksum;
  req.apply_log_limit = sh->log_limit;
  *out = fps__pack(&req);
  *last = 1;
  return 0;
}

static int stats_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  stats_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__stats_response__free_unpacked(sh->resp, &fps__pb_allocator);
  int code;
  sh->resp = fps__unpack(&factorps__v1__stats_response__descriptor, data, len, &code);
  if (!sh->resp) return fps__stream_fail(s, code, "%s StatsResponse", fps__unpack_why(code));
  return 0;
}

static void stats_reset(fps__stream_t *s) {
  stats_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__stats_response__free_unpacked(sh->resp, &fps__pb_allocator);
  sh->resp = NULL;
}

static const fps__stream_ops_t stats_ops = {stats_next, stats_reply, stats_reset, NULL};

static void free_shards(stats_shard_t *sh, size_t n) {
  if (!sh) return;
  for (size_t i = 0; i < n; i++)
    if (sh[i].resp) factorps__v1__stats_response__free_unpacked(sh[i].resp, &fps__pb_allocator);
  fps_free(sh);
}

/* Calls Stats on every shard; on success each sh[i].resp is set. */
static int stats_all(fps_client_t *c, int include_tensors, uint32_t log_limit,
                     stats_shard_t **out, fps_status_t *status) {
  stats_shard_t *sh = fps_calloc(c->n_shards, sizeof *sh);
  fps__stream_t **run = fps_calloc(c->n_shards, sizeof *run);
  int rc;
  *out = NULL;
  if (!sh || !run) {
    fps_free(sh);
    fps_free(run);
    return fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
  }
  for (size_t i = 0; i < c->n_shards; i++) {
    sh[i].s.shard = (int)i;
    sh[i].s.ops = &stats_ops;
    sh[i].s.ctx = &sh[i];
    sh[i].include_tensors = include_tensors;
    /* The shard's checksum costs it a pass over its bytes: asked for
     * where it is compared, a shard listed with its replicas (the calls
     * with tensors get it anyway). */
    sh[i].include_checksum = !include_tensors && c->shards[i].n > 1;
    sh[i].log_limit = log_limit;
    run[i] = &sh[i].s;
  }
  size_t n_run = c->n_shards;
  for (size_t round = 1;; round++) {
    rc = fps__streams_run(c, FPS__METHOD_STATS, run, n_run, FPS__RETRY_IDEMPOTENT, status);
    for (size_t i = 0; !rc && i < c->n_shards; i++)
      if (!sh[i].resp || !sh[i].resp->shard)
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i,
                             "shard %zu (%s): Stats reply without shard figures", i, c->addrs[i]);
    if (rc) break;
    /* A standby answers Stats too, but the figures that matter are the
     * primary's: a replicated shard whose answer came from a standby is
     * asked at its next replica, each replica at most once. A primary's
     * answer is where the shard's calls go next. */
    n_run = 0;
    for (size_t i = 0; i < c->n_shards; i++) {
      fps__shard_conn_t *sc = &c->shards[i];
      const char *role = sh[i].resp->shard->replica_role;
      if (role && !strcmp(role, "primary")) {
        atomic_store(&sc->current, sh[i].s.replica);
      } else if (role && !strcmp(role, "standby") && round < sc->n) {
        atomic_store(&sc->current, (int)(((size_t)sh[i].s.replica + 1) % sc->n));
        run[n_run++] = &sh[i].s;
      }
    }
    if (!n_run) break;
  }
  fps_free(run);
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
    return fps__status_err(status, FPS_EINVAL, -1, "client or out is NULL");
  if (n != c->n_shards)
    return fps__status_err(status, FPS_EINVAL, -1,
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
    o->split_blocks = s->split_blocks;
    o->split_param_bytes = s->split_param_bytes;
    o->exchange_sent_bytes = s->exchange_sent_bytes;
    o->exchange_received_bytes = s->exchange_received_bytes;
    o->exchange_steps = s->exchange_steps;
    o->exchange_failures = s->exchange_failures;
    o->exchange_seconds_sum = s->exchange_seconds_sum;
    snprintf(o->replica_role, sizeof o->replica_role, "%s", s->replica_role ? s->replica_role : "");
    o->term = s->term;
    snprintf(o->replica_peer, sizeof o->replica_peer, "%s", s->replica_peer ? s->replica_peer : "");
    o->standby_joined = s->standby_joined;
    o->replica = (uint32_t)sh[i].s.replica;
    o->state_checksum = s->state_checksum;
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
  /* Which rows it is: a block's from its map, a whole tensor's all. */
  uint64_t rows = 1;
  for (uint32_t d = 0; d + 1 < o->ndim; d++) rows *= o->shape[d];
  if (o->ndim == 1) rows = o->shape[0];
  o->n_blocks = 1;
  o->row_hi = rows;
  const Factorps__V1__SplitBlock *sp = t->split;
  if (sp && sp->n_bounds >= 3 && sp->block_index + 1 < sp->n_bounds) {
    o->block_index = sp->block_index;
    o->n_blocks = (uint32_t)(sp->n_bounds - 1);
    o->row_lo = sp->bounds[sp->block_index];
    o->row_hi = sp->bounds[sp->block_index + 1];
  }
  o->checksum = t->checksum;
}

int fps_client_tensor_stats(fps_client_t *c, const char *name, fps_tensor_stats_t *out,
                            fps_apply_record_t *log, size_t log_cap, size_t *log_len,
                            fps_status_t *status) {
  stats_shard_t *sh;
  if (!c || !name || !out || (log_cap && !log))
    return fps__status_err(status, FPS_EINVAL, -1, "NULL argument");
  if (log_cap > UINT32_MAX) log_cap = UINT32_MAX;
  /* Every shard is asked: Stats has no name filter, and asking all also
   * finds a tensor that sits on an unexpected shard. */
  int rc = stats_all(c, 1, (uint32_t)log_cap, &sh, status);
  if (rc) return rc;
  rc = fps__status_err(status, FPS_ENOTFOUND, -1, "no shard holds tensor '%s'", name);
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

/* One tensor report of discover: which shard sent it. */
typedef struct disc_s {
  const Factorps__V1__TensorStats *t;
  int shard;
} disc_t;

static int disc_by_name(const void *a, const void *b) {
  const disc_t *x = a, *y = b;
  int c = strcmp(x->t->name, y->t->name);
  if (c) return c;
  return x->shard < y->shard ? -1 : x->shard > y->shard;
}

static int is_block(const Factorps__V1__TensorStats *t) { return t->split && t->split->n_bounds >= 3; }

/* The blocks of a split tensor from its reports r[0..n) (same name, by
 * shard): one consistent map over the client's shards, every block
 * reported once, by the shard the map puts it on. Fills x->blocks,
 * n_blocks and shard. Returns 0, or DATA_LOSS/RESOURCE_EXHAUSTED via st. */
static int disc_blocks(fps_client_t *c, const disc_t *r, size_t n, fps__tensor_t *x,
                       fps_status_t *st) {
  const Factorps__V1__SplitBlock *m = r[0].t->split;
  const char *name = r[0].t->name;
  const size_t nb = m->n_bounds - 1;
  const uint64_t rows = x->numel / fps__row_elems(x);
  if (m->shard_count != c->n_shards || m->n_block_shards != nb || nb > FPS__SPLIT_MAX_SHARDS)
    return fps__status_set(st, FPS_CODE_DATA_LOSS, r[0].shard,
                           "shard %d (%s) holds a block of tensor '%s' placed for %u shards in %zu "
                           "blocks; this client has %zu shards",
                           r[0].shard, c->addrs[r[0].shard], name, m->shard_count, nb, c->n_shards);
  for (size_t k = 0; k < nb; k++)
    if (m->bounds[k] >= m->bounds[k + 1] || m->block_shards[k] >= c->n_shards ||
        (k && m->block_shards[k] <= m->block_shards[k - 1]))
      return fps__status_set(st, FPS_CODE_DATA_LOSS, r[0].shard,
                             "shard %d (%s) reports tensor '%s' with an inconsistent block map "
                             "(block %zu)",
                             r[0].shard, c->addrs[r[0].shard], name, k);
  if (m->bounds[0] != 0 || m->bounds[nb] != rows)
    return fps__status_set(st, FPS_CODE_DATA_LOSS, r[0].shard,
                           "shard %d (%s) reports tensor '%s' with blocks over rows [%llu, %llu), "
                           "not its %llu rows",
                           r[0].shard, c->addrs[r[0].shard], name, (unsigned long long)m->bounds[0],
                           (unsigned long long)m->bounds[nb], (unsigned long long)rows);
  unsigned char *seen = fps_calloc(nb, 1);
  if (!seen) return fps__status_err(st, FPS_ENOMEM, -1, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    const Factorps__V1__SplitBlock *o = r[i].t->split;
    if (!is_block(r[i].t) || o->n_bounds != m->n_bounds || o->n_block_shards != nb ||
        o->shard_count != m->shard_count ||
        memcmp(o->bounds, m->bounds, m->n_bounds * sizeof *o->bounds) ||
        memcmp(o->block_shards, m->block_shards, nb * sizeof *o->block_shards) ||
        r[i].t->n_shape != r[0].t->n_shape ||
        memcmp(r[i].t->shape, r[0].t->shape, r[0].t->n_shape * sizeof *r[0].t->shape)) {
      rc = fps__status_set(st, FPS_CODE_DATA_LOSS, r[i].shard,
                           "tensor '%s': shards %d and %d report it with different shapes or block "
                           "maps (or one holds it whole)",
                           name, r[0].shard, r[i].shard);
    } else if (o->block_index >= nb || m->block_shards[o->block_index] != (uint32_t)r[i].shard ||
               seen[o->block_index]) {
      rc = fps__status_set(st, FPS_CODE_DATA_LOSS, r[i].shard,
                           "shard %d (%s) reports block %u of tensor '%s', which its map puts on "
                           "shard %u%s",
                           r[i].shard, c->addrs[r[i].shard], o->block_index, name,
                           o->block_index < nb ? m->block_shards[o->block_index] : 0,
                           o->block_index < nb && seen[o->block_index] ? " (reported twice)" : "");
    } else {
      seen[o->block_index] = 1;
    }
  }
  for (size_t k = 0; k < nb && !rc; k++)
    if (!seen[k])
      rc = fps__status_set(st, FPS_CODE_DATA_LOSS, (int)m->block_shards[k],
                           "tensor '%s' block %zu (rows [%llu, %llu)) is missing: shard %u (%s) "
                           "does not hold it",
                           name, k, (unsigned long long)m->bounds[k],
                           (unsigned long long)m->bounds[k + 1], m->block_shards[k],
                           c->addrs[m->block_shards[k]]);
  fps_free(seen);
  if (rc) return rc;
  if (!(x->blocks = fps_malloc(nb * sizeof *x->blocks)))
    return fps__status_err(st, FPS_ENOMEM, -1, "out of memory");
  for (size_t k = 0; k < nb; k++)
    x->blocks[k] = (fps__block_t){.shard = (int)m->block_shards[k], .row_lo = m->bounds[k],
                                  .row_hi = m->bounds[k + 1]};
  x->n_blocks = nb;
  x->shard = x->blocks[0].shard;
  return 0;
}

int fps_client_discover(fps_client_t *c, size_t *n_found, fps_status_t *status) {
  stats_shard_t *sh;
  fps__tensor_list_t list = {0};
  disc_t *r = NULL;
  size_t total = 0;
  int rc;
  if (!c) return fps__status_err(status, FPS_EINVAL, -1, "client is NULL");
  if ((rc = stats_all(c, 1, 0, &sh, status))) return rc;
  for (size_t i = 0; i < c->n_shards; i++) total += sh[i].resp->n_tensors;
  list.t = fps_calloc(total ? total : 1, sizeof *list.t);
  r = fps_calloc(total ? total : 1, sizeof *r);
  if (!list.t || !r) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto fail;
  }
  size_t nr = 0;
  for (size_t i = 0; i < c->n_shards; i++) {
    const Factorps__V1__StatsResponse *resp = sh[i].resp;
    for (size_t j = 0; j < resp->n_tensors; j++) {
      const Factorps__V1__TensorStats *t = resp->tensors[j];
      if (!fps__name_valid(t->name) || t->n_shape > FPS_CLIENT_MAX_DIMS) {
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i,
                             "shard %zu reports a tensor with a bad name or shape", i);
        goto fail;
      }
      r[nr++] = (disc_t){t, (int)i};
    }
  }
  /* A name reported by several shards must be a split tensor's blocks. */
  qsort(r, nr, sizeof *r, disc_by_name);
  for (size_t a = 0, b; a < nr; a = b) {
    for (b = a + 1; b < nr && !strcmp(r[a].t->name, r[b].t->name);) b++;
    const Factorps__V1__TensorStats *t = r[a].t;
    fps__tensor_t *x = &list.t[list.n];
    char err[64];
    x->ndim = (uint32_t)t->n_shape;
    if (t->n_shape) memcpy(x->shape, t->shape, t->n_shape * sizeof *t->shape);
    x->numel = fps__shape_numel(x->ndim, x->shape, err, sizeof err);
    if (!x->numel) {
      rc = fps__status_set(status, FPS_CODE_DATA_LOSS, r[a].shard,
                           "shard %d reports tensor '%s' with a bad shape: %s", r[a].shard, t->name,
                           err);
      goto fail;
    }
    x->bytes = x->numel * 4;
    x->shard = r[a].shard;
    x->n_blocks = 1;
    if (!(x->name = fps_strdup(t->name))) {
      rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
      goto fail;
    }
    list.n++;
    if (is_block(t)) {
      if ((rc = disc_blocks(c, r + a, b - a, x, status))) goto fail;
    } else if (b - a > 1) {
      rc = fps__status_set(status, FPS_CODE_DATA_LOSS, r[a + 1].shard,
                           "tensor '%s' is held by shards %d and %d", t->name, r[a].shard,
                           r[a + 1].shard);
      goto fail;
    }
  }
  fps__tensor_list_sort(&list); /* already in name order; keeps the invariant */
  pthread_rwlock_wrlock(&c->lock);
  fps__tensor_list_free(&c->tensors);
  c->tensors = list;
  pthread_rwlock_unlock(&c->lock);
  if (n_found) *n_found = list.n;
  list = (fps__tensor_list_t){0};
  fps__status_ok(status);
  rc = 0;
fail:
  fps_free(r);
  fps__tensor_list_free(&list);
  free_shards(sh, c->n_shards);
  return rc;
}

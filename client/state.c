/* fps_client_get_state(): GetState on every shard that holds one of the
 * named tensors, in parallel. Each reply message is unpacked and its state
 * slices copied straight into the caller's arrays, bounds-checked against
 * what the tensor's shape allows; after an OK status every array must have
 * been covered exactly and every tensor have its TensorState, or the call
 * fails with DATA_LOSS. Read-only, so retried on UNAVAILABLE. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

enum { K_ROW, K_COL, K_VAR, K_MOM, K_N };

typedef struct st_item_s {
  const fps__tensor_t *t;
  size_t idx;                          /* caller index */
  uint64_t max[K_N];                   /* most elements a kind may have */
  uint64_t got[K_N];                   /* elements received */
  uint64_t want[K_N];                  /* elements the TensorState names */
  fps_tensor_state_t info;
  int have_info;
} st_item_t;

typedef struct st_job_s {
  float *const *arr[K_N];              /* the caller's row, col, var, mom */
} st_job_t;

typedef struct st_shard_s {
  fps__stream_t s;
  const st_job_t *job;
  st_item_t **items;                   /* this shard's, sorted by name */
  size_t n;
} st_shard_t;

static int by_name(const void *a, const void *b) {
  return strcmp((*(st_item_t *const *)a)->t->name, (*(st_item_t *const *)b)->t->name);
}

static st_item_t *find(const st_shard_t *sh, const char *name) {
  size_t lo = 0, hi = sh->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(name, sh->items[mid]->t->name);
    if (c == 0) return sh->items[mid];
    if (c < 0) hi = mid;
    else lo = mid + 1;
  }
  return NULL;
}

static int st_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  st_shard_t *sh = s->ctx;
  char **names = malloc((sh->n ? sh->n : 1) * sizeof *names);
  if (!names) return fps__stream_fail(s, FPS_CODE_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t i = 0; i < sh->n; i++) names[i] = sh->items[i]->t->name;
  Factorps__V1__GetStateRequest req = FACTORPS__V1__GET_STATE_REQUEST__INIT;
  req.n_names = sh->n;
  req.names = names;
  *out = fps__pack(&req);
  free(names);
  *last = 1;
  return 0;
}

static int st_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  st_shard_t *sh = s->ctx;
  Factorps__V1__GetStateResponse *m = factorps__v1__get_state_response__unpack(NULL, len, data);
  int rc = 0;
  if (!m) return fps__stream_fail(s, FPS_CODE_INTERNAL, "malformed GetStateResponse (%zu bytes)", len);
  for (size_t i = 0; i < m->n_slices && !rc; i++) {
    const Factorps__V1__StateSlice *sl = m->slices[i];
    st_item_t *it = sl->name ? find(sh, sl->name) : NULL;
    int k = (int)sl->kind - 1;
    if (!it) {
      rc = fps__stream_fail(s, FPS_CODE_INTERNAL, "reply carries state of tensor '%.256s', not asked for",
                            sl->name ? sl->name : "");
      break;
    }
    uint64_t cnt = sl->data.len / 4;
    if (k < 0 || k >= K_N || sl->data.len % 4 || sl->offset > it->max[k] || cnt > it->max[k] - sl->offset) {
      rc = fps__stream_fail(s, FPS_CODE_INTERNAL,
                            "tensor '%s': reply state slice (kind %d, [%llu, +%zu bytes)) outside what its "
                            "shape allows",
                            it->t->name, (int)sl->kind, (unsigned long long)sl->offset, sl->data.len);
      break;
    }
    float *const *arr = sh->job->arr[k];
    if (arr && arr[it->idx]) memcpy(arr[it->idx] + sl->offset, sl->data.data, sl->data.len);
    it->got[k] += cnt;
  }
  for (size_t i = 0; i < m->n_tensors && !rc; i++) {
    const Factorps__V1__TensorState *ts = m->tensors[i];
    st_item_t *it = ts->name ? find(sh, ts->name) : NULL;
    if (!it) {
      rc = fps__stream_fail(s, FPS_CODE_INTERNAL, "reply carries the state of tensor '%.256s', not asked for",
                            ts->name ? ts->name : "");
      break;
    }
    uint64_t n[K_N] = {ts->row_elements, ts->col_elements, ts->var_elements, ts->mom_elements};
    for (int k = 0; k < K_N; k++)
      if (n[k] > it->max[k] || (k != K_MOM && n[k] != it->max[k])) {
        rc = fps__stream_fail(s, FPS_CODE_FAILED_PRECONDITION,
                              "tensor '%s': the shard's state sizes (row %llu, col %llu, var %llu, mom %llu) do "
                              "not fit the client's shape",
                              it->t->name, (unsigned long long)n[0], (unsigned long long)n[1],
                              (unsigned long long)n[2], (unsigned long long)n[3]);
        break;
      }
    it->info = (fps_tensor_state_t){ts->version, ts->step, ts->rms, ts->lr, ts->weight_decay,
                                    n[K_ROW], n[K_COL], n[K_VAR], n[K_MOM]};
    memcpy(it->want, n, sizeof n);
    it->have_info = 1;
  }
  factorps__v1__get_state_response__free_unpacked(m, NULL);
  return rc;
}

static void st_reset(fps__stream_t *s) {
  st_shard_t *sh = s->ctx;
  for (size_t i = 0; i < sh->n; i++) {
    memset(sh->items[i]->got, 0, sizeof sh->items[i]->got);
    sh->items[i]->have_info = 0;
  }
}

static const fps__stream_ops_t st_ops = {st_next, st_reply, st_reset, NULL};

int fps_client_get_state(fps_client_t *c, const char *const *names, size_t n, fps_tensor_state_t *info,
                         float *const *row, float *const *col, float *const *var, float *const *mom,
                         fps_status_t *status) {
  if (!c || (n && !names)) return fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "NULL argument");
  st_job_t job = {{row, col, var, mom}};
  st_item_t *items = calloc(n ? n : 1, sizeof *items);
  st_item_t **sorted = calloc(n ? n : 1, sizeof *sorted);
  st_shard_t *sh = calloc(c->n_shards, sizeof *sh);
  fps__stream_t **streams = calloc(c->n_shards, sizeof *streams);
  int rc, locked = 0;
  if (!items || !sorted || !sh || !streams) {
    rc = fps__status_set(status, FPS_CODE_RESOURCE_EXHAUSTED, -1, "out of memory");
    goto done;
  }
  /* The read lock keeps the tensor list (and its names) alive. */
  pthread_rwlock_rdlock(&c->lock);
  locked = 1;
  for (size_t i = 0; i < n; i++) {
    if (!names[i]) {
      rc = fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "names[%zu] is NULL", i);
      goto done;
    }
    const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, names[i]);
    if (!t) {
      rc = fps__status_set(status, FPS_CODE_NOT_FOUND, -1, "tensor '%s' is not in this client's tensor list",
                           names[i]);
      goto done;
    }
    st_item_t *it = &items[i];
    it->t = t;
    it->idx = i;
    if (t->ndim >= 2) {
      uint64_t lead = t->numel / (t->shape[t->ndim - 2] * t->shape[t->ndim - 1]);
      it->max[K_ROW] = lead * t->shape[t->ndim - 2];
      it->max[K_COL] = lead * t->shape[t->ndim - 1];
    } else {
      it->max[K_VAR] = t->numel;
    }
    it->max[K_MOM] = t->numel;
    sorted[i] = it;
    sh[t->shard].n++;
  }
  qsort(sorted, n, sizeof *sorted, by_name);
  for (size_t i = 1; i < n; i++)
    if (sorted[i - 1]->t == sorted[i]->t) {
      rc = fps__status_set(status, FPS_CODE_INVALID_ARGUMENT, -1, "tensor '%s' is named twice",
                           sorted[i]->t->name);
      goto done;
    }
  /* Per shard, a run of `sorted` (stays sorted by name within it). */
  {
    st_item_t **base = sorted;
    st_item_t **by_shard = calloc(n ? n : 1, sizeof *by_shard);
    if (!by_shard) {
      rc = fps__status_set(status, FPS_CODE_RESOURCE_EXHAUSTED, -1, "out of memory");
      goto done;
    }
    size_t start = 0;
    for (size_t s = 0; s < c->n_shards; s++) {
      sh[s].items = by_shard + start;
      start += sh[s].n;
      sh[s].n = 0;
    }
    for (size_t i = 0; i < n; i++) {
      st_shard_t *x = &sh[base[i]->t->shard];
      x->items[x->n++] = base[i];
    }
    memcpy(sorted, by_shard, n * sizeof *sorted);
    free(by_shard);
    size_t start2 = 0;
    for (size_t s = 0; s < c->n_shards; s++) {
      sh[s].items = sorted + start2;
      start2 += sh[s].n;
    }
  }
  size_t ns = 0;
  for (size_t s = 0; s < c->n_shards; s++) {
    if (!sh[s].n) continue;
    sh[s].s.shard = (int)s;
    sh[s].s.ops = &st_ops;
    sh[s].s.ctx = &sh[s];
    sh[s].job = &job;
    streams[ns++] = &sh[s].s;
  }
  rc = fps__streams_run(c, FPS__METHOD_GETSTATE, streams, ns, FPS__RETRY_IDEMPOTENT, status);
  if (rc) goto done;
  for (size_t i = 0; i < n; i++) {
    st_item_t *it = &items[i];
    int short_kind = -1;
    for (int k = 0; k < K_N; k++)
      if (it->have_info && it->got[k] != it->want[k]) short_kind = k;
    if (!it->have_info || short_kind >= 0) {
      static const char *const kn[K_N] = {"row", "col", "var", "mom"};
      rc = fps__status_set(status, FPS_CODE_DATA_LOSS, it->t->shard,
                           "shard %d (%s): tensor '%s': %s", it->t->shard, c->addrs[it->t->shard], it->t->name,
                           !it->have_info ? "the reply had no TensorState" : kn[short_kind]);
      if (it->have_info && status)
        snprintf(status->message + strlen(status->message), sizeof status->message - strlen(status->message),
                 " state: %llu of %llu elements received", (unsigned long long)it->got[short_kind],
                 (unsigned long long)it->want[short_kind]);
      goto done;
    }
    if (info) info[i] = it->info;
  }
  fps__status_ok(status);
done:
  if (locked) pthread_rwlock_unlock(&c->lock);
  free(items);
  free(sorted);
  free(sh);
  free(streams);
  return rc;
}

/* fps_client_get_state(): GetState on every shard that holds one of the
 * named tensors, in parallel. Each reply message is unpacked and its state
 * slices copied straight into the caller's arrays, bounds-checked against
 * what the tensor's shape allows; after an OK status every array must have
 * been covered exactly and every tensor have its TensorState, or the call
 * fails with DATA_LOSS. Read-only, so retried on UNAVAILABLE.
 *
 * A split tensor is read from every block's shard and assembled
 * into the whole tensor's state: row statistics, variance and momentum at
 * the block's rows; the column statistics of a matrix that several blocks
 * touch are held by each of them, so every copy is checked to be
 * bit-identical (DATA_LOSS naming the matrix and the blocks otherwise).
 * The blocks must be at one version, step and RMS: a read that meets a
 * step applied on some blocks' shards and not yet on others is repeated. */
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

enum { K_ROW, K_COL, K_VAR, K_MOM, K_N };

/* One tensor, or one row block of a split tensor, on one shard. */
typedef struct st_item_s {
  const fps__tensor_t *t;
  size_t idx;                          /* caller index */
  int shard;
  uint32_t block;                      /* block index (0: whole) */
  uint64_t dst[K_N];                   /* where each kind goes in the caller's array */
  uint64_t mtx_lo;                     /* factored: the first matrix its rows touch */
  float *col;                          /* split and factored: its column state (owned) */
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
  const st_item_t *x = *(st_item_t *const *)a, *y = *(st_item_t *const *)b;
  int c = strcmp(x->t->name, y->t->name);
  if (c) return c;
  return x->block < y->block ? -1 : x->block > y->block;
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
  char **names = fps_malloc((sh->n ? sh->n : 1) * sizeof *names);
  if (!names) return fps__stream_fail(s, FPS_CODE_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t i = 0; i < sh->n; i++) names[i] = sh->items[i]->t->name;
  Factorps__V1__GetStateRequest req = FACTORPS__V1__GET_STATE_REQUEST__INIT;
  req.n_names = sh->n;
  req.names = names;
  *out = fps__pack(&req);
  fps_free(names);
  *last = 1;
  return 0;
}

static int st_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  st_shard_t *sh = s->ctx;
  int rc = 0, code;
  Factorps__V1__GetStateResponse *m = fps__unpack(&factorps__v1__get_state_response__descriptor, data, len, &code);
  if (!m) return fps__stream_fail(s, code, "%s GetStateResponse (%zu bytes)", fps__unpack_why(code), len);
  /* The sizes first: a client whose list names another shape is told
   * so (FAILED_PRECONDITION), not that a slice is out of bounds. */
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
    if (k == K_COL && it->col)
      memcpy(it->col + sl->offset, sl->data.data, sl->data.len); /* checked, then copied */
    else if (arr && arr[it->idx])
      memcpy(arr[it->idx] + it->dst[k] + sl->offset, sl->data.data, sl->data.len);
    it->got[k] += cnt;
  }
  factorps__v1__get_state_response__free_unpacked(m, &fps__pb_allocator);
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

static const char *const kind_name[K_N] = {"row", "col", "var", "mom"};

static void pause_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* "" or " block 1 (rows [4, 9))" for a split tensor's item. */
static const char *block_label(const st_item_t *it, char *buf, size_t len) {
  buf[0] = '\0';
  if (it->t->blocks)
    snprintf(buf, len, " block %u (rows [%llu, %llu))", it->block,
             (unsigned long long)it->t->blocks[it->block].row_lo,
             (unsigned long long)it->t->blocks[it->block].row_hi);
  return buf;
}

/* After an OK run: every item covered exactly, then each tensor's blocks
 * assembled (items[] holds every tensor's blocks together, in row order).
 * *torn: blocks at different versions (a step in progress: read again). */
static int assemble(fps_client_t *c, st_item_t *items, size_t n_items, const st_job_t *job,
                    fps_tensor_state_t *info, int *torn, fps_status_t *status) {
  char bl[64], bl2[64];
  *torn = 0;
  for (size_t i = 0; i < n_items; i++) {
    st_item_t *it = &items[i];
    int short_kind = -1;
    for (int k = 0; k < K_N; k++)
      if (it->have_info && it->got[k] != it->want[k]) short_kind = k;
    if (!it->have_info || short_kind >= 0) {
      int rc = fps__status_set(status, FPS_CODE_DATA_LOSS, it->shard, "shard %d (%s): tensor '%s'%s: %s",
                               it->shard, c->addrs[it->shard], it->t->name, block_label(it, bl, sizeof bl),
                               !it->have_info ? "the reply had no TensorState" : kind_name[short_kind]);
      if (it->have_info && status)
        snprintf(status->message + strlen(status->message), sizeof status->message - strlen(status->message),
                 " state: %llu of %llu elements received", (unsigned long long)it->got[short_kind],
                 (unsigned long long)it->want[short_kind]);
      return rc;
    }
  }
  for (size_t i = 0; i < n_items;) {
    const st_item_t *f = &items[i];
    const fps__tensor_t *t = f->t;
    const size_t nb = fps__block_count(t);
    fps_tensor_state_t whole = f->info;
    for (size_t b = 1; b < nb; b++) {
      const st_item_t *it = &items[i + b], *p = &items[i + b - 1];
      if (it->info.version != f->info.version) {
        *torn = 1;
        return fps__status_set(status, FPS_CODE_ABORTED, it->shard,
                               "tensor '%s': its row blocks kept reporting different versions (%llu:%s "
                               "on shard %d (%s); %llu:%s on shard %d (%s)) while a step was being "
                               "applied; read again",
                               t->name, (unsigned long long)f->info.version, block_label(f, bl, sizeof bl),
                               f->shard, c->addrs[f->shard], (unsigned long long)it->info.version,
                               block_label(it, bl2, sizeof bl2), it->shard, c->addrs[it->shard]);
      }
      if (it->info.step != f->info.step || it->info.rms != f->info.rms)
        return fps__status_set(status, FPS_CODE_DATA_LOSS, it->shard,
                               "tensor '%s': at version %llu its row blocks differ: step %llu, RMS %.9g "
                               "(%s on shard %d (%s)) and step %llu, RMS %.9g (%s on shard %d (%s)): "
                               "the blocks have diverged",
                               t->name, (unsigned long long)f->info.version,
                               (unsigned long long)f->info.step, f->info.rms, block_label(f, bl, sizeof bl) + 1,
                               f->shard, c->addrs[f->shard], (unsigned long long)it->info.step, it->info.rms,
                               block_label(it, bl2, sizeof bl2) + 1, it->shard, c->addrs[it->shard]);
      /* A matrix both blocks touch: the copies must be bit-identical. */
      if (it->col && p->col) {
        const uint64_t C = t->shape[t->ndim - 1];
        const uint64_t p_last = p->mtx_lo + p->want[K_COL] / C - 1;
        if (p_last == it->mtx_lo && memcmp(p->col + (p_last - p->mtx_lo) * C, it->col, C * 4) != 0)
          return fps__status_set(status, FPS_CODE_DATA_LOSS, it->shard,
                                 "tensor '%s': the column state of matrix %llu differs between%s on "
                                 "shard %d (%s) and%s on shard %d (%s): the blocks have diverged",
                                 t->name, (unsigned long long)it->mtx_lo, block_label(p, bl, sizeof bl),
                                 p->shard, c->addrs[p->shard], block_label(it, bl2, sizeof bl2),
                                 it->shard, c->addrs[it->shard]);
      }
      whole.mom_elements += it->info.mom_elements;
    }
    /* The whole tensor's sizes, and its column state from the blocks. */
    if (nb > 1) {
      whole.row_elements = t->ndim >= 2 ? t->numel / t->shape[t->ndim - 1] : 0;
      whole.col_elements = t->ndim >= 2 ? t->numel / t->shape[t->ndim - 2] : 0;
      whole.var_elements = t->ndim >= 2 ? 0 : t->numel;
      float *const *col = job->arr[K_COL];
      if (col && col[f->idx])
        for (size_t b = 0; b < nb; b++) {
          const st_item_t *it = &items[i + b];
          if (it->col) memcpy(col[f->idx] + it->dst[K_COL], it->col, it->want[K_COL] * 4);
        }
    }
    if (info) info[f->idx] = whole;
    i += nb;
  }
  return 0;
}

/* Reads of a split tensor caught at different versions, and the pause
 * before the first repeat (doubling). */
#define TORN_ATTEMPTS 8
#define TORN_PAUSE 0.005

int fps_client_get_state(fps_client_t *c, const char *const *names, size_t n, fps_tensor_state_t *info,
                         float *const *row, float *const *col, float *const *var, float *const *mom,
                         fps_status_t *status) {
  if (!c || (n && !names)) return fps__status_err(status, FPS_EINVAL, -1, "NULL argument");
  st_job_t job = {{row, col, var, mom}};
  st_item_t *items = NULL;
  st_item_t **sorted = NULL;
  st_shard_t *sh = fps_calloc(c->n_shards, sizeof *sh);
  fps__stream_t **streams = fps_calloc(c->n_shards, sizeof *streams);
  size_t total = 0;
  int rc, locked = 0;
  if (!sh || !streams) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto done;
  }
  /* The read lock keeps the tensor list (and its names) alive. */
  pthread_rwlock_rdlock(&c->lock);
  locked = 1;
  for (size_t i = 0; i < n; i++) {
    if (!names[i]) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "names[%zu] is NULL", i);
      goto done;
    }
    const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, names[i]);
    if (!t) {
      rc = fps__status_err(status, FPS_ENOTFOUND, -1, "tensor '%s' is not in this client's tensor list",
                           names[i]);
      goto done;
    }
    total += fps__block_count(t);
  }
  items = fps_calloc(total ? total : 1, sizeof *items);
  sorted = fps_calloc(total ? total : 1, sizeof *sorted);
  if (!items || !sorted) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto done;
  }
  /* One item per tensor, or per row block of a split one, with the part of
   * each state array it holds (block-local on the shard). */
  for (size_t i = 0, k = 0; i < n; i++) {
    const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, names[i]);
    const uint64_t C = fps__row_elems(t), R = t->ndim >= 2 ? t->shape[t->ndim - 2] : 1;
    for (size_t b = 0; b < fps__block_count(t); b++, k++) {
      const fps__block_t blk = fps__block_at(t, b);
      const uint64_t lo = blk.row_lo, hi = blk.row_hi;
      st_item_t *it = &items[k];
      it->t = t;
      it->idx = i;
      it->shard = blk.shard;
      it->block = (uint32_t)b;
      if (t->ndim >= 2) {
        it->mtx_lo = lo / R;
        it->max[K_ROW] = hi - lo;
        it->max[K_COL] = ((hi - 1) / R + 1 - it->mtx_lo) * C;
        it->dst[K_ROW] = lo;
        it->dst[K_COL] = it->mtx_lo * C;
        if (t->blocks && !(it->col = fps_malloc(it->max[K_COL] * 4))) {
          rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
          goto done;
        }
      } else {
        it->max[K_VAR] = hi - lo;
        it->dst[K_VAR] = lo;
      }
      it->max[K_MOM] = (hi - lo) * C;
      it->dst[K_MOM] = lo * C;
      sorted[k] = it;
      sh[blk.shard].n++;
    }
  }
  qsort(sorted, total, sizeof *sorted, by_name);
  for (size_t i = 1; i < total; i++)
    if (sorted[i - 1]->t == sorted[i]->t && sorted[i - 1]->block == sorted[i]->block) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s' is named twice",
                           sorted[i]->t->name);
      goto done;
    }
  /* Per shard, a run of `sorted` (stays sorted by name within it: a shard
   * holds at most one block of a tensor). */
  {
    st_item_t **by_shard = fps_calloc(total ? total : 1, sizeof *by_shard);
    if (!by_shard) {
      rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
      goto done;
    }
    size_t start = 0;
    for (size_t s = 0; s < c->n_shards; s++) {
      sh[s].items = by_shard + start;
      start += sh[s].n;
      sh[s].n = 0;
    }
    for (size_t i = 0; i < total; i++) {
      st_shard_t *x = &sh[sorted[i]->shard];
      x->items[x->n++] = sorted[i];
    }
    memcpy(sorted, by_shard, total * sizeof *sorted);
    fps_free(by_shard);
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
  double pause = TORN_PAUSE;
  for (int attempt = 1;; attempt++) {
    int torn = 0;
    rc = fps__streams_run(c, FPS__METHOD_GETSTATE, streams, ns, FPS__RETRY_IDEMPOTENT, status);
    if (rc) goto done;
    rc = assemble(c, items, total, &job, info, &torn, status);
    if (!torn || attempt == TORN_ATTEMPTS) break;
    pause_s(pause);
    pause *= 2;
    for (size_t s = 0; s < ns; s++) st_reset(streams[s]);
  }
  if (rc) goto done;
  fps__status_ok(status);
done:
  if (locked) pthread_rwlock_unlock(&c->lock);
  if (items)
    for (size_t i = 0; i < total; i++) fps_free(items[i].col);
  fps_free(items);
  fps_free(sorted);
  fps_free(sh);
  fps_free(streams);
  return rc;
}

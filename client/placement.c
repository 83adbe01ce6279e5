/* The tensor list and the placement of tensors on shards.
 *
 * Every worker must compute the same map from the same tensor list without
 * talking to the others, so the algorithm depends only on the set of
 * (name, bytes) pairs: sort by bytes descending, then name ascending
 * (strcmp, i.e. bytewise, so locale never matters); assign each tensor in
 * that order to the shard with the fewest bytes so far, ties to the lowest
 * index. This is the LPT greedy for makespan: the heaviest shard exceeds the
 * lightest by at most the largest tensor, and within 4/3 of the optimum.
 *
 * Row splitting (fps__placement_split): the same LPT for tensors
 * below split_min_bytes, then each larger tensor is water-filled onto the
 * lightest shards in row blocks, so one huge tensor (an embedding) no longer
 * decides the heaviest shard. */
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "internal.h"
#include "name.h"

/* Same bound as the server's kernel (common/adafactor.h FPS_MAX_NUMEL). */
#define FPS__MAX_NUMEL (UINT64_C(1) << 40)

int fps__name_valid(const char *name) {
  if (!name) return 0;
  char why[256];
  /* The shard's rule (common/name.h): UTF-8 without control characters. */
  return fps_name_check(name, strnlen(name, FPS_CLIENT_NAME_MAX + 1), why, sizeof why) == 0;
}

uint64_t fps__shape_numel(uint32_t ndim, const uint64_t *shape, char *err, size_t errlen) {
  uint64_t numel = 1;
  if (ndim > FPS_CLIENT_MAX_DIMS) {
    snprintf(err, errlen, "%u dims, at most %d allowed", ndim, FPS_CLIENT_MAX_DIMS);
    return 0;
  }
  for (uint32_t d = 0; d < ndim; d++) {
    if (shape[d] == 0) {
      snprintf(err, errlen, "dim %u is 0", d);
      return 0;
    }
    if (shape[d] > FPS__MAX_NUMEL || numel > FPS__MAX_NUMEL / shape[d]) {
      snprintf(err, errlen, "more than 2^40 elements");
      return 0;
    }
    numel *= shape[d];
  }
  return numel;
}

static int by_bytes_then_name(const void *a, const void *b) {
  const fps__tensor_t *x = *(fps__tensor_t *const *)a, *y = *(fps__tensor_t *const *)b;
  if (x->bytes != y->bytes) return x->bytes > y->bytes ? -1 : 1;
  return strcmp(x->name, y->name);
}

int fps__placement_compute(fps__tensor_t *t, size_t n, size_t n_shards, uint64_t *load_out) {
  fps__tensor_t **order = NULL;
  uint64_t *load = NULL;
  int rc = FPS_ENOMEM;

  order = fps_malloc((n ? n : 1) * sizeof *order);
  load = fps_calloc(n_shards, sizeof *load);
  if (!order || !load) goto fail;
  for (size_t i = 0; i < n; i++) order[i] = &t[i];
  qsort(order, n, sizeof *order, by_bytes_then_name);
  for (size_t i = 0; i < n; i++) {
    /* Linear scan: shard counts are small, and a heap would need the same
     * lowest-index tie-break spelled out anyway. */
    size_t best = 0;
    for (size_t s = 1; s < n_shards; s++)
      if (load[s] < load[best]) best = s;
    order[i]->shard = (int)best;
    load[best] += order[i]->bytes;
  }
  if (load_out) memcpy(load_out, load, n_shards * sizeof *load);
  rc = 0;
fail:
  fps_free(order);
  fps_free(load);
  return rc;
}

static int by_name(const void *a, const void *b) {
  return strcmp(((const fps__tensor_t *)a)->name, ((const fps__tensor_t *)b)->name);
}

long fps__tensor_list_sort(fps__tensor_list_t *l) {
  if (l->n == 0) return -1;
  qsort(l->t, l->n, sizeof *l->t, by_name);
  for (size_t i = 1; i < l->n; i++)
    if (!strcmp(l->t[i - 1].name, l->t[i].name)) return (long)i;
  return -1;
}

const fps__tensor_t *fps__tensor_list_find(const fps__tensor_list_t *l, const char *name) {
  size_t lo = 0, hi = l->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int cmp = strcmp(name, l->t[mid].name);
    if (cmp == 0) return &l->t[mid];
    if (cmp < 0)
      hi = mid;
    else
      lo = mid + 1;
  }
  return NULL;
}

void fps__tensor_list_free(fps__tensor_list_t *l) {
  for (size_t i = 0; i < l->n; i++) {
    fps_free(l->t[i].name);
    fps_free(l->t[i].blocks);
  }
  fps_free(l->t);
  l->t = NULL;
  l->n = 0;
}

/* ---- row-split placement ------------------------------------------------ */

/* Rows a tensor is cut along: the flattened rows of its [..., R, C] view
 * (numel / C) for ndim >= 2, else its elements. */
static uint64_t split_rows(const fps__tensor_t *t) {
  return t->ndim >= 2 ? t->numel / t->shape[t->ndim - 1] : t->numel;
}

typedef struct shard_load_s {
  uint64_t load;
  size_t shard;
} shard_load_t;

static int by_load_then_index(const void *a, const void *b) {
  const shard_load_t *x = a, *y = b;
  if (x->load != y->load) return x->load < y->load ? -1 : 1;
  return x->shard < y->shard ? -1 : x->shard > y->shard;
}

/* Water-fills one tensor of `rows` rows of `row_bytes` bytes onto `load`
 * (updated): finds the level L with sum_s max(0, L - load_s) = bytes over
 * the min(rows, S) least-loaded shards (ties to the lower index), gives
 * shard s about max(0, L - load_s) bytes rounded to whole rows, blocks in
 * shard-index order along the rows. Exact integer arithmetic (128-bit), so
 * every machine cuts the same rows. Writes the blocks (at most S) to out. */
__extension__ typedef unsigned __int128 u128;

static size_t water_fill(uint64_t rows, uint64_t row_bytes, uint64_t *load, size_t S,
                         shard_load_t *order, u128 *tk, fps__block_t *out) {
  const uint64_t bytes = rows * row_bytes;
  for (size_t s = 0; s < S; s++) order[s] = (shard_load_t){load[s], s};
  qsort(order, S, sizeof *order, by_load_then_index);
  size_t cand = S < rows ? S : (size_t)rows;
  /* The k lowest shards are filled: k*L = bytes + sum of their loads, and
   * L must not pass the next shard's load. */
  size_t k = 1;
  u128 sum = order[0].load;
  for (; k < cand; k++) {
    if ((u128)bytes + sum <= (u128)k * order[k].load) break;
    sum += order[k].load;
  }
  /* t_s * k = bytes + sum - k*load_s, for the k filled shards; others 0. */
  memset(tk, 0, S * sizeof *tk);
  u128 total = 0;
  for (size_t i = 0; i < k; i++) {
    u128 v = (u128)bytes + sum - (u128)k * order[i].load;
    tk[order[i].shard] = v;
    total += v; /* = k * bytes */
  }
  /* Boundaries at the rounded cumulative targets (rounding does not
   * accumulate; the remainder lands in the last block), then at least one
   * row per nonempty block. */
  size_t nb = 0, nonempty = 0;
  for (size_t s = 0; s < S; s++) nonempty += tk[s] != 0;
  u128 cum = 0;
  uint64_t prev = 0;
  for (size_t s = 0; s < S; s++) {
    if (!tk[s]) continue;
    cum += tk[s];
    uint64_t hi = (uint64_t)(((u128)rows * cum + total / 2) / total);
    size_t left = nonempty - nb - 1; /* nonempty blocks after this one */
    if (hi < prev + 1) hi = prev + 1;
    if (hi > rows - left) hi = rows - left;
    if (left == 0) hi = rows;
    out[nb++] = (fps__block_t){.shard = (int)s, .row_lo = prev, .row_hi = hi};
    load[s] += (hi - prev) * row_bytes;
    prev = hi;
  }
  return nb;
}

int fps__placement_split(fps__tensor_t *t, size_t n, size_t n_shards, uint64_t split_min_bytes,
                         fps__block_t *blocks, size_t *first, uint64_t *load_out) {
  fps__tensor_t **order = NULL;
  uint64_t *load = NULL;
  shard_load_t *sl = NULL;
  fps__block_t *tmp = NULL;
  size_t *slot = NULL;
  u128 *tk = NULL;
  int rc = FPS_ENOMEM;
  if (n_shards == 0 || n_shards > FPS__SPLIT_MAX_SHARDS) return FPS_EINVAL;
  const bool splitting = split_min_bytes > 0;
  size_t nbig = 0;
  for (size_t i = 0; i < n; i++) nbig += splitting && t[i].bytes >= split_min_bytes;

  order = fps_malloc((n ? n : 1) * sizeof *order);
  load = fps_calloc(n_shards, sizeof *load);
  sl = fps_malloc(n_shards * sizeof *sl);
  tk = fps_malloc(n_shards * sizeof *tk);
  slot = fps_malloc((n ? n : 1) * sizeof *slot);
  tmp = fps_malloc((nbig ? nbig : 1) * n_shards * sizeof *tmp); /* each big tensor's blocks */
  if (!order || !load || !sl || !tk || !slot || !tmp) goto fail;
  for (size_t i = 0, b = 0; i < n; i++)
    slot[i] = splitting && t[i].bytes >= split_min_bytes ? b++ : 0;
  for (size_t i = 0; i < n; i++) order[i] = &t[i];
  qsort(order, n, sizeof *order, by_bytes_then_name);
  /* Whole tensors first, by the LPT rule of fps__placement_compute. */
  for (size_t i = 0; i < n; i++) {
    fps__tensor_t *x = order[i];
    if (splitting && x->bytes >= split_min_bytes) continue;
    size_t best = 0;
    for (size_t s = 1; s < n_shards; s++)
      if (load[s] < load[best]) best = s;
    x->shard = (int)best;
    x->n_blocks = 1;
    load[best] += x->bytes;
  }
  /* Then the large ones, each water-filled onto the loads so far. */
  for (size_t i = 0; i < n && splitting; i++) {
    fps__tensor_t *x = order[i];
    if (x->bytes < split_min_bytes) continue;
    const uint64_t rows = split_rows(x);
    fps__block_t *b = tmp + slot[x - t] * n_shards;
    x->n_blocks = water_fill(rows, x->bytes / rows, load, n_shards, sl, tk, b);
    x->shard = b[0].shard;
  }
  /* Blocks in the tensors' own order. */
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    first[i] = at;
    if (splitting && t[i].bytes >= split_min_bytes) {
      memcpy(blocks + at, tmp + slot[i] * n_shards, t[i].n_blocks * sizeof *blocks);
    } else {
      blocks[at] = (fps__block_t){.shard = t[i].shard, .row_lo = 0, .row_hi = split_rows(&t[i])};
    }
    at += t[i].n_blocks;
  }
  first[n] = at;
  if (load_out) memcpy(load_out, load, n_shards * sizeof *load);
  rc = 0;
fail:
  fps_free(order);
  fps_free(load);
  fps_free(sl);
  fps_free(tk);
  fps_free(slot);
  fps_free(tmp);
  return rc;
}

static int by_name_ptr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int fps_client_placement_plan(const fps_tensor_def_t *defs, size_t n, size_t n_shards,
                              uint64_t split_min_bytes, fps_block_t *blocks, size_t cap,
                              size_t *n_blocks, uint64_t *shard_bytes, fps_status_t *status) {
  fps__tensor_t *t = NULL;
  fps__block_t *b = NULL;
  size_t *first = NULL;
  const char **names = NULL;
  char err[256];
  int rc;
  if (n_blocks) *n_blocks = 0;
  if (n_shards == 0 || n_shards > FPS__SPLIT_MAX_SHARDS)
    return fps__status_err(status, FPS_EINVAL, -1,
                           "need 1..%d shards, got %zu", FPS__SPLIT_MAX_SHARDS, n_shards);
  if ((!defs && n) || (!blocks && cap))
    return fps__status_err(status, FPS_EINVAL, -1, "defs or blocks is NULL");
  t = fps_calloc(n ? n : 1, sizeof *t);
  first = fps_malloc((n + 1) * sizeof *first);
  names = fps_malloc((n ? n : 1) * sizeof *names);
  if (!t || !first || !names) goto nomem;
  size_t nbig = 0;
  for (size_t i = 0; i < n; i++) {
    const fps_tensor_def_t *d = &defs[i];
    if (!fps__name_valid(d->name)) {
      rc = fps__status_err(status, FPS_EINVAL, -1,
                           "tensor %zu: name must be 1..%d bytes of UTF-8 without control "
                           "characters",
                           i, FPS_CLIENT_NAME_MAX);
      goto fail;
    }
    uint64_t numel = fps__shape_numel(d->ndim, d->shape, err, sizeof err);
    if (!numel) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s': bad shape: %s",
                           d->name, err);
      goto fail;
    }
    t[i].name = (char *)d->name; /* read only; never freed here */
    t[i].ndim = d->ndim;
    memcpy(t[i].shape, d->shape, d->ndim * sizeof *d->shape);
    t[i].numel = numel;
    t[i].bytes = numel * 4;
    names[i] = d->name;
    nbig += split_min_bytes && t[i].bytes >= split_min_bytes;
  }
  qsort(names, n, sizeof *names, by_name_ptr);
  for (size_t i = 1; i < n; i++)
    if (!strcmp(names[i - 1], names[i])) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s' is listed twice",
                           names[i]);
      goto fail;
    }
  b = fps_malloc((n + nbig * (n_shards - 1) + 1) * sizeof *b);
  if (!b) goto nomem;
  if (fps__placement_split(t, n, n_shards, split_min_bytes, b, first, shard_bytes)) goto nomem;
  if (n_blocks) *n_blocks = first[n];
  if (first[n] > cap) {
    rc = fps__status_set(status, FPS_CODE_OUT_OF_RANGE, -1,
                         "the plan has %zu blocks, room for %zu given", first[n], cap);
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    const uint64_t cols = t[i].ndim >= 2 ? t[i].shape[t[i].ndim - 1] : 1;
    for (size_t k = first[i]; k < first[i + 1]; k++)
      blocks[k] = (fps_block_t){.tensor = i, .shard = b[k].shard, .row_lo = b[k].row_lo,
                                .row_hi = b[k].row_hi,
                                .bytes = (b[k].row_hi - b[k].row_lo) * cols * 4};
  }
  fps__status_ok(status);
  rc = 0;
  goto done;
nomem:
  rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
fail:
  if (shard_bytes && rc) memset(shard_bytes, 0, n_shards * sizeof *shard_bytes);
done:
  fps_free(t);
  fps_free(b);
  fps_free(first);
  fps_free(names);
  return rc;
}

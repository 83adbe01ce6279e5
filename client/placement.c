/* The tensor list and the placement of tensors on shards.
 *
 * Every worker must compute the same map from the same tensor list without
 * talking to the others, so the algorithm depends only on the set of
 * (name, bytes) pairs: sort by bytes descending, then name ascending
 * (strcmp, i.e. bytewise, so locale never matters); assign each tensor in
 * that order to the shard with the fewest bytes so far, ties to the lowest
 * index. This is the LPT greedy for makespan: the heaviest shard exceeds the
 * lightest by at most the largest tensor, and within 4/3 of the optimum. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

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

  order = malloc((n ? n : 1) * sizeof *order);
  load = calloc(n_shards, sizeof *load);
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
  free(order);
  free(load);
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
  for (size_t i = 0; i < l->n; i++) free(l->t[i].name);
  free(l->t);
  l->t = NULL;
  l->n = 0;
}

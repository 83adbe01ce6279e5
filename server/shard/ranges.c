/* Sorted interval sets: which elements of a tensor a series of slices has
 * covered. Slices usually arrive in order, so the common insert appends to
 * (or extends) the last interval in O(1); out-of-order inserts binary-search
 * and shift. */
#include <stdlib.h>
#include <string.h>

#include "shard.h"

/* Index of the first interval whose hi > lo. */
static size_t fps__ranges_lower(const fps_ranges_t *r, uint64_t lo) {
  size_t a = 0, b = r->n;
  while (a < b) {
    size_t m = a + (b - a) / 2;
    if (r->v[m].hi <= lo) a = m + 1;
    else b = m;
  }
  return a;
}

int fps_ranges_add(fps_ranges_t *r, uint64_t lo, uint64_t hi) {
  if (hi <= lo) return 0;
  size_t i = fps__ranges_lower(r, lo);
  if (i < r->n && r->v[i].lo < hi) return FPS_EEXISTS;
  /* Merge with the left neighbour (ends at lo) and/or the right (starts at hi). */
  bool left = i > 0 && r->v[i - 1].hi == lo;
  bool right = i < r->n && r->v[i].lo == hi;
  if (left && right) {
    r->v[i - 1].hi = r->v[i].hi;
    memmove(&r->v[i], &r->v[i + 1], (r->n - i - 1) * sizeof r->v[0]);
    r->n--;
  } else if (left) {
    r->v[i - 1].hi = hi;
  } else if (right) {
    r->v[i].lo = lo;
  } else {
    if (r->n == r->cap) {
      size_t cap = r->cap ? r->cap * 2 : 8;
      fps_range_t *v = realloc(r->v, cap * sizeof *v);
      if (!v) return FPS_ENOMEM;
      r->v = v;
      r->cap = cap;
    }
    memmove(&r->v[i + 1], &r->v[i], (r->n - i) * sizeof r->v[0]);
    r->v[i].lo = lo;
    r->v[i].hi = hi;
    r->n++;
  }
  r->covered += hi - lo;
  return 0;
}

uint64_t fps_ranges_first_gap(const fps_ranges_t *r, uint64_t total) {
  if (r->n == 0 || r->v[0].lo > 0) return 0;
  return r->v[0].hi < total ? r->v[0].hi : total;
}

int fps_ranges_copy(fps_ranges_t *dst, const fps_ranges_t *src) {
  memset(dst, 0, sizeof *dst);
  if (src->n == 0) return 0;
  dst->v = malloc(src->n * sizeof *dst->v);
  if (!dst->v) return FPS_ENOMEM;
  memcpy(dst->v, src->v, src->n * sizeof *dst->v);
  dst->n = dst->cap = src->n;
  dst->covered = src->covered;
  return 0;
}

void fps_ranges_free(fps_ranges_t *r) {
  if (!r) return;
  free(r->v);
  memset(r, 0, sizeof *r);
}

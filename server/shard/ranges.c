/* Sorted interval sets: which elements of a tensor a series of slices has
 * covered, kept as maximal disjoint intervals in a treap (a binary search
 * tree by lo, heap-ordered by random priorities), so each insert costs
 * O(log n) expected whatever order the slices arrive in: a request of n
 * slices is O(n log n), never O(n^2) (an attacker sending one-element
 * slices in reverse used to make each insert shift the whole array).
 * Adjacent intervals merge, so slices sent in order stay one interval.
 * Nodes live in one pool indexed from 1; 0 means none. */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "alloc.h"
#include "internal.h"

#define NIL 0u

static uint64_t fps__ranges_seed;

/* Priorities: a keyed mix of a counter, so their order cannot be chosen
 * by whoever picks the slice order. */
static uint32_t fps__ranges_prio(void) {
  static _Atomic uint64_t ctr;
  uint64_t seed = __atomic_load_n(&fps__ranges_seed, __ATOMIC_RELAXED);
  if (!seed) {
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) != (ssize_t)sizeof s) s = (uint64_t)(uintptr_t)&ctr ^ 0x9E3779B97F4A7C15u;
    s |= 1;
    uint64_t z = 0;
    __atomic_compare_exchange_n(&fps__ranges_seed, &z, s, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    seed = __atomic_load_n(&fps__ranges_seed, __ATOMIC_RELAXED);
  }
  uint64_t x = (ctr++ + 1) * seed;
  x ^= x >> 31;
  x *= UINT64_C(0xBF58476D1CE4E5B9);
  x ^= x >> 29;
  return (uint32_t)x;
}

static uint32_t fps__ranges_node(fps_ranges_t *r, uint64_t lo, uint64_t hi) {
  uint32_t i;
  if (r->free) {
    i = r->free;
    r->free = r->v[i].left;
  } else {
    if ((size_t)r->used + 1 >= r->cap) {
      size_t cap = r->cap ? r->cap * 2 : 16;
      if (cap > UINT32_MAX) return NIL;
      fps_range_node_t *v = fps_realloc(r->v, cap * sizeof *v);
      if (!v) return NIL;
      r->v = v;
      r->cap = cap;
    }
    i = ++r->used;
  }
  r->v[i] = (fps_range_node_t){lo, hi, NIL, NIL, fps__ranges_prio()};
  return i;
}

/* Inserts node x into the subtree at *t (by lo, keys distinct). */
static void fps__ranges_insert(fps_range_node_t *v, uint32_t *t, uint32_t x) {
  if (*t == NIL) {
    *t = x;
    return;
  }
  uint32_t y = *t;
  if (v[x].lo < v[y].lo) {
    fps__ranges_insert(v, &v[y].left, x);
    if (v[v[y].left].prio > v[y].prio) { /* rotate right */
      uint32_t l = v[y].left;
      v[y].left = v[l].right;
      v[l].right = y;
      *t = l;
    }
  } else {
    fps__ranges_insert(v, &v[y].right, x);
    if (v[v[y].right].prio > v[y].prio) { /* rotate left */
      uint32_t rr = v[y].right;
      v[y].right = v[rr].left;
      v[rr].left = y;
      *t = rr;
    }
  }
}

/* Removes node x (found by its lo) from the subtree at *t. */
static void fps__ranges_remove(fps_range_node_t *v, uint32_t *t, uint32_t x) {
  while (*t != x) t = v[x].lo < v[*t].lo ? &v[*t].left : &v[*t].right;
  /* Rotate x down until it has at most one child, then splice it out. */
  for (;;) {
    uint32_t l = v[x].left, rr = v[x].right;
    if (l == NIL) {
      *t = rr;
      return;
    }
    if (rr == NIL) {
      *t = l;
      return;
    }
    if (v[l].prio > v[rr].prio) {
      v[x].left = v[l].right;
      v[l].right = x;
      *t = l;
      t = &v[l].right;
    } else {
      v[x].right = v[rr].left;
      v[rr].left = x;
      *t = rr;
      t = &v[rr].left;
    }
  }
}

int fps_ranges_add(fps_ranges_t *r, uint64_t lo, uint64_t hi) {
  if (hi <= lo) return 0;
  /* pred: the interval with the largest lo < hi; succ: the smallest lo >= hi. */
  uint32_t pred = NIL, succ = NIL;
  for (uint32_t t = r->root; t != NIL;) {
    if (r->v[t].lo < hi) {
      pred = t;
      t = r->v[t].right;
    } else {
      succ = t;
      t = r->v[t].left;
    }
  }
  /* Intervals are disjoint and sorted, so only pred can overlap. */
  if (pred != NIL && r->v[pred].hi > lo) return FPS_EEXISTS;
  bool left = pred != NIL && r->v[pred].hi == lo;
  bool right = succ != NIL && r->v[succ].lo == hi;
  if (left && right) {
    r->v[pred].hi = r->v[succ].hi;
    fps__ranges_remove(r->v, &r->root, succ);
    r->v[succ].left = r->free;
    r->free = succ;
    r->n--;
  } else if (left) {
    r->v[pred].hi = hi;
  } else if (right) {
    r->v[succ].lo = lo; /* still above pred, below everything after: order holds */
  } else {
    uint32_t x = fps__ranges_node(r, lo, hi);
    if (x == NIL) return FPS_ENOMEM;
    fps__ranges_insert(r->v, &r->root, x);
    r->n++;
  }
  r->covered += hi - lo;
  return 0;
}

uint64_t fps_ranges_first_gap(const fps_ranges_t *r, uint64_t total) {
  uint32_t t = r->root;
  if (t == NIL) return 0;
  while (r->v[t].left != NIL) t = r->v[t].left;
  if (r->v[t].lo > 0) return 0;
  return r->v[t].hi < total ? r->v[t].hi : total;
}

int fps_ranges_copy(fps_ranges_t *dst, const fps_ranges_t *src) {
  memset(dst, 0, sizeof *dst);
  if (src->n == 0) return 0;
  dst->v = fps_malloc(src->cap * sizeof *dst->v);
  if (!dst->v) return FPS_ENOMEM;
  memcpy(dst->v, src->v, ((size_t)src->used + 1) * sizeof *dst->v);
  dst->n = src->n;
  dst->cap = src->cap;
  dst->root = src->root;
  dst->free = src->free;
  dst->used = src->used;
  dst->covered = src->covered;
  return 0;
}

void fps_ranges_free(fps_ranges_t *r) {
  if (!r) return;
  fps_free(r->v);
  memset(r, 0, sizeof *r);
}

int fps_ranges_reserve(fps_ranges_t *r) {
  if (r->free != NIL) return 0;
  uint32_t x = fps__ranges_node(r, 0, 0);
  if (x == NIL) return FPS_ENOMEM;
  r->v[x].left = r->free;
  r->free = x;
  return 0;
}

bool fps_ranges_find(const fps_ranges_t *r, uint64_t x, fps_range_t *out) {
  uint32_t best = NIL;
  for (uint32_t t = r->root; t != NIL;) {
    if (r->v[t].lo <= x) {
      best = t;
      t = r->v[t].right;
    } else {
      t = r->v[t].left;
    }
  }
  if (best == NIL || r->v[best].hi <= x) return false;
  out->lo = r->v[best].lo;
  out->hi = r->v[best].hi;
  return true;
}

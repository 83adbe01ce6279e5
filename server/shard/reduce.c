/* The running sum of a sync round: see internal.h (reduce.c) for the rule (worker w sums
 * [lo, hi) once done[w-1] covers it) and why it gives the bits of a sum in
 * worker-id order.
 *
 * Memory per tensor while a round is streamed: one accumulator of numel
 * floats, plus the pieces that arrived ahead of the workers below them.
 * Such a piece is a reference to the message it came in (fps_slice_owner_t:
 * the message's bytes count once against max_staging_bytes while any of
 * its pieces is staged), so each received gradient byte is read once, when
 * it is checked, converted and summed; only a slice whose bytes do not
 * outlive the call (no owner) is staged as a converted copy. When the
 * workers stream in step, little is staged; in the worst case (the higher
 * workers finish before worker 0 starts) it is every gradient as received.
 *
 * Staged pieces of one push are a treap by lo, so finding the ones a new
 * range of done[w-1] made ready costs O(log n + k) whatever the order and
 * size of the slices. */
#include "internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "alloc.h"
#include "simd/kernels.h"

/* Floats checked per step by a retry that only checks (its values are not
 * kept): decoded into this stack buffer, which stays in L1. */
#define FPS_REDUCE_CHUNK 2048

/* ------------------------------------------------------------- pieces */

/* Random priorities, keyed once per process, so no slice order can
 * unbalance the treap. */
static uint32_t fps__piece_prio(void) {
  static _Atomic uint64_t ctr;
  static _Atomic uint64_t seed;
  uint64_t k = seed;
  if (!k) {
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) != (ssize_t)sizeof s) s = (uint64_t)(uintptr_t)&ctr;
    s |= 1;
    uint64_t z = 0;
    /* C11's own call: clang refuses the __atomic builtins on _Atomic. */
    atomic_compare_exchange_strong_explicit(&seed, &z, s, memory_order_relaxed, memory_order_relaxed);
    k = seed;
  }
  uint64_t x = (ctr++ + 1) * k;
  x ^= x >> 31;
  x *= UINT64_C(0xBF58476D1CE4E5B9);
  x ^= x >> 29;
  return (uint32_t)x;
}

/* l: the pieces of t with lo < key; r: the others. */
static void fps__piece_split(fps_piece_t *t, uint64_t key, fps_piece_t **l, fps_piece_t **r) {
  if (!t) {
    *l = *r = NULL;
  } else if (t->lo < key) {
    fps__piece_split(t->right, key, &t->right, r);
    *l = t;
  } else {
    fps__piece_split(t->left, key, l, &t->left);
    *r = t;
  }
}

/* Every piece of l lies before every piece of r. */
static fps_piece_t *fps__piece_merge(fps_piece_t *l, fps_piece_t *r) {
  if (!l) return r;
  if (!r) return l;
  if (l->prio > r->prio) {
    l->right = fps__piece_merge(l->right, r);
    return l;
  }
  r->left = fps__piece_merge(l, r->left);
  return r;
}

static void fps__piece_insert(fps_piece_t **root, fps_piece_t *x) {
  fps_piece_t *a, *b;
  x->left = x->right = NULL;
  fps__piece_split(*root, x->lo, &a, &b);
  *root = fps__piece_merge(fps__piece_merge(a, x), b);
}

/* Removes and returns the first (or last) piece of a non-empty tree. */
static fps_piece_t *fps__piece_pop_min(fps_piece_t **t) {
  while ((*t)->left) t = &(*t)->left;
  fps_piece_t *x = *t;
  *t = x->right;
  x->right = NULL;
  return x;
}

static fps_piece_t *fps__piece_pop_max(fps_piece_t **t) {
  while ((*t)->right) t = &(*t)->right;
  fps_piece_t *x = *t;
  *t = x->left;
  x->left = NULL;
  return x;
}

/* One more staged piece of e over o's bytes: the first charges them
 * (against the limit and as e's push's staged bytes). false: the limit. */
static bool fps__owner_hold(fps_shard_t *sh, fps_push_entry_t *e, fps_slice_owner_t *o) {
  if (atomic_fetch_add(&o->staged, 1) == 0) {
    if (!fps__tbuf_charge(sh, o->bytes)) {
      atomic_fetch_sub(&o->staged, 1);
      return false;
    }
    fps__push_staged_add(e->owner, (int64_t)o->bytes);
  }
  o->ref(o->ctx);
  return true;
}

/* The piece is gone: the last one over o's bytes releases the charge. All
 * pieces of one message are of one push (o is one call's message). */
static void fps__owner_drop(fps_shard_t *sh, fps_push_entry_t *e, fps_slice_owner_t *o) {
  if (atomic_fetch_sub(&o->staged, 1) == 1) {
    fps__tbuf_uncharge(sh, o->bytes);
    fps__push_staged_add(e->owner, -(int64_t)o->bytes);
  }
  o->unref(o->ctx); /* may free o */
}

static void fps__piece_free(fps_shard_t *sh, fps_push_entry_t *e, fps_piece_t *x) {
  e->staged_n -= x->hi - x->lo;
  if (x->owner) {
    fps__owner_drop(sh, e, x->owner);
  } else {
    fps__push_staged_add(e->owner, -(int64_t)((x->hi - x->lo) * sizeof(float)));
    fps_tbuf_free(sh, x->data, x->hi - x->lo);
  }
  fps_free(x);
}

static void fps__piece_free_tree(fps_shard_t *sh, fps_push_entry_t *e, fps_piece_t *t) {
  while (t) {
    fps_piece_t *x = fps__piece_pop_min(&t);
    fps__piece_free(sh, e, x);
  }
}

/* ------------------------------------------------------------ the sum */

void fps__reduce_bad_value_why(char *why, size_t wl, const char *name, uint64_t index, float v) {
  if (isnan(v) || isinf(v))
    snprintf(why, wl, "tensor '%s': gradient element %" PRIu64 " is %s; nothing was applied", name, index,
             isnan(v) ? "NaN" : "Inf");
  else
    snprintf(why, wl,
             "tensor '%s': gradient element %" PRIu64 " is %g, beyond the largest magnitude the shard "
             "accepts (2^63 = %g: its square would overflow float32); nothing was applied",
             name, index, (double)v, FPS_GRAD_ABS_LIMIT);
}

static void fps__reduce_destroy(fps_shard_t *sh, fps_tensor_t *t) {
  fps_reduce_t *r = t->red;
  if (!r) return;
  fps__tbuf_keep(sh, t, r->acc);
  for (uint32_t w = 0; w < sh->cfg.workers; w++) fps_ranges_free(&r->done[w]);
  fps_free(r->done);
  fps_free(r->owner);
  fps_free(r);
  t->red = NULL;
}

void fps__reduce_free(fps_shard_t *sh, fps_tensor_t *t) { fps__reduce_destroy(sh, t); }

/* True if worker w may sum [lo, hi) now: w - 1 has summed all of it. */
static bool fps__reduce_ready(const fps_reduce_t *r, uint32_t w, uint64_t lo, uint64_t hi) {
  if (w == 0) return true;
  fps_range_t m;
  return fps_ranges_find(&r->done[w - 1], lo, &m) && hi <= m.hi;
}

/* Sums ready piece x as worker w's (worker 0 copies, the others add: the
 * one fp32 addition of the worker-id order). A reference is checked and
 * converted in the same pass. Returns how many elements may be recorded
 * in done[w]: all, or on a bad value (why set) those before it (none for
 * worker 0, whose unrecorded elements are overwritten later). */
static uint64_t fps__reduce_add_piece(fps_shard_t *sh, fps_tensor_t *t, uint32_t w, const fps_piece_t *x,
                                      int *err, char *why, size_t wl) {
  fps_reduce_t *r = t->red;
  uint64_t lo = x->lo, n = x->hi - x->lo;
  *err = 0;
  if (!x->owner) {
    if (w == 0) memcpy(r->acc + lo, x->data, (size_t)n * sizeof(float));
    else fps_kernels_add_f32(sh->kernels, r->acc + lo, x->data, (size_t)n);
    return n;
  }
  uint64_t bad = w == 0 ? fps_dtype_grad_decode(sh->kernels, x->dtype, r->acc + lo, x->src, n)
                        : fps_dtype_grad_sum(sh->kernels, x->dtype, r->acc + lo, x->src, n);
  if (bad == n) return n;
  fps__reduce_bad_value_why(why, wl, t->name, lo + bad, fps_dtype_value(x->dtype, x->src, bad));
  *err = FPS_EINVAL;
  return w == 0 ? 0 : bad;
}

/* e's staged gradient held a bad value (why): e fails (its later slices
 * and its join too), its other staged pieces are dropped, its call is
 * woken, and it is queued for the entry point to fail its round if it
 * waits in one. */
static void fps__reduce_fail(fps_shard_t *sh, fps_push_entry_t *e, int err, const char *why) {
  if (!e->red_err) {
    e->red_err = err;
    e->red_msg = fps_strdup(why);
  }
  fps__piece_free_tree(sh, e, e->staged);
  e->staged = NULL;
  fps_reduce_t *r = e->t->red;
  e->red_fail_next = r->failed;
  r->failed = e;
  fps__push_staged_failed(e->owner, e);
  fps__push_wake(e->owner);
}

/* Fails the rounds of the pushes queued by fps__reduce_fail (may discard
 * t's sum). */
static void fps__reduce_settle_failed(fps_shard_t *sh, fps_tensor_t *t, fps__member_failed_fn failed,
                                      fps_push_entry_t **resolve) {
  if (!t->red) return;
  fps_push_entry_t *f = t->red->failed;
  t->red->failed = NULL;
  while (f) {
    fps_push_entry_t *x = f;
    f = x->red_fail_next;
    x->red_fail_next = NULL;
    failed(sh, x, resolve);
  }
}

/* done[w] just gained [lo, hi): sums the staged pieces of workers w+1,
 * w+2, ... that this made ready. At each level only pieces overlapping
 * the span the level below changed can have become ready. */
static void fps__reduce_cascade(fps_shard_t *sh, fps_tensor_t *t, uint32_t w, uint64_t lo, uint64_t hi) {
  fps_reduce_t *r = t->red;
  for (uint32_t v = w + 1; v < sh->cfg.workers && lo < hi; v++) {
    fps_push_entry_t *ev = r->owner[v];
    if (!ev || !ev->staged) return;
    fps_piece_t *a, *b, *c;
    fps__piece_split(ev->staged, lo, &a, &b);
    fps__piece_split(b, hi, &b, &c);
    /* The last piece starting before lo may reach into [lo, hi). */
    if (a) {
      fps_piece_t *p = fps__piece_pop_max(&a);
      if (p->hi > lo) b = fps__piece_merge(p, b);
      else a = fps__piece_merge(a, p);
    }
    ev->staged = fps__piece_merge(a, c);
    uint64_t nlo = UINT64_MAX, nhi = 0;
    while (b) {
      fps_piece_t *x = fps__piece_pop_min(&b);
      if (fps__reduce_ready(r, v, x->lo, x->hi) && fps_ranges_reserve(&r->done[v]) == 0) {
        int err;
        char why[FPS_WHY_MAX];
        uint64_t k = fps__reduce_add_piece(sh, t, v, x, &err, why, sizeof why);
        if (k) {
          fps_ranges_add(&r->done[v], x->lo, x->lo + k); /* reserved: cannot fail */
          if (x->lo < nlo) nlo = x->lo;
          if (x->lo + k > nhi) nhi = x->lo + k;
        }
        fps__piece_free(sh, ev, x);
        if (err) {
          /* ev's gradient is done for: nothing more of it is summed, and
           * the levels above go on with what it did sum. */
          fps__piece_free_tree(sh, ev, b);
          b = NULL;
          fps__reduce_fail(sh, ev, err, why);
        }
      } else {
        fps__piece_insert(&ev->staged, x);
      }
    }
    /* Less staged: a push held back for it may go on. */
    if (nlo < nhi) fps__push_wake(ev->owner);
    lo = nlo;
    hi = nhi;
  }
}

/* Sums every staged piece of e that is ready (e holds its place). */
static void fps__reduce_drain(fps_shard_t *sh, fps_push_entry_t *e) {
  fps_reduce_t *r = e->t->red;
  uint32_t w = e->worker_id;
  fps_piece_t *all = e->staged;
  e->staged = NULL;
  while (all) {
    fps_piece_t *x = fps__piece_pop_min(&all);
    if (fps__reduce_ready(r, w, x->lo, x->hi) && fps_ranges_reserve(&r->done[w]) == 0) {
      int err;
      char why[FPS_WHY_MAX];
      uint64_t lo = x->lo, k = fps__reduce_add_piece(sh, e->t, w, x, &err, why, sizeof why);
      if (k) fps_ranges_add(&r->done[w], lo, lo + k); /* reserved: cannot fail */
      fps__piece_free(sh, e, x);
      if (k) fps__reduce_cascade(sh, e->t, w, lo, lo + k);
      if (err) {
        fps__piece_free_tree(sh, e, all);
        all = NULL;
        fps__reduce_fail(sh, e, err, why);
        return;
      }
    } else {
      fps__piece_insert(&e->staged, x);
    }
  }
}

/* e takes its worker's place in t's sum if it may (its step is the
 * round's, nobody else holds the place), creating the sum if needed, and
 * sums its staged pieces that are ready. 0 (also when it may not: it
 * stays private), FPS_ELIMIT or FPS_ENOMEM. */
static int fps__reduce_attach(fps_shard_t *sh, fps_push_entry_t *e, char *why, size_t wl) {
  fps_tensor_t *t = e->t;
  uint32_t w = e->worker_id, W = sh->cfg.workers;
  if (e->attached || e->replay_only || e->step != t->version) return 0;
  if (t->red && t->red->owner[w]) return 0;
  if (!t->red) {
    fps_reduce_t *r = fps_calloc(1, sizeof *r);
    bool over = false;
    if (r) {
      r->owner = fps_calloc(W, sizeof *r->owner);
      r->done = fps_calloc(W, sizeof *r->done);
      if (r->owner && r->done) r->acc = fps__tbuf_take(sh, t, &over);
    }
    if (!r || !r->acc) {
      if (r) {
        fps_free(r->owner);
        fps_free(r->done);
        fps_free(r);
      }
      if (over)
        snprintf(why, wl,
                 "tensor '%s': its %" PRIu64 "-byte sync sum would pass the shard's limit of %" PRIu64
                 " bytes for in-flight tensors (--max-staging-bytes); retry later",
                 t->name, t->numel * 4, sh->cfg.max_staging_bytes);
      else
        snprintf(why, wl, "tensor '%s': out of memory for a %" PRIu64 "-element sync sum", t->name, t->numel);
      return over ? FPS_ELIMIT : FPS_ENOMEM;
    }
    r->step = t->version;
    t->red = r;
  }
  t->red->owner[w] = e;
  e->attached = true;
  fps__reduce_drain(sh, e);
  return 0;
}

/* Decodes and checks s without keeping it (a retry of an applied push:
 * its values are not used, but a bad one is still refused). */
static int fps__reduce_check_only(const fps_tensor_t *t, const fps_slice_t *s, uint64_t count, char *why,
                                  size_t wl) {
  float tmp[FPS_REDUCE_CHUNK];
  size_t esz = fps_dtype_size(s->dtype);
  for (uint64_t off = 0; off < count; off += FPS_REDUCE_CHUNK) {
    uint64_t n = count - off < FPS_REDUCE_CHUNK ? count - off : FPS_REDUCE_CHUNK;
    uint64_t bad = fps_dtype_grad_decode(NULL, s->dtype, tmp, s->data + off * esz, n);
    if (bad < n) {
      fps__reduce_bad_value_why(why, wl, t->name, s->offset + off + bad,
                                fps_dtype_value(s->dtype, s->data, off + bad));
      return FPS_EINVAL;
    }
  }
  return 0;
}

/* s is ready for e's worker: checked, converted and summed in one pass
 * straight from the received bytes. A bad value stops it; exactly the
 * elements before it are summed, and they stay recorded in done[w] (the
 * push then fails, and if that is not empty, leaving aborts the round). */
static int fps__reduce_sum_slice(fps_shard_t *sh, fps_push_entry_t *e, const fps_slice_t *s, uint64_t count,
                                 char *why, size_t wl) {
  fps_tensor_t *t = e->t;
  fps_reduce_t *r = t->red;
  uint32_t w = e->worker_id;
  uint64_t lo = s->offset, hi = lo + count;
  if (fps_ranges_reserve(&r->done[w]) < 0) {
    snprintf(why, wl, "tensor '%s': out of memory", t->name);
    return FPS_ENOMEM;
  }
  if (w == 0) {
    /* Worker 0 decodes straight into the sum. On a bad value nothing is
     * recorded: the elements stay unsummed and are overwritten later. */
    uint64_t bad = fps_dtype_grad_decode(sh->kernels, s->dtype, r->acc + lo, s->data, count);
    if (bad < count) {
      fps__reduce_bad_value_why(why, wl, t->name, lo + bad, fps_dtype_value(s->dtype, s->data, bad));
      return FPS_EINVAL;
    }
  } else {
    uint64_t bad = fps_dtype_grad_sum(sh->kernels, s->dtype, r->acc + lo, s->data, count);
    if (bad < count) {
      fps__reduce_bad_value_why(why, wl, t->name, lo + bad, fps_dtype_value(s->dtype, s->data, bad));
      fps_ranges_add(&r->done[w], lo, lo + bad); /* reserved: cannot fail */
      fps__reduce_cascade(sh, t, w, lo, lo + bad);
      return FPS_EINVAL;
    }
  }
  fps_ranges_add(&r->done[w], lo, hi);
  fps__reduce_cascade(sh, t, w, lo, hi);
  return 0;
}

/* s arrived before e's worker may sum it: keep a reference to its bytes
 * (checked when summed), or without an owner (or if its message would
 * pass the limit) a converted, checked copy. */
static int fps__reduce_stage(fps_shard_t *sh, fps_push_entry_t *e, const fps_slice_t *s, uint64_t count,
                             char *why, size_t wl) {
  fps_tensor_t *t = e->t;
  bool over = false;
  fps_piece_t *x = fps_malloc(sizeof *x);
  float *data = NULL;
  bool ok = x != NULL;
  fps_slice_owner_t *owner = s->owner;
  /* A message that would pass the limit (its other slices were summed,
   * or it is mostly other tensors') may leave room for a converted copy
   * of this slice alone: no request is refused that would fit. */
  if (ok && owner && !fps__owner_hold(sh, e, owner)) owner = NULL;
  if (ok && !owner) ok = (data = fps_tbuf_alloc(sh, count, &over)) != NULL;
  if (!ok) {
    fps_free(x);
    uint64_t bytes = count * 4;
    if (over)
      snprintf(why, wl,
               "tensor '%s': staging %" PRIu64 " gradient bytes of worker %u that arrived before the workers "
               "below it would pass the shard's limit of %" PRIu64
               " bytes for in-flight tensors (--max-staging-bytes); retry later",
               t->name, bytes, e->worker_id, sh->cfg.max_staging_bytes);
    else
      snprintf(why, wl, "tensor '%s': out of memory staging %" PRIu64 " gradient elements", t->name, count);
    return over ? FPS_ELIMIT : FPS_ENOMEM;
  }
  if (!owner) {
    uint64_t bad = fps_dtype_grad_decode(sh->kernels, s->dtype, data, s->data, count);
    if (bad < count) {
      fps__reduce_bad_value_why(why, wl, t->name, s->offset + bad, fps_dtype_value(s->dtype, s->data, bad));
      fps_tbuf_free(sh, data, count);
      fps_free(x);
      return FPS_EINVAL;
    }
    fps__push_staged_add(e->owner, (int64_t)(count * sizeof(float)));
  }
  x->lo = s->offset;
  x->hi = s->offset + count;
  x->dtype = s->dtype;
  x->owner = owner;
  x->src = s->data;
  x->data = data;
  x->prio = fps__piece_prio();
  fps__piece_insert(&e->staged, x);
  e->staged_n += count;
  return 0;
}

/* e's own error, if a discard or a bad staged value gave it one. */
static int fps__reduce_own_err(const fps_push_entry_t *e, char *why, size_t wl) {
  if (!e->red_err) return 0;
  snprintf(why, wl, "%s", e->red_msg ? e->red_msg : fps_strerror(e->red_err));
  return e->red_err;
}

int fps__reduce_slice_locked(fps_shard_t *sh, fps_push_entry_t *e, const fps_slice_t *s, uint64_t count,
                             fps__member_failed_fn failed, char *why, size_t wl, fps_push_entry_t **resolve) {
  int rc = fps__reduce_own_err(e, why, wl);
  if (rc < 0) return rc;
  if (e->replay_only) return fps__reduce_check_only(e->t, s, count, why, wl);
  rc = fps__reduce_attach(sh, e, why, wl);
  if (rc == 0) rc = fps__reduce_own_err(e, why, wl); /* a piece the attach summed */
  if (rc == 0) {
    if (e->attached && fps__reduce_ready(e->t->red, e->worker_id, s->offset, s->offset + count))
      rc = fps__reduce_sum_slice(sh, e, s, count, why, wl);
    else
      rc = fps__reduce_stage(sh, e, s, count, why, wl);
  }
  fps__reduce_settle_failed(sh, e->t, failed, resolve);
  return rc;
}

int fps__reduce_join_locked(fps_shard_t *sh, fps_push_entry_t *e, fps__member_failed_fn failed, char *why,
                            size_t wl, fps_push_entry_t **resolve) {
  int rc = fps__reduce_own_err(e, why, wl);
  if (rc < 0) return rc;
  if (e->attached) fps__reduce_drain(sh, e); /* pieces an allocation failure left behind */
  else rc = fps__reduce_attach(sh, e, why, wl);
  fps__reduce_settle_failed(sh, e->t, failed, resolve);
  if (rc == 0) rc = fps__reduce_own_err(e, why, wl);
  /* Another member's failure discarded the sum e had only staged pieces
   * for: e takes its place in the next one. */
  if (rc == 0 && !e->attached) {
    rc = fps__reduce_attach(sh, e, why, wl);
    /* That attach sums e's ready pieces too: a bad value among them is
     * queued like any other and must be settled before the locks go. */
    fps__reduce_settle_failed(sh, e->t, failed, resolve);
    if (rc == 0) rc = fps__reduce_own_err(e, why, wl);
  }
  return rc;
}

float *fps__reduce_take_locked(fps_shard_t *sh, fps_tensor_t *t) {
  fps_reduce_t *r = t->red;
  if (!r) return NULL;
  uint32_t W = sh->cfg.workers;
  float *sum = NULL;
  if (r->done[W - 1].covered == t->numel) {
    sum = r->acc;
    r->acc = NULL;
  }
  for (uint32_t w = 0; w < W; w++)
    if (r->owner[w]) r->owner[w]->attached = false;
  fps__reduce_destroy(sh, t);
  return sum;
}

bool fps__reduce_leave_locked(fps_shard_t *sh, fps_push_entry_t *e) {
  fps_tensor_t *t = e->t;
  fps_reduce_t *r = t->red;
  if (!e->attached || !r) return false;
  uint32_t w = e->worker_id;
  if (r->done[w].covered > 0) return true;
  r->owner[w] = NULL;
  e->attached = false;
  for (uint32_t v = 0; v < sh->cfg.workers; v++)
    if (r->owner[v]) return false;
  fps__reduce_destroy(sh, t); /* nobody left: nothing is summed */
  return false;
}

void fps__reduce_discard_locked(fps_shard_t *sh, fps_tensor_t *t, int err, const char *msg) {
  fps_reduce_t *r = t->red;
  if (!r) return;
  for (uint32_t w = 0; w < sh->cfg.workers; w++) {
    fps_push_entry_t *ev = r->owner[w];
    if (!ev) continue;
    fps__push_wake(ev->owner); /* held back for a sum that is gone */
    ev->attached = false;
    if (r->done[w].covered > 0 && !ev->red_err) {
      ev->red_err = err;
      ev->red_msg = fps_strdup(msg);
    }
  }
  fps__reduce_destroy(sh, t);
}

bool fps__reduce_lower_streaming_locked(fps_shard_t *sh, fps_push_entry_t *e) {
  fps_reduce_t *r = e->t->red;
  if (!e->attached || !r) return false;
  for (uint32_t v = 0; v < e->worker_id; v++) {
    fps_push_entry_t *ev = r->owner[v];
    if (ev && r->done[v].covered < e->t->numel && fps__push_streaming(ev->owner)) return true;
  }
  (void)sh;
  return false;
}

void fps__reduce_wake_above_locked(fps_shard_t *sh, fps_push_entry_t *e) {
  fps_reduce_t *r = e->t->red;
  if (!e->attached || !r) return;
  for (uint32_t v = e->worker_id + 1; v < sh->cfg.workers; v++)
    if (r->owner[v]) fps__push_wake(r->owner[v]->owner);
}

void fps__reduce_entry_free_locked(fps_shard_t *sh, fps_push_entry_t *e) {
  fps__piece_free_tree(sh, e, e->staged);
  e->staged = NULL;
  fps_free(e->red_msg);
  e->red_msg = NULL;
}

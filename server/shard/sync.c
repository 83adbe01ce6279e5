/* Sync rounds: W workers' gradients for one tensor and step become one
 * update, and the rounds a call's tensors joined are applied together.
 *
 * A tensor has at most one open round, for step == its version. The
 * workers' gradients are summed in worker-id order while they stream in
 * (reduce.c: one accumulator per round, bit-identical to summing whole
 * gradients in that order); each worker's push joins at its half-close; a
 * round is full when all W workers joined. A push naming several tensors links their rounds: the
 * rounds connected through member pushes form a set, and a full round
 * waits until every round of its set is full. The push that fills the last
 * one completes the whole set: it locks the set's tensors (address order),
 * checks every round (members agree, the update's settings pass) and
 * allocates everything the updates need and takes each round's finished
 * sum, and only then divides each by W and applies one step per tensor
 * through the shard's one apply-and-snapshot path, each round's members
 * sharing one snapshot (the sum's buffer).
 * If any check or allocation fails, or any round of the set misses its
 * deadline, no round of the set is applied and every member of every round
 * of it fails with the cause (naming the tensor). So a call's tensors are
 * applied all together or not at all. Nobody sleeps: a push that is not
 * last waits until it is resolved (its done callback runs then). A member
 * that withdraws (its call went away) leaves every round of its call at
 * once and is no longer counted; the others keep waiting, unless part of
 * its gradient is already in a round's sum: a sum cannot be taken apart,
 * so that round's set is failed with FPS_EUNAVAILABLE (clients retry a
 * started push on it) naming the worker whose call failed, and nothing is
 * applied. The same holds for a push that goes away before joining
 * (fps__sync_leave), and for the members of a failed set: their sums are
 * discarded, and pushes still streaming into them fail at their next slice.
 *
 * Membership (fps_round_t) is guarded by sh->rounds_mu; a set being
 * completed is marked settling, which freezes it (no withdraw, no expiry;
 * a join to one of its full rounds is a duplicate), so its tensors' locks
 * can be taken without holding rounds_mu.
 *
 * Deadlines are enforced by fps_shard_expire(), the hook the server
 * registers with its timer (server/timer.c). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "pool.h"
#include "internal.h"

/* How long before a member's own deadline its round gives up (shard.h). */
static int64_t fps__round_margin(int64_t call_deadline_ns, int64_t now) {
  int64_t m = call_deadline_ns > now ? (call_deadline_ns - now) / 4 : 0;
  if (m < FPS_ROUND_MARGIN_MIN_NS) m = FPS_ROUND_MARGIN_MIN_NS;
  if (m > FPS_ROUND_MARGIN_MAX_NS) m = FPS_ROUND_MARGIN_MAX_NS;
  return m;
}

/* ------------------------------------------------------- open rounds */

/* REQUIRES sh->rounds_mu (as every function named _locked here). */
static void fps__rounds_link_locked(fps_shard_t *sh, fps_tensor_t *t) {
  if (t->in_rounds) return;
  t->rprev = NULL;
  t->rnext = sh->rounds;
  if (sh->rounds) sh->rounds->rprev = t;
  sh->rounds = t;
  t->in_rounds = true;
}

static void fps__rounds_unlink_locked(fps_shard_t *sh, fps_tensor_t *t) {
  if (!t->in_rounds) return;
  if (t->rprev) t->rprev->rnext = t->rnext;
  else sh->rounds = t->rnext;
  if (t->rnext) t->rnext->rprev = t->rprev;
  t->rprev = t->rnext = NULL;
  t->in_rounds = false;
}

/* ---------------------------------------------------------- round sets */

/* The set of t's round: every round reachable through member pushes, as
 * a list from t through round.cnext. *count gets its size, *full whether
 * every round of it is full. No allocation. */
static void fps__set_walk_locked(fps_shard_t *sh, fps_tensor_t *t, size_t *count, bool *full) {
  uint32_t W = sh->cfg.workers;
  uint64_t gen = ++sh->rounds_walk;
  fps_tensor_t *tail = t;
  t->round.seen = gen;
  t->round.cnext = NULL;
  size_t n = 1;
  bool all = true;
  for (fps_tensor_t *x = t; x; x = x->round.cnext) {
    if (x->round.joined < W) all = false;
    for (uint32_t w = 0; w < W; w++) {
      fps_push_entry_t *m = x->round.member[w];
      if (!m) continue;
      /* The member's push: its entries are fixed since its commit. */
      fps_push_entry_t **pe;
      size_t pn = fps__push_entries(m->owner, gen, &pe);
      for (size_t i = 0; i < pn; i++) {
        fps_tensor_t *y = pe[i]->t;
        if (!pe[i]->in_round || y->round.seen == gen) continue;
        y->round.seen = gen;
        y->round.cnext = NULL;
        tail->round.cnext = y;
        tail = y;
        n++;
      }
    }
  }
  *count = n;
  *full = all;
}

/* Closes t's round; chains its members onto *list. */
static size_t fps__round_take_locked(fps_shard_t *sh, fps_tensor_t *t, fps_push_entry_t **list) {
  size_t n = 0;
  for (uint32_t w = 0; w < sh->cfg.workers; w++) {
    fps_push_entry_t *e = t->round.member[w];
    if (!e) continue;
    e->in_round = false;
    t->round.member[w] = NULL;
    e->resolve_next = *list;
    *list = e;
    n++;
  }
  t->round.open = false;
  t->round.settling = false;
  t->round.joined = 0;
  fps__rounds_unlink_locked(sh, t);
  fps_metrics_waiting_add(-(int)n);
  return n;
}

/* Appends to msg (of len bytes, n used) what the failure of a set of k > 1
 * rounds means for the others: the tensors named whole or not at all. */
static void fps__set_suffix(char *msg, size_t len, size_t n, fps_tensor_t *set, size_t k) {
  if (k < 2 || n >= len) return;
  n += (size_t)snprintf(msg + n, len - n, "; linked through the same calls, none of the %zu rounds (tensors ", k);
  size_t named = 0;
  for (fps_tensor_t *x = set; x && n < len; x = x->round.cnext) {
    size_t need = strlen(x->name) + 4;
    if (n + need + 40 >= len) {
      snprintf(msg + n, len - n, ", and %zu more) was applied", k - named);
      return;
    }
    n += (size_t)snprintf(msg + n, len - n, "%s'%s'", named ? ", " : "", x->name);
    named++;
  }
  if (n < len) snprintf(msg + n, len - n, ") was applied");
}

/* Fails every round of the set with err and msg (copied for each member);
 * the members are chained onto *list for resolving. */
static void fps__set_fail_locked(fps_shard_t *sh, fps_tensor_t *set, int err, const char *msg,
                                 fps_push_entry_t **list) {
  for (fps_tensor_t *x = set, *next; x; x = next) {
    next = x->round.cnext;
    fps_push_entry_t *before = *list;
    fps__round_take_locked(sh, x, list);
    for (fps_push_entry_t *e = *list; e != before; e = e->resolve_next) {
      e->err = err;
      e->msg = fps_strdup(msg);
    }
  }
}

static void fps__resolve_list(fps_push_entry_t *list) {
  while (list) {
    fps_push_entry_t *e = list;
    list = e->resolve_next;
    e->resolve_next = NULL;
    fps__push_entry_resolved(e);
  }
}

/* The set's list in address order (merge sort through round.cnext). */
static fps_tensor_t *fps__set_sort(fps_tensor_t *l, size_t k) {
  if (k < 2) return l;
  fps_tensor_t *b = l;
  for (size_t i = 1; i < k / 2; i++) b = b->round.cnext;
  fps_tensor_t *r = b->round.cnext;
  b->round.cnext = NULL;
  l = fps__set_sort(l, k / 2);
  r = fps__set_sort(r, k - k / 2);
  fps_tensor_t head, *tail = &head;
  while (l && r) {
    fps_tensor_t **pick = (uintptr_t)l < (uintptr_t)r ? &l : &r;
    tail->round.cnext = *pick;
    tail = *pick;
    *pick = (*pick)->round.cnext;
  }
  tail->round.cnext = l ? l : r;
  return head.round.cnext;
}

/* Settling: takes t's finished sum into t->round.sum (none: a buffer for
 * the snapshot if one is wanted). 0, or FPS_EUNAVAILABLE if the sum lost
 * a member's gradient (it was aborted meanwhile), FPS_ELIMIT / FPS_ENOMEM
 * for the snapshot's buffer, with why. REQUIRES t->mu. */
static int fps__round_sum_take_locked(fps_shard_t *sh, fps_tensor_t *t, char *why, size_t wl) {
  t->round.sum = NULL;
  if (!t->round.none) {
    if ((t->round.sum = fps__reduce_take_locked(sh, t))) return 0;
    snprintf(why, wl,
             "tensor '%s' step %" PRIu64 ": the sync sum lost a member's gradient (a call whose gradient was "
             "in it failed); nothing was applied, retry",
             t->name, t->round.step);
    return FPS_EUNAVAILABLE;
  }
  /* Another push of a member's worker may still be streaming a gradient
   * for this step: the round is complete without it. */
  char msg[512];
  snprintf(msg, sizeof msg,
           "tensor '%s' step %" PRIu64 ": duplicate push: the round completed with another PushPull of this "
           "worker (which sent no_grad); not counted",
           t->name, t->round.step);
  fps__reduce_discard_locked(sh, t, FPS_EDUP, msg);
  return 0; /* the replies reference the current parameters: no buffer */
}

/* The division of a round's sum by W, in chunks on the kernel pool (the
 * set's update waits for it, and one thread would leave the other cores
 * idle); each element is divided once, so the bits do not depend on the
 * chunking. */
typedef struct fps__div_job_s {
  const fps_kernels_t *k;
  float *x;
  uint64_t n;
  size_t nchunks;
  float d;
} fps__div_job_t;

static void fps__div_chunk(void *arg, size_t c) {
  const fps__div_job_t *j = arg;
  uint64_t lo = j->n * c / j->nchunks, hi = j->n * (c + 1) / j->nchunks;
  fps_kernels_div_f32(j->k, j->x + lo, (size_t)(hi - lo), j->d);
}

static void fps__sum_divide(fps_shard_t *sh, float *sum, uint64_t numel, float d) {
  fps__div_job_t j = {.k = sh->kernels, .x = sum, .n = numel, .d = d, .nchunks = 1};
  if (sh->pool && numel >= FPS_POOL_MIN(sh)) j.nchunks = 2 * (size_t)fps_pool_threads(sh->pool);
  fps_pool_run(j.nchunks > 1 ? sh->pool : NULL, j.nchunks, fps__div_chunk, &j);
}

/* Every set is applied under the apply gate's read side, and settled with
 * it held: fps__set_complete takes it before any tensor lock, and
 * fps__set_settle releases it. A set with split blocks lets it go while it
 * exchanges (the cut of a standby must not wait for a peer), and each
 * advance of its exchange takes it again before the tensors' locks
 * (xstep.c), so that its apply and its members' keys are in one cut. */

/* Completes a full set of k rounds that the caller marked settling: every
 * round is checked and prepared before any is applied. A set holding
 * split blocks then exchanges their partials with the other shards
 * (xstep.c) and is settled by whoever completes or fails that exchange.
 * Holds no lock on entry; resolves the members after releasing every
 * lock. */
static void fps__set_complete(fps_shard_t *sh, fps_tensor_t *set, size_t k) {
  uint32_t W = sh->cfg.workers;
  set = fps__set_sort(set, k);
  /* Held until fps__set_settle has applied the set and recorded its
   * members' keys (there: why); before any tensor lock, its order. */
  pthread_rwlock_rdlock(&sh->apply_gate);
  int64_t found = fps_now_ns();
  for (fps_tensor_t *t = set; t; t = t->round.cnext) {
    pthread_mutex_lock(&t->mu);
    t->round.complete_ns = found;
  }
  char why[1024];
  int err = 0;
  for (fps_tensor_t *t = set; t && !err; t = t->round.cnext)
    err = fps_round_agree(t, t->round.member, W, &t->round.none, why, sizeof why);
  fps_tensor_t *prepared = set;
  for (; prepared && !err; prepared = prepared->round.cnext) {
    fps_push_entry_t **m = prepared->round.member;
    err = fps__apply_prepare(sh, prepared, &m[0]->uh, !prepared->round.none, &prepared->round.prep, why,
                             sizeof why);
    if (!err) err = fps__round_sum_take_locked(sh, prepared, why, sizeof why);
  }
  if (err) {
    fps__set_settle(sh, set, k, err, why, sizeof why);
    return;
  }
  /* ((g0 + g1) + g2) + ... in fp32, summed as the slices came (reduce.c),
   * then one division by W: the exact arithmetic a local replay must use
   * to match bit for bit; the SIMD variants (common/simd) give exactly the
   * plain loop's bits. A block's pass A needs the mean before the
   * exchange, so every sum is divided here. */
  for (fps_tensor_t *t = set; t && W > 1; t = t->round.cnext)
    if (!t->round.none) fps__sum_divide(sh, t->round.sum, t->numel, (float)W);
  /* Blocks of split tensors step with the other shards first. */
  if (fps__xstep_needed(set)) {
    fps_xgroup_t *g = NULL;
    err = fps__xstep_start(sh, set, k, fps__set_settle, &g, why, sizeof why);
    if (err) {
      fps__set_settle(sh, set, k, err, why, sizeof why);
      return;
    }
    for (fps_tensor_t *t = set; t; t = t->round.cnext) pthread_mutex_unlock(&t->mu);
    pthread_rwlock_unlock(&sh->apply_gate);
    fps__xstep_kick(g);
    return;
  }
  fps__set_settle(sh, set, k, 0, why, sizeof why);
}

/* The step timeline (--log-level debug): for a set about to be applied,
 * when each worker's call began and finished streaming and how long it
 * was held, the set's completion and the apply's start, in ms after the
 * earliest call began. Members are read from the set's first tensor (a
 * worker's other pushes of the set, if any, are not shown). REQUIRES the
 * set's t->mu. */
static void fps__set_timeline(fps_shard_t *sh, fps_tensor_t *set, size_t k, int64_t apply_ns) {
  uint32_t W = sh->cfg.workers;
  uint64_t numel = 0;
  for (fps_tensor_t *t = set; t; t = t->round.cnext) numel += t->numel;
  fps_push_times_t tm;
  int64_t t0 = set->round.complete_ns;
  for (uint32_t w = 0; w < W; w++) {
    fps__push_times(set->round.member[w]->owner, &tm);
    if (tm.created_ns < t0) t0 = tm.created_ns;
  }
  char line[1536];
  size_t at = (size_t)snprintf(line, sizeof line, "sync step %" PRIu64 " timeline: %zu tensors, %" PRIu64 " params;",
                               set->round.step, k, numel);
  for (uint32_t w = 0; w < W && at < sizeof line; w++) {
    fps__push_times(set->round.member[w]->owner, &tm);
    at += (size_t)snprintf(line + at, sizeof line - at, " w%u call +%.1f end +%.1f held %.1f (%u)", w,
                           (double)(tm.created_ns - t0) / 1e6, (double)(tm.recv_end_ns - t0) / 1e6,
                           (double)tm.held_ns / 1e6, tm.holds);
  }
  if (at < sizeof line)
    snprintf(line + at, sizeof line - at, "; complete +%.1f apply +%.1f ms", (double)(set->round.complete_ns - t0) / 1e6,
             (double)(apply_ns - t0) / 1e6);
  FPS_LOG(FPS_LOG_DEBUG, "%s", line);
}

void fps__set_settle(fps_shard_t *sh, fps_tensor_t *set, size_t k, int err, char *why, size_t why_len) {
  uint32_t W = sh->cfg.workers;
  fps_push_entry_t *list = NULL;
  fps_xanchor_t *anchors = NULL; /* split blocks' anchors due (xrecover.c) */
  if (err) {
    /* What was prepared or summed for the rounds is not used (rounds
     * never prepared hold nothing: both releases are no-ops then). */
    for (fps_tensor_t *t = set; t; t = t->round.cnext) {
      fps__apply_prep_release(&t->round.prep);
      fps__tbuf_keep(sh, t, t->round.sum);
      t->round.sum = NULL;
    }
    fps__set_suffix(why, why_len, strlen(why), set, k);
    /* The members' gradients were summed: pushes still streaming into
     * those sums can no longer be applied either. */
    for (fps_tensor_t *t = set; t; t = t->round.cnext) fps__reduce_discard_locked(sh, t, FPS_EUNAVAILABLE, why);
    pthread_mutex_lock(&sh->rounds_mu);
    fps__set_fail_locked(sh, set, err, why, &list);
    pthread_mutex_unlock(&sh->rounds_mu);
  } else {
    /* Nothing below can fail: every round of the set is applied. */
    int64_t apply_ns = fps_now_ns();
    if (FPS_LOG_DEBUG <= fps__log_level) fps__set_timeline(sh, set, k, apply_ns);
    for (fps_tensor_t *t = set; t; t = t->round.cnext) {
      fps_push_entry_t **m = t->round.member;
      float *sum = t->round.sum;
      t->round.sum = NULL;
      if (!t->round.none)
        fps_metrics_step_observe(W, (double)(fps_now_ns() - t->round.started_ns) / 1e9);
      /* The sum buffer (divided by W: fps__set_complete) becomes the
       * tensor's parameters, which all W replies share (one reference
       * each). Every worker said no_grad: nothing is applied, every member
       * gets the current params at the current version. */
      bool want = false;
      for (uint32_t w = 0; w < W; w++) want |= !m[w]->skip_params;
      /* The bf16 replies' encoding is made by the update (store.c), one
       * reference for each. */
      int bf16_replies = 0;
      for (uint32_t w = 0; w < W; w++) bf16_replies += !m[w]->skip_params && m[w]->dtype == FPS_DTYPE_BF16;
      t->round.prep.bf16_replies = bf16_replies;
      fps_snap_t *snap = NULL;
      int rc = fps__tensor_apply_locked(sh, t, &sum, !t->round.none, 0, t->round.step, &m[0]->uh, want, (int)W,
                                        &snap, &t->round.prep);
      fps_snap_bf16_t *enc = t->round.prep.bf16;
      t->round.prep.bf16 = NULL;
      fps__apply_prep_release(&t->round.prep);
      if (t->split && rc == 0 && !t->round.none) fps__xrec_applied_locked(sh, t, &anchors);
      fps__tbuf_keep(sh, t, sum); /* NULL once consumed */
      for (uint32_t w = 0; w < W; w++) {
        fps_push_entry_t *e = m[w];
        fps__tbuf_keep(sh, t, e->grad);
        e->grad = NULL;
        if (rc < 0) { /* not reached: the step was checked and prepared */
          e->err = rc;
          e->msg = fps_strdup("the Adafactor step failed");
        } else {
          e->err = 0;
          e->version = t->version;
          if (snap && !e->skip_params) {
            e->snap = snap;
            if (enc && e->dtype == FPS_DTYPE_BF16) e->bf16 = enc;
          } else if (snap) {
            fps_snap_unref(snap);
          }
        }
      }
    }
    if (FPS_LOG_DEBUG <= fps__log_level)
      FPS_LOG(FPS_LOG_DEBUG, "sync step %" PRIu64 " timeline: applied %zu tensors in %.1f ms", set->round.step, k,
               (double)(fps_now_ns() - apply_ns) / 1e6);
    /* Every member's key, now, inside the gate and with the set's locks
     * held: a standby's next cut holds the set's results together with all
     * W keys of each round (replica.c). The answers go out one by one; if
     * the primary dies between two of them, a member whose answer was lost
     * retries on the promoted standby and is answered from its key, as a
     * duplicate, instead of being refused as stale. Each push once, from
     * the round of its first tensor (all of a push's tensors are rounds of
     * this set). */
    for (fps_tensor_t *t = set; t; t = t->round.cnext)
      for (uint32_t w = 0; w < W; w++) {
        fps_push_entry_t *e = t->round.member[w];
        if (e && !e->err && e->owner->e[0] == e) fps__repl_key_applied(sh, e->owner);
      }
    pthread_mutex_lock(&sh->rounds_mu);
    for (fps_tensor_t *t = set, *next; t; t = next) {
      next = t->round.cnext;
      fps__round_take_locked(sh, t, &list);
    }
    pthread_mutex_unlock(&sh->rounds_mu);
  }
  /* Reverse of the locking order is not needed for mutexes; any order.
   * (fps__round_take_locked left every round.cnext alone.) */
  for (fps_tensor_t *t = set, *next; t; t = next) {
    next = t->round.cnext;
    pthread_mutex_unlock(&t->mu);
  }
  /* Before the members are resolved: their callbacks may push again. */
  pthread_rwlock_unlock(&sh->apply_gate);
  /* Before the members hear: a worker's next step must find the anchor
   * of this one on disk (xrecover.c). */
  fps__xrec_anchor_flush(sh, anchors);
  fps__resolve_list(list);
}

static int fps__cmp_entry_tensor(const void *a, const void *b) {
  const fps_tensor_t *x = (*(fps_push_entry_t *const *)a)->t, *y = (*(fps_push_entry_t *const *)b)->t;
  return x < y ? -1 : x > y;
}

int fps__sync_join(fps_shard_t *sh, fps_push_entry_t **e, size_t n, uint32_t worker_id, int64_t call_deadline_ns,
                   char *why, size_t why_len) {
  uint32_t W = sh->cfg.workers;
  int code = 0;
  /* Lock every tensor of the call in address order (no deadlock with a
   * call that names the same tensors in another order), check them all,
   * then join them all: a call joins every round or none. */
  fps_push_entry_t **sorted = fps_malloc(n * sizeof *sorted);
  if (!sorted) {
    snprintf(why, why_len, "out of memory joining %zu sync rounds", n);
    return FPS_ENOMEM;
  }
  memcpy(sorted, e, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, fps__cmp_entry_tensor);
  fps_push_entry_t *failed = NULL; /* pushes a bad staged value failed */
  fps_tensor_t *apart = NULL;       /* a split block the worker's step missed */
  for (size_t i = 0; i < n; i++) pthread_mutex_lock(&sorted[i]->t->mu);
  for (size_t i = 0; i < n && code == 0; i++) {
    fps_tensor_t *t = sorted[i]->t;
    uint64_t step = sorted[i]->step;
    if (t->round.exchanging) {
      /* Its round's sum is taken and its update waits for the other
       * shards (xstep.c): the version moves, or the set fails, soon. */
      code = FPS_EUNAVAILABLE;
      snprintf(why, why_len,
               "tensor '%s': step %" PRIu64 " is being applied with the other shards of the split tensor "
               "(exchanging partials); worker %u's push is not counted, retry",
               t->name, t->version, worker_id);
    } else if (fps__xrec_refuse(t, why, why_len)) {
      code = FPS_ESTATE;
    } else if (step < t->version) {
      code = FPS_ESTALE;
      snprintf(why, why_len,
               "tensor '%s': stale push: worker %u sent step %" PRIu64 " but the tensor is at version %" PRIu64
               " (that step is already applied)",
               t->name, worker_id, step, t->version);
      fps__xrec_hint(t, why, why_len);
      if (t->split) apart = t;
    } else if (step > t->version) {
      code = FPS_EAHEAD;
      snprintf(why, why_len,
               "tensor '%s': worker %u sent step %" PRIu64 ", ahead of shard: the tensor is at version %" PRIu64,
               t->name, worker_id, step, t->version);
      fps_checkpoint_ahead_hint(t, why, why_len);
      fps__xrec_hint(t, why, why_len);
      if (t->split) apart = t; /* its peers may be where the worker is */
    } else if (!sorted[i]->no_grad) {
      /* Takes the worker's place in the round's sum if it is free. */
      code = fps__reduce_join_locked(sh, sorted[i], fps__sync_member_failed_locked, why, why_len, &failed);
    }
  }
  pthread_mutex_lock(&sh->rounds_mu);
  for (size_t i = 0; i < n && code == 0; i++) {
    fps_tensor_t *t = sorted[i]->t;
    if (t->round.open && t->round.member[worker_id]) {
      code = FPS_EDUP;
      snprintf(why, why_len,
               "tensor '%s': duplicate push: worker %u already pushed step %" PRIu64
               " (waiting for the other workers); not counted twice",
               t->name, worker_id, sorted[i]->step);
    } else if (!sorted[i]->no_grad && !sorted[i]->attached) {
      code = FPS_EUNAVAILABLE;
      snprintf(why, why_len,
               "tensor '%s': another PushPull of worker %u for step %" PRIu64
               " is still streaming this tensor's gradient; retry once it has ended",
               t->name, worker_id, sorted[i]->step);
    }
  }
  fps_tensor_t *settle = NULL;
  size_t k = 0;
  if (code == 0) {
    int64_t now = fps_now_ns();
    bool any_full = false;
    for (size_t i = 0; i < n; i++) {
      fps_push_entry_t *x = sorted[i];
      fps_tensor_t *t = x->t;
      if (!t->round.open) {
        t->round.open = true;
        t->round.step = x->step;
        t->round.joined = 0;
        t->round.started_ns = now;
        t->round.deadline_ns = fps_clock_after(now, sh->cfg.deadline);
        t->round.calls_deadline_ns = INT64_MAX;
        fps__rounds_link_locked(sh, t);
      }
      int64_t d = call_deadline_ns == INT64_MAX ? INT64_MAX : call_deadline_ns - fps__round_margin(call_deadline_ns, now);
      if (d < t->round.deadline_ns) t->round.deadline_ns = d;
      if (d < t->round.calls_deadline_ns) t->round.calls_deadline_ns = d;
      t->round.member[worker_id] = x;
      t->round.joined++;
      fps_metrics_waiting_add(1);
      x->in_round = true;
      any_full |= t->round.joined == W;
    }
    /* This call linked all its rounds into one set: complete it if every
     * round of it is full now (only a round that just filled can be the
     * last one missing). */
    bool full = false;
    if (any_full) fps__set_walk_locked(sh, sorted[0]->t, &k, &full);
    if (full) {
      settle = sorted[0]->t;
      for (fps_tensor_t *x = settle; x; x = x->round.cnext) x->round.settling = true;
    }
  }
  pthread_mutex_unlock(&sh->rounds_mu);
  for (size_t i = n; i-- > 0;) pthread_mutex_unlock(&sorted[i]->t->mu);
  fps_free(sorted);
  fps__resolve_list(failed);
  if (apart) fps__xrec_announce(sh, apart);
  if (settle) fps__set_complete(sh, settle, k);
  return code;
}

size_t fps__sync_withdraw(fps_shard_t *sh, fps_push_entry_t **e, size_t n) {
  size_t k = 0;
  pthread_mutex_lock(&sh->rounds_mu);
  /* A set being completed is past withdrawing: it resolves the push. All
   * of a push's rounds are in one set, so one check covers them. */
  for (size_t i = 0; i < n; i++)
    if (e[i]->in_round && e[i]->t->round.settling) {
      pthread_mutex_unlock(&sh->rounds_mu);
      return 0;
    }
  /* Every round of the call at once: a set completing later never holds
   * part of a withdrawn call. */
  for (size_t i = 0; i < n; i++) {
    fps_tensor_t *t = e[i]->t;
    if (!e[i]->in_round) continue;
    t->round.member[e[i]->worker_id] = NULL;
    e[i]->in_round = false;
    fps_metrics_waiting_add(-1);
    if (--t->round.joined == 0) {
      t->round.open = false;
      fps__rounds_unlink_locked(sh, t);
    }
    e[i]->err = FPS_ECANCELLED;
    e[i]->withdrawn = true;
    k++;
  }
  pthread_mutex_unlock(&sh->rounds_mu);
  /* What the withdrawn entries had summed cannot be taken back out. (The
   * flag is never cleared: a push commits once, and leaving twice is a
   * no-op, so a cancel racing the commit's own withdraw is harmless.) */
  for (size_t i = 0; i < n; i++)
    if (e[i]->withdrawn) fps__sync_leave(sh, e[i]);
  return k;
}

/* t's sum holds part of the gradient of worker `worker`, whose call failed:
 * discards it and fails t's open round's set (its members' gradients were
 * in that sum), chaining them onto *list. A set being completed is left to
 * its completer, which then finds the sum gone and fails it. REQUIRES
 * t->mu. */
static void fps__sum_abort_locked(fps_shard_t *sh, fps_tensor_t *t, uint32_t worker, fps_push_entry_t **list) {
  char msg[1024];
  snprintf(msg, sizeof msg,
           "tensor '%s' step %" PRIu64 ": worker %u's call failed after part of its gradient was summed into "
           "the sync round; a sum cannot be taken apart, so the round was aborted and nothing was applied; "
           "retry the push",
           t->name, t->version, worker);
  fps__reduce_discard_locked(sh, t, FPS_EUNAVAILABLE, msg);
  pthread_mutex_lock(&sh->rounds_mu);
  if (t->round.open && !t->round.settling) {
    size_t k;
    bool full;
    fps__set_walk_locked(sh, t, &k, &full);
    fps__set_suffix(msg, sizeof msg, strlen(msg), t, k);
    fps__set_fail_locked(sh, t, FPS_EUNAVAILABLE, msg, list);
  }
  pthread_mutex_unlock(&sh->rounds_mu);
}

void fps__sync_member_failed_locked(fps_shard_t *sh, fps_push_entry_t *e, fps_push_entry_t **list) {
  fps_tensor_t *t = e->t;
  pthread_mutex_lock(&sh->rounds_mu);
  /* A set being completed is left to its completer (it finds the sum
   * short and fails the set). */
  bool member = e->in_round && t->round.open && !t->round.settling;
  pthread_mutex_unlock(&sh->rounds_mu);
  if (!member) return; /* still streaming: its next slice or its join fails */
  char msg[1024];
  snprintf(msg, sizeof msg,
           "tensor '%s' step %" PRIu64 ": worker %u's gradient held an invalid value (found when it was summed); "
           "the round was aborted and nothing was applied; retry the push",
           t->name, t->version, e->worker_id);
  fps__reduce_discard_locked(sh, t, FPS_EUNAVAILABLE, msg);
  pthread_mutex_lock(&sh->rounds_mu);
  if (e->in_round && t->round.open && !t->round.settling) {
    size_t k;
    bool full;
    fps_push_entry_t *before = *list;
    fps__set_walk_locked(sh, t, &k, &full);
    fps__set_suffix(msg, sizeof msg, strlen(msg), t, k);
    fps__set_fail_locked(sh, t, FPS_EUNAVAILABLE, msg, list);
    /* The push with the bad value is told what it was, in every round. */
    for (fps_push_entry_t *x = *list; x != before; x = x->resolve_next) {
      if (x->owner != e->owner) continue;
      char *m = fps_strdup(e->red_msg ? e->red_msg : msg);
      if (m) {
        fps_free(x->msg);
        x->msg = m;
      }
      x->err = e->red_err;
    }
  }
  pthread_mutex_unlock(&sh->rounds_mu);
}

void fps__sync_resolve(fps_push_entry_t *list) { fps__resolve_list(list); }

void fps__sync_leave(fps_shard_t *sh, fps_push_entry_t *e) {
  fps_tensor_t *t = e->t;
  fps_push_entry_t *list = NULL;
  pthread_mutex_lock(&t->mu);
  fps__reduce_wake_above_locked(sh, e); /* it no longer streams */
  if (fps__reduce_leave_locked(sh, e)) fps__sum_abort_locked(sh, t, e->worker_id, &list);
  fps__reduce_entry_free_locked(sh, e);
  pthread_mutex_unlock(&t->mu);
  fps__resolve_list(list);
}

/* The message of a set that failed at its deadline (or, with reason, was
 * failed by force), starting from the round hit: the cause is the first
 * round of the set still missing workers. */
static void fps__set_expiry_msg_locked(fps_shard_t *sh, fps_tensor_t *set, size_t k, fps_tensor_t *hit, int64_t now,
                                       const char *reason, char *msg, size_t len) {
  uint32_t W = sh->cfg.workers;
  fps_tensor_t *cause = hit;
  if (!reason)
    for (fps_tensor_t *x = set; x && cause->round.joined == W; x = x->round.cnext)
      if (x->round.joined < W) cause = x;
  size_t n = (size_t)snprintf(msg, len, "tensor '%s' step %" PRIu64 ": ", cause->name, cause->round.step);
  if (reason) {
    n += (size_t)snprintf(msg + n, len - n, "%s", reason);
  } else {
    n += (size_t)snprintf(msg + n, len - n, "sync round timed out after %.3f s waiting for workers ",
                          (double)(now - cause->round.started_ns) / 1e9);
    uint32_t missing = 0;
    for (uint32_t w = 0; w < W; w++) {
      if (cause->round.member[w]) continue;
      /* Long lists are cut; the count below stays exact. */
      if (n < len - 120) n += (size_t)snprintf(msg + n, len - n, "%s%u", missing ? ", " : "", w);
      missing++;
    }
    if (n < len)
      n += (size_t)snprintf(msg + n, len - n, " (%u of %u missing%s)", missing, W,
                            k > 1 ? "" : "; the tensor is unchanged");
  }
  fps__set_suffix(msg, len, n < len ? n : len, set, k);
}

/* ------------------------------------------------------------ expiry */

void fps__sync_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason) {
  char msg[1024];
  for (;;) {
    /* One expired set at a time: failing it unlinks its rounds. */
    fps_push_entry_t *list = NULL;
    pthread_mutex_lock(&sh->rounds_mu);
    fps_tensor_t *hit = NULL;
    for (fps_tensor_t *t = sh->rounds; t; t = t->rnext)
      if (!t->round.settling && (force || now >= t->round.deadline_ns)) {
        hit = t;
        break;
      }
    if (hit) {
      size_t k;
      bool full;
      fps__set_walk_locked(sh, hit, &k, &full);
      fps__set_expiry_msg_locked(sh, hit, k, hit, now, reason, msg, sizeof msg);
      fps__set_fail_locked(sh, hit, err, msg, &list);
    }
    pthread_mutex_unlock(&sh->rounds_mu);
    if (!hit) return;
    fps__resolve_list(list);
  }
}

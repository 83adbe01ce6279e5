/* Sync rounds: W workers' gradients for one tensor and step become one
 * update.
 *
 * A tensor has at most one open round, for step == its version. Each
 * worker's push joins with its staged gradient; the push that completes the
 * round sums the W gradients in worker-id order (so the result never
 * depends on arrival order), divides by W, applies one step through the
 * shard's one apply-and-snapshot path and resolves every member with one
 * shared snapshot of the fresh parameters. Nobody sleeps: a push that is
 * not last waits until it is resolved (its done callback runs then). A
 * round that misses its deadline fails all members with FPS_ETIMEOUT and
 * leaves the tensor untouched; a member that withdraws (its call went away)
 * is no longer counted.
 *
 * Deadlines are enforced by fps_shard_expire(), the hook the server
 * registers with its timer (server/timer.c). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "shard.h"

/* ------------------------------------------------------- open rounds */

static void fps__rounds_link(fps_shard_t *sh, fps_tensor_t *t) {
  pthread_mutex_lock(&sh->rounds_mu);
  if (!t->in_rounds) {
    t->rprev = NULL;
    t->rnext = sh->rounds;
    if (sh->rounds) sh->rounds->rprev = t;
    sh->rounds = t;
    t->in_rounds = true;
  }
  pthread_mutex_unlock(&sh->rounds_mu);
}

static void fps__rounds_unlink(fps_shard_t *sh, fps_tensor_t *t) {
  pthread_mutex_lock(&sh->rounds_mu);
  if (t->in_rounds) {
    if (t->rprev) t->rprev->rnext = t->rnext;
    else sh->rounds = t->rnext;
    if (t->rnext) t->rnext->rprev = t->rprev;
    t->rprev = t->rnext = NULL;
    t->in_rounds = false;
  }
  pthread_mutex_unlock(&sh->rounds_mu);
}

/* Closes t's round; moves its members into out[] (W slots). REQUIRES t->mu. */
static size_t fps__round_take_locked(fps_shard_t *sh, fps_tensor_t *t, fps_push_entry_t **out) {
  size_t n = 0;
  for (uint32_t w = 0; w < sh->cfg.workers; w++) {
    fps_push_entry_t *e = t->round.member[w];
    if (!e) continue;
    e->in_round = false;
    t->round.member[w] = NULL;
    out[n++] = e;
  }
  t->round.open = false;
  t->round.joined = 0;
  fps__rounds_unlink(sh, t);
  fps_metrics_waiting_add(-(int)n);
  return n;
}

/* The round is full: check that its members agree (settings, who has a
 * gradient), average in worker-id order, apply, snapshot. Members are
 * moved to out[] with their results set. REQUIRES t->mu. */
static size_t fps__round_complete_locked(fps_shard_t *sh, fps_tensor_t *t, fps_push_entry_t **out) {
  uint32_t W = sh->cfg.workers;
  fps_push_entry_t **m = t->round.member;
  uint64_t n = t->numel;
  uint64_t step = t->round.step;
  float *sum = m[0]->grad;
  char why[1024];
  bool none = false;
  if (fps_round_agree(t, m, W, &none, why, sizeof why) < 0) {
    /* A disagreement fails every member; nothing is applied. */
    size_t k = fps__round_take_locked(sh, t, out);
    for (size_t i = 0; i < k; i++) {
      out[i]->err = FPS_ESTATE;
      out[i]->msg = fps_strdup(why);
    }
    return k;
  }
  if (!none) {
    fps_metrics_step_observe(W, (double)(fps_now_ns() - t->round.started_ns) / 1e9);
    /* ((g0 + g1) + g2) + ... in fp32, then one division by W: the exact
     * arithmetic a local replay must use to match bit for bit; the SIMD
     * variants (common/simd) give exactly the plain loop's bits. */
    for (uint32_t w = 1; w < W; w++) fps_kernels_add_f32(sh->kernels, sum, m[w]->grad, (size_t)n);
    if (W > 1) fps_kernels_div_f32(sh->kernels, sum, (size_t)n, (float)W);
  }
  bool want = false;
  for (uint32_t w = 0; w < W; w++) want |= !m[w]->skip_params;
  /* The sum buffer becomes the snapshot all W share (one reference each).
   * Every worker said no_grad: nothing is applied, every member gets the
   * current params at the current version. */
  fps_snap_t *snap = NULL;
  int rc = fps__tensor_apply_locked(sh, t, sum, !none, 0, step, &m[0]->uh, want, (int)W, &snap);
  if (rc == 0 && want) m[0]->grad = NULL; /* consumed */
  uint64_t version = t->version;
  size_t k = fps__round_take_locked(sh, t, out);
  for (size_t i = 0; i < k; i++) {
    fps_push_entry_t *e = out[i];
    fps_tbuf_free(sh, e->grad, n);
    e->grad = NULL;
    if (rc < 0) {
      e->err = rc;
      e->msg = fps_strdup("the Adafactor step failed");
    } else if (!snap && !e->skip_params) {
      e->err = FPS_ENOMEM;
      e->msg = fps_strdup("out of memory for the parameter snapshot");
    } else {
      e->err = 0;
      e->version = version;
      if (snap && !e->skip_params) e->snap = snap;
      else if (snap) fps_snap_unref(snap);
    }
  }
  return k;
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
  fps_push_entry_t **done = fps_malloc((size_t)W * n * sizeof *done);
  if (!sorted || !done) {
    fps_free(sorted);
    fps_free(done);
    snprintf(why, why_len, "out of memory joining %zu sync rounds", n);
    return FPS_ENOMEM;
  }
  memcpy(sorted, e, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, fps__cmp_entry_tensor);
  for (size_t i = 0; i < n; i++) pthread_mutex_lock(&sorted[i]->t->mu);
  for (size_t i = 0; i < n && code == 0; i++) {
    fps_tensor_t *t = sorted[i]->t;
    uint64_t step = sorted[i]->step;
    if (step < t->version) {
      code = FPS_ESTALE;
      snprintf(why, why_len,
               "tensor '%s': stale push: worker %u sent step %" PRIu64 " but the tensor is at version %" PRIu64
               " (that step is already applied)",
               t->name, worker_id, step, t->version);
    } else if (step > t->version) {
      code = FPS_EAHEAD;
      snprintf(why, why_len,
               "tensor '%s': worker %u sent step %" PRIu64 ", ahead of shard: the tensor is at version %" PRIu64,
               t->name, worker_id, step, t->version);
      fps_checkpoint_ahead_hint(t, why, why_len);
    } else if (t->round.open && t->round.member[worker_id]) {
      code = FPS_EDUP;
      snprintf(why, why_len,
               "tensor '%s': duplicate push: worker %u already pushed step %" PRIu64
               " (waiting for the other workers); not counted twice",
               t->name, worker_id, step);
    }
  }
  size_t ndone = 0;
  int64_t now = fps_now_ns();
  if (code == 0) {
    for (size_t i = 0; i < n; i++) {
      fps_push_entry_t *x = sorted[i];
      fps_tensor_t *t = x->t;
      if (!t->round.open) {
        t->round.open = true;
        t->round.step = x->step;
        t->round.joined = 0;
        t->round.started_ns = now;
        __atomic_store_n(&t->round.deadline_ns, fps_clock_after(now, sh->cfg.deadline), __ATOMIC_RELAXED);
        fps__rounds_link(sh, t);
      }
      int64_t d = call_deadline_ns == INT64_MAX ? INT64_MAX : call_deadline_ns - FPS_ROUND_MARGIN_NS;
      if (d < t->round.deadline_ns) __atomic_store_n(&t->round.deadline_ns, d, __ATOMIC_RELAXED);
      t->round.member[worker_id] = x;
      t->round.joined++;
      fps_metrics_waiting_add(1);
      x->in_round = true;
      if (t->round.joined == W) ndone += fps__round_complete_locked(sh, t, done + ndone);
    }
  }
  for (size_t i = n; i-- > 0;) pthread_mutex_unlock(&sorted[i]->t->mu);
  for (size_t i = 0; i < ndone; i++) fps__push_entry_resolved(done[i]);
  fps_free(sorted);
  fps_free(done);
  return code;
}

size_t fps__sync_withdraw(fps_shard_t *sh, fps_push_entry_t **e, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    fps_tensor_t *t = e[i]->t;
    pthread_mutex_lock(&t->mu);
    if (e[i]->in_round) {
      t->round.member[e[i]->worker_id] = NULL;
      e[i]->in_round = false;
      fps_metrics_waiting_add(-1);
      if (--t->round.joined == 0) {
        t->round.open = false;
        fps__rounds_unlink(sh, t);
      }
      e[i]->err = FPS_ECANCELLED;
      k++;
    }
    pthread_mutex_unlock(&t->mu);
  }
  return k;
}

/* Fails t's round if it is still open and past its deadline (or always,
 * when force). Members are resolved without the lock held. */
static void fps__round_fail(fps_shard_t *sh, fps_tensor_t *t, int64_t now, bool force, int err,
                            const char *reason) {
  uint32_t W = sh->cfg.workers;
  fps_push_entry_t **out = fps_malloc(W * sizeof *out);
  if (!out) return; /* retried on the next tick */
  char msg[1024];
  size_t k = 0;
  pthread_mutex_lock(&t->mu);
  if (t->round.open && (force || now >= t->round.deadline_ns)) {
    size_t n = (size_t)snprintf(msg, sizeof msg, "tensor '%s' step %" PRIu64 ": ", t->name, t->round.step);
    if (reason) {
      n += (size_t)snprintf(msg + n, sizeof msg - n, "%s", reason);
    } else {
      n += (size_t)snprintf(msg + n, sizeof msg - n,
                            "sync round timed out after %.3f s waiting for workers ",
                            (double)(now - t->round.started_ns) / 1e9);
      uint32_t missing = 0;
      for (uint32_t w = 0; w < W; w++) {
        if (t->round.member[w]) continue;
        /* Long lists are cut; the count below stays exact. */
        if (n < sizeof msg - 120)
          n += (size_t)snprintf(msg + n, sizeof msg - n, "%s%u", missing ? ", " : "", w);
        missing++;
      }
      if (n < sizeof msg)
        snprintf(msg + n, sizeof msg - n, " (%u of %u missing; the tensor is unchanged)", missing, W);
    }
    k = fps__round_take_locked(sh, t, out);
  }
  pthread_mutex_unlock(&t->mu);
  for (size_t i = 0; i < k; i++) {
    out[i]->err = err;
    out[i]->msg = fps_strdup(msg);
    fps__push_entry_resolved(out[i]);
  }
  fps_free(out);
}

/* ------------------------------------------------------------ expiry */

void fps__sync_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason) {
  for (;;) {
    /* Pick one expired round at a time: failing it unlinks it. */
    fps_tensor_t *hit = NULL;
    pthread_mutex_lock(&sh->rounds_mu);
    for (fps_tensor_t *t = sh->rounds; t; t = t->rnext) {
      /* deadline_ns is written under t->mu; a stale read only delays the
       * expiry by one tick, and fps__round_fail re-checks under the lock. */
      if (force || now >= __atomic_load_n(&t->round.deadline_ns, __ATOMIC_RELAXED)) {
        hit = t;
        break;
      }
    }
    pthread_mutex_unlock(&sh->rounds_mu);
    if (!hit) return;
    fps__round_fail(sh, hit, now, force, err, reason);
    /* A round not failed (re-check said no) would be picked again: bail. */
    pthread_mutex_lock(&sh->rounds_mu);
    bool still = hit->in_rounds;
    pthread_mutex_unlock(&sh->rounds_mu);
    if (still) return;
  }
}

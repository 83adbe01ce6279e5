/* One worker's push: gradient slices for some tensors, staged, checked,
 * then applied the way the shard's mode says (see shard.h).
 *
 * Life of a push (state):
 *   RECV  fps_push_header() / fps_push_slice() per message: each slice is
 *         validated and decoded straight into its tensor's staging buffer
 *   WAIT  fps_push_commit(): sync joins the rounds (and is resolved by
 *         whoever completes them), ssp may park until the slowest worker
 *         catches up, async applies at once
 *   DONE  resolved: fps_push_result() and fps_push_take() give the outcome
 * A failure at any point leaves every tensor as it was: nothing is applied
 * before the whole push has been validated.
 *
 * Who resolves a waiting push runs its done callback: `pending` counts the
 * entries still in rounds (sync) or the ssp wait, plus one hold that
 * fps_push_commit() keeps until it returns, so the callback can never run
 * while the committing thread still touches the push.
 *
 * Copies of one tensor while a push is in flight: the parameters
 * themselves, plus (async, ssp) one staging buffer per push (the gradient
 * in fp32), which after the update becomes the reply snapshot; sync: one
 * accumulator per round that the W workers' slices are summed into as they
 * arrive, plus the slices that came ahead of the workers below them
 * (reduce.c); the accumulator becomes the one snapshot all W share. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "internal.h"

int fps_push_create(fps_shard_t *sh, int64_t deadline_ns, fps_push_done_fn done, void *arg, fps_push_t **out) {
  *out = NULL;
  fps_push_t *p = fps_calloc(1, sizeof *p);
  if (!p) return FPS_ENOMEM;
  pthread_mutex_init(&p->mu, NULL);
  p->sh = sh;
  p->state = PUSH_RECV;
  p->deadline_ns = deadline_ns;
  p->created_ns = fps_now_ns();
  p->done = done;
  p->arg = arg;
  *out = p;
  return 0;
}

void fps_push_destroy(fps_push_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->sh->held_mu);
  if (p->held) fps__push_unhold_locked(p->sh, p); /* its caller gave up on it */
  pthread_mutex_unlock(&p->sh->held_mu);
  for (size_t i = 0; i < p->n; i++) {
    fps_push_entry_t *e = p->e[i];
    if (p->sh->cfg.mode == FPS_MODE_SYNC) fps__sync_leave(p->sh, e);
    fps__tbuf_keep(p->sh, e->t, e->grad);
    fps_ranges_free(&e->got);
    fps_free(e->msg);
    fps_snap_bf16_unref(e->bf16);
    fps_snap_unref(e->snap);
    fps__apply_prep_release(&e->prep);
    fps_free(e);
  }
  fps_free(p->e);
  fps_free(p->htab);
  fps_free(p->msg);
  pthread_mutex_destroy(&p->mu);
  fps_free(p);
}

void fps_push_set_deadline(fps_push_t *p, int64_t deadline_ns) { p->deadline_ns = deadline_ns; }

int fps_push_set_id(fps_push_t *p, uint64_t push_id, char *why, size_t wl) {
  if (!p->have_id) {
    p->have_id = true;
    p->push_id = push_id;
    return 0;
  }
  if (push_id != p->push_id) {
    snprintf(why, wl, "push_id changed within one PushPull stream (%" PRIu64 " then %" PRIu64 ")", p->push_id,
             push_id);
    return FPS_EINVAL;
  }
  return 0;
}

bool fps_push_replayed(const fps_push_t *p) { return p->replayed; }

void fps_push_set_resume(fps_push_t *p, fps_push_resume_fn fn, void *arg) {
  p->resume = fn;
  p->resume_arg = arg;
}

bool fps_push_hold(fps_push_t *p) {
  fps_shard_t *sh = p->sh;
  if (sh->cfg.mode != FPS_MODE_SYNC || !p->resume) return false;
  /* Bounded by the call's deadline and by the round deadline's length. */
  int64_t now = fps_now_ns(), until = fps_clock_after(now, sh->cfg.deadline);
  if (p->deadline_ns < until) until = p->deadline_ns;
  if (now >= until || atomic_load(&p->staged) <= (int64_t)FPS_PUSH_HOLD_BYTES) return false;
  pthread_mutex_lock(&sh->held_mu);
  uint64_t wakes = p->wakes;
  pthread_mutex_unlock(&sh->held_mu);
  if (!fps__push_streaming(p)) return false;
  bool blocked = false;
  for (size_t i = 0; i < p->n && !blocked; i++) {
    fps_push_entry_t *e = p->e[i];
    pthread_mutex_lock(&e->t->mu);
    if (e->staged) blocked = fps__reduce_lower_streaming_locked(sh, e);
    pthread_mutex_unlock(&e->t->mu);
  }
  if (!blocked) return false;
  /* A wake since the count was read may have removed the reason: then the
   * caller goes on receiving (and asks again after the next message). */
  pthread_mutex_lock(&sh->held_mu);
  bool hold = p->wakes == wakes;
  if (hold) {
    p->held = true;
    p->held_until = until;
    p->held_since_ns = fps_now_ns();
    p->holds++;
    p->hprev = NULL;
    p->hnext = sh->held;
    if (sh->held) sh->held->hprev = p;
    sh->held = p;
  }
  pthread_mutex_unlock(&sh->held_mu);
  return hold;
}

/* async/ssp: applies every entry now (each under its tensor's lock); its
 * staging buffer becomes the snapshot. With replay (a retry of a push
 * already applied), nothing is applied: the snapshot is of the current
 * parameters, in every mode. Everything that can fail (settings, scratch,
 * snapshot wrappers) is checked and allocated for every tensor first, and
 * the updates themselves cannot fail: the call's tensors are applied all
 * or none. Returns false (p->err set, nothing applied) on such a failure. */
static bool fps__push_apply(fps_push_t *p, bool replay, const uint64_t *vers) {
  fps_shard_t *sh = p->sh;
  char why[FPS_WHY_MAX];
  int rc = 0;
  size_t k = 0;
  for (; k < p->n && rc == 0; k++) {
    fps_push_entry_t *e = p->e[k];
    rc = fps__apply_prepare(sh, e->t, &e->uh, !e->no_grad && !replay, &e->prep, why, sizeof why);
  }
  if (rc < 0) {
    for (size_t i = 0; i < k; i++) fps__apply_prep_release(&p->e[i]->prep);
    size_t len = strlen(why);
    if (p->n > 1)
      snprintf(why + len, sizeof why - len, "; none of the call's %zu tensors was applied", p->n);
    p->err = rc;
    p->msg = fps_strdup(why);
    return false;
  }
  /* All of the push between two images of a standby's batch (replica.c). */
  pthread_rwlock_rdlock(&sh->apply_gate);
  for (size_t i = 0; i < p->n; i++) {
    fps_push_entry_t *e = p->e[i];
    fps_tensor_t *t = e->t;
    fps_snap_t *snap = NULL;
    /* A bf16 reply: the update makes its encoding (store.c). */
    e->prep.bf16_replies = !e->skip_params && e->dtype == FPS_DTYPE_BF16;
    pthread_mutex_lock(&t->mu);
    /* no_grad: nothing to apply (no update, no weight decay); the reply
     * carries the current params. Prepared: cannot fail. */
    fps__tensor_apply_locked(sh, t, &e->grad, !e->no_grad && !replay, p->worker_id, e->step, &e->uh,
                             !e->skip_params, 1, &snap, &e->prep);
    e->bf16 = e->prep.bf16;
    e->prep.bf16 = NULL;
    e->version = t->version;
    pthread_mutex_unlock(&t->mu);
    fps__apply_prep_release(&e->prep);
    /* A retry is told the version its first attempt made (the params are
     * the current ones). */
    if (replay) e->version = vers ? vers[i] : 0;
    e->err = 0;
    e->snap = snap; /* NULL with skip_params */
    fps__tbuf_keep(sh, t, e->grad); /* not consumed: no update */
    e->grad = NULL;
  }
  if (!replay) fps__repl_key_applied(sh, p);
  pthread_rwlock_unlock(&sh->apply_gate);
  if (sh->cfg.mode == FPS_MODE_SSP && !replay) fps__ssp_advance(sh, p->worker_id, p->step);
  return true;
}

static void fps__push_apply_all(fps_push_t *p) { (void)fps__push_apply(p, false, NULL); }

/* The ssp wait's resume (ssp.c calls it when the slowest worker caught
 * up): applies the push, then releases the wait's pending count. */
static void fps__push_ssp_resume(fps_ssp_wait_t *w) {
  fps_push_t *p = w->p;
  fps__push_apply_all(p);
  if (fps__push_release(p, 1)) p->done(p, p->arg);
}

static const char fps__ssp_cancel_msg[] = "PushPull: cancelled while waiting for slower workers";

void fps_push_cancel(fps_push_t *p) {
  fps_shard_t *sh = p->sh;
  pthread_mutex_lock(&p->mu);
  p->cancelled = true;
  int state = p->state;
  pthread_mutex_unlock(&p->mu);
  /* A held push receives again, which fails on the dead call and ends it. */
  if (state == PUSH_RECV) fps__push_wake(p);
  if (state != PUSH_WAIT) return; /* RECV: the commit refuses; DONE: too late */
  if (sh->cfg.mode == FPS_MODE_SYNC) {
    size_t k = fps__sync_withdraw(sh, p->e, p->n);
    if (k && fps__push_release(p, k)) p->done(p, p->arg);
  } else if (sh->cfg.mode == FPS_MODE_SSP && fps__ssp_unpark(sh, &p->wait)) {
    fps__push_ssp_fail(p, FPS_ECANCELLED, fps__ssp_cancel_msg);
  }
}

int fps_push_result(fps_push_t *p, char *why, size_t wl) {
  if (p->err) {
    snprintf(why, wl, "%s", p->msg ? p->msg : fps_strerror(p->err));
    return p->err;
  }
  for (size_t i = 0; i < p->n; i++) {
    fps_push_entry_t *e = p->e[i];
    if (e->err) {
      snprintf(why, wl, "%s", e->msg ? e->msg : "PushPull: the call was cancelled");
      return e->err;
    }
  }
  return 0;
}

size_t fps_push_count(const fps_push_t *p) { return p->n; }

fps_snap_bf16_t *fps_push_take_bf16(fps_push_t *p, size_t i) {
  fps_snap_bf16_t *enc = p->e[i]->bf16;
  p->e[i]->bf16 = NULL;
  return enc;
}

void fps_push_take(fps_push_t *p, size_t i, fps_push_out_t *out) {
  fps_push_entry_t *e = p->e[i];
  out->t = e->t;
  out->snap = e->snap;
  e->snap = NULL;
  out->version = e->version;
  out->dtype = e->dtype;
}

int fps_push_commit(fps_push_t *p, char *why, size_t wl) {
  fps_shard_t *sh = p->sh;
  for (size_t i = 0; i < p->n; i++) {
    fps_push_entry_t *e = p->e[i];
    fps_push_settings_resolve(e);
    if (e->no_grad) continue;
    if (e->got.covered != e->t->numel) {
      uint64_t gap = fps_ranges_first_gap(&e->got, e->t->numel);
      snprintf(why, wl,
               "tensor '%s': missing slices: the gradient covers %" PRIu64 " of %" PRIu64
               " elements (first missing element %" PRIu64 ")",
               e->t->name, e->got.covered, e->t->numel, gap);
      return FPS_EINVAL;
    }
  }
  /* The last moment to refuse: a call cancelled or past its deadline by
   * now applies nothing (the transport already made sure the stream was
   * half-closed by a live caller). */
  bool late = p->deadline_ns != INT64_MAX && fps_now_ns() >= p->deadline_ns;
  pthread_mutex_lock(&p->mu);
  bool cancelled = p->cancelled;
  p->state = cancelled || late ? PUSH_DONE : PUSH_WAIT;
  p->pending = 1; /* this thread's hold until it is done here */
  p->recv_end_ns = fps_now_ns();
  pthread_mutex_unlock(&p->mu);
  /* No longer streaming: the higher workers it held back may go on. */
  for (size_t i = 0; sh->cfg.mode == FPS_MODE_SYNC && i < p->n; i++) {
    pthread_mutex_lock(&p->e[i]->t->mu);
    fps__reduce_wake_above_locked(sh, p->e[i]);
    pthread_mutex_unlock(&p->e[i]->t->mu);
  }
  if (cancelled) {
    snprintf(why, wl, "PushPull: the call was cancelled");
    return FPS_ECANCELLED;
  }
  if (late) {
    snprintf(why, wl, "PushPull: the call's deadline passed before its stream was complete; nothing was applied");
    return FPS_ETIMEOUT;
  }
  if (p->push_id != 0 && p->n > 0) {
    int rc = fps__idem_claim(&sh->idem, p->worker_id, p->push_id, &p->idem_slot);
    if (rc == FPS_EEXISTS) {
      /* A retry of a push the shard applied (its reply was lost): answer
       * it with the versions it made, apply nothing. */
      uint64_t *vers = fps_malloc(p->n * sizeof *vers);
      rc = vers ? fps__idem_versions(&sh->idem, p->worker_id, p->push_id, fps__push_tensors_hash(p), vers,
                                     (uint32_t)p->n)
                : FPS_ENOMEM;
      if (rc == 0) {
        p->replayed = fps__push_apply(p, true, vers);
        fps_free(vers);
        fps__push_release(p, 1);
        return 0;
      }
      fps_free(vers);
      pthread_mutex_lock(&p->mu);
      p->pending = 0;
      p->state = PUSH_DONE;
      pthread_mutex_unlock(&p->mu);
      if (rc == FPS_EINVAL)
        snprintf(why, wl,
                 "PushPull: push_id %" PRIu64 " of worker %u was applied to other tensors; a retry must name "
                 "the same tensors in the same order",
                 p->push_id, p->worker_id);
      else if (rc == FPS_ENOTFOUND)
        snprintf(why, wl, "PushPull: push_id %" PRIu64 " of worker %u just left the shard's window; retry",
                 p->push_id, p->worker_id);
      else
        snprintf(why, wl, "PushPull: out of memory answering a retry");
      return rc == FPS_ENOTFOUND ? FPS_EUNAVAILABLE : rc;
    }
    if (rc == FPS_EAGAIN || rc == FPS_ELIMIT) {
      pthread_mutex_lock(&p->mu);
      p->pending = 0;
      p->state = PUSH_DONE;
      pthread_mutex_unlock(&p->mu);
      if (rc == FPS_ELIMIT)
        snprintf(why, wl,
                 "PushPull: push_id %" PRIu64 " of worker %u: the shard's idempotency window is full of "
                 "pushes in flight; retry",
                 p->push_id, p->worker_id);
      else
        snprintf(why, wl,
                 "PushPull: push_id %" PRIu64 " of worker %u is still being applied by an earlier call; retry "
                 "for its result",
                 p->push_id, p->worker_id);
      return FPS_EUNAVAILABLE;
    }
    p->idem_claimed = true;
  }

  if (sh->cfg.mode == FPS_MODE_SYNC && p->n > 0) {
    pthread_mutex_lock(&p->mu);
    p->pending += p->n;
    pthread_mutex_unlock(&p->mu);
    int rc = fps__sync_join(sh, p->e, p->n, p->worker_id, p->deadline_ns, why, wl);
    if (rc < 0) {
      /* Joined none of the rounds. */
      pthread_mutex_lock(&p->mu);
      p->pending = 0;
      p->state = PUSH_DONE;
      pthread_mutex_unlock(&p->mu);
      p->err = rc;
      fps__push_settle(p); /* nothing applied: forget the key */
      p->err = 0;
      return rc;
    }
    pthread_mutex_lock(&p->mu);
    cancelled = p->cancelled;
    pthread_mutex_unlock(&p->mu);
    if (cancelled) {
      /* The cancel raced the join: take back what is still waiting. */
      size_t k = fps__sync_withdraw(sh, p->e, p->n);
      if (k) fps__push_release(p, k); /* never the last: the hold */
    }
    return fps__push_release(p, 1) ? 0 : FPS_EAGAIN;
  }
  if (sh->cfg.mode == FPS_MODE_SSP && p->n > 0) {
    p->wait.p = p;
    p->wait.resume = fps__push_ssp_resume;
    p->wait.worker_id = p->worker_id;
    p->wait.step = p->step;
    p->wait.deadline_ns = p->deadline_ns;
    pthread_mutex_lock(&p->mu);
    p->pending++; /* the wait: released by whoever resumes or fails it */
    pthread_mutex_unlock(&p->mu);
    if (!fps__ssp_admit_or_park(sh, &p->wait)) {
      pthread_mutex_lock(&p->mu);
      cancelled = p->cancelled;
      pthread_mutex_unlock(&p->mu);
      if (cancelled && fps__ssp_unpark(sh, &p->wait)) fps__push_ssp_fail(p, FPS_ECANCELLED, fps__ssp_cancel_msg);
      return fps__push_release(p, 1) ? 0 : FPS_EAGAIN;
    }
    fps__push_release(p, 1); /* admitted: the wait is over at once */
  }
  fps__push_apply_all(p);
  fps__push_release(p, 1);
  return 0;
}

int fps_push_header(fps_push_t *p, uint32_t worker_id, uint64_t step, bool skip_params, uint32_t num_workers,
                    int expect_mode, char *why, size_t wl) {
  if (!p->have_header) {
    p->have_header = true;
    p->worker_id = worker_id;
    p->step = step;
    p->skip_params = skip_params;
    p->num_workers = num_workers;
    p->expect_mode = expect_mode;
    return fps_push_header_check(&p->sh->cfg, worker_id, num_workers, expect_mode, why, wl);
  }
  if (worker_id != p->worker_id || step != p->step || num_workers != p->num_workers ||
      expect_mode != p->expect_mode) {
    snprintf(why, wl,
             "worker_id/step/num_workers/expect_mode changed within one PushPull stream (%u/%" PRIu64
             "/%u/%d then %u/%" PRIu64 "/%u/%d)",
             p->worker_id, p->step, p->num_workers, p->expect_mode, worker_id, step, num_workers, expect_mode);
    return FPS_EINVAL;
  }
  return 0;
}

static fps_push_entry_t **fps__push_slot(fps_push_t *p, const fps_tensor_t *t) {
  size_t h = ((uintptr_t)t >> 4) * UINT64_C(0x9E3779B97F4A7C15) & (p->hcap - 1);
  while (p->htab[h] && p->htab[h]->t != t) h = (h + 1) & (p->hcap - 1);
  return &p->htab[h];
}

/* The entry for t in this push, created on first sight; NULL on OOM or
 * (with *over_limit) when staging would pass max_staging_bytes. */
static fps_push_entry_t *fps__push_entry(fps_push_t *p, fps_tensor_t *t, int dtype, bool *over_limit) {
  if (p->hcap && *fps__push_slot(p, t)) return *fps__push_slot(p, t);
  if ((p->n + 1) * 2 > p->hcap) {
    size_t cap = p->hcap ? p->hcap * 2 : 16;
    fps_push_entry_t **nt = fps_calloc(cap, sizeof *nt);
    if (!nt) return NULL;
    fps_free(p->htab);
    p->htab = nt;
    p->hcap = cap;
    for (size_t i = 0; i < p->n; i++) *fps__push_slot(p, p->e[i]->t) = p->e[i];
  }
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 8;
    fps_push_entry_t **ne = fps_realloc(p->e, cap * sizeof *ne);
    if (!ne) return NULL;
    p->e = ne;
    p->cap = cap;
  }
  fps_push_entry_t *e = fps_calloc(1, sizeof *e);
  if (!e) return NULL;
  /* Sync sums into its round's accumulator instead (reduce.c). */
  if (p->sh->cfg.mode != FPS_MODE_SYNC && !(e->grad = fps__tbuf_take(p->sh, t, over_limit))) {
    fps_free(e);
    return NULL;
  }
  e->owner = p;
  e->t = t;
  e->worker_id = p->worker_id;
  e->skip_params = p->skip_params;
  e->dtype = dtype;
  e->step = p->step;
  p->e[p->n++] = e;
  *fps__push_slot(p, t) = e;
  return e;
}

/* The ready tensor `name` of this shard, or NULL with FPS_E* in *rc. */
static fps_tensor_t *fps__push_find(fps_push_t *p, const char *name, uint64_t *version, int *rc, char *why,
                                    size_t wl) {
  fps_shard_t *sh = p->sh;
  if ((*rc = fps_shard_name_check(name, why, wl)) < 0) return NULL;
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (!t) {
    snprintf(why, wl, "tensor '%s' not found on shard %u", name, sh->cfg.shard_id);
    *rc = FPS_ENOTFOUND;
    return NULL;
  }
  pthread_mutex_lock(&t->mu);
  bool ready = t->ready;
  *version = t->version;
  pthread_mutex_unlock(&t->mu);
  if (!ready) {
    snprintf(why, wl, "tensor '%s' is still initialising: push after every initial value is sent", name);
    *rc = FPS_ESTATE;
    return NULL;
  }
  return t;
}

/* A new entry for t at `step`: fails early on a sync step that cannot join
 * (the join re-checks), or on staging limits. */
static fps_push_entry_t *fps__push_new_entry(fps_push_t *p, fps_tensor_t *t, uint64_t version, int dtype,
                                             uint64_t step, int *rc, char *why, size_t wl) {
  fps_shard_t *sh = p->sh;
  /* A retry of an applied push is answered at the commit, whatever the
   * tensor's version is now. */
  bool retry = p->push_id != 0 && fps__idem_applied(&sh->idem, p->worker_id, p->push_id);
  if (sh->cfg.mode == FPS_MODE_SYNC && t->split && !retry) {
    /* Blocks apart for good: before "ahead"/"stale", whose hint (pull,
     * push again) cannot help. */
    pthread_mutex_lock(&t->mu);
    bool apart = fps__xrec_refuse(t, why, wl);
    pthread_mutex_unlock(&t->mu);
    if (apart) {
      *rc = FPS_ESTATE;
      return NULL;
    }
  }
  if (sh->cfg.mode == FPS_MODE_SYNC && step != version && !retry) {
    snprintf(why, wl,
             step < version
                 ? "tensor '%s': stale push: worker %u sent step %" PRIu64 " but the tensor is at version %" PRIu64
                 : "tensor '%s': worker %u sent step %" PRIu64 ", ahead of shard: the tensor is at version %" PRIu64,
             t->name, p->worker_id, step, version);
    if (step > version) fps_checkpoint_ahead_hint(t, why, wl);
    *rc = step < version ? FPS_ESTALE : FPS_EAHEAD;
    return NULL;
  }
  bool over = false;
  fps_push_entry_t *e = fps__push_entry(p, t, dtype, &over);
  if (!e && over) {
    snprintf(why, wl,
             "tensor '%s': staging its %" PRIu64 "-byte gradient would pass the shard's limit of %" PRIu64
             " bytes for in-flight tensors (--max-staging-bytes); retry later",
             t->name, t->numel * 4, sh->cfg.max_staging_bytes);
    *rc = FPS_ELIMIT;
    return NULL;
  }
  if (!e) {
    snprintf(why, wl, "tensor '%s': out of memory staging a %" PRIu64 "-element gradient", t->name, t->numel);
    *rc = FPS_ENOMEM;
    return NULL;
  }
  e->step = step;
  e->replay_only = retry && sh->cfg.mode == FPS_MODE_SYNC;
  return e;
}

int fps_push_tensor(fps_push_t *p, const fps_push_tensor_t *tp, char *why, size_t wl) {
  const char *name = tp->name ? tp->name : "";
  int rc;
  uint64_t version;
  fps_tensor_t *t = fps__push_find(p, name, &version, &rc, why, wl);
  if (!t) return rc;
  fps_push_entry_t *e = p->hcap ? *fps__push_slot(p, t) : NULL;
  if (e && e->has_push) {
    snprintf(why, wl, "tensor '%s': named by two TensorPush entries in one PushPull call (at most one each)", name);
    return FPS_EINVAL;
  }
  if (e) {
    snprintf(why, wl,
             "tensor '%s': its TensorPush came after its first gradient slice; send it in the same message "
             "as that slice or earlier",
             name);
    return FPS_EINVAL;
  }
  if (tp->skip_step && !tp->no_grad) {
    snprintf(why, wl, "tensor '%s': skip_step needs no_grad (a skipped step sends no gradient)", name);
    return FPS_EINVAL;
  }
  rc = fps_push_settings_check(t, tp->has_lr, tp->lr, tp->has_weight_decay, tp->weight_decay, why, wl);
  if (rc < 0) return rc;
  e = fps__push_new_entry(p, t, version, FPS_DTYPE_F32, tp->has_step ? tp->step : p->step, &rc, why, wl);
  if (!e) return rc;
  e->has_push = true;
  e->has_lr = tp->has_lr;
  e->lr = tp->lr;
  e->has_weight_decay = tp->has_weight_decay;
  e->weight_decay = tp->weight_decay;
  e->no_grad = tp->no_grad;
  e->skip_step = tp->skip_step;
  return 0;
}

int fps_push_slice(fps_push_t *p, const char *name, const fps_slice_t *s, char *why, size_t wl) {
  fps_shard_t *sh = p->sh;
  int rc;
  uint64_t version;
  fps_tensor_t *t = fps__push_find(p, name, &version, &rc, why, wl);
  if (!t) return rc;
  uint64_t count;
  if ((rc = fps_shard_slice_check(name, s, &t->shape, t->numel, true, &count, why, wl)) < 0) return rc;
  /* Sync: a staged slice of this push (maybe of another tensor) held a
   * bad value when it was summed; nothing more of it is kept. */
  fps_push_entry_t *bad_entry = atomic_load_explicit(&p->bad_staged, memory_order_acquire);
  if (bad_entry) {
    snprintf(why, wl, "%s", bad_entry->red_msg ? bad_entry->red_msg : fps_strerror(bad_entry->red_err));
    return bad_entry->red_err;
  }
  fps_push_entry_t *e = p->hcap ? *fps__push_slot(p, t) : NULL;
  if (!e) {
    e = fps__push_new_entry(p, t, version, s->dtype, p->step, &rc, why, wl);
    if (!e) return rc;
  } else if (e->no_grad) {
    snprintf(why, wl, "tensor '%s': gradient slices sent for a tensor its TensorPush marks no_grad", name);
    return FPS_EINVAL;
  }
  if (!e->has_slices) e->dtype = s->dtype; /* the first slice's dtype: the reply's */
  e->has_slices = true;
  rc = fps_ranges_add(&e->got, s->offset, s->offset + count);
  if (rc == FPS_EEXISTS) {
    snprintf(why, wl, "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") overlaps a slice already received", name,
             s->offset, s->offset + count);
    return FPS_EINVAL;
  }
  if (rc < 0) {
    snprintf(why, wl, "tensor '%s': out of memory", name);
    return FPS_ENOMEM;
  }
  if (sh->cfg.mode == FPS_MODE_SYNC) {
    /* Summed into the round as it arrives, or staged until it can be;
     * piece by piece when the data is in several buffers. */
    fps_push_entry_t *failed = NULL; /* pushes a bad staged value failed */
    pthread_mutex_lock(&t->mu);
    if (!s->src) {
      rc = fps__reduce_slice_locked(sh, e, s, count, fps__sync_member_failed_locked, why, wl, &failed);
    } else {
      const uint8_t *piece;
      uint64_t k, done = 0;
      size_t esz = fps_dtype_size(s->dtype);
      rc = 0;
      while (rc == 0 && done < count && (k = s->src->next(s->src->ctx, &piece)) > 0) {
        if (k > count - done) k = count - done;
        fps_slice_t part = *s;
        part.offset = s->offset + done;
        part.data = piece;
        part.len = (size_t)k * esz;
        part.src = NULL;
        /* An element cut between buffers was copied out: not held. */
        if (piece == s->src->bounce) part.owner = NULL;
        rc = fps__reduce_slice_locked(sh, e, &part, k, fps__sync_member_failed_locked, why, wl, &failed);
        done += k;
      }
      if (rc == 0 && done < count) {
        snprintf(why, wl, "tensor '%s': slice data ends after %" PRIu64 " of %" PRIu64 " elements", name, done,
                 count);
        rc = FPS_EPROTO;
      }
    }
    pthread_mutex_unlock(&t->mu);
    fps__sync_resolve(failed);
    if (rc < 0) return rc;
  } else {
    /* Check, convert and stage in one pass, piece by piece when the data is
     * in several buffers (each piece whole elements). */
    uint64_t bad = count, done = 0;
    float badv = 0;
    if (!s->src) {
      bad = fps_dtype_grad_decode(sh->kernels, s->dtype, e->grad + s->offset, s->data, count);
      if (bad < count) badv = fps_dtype_value(s->dtype, s->data, bad);
    } else {
      const uint8_t *piece;
      uint64_t k;
      while (done < count && (k = s->src->next(s->src->ctx, &piece)) > 0) {
        if (k > count - done) k = count - done;
        uint64_t b = fps_dtype_grad_decode(sh->kernels, s->dtype, e->grad + s->offset + done, piece, k);
        if (b < k) {
          bad = done + b;
          badv = fps_dtype_value(s->dtype, piece, b);
          break;
        }
        done += k;
      }
      if (bad == count && done < count) {
        snprintf(why, wl, "tensor '%s': slice data ends after %" PRIu64 " of %" PRIu64 " elements", name, done,
                 count);
        return FPS_EPROTO;
      }
    }
    if (bad < count) {
      fps__reduce_bad_value_why(why, wl, name, s->offset + bad, badv);
      return FPS_EINVAL;
    }
  }
  return 0;
}

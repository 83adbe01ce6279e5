/* Coordination between workers: sync rounds, ssp waits and the timer
 * thread that enforces every deadline.
 *
 * sync: a tensor has at most one open round, for step == its version. Each
 * worker's call joins with its staged gradient; the call that completes the
 * round sums the W gradients in worker-id order (so the result never
 * depends on arrival order), divides by W, applies one step and resolves
 * every member with one shared snapshot of the fresh parameters. Nobody
 * sleeps: a call that is not last simply has no batch in flight until it is
 * resolved. A round that misses its deadline fails all members with
 * DEADLINE_EXCEEDED and leaves the tensor untouched.
 *
 * ssp: a call from a worker more than S steps ahead of the slowest waits in
 * a list until fps_ssp_advance() lets it go or the timer fails it.
 *
 * Deadlines are enforced by the timer thread (timer.c) through the hook
 * registered in fps_sync_start(). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "server.h"

/* A round fails this long before its earliest member's own deadline, so
 * the members hear which workers were missing rather than a bare
 * DEADLINE_EXCEEDED from their own gRPC timer. */
#define FPS_ROUND_MARGIN_NS INT64_C(200000000)

/* ------------------------------------------------------- open rounds */

static void fps__rounds_link(fps_server_t *srv, fps_tensor_t *t) {
  pthread_mutex_lock(&srv->rounds_mu);
  if (!t->in_rounds) {
    t->rprev = NULL;
    t->rnext = srv->rounds;
    if (srv->rounds) srv->rounds->rprev = t;
    srv->rounds = t;
    t->in_rounds = true;
  }
  pthread_mutex_unlock(&srv->rounds_mu);
}

static void fps__rounds_unlink(fps_server_t *srv, fps_tensor_t *t) {
  pthread_mutex_lock(&srv->rounds_mu);
  if (t->in_rounds) {
    if (t->rprev) t->rprev->rnext = t->rnext;
    else srv->rounds = t->rnext;
    if (t->rnext) t->rnext->rprev = t->rprev;
    t->rprev = t->rnext = NULL;
    t->in_rounds = false;
  }
  pthread_mutex_unlock(&srv->rounds_mu);
}

/* Closes t's round; moves its members into out[] (W slots). REQUIRES t->mu. */
static size_t fps__round_take_locked(fps_server_t *srv, fps_tensor_t *t, fps_push_entry_t **out) {
  size_t n = 0;
  for (uint32_t w = 0; w < srv->cfg.workers; w++) {
    fps_push_entry_t *e = t->round.member[w];
    if (!e) continue;
    e->in_round = false;
    t->round.member[w] = NULL;
    out[n++] = e;
  }
  t->round.open = false;
  t->round.joined = 0;
  fps__rounds_unlink(srv, t);
  fps_metrics_waiting_add(-(int)n);
  return n;
}

/* The round is full: check that its members agree (settings, who has a
 * gradient), average in worker-id order, apply, snapshot. Members are
 * moved to out[] with their results set. REQUIRES t->mu. */
static size_t fps__round_complete_locked(fps_server_t *srv, fps_tensor_t *t, fps_push_entry_t **out) {
  uint32_t W = srv->cfg.workers;
  fps_push_entry_t **m = t->round.member;
  uint64_t n = t->numel;
  uint64_t step = t->round.step;
  float *sum = m[0]->grad;
  char why[1024];
  bool none = false;
  if (fps_round_agree(t, m, W, &none, why, sizeof why) < 0) {
    /* A disagreement fails every member; nothing is applied. */
    size_t k = fps__round_take_locked(srv, t, out);
    for (size_t i = 0; i < k; i++) {
      out[i]->code = GRPC_STATUS_FAILED_PRECONDITION;
      out[i]->msg = strdup(why);
    }
    return k;
  }
  if (none) {
    /* Every worker said no_grad: the round completes with nothing applied;
     * every member gets the current params at the current version. */
    bool want = false;
    for (uint32_t w = 0; w < W; w++) want |= !m[w]->skip_params;
    fps_snap_t *snap = NULL;
    if (want) {
      memcpy(sum, t->param, n * sizeof(float));
      m[0]->grad = NULL;
      snap = fps_snap_wrap(srv, sum, n, t->version, (int)W);
    }
    uint64_t version = t->version;
    size_t k = fps__round_take_locked(srv, t, out);
    for (size_t i = 0; i < k; i++) {
      fps_push_entry_t *e = out[i];
      fps_tbuf_free(srv, e->grad, n);
      e->grad = NULL;
      if (!snap && want && !e->skip_params) {
        e->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        e->msg = strdup("out of memory for the parameter snapshot");
        continue;
      }
      e->code = GRPC_STATUS_OK;
      e->version = version;
      if (snap && !e->skip_params) e->snap = snap;
      else if (snap) fps_snap_unref(snap);
    }
    return k;
  }
  fps_metrics_step_observe(W, (double)(fps_now_ns() - t->round.started_ns) / 1e9);
  /* ((g0 + g1) + g2) + ... in fp32, then one division by W: the exact
   * arithmetic a local replay must use to match bit for bit; the SIMD
   * variants (common/simd) give exactly the plain loop's bits. */
  for (uint32_t w = 1; w < W; w++) fps_kernels_add_f32(srv->kernels, sum, m[w]->grad, (size_t)n);
  if (W > 1) fps_kernels_div_f32(srv->kernels, sum, (size_t)n, (float)W);
  int rc = fps__tensor_apply_locked(srv, t, sum, 0, step, &m[0]->uh);
  fps_snap_t *snap = NULL;
  if (rc == 0) {
    bool want = false;
    for (uint32_t w = 0; w < W; w++) want |= !m[w]->skip_params;
    if (want) {
      /* The sum buffer is spent: it becomes the snapshot all W share. */
      memcpy(sum, t->param, n * sizeof(float));
      m[0]->grad = NULL;
      snap = fps_snap_wrap(srv, sum, n, t->version, (int)W);
    }
  }
  uint64_t version = t->version;
  size_t k = fps__round_take_locked(srv, t, out);
  for (size_t i = 0; i < k; i++) {
    fps_push_entry_t *e = out[i];
    fps_tbuf_free(srv, e->grad, n);
    e->grad = NULL;
    if (rc < 0) {
      e->code = GRPC_STATUS_INTERNAL;
      e->msg = strdup("the Adafactor step failed");
    } else if (!snap && !e->skip_params) {
      e->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
      e->msg = strdup("out of memory for the parameter snapshot");
    } else {
      e->code = GRPC_STATUS_OK;
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

grpc_status_code fps_sync_join(fps_server_t *srv, fps_push_entry_t **e, size_t n, uint32_t worker_id,
                               int64_t call_deadline_ns, char *why, size_t why_len) {
  uint32_t W = srv->cfg.workers;
  grpc_status_code code = GRPC_STATUS_OK;
  /* Lock every tensor of the call in address order (no deadlock with a
   * call that names the same tensors in another order), check them all,
   * then join them all: a call joins every round or none. */
  fps_push_entry_t **sorted = malloc(n * sizeof *sorted);
  fps_push_entry_t **done = malloc((size_t)W * n * sizeof *done);
  if (!sorted || !done) {
    free(sorted);
    free(done);
    snprintf(why, why_len, "out of memory joining %zu sync rounds", n);
    return GRPC_STATUS_RESOURCE_EXHAUSTED;
  }
  memcpy(sorted, e, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, fps__cmp_entry_tensor);
  for (size_t i = 0; i < n; i++) pthread_mutex_lock(&sorted[i]->t->mu);
  for (size_t i = 0; i < n && code == GRPC_STATUS_OK; i++) {
    fps_tensor_t *t = sorted[i]->t;
    uint64_t step = sorted[i]->step;
    if (step < t->version) {
      code = GRPC_STATUS_FAILED_PRECONDITION;
      snprintf(why, why_len,
               "tensor '%s': stale push: worker %u sent step %" PRIu64 " but the tensor is at version %" PRIu64
               " (that step is already applied)",
               t->name, worker_id, step, t->version);
    } else if (step > t->version) {
      code = GRPC_STATUS_FAILED_PRECONDITION;
      snprintf(why, why_len,
               "tensor '%s': worker %u sent step %" PRIu64 ", ahead of shard: the tensor is at version %" PRIu64,
               t->name, worker_id, step, t->version);
      fps_checkpoint_ahead_hint(t, why, why_len);
    } else if (t->round.open && t->round.member[worker_id]) {
      code = GRPC_STATUS_ALREADY_EXISTS;
      snprintf(why, why_len,
               "tensor '%s': duplicate push: worker %u already pushed step %" PRIu64
               " (waiting for the other workers); not counted twice",
               t->name, worker_id, step);
    }
  }
  size_t ndone = 0;
  int64_t now = fps_now_ns();
  if (code == GRPC_STATUS_OK) {
    for (size_t i = 0; i < n; i++) {
      fps_push_entry_t *x = sorted[i];
      fps_tensor_t *t = x->t;
      if (!t->round.open) {
        t->round.open = true;
        t->round.step = x->step;
        t->round.joined = 0;
        t->round.started_ns = now;
        __atomic_store_n(&t->round.deadline_ns, fps_clock_after(now, srv->cfg.deadline), __ATOMIC_RELAXED);
        fps__rounds_link(srv, t);
      }
      int64_t d = call_deadline_ns == INT64_MAX ? INT64_MAX : call_deadline_ns - FPS_ROUND_MARGIN_NS;
      if (d < t->round.deadline_ns) __atomic_store_n(&t->round.deadline_ns, d, __ATOMIC_RELAXED);
      t->round.member[worker_id] = x;
      t->round.joined++;
      fps_metrics_waiting_add(1);
      x->in_round = true;
      if (t->round.joined == W) ndone += fps__round_complete_locked(srv, t, done + ndone);
    }
  }
  for (size_t i = n; i-- > 0;) pthread_mutex_unlock(&sorted[i]->t->mu);
  for (size_t i = 0; i < ndone; i++) fps_pushpull_resolved(done[i]);
  free(sorted);
  free(done);
  return code;
}

size_t fps_sync_withdraw(fps_server_t *srv, fps_push_entry_t **e, size_t n) {
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
        fps__rounds_unlink(srv, t);
      }
      e[i]->code = GRPC_STATUS_CANCELLED;
      k++;
    }
    pthread_mutex_unlock(&t->mu);
  }
  return k;
}

/* Fails t's round if it is still open and past its deadline (or always,
 * when force). Members are resolved without the lock held. */
static void fps__round_fail(fps_server_t *srv, fps_tensor_t *t, int64_t now, bool force,
                            grpc_status_code code, const char *reason) {
  uint32_t W = srv->cfg.workers;
  fps_push_entry_t **out = malloc(W * sizeof *out);
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
    k = fps__round_take_locked(srv, t, out);
  }
  pthread_mutex_unlock(&t->mu);
  for (size_t i = 0; i < k; i++) {
    out[i]->code = code;
    out[i]->msg = strdup(msg);
    fps_pushpull_resolved(out[i]);
  }
  free(out);
}

/* --------------------------------------------------------------- ssp */

static uint64_t fps__ssp_min_locked(fps_server_t *srv) {
  uint64_t m = UINT64_MAX;
  for (uint32_t w = 0; w < srv->cfg.workers; w++)
    if (srv->ssp_clock[w] < m) m = srv->ssp_clock[w];
  return m;
}

bool fps_ssp_admit_or_park(fps_server_t *srv, fps_ssp_wait_t *w) {
  pthread_mutex_lock(&srv->ssp_mu);
  uint64_t min = fps__ssp_min_locked(srv);
  bool go = w->step <= min + srv->cfg.staleness;
  fps_metrics_staleness_observe(w->step > min ? w->step - min : 0);
  if (!go) {
    fps_metrics_waiting_add(1);
    w->parked = true;
    w->prev = NULL;
    w->next = srv->ssp_waits;
    if (srv->ssp_waits) srv->ssp_waits->prev = w;
    srv->ssp_waits = w;
  }
  pthread_mutex_unlock(&srv->ssp_mu);
  return go;
}

static void fps__ssp_unlink_locked(fps_server_t *srv, fps_ssp_wait_t *w) {
  if (w->prev) w->prev->next = w->next;
  else srv->ssp_waits = w->next;
  if (w->next) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  w->parked = false;
  fps_metrics_waiting_add(-1);
}

bool fps_ssp_unpark(fps_server_t *srv, fps_ssp_wait_t *w) {
  pthread_mutex_lock(&srv->ssp_mu);
  bool was = w->parked;
  if (was) fps__ssp_unlink_locked(srv, w);
  pthread_mutex_unlock(&srv->ssp_mu);
  return was;
}

void fps_ssp_advance(fps_server_t *srv, uint32_t worker_id, uint64_t step) {
  fps_ssp_wait_t *go = NULL;
  pthread_mutex_lock(&srv->ssp_mu);
  if (worker_id < srv->cfg.workers && srv->ssp_clock[worker_id] < step + 1) srv->ssp_clock[worker_id] = step + 1;
  uint64_t min = fps__ssp_min_locked(srv);
  for (fps_ssp_wait_t *w = srv->ssp_waits, *nx; w; w = nx) {
    nx = w->next;
    if (w->step <= min + srv->cfg.staleness) {
      fps__ssp_unlink_locked(srv, w);
      w->next = go;
      go = w;
    }
  }
  pthread_mutex_unlock(&srv->ssp_mu);
  while (go) {
    fps_ssp_wait_t *nx = go->next;
    go->next = NULL;
    fps_pushpull_ssp_resume(go->pp);
    go = nx;
  }
}

/* Fails parked ssp calls past their deadline (or all, when force). */
static void fps__ssp_expire(fps_server_t *srv, int64_t now, bool force, grpc_status_code code, const char *reason) {
  fps_ssp_wait_t *fail = NULL;
  uint64_t min;
  pthread_mutex_lock(&srv->ssp_mu);
  min = fps__ssp_min_locked(srv);
  for (fps_ssp_wait_t *w = srv->ssp_waits, *nx; w; w = nx) {
    nx = w->next;
    if (force || now >= w->deadline_ns) {
      fps__ssp_unlink_locked(srv, w);
      w->next = fail;
      fail = w;
    }
  }
  pthread_mutex_unlock(&srv->ssp_mu);
  while (fail) {
    fps_ssp_wait_t *nx = fail->next;
    char msg[512];
    if (reason)
      snprintf(msg, sizeof msg, "%s", reason);
    else
      snprintf(msg, sizeof msg,
               "ssp: worker %u at step %" PRIu64 " is more than %u steps ahead of the slowest worker (step %" PRIu64
               ") and the deadline passed while waiting",
               fail->worker_id, fail->step, srv->cfg.staleness, min);
    fail->next = NULL;
    fps_pushpull_ssp_fail(fail->pp, code, msg);
    fail = nx;
  }
}

/* ------------------------------------------------------------- timer */

static void fps__expire_rounds(fps_server_t *srv, int64_t now, bool force, grpc_status_code code,
                               const char *reason) {
  for (;;) {
    /* Pick one expired round at a time: failing it unlinks it. */
    fps_tensor_t *hit = NULL;
    pthread_mutex_lock(&srv->rounds_mu);
    for (fps_tensor_t *t = srv->rounds; t; t = t->rnext) {
      /* deadline_ns is written under t->mu; a stale read only delays the
       * expiry by one tick, and fps__round_fail re-checks under the lock. */
      if (force || now >= __atomic_load_n(&t->round.deadline_ns, __ATOMIC_RELAXED)) {
        hit = t;
        break;
      }
    }
    pthread_mutex_unlock(&srv->rounds_mu);
    if (!hit) return;
    fps__round_fail(srv, hit, now, force, code, reason);
    /* A round not failed (re-check said no) would be picked again: bail. */
    pthread_mutex_lock(&srv->rounds_mu);
    bool still = hit->in_rounds;
    pthread_mutex_unlock(&srv->rounds_mu);
    if (still) return;
  }
}

/* Timer hook: fails rounds and ssp waits past their deadline. */
static void fps__sync_expire(void *arg, int64_t now) {
  fps_server_t *srv = arg;
  fps__expire_rounds(srv, now, false, GRPC_STATUS_DEADLINE_EXCEEDED, NULL);
  fps__ssp_expire(srv, now, false, GRPC_STATUS_DEADLINE_EXCEEDED, NULL);
}

int fps_sync_start(fps_server_t *srv) {
  srv->ssp_clock = calloc(srv->cfg.workers, sizeof *srv->ssp_clock);
  if (!srv->ssp_clock) return FPS_ENOMEM;
  return fps_timer_add(srv->timer, fps__sync_expire, srv);
}

void fps_sync_stop(fps_server_t *srv) {
  free(srv->ssp_clock);
  srv->ssp_clock = NULL;
}

void fps_sync_fail_all(fps_server_t *srv, grpc_status_code code, const char *why) {
  int64_t now = fps_now_ns();
  fps__expire_rounds(srv, now, true, code, why);
  fps__ssp_expire(srv, now, true, code, why);
}

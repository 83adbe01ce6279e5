/* ssp waits: a push from a worker more than S (--staleness) steps ahead
 * of the slowest worker waits in a list until fps__ssp_advance() (the
 * slowest worker finished a push) lets it go, its call goes away
 * (fps__ssp_unpark) or its deadline passes (fps__ssp_expire, from the
 * expiry hook). A worker's clock is the number of its pushes completed:
 * after a push of step s it is s + 1. Every clock starts at the step of the
 * first push the shard sees: 0 for a new job, the job's step for a shard
 * that restarted from a checkpoint or whose tensors were resumed at a step
 * (with clocks at 0 there, every worker would wait for workers that are
 * not behind at all, until the deadline). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "internal.h"

static uint64_t fps__ssp_min_locked(fps_shard_t *sh) {
  uint64_t m = UINT64_MAX;
  for (uint32_t w = 0; w < sh->cfg.workers; w++)
    if (sh->ssp_clock[w] < m) m = sh->ssp_clock[w];
  return m;
}

bool fps__ssp_admit_or_park(fps_shard_t *sh, fps_ssp_wait_t *w) {
  pthread_mutex_lock(&sh->ssp_mu);
  if (!sh->ssp_started) {
    for (uint32_t k = 0; k < sh->cfg.workers; k++) sh->ssp_clock[k] = w->step;
    sh->ssp_started = true;
  }
  uint64_t min = fps__ssp_min_locked(sh);
  bool go = w->step <= min + sh->cfg.staleness;
  fps_metrics_staleness_observe(w->step > min ? w->step - min : 0);
  if (!go) {
    fps_metrics_waiting_add(1);
    w->parked = true;
    w->prev = NULL;
    w->next = sh->ssp_waits;
    if (sh->ssp_waits) sh->ssp_waits->prev = w;
    sh->ssp_waits = w;
  }
  pthread_mutex_unlock(&sh->ssp_mu);
  return go;
}

static void fps__ssp_unlink_locked(fps_shard_t *sh, fps_ssp_wait_t *w) {
  if (w->prev) w->prev->next = w->next;
  else sh->ssp_waits = w->next;
  if (w->next) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  w->parked = false;
  fps_metrics_waiting_add(-1);
}

bool fps__ssp_unpark(fps_shard_t *sh, fps_ssp_wait_t *w) {
  pthread_mutex_lock(&sh->ssp_mu);
  bool was = w->parked;
  if (was) fps__ssp_unlink_locked(sh, w);
  pthread_mutex_unlock(&sh->ssp_mu);
  return was;
}

void fps__ssp_advance(fps_shard_t *sh, uint32_t worker_id, uint64_t step) {
  fps_ssp_wait_t *go = NULL;
  pthread_mutex_lock(&sh->ssp_mu);
  if (worker_id < sh->cfg.workers && sh->ssp_clock[worker_id] < step + 1) sh->ssp_clock[worker_id] = step + 1;
  uint64_t min = fps__ssp_min_locked(sh);
  for (fps_ssp_wait_t *w = sh->ssp_waits, *nx; w; w = nx) {
    nx = w->next;
    if (w->step <= min + sh->cfg.staleness) {
      fps__ssp_unlink_locked(sh, w);
      w->next = go;
      go = w;
    }
  }
  pthread_mutex_unlock(&sh->ssp_mu);
  while (go) {
    fps_ssp_wait_t *nx = go->next;
    go->next = NULL;
    go->resume(go);
    go = nx;
  }
}

void fps__ssp_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason) {
  fps_ssp_wait_t *fail = NULL;
  uint64_t min;
  pthread_mutex_lock(&sh->ssp_mu);
  min = fps__ssp_min_locked(sh);
  for (fps_ssp_wait_t *w = sh->ssp_waits, *nx; w; w = nx) {
    nx = w->next;
    if (force || now >= w->deadline_ns) {
      fps__ssp_unlink_locked(sh, w);
      w->next = fail;
      fail = w;
    }
  }
  pthread_mutex_unlock(&sh->ssp_mu);
  while (fail) {
    fps_ssp_wait_t *nx = fail->next;
    char msg[512];
    if (reason)
      snprintf(msg, sizeof msg, "%s", reason);
    else
      snprintf(msg, sizeof msg,
               "ssp: worker %u at step %" PRIu64 " is more than %u steps ahead of the slowest worker (step %" PRIu64
               ") and the deadline passed while waiting",
               fail->worker_id, fail->step, sh->cfg.staleness, min);
    fail->next = NULL;
    fps__push_ssp_fail(fail->p, err, msg);
    fail = nx;
  }
}


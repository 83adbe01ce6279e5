/* What the files below push.c may do to a push, and how a push is
 * resolved: wake it (its caller was held back, fps_push_hold), ask whether
 * it still streams, count its staged bytes, mark a bad staged value, walk
 * its entries, and release its pending counts: the last release settles
 * its idempotency key and runs its done callback. sync.c, reduce.c,
 * ssp.c and xstep.c call these; none of them calls back up into push.c
 * (an ssp wait resumes its push through the wait's own callback). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"

size_t fps__push_entries(fps_push_t *p, uint64_t walk, fps_push_entry_t ***out) {
  if (p->walk == walk) return 0; /* this walk has seen its entries */
  p->walk = walk;
  *out = p->e;
  return p->n;
}

/* Which tensors, in which order: a retry must name the same. Hashed by
 * name, not by address, so that a standby replica that took the key from
 * its primary (replica.c) recognises the retry too. */
uint64_t fps__push_tensors_hash(const fps_push_t *p) {
  uint64_t h = UINT64_C(1469598103934665603);
  for (size_t i = 0; i < p->n; i++) {
    for (const unsigned char *c = (const unsigned char *)p->e[i]->t->name; *c; c++)
      h = (h ^ *c) * UINT64_C(1099511628211);
    h = (h ^ 0x100) * UINT64_C(1099511628211); /* the end of a name */
  }
  return h;
}

/* The push is resolved: remember its key if every tensor was applied
 * (a retry is then answered, not applied), forget it otherwise. */
void fps__push_settle(fps_push_t *p) {
  if (!p->idem_claimed) return;
  bool applied = p->err == 0;
  for (size_t i = 0; applied && i < p->n; i++) applied = p->e[i]->err == 0;
  p->idem_claimed = false;
  uint64_t inl[FPS_IDEM_INLINE];
  uint64_t *v = !applied ? NULL : p->n <= FPS_IDEM_INLINE ? inl : fps_malloc(p->n * sizeof *v);
  for (size_t i = 0; v && i < p->n; i++) v[i] = p->e[i]->version;
  fps__idem_settle(&p->sh->idem, p->idem_slot, p->worker_id, p->push_id, fps__push_tensors_hash(p), v,
                   (uint32_t)p->n);
  if (v != inl) fps_free(v);
}

/* Drops k pending counts; true when that resolved the push. */
bool fps__push_release(fps_push_t *p, size_t k) {
  pthread_mutex_lock(&p->mu);
  p->pending -= k;
  bool last = p->pending == 0;
  if (last) p->state = PUSH_DONE;
  pthread_mutex_unlock(&p->mu);
  if (last) fps__push_settle(p);
  return last;
}

uint64_t fps__push_key(const fps_push_t *p) { return p->push_id; }

void fps__push_staged_add(fps_push_t *p, int64_t bytes) {
  atomic_fetch_add(&p->staged, bytes);
  fps_shard_t *sh = p->sh;
  int64_t now = atomic_fetch_add(&sh->staged_bytes, bytes) + bytes;
  int64_t peak = atomic_load(&sh->staged_peak);
  while (now > peak && !atomic_compare_exchange_weak(&sh->staged_peak, &peak, now)) {
  }
}

void fps_shard_staging_peaks(fps_shard_t *sh, uint64_t *buffers, uint64_t *staged) {
  *buffers = atomic_load(&sh->tbuf_peak);
  int64_t s = atomic_load(&sh->staged_peak);
  *staged = s > 0 ? (uint64_t)s : 0;
}

void fps__push_staged_failed(fps_push_t *p, fps_push_entry_t *e) {
  fps_push_entry_t *none = NULL;
  atomic_compare_exchange_strong_explicit(&p->bad_staged, &none, e, memory_order_release, memory_order_relaxed);
}

bool fps__push_streaming(fps_push_t *p) {
  pthread_mutex_lock(&p->mu);
  bool on = p->state == PUSH_RECV && !p->cancelled;
  pthread_mutex_unlock(&p->mu);
  return on;
}

/* Unlinks a held push. REQUIRES sh->held_mu. */
void fps__push_unhold_locked(fps_shard_t *sh, fps_push_t *p) {
  p->held = false;
  p->held_ns += fps_now_ns() - p->held_since_ns;
  if (p->hprev) p->hprev->hnext = p->hnext;
  else sh->held = p->hnext;
  if (p->hnext) p->hnext->hprev = p->hprev;
  p->hprev = p->hnext = NULL;
}

void fps__push_wake(fps_push_t *p) {
  fps_shard_t *sh = p->sh;
  pthread_mutex_lock(&sh->held_mu);
  p->wakes++;
  bool was = p->held;
  if (was) fps__push_unhold_locked(sh, p);
  pthread_mutex_unlock(&sh->held_mu);
  /* Whoever unlinks a held push resumes it; until then the caller has no
   * receive pending and the push cannot be freed. */
  if (was) p->resume(p, p->resume_arg);
}

void fps__push_expire_holds(fps_shard_t *sh, int64_t now, bool force) {
  for (;;) {
    fps_push_t *hit = NULL;
    pthread_mutex_lock(&sh->held_mu);
    for (fps_push_t *p = sh->held; p && !hit; p = p->hnext)
      if (force || now >= p->held_until) hit = p;
    if (hit) fps__push_unhold_locked(sh, hit);
    pthread_mutex_unlock(&sh->held_mu);
    if (!hit) return;
    hit->resume(hit, hit->resume_arg);
  }
}

void fps__push_times(fps_push_t *p, fps_push_times_t *out) {
  out->created_ns = p->created_ns;
  pthread_mutex_lock(&p->mu);
  out->recv_end_ns = p->recv_end_ns;
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_lock(&p->sh->held_mu);
  out->held_ns = p->held_ns + (p->held ? fps_now_ns() - p->held_since_ns : 0);
  out->holds = p->holds;
  pthread_mutex_unlock(&p->sh->held_mu);
}

void fps__push_entry_resolved(fps_push_entry_t *e) {
  fps_push_t *p = e->owner;
  if (fps__push_release(p, 1)) p->done(p, p->arg);
}

void fps__push_ssp_fail(fps_push_t *p, int err, const char *msg) {
  p->err = err;
  p->msg = fps_strdup(msg);
  if (fps__push_release(p, 1)) p->done(p, p->arg);
}

/* Push idempotency: which (worker, push_id) pushes the shard applied, for a
 * bounded window, so that a retry after a lost reply is answered instead of
 * applied again (shard.h, "push idempotency").
 *
 * One table for the shard: a ring of FPS_IDEM_WINDOW entries in arrival
 * order (the oldest is forgotten when a new push_id arrives) and a chained
 * hash over it. An entry is CLAIMED from the moment a push with that key
 * commits until it is resolved: APPLIED if every tensor was applied,
 * otherwise dropped (nothing was applied, a retry must apply). */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"

#define FPS_IDEM_NIL UINT32_MAX

static uint32_t fps__idem_bucket(const fps_idem_t *ix, uint32_t worker, uint64_t id) {
  uint64_t h = (id ^ ((uint64_t)worker << 32 | worker)) * UINT64_C(0x9E3779B97F4A7C15);
  return (uint32_t)(h >> 40) & (ix->nbucket - 1);
}

int fps__idem_init(fps_idem_t *ix, uint32_t window) {
  memset(ix, 0, sizeof *ix);
  ix->cap = window;
  ix->nbucket = 1;
  while (ix->nbucket < 2 * window) ix->nbucket *= 2;
  /* Touched now, so the shard's memory does not grow as keys arrive. */
  ix->ent = fps_malloc((size_t)window * sizeof *ix->ent);
  if (ix->ent) memset(ix->ent, 0, (size_t)window * sizeof *ix->ent);
  ix->bucket = fps_malloc(ix->nbucket * sizeof *ix->bucket);
  if (!ix->ent || !ix->bucket) {
    fps_free(ix->ent);
    fps_free(ix->bucket);
    memset(ix, 0, sizeof *ix);
    return FPS_ENOMEM;
  }
  for (uint32_t i = 0; i < ix->nbucket; i++) ix->bucket[i] = FPS_IDEM_NIL;
  pthread_mutex_init(&ix->mu, NULL);
  return 0;
}

void fps__idem_destroy(fps_idem_t *ix) {
  if (!ix->ent) return;
  for (uint32_t i = 0; i < ix->cap; i++)
    if (ix->ent[i].n > FPS_IDEM_INLINE) fps_free(ix->ent[i].v.out);
  fps_free(ix->ent);
  fps_free(ix->bucket);
  pthread_mutex_destroy(&ix->mu);
  memset(ix, 0, sizeof *ix);
}

static uint32_t *fps__idem_link_locked(fps_idem_t *ix, uint32_t worker, uint64_t id) {
  uint32_t *at = &ix->bucket[fps__idem_bucket(ix, worker, id)];
  while (*at != FPS_IDEM_NIL && !(ix->ent[*at].worker == worker && ix->ent[*at].id == id)) at = &ix->ent[*at].next;
  return at;
}

static void fps__idem_unlink_locked(fps_idem_t *ix, uint32_t slot) {
  fps_idem_entry_t *e = &ix->ent[slot];
  uint32_t *at = fps__idem_link_locked(ix, e->worker, e->id);
  if (*at == slot) *at = e->next;
  e->state = FPS_IDEM_FREE;
  if (e->n > FPS_IDEM_INLINE) fps_free(e->v.out);
  e->n = 0;
}

int fps__idem_claim(fps_idem_t *ix, uint32_t worker, uint64_t id, uint32_t *slot) {
  pthread_mutex_lock(&ix->mu);
  uint32_t *at = fps__idem_link_locked(ix, worker, id);
  if (*at != FPS_IDEM_NIL) {
    int state = ix->ent[*at].state;
    pthread_mutex_unlock(&ix->mu);
    return state == FPS_IDEM_APPLIED ? FPS_EEXISTS : FPS_EAGAIN;
  }
  /* Take the oldest slot; a claim still in flight there is forgotten too
   * (its settle finds the slot reused and does nothing). */
  uint32_t s = ix->head;
  ix->head = (ix->head + 1) % ix->cap;
  if (ix->ent[s].state != FPS_IDEM_FREE) fps__idem_unlink_locked(ix, s);
  fps_idem_entry_t *e = &ix->ent[s];
  e->worker = worker;
  e->id = id;
  e->state = FPS_IDEM_CLAIMED;
  at = fps__idem_link_locked(ix, worker, id); /* the unlink may have moved the end */
  e->next = FPS_IDEM_NIL;
  *at = s;
  *slot = s;
  pthread_mutex_unlock(&ix->mu);
  return 0;
}

void fps__idem_settle(fps_idem_t *ix, uint32_t slot, uint32_t worker, uint64_t id, uint64_t tensors,
                      const uint64_t *v, uint32_t n) {
  /* Without memory (or with too many tensors to count) the key is
   * forgotten, so a retry applies again rather than answering wrong. */
  uint64_t *out = NULL;
  bool keep = v != NULL && n <= UINT16_MAX;
  if (keep && n > FPS_IDEM_INLINE) {
    out = fps_malloc(n * sizeof *out);
    if (out) memcpy(out, v, n * sizeof *out);
    else keep = false;
  }
  pthread_mutex_lock(&ix->mu);
  fps_idem_entry_t *e = &ix->ent[slot];
  if (e->state == FPS_IDEM_CLAIMED && e->worker == worker && e->id == id) {
    if (keep) {
      e->state = FPS_IDEM_APPLIED;
      e->tensors = tensors;
      e->n = (uint16_t)n;
      if (out) e->v.out = out;
      else memcpy(e->v.in, v, n * sizeof *v);
      out = NULL;
    } else {
      fps__idem_unlink_locked(ix, slot);
    }
  }
  pthread_mutex_unlock(&ix->mu);
  fps_free(out);
}

int fps__idem_versions(fps_idem_t *ix, uint32_t worker, uint64_t id, uint64_t tensors, uint64_t *v, uint32_t n) {
  int rc = FPS_ENOTFOUND;
  pthread_mutex_lock(&ix->mu);
  uint32_t *at = fps__idem_link_locked(ix, worker, id);
  if (*at != FPS_IDEM_NIL && ix->ent[*at].state == FPS_IDEM_APPLIED) {
    const fps_idem_entry_t *e = &ix->ent[*at];
    if (e->tensors != tensors || e->n != n) {
      rc = FPS_EINVAL;
    } else {
      memcpy(v, e->n > FPS_IDEM_INLINE ? e->v.out : e->v.in, n * sizeof *v);
      rc = 0;
    }
  }
  pthread_mutex_unlock(&ix->mu);
  return rc;
}

bool fps__idem_applied(fps_idem_t *ix, uint32_t worker, uint64_t id) {
  pthread_mutex_lock(&ix->mu);
  uint32_t *at = fps__idem_link_locked(ix, worker, id);
  bool applied = *at != FPS_IDEM_NIL && ix->ent[*at].state == FPS_IDEM_APPLIED;
  pthread_mutex_unlock(&ix->mu);
  return applied;
}

/* Push idempotency: which (worker, push_id) pushes the shard applied, for a
 * bounded window, so that a retry after a lost reply is answered instead of
 * applied again (shard.h, "push idempotency").
 *
 * One table of cap entries with a chained hash over them. An entry is
 * CLAIMED from the moment a push with that key commits until it is
 * resolved: APPLIED if every tensor was applied, otherwise dropped (nothing
 * was applied, a retry must apply). Who makes way for a new key is decided
 * per worker, so that one client's pushes cannot flush another's keys:
 * each worker's keys are a list in arrival order, with a count bounded by
 * per_worker; workers are also listed by their count (by_count), so the one
 * holding the most is found at once when the table is full. A CLAIMED entry
 * is never taken: its push is in flight and its retry must find it. */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"

#define FPS_IDEM_NIL UINT32_MAX

static uint32_t fps__idem_bucket(const fps_idem_t *ix, uint32_t worker, uint64_t id) {
  uint64_t h = (id ^ ((uint64_t)worker << 32 | worker)) * UINT64_C(0x9E3779B97F4A7C15);
  return (uint32_t)(h >> 40) & (ix->nbucket - 1);
}

static uint32_t fps__idem_wbucket(const fps_idem_t *ix, uint32_t worker) {
  return (uint32_t)(((uint64_t)worker * UINT64_C(0x9E3779B97F4A7C15)) >> 40) & (ix->nbucket - 1);
}

int fps__idem_init(fps_idem_t *ix, uint32_t window, uint32_t per_worker) {
  memset(ix, 0, sizeof *ix);
  ix->cap = window;
  ix->per_worker = per_worker < window ? per_worker : window;
  ix->nbucket = 1;
  while (ix->nbucket < 2 * window) ix->nbucket *= 2;
  /* Touched now, so the shard's memory does not grow as keys arrive. */
  ix->ent = fps_calloc(window, sizeof *ix->ent);
  /* One record more than entries: a new worker's is taken before room is
   * made for its first key. */
  ix->wk = fps_calloc((size_t)window + 1, sizeof *ix->wk);
  ix->bucket = fps_malloc(ix->nbucket * sizeof *ix->bucket);
  ix->wbucket = fps_malloc(ix->nbucket * sizeof *ix->wbucket);
  ix->by_count = fps_malloc((ix->per_worker + 1) * sizeof *ix->by_count);
  if (!ix->ent || !ix->wk || !ix->bucket || !ix->wbucket || !ix->by_count) {
    fps_free(ix->ent);
    fps_free(ix->wk);
    fps_free(ix->bucket);
    fps_free(ix->wbucket);
    fps_free(ix->by_count);
    memset(ix, 0, sizeof *ix);
    return FPS_ENOMEM;
  }
  for (uint32_t i = 0; i < ix->nbucket; i++) ix->bucket[i] = ix->wbucket[i] = FPS_IDEM_NIL;
  for (uint32_t i = 0; i <= ix->per_worker; i++) ix->by_count[i] = FPS_IDEM_NIL;
  for (uint32_t i = 0; i < window; i++) ix->ent[i].next = i + 1 < window ? i + 1 : FPS_IDEM_NIL;
  for (uint32_t i = 0; i <= window; i++) ix->wk[i].hnext = i < window ? i + 1 : FPS_IDEM_NIL;
  ix->free = ix->wfree = 0;
  pthread_mutex_init(&ix->mu, NULL);
  return 0;
}

void fps__idem_destroy(fps_idem_t *ix) {
  if (!ix->ent) return;
  for (uint32_t i = 0; i < ix->cap; i++)
    if (ix->ent[i].state != FPS_IDEM_FREE && ix->ent[i].n > FPS_IDEM_INLINE) fps_free(ix->ent[i].v.out);
  fps_free(ix->ent);
  fps_free(ix->wk);
  fps_free(ix->bucket);
  fps_free(ix->wbucket);
  fps_free(ix->by_count);
  pthread_mutex_destroy(&ix->mu);
  memset(ix, 0, sizeof *ix);
}

/* ------------------------------------------------------------ workers */

/* The list of workers holding `count` keys: newest arrival first. */
static void fps__idem_count_unlink_locked(fps_idem_t *ix, uint32_t r) {
  fps_idem_worker_t *w = &ix->wk[r];
  if (w->cprev != FPS_IDEM_NIL) ix->wk[w->cprev].cnext = w->cnext;
  else ix->by_count[w->count] = w->cnext;
  if (w->cnext != FPS_IDEM_NIL) ix->wk[w->cnext].cprev = w->cprev;
}

static void fps__idem_count_link_locked(fps_idem_t *ix, uint32_t r) {
  fps_idem_worker_t *w = &ix->wk[r];
  w->cprev = FPS_IDEM_NIL;
  w->cnext = ix->by_count[w->count];
  if (w->cnext != FPS_IDEM_NIL) ix->wk[w->cnext].cprev = r;
  ix->by_count[w->count] = r;
  if (w->count > ix->max_count) ix->max_count = w->count;
}

static uint32_t *fps__idem_wlink_locked(fps_idem_t *ix, uint32_t worker) {
  uint32_t *at = &ix->wbucket[fps__idem_wbucket(ix, worker)];
  while (*at != FPS_IDEM_NIL && ix->wk[*at].worker != worker) at = &ix->wk[*at].hnext;
  return at;
}

/* The record of `worker`, created (holding nothing yet) if it has none.
 * There is always a free record: every other record holds an entry, and
 * there is one record more than entries. */
static uint32_t fps__idem_worker_locked(fps_idem_t *ix, uint32_t worker) {
  uint32_t *at = fps__idem_wlink_locked(ix, worker);
  if (*at != FPS_IDEM_NIL) return *at;
  uint32_t r = ix->wfree;
  ix->wfree = ix->wk[r].hnext;
  fps_idem_worker_t *w = &ix->wk[r];
  memset(w, 0, sizeof *w);
  w->worker = worker;
  w->oldest = w->newest = w->cprev = w->cnext = FPS_IDEM_NIL;
  w->hnext = FPS_IDEM_NIL;
  *at = r;
  return r;
}

/* ------------------------------------------------------------ entries */

static uint32_t *fps__idem_link_locked(fps_idem_t *ix, uint32_t worker, uint64_t id) {
  uint32_t *at = &ix->bucket[fps__idem_bucket(ix, worker, id)];
  while (*at != FPS_IDEM_NIL && !(ix->ent[*at].worker == worker && ix->ent[*at].id == id)) at = &ix->ent[*at].next;
  return at;
}

/* Forgets the entry at slot: out of the hash, out of its worker's list
 * (the worker's record goes with its last key), onto the free list. */
static void fps__idem_drop_locked(fps_idem_t *ix, uint32_t slot) {
  fps_idem_entry_t *e = &ix->ent[slot];
  uint32_t *at = fps__idem_link_locked(ix, e->worker, e->id);
  if (*at == slot) *at = e->next;
  uint32_t r = e->wrec;
  fps_idem_worker_t *w = &ix->wk[r];
  if (e->wprev != FPS_IDEM_NIL) ix->ent[e->wprev].wnext = e->wnext;
  else w->oldest = e->wnext;
  if (e->wnext != FPS_IDEM_NIL) ix->ent[e->wnext].wprev = e->wprev;
  else w->newest = e->wprev;
  fps__idem_count_unlink_locked(ix, r);
  if (--w->count > 0) {
    fps__idem_count_link_locked(ix, r);
  } else {
    uint32_t *wat = fps__idem_wlink_locked(ix, w->worker);
    *wat = w->hnext;
    w->hnext = ix->wfree;
    ix->wfree = r;
  }
  while (ix->max_count > 0 && ix->by_count[ix->max_count] == FPS_IDEM_NIL) ix->max_count--;
  if (e->n > FPS_IDEM_INLINE) fps_free(e->v.out);
  e->n = 0;
  e->state = FPS_IDEM_FREE;
  e->next = ix->free;
  ix->free = slot;
}

/* Forgets worker record r's oldest settled key; false if every key it
 * holds is in flight. */
static bool fps__idem_evict_locked(fps_idem_t *ix, uint32_t r) {
  for (uint32_t s = ix->wk[r].oldest; s != FPS_IDEM_NIL; s = ix->ent[s].wnext)
    if (ix->ent[s].state != FPS_IDEM_CLAIMED) {
      fps__idem_drop_locked(ix, s);
      return true;
    }
  return false;
}

/* Makes room for one more key of record r: its own oldest settled key once
 * it holds per_worker; else, with the table full, that of the worker
 * holding the most, as long as that is more than FPS_IDEM_KEEP (newest
 * arrival at that count first). False: no room without taking another
 * worker's newest FPS_IDEM_KEEP keys or a key in flight. */
static bool fps__idem_room_locked(fps_idem_t *ix, uint32_t r) {
  if (ix->wk[r].count >= ix->per_worker) return fps__idem_evict_locked(ix, r);
  if (ix->free != FPS_IDEM_NIL) return true;
  for (uint32_t c = ix->max_count; c > FPS_IDEM_KEEP; c--)
    for (uint32_t v = ix->by_count[c]; v != FPS_IDEM_NIL; v = ix->wk[v].cnext)
      if (fps__idem_evict_locked(ix, v)) return true;
  return false;
}

int fps__idem_claim(fps_idem_t *ix, uint32_t worker, uint64_t id, uint32_t *slot) {
  pthread_mutex_lock(&ix->mu);
  uint32_t *at = fps__idem_link_locked(ix, worker, id);
  if (*at != FPS_IDEM_NIL) {
    int state = ix->ent[*at].state;
    pthread_mutex_unlock(&ix->mu);
    return state == FPS_IDEM_APPLIED ? FPS_EEXISTS : FPS_EAGAIN;
  }
  uint32_t r = fps__idem_worker_locked(ix, worker);
  if (!fps__idem_room_locked(ix, r)) {
    if (ix->wk[r].count == 0) { /* a record made for nothing */
      uint32_t *wat = fps__idem_wlink_locked(ix, worker);
      *wat = ix->wk[r].hnext;
      ix->wk[r].hnext = ix->wfree;
      ix->wfree = r;
    }
    pthread_mutex_unlock(&ix->mu);
    return FPS_ELIMIT;
  }
  /* The eviction may have freed r itself (its last key): look it up again. */
  r = fps__idem_worker_locked(ix, worker);
  uint32_t s = ix->free;
  ix->free = ix->ent[s].next;
  fps_idem_entry_t *e = &ix->ent[s];
  memset(e, 0, sizeof *e);
  e->worker = worker;
  e->id = id;
  e->state = FPS_IDEM_CLAIMED;
  e->wrec = r;
  fps_idem_worker_t *w = &ix->wk[r];
  e->wprev = w->newest;
  e->wnext = FPS_IDEM_NIL;
  if (w->newest != FPS_IDEM_NIL) ix->ent[w->newest].wnext = s;
  else w->oldest = s;
  w->newest = s;
  if (w->count > 0) fps__idem_count_unlink_locked(ix, r);
  w->count++;
  fps__idem_count_link_locked(ix, r);
  at = fps__idem_link_locked(ix, worker, id); /* the eviction may have moved the end */
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
      fps__idem_drop_locked(ix, slot);
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

void fps__idem_forget_after(fps_idem_t *ix, uint64_t version) {
  pthread_mutex_lock(&ix->mu);
  for (uint32_t s = 0; s < ix->cap; s++) {
    fps_idem_entry_t *e = &ix->ent[s];
    if (e->state != FPS_IDEM_APPLIED) continue;
    const uint64_t *v = e->n > FPS_IDEM_INLINE ? e->v.out : e->v.in;
    bool after = false;
    for (uint32_t i = 0; i < e->n && !after; i++) after = v[i] > version;
    if (after) fps__idem_drop_locked(ix, s);
  }
  pthread_mutex_unlock(&ix->mu);
}

bool fps__idem_applied(fps_idem_t *ix, uint32_t worker, uint64_t id) {
  pthread_mutex_lock(&ix->mu);
  uint32_t *at = fps__idem_link_locked(ix, worker, id);
  bool applied = *at != FPS_IDEM_NIL && ix->ent[*at].state == FPS_IDEM_APPLIED;
  pthread_mutex_unlock(&ix->mu);
  return applied;
}

/* Tensor-sized buffers and their accounting: gradient staging, sync sums
 * and retired parameter buffers count against max_staging_bytes (so many
 * concurrent pushes cannot exhaust memory); a tensor keeps one spare
 * buffer for its next sum or staging (given up first when the limit is
 * near); the refcounted parameter buffers (fps_snap_t) that replies, Pull
 * and checkpoints reference instead of copying. */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"

/* Bytes a tensor-sized buffer of numel floats takes (at least one float,
 * so a zero-sized tensor still has a valid pointer). */
static uint64_t fps__tbuf_bytes(uint64_t numel) { return (numel ? numel : 1) * sizeof(float); }

/* Fills a buffer wrapper (fps_snap_t): not retired, no bf16 encoding. */
static void fps__snap_init(fps_snap_t *s, fps_shard_t *sh, float *data, uint64_t numel, uint64_t version,
                           int refs, bool staged) {
  atomic_init(&s->refs, refs);
  s->sh = sh;
  s->data = data;
  s->numel = numel;
  s->version = version;
  s->staged = staged;
  s->owner = NULL;
  s->bf16 = NULL;
}

/* t out of sh->spares. REQUIRES: sh->spare_mu, t->spare set. */
static void fps__spare_unlink_locked(fps_shard_t *sh, fps_tensor_t *t) {
  if (t->spare_prev) t->spare_prev->spare_next = t->spare_next;
  else sh->spares = t->spare_next;
  if (t->spare_next) t->spare_next->spare_prev = t->spare_prev;
  else sh->spares_last = t->spare_prev;
  t->spare_prev = t->spare_next = NULL;
}

/* Takes t's spare out of the list (NULL if none); still counted in
 * tbuf_bytes, no longer in spare_bytes. */
static float *fps__spare_detach(fps_shard_t *sh, fps_tensor_t *t) {
  pthread_mutex_lock(&sh->spare_mu);
  float *p = t->spare;
  if (p) {
    fps__spare_unlink_locked(sh, t);
    t->spare = NULL;
    atomic_fetch_sub(&sh->spare_bytes, fps__tbuf_bytes(t->numel));
  }
  pthread_mutex_unlock(&sh->spare_mu);
  return p;
}

/* Frees the least recently kept spare; false if there is none. */
static bool fps__spare_give_up_one(fps_shard_t *sh) {
  pthread_mutex_lock(&sh->spare_mu);
  fps_tensor_t *t = sh->spares;
  float *p = NULL;
  uint64_t bytes = 0;
  if (t) {
    p = t->spare;
    bytes = fps__tbuf_bytes(t->numel);
    fps__spare_unlink_locked(sh, t);
    t->spare = NULL;
    atomic_fetch_sub(&sh->spare_bytes, bytes);
  }
  pthread_mutex_unlock(&sh->spare_mu);
  if (!t) return false;
  fps_free(p); /* before it stops counting: the limit stays true */
  atomic_fetch_sub(&sh->tbuf_bytes, bytes);
  return true;
}

/* Counts bytes against max_staging_bytes; false if that would pass it
 * even with every spare given up. Spares are given up (least recently
 * kept first) only when the bytes would not fit otherwise. */
static bool fps__tbuf_reserve(fps_shard_t *sh, uint64_t bytes) {
  const uint64_t max = sh->cfg.max_staging_bytes;
  for (;;) {
    uint64_t cur = atomic_load(&sh->tbuf_bytes);
    do {
      if (cur + bytes < cur) return false;
      if (cur + bytes > max) break;
      if (atomic_compare_exchange_weak(&sh->tbuf_bytes, &cur, cur + bytes)) {
        uint64_t peak = atomic_load(&sh->tbuf_peak);
        while (cur + bytes > peak && !atomic_compare_exchange_weak(&sh->tbuf_peak, &peak, cur + bytes)) {
        }
        return true;
      }
    } while (1);
    /* Over: only what is in flight counts against a request (cur and
     * spare are read apart: a spare kept since cur was read may not be
     * in it, hence the clamp). Each pass gives a spare up or ends. */
    uint64_t spare = atomic_load(&sh->spare_bytes);
    uint64_t in_flight = cur > spare ? cur - spare : 0;
    if (in_flight + bytes > max || in_flight + bytes < in_flight) return false;
    if (!fps__spare_give_up_one(sh)) return false;
  }
}

float *fps_tbuf_alloc(fps_shard_t *sh, uint64_t numel, bool *over_limit) {
  uint64_t bytes = fps__tbuf_bytes(numel);
  *over_limit = !fps__tbuf_reserve(sh, bytes);
  if (*over_limit) return NULL;
  float *p = fps_malloc(bytes);
  if (!p) atomic_fetch_sub(&sh->tbuf_bytes, bytes);
  return p;
}

bool fps__tbuf_charge(fps_shard_t *sh, uint64_t bytes) { return fps__tbuf_reserve(sh, bytes); }

void fps__tbuf_uncharge(fps_shard_t *sh, uint64_t bytes) { atomic_fetch_sub(&sh->tbuf_bytes, bytes); }

void fps_tbuf_free(fps_shard_t *sh, float *p, uint64_t numel) {
  if (!p) return;
  fps_free(p);
  atomic_fetch_sub(&sh->tbuf_bytes, fps__tbuf_bytes(numel));
}

fps_snap_t *fps__pbuf_new(uint64_t numel) {
  fps_snap_t *s = fps_malloc(sizeof *s);
  float *data = fps_malloc(fps__tbuf_bytes(numel));
  if (!s || !data) {
    fps_free(s);
    fps_free(data);
    return NULL;
  }
  fps__snap_init(s, NULL, data, numel, 0, 1, false);
  return s;
}

fps_snap_t *fps__pbuf_new_staged(fps_shard_t *sh, fps_tensor_t *t, bool *over_limit) {
  *over_limit = false;
  fps_snap_t *s = fps_malloc(sizeof *s);
  if (!s) return NULL;
  float *data = fps__tbuf_take(sh, t, over_limit);
  if (!data) {
    fps_free(s);
    return NULL;
  }
  fps__snap_init(s, sh, data, t->numel, 0, 1, true);
  s->owner = t; /* never published: released as t's spare */
  return s;
}

void fps__pbuf_publish(fps_shard_t *sh, fps_snap_t *s) {
  s->staged = false;
  s->owner = NULL;
  atomic_fetch_sub(&sh->tbuf_bytes, fps__tbuf_bytes(s->numel));
}

float *fps__tbuf_take(fps_shard_t *sh, fps_tensor_t *t, bool *over_limit) {
  float *p = fps__spare_detach(sh, t);
  if (!p) return fps_tbuf_alloc(sh, t->numel, over_limit);
  *over_limit = false; /* counted since it was in flight last time */
  return p;
}

void fps__tbuf_keep(fps_shard_t *sh, fps_tensor_t *t, float *p) {
  if (!p) return;
  const uint64_t bytes = fps__tbuf_bytes(t->numel);
  pthread_mutex_lock(&sh->spare_mu);
  float *old = t->spare;
  if (old) fps__spare_unlink_locked(sh, t);
  else atomic_fetch_add(&sh->spare_bytes, bytes);
  t->spare = p; /* the most recently kept: last to be given up */
  t->spare_prev = sh->spares_last;
  t->spare_next = NULL;
  if (sh->spares_last) sh->spares_last->spare_next = t;
  else sh->spares = t;
  sh->spares_last = t;
  pthread_mutex_unlock(&sh->spare_mu);
  if (old) {
    fps_free(old);
    atomic_fetch_sub(&sh->tbuf_bytes, bytes);
  }
}

uint64_t fps_shard_in_flight_bytes(fps_shard_t *sh) {
  /* Spares are counted in tbuf_bytes before spare_bytes and leave it after:
   * read spare_bytes first so the difference never goes below zero. */
  uint64_t spare = atomic_load(&sh->spare_bytes);
  uint64_t all = atomic_load(&sh->tbuf_bytes);
  return all > spare ? all - spare : 0;
}

void fps__tbuf_drop_spare(fps_shard_t *sh, fps_tensor_t *t) {
  float *p = fps__spare_detach(sh, t);
  if (!p) return;
  fps_free(p);
  atomic_fetch_sub(&sh->tbuf_bytes, fps__tbuf_bytes(t->numel));
}

void fps__pbuf_retire(fps_shard_t *sh, fps_tensor_t *t, fps_snap_t *s) {
  if (!s) return;
  if (!sh || s->staged) { /* the shard's own teardown (no readers left), or
                           * a replacement never published (counted) */
    fps_snap_unref(s);
    return;
  }
  /* From now on it is a staging buffer like any other (its last holder
   * frees it, or makes it t's spare: fps__tbuf_keep): readers may keep it
   * alive after the tensor moved on. Not checked against the limit: the
   * caller has just taken a buffer of this size out of staging (an
   * update's gradient buffer, or a replacement: fps__pbuf_publish). Its
   * sh was NULL until now: a tensor's own buffer counts in param_bytes
   * (--max-bytes), and nothing reads sh but the last unref, which for a
   * buffer not staged frees data uncounted. */
  s->sh = sh;
  s->owner = t;
  s->staged = true;
  atomic_fetch_add(&sh->tbuf_bytes, fps__tbuf_bytes(s->numel));
  fps_snap_unref(s);
}

void fps_snap_unref(fps_snap_t *s) {
  if (!s) return;
  if (atomic_fetch_sub(&s->refs, 1) == 1) {
    if (s->staged && s->owner) fps__tbuf_keep(s->sh, s->owner, s->data);
    else if (s->staged) fps_tbuf_free(s->sh, s->data, s->numel);
    else fps_free(s->data);
    fps_free(s);
  }
}

void fps__pbuf_adopt(fps_shard_t *sh, fps_snap_t *s, float *data, uint64_t numel, uint64_t version) {
  fps__snap_init(s, sh, data, numel, version, 1, false);
  atomic_fetch_sub(&sh->tbuf_bytes, fps__tbuf_bytes(numel));
}

void fps_snap_ref(fps_snap_t *s) { atomic_fetch_add(&s->refs, 1); }

const float *fps_snap_data(const fps_snap_t *s) { return s->data; }

uint64_t fps_snap_numel(const fps_snap_t *s) { return s->numel; }

uint64_t fps_snap_version(const fps_snap_t *s) { return s->version; }

/* The shard's tensors: a name -> tensor hash map, tensor lifetime, the one
 * place an Adafactor step is applied and snapshotted (version, apply log,
 * counters), the refcounted parameter snapshots replies stream from, the
 * name/shape/slice rules every method shares, and the shard's own
 * set-up.
 *
 * Tensors are never removed while the shard runs, so a pointer found under
 * the store's read lock stays valid after the lock is dropped. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "name.h"
#include "reduce.h"
#include "shard.h"
#include "xstep.h"

static uint64_t fps__hash(const char *s, size_t len) {
  uint64_t h = UINT64_C(1469598103934665603); /* FNV-1a */
  for (size_t i = 0; i < len; i++) {
    h ^= (unsigned char)s[i];
    h *= UINT64_C(1099511628211);
  }
  return h;
}

int fps_store_init(fps_store_t *st) {
  memset(st, 0, sizeof *st);
  st->nbucket = 64;
  st->bucket = fps_calloc(st->nbucket, sizeof *st->bucket);
  if (!st->bucket) return FPS_ENOMEM;
  if (pthread_rwlock_init(&st->mu, NULL) != 0) {
    fps_free(st->bucket);
    st->bucket = NULL;
    return FPS_ENOMEM;
  }
  return 0;
}

void fps_store_destroy(fps_store_t *st) {
  if (!st->bucket) return;
  fps_tensor_t *t = st->first;
  while (t) {
    fps_tensor_t *n = t->next;
    fps_tensor_destroy(t);
    t = n;
  }
  fps_free(st->bucket);
  pthread_rwlock_destroy(&st->mu);
  memset(st, 0, sizeof *st);
}

fps_tensor_t *fps_store_find(fps_store_t *st, const char *name) {
  pthread_rwlock_rdlock(&st->mu);
  fps_tensor_t *t = fps__store_find_locked(st, name, strlen(name));
  pthread_rwlock_unlock(&st->mu);
  return t;
}

fps_tensor_t *fps__store_find_locked(fps_store_t *st, const char *name, size_t len) {
  fps_tensor_t *t = st->bucket[fps__hash(name, len) & (st->nbucket - 1)];
  for (; t; t = t->hnext)
    if (strlen(t->name) == len && memcmp(t->name, name, len) == 0) return t;
  return NULL;
}

int fps__store_reserve_locked(fps_store_t *st, uint64_t n) {
  if (n <= st->nbucket) return 0;
  /* Keep chains short: grow the table to load factor <= 1. */
  size_t nb = st->nbucket;
  while (nb < n) nb *= 2;
  {
    fps_tensor_t **b = fps_calloc(nb, sizeof *b);
    if (!b) return FPS_ENOMEM;
    for (fps_tensor_t *x = st->first; x; x = x->next) {
      size_t i = fps__hash(x->name, strlen(x->name)) & (nb - 1);
      x->hnext = b[i];
      b[i] = x;
    }
    fps_free(st->bucket);
    st->bucket = b;
    st->nbucket = nb;
  }
  return 0;
}

int fps__store_insert_locked(fps_store_t *st, fps_tensor_t *t) {
  int rc = fps__store_reserve_locked(st, st->count + 1);
  if (rc < 0) return rc;
  size_t i = fps__hash(t->name, strlen(t->name)) & (st->nbucket - 1);
  t->hnext = st->bucket[i];
  st->bucket[i] = t;
  t->next = NULL;
  if (st->last) st->last->next = t;
  else st->first = t;
  st->last = t;
  st->count++;
  st->param_bytes += t->numel * 4;
  fps_metrics_state_add_tensor(t->numel, &t->size);
  if (t->split) fps_metrics_state_add(&(fps_metrics_state_t){.split_blocks = 1, .split_elements = t->numel});
  return 0;
}

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

/* A tensor without its optimizer state, or NULL on OOM. */
static fps_tensor_t *fps__tensor_alloc(const char *name, size_t len, const fps_shape_t *shape,
                                       uint64_t numel, const fps_adafactor_hparams_t *hp,
                                       uint32_t workers, uint32_t log_cap) {
  fps_tensor_t *t = fps_calloc(1, sizeof *t);
  if (!t) return NULL;
  if (pthread_mutex_init(&t->mu, NULL) != 0) {
    fps_free(t);
    return NULL;
  }
  t->shape = *shape;
  t->numel = numel;
  t->hp = *hp;
  t->last_lr = hp->has_lr ? hp->lr : 0.0;
  t->last_weight_decay = hp->weight_decay;
  t->name = fps_malloc(len + 1);
  /* Parameters are written by Create's init slices; malloc (not calloc)
   * leaves untouched pages unfaulted until then. */
  t->pbuf = fps__pbuf_new(numel);
  t->param = t->pbuf ? t->pbuf->data : NULL;
  t->round.member = fps_calloc(workers ? workers : 1, sizeof *t->round.member);
  /* The apply log grows on demand: most tensors of a big model never need
   * the full --apply-log ring, and 1M tensors x 4096 records would be GBs. */
  t->log_max = log_cap;
  if (!t->name || !t->pbuf || !t->round.member) goto fail;
  memcpy(t->name, name, len);
  t->name[len] = 0;
  return t;
fail:
  fps_tensor_destroy(t);
  return NULL;
}

fps_tensor_t *fps_tensor_create(const char *name, size_t len, const fps_shape_t *shape,
                                uint64_t numel, const fps_adafactor_hparams_t *hp,
                                uint32_t workers, uint32_t log_cap) {
  fps_tensor_t *t = fps__tensor_alloc(name, len, shape, numel, hp, workers, log_cap);
  if (!t) return NULL;
  if (fps_adafactor_state_init(&t->st, shape, hp) < 0 || fps_adafactor_state_size(shape, hp, &t->size) < 0) {
    fps_tensor_destroy(t);
    return NULL;
  }
  return t;
}

fps_tensor_t *fps_tensor_create_split(const char *name, size_t len, const fps_split_geom_t *g,
                                      const fps_split_map_t *map, const fps_adafactor_hparams_t *hp,
                                      uint32_t workers, uint32_t log_cap) {
  fps_tensor_t *t = fps__tensor_alloc(name, len, &g->shape, g->block_numel, hp, workers, log_cap);
  if (!t) return NULL;
  fps_tensor_split_t *sp = t->split = fps_calloc(1, sizeof *sp);
  const size_t nb = map->n_bounds - 1;
  if (!sp || !(sp->bounds = fps_malloc(map->n_bounds * sizeof *sp->bounds)) ||
      !(sp->block_shards = fps_malloc(nb * sizeof *sp->block_shards)) ||
      fps_split_state_init(&sp->st, g, hp) < 0) {
    fps_tensor_destroy(t);
    return NULL;
  }
  sp->g = *g;
  sp->block_index = map->block_index;
  sp->n_blocks = (uint32_t)nb;
  memcpy(sp->bounds, map->bounds, map->n_bounds * sizeof *sp->bounds);
  memcpy(sp->block_shards, map->block_shards, nb * sizeof *sp->block_shards);
  sp->shard_count = map->shard_count;
  fps_shard_split_state_size(g, hp, &t->size);
  return t;
}

void fps_tensor_state_arrays(const fps_tensor_t *t, float *out[FPS_STATE_KINDS]) {
  if (t->split) {
    const fps_split_state_t *st = &t->split->st;
    out[FPS_STATE_ROW] = st->row;
    out[FPS_STATE_COL] = st->col;
    out[FPS_STATE_VAR] = st->var;
    out[FPS_STATE_MOM] = st->mom;
  } else {
    out[FPS_STATE_ROW] = t->st.row;
    out[FPS_STATE_COL] = t->st.col;
    out[FPS_STATE_VAR] = t->st.var;
    out[FPS_STATE_MOM] = t->st.mom;
  }
}

void fps_tensor_destroy(fps_tensor_t *t) {
  if (!t) return;
  fps_adafactor_state_destroy(&t->st);
  fps__split_destroy(t->split);
  fps_ranges_free(&t->init);
  for (int k = 0; k < FPS_STATE_KINDS; k++) fps_ranges_free(&t->init_state[k]);
  fps_free(t->round.member);
  fps_free(t->log);
  fps__pbuf_retire(NULL, NULL, t->pbuf); /* the shard's own teardown: no readers left */
  fps_free(t->spare);                    /* likewise: nobody counts any more */
  fps_free(t->name);
  pthread_mutex_destroy(&t->mu);
  fps_free(t);
}

/* This update's settings: Create's, with the push's lr and weight decay
 * (validated against the flavor's rules when they arrived). */
fps_adafactor_hparams_t fps__update_hparams(const fps_tensor_t *t, const fps_update_hp_t *uh) {
  fps_adafactor_hparams_t hp = t->hp;
  if (uh) {
    hp.lr = uh->lr;
    hp.weight_decay = uh->weight_decay;
  }
  return hp;
}

int fps__apply_prepare(fps_shard_t *sh, const fps_tensor_t *t, const fps_update_hp_t *uh, bool update,
                       fps_apply_prep_t *prep, char *why, size_t wl) {
  prep->scratch = NULL;
  prep->snap = NULL;
  prep->split = NULL;
  prep->bf16_replies = 0;
  prep->bf16 = NULL;
  if (update && t->split && sh->cfg.mode != FPS_MODE_SYNC) {
    /* Not reached while Create refuses blocks outside sync mode. */
    snprintf(why, wl, "tensor '%s' is a block of a split tensor: split tensors need --mode sync", t->name);
    return FPS_EUNSUPPORTED;
  }
  /* A block's settings are checked by its pass A (xstep.c), which needs
   * no scratch of ours. */
  if (update && !t->split) {
    fps_adafactor_hparams_t hp = fps__update_hparams(t, uh);
    int rc = fps_adafactor_step_check(&hp, &t->st);
    if (rc < 0) {
      snprintf(why, wl, "tensor '%s': the Adafactor step refuses this update's settings: %s", t->name,
               fps_strerror(rc));
      return rc;
    }
    size_t len = fps_adafactor_scratch_len(&t->st);
    if (len && !(prep->scratch = fps_malloc(len * sizeof(double)))) {
      snprintf(why, wl, "tensor '%s': out of memory for the Adafactor step's scratch", t->name);
      return FPS_ENOMEM;
    }
  }
  if (update && !(prep->snap = fps_malloc(sizeof *prep->snap))) {
    fps_free(prep->scratch);
    prep->scratch = NULL;
    snprintf(why, wl, "tensor '%s': out of memory for the new parameters' wrapper", t->name);
    return FPS_ENOMEM;
  }
  return 0;
}

void fps__apply_prep_release(fps_apply_prep_t *prep) {
  fps_split_step_free(prep->split); /* not applied: abandoned, nothing changed */
  prep->split = NULL;
  fps_free(prep->scratch);
  fps_free(prep->snap);
  prep->scratch = NULL;
  prep->snap = NULL;
  /* References to the update's encoding nobody took. */
  for (int i = 0; prep->bf16 && i < prep->bf16_replies; i++) fps_snap_bf16_unref(prep->bf16);
  prep->bf16 = NULL;
  prep->bf16_replies = 0;
}

int fps__tensor_apply_locked(fps_shard_t *sh, fps_tensor_t *t, float **grad, bool update, uint32_t worker_id,
                             uint64_t step, const fps_update_hp_t *uh, bool want_snap, int refs, fps_snap_t **snap,
                             fps_apply_prep_t *prep) {
  if (snap) *snap = NULL;
  if (update) {
    fps_adafactor_trace_t tr;
    memset(&tr, 0, sizeof tr);
    fps_adafactor_hparams_t hp = fps__update_hparams(t, uh);
    /* The wrapper the gradient buffer is published in, before anything
     * changes (prepared: cannot fail). */
    fps_snap_t *nb = prep && prep->snap ? prep->snap : fps_malloc(sizeof *nb);
    if (!nb) return FPS_ENOMEM;
    if (prep) prep->snap = NULL;
    float *out = *grad;
    int64_t t0 = fps_now_ns();
    fps_pool_t *pool = t->numel >= FPS_POOL_MIN(sh) ? sh->pool : NULL;
    int rc;
    /* Replies that send bf16: their encoding is written by pass C (none if
     * it cannot be had within the staging limit: they convert). */
    fps_snap_bf16_t *enc = NULL;
    if (!t->split && prep && prep->bf16_replies > 0) enc = fps__snap_bf16_new(sh, t->numel, prep->bf16_replies);
    /* Out of place into the gradient buffer: the published parameters
     * stay as replies and Pulls read them (fps_snap_t's rule). */
    if (!t->split) {
      rc = fps_adafactor_step_to_bf16(sh->kernels, &hp, &t->st, t->param, out, out,
                                      enc ? fps__snap_bf16_buf(enc) : NULL, pool, prep ? prep->scratch : NULL,
                                      &tr);
    } else if (prep && prep->split) {
      /* A block: pass C of the step combined with the other shards
       * (xstep.c); grad is the sum its pass A read. */
      rc = fps_split_step_apply_to(prep->split, out, &tr);
      fps_split_step_free(prep->split);
      prep->split = NULL;
    } else {
      rc = FPS_EUNSUPPORTED; /* a block steps only with the other blocks */
    }
    int64_t t1 = fps_now_ns();
    if (rc < 0) {
      fps__snap_bf16_discard(enc);
      fps_free(nb);
      FPS_SLOG(FPS_LOG_ERROR, "tensor '%s': Adafactor step failed: %s", t->name, fps_strerror(rc));
      return rc;
    }
    t->version++;
    /* Publish: the staged gradient buffer becomes the tensor's own (no
     * longer staging), the old one is retired (staging while read). */
    fps__snap_init(nb, sh, out, t->numel, t->version, 1, false);
    if (enc) { /* before publishing: every reader finds it made */
      fps__snap_bf16_attach(enc, nb);
      prep->bf16 = enc;
    }
    atomic_fetch_sub(&sh->tbuf_bytes, fps__tbuf_bytes(t->numel));
    *grad = NULL;
    fps_snap_t *old = t->pbuf;
    t->pbuf = nb;
    t->param = out;
    fps__pbuf_retire(sh, t, old);
    atomic_fetch_add(&sh->changes, 1); /* after the step's writes: checkpoint.c */
    /* hf relative_step: the lr is the relative step size this step used. */
    t->last_lr = hp.flavor == FPS_FLAVOR_HF && hp.relative_step ? tr.rel_step : hp.lr;
    t->last_weight_decay = hp.weight_decay;
    if (t->log_len == t->log_cap && t->log_cap < t->log_max) {
      /* Not wrapped yet (head is 0), so growing keeps the order. */
      uint32_t cap = t->log_cap ? t->log_cap * 2 : 16;
      if (cap > t->log_max) cap = t->log_max;
      fps_apply_rec_t *nl = fps_realloc(t->log, cap * sizeof *nl);
      if (nl) {
        t->log = nl;
        t->log_cap = cap;
      } else {
        t->log_max = t->log_cap; /* out of memory: keep the ring as it is */
      }
    }
    if (t->log_cap) {
      uint32_t slot = (t->log_head + t->log_len) % t->log_cap;
      if (t->log_len == t->log_cap) t->log_head = (t->log_head + 1) % t->log_cap;
      else t->log_len++;
      t->log[slot] = (fps_apply_rec_t){worker_id, step, t->version, t->last_lr, t->last_weight_decay};
    }
    atomic_fetch_add(&sh->counters.updates, 1);
    atomic_fetch_add(&sh->counters.update_bytes, tr.bytes);
    fps_metrics_update_observe((double)(t1 - t0) / 1e9, tr.bytes);
    pthread_mutex_lock(&sh->counters.mu);
    sh->counters.update_seconds_sum += (double)(t1 - t0) / 1e9;
    pthread_mutex_unlock(&sh->counters.mu);
  }
  if (want_snap && refs > 0) {
    /* The replies read the published buffer itself: no copy. */
    atomic_fetch_add(&t->pbuf->refs, refs);
    *snap = t->pbuf;
  }
  return 0;
}

void fps_shape_format(const fps_shape_t *s, char *buf, size_t len) {
  size_t n = 0;
  n += (size_t)snprintf(buf + n, len - n, "[");
  for (uint32_t i = 0; i < s->ndim && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, "%s%" PRIu64, i ? ", " : "", s->dim[i]);
  if (n < len) snprintf(buf + n, len - n, "]");
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
      if (atomic_compare_exchange_weak(&sh->tbuf_bytes, &cur, cur + bytes)) return true;
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

fps_snap_t *fps_snap_wrap(fps_shard_t *sh, float *data, uint64_t numel, uint64_t version, int refs) {
  fps_snap_t *s = fps_malloc(sizeof *s);
  if (!s) {
    fps_tbuf_free(sh, data, numel);
    return NULL;
  }
  fps__snap_init(s, sh, data, numel, version, refs, true);
  return s;
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

void fps_counters_push_done(fps_shard_t *sh, bool ok, double seconds) {
  fps_counters_t *c = &sh->counters;
  if (!ok) {
    atomic_fetch_add(&c->push_errors, 1);
    return;
  }
  atomic_fetch_add(&c->pushes, 1);
  pthread_mutex_lock(&c->mu);
  c->push_seconds_sum += seconds;
  c->latency[(c->latency_head + c->latency_n) % FPS_LATENCY_RING] = seconds;
  if (c->latency_n < FPS_LATENCY_RING) c->latency_n++;
  else c->latency_head = (c->latency_head + 1) % FPS_LATENCY_RING;
  pthread_mutex_unlock(&c->mu);
}

int fps_shard_snapshot(fps_shard_t *sh, const char *name, fps_tensor_t **tp, fps_snap_t **snap, char *why,
                       size_t wl) {
  *tp = NULL;
  *snap = NULL;
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (!t) {
    snprintf(why, wl, "tensor '%s' not found on shard %u", name, sh->cfg.shard_id);
    return FPS_ENOTFOUND;
  }
  pthread_mutex_lock(&t->mu);
  bool ready = t->ready;
  uint64_t inited = t->init.covered;
  /* The published buffer itself (immutable): a reference, no copy, and
   * nothing to allocate. */
  if (ready) {
    fps_snap_ref(t->pbuf);
    *snap = t->pbuf;
  }
  pthread_mutex_unlock(&t->mu);
  if (!ready) {
    snprintf(why, wl, "tensor '%s' is still initialising (%" PRIu64 " of %" PRIu64 " elements have initial values)",
             name, inited, t->numel);
    return FPS_ESTATE;
  }
  *tp = t;
  return 0;
}

int fps_shard_state_snap(fps_shard_t *sh, const char *name, fps_state_snap_t *out, char *why, size_t wl) {
  memset(out, 0, sizeof *out);
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (!t) {
    snprintf(why, wl, "tensor '%s' not found on shard %u", name, sh->cfg.shard_id);
    return FPS_ENOTFOUND;
  }
  out->t = t;
  /* Sizes are fixed once the tensor exists: allocate outside the lock. */
  out->n[FPS_STATE_ROW] = t->size.row;
  out->n[FPS_STATE_COL] = t->size.col;
  out->n[FPS_STATE_VAR] = t->size.var;
  out->n[FPS_STATE_MOM] = t->size.mom;
  out->total = t->size.elements;
  if (out->total) {
    bool over = false;
    out->data = fps_tbuf_alloc(sh, out->total, &over);
    if (!out->data) {
      snprintf(why, wl,
               over ? "tensor '%s': copying its %" PRIu64 "-element state would pass the shard's limit for "
                      "in-flight tensors (--max-staging-bytes); retry later"
                    : "tensor '%s': out of memory copying its %" PRIu64 "-element state",
               name, out->total);
      return over ? FPS_ELIMIT : FPS_ENOMEM;
    }
  }
  pthread_mutex_lock(&t->mu);
  bool ready = t->ready;
  uint64_t inited = t->init.covered;
  if (ready) {
    float *src[FPS_STATE_KINDS];
    fps_tensor_state_arrays(t, src);
    float *dst = out->data;
    for (int k = 0; k < FPS_STATE_KINDS; k++) {
      if (out->n[k]) memcpy(dst, src[k], out->n[k] * sizeof(float));
      dst += out->n[k];
    }
    out->version = t->version;
    /* A block's step count and RMS are the whole tensor's (split_tensor.h). */
    out->step = t->split ? t->split->st.step : t->st.step;
    out->rms = t->split ? t->split->st.rms : t->st.rms;
    out->lr = t->last_lr;
    out->weight_decay = t->last_weight_decay;
  }
  pthread_mutex_unlock(&t->mu);
  if (!ready) {
    fps_state_snap_release(sh, out);
    snprintf(why, wl, "tensor '%s' is still initialising (%" PRIu64 " of %" PRIu64 " elements have initial values)",
             name, inited, t->numel);
    return FPS_ESTATE;
  }
  return 0;
}

const float *fps_state_snap_array(const fps_state_snap_t *s, int kind) {
  const float *p = s->data;
  for (int k = 0; k < kind; k++) p += s->n[k];
  return p;
}

void fps_state_snap_release(fps_shard_t *sh, fps_state_snap_t *s) {
  if (s->data) fps_tbuf_free(sh, s->data, s->total);
  s->data = NULL;
}

static int fps__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int fps_shard_view(fps_shard_t *sh, bool with_tensors, uint32_t log_limit, fps_shard_view_t *v) {
  memset(v, 0, sizeof *v);
  if (log_limit > sh->cfg.apply_log) log_limit = sh->cfg.apply_log;
  pthread_rwlock_rdlock(&sh->store.mu);
  uint64_t count = sh->store.count;
  v->tensors = count;
  if (with_tensors && count) {
    v->t = fps_calloc(count, sizeof *v->t);
    v->recs = log_limit ? fps_calloc(count * log_limit, sizeof *v->recs) : NULL;
    if (!v->t || (log_limit && !v->recs)) {
      pthread_rwlock_unlock(&sh->store.mu);
      fps_shard_view_free(v);
      return FPS_ENOMEM;
    }
  }
  size_t nrec = 0;
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) {
    v->param_elements += t->numel;
    if (t->split) {
      v->split_blocks++;
      v->split_elements += t->numel;
    }
    v->state.row += t->size.row;
    v->state.col += t->size.col;
    v->state.var += t->size.var;
    v->state.mom += t->size.mom;
    v->state.elements += t->size.elements;
    v->state.bytes += t->size.bytes;
    v->state.adamw_elements += t->size.adamw_elements;
    v->state.adamw_bytes += t->size.adamw_bytes;
    if (!v->t) continue;
    fps_tensor_view_t *o = &v->t[v->n++];
    o->t = t;
    pthread_mutex_lock(&t->mu);
    o->version = t->version;
    o->ready = t->ready;
    uint32_t take = t->log_len < log_limit ? t->log_len : log_limit;
    o->log = v->recs ? v->recs + nrec : NULL; /* no records asked: no array */
    o->nlog = take;
    /* Oldest first among the last `take` records. */
    for (uint32_t k = 0; k < take; k++) v->recs[nrec++] = t->log[(t->log_head + t->log_len - take + k) % t->log_cap];
    pthread_mutex_unlock(&t->mu);
  }
  pthread_rwlock_unlock(&sh->store.mu);
  fps_counters_t *c = &sh->counters;
  v->pushes = atomic_load(&c->pushes);
  v->push_errors = atomic_load(&c->push_errors);
  v->updates = atomic_load(&c->updates);
  v->bytes_received = atomic_load(&c->bytes_received);
  v->bytes_sent = atomic_load(&c->bytes_sent);
  v->update_bytes = atomic_load(&c->update_bytes);
  v->xbytes_sent = atomic_load(&c->xbytes_sent);
  v->xbytes_received = atomic_load(&c->xbytes_received);
  v->xsteps = atomic_load(&c->xsteps);
  v->xfailures = atomic_load(&c->xfailures);
  double lat[FPS_LATENCY_RING];
  pthread_mutex_lock(&c->mu);
  v->push_seconds_sum = c->push_seconds_sum;
  v->update_seconds_sum = c->update_seconds_sum;
  v->xseconds_sum = c->xseconds_sum;
  uint32_t nl = c->latency_n;
  memcpy(lat, c->latency, sizeof lat);
  pthread_mutex_unlock(&c->mu);
  if (nl) {
    qsort(lat, nl, sizeof lat[0], fps__cmp_double);
    v->push_seconds_p50 = lat[(nl - 1) / 2];
    v->push_seconds_p99 = lat[(size_t)((nl - 1) * 0.99)];
  }
  v->uptime_seconds = (double)(fps_now_ns() - sh->started_ns) / 1e9;
  return 0;
}

void fps_shard_view_free(fps_shard_view_t *v) {
  fps_free(v->t);
  fps_free(v->recs);
  memset(v, 0, sizeof *v);
}

/* ------------------------------------------------------------- rules */

const char *fps_mode_name(int mode) {
  switch (mode) {
    case FPS_MODE_SYNC: return "sync";
    case FPS_MODE_ASYNC: return "async";
    case FPS_MODE_SSP: return "ssp";
    default: return "unknown";
  }
}

int fps_shard_name_check(const char *name, char *why, size_t why_len) {
  /* The rule lives in common/name.c (the client and the checkpoint format
   * share it). */
  return fps_name_check(name, name ? strlen(name) : 0, why, why_len) < 0 ? FPS_EINVAL : 0;
}

int fps_shard_shape_check(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out, uint64_t *numel,
                          char *why, size_t why_len) {
  memset(out, 0, sizeof *out);
  if (n > FPS_MAX_DIMS) {
    snprintf(why, why_len, "tensor '%s': shape has %zu dimensions, at most %d are supported", name, n,
             FPS_MAX_DIMS);
    return FPS_EINVAL;
  }
  out->ndim = (uint32_t)n;
  for (size_t i = 0; i < n; i++) out->dim[i] = dims[i];
  char kwhy[256] = "";
  int rc = fps_shape_validate(out, numel, kwhy, sizeof kwhy);
  if (rc < 0) {
    char sh[256];
    fps_shape_format(out, sh, sizeof sh);
    snprintf(why, why_len, "tensor '%s': invalid shape %s: %s", name, sh, kwhy);
    return rc == FPS_EOVERFLOW ? FPS_EOVERFLOW : FPS_EINVAL;
  }
  return 0;
}

bool fps_shape_equal(const fps_shape_t *a, const fps_shape_t *b) {
  if (a->ndim != b->ndim) return false;
  for (uint32_t i = 0; i < a->ndim; i++)
    if (a->dim[i] != b->dim[i]) return false;
  return true;
}

int fps_shard_slice_check(const char *name, const fps_slice_t *s, const fps_shape_t *shape, uint64_t numel,
                          bool shape_required, uint64_t *count, char *why, size_t why_len) {
  size_t esz = fps_dtype_size(s->dtype);
  if (esz == 0) {
    snprintf(why, why_len, "tensor '%s': unsupported dtype %d (supported: DTYPE_F32 = 1, DTYPE_BF16 = 2)", name,
             s->dtype);
    return FPS_EINVAL;
  }
  if (s->n_shape || shape_required) {
    bool same = s->n_shape == shape->ndim;
    for (size_t i = 0; same && i < s->n_shape; i++) same = s->shape[i] == shape->dim[i];
    if (!same) {
      char want[256], got[256] = "[";
      fps_shape_format(shape, want, sizeof want);
      size_t n = 1;
      for (size_t i = 0; i < s->n_shape && n < sizeof got - 24; i++)
        n += (size_t)snprintf(got + n, sizeof got - n, "%s%" PRIu64, i ? ", " : "", s->shape[i]);
      snprintf(got + n, sizeof got - n, "]");
      snprintf(why, why_len, "tensor '%s': wrong shape %s, the tensor's shape is %s", name, got, want);
      return FPS_EINVAL;
    }
  }
  if (s->len % esz != 0) {
    snprintf(why, why_len, "tensor '%s': slice data is %zu bytes, not a whole number of %s elements", name, s->len,
             fps_dtype_name(s->dtype));
    return FPS_EINVAL;
  }
  uint64_t n = s->len / esz;
  if (s->offset > numel || n > numel - s->offset) {
    /* offset + n may not fit in 64 bits (a hostile offset): name both. */
    if (s->offset > UINT64_MAX - n)
      snprintf(why, why_len,
               "tensor '%s': slice of %" PRIu64 " elements at offset %" PRIu64
               " is out of range: the tensor has %" PRIu64 " elements",
               name, n, s->offset, numel);
    else
      snprintf(why, why_len,
               "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") is out of range: the tensor has %" PRIu64
               " elements (wrong element count for its shape?)",
               name, s->offset, s->offset + n, numel);
    return FPS_EINVAL;
  }
  *count = n;
  return 0;
}

uint64_t fps_shard_first_nonfinite(int dtype, const uint8_t *data, uint64_t n) {
  if (dtype == FPS_DTYPE_F32) {
    for (uint64_t i = 0; i < n; i++) {
      uint32_t u;
      memcpy(&u, data + 4 * i, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return i;
    }
  } else if (dtype == FPS_DTYPE_BF16) {
    for (uint64_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, data + 2 * i, 2);
      if ((h & 0x7f80u) == 0x7f80u) return i;
    }
  }
  return n;
}

/* ------------------------------------------------------------- shard */

int fps_shard_init(fps_shard_t *sh, const fps_shard_opts_t *opts, const fps_kernels_t *kernels, fps_pool_t *pool) {
  memset(sh, 0, sizeof *sh);
  sh->cfg = *opts;
  if (sh->cfg.workers == 0) sh->cfg.workers = 1;
  if (!sh->cfg.checkpoint_dir) sh->cfg.checkpoint_dir = "";
  sh->kernels = kernels;
  sh->pool = pool;
  sh->ckpt_dir_fd = -1;
  atomic_init(&sh->tbuf_bytes, 0);
  atomic_init(&sh->spare_bytes, 0);
  sh->ssp_clock = fps_calloc(sh->cfg.workers, sizeof *sh->ssp_clock);
  if (!sh->ssp_clock || fps_store_init(&sh->store) < 0 || fps__idem_init(&sh->idem, FPS_IDEM_WINDOW) < 0) {
    fps_free(sh->ssp_clock);
    sh->ssp_clock = NULL;
    return FPS_ENOMEM;
  }
  pthread_mutex_init(&sh->ssp_mu, NULL);
  pthread_mutex_init(&sh->rounds_mu, NULL);
  pthread_mutex_init(&sh->held_mu, NULL);
  pthread_mutex_init(&sh->counters.mu, NULL);
  pthread_mutex_init(&sh->ckpt_mu, NULL);
  pthread_mutex_init(&sh->xs_mu, NULL);
  pthread_mutex_init(&sh->spare_mu, NULL);
  sh->started_ns = fps_now_ns();
  return 0;
}

void fps_shard_destroy(fps_shard_t *sh) {
  if (!sh->ssp_clock) return;
  /* A sum no push holds any more is freed with its tensor. */
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) fps__reduce_free(sh, t);
  fps_store_destroy(&sh->store);
  fps__idem_destroy(&sh->idem);
  fps_free(sh->ssp_clock);
  sh->ssp_clock = NULL;
  pthread_mutex_destroy(&sh->ssp_mu);
  pthread_mutex_destroy(&sh->rounds_mu);
  pthread_mutex_destroy(&sh->held_mu);
  pthread_mutex_destroy(&sh->counters.mu);
  pthread_mutex_destroy(&sh->ckpt_mu);
  pthread_mutex_destroy(&sh->xs_mu);
  pthread_mutex_destroy(&sh->spare_mu);
}

void fps_shard_set_exchange(fps_shard_t *sh, fps_xsend_fn send, void *ctx, double deadline_seconds) {
  sh->xsend = send;
  sh->xsend_ctx = ctx;
  sh->xdeadline = deadline_seconds;
}

void fps_shard_expire(void *arg, int64_t now_ns) {
  fps_shard_t *sh = arg;
  fps__sync_expire(sh, now_ns, false, FPS_ETIMEOUT, NULL);
  fps__xstep_expire(sh, now_ns, false, NULL);
  fps__push_expire_holds(sh, now_ns, false);
  fps__ssp_expire(sh, now_ns, false, FPS_ETIMEOUT, NULL);
}

void fps_shard_fail_waiting(fps_shard_t *sh, int err, const char *why) {
  int64_t now = fps_now_ns();
  fps__sync_expire(sh, now, true, err, why);
  fps__xstep_expire(sh, now, true, why);
  fps__ssp_expire(sh, now, true, err, why);
  fps__push_expire_holds(sh, now, true); /* held calls receive again, and end */
}

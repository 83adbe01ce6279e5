/* The shard's tensors: a name -> tensor hash map, tensor lifetime, and
 * the one place an Adafactor step is applied and published (version,
 * apply log, counters) for every mode.
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
#include "internal.h"

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
  if (t->split) {
    /* The exchange's own (a step, early partials) went first: shard.c's
     * teardown calls fps__xstep_forget(), and a tensor freed at Create
     * never had any. */
    FPS_ASSERT(!t->split->xs && !t->split->mail);
    fps_split_state_destroy(&t->split->st);
    fps_free(t->split->bounds);
    fps_free(t->split->block_shards);
    fps_free(t->split);
  }
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
      FPS_LOG(FPS_LOG_ERROR, "tensor '%s': Adafactor step failed: %s", t->name, fps_strerror(rc));
      return rc;
    }
    t->version++;
    /* Publish: the staged gradient buffer becomes the tensor's own (no
     * longer staging), the old one is retired (staging while read). */
    fps__pbuf_adopt(sh, nb, out, t->numel, t->version);
    if (enc) { /* before publishing: every reader finds it made */
      fps__snap_bf16_attach(enc, nb);
      prep->bf16 = enc;
    }
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
    fps_metrics_update_observe((double)(t1 - t0) / 1e9, tr.bytes);
  }
  if (want_snap && refs > 0) {
    /* The replies read the published buffer itself: no copy. */
    atomic_fetch_add(&t->pbuf->refs, refs);
    *snap = t->pbuf;
  }
  return 0;
}




























/* ------------------------------------------------------------- rules */







/* ------------------------------------------------------------- shard */

const char *fps_tensor_name(const fps_tensor_t *t) { return t->name; }

const fps_shape_t *fps_tensor_shape(const fps_tensor_t *t) { return &t->shape; }

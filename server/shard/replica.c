/* What the standby replicas need of the core (shard.h "replicas"): a
 * tensor's whole state at one version (the primary ships it), the same
 * installed as it is (the standby copies bits: no kernel runs twice, and
 * both hold the same bytes by construction), the idempotency keys both
 * ways, and a checksum that shows the two are equal.
 *
 * A tensor's image is taken under its lock: a reference to its published
 * parameters (immutable, no copy) and a copy of its optimizer state, with
 * version, step and RMS of that one moment. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"

size_t fps_shard_tensors(fps_shard_t *sh, fps_tensor_t **out, size_t cap) {
  size_t n = 0;
  pthread_rwlock_rdlock(&sh->store.mu);
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) {
    if (n < cap) out[n] = t;
    n++;
  }
  pthread_rwlock_unlock(&sh->store.mu);
  return n;
}

/* What an image needs before any lock: the tensor's constant facts and
 * a buffer for its state copy. 0, or FPS_EUNSUPPORTED (a split block),
 * FPS_ELIMIT / FPS_ENOMEM, with why. */
static int fps__image_prep(fps_shard_t *sh, fps_tensor_t *t, fps_image_t *o, char *why, size_t wl) {
  memset(o, 0, sizeof *o);
  o->t = t;
  o->name = t->name;
  o->shape = &t->shape;
  o->hp = t->hp;
  o->numel = t->numel;
  o->n[FPS_STATE_ROW] = t->size.row;
  o->n[FPS_STATE_COL] = t->size.col;
  o->n[FPS_STATE_VAR] = t->size.var;
  o->n[FPS_STATE_MOM] = t->size.mom;
  o->total_state = t->size.elements;
  if (t->split) { /* the map is constant */
    o->is_split = true;
    fps_shard_split_map_of(t->split, &o->split);
  }
  if (o->total_state) {
    bool over = false;
    if (!(o->state = fps_tbuf_alloc(sh, o->total_state, &over))) {
      snprintf(why, wl, "tensor '%s': copying its state for the standby: %s", t->name,
               over ? "past --max-staging-bytes" : "out of memory");
      return over ? FPS_ELIMIT : FPS_ENOMEM;
    }
  }
  return 0;
}

/* Fills a prepared image from its tensor; a tensor still initialising is
 * left without params. REQUIRES t->mu. */
static void fps__image_fill_locked(fps_tensor_t *t, fps_image_t *o) {
  if (!t->ready) return;
  float *src[FPS_STATE_KINDS];
  fps_tensor_state_arrays(t, src);
  float *dst = o->state;
  for (int k = 0; k < FPS_STATE_KINDS; k++) {
    if (o->n[k]) memcpy(dst, src[k], o->n[k] * sizeof(float));
    dst += o->n[k];
  }
  fps_snap_ref(t->pbuf);
  o->params = t->pbuf;
  o->version = t->version;
  o->step = t->st.step;
  o->rms = t->st.rms;
  o->last_lr = t->last_lr;
  o->last_weight_decay = t->last_weight_decay;
  if (!t->split) return;
  const fps_tensor_split_t *sp = t->split;
  o->step = sp->st.step;
  o->rms = sp->st.rms;
  o->split_replaces = sp->replaces;
  /* The step that made this version, if it was one (not a restore, an
   * agreed version or a Create): small copies, under the lock. */
  const fps_xmail_t *ml = sp->mail;
  if (!ml || !ml->applied || ml->applied_version + 1 != t->version) return;
  o->xapplied = true;
  o->xversion = ml->applied_version;
  o->xattempt = ml->applied_attempt;
  for (int i = 0; i < 2; i++) {
    if (!ml->own[i] || !ml->own_len[i]) continue;
    if (!(o->xown[i] = fps_malloc(ml->own_len[i]))) {
      o->oom = true;
      continue;
    }
    memcpy(o->xown[i], ml->own[i], ml->own_len[i]);
    o->xown_len[i] = ml->own_len[i];
  }
}

/* After the locks: a split block's step record that could not be copied
 * fails the image (a standby without it could not answer its peers'
 * retries of that step). */
static int fps__image_check(const fps_image_t *o, char *why, size_t wl) {
  if (!o->oom) return 0;
  snprintf(why, wl, "tensor '%s': out of memory copying its last step's partials for the standby", o->name);
  return FPS_ENOMEM;
}

int fps_shard_image(fps_shard_t *sh, fps_tensor_t *t, fps_image_t *out, char *why, size_t wl) {
  int rc = fps__image_prep(sh, t, out, why, wl);
  if (rc < 0) return rc;
  pthread_mutex_lock(&t->mu);
  fps__image_fill_locked(t, out);
  pthread_mutex_unlock(&t->mu);
  if ((rc = fps__image_check(out, why, wl)) < 0) {
    fps_image_release(sh, out);
    return rc;
  }
  if (!out->params) {
    fps_image_release(sh, out);
    snprintf(why, wl, "tensor '%s' is still initialising", t->name);
    return FPS_ESTATE;
  }
  return 0;
}

static int fps__cmp_tensor_addr(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)(*(fps_tensor_t *const *)a), y = (uintptr_t)(*(fps_tensor_t *const *)b);
  return x < y ? -1 : x > y;
}

/* Whether t is in order[0..n) (sorted by address). */
static bool fps__tensor_in(fps_tensor_t *const *order, size_t n, const fps_tensor_t *t) {
  return n && bsearch(&t, order, n, sizeof *order, fps__cmp_tensor_addr) != NULL;
}

/* A failed cut: its images and keys go. (The standby is dropped on this
 * failure, replica_send.c: the keys go with it.) */
static void fps__images_drop(fps_shard_t *sh, fps_image_t *out, size_t n, fps_image_t *ex, size_t ne,
                             fps_key_rec_t *kl) {
  fps_key_recs_free(kl);
  for (size_t i = 0; i < ne; i++) fps_image_release(sh, &ex[i]);
  fps_free(ex);
  for (size_t i = 0; i < n; i++) fps_image_release(sh, &out[i]);
}

int fps_shard_images(fps_shard_t *sh, fps_tensor_t *const *t, size_t n, fps_image_t *out, fps_key_rec_t **keys,
                     fps_image_t **extra, size_t *nextra, char *why, size_t wl) {
  *keys = NULL;
  *extra = NULL;
  *nextra = 0;
  memset(out, 0, n * sizeof *out);
  fps_tensor_t **order = fps_malloc((n ? n : 1) * sizeof *order);
  if (!order) {
    snprintf(why, wl, "out of memory imaging %zu tensors", n);
    return FPS_ENOMEM;
  }
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = fps__image_prep(sh, t[i], &out[i], why, wl);
    order[i] = t[i];
  }
  if (rc < 0) {
    for (size_t i = 0; i < n; i++) fps_image_release(sh, &out[i]);
    fps_free(order);
    return rc;
  }
  qsort(order, n, sizeof *order, fps__cmp_tensor_addr);
  pthread_rwlock_wrlock(&sh->apply_gate);
  /* No push applies while the gate's write side is held (async/ssp take
   * the read side around their tensors, sync around a set's update), so
   * the keys queued now are exactly those of the pushes whose effects the
   * tensors hold from here until the gate opens. */
  pthread_mutex_lock(&sh->rkeys_mu);
  fps_key_rec_t *kl = sh->rkeys;
  sh->rkeys = sh->rkeys_last = NULL;
  pthread_mutex_unlock(&sh->rkeys_mu);
  /* The tensors those pushes changed that the caller did not name: imaged
   * in this cut too. Shipping a key without them would let a retry after a
   * failover be answered from the key while its gradient is not in the
   * promoted standby's state (lost); shipping their state without the key
   * would refuse the retry as stale (sync) or apply it twice (async). Rare:
   * the caller names what the answers marked, and a push's answer marks
   * every tensor it changed, so this is only the pushes applied between
   * the caller's pick and this gate. */
  size_t ne = 0, ecap = 0;
  fps_image_t *ex = NULL;
  fps_tensor_t **all = order;
  for (fps_key_rec_t *k = kl; k && rc == 0; k = k->next)
    for (uint32_t j = 0; j < k->n && rc == 0; j++) {
      fps_tensor_t *x = k->t[j];
      bool have = fps__tensor_in(order, n, x);
      for (size_t i = 0; i < ne && !have; i++) have = ex[i].t == x;
      if (have) continue;
      if (ne == ecap) {
        size_t c = ecap ? 2 * ecap : 4;
        fps_image_t *nx = fps_realloc(ex, c * sizeof *nx);
        if (!nx) {
          snprintf(why, wl, "out of memory imaging the tensors of the pushes applied meanwhile");
          rc = FPS_ENOMEM;
          break;
        }
        ex = nx;
        ecap = c;
      }
      rc = fps__image_prep(sh, x, &ex[ne], why, wl); /* an allocation under the gate: rare, see above */
      ne++;
    }
  if (rc == 0 && ne) {
    if (!(all = fps_malloc((n + ne) * sizeof *all))) {
      snprintf(why, wl, "out of memory imaging %zu tensors", n + ne);
      rc = FPS_ENOMEM;
    } else {
      memcpy(all, order, n * sizeof *all);
      for (size_t i = 0; i < ne; i++) all[n + i] = ex[i].t;
      qsort(all, n + ne, sizeof *all, fps__cmp_tensor_addr);
    }
  }
  if (rc < 0) {
    pthread_rwlock_unlock(&sh->apply_gate);
    if (all != order) fps_free(all);
    fps_free(order);
    fps__images_drop(sh, out, n, ex, ne, kl);
    return rc;
  }
  size_t na = n + ne;
  for (size_t i = 0; i < na; i++)
    if (i == 0 || all[i] != all[i - 1]) pthread_mutex_lock(&all[i]->mu);
  for (size_t i = 0; i < n; i++) fps__image_fill_locked(t[i], &out[i]);
  for (size_t i = 0; i < ne; i++) fps__image_fill_locked(ex[i].t, &ex[i]);
  for (size_t i = na; i-- > 0;)
    if (i == 0 || all[i] != all[i - 1]) pthread_mutex_unlock(&all[i]->mu);
  pthread_rwlock_unlock(&sh->apply_gate);
  if (all != order) fps_free(all);
  fps_free(order);
  for (size_t i = 0; i < n + ne && rc == 0; i++) rc = fps__image_check(i < n ? &out[i] : &ex[i - n], why, wl);
  if (rc < 0) {
    fps__images_drop(sh, out, n, ex, ne, kl);
    return rc;
  }
  *keys = kl;
  *extra = ex;
  *nextra = ne;
  return 0;
}

void fps_key_recs_free(fps_key_rec_t *k) {
  while (k) {
    fps_key_rec_t *nx = k->next;
    fps_free(k->v);
    fps_free(k->t);
    fps_free(k);
    k = nx;
  }
}

void fps_shard_repl_keys(fps_shard_t *sh, bool on) {
  pthread_mutex_lock(&sh->rkeys_mu);
  sh->rkeys_on = on;
  fps_key_rec_t *drop = on ? NULL : sh->rkeys;
  if (!on) sh->rkeys = sh->rkeys_last = NULL;
  pthread_mutex_unlock(&sh->rkeys_mu);
  fps_key_recs_free(drop);
}

void fps__repl_key_applied(fps_shard_t *sh, const fps_push_t *p) {
  if (!p->push_id) return;
  pthread_mutex_lock(&sh->rkeys_mu);
  bool on = sh->rkeys_on;
  pthread_mutex_unlock(&sh->rkeys_mu);
  if (!on) return;
  fps_key_rec_t *k = fps_calloc(1, sizeof *k);
  if (k && p->n && (!(k->v = fps_malloc(p->n * sizeof *k->v)) || !(k->t = fps_malloc(p->n * sizeof *k->t)))) {
    fps_key_recs_free(k);
    k = NULL;
  }
  /* Without memory the key is not shipped with its images: a retry on a
   * promoted standby may then apply again (never for an acknowledged
   * push: its answer waits for the key by its own path, replica_send.c). */
  if (!k) return;
  k->worker = p->worker_id;
  k->id = p->push_id;
  k->tensors = fps__push_tensors_hash(p);
  k->n = (uint32_t)p->n;
  for (size_t i = 0; i < p->n; i++) {
    k->v[i] = p->e[i]->version;
    k->t[i] = p->e[i]->t;
  }
  pthread_mutex_lock(&sh->rkeys_mu);
  if (sh->rkeys_on) {
    if (sh->rkeys_last) sh->rkeys_last->next = k;
    else sh->rkeys = k;
    sh->rkeys_last = k;
    k = NULL;
  }
  pthread_mutex_unlock(&sh->rkeys_mu);
  fps_key_recs_free(k);
}

void fps_image_release(fps_shard_t *sh, fps_image_t *img) {
  if (img->state) fps_tbuf_free(sh, img->state, img->total_state);
  img->state = NULL;
  for (int i = 0; i < 2; i++) {
    fps_free(img->xown[i]);
    img->xown[i] = NULL;
  }
  fps_snap_unref(img->params);
  img->params = NULL;
}

float *fps_image_take_state(fps_shard_t *sh, fps_image_t *img) {
  float *p = img->state;
  img->state = NULL;
  if (p) fps__tbuf_uncharge(sh, (img->total_state ? img->total_state : 1) * sizeof(float)); /* as fps_tbuf_alloc */
  return p;
}

int fps_shard_install(fps_shard_t *sh, const fps_image_in_t *in, char *why, size_t wl) {
  if (in->version > FPS_MAX_STEP || in->step > FPS_MAX_STEP) {
    snprintf(why, wl, "tensor '%s': version %" PRIu64 ", step %" PRIu64 ": past the largest a tensor may hold (2^53)",
             in->name, in->version, in->step);
    return FPS_EINVAL;
  }
  fps_tensor_t *t = fps_store_find(&sh->store, in->name);
  if (!t) {
    /* Created as any Create would (every rule and limit), then filled. */
    fps_create_item_t item = {.name = in->name, .dims = in->dims, .ndim = in->ndim, .hp = in->hp,
                              .split = in->split};
    fps_create_info_t info;
    uint64_t received = 0;
    int rc = fps_shard_create(sh, sh->cfg.shard_id, sh->cfg.shard_count, &item, 1, &info, &received, why, wl);
    if (rc < 0) return rc;
    t = info.t;
  }
  if (t->split) {
    /* A demoted primary's step still in flight: it settles (within its
     * exchange deadline) before the new primary's image replaces the
     * block; the stream is tried again meanwhile. (A standby begins no
     * step, so none can begin after this check.) */
    pthread_mutex_lock(&t->mu);
    bool busy = t->split->xs != NULL;
    pthread_mutex_unlock(&t->mu);
    if (busy) {
      snprintf(why, wl, "tensor '%s': a step of this block is still in flight here", in->name);
      return FPS_EUNAVAILABLE;
    }
  }
  if (t->split || in->split) {
    fps_split_map_t have;
    if (t->split) fps_shard_split_map_of(t->split, &have);
    int rc = fps_shard_split_match(in->name, t->split ? &have : NULL, in->split, why, wl);
    if (rc < 0) return rc;
  }
  /* Create-or-match's rules decide whether the image fits the tensor held. */
  fps_shape_t shape;
  uint64_t numel;
  int rc = fps_shard_shape_check(in->name, in->dims, in->ndim, &shape, &numel, why, wl);
  if (rc < 0) return rc;
  if (!fps_shape_equal(&shape, &t->shape) || memcmp(&in->hp, &t->hp, sizeof in->hp) != 0 ||
      in->n[FPS_STATE_ROW] != t->size.row || in->n[FPS_STATE_COL] != t->size.col ||
      in->n[FPS_STATE_VAR] != t->size.var || in->n[FPS_STATE_MOM] != t->size.mom) {
    snprintf(why, wl, "tensor '%s' is held here with another shape, settings or state size than the primary's",
             in->name);
    return FPS_EEXISTS;
  }
  /* A block's last step record, copied before the lock. */
  uint8_t *own[2] = {NULL, NULL};
  size_t own_len[2] = {0, 0};
  fps_xmail_t *mail = NULL;
  if (t->split) {
    bool oom = !(mail = fps_calloc(1, sizeof *mail));
    for (int i = 0; i < 2 && !oom && in->xapplied; i++)
      if (in->xown[i] && in->xown_len[i]) {
        if ((own[i] = fps_malloc(in->xown_len[i]))) memcpy(own[i], in->xown[i], in->xown_len[i]);
        else oom = true;
        own_len[i] = in->xown_len[i];
      }
    if (oom) {
      rc = FPS_ENOMEM;
      goto fail;
    }
  }
  bool over = false;
  fps_snap_t *nb;
  if (in->params_own) {
    /* The received buffer itself becomes the parameters. */
    if (!(nb = fps_malloc(sizeof *nb))) {
      rc = FPS_ENOMEM;
      goto fail;
    }
  } else {
    if (!(nb = fps__pbuf_new_staged(sh, t, &over))) {
      rc = over ? FPS_ELIMIT : FPS_ENOMEM;
      goto fail;
    }
    memcpy(nb->data, in->params, t->numel * sizeof(float)); /* nobody sees nb yet: no lock */
  }
  pthread_mutex_lock(&t->mu);
  fps_snap_t *old = t->pbuf;
  if (in->params_own) {
    fps__pbuf_adopt(sh, nb, in->params_own, t->numel, in->version);
  } else {
    fps__pbuf_publish(sh, nb);
  }
  t->pbuf = nb;
  t->param = nb->data;
  float *dst[FPS_STATE_KINDS];
  fps_tensor_state_arrays(t, dst);
  const float *src = in->state;
  for (int k = 0; k < FPS_STATE_KINDS; k++) {
    if (in->n[k]) memcpy(dst[k], src, in->n[k] * sizeof(float));
    src += in->n[k];
  }
  fps_xanchor_t *anchors = NULL;
  if (t->split) {
    fps_tensor_split_t *sp = t->split;
    sp->st.step = in->step;
    sp->st.rms = (float)in->rms;
    /* What the Exchange kept belongs to the primary's past: the block
     * holds only the step that made this version. */
    if (!sp->mail) {
      sp->mail = mail;
      mail = NULL;
    } else {
      fps__xmail_reset(sp);
    }
    if (in->xapplied && in->xversion + 1 == in->version)
      fps__xmail_applied(sp->mail, in->xversion, in->xattempt, own, own_len, true);
    sp->mail->imaged = true; /* until the block's own next step */
    /* The primary replaced the block since this standby's last image of
     * it: its anchors here are of the old history and must not be agreed
     * on later (xrecover.c: the primary dropped its own). */
    if (sp->replaces != in->split_replaces) {
      fps__xrec_new_history(sh, t);
      sp->replaces = in->split_replaces;
    }
  } else {
    t->st.step = in->step;
    t->st.rms = (float)in->rms;
  }
  t->version = in->version;
  nb->version = in->version;
  t->last_lr = in->last_lr;
  t->last_weight_decay = in->last_weight_decay;
  if (!t->ready) {
    t->ready = true;
    fps_ranges_free(&t->init);
    for (int k = 0; k < FPS_STATE_KINDS; k++) fps_ranges_free(&t->init_state[k]);
  }
  t->init_gen++;
  /* A standby keeps anchors too, at the versions its primary does (those
   * a step reached: the image brings the step that made it), so that once
   * promoted it has versions its peers can agree on (xrecover.c). */
  if (t->split && in->xapplied && in->xversion + 1 == in->version) fps__xrec_applied_locked(sh, t, &anchors);
  pthread_mutex_unlock(&t->mu);
  fps_free(mail);
  fps_free(own[0]);
  fps_free(own[1]);
  if (anchors) fps__xrec_anchor_flush(sh, anchors);
  fps__pbuf_retire(sh, t, old); /* readers may still hold it */
  atomic_fetch_add(&sh->changes, 1);
  return 0;
fail: /* before the lock: nothing changed */
  fps_free(mail);
  fps_free(own[0]);
  fps_free(own[1]);
  snprintf(why, wl, "tensor '%s': %s", in->name, rc == FPS_ELIMIT ? "past --max-staging-bytes" : "out of memory");
  return rc;
}

float *fps_shard_param_buf(fps_shard_t *sh, const char *name, uint64_t numel, bool *over_limit) {
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (t && t->numel == numel && !t->split) return fps__tbuf_take(sh, t, over_limit);
  return fps_tbuf_alloc(sh, numel, over_limit);
}

void fps_shard_param_buf_free(fps_shard_t *sh, float *p, uint64_t numel) {
  if (p) fps_tbuf_free(sh, p, numel);
}

/* ------------------------------------------------------------ checksum */

/* A 64-bit hash of n bytes in 32-byte stripes of four lanes (xxHash64's
 * round and avalanche), about memory speed; the tail is folded in 8-byte
 * words and single bytes. */
#define FPS_P1 UINT64_C(0x9E3779B185EBCA87)
#define FPS_P2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define FPS_P3 UINT64_C(0x165667B19E3779F9)
static inline uint64_t fps__rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t fps__round(uint64_t acc, uint64_t in) {
  return fps__rotl(acc + in * FPS_P2, 31) * FPS_P1;
}
static inline uint64_t fps__rd64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

uint64_t fps_hash64(const void *data, size_t n, uint64_t seed) {
  const uint8_t *p = data, *end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t a = seed + FPS_P1 + FPS_P2, b = seed + FPS_P2, c = seed, d = seed - FPS_P1;
    for (; p + 32 <= end; p += 32) {
      a = fps__round(a, fps__rd64(p));
      b = fps__round(b, fps__rd64(p + 8));
      c = fps__round(c, fps__rd64(p + 16));
      d = fps__round(d, fps__rd64(p + 24));
    }
    h = fps__rotl(a, 1) + fps__rotl(b, 7) + fps__rotl(c, 12) + fps__rotl(d, 18);
    h = (h ^ fps__round(0, a)) * FPS_P1;
    h = (h ^ fps__round(0, b)) * FPS_P1;
    h = (h ^ fps__round(0, c)) * FPS_P1;
    h = (h ^ fps__round(0, d)) * FPS_P1;
  } else {
    h = seed + FPS_P3;
  }
  h += (uint64_t)n;
  for (; p + 8 <= end; p += 8) h = fps__rotl(h ^ fps__round(0, fps__rd64(p)), 27) * FPS_P1 + FPS_P2;
  for (; p < end; p++) h = fps__rotl(h ^ (*p * FPS_P3), 11) * FPS_P1;
  h ^= h >> 33;
  h *= FPS_P2;
  h ^= h >> 29;
  h *= FPS_P3;
  h ^= h >> 32;
  return h;
}

int fps_shard_checksum(fps_shard_t *sh, fps_tensor_t *t, uint64_t *version, uint64_t *sum) {
  (void)sh;
  *sum = 0;
  pthread_mutex_lock(&t->mu);
  if (!t->ready) {
    *version = t->version;
    pthread_mutex_unlock(&t->mu);
    return FPS_ESTATE;
  }
  /* The state is updated in place: hashed under the lock. The parameters
   * are an immutable buffer: hashed after, from a reference. */
  float *arr[FPS_STATE_KINDS];
  fps_tensor_state_arrays(t, arr);
  uint64_t n[FPS_STATE_KINDS] = {t->size.row, t->size.col, t->size.var, t->size.mom};
  uint64_t hs = 0;
  for (int k = 0; k < FPS_STATE_KINDS; k++)
    if (n[k] && arr[k]) hs = fps_hash64(arr[k], n[k] * sizeof(float), hs ^ (uint64_t)(k + 1));
  fps_snap_t *p = t->pbuf;
  fps_snap_ref(p);
  *version = t->version;
  pthread_mutex_unlock(&t->mu);
  uint64_t hp = fps_hash64(p->data, p->numel * sizeof(float), 0);
  fps_snap_unref(p);
  *sum = fps_hash64(&(uint64_t[2]){hp, hs}, 16, *version);
  if (*sum == 0) *sum = 1; /* 0 means "no checksum" */
  return 0;
}

uint64_t fps_shard_state_checksum(fps_shard_t *sh) {
  uint64_t h = 0, i = 0;
  /* Tensors are never removed: walk the creation list without the store
   * lock held across the checksums (each takes its tensor's lock). */
  pthread_rwlock_rdlock(&sh->store.mu);
  fps_tensor_t *t = sh->store.first;
  pthread_rwlock_unlock(&sh->store.mu);
  for (; t; i++) {
    uint64_t v, sum;
    if (fps_shard_checksum(sh, t, &v, &sum) == 0) h = fps_hash64(&(uint64_t[2]){h, sum}, 16, i);
    pthread_rwlock_rdlock(&sh->store.mu);
    t = t->next;
    pthread_rwlock_unlock(&sh->store.mu);
  }
  return h;
}

/* ------------------------------------------------------ idempotency */

bool fps_push_key_info(const fps_push_t *p, uint32_t *worker, uint64_t *id, uint64_t *tensors) {
  if (!p->push_id || p->replayed) return false;
  *worker = p->worker_id;
  *id = p->push_id;
  *tensors = fps__push_tensors_hash(p);
  return true;
}

int fps_shard_idem_put(fps_shard_t *sh, uint32_t worker, uint64_t id, uint64_t tensors, const uint64_t *v,
                       uint32_t n) {
  uint32_t slot;
  int rc = fps__idem_claim(&sh->idem, worker, id, &slot);
  if (rc == FPS_EEXISTS) return 0; /* already known */
  if (rc < 0) return rc;
  fps__idem_settle(&sh->idem, slot, worker, id, tensors, v, n);
  return 0;
}

void fps_shard_idem_each(fps_shard_t *sh, fps_idem_each_fn fn, void *arg) {
  fps_idem_t *ix = &sh->idem;
  pthread_mutex_lock(&ix->mu);
  for (uint32_t i = 0; i < ix->cap; i++) {
    const fps_idem_entry_t *e = &ix->ent[i];
    if (e->state != FPS_IDEM_APPLIED) continue;
    fn(arg, e->worker, e->id, e->tensors, e->n <= FPS_IDEM_INLINE ? e->v.in : e->v.out, e->n);
  }
  pthread_mutex_unlock(&ix->mu);
}

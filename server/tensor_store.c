/* The shard's tensors: a name -> tensor hash map, tensor lifetime, the one
 * place an Adafactor step is applied (version, apply log, counters), and
 * the refcounted parameter snapshots replies stream from.
 *
 * Tensors are never removed while the server runs, so a pointer found under
 * the store's read lock stays valid after the lock is dropped. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "server.h"

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
  st->bucket = calloc(st->nbucket, sizeof *st->bucket);
  if (!st->bucket) return FPS_ENOMEM;
  if (pthread_rwlock_init(&st->mu, NULL) != 0) {
    free(st->bucket);
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
  free(st->bucket);
  pthread_rwlock_destroy(&st->mu);
  memset(st, 0, sizeof *st);
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
    fps_tensor_t **b = calloc(nb, sizeof *b);
    if (!b) return FPS_ENOMEM;
    for (fps_tensor_t *x = st->first; x; x = x->next) {
      size_t i = fps__hash(x->name, strlen(x->name)) & (nb - 1);
      x->hnext = b[i];
      b[i] = x;
    }
    free(st->bucket);
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
  return 0;
}

fps_tensor_t *fps_tensor_create(const char *name, size_t len, const fps_shape_t *shape,
                                uint64_t numel, const fps_adafactor_hparams_t *hp,
                                uint32_t workers, uint32_t log_cap) {
  fps_tensor_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  if (pthread_mutex_init(&t->mu, NULL) != 0) {
    free(t);
    return NULL;
  }
  t->shape = *shape;
  t->numel = numel;
  t->hp = *hp;
  t->last_lr = hp->has_lr ? hp->lr : 0.0;
  t->last_weight_decay = hp->weight_decay;
  t->name = malloc(len + 1);
  /* Parameters are written by Create's init slices; malloc (not calloc)
   * leaves untouched pages unfaulted until then. At least one float so a
   * zero-sized tensor still has a valid pointer. */
  t->param = malloc((numel ? numel : 1) * sizeof(float));
  t->round.member = calloc(workers ? workers : 1, sizeof *t->round.member);
  /* The apply log grows on demand: most tensors of a big model never need
   * the full --apply-log ring, and 1M tensors x 4096 records would be GBs. */
  t->log_max = log_cap;
  if (!t->name || !t->param || !t->round.member) goto fail;
  memcpy(t->name, name, len);
  t->name[len] = 0;
  if (fps_adafactor_state_init(&t->st, shape, hp) < 0) goto fail;
  if (fps_adafactor_state_size(shape, hp, &t->size) < 0) goto fail;
  return t;
fail:
  fps_tensor_destroy(t);
  return NULL;
}

void fps_tensor_destroy(fps_tensor_t *t) {
  if (!t) return;
  fps_adafactor_state_destroy(&t->st);
  fps_ranges_free(&t->init);
  free(t->round.member);
  free(t->log);
  free(t->param);
  free(t->name);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

int fps__tensor_apply_locked(fps_server_t *srv, fps_tensor_t *t, const float *grad,
                             uint32_t worker_id, uint64_t step, const fps_update_hp_t *uh) {
  fps_adafactor_trace_t tr;
  memset(&tr, 0, sizeof tr);
  /* This update's settings: Create's, with the push's lr and weight decay
   * (validated against the flavor's rules when they arrived). */
  fps_adafactor_hparams_t hp = t->hp;
  if (uh) {
    hp.lr = uh->lr;
    hp.weight_decay = uh->weight_decay;
  }
  int64_t t0 = fps_now_ns();
  fps_pool_t *pool = t->numel >= FPS_POOL_MIN_NUMEL ? srv->pool : NULL;
  int rc = fps_adafactor_step(srv->kernels, &hp, &t->st, t->param, grad, pool, &tr);
  int64_t t1 = fps_now_ns();
  if (rc < 0) {
    FPS_SLOG(FPS_LOG_ERROR, "tensor '%s': Adafactor step failed: %s", t->name, fps_strerror(rc));
    return rc;
  }
  t->version++;
  /* hf relative_step: the lr is the relative step size this step used. */
  t->last_lr = hp.flavor == FPS_FLAVOR_HF && hp.relative_step ? tr.rel_step : hp.lr;
  t->last_weight_decay = hp.weight_decay;
  if (t->log_len == t->log_cap && t->log_cap < t->log_max) {
    /* Not wrapped yet (head is 0), so growing keeps the order. */
    uint32_t cap = t->log_cap ? t->log_cap * 2 : 16;
    if (cap > t->log_max) cap = t->log_max;
    fps_apply_rec_t *nl = realloc(t->log, cap * sizeof *nl);
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
  atomic_fetch_add(&srv->counters.updates, 1);
  atomic_fetch_add(&srv->counters.update_bytes, tr.bytes);
  fps_metrics_update_observe((double)(t1 - t0) / 1e9, tr.bytes);
  pthread_mutex_lock(&srv->counters.mu);
  srv->counters.update_seconds_sum += (double)(t1 - t0) / 1e9;
  pthread_mutex_unlock(&srv->counters.mu);
  return 0;
}

void fps_shape_format(const fps_shape_t *s, char *buf, size_t len) {
  size_t n = 0;
  n += (size_t)snprintf(buf + n, len - n, "[");
  for (uint32_t i = 0; i < s->ndim && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, "%s%" PRIu64, i ? ", " : "", s->dim[i]);
  if (n < len) snprintf(buf + n, len - n, "]");
}

float *fps_tbuf_alloc(fps_server_t *srv, uint64_t numel, bool *over_limit) {
  uint64_t bytes = (numel ? numel : 1) * sizeof(float);
  *over_limit = false;
  uint64_t cur = atomic_load(&srv->tbuf_bytes);
  do {
    if (cur + bytes > srv->cfg.max_staging_bytes || cur + bytes < cur) {
      *over_limit = true;
      return NULL;
    }
  } while (!atomic_compare_exchange_weak(&srv->tbuf_bytes, &cur, cur + bytes));
  float *p = malloc(bytes);
  if (!p) atomic_fetch_sub(&srv->tbuf_bytes, bytes);
  return p;
}

void fps_tbuf_free(fps_server_t *srv, float *p, uint64_t numel) {
  if (!p) return;
  free(p);
  atomic_fetch_sub(&srv->tbuf_bytes, (numel ? numel : 1) * sizeof(float));
}

fps_snap_t *fps_snap_wrap(fps_server_t *srv, float *data, uint64_t numel, uint64_t version, int refs) {
  fps_snap_t *s = malloc(sizeof *s);
  if (!s) {
    fps_tbuf_free(srv, data, numel);
    return NULL;
  }
  atomic_init(&s->refs, refs);
  s->srv = srv;
  s->data = data;
  s->numel = numel;
  s->version = version;
  return s;
}

void fps_snap_unref(fps_snap_t *s) {
  if (!s) return;
  if (atomic_fetch_sub(&s->refs, 1) == 1) {
    fps_tbuf_free(s->srv, s->data, s->numel);
    free(s);
  }
}

void fps_counters_push_done(fps_server_t *srv, bool ok, double seconds) {
  fps_counters_t *c = &srv->counters;
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

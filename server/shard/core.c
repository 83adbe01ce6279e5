/* The shard: its set-up and teardown, the expiry hook and shutdown, the
 * counters, and the views the read-only methods take of it (Pull's
 * parameters, GetState's optimizer state, Stats' figures). It stands
 * above every other file of the core: it is the one that starts and ends
 * them all. Its counters are the metrics registry's (server/metrics),
 * the one store of them. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "internal.h"
#include "metrics.h"

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
    /* A block's step count and RMS are the whole tensor's (internal.h, store.c). */
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

int fps_shard_view(fps_shard_t *sh, bool with_tensors, uint32_t log_limit, fps_shard_view_t *v) {
  memset(v, 0, sizeof *v);
  v->simd = fps_kernels_name(sh->kernels);
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
    /* Constant since Create: read through t without its lock. */
    o->name = t->name;
    o->shape = &t->shape;
    o->numel = t->numel;
    o->flavor = t->hp.flavor;
    o->factored = t->split ? t->split->g.factored : t->st.factored;
    o->size = t->size;
    o->split = t->split != NULL;
    if (t->split) fps_shard_split_map_of(t->split, &o->map);
    pthread_mutex_lock(&t->mu);
    o->version = t->version;
    o->ready = t->ready;
    o->split_lost_steps = fps__xrec_lost_steps(t);
    uint32_t take = t->log_len < log_limit ? t->log_len : log_limit;
    o->log = v->recs ? v->recs + nrec : NULL; /* no records asked: no array */
    o->nlog = take;
    /* Oldest first among the last `take` records. */
    for (uint32_t k = 0; k < take; k++) v->recs[nrec++] = t->log[(t->log_head + t->log_len - take + k) % t->log_cap];
    pthread_mutex_unlock(&t->mu);
  }
  pthread_rwlock_unlock(&sh->store.mu);
  fps_metrics_totals_t c; /* the registry is the one store of counters */
  fps_metrics_totals(&c);
  v->pushes = c.pushes;
  v->push_errors = c.push_errors;
  v->updates = c.updates;
  v->bytes_received = c.bytes_received;
  v->bytes_sent = c.bytes_sent;
  v->update_bytes = c.update_bytes;
  v->xbytes_sent = c.xbytes_sent;
  v->xbytes_received = c.xbytes_received;
  v->xsteps = c.xsteps;
  v->xfailures = c.xfailures;
  v->push_seconds_sum = c.push_seconds_sum;
  v->update_seconds_sum = c.update_seconds_sum;
  v->xseconds_sum = c.xseconds_sum;
  v->push_seconds_p50 = c.push_seconds_p50;
  v->push_seconds_p99 = c.push_seconds_p99;
  v->uptime_seconds = (double)(fps_now_ns() - sh->started_ns) / 1e9;
  return 0;
}

void fps_shard_view_free(fps_shard_view_t *v) {
  fps_free(v->t);
  fps_free(v->recs);
  memset(v, 0, sizeof *v);
}

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
  atomic_init(&sh->tbuf_peak, 0);
  atomic_init(&sh->staged_bytes, 0);
  atomic_init(&sh->staged_peak, 0);
  sh->ssp_clock = fps_calloc(sh->cfg.workers, sizeof *sh->ssp_clock);
  if (!sh->ssp_clock || fps_store_init(&sh->store) < 0 || fps__idem_init(&sh->idem, FPS_IDEM_WINDOW, FPS_IDEM_PER_WORKER) < 0) {
    fps_free(sh->ssp_clock);
    sh->ssp_clock = NULL;
    return FPS_ENOMEM;
  }
  pthread_mutex_init(&sh->ssp_mu, NULL);
  pthread_mutex_init(&sh->rounds_mu, NULL);
  pthread_mutex_init(&sh->held_mu, NULL);
  pthread_mutex_init(&sh->ckpt_mu, NULL);
  pthread_mutex_init(&sh->job_mu, NULL);
  if (sh->cfg.job_id && *sh->cfg.job_id) {
    snprintf(sh->job_id, sizeof sh->job_id, "%s", sh->cfg.job_id);
    snprintf(sh->job_from, sizeof sh->job_from, "--job-id");
  }
  pthread_mutex_init(&sh->xs_mu, NULL);
  pthread_mutex_init(&sh->spare_mu, NULL);
  pthread_rwlockattr_t ra;
  pthread_rwlockattr_init(&ra);
  pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&sh->apply_gate, &ra);
  pthread_rwlockattr_destroy(&ra);
  pthread_mutex_init(&sh->rkeys_mu, NULL);
  sh->started_ns = fps_now_ns();
  return 0;
}

void fps_shard_destroy(fps_shard_t *sh) {
  if (!sh->ssp_clock) return;
  /* A sum no push holds any more is freed with its tensor. */
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) {
    fps__reduce_free(sh, t);
    fps__xstep_forget(t);
  }
  fps_store_destroy(&sh->store);
  fps__idem_destroy(&sh->idem);
  fps_free(sh->ssp_clock);
  sh->ssp_clock = NULL;
  pthread_mutex_destroy(&sh->ssp_mu);
  pthread_mutex_destroy(&sh->rounds_mu);
  pthread_mutex_destroy(&sh->held_mu);
  pthread_mutex_destroy(&sh->ckpt_mu);
  pthread_mutex_destroy(&sh->job_mu);
  pthread_mutex_destroy(&sh->xs_mu);
  pthread_mutex_destroy(&sh->spare_mu);
  pthread_rwlock_destroy(&sh->apply_gate);
  fps_key_recs_free(sh->rkeys);
  sh->rkeys = sh->rkeys_last = NULL;
  pthread_mutex_destroy(&sh->rkeys_mu);
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

int fps_shard_new(const fps_shard_opts_t *opts, const fps_kernels_t *kernels, fps_pool_t *pool,
                  fps_shard_t **out) {
  *out = NULL;
  fps_shard_t *sh = fps_malloc(sizeof *sh);
  if (!sh) return FPS_ENOMEM;
  int rc = fps_shard_init(sh, opts, kernels, pool);
  if (rc < 0) {
    fps_free(sh);
    return rc;
  }
  *out = sh;
  return 0;
}

void fps_shard_free(fps_shard_t *sh) {
  if (!sh) return;
  fps_shard_destroy(sh);
  fps_free(sh);
}

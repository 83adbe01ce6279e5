/* PushPull: a worker streams gradient slices for some tensors, half-closes,
 * and gets the fresh parameters and versions streamed back.
 *
 * Life of a call (phase):
 *   RECV  one RECV_MESSAGE at a time; each message is validated and its
 *         slices decoded straight into per-tensor staging buffers
 *   WAIT  after the half-close: sync joins the rounds (and is resumed by
 *         whoever completes them), ssp may park until the slowest worker
 *         catches up, async applies at once
 *   SEND  the reply streams from the snapshots, one message per batch
 * A failure at any point answers with a status and leaves every tensor as
 * it was: nothing is applied before the whole stream has been validated.
 *
 * Copies of one tensor while a push is in flight: the parameters
 * themselves, plus one staging buffer per pushing call (the gradient in
 * fp32), which after the update is reused as the reply snapshot (sync: the
 * W workers' buffers are summed into the lowest worker's, which becomes
 * the one snapshot all W share; the others are freed). Per message, the
 * received bytes exist twice more (gRPC's slices, the flattened and
 * unpacked message), bounded by the message size, not the tensor size. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "wire.h"

enum { PP_RECV, PP_WAIT, PP_SEND, PP_DONE };

typedef struct fps_pp_call_s {
  fps_call_t base;
  int phase;                  /* PP_* (base.mu) */
  bool cancelled;             /* cancel notice seen (base.mu) */
  bool have_header;           /* worker_id/step taken from the first message */
  uint32_t worker_id;
  uint64_t step;
  uint32_t num_workers;       /* the worker's W, 0: unchecked */
  int expect_mode;            /* the worker's expected mode, 0: any */
  bool skip_params;
  fps_push_entry_t **e;       /* entries in first-seen order */
  size_t n, cap;
  fps_push_entry_t **htab;    /* tensor pointer -> entry, open addressing */
  size_t hcap;
  size_t pending;             /* unresolved entries + 1 hold (base.mu) */
  fps_reply_t reply;
  fps_ssp_wait_t wait;
} fps_pp_call_t;

static void fps__pp_destroy(fps_call_t *c) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  for (size_t i = 0; i < pp->n; i++) {
    fps_push_entry_t *e = pp->e[i];
    fps_tbuf_free(c->srv, e->grad, e->t->numel);
    fps_ranges_free(&e->got);
    free(e->msg);
    fps_snap_unref(e->snap);
    free(e);
  }
  free(pp->e);
  free(pp->htab);
  fps_reply_free(&pp->reply);
  free(pp);
}

/* Ends the call with an error; counts it once. */
static void fps__pp_fail(fps_pp_call_t *pp, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fps__pp_fail(fps_pp_call_t *pp, grpc_status_code code, const char *fmt, ...) {
  pthread_mutex_lock(&pp->base.mu);
  bool first = pp->phase != PP_DONE;
  pp->phase = PP_DONE;
  pthread_mutex_unlock(&pp->base.mu);
  if (!first) return;
  fps_counters_push_done(pp->base.srv, false, 0);
  va_list ap;
  va_start(ap, fmt);
  fps_call_failv(&pp->base, code, fmt, ap);
  va_end(ap);
}

static void fps__pp_send_next(fps_pp_call_t *pp) {
  bool last = false;
  grpc_byte_buffer *bb = fps_reply_next(&pp->reply, pp->base.srv, &last);
  if (!bb) {
    fps__pp_fail(pp, GRPC_STATUS_RESOURCE_EXHAUSTED, "PushPull: out of memory packing the reply");
    return;
  }
  if (last) {
    pthread_mutex_lock(&pp->base.mu);
    pp->phase = PP_DONE;
    pthread_mutex_unlock(&pp->base.mu);
    fps_counters_push_done(pp->base.srv, true, (double)(fps_now_ns() - pp->base.start_ns) / 1e9);
  }
  /* A failed final send has released the call already: touch it only
   * after a failed intermediate one. */
  if (fps_call_send(&pp->base, bb, last) < 0 && !last)
    fps_call_fail(&pp->base, GRPC_STATUS_INTERNAL, "PushPull: cannot send the reply");
}

/* Every entry is resolved: answer. */
static void fps__pp_finish(fps_pp_call_t *pp) {
  for (size_t i = 0; i < pp->n; i++) {
    fps_push_entry_t *e = pp->e[i];
    if (e->code != GRPC_STATUS_OK) {
      fps__pp_fail(pp, e->code, "%s", e->msg ? e->msg : "PushPull: the call was cancelled");
      return;
    }
  }
  pp->reply.items = calloc(pp->n ? pp->n : 1, sizeof *pp->reply.items);
  if (!pp->reply.items) {
    fps__pp_fail(pp, GRPC_STATUS_RESOURCE_EXHAUSTED, "PushPull: out of memory");
    return;
  }
  for (size_t i = 0; i < pp->n; i++) {
    fps_push_entry_t *e = pp->e[i];
    fps_reply_item_t *it = &pp->reply.items[i];
    it->t = e->t;
    it->snap = e->snap; /* moves: the reply drops it */
    e->snap = NULL;
    it->version = e->version;
    it->dtype = e->dtype;
  }
  pp->reply.n = pp->n;
  pthread_mutex_lock(&pp->base.mu);
  pp->phase = PP_SEND;
  pthread_mutex_unlock(&pp->base.mu);
  fps__pp_send_next(pp);
}

/* Drops one pending count; the last one answers. */
static void fps__pp_release(fps_pp_call_t *pp, size_t k) {
  pthread_mutex_lock(&pp->base.mu);
  pp->pending -= k;
  bool last = pp->pending == 0;
  pthread_mutex_unlock(&pp->base.mu);
  if (last) fps__pp_finish(pp);
}

void fps_pushpull_resolved(fps_push_entry_t *e) { fps__pp_release(e->owner, 1); }

/* async/ssp: applies every entry now (each under its tensor's lock) and
 * turns its staging buffer into the reply snapshot. */
static void fps__pp_apply_all(fps_pp_call_t *pp) {
  fps_server_t *srv = pp->base.srv;
  for (size_t i = 0; i < pp->n; i++) {
    fps_push_entry_t *e = pp->e[i];
    fps_tensor_t *t = e->t;
    pthread_mutex_lock(&t->mu);
    /* no_grad: nothing to apply (no update, no weight decay); the reply
     * carries the current params. */
    int rc = e->no_grad ? 0 : fps__tensor_apply_locked(srv, t, e->grad, pp->worker_id, e->step, &e->uh);
    e->version = t->version;
    if (rc == 0 && !e->skip_params) memcpy(e->grad, t->param, t->numel * sizeof(float));
    pthread_mutex_unlock(&t->mu);
    if (rc < 0) {
      e->code = GRPC_STATUS_INTERNAL;
      e->msg = strdup("the Adafactor step failed");
      continue;
    }
    e->code = GRPC_STATUS_OK;
    if (!e->skip_params) {
      e->snap = fps_snap_wrap(srv, e->grad, t->numel, e->version, 1);
      e->grad = NULL;
      if (!e->snap) {
        e->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        e->msg = strdup("out of memory for the parameter snapshot");
      }
    } else {
      fps_tbuf_free(srv, e->grad, t->numel);
      e->grad = NULL;
    }
  }
  if (srv->cfg.mode == FPS_MODE_SSP) fps_ssp_advance(srv, pp->worker_id, pp->step);
}

void fps_pushpull_ssp_resume(fps_pp_call_t *pp) {
  fps__pp_apply_all(pp);
  fps__pp_finish(pp);
}

void fps_pushpull_ssp_fail(fps_pp_call_t *pp, grpc_status_code code, const char *msg) {
  fps__pp_fail(pp, code, "%s", msg);
}

static void fps__pp_on_cancel(fps_call_t *c) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  fps_server_t *srv = c->srv;
  pthread_mutex_lock(&c->mu);
  pp->cancelled = true;
  int phase = pp->phase;
  pthread_mutex_unlock(&c->mu);
  if (phase != PP_WAIT) return; /* RECV/SEND: the pending batch fails instead */
  if (srv->cfg.mode == FPS_MODE_SYNC) {
    size_t k = fps_sync_withdraw(srv, pp->e, pp->n);
    if (k) fps__pp_release(pp, k);
  } else if (srv->cfg.mode == FPS_MODE_SSP && fps_ssp_unpark(srv, &pp->wait)) {
    fps__pp_fail(pp, GRPC_STATUS_CANCELLED, "PushPull: cancelled while waiting for slower workers");
  }
}

/* The half-close arrived: everything is received and validated. */
static void fps__pp_commit(fps_pp_call_t *pp) {
  fps_server_t *srv = pp->base.srv;
  for (size_t i = 0; i < pp->n; i++) {
    fps_push_entry_t *e = pp->e[i];
    fps_push_settings_resolve(e);
    if (e->no_grad) continue;
    if (e->got.covered != e->t->numel) {
      uint64_t gap = fps_ranges_first_gap(&e->got, e->t->numel);
      fps__pp_fail(pp, GRPC_STATUS_INVALID_ARGUMENT,
                   "tensor '%s': missing slices: the gradient covers %" PRIu64 " of %" PRIu64
                   " elements (first missing element %" PRIu64 ")",
                   e->t->name, e->got.covered, e->t->numel, gap);
      return;
    }
  }
  pthread_mutex_lock(&pp->base.mu);
  pp->phase = PP_WAIT;
  pp->pending = pp->n + 1; /* +1: this thread's hold until it is done here */
  pthread_mutex_unlock(&pp->base.mu);

  if (srv->cfg.mode == FPS_MODE_SYNC && pp->n > 0) {
    char why[FPS_WHY_MAX];
    grpc_status_code code =
        fps_sync_join(srv, pp->e, pp->n, pp->worker_id, pp->base.deadline_ns, why, sizeof why);
    if (code != GRPC_STATUS_OK) {
      fps__pp_fail(pp, code, "%s", why); /* joined none of the rounds */
      return;
    }
    pthread_mutex_lock(&pp->base.mu);
    bool cancelled = pp->cancelled;
    pthread_mutex_unlock(&pp->base.mu);
    if (cancelled) {
      /* The cancel notice raced the join: take back what is still waiting. */
      size_t k = fps_sync_withdraw(srv, pp->e, pp->n);
      if (k) fps__pp_release(pp, k);
    }
    fps__pp_release(pp, 1);
    return;
  }
  if (srv->cfg.mode == FPS_MODE_SSP && pp->n > 0) {
    pp->wait.pp = pp;
    pp->wait.worker_id = pp->worker_id;
    pp->wait.step = pp->step;
    pp->wait.deadline_ns = pp->base.deadline_ns;
    if (!fps_ssp_admit_or_park(srv, &pp->wait)) {
      pthread_mutex_lock(&pp->base.mu);
      bool cancelled = pp->cancelled;
      pthread_mutex_unlock(&pp->base.mu);
      if (cancelled && fps_ssp_unpark(srv, &pp->wait))
        fps__pp_fail(pp, GRPC_STATUS_CANCELLED, "PushPull: cancelled while waiting for slower workers");
      return; /* resumed by fps_ssp_advance or failed by the timer */
    }
  }
  fps__pp_apply_all(pp);
  fps__pp_finish(pp);
}

static fps_push_entry_t **fps__pp_slot(fps_pp_call_t *pp, const fps_tensor_t *t) {
  size_t h = ((uintptr_t)t >> 4) * UINT64_C(0x9E3779B97F4A7C15) & (pp->hcap - 1);
  while (pp->htab[h] && pp->htab[h]->t != t) h = (h + 1) & (pp->hcap - 1);
  return &pp->htab[h];
}

/* The entry for t in this call, created on first sight; NULL on OOM or
 * (with *over_limit) when staging would pass --max-staging-bytes. */
static fps_push_entry_t *fps__pp_entry(fps_pp_call_t *pp, fps_tensor_t *t, int dtype, bool *over_limit) {
  if (pp->hcap && *fps__pp_slot(pp, t)) return *fps__pp_slot(pp, t);
  if ((pp->n + 1) * 2 > pp->hcap) {
    size_t cap = pp->hcap ? pp->hcap * 2 : 16;
    fps_push_entry_t **nt = calloc(cap, sizeof *nt);
    if (!nt) return NULL;
    free(pp->htab);
    pp->htab = nt;
    pp->hcap = cap;
    for (size_t i = 0; i < pp->n; i++) *fps__pp_slot(pp, pp->e[i]->t) = pp->e[i];
  }
  if (pp->n == pp->cap) {
    size_t cap = pp->cap ? pp->cap * 2 : 8;
    fps_push_entry_t **ne = realloc(pp->e, cap * sizeof *ne);
    if (!ne) return NULL;
    pp->e = ne;
    pp->cap = cap;
  }
  fps_push_entry_t *e = calloc(1, sizeof *e);
  if (!e) return NULL;
  e->grad = fps_tbuf_alloc(pp->base.srv, t->numel, over_limit);
  if (!e->grad) {
    free(e);
    return NULL;
  }
  e->owner = pp;
  e->t = t;
  e->worker_id = pp->worker_id;
  e->skip_params = pp->skip_params;
  e->deadline_ns = pp->base.deadline_ns;
  e->dtype = dtype;
  e->step = pp->step;
  pp->e[pp->n++] = e;
  *fps__pp_slot(pp, t) = e;
  return e;
}

/* The ready tensor `name` of this shard, or NULL with a status in why. */
static fps_tensor_t *fps__pp_tensor(fps_pp_call_t *pp, const char *name, uint64_t *version,
                                    grpc_status_code *code, char *why, size_t wl) {
  fps_server_t *srv = pp->base.srv;
  if ((*code = fps_wire_name(name, why, wl)) != GRPC_STATUS_OK) return NULL;
  pthread_rwlock_rdlock(&srv->store.mu);
  fps_tensor_t *t = fps__store_find_locked(&srv->store, name, strlen(name));
  pthread_rwlock_unlock(&srv->store.mu);
  if (!t) {
    snprintf(why, wl, "tensor '%s' not found on shard %u", name, srv->cfg.shard_id);
    *code = GRPC_STATUS_NOT_FOUND;
    return NULL;
  }
  pthread_mutex_lock(&t->mu);
  bool ready = t->ready;
  *version = t->version;
  pthread_mutex_unlock(&t->mu);
  if (!ready) {
    snprintf(why, wl, "tensor '%s' is still initialising: push after every initial value is sent", name);
    *code = GRPC_STATUS_FAILED_PRECONDITION;
    return NULL;
  }
  return t;
}

/* A new entry for t at `step`: fails early on a sync step that cannot join
 * (the join re-checks), or on staging limits. */
static fps_push_entry_t *fps__pp_new_entry(fps_pp_call_t *pp, fps_tensor_t *t, uint64_t version, int dtype,
                                           uint64_t step, grpc_status_code *code, char *why, size_t wl) {
  fps_server_t *srv = pp->base.srv;
  if (srv->cfg.mode == FPS_MODE_SYNC && step != version) {
    snprintf(why, wl,
             step < version
                 ? "tensor '%s': stale push: worker %u sent step %" PRIu64 " but the tensor is at version %" PRIu64
                 : "tensor '%s': worker %u sent step %" PRIu64 ", ahead of shard: the tensor is at version %" PRIu64,
             t->name, pp->worker_id, step, version);
    if (step > version) fps_checkpoint_ahead_hint(t, why, wl);
    *code = GRPC_STATUS_FAILED_PRECONDITION;
    return NULL;
  }
  bool over = false;
  fps_push_entry_t *e = fps__pp_entry(pp, t, dtype, &over);
  if (!e && over) {
    snprintf(why, wl,
             "tensor '%s': staging its %" PRIu64 "-byte gradient would pass the shard's limit of %" PRIu64
             " bytes for in-flight tensors (--max-staging-bytes); retry later",
             t->name, t->numel * 4, srv->cfg.max_staging_bytes);
    *code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    return NULL;
  }
  if (!e) {
    snprintf(why, wl, "tensor '%s': out of memory staging a %" PRIu64 "-element gradient", t->name, t->numel);
    *code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    return NULL;
  }
  e->step = step;
  return e;
}

/* One TensorPush: validated, recorded in its tensor's entry. */
static grpc_status_code fps__pp_tensor_push(fps_pp_call_t *pp, const Factorps__V1__PushPullRequest__TensorPush *tp,
                                            char *why, size_t wl) {
  const char *name = tp->name ? tp->name : "";
  grpc_status_code code;
  uint64_t version;
  fps_tensor_t *t = fps__pp_tensor(pp, name, &version, &code, why, wl);
  if (!t) return code;
  fps_push_entry_t *e = pp->hcap ? *fps__pp_slot(pp, t) : NULL;
  if (e && e->has_push) {
    snprintf(why, wl, "tensor '%s': named by two TensorPush entries in one PushPull call (at most one each)", name);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (e) {
    snprintf(why, wl,
             "tensor '%s': its TensorPush came after its first gradient slice; send it in the same message "
             "as that slice or earlier",
             name);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  bool has_lr = tp->has_lr_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR;
  bool has_wd = tp->has_weight_decay_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_WEIGHT_DECAY_WEIGHT_DECAY;
  bool has_step = tp->has_step_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_STEP_STEP;
  int rc = fps_push_settings_check(t, has_lr, tp->lr, has_wd, tp->weight_decay, why, wl);
  if (rc < 0) return fps_wire_status(rc);
  e = fps__pp_new_entry(pp, t, version, FACTORPS__V1__DTYPE__DTYPE_F32, has_step ? tp->step : pp->step, &code,
                        why, wl);
  if (!e) return code;
  e->has_push = true;
  e->has_lr = has_lr;
  e->lr = tp->lr;
  e->has_weight_decay = has_wd;
  e->weight_decay = tp->weight_decay;
  e->no_grad = tp->no_grad;
  return GRPC_STATUS_OK;
}

/* Validates one request message and stages its slices. */
static grpc_status_code fps__pp_message(fps_pp_call_t *pp, const Factorps__V1__PushPullRequest *m, char *why,
                                        size_t wl) {
  fps_server_t *srv = pp->base.srv;
  if (!pp->have_header) {
    pp->have_header = true;
    pp->worker_id = m->worker_id;
    pp->step = m->step;
    pp->skip_params = m->skip_params;
    pp->num_workers = m->num_workers;
    pp->expect_mode = (int)m->expect_mode;
    int rc = fps_push_header_check(&srv->cfg, m->worker_id, m->num_workers, (int)m->expect_mode, why, wl);
    if (rc < 0) return fps_wire_status(rc);
  } else if (m->worker_id != pp->worker_id || m->step != pp->step || m->num_workers != pp->num_workers ||
             (int)m->expect_mode != pp->expect_mode) {
    snprintf(why, wl,
             "worker_id/step/num_workers/expect_mode changed within one PushPull stream (%u/%" PRIu64
             "/%u/%d then %u/%" PRIu64 "/%u/%d)",
             pp->worker_id, pp->step, pp->num_workers, pp->expect_mode, m->worker_id, m->step, m->num_workers,
             (int)m->expect_mode);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  grpc_status_code code;
  /* Settings first: a message may carry a tensor's TensorPush together
   * with its first slice. */
  for (size_t i = 0; i < m->n_tensors; i++)
    if ((code = fps__pp_tensor_push(pp, m->tensors[i], why, wl)) != GRPC_STATUS_OK) return code;
  for (size_t i = 0; i < m->n_grads; i++) {
    const Factorps__V1__TensorSlice *s = m->grads[i];
    const char *name = s->name ? s->name : "";
    uint64_t version;
    fps_tensor_t *t = fps__pp_tensor(pp, name, &version, &code, why, wl);
    if (!t) return code;
    uint64_t count;
    if ((code = fps_wire_slice(name, s, &t->shape, t->numel, true, &count, why, wl)) != GRPC_STATUS_OK)
      return code;
    fps_push_entry_t *e = pp->hcap ? *fps__pp_slot(pp, t) : NULL;
    if (!e) {
      e = fps__pp_new_entry(pp, t, version, (int)s->dtype, pp->step, &code, why, wl);
      if (!e) return code;
    } else if (e->no_grad) {
      snprintf(why, wl, "tensor '%s': gradient slices sent for a tensor its TensorPush marks no_grad", name);
      return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (!e->has_slices) e->dtype = (int)s->dtype; /* the first slice's dtype: the reply's */
    e->has_slices = true;
    int rc = fps_ranges_add(&e->got, s->offset, s->offset + count);
    if (rc == FPS_EEXISTS) {
      snprintf(why, wl, "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") overlaps a slice already received", name,
               s->offset, s->offset + count);
      return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (rc < 0) {
      snprintf(why, wl, "tensor '%s': out of memory", name);
      return GRPC_STATUS_RESOURCE_EXHAUSTED;
    }
    uint64_t bad = count;
    fps_dtype_decode((int)s->dtype, s->data.data, count, e->grad + s->offset, &bad);
    if (bad < count) {
      float v = e->grad[s->offset + bad];
      if (isnan(v) || isinf(v))
        snprintf(why, wl, "tensor '%s': gradient element %" PRIu64 " is %s; nothing was applied", name,
                 s->offset + bad, isnan(v) ? "NaN" : "Inf");
      else
        snprintf(why, wl,
                 "tensor '%s': gradient element %" PRIu64 " is %g, beyond the largest magnitude the shard "
                 "accepts (2^63 = %g: its square would overflow float32); nothing was applied",
                 name, s->offset + bad, (double)v, FPS_GRAD_ABS_LIMIT);
      return GRPC_STATUS_INVALID_ARGUMENT;
    }
    atomic_fetch_add(&srv->counters.bytes_received, s->data.len);
    fps_metrics_rpc_bytes(FPS_METRICS_PUSHPULL, s->data.len, 0);
  }
  return GRPC_STATUS_OK;
}

static void fps__pp_on_batch(fps_call_t *c, bool ok) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  pthread_mutex_lock(&c->mu);
  int phase = pp->phase;
  pthread_mutex_unlock(&c->mu);
  if (!ok) {
    fps__pp_fail(pp, GRPC_STATUS_CANCELLED, "PushPull: the call ended early");
    return;
  }
  if (phase == PP_SEND) {
    fps__pp_send_next(pp);
    return;
  }
  if (phase != PP_RECV) return;
  if (!c->recv_buf) {
    fps__pp_commit(pp); /* half-close */
    return;
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  Factorps__V1__PushPullRequest *m = NULL;
  char why[FPS_WHY_MAX];
  grpc_status_code code;
  if (fps_bb_flatten(c->recv_buf, &buf, &len) < 0) {
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    snprintf(why, sizeof why, "PushPull: out of memory reading a %zu-byte message",
             grpc_byte_buffer_length(c->recv_buf));
  } else if ((code = fps_wire_unpack(&factorps__v1__push_pull_request__descriptor, buf, len,
                                     (ProtobufCMessage **)&m, why, sizeof why)) == GRPC_STATUS_OK) {
    /* Drop the wire copy before decoding into staging: keeps the peak at
     * one extra message rather than two. */
    free(buf);
    buf = NULL;
    grpc_byte_buffer_destroy(c->recv_buf);
    c->recv_buf = NULL;
    code = fps__pp_message(pp, m, why, sizeof why);
  } else {
    char w2[FPS_WHY_MAX + 16];
    snprintf(w2, sizeof w2, "PushPull: %s", why);
    snprintf(why, sizeof why, "%.*s", (int)sizeof why - 1, w2);
  }
  if (m) factorps__v1__push_pull_request__free_unpacked(m, NULL);
  free(buf);
  if (code != GRPC_STATUS_OK) {
    fps__pp_fail(pp, code, "%s", why);
    return;
  }
  if (fps_call_recv(c) < 0) fps__pp_fail(pp, GRPC_STATUS_INTERNAL, "PushPull: cannot receive");
}

void fps_rpc_pushpull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md) {
  fps_pp_call_t *pp = calloc(1, sizeof *pp);
  if (!pp) {
    grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(md);
    return;
  }
  pp->base.destroy = fps__pp_destroy;
  pp->base.on_batch = fps__pp_on_batch;
  pp->base.on_cancel = fps__pp_on_cancel;
  pp->phase = PP_RECV;
  if (fps_call_begin(&pp->base, srv, call, deadline, md, "PushPull") < 0) return;
  if (fps_call_recv(&pp->base) < 0) fps__pp_fail(pp, GRPC_STATUS_INTERNAL, "PushPull: cannot receive");
}

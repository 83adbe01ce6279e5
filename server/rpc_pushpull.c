/* PushPull: a worker streams gradient slices for some tensors, half-closes,
 * and gets the fresh parameters and versions streamed back.
 *
 * The handler only moves bytes: each message is decoded and its slices are
 * handed to the core's push (shard/push.c), which checks, stages and, at
 * the half-close, applies them, joins sync rounds or waits in ssp. Life of
 * a call (phase):
 *   RECV  one RECV_MESSAGE at a time, each fed to fps_push_header/slice
 *   CLOSING  no message came: half-close or a dead call; the initial
 *         metadata is sent as a probe (fps_call_probe), and only if that
 *         succeeds is the push committed
 *   WAIT  after the half-close, until the push is resolved: at once, or
 *         later through fps__pp_on_done (the push's done callback, run by
 *         whoever completes the round or lets the ssp wait go)
 *   SEND  the reply streams from the snapshots, one message per batch
 * Per message, the received bytes exist twice more than in staging (gRPC's
 * slices, the flattened and unpacked message), bounded by the message
 * size, not the tensor size. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "wire.h"

enum { PP_RECV, PP_CLOSING, PP_WAIT, PP_SEND, PP_DONE };

typedef struct fps_pp_call_s {
  fps_call_t base;
  int phase;                  /* PP_* (base.mu) */
  fps_push_t *push;           /* the core's side of this call */
  fps_reply_t reply;
} fps_pp_call_t;

static void fps__pp_destroy(fps_call_t *c) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  fps_push_destroy(pp->push);
  fps_reply_free(&pp->reply);
  fps_free(pp);
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
  fps_counters_push_done(&pp->base.srv->shard, false, 0);
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
    fps_counters_push_done(&pp->base.srv->shard, true, (double)(fps_now_ns() - pp->base.start_ns) / 1e9);
  }
  /* A failed final send has released the call already: touch it only
   * after a failed intermediate one. */
  if (fps_call_send(&pp->base, bb, last) < 0 && !last)
    fps_call_fail(&pp->base, GRPC_STATUS_INTERNAL, "PushPull: cannot send the reply");
}

/* The push is resolved: answer. */
static void fps__pp_finish(fps_pp_call_t *pp) {
  char why[FPS_WHY_MAX];
  int rc = fps_push_result(pp->push, why, sizeof why);
  if (rc < 0) {
    fps__pp_fail(pp, fps_status_from_err(rc), "%s", why);
    return;
  }
  size_t n = fps_push_count(pp->push);
  pp->reply.items = fps_calloc(n ? n : 1, sizeof *pp->reply.items);
  if (!pp->reply.items) {
    fps__pp_fail(pp, GRPC_STATUS_RESOURCE_EXHAUSTED, "PushPull: out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    fps_push_out_t o;
    fps_push_take(pp->push, i, &o); /* the snapshot moves: the reply drops it */
    fps_reply_item_t *it = &pp->reply.items[i];
    it->t = o.t;
    it->snap = o.snap;
    it->version = o.version;
    it->dtype = o.dtype;
  }
  pp->reply.n = n;
  pthread_mutex_lock(&pp->base.mu);
  pp->phase = PP_SEND;
  pthread_mutex_unlock(&pp->base.mu);
  fps__pp_send_next(pp);
}

/* The push's done callback: a round completed or failed, an ssp wait
 * ended. Runs on the thread that resolved it, with no core lock held. */
static void fps__pp_on_done(fps_push_t *p, void *arg) {
  (void)p;
  fps__pp_finish(arg);
}

static void fps__pp_on_cancel(fps_call_t *c) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  /* RECV/SEND: the pending batch fails instead; WAIT: the core withdraws
   * the push and resolves it (the done callback answers). */
  fps_push_cancel(pp->push);
}

/* The half-close arrived: everything is received. */
static void fps__pp_commit(fps_pp_call_t *pp) {
  char why[FPS_WHY_MAX];
  pthread_mutex_lock(&pp->base.mu);
  pp->phase = PP_WAIT;
  pthread_mutex_unlock(&pp->base.mu);
  int rc = fps_push_commit(pp->push, why, sizeof why);
  if (rc == FPS_EAGAIN) return; /* fps__pp_on_done answers */
  if (rc < 0) {
    fps__pp_fail(pp, fps_status_from_err(rc), "%s", why);
    return;
  }
  fps__pp_finish(pp);
}

/* Decodes one request message and feeds it to the push: the header, the
 * per-tensor settings, the slices. */
static int fps__pp_message(fps_pp_call_t *pp, const Factorps__V1__PushPullRequest *m, char *why, size_t wl) {
  int rc = fps_push_header(pp->push, m->worker_id, m->step, m->skip_params, m->num_workers, (int)m->expect_mode,
                           why, wl);
  if (rc < 0) return rc;
  if ((rc = fps_push_set_id(pp->push, m->push_id, why, wl)) < 0) return rc;
  /* Settings first: a message may carry a tensor's TensorPush together
   * with its first slice. */
  for (size_t i = 0; i < m->n_tensors; i++) {
    const Factorps__V1__PushPullRequest__TensorPush *tp = m->tensors[i];
    fps_push_tensor_t t = {
        .name = tp->name ? tp->name : "",
        .has_lr = tp->has_lr_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR,
        .lr = tp->lr,
        .has_weight_decay =
            tp->has_weight_decay_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_WEIGHT_DECAY_WEIGHT_DECAY,
        .weight_decay = tp->weight_decay,
        .no_grad = tp->no_grad,
        .has_step = tp->has_step_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_STEP_STEP,
        .step = tp->step,
    };
    if ((rc = fps_push_tensor(pp->push, &t, why, wl)) < 0) return rc;
  }
  for (size_t i = 0; i < m->n_grads; i++) {
    const Factorps__V1__TensorSlice *s = m->grads[i];
    fps_slice_t sl;
    fps_wire_slice_view(s, &sl);
    if ((rc = fps_push_slice(pp->push, s->name ? s->name : "", &sl, why, wl)) < 0) return rc;
    fps_metrics_rpc_bytes(FPS_METRICS_PUSHPULL, s->data.len, 0);
  }
  return 0;
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
  if (phase == PP_CLOSING) {
    fps__pp_commit(pp); /* the probe went through: a real half-close */
    return;
  }
  if (phase != PP_RECV) return;
  if (!c->recv_buf) {
    /* No message: a half-close, or a call that died (cancelled, past its
     * deadline, the worker gone). Only a live call may commit: probe it
     * first (fps_call_probe; a dead call fails the probe, !ok above). */
    pthread_mutex_lock(&c->mu);
    pp->phase = PP_CLOSING;
    pthread_mutex_unlock(&c->mu);
    if (fps_call_probe(c) < 0) fps__pp_fail(pp, GRPC_STATUS_INTERNAL, "PushPull: cannot answer the half-close");
    return;
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  Factorps__V1__PushPullRequest *m = NULL;
  char why[FPS_WHY_MAX];
  int rc = fps_bb_flatten(c->recv_buf, c->srv->cfg.max_message_bytes, &buf, &len);
  if (rc < 0) {
    snprintf(why, sizeof why, "PushPull: cannot take a %zu-byte message: %s",
             grpc_byte_buffer_length(c->recv_buf), fps_bb_flatten_why(rc));
  } else if ((rc = fps_wire_unpack(&factorps__v1__push_pull_request__descriptor, buf, len, (ProtobufCMessage **)&m,
                                   why, sizeof why)) == 0) {
    /* Drop the wire copy before decoding into staging: keeps the peak at
     * one extra message rather than two. */
    fps_free(buf);
    buf = NULL;
    grpc_byte_buffer_destroy(c->recv_buf);
    c->recv_buf = NULL;
    rc = fps__pp_message(pp, m, why, sizeof why);
  } else {
    char w2[FPS_WHY_MAX + 16];
    snprintf(w2, sizeof w2, "PushPull: %s", why);
    snprintf(why, sizeof why, "%.*s", (int)sizeof why - 1, w2);
  }
  if (m) factorps__v1__push_pull_request__free_unpacked(m, &fps_wire_allocator);
  fps_free(buf);
  if (rc < 0) {
    fps__pp_fail(pp, fps_status_from_err(rc), "%s", why);
    return;
  }
  if (fps_call_recv(c) < 0) fps__pp_fail(pp, GRPC_STATUS_INTERNAL, "PushPull: cannot receive");
}

void fps_rpc_pushpull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md) {
  fps_pp_call_t *pp = fps_calloc(1, sizeof *pp);
  if (!pp || fps_push_create(&srv->shard, INT64_MAX, fps__pp_on_done, pp, &pp->push) < 0) {
    fps_free(pp);
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
  fps_push_set_deadline(pp->push, pp->base.deadline_ns);
  if (fps_call_recv(&pp->base) < 0) fps__pp_fail(pp, GRPC_STATUS_INTERNAL, "PushPull: cannot receive");
}

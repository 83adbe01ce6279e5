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
 * A message is decoded where gRPC received it, in its slices (wire.c,
 * common/wire_codec.h): no flat copy, no unpacked copy; the core reads each
 * gradient byte once, checking, converting and summing it in one pass. A
 * compressed message is inflated into one buffer first. The received
 * buffers are refcounted (fps_pp_msg_t): a sync slice that arrives before
 * the workers below it is staged by the core as a reference to them, and
 * the last reference frees them. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "replica.h"
#include "replica_send.h"
#include "wire.h"

enum { PP_RECV, PP_CLOSING, PP_WAIT, PP_SEND, PP_DONE };

/* One received message's buffers (gRPC's byte buffer, or the inflated copy
 * of a compressed one), kept alive while the core stages pieces of it:
 * the handler holds one reference while it decodes the message, each
 * staged piece one more. */
typedef struct fps_pp_msg_s {
  fps_slice_owner_t owner;    /* what the core sees (ctx: this) */
  atomic_int refs;
  grpc_byte_buffer *bb;
  uint8_t *flat;              /* the inflated message, or NULL */
} fps_pp_msg_t;

static void fps__pp_msg_ref(void *ctx) {
  fps_pp_msg_t *m = ctx;
  atomic_fetch_add_explicit(&m->refs, 1, memory_order_relaxed);
}

/* Any thread, maybe under core locks: frees only (grpc_byte_buffer_destroy
 * is thread-safe and calls nothing of ours). */
static void fps__pp_msg_unref(void *ctx) {
  fps_pp_msg_t *m = ctx;
  if (atomic_fetch_sub_explicit(&m->refs, 1, memory_order_acq_rel) != 1) return;
  if (m->bb) grpc_byte_buffer_destroy(m->bb);
  fps_free(m->flat);
  fps_free(m);
}

typedef struct fps_pp_call_s {
  fps_call_t base;
  int phase;                  /* PP_* (base.mu) */
  fps_push_t *push;           /* the core's side of this call */
  fps_reply_t reply;
  fps_wspan_t *spans;         /* the received message's buffers (reused) */
  size_t spans_cap;
  fps_pp_msg_t *msg;          /* the message being decoded, NULL: none */
} fps_pp_call_t;

static void fps__pp_destroy(fps_call_t *c) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  fps_push_destroy(pp->push);
  fps_reply_free(&pp->reply);
  fps_free(pp->spans);
  fps_free(pp);
}

/* Ends the call with an error; counts it once. */
static void fps__pp_fail(fps_pp_call_t *pp, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fps__pp_fail(fps_pp_call_t *pp, int err, const char *fmt, ...) {
  pthread_mutex_lock(&pp->base.mu);
  bool first = pp->phase != PP_DONE;
  pp->phase = PP_DONE;
  pthread_mutex_unlock(&pp->base.mu);
  if (!first) return;
  fps_metrics_push_observe(false, 0);
  va_list ap;
  va_start(ap, fmt);
  fps_call_errorv(&pp->base, err, fmt, ap);
  va_end(ap);
}

static void fps__pp_send_next(fps_pp_call_t *pp) {
  bool last = false;
  grpc_byte_buffer *bb = fps_reply_next(&pp->reply, pp->base.srv, &last);
  if (!bb) {
    fps__pp_fail(pp, FPS_ENOMEM, "PushPull: out of memory packing the reply");
    return;
  }
  if (last) {
    pthread_mutex_lock(&pp->base.mu);
    pp->phase = PP_DONE;
    pthread_mutex_unlock(&pp->base.mu);
    fps_metrics_push_observe(true, (double)(fps_now_ns() - pp->base.start_ns) / 1e9);
  }
  /* A failed final send has released the call already: touch it only
   * after a failed intermediate one. */
  if (fps_call_send(&pp->base, bb, last) < 0 && !last)
    fps_call_error(&pp->base, FPS_EIO, "PushPull: cannot send the reply");
}

/* The standby has what this push's answer depends on (replica.h). */
static void fps__pp_acked(void *arg, int err, const char *why) {
  fps_pp_call_t *pp = arg;
  if (err < 0) {
    fps__pp_fail(pp, err, "PushPull: %s", why ? why : "the standby was lost");
    return;
  }
  pthread_mutex_lock(&pp->base.mu);
  pp->phase = PP_SEND;
  pthread_mutex_unlock(&pp->base.mu);
  fps__pp_send_next(pp);
}

/* The push is resolved: answer. */
static void fps__pp_finish(fps_pp_call_t *pp) {
  char why[FPS_WHY_MAX];
  int rc = fps_push_result(pp->push, why, sizeof why);
  if (rc < 0) {
    fps__pp_fail(pp, rc, "%s", why);
    return;
  }
  size_t n = fps_push_count(pp->push);
  pp->reply.items = fps_calloc(n ? n : 1, sizeof *pp->reply.items);
  if (!pp->reply.items) {
    fps__pp_fail(pp, FPS_ENOMEM, "PushPull: out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    fps_push_out_t o;
    fps_push_take(pp->push, i, &o); /* the snapshot moves: the reply drops it */
    fps_reply_item_t *it = &pp->reply.items[i];
    it->t = o.t;
    it->snap = o.snap;
    it->bf16 = fps_push_take_bf16(pp->push, i); /* made by the update, or NULL: the reply converts */
    it->version = o.version;
    it->dtype = o.dtype;
  }
  pp->reply.n = n;
  /* With a joined standby, the answer waits until the standby holds the
   * tensors' new states and the push's key (replica.h); no thread
   * blocks: fps__pp_acked answers. */
  fps_tensor_t *small[8], **ts = n <= 8 ? small : fps_malloc(n * sizeof *ts);
  uint64_t vsmall[8], *vs = n <= 8 ? vsmall : fps_malloc(n * sizeof *vs);
  int wr = FPS_ENOMEM;
  if (ts && vs) {
    for (size_t i = 0; i < n; i++) {
      ts[i] = pp->reply.items[i].t;
      vs[i] = pp->reply.items[i].version;
    }
    fps_rkey_t key = {.v = vs, .n = (uint32_t)n};
    bool has_key = fps_push_key_info(pp->push, &key.worker, &key.id, &key.tensors);
    wr = fps_replica_ack_wait(pp->base.srv->replica, ts, vs, NULL, n, has_key ? &key : NULL, fps__pp_acked, pp, why,
                              sizeof why);
  }
  if (ts != small) fps_free(ts);
  if (vs != vsmall) fps_free(vs);
  if (wr == FPS_EAGAIN) return;
  if (wr < 0) {
    fps__pp_fail(pp, wr, "PushPull: %s",
                 wr == FPS_ENOMEM ? "out of memory waiting for the standby" : why);
    return;
  }
  fps__pp_acked(pp, 0, NULL);
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
    fps__pp_fail(pp, rc, "%s", why);
    return;
  }
  fps__pp_finish(pp);
}

/* A name field's bytes as a C string (names are short: the stack buffer
 * nearly always does; the wire check refused any NUL in them). */
typedef struct fps_pp_name_s {
  char small[FPS_NAME_MAX * 2];
  char *heap;
  const char *s;
} fps_pp_name_t;

static int fps__pp_name(fps_pp_name_t *n, fps_wreader_t r, uint64_t len) {
  n->heap = NULL;
  char *dst = n->small;
  if (len >= sizeof n->small && !(dst = n->heap = fps_malloc(len + 1))) return FPS_ENOMEM;
  fps_wr_read(&r, dst, len);
  dst[len] = '\0';
  n->s = dst;
  return 0;
}

/* The data of one slice, for the core: whole elements straight from the
 * received buffers (wire_codec.h). */
static uint64_t fps__pp_next_piece(void *ctx, const uint8_t **p) { return fps_welems_next(ctx, p); }

/* One TensorPush (PushPullRequest.TensorPush) to the push. */
static int fps__pp_tensor_push(fps_pp_call_t *pp, fps_wreader_t r, char *why, size_t wl) {
  fps_push_tensor_t t;
  fps_wreader_t name;
  uint64_t name_len;
  if (!fps_wire_tensor_push_parse(r, &t, &name, &name_len)) return FPS_EPROTO;
  fps_pp_name_t n;
  if (fps__pp_name(&n, name, name_len) < 0) {
    snprintf(why, wl, "PushPull: out of memory for a %" PRIu64 "-byte name", name_len);
    return FPS_ENOMEM;
  }
  t.name = n.s;
  int rc = fps_push_tensor(pp->push, &t, why, wl);
  fps_free(n.heap);
  return rc;
}

/* One gradient slice to the push: the core checks, converts and stages
 * its data piece by piece from the received buffers. */
static int fps__pp_grad(fps_pp_call_t *pp, fps_wreader_t r, char *why, size_t wl) {
  fps_wire_tslice_t ts;
  if (!fps_wire_tslice_parse(&r, &ts)) return FPS_EPROTO;
  fps_pp_name_t n;
  if (fps__pp_name(&n, ts.name, ts.name_len) < 0) {
    snprintf(why, wl, "PushPull: out of memory for a %" PRIu64 "-byte name", ts.name_len);
    return FPS_ENOMEM;
  }
  size_t esz = fps_dtype_size(ts.dtype);
  fps_welems_t it;
  /* The core reads the pieces only once the dtype and the length passed
   * its checks, so a bad dtype's element size is never used. */
  fps_welems_init(&it, &ts.data, esz && ts.data_len % esz == 0 ? esz : 1);
  fps_slice_src_t src = {fps__pp_next_piece, &it, it.bounce};
  fps_slice_t sl = {
      .owner = pp->msg ? &pp->msg->owner : NULL,
      .dtype = ts.dtype,
      .shape = ts.shape,
      .n_shape = ts.n_shape < FPS_WIRE_SHAPE_KEEP ? (size_t)ts.n_shape : FPS_WIRE_SHAPE_KEEP,
      .offset = ts.offset,
      .len = (size_t)ts.data_len,
      .src = &src,
  };
  int rc = fps_push_slice(pp->push, n.s, &sl, why, wl);
  fps_free(n.heap);
  if (rc == 0) fps_metrics_rpc_bytes(FPS_METRICS_PUSHPULL, ts.data_len, 0);
  return rc;
}

/* Decodes one request message straight from its buffers (msg) and feeds
 * it to the push: first the checks protobuf-c's unpack made (names,
 * structure), then the header, the per-tensor settings, the slices, in the
 * order an unpacked message was handled. */
static int fps__pp_message(fps_pp_call_t *pp, const fps_wreader_t *msg, char *why, size_t wl) {
  bool repeats;
  int rc = fps_wire_check(&factorps__v1__push_pull_request__descriptor, msg, &repeats, why, wl);
  if (rc < 0) {
    char w2[FPS_WHY_MAX + 16];
    snprintf(w2, sizeof w2, "PushPull: %s", why);
    snprintf(why, wl, "%.*s", (int)wl - 1, w2);
    return rc;
  }
  fps_wire_pp_header_t h;
  if (!fps_wire_pp_header(msg, &h)) return FPS_EPROTO;
  fps_wreader_t r;
  rc = fps_push_header(pp->push, h.worker_id, h.step, h.skip_params, h.num_workers, (int)h.expect_mode, why, wl);
  if (rc < 0) return rc;
  if ((rc = fps_push_set_id(pp->push, h.push_id, why, wl)) < 0) return rc;
  /* Settings first: a message may carry a tensor's TensorPush together
   * with its first slice. Then the slices. */
  for (int pass = 0; pass < 2; pass++) {
    uint32_t want = pass == 0 ? 5 : 3;
    r = *msg;
    while (fps_wr_left(&r) > 0) {
      uint32_t field;
      int wt;
      if (!fps_wr_key(&r, &field, &wt)) return FPS_EPROTO;
      if (field != want || wt != FPS_WT_LEN) {
        if (!fps_wr_skip_value(&r, wt)) return FPS_EPROTO;
        continue;
      }
      fps_wreader_t sub;
      uint64_t len;
      if (!fps_wr_sub(&r, &sub, &len)) return FPS_EPROTO;
      rc = pass == 0 ? fps__pp_tensor_push(pp, sub, why, wl) : fps__pp_grad(pp, sub, why, wl);
      if (rc < 0) return rc;
    }
  }
  return 0;
}

static void fps__pp_on_batch(fps_call_t *c, bool ok) {
  fps_pp_call_t *pp = (fps_pp_call_t *)c;
  pthread_mutex_lock(&c->mu);
  int phase = pp->phase;
  pthread_mutex_unlock(&c->mu);
  if (!ok) {
    fps__pp_fail(pp, FPS_ECANCELLED, "PushPull: the call ended early");
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
    if (fps_call_probe(c) < 0) fps__pp_fail(pp, FPS_EIO, "PushPull: cannot answer the half-close");
    return;
  }
  uint8_t *flat = NULL;
  size_t len = 0, nspan = 0;
  char why[FPS_WHY_MAX] = "";
  int rc = 0;
  grpc_byte_buffer *bb = c->recv_buf;
  c->recv_buf = NULL; /* the holder below (or this function) frees it */
  size_t total = grpc_byte_buffer_length(bb);
  if (bb->data.raw.compression != GRPC_COMPRESS_NONE) {
    /* A compressed message is inflated (bounded) into one buffer. */
    if ((rc = fps_bb_flatten(bb, c->srv->cfg.max_message_bytes, &flat, &len)) == 0) {
      fps_wspan_t one = {flat, len};
      if (!pp->spans && !(pp->spans = fps_malloc(sizeof *pp->spans))) rc = FPS_ENOMEM;
      else if (pp->spans_cap == 0) pp->spans_cap = 1;
      if (rc == 0) {
        pp->spans[0] = one;
        nspan = 1;
      }
    }
  } else if (total > c->srv->cfg.max_message_bytes) {
    rc = FPS_ELIMIT;
  } else if ((nspan = fps_wire_bb_spans(bb, &pp->spans, &pp->spans_cap)) == SIZE_MAX) {
    rc = FPS_ENOMEM;
  }
  if (rc < 0) {
    snprintf(why, sizeof why, "PushPull: cannot take a %zu-byte message: %s", total, fps_bb_flatten_why(rc));
    fps_free(flat);
    grpc_byte_buffer_destroy(bb);
  } else {
    /* Without a holder (out of memory) the core copies what it stages. */
    fps_pp_msg_t *m = fps_malloc(sizeof *m);
    if (flat) {
      grpc_byte_buffer_destroy(bb); /* inflated: only flat is read */
      bb = NULL;
    }
    if (m) {
      m->owner.ref = fps__pp_msg_ref;
      m->owner.unref = fps__pp_msg_unref;
      m->owner.ctx = m;
      /* What staging a piece of it keeps: the bytes received (inflated). */
      m->owner.bytes = flat ? len : total;
      atomic_init(&m->owner.staged, 0);
      atomic_init(&m->refs, 1);
      m->bb = bb;
      m->flat = flat;
    }
    pp->msg = m;
    fps_wreader_t msg;
    fps_wr_init(&msg, pp->spans, nspan);
    rc = fps__pp_message(pp, &msg, why, sizeof why);
    if (rc == FPS_EPROTO && why[0] == '\0')
      snprintf(why, sizeof why, "PushPull: malformed PushPullRequest (%zu bytes)", total);
    pp->msg = NULL;
    /* The handler's reference: the buffers stay while staged pieces
     * reference them, otherwise they go before the next message. */
    if (m) {
      fps__pp_msg_unref(m);
    } else {
      fps_free(flat);
      if (bb) grpc_byte_buffer_destroy(bb);
    }
  }
  if (rc < 0) {
    fps__pp_fail(pp, rc, "%s", why);
    return;
  }
  /* Sync backpressure: while this call has slices staged ahead of a lower
   * worker that is still streaming, the next message waits in gRPC's flow
   * control rather than in the shard's memory (fps_push_hold). */
  if (fps_push_hold(pp->push)) return; /* fps__pp_on_resume receives */
  if (fps_call_recv(c) < 0) fps__pp_fail(pp, FPS_EIO, "PushPull: cannot receive");
}

/* The core let a held push go on (any thread, maybe under core locks):
 * only post the next receive. */
static void fps__pp_on_resume(fps_push_t *p, void *arg) {
  (void)p;
  fps_pp_call_t *pp = arg;
  if (fps_call_recv(&pp->base) < 0) fps__pp_fail(pp, FPS_EIO, "PushPull: cannot receive");
}

void fps_rpc_pushpull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md) {
  fps_pp_call_t *pp = fps_calloc(1, sizeof *pp);
  if (!pp || fps_push_create(srv->shard, INT64_MAX, fps__pp_on_done, pp, &pp->push) < 0) {
    fps_free(pp);
    grpc_call_cancel_with_status(call, fps_status_from_err(FPS_ENOMEM), "out of memory", NULL);
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
  fps_push_set_resume(pp->push, fps__pp_on_resume, pp);
  if (fps_call_recv(&pp->base) < 0) fps__pp_fail(pp, FPS_EIO, "PushPull: cannot receive");
}

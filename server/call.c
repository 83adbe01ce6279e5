/* The call object every method shares and its life cycle (the transport's
 * half that the handlers use): begin, receive, send, fail, the reference
 * counts that end a call exactly once, request unpacking and reply
 * packing, and the list of live calls the timer and shutdown walk.
 *
 * Each call has at most one batch of its own in flight (plus the
 * RECV_CLOSE_ON_SERVER op posted at the start), so the order of its
 * messages is fixed by the code and start_batch never races with itself;
 * call->mu still guards start_batch because a parked call can be resumed
 * from the timer thread or another call's poller.
 *
 * It sits below the handlers (rpc_*.c use it) and below grpc_server.c
 * (which accepts calls and starts the handlers), so the arrows between
 * the layers point one way. */
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "alloc.h"
#include "metrics.h"
#include "name.h"
#include "server.h"
#include "tsan.h"
#include "wire.h"

/* A gRPC deadline on the shard's clock (clock.h); INT64_MAX for "none".
 * gRPC's monotonic clock has its own origin, so only the time left is
 * carried over. */
static int64_t fps__deadline_ns(gpr_timespec d, int64_t now_ns) {
  if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return INT64_MAX;
  gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(d, GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC));
  left.clock_type = GPR_TIMESPAN;
  if (left.tv_sec < 0) return now_ns;
  if (left.tv_sec > INT64_MAX / 1000000000 / 2) return INT64_MAX;
  return now_ns + left.tv_sec * INT64_C(1000000000) + left.tv_nsec;
}

/* ------------------------------------------------------------ call base */

/* Counts the finished call once (REQUIRES c->mu): method, status, time. */
static void fps__call_meter_locked(fps_call_t *c, grpc_status_code code) {
  if (c->metered) return;
  c->metered = true;
  int m = fps_metrics_method_from_name(c->method);
  if (m >= 0)
    fps_metrics_rpc_observe((fps_metrics_method_t)m, (int)code,
                            (double)(fps_now_ns() - c->start_ns) / 1e9, 0, 0);
}

/* grpc_call_start_batch with the hand-off of `tag` to the thread that will
 * take it from the queue (tsan.h). The arguments are read before the
 * release, so nothing of the call is touched after it. Once the server
 * closed its queue (shutdown) it refuses, as gRPC would for a finished
 * call: the callers already release what a batch would have. */
static grpc_call_error fps__start_batch(fps_server_t *srv, grpc_call *call, const grpc_op *ops, size_t n,
                                        void *tag) {
  grpc_call_error e = GRPC_CALL_ERROR_ALREADY_FINISHED;
  pthread_rwlock_rdlock(&srv->batch_gate);
  if (!srv->batches_closed) {
    FPS_TSAN_RELEASE(tag);
    e = grpc_call_start_batch(call, ops, n, tag, NULL);
  }
  pthread_rwlock_unlock(&srv->batch_gate);
  return e;
}

static void fps__call_unref(fps_call_t *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1) return;
  fps_calls_unlink(c->srv, c);
  grpc_metadata_array_destroy(&c->md);
  if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
  grpc_slice_unref(c->status_details);
  grpc_call_unref(c->call);
  pthread_mutex_destroy(&c->mu);
  c->destroy(c);
}

static void fps__call_on_close(fps_tag_t *tag, bool ok) {
  fps_call_t *c = (fps_call_t *)((char *)tag - offsetof(fps_call_t, close_tag));
  pthread_mutex_lock(&c->mu);
  c->closed = true;
  bool cancelled = c->cancelled != 0;
  /* A call cancelled before its status (client gone, deadline) counts too. */
  if (cancelled && !c->status_sent)
    fps__call_meter_locked(c, fps_status_from_err(c->cancel_requested ? FPS_ETIMEOUT : FPS_ECANCELLED));
  pthread_mutex_unlock(&c->mu);
  if (cancelled && c->on_cancel) c->on_cancel(c);
  fps__call_unref(c);
}

static void fps__call_on_status(fps_tag_t *tag, bool ok) {
  fps_call_t *c = (fps_call_t *)((char *)tag - offsetof(fps_call_t, status_tag));
  /* The status went out (or the call died): the logic reference goes. */
  fps__call_unref(c);
}

static void fps__call_on_batch(fps_tag_t *tag, bool ok) {
  fps_call_t *c = (fps_call_t *)((char *)tag - offsetof(fps_call_t, batch_tag));
  pthread_mutex_lock(&c->mu);
  bool ended = c->status_sent;
  pthread_mutex_unlock(&c->mu);
  /* A receive that completes after the call was already answered (an error
   * status raced it) has nothing left to drive. */
  if (ended) return;
  c->on_batch(c, ok);
}

int fps_call_begin(fps_call_t *c, fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                   grpc_metadata_array *md, const char *method) {
  c->batch_tag.fn = fps__call_on_batch;
  c->close_tag.fn = fps__call_on_close;
  c->status_tag.fn = fps__call_on_status;
  c->srv = srv;
  c->call = call;
  c->method = method;
  c->md = *md;
  memset(md, 0, sizeof *md);
  c->status_details = grpc_empty_slice();
  pthread_mutex_init(&c->mu, NULL);
  atomic_init(&c->refs, 2); /* logic + close */
  c->start_ns = fps_now_ns();
  int64_t client = fps__deadline_ns(deadline, c->start_ns);
  int64_t ours = fps_clock_after(c->start_ns, srv->cfg.deadline);
  c->deadline_ns = client < ours ? client : ours;
  fps_calls_link(srv, c);

  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  pthread_mutex_lock(&c->mu);
  grpc_call_error e = fps__start_batch(srv, call, &op, 1, &c->close_tag);
  pthread_mutex_unlock(&c->mu);
  if (e != GRPC_CALL_OK) {
    FPS_LOG(FPS_LOG_ERROR, "%s: RECV_CLOSE_ON_SERVER failed: %d", method, (int)e);
    atomic_store(&c->refs, 1);
    grpc_call_cancel(call, NULL);
    fps__call_unref(c);
    return FPS_EPROTO;
  }
  return 0;
}

void *fps_call_start_unary(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                           grpc_metadata_array *md, grpc_byte_buffer *payload, size_t size,
                           void (*destroy)(fps_call_t *), void (*on_batch)(fps_call_t *, bool),
                           const char *method, const ProtobufCMessageDescriptor *desc,
                           fps_call_t **out, uint64_t *held) {
  *out = NULL;
  *held = 0;
  fps_call_t *c = fps_calloc(1, size);
  if (!c) {
    grpc_call_cancel_with_status(call, fps_status_from_err(FPS_ENOMEM), "out of memory", NULL);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(md);
    if (payload) grpc_byte_buffer_destroy(payload);
    return NULL;
  }
  c->destroy = destroy;
  c->on_batch = on_batch;
  if (fps_call_begin(c, srv, call, deadline, md, method) < 0) {
    if (payload) grpc_byte_buffer_destroy(payload);
    return NULL;
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc;
  ProtobufCMessage *req = NULL;
  if (!payload) {
    fps_call_error(c, FPS_EINVAL, "%s: the request message is missing", method);
  } else if ((rc = fps_bb_flatten(payload, srv->cfg.max_message_bytes, &buf, &len)) < 0) {
    fps_call_error(c, rc, "%s: cannot take a %zu-byte request: %s", method, grpc_byte_buffer_length(payload),
                   fps_bb_flatten_why(rc));
  } else {
    char why[FPS_WHY_MAX];
    rc = fps_wire_unpack_held(desc, buf, len, srv->cfg.max_bytes, &srv->decode, held, &req, why, sizeof why);
    if (rc < 0) fps_call_error(c, rc, "%s: %s", method, why);
  }
  /* protobuf-c copies bytes fields: the flat buffer is not needed after. */
  fps_free(buf);
  if (payload) grpc_byte_buffer_destroy(payload);
  if (req) *out = c;
  return req;
}

int fps_call_recv(fps_call_t *c) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &c->recv_buf;
  pthread_mutex_lock(&c->mu);
  if (c->recv_buf) {
    grpc_byte_buffer_destroy(c->recv_buf);
    c->recv_buf = NULL;
  }
  grpc_call_error e = fps__start_batch(c->srv, c->call, &op, 1, &c->batch_tag);
  pthread_mutex_unlock(&c->mu);
  return e == GRPC_CALL_OK ? 0 : FPS_EPROTO;
}

int fps_call_probe(fps_call_t *c) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_INITIAL_METADATA;
  pthread_mutex_lock(&c->mu);
  if (c->initial_md_sent || c->status_sent) {
    pthread_mutex_unlock(&c->mu);
    return FPS_ESTATE;
  }
  c->initial_md_sent = true;
  grpc_call_error e = fps__start_batch(c->srv, c->call, &op, 1, &c->batch_tag);
  pthread_mutex_unlock(&c->mu);
  return e == GRPC_CALL_OK ? 0 : FPS_EPROTO;
}

int fps_call_send(fps_call_t *c, grpc_byte_buffer *msg, bool final) {
  grpc_op ops[3];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  pthread_mutex_lock(&c->mu);
  if (c->status_sent) {
    pthread_mutex_unlock(&c->mu);
    grpc_byte_buffer_destroy(msg);
    return FPS_ESTATE;
  }
  if (!c->initial_md_sent) {
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    c->initial_md_sent = true;
  }
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n++].data.send_message.send_message = msg;
  if (final) {
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n++].data.send_status_from_server.status = fps_status_from_err(FPS_OK);
    c->status_sent = true;
    fps__call_meter_locked(c, fps_status_from_err(FPS_OK));
  }
  /* A final send's status completion may drop the last reference on
   * another poller before we unlock: hold one of our own until we are done
   * with c. */
  atomic_fetch_add(&c->refs, 1);
  grpc_call_error e = fps__start_batch(c->srv, c->call, ops, n, final ? &c->status_tag : &c->batch_tag);
  pthread_mutex_unlock(&c->mu);
  if (e != GRPC_CALL_OK && final) fps__call_unref(c);
  /* The send op holds its own reference to the message's slices. */
  grpc_byte_buffer_destroy(msg);
  if (e != GRPC_CALL_OK) FPS_LOG(FPS_LOG_ERROR, "%s: start_batch(send) failed: %d", c->method, (int)e);
  fps__call_unref(c);
  return e == GRPC_CALL_OK ? 0 : FPS_EPROTO;
}

/* Ends the call with `code` (status.c's translation of an FPS_E* code)
 * and the message. */
static void fps__call_end(fps_call_t *c, grpc_status_code code, const char *fmt, va_list ap) {
  char msg[2048];
  vsnprintf(msg, sizeof msg, fmt, ap);
  /* Status messages are UTF-8 on the wire: a name or a truncation must
   * never leave half a character (common/name.h). */
  fps_utf8_fix(msg);
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  pthread_mutex_lock(&c->mu);
  if (c->status_sent) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  FPS_LOG(FPS_LOG_DEBUG, "%s: status %d: %s", c->method, (int)code, msg);
  if (!c->initial_md_sent) {
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    c->initial_md_sent = true;
  }
  grpc_slice_unref(c->status_details);
  c->status_details = grpc_slice_from_copied_string(msg);
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = code;
  ops[n++].data.send_status_from_server.status_details = &c->status_details;
  c->status_sent = true;
  fps__call_meter_locked(c, code);
  /* The status completion may drop the last reference on another poller
   * before we unlock: hold one of our own until we are done with c. */
  atomic_fetch_add(&c->refs, 1);
  grpc_call_error e = fps__start_batch(c->srv, c->call, ops, n, &c->status_tag);
  pthread_mutex_unlock(&c->mu);
  if (e != GRPC_CALL_OK) {
    /* No completion will come: release the logic reference here. */
    FPS_LOG(FPS_LOG_ERROR, "%s: start_batch(status) failed: %d", c->method, (int)e);
    fps__call_unref(c);
  }
  fps__call_unref(c);
}

void fps_call_errorv(fps_call_t *c, int err, const char *fmt, va_list ap) {
  FPS_ASSERT(err < 0);
  fps__call_end(c, fps_status_from_err(err), fmt, ap);
}

void fps_call_error(fps_call_t *c, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fps_call_errorv(c, err, fmt, ap);
  va_end(ap);
}

/* Frees the packed bytes when gRPC drops the slice. */
static void fps__free_packed(void *p, size_t len) {
  FPS_TSAN_ACQUIRE(p); /* gRPC may drop the slice on any thread */
  (void)len;
  fps_free(p);
}

grpc_byte_buffer *fps_pack_message(const void *m) {
  const ProtobufCMessage *pm = m;
  size_t len = protobuf_c_message_get_packed_size(pm);
  uint8_t *buf = fps_malloc(len ? len : 1);
  if (!buf) return NULL;
  protobuf_c_message_pack(pm, buf);
  /* The slice takes ownership of buf: the packed bytes go to the transport
   * without another copy. */
  FPS_TSAN_RELEASE(buf);
  grpc_slice s = grpc_slice_new_with_len(buf, len, fps__free_packed);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

grpc_byte_buffer *fps_pack_message_into(const void *m, uint8_t *buf, size_t cap) {
  const ProtobufCMessage *pm = m;
  size_t len = protobuf_c_message_get_packed_size(pm);
  if (len > cap) return NULL;
  protobuf_c_message_pack(pm, buf);
  FPS_TSAN_RELEASE(buf);
  grpc_slice s = grpc_slice_new_with_len(buf, len, fps__free_packed);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

/* Inflates a gzip or deflate (zlib) message into at most `limit` bytes,
 * one slice at a time, stopping the moment the output would pass the
 * limit: a small bomb never costs more than the limit. */
static int fps__bb_inflate(const grpc_slice_buffer *sb, int gzip, uint64_t limit, uint8_t **out, size_t *len) {
  z_stream z;
  memset(&z, 0, sizeof z);
  if (inflateInit2(&z, gzip ? 15 + 16 : 15) != Z_OK) return FPS_ENOMEM;
  size_t cap = 0, n = 0;
  uint8_t *p = NULL;
  int rc = 0, zr = Z_OK;
  for (size_t i = 0; i < sb->count && zr != Z_STREAM_END && rc == 0; i++) {
    z.next_in = (Bytef *)GRPC_SLICE_START_PTR(sb->slices[i]);
    z.avail_in = (uInt)GRPC_SLICE_LENGTH(sb->slices[i]);
    while (z.avail_in > 0 && zr != Z_STREAM_END) {
      if (n == cap) {
        if (cap >= limit) {
          rc = FPS_ELIMIT; /* more output is coming: past the limit */
          break;
        }
        size_t ncap = cap ? cap * 2 : 64 * 1024;
        if (ncap > limit) ncap = (size_t)limit;
        uint8_t *np = fps_realloc(p, ncap ? ncap : 1);
        if (!np) {
          rc = FPS_ENOMEM;
          break;
        }
        p = np;
        cap = ncap;
      }
      z.next_out = p + n;
      z.avail_out = (uInt)(cap - n);
      zr = inflate(&z, Z_NO_FLUSH);
      n = cap - z.avail_out;
      if (zr != Z_OK && zr != Z_STREAM_END && !(zr == Z_BUF_ERROR && z.avail_out == 0)) {
        rc = zr == Z_MEM_ERROR ? FPS_ENOMEM : FPS_EFORMAT;
        break;
      }
    }
  }
  /* An output buffer exactly full may still hide more data. */
  if (rc == 0 && zr != Z_STREAM_END) {
    if (n == cap && cap >= limit) {
      uint8_t probe;
      z.next_out = &probe;
      z.avail_out = 1;
      zr = inflate(&z, Z_NO_FLUSH);
      rc = z.avail_out == 0 ? FPS_ELIMIT : zr == Z_STREAM_END ? 0 : FPS_EFORMAT;
    } else {
      rc = FPS_EFORMAT; /* truncated stream */
    }
  }
  inflateEnd(&z);
  if (rc < 0) {
    fps_free(p);
    return rc;
  }
  *out = p ? p : fps_malloc(1);
  *len = n;
  return *out ? 0 : FPS_ENOMEM;
}

int fps_bb_flatten(grpc_byte_buffer *bb, uint64_t limit, uint8_t **out, size_t *len) {
  *out = NULL;
  *len = 0;
  /* The core hands compressed messages over as they came
   * (GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION is off), and
   * grpc_byte_buffer_reader_init() would inflate them whole, unbounded:
   * read the raw slices and inflate here, bounded. */
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression != GRPC_COMPRESS_NONE) {
    grpc_compression_algorithm alg = bb->data.raw.compression;
    if (alg != GRPC_COMPRESS_GZIP && alg != GRPC_COMPRESS_DEFLATE) return FPS_EUNSUPPORTED;
    return fps__bb_inflate(&bb->data.raw.slice_buffer, alg == GRPC_COMPRESS_GZIP, limit, out, len);
  }
  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, bb)) return FPS_EPROTO;
  size_t total = grpc_byte_buffer_length(bb);
  if (total > limit) {
    grpc_byte_buffer_reader_destroy(&rd);
    return FPS_ELIMIT;
  }
  uint8_t *p = fps_malloc(total ? total : 1);
  if (!p) {
    grpc_byte_buffer_reader_destroy(&rd);
    return FPS_ENOMEM;
  }
  size_t off = 0;
  grpc_slice s;
  while (grpc_byte_buffer_reader_next(&rd, &s)) {
    size_t n = GRPC_SLICE_LENGTH(s);
    if (off + n <= total) memcpy(p + off, GRPC_SLICE_START_PTR(s), n);
    off += n;
    grpc_slice_unref(s);
  }
  grpc_byte_buffer_reader_destroy(&rd);
  if (off != total) {
    fps_free(p);
    return FPS_EPROTO;
  }
  *out = p;
  *len = total;
  return 0;
}

const char *fps_bb_flatten_why(int rc) {
  switch (rc) {
    case FPS_ELIMIT: return "it inflates to more than --max-message-bytes";
    case FPS_EFORMAT: return "its compressed data is corrupt";
    case FPS_EUNSUPPORTED: return "it uses a compression the shard does not accept (gzip, deflate)";
    case FPS_ENOMEM: return "out of memory";
    default: return "it cannot be read";
  }
}

/* ---------------------------------------------------------- call list */

void fps_calls_link(fps_server_t *srv, fps_call_t *c) {
  pthread_mutex_lock(&srv->calls_mu);
  c->prev = NULL;
  c->next = srv->calls;
  if (srv->calls) srv->calls->prev = c;
  srv->calls = c;
  srv->ncalls++;
  pthread_mutex_unlock(&srv->calls_mu);
}

void fps_calls_unlink(fps_server_t *srv, fps_call_t *c) {
  pthread_mutex_lock(&srv->calls_mu);
  if (c->prev) c->prev->next = c->next;
  else srv->calls = c->next;
  if (c->next) c->next->prev = c->prev;
  srv->ncalls--;
  pthread_mutex_unlock(&srv->calls_mu);
}

void fps_calls_expire(void *arg, int64_t now_ns) {
  fps_server_t *srv = arg;
  pthread_mutex_lock(&srv->calls_mu);
  for (fps_call_t *c = srv->calls; c; c = c->next) {
    if (c->cancel_requested || c->deadline_ns > now_ns) continue;
    c->cancel_requested = true;
    char msg[256];
    snprintf(msg, sizeof msg, "%s: call exceeded its deadline (%.3f s after it started)", c->method,
             (double)(now_ns - c->start_ns) / 1e9);
    /* Thread-safe in gRPC and harmless if the call already ended. */
    grpc_call_cancel_with_status(c->call, fps_status_from_err(FPS_ETIMEOUT), msg, NULL);
  }
  pthread_mutex_unlock(&srv->calls_mu);
}


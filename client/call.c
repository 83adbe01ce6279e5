/* The call engine: runs one streaming call per shard, all shards in
 * parallel, on one completion queue driven by the calling thread.
 *
 * Per stream and attempt:
 *   gate   wait (connectivity watch) until the shard's channel is READY. A
 *          channel in TRANSIENT_FAILURE (now or during the wait) fails the
 *          attempt as UNAVAILABLE before any call exists, which is why even
 *          PushPull may be retried then: nothing can have been sent.
 *   call   one batch waits for the status; one send is in flight at a time
 *          (gRPC allows no more per call) while the producer already packs
 *          the next message, so packing overlaps the transport's writes and
 *          at most two packed messages exist per stream; one receive is in
 *          flight at a time, and each reply is handed to the consumer as it
 *          arrives, so replies are decoded while other shards still send.
 * A stream with `after` set (a push cut into several calls to one shard)
 * is held before its gate until that stream has handed its last message
 * to gRPC (or ended): the calls to a shard then upload one after the
 * other, with at most one message of overlap, so the first call's request
 * is whole (and can be applied and answered) while the next ones still
 * upload. Holding waits for a send, never for a reply.
 * Every call carries the one deadline of the whole operation (retries
 * included), so the engine ends within it; the queue wait has a slack on
 * top after which every call is cancelled, which gRPC answers promptly.
 * A shard with standby replicas ("a:p|b:p"): each attempt goes to one
 * replica, the one that answered the shard's last call first; an attempt
 * that failed UNAVAILABLE (a standby's refusal, a dead process) is retried
 * on the next replica at once, and only a full round over the replicas
 * waits for the backoff. Each stream is retried on its own, while the
 * other shards' streams still run (engine_failover): a split tensor's
 * block shards hold their calls until every block steps. */
#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "internal.h"

enum { TAG_GATE, TAG_SEND, TAG_RECV, TAG_STATUS, TAG_COUNT };

typedef struct fps__stream_engine_s engine_t;

typedef struct tag_s {
  engine_t *e;
  int kind;
} tag_t;

struct fps__stream_engine_s {
  fps__stream_t *s;
  fps_client_t *c;
  const char *method;
  gpr_timespec deadline;
  grpc_completion_queue *cq;
  tag_t tags[TAG_COUNT];
  grpc_call *call;                   /* NULL until the gate opened */
  int pending[TAG_COUNT];            /* batches/watches in flight */
  int status_done;
  int finished;                      /* outcome recorded, resources freed */
  int counted;                       /* its finish was counted by the attempt */
  int held;                          /* not started: waits for s->after to send */
  int started;                       /* its gate has begun */
  engine_t *succ;                    /* the engine held until this one sent all */
  int retryable;                     /* this attempt may be repeated */
  int delayed;                       /* its gate waits for a backoff (gate_after) */
  int *refused;                      /* the attempt's: a stream failed for good */
  int local_code;                    /* local failure, beats the status */
  int sending_done;                  /* close sent, or sending abandoned */
  grpc_byte_buffer *send_bb;         /* message in flight */
  grpc_byte_buffer *next;            /* built ahead of time */
  int have_next, next_last;
  grpc_byte_buffer *recv_bb;
  uint8_t *flat;                     /* reused gather buffer for replies */
  size_t flat_cap;
  fps_wspan_t *spans;                /* reused: a reply's slices, for on_spans */
  size_t spans_cap;
  grpc_metadata_array init_md, trail_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  grpc_metadata auth_md;
};

int fps__stream_fail(fps__stream_t *s, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->msg, sizeof s->msg, fmt, ap);
  va_end(ap);
  s->code = code;
  if (s->e) s->e->local_code = code;
  return code;
}

grpc_byte_buffer *fps__pack(const void *msg) {
  const ProtobufCMessage *m = msg;
  size_t n = protobuf_c_message_get_packed_size(m);
  grpc_slice sl = grpc_slice_malloc(n);
  protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(sl));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  return bb;
}

static void *fps__pb_alloc(void *unused, size_t size) {
  (void)unused;
  return fps_malloc(size);
}

static void fps__pb_free(void *unused, void *p) {
  (void)unused;
  fps_free(p);
}

ProtobufCAllocator fps__pb_allocator = {fps__pb_alloc, fps__pb_free, NULL};

void *fps__unpack(const void *descriptor, const uint8_t *data, size_t len, int *code) {
  errno = 0;
  void *m = protobuf_c_message_unpack(descriptor, &fps__pb_allocator, len, data);
  /* protobuf-c says only "no message": an allocation that failed left
   * ENOMEM behind (fps_malloc sets it), a malformed reply does not. */
  if (!m) *code = fps__code_from_err(errno == ENOMEM ? FPS_ENOMEM : FPS_EPROTO);
  return m;
}

const char *fps__unpack_why(int code) {
  return code == FPS_CODE_RESOURCE_EXHAUSTED ? "out of memory decoding" : "malformed";
}

static void engine_cancel(engine_t *e, int code, const char *why) {
  if (e->call) grpc_call_cancel_with_status(e->call, (grpc_status_code)code, why, NULL);
}

/* Packs the next message ahead, unless the producer is done. */
static void produce(engine_t *e) {
  if (e->have_next || e->next_last || e->local_code) return;
  int last = 0;
  grpc_byte_buffer *bb = NULL;
  if (e->s->ops->next(e->s, &bb, &last)) {
    engine_cancel(e, GRPC_STATUS_CANCELLED, "client failed to build a request");
    return;
  }
  e->next = bb;
  e->have_next = 1;
  e->next_last = last;
}

/* Starts sending the packed-ahead message (with the initial metadata if
 * `first`). */
static void send_next(engine_t *e, int first) {
  grpc_op ops[3];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (!e->have_next) {
    e->sending_done = 1;
    return;
  }
  if (first) {
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].data.send_initial_metadata.count = e->c->auth_header ? 1 : 0;
    ops[n].data.send_initial_metadata.metadata = e->c->auth_header ? &e->auth_md : NULL;
    n++;
  }
  e->send_bb = e->next;
  e->next = NULL;
  e->have_next = 0;
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n].data.send_message.send_message = e->send_bb;
  n++;
  if (e->next_last) {
    ops[n].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    n++;
    e->sending_done = 1;
  }
  if (grpc_call_start_batch(e->call, ops, n, &e->tags[TAG_SEND], NULL) != GRPC_CALL_OK) {
    grpc_byte_buffer_destroy(e->send_bb);
    e->send_bb = NULL;
    e->sending_done = 1;
    fps__stream_fail(e->s, FPS_CODE_INTERNAL, "gRPC refused a send batch");
    engine_cancel(e, GRPC_STATUS_INTERNAL, "client send batch refused");
    return;
  }
  e->pending[TAG_SEND] = 1;
}

static void recv_next(engine_t *e, int first) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (first) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n].data.recv_initial_metadata.recv_initial_metadata = &e->init_md;
    n++;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n].data.recv_message.recv_message = &e->recv_bb;
  n++;
  if (grpc_call_start_batch(e->call, ops, n, &e->tags[TAG_RECV], NULL) != GRPC_CALL_OK) {
    fps__stream_fail(e->s, FPS_CODE_INTERNAL, "gRPC refused a receive batch");
    engine_cancel(e, GRPC_STATUS_INTERNAL, "client receive batch refused");
    return;
  }
  e->pending[TAG_RECV] = 1;
}

/* The replica this attempt of the stream goes to. */
static fps__replica_t *replica_of(const engine_t *e) {
  return &e->c->shards[e->s->shard].r[e->s->replica];
}

static void call_start(engine_t *e) {
  fps_client_t *c = e->c;
  grpc_slice method = grpc_slice_from_static_string(e->method);
  pthread_mutex_lock(&c->chan_mu);
  e->call = grpc_channel_create_call(replica_of(e)->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                     e->cq, method, NULL, e->deadline, NULL);
  pthread_mutex_unlock(&c->chan_mu);
  if (!e->call) {
    fps__stream_fail(e->s, FPS_CODE_INTERNAL, "gRPC could not create a call");
    return;
  }
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op.data.recv_status_on_client.trailing_metadata = &e->trail_md;
  op.data.recv_status_on_client.status = &e->status;
  op.data.recv_status_on_client.status_details = &e->details;
  op.data.recv_status_on_client.error_string = &e->error_string;
  if (grpc_call_start_batch(e->call, &op, 1, &e->tags[TAG_STATUS], NULL) != GRPC_CALL_OK) {
    fps__stream_fail(e->s, FPS_CODE_INTERNAL, "gRPC refused the status batch");
    grpc_call_cancel(e->call, NULL);
    grpc_call_unref(e->call);
    e->call = NULL;
    return;
  }
  e->pending[TAG_STATUS] = 1;
  produce(e);
  if (e->local_code) return; /* cancelled: the status batch reports it */
  send_next(e, 1);
  recv_next(e, 1);
  produce(e); /* pipelining: pack message 2 while message 1 goes out */
}

/* The gate of an attempt that must wait for a backoff first: a watch of
 * the replica's channel that ends at `until` (or earlier, at a change of
 * state), after which gate_event begins the gate. */
static void gate_after(engine_t *e, gpr_timespec until) {
  pthread_mutex_lock(&e->c->chan_mu);
  grpc_connectivity_state st = fps__channel_state_locked(e->c, e->s->shard, e->s->replica);
  grpc_channel_watch_connectivity_state(replica_of(e)->channel, st, until, e->cq, &e->tags[TAG_GATE]);
  pthread_mutex_unlock(&e->c->chan_mu);
  e->pending[TAG_GATE] = 1;
  e->delayed = 1;
}

static void gate_watch(engine_t *e, grpc_connectivity_state st) {
  pthread_mutex_lock(&e->c->chan_mu);
  grpc_channel_watch_connectivity_state(replica_of(e)->channel, st, e->deadline, e->cq,
                                        &e->tags[TAG_GATE]);
  pthread_mutex_unlock(&e->c->chan_mu);
  e->pending[TAG_GATE] = 1;
}

static grpc_connectivity_state gate_state(engine_t *e) {
  pthread_mutex_lock(&e->c->chan_mu);
  grpc_connectivity_state st = fps__channel_state_locked(e->c, e->s->shard, e->s->replica);
  pthread_mutex_unlock(&e->c->chan_mu);
  return st;
}

static void gate_fail_unavailable(engine_t *e) {
  /* gRPC does not say why a channel failed; a TLS mismatch looks like a
   * dead shard from here, so the message names the likely suspects. */
  fps__stream_fail(e->s, FPS_CODE_UNAVAILABLE, "cannot connect to %s%s", replica_of(e)->addr,
                   e->c->tls ? " (shard down, or the TLS handshake failed: check tls_ca_file, the "
                               "client certificate and the name the shard's certificate carries)"
                             : " (shard down, or it serves TLS and needs tls_ca_file)");
  e->retryable = 1; /* no call was made: safe for every method */
}

static void gate_begin(engine_t *e) {
  grpc_connectivity_state st = gate_state(e);
  if (st == GRPC_CHANNEL_READY) {
    call_start(e);
  } else if (st == GRPC_CHANNEL_TRANSIENT_FAILURE) {
    /* gRPC 1.51 keeps a failed channel in TRANSIENT_FAILURE while it keeps
     * reconnecting in the background (it goes straight to READY when a
     * connection succeeds), so waiting for a change here could wait for the
     * whole deadline. Fail this attempt; the retry loop polls again after
     * its backoff (and gate_state replaces a channel failing for long). */
    gate_fail_unavailable(e);
  } else if (st == GRPC_CHANNEL_SHUTDOWN) {
    fps__stream_fail(e->s, FPS_CODE_UNAVAILABLE, "channel to %s is shut down",
                     replica_of(e)->addr);
  } else {
    gate_watch(e, st);
  }
}

static void gate_event(engine_t *e, int success) {
  e->pending[TAG_GATE] = 0;
  if (e->delayed) { /* its backoff is over */
    e->delayed = 0;
    gate_begin(e);
    return;
  }
  if (!success) {
    fps__stream_fail(e->s, FPS_CODE_DEADLINE_EXCEEDED, "not connected to %s within the deadline",
                     replica_of(e)->addr);
    return;
  }
  grpc_connectivity_state st = gate_state(e);
  switch (st) {
    case GRPC_CHANNEL_READY:
      call_start(e);
      break;
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      gate_fail_unavailable(e);
      break;
    case GRPC_CHANNEL_SHUTDOWN:
      fps__stream_fail(e->s, FPS_CODE_UNAVAILABLE, "channel to %s is shut down",
                       replica_of(e)->addr);
      break;
    default:
      gate_watch(e, st);
      break;
  }
}

static void send_event(engine_t *e, int success) {
  e->pending[TAG_SEND] = 0;
  grpc_byte_buffer_destroy(e->send_bb);
  e->send_bb = NULL;
  if (!success || e->local_code) {
    /* The stream broke; the status batch says why. */
    e->sending_done = 1;
    return;
  }
  if (e->sending_done) return;
  produce(e);
  if (e->local_code) {
    e->sending_done = 1;
    return;
  }
  send_next(e, 0);
  produce(e);
}

/* Hands one received message to the consumer. A consumer with on_spans
 * (PushPull and Pull replies, the tensor data) reads the slices gRPC
 * received it in, where they are. Otherwise it gets one contiguous buffer:
 * gRPC delivers a large message as many slices; instead of
 * grpc_byte_buffer_reader_readall(), which allocates a fresh buffer per
 * message (for 4 MiB messages that is an mmap and a page fault per 4 KiB
 * every time), the slices are gathered into one buffer per stream that is
 * reused for every message of the call. A one-slice message is read in
 * place. */
static int deliver(engine_t *e, grpc_byte_buffer *bb) {
  grpc_byte_buffer_reader rd;
  grpc_slice sl;
  int rc;
  if (e->s->ops->on_spans && bb->data.raw.compression == GRPC_COMPRESS_NONE) {
    /* The consumer reads the received slices themselves: no gathering. */
    const grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    if (sb->count > e->spans_cap) {
      fps_wspan_t *ns = fps_realloc(e->spans, sb->count * sizeof *ns);
      if (!ns)
        return fps__stream_fail(e->s, FPS_CODE_RESOURCE_EXHAUSTED, "out of memory for a %zu-slice reply",
                                sb->count);
      e->spans = ns;
      e->spans_cap = sb->count;
    }
    for (size_t i = 0; i < sb->count; i++)
      e->spans[i] = (fps_wspan_t){GRPC_SLICE_START_PTR(sb->slices[i]), GRPC_SLICE_LENGTH(sb->slices[i])};
    return e->s->ops->on_spans(e->s, e->spans, sb->count);
  }
  if (!grpc_byte_buffer_reader_init(&rd, bb))
    return fps__stream_fail(e->s, FPS_CODE_INTERNAL, "cannot read a reply (compressed?)");
  size_t len = grpc_byte_buffer_length(bb);
  if (bb->data.raw.compression == GRPC_COMPRESS_NONE && bb->data.raw.slice_buffer.count == 1) {
    grpc_slice only = bb->data.raw.slice_buffer.slices[0];
    rc = e->s->ops->on_message(e->s, GRPC_SLICE_START_PTR(only), GRPC_SLICE_LENGTH(only));
    grpc_byte_buffer_reader_destroy(&rd);
    return rc;
  }
  if (len > e->flat_cap) {
    fps_free(e->flat);
    e->flat_cap = 0;
    if (!(e->flat = fps_malloc(len ? len : 1))) {
      grpc_byte_buffer_reader_destroy(&rd);
      return fps__stream_fail(e->s, FPS_CODE_RESOURCE_EXHAUSTED,
                              "out of memory for a %zu-byte reply", len);
    }
    e->flat_cap = len;
  }
  size_t off = 0;
  while (grpc_byte_buffer_reader_next(&rd, &sl)) {
    size_t n = GRPC_SLICE_LENGTH(sl);
    if (n > len - off) n = len - off; /* cannot happen; never overflow */
    memcpy(e->flat + off, GRPC_SLICE_START_PTR(sl), n);
    off += n;
    grpc_slice_unref(sl);
  }
  grpc_byte_buffer_reader_destroy(&rd);
  if (e->s->ops->on_spans) {
    /* A compressed reply, inflated by the reader: one buffer. */
    fps_wspan_t one = {e->flat, off};
    return e->s->ops->on_spans(e->s, &one, 1);
  }
  return e->s->ops->on_message(e->s, e->flat, off);
}

static void recv_event(engine_t *e, int success) {
  e->pending[TAG_RECV] = 0;
  if (!success || !e->recv_bb) return; /* end of stream or broken call */
  int rc = e->local_code;
  if (!rc) rc = deliver(e, e->recv_bb);
  grpc_byte_buffer_destroy(e->recv_bb);
  e->recv_bb = NULL;
  if (rc) {
    if (!e->local_code) e->local_code = rc;
    engine_cancel(e, GRPC_STATUS_CANCELLED, "client rejected the reply");
    return;
  }
  recv_next(e, 0);
}

static void engine_init(engine_t *e, fps_client_t *c, fps__stream_t *s, const char *method,
                        gpr_timespec deadline, grpc_completion_queue *cq) {
  memset(e, 0, sizeof *e);
  e->s = s;
  e->c = c;
  e->method = method;
  e->deadline = deadline;
  e->cq = cq;
  for (int k = 0; k < TAG_COUNT; k++) e->tags[k] = (tag_t){e, k};
  grpc_metadata_array_init(&e->init_md);
  grpc_metadata_array_init(&e->trail_md);
  e->details = grpc_empty_slice();
  if (c->auth_header) {
    e->auth_md.key = grpc_slice_from_static_string("authorization");
    e->auth_md.value = grpc_slice_from_static_string(c->auth_header);
  }
  s->e = e;
  s->code = FPS_CODE_OK;
  s->msg[0] = '\0';
}

static int engine_busy(const engine_t *e) {
  for (int k = 0; k < TAG_COUNT; k++)
    if (e->pending[k]) return 1;
  return 0;
}

/* Records the outcome once nothing is in flight, and frees the call. */
static void engine_finish(engine_t *e, fps__retry_t retry) {
  fps__stream_t *s = e->s;
  if (e->finished || engine_busy(e)) return;
  e->finished = 1;
  if (e->call) {
    if (!e->local_code) {
      s->code = (int)e->status;
      if (e->status != GRPC_STATUS_OK) {
        size_t n = GRPC_SLICE_LENGTH(e->details);
        if (n >= sizeof s->msg) n = sizeof s->msg - 1;
        memcpy(s->msg, GRPC_SLICE_START_PTR(e->details), n);
        s->msg[n] = '\0';
        if (!n && e->error_string) snprintf(s->msg, sizeof s->msg, "%s", e->error_string);
      }
      /* A call the shard's side cancelled (not this client: that sets
       * local_code) is one a stopping shard dropped: gRPC cancels the calls
       * still open when a server shuts down. For an idempotent call that is
       * as retryable as UNAVAILABLE, and reported so. */
      if (e->status == GRPC_STATUS_CANCELLED && retry == FPS__RETRY_IDEMPOTENT) {
        s->code = FPS_CODE_UNAVAILABLE;
        static const char why[] = "the call was cancelled by the shard's side (a shard stopping): ";
        const size_t wl = sizeof why - 1, keep = strnlen(s->msg, sizeof s->msg - 1 - wl);
        memmove(s->msg + wl, s->msg, keep);
        memcpy(s->msg, why, wl);
        s->msg[wl + keep] = '\0';
      }
      if ((e->status == GRPC_STATUS_UNAVAILABLE || e->status == GRPC_STATUS_CANCELLED) &&
          retry == FPS__RETRY_IDEMPOTENT)
        e->retryable = 1;
      /* The replica that answered is where the shard's next calls start.
       * Not from Stats, which standbys answer too. */
      if (e->status == GRPC_STATUS_OK && strcmp(e->method, FPS__METHOD_STATS) != 0)
        atomic_store(&e->c->shards[s->shard].current, s->replica);
    }
    grpc_call_unref(e->call);
    e->call = NULL;
  } else if (!e->local_code) {
    /* Defensive: a gate that ended without a verdict. */
    fps__stream_fail(s, FPS_CODE_INTERNAL, "call never started");
  }
  if (e->local_code) s->code = e->local_code;
  if (e->have_next) grpc_byte_buffer_destroy(e->next);
  fps_free(e->flat);
  e->flat = NULL;
  e->flat_cap = 0;
  fps_free(e->spans);
  e->spans = NULL;
  e->spans_cap = 0;
  e->have_next = 0;
  grpc_metadata_array_destroy(&e->init_md);
  grpc_metadata_array_destroy(&e->trail_md);
  grpc_slice_unref(e->details);
  if (e->error_string) gpr_free((void *)e->error_string);
  e->error_string = NULL;
  s->e = NULL;
}

static void sleep_seconds(double s) {
  if (s <= 0) return;
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

static int stream_next_replica(const fps_client_t *c, fps__stream_t *s, int *round_done);

/* A finished engine whose stream failed UNAVAILABLE starts again inside
 * this attempt, on its shard's next replica if it has standbys: the other
 * shards' calls may wait for this one (a split tensor's blocks step
 * together, so a block shard's call waits for the partials of the block
 * whose primary died, or whose step failed there) and must not wait for
 * their own end first. At once within a round over the replicas; a new
 * round (every attempt without standbys) after the backoff (as
 * fps__streams_run's: initial, doubling, at most 5 s), on this stream's
 * own timer. Not once a stream of the attempt failed for good: the call
 * fails then, whatever the others do. 1 if started again. */
static int engine_failover(engine_t *e) {
  fps__stream_t *s = e->s;
  const int nr = (int)e->c->shards[s->shard].n;
  if (*e->refused || !e->retryable || s->code != FPS_CODE_UNAVAILABLE) return 0;
  gpr_timespec now = gpr_now(GPR_CLOCK_MONOTONIC), end = gpr_convert_clock_type(e->deadline, GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(now, end) >= 0) return 0;
  int round_done = 0;
  if (!stream_next_replica(e->c, s, &round_done)) return 0;
  double wait = 0;
  if (round_done) {
    wait = e->c->opts.backoff_initial_seconds;
    for (int r = s->attempts / nr; r > 1 && wait < 5.0; r--) wait *= 2;
    if (wait > 5.0) wait = 5.0;
  }
  gpr_timespec until = gpr_time_add(now, gpr_time_from_nanos((int64_t)(wait * 1e9), GPR_TIMESPAN));
  if (gpr_time_cmp(until, end) >= 0) return 0;
  if (s->ops->reset) s->ops->reset(s);
  engine_t *succ = e->succ;
  int *refused = e->refused;
  engine_init(e, e->c, s, e->method, e->deadline, e->cq);
  e->succ = succ;
  e->refused = refused;
  e->started = 1;
  if (wait > 0) gate_after(e, until);
  else gate_begin(e);
  return 1;
}

/* Records finished engines in `*active` and starts the engines held
 * behind `e` once it has sent everything (or ended). */
static void engine_settle(engine_t *e, fps__retry_t retry, size_t *active) {
  while (e) {
    engine_finish(e, retry);
    if (e->finished && !e->counted && e->s->code != FPS_CODE_OK && e->s->code != FPS_CODE_UNAVAILABLE)
      *e->refused = 1;
    if (e->finished && !e->counted && engine_failover(e)) continue; /* settled again: it may fail at once */
    if (e->finished && !e->counted) {
      e->counted = 1;
      (*active)--;
    }
    engine_t *next = e->succ;
    if (!next || !next->held || !(e->sending_done || e->finished)) return;
    next->held = 0;
    next->started = 1;
    gate_begin(next);
    e = next;
  }
}

/* Attempts whose calls gRPC never completed, even cancelled (seen under
 * ASan with 2-9 ms deadlines: a cancelled call's receive and status ops
 * still pending 10 s later). Their queue and engines must outlive the
 * attempt, since gRPC may still write into them; they are kept here,
 * reachable, instead of making the caller wait forever. */
typedef struct abandoned_s {
  grpc_completion_queue *cq;
  engine_t *engines;
  struct abandoned_s *next;
} abandoned_t;
static pthread_mutex_t abandoned_mu = PTHREAD_MUTEX_INITIALIZER;
static abandoned_t *abandoned;

static void abandon(grpc_completion_queue *cq, engine_t *engines) {
  abandoned_t *a = fps_malloc(sizeof *a);
  pthread_mutex_lock(&abandoned_mu);
  if (a) {
    *a = (abandoned_t){cq, engines, abandoned};
    abandoned = a;
  }
  pthread_mutex_unlock(&abandoned_mu);
}

/* Runs one attempt of the streams in `run` (n of them). Returns 0, or 1 if
 * gRPC left operations pending past every bound: then the queue and
 * `engines` belong to gRPC (abandoned) and the caller must not touch or
 * free `engines` again. */
static int run_attempt(fps_client_t *c, const char *method, fps__stream_t **run, size_t n,
                        gpr_timespec deadline, fps__retry_t retry, engine_t *engines) {
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  size_t active = n;
  int refused = 0; /* a stream failed for good: none starts again (engine_failover) */
  for (size_t i = 0; i < n; i++) {
    engine_init(&engines[i], c, run[i], method, deadline, cq);
    engines[i].refused = &refused;
  }
  /* A stream whose `after` runs in this attempt waits for it (its engine
   * is known by now: engine_init set s->e); one that already succeeded in
   * an earlier attempt holds nothing back. */
  for (size_t i = 0; i < n; i++) {
    fps__stream_t *a = run[i]->after;
    if (a && a->e && a->e >= engines && a->e < engines + n) {
      a->e->succ = &engines[i];
      engines[i].held = 1;
    }
  }
  /* engine_settle() may start held engines further down the array: each
   * engine starts exactly once. */
  for (size_t i = 0; i < n; i++) {
    if (engines[i].held || engines[i].started) continue;
    engines[i].started = 1;
    gate_begin(&engines[i]);
    engine_settle(&engines[i], retry, &active);
  }
  /* The calls carry the deadline; the queue wait adds a slack beyond it so
   * a misbehaving transport cannot hold the caller forever. */
  gpr_timespec wait_until =
      gpr_time_add(deadline, gpr_time_from_millis(5000, GPR_TIMESPAN));
  int cancelled = 0;
  while (active > 0) {
    grpc_event ev = grpc_completion_queue_next(cq, wait_until, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
      if (cancelled) break; /* gRPC left ops pending: abandoned below, never hang */
      for (size_t i = 0; i < n; i++) {
        if (engines[i].finished) continue;
        if (!engines[i].local_code)
          fps__stream_fail(run[i], FPS_CODE_DEADLINE_EXCEEDED, "no answer within the deadline");
        engine_cancel(&engines[i], GRPC_STATUS_DEADLINE_EXCEEDED, "deadline");
      }
      /* Held engines have no call to cancel: they end here. */
      for (size_t i = 0; i < n; i++)
        if (engines[i].held) {
          engines[i].held = 0;
          engine_settle(&engines[i], retry, &active);
        }
      cancelled = 1;
      wait_until = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                gpr_time_from_millis(10000, GPR_TIMESPAN));
      continue;
    }
    if (ev.type != GRPC_OP_COMPLETE) break;
    tag_t *t = ev.tag;
    engine_t *e = t->e;
    switch (t->kind) {
      case TAG_GATE: gate_event(e, ev.success); break;
      case TAG_SEND: send_event(e, ev.success); break;
      case TAG_RECV: recv_event(e, ev.success); break;
      case TAG_STATUS:
        e->pending[TAG_STATUS] = 0;
        e->status_done = 1;
        break;
    }
    engine_settle(e, retry, &active);
  }
  if (active > 0) {
    /* Never hang the caller: the streams already carry DEADLINE_EXCEEDED. */
    for (size_t i = 0; i < n; i++) {
      if (engines[i].finished) continue;
      if (run[i]->code == FPS_CODE_OK)
        fps__stream_fail(run[i], engines[i].local_code ? engines[i].local_code : FPS_CODE_DEADLINE_EXCEEDED,
                         "no answer within the deadline");
      run[i]->e = NULL;
    }
    abandon(cq, engines);
    return 1;
  }
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return 0;
}

/* Moves a stream that failed UNAVAILABLE on to its shard's next replica.
 * Returns 1 if it may be tried again (max_retries rounds over all the
 * shard's replicas), with *round_done set when the next attempt begins a
 * new round (the backoff comes first). */
static int stream_next_replica(const fps_client_t *c, fps__stream_t *s, int *round_done) {
  const int nr = (int)c->shards[s->shard].n;
  s->attempts++;
  if (s->attempts >= (c->opts.max_retries + 1) * nr) return 0;
  if (s->attempts % nr == 0) *round_done = 1;
  s->replica = (s->replica + 1) % nr;
  return 1;
}

int fps__streams_run(fps_client_t *c, const char *method, fps__stream_t *const *streams, size_t n,
                     fps__retry_t retry, fps_status_t *st) {
  double start = fps__now();
  double end = start + c->opts.deadline_seconds;
  gpr_timespec deadline = fps__deadline_after(c->opts.deadline_seconds);
  double backoff = c->opts.backoff_initial_seconds;
  fps__stream_t **run = fps_malloc((n ? n : 1) * sizeof *run);
  engine_t *engines = fps_calloc(n ? n : 1, sizeof *engines);
  size_t n_run = n;

  if (!run || !engines) {
    fps_free(run);
    fps_free(engines);
    return fps__status_err(st, FPS_ENOMEM, -1, "out of memory starting calls");
  }
  memcpy(run, streams, n * sizeof *run);
  for (size_t i = 0; i < n; i++) {
    streams[i]->replica = atomic_load(&c->shards[streams[i]->shard].current);
    streams[i]->attempts = 0;
  }
  for (;;) {
    if (run_attempt(c, method, run, n_run, deadline, retry, engines)) {
      engines = NULL; /* gRPC's now */
      break;
    }
    /* A stream refused for good (any failure but UNAVAILABLE) fails the
     * call whatever the others do: retrying them would only apply parts of
     * a call that fails, or wait again for nothing (a split block's peer
     * waits out its exchange deadline, UNAVAILABLE, for partials that the
     * refusing shard never sends: six retries of that took a minute). */
    int refused = 0;
    for (size_t i = 0; i < n; i++)
      refused |= streams[i]->code != FPS_CODE_OK && streams[i]->code != FPS_CODE_UNAVAILABLE;
    if (refused) break;
    /* A stream that failed UNAVAILABLE goes to its shard's next replica at
     * once: with a standby that is where the primary went. Only a full
     * round over the replicas (the only one, without standbys) waits for
     * the backoff first. */
    size_t again = 0;
    int round_done = 0;
    for (size_t i = 0; i < n_run; i++)
      if (engines[i].retryable && run[i]->code == FPS_CODE_UNAVAILABLE &&
          stream_next_replica(c, run[i], &round_done))
        run[again++] = run[i];
    if (!again) break;
    double left = end - fps__now();
    if (left <= 0.01) break;
    if (round_done) {
      sleep_seconds(backoff < left ? backoff : left * 0.5);
      backoff = backoff * 2 > 5.0 ? 5.0 : backoff * 2;
    }
    for (size_t i = 0; i < again; i++)
      if (run[i]->ops->reset) run[i]->ops->reset(run[i]);
    n_run = again;
  }
  fps_free(run);
  fps_free(engines);

  /* Report the failing stream of the lowest shard index, so the message
   * does not depend on which shard happened to answer first; a refusal
   * before an UNAVAILABLE (which may only be a consequence of it, above). */
  const fps__stream_t *worst = NULL;
  for (size_t i = 0; i < n; i++) {
    const fps__stream_t *s = streams[i];
    if (s->code == FPS_CODE_OK) continue;
    const int firm = s->code != FPS_CODE_UNAVAILABLE, worst_firm = worst && worst->code != FPS_CODE_UNAVAILABLE;
    if (!worst || firm > worst_firm || (firm == worst_firm && s->shard < worst->shard)) worst = s;
  }
  if (!worst) {
    fps__status_ok(st);
    return 0;
  }
  const fps__shard_conn_t *sc = &c->shards[worst->shard];
  if (sc->n > 1)
    return fps__status_set(st, worst->code, worst->shard, "shard %d (%s, last tried %s): %s: %s",
                           worst->shard, c->addrs[worst->shard], sc->r[worst->replica].addr,
                           fps_code_name(worst->code), worst->msg);
  return fps__status_set(st, worst->code, worst->shard, "shard %d (%s): %s: %s", worst->shard,
                         c->addrs[worst->shard], fps_code_name(worst->code), worst->msg);
}

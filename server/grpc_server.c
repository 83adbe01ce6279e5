/* gRPC C core plumbing: one completion queue served by T poller threads,
 * request slots for the registered methods (plus a generic slot that
 * answers UNIMPLEMENTED), admission (tokens, the call limit), the method
 * table that starts the handlers, start and stop. The call object the
 * handlers share is call.c, below them. */
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "auth.h"
#include "metrics.h"
#include "replica.h"
#include "server.h"
#include "tsan.h"

#define FPS_SLOTS_PER_METHOD 8
#define FPS_MAX_METADATA_BYTES 8192

/* The method table, from the one list (common/methods.h); M_GENERIC
 * takes every other path (answered UNIMPLEMENTED). */
enum { M_GENERIC = FPS_METHOD_COUNT };
static const char *const fps__method_path[] = {
#define FPS__PATH(id, name, handler, role, streaming) [FPS_METHOD_##id] = FPS_METHOD_PREFIX name,
    FPS_METHOD_MAP(FPS__PATH)
#undef FPS__PATH
};
/* 1: the handler reads the request stream itself (no initial message). */
static const bool fps__method_streaming[] = {
#define FPS__STREAMING(id, name, handler, role, streaming) [FPS_METHOD_##id] = streaming,
    FPS_METHOD_MAP(FPS__STREAMING)
#undef FPS__STREAMING
};

typedef struct fps_slot_s {
  fps_tag_t tag;
  fps_server_t *srv;
  int method;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details;   /* generic slot only */
} fps_slot_t;

typedef struct fps_poller_s {
  pthread_t th;
  fps_server_t *srv;
} fps_poller_t;

static fps_poller_t *fps__pollers;
static uint32_t fps__npollers;

/* Shutdown notification tag. */
typedef struct fps_shutdown_tag_s {
  fps_tag_t tag;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool done;
} fps_shutdown_tag_t;
static fps_shutdown_tag_t fps__shutdown_tag;

/* ---------------------------------------------------------- admission */

/* The role each method needs (auth.h); Create's replace needs admin
 * too, checked by its handler once the request is read. */
static const unsigned fps__method_role[] = {
#define FPS__ROLE(id, name, handler, role, streaming) [FPS_METHOD_##id] = FPS_ROLE_##role,
    FPS_METHOD_MAP(FPS__ROLE)
#undef FPS__ROLE
    [M_GENERIC] = 0,
};
/* Calls admitted but maybe not yet linked into srv->calls: counted with
 * srv->ncalls so that pollers admitting at the same moment cannot together
 * pass --max-concurrent-calls (a call is briefly counted twice, which errs
 * on the side of refusing). */
static atomic_uint_fast64_t fps__arriving;

/* Decides, before any handler state exists, whether a call may run: its
 * bearer token (UNAUTHENTICATED), the role the method needs
 * (PERMISSION_DENIED) and the shard's call limit (RESOURCE_EXHAUSTED). A refused call is answered here and its payload
 * freed; an admitted one must be followed by fps__call_admitted() once the
 * handler has started. */
static bool fps__call_admit(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md, grpc_byte_buffer *payload, int method) {
  static const char prefix[] = "/factorps.v1.ParameterServer/";
  const char *name = method < M_GENERIC ? fps__method_path[method] + sizeof prefix - 1 : "unknown method";
  char why[512];
  fps_ident_t id;
  int rc = fps_auth_check(srv->auth, md, &id, why, sizeof why);
  if (rc == 0) rc = fps_auth_cert_limit(srv->auth, call, &id, why, sizeof why);
  if (rc == 0) rc = fps_auth_allow(&id, fps__method_role[method], name, why, sizeof why);
  /* A standby (or a primary stepping down) serves no worker call: the
   * client fails over to the other replica (replica.h). */
  if (rc == 0 && method != FPS_METHOD_STATS && method != FPS_METHOD_REPLICATE && method != M_GENERIC)
    rc = fps_replica_refusal(srv->replica, why, sizeof why);
  if (rc == 0) {
    uint64_t arriving = atomic_fetch_add(&fps__arriving, 1) + 1;
    pthread_mutex_lock(&srv->calls_mu);
    uint64_t running = srv->ncalls;
    pthread_mutex_unlock(&srv->calls_mu);
    if (running + arriving <= srv->cfg.max_concurrent_calls) return true;
    atomic_fetch_sub(&fps__arriving, 1);
    rc = FPS_ELIMIT;
    snprintf(why, sizeof why,
             "shard %u is at its limit of %u concurrent calls (--max-concurrent-calls); retry later",
             srv->cfg.shard_id, srv->cfg.max_concurrent_calls);
  }
  fps__auth_log_refusal(call, name, why);
  if (payload) grpc_byte_buffer_destroy(payload);
  /* Answer through a throwaway base, so the refusal is metered like any
   * other status of that method. */
  fps_call_t *c = fps_calloc(1, sizeof *c);
  if (!c) {
    grpc_call_cancel_with_status(call, fps_status_from_err(rc), why, NULL);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(md);
    return false;
  }
  c->destroy = (void (*)(fps_call_t *))fps_free;
  if (fps_call_begin(c, srv, call, deadline, md, name) == 0) fps_call_error(c, rc, "%s", why);
  return false;
}

static void fps__call_admitted(void) { atomic_fetch_sub(&fps__arriving, 1); }

/* ------------------------------------------- the request, once admitted */

/* A unary call's request is read only after admission: gRPC would
 * otherwise read the whole message (up to --max-message-bytes, the
 * receive window opened for it) before the token is looked at, and
 * unauthenticated streams that stall inside their message held that much
 * each (6 x 16 MiB took a shard from 19 to 116 MiB, kept after they left).
 * Until it is read, a refused or unread stream holds at most gRPC's 64 KiB
 * lookahead. While reading, the call counts as arriving against
 * --max-concurrent-calls, so stalled senders cannot pile up either. */
typedef struct fps_pending_s {
  fps_tag_t tag;
  fps_server_t *srv;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;        /* RECV_MESSAGE's; NULL: none came */
  int method;
} fps_pending_t;

static void fps__dispatch(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, grpc_metadata_array *md,
                          grpc_byte_buffer *payload, int method);

static void fps__pending_done(fps_tag_t *tag, bool ok) {
  fps_pending_t *p = (fps_pending_t *)tag;
  if (!ok || atomic_load(&p->srv->shutting_down)) {
    /* The call died (client gone, deadline, shutdown) before its message. */
    if (p->payload) grpc_byte_buffer_destroy(p->payload);
    grpc_call_cancel(p->call, NULL);
    grpc_call_unref(p->call);
    grpc_metadata_array_destroy(&p->md);
  } else {
    fps__dispatch(p->srv, p->call, p->deadline, &p->md, p->payload, p->method);
  }
  fps_free(p);
  fps__call_admitted();
}

/* Reads an admitted unary call's request, then starts its handler
 * (fps__pending_done). False if that could not begin: the call is
 * answered and released here. */
static bool fps__pending_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, grpc_metadata_array *md,
                               int method) {
  fps_pending_t *p = fps_calloc(1, sizeof *p);
  if (!p) {
    grpc_call_cancel_with_status(call, fps_status_from_err(FPS_ENOMEM), "out of memory", NULL);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(md);
    return false;
  }
  p->tag.fn = fps__pending_done;
  p->srv = srv;
  p->call = call;
  p->deadline = deadline;
  p->md = *md;
  memset(md, 0, sizeof *md);
  p->method = method;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &p->payload;
  grpc_call_error e = GRPC_CALL_ERROR_ALREADY_FINISHED;
  pthread_rwlock_rdlock(&srv->batch_gate);
  if (!srv->batches_closed) {
    FPS_TSAN_RELEASE(&p->tag);
    e = grpc_call_start_batch(call, &op, 1, &p->tag, NULL);
  }
  pthread_rwlock_unlock(&srv->batch_gate);
  if (e == GRPC_CALL_OK) return true;
  grpc_call_cancel(call, NULL);
  grpc_call_unref(call);
  grpc_metadata_array_destroy(&p->md);
  fps_free(p);
  return false;
}

/* -------------------------------------------------------------- slots */

static int fps__slot_post(fps_slot_t *s);

static void fps__slot_done(fps_tag_t *tag, bool ok) {
  fps_slot_t *s = (fps_slot_t *)tag;
  fps_server_t *srv = s->srv;
  if (!ok) {
    /* Shutdown: the slot is not re-posted. */
    grpc_metadata_array_destroy(&s->md);
    if (s->method == M_GENERIC) grpc_call_details_destroy(&s->details);
    fps_free(s);
    return;
  }
  grpc_call *call = s->call;
  gpr_timespec deadline = s->method == M_GENERIC ? s->details.deadline : s->deadline;
  grpc_metadata_array md = s->md;
  grpc_byte_buffer *payload = s->payload;
  int method = s->method;
  /* Re-post before handling, so a burst of calls never finds no slot. */
  grpc_metadata_array_init(&s->md);
  s->payload = NULL;
  s->call = NULL;
  if (method == M_GENERIC) {
    grpc_call_details_destroy(&s->details);
    grpc_call_details_init(&s->details);
  }
  if (atomic_load(&srv->shutting_down) || fps__slot_post(s) < 0) {
    grpc_metadata_array_destroy(&s->md);
    if (method == M_GENERIC) grpc_call_details_destroy(&s->details);
    fps_free(s);
  }
  if (!fps__call_admit(srv, call, deadline, &md, payload, method)) return;
  /* PushPull reads its own stream, and an unknown method is answered at
   * once; the unary methods read their request first (fps__pending_*),
   * and stay counted as arriving until their handler has started. */
  if (method != M_GENERIC && !fps__method_streaming[method]) {
    if (!fps__pending_start(srv, call, deadline, &md, method)) fps__call_admitted();
    return;
  }
  fps__dispatch(srv, call, deadline, &md, payload, method);
  fps__call_admitted();
}

/* Starts the handler of an admitted call (it takes call, md and payload). */
static void fps__dispatch(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, grpc_metadata_array *md,
                          grpc_byte_buffer *payload, int method) {
  switch (method) {
#define FPS__START_0(handler) fps_rpc_##handler##_start(srv, call, deadline, md, payload)
#define FPS__START_1(handler) fps_rpc_##handler##_start(srv, call, deadline, md)
#define FPS__CASE(id, name, handler, role, streaming) \
  case FPS_METHOD_##id: FPS__START_##streaming(handler); break;
    FPS_METHOD_MAP(FPS__CASE)
#undef FPS__CASE
#undef FPS__START_0
#undef FPS__START_1
    default: {
      /* Unknown method: answer UNIMPLEMENTED through a throwaway base. */
      fps_call_t *c = fps_calloc(1, sizeof *c);
      if (!c) {
        grpc_call_cancel(call, NULL);
        grpc_call_unref(call);
        grpc_metadata_array_destroy(md);
        break;
      }
      c->destroy = (void (*)(fps_call_t *))fps_free;
      if (fps_call_begin(c, srv, call, deadline, md, "unknown method") == 0)
        fps_call_error(c, FPS_EUNSUPPORTED, "factorps serves factorps.v1.ParameterServer only");
      break;
    }
  }
}

static int fps__slot_post(fps_slot_t *s) {
  fps_server_t *srv = s->srv;
  grpc_call_error e = GRPC_CALL_ERROR;
  int method = s->method;
  /* Under the gate like every batch: a request on a queue shut down aborts. */
  pthread_rwlock_rdlock(&srv->batch_gate);
  if (srv->batches_closed) {
  } else if (method == M_GENERIC) {
    /* Nothing of the slot is read after the release (tsan.h). */
    FPS_TSAN_RELEASE(&s->tag);
    e = grpc_server_request_call(srv->server, &s->call, &s->details, &s->md, srv->cq, srv->cq, &s->tag);
  } else {
    /* No payload: a request is read only once its call is admitted. */
    FPS_TSAN_RELEASE(&s->tag);
    e = grpc_server_request_registered_call(srv->server, srv->method[method], &s->call, &s->deadline,
                                            &s->md, NULL, srv->cq, srv->cq, &s->tag);
  }
  pthread_rwlock_unlock(&srv->batch_gate);
  return e == GRPC_CALL_OK ? 0 : FPS_EPROTO;
}

static int fps__slot_new(fps_server_t *srv, int method) {
  fps_slot_t *s = fps_calloc(1, sizeof *s);
  if (!s) return FPS_ENOMEM;
  s->tag.fn = fps__slot_done;
  s->srv = srv;
  s->method = method;
  grpc_metadata_array_init(&s->md);
  if (method == M_GENERIC) grpc_call_details_init(&s->details);
  if (fps__slot_post(s) < 0) {
    grpc_metadata_array_destroy(&s->md);
    if (method == M_GENERIC) grpc_call_details_destroy(&s->details);
    fps_free(s);
    return FPS_EPROTO;
  }
  return 0;
}

/* ----------------------------------------------------- pollers, start */

static void *fps__poller_main(void *arg) {
  fps_poller_t *p = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(p->srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    fps_tag_t *tag = ev.tag;
    FPS_TSAN_ACQUIRE(tag); /* from the thread that handed it to gRPC (tsan.h) */
    tag->fn(tag, ev.success != 0);
  }
  return NULL;
}

static void fps__shutdown_done(fps_tag_t *tag, bool ok) {
  fps_shutdown_tag_t *t = (fps_shutdown_tag_t *)tag;
  pthread_mutex_lock(&t->mu);
  t->done = true;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

int fps_grpc_start(fps_server_t *srv) {
  srv->batches_closed = false; /* no thread of ours runs yet */
  /* Bad TLS files or tokens stop the start before anything listens. */
  int rc = fps_auth_create(&srv->cfg, &srv->auth);
  if (rc < 0) return rc;
  FPS_LOG(FPS_LOG_INFO, "gRPC security: %s", fps_auth_describe(srv->auth));
  if (srv->cfg.mode == FPS_MODE_SYNC && srv->cfg.max_concurrent_calls < srv->cfg.workers)
    FPS_LOG(FPS_LOG_WARN, "--max-concurrent-calls %u is below --workers %u: a round needs every "
             "worker's push parked at once and can never complete", srv->cfg.max_concurrent_calls,
             srv->cfg.workers);
  grpc_arg args[8];
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = (int)srv->cfg.max_message_bytes;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[1].value.integer = -1;
  /* gRPC sets SO_REUSEPORT by default: a second shard on the same port
   * would silently share it instead of failing "address in use". */
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = GRPC_ARG_ALLOW_REUSEPORT;
  args[2].value.integer = 0;
  /* Request metadata per call (gRPC's default, set so it is a decision):
   * our clients send at most a 4 KiB token and a few hundred bytes of
   * standard headers. gRPC 1.51's C core answers metadata above this by
   * closing the whole HTTP/2 connection (every call on it fails), which
   * the application cannot change; a higher limit would only let one
   * stream hold more memory. Other connections are not affected. */
  args[3].type = GRPC_ARG_INTEGER;
  args[3].key = GRPC_ARG_MAX_METADATA_SIZE;
  args[3].value.integer = FPS_MAX_METADATA_BYTES;
  /* The core's decompression inflates a whole message before it checks
   * the size, and before the handler (token, call limit) sees the call:
   * 0.5 MB of gzip cost 545 MiB. Compressed messages are handed over as
   * they arrived (their wire size bounded by the receive limit) and
   * inflated by fps_bb_flatten(), bounded, after admission. */
  args[4].type = GRPC_ARG_INTEGER;
  args[4].key = GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION;
  args[4].value.integer = 0;
  /* No BDP probing by default: it grows every stream's receive window to
   * its bandwidth-delay estimate, and a stream whose push the shard is not
   * reading yet (a sync round held back, a slow sum) then holds that many
   * received bytes in gRPC's buffers. On loopback under load that was
   * 150-200 MiB per shard at W = 4 (100M parameters, VmHWM 621-676 MiB
   * with it, 452-478 without). Each read still opens the window for the
   * whole message it waits for, so messages stream at full speed; only on
   * links whose bandwidth-delay product nears a message (4 MiB) does the
   * one round trip between messages show, and --http2-bdp-probe trades
   * that memory back for it. */
  args[5].type = GRPC_ARG_INTEGER;
  args[5].key = GRPC_ARG_HTTP2_BDP_PROBE;
  args[5].value.integer = srv->cfg.http2_bdp_probe ? 1 : 0;
  /* Streams per connection: gRPC's default is unlimited, so one client
   * could open any number of streams on one connection (each holding
   * receive buffers). A client past the cap waits for a stream to end. */
  args[6].type = GRPC_ARG_INTEGER;
  args[6].key = GRPC_ARG_MAX_CONCURRENT_STREAMS;
  args[6].value.integer = (int)srv->cfg.max_streams_per_connection;
  /* Larger DATA frames than HTTP/2's 16 KiB: a worker's gradients come in
   * 64x fewer frames at 1 MiB, each parsed and written once, which cut the
   * workers' CPU per step by 7-14% across a 2.5 Gbit/s link; a frame holds
   * the connection for 3.5 ms at that rate (docs/performance.md). */
  size_t nargs = 7;
  if (srv->cfg.http2_max_frame) {
    args[nargs].type = GRPC_ARG_INTEGER;
    args[nargs].key = GRPC_ARG_HTTP2_MAX_FRAME_SIZE;
    args[nargs].value.integer = (int)srv->cfg.http2_max_frame;
    nargs++;
  }
  grpc_channel_args ca = {nargs, args};
  srv->server = grpc_server_create(&ca, NULL);
  srv->cq = grpc_completion_queue_create_for_next(NULL);
  if (!srv->server || !srv->cq) return FPS_ENOMEM;
  grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
  /* Pollers first: whatever fails below, fps_grpc_stop() can then shut the
   * server down and drain the queue the normal way. */
  fps__npollers = srv->cfg.threads;
  fps__pollers = fps_calloc(fps__npollers, sizeof *fps__pollers);
  if (!fps__pollers) {
    fps__npollers = 0;
    return FPS_ENOMEM;
  }
  for (uint32_t i = 0; i < fps__npollers; i++) {
    fps__pollers[i].srv = srv;
    if (pthread_create(&fps__pollers[i].th, NULL, fps__poller_main, &fps__pollers[i]) != 0) {
      fps__npollers = i;
      return FPS_ENOMEM;
    }
  }
  for (int m = 0; m < M_GENERIC; m++) {
    srv->method[m] = grpc_server_register_method(srv->server, fps__method_path[m], NULL, GRPC_SRM_PAYLOAD_NONE, 0);
    if (!srv->method[m]) return FPS_EPROTO;
  }
  grpc_server_credentials *creds = fps_auth_server_credentials(srv->auth);
  if (!creds) return FPS_ENOMEM;
  srv->port = grpc_server_add_http2_port(srv->server, srv->cfg.listen, creds);
  grpc_server_credentials_release(creds);
  if (srv->port <= 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot listen on '%s' (address in use or invalid)", srv->cfg.listen);
    return FPS_EIO;
  }
  grpc_server_start(srv->server);
  for (int m = 0; m <= M_GENERIC; m++) {
    int n = m == M_GENERIC ? 2 : FPS_SLOTS_PER_METHOD;
    for (int i = 0; i < n; i++)
      if (fps__slot_new(srv, m) < 0) return FPS_ENOMEM;
  }
  return 0;
}

void fps_grpc_stop(fps_server_t *srv, double grace_s) {
  if (!srv->server) return;
  atomic_store(&srv->shutting_down, true);
  fps_shutdown_tag_t *t = &fps__shutdown_tag;
  t->tag.fn = fps__shutdown_done;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  pthread_mutex_lock(&t->mu);
  t->done = false;
  pthread_mutex_unlock(&t->mu);
  FPS_TSAN_RELEASE(&t->tag);
  grpc_server_shutdown_and_notify(srv->server, srv->cq, &t->tag);
  /* Calls parked in sync rounds or ssp waits would only end at their
   * deadline: fail them now. */
  fps_shard_fail_waiting(srv->shard, FPS_EUNAVAILABLE, "shard is shutting down");

  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  long grace_ns = (long)(grace_s * 1e9);
  until.tv_sec += grace_ns / 1000000000L;
  until.tv_nsec += grace_ns % 1000000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&t->mu);
  while (!t->done && fps__npollers > 0) {
    if (pthread_cond_timedwait(&t->cv, &t->mu, &until) != 0) break;
  }
  bool done = t->done;
  pthread_mutex_unlock(&t->mu);
  if (!done) {
    FPS_LOG(FPS_LOG_WARN, "shutdown: calls still running after %.1f s, cancelling them", grace_s);
    grpc_server_cancel_all_calls(srv->server);
    pthread_mutex_lock(&t->mu);
    while (!t->done && fps__npollers > 0) pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
  }
  /* Calls can still be finishing their last batches: destroying the
   * server cancels what remains, the queue drains to SHUTDOWN, and the
   * pollers (which run the final unrefs) exit. */
  grpc_server_cancel_all_calls(srv->server);
  grpc_server_destroy(srv->server);
  pthread_rwlock_wrlock(&srv->batch_gate);
  srv->batches_closed = true;
  pthread_rwlock_unlock(&srv->batch_gate);
  grpc_completion_queue_shutdown(srv->cq);
  for (uint32_t i = 0; i < fps__npollers; i++) pthread_join(fps__pollers[i].th, NULL);
  /* Only now: a poller re-posting a slot reads srv->server until it exits. */
  srv->server = NULL;
  fps_free(fps__pollers);
  fps__pollers = NULL;
  fps__npollers = 0;
  grpc_completion_queue_destroy(srv->cq);
  srv->cq = NULL;
  fps_auth_destroy(srv->auth);
  srv->auth = NULL;
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
}

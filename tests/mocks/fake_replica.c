/* See fake_replica.h. One thread drives the server's completion queue:
 * each call is answered (initial metadata, the status) in one batch as
 * soon as it arrives, and the next call is requested at once. */
#include "fake_replica.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TAG_REQUEST, TAG_ANSWERED, TAG_SHUTDOWN };

typedef struct fake_call_s {
  int kind;                            /* TAG_REQUEST, then TAG_ANSWERED */
  grpc_call *call;
  grpc_call_details details;
  grpc_metadata_array md;
  int cancelled;
} fake_call_t;

struct fps_fake_replica_s {
  grpc_server *server;
  grpc_completion_queue *cq;
  pthread_t th;
  char addr[64];
  int code;
  grpc_slice message;
  atomic_int calls;
  int shutdown_tag;                    /* kind TAG_SHUTDOWN */
};

static fake_call_t *request_next(fps_fake_replica_t *f) {
  fake_call_t *fc = calloc(1, sizeof *fc);
  if (!fc) return NULL;
  fc->kind = TAG_REQUEST;
  grpc_call_details_init(&fc->details);
  grpc_metadata_array_init(&fc->md);
  if (grpc_server_request_call(f->server, &fc->call, &fc->details, &fc->md, f->cq, f->cq, fc) !=
      GRPC_CALL_OK) {
    grpc_call_details_destroy(&fc->details);
    grpc_metadata_array_destroy(&fc->md);
    free(fc);
    return NULL;
  }
  return fc;
}

static void call_free(fake_call_t *fc) {
  if (fc->call) grpc_call_unref(fc->call);
  grpc_call_details_destroy(&fc->details);
  grpc_metadata_array_destroy(&fc->md);
  free(fc);
}

static void *serve(void *arg) {
  fps_fake_replica_t *f = arg;
  int stopping = 0;
  request_next(f);
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(f->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    if (ev.tag == &f->shutdown_tag) {
      stopping = 1;
      grpc_completion_queue_shutdown(f->cq);
      continue;
    }
    fake_call_t *fc = ev.tag;
    if (fc->kind == TAG_ANSWERED || !ev.success) {
      call_free(fc);
      continue;
    }
    /* A new call: answer it, and ask for the next one. */
    if (!stopping) request_next(f);
    atomic_fetch_add(&f->calls, 1);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[1].data.recv_close_on_server.cancelled = &fc->cancelled;
    ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[2].data.send_status_from_server.status = (grpc_status_code)f->code;
    ops[2].data.send_status_from_server.status_details = &f->message;
    fc->kind = TAG_ANSWERED;
    if (grpc_call_start_batch(fc->call, ops, 3, fc, NULL) != GRPC_CALL_OK) call_free(fc);
  }
  return NULL;
}

fps_fake_replica_t *fps_fake_replica_start(int code, const char *message) {
  fps_fake_replica_t *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  grpc_init();
  f->code = code;
  f->shutdown_tag = TAG_SHUTDOWN;
  f->message = grpc_slice_from_copied_string(message);
  f->cq = grpc_completion_queue_create_for_next(NULL);
  f->server = grpc_server_create(NULL, NULL);
  grpc_server_register_completion_queue(f->server, f->cq, NULL);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  int port = grpc_server_add_http2_port(f->server, "127.0.0.1:0", creds);
  grpc_server_credentials_release(creds);
  if (port <= 0) {
    grpc_server_destroy(f->server);
    grpc_completion_queue_shutdown(f->cq);
    while (grpc_completion_queue_next(f->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(f->cq);
    grpc_slice_unref(f->message);
    free(f);
    grpc_shutdown();
    return NULL;
  }
  snprintf(f->addr, sizeof f->addr, "127.0.0.1:%d", port);
  grpc_server_start(f->server);
  pthread_create(&f->th, NULL, serve, f);
  return f;
}

const char *fps_fake_replica_addr(const fps_fake_replica_t *f) { return f->addr; }

int fps_fake_replica_calls(const fps_fake_replica_t *f) {
  return atomic_load(&((fps_fake_replica_t *)f)->calls);
}

void fps_fake_replica_stop(fps_fake_replica_t *f) {
  if (!f) return;
  grpc_server_shutdown_and_notify(f->server, f->cq, &f->shutdown_tag);
  grpc_server_cancel_all_calls(f->server);
  pthread_join(f->th, NULL);
  grpc_server_destroy(f->server);
  grpc_completion_queue_destroy(f->cq);
  grpc_slice_unref(f->message);
  free(f);
  grpc_shutdown();
}

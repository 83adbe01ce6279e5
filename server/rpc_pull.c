/* Pull: current parameters and versions of named tensors, streamed.
 *
 * Every tensor's published parameters are referenced by the core
 * (fps_shard_snapshot: no copy, under its lock, briefly) before the first
 * message goes out, so the reply is all-or-nothing, shows each tensor at
 * one version, and a slow reader never holds a tensor lock. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "wire.h"

typedef struct fps_pull_call_s {
  fps_call_t base;
  fps_reply_t reply;
} fps_pull_call_t;

static void fps__pull_destroy(fps_call_t *c) {
  fps_pull_call_t *pc = (fps_pull_call_t *)c;
  fps_reply_free(&pc->reply);
  fps_free(pc);
}

/* Sends the next message of the reply (the final one carries OK). */
static void fps__pull_send_next(fps_pull_call_t *pc) {
  bool last = false;
  grpc_byte_buffer *bb = fps_reply_next(&pc->reply, pc->base.srv, &last);
  if (!bb) {
    fps_call_error(&pc->base, FPS_ENOMEM, "Pull: out of memory packing the reply");
    return;
  }
  /* A failed final send has released the call already: touch it only
   * after a failed intermediate one. */
  if (fps_call_send(&pc->base, bb, last) < 0 && !last)
    fps_call_error(&pc->base, FPS_EIO, "Pull: cannot send the reply");
}

static void fps__pull_on_batch(fps_call_t *c, bool ok) {
  fps_pull_call_t *pc = (fps_pull_call_t *)c;
  if (!ok) {
    fps_call_error(c, FPS_ECANCELLED, "Pull: the call ended while sending");
    return;
  }
  fps__pull_send_next(pc);
}

static void fps__pull_run(fps_pull_call_t *pc, const Factorps__V1__PullRequest *req) {
  fps_server_t *srv = pc->base.srv;
  char why[FPS_WHY_MAX];
  int rc = 0;
  int dtype = req->dtype == 0 ? FPS_DTYPE_F32 : (int)req->dtype;
  if (fps_dtype_size(dtype) == 0) {
    fps_call_error(&pc->base, FPS_EINVAL,
                   "Pull: unsupported dtype %d (supported: DTYPE_F32 = 1, DTYPE_BF16 = 2)", (int)req->dtype);
    return;
  }
  /* Each name at most once, as GetState: otherwise a request of a few KiB
   * naming one big tensor many times is answered with many copies. */
  if ((rc = fps_wire_names_check("Pull", req->names, req->n_names, why, sizeof why)) < 0) {
    fps_call_error(&pc->base, rc, "%s", why);
    return;
  }
  pc->reply.pull = true;
  pc->reply.items = fps_calloc(req->n_names ? req->n_names : 1, sizeof *pc->reply.items);
  if (!pc->reply.items) {
    fps_call_error(&pc->base, FPS_ENOMEM, "Pull: out of memory");
    return;
  }
  for (size_t i = 0; i < req->n_names && rc == 0; i++) {
    const char *name = req->names[i] ? req->names[i] : "";
    fps_reply_item_t *it = &pc->reply.items[pc->reply.n];
    if ((rc = fps_shard_snapshot(srv->shard, name, &it->t, &it->snap, why, sizeof why)) < 0) break;
    it->version = fps_snap_version(it->snap);
    it->dtype = dtype;
    pc->reply.n++;
  }
  if (rc < 0) {
    fps_reply_free(&pc->reply);
    fps_call_error(&pc->base, rc, "%s", why);
    return;
  }
  fps__pull_send_next(pc);
}

void fps_rpc_pull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                        grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__PullRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_pull_call_t),
      fps__pull_destroy, fps__pull_on_batch, "Pull", &factorps__v1__pull_request__descriptor, &c, &held);
  if (!req) return;
  fps__pull_run((fps_pull_call_t *)c, req);
  fps_wire_request_free(&srv->decode, &req->base, held);
}

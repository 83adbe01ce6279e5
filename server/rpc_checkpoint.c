/* Checkpoint: writes a durable checkpoint now (unary). The write runs on
 * the poller thread that received the call: it holds no tensor lock while
 * hashing and writing (see checkpoint.c), so other pollers keep serving
 * pushes; a concurrent periodic checkpoint is waited for, not duplicated in
 * parallel (srv->ckpt_mu). */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "checkpoint.h"
#include "wire.h"

typedef struct fps_ckpt_call_s {
  fps_call_t base;
} fps_ckpt_call_t;

/* CheckpointResponse beyond its path's directory: the file name (at most
 * 64 bytes), tags, lengths and four varints / doubles. */
#define FPS_CKPT_REPLY_EXTRA 128

static void fps__ckpt_call_destroy(fps_call_t *c) { fps_free(c); }

static void fps__ckpt_call_run(fps_ckpt_call_t *cc) {
  fps_server_t *srv = cc->base.srv;
  if (!*srv->cfg.checkpoint_dir) {
    fps_call_fail(&cc->base, GRPC_STATUS_FAILED_PRECONDITION,
                  "Checkpoint: shard %u was started without --checkpoint-dir", srv->cfg.shard_id);
    return;
  }
  if (atomic_load(&srv->shutting_down)) {
    fps_call_fail(&cc->base, GRPC_STATUS_UNAVAILABLE,
                  "Checkpoint: shard is shutting down (it writes a checkpoint on its way out)");
    return;
  }
  /* The reply's bytes, reserved before the checkpoint is written: its path
   * (the directory plus a file name) and four numbers. */
  size_t reply_cap = strlen(srv->cfg.checkpoint_dir) + FPS_CKPT_REPLY_EXTRA;
  uint8_t *reply_buf = fps_malloc(reply_cap);
  if (!reply_buf) {
    fps_call_fail(&cc->base, GRPC_STATUS_RESOURCE_EXHAUSTED, "Checkpoint: out of memory for the reply");
    return;
  }
  fps_ckpt_done_t done;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_checkpoint_write(srv->shard, &done, why, sizeof why);
  if (rc < 0) {
    fps_free(reply_buf);
    grpc_status_code code = rc == FPS_ENOMEM      ? GRPC_STATUS_RESOURCE_EXHAUSTED
                            : rc == FPS_EAGAIN    ? GRPC_STATUS_UNAVAILABLE
                            : rc == FPS_ENOTFOUND ? GRPC_STATUS_FAILED_PRECONDITION
                                                  : GRPC_STATUS_INTERNAL;
    fps_call_fail(&cc->base, code, "Checkpoint into %s failed: %s (%s)", srv->cfg.checkpoint_dir, why,
                  fps_strerror(rc));
    return;
  }
  Factorps__V1__CheckpointResponse resp = FACTORPS__V1__CHECKPOINT_RESPONSE__INIT;
  resp.path = done.path;
  resp.sequence = done.seq;
  resp.bytes = done.bytes;
  resp.tensors = done.tensors;
  resp.seconds = done.seconds;
  grpc_byte_buffer *bb = fps_pack_message_into(&resp, reply_buf, reply_cap);
  if (!bb) {
    fps_free(reply_buf);
    fps_call_fail(&cc->base, GRPC_STATUS_INTERNAL, "Checkpoint: the reply outgrew its %zu reserved bytes (%s written)",
                  reply_cap, done.path);
  } else {
    fps_call_send(&cc->base, bb, true); /* final: on failure the call is already released */
  }
}

void fps_rpc_checkpoint_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                              grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  Factorps__V1__CheckpointRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_ckpt_call_t),
      fps__ckpt_call_destroy, NULL, "Checkpoint", &factorps__v1__checkpoint_request__descriptor, &c);
  if (!req) return;
  fps__ckpt_call_run((fps_ckpt_call_t *)c);
  protobuf_c_message_free_unpacked(&req->base, &fps_wire_allocator);
}

/* Checkpoint: writes a durable checkpoint now (unary), on a thread of its
 * own. Writing takes from milliseconds to a minute (hashing and fsync of
 * the whole shard); on the poller that received the call it held that
 * poller, and a dozen concurrent calls held every poller, so Stats and
 * pushes waited behind them. The handler only queues the call;
 * the writer thread takes every call queued so far and serves them with
 * ONE write that starts after all of them arrived, so each caller gets a
 * checkpoint holding every update acknowledged before its call, and N
 * concurrent calls cost one write, not N. The write itself is
 * fps_checkpoint_write (serialised with the periodic one by the shard's
 * checkpoint lock). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "checkpoint.h"
#include "wire.h"

typedef struct fps_ckpt_call_s {
  fps_call_t base;
  uint8_t *reply_buf;             /* reserved before anything is written */
  size_t reply_cap;
  struct fps_ckpt_call_s *next;   /* the queue (fps_ckpt_queue_t.mu) */
} fps_ckpt_call_t;

/* The calls waiting for the next write, and the thread that writes. */
struct fps_ckpt_queue_s {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  fps_ckpt_call_t *head, **tail;  /* in arrival order (mu) */
  bool stop;                      /* (mu) */
  pthread_t th;
};

/* CheckpointResponse beyond its path's directory: the file name (at most
 * 64 bytes), tags, lengths and four varints / doubles. */
#define FPS_CKPT_REPLY_EXTRA 128

static void fps__ckpt_call_destroy(fps_call_t *c) {
  fps_free(((fps_ckpt_call_t *)c)->reply_buf);
  fps_free(c);
}

/* Answers one call with the write's outcome. */
static void fps__ckpt_answer(fps_ckpt_call_t *cc, int rc, const fps_ckpt_done_t *done, const char *why) {
  fps_server_t *srv = cc->base.srv;
  if (rc < 0) {
    /* Memory and a busy writer are worth a retry; no initialised tensor
     * (FPS_ENOTFOUND) is the caller's state to change, not a missing
     * thing; any other failure is the shard's own. */
    int err = rc == FPS_ENOMEM || rc == FPS_EAGAIN ? rc : rc == FPS_ENOTFOUND ? FPS_ESTATE : FPS_EINTERNAL;
    fps_call_error(&cc->base, err, "Checkpoint into %s failed: %s (%s)", srv->cfg.checkpoint_dir, why,
                   fps_strerror(rc));
    return;
  }
  Factorps__V1__CheckpointResponse resp = FACTORPS__V1__CHECKPOINT_RESPONSE__INIT;
  resp.path = (char *)done->path;
  resp.sequence = done->seq;
  resp.bytes = done->bytes;
  resp.tensors = done->tensors;
  resp.seconds = done->seconds;
  grpc_byte_buffer *bb = fps_pack_message_into(&resp, cc->reply_buf, cc->reply_cap);
  if (!bb) {
    fps_call_error(&cc->base, FPS_EINTERNAL, "Checkpoint: the reply outgrew its %zu reserved bytes (%s written)",
                   cc->reply_cap, done->path);
    return;
  }
  cc->reply_buf = NULL; /* the byte buffer's now */
  fps_call_send(&cc->base, bb, true); /* final: on failure the call is already released */
}

static void *fps__ckpt_writer(void *arg) {
  fps_server_t *srv = arg;
  fps_ckpt_queue_t *q = srv->ckpt_q;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->stop && !q->head) pthread_cond_wait(&q->cv, &q->mu);
    if (!q->head) break; /* stopping, nothing left */
    fps_ckpt_call_t *batch = q->head;
    q->head = NULL;
    q->tail = &q->head;
    bool stopping = q->stop;
    pthread_mutex_unlock(&q->mu);
    fps_ckpt_done_t done;
    memset(&done, 0, sizeof done);
    char why[FPS_CKPT_WHY_MAX] = "";
    /* Shutting down: the final checkpoint (main.c) comes after gRPC. */
    bool refused = stopping || atomic_load(&srv->shutting_down);
    int rc = refused ? 0 : fps_checkpoint_write(srv->shard, &done, why, sizeof why);
    while (batch) {
      fps_ckpt_call_t *next = batch->next;
      if (refused)
        fps_call_error(&batch->base, FPS_EUNAVAILABLE,
                       "Checkpoint: shard is shutting down (it writes a checkpoint on its way out)");
      else
        fps__ckpt_answer(batch, rc, &done, why);
      batch = next;
    }
    pthread_mutex_lock(&q->mu);
  }
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

int fps_rpc_checkpoint_init(fps_server_t *srv) {
  if (!*srv->cfg.checkpoint_dir) return 0; /* every call is refused, no thread needed */
  fps_ckpt_queue_t *q = fps_calloc(1, sizeof *q);
  if (!q) return FPS_ENOMEM;
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->cv, NULL);
  q->tail = &q->head;
  srv->ckpt_q = q;
  if (pthread_create(&q->th, NULL, fps__ckpt_writer, srv) != 0) {
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
    fps_free(q);
    srv->ckpt_q = NULL;
    return FPS_ENOMEM;
  }
  return 0;
}

void fps_rpc_checkpoint_stop(fps_server_t *srv) {
  fps_ckpt_queue_t *q = srv->ckpt_q;
  if (!q) return;
  pthread_mutex_lock(&q->mu);
  q->stop = true;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->mu);
  pthread_join(q->th, NULL); /* it fails whatever is still queued */
  pthread_cond_destroy(&q->cv);
  pthread_mutex_destroy(&q->mu);
  fps_free(q);
  srv->ckpt_q = NULL;
}

void fps_rpc_checkpoint_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                              grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__CheckpointRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_ckpt_call_t),
      fps__ckpt_call_destroy, NULL, "Checkpoint", &factorps__v1__checkpoint_request__descriptor, &c, &held);
  if (!req) return;
  fps_wire_request_free(&srv->decode, &req->base, held);
  fps_ckpt_call_t *cc = (fps_ckpt_call_t *)c;
  if (!*srv->cfg.checkpoint_dir) {
    fps_call_error(c, FPS_ESTATE, "Checkpoint: shard %u was started without --checkpoint-dir", srv->cfg.shard_id);
    return;
  }
  if (atomic_load(&srv->shutting_down) || !srv->ckpt_q) {
    fps_call_error(c, FPS_EUNAVAILABLE, "Checkpoint: shard is shutting down (it writes a checkpoint on its way out)");
    return;
  }
  /* The reply's bytes, reserved before the checkpoint is written: its path
   * (the directory plus a file name) and four numbers. */
  cc->reply_cap = strlen(srv->cfg.checkpoint_dir) + FPS_CKPT_REPLY_EXTRA;
  if (!(cc->reply_buf = fps_malloc(cc->reply_cap))) {
    fps_call_error(c, FPS_ENOMEM, "Checkpoint: out of memory for the reply");
    return;
  }
  fps_ckpt_queue_t *q = srv->ckpt_q;
  pthread_mutex_lock(&q->mu);
  cc->next = NULL;
  *q->tail = cc;
  q->tail = &cc->next;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->mu);
}

/* fps_client_checkpoint(): a Checkpoint call to every shard in parallel.
 * Retried on UNAVAILABLE: a shard that restarts mid-call has either not
 * written the file or written it durably, and one more checkpoint is
 * harmless. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

typedef struct ckpt_shard_s {
  fps__stream_t s;
  Factorps__V1__CheckpointResponse *resp; /* owned */
} ckpt_shard_t;

static int ckpt_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  (void)s;
  Factorps__V1__CheckpointRequest req = FACTORPS__V1__CHECKPOINT_REQUEST__INIT;
  *out = fps__pack(&req);
  *last = 1;
  return 0;
}

static int ckpt_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  ckpt_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__checkpoint_response__free_unpacked(sh->resp, &fps__pb_allocator);
  int code;
  sh->resp = fps__unpack(&factorps__v1__checkpoint_response__descriptor, data, len, &code);
  if (!sh->resp) return fps__stream_fail(s, code, "%s CheckpointResponse", fps__unpack_why(code));
  return 0;
}

static void ckpt_reset(fps__stream_t *s) {
  ckpt_shard_t *sh = s->ctx;
  if (sh->resp) factorps__v1__checkpoint_response__free_unpacked(sh->resp, &fps__pb_allocator);
  sh->resp = NULL;
}

static const fps__stream_ops_t ckpt_ops = {ckpt_next, ckpt_reply, ckpt_reset, NULL};

int fps_client_checkpoint(fps_client_t *c, fps_checkpoint_info_t *out, size_t n, fps_status_t *status) {
  if (!c) return fps__status_err(status, FPS_EINVAL, -1, "client is NULL");
  if (out ? n != c->n_shards : n != 0)
    return fps__status_err(status, FPS_EINVAL, -1,
                           "out has %zu entries, the client has %zu shards (out NULL needs n 0)", n,
                           c->n_shards);
  ckpt_shard_t *sh = fps_calloc(c->n_shards, sizeof *sh);
  fps__stream_t **run = fps_calloc(c->n_shards, sizeof *run);
  int rc;
  if (!sh || !run) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < c->n_shards; i++) {
    sh[i].s.shard = (int)i;
    sh[i].s.ops = &ckpt_ops;
    sh[i].s.ctx = &sh[i];
    run[i] = &sh[i].s;
  }
  rc = fps__streams_run(c, FPS__METHOD_CHECKPOINT, run, c->n_shards, FPS__RETRY_IDEMPOTENT, status);
  for (size_t i = 0; !rc && i < c->n_shards; i++)
    if (!sh[i].resp)
      rc = fps__status_set(status, FPS_CODE_DATA_LOSS, (int)i, "shard %zu (%s): no CheckpointResponse", i,
                           c->addrs[i]);
  if (rc) goto out;
  for (size_t i = 0; out && i < n; i++) {
    const Factorps__V1__CheckpointResponse *r = sh[i].resp;
    memset(&out[i], 0, sizeof out[i]);
    snprintf(out[i].path, sizeof out[i].path, "%s", r->path ? r->path : "");
    out[i].sequence = r->sequence;
    out[i].bytes = r->bytes;
    out[i].tensors = r->tensors;
    out[i].seconds = r->seconds;
  }
  fps__status_ok(status);
out:
  for (size_t i = 0; sh && i < c->n_shards; i++)
    if (sh[i].resp) factorps__v1__checkpoint_response__free_unpacked(sh[i].resp, &fps__pb_allocator);
  fps_free(sh);
  fps_free(run);
  return rc;
}

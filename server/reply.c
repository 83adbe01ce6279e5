/* Streams tensors back to a client: each message carries slices of one or
 * more tensors (small tensors share a message) up to FPS_REPLY_BUDGET bytes
 * of payload; the last message carries every tensor's version.
 *
 * Data comes from refcounted snapshots, never from the live tensor, so a
 * slow reader holds no lock and always sees one consistent version. A
 * message is a gRPC byte buffer of slices that reference the snapshot:
 * the protobuf framing (common/wire_codec.h) in one small buffer, cut into
 * a slice before each payload, and each fp32 payload as a slice over the
 * snapshot's own memory (grpc_slice_new_with_user_data) holding a
 * snapshot reference that its destroy callback drops, on whichever thread
 * gRPC releases it. No byte of an fp32 reply is copied in user space. A
 * bf16 payload is a slice over the snapshot's one shared bf16 encoding
 * (shard/snap_bf16.c: converted by the first reply that needs it and used
 * by all that send the snapshot meanwhile, the W of a sync round), holding
 * a reference to the encoding the same way; the reply itself holds one
 * until it is freed, so the encoding outlives the gaps between its
 * messages. Only when the encoding cannot be had (the staging limit, out
 * of memory, another reply is converting it) does a reply convert its own
 * payload, one pass into a buffer gRPC owns. */
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "alloc.h"
#include "metrics.h"
#include "tsan.h"
#include "wire.h"

void fps_reply_free(fps_reply_t *r) {
  for (size_t i = 0; i < r->n; i++) {
    fps_snap_bf16_unref(r->items[i].bf16);
    fps_snap_unref(r->items[i].snap);
  }
  fps_free(r->items);
  memset(r, 0, sizeof *r);
}

/* gRPC is done with a payload slice: its snapshot reference goes. */
static void fps__reply_slice_released(void *snap) {
  FPS_TSAN_ACQUIRE(snap); /* gRPC may drop the slice on any thread */
  fps_snap_unref(snap);
}

/* gRPC is done with a slice over a shared bf16 encoding. */
static void fps__reply_bf16_released(void *enc) {
  FPS_TSAN_ACQUIRE(enc); /* gRPC may drop the slice on any thread */
  fps_snap_bf16_unref(enc);
}

/* gRPC is done with a buffer of ours (framing, a bf16 payload). */
static void fps__reply_buf_free(void *p, size_t len) {
  FPS_TSAN_ACQUIRE(p); /* gRPC may drop the slice on any thread */
  (void)len;
  fps_free(p);
}

/* One run of a tensor's elements in the message being built. */
typedef struct fps_reply_run_s {
  fps_reply_item_t *it;
  uint64_t off, cnt;
  uint8_t *own;               /* bf16 without it->bf16: this run's conversion */
} fps_reply_run_t;

grpc_byte_buffer *fps_reply_next(fps_reply_t *r, fps_server_t *srv, bool *last) {
  /* Enough runs to fill a message with tensors of ~1 KiB. */
  enum { MAX_RUNS = 4096 };
  fps_reply_run_t *runs = fps_malloc(MAX_RUNS * sizeof *runs);
  grpc_slice *sl = NULL;
  size_t ns = 0, n_sl = 0, budget = FPS_REPLY_BUDGET, hdr_cap = 0;
  grpc_byte_buffer *bb = NULL;
  uint64_t payload = 0;
  *last = false;
  if (!runs) return NULL;

  /* Plan: runs until the budget or the items run out. A per-run overhead
   * estimate keeps many tiny tensors from overshooting. */
  size_t cur = r->cur;
  uint64_t off = r->off;
  while (cur < r->n && ns < MAX_RUNS) {
    fps_reply_item_t *it = &r->items[cur];
    if (!it->snap || fps_snap_numel(it->snap) == 0 || off >= fps_snap_numel(it->snap)) {
      cur++;
      off = 0;
      continue;
    }
    size_t esz = fps_dtype_size(it->dtype);
    size_t name_len = strlen(fps_tensor_name(it->t));
    size_t overhead = name_len + 16 + 11 * FPS_MAX_DIMS + 32;
    if (budget < overhead + esz) break;
    uint64_t can = (budget - overhead) / esz;
    uint64_t left = fps_snap_numel(it->snap) - off;
    uint64_t cnt = left < can ? left : can;
    runs[ns++] = (fps_reply_run_t){it, off, cnt, NULL};
    hdr_cap += FPS_WIRE_SLICE_HEADER_MAX(name_len, fps_tensor_shape(it->t)->ndim);
    payload += cnt * esz;
    budget -= overhead + cnt * esz;
    off += cnt;
    if (off >= fps_snap_numel(it->snap)) {
      cur++;
      off = 0;
    }
  }
  *last = cur >= r->n;
  if (*last && ns > 0) {
    /* The versions must fit beside the data, or they go alone in one more
     * message (they cannot be split: the contract puts them all in the
     * last one). */
    size_t vbytes = 16;
    for (size_t i = 0; i < r->n; i++) vbytes += strlen(fps_tensor_name(r->items[i].t)) + 16;
    if (vbytes > budget) *last = false;
  }
  if (*last)
    for (size_t i = 0; i < r->n; i++) hdr_cap += FPS_WIRE_VERSION_MAX(strlen(fps_tensor_name(r->items[i].t)));

  /* Encode: per run its framing, then its payload; the versions last. */
  sl = fps_malloc((2 * ns + 1) * sizeof *sl);
  uint8_t *h = fps_malloc(hdr_cap ? hdr_cap : 1);
  if (!sl || !h) {
    fps_free(h);
    goto fail;
  }
  /* The bf16 payloads first: a conversion of its own, for a run whose
   * snapshot has no shared encoding, is the only step left that can fail. */
  for (size_t i = 0; i < ns; i++) {
    fps_reply_run_t *run = &runs[i];
    if (run->it->dtype == FPS_DTYPE_F32) continue;
    if (run->it->dtype == FPS_DTYPE_BF16 && !run->it->bf16)
      run->it->bf16 = fps_snap_bf16_get(srv->shard, run->it->snap);
    if (run->it->bf16) continue;
    if (!(run->own = fps_malloc((size_t)run->cnt * fps_dtype_size(run->it->dtype)))) {
      for (size_t j = 0; j < i; j++) fps_free(runs[j].own);
      fps_free(h);
      goto fail;
    }
    fps_dtype_encode(run->it->dtype, fps_snap_data(run->it->snap) + run->off, run->cnt, run->own);
  }
  grpc_slice hdr = grpc_slice_new_with_len(h, hdr_cap, fps__reply_buf_free);
  size_t hn = 0, mark = 0;
  for (size_t i = 0; i < ns; i++) {
    const fps_reply_run_t *run = &runs[i];
    const fps_tensor_t *t = run->it->t;
    fps_snap_t *snap = run->it->snap;
    size_t bytes = (size_t)run->cnt * fps_dtype_size(run->it->dtype);
    const char *name = fps_tensor_name(t);
    const fps_shape_t *shape = fps_tensor_shape(t);
    hn += fps_wire_slice_header(h + hn, 1, name, strlen(name), run->it->dtype, shape->ndim, shape->dim, run->off,
                                bytes);
    sl[n_sl++] = grpc_slice_sub(hdr, mark, hn);
    mark = hn;
    if (run->it->dtype == FPS_DTYPE_F32) {
      /* fp32 goes to the socket from the snapshot itself. */
      fps_snap_ref(snap);
      FPS_TSAN_RELEASE(snap);
      sl[n_sl++] = grpc_slice_new_with_user_data((void *)(fps_snap_data(snap) + run->off), bytes, fps__reply_slice_released, snap);
    } else if (run->it->bf16) {
      /* bf16 from the snapshot's shared encoding. */
      fps_snap_bf16_t *enc = run->it->bf16;
      fps_snap_bf16_ref(enc);
      FPS_TSAN_RELEASE(enc);
      sl[n_sl++] = grpc_slice_new_with_user_data((void *)(fps_snap_bf16_data(enc) + run->off * 2), bytes,
                                                 fps__reply_bf16_released, enc);
    } else {
      FPS_TSAN_RELEASE(run->own);
      sl[n_sl++] = grpc_slice_new_with_len(run->own, bytes, fps__reply_buf_free);
    }
  }
  if (*last)
    for (size_t i = 0; i < r->n; i++)
      hn += fps_wire_version(h + hn, 2, fps_tensor_name(r->items[i].t), strlen(fps_tensor_name(r->items[i].t)), r->items[i].version);
  if (mark < hn || n_sl == 0) sl[n_sl++] = grpc_slice_sub(hdr, mark, hn);
  /* After the last write into h (the versions above): gRPC may free it
   * on another thread from here on. */
  FPS_TSAN_RELEASE(h);
  bb = grpc_raw_byte_buffer_create(sl, n_sl);
  for (size_t i = 0; i < n_sl; i++) grpc_slice_unref(sl[i]);
  grpc_slice_unref(hdr);
  r->cur = cur;
  r->off = off;
  fps_metrics_rpc_bytes(r->pull ? FPS_METRICS_PULL : FPS_METRICS_PUSHPULL, 0, payload);
  if (*last) r->done = true;
fail:
  fps_free(runs);
  fps_free(sl);
  return bb;
}

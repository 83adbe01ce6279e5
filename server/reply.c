/* Streams tensors back to a client: each message packs slices of one or
 * more tensors (small tensors share a message) up to FPS_REPLY_BUDGET bytes
 * of payload; the last message carries every tensor's version.
 *
 * Data comes from refcounted snapshots, never from the live tensor, so a
 * slow reader holds no lock and always sees one consistent version. The
 * encode into the message buffer is the only copy per message: the packed
 * buffer becomes the gRPC slice without another. */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "wire.h"

void fps_reply_free(fps_reply_t *r) {
  for (size_t i = 0; i < r->n; i++) fps_snap_unref(r->items[i].snap);
  fps_free(r->items);
  memset(r, 0, sizeof *r);
}

grpc_byte_buffer *fps_reply_next(fps_reply_t *r, fps_server_t *srv, bool *last) {
  /* Enough slices to fill a message with tensors of ~1 KiB. */
  enum { MAX_SLICES = 4096 };
  struct fps_slice_scratch_s {
    Factorps__V1__TensorSlice sl;
    uint64_t shape[FPS_MAX_DIMS];
    uint8_t *enc;
  } *sc = NULL;
  Factorps__V1__TensorSlice **slp = NULL;
  size_t ns = 0, budget = FPS_REPLY_BUDGET;
  grpc_byte_buffer *bb = NULL;
  Factorps__V1__TensorVersion *vers = NULL, **versp = NULL;
  uint64_t payload = 0;
  *last = false;
  sc = fps_malloc(MAX_SLICES * sizeof *sc);
  slp = fps_malloc(MAX_SLICES * sizeof *slp);
  if (!sc || !slp) goto fail;

  /* Fill slices until the budget or the items run out. A per-slice
   * overhead estimate keeps many tiny tensors from overshooting. */
  while (r->cur < r->n && ns < MAX_SLICES) {
    fps_reply_item_t *it = &r->items[r->cur];
    if (!it->snap || it->snap->numel == 0 || r->off >= it->snap->numel) {
      r->cur++;
      r->off = 0;
      continue;
    }
    size_t esz = fps_dtype_size(it->dtype);
    size_t overhead = strlen(it->t->name) + 16 + 11 * FPS_MAX_DIMS + 32;
    if (budget < overhead + esz) break;
    uint64_t can = (budget - overhead) / esz;
    uint64_t left = it->snap->numel - r->off;
    uint64_t cnt = left < can ? left : can;
    uint8_t *data;
    if (it->dtype == FPS_DTYPE_F32) {
      /* fp32 goes straight from the snapshot into the packed message. */
      data = (uint8_t *)(it->snap->data + r->off);
      sc[ns].enc = NULL;
    } else {
      data = fps_malloc(cnt * esz);
      if (!data) goto fail;
      fps_dtype_encode(it->dtype, it->snap->data + r->off, cnt, data);
      sc[ns].enc = data;
    }
    factorps__v1__tensor_slice__init(&sc[ns].sl);
    sc[ns].sl.name = it->t->name;
    sc[ns].sl.dtype = (Factorps__V1__DType)it->dtype;
    sc[ns].sl.n_shape = it->t->shape.ndim;
    for (uint32_t d = 0; d < it->t->shape.ndim; d++) sc[ns].shape[d] = it->t->shape.dim[d];
    sc[ns].sl.shape = sc[ns].shape;
    sc[ns].sl.offset = r->off;
    sc[ns].sl.data.data = data;
    sc[ns].sl.data.len = cnt * esz;
    slp[ns] = &sc[ns].sl;
    ns++;
    payload += cnt * esz;
    budget -= overhead + cnt * esz;
    r->off += cnt;
    if (r->off >= it->snap->numel) {
      r->cur++;
      r->off = 0;
    }
  }
  *last = r->cur >= r->n;
  if (*last && ns > 0) {
    /* The versions must fit beside the data, or they go alone in one more
     * message (they cannot be split: the contract puts them all in the
     * last one). */
    size_t vbytes = 16;
    for (size_t i = 0; i < r->n; i++) vbytes += strlen(r->items[i].t->name) + 16;
    if (vbytes > budget) *last = false;
  }
  if (*last) {
    vers = fps_calloc(r->n ? r->n : 1, sizeof *vers);
    versp = fps_calloc(r->n ? r->n : 1, sizeof *versp);
    if (!vers || !versp) goto fail;
    for (size_t i = 0; i < r->n; i++) {
      factorps__v1__tensor_version__init(&vers[i]);
      vers[i].name = r->items[i].t->name;
      vers[i].version = r->items[i].version;
      versp[i] = &vers[i];
    }
  }
  if (r->pull) {
    Factorps__V1__PullResponse m = FACTORPS__V1__PULL_RESPONSE__INIT;
    m.n_params = ns;
    m.params = slp;
    m.n_versions = *last ? r->n : 0;
    m.versions = versp;
    bb = fps_pack_message(&m);
  } else {
    Factorps__V1__PushPullResponse m = FACTORPS__V1__PUSH_PULL_RESPONSE__INIT;
    m.n_params = ns;
    m.params = slp;
    m.n_versions = *last ? r->n : 0;
    m.versions = versp;
    bb = fps_pack_message(&m);
  }
  if (bb) atomic_fetch_add(&srv->shard.counters.bytes_sent, payload);
  if (bb) fps_metrics_rpc_bytes(r->pull ? FPS_METRICS_PULL : FPS_METRICS_PUSHPULL, 0, payload);
fail:
  for (size_t i = 0; i < ns; i++) fps_free(sc[i].enc);
  fps_free(sc);
  fps_free(slp);
  fps_free(vers);
  fps_free(versp);
  if (*last && bb) r->done = true;
  return bb;
}

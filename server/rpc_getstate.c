/* GetState: the optimizer state of named tensors, streamed (see
 * GetStateRequest in the proto).
 *
 * Every tensor's state is copied (under its lock, at one version: the core's
 * fps_tensor_state_snap) before the first message goes out, so the reply is
 * all-or-nothing and a slow reader holds no lock. Messages carry slices of
 * the arrays up to FPS_REPLY_BUDGET bytes; the last one carries every
 * tensor's TensorState. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "metrics.h"
#include "status.h"
#include "wire.h"

typedef struct fps_getstate_call_s {
  fps_call_t base;
  fps_state_snap_t *snap;     /* one per named tensor */
  size_t n;
  size_t cur;                 /* next tensor to send */
  int kind;                   /* next kind of snap[cur] */
  uint64_t off;               /* next element of that kind */
} fps_getstate_call_t;

static const Factorps__V1__StateKind fps__kind_wire[FPS_STATE_KINDS] = {
    FACTORPS__V1__STATE_KIND__STATE_ROW, FACTORPS__V1__STATE_KIND__STATE_COL,
    FACTORPS__V1__STATE_KIND__STATE_VAR, FACTORPS__V1__STATE_KIND__STATE_MOM};

static void fps__getstate_destroy(fps_call_t *c) {
  fps_getstate_call_t *gc = (fps_getstate_call_t *)c;
  for (size_t i = 0; i < gc->n; i++) fps_state_snap_release(c->srv->shard, &gc->snap[i]);
  fps_free(gc->snap);
  fps_free(gc);
}

/* Packs the next message; *last when it carries the TensorStates. */
static grpc_byte_buffer *fps__getstate_next(fps_getstate_call_t *gc, bool *last) {
  enum { MAX_SLICES = 4096 };
  Factorps__V1__StateSlice *sl = fps_calloc(MAX_SLICES, sizeof *sl);
  Factorps__V1__StateSlice **slp = fps_calloc(MAX_SLICES, sizeof *slp);
  Factorps__V1__TensorState *ts = NULL, **tsp = NULL;
  grpc_byte_buffer *bb = NULL;
  size_t ns = 0, budget = FPS_REPLY_BUDGET;
  uint64_t payload = 0;
  *last = false;
  if (!sl || !slp) goto out;
  while (gc->cur < gc->n && ns < MAX_SLICES) {
    fps_state_snap_t *s = &gc->snap[gc->cur];
    if (gc->kind >= FPS_STATE_KINDS) {
      gc->cur++;
      gc->kind = 0;
      gc->off = 0;
      continue;
    }
    if (gc->off >= s->n[gc->kind]) {
      gc->kind++;
      gc->off = 0;
      continue;
    }
    size_t overhead = strlen(fps_tensor_name(s->t)) + 40;
    if (budget < overhead + 4) break;
    uint64_t can = (budget - overhead) / 4, left = s->n[gc->kind] - gc->off;
    uint64_t cnt = left < can ? left : can;
    factorps__v1__state_slice__init(&sl[ns]);
    sl[ns].name = (char *)fps_tensor_name(s->t);
    sl[ns].kind = fps__kind_wire[gc->kind];
    sl[ns].offset = gc->off;
    sl[ns].data.data = (uint8_t *)(fps_state_snap_array(s, gc->kind) + gc->off); /* LE host */
    sl[ns].data.len = cnt * 4;
    slp[ns] = &sl[ns];
    ns++;
    payload += cnt * 4;
    budget -= overhead + cnt * 4;
    gc->off += cnt;
  }
  *last = gc->cur >= gc->n;
  if (*last) {
    size_t need = 16;
    for (size_t i = 0; i < gc->n; i++) need += strlen(fps_tensor_name(gc->snap[i].t)) + 120;
    if (ns > 0 && need > budget) *last = false; /* the TensorStates go alone, next */
  }
  if (*last) {
    ts = fps_calloc(gc->n ? gc->n : 1, sizeof *ts);
    tsp = fps_calloc(gc->n ? gc->n : 1, sizeof *tsp);
    if (!ts || !tsp) goto out;
    for (size_t i = 0; i < gc->n; i++) {
      const fps_state_snap_t *s = &gc->snap[i];
      factorps__v1__tensor_state__init(&ts[i]);
      ts[i].name = (char *)fps_tensor_name(s->t);
      ts[i].version = s->version;
      ts[i].step = s->step;
      ts[i].rms = s->rms;
      ts[i].row_elements = s->n[FPS_STATE_ROW];
      ts[i].col_elements = s->n[FPS_STATE_COL];
      ts[i].var_elements = s->n[FPS_STATE_VAR];
      ts[i].mom_elements = s->n[FPS_STATE_MOM];
      ts[i].lr = s->lr;
      ts[i].weight_decay = s->weight_decay;
      tsp[i] = &ts[i];
    }
  }
  Factorps__V1__GetStateResponse m = FACTORPS__V1__GET_STATE_RESPONSE__INIT;
  m.n_slices = ns;
  m.slices = slp;
  m.n_tensors = *last ? gc->n : 0;
  m.tensors = tsp;
  bb = fps_pack_message(&m);
  if (bb) fps_metrics_rpc_bytes(FPS_METRICS_GETSTATE, 0, payload);
out:
  fps_free(sl);
  fps_free(slp);
  fps_free(ts);
  fps_free(tsp);
  return bb;
}

static void fps__getstate_send_next(fps_getstate_call_t *gc) {
  bool last = false;
  grpc_byte_buffer *bb = fps__getstate_next(gc, &last);
  if (!bb) {
    fps_call_error(&gc->base, FPS_ENOMEM, "GetState: out of memory packing the reply");
    return;
  }
  /* A failed final send has released the call already. */
  if (fps_call_send(&gc->base, bb, last) < 0 && !last)
    fps_call_error(&gc->base, FPS_EIO, "GetState: cannot send the reply");
}

static void fps__getstate_on_batch(fps_call_t *c, bool ok) {
  if (!ok) {
    fps_call_error(c, FPS_ECANCELLED, "GetState: the call ended while sending");
    return;
  }
  fps__getstate_send_next((fps_getstate_call_t *)c);
}

static void fps__getstate_run(fps_getstate_call_t *gc, const Factorps__V1__GetStateRequest *req) {
  fps_server_t *srv = gc->base.srv;
  char why[FPS_WHY_MAX];
  size_t n = req->n_names;
  gc->snap = fps_calloc(n ? n : 1, sizeof *gc->snap);
  if (!gc->snap) {
    fps_call_error(&gc->base, FPS_ENOMEM, "GetState: out of memory for %zu tensors", n);
    return;
  }
  int rc = fps_wire_names_check("GetState", req->names, n, why, sizeof why);
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = fps_shard_state_snap(srv->shard, req->names[i], &gc->snap[i], why, sizeof why);
    if (rc == 0) gc->n = i + 1;
  }
  if (rc < 0) {
    fps_call_error(&gc->base, rc, "%s", why); /* the snapshots go with the call */
    return;
  }
  fps__getstate_send_next(gc);
}

void fps_rpc_getstate_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, grpc_metadata_array *md,
                            grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__GetStateRequest *req = fps_call_start_unary(
      srv, call, deadline, md, payload, sizeof(fps_getstate_call_t), fps__getstate_destroy, fps__getstate_on_batch,
      "GetState", &factorps__v1__get_state_request__descriptor, &c, &held);
  if (!req) return;
  fps__getstate_run((fps_getstate_call_t *)c, req);
  fps_wire_request_free(&srv->decode, &req->base, held);
}

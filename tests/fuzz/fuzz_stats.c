/* libFuzzer target: a StatsRequest through the shard's real Stats handler
 * (server/rpc_stats.c: decode, per-tensor figures, apply-log limits). One
 * async push to "w" first, through the real PushPull path, so the apply
 * log has a record to report. */
#include <stdlib.h>
#include <string.h>

#include "factorps/v1/factorps.pb-c.h"
#include "fuzz_server.h"

static void push_w(fps_server_t *srv) {
  float g[12];
  for (int i = 0; i < 12; i++) g[i] = 0.1f * (float)(i - 6);
  uint64_t shape[2] = {4, 3};
  Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT;
  Factorps__V1__TensorSlice *sp = &s;
  s.name = "w";
  s.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  s.n_shape = 2;
  s.shape = shape;
  s.data.data = (uint8_t *)g;
  s.data.len = sizeof g;
  Factorps__V1__PushPullRequest m = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  m.n_grads = 1;
  m.grads = &sp;
  size_t len;
  uint8_t *buf = fz_pack(&m, &len);
  fz_call_t *c = fz_call_start(srv, FZ_PUSHPULL, NULL, 0, false);
  fz_call_send(c, buf, len);
  fz_call_half_close(c);
  free(buf);
  if (fz_call_status(c) != GRPC_STATUS_OK) abort();
  fz_call_finish(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  push_w(srv);
  fz_call_finish(fz_call_start(srv, FZ_STATS, data, size, true));
  fz_server_free(srv);
  return 0;
}

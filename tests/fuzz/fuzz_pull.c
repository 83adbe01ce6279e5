/* libFuzzer target: a PullRequest through the shard's real Pull handler
 * (server/rpc_pull.c: decode, dtype, names, lookup, readiness, snapshots,
 * the size-bounded reply stream), against the fixture tensors: "w" and "b"
 * are ready, "half" is still initialising. */
#include "fuzz_server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  fz_call_finish(fz_call_start(srv, FZ_PULL, data, size, true));
  fz_server_free(srv);
  return 0;
}

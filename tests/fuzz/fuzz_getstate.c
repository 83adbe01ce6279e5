/* libFuzzer target: a GetStateRequest through the shard's real GetState
 * handler (server/rpc_getstate.c: decode, names, duplicates, lookup,
 * readiness, state snapshots, the size-bounded reply stream), against the
 * fixture tensors: "w" (hf, factored) and "b" (torch, 1-D) are ready,
 * "half" is still initialising. */
#include "fuzz_server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  fz_call_finish(fz_call_start(srv, FZ_GETSTATE, data, size, true));
  fz_server_free(srv);
  return 0;
}

/* libFuzzer target: a CheckpointRequest through the shard's real Checkpoint
 * handler (server/rpc_checkpoint.c). The message has no fields, so what is
 * fuzzed is its decoding (unknown fields, truncation) and the answer of a
 * shard started without --checkpoint-dir; writing checkpoints is covered by
 * the checkpoint tests, reading them by fuzz_checkpoint. */
#include "fuzz_server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  fz_call_finish(fz_call_start(srv, FZ_CHECKPOINT, data, size, true));
  fz_server_free(srv);
  return 0;
}

/* libFuzzer target: a CreateRequest, from its bytes through the shard's
 * real Create handler (server/rpc_create.c: protobuf-c decode, names,
 * shapes, optimizer settings, init slices, limits, the store), on a shard
 * that already holds the fixture tensors, so the "already exists"
 * comparisons run too. The same request is sent twice: the second time
 * exercises the idempotent path (existing tensors, ignored init values). */
#include <stdlib.h>

#include "fuzz_server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  for (int round = 0; round < 2; round++) {
    fz_call_t *c = fz_call_start(srv, FZ_CREATE, data, size, true);
    fz_call_finish(c);
  }
  fz_server_free(srv);
  return 0;
}

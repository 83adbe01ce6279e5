/* libFuzzer target: a CreateRequest, from its bytes through the shard's
 * real Create handler (server/rpc_create.c: protobuf-c decode, names,
 * shapes, optimizer settings, init slices, limits, the store), on a shard
 * that already holds the fixture tensors, so the "already exists"
 * comparisons run too, first on a single async shard, then on shard 0 of
 * 2 in sync mode with peers (so SplitBlock maps reach the block store).
 * The same request is sent twice: the second time
 * exercises the idempotent path (existing tensors, ignored init values). */
#include <stdlib.h>

#include "fuzz_server.h"

/* Create never sends to a peer; a send would be a bug. */
static int no_send(void *ctx, uint32_t to, const fps_xmsg_t *m, int64_t deadline_ns, fps_xsend_done_fn done,
                   void *arg) {
  (void)ctx, (void)to, (void)m, (void)deadline_ns, (void)done, (void)arg;
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* An async single shard, then shard 0 of 2 in sync mode with peers,
   * where SplitBlock maps get past the mode and --peers checks and become
   * row blocks. */
  for (int kind = 0; kind < 2; kind++) {
    fps_server_t *srv = kind == 0 ? fz_server_new(FPS_MODE_ASYNC, 1, 0)
                                  : fz_server_new_peer(FPS_MODE_SYNC, 1, 0, 2, no_send, NULL);
    for (int round = 0; round < 2; round++) {
      fz_call_t *c = fz_call_start(srv, FZ_CREATE, data, size, true);
      fz_call_finish(c);
    }
    fz_server_free(srv);
  }
  return 0;
}

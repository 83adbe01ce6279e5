/* libFuzzer target: PushPull streams through the shard's real handler
 * (server/rpc_pushpull.c: per-message decode and validation, staging,
 * overlap and coverage checks, then sync rounds / ssp waits / async apply,
 * the Adafactor step, the reply stream, cancellation), up to three calls
 * at once so sync rounds can fill, stall and be withdrawn.
 *
 * Input: one config byte, then operations:
 *   config: mode = 1 + (b & 3) % 3 (sync, async, ssp),
 *           workers = 1 + (b >> 2 & 3) % 3, staleness = (b >> 4 & 3) % 3,
 *           bit 6: a CreateRequest chunk (u16 LE length, then the message)
 *           follows and is sent first, so streams can push to tensors of
 *           any shape the fuzzer creates, not only the fixture's
 *   op byte: call = (op >> 2) % 3; op & 3: 0 or 3 = a message (u16 LE
 *           length, then a PushPullRequest), 1 = half-close, 2 = cancel
 * A slot whose call has ended starts a new call on its next operation. At
 * the end every open call half-closes, and whatever still waits (a sync
 * round short of workers, a parked ssp call) is cancelled, as a client
 * giving up would. */
#include "fuzz_server.h"

#define NCALLS 3

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in_t in = {data, size};
  uint8_t cfg = fz_byte(&in);
  fps_server_t *srv = fz_server_new(1 + (cfg & 3) % 3, 1 + (cfg >> 2 & 3) % 3, (cfg >> 4 & 3) % 3);
  const uint8_t *p;
  size_t len;
  if ((cfg & 0x40) && fz_chunk(&in, &p, &len)) fz_call_finish(fz_call_start(srv, FZ_CREATE, p, len, true));
  fz_call_t *calls[NCALLS] = {0};
  while (in.n) {
    uint8_t op = fz_byte(&in);
    int k = (op >> 2) % NCALLS;
    if (calls[k] && fz_call_ended(calls[k])) {
      fz_call_finish(calls[k]);
      calls[k] = NULL;
    }
    if (!calls[k]) calls[k] = fz_call_start(srv, FZ_PUSHPULL, NULL, 0, false);
    switch (op & 3) {
      case 1: fz_call_half_close(calls[k]); break;
      case 2: fz_call_cancel(calls[k]); break;
      default:
        if (fz_chunk(&in, &p, &len)) fz_call_send(calls[k], p, len);
        break;
    }
  }
  for (int k = 0; k < NCALLS; k++)
    if (calls[k]) fz_call_half_close(calls[k]);
  for (int k = 0; k < NCALLS; k++)
    if (calls[k]) {
      fz_call_cancel(calls[k]);
      fz_call_finish(calls[k]);
    }
  fz_server_free(srv);
  return 0;
}

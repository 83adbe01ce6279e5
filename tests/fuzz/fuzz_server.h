/* Shared harness of the gRPC-side fuzz targets (fuzz_create, fuzz_pull,
 * fuzz_stats, fuzz_pushpull, fuzz_ckpt_rpc, fuzz_getstate, fuzz_exchange,
 * fuzz_replicate).
 *
 * The targets drive the shard's real request path: the method entry points
 * of server/rpc_*.c, the call base of server/grpc_server.c, wire.c's
 * validation, the store, sync rounds, ssp waits, the Adafactor step and the
 * reply packer, all linked unchanged. Only the transport is replaced:
 * fake_grpc.c defines the four gRPC call functions the server uses on a
 * call (grpc_call_start_batch, grpc_call_cancel, grpc_call_cancel_with_status,
 * grpc_call_unref). A definition in the executable takes precedence over
 * libgrpc's, so the server's calls land in the fake, which records what
 * the server sends and completes its batches from a queue that the harness
 * drains on one thread, in a fixed order: every input replays the same way.
 *
 * Oracles besides the sanitizers (each aborts): every reply message must
 * decode as the method's response type, every call must end with exactly
 * one status, and every call must be released (grpc_call_unref) once.
 * With FPS_FUZZ_CHECK_FINITE=1 in the environment, a tensor holding a NaN
 * or Inf weight at the end of an input aborts too (off by default: see
 * crashes/README.md for the open finding it reports). */
#ifndef FPS_FUZZ_SERVER_H
#define FPS_FUZZ_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server.h"
#include "shard/internal.h"

typedef enum fz_method_e {
  FZ_CREATE, FZ_PUSHPULL, FZ_PULL, FZ_STATS, FZ_CHECKPOINT, FZ_GETSTATE, FZ_EXCHANGE, FZ_REPLICATE
} fz_method_t;

typedef struct fz_call_s fz_call_t;

/* A fresh shard (store, counters, kernels) with the given consistency mode,
 * small limits (so no input can make it allocate much) and the fixture
 * tensors created through the real Create path:
 *   "w"    [4, 3] hf (factored), ready
 *   "b"    [3]    torch, ready
 *   "half" [2, 2] torch, only elements [0, 2) initialised (not ready)
 * Aborts if the fixture cannot be built. */
fps_server_t *fz_server_new(int mode, uint32_t workers, uint32_t staleness);
/* The same shard as shard `shard_id` of `shard_count` (the fixture tensors
 * are its own), with `send` installed as its Exchange sender, so that it
 * accepts row blocks of split tensors (sync mode only). */
fps_server_t *fz_server_new_peer(int mode, uint32_t workers, uint32_t shard_id, uint32_t shard_count,
                                 fps_xsend_fn send, void *ctx);
/* The same shard as a standby replica (--replica-peer, a file lease that
 * is never acquired: no lease thread runs), so that it takes Replicate
 * streams. The primary's sending side (replica_send.c) is not linked
 * into the fuzz targets: a standby never sends, and fuzz_server.c's
 * stand-ins abort if anything tries to. */
fps_server_t *fz_server_new_standby(int mode, uint32_t workers);
void fz_server_free(fps_server_t *srv);

/* Starts a call of method m. For the unary methods, request holds the
 * message bytes (NULL: no message at all); the call runs to its end before
 * this returns. For PushPull and Replicate, request must be NULL: feed
 * them with fz_call_send / fz_call_half_close / fz_call_cancel. */
fz_call_t *fz_call_start(fps_server_t *srv, fz_method_t m, const uint8_t *request, size_t len, bool has_request);
/* Client side of a stream: one message, the half-close, a cancel (client
 * gone or deadline). Ignored once the call has ended, or while the server
 * is not reading (as a real transport would hold the message back). */
void fz_call_send(fz_call_t *c, const uint8_t *msg, size_t len);
void fz_call_half_close(fz_call_t *c);
void fz_call_cancel(fz_call_t *c);
/* Completes queued batches until nothing is left to run. */
void fz_drain(void);
/* True once the server sent the status (or the call was cancelled). */
bool fz_call_ended(const fz_call_t *c);
/* The status the server sent (GRPC_STATUS_OK...), -1 if none yet. */
int fz_call_status(const fz_call_t *c);
/* Checks that the call ended and was released, then frees the record. */
void fz_call_finish(fz_call_t *c);

/* Packs a protobuf-c message into a malloc'd buffer. */
uint8_t *fz_pack(const void *protobuf_c_message, size_t *len);
/* Starts a PushPull call carrying the one message msg (a protobuf-c
 * PushPullRequest), half-closed; it may wait (a sync round, an exchange). */
fz_call_t *fz_push_one(fps_server_t *srv, const void *msg);
/* Runs unary method m with request msg (a protobuf-c message) to its end;
 * aborts, naming `what`, unless it answered OK. */
void fz_unary_ok(fps_server_t *srv, fz_method_t m, const void *msg, const char *what);

/* Input helpers: a reader over the fuzz input. */
typedef struct fz_in_s {
  const uint8_t *p;
  size_t n;
} fz_in_t;
uint8_t fz_byte(fz_in_t *in);          /* 0 when exhausted */
/* Next length-prefixed chunk (u16 little-endian length, clipped to what is
 * left). False when the input is exhausted. */
bool fz_chunk(fz_in_t *in, const uint8_t **p, size_t *len);

/* Writes DIR/NAME as the targets that take a flags byte and messages
 * read it (fz_chunk): flags, then each message's u16 LE length and bytes.
 * 0, or -1 if the file cannot be written. */
int fz_write_seed(const char *dir, const char *name, uint8_t flags, uint8_t *const *msgs, const size_t *lens,
                  size_t n);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif

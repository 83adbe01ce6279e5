/* factorps shard metrics: a process-wide registry of counters, gauges and
 * histograms, rendered in the Prometheus text format (0.0.4), and the HTTP
 * endpoint that serves it together with /healthz and /readyz.
 *
 * How the server uses it (all of it is optional; nothing here blocks):
 *
 *   fps_metrics_config_t mc = {.shard_id = id, .shard_count = n, .mode = "sync",
 *                              .workers = w, .simd = "avx2"};
 *   fps_metrics_init(&mc);                          // once, before any thread
 *   fps_metrics_http_opts_t ho = {.listen = "0.0.0.0:9150"};
 *   fps_metrics_http_t *http;
 *   fps_metrics_http_start(&ho, &http);            // own thread + libuv loop
 *   ... grpc port bound, state loaded:  fps_metrics_ready_set(true);
 *   ... after every RPC:       fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, code, secs, 0, 0);
 *   ... payload in/out:        fps_metrics_rpc_bytes(FPS_METRICS_PUSHPULL, rx, tx);
 *   ... after every update:    fps_metrics_update_observe(secs, bytes_moved);
 *   ... a PushPull answered:   fps_metrics_push_observe(ok, secs)
 *   ... Stats:                 fps_metrics_totals(&t)
 *   ... a tensor registered:   fps_metrics_state_add_tensor(numel, &size)
 *   ... sync/ssp:              fps_metrics_step_observe / _staleness_observe / _waiting_add
 *   ... checkpoints:           fps_metrics_restore_set (start-up), then per write
 *                              fps_metrics_checkpoint_mark + _written or _failed
 *   fps_metrics_ready_set(false); fps_metrics_http_stop(http);
 *
 * server/main.c, grpc_server.c, sync.c, shard/store.c, rpc_create.c,
 * rpc_pushpull.c, reply.c and checkpoint.c make exactly these calls (grep fps_metrics_).
 *
 * Hot-path calls (the *_observe, *_add and *_set functions) are lock-free:
 * relaxed atomic adds on static storage, no allocation, no syscalls, safe
 * from any thread. The scrape renders from those atomics on the HTTP thread,
 * so a slow or hostile HTTP client can never stall an RPC.
 *
 * Every series carries the label shard="<shard_id>". The registry is one per
 * process because a factorps-server process is exactly one shard. */
#ifndef FPS_METRICS_H
#define FPS_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "methods.h"

/* RPC methods with their own series (label method="<name>"): the one
 * method list (common/methods.h), the gRPC method name as the label. */
typedef enum fps_metrics_method_e {
#define FPS_METRICS_METHOD_ENUM(id, name, handler, role, streaming) FPS_METRICS_##id = FPS_METHOD_##id,
  FPS_METHOD_MAP(FPS_METRICS_METHOD_ENUM)
#undef FPS_METRICS_METHOD_ENUM
  FPS_METRICS_METHOD_COUNT = FPS_METHOD_COUNT
} fps_metrics_method_t;

/* Optimizer-state kinds (label kind="<name>"). */
#define FPS_METRICS_KIND_MAP(X)                                            \
  X(ROW, "row")                                                            \
  X(COL, "col")                                                            \
  X(VAR, "var")                                                            \
  X(MOM, "momentum")

/* Why a checkpoint write failed (label reason="<name>"): no_space (ENOSPC
 * or EDQUOT), io (any other I/O error), no_memory, no_directory (the
 * checkpoint directory vanished), busy (another writer holds it), other. */
#define FPS_METRICS_CKPT_REASON_MAP(X)                                     \
  X(NO_SPACE, "no_space")                                                  \
  X(IO, "io")                                                              \
  X(NO_MEMORY, "no_memory")                                                \
  X(NO_DIRECTORY, "no_directory")                                          \
  X(BUSY, "busy")                                                          \
  X(OTHER, "other")

typedef enum fps_metrics_ckpt_reason_e {
#define FPS_METRICS_REASON_ENUM(id, label) FPS_METRICS_CKPT_##id,
  FPS_METRICS_CKPT_REASON_MAP(FPS_METRICS_REASON_ENUM)
#undef FPS_METRICS_REASON_ENUM
  FPS_METRICS_CKPT_REASON_COUNT
} fps_metrics_ckpt_reason_t;

/* What start-up did with --checkpoint-dir (label outcome="<name>"):
 * disabled (no --checkpoint-dir), empty (the directory held no valid
 * checkpoint: started with no tensors), restored, refused (the shard exits:
 * --require-checkpoint without a valid checkpoint, unreadable directory,
 * checkpoint over the limits). */
#define FPS_METRICS_RESTORE_MAP(X)                                         \
  X(DISABLED, "disabled")                                                  \
  X(EMPTY, "empty")                                                        \
  X(RESTORED, "restored")                                                  \
  X(REFUSED, "refused")

typedef enum fps_metrics_restore_e {
#define FPS_METRICS_RESTORE_ENUM(id, label) FPS_METRICS_RESTORE_##id,
  FPS_METRICS_RESTORE_MAP(FPS_METRICS_RESTORE_ENUM)
#undef FPS_METRICS_RESTORE_ENUM
  FPS_METRICS_RESTORE_COUNT
} fps_metrics_restore_t;

/* The shard's state totals. Element counts, not bytes: bytes are derived
 * (4 per fp32 element) when rendering. */
typedef struct fps_metrics_state_s {
  uint64_t tensors;         /* tensors registered on the shard */
  uint64_t param_elements;  /* sum of numel */
  uint64_t row, col, var, mom;  /* optimizer state elements by kind */
  uint64_t adamw_elements;  /* what AdamW would keep: 2 * numel */
  uint64_t split_blocks;    /* of the tensors, row blocks of split tensors */
  uint64_t split_elements;  /* their elements (part of param_elements) */
} fps_metrics_state_t;

/* Static facts about the shard, exposed as labels/gauges. Strings are copied
 * (truncated to 63 bytes); NULL means "unknown". */
typedef struct fps_metrics_config_s {
  uint32_t shard_id;        /* value of the shard="" label on every series */
  uint32_t shard_count;
  const char *mode;         /* "sync", "async", "ssp" */
  uint32_t workers;         /* sync/ssp: workers per step */
  uint32_t staleness;       /* ssp: bound on how far a worker may run ahead */
  const char *simd;         /* kernel variant in use: "scalar", "avx2", "avx512", "neon" */
  const char *version;      /* NULL: the version this library was built as */
  double checkpoint_interval; /* seconds between periodic checkpoints (0: none) */
} fps_metrics_config_t;

/* Sets the static facts and zeroes every counter, gauge and histogram.
 * Returns 0, or FPS_EINVAL for a NULL config.
 * REQUIRES: no other thread is using the registry (call it at start-up). */
int fps_metrics_init(const fps_metrics_config_t *cfg);

/* One finished RPC: `method` is a FPS_METRICS_* value, `grpc_code` a
 * grpc_status_code value (0 OK .. 16 UNAUTHENTICATED; anything else counts
 * as UNKNOWN), `seconds` its wall time from the first message to the status,
 * `rx_bytes`/`tx_bytes` the tensor payload bytes received and sent.
 * An out-of-range method is ignored. Lock-free, any thread. */
void fps_metrics_rpc_observe(fps_metrics_method_t method, int grpc_code, double seconds,
                             uint64_t rx_bytes, uint64_t tx_bytes);

/* Tensor payload bytes as they flow (a long PushPull stream shows up
 * progressively): received from and sent to the client of `method`.
 * Lock-free, any thread; an out-of-range method is ignored. */
void fps_metrics_rpc_bytes(fps_metrics_method_t method, uint64_t rx_bytes, uint64_t tx_bytes);

/* The method for a gRPC method name, "PushPull" or the full path
 * "/factorps.v1.ParameterServer/PushPull"; -1 when it is not one of ours. */
int fps_metrics_method_from_name(const char *name);

/* One Adafactor update of one tensor: time inside the kernel and the bytes
 * it moved (its own count: reads + writes). GB/s is derived from the two
 * counters (factorps_update_bytes_total / factorps_update_duration_seconds_sum).
 * Lock-free, any thread. */
void fps_metrics_update_observe(double seconds, uint64_t bytes);

/* A PushPull's push: answered in full (ok: its seconds from the first
 * message to the last reply message) or refused/failed by the shard. Any
 * thread; ok takes a short lock for the window of recent latencies. */
void fps_metrics_push_observe(bool ok, double seconds);

/* The counters Stats shows, read from the registry (the one store of
 * counters: nothing else keeps a copy). Any thread. */
#define FPS_METRICS_RECENT_PUSHES 1024 /* pushes behind Stats' p50 and p99 */
typedef struct fps_metrics_totals_s {
  uint64_t pushes, push_errors;       /* push_duration's count; push_errors */
  double push_seconds_sum;
  double push_seconds_p50, push_seconds_p99; /* of the recent pushes, 0: none */
  uint64_t updates, update_bytes;     /* update_duration's count; update_bytes */
  double update_seconds_sum;
  uint64_t bytes_received, bytes_sent; /* tensor payload, every method */
  uint64_t xbytes_sent, xbytes_received, xsteps, xfailures; /* the exchange */
  double xseconds_sum;
} fps_metrics_totals_t;
void fps_metrics_totals(fps_metrics_totals_t *out);

/* sync: one round completed (one tensor's step: the gradients of all
 * `waited_for` workers averaged and applied); `wait_seconds` is how long its
 * first member waited for the last. Lock-free, any thread. */
void fps_metrics_step_observe(uint32_t waited_for, double wait_seconds);
/* Split tensors (the shard core's xstep.c): bytes of partial sums sent
 * (acknowledged by the peer) and accepted; one step's exchange completed
 * (ok: its seconds from sending our partials to having every block's) or
 * failed. Lock-free, any thread. */
void fps_metrics_exchange_bytes(uint64_t sent, uint64_t received);
void fps_metrics_exchange_observe(bool ok, double seconds);
/* A split block moved to the version its shards agreed on (xrecover.c),
 * undoing lost_steps updates (0: it moved forward). */
void fps_metrics_split_recovered(uint64_t lost_steps);
/* ssp: a push admitted `staleness` steps ahead of the slowest worker. */
void fps_metrics_staleness_observe(uint64_t staleness);
/* Gauge of what waits for other workers now: in sync, tensor gradients
 * sitting in open rounds (a call pushing 3 tensors counts 3); in ssp,
 * parked PushPull calls. Moves it by delta (+1 park, -1 leave). */
void fps_metrics_waiting_add(int delta);

/* Adds to the shard's state totals (a new tensor's or block's figures:
 * tensors are never deleted, so totals only grow). NULL is ignored. */
void fps_metrics_state_add(const fps_metrics_state_t *delta);
/* Adds one new tensor: numel elements with optimizer state `size` (from
 * fps_adafactor_state_size()). NULL size is ignored. */
void fps_metrics_state_add_tensor(uint64_t numel, const fps_state_size_t *size);

/* Checkpoints. Start-up: _restore_set once, with the restored checkpoint's
 * sequence, its creation time (unix seconds; it also becomes the last
 * successful checkpoint's time and sequence) and the restore's duration
 * (0s for other outcomes). Until called the outcome is "disabled".
 * Every write: _mark before the first tensor is copied (it returns the
 * number of tensor updates applied so far), then _written with that mark on
 * success or _failed with the reason. factorps_checkpoint_unsaved_updates is
 * the updates applied since the mark of the last successful write: at most
 * what a crash now would lose. Lock-free, any thread. */
void fps_metrics_restore_set(fps_metrics_restore_t outcome, uint64_t seq, double created_unix,
                             double seconds);
uint64_t fps_metrics_checkpoint_mark(void);
void fps_metrics_checkpoint_written(uint64_t seq, double unix_time, double seconds, uint64_t bytes,
                                    uint64_t mark);
void fps_metrics_checkpoint_failed(fps_metrics_ckpt_reason_t reason);
/* A checkpoint file the shard could not load was moved aside at start-up. */
void fps_metrics_checkpoint_set_aside(void);

/* Readiness (/readyz): true once the state is loaded and the gRPC port is
 * bound; false again while shutting down. Default false. */
void fps_metrics_ready_set(bool ready);
bool fps_metrics_ready_get(void);

/* Standby replicas (server/replica.h): the role (0 solo, 1 primary, 2
 * standby), term, joined flag and promotions of this process; bytes and
 * ops sent on the Replicate stream; messages not yet acknowledged; the
 * state checksum (set by the scrape's collect hook). Lock-free. */
void fps_metrics_replica_set(int role, uint64_t term, bool joined, uint64_t failovers);
void fps_metrics_replication_sent(uint64_t bytes, uint64_t ops);
void fps_metrics_replication_lag_set(uint64_t ops);
void fps_metrics_state_checksum_set(uint64_t sum);
/* A promotion over a lease that said the previous primary answered alone. */
void fps_metrics_replica_unclean_promotion(void);

/* Renders every series into a new NUL-terminated buffer in text format
 * 0.0.4, including the process_* series read from /proc.
 * Returns 0 and sets *out (caller frees with fps_free()) and *len, or
 * FPS_ENOMEM. Thread-safe (reads atomics only). */
int fps_metrics_render(char **out, size_t *len);

/* ------------------------------------------------------------- HTTP */

typedef struct fps_metrics_http_s fps_metrics_http_t;

typedef struct fps_metrics_http_opts_s {
  /* "host:port", "[v6]:port" or ":port" (all IPv4 interfaces). Port 0 picks
   * a free port (see fps_metrics_http_port). Required. */
  const char *listen;
  /* Optional: called on the HTTP thread before each /metrics render.
   * Must not block for long. */
  void (*collect)(void *arg);
  /* Optional: /readyz asks this instead of the fps_metrics_ready_set() flag. */
  bool (*ready)(void *arg);
  void *arg;                       /* passed to collect and ready */
  /* Open at once; 0: 128. At the limit a new connection evicts the oldest
   * one not writing an answer, so probes are never starved. */
  unsigned max_connections;
  unsigned request_timeout_ms;     /* whole request, from accept; 0: 5000. Then 408 */
  unsigned max_header_bytes;       /* request line + headers; 0: 8192. Then 431 */
  unsigned max_body_bytes;         /* declared body; 0: 1024. Then 413 */
  /* Optional: written with the bound port and a newline once listening
   * (temporary file + rename, so a reader never sees a partial number). */
  const char *port_file;
} fps_metrics_http_opts_t;

/* Binds the listening socket (in the caller's thread, so a bad address or a
 * port in use is reported here) and starts the libuv loop thread.
 * Returns 0 and sets *out, or FPS_EINVAL (bad address), FPS_EIO (bind or
 * listen failed; the reason is logged to stderr), FPS_ENOMEM.
 * Destroy with fps_metrics_http_stop(). */
int fps_metrics_http_start(const fps_metrics_http_opts_t *opts, fps_metrics_http_t **out);

/* The bound TCP port (useful with port 0). */
int fps_metrics_http_port(const fps_metrics_http_t *h);

/* Stops the loop (uv_async_send), closes every connection and the listener,
 * joins the thread and frees everything. NULL is a no-op.
 * REQUIRES: not called from the HTTP thread (i.e. not from a callback). */
void fps_metrics_http_stop(fps_metrics_http_t *h);

#endif

/* factorps-server: the one map of the shard process (after redis server.h).
 *
 * A shard keeps named fp32 tensors with their Adafactor state and serves
 * factorps.v1.ParameterServer over gRPC (C core). Pieces, one file each:
 *
 *   main.c          start-up, signal thread, orderly shutdown
 *   config.c        fps_config_t and its table (flags, FACTORPS_* env, --help)
 *   ranges.c        sorted interval sets (slice coverage and overlap checks)
 *   tensor_store.c  the name -> tensor map, tensor lifetime, apply + log
 *   sync.c          sync rounds, ssp waits and their expiry hook
 *   clock.c         fps_now_ns(): the monotonic clock of every deadline
 *   timer.c         the deadline thread: runs the hooks modules register
 *   status.c        the one FPS_E* -> gRPC status table
 *   grpc_server.c   completion queue, poller threads, request slots and the
 *                   per-call base state machine (send/recv/status helpers)
 *   wire.c          proto <-> internal helpers shared by the handlers
 *   reply.c         streams tensor snapshots back as size-bounded messages
 *   rpc_create.c rpc_pushpull.c rpc_pull.c rpc_stats.c rpc_checkpoint.c
 *                   the methods
 *   checkpoint.c    durable checkpoints: restore at start-up, snapshots
 *                   written on the RPC, every interval and on SIGTERM
 *
 * Threads: T pollers run grpc_completion_queue_next() and every handler
 * step (handlers never sleep: a sync round or an ssp wait parks its call and
 * whoever completes the round resumes it); one timer thread (timer.c) runs
 * the hooks that expire rounds, ssp waits and calls past their deadline;
 * one signal thread turns
 * SIGTERM/SIGINT into a shutdown.
 *
 * Locks, in acquisition order (never the reverse): store->mu (rwlock) ->
 * tensor->mu -> srv->ssp_mu -> call->mu -> srv->calls_mu. Rounds are
 * completed with the tensor lock held only to collect their members; calls
 * are resumed after it is released. */
#ifndef FPS_SERVER_H
#define FPS_SERVER_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

#include "adafactor.h"
#include "clock.h"
#include "dtype.h"
#include "error.h"
#include "status.h"
#include "timer.h"

#define FPS_NAME_MAX 256                 /* bytes of UTF-8 in a tensor name */
/* Payload budget of one reply message: a little under gRPC's default 4 MiB
 * receive limit, so a client that never raised its limit still works. */
#define FPS_REPLY_BUDGET ((size_t)4 * 1024 * 1024 - 4096)
#define FPS_LATENCY_RING 1024            /* recent pushes kept for p50/p99 */
/* Tensors at least this big are updated on the kernel pool; smaller ones on
 * the calling poller thread (the pool runs one job at a time, and many small
 * tensors already spread over the pollers). */
#define FPS_POOL_MIN_NUMEL (UINT64_C(1) << 22)

/* ------------------------------------------------------------ logging */

typedef enum fps_log_level_e { FPS_LOG_ERROR = 0, FPS_LOG_WARN, FPS_LOG_INFO, FPS_LOG_DEBUG } fps_log_level_t;
extern int fps__log_level;
void fps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Checks the level before evaluating the arguments. */
#define FPS_SLOG(level, ...)                            \
  do {                                                  \
    if ((level) <= fps__log_level) fps__log(level, __VA_ARGS__); \
  } while (0)

/* ------------------------------------------------------------- config */

typedef enum fps_mode_e { FPS_MODE_SYNC = 1, FPS_MODE_ASYNC = 2, FPS_MODE_SSP = 3 } fps_mode_t;

typedef struct fps_config_s {
  char *listen;               /* host:port, port 0 picks a free one */
  uint32_t shard_id;          /* this shard's index */
  uint32_t shard_count;       /* shards in the job */
  int mode;                   /* fps_mode_t */
  uint32_t staleness;         /* ssp: max steps ahead of the slowest worker */
  uint32_t workers;           /* sync/ssp: number of workers W */
  double deadline;            /* seconds: default call deadline and sync round deadline */
  uint64_t max_message_bytes; /* gRPC receive limit per message */
  uint32_t threads;           /* completion-queue poller threads */
  char *port_file;            /* written with the bound port, or NULL */
  uint64_t max_tensors;       /* Create beyond this: RESOURCE_EXHAUSTED */
  uint64_t max_bytes;         /* parameter bytes beyond this: RESOURCE_EXHAUSTED */
  uint64_t max_staging_bytes; /* gradient staging + reply snapshots, all calls */
  uint32_t max_concurrent_calls; /* calls in progress; more: RESOURCE_EXHAUSTED */
  char *tls_cert;             /* PEM chain, "" = plaintext (auth.c) */
  char *tls_key;              /* PEM key of tls_cert */
  char *tls_client_ca;        /* PEM CA: client certificates required, "" = none */
  char *auth_token_file;      /* bearer tokens, one a line, "" = none */
  uint32_t apply_log;         /* per-tensor apply records kept for Stats */
  char *log_level;            /* error, warn, info, debug */
  char *simd;                 /* scalar|avx2|neon|auto */
  uint32_t kernel_threads;    /* pool size for large tensors' updates (0: CPUs) */
  int malloc_tune;            /* 1: one arena, no mmap threshold, no trim */
  char *metrics_listen;       /* HTTP /metrics /healthz /readyz host:port, "" = off */
  char *metrics_port_file;    /* written with the bound metrics port, or "" */
  char *checkpoint_dir;       /* durable checkpoints, "" = off */
  double checkpoint_interval; /* seconds between periodic checkpoints, 0 = off */
  uint32_t checkpoint_keep;   /* newest checkpoints kept */
  int require_checkpoint;     /* refuse to start without a loaded checkpoint */
} fps_config_t;

/* Fills defaults, then FACTORPS_* environment variables, then argv.
 * Returns 0; 1 if --help/--version was printed (exit 0); FPS_EINVAL with
 * the problem printed to stderr. Strings in *cfg are owned by cfg. */
int fps_config_load(fps_config_t *cfg, int argc, char **argv);
void fps_config_free(fps_config_t *cfg);
void fps_config_dump(const fps_config_t *cfg, void (*line)(const char *));
const char *fps_mode_name(int mode);

/* ------------------------------------------------------------- ranges */

/* Sorted, merged, non-overlapping half-open intervals [lo, hi). */
typedef struct fps_range_s {
  uint64_t lo, hi;
} fps_range_t;

typedef struct fps_ranges_s {
  fps_range_t *v;
  size_t n, cap;
  uint64_t covered;           /* sum of hi - lo */
} fps_ranges_t;

/* Adds [lo, hi). Returns 0, FPS_EEXISTS if it overlaps what is there
 * (nothing changes then), FPS_ENOMEM. An empty interval is a no-op. */
int fps_ranges_add(fps_ranges_t *r, uint64_t lo, uint64_t hi);
/* First gap in [0, total) or total if none (for "missing slice" messages). */
uint64_t fps_ranges_first_gap(const fps_ranges_t *r, uint64_t total);
int fps_ranges_copy(fps_ranges_t *dst, const fps_ranges_t *src);
void fps_ranges_free(fps_ranges_t *r);

/* ------------------------------------------------------ tensors, store */

typedef struct fps_server_s fps_server_t;
typedef struct fps_tensor_s fps_tensor_t;
typedef struct fps_push_entry_s fps_push_entry_t;

/* A refcounted fp32 copy of a tensor's parameters at one version: what a
 * reply streams from, so a slow reader never holds the tensor's lock. */
typedef struct fps_snap_s {
  atomic_int refs;
  fps_server_t *srv;          /* whose buffer accounting data counts in */
  float *data;                /* numel floats, owned */
  uint64_t numel;
  uint64_t version;
} fps_snap_t;

/* Takes ownership of data (from fps_tbuf_alloc). Returns NULL on OOM (data
 * freed). */
fps_snap_t *fps_snap_wrap(fps_server_t *srv, float *data, uint64_t numel, uint64_t version, int refs);

/* Tensor-sized transient buffers (gradient staging, reply snapshots) are
 * counted against --max-staging-bytes, so many concurrent calls cannot
 * exhaust memory. alloc returns NULL with *over_limit set when the limit
 * would be passed, or NULL on OOM. free(NULL) is a no-op. */
float *fps_tbuf_alloc(fps_server_t *srv, uint64_t numel, bool *over_limit);
void fps_tbuf_free(fps_server_t *srv, float *p, uint64_t numel);
void fps_snap_unref(fps_snap_t *s);

typedef struct fps_apply_rec_s {
  uint32_t worker_id;
  uint64_t step;
  uint64_t version;
  double lr;                  /* applied (hf relative_step: rel_t) */
  double weight_decay;        /* applied */
} fps_apply_rec_t;

/* The hyperparameters one update applies: the push's TensorPush values,
 * Create's where absent (push_settings.c). */
typedef struct fps_update_hp_s {
  double lr;
  double weight_decay;
} fps_update_hp_t;

/* The sync round of one tensor: at most one is open (its step equals the
 * tensor's version). */
typedef struct fps_round_s {
  bool open;
  uint64_t step;
  uint32_t joined;            /* members present */
  fps_push_entry_t **member;  /* [workers], by worker id, NULL = missing */
  int64_t started_ns;         /* first join */
  int64_t deadline_ns;        /* fails the round at this time */
} fps_round_t;

struct fps_tensor_s {
  char *name;                 /* NUL-terminated, <= FPS_NAME_MAX bytes */
  fps_shape_t shape;
  uint64_t numel;
  fps_adafactor_hparams_t hp;
  fps_state_size_t size;      /* optimizer state sizes (constant) */
  pthread_mutex_t mu;         /* guards everything below */
  float *param;               /* numel floats */
  fps_adafactor_state_t st;
  bool ready;                 /* every element initialised */
  fps_ranges_t init;          /* initialised ranges while !ready */
  uint64_t version;           /* updates applied */
  double last_lr;             /* lr of the last update (Create's before one) */
  double last_weight_decay;   /* weight decay of the last update */
  uint64_t restored_seq;      /* checkpoint it was restored from, 0: none */
  uint64_t restored_version;  /* its version in that checkpoint */
  fps_round_t round;          /* sync mode */
  fps_apply_rec_t *log;       /* ring of the last updates, log_cap slots */
  uint32_t log_cap, log_len, log_head;
  uint32_t log_max;           /* --apply-log: the ring grows up to this */
  fps_tensor_t *rprev, *rnext; /* srv open-round list (srv->rounds_mu) */
  bool in_rounds;             /* linked in the open-round list */
  fps_tensor_t *hnext;        /* hash chain (store->mu) */
  fps_tensor_t *next;         /* creation order (store->mu) */
};

typedef struct fps_store_s {
  pthread_rwlock_t mu;        /* map structure; tensors are never removed */
  fps_tensor_t **bucket;
  size_t nbucket;             /* power of two */
  uint64_t count;
  uint64_t param_bytes;
  fps_tensor_t *first, *last; /* creation order */
} fps_store_t;

int fps_store_init(fps_store_t *st);
void fps_store_destroy(fps_store_t *st);
/* Lookup; REQUIRES store->mu held (read or write). */
fps_tensor_t *fps__store_find_locked(fps_store_t *st, const char *name, size_t len);
/* Grows the table for n tensors, so that n inserts cannot fail.
 * REQUIRES store->mu held for writing. */
int fps__store_reserve_locked(fps_store_t *st, uint64_t n);
/* Inserts t (its name unique); REQUIRES store->mu held for writing. */
int fps__store_insert_locked(fps_store_t *st, fps_tensor_t *t);
/* Allocates a tensor (params uninitialised, state zeroed) or NULL on OOM. */
fps_tensor_t *fps_tensor_create(const char *name, size_t len, const fps_shape_t *shape,
                                uint64_t numel, const fps_adafactor_hparams_t *hp,
                                uint32_t workers, uint32_t log_cap);
void fps_tensor_destroy(fps_tensor_t *t);
/* One Adafactor step with grad (finite, numel floats) and the update's
 * hyperparameters uh (NULL: Create's), version+1, apply log, counters.
 * REQUIRES t->mu held. */
int fps__tensor_apply_locked(fps_server_t *srv, fps_tensor_t *t, const float *grad,
                             uint32_t worker_id, uint64_t step, const fps_update_hp_t *uh);
/* "[3, 5]" into buf. */
void fps_shape_format(const fps_shape_t *s, char *buf, size_t len);

/* -------------------------------------------------- gRPC call plumbing */

/* Every completion-queue tag starts with this: the poller calls fn. */
typedef struct fps_tag_s {
  void (*fn)(struct fps_tag_s *tag, bool ok);
} fps_tag_t;

typedef struct fps_call_s fps_call_t;

/* The base of every call: one batch in flight at a time (plus the
 * close-on-server op), refcounted by "logic" (until the status is sent)
 * and "close" (until RECV_CLOSE_ON_SERVER completes). */
struct fps_call_s {
  fps_tag_t batch_tag;        /* completion of the current batch */
  fps_tag_t close_tag;        /* completion of RECV_CLOSE_ON_SERVER */
  fps_tag_t status_tag;       /* completion of the batch that sent the status */
  fps_server_t *srv;
  grpc_call *call;
  const char *method;         /* for logs */
  pthread_mutex_t mu;         /* serialises start_batch and call state */
  atomic_int refs;
  int cancelled;              /* written by gRPC on close */
  bool closed;                /* close op completed */
  bool initial_md_sent;
  bool status_sent;           /* final batch started */
  atomic_bool cancel_requested; /* the timer already cancelled it (atomic: set
                                 * under calls_mu, read under mu) */
  bool metered;               /* counted in the metrics registry (once) */
  int64_t start_ns;
  int64_t deadline_ns;        /* min(client deadline, start + --deadline) */
  grpc_metadata_array md;     /* request metadata (owned) */
  grpc_byte_buffer *recv_buf; /* RECV_MESSAGE target / initial payload */
  grpc_slice status_details;
  /* Method hooks: next step after a batch (ok == false: the call is dead),
   * cancel notice, destructor of the derived object. */
  void (*on_batch)(fps_call_t *c, bool ok);
  void (*on_cancel)(fps_call_t *c);
  void (*destroy)(fps_call_t *c);
  fps_call_t *prev, *next;    /* srv->calls list */
};

/* Initialises the base and posts RECV_CLOSE_ON_SERVER. Takes ownership of
 * call and md. Returns 0 or a negative FPS_E*; on failure the caller frees c's
 * derived parts and the base is already released. */
int fps_call_begin(fps_call_t *c, fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                   grpc_metadata_array *md, const char *method);
/* The start of every unary handler (Create, Pull, Stats, Checkpoint):
 * allocates the handler's call state (`size` bytes, fps_call_t first,
 * zeroed), begins the call and decodes the request with `desc`. Returns the
 * request (free it with protobuf_c_message_free_unpacked) and sets *out to
 * the call; on failure the call has been answered or cancelled and NULL is
 * returned. Takes ownership of call, md and payload in every case. */
void *fps_call_start_unary(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                           grpc_metadata_array *md, grpc_byte_buffer *payload, size_t size,
                           void (*destroy)(fps_call_t *), void (*on_batch)(fps_call_t *, bool),
                           const char *method, const ProtobufCMessageDescriptor *desc,
                           fps_call_t **out);
/* Starts RECV_MESSAGE into c->recv_buf; on_batch runs on completion. */
int fps_call_recv(fps_call_t *c);
/* Sends one message (ownership of msg passes); with final, OK status too.
 * A final send that fails releases the call's logic reference itself: the
 * caller must not touch c afterwards (a non-final failure leaves c to the
 * caller, who ends it with fps_call_fail). */
int fps_call_send(fps_call_t *c, grpc_byte_buffer *msg, bool final);
/* Ends the call with a non-OK status and a message; safe once per call. */
void fps_call_fail(fps_call_t *c, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void fps_call_failv(fps_call_t *c, grpc_status_code code, const char *fmt, va_list ap);
/* Packs a protobuf-c message into a byte buffer (no extra copy). */
grpc_byte_buffer *fps_pack_message(const void *protobuf_c_message);
/* Flattens a received byte buffer (one copy). Caller frees *out. */
int fps_bb_flatten(grpc_byte_buffer *bb, uint8_t **out, size_t *len);

/* ---------------------------------------------------------- the shard */

typedef struct fps_counters_s {
  atomic_uint_fast64_t pushes;
  atomic_uint_fast64_t push_errors;
  atomic_uint_fast64_t updates;
  atomic_uint_fast64_t bytes_received;
  atomic_uint_fast64_t bytes_sent;
  atomic_uint_fast64_t update_bytes;
  pthread_mutex_t mu;               /* the doubles and the latency ring */
  double push_seconds_sum;
  double update_seconds_sum;
  double latency[FPS_LATENCY_RING];
  uint32_t latency_n, latency_head;
} fps_counters_t;

/* An ssp call waiting for the slowest worker (embedded in the call). */
typedef struct fps_ssp_wait_s {
  struct fps_pp_call_s *pp;
  uint32_t worker_id;
  uint64_t step;
  int64_t deadline_ns;
  bool parked;                      /* linked (srv->ssp_mu) */
  struct fps_ssp_wait_s *prev, *next;
} fps_ssp_wait_t;

struct fps_server_s {
  fps_config_t cfg;
  const fps_kernels_t *kernels;
  fps_pool_t *pool;                 /* splits large tensors' updates; NULL: none */
  atomic_uint_fast64_t tbuf_bytes;  /* bytes in fps_tbuf_alloc buffers */
  fps_store_t store;
  fps_counters_t counters;
  int64_t started_ns;
  grpc_server *server;
  grpc_completion_queue *cq;
  void *method[5];                  /* registered method handles */
  int port;
  atomic_bool shutting_down;
  /* Active calls, for deadline enforcement and shutdown. */
  pthread_mutex_t calls_mu;
  fps_call_t *calls;
  uint64_t ncalls;
  /* ssp: per-worker completed pushes and the parked calls. */
  pthread_mutex_t ssp_mu;
  uint64_t *ssp_clock;              /* [workers] */
  fps_ssp_wait_t *ssp_waits;
  /* Tensors with an open sync round (for the timer). */
  pthread_mutex_t rounds_mu;
  fps_tensor_t *rounds;
  fps_timer_t *timer;               /* deadline thread (timer.c) */
  /* Checkpoints (checkpoint.c). */
  pthread_mutex_t ckpt_mu;          /* one checkpoint at a time */
  int ckpt_dir_fd;                  /* lease on --checkpoint-dir, -1: none */
  uint64_t ckpt_restored_seq;       /* checkpoint loaded at start-up, 0: none */
  pthread_t ckpt_thread;            /* periodic checkpoints */
  bool ckpt_thread_on;
  pthread_mutex_t ckpt_thread_mu;
  pthread_cond_t ckpt_thread_cv;
  bool ckpt_thread_stop;
};

/* What one checkpoint did (checkpoint.c). */
typedef struct fps_ckpt_done_s {
  char path[4096];
  uint64_t seq;
  uint64_t bytes;                   /* file size */
  uint64_t tensors;                 /* tensors written */
  uint64_t skipped;                 /* tensors still initialising, not written */
  double seconds;                   /* all of it */
  double copy_seconds;              /* allocating and copying the snapshot */
  double max_hold_seconds;          /* longest time one tensor lock was held */
} fps_ckpt_done_t;

/* At start-up, before gRPC: takes the lease on --checkpoint-dir (creating
 * it) and loads the newest valid checkpoint into the empty store (files
 * that fail verification are logged and skipped). Returns 0 (restored, or
 * nothing to restore and not required), FPS_ENOTFOUND (required but none
 * valid), or another FPS_E* with the reason logged. No-op without a dir. */
int fps_checkpoint_open(fps_server_t *srv);
/* Writes a checkpoint now: copies every ready tensor under its own lock,
 * writes outside every lock. Thread-safe (serialised by srv->ckpt_mu).
 * Returns 0, FPS_ESTATE (no --checkpoint-dir), FPS_ENOTFOUND (no ready
 * tensor: nothing written, nothing pruned), or FPS_E* with `why`. */
int fps_checkpoint_write(fps_server_t *srv, fps_ckpt_done_t *out, char *why, size_t why_len);
/* Periodic checkpoints (--checkpoint-interval > 0); start is a no-op
 * otherwise. stop joins the thread (a write in progress finishes first);
 * close stops it too and releases the directory lease. */
int fps_checkpoint_start(fps_server_t *srv);
void fps_checkpoint_stop(fps_server_t *srv);
void fps_checkpoint_close(fps_server_t *srv);
/* Appends to `buf` what a worker ahead of a restored tensor must do
 * (nothing if the tensor was not restored). No lock needed: the
 * restored_* fields are written before gRPC starts and never change. */
void fps_checkpoint_ahead_hint(const fps_tensor_t *t, char *buf, size_t len);

/* Waits (sync.c): start allocates the ssp clocks and registers the
 * expiry hook of rounds and ssp waits with srv->timer; stop frees them. */
int fps_sync_start(fps_server_t *srv);
void fps_sync_stop(fps_server_t *srv);
/* Fails every parked call (shutdown): UNAVAILABLE. */
void fps_sync_fail_all(fps_server_t *srv, grpc_status_code code, const char *why);

/* grpc_server.c */
int fps_grpc_start(fps_server_t *srv);
/* Stops accepting, gives in-flight calls up to grace_s, cancels the rest. */
void fps_grpc_stop(fps_server_t *srv, double grace_s);
void fps_calls_link(fps_server_t *srv, fps_call_t *c);
void fps_calls_unlink(fps_server_t *srv, fps_call_t *c);
/* Timer hook (arg: the server): cancels calls past their deadline. */
void fps_calls_expire(void *srv, int64_t now_ns);

/* Method entry points: each takes ownership of call, md and payload. */
void fps_rpc_create_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                          grpc_metadata_array *md, grpc_byte_buffer *payload);
void fps_rpc_stats_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                         grpc_metadata_array *md, grpc_byte_buffer *payload);
void fps_rpc_pull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                        grpc_metadata_array *md, grpc_byte_buffer *payload);
void fps_rpc_pushpull_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md);
void fps_rpc_checkpoint_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                              grpc_metadata_array *md, grpc_byte_buffer *payload);

/* ------------------------------------------------------------- replies */

/* One tensor of a streamed reply. */
typedef struct fps_reply_item_s {
  fps_tensor_t *t;
  fps_snap_t *snap;           /* NULL: versions only */
  uint64_t version;
  int dtype;                  /* wire dtype of the data */
} fps_reply_item_t;

typedef struct fps_reply_s {
  fps_reply_item_t *items;
  size_t n;
  size_t cur;                 /* next item to send */
  uint64_t off;               /* next element of items[cur] */
  bool pull;                  /* PullResponse vs PushPullResponse */
  bool done;
} fps_reply_t;

/* Packs the next reply message; *last is set when it carries the versions.
 * Returns NULL on OOM. */
grpc_byte_buffer *fps_reply_next(fps_reply_t *r, fps_server_t *srv, bool *last);
/* Drops the snapshots and the item array. */
void fps_reply_free(fps_reply_t *r);

/* ------------------------------------------------------------ push path */

/* One tensor's gradient within one PushPull call. */
struct fps_push_entry_s {
  struct fps_pp_call_s *owner;
  fps_tensor_t *t;
  uint32_t worker_id;         /* the pushing worker */
  bool skip_params;           /* no snapshot wanted */
  int64_t deadline_ns;        /* the owning call's deadline */
  float *grad;                /* numel floats: staging, becomes the reply snapshot */
  fps_ranges_t got;           /* slices received */
  int dtype;                  /* dtype of the first slice: reply dtype */
  uint64_t step;              /* this tensor's step (TensorPush.step or the call's) */
  bool has_slices;            /* a gradient slice arrived */
  bool has_push;              /* a TensorPush named it */
  bool no_grad;               /* TensorPush.no_grad: nothing to apply */
  bool has_lr, has_weight_decay;
  double lr, weight_decay;    /* TensorPush values when has_* */
  fps_update_hp_t uh;         /* effective values (set at commit) */
  bool in_round;              /* member of t->round (t->mu) */
  bool resolved;              /* round done or failed (owner->base.mu) */
  grpc_status_code code;      /* result when resolved */
  char *msg;                  /* error text when code != OK */
  fps_snap_t *snap;           /* result params (OK, unless skip_params) */
  uint64_t version;           /* version after the update */
};

/* Called when a sync round finishes (OK or failed) for an entry, without
 * any tensor lock held. Resumes the owning call when it was its last. */
void fps_pushpull_resolved(fps_push_entry_t *e);
/* ssp: called to apply a call that waited and may now proceed. */
void fps_pushpull_ssp_resume(struct fps_pp_call_s *pp);
/* ssp: fail a parked call. */
void fps_pushpull_ssp_fail(struct fps_pp_call_s *pp, grpc_status_code code, const char *msg);

/* sync.c: joins every entry of a call to its tensor's round (all or none),
 * each at its own step (e->step).
 * On a validation failure returns the gRPC code and fills why. Entries of
 * rounds that complete here are resolved before returning. */
grpc_status_code fps_sync_join(fps_server_t *srv, fps_push_entry_t **e, size_t n,
                               uint32_t worker_id, int64_t call_deadline_ns,
                               char *why, size_t why_len);
/* Withdraws entries still waiting in a round (cancelled call). Returns how
 * many were withdrawn (they are resolved as CANCELLED by the caller). */
size_t fps_sync_withdraw(fps_server_t *srv, fps_push_entry_t **e, size_t n);

/* ssp: true if worker at step may go now; otherwise parks pp (under
 * srv->ssp_mu) and returns false. */
bool fps_ssp_admit_or_park(fps_server_t *srv, fps_ssp_wait_t *w);
/* ssp: record a finished push and resume parked calls that may go now. */
void fps_ssp_advance(fps_server_t *srv, uint32_t worker_id, uint64_t step);
/* ssp: removes pp from the parked list; true if it was there. */
bool fps_ssp_unpark(fps_server_t *srv, fps_ssp_wait_t *w);

void fps_counters_push_done(fps_server_t *srv, bool ok, double seconds);

/* ------------------------------------- per-push settings (push_settings.c)
 *
 * gRPC-free: each returns 0 or a negative FPS_E* with a message in `why`
 * naming the tensor and the problem (wire.c's fps_wire_status() maps the
 * code to the gRPC status). */

/* The stream header against the shard's configuration: worker_id < W and
 * num_workers == W (unless 0) in sync/ssp, expect_mode (0: any) equal to
 * the shard's mode. FPS_ESTATE on a mismatch. */
int fps_push_header_check(const fps_config_t *cfg, uint32_t worker_id, uint32_t num_workers,
                          int expect_mode, char *why, size_t why_len);
/* Validates a TensorPush's lr / weight decay for tensor t with its flavor's
 * own rules (as Create does): FPS_EHPARAM. */
int fps_push_settings_check(const fps_tensor_t *t, bool has_lr, double lr, bool has_wd, double wd,
                            char *why, size_t why_len);
/* e->uh from e's TensorPush values and t's Create settings. */
void fps_push_settings_resolve(fps_push_entry_t *e);
/* A full sync round's members m[0..W-1] against each other: identical
 * effective lr/weight decay (FPS_ESTATE naming the workers and values), a
 * gradient from all or none (FPS_ESTATE naming who had and who lacked one).
 * *all_no_grad is set when no member has a gradient. */
int fps_round_agree(const fps_tensor_t *t, fps_push_entry_t *const *m, uint32_t W, bool *all_no_grad,
                    char *why, size_t why_len);

#endif

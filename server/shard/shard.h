/* The shard core's face: what the RPC layer (server/rpc_*.c, reply.c,
 * grpc_server.c, peer.c, main.c) calls, and nothing else. The core's
 * inside (its structs and the calls its files make of each other) is
 * internal.h, which only the core's own files and its tests include.
 *
 * The core decides everything a shard decides and knows nothing of how
 * calls reach it: it includes no gRPC and no protobuf-c header (the
 * fps_shard library does not link them, and layer.h poisons their names).
 * Functions return 0 or a negative FPS_E* (common/error.h) and write a
 * message naming the tensor and the problem into a `why` buffer; the RPC
 * layer translates the code (server/status.c) and sends the message. A
 * push that has to wait (a sync round, an ssp wait) is resumed through the
 * callback its creator registered (fps_push_done_fn), on whichever thread
 * completes it. Every function here is thread-safe unless it says
 * otherwise. */
#ifndef FPS_SHARD_H
#define FPS_SHARD_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "adafactor_split.h"
#include "dtype.h"
#include "error.h"
#include "name.h"
#include "log.h"

#define FPS_NAME_MAX FPS_TENSOR_NAME_MAX /* bytes of UTF-8 in a tensor name (name.h) */
#define FPS_WHY_MAX 2048                 /* room for any message of the core */

typedef struct fps_shard_s fps_shard_t;   /* one shard: store, rounds, waits */
typedef struct fps_tensor_s fps_tensor_t; /* a tensor (never freed while the shard runs) */
typedef struct fps_push_s fps_push_t;     /* one PushPull call's push */
typedef struct fps_snap_s fps_snap_t;     /* an immutable parameter buffer */
typedef struct fps_snap_bf16_s fps_snap_bf16_t; /* a buffer's bf16 encoding */

/* ------------------------------------------------------ options, shard */

typedef enum fps_mode_e { FPS_MODE_SYNC = 1, FPS_MODE_ASYNC = 2, FPS_MODE_SSP = 3 } fps_mode_t;

/* "sync", "async", "ssp" or "unknown". */
const char *fps_mode_name(int mode);

/* What the core needs of the shard's configuration (main.c fills it from
 * fps_config_t: the fields have the same names and meanings there). */
typedef struct fps_shard_opts_s {
  uint32_t shard_id;          /* this shard's index */
  uint32_t shard_count;       /* shards in the job */
  int mode;                   /* fps_mode_t */
  uint32_t staleness;         /* ssp: max steps ahead of the slowest worker */
  uint32_t workers;           /* sync/ssp: number of workers W (>= 1) */
  double deadline;            /* seconds: sync round deadline */
  uint64_t max_tensors;       /* Create beyond this: FPS_ELIMIT */
  uint64_t max_bytes;         /* parameter bytes beyond this: FPS_ELIMIT */
  uint64_t max_staging_bytes; /* gradient staging + snapshots, all pushes */
  uint32_t apply_log;         /* per-tensor apply records kept */
  const char *checkpoint_dir; /* "" = off (borrowed) */
  double checkpoint_interval; /* seconds between periodic checkpoints, 0 = off */
  uint32_t checkpoint_keep;   /* newest checkpoints kept */
  int require_checkpoint;     /* refuse to start without a loaded checkpoint */
  const char *job_id;         /* --job-id: the job served, "" or NULL = learnt
                                 from a checkpoint or the first Create (borrowed) */
  uint32_t split_anchor_steps; /* a split block's state kept on disk every N
                               * versions (xrecover.c), 0: never */
} fps_shard_opts_t;

/* A new, empty shard (shard.c): copies opts (checkpoint_dir stays
 * borrowed), uses kernels and pool (NULL: none; the pool stays the
 * caller's). Returns 0 and *out, or FPS_ENOMEM. Free with
 * fps_shard_free(). */
int fps_shard_new(const fps_shard_opts_t *opts, const fps_kernels_t *kernels, fps_pool_t *pool,
                  fps_shard_t **out);
/* Frees the shard, its store and its waits. REQUIRES no push in progress
 * and the checkpoint thread stopped (fps_checkpoint_close). NULL: no-op. */
void fps_shard_free(fps_shard_t *sh);
/* Expiry hook (timer.h; arg: the shard): fails rounds, exchanges, holds
 * and ssp waits past their deadline with FPS_ETIMEOUT. */
void fps_shard_expire(void *sh, int64_t now_ns);
/* Fails every waiting push (shutdown) with err and why. */
void fps_shard_fail_waiting(fps_shard_t *sh, int err, const char *why);
/* Staging bytes of calls in flight (max_staging_bytes' count without the
 * spare buffers kept for reuse). */
uint64_t fps_shard_in_flight_bytes(fps_shard_t *sh);

/* ----------------------------------------------------------- the rules */

/* Name rule (common/name.h): 1..FPS_NAME_MAX bytes of UTF-8 without
 * control characters. 0 or FPS_EINVAL. */
int fps_shard_name_check(const char *name, char *why, size_t why_len);
/* Shape from dims (dims >= 1, ndim <= FPS_MAX_DIMS, numel bounded):
 * 0, FPS_EINVAL or FPS_EOVERFLOW. */
int fps_shard_shape_check(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out, uint64_t *numel,
                          char *why, size_t why_len);

/* ------------------------------------------------- tensors, buffers */

/* A tensor's name (NUL-terminated) and shape: fixed at Create, valid while
 * the shard lives. */
const char *fps_tensor_name(const fps_tensor_t *t);
const fps_shape_t *fps_tensor_shape(const fps_tensor_t *t);

/* A parameter buffer at one version, refcounted and never written while
 * anyone holds it: replies and Pull reference it instead of copying. */
const float *fps_snap_data(const fps_snap_t *s);  /* numel floats */
uint64_t fps_snap_numel(const fps_snap_t *s);
uint64_t fps_snap_version(const fps_snap_t *s);
/* One more reference (e.g. for a reply slice over the data). */
void fps_snap_ref(fps_snap_t *s);
/* Drops one reference; the last frees. NULL is a no-op. */
void fps_snap_unref(fps_snap_t *s);

/* A buffer's numel elements as little-endian bf16 (round to nearest even),
 * converted once and shared by every reply that sends the buffer while
 * any of them holds a reference (snap_bf16.c). fps_snap_bf16_get: a
 * reference to s's encoding, converted now by this caller if there is
 * none, into a buffer counted against max_staging_bytes; NULL when it
 * cannot be had now (the limit, out of memory, or another thread is
 * converting it): the caller converts its own copy. REQUIRES: the caller
 * holds a reference to s. Never waits for a conversion. */
fps_snap_bf16_t *fps_snap_bf16_get(fps_shard_t *sh, fps_snap_t *s);
/* Its bytes: 2 * numel, valid while the reference is held. */
const uint8_t *fps_snap_bf16_data(const fps_snap_bf16_t *e);
void fps_snap_bf16_ref(fps_snap_bf16_t *e);
/* Drops one; the last frees the encoding. NULL is a no-op. */
void fps_snap_bf16_unref(fps_snap_bf16_t *e);

/* -------------------------------------------------------------- slices */

/* Where the data of a slice is when it is not in one piece (the buffers a
 * message was received in): next yields the following run of whole
 * elements (sets *data, returns the element count), 0 when all is given. */
typedef struct fps_slice_src_s {
  uint64_t (*next)(void *ctx, const uint8_t **data);
  void *ctx;
  /* Where next puts an element cut between two buffers (copied there, so
   * not held by the slice's owner), NULL: never. */
  const uint8_t *bounce;
} fps_slice_src_t;

/* Who keeps a slice's bytes alive past the call that hands them to the
 * core (the RPC layer's received message), so that a sync slice that
 * arrives early is staged as a reference to them, not as a copy
 * (reduce.c). The core takes one reference per staged piece (ref) and
 * drops it when the piece is summed or thrown away (unref: any thread,
 * maybe with core locks held, so it must not call into the core; the
 * last one frees the bytes). While any staged piece references them,
 * `bytes` count once against max_staging_bytes (`staged` is the core's
 * count of those pieces: set it to 0). */
typedef struct fps_slice_owner_s {
  void (*ref)(void *ctx);
  void (*unref)(void *ctx);
  void *ctx;
  uint64_t bytes;             /* the memory the references keep alive */
  atomic_uint_fast64_t staged; /* the core's: staged pieces referencing it */
} fps_slice_owner_t;

/* One slice of a tensor as it came off the wire: data is little-endian
 * elements of dtype, any alignment, either in one piece (data) or, with
 * src set, in the pieces src yields (data unused; len still the total). */
typedef struct fps_slice_s {
  int dtype;                  /* FPS_DTYPE_* */
  const uint64_t *shape;      /* the sender's idea of the shape, n_shape dims */
  size_t n_shape;             /* 0: not given */
  uint64_t offset;            /* first element */
  const uint8_t *data;
  size_t len;                 /* bytes */
  const fps_slice_src_t *src; /* NULL: data holds all of it */
  fps_slice_owner_t *owner;   /* keeps data alive, NULL: the bytes last only
                               * for the call (the core copies what it keeps) */
} fps_slice_t;

/* ---------------------------------------------------------------- create */

/* Kinds of optimizer state arrays (the wire's StateKind - 1). */
enum { FPS_STATE_ROW = 0, FPS_STATE_COL, FPS_STATE_VAR, FPS_STATE_MOM, FPS_STATE_KINDS };

/* One run of a state array (float32 little-endian, any alignment). */
typedef struct fps_state_slice_s {
  int kind;                   /* FPS_STATE_*, or -1: not a kind */
  uint64_t offset;            /* first element within the kind's array */
  const uint8_t *data;
  size_t len;                 /* bytes */
} fps_state_slice_t;

/* A block map of a split tensor as it arrives (SplitBlock's fields). */
typedef struct fps_split_map_s {
  uint32_t block_index;
  const uint64_t *bounds;         /* n_bounds = blocks + 1 */
  size_t n_bounds;
  const uint32_t *block_shards;   /* one per block */
  size_t n_block_shards;
  uint32_t shard_count;           /* the count the map was made for */
} fps_split_map_t;

/* One TensorCreate: the hyperparameters are decoded (and validated) by
 * the caller; name and shape are checked here again. */
typedef struct fps_create_item_s {
  const char *name;
  const uint64_t *dims;
  size_t ndim;
  fps_adafactor_hparams_t hp;
  const fps_slice_t *init;    /* initial values, NULL: none */
  /* Resume and ownership (TensorCreate step, init_state, rms, replace). */
  uint64_t step;              /* the step count and version to start at, 0: fresh */
  const fps_state_slice_t *state; /* with step > 0: state values */
  size_t n_state;
  double rms;                 /* hf RMS at resume */
  bool replace;               /* replace an existing tensor's values */
  /* A row block of a split tensor (proto SplitBlock), NULL: whole. Then
   * init and state are the block's, at block-local offsets. */
  const fps_split_map_t *split;
} fps_create_item_t;

typedef struct fps_create_info_s {
  fps_tensor_t *t;            /* the tensor this item names */
  uint64_t version;
  bool ready;
  uint64_t initialised;       /* elements with initial values */
  bool created;               /* first item of a tensor this call created */
  bool changed;               /* this call created, initialised or replaced it
                               * (false: it was ready and stays as it was) */
} fps_create_info_t;

/* Create-or-match for n items (several may name one tensor: they must
 * agree). All is validated before anything changes: shard placement
 * (FPS_ESTATE), names and shapes (FPS_EINVAL), a tensor that exists with
 * another shape or settings (FPS_EEXISTS), init slices (range, dtype,
 * finite, no overlap with what is initialised: FPS_EINVAL), limits
 * (max_tensors, max_bytes: FPS_ELIMIT), memory (FPS_ENOMEM). On success
 * the new tensors are in the store, the init slices written (ignored for a
 * tensor that was already ready: the first values win), out[i] filled for
 * every item and *received set to the init bytes written.
 *
 * Resume (step > 0): a new tensor starts at version and step count `step`
 * (hf: RMS `rms`) and is ready only once its params and every state array
 * are covered by init and state slices (this and later Creates at the same
 * step; FPS_EINVAL for another step, a state kind the tensor lacks, values
 * out of range, non-finite or negative second moments, overlap). Replace:
 * an existing tensor's params, state, step and version are replaced by
 * this call's, which must cover all of them (FPS_EINVAL otherwise), in one
 * step under its lock; FPS_ESTATE while a sync round is open for it. A
 * missing tensor is created as without replace.
 *
 * Split blocks (item.split): the map is checked (FPS_ESTATE, FPS_EINVAL),
 * then whether this shard may hold blocks (FPS_ESTATE); a block matches an
 * existing one only with the same shape, settings and map, and a whole
 * tensor never matches a block (FPS_EEXISTS naming what differs).
 * Everything above then holds for the block: its numel, state sizes and
 * offsets. */
int fps_shard_create(fps_shard_t *sh, uint32_t shard_id, uint32_t shard_count, const fps_create_item_t *items,
                     size_t n, fps_create_info_t *out, uint64_t *received, char *why, size_t why_len);

/* ------------------------------------------------------- reads: Pull, GetState */

/* Pull's view of a tensor: a reference to its published parameters (no
 * copy; release with fps_snap_unref) and the tensor. Returns 0,
 * FPS_ENOTFOUND or FPS_ESTATE (still initialising), with why. */
int fps_shard_snapshot(fps_shard_t *sh, const char *name, fps_tensor_t **t, fps_snap_t **snap, char *why,
                       size_t why_len);

/* GetState's view of a tensor: its optimizer state copied under its lock
 * (one version). Kinds in the order row, col, var, mom (FPS_STATE_*), back
 * to back in data. */
typedef struct fps_state_snap_s {
  fps_tensor_t *t;
  uint64_t version, step;
  double rms, lr, weight_decay;  /* hf RMS; the last update's lr / weight decay */
  uint64_t n[FPS_STATE_KINDS];  /* elements of each kind */
  uint64_t total;               /* their sum */
  float *data;                  /* total floats (counted as staging), or NULL */
} fps_state_snap_t;
/* Copies tensor `name`'s state. Returns 0, FPS_ENOTFOUND, FPS_ESTATE (still
 * initialising), FPS_ELIMIT (staging limit) or FPS_ENOMEM, with why.
 * Release with fps_state_snap_release() (also after a failure). */
int fps_shard_state_snap(fps_shard_t *sh, const char *name, fps_state_snap_t *out, char *why, size_t why_len);
/* The kind's array within a snapshot. */
const float *fps_state_snap_array(const fps_state_snap_t *s, int kind);
void fps_state_snap_release(fps_shard_t *sh, fps_state_snap_t *s);

/* ---------------------------------------------------------- reads: Stats */

typedef struct fps_apply_rec_s {
  uint32_t worker_id;
  uint64_t step;
  uint64_t version;
  double lr;                  /* applied (hf relative_step: rel_t) */
  double weight_decay;        /* applied */
} fps_apply_rec_t;

/* One tensor as Stats shows it, read-only: copied under its lock where it
 * changes; name, shape, settings, state sizes and the block map are
 * constant and point into the tensor (valid while the shard lives). */
typedef struct fps_tensor_view_s {
  const char *name;
  const fps_shape_t *shape;   /* the whole tensor's, also for a block */
  uint64_t numel;             /* elements held here (a block's own) */
  int flavor;                 /* FPS_FLAVOR_* */
  bool factored;              /* row/col second moments */
  fps_state_size_t size;      /* its optimizer state */
  bool split;                 /* a row block of a split tensor: map below */
  fps_split_map_t map;        /* with split: the block map */
  uint64_t version;
  bool ready;
  uint64_t split_lost_steps;  /* a block: updates undone by moving to an agreed version */
  uint32_t nlog;              /* apply records in log, oldest first */
  const fps_apply_rec_t *log; /* into the view's storage */
} fps_tensor_view_t;

/* The shard as Stats shows it. */
typedef struct fps_shard_view_s {
  const char *simd;           /* the kernel variant in use */
  uint64_t tensors;           /* tensors in the store */
  uint64_t param_elements;    /* their elements */
  uint64_t split_blocks;      /* of them, row blocks of split tensors */
  uint64_t split_elements;    /* the blocks' elements */
  fps_state_size_t state;     /* their optimizer state, summed */
  fps_tensor_view_t *t;       /* per tensor in creation order (with_tensors), else NULL */
  size_t n;
  fps_apply_rec_t *recs;      /* storage of every view's log */
  /* The counters (the metrics registry) at the time of the view. */
  uint64_t pushes, push_errors, updates, bytes_received, bytes_sent, update_bytes;
  double push_seconds_sum, update_seconds_sum;
  uint64_t xbytes_sent, xbytes_received, xsteps, xfailures; /* the exchange */
  double xseconds_sum;
  double push_seconds_p50, push_seconds_p99; /* of the recent pushes, 0: none */
  double uptime_seconds;
} fps_shard_view_t;

/* Reads the shard: totals always; with with_tensors, one view per tensor
 * (each under its own lock, briefly) with up to log_limit of its newest
 * apply records. Returns 0 or FPS_ENOMEM (nothing to free then). Free
 * with fps_shard_view_free(). */
int fps_shard_view(fps_shard_t *sh, bool with_tensors, uint32_t log_limit, fps_shard_view_t *out);
void fps_shard_view_free(fps_shard_view_t *v);

/* ---------------------------------------------------------------- push */

/* Called once when a push that fps_push_commit() left waiting is resolved
 * (applied, failed, cancelled): on the thread that resolved it (another
 * push's, the timer's), with no core lock held. The push stays owned by its
 * creator; fps_push_result() tells how it ended. */
typedef void (*fps_push_done_fn)(fps_push_t *p, void *arg);

/* A new push (one PushPull call). deadline_ns: the call's deadline on the
 * fps_now_ns() clock (INT64_MAX: none); done/arg: see fps_push_done_fn.
 * Returns 0 or FPS_ENOMEM. Free with fps_push_destroy(). */
int fps_push_create(fps_shard_t *sh, int64_t deadline_ns, fps_push_done_fn done, void *arg, fps_push_t **out);
/* The call's deadline, when it is known only after the push exists.
 * REQUIRES: before fps_push_commit(). */
void fps_push_set_deadline(fps_push_t *p, int64_t deadline_ns);
/* Frees p, its staging and its results. REQUIRES p not waiting (never
 * committed, failed, or resolved). NULL is a no-op. */
void fps_push_destroy(fps_push_t *p);
/* The header of each message: the first call sets worker_id/step/
 * skip_params and checks the job (worker_id < W and num_workers == W
 * unless 0 in sync/ssp, expect_mode 0 or the shard's: FPS_ESTATE); later
 * ones must repeat worker_id, step, num_workers and expect_mode
 * (FPS_EINVAL). */
int fps_push_header(fps_push_t *p, uint32_t worker_id, uint64_t step, bool skip_params, uint32_t num_workers,
                    int expect_mode, char *why, size_t why_len);
/* The push's idempotency key (PushPullRequest.push_id; 0: none), the same
 * in every message of a call: FPS_EINVAL if it changes. */
int fps_push_set_id(fps_push_t *p, uint64_t push_id, char *why, size_t why_len);
/* One tensor's settings for this push (TensorPush in the proto). */
typedef struct fps_push_tensor_s {
  const char *name;
  bool has_lr;
  double lr;                  /* this update's lr (absent: Create's) */
  bool has_weight_decay;
  double weight_decay;        /* this update's weight decay (absent: Create's) */
  bool no_grad;               /* no gradient this step: nothing applied */
  bool skip_step;             /* sync: the whole round applies nothing (needs no_grad) */
  bool has_step;
  uint64_t step;              /* this tensor's step, if not the push's */
} fps_push_tensor_t;
/* Records tp for its tensor: the tensor must exist and be ready, be named
 * once and before its first slice (FPS_EINVAL), its lr/weight decay pass
 * the flavor's rules (FPS_EHPARAM); sync: its step must be the tensor's
 * version (FPS_ESTALE, FPS_EAHEAD). */
int fps_push_tensor(fps_push_t *p, const fps_push_tensor_t *tp, char *why, size_t why_len);
/* One gradient slice of tensor `name`: the tensor must exist (FPS_ENOTFOUND)
 * and be ready (FPS_ESTATE); sync: the step must be the tensor's version
 * (FPS_ESTALE, FPS_EAHEAD); the slice must fit (FPS_EINVAL), not overlap
 * one already received (FPS_EINVAL) and hold finite values below
 * FPS_GRAD_ABS_LIMIT (FPS_EINVAL); its tensor is staged within
 * max_staging_bytes (FPS_ELIMIT). The data is read in one pass (piece by
 * piece with s->src: FPS_EPROTO if the pieces end early): decoded into
 * staging or the sync sum, or (sync, s->owner set) staged as a reference
 * to be checked when it is summed, which may then fail the push later
 * (internal.h, reduce.c); nothing is applied before fps_push_commit(). */
int fps_push_slice(fps_push_t *p, const char *name, const fps_slice_t *s, char *why, size_t why_len);
/* The stream is complete: every staged tensor must be covered (FPS_EINVAL).
 * async: applies now. ssp: applies now or parks until the slowest worker
 * is close enough. sync: joins every tensor's round or none (FPS_ESTALE,
 * FPS_EAHEAD, FPS_EDUP); the push that completes a round applies it.
 * Returns 0 when the push is resolved on return (fps_push_result() tells
 * how; done is not called), FPS_EAGAIN when it waits (done is called once,
 * maybe before this returns), or another FPS_E* when it was refused before
 * joining or waiting (nothing applied, done is not called). */
int fps_push_commit(fps_push_t *p, char *why, size_t why_len);
/* The call went away: a push still waiting withdraws from its rounds or
 * its ssp wait (a withdrawn member never counts) and is resolved with
 * FPS_ECANCELLED (done is called if it was waiting). Before the commit,
 * it only marks p, so a later commit withdraws at once. */
void fps_push_cancel(fps_push_t *p);
/* How a resolved push ended: 0, or the FPS_E* of its first failed tensor
 * with its message in why. */
int fps_push_result(fps_push_t *p, char *why, size_t why_len);
/* True if the resolved push was a retry answered from the window (nothing
 * applied by this call). */
bool fps_push_replayed(const fps_push_t *p);
/* The tensors of a resolved push, in first-seen order. */
size_t fps_push_count(const fps_push_t *p);
typedef struct fps_push_out_s {
  fps_tensor_t *t;
  fps_snap_t *snap;           /* the parameters after the update; NULL with skip_params */
  uint64_t version;           /* version after the update */
  int dtype;                  /* dtype of the first slice received */
} fps_push_out_t;
/* Item i of a successful push; the snapshot reference moves to the caller
 * (a second take of the same item gets snap NULL). */
void fps_push_take(fps_push_t *p, size_t i, fps_push_out_t *out);
/* Item i's bf16 encoding of its snapshot, made by the update for a bf16
 * reply: the reference moves to the caller (NULL: none; a second take
 * gets NULL; one not taken goes with the push). */
fps_snap_bf16_t *fps_push_take_bf16(fps_push_t *p, size_t i);

/* Sync backpressure. A slice that arrives before the workers below its
 * worker have been summed over its elements is staged; so that staging
 * stays near one message per call, the RPC layer asks after each message
 * whether to receive the next one now. fps_push_hold() says true (hold)
 * when the push has more than FPS_PUSH_HOLD_BYTES staged and a lower
 * worker that has not yet sent all of that tensor is still streaming
 * (its call alive, not half-closed); otherwise the push keeps streaming and
 * stages (within max_staging_bytes). After a true, the caller must not
 * receive until `resume` runs: once, on any thread, possibly with core
 * locks held, so it must only post the next receive. It runs when staged
 * pieces are summed, when a lower worker half-closes or goes away, when
 * the round's sum is discarded, when the push is cancelled, and at the
 * latest at the push's deadline or after --deadline seconds (the expiry
 * hook). A hold never waits on a higher worker, so holds cannot form a
 * cycle: the lowest streaming worker of a tensor is never held for it, and
 * worker 0 never is. */
#define FPS_PUSH_HOLD_BYTES (UINT64_C(4) << 20)
typedef void (*fps_push_resume_fn)(fps_push_t *p, void *arg);
void fps_push_set_resume(fps_push_t *p, fps_push_resume_fn fn, void *arg);
bool fps_push_hold(fps_push_t *p);
/* High-water marks since start: bytes of tensor-sized buffers counted
 * against max_staging_bytes (spares included), and of sync slices staged
 * ahead of lower workers (all workers together). Thread-safe. */
void fps_shard_staging_peaks(fps_shard_t *sh, uint64_t *buffers, uint64_t *staged);

/* ------------------------------------------------------------ job identity */

/* The job a shard serves (job.c), kept in every checkpoint it writes so
 * that a volume reused by another job is not restored into it. Fixed by
 * --job-id, else by the checkpoint restored at start-up, else by the
 * first Create that names one; never changed afterwards. */

/* A Create names `job` (NULL or "": names none, as older clients): the
 * shard adopts it if it has none yet. Returns 0, FPS_EINVAL (not a job id:
 * fps_ckpt_job_check) or FPS_ESTATE (the shard serves another job; `why`
 * names both and where the shard's came from). Thread-safe. */
int fps_shard_job_claim(fps_shard_t *sh, const char *job, char *why, size_t wl);
/* Copies the shard's job id ("" = none yet) into out[len]. Thread-safe. */
void fps_shard_job_get(fps_shard_t *sh, char *out, size_t len);

/* ----------------------------------------------------------- checkpoints */

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

/* At start-up, before serving: takes the lease on checkpoint_dir (creating
 * it) and loads the newest valid checkpoint into the empty store (files
 * that fail verification are logged and skipped). Returns 0 (restored, or
 * nothing to restore and not required), FPS_ENOTFOUND (required but none
 * valid), or another FPS_E* with the reason logged. No-op without a dir. */
int fps_checkpoint_open(fps_shard_t *sh);
/* Writes a checkpoint now: copies every ready tensor under its own lock,
 * writes outside every lock. Serialised by the shard's checkpoint lock.
 * Returns 0, FPS_ESTATE (no checkpoint_dir), FPS_ENOTFOUND (no ready
 * tensor: nothing written, nothing pruned), or FPS_E* with `why`. */
int fps_checkpoint_write(fps_shard_t *sh, fps_ckpt_done_t *out, char *why, size_t why_len);
/* Periodic checkpoints (checkpoint_interval > 0); start is a no-op
 * otherwise. stop joins the thread (a write in progress finishes first);
 * close stops it too and releases the directory lease. */
int fps_checkpoint_start(fps_shard_t *sh);
void fps_checkpoint_stop(fps_shard_t *sh);
void fps_checkpoint_close(fps_shard_t *sh);
/* True if the newest checkpoint this process wrote or loaded still holds
 * the shard's state: nothing changed since it was copied and its file is
 * still there (SIGTERM's final write and the periodic one are skipped
 * then); *path (may be NULL) gets that file's path, valid until the next
 * checkpoint. */
bool fps_checkpoint_unchanged(fps_shard_t *sh, const char **path);

/* ------------------------------------------- split tensors: the exchange */

/* Exchange phases past the partials' (ExchangePhase; ABORT below): COMMIT says "every
 * partial of this step is here and every send of mine acknowledged" (no
 * payload; steps of 3+ blocks apply only once every block said it);
 * VERSIONS lists the versions the sender's block can be restored to (its
 * own and its anchors': xrecover.c), 8 bytes each, little-endian. */
#define FPS_XPHASE_COMMIT 3
#define FPS_XPHASE_VERSIONS 4
#define FPS_XPHASE_ABORT 5 /* "my step of it will not begin" (shutting down; no payload) */
#define FPS_XVERSIONS_MAX 8 /* versions a VERSIONS message lists at most */

/* One Exchange message (ExchangeRequest's fields). partials is the wire
 * form of common/adafactor_split.h; valid only during the call it is
 * passed to. */
typedef struct fps_xmsg_s {
  const char *name;
  uint64_t version;            /* the block's version before the step */
  uint32_t from_shard, shard_count, block_index;
  int phase;                   /* FPS_SPLIT_PHASE_*, FPS_XPHASE_COMMIT or
                                * FPS_XPHASE_VERSIONS */
  uint64_t attempt;            /* the step's attempt (xstep.c): a hash of
                                * its members' (worker_id, push_id); 0: the
                                * members carry no push_id */
  const void *partials;
  size_t len;
  uint64_t stamp;              /* the sender's clock when it made the message
                                * (xrecover.c "STAMPS"); 0: not known */
  bool want;                   /* the sender lacks the receiver's own
                                * partials (or COMMIT) of this phase */
} fps_xmsg_t;

/* What an OK Exchange answers (ExchangeResponse): the step of the
 * message's (version, attempt) applied on the receiver; with the
 * message's `want`, the receiver's own partials of that phase (STATS/U2;
 * owned: fps_free) or, for a COMMIT, that it committed, when the sender
 * should have had them already (the receiver's send of them to it was
 * acknowledged, or the step applied): a standby promoted in the middle of
 * a step lacks what went to its predecessor. */
typedef struct fps_xreply_s {
  bool applied;
  bool committed;
  uint8_t *partials;
  size_t len;
} fps_xreply_t;

/* How one send ended: err 0 (the peer acknowledged; reply is its answer,
 * valid during the call), or FPS_E* with a message naming the peer and
 * the cause (FPS_EUNAVAILABLE: not reachable within the deadline;
 * otherwise the peer's refusal translated; reply NULL). Called
 * exactly once per accepted send, on any thread, with no core lock held. */
typedef void (*fps_xsend_done_fn)(void *arg, int err, const char *msg, const fps_xreply_t *reply);

/* The sender: copies what it needs of *m (m is only valid during the
 * call), sends it to shard `to_shard`, retrying transient failures until
 * deadline_ns (fps_now_ns clock), and reports through done. Returns 0
 * (done will be called) or FPS_E* (refused at once, e.g. no address for
 * that shard; done is not called). The core calls it with no core lock
 * held. */
typedef int (*fps_xsend_fn)(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns,
                            fps_xsend_done_fn done, void *arg);

/* Installs the sender and the time a step's exchange may take (seconds,
 * > 0; a member push's own deadline may cut it shorter). Before serving;
 * without a sender, Create refuses split blocks (FPS_ESTATE: "this shard
 * has no --peers"). */
void fps_shard_set_exchange(fps_shard_t *sh, fps_xsend_fn send, void *ctx, double deadline_seconds);

/* An Exchange from a peer, validated in the proto's order against this
 * shard's block of m->name: FPS_ENOTFOUND (no block of it here),
 * FPS_ESTATE (held whole; the block/shard pair is not in this map; an old
 * version; geometry or old column state that differ: diverged),
 * FPS_ESTATE also for partials of an attempt whose step failed here,
 * FPS_EEXISTS (different partials for a (version, block, phase, attempt)
 * already received; an identical retry is 0), FPS_EINVAL, FPS_ENOMEM; `why` names
 * the tensor, the sender and the problem. Kept partials may complete this
 * shard's step on the calling thread (its pushes resolved before return).
 * On 0, *reply (may be NULL) gets the answer; free it with
 * fps_xreply_free. */
int fps_shard_exchange_receive(fps_shard_t *sh, const fps_xmsg_t *m, fps_xreply_t *reply, char *why,
                               size_t why_len);
void fps_xreply_free(fps_xreply_t *reply);

/* ------------------------------------------------------------ replicas */

/* What standby replicas need of the core (replica.c; server/replica.h).
 * The tensors in creation order: up to cap into out; returns how many
 * there are. */
size_t fps_shard_tensors(fps_shard_t *sh, fps_tensor_t **out, size_t cap);

/* A tensor's whole state at one version, taken under its lock: its
 * parameters (a reference: no copy) and a copy of its optimizer state
 * (row, col, var, mom back to back, n[k] floats each). name, shape and
 * hp point into or copy the tensor (constant). */
typedef struct fps_image_s {
  fps_tensor_t *t;
  const char *name;
  const fps_shape_t *shape;
  fps_adafactor_hparams_t hp;
  uint64_t numel;
  uint64_t n[FPS_STATE_KINDS];
  uint64_t total_state;
  uint64_t version, step;
  double rms, last_lr, last_weight_decay;
  fps_snap_t *params;         /* numel floats */
  float *state;               /* total_state floats (staging), or NULL */
  /* A row block of a split tensor (numel and n are the block's; shape is
   * the whole tensor's): its map (a view into the tensor, constant) and
   * its last step applied when that step made `version` (the Exchange a
   * promoted standby must answer as the primary would: xstep.c). */
  bool is_split;
  fps_split_map_t split;
  uint64_t split_replaces;    /* the block's replaces so far (its history) */
  bool xapplied;
  uint64_t xversion, xattempt;
  uint8_t *xown[2];           /* owned copies: STATS, U2 (NULL: none) */
  size_t xown_len[2];
  bool oom;                   /* copying xown failed */
} fps_image_t;
/* 0, FPS_ESTATE (still initialising), FPS_ELIMIT / FPS_ENOMEM (the state
 * copy), with why. Release with
 * fps_image_release (also after a failure). */
int fps_shard_image(fps_shard_t *sh, fps_tensor_t *t, fps_image_t *out, char *why, size_t why_len);
void fps_image_release(fps_shard_t *sh, fps_image_t *img);
/* Takes img's state copy out of the image and off the staging account
 * (NULL if it has none): the caller frees it with fps_free, whenever it
 * likes, even after the shard is gone (a gRPC slice may hold it until
 * gRPC's own teardown). */
float *fps_image_take_state(fps_shard_t *sh, fps_image_t *img);

/* A push's key as a standby takes it: worker, push_id, the hash of its
 * tensors and the versions it made (owned by the record), and the tensors
 * themselves (t[i] made version v[i]; tensors are never removed). */
typedef struct fps_key_rec_s {
  uint32_t worker;
  uint64_t id, tensors;
  uint32_t n;
  uint64_t *v;
  fps_tensor_t **t;
  struct fps_key_rec_s *next;
} fps_key_rec_t;
void fps_key_recs_free(fps_key_rec_t *list);

/* Turns on (or off, dropping what is queued) the recording of pushes'
 * keys as they are applied (async/ssp: each push; sync: every member of a
 * set at once, when the set is applied), for fps_shard_images. */
void fps_shard_repl_keys(fps_shard_t *sh, bool on);

/* Images of n tensors at one moment between pushes: under the apply
 * gate's write side (no push half applied, in any mode) and every one of
 * their locks at once, so that what one push changed is in all of them or
 * in none. *keys gets the keys of the pushes applied since the last call
 * (free with fps_key_recs_free), and every tensor those pushes changed is
 * imaged in the same cut: out[i] for t[i], and the ones not among t[] in
 * *extra (an array of *nextra, NULL if none; release each and fps_free
 * it). So no key ever goes to the standby ahead of the state it answers
 * for. A tensor still initialising gets params NULL (skip it). 0, or
 * FPS_EUNSUPPORTED (a split block), FPS_ELIMIT / FPS_ENOMEM (the state
 * copies) with why; release every out[i] with fps_image_release. */
int fps_shard_images(fps_shard_t *sh, fps_tensor_t *const *t, size_t n, fps_image_t *out, fps_key_rec_t **keys,
                     fps_image_t **extra, size_t *nextra, char *why, size_t why_len);

/* An image as it arrives on a standby: installed as it is (parameters,
 * state, version, step, RMS, last lr and weight decay), creating the
 * tensor first (Create's rules and limits) if it is missing. The bits
 * are copied: nothing is computed. */
typedef struct fps_image_in_s {
  const char *name;
  const uint64_t *dims;
  size_t ndim;
  fps_adafactor_hparams_t hp;
  uint64_t n[FPS_STATE_KINDS];
  uint64_t version, step;
  double rms, last_lr, last_weight_decay;
  const float *params;        /* numel floats (aligned), copied in */
  float *params_own;          /* or: a buffer of fps_shard_param_buf that
                               * becomes the parameters (no copy; the core
                               * owns it once install returns 0) */
  const float *state;         /* sum of n[k] floats */
  /* A row block of a split tensor (NULL: whole): its map, and its last
   * step applied (fps_image_t's xapplied ...; copied in). */
  const fps_split_map_t *split;
  uint64_t split_replaces;    /* another count than the block's here: the
                               * primary replaced it (its anchors go) */
  bool xapplied;
  uint64_t xversion, xattempt;
  const uint8_t *xown[2];
  size_t xown_len[2];
} fps_image_in_t;
/* The elements of the row block `map` places on this shard (shard_id of
 * shard_count) of a tensor of `shape` (validated): 0, or the map's
 * refusals (fps_shard_split_check's FPS_ESTATE / FPS_EINVAL) with why. */
int fps_shard_block_numel(const char *name, const fps_shape_t *shape, const fps_split_map_t *map,
                          uint32_t shard_id, uint32_t shard_count, uint64_t *numel, char *why, size_t why_len);
/* A buffer for numel parameters of tensor `name` counted against
 * max_staging_bytes until an install adopts it (fps_image_in_t.params_own);
 * NULL with *over_limit set past the limit, or NULL out of memory. A
 * tensor held with numel elements gives its spare (the parameter buffer
 * its last install retired) when it has one: a standby takes every image
 * into the same two buffers instead of faulting in fresh pages each time.
 * Free an unused one with fps_shard_param_buf_free. */
float *fps_shard_param_buf(fps_shard_t *sh, const char *name, uint64_t numel, bool *over_limit);
void fps_shard_param_buf_free(fps_shard_t *sh, float *p, uint64_t numel);
/* 0, or FPS_EEXISTS (held here with another shape, settings or state
 * size), FPS_EUNSUPPORTED (a split block), Create's refusals, FPS_ELIMIT,
 * FPS_ENOMEM, with why; nothing changed on failure. */
int fps_shard_install(fps_shard_t *sh, const fps_image_in_t *in, char *why, size_t why_len);

/* A 64-bit hash (xxHash64's rounds) of n bytes with a seed. */
uint64_t fps_hash64(const void *data, size_t n, uint64_t seed);
/* Tensor t's checksum at its current version (*version): the hash of its
 * parameter bytes combined with that of its optimizer-state bytes, the
 * state hashed under the tensor's lock (a pass over the state: the
 * factored state is small), the parameters after, from their immutable
 * buffer. 0, or FPS_ESTATE (initialising; *sum 0). Never 0 otherwise. */
int fps_shard_checksum(fps_shard_t *sh, fps_tensor_t *t, uint64_t *version, uint64_t *sum);
/* The shard's: a hash over every ready tensor's checksum in creation
 * order (0: none ready). One pass over every tensor's bytes. */
uint64_t fps_shard_state_checksum(fps_shard_t *sh);

/* A resolved, applied push's idempotency key (false: it had none, or it
 * was a replay): its worker, push_id and the hash of its tensors. */
bool fps_push_key_info(const fps_push_t *p, uint32_t *worker, uint64_t *id, uint64_t *tensors);
/* Remembers (worker, id) as applied with versions v[0..n) (a standby
 * taking the primary's keys). 0 (also if known already), FPS_ELIMIT. */
int fps_shard_idem_put(fps_shard_t *sh, uint32_t worker, uint64_t id, uint64_t tensors, const uint64_t *v,
                       uint32_t n);
/* Calls fn for every applied key, under the window's lock (fn must not
 * call into the core). */
typedef void (*fps_idem_each_fn)(void *arg, uint32_t worker, uint64_t id, uint64_t tensors, const uint64_t *v,
                                 uint32_t n);
void fps_shard_idem_each(fps_shard_t *sh, fps_idem_each_fn fn, void *arg);

/* The payload checks of an Exchange that need no tensor: phase STATS/U2
 * partials (fps_split_partials_check), an empty COMMIT, a VERSIONS list.
 * 0 or FPS_EINVAL with the problem in `why`. */
int fps_shard_exchange_payload_check(int phase, const void *buf, size_t len, char *why, size_t why_len);

/* SIGTERM: no new split step begins from now on, and the ones whose
 * exchange has begun finish or fail (each within its exchange deadline)
 * while gRPC still serves the peers' Exchange calls; waits at most
 * max_seconds. Call before stopping the peers and gRPC. */
void fps_shard_drain_exchanges(fps_shard_t *sh, double max_seconds);

/* Once serving: every restored split block tells its peers the versions it
 * can be restored to, so that a job whose blocks came back at different
 * versions agrees on one by itself (xrecover.c). */
void fps_shard_recover_start(fps_shard_t *sh);

#endif

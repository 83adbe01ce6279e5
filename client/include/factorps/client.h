/* libfactorps: the worker-side client of a factorps parameter server.
 *
 * A client connects to every shard of one job, places each tensor on exactly
 * one shard (deterministically, from the full tensor list, so that every
 * worker computes the same map), and talks to all shards in parallel.
 *
 * Conventions
 * - Every function that can fail returns an fps_code (0 = OK, otherwise a
 *   gRPC status code value) and, if `status` is non-NULL, fills it with the
 *   code and a message naming the tensor/shard and the problem.
 * - Tensors are fp32, C order, host memory owned by the caller; the library
 *   never keeps a pointer to caller memory after a call returns.
 * - Thread-safety: an fps_client_t may be used from several threads at once
 *   (calls are independent); create/destroy must not race with other calls.
 * - Deadlines: every exchange with the shards (one call per shard, or per
 *   chunk of a push, all in parallel) finishes within `deadline_seconds`, retries and backoff
 *   included, plus a small slack (at most 15 s more if gRPC does not end a
 *   call it was told to cancel: the call is then given up as
 *   DEADLINE_EXCEEDED); no call waits forever. PushPull, Pull and
 *   Stats are one exchange. fps_client_create_tensors() is one exchange per
 *   message of initial values (a large model needs several), then waits at
 *   most `deadline_seconds` for values other workers upload.
 * - Retries: on UNAVAILABLE a call is retried with exponential backoff
 *   (up to max_retries, within deadline_seconds): Create, Pull and Stats
 *   (idempotent or read-only), and PushPull too, also after it started:
 *   every push carries an idempotency key (push_id, unique per process), so
 *   the shard applies a retried push at most once; a retry of a push the
 *   shard already applied (its reply was lost) gets the versions that push
 *   made and the current params (proto: PushPullRequest.push_id; the shard
 *   remembers each worker's last 4,096 keys). Other errors are reported, never
 *   repeated; fps_push_args_t.push_id lets a caller retry those itself. A
 *   call to several shards that one of them refused otherwise than
 *   UNAVAILABLE retries none of the others (it fails anyway; the blocks of
 *   a split tensor on the other shards would only wait out their exchange
 *   deadline again) and reports that refusal.
 * - Standby replicas: a shard's address may list its replicas, "a:p|b:p"
 *   (see fps_client_create()). A call that fails UNAVAILABLE on one (a
 *   standby refuses worker calls so; a dead or unreachable process) is
 *   sent at once to the next, with the same push_id, so a push is applied
 *   at most once whichever replica applied it; after each round over all
 *   of a shard's replicas comes the backoff, and max_retries counts such
 *   rounds. The client remembers the replica that answered last and starts
 *   there. All within the call's one deadline.
 * - Memory: when the library runs out of memory a call answers
 *   RESOURCE_EXHAUSTED (fps_client_create: NULL with that status) and the
 *   client stays usable: the same call, repeated, succeeds
 *   (tests/integration/test_client_alloc_sweep.c fails each allocation of
 *   create, create_tensors, placement_plan, push_pull_ex, pull, stats,
 *   tensor_stats, discover, get_state and checkpoint in turn).
 * - Placement: see fps_client_create_tensors().
 * - Wire: tensors travel as fp32 little-endian; the library refuses to build
 *   on a big-endian host.
 *
 * Names here are the contract the Python binding (ctypes) codes against:
 * extend, never rename or reorder. */
#ifndef FACTORPS_CLIENT_H
#define FACTORPS_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Exported symbols. The library is built with hidden visibility by default,
 * so only functions marked FPS_EXTERN are part of libfactorps.so's ABI. */
#if defined(FPS_BUILDING_CLIENT) && defined(__GNUC__)
#define FPS_EXTERN __attribute__((visibility("default")))
#else
#define FPS_EXTERN
#endif

#define FPS_CLIENT_MAX_DIMS 8
#define FPS_STATUS_MESSAGE_MAX 1024
#define FPS_CLIENT_NAME_MAX 256   /* longest tensor name, in bytes */
#define FPS_CLIENT_MAX_REPLICAS 4 /* most replicas one shard address lists */

/* Status codes: the gRPC status code values, so an error from a shard keeps
 * its meaning end to end. */
typedef enum fps_code_e {
  FPS_CODE_OK = 0,
  FPS_CODE_CANCELLED = 1,
  FPS_CODE_UNKNOWN = 2,
  FPS_CODE_INVALID_ARGUMENT = 3,
  FPS_CODE_DEADLINE_EXCEEDED = 4,
  FPS_CODE_NOT_FOUND = 5,
  FPS_CODE_ALREADY_EXISTS = 6,
  FPS_CODE_PERMISSION_DENIED = 7,
  FPS_CODE_RESOURCE_EXHAUSTED = 8,
  FPS_CODE_FAILED_PRECONDITION = 9,
  FPS_CODE_ABORTED = 10,
  FPS_CODE_OUT_OF_RANGE = 11,
  FPS_CODE_UNIMPLEMENTED = 12,
  FPS_CODE_INTERNAL = 13,
  FPS_CODE_UNAVAILABLE = 14,
  FPS_CODE_DATA_LOSS = 15,
  FPS_CODE_UNAUTHENTICATED = 16,
} fps_code_t;

/* The outcome of a call. `message` names the shard (index and address), the
 * tensor where one is concerned, and the problem; for an error returned by a
 * shard it carries the shard's status details. When several shards fail in
 * one call, the first failing shard by index is reported. */
typedef struct fps_status_s {
  int code;                                  /* fps_code_t */
  int shard;                                 /* shard index, -1 if none */
  char message[FPS_STATUS_MESSAGE_MAX];      /* NUL-terminated */
} fps_status_t;

/* Symbolic name of a status code ("UNAVAILABLE"); never NULL. Thread-safe. */
FPS_EXTERN const char *fps_code_name(int code);

typedef struct fps_client_s fps_client_t;

/* Client settings. Strings are copied by fps_client_create(). */
typedef struct fps_client_options_s {
  double deadline_seconds;       /* per call, retries included; default 60 */
  int max_retries;               /* on UNAVAILABLE, with backoff; default 5 */
  double backoff_initial_seconds;/* default 0.1, doubling, capped at 5 */
  uint64_t max_message_bytes;    /* largest message sent (at most the
                                    shard's --max-message-bytes); >= 64 KiB;
                                    default 4 MiB. Replies of up to 4 MiB
                                    are accepted whatever this is. */
  const char *tls_ca_file;       /* PEM CA bundle: TLS, shards verified
                                    against it; NULL: plaintext */
  const char *tls_cert_file;     /* PEM client certificate for mutual TLS,
                                    or NULL (needs tls_ca_file) */
  const char *tls_key_file;      /* its unencrypted PEM private key */
  const char *auth_token;        /* bearer token sent as "authorization:
                                    Bearer <token>" on every call, or NULL;
                                    visible ASCII, no spaces */
  const char *tls_server_name;   /* name the shards' certificates must
                                    carry when not the address's host
                                    (e.g. shards dialled by IP), or NULL */
  int wire_dtype;                /* element type of push_pull payloads:
                                    FPS_WIRE_F32 (or 0; default) or
                                    FPS_WIRE_BF16: gradients are rounded to
                                    bf16 (nearest even) before sending and
                                    the fresh parameters come back as bf16
                                    (the shard keeps fp32 master weights and
                                    state); half the bytes each way. The
                                    caller's arrays stay fp32. Create and
                                    Pull always move exact fp32. */
  uint64_t split_min_bytes;      /* tensors of at least this many bytes
                                    are cut into row blocks over several
                                    shards (see fps_client_placement_plan
                                    and "Split tensors" below); 0 (the
                                    default) never splits. Every shard
                                    must run with --peers (one without
                                    refuses a block's Create with
                                    FAILED_PRECONDITION) in sync mode. */
  uint64_t push_chunk_bytes;     /* push_pull cuts a shard's tensors into
                                    chunks of at least this many bytes of
                                    fp32 gradient (4 per element with
                                    either wire dtype, so bf16 cuts the
                                    chunks fp32 cuts; whole tensors or row
                                    blocks; at most
                                    32 chunks per shard), each its own call
                                    with its own push_id, so the shard
                                    applies and answers the first chunks
                                    while later ones still upload; see
                                    fps_client_push_pull(). 0: one call per
                                    shard (every tensor of a shard applied
                                    together or none). Default
                                    FPS_PUSH_CHUNK_BYTES_DEFAULT. */
  const char *job_id;            /* the job's identity, sent with every
                                    Create (1..64 bytes of [A-Za-z0-9._:-];
                                    copied), or NULL: none. A shard that
                                    serves another job (its --job-id, the
                                    checkpoint it restored, or an earlier
                                    Create's) refuses the Create with
                                    FAILED_PRECONDITION naming both, so a
                                    new job does not resume another's
                                    checkpoint. Give every worker of a job
                                    the same id. */
} fps_client_options_t;

/* The default chunk of a push (fps_client_options_t.push_chunk_bytes). */
#define FPS_PUSH_CHUNK_BYTES_DEFAULT (UINT64_C(8) << 20)

/* The split threshold factorps recommends (32 MiB): it splits a
 * 100M-parameter model's embedding (67 MB in `factorps load --model peer`)
 * and nothing else, which brings max/min shard bytes to <= 1.05 over 2, 3
 * and 4 shards (README, "Split tensors"). Not the default: splitting needs
 * shards started with --peers, in sync mode.
 *
 * Split tensors. A tensor the placement cuts into row blocks is used like
 * any other: every call takes and fills the caller's whole arrays, and the
 * library routes each block's part (rows [lo, hi) of the [..., R, C] view,
 * elements [lo*C, hi*C)) to and from its shard. Create sends every block
 * its slice of init and of the resume state (GetState's layouts: its rows'
 * row statistics, the column statistics of each matrix its rows touch,
 * its elements' variance and momentum). PushPull's reply must show every
 * block at the same version (the shards apply a split tensor's step on all
 * blocks or none), else DATA_LOSS: the blocks have diverged. Pull and
 * GetState that meet a step applied on some blocks' shards and not yet on
 * others read again (up to 8 times, a few ms apart), then fail with
 * ABORTED. GetState assembles the whole tensor's state and checks that the
 * copies of a matrix's column statistics held by several blocks are
 * identical (DATA_LOSS otherwise). Errors name the tensor, the block (its
 * index and rows) and the shard. */
#define FPS_SPLIT_MIN_BYTES_DEFAULT (UINT64_C(32) << 20)

/* Values of fps_client_options_t.wire_dtype (the wire contract's DType). */
enum { FPS_WIRE_F32 = 1, FPS_WIRE_BF16 = 2 };

/* Optimizer flavors and hyperparameters, as in the wire contract
 * (proto/factorps/v1/factorps.proto, AdafactorConfig). A has_* flag of 0
 * means "upstream default". */
typedef enum fps_optim_flavor_e {
  FPS_OPTIM_TORCH = 1,
  FPS_OPTIM_HF = 2,
} fps_optim_flavor_t;

typedef struct fps_optim_config_s {
  int flavor;                      /* fps_optim_flavor_t */
  int has_lr;             double lr;
  int has_beta2_decay;    double beta2_decay;
  int has_eps1;           double eps1;
  int has_eps2;           double eps2;
  int has_clip_threshold; double clip_threshold;
  int has_weight_decay;   double weight_decay;
  int has_maximize;       int maximize;
  int has_relative_step;  int relative_step;
  int has_scale_parameter;int scale_parameter;
  int has_warmup_init;    int warmup_init;
  int has_beta1;          double beta1;
} fps_optim_config_t;

/* One tensor of the job. ndim 0 is a scalar; every dim >= 1. */
typedef struct fps_tensor_def_s {
  const char *name;              /* 1..FPS_CLIENT_NAME_MAX bytes */
  uint32_t ndim;
  uint64_t shape[FPS_CLIENT_MAX_DIMS];
  fps_optim_config_t optim;      /* flavor 0 means FPS_OPTIM_TORCH */
  const float *init;   /* initial values (numel floats), or NULL to only
                          register and wait for another worker's values */
  /* Added for resume and ownership (appended; zero = as before): */
  uint64_t step;       /* resume: the step count t and version the tensor
                          starts at (0 = fresh); needs init and the state
                          arrays below for the kinds the tensor has */
  const float *state_row; /* factored (ndim >= 2): lead*R floats, else NULL */
  const float *state_col; /* factored: lead*C floats, else NULL */
  const float *state_var; /* ndim <= 1: numel floats, else NULL */
  const float *state_mom; /* hf with beta1: numel floats, else NULL */
  double rms;          /* hf RMS state scalar at resume (torch: 0) */
  int replace;         /* the tensor exists: replace its params, state, step
                          and version (needs init; everything of the tensor
                          must fit one message of max_message_bytes) */
} fps_tensor_def_t;

/* Fills `o` with the defaults above. Thread-safe. */
FPS_EXTERN void fps_client_options_init(fps_client_options_t *o);

/* Connects to `n_shards` shards (addresses "host:port", shard i at index i).
 * A shard with standby replicas (factorps-server --replica-peer) is one
 * entry listing its processes separated by '|', in any order, at most
 * FPS_CLIENT_MAX_REPLICAS: "10.0.0.5:50051|10.0.0.6:50051"; calls go to the
 * one that acknowledges (the primary) and follow a failover by themselves
 * (see Standby replicas above).
 * `opts` may be NULL (defaults). Returns NULL and fills `status` on bad
 * arguments (INVALID_ARGUMENT: no shards, empty address, an entry with an
 * empty replica, more than FPS_CLIENT_MAX_REPLICAS or one replica twice,
 * out-of-range options, half a TLS configuration, an unreadable or non-PEM
 * TLS file);
 * connection happens lazily, so an unreachable shard is reported by the
 * first call. A failed TLS handshake (a shard's certificate not signed by
 * tls_ca_file or not naming the shard, a client certificate the shard does
 * not accept, a plaintext shard) is reported by calls as UNAVAILABLE; a
 * missing or wrong token as UNAUTHENTICATED.
 * Caller owns the result and frees it with fps_client_destroy(). Copies
 * `addrs` and the option strings. Thread-safe (initialises gRPC). */
FPS_EXTERN fps_client_t *fps_client_create(const char *const *addrs, size_t n_shards,
                                           const fps_client_options_t *opts,
                                           fps_status_t *status);

/* Frees the client and its channels. NULL is a no-op.
 * REQUIRES: no call on `c` is in flight. */
FPS_EXTERN void fps_client_destroy(fps_client_t *c);

/* Registers the job's full tensor list: computes the placement and creates
 * every tensor on its shard (idempotent). A def with step > 0 resumes: the
 * tensor starts at that step and version with the given state (GetState's
 * layouts), on shards where it does not exist yet (an existing ready tensor
 * is matched and keeps its values, unless `replace`). A def with `replace`
 * overwrites an existing tensor's params, state, step and version in one
 * Create (FAILED_PRECONDITION while a sync round is open for it). Tensors whose `init` is NULL are
 * waited for until another worker has supplied their values or the deadline
 * passes (DEADLINE_EXCEEDED naming a tensor still missing values). Initial
 * values travel in slices of at most max_message_bytes; all shards are
 * served in parallel. Replaces any earlier tensor list of this client, also
 * when it fails after validation (then the shards may hold some tensors).
 *
 * Placement (identical on every worker for the same set of defs, whatever
 * their order): tensors are sorted by size in bytes, largest first, ties by
 * name (strcmp order); each in turn goes to the shard with the fewest bytes
 * so far, ties to the lowest shard index. The heaviest shard thus exceeds
 * the lightest by at most the largest tensor. But a tensor this client's
 * list already places whole, with the same shape (an earlier create, or
 * fps_client_discover(): where the shards hold it), stays on that shard:
 * a tensor added to a running job must not move the others away from
 * their state (call fps_client_discover() first in a process that has no
 * list yet). With split_min_bytes > 0,
 * fps_client_placement_plan()'s placement: tensors of at least that size
 * are cut into row blocks (see "Split tensors"); a replace must then fit
 * one message per block.
 *
 * Errors: INVALID_ARGUMENT (empty or over-long or duplicate name, bad shape,
 * unknown flavor), any shard error (ALREADY_EXISTS for a mismatch with an
 * existing tensor, FAILED_PRECONDITION for a shard whose id/count differs
 * from the client's list), UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED
 * (out of memory). `defs` and their arrays are only read during the call.
 * Thread-safety: must not race with other calls on `c`. */
FPS_EXTERN int fps_client_create_tensors(fps_client_t *c, const fps_tensor_def_t *defs,
                                         size_t n, fps_status_t *status);

/* One row block of a tensor in a placement plan. */
typedef struct fps_block_s {
  size_t tensor;     /* index into the defs */
  int shard;         /* the shard it is placed on */
  uint64_t row_lo;   /* its rows [row_lo, row_hi): flattened rows of the */
  uint64_t row_hi;   /* [..., R, C] view (numel / C of them; elements for
                        ndim <= 1); a whole tensor is [0, all rows) */
  uint64_t bytes;    /* (row_hi - row_lo) * C * 4 */
} fps_block_t;

/* The placement of `n` tensors on `n_shards` shards with row splitting
 * (identical on every worker for the same set of (name, shape) pairs,
 * whatever their order), without a client or a network:
 *   1. tensors below split_min_bytes (all of them if it is 0) are placed
 *      whole by the LPT rule of fps_client_create_tensors (largest first,
 *      ties by name; each to the shard with the fewest bytes so far, ties
 *      to the lowest index);
 *   2. then each tensor of at least split_min_bytes, largest first, ties by
 *      name, is water-filled: with L the level at which
 *      sum_s max(0, L - bytes_s) equals its bytes (over the min(rows,
 *      n_shards) shards with the fewest bytes, ties to the lower index),
 *      shard s gets a block of about max(0, L - bytes_s) bytes: boundaries
 *      at the cumulative targets rounded to the nearest row (exact integer
 *      arithmetic), at least one row per block, blocks in shard-index order
 *      along the rows. At most one block per shard per tensor; a tensor
 *      that fills a single shard stays whole.
 * `blocks` (room for `cap`) gets every tensor's blocks, tensors in `defs`
 * order, each tensor's in row order; *n_blocks the count (also when cap is
 * too small: then OUT_OF_RANGE and nothing is written; blocks may be NULL
 * with cap 0 to ask). shard_bytes (n_shards entries, may be NULL) gets each
 * shard's parameter bytes. Errors: INVALID_ARGUMENT (no shards or more
 * than 65536, a bad or duplicate name, a bad shape), OUT_OF_RANGE,
 * RESOURCE_EXHAUSTED (out of memory). Thread-safe. */
FPS_EXTERN int fps_client_placement_plan(const fps_tensor_def_t *defs, size_t n,
                                         size_t n_shards, uint64_t split_min_bytes,
                                         fps_block_t *blocks, size_t cap, size_t *n_blocks,
                                         uint64_t *shard_bytes, fps_status_t *status);

/* The shard index tensor `name` is placed on (a split tensor: its first
 * block's), or -1 if unknown. Thread-safe against every call but
 * fps_client_create_tensors()/fps_client_discover(). */
FPS_EXTERN int fps_client_shard_of(const fps_client_t *c, const char *name);

/* Pushes this worker's gradients for `n` tensors (all shards in parallel;
 * per shard one streaming call per chunk of its tensors, see
 * push_chunk_bytes, or one call with push_chunk_bytes 0; slices of at most
 * max_message_bytes, pipelined) and writes the fresh parameters straight into `params[i]`
 * (numel floats each, may alias grads[i]; NULL skips that tensor's data; if
 * all of a shard's are NULL the shard sends versions only) and the new
 * versions into `versions` (may be NULL). `step` is the number of pushes
 * this worker has completed before this one. Every name must be in the
 * tensor list (NOT_FOUND otherwise) and appear once (INVALID_ARGUMENT).
 * Each shard applies the tensors of one chunk (with push_chunk_bytes 0:
 * all of its tensors of the push) all together or none of them; on error
 * no output is guaranteed to be written (other chunks and shards may have
 * succeeded), and the status names the shard and tensor. Each chunk's
 * call is retried on UNAVAILABLE with its own push_id, derived from the
 * push's (see Retries above), so a retry applies only what was not
 * applied; the same holds for a caller's retry with the same
 * fps_push_args_t.push_id and the same tensors and options.
 * Thread-safe (several workers may share one client). */
FPS_EXTERN int fps_client_push_pull(fps_client_t *c, uint32_t worker_id, uint64_t step,
                                    const char *const *names, const float *const *grads,
                                    float *const *params, uint64_t *versions, size_t n,
                                    fps_status_t *status);

/* Per-tensor settings of one push (the wire's PushPullRequest.TensorPush):
 * a has_* flag of 0 means "the tensor's Create value" (lr, weight_decay)
 * or "the call's step". */
typedef struct fps_tensor_push_s {
  int has_lr;           double lr;           /* this update's lr: finite, >= 0;
                                                hf relative_step=true: must be 0
                                                (INVALID_ARGUMENT from the shard) */
  int has_weight_decay; double weight_decay; /* this update's weight decay, >= 0 */
  int no_grad;          /* no gradient this step (frozen/unused): no update, no
                           weight decay, version unchanged; grads[i] may be NULL
                           and is not sent */
  int has_step;         uint64_t step;       /* this tensor's step, if it differs
                                                from args->step */
  int skip_step;        /* this worker skips this step (AMP found an Inf);
                           needs no_grad. sync: the round applies nothing for
                           any worker, whose versions[i] then stay */
} fps_tensor_push_t;

/* The call-wide arguments of fps_client_push_pull_ex(). */
typedef struct fps_push_args_s {
  uint32_t worker_id;
  uint32_t num_workers; /* the job's worker count W, checked by sync/ssp
                           shards at the first message (FAILED_PRECONDITION
                           when it differs from their --workers); 0 = unchecked */
  uint64_t step;        /* default step of every tensor (see push_pull) */
  int expect_mode;      /* 0 any, 1 sync, 2 async, 3 ssp (the proto's Mode):
                           a shard in another mode answers FAILED_PRECONDITION */
  uint64_t push_id;     /* idempotency key (proto PushPullRequest.push_id);
                           0 = the library picks a fresh one. Pass the same
                           nonzero key again to retry a push whose outcome is
                           unknown (DEADLINE_EXCEEDED, CANCELLED): the shard
                           applies it at most once */
} fps_push_args_t;

/* fps_client_push_pull() with per-tensor settings and the job checks:
 * `per` (n entries, or NULL for none) gives each tensor's lr, weight decay,
 * no_grad and step for this update only (the tensor's Create settings stay
 * its defaults); see TensorPush in the proto for the shard's rules (sync:
 * every worker of a round must send the same effective lr and weight decay
 * and agree on no_grad, else every one of them gets FAILED_PRECONDITION
 * and nothing is applied). A no_grad tensor's params[i] and versions[i]
 * still get its current values. Errors as fps_client_push_pull(), plus
 * INVALID_ARGUMENT for a NULL args, an expect_mode outside 0..3, or a NULL
 * grads[i] without no_grad. Thread-safe. */
FPS_EXTERN int fps_client_push_pull_ex(fps_client_t *c, const fps_push_args_t *args,
                                       const char *const *names, const float *const *grads,
                                       const fps_tensor_push_t *per, float *const *params,
                                       uint64_t *versions, size_t n, fps_status_t *status);

/* Reads the current values and versions of `n` tensors into `params[i]`
 * (numel floats each; NULL skips the data) and `versions` (may be NULL).
 * Errors as fps_client_push_pull(); retried on UNAVAILABLE. Thread-safe. */
FPS_EXTERN int fps_client_pull(fps_client_t *c, const char *const *names, float *const *params,
                               uint64_t *versions, size_t n, fps_status_t *status);

/* Per-shard figures, as in the wire contract's ShardStats. */
typedef struct fps_shard_stats_s {
  uint32_t shard_id, shard_count;
  char mode[8];                 /* "sync", "async", "ssp" */
  char simd[16];
  uint64_t tensors, param_elements, param_bytes;
  uint64_t state_row, state_col, state_var, state_mom, state_elements, state_bytes;
  uint64_t adamw_elements, adamw_bytes;
  uint64_t pushes, push_errors, updates, bytes_received, bytes_sent;
  double push_seconds_sum, push_seconds_p50, push_seconds_p99;
  double update_seconds_sum;
  uint64_t update_bytes;
  double uptime_seconds;
  /* Added after the draft (appended, so earlier fields keep their offsets): */
  uint32_t workers;             /* sync/ssp */
  uint32_t staleness;           /* ssp */
  char version[32];             /* factorps version of the shard */
  /* Split tensors (appended, so earlier fields keep their offsets): */
  uint64_t split_blocks;        /* row blocks of split tensors held (counted in
                                   `tensors`) */
  uint64_t split_param_bytes;   /* their parameter bytes (in param_bytes) */
  uint64_t exchange_sent_bytes; /* partials sent that peers acknowledged */
  uint64_t exchange_received_bytes; /* partials accepted from peers */
  uint64_t exchange_steps;      /* block steps completed with the other shards */
  uint64_t exchange_failures;   /* block steps that failed in the exchange */
  double exchange_seconds_sum;  /* completed steps: sending ours to having all */
  /* Standby replicas (appended, so earlier fields keep their offsets): */
  char replica_role[16];        /* "solo" (no standby), "primary" or "standby";
                                   "" from a shard that does not say */
  uint64_t term;                /* the lease term it holds, or the highest seen */
  char replica_peer[256];       /* its other replica (--replica-peer), or "" */
  int standby_joined;           /* primary: a standby has joined its stream (what
                                   it acknowledges is on both); standby: it has
                                   joined the primary's */
  uint32_t replica;             /* which of the shard entry's replicas answered
                                   (0: the first; always 0 for a single address) */
  uint64_t state_checksum;      /* a hash over every tensor's checksum (the
                                   factorps_state_checksum metric): equal on a
                                   primary and its standby at the same versions.
                                   Asked only of a shard whose entry lists its
                                   replicas (it costs the shard a pass over its
                                   bytes): 0 otherwise */
} fps_shard_stats_t;

/* Fills `out[i]` for every shard i (n must equal the shard count;
 * INVALID_ARGUMENT otherwise). A shard with standby replicas is asked at
 * the replica its calls go to, and while the one that answers says it is
 * a standby, at the next one (each once): the figures are the primary's
 * unless none answered as primary; out[i].replica and replica_role say
 * who answered.
 * Retried on UNAVAILABLE. Thread-safe. */
FPS_EXTERN int fps_client_stats(fps_client_t *c, fps_shard_stats_t *out, size_t n,
                                fps_status_t *status);

/* One applied update of a tensor, as the shard logs it (Stats.apply_log). */
typedef struct fps_apply_record_s {
  uint32_t worker_id;           /* sync: the lowest worker id of the round */
  uint64_t step;                /* the pushing worker's step */
  uint64_t version;             /* the tensor's version after the update */
  double lr;                    /* the lr it applied (hf relative_step: rel_t) */
  double weight_decay;          /* the weight decay it applied */
} fps_apply_record_t;

/* Per-tensor figures, as in the wire contract's TensorStats. */
typedef struct fps_tensor_stats_s {
  char name[FPS_CLIENT_NAME_MAX + 1];
  int shard;                    /* index of the shard that reported it */
  uint32_t ndim;
  uint64_t shape[FPS_CLIENT_MAX_DIMS];
  uint64_t version;
  int ready, factored, flavor;  /* flavor: fps_optim_flavor_t */
  uint64_t param_elements, param_bytes;
  uint64_t state_row, state_col, state_var, state_mom, state_elements, state_bytes;
  uint64_t adamw_elements, adamw_bytes;
  /* Split tensors (appended, so earlier fields keep their offsets): which
   * rows the reporting shard holds. A whole tensor: block 0 of 1, all its rows; a row block: its
   * index, the tensor's block count and its rows (the sizes above are the
   * block's, the shape the whole tensor's). */
  uint32_t block_index, n_blocks;
  uint64_t row_lo, row_hi;
  /* Standby replicas (appended): a hash of the tensor's parameter and
   * optimizer-state bytes at `version`, equal on a primary and its standby
   * at the same version; 0 from a shard that does not say. */
  uint64_t checksum;
} fps_tensor_stats_t;

/* Figures of tensor `name` and its last `log_cap` applied updates, oldest
 * first, into `log` (may be NULL when log_cap is 0); `*log_len` (may be
 * NULL) gets the number written. Asks every shard and reports the first
 * (by index) that holds the tensor: a split tensor's first block held
 * (out->block_index and row_lo/row_hi say which). NOT_FOUND if no shard
 * holds it. Thread-safe. */
FPS_EXTERN int fps_client_tensor_stats(fps_client_t *c, const char *name, fps_tensor_stats_t *out,
                                       fps_apply_record_t *log, size_t log_cap, size_t *log_len,
                                       fps_status_t *status);

/* Replaces the tensor list with the tensors the shards hold (from Stats),
 * each placed on the shard that reports it (a split tensor: its blocks
 * where the shards' maps put them), so that a tool that did not create the
 * tensors can pull them. Optimizer settings are not known after this call
 * (create with them instead). `*n_found` (may be NULL) gets the number of
 * tensors. Errors: as fps_client_stats(); DATA_LOSS if two shards report
 * the same name held whole, or a split tensor's blocks do not form one
 * complete map for this client's shards (a block missing, reported twice
 * or by another shard than its map's, maps that differ). Must not race
 * with other calls on `c`. */
FPS_EXTERN int fps_client_discover(fps_client_t *c, size_t *n_found, fps_status_t *status);

/* The shape of tensor `name` from the tensor list: 0 and `*ndim`, `shape`
 * (FPS_CLIENT_MAX_DIMS entries) filled, or -1 if unknown. Thread-safe as
 * fps_client_shard_of(). */
FPS_EXTERN int fps_client_tensor_shape(const fps_client_t *c, const char *name, uint32_t *ndim,
                                       uint64_t *shape);

/* The row blocks tensor `name` is placed in (from the tensor list, as
 * fps_client_shard_of): up to `cap` of them into `blocks` (NULL: none, only
 * the count), in row order; a whole tensor is one block of all its rows.
 * The blocks' `tensor` field is the tensor's index in the client's list,
 * sorted by name. Returns the tensor's block count (also when cap is
 * smaller), or -1 if the name is unknown (or c or name is NULL).
 * Thread-safe as fps_client_shard_of(). */
FPS_EXTERN int fps_client_tensor_blocks(const fps_client_t *c, const char *name,
                                        fps_block_t *blocks, size_t cap);

/* Number of shards this client was created with. Thread-safe. */
FPS_EXTERN size_t fps_client_shard_count(const fps_client_t *c);

#define FPS_CHECKPOINT_PATH_MAX 4096

/* What one shard's checkpoint wrote (the wire contract's
 * CheckpointResponse). */
typedef struct fps_checkpoint_info_s {
  char path[FPS_CHECKPOINT_PATH_MAX]; /* the file, as the shard names it */
  uint64_t sequence;                  /* its sequence number */
  uint64_t bytes;                     /* its size */
  uint64_t tensors;                   /* tensors written */
  double seconds;                     /* the shard's wall time for it */
} fps_checkpoint_info_t;

/* Asks every shard, in parallel, to write a durable checkpoint into its
 * --checkpoint-dir now; returns once every file is on disk. `out` may be
 * NULL (then n must be 0); otherwise n must equal the shard count and
 * out[i] gets shard i's result. Each shard's checkpoint is consistent per
 * tensor, not across shards (see the README). Errors: FAILED_PRECONDITION
 * (a shard has no --checkpoint-dir, or no initialised tensor), INTERNAL
 * (a write failed: disk full, permissions; the message says why),
 * UNAVAILABLE after retries (a shard is down or shutting down),
 * INVALID_ARGUMENT, RESOURCE_EXHAUSTED (out of memory). Retried on
 * UNAVAILABLE (a repeated checkpoint is harmless). Thread-safe. */
FPS_EXTERN int fps_client_checkpoint(fps_client_t *c, fps_checkpoint_info_t *out, size_t n,
                                     fps_status_t *status);

/* One tensor's optimizer state figures, as the wire's TensorState. */
typedef struct fps_tensor_state_s {
  uint64_t version;             /* updates applied */
  uint64_t step;                /* Adafactor step count t (torch/hf 'step') */
  double rms;                   /* hf 'RMS' (RMS(param) before the last step); torch 0 */
  double lr;                    /* lr of the last update (hf relative_step: rel_t);
                                   before any, Create's (relative_step: 0) */
  double weight_decay;          /* weight decay of the last update (or Create's) */
  uint64_t row_elements;        /* factored (ndim >= 2): lead*R, else 0 */
  uint64_t col_elements;        /* factored: lead*C, else 0 */
  uint64_t var_elements;        /* unfactored (ndim <= 1): numel, else 0 */
  uint64_t mom_elements;        /* hf with beta1: numel, else 0 */
} fps_tensor_state_t;

/* Reads the optimizer state of `n` tensors (GetState on their shards, in
 * parallel): info[i] (may be NULL) gets tensor i's figures, and each of
 * row, col, var, mom (each may be NULL to skip that kind for every tensor;
 * an entry may be NULL to skip it for one tensor) gets the arrays in the
 * canonical flat layouts (tests/vectors/README.md), C order:
 *   row[i]  lead*R floats (shape [..., R, C], lead = product of the
 *           leading dims; torch's exp_avg_sq_row, hf's exp_avg_sq_row)
 *   col[i]  lead*C floats (exp_avg_sq_col)
 *   var[i]  numel floats, for ndim <= 1 (exp_avg_sq)
 *   mom[i]  numel floats, for hf with beta1 (exp_avg)
 * A kind the tensor does not have is not written (its *_elements is 0);
 * the sizes follow from the shape, or come from info with all arrays NULL.
 * Each tensor's state is of one version (copied under its lock on the
 * shard); different tensors may be at different versions.
 * Errors: NOT_FOUND (a name not in the tensor list, or not on its shard),
 * INVALID_ARGUMENT (NULL names, a name twice), FAILED_PRECONDITION (still
 * initialising), DATA_LOSS (a reply that does not cover the state
 * exactly), UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED (out of
 * memory). Retried on UNAVAILABLE
 * (read-only). On error the arrays may be partly written. Thread-safe. */
FPS_EXTERN int fps_client_get_state(fps_client_t *c, const char *const *names, size_t n,
                                    fps_tensor_state_t *info, float *const *row, float *const *col,
                                    float *const *var, float *const *mom, fps_status_t *status);

#ifdef __cplusplus
}
#endif
#endif

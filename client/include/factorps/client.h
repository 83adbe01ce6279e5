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
 *
 * DRAFT API: the client work fills in the implementation; names here are the
 * contract the Python binding codes against. */
#ifndef FACTORPS_CLIENT_H
#define FACTORPS_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(FPS_BUILDING_CLIENT)
#define FPS_EXTERN __attribute__((visibility("default")))
#else
#define FPS_EXTERN
#endif

#define FPS_CLIENT_MAX_DIMS 8
#define FPS_STATUS_MESSAGE_MAX 1024

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

typedef struct fps_status_s {
  int code;                                  /* fps_code_t */
  int shard;                                 /* shard index, -1 if none */
  char message[FPS_STATUS_MESSAGE_MAX];      /* NUL-terminated */
} fps_status_t;

typedef struct fps_client_s fps_client_t;

typedef struct fps_client_options_s {
  double deadline_seconds;       /* per call; default 60 */
  int max_retries;               /* on UNAVAILABLE, with backoff; default 5 */
  double backoff_initial_seconds;/* default 0.1, doubling, capped at 5 */
  uint64_t max_message_bytes;    /* slice/message size limit; default 4 MiB */
  const char *tls_ca_file;       /* NULL: plaintext (reserved for TLS) */
  const char *tls_cert_file;     /* client certificate for mTLS, or NULL */
  const char *tls_key_file;
  const char *auth_token;        /* bearer token, or NULL */
} fps_client_options_t;

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

typedef struct fps_tensor_def_s {
  const char *name;
  uint32_t ndim;
  uint64_t shape[FPS_CLIENT_MAX_DIMS];
  fps_optim_config_t optim;
  const float *init;   /* initial values (numel floats), or NULL to only
                          register and wait for another worker's values */
} fps_tensor_def_t;

/* Fills `o` with the defaults above. */
FPS_EXTERN void fps_client_options_init(fps_client_options_t *o);

/* Connects to `n_shards` shards (addresses "host:port", shard i at index i).
 * Returns NULL and fills `status` on bad arguments; connection happens
 * lazily, so an unreachable shard is reported by the first call.
 * Caller owns the result and frees it with fps_client_destroy(). */
FPS_EXTERN fps_client_t *fps_client_create(const char *const *addrs, size_t n_shards,
                                           const fps_client_options_t *opts,
                                           fps_status_t *status);

/* Frees the client. NULL is a no-op. No call may be in flight. */
FPS_EXTERN void fps_client_destroy(fps_client_t *c);

/* Registers the job's full tensor list: computes the placement (balanced by
 * bytes, identical on every worker for the same list) and creates every
 * tensor on its shard (idempotent). Tensors whose `init` is NULL are waited
 * for until another worker has supplied their values or the deadline passes.
 * Replaces any earlier tensor list of this client. */
FPS_EXTERN int fps_client_create_tensors(fps_client_t *c, const fps_tensor_def_t *defs,
                                         size_t n, fps_status_t *status);

/* The shard index tensor `name` is placed on, or -1 if unknown. */
FPS_EXTERN int fps_client_shard_of(const fps_client_t *c, const char *name);

/* Pushes this worker's gradients for `n` tensors (all shards in parallel,
 * one call per shard) and writes the fresh parameters into `params[i]`
 * (numel floats each, may alias grads[i]; NULL skips that tensor's data) and
 * the new versions into `versions` (may be NULL). `step` is the number of
 * pushes this worker has completed before this one. On error no output is
 * guaranteed to be written, and the status names the shard and tensor. */
FPS_EXTERN int fps_client_push_pull(fps_client_t *c, uint32_t worker_id, uint64_t step,
                                    const char *const *names, const float *const *grads,
                                    float *const *params, uint64_t *versions, size_t n,
                                    fps_status_t *status);

/* Reads the current values and versions of `n` tensors. */
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
} fps_shard_stats_t;

/* Fills `out[i]` for every shard i (n must equal the shard count). */
FPS_EXTERN int fps_client_stats(fps_client_t *c, fps_shard_stats_t *out, size_t n,
                                fps_status_t *status);

/* Number of shards this client was created with. */
FPS_EXTERN size_t fps_client_shard_count(const fps_client_t *c);

#ifdef __cplusplus
}
#endif
#endif

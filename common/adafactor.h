/* Adafactor: hyperparameters, per-tensor optimizer state and the update step.
 *
 * Two flavors, exactly as tests/vectors/README.md specifies:
 *   FPS_FLAVOR_TORCH  torch.optim.Adafactor (PyTorch >= 2.5)
 *   FPS_FLAVOR_HF     transformers' Adafactor
 * A tensor is factored iff ndim >= 2, over its last two dimensions; leading
 * dimensions are a batch of independent matrices.
 *
 * Names here are the contract the server and client code against. Errors
 * are the (negative) FPS_E* codes of error.h, returned as they are.
 * Thread-safety: every function is reentrant; one state must not be stepped
 * by two threads at once (the caller serialises steps of one tensor). */
#ifndef FPS_ADAFACTOR_H
#define FPS_ADAFACTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "fps_limits.h" /* FPS_MAX_DIMS, FPS_MAX_NUMEL */
#include "pool.h"
#include "simd/kernels.h"


typedef enum fps_flavor_e {
  FPS_FLAVOR_TORCH = 1,
  FPS_FLAVOR_HF = 2,
} fps_flavor_t;

typedef struct fps_shape_s {
  uint32_t ndim;                  /* 0 (a scalar) .. FPS_MAX_DIMS */
  uint64_t dim[FPS_MAX_DIMS];     /* each >= 1 */
} fps_shape_t;

/* Hyperparameters of both flavors; fields a flavor does not use must keep
 * their defaults (validation rejects anything else, never ignores it). */
typedef struct fps_adafactor_hparams_s {
  fps_flavor_t flavor;
  bool has_lr;            /* hf: false means relative_step decides the lr */
  double lr;              /* torch default 1e-2 */
  double decay;           /* torch beta2_decay / hf decay_rate, default -0.8 */
  double eps1;            /* torch: float32 eps; hf: 1e-30 */
  double eps2;            /* default 1e-3 */
  double clip;            /* torch d / hf clip_threshold, default 1.0 */
  double weight_decay;    /* default 0 */
  bool maximize;          /* torch only */
  bool has_beta1;         /* hf only: momentum on when true */
  double beta1;
  bool scale_parameter;   /* hf only, default true */
  bool relative_step;     /* hf only, default true */
  bool warmup_init;       /* hf only, default false */
} fps_adafactor_hparams_t;

/* Optimizer state size of one tensor, in elements by kind and in bytes,
 * beside what AdamW would hold for the same tensor (2 x numel). The scalar
 * step and RMS are not counted, as upstream does not count them either. */
typedef struct fps_state_size_s {
  uint64_t row, col, var, mom;    /* elements by kind */
  uint64_t elements;              /* row + col + var + mom */
  uint64_t bytes;                 /* elements * sizeof(float) */
  uint64_t adamw_elements;        /* 2 * numel */
  uint64_t adamw_bytes;           /* adamw_elements * sizeof(float) */
} fps_state_size_t;

/* The state the optimizer keeps for one tensor. Arrays are NULL where the
 * tensor's flavor/shape does not use them. */
typedef struct fps_adafactor_state_s {
  fps_shape_t shape;
  uint64_t numel;
  bool factored;
  uint64_t batch, rows, cols;     /* factored: batch x rows x cols == numel */
  float *row;                     /* batch * rows */
  float *col;                     /* batch * cols */
  float *var;                     /* numel, unfactored only */
  float *mom;                     /* numel, hf with beta1 only */
  uint64_t step;                  /* steps applied so far (torch: stalls at 2^24 like its float32 counter) */
  float rms;                      /* hf: RMS(param) before the last step */
} fps_adafactor_state_t;

/* Per-step scalars, the same figures the golden vectors' trace records,
 * plus how many bytes the kernel moved through memory (for GB/s). */
typedef struct fps_adafactor_trace_s {
  uint64_t step;          /* t, after the increment */
  double rel_step;        /* torch rho_t / hf rel_step_sz */
  double rms_param;       /* RMS(param) before the step */
  double lr;              /* torch alpha / hf lr_t (scaled by param RMS where the flavor does) */
  double beta2t;          /* hf beta2t = 1 - t^decay; torch 1 - t^beta2_decay too */
  double rms_update;      /* RMS(U) before clipping */
  double clip_denom;      /* max(1, rms_update / clip) */
  double step_size;       /* lr / clip_denom */
  bool explicit_rms;      /* torch factored: a clamp could bind, RMS(U) took an extra pass */
  uint64_t bytes;         /* bytes read + written by this step's passes over memory */
} fps_adafactor_trace_t;

/* Fills *hp with the upstream defaults of a flavor (torch: lr 1e-2, eps1 =
 * float32 eps; hf: relative_step, scale_parameter, eps1 1e-30). */
void fps_adafactor_defaults(fps_adafactor_hparams_t *hp, fps_flavor_t flavor);

/* Checks hyperparameters the way upstream's constructors do, plus NaN/Inf
 * anywhere and fields the flavor lacks set to non-defaults. Returns 0,
 * FPS_EFLAVOR (unknown flavor) or FPS_EHPARAM; `why` (may be NULL) gets a
 * message naming the parameter. Never clamps or fixes anything. */
int fps_adafactor_validate(const fps_adafactor_hparams_t *hp, char *why, size_t why_len);

/* 0 if a and b are the same settings, else FPS_EEXISTS with the first
 * differing field in `why` ("lr 0.01 vs 0.001"). */
int fps_adafactor_hparams_diff(const fps_adafactor_hparams_t *a, const fps_adafactor_hparams_t *b,
                               char *why, size_t why_len);

/* Like fps_adafactor_hparams_diff() but ignores what a push may change
 * per update (lr, when both have one, and weight_decay): the settings that
 * stay fixed for a tensor's lifetime. 0 or FPS_EEXISTS with the first
 * differing fixed field in `why`. */
int fps_adafactor_hparams_diff_fixed(const fps_adafactor_hparams_t *a, const fps_adafactor_hparams_t *b,
                                     char *why, size_t why_len);

/* "torch" / "hf". parse returns FPS_EFLAVOR for anything else. */
int fps_flavor_parse(const char *s, fps_flavor_t *out);
const char *fps_flavor_name(fps_flavor_t f); /* "unknown" if not a flavor */

/* ndim <= FPS_MAX_DIMS, every dim >= 1, numel <= FPS_MAX_NUMEL computed
 * without overflow. Returns 0 (and *numel if non-NULL), FPS_ESHAPE or
 * FPS_EOVERFLOW, with a message in `why`. */
int fps_shape_validate(const fps_shape_t *s, uint64_t *numel, char *why, size_t why_len);

/* The optimizer state a tensor of shape s needs, by kind, and AdamW's. */
int fps_adafactor_state_size(const fps_shape_t *s, const fps_adafactor_hparams_t *hp,
                             fps_state_size_t *out);

/* Allocates zeroed state for a tensor (validates shape and hparams first).
 * On failure *st is left zeroed (destroy is still safe). Free with
 * fps_adafactor_state_destroy(). */
int fps_adafactor_state_init(fps_adafactor_state_t *st, const fps_shape_t *s,
                             const fps_adafactor_hparams_t *hp);
/* Frees the arrays; NULL-safe and idempotent (zeroes *st). */
void fps_adafactor_state_destroy(fps_adafactor_state_t *st);

/* One Adafactor step: updates param (st->numel floats) in place from grad.
 * k: kernels (NULL = fps_kernels_best()); pool: NULL runs on the calling
 * thread only, else large tensors are split over the pool's threads. The
 * result is bit-identical for any thread count: work is cut into chunks
 * that depend on the shape only, and partial sums are combined in chunk
 * order. trace may be NULL. hp must be the settings st was created with.
 * Returns 0, FPS_EHPARAM/FPS_EFLAVOR (bad hp), FPS_EINVAL (NULL args,
 * state not initialised), FPS_ENOMEM. Non-finite gradients are not
 * rejected here (the caller validates); they propagate like upstream. */
int fps_adafactor_step(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                       fps_adafactor_state_t *st, float *param, const float *grad,
                       fps_pool_t *pool, fps_adafactor_trace_t *trace);

/* What fps_adafactor_step() checks before it touches anything: 0, or the
 * FPS_E* it would return for these settings and this state (bad hp, state
 * made for other settings). */
int fps_adafactor_step_check(const fps_adafactor_hparams_t *hp, const fps_adafactor_state_t *st);
/* Doubles of scratch one step of this state needs (0: none), constant for
 * a tensor: a caller that must not fail half-way through several tensors'
 * steps allocates them all first. */
size_t fps_adafactor_scratch_len(const fps_adafactor_state_t *st);
/* fps_adafactor_step() out of place, with the caller's scratch
 * (fps_adafactor_scratch_len doubles, or NULL: allocated here; with
 * scratch, a state that passed fps_adafactor_step_check() with hp cannot
 * fail): reads param and grad, writes
 * the new params to out (numel floats). out may be param (in place, what
 * the calls above do) or grad (the gradient buffer is consumed and becomes
 * the new params); any other overlap of out with param or grad is not
 * allowed. param is only read, so a buffer others are reading (a published
 * parameter snapshot) stays unchanged when out is not param. Results are
 * bit-identical to the in-place step for every kernel variant. */
int fps_adafactor_step_to(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                          fps_adafactor_state_t *st, const float *param, const float *grad,
                          float *out, fps_pool_t *pool, double *scratch,
                          fps_adafactor_trace_t *trace);

/* fps_adafactor_step_to() that also writes the new parameters' bf16
 * encoding (numel little-endian bf16, any alignment, fps_f32_to_bf16()'s
 * bits) to out_bf16 in the same pass: each block of the update is encoded
 * while it is still in L1, so the replies that send bf16 need no second
 * pass over the parameters. out_bf16 NULL: exactly fps_adafactor_step_to().
 * out_bf16 must not overlap param, grad or out. */
int fps_adafactor_step_to_bf16(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                               fps_adafactor_state_t *st, const float *param, const float *grad,
                               float *out, void *out_bf16, fps_pool_t *pool, double *scratch,
                               fps_adafactor_trace_t *trace);

/* Bytes the step moves through memory per step for this state, on the
 * common path (no torch clamp fallback): see adafactor_step.c. */
uint64_t fps_adafactor_step_bytes(const fps_adafactor_state_t *st);

#endif

/* Adafactor: hyperparameters, per-tensor optimizer state and the update step.
 *
 * Two flavors, exactly as tests/vectors/README.md specifies:
 *   FPS_FLAVOR_TORCH  torch.optim.Adafactor (PyTorch >= 2.5)
 *   FPS_FLAVOR_HF     transformers' Adafactor
 * A tensor is factored iff ndim >= 2, over its last two dimensions; leading
 * dimensions are a batch of independent matrices.
 *
 * DRAFT API: the kernel work fills in the implementation; names here are the
 * contract the server and client code against. */
#ifndef FPS_ADAFACTOR_H
#define FPS_ADAFACTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define FPS_MAX_DIMS 8

/* Largest element count a tensor may have: keeps every byte count in
 * uint64_t and every index in int64_t free of overflow. */
#define FPS_MAX_NUMEL (UINT64_C(1) << 40)

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
  uint64_t step;                  /* steps applied so far */
  float rms;                      /* hf: RMS(param) before the last step */
} fps_adafactor_state_t;

#endif

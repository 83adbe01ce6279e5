/* Pieces of the Adafactor step shared by the whole-tensor step
 * (adafactor_step.c) and the row-split step (adafactor_split.c), so both
 * compute the per-step scalars and the statistics updates with the same
 * operations in the same order. Internal to common/. */
#ifndef FPS_ADAFACTOR_INTERNAL_H
#define FPS_ADAFACTOR_INTERNAL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "adafactor.h"

/* A chunk has at least this many elements (smaller work is not worth a
 * thread hand-off) and a run of rows has at most FPS_STEP_MAX_CHUNKS
 * chunks (bounds the per-chunk column scratch and the serial combine). */
#define FPS_STEP_CHUNK_ELEMS (UINT64_C(1) << 15)
#define FPS_STEP_MAX_CHUNKS 16

static inline size_t fps__chunk_count(uint64_t units, uint64_t elems_per_unit) {
  uint64_t k = units * elems_per_unit / FPS_STEP_CHUNK_ELEMS;
  if (k > FPS_STEP_MAX_CHUNKS) k = FPS_STEP_MAX_CHUNKS;
  if (k > units) k = units;
  return k ? (size_t)k : 1;
}

static inline uint64_t fps__chunk_lo(uint64_t units, size_t nchunks, size_t k) {
  return units * k / nchunks;
}

/* The per-step scalars both passes need. */
typedef struct fps__step_scalars_s {
  bool hf;
  double t;
  double w;          /* weight of the new mean: torch t^decay, hf 1 - beta2t */
  double eps1;       /* hf: added to g^2 (mean); torch: clamp of mean(row) */
  float floor;       /* clamp of V: torch eps1^2, hf 0 */
  float beta1;       /* hf momentum, else 0 */
  float sign;        /* -1 for torch maximize: U is odd in g */
  uint64_t new_step; /* the step count after this step */
} fps__step_scalars_t;

static inline void fps__step_scalars_init(fps__step_scalars_t *sc,
                                          const fps_adafactor_hparams_t *hp, uint64_t step) {
  const bool hf = hp->flavor == FPS_FLAVOR_HF;
  *sc = (fps__step_scalars_t){.hf = hf, .eps1 = hp->eps1, .sign = 1.0f};
  if (hf) {
    sc->new_step = step + 1;
    sc->t = (double)sc->new_step;
    sc->w = pow(sc->t, hp->decay); /* 1 - beta2t */
    sc->floor = 0.0f;
    sc->beta1 = hp->has_beta1 ? (float)hp->beta1 : 0.0f;
  } else {
    /* torch keeps the step in a float32 tensor: it stops at 2^24. */
    float tf = (float)step + 1.0f;
    sc->new_step = (uint64_t)tf;
    sc->t = tf;
    sc->w = pow(sc->t, hp->decay);
    sc->floor = (float)(hp->eps1 * hp->eps1);
    if (hp->maximize) sc->sign = -1.0f;
  }
}

/* torch's lerp, in double: exact at w = 1 (the state is then the mean). */
static inline double fps__lerp_torch(double a, double b, double w) {
  return fabs(w) < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w);
}

/* New row/column statistic from the old one and the mean of g^2. */
static inline double fps__stat_update(const fps__step_scalars_t *sc, double old, double mean) {
  if (sc->hf) return (1.0 - sc->w) * old + sc->w * (mean + sc->eps1);
  return fps__lerp_torch(old, mean, sc->w);
}

/* mean(r) from the sum of a matrix's R row statistics, clamped at eps1 for
 * torch (NaN kept); and whether the torch clamp V >= eps1^2 might bind
 * somewhere given the smallest row and column statistics (rmin ignores
 * NaN; a NaN mean also says "might bind"), in which case RMS(U) needs the
 * explicit pass. hf never clamps. */
static inline bool fps__fact_factors(const fps__step_scalars_t *sc, double rsum, uint64_t R,
                                     double rmin, double cmin, double *m_out) {
  double m = rsum / (double)R;
  if (!sc->hf && !(m >= sc->eps1)) m = sc->eps1 > m ? sc->eps1 : m; /* keeps NaN */
  *m_out = m;
  if (sc->hf) return false;
  double floor = (double)sc->floor;
  return !(rmin > 0 && cmin > 0 && rmin * cmin / m >= floor * (1 + 1e-6));
}

/* The whole-tensor scalars of one step from sum p^2 and sum U^2, in double
 * like upstream's Python floats. */
typedef struct fps__step_result_s {
  double rms_param, rel, lr_eff, pmul, rms_u, denom, step_size;
  float rms_f;  /* hf: RMS(param) as upstream stores it (float32) */
} fps__step_result_t;

static inline void fps__step_result(const fps_adafactor_hparams_t *hp,
                                    const fps__step_scalars_t *sc, double psq, double u2,
                                    uint64_t numel, fps__step_result_t *r) {
  r->rms_param = sqrt(psq / (double)numel);
  r->pmul = 1.0;
  r->rms_f = 0.0f;
  if (sc->hf) {
    r->rel = hp->has_lr ? hp->lr : fmin(hp->warmup_init ? 1e-6 * sc->t : 1e-2, 1.0 / sqrt(sc->t));
    /* upstream stores RMS as float32 and scales by that */
    r->rms_f = (float)r->rms_param;
    r->lr_eff = r->rel * (hp->scale_parameter ? fmax(hp->eps2, (double)r->rms_f) : 1.0);
    if (hp->weight_decay != 0) r->pmul = 1.0 - hp->weight_decay * r->lr_eff;
  } else {
    r->rel = fmin(hp->lr, 1.0 / sqrt(sc->t));
    r->lr_eff = fmax(hp->eps2, r->rms_param) * r->rel;
    if (hp->weight_decay != 0) r->pmul = 1.0 - hp->lr * hp->weight_decay;
  }
  r->rms_u = sqrt(u2 / (double)numel);
  double q = r->rms_u / hp->clip;
  r->denom = q > 1.0 ? q : 1.0; /* NaN RMS(U) gives NaN, as upstream's clamp */
  if (isnan(q)) r->denom = q;
  r->step_size = r->lr_eff / r->denom;
}

/* One matrix (or a run of its rows) of a factored tensor in nchunks chunks
 * of rows (adafactor_step.c). The whole step's pass A updates row in
 * place; the split step's keeps the old rows and fills a new array, then
 * both share the explicit RMS(U) pass and pass C, which read row. */
typedef struct fps__fact_ctx_s {
  const fps_kernels_t *k;
  const fps__step_scalars_t *sc;
  size_t rows, cols, nchunks;
  const float *g;
  const float *p;
  float *out;       /* pass C's new params: p, g or a separate buffer */
  void *out16;      /* NULL, or pass C also writes out's bf16 encoding here */
  float *mom;
  float *row;       /* this matrix's row state */
  const float *col; /* this matrix's col state (pass C) */
  const float *colf;
  double *scratch;  /* nchunks x (col partial, S partial), each cols long */
  double psq[FPS_STEP_MAX_CHUNKS];
  double u2[FPS_STEP_MAX_CHUNKS];
  double m;         /* mean(r), clamped at eps1 for torch */
  float pmul, s;    /* param multiplier (weight decay), signed step size */
} fps__fact_ctx_t;
void fps__fact_pass_u2(void *arg, size_t ck);
void fps__fact_pass_c(void *arg, size_t ck);

/* An unfactored tensor (or a block of one) as one run of n elements in
 * nchunks chunks (adafactor_step.c): pass A updates v and writes each
 * chunk's sum U^2 and sum p^2; pass C applies the update. Shared by the
 * whole step and the split one. */
typedef struct fps__var_ctx_s {
  const fps_kernels_t *k;
  const fps__step_scalars_t *sc;
  size_t n, nchunks;
  const float *g;
  const float *p;
  float *out;       /* pass C's new params: p, g or a separate buffer */
  void *out16;      /* NULL, or pass C also writes out's bf16 encoding here */
  float *v, *mom;
  float a, b, e;
  double psq[FPS_STEP_MAX_CHUNKS];
  double u2[FPS_STEP_MAX_CHUNKS];
  float pmul, s;
} fps__var_ctx_t;
void fps__var_pass_a(void *arg, size_t ck);
void fps__var_pass_c(void *arg, size_t ck);

#endif

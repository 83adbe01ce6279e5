/* The Adafactor step: per-step scalars, pass order and chunking over
 * threads. The per-element work is in the kernels (simd/).
 *
 * Memory traffic (fp32, per element of the tensor):
 *   factored (ndim >= 2), per matrix R x C:
 *     pass A  reads g and p once (8 B): row sums of g^2, column sums of g^2,
 *             sum p^2 for RMS(param). Once row i's sum is known its new row
 *             statistic r_i is known, so while the row is still in L1/L2 we
 *             accumulate S_j += g_ij^2 / r_i (no extra memory traffic).
 *             After the column update, sum U^2 = m * sum_j S_j / c_j, where
 *             m = mean r (hf) or max(mean r, eps1) (torch): U_ij^2 =
 *             g_ij^2 m / (r_i c_j) whenever no clamp binds.
 *     pass C  reads g and p, writes the new params (12 B) to p, to g (the
 *             consumed gradient buffer) or to a separate out; into p or g
 *             the line is read anyway (no extra write-allocate traffic).
 *     = 20 B/elem. torch only: if min r * min c / m < eps1^2 a clamp may
 *     bind and RMS(U) takes an explicit pass over g (+4 B = 24 B/elem).
 *   unfactored (ndim <= 1):
 *     pass A  reads g, p, v, writes v (16 B), and sums U^2 with the new v.
 *     pass C  reads g, v, p, writes p (16 B).  = 32 B/elem.
 *   hf momentum adds a read and a write of mom in pass C (+8 B/elem).
 *   a bf16 out (fps_adafactor_step_to_bf16) adds its write (+2 B/elem):
 *   each block is encoded while it is in L1.
 * Both passes are needed: the clip factor (RMS(U)) and the lr (RMS(param))
 * are whole-tensor reductions that every element's update depends on.
 *
 * Determinism: each tensor is cut into chunks whose bounds depend only on
 * the shape; each chunk writes its own partial sums, which are combined in
 * chunk order. So results are bit-identical for any thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "adafactor.h"
#include "adafactor_internal.h"
#include "simd/kernels_impl.h"

/* ---- factored ---------------------------------------------------------- */


static void fact_pass_a(void *arg, size_t ck) {
  fps__fact_ctx_t *c = arg;
  const size_t C = c->cols;
  double *col = c->scratch + 2 * C * ck, *s = col + C;
  memset(col, 0, 2 * C * sizeof(double));
  double psq = 0;
  const uint64_t lo = fps__chunk_lo(c->rows, c->nchunks, ck);
  const uint64_t hi = fps__chunk_lo(c->rows, c->nchunks, ck + 1);
  for (uint64_t i = lo; i < hi; i++) {
    double gsq, ps;
    c->k->row_stats(c->g + i * C, c->p + i * C, C, col, &gsq, &ps);
    psq += ps;
    float r = (float)fps__stat_update(c->sc, c->row[i], gsq / (double)C);
    c->row[i] = r;
    /* 1/0 = inf for an all-zero row: then S is NaN and the caller takes the
     * explicit path (torch) or NaN propagates as upstream (hf, eps1 = 0). */
    c->k->row_scaled(c->g + i * C, C, 1.0 / (double)r, s);
  }
  c->psq[ck] = psq;
}

void fps__fact_pass_u2(void *arg, size_t ck) {
  fps__fact_ctx_t *c = arg;
  const size_t C = c->cols;
  double u2 = 0;
  const uint64_t lo = fps__chunk_lo(c->rows, c->nchunks, ck);
  const uint64_t hi = fps__chunk_lo(c->rows, c->nchunks, ck + 1);
  for (uint64_t i = lo; i < hi; i++)
    u2 += c->k->row_u2_clamped(c->g + i * C, c->col, C, (float)(c->row[i] / c->m), c->sc->floor);
  c->u2[ck] = u2;
}

/* With bf16 out, pass C runs in blocks of this many elements (16 KiB of
 * fp32, within any L1): each block is updated and then encoded from L1,
 * so the encoding adds a 2 B/elem write and no read from memory. The
 * kernels are elementwise, so cutting a row into blocks changes no bit. */
#define FPS_BF16_BLOCK 4096

static void fact_row_c(const fps__fact_ctx_t *c, uint64_t i, size_t j, size_t n, float rowf) {
  const size_t C = c->cols;
  const size_t at = i * C + j;
  float *mom = c->mom ? c->mom + at : NULL;
  if (c->colf)
    c->k->apply_rowcol(c->out + at, c->p + at, c->g + at, mom, c->colf + j, n, rowf, c->pmul,
                       c->sc->beta1);
  else
    c->k->apply_elem(c->out + at, c->p + at, c->g + at, mom, c->col + j, n,
                     (float)(c->row[i] / c->m), c->sc->floor, c->s, c->pmul, c->sc->beta1);
  if (c->out16) c->k->bf16_encode((uint8_t *)c->out16 + 2 * at, c->out + at, n);
}

void fps__fact_pass_c(void *arg, size_t ck) {
  fps__fact_ctx_t *c = arg;
  const size_t C = c->cols;
  const size_t blk = c->out16 ? FPS_BF16_BLOCK : C;
  const uint64_t lo = fps__chunk_lo(c->rows, c->nchunks, ck);
  const uint64_t hi = fps__chunk_lo(c->rows, c->nchunks, ck + 1);
  for (uint64_t i = lo; i < hi; i++) {
    /* U_ij = g_ij * sqrt(m / r_i) * (1 / sqrt(c_j)), times the step. */
    float rowf = c->colf ? (float)((double)c->s * sqrt(c->m / (double)c->row[i])) : 0.0f;
    for (size_t j = 0; j < C; j += blk) fact_row_c(c, i, j, C - j < blk ? C - j : blk, rowf);
  }
}

/* mean of the row state, clamped for torch; and whether the torch clamp
 * V >= eps1^2 might bind somewhere (then RMS(U) needs the explicit pass). */
static bool fact_factors(const fps__step_scalars_t *sc, const float *row, size_t R,
                         const float *col, size_t C, double *m_out) {
  double sum = 0, rmin = INFINITY, cmin = INFINITY;
  for (size_t i = 0; i < R; i++) {
    sum += row[i];
    if (row[i] < rmin) rmin = row[i];
  }
  for (size_t j = 0; j < C; j++)
    if (col[j] < cmin) cmin = col[j];
  return fps__fact_factors(sc, sum, R, rmin, cmin, m_out);
}

/* ---- unfactored -------------------------------------------------------- */

void fps__var_pass_a(void *arg, size_t ck) {
  fps__var_ctx_t *c = arg;
  uint64_t lo = fps__chunk_lo(c->n, c->nchunks, ck), hi = fps__chunk_lo(c->n, c->nchunks, ck + 1);
  double u2 = 0, psq = 0;
  c->k->var_update(c->g + lo, c->p + lo, c->v + lo, hi - lo, c->a, c->b, c->e, c->sc->floor, &u2,
                   &psq);
  c->u2[ck] = u2;
  c->psq[ck] = psq;
}

void fps__var_pass_c(void *arg, size_t ck) {
  fps__var_ctx_t *c = arg;
  uint64_t lo = fps__chunk_lo(c->n, c->nchunks, ck), hi = fps__chunk_lo(c->n, c->nchunks, ck + 1);
  const uint64_t blk = c->out16 ? FPS_BF16_BLOCK : hi - lo;
  for (uint64_t j = lo; j < hi; j += blk) {
    size_t n = (size_t)(hi - j < blk ? hi - j : blk);
    c->k->apply_elem(c->out + j, c->p + j, c->g + j, c->mom ? c->mom + j : NULL, c->v + j, n, 1.0f,
                     c->sc->floor, c->s, c->pmul, c->sc->beta1);
    if (c->out16) c->k->bf16_encode((uint8_t *)c->out16 + 2 * j, c->out + j, n);
  }
}

/* ---- the step ---------------------------------------------------------- */

uint64_t fps_adafactor_step_bytes(const fps_adafactor_state_t *st) {
  if (!st) return 0;
  uint64_t per = st->factored ? 20 : 32;
  if (st->mom) per += 8;
  uint64_t b = per * st->numel;
  if (st->factored) b += 8 * st->batch * (st->rows + st->cols); /* state read + write */
  return b;
}

int fps_adafactor_step_check(const fps_adafactor_hparams_t *hp, const fps_adafactor_state_t *st) {
  if (!hp || !st || st->numel == 0) return FPS_EINVAL;
  int rc = fps_adafactor_validate(hp, NULL, 0);
  if (rc) return rc;
  const bool hf = hp->flavor == FPS_FLAVOR_HF;
  if ((hf && hp->has_beta1) != (st->mom != NULL) ||
      (st->factored ? !st->row || !st->col : !st->var))
    return FPS_EINVAL; /* state made for other settings */
  return 0;
}

size_t fps_adafactor_scratch_len(const fps_adafactor_state_t *st) {
  if (!st || !st->factored) return 0;
  const size_t C = (size_t)st->cols;
  return 2 * fps__chunk_count((size_t)st->rows, C) * C + C / 2 + 1;
}

int fps_adafactor_step(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                       fps_adafactor_state_t *st, float *param, const float *grad,
                       fps_pool_t *pool, fps_adafactor_trace_t *trace) {
  return fps_adafactor_step_to(k, hp, st, param, grad, param, pool, NULL, trace);
}

int fps_adafactor_step_to(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                          fps_adafactor_state_t *st, const float *param, const float *grad,
                          float *out, fps_pool_t *pool, double *scratch,
                          fps_adafactor_trace_t *trace) {
  return fps_adafactor_step_to_bf16(k, hp, st, param, grad, out, NULL, pool, scratch, trace);
}

int fps_adafactor_step_to_bf16(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                               fps_adafactor_state_t *st, const float *param, const float *grad,
                               float *out, void *out_bf16, fps_pool_t *pool, double *scratch,
                               fps_adafactor_trace_t *trace) {
  if (!param || !grad || !out) return FPS_EINVAL;
  int rc = fps_adafactor_step_check(hp, st);
  if (rc) return rc;
  if (!k) k = fps_kernels_best();
  const bool hf = hp->flavor == FPS_FLAVOR_HF;

  fps__step_scalars_t sc;
  fps__step_scalars_init(&sc, hp, st->step);
  const uint64_t new_step = sc.new_step;

  const size_t C = (size_t)st->cols, R = (size_t)st->rows;
  const uint64_t numel = st->numel;
  double psq = 0, u2 = 0;
  uint64_t bytes = fps_adafactor_step_bytes(st);
  if (out_bf16) bytes += 2 * numel; /* the encoding's write */
  bool explicit_rms = false;
  fps__fact_ctx_t fc;
  fps__var_ctx_t vc;

  /* Pass A: statistics, RMS(param) and sum U^2. */
  if (st->factored) {
    memset(&fc, 0, sizeof fc);
    fc.k = k;
    fc.sc = &sc;
    fc.rows = R;
    fc.cols = C;
    fc.nchunks = fps__chunk_count(R, C);
    /* Chunk partials, plus C floats of column factors for pass C. Freed at
     * the end of the step: a shard holds many tensors and this (16 B x C
     * per chunk) is not optimizer state worth keeping between steps. */
    fc.scratch = scratch ? scratch : fps_malloc(fps_adafactor_scratch_len(st) * sizeof(double));
    if (!fc.scratch) return FPS_ENOMEM;
    for (uint64_t mtx = 0; mtx < st->batch; mtx++) {
      fc.g = grad + mtx * R * C;
      fc.p = param + mtx * R * C;
      fc.row = st->row + mtx * R;
      float *col = st->col + mtx * C;
      fps_pool_run(pool, fc.nchunks, fact_pass_a, &fc);
      for (size_t ck = 0; ck < fc.nchunks; ck++) psq += fc.psq[ck];
      /* combine the chunks' column partials in chunk order */
      double *c0 = fc.scratch, *s0 = c0 + C, ssum = 0;
      for (size_t j = 0; j < C; j++) {
        double cs = c0[j], ss = s0[j];
        for (size_t ck = 1; ck < fc.nchunks; ck++) {
          cs += fc.scratch[2 * C * ck + j];
          ss += fc.scratch[2 * C * ck + C + j];
        }
        col[j] = (float)fps__stat_update(&sc, col[j], cs / (double)R);
        ssum += ss / (double)col[j];
      }
      double m;
      if (fact_factors(&sc, fc.row, R, col, C, &m)) {
        explicit_rms = true;
        bytes += 4 * R * C;
        fc.col = col;
        fc.m = m;
        fps_pool_run(pool, fc.nchunks, fps__fact_pass_u2, &fc);
        for (size_t ck = 0; ck < fc.nchunks; ck++) u2 += fc.u2[ck];
      } else {
        u2 += m * ssum;
      }
    }
  } else {
    memset(&vc, 0, sizeof vc);
    vc.k = k;
    vc.sc = &sc;
    vc.n = (size_t)numel;
    vc.nchunks = fps__chunk_count(numel, 1);
    vc.g = grad;
    vc.p = param;
    vc.out = out;
    vc.out16 = out_bf16;
    vc.v = st->var;
    vc.mom = st->mom;
    vc.a = (float)(1.0 - sc.w);
    vc.b = (float)sc.w;
    vc.e = hf ? (float)hp->eps1 : 0.0f;
    fps_pool_run(pool, vc.nchunks, fps__var_pass_a, &vc);
    for (size_t ck = 0; ck < vc.nchunks; ck++) {
      psq += vc.psq[ck];
      u2 += vc.u2[ck];
    }
  }

  /* Per-step scalars, in double like upstream's Python floats. */
  fps__step_result_t res;
  fps__step_result(hp, &sc, psq, u2, numel, &res);
  if (hf) st->rms = res.rms_f;
  const double rms_param = res.rms_param, rel = res.rel, lr_eff = res.lr_eff, pmul = res.pmul,
               rms_u = res.rms_u, denom = res.denom, step_size = res.step_size;

  /* Pass C: the update. */
  if (st->factored) {
    fc.pmul = (float)pmul;
    fc.s = (float)(sc.sign * step_size);
    float *colf = (float *)(fc.scratch + 2 * fc.nchunks * C);
    for (uint64_t mtx = 0; mtx < st->batch; mtx++) {
      fc.g = grad + mtx * R * C;
      fc.p = param + mtx * R * C;
      fc.out = out + mtx * R * C;
      fc.out16 = out_bf16 ? (uint8_t *)out_bf16 + 2 * mtx * R * C : NULL;
      fc.mom = st->mom ? st->mom + mtx * R * C : NULL;
      fc.row = st->row + mtx * R;
      fc.col = st->col + mtx * C;
      double m;
      if (fact_factors(&sc, fc.row, R, fc.col, C, &m)) {
        fc.colf = NULL;
      } else {
        for (size_t j = 0; j < C; j++) colf[j] = 1.0f / sqrtf(fc.col[j]);
        fc.colf = colf;
      }
      fc.m = m;
      fps_pool_run(pool, fc.nchunks, fps__fact_pass_c, &fc);
    }
  } else {
    vc.pmul = (float)pmul;
    vc.s = (float)(sc.sign * step_size);
    fps_pool_run(pool, vc.nchunks, fps__var_pass_c, &vc);
  }

  if (st->factored && !scratch) fps_free(fc.scratch);
  st->step = new_step;
  if (trace) {
    trace->step = new_step;
    trace->rel_step = rel;
    trace->rms_param = rms_param;
    trace->lr = lr_eff;
    trace->beta2t = 1.0 - sc.w;
    trace->rms_update = rms_u;
    trace->clip_denom = denom;
    trace->step_size = step_size;
    trace->explicit_rms = explicit_rms;
    trace->bytes = bytes;
  }
  return 0;
}

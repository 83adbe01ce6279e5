/* The kernel function table (internal to common/).
 *
 * Each entry works on one contiguous run of floats (one matrix row, or one
 * chunk of a vector); adafactor_step.c does the per-step scalar math, the
 * chunking over threads and the order of the passes. Every variant must
 * compute the elementwise formulas below with the same operations in the
 * same order (no FMA contraction there), so parameters differ between
 * variants only through the order of the double-precision sums. */
#ifndef FPS_SIMD_KERNELS_IMPL_H
#define FPS_SIMD_KERNELS_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

struct fps_kernels_s {
  const char *name;

  /* Factored pass A, one row: *gsq = sum g^2, *psq = sum p^2 (both double),
   * and col[j] += (double)g[j]^2 for every j. */
  void (*row_stats)(const float *g, const float *p, size_t n, double *col, double *gsq,
                    double *psq);

  /* Factored pass A, same row again while it is in cache:
   * s[j] += (double)g[j]^2 * inv_r. */
  void (*row_scaled)(const float *g, size_t n, double inv_r, double *s);

  /* Unfactored pass A: v[j] = a*v[j] + b*(g[j]*g[j] + e) (float), and
   * *u2 += g^2 / max(v[j], floor), *psq += p^2 (double). */
  void (*var_update)(const float *g, const float *p, float *v, size_t n, float a, float b,
                     float e, float floor, double *u2, double *psq);

  /* Explicit RMS pass (torch when a clamp may bind):
   * returns sum over j of g^2 / max(rr * c[j], floor), in double. */
  double (*row_u2_clamped)(const float *g, const float *c, size_t n, float rr, float floor);

  /* Pass C, factored: u = (g[j] * colf[j]) * rowf; then momentum if mom
   * (m = beta1*m + (1-beta1)*u; u = m); out[j] = p[j]*pmul - u.
   * out may be p (in place) or g (the gradient buffer becomes the new
   * parameters); any other overlap is not allowed. Element j is read
   * before out[j] is written and never read again, so both aliasings give
   * the same bits as a separate out: no `restrict` here. */
  void (*apply_rowcol)(float *out, const float *p, const float *g, float *mom, const float *colf,
                       size_t n, float rowf, float pmul, float beta1);

  /* Pass C, elementwise variance: u = (g[j] * (1 / sqrt(max(rr*c[j], floor)))) * s,
   * then momentum and out as apply_rowcol (same aliasing rule). Used for
   * 0/1-D tensors (rr = 1, c = the variance) and for torch's clamped
   * factored case. */
  void (*apply_elem)(float *out, const float *p, const float *g, float *mom, const float *c,
                     size_t n, float rr, float floor, float s, float pmul, float beta1);

  /* The sync round's sum, one worker at a time in worker-id order:
   * dst[j] += src[j] (fp32), then once per round div_f32: dst[j] /= d
   * (a true division, not a multiply by 1/d). Bit-identical in every
   * variant, so a round's result never depends on the CPU. */
  void (*add_f32)(float *dst, const float *src, size_t n);
  void (*div_f32)(float *dst, size_t n, float d);

  /* fp32 -> bf16 exactly as fps_f32_to_bf16() (round to nearest even, NaN
   * quieted, sign kept), written little-endian at dst (any alignment). */
  void (*bf16_encode)(void *dst, const float *src, size_t n);

  /* bf16 (little-endian, any alignment) -> fp32, exact. Returns the index
   * of the first element that is not a valid gradient (exponent field of
   * 0xBE or more: |x| >= 2^63, Inf, NaN; see dtype.h), or n. */
  size_t (*bf16_decode)(float *dst, const void *src, size_t n);

  /* bf16 -> fp32 exactly as bf16_decode, without the gradient check, for
   * a dst that is not read again soon (a reply written into the caller's
   * parameter array): the x86 variants store whole 64-byte lines with
   * non-temporal stores, which skip reading dst's lines into the cache
   * first (6 B/elem of memory traffic instead of 10), then sfence. dst must
   * be 4-byte aligned (a float array); src any alignment. */
  void (*bf16_widen_nt)(float *dst, const void *src, size_t n);

  /* The wire gradient's one pass in (the sync sum and the staging decode):
   * src holds n little-endian fp32 (sum_f32, decode_f32) or bf16
   * (sum_bf16) values at any alignment. Each returns the index of the
   * first value that is not a valid gradient (bf16_decode's rule), or n;
   * elements before that index are done, dst/acc from it on is untouched,
   * so a caller's record of what was summed stays exact. The additions are
   * add_f32's (one fp32 add per element, no FMA), so the sum is
   * bit-identical to decoding first and then add_f32 in every variant. */
  size_t (*sum_f32)(float *acc, const void *src, size_t n);    /* acc[j] += le_f32(src[j]) */
  size_t (*sum_bf16)(float *acc, const void *src, size_t n);   /* acc[j] += bf16(src[j]) */
  size_t (*decode_f32)(float *dst, const void *src, size_t n); /* dst[j] = le_f32(src[j]) */
};

extern const fps_kernels_t fps__kernels_scalar;
#if defined(__x86_64__) && defined(FPS_HAVE_AVX2)
extern const fps_kernels_t fps__kernels_avx2;
#endif
#if defined(__x86_64__) && defined(FPS_HAVE_AVX512)
extern const fps_kernels_t fps__kernels_avx512;
#endif
#if defined(__aarch64__)
extern const fps_kernels_t fps__kernels_neon;
#endif

#endif

/* AVX2+FMA kernels (x86-64; this file alone is built with -mavx2 -mfma).
 *
 * Elementwise results (state v, p, mom) are computed with exactly the
 * scalar reference's operations in the same order: no FMA there, and
 * 1/sqrt is sqrt + divide (both correctly rounded), never the rsqrt
 * approximation. So they are bit-identical to kernels_scalar.c given the
 * same per-step scalars. Only the double-precision sums (g^2, p^2, U^2)
 * use 8 lanes and FMA, so they differ from scalar in the last bits.
 *
 * The step is memory-bound (see adafactor_step.c for the 20 B/elem
 * accounting), so these loops aim to keep the load ports busy, not to save
 * arithmetic: two 4-double accumulators per sum hide the add latency. */
#include <immintrin.h>
#include <math.h>

#include "kernels_impl.h"

static inline double hsum_pd(__m256d a, __m256d b) {
  __m256d s = _mm256_add_pd(a, b);
  __m128d lo = _mm256_castpd256_pd128(s), hi = _mm256_extractf128_pd(s, 1);
  lo = _mm_add_pd(lo, hi);
  return _mm_cvtsd_f64(_mm_add_sd(lo, _mm_unpackhi_pd(lo, lo)));
}

static void row_stats_avx2(const float *g, const float *p, size_t n, double *col, double *gsq,
                           double *psq) {
  __m256d ga0 = _mm256_setzero_pd(), ga1 = ga0, pa0 = ga0, pa1 = ga0;
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 gv = _mm256_loadu_ps(g + j), pv = _mm256_loadu_ps(p + j);
    __m256d g0 = _mm256_cvtps_pd(_mm256_castps256_ps128(gv));
    __m256d g1 = _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1));
    __m256d p0 = _mm256_cvtps_pd(_mm256_castps256_ps128(pv));
    __m256d p1 = _mm256_cvtps_pd(_mm256_extractf128_ps(pv, 1));
    __m256d q0 = _mm256_mul_pd(g0, g0), q1 = _mm256_mul_pd(g1, g1);
    /* column sums: same mul-then-add as scalar, so col state is identical */
    _mm256_storeu_pd(col + j, _mm256_add_pd(_mm256_loadu_pd(col + j), q0));
    _mm256_storeu_pd(col + j + 4, _mm256_add_pd(_mm256_loadu_pd(col + j + 4), q1));
    ga0 = _mm256_add_pd(ga0, q0);
    ga1 = _mm256_add_pd(ga1, q1);
    pa0 = _mm256_fmadd_pd(p0, p0, pa0);
    pa1 = _mm256_fmadd_pd(p1, p1, pa1);
  }
  double gs = hsum_pd(ga0, ga1), ps = hsum_pd(pa0, pa1);
  for (; j < n; j++) {
    double gd = g[j], pd = p[j], g2 = gd * gd;
    gs += g2;
    ps += pd * pd;
    col[j] += g2;
  }
  *gsq = gs;
  *psq = ps;
}

static void row_scaled_avx2(const float *g, size_t n, double inv_r, double *s) {
  const __m256d ir = _mm256_set1_pd(inv_r);
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 gv = _mm256_loadu_ps(g + j);
    __m256d g0 = _mm256_cvtps_pd(_mm256_castps256_ps128(gv));
    __m256d g1 = _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1));
    __m256d t0 = _mm256_mul_pd(_mm256_mul_pd(g0, g0), ir);
    __m256d t1 = _mm256_mul_pd(_mm256_mul_pd(g1, g1), ir);
    _mm256_storeu_pd(s + j, _mm256_add_pd(_mm256_loadu_pd(s + j), t0));
    _mm256_storeu_pd(s + j + 4, _mm256_add_pd(_mm256_loadu_pd(s + j + 4), t1));
  }
  for (; j < n; j++) {
    double gd = g[j];
    s[j] += gd * gd * inv_r;
  }
}

static void var_update_avx2(const float *g, const float *p, float *v, size_t n, float a, float b,
                            float e, float floor, double *u2, double *psq) {
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b), ev = _mm256_set1_ps(e);
  const __m256 fv = _mm256_set1_ps(floor);
  __m256d ua0 = _mm256_setzero_pd(), ua1 = ua0, pa0 = ua0, pa1 = ua0;
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 gv = _mm256_loadu_ps(g + j), pv = _mm256_loadu_ps(p + j);
    __m256 sq = _mm256_add_ps(_mm256_mul_ps(gv, gv), ev);
    __m256 nv = _mm256_add_ps(_mm256_mul_ps(av, _mm256_loadu_ps(v + j)), _mm256_mul_ps(bv, sq));
    _mm256_storeu_ps(v + j, nv);
    /* max_ps(floor, nv) returns nv when nv is NaN, like the scalar ?: */
    __m256 den = _mm256_max_ps(fv, nv);
    __m256d g0 = _mm256_cvtps_pd(_mm256_castps256_ps128(gv));
    __m256d g1 = _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1));
    __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(den));
    __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(den, 1));
    ua0 = _mm256_add_pd(ua0, _mm256_div_pd(_mm256_mul_pd(g0, g0), d0));
    ua1 = _mm256_add_pd(ua1, _mm256_div_pd(_mm256_mul_pd(g1, g1), d1));
    __m256d p0 = _mm256_cvtps_pd(_mm256_castps256_ps128(pv));
    __m256d p1 = _mm256_cvtps_pd(_mm256_extractf128_ps(pv, 1));
    pa0 = _mm256_fmadd_pd(p0, p0, pa0);
    pa1 = _mm256_fmadd_pd(p1, p1, pa1);
  }
  double us = hsum_pd(ua0, ua1), ps = hsum_pd(pa0, pa1);
  for (; j < n; j++) {
    float sq = g[j] * g[j] + e;
    float nv = a * v[j] + b * sq;
    v[j] = nv;
    float den = floor > nv ? floor : nv;
    double gd = g[j], pd = p[j];
    us += gd * gd / den;
    ps += pd * pd;
  }
  *u2 += us;
  *psq += ps;
}

static double row_u2_clamped_avx2(const float *g, const float *c, size_t n, float rr,
                                  float floor) {
  const __m256 rv = _mm256_set1_ps(rr), fv = _mm256_set1_ps(floor);
  __m256d ua0 = _mm256_setzero_pd(), ua1 = ua0;
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 gv = _mm256_loadu_ps(g + j);
    __m256 den = _mm256_max_ps(fv, _mm256_mul_ps(rv, _mm256_loadu_ps(c + j)));
    __m256d g0 = _mm256_cvtps_pd(_mm256_castps256_ps128(gv));
    __m256d g1 = _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1));
    __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(den));
    __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(den, 1));
    ua0 = _mm256_add_pd(ua0, _mm256_div_pd(_mm256_mul_pd(g0, g0), d0));
    ua1 = _mm256_add_pd(ua1, _mm256_div_pd(_mm256_mul_pd(g1, g1), d1));
  }
  double us = hsum_pd(ua0, ua1);
  for (; j < n; j++) {
    float v = rr * c[j];
    float den = floor > v ? floor : v;
    double gd = g[j];
    us += gd * gd / den;
  }
  return us;
}

static void apply_rowcol_avx2(float *p, const float *g, float *mom, const float *colf, size_t n,
                              float rowf, float pmul, float beta1) {
  const __m256 rv = _mm256_set1_ps(rowf), mv = _mm256_set1_ps(pmul);
  size_t j = 0;
  if (mom) {
    const float omb = 1.0f - beta1;
    const __m256 b1 = _mm256_set1_ps(beta1), ob = _mm256_set1_ps(omb);
    for (; j + 8 <= n; j += 8) {
      __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
      __m256 m = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mom + j)), _mm256_mul_ps(ob, u));
      _mm256_storeu_ps(mom + j, m);
      _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), m));
    }
    for (; j < n; j++) {
      float u = (g[j] * colf[j]) * rowf;
      float m = beta1 * mom[j] + omb * u;
      mom[j] = m;
      p[j] = p[j] * pmul - m;
    }
    return;
  }
  for (; j + 16 <= n; j += 16) {
    __m256 u0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
    __m256 u1 =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j + 8), _mm256_loadu_ps(colf + j + 8)), rv);
    _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u0));
    _mm256_storeu_ps(p + j + 8, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), mv), u1));
  }
  for (; j + 8 <= n; j += 8) {
    __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
    _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u));
  }
  for (; j < n; j++) {
    float u = (g[j] * colf[j]) * rowf;
    p[j] = p[j] * pmul - u;
  }
}

static void apply_elem_avx2(float *p, const float *g, float *mom, const float *c, size_t n,
                            float rr, float floor, float s, float pmul, float beta1) {
  const float omb = 1.0f - beta1;
  const __m256 rv = _mm256_set1_ps(rr), fv = _mm256_set1_ps(floor), sv = _mm256_set1_ps(s);
  const __m256 mv = _mm256_set1_ps(pmul), one = _mm256_set1_ps(1.0f);
  const __m256 b1 = _mm256_set1_ps(beta1), ob = _mm256_set1_ps(omb);
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 den = _mm256_max_ps(fv, _mm256_mul_ps(rv, _mm256_loadu_ps(c + j)));
    __m256 inv = _mm256_div_ps(one, _mm256_sqrt_ps(den));
    __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), inv), sv);
    if (mom) {
      u = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mom + j)), _mm256_mul_ps(ob, u));
      _mm256_storeu_ps(mom + j, u);
    }
    _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u));
  }
  for (; j < n; j++) {
    float v = rr * c[j];
    float den = floor > v ? floor : v;
    float u = (g[j] * (1.0f / sqrtf(den))) * s;
    if (mom) {
      u = beta1 * mom[j] + omb * u;
      mom[j] = u;
    }
    p[j] = p[j] * pmul - u;
  }
}

const fps_kernels_t fps__kernels_avx2 = {
    .name = "avx2",
    .row_stats = row_stats_avx2,
    .row_scaled = row_scaled_avx2,
    .var_update = var_update_avx2,
    .row_u2_clamped = row_u2_clamped_avx2,
    .apply_rowcol = apply_rowcol_avx2,
    .apply_elem = apply_elem_avx2,
};

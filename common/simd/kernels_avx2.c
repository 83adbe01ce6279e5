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
#include <stdint.h>
#include <string.h>

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

static void apply_rowcol_avx2(float *out, const float *p, const float *g, float *mom,
                              const float *colf, size_t n, float rowf, float pmul, float beta1) {
  const __m256 rv = _mm256_set1_ps(rowf), mv = _mm256_set1_ps(pmul);
  size_t j = 0;
  if (mom) {
    const float omb = 1.0f - beta1;
    const __m256 b1 = _mm256_set1_ps(beta1), ob = _mm256_set1_ps(omb);
    for (; j + 8 <= n; j += 8) {
      __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
      __m256 m = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mom + j)), _mm256_mul_ps(ob, u));
      _mm256_storeu_ps(mom + j, m);
      _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), m));
    }
    for (; j < n; j++) {
      float u = (g[j] * colf[j]) * rowf;
      float m = beta1 * mom[j] + omb * u;
      mom[j] = m;
      out[j] = p[j] * pmul - m;
    }
    return;
  }
  for (; j + 16 <= n; j += 16) {
    __m256 u0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
    __m256 u1 =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j + 8), _mm256_loadu_ps(colf + j + 8)), rv);
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u0));
    _mm256_storeu_ps(out + j + 8,
                     _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), mv), u1));
  }
  for (; j + 8 <= n; j += 8) {
    __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + j), _mm256_loadu_ps(colf + j)), rv);
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u));
  }
  for (; j < n; j++) {
    float u = (g[j] * colf[j]) * rowf;
    out[j] = p[j] * pmul - u;
  }
}

static void apply_elem_avx2(float *out, const float *p, const float *g, float *mom, const float *c,
                            size_t n, float rr, float floor, float s, float pmul, float beta1) {
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
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), mv), u));
  }
  for (; j < n; j++) {
    float v = rr * c[j];
    float den = floor > v ? floor : v;
    float u = (g[j] * (1.0f / sqrtf(den))) * s;
    if (mom) {
      u = beta1 * mom[j] + omb * u;
      mom[j] = u;
    }
    out[j] = p[j] * pmul - u;
  }
}

static void add_f32_avx2(float *dst, const float *src, size_t n) {
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 a0 = _mm256_add_ps(_mm256_loadu_ps(dst + j), _mm256_loadu_ps(src + j));
    __m256 a1 = _mm256_add_ps(_mm256_loadu_ps(dst + j + 8), _mm256_loadu_ps(src + j + 8));
    _mm256_storeu_ps(dst + j, a0);
    _mm256_storeu_ps(dst + j + 8, a1);
  }
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_add_ps(_mm256_loadu_ps(dst + j), _mm256_loadu_ps(src + j)));
  for (; j < n; j++) dst[j] += src[j];
}

static void div_f32_avx2(float *dst, size_t n, float d) {
  const __m256 dv = _mm256_set1_ps(d);
  size_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_div_ps(_mm256_loadu_ps(dst + j), dv));
  for (; j < n; j++) dst[j] /= d;
}

/* The same integer rounding as fps_f32_to_bf16() (dtype.c), 8 lanes. */
static inline __m256i bf16_round8(__m256i u) {
  /* both sides are below 2^31, so the signed compare is the unsigned one */
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                   _mm256_set1_epi32(0x7f800000));
  __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i q = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(r, q, nan);
}

static uint16_t bf16_one(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void bf16_encode_avx2(void *dst, const float *src, size_t n) {
  unsigned char *d = dst;
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256i a = bf16_round8(_mm256_castps_si256(_mm256_loadu_ps(src + j)));
    __m256i b = bf16_round8(_mm256_castps_si256(_mm256_loadu_ps(src + j + 8)));
    /* packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7; reorder */
    __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256((__m256i *)(void *)(d + 2 * j), h);
  }
  for (; j < n; j++) {
    uint16_t h = bf16_one(src[j]);
    memcpy(d + 2 * j, &h, 2);
  }
}

static size_t bf16_decode_avx2(float *dst, const void *src, size_t n) {
  const unsigned char *s = src;
  const __m256i expm = _mm256_set1_epi32(0x7f800000), lim1 = _mm256_set1_epi32(0x5f000000 - 1);
  size_t bad = n, j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256i u = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(s + 2 * j))), 16);
    _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(u));
    if (bad == n) {
      int hit = _mm256_movemask_ps(
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(u, expm), lim1)));
      if (hit) bad = j + (size_t)__builtin_ctz((unsigned)hit);
    }
  }
  for (; j < n; j++) {
    uint16_t h;
    memcpy(&h, s + 2 * j, 2);
    if (bad == n && (h & 0x7f80u) >= 0x5f00u) bad = j;
    uint32_t u = (uint32_t)h << 16;
    memcpy(dst + j, &u, 4);
  }
  return bad;
}

/* Ordinary stores up to dst's 32-byte alignment, then 8 lanes at a time
 * with non-temporal stores, the tail ordinary again. */
static void bf16_widen_nt_avx2(float *dst, const void *src, size_t n) {
  const unsigned char *s = src;
  size_t j = 0;
  for (; j < n && ((uintptr_t)(dst + j) & 31); j++) {
    uint16_t h;
    memcpy(&h, s + 2 * j, 2);
    uint32_t u = (uint32_t)h << 16;
    memcpy(dst + j, &u, 4);
  }
  for (; j + 8 <= n; j += 8) {
    __m256i u = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(s + 2 * j))), 16);
    _mm256_stream_si256((__m256i *)(void *)(dst + j), u);
  }
  _mm_sfence(); /* the stores are visible before whatever publishes dst */
  if (j < n) (void)bf16_decode_avx2(dst + j, s + 2 * j, n - j);
}

/* ---- the wire gradient's one pass in: check, convert, sum ---- */

/* 8 elements of little-endian fp32 (bf16 = 0) or bf16 data as fp32 bits;
 * the bf16 widening is a shift, exact. */
static inline __m256i wire_load8(const unsigned char *s, size_t j, int bf16) {
  if (bf16)
    return _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(s + 2 * j))), 16);
  return _mm256_loadu_si256((const __m256i *)(const void *)(s + 4 * j));
}

/* Lanes whose exponent field is 0xBE or more (dtype.h's rule); both sides
 * are below 2^31, so the signed compare is the unsigned one. */
static inline __m256i wire_bad8(__m256i u) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                            _mm256_set1_epi32(0x5f000000 - 1));
}

static inline __m256 wire_put8(float *dst, __m256i u, int add) {
  __m256 f = _mm256_castsi256_ps(u);
  return add ? _mm256_add_ps(_mm256_loadu_ps(dst), f) : f;
}

/* 16 then 8 lanes while no lane is bad; a block with a bad lane, and the
 * tail, go element by element, so nothing at or after the bad one is
 * written. */
static inline size_t wire_in_avx2(float *dst, const void *src, size_t n, int bf16, int add) {
  const unsigned char *s = src;
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256i u0 = wire_load8(s, j, bf16), u1 = wire_load8(s, j + 8, bf16);
    if (!_mm256_testz_si256(_mm256_or_si256(wire_bad8(u0), wire_bad8(u1)), _mm256_set1_epi32(-1)))
      break;
    __m256 a0 = wire_put8(dst + j, u0, add), a1 = wire_put8(dst + j + 8, u1, add);
    _mm256_storeu_ps(dst + j, a0);
    _mm256_storeu_ps(dst + j + 8, a1);
  }
  for (; j + 8 <= n; j += 8) {
    __m256i u = wire_load8(s, j, bf16);
    if (!_mm256_testz_si256(wire_bad8(u), wire_bad8(u))) break;
    _mm256_storeu_ps(dst + j, wire_put8(dst + j, u, add));
  }
  for (; j < n; j++) {
    uint32_t u;
    if (bf16) {
      uint16_t h;
      memcpy(&h, s + 2 * j, 2);
      u = (uint32_t)h << 16;
    } else {
      memcpy(&u, s + 4 * j, 4);
    }
    if ((u & 0x7f800000u) >= 0x5f000000u) return j;
    float f;
    memcpy(&f, &u, 4);
    if (add) dst[j] += f;
    else dst[j] = f;
  }
  return n;
}

static size_t sum_f32_avx2(float *acc, const void *src, size_t n) {
  return wire_in_avx2(acc, src, n, 0, 1);
}
static size_t sum_bf16_avx2(float *acc, const void *src, size_t n) {
  return wire_in_avx2(acc, src, n, 1, 1);
}
static size_t decode_f32_avx2(float *dst, const void *src, size_t n) {
  return wire_in_avx2(dst, src, n, 0, 0);
}

const fps_kernels_t fps__kernels_avx2 = {
    .name = "avx2",
    .row_stats = row_stats_avx2,
    .row_scaled = row_scaled_avx2,
    .var_update = var_update_avx2,
    .row_u2_clamped = row_u2_clamped_avx2,
    .apply_rowcol = apply_rowcol_avx2,
    .apply_elem = apply_elem_avx2,
    .add_f32 = add_f32_avx2,
    .div_f32 = div_f32_avx2,
    .bf16_encode = bf16_encode_avx2,
    .bf16_decode = bf16_decode_avx2,
    .bf16_widen_nt = bf16_widen_nt_avx2,
    .sum_f32 = sum_f32_avx2,
    .sum_bf16 = sum_bf16_avx2,
    .decode_f32 = decode_f32_avx2,
};

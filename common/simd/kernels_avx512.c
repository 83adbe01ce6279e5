/* AVX-512 kernels (x86-64; this file alone is built with -mavx512f
 * -mavx512bw -mavx512vl, and kernels_select.c runs it only when CPUID and
 * XGETBV report F, BW and VL plus the opmask and ZMM state).
 *
 * Same contract as kernels_avx2.c: elementwise results (state v, column
 * and S sums, p, mom, the sync sum, bf16 bits) use exactly the scalar
 * reference's operations in the same order (no FMA, sqrt + divide rather
 * than the rsqrt14 estimate), so they are bit-identical to
 * kernels_scalar.c. Only the double-precision sums (g^2, p^2, U^2) use
 * lanes and FMA, and so differ from scalar in their last bits.
 *
 * Tails run as one masked iteration instead of a scalar loop: masked
 * loads never touch memory past n (no fault, no read of a neighbour's
 * bytes), masked stores never write it, and the masked-off lanes are kept
 * out of every sum (mask_add) and every division (maskz_div).
 *
 * bf16: AVX512-BF16's vcvtneps2bf16 rounds to nearest even and quiets
 * NaNs like fps_f32_to_bf16(), but it treats denormal inputs as zero and
 * flushes denormal results, which the scalar reference does not. So the
 * rounding here is done with integer ops (add 0x7fff + lsb, NaN fix-up,
 * narrow with vpmovdw), exact for every input bit pattern. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels_impl.h"

static inline __mmask16 tail_mask(size_t left) {
  return (__mmask16)((1u << left) - 1u); /* left < 16 */
}

static inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d hi_pd(__m512 v) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static void row_stats_avx512(const float *g, const float *p, size_t n, double *col, double *gsq,
                             double *psq) {
  __m512d ga0 = _mm512_setzero_pd(), ga1 = ga0, pa0 = ga0, pa1 = ga0;
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 gv = _mm512_loadu_ps(g + j), pv = _mm512_loadu_ps(p + j);
    __m512d g0 = lo_pd(gv), g1 = hi_pd(gv), p0 = lo_pd(pv), p1 = hi_pd(pv);
    __m512d q0 = _mm512_mul_pd(g0, g0), q1 = _mm512_mul_pd(g1, g1);
    _mm512_storeu_pd(col + j, _mm512_add_pd(_mm512_loadu_pd(col + j), q0));
    _mm512_storeu_pd(col + j + 8, _mm512_add_pd(_mm512_loadu_pd(col + j + 8), q1));
    ga0 = _mm512_add_pd(ga0, q0);
    ga1 = _mm512_add_pd(ga1, q1);
    pa0 = _mm512_fmadd_pd(p0, p0, pa0);
    pa1 = _mm512_fmadd_pd(p1, p1, pa1);
  }
  if (j < n) {
    __mmask16 m = tail_mask(n - j);
    __mmask8 m0 = (__mmask8)m, m1 = (__mmask8)(m >> 8);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + j), pv = _mm512_maskz_loadu_ps(m, p + j);
    __m512d g0 = lo_pd(gv), g1 = hi_pd(gv), p0 = lo_pd(pv), p1 = hi_pd(pv);
    __m512d q0 = _mm512_mul_pd(g0, g0), q1 = _mm512_mul_pd(g1, g1);
    _mm512_mask_storeu_pd(col + j, m0, _mm512_add_pd(_mm512_maskz_loadu_pd(m0, col + j), q0));
    _mm512_mask_storeu_pd(col + j + 8, m1,
                          _mm512_add_pd(_mm512_maskz_loadu_pd(m1, col + j + 8), q1));
    /* masked-off lanes hold 0 * 0 = +0: adding them changes no sum */
    ga0 = _mm512_add_pd(ga0, q0);
    ga1 = _mm512_add_pd(ga1, q1);
    pa0 = _mm512_fmadd_pd(p0, p0, pa0);
    pa1 = _mm512_fmadd_pd(p1, p1, pa1);
  }
  *gsq = _mm512_reduce_add_pd(_mm512_add_pd(ga0, ga1));
  *psq = _mm512_reduce_add_pd(_mm512_add_pd(pa0, pa1));
}

static void row_scaled_avx512(const float *g, size_t n, double inv_r, double *s) {
  const __m512d ir = _mm512_set1_pd(inv_r);
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 gv = _mm512_loadu_ps(g + j);
    __m512d g0 = lo_pd(gv), g1 = hi_pd(gv);
    __m512d t0 = _mm512_mul_pd(_mm512_mul_pd(g0, g0), ir);
    __m512d t1 = _mm512_mul_pd(_mm512_mul_pd(g1, g1), ir);
    _mm512_storeu_pd(s + j, _mm512_add_pd(_mm512_loadu_pd(s + j), t0));
    _mm512_storeu_pd(s + j + 8, _mm512_add_pd(_mm512_loadu_pd(s + j + 8), t1));
  }
  if (j < n) {
    __mmask16 m = tail_mask(n - j);
    __mmask8 m0 = (__mmask8)m, m1 = (__mmask8)(m >> 8);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
    __m512d g0 = lo_pd(gv), g1 = hi_pd(gv);
    __m512d t0 = _mm512_mul_pd(_mm512_mul_pd(g0, g0), ir);
    __m512d t1 = _mm512_mul_pd(_mm512_mul_pd(g1, g1), ir);
    _mm512_mask_storeu_pd(s + j, m0, _mm512_add_pd(_mm512_maskz_loadu_pd(m0, s + j), t0));
    _mm512_mask_storeu_pd(s + j + 8, m1, _mm512_add_pd(_mm512_maskz_loadu_pd(m1, s + j + 8), t1));
  }
}

/* One 16-lane step of var_update; m selects the live lanes. */
static inline void var_block(const float *g, const float *p, float *v, __mmask16 m, __m512 av,
                             __m512 bv, __m512 ev, __m512 fv, __m512d *ua0, __m512d *ua1,
                             __m512d *pa0, __m512d *pa1) {
  __m512 gv = _mm512_maskz_loadu_ps(m, g), pv = _mm512_maskz_loadu_ps(m, p);
  __m512 sq = _mm512_add_ps(_mm512_mul_ps(gv, gv), ev);
  __m512 nv = _mm512_add_ps(_mm512_mul_ps(av, _mm512_maskz_loadu_ps(m, v)), _mm512_mul_ps(bv, sq));
  _mm512_mask_storeu_ps(v, m, nv);
  /* max_ps(floor, nv) returns nv when nv is NaN, like the scalar ?: */
  __m512 den = _mm512_max_ps(fv, nv);
  __mmask8 m0 = (__mmask8)m, m1 = (__mmask8)(m >> 8);
  __m512d g0 = lo_pd(gv), g1 = hi_pd(gv), d0 = lo_pd(den), d1 = hi_pd(den);
  *ua0 = _mm512_mask_add_pd(*ua0, m0, *ua0, _mm512_maskz_div_pd(m0, _mm512_mul_pd(g0, g0), d0));
  *ua1 = _mm512_mask_add_pd(*ua1, m1, *ua1, _mm512_maskz_div_pd(m1, _mm512_mul_pd(g1, g1), d1));
  __m512d p0 = lo_pd(pv), p1 = hi_pd(pv);
  *pa0 = _mm512_fmadd_pd(p0, p0, *pa0);
  *pa1 = _mm512_fmadd_pd(p1, p1, *pa1);
}

static void var_update_avx512(const float *g, const float *p, float *v, size_t n, float a, float b,
                              float e, float floor, double *u2, double *psq) {
  const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b), ev = _mm512_set1_ps(e);
  const __m512 fv = _mm512_set1_ps(floor);
  __m512d ua0 = _mm512_setzero_pd(), ua1 = ua0, pa0 = ua0, pa1 = ua0;
  size_t j = 0;
  for (; j + 16 <= n; j += 16)
    var_block(g + j, p + j, v + j, 0xffff, av, bv, ev, fv, &ua0, &ua1, &pa0, &pa1);
  if (j < n)
    var_block(g + j, p + j, v + j, tail_mask(n - j), av, bv, ev, fv, &ua0, &ua1, &pa0, &pa1);
  *u2 += _mm512_reduce_add_pd(_mm512_add_pd(ua0, ua1));
  *psq += _mm512_reduce_add_pd(_mm512_add_pd(pa0, pa1));
}

static double row_u2_clamped_avx512(const float *g, const float *c, size_t n, float rr,
                                    float floor) {
  const __m512 rv = _mm512_set1_ps(rr), fv = _mm512_set1_ps(floor);
  __m512d ua0 = _mm512_setzero_pd(), ua1 = ua0;
  for (size_t j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __mmask8 m0 = (__mmask8)m, m1 = (__mmask8)(m >> 8);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
    __m512 den = _mm512_max_ps(fv, _mm512_mul_ps(rv, _mm512_maskz_loadu_ps(m, c + j)));
    __m512d g0 = lo_pd(gv), g1 = hi_pd(gv), d0 = lo_pd(den), d1 = hi_pd(den);
    ua0 = _mm512_mask_add_pd(ua0, m0, ua0, _mm512_maskz_div_pd(m0, _mm512_mul_pd(g0, g0), d0));
    ua1 = _mm512_mask_add_pd(ua1, m1, ua1, _mm512_maskz_div_pd(m1, _mm512_mul_pd(g1, g1), d1));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(ua0, ua1));
}

static void apply_rowcol_avx512(float *out, const float *p, const float *g, float *mom,
                                const float *colf, size_t n, float rowf, float pmul, float beta1) {
  const __m512 rv = _mm512_set1_ps(rowf), mv = _mm512_set1_ps(pmul);
  if (mom) {
    const float omb = 1.0f - beta1;
    const __m512 b1 = _mm512_set1_ps(beta1), ob = _mm512_set1_ps(omb);
    for (size_t j = 0; j < n; j += 16) {
      __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
      __m512 u = _mm512_mul_ps(
          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + j), _mm512_maskz_loadu_ps(m, colf + j)), rv);
      __m512 mo =
          _mm512_add_ps(_mm512_mul_ps(b1, _mm512_maskz_loadu_ps(m, mom + j)), _mm512_mul_ps(ob, u));
      _mm512_mask_storeu_ps(mom + j, m, mo);
      _mm512_mask_storeu_ps(out + j, m,
                            _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), mv), mo));
    }
    return;
  }
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512 u0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(g + j), _mm512_loadu_ps(colf + j)), rv);
    __m512 u1 = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_loadu_ps(g + j + 16), _mm512_loadu_ps(colf + j + 16)), rv);
    _mm512_storeu_ps(out + j, _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j), mv), u0));
    _mm512_storeu_ps(out + j + 16,
                     _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j + 16), mv), u1));
  }
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m512 u = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + j), _mm512_maskz_loadu_ps(m, colf + j)), rv);
    _mm512_mask_storeu_ps(out + j, m,
                          _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), mv), u));
  }
}

static void apply_elem_avx512(float *out, const float *p, const float *g, float *mom,
                              const float *c, size_t n, float rr, float floor, float s, float pmul,
                              float beta1) {
  const float omb = 1.0f - beta1;
  const __m512 rv = _mm512_set1_ps(rr), fv = _mm512_set1_ps(floor), sv = _mm512_set1_ps(s);
  const __m512 mv = _mm512_set1_ps(pmul), one = _mm512_set1_ps(1.0f);
  const __m512 b1 = _mm512_set1_ps(beta1), ob = _mm512_set1_ps(omb);
  for (size_t j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m512 den = _mm512_max_ps(fv, _mm512_mul_ps(rv, _mm512_maskz_loadu_ps(m, c + j)));
    __m512 inv = _mm512_maskz_div_ps(m, one, _mm512_maskz_sqrt_ps(m, den));
    __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + j), inv), sv);
    if (mom) {
      u = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_maskz_loadu_ps(m, mom + j)), _mm512_mul_ps(ob, u));
      _mm512_mask_storeu_ps(mom + j, m, u);
    }
    _mm512_mask_storeu_ps(out + j, m,
                          _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), mv), u));
  }
}

static void add_f32_avx512(float *dst, const float *src, size_t n) {
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512 a0 = _mm512_add_ps(_mm512_loadu_ps(dst + j), _mm512_loadu_ps(src + j));
    __m512 a1 = _mm512_add_ps(_mm512_loadu_ps(dst + j + 16), _mm512_loadu_ps(src + j + 16));
    _mm512_storeu_ps(dst + j, a0);
    _mm512_storeu_ps(dst + j + 16, a1);
  }
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    _mm512_mask_storeu_ps(
        dst + j, m,
        _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst + j), _mm512_maskz_loadu_ps(m, src + j)));
  }
}

static void div_f32_avx512(float *dst, size_t n, float d) {
  const __m512 dv = _mm512_set1_ps(d);
  for (size_t j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    _mm512_mask_storeu_ps(dst + j, m, _mm512_maskz_div_ps(m, _mm512_maskz_loadu_ps(m, dst + j), dv));
  }
}

/* 16 fp32 bit patterns -> 16 bf16, exactly as fps_f32_to_bf16(). */
static inline __m256i bf16_round16(__m512i u) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
}

static void bf16_encode_avx512(void *dst, const float *src, size_t n) {
  uint16_t *d = dst; /* any alignment: only unaligned loads and stores */
  for (size_t j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m256i h = bf16_round16(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + j)));
    _mm256_mask_storeu_epi16(d + j, m, h);
  }
}

/* bf16 -> fp32 (exact: a shift), and the first invalid gradient: an
 * exponent field of 0xBE or more (|x| >= 2^63, Inf, NaN), as dtype.c. */
static size_t bf16_decode_avx512(float *dst, const void *src, size_t n) {
  const uint16_t *s = src;
  const __m512i expm = _mm512_set1_epi32(0x7f800000), lim = _mm512_set1_epi32(0x5f000000);
  size_t bad = n;
  for (size_t j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + j)), 16);
    _mm512_mask_storeu_ps(dst + j, m, _mm512_castsi512_ps(u));
    if (bad == n) {
      __mmask16 hit = _mm512_mask_cmpge_epu32_mask(m, _mm512_and_si512(u, expm), lim);
      if (hit) bad = j + (size_t)__builtin_ctz(hit);
    }
  }
  return bad;
}

/* One masked ordinary store up to dst's 64-byte alignment, then whole
 * lines with non-temporal stores, the tail masked and ordinary. */
static void bf16_widen_nt_avx512(float *dst, const void *src, size_t n) {
  const uint16_t *s = src;
  size_t head = (size_t)((64 - ((uintptr_t)dst & 63)) & 63) / 4;
  if (head > n) head = n;
  if (head) {
    __mmask16 m = tail_mask(head);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s)), 16);
    _mm512_mask_storeu_ps(dst, m, _mm512_castsi512_ps(u));
  }
  size_t j = head;
  for (; j + 16 <= n; j += 16) {
    __m512i u = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(s + j))), 16);
    _mm512_stream_si512((void *)(dst + j), u);
  }
  _mm_sfence(); /* the stores are visible before whatever publishes dst */
  if (j < n) {
    __mmask16 m = tail_mask(n - j);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + j)), 16);
    _mm512_mask_storeu_ps(dst + j, m, _mm512_castsi512_ps(u));
  }
}

/* ---- the wire gradient's one pass in: check, convert, sum ---- */

/* The lanes of m of 16 elements of little-endian fp32 (bf16 = 0) or bf16
 * data as fp32 bits (0 elsewhere; nothing outside m is read); the bf16
 * widening is a shift, exact (vcvtneps2bf16 goes the other way, and
 * flushes denormals). */
static inline __m512i wire_load16(const unsigned char *s, size_t j, __mmask16 m, int bf16) {
  if (bf16)
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + 2 * j)), 16);
  return _mm512_maskz_loadu_epi32(m, s + 4 * j);
}

/* Lanes whose exponent field is 0xBE or more (dtype.h's rule). */
static inline __mmask16 wire_bad16(__m512i u) {
  return _mm512_cmpge_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7f800000)),
                                 _mm512_set1_epi32(0x5f000000));
}

static inline void wire_put16(float *dst, __mmask16 m, __m512i u, int add) {
  __m512 f = _mm512_castsi512_ps(u);
  if (add) f = _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), f);
  _mm512_mask_storeu_ps(dst, m, f);
}

/* 32 lanes at a time, then one masked block per 16; in a block with a bad
 * lane only the lanes before it are written. */
static inline size_t wire_in_avx512(float *dst, const void *src, size_t n, int bf16, int add) {
  const unsigned char *s = src;
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512i u0 = wire_load16(s, j, 0xffff, bf16), u1 = wire_load16(s, j + 16, 0xffff, bf16);
    if (wire_bad16(u0) | wire_bad16(u1)) break;
    wire_put16(dst + j, 0xffff, u0, add);
    wire_put16(dst + j + 16, 0xffff, u1, add);
  }
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m512i u = wire_load16(s, j, m, bf16);
    __mmask16 bad = wire_bad16(u) & m;
    if (bad) {
      unsigned first = (unsigned)__builtin_ctz(bad);
      wire_put16(dst + j, (__mmask16)((1u << first) - 1u), u, add);
      return j + first;
    }
    wire_put16(dst + j, m, u, add);
  }
  return n;
}

static size_t sum_f32_avx512(float *acc, const void *src, size_t n) {
  return wire_in_avx512(acc, src, n, 0, 1);
}
static size_t sum_bf16_avx512(float *acc, const void *src, size_t n) {
  return wire_in_avx512(acc, src, n, 1, 1);
}
static size_t decode_f32_avx512(float *dst, const void *src, size_t n) {
  return wire_in_avx512(dst, src, n, 0, 0);
}

const fps_kernels_t fps__kernels_avx512 = {
    .name = "avx512",
    .row_stats = row_stats_avx512,
    .row_scaled = row_scaled_avx512,
    .var_update = var_update_avx512,
    .row_u2_clamped = row_u2_clamped_avx512,
    .apply_rowcol = apply_rowcol_avx512,
    .apply_elem = apply_elem_avx512,
    .add_f32 = add_f32_avx512,
    .div_f32 = div_f32_avx512,
    .bf16_encode = bf16_encode_avx512,
    .bf16_decode = bf16_decode_avx512,
    .bf16_widen_nt = bf16_widen_nt_avx512,
    .sum_f32 = sum_f32_avx512,
    .sum_bf16 = sum_bf16_avx512,
    .decode_f32 = decode_f32_avx512,
};

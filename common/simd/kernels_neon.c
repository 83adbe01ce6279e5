/* NEON kernels (aarch64, where Advanced SIMD is architectural).
 *
 * Same contract as kernels_avx2.c: elementwise results use the scalar
 * reference's operations in the same order (separate multiply and add,
 * which -std=c11's -ffp-contract=off keeps unfused; sqrt + divide, not the
 * vrsqrte estimate), so they are bit-identical to scalar; only the double
 * sums use lanes and FMA. The clamp is a compare + select rather than
 * vmaxq so that a NaN and -0.0 behave exactly like the scalar ?: does. */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels_impl.h"

static inline float32x4_t clamp_min(float32x4_t floor, float32x4_t x) {
  return vbslq_f32(vcgtq_f32(floor, x), floor, x); /* floor > x ? floor : x */
}

static void row_stats_neon(const float *g, const float *p, size_t n, double *col, double *gsq,
                           double *psq) {
  float64x2_t ga0 = vdupq_n_f64(0), ga1 = ga0, pa0 = ga0, pa1 = ga0;
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t gv = vld1q_f32(g + j), pv = vld1q_f32(p + j);
    float64x2_t g0 = vcvt_f64_f32(vget_low_f32(gv)), g1 = vcvt_high_f64_f32(gv);
    float64x2_t p0 = vcvt_f64_f32(vget_low_f32(pv)), p1 = vcvt_high_f64_f32(pv);
    float64x2_t q0 = vmulq_f64(g0, g0), q1 = vmulq_f64(g1, g1);
    vst1q_f64(col + j, vaddq_f64(vld1q_f64(col + j), q0));
    vst1q_f64(col + j + 2, vaddq_f64(vld1q_f64(col + j + 2), q1));
    ga0 = vaddq_f64(ga0, q0);
    ga1 = vaddq_f64(ga1, q1);
    pa0 = vfmaq_f64(pa0, p0, p0);
    pa1 = vfmaq_f64(pa1, p1, p1);
  }
  double gs = vaddvq_f64(vaddq_f64(ga0, ga1)), ps = vaddvq_f64(vaddq_f64(pa0, pa1));
  for (; j < n; j++) {
    double gd = g[j], pd = p[j], g2 = gd * gd;
    gs += g2;
    ps += pd * pd;
    col[j] += g2;
  }
  *gsq = gs;
  *psq = ps;
}

static void row_scaled_neon(const float *g, size_t n, double inv_r, double *s) {
  const float64x2_t ir = vdupq_n_f64(inv_r);
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t gv = vld1q_f32(g + j);
    float64x2_t g0 = vcvt_f64_f32(vget_low_f32(gv)), g1 = vcvt_high_f64_f32(gv);
    vst1q_f64(s + j, vaddq_f64(vld1q_f64(s + j), vmulq_f64(vmulq_f64(g0, g0), ir)));
    vst1q_f64(s + j + 2, vaddq_f64(vld1q_f64(s + j + 2), vmulq_f64(vmulq_f64(g1, g1), ir)));
  }
  for (; j < n; j++) {
    double gd = g[j];
    s[j] += gd * gd * inv_r;
  }
}

static void var_update_neon(const float *g, const float *p, float *v, size_t n, float a, float b,
                            float e, float floor, double *u2, double *psq) {
  const float32x4_t av = vdupq_n_f32(a), bv = vdupq_n_f32(b), ev = vdupq_n_f32(e);
  const float32x4_t fv = vdupq_n_f32(floor);
  float64x2_t ua0 = vdupq_n_f64(0), ua1 = ua0, pa0 = ua0, pa1 = ua0;
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t gv = vld1q_f32(g + j), pv = vld1q_f32(p + j);
    float32x4_t sq = vaddq_f32(vmulq_f32(gv, gv), ev);
    float32x4_t nv = vaddq_f32(vmulq_f32(av, vld1q_f32(v + j)), vmulq_f32(bv, sq));
    vst1q_f32(v + j, nv);
    float32x4_t den = clamp_min(fv, nv);
    float64x2_t g0 = vcvt_f64_f32(vget_low_f32(gv)), g1 = vcvt_high_f64_f32(gv);
    float64x2_t d0 = vcvt_f64_f32(vget_low_f32(den)), d1 = vcvt_high_f64_f32(den);
    ua0 = vaddq_f64(ua0, vdivq_f64(vmulq_f64(g0, g0), d0));
    ua1 = vaddq_f64(ua1, vdivq_f64(vmulq_f64(g1, g1), d1));
    float64x2_t p0 = vcvt_f64_f32(vget_low_f32(pv)), p1 = vcvt_high_f64_f32(pv);
    pa0 = vfmaq_f64(pa0, p0, p0);
    pa1 = vfmaq_f64(pa1, p1, p1);
  }
  double us = vaddvq_f64(vaddq_f64(ua0, ua1)), ps = vaddvq_f64(vaddq_f64(pa0, pa1));
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

static double row_u2_clamped_neon(const float *g, const float *c, size_t n, float rr,
                                  float floor) {
  const float32x4_t rv = vdupq_n_f32(rr), fv = vdupq_n_f32(floor);
  float64x2_t ua0 = vdupq_n_f64(0), ua1 = ua0;
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t gv = vld1q_f32(g + j);
    float32x4_t den = clamp_min(fv, vmulq_f32(rv, vld1q_f32(c + j)));
    float64x2_t g0 = vcvt_f64_f32(vget_low_f32(gv)), g1 = vcvt_high_f64_f32(gv);
    float64x2_t d0 = vcvt_f64_f32(vget_low_f32(den)), d1 = vcvt_high_f64_f32(den);
    ua0 = vaddq_f64(ua0, vdivq_f64(vmulq_f64(g0, g0), d0));
    ua1 = vaddq_f64(ua1, vdivq_f64(vmulq_f64(g1, g1), d1));
  }
  double us = vaddvq_f64(vaddq_f64(ua0, ua1));
  for (; j < n; j++) {
    float v = rr * c[j];
    float den = floor > v ? floor : v;
    double gd = g[j];
    us += gd * gd / den;
  }
  return us;
}

static void apply_rowcol_neon(float *out, const float *p, const float *g, float *mom,
                              const float *colf, size_t n, float rowf, float pmul, float beta1) {
  const float omb = 1.0f - beta1;
  const float32x4_t rv = vdupq_n_f32(rowf), mv = vdupq_n_f32(pmul);
  const float32x4_t b1 = vdupq_n_f32(beta1), ob = vdupq_n_f32(omb);
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t u = vmulq_f32(vmulq_f32(vld1q_f32(g + j), vld1q_f32(colf + j)), rv);
    if (mom) {
      u = vaddq_f32(vmulq_f32(b1, vld1q_f32(mom + j)), vmulq_f32(ob, u));
      vst1q_f32(mom + j, u);
    }
    vst1q_f32(out + j, vsubq_f32(vmulq_f32(vld1q_f32(p + j), mv), u));
  }
  for (; j < n; j++) {
    float u = (g[j] * colf[j]) * rowf;
    if (mom) {
      u = beta1 * mom[j] + omb * u;
      mom[j] = u;
    }
    out[j] = p[j] * pmul - u;
  }
}

static void apply_elem_neon(float *out, const float *p, const float *g, float *mom, const float *c,
                            size_t n, float rr, float floor, float s, float pmul, float beta1) {
  const float omb = 1.0f - beta1;
  const float32x4_t rv = vdupq_n_f32(rr), fv = vdupq_n_f32(floor), sv = vdupq_n_f32(s);
  const float32x4_t mv = vdupq_n_f32(pmul), one = vdupq_n_f32(1.0f);
  const float32x4_t b1 = vdupq_n_f32(beta1), ob = vdupq_n_f32(omb);
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t den = clamp_min(fv, vmulq_f32(rv, vld1q_f32(c + j)));
    float32x4_t inv = vdivq_f32(one, vsqrtq_f32(den));
    float32x4_t u = vmulq_f32(vmulq_f32(vld1q_f32(g + j), inv), sv);
    if (mom) {
      u = vaddq_f32(vmulq_f32(b1, vld1q_f32(mom + j)), vmulq_f32(ob, u));
      vst1q_f32(mom + j, u);
    }
    vst1q_f32(out + j, vsubq_f32(vmulq_f32(vld1q_f32(p + j), mv), u));
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

static void add_f32_neon(float *dst, const float *src, size_t n) {
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    float32x4_t a0 = vaddq_f32(vld1q_f32(dst + j), vld1q_f32(src + j));
    float32x4_t a1 = vaddq_f32(vld1q_f32(dst + j + 4), vld1q_f32(src + j + 4));
    vst1q_f32(dst + j, a0);
    vst1q_f32(dst + j + 4, a1);
  }
  for (; j + 4 <= n; j += 4) vst1q_f32(dst + j, vaddq_f32(vld1q_f32(dst + j), vld1q_f32(src + j)));
  for (; j < n; j++) dst[j] += src[j];
}

static void div_f32_neon(float *dst, size_t n, float d) {
  const float32x4_t dv = vdupq_n_f32(d);
  size_t j = 0;
  for (; j + 4 <= n; j += 4) vst1q_f32(dst + j, vdivq_f32(vld1q_f32(dst + j), dv));
  for (; j < n; j++) dst[j] /= d;
}

static uint16_t bf16_one(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The same integer rounding as fps_f32_to_bf16() (dtype.c), 4 lanes;
 * bytes in and out so that dst needs no alignment. */
static void bf16_encode_neon(void *dst, const float *src, size_t n) {
  unsigned char *d = dst;
  const uint32x4_t absm = vdupq_n_u32(0x7fffffffu), inf = vdupq_n_u32(0x7f800000u);
  const uint32x4_t one = vdupq_n_u32(1), bias = vdupq_n_u32(0x7fffu), quiet = vdupq_n_u32(0x40u);
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    uint32x4_t u = vreinterpretq_u32_f32(vld1q_f32(src + j));
    uint32x4_t nan = vcgtq_u32(vandq_u32(u, absm), inf);
    uint32x4_t hi = vshrq_n_u32(u, 16);
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vandq_u32(hi, one), bias)), 16);
    uint16x4_t h = vmovn_u32(vbslq_u32(nan, vorrq_u32(hi, quiet), r));
    vst1_u8(d + 2 * j, vreinterpret_u8_u16(h));
  }
  for (; j < n; j++) {
    uint16_t h = bf16_one(src[j]);
    memcpy(d + 2 * j, &h, 2);
  }
}

static size_t bf16_decode_neon(float *dst, const void *src, size_t n) {
  const unsigned char *s = src;
  const uint32x4_t expm = vdupq_n_u32(0x7f800000u), lim = vdupq_n_u32(0x5f000000u);
  size_t bad = n, j = 0;
  for (; j + 4 <= n; j += 4) {
    uint32x4_t u = vshll_n_u16(vreinterpret_u16_u8(vld1_u8(s + 2 * j)), 16);
    vst1q_f32(dst + j, vreinterpretq_f32_u32(u));
    if (bad == n && vmaxvq_u32(vcgeq_u32(vandq_u32(u, expm), lim))) {
      for (size_t k = j; k < j + 4; k++) {
        uint16_t h;
        memcpy(&h, s + 2 * k, 2);
        if ((h & 0x7f80u) >= 0x5f00u) {
          bad = k;
          break;
        }
      }
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

/* No non-temporal store worth having here: bf16_decode without its check. */
static void bf16_widen_nt_neon(float *dst, const void *src, size_t n) {
  (void)bf16_decode_neon(dst, src, n);
}

/* ---- the wire gradient's one pass in: check, convert, sum ---- */

/* 4 elements of little-endian fp32 (bf16 = 0) or bf16 data as fp32 bits;
 * bytes in, so src needs no alignment; the bf16 widening is a shift. */
static inline uint32x4_t wire_load4(const unsigned char *s, size_t j, int bf16) {
  if (bf16) return vshll_n_u16(vreinterpret_u16_u8(vld1_u8(s + 2 * j)), 16);
  return vreinterpretq_u32_u8(vld1q_u8(s + 4 * j));
}

/* Lanes whose exponent field is 0xBE or more (dtype.h's rule). */
static inline uint32x4_t wire_bad4(uint32x4_t u) {
  return vcgeq_u32(vandq_u32(u, vdupq_n_u32(0x7f800000u)), vdupq_n_u32(0x5f000000u));
}

static inline float32x4_t wire_put4(const float *dst, uint32x4_t u, int add) {
  float32x4_t f = vreinterpretq_f32_u32(u);
  return add ? vaddq_f32(vld1q_f32(dst), f) : f;
}

/* 8 then 4 lanes while no lane is bad; a block with a bad lane, and the
 * tail, go element by element, so nothing at or after it is written. */
static inline size_t wire_in_neon(float *dst, const void *src, size_t n, int bf16, int add) {
  const unsigned char *s = src;
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint32x4_t u0 = wire_load4(s, j, bf16), u1 = wire_load4(s, j + 4, bf16);
    if (vmaxvq_u32(vorrq_u32(wire_bad4(u0), wire_bad4(u1)))) break;
    float32x4_t a0 = wire_put4(dst + j, u0, add), a1 = wire_put4(dst + j + 4, u1, add);
    vst1q_f32(dst + j, a0);
    vst1q_f32(dst + j + 4, a1);
  }
  for (; j + 4 <= n; j += 4) {
    uint32x4_t u = wire_load4(s, j, bf16);
    if (vmaxvq_u32(wire_bad4(u))) break;
    vst1q_f32(dst + j, wire_put4(dst + j, u, add));
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

static size_t sum_f32_neon(float *acc, const void *src, size_t n) {
  return wire_in_neon(acc, src, n, 0, 1);
}
static size_t sum_bf16_neon(float *acc, const void *src, size_t n) {
  return wire_in_neon(acc, src, n, 1, 1);
}
static size_t decode_f32_neon(float *dst, const void *src, size_t n) {
  return wire_in_neon(dst, src, n, 0, 0);
}

const fps_kernels_t fps__kernels_neon = {
    .name = "neon",
    .row_stats = row_stats_neon,
    .row_scaled = row_scaled_neon,
    .var_update = var_update_neon,
    .row_u2_clamped = row_u2_clamped_neon,
    .apply_rowcol = apply_rowcol_neon,
    .apply_elem = apply_elem_neon,
    .add_f32 = add_f32_neon,
    .div_f32 = div_f32_neon,
    .bf16_encode = bf16_encode_neon,
    .bf16_decode = bf16_decode_neon,
    .bf16_widen_nt = bf16_widen_nt_neon,
    .sum_f32 = sum_f32_neon,
    .sum_bf16 = sum_bf16_neon,
    .decode_f32 = decode_f32_neon,
};

/* Scalar reference kernels: plain C, always built. The SIMD variants must
 * match these formulas operation for operation (see kernels_impl.h). */
#include <math.h>
#include <string.h>

#include "dtype.h"
#include "kernels_impl.h"

static void row_stats_scalar(const float *g, const float *p, size_t n, double *col, double *gsq,
                             double *psq) {
  double gs = 0, ps = 0;
  for (size_t j = 0; j < n; j++) {
    double gd = g[j], pd = p[j];
    double g2 = gd * gd;
    gs += g2;
    ps += pd * pd;
    col[j] += g2;
  }
  *gsq = gs;
  *psq = ps;
}

static void row_scaled_scalar(const float *g, size_t n, double inv_r, double *s) {
  for (size_t j = 0; j < n; j++) {
    double gd = g[j];
    s[j] += gd * gd * inv_r;
  }
}

static void var_update_scalar(const float *g, const float *p, float *v, size_t n, float a, float b,
                              float e, float floor, double *u2, double *psq) {
  double us = 0, ps = 0;
  for (size_t j = 0; j < n; j++) {
    float sq = g[j] * g[j] + e;
    float nv = a * v[j] + b * sq;
    v[j] = nv;
    /* NaN-preserving clamp: a NaN variance stays NaN, as in torch. */
    float den = floor > nv ? floor : nv;
    double gd = g[j], pd = p[j];
    us += gd * gd / den;
    ps += pd * pd;
  }
  *u2 += us;
  *psq += ps;
}

static double row_u2_clamped_scalar(const float *g, const float *c, size_t n, float rr,
                                    float floor) {
  double us = 0;
  for (size_t j = 0; j < n; j++) {
    float v = rr * c[j];
    float den = floor > v ? floor : v;
    double gd = g[j];
    us += gd * gd / den;
  }
  return us;
}

static void apply_rowcol_scalar(float *out, const float *p, const float *g, float *mom,
                                const float *colf, size_t n, float rowf, float pmul, float beta1) {
  if (mom) {
    float omb = 1.0f - beta1;
    for (size_t j = 0; j < n; j++) {
      float u = (g[j] * colf[j]) * rowf;
      float m = beta1 * mom[j] + omb * u;
      mom[j] = m;
      out[j] = p[j] * pmul - m;
    }
  } else {
    for (size_t j = 0; j < n; j++) {
      float u = (g[j] * colf[j]) * rowf;
      out[j] = p[j] * pmul - u;
    }
  }
}

static void apply_elem_scalar(float *out, const float *p, const float *g, float *mom,
                              const float *c, size_t n, float rr, float floor, float s, float pmul,
                              float beta1) {
  float omb = 1.0f - beta1;
  for (size_t j = 0; j < n; j++) {
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

static void add_f32_scalar(float *dst, const float *src, size_t n) {
  for (size_t j = 0; j < n; j++) dst[j] += src[j];
}

static void div_f32_scalar(float *dst, size_t n, float d) {
  for (size_t j = 0; j < n; j++) dst[j] /= d;
}

static void bf16_encode_scalar(void *dst, const float *src, size_t n) {
  unsigned char *p = dst;
  for (size_t j = 0; j < n; j++) {
    uint16_t h = fps_f32_to_bf16(src[j]);
    memcpy(p + 2 * j, &h, 2);
  }
}

static size_t bf16_decode_scalar(float *dst, const void *src, size_t n) {
  const unsigned char *p = src;
  size_t bad = n;
  for (size_t j = 0; j < n; j++) {
    uint16_t h;
    memcpy(&h, p + 2 * j, 2);
    if (bad == n && (h & 0x7f80u) >= 0x5f00u) bad = j;
    dst[j] = fps_bf16_to_f32(h);
  }
  return bad;
}

static void bf16_widen_nt_scalar(float *dst, const void *src, size_t n) {
  (void)bf16_decode_scalar(dst, src, n);
}

/* ---- the wire gradient's one pass in: check, convert, sum ---- */

/* fp32 bits of element j of little-endian fp32 (bf16 = 0) or bf16 data. */
static inline uint32_t wire_bits(const unsigned char *s, size_t j, int bf16) {
  if (bf16) {
    uint16_t h;
    memcpy(&h, s + 2 * j, 2);
    return (uint32_t)h << 16;
  }
  uint32_t u;
  memcpy(&u, s + 4 * j, 4);
  return u;
}

/* dtype.h's gradient rule on the bits: an exponent field of 0xBE or more
 * (|x| >= 2^63, Inf, NaN). */
static inline int bad_grad(uint32_t u) { return (u & 0x7f800000u) >= 0x5f000000u; }

/* Element by element, stopping at the first invalid gradient. */
static inline size_t wire_in_scalar(float *dst, const void *src, size_t n, int bf16, int add) {
  const unsigned char *s = src;
  for (size_t j = 0; j < n; j++) {
    uint32_t u = wire_bits(s, j, bf16);
    if (bad_grad(u)) return j;
    float f;
    memcpy(&f, &u, 4);
    if (add) dst[j] += f;
    else dst[j] = f;
  }
  return n;
}

static size_t sum_f32_scalar(float *acc, const void *src, size_t n) {
  return wire_in_scalar(acc, src, n, 0, 1);
}
static size_t sum_bf16_scalar(float *acc, const void *src, size_t n) {
  return wire_in_scalar(acc, src, n, 1, 1);
}
static size_t decode_f32_scalar(float *dst, const void *src, size_t n) {
  return wire_in_scalar(dst, src, n, 0, 0);
}

const fps_kernels_t fps__kernels_scalar = {
    .name = "scalar",
    .row_stats = row_stats_scalar,
    .row_scaled = row_scaled_scalar,
    .var_update = var_update_scalar,
    .row_u2_clamped = row_u2_clamped_scalar,
    .apply_rowcol = apply_rowcol_scalar,
    .apply_elem = apply_elem_scalar,
    .add_f32 = add_f32_scalar,
    .div_f32 = div_f32_scalar,
    .bf16_encode = bf16_encode_scalar,
    .bf16_decode = bf16_decode_scalar,
    .bf16_widen_nt = bf16_widen_nt_scalar,
    .sum_f32 = sum_f32_scalar,
    .sum_bf16 = sum_bf16_scalar,
    .decode_f32 = decode_f32_scalar,
};

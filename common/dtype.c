/* fp32 <-> bf16 conversion and the wire decode/encode loops.
 *
 * The machines factorps runs on are little-endian (x86-64, aarch64); the
 * static assertion below makes a big-endian build fail loudly instead of
 * silently swapping every tensor. */
#include "dtype.h"

#include <math.h>
#include <string.h>

#include "simd/kernels_impl.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "factorps' wire format is little-endian; add byte swapping for this target");

size_t fps_dtype_size(int dtype) {
  switch (dtype) {
    case FPS_DTYPE_F32: return 4;
    case FPS_DTYPE_BF16: return 2;
    default: return 0;
  }
}

const char *fps_dtype_name(int dtype) {
  switch (dtype) {
    case FPS_DTYPE_F32: return "f32";
    case FPS_DTYPE_BF16: return "bf16";
    default: return "unknown";
  }
}

uint16_t fps_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    /* NaN: truncating could clear every payload bit left in the top half
     * and turn it into Inf, so force the quiet bit. */
    return (uint16_t)((u >> 16) | 0x0040u);
  }
  /* Round to nearest, ties to even: add 0x7fff plus the lowest kept bit.
   * A carry out of the mantissa correctly bumps the exponent (and gives
   * Inf past the largest finite bf16). */
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return (uint16_t)(u >> 16);
}

float fps_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

int fps_dtype_decode(int dtype, const void *src, uint64_t n, float *dst,
                     uint64_t *first_bad_grad) {
  uint64_t bad = n;
  if (dtype == FPS_DTYPE_F32) {
    if (!first_bad_grad) {
      memcpy(dst, src, n * 4); /* nothing to check: the plain copy */
      return 0;
    }
    /* Copy and check in one pass; the kernel stops at the first invalid
     * value, and the rest is still decoded, as this function promises. */
    bad = fps_kernels_best()->decode_f32(dst, src, (size_t)n);
    if (bad < n) memcpy(dst + bad, (const unsigned char *)src + 4 * bad, (n - bad) * 4);
  } else if (dtype == FPS_DTYPE_BF16) {
    /* The SIMD variant converts and checks in one pass (exact: a shift). */
    bad = fps_kernels_best()->bf16_decode(dst, src, (size_t)n);
  } else {
    return FPS_EINVAL;
  }
  if (first_bad_grad) *first_bad_grad = bad;
  return 0;
}

uint64_t fps_dtype_grad_sum(const fps_kernels_t *k, int dtype, float *acc, const void *src, uint64_t n) {
  if (!k) k = fps_kernels_best();
  switch (dtype) {
    case FPS_DTYPE_F32: return k->sum_f32(acc, src, (size_t)n);
    case FPS_DTYPE_BF16: return k->sum_bf16(acc, src, (size_t)n);
    default: return 0;
  }
}

uint64_t fps_dtype_grad_decode(const fps_kernels_t *k, int dtype, float *dst, const void *src,
                               uint64_t n) {
  if (!k) k = fps_kernels_best();
  switch (dtype) {
    case FPS_DTYPE_F32: return k->decode_f32(dst, src, (size_t)n);
    case FPS_DTYPE_BF16: return k->bf16_decode(dst, src, (size_t)n);
    default: return 0;
  }
}

void fps_dtype_decode_out(int dtype, const void *src, uint64_t n, float *dst) {
  /* The streaming stores reach their 64-byte alignment only from a
   * float-aligned dst; any other dst takes the plain decode. */
  if (dtype == FPS_DTYPE_BF16 && ((uintptr_t)dst & 3) == 0) fps_kernels_best()->bf16_widen_nt(dst, src, (size_t)n);
  else (void)fps_dtype_decode(dtype, src, n, dst, NULL);
}

float fps_dtype_value(int dtype, const void *src, uint64_t i) {
  const unsigned char *p = src;
  float f = 0;
  if (dtype == FPS_DTYPE_F32) {
    memcpy(&f, p + 4 * i, 4);
  } else if (dtype == FPS_DTYPE_BF16) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    f = fps_bf16_to_f32(h);
  }
  return f;
}

int fps_dtype_encode(int dtype, const float *src, uint64_t n, void *dst) {
  unsigned char *p = dst;
  if (dtype == FPS_DTYPE_F32) {
    memcpy(p, src, n * 4);
  } else if (dtype == FPS_DTYPE_BF16) {
    /* Every variant rounds exactly as fps_f32_to_bf16() (kernels_impl.h). */
    fps_kernels_best()->bf16_encode(p, src, (size_t)n);
  } else {
    return FPS_EINVAL;
  }
  return 0;
}

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

/* An exponent field of 0xBE or more means |x| >= 2^63 = FPS_GRAD_ABS_LIMIT,
 * NaN and Inf (all ones) included; testing the bits keeps the loop
 * branch-free and independent of -ffast-math. */
#define FPS__BAD_GRAD_EXP 0x5f000000u
static inline int fps__bad_grad_bits(uint32_t u) {
  return (u & 0x7f800000u) >= FPS__BAD_GRAD_EXP;
}

int fps_dtype_decode(int dtype, const void *src, uint64_t n, float *dst,
                     uint64_t *first_bad_grad) {
  const unsigned char *p = src;
  uint64_t bad = n;
  if (dtype == FPS_DTYPE_F32) {
    /* One pass: copy a cache-sized block, then test it while it is hot.
     * (bits & exponent) + (2^31 - FPS__BAD_GRAD_EXP) carries into bit 31
     * only for an exponent field of 0xBE or more (|x| >= 2^63, NaN, Inf);
     * the OR over a fixed-size block is branch-free, so the compiler
     * vectorises it. Only a block with a hit is scanned. */
    const uint32_t carry = 0x80000000u - FPS__BAD_GRAD_EXP;
    enum { B = 1024 };
    for (uint64_t i = 0; i < n; i += B) {
      uint64_t m = n - i < B ? n - i : B;
      memcpy(dst + i, p + 4 * i, m * 4);
      if (!first_bad_grad || bad != n) continue;
      const uint32_t *w = (const uint32_t *)(const void *)(dst + i);
      uint32_t acc = 0;
      if (m == B) {
        for (uint64_t j = 0; j < B; j++) acc |= (w[j] & 0x7f800000u) + carry;
      } else {
        for (uint64_t j = 0; j < m; j++) acc |= (w[j] & 0x7f800000u) + carry;
      }
      if (acc & 0x80000000u) {
        for (uint64_t j = 0; j < m; j++) {
          if (fps__bad_grad_bits(w[j])) {
            bad = i + j;
            break;
          }
        }
      }
    }
  } else if (dtype == FPS_DTYPE_BF16) {
    /* The SIMD variant converts and checks in one pass (exact: a shift). */
    bad = fps_kernels_best()->bf16_decode(dst, p, (size_t)n);
  } else {
    return FPS_EINVAL;
  }
  if (first_bad_grad) *first_bad_grad = bad;
  return 0;
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

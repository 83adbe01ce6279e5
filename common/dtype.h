/* Wire element types and their conversion to and from fp32.
 *
 * Shards store and update fp32; other dtypes are converted at the edge.
 * The enum values equal the wire contract's factorps.v1.DType values so a
 * received dtype can be checked with fps_dtype_size() and used directly.
 *
 * Thread-safety: every function is pure and reentrant. */
#ifndef FPS_DTYPE_H
#define FPS_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

typedef enum fps_dtype_e {
  FPS_DTYPE_F32 = 1,   /* IEEE binary32, 4 bytes little-endian */
  FPS_DTYPE_BF16 = 2,  /* bfloat16, 2 bytes little-endian */
} fps_dtype_t;

/* Bytes per element of dtype, or 0 if dtype is not a supported dtype. */
size_t fps_dtype_size(int dtype);

/* "f32", "bf16", or "unknown". */
const char *fps_dtype_name(int dtype);

/* fp32 -> bf16 with round-to-nearest-even. NaN stays NaN (quiet, sign
 * kept); +-Inf stays +-Inf; values that round above the bf16 range become
 * +-Inf, as IEEE rounding does. */
uint16_t fps_f32_to_bf16(float f);

/* bf16 -> fp32; exact (bf16 is the top half of an fp32). */
float fps_bf16_to_f32(uint16_t h);

/* Gradient elements must be finite and smaller in magnitude than this
 * (2^63, about 9.2e18). Adafactor squares every gradient element and keeps
 * the second-moment statistics in fp32: below 2^63, g^2 < 2^126 stays a
 * factor 4 under FLT_MAX, so neither the squares nor their running averages
 * can overflow to Inf and turn the whole tensor into NaN (which one worker's
 * finite but huge gradient would otherwise do, to every worker). */
#define FPS_GRAD_ABS_LIMIT 9223372036854775808.0

/* Decodes n elements of little-endian `dtype` data at src (any alignment)
 * into dst as fp32. If first_bad_grad is non-NULL it receives the index of
 * the first element that is not a valid gradient (NaN, Inf, or a magnitude
 * of FPS_GRAD_ABS_LIMIT or more), or n if every element is valid; the check
 * rides on the same pass over memory as the copy.
 * Returns 0 or FPS_EINVAL (unsupported dtype). */
int fps_dtype_decode(int dtype, const void *src, uint64_t n, float *dst,
                     uint64_t *first_bad_grad);

/* fps_dtype_decode() without the check, for a dst that is not read again
 * soon (parameters a reply writes into the caller's array): bf16 is
 * widened with non-temporal stores where the CPU has them (no read of
 * dst's cache lines first), same bits. A dst that is not 4-byte aligned
 * (a caller's packed buffer) gets the plain decode; an unsupported dtype
 * writes nothing. */
void fps_dtype_decode_out(int dtype, const void *src, uint64_t n, float *dst);

/* The kernel table (simd/kernels.h); NULL below means the best variant. */
typedef struct fps_kernels_s fps_kernels_t;

/* A received gradient's one pass in: n little-endian `dtype` values at src
 * (any alignment; dtype F32 or BF16, already validated: any other dtype
 * refuses element 0) are checked and added to acc (acc[j] += x[j], one
 * fp32 add, bit-identical to decoding first and then
 * fps_kernels_add_f32) or, for fps_dtype_grad_decode, stored at dst.
 * Returns the index of the first element that is not a valid gradient
 * (see FPS_GRAD_ABS_LIMIT) or n. Elements before it are done; a sum
 * leaves acc from that index on untouched (so what was summed is exactly
 * [0, index)); a decode may have written dst there. Kernels k (NULL: the
 * best); every variant gives the same bits. */
uint64_t fps_dtype_grad_sum(const fps_kernels_t *k, int dtype, float *acc, const void *src, uint64_t n);
uint64_t fps_dtype_grad_decode(const fps_kernels_t *k, int dtype, float *dst, const void *src,
                               uint64_t n);

/* Element i of little-endian `dtype` data at src as fp32 (0 for an
 * unsupported dtype): the value to name in an error message. */
float fps_dtype_value(int dtype, const void *src, uint64_t i);

/* Encodes n fp32 values to little-endian `dtype` bytes at dst (any
 * alignment; fps_dtype_size(dtype) * n bytes). Returns 0 or FPS_EINVAL. */
int fps_dtype_encode(int dtype, const float *src, uint64_t n, void *dst);

#endif

/* SIMD kernels for the Adafactor step, with runtime dispatch.
 *
 * Variants: "scalar" (the reference, always built), "avx2" (AVX2+FMA,
 * x86-64 only), "avx512" (AVX-512 F+BW+VL, x86-64 only, FPS_WITH_AVX512)
 * and "neon" (aarch64 only). One is chosen once per process from what the
 * CPU supports (avx512 > avx2 > neon > scalar);
 * FACTORPS_SIMD=scalar|avx2|avx512|neon forces one.
 * The function table itself is internal (kernels_impl.h). */
#ifndef FPS_SIMD_KERNELS_H
#define FPS_SIMD_KERNELS_H

#include <stddef.h>

typedef struct fps_kernels_s fps_kernels_t;

/* The fastest variant this CPU supports, honouring FACTORPS_SIMD when it
 * names a supported variant (an unusable value falls back to the best with
 * a one-line warning on stderr; fps_kernels_from_env() turns it into an
 * error instead). Chosen once; thread-safe. */
const fps_kernels_t *fps_kernels_best(void);

/* Looks a variant up by name ("auto": the best this CPU supports). Returns 0, FPS_EUNSUPPORTED (known variant
 * this CPU or build cannot run) or FPS_EINVAL (unknown name). */
int fps_kernels_by_name(const char *name, const fps_kernels_t **out, char *why, size_t why_len);

/* FACTORPS_SIMD if set and non-empty (errors as fps_kernels_by_name), else
 * the best variant. Use this at start-up to turn a bad setting into a clear
 * error instead of a silent fallback. */
int fps_kernels_from_env(const fps_kernels_t **out, char *why, size_t why_len);

/* The sync round's deterministic sum with variant k (NULL: the best):
 * dst[i] += src[i] in fp32, and dst[i] /= d (a true division). Every
 * variant gives the bits of the plain C loops, so summing the workers'
 * gradients one at a time in worker-id order and dividing once by W is
 * bit-identical to a local replay in that order on any CPU. */
void fps_kernels_add_f32(const fps_kernels_t *k, float *dst, const float *src, size_t n);
void fps_kernels_div_f32(const fps_kernels_t *k, float *dst, size_t n, float d);

/* "scalar", "avx2", "avx512" or "neon". */
const char *fps_kernels_name(const fps_kernels_t *k);

/* Every variant name known to the build, in order scalar, avx2, avx512, neon
 * (NULL-terminated); fps_kernels_by_name() says which ones run here. */
extern const char *const fps_kernels_all_names[];

#endif

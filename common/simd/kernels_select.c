/* Chooses the kernel variant: CPUID + XGETBV on x86-64 (AVX2 and FMA in
 * the CPU, and YMM state enabled by the OS; for AVX-512 also F, BW and VL
 * in the CPU and the opmask and both ZMM state components enabled), HWCAP
 * on aarch64 (ASIMD is architectural there, but we still ask). Decided
 * once per process; the best is avx512, then avx2, then neon, then
 * scalar. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "kernels_impl.h"

#if defined(__x86_64__) && (defined(FPS_HAVE_AVX2) || defined(FPS_HAVE_AVX512))
#include <cpuid.h>
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#endif

const char *const fps_kernels_all_names[] = {"scalar", "avx2", "avx512", "neon", NULL};

#if defined(__x86_64__) && (defined(FPS_HAVE_AVX2) || defined(FPS_HAVE_AVX512))
/* XCR0, the state components the OS saves and restores; 0 unless CPUID
 * says OSXSAVE (XGETBV itself would fault otherwise). */
static unsigned long long os_xcr0(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}
#endif

#if defined(__x86_64__) && defined(FPS_HAVE_AVX512)
static int cpu_has_avx512(void) {
  unsigned a, b, c, d;
  /* XCR0 bits: 1 SSE, 2 AVX (YMM), 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM */
  if ((os_xcr0() & 0xe6u) != 0xe6u) return 0;
  if (__get_cpuid_max(0, NULL) < 7) return 0;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned f = 1u << 16, bw = 1u << 30, vl = 1u << 31;
  return (b & (f | bw | vl)) == (f | bw | vl);
}
#endif

#if defined(__x86_64__) && defined(FPS_HAVE_AVX2)
static int cpu_has_avx2_fma(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned fma = 1u << 12, osxsave = 1u << 27, avx = 1u << 28;
  if ((c & (fma | osxsave | avx)) != (fma | osxsave | avx)) return 0;
  /* XGETBV(0): the OS saves XMM (bit 1) and YMM (bit 2) state. */
  if ((os_xcr0() & 6u) != 6u) return 0;
  if (__get_cpuid_max(0, NULL) < 7) return 0;
  __cpuid_count(7, 0, a, b, c, d);
  return (b & (1u << 5)) != 0; /* AVX2 */
}
#endif

static void set_why(char *why, size_t why_len, const char *fmt, const char *arg) {
  if (why && why_len) snprintf(why, why_len, fmt, arg);
}

static const fps_kernels_t *detect_best(void);

int fps_kernels_by_name(const char *name, const fps_kernels_t **out, char *why, size_t why_len) {
  if (!name || !out) {
    set_why(why, why_len, "%s", "no SIMD variant name given");
    return FPS_EINVAL;
  }
  /* "auto" is a name too (README: FACTORPS_SIMD=auto), so that an
   * environment or flag can say "detect" explicitly. */
  if (!strcmp(name, "auto")) {
    *out = detect_best();
    return 0;
  }
  if (!strcmp(name, "scalar")) {
    *out = &fps__kernels_scalar;
    return 0;
  }
  if (!strcmp(name, "avx2")) {
#if defined(__x86_64__) && defined(FPS_HAVE_AVX2)
    if (cpu_has_avx2_fma()) {
      *out = &fps__kernels_avx2;
      return 0;
    }
    set_why(why, why_len, "SIMD variant '%s' needs AVX2 and FMA, which this CPU lacks", name);
#else
    set_why(why, why_len, "SIMD variant '%s' was not built (x86-64 only, FPS_WITH_AVX2=ON)", name);
#endif
    return FPS_EUNSUPPORTED;
  }
  if (!strcmp(name, "avx512")) {
#if defined(__x86_64__) && defined(FPS_HAVE_AVX512)
    if (cpu_has_avx512()) {
      *out = &fps__kernels_avx512;
      return 0;
    }
    set_why(why, why_len,
            "SIMD variant '%s' needs AVX-512 F, BW and VL with ZMM state enabled by the OS, "
            "which this machine lacks",
            name);
#else
    set_why(why, why_len, "SIMD variant '%s' was not built (x86-64 only, FPS_WITH_AVX512=ON)",
            name);
#endif
    return FPS_EUNSUPPORTED;
  }
  if (!strcmp(name, "neon")) {
#if defined(__aarch64__)
    if (getauxval(AT_HWCAP) & HWCAP_ASIMD) {
      *out = &fps__kernels_neon;
      return 0;
    }
    set_why(why, why_len, "SIMD variant '%s' needs ASIMD, which this CPU lacks", name);
#else
    set_why(why, why_len, "SIMD variant '%s' exists only on aarch64 builds", name);
#endif
    return FPS_EUNSUPPORTED;
  }
  set_why(why, why_len, "unknown SIMD variant '%s' (expected auto, scalar, avx2, avx512 or neon)", name);
  return FPS_EINVAL;
}

static const fps_kernels_t *detect_best(void) {
  const fps_kernels_t *k = NULL;
  if (fps_kernels_by_name("avx512", &k, NULL, 0) == 0) return k;
  if (fps_kernels_by_name("avx2", &k, NULL, 0) == 0) return k;
  if (fps_kernels_by_name("neon", &k, NULL, 0) == 0) return k;
  return &fps__kernels_scalar;
}

static const fps_kernels_t *g_best;
static pthread_once_t g_best_once = PTHREAD_ONCE_INIT;

static void choose_once(void) {
  const fps_kernels_t *k = NULL;
  char why[256];
  if (fps_kernels_from_env(&k, why, sizeof why) != 0) {
    k = detect_best();
    /* Callers that can fail use fps_kernels_from_env(); this path has no
     * error to return, so at least say once that the setting was ignored. */
    fprintf(stderr, "factorps: %s; using %s\n", why, k->name);
  }
  g_best = k;
}

const fps_kernels_t *fps_kernels_best(void) {
  pthread_once(&g_best_once, choose_once);
  return g_best;
}

int fps_kernels_from_env(const fps_kernels_t **out, char *why, size_t why_len) {
  if (!out) return FPS_EINVAL;
  const char *env = getenv("FACTORPS_SIMD");
  if (!env || !*env) {
    *out = detect_best();
    return 0;
  }
  int rc = fps_kernels_by_name(env, out, why, why_len);
  if (rc != 0 && why && why_len) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "FACTORPS_SIMD: %s", why);
    snprintf(why, why_len, "%s", tmp);
  }
  return rc;
}

void fps_kernels_add_f32(const fps_kernels_t *k, float *dst, const float *src, size_t n) {
  (k ? k : fps_kernels_best())->add_f32(dst, src, n);
}

void fps_kernels_div_f32(const fps_kernels_t *k, float *dst, size_t n, float d) {
  (k ? k : fps_kernels_best())->div_f32(dst, n, d);
}

const char *fps_kernels_name(const fps_kernels_t *k) { return k ? k->name : "none"; }

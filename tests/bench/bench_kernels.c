/* fps_bench_kernels: Adafactor step throughput per SIMD variant, against
 * this machine's memory bandwidth.
 *
 * For fp32 shapes 1024x1024, 4096x4096, 768x3072, 50257x768 and a 16M
 * vector, per supported variant, on 1 thread and on all CPUs: median time
 * per step, ns/element, and effective GB/s = bytes the step must move /
 * time, with the byte count from fps_adafactor_step_bytes() (20 B/elem
 * factored, 32 B/elem for a vector; adafactor_step.c explains them). The
 * same run measures a STREAM-style triad a[i] = b[i] + s*c[i] over three
 * 128 MiB arrays (--triad-mib; STREAM wants each array at least 4x the
 * last-level cache, which 128 MiB is on a 32 MiB L3 but not on a 260 MiB
 * one), counted as STREAM does (24 B/elem,
 * write-allocate traffic not counted), with its reps interleaved with the
 * kernel reps so that a busy machine slows both alike. The triad figure is
 * the best of N reps, as STREAM reports it; each kernel's best rep is set
 * against it ("% of triad": best against best, the same rule for both),
 * beside the kernel's median. torch default settings (no momentum). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "adafactor.h"
#include "pool.h"
#include "simd/kernels_impl.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double minimum(const double *v, int n) {
  double m = v[0];
  for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
  return m;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* ---- triad ---- */

/* Three double arrays of `mib` MiB each (default 128: 4x a 32 MiB L3, so
 * the triad streams from DRAM there). Allocated once; one rep = one pass. */
typedef struct triad_s {
  double *a, *b, *c;
  size_t n, nchunks;
} triad_t;

static void triad_chunk(void *arg, size_t k) {
  triad_t *t = arg;
  size_t lo = t->n * k / t->nchunks, hi = t->n * (k + 1) / t->nchunks;
  double *restrict a = t->a;
  const double *restrict b = t->b, *restrict c = t->c;
  for (size_t i = lo; i < hi; i++) a[i] = b[i] + 3.0 * c[i];
}

static void triad_init(triad_t *t, size_t mib) {
  t->n = mib << 17; /* doubles */
  t->nchunks = 64;
  t->a = malloc(t->n * 8), t->b = malloc(t->n * 8), t->c = malloc(t->n * 8);
  if (!t->a || !t->b || !t->c) {
    fprintf(stderr, "triad: out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < t->n; i++) t->a[i] = 0, t->b[i] = 1, t->c[i] = 2;
}

/* Seconds for one triad pass. */
static double triad_rep(triad_t *t, fps_pool_t *pool) {
  double t0 = now_s();
  fps_pool_run(pool, t->nchunks, triad_chunk, t);
  return now_s() - t0;
}

/* ---- kernel ---- */

typedef struct shape_case_s {
  const char *label;
  fps_shape_t shape;
} shape_case_t;

/* One variant's tensor: its own params, gradient and state. */
typedef struct kcase_s {
  const fps_kernels_t *k;
  float *p, *g;
  fps_adafactor_state_t st;
  uint64_t bytes;
  double times[64];
} kcase_t;

static void kcase_init(kcase_t *c, const fps_kernels_t *k, const fps_shape_t *s,
                       const fps_adafactor_hparams_t *hp, uint64_t n) {
  c->k = k;
  c->p = malloc(n * 4), c->g = malloc(n * 4);
  if (!c->p || !c->g || fps_adafactor_state_init(&c->st, s, hp) != 0) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  rng = 0x2545F4914F6CDD1Dull; /* same data for every variant */
  for (uint64_t i = 0; i < n; i++) c->p[i] = frand() * 0.5f, c->g[i] = frand();
}

static void kcase_free(kcase_t *c) {
  fps_adafactor_state_destroy(&c->st);
  free(c->p), free(c->g);
}

/* The path the fused kernels replaced (reduce.c and dtype.c before them),
 * kept here as the baseline: per 1024 floats, memcpy from the received
 * bytes, then a branch-free OR over the copy tests the exponents (the old
 * fps_dtype_decode); the sync sum did that into a 2048-float stack buffer
 * and then add_f32'd it. */
static size_t old_decode_check(float *dst, const void *src, size_t n) {
  const unsigned char *p = src;
  const uint32_t carry = 0x80000000u - 0x5f000000u;
  for (size_t i = 0; i < n; i += 1024) {
    size_t m = n - i < 1024 ? n - i : 1024;
    memcpy(dst + i, p + 4 * i, m * 4);
    const uint32_t *w = (const uint32_t *)(const void *)(dst + i);
    uint32_t acc = 0;
    for (size_t j = 0; j < m; j++) acc |= (w[j] & 0x7f800000u) + carry;
    if (acc & 0x80000000u)
      for (size_t j = 0; j < m; j++)
        if ((w[j] & 0x7f800000u) >= 0x5f000000u) return i + j;
  }
  return n;
}

static size_t old_sum(const fps_kernels_t *k, float *acc, const void *src, size_t n) {
  float tmp[2048];
  const unsigned char *p = src;
  for (size_t off = 0; off < n; off += 2048) {
    size_t m = n - off < 2048 ? n - off : 2048;
    size_t bad = old_decode_check(tmp, p + 4 * off, m);
    if (bad < m) return off + bad;
    k->add_f32(acc + off, tmp, m);
  }
  return n;
}

enum {
  SK_ADD, SK_OLD_SUM, SK_SUM_F32, SK_SUM_BF16, SK_OLD_DECODE, SK_DECODE_F32, SK_ENCODE_BF16,
  SK_DECODE_BF16, SK_COUNT
};
static const char *const sk_what[SK_COUNT] = {
    "add_f32 (sync sum of fp32 arrays)",
    "old sum: memcpy + check into L1, then add_f32",
    "sum_f32 (check + add from the wire bytes)",
    "sum_bf16 (check + widen + add)",
    "old fps_dtype_decode f32: memcpy + check",
    "decode_f32 (check + copy)",
    "bf16_encode",
    "bf16_decode + gradient check"};
/* bytes each must move: reads plus writes, per element */
static const double sk_bpe[SK_COUNT] = {12, 12, 12, 10, 8, 8, 6, 6};

/* The sync sum and the wire conversions over 16M elements, one thread,
 * per variant; the old memcpy-based decode is variant-independent and
 * runs once. All (kernel, variant) pairs run round-robin rep by rep, so
 * that the machine's load hits the new kernels and the ones they replaced
 * alike: best of `reps` and median. */
static void bench_stream_kernels(int reps) {
  const size_t n = (size_t)16 << 20;
  float *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
  uint16_t *h = malloc(n * 2);
  unsigned char *wire = malloc(n * 4 + 64);
  if (!a || !b || !c || !h || !wire) exit(1);
  for (size_t i = 0; i < n; i++) a[i] = frand(), b[i] = frand() * 1e-3f, c[i] = 0;
  memcpy(wire, b, n * 4);
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, b + i, 4);
    h[i] = (uint16_t)(u >> 16); /* valid bf16 gradients: b's top halves */
  }
  typedef struct pair_s {
    int what;
    const fps_kernels_t *k;
    double t[64];
  } pair_t;
  pair_t pairs[SK_COUNT * 4];
  int np = 0;
  for (int w = 0; w < SK_COUNT; w++)
    for (int vi = 0; fps_kernels_all_names[vi]; vi++) {
      const fps_kernels_t *k;
      if (fps_kernels_by_name(fps_kernels_all_names[vi], &k, NULL, 0) != 0) continue;
      if (w == SK_OLD_DECODE && vi > 0) continue;
      pairs[np].what = w;
      pairs[np++].k = k;
    }
  for (int r = -1; r < reps; r++)
    for (int i = 0; i < np; i++) {
      const fps_kernels_t *k = pairs[i].k;
      size_t got = n;
      double t0 = now_s();
      switch (pairs[i].what) {
        case SK_ADD: k->add_f32(a, b, n); break;
        case SK_OLD_SUM: got = old_sum(k, a, wire, n); break;
        case SK_SUM_F32: got = k->sum_f32(a, wire, n); break;
        case SK_SUM_BF16: got = k->sum_bf16(a, h, n); break;
        case SK_OLD_DECODE: got = old_decode_check(c, wire, n); break;
        case SK_DECODE_F32: got = k->decode_f32(c, wire, n); break;
        case SK_ENCODE_BF16: k->bf16_encode(h, a, n); break;
        default: got = k->bf16_decode(c, h, n); break;
      }
      if (r >= 0) pairs[i].t[r] = now_s() - t0;
      if (got != n) exit(1);
    }
  /* "vs replaced": the fused kernel's best rep against the best rep of
   * the path it replaced, same variant, same run. */
  printf("\n| kernel | simd | best ms | median ms | B/elem | best GB/s | vs scalar (best) | vs replaced (best) |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  double scalar_best = 0, best_of[SK_COUNT][4] = {{0}};
  for (int i = 0; i < np; i++) {
    double best = minimum(pairs[i].t, reps), med = median(pairs[i].t, reps);
    if (i == 0 || pairs[i].what != pairs[i - 1].what) scalar_best = best;
    int w = pairs[i].what, vi = 0;
    while (strcmp(fps_kernels_all_names[vi], pairs[i].k->name)) vi++;
    best_of[w][vi] = best;
    char vs[32] = "-";
    if (w == SK_SUM_F32 && best_of[SK_OLD_SUM][vi] > 0)
      snprintf(vs, sizeof vs, "%.2fx", best_of[SK_OLD_SUM][vi] / best);
    if (w == SK_DECODE_F32 && best_of[SK_OLD_DECODE][0] > 0)
      snprintf(vs, sizeof vs, "%.2fx", best_of[SK_OLD_DECODE][0] / best);
    printf("| %s | %s | %.2f | %.2f | %.0f | %.2f | %.2fx | %s |\n", sk_what[w],
           w == SK_OLD_DECODE ? "memcpy" : pairs[i].k->name, best * 1e3, med * 1e3, sk_bpe[w],
           sk_bpe[w] * (double)n / best / 1e9, scalar_best / best, vs);
  }
  free(a), free(b), free(c), free(h), free(wire);
}

int main(int argc, char **argv) {
  int reps = 9;
  size_t triad_mib = 128;
  const char *only_shape = NULL, *only_simd = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) reps = 3;
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc) only_shape = argv[++i];
    else if (!strcmp(argv[i], "--simd") && i + 1 < argc) only_simd = argv[++i];
    else if (!strcmp(argv[i], "--triad-mib") && i + 1 < argc) triad_mib = (size_t)atol(argv[++i]);
    else {
      fprintf(stderr,
              "usage: %s [--quick] [--reps N] [--shape LABEL|stream] [--simd NAME] [--triad-mib M]\n",
              argv[0]);
      return 2;
    }
  }
  if (triad_mib < 1 || triad_mib > 8192) {
    fprintf(stderr, "--triad-mib must be 1..8192\n");
    return 2;
  }
  if (reps < 1 || reps > 64) {
    fprintf(stderr, "--reps must be 1..64\n");
    return 2;
  }
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu < 1) ncpu = 1;
  const unsigned thread_counts[2] = {1, (unsigned)ncpu};
  const int nt = ncpu > 1 ? 2 : 1;
  fps_pool_t *pools[2] = {NULL, NULL};
  if (nt > 1 && fps_pool_create(&pools[1], (unsigned)ncpu) != 0) return 1;

  triad_t tri;
  triad_init(&tri, triad_mib);
  printf("# Adafactor step (torch defaults) vs a STREAM-style triad a = b + s*c over\n"
         "# 3 x %zu MiB double arrays (24 B/elem counted, as STREAM does). Triad and\n"
         "# kernel reps are interleaved round-robin, so both see the same machine load;\n"
         "# %d reps after 2 warm-ups: ms/step and GB/s are medians, best ms and best GB/s the\n"
         "# fastest rep; the triad is the best rep, as STREAM reports it, and %% of triad is\n"
         "# the kernel's best GB/s over the triad's best.\n"
         "# kernel bytes/elem: factored 20 (pass A reads g,p; pass C reads g,p, writes p),\n"
         "#   vector 32 (pass A reads g,p,v, writes v; pass C reads g,v,p, writes p);\n"
         "#   + the row/col state (negligible).\n\n",
         triad_mib, reps);

  const shape_case_t shapes[] = {
      {"1024x1024", {.ndim = 2, .dim = {1024, 1024}}},
      {"4096x4096", {.ndim = 2, .dim = {4096, 4096}}},
      {"768x3072", {.ndim = 2, .dim = {768, 3072}}},
      {"50257x768", {.ndim = 2, .dim = {50257, 768}}},
      {"16M", {.ndim = 1, .dim = {UINT64_C(16) << 20}}},
  };
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  printf("| shape | simd | threads | ms/step | best ms | ns/elem | B/elem | GB/s | best GB/s "
         "| triad GB/s | %% of triad | vs scalar |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    if (only_shape && strcmp(only_shape, shapes[si].label)) continue;
    uint64_t n;
    fps_shape_validate(&shapes[si].shape, &n, NULL, 0);
    kcase_t cases[4];
    int nc = 0;
    for (int vi = 0; fps_kernels_all_names[vi]; vi++) {
      const fps_kernels_t *k;
      if (fps_kernels_by_name(fps_kernels_all_names[vi], &k, NULL, 0) != 0) continue;
      /* scalar always runs: the "vs scalar" column needs it */
      if (only_simd && vi != 0 && strcmp(only_simd, fps_kernels_all_names[vi])) continue;
      kcase_init(&cases[nc++], k, &shapes[si].shape, &hp, n);
    }
    for (int ti = 0; ti < nt; ti++) {
      double ttimes[64];
      for (int r = -2; r < reps; r++) {
        double tt = triad_rep(&tri, pools[ti]);
        if (r >= 0) ttimes[r] = tt;
        for (int c = 0; c < nc; c++) {
          fps_adafactor_trace_t tr;
          double t0 = now_s();
          if (fps_adafactor_step(cases[c].k, &hp, &cases[c].st, cases[c].p, cases[c].g, pools[ti],
                                 &tr) != 0)
            exit(1);
          if (r >= 0) cases[c].times[r] = now_s() - t0;
          cases[c].bytes = tr.bytes;
        }
      }
      double triad = 24.0 * (double)tri.n / minimum(ttimes, reps) / 1e9; /* best, as STREAM */
      double scalar_t = median(cases[0].times, reps); /* sorts: min is still [0] */
      for (int c = 0; c < nc; c++) {
        double best = minimum(cases[c].times, reps); /* before median() sorts */
        double t = median(cases[c].times, reps);
        double gbs = cases[c].bytes / t / 1e9, best_gbs = cases[c].bytes / best / 1e9;
        printf("| %s | %s | %u | %.3f | %.3f | %.3f | %.1f | %.2f | %.2f | %.2f | %.0f%% | %.2fx |\n",
               shapes[si].label, fps_kernels_name(cases[c].k), thread_counts[ti], t * 1e3,
               best * 1e3, t * 1e9 / n, (double)cases[c].bytes / n, gbs, best_gbs, triad,
               100 * best_gbs / triad, scalar_t / t);
      }
      fflush(stdout);
    }
    for (int c = 0; c < nc; c++) kcase_free(&cases[c]);
  }
  free(tri.a), free(tri.b), free(tri.c);
  if (!only_shape || !strcmp(only_shape, "stream")) bench_stream_kernels(reps);
  fps_pool_destroy(pools[1]);
  return 0;
}

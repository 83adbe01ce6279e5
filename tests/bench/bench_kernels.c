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

/* The sync sum (dst += src, 12 B/elem) and the bf16 wire conversions
 * (encode 6 B/elem, decode + check 6 B/elem) over 16M elements, one
 * thread, per variant: best of `reps` (like the triad) and median. */
static void bench_stream_kernels(int reps) {
  const size_t n = (size_t)16 << 20;
  float *a = malloc(n * 4), *b = malloc(n * 4);
  uint16_t *h = malloc(n * 2);
  if (!a || !b || !h) exit(1);
  for (size_t i = 0; i < n; i++) a[i] = frand(), b[i] = frand() * 1e-3f;
  printf("\n| kernel | simd | best ms | median ms | B/elem | best GB/s | vs scalar (best) |\n");
  printf("|---|---|---|---|---|---|---|\n");
  const char *what[3] = {"add_f32 (sync sum)", "bf16_encode", "bf16_decode"};
  const double bpe[3] = {12, 6, 6};
  for (int w = 0; w < 3; w++) {
    double scalar_best = 0;
    for (int vi = 0; fps_kernels_all_names[vi]; vi++) {
      const fps_kernels_t *k;
      if (fps_kernels_by_name(fps_kernels_all_names[vi], &k, NULL, 0) != 0) continue;
      double t[64];
      for (int r = -1; r < reps; r++) {
        double t0 = now_s();
        if (w == 0) k->add_f32(a, b, n);
        else if (w == 1) k->bf16_encode(h, a, n);
        else if (k->bf16_decode(b, h, n) != n) exit(1);
        if (r >= 0) t[r] = now_s() - t0;
      }
      double best = minimum(t, reps), med = median(t, reps);
      if (vi == 0) scalar_best = best;
      printf("| %s | %s | %.2f | %.2f | %.0f | %.2f | %.2fx |\n", what[w], k->name, best * 1e3,
             med * 1e3, bpe[w], bpe[w] * (double)n / best / 1e9, scalar_best / best);
    }
  }
  free(a), free(b), free(h);
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

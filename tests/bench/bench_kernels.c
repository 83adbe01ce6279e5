/* fps_bench_kernels: Adafactor step throughput per SIMD variant, against
 * this machine's memory bandwidth.
 *
 * For fp32 shapes 1024x1024, 4096x4096, 768x3072, 50257x768 and a 16M
 * vector, per supported variant, on 1 thread and on all CPUs: median time
 * per step, ns/element, and effective GB/s = bytes the step must move /
 * time, with the byte count from fps_adafactor_step_bytes() (20 B/elem
 * factored, 32 B/elem for a vector; adafactor_step.c explains them). The
 * same run measures a STREAM-style triad a[i] = b[i] + s*c[i] over three
 * 128 MiB arrays (4x the L3 here), 1 thread and all, counted as STREAM
 * does (24 B/elem, write-allocate traffic not counted), and prints each
 * kernel's GB/s as a fraction of the triad figure for the same thread
 * count. torch default settings (no momentum). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "adafactor.h"
#include "pool.h"
#include "simd/kernels.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
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

static double triad_gbs(fps_pool_t *pool, int reps) {
  triad_t t = {.n = (size_t)16 << 20, .nchunks = 64};
  t.a = malloc(t.n * 8), t.b = malloc(t.n * 8), t.c = malloc(t.n * 8);
  if (!t.a || !t.b || !t.c) {
    fprintf(stderr, "triad: out of memory\n");
    exit(1);
  }
  /* first touch from the pool, so pages are spread like the work */
  for (size_t i = 0; i < t.n; i++) t.a[i] = 0, t.b[i] = 1, t.c[i] = 2;
  double best = 0, times[64];
  for (int r = 0; r < reps; r++) {
    double t0 = now_s();
    fps_pool_run(pool, t.nchunks, triad_chunk, &t);
    times[r] = now_s() - t0;
  }
  best = median(times, reps);
  double gbs = 24.0 * (double)t.n / best / 1e9;
  free(t.a), free(t.b), free(t.c);
  return gbs;
}

/* ---- kernel ---- */

typedef struct shape_case_s {
  const char *label;
  fps_shape_t shape;
} shape_case_t;

static double bench_step(const fps_kernels_t *k, fps_pool_t *pool, const fps_shape_t *s, int reps,
                         uint64_t *bytes) {
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  uint64_t n;
  fps_shape_validate(s, &n, NULL, 0);
  float *p = malloc(n * 4), *g = malloc(n * 4);
  if (!p || !g) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (uint64_t i = 0; i < n; i++) p[i] = frand() * 0.5f, g[i] = frand();
  fps_adafactor_state_t st;
  if (fps_adafactor_state_init(&st, s, &hp) != 0) exit(1);
  fps_adafactor_trace_t tr;
  double times[64];
  for (int r = -2; r < reps; r++) { /* two warm-up steps */
    double t0 = now_s();
    if (fps_adafactor_step(k, &hp, &st, p, g, pool, &tr) != 0) exit(1);
    if (r >= 0) times[r] = now_s() - t0;
  }
  *bytes = tr.bytes;
  fps_adafactor_state_destroy(&st);
  free(p), free(g);
  return median(times, reps);
}

int main(int argc, char **argv) {
  int reps = 9;
  const char *only_shape = NULL, *only_simd = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) reps = 3;
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc) only_shape = argv[++i];
    else if (!strcmp(argv[i], "--simd") && i + 1 < argc) only_simd = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--quick] [--reps N] [--shape LABEL] [--simd NAME]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 64) reps = 9;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu < 1) ncpu = 1;
  const unsigned thread_counts[2] = {1, (unsigned)ncpu};
  const int nt = ncpu > 1 ? 2 : 1;
  fps_pool_t *pools[2] = {NULL, NULL};
  if (nt > 1 && fps_pool_create(&pools[1], (unsigned)ncpu) != 0) return 1;

  double triad[2];
  for (int ti = 0; ti < nt; ti++) triad[ti] = triad_gbs(pools[ti], reps);
  printf("# STREAM-style triad, 3 x 128 MiB double arrays, 24 B/elem counted:\n");
  for (int ti = 0; ti < nt; ti++)
    printf("#   %u thread(s): %.2f GB/s\n", thread_counts[ti], triad[ti]);
  printf("# kernel bytes/elem: factored 20 (pass A reads g,p; pass C reads g,p, writes p),\n"
         "#   vector 32 (pass A reads g,p,v, writes v; pass C reads g,v,p, writes p);\n"
         "#   + row/col state. torch defaults, median of %d steps after 2 warm-ups.\n\n",
         reps);

  const shape_case_t shapes[] = {
      {"1024x1024", {.ndim = 2, .dim = {1024, 1024}}},
      {"4096x4096", {.ndim = 2, .dim = {4096, 4096}}},
      {"768x3072", {.ndim = 2, .dim = {768, 3072}}},
      {"50257x768", {.ndim = 2, .dim = {50257, 768}}},
      {"16M", {.ndim = 1, .dim = {UINT64_C(16) << 20}}},
  };
  printf("| shape | simd | threads | ms/step | ns/elem | B/elem | GB/s | %% of triad | vs scalar |\n");
  printf("|---|---|---|---|---|---|---|---|---|\n");
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    if (only_shape && strcmp(only_shape, shapes[si].label)) continue;
    uint64_t n;
    fps_shape_validate(&shapes[si].shape, &n, NULL, 0);
    double scalar_t[2] = {0, 0};
    for (int vi = 0; fps_kernels_all_names[vi]; vi++) {
      const fps_kernels_t *k;
      if (fps_kernels_by_name(fps_kernels_all_names[vi], &k, NULL, 0) != 0) continue;
      /* scalar always runs: the "vs scalar" column needs it */
      if (only_simd && vi != 0 && strcmp(only_simd, fps_kernels_all_names[vi])) continue;
      for (int ti = 0; ti < nt; ti++) {
        uint64_t bytes;
        double t = bench_step(k, pools[ti], &shapes[si].shape, reps, &bytes);
        if (vi == 0) scalar_t[ti] = t;
        double gbs = bytes / t / 1e9;
        printf("| %s | %s | %u | %.3f | %.3f | %.1f | %.2f | %.0f%% | %.2fx |\n",
               shapes[si].label, fps_kernels_name(k), thread_counts[ti], t * 1e3, t * 1e9 / n,
               (double)bytes / n, gbs, 100 * gbs / triad[ti], scalar_t[ti] / t);
        fflush(stdout);
      }
    }
  }
  fps_pool_destroy(pools[1]);
  return 0;
}

/* fps_bench_split: the compute cost of a row-split Adafactor step against
 * the whole-tensor step on the same tensor, same thread, same run.
 *
 *   fps_bench_split [--rows R] [--cols C] [--blocks B] [--reps N] [--flavor torch|hf]
 *
 * Each rep runs one whole step (fps_adafactor_step) and one split step of B
 * blocks, one after the other on this thread: every block's pass A, the
 * partials encoded and decoded for each of the B - 1 other blocks (what
 * the wire would carry), every block's combine, then every block's pass C.
 * The order alternates between reps so neither always runs on a warm
 * cache. Prints the median of each and their ratio (split / whole); the
 * machine's load moves both alike, so only the ratio is meaningful. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adafactor.h"
#include "adafactor_split.h"

#define MAXB 64

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void die(const char *what) {
  fprintf(stderr, "fps_bench_split: %s\n", what);
  exit(1);
}

static void split_step(const fps_adafactor_hparams_t *hp, fps_split_state_t *st, size_t nb,
                       float *param, const float *grad, unsigned char **wire) {
  fps_split_step_t *s[MAXB];
  fps_split_partials_t parts[MAXB], dec[MAXB];
  size_t len[MAXB];
  for (size_t b = 0; b < nb; b++) {
    uint64_t off = st[b].g.row_lo * st[b].g.cols;
    if (fps_split_step_begin(NULL, hp, &st[b], param + off, grad + off, NULL, &s[b]))
      die("begin failed");
    parts[b] = *fps_split_step_partials(s[b]);
    len[b] = fps_split_partials_encode(&parts[b], wire[b],
                                       fps_split_partials_size(&st[b].g, FPS_SPLIT_PHASE_STATS));
  }
  for (size_t me = 0; me < nb; me++) {
    for (size_t b = 0; b < nb; b++) {
      if (b == me) {
        dec[b] = parts[b];
        continue;
      }
      if (fps_split_partials_decode(wire[b], len[b], &st[b].g, FPS_SPLIT_PHASE_STATS, &dec[b],
                                    NULL, 0))
        die("decode failed");
    }
    if (fps_split_step_combine(s[me], dec, nb, NULL, 0)) die("combine failed");
    if (fps_split_step_needs_u2(s[me])) die("the bench's gradients take the u2 phase");
    for (size_t b = 0; b < nb; b++)
      if (b != me) fps_split_partials_free(&dec[b]);
  }
  for (size_t b = 0; b < nb; b++) {
    if (fps_split_step_apply(s[b], NULL)) die("apply failed");
    fps_split_step_free(s[b]);
  }
}

int main(int argc, char **argv) {
  unsigned long rows = 8192, cols = 4096, blocks = 4, reps = 7;
  const char *flavor = "torch";
  static const struct option opts[] = {{"rows", required_argument, NULL, 'r'},
                                       {"cols", required_argument, NULL, 'c'},
                                       {"blocks", required_argument, NULL, 'b'},
                                       {"reps", required_argument, NULL, 'n'},
                                       {"flavor", required_argument, NULL, 'f'},
                                       {NULL, 0, NULL, 0}};
  int o;
  while ((o = getopt_long(argc, argv, "r:c:b:n:f:", opts, NULL)) != -1) {
    switch (o) {
      case 'r': rows = strtoul(optarg, NULL, 10); break;
      case 'c': cols = strtoul(optarg, NULL, 10); break;
      case 'b': blocks = strtoul(optarg, NULL, 10); break;
      case 'n': reps = strtoul(optarg, NULL, 10); break;
      case 'f': flavor = optarg; break;
      default:
        fprintf(stderr, "usage: fps_bench_split [--rows R] [--cols C] [--blocks B] [--reps N] "
                        "[--flavor torch|hf]\n");
        return 2;
    }
  }
  if (!rows || !cols || blocks < 2 || blocks > MAXB || blocks > rows || !reps || reps > 1000)
    die("need rows, cols >= 1, 2 <= blocks <= min(64, rows), 1 <= reps <= 1000");
  fps_adafactor_hparams_t hp;
  fps_flavor_t fl;
  if (fps_flavor_parse(flavor, &fl)) die("--flavor must be torch or hf");
  fps_adafactor_defaults(&hp, fl);
  fps_shape_t shape = {.ndim = 2, .dim = {rows, cols}};
  const size_t n = (size_t)rows * cols;
  float *pw = malloc(n * sizeof(float)), *ps = malloc(n * sizeof(float));
  float *g = malloc(n * sizeof(float));
  if (!pw || !ps || !g) die("out of memory");
  unsigned seed = 1;
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    g[i] = ((float)(seed >> 8 & 0xffff) / 65536.0f - 0.5f) * 0.1f;
    pw[i] = ps[i] = (float)((seed >> 4) & 0xff) / 256.0f - 0.5f;
  }
  fps_adafactor_state_t whole;
  if (fps_adafactor_state_init(&whole, &shape, &hp)) die("state init failed");
  fps_split_state_t st[MAXB];
  unsigned char *wire[MAXB];
  for (size_t b = 0; b < blocks; b++) {
    fps_split_geom_t geo;
    if (fps_split_geom_init(&geo, &shape, rows * b / blocks, rows * (b + 1) / blocks, NULL, 0) ||
        fps_split_state_init(&st[b], &geo, &hp))
      die("block init failed");
    wire[b] = malloc(fps_split_partials_size(&geo, FPS_SPLIT_PHASE_STATS));
    if (!wire[b]) die("out of memory");
  }
  double *tw = malloc(reps * sizeof(double)), *ts = malloc(reps * sizeof(double));
  if (!tw || !ts) die("out of memory");
  for (unsigned long r = 0; r < reps; r++) {
    for (int k = 0; k < 2; k++) {
      bool do_split = (r + k) % 2 == 1;
      double t0 = now();
      if (do_split) {
        split_step(&hp, st, blocks, ps, g, wire);
        ts[r] = now() - t0;
      } else {
        if (fps_adafactor_step(NULL, &hp, &whole, pw, g, NULL, NULL)) die("step failed");
        tw[r] = now() - t0;
      }
    }
  }
  /* Same input, same steps: the results must agree (bit for bit so far). */
  size_t differ = 0;
  for (size_t i = 0; i < n; i++) differ += pw[i] != ps[i];
  qsort(tw, reps, sizeof *tw, cmp_double);
  qsort(ts, reps, sizeof *ts, cmp_double);
  printf("%s [%lu, %lu] in %lu blocks, %lu reps, kernels %s: whole %.2f ms, split %.2f ms "
         "(median), split/whole %.3f; %zu of %zu params differ\n",
         flavor, rows, cols, blocks, reps, fps_kernels_name(fps_kernels_best()),
         1e3 * tw[reps / 2], 1e3 * ts[reps / 2], ts[reps / 2] / tw[reps / 2], differ, n);
  for (size_t b = 0; b < blocks; b++) {
    fps_split_state_destroy(&st[b]);
    free(wire[b]);
  }
  fps_adafactor_state_destroy(&whole);
  free(pw);
  free(ps);
  free(g);
  free(tw);
  free(ts);
  return 0;
}

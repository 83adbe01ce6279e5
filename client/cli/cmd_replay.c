/* `factorps replay VECTORS_DIR OUT_DIR [--simd scalar|avx2|avx512|neon] [--threads N]`
 *
 * Runs every golden-vector case in VECTORS_DIR (adafactor-golden-v1: one
 * directory per case with hparams.txt, param_0.bin, grad_<t>.bin) through
 * the kernels and writes OUT_DIR/<case>/param_<t>.bin and
 * state_<row|col|var|mom>.bin, for tests/vectors/check_vectors.py. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adafactor.h"
#include "commands.h"
#include "golden.h"
#include "pool.h"
#include "simd/kernels.h"

static void replay_usage(FILE *out) {
  fprintf(out,
          "usage: factorps replay VECTORS_DIR OUT_DIR [--simd scalar|avx2|avx512|neon] [--threads N]\n"
          "       [--case SUBSTR]\n"
          "Replays Adafactor golden vectors and writes OUT_DIR/<case>/param_<t>.bin and\n"
          "state_<name>.bin. --simd defaults to $FACTORPS_SIMD or the best variant;\n"
          "--threads (default 1) splits large tensors over a thread pool.\n"
          "Exit status: 0 all cases replayed, 1 a case failed, 2 usage error,\n"
          "77 the --simd variant is not supported on this machine.\n");
}

int fps_cli_replay(int argc, char **argv) {
  static const struct option opts[] = {{"simd", required_argument, NULL, 's'},
                                       {"threads", required_argument, NULL, 't'},
                                       {"case", required_argument, NULL, 'c'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *simd = NULL, *filter = NULL;
  unsigned threads = 1;
  char why[512] = "";
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "s:t:c:h", opts, NULL)) != -1) {
    switch (c) {
      case 's': simd = optarg; break;
      case 'c': filter = optarg; break;
      case 't': {
        unsigned long long v;
        if (fps_cli_u64(optarg, "--threads", 1, 256, &v)) return 2;
        threads = (unsigned)v;
        break;
      }
      case 'h': replay_usage(stdout); return 0;
      default: replay_usage(stderr); return 2;
    }
  }
  if (fps_cli_operands("replay", argc, argv, optind, 2, 2, "VECTORS_DIR and OUT_DIR")) {
    replay_usage(stderr);
    return 2;
  }
  const char *vec_dir = argv[optind], *out_dir = argv[optind + 1];

  const fps_kernels_t *k;
  int rc = simd ? fps_kernels_by_name(simd, &k, why, sizeof why)
                : fps_kernels_from_env(&k, why, sizeof why);
  if (rc) {
    fprintf(stderr, "factorps replay: %s\n", why);
    /* 77 (the automake "skipped" status): scripts can tell "this machine
     * cannot run that variant" from a usage error. */
    return rc == FPS_EUNSUPPORTED ? 77 : 2;
  }
  fps_pool_t *pool = NULL;
  if (threads > 1 && (rc = fps_pool_create(&pool, threads)) != 0) {
    fprintf(stderr, "factorps replay: cannot start %u threads: %s\n", threads, fps_strerror(rc));
    return 1;
  }

  char **names = NULL;
  size_t n = 0, done = 0, failed = 0;
  rc = fps_golden_list(vec_dir, &names, &n, why, sizeof why);
  if (rc) {
    fprintf(stderr, "factorps replay: %s\n", why);
    fps_pool_destroy(pool);
    return 1;
  }
  for (size_t i = 0; i < n; i++) {
    if (filter && !strstr(names[i], filter)) continue;
    fps_golden_case_t gc;
    fps_golden_run_t run;
    memset(&run, 0, sizeof run);
    rc = fps_golden_load(vec_dir, names[i], &gc, why, sizeof why);
    if (!rc) rc = fps_golden_run(&gc, k, pool, &run, why, sizeof why);
    if (!rc) rc = fps_golden_write_results(&gc, &run, out_dir, why, sizeof why);
    fps_golden_run_free(&run);
    if (rc) {
      fprintf(stderr, "factorps replay: %s: %s (%s)\n", names[i], why, fps_err_name(rc));
      failed++;
    } else {
      done++;
    }
  }
  fps_golden_list_free(names, n);
  fps_pool_destroy(pool);
  if (done + failed == 0) {
    if (filter && n)
      fprintf(stderr, "factorps replay: no case of the %zu in %s matches --case '%s'\n", n, vec_dir, filter);
    else
      fprintf(stderr, "factorps replay: no cases found in %s\n", vec_dir);
    return 1;
  }
  printf("replayed %zu case(s) with %s kernels into %s", done, fps_kernels_name(k), out_dir);
  if (failed) printf(", %zu failed", failed);
  printf("\n");
  return failed ? 1 : 0;
}

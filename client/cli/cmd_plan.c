/* factorps plan: where the tensors of a `factorps load` model would go on S
 * shards, with and without row splitting (fps_client_placement_plan), with
 * no shard involved. Prints each shard's bytes, the blocks of every split
 * tensor and max/min shard bytes both ways; the last line is
 * `RESULT key=value ...` for scripts. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "commands.h"
#include "models.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps plan --shard-count S [--model gpt|peer] [--params N] [--tensors K]\n"
          "                     [--split-min-bytes B]\n"
          "Prints the placement of the load model's tensors on S shards (1..65536): each\n"
          "shard's bytes and the row blocks of every tensor of at least B bytes (default\n"
          "32Mi, the recommended threshold; 0 never splits), and max/min shard bytes with\n"
          "and without splitting. N (default 100M) and B take k/M/G (10^3..) or Ki/Mi/Gi\n"
          "(2^10..) suffixes. --model and --tensors as in `factorps load`.\n");
}

static double ratio(const uint64_t *load, size_t S) {
  uint64_t mx = 0, mn = UINT64_MAX;
  for (size_t s = 0; s < S; s++) {
    if (load[s] > mx) mx = load[s];
    if (load[s] < mn) mn = load[s];
  }
  return mn ? (double)mx / (double)mn : 0.0; /* 0: a shard holds nothing */
}

int fps_cli_plan(int argc, char **argv) {
  static const struct option longopts[] = {{"shard-count", required_argument, NULL, 'S'},
                                           {"model", required_argument, NULL, 'o'},
                                           {"params", required_argument, NULL, 'n'},
                                           {"tensors", required_argument, NULL, 'K'},
                                           {"split-min-bytes", required_argument, NULL, 'B'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  unsigned long long shards = 0, params = 100000000, tensors = 64;
  unsigned long long split = FPS_SPLIT_MIN_BYTES_DEFAULT;
  int peer = 0, opt, rc = 1;
  fps_cli_model_t m = {0};
  fps_block_t *blocks = NULL;
  uint64_t *whole = NULL, *load = NULL;

  optind = 1;
  while ((opt = getopt_long(argc, argv, "hS:o:n:K:B:", longopts, NULL)) != -1) {
    switch (opt) {
      case 'S':
        if (fps_cli_u64(optarg, "--shard-count", 1, 65536, &shards)) return 2;
        break;
      case 'o':
        if (strcmp(optarg, "gpt") && strcmp(optarg, "peer")) {
          fprintf(stderr, "factorps plan: --model must be gpt or peer, not '%s'\n", optarg);
          return 2;
        }
        peer = !strcmp(optarg, "peer");
        break;
      case 'n':
        if (fps_cli_bytes(optarg, "--params", &params)) return 2;
        if (params == 0 || params > (1ull << 40)) {
          fprintf(stderr, "factorps plan: --params must be 1..2^40, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'K':
        if (fps_cli_u64(optarg, "--tensors", 7, 3073, &tensors)) return 2;
        break;
      case 'B':
        if (fps_cli_bytes(optarg, "--split-min-bytes", &split)) return 2;
        break;
      case 'h':
        usage(stdout);
        return 0;
      default:
        usage(stderr);
        return 2;
    }
  }
  if (optind < argc || !shards) {
    if (!shards) fprintf(stderr, "factorps plan: --shard-count is required\n");
    else fprintf(stderr, "factorps plan: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  int mrc = peer ? fps_cli_model_peer(&m, params, tensors, "factorps plan")
                 : fps_cli_model_gpt(&m, params, "factorps plan");
  if (mrc) return mrc;
  const size_t S = (size_t)shards;
  fps_status_t st;
  size_t nb = 0;
  whole = fps_calloc(S, sizeof *whole);
  load = fps_calloc(S, sizeof *load);
  if (!whole || !load) goto nomem;
  /* Ask the split plan's size first: it has at least as many blocks as
   * the whole-tensor plan. */
  if (fps_client_placement_plan(m.defs, m.n_tensors, S, split, NULL, 0, &nb, NULL, &st) &&
      st.code != FPS_CODE_OUT_OF_RANGE)
    goto failed;
  blocks = fps_malloc((nb ? nb : 1) * sizeof *blocks);
  if (!blocks) goto nomem;
  size_t nwhole;
  if (fps_client_placement_plan(m.defs, m.n_tensors, S, 0, blocks, nb, &nwhole, whole, &st) ||
      fps_client_placement_plan(m.defs, m.n_tensors, S, split, blocks, nb, &nb, load, &st))
    goto failed;

  printf("%s model, %llu parameters in %zu tensors (%.1f MB), %zu shards, split_min_bytes %llu\n",
         peer ? "peer" : "gpt", (unsigned long long)m.total, m.n_tensors,
         (double)m.total * 4 / 1e6, S, split);
  size_t split_tensors = 0;
  for (size_t k = 0; k < nb;) {
    size_t e = k + 1;
    while (e < nb && blocks[e].tensor == blocks[k].tensor) e++;
    if (e - k > 1) {
      const fps_tensor_def_t *d = &m.defs[blocks[k].tensor];
      split_tensors++;
      printf("split %s [", d->name);
      for (uint32_t i = 0; i < d->ndim; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)d->shape[i]);
      printf("]:");
      for (size_t b = k; b < e; b++)
        printf(" shard %d rows [%llu, %llu)", blocks[b].shard, (unsigned long long)blocks[b].row_lo,
               (unsigned long long)blocks[b].row_hi);
      printf("\n");
    }
    k = e;
  }
  for (size_t s = 0; s < S; s++)
    printf("shard %zu: %.3f MB split, %.3f MB whole\n", s, (double)load[s] / 1e6,
           (double)whole[s] / 1e6);
  printf("max/min shard bytes: %.4f split, %.4f whole\n", ratio(load, S), ratio(whole, S));
  printf("RESULT shards=%zu split_tensors=%zu blocks=%zu ratio_split=%.6f ratio_whole=%.6f\n", S,
         split_tensors, nb, ratio(load, S), ratio(whole, S));
  rc = 0;
  goto done;
nomem:
  fprintf(stderr, "factorps plan: out of memory\n");
  goto done;
failed:
  fprintf(stderr, "factorps plan: %s\n", st.message);
done:
  fps_free(blocks);
  fps_free(whole);
  fps_free(load);
  fps_cli_model_free(&m);
  return rc;
}

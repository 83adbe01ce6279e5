/* factorps checkpoint --shards A,B [--deadline S]: every shard writes a
 * durable checkpoint now.
 * factorps checkpoint verify DIR [--shard-id I --shard-count N] [--mode M]:
 * checks every checkpoint file in DIR completely (header bounds, metadata,
 * both SHA-256s, and the placement if given); exit 1 if any file is bad.
 * Leftover temporary files of an interrupted write are not checkpoints and
 * are listed as ignored.
 * factorps checkpoint reshard --shard-count S' [--split-min-bytes B]
 * IN_DIR... OUT_DIR...: the newest valid checkpoints of a job's S shards,
 * verified as one job and gathered whole, written as S' checkpoints placed
 * exactly as the workers place the tensors (fps_client_placement_plan with
 * the same split_min_bytes). */
#include <dirent.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "checkpoint.h"
#include "checkpoint_reshard.h"
#include "commands.h"
#include "factorps/client.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps checkpoint --shards HOST:PORT[,HOST:PORT...] [--deadline SECONDS]\n"
          "       factorps checkpoint verify DIR [--shard-id I --shard-count N] [--mode sync|async|ssp]\n"
          "       factorps checkpoint reshard --shard-count S' [--split-min-bytes B] IN_DIR... OUT_DIR...\n"
          "The first form asks every shard to write a durable checkpoint into its --checkpoint-dir\n"
          "and prints one line per shard. The second verifies every checkpoint file in DIR (header,\n"
          "bounds, SHA-256 of header and data, the values a shard's loader checks, and the\n"
          "placement if given) and exits 1 if any is bad.\n"
          "The third reads the newest valid checkpoint of each of a job's S shards (the first S\n"
          "directories; the last S' are the outputs), checks that they are one job, and writes S'\n"
          "checkpoints that shards started with --shard-count S' restore; B must be the workers'\n"
          "split_min_bytes (default 0, never split; k/M/G, Ki/Mi/Gi suffixes). See `reshard --help`.\n"
          "--shards defaults to $FACTORPS_SHARDS. Options of the first form:\n" FPS_CLI_SEC_USAGE);
}

static int verify(int argc, char **argv) {
  static const struct option longopts[] = {{"shard-id", required_argument, NULL, 'i'},
                                           {"shard-count", required_argument, NULL, 'n'},
                                           {"mode", required_argument, NULL, 'm'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  unsigned long long id = 0, count = 0;
  int have_id = 0, have_count = 0, opt;
  const char *mode = NULL;
  optind = 1;
  while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (opt) {
      case 'i':
        if (fps_cli_u64(optarg, "--shard-id", 0, 65535, &id)) return 2;
        have_id = 1;
        break;
      case 'n':
        if (fps_cli_u64(optarg, "--shard-count", 1, 65536, &count)) return 2;
        have_count = 1;
        break;
      case 'm':
        if (fps_cli_mode(optarg, "--mode")) return 2;
        mode = optarg;
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (have_id != have_count) {
    fprintf(stderr, "factorps checkpoint verify: --shard-id and --shard-count go together\n");
    return 2;
  }
  if (have_id && id >= count) {
    fprintf(stderr, "factorps checkpoint verify: --shard-id %llu must be below --shard-count %llu\n",
            (unsigned long long)id, (unsigned long long)count);
    return 2;
  }
  if (fps_cli_operands("checkpoint verify", argc, argv, optind, 1, 1, "the checkpoint DIR")) {
    usage(stderr);
    return 2;
  }
  const char *dir = argv[optind];
  fps_ckpt_expect_t ex = {.shard_id = (uint32_t)id, .shard_count = (uint32_t)count, .mode = mode};
  /* Mode alone is checked by asking for "any placement" per file below. */
  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  /* The values too, as a shard loading a file checks them: one whose
   * digests were recomputed over a NaN verifies byte for byte. */
  int rc = fps_ckpt_list_values(dir, have_id ? &ex : NULL, &e, &n);
  if (rc < 0) {
    fprintf(stderr, "factorps checkpoint verify: %s: %s\n", dir, fps_strerror(rc));
    return 1;
  }
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    int st = e[i].status;
    if (st == 0 && mode && !have_id && strcmp(mode, e[i].info.shard.mode)) {
      st = FPS_ESTATE;
      snprintf(e[i].why, sizeof e[i].why, "written in mode %s, not %s", e[i].info.shard.mode, mode);
    }
    if (st == 0) {
      printf("ok   %s  sequence %llu  shard %u/%u  mode %s  %llu tensors (%llu row blocks)  %llu bytes  "
             "created %s%s%s\n",
             e[i].path, (unsigned long long)e[i].info.seq, e[i].info.shard.shard_id,
             e[i].info.shard.shard_count, e[i].info.shard.mode, (unsigned long long)e[i].info.tensors,
             (unsigned long long)e[i].info.blocks, (unsigned long long)e[i].info.file_bytes,
             e[i].info.created, e[i].info.shard.job_id[0] ? "  job " : "", e[i].info.shard.job_id);
    } else {
      bad++;
      printf("BAD  %s  %s: %s\n", e[i].path, fps_err_name(st), e[i].why);
    }
  }
  fps_ckpt_list_free(e);
  /* Temporary files of interrupted writes: not checkpoints, never loaded. */
  size_t tmp = 0;
  DIR *d = opendir(dir);
  for (struct dirent *de; d && (de = readdir(d));) {
    size_t l = strlen(de->d_name);
    if (de->d_name[0] == '.' && l > 4 && !strcmp(de->d_name + l - 4, ".tmp")) {
      printf("ignored %s/%s (temporary file of an interrupted write)\n", dir, de->d_name);
      tmp++;
    }
  }
  if (d) closedir(d);
  printf("%zu checkpoint%s, %zu bad, %zu temporary file%s ignored\n", n, n == 1 ? "" : "s", bad, tmp,
         tmp == 1 ? "" : "s");
  return bad ? 1 : 0;
}

static void reshard_usage(FILE *out) {
  fprintf(out,
          "usage: factorps checkpoint reshard --shard-count S' [--split-min-bytes B] IN_DIR... OUT_DIR...\n"
          "Turns the checkpoints of a job's S shards into checkpoints for S' shards. IN_DIR...: the\n"
          "--checkpoint-dir of every shard of the job, any order (S = the number of directories\n"
          "minus S'); the newest valid checkpoint of each is used, and all must be of one moment\n"
          "(take them with `factorps checkpoint --shards ...` while no worker pushes). OUT_DIR...:\n"
          "S' directories, output shard k into the k-th (created if missing; none may hold a\n"
          "checkpoint yet). Tensors are placed exactly as workers with this split_min_bytes place\n"
          "them (B: the workers' value, default 0 = never split, as every client's default; k/M/G =\n"
          "10^3.., Ki/Mi/Gi = 2^10..). Every input is verified; nothing is left in OUT_DIR if\n"
          "anything fails.\n");
}

static void reshard_rejected(void *ctx, const char *path, int err, const char *why) {
  (void)ctx;
  fprintf(stderr, "factorps checkpoint reshard: %s skipped (%s): %s; trying the previous one\n", path,
          fps_err_name(err), why);
}

static int reshard(int argc, char **argv) {
  static const struct option longopts[] = {{"shard-count", required_argument, NULL, 'n'},
                                           {"split-min-bytes", required_argument, NULL, 'B'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  unsigned long long out_count = 0, split = 0;
  int opt, rc = 1;
  optind = 1;
  while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (opt) {
      case 'n':
        if (fps_cli_u64(optarg, "--shard-count", 1, 65536, &out_count)) return 2;
        break;
      case 'B':
        if (fps_cli_bytes(optarg, "--split-min-bytes", &split)) return 2;
        break;
      case 'h': reshard_usage(stdout); return 0;
      default: reshard_usage(stderr); return 2;
    }
  }
  size_t total = (size_t)(argc - optind);
  if (!out_count || total <= out_count) {
    fprintf(stderr, "factorps checkpoint reshard: need --shard-count S' and at least one input "
                    "directory before the S' output directories\n");
    reshard_usage(stderr);
    return 2;
  }
  const size_t n_in = total - out_count;
  char *const *in_dirs = argv + optind;
  const char *const *out_dirs = (const char *const *)(argv + optind + n_in);
  fps_ckpt_t **in = fps_calloc(n_in, sizeof *in);
  fps_ckpt_job_t *job = NULL;
  fps_tensor_def_t *defs = NULL;
  fps_block_t *blocks = NULL;
  fps_ckpt_place_t *plan = NULL;
  fps_ckpt_written_t *w = fps_calloc(out_count, sizeof *w);
  char why[FPS_CKPT_WHY_MAX] = "";
  if (!in || !w) goto nomem;
  for (size_t i = 0; i < n_in; i++) {
    int lrc = fps_ckpt_load_newest(in_dirs[i], NULL, reshard_rejected, NULL, &in[i]);
    if (lrc < 0) {
      fprintf(stderr, "factorps checkpoint reshard: %s: %s\n", in_dirs[i],
              lrc == FPS_ENOTFOUND ? "no checkpoint (or no such directory)"
              : lrc == FPS_EFORMAT ? "no valid checkpoint"
                                   : fps_strerror(lrc));
      goto done;
    }
  }
  int grc = fps_ckpt_job_gather(in, n_in, &job, why, sizeof why);
  if (grc < 0) {
    fprintf(stderr, "factorps checkpoint reshard: %s (%s)\n", why, fps_err_name(grc));
    goto done;
  }
  if (!(defs = fps_calloc(job->n ? job->n : 1, sizeof *defs))) goto nomem;
  for (size_t i = 0; i < job->n; i++) {
    const fps_shape_t *sh = &job->t[i].state.shape;
    defs[i].name = job->t[i].name;
    defs[i].ndim = sh->ndim;
    memcpy(defs[i].shape, sh->dim, sh->ndim * sizeof *sh->dim);
  }
  fps_status_t st;
  size_t nb = 0;
  /* The workers' own placement: ask for the block count, then the blocks. */
  int prc = fps_client_placement_plan(defs, job->n, out_count, split, NULL, 0, &nb, NULL, &st);
  if (prc && st.code != FPS_CODE_OUT_OF_RANGE) goto plan_failed;
  if (!(blocks = fps_calloc(nb ? nb : 1, sizeof *blocks)) || !(plan = fps_calloc(nb ? nb : 1, sizeof *plan)))
    goto nomem;
  if (fps_client_placement_plan(defs, job->n, out_count, split, blocks, nb, &nb, NULL, &st))
    goto plan_failed;
  size_t n_split = 0;
  for (size_t k = 0; k < nb; k++) {
    plan[k] = (fps_ckpt_place_t){.tensor = blocks[k].tensor, .shard = (uint32_t)blocks[k].shard,
                                 .row_lo = blocks[k].row_lo, .row_hi = blocks[k].row_hi};
    n_split += k && blocks[k].tensor == blocks[k - 1].tensor &&
               (k < 2 || blocks[k - 2].tensor != blocks[k].tensor);
  }
  /* Shards hold row blocks only in sync mode (server/shard/split_block.c):
   * outputs they would refuse to start on are not written at all. */
  if (n_split && strcmp(job->mode, "sync") != 0) {
    fprintf(stderr,
            "factorps checkpoint reshard: the job runs in mode %s, and split tensors need --mode sync: "
            "with --split-min-bytes %llu, %zu tensor%s would be split; nothing written\n",
            job->mode, split, n_split, n_split == 1 ? "" : "s");
    goto done;
  }
  int wrc = fps_ckpt_job_write(job, plan, nb, (uint32_t)out_count, out_dirs, w, why, sizeof why);
  if (wrc < 0) {
    fprintf(stderr, "factorps checkpoint reshard: %s (%s); nothing written\n", why, fps_err_name(wrc));
    goto done;
  }
  for (size_t i = 0; i < n_in; i++)
    printf("in   %s  shard %u/%u  sequence %llu  %llu tensors (%llu row blocks)\n", in[i]->path,
           in[i]->info.shard.shard_id, in[i]->info.shard.shard_count,
           (unsigned long long)in[i]->info.seq, (unsigned long long)in[i]->info.tensors,
           (unsigned long long)in[i]->info.blocks);
  for (unsigned long long k = 0; k < out_count; k++) {
    size_t nt = 0, nblk = 0;
    for (size_t b = 0; b < nb; b++) {
      if (plan[b].shard != k) continue;
      nt++;
      bool whole = (b == 0 || plan[b - 1].tensor != plan[b].tensor) &&
                   (b + 1 == nb || plan[b + 1].tensor != plan[b].tensor);
      nblk += !whole;
    }
    printf("out  %s  shard %llu/%llu  %zu tensors (%zu row blocks)  %llu bytes\n", w[k].path, k,
           out_count, nt, nblk, (unsigned long long)w[k].file_bytes);
  }
  printf("resharded %zu tensors (%zu split) of %zu shards onto %llu shards, mode %s, "
         "split_min_bytes %llu\n",
         job->n, n_split, n_in, out_count, job->mode, split);
  rc = 0;
  goto done;
plan_failed:
  fprintf(stderr, "factorps checkpoint reshard: placement: %s: %s\n", fps_code_name(st.code),
          st.message);
  goto done;
nomem:
  fprintf(stderr, "factorps checkpoint reshard: out of memory\n");
done:
  for (size_t i = 0; in && i < n_in; i++) fps_ckpt_destroy(in[i]);
  fps_free(in);
  fps_ckpt_job_destroy(job);
  fps_free(defs);
  fps_free(blocks);
  fps_free(plan);
  fps_free(w);
  return rc;
}

int fps_cli_checkpoint(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "verify")) return verify(argc - 1, argv + 1);
  if (argc >= 2 && !strcmp(argv[1], "reshard")) return reshard(argc - 1, argv + 1);
  static const struct option longopts[] = {{"shards", required_argument, NULL, 's'},
                                           {"deadline", required_argument, NULL, 'd'},
                                           {"help", no_argument, NULL, 'h'},
                                           FPS_CLI_SEC_LONGOPTS,
                                           {NULL, 0, NULL, 0}};
  const char *shards = fps_cli_env_shards();
  fps_cli_sec_t sec = {0};
  int opt, rc = 1;
  double deadline = 300;
  char **addrs = NULL;
  size_t n = 0;
  fps_client_t *c = NULL;
  fps_checkpoint_info_t *info = NULL;
  fps_status_t status;
  optind = 1;
  while ((opt = getopt_long(argc, argv, "hs:d:", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': shards = optarg; break;
      case 'd':
        if (fps_cli_double(optarg, "--deadline", 0.001, 86400, &deadline)) return 2;
        break;
      case 'h': usage(stdout); return 0;
      default:
        if (fps_cli_sec_opt(&sec, opt, optarg)) break;
        usage(stderr);
        return 2;
    }
  }
  if (fps_cli_operands("checkpoint", argc, argv, optind, 0, 0, "")) {
    usage(stderr);
    return 2;
  }
  if (!shards) {
    fprintf(stderr, "factorps %s: no shards: pass --shards HOST:PORT[,...] or set FACTORPS_SHARDS\n",
            "checkpoint");
    return 2;
  }
  int crc = fps_cli_connect("checkpoint", shards, &sec, deadline, 2, &addrs, &n, &c, &status);
  if (crc == 2) return 2;
  if (crc) goto fail;
  if (!(info = fps_calloc(n, sizeof *info))) {
    snprintf(status.message, sizeof status.message, "out of memory");
    status.code = FPS_CODE_RESOURCE_EXHAUSTED;
    goto fail;
  }
  if (fps_client_checkpoint(c, info, n, &status)) goto fail;
  for (size_t i = 0; i < n; i++)
    printf("shard %zu  %s  sequence %llu  %llu tensors  %llu bytes  %.3f s  %s\n", i, addrs[i],
           (unsigned long long)info[i].sequence, (unsigned long long)info[i].tensors,
           (unsigned long long)info[i].bytes, info[i].seconds, info[i].path);
  rc = 0;
  goto done;
fail:
  fprintf(stderr, "factorps checkpoint: %s: %s\n", fps_code_name(status.code), status.message);
done:
  fps_free(info);
  fps_client_destroy(c);
  fps_cli_split_free(addrs);
  fps_cli_sec_free(&sec);
  return rc;
}

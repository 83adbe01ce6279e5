/* factorps checkpoint --shards A,B [--deadline S]: every shard writes a
 * durable checkpoint now.
 * factorps checkpoint verify DIR [--shard-id I --shard-count N] [--mode M]:
 * checks every checkpoint file in DIR completely (header bounds, metadata,
 * both SHA-256s, and the placement if given); exit 1 if any file is bad.
 * Leftover temporary files of an interrupted write are not checkpoints and
 * are listed as ignored. */
#include <dirent.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "commands.h"
#include "factorps/client.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps checkpoint --shards HOST:PORT[,HOST:PORT...] [--deadline SECONDS]\n"
          "       factorps checkpoint verify DIR [--shard-id I --shard-count N] [--mode sync|async|ssp]\n"
          "The first form asks every shard to write a durable checkpoint into its --checkpoint-dir\n"
          "and prints one line per shard. The second verifies every checkpoint file in DIR (header,\n"
          "bounds, SHA-256 of header and data, and the placement if given) and exits 1 if any is bad.\n"
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
      case 'm': mode = optarg; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind + 1 != argc || have_id != have_count || (have_id && id >= count)) {
    usage(stderr);
    return 2;
  }
  const char *dir = argv[optind];
  fps_ckpt_expect_t ex = {.shard_id = (uint32_t)id, .shard_count = (uint32_t)count, .mode = mode};
  /* Mode alone is checked by asking for "any placement" per file below. */
  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  int rc = fps_ckpt_list(dir, have_id ? &ex : NULL, &e, &n);
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
      printf("ok   %s  sequence %llu  shard %u/%u  mode %s  %llu tensors  %llu bytes  created %s\n", e[i].path,
             (unsigned long long)e[i].info.seq, e[i].info.shard.shard_id, e[i].info.shard.shard_count,
             e[i].info.shard.mode, (unsigned long long)e[i].info.tensors,
             (unsigned long long)e[i].info.file_bytes, e[i].info.created);
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

int fps_cli_checkpoint(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "verify")) return verify(argc - 1, argv + 1);
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
  if (!shards) {
    fprintf(stderr, "factorps %s: no shards: pass --shards HOST:PORT[,...] or set FACTORPS_SHARDS\n",
            "checkpoint");
    return 2;
  }
  if (optind != argc) {
    usage(stderr);
    return 2;
  }
  int crc = fps_cli_connect("checkpoint", shards, &sec, deadline, 2, &addrs, &n, &c, &status);
  if (crc == 2) return 2;
  if (crc) goto fail;
  if (!(info = calloc(n, sizeof *info))) {
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
  free(info);
  fps_client_destroy(c);
  fps_cli_split_free(addrs);
  fps_cli_sec_free(&sec);
  return rc;
}

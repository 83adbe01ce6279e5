/* factorps pull --shards A,B NAME...: current values of tensors. Finds the
 * tensors on the shards (Stats), pulls them, and prints version, shape and
 * a summary (min, max, mean, RMS, first values), or writes the raw
 * little-endian fp32 values to --out (one file, tensors concatenated in the
 * order named). --state adds each tensor's optimizer state (GetState): step,
 * hf RMS, the last applied lr and weight decay, and a summary of every state
 * array. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "commands.h"
#include "factorps/client.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps pull --shards HOST:PORT[,...] [--out FILE] [--state] [--deadline S] NAME...\n"
          "Prints each tensor's shard, version, shape and a summary of its values; with --out,\n"
          "writes the values as raw little-endian float32, tensors in the order named.\n"
          "--state also prints the optimizer state: step, RMS (hf), the lr and weight decay of\n"
          "the last update, and a summary of each state array (row, col, var, mom).\n"
          "--shards defaults to $FACTORPS_SHARDS.\n" FPS_CLI_SEC_USAGE);
}

static void summary(const float *v, uint64_t n) {
  double mn = INFINITY, mx = -INFINITY, sum = 0, sq = 0;
  for (uint64_t i = 0; i < n; i++) {
    double x = v[i];
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
    sum += x;
    sq += x * x;
  }
  printf("  min %.6g  max %.6g  mean %.6g  rms %.6g\n  first:", mn, mx, sum / (double)n,
         sqrt(sq / (double)n));
  for (uint64_t i = 0; i < n && i < 8; i++) printf(" %.6g", v[i]);
  printf("%s\n", n > 8 ? " ..." : "");
}

/* The optimizer state of one tensor: figures and a summary of each array.
 * Returns 0, or the status code. */
static int print_state(fps_client_t *c, const char *name, uint64_t numel, fps_status_t *status) {
  float *a[4] = {NULL, NULL, NULL, NULL};
  fps_tensor_state_t in;
  const char *const names[1] = {name};
  int rc = fps_client_get_state(c, names, 1, &in, NULL, NULL, NULL, NULL, status);
  if (rc) return rc;
  uint64_t n[4] = {in.row_elements, in.col_elements, in.var_elements, in.mom_elements};
  for (int k = 0; k < 4; k++)
    if (n[k] && !(a[k] = fps_malloc(n[k] * sizeof(float)))) {
      rc = FPS_CODE_RESOURCE_EXHAUSTED;
      snprintf(status->message, sizeof status->message, "out of memory for the state of '%s'", name);
      goto out;
    }
  float *const row[1] = {a[0]}, *const col[1] = {a[1]}, *const var[1] = {a[2]}, *const mom[1] = {a[3]};
  if ((rc = fps_client_get_state(c, names, 1, &in, row, col, var, mom, status))) goto out;
  printf("  state: step %llu  rms %.6g  last lr %.6g  weight_decay %.6g  %llu elements (AdamW: %llu)\n",
         (unsigned long long)in.step, in.rms, in.lr, in.weight_decay,
         (unsigned long long)(n[0] + n[1] + n[2] + n[3]), (unsigned long long)(2 * numel));
  static const char *const kn[4] = {"row", "col", "var", "mom"};
  for (int k = 0; k < 4; k++) {
    if (!n[k]) continue;
    printf("  %s (%llu):", kn[k], (unsigned long long)n[k]);
    summary(a[k], n[k]);
  }
out:
  for (int k = 0; k < 4; k++) fps_free(a[k]);
  return rc;
}

int fps_cli_pull(int argc, char **argv) {
  static const struct option longopts[] = {{"shards", required_argument, NULL, 's'},
                                           {"out", required_argument, NULL, 'o'},
                                           {"deadline", required_argument, NULL, 'd'},
                                           {"state", no_argument, NULL, 'S'},
                                           {"help", no_argument, NULL, 'h'},
                                           FPS_CLI_SEC_LONGOPTS,
                                           {NULL, 0, NULL, 0}};
  const char *shards = fps_cli_env_shards(), *out_path = NULL;
  fps_cli_sec_t sec = {0};
  double deadline = 60;
  int opt, rc = 1, want_state = 0;
  char **addrs = NULL;
  size_t n = 0;
  fps_client_t *c = NULL;
  fps_status_t status;
  float *buf = NULL;
  FILE *out = NULL;

  optind = 1;
  while ((opt = getopt_long(argc, argv, "hs:o:d:", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': shards = optarg; break;
      case 'o': out_path = optarg; break;
      case 'S': want_state = 1; break;
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
  if (fps_cli_operands("pull", argc, argv, optind, 1, argc, "the NAME of a tensor to pull")) {
    usage(stderr);
    return 2;
  }
  if (!shards) {
    fprintf(stderr, "factorps %s: no shards: pass --shards HOST:PORT[,...] or set FACTORPS_SHARDS\n",
            "pull");
    return 2;
  }
  int crc = fps_cli_connect("pull", shards, &sec, deadline, -1, &addrs, &n, &c, &status);
  if (crc == 2) return 2;
  if (crc) goto fail;
  if (fps_client_discover(c, NULL, &status)) goto fail;
  /* Every name first: --out is not emptied for a pull that cannot be. */
  for (int a = optind; a < argc; a++) {
    uint32_t ndim;
    uint64_t shape[FPS_CLIENT_MAX_DIMS];
    if (fps_client_tensor_shape(c, argv[a], &ndim, shape)) {
      fprintf(stderr, "factorps pull: no shard holds tensor '%s'\n", argv[a]);
      goto done;
    }
  }
  if (out_path && !(out = fopen(out_path, "wb"))) {
    perror(out_path);
    goto done;
  }
  for (int a = optind; a < argc; a++) {
    const char *name = argv[a];
    uint32_t ndim;
    uint64_t shape[FPS_CLIENT_MAX_DIMS], numel = 1, version;
    fps_client_tensor_shape(c, name, &ndim, shape); /* held: checked above */
    for (uint32_t d = 0; d < ndim; d++) numel *= shape[d];
    fps_free(buf);
    if (!(buf = fps_malloc(numel * sizeof *buf))) {
      fprintf(stderr, "factorps pull: out of memory for tensor '%s'\n", name);
      goto done;
    }
    float *const params[1] = {buf};
    const char *const names[1] = {name};
    if (fps_client_pull(c, names, params, &version, 1, &status)) goto fail;
    printf("%s  shard %d  version %llu  shape [", name, fps_client_shard_of(c, name),
           (unsigned long long)version);
    for (uint32_t d = 0; d < ndim; d++) printf("%s%llu", d ? ", " : "", (unsigned long long)shape[d]);
    printf("]  %llu elements\n", (unsigned long long)numel);
    if (out) {
      if (fwrite(buf, sizeof *buf, numel, out) != numel) {
        perror(out_path);
        goto done;
      }
    } else {
      summary(buf, numel);
    }
    if (want_state && print_state(c, name, numel, &status)) goto fail;
  }
  if (out && fclose(out)) {
    out = NULL;
    perror(out_path);
    goto done;
  }
  out = NULL;
  rc = 0;
  goto done;
fail:
  fprintf(stderr, "factorps pull: %s: %s\n", fps_code_name(status.code), status.message);
done:
  if (out) fclose(out);
  fps_free(buf);
  fps_client_destroy(c);
  fps_cli_split_free(addrs);
  fps_cli_sec_free(&sec);
  return rc;
}

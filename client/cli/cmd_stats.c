/* factorps stats --shards A,B [--json] [--deadline S]: every shard's figures. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "commands.h"
#include "factorps/client.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps stats --shards HOST:PORT[,HOST:PORT...] [--json] [--deadline SECONDS]\n"
          "Prints each shard's mode, tensors, parameter and optimizer-state sizes (with AdamW's\n"
          "equivalent), the row blocks of split tensors it holds and their exchange with the\n"
          "other shards, push counts and latencies, then a total line with the AdamW ratio.\n"
          "--json prints one JSON object. --shards defaults to $FACTORPS_SHARDS.\n"
          FPS_CLI_SEC_USAGE);
}

static void print_json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      printf("\\%c", ch);
    else if (ch < 0x20)
      printf("\\u%04x", ch);
    else
      putchar(ch);
  }
  putchar('"');
}

static void print_json(char **addrs, const fps_shard_stats_t *st, size_t n) {
  printf("{\"shards\": [");
  for (size_t i = 0; i < n; i++) {
    const fps_shard_stats_t *s = &st[i];
    printf("%s\n  {\"address\": ", i ? "," : "");
    print_json_str(addrs[i]);
    printf(", \"shard_id\": %u, \"shard_count\": %u, \"mode\": ", s->shard_id, s->shard_count);
    print_json_str(s->mode);
    printf(", \"workers\": %u, \"staleness\": %u, \"simd\": ", s->workers, s->staleness);
    print_json_str(s->simd);
    printf(", \"version\": ");
    print_json_str(s->version);
    printf(", \"tensors\": %llu, \"param_elements\": %llu, \"param_bytes\": %llu, "
           "\"state_row\": %llu, \"state_col\": %llu, \"state_var\": %llu, \"state_mom\": %llu, "
           "\"state_elements\": %llu, \"state_bytes\": %llu, \"adamw_elements\": %llu, "
           "\"adamw_bytes\": %llu, \"pushes\": %llu, \"push_errors\": %llu, \"updates\": %llu, "
           "\"bytes_received\": %llu, \"bytes_sent\": %llu, \"push_seconds_sum\": %.9g, "
           "\"push_seconds_p50\": %.9g, \"push_seconds_p99\": %.9g, "
           "\"update_seconds_sum\": %.9g, \"update_bytes\": %llu, \"uptime_seconds\": %.9g, "
           "\"split_blocks\": %llu, \"split_param_bytes\": %llu, "
           "\"exchange_sent_bytes\": %llu, \"exchange_received_bytes\": %llu, "
           "\"exchange_steps\": %llu, \"exchange_failures\": %llu, "
           "\"exchange_seconds_sum\": %.9g",
           (unsigned long long)s->tensors, (unsigned long long)s->param_elements,
           (unsigned long long)s->param_bytes, (unsigned long long)s->state_row,
           (unsigned long long)s->state_col, (unsigned long long)s->state_var,
           (unsigned long long)s->state_mom, (unsigned long long)s->state_elements,
           (unsigned long long)s->state_bytes, (unsigned long long)s->adamw_elements,
           (unsigned long long)s->adamw_bytes, (unsigned long long)s->pushes,
           (unsigned long long)s->push_errors, (unsigned long long)s->updates,
           (unsigned long long)s->bytes_received, (unsigned long long)s->bytes_sent,
           s->push_seconds_sum, s->push_seconds_p50, s->push_seconds_p99, s->update_seconds_sum,
           (unsigned long long)s->update_bytes, s->uptime_seconds,
           (unsigned long long)s->split_blocks, (unsigned long long)s->split_param_bytes,
           (unsigned long long)s->exchange_sent_bytes,
           (unsigned long long)s->exchange_received_bytes, (unsigned long long)s->exchange_steps,
           (unsigned long long)s->exchange_failures, s->exchange_seconds_sum);
    printf(", \"replica_role\": ");
    print_json_str(s->replica_role);
    printf(", \"term\": %llu, \"replica_peer\": ", (unsigned long long)s->term);
    print_json_str(s->replica_peer);
    printf(", \"standby_joined\": %s, \"replica\": %u, \"state_checksum\": %llu}",
           s->standby_joined ? "true" : "false", s->replica,
           (unsigned long long)s->state_checksum);
  }
  printf("\n]}\n");
}

static void print_text(char **addrs, const fps_shard_stats_t *st, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const fps_shard_stats_t *s = &st[i];
    printf("shard %u/%u  %s  mode %s", s->shard_id, s->shard_count, addrs[i], s->mode);
    if (strcmp(s->mode, "async")) printf(" workers %u", s->workers);
    if (!strcmp(s->mode, "ssp")) printf(" staleness %u", s->staleness);
    printf("  simd %s  version %s  uptime %.0f s\n", s->simd, s->version, s->uptime_seconds);
    /* Whether what it acknowledges survives its loss (docs/operations.md). */
    if (!strcmp(s->replica_role, "solo"))
      printf("  replica: solo (no standby: a crash loses what its last checkpoint lacks)\n");
    else if (s->replica_role[0])
      printf("  replica: %s (answered by replica %u), term %llu, peer %s, standby %s, "
             "checksum %016llx\n",
             s->replica_role, s->replica, (unsigned long long)s->term, s->replica_peer,
             s->standby_joined ? "joined" : "not joined", (unsigned long long)s->state_checksum);
    printf("  tensors %llu  params %llu (%.1f MiB)", (unsigned long long)s->tensors,
           (unsigned long long)s->param_elements, (double)s->param_bytes / 1048576.0);
    /* Row blocks of split tensors are among the tensors and params. */
    if (s->split_blocks)
      printf("  of which split-tensor blocks %llu (%.1f MiB)", (unsigned long long)s->split_blocks,
             (double)s->split_param_bytes / 1048576.0);
    printf("\n");
    printf("  optimizer state %llu elements (%.2f MiB: row %llu col %llu var %llu mom %llu); "
           "AdamW would keep %llu (%.1f MiB)\n",
           (unsigned long long)s->state_elements, (double)s->state_bytes / 1048576.0,
           (unsigned long long)s->state_row, (unsigned long long)s->state_col,
           (unsigned long long)s->state_var, (unsigned long long)s->state_mom,
           (unsigned long long)s->adamw_elements, (double)s->adamw_bytes / 1048576.0);
    printf("  pushes %llu (errors %llu)  updates %llu  received %.1f MiB  sent %.1f MiB\n",
           (unsigned long long)s->pushes, (unsigned long long)s->push_errors,
           (unsigned long long)s->updates, (double)s->bytes_received / 1048576.0,
           (double)s->bytes_sent / 1048576.0);
    printf("  push latency p50 %.3f ms  p99 %.3f ms  kernel time %.3f s\n",
           s->push_seconds_p50 * 1e3, s->push_seconds_p99 * 1e3, s->update_seconds_sum);
    if (s->split_blocks || s->exchange_steps || s->exchange_failures)
      printf("  exchange: %llu steps (%llu failed), %.3f ms per step, sent %.1f KiB, "
             "received %.1f KiB\n",
             (unsigned long long)s->exchange_steps, (unsigned long long)s->exchange_failures,
             s->exchange_steps ? s->exchange_seconds_sum * 1e3 / (double)s->exchange_steps : 0.0,
             (double)s->exchange_sent_bytes / 1024.0, (double)s->exchange_received_bytes / 1024.0);
  }
  unsigned long long tensors = 0, params = 0, state = 0, state_b = 0, adamw = 0, adamw_b = 0;
  for (size_t i = 0; i < n; i++) {
    tensors += st[i].tensors;
    params += st[i].param_elements;
    state += st[i].state_elements;
    state_b += st[i].state_bytes;
    adamw += st[i].adamw_elements;
    adamw_b += st[i].adamw_bytes;
  }
  printf("total (%zu shard%s): tensors %llu  params %llu  optimizer state %llu elements "
         "(%.2f MiB); AdamW would keep %llu (%.2f MiB): ",
         n, n == 1 ? "" : "s", tensors, params, state, (double)state_b / 1048576.0, adamw,
         (double)adamw_b / 1048576.0);
  if (state)
    printf("%.1fx Adafactor's\n", (double)adamw / (double)state);
  else
    printf("no state yet\n");
}

int fps_cli_stats(int argc, char **argv) {
  static const struct option longopts[] = {{"shards", required_argument, NULL, 's'},
                                           {"json", no_argument, NULL, 'j'},
                                           {"deadline", required_argument, NULL, 'd'},
                                           {"help", no_argument, NULL, 'h'},
                                           FPS_CLI_SEC_LONGOPTS,
                                           {NULL, 0, NULL, 0}};
  const char *shards = fps_cli_env_shards();
  fps_cli_sec_t sec = {0};
  int json = 0, opt, rc = 1;
  double deadline = 10;
  char **addrs = NULL;
  size_t n = 0;
  fps_client_t *c = NULL;
  fps_shard_stats_t *st = NULL;
  fps_status_t status;

  optind = 1;
  while ((opt = getopt_long(argc, argv, "hs:jd:", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': shards = optarg; break;
      case 'j': json = 1; break;
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
  if (fps_cli_operands("stats", argc, argv, optind, 0, 0, "")) {
    usage(stderr);
    return 2;
  }
  if (!shards) {
    fprintf(stderr, "factorps %s: no shards: pass --shards HOST:PORT[,...] or set FACTORPS_SHARDS\n",
            "stats");
    return 2;
  }
  int crc = fps_cli_connect("stats", shards, &sec, deadline, 2, &addrs, &n, &c, &status);
  if (crc == 2) return 2;
  if (crc) goto fail;
  if (!(st = fps_calloc(n, sizeof *st))) goto fail;
  if (fps_client_stats(c, st, n, &status)) goto fail;
  if (json)
    print_json(addrs, st, n);
  else
    print_text(addrs, st, n);
  rc = 0;
  goto done;
fail:
  fprintf(stderr, "factorps stats: %s: %s\n", fps_code_name(status.code), status.message);
done:
  fps_free(st);
  fps_client_destroy(c);
  fps_cli_split_free(addrs);
  fps_cli_sec_free(&sec);
  return rc;
}

/* Subcommands of the `factorps` command-line tool. Each takes the arguments
 * after its own name (argv[0] is the subcommand name) and returns the
 * process exit status: 0 success, 1 failure, 2 usage error. */
#ifndef FPS_CLI_COMMANDS_H
#define FPS_CLI_COMMANDS_H

#include <stddef.h>

#include "factorps/client.h"

int fps_cli_replay(int argc, char **argv);
int fps_cli_stats(int argc, char **argv);
int fps_cli_pull(int argc, char **argv);
int fps_cli_load(int argc, char **argv);
int fps_cli_checkpoint(int argc, char **argv);
int fps_cli_plan(int argc, char **argv);

/* Helpers shared by the subcommands (args.c). */

/* $FACTORPS_SHARDS if set and not empty, else NULL: the default of every
 * subcommand's --shards. */
const char *fps_cli_env_shards(void);

/* Splits "A,B,C" into a NULL-terminated array of copies; *n gets the count.
 * Returns NULL on an empty element or out of memory. Free with
 * fps_cli_split_free(). */
char **fps_cli_split(const char *list, size_t *n);
void fps_cli_split_free(char **v);
/* Strict number parsing; 0 on success, -1 (after printing `what`) on junk
 * or out of range. */
int fps_cli_u64(const char *s, const char *what, unsigned long long lo, unsigned long long hi,
                unsigned long long *out);
int fps_cli_double(const char *s, const char *what, double lo, double hi, double *out);
/* The operands after the options, argv[first..argc): 0 if there are
 * min..max of them; else -1 after printing "factorps CMD: missing WHAT" or
 * "... unexpected argument 'X'". */
int fps_cli_operands(const char *cmd, int argc, char **argv, int first, int min, int max, const char *what);
/* A consistency mode name: 0 for sync, async or ssp; -1 (after printing
 * `what`) otherwise. */
int fps_cli_mode(const char *s, const char *what);
/* Parses a count with an optional k/M/G suffix (decimal: 10M = 10000000). */
int fps_cli_count(const char *s, const char *what, unsigned long long *out);
/* Parses a byte count, 0 allowed, with an optional k/M/G (10^3..) or
 * Ki/Mi/Gi (2^10..) suffix. */
int fps_cli_bytes(const char *s, const char *what, unsigned long long *out);

/* TLS and bearer-token options of the subcommands that talk to shards:
 * add FPS_CLI_SEC_LONGOPTS to the getopt_long table, pass unknown option
 * values to fps_cli_sec_opt(), then fps_cli_sec_load() once and
 * fps_cli_sec_fill() into each fps_client_options_t. */
enum {
  FPS_CLI_OPT_TLS_CA = 0x1000,
  FPS_CLI_OPT_TLS_CERT,
  FPS_CLI_OPT_TLS_KEY,
  FPS_CLI_OPT_TLS_SERVER_NAME,
  FPS_CLI_OPT_TOKEN_FILE,
  FPS_CLI_OPT_JOB_ID,
};
#define FPS_CLI_SEC_LONGOPTS                                                  \
  {"tls-ca", required_argument, NULL, FPS_CLI_OPT_TLS_CA},                    \
      {"tls-cert", required_argument, NULL, FPS_CLI_OPT_TLS_CERT},            \
      {"tls-key", required_argument, NULL, FPS_CLI_OPT_TLS_KEY},              \
      {"tls-server-name", required_argument, NULL, FPS_CLI_OPT_TLS_SERVER_NAME}, \
      {"token-file", required_argument, NULL, FPS_CLI_OPT_TOKEN_FILE},        \
      {"job-id", required_argument, NULL, FPS_CLI_OPT_JOB_ID}
#define FPS_CLI_SEC_USAGE                                                               \
  "  --tls-ca FILE          PEM CA of the shards' certificates: connect with TLS\n"     \
  "  --tls-cert FILE        PEM client certificate (mutual TLS; with --tls-key)\n"      \
  "  --tls-key FILE         its PEM private key\n"                                      \
  "  --tls-server-name NAME name the shards' certificates carry, if not the host\n"     \
  "  --token-file FILE      bearer token (first non-empty line) sent on every call\n"   \
  "  --job-id ID            the job's identity, sent with Create (a shard of another job\n" \
  "                         refuses it)\n"

typedef struct fps_cli_sec_s {
  const char *ca, *cert, *key, *server_name, *token_file; /* argv strings */
  const char *job_id;                                      /* argv string, or NULL */
  char *token;                                             /* read from token_file */
} fps_cli_sec_t;

/* 1 if opt is one of FPS_CLI_OPT_* (recorded), else 0. */
int fps_cli_sec_opt(fps_cli_sec_t *s, int opt, const char *arg);
/* Reads --token-file; 0, or -1 after printing why. */
int fps_cli_sec_load(fps_cli_sec_t *s);
/* Points o's TLS and token fields at s (which must outlive the client's
 * creation). */
void fps_cli_sec_fill(const fps_cli_sec_t *s, fps_client_options_t *o);
/* Wipes and frees the token. */
void fps_cli_sec_free(fps_cli_sec_t *s);

/* The connection set-up of stats, pull and checkpoint: splits `shards` into
 * *addrs (free with fps_cli_split_free; NULL on a usage error), loads the
 * TLS/token files and creates the client with `deadline` and, if
 * max_retries >= 0, that many retries. Returns 0; 2 after printing a usage
 * problem (a client refused as INVALID_ARGUMENT: an address, TLS option or
 * job id); or 1 with *status saying why the client could not be created. */
int fps_cli_connect(const char *cmd, const char *shards, fps_cli_sec_t *sec, double deadline,
                    int max_retries, char ***addrs, size_t *n, fps_client_t **c,
                    fps_status_t *status);

#endif

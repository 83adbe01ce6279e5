/* Argument helpers shared by the factorps subcommands. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "commands.h"

const char *fps_cli_env_shards(void) {
  const char *s = getenv("FACTORPS_SHARDS");
  return s && *s ? s : NULL;
}

void fps_cli_split_free(char **v) {
  if (!v) return;
  for (size_t i = 0; v[i]; i++) fps_free(v[i]);
  fps_free(v);
}

char **fps_cli_split(const char *list, size_t *n) {
  size_t cap = 1;
  for (const char *p = list; *p; p++) cap += *p == ',';
  char **v = fps_calloc(cap + 1, sizeof *v);
  if (!v) return NULL;
  size_t k = 0;
  const char *p = list;
  for (;;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == 0 || !(v[k] = fps_strndup(p, len))) {
      fps_cli_split_free(v);
      return NULL;
    }
    k++;
    if (!e) break;
    p = e + 1;
  }
  *n = k;
  return v;
}

int fps_cli_u64(const char *s, const char *what, unsigned long long lo, unsigned long long hi,
                unsigned long long *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  /* A digit first: strtoull would skip spaces and take " -1" as 2^64-1. */
  if (errno || !(s[0] >= '0' && s[0] <= '9') || *end || v < lo || v > hi) {
    fprintf(stderr, "factorps: %s must be an integer in [%llu, %llu], not '%s'\n", what, lo, hi,
            s);
    return -1;
  }
  *out = v;
  return 0;
}

int fps_cli_operands(const char *cmd, int argc, char **argv, int first, int min, int max, const char *what) {
  int n = argc - first;
  if (n < min) {
    fprintf(stderr, "factorps %s: missing %s\n", cmd, what);
    return -1;
  }
  if (n > max) {
    fprintf(stderr, "factorps %s: unexpected argument '%s'\n", cmd, argv[first + max]);
    return -1;
  }
  return 0;
}

int fps_cli_mode(const char *s, const char *what) {
  if (!strcmp(s, "sync") || !strcmp(s, "async") || !strcmp(s, "ssp")) return 0;
  fprintf(stderr, "factorps: %s must be sync, async or ssp, not '%s'\n", what, s);
  return -1;
}

int fps_cli_double(const char *s, const char *what, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi) {
    fprintf(stderr, "factorps: %s must be a number in [%g, %g], not '%s'\n", what, lo, hi, s);
    return -1;
  }
  *out = v;
  return 0;
}

int fps_cli_count(const char *s, const char *what, unsigned long long *out) {
  char buf[64];
  size_t len = strlen(s);
  unsigned long long mul = 1;
  if (len == 0 || len >= sizeof buf) {
    fprintf(stderr, "factorps: %s: bad count '%s'\n", what, s);
    return -1;
  }
  memcpy(buf, s, len + 1);
  switch (buf[len - 1]) {
    case 'k': case 'K': mul = 1000ull; break;
    case 'm': case 'M': mul = 1000000ull; break;
    case 'g': case 'G': mul = 1000000000ull; break;
    default: break;
  }
  if (mul != 1) buf[len - 1] = '\0';
  unsigned long long v;
  if (fps_cli_u64(buf, what, 1, (1ull << 40) / mul, &v)) return -1;
  *out = v * mul;
  return 0;
}

int fps_cli_bytes(const char *s, const char *what, unsigned long long *out) {
  static const struct {
    const char *sfx;
    unsigned long long mul;
  } units[] = {{"", 1},           {"k", 1000ull},      {"K", 1000ull},     {"M", 1000000ull},
               {"G", 1000000000ull}, {"Ki", 1ull << 10}, {"Mi", 1ull << 20}, {"Gi", 1ull << 30}};
  char *end = NULL;
  if (*s >= '0' && *s <= '9') {
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    for (size_t i = 0; !errno && i < sizeof units / sizeof *units; i++)
      if (!strcmp(end, units[i].sfx) && v <= ULLONG_MAX / units[i].mul) {
        *out = v * units[i].mul;
        return 0;
      }
  }
  fprintf(stderr, "factorps: %s must be a byte count (digits, then k, M, G, Ki, Mi or Gi), not '%s'\n",
          what, s);
  return -1;
}

/* ----------------------------------------------- TLS and token options */

int fps_cli_sec_opt(fps_cli_sec_t *s, int opt, const char *arg) {
  switch (opt) {
    case FPS_CLI_OPT_TLS_CA: s->ca = arg; return 1;
    case FPS_CLI_OPT_TLS_CERT: s->cert = arg; return 1;
    case FPS_CLI_OPT_TLS_KEY: s->key = arg; return 1;
    case FPS_CLI_OPT_TLS_SERVER_NAME: s->server_name = arg; return 1;
    case FPS_CLI_OPT_TOKEN_FILE: s->token_file = arg; return 1;
    case FPS_CLI_OPT_JOB_ID: s->job_id = arg; return 1;
    default: return 0;
  }
}

int fps_cli_sec_load(fps_cli_sec_t *s) {
  /* A token on the command line would show in ps and shell history: it
   * comes from a file, first non-empty line, surrounding blanks dropped. */
  if (!s->token_file) return 0;
  FILE *f = fopen(s->token_file, "r");
  if (!f) {
    fprintf(stderr, "factorps: --token-file '%s': %s\n", s->token_file, strerror(errno));
    return -1;
  }
  char line[4100];
  while (fgets(line, sizeof line, f)) {
    char *p = line + strspn(line, " \t\r\n");
    size_t n = strcspn(p, "\r\n");
    while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
    if (n == 0 || *p == '#') continue;
    s->token = fps_strndup(p, n);
    break;
  }
  fclose(f);
  explicit_bzero(line, sizeof line);
  if (!s->token) {
    fprintf(stderr, "factorps: --token-file '%s' holds no token\n", s->token_file);
    return -1;
  }
  return 0;
}

void fps_cli_sec_fill(const fps_cli_sec_t *s, fps_client_options_t *o) {
  o->tls_ca_file = s->ca;
  o->tls_cert_file = s->cert;
  o->tls_key_file = s->key;
  o->tls_server_name = s->server_name;
  o->auth_token = s->token;
  o->job_id = s->job_id;
}

void fps_cli_sec_free(fps_cli_sec_t *s) {
  if (s->token) {
    explicit_bzero(s->token, strlen(s->token));
    fps_free(s->token);
    s->token = NULL;
  }
}

int fps_cli_connect(const char *cmd, const char *shards, fps_cli_sec_t *sec, double deadline,
                    int max_retries, char ***addrs, size_t *n, fps_client_t **c,
                    fps_status_t *status) {
  *c = NULL;
  memset(status, 0, sizeof *status);
  if (!(*addrs = fps_cli_split(shards, n))) {
    fprintf(stderr, "factorps %s: bad --shards list '%s'\n", cmd, shards);
    return 2;
  }
  if (fps_cli_sec_load(sec)) {
    fps_cli_split_free(*addrs);
    *addrs = NULL;
    return 2;
  }
  fps_client_options_t o;
  fps_client_options_init(&o);
  fps_cli_sec_fill(sec, &o);
  o.deadline_seconds = deadline;
  if (max_retries >= 0) o.max_retries = max_retries;
  *c = fps_client_create((const char *const *)*addrs, *n, &o, status);
  if (*c) return 0;
  if (status->code == FPS_CODE_INVALID_ARGUMENT) {
    /* An address, TLS option or job id the client refuses: a bad flag. */
    fprintf(stderr, "factorps %s: %s: %s\n", cmd, fps_code_name(status->code), status->message);
    fps_cli_split_free(*addrs);
    *addrs = NULL;
    return 2;
  }
  return 1;
}

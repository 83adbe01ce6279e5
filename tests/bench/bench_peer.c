/* The shard-to-shard transport's cost: Exchange round trips
 * through server/peer.c (the sender a shard installs) to a real shard on
 * loopback, for the partials of a 1-D block (64 bytes) and of blocks
 * touching M matrices of C columns (64 + M (16 + 20 C) bytes), one send at
 * a time and `depth` at once, plaintext and mutual TLS with a token, in
 * one run so the ratios are comparable (the machine is shared).
 *
 * The receiving shard holds no block of the tensor, so it answers after
 * the full request checks (name, shard count, the partials' header and
 * length) with NOT_FOUND: what is timed is the transport plus the
 * checks, not the core's combine.
 *
 *   build/tests/bench/fps_bench_peer [--sends N] [--depth D] [--cols C] [--mats M]
 * Environment: FPS_SERVER (default: the build's factorps-server),
 * FPS_GENCERTS (default: the repository's tests/security/gencerts.sh). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <grpc/grpc.h>

#include "adafactor_split.h"
#include "harness.h"
#include "peer.h"
#include "server.h"

typedef struct waiter_s {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int pending;
  int bad;
} waiter_t;

static void on_done(void *arg, int err, const char *msg, const fps_xreply_t *reply) {
  (void)reply;
  waiter_t *w = arg;
  pthread_mutex_lock(&w->mu);
  if (err != FPS_ENOTFOUND) {
    if (!w->bad) fprintf(stderr, "unexpected outcome %s: %s\n", fps_err_name(err), msg ? msg : "");
    w->bad++;
  }
  w->pending--;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static fps_peers_t *sender(const char *addr, const char *const *extra) {
  char peers[256];
  snprintf(peers, sizeof peers, "127.0.0.1:1,%s", addr);
  const char *argv[32] = {"factorps-server", "--shard-id", "0", "--shard-count", "2", "--peers", peers,
                          "--log-level", "warn"};
  int argc = 9;
  for (int i = 0; extra && extra[i]; i++) argv[argc++] = extra[i];
  fps_config_t cfg;
  fps_peers_t *p = NULL;
  if (fps_config_load(&cfg, argc, (char **)argv) != 0) exit(2);
  if (fps_peers_create(&cfg, &p) < 0) exit(1);
  fps_config_free(&cfg);
  return p;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median and p99 of n one-at-a-time round trips, and sends/s with
 * `depth` in flight. */
static void measure(fps_peers_t *p, const uint8_t *buf, size_t len, int n, int depth, double *p50, double *p99,
                    double *rate) {
  waiter_t w = {.pending = 0};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  fps_xmsg_t m = {.name = "emb", .from_shard = 0, .shard_count = 2, .phase = FPS_SPLIT_PHASE_STATS,
                  .partials = buf, .len = len};
  double *lat = calloc((size_t)n, sizeof *lat);
  for (int i = 0; i < n + 10; i++) { /* 10 warm-up sends */
    int64_t t0 = fps_now_ns();
    pthread_mutex_lock(&w.mu);
    w.pending = 1;
    pthread_mutex_unlock(&w.mu);
    if (fps_peers_send(p, 1, &m, t0 + INT64_C(30000000000), on_done, &w) != 0) exit(1);
    pthread_mutex_lock(&w.mu);
    while (w.pending) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    if (i >= 10) lat[i - 10] = (double)(fps_now_ns() - t0) / 1e6;
  }
  qsort(lat, (size_t)n, sizeof *lat, cmp_double);
  *p50 = lat[n / 2];
  *p99 = lat[(n * 99) / 100];
  int64_t t0 = fps_now_ns();
  for (int i = 0; i < n; i++) {
    pthread_mutex_lock(&w.mu);
    while (w.pending >= depth) pthread_cond_wait(&w.cv, &w.mu);
    w.pending++;
    pthread_mutex_unlock(&w.mu);
    if (fps_peers_send(p, 1, &m, fps_now_ns() + INT64_C(30000000000), on_done, &w) != 0) exit(1);
  }
  pthread_mutex_lock(&w.mu);
  while (w.pending) pthread_cond_wait(&w.cv, &w.mu);
  int bad = w.bad;
  pthread_mutex_unlock(&w.mu);
  *rate = n / ((double)(fps_now_ns() - t0) / 1e9);
  free(lat);
  if (bad) exit(1);
}

int main(int argc, char **argv) {
  int n = 400, depth = 8;
  uint64_t cols = 4096, mats = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--sends")) n = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--depth")) depth = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--cols")) cols = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--mats")) mats = strtoull(argv[i + 1], NULL, 10);
    else {
      fprintf(stderr, "usage: %s [--sends N] [--depth D] [--cols C] [--mats M]\n", argv[0]);
      return 2;
    }
  }
  if (n < 10 || depth < 1 || cols < 1 || mats < 1) return 2;
  setenv("FPS_SERVER", getenv("FPS_SERVER") ? getenv("FPS_SERVER") : FPS_BENCH_SERVER, 1);
  const char *gencerts = getenv("FPS_GENCERTS") ? getenv("FPS_GENCERTS") : FPS_BENCH_GENCERTS;
  char dir[] = "/tmp/fps-bench-peer-XXXXXX", cmd[1024], f[8][512];
  if (!mkdtemp(dir)) return 1;
  snprintf(cmd, sizeof cmd, "sh '%s' '%s' >/dev/null", gencerts, dir);
  if (system(cmd) != 0) return 1;
  const char *names[] = {"server.pem", "server.key", "ca.pem", "tokens.txt", "client.pem", "client.key", "token"};
  for (int i = 0; i < 7; i++) snprintf(f[i], sizeof f[i], "%s/%s", dir, names[i]);
  grpc_init();

  /* The partials: one 1-D block's, and a factored block's. */
  uint8_t small[64];
  fps_split_partials_t one = {.phase = FPS_SPLIT_PHASE_STATS, .row_lo = 0, .row_hi = 4, .psq = 1, .u2 = 1};
  if (fps_split_partials_encode(&one, small, sizeof small) != sizeof small) return 1;
  size_t big_len = 64 + mats * (16 + 20 * cols);
  uint8_t *big = calloc(1, big_len);
  double *d = calloc(mats * cols * 4 + 2 * mats, sizeof *d);
  float *col = calloc(mats * cols, sizeof *col);
  fps_split_partials_t fac = {.phase = FPS_SPLIT_PHASE_STATS, .factored = true, .row_lo = 0, .row_hi = 8,
                              .cols = cols, .mtx_lo = 0, .nmat = mats, .psq = 1, .rsum = d, .rmin = d + mats,
                              .colsum = d + 2 * mats, .s = d + 2 * mats + mats * cols, .col_old = col};
  if (fps_split_partials_encode(&fac, big, big_len) != big_len) {
    fprintf(stderr, "cannot encode %zu bytes of partials\n", big_len);
    return 1;
  }

  fps_test_server_t plain, secure;
  const char *sec_flags[] = {"--tls-cert", f[0], "--tls-key", f[1], "--tls-client-ca", f[2], "--auth-token-file",
                             f[3], NULL};
  if (fps_test_server_start(&plain, 1, 2, "sync", 1, NULL) < 0 ||
      fps_test_server_start(&secure, 1, 2, "sync", 1, sec_flags) < 0)
    return 1;
  fps_peers_t *pp = sender(plain.addr, NULL);
  const char *peer_flags[] = {"--peer-tls-ca", f[2], "--peer-tls-cert", f[4], "--peer-tls-key", f[5],
                              "--peer-token-file", f[6], NULL};
  fps_peers_t *ps = sender(secure.addr, peer_flags);

  printf("Exchange round trips to a shard on loopback, %d sends each (after 10 warm-up), depth %d\n", n, depth);
  printf("%-24s %10s %10s %12s %10s\n", "partials", "p50 ms", "p99 ms", "sends/s", "MB/s");
  struct {
    const char *what;
    const uint8_t *buf;
    size_t len;
  } cases[] = {{"64 B (1-D block)", small, sizeof small}, {NULL, big, big_len}};
  char label[64];
  snprintf(label, sizeof label, "%zu B (%llu x %llu)", big_len, (unsigned long long)mats, (unsigned long long)cols);
  cases[1].what = label;
  for (int c = 0; c < 2; c++) {
    double r[2][3];
    fps_peers_t *ps2[2] = {pp, ps};
    /* Interleaved, twice, so drift hits both alike; the second pass is kept. */
    for (int pass = 0; pass < 2; pass++)
      for (int s = 0; s < 2; s++) measure(ps2[s], cases[c].buf, cases[c].len, n, depth, &r[s][0], &r[s][1], &r[s][2]);
    for (int s = 0; s < 2; s++)
      printf("%-24s %10.3f %10.3f %12.0f %10.1f  %s\n", cases[c].what, r[s][0], r[s][1], r[s][2],
             r[s][2] * (double)cases[c].len / 1e6, s ? "mTLS + token" : "plaintext");
    printf("%-24s p50 mTLS+token / plaintext %.2f, sends/s plaintext / mTLS+token %.2f\n", "", r[1][0] / r[0][0],
           r[0][2] / r[1][2]);
  }
  fps_peers_destroy(pp);
  fps_peers_destroy(ps);
  fps_test_servers_stop_all();
  grpc_shutdown();
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) return 1;
  free(big);
  free(d);
  free(col);
  return 0;
}

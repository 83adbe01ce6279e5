/* The shard-to-shard transport (server/peer.c) against real shards over
 * loopback: the sender a shard installs for Exchange, driven directly
 * (fps_peers_send, as the core calls it) from this process, configured by
 * the shard's own flag parser (fps_config_load), so the flags, the files
 * and the transport are the ones factorps-server runs.
 *
 * The receiving shards hold no block of the tensor, so a delivered
 * Exchange is answered NOT_FOUND naming the tensor and the sender: that
 * answer proves the call got through TLS, the client certificate and the
 * token and was decoded by the peer; a refusal of a field proves the
 * fields travel. Failures must name the peer (its index and address).
 *
 * Certificates come from tests/security/gencerts.sh (the openssl CLI).
 * Bounds on elapsed time are loose (a loaded 2-core machine): they check
 * that a failure comes from retrying until the deadline, not at once, and
 * that nothing waits far past it. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <grpc/grpc.h>

#include "adafactor_split.h"
#include "harness.h"
#include "peer.h"
#include "server.h"

static char dir[256]; /* certificates and tokens */

static const char *path(const char *name) {
  static char buf[8][512];
  static int i;
  char *p = buf[i++ % 8];
  snprintf(p, sizeof buf[0], "%s/%s", dir, name);
  return p;
}

/* ------------------------------------------------------- done records */

/* What one send's done reported; `calls` counts how often it ran. */
typedef struct outcome_s {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int calls;
  int err;
  char msg[1024];
  double at; /* seconds on the monotonic clock */
} outcome_t;

static double now_s(void) { return (double)fps_now_ns() / 1e9; }

static void outcome_init(outcome_t *o) {
  memset(o, 0, sizeof *o);
  pthread_mutex_init(&o->mu, NULL);
  pthread_cond_init(&o->cv, NULL);
}

static void on_done(void *arg, int err, const char *msg, const fps_xreply_t *reply) {
  (void)reply;
  outcome_t *o = arg;
  /* In the test's log: what a shard would report for this send. */
  fprintf(stderr, "done: %s%s%s\n", fps_err_name(err), msg ? ": " : "", msg ? msg : "");
  pthread_mutex_lock(&o->mu);
  o->calls++;
  o->err = err;
  snprintf(o->msg, sizeof o->msg, "%s", msg ? msg : "");
  o->at = now_s();
  pthread_cond_broadcast(&o->cv);
  pthread_mutex_unlock(&o->mu);
}

/* Waits up to `limit_s` for done; fails the test if it never comes. */
static void outcome_wait(outcome_t *o, double limit_s) {
  double end = now_s() + limit_s;
  pthread_mutex_lock(&o->mu);
  while (o->calls == 0 && now_s() < end) {
    pthread_mutex_unlock(&o->mu);
    usleep(10000);
    pthread_mutex_lock(&o->mu);
  }
  int calls = o->calls;
  pthread_mutex_unlock(&o->mu);
  if (calls == 0) fail_msg("done was not called within %.0f s", limit_s);
}

#define assert_err(o, want, needle)                                                                  \
  do {                                                                                               \
    if ((o)->err != (want))                                                                          \
      fail_msg("done(%s), want %s: %s", fps_err_name((o)->err), fps_err_name(want), (o)->msg);       \
    const char *needle_ = (needle);                                                                  \
    if (!strstr((o)->msg, needle_)) fail_msg("message lacks '%s': %s", needle_, (o)->msg);           \
  } while (0)

/* --------------------------------------------------------------- set-up */

/* A sender configured as shard 0 of 2 whose peer 1 is at `addr`, with the
 * shard's own parser: extra flags (NULL-terminated) after --peers. */
static fps_peers_t *sender(const char *addr, double deadline, const char *const *extra) {
  char peers[256], dl[32];
  snprintf(peers, sizeof peers, "127.0.0.1:1,%s", addr);
  snprintf(dl, sizeof dl, "%g", deadline);
  const char *argv[32] = {"factorps-server", "--shard-id", "0", "--shard-count", "2", "--peers", peers,
                          "--exchange-deadline", dl};
  int argc = 9;
  for (int i = 0; extra && extra[i]; i++) argv[argc++] = extra[i];
  fps_config_t cfg;
  assert_int_equal(fps_config_load(&cfg, argc, (char **)argv), 0);
  fps_peers_t *p = NULL;
  int rc = fps_peers_create(&cfg, &p);
  fps_config_free(&cfg);
  if (rc < 0) fail_msg("fps_peers_create: %s", fps_err_name(rc));
  return p;
}

/* Valid phase-STATS partials of a 1-D block of 4 elements (the same bytes
 * for every send: written once, before any thread sends). */
static uint8_t partials[64];

static void partials_init(void) {
  fps_split_partials_t pt = {.phase = FPS_SPLIT_PHASE_STATS, .factored = false, .row_lo = 0, .row_hi = 4,
                             .psq = 1.5, .u2 = 2.5};
  assert_int_equal(fps_split_partials_encode(&pt, partials, sizeof partials), sizeof partials);
}

static fps_xmsg_t xmsg(const char *name, uint32_t shard_count) {
  return (fps_xmsg_t){.name = name, .version = 0, .from_shard = 0, .shard_count = shard_count,
                      .block_index = 0, .phase = FPS_SPLIT_PHASE_STATS, .partials = partials,
                      .len = sizeof partials};
}

static int64_t deadline_in(double s) { return fps_now_ns() + (int64_t)(s * 1e9); }

/* Sends one Exchange of `name` to shard 1 and waits for its outcome. */
static void send_wait(fps_peers_t *p, const char *name, double deadline, outcome_t *o) {
  outcome_init(o);
  fps_xmsg_t m = xmsg(name, 2);
  assert_int_equal(fps_peers_send(p, 1, &m, deadline_in(deadline), on_done, o), 0);
  outcome_wait(o, deadline + 30);
}

/* A shard 1 of 2 with extra flags (NULL-terminated). */
static void receiver(fps_test_server_t *s, const char *const *extra) {
  assert_int_equal(fps_test_server_start(s, 1, 2, "sync", 1, extra), 0);
}

static int group_setup(void **state) {
  (void)state;
  grpc_init();
  partials_init();
  const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  snprintf(dir, sizeof dir, "%s/fps-peer-XXXXXX", tmp);
  if (!mkdtemp(dir)) return -1;
  const char *script = getenv("FPS_GENCERTS");
  if (!script) {
    fprintf(stderr, "FPS_GENCERTS is not set\n");
    return -1;
  }
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "sh '%s' '%s' >/dev/null", script, dir);
  return system(cmd) == 0 ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  grpc_shutdown();
  return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  return 0;
}

/* ---------------------------------------------------------------- tests */

/* Plaintext: delivered (NOT_FOUND names the tensor and the sender); the
 * fields travel (another shard count, malformed partials are refused as
 * such); a send to ourselves or beyond the job is refused at once. */
static void test_plaintext(void **state) {
  (void)state;
  fps_test_server_t r;
  receiver(&r, NULL);
  fps_peers_t *p = sender(r.addr, 10, NULL);
  outcome_t o;
  send_wait(p, "emb.weight", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "'emb.weight' from shard 0");
  assert_err(&o, FPS_ENOTFOUND, r.addr);
  assert_err(&o, FPS_ENOTFOUND, "shard 1 (");
  assert_int_equal(o.calls, 1);

  outcome_init(&o);
  fps_xmsg_t m = xmsg("w", 3);
  assert_int_equal(fps_peers_send(p, 1, &m, deadline_in(10), on_done, &o), 0);
  outcome_wait(&o, 40);
  assert_err(&o, FPS_ESTATE, "one of 3 shards");

  outcome_init(&o);
  m = xmsg("w", 2);
  m.len = 63;
  assert_int_equal(fps_peers_send(p, 1, &m, deadline_in(10), on_done, &o), 0);
  outcome_wait(&o, 40);
  assert_err(&o, FPS_EINVAL, "INVALID_ARGUMENT");

  m = xmsg("w", 2);
  assert_int_equal(fps_peers_send(p, 0, &m, deadline_in(10), on_done, &o), FPS_EINVAL);
  assert_int_equal(fps_peers_send(p, 2, &m, deadline_in(10), on_done, &o), FPS_EINVAL);
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* TLS: the peer's certificate verified against --peer-tls-ca (also by a
 * name it carries, --peer-tls-server-name); a plaintext sender cannot
 * reach a TLS shard (UNAVAILABLE at its deadline, naming the peer). */
static void test_tls(void **state) {
  (void)state;
  fps_test_server_t r;
  const char *srv[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"), NULL};
  receiver(&r, srv);
  const char *tls[] = {"--peer-tls-ca", path("ca.pem"), NULL};
  fps_peers_t *p = sender(r.addr, 10, tls);
  outcome_t o;
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);

  const char *named[] = {"--peer-tls-ca", path("ca.pem"), "--peer-tls-server-name", "shard.factorps.test", NULL};
  p = sender(r.addr, 10, named);
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);

  /* A CA that did not sign the shard's certificate. */
  const char *other[] = {"--peer-tls-ca", path("ca2.pem"), NULL};
  p = sender(r.addr, 1.5, other);
  send_wait(p, "w", 1.5, &o);
  assert_err(&o, FPS_EUNAVAILABLE, r.addr);
  assert_err(&o, FPS_EUNAVAILABLE, "TLS handshake");
  fps_peers_destroy(p);

  p = sender(r.addr, 1.5, NULL);
  send_wait(p, "w", 1.5, &o);
  assert_err(&o, FPS_EUNAVAILABLE, r.addr);
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* Mutual TLS: the calling shard presents --peer-tls-cert; without one, or
 * with one the peer's CA did not sign, the peer refuses the handshake. */
static void test_mtls(void **state) {
  (void)state;
  fps_test_server_t r;
  const char *srv[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"), "--tls-client-ca",
                       path("ca.pem"), NULL};
  receiver(&r, srv);
  const char *mtls[] = {"--peer-tls-ca", path("ca.pem"), "--peer-tls-cert", path("client.pem"), "--peer-tls-key",
                        path("client.key"), NULL};
  fps_peers_t *p = sender(r.addr, 10, mtls);
  outcome_t o;
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);

  const char *bare[] = {"--peer-tls-ca", path("ca.pem"), NULL};
  p = sender(r.addr, 1.5, bare);
  send_wait(p, "w", 1.5, &o);
  assert_err(&o, FPS_EUNAVAILABLE, r.addr);
  fps_peers_destroy(p);

  const char *intruder[] = {"--peer-tls-ca", path("ca.pem"), "--peer-tls-cert", path("other.pem"),
                            "--peer-tls-key", path("other.key"), NULL};
  p = sender(r.addr, 1.5, intruder);
  send_wait(p, "w", 1.5, &o);
  assert_err(&o, FPS_EUNAVAILABLE, r.addr);
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* Bearer tokens: the right one (the second of the peer's rotation list
 * too) is accepted; a wrong or missing one surfaces as the send's error,
 * UNAUTHENTICATED, naming the peer, at once (not retried). */
static void test_token(void **state) {
  (void)state;
  fps_test_server_t r;
  const char *srv[] = {"--auth-token-file", path("tokens.txt"), NULL};
  receiver(&r, srv);
  const char *right[] = {"--peer-token-file", path("token"), NULL};
  fps_peers_t *p = sender(r.addr, 10, right);
  outcome_t o;
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);

  const char *second[] = {"--peer-token-file", path("token2"), NULL};
  p = sender(r.addr, 10, second);
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);

  const char *wrong[] = {"--peer-token-file", path("wrong-token"), NULL};
  p = sender(r.addr, 10, wrong);
  double t0 = now_s();
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ESTATE, "UNAUTHENTICATED");
  assert_err(&o, FPS_ESTATE, r.addr);
  assert_true(o.at - t0 < 9); /* a refusal, not retried to the deadline */
  fps_peers_destroy(p);

  p = sender(r.addr, 10, NULL);
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ESTATE, "UNAUTHENTICATED");
  assert_err(&o, FPS_ESTATE, "requires a bearer token");
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* Mutual TLS and a token together, as a secured job runs. */
static void test_mtls_and_token(void **state) {
  (void)state;
  fps_test_server_t r;
  const char *srv[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"), "--tls-client-ca",
                       path("ca.pem"), "--auth-token-file", path("tokens.txt"), NULL};
  receiver(&r, srv);
  const char *both[] = {"--peer-tls-ca", path("ca.pem"), "--peer-tls-cert", path("client.pem"), "--peer-tls-key",
                        path("client.key"), "--peer-token-file", path("token"), NULL};
  fps_peers_t *p = sender(r.addr, 10, both);
  outcome_t o;
  send_wait(p, "w", 10, &o);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* A peer that is down: retried until the deadline, then UNAVAILABLE
 * naming the peer and the attempts. */
static void test_peer_down(void **state) {
  (void)state;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", fps_test_dead_port());
  fps_peers_t *p = sender(addr, 2, NULL);
  outcome_t o;
  double t0 = now_s();
  send_wait(p, "w", 2, &o);
  assert_err(&o, FPS_EUNAVAILABLE, addr);
  assert_err(&o, FPS_EUNAVAILABLE, "attempts");
  assert_int_equal(o.calls, 1);
  assert_true(o.at - t0 > 1.0); /* retried, not failed at once */
  assert_true(o.at - t0 < 2 + 10);
  fps_peers_destroy(p);
}

/* A peer shard with a standby, "A|B": a replica that cannot be reached
 * (a dead port here, as a killed primary; a standby answers UNAVAILABLE)
 * is left for the other within the same deadline, in either order, and
 * both down is UNAVAILABLE naming the entry. */
static void test_peer_replicas(void **state) {
  (void)state;
  fps_test_server_t r;
  receiver(&r, NULL);
  char dead[64], entry[160];
  snprintf(dead, sizeof dead, "127.0.0.1:%d", fps_test_dead_port());
  for (int order = 0; order < 2; order++) {
    snprintf(entry, sizeof entry, "%s|%s", order ? r.addr : dead, order ? dead : r.addr);
    fps_peers_t *p = sender(entry, 10, NULL);
    for (int k = 0; k < 2; k++) { /* the second starts at the replica that answered */
      outcome_t o;
      send_wait(p, "emb.weight", 10, &o);
      assert_err(&o, FPS_ENOTFOUND, "'emb.weight' from shard 0"); /* delivered */
      assert_err(&o, FPS_ENOTFOUND, entry);
      assert_int_equal(o.calls, 1);
    }
    fps_peers_destroy(p);
  }
  assert_int_equal(fps_test_server_stop(&r), 0);
  snprintf(entry, sizeof entry, "%s|%s", dead, r.addr); /* both down now */
  fps_peers_t *p = sender(entry, 1, NULL);
  outcome_t o;
  send_wait(p, "w", 1, &o);
  assert_err(&o, FPS_EUNAVAILABLE, entry);
  assert_err(&o, FPS_EUNAVAILABLE, "attempts");
  fps_peers_destroy(p);
}

/* A peer that comes up during the deadline: the retries reach it. */
static void test_peer_comes_back(void **state) {
  (void)state;
  int port = fps_test_dead_port();
  char addr[64], listen[80];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  snprintf(listen, sizeof listen, "--listen=%s", addr);
  fps_peers_t *p = sender(addr, 20, NULL);
  outcome_t o;
  outcome_init(&o);
  fps_xmsg_t m = xmsg("w", 2);
  assert_int_equal(fps_peers_send(p, 1, &m, deadline_in(20), on_done, &o), 0);
  usleep(500 * 1000);
  fps_test_server_t r;
  const char *srv[] = {listen, NULL};
  receiver(&r, srv);
  outcome_wait(&o, 60);
  assert_err(&o, FPS_ENOTFOUND, "from shard 0");
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

/* A socket that accepts connections (the kernel's backlog) and never
 * answers: the call runs into its deadline. */
static int silent_listener(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(fd, 16), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  *port = ntohs(a.sin_port);
  return fd;
}

static void test_peer_never_answers(void **state) {
  (void)state;
  int port, fd = silent_listener(&port);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  fps_peers_t *p = sender(addr, 1.5, NULL);
  outcome_t o;
  double t0 = now_s();
  send_wait(p, "w", 1.5, &o);
  assert_err(&o, FPS_ETIMEOUT, addr);
  assert_err(&o, FPS_ETIMEOUT, "did not answer");
  assert_true(o.at - t0 > 1.0);
  fps_peers_destroy(p);
  close(fd);
}

/* Shutdown with sends in flight (one waiting for a silent peer, others
 * between retries to a dead one): every done runs once, FPS_EUNAVAILABLE
 * "shutting down", long before their deadlines; later sends are refused
 * at once. */
static void test_stop_with_sends_in_flight(void **state) {
  (void)state;
  int port, fd = silent_listener(&port);
  char silent[64], dead[64];
  snprintf(silent, sizeof silent, "127.0.0.1:%d", port);
  snprintf(dead, sizeof dead, "127.0.0.1:%d", fps_test_dead_port());
  fps_peers_t *ps = sender(silent, 60, NULL), *pd = sender(dead, 60, NULL);
  enum { N = 4 };
  outcome_t o[2 * N];
  for (int i = 0; i < 2 * N; i++) {
    outcome_init(&o[i]);
    fps_xmsg_t m = xmsg("w", 2);
    assert_int_equal(fps_peers_send(i < N ? ps : pd, 1, &m, deadline_in(60), on_done, &o[i]), 0);
  }
  usleep(300 * 1000); /* the dead peer's sends are between retries now */
  double t0 = now_s();
  fps_peers_stop(ps, 5);
  fps_peers_stop(pd, 5);
  for (int i = 0; i < 2 * N; i++) {
    outcome_wait(&o[i], 10);
    assert_err(&o[i], FPS_EUNAVAILABLE, "shutting down");
    assert_int_equal(o[i].calls, 1);
    assert_true(o[i].at - t0 < 20);
  }
  outcome_t late;
  outcome_init(&late);
  fps_xmsg_t m = xmsg("w", 2);
  assert_int_equal(fps_peers_send(ps, 1, &m, deadline_in(60), on_done, &late), FPS_EUNAVAILABLE);
  fps_peers_destroy(ps);
  fps_peers_destroy(pd);
  for (int i = 0; i < 2 * N; i++) assert_int_equal(o[i].calls, 1);
  assert_int_equal(late.calls, 0);
  close(fd);
}

/* Many sends at once from several threads to one peer: each answered
 * once, none lost. */
typedef struct burst_s {
  fps_peers_t *p;
  outcome_t o[16];
  bool refused[16];
} burst_t;

static void *burst_main(void *arg) {
  burst_t *b = arg;
  for (int i = 0; i < 16; i++) {
    outcome_init(&b->o[i]);
    fps_xmsg_t m = xmsg("w", 2);
    b->refused[i] = fps_peers_send(b->p, 1, &m, deadline_in(30), on_done, &b->o[i]) != 0;
  }
  return NULL;
}

static void test_concurrent_sends(void **state) {
  (void)state;
  fps_test_server_t r;
  receiver(&r, NULL);
  fps_peers_t *p = sender(r.addr, 30, NULL);
  static burst_t b[4];
  pthread_t th[4];
  for (int t = 0; t < 4; t++) {
    b[t].p = p;
    assert_int_equal(pthread_create(&th[t], NULL, burst_main, &b[t]), 0);
  }
  for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 4; t++)
    for (int i = 0; i < 16; i++) {
      assert_false(b[t].refused[i]);
      outcome_wait(&b[t].o[i], 60);
      assert_err(&b[t].o[i], FPS_ENOTFOUND, "from shard 0");
      assert_int_equal(b[t].o[i].calls, 1);
    }
  fps_peers_destroy(p);
  assert_int_equal(fps_test_server_stop(&r), 0);
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_plaintext, teardown),
      cmocka_unit_test_teardown(test_tls, teardown),
      cmocka_unit_test_teardown(test_mtls, teardown),
      cmocka_unit_test_teardown(test_token, teardown),
      cmocka_unit_test_teardown(test_mtls_and_token, teardown),
      cmocka_unit_test_teardown(test_peer_down, teardown),
      cmocka_unit_test_teardown(test_peer_replicas, teardown),
      cmocka_unit_test_teardown(test_peer_comes_back, teardown),
      cmocka_unit_test_teardown(test_peer_never_answers, teardown),
      cmocka_unit_test_teardown(test_stop_with_sends_in_flight, teardown),
      cmocka_unit_test_teardown(test_concurrent_sends, teardown),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

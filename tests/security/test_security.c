/* Security tests through libfactorps against real shards: TLS, mutual TLS,
 * bearer tokens and the concurrent-call limit.
 *
 * Certificates and tokens are made by gencerts.sh (the openssl CLI) into a
 * fresh temporary directory for each run. Each refusal case first puts
 * known state on the shard with an authorised client (one tensor, one
 * push), then lets the intruder try to create a tensor of its own, read the
 * shard's figures and overwrite the tensor, checks the status the intruder
 * gets (UNAVAILABLE for a failed handshake, as gRPC reports it;
 * UNAUTHENTICATED for a missing or wrong token), and finally checks through
 * the authorised client that the shard's state is exactly what it was:
 * same tensors, same version, same values, same push count. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "factorps/client.h"
#include "harness.h"
#include "scrape.h"

#define NUMEL 32

static char dir[256];      /* the certificates and tokens */
static char token[128];    /* contents of dir/token */

#define assert_code(rc, want, st)                                                       \
  do {                                                                                  \
    int rc_ = (rc);                                                                     \
    if (rc_ != (want))                                                                  \
      fail_msg("got %s, want %s: %s", fps_code_name(rc_), fps_code_name(want),          \
               (st).message);                                                           \
  } while (0)

static const char *path(const char *name) {
  /* A few rotating buffers: several paths appear in one call. */
  static char buf[8][512];
  static int i;
  char *p = buf[i++ % 8];
  snprintf(p, sizeof buf[0], "%s/%s", dir, name);
  return p;
}

static void read_token(const char *name, char *out, size_t len) {
  FILE *f = fopen(path(name), "r");
  assert_non_null(f);
  assert_non_null(fgets(out, (int)len, f));
  fclose(f);
  out[strcspn(out, "\r\n")] = 0;
}

static int group_setup(void **state) {
  (void)state;
  const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  snprintf(dir, sizeof dir, "%s/fps-sec-XXXXXX", tmp);
  if (!mkdtemp(dir)) return -1;
  const char *script = getenv("FPS_GENCERTS");
  if (!script) {
    fprintf(stderr, "FPS_GENCERTS is not set\n");
    return -1;
  }
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "sh '%s' '%s'", script, dir);
  if (system(cmd) != 0) {
    fprintf(stderr, "%s failed\n", cmd);
    return -1;
  }
  FILE *f = fopen(path("token"), "r");
  if (!f || !fgets(token, sizeof token, f)) return -1;
  fclose(f);
  token[strcspn(token, "\r\n")] = 0;
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  return 0;
}

/* ------------------------------------------------------------ clients */

typedef struct creds_s {
  const char *ca, *cert, *key, *token, *server_name;
} creds_t;

static fps_client_t *client_new(const char *addr, creds_t cr, fps_status_t *st) {
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 5;
  /* A refused handshake is not transient: no retries keep the test short. */
  o.max_retries = 0;
  o.tls_ca_file = cr.ca ? path(cr.ca) : NULL;
  o.tls_cert_file = cr.cert ? path(cr.cert) : NULL;
  o.tls_key_file = cr.key ? path(cr.key) : NULL;
  o.auth_token = cr.token;
  o.tls_server_name = cr.server_name;
  const char *addrs[1] = {addr};
  return fps_client_create(addrs, 1, &o, st);
}

static fps_tensor_def_t def_of(const char *name, const float *init) {
  fps_tensor_def_t d;
  memset(&d, 0, sizeof d);
  d.name = name;
  d.ndim = 2;
  d.shape[0] = 4;
  d.shape[1] = NUMEL / 4;
  d.optim.flavor = FPS_OPTIM_TORCH;
  d.init = init;
  return d;
}

/* What the shard holds, as an authorised client sees it. */
typedef struct snapshot_s {
  uint64_t tensors, pushes, updates, version;
  float w[NUMEL];
} snapshot_t;

static void snapshot(fps_client_t *c, snapshot_t *s) {
  fps_status_t st;
  fps_shard_stats_t ss;
  memset(s, 0, sizeof *s);
  if (fps_client_shard_of(c, "w") < 0) assert_code(fps_client_discover(c, NULL, &st), 0, st);
  assert_code(fps_client_stats(c, &ss, 1, &st), 0, st);
  s->tensors = ss.tensors;
  s->pushes = ss.pushes;
  s->updates = ss.updates;
  const char *names[1] = {"w"};
  float *params[1] = {s->w};
  assert_code(fps_client_pull(c, names, params, &s->version, 1, &st), 0, st);
}

/* Creates "w", pushes one step and returns the state: the positive path
 * (create, push, pull) of every configuration. */
static void seed(fps_client_t *c, snapshot_t *s) {
  fps_status_t st;
  float init[NUMEL], grad[NUMEL], out[NUMEL];
  for (int i = 0; i < NUMEL; i++) {
    init[i] = (float)i * 0.01f;
    grad[i] = 0.5f - (float)(i % 3);
  }
  fps_tensor_def_t d = def_of("w", init);
  assert_code(fps_client_create_tensors(c, &d, 1, &st), 0, st);
  const char *names[1] = {"w"};
  const float *grads[1] = {grad};
  float *params[1] = {out};
  uint64_t version = 0;
  assert_code(fps_client_push_pull(c, 0, 0, names, grads, params, &version, 1, &st), 0, st);
  assert_int_equal(version, 1);
  snapshot(c, s);
  assert_int_equal(s->tensors, 1);
  assert_int_equal(s->version, 1);
  assert_int_equal(s->pushes, 1);
  assert_memory_equal(s->w, out, sizeof out);
  /* The update moved the values. */
  assert_true(memcmp(s->w, init, sizeof init) != 0);
}

/* The intruder tries everything a client can: register a tensor of its
 * own, register "w" with values of its own, and read the figures. Each
 * must fail with `want`, naming the problem in `want_msg` (if non-NULL). */
static void intrude(const char *addr, creds_t cr, int want, const char *want_msg) {
  fps_status_t st;
  fps_client_t *c = client_new(addr, cr, &st);
  assert_non_null(c);
  float evil[NUMEL];
  for (int i = 0; i < NUMEL; i++) evil[i] = 1000.0f;
  fps_tensor_def_t d[2] = {def_of("w", evil), def_of("evil", evil)};
  assert_code(fps_client_create_tensors(c, d, 2, &st), want, st);
  if (want_msg && !strstr(st.message, want_msg))
    fail_msg("message '%s' does not say '%s'", st.message, want_msg);
  fps_shard_stats_t ss;
  assert_code(fps_client_stats(c, &ss, 1, &st), want, st);
  assert_code(fps_client_discover(c, NULL, &st), want, st);
  fps_client_destroy(c);
}

static void assert_unchanged(fps_client_t *good, const snapshot_t *before) {
  snapshot_t after;
  snapshot(good, &after);
  assert_int_equal(after.tensors, before->tensors);
  assert_int_equal(after.version, before->version);
  assert_int_equal(after.pushes, before->pushes);
  assert_int_equal(after.updates, before->updates);
  assert_memory_equal(after.w, before->w, sizeof after.w);
}

static void start(fps_test_server_t *srv, const char *const *flags) {
  assert_int_equal(fps_test_server_start(srv, 0, 1, "async", 1, flags), 0);
}

/* --------------------------------------------------------------- cases */

/* TLS: create/push/pull work over it; a plaintext client and a client
 * that does not trust the shard's CA are refused; the server-name
 * override is honoured and checked. */
static void test_tls(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"), NULL};
  start(&srv, flags);
  fps_status_t st;
  fps_client_t *good = client_new(srv.addr, (creds_t){.ca = "ca.pem"}, &st);
  assert_non_null(good);
  snapshot_t s;
  seed(good, &s);

  intrude(srv.addr, (creds_t){0}, FPS_CODE_UNAVAILABLE, NULL);
  intrude(srv.addr, (creds_t){.ca = "ca2.pem"}, FPS_CODE_UNAVAILABLE, NULL);
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .server_name = "evil.example"}, FPS_CODE_UNAVAILABLE,
          NULL);
  assert_unchanged(good, &s);

  /* Dialled as localhost, or by IP with the DNS name the certificate
   * carries. */
  char local[64];
  snprintf(local, sizeof local, "localhost:%d", srv.port);
  fps_client_t *c = client_new(local, (creds_t){.ca = "ca.pem"}, &st);
  assert_non_null(c);
  snapshot_t s2;
  snapshot(c, &s2);
  assert_int_equal(s2.version, 1);
  fps_client_destroy(c);
  c = client_new(srv.addr, (creds_t){.ca = "ca.pem", .server_name = "shard.factorps.test"}, &st);
  assert_non_null(c);
  snapshot(c, &s2);
  assert_int_equal(s2.version, 1);
  fps_client_destroy(c);

  fps_client_destroy(good);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* Mutual TLS: only a current certificate from the configured CA gets in. */
static void test_mtls(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"),
                         "--tls-client-ca", path("ca.pem"), NULL};
  start(&srv, flags);
  fps_status_t st;
  fps_client_t *good =
      client_new(srv.addr, (creds_t){.ca = "ca.pem", .cert = "client.pem", .key = "client.key"}, &st);
  assert_non_null(good);
  snapshot_t s;
  seed(good, &s);

  /* Plaintext, TLS without a certificate, a certificate from another CA,
   * an expired certificate. */
  intrude(srv.addr, (creds_t){0}, FPS_CODE_UNAVAILABLE, NULL);
  intrude(srv.addr, (creds_t){.ca = "ca.pem"}, FPS_CODE_UNAVAILABLE, NULL);
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .cert = "other.pem", .key = "other.key"},
          FPS_CODE_UNAVAILABLE, NULL);
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .cert = "expired.pem", .key = "expired.key"},
          FPS_CODE_UNAVAILABLE, NULL);
  /* A valid certificate with a key that is not its own. */
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .cert = "client.pem", .key = "other.key"},
          FPS_CODE_UNAVAILABLE, NULL);
  assert_unchanged(good, &s);
  fps_client_destroy(good);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* Bearer tokens over TLS: missing and wrong tokens are UNAUTHENTICATED;
 * a guess that shares a prefix with the token, or is the token plus a
 * byte, is as wrong as any other. Both tokens of the file are accepted
 * (rotation). */
static void test_token(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"),
                         "--auth-token-file", path("tokens.txt"), NULL};
  start(&srv, flags);
  fps_status_t st;
  fps_client_t *good = client_new(srv.addr, (creds_t){.ca = "ca.pem", .token = token}, &st);
  assert_non_null(good);
  snapshot_t s;
  seed(good, &s);

  char wrong[128], longer[160], shorter[128];
  read_token("wrong-token", wrong, sizeof wrong);
  snprintf(longer, sizeof longer, "%sx", token);
  snprintf(shorter, sizeof shorter, "%.*s", (int)strlen(token) - 1, token);
  intrude(srv.addr, (creds_t){.ca = "ca.pem"}, FPS_CODE_UNAUTHENTICATED, "requires a bearer token");
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .token = wrong}, FPS_CODE_UNAUTHENTICATED,
          "not valid");
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .token = longer}, FPS_CODE_UNAUTHENTICATED,
          "not valid");
  intrude(srv.addr, (creds_t){.ca = "ca.pem", .token = shorter}, FPS_CODE_UNAUTHENTICATED,
          "not valid");
  /* Plaintext with the right token still fails the handshake. */
  intrude(srv.addr, (creds_t){.token = token}, FPS_CODE_UNAVAILABLE, NULL);
  assert_unchanged(good, &s);

  char token2[128];
  read_token("token2", token2, sizeof token2);
  fps_client_t *c = client_new(srv.addr, (creds_t){.ca = "ca.pem", .token = token2}, &st);
  assert_non_null(c);
  snapshot_t s2;
  snapshot(c, &s2);
  assert_int_equal(s2.version, 1);
  fps_client_destroy(c);
  fps_client_destroy(good);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* Tokens without TLS (e.g. a private network): the check is the same. */
static void test_token_plaintext(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--auth-token-file", path("tokens.txt"), NULL};
  start(&srv, flags);
  fps_status_t st;
  fps_client_t *good = client_new(srv.addr, (creds_t){.token = token}, &st);
  assert_non_null(good);
  snapshot_t s;
  seed(good, &s);
  char wrong[128];
  read_token("wrong-token", wrong, sizeof wrong);
  intrude(srv.addr, (creds_t){0}, FPS_CODE_UNAUTHENTICATED, "requires a bearer token");
  intrude(srv.addr, (creds_t){.token = wrong}, FPS_CODE_UNAUTHENTICATED, "not valid");
  assert_unchanged(good, &s);
  fps_client_destroy(good);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* Everything at once: mTLS and a token; a right certificate with a wrong
 * token, and a right token without a certificate, are both refused. */
static void test_mtls_and_token(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--tls-cert", path("server.pem"), "--tls-key", path("server.key"),
                         "--tls-client-ca", path("ca.pem"), "--auth-token-file", path("token"),
                         NULL};
  start(&srv, flags);
  fps_status_t st;
  creds_t ok = {.ca = "ca.pem", .cert = "client.pem", .key = "client.key", .token = token};
  fps_client_t *good = client_new(srv.addr, ok, &st);
  assert_non_null(good);
  snapshot_t s;
  seed(good, &s);
  creds_t no_token = ok, no_cert = ok;
  no_token.token = NULL;
  no_cert.cert = no_cert.key = NULL;
  intrude(srv.addr, no_token, FPS_CODE_UNAUTHENTICATED, "bearer token");
  intrude(srv.addr, no_cert, FPS_CODE_UNAVAILABLE, NULL);
  assert_unchanged(good, &s);
  fps_client_destroy(good);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* Client-side validation: half a TLS configuration and unreadable or
 * non-PEM files fail fps_client_create() with INVALID_ARGUMENT, before any
 * connection (no silent fallback to plaintext). */
static void test_client_options(void **state) {
  (void)state;
  fps_status_t st;
  const char *addr = "127.0.0.1:1";
  const creds_t bad[] = {
      {.cert = "client.pem", .key = "client.key"},       /* no CA */
      {.ca = "ca.pem", .cert = "client.pem"},            /* no key */
      {.ca = "ca.pem", .key = "client.key"},             /* no cert */
      {.ca = "missing.pem"},                             /* unreadable */
      {.ca = "token"},                                   /* not PEM */
      {.ca = "ca.pem", .token = "has space"},            /* not a header token */
      {.ca = "ca.pem", .token = ""},                     /* empty */
      {.server_name = "localhost"},                      /* override without TLS */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    fps_client_t *c = client_new(addr, bad[i], &st);
    if (c) fail_msg("case %zu: client created", i);
    assert_int_equal(st.code, FPS_CODE_INVALID_ARGUMENT);
    /* A token is never echoed back. */
    assert_null(strstr(st.message, "has space"));
  }
}

/* --max-concurrent-calls: with two sync pushes parked in an unfinished
 * round (3 workers expected), a third call is RESOURCE_EXHAUSTED with a
 * message naming the flag; when the parked calls end (deadline), the
 * shard serves again and nothing was applied. */
typedef struct pusher_s {
  const char *addr;
  uint32_t worker;
  int code;
} pusher_t;

/* The parked pushes' deadline: long enough for both to get parked on a
 * loaded machine (nothing else competes for the two slots meanwhile). */
#define PUSH_DEADLINE_S 15

static void *push_thread(void *arg) {
  pusher_t *p = arg;
  fps_status_t st;
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = PUSH_DEADLINE_S;
  o.max_retries = 0;
  const char *addrs[1] = {p->addr};
  fps_client_t *c = fps_client_create(addrs, 1, &o, &st);
  p->code = -1;
  if (!c) return NULL;
  fps_tensor_def_t d = def_of("w", NULL);
  /* A call that just ended may still hold its slot for a moment (it is
   * released after its status is sent): the test's own Create, or the
   * other pusher's. A Create refused for that tries again (bounded). */
  struct timespec c0, cnow;
  clock_gettime(CLOCK_MONOTONIC, &c0);
  int created;
  for (;;) {
    created = fps_client_create_tensors(c, &d, 1, &st);
    clock_gettime(CLOCK_MONOTONIC, &cnow);
    if (created != FPS_CODE_RESOURCE_EXHAUSTED || cnow.tv_sec - c0.tv_sec >= PUSH_DEADLINE_S / 3) break;
    struct timespec ts = {0, 5 * 1000000L};
    nanosleep(&ts, NULL);
  }
  if (created == 0) {
    float grad[NUMEL] = {0};
    grad[0] = 1;
    const char *names[1] = {"w"};
    const float *grads[1] = {grad};
    float *params[1] = {NULL}; /* versions only */
    /* The other pusher's Create may still hold a slot for a moment (a
     * call is briefly counted twice): a refused push tries again (nothing
     * was applied; bounded by the loop). */
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
      p->code = fps_client_push_pull(c, p->worker, 0, names, grads, params, NULL, 1, &st);
      if (p->code != FPS_CODE_RESOURCE_EXHAUSTED) break;
      struct timespec ts = {0, 5 * 1000000L};
      nanosleep(&ts, NULL);
      clock_gettime(CLOCK_MONOTONIC, &now);
    } while (now.tv_sec - t0.tv_sec < PUSH_DEADLINE_S - 2);
  } else {
    p->code = st.code;
  }
  fps_client_destroy(c);
  return NULL;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The shard's factorps_waiting_pushes gauge (sync: gradients in open
 * rounds), read over /metrics, which takes no gRPC call slot; -1 if the
 * scrape failed. */
static double waiting_pushes(int mport) {
  const char *names[1] = {"factorps_waiting_pushes"};
  double v = -1;
  return fps_test_scrape(mport, names, &v, 1) == 0 ? v : -1;
}

static void test_concurrent_call_limit(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *flags[] = {"--max-concurrent-calls", "2", "--metrics-listen", "127.0.0.1:0",
                         "--metrics-port-file", path("metrics.port"), NULL};
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "sync", 3, flags), 0);
  /* Written before the gRPC port the harness waited for. */
  int mport = fps_test_read_port(path("metrics.port"));
  assert_true(mport > 0);
  fps_status_t st;
  fps_client_t *c = client_new(srv.addr, (creds_t){0}, &st);
  assert_non_null(c);
  float init[NUMEL] = {0};
  fps_tensor_def_t d = def_of("w", init);
  assert_code(fps_client_create_tensors(c, &d, 1, &st), 0, st);

  pusher_t p[2] = {{srv.addr, 0, 0}, {srv.addr, 1, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, push_thread, &p[i]), 0);
  /* Sequenced on the shard's own state, not on time: no gRPC call of
   * ours competes with the pushers until both are parked in the round
   * (3 workers: it never completes), each holding a slot to its deadline.
   * Waiting longer than that deadline would mean they never got there. */
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  double w = 0;
  do {
    w = waiting_pushes(mport);
    if (w == 2) break;
    sleep_ms(10);
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (now.tv_sec - t0.tv_sec < PUSH_DEADLINE_S + 5);
  if (w != 2) fail_msg("the two pushes were never both parked (factorps_waiting_pushes %g)", w);
  /* Both slots are held: every call is refused, naming the flag. */
  fps_shard_stats_t ss;
  for (int i = 0; i < 5; i++) {
    int code = fps_client_stats(c, &ss, 1, &st);
    assert_code(code, FPS_CODE_RESOURCE_EXHAUSTED, st);
    assert_non_null(strstr(st.message, "max-concurrent-calls"));
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  /* The round never completed: both pushes failed at their deadline. */
  for (int i = 0; i < 2; i++)
    if (p[i].code != FPS_CODE_DEADLINE_EXCEEDED)
      fail_msg("pusher %d ended with %s, not DEADLINE_EXCEEDED", i,
               p[i].code < 0 ? "no client" : fps_code_name(p[i].code));
  /* The pushers have their answers, but the shard may still count their
   * calls for a moment while it tears them down: until the round is empty
   * and the calls are gone, a call may still be refused (the refusal says
   * "retry later"), so each call below is retried while it is refused. */
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int code;
  uint64_t version = 0;
  float now_w[NUMEL];
  const char *names[1] = {"w"};
  float *params[1] = {now_w};
  do {
    code = waiting_pushes(mport) == 0 ? fps_client_stats(c, &ss, 1, &st) : FPS_CODE_RESOURCE_EXHAUSTED;
    if (code == 0) code = fps_client_pull(c, names, params, &version, 1, &st);
    if (code != FPS_CODE_RESOURCE_EXHAUSTED) break;
    sleep_ms(25);
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (now.tv_sec - t0.tv_sec < 30);
  assert_code(code, 0, st);
  /* Nothing was applied. */
  assert_int_equal(version, 0);
  assert_int_equal(ss.updates, 0);
  assert_memory_equal(now_w, init, sizeof init);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* The server refuses bad security flags at start-up with a clear message
 * (exit status 2 from the config or 1 from the start; never serving). */
static void test_server_flags(void **state) {
  (void)state;
  const char *const cases[][8] = {
      {"--tls-cert", "server.pem", NULL},                                   /* no key */
      {"--tls-cert", "server.pem", "--tls-key", "client.key", NULL},       /* wrong key */
      {"--tls-cert", "expired.pem", "--tls-key", "expired.key", NULL},     /* expired */
      {"--tls-cert", "token", "--tls-key", "server.key", NULL},            /* not PEM */
      {"--tls-client-ca", "ca.pem", NULL},                                  /* mTLS without TLS */
      {"--auth-token-file", "missing", NULL},                              /* unreadable */
      {"--auth-token-file", "ca.srl.empty", NULL},                         /* empty */
  };
  FILE *f = fopen(path("ca.srl.empty"), "w");
  assert_non_null(f);
  fputs("# nothing\n\n", f);
  fclose(f);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *flags[8] = {0};
    for (size_t j = 0; cases[i][j]; j++)
      flags[j] = cases[i][j][0] == '-' ? cases[i][j] : path(cases[i][j]);
    fps_test_server_t srv;
    if (fps_test_server_start(&srv, 0, 1, "async", 1, flags) == 0)
      fail_msg("case %zu: the server started", i);
  }
}

/* argv[1], if given, runs only the tests whose name matches. */
int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_tls, teardown),
      cmocka_unit_test_teardown(test_mtls, teardown),
      cmocka_unit_test_teardown(test_token, teardown),
      cmocka_unit_test_teardown(test_token_plaintext, teardown),
      cmocka_unit_test_teardown(test_mtls_and_token, teardown),
      cmocka_unit_test_teardown(test_client_options, teardown),
      cmocka_unit_test_teardown(test_concurrent_call_limit, teardown),
      cmocka_unit_test_teardown(test_server_flags, teardown),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

/* libfactorps retries a started PushPull on UNAVAILABLE, and the shard
 * applies it exactly once. A TCP proxy in this process
 * stands between the client and a real shard and resets every connection
 * once a chosen number of bytes has passed in one direction:
 *   lost_reply     shard -> client, well into the reply's parameters: the
 *                  push was applied, the reply is lost; the client's retry
 *                  (same push_id) is answered from the shard's window.
 *   lost_request   client -> shard, halfway through the gradient: nothing
 *                  was applied; the retry is applied.
 * Either way the tensor ends at version 1, Stats counts one update, and the
 * parameters the client got equal, bit for bit, those of a second shard
 * that saw the push once without a proxy.
 * The same for a push cut into chunk calls (push_chunk_bytes), each with its own
 * push_id: the cut finds some chunks applied and answered, some applied
 * with their reply lost, some not sent; the retry applies each exactly
 * once. And a shard killed mid-push: the other shard's chunks are applied
 * once, the call fails naming the dead shard within its deadline. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "factorps/client.h"
#include "harness.h"

#define NUMEL (512u * 1024u) /* 2 MiB of fp32 each way */
#define MAX_CONNS 16

/* ---------------------------------------------------------- the proxy */

enum { CUT_NONE = 0, CUT_TO_CLIENT, CUT_TO_SHARD };

typedef struct proxy_s {
  int lfd, port, upstream_port;
  pthread_t th;
  atomic_int stop;
  pthread_mutex_t mu;            /* the fields below */
  int cut_dir;                   /* CUT_*: armed, one shot */
  uint64_t cut_after, counted;   /* bytes in cut_dir since armed */
  int cuts, accepted;
  pid_t kill_pid;                /* SIGKILLed at the cut, if > 0 */
  int fd[MAX_CONNS][2];          /* [client side, shard side], -1: free */
} proxy_t;

static int connect_loopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Resets (RST, not FIN) both sides of connection i. REQUIRES p->mu. */
static void proxy_reset_locked(proxy_t *p, int i) {
  for (int k = 0; k < 2; k++) {
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(p->fd[i][k], SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(p->fd[i][k]);
    p->fd[i][k] = -1;
  }
}

static int write_all(int fd, const char *b, size_t n) {
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

static void *proxy_main(void *arg) {
  proxy_t *p = arg;
  static char buf[65536];
  while (!atomic_load(&p->stop)) {
    struct pollfd pf[1 + 2 * MAX_CONNS];
    int idx[1 + 2 * MAX_CONNS][2], n = 0;
    pf[n++] = (struct pollfd){.fd = p->lfd, .events = POLLIN};
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < MAX_CONNS; i++)
      for (int k = 0; k < 2 && p->fd[i][0] >= 0; k++) {
        idx[n][0] = i, idx[n][1] = k;
        pf[n++] = (struct pollfd){.fd = p->fd[i][k], .events = POLLIN};
      }
    pthread_mutex_unlock(&p->mu);
    if (poll(pf, (nfds_t)n, 50) <= 0) continue;
    if (pf[0].revents & POLLIN) {
      int c = accept4(p->lfd, NULL, NULL, SOCK_CLOEXEC);
      int s = c >= 0 ? connect_loopback(p->upstream_port) : -1;
      pthread_mutex_lock(&p->mu);
      int slot = -1;
      for (int i = 0; i < MAX_CONNS && slot < 0; i++)
        if (p->fd[i][0] < 0) slot = i;
      if (c >= 0 && s >= 0 && slot >= 0) {
        p->fd[slot][0] = c, p->fd[slot][1] = s;
        p->accepted++;
      } else {
        if (c >= 0) close(c);
        if (s >= 0) close(s);
      }
      pthread_mutex_unlock(&p->mu);
    }
    for (int j = 1; j < n; j++) {
      if (!(pf[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      int i = idx[j][0], k = idx[j][1];
      pthread_mutex_lock(&p->mu);
      if (p->fd[i][k] != pf[j].fd) { /* reset meanwhile */
        pthread_mutex_unlock(&p->mu);
        continue;
      }
      ssize_t r = read(p->fd[i][k], buf, sizeof buf);
      int dir = k == 0 ? CUT_TO_SHARD : CUT_TO_CLIENT;
      if (r <= 0 || write_all(p->fd[i][1 - k], buf, (size_t)r) < 0) {
        proxy_reset_locked(p, i);
      } else if (p->cut_dir == dir && (p->counted += (uint64_t)r) >= p->cut_after) {
        /* The cut: every connection, as a network failure would (with
         * kill_pid, the shard dies first, as a crash would). */
        if (p->kill_pid > 0) kill(p->kill_pid, SIGKILL);
        for (int x = 0; x < MAX_CONNS; x++)
          if (p->fd[x][0] >= 0) proxy_reset_locked(p, x);
        p->cut_dir = CUT_NONE;
        p->cuts++;
      }
      pthread_mutex_unlock(&p->mu);
    }
  }
  return NULL;
}

static void proxy_start(proxy_t *p, int upstream_port) {
  memset(p, 0, sizeof *p);
  for (int i = 0; i < MAX_CONNS; i++) p->fd[i][0] = p->fd[i][1] = -1;
  p->upstream_port = upstream_port;
  pthread_mutex_init(&p->mu, NULL);
  p->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(p->lfd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  assert_int_equal(bind(p->lfd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(p->lfd, 16), 0);
  assert_int_equal(getsockname(p->lfd, (struct sockaddr *)&a, &al), 0);
  p->port = ntohs(a.sin_port);
  assert_int_equal(pthread_create(&p->th, NULL, proxy_main, p), 0);
}

static void proxy_arm(proxy_t *p, int dir, uint64_t after) {
  pthread_mutex_lock(&p->mu);
  p->cut_dir = dir;
  p->cut_after = after;
  p->counted = 0;
  pthread_mutex_unlock(&p->mu);
}

static void proxy_stop(proxy_t *p) {
  atomic_store(&p->stop, 1);
  pthread_join(p->th, NULL);
  for (int i = 0; i < MAX_CONNS; i++)
    if (p->fd[i][0] >= 0) proxy_reset_locked(p, i);
  close(p->lfd);
  pthread_mutex_destroy(&p->mu);
}

/* ------------------------------------------------------------ the case */

#define assert_code(rc, want, st)                                                        \
  do {                                                                                   \
    int rc_ = (rc);                                                                      \
    if (rc_ != (want))                                                                   \
      fail_msg("got %s, want %s: %s", fps_code_name(rc_), fps_code_name(want), (st).message); \
  } while (0)

static fps_client_t *client_of(const char *const *addrs, size_t n, uint64_t chunk, double deadline) {
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = deadline;
  o.max_retries = 5;
  o.backoff_initial_seconds = 0.05;
  o.max_message_bytes = 256u * 1024u;
  o.push_chunk_bytes = chunk;
  fps_status_t st;
  fps_client_t *c = fps_client_create(addrs, n, &o, &st);
  if (!c) fail_msg("client: %s", st.message);
  return c;
}

static fps_client_t *client_at(const char *addr) {
  const char *addrs[1] = {addr};
  return client_of(addrs, 1, 0, 60);
}

static float *init_v, *grad_v;

/* Creates "w" through c and pushes the one gradient; params and version
 * out. Returns the push's code. */
static int create_and_push(fps_client_t *c, proxy_t *p, int dir, uint64_t after, float *params,
                           uint64_t *version, fps_status_t *st) {
  fps_tensor_def_t d;
  memset(&d, 0, sizeof d);
  d.name = "w";
  d.ndim = 2;
  d.shape[0] = 1024;
  d.shape[1] = NUMEL / 1024;
  d.init = init_v;
  d.optim.flavor = FPS_OPTIM_TORCH;
  assert_code(fps_client_create_tensors(c, &d, 1, st), 0, *st);
  if (p) proxy_arm(p, dir, after);
  const char *names[1] = {"w"};
  const float *grads[1] = {grad_v};
  float *out[1] = {params};
  return fps_client_push_pull(c, 0, 0, names, grads, out, version, 1, st);
}

static void retried_push_applies_once(int dir, uint64_t after) {
  fps_test_server_t srv, ref;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  assert_int_equal(fps_test_server_start(&ref, 0, 1, "async", 1, NULL), 0);
  init_v = malloc(NUMEL * sizeof(float));
  grad_v = malloc(NUMEL * sizeof(float));
  float *got = malloc(NUMEL * sizeof(float)), *want = malloc(NUMEL * sizeof(float));
  assert_true(init_v && grad_v && got && want);
  for (uint32_t i = 0; i < NUMEL; i++) {
    init_v[i] = (float)((i * 2654435761u) % 2001u) / 1000.0f - 1.0f;
    grad_v[i] = (float)((i * 40503u) % 1999u) / 999.5f - 1.0f;
  }
  fps_status_t st;
  uint64_t v = 0;

  /* The reference: the same push once, no proxy. */
  fps_client_t *rc = client_at(ref.addr);
  assert_code(create_and_push(rc, NULL, CUT_NONE, 0, want, &v, &st), 0, st);
  assert_int_equal(v, 1);
  fps_client_destroy(rc);

  proxy_t p;
  proxy_start(&p, srv.port);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", p.port);
  fps_client_t *c = client_at(addr);
  v = 0;
  assert_code(create_and_push(c, &p, dir, after, got, &v, &st), 0, st);
  pthread_mutex_lock(&p.mu);
  int cuts = p.cuts, accepted = p.accepted;
  pthread_mutex_unlock(&p.mu);
  assert_int_equal(cuts, 1);      /* the first attempt was cut... */
  assert_true(accepted >= 2);     /* ...and retried on a new connection */
  assert_int_equal(v, 1);
  assert_memory_equal(got, want, NUMEL * sizeof(float));

  /* Applied once: Stats read straight from the shard, and a Pull. */
  fps_client_t *direct = client_at(srv.addr);
  fps_shard_stats_t ss;
  assert_code(fps_client_stats(direct, &ss, 1, &st), 0, st);
  assert_int_equal(ss.updates, 1);
  if (dir == CUT_TO_SHARD) {
    assert_int_equal(ss.pushes, 1); /* only the retry was answered */
  } else {
    /* The first attempt's reply went out to a dead connection: the shard
     * may count it OK or failed, but it applied nothing twice. */
    assert_in_range(ss.pushes, 1, 2);
  }
  const char *names[1] = {"w"};
  float *out[1] = {got};
  assert_code(fps_client_pull(c, names, out, &v, 1, &st), 0, st);
  assert_int_equal(v, 1);
  assert_memory_equal(got, want, NUMEL * sizeof(float));
  print_message("%s cut after %llu bytes: %d connection(s), updates %llu, pushes %llu, push_errors %llu\n",
                dir == CUT_TO_CLIENT ? "reply" : "request", (unsigned long long)after, accepted,
                (unsigned long long)ss.updates, (unsigned long long)ss.pushes,
                (unsigned long long)ss.push_errors);
  fps_client_destroy(direct);
  fps_client_destroy(c);
  proxy_stop(&p);
  free(init_v);
  free(grad_v);
  free(got);
  free(want);
  assert_int_equal(fps_test_server_stop(&srv), 0);
  assert_int_equal(fps_test_server_stop(&ref), 0);
}

/* The reply is cut a quarter of the way through its 2 MiB of parameters:
 * the shard streams them only after applying. */
static void test_lost_reply(void **state) {
  (void)state;
  retried_push_applies_once(CUT_TO_CLIENT, 512u * 1024u);
}

/* The request is cut halfway through its 2 MiB of gradient: never
 * half-closed, so nothing was applied. */
static void test_lost_request(void **state) {
  (void)state;
  retried_push_applies_once(CUT_TO_SHARD, 1024u * 1024u);
}

/* ------------------------------------------------- chunked pushes */

#define CT 8                     /* tensors */
#define CT_ROWS 256u
#define CT_COLS 256u             /* 256 KiB of fp32 each, 2 MiB in all */
#define CT_NUMEL (CT_ROWS * CT_COLS)

typedef struct chunk_job_s {
  fps_tensor_def_t defs[CT];
  char names[CT][8];
  const char *np[CT];
  float *init[CT], *grad[CT], *got[CT], *want[CT];
} chunk_job_t;

static void chunk_job_init(chunk_job_t *j) {
  memset(j, 0, sizeof *j);
  for (uint32_t t = 0; t < CT; t++) {
    snprintf(j->names[t], sizeof j->names[t], "c%u", t);
    j->np[t] = j->names[t];
    j->init[t] = malloc(CT_NUMEL * sizeof(float));
    j->grad[t] = malloc(CT_NUMEL * sizeof(float));
    j->got[t] = malloc(CT_NUMEL * sizeof(float));
    j->want[t] = malloc(CT_NUMEL * sizeof(float));
    assert_true(j->init[t] && j->grad[t] && j->got[t] && j->want[t]);
    for (uint32_t i = 0; i < CT_NUMEL; i++) {
      j->init[t][i] = (float)(((i + t * 7919u) * 2654435761u) % 2001u) / 1000.0f - 1.0f;
      j->grad[t][i] = (float)(((i + t * 104729u) * 40503u) % 1999u) / 999.5f - 1.0f;
    }
    fps_tensor_def_t *d = &j->defs[t];
    d->name = j->names[t];
    d->ndim = 2;
    d->shape[0] = CT_ROWS;
    d->shape[1] = CT_COLS;
    d->init = j->init[t];
    d->optim.flavor = FPS_OPTIM_TORCH;
  }
}

static void chunk_job_free(chunk_job_t *j) {
  for (int t = 0; t < CT; t++) {
    free(j->init[t]);
    free(j->grad[t]);
    free(j->got[t]);
    free(j->want[t]);
  }
}

static int chunk_push(fps_client_t *c, chunk_job_t *j, float **out, uint64_t *versions,
                      fps_status_t *st) {
  return fps_client_push_pull(c, 0, 0, j->np, (const float *const *)j->grad, out, versions, CT, st);
}

/* The reference: the same push once, unchunked, on shards without a proxy. */
static void chunk_reference(chunk_job_t *j, fps_test_server_t *ref, int n) {
  const char *addrs[2] = {ref[0].addr, n > 1 ? ref[1].addr : NULL};
  fps_client_t *c = client_of(addrs, (size_t)n, 0, 60);
  fps_status_t st;
  uint64_t v[CT];
  assert_code(fps_client_create_tensors(c, j->defs, CT, &st), 0, st);
  assert_code(chunk_push(c, j, j->want, v, &st), 0, st);
  for (int t = 0; t < CT; t++) assert_int_equal(v[t], 1);
  fps_client_destroy(c);
}

static void chunked_push_applies_once(int dir, uint64_t after) {
  fps_test_server_t srv, ref;
  chunk_job_t j;
  fps_status_t st;
  uint64_t v[CT];
  chunk_job_init(&j);
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  assert_int_equal(fps_test_server_start(&ref, 0, 1, "async", 1, NULL), 0);
  chunk_reference(&j, &ref, 1);

  proxy_t p;
  proxy_start(&p, srv.port);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", p.port);
  const char *addrs[1] = {addr};
  /* A chunk of 1 byte: the library's floor (2 MiB / 32 calls) decides, a
   * call per 256 KiB tensor. */
  fps_client_t *c = client_of(addrs, 1, 1, 60);
  assert_code(fps_client_create_tensors(c, j.defs, CT, &st), 0, st);
  proxy_arm(&p, dir, after);
  assert_code(chunk_push(c, &j, j.got, v, &st), 0, st);
  pthread_mutex_lock(&p.mu);
  int cuts = p.cuts, accepted = p.accepted;
  pthread_mutex_unlock(&p.mu);
  assert_int_equal(cuts, 1);
  assert_true(accepted >= 2);
  for (int t = 0; t < CT; t++) {
    assert_int_equal(v[t], 1);
    assert_memory_equal(j.got[t], j.want[t], CT_NUMEL * sizeof(float));
  }

  /* Applied once each (a Pull and the apply log), as many calls as
   * tensors answered OK at the end. */
  fps_client_t *direct = client_at(srv.addr);
  fps_shard_stats_t ss;
  assert_code(fps_client_stats(direct, &ss, 1, &st), 0, st);
  assert_code(fps_client_discover(direct, NULL, &st), 0, st);
  for (int t = 0; t < CT; t++) {
    fps_tensor_stats_t ts;
    fps_apply_record_t log[4];
    size_t len = 0;
    assert_code(fps_client_tensor_stats(direct, j.np[t], &ts, log, 4, &len, &st), 0, st);
    assert_int_equal(ts.version, 1);
    assert_int_equal(len, 1);
  }
  assert_code(fps_client_pull(c, j.np, j.got, v, CT, &st), 0, st);
  for (int t = 0; t < CT; t++) {
    assert_int_equal(v[t], 1);
    assert_memory_equal(j.got[t], j.want[t], CT_NUMEL * sizeof(float));
  }
  assert_true(ss.pushes >= CT); /* one call per tensor: really chunked */
  print_message("chunked, %s cut after %llu bytes: %d connection(s), updates %llu, pushes %llu, "
                "push_errors %llu\n",
                dir == CUT_TO_CLIENT ? "reply" : "request", (unsigned long long)after, accepted,
                (unsigned long long)ss.updates, (unsigned long long)ss.pushes,
                (unsigned long long)ss.push_errors);
  fps_client_destroy(direct);
  fps_client_destroy(c);
  proxy_stop(&p);
  chunk_job_free(&j);
  assert_int_equal(fps_test_server_stop(&srv), 0);
  assert_int_equal(fps_test_server_stop(&ref), 0);
}

/* The replies are cut after about three chunks' worth of parameters:
 * earlier chunks answered, one mid-reply (applied, reply lost), later
 * ones applied or still uploading. */
static void test_chunked_lost_reply(void **state) {
  (void)state;
  chunked_push_applies_once(CUT_TO_CLIENT, 700u * 1024u);
}

/* The request is cut after about four and a half chunks' worth of
 * gradients: the first chunks arrived whole (applied), one half, the rest
 * never started. */
static void test_chunked_lost_request(void **state) {
  (void)state;
  chunked_push_applies_once(CUT_TO_SHARD, 1100u * 1024u);
}

/* Shard 1 is SIGKILLed a quarter into its part of a chunked push (async,
 * 2 shards). The push fails UNAVAILABLE naming shard 1, within its
 * deadline; shard 0 applied each of its tensors once, with the values an
 * undisturbed pair of shards computes. */
static void test_chunked_shard_killed(void **state) {
  (void)state;
  fps_test_server_t srv[2], ref[2];
  chunk_job_t j;
  fps_status_t st;
  uint64_t v[CT];
  chunk_job_init(&j);
  assert_int_equal(fps_test_servers_start(srv, 2, "async", 1, NULL), 0);
  assert_int_equal(fps_test_servers_start(ref, 2, "async", 1, NULL), 0);
  chunk_reference(&j, ref, 2);

  proxy_t p;
  proxy_start(&p, srv[1].port);
  char addr1[64];
  snprintf(addr1, sizeof addr1, "127.0.0.1:%d", p.port);
  const char *addrs[2] = {srv[0].addr, addr1};
  fps_client_t *c = client_of(addrs, 2, 1, 10);
  assert_code(fps_client_create_tensors(c, j.defs, CT, &st), 0, st);
  pthread_mutex_lock(&p.mu);
  p.kill_pid = srv[1].pid;
  pthread_mutex_unlock(&p.mu);
  proxy_arm(&p, CUT_TO_SHARD, 256u * 1024u);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = chunk_push(c, &j, j.got, v, &st);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  print_message("push with shard 1 killed: %s after %.2f s: %s\n", fps_code_name(rc), took,
                st.message);
  assert_int_equal(rc, FPS_CODE_UNAVAILABLE);
  assert_int_equal(st.shard, 1);
  assert_true(took < 10 + 15 + 1); /* the deadline, plus the documented slack */

  /* Shard 0's tensors: applied once, as the reference. */
  int on0 = 0;
  for (int t = 0; t < CT; t++) {
    if (fps_client_shard_of(c, j.np[t]) != 0) continue;
    on0++;
    const char *names[1] = {j.np[t]};
    float *out[1] = {j.got[t]};
    uint64_t ver = 0;
    assert_code(fps_client_pull(c, names, out, &ver, 1, &st), 0, st);
    assert_int_equal(ver, 1);
    assert_memory_equal(j.got[t], j.want[t], CT_NUMEL * sizeof(float));
  }
  assert_true(on0 >= 2); /* several chunks on the surviving shard */
  fps_client_destroy(c);
  proxy_stop(&p);
  chunk_job_free(&j);
  fps_test_server_stop(&srv[1]); /* killed: its status is SIGKILL's */
  assert_int_equal(fps_test_server_stop(&srv[0]), 0);
  assert_int_equal(fps_test_server_stop(&ref[0]), 0);
  assert_int_equal(fps_test_server_stop(&ref[1]), 0);
}

static void teardown(void) { fps_test_servers_stop_all(); }

int main(int argc, char **argv) {
  atexit(teardown);
  const struct CMUnitTest all[] = {
      cmocka_unit_test(test_lost_reply),
      cmocka_unit_test(test_lost_request),
      cmocka_unit_test(test_chunked_lost_reply),
      cmocka_unit_test(test_chunked_lost_request),
      cmocka_unit_test(test_chunked_shard_killed),
  };
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return cmocka_run_group_tests(all, NULL, NULL);
}

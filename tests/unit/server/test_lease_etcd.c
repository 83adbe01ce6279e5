/* server/lease_etcd.c against a real etcd (Debian's etcd-server, started
 * here on loopback ports with a temporary data directory):
 *
 *   - a second holder waits while the first renews (past the TTL), and
 *     takes the lease at once when the first releases; terms grow;
 *   - a holder killed with SIGKILL frees the lease only when etcd expires
 *     it (after most of the TTL), never before;
 *   - a holder that names every member of a 3-member etcd keeps its lease
 *     while one member is stopped;
 *   - a holder whose etcd stops answering (SIGSTOP: a partition) or dies
 *     stops being valid before the TTL has passed since its etcd went
 *     away, so the next holder never overlaps it; after etcd is back the
 *     next holder (or the same one again) gets a higher term;
 *   - the standby-sync record: a new holder reads what the last one left
 *     ("alone" also from a holder killed after writing it), and a holder
 *     that let go cannot write it.
 *
 * A thread samples both holders every millisecond throughout: two valid
 * at once fails the test. Skips (exit 77 through CMocka's skip) only when
 * no etcd binary exists; scripts/deps.sh installs etcd-server with the
 * test packages, and tests/allowed-skips.txt does not list this test, so
 * scripts/test.sh fails if it skipped. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <cmocka.h>

#include "error.h"
#include "lease.h"

#define NS INT64_C(1000000000)
#define MS INT64_C(1000000)
/* The TTL asked of etcd: its minimum with the default election timeout. */
#define TTL_S 2

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * NS + ts.tv_nsec;
}

static void sleep_ns(int64_t ns) {
  struct timespec ts = {(time_t)(ns / NS), (long)(ns % NS)};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
  }
}

/* ------------------------------------------------------------- etcd */

typedef struct etcd_s {
  pid_t pid;
  char dir[64];
  int client_port, peer_port;
  char spec[128];
} etcd_t;

static etcd_t etcd;

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || getsockname(fd, (struct sockaddr *)&a, &len) < 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

static const char *etcd_binary(void) {
  const char *b = getenv("FPS_ETCD");
  if (b && *b && access(b, X_OK) == 0) return b;
  if (access("/usr/bin/etcd", X_OK) == 0) return "/usr/bin/etcd";
  return NULL;
}

/* One HTTP/1.0 request to 127.0.0.1:port (etcd serves HTTP and gRPC on
 * its client port); the answer (at most len - 1 bytes) in buf. */
static bool http_ask(int port, const char *req, char *buf, size_t len) {
  buf[0] = 0;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = false;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, strlen(req)) == (ssize_t)strlen(req)) {
    size_t got = 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    while (got < len - 1 && poll(&p, 1, 1000) == 1) {
      ssize_t n = read(fd, buf + got, len - 1 - got);
      if (n <= 0) break;
      got += (size_t)n;
    }
    buf[got] = 0;
    ok = got > 0;
  }
  close(fd);
  return ok;
}

/* GET /health answers {"health":"true"} once the member serves (it is
 * part of a quorum with a leader). */
static bool healthy(int port) {
  char buf[2048];
  return http_ask(port, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", buf, sizeof buf) &&
         strstr(buf, "\"health\":\"true\"") != NULL;
}

static bool etcd_healthy(void) { return healthy(etcd.client_port); }

/* Forks etcd as member `name` with its data in dir/data-<name>, its output
 * appended to dir/etcd-<name>.log. */
static pid_t etcd_spawn(const char *dir, const char *name, int client_port, int peer_port, const char *cluster) {
  char client[64], peer[64], data[128], logf[128];
  snprintf(client, sizeof client, "http://127.0.0.1:%d", client_port);
  snprintf(peer, sizeof peer, "http://127.0.0.1:%d", peer_port);
  snprintf(data, sizeof data, "%s/data-%s", dir, name);
  snprintf(logf, sizeof logf, "%s/etcd-%s.log", dir, name);
  const char *bin = etcd_binary();
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    /* Dies with the test, even one a sanitizer aborts before teardown. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(logf, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execl(bin, bin, "--name", name, "--data-dir", data, "--listen-client-urls", client, "--advertise-client-urls",
          client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster,
          "--initial-cluster-token", "fps-test", (char *)NULL);
    _exit(127);
  }
  return pid;
}

/* Starts etcd on etcd.dir and its ports (kept across a restart) and waits
 * (at most 20 s) until it is healthy. */
static void etcd_run(void) {
  char cluster[96];
  snprintf(cluster, sizeof cluster, "t=http://127.0.0.1:%d", etcd.peer_port);
  pid_t pid = etcd_spawn(etcd.dir, "t", etcd.client_port, etcd.peer_port, cluster);
  etcd.pid = pid;
  int64_t until = now_ns() + 20 * NS;
  while (!etcd_healthy()) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      etcd.pid = 0;
      fail_msg("etcd exited at start-up (see %s/etcd-t.log)", etcd.dir);
    }
    if (now_ns() > until) fail_msg("etcd not healthy within 20 s (see %s/etcd-t.log)", etcd.dir);
    sleep_ns(50 * MS);
  }
}

/* A 3-member cluster (for the member-loss case), beside `etcd`'s dir. */
#define MEMBERS 3
static struct {
  pid_t pid;
  int client_port, peer_port;
} member[MEMBERS];

static void cluster_run(void) {
  char cluster[256] = "";
  for (int i = 0; i < MEMBERS; i++) {
    member[i].client_port = free_port();
    member[i].peer_port = free_port();
    size_t n = strlen(cluster);
    snprintf(cluster + n, sizeof cluster - n, "%sm%d=http://127.0.0.1:%d", i ? "," : "", i, member[i].peer_port);
  }
  for (int i = 0; i < MEMBERS; i++) {
    char name[8];
    snprintf(name, sizeof name, "m%d", i);
    member[i].pid = etcd_spawn(etcd.dir, name, member[i].client_port, member[i].peer_port, cluster);
  }
  int64_t until = now_ns() + 30 * NS;
  for (int i = 0; i < MEMBERS; i++)
    while (!healthy(member[i].client_port)) {
      if (now_ns() > until) fail_msg("etcd member m%d not healthy within 30 s (see %s/etcd-m%d.log)", i, etcd.dir, i);
      sleep_ns(50 * MS);
    }
}

static void cluster_kill(void) {
  for (int i = 0; i < MEMBERS; i++)
    if (member[i].pid > 0) {
      kill(member[i].pid, SIGCONT);
      kill(member[i].pid, SIGKILL);
      waitpid(member[i].pid, NULL, 0);
      member[i].pid = 0;
    }
}

/* Whether member i is the raft leader: its Maintenance.Status (through
 * etcd's HTTP gateway) names itself as the leader. */
static bool is_leader(int i) {
  char buf[4096];
  const char req[] =
      "POST /v3/maintenance/status HTTP/1.0\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
  if (!http_ask(member[i].client_port, req, buf, sizeof buf)) return false;
  const char *m = strstr(buf, "\"member_id\":\""), *l = strstr(buf, "\"leader\":\"");
  if (!m || !l) return false;
  m += strlen("\"member_id\":\"");
  l += strlen("\"leader\":\"");
  size_t mn = strcspn(m, "\""), ln = strcspn(l, "\"");
  return mn == ln && !strncmp(m, l, mn);
}

static void etcd_kill(void) {
  if (etcd.pid <= 0) return;
  kill(etcd.pid, SIGCONT);
  kill(etcd.pid, SIGKILL);
  waitpid(etcd.pid, NULL, 0);
  etcd.pid = 0;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(p);
}

static int setup(void **state) {
  (void)state;
  memset(&etcd, 0, sizeof etcd);
  if (!etcd_binary()) return 0; /* each case skips */
  snprintf(etcd.dir, sizeof etcd.dir, "/tmp/fps_etcd_XXXXXX");
  if (!mkdtemp(etcd.dir)) return -1;
  etcd.client_port = free_port();
  etcd.peer_port = free_port();
  if (etcd.client_port <= 0 || etcd.peer_port <= 0 || etcd.client_port == etcd.peer_port) return -1;
  snprintf(etcd.spec, sizeof etcd.spec, "etcd:127.0.0.1:%d/factorps/test/shard-0", etcd.client_port);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  etcd_kill();
  cluster_kill();
  if (etcd.dir[0]) nftw(etcd.dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
  return 0;
}

static void need_etcd(void) {
  if (!etcd_binary()) skip(); /* scripts/deps.sh installs etcd-server */
  etcd_run();
}

/* ----------------------------------------------------------- holders */

/* Acquires on a thread, so the test can watch it wait. */
typedef struct holder_s {
  fps_lease_t *l;
  atomic_bool stop;
  atomic_bool done;
  int rc;
  uint64_t term;
  int64_t at; /* when acquire returned */
  pthread_t th;
  bool started;
} holder_t;

static void *holder_main(void *arg) {
  holder_t *h = arg;
  h->rc = fps_lease_acquire(h->l, &h->stop, &h->term);
  h->at = now_ns();
  atomic_store(&h->done, true);
  return NULL;
}

static void holder_open(holder_t *h, const char *name) {
  memset(h, 0, sizeof *h);
  atomic_init(&h->stop, false);
  atomic_init(&h->done, false);
  assert_int_equal(fps_lease_open(etcd.spec, TTL_S, name, &h->l), 0);
  assert_false(fps_lease_valid(h->l));
}

static void holder_start(holder_t *h) {
  atomic_store(&h->done, false);
  assert_int_equal(pthread_create(&h->th, NULL, holder_main, h), 0);
  h->started = true;
}

/* Waits (bounded) for the acquire thread to return. */
static bool holder_wait(holder_t *h, int64_t max_ns) {
  int64_t until = now_ns() + max_ns;
  while (!atomic_load(&h->done) && now_ns() < until) sleep_ns(2 * MS);
  if (!atomic_load(&h->done)) return false;
  pthread_join(h->th, NULL);
  h->started = false;
  return true;
}

static void holder_close(holder_t *h) {
  if (h->started) {
    atomic_store(&h->stop, true);
    assert_true(holder_wait(h, 5 * NS));
  }
  fps_lease_close(h->l);
  h->l = NULL;
}

/* Samples two holders every millisecond: both valid at once is the one
 * thing a lease must never allow. */
typedef struct watch_s {
  holder_t *a, *b;
  atomic_bool stop;
  atomic_int overlaps;
  pthread_t th;
} watch_t;

static void *watch_main(void *arg) {
  watch_t *w = arg;
  while (!atomic_load(&w->stop)) {
    if (w->a->l && w->b->l && fps_lease_valid(w->a->l) && fps_lease_valid(w->b->l)) atomic_fetch_add(&w->overlaps, 1);
    sleep_ns(MS);
  }
  return NULL;
}

static void watch_start(watch_t *w, holder_t *a, holder_t *b) {
  w->a = a;
  w->b = b;
  atomic_init(&w->stop, false);
  atomic_init(&w->overlaps, 0);
  assert_int_equal(pthread_create(&w->th, NULL, watch_main, w), 0);
}

static void watch_end(watch_t *w) {
  atomic_store(&w->stop, true);
  pthread_join(w->th, NULL);
  assert_int_equal(atomic_load(&w->overlaps), 0);
}

/* ------------------------------------------------------------- cases */

/* B waits while A renews past its TTL; A's release hands over at once. */
static void test_release_hands_over(void **state) {
  (void)state;
  need_etcd();
  holder_t a, b;
  holder_open(&a, "127.0.0.1:1");
  holder_open(&b, "127.0.0.1:2");
  assert_int_equal(fps_lease_acquire(a.l, &a.stop, &a.term), 0);
  assert_true(fps_lease_valid(a.l));
  assert_true(a.term > 0);
  watch_t w;
  watch_start(&w, &a, &b);
  holder_start(&b);
  /* Twice the TTL: A stays valid only because it renews. */
  int64_t until = now_ns() + 2 * TTL_S * NS;
  while (now_ns() < until) {
    assert_true(fps_lease_valid(a.l));
    assert_false(atomic_load(&b.done));
    sleep_ns(20 * MS);
  }
  int64_t released = now_ns();
  fps_lease_release(a.l);
  assert_false(fps_lease_valid(a.l));
  assert_true(holder_wait(&b, 5 * NS));
  assert_int_equal(b.rc, 0);
  assert_true(fps_lease_valid(b.l));
  assert_true(b.term > a.term);
  /* No term past the store's revision was granted: read by the holder
   * and by the replica that lost it alike. */
  uint64_t newest = 0;
  assert_int_equal(fps_lease_newest_term(a.l, &newest), 0);
  assert_true(newest >= b.term);
  assert_int_equal(fps_lease_newest_term(b.l, &newest), 0);
  assert_true(newest >= b.term);
  /* A revoke frees the key: one poll, not a TTL. */
  print_message("release to takeover: %.0f ms (TTL %d s)\n", (double)(b.at - released) / MS, TTL_S);
  assert_true(b.at - released < TTL_S * NS / 2);
  /* A, acquiring again, waits for B and then gets a higher term still. */
  holder_start(&a);
  sleep_ns(300 * MS);
  assert_false(atomic_load(&a.done));
  fps_lease_release(b.l);
  assert_true(holder_wait(&a, 5 * NS));
  assert_int_equal(a.rc, 0);
  assert_true(a.term > b.term);
  watch_end(&w);
  holder_close(&a);
  holder_close(&b);
}

/* The holder in another process, killed: the key goes when etcd expires
 * it, not before. argv: --hold SPEC, or --hold-alone SPEC: "alone" goes on
 * its sync record first (a primary that dropped its standby). */
static int hold_main(const char *spec, bool alone) {
  fps_lease_t *l;
  if (fps_lease_open(spec, TTL_S, "127.0.0.1:9", &l) < 0) return 2;
  uint64_t term;
  if (fps_lease_acquire(l, NULL, &term) < 0) return 3;
  if (alone && fps_lease_set_sync(l, false) < 0) return 5;
  printf("term %llu\n", (unsigned long long)term);
  fflush(stdout);
  /* Renews until killed (bounded, should the test die first). */
  for (int i = 0; i < 600 && fps_lease_valid(l); i++) sleep_ns(100 * MS);
  return 4;
}

static char *self_path;

/* Starts hold_main in a child (flag: --hold or --hold-alone); returns its
 * term once it holds the lease. */
static unsigned long long holder_process(const char *flag, pid_t *out) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], 1);
    close(fds[0]);
    execl(self_path, self_path, flag, etcd.spec, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char line[64] = {0};
  size_t got = 0;
  struct pollfd p = {.fd = fds[0], .events = POLLIN};
  int64_t until = now_ns() + 15 * NS;
  while (!memchr(line, '\n', got) && got < sizeof line - 1 && now_ns() < until) {
    if (poll(&p, 1, 100) != 1) continue;
    ssize_t n = read(fds[0], line + got, sizeof line - 1 - got);
    if (n <= 0) break;
    got += (size_t)n;
  }
  close(fds[0]);
  unsigned long long t1 = 0;
  if (sscanf(line, "term %llu", &t1) != 1) {
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    fail_msg("the holder process did not report its term: '%s'", line);
  }
  *out = child;
  return t1;
}

static void test_killed_holder_frees_after_ttl(void **state) {
  (void)state;
  need_etcd();
  pid_t child;
  unsigned long long t1 = holder_process("--hold", &child);
  holder_t b;
  holder_open(&b, "127.0.0.1:2");
  holder_start(&b);
  /* Longer than the TTL: the child renews, B waits. */
  sleep_ns(TTL_S * NS + 500 * MS);
  bool early = atomic_load(&b.done);
  int64_t killed = now_ns();
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  assert_false(early);
  assert_true(holder_wait(&b, (TTL_S + 5) * NS));
  assert_int_equal(b.rc, 0);
  assert_true(b.term > t1);
  double ms = (double)(b.at - killed) / MS;
  print_message("SIGKILL of the holder to takeover: %.0f ms (TTL %d s)\n", ms, TTL_S);
  /* The child renewed at most TTL/3 before the kill, so etcd kept the key
   * at least 2/3 of the TTL more; and gave it up within TTL + a poll +
   * etcd's 500 ms expiry scan (+ slack for a loaded machine). */
  assert_true(b.at - killed >= TTL_S * NS / 2);
  assert_true(b.at - killed <= TTL_S * NS + 2 * NS);
  holder_close(&b);
}

/* The standby-sync record (lease.h): a new holder reads what the last
 * holder left (none yet: in sync); a holder that released can no longer
 * write it; "alone" written by a holder that then dies (SIGKILL) is what
 * its successor finds, after the TTL. */
static void test_sync_record(void **state) {
  (void)state;
  need_etcd();
  holder_t a, b;
  holder_open(&a, "127.0.0.1:1");
  holder_open(&b, "127.0.0.1:2");
  assert_int_equal(fps_lease_acquire(a.l, &a.stop, &a.term), 0);
  assert_int_equal(fps_lease_get_sync(a.l), 1);
  assert_int_equal(fps_lease_set_sync(a.l, false), 0);
  assert_int_equal(fps_lease_set_sync(a.l, true), 0);
  assert_int_equal(fps_lease_set_sync(a.l, false), 0);
  fps_lease_release(a.l);
  assert_int_equal(fps_lease_set_sync(a.l, true), FPS_EIO); /* not held: not written */
  assert_int_equal(fps_lease_acquire(b.l, &b.stop, &b.term), 0);
  assert_true(b.term > a.term);
  assert_int_equal(fps_lease_get_sync(b.l), 0); /* A answered alone last */
  assert_int_equal(fps_lease_set_sync(b.l, true), 0);
  fps_lease_release(b.l);
  assert_int_equal(fps_lease_acquire(a.l, &a.stop, &a.term), 0);
  assert_int_equal(fps_lease_get_sync(a.l), 1);
  fps_lease_release(a.l);
  /* A primary that recorded "alone", then died. */
  pid_t child;
  unsigned long long t1 = holder_process("--hold-alone", &child);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  holder_start(&b);
  assert_true(holder_wait(&b, (TTL_S + 5) * NS));
  assert_int_equal(b.rc, 0);
  assert_true(b.term > t1);
  assert_int_equal(fps_lease_get_sync(b.l), 0);
  holder_close(&a);
  holder_close(&b);
}

/* etcd stops answering (SIGSTOP): the holder is invalid before the TTL
 * has passed since the stop; the next holder, once etcd answers again,
 * comes after that and gets a higher term. */
static void test_partitioned_holder_stops_before_ttl(void **state) {
  (void)state;
  need_etcd();
  holder_t a, b;
  holder_open(&a, "127.0.0.1:1");
  holder_open(&b, "127.0.0.1:2");
  assert_int_equal(fps_lease_acquire(a.l, &a.stop, &a.term), 0);
  watch_t w;
  watch_start(&w, &a, &b);
  holder_start(&b);
  sleep_ns(TTL_S * NS / 2);
  assert_true(fps_lease_valid(a.l));
  int64_t stopped = now_ns();
  assert_int_equal(kill(etcd.pid, SIGSTOP), 0);
  int64_t invalid = 0;
  while (now_ns() < stopped + 3 * TTL_S * NS) {
    if (!fps_lease_valid(a.l)) {
      invalid = now_ns();
      break;
    }
    sleep_ns(MS);
  }
  assert_true(invalid > 0);
  print_message("etcd stopped to holder invalid: %.0f ms (TTL %d s)\n", (double)(invalid - stopped) / MS, TTL_S);
  /* Its last renewal was sent before the stop: valid until then + TTL -
   * margin at the latest. */
  assert_true(invalid < stopped + TTL_S * NS);
  /* Stay stopped past the TTL: etcd must expire A's lease on its own
   * clock once it runs again. */
  sleep_ns(TTL_S * NS);
  assert_false(atomic_load(&b.done));
  assert_int_equal(kill(etcd.pid, SIGCONT), 0);
  assert_true(holder_wait(&b, (2 * TTL_S + 5) * NS));
  assert_int_equal(b.rc, 0);
  assert_true(b.at > invalid);
  assert_true(b.term > a.term);
  /* A never comes back by itself. */
  sleep_ns(TTL_S * NS / 2);
  assert_false(fps_lease_valid(a.l));
  watch_end(&w);
  holder_close(&a);
  holder_close(&b);
}

/* etcd dies: the holder is invalid before the TTL; after etcd restarts
 * (same data: A's lease still exists there), A acquires again, with a
 * higher term, once its lost lease is revoked or expired. */
static void test_etcd_killed_then_back(void **state) {
  (void)state;
  need_etcd();
  holder_t a;
  holder_open(&a, "127.0.0.1:1");
  assert_int_equal(fps_lease_acquire(a.l, &a.stop, &a.term), 0);
  sleep_ns(TTL_S * NS / 2);
  int64_t killed = now_ns();
  etcd_kill();
  while (fps_lease_valid(a.l) && now_ns() < killed + 3 * TTL_S * NS) sleep_ns(MS);
  int64_t invalid = now_ns();
  assert_false(fps_lease_valid(a.l));
  assert_true(invalid < killed + TTL_S * NS);
  etcd_run();
  uint64_t first = a.term;
  holder_start(&a);
  assert_true(holder_wait(&a, (2 * TTL_S + 10) * NS));
  assert_int_equal(a.rc, 0);
  assert_true(a.term > first);
  assert_true(fps_lease_valid(a.l));
  holder_close(&a);
}

/* A 3-member etcd with one follower SIGSTOPped (alive, accepting
 * connections, answering nothing): a holder that names every member keeps
 * its lease, because its retries go to the other members; and it names
 * the stopped member first, which is where gRPC's default policy
 * (pick_first) would have kept sending every renewal. */
static void test_stopped_member_keeps_the_lease(void **state) {
  (void)state;
  if (!etcd_binary()) skip();
  cluster_run();
  int stop = -1;
  int64_t until = now_ns() + 10 * NS;
  while (stop < 0 && now_ns() < until) {
    for (int i = 0; i < MEMBERS && stop < 0; i++)
      if (is_leader(i)) stop = (i + 1) % MEMBERS; /* a follower */
    if (stop < 0) sleep_ns(50 * MS);
  }
  assert_true(stop >= 0);
  char spec[256];
  int n = snprintf(spec, sizeof spec, "etcd:ipv4:127.0.0.1:%d", member[stop].client_port);
  for (int i = 0; i < MEMBERS; i++)
    if (i != stop) n += snprintf(spec + n, sizeof spec - (size_t)n, ",127.0.0.1:%d", member[i].client_port);
  snprintf(spec + n, sizeof spec - (size_t)n, "/factorps/test/shard-0");
  fps_lease_t *l;
  assert_int_equal(fps_lease_open(spec, TTL_S, "127.0.0.1:1", &l), 0);
  uint64_t term;
  assert_int_equal(fps_lease_acquire(l, NULL, &term), 0);
  assert_int_equal(kill(member[stop].pid, SIGSTOP), 0);
  /* Three TTLs with the member stopped: valid at every sample. */
  int64_t end = now_ns() + 3 * TTL_S * NS;
  int invalid = 0;
  while (now_ns() < end) {
    if (!fps_lease_valid(l)) invalid++;
    sleep_ns(5 * MS);
  }
  kill(member[stop].pid, SIGCONT);
  assert_int_equal(invalid, 0);
  fps_lease_close(l);
}

/* No etcd at the address: acquire keeps trying and ends on stop; the
 * TTL bounds are checked at open (--lease-ttl's range, rounded up). */
static void test_unreachable_and_bad_ttl(void **state) {
  (void)state;
  if (!etcd_binary()) skip();
  holder_t a;
  holder_open(&a, "127.0.0.1:1"); /* etcd.spec: a port nothing listens on */
  holder_start(&a);
  sleep_ns(500 * MS);
  assert_false(atomic_load(&a.done));
  int64_t stop = now_ns();
  atomic_store(&a.stop, true);
  assert_true(holder_wait(&a, 3 * NS));
  assert_int_equal(a.rc, FPS_ECANCELLED);
  assert_true(a.at - stop < NS);
  assert_false(fps_lease_valid(a.l));
  uint64_t newest = 0;
  assert_int_equal(fps_lease_newest_term(a.l, &newest), FPS_EIO); /* within the call deadline */
  fps_lease_close(a.l);
  fps_lease_t *l = (fps_lease_t *)1;
  const double bad[] = {0, -1, 7200, 0.0 / 0.0};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    l = (fps_lease_t *)1;
    assert_int_equal(fps_lease_open(etcd.spec, bad[i], NULL, &l), FPS_EINVAL);
    assert_null(l);
  }
  /* --lease-ttl allows 0.1: etcd counts whole seconds, so it is rounded up. */
  assert_int_equal(fps_lease_open(etcd.spec, 0.1, NULL, &l), 0);
  fps_lease_close(l);
}

/* argv[1], if given, runs only the cases whose name matches (each is its
 * own CTest test, with its own etcd); "--hold SPEC" is the child above. */
int main(int argc, char **argv) {
  self_path = argv[0];
  if (argc == 3 && !strcmp(argv[1], "--hold")) return hold_main(argv[2], false);
  if (argc == 3 && !strcmp(argv[1], "--hold-alone")) return hold_main(argv[2], true);
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_release_hands_over, setup, teardown),
      cmocka_unit_test_setup_teardown(test_killed_holder_frees_after_ttl, setup, teardown),
      cmocka_unit_test_setup_teardown(test_partitioned_holder_stops_before_ttl, setup, teardown),
      cmocka_unit_test_setup_teardown(test_etcd_killed_then_back, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stopped_member_keeps_the_lease, setup, teardown),
      cmocka_unit_test_setup_teardown(test_unreachable_and_bad_ttl, setup, teardown),
      cmocka_unit_test_setup_teardown(test_sync_record, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

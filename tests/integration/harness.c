/* Starting and stopping real factorps-server processes for tests. */
#include "harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Every live server, so atexit can stop them. */
static pid_t live[64];
static size_t n_live;
static int atexit_done;

static void remember(pid_t pid) {
  if (n_live < sizeof live / sizeof live[0]) live[n_live++] = pid;
}

static void forget(pid_t pid) {
  for (size_t i = 0; i < n_live; i++)
    if (live[i] == pid) live[i] = live[--n_live];
}

void fps_test_servers_stop_all(void) {
  while (n_live) {
    fps_test_server_t s = {.pid = live[n_live - 1]};
    fps_test_server_stop(&s);
  }
}

const char *fps_test_server_path(void) {
  const char *p = getenv("FPS_SERVER");
  return p && *p ? p : NULL;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int read_port(const char *path) {
  FILE *f = fopen(path, "r");
  int port = 0;
  if (!f) return 0;
  if (fscanf(f, "%d", &port) != 1) port = 0;
  fclose(f);
  return port;
}

int fps_test_server_start(fps_test_server_t *s, int shard_id, int shard_count, const char *mode,
                          int workers, const char *const *extra) {
  const char *bin = fps_test_server_path();
  char port_file[256], id[16], count[16], w[16];
  const char *argv[64];
  size_t a = 0;
  static int seq;

  memset(s, 0, sizeof *s);
  if (!bin) {
    fprintf(stderr, "harness: FPS_SERVER is not set\n");
    return -1;
  }
  if (!atexit_done) {
    atexit(fps_test_servers_stop_all);
    atexit_done = 1;
  }
  const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  snprintf(port_file, sizeof port_file, "%s/fps-it-%d-%d.port", tmp, (int)getpid(), seq);
  snprintf(s->log, sizeof s->log, "%s/fps-it-%d-%d.log", tmp, (int)getpid(), seq);
  seq++;
  unlink(port_file);
  snprintf(id, sizeof id, "%d", shard_id);
  snprintf(count, sizeof count, "%d", shard_count);
  snprintf(w, sizeof w, "%d", workers);
  argv[a++] = bin;
  argv[a++] = "--listen=127.0.0.1:0";
  argv[a++] = "--shard-id";
  argv[a++] = id;
  argv[a++] = "--shard-count";
  argv[a++] = count;
  argv[a++] = "--mode";
  argv[a++] = mode;
  argv[a++] = "--workers";
  argv[a++] = w;
  argv[a++] = "--port-file";
  argv[a++] = port_file;
  for (size_t i = 0; extra && extra[i] && a < 62; i++) argv[a++] = extra[i];
  argv[a] = NULL;

  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("harness: fork");
    return -1;
  }
  if (pid == 0) {
    /* Die with the test, whatever kills it. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(bin, (char *const *)argv);
    perror("harness: exec factorps-server");
    _exit(127);
  }
  s->pid = pid;
  remember(pid);
  for (int i = 0; i < 1500; i++) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      fprintf(stderr, "harness: factorps-server exited early (status %d); log %s\n", st, s->log);
      forget(pid);
      s->pid = 0;
      return -1;
    }
    if ((s->port = read_port(port_file)) > 0) break;
    sleep_ms(10);
  }
  unlink(port_file);
  if (s->port <= 0) {
    fprintf(stderr, "harness: factorps-server wrote no port within 15 s; log %s\n", s->log);
    fps_test_server_stop(s);
    return -1;
  }
  snprintf(s->addr, sizeof s->addr, "127.0.0.1:%d", s->port);
  return 0;
}

int fps_test_servers_start(fps_test_server_t *s, int n, const char *mode, int workers,
                           const char *const *extra) {
  for (int i = 0; i < n; i++)
    if (fps_test_server_start(&s[i], i, n, mode, workers, extra)) {
      for (int j = 0; j < i; j++) fps_test_server_stop(&s[j]);
      return -1;
    }
  return 0;
}

int fps_test_server_stop(fps_test_server_t *s) {
  int st = -1;
  if (s->pid <= 0) return 0;
  kill(s->pid, SIGTERM);
  /* Longer than the server's own shutdown grace (5 s for calls in flight)
   * plus freeing large tensors on a loaded machine. */
  for (int i = 0; i < 2000; i++) {
    if (waitpid(s->pid, &st, WNOHANG) == s->pid) goto done;
    sleep_ms(10);
  }
  fprintf(stderr, "harness: factorps-server %d ignored SIGTERM for 20 s; killing it\n",
          (int)s->pid);
  kill(s->pid, SIGKILL);
  waitpid(s->pid, NULL, 0);
  st = -1;
done:
  forget(s->pid);
  s->pid = 0;
  /* A clean exit leaves nothing worth reading; keep the log otherwise. */
  if (st == 0)
    unlink(s->log);
  else
    fprintf(stderr, "harness: factorps-server exit status %d; log %s\n", st, s->log);
  return st;
}

int fps_test_dead_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  int port = 0;
  if (fd < 0) return 1;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
    port = ntohs(sa.sin_port);
  close(fd);
  return port ? port : 1;
}

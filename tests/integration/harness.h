/* Integration-test harness: starts real factorps-server processes on
 * 127.0.0.1:0 and learns their ports from --port-file.
 *
 * Servers never outlive the test: each child asks the kernel to kill it when
 * the test process dies (PR_SET_PDEATHSIG, which also covers a CTest
 * timeout's SIGKILL), and fps_test_servers_stop_all() runs from atexit and
 * from every test's teardown. */
#ifndef FPS_TEST_HARNESS_H
#define FPS_TEST_HARNESS_H

#include <stddef.h>
#include <sys/types.h>

#define FPS_TEST_MAX_SERVERS 8

typedef struct fps_test_server_s {
  pid_t pid;
  int port;
  char addr[64];                       /* "127.0.0.1:port" */
  char log[256];                       /* its stdout+stderr */
} fps_test_server_t;

/* The server binary: $FPS_SERVER (CMake passes $<TARGET_FILE:...>). */
const char *fps_test_server_path(void);

/* Starts one shard with extra flags (NULL-terminated list, may be NULL).
 * Returns 0, or -1 after printing why (binary missing, exited early, no
 * port within 15 s). */
int fps_test_server_start(fps_test_server_t *s, int shard_id, int shard_count, const char *mode,
                          int workers, const char *const *extra);

/* Starts `n` shards 0..n-1 of one job. */
int fps_test_servers_start(fps_test_server_t *s, int n, const char *mode, int workers,
                           const char *const *extra);

/* SIGTERM, wait up to 5 s, then SIGKILL. Returns the exit status as
 * waitpid() reports it, or -1 if it had to be killed. Idempotent. */
int fps_test_server_stop(fps_test_server_t *s);
void fps_test_servers_stop_all(void);

/* A loopback port nothing listens on (bound, then closed). */
int fps_test_dead_port(void);

#endif

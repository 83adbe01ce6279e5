/* A stand-alone host for the metrics endpoint: a synthetic registry (two
 * tensors' state, some RPCs) plus a thread that keeps counting PushPulls the
 * way gRPC threads would, so the HTTP tests can check that abuse of the
 * endpoint never stops the counting path.
 *
 *   metrics_test_server [--listen ADDR] [--timeout-ms N] [--max-conns N] [--ready]
 * Prints "port <n>" on stdout once listening. SIGUSR1 toggles readiness;
 * SIGTERM/SIGINT stop it cleanly (exit 0). */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "metrics.h"

static atomic_bool stop_counting;

static void *fake_rpc_thread(void *arg) {
  (void)arg;
  struct timespec ts = {0, 1000000};
  while (!atomic_load(&stop_counting)) {
    fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, 0, 0.0005, 64 * 33 * 4, 64 * 33 * 4);
    fps_metrics_update_observe(0.0001, 5 * 64 * 33 * 4);
    nanosleep(&ts, NULL);
  }
  return NULL;
}

int main(int argc, char **argv) {
  const char *listen = "127.0.0.1:0";
  fps_metrics_http_opts_t ho = {0};
  bool ready = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc)
      listen = argv[++i];
    else if (strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc)
      ho.request_timeout_ms = (unsigned)atoi(argv[++i]);
    else if (strcmp(argv[i], "--max-conns") == 0 && i + 1 < argc)
      ho.max_connections = (unsigned)atoi(argv[++i]);
    else if (strcmp(argv[i], "--ready") == 0)
      ready = true;
    else {
      fprintf(stderr, "usage: %s [--listen ADDR] [--timeout-ms N] [--max-conns N] [--ready]\n",
              argv[0]);
      return 2;
    }
  }
  /* 1000 simultaneous connections need more descriptors than the usual 1024. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }

  fps_metrics_config_t mc = {.shard_id = 3, .shard_count = 4, .mode = "sync", .workers = 2,
                             .simd = "test\"simd"};
  fps_metrics_init(&mc);
  /* Tensors "w" 64x33 (factored: 64 row + 33 col) and "b" 7 (var 7), hf with
   * beta1 (momentum = numel). */
  fps_metrics_state_t w = {.tensors = 1, .param_elements = 64 * 33, .row = 64, .col = 33,
                           .mom = 64 * 33, .adamw_elements = 2 * 64 * 33};
  fps_metrics_state_t b = {.tensors = 1, .param_elements = 7, .var = 7, .mom = 7,
                           .adamw_elements = 14};
  fps_metrics_state_add(&w);
  fps_metrics_state_add(&b);
  fps_metrics_rpc_observe(FPS_METRICS_CREATE, 0, 0.002, 64 * 33 * 4 + 28, 0);
  fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, 9, 0.0001, 0, 0);
  fps_metrics_step_observe(2, 0.003);
  fps_metrics_staleness_observe(1);
  fps_metrics_ready_set(ready);

  /* Block the signals before any thread exists so only sigwait sees them. */
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, NULL);

  ho.listen = listen;
  fps_metrics_http_t *http = NULL;
  int rc = fps_metrics_http_start(&ho, &http);
  if (rc < 0) {
    fprintf(stderr, "metrics_test_server: start failed (%d)\n", rc);
    return 1;
  }
  pthread_t th;
  pthread_create(&th, NULL, fake_rpc_thread, NULL);
  printf("port %d\n", fps_metrics_http_port(http));
  fflush(stdout);

  for (;;) {
    int sig = 0;
    sigwait(&set, &sig);
    if (sig == SIGUSR1) {
      ready = !ready;
      fps_metrics_ready_set(ready);
      continue;
    }
    break;
  }
  atomic_store(&stop_counting, true);
  pthread_join(th, NULL);
  fps_metrics_http_stop(http);
  return 0;
}

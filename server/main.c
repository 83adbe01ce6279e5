/* factorps-server: one shard of a factorps parameter server.
 *
 * Start-up: config, malloc tuning, signals blocked before grpc_init (gRPC
 * starts threads that must not receive them), kernels, store, timer, gRPC.
 * With --checkpoint-dir, the newest valid checkpoint is loaded before gRPC
 * starts (exit 3 if --require-checkpoint and none is valid).
 * Then the main thread waits in sigwait(); SIGTERM/SIGINT stops accepting
 * calls, fails parked calls with UNAVAILABLE, gives in-flight calls a grace
 * period (0.5 s), cancels the rest, writes a final checkpoint (with a
 * --checkpoint-dir), frees everything and exits 0, within 1 s plus the
 * checkpoint's write time (gRPC's own teardown is bounded too). */
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc.h>

#include "alloc.h"
#include "metrics.h"
#include "peer.h"
#include "replica.h"
#include "server.h"

/* SIGTERM to exit: in-flight calls get this long to finish (then they are
 * cancelled), and gRPC's own teardown this long (see fps__grpc_teardown),
 * so the shard exits within 1 s plus its final checkpoint's write time. */
#define FPS_SHUTDOWN_GRACE_S 0.5
#define FPS_TEARDOWN_WAIT_S 0.1
/* How long cancelled Exchange calls get to finish at shutdown. */
#define FPS_PEERS_STOP_WAIT_S 0.2

/* LSan's own end-of-process check, present only under ASan. */
extern void __lsan_do_leak_check(void) __attribute__((weak));

typedef struct fps_teardown_s {
  pthread_mutex_t mu;
  pthread_cond_t cv;                /* CLOCK_MONOTONIC */
  bool done;
} fps_teardown_t;

static void *fps__teardown_main(void *arg) {
  fps_teardown_t *td = arg;
  grpc_shutdown_blocking();
  pthread_mutex_lock(&td->mu);
  td->done = true;
  pthread_cond_broadcast(&td->cv);
  pthread_mutex_unlock(&td->mu);
  return NULL;
}

/* gRPC's global teardown (grpc_shutdown_blocking) joins its executor
 * threads, and one of them can sit for up to 10 s in epoll_wait: the TCP
 * backup poller that covered a large reply's write, which nothing wakes
 * once the connections are gone (its 10 s timeout is fixed in gRPC 1.51).
 * Everything of the shard is finished and freed by then (server, queue,
 * pollers, final checkpoint), so the teardown runs on its own thread and
 * gets FPS_TEARDOWN_WAIT_S: true if it finished, false if the caller
 * should leave with _exit() (no C++ static destructors under gRPC's running
 * threads). */
static bool fps__grpc_teardown(double wait_s) {
  static fps_teardown_t td = {.mu = PTHREAD_MUTEX_INITIALIZER};
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&td.cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_t th;
  if (pthread_create(&th, NULL, fps__teardown_main, &td) != 0) {
    grpc_shutdown_blocking();
    return true;
  }
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  long ns = (long)(wait_s * 1e9);
  until.tv_sec += ns / 1000000000L;
  until.tv_nsec += ns % 1000000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&td.mu);
  while (!td.done && pthread_cond_timedwait(&td.cv, &td.mu, &until) == 0) {
  }
  bool done = td.done;
  pthread_mutex_unlock(&td.mu);
  if (done) pthread_join(th, NULL);
  else pthread_detach(th);
  return done;
}

/* /metrics' collect hook: factorps_state_checksum (a pass over each
 * tensor's parameters and state per scrape: about a tenth of a second
 * per GB). */
static void fps__collect_checksum(void *arg) {
  fps_metrics_state_checksum_set(fps_shard_state_checksum(((fps_server_t *)arg)->shard));
}

/* /readyz: serving, and for a replica, primary or joined standby. */
static bool fps__ready(void *arg) { return fps_replica_ready(((fps_server_t *)arg)->replica); }

static void fps__dump_line(const char *line) { FPS_LOG(FPS_LOG_DEBUG, "config %s", line); }

static int fps__write_port_file(const char *path, int port) {
  /* Write then rename, so a test polling the file never reads half of it. */
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return FPS_EIO;
  int ok = fprintf(f, "%d\n", port) > 0;
  ok &= fclose(f) == 0;
  if (!ok || rename(tmp, path) != 0) {
    unlink(tmp);
    return FPS_EIO;
  }
  return 0;
}

int main(int argc, char **argv) {
  static fps_server_t srv;
  int rc = fps_config_load(&srv.cfg, argc, argv);
  if (rc == 1) return 0;
  if (rc < 0) return 2;

  if (srv.cfg.malloc_tune) {
    /* Large messages: freshly mmapped buffers cost a page fault per 4 KiB
     * on first touch. One arena, no mmap threshold and no trimming keep
     * tensor-sized buffers in the heap for reuse (measured 2-3x for
     * 1-64 MiB messages, see the README). */
    /* M_MMAP_THRESHOLD is capped at 32 MiB by glibc (a larger value is
     * ignored), so mmap is switched off with M_MMAP_MAX = 0 instead. */
    if (!mallopt(M_ARENA_MAX, 1) || !mallopt(M_MMAP_MAX, 0) || !mallopt(M_TRIM_THRESHOLD, -1) ||
        !mallopt(M_TOP_PAD, 64 << 20))
      FPS_LOG(FPS_LOG_DEBUG, "mallopt tuning was refused (normal under ASan); continuing untuned");
  }

  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);
  signal(SIGPIPE, SIG_IGN);

  char why[256] = "";
  const fps_kernels_t *kernels = NULL;
  fps_pool_t *pool = NULL; /* splits large tensors' updates */
  /* cfg.simd already holds FACTORPS_SIMD overridden by --simd (config.c):
   * reading the environment again here would let it beat the flag. */
  rc = fps_kernels_by_name(*srv.cfg.simd ? srv.cfg.simd : "auto", &kernels, why, sizeof why);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--simd %s: %s", srv.cfg.simd, why);
    fps_config_free(&srv.cfg);
    return 2;
  }
  fps_config_dump(&srv.cfg, fps__dump_line);
  if (srv.cfg.kernel_threads != 1 && fps_pool_create(&pool, srv.cfg.kernel_threads) < 0) {
    /* Not fatal: updates run on the calling thread, just slower. */
    FPS_LOG(FPS_LOG_WARN, "cannot start %u kernel threads; large updates run single-threaded",
             srv.cfg.kernel_threads);
    pool = NULL;
  }
  fps_metrics_config_t mcfg = {.shard_id = srv.cfg.shard_id, .shard_count = srv.cfg.shard_count,
                               .mode = fps_mode_name(srv.cfg.mode), .workers = srv.cfg.workers,
                               .staleness = srv.cfg.staleness,
                               .simd = fps_kernels_name(kernels), .version = FPS_VERSION,
                               .checkpoint_interval = *srv.cfg.checkpoint_dir ? srv.cfg.checkpoint_interval : 0};
  fps_metrics_init(&mcfg);
  fps_metrics_http_t *http = NULL;

  pthread_mutex_init(&srv.calls_mu, NULL);
  pthread_rwlock_init(&srv.batch_gate, NULL);
  srv.decode.limit = srv.cfg.max_decode_bytes;
  fps_shard_opts_t opts;
  fps_config_shard_opts(&srv.cfg, &opts);
  if (fps_shard_new(&opts, kernels, pool, &srv.shard) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "out of memory");
    return 1;
  }

  grpc_init();
  int exit_code = 0;
  bool ckpt_on_exit = false;
  /* The calling side of Exchange: bad peer files stop the start (exit 2,
   * as any bad flag) before anything listens. */
  fps_peers_t *peers = NULL;
  if (*srv.cfg.peers) {
    if (fps_peers_create(&srv.cfg, &peers) < 0) {
      exit_code = 2;
      goto out;
    }
    fps_shard_set_exchange(srv.shard, fps_peers_send, peers, srv.cfg.exchange_deadline);
  }
  /* Standby replicas: the lease is opened now (a bad --lease stops the
   * start), taken once gRPC serves. */
  if (fps_replica_create(&srv, &srv.replica) < 0) {
    exit_code = 2;
    goto out;
  }
  /* The deadline thread runs the hooks of rounds, ssp waits and calls. */
  if (fps_timer_create(&srv.timer, 0) < 0 || fps_timer_add(srv.timer, fps_shard_expire, srv.shard) < 0 ||
      fps_timer_add(srv.timer, fps_calls_expire, &srv) < 0 || fps_timer_start(srv.timer) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot start the timer thread");
    exit_code = 1;
    goto out;
  }
  /* Health first: /healthz answers (and /readyz says 503) while gRPC starts. */
  if (*srv.cfg.metrics_listen) {
    fps_metrics_http_opts_t ho = {.listen = srv.cfg.metrics_listen,
                                  .port_file = srv.cfg.metrics_port_file,
                                  .collect = fps__collect_checksum, .ready = fps__ready, .arg = &srv};
    if (fps_metrics_http_start(&ho, &http) < 0) {
      FPS_LOG(FPS_LOG_ERROR, "cannot serve --metrics-listen '%s'", srv.cfg.metrics_listen);
      exit_code = 1;
      goto out;
    }
  }
  /* Restore after /healthz is up (a large restore takes a while and must
   * not look like a dead process to a liveness probe) and before gRPC, so
   * no call can see the empty shard that a restarted one briefly is;
   * /readyz says 503 until the end of start-up. */
  rc = fps_checkpoint_open(srv.shard);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "%s",
            rc == FPS_ENOTFOUND ? "no valid checkpoint to load and --require-checkpoint is set; not starting"
                                : "cannot restore from --checkpoint-dir (see the log above); not starting");
    exit_code = rc == FPS_ENOTFOUND ? 3 : 1;
    goto out;
  }
  if (fps_rpc_checkpoint_init(&srv) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot start the Checkpoint writer thread");
    exit_code = 1;
    goto out;
  }
  if (fps_grpc_start(&srv) < 0) {
    /* Bad TLS files or token files (no security was set up: srv.auth is
     * still NULL) are bad flags, exit 2 like the peers' files; a listen
     * address gRPC cannot bind (a port in use) is 1. */
    exit_code = srv.auth ? 1 : 2;
    goto out;
  }
  if (srv.cfg.port_file && *srv.cfg.port_file && fps__write_port_file(srv.cfg.port_file, srv.port) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot write --port-file '%s'", srv.cfg.port_file);
    exit_code = 1;
    goto out;
  }
  {
    /* The listen address with the bound port (port 0 picks one); a
     * unix:PATH address has no port and is printed as given. */
    char where[512];
    snprintf(where, sizeof where, "%s", srv.cfg.listen);
    char *colon = strrchr(where, ':');
    if (colon && strncmp(where, "unix", 4)) snprintf(colon, sizeof where - (size_t)(colon - where), ":%d", srv.port);
    printf("factorps-server: listening on %s (shard %u of %u, mode %s, workers %u, simd %s)\n", where,
           srv.cfg.shard_id, srv.cfg.shard_count, fps_mode_name(srv.cfg.mode), srv.cfg.workers,
           fps_kernels_name(kernels));
    fflush(stdout);
  }

  if (fps_checkpoint_start(srv.shard) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot start the checkpoint thread");
    exit_code = 1;
    goto out;
  }
  ckpt_on_exit = *srv.cfg.checkpoint_dir != 0;
  fps_metrics_ready_set(true); /* gRPC bound, state (empty or restored) in place */
  if (fps_replica_start(srv.replica) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot start the replica's lease thread");
    exit_code = 1;
    goto out;
  }
  /* Restored split blocks compare versions with their peers (xrecover.c).
   * A replica does so only once it is primary without ever having taken a
   * primary's state (replica.c): a standby's restored blocks are replaced
   * by its primary's, and their versions must not move the peers. */
  if (peers && !*srv.cfg.replica_peer) fps_shard_recover_start(srv.shard);
  for (;;) {
    int sig = 0;
    if (sigwait(&sigs, &sig) == 0 && (sig == SIGTERM || sig == SIGINT)) {
      FPS_LOG(FPS_LOG_INFO, "%s: shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      break;
    }
  }

out:
  fps_metrics_ready_set(false);
  int64_t stop0 = fps_now_ns();
  /* A split step whose exchange has begun finishes (or fails) on every
   * block before this shard stops: the peers may already hold our partials
   * and apply. gRPC still serves their Exchange calls meanwhile; no new
   * step begins. Bounded by the exchange deadline. */
  fps_peers_stopping(peers);
  if (peers && srv.shard) fps_shard_drain_exchanges(srv.shard, srv.cfg.exchange_deadline + 1.0);
  /* Exchanges still in flight fail UNAVAILABLE, so the steps waiting for
   * them fail and answer their calls within the grace period below. */
  fps_peers_stop(peers, FPS_PEERS_STOP_WAIT_S);
  /* A primary lets go of its lease first: its standby takes over while
   * this one drains (calls waiting for the standby's ack fail
   * UNAVAILABLE and their clients go to the new primary). */
  fps_replica_stop(srv.replica);
  fps_grpc_stop(&srv, FPS_SHUTDOWN_GRACE_S);
  fps_replica_destroy(srv.replica); /* its channel before grpc_shutdown */
  srv.replica = NULL;
  fps_peers_destroy(peers); /* its channels before grpc_shutdown */
  peers = NULL;
  FPS_LOG(FPS_LOG_DEBUG, "shutdown: gRPC server stopped in %.3f s", (double)(fps_now_ns() - stop0) / 1e9);
  fps_metrics_http_stop(http);
  fps_timer_destroy(srv.timer);
  srv.timer = NULL;
  fps_rpc_checkpoint_stop(&srv);  /* after gRPC: no call can queue any more */
  fps_checkpoint_stop(srv.shard); /* no periodic write after the final one */
  FPS_LOG(FPS_LOG_DEBUG, "shutdown: threads stopped at %.3f s", (double)(fps_now_ns() - stop0) / 1e9);
  if (ckpt_on_exit) {
    /* After gRPC stopped: no update can follow, so this checkpoint holds
     * the shard's final state. A failure makes the exit status non-zero. */
    const char *last = NULL;
    if (fps_checkpoint_unchanged(srv.shard, &last)) {
      /* The newest checkpoint already holds it: rewriting would only cost
       * the write time (seconds per GiB) out of the grace period. */
      FPS_LOG(FPS_LOG_INFO, "no final checkpoint written: nothing changed since %s",
               last);
    } else {
      rc = fps_checkpoint_write(srv.shard, NULL, why, sizeof why);
      if (rc < 0 && rc != FPS_ENOTFOUND) exit_code = 1;
    }
  }
  fps_checkpoint_close(srv.shard);
  uint64_t peak_buf, peak_staged;
  fps_shard_staging_peaks(srv.shard, &peak_buf, &peak_staged);
  /* What memory a run needed beyond its parameters and state, for sizing
   * --max-staging-bytes and checking the sync memory bound. */
  FPS_LOG(FPS_LOG_INFO, "staging peak: %.1f MiB of buffers, %.1f MiB of slices staged ahead",
          (double)peak_buf / 1048576.0, (double)peak_staged / 1048576.0);
  fps_shard_free(srv.shard);
  fps_pool_destroy(pool);
  bool torn_down = fps__grpc_teardown(FPS_TEARDOWN_WAIT_S);
  FPS_LOG(FPS_LOG_DEBUG, "shutdown: gRPC teardown %s at %.3f s", torn_down ? "done" : "abandoned",
           (double)(fps_now_ns() - stop0) / 1e9);
  pthread_mutex_destroy(&srv.calls_mu);
  pthread_rwlock_destroy(&srv.batch_gate);
  fps_config_free(&srv.cfg);
  if (exit_code == 0) FPS_LOG(FPS_LOG_INFO, "stopped cleanly");
  if (!torn_down) {
    /* gRPC is still waiting for its backup poller (see above): leave
     * without it. Under ASan, the leak check that exit() would run, now. */
    FPS_LOG(FPS_LOG_DEBUG, "gRPC's teardown still waits for its poller; exiting without it");
    fflush(stdout);
    fflush(stderr);
    if (__lsan_do_leak_check) __lsan_do_leak_check();
    _exit(exit_code);
  }
  return exit_code;
}

/* factorps load: a synthetic training load.
 *
 * W workers (threads, or processes with --processes), each with its own
 * client, register a transformer-like model of about N parameters and push
 * S steps of gradients (worker w uses worker id w and steps 0..S-1, so the
 * load is valid for sync shards started with --workers W). Worker 0 supplies
 * the initial values; the others wait for them, which also exercises the
 * wait-for-ready path. Gradients are fixed small values so the load
 * generator spends its time moving bytes, not computing.
 *
 * Reported over the timed steps (after --warmup steps):
 *   steps/s     steps per second of one worker (rounds per second in sync)
 *   GB/s        gradient bytes pushed plus parameter bytes received, all
 *               workers together, per second (10^9 bytes)
 *   latency     push_pull percentiles over every worker's timed steps
 * and a final `RESULT key=value ...` line for scripts (tests/bench/load.sh);
 * its t_start and t_end are the timed window on CLOCK_MONOTONIC, so that a
 * benchmark can take the CPU time of every process over exactly that window
 * (tests/bench/link_bench.py). */
#include <getopt.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "alloc.h"
#include "commands.h"
#include "models.h"
#include "factorps/client.h"

typedef struct load_cfg_s {
  char **addrs;
  size_t n_shards;
  unsigned workers;
  unsigned long long params, steps, warmup;
  double deadline;
  unsigned long long max_message;
  const char *mode_hint;
  int wire_dtype;                      /* FPS_WIRE_F32 or FPS_WIRE_BF16 */
  int model_peer;                      /* --model peer */
  unsigned long long peer_tensors;     /* --tensors K (peer model) */
  unsigned long long split_min_bytes;  /* --split-min-bytes (0: never split) */
  unsigned long long push_chunk_bytes; /* --push-chunk-bytes (0: one call per shard) */
  fps_cli_sec_t sec;                   /* TLS and token options */
  int processes;                       /* 1: --processes, 0: threads */
  long worker_id;                      /* -1: run all W workers; else only this one */
  /* The model. */
  fps_tensor_def_t *defs;
  char (*names)[64];
  size_t n_tensors;
  uint64_t total;                      /* elements */
} load_cfg_t;

typedef struct load_result_s {
  int ok;
  int bad_options;                     /* the client refused the options: exit 2 */
  double t_start, t_end;               /* CLOCK_MONOTONIC of the timed steps */
  double bytes;                        /* pushed + received in the timed steps */
  char error[FPS_STATUS_MESSAGE_MAX + 64];
} load_result_t;

typedef struct worker_s {
  const load_cfg_t *cfg;
  unsigned id;
  load_result_t res;
  double *lat;                         /* timed steps' latencies, seconds */
  pthread_t thread;
} worker_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: factorps load --shards HOST:PORT[,...] [--workers W] [--params N] [--steps S]\n"
          "                     [--warmup K] [--mode-hint sync|async|ssp] [--threads|--processes]\n"
          "                     [--deadline SECONDS] [--max-message BYTES] [--worker-id I]\n"
          "                     [--wire-dtype f32|bf16] [--model gpt|peer] [--tensors K]\n"
          "                     [--split-min-bytes N] [--push-chunk-bytes N]\n"
          "Synthetic load: W workers (default 2, threads unless --processes) each push S steps\n"
          "(default 20) of gradients for a transformer-like model of about N parameters\n"
          "(default 10M; k/M/G suffixes) and report steps/s, GB/s (gradients pushed + params\n"
          "received) and push_pull latency percentiles over the steps after the first K\n"
          "(default 1). Sync shards must run with --workers W. --mode-hint states the mode\n"
          "the shards should run in; a mismatch with what they report is an error.\n"
          "--worker-id I runs only worker I of the W (one worker per process or pod, e.g. a\n"
          "Kubernetes Indexed Job's completion index); its figures are that worker's alone.\n"
          "--wire-dtype bf16 pushes bf16 gradients and receives bf16 parameters (half the\n"
          "bytes; GB/s counts the bytes actually moved). --model peer uses the shapes of the\n"
          "torch.distributed.rpc peer benchmark (K tensors, default 64) instead of the GPT-like\n"
          "stack. --split-min-bytes N cuts every tensor of at least N bytes (suffixes k/M/G\n"
          "for 10^3.., Ki/Mi/Gi for 2^10..; default 0: never) into row blocks over the\n"
          "shards, which must then run --mode sync with --peers; 32Mi (libfactorps'\n"
          "FPS_SPLIT_MIN_BYTES_DEFAULT) balances the 100M models' shard bytes to 5%%.\n"
          "--push-chunk-bytes N pushes each shard's tensors as concurrent calls over chunks\n"
          "of about N bytes of fp32 gradient, bf16 too (default 8Mi,\n"
          "FPS_PUSH_CHUNK_BYTES_DEFAULT; 0: one call per shard).\n"
          "--shards defaults to $FACTORPS_SHARDS.\n"
          FPS_CLI_SEC_USAGE);
}

static uint64_t numel_of(const fps_tensor_def_t *d) {
  uint64_t n = 1;
  for (uint32_t i = 0; i < d->ndim; i++) n *= d->shape[i];
  return n;
}

/* One worker: connect, create (worker 0 uploads values), push S steps. */
static void worker_run(worker_t *w) {
  const load_cfg_t *cfg = w->cfg;
  size_t n = cfg->n_tensors;
  fps_client_t *c = NULL;
  fps_status_t st;
  fps_client_options_t o;
  float *grad = NULL, *param = NULL;
  const float **grads = fps_calloc(n, sizeof *grads);
  float **params = fps_calloc(n, sizeof *params);
  const char **names = fps_calloc(n, sizeof *names);
  fps_tensor_def_t *defs = fps_calloc(n, sizeof *defs);
  uint64_t *versions = fps_calloc(n, sizeof *versions);
  double bytes_per_step = 0;

  w->res.ok = 0;
  if (!grads || !params || !names || !defs || !versions) {
    snprintf(w->res.error, sizeof w->res.error, "out of memory");
    goto done;
  }
  /* One contiguous gradient and one parameter area for the whole model. */
  grad = fps_malloc(cfg->total * sizeof *grad);
  param = fps_malloc(cfg->total * sizeof *param);
  if (!grad || !param) {
    snprintf(w->res.error, sizeof w->res.error, "out of memory for %llu parameters",
             (unsigned long long)cfg->total);
    goto done;
  }
  unsigned seed = 12345u + w->id;
  for (uint64_t i = 0; i < cfg->total; i++) {
    seed = seed * 1103515245u + 12345u;
    grad[i] = ((float)(seed >> 16 & 0x7fff) / 32768.0f - 0.5f) * 2e-3f;
    param[i] = ((float)(seed >> 8 & 0x7fff) / 32768.0f - 0.5f) * 0.1f;
  }
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    defs[i] = cfg->defs[i];
    defs[i].init = w->id == 0 ? param + off : NULL;
    names[i] = cfg->defs[i].name;
    grads[i] = grad + off;
    params[i] = param + off;
    off += numel_of(&cfg->defs[i]);
  }
  bytes_per_step = 2.0 * (double)cfg->total * (cfg->wire_dtype == FPS_WIRE_BF16 ? 2.0 : 4.0);

  fps_client_options_init(&o);
  fps_cli_sec_fill(&cfg->sec, &o);
  o.deadline_seconds = cfg->deadline;
  o.max_message_bytes = cfg->max_message;
  o.wire_dtype = cfg->wire_dtype;
  o.split_min_bytes = cfg->split_min_bytes;
  o.push_chunk_bytes = cfg->push_chunk_bytes;
  if (!(c = fps_client_create((const char *const *)cfg->addrs, cfg->n_shards, &o, &st))) {
    /* An address, TLS option, token or job id it refuses: a bad flag. */
    w->res.bad_options = st.code == FPS_CODE_INVALID_ARGUMENT;
    goto fail;
  }
  if (fps_client_create_tensors(c, defs, n, &st)) goto fail;
  for (unsigned long long s = 0; s < cfg->steps; s++) {
    if (s == cfg->warmup) w->res.t_start = now_s();
    double t0 = now_s();
    /* num_workers: sync/ssp shards of another --workers say so at once,
     * rather than as a stale push on the next run. */
    const fps_push_args_t args = {.worker_id = w->id, .num_workers = cfg->workers, .step = s};
    if (fps_client_push_pull_ex(c, &args, names, grads, NULL, params, versions, n, &st)) goto fail;
    if (s >= cfg->warmup) w->lat[s - cfg->warmup] = now_s() - t0;
  }
  w->res.t_end = now_s();
  w->res.bytes = bytes_per_step * (double)(cfg->steps - cfg->warmup);
  w->res.ok = 1;
  goto done;
fail:
  snprintf(w->res.error, sizeof w->res.error, "worker %u: %s: %s", w->id, fps_code_name(st.code),
           st.message);
done:
  fps_client_destroy(c);
  fps_free(grad);
  fps_free(param);
  fps_free(grads);
  fps_free(params);
  fps_free(names);
  fps_free(defs);
  fps_free(versions);
}

static void *worker_thread(void *arg) {
  worker_run(arg);
  return NULL;
}

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t k = write(fd, p, len);
    if (k <= 0) return -1;
    p += k;
    len -= (size_t)k;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t k = read(fd, p, len);
    if (k <= 0) return -1;
    p += k;
    len -= (size_t)k;
  }
  return 0;
}

/* --processes: fork before any gRPC use in this process (gRPC's threads do
 * not survive fork), run one worker per child, ship results over a pipe. */
static int run_processes(worker_t *ws, unsigned W, size_t n_lat) {
  pid_t *pids = fps_calloc(W, sizeof *pids);
  int *fds = fps_calloc(W, sizeof *fds);
  int rc = 0;
  if (!pids || !fds) {
    fps_free(pids);
    fps_free(fds);
    return -1;
  }
  for (unsigned i = 0; i < W; i++) {
    int p[2];
    if (pipe(p)) {
      perror("pipe");
      rc = -1;
      W = i;
      break;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      worker_run(&ws[i]);
      int bad = write_all(p[1], &ws[i].res, sizeof ws[i].res) ||
                write_all(p[1], ws[i].lat, n_lat * sizeof *ws[i].lat);
      _exit(bad ? 1 : 0);
    }
    close(p[1]);
    if (pid < 0) {
      perror("fork");
      close(p[0]);
      rc = -1;
      W = i;
      break;
    }
    pids[i] = pid;
    fds[i] = p[0];
  }
  for (unsigned i = 0; i < W; i++) {
    if (read_all(fds[i], &ws[i].res, sizeof ws[i].res) ||
        read_all(fds[i], ws[i].lat, n_lat * sizeof *ws[i].lat)) {
      ws[i].res.ok = 0;
      snprintf(ws[i].res.error, sizeof ws[i].res.error, "worker %u: process died", i);
    }
    close(fds[i]);
    waitpid(pids[i], NULL, 0);
  }
  fps_free(pids);
  fps_free(fds);
  return rc;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double pct(const double *v, size_t n, double p) {
  if (!n) return 0;
  size_t i = (size_t)ceil(p / 100.0 * (double)n);
  if (i > 0) i--;
  return v[i < n ? i : n - 1];
}

static int check_mode(const load_cfg_t *cfg) {
  fps_client_options_t o;
  fps_status_t st;
  fps_shard_stats_t *s = fps_calloc(cfg->n_shards, sizeof *s);
  int rc = -1;
  fps_client_options_init(&o);
  fps_cli_sec_fill(&cfg->sec, &o);
  o.deadline_seconds = cfg->deadline < 10 ? cfg->deadline : 10;
  fps_client_t *c = fps_client_create((const char *const *)cfg->addrs, cfg->n_shards, &o, &st);
  if (!s || !c || fps_client_stats(c, s, cfg->n_shards, &st)) {
    fprintf(stderr, "factorps load: %s: %s\n", fps_code_name(st.code), st.message);
    goto done;
  }
  for (size_t i = 0; i < cfg->n_shards; i++) {
    if (strcmp(s[i].mode, cfg->mode_hint)) {
      fprintf(stderr, "factorps load: shard %zu runs in mode %s, --mode-hint says %s\n", i,
              s[i].mode, cfg->mode_hint);
      goto done;
    }
    if (strcmp(s[i].mode, "async") && s[i].workers != cfg->workers) {
      fprintf(stderr, "factorps load: shard %zu expects %u workers, --workers is %u\n", i,
              s[i].workers, cfg->workers);
      goto done;
    }
  }
  rc = 0;
done:
  fps_client_destroy(c);
  fps_free(s);
  return rc;
}

int fps_cli_load(int argc, char **argv) {
  static const struct option longopts[] = {{"shards", required_argument, NULL, 's'},
                                           {"workers", required_argument, NULL, 'w'},
                                           {"params", required_argument, NULL, 'n'},
                                           {"steps", required_argument, NULL, 'S'},
                                           {"warmup", required_argument, NULL, 'k'},
                                           {"mode-hint", required_argument, NULL, 'm'},
                                           {"threads", no_argument, NULL, 't'},
                                           {"processes", no_argument, NULL, 'p'},
                                           {"deadline", required_argument, NULL, 'd'},
                                           {"max-message", required_argument, NULL, 'M'},
                                           {"worker-id", required_argument, NULL, 'i'},
                                           {"wire-dtype", required_argument, NULL, 'D'},
                                           {"model", required_argument, NULL, 'o'},
                                           {"tensors", required_argument, NULL, 'K'},
                                           {"split-min-bytes", required_argument, NULL, 'B'},
                                           {"push-chunk-bytes", required_argument, NULL, 'C'},
                                           {"help", no_argument, NULL, 'h'},
                                           FPS_CLI_SEC_LONGOPTS,
                                           {NULL, 0, NULL, 0}};
  load_cfg_t cfg = {.workers = 2, .params = 10000000, .steps = 20, .warmup = 1, .deadline = 120,
                    .max_message = 4u << 20, .worker_id = -1, .wire_dtype = FPS_WIRE_F32,
                    .peer_tensors = 64, .push_chunk_bytes = FPS_PUSH_CHUNK_BYTES_DEFAULT,
                    .processes = -1 /* neither flag yet */};
  const char *shards = fps_cli_env_shards();
  unsigned long long v;
  int opt, rc = 1;
  worker_t *ws = NULL;
  double *all = NULL;

  optind = 1;
  while ((opt = getopt_long(argc, argv, "hs:w:n:S:k:m:tpd:M:i:D:o:K:B:C:", longopts, NULL)) != -1) {
    switch (opt) {
      case 's': shards = optarg; break;
      case 'w':
        if (fps_cli_u64(optarg, "--workers", 1, 1024, &v)) return 2;
        cfg.workers = (unsigned)v;
        break;
      case 'n':
        if (fps_cli_count(optarg, "--params", &cfg.params)) return 2;
        break;
      case 'S':
        if (fps_cli_u64(optarg, "--steps", 1, 1000000, &cfg.steps)) return 2;
        break;
      case 'k':
        if (fps_cli_u64(optarg, "--warmup", 0, 1000000, &cfg.warmup)) return 2;
        break;
      case 'm':
        if (fps_cli_mode(optarg, "--mode-hint")) return 2;
        cfg.mode_hint = optarg;
        break;
      case 't':
      case 'p':
        if (cfg.processes != -1 && cfg.processes != (opt == 'p')) {
          fprintf(stderr, "factorps load: --threads and --processes exclude each other\n");
          return 2;
        }
        cfg.processes = opt == 'p';
        break;
      case 'd':
        if (fps_cli_double(optarg, "--deadline", 0.001, 86400, &cfg.deadline)) return 2;
        break;
      case 'M':
        if (fps_cli_count(optarg, "--max-message", &cfg.max_message)) return 2;
        break;
      case 'i':
        if (fps_cli_u64(optarg, "--worker-id", 0, 1023, &v)) return 2;
        cfg.worker_id = (long)v;
        break;
      case 'D':
        if (!strcmp(optarg, "f32") || !strcmp(optarg, "fp32")) {
          cfg.wire_dtype = FPS_WIRE_F32;
        } else if (!strcmp(optarg, "bf16")) {
          cfg.wire_dtype = FPS_WIRE_BF16;
        } else {
          fprintf(stderr, "factorps load: --wire-dtype must be f32 or bf16, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'o':
        if (strcmp(optarg, "gpt") && strcmp(optarg, "peer")) {
          fprintf(stderr, "factorps load: --model must be gpt or peer, not '%s'\n", optarg);
          return 2;
        }
        cfg.model_peer = !strcmp(optarg, "peer");
        break;
      case 'K':
        if (fps_cli_u64(optarg, "--tensors", 7, 3073, &cfg.peer_tensors)) return 2;
        break;
      case 'B':
        if (fps_cli_bytes(optarg, "--split-min-bytes", &cfg.split_min_bytes)) return 2;
        break;
      case 'C':
        if (fps_cli_bytes(optarg, "--push-chunk-bytes", &cfg.push_chunk_bytes)) return 2;
        break;
      case 'h': usage(stdout); return 0;
      default:
        if (fps_cli_sec_opt(&cfg.sec, opt, optarg)) break;
        usage(stderr);
        return 2;
    }
  }
  if (cfg.processes == -1) cfg.processes = 0;
  if (fps_cli_operands("load", argc, argv, optind, 0, 0, "")) {
    usage(stderr);
    return 2;
  }
  if (!shards) {
    fprintf(stderr, "factorps %s: no shards: pass --shards HOST:PORT[,...] or set FACTORPS_SHARDS\n",
            "load");
    return 2;
  }
  if (cfg.worker_id >= (long)cfg.workers) {
    fprintf(stderr, "factorps load: --worker-id (%ld) must be below --workers (%u)\n", cfg.worker_id,
            cfg.workers);
    return 2;
  }
  if (cfg.warmup >= cfg.steps) {
    fprintf(stderr, "factorps load: --warmup (%llu) must be below --steps (%llu)\n", cfg.warmup,
            cfg.steps);
    return 2;
  }
  if (!(cfg.addrs = fps_cli_split(shards, &cfg.n_shards))) {
    fprintf(stderr, "factorps load: bad --shards list '%s'\n", shards);
    return 2;
  }
  /* Tensor-sized buffers come and go every step; glibc's defaults return
   * them to the kernel (mmap above 32 MiB at most, trimming) so every step
   * pays page faults again. The server tunes the same way
   * (--malloc-tune); the library leaves malloc to its host program. */
  if (!mallopt(M_MMAP_MAX, 0) || !mallopt(M_TRIM_THRESHOLD, -1) || !mallopt(M_TOP_PAD, 64 << 20))
    fprintf(stderr, "factorps load: mallopt tuning refused; continuing untuned\n");
  if (fps_cli_sec_load(&cfg.sec)) {
    rc = 2;
    goto done;
  }
  {
    fps_cli_model_t m;
    int mrc = cfg.model_peer ? fps_cli_model_peer(&m, cfg.params, cfg.peer_tensors, "factorps load")
                             : fps_cli_model_gpt(&m, cfg.params, "factorps load");
    if (mrc) {
      rc = mrc;
      goto done;
    }
    cfg.defs = m.defs;
    cfg.names = m.names;
    cfg.n_tensors = m.n_tensors;
    cfg.total = m.total;
  }
  /* The mode check talks gRPC, which must not happen before fork(). */
  if (cfg.mode_hint && !cfg.processes && check_mode(&cfg)) goto done;

  size_t n_lat = cfg.steps - cfg.warmup;
  /* The workers this process runs: all W, or just --worker-id. */
  unsigned nrun = cfg.worker_id >= 0 ? 1 : cfg.workers;
  unsigned first = cfg.worker_id >= 0 ? (unsigned)cfg.worker_id : 0;
  ws = fps_calloc(nrun, sizeof *ws);
  all = fps_calloc(n_lat * nrun, sizeof *all);
  if (!ws || !all) goto done;
  for (unsigned i = 0; i < nrun; i++) {
    ws[i].cfg = &cfg;
    ws[i].id = first + i;
    ws[i].lat = all + (size_t)i * n_lat;
  }
  char who[64]; /* what this process runs */
  if (cfg.worker_id >= 0)
    snprintf(who, sizeof who, "worker %ld of %u", cfg.worker_id, cfg.workers);
  else
    snprintf(who, sizeof who, "%u worker %s", cfg.workers, cfg.processes ? "processes" : "threads");
  printf("factorps load: %zu shard(s), %s, %llu parameters in %zu tensors "
         "(%.1f MB), %llu steps (%llu warm-up), %s on the wire\n",
         cfg.n_shards, who,
         (unsigned long long)cfg.total, cfg.n_tensors, (double)cfg.total * 4 / 1e6, cfg.steps,
         cfg.warmup, cfg.wire_dtype == FPS_WIRE_BF16 ? "bf16" : "f32");
  fflush(stdout);
  if (cfg.processes) {
    if (run_processes(ws, nrun, n_lat)) goto done;
  } else {
    unsigned started = 0;
    for (; started < nrun; started++)
      if (pthread_create(&ws[started].thread, NULL, worker_thread, &ws[started])) break;
    for (unsigned i = 0; i < started; i++) pthread_join(ws[i].thread, NULL);
    if (started < nrun) {
      fprintf(stderr, "factorps load: cannot start worker threads\n");
      goto done;
    }
  }
  double t0 = INFINITY, t1 = 0, bytes = 0;
  for (unsigned i = 0; i < nrun; i++) {
    if (!ws[i].res.ok) {
      fprintf(stderr, "factorps load: %s\n", ws[i].res.error);
      if (ws[i].res.bad_options) rc = 2;
      goto done;
    }
    t0 = ws[i].res.t_start < t0 ? ws[i].res.t_start : t0;
    t1 = ws[i].res.t_end > t1 ? ws[i].res.t_end : t1;
    bytes += ws[i].res.bytes;
  }
  double secs = t1 - t0, steps_s = (double)n_lat / secs, gbs = bytes / secs / 1e9;
  size_t n_all = n_lat * nrun;
  qsort(all, n_all, sizeof *all, cmp_double);
  double p50 = pct(all, n_all, 50) * 1e3, p90 = pct(all, n_all, 90) * 1e3,
         p99 = pct(all, n_all, 99) * 1e3, mx = all[n_all - 1] * 1e3;
  printf("  %.3f s for %zu timed steps: %.2f steps/s per worker, %.2f worker-steps/s\n", secs,
         n_lat, steps_s, steps_s * nrun);
  printf("  %.3f GB/s (gradients pushed + parameters received, all workers)\n", gbs);
  printf("  push_pull latency ms: p50 %.2f  p90 %.2f  p99 %.2f  max %.2f\n", p50, p90, p99, mx);
  printf("RESULT shards=%zu workers=%u params=%llu steps=%zu steps_per_s=%.3f gb_per_s=%.3f "
         "p50_ms=%.2f p90_ms=%.2f p99_ms=%.2f max_ms=%.2f wire=%s t_start=%.6f t_end=%.6f\n",
         cfg.n_shards, cfg.workers, (unsigned long long)cfg.total, n_lat, steps_s, gbs, p50, p90,
         p99, mx, cfg.wire_dtype == FPS_WIRE_BF16 ? "bf16" : "f32", t0, t1);
  rc = 0;
done:
  fps_free(ws);
  fps_free(all);
  fps_free(cfg.defs);
  fps_free(cfg.names);
  fps_cli_split_free(cfg.addrs);
  fps_cli_sec_free(&cfg.sec);
  return rc;
}

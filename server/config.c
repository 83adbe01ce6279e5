/* factorps-server configuration: one table drives defaults, FACTORPS_*
 * environment variables, command-line flags, validation, --help and the
 * start-up dump (after redis' standardConfig). Precedence: default < env <
 * flag, so a deployment sets env and a test overrides with a flag. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "checkpoint.h"
#include "lease.h"
#include "memlimit.h"
#include "server.h"

/* CFG_FLAG: a boolean switch whose value is optional (`--x` means true,
 * `--x=false` is allowed), for options that read as commands. */
typedef enum fps_cfg_type_e { CFG_STR, CFG_U32, CFG_U64, CFG_DOUBLE, CFG_MODE, CFG_BOOL, CFG_FLAG } fps_cfg_type_t;

typedef struct fps_cfg_entry_s {
  const char *name;      /* flag without "--"; env is FACTORPS_ + upper(name with - -> _) */
  fps_cfg_type_t type;
  size_t off;
  const char *def;       /* default, parsed like user input */
  double min, max;       /* numeric bounds (inclusive) */
  const char *help;
} fps_cfg_entry_t;

#define OFF(f) offsetof(fps_config_t, f)
static const fps_cfg_entry_t fps__cfg_table[] = {
    {"listen", CFG_STR, OFF(listen), "127.0.0.1:50051", 0, 0,
     "gRPC listen address host:port (port 0: pick a free port) or unix:PATH"},
    {"shard-id", CFG_U32, OFF(shard_id), "0", 0, 65535, "this shard's index, 0 .. shard-count-1"},
    {"shard-count", CFG_U32, OFF(shard_count), "1", 1, 65536, "number of shards in the job"},
    {"mode", CFG_MODE, OFF(mode), "sync", 0, 0, "consistency mode: sync, async or ssp"},
    {"staleness", CFG_U32, OFF(staleness), "2", 0, 1e9,
     "ssp: how many steps a worker may run ahead of the slowest"},
    {"workers", CFG_U32, OFF(workers), "1", 1, 65536, "sync/ssp: number of workers W"},
    {"deadline", CFG_DOUBLE, OFF(deadline), "60", 0.001, 86400,
     "seconds: the longest any call may take (a longer client deadline is capped), and a sync round"},
    {"max-message-bytes", CFG_U64, OFF(max_message_bytes), "67108864", FPS_MESSAGE_BYTES_MIN, 2147483647.0,
     "largest gRPC message accepted (bigger: RESOURCE_EXHAUSTED)"},
    {"threads", CFG_U32, OFF(threads), "0", 0, 256, "completion-queue threads (0: number of CPUs, at least 2)"},
    {"port-file", CFG_STR, OFF(port_file), "", 0, 0, "write the bound port to this file"},
    {"max-tensors", CFG_U64, OFF(max_tensors), "1048576", 1, 1e15, "most tensors this shard holds"},
    {"max-bytes", CFG_U64, OFF(max_bytes), "0", 0, 1.8e19,
     "most parameter bytes this shard holds (0: half the memory cgroup's limit, or of the physical memory)"},
    {"max-staging-bytes", CFG_U64, OFF(max_staging_bytes), "0", 0, 1.8e19,
     "most bytes of gradient staging and reply snapshots over all calls (0: same as --max-bytes)"},
    {"max-decode-bytes", CFG_U64, OFF(max_decode_bytes), "0", 0, 1.8e19,
     "most bytes of requests being decoded and handled over all calls (0: the larger of a quarter of "
     "--max-bytes and 4x --max-message-bytes)"},
    {"max-concurrent-calls", CFG_U32, OFF(max_concurrent_calls), "4096", 1, 1e6,
     "calls in progress at once, parked sync/ssp pushes included (more: RESOURCE_EXHAUSTED)"},
    {"max-streams-per-connection", CFG_U32, OFF(max_streams_per_connection), "1024", 1, 1e6,
     "HTTP/2 streams one connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS; more wait in the client)"},
    {"tls-cert", CFG_STR, OFF(tls_cert), "", 0, 0, "PEM certificate chain: serve TLS (with --tls-key)"},
    {"tls-key", CFG_STR, OFF(tls_key), "", 0, 0, "PEM private key of --tls-cert (unencrypted)"},
    {"tls-client-ca", CFG_STR, OFF(tls_client_ca), "", 0, 0,
     "PEM CA bundle: require client certificates signed by it (mutual TLS)"},
    {"tls-client-roles", CFG_BOOL, OFF(tls_client_roles), "false", 0, 0,
     "a call gets only the roles its client certificate names (URI SAN urn:factorps:worker, "
     "urn:factorps:admin or urn:factorps:peer:<shard-id>; needs --tls-client-ca)"},
    {"auth-token-file", CFG_STR, OFF(auth_token_file), "", 0, 0,
     "file of the workers' bearer tokens, one a line: calls must send 'authorization: Bearer <token>'"},
    {"admin-token-file", CFG_STR, OFF(admin_token_file), "", 0, 0,
     "file of admin tokens: only they may replace or Checkpoint (unset: the worker tokens may)"},
    {"exchange-token-file", CFG_STR, OFF(exchange_token_file), "", 0, 0,
     "file of peer tokens, '<shard-id>:<token>' a line: only they may Exchange, as that shard "
     "(unset: the worker tokens may, as any shard)"},
    {"apply-log", CFG_U32, OFF(apply_log), "4096", 0, 1 << 24,
     "per-tensor apply records kept for Stats.apply_log"},
    {"log-level", CFG_STR, OFF(log_level), "info", 0, 0, "error, warn, info or debug"},
    {"simd", CFG_STR, OFF(simd), "auto", 0, 0, "kernel variant: auto, scalar, avx2, avx512, neon"},
    {"kernel-threads", CFG_U32, OFF(kernel_threads), "0", 0, 256,
     "threads one large tensor's update is split over (0: number of CPUs; 1: none)"},
    {"metrics-listen", CFG_STR, OFF(metrics_listen), "", 0, 0,
     "HTTP /metrics, /healthz, /readyz address host:port (port 0: pick one; empty: off)"},
    {"metrics-port-file", CFG_STR, OFF(metrics_port_file), "", 0, 0,
     "write the bound metrics port to this file"},
    {"malloc-tune", CFG_BOOL, OFF(malloc_tune), "true", 0, 0,
     "tune glibc malloc for large messages (one arena, no mmap threshold, no trim)"},
    {"http2-bdp-probe", CFG_BOOL, OFF(http2_bdp_probe), "false", 0, 0,
     "let gRPC grow HTTP/2 receive windows to its bandwidth-delay estimate (long links; more memory)"},
    {"http2-max-frame", CFG_U64, OFF(http2_max_frame), "1048576", 0, 16777215.0,
     "largest HTTP/2 frame the shard accepts, bytes (SETTINGS_MAX_FRAME_SIZE: clients send their data in "
     "frames up to this size; 0: HTTP/2's 16384)"},
    {"checkpoint-dir", CFG_STR, OFF(checkpoint_dir), "", 0, 0,
     "directory for durable checkpoints (created if missing; empty: no checkpoints)"},
    {"checkpoint-interval", CFG_DOUBLE, OFF(checkpoint_interval), "0", 0, 1e7,
     "seconds between periodic checkpoints (0: only on the Checkpoint RPC and SIGTERM)"},
    {"checkpoint-keep", CFG_U32, OFF(checkpoint_keep), "3", 1, 1e6, "newest checkpoints kept on disk"},
    {"require-checkpoint", CFG_FLAG, OFF(require_checkpoint), "false", 0, 0,
     "refuse to start (exit 3) unless a valid checkpoint is loaded from --checkpoint-dir"},
    {"job-id", CFG_STR, OFF(job_id), "", 0, 0,
     "the job this shard serves (kept in its checkpoints; another job's are not restored; "
     "empty: the restored checkpoint's, else the first Create's)"},
    {"peers", CFG_STR, OFF(peers), "", 0, 0,
     "every shard's host:port by --shard-id, comma-separated (split tensors; our own entry unused); "
     "A|B names a shard's two replicas"},
    {"peer-tls-ca", CFG_STR, OFF(peer_tls_ca), "", 0, 0, "PEM CA bundle: call peers over TLS, verified by it"},
    {"peer-tls-cert", CFG_STR, OFF(peer_tls_cert), "", 0, 0,
     "PEM client certificate this shard presents to peers (their --tls-client-ca)"},
    {"peer-tls-key", CFG_STR, OFF(peer_tls_key), "", 0, 0, "PEM private key of --peer-tls-cert"},
    {"peer-tls-server-name", CFG_STR, OFF(peer_tls_server_name), "", 0, 0,
     "name the peers' certificates carry, if not the host in --peers"},
    {"peer-token-file", CFG_STR, OFF(peer_token_file), "", 0, 0,
     "file whose first token line is sent to peers as 'authorization: Bearer <token>'"},
    {"exchange-deadline", CFG_DOUBLE, OFF(exchange_deadline), "10", 0.01, 86400,
     "seconds a split tensor's exchange with its peers may take, retries included"},
    {"replica-peer", CFG_STR, OFF(replica_peer), "", 0, 0,
     "host:port of this shard's other replica (standby replicas; needs --lease; empty: solo)"},
    {"lease", CFG_STR, OFF(lease), "", 0, 0,
     "who may be primary: file:PATH (flock, one host) or etcd:HOST:PORT/KEY (needs --replica-peer)"},
    {"lease-ttl", CFG_DOUBLE, OFF(lease_ttl), "2", 0.1, 3600,
     "seconds an etcd lease lives without renewal (failover time after a primary dies)"},
    {"replica-advertise", CFG_STR, OFF(replica_advertise), "", 0, 0,
     "host:port clients are told to use for this replica (default: --listen)"},
    {"split-anchor-steps", CFG_U32, OFF(split_anchor_steps), "10", 0, 1e9,
     "split tensors: keep each block's state in --checkpoint-dir every N versions, to recover to (0: never)"},
};
#undef OFF
#define FPS_CFG_N (sizeof fps__cfg_table / sizeof fps__cfg_table[0])

void fps_config_shard_opts(const fps_config_t *cfg, fps_shard_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->shard_id = cfg->shard_id;
  o->shard_count = cfg->shard_count;
  o->mode = cfg->mode;
  o->staleness = cfg->staleness;
  o->workers = cfg->workers;
  o->deadline = cfg->deadline;
  o->max_tensors = cfg->max_tensors;
  o->max_bytes = cfg->max_bytes;
  o->max_staging_bytes = cfg->max_staging_bytes;
  o->apply_log = cfg->apply_log;
  o->checkpoint_dir = cfg->checkpoint_dir ? cfg->checkpoint_dir : "";
  o->checkpoint_interval = cfg->checkpoint_interval;
  o->checkpoint_keep = cfg->checkpoint_keep;
  o->require_checkpoint = cfg->require_checkpoint;
  o->job_id = cfg->job_id ? cfg->job_id : "";
  o->split_anchor_steps = cfg->split_anchor_steps;
}

static void fps__env_name(const fps_cfg_entry_t *e, char *buf, size_t len) {
  size_t n = (size_t)snprintf(buf, len, "FACTORPS_");
  for (const char *p = e->name; *p && n + 1 < len; p++, n++)
    buf[n] = *p == '-' ? '_' : (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
  buf[n] = 0;
}

/* Parses one value into cfg; `src` names where it came from for errors. */
static int fps__cfg_set(fps_config_t *cfg, const fps_cfg_entry_t *e, const char *val, const char *src) {
  char *p = (char *)cfg + e->off;
  char *end = NULL;
  errno = 0;
  switch (e->type) {
    case CFG_STR: {
      char *s = fps_strdup(val);
      if (!s) return FPS_ENOMEM;
      fps_free(*(char **)p);
      *(char **)p = s;
      return 0;
    }
    case CFG_MODE:
      if (!strcmp(val, "sync")) *(int *)p = FPS_MODE_SYNC;
      else if (!strcmp(val, "async")) *(int *)p = FPS_MODE_ASYNC;
      else if (!strcmp(val, "ssp")) *(int *)p = FPS_MODE_SSP;
      else goto bad;
      return 0;
    case CFG_FLAG:
      if (!val) val = "true";
      /* fall through */
    case CFG_BOOL:
      if (!strcmp(val, "1") || !strcmp(val, "true") || !strcmp(val, "yes") || !strcmp(val, "on"))
        *(int *)p = 1;
      else if (!strcmp(val, "0") || !strcmp(val, "false") || !strcmp(val, "no") || !strcmp(val, "off"))
        *(int *)p = 0;
      else goto bad;
      return 0;
    case CFG_DOUBLE: {
      double d = strtod(val, &end);
      if (errno || end == val || *end || !isfinite(d) || d < e->min || d > e->max) goto bad;
      *(double *)p = d;
      return 0;
    }
    case CFG_U32:
    case CFG_U64: {
      if (*val == '-' || *val == 0) goto bad;
      unsigned long long u = strtoull(val, &end, 10);
      if (errno || end == val || *end || (double)u < e->min || (double)u > e->max) goto bad;
      if (e->type == CFG_U32) *(uint32_t *)p = (uint32_t)u;
      else *(uint64_t *)p = (uint64_t)u;
      return 0;
    }
  }
bad:
  if (e->type == CFG_MODE) FPS_LOG(FPS_LOG_ERROR, "%s: --%s must be sync, async or ssp, not '%s'", src, e->name, val);
  else if (e->type == CFG_BOOL || e->type == CFG_FLAG) FPS_LOG(FPS_LOG_ERROR, "%s: --%s must be true or false, not '%s'", src, e->name, val);
  else FPS_LOG(FPS_LOG_ERROR, "%s: --%s must be a number in [%g, %g], not '%s'", src, e->name, e->min, e->max, val);
  return FPS_EINVAL;
}

static void fps__cfg_usage(FILE *f) {
  fprintf(f,
          "usage: factorps-server [options]\n"
          "One factorps shard: tensors, Adafactor state and the gRPC service\n"
          "factorps.v1.ParameterServer. Every option can also be set through the\n"
          "environment variable shown; a flag wins over the environment.\n\n");
  for (size_t i = 0; i < FPS_CFG_N; i++) {
    const fps_cfg_entry_t *e = &fps__cfg_table[i];
    char env[64];
    fps__env_name(e, env, sizeof env);
    fprintf(f, "  --%-18s %s\n  %-20s env %s, default %s\n", e->name, e->help, "", env,
            *e->def ? e->def : "(none)");
  }
  fprintf(f, "  --help               this text\n  --version            print the version\n");
}

/* The port of a host:port address, when it is one: gRPC takes the port
 * modulo 2^16 (127.0.0.1:99999 binds 34463), so an out-of-range port is a
 * bad value here, not a silently different port. Unix socket addresses
 * (unix:PATH, unix-abstract:NAME) are left to gRPC when `unix_ok` (the
 * gRPC listen address); anything else must end in a port. 0 or FPS_EINVAL
 * with a message naming the flag. */
static int fps__cfg_check_port(const char *flag, const char *addr, bool unix_ok) {
  if (unix_ok && (!strncmp(addr, "unix:", 5) || !strncmp(addr, "unix-abstract:", 14))) return 0;
  const char *colon = strrchr(addr, ':');
  const char *d = colon ? colon + 1 : "";
  size_t nd = strspn(d, "0123456789");
  if (!colon || !*d || d[nd]) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s' must be host:port (a port 0..65535)%s", flag, addr,
            unix_ok ? " or unix:PATH" : "");
    return FPS_EINVAL;
  }
  if (nd > 5 || strtoul(d, NULL, 10) > 65535) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': port %s is out of range (0..65535)", flag, addr, d);
    return FPS_EINVAL;
  }
  return 0;
}

/* --peers and the peer TLS/token flags: the shapes of the values. The
 * files themselves are read and checked by peer.c at start-up. */
static int fps__cfg_check_peers(const fps_config_t *cfg) {
  const char *dep[] = {cfg->peer_tls_ca, cfg->peer_tls_cert, cfg->peer_tls_key, cfg->peer_tls_server_name,
                       cfg->peer_token_file};
  const char *dep_name[] = {"peer-tls-ca", "peer-tls-cert", "peer-tls-key", "peer-tls-server-name",
                            "peer-token-file"};
  if (!*cfg->peers) {
    for (int i = 0; i < 5; i++)
      if (*dep[i] && !*cfg->replica_peer) {
        FPS_LOG(FPS_LOG_ERROR, "--%s needs --peers or --replica-peer", dep_name[i]);
        return FPS_EINVAL;
      }
    return 0;
  }
  uint32_t n = 0;
  for (const char *p = cfg->peers;; p++) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == 0 || len > 1024) {
      FPS_LOG(FPS_LOG_ERROR, "--peers entry %u is %s (every shard's host:port, by --shard-id)",
              n, len ? "longer than 1024 bytes" : "empty");
      return FPS_EINVAL;
    }
    char entry[1025];
    memcpy(entry, p, len);
    entry[len] = '\0';
    /* A shard with a standby: both replicas, "A|B". */
    char *bar = strchr(entry, '|');
    if (bar) *bar = '\0';
    if ((bar && (strchr(bar + 1, '|') || !bar[1] || bar == entry))) {
      FPS_LOG(FPS_LOG_ERROR, "--peers entry %u names %s: a shard's entry is host:port, or A|B for its two "
              "replicas", n, bar == entry || !bar[1] ? "an empty replica" : "more than two replicas");
      return FPS_EINVAL;
    }
    if (fps__cfg_check_port("peers", entry, false) < 0) return FPS_EINVAL;
    if (bar && fps__cfg_check_port("peers", bar + 1, false) < 0) return FPS_EINVAL;
    n++;
    if (!e) break;
    p = e;
  }
  if (n != cfg->shard_count) {
    FPS_LOG(FPS_LOG_ERROR, "--peers lists %u address%s; it must list all %u shards of --shard-count, "
                           "by --shard-id", n, n == 1 ? "" : "es", cfg->shard_count);
    return FPS_EINVAL;
  }
  if (!*cfg->peer_tls_cert != !*cfg->peer_tls_key) {
    FPS_LOG(FPS_LOG_ERROR, "--peer-tls-cert and --peer-tls-key must be given together");
    return FPS_EINVAL;
  }
  if ((*cfg->peer_tls_cert || *cfg->peer_tls_server_name) && !*cfg->peer_tls_ca) {
    FPS_LOG(FPS_LOG_ERROR, "--%s needs --peer-tls-ca (the CA that signed the peers' certificates)",
            *cfg->peer_tls_cert ? "peer-tls-cert" : "peer-tls-server-name");
    return FPS_EINVAL;
  }
  return 0;
}

/* --replica-peer, --lease, --lease-ttl, --replica-advertise: both or
 * neither of the first two, shapes of the values. */
static int fps__cfg_check_replica(const fps_config_t *cfg) {
  if (!*cfg->replica_peer) {
    const char *need = *cfg->lease ? "lease" : *cfg->replica_advertise ? "replica-advertise" : NULL;
    if (need) {
      FPS_LOG(FPS_LOG_ERROR, "--%s needs --replica-peer (the other replica of this shard)", need);
      return FPS_EINVAL;
    }
    return 0;
  }
  if (!*cfg->lease) {
    FPS_LOG(FPS_LOG_ERROR, "--replica-peer needs --lease (file:PATH or etcd:HOST:PORT/KEY): "
            "the lease decides which replica is primary");
    return FPS_EINVAL;
  }
  char why[512];
  if (fps_lease_spec_check(cfg->lease, why, sizeof why) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--lease %s", why);
    return FPS_EINVAL;
  }
  if (fps__cfg_check_port("replica-peer", cfg->replica_peer, false) < 0) return FPS_EINVAL;
  if (*cfg->replica_advertise && fps__cfg_check_port("replica-advertise", cfg->replica_advertise, false) < 0)
    return FPS_EINVAL;
  return 0;
}

static int fps__cfg_check(fps_config_t *cfg) {
  if (cfg->shard_id >= cfg->shard_count) {
    FPS_LOG(FPS_LOG_ERROR, "--shard-id %u must be below --shard-count %u", cfg->shard_id,
            cfg->shard_count);
    return FPS_EINVAL;
  }
  if (!*cfg->listen) {
    FPS_LOG(FPS_LOG_ERROR, "--listen must not be empty");
    return FPS_EINVAL;
  }
  if (fps__cfg_check_port("listen", cfg->listen, true) < 0) return FPS_EINVAL;
  if (*cfg->metrics_listen && fps__cfg_check_port("metrics-listen", cfg->metrics_listen, false) < 0)
    return FPS_EINVAL;
  const char *lv[] = {"error", "warn", "info", "debug"};
  int level = -1;
  for (int i = 0; i < 4; i++)
    if (!strcmp(cfg->log_level, lv[i])) level = i;
  if (level < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--log-level must be error, warn, info or debug, not '%s'", cfg->log_level);
    return FPS_EINVAL;
  }
  fps__log_level = level;
  if (cfg->threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cfg->threads = n < 2 ? 2 : (uint32_t)(n > 64 ? 64 : n);
  }
  if (cfg->max_bytes == 0) {
    /* Half of what the process may use: the container's memory cgroup
     * limit where there is one, else the physical memory. */
    char src[256];
    uint64_t lim = fps_memlimit("", src, sizeof src);
    cfg->max_bytes = lim ? lim / 2 : (UINT64_C(1) << 34);
    FPS_LOG(FPS_LOG_INFO, "--max-bytes %" PRIu64 ": half of %" PRIu64 " bytes (%s)", cfg->max_bytes, lim, src);
  }
  if (cfg->max_staging_bytes == 0) cfg->max_staging_bytes = cfg->max_bytes;
  if (cfg->max_decode_bytes == 0) {
    /* Room for the largest message with its values (decoded 1x, held
     * twice as received while decoded: 3x) and then some; on a large
     * shard, a quarter of what its parameters may take. */
    uint64_t four = cfg->max_message_bytes * 4;
    cfg->max_decode_bytes = cfg->max_bytes / 4 > four ? cfg->max_bytes / 4 : four;
  }
  if (!*cfg->checkpoint_dir && (cfg->checkpoint_interval > 0 || cfg->require_checkpoint)) {
    FPS_LOG(FPS_LOG_ERROR, "--%s needs --checkpoint-dir",
            cfg->require_checkpoint ? "require-checkpoint" : "checkpoint-interval");
    return FPS_EINVAL;
  }
  if (*cfg->job_id && fps_ckpt_job_check(cfg->job_id) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--job-id '%s' is not 1..%d bytes of [A-Za-z0-9._:-]", cfg->job_id,
            FPS_CKPT_JOB_MAX);
    return FPS_EINVAL;
  }
  if (fps__cfg_check_peers(cfg) < 0) return FPS_EINVAL;
  if (fps__cfg_check_replica(cfg) < 0) return FPS_EINVAL;
  /* The combinations here, so that they exit 2 like every bad value (the
   * files themselves are read by auth.c at start-up). */
  if (!*cfg->tls_cert != !*cfg->tls_key) {
    FPS_LOG(FPS_LOG_ERROR, "--tls-cert and --tls-key must be given together");
    return FPS_EINVAL;
  }
  if (*cfg->tls_client_ca && !*cfg->tls_cert) {
    FPS_LOG(FPS_LOG_ERROR, "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)");
    return FPS_EINVAL;
  }
  if (cfg->checkpoint_interval > 0 && cfg->checkpoint_interval < 0.01) {
    FPS_LOG(FPS_LOG_ERROR, "--checkpoint-interval must be 0 (off) or at least 0.01 s, not %g",
            cfg->checkpoint_interval);
    return FPS_EINVAL;
  }
  if (cfg->http2_max_frame > 0 && cfg->http2_max_frame < 16384) {
    FPS_LOG(FPS_LOG_ERROR, "--http2-max-frame must be 0 (HTTP/2's 16384) or 16384..16777215 bytes, not %" PRIu64,
            cfg->http2_max_frame);
    return FPS_EINVAL;
  }
  return 0;
}

int fps_config_load(fps_config_t *cfg, int argc, char **argv) {
  memset(cfg, 0, sizeof *cfg);
  int rc;
  for (size_t i = 0; i < FPS_CFG_N; i++) {
    rc = fps__cfg_set(cfg, &fps__cfg_table[i], fps__cfg_table[i].def, "default");
    if (rc < 0) goto fail;
  }
  for (size_t i = 0; i < FPS_CFG_N; i++) {
    char env[64];
    fps__env_name(&fps__cfg_table[i], env, sizeof env);
    const char *v = getenv(env);
    if (v && (rc = fps__cfg_set(cfg, &fps__cfg_table[i], v, env)) < 0) goto fail;
  }
  struct option opts[FPS_CFG_N + 3];
  for (size_t i = 0; i < FPS_CFG_N; i++)
    opts[i] = (struct option){fps__cfg_table[i].name,
                              fps__cfg_table[i].type == CFG_FLAG ? optional_argument : required_argument, NULL,
                              (int)(1000 + i)};
  opts[FPS_CFG_N] = (struct option){"help", no_argument, NULL, 'h'};
  opts[FPS_CFG_N + 1] = (struct option){"version", no_argument, NULL, 'V'};
  opts[FPS_CFG_N + 2] = (struct option){0, 0, 0, 0};
  optind = 1;
  opterr = 0;
  for (;;) {
    int idx = optind;
    int c = getopt_long(argc, argv, "hV", opts, NULL);
    if (c == -1) break;
    if (c == 'h') {
      fps__cfg_usage(stdout);
      fps_config_free(cfg);
      return 1;
    }
    if (c == 'V') {
      printf("factorps-server %s\n", FPS_VERSION);
      fps_config_free(cfg);
      return 1;
    }
    if (c == '?' || c == ':') {
      FPS_LOG(FPS_LOG_ERROR, "unknown option or missing value: '%s' (see --help)",
              idx < argc ? argv[idx] : "?");
      rc = FPS_EINVAL;
      goto fail;
    }
    if ((rc = fps__cfg_set(cfg, &fps__cfg_table[c - 1000], optarg, "command line")) < 0) goto fail;
  }
  if (optind < argc) {
    FPS_LOG(FPS_LOG_ERROR, "unexpected argument '%s' (see --help)", argv[optind]);
    rc = FPS_EINVAL;
    goto fail;
  }
  if ((rc = fps__cfg_check(cfg)) < 0) goto fail;
  return 0;
fail:
  fps_config_free(cfg);
  return rc;
}

void fps_config_free(fps_config_t *cfg) {
  for (size_t i = 0; i < FPS_CFG_N; i++)
    if (fps__cfg_table[i].type == CFG_STR) {
      char **p = (char **)((char *)cfg + fps__cfg_table[i].off);
      fps_free(*p);
      *p = NULL;
    }
}

void fps_config_dump(const fps_config_t *cfg, void (*line)(const char *)) {
  for (size_t i = 0; i < FPS_CFG_N; i++) {
    const fps_cfg_entry_t *e = &fps__cfg_table[i];
    const char *p = (const char *)cfg + e->off;
    char buf[512];
    switch (e->type) {
      case CFG_STR: snprintf(buf, sizeof buf, "%s=%s", e->name, *(char *const *)p); break;
      case CFG_U32: snprintf(buf, sizeof buf, "%s=%u", e->name, *(const uint32_t *)p); break;
      case CFG_U64: snprintf(buf, sizeof buf, "%s=%" PRIu64, e->name, *(const uint64_t *)p); break;
      case CFG_DOUBLE: snprintf(buf, sizeof buf, "%s=%g", e->name, *(const double *)p); break;
      case CFG_MODE: snprintf(buf, sizeof buf, "%s=%s", e->name, fps_mode_name(*(const int *)p)); break;
      case CFG_BOOL:
      case CFG_FLAG: snprintf(buf, sizeof buf, "%s=%s", e->name, *(const int *)p ? "true" : "false"); break;
    }
    line(buf);
  }
}

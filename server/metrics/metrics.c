/* The metrics registry: storage and text exposition both generated from the
 * X-macro tables below, so a series is declared in exactly one place
 * (memcached's THREAD_STATS_FIELDS idea).
 *
 * Storage is static and every value is an _Atomic uint64_t updated with
 * relaxed adds: an RPC thread pays one uncontended-ish atomic add per field
 * and never takes a lock, and a scrape reads the values without stopping
 * anybody. A scrape may see an RPC half counted (its count but not yet its
 * bytes); Prometheus tolerates that, and histograms stay self-consistent
 * because _count and +Inf are computed from the buckets being rendered. */
#include "metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "internal.h"

#ifndef FPS_METRICS_DEFAULT_VERSION
#define FPS_METRICS_DEFAULT_VERSION "unknown"
#endif

/* gRPC status codes by value (grpc/status.h), as label values. */
#define FPS__GRPC_CODE_MAP(X)                                              \
  X(OK) X(CANCELLED) X(UNKNOWN) X(INVALID_ARGUMENT) X(DEADLINE_EXCEEDED)   \
  X(NOT_FOUND) X(ALREADY_EXISTS) X(PERMISSION_DENIED) X(RESOURCE_EXHAUSTED)\
  X(FAILED_PRECONDITION) X(ABORTED) X(OUT_OF_RANGE) X(UNIMPLEMENTED)       \
  X(INTERNAL) X(UNAVAILABLE) X(DATA_LOSS) X(UNAUTHENTICATED)

static const char *const grpc_code_names[] = {
#define FPS__STR(name) #name,
    FPS__GRPC_CODE_MAP(FPS__STR)
#undef FPS__STR
};
enum { NCODES = sizeof grpc_code_names / sizeof grpc_code_names[0], CODE_UNKNOWN = 2 };

static const char *const method_names[] = {
#define FPS__STR(id, name, handler, role, streaming) name,
    FPS_METHOD_MAP(FPS__STR)
#undef FPS__STR
};

static const char *const ckpt_reason_names[] = {
#define FPS__STR(id, label) label,
    FPS_METRICS_CKPT_REASON_MAP(FPS__STR)
#undef FPS__STR
};

static const char *const restore_names[] = {
#define FPS__STR(id, label) label,
    FPS_METRICS_RESTORE_MAP(FPS__STR)
#undef FPS__STR
};

/* HTTP statuses the endpoint can answer with; anything else is counted as
 * the last entry. */
static const int http_codes[] = {200, 400, 404, 405, 408, 413, 414, 431, 505, 500, 503};
enum { NHTTP = sizeof http_codes / sizeof http_codes[0] };

/* Label dimensions of a family, and how many series each has. */
enum dim { DIM_NONE, DIM_METHOD, DIM_METHOD_CODE, DIM_HTTP, DIM_CKPT_REASON, DIM_RESTORE };
#define DIMN_NONE 1
#define DIMN_METHOD FPS_METRICS_METHOD_COUNT
#define DIMN_METHOD_CODE (FPS_METRICS_METHOD_COUNT * NCODES)
#define DIMN_HTTP NHTTP
#define DIMN_CKPT_REASON FPS_METRICS_CKPT_REASON_COUNT
#define DIMN_RESTORE FPS_METRICS_RESTORE_COUNT

/* Stored counters and gauges: X(field, type, name, dim, help). */
#define FPS__SERIES_MAP(X)                                                           \
  X(rpc_requests, counter, "factorps_rpc_requests_total", METHOD_CODE,               \
    "RPCs answered, by method and gRPC status code.")                                \
  X(rpc_received_bytes, counter, "factorps_rpc_received_bytes_total", METHOD,        \
    "Tensor payload bytes received, by method.")                                     \
  X(rpc_sent_bytes, counter, "factorps_rpc_sent_bytes_total", METHOD,                \
    "Tensor payload bytes sent, by method.")                                         \
  X(update_bytes, counter, "factorps_update_bytes_total", NONE,                      \
    "Bytes the Adafactor kernel read and wrote; divide by "                          \
    "factorps_update_duration_seconds_sum for its throughput.")                      \
  X(steps, counter, "factorps_sync_steps_completed_total", NONE,                     \
    "sync rounds completed: one tensor's step with all workers' gradients applied.") \
  X(workers_waited, counter, "factorps_sync_workers_waited_total", NONE,             \
    "Workers the completed sync rounds waited for, summed over rounds.")             \
  X(xsent_bytes, counter, "factorps_exchange_sent_bytes_total", NONE,                \
    "Split tensors: bytes of partial sums sent to peer shards and acknowledged.")     \
  X(xreceived_bytes, counter, "factorps_exchange_received_bytes_total", NONE,        \
    "Split tensors: bytes of partial sums accepted from peer shards.")                \
  X(push_errors, counter, "factorps_push_errors_total", NONE,                        \
    "PushPull calls whose push the shard refused or failed (see "                    \
    "factorps_push_duration_seconds for those answered in full).")                   \
  X(xfailures, counter, "factorps_exchange_failures_total", NONE,                    \
    "Split tensors: steps failed in the exchange (nothing applied on this shard).")   \
  X(xrecoveries, counter, "factorps_split_recoveries_total", NONE,                   \
    "Split tensors: blocks moved to the version their shards agreed on.")            \
  X(xlost_steps, counter, "factorps_split_lost_steps_total", NONE,                   \
    "Split tensors: updates undone by moving blocks back to an agreed version.")     \
  X(waiting, gauge, "factorps_waiting_pushes", NONE,                                 \
    "Waiting now: sync, tensor gradients in open rounds; ssp, parked PushPull calls.")\
  X(http_responses, counter, "factorps_http_responses_total", HTTP,                  \
    "Responses of the metrics/health HTTP endpoint, by status code.")                \
  X(http_rejected, counter, "factorps_http_rejected_connections_total", NONE,        \
    "HTTP connections closed to make room for a new one at the limit.")              \
  X(http_connections, gauge, "factorps_http_connections", NONE,                      \
    "HTTP connections open now.")                                                    \
  X(ckpt_written_bytes, counter, "factorps_checkpoint_written_bytes_total", NONE,    \
    "Bytes of checkpoint files written successfully.")                               \
  X(ckpt_set_aside, counter, "factorps_checkpoint_set_aside_files_total", NONE,      \
    "Checkpoint files this shard could not load, moved to unloaded/ at start-up.")    \
  X(ckpt_failures, counter, "factorps_checkpoint_failures_total", CKPT_REASON,       \
    "Checkpoint writes that failed, by reason.")                                     \
  X(restore_outcome, gauge, "factorps_checkpoint_restore_outcome", RESTORE,          \
    "What start-up did with the checkpoint directory: 1 for the outcome taken.")

/* Histograms: X(field, name, dim, bucket set, help). */
#define FPS__HIST_MAP(X)                                                             \
  X(rpc_duration, "factorps_rpc_duration_seconds", METHOD, latency,                  \
    "RPC wall time from first message to status, by method.")                        \
  X(push_duration, "factorps_push_duration_seconds", NONE, latency,                  \
    "PushPull calls answered in full (a push applied, or a retry answered from the "  \
    "idempotency window): first message to the last reply message.")                 \
  X(update_duration, "factorps_update_duration_seconds", NONE, latency,              \
    "Time inside the Adafactor update kernel, per tensor update.")                   \
  X(step_wait, "factorps_sync_wait_duration_seconds", NONE, latency,                 \
    "sync: how long a round's first push waited for the last worker's.")             \
  X(exchange, "factorps_exchange_duration_seconds", NONE, latency,                   \
    "Split tensors: a step's exchange, from sending its partials to having every "    \
    "block's (completed steps).")                                                    \
  X(staleness, "factorps_ssp_staleness_steps", NONE, staleness,                      \
    "ssp: steps the pushing worker was ahead of the slowest worker when admitted.")   \
  X(ckpt_duration, "factorps_checkpoint_duration_seconds", NONE, checkpoint,         \
    "Successful checkpoint writes: snapshot, hash, write and fsync.")

/* Bucket sets. `scale` converts an observed value into the integer units
 * the sum is kept in (nanoseconds for seconds), so the sum is one atomic
 * add too. */
#define FPS__HIST_MAX_BUCKETS 20
typedef struct bucket_set_s {
  const double *le;
  int n;
  double scale;
} bucket_set_t;
static const double latency_le[] = {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3,
                                    5e-3,  10e-3, 25e-3,  50e-3,  0.1,  0.25, 0.5,
                                    1,     2.5,   5,      10};
static const double staleness_le[] = {0, 1, 2, 4, 8, 16, 32, 64};
static const double checkpoint_le[] = {0.01, 0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                       5,    10,   30,  60,   120, 300, 600};
static const bucket_set_t set_latency = {latency_le, sizeof latency_le / sizeof(double), 1e9};
static const bucket_set_t set_staleness = {staleness_le, sizeof staleness_le / sizeof(double), 1};
static const bucket_set_t set_checkpoint = {checkpoint_le, sizeof checkpoint_le / sizeof(double), 1e9};
_Static_assert(sizeof latency_le / sizeof(double) <= FPS__HIST_MAX_BUCKETS, "bucket storage");
_Static_assert(sizeof checkpoint_le / sizeof(double) <= FPS__HIST_MAX_BUCKETS, "bucket storage");

typedef struct hist_s {
  _Atomic uint64_t bucket[FPS__HIST_MAX_BUCKETS + 1];  /* not cumulative; last: +Inf */
  _Atomic uint64_t sum;                                /* in the set's units */
} hist_t;

/* State totals, one atomic per fps_metrics_state_t field. */
#define FPS__STATE_FIELDS(X)                                                                       \
  X(tensors) X(param_elements) X(row) X(col) X(var) X(mom) X(adamw_elements) X(split_blocks)     \
  X(split_elements)

#define FPS__LABEL_MAX 64

static struct {
#define FPS__FIELD(field, type, name, dim, help) _Atomic uint64_t field[DIMN_##dim];
  FPS__SERIES_MAP(FPS__FIELD)
#undef FPS__FIELD
#define FPS__FIELD(field, name, dim, set, help) hist_t field[DIMN_##dim];
  FPS__HIST_MAP(FPS__FIELD)
#undef FPS__FIELD
#define FPS__FIELD(f) _Atomic uint64_t state_##f;
  FPS__STATE_FIELDS(FPS__FIELD)
#undef FPS__FIELD
  /* Checkpoints: the last successful write (or the restored checkpoint)
   * and the update count marked when its snapshot began. */
  _Atomic uint64_t ckpt_last_unix_bits /* a double's bits */, ckpt_last_seq, ckpt_last_bytes, ckpt_mark;
  _Atomic uint64_t restored_seq, restore_ns;
  atomic_bool ready;
  /* Standby replicas (server/replica.h). */
  _Atomic uint64_t replica_role, replica_term, replica_joined, replica_failovers;
  _Atomic uint64_t repl_sent_bytes, repl_ops, repl_lag, replica_unclean;
  _Atomic uint64_t state_checksum;
  /* The latencies of the most recent pushes, for Stats' p50 and p99 (a
   * window, not a counter: the one thing here under a lock). */
  pthread_mutex_t recent_mu;
  double recent[FPS_METRICS_RECENT_PUSHES];
  uint32_t recent_n, recent_head;
  /* Written once by fps_metrics_init, before threads start. */
  uint32_t shard_id, shard_count, workers, staleness_bound;
  double checkpoint_interval;
  char mode[FPS__LABEL_MAX], simd[FPS__LABEL_MAX], version[FPS__LABEL_MAX];
} g;

#define RELAXED memory_order_relaxed

static pthread_once_t fps__recent_once = PTHREAD_ONCE_INIT;
static void fps__recent_init(void) { pthread_mutex_init(&g.recent_mu, NULL); }

int fps_metrics_init(const fps_metrics_config_t *cfg) {
  if (cfg == NULL) return FPS_EINVAL;
  pthread_once(&fps__recent_once, fps__recent_init);
  pthread_mutex_t mu = g.recent_mu;
  memset(&g, 0, sizeof g);
  g.recent_mu = mu; /* initialised once: the registry is process-wide */
  g.shard_id = cfg->shard_id;
  g.shard_count = cfg->shard_count;
  g.workers = cfg->workers;
  g.staleness_bound = cfg->staleness;
  g.checkpoint_interval = cfg->checkpoint_interval > 0 ? cfg->checkpoint_interval : 0;
  atomic_store(&g.restore_outcome[FPS_METRICS_RESTORE_DISABLED], 1);
  snprintf(g.mode, sizeof g.mode, "%s", cfg->mode ? cfg->mode : "unknown");
  snprintf(g.simd, sizeof g.simd, "%s", cfg->simd ? cfg->simd : "unknown");
  snprintf(g.version, sizeof g.version, "%s",
           cfg->version ? cfg->version : FPS_METRICS_DEFAULT_VERSION);
  return 0;
}

static void hist_observe(hist_t *h, const bucket_set_t *set, double v) {
  /* NaN and negatives (a clock step) land in the first bucket and add 0 to
   * the sum rather than corrupting it. */
  if (!(v > 0)) v = 0;
  int i = 0;
  while (i < set->n && v > set->le[i]) i++;
  atomic_fetch_add_explicit(&h->bucket[i], 1, RELAXED);
  double units = v * set->scale;
  uint64_t u = units < 1.8e19 ? (uint64_t)(units + 0.5) : UINT64_MAX / 2;
  atomic_fetch_add_explicit(&h->sum, u, RELAXED);
}

void fps_metrics_rpc_observe(fps_metrics_method_t method, int grpc_code, double seconds,
                             uint64_t rx_bytes, uint64_t tx_bytes) {
  if ((unsigned)method >= FPS_METRICS_METHOD_COUNT) return;
  if (grpc_code < 0 || grpc_code >= NCODES) grpc_code = CODE_UNKNOWN;
  atomic_fetch_add_explicit(&g.rpc_requests[method * NCODES + grpc_code], 1, RELAXED);
  if (rx_bytes) atomic_fetch_add_explicit(&g.rpc_received_bytes[method], rx_bytes, RELAXED);
  if (tx_bytes) atomic_fetch_add_explicit(&g.rpc_sent_bytes[method], tx_bytes, RELAXED);
  hist_observe(&g.rpc_duration[method], &set_latency, seconds);
}

void fps_metrics_rpc_bytes(fps_metrics_method_t method, uint64_t rx_bytes, uint64_t tx_bytes) {
  if ((unsigned)method >= FPS_METRICS_METHOD_COUNT) return;
  if (rx_bytes) atomic_fetch_add_explicit(&g.rpc_received_bytes[method], rx_bytes, RELAXED);
  if (tx_bytes) atomic_fetch_add_explicit(&g.rpc_sent_bytes[method], tx_bytes, RELAXED);
}

int fps_metrics_method_from_name(const char *name) {
  if (name == NULL) return -1;
  const char *slash = strrchr(name, '/');
  if (slash) name = slash + 1;
  for (int i = 0; i < FPS_METRICS_METHOD_COUNT; i++)
    if (strcmp(name, method_names[i]) == 0) return i;
  return -1;
}

void fps_metrics_update_observe(double seconds, uint64_t bytes) {
  atomic_fetch_add_explicit(&g.update_bytes[0], bytes, RELAXED);
  hist_observe(&g.update_duration[0], &set_latency, seconds);
}

void fps_metrics_push_observe(bool ok, double seconds) {
  if (!ok) {
    atomic_fetch_add_explicit(&g.push_errors[0], 1, RELAXED);
    return;
  }
  hist_observe(&g.push_duration[0], &set_latency, seconds);
  pthread_once(&fps__recent_once, fps__recent_init);
  pthread_mutex_lock(&g.recent_mu);
  g.recent[(g.recent_head + g.recent_n) % FPS_METRICS_RECENT_PUSHES] = seconds;
  if (g.recent_n < FPS_METRICS_RECENT_PUSHES) g.recent_n++;
  else g.recent_head = (g.recent_head + 1) % FPS_METRICS_RECENT_PUSHES;
  pthread_mutex_unlock(&g.recent_mu);
}

static uint64_t hist_count(const hist_t *h) {
  uint64_t n = 0;
  for (int i = 0; i <= FPS__HIST_MAX_BUCKETS; i++) n += atomic_load_explicit(&h->bucket[i], RELAXED);
  return n;
}

static double hist_seconds(const hist_t *h, const bucket_set_t *set) {
  return (double)atomic_load_explicit(&h->sum, RELAXED) / set->scale;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

void fps_metrics_totals(fps_metrics_totals_t *t) {
  memset(t, 0, sizeof *t);
  t->pushes = hist_count(&g.push_duration[0]);
  t->push_seconds_sum = hist_seconds(&g.push_duration[0], &set_latency);
  t->push_errors = atomic_load_explicit(&g.push_errors[0], RELAXED);
  t->updates = hist_count(&g.update_duration[0]);
  t->update_seconds_sum = hist_seconds(&g.update_duration[0], &set_latency);
  t->update_bytes = atomic_load_explicit(&g.update_bytes[0], RELAXED);
  for (int m = 0; m < FPS_METRICS_METHOD_COUNT; m++) {
    t->bytes_received += atomic_load_explicit(&g.rpc_received_bytes[m], RELAXED);
    t->bytes_sent += atomic_load_explicit(&g.rpc_sent_bytes[m], RELAXED);
  }
  t->xbytes_sent = atomic_load_explicit(&g.xsent_bytes[0], RELAXED);
  t->xbytes_received = atomic_load_explicit(&g.xreceived_bytes[0], RELAXED);
  t->xsteps = hist_count(&g.exchange[0]);
  t->xseconds_sum = hist_seconds(&g.exchange[0], &set_latency);
  t->xfailures = atomic_load_explicit(&g.xfailures[0], RELAXED);
  double lat[FPS_METRICS_RECENT_PUSHES];
  pthread_once(&fps__recent_once, fps__recent_init);
  pthread_mutex_lock(&g.recent_mu);
  uint32_t n = g.recent_n;
  memcpy(lat, g.recent, sizeof lat);
  pthread_mutex_unlock(&g.recent_mu);
  if (n) {
    qsort(lat, n, sizeof lat[0], cmp_double);
    t->push_seconds_p50 = lat[(n - 1) / 2];
    t->push_seconds_p99 = lat[(size_t)((n - 1) * 0.99)];
  }
}

void fps_metrics_step_observe(uint32_t waited_for, double wait_seconds) {
  atomic_fetch_add_explicit(&g.steps[0], 1, RELAXED);
  atomic_fetch_add_explicit(&g.workers_waited[0], waited_for, RELAXED);
  hist_observe(&g.step_wait[0], &set_latency, wait_seconds);
}

void fps_metrics_exchange_bytes(uint64_t sent, uint64_t received) {
  if (sent) atomic_fetch_add_explicit(&g.xsent_bytes[0], sent, RELAXED);
  if (received) atomic_fetch_add_explicit(&g.xreceived_bytes[0], received, RELAXED);
}

void fps_metrics_exchange_observe(bool ok, double seconds) {
  if (ok) hist_observe(&g.exchange[0], &set_latency, seconds);
  else atomic_fetch_add_explicit(&g.xfailures[0], 1, RELAXED);
}

void fps_metrics_split_recovered(uint64_t lost_steps) {
  atomic_fetch_add_explicit(&g.xrecoveries[0], 1, RELAXED);
  if (lost_steps) atomic_fetch_add_explicit(&g.xlost_steps[0], lost_steps, RELAXED);
}

void fps_metrics_staleness_observe(uint64_t staleness) {
  hist_observe(&g.staleness[0], &set_staleness, (double)staleness);
}

void fps_metrics_waiting_add(int delta) {
  atomic_fetch_add_explicit(&g.waiting[0], (uint64_t)(int64_t)delta, RELAXED);
}

void fps_metrics_state_add_tensor(uint64_t numel, const fps_state_size_t *size) {
  if (size == NULL) return;
  fps_metrics_state_t d = {.tensors = 1, .param_elements = numel, .row = size->row,
                           .col = size->col, .var = size->var, .mom = size->mom,
                           .adamw_elements = size->adamw_elements};
  fps_metrics_state_add(&d);
}

void fps_metrics_state_add(const fps_metrics_state_t *d) {
  if (d == NULL) return;
#define FPS__FIELD(f) atomic_fetch_add_explicit(&g.state_##f, d->f, RELAXED);
  FPS__STATE_FIELDS(FPS__FIELD)
#undef FPS__FIELD
}

/* Seconds to integer nanoseconds, clamped (a negative or NaN time is 0). */
static uint64_t to_ns(double s) {
  if (!(s > 0)) return 0;
  return s < 1.8e10 ? (uint64_t)(s * 1e9 + 0.5) : UINT64_MAX / 2;
}

/* A double kept in an atomic uint64 (its bits), for wall-clock times that
 * must come back exactly. */
static uint64_t dbits(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}
static double bitsd(uint64_t u) {
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

/* Tensor updates so far: the update histogram's count. */
static uint64_t updates_total(void) {
  uint64_t n = 0;
  for (int k = 0; k <= FPS__HIST_MAX_BUCKETS; k++)
    n += atomic_load_explicit(&g.update_duration[0].bucket[k], RELAXED);
  return n;
}

void fps_metrics_restore_set(fps_metrics_restore_t outcome, uint64_t seq, double created_unix,
                             double seconds) {
  if ((unsigned)outcome >= FPS_METRICS_RESTORE_COUNT) return;
  for (int i = 0; i < FPS_METRICS_RESTORE_COUNT; i++)
    atomic_store_explicit(&g.restore_outcome[i], i == (int)outcome, RELAXED);
  atomic_store_explicit(&g.restored_seq, outcome == FPS_METRICS_RESTORE_RESTORED ? seq : 0, RELAXED);
  atomic_store_explicit(&g.restore_ns, to_ns(seconds), RELAXED);
  if (outcome == FPS_METRICS_RESTORE_RESTORED) {
    atomic_store_explicit(&g.ckpt_last_seq, seq, RELAXED);
    atomic_store_explicit(&g.ckpt_last_unix_bits, dbits(created_unix > 0 ? created_unix : 0), RELAXED);
    atomic_store_explicit(&g.ckpt_mark, updates_total(), RELAXED);
  }
}

uint64_t fps_metrics_checkpoint_mark(void) { return updates_total(); }

void fps_metrics_checkpoint_written(uint64_t seq, double unix_time, double seconds, uint64_t bytes,
                                    uint64_t mark) {
  hist_observe(&g.ckpt_duration[0], &set_checkpoint, seconds);
  atomic_fetch_add_explicit(&g.ckpt_written_bytes[0], bytes, RELAXED);
  atomic_store_explicit(&g.ckpt_last_bytes, bytes, RELAXED);
  atomic_store_explicit(&g.ckpt_last_seq, seq, RELAXED);
  atomic_store_explicit(&g.ckpt_mark, mark, RELAXED);
  atomic_store_explicit(&g.ckpt_last_unix_bits, dbits(unix_time > 0 ? unix_time : 0), RELAXED);
}

void fps_metrics_checkpoint_set_aside(void) { atomic_fetch_add_explicit(&g.ckpt_set_aside[0], 1, RELAXED); }

void fps_metrics_checkpoint_failed(fps_metrics_ckpt_reason_t reason) {
  if ((unsigned)reason >= FPS_METRICS_CKPT_REASON_COUNT) reason = FPS_METRICS_CKPT_OTHER;
  atomic_fetch_add_explicit(&g.ckpt_failures[reason], 1, RELAXED);
}

void fps_metrics_ready_set(bool ready) { atomic_store(&g.ready, ready); }
bool fps__metrics_ready_get(void) { return atomic_load(&g.ready); }
bool fps_metrics_ready_get(void) { return atomic_load(&g.ready); }

void fps_metrics_replica_set(int role, uint64_t term, bool joined, uint64_t failovers) {
  atomic_store_explicit(&g.replica_role, (uint64_t)role, RELAXED);
  atomic_store_explicit(&g.replica_term, term, RELAXED);
  atomic_store_explicit(&g.replica_joined, joined ? 1 : 0, RELAXED);
  atomic_store_explicit(&g.replica_failovers, failovers, RELAXED);
}

void fps_metrics_replication_sent(uint64_t bytes, uint64_t ops) {
  atomic_fetch_add_explicit(&g.repl_sent_bytes, bytes, RELAXED);
  atomic_fetch_add_explicit(&g.repl_ops, ops, RELAXED);
}

void fps_metrics_replica_unclean_promotion(void) { atomic_fetch_add_explicit(&g.replica_unclean, 1, RELAXED); }

void fps_metrics_replication_lag_set(uint64_t ops) { atomic_store_explicit(&g.repl_lag, ops, RELAXED); }

void fps_metrics_state_checksum_set(uint64_t sum) { atomic_store_explicit(&g.state_checksum, sum, RELAXED); }

void fps__metrics_http_response(int status) {
  int i = 0;
  while (i < NHTTP - 1 && http_codes[i] != status) i++;
  atomic_fetch_add_explicit(&g.http_responses[i], 1, RELAXED);
}
void fps__metrics_http_rejected(void) { atomic_fetch_add_explicit(&g.http_rejected[0], 1, RELAXED); }
void fps__metrics_http_connections_add(int delta) {
  atomic_fetch_add_explicit(&g.http_connections[0], (uint64_t)(int64_t)delta, RELAXED);
}

/* ------------------------------------------------------------ rendering */

/* Label values must escape backslash, double quote and newline. */
static void escape_label(char *out, size_t cap, const char *in) {
  size_t o = 0;
  for (; *in && o + 3 < cap; in++) {
    if (*in == '\\' || *in == '"') {
      out[o++] = '\\';
      out[o++] = *in;
    } else if (*in == '\n') {
      out[o++] = '\\';
      out[o++] = 'n';
    } else {
      out[o++] = *in;
    }
  }
  out[o] = '\0';
}

/* The labels of series `i` of a family with dimension `d`, after the shard
 * label. Returns false for series not worth emitting (error codes that
 * never happened: 5 methods x 17 codes of zeros is noise). */
static bool dim_labels(char *out, size_t cap, const char *shard, enum dim d, int i,
                       uint64_t value) {
  switch (d) {
    case DIM_NONE:
      snprintf(out, cap, "%s", shard);
      return true;
    case DIM_METHOD:
      snprintf(out, cap, "%s,method=\"%s\"", shard, method_names[i]);
      return true;
    case DIM_METHOD_CODE:
      if (value == 0 && i % NCODES != 0) return false;
      snprintf(out, cap, "%s,method=\"%s\",code=\"%s\"", shard, method_names[i / NCODES],
               grpc_code_names[i % NCODES]);
      return true;
    case DIM_HTTP:
      if (value == 0 && http_codes[i] != 200) return false;
      snprintf(out, cap, "%s,code=\"%d\"", shard, http_codes[i]);
      return true;
    /* Every reason and outcome, zeros included: increase() and "== 1" need
     * the series to exist before the first failure. */
    case DIM_CKPT_REASON:
      snprintf(out, cap, "%s,reason=\"%s\"", shard, ckpt_reason_names[i]);
      return true;
    case DIM_RESTORE:
      snprintf(out, cap, "%s,outcome=\"%s\"", shard, restore_names[i]);
      return true;
  }
  return false;
}

static void render_series(fps__mbuf_t *b, const char *shard, const char *name, const char *type,
                          const char *help, enum dim d, int n, _Atomic uint64_t *v) {
  char labels[256];
  fps__mbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
  for (int i = 0; i < n; i++) {
    uint64_t x = atomic_load_explicit(&v[i], RELAXED);
    if (!dim_labels(labels, sizeof labels, shard, d, i, x)) continue;
    if (strcmp(type, "gauge") == 0)
      fps__mbuf_printf(b, "%s{%s} %lld\n", name, labels, (long long)(int64_t)x);
    else
      fps__mbuf_printf(b, "%s{%s} %llu\n", name, labels, (unsigned long long)x);
  }
}

static void render_hist(fps__mbuf_t *b, const char *shard, const char *name, const char *help,
                        enum dim d, int n, hist_t *h, const bucket_set_t *set) {
  char labels[256];
  fps__mbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
  for (int i = 0; i < n; i++) {
    dim_labels(labels, sizeof labels, shard, d, i, 1);
    uint64_t cum = 0;
    for (int k = 0; k <= set->n; k++) {
      cum += atomic_load_explicit(&h[i].bucket[k], RELAXED);
      if (k < set->n)
        fps__mbuf_printf(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, labels, set->le[k],
                         (unsigned long long)cum);
      else
        fps__mbuf_printf(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels,
                         (unsigned long long)cum);
    }
    double sum = (double)atomic_load_explicit(&h[i].sum, RELAXED) / set->scale;
    fps__mbuf_printf(b, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels, sum, name, labels,
                     (unsigned long long)cum);
  }
}

static void render_gauge(fps__mbuf_t *b, const char *name, const char *help, const char *labels,
                         double v) {
  fps__mbuf_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s{%s} %.17g\n", name, help, name, name,
                   labels, v);
}

static void render_state(fps__mbuf_t *b, const char *shard) {
#define FPS__FIELD(f) uint64_t f = atomic_load_explicit(&g.state_##f, RELAXED);
  FPS__STATE_FIELDS(FPS__FIELD)
#undef FPS__FIELD
  const struct {
    const char *kind;
    uint64_t n;
  } kinds[] = {{"row", row}, {"col", col}, {"var", var}, {"momentum", mom}};
  const char *names[2] = {"factorps_optimizer_state_elements", "factorps_optimizer_state_bytes"};
  const char *helps[2] = {"Adafactor optimizer state elements held, by kind.",
                          "Adafactor optimizer state bytes held (fp32), by kind."};
  for (int u = 0; u < 2; u++) {
    fps__mbuf_printf(b, "# HELP %s %s\n# TYPE %s gauge\n", names[u], helps[u], names[u]);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
      fps__mbuf_printf(b, "%s{%s,kind=\"%s\"} %llu\n", names[u], shard, kinds[k].kind,
                       (unsigned long long)(u ? kinds[k].n * 4 : kinds[k].n));
  }
  render_gauge(b, "factorps_adamw_equivalent_state_elements",
               "Optimizer state elements AdamW would hold for the same tensors (2 x numel).",
               shard, (double)adamw_elements);
  render_gauge(b, "factorps_adamw_equivalent_state_bytes",
               "Optimizer state bytes AdamW would hold for the same tensors (fp32).", shard,
               (double)adamw_elements * 4);
  render_gauge(b, "factorps_parameter_elements", "Parameter elements (sum of numel).", shard,
               (double)param_elements);
  render_gauge(b, "factorps_parameter_bytes", "Parameter bytes held (fp32 weights).", shard,
               (double)param_elements * 4);
  render_gauge(b, "factorps_tensors", "Tensors registered on this shard.", shard,
               (double)tensors);
  render_gauge(b, "factorps_split_blocks",
               "Row blocks of split tensors held by this shard (counted in factorps_tensors).",
               shard, (double)split_blocks);
  render_gauge(b, "factorps_split_block_parameter_bytes",
               "Parameter bytes of the row blocks held (part of factorps_parameter_bytes).", shard,
               (double)split_elements * 4);
}

static void render_checkpoint(fps__mbuf_t *b, const char *shard) {
  uint64_t mark = atomic_load_explicit(&g.ckpt_mark, RELAXED), now = updates_total();
  render_gauge(b, "factorps_checkpoint_interval_seconds",
               "Seconds between periodic checkpoints (0: none).", shard, g.checkpoint_interval);
  render_gauge(b, "factorps_checkpoint_last_success_timestamp_seconds",
               "Unix time of the last successful checkpoint, or of the one restored at start-up "
               "(0: none yet).",
               shard, bitsd(atomic_load_explicit(&g.ckpt_last_unix_bits, RELAXED)));
  render_gauge(b, "factorps_checkpoint_last_success_sequence",
               "Sequence number of that checkpoint (0: none yet).", shard,
               (double)atomic_load_explicit(&g.ckpt_last_seq, RELAXED));
  render_gauge(b, "factorps_checkpoint_last_success_size_bytes",
               "File size of the last checkpoint this process wrote.", shard,
               (double)atomic_load_explicit(&g.ckpt_last_bytes, RELAXED));
  render_gauge(b, "factorps_checkpoint_unsaved_updates",
               "Tensor updates applied since the last successful checkpoint began: at most "
               "what a crash now loses.",
               shard, (double)(now > mark ? now - mark : 0));
  render_gauge(b, "factorps_checkpoint_restored_sequence",
               "Sequence number of the checkpoint restored at start-up (0: none).", shard,
               (double)atomic_load_explicit(&g.restored_seq, RELAXED));
  render_gauge(b, "factorps_checkpoint_restore_duration_seconds",
               "How long the start-up restore took.", shard,
               (double)atomic_load_explicit(&g.restore_ns, RELAXED) / 1e9);
}

static void render_replica(fps__mbuf_t *b, const char *shard) {
  static const char *const roles[] = {"solo", "primary", "standby"};
  uint64_t role = atomic_load_explicit(&g.replica_role, RELAXED);
  fps__mbuf_printf(b, "# HELP factorps_replica_role This process's replica role (1 for the current one).\n"
                      "# TYPE factorps_replica_role gauge\n");
  for (uint64_t i = 0; i < 3; i++)
    fps__mbuf_printf(b, "factorps_replica_role{%s,role=\"%s\"} %d\n", shard, roles[i], i == role ? 1 : 0);
  render_gauge(b, "factorps_replica_term",
               "Term of the lease this process holds (primary) or the highest it has seen (standby).", shard,
               (double)atomic_load_explicit(&g.replica_term, RELAXED));
  render_gauge(b, "factorps_replica_standby_joined",
               "1 when a standby holds everything this shard acknowledges (primary: a standby joined; "
               "standby: it joined its primary's stream); always 0 on a solo shard.",
               shard, (double)atomic_load_explicit(&g.replica_joined, RELAXED));
  fps__mbuf_printf(b, "# HELP factorps_replication_sent_bytes_total Bytes of Replicate messages sent to the standby.\n"
                      "# TYPE factorps_replication_sent_bytes_total counter\n"
                      "factorps_replication_sent_bytes_total{%s} %llu\n",
                   shard, (unsigned long long)atomic_load_explicit(&g.repl_sent_bytes, RELAXED));
  fps__mbuf_printf(b, "# HELP factorps_replication_ops_total Tensor states and keys sent to the standby.\n"
                      "# TYPE factorps_replication_ops_total counter\n"
                      "factorps_replication_ops_total{%s} %llu\n",
                   shard, (unsigned long long)atomic_load_explicit(&g.repl_ops, RELAXED));
  render_gauge(b, "factorps_replication_lag_ops", "Replicate messages sent but not yet acknowledged.", shard,
               (double)atomic_load_explicit(&g.repl_lag, RELAXED));
  fps__mbuf_printf(b, "# HELP factorps_replica_failovers_total Times this process was promoted to primary.\n"
                      "# TYPE factorps_replica_failovers_total counter\n"
                      "factorps_replica_failovers_total{%s} %llu\n",
                   shard, (unsigned long long)atomic_load_explicit(&g.replica_failovers, RELAXED));
  fps__mbuf_printf(b, "# HELP factorps_replica_unclean_promotions_total Promotions of this process whose lease "
                      "said the previous primary had answered pushes alone (those pushes are not here).\n"
                      "# TYPE factorps_replica_unclean_promotions_total counter\n"
                      "factorps_replica_unclean_promotions_total{%s} %llu\n",
                   shard, (unsigned long long)atomic_load_explicit(&g.replica_unclean, RELAXED));
  /* An integer gauge: a double would round the 64-bit hash. */
  fps__mbuf_printf(b, "# HELP factorps_state_checksum Hash over every tensor's checksum (Stats), "
                      "computed on scrape: equal on a primary and its standby at the same versions.\n"
                      "# TYPE factorps_state_checksum gauge\nfactorps_state_checksum{%s} %llu\n",
                   shard, (unsigned long long)atomic_load_explicit(&g.state_checksum, RELAXED));
}

int fps_metrics_render(char **out, size_t *len) {
  if (out == NULL || len == NULL) return FPS_EINVAL;
  fps__mbuf_t b = {0};
  char shard[32], labels[512], mode[2 * FPS__LABEL_MAX], simd[2 * FPS__LABEL_MAX],
      version[2 * FPS__LABEL_MAX];
  snprintf(shard, sizeof shard, "shard=\"%u\"", (unsigned)g.shard_id);
  escape_label(mode, sizeof mode, g.mode[0] ? g.mode : "unknown");
  escape_label(simd, sizeof simd, g.simd[0] ? g.simd : "unknown");
  escape_label(version, sizeof version, g.version[0] ? g.version : FPS_METRICS_DEFAULT_VERSION);

  snprintf(labels, sizeof labels, "%s,version=\"%s\",simd=\"%s\"", shard, version, simd);
  render_gauge(&b, "factorps_build_info", "Build facts: factorps version and SIMD kernel in use.",
               labels, 1);
  snprintf(labels, sizeof labels, "%s,mode=\"%s\"", shard, mode);
  render_gauge(&b, "factorps_shard_info", "Shard facts: consistency mode.", labels, 1);
  render_gauge(&b, "factorps_shards", "Shards in the deployment.", shard, g.shard_count);
  render_gauge(&b, "factorps_workers", "Workers per step (sync/ssp).", shard, g.workers);
  render_gauge(&b, "factorps_staleness_bound_steps",
               "ssp: versions a worker may run ahead of the slowest.", shard, g.staleness_bound);
  render_gauge(&b, "factorps_ready", "1 when the shard is serving (/readyz is 200).", shard,
               fps__metrics_ready_get() ? 1 : 0);
  render_state(&b, shard);

#define FPS__RENDER(field, type, name, dim, help) \
  render_series(&b, shard, name, #type, help, DIM_##dim, DIMN_##dim, g.field);
  FPS__SERIES_MAP(FPS__RENDER)
#undef FPS__RENDER
#define FPS__RENDER(field, name, dim, set, help) \
  render_hist(&b, shard, name, help, DIM_##dim, DIMN_##dim, g.field, &set_##set);
  FPS__HIST_MAP(FPS__RENDER)
#undef FPS__RENDER

  /* Lifetime average kernel throughput, so a dashboard without rate() math
   * (or a human with curl) sees GB/s directly. */
  uint64_t ub = atomic_load_explicit(&g.update_bytes[0], RELAXED);
  double us = (double)atomic_load_explicit(&g.update_duration[0].sum, RELAXED) / 1e9;
  render_gauge(&b, "factorps_update_throughput_bytes_per_second",
               "Adafactor kernel throughput since start (update bytes / update seconds).", shard,
               us > 0 ? (double)ub / us : 0);

  render_checkpoint(&b, shard);
  render_replica(&b, shard);
  fps__metrics_render_process(&b, shard);
  if (b.oom || b.p == NULL) {
    fps_free(b.p);
    return FPS_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

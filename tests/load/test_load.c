/* Load test: 64 concurrent clients push to 2 async shards for a bounded
 * time; afterwards every update the shards made is accounted for by a push
 * acknowledged to a client, exactly, and the shards' heap does not grow
 * with the pushes after warm-up.
 *
 * Each client (its own fps_client_t, so its own channels) runs a thread that
 * pushes, as worker id = client index and step = its push index, a subset
 * of the tensors of ONE shard per call: a call to one shard either applies
 * all of its tensors or none, so every tensor's count is exact. One call in
 * eight carries a NaN in the last element of its last tensor; the shard must
 * refuse the whole call (INVALID_ARGUMENT) and apply none of it, also the
 * tensors before it in the stream. Messages are capped at 64 KiB, so the
 * matrices travel in several slices and the NaN arrives last.
 *
 * Checked afterwards, per tensor:
 *   - version(end) - version(start) == pushes acknowledged (OK) that named it
 *   - the versions the OK replies carried are exactly start+1 .. end, each
 *     once (every acknowledged push is its own update, none lost, none
 *     doubled)
 *   - the shard's apply log (the last records) names only acknowledged
 *     pushes, with the version each was told, consecutive up to end
 * and per shard: Stats' updates, pushes and push_errors grew by exactly the
 * updates, OK calls and refused calls the clients counted. Any other error
 * (one whose effect is unknown, e.g. DEADLINE_EXCEEDED) fails the test.
 *
 * Memory: the first 40% of the run is warm-up (the apply logs, kept short
 * here, filling up). Then the load stops at IDLE_ROUNDS + 1 idle moments
 * (see idle_moment): every client finishes its push and closes its
 * connections, and once the shards have closed theirs, their heap in use
 * (factorps_heap_in_use_bytes on /metrics, glibc's mallinfo2) is read.
 * From the first idle moment to the last it may grow by at most
 * HEAP_GROWTH_BOUND (plus the buffers of connections gRPC still holds for
 * calls it never ended): anything kept per push (a snapshot, a message, a
 * call, a 256-byte record) grows it by that times the thousands of pushes
 * in between. Not asserted in sanitizer builds (see RSS_BOUNDED).
 * VmRSS is sampled every 250 ms and printed, not bounded: the shards run
 * with --malloc-tune (one arena, no trim), so their resident memory is the
 * heap's high-water mark, the most ever in flight at once (calls being
 * received, ~100 connections' read buffers sized by their recent traffic:
 * ~20 MiB of the ~27 MiB in use under load). A stalled shard (a loaded CI
 * machine) meets a burst later and sets a new mark: the one-off 6-7 MiB
 * steps that failed the earlier peak-RSS bound, with no leak. A leak shows
 * in the idle heap; a 1 KiB-per-push leak injected into the shard failed
 * this test at +9 MiB, a 256-byte one at +2.5 MiB (RSS grew 0.2 MiB).
 *
 * Each shard also writes a checkpoint every second (--checkpoint-interval 1)
 * into its own temporary directory, so the checkpoint path runs under the
 * load (and under TSan in `scripts/test.sh --tsan`); at least one must have
 * been written.
 *
 * Deadlines mixed in: every fourth client sends one push in four first
 * with a 2-9 ms deadline, which gRPC enforces by cancelling the call at
 * any point (before the shard saw it all, while it waits, after it
 * applied it); the client then retries that push with the same push_id
 * until its outcome is known. The exact count above must still hold: the
 * shard applies a push only from a live half-close and at most once per
 * push_id. (Its pushes + push_errors grow by the cut attempts too.)
 *
 * Cancels mixed in: every fourth client (another quarter) sends one push
 * in four first on a raw gRPC call of its own (one message per tensor,
 * then the half-close) and cancels it after a random 0-10 ms, wherever
 * the call is by then (not yet sent, mid-stream, half-closed, waiting,
 * applied and answering); then it retries that push through libfactorps
 * with the same push_id until the outcome is known, as above.
 *
 * Knobs (environment): FPS_LOAD_SECONDS (default 20), FPS_LOAD_CLIENTS
 * (default 64). Bounded in count as well: at most MAX_PUSHES per client. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "factorps/client.h"
#include "factorps/v1/factorps.pb-c.h"
#include "harness.h"
#include "scrape.h"

#define SHARDS 2
#define NT 8                       /* tensors */
#define MAX_CLIENTS 256
#define MAX_PUSHES 6000            /* per client: bounds memory and count */
#define MSG_BYTES (64u * 1024u)
#define APPLY_LOG 512u
#define MAX_SAMPLES 4096
/* Idle moments after the first one (at the end of warm-up). Sanitizer
 * builds, where the heap is not bounded (see RSS_BOUNDED), keep only the
 * last: each idle moment waits for the slowest client, up to ~15 s when
 * gRPC keeps a cancelled call (client/call.c), and calls are 4-10x slower
 * there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define IDLE_ROUNDS 1
#else
#define IDLE_ROUNDS 5
#endif
/* A leak-free run's heap in use grew 0.7-1.1 MiB between the first and
 * last idle moment (about 2 connections kept, fragments of gRPC's
 * caches); anything kept per push grows by its size times the ~6,000
 * pushes per shard in between: 2 MiB catches ~350 bytes per push. Each
 * connection the shard still holds at the end (a call gRPC never ended
 * keeps its channel) holds its buffers, about 0.2 MiB measured. */
#define HEAP_GROWTH_BOUND (2.0 * 1048576)
#define HEAP_PER_KEPT_CONNECTION (0.5 * 1048576)

/* Under a sanitizer (the shards are built like this test) the runtime's
 * own memory (TSan's shadow and histories, ASan's quarantine) dominates
 * VmRSS and grows by design: the series is still printed, not bounded. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RSS_BOUNDED 0
#else
#define RSS_BOUNDED 1
#endif

/* --------------------------------------------------------------- model */

static const char *const names[NT] = {"m0", "m1", "m2", "m3", "v0", "v1", "v2", "s"};
static const uint32_t ndims[NT] = {2, 2, 2, 2, 1, 1, 1, 0};
static const uint64_t shapes[NT][2] = {{192, 192}, {256, 128}, {128, 256}, {96, 384},
                                       {1000, 0}, {500, 0}, {17, 0}, {0, 0}};

static uint64_t numel(size_t t) {
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndims[t]; i++) n *= shapes[t][i];
  return n;
}

static void defs_fill(fps_tensor_def_t *d, float **init) {
  memset(d, 0, NT * sizeof *d);
  for (size_t t = 0; t < NT; t++) {
    d[t].name = names[t];
    d[t].ndim = ndims[t];
    d[t].shape[0] = shapes[t][0];
    d[t].shape[1] = shapes[t][1];
    d[t].optim.flavor = FPS_OPTIM_TORCH;
    d[t].init = init ? init[t] : NULL;
  }
}

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static unsigned env_uint(const char *name, unsigned def, unsigned lo, unsigned hi) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  errno = 0;
  unsigned long x = strtoul(v, &end, 10);
  if (errno || *end || x < lo || x > hi) {
    fprintf(stderr, "%s=%s is not a number in %u..%u; using %u\n", name, v, lo, hi, def);
    return def;
  }
  return (unsigned)x;
}

/* ------------------------------------------------------------- clients */

enum { OUT_OK = 1, OUT_REFUSED, OUT_OTHER };

typedef struct push_rec_s {
  uint8_t outcome;                 /* OUT_* */
  uint8_t shard;
  uint8_t hasty;                   /* attempts that ended DEADLINE_EXCEEDED/CANCELLED */
  uint8_t raw;                     /* raw attempts cancelled by the client (maybe never seen) */
  uint16_t mask;                   /* bit t: tensor t was in the call */
  uint64_t version[NT];            /* OK: the version the reply carried */
} push_rec_t;

struct canceller_s;

typedef struct job_s {
  fps_test_server_t srv[SHARDS];
  int metrics_port[SHARDS];
  int shard_of[NT];
  atomic_int stop;
  /* Idle moments: the main thread sets `pause`; each client finishes the
   * push it is in (outcome known) and waits; once `paused` == `running`
   * no call is in flight. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  atomic_bool pause;
  unsigned paused, running;
  grpc_channel_credentials *creds; /* for the cancellers' raw channels */
  double base_fds[SHARDS];         /* each shard's open fds with only the control client */
  struct canceller_s *cancellers;  /* [MAX_CLIENTS]; those of clients i % 4 == 1 */
} job_t;

/* Client side: waits while the main thread holds an idle moment. */
static void job_pause_point(job_t *job) {
  pthread_mutex_lock(&job->mu);
  if (job->pause) {
    job->paused++;
    pthread_cond_broadcast(&job->cv);
    while (job->pause) pthread_cond_wait(&job->cv, &job->mu);
    job->paused--;
  }
  pthread_mutex_unlock(&job->mu);
}

static void job_client_exit(job_t *job) {
  pthread_mutex_lock(&job->mu);
  job->running--;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
}

/* Raw gRPC channels of one client (one per shard), for the calls it
 * cancels itself. */
typedef struct canceller_s {
  grpc_channel *ch[SHARDS];        /* this round's, NULL until made */
  bool kept_on[SHARDS];            /* a call on ch[s] was kept: the channel stays too */
  unsigned kept_sh[SHARDS];        /* channels kept so far, per shard */
  grpc_completion_queue *cq;
  uint64_t cancelled;              /* calls cancelled before they ended */
  uint64_t ended;                  /* calls that ended before the cancel */
  uint64_t kept;                   /* calls gRPC never ended after the cancel */
} canceller_t;

/* Calls (and their queues) gRPC 1.51 kept after a cancel, like those of
 * client/call.c: left reachable, never freed, since gRPC may still write
 * into them. */
typedef struct kept_s {
  grpc_call *call;
  grpc_completion_queue *cq;
  grpc_metadata_array md[2];
  grpc_status_code status;
  grpc_slice details;
  grpc_byte_buffer *in, *out;
  struct kept_s *next;
} kept_t;
static kept_t *g_kept;
static pthread_mutex_t g_kept_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct client_s {
  job_t *job;
  uint32_t id;
  pthread_t thread;
  push_rec_t *rec;                 /* MAX_PUSHES */
  uint64_t n;                      /* pushes made */
  uint64_t hasty;                  /* attempts cut short by a tiny deadline or a cancel */
  canceller_t *k;                  /* NULL: this client does not cancel */
  int setup_rc;
  fps_status_t setup_st;
  fps_status_t other_st;           /* first unexpected error */
  uint64_t other;
} client_t;

static fps_client_t *client_new(job_t *job, double deadline, fps_status_t *st) {
  const char *addrs[SHARDS];
  fps_client_options_t o;
  for (int i = 0; i < SHARDS; i++) addrs[i] = job->srv[i].addr;
  fps_client_options_init(&o);
  o.max_message_bytes = MSG_BYTES;
  o.deadline_seconds = deadline;
  if (deadline < 1) o.max_retries = 0; /* the hasty client: one attempt, the test retries */
  return fps_client_create(addrs, SHARDS, &o, st);
}

/* One PushPullRequest carrying tensor t's whole gradient g. */
static grpc_byte_buffer *raw_message(uint32_t id, uint64_t step, uint64_t push_id, size_t t, const float *g) {
  Factorps__V1__TensorSlice sl = FACTORPS__V1__TENSOR_SLICE__INIT;
  Factorps__V1__TensorSlice *sp = &sl;
  Factorps__V1__PushPullRequest m = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  uint64_t shape[2] = {shapes[t][0], shapes[t][1]};
  sl.name = (char *)names[t];
  sl.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  sl.n_shape = ndims[t];
  sl.shape = shape;
  sl.data.data = (uint8_t *)g;
  sl.data.len = numel(t) * sizeof(float);
  m.worker_id = id;
  m.step = step;
  m.push_id = push_id;
  m.n_grads = 1;
  m.grads = &sp;
  size_t len = factorps__v1__push_pull_request__get_packed_size(&m);
  grpc_slice buf = grpc_slice_malloc(len);
  factorps__v1__push_pull_request__pack(&m, GRPC_SLICE_START_PTR(buf));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&buf, 1);
  grpc_slice_unref(buf);
  return bb;
}

enum { RAW_STATUS = 1, RAW_SEND, RAW_RECV };

/* Sends a push of the k tensors idx[] (one message each, then the
 * half-close) on a raw call, reading every reply, and cancels the call
 * delay_s after it starts wherever it is by then; returns once the call
 * ended. Its outcome is left to the retry. */
static void raw_push_cancelled(canceller_t *kc, int shard, uint32_t id, uint64_t step, uint64_t push_id,
                               const size_t *idx, const float *const *pg, size_t k, double delay_s) {
  gpr_timespec cancel_at = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                        gpr_time_from_micros((int64_t)(delay_s * 1e6), GPR_TIMESPAN));
  grpc_call *call = grpc_channel_create_call(kc->ch[shard], NULL, GRPC_PROPAGATE_DEFAULTS, kc->cq,
                                             grpc_slice_from_static_string("/factorps.v1.ParameterServer/PushPull"),
                                             NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  assert_non_null(call);
  /* Heap-allocated: gRPC writes into these until the call ends, which
   * may be never (see kept_t). */
  kept_t *kp = calloc(1, sizeof *kp);
  assert_non_null(kp);
  grpc_metadata_array_init(&kp->md[0]);
  grpc_metadata_array_init(&kp->md[1]);

  grpc_op op[3];
  memset(op, 0, sizeof op);
  op[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op[0].data.recv_status_on_client.trailing_metadata = &kp->md[1];
  op[0].data.recv_status_on_client.status = &kp->status;
  op[0].data.recv_status_on_client.status_details = &kp->details;
  assert_int_equal(grpc_call_start_batch(call, op, 1, (void *)(intptr_t)RAW_STATUS, NULL), GRPC_CALL_OK);
  memset(op, 0, sizeof op);
  op[0].op = GRPC_OP_RECV_INITIAL_METADATA;
  op[0].data.recv_initial_metadata.recv_initial_metadata = &kp->md[0];
  op[1].op = GRPC_OP_RECV_MESSAGE;
  op[1].data.recv_message.recv_message = &kp->in;
  assert_int_equal(grpc_call_start_batch(call, op, 2, (void *)(intptr_t)RAW_RECV, NULL), GRPC_CALL_OK);
  size_t sent = 0;
  bool sending = true, recving = true, ended = false, cancelled = false;
  memset(op, 0, sizeof op);
  op[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  op[1].op = GRPC_OP_SEND_MESSAGE;
  op[1].data.send_message.send_message = kp->out = raw_message(id, step, push_id, idx[0], pg[0]);
  op[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  sent = 1;
  assert_int_equal(grpc_call_start_batch(call, op, k == 1 ? 3 : 2, (void *)(intptr_t)RAW_SEND, NULL),
                   GRPC_CALL_OK);
  /* After the cancel, gRPC ends the call at once, or (1.51, rarely, as
   * client/call.c found) never: then it is kept and this client goes on
   * with a fresh queue. */
  gpr_timespec give_up = gpr_inf_future(GPR_CLOCK_MONOTONIC);
  while (!ended || sending || recving) {
    grpc_event ev = grpc_completion_queue_next(kc->cq, cancelled ? give_up : cancel_at, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT && cancelled) {
      kc->kept++;
      if (!kc->kept_on[shard]) kc->kept_sh[shard]++;
      kc->kept_on[shard] = true;
      kp->call = call;
      kp->cq = kc->cq;
      pthread_mutex_lock(&g_kept_mu);
      kp->next = g_kept;
      g_kept = kp;
      pthread_mutex_unlock(&g_kept_mu);
      kc->cq = grpc_completion_queue_create_for_next(NULL);
      return;
    }
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
      grpc_call_cancel(call, NULL);
      cancelled = true;
      give_up = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(5, GPR_TIMESPAN));
      if (!ended) kc->cancelled++;
      continue;
    }
    assert_int_equal(ev.type, GRPC_OP_COMPLETE);
    switch ((intptr_t)ev.tag) {
      case RAW_STATUS:
        ended = true;
        if (!cancelled) kc->ended++;
        break;
      case RAW_SEND:
        grpc_byte_buffer_destroy(kp->out);
        kp->out = NULL;
        sending = ev.success && sent < k;
        if (sending) {
          memset(op, 0, sizeof op);
          op[0].op = GRPC_OP_SEND_MESSAGE;
          op[0].data.send_message.send_message = kp->out = raw_message(id, step, push_id, idx[sent], pg[sent]);
          op[1].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
          sent++;
          assert_int_equal(grpc_call_start_batch(call, op, sent == k ? 2 : 1, (void *)(intptr_t)RAW_SEND, NULL),
                           GRPC_CALL_OK);
        }
        break;
      case RAW_RECV:
        recving = ev.success && kp->in;
        if (kp->in) grpc_byte_buffer_destroy(kp->in);
        kp->in = NULL;
        if (recving) {
          memset(op, 0, sizeof op);
          op[0].op = GRPC_OP_RECV_MESSAGE;
          op[0].data.recv_message.recv_message = &kp->in;
          assert_int_equal(grpc_call_start_batch(call, op, 1, (void *)(intptr_t)RAW_RECV, NULL), GRPC_CALL_OK);
        }
        break;
    }
  }
  grpc_slice_unref(kp->details);
  grpc_metadata_array_destroy(&kp->md[0]);
  grpc_metadata_array_destroy(&kp->md[1]);
  grpc_call_unref(call);
  free(kp);
}

/* A push whose first attempt may be cut short: one push in four of every
 * fourth client goes first through a client whose deadline (0.5-4 ms) can
 * pass at any point of the call (before, during or after the shard
 * applied it; gRPC then cancels the call). Its outcome is unknown, so it is
 * retried through the patient client with the same push_id until it is
 * known: the shard applies it at most once, and a retry of an applied one
 * gets the versions it made. */
static int push_once_known(fps_client_t *c, fps_client_t *hasty, canceller_t *kc, int shard, double cancel_s,
                           uint32_t id, uint64_t step, int use_hasty, const size_t *idx, const char *const *pn,
                           const float *const *pg, float *const *pp, uint64_t *pv, size_t k, fps_status_t *st,
                           uint8_t *cut, uint8_t *raw) {
  fps_push_args_t a = {.worker_id = id, .step = step, .push_id = ((uint64_t)(id + 1) << 32) | (step + 1)};
  int rc = FPS_CODE_DEADLINE_EXCEEDED;
  if (use_hasty && kc) {
    raw_push_cancelled(kc, shard, id, step, a.push_id, idx, pg, k, cancel_s);
    (*raw)++;
  } else if (use_hasty) {
    rc = fps_client_push_pull_ex(hasty, &a, pn, pg, NULL, pp, pv, k, st);
    if (rc != FPS_CODE_DEADLINE_EXCEEDED && rc != FPS_CODE_CANCELLED) return rc;
    (*cut)++;
  }
  for (int attempt = 0; attempt < 20; attempt++) {
    rc = fps_client_push_pull_ex(c, &a, pn, pg, NULL, pp, pv, k, st);
    if (rc != FPS_CODE_UNAVAILABLE) return rc;
    (*cut)++; /* the first attempt still in flight: retry */
  }
  return rc;
}

/* Makes the client's connections for one round: its patient client, the
 * hasty one (every fourth), the canceller's raw channels (another
 * quarter). Returns 0 or the failing code (cl->setup_st says why). */
static int client_connect(client_t *cl, fps_client_t **c, fps_client_t **hasty) {
  job_t *job = cl->job;
  fps_tensor_def_t defs[NT];
  int rc;
  /* The tensors exist already (created with values by the main thread):
   * this registers the list and checks it against the shards. */
  defs_fill(defs, NULL);
  /* 30 s: never the cause of an error; a call that hangs fails the test
   * instead of timing it out. */
  if (!(*c = client_new(job, 30, &cl->setup_st))) return cl->setup_st.code;
  if (cl->id % 4 == 3) {
    /* 2-9 ms: under this load a push takes about that long, so the
     * deadline falls anywhere in the call. Its set-up (a Create exchange
     * that only checks the list) may be cut short too: try again. */
    /* Sanitizer builds run every call several times slower:
     * FPS_LOAD_DEADLINE_SCALE (set by tests/load/CMakeLists.txt) keeps the
     * deadline inside a call there too. */
    double scale = env_uint("FPS_LOAD_DEADLINE_SCALE", 1, 1, 100);
    if (!(*hasty = client_new(job, 0.001 * scale * (2 + cl->id % 8), &cl->setup_st))) return cl->setup_st.code;
    /* For 30 s, like the patient client's deadline: a shard that stalls
     * (a loaded machine) cuts every 2-9 ms attempt short meanwhile, and
     * this runs at every reconnect. */
    rc = FPS_CODE_DEADLINE_EXCEEDED;
    for (double t0 = now_s(); rc && now_s() - t0 < 30;)
      if ((rc = fps_client_create_tensors(*hasty, defs, NT, &cl->setup_st)) && rc != FPS_CODE_DEADLINE_EXCEEDED &&
          rc != FPS_CODE_CANCELLED && rc != FPS_CODE_UNAVAILABLE)
        break;
    if (rc) return rc;
  }
  if ((rc = fps_client_create_tensors(*c, defs, NT, &cl->setup_st))) return rc;
  if (cl->k)
    for (int sh = 0; sh < SHARDS; sh++) {
      cl->k->kept_on[sh] = false;
      cl->k->ch[sh] = grpc_channel_create(job->srv[sh].addr, job->creds, NULL);
      if (!cl->k->ch[sh]) {
        snprintf(cl->setup_st.message, sizeof cl->setup_st.message, "client %u: no raw channel", cl->id);
        return FPS_CODE_INTERNAL;
      }
    }
  return 0;
}


/* Closes the round's connections (a raw channel with a kept call stays,
 * like the call). */
static void client_disconnect(client_t *cl, fps_client_t **c, fps_client_t **hasty) {
  fps_client_destroy(*hasty);
  fps_client_destroy(*c);
  *c = *hasty = NULL;
  if (cl->k)
    for (int sh = 0; sh < SHARDS; sh++) {
      if (cl->k->ch[sh] && !cl->k->kept_on[sh]) grpc_channel_destroy(cl->k->ch[sh]);
      cl->k->ch[sh] = NULL;
    }
}

static void *client_main(void *arg) {
  client_t *cl = arg;
  job_t *job = cl->job;
  fps_client_t *c = NULL, *hasty = NULL;
  float *good[NT] = {0}, *bad[NT] = {0}, *params[NT] = {0};

  cl->setup_rc = FPS_CODE_RESOURCE_EXHAUSTED;
  snprintf(cl->setup_st.message, sizeof cl->setup_st.message, "client %u: out of memory", cl->id);
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel(t);
    good[t] = malloc(n * sizeof(float));
    bad[t] = malloc(n * sizeof(float));
    params[t] = malloc(n * sizeof(float));
    if (!good[t] || !bad[t] || !params[t]) goto out;
    for (uint64_t i = 0; i < n; i++)
      good[t][i] = ((float)(mix(cl->id * 131u + (uint32_t)t * 7919u + (uint32_t)i) % 2001u) - 1000.0f) * 1e-6f;
    memcpy(bad[t], good[t], n * sizeof(float));
    bad[t][n - 1] = NAN;
  }
  /* 0-10 ms (scaled as the deadlines are): about one to two pushes' time. */
  double cancel_scale = 1e-6 * env_uint("FPS_LOAD_DEADLINE_SCALE", 1, 1, 100);
  if (cl->k && !(cl->k->cq = grpc_completion_queue_create_for_next(NULL))) goto out;
  cl->setup_rc = 0;
  /* One connection lifetime per round: each idle moment finds every
   * client disconnected (see idle_moment). */
  while (!atomic_load(&job->stop) && cl->n < MAX_PUSHES) {
    if ((cl->setup_rc = client_connect(cl, &c, &hasty))) goto out;
    while (!atomic_load(&job->stop) && !atomic_load(&job->pause) && cl->n < MAX_PUSHES) {
      uint64_t step = cl->n;
      uint32_t h = mix(cl->id * 0x9e3779b9U ^ (uint32_t)step);
      int shard = (int)((cl->id + step) % SHARDS);
      const char *pn[NT];
      const float *pg[NT];
      float *pp[NT];
      uint64_t pv[NT];
      size_t idx[NT], k = 0;
      uint16_t mask = 0;
      /* A non-empty subset of the shard's tensors, in index order. */
      uint32_t pick = h >> 8;
      for (size_t t = 0; t < NT; t++)
        if (job->shard_of[t] == shard && ((pick >> t) & 1)) idx[k++] = t;
      if (!k)
        for (size_t t = 0; t < NT && !k; t++)
          if (job->shard_of[t] == shard) idx[k++] = t;
      int refuse = (h & 7) == 0;
      for (size_t j = 0; j < k; j++) {
        size_t t = idx[j];
        pn[j] = names[t];
        pg[j] = refuse && j == k - 1 ? bad[t] : good[t];
        pp[j] = params[t];
        mask |= (uint16_t)(1u << t);
      }
      fps_status_t st;
      uint8_t cut = 0, raw = 0;
      int rc = push_once_known(c, hasty, cl->k, shard, cancel_scale * (mix(h) % 10000u), cl->id, step,
                               (hasty || cl->k) && ((h >> 4) & 3) == 0, idx, pn, pg, pp, pv, k, &st, &cut, &raw);
      push_rec_t *r = &cl->rec[cl->n++];
      memset(r, 0, sizeof *r);
      r->hasty = cut;
      r->raw = raw;
      cl->hasty += cut + raw;
      r->shard = (uint8_t)shard;
      r->mask = mask;
      if (rc == FPS_CODE_OK && !refuse) {
        r->outcome = OUT_OK;
        for (size_t j = 0; j < k; j++) r->version[idx[j]] = pv[j];
      } else if (rc == FPS_CODE_INVALID_ARGUMENT && refuse) {
        r->outcome = OUT_REFUSED;
      } else {
        /* Unknown effect (or a NaN accepted): the exact count cannot hold. */
        r->outcome = OUT_OTHER;
        if (!cl->other++) {
          cl->other_st = st;
          if (rc == FPS_CODE_OK)
            snprintf(cl->other_st.message, sizeof cl->other_st.message,
                     "a push with a NaN gradient was acknowledged");
        }
      }
    }
    client_disconnect(cl, &c, &hasty);
    job_pause_point(job);
  }
out:
  job_client_exit(job);
  client_disconnect(cl, &c, &hasty);
  if (cl->k && cl->k->cq) {
    grpc_completion_queue_shutdown(cl->k->cq);
    while (grpc_completion_queue_next(cl->k->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cl->k->cq);
    cl->k->cq = NULL;
  }
  for (size_t t = 0; t < NT; t++) {
    free(good[t]);
    free(bad[t]);
    free(params[t]);
  }
  return NULL;
}

/* -------------------------------------------------------------- memory */

typedef struct sampler_s {
  job_t *job;
  double t0;
  pthread_t thread;
  atomic_int stop;
  size_t n;
  double t[MAX_SAMPLES];
  long kib[MAX_SAMPLES][SHARDS];   /* VmRSS, -1 if unreadable */
  double heap[MAX_SAMPLES][SHARDS][2]; /* heap in use, heap size (bytes; NaN if unknown) */
} sampler_t;

enum { M_IN_USE, M_HEAP_SIZE, M_THREADS, M_FDS, M_SERIES };
static const char *const heap_series[M_SERIES] = {"factorps_heap_in_use_bytes", "factorps_heap_size_bytes",
                                                  "process_threads", "process_open_fds"};

static void heap_read(const job_t *job, int s, double v[M_SERIES]) {
  if (fps_test_scrape(job->metrics_port[s], heap_series, v, M_SERIES))
    for (int i = 0; i < M_SERIES; i++) v[i] = NAN;
}

static long vmrss_kib(pid_t pid) {
  char path[64], line[256];
  long v = -1;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &v) == 1) break;
  fclose(f);
  return v;
}

static void *sampler_main(void *arg) {
  sampler_t *s = arg;
  while (!atomic_load(&s->stop) && s->n < MAX_SAMPLES) {
    s->t[s->n] = now_s() - s->t0;
    for (int i = 0; i < SHARDS; i++) {
      s->kib[s->n][i] = vmrss_kib(s->job->srv[i].pid);
      double v[M_SERIES];
      heap_read(s->job, i, v);
      s->heap[s->n][i][0] = v[M_IN_USE];
      s->heap[s->n][i][1] = v[M_HEAP_SIZE];
    }
    s->n++;
    nanosleep(&(struct timespec){0, 250 * 1000 * 1000}, NULL);
  }
  return NULL;
}

/* An idle moment: no call in flight. The heap in use then is what the
 * shard keeps (tensors, state, logs, connections); anything kept per push
 * raises it from one idle moment to the next. */
typedef struct idle_s {
  double t;                        /* since the start of the load */
  double in_use[SHARDS];           /* smallest of IDLE_READS reads, bytes */
  double size[SHARDS];             /* heap size then, bytes */
  long kib[SHARDS];                /* VmRSS then */
  double threads[SHARDS], fds[SHARDS];
  uint64_t pushes[SHARDS];         /* pushes the clients made to it so far */
} idle_t;

#define IDLE_READS 4

/* Pauses every client after its current push, waits (60 s at most) until
 * none is in a call, lets the shards settle (a cancelled call's clean-up
 * in the shard may trail the client by a little), reads their heaps
 * IDLE_READS times (the smallest: a checkpoint being written holds a
 * buffer for a moment), and, unless last, lets the clients go on. */
static void idle_moment(job_t *job, const client_t *cls, unsigned n_clients, idle_t *m, double t0, bool last) {
  pthread_mutex_lock(&job->mu);
  job->pause = true;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 60;
  while (job->paused < job->running)
    if (pthread_cond_timedwait(&job->cv, &job->mu, &until)) {
      unsigned p = job->paused, r = job->running;
      pthread_mutex_unlock(&job->mu);
      fail_msg("only %u of %u clients reached the idle moment within 60 s", p, r);
    }
  unsigned kept[SHARDS] = {0};
  for (unsigned i = 1; i < MAX_CLIENTS; i += 4)
    for (int s = 0; s < SHARDS; s++) kept[s] += job->cancellers[i].kept_sh[s];
  pthread_mutex_unlock(&job->mu);
  m->t = now_s() - t0;
  /* The clients closed their connections; the shard closes its ends and
   * frees their buffers (gRPC sizes each connection's read buffer by its
   * recent traffic: ~10-20 MiB over ~100 connections here, different at
   * every moment, which is why the clients disconnect). Its open fds
   * tell when: back to the count before the clients came, plus a
   * connection per call gRPC kept (this test's, counted, and
   * libfactorps', not counted: hence also "no fewer for 1 s"). */
  for (int s = 0; s < SHARDS; s++) {
    double v[M_SERIES], low = INFINITY, low_t = now_s();
    for (double w0 = now_s();; nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL)) {
      heap_read(job, s, v);
      if (isnan(v[M_FDS])) fail_msg("shard %d: /metrics unreadable", s);
      if (v[M_FDS] <= job->base_fds[s] + kept[s]) break;
      if (v[M_FDS] < low) low = v[M_FDS], low_t = now_s();
      if (now_s() - low_t > 1) break;
      if (now_s() - w0 > 30)
        fail_msg("shard %d: %.0f fds open 30 s after every client disconnected (%.0f before they came, %u "
                 "channels kept by gRPC)", s, v[M_FDS], job->base_fds[s], kept[s]);
    }
  }
  nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  for (int s = 0; s < SHARDS; s++) m->in_use[s] = m->size[s] = INFINITY;
  for (int i = 0; i < IDLE_READS; i++) {
    for (int s = 0; s < SHARDS; s++) {
      double v[M_SERIES];
      heap_read(job, s, v);
      if (isnan(v[M_IN_USE])) fail_msg("shard %d: no %s on /metrics", s, heap_series[M_IN_USE]);
      if (v[M_IN_USE] < m->in_use[s]) m->in_use[s] = v[M_IN_USE];
      m->size[s] = v[M_HEAP_SIZE];
      m->threads[s] = v[M_THREADS];
      m->fds[s] = v[M_FDS];
    }
    nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  }
  for (int s = 0; s < SHARDS; s++) m->kib[s] = vmrss_kib(job->srv[s].pid);
  /* The clients are paused or gone: their records are still. */
  for (unsigned i = 0; i < n_clients; i++)
    for (uint64_t k = 0; k < cls[i].n; k++) m->pushes[cls[i].rec[k].shard]++;
  pthread_mutex_lock(&job->mu);
  if (last) atomic_store(&job->stop, 1);
  job->pause = false;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
}

/* ---------------------------------------------------------- checkpoints */

static char g_ckpt_root[256];

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void ckpt_cleanup(void) {
  if (g_ckpt_root[0]) nftw(g_ckpt_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  g_ckpt_root[0] = 0;
}

/* Regular files in dir whose name does not start with '.' (a temporary
 * file or the lease), or -1 if dir cannot be read. */
static int count_files(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.' && strstr(e->d_name, ".safetensors")) n++;
  closedir(d);
  return n;
}

/* --------------------------------------------------------------- the test */

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  ckpt_cleanup();
  return 0;
}

static void stats_all(fps_client_t *c, fps_shard_stats_t *sh) {
  fps_status_t st;
  int rc = fps_client_stats(c, sh, SHARDS, &st);
  if (rc) fail_msg("Stats: %s: %s", fps_code_name(rc), st.message);
}

static void test_load_async_exact_and_flat(void **state) {
  (void)state;
  unsigned seconds = env_uint("FPS_LOAD_SECONDS", 20, 4, 3600);
  unsigned n_clients = env_uint("FPS_LOAD_CLIENTS", 64, 1, MAX_CLIENTS);
  double warmup = seconds * 0.4;
  static job_t job;
  static sampler_t smp;
  static client_t cls[MAX_CLIENTS];
  fps_status_t st;
  memset(&job, 0, sizeof job);
  pthread_mutex_init(&job.mu, NULL);
  pthread_cond_init(&job.cv, NULL);

  const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  char ckpt_dir[SHARDS][300];
  snprintf(g_ckpt_root, sizeof g_ckpt_root, "%s/fps-load-XXXXXX", tmp);
  if (!mkdtemp(g_ckpt_root)) fail_msg("mkdtemp %s: %s", g_ckpt_root, strerror(errno));
  for (int i = 0; i < SHARDS; i++) {
    snprintf(ckpt_dir[i], sizeof ckpt_dir[i], "%s/shard%d", g_ckpt_root, i);
    if (mkdir(ckpt_dir[i], 0700)) fail_msg("mkdir %s: %s", ckpt_dir[i], strerror(errno));
    char mport_file[320];
    snprintf(mport_file, sizeof mport_file, "%s/metrics%d.port", g_ckpt_root, i);
    const char *extra[] = {"--apply-log", "512", "--log-level", "warn", "--checkpoint-dir", ckpt_dir[i],
                           "--checkpoint-interval", "1", "--metrics-listen", "127.0.0.1:0",
                           "--metrics-port-file", mport_file, NULL};
    assert_int_equal(fps_test_server_start(&job.srv[i], i, SHARDS, "async", 1, extra), 0);
    /* Written before the gRPC port the harness waited for. */
    if ((job.metrics_port[i] = fps_test_read_port(mport_file)) <= 0) fail_msg("shard %d: no metrics port", i);
  }

  /* Create with values from one client; learn the placement. */
  fps_client_t *ctl = client_new(&job, 120, &st);
  if (!ctl) fail_msg("client: %s", st.message);
  float *init[NT];
  fps_tensor_def_t defs[NT];
  for (size_t t = 0; t < NT; t++) {
    init[t] = malloc(numel(t) * sizeof(float));
    assert_non_null(init[t]);
    for (uint64_t i = 0; i < numel(t); i++) init[t][i] = (float)((mix((uint32_t)(t * 1000003u + i)) % 2001u) - 1000.0) * 1e-4f;
  }
  defs_fill(defs, init);
  int rc = fps_client_create_tensors(ctl, defs, NT, &st);
  if (rc) fail_msg("create: %s: %s", fps_code_name(rc), st.message);
  for (size_t t = 0; t < NT; t++) {
    free(init[t]);
    job.shard_of[t] = fps_client_shard_of(ctl, names[t]);
    assert_true(job.shard_of[t] >= 0 && job.shard_of[t] < SHARDS);
  }
  for (int s = 0; s < SHARDS; s++) {
    int have = 0;
    for (size_t t = 0; t < NT; t++) have += job.shard_of[t] == s;
    if (!have) fail_msg("placement left shard %d without tensors; change the model", s);
  }

  fps_shard_stats_t sh0[SHARDS], sh1[SHARDS];
  fps_tensor_stats_t ts;
  uint64_t v0[NT];
  stats_all(ctl, sh0);
  for (size_t t = 0; t < NT; t++) {
    rc = fps_client_tensor_stats(ctl, names[t], &ts, NULL, 0, NULL, &st);
    if (rc) fail_msg("tensor stats %s: %s", names[t], st.message);
    v0[t] = ts.version;
  }

  /* Load. */
  smp.job = &job;
  smp.t0 = now_s();
  atomic_init(&smp.stop, 0);
  assert_int_equal(pthread_create(&smp.thread, NULL, sampler_main, &smp), 0);
  static canceller_t cancellers[MAX_CLIENTS];
  grpc_init();
  grpc_channel_credentials *creds = job.creds = grpc_insecure_credentials_create();
  job.running = n_clients;
  job.cancellers = cancellers;
  for (int s = 0; s < SHARDS; s++) {
    double v[M_SERIES];
    heap_read(&job, s, v);
    if (isnan(v[M_FDS])) fail_msg("shard %d: no %s on /metrics", s, heap_series[M_FDS]);
    job.base_fds[s] = v[M_FDS];
  }
  for (unsigned i = 0; i < n_clients; i++) {
    cls[i].job = &job;
    cls[i].id = i;
    if (i % 4 == 1) cls[i].k = &cancellers[i];
    cls[i].rec = calloc(MAX_PUSHES, sizeof *cls[i].rec);
    assert_non_null(cls[i].rec);
    assert_int_equal(pthread_create(&cls[i].thread, NULL, client_main, &cls[i]), 0);
  }
  /* Load for `seconds` (idle moments not counted): warm-up, then an idle
   * moment at its end and IDLE_ROUNDS more at even intervals, the last at
   * the end, which stops the clients. */
  static idle_t idle[IDLE_ROUNDS + 1];
  double idle_spent = 0;
  for (int r = 0; r <= IDLE_ROUNDS; r++) {
    double at = warmup + (seconds - warmup) * r / IDLE_ROUNDS;
    while (now_s() - smp.t0 - idle_spent < at) nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
    double p0 = now_s();
    idle_moment(&job, cls, n_clients, &idle[r], smp.t0, r == IDLE_ROUNDS);
    idle_spent += now_s() - p0;
  }
  for (unsigned i = 0; i < n_clients; i++) pthread_join(cls[i].thread, NULL);
  double elapsed = now_s() - smp.t0;
  uint64_t n_cancelled = 0, n_ended = 0, n_kept = 0;
  for (unsigned i = 0; i < n_clients; i++) {
    canceller_t *kc = cls[i].k;
    if (!kc) continue;
    n_cancelled += kc->cancelled;
    n_ended += kc->ended;
    n_kept += kc->kept;
  }
  grpc_channel_credentials_release(creds);
  if (!n_kept) grpc_shutdown();
  atomic_store(&smp.stop, 1);
  pthread_join(smp.thread, NULL);

  /* What the clients counted. */
  uint64_t acked[NT] = {0}, refused_t[NT] = {0};
  uint64_t calls_ok[SHARDS] = {0}, calls_refused[SHARDS] = {0}, calls_cut[SHARDS] = {0}, other = 0, total = 0,
           capped = 0, cut = 0;
  for (unsigned i = 0; i < n_clients; i++) {
    client_t *cl = &cls[i];
    if (cl->setup_rc)
      fail_msg("client %u setup: %s: %s", i, fps_code_name(cl->setup_rc), cl->setup_st.message);
    if (cl->other)
      fail_msg("client %u: %llu pushes with an unexpected outcome, first: %s: %s", i,
               (unsigned long long)cl->other, fps_code_name(cl->other_st.code), cl->other_st.message);
    capped += cl->n == MAX_PUSHES;
    for (uint64_t s = 0; s < cl->n; s++) {
      const push_rec_t *r = &cl->rec[s];
      total++;
      for (size_t t = 0; t < NT; t++) {
        if (!(r->mask >> t & 1)) continue;
        if (r->outcome == OUT_OK) acked[t]++;
        else refused_t[t]++;
      }
      calls_cut[r->shard] += r->hasty;
      cut += r->hasty + r->raw;
      if (r->outcome == OUT_OK) calls_ok[r->shard]++;
      else if (r->outcome == OUT_REFUSED) calls_refused[r->shard]++;
      else other++;
    }
  }
  assert_int_equal(other, 0);
  if (capped) printf("note: %llu clients reached MAX_PUSHES (%d) before the time bound\n",
                     (unsigned long long)capped, MAX_PUSHES);
  printf("load: %u clients, %u shards (async), %.1f s: %llu pushes (%.0f/s), %llu acked, %llu refused\n",
         n_clients, SHARDS, elapsed, (unsigned long long)total, (double)total / elapsed,
         (unsigned long long)(calls_ok[0] + calls_ok[1]),
         (unsigned long long)(calls_refused[0] + calls_refused[1]));
  printf("load: %llu attempts cut short by a 2-9 ms deadline or a 0-10 ms cancel, each retried with its push_id "
         "until known; %llu raw calls cancelled mid-way, %llu ended before their cancel, %llu never ended (gRPC "
         "kept them)\n",
         (unsigned long long)cut, (unsigned long long)n_cancelled, (unsigned long long)n_ended,
         (unsigned long long)n_kept);
  assert_true(cut > 0);
  if (n_clients > 1) assert_true(n_cancelled > 0);

  /* Per tensor: version delta, the set of versions handed out, the log. */
  stats_all(ctl, sh1);
  uint64_t upd[SHARDS] = {0};
  fps_apply_record_t *log = calloc(APPLY_LOG, sizeof *log);
  assert_non_null(log);
  for (size_t t = 0; t < NT; t++) {
    size_t log_len = 0;
    rc = fps_client_tensor_stats(ctl, names[t], &ts, log, APPLY_LOG, &log_len, &st);
    if (rc) fail_msg("tensor stats %s: %s", names[t], st.message);
    uint64_t v1 = ts.version, updates = v1 - v0[t];
    printf("tensor %-3s shard %d: version %llu -> %llu: %llu updates, %llu acked pushes, "
           "%llu refused pushes named it\n",
           names[t], job.shard_of[t], (unsigned long long)v0[t], (unsigned long long)v1,
           (unsigned long long)updates, (unsigned long long)acked[t], (unsigned long long)refused_t[t]);
    if (updates != acked[t])
      fail_msg("tensor %s: %llu updates but %llu acknowledged pushes", names[t],
               (unsigned long long)updates, (unsigned long long)acked[t]);
    upd[job.shard_of[t]] += updates;

    /* Each acknowledged push got its own version in v0+1 .. v1. */
    uint8_t *seen = calloc(updates + 1, 1);
    assert_non_null(seen);
    for (unsigned i = 0; i < n_clients; i++)
      for (uint64_t s = 0; s < cls[i].n; s++) {
        const push_rec_t *r = &cls[i].rec[s];
        if (r->outcome != OUT_OK || !(r->mask >> t & 1)) continue;
        uint64_t v = r->version[t];
        if (v <= v0[t] || v > v1)
          fail_msg("tensor %s: client %u push %llu was told version %llu, outside %llu..%llu", names[t],
                   i, (unsigned long long)s, (unsigned long long)v, (unsigned long long)v0[t] + 1,
                   (unsigned long long)v1);
        if (seen[v - v0[t]]++)
          fail_msg("tensor %s: version %llu was handed to two pushes", names[t], (unsigned long long)v);
      }
    free(seen);

    /* The log: the newest records, consecutive, each an acknowledged push
     * that was told that very version. */
    size_t want_len = updates < APPLY_LOG ? (size_t)updates : APPLY_LOG;
    if (log_len != want_len)
      fail_msg("tensor %s: apply log has %zu records, want %zu", names[t], log_len, want_len);
    for (size_t j = 0; j < log_len; j++) {
      const fps_apply_record_t *a = &log[j];
      uint64_t want_v = v1 - log_len + 1 + j;
      if (a->version != want_v)
        fail_msg("tensor %s: apply log record %zu has version %llu, want %llu", names[t], j,
                 (unsigned long long)a->version, (unsigned long long)want_v);
      if (a->worker_id >= n_clients || a->step >= cls[a->worker_id].n)
        fail_msg("tensor %s: apply log names worker %u step %llu, which no client pushed", names[t],
                 a->worker_id, (unsigned long long)a->step);
      const push_rec_t *r = &cls[a->worker_id].rec[a->step];
      if (r->outcome != OUT_OK || !(r->mask >> t & 1) || r->version[t] != a->version)
        fail_msg("tensor %s: version %llu was applied for worker %u step %llu, which was %s", names[t],
                 (unsigned long long)a->version, a->worker_id, (unsigned long long)a->step,
                 r->outcome == OUT_REFUSED ? "refused" : "not acknowledged with that version");
    }
  }
  free(log);

  /* Per shard: the counters agree with the clients. */
  for (int s = 0; s < SHARDS; s++) {
    uint64_t d_upd = sh1[s].updates - sh0[s].updates, d_push = sh1[s].pushes - sh0[s].pushes,
             d_err = sh1[s].push_errors - sh0[s].push_errors;
    printf("shard %d: updates +%llu (clients: %llu), pushes +%llu (acked calls: %llu), "
           "push_errors +%llu (refused calls: %llu; attempts cut short: %llu)\n",
           s, (unsigned long long)d_upd, (unsigned long long)upd[s], (unsigned long long)d_push,
           (unsigned long long)calls_ok[s], (unsigned long long)d_err,
           (unsigned long long)calls_refused[s], (unsigned long long)calls_cut[s]);
    assert_int_equal(d_upd, upd[s]);
    /* An attempt cut short by its deadline or a cancel is counted by the
     * shard as an error (it never finished), as an OK push (it finished,
     * the answer came too late; its retry is then a second OK, applying
     * nothing), or not at all: a 2 ms deadline can pass before the call
     * leaves the client. Retries of an attempt still in flight
     * (UNAVAILABLE, inside libfactorps) add errors the clients cannot
     * count. So the counters are bounded below only by the answers the
     * clients got; updates == acknowledged pushes above is the exact
     * check. */
    assert_true(d_push >= calls_ok[s] && d_err >= calls_refused[s]);
  }

  /* Memory: the series (one sample a second), then the idle moments. */
  printf("MiB, t(s): shard0 VmRSS heap-size heap-in-use | shard1 VmRSS heap-size heap-in-use\n");
  for (size_t i = 0; i < smp.n; i++)
    if (i % 4 == 0 || i + 1 == smp.n)
      printf("  %5.1f: %7.1f %7.1f %7.1f | %7.1f %7.1f %7.1f\n", smp.t[i], smp.kib[i][0] / 1024.0,
             smp.heap[i][0][1] / 1048576.0, smp.heap[i][0][0] / 1048576.0, smp.kib[i][1] / 1024.0,
             smp.heap[i][1][1] / 1048576.0, smp.heap[i][1][0] / 1048576.0);
  printf("idle moments, MiB, t(s): shard0 VmRSS heap-size heap-in-use | shard1 ...\n");
  for (int r = 0; r <= IDLE_ROUNDS; r++)
    printf("  %5.1f: %7.1f %7.1f %9.3f %3.0f %3.0f | %7.1f %7.1f %9.3f %3.0f %3.0f\n", idle[r].t,
           idle[r].kib[0] / 1024.0, idle[r].size[0] / 1048576.0, idle[r].in_use[0] / 1048576.0,
           idle[r].threads[0], idle[r].fds[0], idle[r].kib[1] / 1024.0, idle[r].size[1] / 1048576.0,
           idle[r].in_use[1] / 1048576.0, idle[r].threads[1], idle[r].fds[1]);
  for (int s = 0; s < SHARDS; s++) {
    const idle_t *a = &idle[0], *z = &idle[IDLE_ROUNDS];
    double growth = z->in_use[s] - a->in_use[s], extra = z->fds[s] > a->fds[s] ? z->fds[s] - a->fds[s] : 0;
    double bound = HEAP_GROWTH_BOUND + extra * HEAP_PER_KEPT_CONNECTION;
    uint64_t pushes = z->pushes[s] - a->pushes[s];
    printf("shard %d: heap in use when idle %.3f -> %.3f MiB over %llu pushes: %+.3f MiB (%.0f bytes per push; "
           "bound %.1f MiB with %.0f more connections held); VmRSS %.1f -> %.1f MiB\n",
           s, a->in_use[s] / 1048576.0, z->in_use[s] / 1048576.0, (unsigned long long)pushes, growth / 1048576.0,
           pushes ? growth / (double)pushes : 0.0, bound / 1048576.0, extra, a->kib[s] / 1024.0, z->kib[s] / 1024.0);
    if (!RSS_BOUNDED) {
      printf("shard %d: sanitizer build, heap bound not asserted\n", s);
      continue;
    }
    if (growth > bound)
      fail_msg("shard %d: heap in use when idle grew by %.3f MiB over %llu pushes after warm-up (bound %.1f MiB): "
               "something is kept per push", s, growth / 1048576.0, (unsigned long long)pushes, bound / 1048576.0);
  }

  fps_client_destroy(ctl);
  for (unsigned i = 0; i < n_clients; i++) free(cls[i].rec);
  for (int s = 0; s < SHARDS; s++) {
    if (fps_test_server_stop(&job.srv[s]) != 0) fail_msg("shard %d did not exit cleanly", s);
    int n = count_files(ckpt_dir[s]);
    printf("shard %d: %d checkpoints kept in %s\n", s, n, ckpt_dir[s]);
    if (n < 1) fail_msg("shard %d wrote no checkpoint under load", s);
  }
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_load_async_exact_and_flat, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

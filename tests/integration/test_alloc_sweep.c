/* The allocation-failure sweep (SQLite's faultsim habit):
 * a real shard (the server's code, all but main()) serves a real gRPC
 * server on 127.0.0.1 in this process, and libfactorps calls it. For one
 * method per test case, call i of the sweep makes the shard's allocation
 * number N = i fail (common/alloc.h counts every allocation of server/,
 * server/shard/ and the common code they call, the RPC layer included),
 * until a call runs through without reaching its Nth allocation. Every
 * failed call must:
 *   - answer RESOURCE_EXHAUSTED or INTERNAL with a message that says what
 *     ran out (never hang, never another code);
 *   - leave the shard exactly as it was: every tensor's parameters,
 *     optimizer state (row, col, var, mom, step, RMS), version, readiness,
 *     last lr / weight decay and apply log bit for bit, the store's
 *     tensors and bytes, the update counters, the staging bytes in use,
 *     and (Checkpoint) the checkpoint directory;
 *     (one exception, counted apart: a PushPull that fails while its reply
 *     is built, after its update was applied whole; never part of it);
 *   - leave the shard serving: the same call, repeated without a fault,
 *     succeeds (a push retried with the failed call's push_id is applied
 *     exactly once: its result equals a twin tensor's that got the same
 *     gradients without any fault).
 * gRPC's own allocations (gpr_malloc) are outside the wrapper; a failure
 * there aborts the process, as gRPC's C core does. Each case prints its
 * numbers: calls swept, failures injected, and how each was answered. */
#include <dirent.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <grpc/grpc.h>

#include "alloc.h"
#include "checkpoint.h"
#include "factorps/client.h"
#include "metrics.h"
#include "server.h"
#include "shard/internal.h"
#include "simd/kernels.h"

/* A sweep longer than this is a runaway (a call that allocates without
 * bound); the real counts are in the tens to hundreds. */
#define SWEEP_MAX 5000

/* ------------------------------------------------------------ the shard */

static fps_server_t g_srv;
static fps_pool_t *g_pool;
static char g_addr[64];
static char g_ckpt_dir[256];

static void shard_start(const char *mode, bool checkpoints) {
  static bool metrics_once;
  const fps_kernels_t *kernels = NULL;
  char why[256];
  assert_int_equal(fps_kernels_by_name("auto", &kernels, why, sizeof why), 0);
  char *argv[16];
  int argc = 0;
  argv[argc++] = "factorps-server";
  argv[argc++] = "--listen=127.0.0.1:0";
  argv[argc++] = "--threads=2";
  argv[argc++] = "--log-level=error";
  argv[argc++] = "--malloc-tune=false";
  argv[argc++] = "--apply-log=8";
  /* Two kernel threads: the pool path runs only for big tensors, but its
   * creation is part of a running shard. */
  argv[argc++] = "--kernel-threads=1";
  char mode_arg[32];
  snprintf(mode_arg, sizeof mode_arg, "--mode=%s", mode);
  argv[argc++] = mode_arg;
  char dir_arg[300];
  if (checkpoints) {
    snprintf(g_ckpt_dir, sizeof g_ckpt_dir, "/tmp/fps-alloc-sweep-%ld", (long)getpid());
    snprintf(dir_arg, sizeof dir_arg, "--checkpoint-dir=%s", g_ckpt_dir);
    argv[argc++] = dir_arg;
  }
  argv[argc] = NULL;
  assert_int_equal(fps_config_load(&g_srv.cfg, argc, argv), 0);
  if (!metrics_once) {
    metrics_once = true;
    fps_metrics_config_t mc = {.shard_id = 0, .shard_count = 1, .mode = mode, .workers = 1,
                               .simd = fps_kernels_name(kernels), .version = "sweep"};
    fps_metrics_init(&mc);
  }
  pthread_mutex_init(&g_srv.calls_mu, NULL);
  pthread_rwlock_init(&g_srv.batch_gate, NULL);
  g_srv.decode.limit = g_srv.cfg.max_decode_bytes;
  fps_shard_opts_t opts;
  fps_config_shard_opts(&g_srv.cfg, &opts);
  assert_int_equal(fps_shard_new(&opts, kernels, g_pool, &g_srv.shard), 0);
  grpc_init();
  assert_int_equal(fps_timer_create(&g_srv.timer, 0), 0);
  assert_int_equal(fps_timer_add(g_srv.timer, fps_shard_expire, g_srv.shard), 0);
  assert_int_equal(fps_timer_add(g_srv.timer, fps_calls_expire, &g_srv), 0);
  assert_int_equal(fps_timer_start(g_srv.timer), 0);
  assert_int_equal(fps_checkpoint_open(g_srv.shard), 0);
  assert_int_equal(fps_rpc_checkpoint_init(&g_srv), 0);
  assert_int_equal(fps_grpc_start(&g_srv), 0);
  snprintf(g_addr, sizeof g_addr, "127.0.0.1:%d", g_srv.port);
}

static void shard_stop(void) {
  fps_grpc_stop(&g_srv, 0.5);
  fps_rpc_checkpoint_stop(&g_srv);
  fps_timer_destroy(g_srv.timer);
  g_srv.timer = NULL;
  fps_checkpoint_stop(g_srv.shard);
  fps_checkpoint_close(g_srv.shard);
  fps_shard_free(g_srv.shard);
  pthread_mutex_destroy(&g_srv.calls_mu);
  pthread_rwlock_destroy(&g_srv.batch_gate);
  fps_config_free(&g_srv.cfg);
  grpc_shutdown_blocking();
  if (*g_ckpt_dir) {
    DIR *d = opendir(g_ckpt_dir);
    struct dirent *e;
    char p[600];
    while (d && (e = readdir(d))) {
      if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2]))) continue;
      snprintf(p, sizeof p, "%s/%s", g_ckpt_dir, e->d_name);
      unlink(p);
    }
    if (d) closedir(d);
    rmdir(g_ckpt_dir);
    *g_ckpt_dir = 0;
  }
  memset(&g_srv, 0, sizeof g_srv);
}

/* Waits until the shard has no call left (the last one's reply may still
 * be in flight when the client returns), no staging bytes in flight (a
 * reply's snapshot is dropped with its call) and no request held in the
 * decode budget (given back on every path, failures included): an idle
 * shard holds none but its tensors' spares. */
static void shard_settle(void) {
  const uint64_t tbuf = 0;
  for (int i = 0; i < 2000; i++) {
    pthread_mutex_lock(&g_srv.calls_mu);
    uint64_t n = g_srv.ncalls;
    pthread_mutex_unlock(&g_srv.calls_mu);
    if (n == 0 && fps_shard_in_flight_bytes(g_srv.shard) == tbuf && atomic_load(&g_srv.decode.held) == 0) return;
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  fail_msg("the shard still has calls, staging bytes (%" PRIu64 ", want %" PRIu64 ") or decode budget held (%" PRIu64
           ") after 10 s",
           fps_shard_in_flight_bytes(g_srv.shard), tbuf, (uint64_t)atomic_load(&g_srv.decode.held));
}

/* ------------------------------------------------------ the shard's state */

typedef struct tstate_s {
  bool exists;
  uint64_t numel, version, step, restored;
  bool ready;
  float rms;
  double lr, wd;
  fps_state_size_t size;
  uint32_t log_len;
  fps_apply_rec_t log[16];
  float *param, *row, *col, *var, *mom;
} tstate_t;

static float *dup_floats(const float *p, uint64_t n) {
  if (!p) return NULL;
  float *q = malloc((n ? n : 1) * sizeof *q);
  assert_non_null(q);
  memcpy(q, p, n * sizeof *q);
  return q;
}

/* The tensor as the core holds it, copied under its lock. */
static void tstate_take(const char *name, tstate_t *s) {
  memset(s, 0, sizeof *s);
  fps_tensor_t *t = fps_store_find(&g_srv.shard->store, name);
  if (!t) return;
  s->exists = true;
  pthread_mutex_lock(&t->mu);
  s->numel = t->numel;
  s->version = t->version;
  s->ready = t->ready;
  s->step = t->st.step;
  s->rms = t->st.rms;
  s->lr = t->last_lr;
  s->wd = t->last_weight_decay;
  s->restored = t->restored_seq;
  s->size = t->size;
  s->log_len = t->log_len < 16 ? t->log_len : 16;
  for (uint32_t i = 0; i < s->log_len; i++) s->log[i] = t->log[(t->log_head + i) % (t->log_cap ? t->log_cap : 1)];
  s->param = dup_floats(t->param, t->numel);
  s->row = dup_floats(t->st.row, t->size.row);
  s->col = dup_floats(t->st.col, t->size.col);
  s->var = dup_floats(t->st.var, t->size.var);
  s->mom = dup_floats(t->st.mom, t->size.mom);
  pthread_mutex_unlock(&t->mu);
}

static void tstate_free(tstate_t *s) {
  free(s->param);
  free(s->row);
  free(s->col);
  free(s->var);
  free(s->mom);
  memset(s, 0, sizeof *s);
}

static bool floats_equal(const float *a, const float *b, uint64_t n) {
  if (!a || !b) return a == b;
  return memcmp(a, b, n * sizeof *a) == 0;
}

/* Bit for bit; `what` names the comparison in the failure. */
static void tstate_assert_equal(const tstate_t *a, const tstate_t *b, const char *name, const char *what) {
  if (a->exists != b->exists) fail_msg("%s: tensor '%s' %s", what, name, a->exists ? "vanished" : "appeared");
  if (!a->exists) return;
  if (a->version != b->version || a->step != b->step || a->ready != b->ready || a->numel != b->numel)
    fail_msg("%s: tensor '%s': version %" PRIu64 " -> %" PRIu64 ", step %" PRIu64 " -> %" PRIu64 ", ready %d -> %d",
             what, name, a->version, b->version, a->step, b->step, a->ready, b->ready);
  if (memcmp(&a->rms, &b->rms, sizeof a->rms) || memcmp(&a->lr, &b->lr, sizeof a->lr) ||
      memcmp(&a->wd, &b->wd, sizeof a->wd))
    fail_msg("%s: tensor '%s': rms / last lr / last weight decay changed", what, name);
  if (!floats_equal(a->param, b->param, a->numel)) fail_msg("%s: tensor '%s': parameters changed", what, name);
  if (!floats_equal(a->row, b->row, a->size.row) || !floats_equal(a->col, b->col, a->size.col) ||
      !floats_equal(a->var, b->var, a->size.var) || !floats_equal(a->mom, b->mom, a->size.mom))
    fail_msg("%s: tensor '%s': optimizer state changed", what, name);
}

/* Like tstate_assert_equal, for a twin that got the same updates under
 * another name (the apply log names the same workers and steps). */
static void tstate_assert_log_equal(const tstate_t *a, const tstate_t *b, const char *name, const char *what) {
  tstate_assert_equal(a, b, name, what);
  if (a->log_len != b->log_len) fail_msg("%s: tensor '%s': apply log length changed", what, name);
  for (uint32_t i = 0; i < a->log_len; i++)
    if (a->log[i].worker_id != b->log[i].worker_id || a->log[i].step != b->log[i].step ||
        a->log[i].version != b->log[i].version || memcmp(&a->log[i].lr, &b->log[i].lr, sizeof(double)) ||
        memcmp(&a->log[i].weight_decay, &b->log[i].weight_decay, sizeof(double)))
      fail_msg("%s: tensor '%s': apply record %u changed: worker %u step %" PRIu64 " version %" PRIu64
               " lr %g wd %g -> worker %u step %" PRIu64 " version %" PRIu64 " lr %g wd %g",
               what, name, i, a->log[i].worker_id, a->log[i].step, a->log[i].version, a->log[i].lr,
               a->log[i].weight_decay, b->log[i].worker_id, b->log[i].step, b->log[i].version, b->log[i].lr,
               b->log[i].weight_decay);
}

typedef struct shard_state_s {
  uint64_t count, param_bytes, updates, update_bytes, tbuf;
} shard_state_t;

static void shard_state_take(shard_state_t *s) {
  pthread_rwlock_rdlock(&g_srv.shard->store.mu);
  s->count = g_srv.shard->store.count;
  s->param_bytes = g_srv.shard->store.param_bytes;
  pthread_rwlock_unlock(&g_srv.shard->store.mu);
  fps_metrics_totals_t tot; /* the counters are the metrics registry's */
  fps_metrics_totals(&tot);
  s->updates = tot.updates;
  s->update_bytes = tot.update_bytes;
  s->tbuf = fps_shard_in_flight_bytes(g_srv.shard); /* spares are a cache */
}

static void shard_state_assert_equal(const shard_state_t *a, const shard_state_t *b, const char *what) {
  if (a->count != b->count || a->param_bytes != b->param_bytes)
    fail_msg("%s: store changed: %" PRIu64 " -> %" PRIu64 " tensors, %" PRIu64 " -> %" PRIu64 " bytes", what,
             a->count, b->count, a->param_bytes, b->param_bytes);
  if (a->updates != b->updates || a->update_bytes != b->update_bytes)
    fail_msg("%s: update counters moved (%" PRIu64 " -> %" PRIu64 ")", what, a->updates, b->updates);
  if (a->tbuf != b->tbuf) fail_msg("%s: staging bytes in flight %" PRIu64 " -> %" PRIu64, what, a->tbuf, b->tbuf);
}

/* ------------------------------------------------------------ the client */

static fps_client_t *client_new(void) {
  const char *addrs[1] = {g_addr};
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 30;
  o.max_retries = 0; /* a failure must come back as it is */
  fps_status_t st;
  fps_client_t *c = fps_client_create(addrs, 1, &o, &st);
  if (!c) fail_msg("client: %s", st.message);
  return c;
}

static float value(uint32_t a, uint32_t b, uint64_t i) {
  uint32_t h = a * 0x9e3779b9U ^ b * 0x85ebca6bU ^ (uint32_t)i * 0x27d4eb2fU;
  h ^= h >> 15;
  h *= 0x2c1b3c6dU;
  h ^= h >> 12;
  return ((float)(h % 20001u) - 10000.0f) / 10000.0f;
}

static void fill(float *p, uint64_t n, uint32_t a, uint32_t b) {
  for (uint64_t i = 0; i < n; i++) p[i] = value(a, b, i);
}

/* The job: a factored hf tensor with momentum (row, col, mom), a 1-D
 * torch one (var); each with a twin for the push sweeps. */
enum { W_R = 6, W_C = 5, W_N = W_R * W_C, V_N = 9 };

static void def_w(fps_tensor_def_t *d, const char *name, const float *init) {
  memset(d, 0, sizeof *d);
  d->name = name;
  d->ndim = 2;
  d->shape[0] = W_R;
  d->shape[1] = W_C;
  d->optim.flavor = FPS_OPTIM_HF;
  d->optim.has_beta1 = 1;
  d->optim.beta1 = 0.9;
  d->optim.has_relative_step = 1;
  d->optim.relative_step = 0;
  d->optim.has_lr = 1;
  d->optim.lr = 0.01;
  d->init = init;
}

static void def_v(fps_tensor_def_t *d, const char *name, const float *init) {
  memset(d, 0, sizeof *d);
  d->name = name;
  d->ndim = 1;
  d->shape[0] = V_N;
  d->optim.flavor = FPS_OPTIM_TORCH;
  d->optim.has_lr = 1;
  d->optim.lr = 0.01;
  d->init = init;
}

static float g_w0[W_N], g_v0[V_N];

static void create_job(fps_client_t *c) {
  fps_tensor_def_t d[4];
  fill(g_w0, W_N, 1, 0);
  fill(g_v0, V_N, 2, 0);
  def_w(&d[0], "w", g_w0);
  def_v(&d[1], "v", g_v0);
  def_w(&d[2], "w_twin", g_w0);
  def_v(&d[3], "v_twin", g_v0);
  fps_status_t st;
  if (fps_client_create_tensors(c, d, 4, &st) != 0) fail_msg("create: %s", st.message);
}

/* A failed call's status: RESOURCE_EXHAUSTED naming memory, or INTERNAL
 * with a message. */
static void assert_oom_status(int rc, const fps_status_t *st, const char *what, uint64_t n) {
  if (rc == FPS_CODE_RESOURCE_EXHAUSTED) {
    if (!strstr(st->message, "memory"))
      fail_msg("%s, allocation %" PRIu64 " failed: RESOURCE_EXHAUSTED without saying what ran out: %s", what, n,
               st->message);
    return;
  }
  if (rc == FPS_CODE_INTERNAL && *st->message) return;
  fail_msg("%s, allocation %" PRIu64 " failed: got %s: %s", what, n, fps_code_name(rc), st->message);
}

/* ------------------------------------------------------------ the sweep */

/* One case: `call` runs the method once (what: its name), `check` asserts
 * that the shard is exactly as `before` said, `good` repeats the call
 * without a fault and checks its result. Each returns the client's code. */
typedef struct sweep_s {
  const char *what;
  fps_client_t *c;
  uint64_t iter;      /* sweep index, for names and gradients */
  void *before;       /* the case's snapshot of the shard */
  void (*take)(struct sweep_s *);
  int (*call)(struct sweep_s *, fps_status_t *);
  void (*check)(struct sweep_s *); /* after a failed call */
  void (*good)(struct sweep_s *);  /* the call again, no fault, must succeed */
  void (*release)(struct sweep_s *);
  uint64_t after_commit; /* pushes that failed after being applied whole */
} sweep_t;

static void sweep_run(sweep_t *s) {
  uint64_t injected = 0, absorbed = 0, n;
  for (n = 1; n <= SWEEP_MAX; n++) {
    s->iter = n;
    shard_settle();
    shard_state_t sh0;
    shard_state_take(&sh0);
    s->take(s);
    fps_status_t st;
    memset(&st, 0, sizeof st);
    fps_alloc_fault_arm(n, 0);
    int rc = s->call(s, &st);
    shard_settle();
    fps_alloc_fault_disarm();
    uint64_t failed = fps_alloc_failures();
    if (failed == 0) {
      /* The call made fewer than n allocations: the sweep is complete. */
      if (rc != 0) fail_msg("%s without a fault: %s: %s", s->what, fps_code_name(rc), st.message);
      s->release(s);
      break;
    }
    injected += failed;
    char what[128];
    snprintf(what, sizeof what, "%s, allocation %" PRIu64 " of the shard failed", s->what, n);
    if (rc == 0) {
      /* The failure was absorbed (an optional buffer): the call's ordinary
       * result, which `good` checks (a push's retry must be a replay). */
      absorbed++;
    } else {
      assert_oom_status(rc, &st, s->what, n);
      uint64_t after = s->after_commit;
      s->check(s);
      shard_state_t sh1;
      shard_state_take(&sh1);
      if (s->after_commit != after) sh0.updates = sh1.updates, sh0.update_bytes = sh1.update_bytes;
      shard_state_assert_equal(&sh0, &sh1, what);
    }
    s->good(s);
    s->release(s);
  }
  if (n > SWEEP_MAX) fail_msg("%s: still allocating after %d calls", s->what, SWEEP_MAX);
  printf("sweep %s: %" PRIu64 " calls swept (%" PRIu64 " allocations), %" PRIu64
         " failures injected: %" PRIu64 " refused with state unchanged, %" PRIu64
         " refused after the push was applied whole (reply lost; the retry replayed it), %" PRIu64
         " absorbed (call OK)\n",
         s->what, n, n - 1, injected, injected - absorbed - s->after_commit, s->after_commit, absorbed);
}

/* ---------------------------------------------------------------- Create */

typedef struct create_case_s {
  tstate_t w, a, b;
  char an[32], bn[32];
  float a0[W_N], b0[V_N];
} create_case_t;

static void create_names(sweep_t *s, create_case_t *cc) {
  snprintf(cc->an, sizeof cc->an, "a%" PRIu64, s->iter);
  snprintf(cc->bn, sizeof cc->bn, "b%" PRIu64, s->iter);
  fill(cc->a0, W_N, 3, (uint32_t)s->iter);
  fill(cc->b0, V_N, 4, (uint32_t)s->iter);
}

static void create_take(sweep_t *s) {
  create_case_t *cc = s->before;
  create_names(s, cc);
  tstate_take("w", &cc->w);
  tstate_take(cc->an, &cc->a);
  tstate_take(cc->bn, &cc->b);
  assert_false(cc->a.exists || cc->b.exists);
}

/* One Create of three tensors: "w" exists (matched, its values ignored),
 * a<i> (factored hf) and b<i> (1-D torch) are new, with values. */
static int create_call(sweep_t *s, fps_status_t *st) {
  create_case_t *cc = s->before;
  fps_tensor_def_t d[3];
  float other[W_N];
  fill(other, W_N, 9, 9);
  def_w(&d[0], "w", other);
  def_w(&d[1], cc->an, cc->a0);
  def_v(&d[2], cc->bn, cc->b0);
  return fps_client_create_tensors(s->c, d, 3, st);
}

static void create_check(sweep_t *s) {
  create_case_t *cc = s->before;
  tstate_t now;
  tstate_take("w", &now);
  tstate_assert_log_equal(&cc->w, &now, "w", s->what);
  tstate_free(&now);
  tstate_take(cc->an, &now);
  if (now.exists) fail_msg("%s: tensor '%s' exists after a failed Create", s->what, cc->an);
  tstate_take(cc->bn, &now);
  if (now.exists) fail_msg("%s: tensor '%s' exists after a failed Create", s->what, cc->bn);
}

static void create_good(sweep_t *s) {
  create_case_t *cc = s->before;
  fps_status_t st;
  int rc = create_call(s, &st);
  if (rc != 0) fail_msg("%s: the shard no longer serves Create: %s", s->what, st.message);
  tstate_t a, b;
  tstate_take(cc->an, &a);
  tstate_take(cc->bn, &b);
  assert_true(a.exists && a.ready && b.exists && b.ready);
  assert_true(floats_equal(a.param, cc->a0, W_N));
  assert_true(floats_equal(b.param, cc->b0, V_N));
  tstate_free(&a);
  tstate_free(&b);
}

static void create_release(sweep_t *s) {
  create_case_t *cc = s->before;
  tstate_free(&cc->w);
  tstate_free(&cc->a);
  tstate_free(&cc->b);
}

static void test_sweep_create(void **unused) {
  (void)unused;
  shard_start("async", false);
  fps_client_t *c = client_new();
  create_job(c);
  create_case_t cc;
  memset(&cc, 0, sizeof cc);
  sweep_t s = {.what = "Create", .c = c, .before = &cc, .take = create_take, .call = create_call,
               .check = create_check, .good = create_good, .release = create_release};
  sweep_run(&s);
  fps_client_destroy(c);
  shard_stop();
}

/* -------------------------------------------------------------- PushPull */

typedef struct push_case_s {
  tstate_t w, v, wt, vt;
  float gw[W_N], gv[V_N];
  float pw[W_N], pv[V_N];
  uint64_t push_id;
} push_case_t;

static void push_take(sweep_t *s) {
  push_case_t *pc = s->before;
  tstate_take("w", &pc->w);
  tstate_take("v", &pc->v);
  tstate_take("w_twin", &pc->wt);
  tstate_take("v_twin", &pc->vt);
  fill(pc->gw, W_N, 5, (uint32_t)s->iter);
  fill(pc->gv, V_N, 6, (uint32_t)s->iter);
  pc->push_id = 0x5eed0000u + s->iter;
}

static int push_names(sweep_t *s, fps_status_t *st, const char *wn, const char *vn, uint64_t push_id,
                      uint64_t *vers) {
  push_case_t *pc = s->before;
  const char *names[2] = {wn, vn};
  const float *grads[2] = {pc->gw, pc->gv};
  float *params[2] = {pc->pw, pc->pv};
  fps_push_args_t a = {.worker_id = 0, .step = pc->w.version, .push_id = push_id};
  return fps_client_push_pull_ex(s->c, &a, names, grads, NULL, params, vers, 2, st);
}

static int push_call(sweep_t *s, fps_status_t *st) {
  push_case_t *pc = s->before;
  return push_names(s, st, "w", "v", pc->push_id, NULL);
}

/* Nothing applied; or, when the failure came while the reply was built,
 * the whole push applied once (every tensor one version on), which the
 * retry must then replay, not apply again (push_good). Never part of it. */
static void push_check(sweep_t *s) {
  push_case_t *pc = s->before;
  tstate_t w, v;
  tstate_take("w", &w);
  tstate_take("v", &v);
  if (w.version == pc->w.version + 1 && v.version == pc->v.version + 1) {
    s->after_commit++;
  } else {
    tstate_assert_log_equal(&pc->w, &w, "w", s->what);
    tstate_assert_log_equal(&pc->v, &v, "v", s->what);
  }
  tstate_free(&w);
  tstate_free(&v);
}

/* The failed call's retry (same push_id) is applied once, and leaves w and
 * v exactly as the same gradients leave the twins. */
static void push_good(sweep_t *s) {
  push_case_t *pc = s->before;
  fps_status_t st;
  uint64_t vers[2], tvers[2];
  int rc = push_names(s, &st, "w", "v", pc->push_id, vers);
  if (rc != 0) fail_msg("%s: the shard no longer serves PushPull: %s", s->what, st.message);
  float rw[W_N], rv[V_N];
  memcpy(rw, pc->pw, sizeof rw);
  memcpy(rv, pc->pv, sizeof rv);
  rc = push_names(s, &st, "w_twin", "v_twin", pc->push_id + 0x100000000ull, tvers);
  if (rc != 0) fail_msg("%s: twin push: %s", s->what, st.message);
  assert_int_equal(vers[0], pc->w.version + 1);
  assert_int_equal(vers[1], pc->v.version + 1);
  assert_memory_equal(rw, pc->pw, sizeof rw);
  assert_memory_equal(rv, pc->pv, sizeof rv);
  tstate_t w, v, wt, vt;
  tstate_take("w", &w);
  tstate_take("v", &v);
  tstate_take("w_twin", &wt);
  tstate_take("v_twin", &vt);
  tstate_assert_log_equal(&wt, &w, "w", "the retried push against its twin");
  tstate_assert_log_equal(&vt, &v, "v", "the retried push against its twin");
  tstate_free(&w);
  tstate_free(&v);
  tstate_free(&wt);
  tstate_free(&vt);
}

static void push_release(sweep_t *s) {
  push_case_t *pc = s->before;
  tstate_free(&pc->w);
  tstate_free(&pc->v);
  tstate_free(&pc->wt);
  tstate_free(&pc->vt);
}

static void push_sweep(const char *mode, const char *what) {
  shard_start(mode, false);
  fps_client_t *c = client_new();
  create_job(c);
  push_case_t pc;
  memset(&pc, 0, sizeof pc);
  sweep_t s = {.what = what, .c = c, .before = &pc, .take = push_take, .call = push_call,
               .check = push_check, .good = push_good, .release = push_release};
  sweep_run(&s);
  fps_client_destroy(c);
  shard_stop();
}

static void test_sweep_pushpull_async(void **unused) {
  (void)unused;
  push_sweep("async", "PushPull async");
}

static void test_sweep_pushpull_sync(void **unused) {
  (void)unused;
  push_sweep("sync", "PushPull sync");
}

/* ------------------------------------- Pull, Stats, GetState, Checkpoint */

/* The read-only methods: the job's four tensors must not change at all. */
typedef struct read_case_s {
  tstate_t t[4];
  char listing[4096];   /* Checkpoint: the directory's files and sizes */
} read_case_t;

static const char *const g_names[4] = {"w", "v", "w_twin", "v_twin"};

static void dir_listing(char *out, size_t len) {
  *out = 0;
  if (!*g_ckpt_dir) return;
  DIR *d = opendir(g_ckpt_dir);
  assert_non_null(d);
  struct dirent *e;
  size_t o = 0;
  char *names[64];
  size_t n = 0;
  while ((e = readdir(d)) && n < 64)
    if (e->d_name[0] != '.') names[n++] = strdup(e->d_name);
  closedir(d);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++)
      if (strcmp(names[j], names[i]) < 0) {
        char *x = names[i];
        names[i] = names[j];
        names[j] = x;
      }
  for (size_t i = 0; i < n; i++) {
    char p[600];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", g_ckpt_dir, names[i]);
    long long sz = stat(p, &sb) == 0 ? (long long)sb.st_size : -1;
    o += (size_t)snprintf(out + o, o < len ? len - o : 0, "%s:%lld ", names[i], sz);
    free(names[i]);
  }
}

static void read_take(sweep_t *s) {
  read_case_t *rc = s->before;
  for (int i = 0; i < 4; i++) tstate_take(g_names[i], &rc->t[i]);
  dir_listing(rc->listing, sizeof rc->listing);
}

static void read_check(sweep_t *s) {
  read_case_t *rc = s->before;
  for (int i = 0; i < 4; i++) {
    tstate_t now;
    tstate_take(g_names[i], &now);
    tstate_assert_log_equal(&rc->t[i], &now, g_names[i], s->what);
    tstate_free(&now);
  }
  char now[4096];
  dir_listing(now, sizeof now);
  if (strcmp(now, rc->listing))
    fail_msg("%s: the checkpoint directory changed: [%s] -> [%s]", s->what, rc->listing, now);
}

static void read_release(sweep_t *s) {
  read_case_t *rc = s->before;
  for (int i = 0; i < 4; i++) tstate_free(&rc->t[i]);
}

static int pull_call(sweep_t *s, fps_status_t *st) {
  float w[W_N], v[V_N];
  float *params[2] = {w, v};
  uint64_t vers[2];
  const char *names[2] = {"w", "v"};
  (void)s;
  return fps_client_pull(s->c, names, params, vers, 2, st);
}

static void pull_good(sweep_t *s) {
  read_case_t *rc = s->before;
  float w[W_N], v[V_N];
  float *params[2] = {w, v};
  uint64_t vers[2];
  const char *names[2] = {"w", "v"};
  fps_status_t st;
  if (fps_client_pull(s->c, names, params, vers, 2, &st) != 0)
    fail_msg("%s: the shard no longer serves Pull: %s", s->what, st.message);
  assert_memory_equal(w, rc->t[0].param, sizeof w);
  assert_memory_equal(v, rc->t[1].param, sizeof v);
  assert_int_equal(vers[0], rc->t[0].version);
  assert_int_equal(vers[1], rc->t[1].version);
}

static int stats_call(sweep_t *s, fps_status_t *st) {
  fps_shard_stats_t ss;
  int rc = fps_client_stats(s->c, &ss, 1, st);
  if (rc != 0) return rc;
  fps_tensor_stats_t ts;
  fps_apply_record_t log[8];
  size_t nlog = 0;
  return fps_client_tensor_stats(s->c, "w", &ts, log, 8, &nlog, st);
}

static void stats_good(sweep_t *s) {
  read_case_t *rc = s->before;
  fps_shard_stats_t ss;
  fps_status_t st;
  if (fps_client_stats(s->c, &ss, 1, &st) != 0) fail_msg("%s: the shard no longer serves Stats: %s", s->what, st.message);
  assert_int_equal(ss.tensors, 4);
  fps_tensor_stats_t ts;
  fps_apply_record_t log[8];
  size_t nlog = 0;
  if (fps_client_tensor_stats(s->c, "w", &ts, log, 8, &nlog, &st) != 0)
    fail_msg("%s: the shard no longer serves Stats: %s", s->what, st.message);
  assert_int_equal(ts.version, rc->t[0].version);
  assert_int_equal(nlog, rc->t[0].log_len < 8 ? rc->t[0].log_len : 8);
}

static int getstate_into(sweep_t *s, fps_status_t *st, fps_tensor_state_t *info, float *wrow, float *wcol,
                         float *wmom, float *vvar) {
  const char *names[2] = {"w", "v"};
  float *row[2] = {wrow, NULL}, *col[2] = {wcol, NULL}, *var[2] = {NULL, vvar}, *mom[2] = {wmom, NULL};
  return fps_client_get_state(s->c, names, 2, info, row, col, var, mom, st);
}

static int getstate_call(sweep_t *s, fps_status_t *st) {
  fps_tensor_state_t info[2];
  float wrow[W_R], wcol[W_C], wmom[W_N], vvar[V_N];
  return getstate_into(s, st, info, wrow, wcol, wmom, vvar);
}

static void getstate_good(sweep_t *s) {
  read_case_t *rc = s->before;
  fps_tensor_state_t info[2];
  float wrow[W_R], wcol[W_C], wmom[W_N], vvar[V_N];
  fps_status_t st;
  if (getstate_into(s, &st, info, wrow, wcol, wmom, vvar) != 0)
    fail_msg("%s: the shard no longer serves GetState: %s", s->what, st.message);
  assert_int_equal(rc->t[0].size.row, W_R);
  assert_memory_equal(wrow, rc->t[0].row, sizeof wrow);
  assert_memory_equal(wcol, rc->t[0].col, sizeof wcol);
  assert_memory_equal(wmom, rc->t[0].mom, sizeof wmom);
  assert_memory_equal(vvar, rc->t[1].var, sizeof vvar);
  assert_int_equal(info[0].step, rc->t[0].step);
}

static int checkpoint_call(sweep_t *s, fps_status_t *st) {
  fps_checkpoint_info_t info;
  return fps_client_checkpoint(s->c, &info, 1, st);
}

static void checkpoint_good(sweep_t *s) {
  fps_checkpoint_info_t info;
  fps_status_t st;
  if (fps_client_checkpoint(s->c, &info, 1, &st) != 0)
    fail_msg("%s: the shard no longer serves Checkpoint: %s", s->what, st.message);
  assert_int_equal(info.tensors, 4);
  struct stat sb;
  assert_int_equal(stat(info.path, &sb), 0);
  assert_int_equal((uint64_t)sb.st_size, info.bytes);
}

/* A few updates first, so the state and the apply logs are not trivial. */
static void read_job(fps_client_t *c) {
  create_job(c);
  float gw[W_N], gv[V_N], pw[W_N], pv[V_N];
  for (uint64_t k = 0; k < 3; k++) {
    fill(gw, W_N, 7, (uint32_t)k);
    fill(gv, V_N, 8, (uint32_t)k);
    const char *names[4] = {"w", "v", "w_twin", "v_twin"};
    const float *grads[4] = {gw, gv, gw, gv};
    float *params[4] = {pw, pv, pw, pv};
    fps_status_t st;
    if (fps_client_push_pull(c, 0, k, names, grads, params, NULL, 4, &st) != 0) fail_msg("push: %s", st.message);
  }
}

static void read_sweep(const char *what, bool checkpoints, int (*call)(sweep_t *, fps_status_t *),
                       void (*good)(sweep_t *)) {
  shard_start("async", checkpoints);
  fps_client_t *c = client_new();
  read_job(c);
  read_case_t rc;
  memset(&rc, 0, sizeof rc);
  sweep_t s = {.what = what, .c = c, .before = &rc, .take = read_take, .call = call,
               .check = read_check, .good = good, .release = read_release};
  sweep_run(&s);
  fps_client_destroy(c);
  shard_stop();
}

static void test_sweep_pull(void **unused) {
  (void)unused;
  read_sweep("Pull", false, pull_call, pull_good);
}

static void test_sweep_stats(void **unused) {
  (void)unused;
  read_sweep("Stats", false, stats_call, stats_good);
}

static void test_sweep_getstate(void **unused) {
  (void)unused;
  read_sweep("GetState", false, getstate_call, getstate_good);
}

static void test_sweep_checkpoint(void **unused) {
  (void)unused;
  read_sweep("Checkpoint", true, checkpoint_call, checkpoint_good);
}

int main(int argc, char **argv) {
  const struct CMUnitTest all[] = {
      cmocka_unit_test(test_sweep_create),         cmocka_unit_test(test_sweep_pushpull_async),
      cmocka_unit_test(test_sweep_pushpull_sync),  cmocka_unit_test(test_sweep_pull),
      cmocka_unit_test(test_sweep_stats),          cmocka_unit_test(test_sweep_getstate),
      cmocka_unit_test(test_sweep_checkpoint),
  };
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return cmocka_run_group_tests(all, NULL, NULL);
}

/* Integration tests of libfactorps against real factorps-server processes:
 * 2 shards x 3 workers in every mode, checked against a local replay
 * through the kernel (fps_adafactor_step):
 *   sync   bit for bit: the gradients are averaged exactly as the shard
 *          does (server/sync.c: fp32 sum in worker-id order, then one
 *          division by (float)W), then one step per round.
 *   async  bit for bit against a replay in the shard's applied order, read
 *   ssp    from Stats.apply_log (worker_id, step) per tensor.
 * The same with pushes cut into chunk calls (push_chunk_bytes).
 * Also: placement is deterministic and balanced and matches where the
 * shards hold the tensors; an unreachable shard gives UNAVAILABLE within the
 * deadline; a tensor created on the wrong shard is refused.
 *
 * Messages are capped at 64 KiB in the client so tensors travel in many
 * slices. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "adafactor.h"
#include "dtype.h"
#include "factorps/client.h"
#include "harness.h"

#define SHARDS 2
#define WORKERS 3
#define STEPS 4
#define MSG_BYTES (64u * 1024u)

/* ------------------------------------------------------------ the model */

typedef struct model_s {
  fps_tensor_def_t defs[8];
  size_t n;
  uint64_t numel[8];
} model_t;

static void model_add(model_t *m, const char *name, uint32_t ndim, const uint64_t *shape,
                      fps_optim_config_t optim) {
  fps_tensor_def_t *d = &m->defs[m->n];
  memset(d, 0, sizeof *d);
  d->name = name;
  d->ndim = ndim;
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndim; i++) {
    d->shape[i] = shape[i];
    n *= shape[i];
  }
  d->optim = optim;
  m->numel[m->n++] = n;
}

/* Shapes and both flavors: a multi-slice matrix, a batch of matrices, 1-D
 * tensors (one larger than a message), a scalar, hf with momentum. */
static void model_init(model_t *m) {
  fps_optim_config_t torch = {.flavor = FPS_OPTIM_TORCH};
  fps_optim_config_t torch_lr = {.flavor = FPS_OPTIM_TORCH, .has_lr = 1, .lr = 3e-2,
                                 .has_weight_decay = 1, .weight_decay = 0.01};
  fps_optim_config_t hf = {.flavor = FPS_OPTIM_HF};
  fps_optim_config_t hf_mom = {.flavor = FPS_OPTIM_HF, .has_relative_step = 1,
                               .relative_step = 0, .has_lr = 1, .lr = 1e-3, .has_beta1 = 1,
                               .beta1 = 0.9};
  memset(m, 0, sizeof *m);
  model_add(m, "embed", 2, (uint64_t[]){300, 100}, torch_lr);
  model_add(m, "w1", 2, (uint64_t[]){64, 33}, torch);
  model_add(m, "b1", 1, (uint64_t[]){7}, torch);
  model_add(m, "t3", 3, (uint64_t[]){2, 3, 4}, hf);
  model_add(m, "w2", 2, (uint64_t[]){40, 50}, hf_mom);
  model_add(m, "scale", 0, NULL, torch);
  model_add(m, "long", 1, (uint64_t[]){70000}, torch);
}

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

/* Deterministic values in [-scale, scale] from (a, b, c, i). */
static float value(uint32_t a, uint32_t b, uint32_t c, uint64_t i, float scale) {
  uint32_t h = mix(a * 0x9e3779b9U ^ mix(b * 0x85ebca6bU ^ mix(c ^ mix((uint32_t)i))));
  return ((float)(h % 20001u) - 10000.0f) / 10000.0f * scale;
}

static void fill_init(float *v, size_t t, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) v[i] = value(1000, 0, (uint32_t)t, i, 0.5f);
}

static void fill_grad(float *v, uint32_t worker, uint64_t step, size_t t, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) v[i] = value(worker + 1, (uint32_t)step + 1, (uint32_t)t, i, 1.0f);
}

static fps_adafactor_hparams_t hparams_of(const fps_optim_config_t *o) {
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, o->flavor == FPS_OPTIM_HF ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
  if (o->has_lr) {
    hp.has_lr = true;
    hp.lr = o->lr;
  }
  if (o->has_beta2_decay) hp.decay = o->beta2_decay;
  if (o->has_eps1) hp.eps1 = o->eps1;
  if (o->has_eps2) hp.eps2 = o->eps2;
  if (o->has_clip_threshold) hp.clip = o->clip_threshold;
  if (o->has_weight_decay) hp.weight_decay = o->weight_decay;
  if (o->has_maximize) hp.maximize = o->maximize;
  if (o->has_relative_step) hp.relative_step = o->relative_step;
  if (o->has_scale_parameter) hp.scale_parameter = o->scale_parameter;
  if (o->has_warmup_init) hp.warmup_init = o->warmup_init;
  if (o->has_beta1) {
    hp.has_beta1 = true;
    hp.beta1 = o->beta1;
  }
  return hp;
}

/* A local replica of one tensor: the kernel's state and parameters. */
typedef struct replica_s {
  fps_adafactor_hparams_t hp;
  fps_adafactor_state_t st;
  float *param;
} replica_t;

static void replica_init(replica_t *r, const model_t *m, size_t t) {
  const fps_tensor_def_t *d = &m->defs[t];
  fps_shape_t shape = {.ndim = d->ndim};
  memset(r, 0, sizeof *r);
  for (uint32_t i = 0; i < d->ndim; i++) shape.dim[i] = d->shape[i];
  r->hp = hparams_of(&d->optim);
  assert_int_equal(fps_adafactor_state_init(&r->st, &shape, &r->hp), 0);
  r->param = malloc(m->numel[t] * sizeof *r->param);
  assert_non_null(r->param);
  fill_init(r->param, t, m->numel[t]);
}

static void replica_step(replica_t *r, const float *grad) {
  assert_int_equal(fps_adafactor_step(NULL, &r->hp, &r->st, r->param, grad, NULL, NULL), 0);
}

static void replica_free(replica_t *r) {
  fps_adafactor_state_destroy(&r->st);
  free(r->param);
}

/* x = bf16(x), as the client and the shard round (common/dtype.h). */
static void round_bf16(float *x, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) x[i] = fps_bf16_to_f32(fps_f32_to_bf16(x[i]));
}

/* Bit-for-bit comparison that names the first differing element. */
static void assert_same_floats(const char *what, const float *got, const float *want, uint64_t n) {
  if (memcmp(got, want, n * sizeof *got) == 0) return;
  for (uint64_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof *got)) {
      fail_msg("%s: element %llu is %.9g, the replay has %.9g", what, (unsigned long long)i,
               (double)got[i], (double)want[i]);
    }
}

/* Checks a call's code, and shows the status message when it differs. */
#define assert_code(rc, want, st)                                                       \
  do {                                                                                  \
    int rc_ = (rc);                                                                     \
    if (rc_ != (want))                                                                  \
      fail_msg("got %s, want %s: %s", fps_code_name(rc_), fps_code_name(want),          \
               (st).message);                                                           \
  } while (0)

/* --------------------------------------------------------- the workers */

typedef struct job_s {
  const model_t *m;
  fps_test_server_t *srv;
  int sync;                       /* all workers push in lock-step rounds */
  fps_client_t *shared;           /* if set: every worker uses this client
                                     (tensors already created) and gets its
                                     params in its gradient buffers */
} job_t;

typedef struct worker_s {
  const job_t *job;
  uint32_t id;
  float *params[8];               /* after the last push */
  uint64_t versions[8];
  int rc;
  fps_status_t st;
  pthread_t thread;
} worker_t;

/* The clients' wire_dtype (0: the default, fp32). */
static int g_wire_dtype;
/* The clients' push_chunk_bytes; 0: the library default (these models are
 * far below it: one call per shard). */
static uint64_t g_push_chunk;

static fps_client_t *client_new(fps_test_server_t *srv, int n, double deadline,
                                fps_status_t *st) {
  const char *addrs[SHARDS];
  fps_client_options_t o;
  for (int i = 0; i < n; i++) addrs[i] = srv[i].addr;
  fps_client_options_init(&o);
  o.max_message_bytes = MSG_BYTES;
  o.deadline_seconds = deadline;
  o.wire_dtype = g_wire_dtype;
  if (g_push_chunk) o.push_chunk_bytes = g_push_chunk;
  return fps_client_create(addrs, (size_t)n, &o, st);
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  const model_t *m = w->job->m;
  fps_tensor_def_t defs[8];
  float *init[8] = {0}, *grads[8] = {0};
  const char *names[8];
  fps_client_t *c = w->job->shared ? w->job->shared : client_new(w->job->srv, SHARDS, 30, &w->st);
  w->rc = -1;
  if (!c) return NULL;
  for (size_t t = 0; t < m->n; t++) {
    defs[t] = m->defs[t];
    names[t] = m->defs[t].name;
    grads[t] = malloc(m->numel[t] * sizeof(float));
    w->params[t] = malloc(m->numel[t] * sizeof(float));
    /* Worker 0 supplies the values; the others wait for them. */
    if (w->id == 0) {
      init[t] = malloc(m->numel[t] * sizeof(float));
      fill_init(init[t], t, m->numel[t]);
    }
    defs[t].init = init[t];
  }
  if (!w->job->shared && (w->rc = fps_client_create_tensors(c, defs, m->n, &w->st))) goto done;
  for (uint64_t s = 0; s < STEPS; s++) {
    for (size_t t = 0; t < m->n; t++) fill_grad(grads[t], w->id, s, t, m->numel[t]);
    /* With a shared client, params alias the gradients (allowed). */
    w->rc = fps_client_push_pull(c, w->id, s, names, (const float *const *)grads,
                                 w->job->shared ? grads : w->params, w->versions, m->n, &w->st);
    if (w->rc) goto done;
  }
  if (w->job->shared)
    for (size_t t = 0; t < m->n; t++) memcpy(w->params[t], grads[t], m->numel[t] * sizeof(float));
  w->rc = 0;
done:
  for (size_t t = 0; t < m->n; t++) {
    free(init[t]);
    free(grads[t]);
  }
  if (!w->job->shared) fps_client_destroy(c);
  return NULL;
}

static void run_workers(const job_t *job, worker_t *ws) {
  for (uint32_t i = 0; i < WORKERS; i++) {
    memset(&ws[i], 0, sizeof ws[i]);
    ws[i].job = job;
    ws[i].id = i;
    assert_int_equal(pthread_create(&ws[i].thread, NULL, worker_main, &ws[i]), 0);
  }
  for (uint32_t i = 0; i < WORKERS; i++) pthread_join(ws[i].thread, NULL);
  for (uint32_t i = 0; i < WORKERS; i++)
    if (ws[i].rc)
      fail_msg("worker %u: %s: %s", i, fps_code_name(ws[i].st.code), ws[i].st.message);
}

static void free_workers(worker_t *ws, const model_t *m) {
  for (uint32_t i = 0; i < WORKERS; i++)
    for (size_t t = 0; t < m->n; t++) free(ws[i].params[t]);
}

/* ------------------------------------------------------------- tests */

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  return 0;
}

/* With g_push_chunk set, each push really went to each shard as several
 * calls (the shard counts one push per call), so the chunked tests cannot
 * pass on the one-call path. */
static void assert_chunked(fps_test_server_t *srv) {
  fps_status_t st;
  fps_shard_stats_t ss[SHARDS];
  int many = 0;
  fps_client_t *c = client_new(srv, SHARDS, 30, &st);
  assert_non_null(c);
  assert_code(fps_client_stats(c, ss, SHARDS, &st), 0, st);
  for (int i = 0; i < SHARDS; i++) {
    print_message("shard %d: %llu tensors, %llu pushes in %d steps of %d workers\n", i,
                  (unsigned long long)ss[i].tensors, (unsigned long long)ss[i].pushes, STEPS, WORKERS);
    /* A shard of one tensor gets one call per push either way. */
    if (ss[i].tensors >= 2) assert_true(ss[i].pushes >= 2 * WORKERS * STEPS);
    many += ss[i].tensors >= 2;
  }
  assert_true(many > 0);
  fps_client_destroy(c);
}

static void sync_run(int shared) {
  model_t m;
  fps_test_server_t srv[SHARDS];
  worker_t ws[WORKERS];
  model_init(&m);
  const char *extra[] = {"--deadline", "30", NULL};
  assert_int_equal(fps_test_servers_start(srv, SHARDS, "sync", WORKERS, extra), 0);
  job_t job = {&m, srv, 1, NULL};
  fps_status_t st;
  if (shared) {
    fps_tensor_def_t defs[8];
    float *init[8];
    for (size_t t = 0; t < m.n; t++) {
      defs[t] = m.defs[t];
      init[t] = malloc(m.numel[t] * sizeof(float));
      fill_init(init[t], t, m.numel[t]);
      defs[t].init = init[t];
    }
    job.shared = client_new(srv, SHARDS, 30, &st);
    assert_non_null(job.shared);
    assert_code(fps_client_create_tensors(job.shared, defs, m.n, &st), 0, st);
    for (size_t t = 0; t < m.n; t++) free(init[t]);
  }
  run_workers(&job, ws);
  fps_client_destroy(job.shared);

  for (size_t t = 0; t < m.n; t++) {
    uint64_t n = m.numel[t];
    replica_t r;
    float *sum = malloc(n * sizeof *sum), *g = malloc(n * sizeof *g);
    replica_init(&r, &m, t);
    for (uint64_t s = 0; s < STEPS; s++) {
      /* The shard's arithmetic: ((g0 + g1) + g2) in fp32, then / (float)W;
       * with bf16 on the wire, of the gradients rounded to bf16. */
      fill_grad(sum, 0, s, t, n);
      if (g_wire_dtype == FPS_WIRE_BF16) round_bf16(sum, n);
      for (uint32_t w = 1; w < WORKERS; w++) {
        fill_grad(g, w, s, t, n);
        if (g_wire_dtype == FPS_WIRE_BF16) round_bf16(g, n);
        for (uint64_t i = 0; i < n; i++) sum[i] += g[i];
      }
      for (uint64_t i = 0; i < n; i++) sum[i] /= (float)WORKERS;
      replica_step(&r, sum);
    }
    /* The shard keeps fp32 weights and sends them back rounded. */
    if (g_wire_dtype == FPS_WIRE_BF16) round_bf16(r.param, n);
    for (uint32_t w = 0; w < WORKERS; w++) {
      char what[128];
      snprintf(what, sizeof what, "sync%s: worker %u, tensor '%s'", shared ? " (shared client)" : "", w,
               m.defs[t].name);
      assert_int_equal(ws[w].versions[t], STEPS);
      assert_same_floats(what, ws[w].params[t], r.param, n);
    }
    replica_free(&r);
    free(sum);
    free(g);
  }
  free_workers(ws, &m);
  if (g_push_chunk) assert_chunked(srv);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

/* CTest also runs this once per SIMD variant (FACTORPS_SIMD, read by
 * both the shards and the local replay): the sync sum must match the plain
 * loop above bit for bit in each. */
static void test_sync_matches_replay(void **state) {
  (void)state;
  const char *simd = getenv("FACTORPS_SIMD");
  if (simd && *simd) {
    const fps_kernels_t *k;
    char why[256];
    if (fps_kernels_by_name(simd, &k, why, sizeof why) == FPS_EUNSUPPORTED) {
      print_message("skipping: %s\n", why);
      skip();
    }
  }
  sync_run(0);
}

/* One client used by all three worker threads at once. */
static void test_sync_shared_client(void **state) {
  (void)state;
  sync_run(1);
}

/* bf16 on the wire: the shard sums the bf16 gradients in fp32, steps its
 * fp32 weights and replies in bf16; one worker per client, and all on one
 * client with params aliasing the gradients. */
static void test_sync_bf16_matches_replay(void **state) {
  (void)state;
  fps_status_t st;
  fps_test_server_t none[SHARDS] = {{.addr = "127.0.0.1:1"}, {.addr = "127.0.0.1:1"}};
  g_wire_dtype = 3; /* not a dtype: refused before any connection */
  assert_null(client_new(none, SHARDS, 1, &st));
  assert_int_equal(st.code, FPS_CODE_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "wire_dtype"));
  g_wire_dtype = FPS_WIRE_BF16;
  sync_run(0);
  sync_run(1);
  g_wire_dtype = 0;
}

/* Pushes cut into chunks (a call per tensor, or per few small ones; the
 * 64 KiB messages cut the larger ones further) give the same parameters,
 * bit for bit, as the replay the one-call path matches above; one client
 * per worker and one shared by all, fp32 and bf16. */
static void test_sync_chunked_matches_replay(void **state) {
  (void)state;
  g_push_chunk = 1;
  sync_run(0);
  sync_run(1);
  g_wire_dtype = FPS_WIRE_BF16;
  sync_run(0);
  g_wire_dtype = 0;
  g_push_chunk = 0;
}

/* async/ssp: replay every tensor in the order its shard applied pushes. */
static void check_applied_order(const model_t *m, fps_test_server_t *srv, const char *mode) {
  fps_status_t st;
  fps_client_t *c = client_new(srv, SHARDS, 30, &st);
  assert_non_null(c);
  /* Learn the placement without creating anything. */
  assert_code(fps_client_discover(c, NULL, &st), 0, st);
  fps_apply_record_t log[WORKERS * STEPS + 1];
  for (size_t t = 0; t < m->n; t++) {
    uint64_t n = m->numel[t];
    fps_tensor_stats_t ts;
    size_t len = 0;
    int rc = fps_client_tensor_stats(c, m->defs[t].name, &ts, log, WORKERS * STEPS + 1, &len, &st);
    if (rc) fail_msg("%s: stats: %s", mode, st.message);
    assert_int_equal(len, WORKERS * STEPS);
    assert_int_equal(ts.version, WORKERS * STEPS);
    int seen[WORKERS][STEPS] = {{0}};
    replica_t r;
    float *g = malloc(n * sizeof *g), *got = malloc(n * sizeof *got);
    replica_init(&r, m, t);
    for (size_t k = 0; k < len; k++) {
      assert_true(log[k].worker_id < WORKERS && log[k].step < STEPS);
      assert_int_equal(log[k].version, k + 1);
      seen[log[k].worker_id][log[k].step]++;
      fill_grad(g, log[k].worker_id, log[k].step, t, n);
      replica_step(&r, g);
    }
    for (int w = 0; w < WORKERS; w++)
      for (int s = 0; s < STEPS; s++) assert_int_equal(seen[w][s], 1);
    const char *names[1] = {m->defs[t].name};
    float *params[1] = {got};
    uint64_t version;
    assert_code(fps_client_pull(c, names, params, &version, 1, &st), 0, st);
    assert_int_equal(version, WORKERS * STEPS);
    char what[128];
    snprintf(what, sizeof what, "%s: tensor '%s'", mode, m->defs[t].name);
    assert_same_floats(what, got, r.param, n);
    replica_free(&r);
    free(g);
    free(got);
  }
  fps_client_destroy(c);
}

static void test_async_matches_applied_order(void **state) {
  (void)state;
  model_t m;
  fps_test_server_t srv[SHARDS];
  worker_t ws[WORKERS];
  model_init(&m);
  assert_int_equal(fps_test_servers_start(srv, SHARDS, "async", WORKERS, NULL), 0);
  job_t job = {&m, srv, 0, NULL};
  run_workers(&job, ws);
  free_workers(ws, &m);
  check_applied_order(&m, srv, "async");
  if (g_push_chunk) assert_chunked(srv);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

/* Chunked pushes in async and ssp: every chunk applied exactly once, in
 * an order the apply log replays bit for bit. */
static void test_async_chunked_matches_applied_order(void **state) {
  g_push_chunk = 1;
  test_async_matches_applied_order(state);
  g_push_chunk = 0;
}

static void test_ssp_matches_applied_order(void **state) {
  (void)state;
  model_t m;
  fps_test_server_t srv[SHARDS];
  worker_t ws[WORKERS];
  model_init(&m);
  const char *extra[] = {"--staleness", "1", "--deadline", "30", NULL};
  assert_int_equal(fps_test_servers_start(srv, SHARDS, "ssp", WORKERS, extra), 0);
  job_t job = {&m, srv, 0, NULL};
  run_workers(&job, ws);
  free_workers(ws, &m);
  check_applied_order(&m, srv, "ssp");
  if (g_push_chunk) assert_chunked(srv);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

static void test_ssp_chunked_matches_applied_order(void **state) {
  g_push_chunk = 1;
  test_ssp_matches_applied_order(state);
  g_push_chunk = 0;
}

static void test_placement_deterministic_balanced(void **state) {
  (void)state;
  enum { N = 40 };
  fps_test_server_t srv[SHARDS];
  fps_tensor_def_t defs[N], shuffled[N];
  char names[N][16];
  fps_status_t st;
  uint64_t load[SHARDS] = {0}, biggest = 0;
  float *init = calloc(5000, sizeof *init);
  assert_non_null(init);
  assert_int_equal(fps_test_servers_start(srv, SHARDS, "async", 1, NULL), 0);
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "p%02d", i);
    memset(&defs[i], 0, sizeof defs[i]);
    defs[i].name = names[i];
    defs[i].ndim = 1;
    /* Repeated sizes exercise the name tie-break. */
    defs[i].shape[0] = 100 + (uint64_t)(mix((uint32_t)i) % 10) * 490;
    defs[i].init = init;
    if (defs[i].shape[0] * 4 > biggest) biggest = defs[i].shape[0] * 4;
  }
  for (int i = 0; i < N; i++) shuffled[i] = defs[(i * 17 + 5) % N];
  fps_client_t *a = client_new(srv, SHARDS, 30, &st), *b = client_new(srv, SHARDS, 30, &st);
  assert_non_null(a);
  assert_non_null(b);
  assert_code(fps_client_create_tensors(a, defs, N, &st), 0, st);
  assert_code(fps_client_create_tensors(b, shuffled, N, &st), 0, st);
  for (int i = 0; i < N; i++) {
    int s = fps_client_shard_of(a, names[i]);
    assert_true(s >= 0 && s < SHARDS);
    assert_int_equal(s, fps_client_shard_of(b, names[i]));
    load[s] += defs[i].shape[0] * 4;
    /* The shard that holds it is the one placement chose. */
    fps_tensor_stats_t ts;
    assert_code(fps_client_tensor_stats(a, names[i], &ts, NULL, 0, NULL, &st), 0, st);
    assert_int_equal(ts.shard, s);
    /* A whole tensor is one block; NULL asks for the count alone, whatever
     * cap says (-1 is kept for an unknown name). */
    fps_block_t blk;
    assert_int_equal(fps_client_tensor_blocks(a, names[i], &blk, 1), 1);
    assert_int_equal(blk.shard, s);
    assert_int_equal(fps_client_tensor_blocks(a, names[i], NULL, 1), 1);
  }
  assert_int_equal(fps_client_tensor_blocks(a, "nope", NULL, 0), -1);
  uint64_t hi = load[0] > load[1] ? load[0] : load[1], lo = load[0] > load[1] ? load[1] : load[0];
  assert_true(hi - lo <= biggest);
  /* Stats agrees: each shard holds its share. */
  fps_shard_stats_t ss[SHARDS];
  assert_code(fps_client_stats(a, ss, SHARDS, &st), 0, st);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(ss[i].param_bytes, load[i]);
  fps_client_destroy(a);
  fps_client_destroy(b);
  free(init);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_unreachable_is_unavailable(void **state) {
  (void)state;
  fps_test_server_t srv[SHARDS];
  fps_status_t st;
  model_t m;
  model_init(&m);
  /* Shard 0 is real, shard 1 is a port nothing listens on. */
  assert_int_equal(fps_test_server_start(&srv[0], 0, SHARDS, "async", 1, NULL), 0);
  memset(&srv[1], 0, sizeof srv[1]);
  snprintf(srv[1].addr, sizeof srv[1].addr, "127.0.0.1:%d", fps_test_dead_port());
  const double deadline = 8;
  fps_client_t *c = client_new(srv, SHARDS, deadline, &st);
  assert_non_null(c);

  double t0 = now_s();
  fps_shard_stats_t ss[SHARDS];
  assert_code(fps_client_stats(c, ss, SHARDS, &st), FPS_CODE_UNAVAILABLE, st);
  assert_int_equal(st.shard, 1);
  assert_non_null(strstr(st.message, srv[1].addr));
  assert_true(now_s() - t0 < deadline + 1);

  t0 = now_s();
  assert_code(fps_client_create_tensors(c, m.defs, m.n, &st), FPS_CODE_UNAVAILABLE, st);
  assert_int_equal(st.shard, 1);
  assert_true(now_s() - t0 < deadline + 1);

  /* The failed create still set the tensor list, so shard 1's tensors can
   * be pushed. The PushPull never reaches shard 1: it is retried (safe:
   * nothing was sent) and still ends UNAVAILABLE, never a hang. */
  const char *names[8];
  float *grads[8];
  size_t k = 0;
  for (size_t t = 0; t < m.n; t++)
    if (fps_client_shard_of(c, m.defs[t].name) == 1) {
      names[k] = m.defs[t].name;
      grads[k] = calloc(m.numel[t], sizeof(float));
      k++;
    }
  assert_true(k > 0);
  t0 = now_s();
  assert_code(fps_client_push_pull(c, 0, 0, names, (const float *const *)grads, grads, NULL, k, &st),
              FPS_CODE_UNAVAILABLE, st);
  assert_int_equal(st.shard, 1);
  assert_true(now_s() - t0 < deadline + 1);
  for (size_t i = 0; i < k; i++) free(grads[i]);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv[0]), 0);
}

static void test_wrong_shard_is_refused(void **state) {
  (void)state;
  fps_test_server_t srv[SHARDS], swapped[SHARDS];
  fps_status_t st;
  model_t m;
  model_init(&m);
  assert_int_equal(fps_test_servers_start(srv, SHARDS, "async", 1, NULL), 0);
  swapped[0] = srv[1];
  swapped[1] = srv[0];
  fps_client_t *c = client_new(swapped, SHARDS, 10, &st);
  assert_non_null(c);
  assert_code(fps_client_create_tensors(c, m.defs, m.n, &st), FPS_CODE_FAILED_PRECONDITION, st);
  assert_int_equal(st.shard, 0);
  fps_client_destroy(c);
  /* Nothing was created anywhere. */
  c = client_new(srv, SHARDS, 10, &st);
  fps_shard_stats_t ss[SHARDS];
  assert_code(fps_client_stats(c, ss, SHARDS, &st), 0, st);
  assert_int_equal(ss[0].tensors + ss[1].tensors, 0);
  fps_client_destroy(c);
  for (int i = 0; i < SHARDS; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

/* A 1 GiB tensor with default client settings (4 MiB messages): create
 * with values, push, and pull back; the update is checked on a sample of
 * elements against the kernel (one step from the same values). Label
 * `slow`: it moves several GiB through loopback. */
static void test_one_gib_round_trip(void **state) {
  (void)state;
  const uint64_t n = (1ull << 30) / 4;
  fps_test_server_t srv;
  fps_status_t st;
  fps_client_options_t o;
  /* The shard caps every call at its --deadline (60 s by default); under
   * ASan on a loaded machine a 1 GiB push can take longer than that. */
  const char *extra[] = {"--deadline", "300", NULL};
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, extra), 0);
  float *buf = malloc(n * sizeof *buf);
  assert_non_null(buf);
  for (uint64_t i = 0; i < n; i++) buf[i] = (float)(i % 1000) * 1e-3f;
  fps_tensor_def_t def = {.name = "big", .ndim = 1, .shape = {n},
                          .optim = {.flavor = FPS_OPTIM_TORCH}, .init = buf};
  const char *addr = srv.addr;
  fps_client_options_init(&o);
  o.deadline_seconds = 300;
  fps_client_t *c = fps_client_create(&addr, 1, &o, &st);
  assert_non_null(c);
  assert_code(fps_client_create_tensors(c, &def, 1, &st), 0, st);
  /* Gradient = the values themselves; the result overwrites the buffer. */
  const char *names[1] = {"big"};
  float *params[1] = {buf};
  uint64_t version = 0;
  assert_code(fps_client_push_pull(c, 0, 0, names, (const float *const *)params, params, &version,
                                   1, &st),
              0, st);
  assert_int_equal(version, 1);
  /* Pull must return exactly what PushPull returned. */
  float *pulled = malloc(n * sizeof *pulled);
  assert_non_null(pulled);
  float *pp[1] = {pulled};
  assert_code(fps_client_pull(c, names, pp, &version, 1, &st), 0, st);
  assert_int_equal(version, 1);
  assert_true(memcmp(pulled, buf, n * sizeof *buf) == 0);
  /* torch, 1-D: every element moves against its gradient's sign. */
  for (uint64_t i = 1; i < n; i += 4099) {
    float before = (float)(i % 1000) * 1e-3f;
    if (before > 0) assert_true(pulled[i] < before);
  }
  free(pulled);
  free(buf);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* argv[1], if given, runs only the tests whose name matches (CTest runs
 * each test as its own process, with its own timeout). */
int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_sync_matches_replay, teardown),
      cmocka_unit_test_teardown(test_sync_bf16_matches_replay, teardown),
      cmocka_unit_test_teardown(test_sync_shared_client, teardown),
      cmocka_unit_test_teardown(test_async_matches_applied_order, teardown),
      cmocka_unit_test_teardown(test_ssp_matches_applied_order, teardown),
      cmocka_unit_test_teardown(test_sync_chunked_matches_replay, teardown),
      cmocka_unit_test_teardown(test_async_chunked_matches_applied_order, teardown),
      cmocka_unit_test_teardown(test_ssp_chunked_matches_applied_order, teardown),
      cmocka_unit_test_teardown(test_placement_deterministic_balanced, teardown),
      cmocka_unit_test_teardown(test_unreachable_is_unavailable, teardown),
      cmocka_unit_test_teardown(test_wrong_shard_is_refused, teardown),
      cmocka_unit_test_teardown(test_one_gib_round_trip, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

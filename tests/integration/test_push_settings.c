/* Per-push settings through libfactorps against real factorps-server
 * processes (fps_client_push_pull_ex):
 *   - a learning-rate and weight-decay schedule, sync with 2 workers on 2
 *     shards, bit for bit against a local replay that steps the kernel with
 *     each step's settings; the apply log records the values applied (hf
 *     relative_step: the relative step size);
 *   - async no_grad (no update, no weight decay, version unchanged) and a
 *     per-tensor step pushed in the same call as other tensors;
 *   - a wrong worker count, worker id or mode fails at once, not after the
 *     round deadline;
 *   - sync workers that disagree about lr or about which tensors have a
 *     gradient all fail with FAILED_PRECONDITION, nothing applied; all
 *     no_grad completes the round with nothing applied. */
#include <math.h>
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
#include "factorps/client.h"
#include "harness.h"

#define assert_code(rc, want, st)                                                       \
  do {                                                                                  \
    int rc_ = (rc);                                                                     \
    if (rc_ != (want))                                                                  \
      fail_msg("got %s, want %s: %s", fps_code_name(rc_), fps_code_name(want),          \
               (st).message);                                                           \
  } while (0)

#define assert_has(st, word)                                                            \
  do {                                                                                  \
    if (!strstr((st).message, (word))) fail_msg("'%s' not in: %s", (word), (st).message); \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static float value(uint32_t a, uint32_t b, uint32_t c, uint64_t i) {
  uint32_t h = a * 0x9e3779b9U ^ b * 0x85ebca6bU ^ c * 0xc2b2ae35U ^ (uint32_t)i * 0x27d4eb2fU;
  h ^= h >> 15;
  h *= 0x2c1b3c6dU;
  h ^= h >> 12;
  return ((float)(h % 20001u) - 10000.0f) / 10000.0f;
}

static fps_client_t *client_new(fps_test_server_t *srv, int n, fps_status_t *st) {
  const char *addrs[4];
  fps_client_options_t o;
  for (int i = 0; i < n; i++) addrs[i] = srv[i].addr;
  fps_client_options_init(&o);
  o.max_message_bytes = 64 * 1024;
  o.deadline_seconds = 30;
  return fps_client_create(addrs, (size_t)n, &o, st);
}

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  return 0;
}

/* ------------------------------------------------------------ the model */

#define NT 4
#define STEPS 6
#define W 2

typedef struct tdef_s {
  const char *name;
  uint32_t ndim;
  uint64_t shape[3];
  fps_optim_config_t optim;
  int sched_lr;                   /* the schedule sends an lr */
} tdef_t;

static const tdef_t MODEL[NT] = {
    {"w", 2, {64, 33}, {.flavor = FPS_OPTIM_TORCH}, 1},
    {"v", 1, {7}, {.flavor = FPS_OPTIM_TORCH, .has_weight_decay = 1, .weight_decay = 0.5}, 1},
    {"h", 2, {40, 50}, {.flavor = FPS_OPTIM_HF, .has_relative_step = 1, .relative_step = 0, .has_lr = 1,
                        .lr = 1e-3, .has_beta1 = 1, .beta1 = 0.9}, 1},
    {"r", 2, {3, 5}, {.flavor = FPS_OPTIM_HF}, 0}, /* relative_step: no lr */
};

static uint64_t numel_of(const tdef_t *d) {
  uint64_t n = 1;
  for (uint32_t i = 0; i < d->ndim; i++) n *= d->shape[i];
  return n;
}

/* The schedule: warmup then decay, per tensor; weight decay grows. */
static double sched_lr(size_t t, uint64_t s) {
  double base = MODEL[t].optim.flavor == FPS_OPTIM_HF ? 1e-3 : 2e-2;
  return s < 2 ? base * (double)(s + 1) / 2 : base * (double)(STEPS - s) / (STEPS - 2);
}
static double sched_wd(size_t t, uint64_t s) { return 0.01 * (double)(s + t); }

static fps_adafactor_hparams_t hparams_of(const fps_optim_config_t *o) {
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, o->flavor == FPS_OPTIM_HF ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
  if (o->has_lr) hp.has_lr = true, hp.lr = o->lr;
  if (o->has_weight_decay) hp.weight_decay = o->weight_decay;
  if (o->has_relative_step) hp.relative_step = o->relative_step;
  if (o->has_beta1) hp.has_beta1 = true, hp.beta1 = o->beta1;
  return hp;
}

static void create_model(fps_client_t *c, int with_init, fps_status_t *st) {
  fps_tensor_def_t defs[NT];
  float *init[NT] = {0};
  memset(defs, 0, sizeof defs);
  for (size_t t = 0; t < NT; t++) {
    defs[t].name = MODEL[t].name;
    defs[t].ndim = MODEL[t].ndim;
    for (uint32_t i = 0; i < MODEL[t].ndim; i++) defs[t].shape[i] = MODEL[t].shape[i];
    defs[t].optim = MODEL[t].optim;
    if (with_init) {
      uint64_t n = numel_of(&MODEL[t]);
      init[t] = malloc(n * sizeof(float));
      for (uint64_t i = 0; i < n; i++) init[t][i] = 0.5f * value(7, 0, (uint32_t)t, i);
      defs[t].init = init[t];
    }
  }
  assert_code(fps_client_create_tensors(c, defs, NT, st), 0, *st);
  for (size_t t = 0; t < NT; t++) free(init[t]);
}

typedef struct worker_s {
  fps_test_server_t *srv;
  uint32_t id;
  float *params[NT];
  uint64_t versions[NT];
  int rc;
  fps_status_t st;
} worker_t;

static void *sched_worker(void *arg) {
  worker_t *w = arg;
  fps_client_t *c = client_new(w->srv, 2, &w->st);
  float *grads[NT];
  const char *names[NT];
  fps_tensor_push_t per[NT];
  w->rc = -1;
  if (!c) return NULL;
  /* Worker 0 uploads the values; worker 1 waits for them. */
  fps_tensor_def_t defs[NT];
  float *init[NT] = {0};
  memset(defs, 0, sizeof defs);
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel_of(&MODEL[t]);
    defs[t].name = names[t] = MODEL[t].name;
    defs[t].ndim = MODEL[t].ndim;
    for (uint32_t i = 0; i < MODEL[t].ndim; i++) defs[t].shape[i] = MODEL[t].shape[i];
    defs[t].optim = MODEL[t].optim;
    if (w->id == 0) {
      init[t] = malloc(n * sizeof(float));
      for (uint64_t i = 0; i < n; i++) init[t][i] = 0.5f * value(7, 0, (uint32_t)t, i);
      defs[t].init = init[t];
    }
    grads[t] = malloc(n * sizeof(float));
    w->params[t] = malloc(n * sizeof(float));
  }
  w->rc = fps_client_create_tensors(c, defs, NT, &w->st);
  for (uint64_t s = 0; s < STEPS && !w->rc; s++) {
    for (size_t t = 0; t < NT; t++) {
      uint64_t n = numel_of(&MODEL[t]);
      for (uint64_t i = 0; i < n; i++) grads[t][i] = value(w->id + 1, (uint32_t)s + 1, (uint32_t)t, i);
      memset(&per[t], 0, sizeof per[t]);
      per[t].has_lr = MODEL[t].sched_lr;
      per[t].lr = sched_lr(t, s);
      per[t].has_weight_decay = 1;
      per[t].weight_decay = sched_wd(t, s);
    }
    fps_push_args_t args = {.worker_id = w->id, .num_workers = W, .step = s, .expect_mode = 1};
    w->rc = fps_client_push_pull_ex(c, &args, names, (const float *const *)grads, per, w->params, w->versions,
                                    NT, &w->st);
  }
  for (size_t t = 0; t < NT; t++) {
    free(init[t]);
    free(grads[t]);
  }
  fps_client_destroy(c);
  return NULL;
}

static void test_sync_schedule_matches_replay(void **state) {
  (void)state;
  fps_test_server_t srv[2];
  const char *extra[] = {"--deadline", "30", NULL};
  assert_int_equal(fps_test_servers_start(srv, 2, "sync", W, extra), 0);
  worker_t ws[W];
  pthread_t th[W];
  for (uint32_t i = 0; i < W; i++) {
    memset(&ws[i], 0, sizeof ws[i]);
    ws[i].srv = srv;
    ws[i].id = i;
    assert_int_equal(pthread_create(&th[i], NULL, sched_worker, &ws[i]), 0);
  }
  for (uint32_t i = 0; i < W; i++) pthread_join(th[i], NULL);
  for (uint32_t i = 0; i < W; i++)
    if (ws[i].rc) fail_msg("worker %u: %s: %s", i, fps_code_name(ws[i].st.code), ws[i].st.message);

  fps_status_t st;
  fps_client_t *c = client_new(srv, 2, &st);
  assert_non_null(c);
  create_model(c, 0, &st); /* the same list: learns the placement */
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel_of(&MODEL[t]);
    fps_shape_t shape = {.ndim = MODEL[t].ndim};
    for (uint32_t i = 0; i < shape.ndim; i++) shape.dim[i] = MODEL[t].shape[i];
    fps_adafactor_hparams_t hp0 = hparams_of(&MODEL[t].optim);
    fps_adafactor_state_t rs;
    assert_int_equal(fps_adafactor_state_init(&rs, &shape, &hp0), 0);
    float *p = malloc(n * sizeof *p), *sum = malloc(n * sizeof *sum);
    for (uint64_t i = 0; i < n; i++) p[i] = 0.5f * value(7, 0, (uint32_t)t, i);
    for (uint64_t s = 0; s < STEPS; s++) {
      for (uint64_t i = 0; i < n; i++) {
        sum[i] = value(1, (uint32_t)s + 1, (uint32_t)t, i);
        sum[i] += value(2, (uint32_t)s + 1, (uint32_t)t, i);
        sum[i] /= (float)W;
      }
      fps_adafactor_hparams_t hp = hp0;
      if (MODEL[t].sched_lr) hp.lr = sched_lr(t, s);
      hp.weight_decay = sched_wd(t, s);
      assert_int_equal(fps_adafactor_step(NULL, &hp, &rs, p, sum, NULL, NULL), 0);
    }
    for (uint32_t w = 0; w < W; w++) {
      assert_int_equal(ws[w].versions[t], STEPS);
      if (memcmp(ws[w].params[t], p, n * sizeof *p) != 0)
        fail_msg("worker %u tensor '%s': params differ from the replay with the schedule", w, MODEL[t].name);
    }
    /* The apply log holds the values each update applied. */
    fps_tensor_stats_t ts;
    fps_apply_record_t log[STEPS];
    size_t len = 0;
    assert_code(fps_client_tensor_stats(c, MODEL[t].name, &ts, log, STEPS, &len, &st), 0, st);
    assert_int_equal(len, STEPS);
    for (uint64_t s = 0; s < STEPS; s++) {
      double want_lr = MODEL[t].sched_lr ? sched_lr(t, s) : fmin(1e-2, 1.0 / sqrt((double)(s + 1)));
      if (log[s].lr != want_lr || log[s].weight_decay != sched_wd(t, s))
        fail_msg("tensor '%s' update %llu: apply log lr %.17g wd %.17g, want %.17g %.17g", MODEL[t].name,
                 (unsigned long long)s + 1, log[s].lr, log[s].weight_decay, want_lr, sched_wd(t, s));
      assert_int_equal(log[s].step, s);
    }
    fps_adafactor_state_destroy(&rs);
    free(p);
    free(sum);
    for (uint32_t w = 0; w < W; w++) free(ws[w].params[t]);
  }
  fps_client_destroy(c);
  for (int i = 0; i < 2; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

/* ------------------------------------------------- async no_grad, step */

static void test_async_no_grad_and_tensor_step(void **state) {
  (void)state;
  fps_test_server_t srv;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  fps_status_t st;
  fps_client_t *c = client_new(&srv, 1, &st);
  assert_non_null(c);
  float a0[64], b0[5], a[64], b[5], ga[64], gb[5];
  for (int i = 0; i < 64; i++) a0[i] = 0.5f * value(3, 0, 0, (uint64_t)i);
  for (int i = 0; i < 5; i++) b0[i] = 0.5f * value(3, 0, 1, (uint64_t)i);
  fps_tensor_def_t defs[2] = {
      {.name = "a", .ndim = 2, .shape = {8, 8},
       .optim = {.flavor = FPS_OPTIM_TORCH, .has_weight_decay = 1, .weight_decay = 0.1}, .init = a0},
      {.name = "b", .ndim = 1, .shape = {5}, .optim = {.flavor = FPS_OPTIM_TORCH}, .init = b0},
  };
  assert_code(fps_client_create_tensors(c, defs, 2, &st), 0, st);
  const char *names[2] = {"a", "b"};
  float *params[2] = {a, b};
  uint64_t ver[2];
  /* Replicas. */
  fps_adafactor_hparams_t hpa = hparams_of(&defs[0].optim), hpb = hparams_of(&defs[1].optim);
  fps_adafactor_state_t ra, rb;
  fps_shape_t sa = {.ndim = 2, .dim = {8, 8}}, sb = {.ndim = 1, .dim = {5}};
  assert_int_equal(fps_adafactor_state_init(&ra, &sa, &hpa), 0);
  assert_int_equal(fps_adafactor_state_init(&rb, &sb, &hpb), 0);
  float pa[64], pb[5];
  memcpy(pa, a0, sizeof pa);
  memcpy(pb, b0, sizeof pb);

  /* Step 0: both have gradients. */
  for (int i = 0; i < 64; i++) ga[i] = value(1, 1, 0, (uint64_t)i);
  for (int i = 0; i < 5; i++) gb[i] = value(1, 1, 1, (uint64_t)i);
  fps_push_args_t args = {.worker_id = 0, .num_workers = 1, .step = 0, .expect_mode = 2};
  assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)(const float *[]){ga, gb}, NULL,
                                      params, ver, 2, &st), 0, st);
  fps_adafactor_step(NULL, &hpa, &ra, pa, ga, NULL, NULL);
  fps_adafactor_step(NULL, &hpb, &rb, pb, gb, NULL, NULL);
  float a_after0[64];
  memcpy(a_after0, a, sizeof a);
  /* Steps 1, 2: "a" frozen (no_grad, NULL gradient, weight decay 0.1 on
   * the tensor): untouched, version 1; "b" trains on. */
  for (uint64_t s = 1; s <= 2; s++) {
    for (int i = 0; i < 5; i++) gb[i] = value(1, (uint32_t)s + 1, 1, (uint64_t)i);
    fps_tensor_push_t per[2] = {{.no_grad = 1}, {0}};
    args.step = s;
    assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)(const float *[]){NULL, gb}, per,
                                        params, ver, 2, &st), 0, st);
    fps_adafactor_step(NULL, &hpb, &rb, pb, gb, NULL, NULL);
    assert_int_equal(ver[0], 1);
    assert_int_equal(ver[1], s + 1);
    assert_memory_equal(a, a_after0, sizeof a);
  }
  /* Step 3: "a" comes back at its own step 1, in the same call as "b" at
   * step 3, with a per-push lr. */
  for (int i = 0; i < 64; i++) ga[i] = value(1, 9, 0, (uint64_t)i);
  for (int i = 0; i < 5; i++) gb[i] = value(1, 4, 1, (uint64_t)i);
  fps_tensor_push_t per[2] = {{.has_step = 1, .step = 1, .has_lr = 1, .lr = 0.5}, {0}};
  args.step = 3;
  assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)(const float *[]){ga, gb}, per,
                                      params, ver, 2, &st), 0, st);
  fps_adafactor_hparams_t hpa2 = hpa;
  hpa2.lr = 0.5;
  fps_adafactor_step(NULL, &hpa2, &ra, pa, ga, NULL, NULL);
  fps_adafactor_step(NULL, &hpb, &rb, pb, gb, NULL, NULL);
  assert_int_equal(ver[0], 2);
  assert_int_equal(ver[1], 4);
  assert_memory_equal(a, pa, sizeof a);
  assert_memory_equal(b, pb, sizeof b);
  fps_tensor_stats_t ts;
  fps_apply_record_t log[4];
  size_t len = 0;
  assert_code(fps_client_tensor_stats(c, "a", &ts, log, 4, &len, &st), 0, st);
  assert_int_equal(len, 2);
  assert_int_equal(log[1].step, 1);
  assert_true(log[0].lr == 1e-2 && log[0].weight_decay == 0.1);
  assert_true(log[1].lr == 0.5 && log[1].weight_decay == 0.1);
  /* A no_grad tensor with a gradient pointer: the gradient is not sent. */
  fps_tensor_push_t frozen[1] = {{.no_grad = 1}};
  args.step = 4;
  assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)(const float *[]){ga}, frozen,
                                      params, ver, 1, &st), 0, st);
  assert_int_equal(ver[0], 2);
  assert_memory_equal(a, pa, sizeof a);
  /* A NULL gradient without no_grad is refused locally. */
  assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)(const float *[]){NULL}, NULL,
                                      params, ver, 1, &st), FPS_CODE_INVALID_ARGUMENT, st);
  fps_adafactor_state_destroy(&ra);
  fps_adafactor_state_destroy(&rb);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* ----------------------------------------------------- fail-fast checks */

static void test_job_checks_fail_fast(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *extra[] = {"--deadline", "30", NULL};
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "sync", 2, extra), 0);
  fps_status_t st;
  fps_client_t *c = client_new(&srv, 1, &st);
  assert_non_null(c);
  float x0[6] = {1, 2, 3, 4, 5, 6}, g[6] = {1, 1, 1, 1, 1, 1}, out[6];
  fps_tensor_def_t def = {.name = "x", .ndim = 1, .shape = {6}, .optim = {.flavor = FPS_OPTIM_TORCH}, .init = x0};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), 0, st);
  const char *names[1] = {"x"};
  const float *grads[1] = {g};
  float *params[1] = {out};
  struct {
    fps_push_args_t a;
    const char *w1, *w2;
  } cases[] = {
      {{.worker_id = 0, .num_workers = 3}, "3 workers", "expects 2"},
      {{.worker_id = 2, .num_workers = 0}, "worker id 2", "2 workers"},
      {{.worker_id = 2, .num_workers = 3}, "3 workers", "--workers"},
      {{.worker_id = 0, .num_workers = 2, .expect_mode = 2}, "async", "sync"},
      {{.worker_id = 1, .num_workers = 2, .expect_mode = 3}, "ssp", "sync"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    double t0 = now_s();
    int rc = fps_client_push_pull_ex(c, &cases[i].a, names, grads, NULL, params, NULL, 1, &st);
    double dt = now_s() - t0;
    assert_code(rc, FPS_CODE_FAILED_PRECONDITION, st);
    assert_has(st, cases[i].w1);
    assert_has(st, cases[i].w2);
    /* At the first message, never after the 30 s round deadline. */
    if (dt > 2.0) fail_msg("case %zu took %.3f s", i, dt);
    printf("case %zu: FAILED_PRECONDITION after %.1f ms: %s\n", i, dt * 1e3, st.message);
  }
  fps_push_args_t bad = {.expect_mode = 9};
  assert_code(fps_client_push_pull_ex(c, &bad, names, grads, NULL, params, NULL, 1, &st),
              FPS_CODE_INVALID_ARGUMENT, st);
  assert_code(fps_client_push_pull_ex(c, NULL, names, grads, NULL, params, NULL, 1, &st),
              FPS_CODE_INVALID_ARGUMENT, st);
  uint64_t v = 9;
  assert_code(fps_client_pull(c, names, params, &v, 1, &st), 0, st);
  assert_int_equal(v, 0);
  assert_memory_equal(out, x0, sizeof x0);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

/* ------------------------------------------------- sync disagreements */

typedef struct one_push_s {
  fps_client_t *c;
  uint32_t id;
  const float *grad;              /* NULL: no_grad */
  fps_tensor_push_t per;
  float out[6];
  uint64_t version;
  int rc;
  fps_status_t st;
} one_push_t;

static void *one_push_main(void *arg) {
  one_push_t *p = arg;
  const char *names[1] = {"x"};
  const float *grads[1] = {p->grad};
  float *params[1] = {p->out};
  if (!p->grad) p->per.no_grad = 1;
  fps_push_args_t args = {.worker_id = p->id, .num_workers = 2, .step = 0, .expect_mode = 1};
  p->rc = fps_client_push_pull_ex(p->c, &args, names, grads, &p->per, params, &p->version, 1, &p->st);
  return NULL;
}

static void round_of_two(fps_client_t *c, one_push_t *p) {
  pthread_t th[2];
  for (uint32_t i = 0; i < 2; i++) {
    p[i].c = c;
    p[i].id = i;
    assert_int_equal(pthread_create(&th[i], NULL, one_push_main, &p[i]), 0);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
}

static void test_sync_disagreement_fails_every_member(void **state) {
  (void)state;
  fps_test_server_t srv;
  const char *extra[] = {"--deadline", "30", NULL};
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "sync", 2, extra), 0);
  fps_status_t st;
  fps_client_t *c = client_new(&srv, 1, &st);
  assert_non_null(c);
  float x0[6] = {1, 2, 3, 4, 5, 6}, g[6] = {1, -1, 1, -1, 1, -1}, out[6];
  fps_tensor_def_t def = {.name = "x", .ndim = 1, .shape = {6},
                          .optim = {.flavor = FPS_OPTIM_TORCH, .has_weight_decay = 1, .weight_decay = 0.25},
                          .init = x0};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), 0, st);
  const char *names[1] = {"x"};
  float *params[1] = {out};
  uint64_t v;

  /* Different lr: both fail, naming the tensor, both workers and values. */
  one_push_t p[2];
  memset(p, 0, sizeof p);
  p[0].grad = p[1].grad = g;
  p[0].per = (fps_tensor_push_t){.has_lr = 1, .lr = 0.01};
  p[1].per = (fps_tensor_push_t){.has_lr = 1, .lr = 0.02};
  double t0 = now_s();
  round_of_two(c, p);
  printf("lr disagreement answered after %.1f ms\n", (now_s() - t0) * 1e3);
  for (int i = 0; i < 2; i++) {
    assert_code(p[i].rc, FPS_CODE_FAILED_PRECONDITION, p[i].st);
    assert_has(p[i].st, "'x'");
    assert_has(p[i].st, "worker 0 sent 0.01");
    assert_has(p[i].st, "worker 1 sent 0.02");
  }
  /* Absent weight decay means Create's (0.25): 0.25 sent explicitly by
   * the other worker agrees, 0.5 does not. */
  memset(p, 0, sizeof p);
  p[0].grad = p[1].grad = g;
  p[1].per = (fps_tensor_push_t){.has_weight_decay = 1, .weight_decay = 0.5};
  round_of_two(c, p);
  for (int i = 0; i < 2; i++) {
    assert_code(p[i].rc, FPS_CODE_FAILED_PRECONDITION, p[i].st);
    assert_has(p[i].st, "weight_decay");
    assert_has(p[i].st, "worker 0 sent 0.25");
  }
  /* A gradient from one, no_grad from the other. */
  memset(p, 0, sizeof p);
  p[0].grad = g;
  round_of_two(c, p);
  for (int i = 0; i < 2; i++) {
    assert_code(p[i].rc, FPS_CODE_FAILED_PRECONDITION, p[i].st);
    assert_has(p[i].st, "workers 0 pushed one");
    assert_has(p[i].st, "workers 1 said no_grad");
  }
  assert_code(fps_client_pull(c, names, params, &v, 1, &st), 0, st);
  assert_int_equal(v, 0);
  assert_memory_equal(out, x0, sizeof x0);
  /* Both no_grad: the round completes, nothing applied (no weight decay). */
  memset(p, 0, sizeof p);
  round_of_two(c, p);
  for (int i = 0; i < 2; i++) {
    assert_code(p[i].rc, 0, p[i].st);
    assert_int_equal(p[i].version, 0);
    assert_memory_equal(p[i].out, x0, sizeof x0);
  }
  /* Agreement (explicit == Create's default) applies, at step 0. */
  memset(p, 0, sizeof p);
  p[0].grad = p[1].grad = g;
  p[0].per = (fps_tensor_push_t){.has_weight_decay = 1, .weight_decay = 0.25};
  round_of_two(c, p);
  for (int i = 0; i < 2; i++) {
    assert_code(p[i].rc, 0, p[i].st);
    assert_int_equal(p[i].version, 1);
  }
  assert_memory_equal(p[0].out, p[1].out, sizeof p[0].out);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_sync_schedule_matches_replay, teardown),
      cmocka_unit_test_teardown(test_async_no_grad_and_tensor_step, teardown),
      cmocka_unit_test_teardown(test_job_checks_fail_fast, teardown),
      cmocka_unit_test_teardown(test_sync_disagreement_fails_every_member, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

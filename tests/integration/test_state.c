/* The optimizer state through libfactorps (fps_client_get_state) against
 * real factorps-server processes:
 *   - after a few async pushes (per-push lr and weight decay included) the
 *     state of every kind of tensor (factored, batched, 1-D, scalar, hf
 *     with momentum, hf relative step) equals a local replay's bit for bit,
 *     with its step, RMS and the last applied lr / weight decay, on 2
 *     shards;
 *   - the state and the last applied lr / weight decay survive a
 *     checkpoint and a restart;
 *   - errors: a name not in the list, a tensor still initialising;
 *   - resume through fps_client_create_tensors (step + state arrays) on
 *     new, empty shards continues bit for bit; replace; local refusals. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

#define NT 6
#define STEPS 3

typedef struct tdef_s {
  const char *name;
  uint32_t ndim;
  uint64_t shape[3];
  fps_optim_config_t optim;
  int push_lr;
} tdef_t;

static const tdef_t MODEL[NT] = {
    {"w", 2, {6, 5}, {.flavor = FPS_OPTIM_TORCH}, 1},
    {"batch", 3, {2, 3, 4}, {.flavor = FPS_OPTIM_TORCH, .has_weight_decay = 1, .weight_decay = 0.1}, 0},
    {"bias", 1, {70000}, {.flavor = FPS_OPTIM_TORCH}, 1}, /* var: several reply slices */
    {"scale", 0, {0}, {.flavor = FPS_OPTIM_TORCH}, 0},
    {"mom", 2, {4, 6}, {.flavor = FPS_OPTIM_HF, .has_relative_step = 1, .relative_step = 0, .has_lr = 1,
                        .lr = 1e-3, .has_beta1 = 1, .beta1 = 0.9}, 1},
    {"rel", 2, {3, 5}, {.flavor = FPS_OPTIM_HF}, 0},
};

static uint64_t numel_of(const tdef_t *d) {
  uint64_t n = 1;
  for (uint32_t i = 0; i < d->ndim; i++) n *= d->shape[i];
  return n;
}

static fps_adafactor_hparams_t hparams_of(const fps_optim_config_t *o) {
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, o->flavor == FPS_OPTIM_HF ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
  if (o->has_lr) hp.has_lr = true, hp.lr = o->lr;
  if (o->has_weight_decay) hp.weight_decay = o->weight_decay;
  if (o->has_relative_step) hp.relative_step = o->relative_step;
  if (o->has_beta1) hp.has_beta1 = true, hp.beta1 = o->beta1;
  return hp;
}

static void defs_of(fps_tensor_def_t *defs, float **init) {
  memset(defs, 0, NT * sizeof *defs);
  for (size_t t = 0; t < NT; t++) {
    defs[t].name = MODEL[t].name;
    defs[t].ndim = MODEL[t].ndim;
    for (uint32_t i = 0; i < MODEL[t].ndim; i++) defs[t].shape[i] = MODEL[t].shape[i];
    defs[t].optim = MODEL[t].optim;
    if (init) {
      uint64_t n = numel_of(&MODEL[t]);
      init[t] = malloc(n * sizeof(float));
      for (uint64_t i = 0; i < n; i++) init[t][i] = 0.5f * value(5, 0, (uint32_t)t, i);
      defs[t].init = init[t];
    }
  }
}

/* Local replicas driven exactly as the pushes below. */
typedef struct replica_s {
  fps_adafactor_hparams_t hp;
  fps_adafactor_state_t st;
  float *p;
  double last_lr, last_wd;
} replica_t;

static double step_lr(size_t t, uint64_t s) { return (MODEL[t].optim.flavor == FPS_OPTIM_HF ? 1e-3 : 3e-2) / (double)(s + 1); }

/* Pushes STEPS steps (one worker) and replays them into r[]. */
static void train(fps_client_t *c, replica_t *r, uint64_t first_step) {
  float *grads[NT], *params[NT];
  const char *names[NT];
  fps_tensor_push_t per[NT];
  fps_status_t st;
  for (size_t t = 0; t < NT; t++) {
    names[t] = MODEL[t].name;
    grads[t] = malloc(numel_of(&MODEL[t]) * sizeof(float));
    params[t] = malloc(numel_of(&MODEL[t]) * sizeof(float));
  }
  for (uint64_t s = first_step; s < first_step + STEPS; s++) {
    for (size_t t = 0; t < NT; t++) {
      uint64_t n = numel_of(&MODEL[t]);
      for (uint64_t i = 0; i < n; i++) grads[t][i] = value(1, (uint32_t)s + 1, (uint32_t)t, i);
      memset(&per[t], 0, sizeof per[t]);
      per[t].has_lr = MODEL[t].push_lr;
      per[t].lr = step_lr(t, s);
      per[t].has_weight_decay = t == 1;
      per[t].weight_decay = 0.05 * (double)s;
      fps_adafactor_hparams_t hp = r[t].hp;
      if (per[t].has_lr) hp.lr = per[t].lr;
      if (per[t].has_weight_decay) hp.weight_decay = per[t].weight_decay;
      fps_adafactor_trace_t tr;
      assert_int_equal(fps_adafactor_step(NULL, &hp, &r[t].st, r[t].p, grads[t], NULL, &tr), 0);
      r[t].last_lr = hp.flavor == FPS_FLAVOR_HF && hp.relative_step ? tr.rel_step : hp.lr;
      r[t].last_wd = hp.weight_decay;
    }
    fps_push_args_t args = {.worker_id = 0, .step = s};
    assert_code(fps_client_push_pull_ex(c, &args, names, (const float *const *)grads, per, params, NULL, NT, &st),
                0, st);
  }
  for (size_t t = 0; t < NT; t++) {
    assert_memory_equal(params[t], r[t].p, numel_of(&MODEL[t]) * sizeof(float));
    free(grads[t]);
    free(params[t]);
  }
}

static void replicas_init(replica_t *r) {
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel_of(&MODEL[t]);
    fps_shape_t shape = {.ndim = MODEL[t].ndim};
    for (uint32_t i = 0; i < shape.ndim; i++) shape.dim[i] = MODEL[t].shape[i];
    r[t].hp = hparams_of(&MODEL[t].optim);
    assert_int_equal(fps_adafactor_state_init(&r[t].st, &shape, &r[t].hp), 0);
    r[t].p = malloc(n * sizeof(float));
    for (uint64_t i = 0; i < n; i++) r[t].p[i] = 0.5f * value(5, 0, (uint32_t)t, i);
  }
}

static void replicas_free(replica_t *r) {
  for (size_t t = 0; t < NT; t++) {
    fps_adafactor_state_destroy(&r[t].st);
    free(r[t].p);
  }
}

/* Reads every tensor's state and compares it with the replicas. */
static void check_state(fps_client_t *c, const replica_t *r, uint64_t version) {
  const char *names[NT];
  float *row[NT], *col[NT], *var[NT], *mom[NT];
  fps_tensor_state_t info[NT];
  fps_status_t st;
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel_of(&MODEL[t]);
    names[t] = MODEL[t].name;
    /* numel floats are always enough for any kind. */
    row[t] = calloc(n, sizeof(float));
    col[t] = calloc(n, sizeof(float));
    var[t] = calloc(n, sizeof(float));
    mom[t] = calloc(n, sizeof(float));
  }
  /* Sizes only first (no arrays). */
  assert_code(fps_client_get_state(c, names, NT, info, NULL, NULL, NULL, NULL, &st), 0, st);
  assert_code(fps_client_get_state(c, names, NT, info, row, col, var, mom, &st), 0, st);
  for (size_t t = 0; t < NT; t++) {
    const fps_adafactor_state_t *rs = &r[t].st;
    const fps_tensor_state_t *in = &info[t];
    uint64_t nrow = rs->row ? rs->batch * rs->rows : 0, ncol = rs->col ? rs->batch * rs->cols : 0;
    uint64_t nvar = rs->var ? rs->numel : 0, nmom = rs->mom ? rs->numel : 0;
    if (in->row_elements != nrow || in->col_elements != ncol || in->var_elements != nvar || in->mom_elements != nmom)
      fail_msg("tensor '%s': sizes %llu/%llu/%llu/%llu", MODEL[t].name, (unsigned long long)in->row_elements,
               (unsigned long long)in->col_elements, (unsigned long long)in->var_elements,
               (unsigned long long)in->mom_elements);
    assert_int_equal(in->version, version);
    assert_int_equal(in->step, rs->step);
    if (in->rms != (double)rs->rms || in->lr != r[t].last_lr || in->weight_decay != r[t].last_wd)
      fail_msg("tensor '%s': rms %.9g lr %.17g wd %.17g, the replay has %.9g %.17g %.17g", MODEL[t].name, in->rms,
               in->lr, in->weight_decay, (double)rs->rms, r[t].last_lr, r[t].last_wd);
    if (nrow) assert_memory_equal(row[t], rs->row, nrow * sizeof(float));
    if (ncol) assert_memory_equal(col[t], rs->col, ncol * sizeof(float));
    if (nvar) assert_memory_equal(var[t], rs->var, nvar * sizeof(float));
    if (nmom) assert_memory_equal(mom[t], rs->mom, nmom * sizeof(float));
    free(row[t]);
    free(col[t]);
    free(var[t]);
    free(mom[t]);
  }
}

static void test_state_matches_replay(void **state) {
  (void)state;
  fps_test_server_t srv[2];
  assert_int_equal(fps_test_servers_start(srv, 2, "async", 1, NULL), 0);
  fps_status_t st;
  fps_client_t *c = client_new(srv, 2, &st);
  assert_non_null(c);
  fps_tensor_def_t defs[NT];
  float *init[NT];
  defs_of(defs, init);
  assert_code(fps_client_create_tensors(c, defs, NT, &st), 0, st);
  replica_t r[NT];
  replicas_init(r);
  for (size_t t = 0; t < NT; t++) {
    r[t].last_lr = r[t].hp.has_lr ? r[t].hp.lr : 0.0;
    r[t].last_wd = r[t].hp.weight_decay;
  }
  check_state(c, r, 0); /* zeros, Create's values */
  train(c, r, 0);
  check_state(c, r, STEPS);
  /* One tensor alone, only its col (NULL entries skip kinds). */
  const char *one[1] = {"w"};
  float colw[5] = {0};
  float *colp[1] = {colw};
  fps_tensor_state_t in;
  assert_code(fps_client_get_state(c, one, 1, &in, NULL, colp, NULL, NULL, &st), 0, st);
  assert_memory_equal(colw, r[0].st.col, sizeof colw);
  /* Errors. */
  const char *bad[1] = {"nope"};
  assert_code(fps_client_get_state(c, bad, 1, &in, NULL, NULL, NULL, NULL, &st), FPS_CODE_NOT_FOUND, st);
  const char *twice[2] = {"w", "w"};
  assert_code(fps_client_get_state(c, twice, 2, NULL, NULL, NULL, NULL, NULL, &st), FPS_CODE_INVALID_ARGUMENT,
              st);
  replicas_free(r);
  for (size_t t = 0; t < NT; t++) free(init[t]);
  fps_client_destroy(c);
  for (int i = 0; i < 2; i++) assert_int_equal(fps_test_server_stop(&srv[i]), 0);
}

static void test_state_survives_checkpoint_restart(void **state) {
  (void)state;
  char dir[] = "/tmp/fps-state-XXXXXX";
  assert_non_null(mkdtemp(dir));
  const char *extra[] = {"--checkpoint-dir", dir, NULL};
  fps_test_server_t srv;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, extra), 0);
  fps_status_t st;
  fps_client_t *c = client_new(&srv, 1, &st);
  assert_non_null(c);
  fps_tensor_def_t defs[NT];
  float *init[NT];
  defs_of(defs, init);
  assert_code(fps_client_create_tensors(c, defs, NT, &st), 0, st);
  replica_t r[NT];
  replicas_init(r);
  train(c, r, 0);
  assert_code(fps_client_checkpoint(c, NULL, 0, &st), 0, st);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, extra), 0);
  c = client_new(&srv, 1, &st);
  assert_non_null(c);
  defs_of(defs, NULL);
  assert_code(fps_client_create_tensors(c, defs, NT, &st), 0, st); /* matches the restored */
  check_state(c, r, STEPS);
  /* And it trains on from there exactly. */
  train(c, r, STEPS);
  check_state(c, r, 2 * STEPS);
  replicas_free(r);
  for (size_t t = 0; t < NT; t++) free(init[t]);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

static void test_state_of_initialising_tensor(void **state) {
  (void)state;
  fps_test_server_t srv;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  fps_status_t st;
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 1; /* create_tensors waits for the values: give up fast */
  const char *addr = srv.addr;
  fps_client_t *c = fps_client_create(&addr, 1, &o, &st);
  assert_non_null(c);
  fps_tensor_def_t def = {.name = "late", .ndim = 1, .shape = {4}, .optim = {.flavor = FPS_OPTIM_TORCH}};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), FPS_CODE_DEADLINE_EXCEEDED, st);
  const char *names[1] = {"late"};
  assert_code(fps_client_get_state(c, names, 1, NULL, NULL, NULL, NULL, NULL, &st), FPS_CODE_FAILED_PRECONDITION,
              st);
  if (!strstr(st.message, "still initialising")) fail_msg("%s", st.message);
  fps_client_destroy(c);
  assert_int_equal(fps_test_server_stop(&srv), 0);
}

static void test_resume_and_replace_through_client(void **state) {
  (void)state;
  fps_test_server_t a[2], b[2];
  assert_int_equal(fps_test_servers_start(a, 2, "async", 1, NULL), 0);
  fps_status_t st;
  fps_client_t *ca = client_new(a, 2, &st);
  assert_non_null(ca);
  fps_tensor_def_t defs[NT];
  float *init[NT];
  defs_of(defs, init);
  assert_code(fps_client_create_tensors(ca, defs, NT, &st), 0, st);
  replica_t r[NT];
  replicas_init(r);
  train(ca, r, 0);
  /* What a state_dict would hold: params, state arrays, step, RMS. */
  const char *names[NT];
  float *params[NT], *row[NT], *col[NT], *var[NT], *mom[NT];
  fps_tensor_state_t info[NT];
  for (size_t t = 0; t < NT; t++) {
    uint64_t n = numel_of(&MODEL[t]);
    names[t] = MODEL[t].name;
    params[t] = malloc(n * sizeof(float));
    row[t] = calloc(n, sizeof(float));
    col[t] = calloc(n, sizeof(float));
    var[t] = calloc(n, sizeof(float));
    mom[t] = calloc(n, sizeof(float));
  }
  assert_code(fps_client_pull(ca, names, params, NULL, NT, &st), 0, st);
  assert_code(fps_client_get_state(ca, names, NT, info, row, col, var, mom, &st), 0, st);
  fps_client_destroy(ca);
  for (int i = 0; i < 2; i++) assert_int_equal(fps_test_server_stop(&a[i]), 0);

  /* New, empty shards: resume from it (64 KiB messages: "bias" takes
   * several Creates for its params and its state). */
  assert_int_equal(fps_test_servers_start(b, 2, "async", 1, NULL), 0);
  fps_client_t *cb = client_new(b, 2, &st);
  assert_non_null(cb);
  defs_of(defs, NULL);
  for (size_t t = 0; t < NT; t++) {
    defs[t].init = params[t];
    defs[t].step = info[t].step;
    defs[t].rms = info[t].rms;
    defs[t].state_row = info[t].row_elements ? row[t] : NULL;
    defs[t].state_col = info[t].col_elements ? col[t] : NULL;
    defs[t].state_var = info[t].var_elements ? var[t] : NULL;
    defs[t].state_mom = info[t].mom_elements ? mom[t] : NULL;
  }
  assert_code(fps_client_create_tensors(cb, defs, NT, &st), 0, st);
  train(cb, r, STEPS); /* asserts the params equal the uninterrupted replay */
  check_state(cb, r, 2 * STEPS);

  /* Local refusals. */
  fps_tensor_def_t bad = defs[0]; /* "w", factored */
  bad.state_var = var[0];
  assert_code(fps_client_create_tensors(cb, &bad, 1, &st), FPS_CODE_INVALID_ARGUMENT, st);
  bad = defs[0];
  bad.state_col = NULL;
  assert_code(fps_client_create_tensors(cb, &bad, 1, &st), FPS_CODE_INVALID_ARGUMENT, st);
  bad = defs[0];
  bad.step = 0;
  assert_code(fps_client_create_tensors(cb, &bad, 1, &st), FPS_CODE_INVALID_ARGUMENT, st);
  bad = defs[2]; /* "bias": 280 KB, more than one 64 KiB message */
  bad.replace = 1;
  assert_code(fps_client_create_tensors(cb, &bad, 1, &st), FPS_CODE_INVALID_ARGUMENT, st);
  if (!strstr(st.message, "one message")) fail_msg("%s", st.message);

  /* Replace "w" (and keep the list whole): fresh values at step 0. */
  float neww[30];
  for (int i = 0; i < 30; i++) neww[i] = 0.125f * (float)i;
  defs_of(defs, NULL);
  defs[0].init = neww;
  defs[0].replace = 1;
  assert_code(fps_client_create_tensors(cb, defs, NT, &st), 0, st);
  float got[30];
  float *gp[1] = {got};
  uint64_t v = 99;
  assert_code(fps_client_pull(cb, names, gp, &v, 1, &st), 0, st);
  assert_int_equal(v, 0);
  assert_memory_equal(got, neww, sizeof got);
  fps_client_destroy(cb);
  for (int i = 0; i < 2; i++) assert_int_equal(fps_test_server_stop(&b[i]), 0);
  replicas_free(r);
  for (size_t t = 0; t < NT; t++) {
    free(init[t]);
    free(params[t]);
    free(row[t]);
    free(col[t]);
    free(var[t]);
    free(mom[t]);
  }
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_state_matches_replay, teardown),
      cmocka_unit_test_teardown(test_state_survives_checkpoint_restart, teardown),
      cmocka_unit_test_teardown(test_state_of_initialising_tensor, teardown),
      cmocka_unit_test_teardown(test_resume_and_replace_through_client, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

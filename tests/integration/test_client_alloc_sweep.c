/* The allocation-failure sweep of libfactorps (common/alloc.h, the
 * library's own domain): for each public function whose file allocates
 * through fps_malloc, call i of the sweep makes the library's allocation
 * number i fail, until a call runs through without reaching it. Every
 * failed call must answer RESOURCE_EXHAUSTED with a message, and leave
 * the client usable: the same call, repeated without a fault, succeeds
 * with the result of a call that never saw one. The shards are real
 * factorps-server processes (their allocations are not counted here;
 * tests/integration/test_alloc_sweep.c sweeps the shard). */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <unistd.h>

#include <cmocka.h>

#include "alloc.h"
#include "factorps/client.h"
#include "harness.h"

/* A sweep longer than this is a runaway (a call that allocates without
 * bound); the real counts are in the tens. */
#define SWEEP_MAX 5000

#define NT 3

/* The tensors of every case: a matrix big enough to split over both
 * shards, a small matrix, a vector. */
static const char *const g_names[NT] = {"big", "small", "bias"};
static float g_big[64 * 32], g_small[8 * 4], g_bias[16];

static void defs_of(fps_tensor_def_t d[NT]) {
  memset(d, 0, NT * sizeof *d);
  d[0] = (fps_tensor_def_t){.name = g_names[0], .ndim = 2, .shape = {64, 32}, .init = g_big};
  d[1] = (fps_tensor_def_t){.name = g_names[1], .ndim = 2, .shape = {8, 4}, .init = g_small};
  d[2] = (fps_tensor_def_t){.name = g_names[2], .ndim = 1, .shape = {16}, .init = g_bias};
  for (size_t i = 0; i < sizeof g_big / sizeof *g_big; i++) g_big[i] = (float)i / 1000.0f;
  for (size_t i = 0; i < sizeof g_small / sizeof *g_small; i++) g_small[i] = (float)i;
  for (size_t i = 0; i < sizeof g_bias / sizeof *g_bias; i++) g_bias[i] = -(float)i;
}

/* One public call with its arguments; ok() checks a successful call's
 * result against the unfaulted one. */
typedef struct sweep_case_s {
  const char *what;
  int (*call)(struct sweep_case_s *k, fps_status_t *st);
  void (*ok)(struct sweep_case_s *k);
  /* Before the sweep: */
  enum { NO_SHARDS,
         SHARDS,
         TENSORS,
         CHECKPOINTS } job;             /* shards, tensors created, checkpoint dirs */
  void (*keep)(struct sweep_case_s *k); /* after one unfaulted call: keep its result */
  fps_client_t *c;
  fps_tensor_def_t defs[NT];
  fps_block_t blocks[2 * NT], want_blocks[2 * NT];
  size_t n_blocks;
  fps_tensor_state_t info[NT], want_info[NT];
  fps_checkpoint_info_t ckpt[2];
  fps_client_t *made;                        /* fps_client_create's */
  float got[NT][64 * 32], want[NT][64 * 32]; /* pulled or pushed params */
  uint64_t ver[NT], want_ver[NT];
  fps_shard_stats_t stats[2];
  fps_tensor_stats_t tstats;
  size_t found;
} sweep_case_t;

static void sweep(sweep_case_t *k) {
  fps_status_t st;
  uint64_t failed = 0, allocations = 0;
  for (uint64_t i = 1;; i++) {
    if (i > SWEEP_MAX) fail_msg("%s: still allocating after %d allocations", k->what, SWEEP_MAX);
    fps_client_alloc_fault_arm(i, 0);
    int rc = k->call(k, &st);
    uint64_t injected = fps_client_alloc_failures();
    allocations = fps_client_alloc_calls();
    fps_client_alloc_fault_disarm();
    if (!injected) {
      if (rc != 0) fail_msg("%s: unfaulted call: %s: %s", k->what, fps_code_name(rc), st.message);
      k->ok(k);
      break;
    }
    if (rc != FPS_CODE_RESOURCE_EXHAUSTED || !*st.message)
      fail_msg("%s: allocation %" PRIu64 " failed, the call answered %s: '%s'", k->what, i, fps_code_name(rc),
               st.message);
    failed++;
    /* Still usable: the same call without a fault succeeds. */
    rc = k->call(k, &st);
    if (rc != 0) fail_msg("%s: after allocation %" PRIu64 " failed: %s: %s", k->what, i, fps_code_name(rc), st.message);
    k->ok(k);
  }
  printf("%s: %" PRIu64 " allocations, each failed once: %" PRIu64 " answered RESOURCE_EXHAUSTED\n", k->what,
         allocations, failed);
  assert_true(failed > 0); /* the function does allocate through the wrapper */
}

/* --------------------------------------------------------------- shards */

static fps_test_server_t g_srv[2];
static char g_dir[2][128];

/* Two shards (with --checkpoint-dir if asked) and k->c, a client of
 * both; with `create` the tensors of k->defs are created first. */
static void job_start(sweep_case_t *k, bool checkpoints, bool create) {
  defs_of(k->defs);
  for (int s = 0; s < 2; s++) {
    char dir_flag[160];
    const char *extra[3] = {NULL};
    if (checkpoints) {
      snprintf(g_dir[s], sizeof g_dir[s], "/tmp/fps-client-sweep-%ld-%d", (long)getpid(), s);
      snprintf(dir_flag, sizeof dir_flag, "--checkpoint-dir=%s", g_dir[s]);
      extra[0] = dir_flag;
    }
    assert_int_equal(fps_test_server_start(&g_srv[s], s, 2, "async", 1, extra), 0);
  }
  const char *addrs[2] = {g_srv[0].addr, g_srv[1].addr};
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 20;
  fps_status_t st;
  k->c = fps_client_create(addrs, 2, &o, &st);
  if (!k->c) fail_msg("fps_client_create: %s", st.message);
  if (create && fps_client_create_tensors(k->c, k->defs, NT, &st) != 0) fail_msg("create: %s", st.message);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path) == 0 ? 0 : -1;
}

static int teardown(void **unused) {
  (void)unused;
  fps_client_alloc_fault_disarm();
  fps_test_servers_stop_all();
  for (int s = 0; s < 2; s++) {
    if (!*g_dir[s]) continue;
    if (nftw(g_dir[s], rm_entry, 8, FTW_DEPTH | FTW_PHYS) != 0) fprintf(stderr, "cannot remove %s\n", g_dir[s]);
    *g_dir[s] = 0;
  }
  return 0;
}

/* ------------------------------------------------------- placement_plan */

static int plan_call(sweep_case_t *k, fps_status_t *st) {
  memset(k->blocks, 0xa5, sizeof k->blocks);
  int rc = fps_client_placement_plan(k->defs, NT, 2, 1024, k->blocks, 2 * NT, &k->n_blocks, NULL, st);
  if (rc == 0) st->code = 0;
  return rc;
}

static void plan_ok(sweep_case_t *k) {
  assert_int_equal(k->n_blocks, 4); /* big in two blocks */
  assert_memory_equal(k->blocks, k->want_blocks, k->n_blocks * sizeof *k->blocks);
}


/* ------------------------------------------------------- create_tensors */

static int create_call(sweep_case_t *k, fps_status_t *st) {
  return fps_client_create_tensors(k->c, k->defs, NT, st);
}

/* The tensors are there, placed as the plan says, with their values. */
static void create_ok(sweep_case_t *k) {
  for (int i = 0; i < NT; i++) {
    uint32_t ndim = 0;
    uint64_t shape[8];
    assert_int_equal(fps_client_tensor_shape(k->c, g_names[i], &ndim, shape), 0);
    assert_int_equal(ndim, k->defs[i].ndim);
  }
  float got[64 * 32];
  float *params[1] = {got};
  const char *names[1] = {"big"};
  fps_status_t st;
  int rc = fps_client_pull(k->c, names, params, NULL, 1, &st);
  if (rc != 0) fail_msg("pull: %s", st.message);
  assert_memory_equal(got, g_big, sizeof got);
}


/* ------------------------------------------------------------ get_state */

static int state_call(sweep_case_t *k, fps_status_t *st) {
  memset(k->info, 0xa5, sizeof k->info);
  return fps_client_get_state(k->c, g_names, NT, k->info, NULL, NULL, NULL, NULL, st);
}

static void state_ok(sweep_case_t *k) { assert_memory_equal(k->info, k->want_info, sizeof k->info); }


/* ----------------------------------------------------------- checkpoint */

static int ckpt_call(sweep_case_t *k, fps_status_t *st) {
  memset(k->ckpt, 0, sizeof k->ckpt);
  return fps_client_checkpoint(k->c, k->ckpt, 2, st);
}

static void ckpt_ok(sweep_case_t *k) {
  for (int s = 0; s < 2; s++) {
    assert_true(k->ckpt[s].sequence > 0);
    assert_non_null(strstr(k->ckpt[s].path, g_dir[s]));
  }
}


/* --------------------------------------------------------------- create */

static int make_call(sweep_case_t *k, fps_status_t *st) {
  const char *addrs[2] = {g_srv[0].addr, g_srv[1].addr};
  fps_client_options_t o;
  fps_client_options_init(&o);
  k->made = fps_client_create(addrs, 2, &o, st);
  return k->made ? 0 : st->code;
}

static void make_ok(sweep_case_t *k) {
  assert_int_equal(fps_client_shard_count(k->made), 2);
  fps_client_destroy(k->made);
  k->made = NULL;
}


/* -------------------------------------------------- pull and push_pull */

static void params_ok(sweep_case_t *k) {
  assert_memory_equal(k->got, k->want, sizeof k->got);
  assert_memory_equal(k->ver, k->want_ver, sizeof k->ver);
}

static int pull_call(sweep_case_t *k, fps_status_t *st) {
  float *params[NT] = {k->got[0], k->got[1], k->got[2]};
  memset(k->got, 0xa5, sizeof k->got);
  return fps_client_pull(k->c, g_names, params, k->ver, NT, st);
}


/* One push under one idempotency key: the shard applies it once, and
 * every later call with the key (after a fault or not) gets its result
 * again. */
static int push_call(sweep_case_t *k, fps_status_t *st) {
  static float g0[64 * 32], g1[8 * 4], g2[16];
  const float *grads[NT] = {g0, g1, g2};
  for (size_t i = 0; i < sizeof g0 / sizeof *g0; i++) g0[i] = 0.5f;
  for (size_t i = 0; i < sizeof g1 / sizeof *g1; i++) g1[i] = -0.25f;
  for (size_t i = 0; i < sizeof g2 / sizeof *g2; i++) g2[i] = 1.0f;
  float *params[NT] = {k->got[0], k->got[1], k->got[2]};
  fps_push_args_t args = {.worker_id = 0, .step = 0, .push_id = 0x5eed};
  memset(k->got, 0xa5, sizeof k->got);
  return fps_client_push_pull_ex(k->c, &args, g_names, grads, NULL, params, k->ver, NT, st);
}


/* ------------------------------------------------------ stats, discover */

static int stats_call(sweep_case_t *k, fps_status_t *st) {
  memset(k->stats, 0, sizeof k->stats);
  return fps_client_stats(k->c, k->stats, 2, st);
}

static void stats_ok(sweep_case_t *k) {
  for (uint32_t s = 0; s < 2; s++) {
    assert_int_equal(k->stats[s].shard_id, s);
    assert_int_equal(k->stats[s].shard_count, 2);
    assert_string_equal(k->stats[s].mode, "async");
  }
  assert_int_equal(k->stats[0].tensors + k->stats[1].tensors, NT);
}


static int tstats_call(sweep_case_t *k, fps_status_t *st) {
  memset(&k->tstats, 0, sizeof k->tstats);
  return fps_client_tensor_stats(k->c, "big", &k->tstats, NULL, 0, NULL, st);
}

static void tstats_ok(sweep_case_t *k) {
  assert_string_equal(k->tstats.name, "big");
  assert_int_equal(k->tstats.ndim, 2);
  assert_int_equal(k->tstats.param_elements, 64 * 32);
}


static int discover_call(sweep_case_t *k, fps_status_t *st) {
  k->found = 0;
  return fps_client_discover(k->c, &k->found, st);
}

static void discover_ok(sweep_case_t *k) {
  assert_int_equal(k->found, NT);
  for (int i = 0; i < NT; i++) assert_true(fps_client_shard_of(k->c, g_names[i]) >= -1);
}


/* ------------------------------------------------------------ the cases */

static void keep_blocks(sweep_case_t *k) { memcpy(k->want_blocks, k->blocks, sizeof k->blocks); }
static void keep_info(sweep_case_t *k) { memcpy(k->want_info, k->info, sizeof k->info); }

static void keep_params(sweep_case_t *k) {
  memcpy(k->want, k->got, sizeof k->got);
  memcpy(k->want_ver, k->ver, sizeof k->ver);
}

static void keep_pushed(sweep_case_t *k) {
  for (int i = 0; i < NT; i++) assert_int_equal(k->ver[i], 1);
  keep_params(k);
}

static sweep_case_t g_cases[] = {
    {.what = "fps_client_placement_plan", .call = plan_call, .ok = plan_ok, .job = NO_SHARDS, .keep = keep_blocks},
    {.what = "fps_client_create_tensors", .call = create_call, .ok = create_ok, .job = SHARDS, .keep = NULL},
    {.what = "fps_client_get_state", .call = state_call, .ok = state_ok, .job = TENSORS, .keep = keep_info},
    {.what = "fps_client_checkpoint", .call = ckpt_call, .ok = ckpt_ok, .job = CHECKPOINTS, .keep = NULL},
    {.what = "fps_client_create", .call = make_call, .ok = make_ok, .job = SHARDS, .keep = NULL},
    {.what = "fps_client_pull", .call = pull_call, .ok = params_ok, .job = TENSORS, .keep = keep_params},
    {.what = "fps_client_push_pull_ex", .call = push_call, .ok = params_ok, .job = TENSORS, .keep = keep_pushed},
    {.what = "fps_client_stats", .call = stats_call, .ok = stats_ok, .job = TENSORS, .keep = NULL},
    {.what = "fps_client_tensor_stats", .call = tstats_call, .ok = tstats_ok, .job = TENSORS, .keep = NULL},
    {.what = "fps_client_discover", .call = discover_call, .ok = discover_ok, .job = TENSORS, .keep = NULL},
};

static void run_case(void **state) {
  sweep_case_t *k = *state;
  defs_of(k->defs);
  if (k->job != NO_SHARDS) job_start(k, k->job == CHECKPOINTS, k->job >= TENSORS);
  fps_status_t st;
  if (k->keep) {
    if (k->call(k, &st) != 0) fail_msg("%s: %s", k->what, st.message);
    k->keep(k);
  }
  sweep(k);
  fps_client_destroy(k->c);
  k->c = NULL;
}

/* One test per case, named after its function without the prefix
 * (test_create_tensors); argv[1] runs only the one of that name. */
int main(int argc, char **argv) {
  enum { N = sizeof g_cases / sizeof g_cases[0] };
  static char names[N][64];
  struct CMUnitTest tests[N];
  for (size_t i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "test_%s", g_cases[i].what + strlen("fps_client_"));
    tests[i] = (struct CMUnitTest){names[i], run_case, NULL, teardown, &g_cases[i]};
  }
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return _cmocka_run_group_tests("client_alloc_sweep", tests, N, NULL, NULL);
}

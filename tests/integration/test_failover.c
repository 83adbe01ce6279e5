/* libfactorps with a shard's replicas listed in one address entry
 * ("a:p|b:p", standby replicas): the entry is checked, and a call that a replica
 * refuses UNAVAILABLE (a fake standby, tests/mocks/fake_replica.c) or that
 * cannot reach one (a port nothing listens on) goes on to the next replica,
 * a real shard, and is applied there once. The client then starts at the
 * replica that answered. With no replica answering, the call fails
 * UNAVAILABLE after max_retries rounds over all of them.
 * The failover between real primary and standby processes is
 * tests/replica/. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "factorps/client.h"
#include "fake_replica.h"
#include "harness.h"

#define NUMEL 1000
#define STANDBY_MSG "shard 0 is a standby (term 2); primary unknown"

#define assert_code(expr, code, st)                                                      \
  do {                                                                                   \
    int rc_ = (expr);                                                                    \
    if (rc_ != (code)) fail_msg("got %s, want %s: %s", fps_code_name(rc_), fps_code_name(code), \
                                (st).message);                                           \
  } while (0)

static int teardown(void **state) {
  (void)state;
  fps_test_servers_stop_all();
  return 0;
}

static fps_client_t *client_for(const char *entry, int max_retries, double backoff,
                                fps_status_t *st) {
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 30;
  o.max_retries = max_retries;
  o.backoff_initial_seconds = backoff;
  const char *addrs[1] = {entry};
  return fps_client_create(addrs, 1, &o, st);
}

/* One async tensor of NUMEL elements: created, then pushed `steps` times;
 * each push must be applied once (versions 1..steps). */
static void create_and_push(fps_client_t *c, int steps) {
  fps_status_t st;
  static float init[NUMEL], grad[NUMEL], params[NUMEL];
  for (int i = 0; i < NUMEL; i++) {
    init[i] = (float)i * 1e-3f;
    grad[i] = 1e-2f;
  }
  fps_tensor_def_t def = {.name = "w", .ndim = 1, .shape = {NUMEL},
                          .optim = {.flavor = FPS_OPTIM_TORCH}, .init = init};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), FPS_CODE_OK, st);
  const char *names[1] = {"w"};
  const float *grads[1] = {grad};
  float *outs[1] = {params};
  for (int s = 0; s < steps; s++) {
    uint64_t version = 0;
    assert_code(fps_client_push_pull(c, 0, (uint64_t)s, names, grads, outs, &version, 1, &st),
                FPS_CODE_OK, st);
    assert_int_equal(version, (uint64_t)s + 1);
  }
}

static void test_entries_are_checked(void **state) {
  (void)state;
  static const struct {
    const char *entry, *says;
  } bad[] = {
      {"127.0.0.1:1||127.0.0.1:2", "empty replica address (replica 1)"},
      {"|127.0.0.1:1", "empty replica address (replica 0)"},
      {"127.0.0.1:1|", "empty replica address (replica 1)"},
      {"a:1|b:1|c:1|d:1|e:1", "lists 5 replicas; at most 4"},
      {"a:1|b:1|a:1", "lists replica 'a:1' twice"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    fps_status_t st;
    /* The bad entry is shard 1: the error names it and its index. */
    const char *addrs[2] = {"127.0.0.1:9", bad[i].entry};
    fps_client_t *c = fps_client_create(addrs, 2, NULL, &st);
    assert_null(c);
    assert_int_equal(st.code, FPS_CODE_INVALID_ARGUMENT);
    assert_int_equal(st.shard, 1);
    if (!strstr(st.message, bad[i].says) || !strstr(st.message, bad[i].entry))
      fail_msg("entry '%s': message '%s' does not say '%s'", bad[i].entry, st.message, bad[i].says);
  }
  /* FPS_CLIENT_MAX_REPLICAS replicas are fine (connection is lazy). */
  fps_status_t st;
  const char *ok[1] = {"a:1|b:1|c:1|d:1"};
  fps_client_t *c = fps_client_create(ok, 1, NULL, &st);
  assert_non_null(c);
  fps_client_destroy(c);
}

/* A standby's refusal sends the call on to the primary; later calls start
 * at the primary and never ask the standby again. */
static void test_refused_replica_leads_to_primary(void **state) {
  (void)state;
  fps_test_server_t srv;
  fps_status_t st;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  fps_fake_replica_t *standby = fps_fake_replica_start(FPS_CODE_UNAVAILABLE, STANDBY_MSG);
  assert_non_null(standby);
  char entry[160];
  snprintf(entry, sizeof entry, "%s|%s", fps_fake_replica_addr(standby), srv.addr);
  /* max_retries 0: one round over both replicas, so the primary is reached
   * without a backoff (30 s here, more than the deadline's half). */
  fps_client_t *c = client_for(entry, 0, 30, &st);
  assert_non_null(c);
  create_and_push(c, 3);
  assert_int_equal(fps_fake_replica_calls(standby), 1);
  fps_shard_stats_t ss;
  assert_code(fps_client_stats(c, &ss, 1, &st), FPS_CODE_OK, st);
  assert_int_equal(ss.updates, 3); /* each push applied once */
  assert_int_equal(fps_fake_replica_calls(standby), 1);
  fps_client_destroy(c);

  /* Listed first, the primary is the only one asked. */
  snprintf(entry, sizeof entry, "%s|%s", srv.addr, fps_fake_replica_addr(standby));
  c = client_for(entry, 0, 30, &st);
  assert_non_null(c);
  const char *names[1] = {"w"};
  static float params[NUMEL];
  float *outs[1] = {params};
  uint64_t version = 0;
  fps_tensor_def_t def = {.name = "w", .ndim = 1, .shape = {NUMEL},
                          .optim = {.flavor = FPS_OPTIM_TORCH}};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), FPS_CODE_OK, st);
  assert_code(fps_client_pull(c, names, outs, &version, 1, &st), FPS_CODE_OK, st);
  assert_int_equal(version, 3);
  assert_int_equal(fps_fake_replica_calls(standby), 1);
  fps_client_destroy(c);
  fps_fake_replica_stop(standby);
}

/* A replica nobody listens on: the call goes on to the next one at once. */
static void test_dead_replica_leads_to_primary(void **state) {
  (void)state;
  fps_test_server_t srv;
  fps_status_t st;
  assert_int_equal(fps_test_server_start(&srv, 0, 1, "async", 1, NULL), 0);
  char entry[160];
  snprintf(entry, sizeof entry, "127.0.0.1:%d|%s", fps_test_dead_port(), srv.addr);
  fps_client_t *c = client_for(entry, 0, 30, &st);
  assert_non_null(c);
  create_and_push(c, 3);
  fps_client_destroy(c);
}

/* No replica answers: UNAVAILABLE after max_retries + 1 rounds, each
 * asking the standby once, and the message says what the last one said. */
static void test_no_replica_answers(void **state) {
  (void)state;
  fps_status_t st;
  fps_fake_replica_t *standby = fps_fake_replica_start(FPS_CODE_UNAVAILABLE, STANDBY_MSG);
  assert_non_null(standby);
  char entry[160];
  snprintf(entry, sizeof entry, "127.0.0.1:%d|%s", fps_test_dead_port(),
           fps_fake_replica_addr(standby));
  fps_client_t *c = client_for(entry, 2, 0.01, &st);
  assert_non_null(c);
  fps_tensor_def_t def = {.name = "w", .ndim = 1, .shape = {NUMEL},
                          .optim = {.flavor = FPS_OPTIM_TORCH}};
  assert_code(fps_client_create_tensors(c, &def, 1, &st), FPS_CODE_UNAVAILABLE, st);
  assert_int_equal(st.shard, 0);
  assert_int_equal(fps_fake_replica_calls(standby), 3);
  if (!strstr(st.message, "is a standby") || !strstr(st.message, fps_fake_replica_addr(standby)))
    fail_msg("message does not name the standby's refusal: %s", st.message);
  fps_client_destroy(c);
  fps_fake_replica_stop(standby);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_entries_are_checked, teardown),
      cmocka_unit_test_teardown(test_refused_replica_leads_to_primary, teardown),
      cmocka_unit_test_teardown(test_dead_replica_leads_to_primary, teardown),
      cmocka_unit_test_teardown(test_no_replica_answers, teardown),
  };
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return cmocka_run_group_tests(tests, NULL, NULL);
}

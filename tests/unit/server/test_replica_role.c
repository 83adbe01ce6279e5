/* server/replica_role.c: the role machine of a replicated shard. Terms
 * only grow; only a primary acknowledges; a primary that sees a higher
 * term steps down at once; a standby competes for the lease only when it
 * cannot lose anything acknowledged (joined, or never contacted). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "error.h"
#include "replica.h"

static void solo_never_changes(void **state) {
  (void)state;
  fps_role_t r;
  fps_role_init(&r, false);
  char why[256] = "";
  assert_int_equal(fps_role_refusal(&r, 0, why, sizeof why), 0);
  assert_int_equal(fps_role_promote(&r, 5), FPS_ESTATE);
  assert_false(fps_role_fence(&r, 9));
  assert_false(fps_role_lease_lost(&r));
  assert_false(fps_role_may_compete(&r));
  uint64_t id = 0;
  assert_int_equal(fps_role_hello(&r, 3, "h:1", &id, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "solo"));
  fps_role_view_t v;
  fps_role_get(&r, &v);
  assert_int_equal(v.role, FPS_REPLICA_SOLO);
  assert_int_equal(v.term, 0);
  assert_string_equal(fps_replica_role_name(v.role), "solo");
  fps_role_destroy(&r);
}

static void cold_start_then_failover(void **state) {
  (void)state;
  fps_role_t a, b;
  fps_role_init(&a, true);
  fps_role_init(&b, true);
  char why[256] = "";
  uint64_t sb = 0, sa = 0, old = 0;
  /* Both start as standbys that may compete (nobody streamed to them). */
  assert_true(fps_role_may_compete(&a));
  assert_true(fps_role_may_compete(&b));
  assert_int_equal(fps_role_refusal(&a, 3, why, sizeof why), FPS_EUNAVAILABLE);
  assert_string_equal(why, "shard 3 is a standby (term 0); primary unknown");
  /* a wins the lease with term 1. */
  assert_int_equal(fps_role_promote(&a, 1), 0);
  assert_int_equal(fps_role_refusal(&a, 3, why, sizeof why), 0);
  assert_false(fps_role_may_compete(&a));
  /* a streams to b: b stops competing until its transfer completes. */
  assert_int_equal(fps_role_hello(&b, 1, "10.0.0.5:50051", &sb, why, sizeof why), 0);
  assert_false(fps_role_may_compete(&b));
  assert_int_equal(fps_role_refusal(&b, 3, why, sizeof why), FPS_EUNAVAILABLE);
  assert_string_equal(why, "shard 3 is a standby (term 1); primary: 10.0.0.5:50051");
  fps_role_standby_joined(&b, sb + 1); /* another stream's transfer: ignored */
  assert_false(fps_role_may_compete(&b));
  fps_role_standby_joined(&b, sb);
  assert_true(fps_role_may_compete(&b));
  fps_role_primary_joined(&a, 1, true);
  fps_role_view_t v;
  fps_role_get(&a, &v);
  assert_true(v.joined);
  /* a dies: b's stream ends, b keeps its joined state and competes; a
   * term not above the highest seen is refused. */
  fps_role_stream_ended(&b, sb);
  assert_true(fps_role_may_compete(&b));
  assert_int_equal(fps_role_promote(&b, 1), FPS_ESTATE);
  assert_int_equal(fps_role_promote(&b, 2), 0);
  fps_role_get(&b, &v);
  assert_int_equal(v.role, FPS_REPLICA_PRIMARY);
  assert_int_equal(v.term, 2);
  assert_int_equal(v.failovers, 1);
  assert_false(v.joined); /* no standby joined this term yet */
  /* a, alive behind a partition, hears of term 2: it steps down at once
   * and must take a state transfer before it may compete again. */
  assert_false(fps_role_fence(&a, 1));
  assert_true(fps_role_fence(&a, 2));
  fps_role_get(&a, &v);
  assert_int_equal(v.role, FPS_REPLICA_STANDBY);
  assert_int_equal(v.term, 2);
  assert_false(fps_role_may_compete(&a));
  assert_int_equal(fps_role_refusal(&a, 3, why, sizeof why), FPS_EUNAVAILABLE);
  /* An old primary's stream (term 1) is refused by both. */
  uint64_t none = 0;
  assert_int_equal(fps_role_hello(&a, 1, "x:1", &none, why, sizeof why), FPS_ESTATE);
  assert_string_equal(why, "term 1 is older than 2");
  assert_int_equal(fps_role_hello(&b, 1, "x:1", &none, why, sizeof why), FPS_ESTATE);
  assert_string_equal(why, "term 1 is older than 2");
  /* A primary never takes a stream of its own term. */
  assert_int_equal(fps_role_hello(&b, 2, "x:1", &none, why, sizeof why), FPS_ESTATE);
  assert_int_equal(none, 0);
  /* b streams to a: a rejoins. */
  assert_int_equal(fps_role_hello(&a, 2, "b:1", &sa, why, sizeof why), 0);
  fps_role_standby_joined(&a, sa);
  assert_true(fps_role_may_compete(&a));
  /* b reconnects in the same term while a's handler of the old stream
   * still runs: the new stream is the current one; the old one's end (or
   * a transfer_done it still carried) changes nothing of the new one. */
  old = sa;
  assert_int_equal(fps_role_hello(&a, 2, "b:1", &sa, why, sizeof why), 0);
  assert_true(sa != old);
  assert_false(fps_role_may_compete(&a)); /* the new stream's transfer first */
  fps_role_standby_joined(&a, old);
  assert_false(fps_role_may_compete(&a));
  fps_role_stream_ended(&a, old);
  fps_role_get(&a, &v);
  assert_true(v.streaming);
  assert_int_equal(v.stream, sa);
  fps_role_standby_joined(&a, sa);
  assert_true(fps_role_may_compete(&a));
  fps_role_destroy(&a);
  fps_role_destroy(&b);
}

static void newer_hello_steps_a_primary_down(void **state) {
  (void)state;
  fps_role_t r;
  fps_role_init(&r, true);
  char why[256];
  assert_int_equal(fps_role_promote(&r, 4), 0);
  uint64_t id = 0;
  assert_int_equal(fps_role_hello(&r, 7, "new:1", &id, why, sizeof why), 0);
  fps_role_view_t v;
  fps_role_get(&r, &v);
  assert_int_equal(v.role, FPS_REPLICA_STANDBY);
  assert_int_equal(v.term, 7);
  assert_true(v.streaming);
  assert_false(v.joined);
  assert_string_equal(v.primary, "new:1");
  /* The lease lost by a standby changes nothing. */
  assert_false(fps_role_lease_lost(&r));
  /* A standby that hears of a newer term than its stream's is no longer
   * joined: what it holds may be behind that term. */
  fps_role_standby_joined(&r, id);
  assert_true(fps_role_may_compete(&r));
  assert_false(fps_role_fence(&r, 9));
  assert_false(fps_role_may_compete(&r));
  /* Nor can that stream's later transfer_done make it joined again. */
  fps_role_standby_joined(&r, id);
  assert_false(fps_role_may_compete(&r));
  fps_role_destroy(&r);
}

static void lease_loss_steps_down(void **state) {
  (void)state;
  fps_role_t r;
  fps_role_init(&r, true);
  assert_int_equal(fps_role_promote(&r, 1), 0);
  assert_true(fps_role_lease_lost(&r));
  char why[256];
  assert_int_equal(fps_role_refusal(&r, 0, why, sizeof why), FPS_EUNAVAILABLE);
  assert_false(fps_role_may_compete(&r));
  fps_role_destroy(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(solo_never_changes),
      cmocka_unit_test(cold_start_then_failover),
      cmocka_unit_test(newer_hello_steps_a_primary_down),
      cmocka_unit_test(lease_loss_steps_down),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The shard core's ssp waits, driven directly with a fake clock: a worker
 * at most S steps ahead of the slowest goes at once; one further ahead
 * parks until the slowest advances (resumed through its done callback),
 * its deadline passes, its call goes away, or the shard shuts down. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "shard_fixture.h"

static const uint64_t DIMS[] = {8, 4};
#define N 32

static fps_push_t *push(fps_shard_t *sh, uint32_t w, uint64_t step, int64_t deadline, fx_done_t *d, const float *g) {
  fps_push_t *p = fx_push_new(sh, w, step, deadline, d);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  return p;
}

static void admit_park_advance(void **unused) {
  (void)unused;
  float v[N], g[N], got[N];
  fx_fill(v, N, 80);
  fx_fill(g, N, 81);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SSP, 2, 1); /* W = 2, S = 1 */
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  fx_done_t d;
  /* Worker 0 at steps 0 and 1: within S of worker 1 (at 0): at once. */
  for (uint64_t s = 0; s < 2; s++) {
    fps_push_t *p = push(&sh, 0, s, INT64_MAX, &d, g);
    assert_int_equal(fx_commit(p, NULL), 0);
    assert_int_equal(d.calls, 0);
    fps_push_destroy(p);
  }
  assert_int_equal(fx_params(&sh, "w", got), 2);
  /* Step 2 is 2 ahead of worker 1's clock 0: parks, nothing applied. */
  fx_done_t dp;
  fps_push_t *parked = push(&sh, 0, 2, INT64_MAX, &dp, g);
  assert_int_equal(fx_commit(parked, NULL), FPS_EAGAIN);
  assert_non_null(sh.ssp_waits);
  assert_int_equal(fx_params(&sh, "w", got), 2);
  /* Worker 1 finishes step 0: its clock is 1, step 2 may go now, and the
   * parked push is applied and resumed on this thread. */
  fx_done_t d1;
  fps_push_t *p1 = push(&sh, 1, 0, INT64_MAX, &d1, g);
  assert_int_equal(fx_commit(p1, NULL), 0);
  assert_int_equal(dp.calls, 1);
  assert_int_equal(dp.err, 0);
  assert_null(sh.ssp_waits);
  fps_push_out_t o;
  fps_push_take(parked, 0, &o);
  assert_int_equal(o.version, 4);
  fps_snap_unref(o.snap);
  fps_push_destroy(parked);
  fps_push_destroy(p1);
  assert_int_equal(fx_params(&sh, "w", got), 4);
  assert_int_equal(sh.ssp_clock[0], 3);
  assert_int_equal(sh.ssp_clock[1], 1);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void parked_push_expires_is_cancelled_or_shut_down(void **unused) {
  (void)unused;
  float v[N], g[N], got[N];
  fx_fill(v, N, 82);
  fx_fill(g, N, 83);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SSP, 2, 0); /* S = 0: lockstep */
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  fx_done_t d;
  fps_push_t *p = push(&sh, 0, 0, INT64_MAX, &d, g);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_destroy(p);
  /* Deadline: the push's own. */
  int64_t t0 = fps_now_ns();
  p = push(&sh, 0, 1, t0 + INT64_C(1000000000), &d, g);
  assert_int_equal(fx_commit(p, NULL), FPS_EAGAIN);
  fps_shard_expire(&sh, t0 + INT64_C(999999999));
  assert_int_equal(d.calls, 0);
  fps_fake_clock_advance(INT64_C(1000000000));
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d.calls, 1);
  assert_int_equal(d.err, FPS_ETIMEOUT);
  assert_non_null(strstr(d.why, "worker 0 at step 1"));
  assert_non_null(strstr(d.why, "slowest worker (step 0)"));
  fps_push_destroy(p);
  /* Cancel: its call went away. */
  p = push(&sh, 0, 1, INT64_MAX, &d, g);
  assert_int_equal(fx_commit(p, NULL), FPS_EAGAIN);
  fps_push_cancel(p);
  assert_int_equal(d.calls, 1);
  assert_int_equal(d.err, FPS_ECANCELLED);
  fps_push_destroy(p);
  /* Shutdown. */
  p = push(&sh, 0, 1, INT64_MAX, &d, g);
  assert_int_equal(fx_commit(p, NULL), FPS_EAGAIN);
  fps_shard_fail_waiting(&sh, FPS_EUNAVAILABLE, "shard is shutting down");
  assert_int_equal(d.calls, 1);
  assert_int_equal(d.err, FPS_EUNAVAILABLE);
  fps_push_destroy(p);
  /* None of them was applied. */
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_null(sh.ssp_waits);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(admit_park_advance),
      cmocka_unit_test(parked_push_expires_is_cancelled_or_shut_down),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

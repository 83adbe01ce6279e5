/* The shard core's sync rounds, driven directly with a fake clock: a round
 * completes when its W-th member joins, with the result bit-identical to
 * summing the gradients in worker-id order (whatever the arrival order,
 * slice order and slice sizes); every member is resolved through its done
 * callback; deadline, duplicate, stale, ahead; a withdrawn (cancelled)
 * member never counts; shutdown fails the waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "shard_fixture.h"

static const uint64_t DIMS[] = {33, 17}; /* factored, odd sizes */
#define N (33 * 17)
#define W 4

/* What a local replay does: ((g0 + g1) + g2) + g3 in fp32, / W, one step
 * through an async shard (the same kernels). */
static void replay(const float *init, float g[][N], uint32_t nw, float *out) {
  fps_shard_t ref;
  fx_shard(&ref, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&ref, "w", DIMS, 2, init), 0);
  static float sum[N];
  memcpy(sum, g[0], sizeof sum);
  for (uint32_t w = 1; w < nw; w++)
    for (uint64_t i = 0; i < N; i++) sum[i] += g[w][i];
  for (uint64_t i = 0; i < N; i++) sum[i] /= (float)nw;
  fx_done_t d;
  fps_push_t *p = fx_push_new(&ref, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", sum, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_destroy(p);
  assert_int_equal(fx_params(&ref, "w", out), 1);
  fx_shard_free(&ref);
}

static bool next_perm(size_t *a, size_t n) {
  size_t i = n - 1;
  while (i > 0 && a[i - 1] >= a[i]) i--;
  if (i == 0) return false;
  size_t j = n - 1;
  while (a[j] <= a[i - 1]) j--;
  size_t t = a[i - 1];
  a[i - 1] = a[j];
  a[j] = t;
  for (size_t l = i, r = n - 1; l < r; l++, r--) t = a[l], a[l] = a[r], a[r] = t;
  return true;
}

static void round_is_bit_identical_in_every_arrival_order(void **unused) {
  (void)unused;
  static float init[N], g[W][N], want[N], got[N];
  fx_fill(init, N, 20);
  for (uint32_t w = 0; w < W; w++) fx_fill(g[w], N, 21 + w);
  replay(init, g, W, want);
  size_t order[W] = {0, 1, 2, 3};
  int orders = 0;
  uint32_t seed = 1;
  do {
    fps_shard_t sh;
    fx_shard(&sh, FPS_MODE_SYNC, W, 0);
    assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
    fps_push_t *p[W];
    fx_done_t d[W];
    for (size_t k = 0; k < W; k++) {
      uint32_t w = (uint32_t)order[k];
      p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
      /* Slices in a random order and of random sizes. */
      size_t parts = 1 + (seed = seed * 1103515245u + 12345u) % 7, perm[8];
      for (size_t i = 0; i < parts; i++) perm[i] = i;
      for (size_t i = parts; i > 1; i--) {
        size_t j = (seed = seed * 1103515245u + 12345u) % i, t = perm[i - 1];
        perm[i - 1] = perm[j];
        perm[j] = t;
      }
      assert_int_equal(fx_push_grad(p[w], "w", g[w], N, parts, perm), 0);
      int rc = fx_commit(p[w], NULL);
      if (k < W - 1) {
        assert_int_equal(rc, FPS_EAGAIN); /* waits for the others */
        assert_int_equal(fx_params(&sh, "w", got), 0);
      } else {
        assert_int_equal(rc, 0); /* the last member completes the round */
      }
    }
    for (uint32_t w = 0; w < W; w++) {
      /* Every member but the last is resolved through its callback, once. */
      assert_int_equal(d[w].calls, w == order[W - 1] ? 0 : 1);
      char why[FPS_WHY_MAX];
      assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
      fps_push_out_t o;
      fps_push_take(p[w], 0, &o);
      assert_int_equal(o.version, 1);
      assert_memory_equal(o.snap->data, want, sizeof want);
      fps_snap_unref(o.snap);
      fps_push_destroy(p[w]);
    }
    assert_int_equal(fx_params(&sh, "w", got), 1);
    assert_memory_equal(got, want, sizeof want);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_null(sh.rounds);
    fx_shard_free(&sh);
    orders++;
  } while (next_perm(order, W));
  assert_int_equal(orders, 24);
}

static void round_deadline_fails_members_and_changes_nothing(void **unused) {
  (void)unused;
  static float init[N], g[N], got[N];
  fx_fill(init, N, 30);
  fx_fill(g, N, 31);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 3, 0);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fx_done_t d1;
  /* The call's deadline (5 s) is earlier than the shard's (10 s): the round
   * fails a margin before it (a quarter of 5 s, at most 1 s: at 4 s). */
  int64_t t0 = fps_now_ns();
  fps_push_t *p = fx_push_new(&sh, 1, 0, t0 + INT64_C(5000000000), &d1);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), FPS_EAGAIN);
  fps_fake_clock_advance(INT64_C(3900000000));
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d1.calls, 0); /* not yet: 3.9 s < 5 s - 1 s */
  fps_fake_clock_advance(INT64_C(200000000));
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d1.calls, 1);
  assert_int_equal(d1.err, FPS_ETIMEOUT);
  assert_non_null(strstr(d1.why, "'w'"));
  assert_non_null(strstr(d1.why, "waiting for workers 0, 2"));
  assert_non_null(strstr(d1.why, "2 of 3 missing"));
  assert_non_null(strstr(d1.why, "unchanged"));
  fps_push_destroy(p);
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, init, sizeof got);
  assert_null(sh.rounds);
  /* The round is gone: the shard's own deadline applies to a call without. */
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), FPS_EAGAIN);
  fps_fake_clock_advance((int64_t)(FX_DEADLINE_S * 1e9) - 1);
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d1.calls, 0);
  fps_fake_clock_advance(1);
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d1.calls, 1);
  assert_int_equal(d1.err, FPS_ETIMEOUT);
  fps_push_destroy(p);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void duplicate_stale_and_ahead(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N];
  fx_fill(init, N, 40);
  fx_fill(g[0], N, 41);
  fx_fill(g[1], N, 42);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 2, 0);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  char why[FPS_WHY_MAX];
  fx_done_t d0, d0b, d1, dx;
  /* Ahead: step 1 while the tensor is at version 0, refused at the slice. */
  fps_push_t *x = fx_push_new(&sh, 1, 1, INT64_MAX, &dx);
  assert_int_equal(fx_push_grad(x, "w", g[1], N, 1, NULL), FPS_EAHEAD);
  fps_push_destroy(x);
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  assert_int_equal(fx_push_grad(p0, "w", g[0], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  /* Duplicate: worker 0 again for the same step, not counted twice. */
  fps_push_t *p0b = fx_push_new(&sh, 0, 0, INT64_MAX, &d0b);
  assert_int_equal(fx_push_grad(p0b, "w", g[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0b, why), FPS_EDUP);
  assert_non_null(strstr(why, "duplicate push: worker 0"));
  assert_int_equal(d0b.calls, 0);
  fps_push_destroy(p0b);
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p1, "w", g[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p1, NULL), 0);
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d0.err, 0);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  replay(init, g, 2, want);
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);
  /* Stale: step 0 is applied already. */
  x = fx_push_new(&sh, 1, 0, INT64_MAX, &dx);
  assert_int_equal(fx_push_grad(x, "w", g[1], N, 1, NULL), FPS_ESTALE);
  fps_push_destroy(x);
  /* A worker id beyond W is refused at the header. */
  fps_push_create(&sh, INT64_MAX, NULL, NULL, &x);
  assert_int_equal(fps_push_header(x, 2, 1, false, 0, 0, why, sizeof why), FPS_ESTATE);
  fps_push_destroy(x);
  fx_shard_free(&sh);
}

static void withdrawn_member_never_counts(void **unused) {
  (void)unused;
  static float init[N], g[3][N], want[N], got[N];
  fx_fill(init, N, 50);
  for (int i = 0; i < 3; i++) fx_fill(g[i], N, 51 + i);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 2, 0);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fx_done_t d0, d0b, d1, dc;
  /* Worker 0 joins with g[2], then its call goes away: withdrawn. */
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  assert_int_equal(fx_push_grad(p0, "w", g[2], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  fps_push_cancel(p0);
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d0.err, FPS_ECANCELLED);
  fps_push_cancel(p0); /* twice is harmless */
  assert_int_equal(d0.calls, 1);
  fps_push_destroy(p0);
  assert_null(sh.rounds);
  /* A push cancelled before its commit never joins. */
  fps_push_t *pc = fx_push_new(&sh, 0, 0, INT64_MAX, &dc);
  assert_int_equal(fx_push_grad(pc, "w", g[2], N, 1, NULL), 0);
  fps_push_cancel(pc);
  assert_int_equal(fx_commit(pc, NULL), FPS_ECANCELLED);
  assert_int_equal(dc.calls, 0);
  fps_push_destroy(pc);
  /* The retry and worker 1 complete the round without g[2]. */
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p1, "w", g[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p1, NULL), FPS_EAGAIN);
  fps_push_t *p0b = fx_push_new(&sh, 0, 0, INT64_MAX, &d0b);
  assert_int_equal(fx_push_grad(p0b, "w", g[0], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0b, NULL), 0);
  assert_int_equal(d1.calls, 1);
  assert_int_equal(d1.err, 0);
  fps_push_destroy(p1);
  fps_push_destroy(p0b);
  replay(init, g, 2, want);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void joins_all_rounds_or_none_and_shutdown_fails_waiting(void **unused) {
  (void)unused;
  static float init[N], g[N];
  fx_fill(init, N, 60);
  fx_fill(g, N, 61);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 2, 0);
  assert_int_equal(fx_create(&sh, "a", DIMS, 2, init), 0);
  assert_int_equal(fx_create(&sh, "b", DIMS, 2, init), 0);
  fx_done_t d0, d0b, d1;
  /* Worker 0 waits in a's round only. */
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  assert_int_equal(fx_push_grad(p0, "a", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  /* Worker 0 again with a and b: a is a duplicate, so b is not joined. */
  fps_push_t *p0b = fx_push_new(&sh, 0, 0, INT64_MAX, &d0b);
  assert_int_equal(fx_push_grad(p0b, "b", g, N, 1, NULL), 0);
  assert_int_equal(fx_push_grad(p0b, "a", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0b, NULL), FPS_EDUP);
  fps_push_destroy(p0b);
  fps_tensor_t *b = fps_store_find(&sh.store, "b");
  assert_false(b->round.open);
  /* Worker 1 waits in b's round; shutdown fails both. */
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p1, "b", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p1, NULL), FPS_EAGAIN);
  fps_shard_fail_waiting(&sh, FPS_EUNAVAILABLE, "shard is shutting down");
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d0.err, FPS_EUNAVAILABLE);
  assert_non_null(strstr(d0.why, "shutting down"));
  assert_int_equal(d1.calls, 1);
  assert_int_equal(d1.err, FPS_EUNAVAILABLE);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  float got[N];
  assert_int_equal(fx_params(&sh, "a", got), 0);
  assert_int_equal(fx_params(&sh, "b", got), 0);
  assert_null(sh.rounds);
  fx_shard_free(&sh);
}

static void members_must_agree_on_settings(void **unused) {
  (void)unused;
  static float init[N], g[N];
  fx_fill(init, N, 70);
  fx_fill(g, N, 71);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 2, 0);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  char why[FPS_WHY_MAX];
  fx_done_t d0, d1;
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  fps_push_tensor_t lr = {.name = "w", .has_lr = true, .lr = 0.1};
  assert_int_equal(fps_push_tensor(p0, &lr, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p0, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p1, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p1, NULL), 0);
  assert_int_equal(d0.err, FPS_ESTATE);
  assert_non_null(strstr(d0.why, "disagree about this update's lr"));
  assert_int_equal(fps_push_result(p1, why, sizeof why), FPS_ESTATE);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 0);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(round_is_bit_identical_in_every_arrival_order),
      cmocka_unit_test(round_deadline_fails_members_and_changes_nothing),
      cmocka_unit_test(duplicate_stale_and_ahead),
      cmocka_unit_test(withdrawn_member_never_counts),
      cmocka_unit_test(joins_all_rounds_or_none_and_shutdown_fails_waiting),
      cmocka_unit_test(members_must_agree_on_settings),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* A call's tensors are applied together or not at all,
 * driven on the shard core directly with the fake clock. Sync: a push
 * naming several tensors links their rounds into a set that completes only
 * when every round of it is full, all at once; a deadline, a disagreement
 * or an allocation failure anywhere in the set applies nothing and fails
 * every member; a cancelled member leaves all its rounds at once. Async
 * and ssp: a failed allocation leaves none of a call's tensors applied. Allocation
 * failures are injected at the shard's Nth allocation (common/alloc.h) and
 * swept over every N the call makes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"
#include "shard_fixture.h"

static const uint64_t DIMS[] = {9, 7}; /* factored: the step needs scratch */
#define N (9 * 7)

/* ---------------------------------------------------- allocation failures */

/* Fails the at-th allocation of the shard (common/alloc.h) from now. */
static void arm(long at) { fps_alloc_fault_arm((uint64_t)at, 0); }
/* Disarms; true if the failure happened. */
static bool disarm(void) {
  bool hit = fps_alloc_failures() > 0;
  fps_alloc_fault_disarm();
  return hit;
}

/* ------------------------------------------------------------ helpers */

static float init_a[N], init_b[N], init_c[N];

static void three_tensors(fps_shard_t *sh, int mode, uint32_t workers) {
  fx_fill(init_a, N, 1);
  fx_fill(init_b, N, 2);
  fx_fill(init_c, N, 3);
  fx_shard(sh, mode, workers, 0);
  assert_int_equal(fx_create(sh, "a", DIMS, 2, init_a), 0);
  assert_int_equal(fx_create(sh, "b", DIMS, 2, init_b), 0);
  assert_int_equal(fx_create(sh, "c", DIMS, 2, init_c), 0);
}

/* One push of worker w at step 0 naming tensors names[0..k) with the
 * gradients g[0..k), committed: returns the commit's code. */
static int push(fps_shard_t *sh, fps_push_t **p, fx_done_t *d, uint32_t w, const char *const *names,
                float (*g)[N], size_t k, char *why) {
  *p = fx_push_new(sh, w, 0, INT64_MAX, d);
  for (size_t i = 0; i < k; i++) assert_int_equal(fx_push_grad(*p, names[i], g[i], N, 1, NULL), 0);
  return fx_commit(*p, why);
}

/* What the shard must hold after one sync round of W=2: ((g0 + g1) / 2)
 * applied once to init, by an async shard with the same kernels. */
static void replay2(const float *init, const float *g0, const float *g1, float *out) {
  fps_shard_t ref;
  fx_shard(&ref, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&ref, "t", DIMS, 2, init), 0);
  float sum[N];
  for (int i = 0; i < N; i++) sum[i] = (g0[i] + g1[i]) / 2.0f;
  fx_done_t d;
  fps_push_t *p = fx_push_new(&ref, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "t", sum, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_destroy(p);
  assert_int_equal(fx_params(&ref, "t", out), 1);
  fx_shard_free(&ref);
}

/* Tensor name is at version v with exactly the parameters want. */
static void holds(fps_shard_t *sh, const char *name, uint64_t v, const float *want) {
  float got[N];
  assert_int_equal(fx_params(sh, name, got), v);
  assert_memory_equal(got, want, sizeof got);
}

static void no_round_left(fps_shard_t *sh) {
  assert_null(sh->rounds);
  assert_int_equal(fps_shard_in_flight_bytes(sh), 0);
}

/* -------------------------------------------------------------- sync */

/* Worker 0 pushes {a, b}, worker 1 only {a}: a's round is full but waits
 * for b's; at the deadline both fail and neither tensor moves. */
static void deadline_fails_the_whole_set(void **unused) {
  (void)unused;
  fps_shard_t sh;
  three_tensors(&sh, FPS_MODE_SYNC, 2);
  static float g0[2][N], g1[1][N];
  fx_fill(g0[0], N, 10);
  fx_fill(g0[1], N, 11);
  fx_fill(g1[0], N, 12);
  const char *ab[] = {"a", "b"}, *a[] = {"a"};
  fps_push_t *p0, *p1;
  fx_done_t d0, d1;
  assert_int_equal(push(&sh, &p0, &d0, 0, ab, g0, 2, NULL), FPS_EAGAIN);
  assert_int_equal(push(&sh, &p1, &d1, 1, a, g1, 1, NULL), FPS_EAGAIN);
  /* a is full, and not applied: its set waits for b. */
  holds(&sh, "a", 0, init_a);
  fps_fake_clock_advance((int64_t)(FX_DEADLINE_S * 1e9) - 1);
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d0.calls + d1.calls, 0);
  fps_fake_clock_advance(1);
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d1.calls, 1);
  assert_int_equal(d0.err, FPS_ETIMEOUT);
  assert_int_equal(d1.err, FPS_ETIMEOUT);
  /* The cause names the round missing a worker, and the rest of the set. */
  for (int i = 0; i < 2; i++) {
    const char *why = i ? d1.why : d0.why;
    assert_non_null(strstr(why, "tensor 'b' step 0: sync round timed out"));
    assert_non_null(strstr(why, "waiting for workers 1 (1 of 2 missing)"));
    assert_non_null(strstr(why, "none of the 2 rounds (tensors '"));
    assert_non_null(strstr(why, "'a'"));
    assert_non_null(strstr(why, "was applied"));
  }
  holds(&sh, "a", 0, init_a);
  holds(&sh, "b", 0, init_b);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  no_round_left(&sh);
  assert_int_equal(fx_updates(), 0);
  fx_shard_free(&sh);
}

/* Worker 1 sends {a} and {b} in two calls: the set {a, b} completes only
 * with the second, and both tensors get their update together. A chain
 * links transitively: {a, b} + {b, c} + {c} + {a}. */
static void separate_calls_complete_together(void **unused) {
  (void)unused;
  fps_shard_t sh;
  three_tensors(&sh, FPS_MODE_SYNC, 2);
  static float ga[2][N], gb[2][N], gc[2][N], want[N];
  for (int w = 0; w < 2; w++) {
    fx_fill(ga[w], N, 20 + w);
    fx_fill(gb[w], N, 30 + w);
    fx_fill(gc[w], N, 40 + w);
  }
  const char *ab[] = {"a", "b"}, *a[] = {"a"}, *b[] = {"b"};
  float g0[2][N];
  memcpy(g0[0], ga[0], sizeof g0[0]);
  memcpy(g0[1], gb[0], sizeof g0[1]);
  fps_push_t *p0, *p1a, *p1b;
  fx_done_t d0, d1a, d1b;
  assert_int_equal(push(&sh, &p0, &d0, 0, ab, g0, 2, NULL), FPS_EAGAIN);
  assert_int_equal(push(&sh, &p1a, &d1a, 1, a, &ga[1], 1, NULL), FPS_EAGAIN);
  holds(&sh, "a", 0, init_a);
  assert_int_equal(push(&sh, &p1b, &d1b, 1, b, &gb[1], 1, NULL), 0);
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d1a.calls, 1);
  assert_int_equal(d0.err, 0);
  assert_int_equal(d1a.err, 0);
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_push_result(p1b, why, sizeof why), 0);
  replay2(init_a, ga[0], ga[1], want);
  holds(&sh, "a", 1, want);
  replay2(init_b, gb[0], gb[1], want);
  holds(&sh, "b", 1, want);
  holds(&sh, "c", 0, init_c);
  /* Every member gets its tensors' fresh parameters and versions. */
  fps_push_out_t o;
  fps_push_take(p0, 1, &o);
  assert_ptr_equal(o.t, fps_store_find(&sh.store, "b"));
  assert_int_equal(o.version, 1);
  assert_memory_equal(o.snap->data, want, sizeof want);
  fps_snap_unref(o.snap);
  fps_push_destroy(p0);
  fps_push_destroy(p1a);
  fps_push_destroy(p1b);
  no_round_left(&sh);

  /* The chain, at step 1. */
  const char *c[] = {"c"};
  fps_push_t *q[4];
  fx_done_t e[4];
  float gq[2][N];
  memcpy(gq[0], ga[0], sizeof gq[0]);
  memcpy(gq[1], gb[0], sizeof gq[1]);
  fps_tensor_t *ta = fps_store_find(&sh.store, "a"), *tc = fps_store_find(&sh.store, "c");
  /* c is still at version 0: push it at step 0 in the chain (per tensor). */
  q[0] = fx_push_new(&sh, 0, 1, INT64_MAX, &e[0]);
  assert_int_equal(fx_push_grad(q[0], "a", gq[0], N, 1, NULL), 0);
  assert_int_equal(fx_push_grad(q[0], "b", gq[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(q[0], NULL), FPS_EAGAIN);
  fps_push_tensor_t c0 = {.name = "c", .has_step = true, .step = 0};
  q[1] = fx_push_new(&sh, 1, 1, INT64_MAX, &e[1]);
  assert_int_equal(fps_push_tensor(q[1], &c0, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(q[1], "b", gb[1], N, 1, NULL), 0);
  assert_int_equal(fx_push_grad(q[1], "c", gc[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(q[1], NULL), FPS_EAGAIN);
  q[2] = fx_push_new(&sh, 0, 0, INT64_MAX, &e[2]);
  assert_int_equal(fx_push_grad(q[2], c[0], gc[0], N, 1, NULL), 0);
  assert_int_equal(fx_commit(q[2], NULL), FPS_EAGAIN); /* b, c full; a is not */
  assert_int_equal(tc->version, 0);
  q[3] = fx_push_new(&sh, 1, 1, INT64_MAX, &e[3]);
  assert_int_equal(fx_push_grad(q[3], "a", ga[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(q[3], NULL), 0); /* completes a, b and c */
  for (int i = 0; i < 3; i++) {
    assert_int_equal(e[i].calls, 1);
    assert_int_equal(e[i].err, 0);
  }
  assert_int_equal(ta->version, 2);
  assert_int_equal(fps_store_find(&sh.store, "b")->version, 2);
  replay2(init_c, gc[0], gc[1], want);
  holds(&sh, "c", 1, want);
  for (int i = 0; i < 4; i++) fps_push_destroy(q[i]);
  no_round_left(&sh);
  fx_shard_free(&sh);
}

/* A cancelled member leaves all its rounds at once. Its gradient was
 * already summed with the other member's (sums are taken as slices
 * arrive), so the round it shared is aborted: the other member fails with
 * UNAVAILABLE naming it, nothing is applied, and the retries complete. */
static void cancelled_member_leaves_every_round(void **unused) {
  (void)unused;
  fps_shard_t sh;
  three_tensors(&sh, FPS_MODE_SYNC, 2);
  static float g0[2][N], bad[2][N], g1a[1][N], g1b[1][N], want[N];
  fx_fill(g0[0], N, 50);
  fx_fill(g0[1], N, 51);
  fx_fill(bad[0], N, 52);
  fx_fill(bad[1], N, 53);
  fx_fill(g1a[0], N, 54);
  fx_fill(g1b[0], N, 55);
  const char *ab[] = {"a", "b"}, *a[] = {"a"}, *b[] = {"b"};
  fps_push_t *px, *p0, *p1a, *p1b;
  fx_done_t dx, d0, d1a, d1b;
  assert_int_equal(push(&sh, &px, &dx, 0, ab, bad, 2, NULL), FPS_EAGAIN);
  assert_int_equal(push(&sh, &p1a, &d1a, 1, a, g1a, 1, NULL), FPS_EAGAIN);
  fps_push_cancel(px);
  assert_int_equal(dx.calls, 1);
  assert_int_equal(dx.err, FPS_ECANCELLED);
  assert_int_equal(d1a.calls, 1); /* a's round aborted: nothing applied */
  assert_int_equal(d1a.err, FPS_EUNAVAILABLE);
  assert_non_null(strstr(d1a.why, "worker 0's call failed"));
  fps_tensor_t *ta = fps_store_find(&sh.store, "a"), *tb = fps_store_find(&sh.store, "b");
  assert_false(ta->round.open);
  assert_false(tb->round.open);
  assert_int_equal(ta->version, 0);
  fps_push_destroy(px);
  fps_push_destroy(p1a);
  /* The retries link a and b again; worker 1's {b} completes the set. */
  assert_int_equal(push(&sh, &p1a, &d1a, 1, a, g1a, 1, NULL), FPS_EAGAIN);
  assert_int_equal(push(&sh, &p0, &d0, 0, ab, g0, 2, NULL), FPS_EAGAIN);
  assert_int_equal(d1a.calls, 0);
  assert_int_equal(push(&sh, &p1b, &d1b, 1, b, g1b, 1, NULL), 0);
  assert_int_equal(d0.err, 0);
  assert_int_equal(d1a.err, 0);
  replay2(init_a, g0[0], g1a[0], want);
  holds(&sh, "a", 1, want);
  replay2(init_b, g0[1], g1b[0], want);
  holds(&sh, "b", 1, want);
  fps_push_destroy(p0);
  fps_push_destroy(p1a);
  fps_push_destroy(p1b);
  no_round_left(&sh);
  fx_shard_free(&sh);
}

/* Members disagree in a's round only: b's round, in the same set, is not
 * applied either. */
static void disagreement_fails_the_whole_set(void **unused) {
  (void)unused;
  fps_shard_t sh;
  three_tensors(&sh, FPS_MODE_SYNC, 2);
  static float g[2][N];
  fx_fill(g[0], N, 60);
  fx_fill(g[1], N, 61);
  char why[FPS_WHY_MAX];
  fx_done_t d0, d1;
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  fps_push_tensor_t lr = {.name = "a", .has_lr = true, .lr = 0.1};
  assert_int_equal(fps_push_tensor(p0, &lr, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p0, "a", g[0], N, 1, NULL), 0);
  assert_int_equal(fx_push_grad(p0, "b", g[1], N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  const char *ba[] = {"b", "a"};
  fps_push_t *p1;
  assert_int_equal(push(&sh, &p1, &d1, 1, ba, g, 2, NULL), 0);
  assert_int_equal(d0.err, FPS_ESTATE);
  assert_non_null(strstr(d0.why, "tensor 'a' step 0: the workers disagree about this update's lr"));
  assert_non_null(strstr(d0.why, "none of the 2 rounds"));
  assert_int_equal(fps_push_result(p1, why, sizeof why), FPS_ESTATE);
  holds(&sh, "a", 0, init_a);
  holds(&sh, "b", 0, init_b);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  no_round_left(&sh);
  fx_shard_free(&sh);
}

/* Every allocation of the call that completes a set, failed in turn: the set
 * is applied whole or not at all, and the shard serves the next round. */
static void allocation_failure_completing_a_set(void **unused) {
  (void)unused;
  static float g0[2][N], g1a[1][N], g1b[1][N], want_a[N], want_b[N];
  fx_fill(g0[0], N, 70);
  fx_fill(g0[1], N, 71);
  fx_fill(g1a[0], N, 72);
  fx_fill(g1b[0], N, 73);
  fps_shard_t sh;
  three_tensors(&sh, FPS_MODE_SYNC, 2); /* fills init_a, init_b */
  fx_shard_free(&sh);
  replay2(init_a, g0[0], g1a[0], want_a);
  replay2(init_b, g0[1], g1b[0], want_b);
  const char *ab[] = {"a", "b"}, *a[] = {"a"};
  long failed = 0, at;
  for (at = 1;; at++) {
    three_tensors(&sh, FPS_MODE_SYNC, 2);
    fps_push_t *p0, *p1a, *p1b;
    fx_done_t d0, d1a, d1b;
    char why[FPS_WHY_MAX];
    assert_int_equal(push(&sh, &p0, &d0, 0, ab, g0, 2, NULL), FPS_EAGAIN);
    assert_int_equal(push(&sh, &p1a, &d1a, 1, a, g1a, 1, NULL), FPS_EAGAIN);
    p1b = fx_push_new(&sh, 1, 0, INT64_MAX, &d1b);
    assert_int_equal(fx_push_grad(p1b, "b", g1b[0], N, 1, NULL), 0);
    arm(at);
    int rc = fx_commit(p1b, why);
    bool hit = disarm();
    if (rc == 0 && fps_push_result(p1b, why, sizeof why) == 0) {
      /* Applied whole: every member OK, both tensors moved. */
      assert_int_equal(d0.err, 0);
      assert_int_equal(d1a.err, 0);
      holds(&sh, "a", 1, want_a);
      holds(&sh, "b", 1, want_b);
    } else {
      assert_true(hit);
      failed++;
      if (rc == 0) {
        /* The set failed: every member with the cause. */
        assert_int_equal(fps_push_result(p1b, why, sizeof why), FPS_ENOMEM);
        assert_int_equal(d0.err, FPS_ENOMEM);
        assert_int_equal(d1a.err, FPS_ENOMEM);
        assert_non_null(strstr(d0.why, "out of memory"));
        assert_non_null(strstr(d0.why, "none of the 2 rounds"));
      } else {
        /* Refused before joining: the others still wait. */
        assert_int_equal(rc, FPS_ENOMEM);
        assert_int_equal(d0.calls + d1a.calls, 0);
        fps_shard_fail_waiting(&sh, FPS_EUNAVAILABLE, "test over");
      }
      holds(&sh, "a", 0, init_a);
      holds(&sh, "b", 0, init_b);
      assert_int_equal(fx_updates(), 0);
    }
    fps_push_destroy(p0);
    fps_push_destroy(p1a);
    fps_push_destroy(p1b);
    no_round_left(&sh);
    fx_shard_free(&sh);
    if (!hit) break; /* past the call's last malloc */
  }
  /* join's array, two scratch buffers, two snapshot wrappers at least. */
  /* Some failures are survived whole (the apply log keeps its old size). */
  print_message("sync set completion: %ld allocations failed in turn, %ld failed the set, none left a tensor "
                "half-applied\n", at - 1, failed);
  assert_true(failed >= 5);
}

/* ------------------------------------------------------- async, ssp */

/* A push of {a, b} whose allocations fail in turn: both applied or
 * neither, and the idempotency record agrees (a retry applies only if
 * nothing was). ssp goes through its admission first, then the same
 * apply. */
static void push_applies_all_or_none(int mode) {
  static float g[2][N];
  fx_fill(g[0], N, 80);
  fx_fill(g[1], N, 81);
  long failed = 0, at;
  for (at = 1;; at++) {
    fps_shard_t sh;
    three_tensors(&sh, mode, 1);
    fx_done_t d;
    char why[FPS_WHY_MAX];
    fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
    assert_int_equal(fps_push_set_id(p, 7, why, sizeof why), 0);
    assert_int_equal(fx_push_grad(p, "a", g[0], N, 1, NULL), 0);
    assert_int_equal(fx_push_grad(p, "b", g[1], N, 1, NULL), 0);
    arm(at);
    int rc = fx_commit(p, why);
    bool hit = disarm();
    assert_int_equal(rc, 0);
    int res = fps_push_result(p, why, sizeof why);
    fps_push_destroy(p);
    float ga[N], gb[N];
    uint64_t va = fx_params(&sh, "a", ga), vb = fx_params(&sh, "b", gb);
    assert_int_equal(va, vb);
    if (res == 0) {
      assert_int_equal(va, 1);
    } else {
      assert_true(hit);
      failed++;
      assert_int_equal(res, FPS_ENOMEM);
      assert_non_null(strstr(why, "none of the call's 2 tensors was applied"));
      assert_int_equal(va, 0);
      assert_memory_equal(ga, init_a, sizeof ga);
      assert_memory_equal(gb, init_b, sizeof gb);
    }
    /* The retry: answered from the window if applied, applied if not. */
    p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
    assert_int_equal(fps_push_set_id(p, 7, why, sizeof why), 0);
    assert_int_equal(fx_push_grad(p, "a", g[0], N, 1, NULL), 0);
    assert_int_equal(fx_push_grad(p, "b", g[1], N, 1, NULL), 0);
    assert_int_equal(fx_commit(p, why), 0);
    assert_int_equal(fps_push_result(p, why, sizeof why), 0);
    assert_int_equal(fps_push_replayed(p), res == 0);
    fps_push_destroy(p);
    assert_int_equal(fx_params(&sh, "a", ga), 1);
    assert_int_equal(fx_params(&sh, "b", gb), 1);
    assert_int_equal(fx_updates(), 2);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    fx_shard_free(&sh);
    if (!hit) break;
  }
  print_message("%s push of 2 tensors: %ld allocations failed in turn, %ld failed the push, none left a "
                "tensor half-applied\n", fps_mode_name(mode), at - 1, failed);
  assert_true(failed >= 4); /* two scratch buffers, two snapshot wrappers */
}

static void async_push_applies_all_or_none(void **unused) {
  (void)unused;
  push_applies_all_or_none(FPS_MODE_ASYNC);
}

static void ssp_push_applies_all_or_none(void **unused) {
  (void)unused;
  push_applies_all_or_none(FPS_MODE_SSP);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(deadline_fails_the_whole_set),
      cmocka_unit_test(separate_calls_complete_together),
      cmocka_unit_test(cancelled_member_leaves_every_round),
      cmocka_unit_test(disagreement_fails_the_whole_set),
      cmocka_unit_test(allocation_failure_completing_a_set),
      cmocka_unit_test(async_push_applies_all_or_none),
      cmocka_unit_test(ssp_push_applies_all_or_none),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

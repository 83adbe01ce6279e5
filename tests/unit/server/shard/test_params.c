/* The tensor's parameters as an immutable refcounted buffer (shard.h,
 * fps_snap_t): replies and Pull reference the published buffer instead of
 * copying it, an update writes its result out of place into its own
 * gradient buffer, and nobody writes a buffer another holder may read.
 *
 * Checked here, on the shard core driven directly:
 *  - a reply's buffer and a Pull's keep the old values bit for bit after
 *    the next update, in async and in sync mode;
 *  - a reply is the published buffer itself (no copy);
 *  - staging accounting (sh->tbuf_bytes; in flight: without spares):
 *    a sync round's peak is the parameters plus one tensor-sized buffer
 *    (the sum), a retired buffer still read counts as staging, and the
 *    count returns to 0 once every reference is dropped;
 *  - the nth allocation of an update failing, for every n, leaves the
 *    tensor exactly as it was (params, version) and staging at 0;
 *  - a freed tensor-sized buffer is the tensor's spare, reused by its next
 *    sum or staging, counted against the staging limit and given up when
 *    a push would otherwise pass it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"
#include "shard_fixture.h"

static const uint64_t DIMS[] = {16, 8}; /* factored: the step needs scratch */
#define N 128
#define TB ((uint64_t)N * 4) /* one tensor-sized buffer, in bytes */

/* Pushes g for worker w at step; returns the commit's code. */
static int push(fps_shard_t *sh, fps_push_t **p, fx_done_t *d, uint32_t w, uint64_t step, const float *g) {
  *p = fx_push_new(sh, w, step, INT64_MAX, d);
  assert_int_equal(fx_push_grad(*p, "w", g, N, 1, NULL), 0);
  return fx_commit(*p, NULL);
}

/* The reply reference of a resolved push (the caller unrefs it). */
static fps_snap_t *reply_of(fps_push_t *p) {
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_push_result(p, why, sizeof why), 0);
  fps_push_out_t o;
  fps_push_take(p, 0, &o);
  assert_non_null(o.snap);
  return o.snap;
}

static void async_reply_and_pull_keep_old_values(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N], g1[N], g2[N], now[N];
  fx_fill(v, N, 1);
  fx_fill(g1, N, 2);
  fx_fill(g2, N, 3);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  char why[FPS_WHY_MAX];

  /* A Pull before any update: the published initial values. */
  fps_tensor_t *pt;
  fps_snap_t *pull0;
  assert_int_equal(fps_shard_snapshot(&sh, "w", &pt, &pull0, why, sizeof why), 0);
  assert_ptr_equal(pull0, t->pbuf);
  assert_int_equal(pull0->version, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0); /* a reference, no copy */

  fx_done_t d;
  fps_push_t *p;
  assert_int_equal(push(&sh, &p, &d, 0, 0, g1), 0);
  fps_snap_t *r1 = reply_of(p);
  fps_push_destroy(p);
  assert_ptr_equal(r1, t->pbuf); /* the reply is the published buffer itself */
  assert_ptr_equal(r1->data, t->param);
  assert_int_equal(r1->version, 1);
  float after1[N];
  memcpy(after1, r1->data, sizeof after1);
  assert_memory_not_equal(after1, v, sizeof v);
  /* The Pull's buffer was retired but is still read: it counts as staging. */
  assert_memory_equal(pull0->data, v, sizeof v);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), TB);

  assert_int_equal(push(&sh, &p, &d, 0, 1, g2), 0);
  fps_snap_t *r2 = reply_of(p);
  fps_push_destroy(p);
  assert_int_equal(r2->version, 2);
  assert_int_equal(fx_params(&sh, "w", now), 2);
  assert_memory_equal(r2->data, now, sizeof now);
  /* The older references still hold their versions, bit for bit. */
  assert_memory_equal(r1->data, after1, sizeof after1);
  assert_memory_equal(pull0->data, v, sizeof v);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 2 * TB);
  fps_snap_unref(pull0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), TB);
  fps_snap_unref(r1);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fps_snap_unref(r2); /* the tensor's own: not staging */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_memory_equal(t->param, now, sizeof now);

  /* The same result as an in-place replay of the two steps. */
  fps_shard_t ref;
  fx_shard(&ref, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&ref, "w", DIMS, 2, v), 0);
  fps_tensor_t *rt = fps_store_find(&ref.store, "w");
  float lp[N];
  memcpy(lp, v, sizeof lp);
  fps_adafactor_state_t st;
  assert_int_equal(fps_adafactor_state_init(&st, &rt->shape, &rt->hp), 0);
  assert_int_equal(fps_adafactor_step(NULL, &rt->hp, &st, lp, g1, NULL, NULL), 0);
  assert_int_equal(fps_adafactor_step(NULL, &rt->hp, &st, lp, g2, NULL, NULL), 0);
  assert_memory_equal(lp, now, sizeof now);
  fps_adafactor_state_destroy(&st);
  fx_shard_free(&ref);
  fx_shard_free(&sh);
}

static void sync_peak_is_params_plus_sum(void **unused) {
  (void)unused;
  enum { W = 2 };
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, W, 0);
  float v[N], g[3][W][N];
  fx_fill(v, N, 10);
  for (int s = 0; s < 3; s++)
    for (int w = 0; w < W; w++) fx_fill(g[s][w], N, (uint32_t)(20 + 2 * s + w));
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  fps_snap_t *held[3][W];
  float vals[3][N];
  for (uint64_t s = 0; s < 3; s++) {
    fps_push_t *p[W];
    fx_done_t d[W];
    /* The replies of round s-1 are still held (as slow replies would
     * be): they are the tensor's own buffer, not staging. */
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_int_equal(push(&sh, &p[0], &d[0], 0, s, g[s][0]), FPS_EAGAIN);
    /* The peak: the tensor's params (not staging) and the round's sum,
     * two tensor-sized buffers (the old code had a third: a snapshot). */
    assert_int_equal(fps_shard_in_flight_bytes(&sh), TB);
    assert_int_equal(push(&sh, &p[1], &d[1], 1, s, g[s][1]), 0);
    for (int w = 0; w < W; w++) {
      held[s][w] = reply_of(p[w]);
      fps_push_destroy(p[w]);
    }
    /* Both replies are the published buffer (the consumed sum). */
    assert_ptr_equal(held[s][0], t->pbuf);
    assert_ptr_equal(held[s][1], t->pbuf);
    assert_int_equal(held[s][0]->version, s + 1);
    memcpy(vals[s], t->param, sizeof vals[s]);
    /* The previous round's replies still read their own values; that
     * retired buffer counts as staging until they let go. */
    if (s >= 1) assert_memory_equal(held[s - 1][0]->data, vals[s - 1], sizeof vals[s - 1]);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), s >= 1 ? TB : 0);
    /* Round s-1's replies let go now (a worker pushes round s+1 only
     * after its reply of round s arrived). */
    if (s >= 1)
      for (int w = 0; w < W; w++) fps_snap_unref(held[s - 1][w]);
  }
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  for (int w = 0; w < W; w++) fps_snap_unref(held[2][w]);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_memory_equal(t->param, vals[2], sizeof vals[2]);
  assert_int_equal(t->version, 3);
  fx_shard_free(&sh);
}

/* Every allocation of one update (staging, scratch, wrappers, the apply
 * log) failing in turn: the push is refused or applied whole; refused, the
 * tensor's params and version are unchanged, a held reply still reads its
 * values, and staging returns to 0. */
static void oom_in_an_update_changes_nothing(void **unused) {
  (void)unused;
  int modes[] = {FPS_MODE_ASYNC, FPS_MODE_SYNC};
  for (int mi = 0; mi < 2; mi++) {
    int failed = 0;
    for (long at = 1;; at++) {
      fps_shard_t sh;
      fx_shard(&sh, modes[mi], 1, 0);
      float v[N], g0[N], g1[N], before[N], now[N];
      fx_fill(v, N, 30);
      fx_fill(g0, N, 31);
      fx_fill(g1, N, 32);
      assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
      fx_done_t d;
      fps_push_t *p;
      assert_int_equal(push(&sh, &p, &d, 0, 0, g0), 0);
      fps_snap_t *r = reply_of(p);
      fps_push_destroy(p);
      assert_int_equal(fx_params(&sh, "w", before), 1);
      p = fx_push_new(&sh, 0, 1, INT64_MAX, &d);
      fps_alloc_fault_arm((uint64_t)at, 0);
      int rc = fx_push_grad(p, "w", g1, N, 1, NULL);
      if (rc == 0) rc = fx_commit(p, NULL);
      bool hit = fps_alloc_failures() > 0;
      fps_alloc_fault_disarm();
      char why[FPS_WHY_MAX];
      int res = rc == 0 ? fps_push_result(p, why, sizeof why) : rc;
      if (res == 0) {
        fps_push_out_t o;
        fps_push_take(p, 0, &o);
        fps_snap_unref(o.snap);
        assert_int_equal(fx_params(&sh, "w", now), 2);
        assert_memory_not_equal(now, before, sizeof now);
      } else {
        assert_true(hit);
        failed++;
        assert_true(res == FPS_ENOMEM || res == FPS_EUNAVAILABLE);
        assert_int_equal(fx_params(&sh, "w", now), 1);
        assert_memory_equal(now, before, sizeof now);
        if (modes[mi] == FPS_MODE_SYNC) fps_shard_fail_waiting(&sh, FPS_EUNAVAILABLE, "test over");
      }
      assert_memory_equal(r->data, before, sizeof before); /* the held reply */
      fps_push_destroy(p);
      fps_snap_unref(r);
      assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
      fx_shard_free(&sh);
      if (!hit) break; /* past the update's last allocation */
    }
    assert_true(failed > 0);
  }
}

/* Pushes g to tensor name for worker 0 at step under the staging limit
 * lim; returns the push's result. */
static int push_under(fps_shard_t *sh, const char *name, uint64_t step, const float *g, uint64_t lim) {
  uint64_t was = sh->cfg.max_staging_bytes;
  sh->cfg.max_staging_bytes = lim;
  fx_done_t d;
  fps_push_t *p = fx_push_new(sh, 0, step, INT64_MAX, &d);
  int rc = fx_push_grad(p, name, g, N, 1, NULL);
  if (rc == 0) rc = fx_commit(p, NULL);
  char why[FPS_WHY_MAX];
  if (rc == 0) rc = fps_push_result(p, why, sizeof why);
  fps_push_destroy(p);
  if (rc < 0 && sh->cfg.mode == FPS_MODE_SYNC) fps_shard_fail_waiting(sh, FPS_EUNAVAILABLE, "test over");
  sh->cfg.max_staging_bytes = was;
  return rc;
}

/* A freed tensor-sized buffer becomes the tensor's one spare, which its
 * next sum (sync) or staging (async) takes instead of a fresh mapping. A
 * spare counts against --max-staging-bytes (not as in flight), and is
 * given up when a fresh buffer would otherwise pass the limit, so the
 * spares never make a push fail that would fit without them. */
static void freed_buffers_are_recycled(void **unused) {
  (void)unused;
  int modes[] = {FPS_MODE_SYNC, FPS_MODE_ASYNC};
  for (int mi = 0; mi < 2; mi++) {
    fps_shard_t sh;
    fx_shard(&sh, modes[mi], 1, 0);
    float v[N], g[N];
    fx_fill(v, N, 40);
    fx_fill(g, N, 41);
    assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
    assert_int_equal(fx_create(&sh, "u", DIMS, 2, v), 0);
    fps_tensor_t *t = fps_store_find(&sh.store, "w");
    fps_tensor_t *u = fps_store_find(&sh.store, "u");
    assert_null(t->spare);
    float *first = t->param;
    fx_done_t d;
    fps_push_t *p;
    assert_int_equal(push(&sh, &p, &d, 0, 0, g), 0);
    fps_snap_t *r = reply_of(p);
    fps_push_destroy(p);
    /* The initial buffer, retired with no reader, is the spare now: held,
     * so counted against the limit, but not in flight. */
    assert_ptr_equal(t->spare, first);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
    assert_int_equal(atomic_load(&sh.spare_bytes), TB);
    /* The next update's buffer is the spare: it becomes the parameters. */
    float *second = t->param;
    assert_int_equal(push(&sh, &p, &d, 0, 1, g), 0);
    fps_snap_t *r2 = reply_of(p);
    fps_push_destroy(p);
    assert_ptr_equal(t->param, first);
    assert_null(t->spare); /* the reply r still reads the second buffer */
    assert_int_equal(fps_shard_in_flight_bytes(&sh), TB);
    assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
    fps_snap_unref(r);
    assert_ptr_equal(t->spare, second);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
    fps_snap_unref(r2);
    /* u's staging would not fit even without w's spare: refused, and the
     * spare is not given up for nothing. */
    assert_int_equal(push_under(&sh, "u", 0, g, TB - 1), FPS_ELIMIT);
    assert_ptr_equal(t->spare, second);
    assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
    /* It fits once w's spare is given up: it is, and the push succeeds
     * (u's own old buffer is u's spare now, the only one held). */
    assert_int_equal(push_under(&sh, "u", 0, g, TB), 0);
    assert_null(t->spare);
    assert_non_null(u->spare);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
    assert_int_equal(atomic_load(&sh.spare_bytes), TB);
    fx_shard_free(&sh); /* frees the spare (ASan: no leak) */
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(async_reply_and_pull_keep_old_values),
      cmocka_unit_test(sync_peak_is_params_plus_sum),
      cmocka_unit_test(oom_in_an_update_changes_nothing),
      cmocka_unit_test(freed_buffers_are_recycled),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

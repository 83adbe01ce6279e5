/* The shard core's push path in async mode, driven directly: a push is
 * applied at its commit (no callback), through the one apply-and-snapshot
 * path; a bad push is refused whole and changes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "metrics.h"
#include "shard_fixture.h"

static const uint64_t DIMS[] = {16, 8};
#define N 128

static void async_applies_at_commit(void **unused) {
  (void)unused;
  fps_shard_t sh, ref;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  fx_shard(&ref, FPS_MODE_ASYNC, 1, 0);
  float v[N], g[N], a[N], b[N];
  fx_fill(v, N, 10);
  fx_fill(g, N, 11);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  assert_int_equal(fx_create(&ref, "w", DIMS, 2, v), 0);
  fx_done_t d;
  /* Slices in any order and size make the same update as one slice. */
  const size_t perm[] = {3, 0, 4, 2, 1};
  fps_push_t *p = fx_push_new(&sh, 7, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", g, N, 5, perm), 0);
  assert_int_equal(fx_commit(p, NULL), 0);
  assert_int_equal(d.calls, 0); /* resolved on return: no callback */
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_push_result(p, why, sizeof why), 0);
  assert_int_equal(fps_push_count(p), 1);
  fps_push_out_t o;
  fps_push_take(p, 0, &o);
  assert_int_equal(o.version, 1);
  assert_int_equal(o.dtype, FPS_DTYPE_F32);
  assert_non_null(o.snap);
  assert_int_equal(fx_params(&sh, "w", a), 1);
  assert_memory_equal(o.snap->data, a, sizeof a); /* the snapshot is the update's result */
  fps_snap_unref(o.snap);
  fps_push_destroy(p);
  fps_push_t *q = fx_push_new(&ref, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(q, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(q, NULL), 0);
  fps_push_destroy(q);
  assert_int_equal(fx_params(&ref, "w", b), 1);
  assert_memory_equal(a, b, sizeof a);
  assert_memory_not_equal(a, v, sizeof a);
  /* The apply log names the worker and step. */
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  assert_int_equal(t->log_len, 1);
  assert_int_equal(t->log[0].worker_id, 7);
  assert_int_equal(t->log[0].version, 1);
  /* Staging is all given back. */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
  fx_shard_free(&ref);
}

static void refused_pushes_change_nothing(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N], g[N], a[N];
  fx_fill(v, N, 12);
  fx_fill(g, N, 13);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  fx_done_t d;
  char why[FPS_WHY_MAX];
  /* A gap: missing slices at the commit. */
  fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  fps_slice_t half = {.dtype = FPS_DTYPE_F32, .shape = DIMS, .n_shape = 2, .offset = 0, .data = (const uint8_t *)g,
                      .len = N / 2 * 4};
  assert_int_equal(fps_push_slice(p, "w", &half, why, sizeof why), 0);
  assert_int_equal(fx_commit(p, why), FPS_EINVAL);
  assert_non_null(strstr(why, "missing slices"));
  fps_push_destroy(p);
  /* An overlap. */
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fps_push_slice(p, "w", &half, why, sizeof why), 0);
  assert_int_equal(fps_push_slice(p, "w", &half, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "overlaps"));
  fps_push_destroy(p);
  /* A non-finite or huge gradient. */
  float bad[N];
  memcpy(bad, g, sizeof bad);
  bad[9] = 1.0f / 0.0f;
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", bad, N, 1, NULL), FPS_EINVAL);
  fps_push_destroy(p);
  bad[9] = 1e20f;
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", bad, N, 1, NULL), FPS_EINVAL);
  fps_push_destroy(p);
  /* Unknown tensor, wrong shape. */
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "nope", g, N, 1, NULL), FPS_ENOTFOUND);
  const uint64_t wrong[] = {8, 16};
  fps_slice_t ws = {.dtype = FPS_DTYPE_F32, .shape = wrong, .n_shape = 2, .data = (const uint8_t *)g, .len = N * 4};
  assert_int_equal(fps_push_slice(p, "w", &ws, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "wrong shape"));
  /* worker_id/step may not change within a push. */
  assert_int_equal(fps_push_header(p, 0, 1, false, 0, 0, why, sizeof why), FPS_EINVAL);
  fps_push_destroy(p);
  assert_int_equal(fx_params(&sh, "w", a), 0);
  assert_memory_equal(a, v, sizeof a);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void no_grad_and_skip_params(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N], g[N];
  fx_fill(v, N, 14);
  fx_fill(g, N, 15);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  char why[FPS_WHY_MAX];
  fx_done_t d;
  /* no_grad: nothing applied, the current params come back. */
  fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  fps_push_tensor_t tp = {.name = "w", .no_grad = true};
  assert_int_equal(fps_push_tensor(p, &tp, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), FPS_EINVAL); /* no slices for a no_grad tensor */
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_out_t o;
  fps_push_take(p, 0, &o);
  assert_int_equal(o.version, 0);
  assert_memory_equal(o.snap->data, v, sizeof v);
  fps_snap_unref(o.snap);
  fps_push_destroy(p);
  /* skip_params: applied, no snapshot. */
  fps_push_create(&sh, INT64_MAX, NULL, NULL, &p);
  assert_int_equal(fps_push_header(p, 0, 0, true, 0, 0, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_take(p, 0, &o);
  assert_int_equal(o.version, 1);
  assert_null(o.snap);
  fps_push_destroy(p);
  /* A per-push lr is applied and logged; an invalid one is refused. */
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  fps_push_tensor_t lr = {.name = "w", .has_lr = true, .lr = 0.5};
  assert_int_equal(fps_push_tensor(p, &lr, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_destroy(p);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  assert_true(t->log[t->log_len - 1].lr == 0.5);
  p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  lr.lr = -1;
  assert_int_equal(fps_push_tensor(p, &lr, why, sizeof why), FPS_EHPARAM);
  fps_push_destroy(p);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void view_shows_totals_log_and_counters(void **unused) {
  (void)unused;
  /* The counters are the process's metrics registry: start it afresh, as
   * a shard process does. */
  fps_metrics_config_t mc = {.shard_id = 0};
  assert_int_equal(fps_metrics_init(&mc), 0);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N], g[N];
  fx_fill(v, N, 16);
  fx_fill(g, N, 17);
  const uint64_t small[] = {5};
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, v), 0);
  assert_int_equal(fx_create(&sh, "b", small, 1, v), 0);
  fx_done_t d;
  for (uint64_t s = 0; s < 3; s++) {
    fps_push_t *p = fx_push_new(&sh, (uint32_t)s + 4, s, INT64_MAX, &d);
    assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
    assert_int_equal(fx_commit(p, NULL), 0);
    fps_push_destroy(p);
  }
  fps_shard_view_t view;
  assert_int_equal(fps_shard_view(&sh, false, 8, &view), 0);
  assert_int_equal(view.tensors, 2);
  assert_int_equal(view.param_elements, N + 5);
  assert_null(view.t);
  assert_int_equal(view.updates, 3);
  fps_shard_view_free(&view);
  /* With tensors: creation order, the newest two records oldest first. */
  assert_int_equal(fps_shard_view(&sh, true, 2, &view), 0);
  assert_int_equal(view.n, 2);
  assert_string_equal(view.t[0].name, "w");
  assert_int_equal(view.t[0].version, 3);
  assert_true(view.t[0].ready);
  assert_int_equal(view.t[0].nlog, 2);
  assert_int_equal(view.t[0].log[0].worker_id, 5);
  assert_int_equal(view.t[0].log[0].version, 2);
  assert_int_equal(view.t[0].log[1].worker_id, 6);
  assert_int_equal(view.t[1].nlog, 0);
  fps_shard_view_free(&view);
  /* The limit is the shard's apply_log at most (8 here). */
  assert_int_equal(fps_shard_view(&sh, true, 100, &view), 0);
  assert_int_equal(view.t[0].nlog, 3);
  fps_shard_view_free(&view);
  fx_shard_free(&sh);
}

/* Data in pieces (fps_slice_t.src, as the PushPull handler hands over a
 * message's buffers): the same update as one piece; a bad element in a
 * later piece is named by its index in the tensor; pieces that end early
 * are refused. */
typedef struct pieces_s {
  const uint8_t *p;
  uint64_t left, esz, step;  /* elements left; bytes per element; next size */
} pieces_t;

static uint64_t next_piece(void *ctx, const uint8_t **data) {
  pieces_t *pc = ctx;
  uint64_t k = pc->step < pc->left ? pc->step : pc->left;
  pc->step = pc->step % 5 + 1; /* 1, 2, .. 5 elements */
  *data = pc->p;
  pc->p += k * pc->esz;
  pc->left -= k;
  return k;
}

static void slice_in_pieces(void **unused) {
  (void)unused;
  fps_shard_t a, b;
  fx_shard(&a, FPS_MODE_ASYNC, 1, 0);
  fx_shard(&b, FPS_MODE_ASYNC, 1, 0);
  float v[N], g[N], pa[N], pb[N];
  fx_fill(v, N, 21);
  fx_fill(g, N, 22);
  assert_int_equal(fx_create(&a, "w", DIMS, 2, v), 0);
  assert_int_equal(fx_create(&b, "w", DIMS, 2, v), 0);
  fx_done_t d;
  char why[FPS_WHY_MAX];
  fps_push_t *p = fx_push_new(&a, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p, why), 0);
  fps_push_destroy(p);
  pieces_t pc = {(const uint8_t *)g, N, 4, 1};
  fps_slice_src_t src = {next_piece, &pc, NULL};
  fps_slice_t sl = {.dtype = FPS_DTYPE_F32, .shape = DIMS, .n_shape = 2, .len = N * 4, .src = &src};
  p = fx_push_new(&b, 0, 0, INT64_MAX, &d);
  assert_int_equal(fps_push_slice(p, "w", &sl, why, sizeof why), 0);
  assert_int_equal(fx_commit(p, why), 0);
  fps_push_destroy(p);
  assert_int_equal(fx_params(&a, "w", pa), 1);
  assert_int_equal(fx_params(&b, "w", pb), 1);
  assert_memory_equal(pa, pb, sizeof pa);
  /* bf16, a NaN in the middle: the tensor's element index is named. */
  uint16_t h[N];
  for (int i = 0; i < N; i++) h[i] = fps_f32_to_bf16(g[i]);
  h[77] = 0x7fc0;
  pc = (pieces_t){(const uint8_t *)h, N, 2, 1};
  sl.dtype = FPS_DTYPE_BF16;
  sl.len = N * 2;
  p = fx_push_new(&b, 0, 1, INT64_MAX, &d);
  assert_int_equal(fps_push_slice(p, "w", &sl, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "element 77 is NaN"));
  fps_push_destroy(p);
  /* Pieces that stop short of the length. */
  pc = (pieces_t){(const uint8_t *)g, N / 2, 4, 1};
  sl.dtype = FPS_DTYPE_F32;
  sl.len = N * 4;
  p = fx_push_new(&b, 0, 1, INT64_MAX, &d);
  assert_int_equal(fps_push_slice(p, "w", &sl, why, sizeof why), FPS_EPROTO);
  fps_push_destroy(p);
  assert_int_equal(fx_params(&b, "w", pb), 1);
  assert_memory_equal(pa, pb, sizeof pa);
  assert_int_equal(fps_shard_in_flight_bytes(&b), 0);
  fx_shard_free(&a);
  fx_shard_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(view_shows_totals_log_and_counters),
      cmocka_unit_test(async_applies_at_commit),
      cmocka_unit_test(refused_pushes_change_nothing),
      cmocka_unit_test(no_grad_and_skip_params),
      cmocka_unit_test(slice_in_pieces),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The shard core's resume and replace rules, driven directly (no
 * gRPC): Create at a step with the optimizer state, readiness only once
 * params and state are covered, state snapshots (GetState) at one version,
 * replace (all in one call, refused while a sync round is open, swapped at
 * once), and every refusal changes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "shard_fixture.h"

static const uint64_t DIMS[] = {4, 3};
#define N 12

static fps_slice_t slice(const float *v, uint64_t off, uint64_t n) {
  return (fps_slice_t){.dtype = FPS_DTYPE_F32, .offset = off, .data = (const uint8_t *)(v + off), .len = n * 4};
}

static fps_state_slice_t sslice(int kind, const float *v, uint64_t off, uint64_t n) {
  return (fps_state_slice_t){.kind = kind, .offset = off, .data = (const uint8_t *)(v + off), .len = n * 4};
}

/* One item naming "w" [4, 3] torch, with the given resume fields. */
static int create_w(fps_shard_t *sh, const fps_slice_t *init, uint64_t step, const fps_state_slice_t *st, size_t nst,
                    bool replace, fps_create_info_t *info, char *why) {
  fps_create_item_t it = {.name = "w", .dims = DIMS, .ndim = 2, .init = init, .step = step, .state = st,
                          .n_state = nst, .replace = replace};
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
  uint64_t rx;
  return fps_shard_create(sh, 0, 1, &it, 1, info, &rx, why, FPS_WHY_MAX);
}

static void resume_at_a_step(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float p[N], row[4] = {1, 2, 3, 4}, col[3] = {0.5f, 0.25f, 2};
  fx_fill(p, N, 3);
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t s = slice(p, 0, N);
  /* Params and row state first: not ready (col is missing). */
  fps_state_slice_t r = sslice(FPS_STATE_ROW, row, 0, 4);
  assert_int_equal(create_w(&sh, &s, 7, &r, 1, false, &info, why), 0);
  assert_true(info.created);
  assert_false(info.ready);
  assert_int_equal(info.version, 7);
  fps_state_snap_t snap;
  assert_int_equal(fps_shard_state_snap(&sh, "w", &snap, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "still initialising"));
  fps_state_snap_release(&sh, &snap);
  /* Another step for the same tensor: refused. */
  fps_state_slice_t c = sslice(FPS_STATE_COL, col, 0, 3);
  assert_int_equal(create_w(&sh, NULL, 8, &c, 1, false, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "being created at step 7, not 8"));
  /* The col state completes it. */
  assert_int_equal(create_w(&sh, NULL, 7, &c, 1, false, &info, why), 0);
  assert_true(info.ready);
  assert_int_equal(fps_shard_state_snap(&sh, "w", &snap, why, sizeof why), 0);
  assert_int_equal(snap.version, 7);
  assert_int_equal(snap.step, 7);
  assert_int_equal(snap.n[FPS_STATE_ROW], 4);
  assert_int_equal(snap.n[FPS_STATE_COL], 3);
  assert_int_equal(snap.n[FPS_STATE_VAR], 0);
  assert_memory_equal(fps_state_snap_array(&snap, FPS_STATE_ROW), row, sizeof row);
  assert_memory_equal(fps_state_snap_array(&snap, FPS_STATE_COL), col, sizeof col);
  fps_state_snap_release(&sh, &snap);
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 7);
  assert_memory_equal(got, p, sizeof p);
  /* A push goes on from step 7 (async: any step; the version is 8). */
  fx_done_t d = {0};
  fps_push_t *ps = fx_push_new(&sh, 0, 7, INT64_MAX, &d);
  float g[N];
  fx_fill(g, N, 4);
  assert_int_equal(fx_push_grad(ps, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(ps, why), 0);
  fps_push_destroy(ps);
  assert_int_equal(fx_params(&sh, "w", got), 8);
  assert_int_equal(fps_shard_state_snap(&sh, "w", &snap, why, sizeof why), 0);
  assert_int_equal(snap.step, 8);
  fps_state_snap_release(&sh, &snap);
  fx_shard_free(&sh);
}

static void bad_state_changes_nothing(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float p[N], ok[4] = {1, 1, 1, 1}, neg[4] = {1, -1, 1, 1};
  fx_fill(p, N, 5);
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t s = slice(p, 0, N);
  struct {
    fps_state_slice_t st[2];
    size_t n;
    uint64_t step;
    const char *word;
  } cases[] = {
      {{sslice(FPS_STATE_ROW, ok, 0, 4)}, 1, 0, "needs a step > 0"},
      {{sslice(FPS_STATE_VAR, ok, 0, 4)}, 1, 1, "has no var state"},
      {{sslice(FPS_STATE_MOM, ok, 0, 4)}, 1, 1, "has no mom state"},
      {{sslice(-1, ok, 0, 4)}, 1, 1, "no valid kind"},
      {{sslice(FPS_STATE_ROW, ok, 2, 3)}, 1, 1, "out of range"},
      {{sslice(FPS_STATE_ROW, neg, 0, 4)}, 1, 1, "never negative"},
      {{sslice(FPS_STATE_ROW, ok, 0, 3), sslice(FPS_STATE_ROW, ok, 2, 2)}, 2, 1, "overlaps"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    why[0] = 0;
    assert_int_equal(create_w(&sh, &s, cases[i].step, cases[i].st, cases[i].n, false, &info, why), FPS_EINVAL);
    if (!strstr(why, cases[i].word)) fail_msg("case %zu: '%s' not in: %s", i, cases[i].word, why);
    assert_int_equal(sh.store.count, 0);
  }
  fx_shard_free(&sh);
}

static void replace_swaps_everything_at_once(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, 2, 0);
  float p[N], q[N], row[4] = {4, 3, 2, 1}, col[3] = {1, 2, 3};
  fx_fill(p, N, 6);
  fx_fill(q, N, 7);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, p), 0);
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  /* A replace must cover everything in one call. */
  fps_slice_t half = slice(q, 0, 6), all = slice(q, 0, N);
  assert_int_equal(create_w(&sh, &half, 0, NULL, 0, true, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "must carry all 12 values"));
  fps_state_slice_t r = sslice(FPS_STATE_ROW, row, 0, 4), c = sslice(FPS_STATE_COL, col, 0, 3);
  assert_int_equal(create_w(&sh, &all, 5, &r, 1, true, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "col: 0 of 3"));
  /* While worker 0 waits in a sync round: refused, nothing changes. */
  fx_done_t d0 = {0}, d1 = {0};
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  float g[N];
  fx_fill(g, N, 8);
  assert_int_equal(fx_push_grad(p0, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p0, why), FPS_EAGAIN);
  fps_state_slice_t rc2[2] = {r, c};
  assert_int_equal(create_w(&sh, &all, 5, rc2, 2, true, &info, why), FPS_ESTATE);
  assert_non_null(strstr(why, "sync round is open"));
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, p, sizeof p);
  /* Worker 1 completes the round; then the replace goes through. */
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d1);
  assert_int_equal(fx_push_grad(p1, "w", g, N, 1, NULL), 0);
  assert_int_equal(fx_commit(p1, why), 0);
  assert_int_equal(d0.calls, 1);
  assert_int_equal(d0.err, 0);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_int_equal(create_w(&sh, &all, 5, rc2, 2, true, &info, why), 0);
  assert_false(info.created);
  assert_true(info.ready);
  assert_int_equal(info.version, 5);
  assert_int_equal(fx_params(&sh, "w", got), 5);
  assert_memory_equal(got, q, sizeof q);
  fps_state_snap_t snap;
  assert_int_equal(fps_shard_state_snap(&sh, "w", &snap, why, sizeof why), 0);
  assert_int_equal(snap.step, 5);
  assert_memory_equal(fps_state_snap_array(&snap, FPS_STATE_ROW), row, sizeof row);
  assert_memory_equal(fps_state_snap_array(&snap, FPS_STATE_COL), col, sizeof col);
  fps_state_snap_release(&sh, &snap);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  assert_int_equal(t->log_len, 0); /* a new history */
  /* Sync pushes now go at step 5. */
  fps_push_t *p2 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  assert_int_equal(fx_push_grad(p2, "w", g, N, 1, NULL), FPS_ESTALE);
  fps_push_destroy(p2);
  fx_shard_free(&sh);
}

/* A replace stages the new values in a buffer of its own until it swaps
 * them in: that buffer counts against --max-staging-bytes (refused over it,
 * nothing changed), and the replaced buffer, retired, counts while a Pull
 * still reads it and then as the tensor's spare, which the next replace
 * takes: the count never passes the limit. */
static void replace_stages_within_the_limit(void **unused) {
  (void)unused;
  const uint64_t TB = N * 4;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float p[N], q[N], row[4] = {4, 3, 2, 1}, col[3] = {1, 2, 3};
  fx_fill(p, N, 9);
  fx_fill(q, N, 10);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, p), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t all = slice(q, 0, N);
  fps_state_slice_t rc2[2] = {sslice(FPS_STATE_ROW, row, 0, 4), sslice(FPS_STATE_COL, col, 0, 3)};
  sh.cfg.max_staging_bytes = TB - 1;
  assert_int_equal(create_w(&sh, &all, 5, rc2, 2, true, &info, why), FPS_ELIMIT);
  assert_non_null(strstr(why, "tensor 'w': staging its 12-element replacement would pass"));
  assert_non_null(strstr(why, "--max-staging-bytes"));
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, p, sizeof p);
  assert_int_equal(atomic_load(&sh.tbuf_bytes), 0);
  /* At the limit, with a Pull reading the old values: through. */
  sh.cfg.max_staging_bytes = TB;
  fps_tensor_t *pt;
  fps_snap_t *pull;
  assert_int_equal(fps_shard_snapshot(&sh, "w", &pt, &pull, why, sizeof why), 0);
  float *old = pull->data;
  assert_int_equal(create_w(&sh, &all, 5, rc2, 2, true, &info, why), 0);
  assert_int_equal(fx_params(&sh, "w", got), 5);
  assert_memory_equal(got, q, sizeof q);
  assert_memory_equal(pull->data, p, sizeof p);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), TB); /* the Pull's buffer */
  assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
  fps_snap_unref(pull);
  assert_ptr_equal(t->spare, old); /* counted, not in flight */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
  /* The next replace stages in the spare: no more than the limit. */
  fx_fill(q, N, 11);
  assert_int_equal(create_w(&sh, &all, 6, rc2, 2, true, &info, why), 0);
  assert_ptr_equal(t->param, old);
  assert_int_equal(fx_params(&sh, "w", got), 6);
  assert_memory_equal(got, q, sizeof q);
  assert_int_equal(atomic_load(&sh.tbuf_bytes), TB);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(resume_at_a_step),
      cmocka_unit_test(bad_state_changes_nothing),
      cmocka_unit_test(replace_swaps_everything_at_once),
      cmocka_unit_test(replace_stages_within_the_limit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

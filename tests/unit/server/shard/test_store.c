/* The shard core's store rules, driven directly (no gRPC): create-or-match,
 * init coverage over several calls, limits, placement, bad init slices, and
 * Pull snapshots. A failed Create changes nothing. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "shard_fixture.h"

/* ---- concurrent Creates of one tensor (Create validates and copies
 * without the store lock, then checks nothing changed meanwhile). */
#define CC_THREADS 4
#define CC_ROUNDS 48
#define CC_N (1 << 18)

typedef struct cc_arg_s {
  fps_shard_t *sh;
  pthread_barrier_t *bar;
  int id;
  float v[CC_N];
  int rc[CC_ROUNDS];
} cc_arg_t;

/* Thread 0 and 1 send [0, N/2) (their own values), thread 2 [N/2, N),
 * thread 3 no values; all name tensor c<round> at once. */
static void *cc_main(void *arg) {
  cc_arg_t *a = arg;
  for (int r = 0; r < CC_ROUNDS; r++) {
    char name[16];
    snprintf(name, sizeof name, "c%d", r);
    const uint64_t dims[1] = {CC_N};
    fps_create_item_t it = {.name = name, .dims = dims, .ndim = 1};
    fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
    uint64_t off = a->id == 2 ? CC_N / 2 : 0;
    fps_slice_t s = {.dtype = FPS_DTYPE_F32, .offset = off, .data = (const uint8_t *)(a->v + off),
                     .len = CC_N / 2 * 4};
    if (a->id < 3) it.init = &s;
    fps_create_info_t info;
    uint64_t rx;
    char why[FPS_WHY_MAX];
    pthread_barrier_wait(a->bar);
    a->rc[r] = fps_shard_create(a->sh, 0, 1, &it, 1, &info, &rx, why, sizeof why);
  }
  return NULL;
}

static void concurrent_creates_are_all_or_nothing(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, CC_THREADS);
  static cc_arg_t a[CC_THREADS];
  pthread_t th[CC_THREADS];
  for (int i = 0; i < CC_THREADS; i++) {
    a[i].sh = &sh;
    a[i].bar = &bar;
    a[i].id = i;
    fx_fill(a[i].v, CC_N, 100 + (uint32_t)i);
    assert_int_equal(pthread_create(&th[i], NULL, cc_main, &a[i]), 0);
  }
  for (int i = 0; i < CC_THREADS; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&bar);
  /* One tensor per round, whatever the interleaving. */
  assert_int_equal(sh.store.count, CC_ROUNDS);
  for (int r = 0; r < CC_ROUNDS; r++) {
    char name[16];
    snprintf(name, sizeof name, "c%d", r);
    /* Thread 2 and 3 never conflict; of 0 and 1 one wins, the other
     * overlaps (EINVAL) unless it came after the tensor was ready (its
     * values then ignored: OK). */
    assert_int_equal(a[2].rc[r], 0);
    assert_int_equal(a[3].rc[r], 0);
    assert_true(a[0].rc[r] == 0 || a[0].rc[r] == FPS_EINVAL);
    assert_true(a[1].rc[r] == 0 || a[1].rc[r] == FPS_EINVAL);
    assert_true(a[0].rc[r] == 0 || a[1].rc[r] == 0);
    float got[CC_N];
    fx_params(&sh, name, got);
    /* The first half is one writer's, whole; the second thread 2's. */
    bool from0 = !memcmp(got, a[0].v, CC_N / 2 * 4), from1 = !memcmp(got, a[1].v, CC_N / 2 * 4);
    if (!from0 && !from1) fail_msg("tensor %s: the first half mixes two Creates' values", name);
    if ((from0 && a[0].rc[r] != 0) || (from1 && a[1].rc[r] != 0))
      fail_msg("tensor %s holds the values of a Create that failed", name);
    assert_memory_equal(got + CC_N / 2, a[2].v + CC_N / 2, CC_N / 2 * 4);
    fps_tensor_t *t = fps_store_find(&sh.store, name);
    assert_non_null(t);
    assert_true(t->ready);
  }
  fx_shard_free(&sh);
}

static const uint64_t DIMS[] = {4, 3};
#define N 12

static int create1(fps_shard_t *sh, const char *name, const uint64_t *dims, size_t ndim, const fps_slice_t *init,
                   const fps_adafactor_hparams_t *hp, fps_create_info_t *info, char *why) {
  fps_create_item_t it = {.name = name, .dims = dims, .ndim = ndim, .init = init};
  if (hp) it.hp = *hp;
  else fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
  uint64_t rx;
  return fps_shard_create(sh, 0, 1, &it, 1, info, &rx, why, FPS_WHY_MAX);
}

static fps_slice_t slice(const float *v, uint64_t off, uint64_t n) {
  return (fps_slice_t){.dtype = FPS_DTYPE_F32, .offset = off, .data = (const uint8_t *)(v + off), .len = n * 4};
}

static void create_or_match(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N];
  fx_fill(v, N, 1);
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t s = slice(v, 0, N);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &s, NULL, &info, why), 0);
  assert_true(info.created);
  assert_true(info.ready);
  /* The same Create again matches: nothing new, still ready, same values. */
  assert_int_equal(create1(&sh, "w", DIMS, 2, NULL, NULL, &info, why), 0);
  assert_false(info.created);
  assert_true(info.ready);
  assert_int_equal(sh.store.count, 1);
  /* Another shape, or another fixed setting: EEXISTS naming the tensor. */
  const uint64_t other[] = {3, 4};
  assert_int_equal(create1(&sh, "w", other, 2, NULL, NULL, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "'w'"));
  assert_non_null(strstr(why, "[4, 3]"));
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  hp.eps2 *= 2;
  assert_int_equal(create1(&sh, "w", DIMS, 2, NULL, &hp, &info, why), FPS_EEXISTS);
  /* lr differs per push: a Create differing only in lr matches. */
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  hp.lr *= 3;
  assert_int_equal(create1(&sh, "w", DIMS, 2, NULL, &hp, &info, why), 0);
  assert_int_equal(sh.store.count, 1);
  /* Two items naming one tensor in one call must agree. */
  fps_create_item_t two[2] = {{.name = "x", .dims = DIMS, .ndim = 2}, {.name = "x", .dims = other, .ndim = 2}};
  fps_adafactor_defaults(&two[0].hp, FPS_FLAVOR_TORCH);
  two[1].hp = two[0].hp;
  fps_create_info_t infos[2];
  uint64_t rx;
  assert_int_equal(fps_shard_create(&sh, 0, 1, two, 2, infos, &rx, why, sizeof why), FPS_EEXISTS);
  assert_null(fps_store_find(&sh.store, "x"));
  fx_shard_free(&sh);
}

static void init_coverage_over_calls(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N], w[N];
  fx_fill(v, N, 2);
  fx_fill(w, N, 3);
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t a = slice(v, 0, 5);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &a, NULL, &info, why), 0);
  assert_false(info.ready);
  assert_int_equal(info.initialised, 5);
  /* Not ready: no push, no Pull. */
  fx_done_t d;
  fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "w", v, N, 1, NULL), FPS_ESTATE);
  fps_push_destroy(p);
  fps_tensor_t *t;
  fps_snap_t *snap;
  assert_int_equal(fps_shard_snapshot(&sh, "w", &t, &snap, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "5 of 12"));
  /* An overlap with what is initialised changes nothing. */
  fps_slice_t o = slice(v, 4, 3);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &o, NULL, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "overlaps"));
  /* The rest, then ready. */
  fps_slice_t b = slice(v, 5, N - 5);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &b, NULL, &info, why), 0);
  assert_true(info.ready);
  assert_int_equal(info.initialised, N);
  /* Once ready, the first values win: later init data is ignored. */
  fps_slice_t c = slice(w, 0, N);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &c, NULL, &info, why), 0);
  float got[N];
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, v, sizeof v);
  assert_int_equal(fps_shard_snapshot(&sh, "w", &t, &snap, why, sizeof why), 0);
  assert_memory_equal(snap->data, v, sizeof v);
  assert_int_equal(snap->version, 0);
  fps_snap_unref(snap);
  fx_shard_free(&sh);
}

static void bad_init_and_names_change_nothing(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  float v[N];
  fx_fill(v, N, 4);
  v[7] = 0.0f / 0.0f;
  fps_create_info_t info;
  char why[FPS_WHY_MAX];
  fps_slice_t s = slice(v, 0, N);
  assert_int_equal(create1(&sh, "w", DIMS, 2, &s, NULL, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "element 7"));
  fps_slice_t out = {.dtype = FPS_DTYPE_F32, .offset = 10, .data = (const uint8_t *)v, .len = 3 * 4};
  assert_int_equal(create1(&sh, "w", DIMS, 2, &out, NULL, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "out of range"));
  fps_slice_t dt = {.dtype = 9, .offset = 0, .data = (const uint8_t *)v, .len = 4};
  assert_int_equal(create1(&sh, "w", DIMS, 2, &dt, NULL, &info, why), FPS_EINVAL);
  assert_int_equal(create1(&sh, "", DIMS, 2, NULL, NULL, &info, why), FPS_EINVAL);
  assert_int_equal(create1(&sh, "bad\x01name", DIMS, 2, NULL, NULL, &info, why), FPS_EINVAL);
  const uint64_t zero[] = {0};
  assert_int_equal(create1(&sh, "z", zero, 1, NULL, NULL, &info, why), FPS_EINVAL);
  assert_int_equal(sh.store.count, 0);
  assert_int_equal(sh.store.param_bytes, 0);
  fx_shard_free(&sh);
}

static void limits_and_placement(void **unused) {
  (void)unused;
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  sh.cfg.max_tensors = 2;
  sh.cfg.max_bytes = 3 * N * 4;
  fps_create_info_t info[3];
  char why[FPS_WHY_MAX];
  uint64_t rx;
  /* Placement: the client's shard id/count must be this shard's. */
  fps_create_item_t it = {.name = "w", .dims = DIMS, .ndim = 2};
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
  assert_int_equal(fps_shard_create(&sh, 1, 2, &it, 1, info, &rx, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "shard 1 of 2"));
  /* max_tensors: three new in one call is refused whole. */
  fps_create_item_t three[3] = {it, it, it};
  three[1].name = "b";
  three[2].name = "c";
  assert_int_equal(fps_shard_create(&sh, 0, 1, three, 3, info, &rx, why, sizeof why), FPS_ELIMIT);
  assert_non_null(strstr(why, "--max-tensors"));
  assert_int_equal(sh.store.count, 0);
  assert_int_equal(fps_shard_create(&sh, 0, 1, three, 2, info, &rx, why, sizeof why), 0);
  /* max_bytes: a third tensor would pass 3 x 48 bytes. */
  sh.cfg.max_tensors = 10;
  const uint64_t big[] = {2 * N};
  fps_create_item_t b = {.name = "big", .dims = big, .ndim = 1, .hp = it.hp};
  assert_int_equal(fps_shard_create(&sh, 0, 1, &b, 1, info, &rx, why, sizeof why), FPS_ELIMIT);
  assert_non_null(strstr(why, "--max-bytes"));
  assert_int_equal(sh.store.count, 2);
  /* max_staging_bytes: a push's gradient staging; a Pull references the
   * published parameters and needs no staging at all. */
  float v[N];
  fx_fill(v, N, 5);
  fps_slice_t s = slice(v, 0, N);
  fps_create_item_t r = {.name = "r", .dims = DIMS, .ndim = 2, .hp = it.hp, .init = &s};
  assert_int_equal(fps_shard_create(&sh, 0, 1, &r, 1, info, &rx, why, sizeof why), 0);
  sh.cfg.max_staging_bytes = N * 4 - 1;
  fx_done_t d;
  fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
  assert_int_equal(fx_push_grad(p, "r", v, N, 1, NULL), FPS_ELIMIT);
  fps_push_destroy(p);
  fps_tensor_t *t;
  fps_snap_t *snap;
  assert_int_equal(fps_shard_snapshot(&sh, "r", &t, &snap, why, sizeof why), 0);
  assert_ptr_equal(snap, t->pbuf);
  assert_memory_equal(snap->data, v, sizeof v);
  fps_snap_unref(snap);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_int_equal(fps_shard_snapshot(&sh, "nope", &t, &snap, why, sizeof why), FPS_ENOTFOUND);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(create_or_match),
      cmocka_unit_test(concurrent_creates_are_all_or_nothing),
      cmocka_unit_test(init_coverage_over_calls),
      cmocka_unit_test(bad_init_and_names_change_nothing),
      cmocka_unit_test(limits_and_placement),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

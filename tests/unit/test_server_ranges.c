/* Unit tests for server/shard/ranges.c: the interval sets that check slice
 * coverage (no overlap, no gap) for Create's init slices and PushPull's
 * gradient slices. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "shard/shard.h"

static void test_in_order_merges(void **state) {
  (void)state;
  fps_ranges_t r = {0};
  for (uint64_t i = 0; i < 100; i++) assert_int_equal(fps_ranges_add(&r, i * 10, i * 10 + 10), 0);
  assert_int_equal(r.n, 1);
  assert_int_equal(r.covered, 1000);
  assert_int_equal(fps_ranges_first_gap(&r, 1000), 1000);
  assert_int_equal(fps_ranges_first_gap(&r, 1001), 1000);
  fps_ranges_free(&r);
}

static void test_out_of_order_and_gaps(void **state) {
  (void)state;
  fps_ranges_t r = {0};
  assert_int_equal(fps_ranges_first_gap(&r, 10), 0);
  assert_int_equal(fps_ranges_add(&r, 50, 60), 0);
  assert_int_equal(fps_ranges_add(&r, 10, 20), 0);
  assert_int_equal(fps_ranges_add(&r, 30, 40), 0);
  assert_int_equal(r.n, 3);
  assert_int_equal(fps_ranges_first_gap(&r, 100), 0);
  assert_int_equal(fps_ranges_add(&r, 0, 10), 0);
  assert_int_equal(fps_ranges_first_gap(&r, 100), 20);
  /* Fills the gap between two intervals: both merge into one. */
  assert_int_equal(fps_ranges_add(&r, 20, 30), 0);
  assert_int_equal(fps_ranges_add(&r, 40, 50), 0);
  assert_int_equal(r.n, 1);
  assert_int_equal(r.covered, 60);
  assert_int_equal(fps_ranges_first_gap(&r, 60), 60);
  /* Empty intervals are no-ops. */
  assert_int_equal(fps_ranges_add(&r, 70, 70), 0);
  assert_int_equal(fps_ranges_add(&r, 80, 75), 0);
  assert_int_equal(r.covered, 60);
  fps_ranges_free(&r);
  fps_ranges_free(&r); /* idempotent */
}

static void test_overlap_rejected_unchanged(void **state) {
  (void)state;
  fps_ranges_t r = {0};
  assert_int_equal(fps_ranges_add(&r, 10, 20), 0);
  assert_int_equal(fps_ranges_add(&r, 30, 40), 0);
  const uint64_t bad[][2] = {{15, 16}, {5, 11}, {19, 31}, {0, 100}, {39, 45}, {10, 20}, {29, 31}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    assert_int_equal(fps_ranges_add(&r, bad[i][0], bad[i][1]), FPS_EEXISTS);
  assert_int_equal(r.n, 2);
  assert_int_equal(r.covered, 20);
  /* Touching is not overlapping. */
  assert_int_equal(fps_ranges_add(&r, 20, 30), 0);
  assert_int_equal(r.n, 1);
  /* Near the top of the range: no overflow. */
  assert_int_equal(fps_ranges_add(&r, UINT64_MAX - 5, UINT64_MAX), 0);
  assert_int_equal(fps_ranges_add(&r, UINT64_MAX - 6, UINT64_MAX - 4), FPS_EEXISTS);
  fps_ranges_free(&r);
}

static void test_copy(void **state) {
  (void)state;
  fps_ranges_t a = {0}, b;
  assert_int_equal(fps_ranges_copy(&b, &a), 0);
  assert_int_equal(b.n, 0);
  for (uint64_t i = 0; i < 20; i++) assert_int_equal(fps_ranges_add(&a, i * 3, i * 3 + 1), 0);
  assert_int_equal(fps_ranges_copy(&b, &a), 0);
  assert_int_equal(b.n, 20);
  assert_int_equal(b.covered, 20);
  /* Independent: changing the copy leaves the original alone. */
  assert_int_equal(fps_ranges_add(&b, 1, 3), 0);
  assert_int_equal(a.n, 20);
  assert_int_equal(b.n, 19);
  fps_ranges_free(&a);
  fps_ranges_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_in_order_merges),
      cmocka_unit_test(test_out_of_order_and_gaps),
      cmocka_unit_test(test_overlap_rejected_unchanged),
      cmocka_unit_test(test_copy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

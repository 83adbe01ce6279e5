/* Unit tests for server/shard/ranges.c: the interval sets that check slice
 * coverage (no overlap, no gap) for Create's init slices and PushPull's
 * gradient slices. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "shard/internal.h"

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

/* Random slices against a bitmap: the same verdict (overlap or not), the
 * same coverage and first gap, and the intervals stay maximal. */
static void test_random_against_bitmap(void **state) {
  (void)state;
  enum { N = 2000 };
  static unsigned char bit[N];
  uint64_t x = 88172645463325252u;
  for (int round = 0; round < 20; round++) {
    fps_ranges_t r = {0};
    memset(bit, 0, sizeof bit);
    uint64_t covered = 0;
    for (int i = 0; i < 3000; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      uint64_t lo = x % N, len = 1 + (x >> 20) % (round % 4 == 0 ? 3 : 40);
      uint64_t hi = lo + len > N ? N : lo + len;
      bool overlap = false;
      for (uint64_t k = lo; k < hi; k++) overlap |= bit[k];
      if (i % 2) assert_int_equal(fps_ranges_reserve(&r), 0); /* twice in a row is harmless */
      assert_int_equal(fps_ranges_reserve(&r), 0);
      int rc = fps_ranges_add(&r, lo, hi);
      assert_int_equal(rc, overlap ? FPS_EEXISTS : 0);
      if (!overlap) {
        for (uint64_t k = lo; k < hi; k++) bit[k] = 1;
        covered += hi - lo;
      }
      assert_int_equal(r.covered, covered);
    }
    size_t runs = 0;
    uint64_t gap = N;
    for (uint64_t k = 0; k < N; k++) {
      if (bit[k] && (k == 0 || !bit[k - 1])) runs++;
      if (!bit[k] && gap == N) gap = k;
    }
    assert_int_equal(r.n, runs);
    assert_int_equal(fps_ranges_first_gap(&r, N), gap);
    /* find: the maximal run around each element, none in a gap. */
    for (uint64_t k = 0; k < N + 2; k++) {
      fps_range_t m = {0, 0};
      bool in = k < N && bit[k];
      assert_int_equal(fps_ranges_find(&r, k, &m), in);
      if (!in) continue;
      uint64_t a = k, b = k + 1;
      while (a > 0 && bit[a - 1]) a--;
      while (b < N && bit[b]) b++;
      assert_int_equal(m.lo, a);
      assert_int_equal(m.hi, b);
    }
    fps_ranges_free(&r);
  }
}

/* 320k one-element slices in the worst orders finish in O(n log n): the
 * old sorted array shifted its whole tail for each of them. */
static void test_many_slices_fast(void **state) {
  (void)state;
  enum { N = 320000 };
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  fps_ranges_t r = {0};
  for (uint64_t i = N; i-- > 0;) assert_int_equal(fps_ranges_add(&r, 2 * i, 2 * i + 1), 0); /* reverse, gaps */
  assert_int_equal(r.n, N);
  for (uint64_t i = 0; i < N; i++) assert_int_equal(fps_ranges_add(&r, 2 * i + 1, 2 * i + 2), 0); /* fill */
  assert_int_equal(r.n, 1);
  assert_int_equal(r.covered, 2 * N);
  fps_ranges_free(&r);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  print_message("640k inserts (reverse with gaps, then filling): %.3f s\n", s);
  assert_true(s < 5.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_in_order_merges),
      cmocka_unit_test(test_out_of_order_and_gaps),
      cmocka_unit_test(test_overlap_rejected_unchanged),
      cmocka_unit_test(test_copy),
      cmocka_unit_test(test_random_against_bitmap),
      cmocka_unit_test(test_many_slices_fast),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

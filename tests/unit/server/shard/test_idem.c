/* Unit tests for server/shard/idem.c, the push idempotency window: the
 * keys one worker needs for its retries survive any number of pushes by
 * others (under one worker id or many), and keys in flight are never
 * forgotten. All shard-wide: one window of FPS_IDEM_WINDOW keys, as the
 * shard makes it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "shard/internal.h"

/* The window as the shard makes it. (Before per-worker bounds the window
 * took no per-worker argument: this keeps the test buildable against that
 * code, where it must fail.) */
static int idem_init(fps_idem_t *ix) {
#ifdef FPS_IDEM_PER_WORKER
  return fps__idem_init(ix, FPS_IDEM_WINDOW, FPS_IDEM_PER_WORKER);
#else
  return fps__idem_init(ix, FPS_IDEM_WINDOW);
#endif
}

static void apply(fps_idem_t *ix, uint32_t worker, uint64_t id, uint64_t version) {
  uint32_t slot;
  assert_int_equal(fps__idem_claim(ix, worker, id, &slot), 0);
  fps__idem_settle(ix, slot, worker, id, 7, &version, 1);
}

/* The retry of (worker, id) finds it applied, with the version it made. */
static void assert_kept(fps_idem_t *ix, uint32_t worker, uint64_t id, uint64_t version) {
  uint64_t v = 0;
  assert_int_equal(fps__idem_versions(ix, worker, id, 7, &v, 1), 0);
  assert_int_equal(v, version);
  uint32_t slot;
  assert_int_equal(fps__idem_claim(ix, worker, id, &slot), FPS_EEXISTS);
}

/* One other client pushing 100k keys as one worker: it flushed the whole
 * shared window (65,536 keys), after which a retried push applied twice. */
static void test_flood_under_one_worker_id(void **state) {
  (void)state;
  fps_idem_t ix;
  assert_int_equal(idem_init(&ix), 0);
  apply(&ix, 0, 1, 11);
  uint32_t inflight;
  assert_int_equal(fps__idem_claim(&ix, 0, 2, &inflight), 0);
  for (uint64_t id = 1; id <= 100000; id++) apply(&ix, 1, id, id);
  assert_kept(&ix, 0, 1, 11);
  uint32_t slot;
  assert_int_equal(fps__idem_claim(&ix, 0, 2, &slot), FPS_EAGAIN); /* still in flight */
  uint64_t v = 12;
  fps__idem_settle(&ix, inflight, 0, 2, 7, &v, 1);
  assert_kept(&ix, 0, 2, 12);
  /* The flooding worker keeps its own newest keys. */
  assert_kept(&ix, 1, 100000, 100000);
  fps__idem_destroy(&ix);
}

/* The same flood under 100k worker ids (async takes any): the window fills
 * and new keys are refused before a worker's newest keys or keys in
 * flight go. */
static void test_flood_under_many_worker_ids(void **state) {
  (void)state;
  fps_idem_t ix;
  assert_int_equal(idem_init(&ix), 0);
  for (uint64_t id = 1; id <= 100; id++) apply(&ix, 0, id, id);
  uint32_t inflight;
  assert_int_equal(fps__idem_claim(&ix, 0, 1000, &inflight), 0);
  int refused = 0;
  for (uint32_t w = 1; w <= 100000; w++) {
    uint32_t slot;
    uint64_t v = w;
    int rc = fps__idem_claim(&ix, w, 1, &slot);
    if (rc == 0) fps__idem_settle(&ix, slot, w, 1, 7, &v, 1);
    else refused++;
  }
  assert_true(refused > 0);
  for (uint64_t id = 1; id <= 100; id++) assert_kept(&ix, 0, id, id);
  uint32_t slot;
  assert_int_equal(fps__idem_claim(&ix, 0, 1000, &slot), FPS_EAGAIN);
  fps__idem_settle(&ix, inflight, 0, 1000, 7, &(uint64_t){5}, 1);
  assert_kept(&ix, 0, 1000, 5);
  fps__idem_destroy(&ix);
}

/* A worker past its own bound forgets its own oldest settled keys, never
 * one in flight; a forgotten key's claim is a fresh claim. */
static void test_a_worker_forgets_its_own_oldest(void **state) {
  (void)state;
  fps_idem_t ix;
  assert_int_equal(idem_init(&ix), 0);
  uint32_t first;
  assert_int_equal(fps__idem_claim(&ix, 3, 1, &first), 0); /* in flight throughout */
  for (uint64_t id = 2; id <= 3 * FPS_IDEM_WINDOW; id++) apply(&ix, 3, id, id);
  uint32_t slot;
  assert_int_equal(fps__idem_claim(&ix, 3, 1, &slot), FPS_EAGAIN);
  assert_kept(&ix, 3, 3 * FPS_IDEM_WINDOW, 3 * FPS_IDEM_WINDOW);
  uint64_t v;
  assert_int_equal(fps__idem_versions(&ix, 3, 2, 7, &v, 1), FPS_ENOTFOUND);
  assert_int_equal(fps__idem_claim(&ix, 3, 2, &slot), 0);
  fps__idem_settle(&ix, slot, 3, 2, 7, NULL, 0); /* failed: forgotten */
  assert_int_equal(fps__idem_claim(&ix, 3, 2, &slot), 0);
  fps__idem_destroy(&ix);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_flood_under_one_worker_id),
      cmocka_unit_test(test_flood_under_many_worker_ids),
      cmocka_unit_test(test_a_worker_forgets_its_own_oldest),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

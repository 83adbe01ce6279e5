/* server/timer.c and server/clock.c: hooks run in order with the time they
 * are given, the thread runs them on its own and stops promptly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <time.h>

#include "clock.h"
#include "error.h"
#include "timer.h"

typedef struct rec_s {
  int calls;
  int64_t last;
  int order[16];
  int n;
} rec_t;

static rec_t g_rec;

static void hook_a(void *arg, int64_t now) {
  (void)arg;
  g_rec.calls++;
  g_rec.last = now;
  if (g_rec.n < 16) g_rec.order[g_rec.n++] = 1;
}

static void hook_b(void *arg, int64_t now) {
  int *count = arg;
  __atomic_fetch_add(count, 1, __ATOMIC_RELAXED);
  (void)now;
  if (g_rec.n < 16) g_rec.order[g_rec.n++] = 2;
}

static void hooks_run_in_order_with_given_time(void **unused) {
  (void)unused;
  fps_timer_t *t;
  int count = 0;
  g_rec = (rec_t){0};
  assert_int_equal(fps_timer_create(&t, 0), 0);
  assert_int_equal(fps_timer_add(t, hook_a, NULL), 0);
  assert_int_equal(fps_timer_add(t, hook_b, &count), 0);
  fps_timer_run(t, 12345);
  assert_int_equal(g_rec.calls, 1);
  assert_int_equal(g_rec.last, 12345);
  assert_int_equal(count, 1);
  assert_int_equal(g_rec.n, 2);
  assert_int_equal(g_rec.order[0], 1);
  assert_int_equal(g_rec.order[1], 2);
  fps_timer_destroy(t); /* never started: no thread to join */
}

static void too_many_hooks_is_a_limit(void **unused) {
  (void)unused;
  fps_timer_t *t;
  int count = 0;
  assert_int_equal(fps_timer_create(&t, 0), 0);
  for (int i = 0; i < FPS_TIMER_HOOKS_MAX; i++) assert_int_equal(fps_timer_add(t, hook_b, &count), 0);
  assert_int_equal(fps_timer_add(t, hook_b, &count), FPS_ELIMIT);
  fps_timer_destroy(t);
  fps_timer_destroy(NULL);
}

static void thread_ticks_and_stops_promptly(void **unused) {
  (void)unused;
  fps_timer_t *t;
  int count = 0;
  g_rec = (rec_t){0};
  assert_int_equal(fps_timer_create(&t, INT64_C(1000000)), 0); /* 1 ms */
  assert_int_equal(fps_timer_add(t, hook_b, &count), 0);
  assert_int_equal(fps_timer_start(t), 0);
  int64_t t0 = fps_now_ns();
  while (__atomic_load_n(&count, __ATOMIC_RELAXED) < 3 && fps_now_ns() - t0 < INT64_C(5000000000)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  assert_true(__atomic_load_n(&count, __ATOMIC_RELAXED) >= 3);
  int64_t s0 = fps_now_ns();
  fps_timer_destroy(t);
  /* Stopping wakes the thread at once rather than at its next tick. */
  assert_true(fps_now_ns() - s0 < INT64_C(500000000));
}

static void clock_is_monotonic_and_after_saturates(void **unused) {
  (void)unused;
  int64_t a = fps_now_ns(), b = fps_now_ns();
  assert_true(b >= a);
  assert_int_equal(fps_clock_after(100, 0), 100);
  assert_int_equal(fps_clock_after(100, 1.5), 100 + INT64_C(1500000000));
  assert_int_equal(fps_clock_after(100, 1e300), INT64_MAX);
  assert_int_equal(fps_clock_after(INT64_MAX - 10, 1.0), INT64_MAX);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(hooks_run_in_order_with_given_time),
      cmocka_unit_test(too_many_hooks_is_a_limit),
      cmocka_unit_test(thread_ticks_and_stops_promptly),
      cmocka_unit_test(clock_is_monotonic_and_after_saturates),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

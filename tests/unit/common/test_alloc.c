/* common/alloc.c: the fault injection counts every kind of allocation,
 * fails exactly the chosen one (or every one from there with persist),
 * and leaves memory and libc semantics alone otherwise; libfactorps's
 * copy (alloc_client.c) counts and fails apart from the process's. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"

/* libfactorps's fps_malloc (alloc.h renames it in the library's files). */
void *fps__client_malloc(size_t size);

static int teardown(void **unused) {
  (void)unused;
  fps_alloc_fault_disarm();
  fps_client_alloc_fault_disarm();
  return 0;
}

static void disarmed_allocations_are_not_counted(void **unused) {
  (void)unused;
  fps_alloc_fault_arm(0, 0);
  fps_alloc_fault_disarm();
  void *p = fps_malloc(16);
  assert_non_null(p);
  fps_free(p);
  assert_int_equal(fps_alloc_calls(), 0);
}

static void every_kind_is_counted(void **unused) {
  (void)unused;
  fps_alloc_fault_arm(0, 0);
  void *a = fps_malloc(8), *b = fps_calloc(2, 8), *c = NULL;
  char *s = fps_strdup("w"), *t = fps_strndup("word", 2);
  a = fps_realloc(a, 64);
  assert_int_equal(fps_aligned_alloc(&c, 64, 128), 0);
  assert_true(a && b && c && s && t);
  assert_int_equal((uintptr_t)c % 64, 0);
  assert_string_equal(s, "w");
  assert_string_equal(t, "wo");
  assert_int_equal(fps_alloc_calls(), 6);
  assert_int_equal(fps_alloc_failures(), 0);
  fps_free(a);
  fps_free(b);
  fps_free(c);
  fps_free(s);
  fps_free(t);
  fps_free(NULL);
  assert_int_equal(fps_alloc_calls(), 6); /* frees are not allocations */
}

static void only_the_nth_fails(void **unused) {
  (void)unused;
  fps_alloc_fault_arm(3, 0);
  void *p[5];
  for (int i = 0; i < 5; i++) {
    errno = 0;
    p[i] = fps_malloc(32);
    if (i == 2) {
      assert_null(p[i]);
      assert_int_equal(errno, ENOMEM);
    } else {
      assert_non_null(p[i]);
    }
  }
  assert_int_equal(fps_alloc_calls(), 5);
  assert_int_equal(fps_alloc_failures(), 1);
  for (int i = 0; i < 5; i++) fps_free(p[i]);
}

static void persist_fails_every_later_one(void **unused) {
  (void)unused;
  fps_alloc_fault_arm(2, 1);
  char *a = fps_strdup("x");
  assert_non_null(a);
  assert_null(fps_calloc(1, 1));
  void *c = NULL;
  assert_int_equal(fps_aligned_alloc(&c, 64, 64), ENOMEM);
  assert_null(c);
  assert_int_equal(fps_alloc_failures(), 2);
  fps_alloc_fault_disarm();
  fps_free(a);
}

static void failed_realloc_keeps_the_block(void **unused) {
  (void)unused;
  char *p = fps_malloc(4);
  assert_non_null(p);
  memcpy(p, "abc", 4);
  fps_alloc_fault_arm(1, 0);
  assert_null(fps_realloc(p, 1 << 20));
  assert_string_equal(p, "abc");
  fps_free(p);
}

static void rearming_restarts_the_count(void **unused) {
  (void)unused;
  fps_alloc_fault_arm(0, 0);
  fps_free(fps_malloc(1));
  fps_free(fps_malloc(1));
  fps_alloc_fault_arm(1, 0);
  assert_int_equal(fps_alloc_calls(), 0);
  assert_null(fps_malloc(1));
  void *p = fps_malloc(1);
  assert_non_null(p);
  fps_free(p);
}

static void the_two_domains_fail_apart(void **unused) {
  (void)unused;
  fps_client_alloc_fault_arm(1, 1);
  void *p = fps_malloc(8);
  assert_non_null(p);
  assert_null(fps__client_malloc(8));
  assert_int_equal(fps_client_alloc_calls(), 1);
  assert_int_equal(fps_client_alloc_failures(), 1);
  fps_client_alloc_fault_disarm();
  fps_alloc_fault_arm(1, 1);
  void *q = fps__client_malloc(8);
  assert_non_null(q);
  assert_null(fps_malloc(8));
  assert_int_equal(fps_alloc_calls(), 1);
  fps_alloc_fault_disarm();
  fps_free(p);
  fps_free(q); /* the same heap: either free() will do */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(disarmed_allocations_are_not_counted, teardown),
      cmocka_unit_test_teardown(every_kind_is_counted, teardown),
      cmocka_unit_test_teardown(only_the_nth_fails, teardown),
      cmocka_unit_test_teardown(persist_fails_every_later_one, teardown),
      cmocka_unit_test_teardown(failed_realloc_keeps_the_block, teardown),
      cmocka_unit_test_teardown(rearming_restarts_the_count, teardown),
      cmocka_unit_test_teardown(the_two_domains_fail_apart, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

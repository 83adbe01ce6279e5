#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <cmocka.h>

#include "error.h"

static void every_code_has_text_and_name(void **unused) {
  (void)unused;
  for (int e = FPS__ERRNO_FIRST + 1; e < FPS__ERRNO_END; e++) {
    assert_string_not_equal(fps_strerror(e), "unknown error");
    assert_int_equal(strncmp(fps_err_name(e), "FPS_E", 5), 0);
  }
  assert_string_equal(fps_err_name(FPS_EINVAL), "FPS_EINVAL");
  assert_string_equal(fps_strerror(12345), "unknown error");
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(every_code_has_text_and_name)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* client/status.c: the library's one translation of its own failures
 * (FPS_E*) into the codes a caller sees, and the status it fills. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "internal.h"

static void codes_map_to_caller_codes(void **unused) {
  (void)unused;
  assert_int_equal(fps__code_from_err(0), FPS_CODE_OK);
  assert_int_equal(fps__code_from_err(FPS_EINVAL), FPS_CODE_INVALID_ARGUMENT);
  assert_int_equal(fps__code_from_err(FPS_EHPARAM), FPS_CODE_INVALID_ARGUMENT);
  assert_int_equal(fps__code_from_err(FPS_EFLAVOR), FPS_CODE_INVALID_ARGUMENT);
  assert_int_equal(fps__code_from_err(FPS_ENOMEM), FPS_CODE_RESOURCE_EXHAUSTED);
  assert_int_equal(fps__code_from_err(FPS_ENOTFOUND), FPS_CODE_NOT_FOUND);
  assert_int_equal(fps__code_from_err(FPS_EAUTH), FPS_CODE_UNAUTHENTICATED);
  assert_int_equal(fps__code_from_err(FPS_EPERM), FPS_CODE_PERMISSION_DENIED);
  /* A bad message inside the library is a shard's reply: INTERNAL, where
   * the server says INVALID_ARGUMENT of a request. */
  assert_int_equal(fps__code_from_err(FPS_EPROTO), FPS_CODE_INTERNAL);
  for (int e = FPS__ERRNO_FIRST + 1; e < FPS__ERRNO_END; e++) {
    int c = fps__code_from_err(e);
    if (c <= FPS_CODE_OK || c > FPS_CODE_UNAUTHENTICATED) fail_msg("%s: code %d", fps_err_name(e), c);
  }
  assert_int_equal(fps__code_from_err(12345), FPS_CODE_INTERNAL);
}

static void status_err_fills_the_status(void **unused) {
  (void)unused;
  fps_status_t st;
  memset(&st, 0xa5, sizeof st);
  assert_int_equal(fps__status_err(&st, FPS_ENOMEM, 3, "out of memory for %d tensors", 2),
                   FPS_CODE_RESOURCE_EXHAUSTED);
  assert_int_equal(st.code, FPS_CODE_RESOURCE_EXHAUSTED);
  assert_int_equal(st.shard, 3);
  assert_string_equal(st.message, "out of memory for 2 tensors");
  assert_int_equal(fps__status_err(NULL, FPS_EINVAL, -1, "x"), FPS_CODE_INVALID_ARGUMENT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(codes_map_to_caller_codes),
      cmocka_unit_test(status_err_fills_the_status),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

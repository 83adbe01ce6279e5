/* server/status.c: the one FPS_E* -> gRPC status table. (That every code
 * has an entry is checked by the compiler: -Wswitch-enum is an error in
 * status.c.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "error.h"
#include "status.h"

static void codes_map_to_their_statuses(void **unused) {
  (void)unused;
  assert_int_equal(fps_status_from_err(0), GRPC_STATUS_OK);
  assert_int_equal(fps_status_from_err(FPS_EINVAL), GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(fps_status_from_err(FPS_ENOTFOUND), GRPC_STATUS_NOT_FOUND);
  assert_int_equal(fps_status_from_err(FPS_EEXISTS), GRPC_STATUS_ALREADY_EXISTS);
  assert_int_equal(fps_status_from_err(FPS_EDUP), GRPC_STATUS_ALREADY_EXISTS);
  assert_int_equal(fps_status_from_err(FPS_ESTALE), GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(fps_status_from_err(FPS_EAHEAD), GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(fps_status_from_err(FPS_ESTATE), GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(fps_status_from_err(FPS_ELIMIT), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_int_equal(fps_status_from_err(FPS_ENOMEM), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_int_equal(fps_status_from_err(FPS_ETIMEOUT), GRPC_STATUS_DEADLINE_EXCEEDED);
  assert_int_equal(fps_status_from_err(FPS_ECANCELLED), GRPC_STATUS_CANCELLED);
  assert_int_equal(fps_status_from_err(FPS_EUNAVAILABLE), GRPC_STATUS_UNAVAILABLE);
}

static void every_code_is_a_real_status(void **unused) {
  (void)unused;
  for (int e = FPS__ERRNO_FIRST + 1; e < FPS__ERRNO_END; e++) {
    grpc_status_code c = fps_status_from_err(e);
    assert_true(c != GRPC_STATUS_OK);
    assert_true(c > GRPC_STATUS_OK && c <= GRPC_STATUS_UNAUTHENTICATED);
  }
  assert_int_equal(fps_status_from_err(12345), GRPC_STATUS_INTERNAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(codes_map_to_their_statuses),
      cmocka_unit_test(every_code_is_a_real_status),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

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

/* The whole table, written out: a code moved to another status changes
 * what clients see on the wire, so it must change here too. */
static void codes_map_to_their_statuses(void **unused) {
  (void)unused;
  static const struct {
    int err;
    grpc_status_code code;
  } table[] = {
      {0, GRPC_STATUS_OK},
      {FPS_EINVAL, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_ENOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED},
      {FPS_ESHAPE, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_EOVERFLOW, GRPC_STATUS_RESOURCE_EXHAUSTED},
      {FPS_EHPARAM, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_EFLAVOR, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_EUNSUPPORTED, GRPC_STATUS_UNIMPLEMENTED},
      {FPS_EIO, GRPC_STATUS_INTERNAL},
      {FPS_EFORMAT, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_ENOTFOUND, GRPC_STATUS_NOT_FOUND},
      {FPS_EEXISTS, GRPC_STATUS_ALREADY_EXISTS},
      {FPS_ESTATE, GRPC_STATUS_FAILED_PRECONDITION},
      {FPS_ENONFINITE, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_EPROTO, GRPC_STATUS_INVALID_ARGUMENT},
      {FPS_ETIMEOUT, GRPC_STATUS_DEADLINE_EXCEEDED},
      {FPS_EUNAVAILABLE, GRPC_STATUS_UNAVAILABLE},
      {FPS_ELIMIT, GRPC_STATUS_RESOURCE_EXHAUSTED},
      {FPS_EAGAIN, GRPC_STATUS_UNAVAILABLE},
      {FPS_ESTALE, GRPC_STATUS_FAILED_PRECONDITION},
      {FPS_EAHEAD, GRPC_STATUS_FAILED_PRECONDITION},
      {FPS_EDUP, GRPC_STATUS_ALREADY_EXISTS},
      {FPS_ECANCELLED, GRPC_STATUS_CANCELLED},
      {FPS_EAUTH, GRPC_STATUS_UNAUTHENTICATED},
      {FPS_EPERM, GRPC_STATUS_PERMISSION_DENIED},
      {FPS_EINTERNAL, GRPC_STATUS_INTERNAL},
  };
  size_t n = sizeof table / sizeof table[0];
  for (size_t i = 0; i < n; i++) {
    if (fps_status_from_err(table[i].err) != table[i].code)
      fail_msg("%s: status %d, expected %d", fps_err_name(table[i].err), (int)fps_status_from_err(table[i].err),
               (int)table[i].code);
  }
  /* Every code is in the list above (so none is added unpinned). */
  assert_int_equal(n - 1, (size_t)(FPS__ERRNO_END - FPS__ERRNO_FIRST - 1));
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

/* Another server's reply, back to a code: every status, written out. */
static void statuses_map_back_to_codes(void **unused) {
  (void)unused;
  static const int want[] = {
      [GRPC_STATUS_OK] = 0,
      [GRPC_STATUS_CANCELLED] = FPS_EUNAVAILABLE,
      [GRPC_STATUS_UNKNOWN] = FPS_EIO,
      [GRPC_STATUS_INVALID_ARGUMENT] = FPS_EINVAL,
      [GRPC_STATUS_DEADLINE_EXCEEDED] = FPS_ETIMEOUT,
      [GRPC_STATUS_NOT_FOUND] = FPS_ENOTFOUND,
      [GRPC_STATUS_ALREADY_EXISTS] = FPS_EEXISTS,
      [GRPC_STATUS_PERMISSION_DENIED] = FPS_ESTATE,
      [GRPC_STATUS_RESOURCE_EXHAUSTED] = FPS_ELIMIT,
      [GRPC_STATUS_FAILED_PRECONDITION] = FPS_ESTATE,
      [GRPC_STATUS_ABORTED] = FPS_EUNAVAILABLE,
      [GRPC_STATUS_OUT_OF_RANGE] = FPS_EINVAL,
      [GRPC_STATUS_UNIMPLEMENTED] = FPS_EUNSUPPORTED,
      [GRPC_STATUS_INTERNAL] = FPS_EIO,
      [GRPC_STATUS_UNAVAILABLE] = FPS_EUNAVAILABLE,
      [GRPC_STATUS_DATA_LOSS] = FPS_EIO,
      [GRPC_STATUS_UNAUTHENTICATED] = FPS_ESTATE,
  };
  for (int c = 0; c <= GRPC_STATUS_UNAUTHENTICATED; c++) {
    int got = fps_err_from_status((grpc_status_code)c);
    if (got != want[c]) fail_msg("status %d: %s, expected %s", c, fps_err_name(got), fps_err_name(want[c]));
  }
  assert_int_equal(fps_err_from_status(GRPC_STATUS__DO_NOT_USE), FPS_EIO);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(codes_map_to_their_statuses),
      cmocka_unit_test(every_code_is_a_real_status),
      cmocka_unit_test(statuses_map_back_to_codes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The installed client header cannot include common/fps_limits.h, so it
 * repeats the limits: this holds it to them (and a limit changed in one
 * place only fails here, at compile time). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "factorps/client.h"
#include "fps_limits.h"
#include "name.h"

_Static_assert(FPS_CLIENT_NAME_MAX == FPS_TENSOR_NAME_MAX, "client.h's name limit is common/fps_limits.h's");
_Static_assert(FPS_CLIENT_MAX_DIMS == FPS_MAX_DIMS, "client.h's dims limit is common/fps_limits.h's");

static void client_header_matches(void **unused) {
  (void)unused;
  assert_int_equal(FPS_CLIENT_NAME_MAX, FPS_TENSOR_NAME_MAX);
  assert_int_equal(FPS_CLIENT_MAX_DIMS, FPS_MAX_DIMS);
  /* The name rule uses the same limit: one byte more is refused. */
  char name[FPS_TENSOR_NAME_MAX + 2];
  for (size_t i = 0; i < sizeof name; i++) name[i] = 'a';
  char why[128];
  assert_int_equal(fps_name_check(name, FPS_TENSOR_NAME_MAX, why, sizeof why), 0);
  assert_int_not_equal(fps_name_check(name, FPS_TENSOR_NAME_MAX + 1, why, sizeof why), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(client_header_matches)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

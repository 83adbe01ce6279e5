/* The tensor name rule and the UTF-8 helpers of status messages
 * (common/name.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "error.h"
#include "name.h"

static int check(const char *s, size_t n, char *why) { return fps_name_check(s, n, why, 256); }

static void names(void **u) {
  (void)u;
  char why[256];
  assert_int_equal(check("w", 1, why), 0);
  assert_int_equal(check("layer.0/wé😀", strlen("layer.0/wé😀"), why), 0);
  assert_int_equal(check("", 0, why), FPS_EINVAL);
  assert_non_null(strstr(why, "empty"));
  /* NUL inside: the length says it is there. */
  assert_int_equal(check("w\0evil", 6, why), FPS_EINVAL);
  assert_non_null(strstr(why, "control character (0x00) at byte 1"));
  assert_non_null(strstr(why, "'w\\x00evil'"));
  for (int c = 1; c < 0x20; c++) {
    char s[3] = {'a', (char)c, 'b'};
    assert_int_equal(check(s, 3, why), FPS_EINVAL);
  }
  assert_int_equal(check("a\x7f", 2, why), FPS_EINVAL);
  /* Not UTF-8: overlong, surrogate, past U+10FFFF, cut short. */
  const char *bad[] = {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "a\xc3", "\xff"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(check(bad[i], strlen(bad[i]), why), FPS_EINVAL);
    assert_non_null(strstr(why, "not valid UTF-8"));
  }
  char big[FPS_TENSOR_NAME_MAX + 1];
  memset(big, 'x', sizeof big);
  assert_int_equal(check(big, FPS_TENSOR_NAME_MAX, why), 0);
  assert_int_equal(check(big, FPS_TENSOR_NAME_MAX + 1, why), FPS_EINVAL);
  assert_non_null(strstr(why, "257 bytes"));
}

static void quote_cuts_whole_characters(void **u) {
  (void)u;
  char out[64];
  assert_string_equal(fps_name_quote("aééé", 7, 4, out, sizeof out), "aé...");
  assert_string_equal(fps_name_quote("aééé", 7, 5, out, sizeof out), "aéé...");
  assert_string_equal(fps_name_quote("a\x01\xff", 3, 64, out, sizeof out), "a\\x01\\xff");
  /* A small output buffer cuts on a character too. */
  char tiny[8];
  fps_name_quote("ééééé", 10, 64, tiny, sizeof tiny);
  assert_true(fps_utf8_valid(tiny, strlen(tiny)));
}

static void fix_makes_messages_utf8(void **u) {
  (void)u;
  char a[] = "name 'aé";
  a[strlen(a) - 1] = '\0'; /* cut inside é */
  assert_string_equal(fps_utf8_fix(a), "name 'a");
  char b[] = "x\xff" "y\xc3" "z";
  assert_string_equal(fps_utf8_fix(b), "x?y?z");
  char c[] = "ok 😀";
  assert_string_equal(fps_utf8_fix(c), "ok 😀");
  char d[] = "e \xf0\x9f\x98"; /* 3 of 4 bytes at the end */
  assert_string_equal(fps_utf8_fix(d), "e ");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(names),
      cmocka_unit_test(quote_cuts_whole_characters),
      cmocka_unit_test(fix_makes_messages_utf8),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

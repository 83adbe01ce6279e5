/* Unit tests for common/dtype: bf16 rounding, NaN/Inf handling, the wire
 * decode/encode loops and their non-finite detection. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "dtype.h"
#include "simd/kernels.h"

static float f_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void test_sizes(void **state) {
  (void)state;
  assert_int_equal(fps_dtype_size(FPS_DTYPE_F32), 4);
  assert_int_equal(fps_dtype_size(FPS_DTYPE_BF16), 2);
  assert_int_equal(fps_dtype_size(0), 0);
  assert_int_equal(fps_dtype_size(3), 0);
  assert_string_equal(fps_dtype_name(FPS_DTYPE_BF16), "bf16");
  assert_string_equal(fps_dtype_name(7), "unknown");
}

static void test_bf16_exact_values(void **state) {
  (void)state;
  const float exact[] = {0.0f, -0.0f, 1.0f, -2.0f, 0.5f, 3.0f, 65536.0f, 1.0f / 1024};
  for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++) {
    uint16_t h = fps_f32_to_bf16(exact[i]);
    float back = fps_bf16_to_f32(h);
    assert_memory_equal(&back, &exact[i], sizeof back);
  }
  assert_int_equal(fps_f32_to_bf16(1.0f), 0x3f80);
}

static void test_bf16_round_nearest_even(void **state) {
  (void)state;
  /* Exactly half-way between 0x3f80 and 0x3f81: ties go to even (0x3f80). */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x3f808000u)), 0x3f80);
  /* Half-way between 0x3f81 and 0x3f82: to even (0x3f82). */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x3f818000u)), 0x3f82);
  /* Just above half-way rounds up, just below rounds down. */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x3f808001u)), 0x3f81);
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x3f807fffu)), 0x3f80);
  /* Mantissa carry bumps the exponent. */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x3fffffffu)), 0x4000);
  /* Largest finite fp32 rounds past the bf16 range to +Inf. */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x7f7fffffu)), 0x7f80);
  /* Negative values round symmetrically. */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0xbf818000u)), 0xbf82);
  /* Subnormals round like everything else. */
  assert_int_equal(fps_f32_to_bf16(f_from_bits(0x00018000u)), 0x0002);
}

static void test_bf16_nan_inf(void **state) {
  (void)state;
  assert_int_equal(fps_f32_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(fps_f32_to_bf16(-INFINITY), 0xff80);
  /* A NaN whose payload lives only in the low 16 bits must stay NaN. */
  uint16_t h = fps_f32_to_bf16(f_from_bits(0x7f800001u));
  assert_true(isnan(fps_bf16_to_f32(h)));
  h = fps_f32_to_bf16(f_from_bits(0xffc00000u));
  assert_true(isnan(fps_bf16_to_f32(h)));
  assert_int_equal(h & 0x8000, 0x8000);
  assert_true(isinf(fps_bf16_to_f32(0x7f80)));
}

static void test_decode_f32_finite_check(void **state) {
  (void)state;
  enum { N = 3000 };
  static float src[N], dst[N];
  for (int i = 0; i < N; i++) src[i] = (float)i * 0.25f;
  uint64_t bad = 0;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
  assert_int_equal(bad, N);
  assert_memory_equal(src, dst, sizeof src);
  src[2049] = NAN;
  src[2500] = INFINITY;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
  assert_int_equal(bad, 2049);
  src[2049] = 1.0f;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
  assert_int_equal(bad, 2500);
  /* Misaligned source. */
  static unsigned char raw[4 * 8 + 1];
  float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  memcpy(raw + 1, v, sizeof v);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, raw + 1, 8, dst, NULL), 0);
  assert_memory_equal(dst, v, sizeof v);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, 0, dst, &bad), 0);
  assert_int_equal(bad, 0);
}

/* A finite gradient whose square overflows the fp32 statistics would turn
 * the whole tensor into NaN: decode flags |g| >= 2^63, of either sign and
 * dtype, and accepts everything just below it. */
static void test_decode_gradient_magnitude_limit(void **state) {
  (void)state;
  const float limit = (float)FPS_GRAD_ABS_LIMIT;
  const float below = nextafterf(limit, 0.0f);
  assert_true((double)limit == 9223372036854775808.0);
  for (int pos = 0; pos < 2; pos++) {
    /* pos 0: inside a full 1024-element block; pos 1: in the short tail. */
    enum { N = 1030 };
    static float src[N], dst[N];
    uint64_t at = pos ? N - 2 : 700, bad = 0;
    for (int i = 0; i < N; i++) src[i] = (i & 1) ? below : -below;
    assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
    assert_int_equal(bad, N);
    src[at] = -limit;
    assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
    assert_int_equal(bad, at);
    src[at] = 1e20f;
    assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, src, N, dst, &bad), 0);
    assert_int_equal(bad, at);
  }
  /* bf16: 2^63 is exact in bf16 (0x5f00); the value just below is 0x5eff. */
  uint16_t h[3] = {0x5effu, 0xdeffu, 0x5f00u};
  float out[3];
  uint64_t bad = 0;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, h, 2, out, &bad), 0);
  assert_int_equal(bad, 2);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, h, 3, out, &bad), 0);
  assert_int_equal(bad, 2);
}

static void test_decode_encode_bf16(void **state) {
  (void)state;
  float src[5] = {1.0f, -3.5f, 0.0f, 1e-3f, 2.0f};
  unsigned char wire[10 + 1];
  float back[5];
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_BF16, src, 5, wire + 1), 0);
  uint64_t bad = 0;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, wire + 1, 5, back, &bad), 0);
  assert_int_equal(bad, 5);
  for (int i = 0; i < 5; i++) assert_true(fabsf(back[i] - src[i]) <= fabsf(src[i]) / 128);
  uint16_t nan_h = 0x7fc0;
  memcpy(wire + 1 + 6, &nan_h, 2);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, wire + 1, 5, back, &bad), 0);
  assert_int_equal(bad, 3);
  assert_int_equal(fps_dtype_decode(9, wire, 1, back, &bad), FPS_EINVAL);
  assert_int_equal(fps_dtype_encode(0, src, 1, wire), FPS_EINVAL);
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_F32, src, 5, back), 0);
  assert_memory_equal(back, src, sizeof src);
}

/* fps_dtype_decode still decodes every element past an invalid one (the
 * kernel stops there; dtype.c copies the rest), bit for bit. */
static void test_decode_f32_past_a_bad_value(void **state) {
  (void)state;
  enum { N = 777 };
  static unsigned char raw[4 * N + 3];
  static float src[N], dst[N];
  for (int i = 0; i < N; i++) src[i] = (float)i - 300.5f;
  src[123] = f_from_bits(0x7fc01234u); /* a NaN with a payload */
  src[500] = INFINITY;
  memcpy(raw + 3, src, sizeof src);
  uint64_t bad = 0;
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_F32, raw + 3, N, dst, &bad), 0);
  assert_int_equal(bad, 123);
  assert_memory_equal(dst, src, sizeof src);
}

/* The shard's one pass in: sums and decodes through the dtype, with the
 * best kernels (NULL) and each variant; stops at the first invalid
 * gradient and leaves the sum from there untouched; an unknown dtype
 * refuses element 0; fps_dtype_value reads the element the error names. */
static void test_grad_sum_and_decode(void **state) {
  (void)state;
  enum { N = 100 };
  float g[N], acc[N], want[N], dst[N];
  unsigned char f32[4 * N + 1], bf[2 * N + 1];
  for (int i = 0; i < N; i++) g[i] = (float)(i % 7) - 2.75f; /* exact in bf16 */
  g[61] = f_from_bits(0xdf000000u);                         /* -2^63 */
  memcpy(f32 + 1, g, sizeof g);
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_BF16, g, N, bf + 1), 0);
  for (int vi = -1; vi < 0 || fps_kernels_all_names[vi]; vi++) { /* -1: NULL, the best */
    const fps_kernels_t *k = NULL;
    if (vi >= 0 && fps_kernels_by_name(fps_kernels_all_names[vi], &k, NULL, 0) != 0) continue;
    for (int dt = FPS_DTYPE_F32; dt <= FPS_DTYPE_BF16; dt++) {
      const unsigned char *w = dt == FPS_DTYPE_F32 ? f32 + 1 : bf + 1;
      for (int i = 0; i < N; i++) acc[i] = want[i] = 0.5f * (float)i;
      for (int i = 0; i < 61; i++) want[i] += g[i];
      assert_int_equal(fps_dtype_grad_sum(k, dt, acc, w, N), 61);
      assert_memory_equal(acc, want, sizeof acc);
      assert_int_equal(fps_dtype_grad_sum(k, dt, acc, w, 61), 61);
      assert_int_equal(fps_dtype_grad_decode(k, dt, dst, w, 61), 61);
      assert_memory_equal(dst, g, 61 * sizeof(float));
      assert_int_equal(fps_dtype_grad_decode(k, dt, dst, w, N), 61);
      assert_true(fps_dtype_value(dt, w, 61) == -(float)FPS_GRAD_ABS_LIMIT);
      assert_true(fps_dtype_value(dt, w, 5) == g[5]);
    }
    memcpy(want, acc, sizeof acc);
    assert_int_equal(fps_dtype_grad_sum(k, 9, acc, f32 + 1, N), 0);
    assert_int_equal(fps_dtype_grad_decode(k, 0, acc, f32 + 1, N), 0);
    assert_memory_equal(acc, want, sizeof acc);
  }
  assert_true(fps_dtype_value(9, f32 + 1, 0) == 0.0f);
}

/* decode_out into a dst that is not float-aligned (bytes 1..3 past an
 * alignment, as a caller's packed buffer may be): the same bits as the
 * plain decode, no fault from the streaming stores. */
static void test_decode_out_unaligned_dst(void **state) {
  (void)state;
  enum { n = 1000 };
  static float src[n], want[n];
  static uint16_t wire[n];
  static unsigned char buf[n * 4 + 128];
  for (int i = 0; i < n; i++) src[i] = (float)(i - 500) * 0.37f;
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_BF16, src, n, wire), 0);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, wire, n, want, NULL), 0);
  for (int off = 0; off < 8; off++) {
    memset(buf, 0xAB, sizeof buf);
    fps_dtype_decode_out(FPS_DTYPE_BF16, wire, n, (float *)(void *)(buf + 64 + off));
    assert_memory_equal(buf + 64 + off, want, sizeof want);
    assert_int_equal(buf[63 + off], 0xAB);
    assert_int_equal(buf[64 + off + sizeof want], 0xAB);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_bf16_exact_values),
      cmocka_unit_test(test_bf16_round_nearest_even),
      cmocka_unit_test(test_bf16_nan_inf),
      cmocka_unit_test(test_decode_f32_finite_check),
      cmocka_unit_test(test_decode_gradient_magnitude_limit),
      cmocka_unit_test(test_decode_encode_bf16),
      cmocka_unit_test(test_decode_f32_past_a_bad_value),
      cmocka_unit_test(test_grad_sum_and_decode),
      cmocka_unit_test(test_decode_out_unaligned_dst),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

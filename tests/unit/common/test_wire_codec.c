/* The data path's wire codec (common/wire_codec.h): reading across
 * buffer boundaries at every cut, the TensorSlice decoder against
 * protobuf-c's unpack, element runs with the bounce buffer, and the
 * encoders against protobuf-c's unpack. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "factorps/v1/factorps.pb-c.h"
#include "wire_codec.h"

/* Cuts buf into spans: a cut after every byte in `cuts` (sorted), and an
 * empty span at each cut too, so empty buffers are crossed as well. */
static size_t cut(const uint8_t *buf, size_t len, const size_t *cuts, size_t ncuts, fps_wspan_t *out) {
  size_t n = 0, at = 0;
  for (size_t i = 0; i < ncuts; i++) {
    out[n++] = (fps_wspan_t){buf + at, cuts[i] - at};
    out[n++] = (fps_wspan_t){buf + cuts[i], 0};
    at = cuts[i];
  }
  out[n++] = (fps_wspan_t){buf + at, len - at};
  return n;
}

/* Random cuts (about one every `every` bytes). */
static size_t random_cuts(size_t len, unsigned every, size_t *cuts) {
  size_t n = 0;
  for (size_t i = 1; i < len; i++)
    if ((unsigned)rand() % every == 0) cuts[n++] = i;
  return n;
}

static void varints_at_every_cut(void **u) {
  (void)u;
  const uint64_t vals[] = {0, 1, 127, 128, 300, UINT64_C(1) << 35, UINT64_MAX};
  uint8_t buf[16 * 7];
  size_t len = 0;
  for (size_t i = 0; i < 7; i++) len += fps_wire_put_varint(buf + len, vals[i]);
  for (size_t c = 1; c < len; c++) {
    fps_wspan_t sp[4];
    size_t cuts[1] = {c};
    size_t n = cut(buf, len, cuts, 1, sp);
    fps_wreader_t r;
    fps_wr_init(&r, sp, n);
    assert_int_equal(fps_wr_left(&r), len);
    for (size_t i = 0; i < 7; i++) {
      uint64_t v;
      assert_true(fps_wr_varint(&r, 10, &v));
      assert_true(v == vals[i]);
    }
    assert_int_equal(fps_wr_left(&r), 0);
  }
  /* Longer than allowed, or cut short: refused, the cursor unmoved. */
  uint8_t eleven[11];
  memset(eleven, 0x80, 10);
  eleven[10] = 0;
  fps_wspan_t one = {eleven, 11};
  fps_wreader_t r;
  fps_wr_init(&r, &one, 1);
  uint64_t v;
  assert_false(fps_wr_varint(&r, 10, &v));
  assert_int_equal(fps_wr_left(&r), 11);
  one.n = 3;
  fps_wr_init(&r, &one, 1);
  assert_false(fps_wr_varint(&r, 10, &v));
  /* A key of field 0 or of a group wire type is malformed. */
  uint8_t k0[] = {0x00}, k3[] = {0x0b};
  uint32_t f;
  int wt;
  fps_wspan_t s0 = {k0, 1}, s3 = {k3, 1};
  fps_wr_init(&r, &s0, 1);
  assert_false(fps_wr_key(&r, &f, &wt));
  fps_wr_init(&r, &s3, 1);
  assert_false(fps_wr_key(&r, &f, &wt));
}

/* A TensorSlice packed by protobuf-c, decoded from cut buffers, equals the
 * original; its data comes back through element runs. */
static void tensor_slice_matches_protobuf_c(void **u) {
  (void)u;
  srand(7);
  for (int iter = 0; iter < 300; iter++) {
    uint64_t shape[5];
    size_t ndim = (size_t)rand() % 6;
    for (size_t d = 0; d < ndim; d++) shape[d] = (uint64_t)rand() << (rand() % 30);
    int bf16 = rand() % 2;
    size_t esz = bf16 ? 2 : 4, count = (size_t)rand() % 300;
    uint8_t *data = malloc(count * esz + 1);
    for (size_t i = 0; i < count * esz; i++) data[i] = (uint8_t)rand();
    char name[40];
    snprintf(name, sizeof name, "layer.%d/w", rand());
    Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT;
    s.name = name;
    s.dtype = bf16 ? FACTORPS__V1__DTYPE__DTYPE_BF16 : FACTORPS__V1__DTYPE__DTYPE_F32;
    s.shape = shape;
    s.n_shape = ndim;
    s.offset = (uint64_t)rand() * (uint64_t)rand();
    s.data.data = data;
    s.data.len = count * esz;
    size_t len = factorps__v1__tensor_slice__get_packed_size(&s);
    uint8_t *buf = malloc(len);
    factorps__v1__tensor_slice__pack(&s, buf);

    size_t cuts[4096];
    size_t nc = random_cuts(len, 1 + (unsigned)rand() % 16, cuts);
    fps_wspan_t *sp = malloc((2 * nc + 1) * sizeof *sp);
    size_t n = cut(buf, len, cuts, nc, sp);
    fps_wreader_t r;
    fps_wr_init(&r, sp, n);
    fps_wire_tslice_t ts;
    assert_true(fps_wire_tslice_parse(&r, &ts));
    assert_int_equal(fps_wr_left(&r), 0);
    char got[64];
    assert_int_equal(ts.name_len, strlen(name));
    assert_true(fps_wr_read(&ts.name, got, ts.name_len));
    assert_memory_equal(got, name, ts.name_len);
    assert_int_equal(ts.dtype, s.dtype);
    assert_int_equal(ts.n_shape, ndim);
    for (size_t d = 0; d < ndim; d++) assert_true(ts.shape[d] == shape[d]);
    assert_true(ts.offset == s.offset);
    assert_int_equal(ts.data_len, count * esz);
    fps_welems_t it;
    fps_welems_init(&it, &ts.data, esz);
    const uint8_t *p;
    uint64_t k, at = 0;
    while ((k = fps_welems_next(&it, &p)) > 0) {
      assert_true(at + k * esz <= count * esz);
      assert_memory_equal(p, data + at, k * esz);
      at += k * esz;
    }
    assert_int_equal(at, count * esz);
    free(sp);
    free(buf);
    free(data);
  }
}

/* An element cut between two buffers comes alone, from the bounce buffer. */
static void element_straddling_buffers(void **u) {
  (void)u;
  uint8_t d[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  fps_wspan_t sp[3] = {{d, 5}, {d + 5, 2}, {d + 7, 5}};
  fps_wreader_t r;
  fps_wr_init(&r, sp, 3);
  fps_welems_t it;
  fps_welems_init(&it, &r, 4);
  const uint8_t *p;
  assert_int_equal(fps_welems_next(&it, &p), 1); /* 1..4 in place */
  assert_ptr_equal(p, d);
  assert_int_equal(fps_welems_next(&it, &p), 1); /* 5..8 across three spans' worth */
  assert_memory_equal(p, d + 4, 4);
  assert_true(p < d || p >= d + 12);             /* from the bounce buffer */
  assert_int_equal(fps_welems_next(&it, &p), 1); /* 9..12 in place */
  assert_ptr_equal(p, d + 8);
  assert_int_equal(fps_welems_next(&it, &p), 0);
}

/* Malformed slices: a known field with the wrong wire type, a length past
 * the end, every truncation of a valid slice that cuts a field. */
static void malformed_slices(void **u) {
  (void)u;
  const uint8_t wrong_dtype[] = {0x15, 1, 0, 0, 0};  /* dtype as fixed32 */
  const uint8_t long_len[] = {0x0a, 0x05, 'a', 'b'};  /* name longer than the rest */
  const uint8_t fixed_shape[] = {0x1d, 1, 0, 0, 0};  /* shape as fixed32 */
  const uint8_t *bad[] = {wrong_dtype, long_len, fixed_shape};
  size_t blen[] = {sizeof wrong_dtype, sizeof long_len, sizeof fixed_shape};
  for (size_t i = 0; i < 3; i++) {
    fps_wspan_t sp = {bad[i], blen[i]};
    fps_wreader_t r;
    fps_wr_init(&r, &sp, 1);
    fps_wire_tslice_t ts;
    assert_false(fps_wire_tslice_parse(&r, &ts));
  }
  uint64_t shape[2] = {300, 3};
  float f[4] = {1, 2, 3, 4};
  Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT;
  s.name = "w";
  s.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  s.shape = shape;
  s.n_shape = 2;
  s.offset = 200;
  s.data.data = (uint8_t *)f;
  s.data.len = sizeof f;
  uint8_t buf[64];
  size_t len = factorps__v1__tensor_slice__pack(&s, buf);
  for (size_t k = 0; k < len; k++) {
    fps_wspan_t sp = {buf, k};
    fps_wreader_t r;
    fps_wr_init(&r, &sp, 1);
    fps_wire_tslice_t ts;
    Factorps__V1__TensorSlice *ref = factorps__v1__tensor_slice__unpack(NULL, k, buf);
    /* Accepted exactly when protobuf-c accepts the same prefix. */
    assert_int_equal(fps_wire_tslice_parse(&r, &ts), ref != NULL);
    if (ref) factorps__v1__tensor_slice__free_unpacked(ref, NULL);
  }
}

/* The encoders: a PullResponse framed by hand (slice headers followed by
 * their data, versions) is what protobuf-c unpacks. */
static void encoders_match_protobuf_c(void **u) {
  (void)u;
  uint64_t shape[3] = {2, 70000, 3};
  uint8_t data[40];
  for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 7);
  uint8_t buf[512];
  size_t n = fps_wire_slice_header(buf, 1, "emb", 3, FACTORPS__V1__DTYPE__DTYPE_F32, 3, shape, 420000, 40);
  assert_true(n <= FPS_WIRE_SLICE_HEADER_MAX(3, 3));
  memcpy(buf + n, data, 40);
  n += 40;
  size_t m = fps_wire_slice_header(buf + n, 1, "s", 1, FACTORPS__V1__DTYPE__DTYPE_BF16, 0, NULL, 0, 0);
  assert_true(m <= FPS_WIRE_SLICE_HEADER_MAX(1, 0));
  n += m;
  m = fps_wire_version(buf + n, 2, "emb", 3, UINT64_C(1) << 50);
  assert_true(m <= FPS_WIRE_VERSION_MAX(3));
  n += m;
  m = fps_wire_version(buf + n, 2, "s", 1, 0);
  assert_true(m <= FPS_WIRE_VERSION_MAX(1));
  n += m;
  Factorps__V1__PullResponse *r = factorps__v1__pull_response__unpack(NULL, n, buf);
  assert_non_null(r);
  assert_int_equal(r->n_params, 2);
  assert_string_equal(r->params[0]->name, "emb");
  assert_int_equal(r->params[0]->n_shape, 3);
  assert_true(r->params[0]->shape[1] == 70000);
  assert_true(r->params[0]->offset == 420000);
  assert_int_equal(r->params[0]->data.len, 40);
  assert_memory_equal(r->params[0]->data.data, data, 40);
  assert_int_equal(r->params[1]->dtype, FACTORPS__V1__DTYPE__DTYPE_BF16);
  assert_int_equal(r->params[1]->data.len, 0);
  assert_int_equal(r->n_versions, 2);
  assert_true(r->versions[0]->version == UINT64_C(1) << 50);
  assert_string_equal(r->versions[1]->name, "s");
  assert_true(r->versions[1]->version == 0);
  factorps__v1__pull_response__free_unpacked(r, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(varints_at_every_cut),
      cmocka_unit_test(tensor_slice_matches_protobuf_c),
      cmocka_unit_test(element_straddling_buffers),
      cmocka_unit_test(malformed_slices),
      cmocka_unit_test(encoders_match_protobuf_c),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Unit tests of libfactorps internals that need no server: the hand-written
 * wire encoder/decoder (checked against protobuf-c, the reference for the
 * wire format) and the placement algorithm. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>

#include "error.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

/* The header encoder + raw data must be what protobuf-c decodes as the same
 * TensorSlice inside a PushPullRequest. */
static void test_slice_header_matches_protobuf_c(void **state) {
  (void)state;
  static const struct {
    const char *name;
    uint32_t ndim;
    uint64_t shape[3];
    uint64_t offset;
    size_t count;
  } cases[] = {
      {"w", 0, {0}, 0, 1},
      {"layer000.attn.qkv", 2, {3072, 1024}, 0, 300},
      {"x", 3, {2, 200, 300}, 123456789ull, 17},
      {"a-name-that-is-longer-than-one-hundred-and-twenty-seven-bytes-so-its-length-"
       "takes-two-varint-bytes-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
       1, {1ull << 33}, (1ull << 33) - 40, 40},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    float data[300];
    for (size_t i = 0; i < cases[c].count; i++) data[i] = (float)i * 0.25f - 3.0f;
    size_t name_len = strlen(cases[c].name);
    uint8_t *buf = malloc(64 + FPS_WIRE_SLICE_HEADER_MAX(name_len, cases[c].ndim) +
                          sizeof data);
    assert_non_null(buf);
    size_t n = fps_wire_put_varint_field(buf, 1, 7);
    n += fps_wire_put_varint_field(buf + n, 2, 1ull << 40);
    size_t h = fps_wire_slice_header(buf + n, 3, cases[c].name, name_len, 1, cases[c].ndim, cases[c].shape,
                                     cases[c].offset, cases[c].count * 4);
    assert_true(h <= FPS_WIRE_SLICE_HEADER_MAX(name_len, cases[c].ndim));
    n += h;
    memcpy(buf + n, data, cases[c].count * 4);
    n += cases[c].count * 4;

    Factorps__V1__PushPullRequest *r = factorps__v1__push_pull_request__unpack(NULL, n, buf);
    assert_non_null(r);
    assert_int_equal(r->worker_id, 7);
    assert_int_equal(r->step, 1ull << 40);
    assert_int_equal(r->n_grads, 1);
    const Factorps__V1__TensorSlice *s = r->grads[0];
    assert_string_equal(s->name, cases[c].name);
    assert_int_equal(s->dtype, 1);
    assert_int_equal(s->n_shape, cases[c].ndim);
    for (uint32_t d = 0; d < cases[c].ndim; d++) assert_int_equal(s->shape[d], cases[c].shape[d]);
    assert_int_equal(s->offset, cases[c].offset);
    assert_int_equal(s->data.len, cases[c].count * 4);
    assert_memory_equal(s->data.data, data, cases[c].count * 4);
    factorps__v1__push_pull_request__free_unpacked(r, NULL);
    free(buf);
  }
}

typedef struct seen_s {
  int slices, versions;
  fps_wire_tslice_t last;
  uint8_t data[64];           /* the last slice's data, reassembled */
  char name[64];
  uint64_t version;
} seen_t;

static int on_slice(void *ctx, const fps_wire_tslice_t *sl) {
  seen_t *s = ctx;
  s->slices++;
  s->last = *sl;
  fps_wreader_t d = sl->data;
  if (sl->data_len <= sizeof s->data) fps_wr_read(&d, s->data, sl->data_len);
  return 0;
}

/* Parses buf as one buffer, or cut in two at `cut` (0: one buffer). */
static int parse(const uint8_t *buf, size_t n, size_t cut, const fps__wire_sink_t *sink, char *err, size_t errlen) {
  fps_wspan_t sp[2] = {{buf, cut ? cut : n}, {buf + cut, cut ? n - cut : 0}};
  return fps__wire_parse_params(sp, cut ? 2 : 1, sink, err, errlen);
}

static int on_version(void *ctx, const char *name, size_t len, uint64_t v) {
  seen_t *s = ctx;
  s->versions++;
  snprintf(s->name, sizeof s->name, "%.*s", (int)len, name);
  s->version = v;
  return 0;
}

/* What protobuf-c packs, the decoder reads, including unpacked shapes and
 * unknown fields it must skip. */
static void test_decoder_reads_protobuf_c(void **state) {
  (void)state;
  float vals[5] = {1, -2, 3.5f, 0, 1e30f};
  uint64_t shape[2] = {5, 1};
  Factorps__V1__TensorSlice sl = FACTORPS__V1__TENSOR_SLICE__INIT;
  sl.name = "t";
  sl.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  sl.n_shape = 2;
  sl.shape = shape;
  sl.offset = 3;
  sl.data.data = (uint8_t *)vals;
  sl.data.len = sizeof vals;
  Factorps__V1__TensorSlice *slp = &sl;
  Factorps__V1__TensorVersion v = FACTORPS__V1__TENSOR_VERSION__INIT;
  v.name = "t";
  v.version = 42;
  Factorps__V1__TensorVersion *vp = &v;
  Factorps__V1__PullResponse resp = FACTORPS__V1__PULL_RESPONSE__INIT;
  resp.n_params = 1;
  resp.params = &slp;
  resp.n_versions = 1;
  resp.versions = &vp;
  size_t n = factorps__v1__pull_response__get_packed_size(&resp);
  uint8_t *buf = malloc(n + 16);
  assert_non_null(buf);
  factorps__v1__pull_response__pack(&resp, buf);
  /* An unknown varint field 9 and an unknown length-delimited field 10. */
  buf[n++] = 9 << 3;
  buf[n++] = 0x81;
  buf[n++] = 0x01;
  buf[n++] = (10 << 3) | 2;
  buf[n++] = 2;
  buf[n++] = 'x';
  buf[n++] = 'y';

  char err[128];
  /* In one buffer and cut in two at every byte: the same result. */
  for (size_t cut = 0; cut < n; cut++) {
    seen_t seen = {0};
    fps__wire_sink_t sink = {on_slice, on_version, &seen};
    assert_int_equal(parse(buf, n, cut, &sink, err, sizeof err), 0);
    assert_int_equal(seen.slices, 1);
    assert_int_equal(seen.versions, 1);
    assert_int_equal(seen.last.name_len, 1);
    assert_int_equal(seen.last.n_shape, 2);
    assert_int_equal(seen.last.shape[0], 5);
    assert_int_equal(seen.last.offset, 3);
    assert_int_equal(seen.last.data_len, sizeof vals);
    assert_memory_equal(seen.data, vals, sizeof vals);
    assert_string_equal(seen.name, "t");
    assert_int_equal(seen.version, 42);
  }

  /* Every truncation is either a clean parse of a prefix or an error;
   * never a read past the end (ASan checks). */
  seen_t seen = {0};
  fps__wire_sink_t sink = {on_slice, on_version, &seen};
  for (size_t cut = 0; cut < n; cut++) {
    uint8_t *p = malloc(cut ? cut : 1);
    memcpy(p, buf, cut);
    parse(p, cut, cut / 2, &sink, err, sizeof err);
    free(p);
  }
  free(buf);
}

static void test_decoder_rejects_garbage(void **state) {
  (void)state;
  seen_t seen = {0};
  fps__wire_sink_t sink = {on_slice, on_version, &seen};
  char err[128];
  /* Length beyond the buffer. */
  static const uint8_t too_long[] = {(1 << 3) | 2, 100, 0x0a};
  assert_int_equal(parse(too_long, sizeof too_long, 0, &sink, err, sizeof err), FPS_EPROTO);
  /* An 11-byte varint. */
  static const uint8_t bad_varint[] = {0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
                                       0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  assert_int_equal(parse(bad_varint, sizeof bad_varint, 5, &sink, err, sizeof err), FPS_EPROTO);
  /* Group wire types are not proto3. */
  static const uint8_t group[] = {(1 << 3) | 3};
  assert_int_equal(parse(group, sizeof group, 0, &sink, err, sizeof err), FPS_EPROTO);
  assert_non_null(strstr(err, "malformed"));
  assert_int_equal(seen.slices, 0);
}

static void test_placement_deterministic_balanced(void **state) {
  (void)state;
  enum { N = 50, SHARDS = 3 };
  fps__tensor_t a[N], b[N];
  char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "t%02d", i);
    memset(&a[i], 0, sizeof a[i]);
    a[i].name = names[i];
    a[i].bytes = 4 * (uint64_t)(1 + (i * 7919) % 13) * 1000; /* many equal sizes */
  }
  for (int i = 0; i < N; i++) b[i] = a[(i * 31 + 7) % N];
  uint64_t load_a[SHARDS], load_b[SHARDS], biggest = 0;
  assert_int_equal(fps__placement_compute(a, N, SHARDS, load_a), 0);
  assert_int_equal(fps__placement_compute(b, N, SHARDS, load_b), 0);
  for (int i = 0; i < N; i++) {
    int j = 0;
    while (strcmp(b[j].name, a[i].name)) j++;
    assert_int_equal(a[i].shard, b[j].shard);
    if (a[i].bytes > biggest) biggest = a[i].bytes;
  }
  uint64_t hi = 0, lo = UINT64_MAX;
  for (int s = 0; s < SHARDS; s++) {
    assert_int_equal(load_a[s], load_b[s]);
    hi = load_a[s] > hi ? load_a[s] : hi;
    lo = load_a[s] < lo ? load_a[s] : lo;
  }
  assert_true(hi - lo <= biggest);

  /* The documented order: largest first, ties by name, to the least
   * loaded shard, ties to the lowest index. */
  fps__tensor_t t[4] = {{.name = "b", .bytes = 8}, {.name = "a", .bytes = 8},
                        {.name = "c", .bytes = 16}, {.name = "d", .bytes = 4}};
  assert_int_equal(fps__placement_compute(t, 4, 2, NULL), 0);
  assert_int_equal(t[2].shard, 0); /* c: 16 -> shard 0 */
  assert_int_equal(t[1].shard, 1); /* a: 8 -> shard 1 (0 has 16) */
  assert_int_equal(t[0].shard, 1); /* b: 8 -> shard 1 (8 < 16) */
  assert_int_equal(t[3].shard, 0); /* d: 4 -> tie 16/16, lowest index */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_slice_header_matches_protobuf_c),
      cmocka_unit_test(test_decoder_reads_protobuf_c),
      cmocka_unit_test(test_decoder_rejects_garbage),
      cmocka_unit_test(test_placement_deterministic_balanced),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

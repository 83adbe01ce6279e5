/* server/call.c, the parts that need no live call: packing replies and
 * flattening received messages, where a compressed request is inflated
 * by the shard itself, never past the limit (a small bomb never costs
 * more than --max-message-bytes), and corrupt or unknown compression is
 * refused with its own code. The call life cycle itself is exercised
 * against real gRPC by the integration, interop and fuzz suites. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <zlib.h>

#include "alloc.h"
#include "error.h"
#include "factorps/v1/factorps.pb-c.h"
#include "server.h"

/* n bytes of a pattern that compresses well but is not all one byte. */
static uint8_t *pattern(size_t n) {
  uint8_t *p = malloc(n ? n : 1);
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i / 1000) ^ (i % 7));
  return p;
}

/* gzip (windowBits 31) or zlib (15) encoding of data. */
static uint8_t *compress_with(int gzip, const uint8_t *data, size_t n, size_t *out_len) {
  z_stream z;
  memset(&z, 0, sizeof z);
  assert_int_equal(deflateInit2(&z, 9, Z_DEFLATED, gzip ? 31 : 15, 8, Z_DEFAULT_STRATEGY), Z_OK);
  size_t cap = deflateBound(&z, n) + 64;
  uint8_t *out = malloc(cap);
  z.next_in = (Bytef *)data;
  z.avail_in = (uInt)n;
  z.next_out = out;
  z.avail_out = (uInt)cap;
  assert_int_equal(deflate(&z, Z_FINISH), Z_STREAM_END);
  *out_len = cap - z.avail_out;
  deflateEnd(&z);
  return out;
}

/* A received message as gRPC hands it over: `parts` slices of data, marked
 * with `alg` (GRPC_COMPRESS_NONE: plain). */
static grpc_byte_buffer *received(const uint8_t *data, size_t n, size_t parts, grpc_compression_algorithm alg) {
  grpc_slice s[8];
  assert_true(parts >= 1 && parts <= 8);
  size_t off = 0;
  for (size_t i = 0; i < parts; i++) {
    size_t len = i + 1 == parts ? n - off : n / parts;
    s[i] = grpc_slice_from_copied_buffer((const char *)data + off, len);
    off += len;
  }
  grpc_byte_buffer *bb = alg == GRPC_COMPRESS_NONE ? grpc_raw_byte_buffer_create(s, parts)
                                                   : grpc_raw_compressed_byte_buffer_create(s, parts, alg);
  for (size_t i = 0; i < parts; i++) grpc_slice_unref(s[i]);
  return bb;
}

static int setup(void **state) {
  (void)state;
  grpc_init();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  grpc_shutdown();
  return 0;
}

static void flatten_plain_within_and_past_the_limit(void **state) {
  (void)state;
  const size_t n = 100000;
  uint8_t *data = pattern(n);
  for (size_t parts = 1; parts <= 5; parts += 2) {
    grpc_byte_buffer *bb = received(data, n, parts, GRPC_COMPRESS_NONE);
    uint8_t *out = NULL;
    size_t len = 1;
    assert_int_equal(fps_bb_flatten(bb, n, &out, &len), 0);
    assert_int_equal(len, n);
    assert_memory_equal(out, data, n);
    fps_free(out);
    assert_int_equal(fps_bb_flatten(bb, n - 1, &out, &len), FPS_ELIMIT);
    assert_null(out);
    assert_int_equal(len, 0);
    grpc_byte_buffer_destroy(bb);
  }
  /* An empty message is a valid, empty request. */
  grpc_byte_buffer *empty = grpc_raw_byte_buffer_create(NULL, 0);
  uint8_t *out = NULL;
  size_t len = 1;
  assert_int_equal(fps_bb_flatten(empty, 0, &out, &len), 0);
  assert_non_null(out);
  assert_int_equal(len, 0);
  fps_free(out);
  grpc_byte_buffer_destroy(empty);
  free(data);
}

static void flatten_inflates_gzip_and_deflate(void **state) {
  (void)state;
  const size_t n = 300000; /* several of the inflater's growth steps */
  uint8_t *data = pattern(n);
  for (int gzip = 0; gzip <= 1; gzip++) {
    size_t zn;
    uint8_t *z = compress_with(gzip, data, n, &zn);
    grpc_compression_algorithm alg = gzip ? GRPC_COMPRESS_GZIP : GRPC_COMPRESS_DEFLATE;
    for (size_t parts = 1; parts <= 4; parts += 3) {
      grpc_byte_buffer *bb = received(z, zn, parts, alg);
      uint8_t *out = NULL;
      size_t len = 0;
      /* Exactly at the limit: accepted (the probe finds the stream's end). */
      assert_int_equal(fps_bb_flatten(bb, n, &out, &len), 0);
      assert_int_equal(len, n);
      assert_memory_equal(out, data, n);
      fps_free(out);
      /* One byte under it: refused, whatever the compressed size. */
      assert_int_equal(fps_bb_flatten(bb, n - 1, &out, &len), FPS_ELIMIT);
      assert_null(out);
      grpc_byte_buffer_destroy(bb);
    }
    free(z);
  }
  free(data);
}

static void a_bomb_costs_at_most_the_limit(void **state) {
  (void)state;
  /* 64 MiB of zeros gzip to about 64 KiB; with a 1 MiB limit the shard must
   * stop at 1 MiB. Counted through fps_malloc's fault-injection counters:
   * every allocation is counted, none made to fail (nth 0). */
  const size_t n = 64u << 20;
  uint8_t *zeros = calloc(1, n);
  size_t zn;
  uint8_t *z = compress_with(1, zeros, n, &zn);
  free(zeros);
  assert_true(zn < n / 100);
  grpc_byte_buffer *bb = received(z, zn, 2, GRPC_COMPRESS_GZIP);
  uint8_t *out = NULL;
  size_t len = 0;
  fps_alloc_fault_arm(0, 0);
  int rc = fps_bb_flatten(bb, 1u << 20, &out, &len);
  uint64_t calls = fps_alloc_calls();
  fps_alloc_fault_disarm();
  assert_int_equal(rc, FPS_ELIMIT);
  assert_null(out);
  /* 64 KiB doubling to the 1 MiB cap: a handful of reallocations, never
   * one per input byte or per slice of output beyond the limit. */
  assert_true(calls >= 1 && calls <= 8);
  grpc_byte_buffer_destroy(bb);
  free(z);
}

static void corrupt_truncated_and_unknown_compression(void **state) {
  (void)state;
  const size_t n = 50000;
  uint8_t *data = pattern(n);
  size_t zn;
  uint8_t *z = compress_with(1, data, n, &zn);
  uint8_t *out = NULL;
  size_t len = 0;
  /* Truncated: every cut refused as corrupt (or, cut in the header, as
   * corrupt too), never accepted short. */
  for (size_t cut = 1; cut < zn; cut += zn / 13 + 1) {
    grpc_byte_buffer *bb = received(z, cut, 1, GRPC_COMPRESS_GZIP);
    int rc = fps_bb_flatten(bb, n, &out, &len);
    if (rc != FPS_EFORMAT) fail_msg("cut at %zu of %zu: rc %d", cut, zn, rc);
    assert_null(out);
    grpc_byte_buffer_destroy(bb);
  }
  /* A flipped byte in the middle of the deflate data. */
  z[zn / 2] ^= 0x5a;
  grpc_byte_buffer *bb = received(z, zn, 1, GRPC_COMPRESS_GZIP);
  int rc = fps_bb_flatten(bb, n, &out, &len);
  assert_true(rc == FPS_EFORMAT);
  grpc_byte_buffer_destroy(bb);
  /* Plain bytes labelled deflate. */
  bb = received(data, n, 1, GRPC_COMPRESS_DEFLATE);
  assert_int_equal(fps_bb_flatten(bb, n, &out, &len), FPS_EFORMAT);
  grpc_byte_buffer_destroy(bb);
  /* A compression the shard does not know (a value past the ones gRPC
   * 1.51 defines: a newer peer's algorithm). */
  bb = received(data, 16, 1, (grpc_compression_algorithm)GRPC_COMPRESS_ALGORITHMS_COUNT);
  assert_int_equal(fps_bb_flatten(bb, n, &out, &len), FPS_EUNSUPPORTED);
  grpc_byte_buffer_destroy(bb);
  free(z);
  free(data);
}

static void flatten_out_of_memory(void **state) {
  (void)state;
  const size_t n = 200000;
  uint8_t *data = pattern(n);
  size_t zn;
  uint8_t *z = compress_with(0, data, n, &zn);
  grpc_byte_buffer *bbs[2] = {received(data, n, 3, GRPC_COMPRESS_NONE), received(z, zn, 2, GRPC_COMPRESS_DEFLATE)};
  for (int k = 0; k < 2; k++) {
    int failures = 0;
    for (uint64_t nth = 1; nth < 32; nth++) {
      uint8_t *out = NULL;
      size_t len = 0;
      fps_alloc_fault_arm(nth, 0);
      int rc = fps_bb_flatten(bbs[k], n, &out, &len);
      uint64_t failed = fps_alloc_failures();
      fps_alloc_fault_disarm();
      if (failed == 0) {
        assert_int_equal(rc, 0);
        assert_memory_equal(out, data, n);
        fps_free(out);
        break;
      }
      assert_int_equal(rc, FPS_ENOMEM);
      assert_null(out);
      failures++;
    }
    assert_true(failures >= 1);
    grpc_byte_buffer_destroy(bbs[k]);
  }
  free(z);
  free(data);
}

static void why_names_each_failure(void **state) {
  (void)state;
  assert_non_null(strstr(fps_bb_flatten_why(FPS_ELIMIT), "--max-message-bytes"));
  assert_non_null(strstr(fps_bb_flatten_why(FPS_EFORMAT), "corrupt"));
  assert_non_null(strstr(fps_bb_flatten_why(FPS_EUNSUPPORTED), "gzip, deflate"));
  assert_string_equal(fps_bb_flatten_why(FPS_ENOMEM), "out of memory");
  assert_string_equal(fps_bb_flatten_why(FPS_EPROTO), "it cannot be read");
}

static void pack_round_trips_and_respects_the_buffer(void **state) {
  (void)state;
  Factorps__V1__TensorInfo info = FACTORPS__V1__TENSOR_INFO__INIT;
  info.name = "layer/w";
  info.version = 12345;
  grpc_byte_buffer *bb = fps_pack_message(&info);
  assert_non_null(bb);
  uint8_t *flat = NULL;
  size_t len = 0;
  assert_int_equal(fps_bb_flatten(bb, 1 << 20, &flat, &len), 0);
  Factorps__V1__TensorInfo *back = factorps__v1__tensor_info__unpack(NULL, len, flat);
  assert_non_null(back);
  assert_string_equal(back->name, "layer/w");
  assert_int_equal(back->version, 12345);
  factorps__v1__tensor_info__free_unpacked(back, NULL);
  fps_free(flat);
  grpc_byte_buffer_destroy(bb);
  /* Into a caller's buffer: the slice takes it (freed with fps_free when
   * gRPC drops it); too small a buffer is NULL, and the buffer stays the
   * caller's. */
  size_t need = protobuf_c_message_get_packed_size(&info.base);
  uint8_t *small = fps_malloc(need - 1);
  assert_null(fps_pack_message_into(&info, small, need - 1));
  fps_free(small);
  uint8_t *buf = fps_malloc(need);
  bb = fps_pack_message_into(&info, buf, need);
  assert_non_null(bb);
  assert_int_equal(grpc_byte_buffer_length(bb), need);
  grpc_byte_buffer_destroy(bb);
  /* The allocation of fps_pack_message failing is NULL. */
  fps_alloc_fault_arm(1, 0);
  bb = fps_pack_message(&info);
  fps_alloc_fault_disarm();
  assert_null(bb);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(flatten_plain_within_and_past_the_limit),
      cmocka_unit_test(flatten_inflates_gzip_and_deflate),
      cmocka_unit_test(a_bomb_costs_at_most_the_limit),
      cmocka_unit_test(corrupt_truncated_and_unknown_compression),
      cmocka_unit_test(flatten_out_of_memory),
      cmocka_unit_test(why_names_each_failure),
      cmocka_unit_test(pack_round_trips_and_respects_the_buffer),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

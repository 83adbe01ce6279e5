/* server/wire_cost.c: the walker's count against what protobuf-c's unpack
 * really allocates (a counting allocator adds up glibc's chunk sizes, the
 * walker's own model, and keeps the peak of the live total). On every
 * input the count must be at least the peak; on the hostile inputs (many
 * tiny entries) it must also be close to it, so the bound refuses what
 * really costs and nothing else. Inputs: normal Creates (large values,
 * many tensors), many empty tensors or names, unknown fields, packed
 * varints, merges of a repeated singular message, every truncation and
 * byte flip of a normal request, hand-made malformed keys and lengths,
 * and random bytes against every request type. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "factorps/v1/factorps.pb-c.h"
#include "../../mocks/count_alloc.h"
#include "wire_cost.h"
#include "wire_codec.h"

/* ------------------------------------------------- the counting allocator */

/* Unpacks with the counting allocator and checks the walker's count
 * covers the peak. Returns the count; *peak the measured peak. */
static uint64_t covers(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t n, uint64_t *peak) {
  fps_count_t c = {0, 0};
  ProtobufCAllocator a = {fps_count_alloc, fps_count_free, &c};
  uint64_t cost = fps_wire_cost(d, b, n, UINT64_MAX);
  ProtobufCMessage *m = protobuf_c_message_unpack(d, &a, n, b);
  protobuf_c_message_free_unpacked(m, &a);
  assert_int_equal(c.live, 0);
  if (c.peak > cost) {
    fprintf(stderr, "%s: %zu bytes: walker %llu < peak %llu\n", d->name, n, (unsigned long long)cost,
            (unsigned long long)c.peak);
    for (size_t i = 0; i < n && i < 64; i++) fprintf(stderr, "%02x", b[i]);
    fprintf(stderr, "\n");
  }
  assert_true(c.peak <= cost);
  /* A limit stops the count past it, and only then. */
  uint64_t limits[] = {0, cost / 2, cost - (cost > 0), cost};
  for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
    uint64_t r = fps_wire_cost(d, b, n, limits[i]);
    assert_true(r <= cost);
    assert_true((r > limits[i]) == (cost > limits[i]));
  }
  if (peak) *peak = c.peak;
  return cost;
}

static uint8_t *pack(const ProtobufCMessage *m, size_t *len) {
  *len = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(*len ? *len : 1);
  assert_non_null(b);
  assert_int_equal(protobuf_c_message_pack(m, b), *len);
  return b;
}

/* n copies of the k bytes of unit, in a fresh buffer. */
static uint8_t *repeat(const uint8_t *unit, size_t k, size_t n, size_t *len) {
  *len = k * n;
  uint8_t *b = malloc(*len ? *len : 1);
  assert_non_null(b);
  for (size_t i = 0; i < n; i++) memcpy(b + i * k, unit, k);
  return b;
}

#define CREATE (&factorps__v1__create_request__descriptor)
#define PULL (&factorps__v1__pull_request__descriptor)

static const ProtobufCMessageDescriptor *const requests[] = {
    &factorps__v1__create_request__descriptor,
    &factorps__v1__pull_request__descriptor,
    &factorps__v1__get_state_request__descriptor,
    &factorps__v1__stats_request__descriptor,
    &factorps__v1__checkpoint_request__descriptor,
    &factorps__v1__exchange_request__descriptor,
    &factorps__v1__replicate_request__descriptor,
    &factorps__v1__push_pull_request__descriptor,
};
#define N_REQUESTS (sizeof requests / sizeof requests[0])

/* ------------------------------------------------------- normal requests */

/* A CreateRequest of n tensors named like a transformer's parameters,
 * shape [rows, 768], torch settings, with values of rows*768 floats when
 * with_init. */
static uint8_t *normal_create(size_t n, size_t rows, int with_init, size_t *len) {
  Factorps__V1__AdafactorConfig opt = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  opt.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  opt.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  opt.lr = 1e-3;
  opt.has_weight_decay_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_WEIGHT_DECAY_WEIGHT_DECAY;
  opt.weight_decay = 0.01;
  uint64_t shape[2] = {rows, 768};
  size_t numel = rows * 768;
  float *vals = with_init ? calloc(numel, sizeof(float)) : NULL;
  Factorps__V1__TensorSlice init = FACTORPS__V1__TENSOR_SLICE__INIT;
  Factorps__V1__TensorCreate *ts = calloc(n, sizeof *ts);
  Factorps__V1__TensorCreate **tp = calloc(n, sizeof *tp);
  char(*names)[64] = calloc(n, sizeof *names);
  assert_true(ts && tp && names && (vals || !with_init));
  for (size_t i = 0; i < n; i++) {
    Factorps__V1__TensorCreate t = FACTORPS__V1__TENSOR_CREATE__INIT;
    snprintf(names[i], sizeof names[i], "model.layers.%zu.mlp.up_proj.weight", i);
    t.name = names[i];
    t.shape = shape;
    t.n_shape = 2;
    t.optimizer = &opt;
    if (with_init) {
      init.name = names[i];
      init.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
      init.shape = shape;
      init.n_shape = 2;
      init.data.data = (uint8_t *)vals;
      init.data.len = numel * sizeof(float);
      t.init = &init;
    }
    ts[i] = t;
    tp[i] = &ts[i];
  }
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.tensors = tp;
  req.n_tensors = n;
  req.shard_count = 1;
  uint8_t *b = pack(&req.base, len);
  free(vals);
  free(ts);
  free(tp);
  free(names);
  return b;
}

static void normal_requests_decode_within_the_bound(void **state) {
  (void)state;
  size_t len;
  uint64_t peak;
  /* One tensor of 4 MiB of values: about its size. */
  uint8_t *b = normal_create(1, 1365, 1, &len);
  uint64_t cost = covers(CREATE, b, len, &peak);
  fprintf(stderr, "Create, 1 tensor, %zu bytes: walker %.3fx, protobuf-c %.3fx\n", len, (double)cost / len,
          (double)peak / len);
  assert_true(cost < len + len / 8);
  free(b);
  /* 20,000 tensors without values. */
  b = normal_create(20000, 768, 0, &len);
  cost = covers(CREATE, b, len, &peak);
  fprintf(stderr, "Create, 20000 tensors without values, %zu bytes: walker %.2fx, protobuf-c %.2fx\n", len,
          (double)cost / len, (double)peak / len);
  assert_true(cost < (uint64_t)len * FPS_WIRE_COST_RATIO / 2);
  free(b);
  /* 100 tensors of 1 row with values. */
  b = normal_create(100, 1, 1, &len);
  cost = covers(CREATE, b, len, &peak);
  fprintf(stderr, "Create, 100 tensors [1, 768], %zu bytes: walker %.2fx, protobuf-c %.2fx\n", len,
          (double)cost / len, (double)peak / len);
  assert_true(cost < (uint64_t)len * 2);
  free(b);
  /* A Pull of 20,000 such names. */
  char(*names)[64] = calloc(20000, sizeof *names);
  char **np = calloc(20000, sizeof *np);
  assert_true(names && np);
  for (size_t i = 0; i < 20000; i++) {
    snprintf(names[i], sizeof names[i], "model.layers.%zu.self_attn.q_proj.weight", i);
    np[i] = names[i];
  }
  Factorps__V1__PullRequest pr = FACTORPS__V1__PULL_REQUEST__INIT;
  pr.names = np;
  pr.n_names = 20000;
  b = pack(&pr.base, &len);
  cost = covers(PULL, b, len, &peak);
  fprintf(stderr, "Pull, 20000 names, %zu bytes: walker %.2fx, protobuf-c %.2fx\n", len, (double)cost / len,
          (double)peak / len);
  assert_true(cost < (uint64_t)len * FPS_WIRE_COST_RATIO / 2);
  free(b);
  free(names);
  free(np);
}

/* ------------------------------------------------------ hostile requests */

/* The walker's count is close to the real peak on the inputs the bound is
 * for: within 2x. */
static void close_to(uint64_t cost, uint64_t peak) { assert_true(cost <= 2 * peak); }

static void many_empty_tensors_are_counted(void **state) {
  (void)state;
  static const uint8_t empty_tensor[] = {0x0a, 0x00};
  size_t len;
  uint64_t peak;
  uint8_t *b = repeat(empty_tensor, 2, 32768, &len);
  uint64_t cost = covers(CREATE, b, len, &peak);
  fprintf(stderr, "Create of %zu empty tensors: walker %.1fx, protobuf-c %.1fx\n", len / 2, (double)cost / len,
          (double)peak / len);
  assert_true(peak > (uint64_t)len * FPS_WIRE_COST_RATIO);
  close_to(cost, peak);
  free(b);
  /* The attack at 2 MiB: counted, not decoded. */
  b = repeat(empty_tensor, 2, 1 << 20, &len);
  cost = fps_wire_cost(CREATE, b, len, UINT64_MAX);
  fprintf(stderr, "Create of 2 MiB of empty tensors: walker %.1fx (%llu bytes)\n", (double)cost / len,
          (unsigned long long)cost);
  assert_true(cost > (uint64_t)len * 100);
  /* Stopped at the bound, a quarter of the way in (the tensors' structs
   * pass it there; arrays and scan slabs are added as the walk stops). */
  uint64_t bound = (uint64_t)len * FPS_WIRE_COST_RATIO + FPS_WIRE_COST_SLACK;
  uint64_t part = fps_wire_cost(CREATE, b, len, bound);
  assert_true(part > bound);
  assert_true(part < cost / 2);
  free(b);
  /* A tensor with an empty optimizer and an empty value each. */
  static const uint8_t nested[] = {0x0a, 0x04, 0x1a, 0x00, 0x22, 0x00};
  b = repeat(nested, sizeof nested, 8192, &len);
  cost = covers(CREATE, b, len, &peak);
  assert_true(peak > (uint64_t)len * FPS_WIRE_COST_RATIO);
  close_to(cost, peak);
  free(b);
}

static void many_empty_names_are_counted(void **state) {
  (void)state;
  static const uint8_t empty_name[] = {0x0a, 0x00};
  size_t len;
  uint64_t peak;
  uint8_t *b = repeat(empty_name, 2, 65536, &len);
  uint64_t cost = covers(PULL, b, len, &peak);
  fprintf(stderr, "Pull of %zu empty names: walker %.1fx, protobuf-c %.1fx\n", len / 2, (double)cost / len,
          (double)peak / len);
  assert_true(peak > (uint64_t)len * FPS_WIRE_COST_RATIO);
  close_to(cost, peak);
  free(b);
  /* The same against GetState. */
  b = repeat(empty_name, 2, 4096, &len);
  covers(&factorps__v1__get_state_request__descriptor, b, len, &peak);
  free(b);
}

static void unknown_fields_and_packed_runs_are_counted(void **state) {
  (void)state;
  size_t len;
  uint64_t peak;
  /* Field 15, a varint 0: unknown to CreateRequest, a copy each. */
  static const uint8_t unknown[] = {0x78, 0x00};
  uint8_t *b = repeat(unknown, 2, 65536, &len);
  uint64_t cost = covers(CREATE, b, len, &peak);
  close_to(cost, peak);
  free(b);
  /* Unknown length-delimited fields of every wire type mixed. */
  static const uint8_t mixed[] = {0x7a, 0x01, 0x00, 0x79, 1, 2, 3, 4, 5, 6, 7, 8, 0x7d, 1, 2, 3, 4};
  b = repeat(mixed, sizeof mixed, 4096, &len);
  covers(CREATE, b, len, NULL);
  free(b);
  /* One tensor whose packed shape holds 65,536 one-byte dims, and a
   * SplitBlock with packed bounds and block_shards. */
  size_t dims = 65536;
  b = malloc(dims + 64);
  assert_non_null(b);
  size_t n = 0;
  b[n++] = 0x0a; /* tensors */
  size_t inner = 1 + fps_wire_varint_len(dims) + dims;
  n += fps_wire_put_varint(b + n, inner);
  b[n++] = 0x12; /* shape, packed */
  n += fps_wire_put_varint(b + n, dims);
  memset(b + n, 1, dims);
  n += dims;
  cost = covers(CREATE, b, n, &peak);
  close_to(cost, peak);
  free(b);
  /* The same dims unpacked: a key and a value each. */
  static const uint8_t dim[] = {0x10, 0x01};
  uint8_t *dimsb = repeat(dim, 2, 16384, &len);
  b = malloc(len + 16);
  assert_non_null(b);
  n = 0;
  b[n++] = 0x0a;
  n += fps_wire_put_varint(b + n, len);
  memcpy(b + n, dimsb, len);
  n += len;
  cost = covers(CREATE, b, n, &peak);
  close_to(cost, peak);
  free(b);
  free(dimsb);
}

/* A SplitBlock (no oneof, so protobuf-c merges it) given again and again
 * inside one tensor, each part with a packed run of bounds. */
static void merges_of_a_repeated_singular_message_are_counted(void **state) {
  (void)state;
  static const uint8_t part[] = {0x4a, 0x06, 0x12, 0x04, 1, 2, 3, 4};
  size_t len;
  uint64_t peak;
  uint8_t *parts = repeat(part, sizeof part, 2048, &len);
  uint8_t *b = malloc(len + 16);
  assert_non_null(b);
  size_t n = 0;
  b[n++] = 0x0a;
  n += fps_wire_put_varint(b + n, len);
  memcpy(b + n, parts, len);
  n += len;
  covers(CREATE, b, n, &peak);
  free(b);
  free(parts);
  /* An AdafactorConfig (all oneofs) and a value given twice each. */
  static const uint8_t twice[] = {0x0a, 0x0c, 0x1a, 0x02, 0x08, 0x01, 0x1a, 0x02, 0x08, 0x02, 0x22, 0x02, 0x0a, 0x00};
  covers(CREATE, twice, sizeof twice, NULL);
}

/* Every prefix of a normal request, every single-byte change of it, and
 * hand-made keys and lengths the unpacker refuses: never a read past the
 * end (ASan), always covered. */
static void truncations_and_malformed_bytes_are_safe(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = normal_create(3, 1, 1, &len);
  for (size_t n = 0; n <= len; n++) covers(CREATE, b, n, NULL);
  uint8_t *c = malloc(len);
  assert_non_null(c);
  static const uint8_t flips[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0x0a, 0x12, 0x22};
  for (size_t i = 0; i < len; i += 7)
    for (size_t f = 0; f < sizeof flips; f++) {
      memcpy(c, b, len);
      c[i] = flips[f];
      covers(CREATE, c, len, NULL);
    }
  free(c);
  free(b);
  static const struct {
    const char *what;
    uint8_t b[16];
    size_t n;
  } bad[] = {
      {"field 0", {0x00, 0x00}, 2},
      {"key of 6 bytes", {0x8a, 0x80, 0x80, 0x80, 0x80, 0x00}, 6},
      {"key of 5 bytes, huge field", {0xfa, 0xff, 0xff, 0xff, 0x7f, 0x00}, 6},
      {"varint of 11 bytes", {0x10, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}, 12},
      {"unterminated varint", {0x10, 0x80, 0x80}, 3},
      {"length past the end", {0x0a, 0x05, 0x00}, 3},
      {"length over 2^31", {0x0a, 0x80, 0x80, 0x80, 0x80, 0x08}, 6},
      {"length prefix of 6 bytes", {0x0a, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, 7},
      {"group start", {0x0b, 0x0c}, 2},
      {"wire type 7", {0x0f}, 1},
      {"fixed64 cut", {0x09, 1, 2, 3}, 4},
      {"fixed32 cut", {0x0d, 1, 2}, 3},
      {"packed fixed cut", {0x0a, 0x03, 0x12, 0x01, 0x80}, 5},
      {"string as varint", {0x0a, 0x02, 0x08, 0x01}, 4},
      {"message as fixed32", {0x0d, 1, 2, 3, 4}, 5},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    for (size_t r = 0; r < N_REQUESTS; r++) {
      /* Exactly n bytes, so ASan sees a read past them. */
      uint8_t *e = malloc(bad[i].n);
      assert_non_null(e);
      memcpy(e, bad[i].b, bad[i].n);
      covers(requests[r], e, bad[i].n, NULL);
      free(e);
    }
}

/* Random bytes, and random sequences of plausible fields, against every
 * request type. */
static void random_inputs_are_covered(void **state) {
  (void)state;
  uint64_t s = 0x9e3779b97f4a7c15ull;
#define RND() (s ^= s << 13, s ^= s >> 7, s ^= s << 17, s)
  uint8_t buf[512];
  static const uint8_t atoms[] = {0x0a, 0x00, 0x12, 0x1a, 0x22, 0x2a, 0x08, 0x10, 0x18, 0x01, 0x02, 0x03, 0x80, 0x7f, 0x4a};
  for (int it = 0; it < 40000; it++) {
    size_t n = (size_t)(RND() % sizeof buf);
    int plausible = it & 1;
    for (size_t i = 0; i < n; i++)
      buf[i] = plausible ? atoms[RND() % sizeof atoms] : (uint8_t)RND();
    uint8_t *e = malloc(n ? n : 1);
    assert_non_null(e);
    memcpy(e, buf, n);
    covers(requests[RND() % N_REQUESTS], e, n, NULL);
    free(e);
  }
#undef RND
}

static void the_chunk_model(void **state) {
  (void)state;
  assert_int_equal(fps_wire_cost_chunk(0), 32);
  assert_int_equal(fps_wire_cost_chunk(24), 32);
  assert_int_equal(fps_wire_cost_chunk(25), 48);
  assert_int_equal(fps_wire_cost_chunk(1000), 1008);
  assert_int_equal(fps_wire_cost_chunk(128 << 10), (128 << 10) + 4096);
  assert_true(fps_wire_cost_chunk(UINT64_MAX) == UINT64_MAX);
  /* Empty messages: their struct. */
  for (size_t r = 0; r < N_REQUESTS; r++)
    assert_int_equal(fps_wire_cost(requests[r], (const uint8_t *)"", 0, UINT64_MAX), fps_wire_cost_chunk(requests[r]->sizeof_message));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(normal_requests_decode_within_the_bound),
      cmocka_unit_test(many_empty_tensors_are_counted),
      cmocka_unit_test(many_empty_names_are_counted),
      cmocka_unit_test(unknown_fields_and_packed_runs_are_counted),
      cmocka_unit_test(merges_of_a_repeated_singular_message_are_counted),
      cmocka_unit_test(truncations_and_malformed_bytes_are_safe),
      cmocka_unit_test(random_inputs_are_covered),
      cmocka_unit_test(the_chunk_model),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

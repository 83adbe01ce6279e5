/* server/wire.c: the conversions and checks between the protobuf-c wire
 * types and the core's, on encodings made by protobuf-c itself and on
 * hand-made bytes protobuf-c would not produce (names with NUL, repeated
 * singular fields, truncations), plus allocation failures. */
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
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

#include "alloc.h"
#include "error.h"
#include "wire.h"

#define CREATE_DESC (&factorps__v1__create_request__descriptor)
#define PP_DESC (&factorps__v1__push_pull_request__descriptor)

/* Packs a protobuf-c message into a fresh buffer (free()). */
static uint8_t *pack(const ProtobufCMessage *m, size_t *len) {
  *len = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(*len ? *len : 1);
  assert_non_null(b);
  assert_int_equal(protobuf_c_message_pack(m, b), *len);
  return b;
}

/* A CreateRequest of one tensor `name` [2, 3] with torch settings. */
static uint8_t *create_request(const char *name, size_t *len) {
  Factorps__V1__AdafactorConfig opt = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  opt.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  opt.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  opt.lr = 0.5;
  Factorps__V1__TensorCreate t = FACTORPS__V1__TENSOR_CREATE__INIT;
  uint64_t shape[2] = {2, 3};
  t.name = (char *)name;
  t.shape = shape;
  t.n_shape = 2;
  t.optimizer = &opt;
  Factorps__V1__TensorCreate *tp = &t;
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.tensors = &tp;
  req.n_tensors = 1;
  req.shard_id = 1;
  req.shard_count = 3;
  return pack(&req.base, len);
}

static void unpack_round_trips_a_create(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = create_request("layer.0/w", &len);
  ProtobufCMessage *m = NULL;
  char why[256] = "";
  assert_int_equal(fps_wire_unpack(CREATE_DESC, b, len, 0, &m, why, sizeof why), 0);
  Factorps__V1__CreateRequest *r = (Factorps__V1__CreateRequest *)m;
  assert_int_equal(r->shard_id, 1);
  assert_int_equal(r->shard_count, 3);
  assert_int_equal(r->n_tensors, 1);
  assert_string_equal(r->tensors[0]->name, "layer.0/w");
  assert_int_equal(r->tensors[0]->n_shape, 2);
  assert_int_equal(r->tensors[0]->shape[1], 3);
  assert_true(r->tensors[0]->optimizer->lr == 0.5);
  protobuf_c_message_free_unpacked(m, &fps_wire_allocator);
  free(b);
}

static void unpack_refuses_truncations_as_malformed(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = create_request("w", &len);
  /* Every strict prefix that cuts into the nested TensorCreate is invalid
   * protobuf; none may crash, and each failure says "malformed". */
  int refused = 0;
  for (size_t n = 1; n < len; n++) {
    uint8_t *c = malloc(n);
    memcpy(c, b, n);
    ProtobufCMessage *m = (ProtobufCMessage *)1;
    char why[256] = "";
    int rc = fps_wire_unpack(CREATE_DESC, c, n, 0, &m, why, sizeof why);
    if (rc == 0) {
      protobuf_c_message_free_unpacked(m, &fps_wire_allocator);
    } else {
      assert_int_equal(rc, FPS_EPROTO);
      assert_null(m);
      assert_non_null(strstr(why, "malformed CreateRequest"));
      refused++;
    }
    free(c);
  }
  assert_true(refused > 0);
  free(b);
}

static void unpack_refuses_a_name_with_nul_or_control(void **state) {
  (void)state;
  /* protobuf-c would unpack "w\0evil" as "w": the wire check must see it. */
  const char *bad[] = {"w\0evil", "w\nx", "w\x7f"};
  const size_t bad_len[] = {6, 3, 2};
  for (size_t k = 0; k < 3; k++) {
    size_t len;
    uint8_t *b = create_request("XXXXXX", &len);
    uint8_t *p = memmem(b, len, "XXXXXX", 6);
    assert_non_null(p);
    /* Shrink the name in place: its length byte is just before it. */
    assert_int_equal(p[-1], 6);
    p[-1] = (uint8_t)bad_len[k];
    memcpy(p, bad[k], bad_len[k]);
    memmove(p + bad_len[k], p + 6, len - (size_t)(p + 6 - b));
    size_t nlen = len - (6 - bad_len[k]);
    /* The enclosing TensorCreate's length shrank too (first field, 1-byte
     * length at b[1]). */
    assert_int_equal(b[0], (1 << 3) | 2);
    b[1] = (uint8_t)(b[1] - (6 - bad_len[k]));
    ProtobufCMessage *m = NULL;
    char why[256] = "";
    assert_int_equal(fps_wire_unpack(CREATE_DESC, b, nlen, 0, &m, why, sizeof why), FPS_EINVAL);
    assert_null(m);
    assert_true(strlen(why) > 0);
    free(b);
  }
}

static void unpack_merges_a_repeated_singular_field(void **state) {
  (void)state;
  /* TensorCreate.optimizer (field 3) sent twice: flavor in the first part,
   * lr in the second. Valid protobuf (the parts merge); protobuf-c 1.4.1
   * alone refuses it when a oneof is absent from both. */
  uint8_t tc[64];
  size_t n = 0;
  tc[n++] = (1 << 3) | 2; /* name "w" */
  tc[n++] = 1;
  tc[n++] = 'w';
  tc[n++] = (2 << 3) | 2; /* shape [4] packed */
  tc[n++] = 1;
  tc[n++] = 4;
  tc[n++] = (3 << 3) | 2; /* optimizer { flavor: TORCH } */
  tc[n++] = 2;
  tc[n++] = (1 << 3) | 0;
  tc[n++] = 1;
  tc[n++] = (3 << 3) | 2; /* optimizer { lr: 0.25 } */
  tc[n++] = 9;
  tc[n++] = (2 << 3) | 1;
  double lr = 0.25;
  memcpy(tc + n, &lr, 8); /* little-endian hosts only, as the wire */
  n += 8;
  uint8_t req[80];
  size_t m = 0;
  req[m++] = (1 << 3) | 2;
  req[m++] = (uint8_t)n;
  memcpy(req + m, tc, n);
  m += n;
  ProtobufCMessage *out = NULL;
  char why[256] = "";
  assert_int_equal(fps_wire_unpack(CREATE_DESC, req, m, 0, &out, why, sizeof why), 0);
  Factorps__V1__CreateRequest *r = (Factorps__V1__CreateRequest *)out;
  assert_int_equal(r->n_tensors, 1);
  Factorps__V1__AdafactorConfig *o = r->tensors[0]->optimizer;
  assert_non_null(o);
  assert_int_equal(o->flavor, FACTORPS__V1__FLAVOR__FLAVOR_TORCH);
  assert_int_equal(o->has_lr_case, FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR);
  assert_true(o->lr == 0.25);
  protobuf_c_message_free_unpacked(out, &fps_wire_allocator);
}

/* A request whose decoded form would outgrow its bound is refused before
 * anything of it is decoded (no allocation at all), naming the type and
 * both figures; a normal one passes, unless --max-bytes is smaller. */
static void unpack_refuses_what_would_decode_too_large(void **state) {
  (void)state;
  size_t n = 32768, len = 2 * n;
  uint8_t *b = malloc(len);
  assert_non_null(b);
  for (size_t i = 0; i < n; i++) {
    b[2 * i] = 0x0a; /* an empty TensorCreate */
    b[2 * i + 1] = 0x00;
  }
  ProtobufCMessage *m = NULL;
  char why[512] = "";
  fps_alloc_fault_arm(0, 0); /* counts allocations, fails none */
  int rc = fps_wire_unpack(CREATE_DESC, b, len, UINT64_MAX, &m, why, sizeof why);
  uint64_t calls = fps_alloc_calls();
  fps_alloc_fault_disarm();
  assert_int_equal(rc, FPS_ELIMIT);
  assert_null(m);
  assert_int_equal(calls, 0);
  char want[256];
  snprintf(want, sizeof want,
           "decoding this %zu-byte CreateRequest would take more than the %llu bytes of memory allowed (16x its "
           "size + 64 KiB)",
           len, (unsigned long long)fps_wire_decode_bound(len));
  assert_non_null(strstr(why, want));
  /* Unbounded (max_bytes 0): decoded as before. */
  assert_int_equal(fps_wire_unpack(CREATE_DESC, b, len, 0, &m, why, sizeof why), 0);
  protobuf_c_message_free_unpacked(m, &fps_wire_allocator);
  free(b);
  /* A normal Create passes, and is refused by a --max-bytes below its cost. */
  b = create_request("layer.0/w", &len);
  assert_int_equal(fps_wire_unpack(CREATE_DESC, b, len, UINT64_MAX, &m, why, sizeof why), 0);
  protobuf_c_message_free_unpacked(m, &fps_wire_allocator);
  m = NULL;
  assert_int_equal(fps_wire_unpack(CREATE_DESC, b, len, 100, &m, why, sizeof why), FPS_ELIMIT);
  assert_null(m);
  assert_non_null(strstr(why, "would take more memory than --max-bytes (100)"));
  free(b);
}

static void unpack_reports_out_of_memory(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = create_request("w", &len);
  /* Fail the 1st, 2nd, ... allocation until the unpack gets through: each
   * failure is FPS_ENOMEM ("out of memory"), never "malformed". */
  int failures = 0;
  for (uint64_t nth = 1; nth < 64; nth++) {
    ProtobufCMessage *m = NULL;
    char why[256] = "";
    fps_alloc_fault_arm(nth, 0);
    int rc = fps_wire_unpack(CREATE_DESC, b, len, 0, &m, why, sizeof why);
    uint64_t failed = fps_alloc_failures();
    fps_alloc_fault_disarm();
    if (rc == 0) {
      assert_int_equal(failed, 0);
      protobuf_c_message_free_unpacked(m, &fps_wire_allocator);
      break;
    }
    assert_int_equal(rc, FPS_ENOMEM);
    assert_null(m);
    assert_non_null(strstr(why, "out of memory"));
    failures++;
  }
  assert_true(failures >= 1);
  free(b);
}

static void hparams_defaults_fields_and_refusals(void **state) {
  (void)state;
  fps_adafactor_hparams_t hp, ref;
  char why[256] = "";
  assert_int_equal(fps_wire_hparams("w", NULL, &hp, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "'w'"));

  Factorps__V1__AdafactorConfig c = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  c.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  assert_int_equal(fps_wire_hparams("w", &c, &hp, why, sizeof why), 0);
  fps_adafactor_defaults(&ref, FPS_FLAVOR_TORCH);
  assert_true(hp.eps2 == ref.eps2 && hp.decay == ref.decay && hp.clip == ref.clip);

  c.has_weight_decay_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_WEIGHT_DECAY_WEIGHT_DECAY;
  c.weight_decay = 0.125;
  assert_int_equal(fps_wire_hparams("w", &c, &hp, why, sizeof why), 0);
  assert_true(hp.weight_decay == 0.125);

  /* A setting the flavor does not have is refused, naming it. */
  c.has_beta1_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_BETA1_BETA1;
  c.beta1 = 0.9;
  assert_int_equal(fps_wire_hparams("w", &c, &hp, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "beta1"));
  c.has_beta1_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_BETA1__NOT_SET;

  Factorps__V1__AdafactorConfig h = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  h.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  h.has_maximize_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_MAXIMIZE_MAXIMIZE;
  assert_int_equal(fps_wire_hparams("w", &h, &hp, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "maximize"));

  /* An unknown flavor, and a value the kernel's validation refuses. */
  c.flavor = 7;
  assert_int_equal(fps_wire_hparams("w", &c, &hp, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "flavor 7"));
  c.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  c.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  c.lr = -1.0;
  assert_int_equal(fps_wire_hparams("w", &c, &hp, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "invalid optimizer settings"));
}

static void slice_view_points_into_the_message(void **state) {
  (void)state;
  uint64_t shape[2] = {4, 5};
  uint8_t data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT;
  s.dtype = FACTORPS__V1__DTYPE__DTYPE_BF16;
  s.shape = shape;
  s.n_shape = 2;
  s.offset = 12;
  s.data.data = data;
  s.data.len = sizeof data;
  fps_slice_t v;
  memset(&v, 0xff, sizeof v);
  fps_wire_slice_view(&s, &v);
  assert_int_equal(v.dtype, FACTORPS__V1__DTYPE__DTYPE_BF16);
  assert_ptr_equal(v.shape, shape);
  assert_int_equal(v.n_shape, 2);
  assert_int_equal(v.offset, 12);
  assert_ptr_equal(v.data, data);
  assert_int_equal(v.len, 8);
  assert_null(v.src);
}

static fps_wreader_t reader(const uint8_t *b, size_t n, fps_wspan_t *span) {
  span->p = b;
  span->n = n;
  fps_wreader_t r;
  fps_wr_init(&r, span, 1);
  return r;
}

static void check_and_header_of_a_push(void **state) {
  (void)state;
  Factorps__V1__PushPullRequest__TensorPush tp = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__INIT;
  tp.name = "emb";
  tp.has_lr_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR;
  tp.lr = 0.01;
  tp.no_grad = true;
  tp.skip_step = true;
  Factorps__V1__PushPullRequest__TensorPush *tpp = &tp;
  Factorps__V1__PushPullRequest req = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  req.worker_id = 3;
  req.step = 41;
  req.num_workers = 4;
  req.expect_mode = FACTORPS__V1__MODE__MODE_SYNC;
  req.push_id = UINT64_C(0x123456789abcdef);
  req.skip_params = true;
  req.tensors = &tpp;
  req.n_tensors = 1;
  size_t len;
  uint8_t *b = pack(&req.base, &len);
  /* The same message twice in a row: valid protobuf whose scalars are the
   * last occurrence's; change worker_id in the second copy. */
  req.worker_id = 2;
  size_t len2;
  uint8_t *b2 = pack(&req.base, &len2);
  uint8_t *both = malloc(len + len2);
  memcpy(both, b, len);
  memcpy(both + len, b2, len2);

  fps_wspan_t span;
  fps_wreader_t r = reader(b, len, &span);
  bool repeats = true;
  char why[256] = "";
  assert_int_equal(fps_wire_check(PP_DESC, &r, &repeats, why, sizeof why), 0);
  assert_false(repeats);
  fps_wire_pp_header_t h;
  assert_true(fps_wire_pp_header(&r, &h));
  assert_int_equal(h.worker_id, 3);
  assert_int_equal(h.step, 41);
  assert_int_equal(h.num_workers, 4);
  assert_int_equal(h.expect_mode, FACTORPS__V1__MODE__MODE_SYNC);
  assert_int_equal(h.push_id, UINT64_C(0x123456789abcdef));
  assert_true(h.skip_params);

  fps_wspan_t span2;
  fps_wreader_t r2 = reader(both, len + len2, &span2);
  assert_int_equal(fps_wire_check(PP_DESC, &r2, &repeats, why, sizeof why), 0);
  assert_true(fps_wire_pp_header(&r2, &h));
  assert_int_equal(h.worker_id, 2);

  /* The TensorPush: field 5 of the request. */
  fps_wreader_t w = r;
  uint32_t field;
  int wt;
  bool found = false;
  while (fps_wr_left(&w) > 0 && fps_wr_key(&w, &field, &wt)) {
    if (field == 5) {
      fps_wreader_t sub, name;
      uint64_t sublen, name_len;
      assert_true(fps_wr_sub(&w, &sub, &sublen));
      fps_push_tensor_t t;
      assert_true(fps_wire_tensor_push_parse(sub, &t, &name, &name_len));
      assert_int_equal(name_len, 3);
      uint8_t nb[3];
      assert_true(fps_wr_read(&name, nb, 3));
      assert_memory_equal(nb, "emb", 3);
      assert_true(t.has_lr && t.lr == 0.01);
      assert_false(t.has_weight_decay);
      assert_true(t.no_grad);
      assert_true(t.skip_step);
      found = true;
    } else {
      assert_true(fps_wr_skip_value(&w, wt));
    }
  }
  assert_true(found);
  free(b);
  free(b2);
  free(both);
}

static void check_refuses_malformed_and_bad_names(void **state) {
  (void)state;
  char why[256] = "";
  bool repeats;
  fps_wspan_t span;
  /* A LEN field whose length runs past the end. */
  const uint8_t cut[] = {(5 << 3) | 2, 10, (1 << 3) | 2, 1, 'w'};
  fps_wreader_t r = reader(cut, sizeof cut, &span);
  assert_int_equal(fps_wire_check(PP_DESC, &r, &repeats, why, sizeof why), FPS_EPROTO);
  assert_non_null(strstr(why, "malformed PushPullRequest"));
  fps_wire_pp_header_t h;
  /* A known field with the wrong wire type (worker_id as LEN). */
  const uint8_t wrong[] = {(1 << 3) | 2, 1, 0};
  r = reader(wrong, sizeof wrong, &span);
  assert_int_equal(fps_wire_check(PP_DESC, &r, &repeats, why, sizeof why), FPS_EPROTO);
  /* A truncated varint is no header. */
  const uint8_t trunc[] = {(2 << 3) | 0, 0x80};
  r = reader(trunc, sizeof trunc, &span);
  assert_false(fps_wire_pp_header(&r, &h));
  /* A TensorPush whose name holds a NUL: the name rule, not "malformed". */
  const uint8_t nul[] = {(5 << 3) | 2, 5, (1 << 3) | 2, 3, 'w', 0, 'x'};
  r = reader(nul, sizeof nul, &span);
  assert_int_equal(fps_wire_check(PP_DESC, &r, &repeats, why, sizeof why), FPS_EINVAL);
  /* And the empty message is a valid, empty push. */
  r = reader(cut, 0, &span);
  assert_int_equal(fps_wire_check(PP_DESC, &r, &repeats, why, sizeof why), 0);
  assert_true(fps_wire_pp_header(&r, &h));
  assert_int_equal(h.worker_id, 0);
  assert_int_equal(h.step, 0);
}

static void names_check_refuses_duplicates_and_bad_names(void **state) {
  (void)state;
  char why[256] = "";
  char *ok[] = {"a", "b", "c/d"};
  assert_int_equal(fps_wire_names_check("Pull", ok, 3, why, sizeof why), 0);
  assert_int_equal(fps_wire_names_check("Pull", ok, 0, why, sizeof why), 0);
  char *dup[] = {"x", "y", "z", "y"};
  assert_int_equal(fps_wire_names_check("Pull", dup, 4, why, sizeof why), FPS_EINVAL);
  assert_string_equal(why, "Pull: tensor 'y' is named twice");
  /* NULL counts as "", which is not a name. */
  char *null_name[] = {"a", NULL};
  assert_int_equal(fps_wire_names_check("GetState", null_name, 2, why, sizeof why), FPS_EINVAL);
  char long_name[300];
  memset(long_name, 'n', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = '\0';
  char *too_long[] = {long_name};
  assert_int_equal(fps_wire_names_check("Pull", too_long, 1, why, sizeof why), FPS_EINVAL);
  /* The sort buffer's allocation failing is FPS_ENOMEM, naming the rpc. */
  fps_alloc_fault_arm(1, 0);
  int rc = fps_wire_names_check("Pull", ok, 3, why, sizeof why);
  fps_alloc_fault_disarm();
  assert_int_equal(rc, FPS_ENOMEM);
  assert_non_null(strstr(why, "Pull: out of memory"));
}

static void bb_spans_cover_every_slice(void **state) {
  (void)state;
  grpc_init();
  /* 70 slices of 64 bytes (refcounted, so gRPC keeps them apart), more
   * than the spans array's first size. */
  enum { N = 70,
         L = 64 };
  static char text[N * L];
  grpc_slice s[N];
  for (int i = 0; i < N; i++) {
    memset(text + i * L, 'a' + i % 26, L);
    s[i] = grpc_slice_from_copied_buffer(text + i * L, L);
  }
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, N);
  fps_wspan_t *spans = NULL;
  size_t cap = 0;
  size_t n = fps_wire_bb_spans(bb, &spans, &cap);
  assert_int_equal(n, bb->data.raw.slice_buffer.count);
  assert_true(n >= 2 && cap >= n);
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    assert_true(off + spans[i].n <= sizeof text);
    assert_memory_equal(spans[i].p, text + off, spans[i].n);
    off += spans[i].n;
  }
  assert_int_equal(off, sizeof text);
  /* A second call reuses the array; growing it failing is SIZE_MAX with
   * nothing changed. */
  fps_wspan_t *kept = spans;
  assert_int_equal(fps_wire_bb_spans(bb, &spans, &cap), n);
  assert_ptr_equal(spans, kept);
  fps_wspan_t *none = NULL;
  size_t none_cap = 0;
  fps_alloc_fault_arm(1, 0);
  size_t m = fps_wire_bb_spans(bb, &none, &none_cap);
  fps_alloc_fault_disarm();
  assert_int_equal(m, SIZE_MAX);
  assert_null(none);
  assert_int_equal(none_cap, 0);
  fps_free(spans);
  grpc_byte_buffer_destroy(bb);
  for (int i = 0; i < N; i++) grpc_slice_unref(s[i]);
  grpc_shutdown();
}

/* The shard-wide decode budget: what a request reserves, when it gives it
 * back (after decoding: its received bytes; at fps_wire_request_free():
 * its decoded size), and that every refusal and failure leaves nothing
 * reserved. */
static void budget_reserves_and_releases(void **state) {
  (void)state;
  fps_decode_budget_t b = {.limit = 100};
  uint64_t others = 7;
  assert_int_equal(fps_decode_reserve(&b, 60, &others), 0);
  assert_int_equal(others, 0);
  assert_int_equal(fps_decode_reserve(&b, 41, &others), FPS_ELIMIT);
  assert_int_equal(others, 60);
  assert_int_equal(fps_decode_reserve(&b, 40, &others), 0);
  assert_int_equal(atomic_load(&b.held), 100);
  assert_int_equal(fps_decode_reserve(&b, 1, &others), FPS_ELIMIT);
  assert_int_equal(fps_decode_reserve(&b, UINT64_MAX, &others), FPS_ELIMIT);
  fps_decode_release(&b, 60);
  fps_decode_release(&b, 40);
  assert_int_equal(atomic_load(&b.held), 0);

  size_t len;
  uint8_t *buf = create_request("layer.0/w", &len);
  uint64_t cost = fps_wire_cost(CREATE_DESC, buf, len, UINT64_MAX);
  ProtobufCMessage *m = NULL;
  char why[512] = "";
  uint64_t held = 99;
  b.limit = cost + 2 * len; /* exactly room for one */
  assert_int_equal(fps_wire_unpack_held(CREATE_DESC, buf, len, UINT64_MAX, &b, &held, &m, why, sizeof why), 0);
  assert_non_null(m);
  /* The received bytes are given back after decoding; the decoded size
   * stays held until the request is freed. */
  assert_int_equal(held, cost);
  assert_int_equal(atomic_load(&b.held), cost);
  fps_wire_request_free(&b, m, held);
  assert_int_equal(atomic_load(&b.held), 0);

  /* One byte short (another call holds it): refused before decoding,
   * naming the budget, nothing reserved, nothing allocated. */
  assert_int_equal(fps_decode_reserve(&b, 1, &others), 0);
  m = NULL;
  fps_alloc_fault_arm(0, 0);
  int rc = fps_wire_unpack_held(CREATE_DESC, buf, len, UINT64_MAX, &b, &held, &m, why, sizeof why);
  uint64_t calls = fps_alloc_calls();
  fps_alloc_fault_disarm();
  assert_int_equal(rc, FPS_ELIMIT);
  assert_null(m);
  assert_int_equal(held, 0);
  assert_int_equal(calls, 0);
  assert_non_null(strstr(why, "--max-decode-bytes"));
  assert_non_null(strstr(why, "1 bytes held by other calls"));
  assert_int_equal(atomic_load(&b.held), 1);
  fps_decode_release(&b, 1);

  /* Allocation failures at every step: nothing stays reserved. */
  b.limit = UINT64_MAX / 2;
  for (uint64_t nth = 1; nth < 64; nth++) {
    m = NULL;
    fps_alloc_fault_arm(nth, 0);
    rc = fps_wire_unpack_held(CREATE_DESC, buf, len, UINT64_MAX, &b, &held, &m, why, sizeof why);
    fps_alloc_fault_disarm();
    if (rc == 0) {
      fps_wire_request_free(&b, m, held);
      assert_int_equal(atomic_load(&b.held), 0);
      break;
    }
    assert_int_equal(rc, FPS_ENOMEM);
    assert_int_equal(held, 0);
    assert_int_equal(atomic_load(&b.held), 0);
  }
  /* Malformed (every truncation) and over --max-bytes: nothing reserved. */
  for (size_t n = 0; n < len; n++) {
    m = NULL;
    rc = fps_wire_unpack_held(CREATE_DESC, buf, n, UINT64_MAX, &b, &held, &m, why, sizeof why);
    fps_wire_request_free(&b, m, held);
    assert_int_equal(atomic_load(&b.held), 0);
  }
  assert_int_equal(fps_wire_unpack_held(CREATE_DESC, buf, len, 100, &b, &held, &m, why, sizeof why), FPS_ELIMIT);
  assert_int_equal(atomic_load(&b.held), 0);
  /* A limit of 0 is no budget. */
  b.limit = 0;
  assert_int_equal(fps_wire_unpack_held(CREATE_DESC, buf, len, UINT64_MAX, &b, &held, &m, why, sizeof why), 0);
  assert_int_equal(held, 0);
  fps_wire_request_free(&b, m, held);
  assert_int_equal(atomic_load(&b.held), 0);
  free(buf);
}

/* Poller threads reserve and release at once: never more than the limit
 * held, all of it given back (run under TSan by the sanitizer build). */
#define BUDGET_THREADS 4
static fps_decode_budget_t budget_shared = {.limit = 1000};
static atomic_uint_fast64_t budget_max_seen;
static void *budget_worker(void *arg) {
  uint64_t n = (uint64_t)(uintptr_t)arg, others;
  for (int i = 0; i < 20000; i++) {
    if (fps_decode_reserve(&budget_shared, n, &others) < 0) continue;
    uint64_t now = atomic_load(&budget_shared.held);
    uint_fast64_t seen = atomic_load(&budget_max_seen);
    while (now > seen && !atomic_compare_exchange_weak(&budget_max_seen, &seen, now)) {
    }
    fps_decode_release(&budget_shared, n);
  }
  return NULL;
}

static void budget_is_shared_between_threads(void **state) {
  (void)state;
  pthread_t t[BUDGET_THREADS];
  for (uintptr_t i = 0; i < BUDGET_THREADS; i++)
    assert_int_equal(pthread_create(&t[i], NULL, budget_worker, (void *)(300 + i * 100)), 0);
  for (int i = 0; i < BUDGET_THREADS; i++) pthread_join(t[i], NULL);
  assert_int_equal(atomic_load(&budget_shared.held), 0);
  assert_true(atomic_load(&budget_max_seen) <= 1000);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(unpack_round_trips_a_create),
      cmocka_unit_test(unpack_refuses_truncations_as_malformed),
      cmocka_unit_test(unpack_refuses_a_name_with_nul_or_control),
      cmocka_unit_test(unpack_merges_a_repeated_singular_field),
      cmocka_unit_test(unpack_refuses_what_would_decode_too_large),
      cmocka_unit_test(unpack_reports_out_of_memory),
      cmocka_unit_test(budget_reserves_and_releases),
      cmocka_unit_test(budget_is_shared_between_threads),
      cmocka_unit_test(hparams_defaults_fields_and_refusals),
      cmocka_unit_test(slice_view_points_into_the_message),
      cmocka_unit_test(check_and_header_of_a_push),
      cmocka_unit_test(check_refuses_malformed_and_bad_names),
      cmocka_unit_test(names_check_refuses_duplicates_and_bad_names),
      cmocka_unit_test(bb_spans_cover_every_slice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

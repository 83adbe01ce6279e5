/* libFuzzer target: the streaming decode of PushPullRequest (server/wire.c
 * over common/wire_codec.c), fed with the message cut into arbitrary
 * buffers, against protobuf-c's unpack of the same bytes in one piece.
 *
 * Input: two bytes seeding the cut (sizes 0..16, some empty buffers, so
 * varints, keys, lengths and elements straddle buffers), then the message.
 * Oracles (each aborts):
 *   - fps_wire_check() says what fps_wire_unpack() says: the same code,
 *     and for a refusal the same message;
 *   - for an accepted message, every field the handler reads (header
 *     scalars, each TensorPush, each TensorSlice with its data reassembled
 *     from the element runs fps_welems_next() yields, f32 and bf16 element
 *     sizes both) equals protobuf-c's unpacked value. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_server.h"
#include "wire.h"

#define FZ_CHECK(c)                                                        \
  do {                                                                     \
    if (!(c)) {                                                            \
      fprintf(stderr, "fuzz_wire: %s:%d: %s\n", __FILE__, __LINE__, #c); \
      abort();                                                             \
    }                                                                      \
  } while (0)

/* Name bytes of a window, compared to a C string. */
static void fz_same_name(fps_wreader_t r, uint64_t len, const char *want) {
  want = want ? want : "";
  FZ_CHECK(len == strlen(want));
  char *got = malloc(len + 1);
  FZ_CHECK(got && fps_wr_read(&r, got, len));
  FZ_CHECK(memcmp(got, want, len) == 0);
  free(got);
}

/* The data window reassembled from element runs of esz bytes. */
static void fz_same_data(const fps_wreader_t *data, uint64_t len, size_t esz, const ProtobufCBinaryData *want) {
  FZ_CHECK(len == want->len);
  if (len % esz) return;
  fps_welems_t it;
  fps_welems_init(&it, data, esz);
  uint64_t at = 0, k;
  const uint8_t *p;
  while ((k = fps_welems_next(&it, &p)) > 0) {
    FZ_CHECK(at + k * esz <= len);
    FZ_CHECK(memcmp(p, want->data + at, k * esz) == 0);
    at += k * esz;
  }
  FZ_CHECK(at == len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  uint32_t seed = (uint32_t)data[0] << 8 | data[1];
  const uint8_t *msg = data + 2;
  size_t len = size - 2;
  const ProtobufCMessageDescriptor *desc = &factorps__v1__push_pull_request__descriptor;

  /* The message in buffers of 0..16 bytes. */
  fps_wspan_t *spans = malloc((2 * len + 2) * sizeof *spans);
  FZ_CHECK(spans);
  size_t n = 0, at = 0;
  while (at < len) {
    seed = seed * 1103515245u + 12345u;
    size_t k = (seed >> 16) % 17;
    if (k > len - at || n + 2 >= 2 * len + 2) k = len - at;
    spans[n++] = (fps_wspan_t){msg + at, k};
    at += k;
  }
  fps_wreader_t r;
  fps_wr_init(&r, spans, n);
  FZ_CHECK(fps_wr_left(&r) == len);

  char why_ref[FPS_WHY_MAX] = "", why[FPS_WHY_MAX] = "";
  ProtobufCMessage *ref = NULL;
  int rc_ref = fps_wire_unpack(desc, msg, len, 0, &ref, why_ref, sizeof why_ref);
  bool repeats = false;
  int rc = fps_wire_check(desc, &r, &repeats, why, sizeof why);
  FZ_CHECK(!repeats); /* PushPullRequest has no singular message field */
  if (rc != rc_ref || (rc < 0 && strcmp(why, why_ref) != 0)) {
    fprintf(stderr, "fuzz_wire: check %d '%s', unpack %d '%s'\n", rc, why, rc_ref, why_ref);
    abort();
  }
  if (rc == 0) {
    const Factorps__V1__PushPullRequest *m = (const Factorps__V1__PushPullRequest *)ref;
    fps_wire_pp_header_t h;
    FZ_CHECK(fps_wire_pp_header(&r, &h));
    FZ_CHECK(h.worker_id == m->worker_id && h.step == m->step && h.skip_params == m->skip_params &&
             h.num_workers == m->num_workers && h.expect_mode == (int32_t)m->expect_mode &&
             h.push_id == m->push_id);
    size_t ngrad = 0, ntp = 0;
    fps_wreader_t c = r;
    while (fps_wr_left(&c) > 0) {
      uint32_t field;
      int wt;
      FZ_CHECK(fps_wr_key(&c, &field, &wt));
      if ((field != 3 && field != 5) || wt != FPS_WT_LEN) {
        FZ_CHECK(fps_wr_skip_value(&c, wt));
        continue;
      }
      fps_wreader_t sub, name;
      uint64_t sublen, name_len;
      FZ_CHECK(fps_wr_sub(&c, &sub, &sublen));
      if (field == 5) {
        FZ_CHECK(ntp < m->n_tensors);
        const Factorps__V1__PushPullRequest__TensorPush *tp = m->tensors[ntp++];
        fps_push_tensor_t t;
        FZ_CHECK(fps_wire_tensor_push_parse(sub, &t, &name, &name_len));
        fz_same_name(name, name_len, tp->name);
        FZ_CHECK(t.has_lr == (tp->has_lr_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR));
        FZ_CHECK(!t.has_lr || memcmp(&t.lr, &tp->lr, 8) == 0);
        FZ_CHECK(t.has_weight_decay ==
                 (tp->has_weight_decay_case ==
                  FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_WEIGHT_DECAY_WEIGHT_DECAY));
        FZ_CHECK(!t.has_weight_decay || memcmp(&t.weight_decay, &tp->weight_decay, 8) == 0);
        FZ_CHECK(t.no_grad == tp->no_grad);
        FZ_CHECK(t.has_step == (tp->has_step_case == FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_STEP_STEP));
        FZ_CHECK(!t.has_step || t.step == tp->step);
      } else {
        FZ_CHECK(ngrad < m->n_grads);
        const Factorps__V1__TensorSlice *s = m->grads[ngrad++];
        fps_wire_tslice_t ts;
        FZ_CHECK(fps_wire_tslice_parse(&sub, &ts));
        fz_same_name(ts.name, ts.name_len, s->name);
        FZ_CHECK(ts.dtype == (int32_t)s->dtype && ts.offset == s->offset && ts.n_shape == s->n_shape);
        for (size_t d = 0; d < s->n_shape && d < FPS_WIRE_SHAPE_KEEP; d++) FZ_CHECK(ts.shape[d] == s->shape[d]);
        fz_same_data(&ts.data, ts.data_len, 4, &s->data);
        fz_same_data(&ts.data, ts.data_len, 2, &s->data);
      }
    }
    FZ_CHECK(ngrad == m->n_grads && ntp == m->n_tensors);
  }
  if (ref) protobuf_c_message_free_unpacked(ref, NULL);
  free(spans);
  return 0;
}

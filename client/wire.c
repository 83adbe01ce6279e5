/* Decoding of PushPullResponse and PullResponse, and encoding of a
 * PushPullRequest's TensorPush, without protobuf-c, on the wire codec the
 * shard uses too (common/wire_codec.h).
 *
 * protobuf-c's unpack would need the message flat and copy every `data`
 * field before we copy it again into the caller's tensor. Reading the two
 * small message types from the buffers gRPC received them in lets the
 * caller decode each slice's bytes straight into its own memory. Everything
 * is bounds-checked; unknown fields are skipped as protobuf requires. */
#include <stdio.h>
#include <string.h>

#include "error.h"
#include "internal.h"

/* A TensorVersion: its name (in place, or copied into name_buf when it is
 * cut between buffers) and version. */
static int parse_version(fps_wreader_t r, char *name_buf, size_t cap, const char **name, size_t *name_len,
                         uint64_t *version) {
  *name = "";
  *name_len = 0;
  *version = 0;
  while (fps_wr_left(&r) > 0) {
    uint32_t field;
    int wt;
    if (!fps_wr_key(&r, &field, &wt)) return FPS_EPROTO;
    if (field == 1 && wt == FPS_WT_LEN) {
      fps_wreader_t sub;
      uint64_t n;
      if (!fps_wr_sub(&r, &sub, &n)) return FPS_EPROTO;
      if (n > cap) {
        /* Longer than any tensor name: no tensor of ours; say so by name. */
        n = cap;
      }
      *name = (const char *)fps_wr_bytes(&sub, n, (uint8_t *)name_buf);
      *name_len = (size_t)n;
    } else if (field == 2 && wt == FPS_WT_VARINT) {
      if (!fps_wr_varint(&r, 10, version)) return FPS_EPROTO;
    } else if (!fps_wr_skip_value(&r, wt)) {
      return FPS_EPROTO;
    }
  }
  return 0;
}

int fps__wire_parse_params(const fps_wspan_t *spans, size_t nspans, const fps__wire_sink_t *sink, char *err,
                           size_t errlen) {
  fps_wreader_t c;
  fps_wr_init(&c, spans, nspans);
  uint64_t total = fps_wr_left(&c);
  while (fps_wr_left(&c) > 0) {
    uint32_t field;
    int wt, rc;
    fps_wreader_t sub;
    uint64_t n;
    if (!fps_wr_key(&c, &field, &wt)) goto malformed;
    if (field == 1 && wt == FPS_WT_LEN) {
      fps_wire_tslice_t sl;
      if (!fps_wr_sub(&c, &sub, &n) || !fps_wire_tslice_parse(&sub, &sl)) goto malformed;
      if ((rc = sink->on_slice(sink->ctx, &sl))) return rc;
    } else if (field == 2 && wt == FPS_WT_LEN) {
      char name_buf[FPS__WIRE_NAME_MAX];
      const char *name;
      size_t name_len;
      uint64_t version;
      if (!fps_wr_sub(&c, &sub, &n) ||
          parse_version(sub, name_buf, sizeof name_buf, &name, &name_len, &version) < 0)
        goto malformed;
      if ((rc = sink->on_version(sink->ctx, name, name_len, version))) return rc;
    } else if (!fps_wr_skip_value(&c, wt)) {
      goto malformed;
    }
  }
  return 0;
malformed:
  snprintf(err, errlen, "malformed reply at byte %llu of %llu",
           (unsigned long long)(total - fps_wr_left(&c)), (unsigned long long)total);
  return FPS_EPROTO;
}

/* ---- encoding ---- */

static size_t put_double_field(uint8_t *p, unsigned field, double v) {
  size_t n = fps_wire_put_varint(p, ((uint64_t)field << 3) | 1);
  memcpy(p + n, &v, 8); /* little-endian host (internal.h) */
  return n + 8;
}

size_t fps__wire_tensor_push(uint8_t *buf, unsigned field, const char *name, size_t name_len,
                             const fps_tensor_push_t *tp) {
  /* The body first, at its final place after a 10-byte-max length: write
   * it past the header's maximum, then move it down. */
  uint8_t *body = buf + 11;
  size_t b = 0;
  body[b++] = (1 << 3) | 2;
  b += fps_wire_put_varint(body + b, name_len);
  memcpy(body + b, name, name_len);
  b += name_len;
  /* oneof members: written whenever present, 0.0 included. */
  if (tp->has_lr) b += put_double_field(body + b, 2, tp->lr);
  if (tp->has_weight_decay) b += put_double_field(body + b, 3, tp->weight_decay);
  if (tp->no_grad) b += fps_wire_put_varint_field(body + b, 4, 1);
  if (tp->has_step) {
    body[b++] = 5 << 3;
    b += fps_wire_put_varint(body + b, tp->step);
  }
  if (tp->skip_step) b += fps_wire_put_varint_field(body + b, 6, 1);
  size_t n = fps_wire_put_len_field(buf, field, b);
  memmove(buf + n, body, b);
  return n + b;
}

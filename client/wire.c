/* Decoding of PushPullResponse and PullResponse, and encoding of the
 * headers of PushPullRequest slices, without protobuf-c.
 *
 * protobuf-c's unpack would copy every `data` field into a fresh buffer
 * before we copy it again into the caller's tensor. Parsing the two small
 * message types by hand lets the caller copy each slice's bytes straight
 * from the received buffer into its own memory. Everything is bounds-checked
 * against the buffer; unknown fields are skipped as protobuf requires. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct cursor_s {
  const uint8_t *p, *end;
} cursor_t;

static int read_varint(cursor_t *c, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (c->p >= c->end) return -1;
    uint8_t b = *c->p++;
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return 0;
    }
  }
  return -1;
}

/* Reads a length-delimited payload. */
static int read_bytes(cursor_t *c, const uint8_t **data, size_t *len) {
  uint64_t n;
  if (read_varint(c, &n) || n > (uint64_t)(c->end - c->p)) return -1;
  *data = c->p;
  *len = (size_t)n;
  c->p += n;
  return 0;
}

static int skip_field(cursor_t *c, unsigned wire_type) {
  uint64_t v;
  const uint8_t *d;
  size_t n;
  switch (wire_type) {
    case 0: return read_varint(c, &v);
    case 1:
      if (c->end - c->p < 8) return -1;
      c->p += 8;
      return 0;
    case 2: return read_bytes(c, &d, &n);
    case 5:
      if (c->end - c->p < 4) return -1;
      c->p += 4;
      return 0;
    default: return -1; /* groups are not proto3 */
  }
}

static int add_dim(fps__wire_slice_t *sl, uint64_t d) {
  if (sl->ndim >= FPS_CLIENT_MAX_DIMS) {
    sl->shape_overflow = 1;
    return 0;
  }
  sl->shape[sl->ndim++] = d;
  return 0;
}

static int parse_slice(const uint8_t *buf, size_t len, fps__wire_slice_t *sl) {
  cursor_t c = {buf, buf + len};
  memset(sl, 0, sizeof *sl);
  while (c.p < c.end) {
    uint64_t key, v;
    if (read_varint(&c, &key)) return -1;
    unsigned field = (unsigned)(key >> 3), wt = (unsigned)(key & 7);
    if (field == 1 && wt == 2) {
      const uint8_t *d;
      if (read_bytes(&c, &d, &sl->name_len)) return -1;
      sl->name = (const char *)d;
    } else if (field == 2 && wt == 0) {
      if (read_varint(&c, &v)) return -1;
      sl->dtype = (int)v;
    } else if (field == 3 && wt == 2) { /* packed shape */
      const uint8_t *d;
      size_t n;
      if (read_bytes(&c, &d, &n)) return -1;
      cursor_t pc = {d, d + n};
      while (pc.p < pc.end) {
        if (read_varint(&pc, &v)) return -1;
        add_dim(sl, v);
      }
    } else if (field == 3 && wt == 0) { /* unpacked shape */
      if (read_varint(&c, &v)) return -1;
      add_dim(sl, v);
    } else if (field == 4 && wt == 0) {
      if (read_varint(&c, &sl->offset)) return -1;
    } else if (field == 5 && wt == 2) {
      if (read_bytes(&c, &sl->data, &sl->data_len)) return -1;
    } else if (skip_field(&c, wt)) {
      return -1;
    }
  }
  return 0;
}

static int parse_version(const uint8_t *buf, size_t len, const char **name, size_t *name_len,
                         uint64_t *version) {
  cursor_t c = {buf, buf + len};
  *name = "";
  *name_len = 0;
  *version = 0;
  while (c.p < c.end) {
    uint64_t key;
    if (read_varint(&c, &key)) return -1;
    unsigned field = (unsigned)(key >> 3), wt = (unsigned)(key & 7);
    if (field == 1 && wt == 2) {
      const uint8_t *d;
      if (read_bytes(&c, &d, name_len)) return -1;
      *name = (const char *)d;
    } else if (field == 2 && wt == 0) {
      if (read_varint(&c, version)) return -1;
    } else if (skip_field(&c, wt)) {
      return -1;
    }
  }
  return 0;
}

int fps__wire_parse_params(const uint8_t *buf, size_t len, const fps__wire_sink_t *sink, char *err,
                           size_t errlen) {
  cursor_t c = {buf, buf + len};
  while (c.p < c.end) {
    uint64_t key;
    const uint8_t *d;
    size_t n;
    int rc;
    if (read_varint(&c, &key)) goto malformed;
    unsigned field = (unsigned)(key >> 3), wt = (unsigned)(key & 7);
    if (field == 1 && wt == 2) {
      fps__wire_slice_t sl;
      if (read_bytes(&c, &d, &n) || parse_slice(d, n, &sl)) goto malformed;
      if ((rc = sink->on_slice(sink->ctx, &sl))) return rc;
    } else if (field == 2 && wt == 2) {
      const char *name;
      size_t name_len;
      uint64_t version;
      if (read_bytes(&c, &d, &n) || parse_version(d, n, &name, &name_len, &version))
        goto malformed;
      if ((rc = sink->on_version(sink->ctx, name, name_len, version))) return rc;
    } else if (skip_field(&c, wt)) {
      goto malformed;
    }
  }
  return 0;
malformed:
  snprintf(err, errlen, "malformed reply at byte %zu of %zu", (size_t)(c.p - buf), len);
  return -1;
}

/* ---- encoding ---- */

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

static size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

size_t fps__wire_put_varint_field(uint8_t *buf, unsigned field, uint64_t v) {
  size_t n = put_varint(buf, (uint64_t)field << 3);
  return n + put_varint(buf + n, v);
}

static size_t put_double_field(uint8_t *p, unsigned field, double v) {
  size_t n = put_varint(p, ((uint64_t)field << 3) | 1);
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
  b += put_varint(body + b, name_len);
  memcpy(body + b, name, name_len);
  b += name_len;
  /* oneof members: written whenever present, 0.0 included. */
  if (tp->has_lr) b += put_double_field(body + b, 2, tp->lr);
  if (tp->has_weight_decay) b += put_double_field(body + b, 3, tp->weight_decay);
  if (tp->no_grad) b += fps__wire_put_varint_field(body + b, 4, 1);
  if (tp->has_step) {
    body[b++] = 5 << 3;
    b += put_varint(body + b, tp->step);
  }
  size_t n = put_varint(buf, ((uint64_t)field << 3) | 2);
  n += put_varint(buf + n, b);
  memmove(buf + n, body, b);
  return n + b;
}

size_t fps__wire_slice_header(uint8_t *buf, unsigned field, const char *name, size_t name_len,
                              int dtype, uint32_t ndim, const uint64_t *shape, uint64_t offset,
                              size_t data_len) {
  size_t shape_bytes = 0;
  for (uint32_t d = 0; d < ndim; d++) shape_bytes += varint_len(shape[d]);
  /* The slice's own length: every field below plus the data. */
  size_t body = 1 + varint_len(name_len) + name_len   /* 1: name */
                + 2                                    /* 2: dtype (< 128) */
                + (ndim ? 1 + varint_len(shape_bytes) + shape_bytes : 0) /* 3: shape */
                + 1 + varint_len(offset)               /* 4: offset */
                + 1 + varint_len(data_len) + data_len; /* 5: data */
  size_t n = 0;
  n += put_varint(buf + n, ((uint64_t)field << 3) | 2);
  n += put_varint(buf + n, body);
  buf[n++] = (1 << 3) | 2;
  n += put_varint(buf + n, name_len);
  memcpy(buf + n, name, name_len);
  n += name_len;
  buf[n++] = 2 << 3;
  buf[n++] = (uint8_t)dtype;
  if (ndim) {
    buf[n++] = (3 << 3) | 2;
    n += put_varint(buf + n, shape_bytes);
    for (uint32_t d = 0; d < ndim; d++) n += put_varint(buf + n, shape[d]);
  }
  buf[n++] = 4 << 3;
  n += put_varint(buf + n, offset);
  buf[n++] = (5 << 3) | 2;
  n += put_varint(buf + n, data_len);
  return n;
}

/* Decoding of PushPullResponse and PullResponse without protobuf-c.
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

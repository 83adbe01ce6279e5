/* The data path's protobuf codec over several buffers (see wire_codec.h). */
#include <string.h>

#include "wire_codec.h"

/* Moves past spans the cursor has used up (and empty ones), so that a
 * cursor with bytes left always points at a byte. */
static void fps__wr_norm(fps_wreader_t *r) {
  while (r->i < r->nspan && r->off >= r->span[r->i].n) {
    r->i++;
    r->off = 0;
  }
}

void fps_wr_init(fps_wreader_t *r, const fps_wspan_t *span, size_t n) {
  r->span = span;
  r->nspan = n;
  r->i = 0;
  r->off = 0;
  r->left = 0;
  for (size_t k = 0; k < n; k++) r->left += span[k].n;
  fps__wr_norm(r);
}

size_t fps_wr_peek(const fps_wreader_t *r, const uint8_t **p) {
  if (r->left == 0 || r->i >= r->nspan) return 0;
  size_t n = r->span[r->i].n - r->off;
  *p = r->span[r->i].p + r->off;
  return n < r->left ? n : (size_t)r->left;
}

bool fps_wr_skip(fps_wreader_t *r, uint64_t n) {
  if (n > r->left) return false;
  r->left -= n;
  while (n > 0) {
    size_t here = r->span[r->i].n - r->off;
    if (n < here) {
      r->off += (size_t)n;
      break;
    }
    n -= here;
    r->i++;
    r->off = 0;
    fps__wr_norm(r);
  }
  fps__wr_norm(r);
  return true;
}

bool fps_wr_read(fps_wreader_t *r, void *dst, uint64_t n) {
  if (n > r->left) return false;
  uint8_t *o = dst;
  while (n > 0) {
    const uint8_t *p;
    size_t here = fps_wr_peek(r, &p);
    size_t k = n < here ? (size_t)n : here;
    memcpy(o, p, k);
    o += k;
    n -= k;
    fps_wr_skip(r, k);
  }
  return true;
}

bool fps_wr_double(fps_wreader_t *r, double *d) {
  uint8_t b[8];
  if (!fps_wr_read(r, b, 8)) return false;
  uint64_t u = 0;
  for (int k = 7; k >= 0; k--) u = u << 8 | b[k];
  memcpy(d, &u, 8);
  return true;
}

const uint8_t *fps_wr_bytes(fps_wreader_t *r, uint64_t n, uint8_t *buf) {
  if (n > r->left) return NULL;
  const uint8_t *p = NULL;
  size_t here = fps_wr_peek(r, &p);
  if (n <= here) {
    if (n) fps_wr_skip(r, n);
    return n ? p : buf;
  }
  fps_wr_read(r, buf, n);
  return buf;
}

bool fps_wr_varint(fps_wreader_t *r, int max_bytes, uint64_t *v) {
  uint64_t x = 0;
  const uint8_t *p;
  size_t here = fps_wr_peek(r, &p);
  /* The common case: the whole varint in this span. */
  for (int k = 0; k < max_bytes && (size_t)k < here; k++) {
    uint8_t b = p[k];
    if (k < 10) x |= (uint64_t)(b & 0x7f) << (7 * k);
    if (!(b & 0x80)) {
      fps_wr_skip(r, (uint64_t)k + 1);
      *v = x;
      return true;
    }
  }
  /* Cut between spans (or malformed): byte by byte. */
  fps_wreader_t c = *r;
  x = 0;
  for (int k = 0; k < max_bytes; k++) {
    uint8_t b;
    if (!fps_wr_read(&c, &b, 1)) return false;
    x |= (uint64_t)(b & 0x7f) << (7 * k);
    if (!(b & 0x80)) {
      *r = c;
      *v = x;
      return true;
    }
  }
  return false;
}

bool fps_wr_key(fps_wreader_t *r, uint32_t *field, int *wt) {
  const uint8_t *p;
  /* protobuf-c refuses a key whose one byte says field 0; a longer key
   * that spells 0 is an unknown field to it, and to us. */
  if (fps_wr_peek(r, &p) == 0 || (p[0] & 0xf8) == 0) return false;
  uint64_t key;
  if (!fps_wr_varint(r, 5, &key)) return false;
  *field = (uint32_t)(key >> 3);
  *wt = (int)(key & 7);
  return *wt == FPS_WT_VARINT || *wt == FPS_WT_I64 || *wt == FPS_WT_LEN || *wt == FPS_WT_I32;
}

bool fps_wr_sub(fps_wreader_t *r, fps_wreader_t *sub, uint64_t *len) {
  uint64_t n;
  if (!fps_wr_varint(r, 5, &n) || n > r->left) return false;
  *sub = *r;
  sub->left = n;
  fps_wr_skip(r, n);
  *len = n;
  return true;
}

bool fps_wr_skip_value(fps_wreader_t *r, int wt) {
  uint64_t v;
  fps_wreader_t sub;
  switch (wt) {
    case FPS_WT_VARINT: return fps_wr_varint(r, 10, &v);
    case FPS_WT_I64: return fps_wr_skip(r, 8);
    case FPS_WT_I32: return fps_wr_skip(r, 4);
    case FPS_WT_LEN: return fps_wr_sub(r, &sub, &v);
    default: return false;
  }
}

void fps_welems_init(fps_welems_t *it, const fps_wreader_t *data, size_t esz) {
  it->r = *data;
  it->esz = esz;
}

uint64_t fps_welems_next(fps_welems_t *it, const uint8_t **p) {
  size_t here = fps_wr_peek(&it->r, p);
  if (here == 0) return 0;
  if (here >= it->esz) {
    uint64_t k = here / it->esz;
    fps_wr_skip(&it->r, k * it->esz);
    return k;
  }
  /* One element cut between two spans. */
  if (!fps_wr_read(&it->r, it->bounce, it->esz)) return 0;
  *p = it->bounce;
  return 1;
}

/* ------------------------------------------------------- TensorSlice */

static void fps__tslice_dim(fps_wire_tslice_t *s, uint64_t d) {
  if (s->n_shape < FPS_WIRE_SHAPE_KEEP) s->shape[s->n_shape] = d;
  s->n_shape++;
}

bool fps_wire_tslice_parse(fps_wreader_t *r, fps_wire_tslice_t *s) {
  s->name = *r;
  s->name.left = 0;
  s->name_len = 0;
  s->dtype = 0;
  s->n_shape = 0;
  s->offset = 0;
  s->data = *r;
  s->data.left = 0;
  s->data_len = 0;
  uint32_t field;
  int wt;
  while (r->left > 0) {
    uint64_t v, n;
    fps_wreader_t sub;
    if (!fps_wr_key(r, &field, &wt)) return false;
    switch (field) {
      case 1: /* name */
        if (wt != FPS_WT_LEN || !fps_wr_sub(r, &s->name, &s->name_len)) return false;
        break;
      case 2: /* dtype (enum: int32) */
        if (wt != FPS_WT_VARINT || !fps_wr_varint(r, 10, &v)) return false;
        s->dtype = (int32_t)(uint32_t)v;
        break;
      case 3: /* shape: packed or one value per field */
        if (wt == FPS_WT_VARINT) {
          if (!fps_wr_varint(r, 10, &v)) return false;
          fps__tslice_dim(s, v);
        } else if (wt == FPS_WT_LEN) {
          if (!fps_wr_sub(r, &sub, &n)) return false;
          while (sub.left > 0) {
            if (!fps_wr_varint(&sub, 10, &v)) return false;
            fps__tslice_dim(s, v);
          }
        } else {
          return false;
        }
        break;
      case 4: /* offset */
        if (wt != FPS_WT_VARINT || !fps_wr_varint(r, 10, &s->offset)) return false;
        break;
      case 5: /* data */
        if (wt != FPS_WT_LEN || !fps_wr_sub(r, &s->data, &s->data_len)) return false;
        break;
      default:
        if (!fps_wr_skip_value(r, wt)) return false;
    }
  }
  return true;
}

/* ----------------------------------------------------------- encoding */

size_t fps_wire_put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

size_t fps_wire_varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

size_t fps_wire_put_varint_field(uint8_t *buf, unsigned field, uint64_t v) {
  size_t n = fps_wire_put_varint(buf, (uint64_t)field << 3);
  return n + fps_wire_put_varint(buf + n, v);
}

size_t fps_wire_put_len_field(uint8_t *buf, unsigned field, uint64_t len) {
  size_t n = fps_wire_put_varint(buf, ((uint64_t)field << 3) | FPS_WT_LEN);
  return n + fps_wire_put_varint(buf + n, len);
}

size_t fps_wire_slice_header(uint8_t *buf, unsigned field, const char *name, size_t name_len, int dtype,
                             uint32_t ndim, const uint64_t *shape, uint64_t offset, size_t data_len) {
  size_t shape_bytes = 0;
  for (uint32_t d = 0; d < ndim; d++) shape_bytes += fps_wire_varint_len(shape[d]);
  /* The slice's own length: every field below plus the data. */
  size_t body = 1 + fps_wire_varint_len(name_len) + name_len                     /* 1: name */
                + 2                                                               /* 2: dtype */
                + (ndim ? 1 + fps_wire_varint_len(shape_bytes) + shape_bytes : 0) /* 3: shape */
                + 1 + fps_wire_varint_len(offset)                                 /* 4: offset */
                + 1 + fps_wire_varint_len(data_len) + data_len;                   /* 5: data */
  size_t n = fps_wire_put_len_field(buf, field, body);
  n += fps_wire_put_len_field(buf + n, 1, name_len);
  memcpy(buf + n, name, name_len);
  n += name_len;
  buf[n++] = 2 << 3;
  buf[n++] = (uint8_t)dtype;
  if (ndim) {
    n += fps_wire_put_len_field(buf + n, 3, shape_bytes);
    for (uint32_t d = 0; d < ndim; d++) n += fps_wire_put_varint(buf + n, shape[d]);
  }
  n += fps_wire_put_varint_field(buf + n, 4, offset);
  n += fps_wire_put_len_field(buf + n, 5, data_len);
  return n;
}

size_t fps_wire_version(uint8_t *buf, unsigned field, const char *name, size_t name_len, uint64_t version) {
  size_t body = 1 + fps_wire_varint_len(name_len) + name_len + (version ? 1 + fps_wire_varint_len(version) : 0);
  size_t n = fps_wire_put_len_field(buf, field, body);
  n += fps_wire_put_len_field(buf + n, 1, name_len);
  memcpy(buf + n, name, name_len);
  n += name_len;
  if (version) n += fps_wire_put_varint_field(buf + n, 2, version);
  return n;
}

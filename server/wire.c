/* Wire-to-core conversion shared by the handlers (see wire.h): protobuf-c
 * types to the core's, and the checks only the wire bytes allow. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "name.h"
#include "wire.h"

int fps_wire_hparams(const char *name, const Factorps__V1__AdafactorConfig *c, fps_adafactor_hparams_t *hp,
                     char *why, size_t why_len) {
  if (!c) {
    snprintf(why, why_len, "tensor '%s': optimizer settings are missing", name);
    return FPS_EINVAL;
  }
  if (c->flavor != FACTORPS__V1__FLAVOR__FLAVOR_TORCH && c->flavor != FACTORPS__V1__FLAVOR__FLAVOR_HF) {
    snprintf(why, why_len, "tensor '%s': optimizer flavor %d is not torch (1) or hf (2)", name, (int)c->flavor);
    return FPS_EINVAL;
  }
  bool torch = c->flavor == FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  const char *lacks = NULL;
  if (torch) {
    if (c->has_relative_step_case) lacks = "relative_step";
    else if (c->has_scale_parameter_case) lacks = "scale_parameter";
    else if (c->has_warmup_init_case) lacks = "warmup_init";
    else if (c->has_beta1_case) lacks = "beta1";
  } else if (c->has_maximize_case) {
    lacks = "maximize";
  }
  if (lacks) {
    snprintf(why, why_len, "tensor '%s': flavor %s has no setting '%s' (leave it absent)", name,
             torch ? "torch" : "hf", lacks);
    return FPS_EINVAL;
  }
  fps_adafactor_defaults(hp, torch ? FPS_FLAVOR_TORCH : FPS_FLAVOR_HF);
  if (c->has_lr_case) {
    hp->has_lr = true;
    hp->lr = c->lr;
  }
  if (c->has_beta2_decay_case) hp->decay = c->beta2_decay;
  if (c->has_eps1_case) hp->eps1 = c->eps1;
  if (c->has_eps2_case) hp->eps2 = c->eps2;
  if (c->has_clip_threshold_case) hp->clip = c->clip_threshold;
  if (c->has_weight_decay_case) hp->weight_decay = c->weight_decay;
  if (c->has_maximize_case) hp->maximize = c->maximize;
  if (c->has_relative_step_case) hp->relative_step = c->relative_step;
  if (c->has_scale_parameter_case) hp->scale_parameter = c->scale_parameter;
  if (c->has_warmup_init_case) hp->warmup_init = c->warmup_init;
  if (c->has_beta1_case) {
    hp->has_beta1 = true;
    hp->beta1 = c->beta1;
  }
  char kwhy[256] = "";
  if (fps_adafactor_validate(hp, kwhy, sizeof kwhy) < 0) {
    snprintf(why, why_len, "tensor '%s': invalid optimizer settings: %s", name, kwhy);
    return FPS_EINVAL;
  }
  return 0;
}

void fps_wire_slice_view(const Factorps__V1__TensorSlice *s, fps_slice_t *out) {
  out->dtype = (int)s->dtype;
  out->shape = s->shape;
  out->n_shape = s->n_shape;
  out->offset = s->offset;
  out->data = s->data.data;
  out->len = s->data.len;
}

/* ------------------------------------------- the wire, before unpacking
 *
 * Two things protobuf-c's unpacker cannot do for us:
 *  - its strings are C strings, so a name's length on the wire is lost and
 *    "w\0evil" would unpack as "w": every string field (all of them are
 *    tensor names in requests) is checked here, on the wire bytes;
 *  - it merges a singular message field that occurs twice (valid protobuf:
 *    the parts merge), but protobuf-c 1.4.1's merge_messages() fails when a
 *    oneof is absent from both parts (AdafactorConfig's fields are all
 *    oneofs), so a valid request was refused as malformed. Merging two
 *    encodings equals parsing their concatenation, so when such a repeat
 *    exists the message is rewritten with each repeated field's parts
 *    concatenated into one occurrence, and protobuf-c never merges.
 * Anything malformed is left to protobuf-c, which refuses it. */

#define FPS__WIRE_DEPTH 32

typedef struct fps_wfield_s {
  uint32_t num;
  int wt;
  const uint8_t *start;   /* the key */
  const uint8_t *payload; /* after the key (and the length for wt 2) */
  uint64_t len;           /* payload bytes (wt 2) */
  const uint8_t *end;     /* after the field */
} fps_wfield_t;

static bool fps__wire_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    uint8_t b = *(*p)++;
    x |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *v = x;
      return true;
    }
  }
  return false;
}

/* Next field at *p; false at the end or on anything malformed. */
static bool fps__wire_next(const uint8_t **p, const uint8_t *end, fps_wfield_t *f) {
  if (*p >= end) return false;
  f->start = *p;
  uint64_t key, v;
  if (!fps__wire_varint(p, end, &key)) return false;
  f->num = (uint32_t)(key >> 3);
  f->wt = (int)(key & 7);
  f->len = 0;
  switch (f->wt) {
    case 0:
      if (!fps__wire_varint(p, end, &v)) return false;
      break;
    case 1:
      if ((size_t)(end - *p) < 8) return false;
      *p += 8;
      break;
    case 5:
      if ((size_t)(end - *p) < 4) return false;
      *p += 4;
      break;
    case 2:
      if (!fps__wire_varint(p, end, &f->len) || f->len > (uint64_t)(end - *p)) return false;
      f->payload = *p;
      *p += f->len;
      break;
    default:
      return false; /* groups and junk: protobuf-c decides */
  }
  if (f->wt != 2) f->payload = f->start;
  f->end = *p;
  return true;
}

static bool fps__wire_nested(const ProtobufCFieldDescriptor *fd, const fps_wfield_t *f) {
  return fd && f->wt == 2 && fd->type == PROTOBUF_C_TYPE_MESSAGE;
}

/* Checks the strings of one message (recursively) and finds repeats of a
 * singular message field. Returns 0 or FPS_EINVAL with why filled. */
static int fps__wire_walk(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, int depth,
                                       bool *repeats, char *why, size_t wl) {
  const uint8_t *end = p + n;
  uint64_t seen = 0; /* singular message fields met, by index (< 64) */
  fps_wfield_t f;
  while (fps__wire_next(&p, end, &f)) {
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, f.num);
    if (!fd || f.wt != 2) continue;
    if (fd->type == PROTOBUF_C_TYPE_STRING && f.len > 0) {
      const char *s = (const char *)f.payload;
      bool bad = memchr(s, '\0', f.len) != NULL || !fps_utf8_valid(s, f.len);
      for (size_t i = 0; !bad && i < f.len; i++) bad = (unsigned char)s[i] < 0x20 || s[i] == 0x7f;
      if (bad && fps_name_check(s, f.len, why, wl) < 0) return FPS_EINVAL;
    } else if (fps__wire_nested(fd, &f) && depth < FPS__WIRE_DEPTH) {
      size_t idx = (size_t)(fd - d->fields);
      if (fd->label != PROTOBUF_C_LABEL_REPEATED && idx < 64) {
        if (seen & (UINT64_C(1) << idx)) *repeats = true;
        seen |= UINT64_C(1) << idx;
      }
      int c = fps__wire_walk(fd->descriptor, f.payload, f.len, depth + 1, repeats, why, wl);
      if (c < 0) return c;
    }
  }
  return 0;
}

static size_t fps__wire_put_varint(uint8_t *o, uint64_t v) {
  size_t n = 0;
  do {
    o[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

/* Writes the canonical form of one message to out (at most n bytes, which
 * is enough: concatenating parts never lengthens them). Returns the bytes
 * written, or -1 on OOM. */
static ptrdiff_t fps__wire_merge(const ProtobufCMessageDescriptor *d, const uint8_t *in, size_t n, int depth,
                                 uint8_t *out) {
  const uint8_t *p = in, *end = in + n;
  uint8_t *o = out;
  uint64_t done = 0; /* singular message fields written, by index (< 64) */
  fps_wfield_t f;
  while (fps__wire_next(&p, end, &f)) {
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, f.num);
    if (!fps__wire_nested(fd, &f) || depth >= FPS__WIRE_DEPTH) {
      memcpy(o, f.start, (size_t)(f.end - f.start));
      o += f.end - f.start;
      continue;
    }
    size_t idx = (size_t)(fd - d->fields);
    bool singular = fd->label != PROTOBUF_C_LABEL_REPEATED && idx < 64;
    if (singular) {
      /* Only the first occurrence is written, carrying every part. */
      if (done & (UINT64_C(1) << idx)) continue;
      done |= UINT64_C(1) << idx;
    }
    size_t total = f.len;
    if (singular) {
      const uint8_t *q = f.end;
      fps_wfield_t g;
      while (fps__wire_next(&q, end, &g))
        if (g.num == f.num && g.wt == 2) total += g.len;
    }
    uint8_t *cat = fps_malloc(total ? total : 1);
    uint8_t *canon = fps_malloc(total ? total : 1);
    if (!cat || !canon) {
      fps_free(cat);
      fps_free(canon);
      return -1;
    }
    memcpy(cat, f.payload, f.len);
    size_t off = f.len;
    if (singular) {
      const uint8_t *q = f.end;
      fps_wfield_t g;
      while (fps__wire_next(&q, end, &g))
        if (g.num == f.num && g.wt == 2) {
          memcpy(cat + off, g.payload, g.len);
          off += g.len;
        }
    }
    ptrdiff_t m = fps__wire_merge(fd->descriptor, cat, total, depth + 1, canon);
    fps_free(cat);
    if (m < 0) {
      fps_free(canon);
      return -1;
    }
    o += fps__wire_put_varint(o, ((uint64_t)f.num << 3) | 2);
    o += fps__wire_put_varint(o, (uint64_t)m);
    memcpy(o, canon, (size_t)m);
    o += m;
    fps_free(canon);
  }
  /* A malformed tail stays as it was, for protobuf-c to refuse. */
  memcpy(o, p, (size_t)(end - p));
  o += end - p;
  return o - out;
}

static void *fps__wire_alloc(void *data, size_t size) {
  (void)data;
  return fps_malloc(size);
}

static void fps__wire_free(void *data, void *p) {
  (void)data;
  fps_free(p);
}

ProtobufCAllocator fps_wire_allocator = {fps__wire_alloc, fps__wire_free, NULL};

int fps_wire_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, ProtobufCMessage **out,
                    char *why, size_t wl) {
  *out = NULL;
  bool repeats = false;
  int code = fps__wire_walk(desc, buf, len, 0, &repeats, why, wl);
  if (code < 0) return code;
  uint8_t *canon = NULL;
  if (repeats) {
    canon = fps_malloc(len ? len : 1);
    ptrdiff_t m = canon ? fps__wire_merge(desc, buf, len, 0, canon) : -1;
    if (m < 0) {
      fps_free(canon);
      snprintf(why, wl, "%s: out of memory merging a %zu-byte message", desc->short_name, len);
      return FPS_ENOMEM;
    }
    buf = canon;
    len = (size_t)m;
  }
  *out = protobuf_c_message_unpack(desc, &fps_wire_allocator, len, buf);
  fps_free(canon);
  if (!*out) {
    snprintf(why, wl, "malformed %s (%zu bytes)", desc->short_name, len);
    return FPS_EPROTO;
  }
  return 0;
}

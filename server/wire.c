/* Wire-to-core conversion shared by the handlers (see wire.h): protobuf-c
 * types to the core's, and the checks only the wire bytes allow. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "alloc.h"
#include "name.h"
#include "wire.h"
#include "wire_cost.h"

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
  out->src = NULL;
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
    o += fps_wire_put_len_field(o, f.num, (uint64_t)m);
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

/* The unpacker's allocator that remembers a failure (*data = true):
 * protobuf-c answers NULL for a malformed message and for a failed
 * allocation alike, and only the second is RESOURCE_EXHAUSTED. */
static void *fps__wire_alloc_noting(void *data, size_t size) {
  void *p = fps_malloc(size);
  if (!p) *(bool *)data = true;
  return p;
}

/* Refuses (FPS_ELIMIT) a message whose decoded form would pass the bound
 * of its received size or max_bytes; the count stops there, so a hostile
 * request costs the walk of its first part only. */
static int fps__wire_admit(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, size_t received,
                           uint64_t max_bytes, uint64_t *cost, char *why, size_t wl) {
  uint64_t bound = fps_wire_decode_bound(received);
  uint64_t limit = bound < max_bytes ? bound : max_bytes;
  *cost = fps_wire_cost(desc, buf, len, limit);
  if (*cost <= limit) return 0;
  if (limit == bound)
    snprintf(why, wl,
             "decoding this %zu-byte %s would take more than the %" PRIu64
             " bytes of memory allowed (%dx its size + %" PRIu64 " KiB): too many small entries",
             received, desc->short_name, bound, FPS_WIRE_COST_RATIO, FPS_WIRE_COST_SLACK >> 10);
  else
    snprintf(why, wl, "decoding this %zu-byte %s would take more memory than --max-bytes (%" PRIu64 ")", received,
             desc->short_name, max_bytes);
  return FPS_ELIMIT;
}

int fps_decode_reserve(fps_decode_budget_t *b, uint64_t n, uint64_t *held_by_others) {
  uint64_t cur = atomic_load(&b->held);
  do {
    *held_by_others = cur;
    if (n > b->limit || cur > b->limit - n) return FPS_ELIMIT;
  } while (!atomic_compare_exchange_weak(&b->held, &cur, cur + n));
  return 0;
}

void fps_decode_release(fps_decode_budget_t *b, uint64_t n) {
  if (n) atomic_fetch_sub(&b->held, n);
}

int fps_wire_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t max_bytes,
                    ProtobufCMessage **out, char *why, size_t wl) {
  return fps_wire_unpack_held(desc, buf, len, max_bytes, NULL, NULL, out, why, wl);
}

int fps_wire_unpack_held(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t max_bytes,
                         fps_decode_budget_t *budget, uint64_t *held, ProtobufCMessage **out, char *why, size_t wl) {
  *out = NULL;
  if (held) *held = 0;
  if (budget && !budget->limit) budget = NULL;
  size_t received = len;
  uint64_t cost = 0;
  /* First, before anything else reads all of it. */
  int code = max_bytes ? fps__wire_admit(desc, buf, len, received, max_bytes, &cost, why, wl) : 0;
  if (code < 0) return code;
  bool repeats = false;
  code = fps__wire_walk(desc, buf, len, 0, &repeats, why, wl);
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
    /* The count above was of the parts: protobuf-c will decode the
     * merged bytes, which are counted again. */
    code = max_bytes ? fps__wire_admit(desc, buf, len, received, max_bytes, &cost, why, wl) : 0;
    if (code < 0) {
      fps_free(canon);
      return code;
    }
  }
  /* While protobuf-c decodes, the request is held three ways: decoded,
   * as received (gRPC's buffer and the caller's flat copy) and merged. */
  uint64_t wire = 2 * (uint64_t)received + (canon ? len : 0);
  if (budget) {
    if (!max_bytes) cost = fps_wire_cost(desc, buf, len, budget->limit);
    uint64_t others;
    if (fps_decode_reserve(budget, cost + wire, &others) < 0) {
      fps_free(canon);
      snprintf(why, wl,
               "decoding this %zu-byte %s would hold %" PRIu64 " bytes, beyond what is left of the %" PRIu64
               "-byte budget for requests being decoded and handled (--max-decode-bytes; %" PRIu64
               " bytes held by other calls): retry later",
               received, desc->short_name, cost + wire, budget->limit, others);
      return FPS_ELIMIT;
    }
  }
  bool oom = false;
  ProtobufCAllocator noting = {fps__wire_alloc_noting, fps__wire_free, &oom};
  *out = protobuf_c_message_unpack(desc, &noting, len, buf);
  fps_free(canon);
  if (budget) {
    /* The caller frees its copies of the wire bytes next: what stays is
     * the decoded message, until fps_wire_request_free(). */
    fps_decode_release(budget, *out ? wire : cost + wire);
    if (*out && held) *held = cost;
    if (*out && !held) fps_decode_release(budget, cost);
  }
  if (!*out && oom) {
    snprintf(why, wl, "%s: out of memory decoding a %zu-byte message", desc->short_name, len);
    return FPS_ENOMEM;
  }
  if (!*out) {
    snprintf(why, wl, "malformed %s (%zu bytes)", desc->short_name, len);
    return FPS_EPROTO;
  }
  return 0;
}

void fps_wire_request_free(fps_decode_budget_t *budget, ProtobufCMessage *msg, uint64_t held) {
  if (msg) protobuf_c_message_free_unpacked(msg, &fps_wire_allocator);
  if (budget) fps_decode_release(budget, held);
}

/* --------------------------------- the same checks, on received buffers */

/* The string walk of fps__wire_walk() over a reader: the same keys (any
 * varint), stopping silently where the bytes stop making sense (the
 * structure check then refuses them). */
static int fps__wire_walk_r(const ProtobufCMessageDescriptor *d, fps_wreader_t r, int depth, bool *repeats,
                            char *why, size_t wl) {
  uint64_t seen = 0;
  while (fps_wr_left(&r) > 0) {
    uint64_t key;
    if (!fps_wr_varint(&r, 10, &key)) return 0;
    uint32_t num = (uint32_t)(key >> 3);
    int wt = (int)(key & 7);
    if (wt != FPS_WT_LEN) {
      if (!fps_wr_skip_value(&r, wt)) return 0;
      continue;
    }
    uint64_t len;
    fps_wreader_t sub;
    if (!fps_wr_varint(&r, 10, &len) || len > fps_wr_left(&r)) return 0;
    sub = r;
    sub.left = len;
    fps_wr_skip(&r, len);
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, num);
    if (!fd) continue;
    if (fd->type == PROTOBUF_C_TYPE_STRING && len > 0) {
      uint8_t small[FPS_NAME_MAX + 1];
      uint8_t *tmp = NULL;
      const uint8_t *p = fps_wr_bytes(&sub, len, len <= sizeof small ? small : (tmp = fps_malloc(len)));
      if (!p) {
        /* Out of memory for a name cut between buffers: walk on; the
         * core checks every name it is given again. */
        fps_free(tmp);
        continue;
      }
      const char *s = (const char *)p;
      bool bad = memchr(s, '\0', len) != NULL || !fps_utf8_valid(s, len);
      for (size_t i = 0; !bad && i < len; i++) bad = (unsigned char)s[i] < 0x20 || s[i] == 0x7f;
      int rc = bad ? fps_name_check(s, len, why, wl) : 0;
      fps_free(tmp);
      if (rc < 0) return FPS_EINVAL;
    } else if (fd->type == PROTOBUF_C_TYPE_MESSAGE && depth < FPS__WIRE_DEPTH) {
      size_t idx = (size_t)(fd - d->fields);
      if (fd->label != PROTOBUF_C_LABEL_REPEATED && idx < 64) {
        if (seen & (UINT64_C(1) << idx)) *repeats = true;
        seen |= UINT64_C(1) << idx;
      }
      int c = fps__wire_walk_r(fd->descriptor, sub, depth + 1, repeats, why, wl);
      if (c < 0) return c;
    }
  }
  return 0;
}

static bool fps__wire_varint_type(ProtobufCType t) {
  switch (t) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_BOOL:
    case PROTOBUF_C_TYPE_ENUM: return true;
    default: return false;
  }
}

/* The wire type a field of type t is unpacked from (LEN for strings,
 * bytes and messages). */
static int fps__wire_type_of(ProtobufCType t) {
  if (fps__wire_varint_type(t)) return FPS_WT_VARINT;
  switch (t) {
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT: return FPS_WT_I32;
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE: return FPS_WT_I64;
    default: return FPS_WT_LEN;
  }
}

/* True if protobuf-c would unpack the message in r as type d. */
static bool fps__wire_well_formed(const ProtobufCMessageDescriptor *d, fps_wreader_t r, int depth) {
  if (depth > FPS__WIRE_DEPTH) return false;
  while (fps_wr_left(&r) > 0) {
    uint32_t num;
    int wt;
    if (!fps_wr_key(&r, &num, &wt)) return false;
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, num);
    if (!fd) {
      if (!fps_wr_skip_value(&r, wt)) return false;
      continue;
    }
    int want = fps__wire_type_of(fd->type);
    if (fd->type == PROTOBUF_C_TYPE_BOOL && fd->label != PROTOBUF_C_LABEL_REPEATED) {
      /* protobuf-c 1.4 reads a bool from any wire type (fps__wire_bool). */
      if (!fps_wr_skip_value(&r, wt)) return false;
      continue;
    }
    if (wt == FPS_WT_LEN && want != FPS_WT_LEN && fd->label == PROTOBUF_C_LABEL_REPEATED) {
      /* Packed: whole values only. */
      fps_wreader_t sub;
      uint64_t len, v;
      if (!fps_wr_sub(&r, &sub, &len)) return false;
      if (want == FPS_WT_VARINT) {
        while (fps_wr_left(&sub) > 0)
          if (!fps_wr_varint(&sub, 10, &v)) return false;
      } else if (len % (want == FPS_WT_I64 ? 8 : 4) != 0) {
        return false;
      }
      continue;
    }
    if (wt != want) return false;
    if (fd->type == PROTOBUF_C_TYPE_MESSAGE) {
      fps_wreader_t sub;
      uint64_t len;
      if (!fps_wr_sub(&r, &sub, &len) || !fps__wire_well_formed(fd->descriptor, sub, depth + 1)) return false;
      continue;
    }
    if (!fps_wr_skip_value(&r, wt)) return false;
  }
  return true;
}

int fps_wire_check(const ProtobufCMessageDescriptor *desc, const fps_wreader_t *msg, bool *repeats, char *why,
                   size_t wl) {
  *repeats = false;
  int rc = fps__wire_walk_r(desc, *msg, 0, repeats, why, wl);
  if (rc < 0) return rc;
  if (!fps__wire_well_formed(desc, *msg, 0)) {
    snprintf(why, wl, "malformed %s (%" PRIu64 " bytes)", desc->short_name, fps_wr_left(msg));
    return FPS_EPROTO;
  }
  return 0;
}

/* A bool field's value as protobuf-c 1.4 reads it: from a field of any
 * wire type, true if any of its value's bytes (a LEN field's length
 * prefix included) has one of its low seven bits set. */
static bool fps__wire_bool(fps_wreader_t *r, int wt, bool *b) {
  uint64_t n;
  switch (wt) {
    case FPS_WT_VARINT: n = 0; break;
    case FPS_WT_I64: n = 8; break;
    case FPS_WT_I32: n = 4; break;
    case FPS_WT_LEN: {
      fps_wreader_t c = *r;
      uint64_t len;
      if (!fps_wr_varint(&c, 5, &len) || len > fps_wr_left(&c)) return false;
      n = fps_wr_left(r) - fps_wr_left(&c) + len; /* prefix and payload */
      break;
    }
    default: return false;
  }
  *b = false;
  if (wt == FPS_WT_VARINT) {
    /* The varint's own bytes, up to the one without a continuation bit. */
    for (int k = 0; k < 10; k++) {
      uint8_t x;
      if (!fps_wr_read(r, &x, 1)) return false;
      if (x & 0x7f) *b = true;
      if (!(x & 0x80)) return true;
    }
    return false;
  }
  for (uint64_t k = 0; k < n; k++) {
    uint8_t x;
    if (!fps_wr_read(r, &x, 1)) return false;
    if (x & 0x7f) *b = true;
  }
  return true;
}

bool fps_wire_pp_header(const fps_wreader_t *msg, fps_wire_pp_header_t *h) {
  memset(h, 0, sizeof *h);
  fps_wreader_t r = *msg;
  while (fps_wr_left(&r) > 0) {
    uint32_t field;
    int wt;
    uint64_t v;
    if (!fps_wr_key(&r, &field, &wt)) return false;
    if (field == 4) {
      if (!fps__wire_bool(&r, wt, &h->skip_params)) return false;
      continue;
    }
    if (wt != FPS_WT_VARINT || field == 3 || field == 5 || field > 8) {
      if (!fps_wr_skip_value(&r, wt)) return false;
      continue;
    }
    if (!fps_wr_varint(&r, 10, &v)) return false;
    switch (field) {
      case 1: h->worker_id = (uint32_t)v; break;
      case 2: h->step = v; break;
      case 6: h->num_workers = (uint32_t)v; break;
      case 7: h->expect_mode = (int32_t)(uint32_t)v; break;
      case 8: h->push_id = v; break;
      default: break;
    }
  }
  return true;
}

bool fps_wire_tensor_push_parse(fps_wreader_t r, fps_push_tensor_t *t, fps_wreader_t *name, uint64_t *name_len) {
  memset(t, 0, sizeof *t);
  t->name = "";
  *name = r;
  name->left = 0;
  *name_len = 0;
  while (fps_wr_left(&r) > 0) {
    uint32_t field;
    int wt;
    uint64_t v;
    /* fps_wire_check() made sure known fields have their wire types. */
    if (!fps_wr_key(&r, &field, &wt)) return false;
    if (field == 1 && wt == FPS_WT_LEN) {
      if (!fps_wr_sub(&r, name, name_len)) return false;
    } else if ((field == 2 || field == 3) && wt == FPS_WT_I64) {
      double d;
      if (!fps_wr_double(&r, &d)) return false;
      if (field == 2) {
        t->has_lr = true;
        t->lr = d;
      } else {
        t->has_weight_decay = true;
        t->weight_decay = d;
      }
    } else if (field == 4) {
      if (!fps__wire_bool(&r, wt, &t->no_grad)) return false;
    } else if (field == 6) {
      if (!fps__wire_bool(&r, wt, &t->skip_step)) return false;
    } else if (field == 5 && wt == FPS_WT_VARINT) {
      if (!fps_wr_varint(&r, 10, &v)) return false;
      t->has_step = true;
      t->step = v;
    } else if (!fps_wr_skip_value(&r, wt)) {
      return false;
    }
  }
  return true;
}

static int fps__cmp_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int fps_wire_names_check(const char *rpc, char *const *names, size_t n, char *why, size_t why_len) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) rc = fps_shard_name_check(names[i] ? names[i] : "", why, why_len);
  if (rc < 0 || n < 2) return rc;
  const char **sorted = fps_malloc(n * sizeof *sorted);
  if (!sorted) {
    snprintf(why, why_len, "%s: out of memory checking %zu names", rpc, n);
    return FPS_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) sorted[i] = names[i] ? names[i] : "";
  qsort(sorted, n, sizeof *sorted, fps__cmp_name);
  for (size_t i = 1; i < n; i++)
    if (!strcmp(sorted[i - 1], sorted[i])) {
      snprintf(why, why_len, "%s: tensor '%s' is named twice", rpc, sorted[i]);
      rc = FPS_EINVAL;
      break;
    }
  fps_free(sorted);
  return rc;
}

size_t fps_wire_bb_spans(grpc_byte_buffer *bb, fps_wspan_t **spans, size_t *cap) {
  const grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
  if (sb->count > *cap) {
    size_t ncap = sb->count < 64 ? 64 : sb->count;
    fps_wspan_t *ns = fps_realloc(*spans, ncap * sizeof *ns);
    if (!ns) return SIZE_MAX;
    *spans = ns;
    *cap = ncap;
  }
  for (size_t i = 0; i < sb->count; i++) {
    (*spans)[i].p = GRPC_SLICE_START_PTR(sb->slices[i]);
    (*spans)[i].n = GRPC_SLICE_LENGTH(sb->slices[i]);
  }
  return sb->count;
}

/* The cost of protobuf-c's unpack, read off the wire bytes (wire_cost.h).
 *
 * The walk follows protobuf_c_message_unpack() of protobuf-c 1.4.1 step by
 * step: it accepts every field the unpacker's scan accepts (keys, varints,
 * length prefixes with the same limits) and stops a message where that
 * scan stops, so nothing the unpacker allocates goes uncounted; where it
 * is unsure it counts more. What the unpacker allocates, per message:
 *  - the message struct (desc->sizeof_message);
 *  - beyond the 16 fields its stack holds, slabs of scanned fields that
 *    double in size, 32 fields first;
 *  - an array per repeated field, of its element count times the
 *    element's size (packed varints counted as the unpacker counts them:
 *    one per byte without the continuation bit);
 *  - an array of unknown fields, and a copy of each;
 *  - a copy of each string (its length + 1) and of each non-empty bytes
 *    field, and the same again, recursively, for each nested message;
 *  - a singular message field that occurs again is merged into the
 *    earlier one, which holds both and arrays of both at once: such a
 *    field is counted twice.
 * Everything is counted as if it were never freed (a singular string's
 * earlier copies, the scan slabs, the parts of a merge): an upper bound,
 * and a close one for the inputs that matter (many small entries). */
#include "wire_cost.h"

#include <stdbool.h>
#include <string.h>

#define FPS__COST_DEPTH 32
/* glibc serves larger requests from mmap, rounded to pages. */
#define FPS__COST_MMAP_MIN ((uint64_t)128 << 10)

/* The layout of protobuf-c's ScannedMember, for its size. */
typedef struct fps__cost_scanned_s {
  uint32_t tag;
  uint8_t wire_type;
  uint8_t length_prefix_len;
  const void *field;
  size_t len;
  const uint8_t *data;
} fps__cost_scanned_t;

static uint64_t fps__cost_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

static uint64_t fps__cost_mul(uint64_t a, uint64_t b) {
  if (a && b > UINT64_MAX / a) return UINT64_MAX;
  return a * b;
}

uint64_t fps_wire_cost_chunk(uint64_t n) {
  if (n > UINT64_MAX - 8192) return UINT64_MAX;
  if (n >= FPS__COST_MMAP_MIN) return (n + 16 + 4095) & ~(uint64_t)4095;
  uint64_t c = (n + 8 + 15) & ~(uint64_t)15;
  return c < 32 ? 32 : c;
}

static size_t fps__cost_elt(ProtobufCType t) {
  switch (t) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE: return 8;
    case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE: return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
    default: return 4;
  }
}

static bool fps__cost_packable(ProtobufCType t) {
  return t != PROTOBUF_C_TYPE_STRING && t != PROTOBUF_C_TYPE_BYTES && t != PROTOBUF_C_TYPE_MESSAGE;
}

/* The key at p as the unpacker reads it: at most 5 bytes, field number 0
 * refused. Returns its length, 0 if the unpacker would stop here. */
static size_t fps__cost_key(const uint8_t *p, size_t rem, uint32_t *tag, int *wt) {
  if ((p[0] & 0xf8) == 0) return 0;
  *wt = p[0] & 7;
  uint32_t t = (p[0] & 0x7f) >> 3;
  if (!(p[0] & 0x80)) {
    *tag = t;
    return 1;
  }
  size_t max = rem > 5 ? 5 : rem;
  unsigned shift = 4;
  for (size_t i = 1; i < max; i++) {
    /* The unpacker shifts a uint8_t promoted to int: the bits it keeps
     * are those of an unsigned shift. */
    t |= (uint32_t)(p[i] & 0x7f) << shift;
    if (!(p[i] & 0x80)) {
      *tag = t;
      return i + 1;
    }
    shift += 7;
  }
  return 0;
}

/* A length-prefixed value at p: its prefix (at most 5 bytes) in *pref;
 * returns prefix + value bytes, 0 if the unpacker would stop here. */
static size_t fps__cost_lenpref(const uint8_t *p, size_t rem, size_t *pref) {
  size_t max = rem < 5 ? rem : 5;
  uint64_t v = 0;
  size_t i;
  for (i = 0; i < max; i++) {
    v |= (uint64_t)(p[i] & 0x7f) << (7 * i);
    if (!(p[i] & 0x80)) break;
  }
  if (i == max) return 0;
  *pref = i + 1;
  if (v > INT32_MAX || *pref + v > rem) return 0;
  return *pref + (size_t)v;
}

/* Elements of a packed run of n bytes, as the unpacker counts them. */
static uint64_t fps__cost_packed(ProtobufCType t, const uint8_t *p, size_t n) {
  switch (t) {
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT: return n / 4;
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE: return n / 8;
    case PROTOBUF_C_TYPE_BOOL: return n;
    default: {
      uint64_t c = 0;
      for (size_t i = 0; i < n; i++) c += !(p[i] & 0x80);
      return c;
    }
  }
}

/* The scan slabs of a message of n fields. */
static uint64_t fps__cost_slabs(uint64_t n) {
  uint64_t cap = 16, total = 0;
  for (unsigned w = 1; n > cap && w < 40; w++) {
    uint64_t members = (uint64_t)1 << (w + 4);
    total = fps__cost_add(total, fps_wire_cost_chunk(fps__cost_mul(sizeof(fps__cost_scanned_t), members)));
    cap = fps__cost_add(cap, members);
  }
  return total;
}

/* The walk's running count over the whole request, every part counted as
 * soon as it is known: it can only grow to the final count, so the walk
 * stops as soon as it passes the limit. */
typedef struct fps__cost_ctx_s {
  uint64_t spent, limit;
} fps__cost_ctx_t;

/* Adds x to a message's total and to the request's running count. */
static void fps__cost_charge(fps__cost_ctx_t *ctx, uint64_t *total, uint64_t x) {
  *total = fps__cost_add(*total, x);
  ctx->spent = fps__cost_add(ctx->spent, x);
}

/* One message's count (its nested messages' included), or a partial one
 * once ctx->spent passed ctx->limit. */
static uint64_t fps__cost_msg(fps__cost_ctx_t *ctx, const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n,
                              int depth) {
  uint64_t total = 0;
  if (depth > FPS__COST_DEPTH) {
    fps__cost_charge(ctx, &total, UINT64_MAX);
    return total;
  }
  fps__cost_charge(ctx, &total, fps_wire_cost_chunk(d->sizeof_message));
  /* The required-field bitmap: on the stack up to 128 fields. */
  if (d->n_fields > 128) fps__cost_charge(ctx, &total, fps_wire_cost_chunk((d->n_fields + 7) / 8));
  /* Only the descriptor's own entries are cleared: a hostile request
   * may hold a million empty messages. */
  size_t nf = d->n_fields < 64 ? d->n_fields : 64;
  uint64_t count[64]; /* repeated elements, by field index */
  uint64_t first[64]; /* a singular message field's first cost (after seen) */
  memset(count, 0, nf * sizeof count[0]);
  uint64_t seen = 0, twice = 0;
  const ProtobufCFieldDescriptor *last = NULL;
  uint64_t members = 0, unknown = 0;
  size_t rem = n;
  while (rem > 0 && ctx->spent <= ctx->limit) {
    uint32_t tag;
    int wt;
    size_t used = fps__cost_key(p, rem, &tag, &wt);
    if (!used) break;
    p += used;
    rem -= used;
    size_t flen = 0, pref = 0;
    switch (wt) {
      case PROTOBUF_C_WIRE_TYPE_VARINT: {
        size_t max = rem < 10 ? rem : 10, i;
        for (i = 0; i < max; i++)
          if (!(p[i] & 0x80)) break;
        flen = i == max ? 0 : i + 1;
        break;
      }
      case PROTOBUF_C_WIRE_TYPE_64BIT: flen = rem < 8 ? 0 : 8; break;
      case PROTOBUF_C_WIRE_TYPE_32BIT: flen = rem < 4 ? 0 : 4; break;
      case PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED: flen = fps__cost_lenpref(p, rem, &pref); break;
      default: break;
    }
    if (!flen) break;
    const uint8_t *val = p + pref;
    size_t vlen = flen - pref;
    p += flen;
    rem -= flen;
    members++;
    /* Fields of one kind come in runs: the last lookup is reused, as
     * protobuf-c does. */
    const ProtobufCFieldDescriptor *fd = last && last->id == tag ? last : protobuf_c_message_descriptor_get_field(d, tag);
    if (fd) last = fd;
    if (!fd) {
      unknown++;
      fps__cost_charge(ctx, &total, fps_wire_cost_chunk(flen));
      continue;
    }
    size_t idx = (size_t)(fd - d->fields);
    bool lp = wt == PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
      bool packed = lp && ((fd->flags & PROTOBUF_C_FIELD_FLAG_PACKED) || fps__cost_packable(fd->type));
      uint64_t c = packed ? fps__cost_packed(fd->type, val, vlen) : 1;
      /* Past 64 fields, an array per occurrence: never less than one
       * array of all of them. */
      if (idx < 64) count[idx] += c;
      else fps__cost_charge(ctx, &total, fps_wire_cost_chunk(fps__cost_mul(c, fps__cost_elt(fd->type))));
    }
    if (!lp) continue;
    switch (fd->type) {
      case PROTOBUF_C_TYPE_STRING: fps__cost_charge(ctx, &total, fps_wire_cost_chunk((uint64_t)vlen + 1)); break;
      case PROTOBUF_C_TYPE_BYTES:
        if (vlen) fps__cost_charge(ctx, &total, fps_wire_cost_chunk(vlen));
        break;
      case PROTOBUF_C_TYPE_MESSAGE: {
        /* Already in ctx->spent: only the merge's second count is new. */
        uint64_t c = fps__cost_msg(ctx, fd->descriptor, val, vlen, depth + 1);
        total = fps__cost_add(total, c);
        if (fd->label != PROTOBUF_C_LABEL_REPEATED) {
          if (idx >= 64) {
            fps__cost_charge(ctx, &total, c);
          } else if (seen & (UINT64_C(1) << idx)) {
            if (!(twice & (UINT64_C(1) << idx))) fps__cost_charge(ctx, &total, first[idx]);
            twice |= UINT64_C(1) << idx;
            fps__cost_charge(ctx, &total, c);
          } else {
            seen |= UINT64_C(1) << idx;
            first[idx] = c;
          }
        }
        break;
      }
      default: break;
    }
  }
  fps__cost_charge(ctx, &total, fps__cost_slabs(members));
  for (size_t i = 0; i < nf; i++)
    if (count[i])
      fps__cost_charge(ctx, &total, fps_wire_cost_chunk(fps__cost_mul(count[i], fps__cost_elt(d->fields[i].type))));
  if (unknown)
    fps__cost_charge(ctx, &total,
                     fps_wire_cost_chunk(fps__cost_mul(unknown, sizeof(ProtobufCMessageUnknownField))));
  return total;
}

uint64_t fps_wire_cost(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t limit) {
  fps__cost_ctx_t ctx = {0, limit};
  uint64_t total = fps__cost_msg(&ctx, desc, buf, len, 0);
  return ctx.spent > limit ? ctx.spent : total;
}

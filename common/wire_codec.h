/* The one protobuf wire codec of the data path, shared by the shard and
 * libfactorps: a reader over a message that lies in several buffers (the
 * slices gRPC received it in), the TensorSlice decoder both sides need, and
 * the encoders of the few framing bytes the data path writes by hand.
 *
 * Why by hand: protobuf-c unpacks a message from one flat buffer and copies
 * every `bytes` field; for tensor data that meant flattening each message
 * (one copy) and unpacking it (another) before decoding it into its
 * destination (a third). Reading the fields straight from the received
 * buffers leaves one pass per data byte: the consumer's own decode.
 *
 * Everything is bounds-checked; a reader never reads past its window.
 * Thread-safety: readers are plain values, one per thread; the functions
 * are reentrant. No gRPC and no protobuf-c here (the shard core and the
 * client both link it). */
#ifndef FPS_WIRE_CODEC_H
#define FPS_WIRE_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Protobuf wire types this codec knows (proto3 has no groups). */
enum { FPS_WT_VARINT = 0, FPS_WT_I64 = 1, FPS_WT_LEN = 2, FPS_WT_I32 = 5 };

/* One contiguous run of a message's bytes. */
typedef struct fps_wspan_s {
  const uint8_t *p;
  size_t n;
} fps_wspan_t;

/* A window of `left` bytes over a list of spans, read front to back. A
 * copy of a reader is an independent cursor over the same bytes (the spans
 * must outlive every copy). */
typedef struct fps_wreader_s {
  const fps_wspan_t *span;
  size_t nspan;
  size_t i;                   /* current span */
  size_t off;                 /* offset within span i */
  uint64_t left;              /* bytes left in the window */
} fps_wreader_t;

/* A reader over all the bytes of span[0..n). */
void fps_wr_init(fps_wreader_t *r, const fps_wspan_t *span, size_t n);
/* Bytes left in the window. */
static inline uint64_t fps_wr_left(const fps_wreader_t *r) { return r->left; }
/* A varint of at most max_bytes bytes (10 for values, 5 for keys and
 * lengths, as protobuf-c). False if truncated or longer. */
bool fps_wr_varint(fps_wreader_t *r, int max_bytes, uint64_t *v);
/* A field key: field number and wire type (0, 1, 2 or 5). False at the
 * end of the window or on a malformed key (as protobuf-c: more than 5
 * bytes, a group wire type, or a one-byte key of field 0). */
bool fps_wr_key(fps_wreader_t *r, uint32_t *field, int *wt);
/* A little-endian IEEE double (an I64 field's value). */
bool fps_wr_double(fps_wreader_t *r, double *d);
/* Copies the next n bytes to dst (false if fewer are left). */
bool fps_wr_read(fps_wreader_t *r, void *dst, uint64_t n);
/* Skips n bytes (false if fewer are left). */
bool fps_wr_skip(fps_wreader_t *r, uint64_t n);
/* The length prefix of a LEN field and its window: *sub covers the next
 * *len bytes and r moves past them. False if malformed or too long. */
bool fps_wr_sub(fps_wreader_t *r, fps_wreader_t *sub, uint64_t *len);
/* Skips the value of a field of wire type wt. False if malformed. */
bool fps_wr_skip_value(fps_wreader_t *r, int wt);
/* The bytes readable in place at the cursor (at most `left`), without
 * moving it: *p points at them. 0 at the end of the window. */
size_t fps_wr_peek(const fps_wreader_t *r, const uint8_t **p);
/* The next n bytes in one piece: in place if they lie in one span,
 * otherwise copied into buf (of at least n bytes). NULL if fewer are left.
 * The cursor moves past them. */
const uint8_t *fps_wr_bytes(fps_wreader_t *r, uint64_t n, uint8_t *buf);

/* The data of a slice as runs of whole elements: each call of next yields
 * the following run in place, or, for an element cut between two spans,
 * that one element from a small bounce buffer. */
typedef struct fps_welems_s {
  fps_wreader_t r;            /* what is left of the data */
  size_t esz;                 /* bytes per element (1..8) */
  uint8_t bounce[8];
} fps_welems_t;
/* REQUIRES: 1 <= esz <= 8 and fps_wr_left(data) a multiple of esz. */
void fps_welems_init(fps_welems_t *it, const fps_wreader_t *data, size_t esz);
/* The next run: sets *p and returns its element count; 0 when done. */
uint64_t fps_welems_next(fps_welems_t *it, const uint8_t **p);

/* ------------------------------------------------------- TensorSlice
 *
 * factorps.v1.TensorSlice, as protobuf-c would read it: the last
 * occurrence of a singular field wins, shape values accumulate (packed or
 * not), unknown fields are skipped, a known field with the wrong wire type
 * is malformed. */

/* Shape values kept: more than any message about a wrong shape prints
 * (the count is kept exactly, so a comparison stays exact). */
#define FPS_WIRE_SHAPE_KEEP 128

typedef struct fps_wire_tslice_s {
  fps_wreader_t name;         /* the name's bytes (empty window: none) */
  uint64_t name_len;
  int32_t dtype;              /* the wire DType value */
  uint64_t shape[FPS_WIRE_SHAPE_KEEP];
  uint64_t n_shape;           /* values sent (only the first KEEP kept) */
  uint64_t offset;
  fps_wreader_t data;         /* the data's bytes */
  uint64_t data_len;
} fps_wire_tslice_t;

/* Decodes the TensorSlice in window r (consumed). False if malformed. */
bool fps_wire_tslice_parse(fps_wreader_t *r, fps_wire_tslice_t *out);

/* ----------------------------------------------------------- encoding */

/* Most bytes one varint takes. */
#define FPS_WIRE_VARINT_MAX 10
/* Writes v as a varint; returns the bytes written. */
size_t fps_wire_put_varint(uint8_t *buf, uint64_t v);
/* Bytes fps_wire_put_varint() writes for v. */
size_t fps_wire_varint_len(uint64_t v);
/* Writes a key and varint value (field `field` = v); returns the bytes
 * written (<= 15). */
size_t fps_wire_put_varint_field(uint8_t *buf, unsigned field, uint64_t v);
/* Writes a key and a length prefix of a LEN field; returns the bytes
 * written (<= 15). */
size_t fps_wire_put_len_field(uint8_t *buf, unsigned field, uint64_t len);

/* Most header bytes fps_wire_slice_header() writes for a name of
 * `name_len` bytes and `ndim` dims. */
#define FPS_WIRE_SLICE_HEADER_MAX(name_len, ndim) (48 + (name_len) + 11 * (ndim))
/* Writes the framing of a TensorSlice whose `data_len` data bytes follow
 * it: the enclosing message's field `field` key and length, then name,
 * dtype, shape (packed, none for ndim 0), offset and the data field's key
 * and length. Returns the bytes written. REQUIRES dtype < 128. */
size_t fps_wire_slice_header(uint8_t *buf, unsigned field, const char *name, size_t name_len, int dtype,
                             uint32_t ndim, const uint64_t *shape, uint64_t offset, size_t data_len);
/* Most bytes fps_wire_version() writes for a name of `name_len` bytes. */
#define FPS_WIRE_VERSION_MAX(name_len) (28 + (name_len))
/* Writes a TensorVersion {name, version} as field `field` of the
 * enclosing message. Returns the bytes written. */
size_t fps_wire_version(uint8_t *buf, unsigned field, const char *name, size_t name_len, uint64_t version);

#endif

/* Between the protobuf-c wire types and the core's own types, for the
 * rpc_*.c handlers. Checks speak the core's language: 0 or FPS_E* with a
 * message naming the tensor and the problem in why (the rules themselves,
 * names, shapes and slices, are the core's: shard/shard.h, common/name.h). */
#ifndef FPS_SERVER_WIRE_H
#define FPS_SERVER_WIRE_H

#include "factorps/v1/factorps.pb-c.h"
#include "server.h"
#include "wire_codec.h"
#include "wire_cost.h"

/* AdafactorConfig -> hparams: defaults of the flavor, then the fields that
 * are present; a field the flavor lacks is FPS_EINVAL; then the kernel's
 * own validation. A NULL config is FPS_EINVAL. */
int fps_wire_hparams(const char *name, const Factorps__V1__AdafactorConfig *c, fps_adafactor_hparams_t *hp,
                     char *why, size_t why_len);

/* A view of a wire slice as the core's fps_slice_t (no copy: it points
 * into s, which must outlive it). */
void fps_wire_slice_view(const Factorps__V1__TensorSlice *s, fps_slice_t *out);

/* protobuf-c's allocator for requests, through fps_malloc/fps_free (so
 * the fault injection reaches the decoder): pass it to every *_unpack and
 * *_free_unpacked of a request. */
extern ProtobufCAllocator fps_wire_allocator;

/* Unpacks a request. First, with max_bytes not 0, refuses a message whose
 * decoded form (fps_wire_cost(), counted before anything else reads all of
 * it) would exceed fps_wire_decode_bound(len) or max_bytes: FPS_ELIMIT,
 * "decoding this N-byte <Type> would take more than the M bytes of memory
 * allowed ..."; max_bytes 0 skips that bound (tests comparing decoders
 * only). Then checks every string field on the wire (names with NUL or
 * control characters: FPS_EINVAL naming the name), merges repeated parts
 * of singular message fields (valid protobuf that protobuf-c 1.4.1
 * refuses when a oneof is absent; the merged bytes are counted again),
 * then unpacks. Returns 0 with *out set (free with
 * protobuf_c_message_free_unpacked and &fps_wire_allocator), FPS_EPROTO
 * ("malformed <Type> (N bytes)"), FPS_ELIMIT or FPS_ENOMEM. */
int fps_wire_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t max_bytes,
                    ProtobufCMessage **out, char *why, size_t why_len);

/* fps_wire_unpack(), holding the request in the shard-wide budget (NULL,
 * or a limit of 0: none): before protobuf-c decodes it, reserves its
 * decoded size (fps_wire_cost()) and its received bytes as they are held
 * while it is decoded (twice, three times if merged); when that does not
 * fit in what is left, refuses it with FPS_ELIMIT naming the budget
 * (--max-decode-bytes), nothing decoded. After decoding the received
 * bytes are given back; *held (its decoded size) stays reserved until
 * fps_wire_request_free(). On error nothing stays reserved (*held 0). */
int fps_wire_unpack_held(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t max_bytes,
                         fps_decode_budget_t *budget, uint64_t *held, ProtobufCMessage **out, char *why,
                         size_t why_len);

/* Frees a request from fps_wire_unpack_held() (msg may be NULL) and gives
 * its held bytes back to budget. */
void fps_wire_request_free(fps_decode_budget_t *budget, ProtobufCMessage *msg, uint64_t held);

/* Reserves n bytes of b: 0, or FPS_ELIMIT when b->held + n would exceed
 * b->limit (nothing reserved). *held_by_others: what was held then. Safe
 * from any thread. */
int fps_decode_reserve(fps_decode_budget_t *b, uint64_t n, uint64_t *held_by_others);
/* Gives back n bytes reserved with fps_decode_reserve(). */
void fps_decode_release(fps_decode_budget_t *b, uint64_t n);

/* The most memory decoding a len-byte request may take:
 * FPS_WIRE_COST_RATIO * len + FPS_WIRE_COST_SLACK (wire_cost.h). */
static inline uint64_t fps_wire_decode_bound(size_t len) {
  return (uint64_t)len * FPS_WIRE_COST_RATIO + FPS_WIRE_COST_SLACK;
}

/* The checks of fps_wire_unpack() on a message that stays in the buffers
 * it was received in (msg, a window over them), for the handlers that
 * decode it themselves with wire_codec.h: first every string field on the
 * wire (as fps_wire_unpack: FPS_EINVAL naming the name), then the message's
 * structure as protobuf-c's unpack checks it (known fields with the right
 * wire types, packed values whole, nested messages likewise): FPS_EPROTO
 * "malformed <Type> (N bytes)". *repeats is set if a singular message field
 * occurs twice (those parts must be merged: fps_wire_unpack() does). */
int fps_wire_check(const ProtobufCMessageDescriptor *desc, const fps_wreader_t *msg, bool *repeats, char *why,
                   size_t why_len);

/* PushPullRequest, decoded from a message fps_wire_check() accepted: its
 * scalar fields (wherever they are, the last occurrence winning, as
 * protobuf-c reads them), and one TensorPush (its name as a window: *name,
 * *name_len). False if malformed. */
typedef struct fps_wire_pp_header_s {
  uint32_t worker_id;
  uint64_t step;
  bool skip_params;
  uint32_t num_workers;
  int32_t expect_mode;
  uint64_t push_id;
} fps_wire_pp_header_t;
bool fps_wire_pp_header(const fps_wreader_t *msg, fps_wire_pp_header_t *h);
bool fps_wire_tensor_push_parse(fps_wreader_t r, fps_push_tensor_t *t, fps_wreader_t *name, uint64_t *name_len);

/* The names of a request that reads tensors (Pull, GetState): each must
 * pass fps_shard_name_check() and none may appear twice, so a reply is
 * never larger than the shard's tensors (a Pull naming one tensor a
 * thousand times would otherwise be answered with a thousand copies).
 * NULL names count as "". Returns 0, FPS_EINVAL with why naming the name
 * ("<rpc>: tensor 'x' is named twice"), or FPS_ENOMEM. */
int fps_wire_names_check(const char *rpc, char *const *names, size_t n, char *why, size_t why_len);

/* The spans of a received, uncompressed byte buffer's slices into
 * *spans (grown as needed; *cap its capacity). Returns the count, or
 * SIZE_MAX on OOM. The spans point into bb's slices. */
size_t fps_wire_bb_spans(grpc_byte_buffer *bb, fps_wspan_t **spans, size_t *cap);

#endif

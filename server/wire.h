/* Helpers between the protobuf-c wire types and the shard's own types,
 * shared by the rpc_*.c handlers. Every check returns a gRPC status code
 * (GRPC_STATUS_OK or the code the contract prescribes) and writes a message
 * naming the tensor and the problem into why. */
#ifndef FPS_SERVER_WIRE_H
#define FPS_SERVER_WIRE_H

#include "factorps/v1/factorps.pb-c.h"
#include "server.h"

#define FPS_WHY_MAX 2048

/* Name: 1..FPS_NAME_MAX bytes of valid UTF-8. */
grpc_status_code fps_wire_name(const char *name, char *why, size_t why_len);

/* Shape from the wire (dims >= 1, ndim <= FPS_MAX_DIMS, numel bounded). */
grpc_status_code fps_wire_shape(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out,
                                uint64_t *numel, char *why, size_t why_len);

/* AdafactorConfig -> hparams: defaults of the flavor, then the fields that
 * are present; a field the flavor lacks is INVALID_ARGUMENT; then the
 * kernel's own validation. A NULL config is INVALID_ARGUMENT. */
grpc_status_code fps_wire_hparams(const char *name, const Factorps__V1__AdafactorConfig *c,
                                  fps_adafactor_hparams_t *hp, char *why, size_t why_len);

/* A slice against a tensor of shape/numel: dtype supported, data a whole
 * number of elements, shape (if given) equal, [offset, offset+count) within
 * numel. *count gets the element count. */
grpc_status_code fps_wire_slice(const char *name, const Factorps__V1__TensorSlice *s,
                                const fps_shape_t *shape, uint64_t numel, bool shape_required,
                                uint64_t *count, char *why, size_t why_len);

/* Index of the first NaN/Inf among n little-endian elements of dtype at
 * data (any alignment), or n if all are finite. */
uint64_t fps_wire_first_nonfinite(int dtype, const uint8_t *data, uint64_t n);

/* Unpacks a request: checks every string field on the wire first (names
 * with NUL or control characters: INVALID_ARGUMENT naming the name), merges
 * repeated parts of singular message fields (valid protobuf that
 * protobuf-c 1.4.1 refuses when a oneof is absent), then unpacks. Returns
 * GRPC_STATUS_OK with *out set (free with protobuf_c_message_free_unpacked),
 * INVALID_ARGUMENT ("malformed <Type> (N bytes)") or RESOURCE_EXHAUSTED. */
grpc_status_code fps_wire_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len,
                                 ProtobufCMessage **out, char *why, size_t why_len);

/* The gRPC status of an FPS_E* code from the gRPC-free checks (one table). */
grpc_status_code fps_wire_status(int fps_err);

/* Equal shapes? */
bool fps_shape_equal(const fps_shape_t *a, const fps_shape_t *b);

#endif

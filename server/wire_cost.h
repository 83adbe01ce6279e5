/* What decoding a request with protobuf-c costs, known before decoding.
 *
 * protobuf_c_message_unpack() allocates per nested message, per repeated
 * element, per string and per field scanned, so a few bytes on the wire can
 * become hundreds in memory: an empty TensorCreate is 2 bytes and a struct
 * of over a hundred, and a 2 MiB CreateRequest of them once took the shard
 * about 190 times its size. The walker here reads the wire bytes once,
 * allocating nothing, and adds up every allocation the unpacker would make
 * (the model of protobuf-c 1.4.1's unpack and of glibc's chunk sizes), so
 * a request can be refused before any of it is decoded. */
#ifndef FPS_SERVER_WIRE_COST_H
#define FPS_SERVER_WIRE_COST_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

/* The bound the shard holds decoding to: a request may take at most
 * FPS_WIRE_COST_RATIO times its size plus FPS_WIRE_COST_SLACK (so tiny
 * requests, whose fixed structs outweigh their bytes, always pass). A normal
 * request sits far below it: tensors' values decode to their own size, and
 * a Create of many tensors without values to about 6 times its size. */
#define FPS_WIRE_COST_RATIO 16
#define FPS_WIRE_COST_SLACK ((uint64_t)64 << 10)

/* The heap protobuf_c_message_unpack(desc, allocator, len, buf) can take
 * when every allocation lands in glibc's malloc: an upper bound of its peak
 * (every allocation counted as if none were freed, merges of a repeated
 * singular message counted twice), whatever the bytes, malformed ones
 * included (counted up to where the unpacker would stop). The walk stops
 * as soon as the count passes limit (UINT64_MAX: never), returning a value
 * above limit that is less than the full count: a hostile request costs
 * only the part read. Allocates nothing and never fails; UINT64_MAX for
 * nesting deeper than 32 messages, which no request type allows. Reads
 * buf[0..len). Thread-safe. */
uint64_t fps_wire_cost(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len, uint64_t limit);

/* What one allocation of n bytes takes in the model: glibc's chunk (the size plus its
 * header, rounded to 16, at least 32 bytes), or whole pages for the sizes
 * glibc may map instead. */
uint64_t fps_wire_cost_chunk(uint64_t n);

#endif

/* The limits both sides of the wire keep, in one place. The shard and the
 * C code of both sides use these macros; the installed client header
 * (client/include/factorps/client.h: FPS_CLIENT_NAME_MAX,
 * FPS_CLIENT_MAX_DIMS) and the Python package (factorps/_lib.py:
 * NAME_MAX, MAX_DIMS; client.py's max_message_bytes default) cannot
 * include this file, so tests hold them to it
 * (tests/unit/common/test_limits.c, tests/python/test_limits.py).
 * (Not "limits.h": common/ is on the include path, and that name is the
 * C library's.) */
#ifndef FPS_LIMITS_H
#define FPS_LIMITS_H

/* Bytes of UTF-8 in a tensor name (the name rule: common/name.h). */
#define FPS_TENSOR_NAME_MAX 256

/* Dimensions of a tensor's shape. */
#define FPS_MAX_DIMS 8

/* Largest element count a tensor may have: keeps every byte count in
 * uint64_t and every index in int64_t free of overflow. */
#define FPS_MAX_NUMEL (UINT64_C(1) << 40)

/* Largest step (and version) a tensor may be created, resumed, loaded or
 * replicated at. No run gets near it (2^53 steps at one a microsecond
 * take 285 years), every count below it is exact as a double (Python,
 * JSON, Prometheus) and a version counted up from it never wraps to 0. */
#define FPS_MAX_STEP (UINT64_C(1) << 53)

/* gRPC's default receive limit, which a peer that never raised its own
 * holds us to: the client's default max_message_bytes, and what the
 * shard's replies stay under (FPS_REPLY_BUDGET leaves room for framing). */
#define FPS_MESSAGE_BYTES_DEFAULT (4u * 1024u * 1024u)

/* The smallest max_message_bytes a client or shard accepts. */
#define FPS_MESSAGE_BYTES_MIN (64u * 1024u)

#endif

/* The one translation of the project's error codes (FPS_E*, common/error.h)
 * into gRPC status codes. The shard core and the helpers below the RPC
 * layer speak FPS_E* only; a handler that answers a call with an error
 * passes the code through fps_status_from_err() and nothing else. */
#ifndef FPS_SERVER_STATUS_H
#define FPS_SERVER_STATUS_H

#include <grpc/status.h>

/* The gRPC status for 0 or a negative FPS_E* code (unknown codes:
 * GRPC_STATUS_INTERNAL). Thread-safe. */
grpc_status_code fps_status_from_err(int err);

#endif

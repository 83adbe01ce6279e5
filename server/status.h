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

/* The FPS_E* code for the status of another server's reply (a peer
 * shard's Exchange): 0 for OK; a refused token or role is FPS_ESTATE (the
 * servers' configuration, not the caller's); unknown, internal and
 * data-loss statuses are FPS_EIO. Thread-safe. */
int fps_err_from_status(grpc_status_code code);

#endif

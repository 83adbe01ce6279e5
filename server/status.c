/* FPS_E* -> gRPC status, in one table, and back for another server's
 * replies (see status.h). */
#include "status.h"

#include "error.h"

#define FPS_STATUS_MAP(X)                                   \
  X(INVAL, GRPC_STATUS_INVALID_ARGUMENT)                    \
  X(NOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED)                  \
  X(SHAPE, GRPC_STATUS_INVALID_ARGUMENT)                    \
  X(OVERFLOW, GRPC_STATUS_RESOURCE_EXHAUSTED)               \
  X(HPARAM, GRPC_STATUS_INVALID_ARGUMENT)                   \
  X(FLAVOR, GRPC_STATUS_INVALID_ARGUMENT)                   \
  X(UNSUPPORTED, GRPC_STATUS_UNIMPLEMENTED)                 \
  X(IO, GRPC_STATUS_INTERNAL)                               \
  X(FORMAT, GRPC_STATUS_INVALID_ARGUMENT)                   \
  X(NOTFOUND, GRPC_STATUS_NOT_FOUND)                        \
  X(EXISTS, GRPC_STATUS_ALREADY_EXISTS)                     \
  X(STATE, GRPC_STATUS_FAILED_PRECONDITION)                 \
  X(NONFINITE, GRPC_STATUS_INVALID_ARGUMENT)                \
  X(PROTO, GRPC_STATUS_INVALID_ARGUMENT)                    \
  X(TIMEOUT, GRPC_STATUS_DEADLINE_EXCEEDED)                 \
  X(UNAVAILABLE, GRPC_STATUS_UNAVAILABLE)                   \
  X(LIMIT, GRPC_STATUS_RESOURCE_EXHAUSTED)                  \
  X(AGAIN, GRPC_STATUS_UNAVAILABLE)                         \
  X(STALE, GRPC_STATUS_FAILED_PRECONDITION)                 \
  X(AHEAD, GRPC_STATUS_FAILED_PRECONDITION)                 \
  X(DUP, GRPC_STATUS_ALREADY_EXISTS)                        \
  X(CANCELLED, GRPC_STATUS_CANCELLED)                       \
  X(AUTH, GRPC_STATUS_UNAUTHENTICATED)                      \
  X(PERM, GRPC_STATUS_PERMISSION_DENIED)                    \
  X(INTERNAL, GRPC_STATUS_INTERNAL)

/* A code added to FPS_ERRNO_MAP but not here fails the build. */
#pragma GCC diagnostic error "-Wswitch-enum"

grpc_status_code fps_status_from_err(int err) {
  switch ((fps_errno_t)err) {
    case FPS_OK: return GRPC_STATUS_OK;
#define FPS_STATUS_CASE(name, code) case FPS_E##name: return code;
    FPS_STATUS_MAP(FPS_STATUS_CASE)
#undef FPS_STATUS_CASE
    case FPS__ERRNO_FIRST:
    case FPS__ERRNO_END: break;
  }
  return GRPC_STATUS_INTERNAL;
}

/* Not the table read backwards: several codes share a status, and a
 * refusal from another server means something else to the caller. */
int fps_err_from_status(grpc_status_code code) {
  switch (code) {
    case GRPC_STATUS_OK: return 0;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_OUT_OF_RANGE: return FPS_EINVAL;
    case GRPC_STATUS_NOT_FOUND: return FPS_ENOTFOUND;
    case GRPC_STATUS_ALREADY_EXISTS: return FPS_EEXISTS;
    /* A peer refusing this server's token or certificate is a
     * configuration problem between the servers, which a retry cannot
     * fix, and not the caller's credentials. */
    case GRPC_STATUS_UNAUTHENTICATED:
    case GRPC_STATUS_PERMISSION_DENIED:
    case GRPC_STATUS_FAILED_PRECONDITION: return FPS_ESTATE;
    case GRPC_STATUS_RESOURCE_EXHAUSTED: return FPS_ELIMIT;
    case GRPC_STATUS_DEADLINE_EXCEEDED: return FPS_ETIMEOUT;
    case GRPC_STATUS_UNIMPLEMENTED: return FPS_EUNSUPPORTED;
    case GRPC_STATUS_CANCELLED:
    case GRPC_STATUS_ABORTED:
    case GRPC_STATUS_UNAVAILABLE: return FPS_EUNAVAILABLE;
    case GRPC_STATUS_UNKNOWN:
    case GRPC_STATUS_INTERNAL:
    case GRPC_STATUS_DATA_LOSS:
    case GRPC_STATUS__DO_NOT_USE: break;
  }
  return FPS_EIO;
}

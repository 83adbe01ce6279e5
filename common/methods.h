/* The methods of factorps.v1.ParameterServer (proto/factorps/v1/
 * factorps.proto), listed once: the shard's handler and method tables
 * (server/grpc_server.c, server.h), the metric labels (server/metrics)
 * and the names in messages are generated from this X-macro. A method
 * added to the proto is added here, and the compiler then asks for its
 * handler (fps_rpc_<handler>_start).
 *
 *   X(ID, "Name", handler, role, streaming)
 *
 * ID names the enum values (FPS_METHOD_<ID>, FPS_METRICS_<ID>); "Name" is
 * the gRPC method name and metric label; role is the token role a call
 * needs (server/auth.h FPS_ROLE_<role>; Create's replace also needs
 * ADMIN, checked by its handler); streaming 1: the request is a stream
 * the handler reads itself, 0: one message read before the handler runs. */
#ifndef FPS_METHODS_H
#define FPS_METHODS_H

#define FPS_METHOD_MAP(X)                              \
  X(CREATE, "Create", create, WORKER, 0)               \
  X(PUSHPULL, "PushPull", pushpull, WORKER, 1)         \
  X(PULL, "Pull", pull, WORKER, 0)                     \
  X(STATS, "Stats", stats, WORKER, 0)                  \
  X(CHECKPOINT, "Checkpoint", checkpoint, ADMIN, 0)    \
  X(GETSTATE, "GetState", getstate, WORKER, 0)         \
  X(EXCHANGE, "Exchange", exchange, PEER, 0)         \
  X(REPLICATE, "Replicate", replicate, PEER, 1)

/* The service's path prefix: "/factorps.v1.ParameterServer/" "PushPull". */
#define FPS_METHOD_PREFIX "/factorps.v1.ParameterServer/"

typedef enum fps_method_e {
#define FPS__METHOD_ENUM(id, name, handler, role, streaming) FPS_METHOD_##id,
  FPS_METHOD_MAP(FPS__METHOD_ENUM)
#undef FPS__METHOD_ENUM
  FPS_METHOD_COUNT
} fps_method_t;

#endif

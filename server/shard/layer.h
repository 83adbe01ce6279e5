/* Forced into every file of the shard core (-include, server/CMakeLists.txt):
 * the core knows no gRPC and no protobuf-c, and the compiler enforces it.
 * Any gRPC or protobuf-c header declares one of these names, so including
 * one here fails the build instead of quietly pointing a layer upward. */
#ifndef FPS_SHARD_LAYER_H
#define FPS_SHARD_LAYER_H
#pragma GCC poison grpc_status_code grpc_call grpc_byte_buffer gpr_timespec
#pragma GCC poison ProtobufCMessage ProtobufCMessageDescriptor ProtobufCBinaryData
#endif

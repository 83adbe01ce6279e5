/* libFuzzer target: the cost walker (server/wire_cost.c) against what
 * protobuf-c's unpack really allocates.
 *
 * Input: one byte choosing the request type (Create, Pull, GetState,
 * Stats, Checkpoint, Exchange, Replicate, PushPull), then the message.
 * Oracle (aborts): the walker's count is at least the peak of the live
 * allocations of protobuf_c_message_unpack() of the same bytes, each
 * counted as the walker's malloc model counts it, and the unpacked message
 * frees everything; with a limit (half the count) the walk stops past it.
 * The walker itself must never read past the input (ASan) nor fail. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "factorps/v1/factorps.pb-c.h"
#include "../mocks/count_alloc.h"
#include "wire_cost.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const ProtobufCMessageDescriptor *const fz_requests[] = {
    &factorps__v1__create_request__descriptor,
    &factorps__v1__pull_request__descriptor,
    &factorps__v1__get_state_request__descriptor,
    &factorps__v1__stats_request__descriptor,
    &factorps__v1__checkpoint_request__descriptor,
    &factorps__v1__exchange_request__descriptor,
    &factorps__v1__replicate_request__descriptor,
    &factorps__v1__push_pull_request__descriptor,
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const ProtobufCMessageDescriptor *d = fz_requests[data[0] % (sizeof fz_requests / sizeof fz_requests[0])];
  data++;
  size--;
  uint64_t cost = fps_wire_cost(d, data, size, UINT64_MAX);
  fps_count_t c = {0, 0};
  ProtobufCAllocator a = {fps_count_alloc, fps_count_free, &c};
  ProtobufCMessage *m = protobuf_c_message_unpack(d, &a, size, data);
  protobuf_c_message_free_unpacked(m, &a);
  /* Stopped past a limit, and only then. */
  uint64_t limit = cost / 2, part = fps_wire_cost(d, data, size, limit);
  if ((part > limit) != (cost > limit) || part > cost) {
    fprintf(stderr, "fuzz_wire_cost: %s of %zu bytes: limit %llu: %llu, full %llu\n", d->name, size,
            (unsigned long long)limit, (unsigned long long)part, (unsigned long long)cost);
    abort();
  }
  if (c.live != 0 || c.peak > cost) {
    fprintf(stderr, "fuzz_wire_cost: %s of %zu bytes: walker %llu, protobuf-c peak %llu, left %llu\n", d->name,
            size, (unsigned long long)cost, (unsigned long long)c.peak, (unsigned long long)c.live);
    abort();
  }
  return 0;
}

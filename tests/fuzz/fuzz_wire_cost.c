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
#include "wire_cost.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct fz_counter_s {
  uint64_t live, peak;
} fz_counter_t;

typedef union fz_hdr_u {
  size_t size;
  max_align_t align;
} fz_hdr_t;

static void *fz_alloc(void *data, size_t size) {
  fz_counter_t *c = data;
  fz_hdr_t *h = malloc(sizeof *h + size);
  if (!h) return NULL;
  h->size = size;
  c->live += fps_wire_cost_chunk(size);
  if (c->live > c->peak) c->peak = c->live;
  return h + 1;
}

static void fz_free(void *data, void *p) {
  if (!p) return;
  fz_counter_t *c = data;
  fz_hdr_t *h = (fz_hdr_t *)p - 1;
  c->live -= fps_wire_cost_chunk(h->size);
  free(h);
}

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
  fz_counter_t c = {0, 0};
  ProtobufCAllocator a = {fz_alloc, fz_free, &c};
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

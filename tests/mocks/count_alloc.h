/* A protobuf-c allocator that counts, for the decode-cost walker's tests
 * (tests/unit/server/test_wire_cost.c, tests/fuzz/fuzz_wire_cost.c): each
 * block is counted at glibc's chunk size, the walker's own model
 * (fps_wire_cost_chunk), and the peak of the live total is kept. Use as
 * ProtobufCAllocator a = {fps_count_alloc, fps_count_free, &counter}. */
#ifndef FPS_TESTS_COUNT_ALLOC_H
#define FPS_TESTS_COUNT_ALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "wire_cost.h"

typedef struct fps_count_s {
  uint64_t live, peak;
} fps_count_t;

/* The block's size, kept in front of it so that free can count it back. */
typedef union fps_count_hdr_u {
  size_t size;
  max_align_t align;
} fps_count_hdr_t;

static inline void *fps_count_alloc(void *data, size_t size) {
  fps_count_t *c = data;
  fps_count_hdr_t *h = malloc(sizeof *h + size);
  if (!h) return NULL;
  h->size = size;
  c->live += fps_wire_cost_chunk(size);
  if (c->live > c->peak) c->peak = c->live;
  return h + 1;
}

static inline void fps_count_free(void *data, void *p) {
  if (!p) return;
  fps_count_t *c = data;
  fps_count_hdr_t *h = (fps_count_hdr_t *)p - 1;
  c->live -= fps_wire_cost_chunk(h->size);
  free(h);
}

#endif

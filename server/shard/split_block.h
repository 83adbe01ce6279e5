/* Create of one row block of a split tensor (issue 12, proto SplitBlock):
 * the checks of the block map a shard can make on its own. The shard does
 * not hold blocks yet; rpc_create.c refuses a valid block with
 * UNIMPLEMENTED after these checks, so a client learns first whether its
 * map is wrong. gRPC-free (shard core). */
#ifndef FPS_SHARD_SPLIT_BLOCK_H
#define FPS_SHARD_SPLIT_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"

/* A block map as it arrives (SplitBlock's fields). */
typedef struct fps_split_map_s {
  uint32_t block_index;
  const uint64_t *bounds;         /* n_bounds = blocks + 1 */
  size_t n_bounds;
  const uint32_t *block_shards;   /* one per block */
  size_t n_block_shards;
  uint32_t shard_count;           /* the count the map was made for */
} fps_split_map_t;

/* Checks block `map` of tensor `name` (shape already validated) against
 * this shard (shard_id of shard_count). Returns 0 (then *row_lo and *row_hi,
 * may be NULL, get the block's rows), FPS_ESTATE (map made for another
 * shard count, or the block is another shard's: the message names both
 * counts / ids) or FPS_EINVAL (inconsistent geometry, naming the field).
 * The count is checked first: a map for another count says nothing about
 * this job's geometry. */
int fps_shard_split_check(const char *name, const fps_shape_t *shape, const fps_split_map_t *map,
                          uint32_t shard_id, uint32_t shard_count, uint64_t *row_lo,
                          uint64_t *row_hi, char *why, size_t why_len);

#endif

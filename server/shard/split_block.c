/* Checks of a split tensor's block map at Create (split_block.h). */
#include "split_block.h"

#include <stdio.h>

#include "adafactor_split.h"

int fps_shard_split_check(const char *name, const fps_shape_t *shape, const fps_split_map_t *map,
                          uint32_t shard_id, uint32_t shard_count, uint64_t *row_lo,
                          uint64_t *row_hi, char *why, size_t why_len) {
  char sub[256];
  if (map->shard_count != shard_count) {
    snprintf(why, why_len,
             "tensor '%s': split block placed for %u shards, but this shard is one of %u "
             "(--shard-count)",
             name, map->shard_count, shard_count);
    return FPS_ESTATE;
  }
  if (map->n_bounds < 3 || map->n_bounds - 1 > FPS_SPLIT_MAX_BLOCKS) {
    snprintf(why, why_len,
             "tensor '%s': split.bounds has %zu entries; a split needs 2 to %d blocks (one more "
             "bound than blocks)",
             name, map->n_bounds, FPS_SPLIT_MAX_BLOCKS);
    return FPS_EINVAL;
  }
  const size_t nb = map->n_bounds - 1;
  int rc = fps_split_bounds_validate(shape, map->bounds, nb, sub, sizeof sub);
  if (rc) {
    snprintf(why, why_len, "tensor '%s': split.bounds: %s", name, sub);
    return FPS_EINVAL;
  }
  if (map->n_block_shards != nb) {
    snprintf(why, why_len, "tensor '%s': split.block_shards has %zu entries for %zu blocks", name,
             map->n_block_shards, nb);
    return FPS_EINVAL;
  }
  for (size_t b = 0; b < nb; b++) {
    if (map->block_shards[b] >= shard_count) {
      snprintf(why, why_len, "tensor '%s': split.block_shards[%zu] is shard %u of %u", name, b,
               map->block_shards[b], shard_count);
      return FPS_EINVAL;
    }
    if (b && map->block_shards[b] <= map->block_shards[b - 1]) {
      snprintf(why, why_len,
               "tensor '%s': split.block_shards must increase (at most one block per shard), "
               "but block %zu is on shard %u after shard %u",
               name, b, map->block_shards[b], map->block_shards[b - 1]);
      return FPS_EINVAL;
    }
  }
  if (map->block_index >= nb) {
    snprintf(why, why_len, "tensor '%s': split.block_index %u of %zu blocks", name,
             map->block_index, nb);
    return FPS_EINVAL;
  }
  if (map->block_shards[map->block_index] != shard_id) {
    snprintf(why, why_len,
             "tensor '%s': split block %u is placed on shard %u, but this is shard %u "
             "(--shard-id)",
             name, map->block_index, map->block_shards[map->block_index], shard_id);
    return FPS_ESTATE;
  }
  if (row_lo) *row_lo = map->bounds[map->block_index];
  if (row_hi) *row_hi = map->bounds[map->block_index + 1];
  return 0;
}

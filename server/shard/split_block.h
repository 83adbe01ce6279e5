/* Create of one row block of a split tensor (proto SplitBlock):
 * the checks of the block map a shard can make on its own, whether this
 * shard may hold blocks at all, create-or-match of two maps, and a
 * block's state sizes. create.c applies them; split_tensor.h says how a
 * block lives in the store. gRPC-free (shard core). */
#ifndef FPS_SHARD_SPLIT_BLOCK_H
#define FPS_SHARD_SPLIT_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "adafactor_split.h"

struct fps_shard_s;
struct fps_tensor_split_s;

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

/* Whether this shard can hold split blocks at all: FPS_ESTATE naming the
 * tensor and the reason (no sender installed: "this shard has no
 * --peers"; async/ssp mode: "split tensors need --mode sync"), else 0.
 * The one place these rules live (the cross-shard step may lift the mode
 * rule). */
int fps_shard_split_allowed(const struct fps_shard_s *sh, const char *name, char *why,
                            size_t why_len);

/* Create-or-match of tensor `name`: the map it is held with (`have`, NULL:
 * held whole) against the one asked for (`want`, NULL: whole). 0 if they
 * are the same (both whole, or equal block_index, bounds, block_shards and
 * shard_count), else FPS_EEXISTS naming what differs (existing vs
 * requested). */
int fps_shard_split_match(const char *name, const fps_split_map_t *have, const fps_split_map_t *want,
                          char *why, size_t why_len);

/* The map a block tensor's t->split holds, as a view (points into it). */
void fps_shard_split_map_of(const struct fps_tensor_split_s *s, fps_split_map_t *out);

/* The optimizer state a block keeps (proto SplitBlock): STATE_ROW its
 * rows, STATE_COL cols per touched matrix (factored), STATE_VAR its
 * elements (1-D), STATE_MOM its elements (hf with beta1); AdamW's figure
 * for its elements. */
void fps_shard_split_state_size(const fps_split_geom_t *g, const fps_adafactor_hparams_t *hp,
                                fps_state_size_t *out);

#endif

/* Checks of a split tensor's block map at Create (internal.h). */
#include "internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>


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

int fps_shard_split_allowed(const fps_shard_t *sh, const char *name, char *why, size_t why_len) {
  if (sh->cfg.mode != FPS_MODE_SYNC) {
    snprintf(why, why_len,
             "tensor '%s': this shard runs in %s mode; split tensors need --mode sync (their step "
             "waits for every block's round)",
             name, fps_mode_name(sh->cfg.mode));
    return FPS_ESTATE;
  }
  if (!sh->xsend) {
    snprintf(why, why_len,
             "tensor '%s': this shard has no --peers, so it cannot hold a block of a split tensor "
             "(its step exchanges partial sums with the other blocks' shards)",
             name);
    return FPS_ESTATE;
  }
  return 0;
}

/* "[0, 3, 7]" of n values into buf (shortened with "..." past its room). */
static void fps__u64_list(const uint64_t *v64, const uint32_t *v32, size_t n, char *buf, size_t len) {
  size_t k = (size_t)snprintf(buf, len, "[");
  for (size_t i = 0; i < n && k < len; i++) {
    if (k + 28 > len) {
      k += (size_t)snprintf(buf + k, len - k, "...");
      break;
    }
    uint64_t x = v64 ? v64[i] : v32[i];
    k += (size_t)snprintf(buf + k, len - k, "%s%" PRIu64, i ? ", " : "", x);
  }
  if (k < len) snprintf(buf + k, len - k, "]");
}

int fps_shard_split_match(const char *name, const fps_split_map_t *have, const fps_split_map_t *want,
                          char *why, size_t why_len) {
  if (!have && !want) return 0;
  if (!have || !want) {
    const fps_split_map_t *m = have ? have : want;
    snprintf(why, why_len,
             have ? "tensor '%s' already exists here as block %u of a split tensor (%zu blocks for "
                    "%u shards), not whole: a tensor is split or whole from its first Create on"
                  : "tensor '%s' already exists here whole, not as block %u of a split tensor (%zu "
                    "blocks for %u shards): a tensor is split or whole from its first Create on",
             name, m->block_index, m->n_bounds - 1, m->shard_count);
    return FPS_EEXISTS;
  }
  char a[512], b[512];
  const char *what = NULL;
  if (have->shard_count != want->shard_count) {
    snprintf(why, why_len,
             "tensor '%s' already exists here as a block placed for %u shards, not %u (existing vs "
             "requested)",
             name, have->shard_count, want->shard_count);
    return FPS_EEXISTS;
  }
  if (have->n_bounds != want->n_bounds ||
      memcmp(have->bounds, want->bounds, have->n_bounds * sizeof *have->bounds) != 0) {
    fps__u64_list(have->bounds, NULL, have->n_bounds, a, sizeof a);
    fps__u64_list(want->bounds, NULL, want->n_bounds, b, sizeof b);
    what = "split.bounds";
  } else if (have->n_block_shards != want->n_block_shards ||
             memcmp(have->block_shards, want->block_shards,
                    have->n_block_shards * sizeof *have->block_shards) != 0) {
    fps__u64_list(NULL, have->block_shards, have->n_block_shards, a, sizeof a);
    fps__u64_list(NULL, want->block_shards, want->n_block_shards, b, sizeof b);
    what = "split.block_shards";
  } else if (have->block_index != want->block_index) {
    snprintf(a, sizeof a, "%u", have->block_index);
    snprintf(b, sizeof b, "%u", want->block_index);
    what = "split.block_index";
  }
  if (!what) return 0;
  snprintf(why, why_len,
           "tensor '%s' already exists here as a split block with %s %s, not %s (existing vs "
           "requested): a tensor's block map is fixed when it is first created",
           name, what, a, b);
  return FPS_EEXISTS;
}

int fps_shard_block_numel(const char *name, const fps_shape_t *shape, const fps_split_map_t *map,
                          uint32_t shard_id, uint32_t shard_count, uint64_t *numel, char *why, size_t why_len) {
  uint64_t lo = 0, hi = 0;
  int rc = fps_shard_split_check(name, shape, map, shard_id, shard_count, &lo, &hi, why, why_len);
  if (rc < 0) return rc;
  /* Rows of the last two dimensions' matrices, all batches in a row
   * (proto SplitBlock); a 0-D or 1-D tensor's rows are its elements. */
  uint64_t cols = shape->ndim >= 2 ? shape->dim[shape->ndim - 1] : 1;
  *numel = (hi - lo) * cols;
  return 0;
}

void fps_shard_split_map_of(const fps_tensor_split_t *s, fps_split_map_t *out) {
  *out = (fps_split_map_t){.block_index = s->block_index,
                           .bounds = s->bounds,
                           .n_bounds = (size_t)s->n_blocks + 1,
                           .block_shards = s->block_shards,
                           .n_block_shards = s->n_blocks,
                           .shard_count = s->shard_count};
}

void fps_shard_split_state_size(const fps_split_geom_t *g, const fps_adafactor_hparams_t *hp,
                                fps_state_size_t *out) {
  memset(out, 0, sizeof *out);
  if (g->factored) {
    out->row = g->row_hi - g->row_lo;
    out->col = g->nmat * g->cols;
  } else {
    out->var = g->block_numel;
  }
  if (hp->flavor == FPS_FLAVOR_HF && hp->has_beta1) out->mom = g->block_numel;
  out->elements = out->row + out->col + out->var + out->mom;
  out->bytes = out->elements * sizeof(float);
  out->adamw_elements = 2 * g->block_numel;
  out->adamw_bytes = out->adamw_elements * sizeof(float);
}

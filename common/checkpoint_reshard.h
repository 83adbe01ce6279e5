/* Resharding checkpoints (`factorps checkpoint reshard`): the
 * checkpoints S shards wrote for one job are verified as a whole and
 * gathered into whole tensors, which are then cut by a new placement and
 * written as S' complete checkpoints. Standalone (fps_checkpoint): the
 * placement itself is the client's (fps_client_placement_plan), computed by
 * the caller, so this code and the workers cannot disagree about it.
 *
 * Memory: the gathered job holds every tensor whole (the inputs' arrays are
 * moved, not copied); writing holds one output shard's snapshot at a time
 * on top. Thread-safety: reentrant. */
#ifndef FPS_CHECKPOINT_RESHARD_H
#define FPS_CHECKPOINT_RESHARD_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"

/* Every tensor of a job, whole. */
typedef struct fps_ckpt_job_s {
  char mode[FPS_CKPT_MODE_MAX + 1];     /* the inputs' consistency mode */
  uint32_t shard_count;                 /* how many shards wrote the inputs */
  char job_id[FPS_CKPT_JOB_MAX + 1];    /* the inputs' job, "" = none */
  size_t n;
  fps_ckpt_tensor_t *t;                 /* whole (block.n_blocks 0), sorted by name (strcmp) */
} fps_ckpt_job_t;

/* Verifies that in[0..n_in) are the checkpoints of one job (each written by
 * a different shard of n_in, all in the same mode; every tensor held whole
 * by exactly one shard or as row blocks with one map, one hparams set, each
 * block exactly once, the blocks' versions, steps, RMS and applied lr/weight
 * decay equal and the copies of a shared matrix's column state bit-identical)
 * and gathers them into whole tensors (fps_split_state_to_whole). Moves the
 * inputs' arrays into the job (the inputs stay valid to destroy). Returns 0
 * (*out set; free with fps_ckpt_job_destroy), FPS_ESTATE (not one job, with
 * `why` naming the files and the tensor), FPS_EINVAL or FPS_ENOMEM. On
 * failure the inputs are unchanged. */
int fps_ckpt_job_gather(fps_ckpt_t *const *in, size_t n_in, fps_ckpt_job_t **out, char *why,
                        size_t why_len);

void fps_ckpt_job_destroy(fps_ckpt_job_t *job);

/* One block of the new placement: rows [row_lo, row_hi) of job->t[tensor]
 * (flattened rows of the [..., R, C] view; elements for ndim <= 1) on
 * `shard`. A tensor placed on one shard is one block of all its rows. */
typedef struct fps_ckpt_place_s {
  size_t tensor;
  uint32_t shard;
  uint64_t row_lo, row_hi;
} fps_ckpt_place_t;

/* Writes the job as shard_count checkpoints, output shard k into
 * out_dirs[k] (created if missing, mode 0700; each must hold no checkpoint
 * yet, and all must be different directories). plan: every tensor's blocks,
 * tensors in job order, each tensor's in row order covering all its rows
 * with shards strictly increasing (what fps_client_placement_plan gives).
 * A tensor of one block is written whole, the others as row blocks with the
 * map (bounds, block_shards, shard_count) of the plan. Every output is
 * complete and checksummed (fps_ckpt_write: temporary name, fsync, rename),
 * and the call is all or nothing: if anything fails, the checkpoints it
 * already wrote are deleted and the directories it created removed.
 * written (shard_count entries, may be NULL) gets what each write did.
 * Returns 0; FPS_EINVAL (a plan that does not cover the job, bad counts,
 * `why` says which); FPS_EEXISTS (an out dir already holds checkpoints, or
 * two are the same); FPS_EIO, FPS_ENOMEM, or what fps_ckpt_write returns. */
int fps_ckpt_job_write(const fps_ckpt_job_t *job, const fps_ckpt_place_t *plan, size_t n_plan,
                       uint32_t shard_count, const char *const *out_dirs,
                       fps_ckpt_written_t *written, char *why, size_t why_len);

#endif

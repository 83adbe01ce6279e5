/* Resharding: verify S checkpoints as one job, gather whole tensors, write
 * S' checkpoints of a new placement (checkpoint_reshard.h). */
#include "checkpoint_reshard.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "checkpoint_internal.h"

#define FAIL(code, ...)                              \
  do {                                               \
    fps__ckpt_why(why, why_len, __VA_ARGS__);        \
    rc = (code);                                     \
    goto done;                                       \
  } while (0)

/* ------------------------------------------------------------ gather */

/* Where one tensor (whole or a block) of the inputs is. */
typedef struct occ_s {
  const fps_ckpt_tensor_t *t;
  size_t file;
} occ_t;

static int occ_cmp(const void *a, const void *b) {
  const occ_t *x = a, *y = b;
  int c = strcmp(x->t->name, y->t->name);
  if (c) return c;
  if (x->t->block.block_index != y->t->block.block_index)
    return x->t->block.block_index < y->t->block.block_index ? -1 : 1;
  return x->file < y->file ? -1 : x->file > y->file;
}

static bool hp_equal(const fps_adafactor_hparams_t *a, const fps_adafactor_hparams_t *b) {
  return a->flavor == b->flavor && a->has_lr == b->has_lr && a->lr == b->lr &&
         a->decay == b->decay && a->eps1 == b->eps1 && a->eps2 == b->eps2 && a->clip == b->clip &&
         a->weight_decay == b->weight_decay && a->maximize == b->maximize &&
         a->has_beta1 == b->has_beta1 && a->beta1 == b->beta1 &&
         a->scale_parameter == b->scale_parameter && a->relative_step == b->relative_step &&
         a->warmup_init == b->warmup_init;
}

static bool shape_equal(const fps_shape_t *a, const fps_shape_t *b) {
  if (a->ndim != b->ndim) return false;
  for (uint32_t d = 0; d < a->ndim; d++)
    if (a->dim[d] != b->dim[d]) return false;
  return true;
}

static bool map_equal(const fps_ckpt_block_t *a, const fps_ckpt_block_t *b) {
  return a->n_blocks == b->n_blocks && a->shard_count == b->shard_count &&
         !memcmp(a->bounds, b->bounds, ((size_t)a->n_blocks + 1) * sizeof *a->bounds) &&
         !memcmp(a->block_shards, b->block_shards, (size_t)a->n_blocks * sizeof *a->block_shards);
}

/* The checks of one split tensor's blocks g[0..n) (sorted by block index).
 * in: the inputs, for file names. */
static int check_blocks(fps_ckpt_t *const *in, const occ_t *g, size_t n, char *why,
                        size_t why_len) {
  int rc = 0;
  const fps_ckpt_tensor_t *b0 = g[0].t;
  const char *name = b0->name, *f0 = in[g[0].file]->path;
  for (size_t k = 0; k < n; k++) {
    const fps_ckpt_tensor_t *t = g[k].t;
    const char *f = in[g[k].file]->path;
    if (!t->block.n_blocks)
      FAIL(FPS_ESTATE, "tensor '%s' is held whole by %s but as row blocks by %s", name, f, f0);
    if (!shape_equal(&t->bstate.g.shape, &b0->bstate.g.shape) || !map_equal(&t->block, &b0->block))
      FAIL(FPS_ESTATE, "tensor '%s': %s and %s hold blocks of different shapes or block maps", name,
           f0, f);
    if (!hp_equal(&t->hparams, &b0->hparams))
      FAIL(FPS_ESTATE, "tensor '%s': %s and %s hold blocks with different hyperparameters", name,
           f0, f);
    if (t->block.block_index != k) {
      /* Sorted by index: a gap is a missing block, a repeat a duplicate. */
      if (k && t->block.block_index == g[k - 1].t->block.block_index)
        FAIL(FPS_ESTATE, "tensor '%s': block %u is in both %s and %s", name, t->block.block_index,
             in[g[k - 1].file]->path, f);
      break;
    }
    if (t->version != b0->version || t->bstate.step != b0->bstate.step ||
        memcmp(&t->bstate.rms, &b0->bstate.rms, sizeof(float)) != 0 ||
        t->last_lr != b0->last_lr || t->last_weight_decay != b0->last_weight_decay)
      FAIL(FPS_ESTATE,
           "tensor '%s': block %zu in %s is at version %" PRIu64 " (step %" PRIu64
           "), block 0 in %s at version %" PRIu64 " (step %" PRIu64
           ") or their RMS or last lr differ: the shards' checkpoints are not of the same step",
           name, k, f, t->version, t->bstate.step, f0, b0->version, b0->bstate.step);
    if (k && t->bstate.g.factored) {
      const fps_split_geom_t *pg = &g[k - 1].t->bstate.g, *cg = &t->bstate.g;
      if (pg->mtx_lo + pg->nmat - 1 == cg->mtx_lo &&
          memcmp(g[k - 1].t->bstate.col + (pg->nmat - 1) * pg->cols, t->bstate.col,
                 cg->cols * sizeof(float)) != 0)
        FAIL(FPS_ESTATE,
             "tensor '%s': the column state of matrix %" PRIu64
             " differs between block %zu in %s and block %zu in %s (the shards diverged)",
             name, cg->mtx_lo, k - 1, in[g[k - 1].file]->path, k, f);
    }
  }
  /* Stopped early or ran out: the first index not present is missing. */
  for (uint32_t want = 0; want < b0->block.n_blocks; want++) {
    if (want < n && g[want].t->block.block_index == want) continue;
    uint32_t s = b0->block.block_shards[want];
    const char *holder = NULL;
    for (size_t i = 0; i < b0->block.shard_count && in[i]; i++)
      if (in[i]->info.shard.shard_id == s) holder = in[i]->path;
    FAIL(FPS_ESTATE, "tensor '%s': block %u of %u (rows [%" PRIu64 ", %" PRIu64
         "), shard %u) is missing%s%s",
         name, want, b0->block.n_blocks, b0->block.bounds[want], b0->block.bounds[want + 1], s,
         holder ? " from " : "", holder ? holder : "");
  }
  if (n > b0->block.n_blocks)
    FAIL(FPS_ESTATE, "tensor '%s': more blocks than its map's %u", name, b0->block.n_blocks);
done:
  return rc;
}

void fps_ckpt_job_destroy(fps_ckpt_job_t *job) {
  if (!job) return;
  for (size_t i = 0; i < job->n; i++) {
    fps_free(job->t[i].param);
    fps_adafactor_state_destroy(&job->t[i].state);
  }
  fps_free(job->t);
  fps_free(job);
}

int fps_ckpt_job_gather(fps_ckpt_t *const *in, size_t n_in, fps_ckpt_job_t **out, char *why,
                        size_t why_len) {
  int rc = 0;
  occ_t *occ = NULL;
  size_t *start = NULL, n_occ = 0, n_groups = 0;
  const char **by_shard = NULL;
  fps_ckpt_job_t *job = NULL;
  if (!out) return FPS_EINVAL;
  *out = NULL;
  if (!in || n_in == 0) FAIL(FPS_EINVAL, "no input checkpoints");
  for (size_t i = 0; i < n_in; i++)
    if (!in[i]) FAIL(FPS_EINVAL, "input %zu is missing", i);
  by_shard = fps_calloc(n_in, sizeof *by_shard);
  if (!by_shard) FAIL(FPS_ENOMEM, "out of memory");
  for (size_t i = 0; i < n_in; i++) {
    const fps_ckpt_shard_t *s = &in[i]->info.shard;
    if (s->shard_count != n_in)
      FAIL(FPS_ESTATE,
           "%s was written by shard %u of %u, but %zu input checkpoints were given: pass one "
           "directory per shard of the job",
           in[i]->path, s->shard_id, s->shard_count, n_in);
    if (by_shard[s->shard_id])
      FAIL(FPS_ESTATE, "%s and %s were both written by shard %u", by_shard[s->shard_id],
           in[i]->path, s->shard_id);
    by_shard[s->shard_id] = in[i]->path;
    if (strcmp(s->mode, in[0]->info.shard.mode) != 0)
      FAIL(FPS_ESTATE, "%s was written in mode %s, %s in mode %s: not one job", in[0]->path,
           in[0]->info.shard.mode, in[i]->path, s->mode);
    if (strcmp(s->job_id, in[0]->info.shard.job_id) != 0)
      FAIL(FPS_ESTATE, "%s was written for job '%s', %s for job '%s': not one job", in[0]->path,
           in[0]->info.shard.job_id, in[i]->path, s->job_id);
    n_occ += in[i]->n_tensors;
  }
  occ = fps_malloc((n_occ ? n_occ : 1) * sizeof *occ);
  start = fps_malloc((n_occ + 1) * sizeof *start);
  if (!occ || !start) FAIL(FPS_ENOMEM, "out of memory");
  for (size_t i = 0, k = 0; i < n_in; i++)
    for (size_t j = 0; j < in[i]->n_tensors; j++) occ[k++] = (occ_t){&in[i]->tensors[j], i};
  if (n_occ) qsort(occ, n_occ, sizeof *occ, occ_cmp);
  for (size_t k = 0; k < n_occ; k++)
    if (k == 0 || strcmp(occ[k].t->name, occ[k - 1].t->name) != 0) start[n_groups++] = k;
  start[n_groups] = n_occ;

  /* Pass 1: every check, nothing changed. */
  for (size_t gi = 0; gi < n_groups; gi++) {
    const occ_t *g = occ + start[gi];
    size_t n = start[gi + 1] - start[gi];
    if (!g[0].t->block.n_blocks) {
      if (n > 1)
        FAIL(FPS_ESTATE, "tensor '%s' is held whole by %s and also by %s", g[0].t->name,
             in[g[0].file]->path, in[g[1].file]->path);
      continue;
    }
    if ((rc = check_blocks(in, g, n, why, why_len)) < 0) goto done;
  }

  /* Pass 2: allocate the gathered tensors (may fail: inputs unchanged),
   * then move the whole ones (cannot fail). */
  job = fps_calloc(1, sizeof *job);
  if (!job || !(job->t = fps_calloc(n_groups ? n_groups : 1, sizeof *job->t)))
    FAIL(FPS_ENOMEM, "out of memory");
  snprintf(job->mode, sizeof job->mode, "%s", in[0]->info.shard.mode);
  snprintf(job->job_id, sizeof job->job_id, "%s", in[0]->info.shard.job_id);
  job->shard_count = (uint32_t)n_in;
  for (size_t gi = 0; gi < n_groups; gi++) {
    const occ_t *g = occ + start[gi];
    const fps_ckpt_tensor_t *b0 = g[0].t;
    fps_ckpt_tensor_t *jt = &job->t[gi];
    job->n = gi + 1;
    snprintf(jt->name, sizeof jt->name, "%s", b0->name);
    jt->hparams = b0->hparams;
    jt->version = b0->version;
    jt->last_lr = b0->last_lr;
    jt->last_weight_decay = b0->last_weight_decay;
    if (!b0->block.n_blocks) continue;
    const fps_split_geom_t *wg = &b0->bstate.g;
    void *p = NULL;
    if (fps_aligned_alloc(&p, 64, (size_t)wg->numel * sizeof(float)) != 0)
      FAIL(FPS_ENOMEM, "out of memory for tensor '%s'", b0->name);
    jt->param = p;
    if ((rc = fps_adafactor_state_init(&jt->state, &wg->shape, &jt->hparams)) < 0)
      FAIL(rc, "tensor '%s': cannot allocate its whole state: %s", b0->name, fps_strerror(rc));
    for (uint32_t k = 0; k < b0->block.n_blocks; k++) {
      const fps_ckpt_tensor_t *t = g[k].t;
      memcpy(jt->param + t->bstate.g.row_lo * t->bstate.g.cols, t->param,
             (size_t)t->bstate.g.block_numel * sizeof(float));
      if ((rc = fps_split_state_to_whole(&t->bstate, &jt->state)) < 0)
        FAIL(FPS_ESTATE, "tensor '%s': block %u in %s does not fit the tensor's state", b0->name, k,
             in[g[k].file]->path);
    }
  }
  for (size_t gi = 0; gi < n_groups; gi++) {
    fps_ckpt_tensor_t *src = (fps_ckpt_tensor_t *)occ[start[gi]].t;
    if (src->block.n_blocks) continue;
    job->t[gi].param = src->param;
    job->t[gi].state = src->state;
    src->param = NULL;
    memset(&src->state, 0, sizeof src->state);
  }
  *out = job;
  job = NULL;
done:
  fps_ckpt_job_destroy(job);
  fps_free(occ);
  fps_free(start);
  fps_free(by_shard);
  return rc;
}

/* ------------------------------------------------------------- write */

/* Rows blocks of this shape are cut from (checkpoint.h ROW BLOCKS). */
static uint64_t total_rows(const fps_shape_t *shape) {
  if (shape->ndim == 0) return 1;
  return fps_split_total_rows(shape);
}

/* The output directories: created if missing, empty of checkpoints,
 * pairwise different. created[k] records what to remove on failure. */
static int prepare_dirs(const char *const *dirs, uint32_t n, bool *created, char *why,
                        size_t why_len) {
  int rc = 0;
  struct stat *st = fps_calloc(n, sizeof *st);
  if (!st) FAIL(FPS_ENOMEM, "out of memory");
  for (uint32_t k = 0; k < n; k++) {
    if (!dirs[k] || !*dirs[k]) FAIL(FPS_EINVAL, "output directory %u is not given", k);
    if (mkdir(dirs[k], 0700) == 0) created[k] = true;
    else if (errno != EEXIST) FAIL(FPS_EIO, "create %s: %s", dirs[k], strerror(errno));
    if (stat(dirs[k], &st[k]) < 0) FAIL(FPS_EIO, "%s: %s", dirs[k], strerror(errno));
    if (!S_ISDIR(st[k].st_mode)) FAIL(FPS_EINVAL, "%s is not a directory", dirs[k]);
    for (uint32_t j = 0; j < k; j++)
      if (st[j].st_dev == st[k].st_dev && st[j].st_ino == st[k].st_ino)
        FAIL(FPS_EEXISTS, "output directories %s and %s are the same directory", dirs[j], dirs[k]);
    int fd = open(dirs[k], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) FAIL(FPS_EIO, "open %s: %s", dirs[k], strerror(errno));
    fps__ckpt_file_t *files = NULL;
    size_t nf = 0;
    int src = fps__ckpt_scan(fd, &files, &nf);
    close(fd);
    fps_free(files);
    if (src < 0) FAIL(src, "scan %s: %s", dirs[k], src == FPS_ENOMEM ? "out of memory" : strerror(errno));
    if (nf)
      FAIL(FPS_EEXISTS,
           "%s already holds %zu checkpoint%s: the outputs must go into directories without any",
           dirs[k], nf, nf == 1 ? "" : "s");
  }
done:
  fps_free(st);
  return rc;
}

/* Checks the plan against the job; first[i] .. first[i + 1] are tensor i's
 * blocks. */
static int check_plan(const fps_ckpt_job_t *job, const fps_ckpt_place_t *plan, size_t n_plan,
                      uint32_t shard_count, size_t *first, char *why, size_t why_len) {
  int rc = 0;
  size_t p = 0;
  for (size_t i = 0; i < job->n; i++) {
    const fps_ckpt_tensor_t *t = &job->t[i];
    const uint64_t rows = total_rows(&t->state.shape);
    first[i] = p;
    uint64_t at = 0;
    long prev_shard = -1;
    for (; p < n_plan && plan[p].tensor == i; p++) {
      const fps_ckpt_place_t *b = &plan[p];
      if (b->row_lo != at || b->row_hi <= b->row_lo || b->row_hi > rows)
        FAIL(FPS_EINVAL, "plan: tensor '%s' block rows [%" PRIu64 ", %" PRIu64
             ") do not continue at row %" PRIu64 " of %" PRIu64,
             t->name, b->row_lo, b->row_hi, at, rows);
      if (b->shard >= shard_count || (long)b->shard <= prev_shard)
        FAIL(FPS_EINVAL, "plan: tensor '%s' has a block on shard %u (of %u) after shard %ld",
             t->name, b->shard, shard_count, prev_shard);
      at = b->row_hi;
      prev_shard = b->shard;
    }
    if (at != rows)
      FAIL(FPS_EINVAL, "plan: tensor '%s' has %" PRIu64 " of its %" PRIu64 " rows placed", t->name,
           at, rows);
    if (p - first[i] > FPS_SPLIT_MAX_BLOCKS)
      FAIL(FPS_EINVAL, "plan: tensor '%s' has more than %d blocks", t->name, FPS_SPLIT_MAX_BLOCKS);
  }
  first[job->n] = p;
  if (p != n_plan)
    FAIL(FPS_EINVAL, "plan: block %zu is of tensor %zu, not of one of the job's %zu in order", p,
         plan[p].tensor, job->n);
done:
  return rc;
}

/* Adds tensor t's block b (one of nb at plan[0..nb)) to the snapshot. */
static int add_placed(fps_ckpt_snapshot_t *s, const fps_ckpt_tensor_t *t,
                      const fps_ckpt_place_t *plan, size_t nb, size_t b, uint64_t *bounds,
                      uint32_t *shards, uint32_t shard_count, char *why, size_t why_len) {
  size_t idx = 0;
  int rc;
  if (nb == 1) {
    rc = fps_ckpt_snapshot_add(s, t->name, &t->state.shape, &t->hparams, &idx, why, why_len);
    if (rc == 0) rc = fps_ckpt_snapshot_copy(s, idx, t->version, t->param, &t->state);
  } else {
    for (size_t k = 0; k < nb; k++) {
      bounds[k] = plan[k].row_lo;
      shards[k] = plan[k].shard;
    }
    bounds[nb] = plan[nb - 1].row_hi;
    fps_ckpt_block_t map = {.block_index = (uint32_t)b, .n_blocks = (uint32_t)nb,
                            .bounds = bounds, .block_shards = shards, .shard_count = shard_count};
    rc = fps_ckpt_snapshot_add_block(s, t->name, &t->state.shape, &t->hparams, &map, &idx, why,
                                     why_len);
    if (rc < 0) return rc;
    fps_split_geom_t g;
    fps_split_state_t st;
    rc = fps_split_geom_init(&g, &t->state.shape, plan[b].row_lo, plan[b].row_hi, why, why_len);
    if (rc < 0) return rc;
    rc = fps_split_state_init(&st, &g, &t->hparams);
    if (rc == 0) rc = fps_split_state_from_whole(&st, &t->state);
    if (rc == 0) rc = fps_ckpt_snapshot_copy_block(s, idx, t->version, t->param + g.row_lo * g.cols, &st);
    fps_split_state_destroy(&st);
  }
  if (rc == 0) rc = fps_ckpt_snapshot_set_applied(s, idx, t->last_lr, t->last_weight_decay);
  if (rc < 0 && why && !*why)
    fps__ckpt_why(why, why_len, "tensor '%s': cannot copy it: %s", t->name, fps_strerror(rc));
  return rc;
}

int fps_ckpt_job_write(const fps_ckpt_job_t *job, const fps_ckpt_place_t *plan, size_t n_plan,
                       uint32_t shard_count, const char *const *out_dirs,
                       fps_ckpt_written_t *written, char *why, size_t why_len) {
  int rc = 0;
  size_t *first = NULL;
  bool *created = NULL;
  fps_ckpt_written_t *w = NULL;
  uint64_t *bounds = NULL;
  uint32_t *shards = NULL, done_k = 0;
  fps_ckpt_snapshot_t *s = NULL;
  if (why && why_len) why[0] = '\0';
  if (!job || !out_dirs || (!plan && n_plan) || shard_count == 0)
    FAIL(FPS_EINVAL, "bad argument (no job, plan, output directories or shard count)");
  first = fps_malloc((job->n + 1) * sizeof *first);
  created = fps_calloc(shard_count, sizeof *created);
  w = fps_calloc(shard_count, sizeof *w);
  bounds = fps_malloc((FPS_SPLIT_MAX_BLOCKS + 1) * sizeof *bounds);
  shards = fps_malloc(FPS_SPLIT_MAX_BLOCKS * sizeof *shards);
  if (!first || !created || !w || !bounds || !shards) FAIL(FPS_ENOMEM, "out of memory");
  if ((rc = check_plan(job, plan, n_plan, shard_count, first, why, why_len)) < 0) goto done;
  if ((rc = prepare_dirs(out_dirs, shard_count, created, why, why_len)) < 0) goto done;
  for (uint32_t k = 0; k < shard_count; k++) {
    if ((rc = fps_ckpt_snapshot_create(&s, k, shard_count, job->mode)) < 0)
      FAIL(rc, "cannot create a snapshot for shard %u: %s", k, fps_strerror(rc));
    if ((rc = fps_ckpt_snapshot_set_job(s, job->job_id)) < 0) FAIL(rc, "bad job id '%s'", job->job_id);
    for (size_t i = 0; i < job->n; i++) {
      size_t nb = first[i + 1] - first[i];
      for (size_t b = 0; b < nb; b++) {
        if (plan[first[i] + b].shard != k) continue;
        rc = add_placed(s, &job->t[i], plan + first[i], nb, b, bounds, shards, shard_count, why,
                        why_len);
        if (rc < 0) goto done;
      }
    }
    if ((rc = fps_ckpt_write(out_dirs[k], s, 1, &w[k], why, why_len)) < 0) goto done;
    done_k = k + 1;
    fps_ckpt_snapshot_destroy(s);
    s = NULL;
  }
  if (written) memcpy(written, w, shard_count * sizeof *w);
done:
  fps_ckpt_snapshot_destroy(s);
  if (rc < 0 && w) {
    /* All or nothing: remove what this call made. */
    for (uint32_t k = 0; k < done_k; k++) unlink(w[k].path);
    for (uint32_t k = 0; created && k < shard_count; k++) {
      if (created[k]) rmdir(out_dirs[k]);
    }
  }
  fps_free(first);
  fps_free(created);
  fps_free(w);
  fps_free(bounds);
  fps_free(shards);
  return rc;
}

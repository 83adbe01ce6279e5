/* A shard's checkpoint of row blocks, restored (no gRPC): a
 * restarted shard comes back with its blocks at their versions, with the
 * block's params, row, column and momentum state, step, RMS and map bit for
 * bit; a Create with the same map then matches the restored block and a
 * different map is refused; a shard that may not hold blocks (no --peers)
 * refuses to start on such a checkpoint instead of serving half a tensor. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "shard_fixture.h"

/* Create only needs a sender to be installed; no step runs here. */
static int never_send(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns,
                      fps_xsend_done_fn done, void *arg) {
  (void)ctx, (void)to_shard, (void)m, (void)deadline_ns, (void)done, (void)arg;
  return FPS_EUNAVAILABLE;
}

/* Shard 1 of 2, sync, one worker, checkpointing into dir; with_peers:
 * a sender installed (the shard was started with --peers). */
static void shard_open(fps_shard_t *sh, const char *dir, bool with_peers, int expect_open) {
  fx_shard(sh, FPS_MODE_SYNC, 1, 0);
  sh->cfg.shard_id = 1;
  sh->cfg.shard_count = 2;
  sh->cfg.checkpoint_dir = dir;
  sh->cfg.checkpoint_keep = 2;
  if (with_peers) fps_shard_set_exchange(sh, never_send, NULL, 5.0);
  assert_int_equal(fps_checkpoint_open(sh), expect_open);
}

static void shard_close(fps_shard_t *sh) {
  fps_checkpoint_close(sh);
  fx_shard_free(sh);
}

static void remove_dir(const char *dir) {
  DIR *dp = opendir(dir);
  assert_non_null(dp);
  for (struct dirent *de; (de = readdir(dp));) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    unlink(path);
  }
  closedir(dp);
  assert_int_equal(rmdir(dir), 0);
}

/* [2, 5, 3] hf with beta1 in blocks [0, 3) on shard 0 and [3, 10) on shard
 * 1: this shard's block spans both matrices (7 rows, 2 x 3 columns, 21
 * elements). */
static const uint64_t D[] = {2, 5, 3};
static const uint64_t BND[] = {0, 3, 10};
static const uint32_t SHARDS[] = {0, 1};

static fps_split_map_t map_of(const uint64_t *bounds) {
  return (fps_split_map_t){.block_index = 1, .bounds = bounds, .n_bounds = 3, .block_shards = SHARDS,
                           .n_block_shards = 2, .shard_count = 2};
}

typedef struct block_values_s {
  float p[21], row[7], col[6], mom[21];
} block_values_t;

static fps_create_item_t block_item(const fps_split_map_t *m, block_values_t *v, fps_slice_t *ps,
                                    fps_state_slice_t st[3]) {
  fps_create_item_t it = {.name = "h", .dims = D, .ndim = 3, .split = m};
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_HF);
  it.hp.relative_step = false;
  it.hp.has_lr = true;
  it.hp.lr = 1e-3;
  it.hp.has_beta1 = true;
  it.hp.beta1 = 0.9;
  if (!v) return it;
  *ps = (fps_slice_t){.dtype = FPS_DTYPE_F32, .offset = 0, .data = (const uint8_t *)v->p, .len = sizeof v->p};
  st[0] = (fps_state_slice_t){.kind = FPS_STATE_ROW, .data = (const uint8_t *)v->row, .len = sizeof v->row};
  st[1] = (fps_state_slice_t){.kind = FPS_STATE_COL, .data = (const uint8_t *)v->col, .len = sizeof v->col};
  st[2] = (fps_state_slice_t){.kind = FPS_STATE_MOM, .data = (const uint8_t *)v->mom, .len = sizeof v->mom};
  it.init = ps;
  it.state = st;
  it.n_state = 3;
  it.step = 12;
  it.rms = 0.75;
  return it;
}

static int create1(fps_shard_t *sh, const fps_create_item_t *it, fps_create_info_t *info, char *why) {
  uint64_t rx;
  return fps_shard_create(sh, sh->cfg.shard_id, sh->cfg.shard_count, it, 1, info, &rx, why, FPS_WHY_MAX);
}

static void restart_restores_blocks(void **unused) {
  (void)unused;
  char dir[] = "/tmp/fps-ckpt-blocks-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  block_values_t v;
  fx_fill(v.p, 21, 2);
  fx_fill(v.row, 7, 3);
  fx_fill(v.col, 6, 4);
  fx_fill(v.mom, 21, 5);
  for (int k = 0; k < 7; k++) v.row[k] = v.row[k] * v.row[k] + 0.01f; /* second moments are positive */
  for (int k = 0; k < 6; k++) v.col[k] = v.col[k] * v.col[k] + 0.01f;
  fps_split_map_t m = map_of(BND);
  fps_slice_t ps;
  fps_state_slice_t st[3];

  fps_shard_t sh;
  shard_open(&sh, dir, true, 0);
  fps_create_item_t it = block_item(&m, &v, &ps, st);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.ready);
  float w[4] = {1, 2, 3, 4};
  const uint64_t d4[] = {4};
  fps_slice_t ws = {.dtype = FPS_DTYPE_F32, .data = (const uint8_t *)w, .len = sizeof w};
  fps_create_item_t wi = {.name = "w", .dims = d4, .ndim = 1, .init = &ws};
  fps_adafactor_defaults(&wi.hp, FPS_FLAVOR_TORCH);
  assert_int_equal(create1(&sh, &wi, &info, why), 0);
  fps_ckpt_done_t done;
  assert_int_equal(fps_checkpoint_write(&sh, &done, why, sizeof why), 0);
  assert_int_equal(done.tensors, 2);
  shard_close(&sh);

  /* The restart. */
  shard_open(&sh, dir, true, 0);
  assert_int_equal(sh.store.count, 2);
  fps_tensor_t *t = fps_store_find(&sh.store, "h");
  assert_non_null(t);
  assert_non_null(t->split);
  assert_true(t->ready);
  assert_int_equal(t->version, 12);
  assert_int_equal(t->restored_version, 12);
  assert_int_equal(t->numel, 21);
  assert_int_equal(t->shape.ndim, 3);
  assert_int_equal(t->shape.dim[1], 5);
  const fps_tensor_split_t *sp = t->split;
  assert_int_equal(sp->block_index, 1);
  assert_int_equal(sp->n_blocks, 2);
  assert_int_equal(sp->shard_count, 2);
  assert_memory_equal(sp->bounds, BND, sizeof BND);
  assert_memory_equal(sp->block_shards, SHARDS, sizeof SHARDS);
  assert_int_equal(sp->g.row_lo, 3);
  assert_int_equal(sp->g.row_hi, 10);
  assert_int_equal(sp->g.nmat, 2);
  assert_memory_equal(t->param, v.p, sizeof v.p);
  assert_memory_equal(sp->st.row, v.row, sizeof v.row);
  assert_memory_equal(sp->st.col, v.col, sizeof v.col);
  assert_memory_equal(sp->st.mom, v.mom, sizeof v.mom);
  assert_null(sp->st.var);
  assert_int_equal(sp->st.step, 12);
  assert_true(sp->st.rms == 0.75f);
  assert_int_equal(t->size.row, 7);
  assert_int_equal(t->size.col, 6);
  assert_int_equal(sh.store.param_bytes, (21 + 4) * 4);
  /* GetState reads the restored block. */
  fps_state_snap_t ss;
  assert_int_equal(fps_shard_state_snap(&sh, "h", &ss, why, sizeof why), 0);
  assert_int_equal(ss.version, 12);
  assert_memory_equal(fps_state_snap_array(&ss, FPS_STATE_COL), v.col, sizeof v.col);
  fps_state_snap_release(&sh, &ss);

  /* Workers' Create of the same block matches it and changes nothing. */
  fps_create_item_t again = block_item(&m, NULL, NULL, NULL);
  assert_int_equal(create1(&sh, &again, &info, why), 0);
  assert_false(info.created);
  assert_true(info.ready);
  assert_int_equal(info.version, 12);
  float got[21];
  assert_int_equal(fx_params(&sh, "h", got), 12);
  assert_memory_equal(got, v.p, sizeof got);
  /* Another map (workers with another split_min_bytes): refused. */
  static const uint64_t other[] = {0, 4, 10};
  fps_split_map_t mo = map_of(other);
  fps_create_item_t wrong = block_item(&mo, NULL, NULL, NULL);
  assert_int_equal(create1(&sh, &wrong, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "split.bounds"));
  /* Written again, it reads back the same (a second restart). */
  assert_int_equal(fps_checkpoint_write(&sh, &done, why, sizeof why), 0);
  shard_close(&sh);
  shard_open(&sh, dir, true, 0);
  t = fps_store_find(&sh.store, "h");
  assert_non_null(t);
  assert_non_null(t->split);
  assert_memory_equal(t->param, v.p, sizeof v.p);
  assert_memory_equal(t->split->st.col, v.col, sizeof v.col);
  shard_close(&sh);

  /* Without --peers the shard could not step the tensor: it refuses to
   * start, restoring nothing. */
  fx_shard(&sh, FPS_MODE_SYNC, 1, 0);
  sh.cfg.shard_id = 1;
  sh.cfg.shard_count = 2;
  sh.cfg.checkpoint_dir = dir;
  assert_int_equal(fps_checkpoint_open(&sh), FPS_ESTATE);
  assert_int_equal(sh.store.count, 0);
  shard_close(&sh);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(restart_restores_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Row blocks of split tensors in the shard's store, driven
 * directly (no gRPC): Create of a block (map checks, "no --peers" and the
 * mode rule, create-or-match of maps, whole vs block), block-local init
 * coverage, resume with the block's state sizes, replace, limits counting
 * the block's bytes, Pull and GetState of a block, the Stats view, a
 * checkpoint with a block, and a push naming a block refused before
 * anything is staged. Every refusal
 * leaves the store as it was. */
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

/* The sender these tests install: Create only needs one to be there (no
 * step runs here), so a send is refused. */
static int never_send(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns, fps_xsend_done_fn done,
                      void *arg) {
  (void)ctx, (void)to_shard, (void)m, (void)deadline_ns, (void)done, (void)arg;
  return FPS_EUNAVAILABLE;
}

/* Shard `id` of `count`, sync, one worker, with a sender. */
static void shard_of(fps_shard_t *sh, uint32_t id, uint32_t count) {
  fx_shard(sh, FPS_MODE_SYNC, 1, 0);
  sh->cfg.shard_id = id;
  sh->cfg.shard_count = count;
  fps_shard_set_exchange(sh, never_send, NULL, 5.0);
}

static fps_slice_t slice(const float *v, uint64_t off, uint64_t n) {
  return (fps_slice_t){.dtype = FPS_DTYPE_F32, .offset = off, .data = (const uint8_t *)(v + off), .len = n * 4};
}

static fps_state_slice_t sslice(int kind, const float *v, uint64_t off, uint64_t n) {
  return (fps_state_slice_t){.kind = kind, .offset = off, .data = (const uint8_t *)(v + off), .len = n * 4};
}

/* A torch item; split/init/state may be NULL. */
static fps_create_item_t item(const char *name, const uint64_t *dims, size_t ndim, const fps_split_map_t *split,
                              const fps_slice_t *init) {
  fps_create_item_t it = {.name = name, .dims = dims, .ndim = ndim, .init = init, .split = split};
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
  return it;
}

static int create1(fps_shard_t *sh, const fps_create_item_t *it, fps_create_info_t *info, char *why) {
  uint64_t rx;
  return fps_shard_create(sh, sh->cfg.shard_id, sh->cfg.shard_count, it, 1, info, &rx, why, FPS_WHY_MAX);
}

/* [10, 3] over 2 shards: rows [0, 4) on shard 0, [4, 10) on shard 1. */
static const uint64_t D10x3[] = {10, 3};
static const uint64_t B2[] = {0, 4, 10};
static const uint32_t S2[] = {0, 1};

static fps_split_map_t map2(uint32_t index) {
  return (fps_split_map_t){.block_index = index, .bounds = B2, .n_bounds = 3, .block_shards = S2,
                           .n_block_shards = 2, .shard_count = 2};
}

static void refusals_change_nothing(void **unused) {
  (void)unused;
  fps_shard_t sh;
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  float v[18] = {0};
  fps_slice_t s = slice(v, 0, 12);
  fps_split_map_t m = map2(0);
  fps_create_item_t it = item("e", D10x3, 2, &m, &s);

  /* No sender: no --peers. */
  fx_shard(&sh, FPS_MODE_SYNC, 1, 0);
  sh.cfg.shard_count = 2;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_ESTATE);
  assert_non_null(strstr(why, "tensor 'e'"));
  assert_non_null(strstr(why, "has no --peers"));
  assert_int_equal(sh.store.count, 0);
  fx_shard_free(&sh);

  /* async and ssp: split tensors need sync. */
  int modes[] = {FPS_MODE_ASYNC, FPS_MODE_SSP};
  for (int k = 0; k < 2; k++) {
    fx_shard(&sh, modes[k], 1, 1);
    sh.cfg.shard_count = 2;
    fps_shard_set_exchange(&sh, never_send, NULL, 5.0);
    assert_int_equal(create1(&sh, &it, &info, why), FPS_ESTATE);
    assert_non_null(strstr(why, "split tensors need --mode sync"));
    assert_non_null(strstr(why, fps_mode_name(modes[k])));
    assert_int_equal(sh.store.count, 0);
    fx_shard_free(&sh);
  }

  shard_of(&sh, 0, 2);
  /* The map is checked before the shard's own rules: another shard's block. */
  fps_split_map_t m1 = map2(1);
  it.split = &m1;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_ESTATE);
  assert_non_null(strstr(why, "placed on shard 1, but this is shard 0"));
  /* A map for another count. */
  fps_split_map_t m3 = map2(0);
  m3.shard_count = 3;
  it.split = &m3;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_ESTATE);
  assert_non_null(strstr(why, "placed for 3 shards"));
  /* Bounds that do not end at the rows. */
  const uint64_t bad[] = {0, 4, 9};
  fps_split_map_t mb = map2(0);
  mb.bounds = bad;
  it.split = &mb;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "split.bounds"));
  /* An init slice past the block's 12 elements (inside the whole 30). */
  it.split = &m;
  fps_slice_t far = slice(v, 10, 4);
  it.init = &far;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "out of range: the tensor has 12 elements"));
  /* A slice may carry the whole shape, not the block's. */
  const uint64_t blk_shape[] = {4, 3};
  fps_slice_t shaped = slice(v, 0, 12);
  shaped.shape = blk_shape;
  shaped.n_shape = 2;
  it.init = &shaped;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "wrong shape [4, 3]"));
  /* Non-finite init. */
  float nan_v[12] = {0};
  nan_v[5] = __builtin_nanf("");
  fps_slice_t ns = slice(nan_v, 0, 12);
  it.init = &ns;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "element 5 is NaN"));
  assert_int_equal(sh.store.count, 0);
  assert_int_equal(sh.store.param_bytes, 0);
  fx_shard_free(&sh);
}

static void create_pull_getstate_view(void **unused) {
  (void)unused;
  fps_shard_t sh;
  shard_of(&sh, 1, 2);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  float v[18];
  fx_fill(v, 18, 7);
  fps_split_map_t m = map2(1);
  /* Block 1 (rows [4, 10): 18 elements) in two Creates, whole shape on the
   * first slice. */
  fps_slice_t a = slice(v, 0, 10);
  a.shape = D10x3;
  a.n_shape = 2;
  fps_create_item_t it = item("e", D10x3, 2, &m, &a);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.created);
  assert_false(info.ready);
  assert_int_equal(info.initialised, 10);
  fps_tensor_t *t;
  fps_snap_t *snap;
  assert_int_equal(fps_shard_snapshot(&sh, "e", &t, &snap, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "10 of 18 elements"));
  /* Overlap with what is there. */
  fps_slice_t o = slice(v, 9, 9);
  it.init = &o;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "overlaps"));
  fps_slice_t b = slice(v, 10, 8);
  it.init = &b;
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_false(info.created);
  assert_true(info.ready);
  assert_int_equal(info.initialised, 18);

  /* Pull: the block's 18 params at block-local offsets, version 0. */
  assert_int_equal(fps_shard_snapshot(&sh, "e", &t, &snap, why, sizeof why), 0);
  assert_int_equal(snap->numel, 18);
  assert_int_equal(snap->version, 0);
  assert_memory_equal(snap->data, v, sizeof v);
  fps_snap_unref(snap);
  assert_non_null(t->split);
  assert_int_equal(t->shape.ndim, 2);
  assert_int_equal(t->shape.dim[0], 10);
  assert_int_equal(t->split->g.row_lo, 4);
  assert_int_equal(t->split->g.row_hi, 10);
  assert_int_equal(t->split->n_blocks, 2);
  assert_int_equal(t->split->bounds[2], 10);
  assert_int_equal(t->split->block_shards[1], 1);

  /* GetState: 6 rows, 3 columns (one matrix), zero at step 0. */
  fps_state_snap_t st;
  assert_int_equal(fps_shard_state_snap(&sh, "e", &st, why, sizeof why), 0);
  assert_int_equal(st.n[FPS_STATE_ROW], 6);
  assert_int_equal(st.n[FPS_STATE_COL], 3);
  assert_int_equal(st.n[FPS_STATE_VAR], 0);
  assert_int_equal(st.n[FPS_STATE_MOM], 0);
  assert_int_equal(st.step, 0);
  assert_int_equal(st.version, 0);
  for (int k = 0; k < 9; k++) assert_true(fps_state_snap_array(&st, FPS_STATE_ROW)[k] == 0.0f);
  fps_state_snap_release(&sh, &st);

  /* Limits and Stats count the block's bytes; a whole tensor beside it. */
  float w[6] = {1, 2, 3, 4, 5, 6};
  const uint64_t d6[] = {6};
  fps_slice_t ws = slice(w, 0, 6);
  fps_create_item_t wi = item("w", d6, 1, NULL, &ws);
  assert_int_equal(create1(&sh, &wi, &info, why), 0);
  assert_int_equal(sh.store.param_bytes, (18 + 6) * 4);
  fps_shard_view_t view;
  assert_int_equal(fps_shard_view(&sh, true, 0, &view), 0);
  assert_int_equal(view.tensors, 2);
  assert_int_equal(view.param_elements, 24);
  assert_int_equal(view.split_blocks, 1);
  assert_int_equal(view.split_elements, 18);
  assert_int_equal(view.state.row, 6);
  assert_int_equal(view.state.col, 3);
  assert_int_equal(view.state.var, 6);
  assert_int_equal(view.n, 2);
  assert_string_equal(view.t[0].name, t->name);
  assert_true(view.t[0].split);
  assert_int_equal(view.t[0].map.block_index, t->split->block_index);
  assert_int_equal(view.t[0].numel, 18);
  assert_true(view.t[0].ready);
  assert_false(view.t[1].split);
  fps_shard_view_free(&view);
  fx_shard_free(&sh);
}

static void create_or_match(void **unused) {
  (void)unused;
  fps_shard_t sh;
  /* Shard 1 of 3; [12, 2] in blocks [0, 5) on 1 and [5, 12) on 2, or the
   * other way round. */
  shard_of(&sh, 1, 3);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  const uint64_t d[] = {12, 2};
  const uint64_t bnd[] = {0, 5, 12}, bnd2[] = {0, 6, 12};
  const uint32_t s12[] = {1, 2}, s01[] = {0, 1};
  fps_split_map_t m = {.block_index = 0, .bounds = bnd, .n_bounds = 3, .block_shards = s12, .n_block_shards = 2,
                       .shard_count = 3};
  float v[14];
  fx_fill(v, 14, 1);
  fps_slice_t s = slice(v, 0, 10);
  fps_create_item_t it = item("x", d, 2, &m, &s);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.ready);
  /* The same block again matches (its values ignored: first values win). */
  float other[10] = {0};
  fps_slice_t so = slice(other, 0, 10);
  it.init = &so;
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_false(info.created);
  float got[10];
  assert_int_equal(fx_params(&sh, "x", got), 0);
  assert_memory_equal(got, v, sizeof got);

  /* Other bounds: this shard's block would be rows [0, 6). */
  fps_split_map_t mb = m;
  mb.bounds = bnd2;
  it.split = &mb;
  it.init = NULL;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "split.bounds [0, 5, 12], not [0, 6, 12]"));
  /* Other shards: this shard holds block 1 of that map. */
  fps_split_map_t ms = m;
  ms.block_shards = s01;
  ms.block_index = 1;
  it.split = &ms;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "split.block_shards [1, 2], not [0, 1]"));
  /* Whole against the block. */
  it.split = NULL;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "already exists here as block 0 of a split tensor"));
  /* Another shape, other settings. */
  const uint64_t d2[] = {12, 3};
  fps_create_item_t is = item("x", d2, 2, &m, NULL);
  assert_int_equal(create1(&sh, &is, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "shape [12, 2], not [12, 3]"));
  fps_create_item_t ih = item("x", d, 2, &m, NULL);
  ih.hp.eps2 = 0.5;
  assert_int_equal(create1(&sh, &ih, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "different optimizer settings"));

  /* A block against a whole tensor of the name. */
  const uint64_t d1[] = {4};
  float z[4] = {0};
  fps_slice_t zs = slice(z, 0, 4);
  fps_create_item_t iw = item("y", d1, 1, NULL, &zs);
  assert_int_equal(create1(&sh, &iw, &info, why), 0);
  const uint64_t b4[] = {0, 2, 4};
  fps_split_map_t my = {.block_index = 0, .bounds = b4, .n_bounds = 3, .block_shards = s12, .n_block_shards = 2,
                        .shard_count = 3};
  iw.split = &my;
  iw.init = NULL;
  assert_int_equal(create1(&sh, &iw, &info, why), FPS_EEXISTS);
  assert_non_null(strstr(why, "already exists here whole, not as block 0"));

  /* Two items of one call naming one tensor with different maps: refused,
   * nothing created. */
  fps_create_item_t two[2] = {item("z", d, 2, &m, NULL), item("z", d, 2, &mb, NULL)};
  uint64_t rx;
  assert_int_equal(fps_shard_create(&sh, 1, 3, two, 2, (fps_create_info_t[2]){0}, &rx, why, sizeof why),
                   FPS_EEXISTS);
  assert_non_null(strstr(why, "split.bounds"));
  assert_null(fps_store_find(&sh.store, "z"));
  assert_int_equal(sh.store.count, 2);
  fx_shard_free(&sh);
}

static void resume_with_block_state(void **unused) {
  (void)unused;
  fps_shard_t sh;
  shard_of(&sh, 1, 2);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  /* [2, 5, 3] hf with beta1: 10 flattened rows; the block on shard 1 is
   * rows [3, 10), so it spans both matrices: 7 rows, 2 x 3 columns, 21
   * elements of momentum. */
  const uint64_t d[] = {2, 5, 3};
  const uint64_t bnd[] = {0, 3, 10};
  const uint32_t sh_of[] = {1, 0}; /* not increasing: refused below */
  const uint32_t s01[] = {0, 1};
  fps_split_map_t m = {.block_index = 1, .bounds = bnd, .n_bounds = 3, .block_shards = s01, .n_block_shards = 2,
                       .shard_count = 2};
  float p[21], row[7], col[6], mom[21];
  fx_fill(p, 21, 2);
  for (int k = 0; k < 7; k++) row[k] = 0.1f * (float)(k + 1);
  for (int k = 0; k < 6; k++) col[k] = 0.2f * (float)(k + 1);
  fx_fill(mom, 21, 3);
  fps_create_item_t it = item("h", d, 3, &m, NULL);
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_HF);
  it.hp.relative_step = false;
  it.hp.has_lr = true;
  it.hp.lr = 1e-3;
  it.hp.has_beta1 = true;
  it.hp.beta1 = 0.9;
  it.step = 5;
  it.rms = 0.5;

  /* block_shards must increase. */
  fps_split_map_t mbad = m;
  mbad.block_shards = sh_of;
  it.split = &mbad;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "block_shards must increase"));
  it.split = &m;

  /* The column state is 6 values (two matrices), not 3 or the whole's. */
  fps_state_slice_t c7 = sslice(FPS_STATE_COL, (float[7]){0}, 0, 7);
  it.state = &c7;
  it.n_state = 1;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "col state slice [0, 7) is out of range: it has 6 elements"));
  /* A kind it lacks. */
  fps_state_slice_t vs = sslice(FPS_STATE_VAR, p, 0, 1);
  it.state = &vs;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "has no var state"));
  assert_int_equal(sh.store.count, 0);

  /* Params, row and mom first: not ready; col completes it. */
  fps_slice_t ps = slice(p, 0, 21);
  fps_state_slice_t first[2] = {sslice(FPS_STATE_ROW, row, 0, 7), sslice(FPS_STATE_MOM, mom, 0, 21)};
  it.init = &ps;
  it.state = first;
  it.n_state = 2;
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_false(info.ready);
  assert_int_equal(info.version, 5);
  fps_state_slice_t cs = sslice(FPS_STATE_COL, col, 0, 6);
  it.init = NULL;
  it.state = &cs;
  it.n_state = 1;
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.ready);

  fps_state_snap_t st;
  assert_int_equal(fps_shard_state_snap(&sh, "h", &st, why, sizeof why), 0);
  assert_int_equal(st.version, 5);
  assert_int_equal(st.step, 5);
  assert_true(st.rms == 0.5);
  assert_int_equal(st.n[FPS_STATE_ROW], 7);
  assert_int_equal(st.n[FPS_STATE_COL], 6);
  assert_int_equal(st.n[FPS_STATE_MOM], 21);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_ROW), row, sizeof row);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_COL), col, sizeof col);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_MOM), mom, sizeof mom);
  fps_state_snap_release(&sh, &st);
  float got[21];
  assert_int_equal(fx_params(&sh, "h", got), 5);
  assert_memory_equal(got, p, sizeof p);

  /* Replace: everything in one call (the state too at a step > 0). */
  float p2[21], row2[7], col2[6], mom2[21];
  fx_fill(p2, 21, 9);
  fx_fill(mom2, 21, 10);
  for (int k = 0; k < 7; k++) row2[k] = 1.0f + (float)k;
  for (int k = 0; k < 6; k++) col2[k] = 2.0f + (float)k;
  fps_slice_t p2s = slice(p2, 0, 21);
  fps_state_slice_t all[3] = {sslice(FPS_STATE_ROW, row2, 0, 7), sslice(FPS_STATE_COL, col2, 0, 6),
                              sslice(FPS_STATE_MOM, mom2, 0, 20)};
  it.init = &p2s;
  it.state = all;
  it.n_state = 3;
  it.step = 3;
  it.rms = 0.25;
  it.replace = true;
  assert_int_equal(create1(&sh, &it, &info, why), FPS_EINVAL);
  assert_non_null(strstr(why, "mom: 20 of 21 elements"));
  assert_int_equal(fx_params(&sh, "h", got), 5); /* unchanged */
  assert_memory_equal(got, p, sizeof p);
  all[2] = sslice(FPS_STATE_MOM, mom2, 0, 21);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.ready);
  assert_int_equal(info.version, 3);
  assert_int_equal(fx_params(&sh, "h", got), 3);
  assert_memory_equal(got, p2, sizeof p2);
  assert_int_equal(fps_shard_state_snap(&sh, "h", &st, why, sizeof why), 0);
  assert_int_equal(st.step, 3);
  assert_true(st.rms == 0.25);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_ROW), row2, sizeof row2);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_COL), col2, sizeof col2);
  assert_memory_equal(fps_state_snap_array(&st, FPS_STATE_MOM), mom2, sizeof mom2);
  fps_state_snap_release(&sh, &st);
  fx_shard_free(&sh);
}

static void one_d_blocks(void **unused) {
  (void)unused;
  fps_shard_t sh;
  shard_of(&sh, 2, 3);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  /* [10] in element ranges [0, 3) [3, 9) [9, 10): a one-element block. */
  const uint64_t d[] = {10};
  const uint64_t bnd[] = {0, 3, 9, 10};
  const uint32_t s[] = {0, 1, 2};
  fps_split_map_t m = {.block_index = 2, .bounds = bnd, .n_bounds = 4, .block_shards = s, .n_block_shards = 3,
                       .shard_count = 3};
  float one = 3.5f, var = 0.125f;
  fps_slice_t ps = slice(&one, 0, 1);
  fps_state_slice_t vs = sslice(FPS_STATE_VAR, &var, 0, 1);
  fps_create_item_t it = item("b", d, 1, &m, &ps);
  it.step = 2;
  it.state = &vs;
  it.n_state = 1;
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_true(info.ready);
  fps_state_snap_t st;
  assert_int_equal(fps_shard_state_snap(&sh, "b", &st, why, sizeof why), 0);
  assert_int_equal(st.n[FPS_STATE_VAR], 1);
  assert_int_equal(st.n[FPS_STATE_ROW] + st.n[FPS_STATE_COL] + st.n[FPS_STATE_MOM], 0);
  assert_true(fps_state_snap_array(&st, FPS_STATE_VAR)[0] == 0.125f);
  assert_int_equal(st.step, 2);
  fps_state_snap_release(&sh, &st);
  float got;
  assert_int_equal(fx_params(&sh, "b", &got), 2);
  assert_true(got == 3.5f);
  fx_shard_free(&sh);
}

static void limits_count_the_block(void **unused) {
  (void)unused;
  fps_shard_t sh;
  shard_of(&sh, 0, 2);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  /* 90 bytes: one block's 48 fit where the whole tensor's 120 would not;
   * two blocks do not. */
  sh.cfg.max_bytes = 90;
  fps_split_map_t m = map2(0);
  fps_create_item_t it = item("e", D10x3, 2, &m, NULL);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  assert_int_equal(sh.store.param_bytes, 48);
  fps_create_item_t it2 = item("f", D10x3, 2, &m, NULL);
  assert_int_equal(create1(&sh, &it2, &info, why), FPS_ELIMIT);
  assert_non_null(strstr(why, "48 new parameter bytes would exceed"));
  sh.cfg.max_bytes = 1000;
  sh.cfg.max_tensors = 1;
  assert_int_equal(create1(&sh, &it2, &info, why), FPS_ELIMIT);
  assert_non_null(strstr(why, "--max-tensors"));
  assert_int_equal(sh.store.count, 1);
  fx_shard_free(&sh);
}

/* A checkpoint writes a block beside whole tensors (the block layout is
 * checkpoint.c's; here: the store's blocks reach it whole and intact). */
static void checkpoint_writes_blocks(void **unused) {
  (void)unused;
  char dir[] = "/tmp/fps-blocks-XXXXXX";
  assert_non_null(mkdtemp(dir));
  fps_shard_t sh;
  shard_of(&sh, 0, 2);
  sh.cfg.checkpoint_dir = dir;
  sh.cfg.checkpoint_keep = 2;
  assert_int_equal(fps_checkpoint_open(&sh), 0);
  char why[FPS_WHY_MAX];
  fps_create_info_t info;
  float v[12];
  fx_fill(v, 12, 5);
  fps_slice_t s = slice(v, 0, 12);
  fps_split_map_t m = map2(0);
  fps_create_item_t it = item("e", D10x3, 2, &m, &s);
  assert_int_equal(create1(&sh, &it, &info, why), 0);
  fps_ckpt_done_t done;
  assert_int_equal(fps_checkpoint_write(&sh, &done, why, sizeof why), 0);
  assert_int_equal(done.tensors, 1);
  assert_int_equal(done.skipped, 0);
  const uint64_t d4[] = {4};
  fps_slice_t ws = slice(v, 0, 4);
  fps_create_item_t wi = item("w", d4, 1, NULL, &ws);
  assert_int_equal(create1(&sh, &wi, &info, why), 0);
  assert_int_equal(fps_checkpoint_write(&sh, &done, why, sizeof why), 0);
  assert_int_equal(done.tensors, 2);
  assert_int_equal(done.skipped, 0);
  fps_checkpoint_close(&sh);
  fx_shard_free(&sh);
  DIR *dp = opendir(dir);
  assert_non_null(dp);
  for (struct dirent *de; (de = readdir(dp));) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    char path[sizeof dir + 300];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    unlink(path);
  }
  closedir(dp);
  assert_int_equal(rmdir(dir), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(refusals_change_nothing),
      cmocka_unit_test(create_pull_getstate_view),
      cmocka_unit_test(create_or_match),
      cmocka_unit_test(resume_with_block_state),
      cmocka_unit_test(one_d_blocks),
      cmocka_unit_test(limits_count_the_block),
      cmocka_unit_test(checkpoint_writes_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

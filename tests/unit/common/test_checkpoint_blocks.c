/* Checkpoints of row blocks: the block layout round trips bit
 * for bit beside whole tensors, files without blocks stay format_version 1,
 * the writer refuses maps that do not fit the shape or the shard, and the
 * reader refuses re-sealed headers whose block metadata is inconsistent,
 * naming the tensor. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adafactor_split.h"
#include "checkpoint.h"
#include "sha256.h"

/* ------------------------------------------------------------ helpers */

static char *make_dir(void) {
  char *d = strdup("/tmp/fps-ckpt-blocks-XXXXXX");
  assert_non_null(d);
  assert_non_null(mkdtemp(d));
  return d;
}

static void remove_dir(char *d) {
  DIR *dd = opendir(d);
  if (dd) {
    struct dirent *de;
    while ((de = readdir(dd)) != NULL) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
      char p[FPS_CKPT_PATH_MAX];
      snprintf(p, sizeof p, "%s/%s", d, de->d_name);
      unlink(p);
    }
    closedir(dd);
  }
  rmdir(d);
  free(d);
}

static unsigned char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)n + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return b;
}

static void write_all_file(const char *path, const void *b, size_t len) {
  unlink(path);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  if (len) assert_int_equal(fwrite(b, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

static void fill(float *p, uint64_t n, float base) {
  for (uint64_t i = 0; i < n; i++) p[i] = base + (float)i * 0.25f;
}

/* A block as a shard holds it. */
typedef struct live_block_s {
  const char *name;
  fps_shape_t shape;                    /* whole */
  fps_adafactor_hparams_t hp;
  uint64_t bounds[5];
  uint32_t shards[4];
  uint32_t n_blocks, index, count;
  fps_split_state_t st;
  float *param;
  uint64_t version;
} live_block_t;

static fps_ckpt_block_t map_of(live_block_t *b) {
  return (fps_ckpt_block_t){.block_index = b->index, .n_blocks = b->n_blocks, .bounds = b->bounds,
                            .block_shards = b->shards, .shard_count = b->count};
}

static void block_make(live_block_t *b, int seed) {
  fps_split_geom_t g;
  char why[256] = "";
  int rc = fps_split_geom_init(&g, &b->shape, b->bounds[b->index], b->bounds[b->index + 1], why,
                               sizeof why);
  if (rc) fail_msg("geom: %s", why);
  assert_int_equal(fps_split_state_init(&b->st, &g, &b->hp), 0);
  b->param = malloc(g.block_numel * sizeof(float));
  assert_non_null(b->param);
  fill(b->param, g.block_numel, (float)(seed * 100));
  if (b->st.row) fill(b->st.row, g.row_hi - g.row_lo, (float)(seed * 100 + 10));
  if (b->st.col) fill(b->st.col, g.nmat * g.cols, (float)(seed * 100 + 20));
  if (b->st.var) fill(b->st.var, g.block_numel, (float)(seed * 100 + 30));
  if (b->st.mom) fill(b->st.mom, g.block_numel, (float)(seed * 100 + 40));
  b->st.step = 11 + (uint64_t)seed;
  b->st.rms = 0.5f + (float)seed;
  b->version = 11 + (uint64_t)seed;
}

static void block_free(live_block_t *b) {
  fps_split_state_destroy(&b->st);
  free(b->param);
}

/* Shard 1 of 3: "emb" [2,5,4] rows [3, 8) (spans both matrices), "bias"
 * [7] elements [2, 7) with hf momentum, and a whole "w" [3,5]. */
typedef struct fixture_s {
  live_block_t blk[2];
  fps_adafactor_hparams_t whp;
  fps_adafactor_state_t wst;
  float wparam[15];
} fixture_t;

static void fixture_make(fixture_t *f) {
  memset(f, 0, sizeof *f);
  live_block_t *e = &f->blk[0], *b = &f->blk[1];
  e->name = "emb";
  e->shape = (fps_shape_t){3, {2, 5, 4}};
  fps_adafactor_defaults(&e->hp, FPS_FLAVOR_TORCH);
  e->n_blocks = 3;
  memcpy(e->bounds, (uint64_t[]){0, 3, 8, 10}, 4 * sizeof(uint64_t));
  memcpy(e->shards, (uint32_t[]){0, 1, 2}, 3 * sizeof(uint32_t));
  e->index = 1;
  e->count = 3;
  block_make(e, 1);
  b->name = "bias";
  b->shape = (fps_shape_t){1, {7}};
  fps_adafactor_defaults(&b->hp, FPS_FLAVOR_HF);
  b->hp.has_lr = true;
  b->hp.lr = 1e-3;
  b->hp.relative_step = false;
  b->hp.has_beta1 = true;
  b->hp.beta1 = 0.9;
  b->n_blocks = 2;
  memcpy(b->bounds, (uint64_t[]){0, 2, 7}, 3 * sizeof(uint64_t));
  memcpy(b->shards, (uint32_t[]){0, 1}, 2 * sizeof(uint32_t));
  b->index = 1;
  b->count = 3;
  block_make(b, 2);
  fps_adafactor_defaults(&f->whp, FPS_FLAVOR_TORCH);
  fps_shape_t ws = {2, {3, 5}};
  assert_int_equal(fps_adafactor_state_init(&f->wst, &ws, &f->whp), 0);
  fill(f->wparam, 15, 7);
  fill(f->wst.row, 3, 8);
  fill(f->wst.col, 5, 9);
  f->wst.step = 4;
}

static void fixture_free(fixture_t *f) {
  for (int i = 0; i < 2; i++) block_free(&f->blk[i]);
  fps_adafactor_state_destroy(&f->wst);
}

static void write_fixture(const char *dir, fixture_t *f, fps_ckpt_written_t *w) {
  fps_ckpt_snapshot_t *s = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  assert_int_equal(fps_ckpt_snapshot_create(&s, 1, 3, "sync"), 0);
  for (int i = 0; i < 2; i++) {
    live_block_t *b = &f->blk[i];
    fps_ckpt_block_t m = map_of(b);
    size_t idx;
    int rc = fps_ckpt_snapshot_add_block(s, b->name, &b->shape, &b->hp, &m, &idx, why, sizeof why);
    if (rc) fail_msg("add_block %s: %s", b->name, why);
    /* A block is not a whole tensor, and the other way round. */
    assert_int_equal(fps_ckpt_snapshot_copy(s, idx, b->version, b->param, &f->wst), FPS_EINVAL);
    assert_int_equal(fps_ckpt_snapshot_copy_block(s, idx, b->version, b->param, &b->st), 0);
  }
  /* The other block's state does not fit the first. */
  assert_int_equal(fps_ckpt_snapshot_copy_block(s, 0, 1, f->blk[1].param, &f->blk[1].st),
                   FPS_ESHAPE);
  assert_int_equal(fps_ckpt_snapshot_copy_block(s, 0, f->blk[0].version, f->blk[0].param,
                                                &f->blk[0].st), 0);
  size_t idx;
  fps_shape_t ws = {2, {3, 5}};
  assert_int_equal(fps_ckpt_snapshot_add(s, "w", &ws, &f->whp, &idx, why, sizeof why), 0);
  assert_int_equal(fps_ckpt_snapshot_copy_block(s, idx, 1, f->wparam, &f->blk[0].st), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_copy(s, idx, 4, f->wparam, &f->wst), 0);
  int rc = fps_ckpt_write(dir, s, 3, w, why, sizeof why);
  if (rc) fail_msg("write: %s", why);
  fps_ckpt_snapshot_destroy(s);
}

static const fps_ckpt_tensor_t *find(const fps_ckpt_t *c, const char *name) {
  for (size_t i = 0; i < c->n_tensors; i++)
    if (!strcmp(c->tensors[i].name, name)) return &c->tensors[i];
  fail_msg("no tensor %s", name);
  return NULL;
}

static void expect_floats(const float *a, const float *b, uint64_t n, const char *what) {
  if (n && memcmp(a, b, n * sizeof(float)) != 0) fail_msg("%s differs", what);
}

static void expect_fixture(const fps_ckpt_t *c, const fixture_t *f) {
  assert_int_equal(c->n_tensors, 3);
  assert_int_equal(c->info.format_version, 2);
  assert_int_equal(c->info.blocks, 2);
  for (int i = 0; i < 2; i++) {
    const live_block_t *b = &f->blk[i];
    const fps_ckpt_tensor_t *t = find(c, b->name);
    const fps_split_geom_t *g = &t->bstate.g, *want = &b->st.g;
    assert_int_equal(t->block.n_blocks, b->n_blocks);
    assert_int_equal(t->block.block_index, b->index);
    assert_int_equal(t->block.shard_count, b->count);
    assert_memory_equal(t->block.bounds, b->bounds, (b->n_blocks + 1) * sizeof(uint64_t));
    assert_memory_equal(t->block.block_shards, b->shards, b->n_blocks * sizeof(uint32_t));
    assert_memory_equal(&g->shape, &want->shape, sizeof g->shape);
    assert_int_equal(g->row_lo, want->row_lo);
    assert_int_equal(g->row_hi, want->row_hi);
    assert_int_equal(g->nmat, want->nmat);
    assert_int_equal(t->state.numel, 0); /* a block's whole-tensor state is unused */
    assert_null(t->state.row);
    expect_floats(t->param, b->param, want->block_numel, "block params");
    assert_int_equal(!!t->bstate.row, !!b->st.row);
    if (b->st.row) expect_floats(t->bstate.row, b->st.row, want->row_hi - want->row_lo, "row");
    if (b->st.col) expect_floats(t->bstate.col, b->st.col, want->nmat * want->cols, "col");
    assert_int_equal(!!t->bstate.var, !!b->st.var);
    if (b->st.var) expect_floats(t->bstate.var, b->st.var, want->block_numel, "var");
    assert_int_equal(!!t->bstate.mom, !!b->st.mom);
    if (b->st.mom) expect_floats(t->bstate.mom, b->st.mom, want->block_numel, "mom");
    assert_int_equal(t->bstate.step, b->st.step);
    assert_true(t->bstate.rms == b->st.rms);
    assert_int_equal(t->version, b->version);
    assert_memory_equal(&t->hparams, &b->hp, sizeof t->hparams);
  }
  const fps_ckpt_tensor_t *w = find(c, "w");
  assert_int_equal(w->block.n_blocks, 0);
  assert_null(w->bstate.row);
  expect_floats(w->param, f->wparam, 15, "whole params");
  expect_floats(w->state.row, f->wst.row, 3, "whole row");
  expect_floats(w->state.col, f->wst.col, 5, "whole col");
  assert_int_equal(w->state.step, 4);
}

static const fps_ckpt_expect_t EXPECT = {.shard_id = 1, .shard_count = 3, .mode = "sync"};

/* ------------------------------------------------------------- tests */

static void block_round_trip(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fixture_t f;
  fixture_make(&f);
  fps_ckpt_written_t w;
  write_fixture(dir, &f, &w);
  fps_ckpt_t *c = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_load_file(w.path, &EXPECT, &c, why, sizeof why);
  if (rc) fail_msg("load: %s", why);
  expect_fixture(c, &f);
  fps_ckpt_destroy(c);
  /* The block layout as a plain safetensors reader sees it. */
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
  cJSON *root = cJSON_ParseWithLength((const char *)b + 8, n);
  assert_non_null(root);
  static const struct {
    const char *key;
    int ndim;
    double d0, d1;
  } shapes[] = {{"emb", 2, 5, 4}, {"emb/row", 1, 5, 0}, {"emb/col", 2, 2, 4},
                {"bias", 1, 5, 0}, {"bias/var", 1, 5, 0}, {"bias/mom", 1, 5, 0}};
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
    cJSON *e = cJSON_GetObjectItemCaseSensitive(root, shapes[i].key);
    if (!e) fail_msg("no entry %s", shapes[i].key);
    cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    assert_int_equal(cJSON_GetArraySize(sh), shapes[i].ndim);
    assert_true(cJSON_GetArrayItem(sh, 0)->valuedouble == shapes[i].d0);
    if (shapes[i].ndim == 2) assert_true(cJSON_GetArrayItem(sh, 1)->valuedouble == shapes[i].d1);
  }
  cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "format_version")->valuestring, "2");
  cJSON *tm = cJSON_Parse(cJSON_GetObjectItemCaseSensitive(meta, "tensor:emb")->valuestring);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(tm, "shape")->valuestring, "2,5,4");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(tm, "bounds")->valuestring, "0,3,8,10");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(tm, "block_shards")->valuestring, "0,1,2");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(tm, "block_index")->valuestring, "1");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(tm, "shard_count")->valuestring, "3");
  cJSON_Delete(tm);
  cJSON_Delete(root);
  free(b);
  /* Another shard's reader refuses it as mismatched, as for whole tensors. */
  fps_ckpt_expect_t other = {.shard_id = 0, .shard_count = 3, .mode = NULL};
  assert_int_equal(fps_ckpt_verify_file(w.path, &other, NULL, why, sizeof why), FPS_ESTATE);
  fixture_free(&f);
  remove_dir(dir);
}

static void whole_files_stay_version_1(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 1, "async"), 0);
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_shape_t shape = {2, {2, 3}};
  fps_adafactor_state_t st;
  assert_int_equal(fps_adafactor_state_init(&st, &shape, &hp), 0);
  float p[6] = {1, 2, 3, 4, 5, 6};
  size_t idx;
  assert_int_equal(fps_ckpt_snapshot_add(s, "w", &shape, &hp, &idx, NULL, 0), 0);
  assert_int_equal(fps_ckpt_snapshot_copy(s, idx, 1, p, &st), 0);
  fps_ckpt_written_t w;
  char why[FPS_CKPT_WHY_MAX] = "";
  assert_int_equal(fps_ckpt_write(dir, s, 1, &w, why, sizeof why), 0);
  fps_ckpt_info_t info;
  assert_int_equal(fps_ckpt_verify_file(w.path, NULL, &info, why, sizeof why), 0);
  assert_int_equal(info.format_version, 1);
  assert_int_equal(info.blocks, 0);
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  assert_non_null(memmem(b, len, "\"format_version\":\"1\"", 20));
  assert_null(memmem(b, len, "bounds", 6));
  free(b);
  fps_adafactor_state_destroy(&st);
  fps_ckpt_snapshot_destroy(s);
  remove_dir(dir);
}

static void add_block_refuses_bad_maps(void **unused) {
  (void)unused;
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(&s, 1, 3, "sync"), 0);
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_shape_t shape = {3, {2, 5, 4}}; /* 10 rows */
  static const struct {
    const char *what;
    uint32_t n_blocks, index, count;
    uint64_t bounds[5];
    uint32_t shards[4];
    const char *why;
  } cases[] = {
      {"one block", 1, 0, 3, {0, 10}, {1}, "a split tensor has 2..4096"},
      {"bounds past the rows", 2, 1, 3, {0, 3, 11}, {0, 1}, "ends at row 11, not at 10"},
      {"bounds not from 0", 2, 1, 3, {1, 3, 10}, {0, 1}, "starts at row 1"},
      {"empty block", 3, 1, 3, {0, 3, 3, 10}, {0, 1, 2}, "must increase"},
      {"index out of range", 2, 2, 3, {0, 3, 10}, {0, 1}, "block_index 2"},
      {"shards not increasing", 3, 1, 3, {0, 3, 8, 10}, {0, 1, 1}, "block_shards[2]"},
      {"shard beyond the count", 2, 1, 3, {0, 3, 10}, {1, 3}, "block_shards[1] = 3"},
      {"map of another count", 2, 1, 4, {0, 3, 10}, {0, 1}, "made for 4 shards"},
      {"another shard's block", 2, 0, 3, {0, 3, 10}, {0, 1}, "belongs to shard 0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    fps_ckpt_block_t m = {.block_index = cases[i].index, .n_blocks = cases[i].n_blocks,
                          .bounds = (uint64_t *)cases[i].bounds,
                          .block_shards = (uint32_t *)cases[i].shards,
                          .shard_count = cases[i].count};
    char why[FPS_CKPT_WHY_MAX] = "";
    size_t idx = 77;
    int rc = fps_ckpt_snapshot_add_block(s, "emb", &shape, &hp, &m, &idx, why, sizeof why);
    if (rc != FPS_EINVAL || !strstr(why, cases[i].why) || !strstr(why, "\"emb\""))
      fail_msg("%s: got %s \"%s\", want \"%s\"", cases[i].what, fps_err_name(rc), why,
               cases[i].why);
    assert_int_equal(idx, 77);
  }
  assert_int_equal(fps_ckpt_snapshot_count(s), 0);
  /* A 0-D tensor has one row: it cannot be split at all. */
  fps_shape_t scalar = {0, {0}};
  uint64_t b2[] = {0, 1, 1};
  uint32_t s2[] = {0, 1};
  fps_ckpt_block_t m = {.block_index = 1, .n_blocks = 2, .bounds = b2, .block_shards = s2,
                        .shard_count = 3};
  assert_int_equal(fps_ckpt_snapshot_add_block(s, "s", &scalar, &hp, &m, NULL, NULL, 0), FPS_EINVAL);
  fps_ckpt_snapshot_destroy(s);
}

/* ------------------------------------- re-sealed headers (valid digests) */

static const char ZEROS[] = "0000000000000000000000000000000000000000000000000000000000000000";

static void seal(const char *path, cJSON *root, const unsigned char *data, size_t dlen) {
  cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
  uint8_t dig[FPS_SHA256_LEN];
  char hex[65];
  assert_int_equal(fps_sha256(data, dlen, dig), 0);
  fps_sha256_hex(dig, hex);
  cJSON_ReplaceItemInObjectCaseSensitive(meta, "data_sha256", cJSON_CreateString(hex));
  cJSON_ReplaceItemInObjectCaseSensitive(meta, "header_sha256", cJSON_CreateString(ZEROS));
  char *text = cJSON_PrintUnformatted(root);
  assert_non_null(text);
  size_t n = strlen(text), pad = (8 - (8 + n) % 8) % 8;
  size_t total = 8 + n + pad + dlen;
  unsigned char *f = malloc(total);
  assert_non_null(f);
  for (int i = 0; i < 8; i++) f[i] = (unsigned char)((uint64_t)(n + pad) >> (8 * i));
  memcpy(f + 8, text, n);
  memset(f + 8 + n, ' ', pad);
  memcpy(f + 8 + n + pad, data, dlen);
  cJSON_free(text);
  char *at = strstr((char *)f + 8, "\"header_sha256\":\"");
  assert_non_null(at);
  assert_int_equal(fps_sha256(f, 8 + n + pad, dig), 0);
  fps_sha256_hex(dig, hex);
  memcpy(at + strlen("\"header_sha256\":\""), hex, 64);
  write_all_file(path, f, total);
  free(f);
}

/* Sets (val non-NULL) or removes one key of "tensor:emb". */
static void set_emb(cJSON *meta, const char *key, const char *val) {
  cJSON *s = cJSON_GetObjectItemCaseSensitive(meta, "tensor:emb");
  cJSON *o = cJSON_Parse(s->valuestring);
  if (val) cJSON_ReplaceItemInObjectCaseSensitive(o, key, cJSON_CreateString(val));
  else cJSON_DeleteItemFromObjectCaseSensitive(o, key);
  char *t = cJSON_PrintUnformatted(o);
  cJSON_ReplaceItemInObjectCaseSensitive(meta, "tensor:emb", cJSON_CreateString(t));
  cJSON_free(t);
  cJSON_Delete(o);
}

static void resealed_block_headers(void **unused) {
  (void)unused;
  static const struct {
    const char *what, *key, *val; /* val NULL: remove the key; key NULL: format_version "1" */
    const char *why;
  } cases[] = {
      {"no change", "shape", "2,5,4", NULL},
      {"bounds past the rows", "bounds", "0,3,8,11", "ends at row 11, not at 10"},
      {"other rows for this block", "bounds", "0,4,8,10", "wrong shape"},
      {"shards not increasing", "block_shards", "0,2,1", "must increase"},
      {"fewer shards than blocks", "block_shards", "0,1", "\"block_shards\" has a bad value"},
      {"map of another count", "shard_count", "4", "made for 4 shards"},
      {"another shard's block", "block_index", "0", "belongs to shard 0"},
      {"index out of range", "block_index", "3", "block_index 3"},
      {"no bounds", "bounds", NULL, "lacks \"bounds\""},
      {"bad list", "bounds", "0,,8,10", "\"bounds\" has a bad value"},
      {"signed list", "bounds", "0,3,+8,10", "\"bounds\" has a bad value"},
      {"other column count", "shape", "2,5,5", "wrong shape"},
      {"other row count", "shape", "2,6,4", "ends at row 10, not at 12"},
      {"no dims", "shape", "", "\"shape\" has a bad value"},
      {"nine dims", "shape", "1,1,1,1,1,1,1,2,5", "\"shape\" has a bad value"},
      {"blocks in a version 1 file", NULL, NULL, "format_version 1 cannot hold"},
  };
  char *dir = make_dir();
  fixture_t f;
  fixture_make(&f);
  fps_ckpt_written_t w;
  write_fixture(dir, &f, &w);
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    cJSON *root = cJSON_ParseWithLength((const char *)b + 8, n);
    assert_non_null(root);
    cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
    if (cases[i].key) set_emb(meta, cases[i].key, cases[i].val);
    else cJSON_ReplaceItemInObjectCaseSensitive(meta, "format_version", cJSON_CreateString("1"));
    seal(w.path, root, b + 8 + n, len - 8 - n);
    cJSON_Delete(root);
    char why[FPS_CKPT_WHY_MAX] = "";
    fps_ckpt_t *c = NULL;
    int rc = fps_ckpt_load_file(w.path, &EXPECT, &c, why, sizeof why);
    if (!cases[i].why) {
      if (rc) fail_msg("%s: rejected: %s", cases[i].what, why);
      expect_fixture(c, &f);
      fps_ckpt_destroy(c);
      continue;
    }
    if (rc != FPS_EFORMAT || !strstr(why, cases[i].why) || !strstr(why, "emb"))
      fail_msg("%s: got %s \"%s\", want FPS_EFORMAT \"%s\"", cases[i].what, fps_err_name(rc),
               why, cases[i].why);
    assert_null(c);
  }
  free(b);
  fixture_free(&f);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(block_round_trip),
      cmocka_unit_test(whole_files_stay_version_1),
      cmocka_unit_test(add_block_refuses_bad_maps),
      cmocka_unit_test(resealed_block_headers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

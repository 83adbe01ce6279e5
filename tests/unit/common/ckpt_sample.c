/* Helper for checkpoint_read.py: writes a checkpoint with known contents,
 * and checks a checkpoint (e.g. one Python wrote) against the same
 * pattern, so the format is shown to be readable and writable without
 * factorps.
 *
 *   ckpt_sample write DIR     writes DIR/ckpt-<seq>.safetensors, prints its path
 *   ckpt_sample check PATH    loads PATH, checks every value; exit 0 if all match
 *   ckpt_sample write-blocks DIR  writes row blocks (checkpoint.h ROW BLOCKS) of
 *                             BLOCKS below, with the same pattern, prints its path
 *   ckpt_sample bench DIR MB  times snapshot, write, verify and load of about
 *                             MB megabytes of weights (not a test: numbers only)
 *
 * Pattern, tensor i (file order), array kind k (0 weights, 1 row, 2 col,
 * 3 var, 4 mom), element j: value = i*1000 + k*100 + j*0.5 (exact in
 * float32); version = 7+i, step = 40+i, rms = 0.25*(i+1). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adafactor.h"
#include "adafactor_split.h"
#include "checkpoint.h"

typedef struct spec_s {
  const char *name;
  fps_shape_t shape;
  fps_flavor_t flavor;
  bool momentum;
} spec_t;

static const spec_t SPECS[] = {
    {"layer0/w", {2, {3, 5}}, FPS_FLAVOR_TORCH, false},
    {"emb", {3, {2, 3, 4}}, FPS_FLAVOR_TORCH, false},
    {"bias", {1, {7}}, FPS_FLAVOR_HF, false},
    {"head.w \xc3\xa9", {2, {4, 6}}, FPS_FLAVOR_HF, true},
    {"scalar", {0, {0}}, FPS_FLAVOR_TORCH, false},
};
#define NSPECS (sizeof SPECS / sizeof SPECS[0])

static float value(size_t i, int k, uint64_t j) {
  return (float)(i * 1000 + (size_t)k * 100) + (float)j * 0.5f;
}

static void fill(float *p, uint64_t n, size_t i, int k) {
  for (uint64_t j = 0; j < n; j++) p[j] = value(i, k, j);
}

static int check(const float *p, uint64_t n, size_t i, int k, const char *name) {
  for (uint64_t j = 0; j < n; j++) {
    if (p[j] != value(i, k, j)) {
      fprintf(stderr, "%s: array %d element %" PRIu64 " is %g, want %g\n", name, k, j, p[j],
              value(i, k, j));
      return 1;
    }
  }
  return 0;
}

static int hparams(const spec_t *sp, fps_adafactor_hparams_t *hp) {
  fps_adafactor_defaults(hp, sp->flavor);
  if (sp->momentum) {
    hp->has_lr = true;
    hp->lr = 1e-3;
    hp->relative_step = false;
    hp->scale_parameter = false;
    hp->has_beta1 = true;
    hp->beta1 = 0.9;
  }
  return 0;
}

static int do_write(const char *dir) {
  fps_ckpt_snapshot_t *s = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_snapshot_create(&s, 1, 2, "sync");
  for (size_t i = 0; i < NSPECS && rc == 0; i++) {
    fps_adafactor_hparams_t hp;
    hparams(&SPECS[i], &hp);
    fps_adafactor_state_t st;
    size_t idx;
    rc = fps_adafactor_state_init(&st, &SPECS[i].shape, &hp);
    if (rc) break;
    fps_state_size_t sz;
    fps_adafactor_state_size(&SPECS[i].shape, &hp, &sz);
    float *param = malloc(st.numel * sizeof(float));
    fill(param, st.numel, i, 0);
    if (st.row) fill(st.row, sz.row, i, 1);
    if (st.col) fill(st.col, sz.col, i, 2);
    if (st.var) fill(st.var, sz.var, i, 3);
    if (st.mom) fill(st.mom, sz.mom, i, 4);
    st.step = 40 + i;
    st.rms = 0.25f * (float)(i + 1);
    rc = fps_ckpt_snapshot_add(s, SPECS[i].name, &SPECS[i].shape, &hp, &idx, why, sizeof why);
    if (rc == 0) rc = fps_ckpt_snapshot_copy(s, idx, 7 + i, param, &st);
    free(param);
    fps_adafactor_state_destroy(&st);
  }
  fps_ckpt_written_t w;
  if (rc == 0) rc = fps_ckpt_write(dir, s, 3, &w, why, sizeof why);
  fps_ckpt_snapshot_destroy(s);
  if (rc) {
    fprintf(stderr, "write: %s: %s\n", fps_err_name(rc), why);
    return 1;
  }
  printf("%s\n", w.path);
  return 0;
}

static int do_check(const char *path) {
  fps_ckpt_t *c = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  fps_ckpt_expect_t ex = {.shard_id = 1, .shard_count = 2, .mode = "sync"};
  int rc = fps_ckpt_load_file(path, &ex, &c, why, sizeof why);
  if (rc) {
    fprintf(stderr, "load %s: %s: %s\n", path, fps_err_name(rc), why);
    return 1;
  }
  int bad = c->n_tensors != NSPECS;
  for (size_t i = 0; i < c->n_tensors && !bad; i++) {
    const fps_ckpt_tensor_t *t = &c->tensors[i];
    const spec_t *sp = &SPECS[i];
    fps_adafactor_hparams_t hp;
    hparams(sp, &hp);
    fps_state_size_t sz;
    fps_adafactor_state_size(&sp->shape, &hp, &sz);
    bad |= strcmp(t->name, sp->name) != 0;
    bad |= fps_adafactor_hparams_diff(&t->hparams, &hp, why, sizeof why) != 0;
    bad |= t->version != 7 + i || t->state.step != 40 + i || t->state.rms != 0.25f * (float)(i + 1);
    if (bad) {
      fprintf(stderr, "tensor %zu (%s): name, hyperparameters, version, step or rms differ %s\n",
              i, t->name, why);
      break;
    }
    bad |= check(t->param, t->state.numel, i, 0, t->name);
    if (sz.row) bad |= check(t->state.row, sz.row, i, 1, t->name);
    if (sz.col) bad |= check(t->state.col, sz.col, i, 2, t->name);
    if (sz.var) bad |= check(t->state.var, sz.var, i, 3, t->name);
    if (sz.mom) bad |= check(t->state.mom, sz.mom, i, 4, t->name);
  }
  printf("%s: seq %" PRIu64 ", %zu tensors, %s\n", path, c->info.seq, c->n_tensors,
         bad ? "MISMATCH" : "ok");
  fps_ckpt_destroy(c);
  return bad;
}

/* Shard 1 of 2 holding the second block of each: "emb" [2,3,4] rows
 * [2, 6) (both matrices), "bias" [7] elements [3, 7) with hf momentum. */
typedef struct block_spec_s {
  const char *name;
  fps_shape_t shape;
  uint64_t bounds[3];
  bool momentum;
} block_spec_t;

static const block_spec_t BLOCKS[] = {
    {"emb", {3, {2, 3, 4}}, {0, 2, 6}, false},
    {"bias", {1, {7}}, {0, 3, 7}, true},
};

static int do_write_blocks(const char *dir) {
  fps_ckpt_snapshot_t *s = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_snapshot_create(&s, 1, 2, "sync");
  for (size_t i = 0; i < sizeof BLOCKS / sizeof *BLOCKS && rc == 0; i++) {
    const block_spec_t *b = &BLOCKS[i];
    spec_t sp = {b->name, b->shape, b->momentum ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH, b->momentum};
    fps_adafactor_hparams_t hp;
    hparams(&sp, &hp);
    uint32_t shards[2] = {0, 1};
    fps_ckpt_block_t map = {.block_index = 1, .n_blocks = 2, .bounds = (uint64_t *)b->bounds,
                            .block_shards = shards, .shard_count = 2};
    fps_split_geom_t g;
    fps_split_state_t st;
    size_t idx;
    rc = fps_split_geom_init(&g, &b->shape, b->bounds[1], b->bounds[2], why, sizeof why);
    if (rc == 0) rc = fps_split_state_init(&st, &g, &hp);
    if (rc) break;
    float *param = malloc(g.block_numel * sizeof(float));
    fill(param, g.block_numel, i, 0);
    if (st.row) fill(st.row, g.row_hi - g.row_lo, i, 1);
    if (st.col) fill(st.col, g.nmat * g.cols, i, 2);
    if (st.var) fill(st.var, g.block_numel, i, 3);
    if (st.mom) fill(st.mom, g.block_numel, i, 4);
    st.step = 40 + i;
    st.rms = 0.25f * (float)(i + 1);
    rc = fps_ckpt_snapshot_add_block(s, b->name, &b->shape, &hp, &map, &idx, why, sizeof why);
    if (rc == 0) rc = fps_ckpt_snapshot_copy_block(s, idx, 7 + i, param, &st);
    free(param);
    fps_split_state_destroy(&st);
  }
  fps_ckpt_written_t w;
  if (rc == 0) rc = fps_ckpt_write(dir, s, 3, &w, why, sizeof why);
  fps_ckpt_snapshot_destroy(s);
  if (rc) {
    fprintf(stderr, "write-blocks: %s: %s\n", fps_err_name(rc), why);
    return 1;
  }
  printf("%s\n", w.path);
  return 0;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 16 torch tensors of 1024 x cols, about MB megabytes of weights. */
static int do_bench(const char *dir, long mb) {
  enum { N = 16 };
  uint64_t cols = (uint64_t)mb * (1 << 20) / 4 / 1024 / N;
  if (mb <= 0 || cols == 0) return 2;
  fps_shape_t shape = {2, {1024, cols}};
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_adafactor_state_t st[N];
  float *param[N];
  for (int i = 0; i < N; i++) {
    if (fps_adafactor_state_init(&st[i], &shape, &hp)) return 1;
    param[i] = malloc(st[i].numel * sizeof(float));
    if (!param[i]) return 1;
    fill(param[i], st[i].numel, (size_t)i, 0);
  }
  fps_ckpt_snapshot_t *s = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  double t0 = now(), add = 0, copy = 0, copy_max = 0;
  int rc = fps_ckpt_snapshot_create(&s, 0, 1, "async");
  for (int i = 0; i < N && rc == 0; i++) {
    char name[16];
    size_t idx;
    snprintf(name, sizeof name, "w%d", i);
    double a = now();
    rc = fps_ckpt_snapshot_add(s, name, &shape, &hp, &idx, why, sizeof why);
    double b = now();
    if (rc == 0) rc = fps_ckpt_snapshot_copy(s, idx, 1, param[i], &st[i]);
    double c = now();
    add += b - a;
    copy += c - b;
    if (c - b > copy_max) copy_max = c - b;
  }
  double t1 = now();
  fps_ckpt_written_t w;
  if (rc == 0) rc = fps_ckpt_write(dir, s, 1, &w, why, sizeof why);
  double t2 = now();
  double bytes = (double)fps_ckpt_snapshot_bytes(s);
  fps_ckpt_snapshot_destroy(s);
  if (rc) {
    fprintf(stderr, "bench: %s: %s\n", fps_err_name(rc), why);
    return 1;
  }
  fps_ckpt_info_t info;
  rc = fps_ckpt_verify_file(w.path, NULL, &info, why, sizeof why);
  double t3 = now();
  fps_ckpt_t *c = NULL;
  if (rc == 0) rc = fps_ckpt_load_file(w.path, NULL, &c, why, sizeof why);
  double t4 = now();
  fps_ckpt_destroy(c);
  for (int i = 0; i < N; i++) {
    fps_adafactor_state_destroy(&st[i]);
    free(param[i]);
  }
  if (rc) {
    fprintf(stderr, "bench: %s: %s\n", fps_err_name(rc), why);
    return 1;
  }
  double mib = bytes / (1 << 20);
  printf("%.1f MiB of weights+state in %d tensors (%s)\n", mib, N, w.path);
  printf("snapshot add (alloc+prefault, no lock): %.3f s\n", add);
  printf("snapshot copy (under lock): total %.3f s, longest tensor %.4f s, %.2f GiB/s\n", copy,
         copy_max, mib / 1024 / copy);
  printf("write (hash+write+fsync+rename): %.3f s, %.2f GiB/s\n", t2 - t1, mib / 1024 / (t2 - t1));
  printf("verify: %.3f s, %.2f GiB/s\n", t3 - t2, mib / 1024 / (t3 - t2));
  printf("load: %.3f s, %.2f GiB/s\n", t4 - t3, mib / 1024 / (t4 - t3));
  (void)t0;
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "bench") == 0) return do_bench(argv[2], strtol(argv[3], NULL, 10));
  if (argc == 3 && strcmp(argv[1], "write") == 0) return do_write(argv[2]);
  if (argc == 3 && strcmp(argv[1], "check") == 0) return do_check(argv[2]);
  if (argc == 3 && strcmp(argv[1], "write-blocks") == 0) return do_write_blocks(argv[2]);
  fprintf(stderr, "usage: %s write DIR | check PATH | write-blocks DIR | bench DIR MB\n", argv[0]);
  return 2;
}

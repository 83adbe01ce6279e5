/* Checkpoint format: round trip, retention, fallback to the previous valid
 * file, and hostile files (every truncation, flipped bytes, and headers
 * re-sealed with valid digests but invalid contents). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "adafactor.h"
#include "checkpoint.h"
#include "sha256.h"

/* ------------------------------------------------------------ helpers */

typedef struct spec_s {
  const char *name;
  fps_shape_t shape;
  fps_flavor_t flavor;
  int variant; /* 0 defaults, 1 weight decay, 2 hf trainer + beta1 */
} spec_t;

static const spec_t SPECS[] = {
    {"layer0/w", {2, {3, 5}}, FPS_FLAVOR_TORCH, 0},
    {"emb", {3, {2, 3, 4}}, FPS_FLAVOR_TORCH, 1},
    {"bias", {1, {7}}, FPS_FLAVOR_HF, 0},
    {"head.w \xc3\xa9", {2, {4, 6}}, FPS_FLAVOR_HF, 2},
    {"scalar", {0, {0}}, FPS_FLAVOR_TORCH, 0},
};
#define NSPECS (sizeof SPECS / sizeof SPECS[0])

static fps_adafactor_hparams_t spec_hparams(const spec_t *sp) {
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, sp->flavor);
  if (sp->variant == 1) hp.weight_decay = 0.01;
  if (sp->variant == 2) {
    hp.has_lr = true;
    hp.lr = 1e-3;
    hp.relative_step = false;
    hp.scale_parameter = false;
    hp.has_beta1 = true;
    hp.beta1 = 0.9;
  }
  return hp;
}

/* A tensor's live data as the server would hold it. */
typedef struct live_s {
  fps_adafactor_hparams_t hp;
  fps_adafactor_state_t st;
  float *param;
  uint64_t version;
} live_t;

static void fill(float *p, uint64_t n, float base) {
  for (uint64_t i = 0; i < n; i++) p[i] = base + (float)i * 0.5f;
}

static void live_make(live_t *l, const spec_t *sp, int seed) {
  l->hp = spec_hparams(sp);
  assert_int_equal(fps_adafactor_state_init(&l->st, &sp->shape, &l->hp), 0);
  l->param = malloc(l->st.numel * sizeof(float));
  assert_non_null(l->param);
  fill(l->param, l->st.numel, (float)(seed * 1000));
  fps_state_size_t sz;
  assert_int_equal(fps_adafactor_state_size(&sp->shape, &l->hp, &sz), 0);
  if (l->st.row) fill(l->st.row, sz.row, (float)(seed * 1000 + 100));
  if (l->st.col) fill(l->st.col, sz.col, (float)(seed * 1000 + 200));
  if (l->st.var) fill(l->st.var, sz.var, (float)(seed * 1000 + 300));
  if (l->st.mom) fill(l->st.mom, sz.mom, (float)(seed * 1000 + 400));
  l->st.step = 40 + (uint64_t)seed;
  l->st.rms = 0.1f * (float)(seed + 1);
  l->version = 7 + (uint64_t)seed;
}

static void live_free(live_t *l) {
  fps_adafactor_state_destroy(&l->st);
  free(l->param);
}

/* A snapshot of all SPECS whose values depend on `gen`. */
static fps_ckpt_snapshot_t *snapshot_of(live_t *lv, int gen, uint32_t shard, uint32_t count) {
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(&s, shard, count, "sync"), 0);
  for (size_t i = 0; i < NSPECS; i++) {
    live_make(&lv[i], &SPECS[i], (int)i + 10 * gen);
    size_t idx = 99;
    char why[256] = "";
    int rc = fps_ckpt_snapshot_add(s, SPECS[i].name, &SPECS[i].shape, &lv[i].hp, &idx, why,
                                   sizeof why);
    if (rc) fail_msg("add %s: %s", SPECS[i].name, why);
    assert_int_equal(idx, i);
    assert_int_equal(fps_ckpt_snapshot_copy(s, idx, lv[i].version, lv[i].param, &lv[i].st), 0);
  }
  return s;
}

static void write_gen(const char *dir, int gen, unsigned keep, fps_ckpt_written_t *w) {
  live_t lv[NSPECS];
  fps_ckpt_snapshot_t *s = snapshot_of(lv, gen, 0, 2);
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_write(dir, s, keep, w, why, sizeof why);
  if (rc) fail_msg("write: %s: %s", fps_err_name(rc), why);
  fps_ckpt_snapshot_destroy(s);
  for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
}

static void expect_equal_gen(const fps_ckpt_t *c, int gen) {
  assert_int_equal(c->n_tensors, NSPECS);
  for (size_t i = 0; i < NSPECS; i++) {
    live_t l;
    live_make(&l, &SPECS[i], (int)i + 10 * gen);
    const fps_ckpt_tensor_t *t = &c->tensors[i];
    assert_string_equal(t->name, SPECS[i].name);
    char why[128] = "";
    if (fps_adafactor_hparams_diff(&t->hparams, &l.hp, why, sizeof why))
      fail_msg("%s: hparams differ: %s", t->name, why);
    assert_int_equal(t->version, l.version);
    assert_int_equal(t->state.step, l.st.step);
    assert_true(t->state.rms == l.st.rms);
    assert_int_equal(t->state.numel, l.st.numel);
    assert_int_equal(t->state.factored, l.st.factored);
    assert_memory_equal(t->param, l.param, l.st.numel * 4);
    fps_state_size_t sz;
    assert_int_equal(fps_adafactor_state_size(&SPECS[i].shape, &l.hp, &sz), 0);
    assert_true((t->state.row != NULL) == (l.st.row != NULL));
    assert_true((t->state.col != NULL) == (l.st.col != NULL));
    assert_true((t->state.var != NULL) == (l.st.var != NULL));
    assert_true((t->state.mom != NULL) == (l.st.mom != NULL));
    if (l.st.row) assert_memory_equal(t->state.row, l.st.row, sz.row * 4);
    if (l.st.col) assert_memory_equal(t->state.col, l.st.col, sz.col * 4);
    if (l.st.var) assert_memory_equal(t->state.var, l.st.var, sz.var * 4);
    if (l.st.mom) assert_memory_equal(t->state.mom, l.st.mom, sz.mom * 4);
    live_free(&l);
  }
}

static char *make_dir(void) {
  char *d = strdup("/tmp/fps-ckpt-test-XXXXXX");
  assert_non_null(d);
  assert_non_null(mkdtemp(d));
  return d;
}

static void remove_dir(char *d) {
  DIR *dd = opendir(d);
  if (dd) {
    struct dirent *de;
    while ((de = readdir(dd)) != NULL) {
      if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
      char p[FPS_CKPT_PATH_MAX];
      snprintf(p, sizeof p, "%s/%s", d, de->d_name);
      unlink(p);
    }
    closedir(dd);
  }
  rmdir(d);
  free(d);
}

static size_t count_files(const char *d, const char *prefix) {
  size_t n = 0;
  DIR *dd = opendir(d);
  assert_non_null(dd);
  struct dirent *de;
  while ((de = readdir(dd)) != NULL)
    if (strncmp(de->d_name, prefix, strlen(prefix)) == 0) n++;
  closedir(dd);
  return n;
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
  /* A fresh file rather than an overwrite: ext4 flushes files truncated
   * and rewritten in place on close, which would make this test slow. */
  unlink(path);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  if (len) assert_int_equal(fwrite(b, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

typedef struct rejects_s {
  int n;
  char path[FPS_CKPT_PATH_MAX];
  char why[FPS_CKPT_WHY_MAX];
  int err;
} rejects_t;

static void on_reject(void *ctx, const char *path, int err, const char *why) {
  rejects_t *r = ctx;
  r->n++;
  r->err = err;
  snprintf(r->path, sizeof r->path, "%s", path);
  snprintf(r->why, sizeof r->why, "%s", why);
}

static const fps_ckpt_expect_t EXPECT = {.shard_id = 0, .shard_count = 2, .mode = NULL};

/* ------------------------------------------------------------- tests */

/* The shard's way: weights borrowed (fps_ckpt_snapshot_borrow_params),
 * only the state copied. The file is the same as a copying snapshot's
 * (same data digest), the weights are read at write time (changing the
 * live state after the copy changes nothing), and every reference is
 * released exactly once: at a second copy of an index and at destroy. */
static int released[NSPECS + 1];
static void release_ref(void *ref) { released[(int *)ref - released]++; }

static void borrowed_params_round_trip(void **unused) {
  (void)unused;
  char *dir = make_dir(), *dir2 = make_dir();
  fps_ckpt_written_t w, w2;
  write_gen(dir, 1, 3, &w);
  memset(released, 0, sizeof released);
  live_t lv[NSPECS];
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 2, "sync"), 0);
  fps_ckpt_snapshot_borrow_params(s, release_ref);
  for (size_t i = 0; i < NSPECS; i++) {
    live_make(&lv[i], &SPECS[i], (int)i + 10);
    size_t idx;
    assert_int_equal(fps_ckpt_snapshot_add(s, SPECS[i].name, &SPECS[i].shape, &lv[i].hp, &idx, NULL, 0), 0);
    /* a plain copy into a borrowing snapshot is refused */
    assert_int_equal(fps_ckpt_snapshot_copy(s, idx, lv[i].version, lv[i].param, &lv[i].st), FPS_EINVAL);
    int *ref = &released[i];
    assert_int_equal(fps_ckpt_snapshot_copy_ref(s, idx, lv[i].version, lv[i].param, ref, &lv[i].st), 0);
    if (i == 0) { /* copied again: the first reference goes, the second stays */
      assert_int_equal(fps_ckpt_snapshot_copy_ref(s, idx, lv[i].version, lv[i].param, ref, &lv[i].st), 0);
      assert_int_equal(released[0], 1);
    }
    if (lv[i].st.row) lv[i].st.row[0] = -1.0f; /* after the copy: not in the file */
  }
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_write(dir2, s, 3, &w2, why, sizeof why);
  if (rc) fail_msg("write: %s", why);
  for (size_t i = 0; i < NSPECS; i++) assert_int_equal(released[i], i == 0 ? 1 : 0);
  fps_ckpt_snapshot_destroy(s);
  for (size_t i = 0; i < NSPECS; i++) assert_int_equal(released[i], i == 0 ? 2 : 1);
  for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
  assert_int_equal(w2.file_bytes, w.file_bytes);
  fps_ckpt_t *c = NULL, *c1 = NULL;
  assert_int_equal(fps_ckpt_load_file(w2.path, &EXPECT, &c, why, sizeof why), 0);
  assert_int_equal(fps_ckpt_load_file(w.path, &EXPECT, &c1, why, sizeof why), 0);
  expect_equal_gen(c, 1);
  assert_string_equal(c->info.data_sha256, c1->info.data_sha256);
  fps_ckpt_destroy(c);
  fps_ckpt_destroy(c1);
  remove_dir(dir);
  remove_dir(dir2);
}

static void round_trip(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 3, &w);
  assert_int_equal(w.seq, 1);
  assert_int_equal(w.pruned, 0);
  assert_int_equal(w.prune_err, 0);
  assert_non_null(strstr(w.path, "/ckpt-00000001.safetensors"));
  struct stat st;
  assert_int_equal(stat(w.path, &st), 0);
  assert_int_equal((uint64_t)st.st_size, w.file_bytes);
  assert_int_equal(st.st_mode & 0777, 0600);

  fps_ckpt_t *c = NULL;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_load_file(w.path, &EXPECT, &c, why, sizeof why);
  if (rc) fail_msg("load: %s", why);
  expect_equal_gen(c, 1);
  assert_int_equal(c->info.seq, 1);
  assert_int_equal(c->info.shard.shard_id, 0);
  assert_int_equal(c->info.shard.shard_count, 2);
  assert_string_equal(c->info.shard.mode, "sync");
  assert_int_equal(c->info.tensors, NSPECS);
  assert_int_equal(c->info.file_bytes, w.file_bytes);
  assert_int_equal(strlen(c->info.data_sha256), 64);
  assert_int_equal(c->info.created[4], '-');
  /* The data section starts 8-byte aligned. */
  assert_int_equal((c->info.file_bytes - c->info.data_bytes) % 8, 0);
  fps_ckpt_destroy(c);

  /* Ownership transfer: the caller takes a tensor's arrays. */
  c = NULL;
  assert_int_equal(fps_ckpt_load_file(w.path, &EXPECT, &c, NULL, 0), 0);
  float *param = c->tensors[0].param;
  fps_adafactor_state_t taken = c->tensors[0].state;
  c->tensors[0].param = NULL;
  memset(&c->tensors[0].state, 0, sizeof taken);
  fps_ckpt_destroy(c);
  assert_true(param[1] == 10000.5f);
  free(param);
  fps_adafactor_state_destroy(&taken);

  fps_ckpt_info_t info;
  assert_int_equal(fps_ckpt_verify_file(w.path, NULL, &info, why, sizeof why), 0);
  assert_int_equal(info.seq, 1);
  remove_dir(dir);
}

/* The lr and weight decay of a tensor's last update (per-push settings)
 * are stored and restored; without fps_ckpt_snapshot_set_applied() the
 * tensor's own hyperparameters are stored. */
static void applied_settings_round_trip(void **unused) {
  (void)unused;
  char *dir = make_dir();
  live_t lv[NSPECS];
  fps_ckpt_snapshot_t *s = snapshot_of(lv, 1, 0, 2);
  assert_int_equal(fps_ckpt_snapshot_set_applied(s, 0, 0.125, 0.75), 0);
  assert_int_equal(fps_ckpt_snapshot_set_applied(s, 3, 0.0, 0.0), 0);
  assert_int_equal(fps_ckpt_snapshot_set_applied(s, NSPECS, 0.1, 0.1), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_set_applied(s, 1, -0.1, 0.1), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_set_applied(s, 1, 0.1, NAN), FPS_EINVAL);
  fps_ckpt_written_t w;
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_write(dir, s, 1, &w, why, sizeof why);
  if (rc) fail_msg("write: %s", why);
  fps_ckpt_snapshot_destroy(s);
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_file(w.path, &EXPECT, &c, why, sizeof why), 0);
  assert_true(c->tensors[0].last_lr == 0.125 && c->tensors[0].last_weight_decay == 0.75);
  assert_true(c->tensors[3].last_lr == 0.0 && c->tensors[3].last_weight_decay == 0.0);
  /* Not set: the tensor's own lr (hf relative_step: none, 0) and decay. */
  assert_true(c->tensors[1].last_lr == 1e-2 && c->tensors[1].last_weight_decay == 0.01);
  assert_true(c->tensors[2].last_lr == 0.0 && c->tensors[2].last_weight_decay == 0.0);
  fps_ckpt_destroy(c);
  for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
  remove_dir(dir);
}

/* A diverged tensor (NaN or Inf weights, a negative second moment) still
 * checkpoints (the file records what was there), but loading refuses the
 * file, naming the tensor and the array: restored as it was, such state
 * would poison every later step. (The loader then falls back to an older
 * file, see falls_back_past_bad_files.) */
static void non_finite_values_refused_at_load(void **unused) {
  (void)unused;
  char *dir = make_dir();
  const float specials[] = {NAN, INFINITY, -INFINITY, -1.0f};
  for (int k = 0; k < 4; k++) {
    live_t l;
    live_make(&l, &SPECS[2], 1);
    if (k < 3) l.param[0] = specials[k];
    l.st.var[1] = specials[k];
    fps_ckpt_snapshot_t *s = NULL;
    size_t idx;
    assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 2, "sync"), 0);
    assert_int_equal(fps_ckpt_snapshot_add(s, "bias", &SPECS[2].shape, &l.hp, &idx, NULL, 0), 0);
    assert_int_equal(fps_ckpt_snapshot_copy(s, idx, l.version, l.param, &l.st), 0);
    fps_ckpt_written_t w;
    assert_int_equal(fps_ckpt_write(dir, s, 1, &w, NULL, 0), 0);
    fps_ckpt_snapshot_destroy(s);
    fps_ckpt_t *c = NULL;
    char why[FPS_CKPT_WHY_MAX] = "";
    int rc = fps_ckpt_load_file(w.path, &EXPECT, &c, why, sizeof why);
    if (rc != FPS_EFORMAT) fail_msg("special %d: loaded (%d): %s", k, rc, why);
    assert_null(c);
    if (!strstr(why, "tensor \"bias\"") ||
        !strstr(why, k < 3 ? "the weights' element 0" : "var state's element 1") ||
        !strstr(why, k < 3 ? "not finite" : "cannot be negative"))
      fail_msg("special %d: %s", k, why);
    live_free(&l);
  }
  remove_dir(dir);
}

static void empty_snapshot(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(&s, 1, 3, "async"), 0);
  fps_ckpt_written_t w;
  assert_int_equal(fps_ckpt_write(dir, s, 1, &w, NULL, 0), 0);
  fps_ckpt_snapshot_destroy(s);
  fps_ckpt_t *c = NULL;
  fps_ckpt_expect_t ex = {.shard_id = 1, .shard_count = 3, .mode = "async"};
  assert_int_equal(fps_ckpt_load_newest(dir, &ex, NULL, NULL, &c), 0);
  assert_int_equal(c->n_tensors, 0);
  assert_int_equal(c->info.data_bytes, 0);
  fps_ckpt_destroy(c);
  remove_dir(dir);
}

static void keeps_last_k_and_loads_newest(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w;
  for (int g = 1; g <= 5; g++) {
    write_gen(dir, g, 3, &w);
    assert_int_equal(w.seq, (uint64_t)g);
    assert_int_equal(w.pruned, g > 3 ? 1 : 0);
  }
  assert_int_equal(count_files(dir, "ckpt-"), 3);
  char p[FPS_CKPT_PATH_MAX];
  snprintf(p, sizeof p, "%s/ckpt-00000002.safetensors", dir);
  assert_int_equal(access(p, F_OK), -1);
  snprintf(p, sizeof p, "%s/ckpt-00000003.safetensors", dir);
  assert_int_equal(access(p, F_OK), 0);

  rejects_t rj = {0};
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(rj.n, 0);
  assert_int_equal(c->info.seq, 5);
  expect_equal_gen(c, 5);
  fps_ckpt_destroy(c);

  /* keep = 1 after more files: only the new one stays. */
  write_gen(dir, 6, 1, &w);
  assert_int_equal(w.pruned, 3);
  assert_int_equal(count_files(dir, "ckpt-"), 1);

  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  assert_int_equal(fps_ckpt_list(dir, NULL, &e, &n), 0);
  assert_int_equal(n, 1);
  assert_int_equal(e[0].status, 0);
  assert_int_equal(e[0].seq, 6);
  assert_int_equal(e[0].info.tensors, NSPECS);
  fps_ckpt_list_free(e);
  remove_dir(dir);
}

/* Newest truncated, corrupted or mismatched: the previous valid one loads
 * and the skipped file is reported by name with its reason. */
static void falls_back_past_bad_files(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w1, w2, w3, w4;
  write_gen(dir, 1, 10, &w1);
  write_gen(dir, 2, 10, &w2);
  write_gen(dir, 3, 10, &w3);

  /* Corrupt the newest: flip one data bit. */
  size_t len;
  unsigned char *b = read_all(w3.path, &len);
  b[len - 3] ^= 0x10;
  write_all_file(w3.path, b, len);
  free(b);
  rejects_t rj = {0};
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(c->info.seq, 2);
  expect_equal_gen(c, 2);
  fps_ckpt_destroy(c);
  assert_int_equal(rj.n, 1);
  assert_string_equal(rj.path, w3.path);
  assert_int_equal(rj.err, FPS_EFORMAT);
  assert_non_null(strstr(rj.why, "corrupted: data SHA-256"));

  /* Truncate the second newest too. */
  assert_int_equal(truncate(w2.path, (off_t)(w2.file_bytes - 100)), 0);
  memset(&rj, 0, sizeof rj);
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(c->info.seq, 1);
  fps_ckpt_destroy(c);
  assert_int_equal(rj.n, 2);
  assert_string_equal(rj.path, w2.path);
  assert_non_null(strstr(rj.why, "truncated"));

  /* A newer file from another shard is mismatched, not loaded. */
  live_t lv[NSPECS];
  fps_ckpt_snapshot_t *s = snapshot_of(lv, 4, 1, 2);
  assert_int_equal(fps_ckpt_write(dir, s, 10, &w4, NULL, 0), 0);
  fps_ckpt_snapshot_destroy(s);
  for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
  memset(&rj, 0, sizeof rj);
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(c->info.seq, 1);
  fps_ckpt_destroy(c);
  assert_int_equal(rj.n, 3);
  /* Reported newest first: the mismatched one was the first skipped. */
  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  assert_int_equal(fps_ckpt_list(dir, &EXPECT, &e, &n), 0);
  assert_int_equal(n, 4);
  assert_int_equal(e[0].seq, 4);
  assert_int_equal(e[0].status, FPS_ESTATE);
  assert_non_null(strstr(e[0].why, "mismatched: written by shard 1 of 2"));
  assert_int_equal(e[1].status, FPS_EFORMAT);
  assert_int_equal(e[2].status, FPS_EFORMAT);
  assert_int_equal(e[3].status, 0);
  fps_ckpt_list_free(e);

  /* A mode requirement is checked as well. */
  fps_ckpt_expect_t ex = EXPECT;
  ex.mode = "async";
  memset(&rj, 0, sizeof rj);
  assert_int_equal(fps_ckpt_load_newest(dir, &ex, on_reject, &rj, &c), FPS_EFORMAT);
  assert_null(c);
  assert_int_equal(rj.n, 4);
  assert_non_null(strstr(rj.why, "mode"));
  remove_dir(dir);
}

static void empty_or_missing_dir(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), FPS_ENOTFOUND);
  /* Stray files are not checkpoints. */
  char p[FPS_CKPT_PATH_MAX];
  snprintf(p, sizeof p, "%s/ckpt-x.safetensors", dir);
  write_all_file(p, "x", 1);
  snprintf(p, sizeof p, "%s/notes.txt", dir);
  write_all_file(p, "x", 1);
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), FPS_ENOTFOUND);
  /* One garbage checkpoint file: reported (stderr by default), none valid. */
  snprintf(p, sizeof p, "%s/ckpt-7.safetensors", dir);
  write_all_file(p, "garbage!", 8);
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), FPS_EFORMAT);
  assert_null(c);
  /* The next write continues after the highest sequence number seen. */
  fps_ckpt_written_t w;
  write_gen(dir, 1, 5, &w);
  assert_int_equal(w.seq, 8);
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), 0);
  assert_int_equal(c->info.seq, 8);
  fps_ckpt_destroy(c);

  char missing[FPS_CKPT_PATH_MAX];
  snprintf(missing, sizeof missing, "%s/nope", dir);
  assert_int_equal(fps_ckpt_load_newest(missing, &EXPECT, NULL, NULL, &c), FPS_ENOTFOUND);
  fps_ckpt_entry_t *e = NULL;
  size_t n = 9;
  assert_int_equal(fps_ckpt_list(missing, NULL, &e, &n), FPS_ENOTFOUND);
  fps_ckpt_info_t info;
  assert_int_equal(fps_ckpt_verify_file(missing, NULL, &info, NULL, 0), FPS_ENOTFOUND);
  assert_int_equal(fps_ckpt_verify_file(dir, NULL, &info, NULL, 0), FPS_EFORMAT);
  /* A FIFO under a newer checkpoint's name is skipped, not waited on. */
  snprintf(p, sizeof p, "%s/ckpt-9.safetensors", dir);
  assert_int_equal(mkfifo(p, 0600), 0);
  rejects_t rj = {0};
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(c->info.seq, 8);
  assert_int_equal(rj.n, 1);
  assert_string_equal(rj.why, "not a regular file");
  fps_ckpt_destroy(c);
  remove_dir(dir);
}

/* A writer killed mid-write leaves a .tmp file: readers ignore it and the
 * next write removes it. */
static void stale_temp_file(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 5, &w);
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  char p[FPS_CKPT_PATH_MAX];
  snprintf(p, sizeof p, "%s/.ckpt-00000002.safetensors.tmp", dir);
  write_all_file(p, b, len / 2);
  free(b);
  rejects_t rj = {0};
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, on_reject, &rj, &c), 0);
  assert_int_equal(rj.n, 0);
  assert_int_equal(c->info.seq, 1);
  fps_ckpt_destroy(c);
  assert_int_equal(count_files(dir, ".ckpt-"), 1);
  write_gen(dir, 2, 5, &w);
  assert_int_equal(w.seq, 2);
  assert_int_equal(count_files(dir, ".ckpt-"), 0);
  assert_int_equal(count_files(dir, "ckpt-"), 2);
  remove_dir(dir);
}

static void writer_rejects_bad_input(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_snapshot_t *s = NULL;
  assert_int_equal(fps_ckpt_snapshot_create(NULL, 0, 1, "sync"), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 2, 2, "sync"), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 0, "sync"), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 1, "Sync"), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 1, ""), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 1, NULL), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_create(&s, 0, 1, "sync"), 0);

  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_shape_t sh = {2, {3, 4}};
  size_t idx;
  char why[FPS_CKPT_WHY_MAX];
  char longname[FPS_CKPT_NAME_MAX + 2];
  memset(longname, 'a', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  const char *bad_names[] = {"", "__metadata__", "a\nb", "bad\xff", "\xc0\xaf", "\xed\xa0\x80",
                             "a\x7f", longname};
  for (size_t i = 0; i < sizeof bad_names / sizeof *bad_names; i++) {
    why[0] = '\0';
    assert_int_equal(fps_ckpt_snapshot_add(s, bad_names[i], &sh, &hp, &idx, why, sizeof why),
                     FPS_EINVAL);
    assert_true(why[0] != '\0');
  }
  longname[FPS_CKPT_NAME_MAX] = '\0'; /* exactly the maximum is fine */
  fps_shape_t zero = {2, {3, 0}};
  assert_int_equal(fps_ckpt_snapshot_add(s, "z", &zero, &hp, &idx, why, sizeof why), FPS_ESHAPE);
  fps_adafactor_hparams_t bad = hp;
  bad.lr = -1;
  assert_int_equal(fps_ckpt_snapshot_add(s, "h", &sh, &bad, &idx, why, sizeof why), FPS_EHPARAM);
  assert_int_equal(fps_ckpt_snapshot_count(s), 0);

  assert_int_equal(fps_ckpt_snapshot_add(s, longname, &sh, &hp, &idx, why, sizeof why), 0);
  assert_int_equal(fps_ckpt_snapshot_add(s, "a", &sh, &hp, &idx, why, sizeof why), 0);
  assert_int_equal(idx, 1);
  assert_int_equal(fps_ckpt_snapshot_bytes(s), 2 * (12 + 3 + 4) * 4);
  /* Not copied yet. */
  why[0] = '\0';
  assert_int_equal(fps_ckpt_write(dir, s, 2, NULL, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "never copied"));

  fps_adafactor_state_t st, other;
  assert_int_equal(fps_adafactor_state_init(&st, &sh, &hp), 0);
  fps_shape_t sh2 = {2, {4, 3}};
  assert_int_equal(fps_adafactor_state_init(&other, &sh2, &hp), 0);
  float param[12] = {0};
  assert_int_equal(fps_ckpt_snapshot_copy(s, 1, 1, param, &other), FPS_ESHAPE);
  assert_int_equal(fps_ckpt_snapshot_copy(s, 2, 1, param, &st), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_copy(s, 1, 1, NULL, &st), FPS_EINVAL);
  assert_int_equal(fps_ckpt_snapshot_copy(s, 0, 1, param, &st), 0);
  assert_int_equal(fps_ckpt_snapshot_copy(s, 1, 1, param, &st), 0);
  /* An hf state with momentum where the torch layout has none. */
  fps_adafactor_hparams_t hf;
  fps_adafactor_defaults(&hf, FPS_FLAVOR_HF);
  hf.has_lr = true;
  hf.lr = 1e-3;
  hf.relative_step = false;
  hf.has_beta1 = true;
  hf.beta1 = 0.9;
  fps_adafactor_state_t mom;
  assert_int_equal(fps_adafactor_state_init(&mom, &sh, &hf), 0);
  assert_int_equal(fps_ckpt_snapshot_copy(s, 1, 1, param, &mom), FPS_ESHAPE);
  fps_adafactor_state_destroy(&mom);

  assert_int_equal(fps_ckpt_write(dir, s, 0, NULL, why, sizeof why), FPS_EINVAL);
  char missing[FPS_CKPT_PATH_MAX];
  snprintf(missing, sizeof missing, "%s/nope", dir);
  assert_int_equal(fps_ckpt_write(missing, s, 1, NULL, why, sizeof why), FPS_ENOTFOUND);

  /* Another writer holds the directory. */
  int lfd = open(dir, O_RDONLY | O_DIRECTORY);
  assert_true(lfd >= 0);
  assert_int_equal(flock(lfd, LOCK_EX), 0);
  assert_int_equal(fps_ckpt_write(dir, s, 1, NULL, why, sizeof why), FPS_EAGAIN);
  close(lfd);
  assert_int_equal(count_files(dir, "ckpt-"), 0);
  assert_int_equal(fps_ckpt_write(dir, s, 1, NULL, why, sizeof why), 0);

  /* "a" stores "a/row": a tensor named "a/row" would collide. */
  assert_int_equal(fps_ckpt_snapshot_add(s, "a/row", &sh, &hp, &idx, why, sizeof why), 0);
  assert_int_equal(fps_ckpt_snapshot_copy(s, idx, 1, param, &st), 0);
  why[0] = '\0';
  assert_int_equal(fps_ckpt_write(dir, s, 1, NULL, why, sizeof why), FPS_EEXISTS);
  assert_non_null(strstr(why, "\"a/row\""));
  assert_int_equal(count_files(dir, "ckpt-"), 1);
  assert_int_equal(count_files(dir, ".ckpt-"), 0);

  fps_adafactor_state_destroy(&st);
  fps_adafactor_state_destroy(&other);
  fps_ckpt_snapshot_destroy(s);
  fps_ckpt_snapshot_destroy(NULL);
  fps_ckpt_destroy(NULL);
  fps_ckpt_list_free(NULL);
  remove_dir(dir);
}

/* Every proper prefix of a valid file and every single-byte flip (three
 * masks) must be rejected: cleanly, never crashing, never accepted. */
static void hostile_truncations_and_flips(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 1, &w);
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  char p[FPS_CKPT_PATH_MAX];
  snprintf(p, sizeof p, "%s/victim.safetensors", dir);
  char why[FPS_CKPT_WHY_MAX];
  fps_ckpt_info_t info;
  size_t cases = 0;

  for (size_t cut = 0; cut < len; cut++) {
    write_all_file(p, b, cut);
    why[0] = '\0';
    int rc = fps_ckpt_verify_file(p, NULL, &info, why, sizeof why);
    if (rc != FPS_EFORMAT) fail_msg("truncated at %zu: %s (%s)", cut, fps_err_name(rc), why);
    assert_true(why[0] != '\0');
    if (cut % 97 == 0) {
      fps_ckpt_t *c = NULL;
      assert_int_equal(fps_ckpt_load_file(p, NULL, &c, why, sizeof why), FPS_EFORMAT);
      assert_null(c);
    }
    cases++;
  }
  const unsigned char masks[] = {0x01, 0x20, 0x80};
  for (size_t pos = 0; pos < len; pos++) {
    for (size_t m = 0; m < sizeof masks; m++) {
      b[pos] ^= masks[m];
      write_all_file(p, b, len);
      b[pos] ^= masks[m];
      why[0] = '\0';
      int rc;
      if ((pos + m) % 13 == 0) {
        fps_ckpt_t *c = NULL;
        rc = fps_ckpt_load_file(p, NULL, &c, why, sizeof why);
        assert_null(c);
      } else {
        rc = fps_ckpt_verify_file(p, NULL, &info, why, sizeof why);
      }
      if (rc != FPS_EFORMAT)
        fail_msg("byte %zu ^ 0x%02x: %s (%s)", pos, masks[m], fps_err_name(rc), why);
      cases++;
    }
  }
  /* Extra bytes at the end. */
  unsigned char *big = malloc(len + 8);
  memcpy(big, b, len);
  memset(big + len, 0, 8);
  write_all_file(p, big, len + 8);
  assert_int_equal(fps_ckpt_verify_file(p, NULL, &info, why, sizeof why), FPS_EFORMAT);
  free(big);
  /* And the original still verifies. */
  write_all_file(p, b, len);
  assert_int_equal(fps_ckpt_verify_file(p, NULL, &info, why, sizeof why), 0);
  print_message("  %zu damaged files of a %zu-byte checkpoint rejected\n", cases, len);
  free(b);
  remove_dir(dir);
}

/* ------------------------------------- re-sealed headers (valid digests) */

static const char ZEROS[] = "0000000000000000000000000000000000000000000000000000000000000000";

/* Writes `path` from a header object and a data section, with both
 * digests computed as checkpoint.h documents (independently of the
 * writer's code). */
static void seal(const char *path, cJSON *root, const unsigned char *data, size_t dlen) {
  cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
  uint8_t dig[FPS_SHA256_LEN];
  char hex[65];
  assert_int_equal(fps_sha256(data, dlen, dig), 0);
  fps_sha256_hex(dig, hex);
  if (cJSON_GetObjectItemCaseSensitive(meta, "data_sha256"))
    cJSON_ReplaceItemInObjectCaseSensitive(meta, "data_sha256", cJSON_CreateString(hex));
  if (cJSON_GetObjectItemCaseSensitive(meta, "header_sha256"))
    cJSON_ReplaceItemInObjectCaseSensitive(meta, "header_sha256", cJSON_CreateString(ZEROS));
  char *text = cJSON_PrintUnformatted(root);
  assert_non_null(text);
  size_t n = strlen(text), pad = (8 - (8 + n) % 8) % 8;
  size_t total = 8 + n + pad + dlen;
  unsigned char *f = malloc(total);
  for (int i = 0; i < 8; i++) f[i] = (unsigned char)((uint64_t)(n + pad) >> (8 * i));
  memcpy(f + 8, text, n);
  memset(f + 8 + n, ' ', pad);
  if (dlen) memcpy(f + 8 + n + pad, data, dlen);
  cJSON_free(text);
  char *at = strstr((char *)f + 8, "\"header_sha256\":\"");
  if (at) {
    assert_int_equal(fps_sha256(f, 8 + n + pad, dig), 0);
    fps_sha256_hex(dig, hex);
    memcpy(at + strlen("\"header_sha256\":\""), hex, 64);
  }
  write_all_file(path, f, total);
  free(f);
}

typedef void (*mutate_fn)(cJSON *root, cJSON *meta);

static void m_none(cJSON *r, cJSON *m) { (void)r, (void)m; }
static void m_dtype(cJSON *r, cJSON *m) {
  (void)m;
  cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "bias"), "dtype",
                                         cJSON_CreateString("F16"));
}
static void m_shape_swap(cJSON *r, cJSON *m) {
  (void)m;
  cJSON *s = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "layer0/w"), "shape");
  cJSON_ReplaceItemInArray(s, 0, cJSON_CreateNumber(5));
  cJSON_ReplaceItemInArray(s, 1, cJSON_CreateNumber(3));
}
static void set_dim(cJSON *r, double v) {
  cJSON *s = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "bias"), "shape");
  cJSON_ReplaceItemInArray(s, 0, cJSON_CreateNumber(v));
}
static void m_dim_frac(cJSON *r, cJSON *m) { (void)m, set_dim(r, 7.5); }
static void m_dim_neg(cJSON *r, cJSON *m) { (void)m, set_dim(r, -7); }
static void m_dim_huge(cJSON *r, cJSON *m) { (void)m, set_dim(r, 1e300); }
static void m_dim_zero(cJSON *r, cJSON *m) { (void)m, set_dim(r, 0); }
static void m_dims_many(cJSON *r, cJSON *m) {
  (void)m;
  cJSON *s = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "bias"), "shape");
  for (int i = 0; i < 9; i++) cJSON_AddItemToArray(s, cJSON_CreateNumber(1));
}
static void set_offs(cJSON *r, double b, double e) {
  cJSON *o = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "bias"),
                                              "data_offsets");
  cJSON_ReplaceItemInArray(o, 0, cJSON_CreateNumber(b));
  cJSON_ReplaceItemInArray(o, 1, cJSON_CreateNumber(e));
}
static void m_offs_reversed(cJSON *r, cJSON *m) { (void)m, set_offs(r, 40, 12); }
static void m_offs_past_end(cJSON *r, cJSON *m) { (void)m, set_offs(r, 0, 1e12); }
static void m_offs_overlap(cJSON *r, cJSON *m) { (void)m, set_offs(r, 0, 28); }
static void m_offs_three(cJSON *r, cJSON *m) {
  (void)m;
  cJSON *o = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "bias"),
                                              "data_offsets");
  cJSON_AddItemToArray(o, cJSON_CreateNumber(0));
}
static void m_field_extra(cJSON *r, cJSON *m) {
  (void)m;
  cJSON_AddStringToObject(cJSON_GetObjectItemCaseSensitive(r, "bias"), "extra", "x");
}
static void m_no_count(cJSON *r, cJSON *m) { (void)r, cJSON_DeleteItemFromObjectCaseSensitive(m, "tensor_count"); }
static void m_bad_count(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "tensor_count", cJSON_CreateString("4"));
}
static void m_unknown_meta(cJSON *r, cJSON *m) { (void)r, cJSON_AddStringToObject(m, "note", "x"); }
static void m_meta_number(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "shard_id", cJSON_CreateNumber(0));
}
static void m_version3(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "format_version", cJSON_CreateString("3"));
}
static void m_format(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "format", cJSON_CreateString("other"));
}
static void m_seq(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "sequence", cJSON_CreateString("9"));
}
static void m_shard(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "shard_id", cJSON_CreateString("2"));
}
static void m_shard_big(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "shard_count", cJSON_CreateString("4294967296"));
}
static void m_mode(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "mode", cJSON_CreateString("SYNC!"));
}
static void m_extra_entry(cJSON *r, cJSON *m) {
  (void)m;
  cJSON *e = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(r, "bias"), 1);
  cJSON_AddItemToObject(r, "stray", e);
}
static void m_dup_entry(cJSON *r, cJSON *m) {
  (void)m;
  cJSON *e = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(r, "bias"), 1);
  cJSON_AddItemToObject(r, "bias", e);
}
static void m_drop_state(cJSON *r, cJSON *m) { (void)m, cJSON_DeleteItemFromObjectCaseSensitive(r, "bias/var"); }
static void m_drop_tensor_meta(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_DeleteItemFromObjectCaseSensitive(m, "tensor:bias");
  cJSON_ReplaceItemInObjectCaseSensitive(m, "tensor_count", cJSON_CreateString("4"));
}
static void set_tmeta(cJSON *m, const char *key, const char *val) {
  cJSON *t = cJSON_GetObjectItemCaseSensitive(m, "tensor:bias");
  cJSON *o = cJSON_Parse(t->valuestring);
  if (val) cJSON_ReplaceItemInObjectCaseSensitive(o, key, cJSON_CreateString(val));
  else cJSON_DeleteItemFromObjectCaseSensitive(o, key);
  char *s = cJSON_PrintUnformatted(o);
  cJSON_ReplaceItemInObjectCaseSensitive(m, "tensor:bias", cJSON_CreateString(s));
  cJSON_free(s);
  cJSON_Delete(o);
}
static void m_t_flavor(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "flavor", "adam"); }
static void m_t_nan(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "lr", "nan"); }
static void m_t_lr_neg(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "eps2", "-1"); }
static void m_t_bool(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "maximize", "yes"); }
static void m_t_step(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "step", "-3"); }
/* Past FPS_MAX_STEP: a version counted up from it could wrap to 0. */
static void m_t_step_huge(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "step", "9007199254740993"); }
static void m_t_version_huge(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "version", "18446744073709551615"); }
static void m_t_rms_big(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "rms", "1e39"); }
static void m_t_rms_inexact(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "rms", "0.1"); }
static void m_t_missing(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "decay", NULL); }
static void m_t_no_applied(cJSON *r, cJSON *m) {
  (void)r;
  set_tmeta(m, "last_lr", NULL);
  set_tmeta(m, "last_weight_decay", NULL);
}
static void m_t_last_lr_neg(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "last_lr", "-0.5"); }
static void m_t_last_wd_nan(cJSON *r, cJSON *m) { (void)r, set_tmeta(m, "last_weight_decay", "nan"); }
static void m_t_hf_beta1(cJSON *r, cJSON *m) {
  /* Momentum on without a "bias/mom" array stored. */
  (void)r;
  set_tmeta(m, "has_beta1", "true");
  set_tmeta(m, "beta1", "0.9");
}
static void m_t_not_json(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_ReplaceItemInObjectCaseSensitive(m, "tensor:bias", cJSON_CreateString("{oops"));
}
static void m_bad_name(cJSON *r, cJSON *m) {
  (void)r;
  cJSON *t = cJSON_DetachItemFromObjectCaseSensitive(m, "tensor:bias");
  cJSON_AddItemToObject(m, "tensor:", t);
}
static void m_many_tensor_meta(cJSON *r, cJSON *m) {
  /* More tensors described than the header has entries (found by fuzzing:
   * the reader once sized its tensor table by the entries). */
  (void)r;
  const char *tm = cJSON_GetObjectItemCaseSensitive(m, "tensor:bias")->valuestring;
  for (int i = 0; i < 40; i++) {
    char key[32];
    snprintf(key, sizeof key, "tensor:ghost%d", i);
    cJSON_AddStringToObject(m, key, tm);
  }
  cJSON_ReplaceItemInObjectCaseSensitive(m, "tensor_count", cJSON_CreateString("45"));
}
static void m_job(cJSON *r, cJSON *m) { (void)r, cJSON_AddStringToObject(m, "job_id", "job-7"); }
static void m_job_bad(cJSON *r, cJSON *m) { (void)r, cJSON_AddStringToObject(m, "job_id", "job 7"); }
static void m_job_empty(cJSON *r, cJSON *m) { (void)r, cJSON_AddStringToObject(m, "job_id", ""); }
static void m_no_meta(cJSON *r, cJSON *m) { (void)m, cJSON_DeleteItemFromObjectCaseSensitive(r, "__metadata__"); }
static void m_no_header_digest(cJSON *r, cJSON *m) {
  (void)r;
  cJSON_DeleteItemFromObjectCaseSensitive(m, "header_sha256");
}

typedef struct mutation_s {
  const char *what;
  mutate_fn fn;
  const char *why; /* expected substring of the reason; NULL: must verify */
} mutation_t;

static const mutation_t MUTATIONS[] = {
    {"no change", m_none, NULL},
    {"dtype F16", m_dtype, "is not F32"},
    {"transposed weights shape", m_shape_swap, "wrong shape"},
    {"fractional dim", m_dim_frac, "positive integer"},
    {"negative dim", m_dim_neg, "positive integer"},
    {"huge dim", m_dim_huge, "positive integer"},
    {"zero dim", m_dim_zero, "positive integer"},
    {"nine dims", m_dims_many, "more than 8"},
    {"reversed offsets", m_offs_reversed, "out of order"},
    {"offsets past the end", m_offs_past_end, "truncated"},
    {"overlapping offsets", m_offs_overlap, "overlap"},
    {"three offsets", m_offs_three, "two non-negative"},
    {"extra entry field", m_field_extra, "unknown or duplicate field"},
    {"no tensor_count", m_no_count, "lacks \"tensor_count\""},
    {"wrong tensor_count", m_bad_count, "tensor_count"},
    {"unknown metadata key", m_unknown_meta, "unknown metadata key"},
    {"numeric metadata", m_meta_number, "not a string"},
    {"format_version 3", m_version3, "not supported"},
    {"other format", m_format, "format is"},
    {"sequence differs from the name", m_seq, "file name says sequence 1"},
    {"shard id >= count", m_shard, "placement"},
    {"shard count > 2^32", m_shard_big, "placement"},
    {"bad mode", m_mode, "bad mode"},
    {"stray array", m_extra_entry, "belongs to no tensor"},
    {"duplicate array", m_dup_entry, "duplicate header entry"},
    {"missing state array", m_drop_state, "no \"bias/var\" entry"},
    {"missing tensor metadata", m_drop_tensor_meta, "belongs to no tensor"},
    {"unknown flavor", m_t_flavor, "\"flavor\" has a bad value"},
    {"NaN lr", m_t_nan, "\"lr\" has a bad value"},
    {"negative eps2", m_t_lr_neg, "invalid hyperparameters"},
    {"bad bool", m_t_bool, "\"maximize\" has a bad value"},
    {"negative step", m_t_step, "\"step\" has a bad value"},
    {"step past 2^53", m_t_step_huge, "\"step\" has a bad value"},
    {"version 2^64 - 1", m_t_version_huge, "\"version\" has a bad value"},
    {"rms beyond float", m_t_rms_big, "\"rms\" has a bad value"},
    {"rms not a float", m_t_rms_inexact, "\"rms\" has a bad value"},
    {"missing hparam", m_t_missing, "lacks \"decay\""},
    {"no last_lr/last_weight_decay (an earlier writer)", m_t_no_applied, NULL},
    {"negative last_lr", m_t_last_lr_neg, "\"last_lr\" has a bad value"},
    {"NaN last_weight_decay", m_t_last_wd_nan, "\"last_weight_decay\" has a bad value"},
    {"momentum without its array", m_t_hf_beta1, "no \"bias/mom\" entry"},
    {"tensor metadata not JSON", m_t_not_json, "not a JSON object"},
    {"empty tensor name", m_bad_name, "tensor name"},
    {"more tensors than arrays", m_many_tensor_meta, "no weights entry for tensor \"ghost0\""},
    {"a job_id", m_job, NULL},
    {"job_id with a blank", m_job_bad, "bad job_id"},
    {"empty job_id", m_job_empty, "bad job_id"},
    {"no __metadata__", m_no_meta, "header_sha256"},
    {"no header digest", m_no_header_digest, "header_sha256"},
};

static void resealed_headers(void **unused) {
  (void)unused;
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 1, &w);
  size_t len;
  unsigned char *b = read_all(w.path, &len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
  char path[FPS_CKPT_PATH_MAX];
  /* Same name as the original, so the sequence check applies. */
  snprintf(path, sizeof path, "%s/ckpt-1.safetensors", dir);
  unlink(w.path);
  for (size_t i = 0; i < sizeof MUTATIONS / sizeof *MUTATIONS; i++) {
    const mutation_t *mu = &MUTATIONS[i];
    cJSON *root = cJSON_ParseWithLength((const char *)b + 8, n);
    assert_non_null(root);
    mu->fn(root, cJSON_GetObjectItemCaseSensitive(root, "__metadata__"));
    seal(path, root, b + 8 + n, len - 8 - n);
    cJSON_Delete(root);
    char why[FPS_CKPT_WHY_MAX] = "";
    fps_ckpt_t *c = NULL;
    int rc = fps_ckpt_load_file(path, &EXPECT, &c, why, sizeof why);
    if (!mu->why) {
      if (rc) fail_msg("%s: rejected: %s", mu->what, why);
      expect_equal_gen(c, 1);
      fps_ckpt_destroy(c);
      continue;
    }
    if (rc != FPS_EFORMAT || !strstr(why, mu->why))
      fail_msg("%s: got %s \"%s\", want FPS_EFORMAT \"%s\"", mu->what, fps_err_name(rc), why,
               mu->why);
    assert_null(c);
  }

  /* Data section with a gap after the last array (digest still right). */
  cJSON *root = cJSON_ParseWithLength((const char *)b + 8, n);
  unsigned char *data = calloc(1, len - 8 - n + 4);
  memcpy(data, b + 8 + n, len - 8 - n);
  seal(path, root, data, len - 8 - n + 4);
  cJSON_Delete(root);
  free(data);
  char why[FPS_CKPT_WHY_MAX] = "";
  assert_int_equal(fps_ckpt_verify_file(path, NULL, NULL, why, sizeof why), FPS_EFORMAT);
  assert_non_null(strstr(why, "bytes after the last array"));

  /* Raw headers that are not objects, deeply nested, or not JSON. */
  const char *raw[] = {"[]", "{\"a\":1} x", "{\"a\":\"\\u0000\"}", "{{{{{{{{", " {}", "{}",
                       "{\"__metadata__\":[1,2]}",
                       "{\"__metadata__\":[{\"header_sha256\":\"x\"}]}",
                       "{\"__metadata__\":{\"header_sha256\":5}}", "{\"__metadata__\":\"s\"}",
                       "{\"x\":{\"dtype\":\"F32\"}}", "{\"\":{}}", "{\"a\":1,\"a\":2}"};
  for (size_t i = 0; i < sizeof raw / sizeof *raw; i++) {
    /* Padded so that each reaches the JSON parser. */
    size_t hl = strlen(raw[i]);
    hl += (8 - (8 + hl) % 8) % 8;
    unsigned char f[128];
    memset(f, 0, 8);
    memset(f + 8, ' ', hl);
    memcpy(f + 8, raw[i], strlen(raw[i]));
    f[0] = (unsigned char)hl;
    write_all_file(path, f, 8 + hl);
    why[0] = '\0';
    assert_int_equal(fps_ckpt_verify_file(path, NULL, NULL, why, sizeof why), FPS_EFORMAT);
    assert_true(why[0] != '\0');
  }
  size_t deep = 4096;
  unsigned char *f = malloc(8 + deep);
  memset(f, 0, 8);
  f[0] = (unsigned char)(deep & 0xff);
  f[1] = (unsigned char)(deep >> 8);
  memset(f + 8, '[', deep);
  f[8] = '{';
  write_all_file(path, f, 8 + deep);
  free(f);
  assert_int_equal(fps_ckpt_verify_file(path, NULL, NULL, why, sizeof why), FPS_EFORMAT);
  free(b);
  remove_dir(dir);
}

/* A writer killed with SIGKILL at random moments (inside the data write,
 * the fsyncs, the rename or the pruning) never leaves a checkpoint file
 * that fails to verify, and the newest complete one loads. */
static void sigkill_during_writes(void **unused) {
  (void)unused;
  if (getenv("FPS_TEST_EMULATED")) skip(); /* qemu-user: fork hangs */
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 2, &w);
  srand(20261129);
  int mid_write = 0;
  for (int round = 0; round < 12; round++) {
    int ready[2];
    assert_int_equal(pipe(ready), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      close(ready[0]);
      /* Child: two 1 MiB tensors (small enough for qemu-user), written over and over. */
      fps_ckpt_snapshot_t *s = NULL;
      fps_adafactor_hparams_t hp;
      fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
      fps_shape_t sh = {2, {512, 512}};
      fps_adafactor_state_t st;
      float *param = calloc(512 * 512, sizeof(float));
      if (!param || fps_ckpt_snapshot_create(&s, 0, 2, "sync") ||
          fps_adafactor_state_init(&st, &sh, &hp))
        _exit(3);
      for (int i = 0; i < 2; i++) {
        size_t idx;
        char name[8];
        snprintf(name, sizeof name, "t%d", i);
        if (fps_ckpt_snapshot_add(s, name, &sh, &hp, &idx, NULL, 0) ||
            fps_ckpt_snapshot_copy(s, idx, (uint64_t)round, param, &st))
          _exit(4);
      }
      /* Ready: from here on the child only writes checkpoints. */
      if (write(ready[1], "r", 1) != 1) _exit(6);
      for (;;)
        if (fps_ckpt_write(dir, s, 2, NULL, NULL, 0)) _exit(5);
    }
    close(ready[1]);
    char r;
    assert_int_equal(read(ready[0], &r, 1), 1);
    close(ready[0]);
    struct timespec ts = {0, (long)(rand() % 400) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status)); /* killed, not failed */
    mid_write += count_files(dir, ".ckpt-") > 0;

    fps_ckpt_entry_t *e = NULL;
    size_t n = 0;
    assert_int_equal(fps_ckpt_list(dir, &EXPECT, &e, &n), 0);
    assert_true(n >= 1);
    for (size_t i = 0; i < n; i++)
      if (e[i].status) fail_msg("round %d: %s: %s", round, e[i].path, e[i].why);
    fps_ckpt_list_free(e);
    fps_ckpt_t *c = NULL;
    assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), 0);
    fps_ckpt_destroy(c);
  }
  print_message("  %d of 12 kills landed inside a write\n", mid_write);
  /* The next write removes a temporary file the last kill may have left. */
  write_gen(dir, 2, 2, &w);
  assert_int_equal(count_files(dir, ".ckpt-"), 0);
  remove_dir(dir);
}

/* A write that fails half-way (here: the file size limit, as a full disk
 * would) returns FPS_EIO with the reason, leaves no new or temporary file,
 * and deletes no old checkpoint. Runs in a child: the limit is per process. */
static void failed_write_leaves_nothing(void **unused) {
  (void)unused;
  if (getenv("FPS_TEST_EMULATED")) skip(); /* qemu-user: fork hangs */
  char *dir = make_dir();
  fps_ckpt_written_t w;
  write_gen(dir, 1, 1, &w);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN); /* get EFBIG from write() instead of dying */
    struct rlimit rl = {.rlim_cur = 1000, .rlim_max = RLIM_INFINITY};
    if (setrlimit(RLIMIT_FSIZE, &rl)) _exit(3);
    live_t lv[NSPECS];
    fps_ckpt_snapshot_t *s = snapshot_of(lv, 2, 0, 2);
    char why[FPS_CKPT_WHY_MAX] = "";
    int rc = fps_ckpt_write(dir, s, 1, NULL, why, sizeof why);
    fps_ckpt_snapshot_destroy(s);
    for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
    /* Linux says EFBIG; qemu-user reports no progress instead. */
    _exit(rc == FPS_EIO && strncmp(why, "write: ", 7) == 0 ? 0 : 4);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  assert_int_equal(count_files(dir, ".ckpt-"), 0);
  assert_int_equal(count_files(dir, "ckpt-"), 1);
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), 0);
  assert_int_equal(c->info.seq, 1);
  expect_equal_gen(c, 1);
  fps_ckpt_destroy(c);
  remove_dir(dir);
}

typedef struct race_s {
  const char *dir;
  volatile int done;
  int writes;
} race_t;

static void *race_writer(void *arg) {
  race_t *r = arg;
  for (int g = 0; g < 15; g++) {
    live_t lv[NSPECS];
    fps_ckpt_snapshot_t *s = snapshot_of(lv, g, 0, 2);
    if (fps_ckpt_write(r->dir, s, 2, NULL, NULL, 0) == 0) r->writes++;
    fps_ckpt_snapshot_destroy(s);
    for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);
  }
  __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Readers running beside a writer (and its pruning) see complete files
 * only: a file may vanish between the scan and the open (FPS_ENOTFOUND),
 * but none is ever seen half-written. */
static void readers_beside_a_writer(void **unused) {
  (void)unused;
  if (getenv("FPS_TEST_EMULATED")) skip(); /* too slow under qemu-user */
  char *dir = make_dir();
  race_t r = {.dir = dir};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, race_writer, &r), 0);
  int lists = 0;
  while (!__atomic_load_n(&r.done, __ATOMIC_ACQUIRE)) {
    fps_ckpt_entry_t *e = NULL;
    size_t n = 0;
    assert_int_equal(fps_ckpt_list(dir, &EXPECT, &e, &n), 0);
    for (size_t i = 0; i < n; i++)
      if (e[i].status != 0 && e[i].status != FPS_ENOTFOUND)
        fail_msg("%s: %s: %s", e[i].path, fps_err_name(e[i].status), e[i].why);
    fps_ckpt_list_free(e);
    lists++;
  }
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(r.writes, 15);
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_newest(dir, &EXPECT, NULL, NULL, &c), 0);
  assert_int_equal(c->info.seq, 15);
  expect_equal_gen(c, 14);
  fps_ckpt_destroy(c);
  print_message("  %d listings beside 15 writes\n", lists);
  remove_dir(dir);
}

static void directory_lease(void **unused) {
  (void)unused;
  char *dir = make_dir();
  char sub[FPS_CKPT_PATH_MAX], why[FPS_CKPT_WHY_MAX];
  snprintf(sub, sizeof sub, "%s/ckpts", dir);
  assert_int_equal(fps_ckpt_dir_lock(sub, false, why, sizeof why), FPS_ENOTFOUND);
  int fd = fps_ckpt_dir_lock(sub, true, why, sizeof why);
  if (fd < 0) fail_msg("lock: %s", why);
  /* A second holder (another fd, as another process would have) fails
   * and is told who holds the directory. */
  why[0] = '\0';
  assert_int_equal(fps_ckpt_dir_lock(sub, true, why, sizeof why), FPS_EAGAIN);
  char pid[40];
  snprintf(pid, sizeof pid, "(pid %ld)", (long)getpid());
  assert_non_null(strstr(why, pid));
  /* Writes take their own lock, not blocked by the lease. */
  fps_ckpt_written_t w;
  write_gen(sub, 1, 2, &w);
  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  assert_int_equal(fps_ckpt_list(sub, NULL, &e, &n), 0);
  assert_int_equal(n, 1); /* .lock is not a checkpoint */
  fps_ckpt_list_free(e);
  close(fd);
  fd = fps_ckpt_dir_lock(sub, false, why, sizeof why);
  assert_true(fd >= 0);
  close(fd);
  /* Not a directory; parent missing. */
  assert_int_equal(fps_ckpt_dir_lock(w.path, false, why, sizeof why), FPS_EIO);
  assert_non_null(strstr(why, "not a directory"));
  snprintf(sub, sizeof sub, "%s/no/such", dir);
  assert_int_equal(fps_ckpt_dir_lock(sub, true, why, sizeof why), FPS_EIO);
  assert_int_equal(fps_ckpt_dir_lock("", true, why, sizeof why), FPS_EINVAL);
  /* remove_dir removes files only: empty the subdirectory first. */
  snprintf(sub, sizeof sub, "%s/ckpts", dir);
  DIR *dd = opendir(sub);
  struct dirent *de;
  while ((de = readdir(dd)) != NULL) {
    char p[FPS_CKPT_PATH_MAX + 300];
    if (de->d_name[0] == '.' && (de->d_name[1] == '\0' || strcmp(de->d_name, "..") == 0)) continue;
    snprintf(p, sizeof p, "%s/%s", sub, de->d_name);
    unlink(p);
  }
  closedir(dd);
  rmdir(sub);
  remove_dir(dir);
}

/* The job identity: stored when set, checked against a reader's expected
 * job (both named), absent in a file of a shard that never knew its job
 * (that file loads anywhere, byte for byte what earlier writers wrote). */
static void job_identity_checked(void **unused) {
  (void)unused;
  char *dir = make_dir();
  char why[FPS_CKPT_WHY_MAX] = "";
  live_t lv[NSPECS];
  fps_ckpt_snapshot_t *s = snapshot_of(lv, 1, 0, 2);
  assert_int_equal(fps_ckpt_snapshot_set_job(s, "bad id"), FPS_EINVAL);
  char longid[FPS_CKPT_JOB_MAX + 2];
  memset(longid, 'a', sizeof longid - 1);
  longid[sizeof longid - 1] = 0;
  assert_int_equal(fps_ckpt_snapshot_set_job(s, longid), FPS_EINVAL);
  longid[FPS_CKPT_JOB_MAX] = 0;
  assert_int_equal(fps_ckpt_snapshot_set_job(s, longid), 0);
  assert_int_equal(fps_ckpt_snapshot_set_job(s, "job-a.1:x_y"), 0);
  fps_ckpt_written_t w;
  int rc = fps_ckpt_write(dir, s, 3, &w, why, sizeof why);
  if (rc) fail_msg("write: %s", why);
  fps_ckpt_snapshot_destroy(s);
  for (size_t i = 0; i < NSPECS; i++) live_free(&lv[i]);

  fps_ckpt_info_t info;
  fps_ckpt_expect_t ex = EXPECT;
  ex.job_id = "job-a.1:x_y";
  assert_int_equal(fps_ckpt_verify_file(w.path, &ex, &info, why, sizeof why), 0);
  assert_string_equal(info.shard.job_id, "job-a.1:x_y");
  ex.job_id = "job-b";
  assert_int_equal(fps_ckpt_verify_file(w.path, &ex, &info, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "written for job 'job-a.1:x_y', this shard serves job 'job-b'"));
  fps_ckpt_t *c = NULL;
  assert_int_equal(fps_ckpt_load_file(w.path, &ex, &c, why, sizeof why), FPS_ESTATE);
  assert_null(c);
  /* The loader skips it (reporting it) like any mismatched file. */
  rejects_t rj = {0};
  assert_int_equal(fps_ckpt_load_newest(dir, &ex, on_reject, &rj, &c), FPS_EFORMAT);
  assert_int_equal(rj.n, 1);
  assert_int_equal(rj.err, FPS_ESTATE);
  assert_string_equal(rj.path, w.path);
  /* A file without a job loads whatever job the reader expects, and has
   * no "job_id" key at all. */
  write_gen(dir, 2, 3, &w);
  assert_int_equal(fps_ckpt_verify_file(w.path, &ex, &info, why, sizeof why), 0);
  assert_string_equal(info.shard.job_id, "");
  size_t len = 0;
  unsigned char *b = read_all(w.path, &len);
  assert_null(memmem(b, len, "job_id", 6));
  free(b);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(round_trip),
      cmocka_unit_test(borrowed_params_round_trip),
      cmocka_unit_test(applied_settings_round_trip),
      cmocka_unit_test(non_finite_values_refused_at_load),
      cmocka_unit_test(empty_snapshot),
      cmocka_unit_test(keeps_last_k_and_loads_newest),
      cmocka_unit_test(falls_back_past_bad_files),
      cmocka_unit_test(empty_or_missing_dir),
      cmocka_unit_test(stale_temp_file),
      cmocka_unit_test(writer_rejects_bad_input),
      cmocka_unit_test(hostile_truncations_and_flips),
      cmocka_unit_test(resealed_headers),
      cmocka_unit_test(sigkill_during_writes),
      cmocka_unit_test(failed_write_leaves_nothing),
      cmocka_unit_test(readers_beside_a_writer),
      cmocka_unit_test(directory_lease),
      cmocka_unit_test(job_identity_checked),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Resharding checkpoints without a server: a synthetic job
 * written for 2 shards is resharded to 3 and back to 2 by the real
 * `factorps checkpoint reshard` (argv[1]); every output tensor and block
 * equals, bit for bit, the direct split of the job's whole tensors by the
 * workers' placement (fps_client_placement_plan), computed here by slicing
 * independently of the resharding code. Inputs that are not one job
 * (versions, column state, hyperparameters, modes, shards, missing or
 * duplicate tensors) are refused naming the file and the tensor, and a
 * failed reshard leaves nothing in its output directories. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "adafactor_split.h"
#include "alloc.h"
#include "checkpoint.h"
#include "checkpoint_reshard.h"
#include "factorps/client.h"

static const char *CLI;

/* ---------------------------------------------------- the synthetic job */

typedef struct spec_s {
  const char *name;
  fps_shape_t shape;
  int hp; /* 0 torch defaults, 1 hf with beta1, 2 hf without */
} spec_t;

/* With SPLIT_MIN 100 bytes the first three are split, the last two whole. */
static const spec_t SPECS[] = {
    {"emb", {2, {50, 8}}, 0},
    {"stack", {3, {3, 7, 4}}, 0},
    {"bias1d", {1, {40}}, 1},
    {"w", {2, {5, 3}}, 2},
    {"scalar", {0, {0}}, 0},
};
#define NSPECS (sizeof SPECS / sizeof *SPECS)
#define SPLIT_MIN 100

static uint32_t lcg = 12345;
static float rnd(void) {
  lcg = lcg * 1664525u + 1013904223u;
  return (float)((int32_t)(lcg >> 8) - (1 << 23)) / (float)(1 << 20);
}

static void fill(float *p, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) p[i] = rnd();
}

/* Second moments are never negative (a loader refuses a file that says
 * otherwise). */
static void fill_moment(float *p, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) p[i] = fabsf(rnd());
}

/* The job's truth: whole tensors, as a job (sorted by name, like a
 * gathered one). */
static fps_ckpt_job_t *truth_make(void) {
  fps_ckpt_job_t *j = fps_calloc(1, sizeof *j);
  assert_non_null(j);
  j->t = fps_calloc(NSPECS, sizeof *j->t);
  snprintf(j->mode, sizeof j->mode, "sync");
  j->shard_count = 2;
  const spec_t *order[NSPECS];
  for (size_t i = 0; i < NSPECS; i++) order[i] = &SPECS[i];
  for (size_t i = 0; i < NSPECS; i++)
    for (size_t k = i + 1; k < NSPECS; k++)
      if (strcmp(order[k]->name, order[i]->name) < 0) {
        const spec_t *x = order[i];
        order[i] = order[k];
        order[k] = x;
      }
  for (size_t i = 0; i < NSPECS; i++) {
    const spec_t *sp = order[i];
    fps_ckpt_tensor_t *t = &j->t[i];
    j->n = i + 1;
    snprintf(t->name, sizeof t->name, "%s", sp->name);
    fps_adafactor_defaults(&t->hparams, sp->hp ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
    if (sp->hp == 1) {
      t->hparams.has_lr = true;
      t->hparams.lr = 1e-3;
      t->hparams.relative_step = false;
      t->hparams.has_beta1 = true;
      t->hparams.beta1 = 0.9;
    }
    assert_int_equal(fps_adafactor_state_init(&t->state, &sp->shape, &t->hparams), 0);
    void *p = NULL;
    assert_int_equal(fps_aligned_alloc(&p, 64, t->state.numel * sizeof(float)), 0);
    t->param = p;
    fill(t->param, t->state.numel);
    fps_state_size_t sz;
    assert_int_equal(fps_adafactor_state_size(&sp->shape, &t->hparams, &sz), 0);
    if (t->state.row) fill_moment(t->state.row, sz.row);
    if (t->state.col) fill_moment(t->state.col, sz.col);
    if (t->state.var) fill_moment(t->state.var, sz.var);
    if (t->state.mom) fill(t->state.mom, sz.mom);
    t->state.step = 20 + i;
    t->state.rms = 0.125f * (float)(i + 1);
    t->version = 20 + i;
    t->last_lr = 0.001 * (double)(i + 1);
    t->last_weight_decay = 0.0;
  }
  return j;
}

/* The workers' placement of the job on `shards` shards. */
static fps_ckpt_place_t *plan_of(const fps_ckpt_job_t *j, size_t shards, uint64_t split,
                                 size_t *n_plan) {
  fps_tensor_def_t defs[NSPECS];
  memset(defs, 0, sizeof defs);
  for (size_t i = 0; i < j->n; i++) {
    defs[i].name = j->t[i].name;
    defs[i].ndim = j->t[i].state.shape.ndim;
    memcpy(defs[i].shape, j->t[i].state.shape.dim, defs[i].ndim * sizeof(uint64_t));
  }
  fps_block_t b[NSPECS * 8];
  fps_status_t st;
  size_t nb = 0;
  assert_int_equal(fps_client_placement_plan(defs, j->n, shards, split, b, NSPECS * 8, &nb, NULL, &st), 0);
  fps_ckpt_place_t *p = calloc(nb, sizeof *p);
  for (size_t k = 0; k < nb; k++)
    p[k] = (fps_ckpt_place_t){b[k].tensor, (uint32_t)b[k].shard, b[k].row_lo, b[k].row_hi};
  *n_plan = nb;
  return p;
}

/* --------------------------------------------------------- directories */

static char *tmp_root(void) {
  char *d = strdup("/tmp/fps-reshard-XXXXXX");
  assert_non_null(mkdtemp(d));
  return d;
}

static void rm_rf(const char *d) {
  DIR *dd = opendir(d);
  if (!dd) return;
  struct dirent *de;
  while ((de = readdir(dd)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    char p[FPS_CKPT_PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", d, de->d_name);
    struct stat st;
    if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) rm_rf(p);
    else unlink(p);
  }
  closedir(dd);
  rmdir(d);
}

static void dirs_of(char out[][FPS_CKPT_PATH_MAX], const char *root, const char *tag, size_t n) {
  for (size_t k = 0; k < n; k++) snprintf(out[k], FPS_CKPT_PATH_MAX, "%s/%s%zu", root, tag, k);
}

static bool exists(const char *p) {
  struct stat st;
  return stat(p, &st) == 0;
}

/* Runs the CLI; returns its exit status, its output in out. */
static int run_cli(char *out, size_t cap, const char *fmt, ...) {
  char args[8192], cmd[9000];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "'%s' checkpoint reshard %s 2>&1", CLI, args);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  size_t n = fread(out, 1, cap - 1, f);
  out[n] = '\0';
  int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static fps_ckpt_t *load_dir(const char *d) {
  fps_ckpt_t *c = NULL;
  int rc = fps_ckpt_load_newest(d, NULL, NULL, NULL, &c);
  if (rc) fail_msg("load %s: %s", d, fps_err_name(rc));
  return c;
}

/* ------------------------------------------------------------ checking */

static void same_floats(const float *a, const float *b, uint64_t n, const char *what,
                        const char *name, uint32_t shard) {
  if (memcmp(a, b, n * sizeof(float)) != 0)
    fail_msg("shard %u, tensor %s: %s differs from the direct split", shard, name, what);
}

/* Shards' checkpoints in dirs[0..S) hold exactly the truth cut by plan:
 * each block's arrays sliced straight from the whole arrays. */
static void expect_split(const fps_ckpt_job_t *truth, const fps_ckpt_place_t *plan, size_t n_plan,
                         char dirs[][FPS_CKPT_PATH_MAX], uint32_t S) {
  for (uint32_t k = 0; k < S; k++) {
    fps_ckpt_t *c = load_dir(dirs[k]);
    assert_int_equal(c->info.shard.shard_id, k);
    assert_int_equal(c->info.shard.shard_count, S);
    assert_string_equal(c->info.shard.mode, "sync");
    size_t expected = 0;
    for (size_t p = 0; p < n_plan; p++) {
      if (plan[p].shard != k) continue;
      expected++;
      const fps_ckpt_tensor_t *w = &truth->t[plan[p].tensor];
      const fps_ckpt_tensor_t *t = NULL;
      for (size_t i = 0; i < c->n_tensors; i++)
        if (!strcmp(c->tensors[i].name, w->name)) t = &c->tensors[i];
      if (!t) fail_msg("shard %u lacks %s", k, w->name);
      size_t first = p, last = p;
      while (first > 0 && plan[first - 1].tensor == plan[p].tensor) first--;
      while (last + 1 < n_plan && plan[last + 1].tensor == plan[p].tensor) last++;
      assert_int_equal(t->version, w->version);
      assert_true(t->last_lr == w->last_lr);
      assert_memory_equal(&t->hparams, &w->hparams, sizeof t->hparams);
      if (first == last) {
        assert_int_equal(t->block.n_blocks, 0);
        same_floats(t->param, w->param, w->state.numel, "params", w->name, k);
        fps_state_size_t sz;
        assert_int_equal(fps_adafactor_state_size(&w->state.shape, &w->hparams, &sz), 0);
        if (sz.row) same_floats(t->state.row, w->state.row, sz.row, "row", w->name, k);
        if (sz.col) same_floats(t->state.col, w->state.col, sz.col, "col", w->name, k);
        if (sz.var) same_floats(t->state.var, w->state.var, sz.var, "var", w->name, k);
        if (sz.mom) same_floats(t->state.mom, w->state.mom, sz.mom, "mom", w->name, k);
        assert_int_equal(t->state.step, w->state.step);
        assert_true(t->state.rms == w->state.rms);
        continue;
      }
      assert_int_equal(t->block.n_blocks, last - first + 1);
      assert_int_equal(t->block.block_index, p - first);
      assert_int_equal(t->block.shard_count, S);
      for (size_t b = first; b <= last; b++) {
        assert_int_equal(t->block.bounds[b - first], plan[b].row_lo);
        assert_int_equal(t->block.block_shards[b - first], plan[b].shard);
      }
      assert_int_equal(t->block.bounds[last - first + 1], plan[last].row_hi);
      const fps_shape_t *sh = &w->state.shape;
      const uint64_t lo = plan[p].row_lo, hi = plan[p].row_hi;
      const uint64_t C = sh->ndim >= 2 ? sh->dim[sh->ndim - 1] : 1;
      same_floats(t->param, w->param + lo * C, (hi - lo) * C, "block params", w->name, k);
      if (sh->ndim >= 2) {
        const uint64_t R = sh->dim[sh->ndim - 2];
        const uint64_t m0 = lo / R, m1 = (hi - 1) / R;
        same_floats(t->bstate.row, w->state.row + lo, hi - lo, "block row", w->name, k);
        same_floats(t->bstate.col, w->state.col + m0 * C, (m1 - m0 + 1) * C, "block col", w->name, k);
      } else {
        same_floats(t->bstate.var, w->state.var + lo, hi - lo, "block var", w->name, k);
      }
      if (w->state.mom) same_floats(t->bstate.mom, w->state.mom + lo * C, (hi - lo) * C, "block mom", w->name, k);
      assert_int_equal(t->bstate.step, w->state.step);
      assert_true(t->bstate.rms == w->state.rms);
    }
    assert_int_equal(c->n_tensors, expected);
    fps_ckpt_destroy(c);
  }
}

static size_t count_split(const fps_ckpt_place_t *plan, size_t n) {
  size_t s = 0;
  for (size_t p = 1; p < n; p++) s += plan[p].tensor == plan[p - 1].tensor && (p < 2 || plan[p - 2].tensor != plan[p].tensor);
  return s;
}

/* The 2-shard checkpoints of the truth in root/a0, root/a1. */
static void write_two(const fps_ckpt_job_t *truth, const char *root, char a[][FPS_CKPT_PATH_MAX],
                      fps_ckpt_place_t **plan2, size_t *n2) {
  dirs_of(a, root, "a", 2);
  *plan2 = plan_of(truth, 2, SPLIT_MIN, n2);
  assert_true(count_split(*plan2, *n2) >= 3);
  const char *out[2] = {a[0], a[1]};
  char why[FPS_CKPT_WHY_MAX] = "";
  int rc = fps_ckpt_job_write(truth, *plan2, *n2, 2, out, NULL, why, sizeof why);
  if (rc) fail_msg("write: %s", why);
  expect_split(truth, *plan2, *n2, a, 2);
}

/* ---------------------------------------------------------------- tests */

static void reshard_2_3_2(void **unused) {
  (void)unused;
  char *root = tmp_root();
  fps_ckpt_job_t *truth = truth_make();
  char a[2][FPS_CKPT_PATH_MAX], b[3][FPS_CKPT_PATH_MAX], c[2][FPS_CKPT_PATH_MAX];
  fps_ckpt_place_t *plan2, *plan3;
  size_t n2, n3;
  write_two(truth, root, a, &plan2, &n2);
  dirs_of(b, root, "b", 3);
  dirs_of(c, root, "c", 2);
  plan3 = plan_of(truth, 3, SPLIT_MIN, &n3);
  assert_true(count_split(plan3, n3) >= 3);
  char out[16384];
  /* Inputs in any order. */
  int rc = run_cli(out, sizeof out, "--shard-count 3 --split-min-bytes %d %s %s %s %s %s", SPLIT_MIN,
                   a[1], a[0], b[0], b[1], b[2]);
  if (rc) fail_msg("2 -> 3 failed (%d): %s", rc, out);
  assert_non_null(strstr(out, "resharded 5 tensors (3 split) of 2 shards onto 3 shards"));
  expect_split(truth, plan3, n3, b, 3);
  rc = run_cli(out, sizeof out, "--shard-count 2 --split-min-bytes %d %s %s %s %s %s", SPLIT_MIN,
               b[0], b[1], b[2], c[0], c[1]);
  if (rc) fail_msg("3 -> 2 failed (%d): %s", rc, out);
  expect_split(truth, plan2, n2, c, 2);
  /* split_min_bytes 0 (never split): everything whole on 2 shards. */
  char d[2][FPS_CKPT_PATH_MAX];
  dirs_of(d, root, "d", 2);
  size_t n0;
  fps_ckpt_place_t *plan0 = plan_of(truth, 2, 0, &n0);
  assert_int_equal(n0, NSPECS);
  rc = run_cli(out, sizeof out, "--shard-count 2 --split-min-bytes 0 %s %s %s %s %s", b[0], b[1], b[2],
               d[0], d[1]);
  if (rc) fail_msg("3 -> 2 whole failed (%d): %s", rc, out);
  expect_split(truth, plan0, n0, d, 2);
  /* And to a single shard. */
  char e[1][FPS_CKPT_PATH_MAX];
  dirs_of(e, root, "e", 1);
  size_t n1;
  fps_ckpt_place_t *plan1 = plan_of(truth, 1, SPLIT_MIN, &n1);
  rc = run_cli(out, sizeof out, "--shard-count 1 --split-min-bytes %d %s %s %s", SPLIT_MIN, c[0], c[1], e[0]);
  if (rc) fail_msg("2 -> 1 failed (%d): %s", rc, out);
  expect_split(truth, plan1, n1, e, 1);
  free(plan0);
  free(plan1);
  free(plan2);
  free(plan3);
  fps_ckpt_job_destroy(truth);
  rm_rf(root);
  free(root);
}

/* ------------------------------------------------ inputs not of one job */

typedef void (*mutate_fn)(fps_ckpt_t **in, char *file, size_t file_len);

static fps_ckpt_tensor_t *tensor_in(fps_ckpt_t *c, const char *name) {
  for (size_t i = 0; i < c->n_tensors; i++)
    if (!strcmp(c->tensors[i].name, name)) return &c->tensors[i];
  return NULL;
}

static void m_version(fps_ckpt_t **in, char *f, size_t n) {
  tensor_in(in[1], "emb")->version++;
  snprintf(f, n, "%s", in[1]->path);
}
static void m_step(fps_ckpt_t **in, char *f, size_t n) {
  tensor_in(in[0], "bias1d")->bstate.step--;
  snprintf(f, n, "%s", in[0]->path);
}
static void m_hparams(fps_ckpt_t **in, char *f, size_t n) {
  tensor_in(in[1], "emb")->hparams.eps2 *= 2;
  snprintf(f, n, "%s", in[1]->path);
}
/* The column state of the matrix "stack"'s blocks share. */
static void m_col(fps_ckpt_t **in, char *f, size_t n) {
  fps_ckpt_tensor_t *t0 = tensor_in(in[0], "stack"), *t1 = tensor_in(in[1], "stack");
  assert_non_null(t0);
  assert_non_null(t1);
  fps_ckpt_tensor_t *second = t0->block.block_index == 1 ? t0 : t1;
  fps_ckpt_tensor_t *first = second == t0 ? t1 : t0;
  const fps_split_geom_t *g0 = &first->bstate.g, *g1 = &second->bstate.g;
  if (g0->mtx_lo + g0->nmat - 1 != g1->mtx_lo) fail_msg("the plan's blocks of stack share no matrix");
  second->bstate.col[1] = -second->bstate.col[1] + 1.0f;
  snprintf(f, n, "%s", in[second == t0 ? 0 : 1]->path);
}
static void m_missing(fps_ckpt_t **in, char *f, size_t n) {
  fps_ckpt_tensor_t *t = tensor_in(in[1], "emb");
  snprintf(t->name, sizeof t->name, "emb_renamed");
  snprintf(f, n, "%s", in[1]->path);
}
static void m_whole_twice(fps_ckpt_t **in, char *f, size_t n) {
  /* A whole tensor of shard 0 appears again on shard 1. */
  fps_ckpt_tensor_t *w0 = NULL, *w1 = NULL;
  for (size_t i = 0; i < in[0]->n_tensors; i++)
    if (!in[0]->tensors[i].block.n_blocks) w0 = &in[0]->tensors[i];
  for (size_t i = 0; i < in[1]->n_tensors; i++)
    if (!in[1]->tensors[i].block.n_blocks) w1 = &in[1]->tensors[i];
  if (!w0 || !w1) fail_msg("the 2-shard plan has no whole tensor on each shard");
  snprintf(w1->name, sizeof w1->name, "%s", w0->name);
  snprintf(f, n, "%s", in[1]->path);
}
static void m_mode(fps_ckpt_t **in, char *f, size_t n) {
  snprintf(in[1]->info.shard.mode, sizeof in[1]->info.shard.mode, "async");
  snprintf(f, n, "%s", in[1]->path);
}
static void m_same_shard(fps_ckpt_t **in, char *f, size_t n) {
  fps_ckpt_t *x = in[1];
  in[1] = in[0];
  in[0] = x; /* kept for destruction by the caller */
  x->info.shard.shard_id = in[1]->info.shard.shard_id;
  snprintf(f, n, "%s", x->path);
}

static void not_one_job(void **unused) {
  (void)unused;
  static const struct {
    const char *what;
    mutate_fn fn;
    const char *why, *tensor; /* tensor NULL: no tensor named */
  } cases[] = {
      {"block versions differ", m_version, "not of the same step", "'emb'"},
      {"block steps differ", m_step, "not of the same step", "'bias1d'"},
      {"block hparams differ", m_hparams, "different hyperparameters", "'emb'"},
      {"column state copies differ", m_col, "column state of matrix", "'stack'"},
      {"a block missing", m_missing, "is missing from", "'emb'"},
      {"a whole tensor twice", m_whole_twice, "held whole by", ""},
      {"modes differ", m_mode, "mode async", NULL},
      {"one shard twice", m_same_shard, "were both written by shard", NULL},
  };
  char *root = tmp_root();
  fps_ckpt_job_t *truth = truth_make();
  char a[2][FPS_CKPT_PATH_MAX];
  fps_ckpt_place_t *plan2;
  size_t n2;
  write_two(truth, root, a, &plan2, &n2);
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    fps_ckpt_t *in[2] = {load_dir(a[0]), load_dir(a[1])};
    fps_ckpt_t *keep[2] = {in[0], in[1]};
    char file[FPS_CKPT_PATH_MAX] = "", why[FPS_CKPT_WHY_MAX] = "";
    cases[i].fn(in, file, sizeof file);
    fps_ckpt_job_t *job = (fps_ckpt_job_t *)1;
    int rc = fps_ckpt_job_gather(in, 2, &job, why, sizeof why);
    if (rc != FPS_ESTATE || !strstr(why, cases[i].why) || !strstr(why, file) ||
        (cases[i].tensor && !strstr(why, cases[i].tensor)))
      fail_msg("%s: got %s \"%s\", want \"%s\" naming %s and %s", cases[i].what, fps_err_name(rc),
               why, cases[i].why, file, cases[i].tensor ? cases[i].tensor : "-");
    assert_null(job);
    /* Refused inputs are untouched: still destroyable, arrays in place. */
    for (int k = 0; k < 2; k++)
      for (size_t t = 0; t < keep[k]->n_tensors; t++) assert_non_null(keep[k]->tensors[t].param);
    fps_ckpt_destroy(keep[0]);
    fps_ckpt_destroy(keep[1]);
  }
  /* One shard's checkpoint alone is not the job. */
  fps_ckpt_t *one = load_dir(a[0]);
  char why[FPS_CKPT_WHY_MAX] = "";
  fps_ckpt_job_t *job = NULL;
  assert_int_equal(fps_ckpt_job_gather(&one, 1, &job, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "written by shard 0 of 2, but 1 input"));
  fps_ckpt_destroy(one);
  free(plan2);
  fps_ckpt_job_destroy(truth);
  rm_rf(root);
  free(root);
}

/* ------------------------------------------------------ all or nothing */

static void failures_leave_nothing(void **unused) {
  (void)unused;
  char *root = tmp_root();
  fps_ckpt_job_t *truth = truth_make();
  char a[2][FPS_CKPT_PATH_MAX], b[3][FPS_CKPT_PATH_MAX];
  fps_ckpt_place_t *plan2;
  size_t n2;
  write_two(truth, root, a, &plan2, &n2);
  dirs_of(b, root, "b", 3);
  char out[16384];
  /* The last output already holds a checkpoint (an input's): refused
   * before anything is written; the two new directories are gone again. */
  int rc = run_cli(out, sizeof out, "--shard-count 3 --split-min-bytes %d %s %s %s %s %s", SPLIT_MIN,
                   a[0], a[1], b[0], b[1], a[1]);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "already holds 1 checkpoint"));
  assert_non_null(strstr(out, a[1]));
  assert_false(exists(b[0]));
  assert_false(exists(b[1]));
  /* The same output twice. */
  mkdir(b[0], 0700);
  rc = run_cli(out, sizeof out, "--shard-count 2 --split-min-bytes %d %s %s %s %s/.", SPLIT_MIN, a[0],
               a[1], b[0], b[0]);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "are the same directory"));
  /* An output that cannot be created (its parent is missing): the first,
   * already written, is removed again. */
  char deep[FPS_CKPT_PATH_MAX];
  snprintf(deep, sizeof deep, "%s/no/such", root);
  rc = run_cli(out, sizeof out, "--shard-count 2 --split-min-bytes %d %s %s %s %s", SPLIT_MIN, a[0],
               a[1], b[0], deep);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "nothing written"));
  DIR *dd = opendir(b[0]);
  assert_non_null(dd);
  for (struct dirent *de; (de = readdir(dd));)
    if (de->d_name[0] != '.') fail_msg("%s left in %s", de->d_name, b[0]);
  closedir(dd);
  /* A damaged input: its directory has no other checkpoint, so nothing is
   * resharded, and the file and the damage are named. */
  fps_ckpt_t *c1 = load_dir(a[1]);
  char path[FPS_CKPT_PATH_MAX];
  snprintf(path, sizeof path, "%s", c1->path);
  fps_ckpt_destroy(c1);
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  fseek(f, -3, SEEK_END);
  int ch = fgetc(f);
  fseek(f, -3, SEEK_END);
  fputc(ch ^ 0x40, f);
  fclose(f);
  rc = run_cli(out, sizeof out, "--shard-count 3 --split-min-bytes %d %s %s %s %s %s", SPLIT_MIN,
               a[0], a[1], b[0], b[1], b[2]);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, path));
  assert_non_null(strstr(out, "data SHA-256"));
  assert_non_null(strstr(out, "no valid checkpoint"));
  assert_false(exists(b[1]));
  /* An async job: its shards could not hold blocks, so splitting is
   * refused and nothing written; placed whole, it reshards. */
  char x[2][FPS_CKPT_PATH_MAX];
  dirs_of(x, root, "x", 2);
  snprintf(truth->mode, sizeof truth->mode, "async");
  size_t nw;
  fps_ckpt_place_t *whole = plan_of(truth, 2, 0, &nw);
  const char *xo[2] = {x[0], x[1]};
  char why[FPS_CKPT_WHY_MAX] = "";
  assert_int_equal(fps_ckpt_job_write(truth, whole, nw, 2, xo, NULL, why, sizeof why), 0);
  rc = run_cli(out, sizeof out, "--shard-count 3 --split-min-bytes %d %s %s %s %s %s", SPLIT_MIN, x[0],
               x[1], b[0], b[1], b[2]);
  assert_int_equal(rc, 1);
  assert_non_null(strstr(out, "mode async, and split tensors need --mode sync"));
  assert_false(exists(b[2]));
  rc = run_cli(out, sizeof out, "--shard-count 3 %s %s %s %s %s", x[0], x[1], b[0], b[1], b[2]);
  if (rc) fail_msg("async whole reshard failed (%d): %s", rc, out);
  assert_non_null(strstr(out, "mode async"));
  free(whole);
  /* Usage errors. */
  assert_int_equal(run_cli(out, sizeof out, "--shard-count 2 %s %s", a[0], b[0]), 2);
  assert_int_equal(run_cli(out, sizeof out, "%s %s", a[0], b[0]), 2);
  assert_int_equal(run_cli(out, sizeof out, "--shard-count 1 --split-min-bytes 12Q %s %s %s", a[0], a[1], b[0]), 2);
  assert_non_null(strstr(out, "must be a byte count"));
  free(plan2);
  fps_ckpt_job_destroy(truth);
  rm_rf(root);
  free(root);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PATH-TO-factorps\n", argv[0]);
    return 2;
  }
  CLI = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(reshard_2_3_2),
      cmocka_unit_test(not_one_job),
      cmocka_unit_test(failures_leave_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

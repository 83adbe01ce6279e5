/* The row-split placement plan (fps_client_placement_plan, client/placement.c)
 * without a server: the water-filling rule on a worked example, blocks that
 * tile their tensor, independence from the order of the defs, equality with
 * today's whole-tensor placement at split_min_bytes 0, the balance the
 * 100M-parameter load model reaches over 2, 3 and 4 shards, the edges (fewer
 * rows than shards, 1-D tensors), argument errors, and
 * fps_client_create_tensors cutting a tensor into the plan's blocks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "factorps/client.h"
#include "internal.h"

#define MIB (UINT64_C(1) << 20)

static fps_tensor_def_t def2(const char *name, uint64_t r, uint64_t c) {
  fps_tensor_def_t d;
  memset(&d, 0, sizeof d);
  d.name = name;
  d.ndim = 2;
  d.shape[0] = r;
  d.shape[1] = c;
  return d;
}

static fps_tensor_def_t def1(const char *name, uint64_t n) {
  fps_tensor_def_t d = def2(name, n, 1);
  d.ndim = 1;
  d.shape[1] = 0;
  return d;
}

static uint64_t rows_of(const fps_tensor_def_t *d) {
  if (d->ndim < 2) {
    uint64_t n = 1;
    for (uint32_t i = 0; i < d->ndim; i++) n *= d->shape[i];
    return n;
  }
  uint64_t n = 1;
  for (uint32_t i = 0; i + 1 < d->ndim; i++) n *= d->shape[i];
  return n;
}

/* Runs the plan and checks what every plan must satisfy: tensors in defs
 * order, each tiled by its blocks in row order, blocks on increasing shard
 * indices (so at most one per shard), bytes adding up to shard_bytes. */
static size_t plan(const fps_tensor_def_t *defs, size_t n, size_t S, uint64_t split,
                   fps_block_t *b, size_t cap, uint64_t *shard_bytes) {
  fps_status_t st;
  size_t nb = 0;
  int rc = fps_client_placement_plan(defs, n, S, split, b, cap, &nb, shard_bytes, &st);
  if (rc) print_error("plan: %s\n", st.message);
  assert_int_equal(rc, 0);
  uint64_t sum[64] = {0};
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    const uint64_t rows = rows_of(&defs[i]), row_bytes = defs[i].ndim >= 2
                                                             ? 4 * defs[i].shape[defs[i].ndim - 1]
                                                             : 4;
    uint64_t next = 0;
    int last_shard = -1;
    for (; k < nb && b[k].tensor == i; k++) {
      assert_int_equal(b[k].row_lo, next);
      assert_true(b[k].row_hi > b[k].row_lo);
      assert_true(b[k].shard > last_shard && b[k].shard < (int)S);
      assert_int_equal(b[k].bytes, (b[k].row_hi - b[k].row_lo) * row_bytes);
      sum[b[k].shard] += b[k].bytes;
      last_shard = b[k].shard;
      next = b[k].row_hi;
    }
    assert_int_equal(next, rows);
  }
  assert_int_equal(k, nb);
  for (size_t s = 0; s < S; s++) assert_int_equal(sum[s], shard_bytes[s]);
  return nb;
}

/* The worked example of the rule: a (40 B) -> shard 0, b (20 B) -> shard 1
 * by LPT; big (12 rows of 4 B) water-fills shards 2 and 1 to L = 34:
 * targets 14 B and 34 B, cumulative boundary 12 * 14/48 = 3.5 -> row 4. */
static void water_fill_worked_example(void **u) {
  (void)u;
  fps_tensor_def_t defs[] = {def2("big", 12, 1), def1("a", 10), def1("b", 5)};
  fps_block_t b[8];
  uint64_t load[3];
  size_t nb = plan(defs, 3, 3, 48, b, 8, load);
  assert_int_equal(nb, 4);
  assert_int_equal(b[0].shard, 1);
  assert_int_equal(b[0].row_hi, 4);
  assert_int_equal(b[1].shard, 2);
  assert_int_equal(b[1].row_lo, 4);
  assert_int_equal(b[2].shard, 0); /* a */
  assert_int_equal(b[3].shard, 1); /* b */
  assert_int_equal(load[0], 40);
  assert_int_equal(load[1], 36);
  assert_int_equal(load[2], 32);
  /* one byte more of threshold: nothing splits, LPT places big first */
  nb = plan(defs, 3, 3, 49, b, 8, load);
  assert_int_equal(nb, 3);
  assert_int_equal(b[0].shard, 0);
  assert_int_equal(load[0], 48);
}

/* split_min_bytes 0 is today's placement; any order of the defs gives the
 * same map. */
static void zero_never_splits_and_order_is_irrelevant(void **u) {
  (void)u;
  enum { N = 60, S = 3 };
  fps_tensor_def_t defs[N], shuf[N];
  char names[N][16];
  fps__tensor_t t[N];
  unsigned seed = 99;
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "t%02d", i);
    seed = seed * 1103515245u + 12345u;
    uint64_t r = 1 + (seed >> 16) % 300, c = 1 + (seed >> 8) % 200;
    defs[i] = i % 4 ? def2(names[i], r, c) : def1(names[i], r * c);
    memset(&t[i], 0, sizeof t[i]);
    t[i].name = names[i];
    t[i].numel = r * c;
    t[i].bytes = 4 * r * c;
  }
  assert_int_equal(fps__placement_compute(t, N, S, NULL), 0);
  fps_block_t b[N * S], b2[N * S];
  uint64_t load[S], load2[S];
  assert_int_equal(plan(defs, N, S, 0, b, N * S, load), N);
  for (int i = 0; i < N; i++) assert_int_equal(b[i].shard, t[i].shard);
  /* a threshold that splits some tensors, on a reversed-and-rotated list */
  for (int i = 0; i < N; i++) shuf[i] = defs[(N - 1 - i + 17) % N];
  size_t nb = plan(defs, N, S, 100000, b, N * S, load);
  size_t nb2 = plan(shuf, N, S, 100000, b2, N * S, load2);
  assert_int_equal(nb, nb2);
  assert_true(nb > N); /* something was split */
  assert_memory_equal(load, load2, sizeof load);
  for (size_t k = 0; k < nb; k++) {
    const char *name = defs[b[k].tensor].name;
    size_t k2 = 0;
    while (k2 < nb2 && (strcmp(shuf[b2[k2].tensor].name, name) || b2[k2].row_lo != b[k].row_lo))
      k2++;
    assert_true(k2 < nb2);
    assert_int_equal(b2[k2].shard, b[k].shard);
    assert_int_equal(b2[k2].row_hi, b[k].row_hi);
  }
}

/* The shapes `factorps load --model peer --params N --tensors 64` uses
 * (client/cli/models.c fps_cli_model_peer: h the largest multiple of 64
 * with 12 L h^2 <= 0.88 N, L = 10 layers, an embedding [V, h] taking the
 * rest, 3 norm vectors), and the GPT-like default model (fps_cli_model_gpt);
 * `factorps plan` (tests/unit/client/cli/plan_balance.sh) checks the real builders. */
typedef struct model_s {
  fps_tensor_def_t defs[80];
  char names[80][32];
  size_t n;
} model_t;

static void add(model_t *m, const char *name, uint32_t nd, uint64_t a, uint64_t b) {
  snprintf(m->names[m->n], sizeof m->names[0], "%s", name);
  m->defs[m->n] = nd == 1 ? def1(m->names[m->n], a) : def2(m->names[m->n], a, b);
  m->n++;
}

static void model_peer(model_t *m, uint64_t n) {
  const uint64_t layers = 10, extra = 3;
  uint64_t h = (uint64_t)floor(sqrt(0.88 * (double)n / (double)(12 * layers)) / 64.0) * 64;
  uint64_t used = layers * (12 * h * h + 7 * h) + extra * h;
  m->n = 0;
  add(m, "embed", 2, (n - used) / h, h);
  char name[32];
  for (uint64_t l = 0; l < layers; l++) {
    const char *sfx[] = {"wqkv", "wo", "w1", "w2", "b_qkv", "b_1"};
    uint64_t a[] = {3 * h, h, 4 * h, h, 3 * h, 4 * h}, b[] = {h, h, h, 4 * h, 0, 0};
    for (int i = 0; i < 6; i++) {
      snprintf(name, sizeof name, "layer%03llu.%s", (unsigned long long)l, sfx[i]);
      add(m, name, i < 4 ? 2 : 1, a[i], b[i]);
    }
  }
  for (uint64_t i = 0; i < extra; i++) {
    snprintf(name, sizeof name, "norm%llu", (unsigned long long)i);
    add(m, name, 1, h, 0);
  }
}

static void model_gpt(model_t *m, uint64_t n) {
  uint64_t d = (uint64_t)(sqrt((double)n / 100.0) / 8.0 + 0.5) * 8;
  uint64_t per_layer = 12 * d * d + 2 * d;
  uint64_t layers = (uint64_t)((double)n * 0.7 / (double)per_layer);
  m->n = 0;
  add(m, "embed.tok", 2, (n - layers * per_layer - d) / d, d);
  char name[32];
  for (uint64_t l = 0; l < layers; l++) {
    const char *sfx[] = {"ln1", "attn.qkv", "attn.out", "ln2", "mlp.up", "mlp.down"};
    uint32_t nd[] = {1, 2, 2, 1, 2, 2};
    uint64_t a[] = {d, 3 * d, d, d, 4 * d, d}, b[] = {0, d, d, 0, d, 4 * d};
    for (int i = 0; i < 6; i++) {
      snprintf(name, sizeof name, "layer%03llu.%s", (unsigned long long)l, sfx[i]);
      add(m, name, nd[i], a[i], b[i]);
    }
  }
  add(m, "ln_f", 1, d, 0);
}

static double ratio(const uint64_t *load, size_t S) {
  uint64_t mx = 0, mn = UINT64_MAX;
  for (size_t s = 0; s < S; s++) {
    if (load[s] > mx) mx = load[s];
    if (load[s] < mn) mn = load[s];
  }
  return (double)mx / (double)mn;
}

/* Balance: max/min shard parameter bytes <= 1.05 over 2, 3 and 4 shards
 * for the 100M load model at the default threshold (32 MiB), which splits
 * only the embedding; the whole-tensor placement is far off. */
static void load_model_balanced_at_default(void **u) {
  (void)u;
  for (int which = 0; which < 2; which++) {
    model_t m;
    if (which == 0)
      model_peer(&m, 100000000);
    else
      model_gpt(&m, 100000000);
    for (size_t S = 2; S <= 4; S++) {
      fps_block_t b[80 * 4];
      uint64_t whole[4], split[4];
      plan(m.defs, m.n, S, 0, b, 80 * 4, whole);
      size_t nb = plan(m.defs, m.n, S, FPS_SPLIT_MIN_BYTES_DEFAULT, b, 80 * 4, split);
      size_t split_tensors = 0;
      for (size_t k = 1; k < nb; k++) split_tensors += b[k].tensor == b[k - 1].tensor;
      print_message("%s 100M, %zu shards: max/min %.4f whole, %.4f split at 32 MiB "
                    "(%zu extra blocks)\n",
                    which ? "gpt" : "peer", S, ratio(whole, S), ratio(split, S), split_tensors);
      assert_true(ratio(split, S) <= 1.05);
      /* only the embedding is large enough to split */
      assert_true(nb <= m.n + S - 1);
    }
  }
}

static void edges_and_errors(void **u) {
  (void)u;
  fps_block_t b[16];
  uint64_t load[4];
  /* two rows cannot make more than two blocks, whatever the shard count */
  fps_tensor_def_t wide[] = {def2("wide", 2, 1000)};
  assert_int_equal(plan(wide, 1, 4, 1, b, 16, load), 2);
  assert_int_equal(b[0].shard, 0);
  assert_int_equal(b[1].shard, 1);
  /* 1-D tensors split by elements, evenly on empty shards */
  fps_tensor_def_t vec[] = {def1("v", 1001)};
  assert_int_equal(plan(vec, 1, 3, 4, b, 16, load), 3);
  assert_int_equal(b[0].row_hi, 334);
  assert_int_equal(b[1].row_hi, 667);
  assert_int_equal(b[2].row_hi, 1001);
  /* a one-element tensor stays whole */
  fps_tensor_def_t one[] = {def1("one", 1)};
  assert_int_equal(plan(one, 1, 4, 1, b, 16, load), 1);

  fps_status_t st;
  size_t nb = 99;
  assert_int_equal(fps_client_placement_plan(vec, 1, 3, 4, b, 2, &nb, load, &st),
                   FPS_CODE_OUT_OF_RANGE);
  assert_int_equal(nb, 3);
  assert_non_null(strstr(st.message, "3 blocks, room for 2"));
  assert_int_equal(fps_client_placement_plan(vec, 1, 3, 4, NULL, 0, &nb, NULL, &st),
                   FPS_CODE_OUT_OF_RANGE);
  assert_int_equal(nb, 3);
  assert_int_equal(fps_client_placement_plan(vec, 1, 0, 4, b, 16, &nb, NULL, &st),
                   FPS_CODE_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "got 0"));
  fps_tensor_def_t dup[] = {def1("x", 4), def1("x", 5)};
  assert_int_equal(fps_client_placement_plan(dup, 2, 2, 0, b, 16, &nb, NULL, &st),
                   FPS_CODE_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "'x' is listed twice"));
  fps_tensor_def_t zero[] = {def2("z", 3, 0)};
  assert_int_equal(fps_client_placement_plan(zero, 1, 2, 0, b, 16, &nb, NULL, &st),
                   FPS_CODE_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "'z': bad shape"));
  fps_tensor_def_t noname[] = {def1(NULL, 4)};
  assert_int_equal(fps_client_placement_plan(noname, 1, 2, 0, b, 16, &nb, NULL, &st),
                   FPS_CODE_INVALID_ARGUMENT);
}

/* fps_client_create_tensors cuts a tensor of at least split_min_bytes into
 * the plan's blocks and sends each its own Create: a replace whose block
 * does not fit one message is refused before anything is sent, naming the
 * tensor, the block and its rows (the address below is never dialled:
 * channels connect lazily and the refusal comes first); the tensor list
 * places the tensor on its first block's shard. */
static void create_cuts_the_plan_into_blocks(void **u) {
  (void)u;
  const char *addrs[] = {"127.0.0.1:9", "127.0.0.1:9"};
  fps_client_options_t o;
  fps_client_options_init(&o);
  assert_int_equal(o.split_min_bytes, 0);
  o.split_min_bytes = 64;
  o.max_message_bytes = 64 << 10;
  o.deadline_seconds = 1;
  o.max_retries = 0;
  fps_status_t st;
  fps_client_t *c = fps_client_create(addrs, 2, &o, &st);
  assert_non_null(c);
  /* 200 x 256 floats: blocks of 100 rows, 102,400 bytes each. */
  float *init = calloc(200 * 256, sizeof *init);
  assert_non_null(init);
  fps_tensor_def_t defs[] = {def2("emb", 200, 256), def1("bias", 3)};
  defs[0].init = init;
  defs[0].replace = 1;
  assert_int_equal(fps_client_create_tensors(c, defs, 2, &st), FPS_CODE_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "tensor 'emb' block 0 (rows [0, 100)): a replace must travel "
                                     "in one message"));
  assert_int_equal(st.shard, 0);
  /* Without replace the blocks go out (to nobody here: UNAVAILABLE). */
  defs[0].replace = 0;
  int rc = fps_client_create_tensors(c, defs, 2, &st);
  assert_true(rc == FPS_CODE_UNAVAILABLE || rc == FPS_CODE_DEADLINE_EXCEEDED);
  fps_block_t b[4];
  uint64_t bytes[2];
  size_t nb = plan(defs, 2, 2, 64, b, 4, bytes);
  assert_int_equal(nb, 3);
  assert_int_equal(fps_client_shard_of(c, "emb"), b[0].shard);
  assert_int_equal(fps_client_shard_of(c, "bias"), b[2].shard);
  free(init);
  fps_client_destroy(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(water_fill_worked_example),
      cmocka_unit_test(zero_never_splits_and_order_is_irrelevant),
      cmocka_unit_test(load_model_balanced_at_default),
      cmocka_unit_test(edges_and_errors),
      cmocka_unit_test(create_cuts_the_plan_into_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* A parameter buffer's shared bf16 encoding (server/shard/snap_bf16.c):
 * the W replies of a sync round get one encoding, converted once, equal to
 * fps_f32_to_bf16 of every parameter; each buffer has its own; it lives
 * while a reply holds a reference (and keeps its buffer alive), is counted
 * against max_staging_bytes, and the last reference frees it; over the
 * limit or out of memory there is none (the reply converts its own) and
 * nothing is left behind; replies racing for it share one conversion.
 * An update whose replies send bf16 makes their encoding in its pass C
 * (one reference per bf16 reply), within the same limit. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"
#include "shard_fixture.h"

static const uint64_t DIMS_A[] = {33, 17}; /* odd numel: the last bf16 half-fills a float */
#define NA (33 * 17)
static const uint64_t DIMS_B[] = {64, 8};
#define NB (64 * 8)
#define W 4

/* What one encoding of n elements may add to the staging bytes: its 2n
 * bytes and a header of less than 64. */
static void assert_charged(uint64_t delta, uint64_t n) {
  assert_true(delta >= 2 * n);
  assert_true(delta < 2 * n + 64);
}

/* p holds n little-endian bf16 equal to fps_f32_to_bf16(src[i]). */
static void assert_bf16_of(const uint8_t *p, const float *src, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) {
    uint16_t want = fps_f32_to_bf16(src[i]);
    assert_int_equal(p[2 * i] | (p[2 * i + 1] << 8), want);
  }
}

/* One sync round of W workers over tensors a and b; snaps[w][0..1] get
 * each worker's snapshot references. */
static void sync_round(fps_shard_t *sh, uint64_t step, uint32_t seed, fps_snap_t *snaps[W][2]) {
  static float ga[NA], gb[NB];
  fps_push_t *p[W];
  fx_done_t d[W];
  for (uint32_t w = 0; w < W; w++) {
    fx_fill(ga, NA, seed + 2 * w);
    fx_fill(gb, NB, seed + 2 * w + 1);
    p[w] = fx_push_new(sh, w, step, INT64_MAX, &d[w]);
    assert_int_equal(fx_push_grad(p[w], "a", ga, NA, 1, NULL), 0);
    assert_int_equal(fx_push_grad(p[w], "b", gb, NB, 1, NULL), 0);
    assert_int_equal(fx_commit(p[w], NULL), w < W - 1 ? FPS_EAGAIN : 0);
  }
  for (uint32_t w = 0; w < W; w++) {
    char why[FPS_WHY_MAX];
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    assert_int_equal(fps_push_count(p[w]), 2);
    for (size_t i = 0; i < 2; i++) {
      fps_push_out_t o;
      fps_push_take(p[w], i, &o);
      assert_non_null(o.snap);
      assert_int_equal(o.version, step + 1);
      snaps[w][i] = o.snap;
    }
    fps_push_destroy(p[w]);
  }
}

static void sync_replies_share_one_encoding_per_buffer(void **unused) {
  (void)unused;
  static float init_a[NA], init_b[NB];
  static const uint64_t n[2] = {NA, NB};
  fx_fill(init_a, NA, 1);
  fx_fill(init_b, NB, 2);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, W, 0);
  assert_int_equal(fx_create(&sh, "a", DIMS_A, 2, init_a), 0);
  assert_int_equal(fx_create(&sh, "b", DIMS_B, 2, init_b), 0);

  fps_snap_t *r1[W][2];
  sync_round(&sh, 0, 10, r1);
  /* One buffer per tensor, shared by the W replies. */
  fps_snap_t *s1[2] = {r1[0][0], r1[0][1]};
  assert_ptr_not_equal(s1[0], s1[1]);
  for (uint32_t w = 0; w < W; w++)
    for (size_t i = 0; i < 2; i++) assert_ptr_equal(r1[w][i], s1[i]);
  int refs0[2] = {atomic_load(&s1[0]->refs), atomic_load(&s1[1]->refs)};
  uint64_t base = fps_shard_in_flight_bytes(&sh);

  /* W replies, each taking a reference to each tensor's encoding: the
   * first converts (and the encoding takes one buffer reference), all get
   * the same encoding, charged once. */
  fps_snap_bf16_t *e[W][2];
  for (uint32_t w = 0; w < W; w++)
    for (size_t i = 0; i < 2; i++) {
      assert_non_null(e[w][i] = fps_snap_bf16_get(&sh, r1[w][i]));
      assert_ptr_equal(e[w][i], e[0][i]);
      assert_int_equal(atomic_load(&s1[i]->refs), refs0[i] + 1);
    }
  assert_ptr_not_equal(e[0][0], e[0][1]);
  for (size_t i = 0; i < 2; i++) assert_bf16_of(fps_snap_bf16_data(e[0][i]), s1[i]->data, n[i]);
  uint64_t charged = fps_shard_in_flight_bytes(&sh) - base;
  assert_true(charged >= 2 * (NA + NB) && charged < 2 * (NA + NB) + 128);

  /* Slices over it hold references too. */
  fps_snap_bf16_ref(e[0][0]);
  /* The workers let go of the buffers (the next round may retire them):
   * the encodings keep theirs alive and readable (ASan catches a read of
   * a freed buffer). */
  for (uint32_t w = 0; w < W; w++)
    for (size_t i = 0; i < 2; i++) fps_snap_unref(r1[w][i]);
  fps_snap_t *r2[W][2];
  sync_round(&sh, 1, 20, r2);
  for (size_t i = 0; i < 2; i++) {
    assert_ptr_not_equal(r2[0][i], s1[i]);
    assert_bf16_of(fps_snap_bf16_data(e[0][i]), s1[i]->data, n[i]);
  }
  /* The new buffers get their own encodings. */
  for (size_t i = 0; i < 2; i++) {
    uint64_t before = fps_shard_in_flight_bytes(&sh);
    fps_snap_bf16_t *e2 = fps_snap_bf16_get(&sh, r2[0][i]);
    assert_non_null(e2);
    assert_ptr_not_equal(e2, e[0][i]);
    assert_bf16_of(fps_snap_bf16_data(e2), r2[0][i]->data, n[i]);
    assert_charged(fps_shard_in_flight_bytes(&sh) - before, n[i]);
    assert_memory_not_equal(fps_snap_bf16_data(e2), fps_snap_bf16_data(e[0][i]), 16);
    fps_snap_bf16_unref(e2);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), before);
    assert_null(r2[0][i]->bf16); /* the next reply converts afresh */
  }
  /* The replies end one by one; the last reference frees each encoding,
   * and with it the old buffer. */
  for (uint32_t w = 0; w < W; w++)
    for (size_t i = 0; i < 2; i++) fps_snap_bf16_unref(e[w][i]);
  fps_snap_bf16_unref(e[0][0]); /* the slice */
  fps_snap_bf16_unref(NULL);
  for (uint32_t w = 0; w < W; w++)
    for (size_t i = 0; i < 2; i++) fps_snap_unref(r2[w][i]);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

static void limit_and_oom_leave_no_encoding(void **unused) {
  (void)unused;
  static float init[NA];
  fx_fill(init, NA, 3);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&sh, "a", DIMS_A, 2, init), 0);
  fps_tensor_t *t;
  fps_snap_t *snap;
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_shard_snapshot(&sh, "a", &t, &snap, why, sizeof why), 0);
  int refs0 = atomic_load(&snap->refs);
  uint64_t base = fps_shard_in_flight_bytes(&sh);

  /* Short of the encoding's bytes: none, nothing charged, no reference
   * kept, and a later reply may try again. */
  sh.cfg.max_staging_bytes = base + 2 * NA - 1;
  for (int i = 0; i < 3; i++) {
    assert_null(fps_snap_bf16_get(&sh, snap));
    assert_int_equal(fps_shard_in_flight_bytes(&sh), base);
    assert_null(snap->bf16);
    assert_int_equal(atomic_load(&snap->refs), refs0);
  }
  /* Out of memory: the same. */
  sh.cfg.max_staging_bytes = 64u << 20;
  fps_alloc_fault_arm(1, 1);
  fps_snap_bf16_t *e = fps_snap_bf16_get(&sh, snap);
  fps_alloc_fault_disarm();
  assert_null(e);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), base);
  assert_null(snap->bf16);
  assert_int_equal(atomic_load(&snap->refs), refs0);
  /* Room: made and charged. */
  assert_non_null(e = fps_snap_bf16_get(&sh, snap));
  assert_bf16_of(fps_snap_bf16_data(e), init, NA);
  assert_charged(fps_shard_in_flight_bytes(&sh) - base, NA);
  fps_snap_bf16_unref(e);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), base);
  assert_int_equal(atomic_load(&snap->refs), refs0);
  fps_snap_unref(snap);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* Replies of one buffer on several threads at once: each retries until it
 * has the encoding and holds it until all have one, so all must hold the
 * same one (one conversion). TSan checks the conversion's writes against
 * the other threads' reads. */
#define RACERS 4
#define NBIG (1u << 20)

typedef struct racer_s {
  fps_shard_t *sh;
  fps_snap_t *snap;
  pthread_barrier_t *go, *held;
  fps_snap_bf16_t *got;
  unsigned sum;               /* bytes read from it, so they are read */
} racer_t;

static void *racer_main(void *arg) {
  racer_t *r = arg;
  pthread_barrier_wait(r->go);
  /* The bound on tries ends a broken build's test instead of hanging it. */
  for (long tries = 0; !r->got && tries < 10000000; tries++)
    if (!(r->got = fps_snap_bf16_get(r->sh, r->snap))) sched_yield();
  if (r->got)
    for (size_t i = 0; i < 2 * NBIG; i += 4099) r->sum += fps_snap_bf16_data(r->got)[i];
  pthread_barrier_wait(r->held);
  return NULL;
}

static void racing_replies_share_one_conversion(void **unused) {
  (void)unused;
  float *init = malloc(NBIG * sizeof(float));
  assert_non_null(init);
  fx_fill(init, NBIG, 4);
  const uint64_t dims[] = {1024, NBIG / 1024};
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&sh, "big", dims, 2, init), 0);
  fps_tensor_t *t;
  fps_snap_t *snap;
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_shard_snapshot(&sh, "big", &t, &snap, why, sizeof why), 0);
  uint64_t base = fps_shard_in_flight_bytes(&sh);
  for (int round = 0; round < 3; round++) {
    pthread_barrier_t go, held;
    pthread_barrier_init(&go, NULL, RACERS);
    pthread_barrier_init(&held, NULL, RACERS + 1);
    pthread_t th[RACERS];
    racer_t r[RACERS];
    for (int i = 0; i < RACERS; i++) {
      r[i] = (racer_t){.sh = &sh, .snap = snap, .go = &go, .held = &held};
      assert_int_equal(pthread_create(&th[i], NULL, racer_main, &r[i]), 0);
    }
    pthread_barrier_wait(&held); /* every racer holds its reference */
    for (int i = 0; i < RACERS; i++) {
      assert_non_null(r[i].got);
      assert_ptr_equal(r[i].got, r[0].got);
    }
    assert_charged(fps_shard_in_flight_bytes(&sh) - base, NBIG);
    assert_bf16_of(fps_snap_bf16_data(r[0].got), init, NBIG);
    for (int i = 0; i < RACERS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
    pthread_barrier_destroy(&held);
    for (int i = 0; i < RACERS; i++) fps_snap_bf16_unref(r[i].got);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), base);
    assert_null(snap->bf16);
  }
  fps_snap_unref(snap);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
  free(init);
}

/* ---- the update's own encoding (made in its pass C) ---- */

/* Tensor name's gradient g (numel floats) as one bf16 slice. */
static void push_bf16(fps_shard_t *sh, fps_push_t *p, const char *name, const float *g, uint64_t numel) {
  uint8_t *b = malloc(numel * 2);
  assert_non_null(b);
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_BF16, g, numel, b), 0);
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  fps_slice_t s = {.dtype = FPS_DTYPE_BF16, .offset = 0, .data = b, .len = numel * 2,
                   .shape = t->shape.dim, .n_shape = t->shape.ndim};
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_push_slice(p, name, &s, why, sizeof why), 0);
  free(b);
}

/* A sync round with bf16 members 0 and 2 and fp32 members 1 and 3: the
 * update attaches one encoding to the new buffer with a reference for each
 * bf16 member (the fp32 ones get none), equal to fps_f32_to_bf16 of the
 * new parameters; a reply finds it made; an encoding reference not taken
 * goes with its push, and the last one frees it and its charge. */
static void sync_update_encodes_for_bf16_members(void **unused) {
  (void)unused;
  static float init[NA], g[NA];
  fx_fill(init, NA, 5);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_SYNC, W, 0);
  assert_int_equal(fx_create(&sh, "a", DIMS_A, 2, init), 0);
  fps_push_t *p[W];
  fx_done_t d[W];
  for (uint32_t w = 0; w < W; w++) {
    fx_fill(g, NA, 40 + w);
    p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
    if (w % 2 == 0) push_bf16(&sh, p[w], "a", g, NA);
    else assert_int_equal(fx_push_grad(p[w], "a", g, NA, 1, NULL), 0);
    assert_int_equal(fx_commit(p[w], NULL), w < W - 1 ? FPS_EAGAIN : 0);
  }
  fps_snap_t *snap[W];
  for (uint32_t w = 0; w < W; w++) {
    char why[FPS_WHY_MAX];
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_out_t o;
    fps_push_take(p[w], 0, &o);
    snap[w] = o.snap;
  }
  assert_non_null(snap[0]->bf16); /* attached before anyone could read it */
  fps_snap_bf16_t *e0 = fps_push_take_bf16(p[0], 0);
  assert_non_null(e0);
  assert_null(fps_push_take_bf16(p[0], 0)); /* moved */
  assert_null(fps_push_take_bf16(p[1], 0));
  assert_null(fps_push_take_bf16(p[3], 0));
  assert_ptr_equal(snap[0]->bf16, e0);
  assert_bf16_of(fps_snap_bf16_data(e0), snap[0]->data, NA);
  /* A reply of this buffer finds it made: the same encoding, no charge. */
  uint64_t held = atomic_load(&sh.tbuf_bytes);
  fps_snap_bf16_t *r = fps_snap_bf16_get(&sh, snap[1]);
  assert_ptr_equal(r, e0);
  assert_int_equal(atomic_load(&sh.tbuf_bytes), held);
  fps_snap_bf16_unref(r);
  /* Worker 2 never takes its reference: its push's end drops it. */
  for (uint32_t w = 0; w < W; w++) fps_push_destroy(p[w]);
  assert_ptr_equal(snap[0]->bf16, e0);
  for (uint32_t w = 0; w < W; w++) fps_snap_unref(snap[w]);
  uint64_t before = atomic_load(&sh.tbuf_bytes);
  fps_snap_bf16_unref(e0); /* the last: the encoding and its buffer go */
  assert_true(before - atomic_load(&sh.tbuf_bytes) >= 2 * NA);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* Async: a bf16 push's update makes its reply's encoding, an fp32 push's
 * none; at the staging limit the update runs without one (the push
 * succeeds as before, nothing is charged, the reply would convert). */
static void async_update_encodes_within_the_limit(void **unused) {
  (void)unused;
  static float init[NA], g[NA], want[NA];
  fx_fill(init, NA, 6);
  fps_shard_t sh;
  fx_shard(&sh, FPS_MODE_ASYNC, 1, 0);
  assert_int_equal(fx_create(&sh, "a", DIMS_A, 2, init), 0);
  for (int round = 0; round < 3; round++) { /* 0 bf16, 1 fp32, 2 bf16 over the limit */
    fx_fill(g, NA, 60 + round);
    fx_done_t d;
    fps_push_t *p = fx_push_new(&sh, 0, 0, INT64_MAX, &d);
    if (round == 1) assert_int_equal(fx_push_grad(p, "a", g, NA, 1, NULL), 0);
    else push_bf16(&sh, p, "a", g, NA);
    uint64_t staged = atomic_load(&sh.tbuf_bytes);
    if (round == 2) sh.cfg.max_staging_bytes = staged + 2 * NA - 1;
    assert_int_equal(fx_commit(p, NULL), 0);
    assert_int_equal(fps_push_result(p, NULL, 0), 0);
    fps_push_out_t o;
    fps_push_take(p, 0, &o);
    fps_snap_bf16_t *e = fps_push_take_bf16(p, 0);
    assert_int_equal(fx_params(&sh, "a", want), (uint64_t)round + 1);
    assert_memory_equal(o.snap->data, want, sizeof want);
    if (round == 0) {
      assert_non_null(e);
      assert_bf16_of(fps_snap_bf16_data(e), want, NA);
    } else {
      assert_null(e);
      assert_null(o.snap->bf16);
    }
    fps_snap_bf16_unref(e);
    fps_snap_unref(o.snap);
    fps_push_destroy(p);
    sh.cfg.max_staging_bytes = 64u << 20;
  }
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sync_replies_share_one_encoding_per_buffer),
      cmocka_unit_test(limit_and_oom_leave_no_encoding),
      cmocka_unit_test(racing_replies_share_one_conversion),
      cmocka_unit_test(sync_update_encodes_for_bf16_members),
      cmocka_unit_test(async_update_encodes_within_the_limit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

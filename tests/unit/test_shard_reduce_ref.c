/* Sync staging by reference (server/shard/reduce.c with slice owners), the
 * core driven directly the way the PushPull handler drives it: every slice
 * comes in its own "message", a heap copy held by a counting owner that the
 * test lets go of right after the slice call (as the handler does), so the
 * core can only read it through the references it took; the last unref
 * frees it (ASan catches a read after that). Checked: random orders, sizes
 * and dtypes give the replay's bits; a held message counts once against
 * max_staging_bytes and the count returns to 0; the limit gives
 * FPS_ELIMIT; a bad value in a staged piece fails its push with
 * FPS_EINVAL naming the element, at once if it waits in its round, and
 * nothing is applied; every reference is dropped after success, a bad
 * value, a cancel, an aborted round and a shutdown. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "shard/reduce.h"
#include "shard_fixture.h"
#include "simd/kernels.h"

static const uint64_t DIMS[] = {37, 29};
#define N (37 * 29)
#define WMAX 4

/* Owners alive (messages not freed yet) and references taken, all tests. */
static long live_msgs;

typedef struct msg_s {
  fps_slice_owner_t owner;
  int refs;
  uint8_t *bytes;
} msg_t;

static void msg_ref(void *ctx) { ((msg_t *)ctx)->refs++; }

static void msg_unref(void *ctx) {
  msg_t *m = ctx;
  if (--m->refs > 0) return;
  free(m->bytes);
  free(m);
  live_msgs--;
}

/* A message holding a copy of n bytes, one reference (the "handler's"). */
static msg_t *msg_new(const void *src, size_t n) {
  msg_t *m = calloc(1, sizeof *m);
  assert_non_null(m);
  m->bytes = malloc(n ? n : 1);
  assert_non_null(m->bytes);
  memcpy(m->bytes, src, n);
  m->refs = 1;
  m->owner.ref = msg_ref;
  m->owner.unref = msg_unref;
  m->owner.ctx = m;
  m->owner.bytes = n;
  atomic_init(&m->owner.staged, 0);
  live_msgs++;
  return m;
}

/* Sends wire bytes of [lo, hi) in dtype dt as one message; returns the
 * slice call's result. The test's reference is dropped afterwards. */
static int send_ref(fps_push_t *p, fps_shard_t *sh, int dt, const uint8_t *wire, uint64_t lo, uint64_t hi,
                    char *why) {
  fps_tensor_t *t = fps_store_find(&sh->store, "w");
  size_t len = (size_t)(hi - lo) * fps_dtype_size(dt);
  msg_t *m = msg_new(wire, len);
  fps_slice_t s = {.dtype = dt, .shape = t->shape.dim, .n_shape = t->shape.ndim, .offset = lo,
                   .data = m->bytes, .len = len, .owner = &m->owner};
  int rc = fps_push_slice(p, "w", &s, why, FPS_WHY_MAX);
  msg_unref(m);
  return rc;
}

static void send_f32(fps_push_t *p, fps_shard_t *sh, const float *g, uint64_t lo, uint64_t hi) {
  char why[FPS_WHY_MAX];
  int rc = send_ref(p, sh, FPS_DTYPE_F32, (const uint8_t *)(g + lo), lo, hi, why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0);
}

/* One round of random slices by reference; returns whether anything was
 * staged (the accumulator is N * 4 bytes). */
static bool random_round(const fps_kernels_t *k, uint32_t W, uint32_t seed) {
  static float init[N], g[WMAX][N], want[N], got[N];
  static fx_ev_t ev[WMAX * 32];
  uint32_t s = seed * 2654435761u + 11;
  fx_fill(init, N, seed);
  size_t nev = 0;
  for (uint32_t w = 0; w < W; w++) {
    fx_fill(g[w], N, seed * 17 + w + 1);
    fx_random_slices(&s, w, g[w], N, 30, ev, &nev);
  }
  fx_shuffle(&s, ev, nev);
  fx_replay(k, DIMS, 2, init, &g[0][0], W, want);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, W, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_push_t *p[WMAX];
  fx_done_t d[WMAX];
  size_t left[WMAX] = {0};
  for (uint32_t w = 0; w < W; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  for (size_t i = 0; i < nev; i++) left[ev[i].w]++;
  bool staged = false;
  uint32_t committed = 0;
  char why[FPS_WHY_MAX];
  for (size_t i = 0; i < nev; i++) {
    assert_int_equal(send_ref(p[ev[i].w], &sh, ev[i].dtype, ev[i].bytes, ev[i].lo, ev[i].hi, why), 0);
    free(ev[i].bytes); /* the test's copy: the core only has the message's */
    staged |= fps_shard_in_flight_bytes(&sh) > (uint64_t)N * 4;
    if (--left[ev[i].w] == 0) {
      committed++;
      assert_int_equal(fx_commit(p[ev[i].w], why), committed < W ? FPS_EAGAIN : 0);
    }
  }
  assert_int_equal(live_msgs, 0); /* everything summed: every message freed */
  for (uint32_t w = 0; w < W; w++) {
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_destroy(p[w]);
  }
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
  return staged;
}

static void by_reference_is_bit_identical(void **unused) {
  (void)unused;
  int variants = 0;
  for (const char *const *name = fps_kernels_all_names; *name; name++) {
    const fps_kernels_t *k;
    char why[256];
    if (fps_kernels_by_name(*name, &k, why, sizeof why) < 0) continue;
    variants++;
    int staged = 0;
    for (uint32_t seed = 1; seed <= 24; seed++) staged += random_round(k, 1 + seed % WMAX, seed);
    assert_true(staged > 5);
  }
  assert_true(variants >= 2);
}

/* A staged message counts its bytes once, whatever number of pieces
 * reference it; bf16 half of fp32; summing releases it; the limit holds. */
static void held_messages_are_counted_once(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N], got[N];
  fx_fill(init, N, 5);
  fx_fill(g[0], N, 6);
  fx_fill(g[1], N, 7);
  const fps_kernels_t *k = fps_kernels_best();
  const uint64_t acc = (uint64_t)N * 4;
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  fx_done_t d[2];
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]), *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  /* One message of worker 1 with two slices of it, as bf16. */
  static uint8_t wire[N * 2];
  assert_int_equal(fps_dtype_encode(FPS_DTYPE_BF16, g[1], N, wire), 0);
  assert_int_equal(fps_dtype_decode(FPS_DTYPE_BF16, wire, N, g[1], NULL), 0);
  msg_t *m = msg_new(wire, sizeof wire);
  char why[FPS_WHY_MAX];
  fps_slice_t a = {.dtype = FPS_DTYPE_BF16, .shape = t->shape.dim, .n_shape = 2, .offset = 0, .data = m->bytes,
                   .len = 400 * 2, .owner = &m->owner};
  fps_slice_t b = a;
  b.offset = 400;
  b.data = m->bytes + 800;
  b.len = (N - 400) * 2;
  assert_int_equal(fps_push_slice(p1, "w", &a, why, sizeof why), 0);
  assert_int_equal(fps_push_slice(p1, "w", &b, why, sizeof why), 0);
  msg_unref(m);
  assert_int_equal(live_msgs, 1); /* held by the staged pieces */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc + N * 2);
  send_f32(p0, &sh, g[0], 0, 300); /* worker 1's pieces are not ready yet */
  assert_int_equal(live_msgs, 1);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc + N * 2);
  send_f32(p0, &sh, g[0], 300, N);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc);
  assert_int_equal(fx_commit(p1, NULL), FPS_EAGAIN);
  assert_int_equal(fx_commit(p0, NULL), 0);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  fx_replay(k, DIMS, 2, init, &g[0][0], 2, want);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);

  /* Room for the sum and 1000 bytes: a 400-float message fits, a second
   * one does not (FPS_ELIMIT, nothing kept). */
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, acc + 2000);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  send_f32(p1, &sh, g[1], 0, 400);
  assert_int_equal(send_ref(p1, &sh, FPS_DTYPE_F32, (const uint8_t *)(g[1] + 400), 400, 800, why), FPS_ELIMIT);
  assert_non_null(strstr(why, "1600 gradient bytes of worker 1"));
  assert_non_null(strstr(why, "--max-staging-bytes"));
  assert_int_equal(live_msgs, 1);
  fps_push_destroy(p1); /* drops the staged piece */
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* A bad value in a staged piece is found when it is summed. */
static void bad_value_in_a_staged_piece(void **unused) {
  (void)unused;
  static float init[N], g[3][N], bad[N], got[N];
  fx_fill(init, N, 20);
  for (int w = 0; w < 3; w++) fx_fill(g[w], N, 21 + w);
  memcpy(bad, g[2], sizeof bad);
  uint32_t nan = 0x7fc00001u;
  memcpy(&bad[701], &nan, 4);
  const fps_kernels_t *k = fps_kernels_best();
  char why[FPS_WHY_MAX];
  fx_done_t d[3];
  fps_push_t *p[3];

  /* Worker 2 waits in its round with the bad piece staged: when worker 0
   * makes it ready, worker 2 fails at once with INVALID_ARGUMENT naming
   * element 701, the others with UNAVAILABLE; nothing is applied. */
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_f32(p[2], &sh, bad, 0, N); /* accepted: checked when summed */
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  send_f32(p[1], &sh, g[1], 0, N);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  assert_int_equal(live_msgs, 2);
  send_f32(p[0], &sh, g[0], 0, N);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(d[2].calls, 1);
  assert_int_equal(d[2].err, FPS_EINVAL);
  assert_non_null(strstr(d[2].why, "tensor 'w': gradient element 701 is NaN"));
  assert_int_equal(d[1].calls, 1);
  assert_int_equal(d[1].err, FPS_EUNAVAILABLE);
  assert_non_null(strstr(d[1].why, "worker 2's gradient held an invalid value"));
  assert_int_equal(fx_commit(p[0], why), FPS_EUNAVAILABLE); /* its sum is gone */
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, init, sizeof got);
  assert_null(t->red);
  assert_false(t->round.open);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* Worker 2 still streaming: its next slice fails with the message, and
   * its leaving (part of it summed) aborts the round. */
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_f32(p[2], &sh, bad, 0, 900);
  send_f32(p[1], &sh, g[1], 0, N);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  send_f32(p[0], &sh, g[0], 0, N);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(send_ref(p[2], &sh, FPS_DTYPE_F32, (const uint8_t *)(bad + 900), 900, N, why), FPS_EINVAL);
  assert_non_null(strstr(why, "gradient element 701 is NaN"));
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  fps_push_destroy(p[2]);
  assert_int_equal(d[0].err, FPS_EUNAVAILABLE);
  assert_int_equal(d[1].err, FPS_EUNAVAILABLE);
  for (uint32_t w = 0; w < 2; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, init, sizeof got);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* Every reference is dropped when staged pieces go without being summed:
 * a cancelled waiting push, a push whose call fails, and a shutdown. */
static void references_dropped_on_every_path(void **unused) {
  (void)unused;
  static float init[N], g[3][N];
  fx_fill(init, N, 30);
  for (int w = 0; w < 3; w++) fx_fill(g[w], N, 31 + w);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, fps_kernels_best(), 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fx_done_t d[3];
  fps_push_t *p[3];
  /* Cancel while waiting with staged pieces. */
  p[2] = fx_push_new(&sh, 2, 0, INT64_MAX, &d[2]);
  send_f32(p[2], &sh, g[2], 0, N);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  fps_push_cancel(p[2]);
  assert_int_equal(d[2].err, FPS_ECANCELLED);
  fps_push_destroy(p[2]);
  assert_int_equal(live_msgs, 0);
  /* A call that fails while streaming. */
  p[1] = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  send_f32(p[1], &sh, g[1], 0, 500);
  send_f32(p[1], &sh, g[1], 500, N);
  assert_int_equal(live_msgs, 2);
  fps_push_destroy(p[1]);
  assert_int_equal(live_msgs, 0);
  /* An aborted round: worker 0's gradient summed, worker 1 summed half
   * and staged the rest, worker 2 staged; worker 1's call dies. */
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_f32(p[2], &sh, g[2], 0, N);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  send_f32(p[0], &sh, g[0], 0, 500);
  send_f32(p[1], &sh, g[1], 0, 500);
  send_f32(p[1], &sh, g[1], 500, N);
  assert_int_equal(live_msgs, 2); /* worker 1's second, worker 2's */
  fps_push_destroy(p[1]);
  assert_int_equal(d[2].err, FPS_EUNAVAILABLE);
  fps_push_destroy(p[2]);
  fps_push_destroy(p[0]);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  /* Shutdown with a waiting push holding staged pieces. */
  p[2] = fx_push_new(&sh, 2, 0, INT64_MAX, &d[2]);
  send_f32(p[2], &sh, g[2], 0, N);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  fps_shard_fail_waiting(&sh, FPS_EUNAVAILABLE, "shutting down");
  assert_int_equal(d[2].err, FPS_EUNAVAILABLE);
  fps_push_destroy(p[2]);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(by_reference_is_bit_identical),
      cmocka_unit_test(held_messages_are_counted_once),
      cmocka_unit_test(bad_value_in_a_staged_piece),
      cmocka_unit_test(references_dropped_on_every_path),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

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
 * value, a cancel, an aborted round and a shutdown; a message with slices
 * of two tensors counts once, and a bad value in one fails the push's
 * later slices of the other; an element cut between two buffers (the
 * handler's bounce buffer) is staged as a copy, and so is a slice whose
 * message would pass the limit when the copy fits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "shard/internal.h"
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
static int send_ref_to(fps_push_t *p, fps_shard_t *sh, const char *name, int dt, const uint8_t *wire, uint64_t lo,
                       uint64_t hi, char *why) {
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  size_t len = (size_t)(hi - lo) * fps_dtype_size(dt);
  msg_t *m = msg_new(wire, len);
  fps_slice_t s = {.dtype = dt, .shape = t->shape.dim, .n_shape = t->shape.ndim, .offset = lo,
                   .data = m->bytes, .len = len, .owner = &m->owner};
  int rc = fps_push_slice(p, name, &s, why, FPS_WHY_MAX);
  msg_unref(m);
  return rc;
}

static int send_ref(fps_push_t *p, fps_shard_t *sh, int dt, const uint8_t *wire, uint64_t lo, uint64_t hi,
                    char *why) {
  return send_ref_to(p, sh, "w", dt, wire, lo, hi, why);
}

/* Tensor name's g[lo, hi) as one fp32 message. */
static void send_f32_to(fps_push_t *p, fps_shard_t *sh, const char *name, const float *g, uint64_t lo,
                        uint64_t hi) {
  char why[FPS_WHY_MAX];
  int rc = send_ref_to(p, sh, name, FPS_DTYPE_F32, (const uint8_t *)(g + lo), lo, hi, why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0);
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

/* Worker w's slices of tensors a and b in one message m (one owner): the
 * slices' sizes in elements, each from its gradient's element lo. */
static int send_two(fps_push_t *p, fps_shard_t *sh, msg_t *m, const char *na, uint64_t lo_a, size_t n_a,
                    const char *nb, uint64_t lo_b, size_t n_b, char *why) {
  fps_tensor_t *ta = fps_store_find(&sh->store, na), *tb = fps_store_find(&sh->store, nb);
  fps_slice_t a = {.dtype = FPS_DTYPE_F32, .shape = ta->shape.dim, .n_shape = ta->shape.ndim, .offset = lo_a,
                   .data = m->bytes, .len = n_a * 4, .owner = &m->owner};
  fps_slice_t b = {.dtype = FPS_DTYPE_F32, .shape = tb->shape.dim, .n_shape = tb->shape.ndim, .offset = lo_b,
                   .data = m->bytes + n_a * 4, .len = n_b * 4, .owner = &m->owner};
  int rc = fps_push_slice(p, na, &a, why, FPS_WHY_MAX);
  if (rc == 0) rc = fps_push_slice(p, nb, &b, why, FPS_WHY_MAX);
  return rc;
}

/* One message carrying slices of two tensors: it counts once while pieces
 * of both are staged, and a bad value in the staged slice of one tensor
 * fails the push for good: its next slice of the other tensor too (it
 * should not go on staging a gradient that cannot be applied), its join,
 * and, once it waits, at once with the set of both rounds. */
static void message_of_two_tensors(void **unused) {
  (void)unused;
  static float init[N], ga[2][N], gb[2][N], bad[N], got[N], msgbuf[2 * N];
  fx_fill(init, N, 40);
  for (int w = 0; w < 2; w++) {
    fx_fill(ga[w], N, 41 + w);
    fx_fill(gb[w], N, 43 + w);
  }
  memcpy(bad, ga[1], sizeof bad);
  uint32_t nan = 0x7fc00001u;
  memcpy(&bad[701], &nan, 4);
  const uint64_t acc = (uint64_t)N * 4;
  char why[FPS_WHY_MAX];
  fx_done_t d[2];
  fps_push_t *p[2];
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, fps_kernels_best(), 64u << 20);
  assert_int_equal(fx_create(&sh, "a", DIMS, 2, init), 0);
  assert_int_equal(fx_create(&sh, "b", DIMS, 2, init), 0);

  /* Still streaming: worker 1's message holds all of a (bad) and the first
   * 400 elements of b, both staged (worker 0 has sent nothing). */
  for (uint32_t w = 0; w < 2; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  memcpy(msgbuf, bad, N * 4);
  memcpy(msgbuf + N, gb[1], 400 * 4);
  msg_t *m = msg_new(msgbuf, (N + 400) * 4);
  assert_int_equal(send_two(p[1], &sh, m, "a", 0, N, "b", 0, 400, why), 0);
  msg_unref(m);
  assert_int_equal(live_msgs, 1);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 2 * acc + (N + 400) * 4); /* two sums, the message once */
  send_f32_to(p[0], &sh, "a", ga[0], 0, N); /* sums worker 1's piece of a: the NaN */
  assert_int_equal(live_msgs, 1);   /* b's piece still references it */
  assert_int_equal(d[1].calls, 0);
  /* The rest of b: refused with a's message, nothing more staged. */
  assert_int_equal(send_ref_to(p[1], &sh, "b", FPS_DTYPE_F32, (const uint8_t *)(gb[1] + 400), 400, N, why), FPS_EINVAL);
  assert_non_null(strstr(why, "tensor 'a': gradient element 701 is NaN"));
  assert_int_equal(live_msgs, 1);
  fps_push_destroy(p[1]); /* 701 elements of it were in a's sum: worker 0 loses it */
  assert_int_equal(live_msgs, 0);
  send_f32_to(p[0], &sh, "b", gb[0], 0, N);
  assert_int_equal(fx_commit(p[0], why), FPS_EUNAVAILABLE);
  fps_push_destroy(p[0]);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* Waiting: worker 1 sent a (bad) and all of b in one message and
   * committed; worker 0's a fails it at once, and the set of both rounds. */
  for (uint32_t w = 0; w < 2; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  memcpy(msgbuf + N, gb[1], N * 4);
  m = msg_new(msgbuf, 2 * N * 4);
  assert_int_equal(send_two(p[1], &sh, m, "a", 0, N, "b", 0, N, why), 0);
  msg_unref(m);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 2 * acc + 2 * N * 4);
  send_f32_to(p[0], &sh, "a", ga[0], 0, N);
  assert_int_equal(d[1].calls, 1);
  assert_int_equal(d[1].err, FPS_EINVAL);
  assert_non_null(strstr(d[1].why, "tensor 'a': gradient element 701 is NaN"));
  assert_int_equal(send_ref_to(p[0], &sh, "b", FPS_DTYPE_F32, (const uint8_t *)gb[0], 0, N, why), 0);
  assert_int_equal(fx_commit(p[0], why), FPS_EUNAVAILABLE);
  for (uint32_t w = 0; w < 2; w++) fps_push_destroy(p[w]);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_int_equal(fx_params(&sh, "a", got), 0);
  assert_memory_equal(got, init, sizeof got);
  assert_int_equal(fx_params(&sh, "b", got), 0);
  assert_memory_equal(got, init, sizeof got);

  /* And the round goes on: a clean retry of both applies. */
  static float want_a[N], want_b[N];
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &ga[0][0], 2, want_a);
  fx_replay(k, DIMS, 2, init, &gb[0][0], 2, want_b);
  for (uint32_t w = 0; w < 2; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  memcpy(msgbuf, ga[1], N * 4);
  m = msg_new(msgbuf, 2 * N * 4);
  assert_int_equal(send_two(p[1], &sh, m, "a", 0, N, "b", 0, N, why), 0);
  msg_unref(m);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  send_f32_to(p[0], &sh, "a", ga[0], 0, N);
  send_f32_to(p[0], &sh, "b", gb[0], 0, N);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fx_commit(p[0], why), 0);
  assert_int_equal(d[1].err, 0);
  for (uint32_t w = 0; w < 2; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "a", got), 1);
  assert_memory_equal(got, want_a, sizeof got);
  assert_int_equal(fx_params(&sh, "b", got), 1);
  assert_memory_equal(got, want_b, sizeof got);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* A slice in pieces (s->src) whose middle element was cut between two
 * received buffers and copied into the handler's bounce buffer: that
 * piece is not the message's, so it is staged as a copy (the handler
 * reuses the bounce buffer at once), the others by reference. */
typedef struct pieces_s {
  const uint8_t *at[3];
  uint64_t n[3];
  int i;
} pieces_t;

static uint64_t pieces_next(void *ctx, const uint8_t **data) {
  pieces_t *ps = ctx;
  if (ps->i == 3) return 0;
  *data = ps->at[ps->i];
  return ps->n[ps->i++];
}

static void element_cut_between_buffers(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N], got[N];
  fx_fill(init, N, 50);
  fx_fill(g[0], N, 51);
  fx_fill(g[1], N, 52);
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &g[0][0], 2, want);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  fx_done_t d[2];
  fps_push_t *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]), *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]);
  /* The message holds elements [0, 500) and [501, N); element 500 came
   * through the bounce buffer. */
  static float msgbuf[N - 1];
  memcpy(msgbuf, g[1], 500 * 4);
  memcpy(msgbuf + 500, g[1] + 501, (N - 501) * 4);
  msg_t *m = msg_new(msgbuf, sizeof msgbuf);
  uint8_t *bounce = malloc(8);
  assert_non_null(bounce);
  memcpy(bounce, &g[1][500], 4);
  pieces_t ps = {{m->bytes, bounce, m->bytes + 500 * 4}, {500, 1, N - 501}, 0};
  fps_slice_src_t src = {pieces_next, &ps, bounce};
  fps_slice_t s = {.dtype = FPS_DTYPE_F32, .shape = t->shape.dim, .n_shape = 2, .offset = 0, .len = N * 4,
                   .src = &src, .owner = &m->owner};
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_push_slice(p1, "w", &s, why, sizeof why), 0);
  msg_unref(m);
  memset(bounce, 0xff, 8); /* reused for the next message: a NaN now */
  free(bounce);
  assert_int_equal(live_msgs, 1);
  /* Staged: the sum, the message once, and one converted element. */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), (uint64_t)N * 4 + sizeof msgbuf + 4);
  assert_int_equal(fx_commit(p1, NULL), FPS_EAGAIN);
  send_f32(p0, &sh, g[0], 0, N);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fx_commit(p0, why), 0);
  assert_int_equal(d[1].err, 0);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* A reference that would pass --max-staging-bytes while a converted copy
 * of the slice fits is staged as the copy: a message whose other slice
 * was summed on arrival does not make a small early slice refused. */
static void copy_when_the_message_does_not_fit(void **unused) {
  (void)unused;
  static const uint64_t BD[] = {4, 4};
  static float init[N], ga[2][N], gb[2][16], want_a[N], want_b[16], got[N], msgbuf[N + 16];
  fx_fill(init, N, 60);
  for (int w = 0; w < 2; w++) {
    fx_fill(ga[w], N, 61 + w);
    fx_fill(gb[w], 16, 63 + w);
  }
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &ga[0][0], 2, want_a);
  fx_replay(k, BD, 2, init, &gb[0][0], 2, want_b);
  const uint64_t sums = (uint64_t)N * 4 + 16 * 4;
  fps_shard_t sh;
  /* Room for both sums and 1000 bytes: not for the message (N + 16
   * floats), but for a copy of b's 16 elements. */
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, sums + 1000);
  assert_int_equal(fx_create(&sh, "a", DIMS, 2, init), 0);
  assert_int_equal(fx_create(&sh, "b", BD, 2, init), 0);
  fx_done_t d[2];
  fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]), *p1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  send_f32_to(p0, &sh, "a", ga[0], 0, N);
  memcpy(msgbuf, ga[1], N * 4);
  memcpy(msgbuf + N, gb[1], 16 * 4);
  msg_t *m = msg_new(msgbuf, sizeof msgbuf);
  char why[FPS_WHY_MAX];
  int rc = send_two(p1, &sh, m, "a", 0, N, "b", 0, 16, why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0); /* a summed on arrival, b staged as a copy */
  msg_unref(m);
  assert_int_equal(live_msgs, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), sums + 16 * 4);
  assert_int_equal(fx_commit(p1, NULL), FPS_EAGAIN);
  fps_tensor_t *tb = fps_store_find(&sh.store, "b");
  fps_slice_t s = {.dtype = FPS_DTYPE_F32, .shape = tb->shape.dim, .n_shape = 2, .offset = 0,
                   .data = (const uint8_t *)gb[0], .len = 16 * 4};
  assert_int_equal(fps_push_slice(p0, "b", &s, why, sizeof why), 0);
  assert_int_equal(fx_commit(p0, why), 0);
  assert_int_equal(d[1].err, 0);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  assert_int_equal(fx_params(&sh, "a", got), 1);
  assert_memory_equal(got, want_a, sizeof want_a);
  assert_int_equal(fx_params(&sh, "b", got), 1);
  assert_memory_equal(got, want_b, sizeof want_b);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(by_reference_is_bit_identical),
      cmocka_unit_test(held_messages_are_counted_once),
      cmocka_unit_test(bad_value_in_a_staged_piece),
      cmocka_unit_test(references_dropped_on_every_path),
      cmocka_unit_test(message_of_two_tensors),
      cmocka_unit_test(element_cut_between_buffers),
      cmocka_unit_test(copy_when_the_message_does_not_fit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

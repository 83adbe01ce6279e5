/* The sync round's running sum (server/shard/reduce.c), driven directly:
 * slices of every worker arriving interleaved in random order and sizes,
 * fp32 and bf16 mixed, some in one piece and some in runs of a few
 * elements (a message received in several buffers), give the bits of a local replay that sums whole
 * gradients in worker-id order, for every SIMD variant this machine runs;
 * what arrives ahead of the workers below is staged, within
 * max_staging_bytes, and drained as they catch up; a push whose gradient is
 * partly in the sum aborts the round when its call fails (the others get
 * FPS_EUNAVAILABLE naming it, nothing is applied), one with only staged
 * pieces just leaves; a second push of a worker waits for the place; a
 * retry of an applied push never reaches the next round's sum. */
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
#include "pool.h"
#include "simd/kernels.h"

static const uint64_t DIMS[] = {37, 29}; /* factored, odd sizes */
#define N (37 * 29)
#define WMAX 5

/* The data of a slice in runs of 1..cap whole elements, as the handler
 * hands over a message received in several buffers (fps_slice_src_t). */
typedef struct runs_s {
  const uint8_t *data;
  uint64_t left, cap;
  size_t esz;
  uint32_t seed;
} runs_t;

static uint64_t runs_next(void *ctx, const uint8_t **data) {
  runs_t *r = ctx;
  if (!r->left) return 0;
  r->seed = r->seed * 1103515245u + 12345u;
  uint64_t k = 1 + (r->seed >> 8) % r->cap;
  if (k > r->left) k = r->left;
  *data = r->data;
  r->data += k * r->esz;
  r->left -= k;
  return k;
}

static int send_runs(fps_push_t *p, fps_shard_t *sh, const fx_ev_t *ev, uint64_t cap, char *why) {
  fps_tensor_t *t = fps_store_find(&sh->store, "w");
  size_t esz = fps_dtype_size(ev->dtype);
  runs_t r = {.data = ev->bytes, .left = ev->hi - ev->lo, .cap = cap, .esz = esz, .seed = (uint32_t)ev->lo + 1};
  fps_slice_src_t src = {.next = runs_next, .ctx = &r};
  fps_slice_t s = {.dtype = ev->dtype, .shape = t->shape.dim, .n_shape = t->shape.ndim, .offset = ev->lo,
                   .len = (ev->hi - ev->lo) * esz, .src = cap ? &src : NULL, .data = cap ? NULL : ev->bytes};
  return fps_push_slice(p, "w", &s, why, FPS_WHY_MAX);
}

static int send(fps_push_t *p, fps_shard_t *sh, const fx_ev_t *ev, char *why) { return send_runs(p, sh, ev, 0, why); }

static void send_ok(fps_push_t *p, fps_shard_t *sh, const float *g, uint64_t lo, uint64_t hi) {
  fx_ev_t ev = {.lo = lo, .hi = hi, .dtype = FPS_DTYPE_F32, .bytes = (uint8_t *)(uintptr_t)(g + lo)};
  char why[FPS_WHY_MAX];
  int rc = send(p, sh, &ev, why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0);
}

/* Random slices of every worker, interleaved in a random order, of random
 * sizes and dtypes; the commits come in a random order too (each after its
 * worker's last slice). Returns whether anything had to be staged. */
static bool one_random_round(const fps_kernels_t *k, uint32_t W, uint32_t seed) {
  static float init[N], g[WMAX][N], want[N], got[N];
  static fx_ev_t ev[WMAX * 64];
  uint32_t s = seed * 2654435761u + 7;
  fx_fill(init, N, seed);
  size_t nev = 0;
  for (uint32_t w = 0; w < W; w++) {
    fx_fill(g[w], N, seed * 31 + w + 1);
    /* Cut into 1..40 pieces at random points. */
    fx_random_slices(&s, w, g[w], N, 40, ev, &nev);
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
  uint32_t committed = 0, last = 0;
  char why[FPS_WHY_MAX];
  for (size_t i = 0; i < nev; i++) {
    /* A third of the slices come in runs of 1..64 elements (a message in
     * several buffers), the others in one piece. */
    uint64_t cap = fx_rnd(&s) % 3 == 0 ? 64 : 0;
    assert_int_equal(send_runs(p[ev[i].w], &sh, &ev[i], cap, why), 0);
    staged |= fps_shard_in_flight_bytes(&sh) > (uint64_t)N * 4;
    if (--left[ev[i].w] == 0) {
      int rc = fx_commit(p[ev[i].w], why);
      committed++;
      assert_int_equal(rc, committed < W ? FPS_EAGAIN : 0);
      last = ev[i].w;
    }
  }
  assert_int_equal(committed, W);
  for (uint32_t w = 0; w < W; w++) {
    assert_int_equal(d[w].calls, w == last ? 0 : 1);
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_out_t o;
    fps_push_take(p[w], 0, &o);
    assert_int_equal(o.version, 1);
    assert_memory_equal(o.snap->data, want, sizeof want);
    fps_snap_unref(o.snap);
    fps_push_destroy(p[w]);
  }
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  assert_null(fps_store_find(&sh.store, "w")->red);
  fx_shard_free(&sh);
  for (size_t i = 0; i < nev; i++) free(ev[i].bytes);
  return staged;
}

static void sum_is_bit_identical_for_every_variant(void **unused) {
  (void)unused;
  int variants = 0;
  for (const char *const *name = fps_kernels_all_names; *name; name++) {
    const fps_kernels_t *k;
    char why[256];
    if (fps_kernels_by_name(*name, &k, why, sizeof why) < 0) continue; /* not on this CPU */
    variants++;
    int staged = 0;
    for (uint32_t seed = 1; seed <= 48; seed++) staged += one_random_round(k, 1 + seed % WMAX, seed);
    /* The random orders did exercise the staging path. */
    assert_true(staged > 10);
  }
  assert_true(variants >= 2); /* scalar and the machine's own */
}

/* Ahead pieces are staged and drained as worker 0 catches up; workers in
 * step stage nothing; the limit holds. */
static void early_pieces_are_staged_and_drained(void **unused) {
  (void)unused;
  static float init[N], g[3][N], want[N], got[N];
  fx_fill(init, N, 90);
  for (int w = 0; w < 3; w++) fx_fill(g[w], N, 91 + w);
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &g[0][0], 3, want);
  const uint64_t acc = (uint64_t)N * 4;
  /* In step: worker 0, 1, 2 piece by piece: only the accumulator. */
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_push_t *p[3];
  fx_done_t d[3];
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  for (uint64_t lo = 0; lo < N; lo += 100)
    for (uint32_t w = 0; w < 3; w++) {
      send_ok(p[w], &sh, g[w], lo, lo + 100 < N ? lo + 100 : N);
      assert_int_equal(fps_shard_in_flight_bytes(&sh), acc);
    }
  for (uint32_t w = 0; w < 3; w++) assert_int_equal(fx_commit(p[w], NULL), w < 2 ? FPS_EAGAIN : 0);
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  fx_shard_free(&sh);

  /* Backwards: worker 2 whole, then 1, then 0 in two halves. */
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_ok(p[2], &sh, g[2], 0, N);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc + acc);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN); /* joins with its gradient staged */
  send_ok(p[1], &sh, g[1], 0, 500);
  send_ok(p[1], &sh, g[1], 500, N);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc * 3);
  send_ok(p[0], &sh, g[0], 0, 500);
  /* Worker 1's first piece is summed; worker 2's whole piece still waits. */
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc * 3 - 500 * 4);
  send_ok(p[0], &sh, g[0], 500, N);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc); /* everything cascaded */
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  assert_int_equal(fx_commit(p[0], NULL), 0);
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof want);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);

  /* Room for the sum and a few pieces: staging more is FPS_ELIMIT. */
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, k, acc + 400 * 4);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_ok(p[1], &sh, g[1], 0, 300);
  fx_ev_t ev = {.lo = 300, .hi = 600, .dtype = FPS_DTYPE_F32, .bytes = (uint8_t *)(g[1] + 300)};
  char why[FPS_WHY_MAX];
  assert_int_equal(send(p[1], &sh, &ev, why), FPS_ELIMIT);
  assert_non_null(strstr(why, "arrived before the workers below it"));
  assert_non_null(strstr(why, "--max-staging-bytes"));
  /* Worker 0 is not held up by it: its slices go straight into the sum. */
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), acc);
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* A failed call whose gradient is in the sum aborts the round; one with
 * only staged pieces leaves it; the retries then complete it exactly. */
static void failed_member_aborts_the_round(void **unused) {
  (void)unused;
  static float init[N], g[3][N], want[N], got[N];
  fx_fill(init, N, 100);
  for (int w = 0; w < 3; w++) fx_fill(g[w], N, 101 + w);
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &g[0][0], 3, want);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 3, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  char why[FPS_WHY_MAX];
  fps_push_t *p[3], *x;
  fx_done_t d[3], dx;
  /* Workers 0 and 2 joined; worker 1 has summed half and its call dies. */
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  send_ok(p[2], &sh, g[2], 0, N);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  send_ok(p[1], &sh, g[1], 0, N / 2);
  fps_push_destroy(p[1]);
  for (uint32_t w = 0; w < 3; w += 2) {
    assert_int_equal(d[w].calls, 1);
    assert_int_equal(d[w].err, FPS_EUNAVAILABLE);
    assert_non_null(strstr(d[w].why, "'w' step 0"));
    assert_non_null(strstr(d[w].why, "worker 1's call failed"));
    assert_non_null(strstr(d[w].why, "nothing was applied"));
    fps_push_destroy(p[w]);
  }
  assert_int_equal(fx_params(&sh, "w", got), 0);
  assert_memory_equal(got, init, sizeof got);
  assert_null(t->red);
  assert_false(t->round.open);
  assert_null(sh.rounds);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* A member cancelled while waiting, with its gradient summed: the same.
   * A push still streaming into that sum fails at its next slice. */
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  send_ok(p[1], &sh, g[1], 0, N);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  send_ok(p[2], &sh, g[2], 0, 10);
  fps_push_cancel(p[1]);
  assert_int_equal(d[1].calls, 1);
  assert_int_equal(d[1].err, FPS_ECANCELLED);
  assert_int_equal(d[0].calls, 1);
  assert_int_equal(d[0].err, FPS_EUNAVAILABLE);
  assert_non_null(strstr(d[0].why, "worker 1's call failed"));
  fx_ev_t ev = {.lo = 10, .hi = N, .dtype = FPS_DTYPE_F32, .bytes = (uint8_t *)(g[2] + 10)};
  assert_int_equal(send(p[2], &sh, &ev, why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "worker 1's call failed"));
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  assert_null(t->red);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* Worker 1 with only staged pieces (worker 0 has sent nothing) leaves:
   * nobody fails, its retry takes its place. */
  for (uint32_t w = 0; w < 3; w++) p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
  send_ok(p[2], &sh, g[2], 0, N);
  assert_int_equal(fx_commit(p[2], NULL), FPS_EAGAIN);
  send_ok(p[1], &sh, g[0], 0, N); /* the wrong values: never summed */
  fps_push_destroy(p[1]);
  assert_int_equal(d[2].calls, 0);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), (uint64_t)N * 8); /* the sum and worker 2's piece */
  p[1] = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  send_ok(p[1], &sh, g[1], 0, N);
  assert_int_equal(fx_commit(p[1], NULL), FPS_EAGAIN);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), 0);
  for (uint32_t w = 0; w < 3; w++) {
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_destroy(p[w]);
  }
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* A bad value after part of a slice was summed fails the push, and its
   * leaving aborts the round. */
  p[0] = fx_push_new(&sh, 0, 1, INT64_MAX, &d[0]);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  x = fx_push_new(&sh, 1, 1, INT64_MAX, &dx);
  send_ok(x, &sh, g[1], 0, 500);
  static float bad[N];
  memcpy(bad, g[1], sizeof bad);
  bad[N - 3] = 1e30f; /* > 2^63 */
  ev = (fx_ev_t){.lo = 500, .hi = N, .dtype = FPS_DTYPE_F32, .bytes = (uint8_t *)(bad + 500)};
  assert_int_equal(send(x, &sh, &ev, why), FPS_EINVAL);
  assert_non_null(strstr(why, "gradient element 1070 is 1e+30"));
  fps_push_destroy(x);
  assert_int_equal(d[0].calls, 1);
  assert_int_equal(d[0].err, FPS_EUNAVAILABLE);
  fps_push_destroy(p[0]);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* Worker 1's slice [lo, N) in dtype dt with the fp32 bits badf (their top
 * half in bf16) at absolute element `at`; the caller frees it. */
static uint8_t *wire_with_bad(int dt, const float *g, uint64_t lo, uint64_t at, uint32_t badf) {
  size_t esz = fps_dtype_size(dt);
  uint8_t *b = malloc((N - lo) * esz);
  assert_non_null(b);
  assert_int_equal(fps_dtype_encode(dt, g + lo, N - lo, b), 0);
  if (dt == FPS_DTYPE_BF16) {
    uint16_t h = (uint16_t)(badf >> 16);
    memcpy(b + (at - lo) * 2, &h, 2);
  } else {
    memcpy(b + (at - lo) * 4, &badf, 4);
  }
  return b;
}

/* A bad value inside a slice, at a position no vector width divides, for
 * every variant and both dtypes, the slice in one piece and in runs: the
 * push fails naming the element and its value; exactly the elements before
 * it are in the sum and recorded as summed, the rest of the sum is
 * untouched, and its leaving aborts the round. A bad value at the first
 * element of the worker's first summed slice sums nothing: that push just
 * leaves, and a retry completes the round bit-identical to the replay. */
static void bad_value_inside_a_slice(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N], got[N];
  fx_fill(init, N, 120);
  for (const char *const *name = fps_kernels_all_names; *name; name++) {
    const fps_kernels_t *k;
    char why[FPS_WHY_MAX];
    if (fps_kernels_by_name(*name, &k, why, sizeof why) < 0) continue; /* not on this CPU */
    for (int dt = FPS_DTYPE_F32; dt <= FPS_DTYPE_BF16; dt++) {
      fx_fill(g[0], N, 121);
      fx_fill(g[1], N, 122);
      /* what the shard sees of worker 1's gradient */
      uint8_t *enc = malloc(N * fps_dtype_size(dt));
      assert_non_null(enc);
      assert_int_equal(fps_dtype_encode(dt, g[1], N, enc), 0);
      assert_int_equal(fps_dtype_decode(dt, enc, N, g[1], NULL), 0);
      fx_replay(k, DIMS, 2, init, &g[0][0], 2, want);
      fps_shard_t sh;
      fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, 64u << 20);
      assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
      fps_tensor_t *t = fps_store_find(&sh.store, "w");
      fx_done_t d0, dx;
      fps_push_t *p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
      send_ok(p0, &sh, g[0], 0, N);
      assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
      fps_push_t *x = fx_push_new(&sh, 1, 0, INT64_MAX, &dx);
      fx_ev_t ev = {.lo = 0, .hi = 3, .dtype = dt, .bytes = enc};
      assert_int_equal(send(x, &sh, &ev, why), 0);
      const uint64_t at = 3 + 37; /* element 37 of the slice [3, N) */
      uint8_t *bad = wire_with_bad(dt, g[1], 3, at, 0x7fc00000u); /* a NaN */
      ev = (fx_ev_t){.lo = 3, .hi = N, .dtype = dt, .bytes = bad};
      assert_int_equal(send_runs(x, &sh, &ev, dt == FPS_DTYPE_BF16 ? 7 : 0, why), FPS_EINVAL);
      assert_non_null(strstr(why, "gradient element 40 is NaN"));
      assert_non_null(t->red);
      assert_int_equal(t->red->done[1].covered, at);
      for (uint64_t i = 0; i < N; i++) {
        float sum = i < at ? g[0][i] + g[1][i] : g[0][i];
        if (memcmp(&sum, &t->red->acc[i], 4)) {
          print_error("%s %s: sum element %llu differs\n", *name, fps_dtype_name(dt),
                      (unsigned long long)i);
          fail();
        }
      }
      fps_push_destroy(x); /* part of it is summed: the round is aborted */
      assert_int_equal(d0.calls, 1);
      assert_int_equal(d0.err, FPS_EUNAVAILABLE);
      assert_non_null(strstr(d0.why, "worker 1's call failed"));
      fps_push_destroy(p0);
      assert_null(t->red);
      assert_int_equal(fx_params(&sh, "w", got), 0);
      assert_memory_equal(got, init, sizeof got);
      free(bad);

      /* The first element bad (an Inf): nothing summed, nobody fails. */
      p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
      send_ok(p0, &sh, g[0], 0, N);
      assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
      x = fx_push_new(&sh, 1, 0, INT64_MAX, &dx);
      bad = wire_with_bad(dt, g[1], 100, 100, 0xff800000u);
      ev = (fx_ev_t){.lo = 100, .hi = N, .dtype = dt, .bytes = bad};
      assert_int_equal(send(x, &sh, &ev, why), FPS_EINVAL);
      assert_non_null(strstr(why, "gradient element 100 is Inf"));
      assert_int_equal(t->red->done[1].covered, 0);
      fps_push_destroy(x);
      assert_int_equal(d0.calls, 0);
      x = fx_push_new(&sh, 1, 0, INT64_MAX, &dx);
      ev = (fx_ev_t){.lo = 0, .hi = N, .dtype = dt, .bytes = enc};
      assert_int_equal(send(x, &sh, &ev, why), 0);
      assert_int_equal(fx_commit(x, why), 0);
      assert_int_equal(d0.calls, 1);
      assert_int_equal(d0.err, 0);
      fps_push_destroy(x);
      fps_push_destroy(p0);
      assert_int_equal(fx_params(&sh, "w", got), 1);
      assert_memory_equal(got, want, sizeof got);
      assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
      fx_shard_free(&sh);
      free(bad);
      free(enc);
    }
  }
}

/* A second push of a worker stages privately while the first holds the
 * place; it is refused while the first streams, takes the place when the
 * first leaves with nothing summed, and is a duplicate once the first has
 * joined. A round that times out discards the sum: a push still streaming
 * into it fails at its next slice. */
static void second_push_of_a_worker_and_deadline(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N], got[N];
  fx_fill(init, N, 110);
  fx_fill(g[0], N, 111);
  fx_fill(g[1], N, 112);
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &g[0][0], 2, want);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  char why[FPS_WHY_MAX];
  fps_push_t *a, *b, *p0;
  fx_done_t da, db, d0;
  a = fx_push_new(&sh, 1, 0, INT64_MAX, &da);
  send_ok(a, &sh, g[1], 0, 100); /* staged: worker 0 has nothing yet */
  b = fx_push_new(&sh, 1, 0, INT64_MAX, &db);
  send_ok(b, &sh, g[1], 0, N);
  assert_int_equal(fx_commit(b, why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "another PushPull of worker 1"));
  fps_push_destroy(b);
  b = fx_push_new(&sh, 1, 0, INT64_MAX, &db);
  send_ok(b, &sh, g[1], 0, N);
  fps_push_destroy(a); /* nothing summed: b may take the place */
  assert_int_equal(fx_commit(b, NULL), FPS_EAGAIN);
  a = fx_push_new(&sh, 1, 0, INT64_MAX, &da);
  send_ok(a, &sh, g[1], 0, N);
  assert_int_equal(fx_commit(a, why), FPS_EDUP);
  assert_non_null(strstr(why, "duplicate push: worker 1"));
  fps_push_destroy(a);
  p0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d0);
  send_ok(p0, &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p0, NULL), 0);
  assert_int_equal(db.calls, 1);
  assert_int_equal(db.err, 0);
  fps_push_destroy(p0);
  fps_push_destroy(b);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);

  /* Step 1: worker 1 joins, worker 0 is still streaming when the round
   * times out. Once the failed member's call is gone, its part of the sum
   * is too: worker 0's push fails at its next slice. */
  b = fx_push_new(&sh, 1, 1, INT64_MAX, &db);
  send_ok(b, &sh, g[1], 0, 100);
  send_ok(b, &sh, g[1], 100, N);
  assert_int_equal(fx_commit(b, NULL), FPS_EAGAIN);
  p0 = fx_push_new(&sh, 0, 1, INT64_MAX, &d0);
  send_ok(p0, &sh, g[0], 0, 200); /* sums worker 1's [0, 100) too */
  fps_fake_clock_advance((int64_t)(FX_DEADLINE_S * 1e9));
  fps_shard_expire(&sh, fps_now_ns());
  assert_int_equal(db.calls, 1);
  assert_int_equal(db.err, FPS_ETIMEOUT);
  fps_push_destroy(b);
  fx_ev_t ev = {.lo = 200, .hi = N, .dtype = FPS_DTYPE_F32, .bytes = (uint8_t *)(g[0] + 200)};
  assert_int_equal(send(p0, &sh, &ev, why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "worker 1's call failed"));
  fps_push_destroy(p0);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);
  assert_null(fps_store_find(&sh.store, "w")->red);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* no_grad members sum nothing; a retry of an applied push is answered
 * from the window and never reaches the next round's sum. */
static void no_grad_and_retries(void **unused) {
  (void)unused;
  static float init[N], g[2][N], want[N], got[N];
  fx_fill(init, N, 120);
  fx_fill(g[0], N, 121);
  fx_fill(g[1], N, 122);
  const fps_kernels_t *k = fps_kernels_best();
  fx_replay(k, DIMS, 2, init, &g[0][0], 2, want);
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, k, 64u << 20);
  assert_int_equal(fx_create(&sh, "w", DIMS, 2, init), 0);
  fps_tensor_t *t = fps_store_find(&sh.store, "w");
  char why[FPS_WHY_MAX];
  fps_push_t *p[2];
  fx_done_t d[2];
  fps_push_tensor_t ng = {.name = "w", .no_grad = true};
  for (uint32_t w = 0; w < 2; w++) {
    p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
    assert_int_equal(fps_push_tensor(p[w], &ng, why, sizeof why), 0);
    assert_int_equal(fx_commit(p[w], NULL), w == 0 ? FPS_EAGAIN : 0);
    assert_null(t->red);
  }
  for (uint32_t w = 0; w < 2; w++) {
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_out_t o;
    fps_push_take(p[w], 0, &o);
    assert_int_equal(o.version, 0);
    assert_memory_equal(o.snap->data, init, sizeof init);
    fps_snap_unref(o.snap);
    fps_push_destroy(p[w]);
  }
  /* Mixed: refused at completion, the sum discarded. */
  p[0] = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  p[1] = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  assert_int_equal(fps_push_tensor(p[1], &ng, why, sizeof why), 0);
  assert_int_equal(fx_commit(p[1], NULL), 0);
  assert_int_equal(d[0].err, FPS_ESTATE);
  assert_non_null(strstr(d[0].why, "disagree about its gradient"));
  for (uint32_t w = 0; w < 2; w++) fps_push_destroy(p[w]);
  assert_null(t->red);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* Mixed, but the no_grad worker skips the step (AMP found an Inf):
   * every member is answered OK at the unchanged version, nothing
   * applied, the other's gradient dropped. skip_step needs no_grad. */
  fps_push_tensor_t bad = {.name = "w", .skip_step = true};
  p[1] = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  assert_int_equal(fps_push_tensor(p[1], &bad, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "skip_step needs no_grad"));
  fps_push_destroy(p[1]);
  fps_push_tensor_t skip = {.name = "w", .no_grad = true, .skip_step = true};
  p[0] = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]);
  send_ok(p[0], &sh, g[0], 0, N);
  assert_int_equal(fx_commit(p[0], NULL), FPS_EAGAIN);
  p[1] = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  assert_int_equal(fps_push_tensor(p[1], &skip, why, sizeof why), 0);
  assert_int_equal(fx_commit(p[1], NULL), 0);
  assert_int_equal(d[0].err, 0);
  for (uint32_t w = 0; w < 2; w++) {
    assert_int_equal(fps_push_result(p[w], why, sizeof why), 0);
    fps_push_out_t o;
    fps_push_take(p[w], 0, &o);
    assert_int_equal(o.version, 0);
    assert_memory_equal(o.snap->data, init, sizeof init);
    fps_snap_unref(o.snap);
    fps_push_destroy(p[w]);
  }
  assert_null(t->red);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);

  /* Step 0 with push ids; then worker 0 retries its applied push while
   * step 1 is being summed: answered, step 1 untouched. */
  for (uint32_t w = 0; w < 2; w++) {
    p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
    assert_int_equal(fps_push_set_id(p[w], 1000 + w, why, sizeof why), 0);
    send_ok(p[w], &sh, g[w], 0, N);
    assert_int_equal(fx_commit(p[w], NULL), w == 0 ? FPS_EAGAIN : 0);
  }
  for (uint32_t w = 0; w < 2; w++) fps_push_destroy(p[w]);
  assert_int_equal(fx_params(&sh, "w", got), 1);
  assert_memory_equal(got, want, sizeof got);
  fps_push_t *s1 = fx_push_new(&sh, 1, 1, INT64_MAX, &d[1]);
  send_ok(s1, &sh, g[1], 0, N); /* staged for step 1 */
  fps_push_t *r = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]);
  assert_int_equal(fps_push_set_id(r, 1000, why, sizeof why), 0);
  send_ok(r, &sh, g[1], 0, N); /* checked, not kept */
  assert_int_equal(fx_commit(r, NULL), 0);
  assert_true(fps_push_replayed(r));
  fps_push_out_t o;
  fps_push_take(r, 0, &o);
  assert_int_equal(o.version, 1);
  assert_memory_equal(o.snap->data, want, sizeof want);
  fps_snap_unref(o.snap);
  fps_push_destroy(r);
  fps_push_destroy(s1);
  assert_null(t->red);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
}

/* Backpressure: a push with more than FPS_PUSH_HOLD_BYTES staged ahead of
 * a lower worker that is still streaming is held (fps_push_hold), and
 * resumed once when that changes: its pieces are summed, the sum is
 * discarded, it is cancelled, or the hold times out. Worker 0 is never
 * held, and nobody is held for a lower worker that is not streaming. */
static void on_resume(fps_push_t *p, void *arg) {
  (void)p;
  (*(int *)arg)++;
}

#define BIG_ROWS 2048
#define BIG_COLS 1024
#define BIG ((uint64_t)BIG_ROWS * BIG_COLS) /* 8 MiB of fp32 */

static void send_big(fps_push_t *p, fps_shard_t *sh, const float *g, uint64_t lo, uint64_t hi) {
  fps_tensor_t *t = fps_store_find(&sh->store, "big");
  fps_slice_t sl = {.dtype = FPS_DTYPE_F32, .shape = t->shape.dim, .n_shape = t->shape.ndim, .offset = lo,
                    .data = (const uint8_t *)(g + lo), .len = (hi - lo) * 4};
  char why[FPS_WHY_MAX];
  int rc = fps_push_slice(p, "big", &sl, why, sizeof why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0);
}

static void backpressure_holds_and_resumes(void **unused) {
  (void)unused;
  static const uint64_t dims[] = {BIG_ROWS, BIG_COLS};
  float *init = calloc(BIG, sizeof *init), *g = malloc(BIG * sizeof *g);
  assert_non_null(init);
  assert_non_null(g);
  fx_fill(g, BIG, 130);
  const uint64_t six = (6u << 20) / 4; /* 6 MiB of elements: above the hold */
  for (int c = 0; c < 4; c++) {
    fps_shard_t sh;
    fx_shard_with(&sh, FPS_MODE_SYNC, 3, fps_kernels_best(), 256u << 20);
    assert_int_equal(fx_create(&sh, "big", dims, 2, init), 0);
    fps_push_t *p[3];
    fx_done_t d[3];
    int resumed[3] = {0, 0, 0};
    for (uint32_t w = 0; w < 3; w++) {
      p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
      fps_push_set_resume(p[w], on_resume, &resumed[w]);
    }
    if (c == 0) {
      /* No lower worker streaming: worker 1 stages and goes on. */
      send_big(p[1], &sh, g, 0, six);
      assert_false(fps_push_hold(p[1]));
      for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
      fx_shard_free(&sh);
      continue;
    }
    send_big(p[0], &sh, g, 0, 1000);
    send_big(p[1], &sh, g, 1000, 1000 + six);
    assert_false(fps_push_hold(p[0])); /* worker 0 never */
    assert_true(fps_push_hold(p[1]));
    assert_int_equal(resumed[1], 0);
    if (c == 1) {
      /* Worker 0 covers part of the piece: still held; all of it: summed,
       * resumed once, no longer held. */
      send_big(p[0], &sh, g, 1000, 500000);
      assert_int_equal(resumed[1], 0);
      send_big(p[0], &sh, g, 500000, BIG);
      assert_int_equal(resumed[1], 1);
      assert_false(fps_push_hold(p[1]));
      assert_int_equal(fps_shard_in_flight_bytes(&sh), BIG * 4);
    } else if (c == 2) {
      /* Cancelled while held: resumed (its receive then fails). */
      fps_push_cancel(p[1]);
      assert_int_equal(resumed[1], 1);
      assert_false(fps_push_hold(p[1]));
    } else {
      /* Held no longer than the round deadline. */
      fps_fake_clock_advance((int64_t)(FX_DEADLINE_S * 1e9) - 1000);
      fps_shard_expire(&sh, fps_now_ns());
      assert_int_equal(resumed[1], 0);
      fps_fake_clock_advance(1000);
      fps_shard_expire(&sh, fps_now_ns());
      assert_int_equal(resumed[1], 1);
      /* The step timeline counts the hold and its whole length (fake
       * clock: exact); worker 0 was never held. */
      fps_push_times_t tm;
      fps__push_times(p[1], &tm);
      assert_int_equal(tm.holds, 1);
      assert_int_equal(tm.held_ns, (int64_t)(FX_DEADLINE_S * 1e9));
      assert_int_equal(tm.recv_end_ns, 0); /* still streaming */
      fps__push_times(p[0], &tm);
      assert_int_equal(tm.holds, 0);
      assert_int_equal(tm.held_ns, 0);
      /* Held again; worker 0's call goes away (its first 1000 elements
       * are in the sum): the sum is discarded, and it resumes. */
      assert_true(fps_push_hold(p[1]));
      fps_fake_clock_advance(5000);
      fps_push_destroy(p[0]);
      p[0] = NULL;
      assert_int_equal(resumed[1], 2);
      fps__push_times(p[1], &tm);
      assert_int_equal(tm.holds, 2);
      assert_int_equal(tm.held_ns, (int64_t)(FX_DEADLINE_S * 1e9) + 5000);
    }
    assert_int_equal(resumed[0], 0);
    for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
    assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
    assert_null(sh.held);
    fx_shard_free(&sh);
  }
  free(init);
  free(g);
}

static void send_to(fps_push_t *p, fps_shard_t *sh, const char *name, const float *g, uint64_t lo, uint64_t hi) {
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  fps_slice_t sl = {.dtype = FPS_DTYPE_F32, .shape = t->shape.dim, .n_shape = t->shape.ndim, .offset = lo,
                    .data = (const uint8_t *)(g + lo), .len = (hi - lo) * 4};
  char why[FPS_WHY_MAX];
  int rc = fps_push_slice(p, name, &sl, why, sizeof why);
  if (rc) fprintf(stderr, "slice: %s\n", why);
  assert_int_equal(rc, 0);
}

/* The staging high-water marks (fps_shard_staging_peaks, logged at exit
 * to check the sync memory bound): a worker's gradient cut into two calls
 * (the client's push chunks) staging 3 MiB each ahead of worker 0 counts
 * 6 MiB of slices staged ahead; the buffers' mark adds the two rounds'
 * sums; both stay when the staging is summed away. */
static void staging_peaks_count_every_call(void **unused) {
  (void)unused;
  static const uint64_t dims[] = {BIG_ROWS, BIG_COLS};
  float *init = calloc(BIG, sizeof *init), *g = malloc(BIG * sizeof *g);
  assert_non_null(init);
  assert_non_null(g);
  fx_fill(g, BIG, 131);
  const uint64_t three = (3u << 20) / 4; /* 3 MiB of elements */
  fps_shard_t sh;
  fx_shard_with(&sh, FPS_MODE_SYNC, 2, fps_kernels_best(), 256u << 20);
  assert_int_equal(fx_create(&sh, "big", dims, 2, init), 0);
  assert_int_equal(fx_create(&sh, "big2", dims, 2, init), 0);
  uint64_t buf, staged;
  fps_shard_staging_peaks(&sh, &buf, &staged);
  assert_int_equal(staged, 0);
  fx_done_t d[3];
  fps_push_t *w0 = fx_push_new(&sh, 0, 0, INT64_MAX, &d[0]);
  fps_push_t *c1 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[1]);
  fps_push_t *c2 = fx_push_new(&sh, 1, 0, INT64_MAX, &d[2]);
  send_to(w0, &sh, "big", g, 0, 10);
  send_to(w0, &sh, "big2", g, 0, 10);
  send_to(c1, &sh, "big", g, 10, 10 + three);
  send_to(c2, &sh, "big2", g, 10, 10 + three);
  fps_shard_staging_peaks(&sh, &buf, &staged);
  assert_int_equal(staged, three * 8);
  assert_int_equal(buf, fps_shard_in_flight_bytes(&sh));
  assert_int_equal(buf, three * 8 + 2 * BIG * 4);
  send_to(w0, &sh, "big", g, 10, BIG);
  send_to(w0, &sh, "big2", g, 10, BIG);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 2 * BIG * 4);
  fps_shard_staging_peaks(&sh, &buf, &staged);
  assert_int_equal(staged, three * 8);
  assert_int_equal(buf, three * 8 + 2 * BIG * 4);
  fps_push_destroy(w0);
  fps_push_destroy(c1);
  fps_push_destroy(c2);
  assert_int_equal(fps_shard_in_flight_bytes(&sh), 0);
  fx_shard_free(&sh);
  free(init);
  free(g);
}

/* A sync set's tensors of FPS_POOL_MIN_NUMEL_SYNC or more elements are
 * divided by W and stepped on the kernel pool: the parameters are the
 * replay's bits (the replay's async shard has no pool), factored and not. */
#define PA_ROWS 640
#define PA_COLS 512
#define PA ((uint64_t)PA_ROWS * PA_COLS)
#define PB (FPS_POOL_MIN_NUMEL_SYNC + 3)

static void step_with(fps_shard_t *sh, int mode, fps_pool_t *pool, const float *init_a, const float *init_b) {
  static const uint64_t da[] = {PA_ROWS, PA_COLS}, db[] = {PB};
  fps__log_level = -1;
  fps_shard_opts_t o = {.shard_id = 0, .shard_count = 1, .mode = mode, .workers = mode == FPS_MODE_SYNC ? 3 : 1,
                        .deadline = FX_DEADLINE_S, .max_tensors = 8, .max_bytes = 64u << 20,
                        .max_staging_bytes = 64u << 20, .apply_log = 8, .checkpoint_dir = ""};
  if (fps_shard_init(sh, &o, fps_kernels_best(), pool) < 0) abort();
  assert_int_equal(fx_create(sh, "a", da, 2, init_a), 0);
  assert_int_equal(fx_create(sh, "b", db, 1, init_b), 0);
}

static void sync_set_on_the_pool_matches_the_replay(void **unused) {
  (void)unused;
  assert_true(PA >= FPS_POOL_MIN_NUMEL_SYNC && PA < FPS_POOL_MIN_NUMEL);
  float *ia = malloc(PA * 4), *ib = malloc(PB * 4), *ga[3], *gb[3];
  float *sa = malloc(PA * 4), *sb = malloc(PB * 4), *got = malloc(PA * 4), *want = malloc(PA * 4);
  assert_true(ia && ib && sa && sb && got && want);
  fx_fill(ia, PA, 7);
  fx_fill(ib, PB, 8);
  for (uint32_t w = 0; w < 3; w++) {
    ga[w] = malloc(PA * 4);
    gb[w] = malloc(PB * 4);
    assert_true(ga[w] && gb[w]);
    fx_fill(ga[w], PA, 100 + w);
    fx_fill(gb[w], PB, 200 + w);
  }
  fps_pool_t *pool;
  assert_int_equal(fps_pool_create(&pool, 3), 0);
  fps_shard_t sh;
  step_with(&sh, FPS_MODE_SYNC, pool, ia, ib);
  fps_push_t *p[3];
  fx_done_t d[3];
  for (uint32_t w = 0; w < 3; w++) {
    p[w] = fx_push_new(&sh, w, 0, INT64_MAX, &d[w]);
    assert_int_equal(fx_push_grad(p[w], "a", ga[w], PA, 3, NULL), 0);
    assert_int_equal(fx_push_grad(p[w], "b", gb[w], PB, 2, NULL), 0);
    assert_int_equal(fx_commit(p[w], NULL), w < 2 ? FPS_EAGAIN : 0);
  }
  /* The replay: ((g0 + g1) + g2) / 3 in plain fp32, one async step. */
  for (uint64_t i = 0; i < PA; i++) sa[i] = ((ga[0][i] + ga[1][i]) + ga[2][i]) / 3.0f;
  for (uint64_t i = 0; i < PB; i++) sb[i] = ((gb[0][i] + gb[1][i]) + gb[2][i]) / 3.0f;
  fps_shard_t ref;
  step_with(&ref, FPS_MODE_ASYNC, NULL, ia, ib);
  fx_done_t rd;
  fps_push_t *r = fx_push_new(&ref, 0, 0, INT64_MAX, &rd);
  assert_int_equal(fx_push_grad(r, "a", sa, PA, 1, NULL), 0);
  assert_int_equal(fx_push_grad(r, "b", sb, PB, 1, NULL), 0);
  assert_int_equal(fx_commit(r, NULL), 0);
  assert_int_equal(fx_params(&sh, "a", got), 1);
  assert_int_equal(fx_params(&ref, "a", want), 1);
  assert_memory_equal(got, want, PA * 4);
  assert_int_equal(fx_params(&sh, "b", got), 1);
  assert_int_equal(fx_params(&ref, "b", want), 1);
  assert_memory_equal(got, want, PB * 4);
  fps_push_destroy(r);
  for (uint32_t w = 0; w < 3; w++) fps_push_destroy(p[w]);
  fx_shard_free(&ref);
  fx_shard_free(&sh);
  fps_pool_destroy(pool);
  for (uint32_t w = 0; w < 3; w++) {
    free(ga[w]);
    free(gb[w]);
  }
  free(ia);
  free(ib);
  free(sa);
  free(sb);
  free(got);
  free(want);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sum_is_bit_identical_for_every_variant),
      cmocka_unit_test(early_pieces_are_staged_and_drained),
      cmocka_unit_test(failed_member_aborts_the_round),
      cmocka_unit_test(bad_value_inside_a_slice),
      cmocka_unit_test(second_push_of_a_worker_and_deadline),
      cmocka_unit_test(no_grad_and_retries),
      cmocka_unit_test(backpressure_holds_and_resumes),
      cmocka_unit_test(staging_peaks_count_every_call),
      cmocka_unit_test(sync_set_on_the_pool_matches_the_replay),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

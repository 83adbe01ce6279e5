/* The standby's cut (fps_shard_images), driven directly: the keys it hands
 * over are those of the pushes its images hold, with every tensor those
 * pushes changed imaged in the same cut. A sync round's W members' keys
 * travel together with the round's result (a member whose answer is lost
 * in a failover is answered from its key on the promoted standby, not
 * refused as stale), and an async push's key never goes without the state
 * it made, even when the caller did not name that tensor. The last test
 * races cuts against sync rounds (run under TSan too). And the standby's
 * side: an image goes into the buffer the install before it retired. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"
#include "shard_fixture.h"

static const uint64_t DA[] = {4, 3}, DB[] = {5};
#define NA 12
#define NB 5

static void make_ab(fps_shard_t *sh, int mode, uint32_t workers) {
  float a[NA], b[NB];
  fx_fill(a, NA, 1);
  fx_fill(b, NB, 2);
  fx_shard(sh, mode, workers, 0);
  assert_int_equal(fx_create(sh, "a", DA, 2, a), 0);
  assert_int_equal(fx_create(sh, "b", DB, 1, b), 0);
}

/* A push of worker w at step with push_id id: gradients for a and b. */
static fps_push_t *push_ab(fps_shard_t *sh, uint32_t w, uint64_t step, uint64_t id, fx_done_t *d) {
  float ga[NA], gb[NB];
  fx_fill(ga, NA, 10 + w);
  fx_fill(gb, NB, 20 + w);
  char why[FPS_WHY_MAX];
  fps_push_t *p = fx_push_new(sh, w, step, INT64_MAX, d);
  assert_int_equal(fps_push_set_id(p, id, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(p, "a", ga, NA, 1, NULL), 0);
  assert_int_equal(fx_push_grad(p, "b", gb, NB, 1, NULL), 0);
  return p;
}

typedef struct cut_s {
  fps_image_t img[1];
  fps_image_t *extra;
  size_t nextra;
  fps_key_rec_t *keys;
} cut_t;

static void cut_take(fps_shard_t *sh, fps_tensor_t *t, cut_t *c) {
  char why[FPS_WHY_MAX];
  int rc = fps_shard_images(sh, &t, 1, c->img, &c->keys, &c->extra, &c->nextra, why, sizeof why);
  if (rc < 0) fail_msg("fps_shard_images: %s", why);
}

static void cut_free(fps_shard_t *sh, cut_t *c) {
  fps_image_release(sh, &c->img[0]);
  for (size_t i = 0; i < c->nextra; i++) fps_image_release(sh, &c->extra[i]);
  fps_free(c->extra);
  fps_key_recs_free(c->keys);
}

static size_t keys_count(const fps_key_rec_t *k) {
  size_t n = 0;
  for (; k; k = k->next) n++;
  return n;
}

static void sync_round_keys_travel_with_its_result(void **unused) {
  (void)unused;
  fps_shard_t sh;
  make_ab(&sh, FPS_MODE_SYNC, 2);
  fps_tensor_t *a = fps_store_find(&sh.store, "a"), *b = fps_store_find(&sh.store, "b");
  fps_shard_repl_keys(&sh, true);
  fx_done_t d0, d1;
  fps_push_t *p0 = push_ab(&sh, 0, 0, 100, &d0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  /* Nothing applied yet: no key, no extra image. */
  cut_t c;
  cut_take(&sh, a, &c);
  assert_int_equal(c.img[0].version, 0);
  assert_null(c.keys);
  assert_int_equal(c.nextra, 0);
  cut_free(&sh, &c);
  fps_push_t *p1 = push_ab(&sh, 1, 0, 200, &d1);
  assert_int_equal(fx_commit(p1, NULL), 0); /* completes the round */
  /* A cut naming only a (a batch picked from other marks before the
   * answers marked a and b): both members' keys, and b imaged too. */
  cut_take(&sh, a, &c);
  assert_int_equal(c.img[0].version, 1);
  assert_int_equal(keys_count(c.keys), 2);
  bool seen[2] = {false, false};
  for (const fps_key_rec_t *k = c.keys; k; k = k->next) {
    assert_true(k->worker < 2);
    assert_int_equal(k->id, k->worker == 0 ? 100 : 200);
    assert_int_equal(k->n, 2);
    assert_ptr_equal(k->t[0], a);
    assert_ptr_equal(k->t[1], b);
    assert_int_equal(k->v[0], 1);
    assert_int_equal(k->v[1], 1);
    seen[k->worker] = true;
  }
  assert_true(seen[0] && seen[1]);
  assert_int_equal(c.nextra, 1);
  assert_ptr_equal(c.extra[0].t, b);
  assert_int_equal(c.extra[0].version, 1);
  assert_non_null(c.extra[0].params);
  cut_free(&sh, &c);
  /* Handed over once. */
  cut_take(&sh, b, &c);
  assert_null(c.keys);
  assert_int_equal(c.nextra, 0);
  cut_free(&sh, &c);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  /* Off (no standby fed): nothing is recorded. */
  fps_shard_repl_keys(&sh, false);
  p0 = push_ab(&sh, 0, 1, 101, &d0);
  assert_int_equal(fx_commit(p0, NULL), FPS_EAGAIN);
  p1 = push_ab(&sh, 1, 1, 201, &d1);
  assert_int_equal(fx_commit(p1, NULL), 0);
  cut_take(&sh, a, &c);
  assert_int_equal(c.img[0].version, 2);
  assert_null(c.keys);
  cut_free(&sh, &c);
  fps_push_destroy(p0);
  fps_push_destroy(p1);
  fx_shard_free(&sh);
}

static void async_key_brings_the_tensors_it_changed(void **unused) {
  (void)unused;
  fps_shard_t sh;
  make_ab(&sh, FPS_MODE_ASYNC, 1);
  float c0[3] = {1, 2, 3};
  const uint64_t dc[] = {3};
  assert_int_equal(fx_create(&sh, "c", dc, 1, c0), 0);
  fps_tensor_t *a = fps_store_find(&sh.store, "a"), *b = fps_store_find(&sh.store, "b"),
               *ct = fps_store_find(&sh.store, "c");
  fps_shard_repl_keys(&sh, true);
  fx_done_t d;
  fps_push_t *p = push_ab(&sh, 0, 0, 7, &d);
  assert_int_equal(fx_commit(p, NULL), 0);
  fps_push_destroy(p);
  /* The batch was picked before the push's answer marked a and b. */
  cut_t c;
  cut_take(&sh, ct, &c);
  assert_int_equal(keys_count(c.keys), 1);
  assert_int_equal(c.keys->id, 7);
  assert_int_equal(c.nextra, 2);
  for (size_t i = 0; i < 2; i++) {
    assert_true(c.extra[i].t == a || c.extra[i].t == b);
    assert_int_equal(c.extra[i].version, 1);
  }
  assert_ptr_not_equal(c.extra[0].t, c.extra[1].t);
  cut_free(&sh, &c);
  fx_shard_free(&sh);
}

/* ------------------------------------------------ cuts racing rounds */

#define STEPS 200

typedef struct racer_s {
  fps_shard_t *sh;
  uint32_t w;
  atomic_int done;
} racer_t;

static void racer_done(fps_push_t *p, void *arg) {
  (void)p;
  atomic_store((atomic_int *)arg, 1);
}

/* cmocka's asserts may not fail on another thread than the test's. */
#define CHECK(ok, what)                                       \
  do {                                                        \
    if (!(ok)) {                                              \
      fprintf(stderr, "racer: %s failed: %s\n", #ok, (what)); \
      abort();                                                \
    }                                                         \
  } while (0)

static void *racer_main(void *arg) {
  racer_t *r = arg;
  float ga[NA], gb[NB];
  fx_fill(ga, NA, 30 + r->w);
  fx_fill(gb, NB, 40 + r->w);
  char why[FPS_WHY_MAX];
  for (uint64_t s = 0; s < STEPS; s++) {
    fps_push_t *p;
    atomic_int done = 0;
    CHECK(fps_push_create(r->sh, INT64_MAX, racer_done, &done, &p) == 0, "create");
    CHECK(fps_push_header(p, r->w, s, false, 0, 0, why, sizeof why) == 0, why);
    CHECK(fps_push_set_id(p, s + 1, why, sizeof why) == 0, why);
    CHECK(fx_push_grad(p, "a", ga, NA, 1, NULL) == 0, "grad a");
    CHECK(fx_push_grad(p, "b", gb, NB, 1, NULL) == 0, "grad b");
    int rc = fps_push_commit(p, why, sizeof why);
    if (rc == FPS_EAGAIN)
      while (!atomic_load(&done)) sched_yield();
    else
      CHECK(rc == 0, why);
    CHECK(fps_push_result(p, why, sizeof why) == 0, why);
    fps_push_destroy(p);
  }
  atomic_store(&r->done, 1);
  return NULL;
}

static void cuts_racing_rounds_hold_whole_rounds(void **unused) {
  (void)unused;
  fps_shard_t sh;
  make_ab(&sh, FPS_MODE_SYNC, 2);
  fps_tensor_t *ts[2] = {fps_store_find(&sh.store, "a"), fps_store_find(&sh.store, "b")};
  fps_shard_repl_keys(&sh, true);
  fx_done_t d;
  fps_push_destroy(fx_push_new(&sh, 0, 0, INT64_MAX, &d)); /* the fixture's shard, before the threads */
  racer_t r[2] = {{.sh = &sh, .w = 0}, {.sh = &sh, .w = 1}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, racer_main, &r[i]), 0);
  static uint8_t got[2][STEPS + 1];
  memset(got, 0, sizeof got);
  size_t total = 0, cuts = 0, with_extra = 0;
  for (bool last = false; !last; cuts++) {
    last = atomic_load(&r[0].done) && atomic_load(&r[1].done);
    cut_t c;
    cut_take(&sh, ts[cuts % 2], &c); /* one of the two: the other is an extra when a round is held */
    uint64_t va = c.img[0].version;
    with_extra += c.nextra > 0;
    for (const fps_key_rec_t *k = c.keys; k; k = k->next) {
      assert_int_equal(k->n, 2);
      assert_true(k->id >= 1 && k->id <= STEPS);
      assert_int_equal(got[k->worker][k->id], 0); /* once */
      got[k->worker][k->id] = 1;
      total++;
      /* Both members of the round in this same cut. */
      bool other = false;
      for (const fps_key_rec_t *o = c.keys; o; o = o->next) other |= o->worker != k->worker && o->id == k->id;
      assert_true(other);
      /* The state the key answers for is in the cut: both tensors. */
      for (uint32_t j = 0; j < 2; j++) {
        uint64_t have = k->t[j] == c.img[0].t ? va : 0;
        for (size_t i = 0; i < c.nextra; i++)
          if (c.extra[i].t == k->t[j]) have = c.extra[i].version;
        assert_true(have >= k->v[j]);
      }
    }
    cut_free(&sh, &c);
    sched_yield(); /* a standby's sender takes a cut per batch, not in a spin */
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  assert_int_equal(total, 2 * STEPS);
  print_message("%zu cuts, %zu with extra images\n", cuts, with_extra);
  fx_shard_free(&sh);
}

/* An image arriving on a standby, installed into buffer p (params_own):
 * a's values plus k, its version v. */
static void install_a(fps_shard_t *sh, float *p, float k, uint64_t v) {
  fps_tensor_t *a = fps_store_find(&sh->store, "a");
  for (int i = 0; i < NA; i++) p[i] = (float)i + k;
  float state[NA + NA];
  memset(state, 0, sizeof state);
  fps_image_in_t in = {.name = "a", .dims = DA, .ndim = 2, .hp = a->hp, .version = v, .params_own = p, .state = state};
  in.n[FPS_STATE_ROW] = a->size.row;
  in.n[FPS_STATE_COL] = a->size.col;
  in.n[FPS_STATE_VAR] = a->size.var;
  in.n[FPS_STATE_MOM] = a->size.mom;
  char why[FPS_WHY_MAX];
  if (fps_shard_install(sh, &in, why, sizeof why) < 0) fail_msg("fps_shard_install: %s", why);
  assert_ptr_equal(a->param, p);
  assert_int_equal(a->version, v);
}

/* A standby takes each image of a tensor into the buffer the install
 * before retired (its spare), not a fresh one: two buffers per tensor
 * however many images arrive, and no staging bytes left behind. */
static void images_alternate_between_two_buffers(void **unused) {
  (void)unused;
  fps_shard_t sh;
  make_ab(&sh, FPS_MODE_ASYNC, 1);
  fps_tensor_t *a = fps_store_find(&sh.store, "a");
  uint64_t staged = atomic_load(&sh.tbuf_bytes);
  bool over = false;
  float *first = a->param;
  float *p1 = fps_shard_param_buf(&sh, "a", NA, &over);
  assert_non_null(p1);
  install_a(&sh, p1, 0.5f, 1);
  float *p2 = fps_shard_param_buf(&sh, "a", NA, &over);
  assert_ptr_equal(p2, first); /* the buffer install 1 retired */
  install_a(&sh, p2, 1.5f, 2);
  float *p3 = fps_shard_param_buf(&sh, "a", NA, &over);
  assert_ptr_equal(p3, p1);
  install_a(&sh, p3, 2.5f, 3);
  assert_float_equal(a->param[NA - 1], (float)(NA - 1) + 2.5f, 0);
  /* Another size than the tensor's, or a tensor not held: a buffer of
   * its own, given back unused. */
  float *q = fps_shard_param_buf(&sh, "a", NA + 1, &over), *r = fps_shard_param_buf(&sh, "new", NA, &over);
  assert_true(q && q != p2 && r && r != p2);
  fps_shard_param_buf_free(&sh, q, NA + 1);
  fps_shard_param_buf_free(&sh, r, NA);
  /* What stays staged is a's one spare, as after any update. */
  assert_int_equal(atomic_load(&sh.tbuf_bytes), staged + NA * sizeof(float));
  assert_int_equal(atomic_load(&sh.spare_bytes), NA * sizeof(float));
  fx_shard_free(&sh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sync_round_keys_travel_with_its_result),
      cmocka_unit_test(async_key_brings_the_tensors_it_changed),
      cmocka_unit_test(cuts_racing_rounds_hold_whole_rounds),
      cmocka_unit_test(images_alternate_between_two_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

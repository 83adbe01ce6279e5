/* Helpers of the shard core's unit tests (test_shard_*.c): a shard with
 * chosen mode and limits, tensors created through the real Create rules,
 * pushes driven the way the PushPull handler drives them, and a record of
 * every done callback. No socket, no gRPC: the core is called directly,
 * with the fake clock of tests/mocks/clock_fake.c. */
#ifndef FPS_TESTS_SHARD_FIXTURE_H
#define FPS_TESTS_SHARD_FIXTURE_H

#include <stdbool.h>
#include <stdint.h>

#include "clock_fake.h"
#include "shard/internal.h"

#define FX_DEADLINE_S 10.0 /* the shard's round deadline in the fixture */

/* A fresh shard: mode, W workers, staleness S, generous limits. Aborts on
 * failure. fx_shard_free() destroys it. */
void fx_shard(fps_shard_t *sh, int mode, uint32_t workers, uint32_t staleness);
void fx_shard_free(fps_shard_t *sh);

/* Creates tensor `name` of shape dims[0..ndim) (torch flavor, defaults)
 * with all of `init` (numel floats) in one slice. Returns the FPS_E* of
 * fps_shard_create(). */
int fx_create(fps_shard_t *sh, const char *name, const uint64_t *dims, size_t ndim, const float *init);

/* What the done callback saw. */
typedef struct fx_done_s {
  int calls;                  /* times done ran for this push */
  int err;                    /* fps_push_result() when it ran */
  char why[FPS_WHY_MAX];
} fx_done_t;

/* A push from worker at step with a deadline on the fake clock (INT64_MAX:
 * none); its done callback records into *d. */
fps_push_t *fx_push_new(fps_shard_t *sh, uint32_t worker, uint64_t step, int64_t deadline_ns, fx_done_t *d);
/* Sends the gradient g (numel floats) of tensor name as one fp32 slice, or
 * as `parts` slices in the order perm[0..parts) (perm NULL: in order).
 * Returns the first FPS_E* of fps_push_slice(). */
int fx_push_grad(fps_push_t *p, const char *name, const float *g, uint64_t numel, size_t parts, const size_t *perm);
/* fps_push_commit(); why goes to stderr on an unexpected error in tests. */
int fx_commit(fps_push_t *p, char *why);
/* Copies tensor name's parameters (numel floats) and version. */
uint64_t fx_params(fps_shard_t *sh, const char *name, float *out);

/* Deterministic pseudo-random floats in [-1, 1). */
void fx_fill(float *v, uint64_t n, uint32_t seed);

/* --- sync rounds with random slices (test_shard_reduce*.c) */

/* A shard with kernels k and a staging limit (sync, or async for a
 * replay). Aborts on failure. */
void fx_shard_with(fps_shard_t *sh, int mode, uint32_t workers, const fps_kernels_t *k, uint64_t staging);
/* xorshift32: the tests' deterministic choices. */
uint32_t fx_rnd(uint32_t *s);

/* One slice of worker w's gradient as it goes on the wire. */
typedef struct fx_ev_s {
  uint32_t w;
  uint64_t lo, hi;
  int dtype;
  uint8_t *bytes;             /* malloc'd wire bytes (fx_events_free) */
} fx_ev_t;

/* Cuts worker w's gradient g (numel floats) into 1..max_parts slices at
 * random points, each fp32 or bf16 at random, appended to ev[*nev]. g is
 * rewritten with what the shard will decode, so a replay sums that. */
void fx_random_slices(uint32_t *s, uint32_t w, float *g, uint64_t numel, size_t max_parts, fx_ev_t *ev,
                      size_t *nev);
/* ev[0..n) in a random order. */
void fx_shuffle(uint32_t *s, fx_ev_t *ev, size_t n);
void fx_events_free(fx_ev_t *ev, size_t n);
/* The local replay of a sync round of tensor `name` (shape dims):
 * ((g0 + g1) + g2) + ... in plain fp32 (g: nw rows of numel floats), one
 * division by nw, one step through an async shard with kernels k. */
void fx_replay(const fps_kernels_t *k, const uint64_t *dims, size_t ndim, const float *init, const float *g,
               uint32_t nw, float *out);

/* Tensor updates applied since the last fx_shard()/fx_shard_with() (the
 * counters are the process's metrics registry). */
uint64_t fx_updates(void);

#endif

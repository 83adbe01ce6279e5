/* Helpers of the shard core's unit tests (see shard_fixture.h). */
#include "shard_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simd/kernels.h"

void fx_shard(fps_shard_t *sh, int mode, uint32_t workers, uint32_t staleness) {
  static const fps_kernels_t *k;
  char why[256];
  if (!k && fps_kernels_by_name("auto", &k, why, sizeof why) < 0) {
    fprintf(stderr, "kernels: %s\n", why);
    abort();
  }
  fps__log_level = -1; /* the core logs nothing in the tests */
  fps_shard_opts_t o = {.shard_id = 0, .shard_count = 1, .mode = mode, .staleness = staleness,
                        .workers = workers, .deadline = FX_DEADLINE_S, .max_tensors = 64,
                        .max_bytes = 64u << 20, .max_staging_bytes = 64u << 20, .apply_log = 8,
                        .checkpoint_dir = ""};
  if (fps_shard_init(sh, &o, k, NULL) < 0) abort();
}

void fx_shard_free(fps_shard_t *sh) { fps_shard_destroy(sh); }

int fx_create(fps_shard_t *sh, const char *name, const uint64_t *dims, size_t ndim, const float *init) {
  uint64_t numel = 1;
  for (size_t i = 0; i < ndim; i++) numel *= dims[i];
  fps_slice_t s = {.dtype = FPS_DTYPE_F32, .offset = 0, .data = (const uint8_t *)init, .len = numel * 4};
  fps_create_item_t it = {.name = name, .dims = dims, .ndim = ndim, .init = init ? &s : NULL};
  fps_adafactor_defaults(&it.hp, FPS_FLAVOR_TORCH);
  fps_create_info_t info;
  uint64_t rx;
  char why[FPS_WHY_MAX];
  return fps_shard_create(sh, 0, 1, &it, 1, &info, &rx, why, sizeof why);
}

static void fx__done(fps_push_t *p, void *arg) {
  fx_done_t *d = arg;
  d->calls++;
  d->err = fps_push_result(p, d->why, sizeof d->why);
}

/* The shard of the last fx_push_new(), for the shapes of its slices. */
static fps_shard_t *fx__sh;

fps_push_t *fx_push_new(fps_shard_t *sh, uint32_t worker, uint64_t step, int64_t deadline_ns, fx_done_t *d) {
  fps_push_t *p;
  fx__sh = sh;
  char why[FPS_WHY_MAX];
  memset(d, 0, sizeof *d);
  if (fps_push_create(sh, deadline_ns, fx__done, d, &p) < 0) abort();
  if (fps_push_header(p, worker, step, false, 0, 0, why, sizeof why) < 0) {
    fprintf(stderr, "header: %s\n", why);
    abort();
  }
  return p;
}

int fx_push_grad(fps_push_t *p, const char *name, const float *g, uint64_t numel, size_t parts, const size_t *perm) {
  char why[FPS_WHY_MAX];
  if (parts == 0) parts = 1;
  /* PushPull slices carry the tensor's shape (an unknown name has none). */
  fps_tensor_t *t = fps_store_find(&fx__sh->store, name);
  for (size_t k = 0; k < parts; k++) {
    size_t i = perm ? perm[k] : k;
    uint64_t lo = numel * i / parts, hi = numel * (i + 1) / parts;
    fps_slice_t s = {.dtype = FPS_DTYPE_F32, .offset = lo, .data = (const uint8_t *)(g + lo), .len = (hi - lo) * 4,
                     .shape = t ? t->shape.dim : NULL, .n_shape = t ? t->shape.ndim : 0};
    int rc = fps_push_slice(p, name, &s, why, sizeof why);
    if (rc < 0) return rc;
  }
  return 0;
}

int fx_commit(fps_push_t *p, char *why) {
  char buf[FPS_WHY_MAX];
  return fps_push_commit(p, why ? why : buf, FPS_WHY_MAX);
}

uint64_t fx_params(fps_shard_t *sh, const char *name, float *out) {
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (!t) abort();
  pthread_mutex_lock(&t->mu);
  memcpy(out, t->param, t->numel * sizeof(float));
  uint64_t v = t->version;
  pthread_mutex_unlock(&t->mu);
  return v;
}

void fx_fill(float *v, uint64_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v[i] = (float)((double)x / 2147483648.0 - 1.0);
  }
}

/* Helpers of the shard core's unit tests (see shard_fixture.h). */
#include "metrics.h"
#include "shard_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "simd/kernels.h"

/* The registry's update count when the last fixture shard was made. */
static uint64_t fx_updates0;

static uint64_t fx_updates_now(void) {
  fps_metrics_totals_t t;
  fps_metrics_totals(&t);
  return t.updates;
}

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
  fx_updates0 = fx_updates_now();
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

void fx_shard_with(fps_shard_t *sh, int mode, uint32_t workers, const fps_kernels_t *k, uint64_t staging) {
  fps__log_level = -1;
  fps_shard_opts_t o = {.shard_id = 0, .shard_count = 1, .mode = mode, .workers = workers,
                        .deadline = FX_DEADLINE_S, .max_tensors = 8, .max_bytes = 64u << 20,
                        .max_staging_bytes = staging, .apply_log = 8, .checkpoint_dir = ""};
  if (fps_shard_init(sh, &o, k, NULL) < 0) abort();
  fx_updates0 = fx_updates_now();
}

uint32_t fx_rnd(uint32_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 17;
  *s ^= *s << 5;
  return *s;
}

void fx_random_slices(uint32_t *s, uint32_t w, float *g, uint64_t numel, size_t max_parts, fx_ev_t *ev,
                      size_t *nev) {
  size_t parts = 1 + fx_rnd(s) % max_parts;
  uint64_t *cut = malloc((parts + 1) * sizeof *cut);
  if (!cut) abort();
  cut[0] = 0;
  for (size_t i = 1; i < parts; i++) cut[i] = fx_rnd(s) % numel;
  cut[parts] = numel;
  for (size_t i = 1; i < parts; i++) /* insertion sort of the inner cuts */
    for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
      uint64_t x = cut[j];
      cut[j] = cut[j - 1];
      cut[j - 1] = x;
    }
  for (size_t i = 0; i < parts; i++) {
    if (cut[i] == cut[i + 1]) continue;
    fx_ev_t *e = &ev[(*nev)++];
    e->w = w;
    e->lo = cut[i];
    e->hi = cut[i + 1];
    e->dtype = fx_rnd(s) % 2 ? FPS_DTYPE_BF16 : FPS_DTYPE_F32;
    uint64_t n = e->hi - e->lo;
    e->bytes = malloc(n * fps_dtype_size(e->dtype));
    if (!e->bytes || fps_dtype_encode(e->dtype, g + e->lo, n, e->bytes) != 0 ||
        fps_dtype_decode(e->dtype, e->bytes, n, g + e->lo, NULL) != 0)
      abort();
  }
  free(cut);
}

void fx_shuffle(uint32_t *s, fx_ev_t *ev, size_t n) {
  for (size_t i = n; i > 1; i--) {
    size_t j = fx_rnd(s) % i;
    fx_ev_t x = ev[i - 1];
    ev[i - 1] = ev[j];
    ev[j] = x;
  }
}

void fx_events_free(fx_ev_t *ev, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(ev[i].bytes);
    ev[i].bytes = NULL;
  }
}

void fx_replay(const fps_kernels_t *k, const uint64_t *dims, size_t ndim, const float *init, const float *g,
               uint32_t nw, float *out) {
  uint64_t numel = 1;
  for (size_t i = 0; i < ndim; i++) numel *= dims[i];
  float *sum = malloc(numel * sizeof *sum);
  if (!sum) abort();
  memcpy(sum, g, numel * sizeof *sum);
  for (uint32_t w = 1; w < nw; w++)
    for (uint64_t i = 0; i < numel; i++) sum[i] += g[w * numel + i];
  if (nw > 1)
    for (uint64_t i = 0; i < numel; i++) sum[i] /= (float)nw;
  fps_shard_t ref;
  fx_shard_with(&ref, FPS_MODE_ASYNC, 1, k, 64u << 20);
  fx_done_t d;
  if (fx_create(&ref, "w", dims, ndim, init) != 0) abort();
  fps_push_t *p = fx_push_new(&ref, 0, 0, INT64_MAX, &d);
  if (fx_push_grad(p, "w", sum, numel, 1, NULL) != 0 || fx_commit(p, NULL) != 0) abort();
  fps_push_destroy(p);
  if (fx_params(&ref, "w", out) != 1) abort();
  fx_shard_free(&ref);
  free(sum);
}

uint64_t fx_updates(void) { return fx_updates_now() - fx_updates0; }

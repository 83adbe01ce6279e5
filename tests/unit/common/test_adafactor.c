/* Adafactor API: hyperparameter and shape validation (named errors, never a
 * silent fix-up), settings comparison, state sizes and lifetime, kernel
 * selection, and thread-count independence of the step. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "adafactor.h"
#include "pool.h"
#include "simd/kernels.h"

static void defaults_are_valid_and_upstream(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp;
  char why[256];
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  assert_int_equal(fps_adafactor_validate(&hp, why, sizeof why), 0);
  assert_true(hp.has_lr && hp.lr == 1e-2 && hp.decay == -0.8 && hp.eps2 == 1e-3 && hp.clip == 1.0);
  assert_true(hp.eps1 == (double)FLT_EPSILON);
  fps_adafactor_defaults(&hp, FPS_FLAVOR_HF);
  assert_int_equal(fps_adafactor_validate(&hp, why, sizeof why), 0);
  assert_true(!hp.has_lr && hp.relative_step && hp.scale_parameter && !hp.warmup_init);
  assert_true(hp.eps1 == 1e-30 && !hp.has_beta1);
}

typedef void (*mutate_fn)(fps_adafactor_hparams_t *);
typedef struct bad_case_s {
  fps_flavor_t flavor;
  mutate_fn mutate;
  int err;
  const char *word; /* the message must name the parameter */
} bad_case_t;

static void m_neg_lr(fps_adafactor_hparams_t *h) { h->lr = -1e-3; }
static void m_hf_lr_rel(fps_adafactor_hparams_t *h) { h->has_lr = true, h->lr = 1e-3; }
static void m_hf_warmup(fps_adafactor_hparams_t *h) {
  h->relative_step = false, h->has_lr = true, h->lr = 1e-3, h->warmup_init = true;
}
static void m_hf_nolr(fps_adafactor_hparams_t *h) { h->relative_step = false; }
static void m_d0(fps_adafactor_hparams_t *h) { h->clip = 0; }
static void m_dneg(fps_adafactor_hparams_t *h) { h->clip = -1; }
static void m_dhalf(fps_adafactor_hparams_t *h) { h->clip = 0.5; }
static void m_nan_lr(fps_adafactor_hparams_t *h) { h->lr = NAN; }
static void m_inf_eps2(fps_adafactor_hparams_t *h) { h->eps2 = INFINITY; }
static void m_nan_decay(fps_adafactor_hparams_t *h) { h->decay = NAN; }
static void m_nan_wd(fps_adafactor_hparams_t *h) { h->weight_decay = NAN; }
static void m_nan_beta1(fps_adafactor_hparams_t *h) { h->has_beta1 = true, h->beta1 = NAN; }
static void m_beta1_1(fps_adafactor_hparams_t *h) { h->has_beta1 = true, h->beta1 = 1.0; }
static void m_beta1_neg(fps_adafactor_hparams_t *h) { h->has_beta1 = true, h->beta1 = -0.1; }
static void m_beta1_torch(fps_adafactor_hparams_t *h) { h->has_beta1 = true, h->beta1 = 0.9; }
static void m_max_hf(fps_adafactor_hparams_t *h) { h->maximize = true; }
static void m_rel_torch(fps_adafactor_hparams_t *h) { h->relative_step = true; }
static void m_warm_torch(fps_adafactor_hparams_t *h) { h->warmup_init = true; }
static void m_scale_torch(fps_adafactor_hparams_t *h) { h->scale_parameter = false; }
static void m_nolr_torch(fps_adafactor_hparams_t *h) { h->has_lr = false; }
static void m_eps1_neg(fps_adafactor_hparams_t *h) { h->eps1 = -1e-30; }
static void m_eps2_neg(fps_adafactor_hparams_t *h) { h->eps2 = -1; }
static void m_decay_pos(fps_adafactor_hparams_t *h) { h->decay = 0.5; }
static void m_wd_neg(fps_adafactor_hparams_t *h) { h->weight_decay = -0.1; }
static void m_flavor(fps_adafactor_hparams_t *h) { h->flavor = (fps_flavor_t)7; }

static void bad_hparams_are_named_errors(void **u) {
  (void)u;
  const fps_flavor_t T = FPS_FLAVOR_TORCH, H = FPS_FLAVOR_HF;
  const bad_case_t cases[] = {
      {T, m_neg_lr, FPS_EHPARAM, "lr"},
      {H, m_hf_lr_rel, FPS_EHPARAM, "relative_step"},
      {H, m_hf_warmup, FPS_EHPARAM, "warmup_init"},
      {H, m_hf_nolr, FPS_EHPARAM, "lr"},
      {T, m_d0, FPS_EHPARAM, "d "},
      {T, m_dneg, FPS_EHPARAM, "d "},
      {T, m_dhalf, FPS_EHPARAM, "d (the clipping threshold) must be >= 1"},
      {H, m_d0, FPS_EHPARAM, "clip_threshold"},
      {T, m_nan_lr, FPS_EHPARAM, "lr"},
      {T, m_inf_eps2, FPS_EHPARAM, "eps2"},
      {H, m_nan_decay, FPS_EHPARAM, "decay_rate"},
      {T, m_nan_decay, FPS_EHPARAM, "beta2_decay"},
      {T, m_nan_wd, FPS_EHPARAM, "weight_decay"},
      {H, m_nan_beta1, FPS_EHPARAM, "beta1"},
      {H, m_beta1_1, FPS_EHPARAM, "beta1"},
      {H, m_beta1_neg, FPS_EHPARAM, "beta1"},
      {T, m_beta1_torch, FPS_EHPARAM, "beta1"},
      {H, m_max_hf, FPS_EHPARAM, "maximize"},
      {T, m_rel_torch, FPS_EHPARAM, "relative_step"},
      {T, m_warm_torch, FPS_EHPARAM, "warmup_init"},
      {T, m_scale_torch, FPS_EHPARAM, "scale_parameter"},
      {T, m_nolr_torch, FPS_EHPARAM, "lr"},
      {H, m_eps1_neg, FPS_EHPARAM, "eps1"},
      {T, m_eps2_neg, FPS_EHPARAM, "eps2"},
      {T, m_decay_pos, FPS_EHPARAM, "beta2_decay"},
      {H, m_wd_neg, FPS_EHPARAM, "weight_decay"},
      {T, m_flavor, FPS_EFLAVOR, "flavor"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fps_adafactor_hparams_t hp;
    char why[256] = "";
    fps_adafactor_defaults(&hp, cases[i].flavor);
    cases[i].mutate(&hp);
    int rc = fps_adafactor_validate(&hp, why, sizeof why);
    if (rc != cases[i].err || !strstr(why, cases[i].word))
      print_error("case %zu: rc %s, why '%s' (want %s naming '%s')\n", i, fps_err_name(rc), why,
                  fps_err_name(cases[i].err), cases[i].word);
    assert_int_equal(rc, cases[i].err);
    assert_non_null(strstr(why, cases[i].word));
    /* no state for bad settings, and the step refuses them too */
    fps_adafactor_state_t st;
    fps_shape_t s = {.ndim = 1, .dim = {4}};
    assert_int_equal(fps_adafactor_state_init(&st, &s, &hp), cases[i].err);
    fps_adafactor_state_destroy(&st);
  }
  /* Valid combinations upstream accepts. */
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_HF);
  hp.relative_step = false, hp.has_lr = true, hp.lr = 1e-3, hp.scale_parameter = false;
  hp.has_beta1 = true, hp.beta1 = 0.0;
  assert_int_equal(fps_adafactor_validate(&hp, NULL, 0), 0);
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  hp.maximize = true, hp.lr = 0, hp.eps1 = 0, hp.weight_decay = 0.1;
  assert_int_equal(fps_adafactor_validate(&hp, NULL, 0), 0);
  assert_int_equal(fps_adafactor_validate(NULL, NULL, 0), FPS_EINVAL);
}

static void hparams_diff_names_field(void **u) {
  (void)u;
  fps_adafactor_hparams_t a, b;
  char why[256] = "";
  fps_adafactor_defaults(&a, FPS_FLAVOR_TORCH);
  b = a;
  assert_int_equal(fps_adafactor_hparams_diff(&a, &b, why, sizeof why), 0);
  b.lr = 1e-3;
  assert_int_equal(fps_adafactor_hparams_diff(&a, &b, why, sizeof why), FPS_EEXISTS);
  assert_string_equal(why, "lr 0.01 vs 0.001");
  b = a;
  b.maximize = true;
  assert_int_equal(fps_adafactor_hparams_diff(&a, &b, why, sizeof why), FPS_EEXISTS);
  assert_string_equal(why, "maximize false vs true");
  fps_adafactor_defaults(&b, FPS_FLAVOR_HF);
  assert_int_equal(fps_adafactor_hparams_diff(&a, &b, why, sizeof why), FPS_EEXISTS);
  assert_string_equal(why, "flavor torch vs hf");
  a = b;
  a.has_beta1 = b.has_beta1 = true, a.beta1 = 0.9, b.beta1 = 0.95;
  assert_int_equal(fps_adafactor_hparams_diff(&a, &b, why, sizeof why), FPS_EEXISTS);
  assert_string_equal(why, "beta1 0.9 vs 0.95");
}

static void flavor_names(void **u) {
  (void)u;
  fps_flavor_t f;
  assert_int_equal(fps_flavor_parse("torch", &f), 0);
  assert_int_equal(f, FPS_FLAVOR_TORCH);
  assert_int_equal(fps_flavor_parse("hf", &f), 0);
  assert_int_equal(f, FPS_FLAVOR_HF);
  assert_int_equal(fps_flavor_parse("adam", &f), FPS_EFLAVOR);
  assert_int_equal(fps_flavor_parse("", &f), FPS_EFLAVOR);
  assert_int_equal(fps_flavor_parse(NULL, &f), FPS_EFLAVOR);
  assert_string_equal(fps_flavor_name(FPS_FLAVOR_HF), "hf");
  assert_string_equal(fps_flavor_name((fps_flavor_t)0), "unknown");
}

static void shapes_validated(void **u) {
  (void)u;
  char why[256];
  uint64_t n;
  fps_shape_t s = {.ndim = 0};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), 0);
  assert_int_equal(n, 1);
  s = (fps_shape_t){.ndim = 3, .dim = {2, 3, 4}};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), 0);
  assert_int_equal(n, 24);
  s = (fps_shape_t){.ndim = 2, .dim = {3, 0}};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), FPS_ESHAPE);
  assert_non_null(strstr(why, "dimension 1 is 0"));
  s = (fps_shape_t){.ndim = FPS_MAX_DIMS + 1};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), FPS_ESHAPE);
  /* 2^32 * 2^32 overflows uint64 silently if multiplied first */
  s = (fps_shape_t){.ndim = 2, .dim = {UINT64_C(1) << 32, UINT64_C(1) << 32}};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), FPS_EOVERFLOW);
  s = (fps_shape_t){.ndim = 2, .dim = {UINT64_MAX, 2}};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), FPS_EOVERFLOW);
  s = (fps_shape_t){.ndim = 1, .dim = {FPS_MAX_NUMEL}};
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), 0);
  s.dim[0]++;
  assert_int_equal(fps_shape_validate(&s, &n, why, sizeof why), FPS_EOVERFLOW);
  assert_int_equal(fps_shape_validate(NULL, &n, why, sizeof why), FPS_EINVAL);

  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_state_size_t sz;
  s = (fps_shape_t){.ndim = 2, .dim = {3, 0}};
  assert_int_equal(fps_adafactor_state_size(&s, &hp, &sz), FPS_ESHAPE);
  fps_adafactor_state_t st;
  assert_int_equal(fps_adafactor_state_init(&st, &s, &hp), FPS_ESHAPE);
  fps_adafactor_state_destroy(&st);
}

static void state_sizes(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp;
  fps_state_size_t sz;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_HF);
  hp.has_beta1 = true, hp.beta1 = 0.9;
  fps_shape_t s = {.ndim = 4, .dim = {2, 3, 5, 7}};
  assert_int_equal(fps_adafactor_state_size(&s, &hp, &sz), 0);
  assert_int_equal(sz.row, 30);
  assert_int_equal(sz.col, 42);
  assert_int_equal(sz.var, 0);
  assert_int_equal(sz.mom, 210);
  assert_int_equal(sz.elements, 282);
  assert_int_equal(sz.bytes, 1128);
  assert_int_equal(sz.adamw_elements, 420);
  assert_int_equal(sz.adamw_bytes, 1680);
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  s = (fps_shape_t){.ndim = 0};
  assert_int_equal(fps_adafactor_state_size(&s, &hp, &sz), 0);
  assert_int_equal(sz.var, 1);
  assert_int_equal(sz.elements, 1);
  assert_int_equal(sz.adamw_elements, 2);
  /* The whole point: a 50257 x 768 embedding. */
  s = (fps_shape_t){.ndim = 2, .dim = {50257, 768}};
  assert_int_equal(fps_adafactor_state_size(&s, &hp, &sz), 0);
  assert_int_equal(sz.elements, 50257 + 768);
  assert_int_equal(sz.adamw_elements, 2ull * 50257 * 768);
}

static void state_lifetime_and_step_args(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_HF);
  fps_adafactor_state_t st;
  fps_shape_t s = {.ndim = 2, .dim = {3, 4}};
  assert_int_equal(fps_adafactor_state_init(&st, &s, &hp), 0);
  assert_true(st.factored && st.row && st.col && !st.var && !st.mom);
  float p[12] = {0}, g[12] = {0};
  assert_int_equal(fps_adafactor_step(NULL, &hp, &st, NULL, g, NULL, NULL), FPS_EINVAL);
  assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, NULL, NULL, NULL), FPS_EINVAL);
  /* momentum settings on a state made without momentum */
  fps_adafactor_hparams_t hp2 = hp;
  hp2.has_beta1 = true, hp2.beta1 = 0.9;
  assert_int_equal(fps_adafactor_step(NULL, &hp2, &st, p, g, NULL, NULL), FPS_EINVAL);
  hp2 = hp;
  hp2.clip = -1;
  assert_int_equal(fps_adafactor_step(NULL, &hp2, &st, p, g, NULL, NULL), FPS_EHPARAM);
  assert_int_equal(st.step, 0);
  fps_adafactor_trace_t tr;
  assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g, NULL, &tr), 0);
  assert_int_equal(st.step, 1);
  assert_int_equal(tr.step, 1);
  assert_int_equal(tr.bytes, fps_adafactor_step_bytes(&st));
  fps_adafactor_state_destroy(&st);
  fps_adafactor_state_destroy(&st); /* idempotent */
  fps_adafactor_state_destroy(NULL);
  assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g, NULL, NULL), FPS_EINVAL);
}

/* The check a caller runs before several steps matches what the step
 * returns, and a step with the caller's scratch gives the same bits. */
static void step_check_and_caller_scratch(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp, bad;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_shape_t s = {.ndim = 2, .dim = {37, 29}};
  fps_adafactor_state_t a, b;
  assert_int_equal(fps_adafactor_state_init(&a, &s, &hp), 0);
  assert_int_equal(fps_adafactor_state_init(&b, &s, &hp), 0);
  assert_int_equal(fps_adafactor_step_check(&hp, &a), 0);
  bad = hp;
  bad.clip = -1;
  assert_int_equal(fps_adafactor_step_check(&bad, &a), FPS_EHPARAM);
  bad = hp;
  bad.flavor = FPS_FLAVOR_HF, bad.has_beta1 = true, bad.beta1 = 0.9, bad.relative_step = false, bad.has_lr = true;
  assert_int_equal(fps_adafactor_step_check(&bad, &a), FPS_EINVAL); /* no momentum state */
  assert_int_equal(fps_adafactor_step_check(NULL, &a), FPS_EINVAL);
  size_t len = fps_adafactor_scratch_len(&a);
  assert_true(len > 29);
  double *scratch = malloc(len * sizeof *scratch);
  assert_non_null(scratch);
  static float pa[37 * 29], pb[37 * 29], g[37 * 29];
  for (int i = 0; i < 37 * 29; i++) {
    pa[i] = pb[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
    g[i] = (float)((i * 104729) % 997) / 498.5f - 1.0f;
  }
  for (int k = 0; k < 3; k++) {
    assert_int_equal(fps_adafactor_step(NULL, &hp, &a, pa, g, NULL, NULL), 0);
    assert_int_equal(fps_adafactor_step_to(NULL, &hp, &b, pb, g, pb, NULL, scratch, NULL), 0);
  }
  assert_memory_equal(pa, pb, sizeof pa);
  assert_memory_equal(a.row, b.row, 37 * sizeof(float));
  assert_memory_equal(a.col, b.col, 29 * sizeof(float));
  free(scratch);
  fps_adafactor_state_destroy(&a);
  fps_adafactor_state_destroy(&b);
  /* Unfactored: no scratch at all. */
  s = (fps_shape_t){.ndim = 1, .dim = {5}};
  assert_int_equal(fps_adafactor_state_init(&a, &s, &hp), 0);
  assert_int_equal(fps_adafactor_scratch_len(&a), 0);
  fps_adafactor_state_destroy(&a);
}

/* torch keeps its step in a float32 tensor, which stops counting at 2^24. */
static void torch_step_counter_stalls_like_float32(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_adafactor_state_t st;
  fps_shape_t s = {.ndim = 1, .dim = {2}};
  assert_int_equal(fps_adafactor_state_init(&st, &s, &hp), 0);
  st.step = UINT64_C(1) << 24;
  float p[2] = {1, 2}, g[2] = {0.5f, -0.5f};
  assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g, NULL, NULL), 0);
  assert_int_equal(st.step, UINT64_C(1) << 24);
  fps_adafactor_state_destroy(&st);
}

/* The step does not validate gradients (the shard does, before it); a NaN
 * or Inf must still not crash anything, and it propagates like upstream. */
static void nonfinite_inputs_do_not_crash(void **u) {
  (void)u;
  const fps_shape_t shapes[] = {{.ndim = 2, .dim = {4, 9}}, {.ndim = 1, .dim = {36}}};
  const float bad[] = {NAN, INFINITY, -INFINITY};
  for (int fl = 0; fl < 2; fl++)
    for (int si = 0; si < 2; si++)
      for (int bi = 0; bi < 3; bi++) {
        fps_adafactor_hparams_t hp;
        fps_adafactor_defaults(&hp, fl ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
        hp.eps1 = 0; /* the most fragile setting: no epsilon at all */
        fps_adafactor_state_t st;
        assert_int_equal(fps_adafactor_state_init(&st, &shapes[si], &hp), 0);
        float p[36], g[36] = {0};
        for (int i = 0; i < 36; i++) p[i] = (float)i * 0.1f;
        /* all-zero gradient first (0/0 territory with eps1 = 0) */
        assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g, NULL, NULL), 0);
        g[5] = bad[bi];
        assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g, NULL, NULL), 0);
        int nonfinite = 0;
        for (int i = 0; i < 36; i++) nonfinite += !isfinite(p[i]);
        assert_true(nonfinite > 0);
        fps_adafactor_state_destroy(&st);
      }
}

static void kernel_selection(void **u) {
  (void)u;
  const fps_kernels_t *k;
  char why[256];
  assert_int_equal(fps_kernels_by_name("scalar", &k, why, sizeof why), 0);
  assert_string_equal(fps_kernels_name(k), "scalar");
  assert_int_equal(fps_kernels_by_name("sse9", &k, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "sse9"));
#if defined(__x86_64__)
  assert_int_equal(fps_kernels_by_name("neon", &k, why, sizeof why), FPS_EUNSUPPORTED);
  assert_non_null(strstr(why, "neon"));
#else
  assert_int_equal(fps_kernels_by_name("avx2", &k, why, sizeof why), FPS_EUNSUPPORTED);
#endif
  setenv("FACTORPS_SIMD", "scalar", 1);
  assert_int_equal(fps_kernels_from_env(&k, why, sizeof why), 0);
  assert_string_equal(fps_kernels_name(k), "scalar");
  setenv("FACTORPS_SIMD", "bogus", 1);
  assert_int_equal(fps_kernels_from_env(&k, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "FACTORPS_SIMD"));
  unsetenv("FACTORPS_SIMD");
  assert_int_equal(fps_kernels_from_env(&k, why, sizeof why), 0);
  assert_ptr_equal(k, fps_kernels_best());
}

/* qemu-user 7.2 (the aarch64 test runner) hangs in pthread_create on these
 * machines, so tests/unit/common/CMakeLists.txt sets FPS_TEST_NO_THREADS there. */
static void skip_without_threads(void) {
  const char *e = getenv("FPS_TEST_NO_THREADS");
  if (e && *e && strcmp(e, "0")) {
    print_message("skipped: FPS_TEST_NO_THREADS is set (no threads under this emulator)\n");
    skip();
  }
}

/* Deterministic pseudo-random floats (xorshift), roughly N(0,1)-ish. */
static uint64_t rng_state = 88172645463325252ull;
static float frand(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Same tensor, same gradients, 1 / 2 / 3 / 5 threads: bit-identical params
 * and state, because chunk bounds depend on the shape only. */
static void thread_count_independent(void **u) {
  (void)u;
  skip_without_threads();
  const fps_shape_t shapes[] = {
      {.ndim = 2, .dim = {1031, 257}},   /* factored, many chunks */
      {.ndim = 3, .dim = {2, 300, 301}}, /* batched */
      {.ndim = 1, .dim = {400003}},      /* unfactored */
  };
  const unsigned threads[] = {1, 2, 3, 5};
  for (int fl = 0; fl < 2; fl++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      fps_adafactor_hparams_t hp;
      fps_adafactor_defaults(&hp, fl ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
      if (fl) hp.has_beta1 = true, hp.beta1 = 0.9;
      else hp.weight_decay = 0.01;
      uint64_t n;
      assert_int_equal(fps_shape_validate(&shapes[si], &n, NULL, 0), 0);
      float *p0 = malloc(n * 4), *g = malloc(3 * n * 4), *ref = malloc(n * 4), *p = malloc(n * 4);
      float *refrow = NULL;
      assert_true(p0 && g && ref && p);
      for (uint64_t i = 0; i < n; i++) p0[i] = frand();
      for (uint64_t i = 0; i < 3 * n; i++) g[i] = frand() * (i % 7 == 0 ? 100.0f : 1.0f);
      for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
        fps_pool_t *pool = NULL;
        if (threads[ti] > 1) assert_int_equal(fps_pool_create(&pool, threads[ti]), 0);
        fps_adafactor_state_t st;
        assert_int_equal(fps_adafactor_state_init(&st, &shapes[si], &hp), 0);
        memcpy(p, p0, n * 4);
        for (int t = 0; t < 3; t++)
          assert_int_equal(fps_adafactor_step(NULL, &hp, &st, p, g + t * n, pool, NULL), 0);
        const float *stat = st.factored ? st.row : st.var;
        uint64_t sn = st.factored ? st.batch * st.rows : n;
        if (ti == 0) {
          memcpy(ref, p, n * 4);
          refrow = malloc(sn * 4);
          memcpy(refrow, stat, sn * 4);
        } else {
          assert_memory_equal(ref, p, n * 4);
          assert_memory_equal(refrow, stat, sn * 4);
        }
        fps_adafactor_state_destroy(&st);
        fps_pool_destroy(pool);
      }
      free(refrow);
      free(p0), free(g), free(ref), free(p);
    }
}

static void count_chunk(void *arg, size_t i) {
  atomic_int *hits = arg;
  atomic_fetch_add(&hits[i], 1);
}

static void pool_runs_every_chunk_once(void **u) {
  (void)u;
  skip_without_threads();
  fps_pool_t *pool;
  assert_int_equal(fps_pool_create(&pool, 4), 0);
  assert_int_equal(fps_pool_threads(pool), 4);
  static atomic_int hits[1000];
  for (int round = 0; round < 200; round++) {
    size_t n = (size_t)(round * 5) % 1000;
    for (size_t i = 0; i < 1000; i++) atomic_store(&hits[i], 0);
    fps_pool_run(pool, n, count_chunk, hits);
    for (size_t i = 0; i < 1000; i++) assert_int_equal(atomic_load(&hits[i]), i < n ? 1 : 0);
  }
  fps_pool_destroy(pool);
  fps_pool_destroy(NULL);
  assert_int_equal(fps_pool_threads(NULL), 1);
  for (size_t i = 0; i < 10; i++) atomic_store(&hits[i], 0);
  fps_pool_run(NULL, 10, count_chunk, hits);
  for (size_t i = 0; i < 10; i++) assert_int_equal(atomic_load(&hits[i]), 1);
  assert_int_equal(fps_pool_create(NULL, 2), FPS_EINVAL);
}

/* Runs of a few chunks back to back: the caller often takes every chunk
 * before a worker wakes, so workers wake late for runs that are over (they
 * must stay out) or join the next one (they must use its fn, arg and n):
 * every run's chunks run exactly once, before it returns, and nothing of
 * an old run runs after it. */
static void pool_late_workers_stay_out(void **u) {
  (void)u;
  skip_without_threads();
  fps_pool_t *pool;
  assert_int_equal(fps_pool_create(&pool, 4), 0);
  static atomic_int a[8], b[8];
  for (int round = 0; round < 20000; round++) {
    atomic_int *hits = round & 1 ? a : b, *other = round & 1 ? b : a;
    size_t n = 1 + (size_t)round % 7;
    for (size_t i = 0; i < 8; i++) atomic_store(&hits[i], 0);
    fps_pool_run(pool, n, count_chunk, hits);
    for (size_t i = 0; i < 8; i++) assert_int_equal(atomic_load(&hits[i]), i < n ? 1 : 0);
    /* The previous run's counts (checked when it returned) are unchanged. */
    if (round > 0)
      for (size_t i = 0; i < 8; i++) assert_int_equal(atomic_load(&other[i]), i < 1 + (size_t)(round - 1) % 7 ? 1 : 0);
  }
  fps_pool_destroy(pool);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(defaults_are_valid_and_upstream),
      cmocka_unit_test(bad_hparams_are_named_errors),
      cmocka_unit_test(hparams_diff_names_field),
      cmocka_unit_test(flavor_names),
      cmocka_unit_test(shapes_validated),
      cmocka_unit_test(state_sizes),
      cmocka_unit_test(state_lifetime_and_step_args),
      cmocka_unit_test(step_check_and_caller_scratch),
      cmocka_unit_test(torch_step_counter_stalls_like_float32),
      cmocka_unit_test(nonfinite_inputs_do_not_crash),
      cmocka_unit_test(kernel_selection),
      cmocka_unit_test(thread_count_independent),
      cmocka_unit_test(pool_runs_every_chunk_once),
      cmocka_unit_test(pool_late_workers_stay_out),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Replays every golden case in $FPS_VECTORS_DIR (tests/vectors/adafactor)
 * through every SIMD variant this machine supports, and checks the params
 * after each step and the final state arrays with check_vectors.py's
 * metrics and tolerances:
 *   param scaled    max|d| / max(max|ref_t|, max|ref_t - ref_t-1|)   <= 1e-5
 *   param upd-rel   max|d| / max|ref_t - ref_t-1|                     <= 1e-3
 *                   (only on steps whose update >= 1e-3 max|ref_t|)
 *   state rel       max|d| / max(|ref|, 1e-6 max|ref|)  row/col/var   <= 1e-4
 *   mom scaled      max|d| / max|ref|                                 <= 1e-5
 *   non-finite values must match exactly.
 * Also checks fps_adafactor_state_size() against index.json's
 * state_elements and adamw_state_elements (when built with cJSON). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "adafactor.h"
#include "golden.h"
#include "simd/kernels.h"

#ifdef FPS_HAVE_CJSON
#include <cjson/cJSON.h>
#endif

#define PTOL 1e-5
#define UTOL 1e-3
#define STOL 1e-4

static const char *vectors_dir(void) {
  const char *d = getenv("FPS_VECTORS_DIR");
  return d && *d ? d : NULL;
}

typedef struct worst_s {
  double param_scaled, upd_rel, state_rel, mom_scaled;
} worst_t;

/* Non-finite entries must match (same NaN-ness / same infinity); the
 * finite ones give max |impl - ref| and max |ref|. */
static int compare_arrays(const float *impl, const float *ref, uint64_t n, double *maxd,
                          double *maxref) {
  int bad = 0;
  *maxd = 0;
  *maxref = 0;
  for (uint64_t i = 0; i < n; i++) {
    bool fi = isfinite(impl[i]), fr = isfinite(ref[i]);
    if (!fi || !fr) {
      bool same = !fi && !fr && ((isnan(impl[i]) && isnan(ref[i])) || impl[i] == ref[i]);
      if (!same) bad++;
      continue;
    }
    double d = fabs((double)impl[i] - ref[i]), r = fabs((double)ref[i]);
    if (d > *maxd) *maxd = d;
    if (r > *maxref) *maxref = r;
  }
  return bad;
}

static double floored_rel(const float *impl, const float *ref, uint64_t n) {
  double mx = 0, worst = 0;
  for (uint64_t i = 0; i < n; i++)
    if (isfinite(ref[i]) && fabs(ref[i]) > mx) mx = fabs(ref[i]);
  double floor = mx * 1e-6 > 1e-300 ? mx * 1e-6 : 1e-300;
  for (uint64_t i = 0; i < n; i++) {
    if (!isfinite(impl[i]) || !isfinite(ref[i])) continue;
    double r = fabs((double)ref[i]);
    double e = fabs((double)impl[i] - ref[i]) / (r > floor ? r : floor);
    if (e > worst) worst = e;
  }
  return worst;
}

/* Returns the number of failed checks for one case (and prints them). */
static int check_case(const fps_golden_case_t *c, const fps_golden_run_t *run, worst_t *w) {
  int fails = 0;
  uint64_t n = c->numel;
  float *prev = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float));
  assert_non_null(prev);
  assert_non_null(ref);
  char path[8192], why[512];
  snprintf(path, sizeof path, "%s/param_0.bin", c->dir);
  assert_int_equal(fps_golden_read_f32(path, prev, n, why, sizeof why), 0);
  for (unsigned t = 1; t <= c->steps; t++) {
    snprintf(path, sizeof path, "%s/param_%u.bin", c->dir, t);
    if (fps_golden_read_f32(path, ref, n, why, sizeof why)) {
      print_error("%s\n", why);
      fails++;
      break;
    }
    const float *impl = run->params + (t - 1) * n;
    double maxd, maxref, upd = 0;
    int bad = compare_arrays(impl, ref, n, &maxd, &maxref);
    if (bad) {
      print_error("%s step %u: %d non-finite mismatches\n", c->name, t, bad);
      fails++;
    }
    for (uint64_t i = 0; i < n; i++) {
      double u = fabs((double)ref[i] - prev[i]);
      if (u > upd) upd = u;
    }
    double denom = maxref > upd ? maxref : upd;
    double sc = denom > 0 ? maxd / denom : (maxd == 0 ? 0 : INFINITY);
    if (sc > w->param_scaled) w->param_scaled = sc;
    if (sc > PTOL) {
      print_error("%s step %u: param scaled err %.3e > %g\n", c->name, t, sc, PTOL);
      fails++;
    }
    if (upd > 0 && upd >= 1e-3 * maxref) {
      double ur = maxd / upd;
      if (ur > w->upd_rel) w->upd_rel = ur;
      if (ur > UTOL) {
        print_error("%s step %u: param err / update %.3e > %g\n", c->name, t, ur, UTOL);
        fails++;
      }
    }
    memcpy(prev, ref, n * sizeof(float));
  }
  for (int kind = 0; kind < FPS_GOLDEN_NSTATE; kind++) {
    uint64_t sn;
    const float *impl = fps_golden_state_array(run, kind, &sn);
    const char *kn = fps_golden_state_names[kind];
    if (!c->state_listed[kind]) {
      if (impl) {
        print_error("%s: has state %s the reference lacks\n", c->name, kn);
        fails++;
      }
      continue;
    }
    if (!impl) {
      print_error("%s: state %s missing\n", c->name, kn);
      fails++;
      continue;
    }
    float *sref = malloc((sn ? sn : 1) * sizeof(float));
    assert_non_null(sref);
    snprintf(path, sizeof path, "%s/state_%s.bin", c->dir, kn);
    if (fps_golden_read_f32(path, sref, sn, why, sizeof why)) {
      print_error("%s\n", why);
      fails++;
      free(sref);
      continue;
    }
    double maxd, maxref;
    int bad = compare_arrays(impl, sref, sn, &maxd, &maxref);
    if (bad) {
      print_error("%s state %s: %d non-finite mismatches\n", c->name, kn, bad);
      fails++;
    }
    if (kind == FPS_GOLDEN_MOM) {
      double sc = maxref > 0 ? maxd / maxref : (maxd == 0 ? 0 : INFINITY);
      if (sc > w->mom_scaled) w->mom_scaled = sc;
      if (sc > PTOL) {
        print_error("%s state mom: scaled err %.3e > %g\n", c->name, sc, PTOL);
        fails++;
      }
    } else {
      double r = floored_rel(impl, sref, sn);
      if (r > w->state_rel) w->state_rel = r;
      if (r > STOL) {
        print_error("%s state %s: rel err %.3e > %g\n", c->name, kn, r, STOL);
        fails++;
      }
    }
    free(sref);
  }
  free(prev);
  free(ref);
  return fails;
}

static void replay_all(const char *variant, unsigned threads) {
  const char *dir = vectors_dir();
  if (!dir) {
    print_message("FPS_VECTORS_DIR is not set\n");
    fail();
  }
  const fps_kernels_t *k;
  char why[512];
  int rc = fps_kernels_by_name(variant, &k, why, sizeof why);
  if (rc == FPS_EUNSUPPORTED) {
    print_message("skipping %s: %s\n", variant, why);
    skip();
  }
  assert_int_equal(rc, 0);
  fps_pool_t *pool = NULL;
  if (threads > 1) assert_int_equal(fps_pool_create(&pool, threads), 0);

  char **names;
  size_t n;
  assert_int_equal(fps_golden_list(dir, &names, &n, why, sizeof why), 0);
  /* 140 cases are shipped; fewer means the copy is broken, not a pass. */
  assert_true(n >= 140);
  int failed_cases = 0;
  worst_t w = {0};
  for (size_t i = 0; i < n; i++) {
    fps_golden_case_t c;
    fps_golden_run_t run;
    rc = fps_golden_load(dir, names[i], &c, why, sizeof why);
    if (rc) {
      print_error("%s: %s\n", names[i], why);
      failed_cases++;
      continue;
    }
    rc = fps_golden_run(&c, k, pool, &run, why, sizeof why);
    if (rc) {
      print_error("%s: %s\n", names[i], why);
      failed_cases++;
    } else if (check_case(&c, &run, &w)) {
      failed_cases++;
    }
    fps_golden_run_free(&run);
  }
  print_message("%s x%u: %zu cases, %d failed; worst param scaled %.2e, upd-rel %.2e, "
                "state rel %.2e, mom scaled %.2e\n",
                variant, threads, n, failed_cases, w.param_scaled, w.upd_rel, w.state_rel,
                w.mom_scaled);
  fps_golden_list_free(names, n);
  fps_pool_destroy(pool);
  assert_int_equal(failed_cases, 0);
}

static void golden_scalar(void **u) { (void)u; replay_all("scalar", 1); }
#if defined(__x86_64__)
static void golden_avx2(void **u) { (void)u; replay_all("avx2", 1); }
#endif
#if defined(__x86_64__)
static void golden_avx512(void **u) { (void)u; replay_all("avx512", 1); }
#endif
#if defined(__aarch64__)
static void golden_neon(void **u) { (void)u; replay_all("neon", 1); }
#endif
/* Small cases run on one chunk, so this mostly checks the pool plumbing. */
static void golden_best_threads(void **u) {
  (void)u;
  /* qemu-user 7.2 hangs in pthread_create here (see tests/unit/common/CMakeLists.txt) */
  const char *e = getenv("FPS_TEST_NO_THREADS");
  if (e && *e && strcmp(e, "0")) skip();
  replay_all(fps_kernels_name(fps_kernels_best()), 3);
}

#ifdef FPS_HAVE_CJSON
static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)len + 1);
  if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
    free(buf);
    buf = NULL;
  }
  if (buf) buf[len] = 0;
  fclose(f);
  return buf;
}
#endif

/* index.json's state_elements / adamw_state_elements are what the shards
 * publish; our state_size must give the same figures for every case. */
static void state_sizes_match_index(void **u) {
  (void)u;
#ifndef FPS_HAVE_CJSON
  skip();
#else
  const char *dir = vectors_dir();
  assert_non_null(dir);
  char path[4096], why[512];
  snprintf(path, sizeof path, "%s/index.json", dir);
  char *text = slurp(path);
  assert_non_null(text);
  cJSON *root = cJSON_Parse(text);
  free(text);
  assert_non_null(root);
  cJSON *cases = cJSON_GetObjectItemCaseSensitive(root, "cases");
  assert_true(cJSON_IsArray(cases));
  int checked = 0;
  cJSON *cj;
  cJSON_ArrayForEach(cj, cases) {
    const char *name = cJSON_GetObjectItemCaseSensitive(cj, "name")->valuestring;
    fps_golden_case_t c;
    assert_int_equal(fps_golden_load(dir, name, &c, why, sizeof why), 0);
    fps_state_size_t sz;
    assert_int_equal(fps_adafactor_state_size(&c.shape, &c.hp, &sz), 0);
    double se = cJSON_GetObjectItemCaseSensitive(cj, "state_elements")->valuedouble;
    double ae = cJSON_GetObjectItemCaseSensitive(cj, "adamw_state_elements")->valuedouble;
    if ((double)sz.elements != se || (double)sz.adamw_elements != ae)
      print_error("%s: state %llu vs %.0f, adamw %llu vs %.0f\n", name,
                  (unsigned long long)sz.elements, se, (unsigned long long)sz.adamw_elements, ae);
    assert_true((double)sz.elements == se);
    assert_true((double)sz.adamw_elements == ae);
    assert_int_equal(sz.bytes, 4 * sz.elements);
    assert_int_equal(sz.adamw_bytes, 4 * sz.adamw_elements);
    /* the hparams.txt "state" line names exactly the kinds we allocate */
    assert_int_equal(sz.row != 0, c.state_listed[FPS_GOLDEN_ROW]);
    assert_int_equal(sz.col != 0, c.state_listed[FPS_GOLDEN_COL]);
    assert_int_equal(sz.var != 0, c.state_listed[FPS_GOLDEN_VAR]);
    assert_int_equal(sz.mom != 0, c.state_listed[FPS_GOLDEN_MOM]);
    checked++;
  }
  cJSON_Delete(root);
  assert_true(checked >= 140);
#endif
}

/* The per-step scalars against index.json's trace: RMS(param), RMS(U)
 * (which the kernel gets from the fused S_j sums, never from U itself),
 * the clip denominator and the lr. Relative tolerance 1e-5 (the float32
 * state rounding is the only difference from the float64 reference). Also
 * the final step count and hf's stored RMS. */
static void traces_match_index(void **u) {
  (void)u;
#ifndef FPS_HAVE_CJSON
  skip();
#else
  const char *dir = vectors_dir();
  assert_non_null(dir);
  char path[4096], why[512];
  snprintf(path, sizeof path, "%s/index.json", dir);
  char *text = slurp(path);
  assert_non_null(text);
  cJSON *root = cJSON_Parse(text);
  free(text);
  assert_non_null(root);
  int bad = 0, checked = 0;
  double worst = 0;
  cJSON *cj;
  cJSON_ArrayForEach(cj, cJSON_GetObjectItemCaseSensitive(root, "cases")) {
    const char *name = cJSON_GetObjectItemCaseSensitive(cj, "name")->valuestring;
    fps_golden_case_t c;
    fps_golden_run_t run;
    assert_int_equal(fps_golden_load(dir, name, &c, why, sizeof why), 0);
    assert_int_equal(fps_golden_run(&c, NULL, NULL, &run, why, sizeof why), 0);
    const bool hf = c.hp.flavor == FPS_FLAVOR_HF;
    cJSON *steps = cJSON_GetObjectItemCaseSensitive(cj, "trace");
    unsigned t = 0;
    cJSON *st;
    cJSON_ArrayForEach(st, steps) {
      const fps_adafactor_trace_t *tr = &run.trace[t++];
      const struct {
        const char *key;
        double mine;
      } f[] = {
          {"rms_param", tr->rms_param},
          {"rms_update", tr->rms_update},
          {"clip_denom", tr->clip_denom},
          {hf ? "lr" : "alpha", tr->lr},
          {hf ? "rel_step_sz" : "rho_t", tr->rel_step},
      };
      for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        cJSON *v = cJSON_GetObjectItemCaseSensitive(st, f[i].key);
        if (!cJSON_IsNumber(v)) continue;
        double ref = v->valuedouble, err = fabs(f[i].mine - ref) / fmax(fabs(ref), 1e-30);
        if (err > worst) worst = err;
        if (err > 1e-5) {
          print_error("%s step %u: %s %.9g vs %.9g\n", name, t, f[i].key, f[i].mine, ref);
          bad++;
        }
      }
    }
    assert_int_equal(t, c.steps);
    cJSON *sc = cJSON_GetObjectItemCaseSensitive(cj, "state_scalars");
    assert_true(run.state.step == (uint64_t)cJSON_GetObjectItemCaseSensitive(sc, "step")->valuedouble);
    if (hf) {
      double ref = cJSON_GetObjectItemCaseSensitive(sc, "RMS")->valuedouble;
      assert_true(fabs(run.state.rms - ref) <= 1e-6 * fmax(fabs(ref), 1e-30));
    }
    fps_golden_run_free(&run);
    checked++;
  }
  cJSON_Delete(root);
  print_message("%d cases' traces, worst relative error %.2e\n", checked, worst);
  assert_int_equal(bad, 0);
#endif
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(golden_scalar),
  /* A variant that cannot exist in this build is not a case at all; only
   * an ISA the CPU may lack at run time (AVX-512) skips. */
#if defined(__x86_64__)
      cmocka_unit_test(golden_avx2),         cmocka_unit_test(golden_avx512),
#endif
#if defined(__aarch64__)
      cmocka_unit_test(golden_neon),
#endif
      cmocka_unit_test(golden_best_threads),
      cmocka_unit_test(state_sizes_match_index),
      cmocka_unit_test(traces_match_index),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

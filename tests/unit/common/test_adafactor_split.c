/* Row-split Adafactor (common/adafactor_split.h).
 *
 * Every golden case whose tensor has >= 2 rows (flattened M*R rows, or
 * elements for 0/1-D) is cut into 2, 3 and 4 blocks (three layouts: a
 * first block of one row, a last block of one row, and boundaries off the
 * matrix boundaries so blocks span matrices where the shape allows), and
 * each step goes through what the shards will do: pass A per block, the
 * partials encoded, decoded by every other block, combined (in block order)
 * by every block on its own, the torch explicit U^2 phase where due, then
 * pass C (in place on odd steps, out of place into the gradient buffer on
 * even ones, the params read left untouched). The reassembled params and
 * state are checked, for every SIMD variant this machine has:
 *   against the golden files, with check_vectors.py's metrics/tolerances
 *     param scaled  max|d| / max(max|ref_t|, max|ref_t - ref_t-1|)  <= 1e-5
 *     param upd-rel max|d| / max|ref_t - ref_t-1| (updates >= 1e-3 max|ref|) <= 1e-3
 *     state rel     max|d| / max(|ref|, 1e-6 max|ref|)  row/col/var   <= 1e-4
 *     mom scaled    max|d| / max|ref|                                 <= 1e-5
 *     non-finite values equal;
 *   against fps_adafactor_step on the whole tensor (same kernels, same
 *     input), with the same metrics and tolerances;
 *   and for agreement between blocks: every block's copy of a shared
 *     matrix's column state, its step count and hf RMS are bit-identical.
 * Then the error paths: geometry, block maps, the partials' wire form, and
 * combine refusing partials that do not tile the tensor or disagree. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "adafactor.h"
#include "adafactor_split.h"
#include "alloc.h"
#include "golden.h"
#include "simd/kernels.h"

#define PTOL 1e-5
#define UTOL 1e-3
#define STOL 1e-4
#define MAXB 4

static const char *vectors_dir(void) {
  const char *d = getenv("FPS_VECTORS_DIR");
  return d && *d ? d : NULL;
}

typedef struct worst_s {
  double param_scaled, upd_rel, state_rel, mom_scaled;
} worst_t;

/* ---- metrics (check_vectors.py's) -------------------------------------- */

static int nonfinite_mismatches(const float *impl, const float *ref, uint64_t n, double *maxd,
                                double *maxref) {
  int bad = 0;
  *maxd = 0;
  *maxref = 0;
  for (uint64_t i = 0; i < n; i++) {
    bool fi = isfinite(impl[i]), fr = isfinite(ref[i]);
    if (!fi || !fr) {
      if (!(!fi && !fr && ((isnan(impl[i]) && isnan(ref[i])) || impl[i] == ref[i]))) bad++;
      continue;
    }
    double d = fabs((double)impl[i] - ref[i]), r = fabs((double)ref[i]);
    if (d > *maxd) *maxd = d;
    if (r > *maxref) *maxref = r;
  }
  return bad;
}

/* Params after each step: impl and ref are steps x n, prev0 the initial. */
static int check_params(const char *what, const float *impl, const float *ref, const float *prev0,
                        uint64_t n, unsigned steps, worst_t *w) {
  int fails = 0;
  for (unsigned t = 0; t < steps; t++) {
    const float *im = impl + t * n, *rf = ref + t * n, *pv = t ? ref + (t - 1) * n : prev0;
    double maxd, maxref, upd = 0;
    if (nonfinite_mismatches(im, rf, n, &maxd, &maxref)) {
      print_error("%s step %u: non-finite mismatch\n", what, t + 1);
      fails++;
    }
    for (uint64_t i = 0; i < n; i++) {
      double u = fabs((double)rf[i] - pv[i]);
      if (u > upd) upd = u;
    }
    double den = maxref > upd ? maxref : upd;
    double sc = den > 0 ? maxd / den : (maxd == 0 ? 0 : INFINITY);
    if (sc > w->param_scaled) w->param_scaled = sc;
    if (sc > PTOL) {
      print_error("%s step %u: param scaled err %.3e > %g\n", what, t + 1, sc, PTOL);
      fails++;
    }
    if (upd > 0 && upd >= 1e-3 * maxref) {
      double ur = maxd / upd;
      if (ur > w->upd_rel) w->upd_rel = ur;
      if (ur > UTOL) {
        print_error("%s step %u: param err / update %.3e > %g\n", what, t + 1, ur, UTOL);
        fails++;
      }
    }
  }
  return fails;
}

static int check_state(const char *what, int kind, const float *impl, const float *ref,
                       uint64_t n, worst_t *w) {
  double maxd, maxref;
  int fails = 0;
  if (nonfinite_mismatches(impl, ref, n, &maxd, &maxref)) {
    print_error("%s state %s: non-finite mismatch\n", what, fps_golden_state_names[kind]);
    fails++;
  }
  if (kind == FPS_GOLDEN_MOM) {
    double sc = maxref > 0 ? maxd / maxref : (maxd == 0 ? 0 : INFINITY);
    if (sc > w->mom_scaled) w->mom_scaled = sc;
    if (sc > PTOL) {
      print_error("%s state mom: scaled err %.3e > %g\n", what, sc, PTOL);
      fails++;
    }
    return fails;
  }
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
  if (worst > w->state_rel) w->state_rel = worst;
  if (worst > STOL) {
    print_error("%s state %s: rel err %.3e > %g\n", what, fps_golden_state_names[kind], worst,
                STOL);
    fails++;
  }
  return fails;
}

/* ---- block layouts ------------------------------------------------------ */

/* bounds[0..nb] for N rows of R rows per matrix (R = N for 0/1-D):
 *   layout 0: a first block of one row, the rest growing (1, 2, 3 parts);
 *   layout 1: the mirror image, a last block of one row;
 *   layout 2: boundaries chosen off the matrix boundaries where possible,
 *             so blocks span matrices (falls back to layout 0). */
static void make_bounds(uint64_t N, uint64_t R, size_t nb, int layout, uint64_t *b) {
  b[0] = 0;
  b[nb] = N;
  if (layout == 2) {
    uint64_t cand[1024];
    size_t nc = 0;
    for (uint64_t r = 1; r < N && nc < 1024; r++)
      if (r % R != 0 || R == N) cand[nc++] = r;
    if (nc >= nb - 1) {
      for (size_t k = 1; k < nb; k++) b[k] = cand[k * nc / nb];
      return;
    }
    layout = 0;
  }
  uint64_t fwd[MAXB + 1];
  fwd[0] = 0;
  fwd[1] = 1;
  fwd[nb] = N;
  size_t tot = 0;
  for (size_t i = 1; i < nb; i++) tot += i;
  size_t cum = 0;
  for (size_t k = 2; k < nb; k++) {
    cum += k - 1;
    uint64_t v = 1 + (N - 1) * cum / tot;
    if (v <= fwd[k - 1]) v = fwd[k - 1] + 1;
    if (v > N - (nb - k)) v = N - (nb - k);
    fwd[k] = v;
  }
  for (size_t k = 0; k <= nb; k++) b[k] = layout == 1 ? N - fwd[nb - k] : fwd[k];
}

/* ---- one split run of a golden case ------------------------------------ */

typedef struct split_run_s {
  float *params;          /* steps x numel */
  float *state[FPS_GOLDEN_NSTATE];
  uint64_t state_n[FPS_GOLDEN_NSTATE];
  uint64_t step;
  float rms;
  unsigned u2_steps;      /* steps that needed the explicit U^2 phase */
} split_run_t;

static void split_run_free(split_run_t *r) {
  free(r->params);
  for (int k = 0; k < FPS_GOLDEN_NSTATE; k++) free(r->state[k]);
  memset(r, 0, sizeof *r);
}

/* Exchanges one phase's partials like the shards will: each block encodes
 * its own, every block decodes the others' (against the geometry it
 * expects) and combines them with its own in block order. */
static void exchange(const fps_split_geom_t *geo, fps_split_step_t **steps, size_t nb, int phase) {
  const fps_split_partials_t *own[MAXB];
  unsigned char *wire[MAXB];
  size_t len[MAXB];
  for (size_t b = 0; b < nb; b++) {
    own[b] = phase == FPS_SPLIT_PHASE_STATS ? fps_split_step_partials(steps[b])
                                            : fps_split_step_u2(steps[b]);
    assert_non_null(own[b]);
    size_t sz = fps_split_partials_size(&geo[b], phase);
    assert_true(sz >= FPS_SPLIT_PARTIALS_HEADER);
    wire[b] = malloc(sz);
    assert_non_null(wire[b]);
    len[b] = fps_split_partials_encode(own[b], wire[b], sz);
    assert_int_equal(len[b], sz);
    assert_int_equal(fps_split_partials_encode(own[b], wire[b], sz - 1), 0);
  }
  for (size_t me = 0; me < nb; me++) {
    fps_split_partials_t parts[MAXB];
    char why[512] = "";
    for (size_t b = 0; b < nb; b++) {
      if (b == me) {
        parts[b] = *own[b];
        continue;
      }
      int rc = fps_split_partials_decode(wire[b], len[b], &geo[b], phase, &parts[b], why,
                                         sizeof why);
      if (rc) print_error("decode block %zu: %s\n", b, why);
      assert_int_equal(rc, 0);
    }
    int rc = phase == FPS_SPLIT_PHASE_STATS
                 ? fps_split_step_combine(steps[me], parts, nb, why, sizeof why)
                 : fps_split_step_combine_u2(steps[me], parts, nb, why, sizeof why);
    if (rc) print_error("combine on block %zu: %s\n", me, why);
    assert_int_equal(rc, 0);
    for (size_t b = 0; b < nb; b++)
      if (b != me) fps_split_partials_free(&parts[b]);
  }
  for (size_t b = 0; b < nb; b++) free(wire[b]);
}

static void split_run(const fps_golden_case_t *c, const fps_kernels_t *k, fps_pool_t *pool,
                      const uint64_t *bounds, size_t nb, split_run_t *out) {
  const uint64_t n = c->numel;
  memset(out, 0, sizeof *out);
  out->params = malloc(c->steps * n * sizeof(float));
  float *param = malloc(n * sizeof(float)), *grad = malloc(n * sizeof(float));
  float *keep = malloc(n * sizeof(float));
  assert_non_null(keep);
  assert_non_null(out->params);
  assert_non_null(param);
  assert_non_null(grad);
  char path[8192], why[512];
  snprintf(path, sizeof path, "%s/param_0.bin", c->dir);
  assert_int_equal(fps_golden_read_f32(path, param, n, why, sizeof why), 0);

  fps_split_geom_t geo[MAXB];
  fps_split_state_t st[MAXB];
  for (size_t b = 0; b < nb; b++) {
    assert_int_equal(fps_split_geom_init(&geo[b], &c->shape, bounds[b], bounds[b + 1], why,
                                         sizeof why), 0);
    assert_int_equal(fps_split_state_init(&st[b], &geo[b], &c->hp), 0);
  }
  for (unsigned t = 1; t <= c->steps; t++) {
    snprintf(path, sizeof path, "%s/grad_%u.bin", c->dir, t);
    assert_int_equal(fps_golden_read_f32(path, grad, n, why, sizeof why), 0);
    fps_split_step_t *steps[MAXB];
    for (size_t b = 0; b < nb; b++) {
      uint64_t off = geo[b].row_lo * geo[b].cols;
      assert_int_equal(fps_split_step_begin(k, &c->hp, &st[b], param + off, grad + off, pool,
                                            &steps[b]), 0);
      /* nothing moves before the partials are combined */
      assert_int_equal(fps_split_step_apply(steps[b], NULL), FPS_EINVAL);
    }
    exchange(geo, steps, nb, FPS_SPLIT_PHASE_STATS);
    bool u2 = fps_split_step_needs_u2(steps[0]);
    for (size_t b = 1; b < nb; b++) assert_int_equal(fps_split_step_needs_u2(steps[b]), u2);
    if (u2) {
      out->u2_steps++;
      exchange(geo, steps, nb, FPS_SPLIT_PHASE_U2);
    }
    fps_adafactor_trace_t tr0 = {0};
    /* even steps apply out of place into the gradient buffer (the
     * shard's way), reading param only; odd steps in place */
    const bool to_grad = t % 2 == 0;
    if (to_grad) memcpy(keep, param, n * sizeof(float));
    for (size_t b = 0; b < nb; b++) {
      fps_adafactor_trace_t tr;
      uint64_t off = geo[b].row_lo * geo[b].cols;
      if (to_grad) {
        assert_int_equal(fps_split_step_apply_to(steps[b], NULL, NULL), FPS_EINVAL);
        assert_int_equal(fps_split_step_apply_to(steps[b], grad + off, &tr), 0);
      } else {
        assert_int_equal(fps_split_step_apply(steps[b], &tr), 0);
      }
      if (b == 0) tr0 = tr;
      /* every block computed the same whole-tensor scalars */
      assert_memory_equal(&tr.step_size, &tr0.step_size, sizeof(double));
      assert_memory_equal(&tr.rms_param, &tr0.rms_param, sizeof(double));
      assert_int_equal(fps_split_step_apply(steps[b], NULL), FPS_EINVAL);
      fps_split_step_free(steps[b]);
    }
    if (to_grad) {
      assert_memory_equal(keep, param, n * sizeof(float));
      memcpy(param, grad, n * sizeof(float));
    }
    memcpy(out->params + (t - 1) * n, param, n * sizeof(float));
  }

  /* Reassemble the state; shared column state must be bit-identical. */
  const fps_split_geom_t *g0 = &geo[0];
  out->step = st[0].step;
  out->rms = st[0].rms;
  for (size_t b = 1; b < nb; b++) {
    assert_int_equal(st[b].step, out->step);
    assert_memory_equal(&st[b].rms, &out->rms, sizeof(float));
  }
  if (g0->factored) {
    const uint64_t C = g0->cols, M = g0->batch, R = g0->rows;
    out->state_n[FPS_GOLDEN_ROW] = M * R;
    out->state_n[FPS_GOLDEN_COL] = M * C;
    out->state[FPS_GOLDEN_ROW] = malloc(M * R * sizeof(float));
    out->state[FPS_GOLDEN_COL] = malloc(M * C * sizeof(float));
    assert_non_null(out->state[FPS_GOLDEN_ROW]);
    assert_non_null(out->state[FPS_GOLDEN_COL]);
    bool have[64 * 1024] = {false};
    assert_true(M <= sizeof have);
    for (size_t b = 0; b < nb; b++) {
      memcpy(out->state[FPS_GOLDEN_ROW] + geo[b].row_lo, st[b].row,
             (geo[b].row_hi - geo[b].row_lo) * sizeof(float));
      for (uint64_t lm = 0; lm < geo[b].nmat; lm++) {
        uint64_t mtx = geo[b].mtx_lo + lm;
        float *dst = out->state[FPS_GOLDEN_COL] + mtx * C;
        if (have[mtx])
          assert_memory_equal(dst, st[b].col + lm * C, C * sizeof(float));
        else
          memcpy(dst, st[b].col + lm * C, C * sizeof(float));
        have[mtx] = true;
      }
    }
  } else {
    out->state_n[FPS_GOLDEN_VAR] = n;
    out->state[FPS_GOLDEN_VAR] = malloc(n * sizeof(float));
    assert_non_null(out->state[FPS_GOLDEN_VAR]);
    for (size_t b = 0; b < nb; b++)
      memcpy(out->state[FPS_GOLDEN_VAR] + geo[b].row_lo, st[b].var,
             geo[b].block_numel * sizeof(float));
  }
  if (st[0].mom) {
    out->state_n[FPS_GOLDEN_MOM] = n;
    out->state[FPS_GOLDEN_MOM] = malloc(n * sizeof(float));
    assert_non_null(out->state[FPS_GOLDEN_MOM]);
    for (size_t b = 0; b < nb; b++)
      memcpy(out->state[FPS_GOLDEN_MOM] + geo[b].row_lo * geo[b].cols, st[b].mom,
             geo[b].block_numel * sizeof(float));
  }
  for (size_t b = 0; b < nb; b++) fps_split_state_destroy(&st[b]);
  free(param);
  free(grad);
  free(keep);
}

/* Checks one split run against the golden files and the unsplit run. */
static int check_split(const fps_golden_case_t *c, const split_run_t *sr,
                       const fps_golden_run_t *whole, const char *label, worst_t *wg,
                       worst_t *wu) {
  const uint64_t n = c->numel;
  int fails = 0;
  char path[8192], why[512], what[512];
  float *ref = malloc(c->steps * n * sizeof(float)), *p0 = malloc(n * sizeof(float));
  assert_non_null(ref);
  assert_non_null(p0);
  snprintf(path, sizeof path, "%s/param_0.bin", c->dir);
  assert_int_equal(fps_golden_read_f32(path, p0, n, why, sizeof why), 0);
  for (unsigned t = 1; t <= c->steps; t++) {
    snprintf(path, sizeof path, "%s/param_%u.bin", c->dir, t);
    assert_int_equal(fps_golden_read_f32(path, ref + (t - 1) * n, n, why, sizeof why), 0);
  }
  snprintf(what, sizeof what, "%s %s vs golden", c->name, label);
  fails += check_params(what, sr->params, ref, p0, n, c->steps, wg);
  snprintf(what, sizeof what, "%s %s vs unsplit", c->name, label);
  fails += check_params(what, sr->params, whole->params, p0, n, c->steps, wu);
  for (int kind = 0; kind < FPS_GOLDEN_NSTATE; kind++) {
    uint64_t wn;
    const float *wa = fps_golden_state_array(whole, kind, &wn);
    if (!c->state_listed[kind] || !wa) {
      if (sr->state[kind] || c->state_listed[kind] != (wa != NULL)) {
        print_error("%s %s: state %s present where the reference lacks it\n", c->name, label,
                    fps_golden_state_names[kind]);
        fails++;
      }
      continue;
    }
    if (!sr->state[kind] || sr->state_n[kind] != wn) {
      print_error("%s %s: state %s missing\n", c->name, label, fps_golden_state_names[kind]);
      fails++;
      continue;
    }
    float *sref = malloc(wn * sizeof(float));
    assert_non_null(sref);
    snprintf(path, sizeof path, "%s/state_%s.bin", c->dir, fps_golden_state_names[kind]);
    assert_int_equal(fps_golden_read_f32(path, sref, wn, why, sizeof why), 0);
    snprintf(what, sizeof what, "%s %s vs golden", c->name, label);
    fails += check_state(what, kind, sr->state[kind], sref, wn, wg);
    snprintf(what, sizeof what, "%s %s vs unsplit", c->name, label);
    fails += check_state(what, kind, sr->state[kind], wa, wn, wu);
    free(sref);
  }
  if (sr->step != whole->state.step) {
    print_error("%s %s: step %llu, unsplit %llu\n", c->name, label,
                (unsigned long long)sr->step, (unsigned long long)whole->state.step);
    fails++;
  }
  if (c->hp.flavor == FPS_FLAVOR_HF &&
      !(fabs(sr->rms - whole->state.rms) <= 1e-6 * fmax(fabs(whole->state.rms), 1e-30))) {
    print_error("%s %s: RMS %.9g, unsplit %.9g\n", c->name, label, sr->rms, whole->state.rms);
    fails++;
  }
  free(ref);
  free(p0);
  return fails;
}

static void golden_split(const char *variant, unsigned threads) {
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
  assert_true(n >= 140);
  int failed = 0, cases = 0, runs = 0, spanning = 0, single = 0;
  unsigned u2_steps = 0;
  worst_t wg = {0}, wu = {0};
  for (size_t i = 0; i < n; i++) {
    fps_golden_case_t c;
    assert_int_equal(fps_golden_load(dir, names[i], &c, why, sizeof why), 0);
    const uint64_t N = fps_split_total_rows(&c.shape);
    if (N < 2) continue;
    const uint64_t R = c.shape.ndim >= 2 ? c.shape.dim[c.shape.ndim - 2] : N;
    fps_golden_run_t whole;
    rc = fps_golden_run(&c, k, NULL, &whole, why, sizeof why);
    if (rc) print_error("%s: %s\n", c.name, why);
    assert_int_equal(rc, 0);
    cases++;
    int case_fails = 0;
    for (size_t nb = 2; nb <= MAXB && nb <= N; nb++) {
      for (int layout = 0; layout < 3; layout++) {
        uint64_t bounds[MAXB + 1];
        make_bounds(N, R, nb, layout, bounds);
        assert_int_equal(fps_split_bounds_validate(&c.shape, bounds, nb, why, sizeof why), 0);
        for (size_t b = 0; b < nb; b++) {
          if (bounds[b + 1] - bounds[b] == 1) single++;
          if (c.shape.ndim >= 3 && bounds[b] / R != (bounds[b + 1] - 1) / R) spanning++;
        }
        split_run_t sr;
        split_run(&c, k, pool, bounds, nb, &sr);
        char label[128];
        snprintf(label, sizeof label, "%zu blocks (layout %d)", nb, layout);
        case_fails += check_split(&c, &sr, &whole, label, &wg, &wu);
        u2_steps += sr.u2_steps;
        runs++;
        split_run_free(&sr);
      }
    }
    if (case_fails) failed++;
    fps_golden_run_free(&whole);
  }
  print_message("%s x%u: %d cases, %d split runs (%d one-row blocks, %d blocks spanning "
                "matrices, %u steps with the u2 phase), %d cases failed\n"
                "  vs golden:  worst param scaled %.2e, upd-rel %.2e, state rel %.2e, mom %.2e\n"
                "  vs unsplit: worst param scaled %.2e, upd-rel %.2e, state rel %.2e, mom %.2e\n",
                variant, threads, cases, runs, single, spanning, u2_steps, failed,
                wg.param_scaled, wg.upd_rel, wg.state_rel, wg.mom_scaled, wu.param_scaled,
                wu.upd_rel, wu.state_rel, wu.mom_scaled);
  fps_golden_list_free(names, n);
  fps_pool_destroy(pool);
  /* The shipped vectors have 90 cases with >= 2 rows (shapes (7,), (3,5),
   * (2,3,4), (64,33), (128,256)); fewer means a broken copy. The
   * layouts must reach single-row blocks, spanning blocks and the torch
   * clamp's explicit phase, or the test is not testing them. */
  assert_true(cases >= 90);
  assert_true(single > 0 && spanning > 0 && u2_steps > 0);
  assert_int_equal(failed, 0);
}

static void split_scalar(void **u) { (void)u; golden_split("scalar", 1); }
#if defined(__x86_64__)
static void split_avx2(void **u) { (void)u; golden_split("avx2", 1); }
static void split_avx512(void **u) { (void)u; golden_split("avx512", 1); }
#endif
#if defined(__aarch64__)
static void split_neon(void **u) { (void)u; golden_split("neon", 1); }
#endif
static void split_best_threads(void **u) {
  (void)u;
  const char *e = getenv("FPS_TEST_NO_THREADS");
  if (e && *e && strcmp(e, "0")) skip();
  golden_split(fps_kernels_name(fps_kernels_best()), 3);
}

/* ---- resharding ---------------------------------------------------------- */

static fps_shape_t shape3(uint64_t a, uint64_t b, uint64_t c) {
  fps_shape_t s = {.ndim = 3, .dim = {a, b, c}};
  return s;
}


/* One step of nb blocks through the wire form, as split_run does. */
static void step_blocks(const fps_golden_case_t *c, const fps_kernels_t *k, fps_split_state_t *st,
                        const fps_split_geom_t *geo, size_t nb, float *param, const float *grad) {
  fps_split_step_t *steps[MAXB];
  for (size_t b = 0; b < nb; b++) {
    uint64_t off = geo[b].row_lo * geo[b].cols;
    assert_int_equal(fps_split_step_begin(k, &c->hp, &st[b], param + off, grad + off, NULL,
                                          &steps[b]), 0);
  }
  exchange(geo, steps, nb, FPS_SPLIT_PHASE_STATS);
  if (fps_split_step_needs_u2(steps[0])) exchange(geo, steps, nb, FPS_SPLIT_PHASE_U2);
  for (size_t b = 0; b < nb; b++) {
    assert_int_equal(fps_split_step_apply(steps[b], NULL), 0);
    fps_split_step_free(steps[b]);
  }
}

/* Resharding, in the math: every golden case with >= 3 rows
 * runs steps 1-2 whole, then its state is cut into 2 blocks (step 3), 3
 * blocks (step 4) and 2 blocks again (step 5), each time gathered into a
 * whole state and cut anew (fps_split_state_to_whole / _from_whole); the
 * params after every step and the final gathered state must match the
 * uninterrupted whole run with the golden metrics (param scaled <= 1e-5,
 * state rel <= 1e-4, mom scaled <= 1e-5). */
static void reshard_mid_run_matches_whole(void **u) {
  (void)u;
  const char *dir = vectors_dir();
  assert_non_null(dir);
  char **names, why[512], path[8192];
  size_t n;
  assert_int_equal(fps_golden_list(dir, &names, &n, why, sizeof why), 0);
  int cases = 0, fails = 0;
  worst_t w = {0};
  for (size_t i = 0; i < n; i++) {
    fps_golden_case_t c;
    assert_int_equal(fps_golden_load(dir, names[i], &c, why, sizeof why), 0);
    const uint64_t N = fps_split_total_rows(&c.shape);
    if (N < 3) continue;
    const uint64_t R = c.shape.ndim >= 2 ? c.shape.dim[c.shape.ndim - 2] : N;
    fps_golden_run_t whole_run;
    assert_int_equal(fps_golden_run(&c, NULL, NULL, &whole_run, why, sizeof why), 0);
    const uint64_t ne = c.numel;
    float *param = malloc(ne * sizeof(float)), *grad = malloc(ne * sizeof(float));
    float *params = malloc(c.steps * ne * sizeof(float)), *p0 = malloc(ne * sizeof(float));
    assert_true(param && grad && params && p0);
    snprintf(path, sizeof path, "%s/param_0.bin", c.dir);
    assert_int_equal(fps_golden_read_f32(path, param, ne, why, sizeof why), 0);
    memcpy(p0, param, ne * sizeof(float));
    fps_adafactor_state_t whole;
    assert_int_equal(fps_adafactor_state_init(&whole, &c.shape, &c.hp), 0);
    const size_t plan[] = {1, 1, 2, 3, 2}; /* blocks per step: 1 = whole */
    for (unsigned t = 1; t <= c.steps; t++) {
      snprintf(path, sizeof path, "%s/grad_%u.bin", c.dir, t);
      assert_int_equal(fps_golden_read_f32(path, grad, ne, why, sizeof why), 0);
      const size_t nb = plan[(t - 1) % 5];
      if (nb == 1) {
        assert_int_equal(fps_adafactor_step(NULL, &c.hp, &whole, param, grad, NULL, NULL), 0);
      } else {
        uint64_t bounds[MAXB + 1];
        make_bounds(N, R, nb, nb == 3 ? 2 : 0, bounds);
        fps_split_geom_t geo[MAXB];
        fps_split_state_t st[MAXB];
        for (size_t b = 0; b < nb; b++) {
          assert_int_equal(fps_split_geom_init(&geo[b], &c.shape, bounds[b], bounds[b + 1], NULL,
                                               0), 0);
          assert_int_equal(fps_split_state_init(&st[b], &geo[b], &c.hp), 0);
          assert_int_equal(fps_split_state_from_whole(&st[b], &whole), 0);
        }
        step_blocks(&c, NULL, st, geo, nb, param, grad);
        for (size_t b = 0; b < nb; b++) {
          assert_int_equal(fps_split_state_to_whole(&st[b], &whole), 0);
          fps_split_state_destroy(&st[b]);
        }
      }
      memcpy(params + (t - 1) * ne, param, ne * sizeof(float));
    }
    fails += check_params(c.name, params, whole_run.params, p0, ne, c.steps, &w);
    for (int kind = 0; kind < FPS_GOLDEN_NSTATE; kind++) {
      uint64_t an, bn;
      const float *a = fps_golden_state_array(&whole_run, kind, &an);
      fps_golden_run_t mine = {.state = whole};
      const float *b = fps_golden_state_array(&mine, kind, &bn);
      assert_int_equal(a != NULL, b != NULL);
      if (a) fails += check_state(c.name, kind, b, a, an, &w);
    }
    assert_int_equal(whole.step, whole_run.state.step);
    assert_memory_equal(&whole.rms, &whole_run.state.rms, sizeof(float));
    fps_adafactor_state_destroy(&whole);
    fps_golden_run_free(&whole_run);
    free(param);
    free(grad);
    free(params);
    free(p0);
    cases++;
  }
  fps_golden_list_free(names, n);
  print_message("resharded 1 -> 2 -> 3 -> 2 blocks mid-run: %d cases; worst vs whole: param "
                "scaled %.2e, state rel %.2e, mom %.2e\n",
                cases, w.param_scaled, w.state_rel, w.mom_scaled);
  assert_true(cases >= 90);
  assert_int_equal(fails, 0);
}

static void state_copies_refuse_other_tensors(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp, mom;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_HF);
  mom = hp;
  mom.has_beta1 = true;
  mom.beta1 = 0.9;
  fps_shape_t s = shape3(2, 3, 4), other = shape3(3, 2, 4);
  fps_split_geom_t g;
  assert_int_equal(fps_split_geom_init(&g, &s, 2, 5, NULL, 0), 0);
  fps_split_state_t st;
  assert_int_equal(fps_split_state_init(&st, &g, &hp), 0);
  fps_adafactor_state_t w_other, w_mom;
  assert_int_equal(fps_adafactor_state_init(&w_other, &other, &hp), 0);
  assert_int_equal(fps_adafactor_state_init(&w_mom, &s, &mom), 0);
  assert_int_equal(fps_split_state_from_whole(&st, &w_other), FPS_EINVAL);
  assert_int_equal(fps_split_state_to_whole(&st, &w_mom), FPS_EINVAL);
  assert_int_equal(fps_split_state_from_whole(&st, NULL), FPS_EINVAL);
  fps_adafactor_state_destroy(&w_other);
  fps_adafactor_state_destroy(&w_mom);
  fps_split_state_destroy(&st);
}

/* ---- error paths --------------------------------------------------------- */

static void geometry_and_bounds(void **u) {
  (void)u;
  char why[256];
  fps_split_geom_t g;
  fps_shape_t s = shape3(2, 3, 4);
  assert_int_equal(fps_split_total_rows(&s), 6);
  assert_int_equal(fps_split_geom_init(&g, &s, 2, 5, why, sizeof why), 0);
  assert_int_equal(g.mtx_lo, 0);
  assert_int_equal(g.nmat, 2);
  assert_int_equal(g.block_numel, 12);
  assert_int_equal(fps_split_geom_init(&g, &s, 3, 6, why, sizeof why), 0);
  assert_int_equal(g.mtx_lo, 1);
  assert_int_equal(g.nmat, 1);
  assert_int_equal(fps_split_geom_init(&g, &s, 4, 4, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "[4, 4)"));
  assert_int_equal(fps_split_geom_init(&g, &s, 0, 7, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "6 rows"));
  fps_shape_t v = {.ndim = 1, .dim = {7}};
  assert_int_equal(fps_split_geom_init(&g, &v, 0, 7, why, sizeof why), 0);
  assert_false(g.factored);
  assert_int_equal(g.block_numel, 7);
  assert_int_equal(fps_split_geom_init(&g, &v, 3, 8, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "7 elements"));
  fps_shape_t bad = {.ndim = 2, .dim = {3, 0}};
  assert_int_equal(fps_split_geom_init(&g, &bad, 0, 1, why, sizeof why), FPS_ESHAPE);

  uint64_t ok[] = {0, 1, 4, 6}, gap[] = {0, 3, 3, 6}, start[] = {1, 3, 6}, end[] = {0, 3, 5};
  assert_int_equal(fps_split_bounds_validate(&s, ok, 3, why, sizeof why), 0);
  assert_int_equal(fps_split_bounds_validate(&s, gap, 3, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "block 1"));
  assert_int_equal(fps_split_bounds_validate(&s, start, 2, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "block 0 starts at row 1"));
  assert_int_equal(fps_split_bounds_validate(&s, end, 2, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "ends at row 5, not at 6"));
  assert_int_equal(fps_split_bounds_validate(&s, ok, 0, why, sizeof why), FPS_EINVAL);
}

/* Two blocks of a [2, 3, 4] tensor, rows [0, 4) and [4, 6): block 0 spans
 * both matrices. */
typedef struct pair_s {
  fps_adafactor_hparams_t hp;
  fps_split_geom_t g[2];
  fps_split_state_t st[2];
  float param[24], grad[24], param0[24];
  fps_split_step_t *s[2];
} pair_t;

static void pair_begin(pair_t *p) {
  memset(p, 0, sizeof *p);
  fps_adafactor_defaults(&p->hp, FPS_FLAVOR_HF);
  fps_shape_t s = shape3(2, 3, 4);
  uint64_t b[] = {0, 4, 6};
  for (int i = 0; i < 24; i++) {
    p->param[i] = p->param0[i] = 0.1f * (float)(i % 7) - 0.3f;
    p->grad[i] = 0.05f * (float)(i % 5) - 0.1f;
  }
  for (int i = 0; i < 2; i++) {
    assert_int_equal(fps_split_geom_init(&p->g[i], &s, b[i], b[i + 1], NULL, 0), 0);
    assert_int_equal(fps_split_state_init(&p->st[i], &p->g[i], &p->hp), 0);
    uint64_t off = b[i] * 4;
    assert_int_equal(fps_split_step_begin(NULL, &p->hp, &p->st[i], p->param + off,
                                          p->grad + off, NULL, &p->s[i]), 0);
  }
}

static void pair_end(pair_t *p) {
  for (int i = 0; i < 2; i++) {
    fps_split_step_free(p->s[i]);
    fps_split_state_destroy(&p->st[i]);
  }
}

static void partials_wire_errors(void **u) {
  (void)u;
  pair_t p;
  pair_begin(&p);
  const fps_split_partials_t *own = fps_split_step_partials(p.s[0]);
  size_t sz = fps_split_partials_size(&p.g[0], FPS_SPLIT_PHASE_STATS);
  assert_int_equal(sz, 64 + 2 * (16 + 20 * 4));
  unsigned char buf[512], bad[512];
  assert_int_equal(fps_split_partials_encode(own, buf, sizeof buf), sz);
  char why[512];
  fps_split_partials_t d;
  /* a round trip gives back the same numbers */
  assert_int_equal(fps_split_partials_decode(buf, sz, &p.g[0], FPS_SPLIT_PHASE_STATS, &d, why,
                                             sizeof why), 0);
  assert_memory_equal(d.colsum, own->colsum, 8 * sizeof(double));
  assert_memory_equal(d.s, own->s, 8 * sizeof(double));
  assert_memory_equal(d.col_old, own->col_old, 8 * sizeof(float));
  assert_memory_equal(d.rsum, own->rsum, 2 * sizeof(double));
  assert_memory_equal(d.rmin, own->rmin, 2 * sizeof(double));
  assert_memory_equal(&d.psq, &own->psq, sizeof(double));
  fps_split_partials_free(&d);

  struct {
    size_t at, len;
    unsigned char val;
    int rc;
    const char *msg;
  } cases[] = {
      {0, sz, 'X', FPS_EFORMAT, "magic"},
      {4, sz, 2, FPS_EPROTO, "version 2"},
      {5, sz, 2, FPS_EPROTO, "phase 2 (u2)"},
      {6, sz, 3, FPS_EFORMAT, "kind 3"},
      {7, sz, 1, FPS_EFORMAT, "reserved"},
      {8, sz, 1, FPS_EPROTO, "rows [1, 4)"},  /* row_lo */
      {24, sz, 5, FPS_EPROTO, "5 columns"},
      {0, sz - 1, 0, FPS_EFORMAT, "expected"},
      {0, 63, 0, FPS_EFORMAT, "header"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    memcpy(bad, buf, sz);
    if (cases[i].val) bad[cases[i].at] = cases[i].val;
    int rc = fps_split_partials_decode(bad, cases[i].len, &p.g[0], FPS_SPLIT_PHASE_STATS, &d,
                                       why, sizeof why);
    if (rc != cases[i].rc || !strstr(why, cases[i].msg))
      print_error("case %zu: rc %d, '%s'\n", i, rc, why);
    assert_int_equal(rc, cases[i].rc);
    assert_non_null(strstr(why, cases[i].msg));
    assert_null(d.owned);
  }
  /* the geometry-free check (what a shard runs before it looks the tensor
   * up) accepts the real thing and rejects a header that lies about the
   * length, including sizes that would overflow */
  fps_split_partials_t h;
  assert_int_equal(fps_split_partials_check(buf, sz, FPS_SPLIT_PHASE_STATS, &h, why, sizeof why),
                   0);
  assert_int_equal(h.row_hi, 4);
  assert_int_equal(h.nmat, 2);
  assert_null(h.colsum);
  struct {
    size_t at;
    uint64_t val;
    const char *msg;
  } hcases[] = {
      {16, 0, "rows [0, 0) are empty"},
      {24, 0, "both must be >= 1"},
      {40, 3, "do not match their header (3 matrices of 4 columns: 352 bytes)"},
      {24, UINT64_C(1) << 62, "do not match"},
      /* All ones reads as 2^64 - 1, and the size it implies in words. */
      {24, UINT64_MAX, "(2 matrices of 2^64 - 1 columns: more than 2^64 bytes)"},
      {40, UINT64_MAX / 96, "do not match"},
  };
  for (size_t i = 0; i < sizeof hcases / sizeof hcases[0]; i++) {
    memcpy(bad, buf, sz);
    for (int k = 0; k < 8; k++) bad[hcases[i].at + k] = (unsigned char)(hcases[i].val >> (8 * k));
    int rc = fps_split_partials_check(bad, sz, FPS_SPLIT_PHASE_STATS, &h, why, sizeof why);
    if (rc != FPS_EFORMAT || !strstr(why, hcases[i].msg))
      print_error("header case %zu: rc %d, '%s'\n", i, rc, why);
    assert_int_equal(rc, FPS_EFORMAT);
    assert_non_null(strstr(why, hcases[i].msg));
  }
  /* a NaN, Inf or negative sum (but S, NaN on an honest shard for an
   * all-zero row) comes only from a broken or hostile peer: refused by
   * both, naming the field. Layout per matrix: rsum, rmin, colsum[4],
   * S[4] (f64), col_old[4] (f32); matrix 1 starts at 64 + 96. */
  struct {
    size_t at;
    double val;
    bool f32;
    const char *msg;
  } vcases[] = {
      {48, NAN, false, "header sum p^2 is nan"},
      {56, -1.0, false, "unfactored sum U^2 is -1"},
      {64, INFINITY, false, "row-statistic sum of matrix 0 is inf"},
      {64 + 96 + 8, -2.0, false, "row-statistic min of matrix 1 is -2"},
      {64 + 16 + 3 * 8, NAN, false, "column sum of g^2 of matrix 0, column 3 is nan"},
      {64 + 96 + 16 + 64 + 4, -INFINITY, true, "column state of matrix 1, column 1 is -inf"},
  };
  for (size_t i = 0; i < sizeof vcases / sizeof vcases[0]; i++) {
    memcpy(bad, buf, sz);
    if (vcases[i].f32) {
      float f = (float)vcases[i].val;
      memcpy(bad + vcases[i].at, &f, 4);
    } else {
      memcpy(bad + vcases[i].at, &vcases[i].val, 8);
    }
    int rc = fps_split_partials_check(bad, sz, FPS_SPLIT_PHASE_STATS, &h, why, sizeof why);
    if (rc != FPS_EFORMAT || !strstr(why, vcases[i].msg))
      print_error("value case %zu: rc %d, '%s'\n", i, rc, why);
    assert_int_equal(rc, FPS_EFORMAT);
    assert_non_null(strstr(why, vcases[i].msg));
    assert_int_equal(fps_split_partials_decode(bad, sz, &p.g[0], FPS_SPLIT_PHASE_STATS, &d, why,
                                               sizeof why), FPS_EFORMAT);
    assert_non_null(strstr(why, vcases[i].msg));
  }
  memcpy(bad, buf, sz);
  double snan = NAN;
  memcpy(bad + 64 + 16 + 4 * 8, &snan, 8); /* S of matrix 0, column 0 */
  assert_int_equal(fps_split_partials_check(bad, sz, FPS_SPLIT_PHASE_STATS, &h, why, sizeof why), 0);
  assert_int_equal(fps_split_partials_check(buf, sz, FPS_SPLIT_PHASE_U2, &h, why, sizeof why),
                   FPS_EPROTO);
  assert_int_equal(fps_split_partials_check(buf, 10, FPS_SPLIT_PHASE_STATS, &h, why, sizeof why),
                   FPS_EFORMAT);
  /* block 0's partials are not block 1's */
  assert_int_equal(fps_split_partials_decode(buf, sz, &p.g[1], FPS_SPLIT_PHASE_STATS, &d, why,
                                             sizeof why), FPS_EPROTO);
  assert_non_null(strstr(why, "expected factored rows [4, 6)"));
  /* nor are they the u2 phase's */
  assert_int_equal(fps_split_partials_decode(buf, sz, &p.g[0], FPS_SPLIT_PHASE_U2, &d, why,
                                             sizeof why), FPS_EPROTO);
  pair_end(&p);
}

static void combine_refuses_and_leaves_state(void **u) {
  (void)u;
  pair_t p;
  pair_begin(&p);
  char why[512];
  fps_split_partials_t parts[2] = {*fps_split_step_partials(p.s[0]),
                                   *fps_split_step_partials(p.s[1])};
  fps_split_partials_t swapped[2] = {parts[1], parts[0]};
  assert_int_equal(fps_split_step_combine(p.s[0], swapped, 2, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "block 0's partials cover rows [4, 6)"));
  assert_int_equal(fps_split_step_combine(p.s[0], parts, 1, why, sizeof why), FPS_EINVAL);
  assert_non_null(strstr(why, "end at row 4, not 6"));
  assert_int_equal(fps_split_step_combine(p.s[1], parts, 0, why, sizeof why), FPS_EINVAL);
  /* a peer whose column state diverged is refused, naming the matrix */
  float col_bad[4];
  memcpy(col_bad, parts[1].col_old, sizeof col_bad);
  col_bad[2] = 1.0f;
  fps_split_partials_t div[2] = {parts[0], parts[1]};
  div[1].col_old = col_bad;
  assert_int_equal(fps_split_step_combine(p.s[1], div, 2, why, sizeof why), FPS_ESTATE);
  assert_non_null(strstr(why, "matrix 1 differs between blocks 0 and 1"));
  /* nothing of the step applies, and the state and params are untouched */
  assert_int_equal(fps_split_step_apply(p.s[1], NULL), FPS_EINVAL);
  assert_memory_equal(p.param, p.param0, sizeof p.param);
  assert_int_equal(p.st[0].step, 0);
  for (int i = 0; i < 4; i++) assert_true(p.st[0].row[i] == 0.0f);
  /* an abandoned step changes nothing either; the next one runs normally */
  fps_split_step_free(p.s[0]);
  fps_split_step_free(p.s[1]);
  p.s[0] = p.s[1] = NULL;
  assert_memory_equal(p.param, p.param0, sizeof p.param);
  for (int i = 0; i < 2; i++)
    assert_int_equal(fps_split_step_begin(NULL, &p.hp, &p.st[i], p.param + p.g[i].row_lo * 4,
                                          p.grad + p.g[i].row_lo * 4, NULL, &p.s[i]), 0);
  parts[0] = *fps_split_step_partials(p.s[0]);
  parts[1] = *fps_split_step_partials(p.s[1]);
  /* a failed combine can be retried (the old step's partials are gone) */
  div[0] = parts[0];
  div[1] = parts[1];
  div[1].col_old = col_bad;
  assert_int_equal(fps_split_step_combine(p.s[1], div, 2, why, sizeof why), FPS_ESTATE);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(fps_split_step_combine(p.s[i], parts, 2, why, sizeof why), 0);
    assert_int_equal(fps_split_step_combine(p.s[i], parts, 2, why, sizeof why), FPS_EINVAL);
    assert_false(fps_split_step_needs_u2(p.s[i])); /* hf never clamps */
    assert_null(fps_split_step_u2(p.s[i]));
  }
  for (int i = 0; i < 2; i++) assert_int_equal(fps_split_step_apply(p.s[i], NULL), 0);
  assert_int_equal(p.st[0].step, 1);
  assert_int_equal(p.st[1].step, 1);
  assert_memory_equal(p.st[0].col + 4, p.st[1].col, 4 * sizeof(float));
  /* the same step on the whole tensor */
  fps_adafactor_state_t whole;
  fps_shape_t s = shape3(2, 3, 4);
  assert_int_equal(fps_adafactor_state_init(&whole, &s, &p.hp), 0);
  float wp[24];
  memcpy(wp, p.param0, sizeof wp);
  assert_int_equal(fps_adafactor_step(NULL, &p.hp, &whole, wp, p.grad, NULL, NULL), 0);
  for (int i = 0; i < 24; i++) assert_true(fabsf(wp[i] - p.param[i]) <= 1e-6f * 0.6f);
  fps_adafactor_state_destroy(&whole);
  pair_end(&p);
}

static void begin_refuses_bad_args(void **u) {
  (void)u;
  fps_adafactor_hparams_t hp, mom;
  fps_adafactor_defaults(&hp, FPS_FLAVOR_TORCH);
  fps_adafactor_defaults(&mom, FPS_FLAVOR_HF);
  mom.has_beta1 = true;
  mom.beta1 = 0.9;
  fps_shape_t s = {.ndim = 2, .dim = {4, 3}};
  fps_split_geom_t g;
  assert_int_equal(fps_split_geom_init(&g, &s, 1, 3, NULL, 0), 0);
  fps_split_state_t st;
  assert_int_equal(fps_split_state_init(&st, &g, &hp), 0);
  float p[6] = {0}, gr[6] = {0};
  fps_split_step_t *step = (fps_split_step_t *)&st; /* must be reset to NULL */
  assert_int_equal(fps_split_step_begin(NULL, &mom, &st, p, gr, NULL, &step), FPS_EINVAL);
  assert_null(step);
  assert_int_equal(fps_split_step_begin(NULL, &hp, &st, NULL, gr, NULL, &step), FPS_EINVAL);
  hp.lr = -1;
  assert_int_equal(fps_split_step_begin(NULL, &hp, &st, p, gr, NULL, &step), FPS_EHPARAM);
  fps_split_state_destroy(&st);
  fps_split_state_destroy(&st); /* idempotent */
  fps_split_step_free(NULL);
}

/* Blocks large enough to be cut into several chunks (the golden cases fit
 * one): a [2, 600, 256] tensor in blocks of rows [0, 1), [1, 900), [900,
 * 1200) (runs of up to 599 x 256 elements: 4 chunks), two steps, torch
 * default and hf momentum. The result must not depend on the thread
 * count (bit-identical with a pool of 3 and without) and must match the
 * whole-tensor step with the golden metrics (param scaled <= 1e-5, state
 * rel <= 1e-4). */
static void chunked_blocks_match_whole(void **u) {
  (void)u;
  const char *e = getenv("FPS_TEST_NO_THREADS");
  const bool threads = !(e && *e && strcmp(e, "0"));
  enum { M = 2, R = 600, C = 256, N = M * R * C, NB = 3 };
  const uint64_t bounds[NB + 1] = {0, 1, 900, 1200};
  fps_shape_t shp = shape3(M, R, C);
  float *p0 = malloc(N * sizeof(float)), *g = malloc(2 * N * sizeof(float));
  float *pw = malloc(N * sizeof(float)), *ps[2] = {malloc(N * sizeof(float)),
                                                   malloc(N * sizeof(float))};
  float *whole_steps = malloc(2 * N * sizeof(float)), *split_steps = malloc(2 * N * sizeof(float));
  assert_true(p0 && g && pw && ps[0] && ps[1] && whole_steps && split_steps);
  unsigned seed = 7;
  for (int i = 0; i < N; i++) {
    seed = seed * 1103515245u + 12345u;
    p0[i] = ((float)(seed >> 8 & 0xffff) / 65536.0f - 0.5f);
  }
  for (int i = 0; i < 2 * N; i++) {
    seed = seed * 1103515245u + 12345u;
    g[i] = ((float)(seed >> 8 & 0xffff) / 65536.0f - 0.5f) * 0.1f;
  }
  fps_pool_t *pool = NULL;
  if (threads) assert_int_equal(fps_pool_create(&pool, 3), 0);
  for (int flavor = 0; flavor < 2; flavor++) {
    fps_adafactor_hparams_t hp;
    fps_adafactor_defaults(&hp, flavor ? FPS_FLAVOR_HF : FPS_FLAVOR_TORCH);
    if (flavor) {
      hp.has_beta1 = true;
      hp.beta1 = 0.9;
    }
    fps_adafactor_state_t whole;
    assert_int_equal(fps_adafactor_state_init(&whole, &shp, &hp), 0);
    memcpy(pw, p0, N * sizeof(float));
    for (int t = 0; t < 2; t++) {
      assert_int_equal(fps_adafactor_step(NULL, &hp, &whole, pw, g + t * N, NULL, NULL), 0);
      memcpy(whole_steps + t * N, pw, N * sizeof(float));
    }
    fps_split_state_t st[2][NB];
    for (int run = 0; run < 2; run++) {
      if (run == 1 && !threads) {
        memcpy(ps[1], ps[0], N * sizeof(float));
        break;
      }
      fps_split_geom_t geo[NB];
      for (int b = 0; b < NB; b++) {
        assert_int_equal(fps_split_geom_init(&geo[b], &shp, bounds[b], bounds[b + 1], NULL, 0), 0);
        assert_int_equal(fps_split_state_init(&st[run][b], &geo[b], &hp), 0);
      }
      memcpy(ps[run], p0, N * sizeof(float));
      for (int t = 0; t < 2; t++) {
        fps_split_step_t *steps[NB];
        for (int b = 0; b < NB; b++) {
          uint64_t off = bounds[b] * C;
          assert_int_equal(fps_split_step_begin(NULL, &hp, &st[run][b], ps[run] + off,
                                                g + t * N + off, run ? pool : NULL, &steps[b]), 0);
        }
        exchange(geo, steps, NB, FPS_SPLIT_PHASE_STATS);
        assert_false(fps_split_step_needs_u2(steps[0]));
        for (int b = 0; b < NB; b++) {
          assert_int_equal(fps_split_step_apply(steps[b], NULL), 0);
          fps_split_step_free(steps[b]);
        }
        if (run == 0) memcpy(split_steps + t * N, ps[0], N * sizeof(float));
      }
    }
    assert_memory_equal(ps[0], ps[1], N * sizeof(float));
    worst_t w = {0};
    assert_int_equal(check_params(flavor ? "hf chunked" : "torch chunked", split_steps,
                                  whole_steps, p0, N, 2, &w), 0);
    for (int b = 0; b < NB; b++) {
      const fps_split_geom_t *gb = &st[0][b].g;
      assert_int_equal(check_state("chunked", FPS_GOLDEN_ROW, st[0][b].row,
                                   whole.row + gb->row_lo, gb->row_hi - gb->row_lo, &w), 0);
      assert_int_equal(check_state("chunked", FPS_GOLDEN_COL, st[0][b].col,
                                   whole.col + gb->mtx_lo * C, gb->nmat * C, &w), 0);
      if (threads) {
        assert_memory_equal(st[0][b].row, st[1][b].row,
                            (gb->row_hi - gb->row_lo) * sizeof(float));
        assert_memory_equal(st[0][b].col, st[1][b].col, gb->nmat * C * sizeof(float));
      }
    }
    print_message("%s [2,600,256] in 3 blocks vs whole: param scaled %.2e, state rel %.2e\n",
                  flavor ? "hf beta1" : "torch", w.param_scaled, w.state_rel);
    for (int run = 0; run < (threads ? 2 : 1); run++)
      for (int b = 0; b < NB; b++) fps_split_state_destroy(&st[run][b]);
    fps_adafactor_state_destroy(&whole);
  }
  fps_pool_destroy(pool);
  free(p0);
  free(g);
  free(pw);
  free(ps[0]);
  free(ps[1]);
  free(whole_steps);
  free(split_steps);
}

/* One step of two blocks of a [2, 3, 4] tensor (rows [0, 4), [4, 6)),
 * through the wire form. Returns 0, or the first error (an allocation that
 * failed); the caller checks nothing changed then. */
static int two_block_step(const fps_adafactor_hparams_t *hp, fps_split_state_t *st, float *param,
                          const float *grad, bool *u2_phase) {
  fps_split_step_t *s[2] = {NULL, NULL};
  fps_split_partials_t dec[2][2];
  memset(dec, 0, sizeof dec);
  unsigned char wire[2][512];
  int rc = 0;
  for (int i = 0; i < 2 && !rc; i++) {
    uint64_t off = st[i].g.row_lo * 4;
    rc = fps_split_step_begin(NULL, hp, &st[i], param + off, grad + off, NULL, &s[i]);
  }
  for (int phase = FPS_SPLIT_PHASE_STATS; phase <= FPS_SPLIT_PHASE_U2 && !rc; phase++) {
    if (phase == FPS_SPLIT_PHASE_U2 && !fps_split_step_needs_u2(s[0])) break;
    if (phase == FPS_SPLIT_PHASE_U2) *u2_phase = true;
    size_t len[2];
    for (int i = 0; i < 2 && !rc; i++) {
      const fps_split_partials_t *own = phase == FPS_SPLIT_PHASE_STATS
                                            ? fps_split_step_partials(s[i])
                                            : fps_split_step_u2(s[i]);
      if (!own) rc = FPS_ENOMEM;
      else len[i] = fps_split_partials_encode(own, wire[i], sizeof wire[i]);
    }
    for (int me = 0; me < 2 && !rc; me++) {
      for (int b = 0; b < 2 && !rc; b++)
        rc = fps_split_partials_decode(wire[b], len[b], &st[b].g, phase, &dec[me][b], NULL, 0);
      if (!rc)
        rc = phase == FPS_SPLIT_PHASE_STATS
                 ? fps_split_step_combine(s[me], dec[me], 2, NULL, 0)
                 : fps_split_step_combine_u2(s[me], dec[me], 2, NULL, 0);
    }
    for (int me = 0; me < 2; me++)
      for (int b = 0; b < 2; b++) fps_split_partials_free(&dec[me][b]);
  }
  for (int i = 0; i < 2 && !rc; i++) rc = fps_split_step_apply(s[i], NULL);
  fps_split_step_free(s[0]);
  fps_split_step_free(s[1]);
  return rc;
}

/* Every allocation of a split step fails in turn: the step reports
 * FPS_ENOMEM and the params, state and step count are as before (apply
 * allocates nothing, so a step fails before any block moved). Both the hf
 * momentum path and torch's explicit-U^2 path (tiny gradients). */
static void oom_sweep_changes_nothing(void **u) {
  (void)u;
  for (int flavor = 0; flavor < 2; flavor++) {
    fps_adafactor_hparams_t hp;
    fps_adafactor_defaults(&hp, flavor ? FPS_FLAVOR_TORCH : FPS_FLAVOR_HF);
    if (!flavor) {
      hp.has_beta1 = true;
      hp.beta1 = 0.9;
    }
    fps_shape_t shp = shape3(2, 3, 4);
    uint64_t b[] = {0, 4, 6};
    fps_split_state_t st[2];
    float param[24], param0[24], grad[24];
    for (int i = 0; i < 24; i++) {
      param[i] = param0[i] = 0.1f * (float)(i % 7) - 0.3f;
      grad[i] = (0.05f * (float)(i % 5) - 0.1f) * (flavor ? 1e-6f : 1.0f);
    }
    for (int i = 0; i < 2; i++) {
      fps_split_geom_t g;
      assert_int_equal(fps_split_geom_init(&g, &shp, b[i], b[i + 1], NULL, 0), 0);
      assert_int_equal(fps_split_state_init(&st[i], &g, &hp), 0);
    }
    bool u2 = false;
    fps_alloc_fault_arm(0, 0);
    assert_int_equal(two_block_step(&hp, st, param, grad, &u2), 0);
    const uint64_t calls = fps_alloc_calls();
    fps_alloc_fault_disarm();
    assert_true(calls > 10);
    assert_int_equal(u2, flavor == 1); /* torch with tiny gradients takes the u2 phase */
    float p1[24], row1[6], col1[8];
    memcpy(p1, param, sizeof p1);
    memcpy(row1, st[0].row, 4 * sizeof(float));
    memcpy(row1 + 4, st[1].row, 2 * sizeof(float));
    memcpy(col1, st[0].col, 8 * sizeof(float));
    for (uint64_t nth = 1; nth <= calls; nth++) {
      memcpy(param, param0, sizeof param);
      for (int i = 0; i < 2; i++) {
        st[i].step = 0;
        st[i].rms = 0;
        memset(st[i].row, 0, (st[i].g.row_hi - st[i].g.row_lo) * sizeof(float));
        memset(st[i].col, 0, st[i].g.nmat * 4 * sizeof(float));
        if (st[i].mom) memset(st[i].mom, 0, st[i].g.block_numel * sizeof(float));
      }
      fps_alloc_fault_arm(nth, 0);
      int rc = two_block_step(&hp, st, param, grad, &u2);
      fps_alloc_fault_disarm();
      if (rc != FPS_ENOMEM) print_error("allocation %llu: rc %d\n", (unsigned long long)nth, rc);
      assert_int_equal(rc, FPS_ENOMEM);
      assert_memory_equal(param, param0, sizeof param);
      for (int i = 0; i < 2; i++) {
        assert_int_equal(st[i].step, 0);
        for (uint64_t r = 0; r < st[i].g.row_hi - st[i].g.row_lo; r++)
          assert_true(st[i].row[r] == 0.0f);
        if (st[i].mom)
          for (uint64_t e = 0; e < st[i].g.block_numel; e++) assert_true(st[i].mom[e] == 0.0f);
      }
      /* the same step then succeeds, with the same result */
      assert_int_equal(two_block_step(&hp, st, param, grad, &u2), 0);
      assert_memory_equal(param, p1, sizeof p1);
      assert_memory_equal(st[0].row, row1, 4 * sizeof(float));
      assert_memory_equal(st[1].row, row1 + 4, 2 * sizeof(float));
      assert_memory_equal(st[0].col, col1, 8 * sizeof(float));
    }
    for (int i = 0; i < 2; i++) fps_split_state_destroy(&st[i]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(split_scalar),
#if defined(__x86_64__)
      cmocka_unit_test(split_avx2),
      cmocka_unit_test(split_avx512),
#endif
#if defined(__aarch64__)
      cmocka_unit_test(split_neon),
#endif
      cmocka_unit_test(split_best_threads),
      cmocka_unit_test(chunked_blocks_match_whole),
      cmocka_unit_test(reshard_mid_run_matches_whole),
      cmocka_unit_test(state_copies_refuse_other_tensors),
      cmocka_unit_test(geometry_and_bounds),
      cmocka_unit_test(partials_wire_errors),
      cmocka_unit_test(combine_refuses_and_leaves_state),
      cmocka_unit_test(begin_refuses_bad_args),
      cmocka_unit_test(oom_sweep_changes_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Every SIMD variant this machine runs against the scalar reference, on
 * random inputs, for every length 0..257 at misaligned addresses (1, 3 and
 * 5 floats past a 64-byte boundary), and full steps on odd shapes.
 *
 * Stated tolerances:
 *  - elementwise outputs of a kernel (variance state, column sums, S sums,
 *    params, momentum) must be BIT-IDENTICAL to scalar: the variants use
 *    the same operations in the same order there (kernels_impl.h);
 *  - double-precision reductions (sum g^2, sum p^2, sum U^2) may differ in
 *    summation order only: relative error <= 1e-12;
 *  - full steps (3 steps, both flavors, several settings): params within
 *    1e-6 of max|param| and state within 1e-6 relative; in practice they
 *    differ by at most an ulp, because only the per-step scalars (through
 *    the sums) can differ.
 * Elements past the end of every output are canaries and must not change.
 *
 * Pass C out of place (out == p, out == g, a separate out) of every
 * variant, scalar included, is bit-identical to scalar's in-place pass C,
 * and fps_adafactor_step_to() to the same variant's in-place step.
 *
 * The sync sum (add_f32 / div_f32) and the bf16 conversions of every
 * variant, scalar included, are checked bit for bit against plain loops
 * written here: the sync round's ((g0 + g1) + g2) ... / W, and
 * fps_f32_to_bf16() / the dtype.h gradient rule on every fp32 bit class
 * (random bit patterns: NaNs with payloads, Inf, denormals, rounding
 * ties), at odd byte offsets for the bf16 side. The wire gradient's fused
 * passes (sum_f32, sum_bf16, decode_f32) are checked against the scalar
 * decode followed by the scalar add_f32: src at every byte offset, invalid
 * gradients at random places, the returned index, and nothing written at
 * or after it. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "adafactor.h"
#include "dtype.h"
#include "simd/kernels_impl.h"

#define MAXN 257
#define PAD 16
#define SUM_RTOL 1e-12
#define STEP_TOL 1e-6

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}
static float nrand(void) { /* Box-Muller: Gaussian-ish */
  double u = urand() + 1e-12, v = urand();
  return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}

/* An aligned buffer with the data starting `off` floats in. */
typedef struct buf_s {
  float *base, *f;
  double *dbase, *d;
} buf_t;
static void buf_init(buf_t *b, size_t off) {
  /* C11: the size must be a multiple of the alignment */
  b->base = aligned_alloc(64, ((MAXN + 2 * PAD) * sizeof(float) + 127) / 64 * 64);
  b->dbase = aligned_alloc(64, ((MAXN + 2 * PAD) * sizeof(double) + 127) / 64 * 64);
  assert_non_null(b->base);
  assert_non_null(b->dbase);
  b->f = b->base + off;
  b->d = b->dbase + off;
}
static void buf_free(buf_t *b) {
  free(b->base);
  free(b->dbase);
}

static void rel_close(double a, double b) {
  double tol = SUM_RTOL * fmax(fabs(a), fabs(b));
  if (!(fabs(a - b) <= tol)) print_error("sum %.17g vs scalar %.17g\n", a, b);
  assert_true(fabs(a - b) <= tol);
}

enum { G, P, V, C, M, NB };

static void fill(buf_t b[NB], size_t n) {
  for (size_t i = 0; i < n + PAD; i++) {
    b[G].f[i] = nrand() * (i % 11 == 0 ? 1e-4f : 1.0f);
    b[P].f[i] = nrand() * 0.5f;
    b[V].f[i] = (float)urand() * (i % 5 == 0 ? 1e-15f : 1.0f); /* some below the floor */
    b[C].f[i] = (float)urand() + 1e-3f;
    b[M].f[i] = nrand() * 1e-3f;
    b[G].d[i] = b[P].d[i] = urand();
  }
}

/* Runs `call` on a copy for scalar and for the variant, then compares the
 * float outputs bit for bit (including canaries past n). */
typedef struct run_s {
  buf_t b[NB];
  double r1, r2;
} run_t;

static void copy_run(run_t *dst, const run_t *src, size_t n) {
  for (int i = 0; i < NB; i++) {
    memcpy(dst->b[i].f, src->b[i].f, (n + PAD) * sizeof(float));
    memcpy(dst->b[i].d, src->b[i].d, (n + PAD) * sizeof(double));
  }
  dst->r1 = src->r1;
  dst->r2 = src->r2;
}

static void same_bits(const run_t *a, const run_t *b, size_t n, const char *what) {
  for (int i = 0; i < NB; i++) {
    if (memcmp(a->b[i].f, b->b[i].f, (n + PAD) * sizeof(float)) ||
        memcmp(a->b[i].d, b->b[i].d, (n + PAD) * sizeof(double))) {
      print_error("%s: n=%zu: array %d differs from scalar\n", what, n, i);
      fail();
    }
  }
}

static void parity(const char *variant) {
  const fps_kernels_t *k, *s = &fps__kernels_scalar;
  char why[256];
  int rc = fps_kernels_by_name(variant, &k, why, sizeof why);
  if (rc == FPS_EUNSUPPORTED) {
    print_message("skipping %s: %s\n", variant, why);
    skip();
  }
  assert_int_equal(rc, 0);
  const size_t offs[] = {1, 3, 5};
  for (size_t oi = 0; oi < 3; oi++) {
    run_t src, rs, rk;
    for (int i = 0; i < NB; i++) {
      buf_init(&src.b[i], offs[oi]);
      buf_init(&rs.b[i], offs[oi]);
      buf_init(&rk.b[i], (offs[oi] + 2 * i + 1) % 8); /* other misalignments too */
    }
    for (size_t n = 0; n <= MAXN; n++) {
      fill(src.b, n);
      src.r1 = src.r2 = 0.25;
#define BOTH(stmt_s, stmt_k, what)        \
  copy_run(&rs, &src, n);                 \
  copy_run(&rk, &src, n);                 \
  {                                       \
    run_t *r = &rs;                       \
    const fps_kernels_t *kk = s;          \
    stmt_s;                               \
    r = &rk;                              \
    kk = k;                               \
    stmt_k;                               \
  }                                       \
  rel_close(rk.r1, rs.r1);                \
  rel_close(rk.r2, rs.r2);                \
  rk.r1 = rs.r1, rk.r2 = rs.r2;           \
  same_bits(&rs, &rk, n, what);
#define K(call) call
      BOTH(K(kk->row_stats(r->b[G].f, r->b[P].f, n, r->b[V].d, &r->r1, &r->r2)),
           K(kk->row_stats(r->b[G].f, r->b[P].f, n, r->b[V].d, &r->r1, &r->r2)), "row_stats");
      BOTH(K(kk->row_scaled(r->b[G].f, n, 0.37, r->b[C].d)),
           K(kk->row_scaled(r->b[G].f, n, 0.37, r->b[C].d)), "row_scaled");
      for (int fl = 0; fl < 2; fl++) {
        float a = fl ? 0.7f : 0.3f, b = 1 - a, e = fl ? 1e-30f : 0.0f, flo = fl ? 0 : 1.42e-14f;
        BOTH(K(kk->var_update(r->b[G].f, r->b[P].f, r->b[V].f, n, a, b, e, flo, &r->r1, &r->r2)),
             K(kk->var_update(r->b[G].f, r->b[P].f, r->b[V].f, n, a, b, e, flo, &r->r1, &r->r2)),
             "var_update");
      }
      BOTH(K(r->r1 = kk->row_u2_clamped(r->b[G].f, r->b[V].f, n, 0.9f, 1e-8f)),
           K(r->r1 = kk->row_u2_clamped(r->b[G].f, r->b[V].f, n, 0.9f, 1e-8f)), "row_u2_clamped");
      for (int mo = 0; mo < 2; mo++) {
        BOTH(K(kk->apply_rowcol(r->b[P].f, r->b[P].f, r->b[G].f, mo ? r->b[M].f : NULL, r->b[C].f,
                                n, -3e-3f, 0.999f, 0.9f)),
             K(kk->apply_rowcol(r->b[P].f, r->b[P].f, r->b[G].f, mo ? r->b[M].f : NULL, r->b[C].f,
                                n, -3e-3f, 0.999f, 0.9f)),
             "apply_rowcol");
        BOTH(K(kk->apply_elem(r->b[P].f, r->b[P].f, r->b[G].f, mo ? r->b[M].f : NULL, r->b[V].f,
                              n, 1.0f, 1e-8f, 2e-3f, 1.0f, 0.9f)),
             K(kk->apply_elem(r->b[P].f, r->b[P].f, r->b[G].f, mo ? r->b[M].f : NULL, r->b[V].f,
                              n, 1.0f, 1e-8f, 2e-3f, 1.0f, 0.9f)),
             "apply_elem");
      }
    }
    for (int i = 0; i < NB; i++) {
      buf_free(&src.b[i]);
      buf_free(&rs.b[i]);
      buf_free(&rk.b[i]);
    }
  }
}

#if defined(__x86_64__)
static void parity_avx2(void **u) { (void)u; parity("avx2"); }
#endif
#if defined(__x86_64__)
static void parity_avx512(void **u) { (void)u; parity("avx512"); }
#endif
#if defined(__aarch64__)
static void parity_neon(void **u) { (void)u; parity("neon"); }
#endif

/* ---- pass C out of place: out == p, out == g, a separate out ---- */

static const fps_kernels_t *variant_or_skip(const char *variant);

/* Pass C of variant k with out aliasing array `dst` (P, G or V, V standing
 * for a separate buffer here) against scalar's in-place pass C: out's n
 * floats bit-identical to scalar's new params, momentum bit-identical,
 * every other array (p when out is not p) and every canary unchanged. */
static void apply_out_case(const fps_kernels_t *k, const run_t *src, run_t *rs, run_t *rk,
                           size_t n, int elem, int mo, int dst) {
  const fps_kernels_t *s = &fps__kernels_scalar;
  copy_run(rs, src, n);
  copy_run(rk, src, n);
  /* scalar in place; the variant's pass gets a separate out in V (apply
   * elem reads c, which is C here, so V is free to be the output) */
  float *ms = mo ? rs->b[M].f : NULL, *mk = mo ? rk->b[M].f : NULL;
  float *out = rk->b[dst].f;
  if (elem) {
    s->apply_elem(rs->b[P].f, rs->b[P].f, rs->b[G].f, ms, rs->b[C].f, n, 0.7f, 1e-8f, 2e-3f,
                  0.999f, 0.9f);
    k->apply_elem(out, rk->b[P].f, rk->b[G].f, mk, rk->b[C].f, n, 0.7f, 1e-8f, 2e-3f, 0.999f,
                  0.9f);
  } else {
    s->apply_rowcol(rs->b[P].f, rs->b[P].f, rs->b[G].f, ms, rs->b[C].f, n, -3e-3f, 0.999f, 0.9f);
    k->apply_rowcol(out, rk->b[P].f, rk->b[G].f, mk, rk->b[C].f, n, -3e-3f, 0.999f, 0.9f);
  }
  for (int i = 0; i < NB; i++) {
    const float *want = i == dst ? rs->b[P].f : i == P ? src->b[P].f : rs->b[i].f;
    if (memcmp(rk->b[i].f, want, n * sizeof(float)) ||
        memcmp(rk->b[i].f + n, src->b[i].f + n, PAD * sizeof(float))) {
      print_error("%s %s out=%d mom=%d: n=%zu: array %d differs\n", fps_kernels_name(k),
                  elem ? "apply_elem" : "apply_rowcol", dst, mo, n, i);
      fail();
    }
  }
}

static void out_parity(const char *variant) {
  const fps_kernels_t *k = variant_or_skip(variant);
  const size_t offs[] = {1, 3, 5};
  for (size_t oi = 0; oi < 3; oi++) {
    run_t src, rs, rk;
    for (int i = 0; i < NB; i++) {
      buf_init(&src.b[i], offs[oi]);
      buf_init(&rs.b[i], offs[oi]);
      buf_init(&rk.b[i], (offs[oi] + 2 * i + 1) % 8);
    }
    for (size_t n = 0; n <= MAXN; n++) {
      fill(src.b, n);
      const int dsts[] = {P, G, V};
      for (int elem = 0; elem < 2; elem++)
        for (int mo = 0; mo < 2; mo++)
          for (int d = 0; d < 3; d++) apply_out_case(k, &src, &rs, &rk, n, elem, mo, dsts[d]);
    }
    for (int i = 0; i < NB; i++) {
      buf_free(&src.b[i]);
      buf_free(&rs.b[i]);
      buf_free(&rk.b[i]);
    }
  }
}

static void out_scalar(void **u) { (void)u; out_parity("scalar"); }
#if defined(__x86_64__)
static void out_avx2(void **u) { (void)u; out_parity("avx2"); }
static void out_avx512(void **u) { (void)u; out_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void out_neon(void **u) { (void)u; out_parity("neon"); }
#endif

/* ---- sync sum and bf16, every variant against plain loops ---- */

static const fps_kernels_t *variant_or_skip(const char *variant) {
  const fps_kernels_t *k;
  char why[256];
  int rc = fps_kernels_by_name(variant, &k, why, sizeof why);
  if (rc == FPS_EUNSUPPORTED) {
    print_message("skipping %s: %s\n", variant, why);
    skip();
  }
  assert_int_equal(rc, 0);
  return k;
}

static uint32_t rbits(void) {
  urand();
  return (uint32_t)(rng >> 17);
}
static float f_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* Inputs that hit every path: ordinary values, then NaN/Inf/denormal and
 * exact ties among them. */
static float special_f32(size_t i) {
  switch (i % 8) {
    case 0: return f_of(rbits());                                  /* any bits */
    case 1: return f_of((rbits() & 0x807fffffu) | (i & 1 ? 0x7f800000u : 0)); /* NaN/Inf or denormal */
    case 2: return f_of((rbits() & 0xffff0000u) | 0x8000u);        /* a tie */
    case 3: return f_of((rbits() & 0xffff0000u) | 0x7fffu);        /* just below a tie */
    default: return nrand() * (i % 3 ? 1.0f : 1e-38f);
  }
}

static void sum_parity(const char *variant) {
  const fps_kernels_t *k = variant_or_skip(variant);
  const size_t offs[] = {0, 1, 3, 5};
  enum { W = 4 };
  float *base = aligned_alloc(64, (W + 2) * 512 * sizeof(float));
  assert_non_null(base);
  for (size_t oi = 0; oi < 4; oi++) {
    float *g[W], *ref = base + W * 512 + offs[oi], *dst = base + (W + 1) * 512 + (offs[oi] + 2) % 8;
    for (int w = 0; w < W; w++) g[w] = base + w * 512 + (offs[oi] + (size_t)w) % 8;
    for (size_t n = 0; n <= MAXN; n++) {
      for (int w = 0; w < W; w++)
        for (size_t i = 0; i < n + PAD; i++) {
          /* finite (the shard rejects others before summing), denormals
           * and huge values included; NaN payloads may legally differ */
          uint32_t b = bits_of(i % 17 == 0 ? special_f32(i) : nrand());
          if ((b & 0x7f800000u) == 0x7f800000u) b &= 0xdfffffffu;
          g[w][i] = f_of(b);
        }
      for (size_t i = 0; i < n + PAD; i++) ref[i] = dst[i] = g[0][i];
      /* sync.c's round: ((g0 + g1) + g2) + g3 in fp32, then / W */
      for (int w = 1; w < W; w++)
        for (size_t i = 0; i < n; i++) ref[i] += g[w][i];
      for (size_t i = 0; i < n; i++) ref[i] /= (float)W;
      for (int w = 1; w < W; w++) k->add_f32(dst, g[w], n);
      k->div_f32(dst, n, (float)W);
      if (memcmp(ref, dst, (n + PAD) * sizeof(float))) {
        print_error("%s: n=%zu off=%zu: sum differs from the plain loop\n", variant, n, offs[oi]);
        fail();
      }
    }
  }
  free(base);
}

static void bf16_parity(const char *variant) {
  const fps_kernels_t *k = variant_or_skip(variant);
  float *src = aligned_alloc(64, 1024 * sizeof(float));
  unsigned char *hb = aligned_alloc(64, 1024), *rb = aligned_alloc(64, 1024);
  float *dec = aligned_alloc(64, 1024 * sizeof(float)), *rdec = aligned_alloc(64, 1024 * sizeof(float));
  assert_true(src && hb && rb && dec && rdec);
  const size_t offs[] = {0, 1, 3, 5};
  for (size_t oi = 0; oi < 4; oi++) {
    float *f = src + offs[oi];
    unsigned char *h = hb + offs[oi] * 3 % 7; /* odd byte offsets too */
    for (size_t n = 0; n <= MAXN; n++) {
      for (size_t i = 0; i < n + PAD; i++) f[i] = special_f32(i + n);
      memset(hb, 0xa5, 1024);
      k->bf16_encode(h, f, n);
      for (size_t i = 0; i < n; i++) {
        uint16_t got, want = fps_f32_to_bf16(f[i]);
        memcpy(&got, h + 2 * i, 2);
        if (got != want) {
          print_error("%s: bf16(0x%08x) = 0x%04x, scalar 0x%04x\n", variant, bits_of(f[i]), got,
                      want);
          fail();
        }
      }
      for (size_t i = 2 * n; i < 2 * (n + PAD); i++) assert_int_equal(h[i], 0xa5); /* canaries */
      /* decode: random bf16 patterns, the first bad one (if any) anywhere */
      for (size_t i = 0; i < n; i++) {
        uint16_t v = (uint16_t)(rbits() & (i % 5 ? 0xbfffu : 0xffffu)); /* mostly valid */
        memcpy(h + 2 * i, &v, 2);
      }
      for (int pass = 0; pass < 2; pass++) {
        if (pass && n) { /* a valid prefix, then one bad element */
          for (size_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(rbits() & 0x3fffu);
            memcpy(h + 2 * i, &v, 2);
          }
          uint16_t badv = (uint16_t)(0x5f00u | (rbits() & 0x80ffu));
          memcpy(h + 2 * (n * 7 / 11), &badv, 2);
        }
        size_t want = n;
        for (size_t i = 0; i < n; i++) {
          uint16_t v;
          memcpy(&v, h + 2 * i, 2);
          if (want == n && (bits_of(fps_bf16_to_f32(v)) & 0x7f800000u) >= 0x5f000000u) want = i;
          rdec[i] = fps_bf16_to_f32(v);
        }
        for (size_t i = n; i < n + PAD; i++) rdec[i] = dec[i] = -7.0f;
        size_t got = k->bf16_decode(dec, h, n);
        if (got != want) print_error("%s: n=%zu first bad %zu, want %zu\n", variant, n, got, want);
        assert_int_equal(got, want);
        assert_memory_equal(dec, rdec, (n + PAD) * sizeof(float));
        /* the unchecked non-temporal widening: the same bits, at every
         * float offset from a 64-byte line */
        for (size_t d = 0; d < 16; d++) {
          for (size_t i = 0; i < n + PAD + 16; i++) dec[i] = -7.0f;
          k->bf16_widen_nt(dec + d, h, n);
          assert_memory_equal(dec + d, rdec, (n + PAD) * sizeof(float));
          for (size_t i = 0; i < d; i++) assert_true(dec[i] == -7.0f);
        }
      }
    }
  }
  free(src), free(hb), free(rb), free(dec), free(rdec);
}

static void sum_scalar(void **u) { (void)u; sum_parity("scalar"); }
#if defined(__x86_64__)
static void sum_avx2(void **u) { (void)u; sum_parity("avx2"); }
#endif
#if defined(__x86_64__)
static void sum_avx512(void **u) { (void)u; sum_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void sum_neon(void **u) { (void)u; sum_parity("neon"); }
#endif
static void bf16_scalar(void **u) { (void)u; bf16_parity("scalar"); }
#if defined(__x86_64__)
static void bf16_avx2(void **u) { (void)u; bf16_parity("avx2"); }
#endif
#if defined(__x86_64__)
static void bf16_avx512(void **u) { (void)u; bf16_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void bf16_neon(void **u) { (void)u; bf16_parity("neon"); }
#endif

/* ---- the wire gradient's one pass in: sum_f32, sum_bf16, decode_f32 ---- */

/* An invalid gradient's fp32 bits (exponent field 0xBE..0xFF): NaN with a
 * payload, +-Inf, exactly 2^63, or anything beyond it. */
static uint32_t bad_bits(void) {
  uint32_t sign = rbits() & 0x80000000u;
  switch (rbits() % 4) {
    case 0: return sign | 0x7f800000u | (1 + rbits() % 0x7fffffu); /* NaN */
    case 1: return sign | 0x7f800000u;                             /* Inf */
    case 2: return sign | 0x5f000000u;                             /* 2^63 */
    default: return sign | ((0xbeu + rbits() % 0x41u) << 23) | (rbits() & 0x7fffffu);
  }
}

/* A valid gradient's fp32 bits, every class: ordinary, tiny, denormal,
 * zero of either sign, and the largest allowed (just below 2^63). */
static uint32_t good_bits(void) {
  switch (rbits() % 6) {
    case 0: return rbits() & 0xdeffffffu; /* any exponent below 0xBE */
    case 1: return (rbits() & 0x807fffffu);                 /* denormal or zero */
    case 2: return (rbits() & 0x80000000u) | 0x5effffffu;   /* largest valid */
    default: return bits_of(nrand());
  }
}

/* Every kind of fused pass of variant k against the scalar decode (a
 * memcpy or bf16 shift, then dtype.h's rule) followed by SCALAR add_f32 on
 * the valid prefix: random lengths around the vector widths, src at any
 * byte offset, dst at any float offset, none, one or several bad values at
 * random positions. The returned index must be the first bad one, the
 * prefix bit-identical, everything from it on (and the canaries past n)
 * untouched. */
static void wire_in_parity(const char *variant) {
  const fps_kernels_t *k = variant_or_skip(variant);
  enum { MAXW = 704, CANARY = 16 }; /* (MAXW + 64) * 4: a multiple of 64 (C11 aligned_alloc) */
  unsigned char *raw = aligned_alloc(64, (MAXW + 64) * 4);
  float *dbase = aligned_alloc(64, (MAXW + 64) * 4), *ref = aligned_alloc(64, (MAXW + 64) * 4);
  float *dec = aligned_alloc(64, (MAXW + 64) * 4);
  assert_true(raw && dbase && ref && dec);
  const char *what[3] = {"sum_f32", "sum_bf16", "decode_f32"};
  for (int kind = 0; kind < 3; kind++) {
    const int bf16 = kind == 1, add = kind != 2;
    size_t (*fn)(float *, const void *, size_t) = kind == 0 ? k->sum_f32 : kind == 1 ? k->sum_bf16 : k->decode_f32;
    for (int trial = 0; trial < 3000; trial++) {
      /* half the lengths near a multiple of 16 (the wider loops' edges) */
      long edge = (long)(rbits() % 40) * 16 + (long)(rbits() % 3) - 1;
      size_t n = trial % 2 ? rbits() % (MAXW - CANARY) : (size_t)(edge < 0 ? 0 : edge);
      size_t soff = rbits() % 64, doff = rbits() % 16;
      unsigned char *src = raw + soff;
      float *dst = dbase + doff;
      memset(raw, 0x5a, (MAXW + 64) * 4);
      for (size_t i = 0; i < n; i++) {
        uint32_t b = good_bits();
        if (bf16) {
          uint16_t h = (uint16_t)(b >> 16);
          memcpy(src + 2 * i, &h, 2);
        } else {
          memcpy(src + 4 * i, &b, 4);
        }
      }
      /* 0 bad values in a third of the trials, else 1..3 anywhere */
      int nbad = n && trial % 3 ? 1 + (int)(rbits() % 3) : 0;
      for (int b = 0; b < nbad; b++) {
        size_t at = rbits() % n;
        uint32_t v = bad_bits();
        if (bf16) {
          uint16_t h = (uint16_t)(v >> 16);
          memcpy(src + 2 * at, &h, 2);
        } else {
          memcpy(src + 4 * at, &v, 4);
        }
      }
      /* the reference: decode everything, find the first bad one */
      size_t want = n;
      for (size_t i = 0; i < n; i++) {
        uint32_t u;
        if (bf16) {
          uint16_t h;
          memcpy(&h, src + 2 * i, 2);
          u = (uint32_t)h << 16;
        } else {
          memcpy(&u, src + 4 * i, 4);
        }
        dec[i] = f_of(u);
        if (want == n && (u & 0x7f800000u) >= 0x5f000000u) want = i;
      }
      /* the accumulator: finite sums of valid gradients, any class */
      for (size_t i = 0; i < n + CANARY; i++) {
        uint32_t b = rbits() % 4 ? good_bits() : (rbits() & 0xff7fffffu); /* up to 2^127 */
        dst[i] = ref[i] = f_of(b);
      }
      if (add) fps__kernels_scalar.add_f32(ref, dec, want);
      else memcpy(ref, dec, want * 4);
      size_t got = fn(dst, src, n);
      if (got != want || memcmp(dst, ref, (n + CANARY) * 4)) {
        size_t i = 0;
        while (i < n + CANARY && bits_of(dst[i]) == bits_of(ref[i])) i++;
        print_error("%s %s: n=%zu src+%zu dst+%zu: returned %zu, want %zu; first differing element %zu\n",
                    variant, what[kind], n, soff, doff, got, want, i);
        fail();
      }
    }
  }
  free(raw), free(dbase), free(ref), free(dec);
}

static void wire_in_scalar(void **u) { (void)u; wire_in_parity("scalar"); }
#if defined(__x86_64__)
static void wire_in_avx2(void **u) { (void)u; wire_in_parity("avx2"); }
static void wire_in_avx512(void **u) { (void)u; wire_in_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void wire_in_neon(void **u) { (void)u; wire_in_parity("neon"); }
#endif

/* ---- full steps on odd shapes ---- */

typedef void (*hp_fn)(fps_adafactor_hparams_t *);
static void hp_torch(fps_adafactor_hparams_t *h) { fps_adafactor_defaults(h, FPS_FLAVOR_TORCH); }
static void hp_torch_wd_max(fps_adafactor_hparams_t *h) {
  fps_adafactor_defaults(h, FPS_FLAVOR_TORCH);
  h->weight_decay = 0.01, h->maximize = true, h->lr = 1.0;
}
static void hp_hf(fps_adafactor_hparams_t *h) { fps_adafactor_defaults(h, FPS_FLAVOR_HF); }
static void hp_hf_trainer_beta1(fps_adafactor_hparams_t *h) {
  fps_adafactor_defaults(h, FPS_FLAVOR_HF);
  h->relative_step = false, h->has_lr = true, h->lr = 1e-3, h->scale_parameter = false;
  h->has_beta1 = true, h->beta1 = 0.9, h->weight_decay = 0.01;
}

static void step_parity(const char *variant) {
  const fps_kernels_t *k;
  char why[256];
  int rc = fps_kernels_by_name(variant, &k, why, sizeof why);
  if (rc == FPS_EUNSUPPORTED) {
    print_message("skipping %s: %s\n", variant, why);
    skip();
  }
  assert_int_equal(rc, 0);
  const fps_shape_t shapes[] = {
      {.ndim = 0},
      {.ndim = 1, .dim = {1}},
      {.ndim = 1, .dim = {257}},
      {.ndim = 2, .dim = {1, 131}},
      {.ndim = 2, .dim = {131, 1}},
      {.ndim = 2, .dim = {17, 33}},
      {.ndim = 3, .dim = {3, 5, 7}},
      {.ndim = 4, .dim = {2, 3, 9, 13}},
      {.ndim = 2, .dim = {300, 301}}, /* several chunks */
  };
  const hp_fn hps[] = {hp_torch, hp_torch_wd_max, hp_hf, hp_hf_trainer_beta1};
  /* 1: normal gradients; 1e-5: torch's mean(row) clamp; 1e-15: V clamp */
  const float gscale[] = {1.0f, 1e-5f, 1e-15f};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (size_t hi = 0; hi < sizeof hps / sizeof hps[0]; hi++)
      for (size_t gi = 0; gi < 3; gi++) {
        fps_adafactor_hparams_t hp;
        hps[hi](&hp);
        uint64_t n;
        assert_int_equal(fps_shape_validate(&shapes[si], &n, NULL, 0), 0);
        /* +1 float: misaligned param and grad */
        float *p0 = malloc((n + 1) * 4), *g = malloc((3 * n + 1) * 4);
        float *ps = malloc((n + 1) * 4), *pk = malloc((n + 1) * 4);
        assert_true(p0 && g && ps && pk);
        for (uint64_t i = 0; i <= n; i++) p0[i] = nrand() * 0.5f;
        for (uint64_t i = 0; i <= 3 * n; i++) g[i] = nrand() * gscale[gi];
        fps_adafactor_state_t ss, sk;
        assert_int_equal(fps_adafactor_state_init(&ss, &shapes[si], &hp), 0);
        assert_int_equal(fps_adafactor_state_init(&sk, &shapes[si], &hp), 0);
        memcpy(ps, p0, (n + 1) * 4);
        memcpy(pk, p0, (n + 1) * 4);
        for (int t = 0; t < 3; t++) {
          assert_int_equal(
              fps_adafactor_step(&fps__kernels_scalar, &hp, &ss, ps + 1, g + 1 + t * n, NULL, NULL),
              0);
          assert_int_equal(fps_adafactor_step(k, &hp, &sk, pk + 1, g + 1 + t * n, NULL, NULL), 0);
        }
        double maxp = 0, maxd = 0;
        for (uint64_t i = 1; i <= n; i++) {
          maxp = fmax(maxp, fabs(ps[i]));
          maxd = fmax(maxd, fabs((double)ps[i] - pk[i]));
        }
        if (maxd > STEP_TOL * maxp)
          print_error("shape %zu hp %zu g %zu: param diff %.3e of max %.3e\n", si, hi, gi, maxd,
                      maxp);
        assert_true(maxd <= STEP_TOL * maxp);
        const float *as[] = {ss.row, ss.col, ss.var, ss.mom}, *bs[] = {sk.row, sk.col, sk.var, sk.mom};
        const uint64_t ns[] = {ss.batch * ss.rows, ss.batch * ss.cols, n, n};
        for (int a = 0; a < 4; a++) {
          assert_true((as[a] == NULL) == (bs[a] == NULL));
          for (uint64_t i = 0; as[a] && i < ns[a]; i++) {
            double d = fabs((double)as[a][i] - bs[a][i]);
            if (!(d <= STEP_TOL * fabs(as[a][i]) + 1e-30))
              print_error("shape %zu hp %zu: state %d[%llu] %.9g vs %.9g\n", si, hi, a,
                          (unsigned long long)i, as[a][i], bs[a][i]);
            assert_true(d <= STEP_TOL * fabs(as[a][i]) + 1e-30);
          }
        }
        fps_adafactor_state_destroy(&ss);
        fps_adafactor_state_destroy(&sk);
        free(p0), free(g), free(ps), free(pk);
      }
}

#if defined(__x86_64__)
static void steps_avx2(void **u) { (void)u; step_parity("avx2"); }
#endif
#if defined(__x86_64__)
static void steps_avx512(void **u) { (void)u; step_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void steps_neon(void **u) { (void)u; step_parity("neon"); }
#endif

/* fps_adafactor_step_to() with the gradient buffer as out (the shard's
 * way: the consumed gradient becomes the next params), with a separate
 * out and in place, 3 steps, against the in-place step of the same
 * variant: params and state bit-identical, and the params read are never
 * written (out of place). Each also runs as fps_adafactor_step_to_bf16():
 * the same params and state, and its bf16 is exactly the scalar
 * reference's encoding of those params (rows wider than the 4096-element
 * block, and a 1-D tensor of several blocks, cover the block cuts). */
static void step_to_parity(const char *variant) {
  const fps_kernels_t *k = variant_or_skip(variant);
  const fps_shape_t shapes[] = {
      {.ndim = 0},
      {.ndim = 1, .dim = {257}},
      {.ndim = 2, .dim = {17, 33}},
      {.ndim = 3, .dim = {3, 5, 7}},
      {.ndim = 2, .dim = {300, 301}},
      {.ndim = 2, .dim = {3, 9001}},
      {.ndim = 1, .dim = {3 * 4096 + 5}},
  };
  const hp_fn hps[] = {hp_torch, hp_torch_wd_max, hp_hf, hp_hf_trainer_beta1};
  const float gscale[] = {1.0f, 1e-15f};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (size_t hi = 0; hi < sizeof hps / sizeof hps[0]; hi++)
      for (size_t gi = 0; gi < 2; gi++)
        for (int mode = 0; mode < 6; mode++) {
          /* mode % 3: 0 out = grad, 1 separate out, 2 in place; mode / 3: bf16 too */
          const int alias = mode % 3, enc = mode / 3;
          fps_adafactor_hparams_t hp;
          hps[hi](&hp);
          uint64_t n;
          assert_int_equal(fps_shape_validate(&shapes[si], &n, NULL, 0), 0);
          float *g = malloc(3 * n * 4), *pin = malloc(n * 4);
          float *bufs[2] = {malloc(n * 4), malloc(n * 4)};
          float *keep = malloc(n * 4);
          uint16_t *h = malloc(n * 2), *ref = malloc(n * 2);
          assert_true(g && pin && bufs[0] && bufs[1] && keep && h && ref);
          for (uint64_t i = 0; i < n; i++) pin[i] = bufs[0][i] = nrand() * 0.5f;
          for (uint64_t i = 0; i < 3 * n; i++) g[i] = nrand() * gscale[gi];
          fps_adafactor_state_t si_, so;
          assert_int_equal(fps_adafactor_state_init(&si_, &shapes[si], &hp), 0);
          assert_int_equal(fps_adafactor_state_init(&so, &shapes[si], &hp), 0);
          int cur = 0; /* bufs[cur] holds the out-of-place run's params */
          for (int t = 0; t < 3; t++) {
            assert_int_equal(fps_adafactor_step(k, &hp, &si_, pin, g + t * n, NULL, NULL), 0);
            float *next = bufs[1 - cur];
            memcpy(next, g + t * n, n * 4); /* mode 0: the gradient buffer itself */
            memcpy(keep, bufs[cur], n * 4);
            float *out = next, *grad = alias == 0 ? next : g + t * n;
            if (alias == 2) out = bufs[cur];
            if (enc) {
              memset(h, 0xa5, n * 2);
              assert_int_equal(fps_adafactor_step_to_bf16(k, &hp, &so, bufs[cur], grad, out, h,
                                                          NULL, NULL, NULL),
                               0);
              fps__kernels_scalar.bf16_encode(ref, out, n);
              if (memcmp(h, ref, n * 2)) {
                print_error("%s shape %zu hp %zu mode %d step %d: bf16 is not bf16(params)\n",
                            variant, si, hi, mode, t);
                fail();
              }
            } else {
              assert_int_equal(
                  fps_adafactor_step_to(k, &hp, &so, bufs[cur], grad, out, NULL, NULL, NULL), 0);
            }
            if (alias == 2) continue; /* in place: bufs[cur] is the result */
            assert_memory_equal(keep, bufs[cur], n * 4); /* the published params stayed */
            cur = 1 - cur;
          }
          if (memcmp(pin, bufs[cur], n * 4)) {
            print_error("%s shape %zu hp %zu mode %d: params differ from in place\n", variant, si,
                        hi, mode);
            fail();
          }
          const float *as[] = {si_.row, si_.col, si_.var, si_.mom};
          const float *bs[] = {so.row, so.col, so.var, so.mom};
          const uint64_t ns[] = {si_.batch * si_.rows, si_.batch * si_.cols, n, n};
          for (int a = 0; a < 4; a++)
            if (as[a]) assert_memory_equal(as[a], bs[a], ns[a] * 4);
          assert_int_equal(si_.step, so.step);
          assert_int_equal(fps_adafactor_step_to(k, &hp, &so, bufs[cur], g, NULL, NULL, NULL, NULL),
                           FPS_EINVAL);
          fps_adafactor_state_destroy(&si_);
          fps_adafactor_state_destroy(&so);
          free(g), free(pin), free(bufs[0]), free(bufs[1]), free(keep), free(h), free(ref);
        }
}

static void step_to_scalar(void **u) { (void)u; step_to_parity("scalar"); }
#if defined(__x86_64__)
static void step_to_avx2(void **u) { (void)u; step_to_parity("avx2"); }
static void step_to_avx512(void **u) { (void)u; step_to_parity("avx512"); }
#endif
#if defined(__aarch64__)
static void step_to_neon(void **u) { (void)u; step_to_parity("neon"); }
#endif

int main(void) {
  /* A variant that cannot exist in this build is not a case at all; only
   * an ISA the CPU may lack at run time (AVX-512) skips. */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sum_scalar),   cmocka_unit_test(bf16_scalar),
      cmocka_unit_test(wire_in_scalar),
      cmocka_unit_test(out_scalar),   cmocka_unit_test(step_to_scalar),
#if defined(__x86_64__)
      cmocka_unit_test(out_avx2),     cmocka_unit_test(out_avx512),
      cmocka_unit_test(step_to_avx2), cmocka_unit_test(step_to_avx512),
      cmocka_unit_test(parity_avx2),  cmocka_unit_test(parity_avx512),
      cmocka_unit_test(steps_avx2),   cmocka_unit_test(steps_avx512),
      cmocka_unit_test(sum_avx2),     cmocka_unit_test(sum_avx512),
      cmocka_unit_test(bf16_avx2),    cmocka_unit_test(bf16_avx512),
      cmocka_unit_test(wire_in_avx2), cmocka_unit_test(wire_in_avx512),
#endif
#if defined(__aarch64__)
      cmocka_unit_test(parity_neon),  cmocka_unit_test(steps_neon),
      cmocka_unit_test(out_neon),     cmocka_unit_test(step_to_neon),
      cmocka_unit_test(sum_neon),     cmocka_unit_test(bf16_neon),
      cmocka_unit_test(wire_in_neon),
#endif
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

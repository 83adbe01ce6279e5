/* Row-split Adafactor (adafactor_split.h): block geometry, block state, the
 * partial sums' wire form, and one step in four stages (pass A -> combine
 * [-> explicit U^2] -> pass C).
 *
 * The passes are those of adafactor_step.c, run over the block's part of
 * each matrix it touches, with the same kernels, the same chunking (chunks
 * cut each run of rows by its length only, partials combined in chunk
 * order) and the same per-step scalars (adafactor_internal.h). Nothing is
 * written to the block's state or params before apply: pass A keeps the
 * new row statistics (and, unfactored, the new variance) in the step, so
 * an abandoned step leaves everything as it was.
 *
 * Exactness across blocks: mean(g^2) per column, mean(r), sum p^2 and
 * sum U^2 are sums over all rows; each block contributes its sums in
 * double and combine adds them in block order, so the result differs from
 * the whole-tensor step only by the order of double additions (far below
 * float32 rounding of the state and params). sum U^2 without a clamp is
 * m * sum_j S_j / c_j with the NEW c_j, which needs the old column state of
 * every matrix: each block sends its copy with its sums (4 B per column),
 * so one exchange per step suffices; torch's clamp fallback needs the new
 * state first and so a second exchange (phase u2). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adafactor_internal.h"
#include "adafactor_split.h"
#include "alloc.h"
#include "simd/kernels_impl.h"

#define PARTIALS_MAGIC UINT32_C(0x58535046) /* "FPSX" little-endian */
enum { KIND_FACTORED = 1, KIND_UNFACTORED = 2 };

/* ---- geometry ---------------------------------------------------------- */

uint64_t fps_split_total_rows(const fps_shape_t *shape) {
  uint64_t numel;
  if (!shape || fps_shape_validate(shape, &numel, NULL, 0)) return 0;
  if (shape->ndim < 2) return numel;
  return numel / shape->dim[shape->ndim - 1];
}

int fps_split_geom_init(fps_split_geom_t *g, const fps_shape_t *shape, uint64_t row_lo,
                        uint64_t row_hi, char *why, size_t why_len) {
  if (!g || !shape) return fps_errorf(FPS_EINVAL, why, why_len, "no geometry given");
  memset(g, 0, sizeof *g);
  uint64_t numel;
  int rc = fps_shape_validate(shape, &numel, why, why_len);
  if (rc) return rc;
  fps_split_geom_t n = {.shape = *shape, .numel = numel, .factored = shape->ndim >= 2};
  if (n.factored) {
    n.cols = shape->dim[shape->ndim - 1];
    n.rows = shape->dim[shape->ndim - 2];
    n.batch = numel / (n.rows * n.cols);
  } else {
    n.batch = 1;
    n.rows = numel;
    n.cols = 1;
  }
  const uint64_t total = n.batch * n.rows;
  if (!(row_lo < row_hi) || row_hi > total)
    return fps_errorf(FPS_EINVAL, why, why_len,
                    "block rows [%llu, %llu) are not a nonempty range within the %llu %s",
                    (unsigned long long)row_lo, (unsigned long long)row_hi,
                    (unsigned long long)total, n.factored ? "rows" : "elements");
  n.row_lo = row_lo;
  n.row_hi = row_hi;
  if (n.factored) {
    n.mtx_lo = row_lo / n.rows;
    n.nmat = (row_hi - 1) / n.rows - n.mtx_lo + 1;
  }
  n.block_numel = (row_hi - row_lo) * n.cols;
  *g = n;
  return 0;
}

int fps_split_bounds_validate(const fps_shape_t *shape, const uint64_t *bounds, size_t n,
                              char *why, size_t why_len) {
  uint64_t numel;
  int rc = fps_shape_validate(shape, &numel, why, why_len);
  if (rc) return rc;
  if (!bounds || n < 1 || n > FPS_SPLIT_MAX_BLOCKS)
    return fps_errorf(FPS_EINVAL, why, why_len, "%zu blocks: a split needs 1 to %d", n,
                    FPS_SPLIT_MAX_BLOCKS);
  const uint64_t total = fps_split_total_rows(shape);
  if (bounds[0] != 0)
    return fps_errorf(FPS_EINVAL, why, why_len, "block 0 starts at row %llu, not 0",
                    (unsigned long long)bounds[0]);
  for (size_t b = 0; b < n; b++)
    if (!(bounds[b] < bounds[b + 1]))
      return fps_errorf(FPS_EINVAL, why, why_len,
                      "block %zu has rows [%llu, %llu): block boundaries must increase", b,
                      (unsigned long long)bounds[b], (unsigned long long)bounds[b + 1]);
  if (bounds[n] != total)
    return fps_errorf(FPS_EINVAL, why, why_len, "the last block ends at row %llu, not at %llu",
                    (unsigned long long)bounds[n], (unsigned long long)total);
  return 0;
}

/* ---- block state ------------------------------------------------------- */

void fps_split_state_destroy(fps_split_state_t *st) {
  if (!st) return;
  fps_free(st->row);
  fps_free(st->col);
  fps_free(st->var);
  fps_free(st->mom);
  memset(st, 0, sizeof *st);
}

int fps_split_state_init(fps_split_state_t *st, const fps_split_geom_t *g,
                         const fps_adafactor_hparams_t *hp) {
  if (!st) return FPS_EINVAL;
  memset(st, 0, sizeof *st);
  if (!g || !hp || g->block_numel == 0) return FPS_EINVAL;
  int rc = fps_adafactor_validate(hp, NULL, 0);
  if (rc) return rc;
  st->g = *g;
  if (g->factored) {
    st->row = fps_calloc(g->row_hi - g->row_lo, sizeof(float));
    st->col = fps_calloc(g->nmat * g->cols, sizeof(float));
    if (!st->row || !st->col) goto nomem;
  } else {
    st->var = fps_calloc(g->block_numel, sizeof(float));
    if (!st->var) goto nomem;
  }
  if (hp->flavor == FPS_FLAVOR_HF && hp->has_beta1) {
    st->mom = fps_calloc(g->block_numel, sizeof(float));
    if (!st->mom) goto nomem;
  }
  return 0;
nomem:
  fps_split_state_destroy(st);
  return FPS_ENOMEM;
}

/* The block and the whole state are of one tensor and the same kinds. */
static bool state_matches(const fps_split_state_t *st, const fps_adafactor_state_t *w) {
  const fps_split_geom_t *g = &st->g;
  if (!w || g->numel != w->numel || g->shape.ndim != w->shape.ndim) return false;
  for (uint32_t d = 0; d < g->shape.ndim; d++)
    if (g->shape.dim[d] != w->shape.dim[d]) return false;
  if ((st->mom != NULL) != (w->mom != NULL)) return false;
  return g->factored ? st->row && st->col && w->row && w->col : st->var && w->var;
}

int fps_split_state_from_whole(fps_split_state_t *st, const fps_adafactor_state_t *whole) {
  if (!st || !state_matches(st, whole)) return FPS_EINVAL;
  const fps_split_geom_t *g = &st->g;
  if (g->factored) {
    memcpy(st->row, whole->row + g->row_lo, (g->row_hi - g->row_lo) * sizeof(float));
    memcpy(st->col, whole->col + g->mtx_lo * g->cols, g->nmat * g->cols * sizeof(float));
  } else {
    memcpy(st->var, whole->var + g->row_lo, g->block_numel * sizeof(float));
  }
  if (st->mom) memcpy(st->mom, whole->mom + g->row_lo * g->cols, g->block_numel * sizeof(float));
  st->step = whole->step;
  st->rms = whole->rms;
  return 0;
}

int fps_split_state_to_whole(const fps_split_state_t *st, fps_adafactor_state_t *whole) {
  if (!st || !state_matches(st, whole)) return FPS_EINVAL;
  const fps_split_geom_t *g = &st->g;
  if (g->factored) {
    memcpy(whole->row + g->row_lo, st->row, (g->row_hi - g->row_lo) * sizeof(float));
    memcpy(whole->col + g->mtx_lo * g->cols, st->col, g->nmat * g->cols * sizeof(float));
  } else {
    memcpy(whole->var + g->row_lo, st->var, g->block_numel * sizeof(float));
  }
  if (st->mom) memcpy(whole->mom + g->row_lo * g->cols, st->mom, g->block_numel * sizeof(float));
  whole->step = st->step;
  whole->rms = st->rms;
  return 0;
}

/* ---- wire form of the partials ------------------------------------------ */

size_t fps_split_partials_size(const fps_split_geom_t *g, int phase) {
  if (!g) return 0;
  if (phase == FPS_SPLIT_PHASE_STATS)
    return FPS_SPLIT_PARTIALS_HEADER + (g->factored ? g->nmat * (16 + 20 * g->cols) : 0);
  if (phase == FPS_SPLIT_PHASE_U2) return FPS_SPLIT_PARTIALS_HEADER + 8 * g->nmat;
  return 0;
}

static unsigned char *put_u64(unsigned char *b, uint64_t v) {
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
  return b + 8;
}
static unsigned char *put_f64(unsigned char *b, double d) {
  uint64_t v;
  memcpy(&v, &d, 8);
  return put_u64(b, v);
}
static unsigned char *put_f32(unsigned char *b, float f) {
  uint32_t v;
  memcpy(&v, &f, 4);
  for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
  return b + 4;
}
static uint64_t get_u64(const unsigned char *b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | b[i];
  return v;
}
static uint32_t get_u32(const unsigned char *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static double get_f64(const unsigned char *b) {
  uint64_t v = get_u64(b);
  double d;
  memcpy(&d, &v, 8);
  return d;
}
static float get_f32(const unsigned char *b) {
  uint32_t v = get_u32(b);
  float f;
  memcpy(&f, &v, 4);
  return f;
}

static size_t partials_size(const fps_split_partials_t *p) {
  fps_split_geom_t g = {.factored = p->factored, .cols = p->cols, .nmat = p->nmat};
  return fps_split_partials_size(&g, p->phase);
}

size_t fps_split_partials_encode(const fps_split_partials_t *p, void *buf, size_t cap) {
  if (!p || !buf) return 0;
  if (p->phase != FPS_SPLIT_PHASE_STATS && p->phase != FPS_SPLIT_PHASE_U2) return 0;
  if (!p->factored && (p->nmat || p->cols)) return 0;
  const size_t need = partials_size(p);
  if (cap < need) return 0;
  unsigned char *b = buf;
  b[0] = (unsigned char)(PARTIALS_MAGIC & 0xff);
  b[1] = (unsigned char)(PARTIALS_MAGIC >> 8 & 0xff);
  b[2] = (unsigned char)(PARTIALS_MAGIC >> 16 & 0xff);
  b[3] = (unsigned char)(PARTIALS_MAGIC >> 24);
  b[4] = FPS_SPLIT_PARTIALS_VERSION;
  b[5] = (unsigned char)p->phase;
  b[6] = p->factored ? KIND_FACTORED : KIND_UNFACTORED;
  b[7] = 0;
  b = put_u64(b + 8, p->row_lo);
  b = put_u64(b, p->row_hi);
  b = put_u64(b, p->cols);
  b = put_u64(b, p->mtx_lo);
  b = put_u64(b, p->nmat);
  const bool stats = p->phase == FPS_SPLIT_PHASE_STATS;
  b = put_f64(b, stats ? p->psq : 0.0);
  b = put_f64(b, stats ? p->u2 : 0.0);
  for (uint64_t m = 0; m < p->nmat; m++) {
    if (!stats) {
      b = put_f64(b, p->u2m[m]);
      continue;
    }
    b = put_f64(b, p->rsum[m]);
    b = put_f64(b, p->rmin[m]);
    for (uint64_t j = 0; j < p->cols; j++) b = put_f64(b, p->colsum[m * p->cols + j]);
    for (uint64_t j = 0; j < p->cols; j++) b = put_f64(b, p->s[m * p->cols + j]);
    for (uint64_t j = 0; j < p->cols; j++) b = put_f32(b, p->col_old[m * p->cols + j]);
  }
  return (size_t)(b - (unsigned char *)buf);
}

void fps_split_partials_free(fps_split_partials_t *p) {
  if (!p) return;
  fps_free(p->owned);
  memset(p, 0, sizeof *p);
}

static const char *phase_name(int phase) {
  return phase == FPS_SPLIT_PHASE_STATS ? "stats" : phase == FPS_SPLIT_PHASE_U2 ? "u2" : "unknown";
}

/* The fixed header: magic, version, phase, kind, reserved byte, and the
 * five fields into *p (arrays NULL). */
static int parse_header(const unsigned char *b, size_t len, int phase, fps_split_partials_t *p,
                        char *why, size_t why_len) {
  if (len < FPS_SPLIT_PARTIALS_HEADER)
    return fps_errorf(FPS_EFORMAT, why, why_len, "partials of %zu bytes: the header alone is %d",
                    len, FPS_SPLIT_PARTIALS_HEADER);
  if (get_u32(b) != PARTIALS_MAGIC)
    return fps_errorf(FPS_EFORMAT, why, why_len, "partials do not start with the magic \"FPSX\"");
  if (b[4] != FPS_SPLIT_PARTIALS_VERSION)
    return fps_errorf(FPS_EPROTO, why, why_len, "partials version %u, this shard reads %d", b[4],
                    FPS_SPLIT_PARTIALS_VERSION);
  if (b[5] != phase)
    return fps_errorf(FPS_EPROTO, why, why_len, "partials of phase %u (%s), expected %d (%s)", b[5],
                    phase_name(b[5]), phase, phase_name(phase));
  if (b[6] != KIND_FACTORED && b[6] != KIND_UNFACTORED)
    return fps_errorf(FPS_EFORMAT, why, why_len, "partials kind %u (expected 1 or 2)", b[6]);
  if (b[7] != 0) return fps_errorf(FPS_EFORMAT, why, why_len, "partials reserved byte is %u", b[7]);
  *p = (fps_split_partials_t){.phase = phase, .factored = b[6] == KIND_FACTORED};
  p->row_lo = get_u64(b + 8);
  p->row_hi = get_u64(b + 16);
  p->cols = get_u64(b + 24);
  p->mtx_lo = get_u64(b + 32);
  p->nmat = get_u64(b + 40);
  return 0;
}

/* Every sum a block's partials carry but S is a sum of squares (or a
 * minimum of row statistics, or column state), so finite and >= 0 from
 * any shard that validated its gradients; a NaN, Inf or negative one can only come
 * from a broken or hostile peer and would poison the whole tensor's step
 * on every shard. p: a header whose length already matched. */
static int check_values(const unsigned char *b, const fps_split_partials_t *p, char *why,
                        size_t why_len) {
  static const char *const hname[2] = {"sum p^2", "unfactored sum U^2"};
  for (int i = 0; i < 2; i++) {
    double v = get_f64(b + 48 + 8 * i);
    if (!(isfinite(v) && v >= 0.0))
      return fps_errorf(FPS_EFORMAT, why, why_len, "partials header %s is %g (must be finite, >= 0)",
                        hname[i], v);
  }
  const unsigned char *q = b + FPS_SPLIT_PARTIALS_HEADER;
  for (uint64_t m = 0; m < p->nmat; m++) {
    if (p->phase == FPS_SPLIT_PHASE_U2) {
      double v = get_f64(q);
      q += 8;
      if (!(isfinite(v) && v >= 0.0))
        return fps_errorf(FPS_EFORMAT, why, why_len,
                          "partials sum U^2 of matrix %llu is %g (must be finite, >= 0)",
                          (unsigned long long)m, v);
      continue;
    }
    /* S_j is not checked: an all-zero row makes it 0 * (1/0) = NaN on an
     * honest shard too (as in adafactor_step.c). */
    static const char *const field[3] = {"row-statistic sum", "row-statistic min",
                                         "column sum of g^2"};
    for (int f = 0; f < 4; f++) {
      uint64_t n = f < 2 ? 1 : p->cols;
      if (f == 3) {
        q += 8 * n;
        continue;
      }
      for (uint64_t j = 0; j < n; j++, q += 8) {
        double v = get_f64(q);
        if (!(isfinite(v) && v >= 0.0) && f < 2)
          return fps_errorf(FPS_EFORMAT, why, why_len,
                            "partials %s of matrix %llu is %g (must be finite, >= 0)", field[f],
                            (unsigned long long)m, v);
        if (!(isfinite(v) && v >= 0.0))
          return fps_errorf(FPS_EFORMAT, why, why_len,
                            "partials %s of matrix %llu, column %llu is %g (must be finite, >= 0)",
                            field[f], (unsigned long long)m, (unsigned long long)j, v);
      }
    }
    for (uint64_t j = 0; j < p->cols; j++, q += 4) {
      float v = get_f32(q);
      if (!(isfinite(v) && v >= 0.0f))
        return fps_errorf(FPS_EFORMAT, why, why_len,
                          "partials column state of matrix %llu, column %llu is %g (must be "
                          "finite, >= 0)",
                          (unsigned long long)m, (unsigned long long)j, (double)v);
    }
  }
  return 0;
}

int fps_split_partials_check(const void *buf, size_t len, int phase, fps_split_partials_t *hdr,
                             char *why, size_t why_len) {
  if (hdr) memset(hdr, 0, sizeof *hdr);
  if (!buf) return fps_errorf(FPS_EINVAL, why, why_len, "no partials given");
  fps_split_partials_t p = {0};
  int rc = parse_header(buf, len, phase, &p, why, why_len);
  if (rc) return rc;
  if (!(p.row_lo < p.row_hi))
  {
    char lo[FPS_U64_TEXT], hi[FPS_U64_TEXT];
    return fps_errorf(FPS_EFORMAT, why, why_len, "partials rows [%s, %s) are empty", fps_u64_text(p.row_lo, lo),
                      fps_u64_text(p.row_hi, hi));
  }
  if (!p.factored && (p.cols || p.mtx_lo || p.nmat))
    return fps_errorf(FPS_EFORMAT, why, why_len,
                    "unfactored partials name %llu columns and matrices %llu+%llu (must be 0)",
                    (unsigned long long)p.cols, (unsigned long long)p.mtx_lo,
                    (unsigned long long)p.nmat);
  if (!p.factored && phase == FPS_SPLIT_PHASE_U2)
    return fps_errorf(FPS_EPROTO, why, why_len, "unfactored partials have no u2 phase");
  if (p.factored && (!p.cols || !p.nmat))
    return fps_errorf(FPS_EFORMAT, why, why_len,
                    "factored partials of %llu columns and %llu matrices (both must be >= 1)",
                    (unsigned long long)p.cols, (unsigned long long)p.nmat);
  /* Body bytes per matrix, without overflow: only a length the message
   * really has can match. */
  const uint64_t body = (uint64_t)(len - FPS_SPLIT_PARTIALS_HEADER);
  bool fits;
  if (!p.factored) {
    fits = body == 0;
  } else if (phase == FPS_SPLIT_PHASE_STATS) {
    fits = p.cols <= (UINT64_MAX - 16) / 20 && body % (16 + 20 * p.cols) == 0 &&
           body / (16 + 20 * p.cols) == p.nmat;
  } else {
    fits = body % 8 == 0 && body / 8 == p.nmat;
  }
  if (!fits) {
    /* The size the header implies, in words where it passes 64 bits. */
    char need[64], nm[FPS_U64_TEXT], nc[FPS_U64_TEXT];
    const uint64_t per = !p.factored ? 0 : phase == FPS_SPLIT_PHASE_STATS ? 16 + 20 * p.cols : 8;
    bool big = !p.factored ? false
               : phase == FPS_SPLIT_PHASE_STATS && p.cols > (UINT64_MAX - 16) / 20 ? true
                                                                                  : p.nmat > (UINT64_MAX - 64) / per;
    if (big) snprintf(need, sizeof need, "more than 2^64 bytes");
    else snprintf(need, sizeof need, "%llu bytes", (unsigned long long)(64 + p.nmat * per));
    return fps_errorf(FPS_EFORMAT, why, why_len,
                      "partials of %zu bytes do not match their header (%s %s of %s columns: %s)", len,
                      fps_u64_text(p.nmat, nm), p.nmat == 1 ? "matrix" : "matrices", fps_u64_text(p.cols, nc),
                      need);
  }
  rc = check_values(buf, &p, why, why_len);
  if (rc) return rc;
  if (hdr) *hdr = p;
  return 0;
}

int fps_split_partials_decode(const void *buf, size_t len, const fps_split_geom_t *expect,
                              int phase, fps_split_partials_t *out, char *why, size_t why_len) {
  if (!out) return fps_errorf(FPS_EINVAL, why, why_len, "no output given");
  memset(out, 0, sizeof *out);
  if (!buf || !expect) return fps_errorf(FPS_EINVAL, why, why_len, "no partials or block given");
  const unsigned char *b = buf;
  fps_split_partials_t p = {0};
  int rc = parse_header(b, len, phase, &p, why, why_len);
  if (rc) return rc;
  const uint64_t ecols = expect->factored ? expect->cols : 0;
  if (p.factored != expect->factored || p.row_lo != expect->row_lo ||
      p.row_hi != expect->row_hi || p.cols != ecols || p.mtx_lo != expect->mtx_lo ||
      p.nmat != expect->nmat)
    return fps_errorf(FPS_EPROTO, why, why_len,
                    "partials are for %s rows [%llu, %llu) of %llu columns, matrices %llu+%llu; "
                    "expected %s rows [%llu, %llu) of %llu columns, matrices %llu+%llu",
                    p.factored ? "factored" : "unfactored", (unsigned long long)p.row_lo,
                    (unsigned long long)p.row_hi, (unsigned long long)p.cols,
                    (unsigned long long)p.mtx_lo, (unsigned long long)p.nmat,
                    expect->factored ? "factored" : "unfactored",
                    (unsigned long long)expect->row_lo, (unsigned long long)expect->row_hi,
                    (unsigned long long)ecols, (unsigned long long)expect->mtx_lo,
                    (unsigned long long)expect->nmat);
  /* The geometry matched a validated block, so this size cannot overflow. */
  const size_t need = partials_size(&p);
  if (len != need)
    return fps_errorf(FPS_EFORMAT, why, why_len, "partials of %zu bytes, expected %zu for this block",
                    len, need);
  p.psq = get_f64(b + 48);
  p.u2 = get_f64(b + 56);
  if (phase == FPS_SPLIT_PHASE_U2 && (p.psq != 0.0 || p.u2 != 0.0 || signbit(p.psq) ||
                                      signbit(p.u2)))
    return fps_errorf(FPS_EFORMAT, why, why_len, "u2 partials carry nonzero header sums");
  rc = check_values(b, &p, why, why_len);
  if (rc) return rc;
  const bool stats = phase == FPS_SPLIT_PHASE_STATS;
  const size_t nd = stats ? (size_t)(p.nmat * (2 + 2 * p.cols)) : (size_t)p.nmat;
  const size_t nf = stats ? (size_t)(p.nmat * p.cols) : 0;
  void *mem = fps_malloc(nd * sizeof(double) + nf * sizeof(float) + 1);
  if (!mem) return fps_errorf(FPS_ENOMEM, why, why_len, "no memory for %zu bytes of partials", len);
  double *d = mem;
  float *f = (float *)(d + nd);
  const unsigned char *q = b + FPS_SPLIT_PARTIALS_HEADER;
  if (stats) {
    p.rsum = d;
    p.rmin = d + p.nmat;
    p.colsum = d + 2 * p.nmat;
    p.s = p.colsum + p.nmat * p.cols;
    p.col_old = f;
  } else {
    p.u2m = d;
  }
  for (uint64_t m = 0; m < p.nmat; m++) {
    if (!stats) {
      p.u2m[m] = get_f64(q);
      q += 8;
      continue;
    }
    p.rsum[m] = get_f64(q);
    p.rmin[m] = get_f64(q + 8);
    q += 16;
    for (uint64_t j = 0; j < p.cols; j++, q += 8) p.colsum[m * p.cols + j] = get_f64(q);
    for (uint64_t j = 0; j < p.cols; j++, q += 8) p.s[m * p.cols + j] = get_f64(q);
    for (uint64_t j = 0; j < p.cols; j++, q += 4) p.col_old[m * p.cols + j] = get_f32(q);
  }
  p.owned = mem;
  *out = p;
  return 0;
}

/* ---- the step ---------------------------------------------------------- */

enum { STAGE_BEGUN = 1, STAGE_COMBINED, STAGE_READY, STAGE_APPLIED };

struct fps_split_step_s {
  const fps_kernels_t *k;
  fps_adafactor_hparams_t hp;
  fps__step_scalars_t sc;
  fps_split_state_t *st;
  float *param;
  const float *grad;
  fps_pool_t *pool;
  int stage;
  bool needs_u2;
  float *new_row;             /* factored: the block's new row statistics */
  float *new_col;             /* factored: nmat * cols, new column state */
  float *colf;                /* factored: cols, pass C's 1/sqrt(c_j) (made at begin so
                                 that apply cannot fail) */
  float *new_var;             /* unfactored: the block's new variance */
  double *m;                  /* factored: nmat, mean(r) of each touched matrix */
  bool *expl;                 /* factored: nmat, torch clamp may bind there */
  double *u2mat;              /* factored: batch, each matrix's sum U^2 (combine) */
  bool *expl_all;             /* factored: batch */
  double *acc;                /* factored: 2 * cols, combine's column sums */
  float *colc;                /* factored: cols, combine's new column state */
  /* Everything combine and the U2 phase need is allocated at begin: a
   * shard that has acknowledged its peers' partials must not fail for
   * want of memory (they may apply; it would diverge). */
  double psq, u2;             /* the whole tensor's */
  fps_split_partials_t part;  /* this block's stats partials */
  fps_split_partials_t part_u2;
  void *part_mem;             /* storage of part's arrays */
  void *u2_mem;               /* storage of part_u2's array (factored) */
  bool u2_done;               /* part_u2 computed */
  fps__step_result_t res;
  bool explicit_rms;
  uint64_t bytes;
};

/* Pass A over one run of rows of one matrix inside the block, cut into
 * chunks: unlike the whole step's it keeps the old row state (the step
 * must change nothing before apply) and also sums and bounds the new rows
 * for the exchange. The later passes are the whole step's (fps__fact_*). */
typedef struct seg_ctx_s {
  const fps_kernels_t *k;
  const fps__step_scalars_t *sc;
  size_t rows, cols, nchunks;
  const float *g;
  const float *p;
  const float *row_old;
  float *row_new;
  double *scratch; /* nchunks x (col partial, S partial), each cols long */
  double psq[FPS_STEP_MAX_CHUNKS], rsum[FPS_STEP_MAX_CHUNKS], rmin[FPS_STEP_MAX_CHUNKS];
} seg_ctx_t;

static void seg_pass_a(void *arg, size_t ck) {
  seg_ctx_t *c = arg;
  const size_t C = c->cols;
  double *col = c->scratch + 2 * C * ck, *s = col + C;
  memset(col, 0, 2 * C * sizeof(double));
  double psq = 0, rsum = 0, rmin = INFINITY;
  const uint64_t lo = fps__chunk_lo(c->rows, c->nchunks, ck);
  const uint64_t hi = fps__chunk_lo(c->rows, c->nchunks, ck + 1);
  for (uint64_t i = lo; i < hi; i++) {
    double gsq, ps;
    c->k->row_stats(c->g + i * C, c->p + i * C, C, col, &gsq, &ps);
    psq += ps;
    float r = (float)fps__stat_update(c->sc, c->row_old[i], gsq / (double)C);
    c->row_new[i] = r;
    rsum += r;
    if (r < rmin) rmin = r;
    /* 1/0 = inf for an all-zero row: as in adafactor_step.c */
    c->k->row_scaled(c->g + i * C, C, 1.0 / (double)r, s);
  }
  c->psq[ck] = psq;
  c->rsum[ck] = rsum;
  c->rmin[ck] = rmin;
}

/* The block's rows of its local matrix lm: [*a, *b) in block-local rows. */
static void seg_rows(const fps_split_geom_t *g, uint64_t lm, uint64_t *a, uint64_t *b) {
  uint64_t mtx = g->mtx_lo + lm;
  uint64_t lo = mtx * g->rows, hi = lo + g->rows;
  if (lo < g->row_lo) lo = g->row_lo;
  if (hi > g->row_hi) hi = g->row_hi;
  *a = lo - g->row_lo;
  *b = hi - g->row_lo;
}

/* Scratch for the largest run of rows of the block. */
static double *seg_scratch(const fps_split_geom_t *g) {
  size_t most = 1;
  for (uint64_t lm = 0; lm < g->nmat; lm++) {
    uint64_t a, b;
    seg_rows(g, lm, &a, &b);
    size_t nc = fps__chunk_count(b - a, g->cols);
    if (nc > most) most = nc;
  }
  return fps_malloc(2 * most * g->cols * sizeof(double));
}

void fps_split_step_free(fps_split_step_t *s) {
  if (!s) return;
  fps_free(s->new_row);
  fps_free(s->new_col);
  fps_free(s->colf);
  fps_free(s->new_var);
  fps_free(s->m);
  fps_free(s->expl);
  fps_free(s->u2mat);
  fps_free(s->expl_all);
  fps_free(s->acc);
  fps_free(s->colc);
  fps_free(s->part_mem);
  fps_free(s->u2_mem);
  fps_free(s);
}

static int begin_factored(fps_split_step_t *s) {
  const fps_split_geom_t *g = &s->st->g;
  const size_t C = (size_t)g->cols, nm = (size_t)g->nmat, nr = (size_t)(g->row_hi - g->row_lo);
  s->new_row = fps_malloc(nr * sizeof(float));
  s->new_col = fps_malloc(nm * C * sizeof(float));
  s->colf = fps_malloc(C * sizeof(float));
  s->m = fps_malloc(nm * sizeof(double));
  s->expl = fps_calloc(nm, sizeof(bool));
  s->part_mem = fps_malloc(nm * (2 + 2 * C) * sizeof(double));
  const size_t M = (size_t)g->batch;
  s->u2mat = fps_calloc(M, sizeof(double));
  s->expl_all = fps_calloc(M, sizeof(bool));
  s->acc = fps_malloc(2 * C * sizeof(double));
  s->colc = fps_malloc(C * sizeof(float));
  s->u2_mem = fps_calloc(nm ? nm : 1, sizeof(double));
  double *scratch = seg_scratch(g);
  if (!s->new_row || !s->new_col || !s->colf || !s->m || !s->expl || !s->part_mem || !s->u2mat ||
      !s->expl_all || !s->acc || !s->colc || !s->u2_mem || !scratch) {
    fps_free(scratch);
    return FPS_ENOMEM;
  }
  fps_split_partials_t *p = &s->part;
  double *d = s->part_mem;
  p->rsum = d;
  p->rmin = d + nm;
  p->colsum = d + 2 * nm;
  p->s = p->colsum + nm * C;
  /* The old column state goes out as it is: the step must not change it
   * before apply, so the state's own array is the partials' copy. */
  p->col_old = s->st->col;
  seg_ctx_t c = {.k = s->k, .sc = &s->sc, .cols = C, .scratch = scratch};
  double psq = 0;
  for (size_t lm = 0; lm < nm; lm++) {
    uint64_t a, b;
    seg_rows(g, lm, &a, &b);
    c.rows = (size_t)(b - a);
    c.nchunks = fps__chunk_count(b - a, C);
    c.g = s->grad + a * C;
    c.p = s->param + a * C;
    c.row_old = s->st->row + a;
    c.row_new = s->new_row + a;
    fps_pool_run(s->pool, c.nchunks, seg_pass_a, &c);
    double rsum = 0, rmin = INFINITY;
    for (size_t ck = 0; ck < c.nchunks; ck++) {
      psq += c.psq[ck];
      rsum += c.rsum[ck];
      if (c.rmin[ck] < rmin) rmin = c.rmin[ck];
    }
    p->rsum[lm] = rsum;
    p->rmin[lm] = rmin;
    /* the chunks' column partials, in chunk order */
    for (size_t j = 0; j < C; j++) {
      double cs = scratch[j], ss = scratch[C + j];
      for (size_t ck = 1; ck < c.nchunks; ck++) {
        cs += scratch[2 * C * ck + j];
        ss += scratch[2 * C * ck + C + j];
      }
      p->colsum[lm * C + j] = cs;
      p->s[lm * C + j] = ss;
    }
  }
  p->psq = psq;
  fps_free(scratch);
  return 0;
}

static int begin_unfactored(fps_split_step_t *s) {
  const fps_split_geom_t *g = &s->st->g;
  const size_t n = (size_t)g->block_numel;
  s->new_var = fps_malloc(n * sizeof(float));
  if (!s->new_var) return FPS_ENOMEM;
  memcpy(s->new_var, s->st->var, n * sizeof(float));
  fps__var_ctx_t c = {.k = s->k, .sc = &s->sc, .n = n, .nchunks = fps__chunk_count(n, 1),
                 .g = s->grad, .p = s->param, .v = s->new_var,
                 .a = (float)(1.0 - s->sc.w), .b = (float)s->sc.w,
                 .e = s->sc.hf ? (float)s->hp.eps1 : 0.0f};
  fps_pool_run(s->pool, c.nchunks, fps__var_pass_a, &c);
  double psq = 0, u2 = 0;
  for (size_t ck = 0; ck < c.nchunks; ck++) {
    psq += c.psq[ck];
    u2 += c.u2[ck];
  }
  s->part.psq = psq;
  s->part.u2 = u2;
  return 0;
}

int fps_split_step_begin(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                         fps_split_state_t *st, float *param, const float *grad,
                         fps_pool_t *pool, fps_split_step_t **out) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  if (!hp || !st || !param || !grad || st->g.block_numel == 0) return FPS_EINVAL;
  int rc = fps_adafactor_validate(hp, NULL, 0);
  if (rc) return rc;
  const bool hf = hp->flavor == FPS_FLAVOR_HF;
  if ((hf && hp->has_beta1) != (st->mom != NULL) ||
      (st->g.factored ? !st->row || !st->col : !st->var))
    return FPS_EINVAL; /* state made for other settings */
  fps_split_step_t *s = fps_calloc(1, sizeof *s);
  if (!s) return FPS_ENOMEM;
  s->k = k ? k : fps_kernels_best();
  s->hp = *hp;
  fps__step_scalars_init(&s->sc, hp, st->step);
  s->st = st;
  s->param = param;
  s->grad = grad;
  s->pool = pool;
  const fps_split_geom_t *g = &st->g;
  s->part = (fps_split_partials_t){.phase = FPS_SPLIT_PHASE_STATS, .factored = g->factored,
                                   .row_lo = g->row_lo, .row_hi = g->row_hi,
                                   .cols = g->factored ? g->cols : 0, .mtx_lo = g->mtx_lo,
                                   .nmat = g->nmat};
  rc = g->factored ? begin_factored(s) : begin_unfactored(s);
  if (rc) {
    fps_split_step_free(s);
    return rc;
  }
  /* Traffic of this block's passes, counted as adafactor_step.c does. */
  uint64_t per = g->factored ? 20 : 32;
  if (st->mom) per += 8;
  s->bytes = per * g->block_numel;
  if (g->factored) s->bytes += 8 * ((g->row_hi - g->row_lo) + g->nmat * g->cols);
  s->stage = STAGE_BEGUN;
  *out = s;
  return 0;
}

const fps_split_partials_t *fps_split_step_partials(const fps_split_step_t *s) {
  return s ? &s->part : NULL;
}

/* parts[0..n) must be phase `phase` partials tiling the tensor's rows in
 * order, of this tensor's kind and columns, one of them this block. */
static int check_tiling(const fps_split_step_t *s, const fps_split_partials_t *parts, size_t n,
                        int phase, char *why, size_t why_len) {
  const fps_split_geom_t *g = &s->st->g;
  if (!parts || n < 1 || n > FPS_SPLIT_MAX_BLOCKS)
    return fps_errorf(FPS_EINVAL, why, why_len, "%zu blocks' partials: expected 1 to %d", n,
                    FPS_SPLIT_MAX_BLOCKS);
  const uint64_t total = g->batch * g->rows, cols = g->factored ? g->cols : 0;
  uint64_t next = 0;
  bool self = false;
  for (size_t b = 0; b < n; b++) {
    const fps_split_partials_t *p = &parts[b];
    if (p->phase != phase || p->factored != g->factored || p->cols != cols)
      return fps_errorf(FPS_EINVAL, why, why_len,
                      "block %zu's partials are of phase %d, %s, %llu columns; expected phase %d, "
                      "%s, %llu columns",
                      b, p->phase, p->factored ? "factored" : "unfactored",
                      (unsigned long long)p->cols, phase, g->factored ? "factored" : "unfactored",
                      (unsigned long long)cols);
    if (p->row_lo != next || !(p->row_lo < p->row_hi) || p->row_hi > total)
      return fps_errorf(FPS_EINVAL, why, why_len,
                      "block %zu's partials cover rows [%llu, %llu); the blocks must tile "
                      "[0, %llu) in order and the next row is %llu",
                      b, (unsigned long long)p->row_lo, (unsigned long long)p->row_hi,
                      (unsigned long long)total, (unsigned long long)next);
    if (g->factored) {
      uint64_t ml = p->row_lo / g->rows, nm = (p->row_hi - 1) / g->rows - ml + 1;
      if (p->mtx_lo != ml || p->nmat != nm)
        return fps_errorf(FPS_EINVAL, why, why_len,
                        "block %zu's partials name matrices %llu+%llu, its rows touch %llu+%llu",
                        b, (unsigned long long)p->mtx_lo, (unsigned long long)p->nmat,
                        (unsigned long long)ml, (unsigned long long)nm);
      const bool arrays = phase == FPS_SPLIT_PHASE_STATS
                              ? p->rsum && p->rmin && p->colsum && p->s && p->col_old
                              : p->u2m != NULL;
      if (!arrays)
        return fps_errorf(FPS_EINVAL, why, why_len, "block %zu's partials lack their arrays", b);
    } else if (p->nmat != 0 || p->mtx_lo != 0) {
      return fps_errorf(FPS_EINVAL, why, why_len, "block %zu's unfactored partials name matrices",
                      b);
    }
    if (p->row_lo == g->row_lo && p->row_hi == g->row_hi) self = true;
    next = p->row_hi;
  }
  if (next != total)
    return fps_errorf(FPS_EINVAL, why, why_len, "the blocks' partials end at row %llu, not %llu",
                    (unsigned long long)next, (unsigned long long)total);
  if (!self)
    return fps_errorf(FPS_EINVAL, why, why_len,
                    "no block's partials are this block's rows [%llu, %llu)",
                    (unsigned long long)g->row_lo, (unsigned long long)g->row_hi);
  return 0;
}

/* The whole-tensor scalars of pass C. Honest partials (finite gradients
 * below the shard's limit) always give finite ones; a peer's corrupt sums
 * (finite, but overflowing once added) may not, and pass C would then write
 * NaN into every block. Every shard combines the same bytes, so every shard
 * refuses alike. Returns 0, or FPS_ESTATE with why (the step stays
 * combinable: nothing changed). */
static int finish_scalars(fps_split_step_t *s, char *why, size_t why_len) {
  const fps_split_geom_t *g = &s->st->g;
  double u2 = s->u2;
  if (g->factored) {
    u2 = 0;
    for (uint64_t mtx = 0; mtx < g->batch; mtx++) u2 += s->u2mat[mtx];
  }
  fps__step_result_t res;
  fps__step_result(&s->hp, &s->sc, s->psq, u2, g->numel, &res);
  if (!isfinite(res.pmul) || !isfinite(res.step_size) || !isfinite(res.rms_f))
    return fps_errorf(FPS_ESTATE, why, why_len,
                      "the blocks' partial sums give a non-finite step (sum p^2 %g, sum U^2 %g): a "
                      "peer's sums are corrupt",
                      s->psq, u2);
  s->u2 = u2;
  s->res = res;
  s->stage = STAGE_READY;
  return 0;
}

int fps_split_step_combine(fps_split_step_t *s, const fps_split_partials_t *parts, size_t n,
                           char *why, size_t why_len) {
  if (!s || s->stage != STAGE_BEGUN)
    return fps_errorf(FPS_EINVAL, why, why_len, "combine needs a step that has just begun");
  int rc = check_tiling(s, parts, n, FPS_SPLIT_PHASE_STATS, why, why_len);
  if (rc) return rc;
  const fps_split_geom_t *g = &s->st->g;
  double psq = 0;
  for (size_t b = 0; b < n; b++) psq += parts[b].psq;
  s->psq = psq;
  if (!g->factored) {
    double u2 = 0;
    for (size_t b = 0; b < n; b++) u2 += parts[b].u2;
    s->u2 = u2;
    return finish_scalars(s, why, why_len);
  }

  const size_t C = (size_t)g->cols, M = (size_t)g->batch;
  double *acc = s->acc; /* allocated at begin: combine cannot run out of memory */
  float *col = s->colc;
  bool any_expl = false;
  size_t first = 0; /* the first block touching matrix mtx */
  for (uint64_t mtx = 0; mtx < M; mtx++) {
    while (parts[first].mtx_lo + parts[first].nmat <= mtx) first++;
    const fps_split_partials_t *p0 = &parts[first];
    const float *old = p0->col_old + (mtx - p0->mtx_lo) * C;
    memset(acc, 0, 2 * C * sizeof(double));
    double rsum = 0, rmin = INFINITY;
    for (size_t b = first; b < n && parts[b].mtx_lo <= mtx; b++) {
      const fps_split_partials_t *p = &parts[b];
      const size_t lm = (size_t)(mtx - p->mtx_lo);
      if (b > first && memcmp(p->col_old + lm * C, old, C * sizeof(float))) {
        rc = fps_errorf(FPS_ESTATE, why, why_len,
                      "the column state of matrix %llu differs between blocks %zu and %zu",
                      (unsigned long long)mtx, first, b);
        goto fail;
      }
      for (size_t j = 0; j < C; j++) {
        acc[j] += p->colsum[lm * C + j];
        acc[C + j] += p->s[lm * C + j];
      }
      rsum += p->rsum[lm];
      if (p->rmin[lm] < rmin) rmin = p->rmin[lm];
    }
    double ssum = 0, cmin = INFINITY;
    for (size_t j = 0; j < C; j++) {
      col[j] = (float)fps__stat_update(&s->sc, old[j], acc[j] / (double)g->rows);
      ssum += acc[C + j] / (double)col[j];
      if (col[j] < cmin) cmin = col[j];
    }
    double m;
    bool expl = fps__fact_factors(&s->sc, rsum, g->rows, rmin, cmin, &m);
    /* As finish_scalars: only corrupt sums make these non-finite. */
    bool finite = isfinite(m) && (expl || isfinite(ssum)); /* ssum unused when explicit */
    for (size_t j = 0; finite && j < C; j++) finite = isfinite(col[j]);
    if (!finite) {
      rc = fps_errorf(FPS_ESTATE, why, why_len,
                      "the blocks' partial sums give a non-finite column statistic of matrix %llu: a "
                      "peer's sums are corrupt",
                      (unsigned long long)mtx);
      goto fail;
    }
    s->expl_all[mtx] = expl;
    s->u2mat[mtx] = expl ? 0.0 : m * ssum;
    any_expl |= expl;
    if (mtx >= g->mtx_lo && mtx < g->mtx_lo + g->nmat) {
      const size_t lm = (size_t)(mtx - g->mtx_lo);
      memcpy(s->new_col + lm * C, col, C * sizeof(float));
      s->m[lm] = m;
      s->expl[lm] = expl;
    }
  }
  s->explicit_rms = any_expl;
  if (any_expl) {
    s->needs_u2 = true;
    s->stage = STAGE_COMBINED;
  } else if ((rc = finish_scalars(s, why, why_len)) < 0) {
    goto fail;
  }
  return 0;
fail:
  /* nothing of the step changed (u2mat and expl_all are rewritten for
   * every matrix): combine may be called again */
  return rc;
}

bool fps_split_step_needs_u2(const fps_split_step_t *s) { return s && s->needs_u2; }

const fps_split_partials_t *fps_split_step_u2(fps_split_step_t *s) {
  if (!s || s->stage != STAGE_COMBINED || !s->needs_u2) return NULL;
  if (s->u2_done) return &s->part_u2;
  const fps_split_geom_t *g = &s->st->g;
  const size_t C = (size_t)g->cols, nm = (size_t)g->nmat;
  double *u2m = s->u2_mem; /* zeroed at begin */
  fps__fact_ctx_t c = {.k = s->k, .sc = &s->sc, .cols = C};
  for (size_t lm = 0; lm < nm; lm++) {
    if (!s->expl[lm]) continue;
    uint64_t a, b;
    seg_rows(g, lm, &a, &b);
    c.rows = (size_t)(b - a);
    c.nchunks = fps__chunk_count(b - a, C);
    c.g = s->grad + a * C;
    c.row = s->new_row + a;
    c.col = s->new_col + lm * C;
    c.m = s->m[lm];
    fps_pool_run(s->pool, c.nchunks, fps__fact_pass_u2, &c);
    double u2 = 0;
    for (size_t ck = 0; ck < c.nchunks; ck++) u2 += c.u2[ck];
    u2m[lm] = u2;
    s->bytes += 4 * (b - a) * C;
  }
  s->u2_done = true;
  s->part_u2 = (fps_split_partials_t){.phase = FPS_SPLIT_PHASE_U2, .factored = true,
                                      .row_lo = g->row_lo, .row_hi = g->row_hi, .cols = g->cols,
                                      .mtx_lo = g->mtx_lo, .nmat = g->nmat, .u2m = u2m};
  return &s->part_u2;
}

int fps_split_step_combine_u2(fps_split_step_t *s, const fps_split_partials_t *parts, size_t n,
                              char *why, size_t why_len) {
  if (!s || s->stage != STAGE_COMBINED || !s->needs_u2)
    return fps_errorf(FPS_EINVAL, why, why_len, "no u2 phase is due for this step");
  int rc = check_tiling(s, parts, n, FPS_SPLIT_PHASE_U2, why, why_len);
  if (rc) return rc;
  const fps_split_geom_t *g = &s->st->g;
  size_t first = 0;
  for (uint64_t mtx = 0; mtx < g->batch; mtx++) {
    while (parts[first].mtx_lo + parts[first].nmat <= mtx) first++;
    if (!s->expl_all[mtx]) continue;
    double u2 = 0;
    for (size_t b = first; b < n && parts[b].mtx_lo <= mtx; b++)
      u2 += parts[b].u2m[mtx - parts[b].mtx_lo];
    s->u2mat[mtx] = u2;
  }
  return finish_scalars(s, why, why_len);
}

int fps_split_step_apply(fps_split_step_t *s, fps_adafactor_trace_t *trace) {
  return fps_split_step_apply_to(s, s ? s->param : NULL, trace);
}

int fps_split_step_apply_to(fps_split_step_t *s, float *out, fps_adafactor_trace_t *trace) {
  if (!s || !out || s->stage != STAGE_READY) return FPS_EINVAL;
  fps_split_state_t *st = s->st;
  const fps_split_geom_t *g = &st->g;
  const float pmul = (float)s->res.pmul, step = (float)(s->sc.sign * s->res.step_size);
  if (g->factored) {
    const size_t C = (size_t)g->cols;
    float *colf = s->colf;
    fps__fact_ctx_t c = {.k = s->k, .sc = &s->sc, .cols = C, .pmul = pmul, .s = step};
    for (size_t lm = 0; lm < g->nmat; lm++) {
      uint64_t a, b;
      seg_rows(g, lm, &a, &b);
      c.rows = (size_t)(b - a);
      c.nchunks = fps__chunk_count(b - a, C);
      c.g = s->grad + a * C;
      c.p = s->param + a * C;
      c.out = out + a * C;
      c.mom = st->mom ? st->mom + a * C : NULL;
      c.row = s->new_row + a;
      c.col = s->new_col + lm * C;
      c.m = s->m[lm];
      if (s->expl[lm]) {
        c.colf = NULL;
      } else {
        for (size_t j = 0; j < C; j++) colf[j] = 1.0f / sqrtf(c.col[j]);
        c.colf = colf;
      }
      fps_pool_run(s->pool, c.nchunks, fps__fact_pass_c, &c);
    }
    memcpy(st->row, s->new_row, (g->row_hi - g->row_lo) * sizeof(float));
    memcpy(st->col, s->new_col, g->nmat * C * sizeof(float));
  } else {
    const size_t n = (size_t)g->block_numel;
    fps__var_ctx_t c = {.k = s->k, .sc = &s->sc, .n = n, .nchunks = fps__chunk_count(n, 1),
                   .g = s->grad, .p = s->param, .out = out, .v = s->new_var, .mom = st->mom,
                   .pmul = pmul, .s = step};
    fps_pool_run(s->pool, c.nchunks, fps__var_pass_c, &c);
    memcpy(st->var, s->new_var, n * sizeof(float));
  }
  st->step = s->sc.new_step;
  if (s->sc.hf) st->rms = s->res.rms_f;
  s->stage = STAGE_APPLIED;
  if (trace) {
    trace->step = s->sc.new_step;
    trace->rel_step = s->res.rel;
    trace->rms_param = s->res.rms_param;
    trace->lr = s->res.lr_eff;
    trace->beta2t = 1.0 - s->sc.w;
    trace->rms_update = s->res.rms_u;
    trace->clip_denom = s->res.denom;
    trace->step_size = s->res.step_size;
    trace->explicit_rms = s->explicit_rms;
    trace->bytes = s->bytes;
  }
  return 0;
}

/* Row-split Adafactor: one step of a tensor whose rows are cut into
 * contiguous blocks held by different shards, giving the update of the
 * whole tensor (exactly the math of fps_adafactor_step(), up to the order
 * of the double-precision sums).
 *
 * Geometry. A tensor of shape [..., R, C] (ndim >= 2) is M = prod(leading
 * dims) matrices of R x C, i.e. M*R flattened rows of C contiguous floats.
 * A block is the rows [row_lo, row_hi) = elements [row_lo*C, row_hi*C); it
 * may span matrix boundaries and then holds the column state of every
 * matrix it touches. A 0-D or 1-D tensor is cut into element ranges (it
 * keeps a full variance: each block holds its elements' variance).
 *
 * One step of block b, on the shard holding it:
 *   1. fps_split_step_begin(): pass A over the block's rows. Computes the
 *      block's partial sums (per touched matrix: column sums of g^2, the sum
 *      of S_j = sum_i g_ij^2 / r_i, the sum and the minimum of its rows' new
 *      row statistics, and its copy of the old column state; sum p^2 of the
 *      block; unfactored: sum U^2 of the block). Changes nothing yet.
 *   2. Every block's partials go to every shard holding a block of the
 *      tensor (fps_split_partials_encode / _decode: the wire form).
 *   3. fps_split_step_combine() with all blocks' partials IN BLOCK ORDER:
 *      the whole-tensor sums, the new column state, RMS(param) and, when no
 *      torch clamp can bind, RMS(U). Every shard combines the same bytes in
 *      the same order, so every shard gets the same bits.
 *   3b. Only torch, only when its clamp V >= eps1^2 may bind for some
 *      matrix (tiny gradients): RMS(U) needs an explicit pass over g with
 *      the new column state, i.e. a second exchange: fps_split_step_u2()
 *      gives this block's sums (one double per touched matrix), and
 *      fps_split_step_combine_u2() combines every block's, in block order.
 *   4. fps_split_step_apply(): pass C on the block's rows, then commits the
 *      new row/column/variance state, the step count and (hf) RMS.
 * fps_split_step_free() before apply abandons the step: the state, params
 * and momentum are exactly as before begin (a peer that did not answer
 * leaves every block unchanged).
 *
 * The column state of a matrix spanning several blocks is held by each of
 * them; combine checks their copies are bit-identical (FPS_ESTATE names the
 * matrix and the blocks otherwise) and every shard writes the same new
 * column state, so they stay identical.
 *
 * Thread-safety: reentrant; one block state must not be used by two steps
 * at once. */
#ifndef FPS_ADAFACTOR_SPLIT_H
#define FPS_ADAFACTOR_SPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"

/* Wire form of partials (fps_split_partials_encode), version 1. */
#define FPS_SPLIT_PARTIALS_VERSION 1
#define FPS_SPLIT_PARTIALS_HEADER 64 /* bytes before the per-matrix data */

/* Most blocks a tensor may be cut into (a block per shard). */
#define FPS_SPLIT_MAX_BLOCKS 4096

enum {
  FPS_SPLIT_PHASE_STATS = 1, /* pass A's partials (every step) */
  FPS_SPLIT_PHASE_U2 = 2,    /* torch's explicit sum U^2 (when a clamp may bind) */
};

/* Where one block lies in its tensor. */
typedef struct fps_split_geom_s {
  fps_shape_t shape;            /* the whole tensor's */
  uint64_t numel;               /* the whole tensor's */
  bool factored;                /* ndim >= 2 */
  uint64_t batch, rows, cols;   /* factored: M, R, C; unfactored: 1, numel, 1 */
  uint64_t row_lo, row_hi;      /* the block: flattened rows (unfactored: elements) */
  uint64_t mtx_lo, nmat;        /* factored: the matrices it touches; else 0, 0 */
  uint64_t block_numel;         /* (row_hi - row_lo) * cols */
} fps_split_geom_t;

/* Validates shape (fps_shape_validate) and 0 <= row_lo < row_hi <= M*R
 * (unfactored: <= numel) and fills *g. Returns 0, FPS_ESHAPE/FPS_EOVERFLOW
 * or FPS_EINVAL (bad range), with a message in `why`. */
int fps_split_geom_init(fps_split_geom_t *g, const fps_shape_t *shape, uint64_t row_lo,
                        uint64_t row_hi, char *why, size_t why_len);

/* The total row count blocks of this shape are cut from: M*R (factored) or
 * numel. 0 if the shape is invalid. */
uint64_t fps_split_total_rows(const fps_shape_t *shape);

/* Checks a whole block map: n >= 1 blocks (<= FPS_SPLIT_MAX_BLOCKS),
 * bounds[0] = 0 < bounds[1] < ... < bounds[n] = total rows of shape.
 * Returns 0 or FPS_EINVAL/FPS_ESHAPE with the first problem in `why`. */
int fps_split_bounds_validate(const fps_shape_t *shape, const uint64_t *bounds, size_t n,
                              char *why, size_t why_len);

/* One block's optimizer state. Arrays are NULL where the flavor/shape does
 * not use them. */
typedef struct fps_split_state_s {
  fps_split_geom_t g;
  float *row;        /* factored: row_hi - row_lo */
  float *col;        /* factored: nmat * cols (matrix mtx_lo first) */
  float *var;        /* unfactored: block_numel */
  float *mom;        /* hf with beta1: block_numel */
  uint64_t step;     /* steps applied (torch: stalls at 2^24 like fps_adafactor_step) */
  float rms;         /* hf: RMS(param) of the whole tensor before the last step */
} fps_split_state_t;

/* Allocates zeroed block state (validates hp). On failure *st is zeroed.
 * Free with fps_split_state_destroy() (NULL-safe, idempotent). */
int fps_split_state_init(fps_split_state_t *st, const fps_split_geom_t *g,
                         const fps_adafactor_hparams_t *hp);
void fps_split_state_destroy(fps_split_state_t *st);

/* Resharding and resume: copies the block's part of a whole tensor's state
 * (same shape; made for the same flavor and momentum setting) into st,
 * initialised for its block: its rows' row statistics, the column
 * statistics of the matrices it touches, its elements' variance and
 * momentum, the step count and hf RMS. Returns 0 or FPS_EINVAL (shape or
 * kinds differ; st unchanged). */
int fps_split_state_from_whole(fps_split_state_t *st, const fps_adafactor_state_t *whole);
/* The reverse, for gathering blocks into a whole tensor's state: writes
 * the block's arrays at their place in whole's (a matrix spanning blocks
 * gets the same column state from each) and its step and RMS. Returns 0 or
 * FPS_EINVAL as above (whole unchanged). */
int fps_split_state_to_whole(const fps_split_state_t *st, fps_adafactor_state_t *whole);

/* One block's partial sums (decoded). Arrays point into the owner's memory
 * (the step context, or fps_split_partials_decode's allocation). */
typedef struct fps_split_partials_s {
  int phase;                 /* FPS_SPLIT_PHASE_* */
  bool factored;
  uint64_t row_lo, row_hi, cols, mtx_lo, nmat;
  double psq;                /* phase stats: sum p^2 over the block */
  double u2;                 /* phase stats, unfactored: sum U^2 over the block */
  double *rsum;              /* stats: nmat sums of the new row statistics */
  double *rmin;              /* stats: nmat minima of the new row statistics (NaN ignored) */
  double *colsum;            /* stats: nmat * cols sums of g^2 over the block's rows */
  double *s;                 /* stats: nmat * cols sums of g^2 / r_i */
  float *col_old;            /* stats: nmat * cols, the block's column state before the step */
  double *u2m;               /* phase u2: nmat explicit sums of U^2 (0 where not explicit) */
  void *owned;               /* decode's allocation; free with fps_split_partials_free() */
} fps_split_partials_t;

/* Bytes of the wire form of a block's partials for a phase (0 on bad args):
 *   stats, factored:   64 + nmat * (16 + 20 * cols)
 *   stats, unfactored: 64
 *   u2:                64 + 8 * nmat
 * Layout (every field little-endian; doubles IEEE-754 binary64, floats
 * binary32): u32 magic "FPSX" (0x58535046), u8 version (1), u8 phase,
 * u8 kind (1 factored, 2 unfactored), u8 0, u64 row_lo, u64 row_hi,
 * u64 cols (0 unfactored), u64 mtx_lo, u64 nmat, f64 psq, f64 u2 (both 0
 * in phase u2); then per touched matrix, phase stats: f64 rsum, f64 rmin,
 * f64 colsum[cols], f64 s[cols], f32 col_old[cols]; phase u2: f64 u2m. */
size_t fps_split_partials_size(const fps_split_geom_t *g, int phase);

/* Writes p's wire form to buf (cap bytes, at least fps_split_partials_size).
 * Returns the bytes written, or 0 if cap is too small or p is malformed. */
size_t fps_split_partials_encode(const fps_split_partials_t *p, void *buf, size_t cap);

/* Parses a wire form that must be block `expect`'s partials of `phase`
 * (same rows, columns and matrices): anything else is FPS_EFORMAT (bad
 * length, magic, kind, reserved byte) or FPS_EPROTO (another version,
 * phase or block), with a message naming the field. On success out owns
 * an allocation (free with fps_split_partials_free); on failure out is
 * zeroed. FPS_ENOMEM possible. A sum other than S that is not finite and
 * >= 0 (NaN, Inf, negative: no shard that validated its gradients sends
 * one) is FPS_EFORMAT naming it, as in fps_split_partials_check. */
int fps_split_partials_decode(const void *buf, size_t len, const fps_split_geom_t *expect,
                              int phase, fps_split_partials_t *out, char *why, size_t why_len);
void fps_split_partials_free(fps_split_partials_t *p);

/* The checks of a wire form that need no block geometry (what a shard can
 * check before it looks the tensor up): magic, version, `phase`, kind,
 * reserved byte, a nonempty row range, fields the kind lacks at 0 (1-D:
 * cols, mtx_lo and nmat; factored: cols and nmat >= 1), a length that
 * matches the header (computed without overflow), and every sum but S
 * finite and >= 0. Returns 0 (and *hdr, may
 * be NULL, gets the header: arrays NULL) or FPS_EFORMAT / FPS_EPROTO as
 * decode, with a message naming the field. */
int fps_split_partials_check(const void *buf, size_t len, int phase, fps_split_partials_t *hdr,
                             char *why, size_t why_len);

typedef struct fps_split_step_s fps_split_step_t;

/* Pass A of one step of block st on this shard: param and grad are the
 * block's block_numel floats (block-local offsets) and must stay valid and
 * unchanged until apply or free. k: kernels (NULL = best); pool: NULL =
 * this thread. Changes nothing in st or param. *out owns the step; free it
 * with fps_split_step_free(). Returns 0, FPS_EINVAL (NULL args, state not
 * made for hp), FPS_EHPARAM/FPS_EFLAVOR, FPS_ENOMEM. Everything the later
 * stages need is allocated here: combine, the u2 phase and apply cannot
 * run out of memory (a shard that has acknowledged its peers' partials
 * must be able to finish the step). */
int fps_split_step_begin(const fps_kernels_t *k, const fps_adafactor_hparams_t *hp,
                         fps_split_state_t *st, float *param, const float *grad,
                         fps_pool_t *pool, fps_split_step_t **out);

/* This block's stats partials (valid until the step is freed). */
const fps_split_partials_t *fps_split_step_partials(const fps_split_step_t *s);

/* Combines every block's stats partials, parts[0..n) in block order (this
 * block's among them, at its place). Checks the blocks cover the tensor's
 * rows in order and that copies of a shared matrix's old column state are
 * bit-identical. Returns 0, FPS_EINVAL (blocks that do not tile the
 * tensor, this block not among them, called twice) or FPS_ESTATE (column
 * states differ); `why` says which. Allocates nothing. Then
 * fps_split_step_needs_u2() says whether phase u2 must follow. */
int fps_split_step_combine(fps_split_step_t *s, const fps_split_partials_t *parts, size_t n,
                           char *why, size_t why_len);

/* After combine: true iff torch's clamp may bind in some matrix of the
 * tensor, so sum U^2 needs the explicit pass and a second exchange. */
bool fps_split_step_needs_u2(const fps_split_step_t *s);

/* Phase u2: this block's explicit sums (runs the pass over g once; valid
 * until the step is freed). NULL if combine has not run or no u2 phase is
 * due. Allocates nothing. */
const fps_split_partials_t *fps_split_step_u2(fps_split_step_t *s);

/* Combines every block's phase-u2 partials, in block order. Returns 0 or
 * FPS_EINVAL as combine. */
int fps_split_step_combine_u2(fps_split_step_t *s, const fps_split_partials_t *parts, size_t n,
                              char *why, size_t why_len);

/* Pass C: updates the block's params (and momentum) and commits the new
 * state and step. trace (may be NULL) gets the whole tensor's scalars, the
 * same as fps_adafactor_step's (bytes: this block's pass traffic).
 * Returns 0 or FPS_EINVAL (combine not done, or u2 phase due and not done,
 * or applied already); on error nothing changed. Cannot fail otherwise. */
int fps_split_step_apply(fps_split_step_t *s, fps_adafactor_trace_t *trace);

/* fps_split_step_apply() out of place: the block's new params go to out
 * (block_numel floats) and begin's param is only read. out may be begin's
 * param or grad; no other overlap. Same errors (NULL out: FPS_EINVAL);
 * bit-identical to the in-place apply. */
int fps_split_step_apply_to(fps_split_step_t *s, float *out, fps_adafactor_trace_t *trace);

/* Frees the step; before apply this abandons it with nothing changed.
 * NULL-safe. */
void fps_split_step_free(fps_split_step_t *s);

#endif

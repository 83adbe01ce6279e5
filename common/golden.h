/* Golden-vector cases (format adafactor-golden-v1, tests/vectors/README.md):
 * reading a case, running it through the kernels, and the file helpers the
 * replay tool and the unit tests share.
 *
 * A case is a directory holding hparams.txt ("key value" lines), param_0.bin
 * and grad_<t>.bin (raw little-endian float32, C order). hparams.txt is used
 * rather than index.json so that any directory of cases works, with no JSON
 * library (the aarch64 cross build has none). */
#ifndef FPS_GOLDEN_H
#define FPS_GOLDEN_H

#include <stdbool.h>
#include <stddef.h>

#include "adafactor.h"

#define FPS_GOLDEN_MAX_STEPS 100000

enum { FPS_GOLDEN_ROW, FPS_GOLDEN_COL, FPS_GOLDEN_VAR, FPS_GOLDEN_MOM, FPS_GOLDEN_NSTATE };
extern const char *const fps_golden_state_names[FPS_GOLDEN_NSTATE]; /* row col var mom */

typedef struct fps_golden_case_s {
  char name[256];
  char dir[4096];                    /* vectors_dir/name */
  fps_shape_t shape;
  uint64_t numel;
  unsigned steps;
  fps_adafactor_hparams_t hp;
  bool state_listed[FPS_GOLDEN_NSTATE]; /* the case's "state" line */
} fps_golden_case_t;

typedef struct fps_golden_run_s {
  unsigned steps;
  uint64_t numel;
  float *params;                     /* steps x numel: param after step t at (t-1)*numel */
  fps_adafactor_trace_t *trace;      /* steps entries */
  fps_adafactor_state_t state;       /* final state */
} fps_golden_run_t;

/* Names of the sub-directories of dir that hold an hparams.txt, sorted.
 * Free with fps_golden_list_free(). Returns 0, FPS_EIO, FPS_ENOMEM. */
int fps_golden_list(const char *dir, char ***names, size_t *n, char *why, size_t why_len);
void fps_golden_list_free(char **names, size_t n);

/* Parses dir/name/hparams.txt and validates shape and hparams.
 * Returns 0, FPS_EIO, FPS_EFORMAT (bad file; `why` names the line),
 * or a shape/hparam error. */
int fps_golden_load(const char *dir, const char *name, fps_golden_case_t *c, char *why,
                    size_t why_len);

/* Reads exactly n floats from path (the file size must match). */
int fps_golden_read_f32(const char *path, float *buf, uint64_t n, char *why, size_t why_len);
/* Writes n floats to path (little-endian, as the host is). */
int fps_golden_write_f32(const char *path, const float *buf, uint64_t n, char *why,
                         size_t why_len);

/* Runs the case's steps from param_0.bin and grad_<t>.bin with kernels k
 * (NULL: best) and pool (NULL: this thread). out is filled; free it with
 * fps_golden_run_free() even on failure. */
int fps_golden_run(const fps_golden_case_t *c, const fps_kernels_t *k, fps_pool_t *pool,
                   fps_golden_run_t *out, char *why, size_t why_len);
void fps_golden_run_free(fps_golden_run_t *r);

/* The final state array of a kind (NULL if the state has none) and its
 * element count. */
const float *fps_golden_state_array(const fps_golden_run_t *r, int kind, uint64_t *n);

/* Writes out_dir/<case>/param_<t>.bin for every step and
 * state_<kind>.bin for every state array (creating the directories). */
int fps_golden_write_results(const fps_golden_case_t *c, const fps_golden_run_t *r,
                             const char *out_dir, char *why, size_t why_len);

#endif

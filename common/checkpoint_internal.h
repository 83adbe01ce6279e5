/* Internals shared by checkpoint.c (format helpers, directory scans),
 * checkpoint_write.c and checkpoint_read.c. Not for other modules. */
#ifndef FPS_CHECKPOINT_INTERNAL_H
#define FPS_CHECKPOINT_INTERNAL_H

#include <cjson/cJSON.h>
#include <stdarg.h>

#include "checkpoint.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoints store little-endian floats as raw bytes: a big-endian host needs byte swaps"
#endif

/* Kinds of arrays a tensor stores, in the order they are laid out. */
enum {
  FPS__CKPT_PARAM = 0,
  FPS__CKPT_ROW,
  FPS__CKPT_COL,
  FPS__CKPT_VAR,
  FPS__CKPT_MOM,
  FPS__CKPT_KINDS
};

/* One stored array of a tensor. */
typedef struct fps__ckpt_array_s {
  int kind;                             /* FPS__CKPT_* */
  fps_shape_t shape;                    /* its shape in the file */
  uint64_t count;                       /* elements */
} fps__ckpt_array_t;

/* Key suffix of a kind: "", "/row", "/col", "/var", "/mom". */
const char *fps__ckpt_suffix(int kind);

/* The arrays a tensor of this shape and these settings stores, in file
 * order: arr[0] is the weights. Validates shape and hparams first.
 * Returns the number of arrays (2..4) or FPS_ESHAPE/FPS_EOVERFLOW/
 * FPS_EHPARAM/FPS_EFLAVOR with a reason in `why`. */
int fps__ckpt_layout(const fps_shape_t *shape, const fps_adafactor_hparams_t *hp,
                     fps__ckpt_array_t arr[FPS__CKPT_KINDS], char *why, size_t why_len);

/* The arrays a row block of geometry g stores (checkpoint.h ROW BLOCKS),
 * in file order. Validates hparams. Returns the number of arrays or
 * FPS_EHPARAM/FPS_EFLAVOR/FPS_EINVAL with a reason. */
int fps__ckpt_block_layout(const fps_split_geom_t *g, const fps_adafactor_hparams_t *hp,
                           fps__ckpt_array_t arr[FPS__CKPT_KINDS], char *why, size_t why_len);

/* The state array of a kind (NULL for FPS__CKPT_PARAM). */
float *fps__ckpt_state_array(const fps_adafactor_state_t *st, int kind);
/* The same for a block's state. */
float *fps__ckpt_split_array(const fps_split_state_t *st, int kind);

/* Deep copy of a block map (dst's arrays fps_malloc'd), and its release
 * (NULL-safe; zeroes the map). Copy returns 0 or FPS_ENOMEM. */
int fps__ckpt_block_copy(fps_ckpt_block_t *dst, const fps_ckpt_block_t *src);
void fps__ckpt_block_free(fps_ckpt_block_t *b);

/* 0 if name is a valid tensor name (see checkpoint.h), else FPS_EINVAL with
 * a reason. len is strlen(name). */
int fps__ckpt_name_check(const char *name, size_t len, char *why, size_t why_len);

/* 0 if mode is [a-z0-9_]{1,FPS_CKPT_MODE_MAX}, else FPS_EINVAL. */
int fps__ckpt_mode_check(const char *mode);

/* The per-tensor metadata object ("tensor:<name>" value, before printing).
 * whole and map: a row block's whole shape and map (both NULL for a whole
 * tensor). NULL when out of memory. */
cJSON *fps__ckpt_tensor_meta(const fps_adafactor_hparams_t *hp, uint64_t version, uint64_t step,
                             float rms, double last_lr, double last_weight_decay,
                             const fps_shape_t *whole, const fps_ckpt_block_t *map);
/* Parses and validates one. Returns 0 or FPS_EFORMAT/FPS_EHPARAM/
 * FPS_EFLAVOR/FPS_ENOMEM with a reason. last_lr / last_weight_decay are
 * optional in the file (older writers lack them): absent, they are hp's lr
 * (0 without one) and weight_decay. The block keys are all present or all
 * absent: present, *whole and *map (arrays fps_malloc'd; free with
 * fps__ckpt_block_free) get them, only parsed here (checked against the
 * shape by the caller); absent, map->n_blocks is 0. On failure *map is
 * zeroed. */
int fps__ckpt_tensor_meta_parse(const char *text, fps_adafactor_hparams_t *hp, uint64_t *version,
                                uint64_t *step, float *rms, double *last_lr, double *last_weight_decay,
                                fps_shape_t *whole, fps_ckpt_block_t *map, char *why, size_t why_len);

/* Strict decimal uint64: digits only, no sign, no leading zeros, no
 * overflow. Returns 0 or FPS_EFORMAT. */
int fps__ckpt_parse_u64(const char *s, uint64_t *out);

/* If `base` is a checkpoint file name (ckpt-<digits>.safetensors) sets
 * *seq and returns true. */
bool fps__ckpt_name_seq(const char *base, uint64_t *seq);

/* A checkpoint file found in a directory. */
typedef struct fps__ckpt_file_s {
  uint64_t seq;
  char name[256];                       /* the directory entry */
} fps__ckpt_file_t;

/* Lists the checkpoint files of an open directory, sorted newest first
 * (highest seq; ties by name, descending). *files is NULL when *n is 0;
 * free with fps_free(). Returns 0, FPS_ENOMEM or FPS_EIO (errno kept). */
int fps__ckpt_scan(int dirfd, fps__ckpt_file_t **files, size_t *n);

/* Points cJSON's allocations at fps_malloc/fps_free (common/alloc.h), once
 * per process, so that the checkpoint's JSON header is part of the
 * allocation-failure sweep. Call before any cJSON use. Thread-safe. */
void fps__ckpt_json_init(void);

/* snprintf into `why` when it is non-NULL. */
void fps__ckpt_why(char *why, size_t why_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FPS__CKPT_META_KEYS(X) \
  X(format)                    \
  X(format_version)            \
  X(shard_id)                  \
  X(shard_count)               \
  X(mode)                      \
  X(sequence)                  \
  X(created)                   \
  X(tensor_count)              \
  X(data_sha256)               \
  X(header_sha256)

/* Metadata keys a file may lack (older writers). */
#define FPS__CKPT_META_KEY_JOB "job_id"

#define FPS__CKPT_TENSOR_PREFIX "tensor:"

#endif

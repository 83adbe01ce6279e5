/* Durable shard checkpoints: the file format, a writer, a verifier and a
 * loader. Standalone: the server decides when to write and what to do with
 * what it loads.
 *
 * FILE FORMAT (format "factorps.checkpoint", format_version "1" or "2")
 *
 * One checkpoint is one file DIR/ckpt-<seq>.safetensors (<seq> in decimal,
 * zero-padded to at least 8 digits so `ls` sorts by age). The file is a
 * plain safetensors file (https://github.com/huggingface/safetensors):
 *
 *   bytes 0..7      N, the header length, unsigned 64-bit little-endian
 *   bytes 8..8+N-1  the header: a UTF-8 JSON object, padded with spaces so
 *                   that 8 + N is a multiple of 8 (the data starts 8-byte
 *                   aligned)
 *   bytes 8+N..end  the data section: raw little-endian IEEE float32 arrays
 *                   in C (row-major) order, back to back, no gaps, the last
 *                   one ending exactly at the end of the file
 *
 * Header entries, one per stored array (all dtype "F32"):
 *   "<name>":     {"dtype":"F32","shape":[...],"data_offsets":[begin,end]}
 *                 the tensor's weights, its own shape
 *   "<name>/row": factored tensors (ndim >= 2): the row second moments,
 *                 shape[:-1]
 *   "<name>/col": factored tensors: the column second moments,
 *                 shape[:-2] + [shape[-1]]
 *   "<name>/var": unfactored tensors (ndim <= 1): the full second moment,
 *                 the tensor's shape
 *   "<name>/mom": flavor hf with beta1 only: the momentum, the tensor's shape
 * data_offsets are byte offsets into the data section, [begin, end).
 *
 * "__metadata__" (safetensors allows string values only, so every value is
 * a string; integers in decimal, doubles printed with "%.17g" so they read
 * back bit-exact):
 *   "format"         "factorps.checkpoint"
 *   "format_version" "1"
 *   "shard_id", "shard_count"   the writing shard's placement
 *   "mode"           the shard's consistency mode ("sync", "async", "ssp")
 *   "job_id"         optional: the job the shard serves (1..64 bytes of
 *                    [A-Za-z0-9._:-]; the shard's --job-id, or the job_id of
 *                    the first Create that carried one). Absent when the
 *                    shard was never told its job, so such a file is byte
 *                    for byte what earlier writers wrote; builds that
 *                    predate it refuse a file that has it ("unknown
 *                    metadata key"), which cannot check it. A reader told a
 *                    job (fps_ckpt_expect_t.job_id) refuses a file of
 *                    another job as mismatched; a file without one loads.
 *   "sequence"       <seq>, the same number as in the file name
 *   "created"        UTC wall-clock time, RFC 3339 with nanoseconds
 *   "tensor_count"   how many tensors the file holds
 *   "tensor:<name>"  per tensor, a JSON object (as a string) with string
 *                    values: "version" (updates applied), "step" (the
 *                    optimizer's step count), "rms" (hf: RMS of the param
 *                    before the last step, a float; "nan", "inf" or "-inf"
 *                    after a diverged step), and the hyperparameters
 *                    "flavor" ("torch"/"hf"), "has_lr", "lr", "decay",
 *                    "eps1", "eps2", "clip", "weight_decay", "maximize",
 *                    "has_beta1", "beta1", "scale_parameter",
 *                    "relative_step", "warmup_init" (booleans "true"/"false");
 *                    optional (absent in files of earlier writers):
 *                    "last_lr", "last_weight_decay", the values the
 *                    tensor's last update applied (hf relative_step: the
 *                    relative step size), restored with the tensor
 *   "data_sha256"    SHA-256 (lowercase hex) of the whole data section
 *   "header_sha256"  SHA-256 of the first 8 + N bytes of the file as they
 *                    are except that this value's 64 hex digits are replaced
 *                    by 64 '0' characters (so a flipped bit anywhere in the
 *                    header, hyperparameters included, is detected). The
 *                    bytes "header_sha256":"<64 hex>" must appear exactly
 *                    once, without blanks: that is how a reader finds them.
 * The digests detect damage, not forgery: anyone can recompute them, so
 * the reader validates everything else as if the file were hostile.
 *
 * Reading it without factorps, e.g. in Python with numpy:
 *   n = int.from_bytes(f.read(8), "little"); h = json.loads(f.read(n))
 *   data = f.read(); b, e = h["w"]["data_offsets"]
 *   w = numpy.frombuffer(data[b:e], "<f4").reshape(h["w"]["shape"])
 * tests/unit/common/checkpoint_read.py does exactly this and checks both hashes.
 *
 * ROW BLOCKS (format_version "2"; server/shard/internal.h).
 * A shard holding a row block of a split tensor stores the block, under the
 * tensor's name. Its "tensor:<name>" object has five more keys (all
 * required together; lists are decimals joined by ","):
 *   "shape"         the WHOLE tensor's shape, e.g. "4,6,8" (ndim >= 1)
 *   "block_index"   which block this is
 *   "bounds"        the n_blocks + 1 row boundaries, 0 first, the whole
 *                   tensor's M*R rows (numel for ndim 1) last
 *   "block_shards"  the n_blocks shard ids, strictly increasing
 *   "shard_count"   the count the map was made for (the file's)
 * With the block's rows [lo, hi) = [bounds[i], bounds[i + 1]), C the last
 * dimension (1 for ndim 1) and nmat the matrices its rows touch (the
 * first is lo / R), its arrays are:
 *   "<name>":     [hi - lo, C] (ndim 1: [hi - lo]), whole elements lo*C ..
 *   "<name>/row": factored: [hi - lo], its rows' row statistics
 *   "<name>/col": factored: [nmat, C], the column state of each touched
 *                 matrix, once (a shard holds one block per tensor)
 *   "<name>/var": ndim 1: [hi - lo]
 *   "<name>/mom": hf with beta1: as the weights
 * "version", "step", "rms", "last_lr" and "last_weight_decay" are the
 * block's, which equal every other block's of the tensor when the shards
 * were idle. The reader checks the map against the shape (bounds tile the
 * rows, 2..FPS_SPLIT_MAX_BLOCKS blocks, shards increasing and < the
 * count) and the file (its shard_count, and block_shards[block_index] =
 * its shard_id). A file holding at least one block is written as
 * format_version "2", a file without any still as "1", byte for byte as
 * before, so builds that predate blocks keep reading it; they refuse a "2"
 * file ("not supported"), whose blocks they would misread as whole
 * tensors. This build reads both and refuses block keys in a "1" file.
 *
 * A tensor name is 1..FPS_CKPT_NAME_MAX bytes of UTF-8 without control
 * characters, not "__metadata__"; the writer refuses a set of names whose
 * array keys would collide (tensors "a" and "a/row"). The shard refuses
 * such names at Create already, with fps_ckpt_state_suffixes.
 *
 * DURABILITY: the writer writes DIR/.ckpt-<seq>.safetensors.tmp, fsyncs it,
 * renames it to its final name and fsyncs DIR; only then does it delete the
 * checkpoints beyond the newest `keep`. A crash at any moment leaves every
 * complete checkpoint intact (a leftover .tmp file is ignored by readers and
 * removed by the next write). One writer per DIR: fps_ckpt_write takes an
 * exclusive flock on DIR and returns FPS_EAGAIN if another holds it.
 *
 * NOT STALLING PUSHES: writing never touches live tensors. The server builds
 * a snapshot that owns copies:
 *   fps_ckpt_snapshot_create()                  no lock
 *   for each tensor:
 *     fps_ckpt_snapshot_add()                   no lock: allocates and
 *                                               pre-faults the copy buffers
 *     lock the tensor; fps_ckpt_snapshot_copy(); unlock   (memcpy only;
 *                                               the shard borrows the
 *                                               weights: _copy_ref)
 *   fps_ckpt_write()                            no lock: hashing and I/O
 *   fps_ckpt_snapshot_destroy()
 * Each tensor is consistent in itself (weights, state, version and step of
 * the same moment); tensors are copied one after another, not at one
 * instant across the shard.
 *
 * Byte order: the format is little-endian; this code supports little-endian
 * hosts only (x86-64, aarch64), checked at compile time.
 *
 * Build: the CMake target fps_checkpoint (fps_common + libcjson +
 * libcrypto), kept out of fps_common so that libfactorps does not depend
 * on cJSON and OpenSSL. */
#ifndef FPS_CHECKPOINT_H
#define FPS_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "adafactor_split.h"
#include "error.h"

#define FPS_CKPT_FORMAT "factorps.checkpoint"
#define FPS_CKPT_FORMAT_VERSION 2          /* the newest this build reads and writes */
#define FPS_CKPT_FORMAT_VERSION_WHOLE 1    /* written when a file holds no row block */
#define FPS_CKPT_NAME_MAX 256              /* bytes of a tensor name */
/* The suffixes of a tensor's state-array keys, "/row", "/col", "/var" and
 * "/mom", then NULL: "<name><suffix>" must not be another tensor's name. */
extern const char *const fps_ckpt_state_suffixes[];
#define FPS_CKPT_MODE_MAX 31               /* bytes of a mode string */
#define FPS_CKPT_JOB_MAX 64                /* bytes of a job id */
#define FPS_CKPT_HEADER_MAX (UINT64_C(100) << 20) /* safetensors' own limit */
#define FPS_CKPT_PATH_MAX 4096             /* bytes of a checkpoint path, NUL included */
#define FPS_CKPT_WHY_MAX 512               /* a useful size for `why` buffers */

/* Who wrote a checkpoint, and what a reader expects of it. */
typedef struct fps_ckpt_shard_s {
  uint32_t shard_id;                    /* < shard_count */
  uint32_t shard_count;                 /* >= 1 */
  char mode[FPS_CKPT_MODE_MAX + 1];     /* [a-z0-9_]{1,31}, e.g. "sync" */
  char job_id[FPS_CKPT_JOB_MAX + 1];    /* the job's identity, "" = none */
} fps_ckpt_shard_t;

/* 0 if `job` is a valid job id (1..FPS_CKPT_JOB_MAX bytes of
 * [A-Za-z0-9._:-]), else FPS_EINVAL. */
int fps_ckpt_job_check(const char *job);

/* What the file-level checks found out about a checkpoint. */
typedef struct fps_ckpt_info_s {
  fps_ckpt_shard_t shard;               /* the writer's placement and mode */
  uint64_t seq;                         /* sequence number */
  char created[40];                     /* RFC 3339 UTC, as stored */
  char data_sha256[65];                 /* lowercase hex */
  uint32_t format_version;              /* 1 or 2 */
  uint64_t tensors;                     /* tensors in the file (blocks included) */
  uint64_t blocks;                      /* of them, row blocks of split tensors */
  uint64_t data_bytes;                  /* size of the data section */
  uint64_t file_bytes;                  /* size of the file */
} fps_ckpt_info_t;

/* The block map of a row block (fps_tensor_split_t's fields, server/shard/internal.h). */
typedef struct fps_ckpt_block_s {
  uint32_t block_index;                 /* this block: rows bounds[i] .. bounds[i + 1] */
  uint32_t n_blocks;                    /* 0: not a block (a whole tensor) */
  uint64_t *bounds;                     /* n_blocks + 1 */
  uint32_t *block_shards;               /* n_blocks */
  uint32_t shard_count;                 /* the count the map was made for */
} fps_ckpt_block_t;

/* Checks map `b` of a tensor of (whole) shape `shape` as the reader does:
 * bounds (fps_split_bounds_validate), 2..FPS_SPLIT_MAX_BLOCKS blocks,
 * block_index < n_blocks, block_shards strictly increasing and <
 * shard_count, and, with shard_count > 0 given, b->shard_count equal to it
 * and block_shards[block_index] == shard_id. Returns 0 or FPS_EINVAL /
 * FPS_ESHAPE with the first problem in `why`. */
int fps_ckpt_block_check(const fps_shape_t *shape, const fps_ckpt_block_t *b, uint32_t shard_id,
                         uint32_t shard_count, char *why, size_t why_len);

/* ------------------------------------------------------------ writing */

typedef struct fps_ckpt_snapshot_s fps_ckpt_snapshot_t;

/* Creates an empty snapshot for one shard. mode: see fps_ckpt_shard_t.
 * Returns 0, FPS_EINVAL (bad placement or mode) or FPS_ENOMEM. Free with
 * fps_ckpt_snapshot_destroy(). Thread-safety: a snapshot is used by one
 * thread at a time. */
int fps_ckpt_snapshot_create(fps_ckpt_snapshot_t **out, uint32_t shard_id, uint32_t shard_count,
                             const char *mode);

/* Records the job the snapshot belongs to (stored as "job_id"); NULL or
 * "" stores none. Returns 0 or FPS_EINVAL (not a valid job id). */
int fps_ckpt_snapshot_set_job(fps_ckpt_snapshot_t *s, const char *job);

/* Adds a tensor and allocates (and touches) its copy buffers, so that
 * fps_ckpt_snapshot_copy() is a plain memcpy. Call it WITHOUT the tensor's
 * lock: shape and hyperparameters are fixed once a tensor exists. *idx gets
 * the tensor's index for fps_ckpt_snapshot_copy().
 * Returns 0; FPS_EINVAL (bad name, with `why`); FPS_EEXISTS (a name, or one
 * of the array keys it implies, is already in the snapshot);
 * FPS_ESHAPE/FPS_EOVERFLOW/FPS_EHPARAM/FPS_EFLAVOR (as fps_shape_validate
 * and fps_adafactor_validate); FPS_ENOMEM. A failed call adds nothing.
 * `why` may be NULL. */
int fps_ckpt_snapshot_add(fps_ckpt_snapshot_t *s, const char *name, const fps_shape_t *shape,
                          const fps_adafactor_hparams_t *hp, size_t *idx, char *why,
                          size_t why_len);

/* Copies a tensor's weights (numel floats) and state into the snapshot:
 * memcpy only, no allocation, no I/O. Call it UNDER the tensor's lock.
 * Copying the same index again overwrites the earlier copy.
 * Returns 0, FPS_EINVAL (bad index, NULL param/state) or FPS_ESHAPE (the
 * state's shape or arrays are not those of the shape and hyperparameters
 * given to fps_ckpt_snapshot_add). */
int fps_ckpt_snapshot_copy(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                           const float *param, const fps_adafactor_state_t *st);

/* Like fps_ckpt_snapshot_add() for a row block of a split tensor: `shape`
 * is the WHOLE tensor's, `map` its block map (copied), which must pass
 * fps_ckpt_block_check() for the snapshot's shard id and count (else
 * FPS_EINVAL naming the problem). Copy it with fps_ckpt_snapshot_copy_block(). */
int fps_ckpt_snapshot_add_block(fps_ckpt_snapshot_t *s, const char *name, const fps_shape_t *shape,
                                const fps_adafactor_hparams_t *hp, const fps_ckpt_block_t *map,
                                size_t *idx, char *why, size_t why_len);

/* fps_ckpt_snapshot_copy() of a block: param is the block's block_numel
 * floats, st its state (geometry and arrays those of the block added).
 * Returns 0, FPS_EINVAL (bad index, NULL args, the index is not a block)
 * or FPS_ESHAPE (st is of another block or kind). */
int fps_ckpt_snapshot_copy_block(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                                 const float *param, const fps_split_state_t *st);

/* Weights by reference instead of by copy (the shard's parameter buffers
 * are immutable once published: shard.h), for tensors added from now on;
 * call it before the first add (later: no effect). Such a tensor must be
 * filled with the _ref calls below (the plain ones give FPS_EINVAL); the
 * snapshot keeps param readable until release(ref) runs, at a later _ref
 * copy of the same index or at destroy. Only the state is copied under
 * the lock, and the snapshot holds no second copy of the weights. */
void fps_ckpt_snapshot_borrow_params(fps_ckpt_snapshot_t *s, void (*release)(void *ref));
/* fps_ckpt_snapshot_copy() / _copy_block() for a borrowing snapshot: ref
 * (non-NULL) is what keeps param alive; on success the snapshot owns it,
 * on failure (same codes) the caller still does. */
int fps_ckpt_snapshot_copy_ref(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                               const float *param, void *ref, const fps_adafactor_state_t *st);
int fps_ckpt_snapshot_copy_block_ref(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                                     const float *param, void *ref, const fps_split_state_t *st);

/* Records the lr and weight decay the tensor's last update applied (they
 * travel with each push; see TensorPush in the proto), stored as the
 * per-tensor metadata "last_lr" / "last_weight_decay". Without this call a
 * tensor stores its hyperparameters' lr (0 without one) and weight_decay.
 * Call it with fps_ckpt_snapshot_copy(), under the same lock.
 * Returns 0 or FPS_EINVAL (bad index, a negative or non-finite value). */
int fps_ckpt_snapshot_set_applied(fps_ckpt_snapshot_t *s, size_t idx, double last_lr,
                                  double last_weight_decay);

/* Tensors added, and bytes of array data held (the data section's size). */
size_t fps_ckpt_snapshot_count(const fps_ckpt_snapshot_t *s);
uint64_t fps_ckpt_snapshot_bytes(const fps_ckpt_snapshot_t *s);

/* NULL is a no-op. */
void fps_ckpt_snapshot_destroy(fps_ckpt_snapshot_t *s);

/* What fps_ckpt_write() did. */
typedef struct fps_ckpt_written_s {
  uint64_t seq;                         /* the new checkpoint's sequence number */
  char path[FPS_CKPT_PATH_MAX];         /* its path */
  uint64_t file_bytes;                  /* its size */
  unsigned pruned;                      /* older checkpoints deleted */
  int prune_err;                        /* 0, or why pruning stopped (FPS_EIO);
                                         * the new checkpoint is durable anyway */
} fps_ckpt_written_t;

/* Writes the snapshot as DIR/ckpt-<seq>.safetensors, seq = one more than
 * the largest sequence number in DIR (1 in an empty DIR), atomically and
 * durably (see DURABILITY above), then deletes the oldest checkpoints so
 * that `keep` remain. DIR must exist. Every tensor added must have been
 * copied. The snapshot is not modified; write it again to retry.
 * Returns 0 (out filled, out may be NULL); FPS_EINVAL (bad argument, keep
 * 0, path too long); FPS_ESTATE (a tensor was added but never copied);
 * FPS_EEXISTS (two tensors' array keys collide, named in `why`);
 * FPS_EAGAIN (another writer holds DIR); FPS_ENOTFOUND (no DIR);
 * FPS_EOVERFLOW (sequence numbers exhausted); FPS_ELIMIT (header larger
 * than FPS_CKPT_HEADER_MAX: roughly 100 000 tensors); FPS_ENOMEM; FPS_EIO
 * (with the system's reason in `why`). On failure no new checkpoint exists
 * and no old one was deleted. If only pruning failed, the call returns 0,
 * out->prune_err is set and `why` names the file. Cost: one pass over the
 * snapshot (SHA-256 and write, 1 MiB at a time), two fsyncs, a rename.
 * Thread-safe for different snapshots (one writer per DIR at a time). */
int fps_ckpt_write(const char *dir, const fps_ckpt_snapshot_t *s, unsigned keep,
                   fps_ckpt_written_t *out, char *why, size_t why_len);

/* Prepares DIR for one shard's lifetime, at start-up: if `create` is true
 * and DIR does not exist, creates it (mode 0700; its parent must exist)
 * and fsyncs its parent so the new directory is durable; checks that DIR
 * is a writable directory; and takes an exclusive lock on DIR/.lock that
 * lasts until the returned fd is closed (or the process exits). A second shard process
 * started with the same DIR then fails here, with the holder's pid in
 * `why`, instead of pruning this shard's checkpoints. Independent of the
 * per-write lock of fps_ckpt_write(), which still applies.
 * Returns the lock's fd (>= 0), or FPS_EINVAL, FPS_ENOTFOUND (no DIR and
 * create false), FPS_EAGAIN (another process holds DIR), FPS_EIO. */
int fps_ckpt_dir_lock(const char *dir, bool create, char *why, size_t why_len);

/* ------------------------------------------------------------ reading
 *
 * Every reading function is reentrant (no global state) and safe against
 * a concurrent writer in the same DIR: files appear only by rename, and a
 * file deleted by pruning while being read is reported, not trusted. */

/* Placement a reader requires. A file written for another shard, mode or
 * job is rejected as "mismatched" (FPS_ESTATE), the reason naming both
 * sides. */
typedef struct fps_ckpt_expect_s {
  uint32_t shard_id;
  uint32_t shard_count;
  const char *mode;                     /* NULL: any mode */
  const char *job_id;                   /* NULL or "": any job; else a file
                                         * with another job_id is refused
                                         * (one without any loads) */
} fps_ckpt_expect_t;

/* One restored tensor. The caller may take ownership of `param` (free it
 * with fps_free()) and of `state` (release it with
 * fps_adafactor_state_destroy()) by copying them out and zeroing the
 * fields here before fps_ckpt_destroy(). A row block (block.n_blocks > 0)
 * has `param` of its block_numel floats, its state in `bstate` (its
 * geometry in bstate.g, the whole shape in bstate.g.shape; release it with
 * fps_split_state_destroy()) and `state` zeroed; its map arrays are owned
 * here too (fps_free()). */
typedef struct fps_ckpt_tensor_s {
  char name[FPS_CKPT_NAME_MAX + 1];
  fps_adafactor_hparams_t hparams;
  uint64_t version;                     /* updates applied */
  double last_lr;                       /* lr of the last update ("last_lr") */
  double last_weight_decay;             /* its weight decay */
  float *param;                         /* state.numel floats, 64-byte aligned */
  fps_adafactor_state_t state;          /* from fps_adafactor_state_init(); step, rms set */
  fps_ckpt_block_t block;               /* n_blocks 0: a whole tensor */
  fps_split_state_t bstate;             /* a block's state (fps_split_state_init()) */
} fps_ckpt_tensor_t;

typedef struct fps_ckpt_s {
  char path[FPS_CKPT_PATH_MAX];         /* the file it came from */
  fps_ckpt_info_t info;
  size_t n_tensors;
  fps_ckpt_tensor_t *tensors;           /* in the file's order */
} fps_ckpt_t;

/* Checks one file completely without keeping its contents: header bounds
 * (every offset, size and shape), metadata completeness, both SHA-256s and,
 * if expect is non-NULL, the placement. info (may be NULL) is filled on
 * success. Never crashes on a hostile file.
 * Returns 0; FPS_EFORMAT (truncated, malformed or corrupted, with the
 * reason in `why`); FPS_ESTATE (mismatched placement or mode);
 * FPS_ENOTFOUND (no such file); FPS_EIO; FPS_ENOMEM. */
int fps_ckpt_verify_file(const char *path, const fps_ckpt_expect_t *expect,
                         fps_ckpt_info_t *info, char *why, size_t why_len);

/* Like fps_ckpt_verify_file(), and on success returns the contents in *out
 * (free with fps_ckpt_destroy()). The values are checked too: weights and
 * momentum finite, second moments (row, col, var) finite and >= 0, else
 * FPS_EFORMAT naming the tensor, the array and the element. Memory: the
 * weights and state of every tensor, allocated once; nothing is returned
 * unless the whole file verified. */
int fps_ckpt_load_file(const char *path, const fps_ckpt_expect_t *expect, fps_ckpt_t **out,
                       char *why, size_t why_len);

/* Called for every checkpoint file the loader skips. */
typedef void (*fps_ckpt_reject_fn)(void *ctx, const char *path, int err, const char *why);

/* Loads the newest valid checkpoint in DIR: tries ckpt-*.safetensors from
 * the highest sequence number down and skips (reporting each through
 * on_reject, or, if on_reject is NULL, one line on stderr naming the file
 * and the reason) every file that is truncated, corrupted or mismatched.
 * Returns 0 (*out set); FPS_ENOTFOUND (DIR holds no checkpoint file, or
 * does not exist); FPS_EFORMAT (checkpoint files exist but none is valid);
 * FPS_EIO (DIR unreadable); FPS_ENOMEM. */
int fps_ckpt_load_newest(const char *dir, const fps_ckpt_expect_t *expect,
                         fps_ckpt_reject_fn on_reject, void *ctx, fps_ckpt_t **out);

/* NULL is a no-op. */
void fps_ckpt_destroy(fps_ckpt_t *c);

/* One checkpoint file found by fps_ckpt_list(). */
typedef struct fps_ckpt_entry_s {
  char path[FPS_CKPT_PATH_MAX];
  uint64_t seq;                         /* from the file name */
  int status;                           /* 0 (valid) or as fps_ckpt_verify_file() */
  char why[FPS_CKPT_WHY_MAX];           /* the reason, if status != 0 */
  fps_ckpt_info_t info;                 /* valid if status == 0 */
} fps_ckpt_entry_t;

/* Lists and fully verifies every checkpoint file in DIR, newest first (for
 * `factorps checkpoint verify`). expect may be NULL (any placement).
 * Returns 0 (*out, *n set; *out is NULL when *n is 0; free with
 * fps_ckpt_list_free()); FPS_ENOTFOUND (no DIR); FPS_EIO; FPS_ENOMEM. */
int fps_ckpt_list(const char *dir, const fps_ckpt_expect_t *expect, fps_ckpt_entry_t **out,
                  size_t *n);
/* fps_ckpt_list() that also checks every file's values as
 * fps_ckpt_load_file() does (FPS_EFORMAT naming the tensor, array and
 * element), reading each file once and holding one file's contents at a
 * time (`factorps checkpoint verify`). */
int fps_ckpt_list_values(const char *dir, const fps_ckpt_expect_t *expect, fps_ckpt_entry_t **out,
                         size_t *n);
void fps_ckpt_list_free(fps_ckpt_entry_t *entries);

#endif

/* The shard core: everything a shard decides, and nothing of how calls
 * reach it (README "Layout"; DESIGN "Inside the shard").
 *
 *   store.c       tensors and the store (name -> tensor), the one apply
 *                 path of every mode, the published parameter buffers
 *                 replies and Pull reference, staging-buffer accounting,
 *                 counters, the name and slice rules
 *   create.c      Create's rules: create-or-match, init coverage, limits
 *   push.c        one worker's push: staging, the checks, then async
 *                 apply, a sync round or an ssp wait
 *   push_settings.c  per-push lr / weight decay / no_grad, the job checks
 *                 of the stream header, a round's agreement
 *   sync.c        sync rounds: join all-or-none, completion in worker-id
 *                 order, deadline, duplicate/stale/ahead, withdraw
 *   reduce.c      a sync round's running sum: slices summed in worker-id
 *                 order as they arrive, early ones staged (reduce.h)
 *   ssp.c         ssp waits: admit, park, advance, expire
 *   snap_bf16.c   a parameter buffer's bf16 encoding, shared by replies
 *   checkpoint.c  durable checkpoints: restore, snapshots, the interval
 *   ranges.c      sorted interval sets (slice coverage and overlap)
 *   split_tensor.h  a row block of a split tensor, the exchange contract
 *   xstep.c       the cross-shard step of a sync set holding blocks:
 *                 partials out and in, combine, apply all or nothing
 *   log.c         the log line
 *
 * The core includes no gRPC and no protobuf-c header (the fps_shard library
 * does not link them, so such an include fails the build). Functions return
 * 0 or a negative FPS_E* (common/error.h) and write a message naming the
 * tensor and the problem into a `why` buffer; the RPC layer translates the
 * code (server/status.c) and sends the message. A push that has to wait (a
 * sync round, an ssp wait) is resumed through the callback its creator
 * registered (fps_push_done_fn), on whichever thread completes it.
 *
 * Locks, in acquisition order (never the reverse): store->mu (rwlock) ->
 * tensor->mu -> sh->ssp_mu -> push->mu -> sh->rounds_mu, and tensor->mu ->
 * sh->xs_mu -> an exchanging set's own mutex (xstep.c). Several tensor
 * locks are taken in address order, and by a thread holding no other tensor
 * lock. A set of linked sync rounds is completed with its tensors' locks
 * held only to check, sum, apply and collect its members; their pushes are
 * resolved (callbacks run) after they are released. snap_bf16.c's lock is
 * a leaf: taken with or without any of these, nothing is taken inside it. */
#ifndef FPS_SHARD_H
#define FPS_SHARD_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "clock.h"
#include "dtype.h"
#include "error.h"
#include "name.h"
#include "split_block.h"
#include "split_tensor.h"

#define FPS_NAME_MAX FPS_TENSOR_NAME_MAX /* bytes of UTF-8 in a tensor name (name.h) */
#define FPS_WHY_MAX 2048                 /* room for any message of the core */
#define FPS_LATENCY_RING 1024            /* recent pushes kept for p50/p99 */
/* Tensors at least this big are updated on the kernel pool; smaller ones on
 * the calling thread (the pool runs one job at a time, and many small
 * tensors already spread over the pollers). */
#define FPS_POOL_MIN_NUMEL (UINT64_C(1) << 22)
/* Sync mode: a set's rounds are applied one after the other on the thread
 * that completed it, while every worker waits for the replies (the step
 * timeline's "applied" line), so every tensor with more than a few
 * chunks of work (adafactor_internal.h) goes to the pool; the pool's
 * chunking does not depend on the thread count (bit-identical). */
#define FPS_POOL_MIN_NUMEL_SYNC (UINT64_C(1) << 18)
#define FPS_POOL_MIN(sh) ((sh)->cfg.mode == FPS_MODE_SYNC ? FPS_POOL_MIN_NUMEL_SYNC : FPS_POOL_MIN_NUMEL)
/* A round fails ahead of its earliest member's own deadline, so the
 * members hear which workers were missing rather than a bare
 * DEADLINE_EXCEEDED from their own transport timer: by a quarter of the
 * time the member had left when it joined, at least MIN (the answer must
 * beat the client's timer on a loaded machine: 200 ms was lost to
 * scheduling delays here) and at most MAX. */
#define FPS_ROUND_MARGIN_MIN_NS INT64_C(200000000)
#define FPS_ROUND_MARGIN_MAX_NS INT64_C(1000000000)

/* ------------------------------------------------------------ logging */

typedef enum fps_log_level_e { FPS_LOG_ERROR = 0, FPS_LOG_WARN, FPS_LOG_INFO, FPS_LOG_DEBUG } fps_log_level_t;
extern int fps__log_level;
void fps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Checks the level before evaluating the arguments. */
#define FPS_SLOG(level, ...)                            \
  do {                                                  \
    if ((level) <= fps__log_level) fps__log(level, __VA_ARGS__); \
  } while (0)

/* ------------------------------------------------------------- ranges */

/* Sorted, merged, non-overlapping half-open intervals [lo, hi). */
typedef struct fps_range_s {
  uint64_t lo, hi;
} fps_range_t;

/* A treap of maximal intervals (ranges.c): O(log n) per insert whatever
 * the order of the slices, so a request of n slices costs O(n log n). */
typedef struct fps_range_node_s {
  uint64_t lo, hi;
  uint32_t left, right;       /* node indices, 0: none (node 0 is unused) */
  uint32_t prio;              /* heap order, random */
} fps_range_node_t;

typedef struct fps_ranges_s {
  fps_range_node_t *v;        /* node pool (v[0] unused) */
  size_t n, cap;              /* intervals; pool slots */
  uint32_t root, free;        /* tree; free list (through .left) */
  uint32_t used;              /* pool slots handed out, v[1..used] */
  uint64_t covered;           /* sum of hi - lo */
} fps_ranges_t;

/* Adds [lo, hi). Returns 0, FPS_EEXISTS if it overlaps what is there
 * (nothing changes then), FPS_ENOMEM. An empty interval is a no-op. */
int fps_ranges_add(fps_ranges_t *r, uint64_t lo, uint64_t hi);
/* First gap in [0, total) or total if none (for "missing slice" messages). */
uint64_t fps_ranges_first_gap(const fps_ranges_t *r, uint64_t total);
int fps_ranges_copy(fps_ranges_t *dst, const fps_ranges_t *src);
/* Makes room so that the next fps_ranges_add() cannot fail with
 * FPS_ENOMEM (it needs at most one node). 0 or FPS_ENOMEM. */
int fps_ranges_reserve(fps_ranges_t *r);
/* The maximal interval that contains x, if any. */
bool fps_ranges_find(const fps_ranges_t *r, uint64_t x, fps_range_t *out);
void fps_ranges_free(fps_ranges_t *r);

/* ------------------------------------------------------ options, rules */

typedef enum fps_mode_e { FPS_MODE_SYNC = 1, FPS_MODE_ASYNC = 2, FPS_MODE_SSP = 3 } fps_mode_t;

/* What the core needs of the shard's configuration (main.c fills it from
 * fps_config_t: the fields have the same names and meanings there). */
typedef struct fps_shard_opts_s {
  uint32_t shard_id;          /* this shard's index */
  uint32_t shard_count;       /* shards in the job */
  int mode;                   /* fps_mode_t */
  uint32_t staleness;         /* ssp: max steps ahead of the slowest worker */
  uint32_t workers;           /* sync/ssp: number of workers W (>= 1) */
  double deadline;            /* seconds: sync round deadline */
  uint64_t max_tensors;       /* Create beyond this: FPS_ELIMIT */
  uint64_t max_bytes;         /* parameter bytes beyond this: FPS_ELIMIT */
  uint64_t max_staging_bytes; /* gradient staging + snapshots, all pushes */
  uint32_t apply_log;         /* per-tensor apply records kept */
  const char *checkpoint_dir; /* "" = off (borrowed) */
  double checkpoint_interval; /* seconds between periodic checkpoints, 0 = off */
  uint32_t checkpoint_keep;   /* newest checkpoints kept */
  int require_checkpoint;     /* refuse to start without a loaded checkpoint */
} fps_shard_opts_t;

const char *fps_mode_name(int mode);

/* Where the data of a slice is when it is not in one piece (the buffers a
 * message was received in): next yields the following run of whole
 * elements (sets *data, returns the element count), 0 when all is given. */
typedef struct fps_slice_src_s {
  uint64_t (*next)(void *ctx, const uint8_t **data);
  void *ctx;
  /* Where next puts an element cut between two buffers (copied there, so
   * not held by the slice's owner), NULL: never. */
  const uint8_t *bounce;
} fps_slice_src_t;

/* Who keeps a slice's bytes alive past the call that hands them to the
 * core (the RPC layer's received message), so that a sync slice that
 * arrives early is staged as a reference to them, not as a copy
 * (reduce.c). The core takes one reference per staged piece (ref) and
 * drops it when the piece is summed or thrown away (unref: any thread,
 * maybe with core locks held, so it must not call into the core; the
 * last one frees the bytes). While any staged piece references them,
 * `bytes` count once against max_staging_bytes (`staged` is the core's
 * count of those pieces: set it to 0). */
typedef struct fps_slice_owner_s {
  void (*ref)(void *ctx);
  void (*unref)(void *ctx);
  void *ctx;
  uint64_t bytes;             /* the memory the references keep alive */
  atomic_uint_fast64_t staged; /* the core's: staged pieces referencing it */
} fps_slice_owner_t;

/* One slice of a tensor as it came off the wire: data is little-endian
 * elements of dtype, any alignment, either in one piece (data) or, with
 * src set, in the pieces src yields (data unused; len still the total). */
typedef struct fps_slice_s {
  int dtype;                  /* FPS_DTYPE_* */
  const uint64_t *shape;      /* the sender's idea of the shape, n_shape dims */
  size_t n_shape;             /* 0: not given */
  uint64_t offset;            /* first element */
  const uint8_t *data;
  size_t len;                 /* bytes */
  const fps_slice_src_t *src; /* NULL: data holds all of it */
  fps_slice_owner_t *owner;   /* keeps data alive, NULL: the bytes last only
                               * for the call (the core copies what it keeps) */
} fps_slice_t;

/* Name rule (common/name.h): 1..FPS_NAME_MAX bytes of UTF-8 without
 * control characters. 0 or FPS_EINVAL. */
int fps_shard_name_check(const char *name, char *why, size_t why_len);
/* Shape from dims (dims >= 1, ndim <= FPS_MAX_DIMS, numel bounded):
 * 0, FPS_EINVAL or FPS_EOVERFLOW. */
int fps_shard_shape_check(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out, uint64_t *numel,
                          char *why, size_t why_len);
/* A slice against a tensor of shape/numel: dtype supported, data a whole
 * number of elements, shape (if given, or if required) equal,
 * [offset, offset+count) within numel. *count gets the element count.
 * 0 or FPS_EINVAL. */
int fps_shard_slice_check(const char *name, const fps_slice_t *s, const fps_shape_t *shape, uint64_t numel,
                          bool shape_required, uint64_t *count, char *why, size_t why_len);
/* Index of the first NaN/Inf among n little-endian elements of dtype at
 * data (any alignment), or n if all are finite. */
uint64_t fps_shard_first_nonfinite(int dtype, const uint8_t *data, uint64_t n);
bool fps_shape_equal(const fps_shape_t *a, const fps_shape_t *b);
/* "[3, 5]" into buf. */
void fps_shape_format(const fps_shape_t *s, char *buf, size_t len);

/* ------------------------------------------------------ tensors, store */

typedef struct fps_shard_s fps_shard_t;
typedef struct fps_tensor_s fps_tensor_t;
typedef struct fps_push_s fps_push_t;
typedef struct fps_push_entry_s fps_push_entry_t;

/* A refcounted, immutable fp32 parameter buffer at one version. A tensor's
 * parameters are one (t->pbuf, published): replies, Pull and checkpoints
 * take references instead of copying, so a slow reader never holds the
 * tensor's lock and nothing is copied per sent byte. Rule: nobody writes a
 * buffer another holder may read. An update writes the new parameters out
 * of place into its own gradient buffer, which becomes the next t->pbuf;
 * Create's init writes only a tensor that is not ready (no references
 * handed out yet); replace and restore install a new buffer. */
typedef struct fps_snap_s {
  atomic_int refs;
  fps_shard_t *sh;            /* whose buffer accounting data counts in */
  float *data;                /* numel floats, owned */
  uint64_t numel;
  uint64_t version;
  bool staged;                /* data counts in sh->tbuf_bytes (every buffer
                               * but a tensor's own t->pbuf, which counts in
                               * its parameter bytes) */
  fps_tensor_t *owner;        /* retired: the tensor whose spare the freed
                               * data may become (fps__tbuf_keep), or NULL */
  struct fps_snap_bf16_s *bf16; /* its bf16 encoding while replies use it,
                               * or NULL (snap_bf16.c, under its lock) */
} fps_snap_t;

/* Takes ownership of data (from fps_tbuf_alloc). Returns NULL on OOM (data
 * freed). */
fps_snap_t *fps_snap_wrap(fps_shard_t *sh, float *data, uint64_t numel, uint64_t version, int refs);
/* A tensor's own parameter buffer (not staged), one reference: NULL on OOM.
 * Its sh stays NULL: it counts in the store's param_bytes (--max-bytes),
 * not in any staging, and a shard's accounting is reached only once it
 * is retired (fps__pbuf_retire sets sh). */
fps_snap_t *fps__pbuf_new(uint64_t numel);
/* A replacement for t's parameters (Create's replace) staged until it is
 * published: counted against max_staging_bytes like a gradient buffer
 * (t's spare if it has one). NULL with *over_limit set over the limit, or
 * NULL on OOM. fps__pbuf_publish makes it the tensor's own (uncounted:
 * the old buffer retired takes its place in staging); retired unpublished,
 * it becomes t's spare. */
fps_snap_t *fps__pbuf_new_staged(fps_shard_t *sh, fps_tensor_t *t, bool *over_limit);
void fps__pbuf_publish(fps_shard_t *sh, fps_snap_t *s);
/* Tensor t lets go of its buffer s (NULL-safe; t NULL: no recycling): it
 * counts as staging from now on, and its last holder (readers may keep it
 * past this call) makes it t's spare (fps__tbuf_keep). sh NULL: the
 * shard's teardown, just freed. */
void fps__pbuf_retire(fps_shard_t *sh, fps_tensor_t *t, fps_snap_t *s);
/* Drops one reference; the last frees. NULL is a no-op. Thread-safe. */
void fps_snap_unref(fps_snap_t *s);
/* Takes one more reference (e.g. for a reply slice over data). Thread-safe. */
static inline void fps_snap_ref(fps_snap_t *s) { atomic_fetch_add(&s->refs, 1); }

/* A buffer's numel elements as little-endian bf16 (round to nearest even),
 * converted once and shared by every reply that sends the buffer while
 * any of them holds a reference (snap_bf16.c). */
typedef struct fps_snap_bf16_s fps_snap_bf16_t;
/* A reference to s's encoding, converted now by this caller if there is
 * none, into a buffer counted against sh's max_staging_bytes. NULL when it
 * cannot be had now (the limit, out of memory, or another thread is
 * converting it): the caller converts its own copy. REQUIRES: the caller
 * holds a reference to s. Thread-safe; never waits for a conversion. */
fps_snap_bf16_t *fps_snap_bf16_get(fps_shard_t *sh, fps_snap_t *s);
/* Its bytes: 2 * s->numel, valid while the reference is held. */
const uint8_t *fps_snap_bf16_data(const fps_snap_bf16_t *e);
/* One more reference (a reply slice over the data). Thread-safe. */
void fps_snap_bf16_ref(fps_snap_bf16_t *e);
/* Drops one; the last frees the encoding and its reference to the buffer,
 * so the next reply of the buffer converts again. NULL is a no-op.
 * Thread-safe. */
void fps_snap_bf16_unref(fps_snap_bf16_t *e);
/* The update's own encoding (made in its pass C): an unattached buffer
 * for numel elements with `refs` references, counted against
 * max_staging_bytes; NULL at the limit or out of memory (then there is
 * none: the replies convert). Its bytes to write: fps__snap_bf16_buf().
 * Attach it to the new buffer before the buffer is published (takes a
 * reference to s); an encoding never attached goes with _discard(). */
fps_snap_bf16_t *fps__snap_bf16_new(fps_shard_t *sh, uint64_t numel, int refs);
uint8_t *fps__snap_bf16_buf(fps_snap_bf16_t *e);
void fps__snap_bf16_attach(fps_snap_bf16_t *e, fps_snap_t *s);
void fps__snap_bf16_discard(fps_snap_bf16_t *e);

/* Tensor-sized transient buffers (gradient staging, sync sums, retired
 * parameter buffers replies still read) are
 * counted against max_staging_bytes, so many concurrent pushes cannot
 * exhaust memory. alloc returns NULL with *over_limit set when the limit
 * would be passed, or NULL on OOM. fps_free(NULL) is a no-op. */
float *fps_tbuf_alloc(fps_shard_t *sh, uint64_t numel, bool *over_limit);
void fps_tbuf_free(fps_shard_t *sh, float *p, uint64_t numel);
/* Counts bytes held elsewhere (a received message staged by reference)
 * against the same limit: false if that would pass it. Thread-safe. */
bool fps__tbuf_charge(fps_shard_t *sh, uint64_t bytes);
void fps__tbuf_uncharge(fps_shard_t *sh, uint64_t bytes);
/* Recycling of t->numel-float staging buffers (a round's sum, a push's
 * staging): take returns t's spare if it has one (already counted: it
 * cannot pass the limit) or a fresh fps_tbuf_alloc buffer; keep makes p
 * (counted, t->numel floats) t's one spare, still counted (an older spare
 * is freed). A spare saves the munmap, mmap and page faults of a large
 * buffer per round; it is what the tensor's next sum or staging takes, and
 * is freed with the tensor, at a replace (drop), or when a fresh buffer
 * would otherwise pass max_staging_bytes: spares are given up first, so
 * no request is refused that would fit without them. Thread-safe. */
float *fps__tbuf_take(fps_shard_t *sh, fps_tensor_t *t, bool *over_limit);
void fps__tbuf_keep(fps_shard_t *sh, fps_tensor_t *t, float *p);
/* Frees t's spare, if any (Create's replace: a new history). */
void fps__tbuf_drop_spare(fps_shard_t *sh, fps_tensor_t *t);
/* Staging bytes of calls in flight: tbuf_bytes without the spares. */
uint64_t fps_shard_in_flight_bytes(fps_shard_t *sh);

typedef struct fps_apply_rec_s {
  uint32_t worker_id;
  uint64_t step;
  uint64_t version;
  double lr;                  /* applied (hf relative_step: rel_t) */
  double weight_decay;        /* applied */
} fps_apply_rec_t;

/* The hyperparameters one update applies: the push's TensorPush values,
 * Create's where absent (push_settings.c). */
typedef struct fps_update_hp_s {
  double lr;
  double weight_decay;
} fps_update_hp_t;

/* What one update needs allocated and checked before anything is applied,
 * so that the updates of several tensors (one call's, a linked set of sync
 * rounds') all apply or none does: fps__apply_prepare() for every tensor
 * first, then fps__tensor_apply_locked() with each prep cannot fail. */
typedef struct fps_apply_prep_s {
  double *scratch;            /* the Adafactor step's scratch, NULL: none needed */
  fps_snap_t *snap;           /* with update: the wrapper of the buffer that
                               * becomes the new parameters */
  struct fps_split_step_s *split; /* a block's combined cross-shard step
                               * (xstep.c): its apply is pass C; NULL: none */
  int bf16_replies;           /* set by the caller after preparing: how many
                               * replies of this update send bf16; then the
                               * update encodes them in its pass C */
  struct fps_snap_bf16_s *bf16; /* after the apply: that encoding with
                               * bf16_replies references for the caller to
                               * hand out, or NULL (none: replies convert) */
} fps_apply_prep_t;

/* Kinds of optimizer state arrays (the wire's StateKind - 1). */
enum { FPS_STATE_ROW = 0, FPS_STATE_COL, FPS_STATE_VAR, FPS_STATE_MOM, FPS_STATE_KINDS };

/* The sync round of one tensor: at most one is open (its step equals the
 * tensor's version). Rounds are linked into sets by their members: a push
 * naming several tensors is a member of each one's round, and a set
 * completes (or fails) as one (sync.c). Guarded by sh->rounds_mu (member
 * arrays are allocated with the tensor). */
typedef struct fps_round_s {
  bool open;
  bool settling;              /* its set is being completed: members frozen */
  bool none;                  /* settling: no member has a gradient */
  uint64_t step;
  uint32_t joined;            /* members present */
  fps_push_entry_t **member;  /* [workers], by worker id, NULL = missing */
  int64_t started_ns;         /* first join */
  int64_t complete_ns;        /* settling: its set was found complete */
  int64_t deadline_ns;        /* fails the round (and its set) at this time */
  int64_t calls_deadline_ns;  /* the members' call deadlines less their
                               * margins (INT64_MAX: none): bounds a split
                               * step's exchange (xstep.c) */
  uint64_t seen;              /* the last set walk that reached it */
  fps_tensor_t *cnext;        /* next tensor of the set walked */
  fps_apply_prep_t prep;      /* settling: what its update needs */
  float *sum;                 /* settling: its finished sum (t->mu) */
  bool exchanging;            /* settling: its set waits for the exchange of
                               * its split blocks (xstep.c; t->mu) */
} fps_round_t;

struct fps_tensor_s {
  char *name;                 /* NUL-terminated, <= FPS_NAME_MAX bytes */
  fps_shape_t shape;
  uint64_t numel;
  fps_adafactor_hparams_t hp;
  fps_state_size_t size;      /* optimizer state sizes (constant) */
  pthread_mutex_t mu;         /* guards everything below */
  fps_snap_t *pbuf;           /* the published parameters (one reference) */
  float *spare;               /* a freed numel-float buffer for the next sum
                               * or staging, or NULL (fps__tbuf_keep; this
                               * and the links: sh->spare_mu) */
  fps_tensor_t *spare_prev, *spare_next; /* in sh->spares while spare */
  float *param;               /* pbuf->data: numel floats, read only once
                               * ready (fps_snap_t's rule) */
  fps_adafactor_state_t st;
  struct fps_tensor_split_s *split; /* NULL: held whole; else a row block of
                               * a split tensor (split_tensor.h: then numel
                               * and size are the block's, st is unused) */
  bool ready;                 /* every element initialised */
  fps_ranges_t init;          /* initialised ranges while !ready */
  fps_ranges_t init_state[FPS_STATE_KINDS]; /* while !ready at a resume step
                                 * (version > 0): state ranges received */
  uint64_t init_gen;          /* bumped by every Create that writes it (create.c) */
  uint64_t version;           /* updates applied */
  double last_lr;             /* lr of the last update (Create's before one) */
  double last_weight_decay;   /* weight decay of the last update */
  uint64_t restored_seq;      /* checkpoint it was restored from, 0: none */
  uint64_t restored_version;  /* its version in that checkpoint */
  fps_round_t round;          /* sync mode */
  struct fps_reduce_s *red;   /* sync: the running sum of the round being
                               * streamed (reduce.h), NULL: none */
  fps_apply_rec_t *log;       /* ring of the last updates, log_cap slots */
  uint32_t log_cap, log_len, log_head;
  uint32_t log_max;           /* apply_log: the ring grows up to this */
  fps_tensor_t *rprev, *rnext; /* open-round list (sh->rounds_mu) */
  bool in_rounds;             /* linked in the open-round list */
  fps_tensor_t *hnext;        /* hash chain (store->mu) */
  fps_tensor_t *next;         /* creation order (store->mu) */
};

typedef struct fps_store_s {
  pthread_rwlock_t mu;        /* map structure; tensors are never removed */
  fps_tensor_t **bucket;
  size_t nbucket;             /* power of two */
  uint64_t count;
  uint64_t param_bytes;
  fps_tensor_t *first, *last; /* creation order */
} fps_store_t;

int fps_store_init(fps_store_t *st);
void fps_store_destroy(fps_store_t *st);
/* Lookup; REQUIRES store->mu held (read or write). */
fps_tensor_t *fps__store_find_locked(fps_store_t *st, const char *name, size_t len);
/* Lookup under the read lock. Tensors are never removed while the shard
 * runs, so the pointer stays valid. NULL if there is none. */
fps_tensor_t *fps_store_find(fps_store_t *st, const char *name);
/* Grows the table for n tensors, so that n inserts cannot fail.
 * REQUIRES store->mu held for writing. */
int fps__store_reserve_locked(fps_store_t *st, uint64_t n);
/* Inserts t (its name unique); REQUIRES store->mu held for writing. */
int fps__store_insert_locked(fps_store_t *st, fps_tensor_t *t);
/* Allocates a tensor (params uninitialised, state zeroed) or NULL on OOM. */
fps_tensor_t *fps_tensor_create(const char *name, size_t len, const fps_shape_t *shape,
                                uint64_t numel, const fps_adafactor_hparams_t *hp,
                                uint32_t workers, uint32_t log_cap);
/* The same for row block g of a split tensor placed by map (checked:
 * fps_shard_split_check): t->shape the whole shape, t->numel and t->size
 * the block's, t->split with a copy of the map and zeroed block state
 * (split_tensor.h). NULL on OOM. */
fps_tensor_t *fps_tensor_create_split(const char *name, size_t len, const fps_split_geom_t *g,
                                      const fps_split_map_t *map, const fps_adafactor_hparams_t *hp,
                                      uint32_t workers, uint32_t log_cap);
/* The tensor's state arrays by kind (FPS_STATE_*; NULL where it has none):
 * a block's from t->split->st, a whole tensor's from t->st. */
void fps_tensor_state_arrays(const fps_tensor_t *t, float *out[FPS_STATE_KINDS]);
void fps_tensor_destroy(fps_tensor_t *t);

/* fps_apply_prep_t (above, with the rounds): checks uh and allocates. */
/* Checks uh against t's settings and state (FPS_EHPARAM, FPS_EINVAL) and
 * allocates what the update needs (FPS_ENOMEM: with update, the wrapper of
 * the buffer that becomes the new parameters), with a message naming the
 * tensor. No lock needed: settings and state sizes are constant. On failure
 * prep holds nothing. */
int fps__apply_prepare(fps_shard_t *sh, const fps_tensor_t *t, const fps_update_hp_t *uh, bool update,
                       fps_apply_prep_t *prep, char *why, size_t why_len);
/* Frees what a prep still holds (what the apply did not use). */
void fps__apply_prep_release(fps_apply_prep_t *prep);

/* The one apply path of every mode. With update: one Adafactor step of t
 * with *grad (finite; an fps_tbuf_alloc buffer of t->numel) and the
 * update's hyperparameters uh (NULL: Create's), written out of place into
 * *grad, which becomes the tensor's published parameters (*grad set NULL:
 * consumed; the old buffer is retired), version+1, apply log, counters;
 * without (no_grad): nothing changes and *grad stays the caller's. With
 * want_snap, *snap gets the parameters after it with `refs` references (no
 * copy). With prep (fps__apply_prepare() for the same uh and update) this
 * cannot fail; without (NULL) it allocates: it may fail (FPS_E*, nothing
 * changed, nothing consumed). REQUIRES t->mu. */
int fps__tensor_apply_locked(fps_shard_t *sh, fps_tensor_t *t, float **grad, bool update, uint32_t worker_id,
                             uint64_t step, const fps_update_hp_t *uh, bool want_snap, int refs, fps_snap_t **snap,
                             fps_apply_prep_t *prep);

/* Pull's view of a tensor: a reference to its published parameters (no
 * copy) and their version. Returns 0, FPS_ENOTFOUND or FPS_ESTATE (still
 * initialising), with why. */
int fps_shard_snapshot(fps_shard_t *sh, const char *name, fps_tensor_t **t, fps_snap_t **snap, char *why,
                       size_t why_len);

/* GetState's view of a tensor: its optimizer state copied under its lock
 * (one version). Kinds in the order row, col, var, mom (FPS_STATE_*), back
 * to back in data. */
typedef struct fps_state_snap_s {
  fps_tensor_t *t;
  uint64_t version, step;
  double rms, lr, weight_decay;  /* hf RMS; the last update's lr / weight decay */
  uint64_t n[FPS_STATE_KINDS];  /* elements of each kind */
  uint64_t total;               /* their sum */
  float *data;                  /* total floats (fps_tbuf_alloc), or NULL */
} fps_state_snap_t;
/* Copies tensor `name`'s state. Returns 0, FPS_ENOTFOUND, FPS_ESTATE (still
 * initialising), FPS_ELIMIT (staging limit) or FPS_ENOMEM, with why.
 * Release with fps_state_snap_release() (also after a failure). */
int fps_shard_state_snap(fps_shard_t *sh, const char *name, fps_state_snap_t *out, char *why, size_t why_len);
/* The kind's array within a snapshot. */
const float *fps_state_snap_array(const fps_state_snap_t *s, int kind);
void fps_state_snap_release(fps_shard_t *sh, fps_state_snap_t *s);

/* The shard as Stats shows it. One tensor: what changes is copied under
 * its lock; name, shape, settings and state sizes are constant and read
 * through t. */
typedef struct fps_tensor_view_s {
  const fps_tensor_t *t;
  uint64_t version;
  bool ready;
  uint32_t nlog;              /* apply records in log, oldest first */
  const fps_apply_rec_t *log; /* into the view's storage */
} fps_tensor_view_t;

typedef struct fps_shard_view_s {
  uint64_t tensors;           /* tensors in the store */
  uint64_t param_elements;    /* their elements */
  uint64_t split_blocks;      /* of them, row blocks of split tensors */
  uint64_t split_elements;    /* the blocks' elements */
  fps_state_size_t state;     /* their optimizer state, summed */
  fps_tensor_view_t *t;       /* per tensor in creation order (with_tensors), else NULL */
  size_t n;
  fps_apply_rec_t *recs;      /* storage of every view's log */
  /* The counters (fps_counters_t) at the time of the view. */
  uint64_t pushes, push_errors, updates, bytes_received, bytes_sent, update_bytes;
  double push_seconds_sum, update_seconds_sum;
  uint64_t xbytes_sent, xbytes_received, xsteps, xfailures; /* the exchange */
  double xseconds_sum;
  double push_seconds_p50, push_seconds_p99; /* of the recent pushes, 0: none */
  double uptime_seconds;
} fps_shard_view_t;

/* Reads the shard: totals always; with with_tensors, one view per tensor
 * (each under its own lock, briefly) with up to log_limit of its newest
 * apply records. Returns 0 or FPS_ENOMEM (nothing to free then). Free
 * with fps_shard_view_free(). Thread-safe. */
int fps_shard_view(fps_shard_t *sh, bool with_tensors, uint32_t log_limit, fps_shard_view_t *out);
void fps_shard_view_free(fps_shard_view_t *v);

/* ---------------------------------------------------------------- create */

/* One TensorCreate: the hyperparameters are decoded (and validated) by
 * the caller; name and shape are checked here again. */
/* One run of a state array (float32 little-endian, any alignment). */
typedef struct fps_state_slice_s {
  int kind;                   /* FPS_STATE_*, or -1: not a kind */
  uint64_t offset;            /* first element within the kind's array */
  const uint8_t *data;
  size_t len;                 /* bytes */
} fps_state_slice_t;

typedef struct fps_create_item_s {
  const char *name;
  const uint64_t *dims;
  size_t ndim;
  fps_adafactor_hparams_t hp;
  const fps_slice_t *init;    /* initial values, NULL: none */
  /* Resume and ownership (TensorCreate step, init_state, rms, replace). */
  uint64_t step;              /* the step count and version to start at, 0: fresh */
  const fps_state_slice_t *state; /* with step > 0: state values */
  size_t n_state;
  double rms;                 /* hf RMS at resume */
  bool replace;               /* replace an existing tensor's values */
  /* A row block of a split tensor (proto SplitBlock), NULL: whole. Then
   * init and state are the block's, at block-local offsets. */
  const fps_split_map_t *split;
} fps_create_item_t;

typedef struct fps_create_info_s {
  fps_tensor_t *t;            /* the tensor this item names */
  uint64_t version;
  bool ready;
  uint64_t initialised;       /* elements with initial values */
  bool created;               /* first item of a tensor this call created */
} fps_create_info_t;

/* Create-or-match for n items (several may name one tensor: they must
 * agree). All is validated before anything changes: shard placement
 * (FPS_ESTATE), names and shapes (FPS_EINVAL), a tensor that exists with
 * another shape or settings (FPS_EEXISTS), init slices (range, dtype,
 * finite, no overlap with what is initialised: FPS_EINVAL), limits
 * (max_tensors, max_bytes: FPS_ELIMIT), memory (FPS_ENOMEM). On success
 * the new tensors are in the store, the init slices written (ignored for a
 * tensor that was already ready: the first values win), out[i] filled for
 * every item and *received set to the init bytes written. Thread-safe.
 *
 * Resume (step > 0): a new tensor starts at version and step count `step`
 * (hf: RMS `rms`) and is ready only once its params and every state array
 * are covered by init and state slices (this and later Creates at the same
 * step; FPS_EINVAL for another step, a state kind the tensor lacks, values
 * out of range, non-finite or negative second moments, overlap). Replace:
 * an existing tensor's params, state, step and version are replaced by
 * this call's, which must cover all of them (FPS_EINVAL otherwise), in one
 * step under its lock; FPS_ESTATE while a sync round is open for it. A
 * missing tensor is created as without replace.
 *
 * Split blocks (item.split): the map is checked (fps_shard_split_check:
 * FPS_ESTATE, FPS_EINVAL), then whether this shard may hold blocks
 * (fps_shard_split_allowed: FPS_ESTATE); a block matches an existing one
 * only with the same shape, settings and map, and a whole tensor never
 * matches a block (FPS_EEXISTS naming what differs). Everything above
 * then holds for the block: its numel, state sizes and offsets. */
int fps_shard_create(fps_shard_t *sh, uint32_t shard_id, uint32_t shard_count, const fps_create_item_t *items,
                     size_t n, fps_create_info_t *out, uint64_t *received, char *why, size_t why_len);

/* ---------------------------------------------------------------- push */

/* Called once when a push that fps_push_commit() left waiting is resolved
 * (applied, failed, cancelled): on the thread that resolved it (another
 * push's, the timer's), with no core lock held. The push stays owned by its
 * creator; fps_push_result() tells how it ended. */
typedef void (*fps_push_done_fn)(fps_push_t *p, void *arg);

/* A new push (one PushPull call). deadline_ns: the call's deadline on the
 * fps_now_ns() clock (INT64_MAX: none); done/arg: see fps_push_done_fn.
 * Returns 0 or FPS_ENOMEM. Free with fps_push_destroy(). */
int fps_push_create(fps_shard_t *sh, int64_t deadline_ns, fps_push_done_fn done, void *arg, fps_push_t **out);
/* The call's deadline, when it is known only after the push exists.
 * REQUIRES: before fps_push_commit(). */
void fps_push_set_deadline(fps_push_t *p, int64_t deadline_ns);
/* Frees p, its staging and its results. REQUIRES p not waiting (never
 * committed, failed, or resolved). NULL is a no-op. */
void fps_push_destroy(fps_push_t *p);
/* The header of each message: the first call sets worker_id/step/
 * skip_params and checks the job (fps_push_header_check: FPS_ESTATE);
 * later ones must repeat worker_id, step, num_workers and expect_mode
 * (FPS_EINVAL). */
int fps_push_header(fps_push_t *p, uint32_t worker_id, uint64_t step, bool skip_params, uint32_t num_workers,
                    int expect_mode, char *why, size_t why_len);
/* One tensor's settings for this push (TensorPush in the proto). */
typedef struct fps_push_tensor_s {
  const char *name;
  bool has_lr;
  double lr;                  /* this update's lr (absent: Create's) */
  bool has_weight_decay;
  double weight_decay;        /* this update's weight decay (absent: Create's) */
  bool no_grad;               /* no gradient this step: nothing applied */
  bool has_step;
  uint64_t step;              /* this tensor's step, if not the push's */
} fps_push_tensor_t;
/* Records tp for its tensor: the tensor must exist and be ready, be named
 * once and before its first slice (FPS_EINVAL), its lr/weight decay pass
 * the flavor's rules (FPS_EHPARAM); sync: its step must be the tensor's
 * version (FPS_ESTALE, FPS_EAHEAD). */
int fps_push_tensor(fps_push_t *p, const fps_push_tensor_t *tp, char *why, size_t why_len);
/* One gradient slice of tensor `name`: the tensor must exist (FPS_ENOTFOUND)
 * and be ready (FPS_ESTATE); sync: the step must be the tensor's version
 * (FPS_ESTALE, FPS_EAHEAD); the slice must fit (FPS_EINVAL), not overlap
 * one already received (FPS_EINVAL) and hold finite values below
 * FPS_GRAD_ABS_LIMIT (FPS_EINVAL); its tensor is staged within
 * max_staging_bytes (FPS_ELIMIT). The data is read in one pass (piece by
 * piece with s->src: FPS_EPROTO if the pieces end early): decoded into
 * staging or the sync sum, or (sync, s->owner set) staged as a reference
 * to be checked when it is summed, which may then fail the push later
 * (reduce.h); nothing is applied before fps_push_commit(). */
int fps_push_slice(fps_push_t *p, const char *name, const fps_slice_t *s, char *why, size_t why_len);
/* The stream is complete: every staged tensor must be covered (FPS_EINVAL).
 * async: applies now. ssp: applies now or parks until the slowest worker
 * is close enough. sync: joins every tensor's round or none (FPS_ESTALE,
 * FPS_EAHEAD, FPS_EDUP); the push that completes a round applies it.
 * Returns 0 when the push is resolved on return (fps_push_result() tells
 * how; done is not called), FPS_EAGAIN when it waits (done is called once,
 * maybe before this returns), or another FPS_E* when it was refused before
 * joining or waiting (nothing applied, done is not called). */
int fps_push_commit(fps_push_t *p, char *why, size_t why_len);
/* The call went away: a push still waiting withdraws from its rounds or
 * its ssp wait (a withdrawn member never counts) and is resolved with
 * FPS_ECANCELLED (done is called if it was waiting). Before the commit,
 * it only marks p, so a later commit withdraws at once. Thread-safe. */
void fps_push_cancel(fps_push_t *p);
/* How a resolved push ended: 0, or the FPS_E* of its first failed tensor
 * with its message in why. */
int fps_push_result(fps_push_t *p, char *why, size_t why_len);
/* The tensors of a resolved push, in first-seen order. */
size_t fps_push_count(const fps_push_t *p);
typedef struct fps_push_out_s {
  fps_tensor_t *t;
  fps_snap_t *snap;           /* the parameters after the update; NULL with skip_params */
  uint64_t version;           /* version after the update */
  int dtype;                  /* dtype of the first slice received */
} fps_push_out_t;
/* Item i's bf16 encoding of its snapshot, made by the update for a bf16
 * reply: the reference moves to the caller (NULL: none; a second take
 * gets NULL; one not taken goes with the push). */
fps_snap_bf16_t *fps_push_take_bf16(fps_push_t *p, size_t i);
/* Item i of a successful push; the snapshot reference moves to the caller
 * (a second take of the same item gets snap NULL). */
void fps_push_take(fps_push_t *p, size_t i, fps_push_out_t *out);
uint32_t fps_push_worker(const fps_push_t *p);
/* The push's idempotency key (PushPullRequest.push_id; 0: none), the same
 * in every message of a call: FPS_EINVAL if it changes. */
int fps_push_set_id(fps_push_t *p, uint64_t push_id, char *why, size_t why_len);
/* True if the resolved push was a retry answered from the window (nothing
 * applied by this call). */
bool fps_push_replayed(const fps_push_t *p);
/* The push's idempotency key (0: none); fixed once it is committed. */
uint64_t fps__push_key(const fps_push_t *p);

/* Sync backpressure. A slice that arrives before the workers below its
 * worker have been summed over its elements is staged; so that staging
 * stays near one message per call, the RPC layer asks after each message
 * whether to receive the next one now. fps_push_hold() says true (hold)
 * when the push has more than FPS_PUSH_HOLD_BYTES staged and a lower
 * worker that has not yet sent all of that tensor is still streaming
 * (its call alive, not half-closed); otherwise the push keeps streaming and
 * stages (within max_staging_bytes). After a true, the caller must not
 * receive until `resume` runs: once, on any thread, possibly with core
 * locks held, so it must only post the next receive. It runs when staged
 * pieces are summed, when a lower worker half-closes or goes away, when
 * the round's sum is discarded, when the push is cancelled, and at the
 * latest at the push's deadline or after --deadline seconds (the expiry
 * hook). A hold never waits on a higher worker, so holds cannot form a
 * cycle: the lowest streaming worker of a tensor is never held for it, and
 * worker 0 never is. */
#define FPS_PUSH_HOLD_BYTES (UINT64_C(4) << 20)
typedef void (*fps_push_resume_fn)(fps_push_t *p, void *arg);
void fps_push_set_resume(fps_push_t *p, fps_push_resume_fn fn, void *arg);
bool fps_push_hold(fps_push_t *p);

/* --------------------------------------------------- the shard, counters */

typedef struct fps_counters_s {
  atomic_uint_fast64_t pushes;
  atomic_uint_fast64_t push_errors;
  atomic_uint_fast64_t updates;
  atomic_uint_fast64_t bytes_received;
  atomic_uint_fast64_t bytes_sent;
  atomic_uint_fast64_t update_bytes;
  pthread_mutex_t mu;               /* the doubles and the latency ring */
  double push_seconds_sum;
  double update_seconds_sum;
  /* The exchange of split tensors' partials (xstep.c): bytes of partials
   * acknowledged by peers / accepted from peers, steps exchanged, steps
   * failed (every cause), and their seconds from sending ours to having
   * every block's (sum, under mu). */
  atomic_uint_fast64_t xbytes_sent, xbytes_received, xsteps, xfailures;
  double xseconds_sum;
  double latency[FPS_LATENCY_RING];
  uint32_t latency_n, latency_head;
} fps_counters_t;

/* An ssp push waiting for the slowest worker (embedded in the push). */
typedef struct fps_ssp_wait_s {
  fps_push_t *p;
  uint32_t worker_id;
  uint64_t step;
  int64_t deadline_ns;
  bool parked;                      /* linked (sh->ssp_mu) */
  struct fps_ssp_wait_s *prev, *next;
} fps_ssp_wait_t;

/* Push idempotency (idem.c): the (worker, push_id) keys of the last
 * FPS_IDEM_WINDOW pushes that carried one, shard-wide, in arrival order. A
 * push whose key is APPLIED applies nothing and is answered with the
 * versions the first attempt made and the tensors' current parameters; one still CLAIMED (in
 * flight) is refused FPS_EUNAVAILABLE (retry later). Keys older than the
 * window are forgotten: such a retry is applied again (async) or refused
 * as stale (sync, ssp: the tensor's version moved on). The ring is
 * allocated and touched at start-up (64 bytes a key, 4 MiB), so memory
 * does not grow with pushes; a push of more than FPS_IDEM_INLINE tensors
 * keeps its versions in a small allocation of its own. */
#define FPS_IDEM_WINDOW 65536
enum { FPS_IDEM_FREE = 0, FPS_IDEM_CLAIMED, FPS_IDEM_APPLIED };
#define FPS_IDEM_INLINE 4            /* versions kept in the entry itself */
typedef struct fps_idem_entry_s {
  uint64_t id;                      /* push_id */
  uint64_t tensors;                 /* hash of the push's tensors, in order */
  uint32_t worker;
  uint32_t next;                    /* hash chain (slot index) */
  uint16_t state;                   /* FPS_IDEM_* */
  uint16_t n;                       /* APPLIED: tensors of the push */
  union {
    uint64_t in[FPS_IDEM_INLINE];   /* n <= FPS_IDEM_INLINE: the versions made */
    uint64_t *out;                  /* otherwise (owned) */
  } v;
} fps_idem_entry_t;
typedef struct fps_idem_s {
  pthread_mutex_t mu;
  fps_idem_entry_t *ent;            /* ring of cap slots */
  uint32_t cap, head;               /* head: the next slot to take */
  uint32_t *bucket;                 /* nbucket chain heads */
  uint32_t nbucket;                 /* power of two */
} fps_idem_t;
int fps__idem_init(fps_idem_t *ix, uint32_t window);
void fps__idem_destroy(fps_idem_t *ix);
/* Claims (worker, id) for a push about to commit: 0 (claimed, *slot set),
 * FPS_EEXISTS (already applied), FPS_EAGAIN (claimed by a push in flight). */
int fps__idem_claim(fps_idem_t *ix, uint32_t worker, uint64_t id, uint32_t *slot);
/* True if (worker, id) is remembered as applied. */
bool fps__idem_applied(fps_idem_t *ix, uint32_t worker, uint64_t id);
/* The claimed push is resolved: applied (remembered with the versions it
 * made, v[0..n), of the tensors whose hash is `tensors`) or not
 * (forgotten; v NULL). */
void fps__idem_settle(fps_idem_t *ix, uint32_t slot, uint32_t worker, uint64_t id, uint64_t tensors,
                      const uint64_t *v, uint32_t n);
/* The versions the applied push (worker, id) made, into v[0..n): 0, or
 * FPS_EINVAL if it named other tensors (hash, count), FPS_ENOTFOUND if the
 * key is gone. */
int fps__idem_versions(fps_idem_t *ix, uint32_t worker, uint64_t id, uint64_t tensors, uint64_t *v, uint32_t n);

struct fps_shard_s {
  fps_shard_opts_t cfg;
  fps_idem_t idem;                  /* push idempotency (idem.c) */
  const fps_kernels_t *kernels;
  fps_pool_t *pool;                 /* splits large tensors' updates; NULL: none */
  atomic_uint_fast64_t tbuf_bytes;  /* bytes in fps_tbuf_alloc buffers,
                                     * the tensors' spares included */
  atomic_uint_fast64_t spare_bytes; /* of which spares (in flight: the rest) */
  pthread_mutex_t spare_mu;         /* a leaf lock: spares, t->spare */
  fps_tensor_t *spares, *spares_last; /* tensors holding a spare, least
                                     * recently kept first (given up in
                                     * that order) */
  fps_store_t store;
  fps_counters_t counters;
  int64_t started_ns;
  /* ssp: per-worker completed pushes and the parked pushes. */
  pthread_mutex_t ssp_mu;
  uint64_t *ssp_clock;              /* [workers] */
  bool ssp_started;                 /* clocks start at the first push's step */
  fps_ssp_wait_t *ssp_waits;
  /* Tensors with an open sync round (for the expiry hook), and every
   * round's membership (fps_round_t). */
  pthread_mutex_t rounds_mu;
  fps_tensor_t *rounds;
  /* Sync pushes held back (fps_push_hold), for the expiry hook. A leaf
   * lock: it also guards every push's held flag and wake count. */
  pthread_mutex_t held_mu;
  fps_push_t *held;
  uint64_t rounds_walk;             /* set walks so far (fps_round_t.seen) */
  /* Bumped after anything a checkpoint holds changes (an update; a Create
   * that writes values, replaces or adds tensors; over-counting only costs
   * a write), so checkpoint.c can tell that nothing changed since the last
   * checkpoint it wrote or loaded. */
  atomic_uint_fast64_t changes;
  /* Checkpoints (checkpoint.c). */
  pthread_mutex_t ckpt_mu;          /* one checkpoint at a time */
  bool ckpt_have_last;              /* a checkpoint was written or loaded (ckpt_mu) */
  uint64_t ckpt_last_changes;       /* `changes` before its copy (ckpt_mu) */
  char ckpt_last_path[4096];        /* its file (ckpt_mu) */
  int ckpt_dir_fd;                  /* lease on checkpoint_dir, -1: none */
  uint64_t ckpt_restored_seq;       /* checkpoint loaded at start-up, 0: none */
  pthread_t ckpt_thread;            /* periodic checkpoints */
  bool ckpt_thread_on;
  pthread_mutex_t ckpt_thread_mu;
  pthread_cond_t ckpt_thread_cv;
  bool ckpt_thread_stop;
  /* The exchange of split tensors' partial sums (split_tensor.h), set by
   * fps_shard_set_exchange() before serving; xsend NULL: no --peers, so
   * no split blocks. */
  fps_xsend_fn xsend;
  void *xsend_ctx;
  double xdeadline;                 /* seconds a step's exchange may take */
  /* The sets exchanging (xstep.c), for the expiry hook; xs_mu comes after
   * every tensor lock. */
  pthread_mutex_t xs_mu;
  struct fps_xgroup_s *xgroups;
};

/* An empty shard: copies opts (checkpoint_dir stays borrowed), uses
 * kernels and pool (NULL: none; the pool stays the caller's). Returns 0 or
 * FPS_ENOMEM. */
int fps_shard_init(fps_shard_t *sh, const fps_shard_opts_t *opts, const fps_kernels_t *kernels, fps_pool_t *pool);
/* Frees the store and the waits. REQUIRES no push in progress. */
void fps_shard_destroy(fps_shard_t *sh);
/* Expiry hook (timer.h; arg: the shard): fails rounds and ssp waits past
 * their deadline with FPS_ETIMEOUT. */
void fps_shard_expire(void *sh, int64_t now_ns);
/* Fails every waiting push (shutdown) with err and why. */
void fps_shard_fail_waiting(fps_shard_t *sh, int err, const char *why);
/* Counts a finished push (ok: its latency too). Thread-safe. */
void fps_counters_push_done(fps_shard_t *sh, bool ok, double seconds);

/* sync.c, for push.c: joins every entry of a push to its tensor's round
 * (all or none), each at its own step (e->step), which links those rounds
 * into one set; if that made every round of the set full, the set is
 * completed (all applied, or all failed) and its members resolved before
 * returning. 0 or FPS_ESTALE / FPS_EAHEAD / FPS_EDUP / FPS_ENOMEM. */
int fps__sync_join(fps_shard_t *sh, fps_push_entry_t **e, size_t n, uint32_t worker_id, int64_t deadline_ns,
                   char *why, size_t why_len);
/* Withdraws a push's entries still waiting in rounds, all at once (none
 * if its set is already being completed); returns how many (they are
 * resolved FPS_ECANCELLED by the caller). A withdrawn entry with part of
 * its gradient in its round's sum aborts that round's set (its members are
 * resolved FPS_EUNAVAILABLE here). */
size_t fps__sync_withdraw(fps_shard_t *sh, fps_push_entry_t **e, size_t n);
/* Entry e (not waiting) is being freed: it leaves its round's sum,
 * aborting the round if part of its gradient is in it. */
void fps__sync_leave(fps_shard_t *sh, fps_push_entry_t *e);
/* A bad value was found in entry e's staged gradient when it was summed
 * (reduce.c; e->red_err and red_msg set). If e waits in its round, t's
 * sum is discarded and the round's set fails: e's push with e->red_err
 * and its message, the other members with FPS_EUNAVAILABLE, chained onto
 * *list (resolve them with fps__sync_resolve once no lock is held). A push
 * still streaming fails at its next slice or its join instead. REQUIRES
 * e->t->mu. */
void fps__sync_member_failed_locked(fps_shard_t *sh, fps_push_entry_t *e, fps_push_entry_t **list);
/* Resolves the entries chained through resolve_next (NULL: none). */
void fps__sync_resolve(fps_push_entry_t *list);
void fps__sync_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason);
/* ssp.c, for push.c. admit_or_park: true if the worker may go now,
 * otherwise parks w. advance: records a finished push and resumes parked
 * pushes that may go now. unpark: true if w was parked (and no longer is). */
bool fps__ssp_admit_or_park(fps_shard_t *sh, fps_ssp_wait_t *w);
void fps__ssp_advance(fps_shard_t *sh, uint32_t worker_id, uint64_t step);
bool fps__ssp_unpark(fps_shard_t *sh, fps_ssp_wait_t *w);
void fps__ssp_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason);
/* push.c, for sync.c, reduce.c and ssp.c. wake: whatever held p back may
 * have changed (resumes it if held). streaming: p still receives (its
 * call alive, not half-closed). REQUIRES nothing; may run under t->mu. */
void fps__push_wake(fps_push_t *p);
bool fps__push_streaming(fps_push_t *p);
/* Counts bytes of p's slices staged (+) or summed/freed (-). */
void fps__push_staged_add(fps_push_t *p, int64_t bytes);
/* Entry e of p (red_err, red_msg set) held a bad value in a staged slice:
 * p's later slices are refused with e's error (the first such entry's). */
void fps__push_staged_failed(fps_push_t *p, fps_push_entry_t *e);
void fps__push_expire_holds(fps_shard_t *sh, int64_t now, bool force);
void fps__push_entry_resolved(fps_push_entry_t *e);
/* The push's entries (*out), fixed once it is committed; returns their
 * count, or 0 if set walk `walk` (sh->rounds_walk) already visited them, so
 * a walk costs O(rounds x W + entries). REQUIRES sh->rounds_mu. */
size_t fps__push_entries(fps_push_t *p, uint64_t walk, fps_push_entry_t ***out);
void fps__push_ssp_resume(fps_push_t *p);
void fps__push_ssp_fail(fps_push_t *p, int err, const char *msg);
/* Where a push's time went, for the sync step timeline (sync.c, debug
 * log): created (its call's first message), its stream's end (0: still
 * streaming), and how long and how often it was held (fps_push_hold). */
typedef struct fps_push_times_s {
  int64_t created_ns, recv_end_ns, held_ns;
  uint32_t holds;
} fps_push_times_t;
void fps__push_times(fps_push_t *p, fps_push_times_t *out);

/* One tensor's gradient within one push. */
struct fps_push_entry_s {
  fps_push_t *owner;
  fps_tensor_t *t;
  uint32_t worker_id;         /* the pushing worker */
  bool skip_params;           /* no snapshot wanted */
  float *grad;                /* numel floats: staging, becomes the params */
  fps_ranges_t got;           /* slices received */
  int dtype;                  /* dtype of the first slice: reply dtype */
  uint64_t step;              /* this tensor's step (TensorPush.step or the push's) */
  bool has_slices;            /* a gradient slice arrived */
  bool has_push;              /* a TensorPush named it */
  bool no_grad;               /* TensorPush.no_grad: nothing to apply */
  bool has_lr, has_weight_decay;
  double lr, weight_decay;    /* TensorPush values when has_* */
  fps_update_hp_t uh;         /* effective values (set at commit) */
  bool in_round;              /* member of t->round (t->mu) */
  int err;                    /* result when resolved: 0 or FPS_E* */
  char *msg;                  /* error text when err != 0 */
  fps_snap_t *snap;           /* result params (ok, unless skip_params) */
  fps_snap_bf16_t *bf16;      /* snap's encoding made by the update, for a
                               * bf16 reply (one reference), or NULL */
  uint64_t version;           /* version after the update */
  fps_apply_prep_t prep;      /* async/ssp: allocated before any tensor is applied */
  fps_push_entry_t *resolve_next; /* sync: members of a finished set, to resolve */
  /* Sync: how this gradient gets into its round's sum (reduce.h; all under
   * t->mu). */
  struct fps_piece_s *staged; /* pieces received but not summed yet */
  uint64_t staged_n;          /* their elements */
  bool attached;              /* t->red->owner[worker_id] is this entry */
  bool replay_only;           /* a retry of an applied push: checked, not kept */
  bool withdrawn;             /* withdrawn from its round (sh->rounds_mu) */
  int red_err;                /* the sum it was in was discarded, or its
                               * staged gradient held a bad value: FPS_E*,
                               * 0: none */
  char *red_msg;              /* why */
  fps_push_entry_t *red_fail_next; /* t->red->failed (reduce.c) */
};

/* ------------------------------------- per-push settings (push_settings.c)
 *
 * Each returns 0 or a negative FPS_E* with a message in `why` naming the
 * tensor and the problem. */

/* The stream header against the shard's configuration: worker_id < W and
 * num_workers == W (unless 0) in sync/ssp, expect_mode (0: any) equal to
 * the shard's mode. FPS_ESTATE on a mismatch. */
int fps_push_header_check(const fps_shard_opts_t *cfg, uint32_t worker_id, uint32_t num_workers, int expect_mode,
                          char *why, size_t why_len);
/* Validates a TensorPush's lr / weight decay for tensor t with its flavor's
 * own rules (as Create does): FPS_EHPARAM. */
int fps_push_settings_check(const fps_tensor_t *t, bool has_lr, double lr, bool has_wd, double wd, char *why,
                            size_t why_len);
/* e->uh from e's TensorPush values and t's Create settings. */
void fps_push_settings_resolve(fps_push_entry_t *e);
/* A full sync round's members m[0..W-1] against each other: identical
 * effective lr/weight decay (FPS_ESTATE naming the workers and values), a
 * gradient from all or none (FPS_ESTATE naming who had and who lacked one).
 * *all_no_grad is set when no member has a gradient. */
int fps_round_agree(const fps_tensor_t *t, fps_push_entry_t *const *m, uint32_t W, bool *all_no_grad, char *why,
                    size_t why_len);

/* ----------------------------------------------------------- checkpoints */

/* What one checkpoint did (checkpoint.c). */
typedef struct fps_ckpt_done_s {
  char path[4096];
  uint64_t seq;
  uint64_t bytes;                   /* file size */
  uint64_t tensors;                 /* tensors written */
  uint64_t skipped;                 /* tensors still initialising, not written */
  double seconds;                   /* all of it */
  double copy_seconds;              /* allocating and copying the snapshot */
  double max_hold_seconds;          /* longest time one tensor lock was held */
} fps_ckpt_done_t;

/* At start-up, before serving: takes the lease on checkpoint_dir (creating
 * it) and loads the newest valid checkpoint into the empty store (files
 * that fail verification are logged and skipped). Returns 0 (restored, or
 * nothing to restore and not required), FPS_ENOTFOUND (required but none
 * valid), or another FPS_E* with the reason logged. No-op without a dir. */
int fps_checkpoint_open(fps_shard_t *sh);
/* Writes a checkpoint now: copies every ready tensor under its own lock,
 * writes outside every lock. Thread-safe (serialised by sh->ckpt_mu).
 * Returns 0, FPS_ESTATE (no checkpoint_dir), FPS_ENOTFOUND (no ready
 * tensor: nothing written, nothing pruned), or FPS_E* with `why`. */
int fps_checkpoint_write(fps_shard_t *sh, fps_ckpt_done_t *out, char *why, size_t why_len);
/* Periodic checkpoints (checkpoint_interval > 0); start is a no-op
 * otherwise. stop joins the thread (a write in progress finishes first);
 * close stops it too and releases the directory lease. */
int fps_checkpoint_start(fps_shard_t *sh);
void fps_checkpoint_stop(fps_shard_t *sh);
void fps_checkpoint_close(fps_shard_t *sh);
/* True if the newest checkpoint this process wrote or loaded still holds
 * the shard's state: nothing changed since it was copied and its file is
 * still there (SIGTERM's final write and the periodic one are skipped
 * then). Thread-safe. */
bool fps_checkpoint_unchanged(fps_shard_t *sh);
/* Appends to `buf` what a worker ahead of a restored tensor must do
 * (nothing if the tensor was not restored). No lock needed: the
 * restored_* fields are written before serving and never change. */
void fps_checkpoint_ahead_hint(const fps_tensor_t *t, char *buf, size_t len);

#endif

/* The shard core's inside: the structs and the calls its files make of
 * each other (after SQLite's sqliteInt.h and libuv's src/unix/internal.h).
 * The RPC layer sees only shard.h; the core's files and its unit tests
 * include this. One banner per file says which file defines what is
 * under it; the banners run from the ground floor up, and a file calls
 * only what stands under its own banner or below it (a lower file that
 * must resume a higher one does it through a callback).
 *
 *   ranges.c      sorted interval sets (slice coverage and overlap)
 *   rules.c       the name, shape and slice rules every method shares
 *   staging.c     tensor-sized buffers counted against max_staging_bytes,
 *                 the tensors' spare buffers, the refcounted parameter
 *                 buffers (fps_snap_t) replies and Pull reference
 *   snap_bf16.c   a parameter buffer's bf16 encoding, shared by replies
 *   split_block.c the block map of a split tensor: checks, match, sizes
 *   store.c       tensors and the store (name -> tensor), the one apply
 *                 path of every mode
 *   idem.c        push idempotency: the window of applied push ids
 *   push_settings.c  per-push lr / weight decay / no_grad, the job checks
 *                 of the stream header, a round's agreement
 *   push_state.c  a push as the files below push.c see it: wake, streaming,
 *                 staged bytes, entries, resolution (done callback)
 *   ssp.c         ssp waits: admit, park, advance, expire
 *   reduce.c      a sync round's running sum: slices summed in worker-id
 *                 order as they arrive, early ones staged
 *   xstep.c       the cross-shard step of a sync set holding blocks:
 *                 partials out and in, combine, apply all or nothing
 *   sync.c        sync rounds: join all-or-none, completion in worker-id
 *                 order, deadline, duplicate/stale/ahead, withdraw
 *   push.c        one worker's push: staging, the checks, then async
 *                 apply, a sync round or an ssp wait
 *   create.c      Create's rules: create-or-match, init coverage, limits
 *   checkpoint.c  durable checkpoints: restore, snapshots, the interval
 *   core.c        the shard: set-up, teardown, expiry, the counters and
 *                 the views Stats, Pull and GetState read
 *
 * Locks, in acquisition order (never the reverse): store->mu (rwlock) ->
 * tensor->mu -> sh->ssp_mu -> push->mu -> sh->rounds_mu, and tensor->mu ->
 * sh->xs_mu -> an exchanging set's own mutex (xstep.c). Several tensor
 * locks are taken in address order, and by a thread holding no other tensor
 * lock. A set of linked sync rounds is completed with its tensors' locks
 * held only to check, sum, apply and collect its members; their pushes are
 * resolved (callbacks run) after they are released. snap_bf16.c's lock is
 * a leaf: taken with or without any of these, nothing is taken inside it;
 * so are sh->spare_mu (staging.c) and sh->held_mu (push.c). */
#ifndef FPS_SHARD_INTERNAL_H
#define FPS_SHARD_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adafactor.h"
#include "adafactor_split.h"
#include "clock.h"
#include "shard.h"

typedef struct fps_push_entry_s fps_push_entry_t;
struct fps_tensor_split_s;

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

/* ---------------------------------------------------- ranges.c */

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

/* ----------------------------------------------------- rules.c */

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
/* Appends to `buf` what a worker ahead of a restored tensor must do
 * (nothing if the tensor was not restored). No lock needed: the
 * restored_* fields are written before serving and never change. */
void fps_checkpoint_ahead_hint(const fps_tensor_t *t, char *buf, size_t len);

/* --------------------------------------------------- staging.c */

/* fps_snap_t: a refcounted, immutable fp32 parameter buffer at one version. A tensor's
 * parameters are one (t->pbuf, published): replies, Pull and checkpoints
 * take references instead of copying, so a slow reader never holds the
 * tensor's lock and nothing is copied per sent byte. Rule: nobody writes a
 * buffer another holder may read. An update writes the new parameters out
 * of place into its own gradient buffer, which becomes the next t->pbuf;
 * Create's init writes only a tensor that is not ready (no references
 * handed out yet); replace and restore install a new buffer. */
struct fps_snap_s {
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
};

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
/* A staged gradient buffer (numel floats, counted) becomes a tensor's
 * parameters at `version`: wrapped in s with one reference, no longer
 * counted as staging (it counts in the store's param_bytes from now on). */
void fps__pbuf_adopt(fps_shard_t *sh, fps_snap_t *s, float *data, uint64_t numel, uint64_t version);
/* Tensor t lets go of its buffer s (NULL-safe; t NULL: no recycling): it
 * counts as staging from now on, and its last holder (readers may keep it
 * past this call) makes it t's spare (fps__tbuf_keep). sh NULL: the
 * shard's teardown, just freed. */
void fps__pbuf_retire(fps_shard_t *sh, fps_tensor_t *t, fps_snap_t *s);
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

/* ------------------------------------------------- snap_bf16.c */

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

/* ----------------------------------------------- split_block.c */

/* Checks block `map` of tensor `name` (shape already validated) against
 * this shard (shard_id of shard_count). Returns 0 (then *row_lo and *row_hi,
 * may be NULL, get the block's rows), FPS_ESTATE (map made for another
 * shard count, or the block is another shard's: the message names both
 * counts / ids) or FPS_EINVAL (inconsistent geometry, naming the field).
 * The count is checked first: a map for another count says nothing about
 * this job's geometry. */
int fps_shard_split_check(const char *name, const fps_shape_t *shape, const fps_split_map_t *map,
                          uint32_t shard_id, uint32_t shard_count, uint64_t *row_lo,
                          uint64_t *row_hi, char *why, size_t why_len);

/* Whether this shard can hold split blocks at all: FPS_ESTATE naming the
 * tensor and the reason (no sender installed: "this shard has no
 * --peers"; async/ssp mode: "split tensors need --mode sync"), else 0.
 * The one place these rules live (the cross-shard step may lift the mode
 * rule). */
int fps_shard_split_allowed(const struct fps_shard_s *sh, const char *name, char *why,
                            size_t why_len);

/* Create-or-match of tensor `name`: the map it is held with (`have`, NULL:
 * held whole) against the one asked for (`want`, NULL: whole). 0 if they
 * are the same (both whole, or equal block_index, bounds, block_shards and
 * shard_count), else FPS_EEXISTS naming what differs (existing vs
 * requested). */
int fps_shard_split_match(const char *name, const fps_split_map_t *have, const fps_split_map_t *want,
                          char *why, size_t why_len);

/* The map a block tensor's t->split holds, as a view (points into it). */
void fps_shard_split_map_of(const struct fps_tensor_split_s *s, fps_split_map_t *out);

/* The optimizer state a block keeps (proto SplitBlock): STATE_ROW its
 * rows, STATE_COL cols per touched matrix (factored), STATE_VAR its
 * elements (1-D), STATE_MOM its elements (hf with beta1); AdamW's figure
 * for its elements. */
void fps_shard_split_state_size(const fps_split_geom_t *g, const fps_adafactor_hparams_t *hp,
                                fps_state_size_t *out);

/* ----------------------------------------------------- store.c */

/* A row block of a split tensor held by this shard (proto SplitBlock and
 * Exchange). A block is an ordinary fps_tensor_t with t->split set:
 *   t->shape  the WHOLE tensor's shape (names, create-or-match, the shape a
 *             slice may carry);
 *   t->numel  the BLOCK's elements (split->g.block_numel): params,
 *             gradients, snapshots, init and gradient slices use
 *             block-local offsets (element 0 is the tensor's lo*C);
 *   t->size   the block's optimizer state sizes;
 *   t->st     unused (zeroed): the block's state is split->st.
 * Version, readiness, init ranges, the sync round and the apply log are
 * the block's own and behave as for a whole tensor. A step of the block
 * is a step of the whole tensor: pass A here, partials to and from every
 * other block's shard, combine in block order, pass C here
 * (common/adafactor_split.h). A block's step applies only when this shard
 * holds every block's partials of every due phase AND every peer has
 * acknowledged ours; anything else (a send that failed after its retries,
 * a refusal, the deadline) fails the step with FPS_EUNAVAILABLE and
 * nothing is applied here (README "Split tensors"). */
struct fps_xstep_s;  /* the cross-shard step in flight (xstep.c) */
struct fps_xmail_s;  /* partials that arrived before this shard's step */

/* t->split of a block tensor; fixed at Create except where noted. */
typedef struct fps_tensor_split_s {
  fps_split_geom_t g;          /* this block's rows within the tensor */
  uint32_t block_index;        /* which block: bounds[i] .. bounds[i + 1] */
  uint32_t n_blocks;
  uint64_t *bounds;            /* n_blocks + 1 row boundaries (owned) */
  uint32_t *block_shards;      /* n_blocks shard ids, increasing (owned) */
  uint32_t shard_count;        /* the count the map was made for */
  fps_split_state_t st;        /* the block's optimizer state (t->mu) */
  struct fps_xstep_s *xs;      /* the step in flight, NULL: none (t->mu) */
  struct fps_xmail_s *mail;    /* early partials (t->mu), NULL: none */
  struct fps_xrec_s *rec;      /* anchors and the peers' versions
                                * (xrecover.c; t->mu), NULL: none yet */
  uint64_t replaces;           /* replaces of the block (t->mu): its history;
                                * a standby takes its primary's count with
                                * each image (replica.c) */
} fps_tensor_split_t;

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
                               * a split tensor (fps_tensor_split_t above: then numel
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
 * (fps_tensor_split_t). NULL on OOM. */
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
/* store.c: the hyperparameters of one update (Create's, with the push's
 * lr and weight decay). */
fps_adafactor_hparams_t fps__update_hparams(const fps_tensor_t *t, const fps_update_hp_t *uh);

/* ------------------------------------------------------ idem.c */

/* Push idempotency (idem.c): the (worker, push_id) keys of pushes that
 * carried one, at most FPS_IDEM_WINDOW shard-wide and FPS_IDEM_PER_WORKER
 * per worker. A push whose key is APPLIED applies nothing and is answered
 * with the versions the first attempt made and the tensors' current
 * parameters; one still CLAIMED (in flight) is refused FPS_EUNAVAILABLE
 * (retry later). Keys in flight are never forgotten. A worker past its own
 * bound forgets its own oldest settled key. When the shard-wide window is
 * full, the worker holding the most keys forgets its oldest, but never its
 * newest FPS_IDEM_KEEP: if every worker is down to those, a new key is
 * refused (FPS_ELIMIT; the push fails UNAVAILABLE, applying nothing). So
 * another worker's pushes, under any number of worker ids, can never take
 * a worker's keys in flight or its newest FPS_IDEM_KEEP settled ones. A
 * forgotten key's retry is applied again (async) or refused as stale
 * (sync, ssp: the version moved on). All is allocated and touched at
 * start-up (about 6 MiB), so memory does not grow with pushes; a push of
 * more than FPS_IDEM_INLINE tensors keeps its versions in a small
 * allocation of its own. */
#define FPS_IDEM_WINDOW 65536
#define FPS_IDEM_PER_WORKER 4096
#define FPS_IDEM_KEEP 256
enum { FPS_IDEM_FREE = 0, FPS_IDEM_CLAIMED, FPS_IDEM_APPLIED };
#define FPS_IDEM_INLINE 4            /* versions kept in the entry itself */
typedef struct fps_idem_entry_s {
  uint64_t id;                      /* push_id */
  uint64_t tensors;                 /* hash of the push's tensors, in order */
  uint32_t worker;
  uint32_t next;                    /* hash chain, or free list (slot index) */
  uint32_t wprev, wnext;            /* its worker's keys, oldest first */
  uint32_t wrec;                    /* its worker's record */
  uint16_t state;                   /* FPS_IDEM_* */
  uint16_t n;                       /* APPLIED: tensors of the push */
  union {
    uint64_t in[FPS_IDEM_INLINE];   /* n <= FPS_IDEM_INLINE: the versions made */
    uint64_t *out;                  /* otherwise (owned) */
  } v;
} fps_idem_entry_t;
/* A worker holding keys: its count and its keys in arrival order; in the
 * list of the workers holding as many (newest first). */
typedef struct fps_idem_worker_s {
  uint32_t worker;
  uint32_t count;                   /* keys held, 1..per_worker */
  uint32_t oldest, newest;          /* entry slots */
  uint32_t hnext;                   /* hash chain, or free list (record index) */
  uint32_t cprev, cnext;            /* workers holding `count` keys */
} fps_idem_worker_t;
typedef struct fps_idem_s {
  pthread_mutex_t mu;
  fps_idem_entry_t *ent;            /* cap slots */
  uint32_t cap, per_worker;
  uint32_t free;                    /* free entry slots (chained by next) */
  uint32_t *bucket;                 /* nbucket chain heads over ent */
  uint32_t nbucket;                 /* power of two */
  fps_idem_worker_t *wk;            /* cap + 1 records */
  uint32_t wfree;                   /* free records (chained by hnext) */
  uint32_t *wbucket;                /* nbucket chain heads over wk */
  uint32_t *by_count;               /* per_worker + 1 list heads */
  uint32_t max_count;               /* highest count some worker holds */
} fps_idem_t;
int fps__idem_init(fps_idem_t *ix, uint32_t window, uint32_t per_worker);
void fps__idem_destroy(fps_idem_t *ix);
/* Claims (worker, id) for a push about to commit: 0 (claimed, *slot set),
 * FPS_EEXISTS (already applied), FPS_EAGAIN (claimed by a push in flight),
 * FPS_ELIMIT (no room: every key that could make way is in flight or a
 * worker's newest FPS_IDEM_KEEP). */
int fps__idem_claim(fps_idem_t *ix, uint32_t worker, uint64_t id, uint32_t *slot);
/* Forgets every applied key that made a version above `version` (a split
 * block moved back to it, xrecover.c: a retry of such a push must apply
 * again, not be answered with versions that were undone; keys of other
 * tensors caught by the bound are answered "stale" instead, which workers
 * recover from). */
void fps__idem_forget_after(fps_idem_t *ix, uint64_t version);
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

/* --------------------------------------------- push_settings.c */

/* Each returns 0 or a negative FPS_E* with a message in `why` naming the
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

/* -------------------------------------------------- push_state.c */

/* An ssp push waiting for the slowest worker (embedded in the push,
 * parked by ssp.c). resume: push.c's, run by ssp.c when the worker may go
 * (applies the push and releases the wait). */
typedef struct fps_ssp_wait_s {
  fps_push_t *p;
  uint32_t worker_id;
  uint64_t step;
  int64_t deadline_ns;
  bool parked;                      /* linked (sh->ssp_mu) */
  void (*resume)(struct fps_ssp_wait_s *w);
  struct fps_ssp_wait_s *prev, *next;
} fps_ssp_wait_t;

/* A push (push.c creates, commits and frees it; the files below push.c
 * reach it only through the calls of push_state.c). */
enum { PUSH_RECV, PUSH_WAIT, PUSH_DONE }; /* fps_push_s.state */

struct fps_push_s {
  fps_shard_t *sh;
  pthread_mutex_t mu;         /* state, cancelled, pending */
  int state;                  /* PUSH_* */
  bool cancelled;             /* fps_push_cancel() was called */
  bool have_header;           /* worker_id/step taken from the first message */
  uint32_t worker_id;
  uint64_t step;
  uint32_t num_workers;       /* the worker's W, 0: unchecked */
  int expect_mode;            /* the worker's expected mode, 0: any */
  bool skip_params;
  int64_t deadline_ns;
  fps_push_entry_t **e;       /* entries in first-seen order */
  size_t n, cap;
  fps_push_entry_t **htab;    /* tensor pointer -> entry, open addressing */
  size_t hcap;
  size_t pending;             /* unresolved entries / wait + 1 hold */
  fps_ssp_wait_t wait;
  uint64_t push_id;           /* idempotency key, 0: none */
  bool have_id;               /* push_id taken from the first message */
  bool idem_claimed;          /* holds sh->idem slot idem_slot */
  uint32_t idem_slot;
  bool replayed;              /* answered from the window, nothing applied */
  uint64_t walk;              /* the last set walk that visited it (sh->rounds_mu) */
  int err;                    /* push-level failure (ssp), 0: none */
  char *msg;                  /* its message */
  fps_push_done_fn done;
  void *arg;
  /* Backpressure (fps_push_hold; the flags under sh->held_mu). */
  fps_push_resume_fn resume;
  void *resume_arg;
  atomic_int_fast64_t staged; /* bytes of its slices staged (reduce.c) */
  /* The first entry whose staged gradient held a bad value (reduce.c;
   * its red_err and red_msg are set before and never change), NULL:
   * none. The push cannot be applied: its later slices of any tensor are
   * refused with that entry's error. */
  fps_push_entry_t *_Atomic bad_staged;
  bool held;                  /* the caller waits for resume */
  uint64_t wakes;             /* fps__push_wake() calls so far */
  int64_t held_until;         /* the expiry hook resumes it then */
  fps_push_t *hprev, *hnext;  /* sh->held */
  /* The step timeline (fps_push_times_t; held_* under sh->held_mu). */
  int64_t created_ns, recv_end_ns, held_since_ns, held_ns;
  uint32_t holds;
};

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
  bool skip_step;             /* TensorPush.skip_step: the round applies nothing */
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
  /* Sync: how this gradient gets into its round's sum (reduce.c; all under
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

/* For sync.c, reduce.c, ssp.c and xstep.c. wake: whatever held p back may
 * have changed (resumes it if held). streaming: p still receives (its
 * call alive, not half-closed). REQUIRES nothing; may run under t->mu. */
void fps__push_wake(fps_push_t *p);
bool fps__push_streaming(fps_push_t *p);
/* Counts bytes of p's slices staged (+) or summed/freed (-). */
void fps__push_staged_add(fps_push_t *p, int64_t bytes);
/* Entry e of p (red_err, red_msg set) held a bad value in a staged slice:
 * p's later slices are refused with e's error (the first such entry's). */
void fps__push_staged_failed(fps_push_t *p, fps_push_entry_t *e);
/* The expiry hook's part: resumes held pushes past their hold (every one
 * with force). */
void fps__push_expire_holds(fps_shard_t *sh, int64_t now, bool force);
/* Unlinks a held push. REQUIRES sh->held_mu. */
void fps__push_unhold_locked(fps_shard_t *sh, fps_push_t *p);
/* The push's entries (*out), fixed once it is committed; returns their
 * count, or 0 if set walk `walk` (sh->rounds_walk) already visited them, so
 * a walk costs O(rounds x W + entries). REQUIRES sh->rounds_mu. */
size_t fps__push_entries(fps_push_t *p, uint64_t walk, fps_push_entry_t ***out);
/* Where a push's time went, for the sync step timeline (sync.c, debug
 * log): created (its call's first message), its stream's end (0: still
 * streaming), and how long and how often it was held (fps_push_hold). */
typedef struct fps_push_times_s {
  int64_t created_ns, recv_end_ns, held_ns;
  uint32_t holds;
} fps_push_times_t;
void fps__push_times(fps_push_t *p, fps_push_times_t *out);
/* The push's idempotency key (0: none); fixed once it is committed. */
uint64_t fps__push_key(const fps_push_t *p);
/* Which tensors, in which order (a retry must name the same). */
uint64_t fps__push_tensors_hash(const fps_push_t *p);
/* Resolution. release drops k pending counts and returns true when that
 * resolved the push (then it is settled: its key remembered if every
 * tensor was applied, forgotten otherwise). entry_resolved releases one
 * entry's count and runs done if it was the last; ssp_fail fails the
 * push with err and msg and releases its wait the same way. */
bool fps__push_release(fps_push_t *p, size_t k);
void fps__push_settle(fps_push_t *p);
void fps__push_entry_resolved(fps_push_entry_t *e);
void fps__push_ssp_fail(fps_push_t *p, int err, const char *msg);

/* ------------------------------------------------------- ssp.c */

/* ssp.c, for push.c. admit_or_park: true if the worker may go now,
 * otherwise parks w. advance: records a finished push and resumes parked
 * pushes that may go now. unpark: true if w was parked (and no longer is). */
bool fps__ssp_admit_or_park(fps_shard_t *sh, fps_ssp_wait_t *w);
void fps__ssp_advance(fps_shard_t *sh, uint32_t worker_id, uint64_t step);
bool fps__ssp_unpark(fps_shard_t *sh, fps_ssp_wait_t *w);
void fps__ssp_expire(fps_shard_t *sh, int64_t now, bool force, int err, const char *reason);

/* ---------------------------------------------------- reduce.c */

/* The running sum of a sync round (reduce.c): W workers' gradients for one
 * tensor are summed as their slices arrive, in worker-id order, into one
 * accumulator per round instead of one staging buffer per worker.
 *
 * Element i of the sum is ((g0[i] + g1[i]) + g2[i]) + ... in fp32 whatever
 * order the slices arrive in: worker w's piece [lo, hi) is summed only once
 * workers 0..w-1 have all been summed over [lo, hi) (worker 0 copies, later
 * workers add). done[w] records what worker w has summed; since w may only
 * sum where w-1 has, done[w] is inside done[w-1], and a piece of w is ready
 * exactly when done[w-1] covers it. A piece that arrives earlier is staged
 * (a reference to the received bytes, whose buffer counts once against
 * max_staging_bytes) and checked, converted and summed in one pass when
 * the workers below catch up, cascading upwards. When the round is
 * full every piece has arrived, so done[W-1] covers the tensor: the sum is
 * divided once by W and applied (sync.c).
 *
 * A summed contribution cannot be taken back out bit-exactly, so when a
 * push whose gradient is (partly) in the sum goes away, the sum is
 * discarded and the round aborted (sync.c); a push that only has staged
 * pieces just leaves. Each worker's place in the sum is held by one push
 * (owner[w]); another push of the same worker meanwhile stages privately
 * and takes the place if it frees up (a retry racing its failed first try).
 *
 * Everything here REQUIRES t->mu. */
/* Part of one push's gradient waiting to be summed: a treap node keyed by
 * lo (pieces of one push never overlap), heap-ordered by prio. */
typedef struct fps_piece_s {
  uint64_t lo, hi;
  struct fps_piece_s *left, *right;
  uint32_t prio;
  int dtype;                  /* of src */
  fps_slice_owner_t *owner;   /* keeps src alive (one reference), NULL: data */
  const uint8_t *src;         /* hi - lo elements of dtype as received,
                               * not checked yet */
  float *data;                /* owner NULL: hi - lo floats, converted and
                               * checked (fps_tbuf_alloc) */
} fps_piece_t;

typedef struct fps_reduce_s {
  uint64_t step;              /* the round's step: the tensor's version */
  float *acc;                 /* numel floats (fps_tbuf_alloc) */
  fps_push_entry_t **owner;   /* [W]: whose gradient is summed as worker w's */
  fps_ranges_t *done;         /* [W]: elements summed for worker w */
  fps_push_entry_t *failed;   /* pushes whose staged piece held a bad value,
                               * for the entry point to fail (red_fail_next) */
} fps_reduce_t;

/* How reduce.c fails the round of an entry whose staged gradient held a
 * bad value (sync.c's fps__sync_member_failed_locked, passed down by the
 * callers, so that reduce.c never calls up into sync.c). */
typedef void (*fps__member_failed_fn)(fps_shard_t *sh, fps_push_entry_t *e, fps_push_entry_t **list);

/* Worker e->worker_id's slice s of count elements (already checked against
 * the tensor's shape): summed now if it can be, otherwise staged. Returns
 * 0, FPS_EINVAL (a value that is not a valid gradient), FPS_ELIMIT
 * (max_staging_bytes), FPS_ENOMEM, or e->red_err (its sum was discarded),
 * with why. After a failure the push is never applied. */
/* A piece staged with s->owner set is a reference to the received bytes
 * (checked, converted and summed in one pass when it is ready); without,
 * a converted, checked copy. A bad value in a staged reference is found
 * when it is summed: its push gets red_err FPS_EINVAL (why naming the
 * element), loses its other staged pieces and is woken; if it waits in
 * its round, the round's set fails (`failed`), its
 * members chained onto *resolve for the caller to resolve after
 * unlocking. */
int fps__reduce_slice_locked(fps_shard_t *sh, fps_push_entry_t *e, const fps_slice_t *s, uint64_t count,
                             fps__member_failed_fn failed, char *why, size_t why_len, fps_push_entry_t **resolve);
/* At the join: e takes its worker's place in the sum if it does not hold
 * it yet and the place is free (e->attached tells), and sums what it can.
 * 0, e->red_err, FPS_ELIMIT, FPS_ENOMEM, with why; *resolve as above. */
int fps__reduce_join_locked(fps_shard_t *sh, fps_push_entry_t *e, fps__member_failed_fn failed, char *why,
                            size_t why_len, fps_push_entry_t **resolve);
/* The round is full: the finished sum (numel floats from fps_tbuf_alloc)
 * moves to the caller and t->red is gone. NULL if there is no sum (no
 * member had a gradient) or, defensively, if it does not cover the tensor
 * (then it is discarded). */
float *fps__reduce_take_locked(fps_shard_t *sh, fps_tensor_t *t);
/* e goes away (its call failed, or it is freed). Returns true if part of
 * its gradient is in the sum: the caller must then discard the sum and
 * abort the round. Otherwise its place (if it held it) is freed. */
bool fps__reduce_leave_locked(fps_shard_t *sh, fps_push_entry_t *e);
/* Throws t's sum away (its round failed or was aborted). Every push with
 * part of its gradient in it gets red_err = err and the message (it can no
 * longer be applied); pushes with only staged pieces keep them for a later
 * sum. No-op without a sum. */
void fps__reduce_discard_locked(fps_shard_t *sh, fps_tensor_t *t, int err, const char *msg);
/* Frees e's staged pieces and message (e is being freed; it must have
 * left). */
void fps__reduce_entry_free_locked(fps_shard_t *sh, fps_push_entry_t *e);
/* Backpressure (fps_push_hold): lower_streaming: true if e holds its
 * worker's place and a lower worker that has not sent all of the tensor
 * yet is still streaming it. wake_above: wakes the pushes of the workers
 * above e's (e stopped streaming). */
bool fps__reduce_lower_streaming_locked(fps_shard_t *sh, fps_push_entry_t *e);
void fps__reduce_wake_above_locked(fps_shard_t *sh, fps_push_entry_t *e);
/* Frees t's sum at shutdown (no push in progress). */
void fps__reduce_free(fps_shard_t *sh, fps_tensor_t *t);
/* why for gradient element `index` of tensor `name` holding v, which is
 * not a valid gradient (NaN, Inf or too large). */
void fps__reduce_bad_value_why(char *why, size_t why_len, const char *name, uint64_t index, float v);

/* ----------------------------------------------------- xmail.c */

/* A kept Exchange (t->split->mail): early partials (done false), or one
 * the step of `version` used (done: wire only, for identical retries). */
typedef struct fps_xkept_s {
  uint64_t version;
  uint64_t attempt;
  uint32_t block;
  int phase;
  bool done;
  uint8_t *wire;
  size_t len;
  fps_split_partials_t dec;   /* !done */
  struct fps_xkept_s *next;
} fps_xkept_t;

#define FPS_XMAIL_FAILED_MAX 4 /* failed attempts remembered per block */

/* What a block keeps of the Exchange between its steps (t->split->mail,
 * t->mu). Every function below REQUIRES t->mu of sp's block. */
typedef struct fps_xmail_s {
  fps_xkept_t *head;
  /* Attempts of the step at failed_version that failed here, oldest
   * first. */
  uint64_t failed_version;
  uint64_t failed[FPS_XMAIL_FAILED_MAX];
  unsigned nfailed;
  /* The last step applied here (version before it, attempt): a peer whose
   * COMMIT's acknowledgement was lost retries it and is answered OK. */
  bool applied;
  uint64_t applied_version, applied_attempt;
  /* That step's own partials per phase (STATS, U2; NULL: none), for a
   * peer that lacks them (fps_xreply_t) and for the standby's image. */
  uint8_t *own[2];
  size_t own_len[2];
  /* The block's state came in a standby's image (replica.c) and has not
   * stepped since: the step above (if any) kept no peer partials, so a
   * retry of its attempt is matched by attempt alone, and the block sends
   * no versions on its own (xrecover.c). */
  bool imaged;
} fps_xmail_t;

/* Frees sp->mail and everything kept (teardown). */
void fps__xmail_free(fps_tensor_split_t *sp);
/* Drops every kept partial and failed attempt: the block's version moved
 * to an agreed one (xrecover.c), so none of it belongs to its history.
 * No step may be in flight. */
void fps__xmail_reset(fps_tensor_split_t *sp);
/* Records the step from `version` (attempt) as the last applied, taking
 * its own partials own[0..1] (NULL: none; the pointers are cleared). */
void fps__xmail_applied(fps_xmail_t *ml, uint64_t version, uint64_t attempt, uint8_t *own[2],
                        const size_t own_len[2], bool imaged);
/* Drops kept partials the block no longer needs at version v: early ones
 * before v, and those of steps before v - 1. */
void fps__xmail_prune(fps_tensor_split_t *sp, uint64_t v);
/* The kept partials of (version v, block b, phase, attempt a) that are
 * (done) or are not (early) a step's, NULL: none. */
fps_xkept_t *fps__xmail_find(fps_tensor_split_t *sp, uint64_t v, uint32_t b, int phase, uint64_t a, bool done);
/* How many early attempts of (v, b, phase) are kept. Kept partials are
 * never evicted for newer ones: anyone who can call Exchange could then
 * push a peer's real partials out with made-up attempts. A further
 * attempt waits (UNAVAILABLE, which the sender's transport retries) until
 * this shard's own step of it starts and takes it directly, or the version
 * moves on and frees the room. Each block's shard has at most one step in
 * flight, so a peer needs more attempts kept only after repeated failures. */
unsigned fps__xmail_count(const fps_tensor_split_t *sp, uint64_t v, uint32_t b, int phase);
/* True if attempt a of the step at version v failed here. */
bool fps__xmail_failed(const fps_tensor_split_t *sp, uint64_t v, uint64_t a);
/* Remembers (failed) or forgets attempt a of the step at version v. The
 * list holds one version's attempts: another version clears it. REQUIRES
 * sp->mail. */
void fps__xmail_mark(fps_tensor_split_t *sp, uint64_t v, uint64_t a, bool failed);

/* ------------------------------------------------- xrecover.c */

/* Recovery of split tensors to one version (xrecover.c): anchors (a
 * block's state on disk every --split-anchor-steps versions, the same
 * versions on every shard) and the agreement on the newest version every
 * block can be restored to. */
typedef struct fps_xanchor_s fps_xanchor_t; /* an anchor to write */

/* After a block's step applied (t->mu held): forgets the peers' versions
 * (the blocks agree again) and, at an anchor version, copies the block
 * (its parameters by reference) onto *list for fps__xrec_anchor_flush. */
void fps__xrec_applied_locked(fps_shard_t *sh, fps_tensor_t *t, fps_xanchor_t **list);
/* Writes the anchors of list (no core lock held) and frees them. */
void fps__xrec_anchor_flush(fps_shard_t *sh, fps_xanchor_t *list);
/* Sends t's versions to the other blocks' shards unless it did within
 * the exchange deadline (no core lock held): a peer's block was met at
 * another version, or a step failed. */
void fps__xrec_announce(fps_shard_t *sh, fps_tensor_t *t);
/* A peer's VERSIONS (checked by fps_shard_exchange_receive; no lock held). */
int fps__xrec_receive(fps_shard_t *sh, fps_tensor_t *t, const fps_xmsg_t *m, char *why, size_t why_len);
/* The stamp of an Exchange message this shard makes now: wall-clock ns,
 * strictly increasing (xrecover.c "STAMPS"). */
uint64_t fps__xrec_stamp(fps_shard_t *sh);
/* A step message (not VERSIONS) of t from block `block` with `stamp`
 * arrived: that block's lists made before it are out of date. REQUIRES
 * t->mu. */
void fps__xrec_peer_stepped(fps_tensor_t *t, uint32_t block, uint64_t stamp);
/* The expiry hook's part: blocks whose agreed version waited for a round
 * to end move to it now; blocks still apart announce again. */
void fps__xrec_tick(fps_shard_t *sh);
/* At restore (no lock held): t's anchors found on disk. (A new block's
 * first anchor empties its directory: another life's anchors are not
 * this one's.) */
void fps__xrec_restored(fps_shard_t *sh, fps_tensor_t *t);
/* Updates t's block undid by moving to agreed versions (Stats). REQUIRES t->mu. */
uint64_t fps__xrec_lost_steps(const fps_tensor_t *t);
/* A replace started a new history: the peers' lists, the refusal of
 * fps__xrec_refuse and the anchors of the old one no longer apply (the
 * next anchor empties the directory). REQUIRES t->mu. */
void fps__xrec_new_history(fps_shard_t *sh, fps_tensor_t *t);
/* Frees t->split->rec (teardown). */
void fps__xrec_forget(fps_tensor_t *t);
/* The hint appended to "ahead of shard" / "stale push" for a block that
 * rolled to an agreed version. */
void fps__xrec_hint(const fps_tensor_t *t, char *buf, size_t len);
/* True, with the blocks' versions in `why`, while t's blocks are known to
 * stand apart with no version held by all of them: a step of t could
 * never complete (the peers' partials are of another version), so it is
 * refused at once rather than at the exchange deadline. REQUIRES t->mu. */
bool fps__xrec_refuse(const fps_tensor_t *t, char *why, size_t len);

/* ----------------------------------------------------- xstep.c */

typedef struct fps_xgroup_s fps_xgroup_t;

/* How a finished exchange settles its set (sync.c's fps__set_settle,
 * passed to fps__xstep_start, so that xstep.c never calls up into
 * sync.c). */
typedef void (*fps__set_settle_fn)(fps_shard_t *sh, fps_tensor_t *set, size_t k, int err, char *why,
                                   size_t why_len);

/* xstep.c, for sync.c. True if the set holds a block tensor with a
 * gradient to step (its update needs the other blocks' partials). */
bool fps__xstep_needed(const fps_tensor_t *set);

/* Begins the exchange of a set of k rounds (locks held as for
 * fps__set_settle, sums divided by W): pass A of every block with a
 * gradient, this shard's partials encoded, early partials taken from the
 * mail, the deadline set (the exchange deadline, cut by the members'
 * call deadlines less their margins). On
 * success the set waits (*out: send its partials with fps__xstep_kick()
 * once the locks are released; `settle` applies or fails the set once the
 * exchange is over); on failure (FPS_E* and why) nothing
 * changed and the caller fails the set. */
int fps__xstep_start(fps_shard_t *sh, fps_tensor_t *set, size_t k, fps__set_settle_fn settle, fps_xgroup_t **out,
                     char *why, size_t why_len);

/* Sends the partials of the started exchange g (no core lock held). The
 * set is settled later by whichever thread completes or fails it. */
void fps__xstep_kick(fps_xgroup_t *g);

/* The expiry hook's part: fails exchanges past their deadline (every one
 * with force, with `reason`) with FPS_EUNAVAILABLE. No lock held. */
void fps__xstep_expire(fps_shard_t *sh, int64_t now, bool force, const char *reason);

/* Frees what the exchange keeps of block t (a step, early partials) at
 * the shard's teardown: no step may be in flight. No-op for a whole
 * tensor. */
void fps__xstep_forget(fps_tensor_t *t);

/* ------------------------------------------------------ sync.c */

/* sync.c. Settles a set of k rounds (a list through round.cnext in
 * address order) whose tensors' locks the caller holds, every round
 * prepared and its sum taken: err 0 applies every round (a block's update
 * is the combined step its prep.split holds), otherwise every member of
 * every round fails with err and why (the set's tensors appended to why,
 * of why_len bytes), nothing is applied and what the rounds had prepared
 * or summed is freed (rounds not prepared yet may hold nothing). Releases the tensors' locks
 * (and the apply gate that fps__set_complete took for a set of whole
 * tensors), then resolves the members. */
void fps__set_settle(fps_shard_t *sh, fps_tensor_t *set, size_t k, int err, char *why, size_t why_len);
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

/* ---------------------------------------------------- replica.c */

/* push.c and sync.c, inside the apply gate's read side: records an
 * applied push's key (the versions its entries now hold) for the
 * standby's next batch (no-op unless fps_shard_repl_keys is on). */
void fps__repl_key_applied(fps_shard_t *sh, const fps_push_t *p);

/* ------------------------------------------------------ push.c */

/* Everything push.c defines for the others is in push_state.c and shard.h. */

/* ----------------------------------------------------- shard.c */

struct fps_shard_s {
  fps_shard_opts_t cfg;
  fps_idem_t idem;                  /* push idempotency (idem.c) */
  const fps_kernels_t *kernels;
  fps_pool_t *pool;                 /* splits large tensors' updates; NULL: none */
  atomic_uint_fast64_t tbuf_bytes;  /* bytes in fps_tbuf_alloc buffers,
                                     * the tensors' spares included */
  atomic_uint_fast64_t spare_bytes; /* of which spares (in flight: the rest) */
  atomic_uint_fast64_t tbuf_peak;   /* tbuf_bytes' high-water mark */
  atomic_int_fast64_t staged_bytes; /* sync slices staged ahead of lower
                                     * workers (reduce.c), all pushes */
  atomic_int_fast64_t staged_peak;  /* staged_bytes' high-water mark */
  pthread_mutex_t spare_mu;         /* a leaf lock: spares, t->spare */
  fps_tensor_t *spares, *spares_last; /* tensors holding a spare, least
                                     * recently kept first (given up in
                                     * that order) */
  fps_store_t store;
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
  /* The job served (job.c). A leaf lock. */
  pthread_mutex_t job_mu;
  char job_id[72];                  /* "" = none yet; at most FPS_CKPT_JOB_MAX bytes */
  char job_from[4160];              /* where it came from, for errors */
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
  /* The exchange of split tensors' partial sums (fps_tensor_split_t), set by
   * fps_shard_set_exchange() before serving; xsend NULL: no --peers, so
   * no split blocks. */
  fps_xsend_fn xsend;
  void *xsend_ctx;
  double xdeadline;                 /* seconds a step's exchange may take */
  /* The sets exchanging (xstep.c), for the expiry hook; xs_mu comes after
   * every tensor lock. */
  pthread_mutex_t xs_mu;
  struct fps_xgroup_s *xgroups;
  atomic_bool xstopping;            /* shutting down: no new exchange begins */
  atomic_int xaborts_in_flight;     /* ABORTs sent by the drain, not yet done */
  atomic_int xrec_pending;          /* split blocks waiting to roll to an
                                     * agreed version (xrecover.c) */
  atomic_int xrec_apart;            /* split blocks announcing their versions
                                     * until they agree (xrecover.c) */
  _Atomic uint64_t xstamp_last;     /* the last Exchange stamp (fps__xrec_stamp) */
  /* async/ssp apply a push's tensors one after the other (push.c) under
   * the read side, and sync applies a whole set and records its members'
   * keys under it (sync.c); a standby's batch of images (replica.c) is
   * taken under the write side, so it never holds half of a push, nor a
   * push without its key. Taken before any tensor lock; writers first, so
   * pushes cannot starve the images. */
  pthread_rwlock_t apply_gate;
  /* While a standby is fed (fps_shard_repl_keys), the keys of pushes as
   * they are applied, inside the gate, so that a batch carries the keys of
   * exactly the pushes its images hold (replica.c). A leaf lock. */
  pthread_mutex_t rkeys_mu;
  bool rkeys_on;
  struct fps_key_rec_s *rkeys, *rkeys_last;
};

/* shard.c: fps_shard_new() and fps_shard_free() on storage of the
 * caller's (the unit tests keep a shard on the stack). init returns 0 or
 * FPS_ENOMEM; destroy REQUIRES no push in progress. */
int fps_shard_init(fps_shard_t *sh, const fps_shard_opts_t *opts, const fps_kernels_t *kernels, fps_pool_t *pool);
void fps_shard_destroy(fps_shard_t *sh);

#endif

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
#ifndef FPS_SHARD_REDUCE_H
#define FPS_SHARD_REDUCE_H

#include "shard.h"

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
 * its round, the round's set fails (fps__sync_member_failed_locked), its
 * members chained onto *resolve for the caller to resolve after
 * unlocking. */
int fps__reduce_slice_locked(fps_shard_t *sh, fps_push_entry_t *e, const fps_slice_t *s, uint64_t count,
                             char *why, size_t why_len, fps_push_entry_t **resolve);
/* At the join: e takes its worker's place in the sum if it does not hold
 * it yet and the place is free (e->attached tells), and sums what it can.
 * 0, e->red_err, FPS_ELIMIT, FPS_ENOMEM, with why; *resolve as above. */
int fps__reduce_join_locked(fps_shard_t *sh, fps_push_entry_t *e, char *why, size_t why_len,
                            fps_push_entry_t **resolve);
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

#endif

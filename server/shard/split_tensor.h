/* A row block of a split tensor held by this shard, and the contract
 * between the shard core and whatever carries partial sums to the other
 * shards (proto SplitBlock and Exchange). gRPC-free (shard core).
 *
 * A block is an ordinary fps_tensor_t with t->split set:
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
 * (common/adafactor_split.h).
 *
 * The exchange. The core never talks to the network: the layer above
 * installs a sender (fps_shard_set_exchange) and hands every Exchange it
 * receives to fps_shard_exchange_receive(). A block's step applies only
 * when this shard holds every block's partials of every due phase AND every
 * peer has acknowledged ours; anything else (a send that failed after its
 * retries, a refusal, the deadline) fails the step with FPS_EUNAVAILABLE
 * and nothing is applied here (README "Split tensors"). */
#ifndef FPS_SHARD_SPLIT_TENSOR_H
#define FPS_SHARD_SPLIT_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "adafactor_split.h"

typedef struct fps_shard_s fps_shard_t;
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
} fps_tensor_split_t;

/* One Exchange message (ExchangeRequest's fields). partials is the wire
 * form of common/adafactor_split.h; valid only during the call it is
 * passed to. */
typedef struct fps_xmsg_s {
  const char *name;
  uint64_t version;            /* the block's version before the step */
  uint32_t from_shard, shard_count, block_index;
  int phase;                   /* FPS_SPLIT_PHASE_* */
  uint64_t attempt;            /* the step's attempt (xstep.c): a hash of
                                * its members' (worker_id, push_id); 0: the
                                * members carry no push_id */
  const void *partials;
  size_t len;
} fps_xmsg_t;

/* How one send ended: err 0 (the peer acknowledged), or FPS_E* with a
 * message naming the peer and the cause (FPS_EUNAVAILABLE: not reachable
 * within the deadline; otherwise the peer's refusal translated). Called
 * exactly once per accepted send, on any thread, with no core lock held. */
typedef void (*fps_xsend_done_fn)(void *arg, int err, const char *msg);

/* The sender: copies what it needs of *m (m is only valid during the
 * call), sends it to shard `to_shard`, retrying transient failures until
 * deadline_ns (fps_now_ns clock), and reports through done. Returns 0
 * (done will be called) or FPS_E* (refused at once, e.g. no address for
 * that shard; done is not called). The core calls it with no core lock
 * held. */
typedef int (*fps_xsend_fn)(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns,
                            fps_xsend_done_fn done, void *arg);

/* Installs the sender and the time a step's exchange may take (seconds,
 * > 0; a member push's own deadline may cut it shorter). Before serving;
 * without a sender, Create refuses split blocks (FPS_ESTATE: "this shard
 * has no --peers"). */
void fps_shard_set_exchange(fps_shard_t *sh, fps_xsend_fn send, void *ctx, double deadline_seconds);

/* An Exchange from a peer, validated in the proto's order against this
 * shard's block of m->name: FPS_ENOTFOUND (no block of it here),
 * FPS_ESTATE (held whole; the block/shard pair is not in this map; an old
 * version; geometry or old column state that differ: diverged),
 * FPS_ESTATE also for partials of an attempt whose step failed here,
 * FPS_EEXISTS (different partials for a (version, block, phase, attempt)
 * already received; an identical retry is 0), FPS_EINVAL, FPS_ENOMEM; `why` names
 * the tensor, the sender and the problem. Kept partials may complete this
 * shard's step on the calling thread (its pushes resolved before return).
 * Thread-safe. */
int fps_shard_exchange_receive(fps_shard_t *sh, const fps_xmsg_t *m, char *why, size_t why_len);

#endif

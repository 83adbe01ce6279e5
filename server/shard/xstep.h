/* The cross-shard step of split tensors inside the shard core: what
 * sync.c and xstep.c call of each other (the public contract is
 * split_tensor.h). gRPC-free. */
#ifndef FPS_SHARD_XSTEP_H
#define FPS_SHARD_XSTEP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shard.h"

typedef struct fps_xgroup_s fps_xgroup_t;

/* sync.c. Settles a set of k rounds (a list through round.cnext in
 * address order) whose tensors' locks the caller holds, every round
 * prepared and its sum taken: err 0 applies every round (a block's update
 * is the combined step its prep.split holds), otherwise every member of
 * every round fails with err and why (the set's tensors appended to why,
 * of why_len bytes), nothing is applied and what the rounds had prepared
 * or summed is freed (rounds not prepared yet may hold nothing). Releases the tensors' locks,
 * then resolves the members. */
void fps__set_settle(fps_shard_t *sh, fps_tensor_t *set, size_t k, int err, char *why, size_t why_len);

/* store.c: the hyperparameters of one update (Create's, with the push's
 * lr and weight decay). */
fps_adafactor_hparams_t fps__update_hparams(const fps_tensor_t *t, const fps_update_hp_t *uh);

/* xstep.c, for sync.c. True if the set holds a block tensor with a
 * gradient to step (its update needs the other blocks' partials). */
bool fps__xstep_needed(const fps_tensor_t *set);

/* Begins the exchange of a set of k rounds (locks held as for
 * fps__set_settle, sums divided by W): pass A of every block with a
 * gradient, this shard's partials encoded, early partials taken from the
 * mail, the deadline set (the exchange deadline, cut by the members'
 * call deadlines less their margins). On
 * success the set waits (*out: send its partials with fps__xstep_kick()
 * once the locks are released); on failure (FPS_E* and why) nothing
 * changed and the caller fails the set. */
int fps__xstep_start(fps_shard_t *sh, fps_tensor_t *set, size_t k, fps_xgroup_t **out, char *why,
                     size_t why_len);

/* Sends the partials of the started exchange g (no core lock held). The
 * set is settled later by whichever thread completes or fails it. */
void fps__xstep_kick(fps_xgroup_t *g);

/* The expiry hook's part: fails exchanges past their deadline (every one
 * with force, with `reason`) with FPS_EUNAVAILABLE. No lock held. */
void fps__xstep_expire(fps_shard_t *sh, int64_t now, bool force, const char *reason);

/* Frees a block's t->split (its map, state and kept partials). No step
 * may be in flight. NULL-safe. */
void fps__split_destroy(fps_tensor_split_t *s);

#endif

/* The core's side of a received Exchange until the cross-shard step
 * exists (issue 12; h12step's xstep.c replaces this file): answered with
 * what this shard can say about the tensor. Nothing is kept: the shard's
 * state is unchanged. */
#include <stdio.h>

#include "shard.h"

int fps_shard_exchange_receive(fps_shard_t *sh, const fps_xmsg_t *m, char *why, size_t why_len) {
  if (!m || !m->name) return fps_errorf(FPS_EINVAL, why, why_len, "Exchange without a tensor name");
  /* Tensors are never removed and t->split is fixed at Create. */
  fps_tensor_t *t = fps_store_find(&sh->store, m->name);
  if (!t)
    return fps_errorf(FPS_ENOTFOUND, why, why_len,
                      "Exchange of tensor '%s' from shard %u: this shard holds no row block of it", m->name,
                      m->from_shard);
  if (!t->split)
    return fps_errorf(FPS_ESTATE, why, why_len,
                      "Exchange of tensor '%s' from shard %u: this shard holds the tensor whole, not as a row "
                      "block of a split tensor",
                      m->name, m->from_shard);
  return fps_errorf(FPS_EUNSUPPORTED, why, why_len,
                    "Exchange of tensor '%s' from shard %u: this shard cannot run cross-shard steps yet",
                    m->name, m->from_shard);
}

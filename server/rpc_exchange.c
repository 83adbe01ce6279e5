/* Exchange: a peer shard's partial sums of one step of a split
 * tensor. The request's own checks come first, in the proto's order (the
 * most basic problem of a request is the one reported); then the core
 * checks it against this shard's block and keeps the partials
 * (fps_shard_exchange_receive), whose FPS_E* answer is translated by
 * status.c. Authentication happened before the handler runs, as for every
 * method. A refused request leaves the shard's state unchanged. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "adafactor_split.h"
#include "alloc.h"
#include "auth.h"
#include "wire.h"

typedef struct fps_exchange_call_s {
  fps_call_t base;
} fps_exchange_call_t;

static void fps__exchange_destroy(fps_call_t *c) { fps_free(c); }

/* 0, or the FPS_E* code for the request with its message in `why`. */
static int fps__exchange_check(fps_server_t *srv, const Factorps__V1__ExchangeRequest *req, char *why,
                               size_t why_len) {
  const char *name = req->name ? req->name : "";
  char sub[512];
  if (fps_shard_name_check(name, sub, sizeof sub) < 0) {
    snprintf(why, why_len, "Exchange: %s", sub);
    return FPS_EINVAL;
  }
  if (req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_STATS &&
      req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_U2 &&
      req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_COMMIT &&
      req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_VERSIONS &&
      req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_ABORT) {
    snprintf(why, why_len,
             "Exchange of tensor '%s': phase %d (expected STATS = 1, U2 = 2, COMMIT = 3, VERSIONS = 4 or ABORT = "
             "5)",
             name, (int)req->phase);
    return FPS_EINVAL;
  }
  if (req->shard_count != srv->cfg.shard_count) {
    snprintf(why, why_len,
             "Exchange of tensor '%s' from shard %u, which is one of %u shards; this shard is "
             "one of %u (--shard-count)",
             name, req->from_shard, req->shard_count, srv->cfg.shard_count);
    return FPS_ESTATE;
  }
  if (req->from_shard >= srv->cfg.shard_count || req->from_shard == srv->cfg.shard_id) {
    snprintf(why, why_len,
             "Exchange of tensor '%s': from_shard %u is not another shard of the %u (this is "
             "shard %u)",
             name, req->from_shard, srv->cfg.shard_count, srv->cfg.shard_id);
    return FPS_EINVAL;
  }
  int rc = fps_shard_exchange_payload_check((int)req->phase, req->partials.data, req->partials.len, sub,
                                            sizeof sub);
  if (rc < 0) {
    snprintf(why, why_len, "Exchange of tensor '%s' from shard %u: %s", name, req->from_shard,
             sub);
    return FPS_EINVAL;
  }
  return 0;
}

void fps_rpc_exchange_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__ExchangeRequest *req = fps_call_start_unary(
      srv, call, deadline, md, payload, sizeof(fps_exchange_call_t), fps__exchange_destroy, NULL,
      "Exchange", &factorps__v1__exchange_request__descriptor, &c, &held);
  if (!req) return;
  char why[FPS_WHY_MAX];
  /* A peer's token speaks for one shard (--exchange-token-file): it may
   * not send another shard's partial sums. */
  fps_ident_t id;
  fps_auth_call_ident(c, &id);
  int rc = 0;
  fps_xreply_t reply = {0};
  if (id.peer_shard >= 0 && (int64_t)req->from_shard != id.peer_shard) {
    rc = FPS_EPERM;
    snprintf(why, sizeof why, "Exchange: from_shard %u, but this call's peer token is shard %" PRId64 "'s",
             req->from_shard, id.peer_shard);
  }
  if (rc == 0) rc = fps__exchange_check(srv, req, why, sizeof why);
  if (rc == 0) {
    fps_xmsg_t m = {.name = req->name, .version = req->version, .from_shard = req->from_shard,
                    .shard_count = req->shard_count, .block_index = req->block_index,
                    .phase = (int)req->phase, .attempt = req->attempt, .partials = req->partials.data, .len = req->partials.len,
                    .stamp = req->stamp, .want = req->want};
    /* May complete this shard's step of the tensor, on this thread. */
    rc = fps_shard_exchange_receive(srv->shard, &m, &reply, why, sizeof why);
  }
  fps_wire_request_free(&srv->decode, &req->base, held);
  if (rc < 0) {
    fps_call_error(c, rc, "%s", why);
    return;
  }
  Factorps__V1__ExchangeResponse resp = FACTORPS__V1__EXCHANGE_RESPONSE__INIT;
  resp.applied = reply.applied;
  resp.committed = reply.committed;
  resp.partials.data = reply.partials;
  resp.partials.len = reply.len;
  grpc_byte_buffer *bb = fps_pack_message(&resp);
  fps_xreply_free(&reply);
  if (!bb) fps_call_error(c, FPS_ENOMEM, "Exchange: out of memory packing the reply");
  else fps_call_send(c, bb, true); /* final: on failure the call is already released */
}

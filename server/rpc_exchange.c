/* Exchange (issue 12, in progress): a peer shard's partial sums of one step
 * of a split tensor. Shards hold no row blocks yet, so no request can be
 * accepted; what is here is the contract's validation, in its order (the
 * most basic problem of a request is the one reported), ending in
 * NOT_FOUND (no block of that tensor here) or FAILED_PRECONDITION (the
 * tensor is held whole). Authentication happened before the handler runs,
 * as for every method. Nothing is kept: the shard's state is unchanged. */
#include <stdio.h>
#include <string.h>

#include "adafactor_split.h"
#include "alloc.h"
#include "wire.h"

typedef struct fps_exchange_call_s {
  fps_call_t base;
} fps_exchange_call_t;

static void fps__exchange_destroy(fps_call_t *c) { fps_free(c); }

/* 0, or the status for the request with its message in `why`. */
static grpc_status_code fps__exchange_check(fps_server_t *srv,
                                            const Factorps__V1__ExchangeRequest *req, char *why,
                                            size_t why_len) {
  const char *name = req->name ? req->name : "";
  char sub[512];
  if (fps_shard_name_check(name, sub, sizeof sub) < 0) {
    snprintf(why, why_len, "Exchange: %s", sub);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_STATS &&
      req->phase != FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_U2) {
    snprintf(why, why_len, "Exchange of tensor '%s': phase %d (expected STATS = 1 or U2 = 2)",
             name, (int)req->phase);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (req->shard_count != srv->cfg.shard_count) {
    snprintf(why, why_len,
             "Exchange of tensor '%s' from shard %u, which is one of %u shards; this shard is "
             "one of %u (--shard-count)",
             name, req->from_shard, req->shard_count, srv->cfg.shard_count);
    return GRPC_STATUS_FAILED_PRECONDITION;
  }
  if (req->from_shard >= srv->cfg.shard_count || req->from_shard == srv->cfg.shard_id) {
    snprintf(why, why_len,
             "Exchange of tensor '%s': from_shard %u is not another shard of the %u (this is "
             "shard %u)",
             name, req->from_shard, srv->cfg.shard_count, srv->cfg.shard_id);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  int rc = fps_split_partials_check(req->partials.data, req->partials.len, (int)req->phase, NULL,
                                    sub, sizeof sub);
  if (rc < 0) {
    snprintf(why, why_len, "Exchange of tensor '%s' from shard %u: %s", name, req->from_shard,
             sub);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (fps_store_find(&srv->shard.store, name)) {
    snprintf(why, why_len,
             "Exchange of tensor '%s' from shard %u: this shard holds the tensor whole, not as "
             "a row block of a split tensor",
             name, req->from_shard);
    return GRPC_STATUS_FAILED_PRECONDITION;
  }
  snprintf(why, why_len,
           "Exchange of tensor '%s' from shard %u: this shard holds no row block of it (shards "
           "do not serve split tensors yet)",
           name, req->from_shard);
  return GRPC_STATUS_NOT_FOUND;
}

void fps_rpc_exchange_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                            grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  Factorps__V1__ExchangeRequest *req = fps_call_start_unary(
      srv, call, deadline, md, payload, sizeof(fps_exchange_call_t), fps__exchange_destroy, NULL,
      "Exchange", &factorps__v1__exchange_request__descriptor, &c);
  if (!req) return;
  char why[1024];
  grpc_status_code code = fps__exchange_check(srv, req, why, sizeof why);
  /* Every path ends in a refusal until shards hold row blocks. */
  fps_call_fail(c, code, "%s", why);
  protobuf_c_message_free_unpacked(&req->base, &fps_wire_allocator);
}

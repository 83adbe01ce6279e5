/* Replicate, the standby's side (replica.h; proto ReplicateRequest): a
 * primary's stream of its state and its changes.
 *
 * One message at a time: receive, check, apply, answer with the highest
 * seq applied, receive the next. The first message must be the hello: a
 * stream for another shard, shard count, mode, worker count or kernel
 * variant, of an older term than this process has seen, or of a term
 * its lease never granted, is refused with FAILED_PRECONDITION and
 * changes nothing. Tensor images come in
 * pieces (at most 32 MiB each) whose data is copied once, from the slices
 * gRPC received it in into the buffers the core adopts (fps__rp_split),
 * assembled here and installed once complete (fps_shard_install: all of
 * a tensor or nothing), and keys
 * go into the idempotency window: during the transfer at once (a standby
 * that has not joined is never promoted), after it at the batch's commit,
 * all together, so that what one push changed is here entirely or not at
 * all. transfer_done makes this standby joined.
 * Any malformed message fails the stream (INVALID_ARGUMENT) with nothing
 * of it applied after the transfer (its batch waits for a commit); in the
 * transfer, the tensors of the message before the bad one stay installed:
 * a standby counts as joined, and may be promoted, only once a stream's
 * transfer is done. The stream has no deadline: it lives as long as the
 * primary keeps it open. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "auth.h"
#include "replica.h"
#include "wire.h"

enum { RP_RECV, RP_SEND, RP_DONE };

/* A split block's map and last step as an image brings them (owned). */
typedef struct fps_rp_block_s {
  fps_split_map_t map;        /* points into bounds, shards */
  uint64_t replaces;
  uint64_t *bounds;
  uint32_t *shards;
  bool applied;
  uint64_t version, attempt;
  uint8_t *own[2];
  size_t own_len[2];
} fps_rp_block_t;

static void fps__rp_block_free(fps_rp_block_t *b) {
  if (!b) return;
  fps_free(b->bounds);
  fps_free(b->shards);
  fps_free(b->own[0]);
  fps_free(b->own[1]);
  fps_free(b);
}

/* The map a piece names, as a view into the message. */
static void fps__rp_map_view(const Factorps__V1__SplitBlock *sb, fps_split_map_t *m) {
  *m = (fps_split_map_t){.block_index = sb->block_index, .bounds = sb->bounds, .n_bounds = sb->n_bounds,
                         .block_shards = sb->block_shards, .n_block_shards = sb->n_block_shards,
                         .shard_count = sb->shard_count};
}

/* rt's block (map, and its last step from the first piece) copied; *out
 * NULL for a whole tensor. 0, FPS_EINVAL or FPS_ENOMEM with why. */
static int fps__rp_block_take(const Factorps__V1__ReplicaTensor *rt, const char *name, fps_rp_block_t **out,
                              char *why, size_t wl) {
  *out = NULL;
  if (!rt->split) {
    if (rt->split_step) {
      snprintf(why, wl, "tensor '%s': split_step without split", name);
      return FPS_EINVAL;
    }
    return 0;
  }
  const Factorps__V1__SplitBlock *sb = rt->split;
  const Factorps__V1__ReplicaSplitStep *ss = rt->split_step;
  if (ss && ss->n_partials > 2) {
    snprintf(why, wl, "tensor '%s': split_step carries %zu partials (at most STATS and U2)", name, ss->n_partials);
    return FPS_EINVAL;
  }
  for (size_t i = 0; ss && i < ss->n_partials; i++) {
    char sub[512];
    if (fps_shard_exchange_payload_check((int)i + 1, ss->partials[i].data, ss->partials[i].len, sub, sizeof sub) <
        0) {
      snprintf(why, wl, "tensor '%s': split_step partials %zu: %s", name, i, sub);
      return FPS_EINVAL;
    }
  }
  fps_rp_block_t *b = fps_calloc(1, sizeof *b);
  if (!b || !(b->bounds = fps_malloc((sb->n_bounds ? sb->n_bounds : 1) * sizeof *b->bounds)) ||
      !(b->shards = fps_malloc((sb->n_block_shards ? sb->n_block_shards : 1) * sizeof *b->shards)))
    goto oom;
  if (sb->n_bounds) memcpy(b->bounds, sb->bounds, sb->n_bounds * sizeof *b->bounds);
  if (sb->n_block_shards) memcpy(b->shards, sb->block_shards, sb->n_block_shards * sizeof *b->shards);
  fps__rp_map_view(sb, &b->map);
  b->replaces = rt->split_replaces;
  b->map.bounds = b->bounds;
  b->map.block_shards = b->shards;
  if (ss) {
    b->applied = true;
    b->version = ss->version;
    b->attempt = ss->attempt;
    for (size_t i = 0; i < ss->n_partials; i++) {
      if (!ss->partials[i].len) continue;
      if (!(b->own[i] = fps_malloc(ss->partials[i].len))) goto oom;
      memcpy(b->own[i], ss->partials[i].data, ss->partials[i].len);
      b->own_len[i] = ss->partials[i].len;
    }
  }
  *out = b;
  return 0;
oom:
  fps__rp_block_free(b);
  snprintf(why, wl, "tensor '%s': out of memory", name);
  return FPS_ENOMEM;
}

/* The image's block fields from b (NULL: whole). */
static void fps__rp_block_in(const fps_rp_block_t *b, fps_image_in_t *in) {
  if (!b) return;
  in->split = &b->map;
  in->split_replaces = b->replaces;
  in->xapplied = b->applied;
  in->xversion = b->version;
  in->xattempt = b->attempt;
  for (int i = 0; i < 2; i++) {
    in->xown[i] = b->own[i];
    in->xown_len[i] = b->own_len[i];
  }
}

/* A complete image received after the transfer, waiting for its commit. */
typedef struct fps_rp_pending_s {
  fps_image_in_t in;          /* in.params_own: its parameter buffer */
  char *name;
  uint64_t *dims;
  uint64_t numel;
  uint8_t *sbuf;              /* its state */
  fps_rp_block_t *block;      /* a split block's (in.split points into it) */
  struct fps_rp_pending_s *next;
} fps_rp_pending_t;

typedef struct fps_rp_key_s {
  uint32_t worker;
  uint64_t id, tensors;
  uint32_t n;
  uint64_t *v;
  struct fps_rp_key_s *next;
} fps_rp_key_t;

typedef struct fps_rp_call_s {
  fps_call_t base;
  bool transferred;           /* transfer_done seen: images wait for commits */
  fps_rp_pending_t *pending, *pending_last;
  fps_rp_key_t *keys, *keys_last;
  int phase;                  /* RP_* (base.mu) */
  bool hello;                 /* the hello was accepted */
  uint64_t term;
  uint64_t stream;            /* its id in the role machine */
  uint64_t seq;               /* last seq applied */
  /* The tensor being assembled: its parameters straight into a buffer
   * the core adopts at install (no copy there), its state beside. */
  char *name;
  uint64_t version, total, got, numel;
  float *pbuf;                /* numel floats (fps_shard_param_buf) */
  uint8_t *sbuf;              /* total - 4 numel bytes */
  fps_rp_block_t *block;      /* a split block's map and last step, NULL: whole */
  fps_wspan_t *spans;         /* the message being read, as gRPC received it */
  size_t spans_cap;
} fps_rp_call_t;

/* A message as this handler reads it: everything but the tensors' data
 * unpacked by protobuf-c from a small copy of those fields' bytes, each
 * tensor's data left where gRPC received it (a window over its slices):
 * the data is copied once, into the buffers the core adopts, instead of
 * three times (flattened, unpacked, then copied in). */
typedef struct fps_rp_msg_s {
  Factorps__V1__ReplicateRequest *m; /* m->tensors: t below while in use */
  size_t nt;
  Factorps__V1__ReplicaTensor **t;   /* each unpacked on its own */
  fps_wreader_t *data;               /* t[i]'s data (last occurrence) */
  uint8_t *rest;                     /* the fields unpacked */
  fps_decode_budget_t *budget;       /* held: what the decoded parts hold of it */
  uint64_t held;
} fps_rp_msg_t;

static void fps__rp_msg_free(fps_rp_msg_t *x) {
  if (x->m) {
    x->m->tensors = NULL;
    x->m->n_tensors = 0;
    protobuf_c_message_free_unpacked(&x->m->base, &fps_wire_allocator);
  }
  for (size_t i = 0; x->t && i < x->nt; i++)
    if (x->t[i]) protobuf_c_message_free_unpacked(&x->t[i]->base, &fps_wire_allocator);
  fps_free(x->t);
  fps_free(x->data);
  fps_free(x->rest);
  if (x->held) fps_decode_release(x->budget, x->held);
  memset(x, 0, sizeof *x);
}

/* Walks the fields of window r: each field's raw bytes (key and value)
 * are appended to out (NULL: only counted in *n) unless it is field
 * `skip` of wire type LEN, whose windows are handed to each_skip. False
 * if malformed. */
typedef bool (*fps_rp_skip_fn)(void *arg, fps_wreader_t *sub);
static bool fps__rp_walk(fps_wreader_t r, uint32_t skip, fps_rp_skip_fn each_skip, void *arg, uint8_t *out,
                         size_t *n) {
  while (fps_wr_left(&r) > 0) {
    fps_wreader_t start = r;
    uint32_t field;
    int wt;
    if (!fps_wr_key(&r, &field, &wt)) return false;
    if (field == skip && wt == FPS_WT_LEN) {
      fps_wreader_t sub;
      uint64_t len;
      if (!fps_wr_sub(&r, &sub, &len) || !each_skip(arg, &sub)) return false;
      continue;
    }
    if (!fps_wr_skip_value(&r, wt)) return false;
    uint64_t bytes = fps_wr_left(&start) - fps_wr_left(&r);
    if (out && !fps_wr_read(&start, out + *n, bytes)) return false;
    *n += (size_t)bytes;
  }
  return true;
}

/* Tensor pieces one message may carry: the primary puts at most 64 in
 * one (replica_send.c); the bound keeps the per-piece arrays small. */
#define FPS_RP_TENSORS_MAX 4096

/* The two passes over a message's tensors: count and size, then copy. */
typedef struct fps_rp_split_s {
  fps_rp_msg_t *x;
  bool fill;
  size_t i;                   /* tensors so far */
  size_t rest;                /* their bytes so far (after the message's own) */
  size_t *off, *len;          /* fill: where each tensor's fields are in x->rest */
} fps_rp_split_t;

static bool fps__rp_data_each(void *arg, fps_wreader_t *sub) {
  *(fps_wreader_t *)arg = *sub; /* the last occurrence wins, as protobuf-c reads it */
  return true;
}

static bool fps__rp_tensor_each(void *arg, fps_wreader_t *sub) {
  fps_rp_split_t *sp = arg;
  size_t n = 0;
  fps_wreader_t dummy;
  fps_wreader_t *data = sp->fill ? &sp->x->data[sp->i] : &dummy;
  fps_wr_init(data, NULL, 0);
  if (sp->fill) sp->off[sp->i] = sp->rest;
  if (!fps__rp_walk(*sub, 12, fps__rp_data_each, data, sp->fill ? sp->x->rest + sp->rest : NULL, &n)) return false;
  if (sp->fill) sp->len[sp->i] = n;
  sp->rest += n;
  sp->i++;
  return true;
}

/* Splits the message in spans into x (fps__rp_msg_free it, also on
 * failure), each part within fps_wire_unpack's bound with max_bytes. 0,
 * FPS_EPROTO, FPS_EINVAL (a bad name), FPS_ELIMIT (fps_wire_unpack) or
 * FPS_ENOMEM with why. */
static int fps__rp_split(const fps_wspan_t *spans, size_t nspan, uint64_t max_bytes, fps_decode_budget_t *budget,
                         fps_rp_msg_t *x, char *why, size_t wl) {
  memset(x, 0, sizeof *x);
  fps_wreader_t r;
  fps_wr_init(&r, spans, nspan);
  uint64_t total = fps_wr_left(&r);
  fps_rp_split_t sp = {.x = x};
  size_t own = 0;
  if (!fps__rp_walk(r, 3, fps__rp_tensor_each, &sp, NULL, &own)) {
    snprintf(why, wl, "malformed ReplicateRequest (%" PRIu64 " bytes)", total);
    return FPS_EPROTO;
  }
  x->nt = sp.i;
  if (x->nt > FPS_RP_TENSORS_MAX) {
    snprintf(why, wl, "%zu tensor pieces in one message (at most %d)", x->nt, FPS_RP_TENSORS_MAX);
    return FPS_EINVAL;
  }
  size_t *ol = fps_malloc((2 * x->nt + 1) * sizeof *ol);
  x->rest = fps_malloc(own + sp.rest + 1);
  x->t = fps_calloc(x->nt + 1, sizeof *x->t);
  x->data = fps_calloc(x->nt + 1, sizeof *x->data);
  if (!ol || !x->rest || !x->t || !x->data) {
    fps_free(ol);
    snprintf(why, wl, "out of memory for a %" PRIu64 "-byte message", total);
    return FPS_ENOMEM;
  }
  sp = (fps_rp_split_t){.x = x, .fill = true, .rest = own, .off = ol, .len = ol + x->nt};
  size_t n = 0;
  (void)fps__rp_walk(r, 3, fps__rp_tensor_each, &sp, x->rest, &n); /* the same walk again */
  /* The parts are decoded one by one; together they stay within the
   * bound of the whole message (fps_wire_unpack's, wire.h). */
  uint64_t bound = fps_wire_decode_bound((size_t)total);
  uint64_t limit = max_bytes && max_bytes < bound ? max_bytes : bound;
  uint64_t cost = fps_wire_cost(&factorps__v1__replicate_request__descriptor, x->rest, own, limit);
  for (size_t i = 0; i < x->nt && cost <= limit; i++)
    cost += fps_wire_cost(&factorps__v1__replica_tensor__descriptor, x->rest + ol[i], ol[x->nt + i], limit - cost);
  if (cost > limit) {
    fps_free(ol);
    snprintf(why, wl, "decoding this %" PRIu64 "-byte ReplicateRequest would take more than the %" PRIu64
             " bytes of memory allowed", total, limit);
    return FPS_ELIMIT;
  }
  /* And within what all requests being decoded may hold at once. */
  uint64_t others = 0;
  if (fps_decode_reserve(budget, cost, &others) < 0) {
    fps_free(ol);
    snprintf(why, wl, "decoding this %" PRIu64 "-byte ReplicateRequest (%" PRIu64 " bytes) would pass the memory "
             "all requests being decoded may hold (%" PRIu64 " held)", total, cost, others);
    return FPS_ELIMIT;
  }
  x->budget = budget;
  x->held = cost;
  ProtobufCMessage *pm = NULL;
  int rc = fps_wire_unpack(&factorps__v1__replicate_request__descriptor, x->rest, own, max_bytes, &pm, why, wl);
  if (rc == 0) x->m = (Factorps__V1__ReplicateRequest *)pm;
  for (size_t i = 0; i < x->nt && rc == 0; i++) {
    pm = NULL;
    rc = fps_wire_unpack(&factorps__v1__replica_tensor__descriptor, x->rest + ol[i], ol[x->nt + i], max_bytes, &pm,
                         why, wl);
    x->t[i] = (Factorps__V1__ReplicaTensor *)pm;
  }
  fps_free(ol);
  if (rc < 0) return rc;
  x->m->tensors = x->t;
  x->m->n_tensors = x->nt;
  return 0;
}

static void fps__rp_drop_piece(fps_rp_call_t *rp) {
  fps_free(rp->name);
  fps_shard_param_buf_free(rp->base.srv->shard, rp->pbuf, rp->numel);
  fps_free(rp->sbuf);
  fps__rp_block_free(rp->block);
  rp->block = NULL;
  rp->name = NULL;
  rp->pbuf = NULL;
  rp->sbuf = NULL;
  rp->total = rp->got = rp->numel = 0;
}

static void fps__rp_drop_pending(fps_rp_call_t *rp) {
  while (rp->pending) {
    fps_rp_pending_t *p = rp->pending;
    rp->pending = p->next;
    fps_free(p->name);
    fps_free(p->dims);
    fps_shard_param_buf_free(rp->base.srv->shard, p->in.params_own, p->numel);
    fps_free(p->sbuf);
    fps__rp_block_free(p->block);
    fps_free(p);
  }
  rp->pending_last = NULL;
  while (rp->keys) {
    fps_rp_key_t *k = rp->keys;
    rp->keys = k->next;
    fps_free(k->v);
    fps_free(k);
  }
  rp->keys_last = NULL;
}

/* Whether this stream still speaks for the primary this process is the
 * standby of: 0, or FPS_ESTATE (a newer term was seen, this process was
 * promoted, or a newer hello of the same term, a primary reconnecting,
 * took over: this stream must end so that only one feeds the standby). */
static int fps__rp_current(fps_rp_call_t *rp, char *why, size_t wl) {
  fps_role_view_t v;
  fps_role_get(fps_replica_role(rp->base.srv->replica), &v);
  if (v.role == FPS_REPLICA_STANDBY && v.term == rp->term && v.stream == rp->stream) return 0;
  if (v.term != rp->term || v.role != FPS_REPLICA_STANDBY)
    snprintf(why, wl, "term %" PRIu64 " is older than %" PRIu64, rp->term, v.term);
  else
    snprintf(why, wl, "a newer stream of term %" PRIu64 " replaced this one", rp->term);
  return FPS_ESTATE;
}

/* The batch since the last commit takes effect: its images, then its
 * keys, with the replica's commit lock held so that a promotion cannot
 * come in between (replica.c). */
static int fps__rp_commit(fps_rp_call_t *rp, char *why, size_t wl) {
  fps_server_t *srv = rp->base.srv;
  int rc = 0;
  fps_replica_commit_lock(srv->replica);
  /* Still this stream's standby (a promotion or a newer primary may have
   * come since the message was checked)? */
  rc = fps__rp_current(rp, why, wl);
  for (fps_rp_pending_t *p = rp->pending; p && rc == 0; p = p->next)
    if ((rc = fps_shard_install(srv->shard, &p->in, why, wl)) == 0) p->in.params_own = NULL; /* adopted */
  for (fps_rp_key_t *k = rp->keys; k && rc == 0; k = k->next)
    (void)fps_shard_idem_put(srv->shard, k->worker, k->id, k->tensors, k->v, k->n);
  fps_replica_commit_unlock(srv->replica);
  fps__rp_drop_pending(rp);
  return rc;
}

static void fps__rp_destroy(fps_call_t *c) {
  fps_rp_call_t *rp = (fps_rp_call_t *)c;
  fps__rp_drop_pending(rp);
  if (rp->hello) {
    fps_role_stream_ended(fps_replica_role(c->srv->replica), rp->stream);
    fps_replica_publish(c->srv->replica);
  }
  fps__rp_drop_piece(rp);
  fps_free(rp->spans);
  fps_free(rp);
}

static void fps__rp_fail(fps_rp_call_t *rp, int err, const char *why) {
  pthread_mutex_lock(&rp->base.mu);
  bool first = rp->phase != RP_DONE;
  rp->phase = RP_DONE;
  pthread_mutex_unlock(&rp->base.mu);
  if (first) fps_call_error(&rp->base, err, "Replicate: %s", why);
}

/* The hello against this shard. */
static int fps__rp_hello(fps_rp_call_t *rp, const Factorps__V1__ReplicateHello *h, char *why,
                                      size_t wl) {
  fps_server_t *srv = rp->base.srv;
  fps_shard_view_t v;
  const char *simd = "";
  bool have = fps_shard_view(srv->shard, false, 0, &v) == 0;
  if (have) simd = v.simd;
  int code = 0;
  if (h->shard_id != srv->cfg.shard_id || h->shard_count != srv->cfg.shard_count)
    snprintf(why, wl, "the primary is shard %u of %u; this is shard %u of %u", h->shard_id, h->shard_count,
             srv->cfg.shard_id, srv->cfg.shard_count), code = FPS_ESTATE;
  else if ((int)h->mode != srv->cfg.mode || h->workers != srv->cfg.workers)
    snprintf(why, wl, "the primary runs --mode %s --workers %u; this shard --mode %s --workers %u",
             fps_mode_name((int)h->mode), h->workers, fps_mode_name(srv->cfg.mode), srv->cfg.workers),
        code = FPS_ESTATE;
  else if (strcmp(h->simd ? h->simd : "", simd) != 0)
    snprintf(why, wl, "the primary's kernels are %s, this shard's %s (start both with the same --simd)",
             h->simd ? h->simd : "", simd), code = FPS_ESTATE;
  if (have) fps_shard_view_free(&v);
  if (code != 0) return code;
  fps_replica_t *r = srv->replica;
  /* A term the lease never granted would outrank every real primary's. */
  if ((code = fps_replica_term_granted(r, h->term, why, wl)) < 0) return code;
  if (fps_role_hello(fps_replica_role(r), h->term, h->primary, &rp->stream, why, wl) < 0) return FPS_ESTATE;
  rp->hello = true;
  rp->term = h->term;
  fps_replica_kick(r);
  fps_replica_publish(r);
  FPS_LOG(FPS_LOG_INFO, "replica: shard %u is the standby of %s (term %" PRIu64 "); taking its state",
          srv->cfg.shard_id, h->primary && *h->primary ? h->primary : "its primary", h->term);
  return 0;
}

/* One piece of a tensor image; installs the tensor when it is complete. */
static int fps__rp_tensor(fps_rp_call_t *rp, const Factorps__V1__ReplicaTensor *rt, fps_wreader_t data,
                          char *why, size_t wl) {
  uint64_t dlen = fps_wr_left(&data);
  fps_server_t *srv = rp->base.srv;
  const char *name = rt->name ? rt->name : "";
  char sub[FPS_WHY_MAX];
  if (fps_shard_name_check(name, sub, sizeof sub) < 0) {
    snprintf(why, wl, "%s", sub);
    return FPS_EINVAL;
  }
  fps_shape_t shape;
  uint64_t numel;
  if (fps_shard_shape_check(name, rt->shape, rt->n_shape, &shape, &numel, sub, sizeof sub) < 0) {
    snprintf(why, wl, "%s", sub);
    return FPS_EINVAL;
  }
  if (rt->split) { /* a row block: the bytes are the block's */
    fps_split_map_t map;
    fps__rp_map_view(rt->split, &map);
    int rc = fps_shard_block_numel(name, &shape, &map, srv->cfg.shard_id, srv->cfg.shard_count, &numel, sub,
                                   sizeof sub);
    if (rc < 0) {
      snprintf(why, wl, "%s", sub);
      return rc;
    }
  }
  if (rt->n_state_elements != FPS_STATE_KINDS) {
    snprintf(why, wl, "tensor '%s': %zu state sizes (expected %d)", name, rt->n_state_elements, FPS_STATE_KINDS);
    return FPS_EINVAL;
  }
  uint64_t state = 0;
  for (int k = 0; k < FPS_STATE_KINDS; k++) {
    if (rt->state_elements[k] > numel * 2 + (UINT64_C(1) << 32)) {
      snprintf(why, wl, "tensor '%s': state size %" PRIu64 " is impossible", name, rt->state_elements[k]);
      return FPS_EINVAL;
    }
    state += rt->state_elements[k];
  }
  uint64_t total = (numel + state) * 4;
  if (rt->total_bytes != total || rt->offset > total || dlen > total - rt->offset) {
    snprintf(why, wl, "tensor '%s': piece [%" PRIu64 ", +%" PRIu64 ") of %" PRIu64 " bytes does not fit its %" PRIu64
             " bytes of parameters and state", name, rt->offset, dlen, rt->total_bytes, total);
    return FPS_EINVAL;
  }
  if (rt->offset == 0) {
    fps__rp_drop_piece(rp);
    if (total > srv->cfg.max_bytes) {
      snprintf(why, wl, "tensor '%s': %" PRIu64 " bytes is past --max-bytes", name, total);
      return FPS_ELIMIT;
    }
    bool over = false;
    rp->name = fps_strdup(name);
    rp->pbuf = fps_shard_param_buf(srv->shard, name, numel, &over);
    rp->numel = rp->pbuf ? numel : 0;
    rp->sbuf = fps_malloc(state ? state * 4 : 1);
    if (!rp->name || !rp->pbuf || !rp->sbuf) {
      fps__rp_drop_piece(rp);
      snprintf(why, wl, "tensor '%s': %s for %" PRIu64 " bytes", name,
               over ? "past --max-staging-bytes" : "out of memory", total);
      return over ? FPS_ELIMIT : FPS_ENOMEM;
    }
    rp->total = total;
    rp->version = rt->version;
    int rc = fps__rp_block_take(rt, name, &rp->block, why, wl);
    if (rc < 0) {
      fps__rp_drop_piece(rp);
      return rc;
    }
  } else if (!rp->name || strcmp(rp->name, name) != 0 || !rp->block != !rt->split || rp->version != rt->version || rp->total != total ||
             rp->got != rt->offset) {
    snprintf(why, wl, "tensor '%s': piece at %" PRIu64 " out of order", name, rt->offset);
    return FPS_EINVAL;
  }
  /* The parameters' bytes, then the state's (a piece may span both),
   * straight from the received slices. */
  uint64_t pbytes = numel * 4, off = rt->offset;
  uint64_t left = dlen;
  if (left && off < pbytes) {
    uint64_t n = pbytes - off < left ? pbytes - off : left;
    (void)fps_wr_read(&data, (uint8_t *)rp->pbuf + off, n); /* dlen bytes are there */
    off += n;
    left -= n;
  }
  if (left) (void)fps_wr_read(&data, rp->sbuf + (off - pbytes), left);
  rp->got += dlen;
  if (rp->got < rp->total) return 0;
  fps_image_in_t in = {.name = name, .dims = rt->shape, .ndim = rt->n_shape, .version = rt->version,
                       .step = rt->step, .rms = rt->rms, .last_lr = rt->last_lr,
                       .last_weight_decay = rt->last_weight_decay,
                       .params_own = rp->pbuf, .state = (const float *)rp->sbuf};
  for (int k = 0; k < FPS_STATE_KINDS; k++) in.n[k] = rt->state_elements[k];
  fps__rp_block_in(rp->block, &in);
  if (fps_wire_hparams(name, rt->config, &in.hp, sub, sizeof sub) < 0) {
    fps__rp_drop_piece(rp);
    snprintf(why, wl, "%s", sub);
    return FPS_EINVAL;
  }
  if (rp->transferred) {
    /* After the transfer: kept until the batch's commit. */
    fps_rp_pending_t *p = fps_calloc(1, sizeof *p);
    if (!p || !(p->dims = fps_malloc((rt->n_shape ? rt->n_shape : 1) * sizeof *p->dims))) {
      fps_free(p);
      fps__rp_drop_piece(rp);
      snprintf(why, wl, "tensor '%s': out of memory", name);
      return FPS_ENOMEM;
    }
    if (rt->n_shape) memcpy(p->dims, rt->shape, rt->n_shape * sizeof *p->dims);
    p->in = in;
    p->in.dims = p->dims;
    p->name = rp->name;
    p->numel = rp->numel;
    p->sbuf = rp->sbuf;
    p->block = rp->block;
    p->in.name = p->name;
    rp->block = NULL;
    rp->name = NULL;
    rp->pbuf = NULL; /* p->in.params_own now */
    rp->sbuf = NULL;
    fps__rp_drop_piece(rp);
    if (rp->pending_last) rp->pending_last->next = p;
    else rp->pending = p;
    rp->pending_last = p;
    return 0;
  }
  int rc = fps_shard_install(srv->shard, &in, sub, sizeof sub);
  if (rc == 0) rp->pbuf = NULL; /* adopted by the tensor */
  fps__rp_drop_piece(rp);
  if (rc < 0) {
    snprintf(why, wl, "%s", sub);
    return rc;
  }
  return 0;
}

static int fps__rp_message(fps_rp_call_t *rp, const fps_rp_msg_t *x, char *why, size_t wl) {
  const Factorps__V1__ReplicateRequest *m = x->m;
  if (!rp->hello) {
    if (!m->hello) {
      snprintf(why, wl, "the first message must carry the hello");
      return FPS_EINVAL;
    }
    int code = fps__rp_hello(rp, m->hello, why, wl);
    if (code != 0) return code;
  } else if (m->hello) {
    snprintf(why, wl, "a second hello");
    return FPS_EINVAL;
  }
  if (m->seq != rp->seq + 1) {
    snprintf(why, wl, "seq %" PRIu64 " after %" PRIu64, m->seq, rp->seq);
    return FPS_EINVAL;
  }
  /* A newer primary's hello (another stream) ends this one's right. */
  int cur = fps__rp_current(rp, why, wl);
  if (cur < 0) return cur;
  /* The message's own checks first, so that a refused message installs
   * none of its tensors. */
  if (m->commit && !rp->transferred) {
    snprintf(why, wl, "a commit before transfer_done");
    return FPS_EINVAL;
  }
  if (m->transfer_done && rp->transferred) {
    snprintf(why, wl, "a second transfer_done");
    return FPS_EINVAL;
  }
  for (size_t i = 0; i < m->n_keys; i++)
    if (m->keys[i]->push_id == 0 || m->keys[i]->n_versions > UINT16_MAX) {
      snprintf(why, wl, "a key with push_id 0 or %zu versions", m->keys[i]->n_versions);
      return FPS_EINVAL;
    }
  for (size_t i = 0; i < m->n_tensors; i++) {
    int code = fps__rp_tensor(rp, m->tensors[i], x->data[i], why, wl);
    if (code != 0) return code;
  }
  for (size_t i = 0; i < m->n_keys; i++) {
    const Factorps__V1__ReplicaKey *k = m->keys[i];
    /* A full window forgets; the retry is then refused as stale or
     * applied again, as after any forgotten key (shard.h). */
    if (!rp->transferred) {
      (void)fps_shard_idem_put(rp->base.srv->shard, k->worker, k->push_id, k->tensors, k->versions,
                               (uint32_t)k->n_versions);
      continue;
    }
    fps_rp_key_t *q = fps_calloc(1, sizeof *q);
    if (!q || (k->n_versions && !(q->v = fps_malloc(k->n_versions * sizeof *q->v)))) {
      fps_free(q);
      snprintf(why, wl, "out of memory for a key");
      return FPS_ENOMEM;
    }
    q->worker = k->worker;
    q->id = k->push_id;
    q->tensors = k->tensors;
    q->n = (uint32_t)k->n_versions;
    if (q->n) memcpy(q->v, k->versions, q->n * sizeof *q->v);
    if (rp->keys_last) rp->keys_last->next = q;
    else rp->keys = q;
    rp->keys_last = q;
  }
  if (m->commit) {
    int rc = fps__rp_commit(rp, why, wl);
    if (rc < 0) return rc;
  }
  if (m->transfer_done) {
    rp->transferred = true;
    fps_role_standby_joined(fps_replica_role(rp->base.srv->replica), rp->stream);
    fps_replica_publish(rp->base.srv->replica);
    FPS_LOG(FPS_LOG_INFO, "replica: joined the primary's stream (term %" PRIu64 ")", rp->term);
  }
  rp->seq = m->seq;
  return 0;
}

static void fps__rp_on_batch(fps_call_t *c, bool ok) {
  fps_rp_call_t *rp = (fps_rp_call_t *)c;
  pthread_mutex_lock(&c->mu);
  int phase = rp->phase;
  pthread_mutex_unlock(&c->mu);
  if (!ok) {
    fps__rp_fail(rp, FPS_ECANCELLED, "the stream ended");
    return;
  }
  if (phase == RP_SEND) {
    pthread_mutex_lock(&c->mu);
    rp->phase = RP_RECV;
    pthread_mutex_unlock(&c->mu);
    if (fps_call_recv(c) < 0) fps__rp_fail(rp, FPS_EINTERNAL, "cannot receive");
    return;
  }
  if (phase != RP_RECV) return;
  if (!c->recv_buf) {
    fps__rp_fail(rp, FPS_ECANCELLED, "the primary closed the stream");
    return;
  }
  grpc_byte_buffer *bb = c->recv_buf;
  c->recv_buf = NULL;
  uint8_t *flat = NULL;
  size_t len = 0, nspan = 0;
  char why[FPS_WHY_MAX] = "";
  int rc = 0;
  size_t total = grpc_byte_buffer_length(bb);
  if (bb->data.raw.compression != GRPC_COMPRESS_NONE) {
    /* A compressed message is inflated (bounded) into one buffer. */
    if ((rc = fps_bb_flatten(bb, c->srv->cfg.max_message_bytes, &flat, &len)) == 0) {
      if (!rp->spans && !(rp->spans = fps_malloc(sizeof *rp->spans))) rc = FPS_ENOMEM;
      else if (rp->spans_cap == 0) rp->spans_cap = 1;
      if (rc == 0) {
        rp->spans[0] = (fps_wspan_t){flat, len};
        nspan = 1;
      }
    }
  } else if (total > c->srv->cfg.max_message_bytes) {
    rc = FPS_ELIMIT;
  } else if ((nspan = fps_wire_bb_spans(bb, &rp->spans, &rp->spans_cap)) == SIZE_MAX) {
    rc = FPS_ENOMEM;
  }
  if (rc < 0) {
    snprintf(why, sizeof why, "cannot take a message: %s", fps_bb_flatten_why(rc));
    fps_free(flat);
    grpc_byte_buffer_destroy(bb);
    fps__rp_fail(rp, rc, why);
    return;
  }
  fps_rp_msg_t x;
  rc = fps__rp_split(rp->spans, nspan, c->srv->cfg.max_bytes, &c->srv->decode, &x, why, sizeof why);
  int code = rc < 0 ? rc : fps__rp_message(rp, &x, why, sizeof why);
  fps__rp_msg_free(&x);
  fps_free(flat);
  grpc_byte_buffer_destroy(bb); /* after the data was read from its slices */
  if (code != 0) {
    fps__rp_fail(rp, code, why);
    return;
  }
  fps_role_view_t v;
  fps_role_get(fps_replica_role(c->srv->replica), &v);
  Factorps__V1__ReplicateResponse resp = FACTORPS__V1__REPLICATE_RESPONSE__INIT;
  resp.acked = rp->seq;
  resp.term = v.term;
  grpc_byte_buffer *out = fps_pack_message(&resp);
  pthread_mutex_lock(&c->mu);
  rp->phase = RP_SEND;
  pthread_mutex_unlock(&c->mu);
  if (!out || fps_call_send(c, out, false) < 0) fps__rp_fail(rp, FPS_EINTERNAL, "cannot answer");
}

void fps_rpc_replicate_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, grpc_metadata_array *md) {
  fps_rp_call_t *rp = fps_calloc(1, sizeof *rp);
  if (!rp) {
    grpc_call_cancel_with_status(call, fps_status_from_err(FPS_ENOMEM), "out of memory", NULL);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(md);
    return;
  }
  rp->base.destroy = fps__rp_destroy;
  rp->base.on_batch = fps__rp_on_batch;
  rp->phase = RP_RECV;
  if (fps_call_begin(&rp->base, srv, call, deadline, md, "Replicate") < 0) return;
  /* The stream lives as long as the primary keeps it: not cut by
   * --deadline (calls_mu: the expiry hook reads it there). */
  pthread_mutex_lock(&srv->calls_mu);
  rp->base.deadline_ns = INT64_MAX;
  pthread_mutex_unlock(&srv->calls_mu);
  /* A peer token speaks for one shard: only this shard's own id may feed
   * it (--exchange-token-file). */
  fps_ident_t id;
  fps_auth_call_ident(&rp->base, &id);
  if (id.peer_shard >= 0 && (uint64_t)id.peer_shard != srv->cfg.shard_id) {
    char why[256];
    snprintf(why, sizeof why, "this call's peer token is shard %" PRId64 "'s; this is shard %u", id.peer_shard,
             srv->cfg.shard_id);
    fps__rp_fail(rp, FPS_EPERM, why);
    return;
  }
  fps_role_view_t rv;
  if (srv->replica) fps_role_get(fps_replica_role(srv->replica), &rv);
  if (!srv->replica || rv.role == FPS_REPLICA_SOLO) {
    fps__rp_fail(rp, FPS_ESTATE,
                 "this shard runs solo (no --replica-peer): it takes no Replicate stream");
    return;
  }
  if (fps_call_recv(&rp->base) < 0) fps__rp_fail(rp, FPS_EINTERNAL, "cannot receive");
}

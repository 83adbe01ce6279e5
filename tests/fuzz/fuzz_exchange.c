/* libFuzzer target: Exchange requests through the shard's real
 * handler (server/rpc_exchange.c: decode, the request's own checks, then
 * fps_shard_exchange_receive in xstep.c: the block, the map, versions,
 * early mail, duplicates, the partials' decode and combine, the apply) on
 * shard 0 of 2 in sync mode that holds block 0 of three split tensors:
 *   "sw" [4, 3]    hf, rows [0, 2) of {0, 2, 4}       (factored)
 *   "sv" [6]       torch, elements [0, 3) of {0, 3, 6} (1-D)
 *   "sm" [2, 3, 4] hf, rows [0, 4) of {0, 4, 6}       (spans both matrices)
 * Any client with the token can call Exchange, so no request may crash the
 * shard, leak, leave a call unanswered or a step stuck.
 *
 * The shard's sender is this file's: it records each send; the input says
 * whether sends are acknowledged at once or left pending; at the end every
 * pending send fails (UNAVAILABLE) and the exchange deadline passes
 * (fps_shard_expire), so a step that did not get its peer's partials fails
 * and the push call ends. Oracles besides the harness's: the push ends,
 * and no block holds a NaN or Inf weight.
 *
 * Input: one flags byte, then ExchangeRequest messages (u16 LE length,
 * then the bytes), each sent as one Exchange call:
 *   bits 0-1: 0 no step in flight, 1..3 a push of sw / sv / sm (worker 0,
 *             step 0) before the first Exchange
 *   bit 2:    a push of all three tensors instead
 *   bit 3:    acknowledge this shard's sends at once (else at the end they
 *             fail)
 *   bit 4:    tiny gradients (1e-6: torch's U2 phase is due)
 * Seeds (FPS_FUZZ_WRITE_SEEDS: fuzz_exchange_seeds DIR): the messages shard
 * 1 really sends in the same steps (two real shard cores wired together),
 * and mutations of them a hostile peer would try. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "factorps/v1/factorps.pb-c.h"
#include "fuzz_server.h"

#define NT 3
#define MAXSENDS 64

typedef struct fx_tensor_s {
  const char *name;
  size_t ndim;
  uint64_t shape[3];
  uint64_t bounds[3];
  uint64_t cols;          /* elements per row */
  bool torch;
} fx_tensor_t;

static const fx_tensor_t fx[NT] = {
    {"sw", 2, {4, 3}, {0, 2, 4}, 3, false},
    {"sv", 1, {6}, {0, 3, 6}, 1, true},
    {"sm", 3, {2, 3, 4}, {0, 4, 6}, 4, false},
};

/* A send of a shard core, not yet acknowledged. */
typedef struct fx_send_s {
  uint32_t from, to;
  uint8_t *req;           /* the ExchangeRequest it would carry */
  size_t len;
  fps_xsend_done_fn done;
  void *arg;
} fx_send_t;

static fx_send_t sends[MAXSENDS];
static size_t nsends;
static bool ack_at_once;
static uint32_t shard_ids[2] = {0, 1};

static int fx_send(void *ctx, uint32_t to, const fps_xmsg_t *m, int64_t deadline_ns, fps_xsend_done_fn done,
                   void *arg) {
  (void)deadline_ns;
  uint32_t from = *(const uint32_t *)ctx;
  if (to >= 2 || to == from) abort(); /* the core sends only to the map's other shard */
  if (ack_at_once) {
    done(arg, 0, "", NULL);
    return 0;
  }
  if (nsends == MAXSENDS) return FPS_EUNAVAILABLE;
  Factorps__V1__ExchangeRequest r = FACTORPS__V1__EXCHANGE_REQUEST__INIT;
  r.name = (char *)m->name;
  r.version = m->version;
  r.from_shard = m->from_shard;
  r.shard_count = m->shard_count;
  r.block_index = m->block_index;
  r.phase = (Factorps__V1__ExchangePhase)m->phase;
  r.partials.data = (uint8_t *)m->partials;
  r.partials.len = m->len;
  fx_send_t *s = &sends[nsends++];
  s->from = from;
  s->to = to;
  s->req = fz_pack(&r, &s->len);
  s->done = done;
  s->arg = arg;
  return 0;
}

/* Ends every pending send with err (0: acknowledged). */
static void fx_resolve_all(int err) {
  while (nsends) {
    fx_send_t s = sends[--nsends];
    free(s.req);
    s.done(s.arg, err, err ? "peer shard 1 did not answer within the deadline" : "", NULL);
  }
  fz_drain();
}

static void fx_grad(const fx_tensor_t *t, uint32_t block, bool tiny, float *g, size_t n) {
  float scale = tiny ? 1e-6f : 1.0f;
  uint64_t off = t->bounds[block] * t->cols;
  for (size_t i = 0; i < n; i++) g[i] = (0.02f * (float)((off + i) % 7) - 0.07f) * scale;
}

/* Creates this shard's blocks through the real Create path. */
static void fx_create_blocks(fps_server_t *srv, uint32_t block) {
  Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT, torch = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  torch.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  torch.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  torch.lr = 0.01;
  static uint32_t block_shards[2] = {0, 1};
  Factorps__V1__TensorSlice s[NT];
  Factorps__V1__SplitBlock sb[NT];
  Factorps__V1__TensorCreate tc[NT];
  Factorps__V1__TensorCreate *tcp[NT];
  float vals[NT][16];
  for (int i = 0; i < NT; i++) {
    const fx_tensor_t *t = &fx[i];
    size_t n = (size_t)((t->bounds[block + 1] - t->bounds[block]) * t->cols);
    for (size_t j = 0; j < n; j++) vals[i][j] = 0.01f * (float)((t->bounds[block] * t->cols + j) % 11) - 0.05f;
    factorps__v1__tensor_slice__init(&s[i]);
    s[i].name = (char *)t->name;
    s[i].dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
    s[i].data.data = (uint8_t *)vals[i];
    s[i].data.len = n * sizeof(float);
    factorps__v1__split_block__init(&sb[i]);
    sb[i].block_index = block;
    sb[i].n_bounds = 3;
    sb[i].bounds = (uint64_t *)t->bounds;
    sb[i].n_block_shards = 2;
    sb[i].block_shards = block_shards;
    sb[i].shard_count = 2;
    factorps__v1__tensor_create__init(&tc[i]);
    tc[i].name = (char *)t->name;
    tc[i].n_shape = t->ndim;
    tc[i].shape = (uint64_t *)t->shape;
    tc[i].optimizer = t->torch ? &torch : &hf;
    tc[i].init = &s[i];
    tc[i].split = &sb[i];
    tcp[i] = &tc[i];
  }
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.n_tensors = NT;
  req.tensors = tcp;
  req.shard_id = block;
  req.shard_count = 2;
  fz_unary_ok(srv, FZ_CREATE, &req, "fuzz_exchange: the Create of the blocks");
}

/* Starts worker 0's push of step 0 to the tensors `mask` picks (bit i:
 * fx[i]); NULL if none. The call waits for the exchange. */
static fz_call_t *fx_push(fps_server_t *srv, uint32_t block, unsigned mask, bool tiny) {
  if (!mask) return NULL;
  Factorps__V1__TensorSlice s[NT];
  Factorps__V1__TensorSlice *sp[NT];
  float g[NT][16];
  size_t k = 0;
  for (int i = 0; i < NT; i++) {
    if (!(mask >> i & 1)) continue;
    const fx_tensor_t *t = &fx[i];
    size_t n = (size_t)((t->bounds[block + 1] - t->bounds[block]) * t->cols);
    fx_grad(t, block, tiny, g[k], n);
    factorps__v1__tensor_slice__init(&s[k]);
    s[k].name = (char *)t->name;
    s[k].dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
    s[k].n_shape = t->ndim;
    s[k].shape = (uint64_t *)t->shape;
    s[k].data.data = (uint8_t *)g[k];
    s[k].data.len = n * sizeof(float);
    sp[k] = &s[k];
    k++;
  }
  Factorps__V1__PushPullRequest req = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  req.worker_id = 0;
  req.step = 0;
  req.n_grads = k;
  req.grads = sp;
  return fz_push_one(srv, &req);
}

static unsigned fx_mask(uint8_t flags) { return flags & 4 ? 7u : (flags & 3) ? 1u << ((flags & 3) - 1) : 0u; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in_t in = {data, size};
  uint8_t flags = fz_byte(&in);
  ack_at_once = flags & 8;
  fps_server_t *srv = fz_server_new_peer(FPS_MODE_SYNC, 1, 0, 2, fx_send, &shard_ids[0]);
  fx_create_blocks(srv, 0);
  fz_call_t *push = fx_push(srv, 0, fx_mask(flags), flags & 16);
  const uint8_t *p;
  size_t len;
  while (fz_chunk(&in, &p, &len)) fz_call_finish(fz_call_start(srv, FZ_EXCHANGE, p, len, true));
  /* The peer's deadline: what is still unacknowledged fails, and with it
   * any step still waiting (nothing applied). */
  fx_resolve_all(FPS_EUNAVAILABLE);
  fps_shard_expire(srv->shard, INT64_MAX);
  fz_drain();
  if (push) {
    if (!fz_call_ended(push)) {
      fprintf(stderr, "fuzz_exchange: the push still waits after every send ended\n");
      abort();
    }
    fz_call_finish(push);
  }
  /* Whatever a peer sends, a step either applies finite weights or
   * nothing: one NaN from a hostile peer must not poison the tensor. */
  for (int i = 0; i < NT; i++) {
    const fps_tensor_t *t = fps_store_find(&srv->shard->store, fx[i].name);
    for (uint64_t j = 0; t && j < t->numel; j++)
      if (!isfinite(t->param[j])) {
        fprintf(stderr, "fuzz_exchange: tensor '%s' has a non-finite weight at version %llu\n", t->name,
                (unsigned long long)t->version);
        abort();
      }
  }
  fz_server_free(srv);
  return 0;
}

#ifdef FPS_FUZZ_WRITE_SEEDS
/* Two real shard cores, 0 and 1, each with its blocks, both pushed the
 * same step; every send is delivered to the other core as an Exchange
 * call until none is pending. What shard 1 sends shard 0 is a seed, plain
 * and mutated. */

#define MAXMSG 16
static uint8_t *to0[MAXMSG];
static size_t to0_len[MAXMSG], nto0;

static void pump(fps_server_t *srv[2]) {
  while (nsends) {
    fx_send_t s = sends[0];
    memmove(sends, sends + 1, --nsends * sizeof *sends);
    if (s.to == 0 && nto0 < MAXMSG) {
      to0[nto0] = malloc(s.len);
      memcpy(to0[nto0], s.req, s.len);
      to0_len[nto0++] = s.len;
    }
    fz_call_t *c = fz_call_start(srv[s.to], FZ_EXCHANGE, s.req, s.len, true);
    int st = fz_call_status(c);
    fz_call_finish(c);
    free(s.req);
    s.done(s.arg, st == 0 ? 0 : FPS_ESTATE, st == 0 ? "" : "refused", NULL);
    fz_drain();
  }
}

/* Message i of to0, unpacked, changed by `how`, repacked. */
static uint8_t *mutate(size_t i, int how, size_t *len) {
  Factorps__V1__ExchangeRequest *r = factorps__v1__exchange_request__unpack(NULL, to0_len[i], to0[i]);
  if (!r) abort();
  uint8_t *pd = malloc(r->partials.len + 64);
  memcpy(pd, r->partials.data, r->partials.len);
  size_t plen = r->partials.len;
  double nan = NAN, inf = INFINITY;
  switch (how) {
    case 0: r->version += 1; break;                  /* one step ahead: kept as mail */
    case 1: r->version += 1000; break;               /* far ahead: diverged */
    case 2: r->block_index = 0; break;               /* our own block */
    case 3: r->block_index = 7; break;               /* no such block */
    case 4: r->from_shard = 0; break;                /* ourselves */
    case 5: r->shard_count = 3; break;
    case 6: if (plen >= 72) memcpy(pd + 64, &nan, 8); break;  /* a NaN sum */
    case 7: if (plen >= 80) memcpy(pd + 72, &inf, 8); break;  /* an Inf min */
    case 8: plen = plen > 8 ? plen - 8 : 0; break;   /* truncated */
    case 9: memset(pd + plen, 0, 8); plen += 8; break;        /* trailing bytes */
    case 10: if (plen >= 40) { uint32_t huge = 0xffffffffu; memcpy(pd + 28, &huge, 4); memcpy(pd + 36, &huge, 4); } break;
    case 11: if (plen >= 64) pd[plen - 1] ^= 0x55; break;     /* a different column state */
    case 12: r->phase = FACTORPS__V1__EXCHANGE_PHASE__EXCHANGE_PHASE_U2; break;
  }
  r->partials.data = pd;
  r->partials.len = plen;
  uint8_t *out = fz_pack(r, len);
  r->partials.data = NULL;
  r->partials.len = 0;
  free(pd);
  factorps__v1__exchange_request__free_unpacked(r, NULL);
  return out;
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  int n = 0;
  static const uint8_t cases[] = {1, 2, 3, 4, 0x12, 0x14, 0x09, 0x0c};
  for (size_t ci = 0; ci < sizeof cases; ci++) {
    uint8_t flags = cases[ci];
    ack_at_once = false;
    nto0 = 0;
    fps_server_t *srv[2] = {fz_server_new_peer(FPS_MODE_SYNC, 1, 0, 2, fx_send, &shard_ids[0]),
                            fz_server_new_peer(FPS_MODE_SYNC, 1, 1, 2, fx_send, &shard_ids[1])};
    fx_create_blocks(srv[0], 0);
    fx_create_blocks(srv[1], 1);
    fz_call_t *push[2] = {fx_push(srv[0], 0, fx_mask(flags), flags & 16),
                          fx_push(srv[1], 1, fx_mask(flags), flags & 16)};
    pump(srv);
    for (int k = 0; k < 2; k++) {
      if (fz_call_status(push[k]) != 0) {
        fprintf(stderr, "fuzz_exchange_seeds: flags %#x: shard %d's step failed (%d)\n", flags, k,
                fz_call_status(push[k]));
        return 1;
      }
      fz_call_finish(push[k]);
    }
    fx_resolve_all(FPS_EUNAVAILABLE);
    fz_server_free(srv[0]);
    fz_server_free(srv[1]);
    char name[64];
    snprintf(name, sizeof name, "step-%02x", flags);
    /* Without ack-at-once the seed's own push sends stay pending. */
    n += fz_write_seed(argv[1], name, flags, to0, to0_len, nto0) == 0;
    /* No step in flight: the same messages arrive early. */
    snprintf(name, sizeof name, "early-%02x", flags);
    n += fz_write_seed(argv[1], name, 0, to0, to0_len, nto0) == 0;
    /* Each message twice: the identical retry. */
    uint8_t *twice[2 * MAXMSG];
    size_t twice_len[2 * MAXMSG];
    for (size_t i = 0; i < nto0; i++) {
      twice[2 * i] = twice[2 * i + 1] = to0[i];
      twice_len[2 * i] = twice_len[2 * i + 1] = to0_len[i];
    }
    snprintf(name, sizeof name, "retry-%02x", flags);
    n += fz_write_seed(argv[1], name, flags, twice, twice_len, 2 * nto0) == 0;
    for (int how = 0; how < 13 && nto0; how++) {
      size_t len;
      uint8_t *m = mutate(0, how, &len);
      snprintf(name, sizeof name, "mut%02d-%02x", how, flags);
      n += fz_write_seed(argv[1], name, flags, &m, &len, 1) == 0;
      free(m);
    }
    for (size_t i = 0; i < nto0; i++) free(to0[i]);
  }
  printf("%d seeds\n", n);
  return 0;
}
#endif

/* The fake gRPC transport and the shard fixture of the gRPC fuzz targets
 * (see fuzz_server.h for why a fake and what it checks).
 *
 * A grpc_call* handed to the server is really an fz_call_t*. Completions go
 * into one FIFO that fz_drain() runs on the calling thread, so the order of
 * every callback is fixed by the input alone. */
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>
#include <math.h>
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "factorps/v1/factorps.pb-c.h"
#include "fuzz_server.h"
#include "metrics.h"
#include "replica.h"
#include "replica_send.h"
#include "simd/kernels.h"

#define FZ_INBOX_MAX 64

/* server/main.c is not linked (it has main()): its two log symbols, weak
 * so that they give way if the server ever defines them in another file.
 * fz_server_new() keeps the level below ERROR: nothing is formatted or
 * printed per input. */
__attribute__((weak)) int fps__log_level = -1;
__attribute__((weak)) void fps__log(int level, const char *fmt, ...) {
  (void)level;
  (void)fmt;
}

struct fz_call_s {
  fz_method_t method;
  fps_tag_t *close_tag;           /* RECV_CLOSE_ON_SERVER, once posted */
  int *cancelled_out;
  bool close_queued;
  fps_tag_t *recv_tag;            /* pending RECV_MESSAGE */
  grpc_byte_buffer **recv_slot;
  grpc_byte_buffer *inbox[FZ_INBOX_MAX]; /* sent by the client, not yet read */
  size_t inbox_n;
  bool half_closed;
  bool cancelled;
  int status;                     /* -1 until the server sends one */
  char details[256];
  int unrefs;
  size_t replies;
};

/* ------------------------------------------------------ completion queue */

typedef struct fz_event_s {
  fps_tag_t *tag;
  bool ok;
} fz_event_t;

static fz_event_t *fz__q;
static size_t fz__qhead, fz__qlen, fz__qcap;

static void fz__push(fps_tag_t *tag, bool ok) {
  if (fz__qhead + fz__qlen == fz__qcap) {
    if (fz__qhead > 0) {
      memmove(fz__q, fz__q + fz__qhead, fz__qlen * sizeof *fz__q);
      fz__qhead = 0;
    } else {
      size_t cap = fz__qcap ? fz__qcap * 2 : 64;
      fz_event_t *q = realloc(fz__q, cap * sizeof *q);
      if (!q) abort();
      fz__q = q;
      fz__qcap = cap;
    }
  }
  fz__q[fz__qhead + fz__qlen++] = (fz_event_t){tag, ok};
}

void fz_drain(void) {
  while (fz__qlen) {
    fz_event_t ev = fz__q[fz__qhead++];
    fz__qlen--;
    if (!fz__qlen) fz__qhead = 0;
    ev.tag->fn(ev.tag, ev.ok);
  }
}

/* ------------------------------------------------------- call behaviour */

static void fz__queue_close(fz_call_t *c, int cancelled) {
  if (c->close_queued || !c->close_tag) return;
  c->close_queued = true;
  *c->cancelled_out = cancelled;
  fz__push(c->close_tag, true);
}

/* Hands the next inbox message (or the half-close) to a pending receive. */
static void fz__deliver(fz_call_t *c) {
  if (!c->recv_tag) return;
  if (c->inbox_n) {
    *c->recv_slot = c->inbox[0];
    memmove(c->inbox, c->inbox + 1, --c->inbox_n * sizeof *c->inbox);
  } else if (c->half_closed) {
    *c->recv_slot = NULL; /* end of stream */
  } else {
    return;
  }
  fps_tag_t *t = c->recv_tag;
  c->recv_tag = NULL;
  fz__push(t, true);
}

static void fz__cancel(fz_call_t *c, int status, const char *details) {
  if (c->cancelled || c->status >= 0) return;
  c->cancelled = true;
  if (status >= 0) {
    c->status = status;
    snprintf(c->details, sizeof c->details, "%s", details ? details : "");
  }
  if (c->recv_tag) {
    fps_tag_t *t = c->recv_tag;
    c->recv_tag = NULL;
    fz__push(t, false);
  }
  fz__queue_close(c, 1);
}

/* Every reply message must decode as the method's response type. */
static void fz__check_reply(fz_call_t *c, grpc_byte_buffer *bb) {
  uint8_t *buf;
  size_t len;
  if (fps_bb_flatten(bb, UINT64_MAX, &buf, &len) < 0) abort();
  ProtobufCMessage *m = NULL;
  switch (c->method) {
    case FZ_CREATE: m = (ProtobufCMessage *)factorps__v1__create_response__unpack(NULL, len, buf); break;
    case FZ_PUSHPULL: m = (ProtobufCMessage *)factorps__v1__push_pull_response__unpack(NULL, len, buf); break;
    case FZ_PULL: m = (ProtobufCMessage *)factorps__v1__pull_response__unpack(NULL, len, buf); break;
    case FZ_STATS: m = (ProtobufCMessage *)factorps__v1__stats_response__unpack(NULL, len, buf); break;
    case FZ_CHECKPOINT: m = (ProtobufCMessage *)factorps__v1__checkpoint_response__unpack(NULL, len, buf); break;
    case FZ_GETSTATE: m = (ProtobufCMessage *)factorps__v1__get_state_response__unpack(NULL, len, buf); break;
    case FZ_EXCHANGE: m = (ProtobufCMessage *)factorps__v1__exchange_response__unpack(NULL, len, buf); break;
    case FZ_REPLICATE: m = (ProtobufCMessage *)factorps__v1__replicate_response__unpack(NULL, len, buf); break;
  }
  if (!m) {
    fprintf(stderr, "fuzz: method %d sent a reply that does not decode (%zu bytes)\n", (int)c->method, len);
    abort();
  }
  protobuf_c_message_free_unpacked(m, NULL);
  free(buf);
  c->replies++;
}

/* The four gRPC call functions the server uses, replacing libgrpc's. */
grpc_call_error grpc_call_start_batch(grpc_call *call, const grpc_op *ops, size_t nops, void *tag, void *reserved) {
  fz_call_t *c = (fz_call_t *)call;
  (void)reserved;
  bool queue = false, final = false;
  for (size_t i = 0; i < nops; i++) {
    switch (ops[i].op) {
      case GRPC_OP_RECV_CLOSE_ON_SERVER:
        if (c->close_tag) abort(); /* posted twice */
        c->close_tag = tag;
        c->cancelled_out = ops[i].data.recv_close_on_server.cancelled;
        if (c->cancelled) fz__queue_close(c, 1);
        break;
      case GRPC_OP_RECV_MESSAGE:
        /* gRPC refuses a second receive in flight: the server must not try. */
        if (c->recv_tag) abort();
        c->recv_tag = tag;
        c->recv_slot = ops[i].data.recv_message.recv_message;
        if (c->cancelled || c->status >= 0) {
          c->recv_tag = NULL;
          fz__push(tag, false);
        } else {
          fz__deliver(c);
        }
        break;
      case GRPC_OP_SEND_INITIAL_METADATA:
        queue = true;
        break;
      case GRPC_OP_SEND_MESSAGE:
        if (c->status >= 0 && !c->cancelled) abort(); /* a message after the status */
        fz__check_reply(c, ops[i].data.send_message.send_message);
        queue = true;
        break;
      case GRPC_OP_SEND_STATUS_FROM_SERVER:
        if (c->status >= 0 && !c->cancelled) {
          fprintf(stderr, "fuzz: method %d sent a second status\n", (int)c->method);
          abort();
        }
        if (!c->cancelled) {
          c->status = (int)ops[i].data.send_status_from_server.status;
          const grpc_slice *d = ops[i].data.send_status_from_server.status_details;
          if (d)
            snprintf(c->details, sizeof c->details, "%.*s", (int)GRPC_SLICE_LENGTH(*d),
                     (const char *)GRPC_SLICE_START_PTR(*d));
        }
        queue = final = true;
        break;
      default:
        abort(); /* the server uses no other server-side op */
    }
  }
  if (final && c->recv_tag) {
    fps_tag_t *t = c->recv_tag;
    c->recv_tag = NULL;
    fz__push(t, false);
  }
  if (queue) fz__push(tag, !c->cancelled);
  if (final) fz__queue_close(c, c->cancelled ? 1 : 0);
  return GRPC_CALL_OK;
}

grpc_call_error grpc_call_cancel(grpc_call *call, void *reserved) {
  (void)reserved;
  fz__cancel((fz_call_t *)call, GRPC_STATUS_CANCELLED, "cancelled by the server");
  return GRPC_CALL_OK;
}

grpc_call_error grpc_call_cancel_with_status(grpc_call *call, grpc_status_code status, const char *description,
                                             void *reserved) {
  (void)reserved;
  fz__cancel((fz_call_t *)call, (int)status, description);
  return GRPC_CALL_OK;
}

void grpc_call_unref(grpc_call *call) {
  fz_call_t *c = (fz_call_t *)call;
  if (++c->unrefs > 1) {
    fprintf(stderr, "fuzz: method %d: call released twice\n", (int)c->method);
    abort();
  }
}

/* -------------------------------------------------------- client side */

/* A message as a transport delivers it: in several slices, here of 1..13
 * bytes in a sequence fixed by the length (every input replays the same
 * way), so varints, names and elements straddle slices as they do on a
 * socket and the shard's in-place decoding is fuzzed along. */
static grpc_byte_buffer *fz__bb(const uint8_t *p, size_t len) {
  grpc_slice_buffer sb;
  grpc_slice_buffer_init(&sb);
  uint32_t x = (uint32_t)len * 2654435761u + 1;
  for (size_t at = 0; at < len || sb.count == 0;) {
    x = x * 1103515245u + 12345u;
    size_t k = 1 + (x >> 16) % 13;
    if (k > len - at) k = len - at;
    grpc_slice_buffer_add(&sb, grpc_slice_from_copied_buffer((const char *)p + at, k));
    at += k;
  }
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sb.slices, sb.count);
  grpc_slice_buffer_destroy(&sb);
  return bb;
}

fz_call_t *fz_call_start(fps_server_t *srv, fz_method_t m, const uint8_t *request, size_t len, bool has_request) {
  fz_call_t *c = calloc(1, sizeof *c);
  if (!c) abort();
  c->method = m;
  c->status = -1;
  grpc_metadata_array md;
  grpc_metadata_array_init(&md);
  gpr_timespec deadline = gpr_inf_future(GPR_CLOCK_REALTIME);
  grpc_byte_buffer *payload = has_request ? fz__bb(request, len) : NULL;
  switch (m) {
    case FZ_CREATE: fps_rpc_create_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_PULL: fps_rpc_pull_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_STATS: fps_rpc_stats_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_CHECKPOINT: fps_rpc_checkpoint_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_GETSTATE: fps_rpc_getstate_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_EXCHANGE: fps_rpc_exchange_start(srv, (grpc_call *)c, deadline, &md, payload); break;
    case FZ_PUSHPULL:
      if (payload) grpc_byte_buffer_destroy(payload);
      fps_rpc_pushpull_start(srv, (grpc_call *)c, deadline, &md);
      break;
    case FZ_REPLICATE:
      if (payload) grpc_byte_buffer_destroy(payload);
      fps_rpc_replicate_start(srv, (grpc_call *)c, deadline, &md);
      break;
  }
  fz_drain();
  return c;
}

void fz_call_send(fz_call_t *c, const uint8_t *msg, size_t len) {
  if (c->cancelled || c->status >= 0 || c->half_closed || c->inbox_n == FZ_INBOX_MAX) return;
  c->inbox[c->inbox_n++] = fz__bb(msg, len);
  fz__deliver(c);
  fz_drain();
}

void fz_call_half_close(fz_call_t *c) {
  if (c->cancelled || c->status >= 0) return;
  c->half_closed = true;
  fz__deliver(c);
  fz_drain();
}

void fz_call_cancel(fz_call_t *c) {
  fz__cancel(c, -1, NULL);
  fz_drain();
}

bool fz_call_ended(const fz_call_t *c) { return c->cancelled || c->status >= 0; }
int fz_call_status(const fz_call_t *c) { return c->status; }

void fz_call_finish(fz_call_t *c) {
  static int verbose = -1;
  if (verbose < 0) verbose = getenv("FPS_FUZZ_VERBOSE") != NULL;
  fz_drain();
  /* FPS_FUZZ_VERBOSE=1: what each call answered, to check what a seed
   * reaches. */
  if (verbose)
    fprintf(stderr, "fuzz: method %d: status %d%s, %zu replies: %s\n", (int)c->method, c->status,
            c->cancelled ? " (cancelled)" : "", c->replies, c->details);
  if (!fz_call_ended(c)) {
    fprintf(stderr, "fuzz: method %d: call neither answered nor cancelled\n", (int)c->method);
    abort();
  }
  if (c->unrefs != 1) {
    fprintf(stderr, "fuzz: method %d: call released %d times (status %d: %s)\n", (int)c->method, c->unrefs,
            c->status, c->details);
    abort();
  }
  if (c->recv_tag) abort();
  for (size_t i = 0; i < c->inbox_n; i++) grpc_byte_buffer_destroy(c->inbox[i]);
  free(c);
}

/* ---------------------------------------- the primary's side, absent */

/* replica_send.c is not linked (CMakeLists.txt): it runs threads and a
 * channel of its own. A standby only ever receives; these stand in for
 * what replica.c calls of it. */
static int fz__rsend_dummy;
int fps_rsend_create(struct fps_server_s *srv, const fps_rsend_owner_t *owner, fps_rsend_t **out) {
  (void)srv;
  (void)owner;
  *out = (fps_rsend_t *)&fz__rsend_dummy;
  return 0;
}
void fps_rsend_destroy(fps_rsend_t *s) { (void)s; }
void fps_rsend_stop_stream(fps_rsend_t *s, const char *why) {
  (void)s;
  (void)why;
}
void fps_rsend_start_stream(fps_rsend_t *s, uint64_t term) {
  (void)s;
  fprintf(stderr, "fuzz: a standby was promoted (term %llu) without a lease thread\n", (unsigned long long)term);
  abort();
}
int fps_rsend_wait(fps_rsend_t *s, fps_tensor_t *const *t, const uint64_t *ver, const bool *changed, size_t n,
                   const fps_rkey_t *key, fps_rsend_done_fn done, void *arg) {
  (void)s, (void)t, (void)ver, (void)changed, (void)n, (void)key, (void)done, (void)arg;
  fprintf(stderr, "fuzz: a standby acknowledged a worker call\n");
  abort();
}

/* ------------------------------------------------------------ fixture */

uint8_t *fz_pack(const void *msg, size_t *len) {
  *len = protobuf_c_message_get_packed_size(msg);
  uint8_t *p = malloc(*len ? *len : 1);
  if (!p) abort();
  protobuf_c_message_pack(msg, p);
  return p;
}

fz_call_t *fz_push_one(fps_server_t *srv, const void *msg) {
  size_t len;
  uint8_t *buf = fz_pack(msg, &len);
  fz_call_t *c = fz_call_start(srv, FZ_PUSHPULL, NULL, 0, false);
  fz_call_send(c, buf, len);
  fz_call_half_close(c);
  free(buf);
  return c;
}

void fz_unary_ok(fps_server_t *srv, fz_method_t m, const void *msg, const char *what) {
  size_t len;
  uint8_t *buf = fz_pack(msg, &len);
  fz_call_t *c = fz_call_start(srv, m, buf, len, true);
  free(buf);
  if (fz_call_status(c) != GRPC_STATUS_OK) {
    fprintf(stderr, "fuzz: %s failed (%d): %s\n", what, fz_call_status(c), c->details);
    abort();
  }
  fz_call_finish(c);
}

static void fz__fixture_tensors(fps_server_t *srv) {
  static const uint64_t shp_w[] = {4, 3}, shp_b[] = {3}, shp_h[] = {2, 2};
  float vw[12], vb[3], vh[2];
  for (int i = 0; i < 12; i++) vw[i] = 0.01f * (float)(i + 1);
  for (int i = 0; i < 3; i++) vb[i] = -0.5f + (float)i;
  vh[0] = 1.0f;
  vh[1] = 2.0f;
  Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT, torch = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  torch.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  torch.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  torch.lr = 0.01;
  Factorps__V1__TensorSlice s[3];
  Factorps__V1__TensorCreate tc[3];
  Factorps__V1__TensorCreate *tcp[3];
  const char *names[3] = {"w", "b", "half"};
  const uint64_t *shapes[3] = {shp_w, shp_b, shp_h};
  size_t nshape[3] = {2, 1, 2};
  float *vals[3] = {vw, vb, vh};
  size_t nvals[3] = {12, 3, 2};
  for (int i = 0; i < 3; i++) {
    factorps__v1__tensor_slice__init(&s[i]);
    s[i].name = (char *)names[i];
    s[i].dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
    s[i].data.data = (uint8_t *)vals[i];
    s[i].data.len = nvals[i] * sizeof(float);
    factorps__v1__tensor_create__init(&tc[i]);
    tc[i].name = (char *)names[i];
    tc[i].n_shape = nshape[i];
    tc[i].shape = (uint64_t *)shapes[i];
    tc[i].optimizer = i == 0 ? &hf : &torch;
    tc[i].init = &s[i];
    tcp[i] = &tc[i];
  }
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.n_tensors = 3;
  req.tensors = tcp;
  req.shard_id = srv->cfg.shard_id;
  req.shard_count = srv->cfg.shard_count;
  fz_unary_ok(srv, FZ_CREATE, &req, "the fixture's Create");
}

static fps_server_t *fz__server_new(int mode, uint32_t workers, uint32_t staleness, uint32_t shard_id,
                                    uint32_t shard_count, fps_xsend_fn send, void *ctx) {
  static bool once;
  static const fps_kernels_t *kernels;
  if (!once) {
    once = true;
    char why[256];
    if (fps_kernels_from_env(&kernels, why, sizeof why) < 0) {
      fprintf(stderr, "fuzz: kernels: %s\n", why);
      abort();
    }
    fps_metrics_config_t mc = {.shard_id = 0, .shard_count = 1, .mode = fps_mode_name(mode), .workers = workers,
                               .simd = fps_kernels_name(kernels), .version = "fuzz"};
    fps_metrics_init(&mc);
  }
  fps__log_level = -1;
  fps_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) abort();
  fps_config_t *cfg = &srv->cfg;
  /* The real defaults first (every string set, as in a running shard),
   * then what the fuzzer varies and the small limits. */
  char arg0[] = "factorps-server";
  char *argv[] = {arg0, NULL};
  if (fps_config_load(cfg, 1, argv) != 0) abort();
  cfg->shard_id = shard_id;
  cfg->shard_count = shard_count;
  cfg->mode = mode;
  cfg->workers = workers ? workers : 1;
  cfg->staleness = staleness;
  cfg->deadline = 30.0;
  cfg->max_message_bytes = 4u << 20;
  cfg->threads = 1;
  /* Small limits: every input stays cheap, and the limit paths get hit. */
  cfg->max_tensors = 16;
  cfg->max_bytes = 64u << 10;
  cfg->max_staging_bytes = 256u << 10;
  cfg->apply_log = 4;
  /* The decode budget as main.c sets it, from config.c's default for
   * these limits (the larger of a quarter of --max-bytes and 4 messages). */
  srv->decode.limit = cfg->max_bytes / 4 > 4 * cfg->max_message_bytes ? cfg->max_bytes / 4 : 4 * cfg->max_message_bytes;
  pthread_mutex_init(&srv->calls_mu, NULL);
  pthread_rwlock_init(&srv->batch_gate, NULL);
  /* The real core; no timer thread is started, so no deadline fires and
   * every input replays the same way. */
  fps_shard_opts_t opts;
  fps_config_shard_opts(cfg, &opts);
  if (fps_shard_new(&opts, kernels, NULL, &srv->shard) < 0) abort();
  if (send) fps_shard_set_exchange(srv->shard, send, ctx, cfg->deadline);
  fz__fixture_tensors(srv);
  return srv;
}

fps_server_t *fz_server_new(int mode, uint32_t workers, uint32_t staleness) {
  return fz__server_new(mode, workers, staleness, 0, 1, NULL, NULL);
}

fps_server_t *fz_server_new_peer(int mode, uint32_t workers, uint32_t shard_id, uint32_t shard_count,
                                 fps_xsend_fn send, void *ctx) {
  return fz__server_new(mode, workers, 0, shard_id, shard_count, send, ctx);
}

fps_server_t *fz_server_new_standby(int mode, uint32_t workers) {
  fps_server_t *srv = fz__server_new(mode, workers, 0, 0, 1, NULL, NULL);
  fps_free(srv->cfg.replica_peer);
  fps_free(srv->cfg.lease);
  /* The lease is opened (the file must exist) but never acquired. */
  srv->cfg.replica_peer = fps_strdup("127.0.0.1:1");
  srv->cfg.lease = fps_strdup("file:/dev/null");
  if (!srv->cfg.replica_peer || !srv->cfg.lease || fps_replica_create(srv, &srv->replica) < 0) abort();
  return srv;
}

void fz_server_free(fps_server_t *srv) {
  fz_drain();
  if (srv->calls) {
    fprintf(stderr, "fuzz: %llu calls still linked at teardown\n", (unsigned long long)srv->ncalls);
    abort();
  }
  if (srv->shard->ssp_waits || srv->shard->rounds) {
    fprintf(stderr, "fuzz: a parked call or an open round outlived its call\n");
    abort();
  }
  /* Finite gradients must never make the weights NaN or Inf: one such
   * push would silently poison every later step of every worker. */
  if (getenv("FPS_FUZZ_CHECK_FINITE"))
    for (fps_tensor_t *t = srv->shard->store.first; t; t = t->next) {
      uint64_t bad = 0;
      for (uint64_t i = 0; t->ready && i < t->numel; i++) bad += !isfinite(t->param[i]);
      if (bad) {
        fprintf(stderr, "fuzz: tensor '%s': %llu of %llu weights are NaN or Inf after version %llu\n", t->name,
                (unsigned long long)bad, (unsigned long long)t->numel, (unsigned long long)t->version);
        abort();
      }
    }
  fps_replica_destroy(srv->replica);
  fps_shard_free(srv->shard);
  fps_config_free(&srv->cfg);
  pthread_mutex_destroy(&srv->calls_mu);
  pthread_rwlock_destroy(&srv->batch_gate);
  free(srv);
}

/* --------------------------------------------------------------- input */

uint8_t fz_byte(fz_in_t *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

bool fz_chunk(fz_in_t *in, const uint8_t **p, size_t *len) {
  if (!in->n) return false;
  size_t l = fz_byte(in);
  l |= (size_t)fz_byte(in) << 8;
  if (l > in->n) l = in->n;
  *p = in->p;
  *len = l;
  in->p += l;
  in->n -= l;
  return true;
}

int fz_write_seed(const char *dir, const char *name, uint8_t flags, uint8_t *const *msgs, const size_t *lens,
                  size_t n) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  fputc(flags, f);
  for (size_t i = 0; i < n; i++) {
    fputc((int)(lens[i] & 0xff), f);
    fputc((int)(lens[i] >> 8), f);
    fwrite(msgs[i], 1, lens[i], f);
  }
  return fclose(f);
}

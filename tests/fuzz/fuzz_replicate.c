/* libFuzzer target: a Replicate stream into a standby, through the shard's
 * real handler (server/rpc_replicate.c: the in-place split of each message
 * over gRPC's slices, the decode bounds, the hello's checks, seq order,
 * pieces assembled into the buffers the core adopts, installs during the
 * transfer, images and keys held for a commit after it) and the core's
 * fps_shard_install. The standby is shard 0 of 1 in async mode
 * (fuzz_server.h: the fixture's "w", "b" and the half-created "half");
 * only the holder of its shard's peer token may open the stream (or any
 * client, where one token grants every role), so no message may crash the
 * shard, leak, leave the call unanswered, promote it, or install a tensor
 * whose sizes disagree with its data.
 *
 * Input: one flags byte, then ReplicateRequest messages (u16 LE length,
 * then the bytes), sent in order on one stream:
 *   bit 0:    a valid hello (seq 1, term 1 + bits 4-7) goes first, so the
 *             fuzzer's own messages start after it (their seq from 2)
 *   bit 1:    the stream ends with a cancel (the primary gone) instead of
 *             a half-close
 *   bit 2:    a second stream then sends the same messages again (the
 *             primary reconnecting, or a second primary of that term)
 * Oracles besides the harness's: the shard is still a standby; Stats with
 * every tensor (sizes, state, checksums) answers OK and reads every
 * installed tensor whole.
 * Seeds (FPS_FUZZ_WRITE_SEEDS: fuzz_replicate_seeds DIR): what a primary
 * sends (its images of real tensors taken by fps_shard_image after a
 * push, in one and in several pieces, keys, the transfer's end, a batch
 * and its commit), and mutations of them a hostile stream would try. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "factorps/v1/factorps.pb-c.h"
#include "fuzz_server.h"
#include "replica.h"

/* The kernel variant the standby runs: a hello must name it. */
static const char *fr_simd(void) {
  static char name[32];
  if (!*name) {
    fps_server_t *srv = fz_server_new(FPS_MODE_ASYNC, 1, 0);
    fps_shard_view_t v;
    if (fps_shard_view(srv->shard, false, 0, &v) < 0) abort();
    snprintf(name, sizeof name, "%s", v.simd);
    fps_shard_view_free(&v);
    fz_server_free(srv);
  }
  return name;
}

static uint8_t *fr_hello(uint64_t seq, uint64_t term, size_t *len) {
  Factorps__V1__ReplicateHello h = FACTORPS__V1__REPLICATE_HELLO__INIT;
  h.shard_id = 0;
  h.shard_count = 1;
  h.term = term;
  h.mode = FACTORPS__V1__MODE__MODE_ASYNC;
  h.workers = 1;
  h.simd = (char *)fr_simd();
  h.primary = (char *)"127.0.0.1:2";
  Factorps__V1__ReplicateRequest m = FACTORPS__V1__REPLICATE_REQUEST__INIT;
  m.seq = seq;
  m.hello = &h;
  return fz_pack(&m, len);
}

/* One stream: the messages of the input, after the hello if asked. */
static void fr_stream(fps_server_t *srv, uint8_t flags, const uint8_t *data, size_t size) {
  fz_in_t in = {data, size};
  fz_call_t *c = fz_call_start(srv, FZ_REPLICATE, NULL, 0, false);
  if (flags & 1) {
    size_t len;
    uint8_t *h = fr_hello(1, 1 + (flags >> 4), &len);
    fz_call_send(c, h, len);
    free(h);
  }
  const uint8_t *p;
  size_t len;
  while (!fz_call_ended(c) && fz_chunk(&in, &p, &len)) fz_call_send(c, p, len);
  if (flags & 2) fz_call_cancel(c);
  else fz_call_half_close(c);
  fz_call_finish(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  uint8_t flags = data[0];
  fps_server_t *srv = fz_server_new_standby(FPS_MODE_ASYNC, 1);
  fr_stream(srv, flags, data + 1, size - 1);
  if (flags & 4) fr_stream(srv, flags, data + 1, size - 1);
  fps_role_view_t v;
  fps_role_get(fps_replica_role(srv->replica), &v);
  if (v.role != FPS_REPLICA_STANDBY) {
    fprintf(stderr, "fuzz_replicate: a stream made the standby %s\n", fps_replica_role_name(v.role));
    abort();
  }
  /* Every tensor, installed or not, read whole: its sizes must be what
   * its buffers hold (ASan sees any other read). */
  Factorps__V1__StatsRequest sr = FACTORPS__V1__STATS_REQUEST__INIT;
  sr.include_tensors = true;
  sr.include_checksum = true;
  fz_unary_ok(srv, FZ_STATS, &sr, "fuzz_replicate: Stats after the stream");
  fz_server_free(srv);
  return 0;
}

#ifdef FPS_FUZZ_WRITE_SEEDS
/* A primary's messages, built from a real shard core's images. */

#define MAXMSG 16

typedef struct fr_seed_s {
  uint8_t *msg[MAXMSG];
  size_t len[MAXMSG];
  size_t n;
} fr_seed_t;

static void fr_add(fr_seed_t *s, uint8_t *m, size_t len) {
  if (s->n == MAXMSG) abort();
  s->msg[s->n] = m;
  s->len[s->n++] = len;
}

static void fr_free(fr_seed_t *s) {
  for (size_t i = 0; i < s->n; i++) free(s->msg[i]);
  s->n = 0;
}

/* A tensor's image as the primary would cut it: piece [off, off + n) of
 * its parameters then state bytes; `how` alters it (0: as is). */
typedef struct fr_image_s {
  char name[32];
  uint64_t shape[4];
  size_t ndim;
  uint64_t version, step, n[FPS_STATE_KINDS];
  double rms, last_lr, last_wd;
  uint8_t *bytes;
  uint64_t total;
} fr_image_t;

static void fr_image(fps_server_t *srv, const char *name, fr_image_t *out) {
  fps_tensor_t *t = fps_store_find(&srv->shard->store, name);
  fps_image_t img;
  char why[256];
  if (!t || fps_shard_image(srv->shard, t, &img, why, sizeof why) < 0) {
    fprintf(stderr, "fuzz_replicate_seeds: no image of '%s'\n", name);
    abort();
  }
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", name);
  out->ndim = img.shape->ndim;
  for (size_t i = 0; i < out->ndim; i++) out->shape[i] = img.shape->dim[i];
  out->version = img.version;
  out->step = img.step;
  for (int k = 0; k < FPS_STATE_KINDS; k++) out->n[k] = img.n[k];
  out->rms = img.rms;
  out->last_lr = img.last_lr;
  out->last_wd = img.last_weight_decay;
  out->total = (img.numel + img.total_state) * 4;
  out->bytes = malloc(out->total);
  memcpy(out->bytes, fps_snap_data(img.params), img.numel * 4);
  if (img.total_state) memcpy(out->bytes + img.numel * 4, img.state, img.total_state * 4);
  fps_image_release(srv->shard, &img);
}

/* A message with pieces of images: (image, offset, length) triples. */
typedef struct fr_piece_s {
  const fr_image_t *im;
  uint64_t off, len;
} fr_piece_t;

static uint8_t *fr_msg(uint64_t seq, const fr_piece_t *pc, size_t np, const uint64_t *key_versions, size_t nkv,
                       bool done, bool commit, size_t *len) {
  Factorps__V1__AdafactorConfig cfg = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  cfg.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  Factorps__V1__ReplicaTensor rt[4], *rtp[4];
  if (np > 4) abort();
  for (size_t i = 0; i < np; i++) {
    const fr_image_t *im = pc[i].im;
    factorps__v1__replica_tensor__init(&rt[i]);
    rt[i].name = (char *)im->name;
    rt[i].n_shape = im->ndim;
    rt[i].shape = (uint64_t *)im->shape;
    rt[i].config = &cfg;
    rt[i].version = im->version;
    rt[i].step = im->step;
    rt[i].rms = im->rms;
    rt[i].last_lr = im->last_lr;
    rt[i].last_weight_decay = im->last_wd;
    rt[i].n_state_elements = FPS_STATE_KINDS;
    rt[i].state_elements = (uint64_t *)im->n;
    rt[i].total_bytes = im->total;
    rt[i].offset = pc[i].off;
    rt[i].data.data = im->bytes + pc[i].off;
    rt[i].data.len = pc[i].len;
    rtp[i] = &rt[i];
  }
  Factorps__V1__ReplicaKey k = FACTORPS__V1__REPLICA_KEY__INIT, *kp = &k;
  k.worker = 0;
  k.push_id = 77;
  k.tensors = 0x1234;
  k.n_versions = nkv;
  k.versions = (uint64_t *)key_versions;
  Factorps__V1__ReplicateRequest m = FACTORPS__V1__REPLICATE_REQUEST__INIT;
  m.seq = seq;
  m.n_tensors = np;
  m.tensors = rtp;
  m.n_keys = nkv ? 1 : 0;
  m.keys = nkv ? &kp : NULL;
  m.transfer_done = done;
  m.commit = commit;
  return fz_pack(&m, len);
}

/* Worker 0's async push of one gradient to "w" on the seed shard. */
static void fr_push_w(fps_server_t *srv, uint64_t step) {
  static const uint64_t shape[] = {4, 3};
  float g[12];
  for (int i = 0; i < 12; i++) g[i] = 0.03f * (float)((i + step) % 5) - 0.05f;
  Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT, *sp = &s;
  s.name = (char *)"w";
  s.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  s.n_shape = 2;
  s.shape = (uint64_t *)shape;
  s.data.data = (uint8_t *)g;
  s.data.len = sizeof g;
  Factorps__V1__PushPullRequest req = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  req.worker_id = 0;
  req.step = step;
  req.n_grads = 1;
  req.grads = &sp;
  fz_call_t *c = fz_push_one(srv, &req);
  if (fz_call_status(c) != 0) abort();
  fz_call_finish(c);
}

/* Creates "r" [5, 6] (hf) on the seed shard. */
static void fr_create_r(fps_server_t *srv) {
  static const uint64_t shape[] = {5, 6};
  float v[30];
  for (int i = 0; i < 30; i++) v[i] = 0.02f * (float)(i % 9) - 0.08f;
  Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  Factorps__V1__TensorSlice s = FACTORPS__V1__TENSOR_SLICE__INIT;
  s.name = (char *)"r";
  s.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  s.data.data = (uint8_t *)v;
  s.data.len = sizeof v;
  Factorps__V1__TensorCreate tc = FACTORPS__V1__TENSOR_CREATE__INIT, *tcp = &tc;
  tc.name = (char *)"r";
  tc.n_shape = 2;
  tc.shape = (uint64_t *)shape;
  tc.optimizer = &hf;
  tc.init = &s;
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.n_tensors = 1;
  req.tensors = &tcp;
  req.shard_count = 1;
  fz_unary_ok(srv, FZ_CREATE, &req, "fuzz_replicate_seeds: the Create of 'r'");
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  const char *dir = argv[1];
  /* The primary: the fixture, "w" pushed once (its factored state set),
   * "r" created; then "w" pushed again for the stream's batch. */
  fps_server_t *p = fz_server_new(FPS_MODE_ASYNC, 1, 0);
  fr_push_w(p, 0);
  fr_create_r(p);
  fr_image_t w1, r0, w2;
  fr_image(p, "w", &w1);
  fr_image(p, "r", &r0);
  fr_push_w(p, 1);
  fr_image(p, "w", &w2);
  fz_server_free(p);

  int n = 0;
  fr_seed_t s = {0};
  uint64_t kv1[] = {1}, kv2[] = {2};
  size_t len;
  uint8_t *m;
  /* The hello alone, given by the input. */
  m = fr_hello(1, 3, &len);
  fr_add(&s, m, len);
  n += fz_write_seed(dir, "hello", 0, s.msg, s.len, s.n) == 0;
  fr_free(&s);
  /* A whole transfer: both images in one message, the key, the end. */
  fr_piece_t both[] = {{&w1, 0, w1.total}, {&r0, 0, r0.total}};
  m = fr_msg(2, both, 2, kv1, 1, false, false, &len);
  fr_add(&s, m, len);
  m = fr_msg(3, NULL, 0, NULL, 0, true, false, &len);
  fr_add(&s, m, len);
  n += fz_write_seed(dir, "transfer", 1, s.msg, s.len, s.n) == 0;
  n += fz_write_seed(dir, "transfer-twice", 1 | 4, s.msg, s.len, s.n) == 0;
  n += fz_write_seed(dir, "transfer-cancel", 1 | 2, s.msg, s.len, s.n) == 0;
  /* Then the stream: w's next image (three pieces over two messages),
   * its key, the commit. */
  fr_piece_t a[] = {{&w2, 0, 20}}, b[] = {{&w2, 20, 30}, {&w2, 50, w2.total - 50}};
  m = fr_msg(4, a, 1, NULL, 0, false, false, &len);
  fr_add(&s, m, len);
  m = fr_msg(5, b, 2, kv2, 1, false, false, &len);
  fr_add(&s, m, len);
  m = fr_msg(6, NULL, 0, NULL, 0, false, true, &len);
  fr_add(&s, m, len);
  n += fz_write_seed(dir, "stream", 1, s.msg, s.len, s.n) == 0;
  n += fz_write_seed(dir, "stream-twice", 1 | 4, s.msg, s.len, s.n) == 0;
  n += fz_write_seed(dir, "stream-term9", 1 | 0x80, s.msg, s.len, s.n) == 0;
  fr_free(&s);
  /* Mutations a hostile stream would try, each after a good hello. */
  for (int how = 0; how < 10; how++) {
    fr_image_t bad = w1;
    fr_piece_t pc = {&bad, 0, w1.total};
    uint64_t kvs[3] = {1, 2, 3};
    size_t nkv = 1, np = 1;
    uint64_t seq = 2;
    switch (how) {
      case 0: bad.total += 4; break;                          /* total disagrees with the sizes */
      case 1: pc.off = 8; pc.len = w1.total - 8; break;       /* first piece not at 0 */
      case 2: bad.n[0] = 1000; break;                         /* state sizes the data lacks */
      case 3: bad.shape[1] = 4; break;                        /* held here with another shape */
      case 4: seq = 5; break;                                 /* a seq gap */
      case 5: nkv = 3; break;                                 /* a key naming more versions */
      case 6: bad.ndim = 0; break;                            /* a scalar of w's bytes */
      case 7: snprintf(bad.name, sizeof bad.name, "half"); break; /* over the half-created tensor */
      case 8: bad.version = 0; break;                         /* older than what it holds */
      case 9: np = 0; break;                                  /* a key without images */
    }
    m = fr_msg(seq, &pc, np, kvs, nkv, false, false, &len);
    fr_add(&s, m, len);
    m = fr_msg(seq + 1, NULL, 0, NULL, 0, true, false, &len);
    fr_add(&s, m, len);
    char name[32];
    snprintf(name, sizeof name, "mut%02d", how);
    n += fz_write_seed(dir, name, 1, s.msg, s.len, s.n) == 0;
    fr_free(&s);
  }
  free(w1.bytes);
  free(r0.bytes);
  free(w2.bytes);
  printf("%d seeds\n", n);
  return 0;
}
#endif

/* Writes the seed corpora of the gRPC and HTTP fuzz targets into
 * DIR/fuzz_<target>/ (tests/fuzz/corpus is its output, committed):
 *   fuzz_gen_seeds tests/fuzz/corpus
 * Seeds are valid requests and near misses against the fixture tensors of
 * fuzz_server.c ("w" [4,3] hf, "b" [3] torch, "half" [2,2] not ready), so
 * the fuzzer starts deep in the validation code instead of at the decoder.
 * The PushPull, wire and HTTP input layouts are described in
 * fuzz_pushpull.c, fuzz_wire.c and fuzz_http.c. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "factorps/v1/factorps.pb-c.h"

static const char *outdir;

static void put(const char *target, const char *name, const void *p, size_t n) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", outdir, target);
  mkdir(path, 0755);
  snprintf(path, sizeof path, "%s/%s/%s", outdir, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) {
    fprintf(stderr, "gen_seeds: cannot write %s\n", path);
    exit(1);
  }
}

static void put_msg(const char *target, const char *name, const void *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  uint8_t *p = malloc(n ? n : 1);
  protobuf_c_message_pack(msg, p);
  put(target, name, p, n);
  free(p);
}

/* ------------------------------------------------------------ Create */

static float F[64];
static uint16_t BF[64];

static void seeds_create(void) {
  const char *T = "fuzz_create";
  Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT, torch = FACTORPS__V1__ADAFACTOR_CONFIG__INIT,
                                full = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  torch.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  torch.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  torch.lr = 0.01;
  full.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  full.has_lr_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_LR_LR;
  full.lr = 0.001;
  full.has_eps1_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_EPS1_EPS1;
  full.eps1 = 1e-30;
  full.has_eps2_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_EPS2_EPS2;
  full.eps2 = 1e-3;
  full.has_clip_threshold_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_CLIP_THRESHOLD_CLIP_THRESHOLD;
  full.clip_threshold = 1.0;
  full.has_beta2_decay_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_BETA2_DECAY_BETA2_DECAY;
  full.beta2_decay = -0.8;
  full.has_weight_decay_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_WEIGHT_DECAY_WEIGHT_DECAY;
  full.weight_decay = 0.01;
  full.has_relative_step_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_RELATIVE_STEP_RELATIVE_STEP;
  full.relative_step = false;
  full.has_scale_parameter_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_SCALE_PARAMETER_SCALE_PARAMETER;
  full.scale_parameter = true;
  full.has_warmup_init_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_WARMUP_INIT_WARMUP_INIT;
  full.warmup_init = false;
  full.has_beta1_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_BETA1_BETA1;
  full.beta1 = 0.9;

  uint64_t s43[] = {4, 3}, s3[] = {3}, s22[] = {2, 2}, s84[] = {8, 4}, s34[] = {3, 4}, s5[] = {5},
           shuge[] = {1u << 20, 1u << 20}, s9d[] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  Factorps__V1__TensorSlice sl[4];
  for (int i = 0; i < 4; i++) factorps__v1__tensor_slice__init(&sl[i]);
  Factorps__V1__TensorCreate tc[4];
  Factorps__V1__TensorCreate *tcp[4] = {&tc[0], &tc[1], &tc[2], &tc[3]};
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.tensors = tcp;
  req.shard_count = 1;
#define RESET()                                                              \
  do {                                                                       \
    for (int i_ = 0; i_ < 4; i_++) {                                         \
      factorps__v1__tensor_create__init(&tc[i_]);                            \
      factorps__v1__tensor_slice__init(&sl[i_]);                             \
    }                                                                        \
    req.n_tensors = 0;                                                       \
    req.shard_id = 0;                                                        \
    req.shard_count = 1;                                                     \
  } while (0)
#define TC(i, nm, shp, opt)                         \
  do {                                              \
    tc[i].name = (char *)(nm);                      \
    tc[i].n_shape = sizeof(shp) / sizeof(shp)[0];   \
    tc[i].shape = shp;                              \
    tc[i].optimizer = opt;                          \
    if (req.n_tensors < (size_t)(i) + 1) req.n_tensors = (size_t)(i) + 1; \
  } while (0)
#define INIT(i, dt, ptr, nbytes, off)               \
  do {                                              \
    sl[i].dtype = dt;                               \
    sl[i].data.data = (uint8_t *)(ptr);             \
    sl[i].data.len = nbytes;                        \
    sl[i].offset = off;                             \
    tc[i].init = &sl[i];                            \
  } while (0)

  /* The fixture itself: existing tensors (idempotent / overlapping init). */
  RESET();
  TC(0, "w", s43, &hf);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 48, 0);
  TC(1, "b", s3, &torch);
  INIT(1, FACTORPS__V1__DTYPE__DTYPE_F32, F, 12, 0);
  TC(2, "half", s22, &torch);
  INIT(2, FACTORPS__V1__DTYPE__DTYPE_F32, F, 8, 2);
  put_msg(T, "fixture-complete-half", &req);
  /* A new tensor with every setting, its init in one f32 slice. */
  RESET();
  TC(0, "emb", s84, &full);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 128, 0);
  put_msg(T, "new-every-setting", &req);
  /* One tensor in two bf16 slices (two items, same name), with shape. */
  RESET();
  TC(0, "v", s5, &torch);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_BF16, BF, 4, 0);
  sl[0].n_shape = 1;
  sl[0].shape = s5;
  sl[0].name = "v";
  TC(1, "v", s5, &torch);
  INIT(1, FACTORPS__V1__DTYPE__DTYPE_BF16, BF, 6, 2);
  put_msg(T, "new-two-bf16-slices", &req);
  /* Without init values: created, not ready. */
  RESET();
  TC(0, "later", s84, &hf);
  put_msg(T, "new-no-init", &req);
  /* Existing name, other shape / other settings. */
  RESET();
  TC(0, "w", s34, &hf);
  put_msg(T, "exists-other-shape", &req);
  RESET();
  TC(0, "b", s3, &hf);
  put_msg(T, "exists-other-settings", &req);
  /* Settings the flavor lacks; no settings; a bad flavor. */
  RESET();
  full.flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  TC(0, "t", s3, &full);
  put_msg(T, "torch-with-hf-settings", &req);
  full.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  RESET();
  TC(0, "t", s3, NULL);
  put_msg(T, "no-optimizer", &req);
  /* Shapes: too big, too many dims, a scalar. */
  RESET();
  TC(0, "huge", shuge, &hf);
  put_msg(T, "shape-huge", &req);
  RESET();
  TC(0, "deep", s9d, &hf);
  put_msg(T, "shape-9-dims", &req);
  RESET();
  tc[0].name = "scalar";
  tc[0].optimizer = &torch;
  req.n_tensors = 1;
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 4, 0);
  put_msg(T, "scalar", &req);
  /* Bad init slices: NaN, out of range, odd byte count, other name. */
  RESET();
  TC(0, "n", s3, &torch);
  float nan3[3] = {1, NAN, 2};
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, nan3, 12, 0);
  put_msg(T, "init-nan", &req);
  RESET();
  TC(0, "n", s3, &torch);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 12, 2);
  put_msg(T, "init-out-of-range", &req);
  RESET();
  TC(0, "n", s3, &torch);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 7, 0);
  put_msg(T, "init-odd-bytes", &req);
  RESET();
  TC(0, "n", s3, &torch);
  INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 12, 0);
  sl[0].name = "other";
  put_msg(T, "init-other-name", &req);
  /* Bad names, wrong shard, empty request. */
  RESET();
  TC(0, "bad\xc3(", s3, &torch);
  put_msg(T, "name-bad-utf8", &req);
  RESET();
  TC(0, "", s3, &torch);
  put_msg(T, "name-empty", &req);
  RESET();
  TC(0, "x", s3, &torch);
  req.shard_id = 1;
  req.shard_count = 2;
  put_msg(T, "wrong-shard", &req);
  RESET();
  put_msg(T, "empty", &req);
  /* Resume at step 3 with the whole state (row 8, col 4), and replace "b"
   * at step 2 with its var state. */
  {
    Factorps__V1__StateSlice st[3], *stp[3];
    float pos[8] = {0.5f, 0.25f, 1.0f, 2.0f, 0.125f, 0.0f, 3.0f, 0.75f}; /* second moments >= 0 */
    for (int k = 0; k < 3; k++) factorps__v1__state_slice__init(&st[k]);
    st[0].kind = FACTORPS__V1__STATE_KIND__STATE_ROW;
    st[0].data.data = (uint8_t *)pos;
    st[0].data.len = 32;
    st[1].kind = FACTORPS__V1__STATE_KIND__STATE_COL;
    st[1].data.data = (uint8_t *)pos;
    st[1].data.len = 16;
    st[2].kind = FACTORPS__V1__STATE_KIND__STATE_VAR;
    st[2].data.data = (uint8_t *)pos;
    st[2].data.len = 12;
    for (int k = 0; k < 3; k++) stp[k] = &st[k];
    RESET();
    TC(0, "resumed", s84, &torch);
    INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 128, 0);
    tc[0].step = 3;
    tc[0].n_init_state = 2;
    tc[0].init_state = stp;
    put_msg(T, "resume-step-3", &req);
    RESET();
    TC(0, "b", s3, &torch);
    INIT(0, FACTORPS__V1__DTYPE__DTYPE_F32, F, 12, 0);
    tc[0].step = 2;
    tc[0].replace = true;
    tc[0].n_init_state = 1;
    tc[0].init_state = stp + 2;
    put_msg(T, "replace-b-step-2", &req);
    RESET();
  }
}

/* Create with SplitBlock maps: fuzz_create also sends every
 * input to shard 0 of 2 in sync mode with peers, where a good map makes a
 * block; the bad ones must be refused naming the field. */
static void seeds_create_split(void) {
  const char *T = "fuzz_create";
  Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
  hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
  static uint64_t s43[] = {4, 3}, s234[] = {2, 3, 4}, s8192[] = {8192}, b2[] = {0, 2, 4},
                  bspan[] = {0, 4, 6}, bdown[] = {0, 3, 2, 4}, bshort[] = {0, 2, 3},
                  bover[] = {0, UINT64_MAX, 4}, bwrap[] = {0, UINT64_MAX - 1, UINT64_MAX},
                  bzero[] = {0, 0, 4}, bone[] = {0, 4};
  static uint32_t sh2[] = {0, 1}, sh_dup[] = {0, 0}, sh_down[] = {1, 0}, sh_out[] = {0, 9}, sh3[] = {0, 1, 2};
  static uint64_t big_b[4098];
  static uint32_t big_s[4097];
  for (uint32_t i = 0; i < 4097; i++) big_s[i] = i;
  Factorps__V1__TensorSlice sl;
  Factorps__V1__SplitBlock sb;
  Factorps__V1__TensorCreate tc;
  Factorps__V1__TensorCreate *tcp[1] = {&tc};
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.tensors = tcp;
  req.n_tensors = 1;
  req.shard_id = 0;
  req.shard_count = 2;
  struct {
    const char *name;
    uint64_t *shape;
    size_t ndim;
    uint64_t *bounds;
    size_t nb;
    uint32_t *shards;
    size_t ns;
    uint32_t index, count;
    size_t init; /* elements of init, 0: none */
  } cases[] = {
      {"split-ok", s43, 2, b2, 3, sh2, 2, 0, 2, 6},
      {"split-span", s234, 3, bspan, 3, sh2, 2, 0, 2, 16},
      {"split-noinit", s43, 2, b2, 3, sh2, 2, 0, 2, 0},
      {"split-init-too-long", s43, 2, b2, 3, sh2, 2, 0, 2, 12},
      {"split-other-shard", s43, 2, b2, 3, sh2, 2, 1, 2, 6},
      {"split-count-3", s43, 2, b2, 3, sh2, 2, 0, 3, 6},
      {"split-bounds-down", s43, 2, bdown, 4, sh3, 3, 0, 2, 6},
      {"split-bounds-short", s43, 2, bshort, 3, sh2, 2, 0, 2, 6},
      {"split-bounds-overflow", s43, 2, bover, 3, sh2, 2, 0, 2, 6},
      {"split-bounds-wrap", s43, 2, bwrap, 3, sh2, 2, 0, 2, 6},
      {"split-bounds-empty-block", s43, 2, bzero, 3, sh2, 2, 0, 2, 0},
      {"split-one-block", s43, 2, bone, 2, sh2, 1, 0, 2, 12},
      {"split-shards-dup", s43, 2, b2, 3, sh_dup, 2, 0, 2, 6},
      {"split-shards-down", s43, 2, b2, 3, sh_down, 2, 0, 2, 6},
      {"split-shards-range", s43, 2, b2, 3, sh_out, 2, 0, 2, 6},
      {"split-shards-len", s43, 2, b2, 3, sh3, 3, 0, 2, 6},
      {"split-index-range", s43, 2, b2, 3, sh2, 2, 7, 2, 6},
      {"split-4096-blocks", s8192, 1, big_b, 4097, big_s, 4096, 0, 4096, 2},
      {"split-4097-blocks", s8192, 1, big_b, 4098, big_s, 4097, 0, 4097, 2},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    /* The large maps: blocks of 2 elements (4096) or 1 element for all but
     * the last (4097 blocks). */
    for (uint64_t i = 0; i < 4098; i++) big_b[i] = cases[c].nb == 4097 ? 2 * i : i < 4097 ? i : 8192;
    factorps__v1__tensor_slice__init(&sl);
    factorps__v1__split_block__init(&sb);
    factorps__v1__tensor_create__init(&tc);
    tc.name = (char *)cases[c].name;
    tc.n_shape = cases[c].ndim;
    tc.shape = cases[c].shape;
    tc.optimizer = &hf;
    if (cases[c].init) {
      sl.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
      sl.data.data = (uint8_t *)F;
      sl.data.len = cases[c].init * sizeof(float);
      tc.init = &sl;
    }
    sb.block_index = cases[c].index;
    sb.n_bounds = cases[c].nb;
    sb.bounds = cases[c].bounds;
    sb.n_block_shards = cases[c].ns;
    sb.block_shards = cases[c].shards;
    sb.shard_count = cases[c].count;
    tc.split = &sb;
    put_msg(T, cases[c].name, &req);
  }
}

/* -------------------------------------------------------- Pull, Stats */

static void seeds_pull(void) {
  const char *T = "fuzz_pull";
  char *names[3];
  Factorps__V1__PullRequest r = FACTORPS__V1__PULL_REQUEST__INIT;
  r.names = names;
  names[0] = "w";
  names[1] = "b";
  r.n_names = 2;
  put_msg(T, "w-b", &r);
  r.dtype = FACTORPS__V1__DTYPE__DTYPE_BF16;
  put_msg(T, "w-b-bf16", &r);
  r.dtype = 7;
  put_msg(T, "bad-dtype", &r);
  r.dtype = 0;
  names[0] = "half";
  r.n_names = 1;
  put_msg(T, "not-ready", &r);
  names[0] = "missing";
  put_msg(T, "not-found", &r);
  names[0] = "\xff";
  put_msg(T, "bad-utf8", &r);
  names[0] = "w";
  names[1] = "w";
  names[2] = "b";
  r.n_names = 3;
  put_msg(T, "repeated", &r);
  r.n_names = 0;
  put_msg(T, "empty", &r);
}

static void seeds_getstate(void) {
  const char *T = "fuzz_getstate";
  char *names[3];
  Factorps__V1__GetStateRequest r = FACTORPS__V1__GET_STATE_REQUEST__INIT;
  r.names = names;
  names[0] = "w";
  names[1] = "b";
  r.n_names = 2;
  put_msg(T, "w-b", &r);
  names[0] = "half";
  r.n_names = 1;
  put_msg(T, "not-ready", &r);
  names[0] = "missing";
  put_msg(T, "not-found", &r);
  names[0] = "w";
  names[1] = "b";
  names[2] = "w";
  r.n_names = 3;
  put_msg(T, "repeated", &r);
  r.n_names = 0;
  put_msg(T, "empty", &r);
}

static void seeds_stats(void) {
  const char *T = "fuzz_stats";
  Factorps__V1__StatsRequest r = FACTORPS__V1__STATS_REQUEST__INIT;
  put_msg(T, "shard-only", &r);
  r.include_tensors = true;
  put_msg(T, "tensors", &r);
  r.apply_log_limit = 2;
  put_msg(T, "tensors-log-2", &r);
  r.apply_log_limit = 0xffffffffu;
  put_msg(T, "tensors-log-max", &r);
}

/* ------------------------------------------------------------ PushPull */

typedef struct buf_s {
  uint8_t b[16384];
  size_t n;
} buf_t;

static void b_byte(buf_t *b, uint8_t v) { b->b[b->n++] = v; }

/* A message op for call k (op & 3 == 0). */
static void b_msg(buf_t *b, int k, const Factorps__V1__PushPullRequest *m) {
  size_t n = protobuf_c_message_get_packed_size((const ProtobufCMessage *)m);
  b_byte(b, (uint8_t)(k << 2));
  b_byte(b, (uint8_t)(n & 0xff));
  b_byte(b, (uint8_t)(n >> 8));
  protobuf_c_message_pack((const ProtobufCMessage *)m, b->b + b->n);
  b->n += n;
}
static void b_close(buf_t *b, int k) { b_byte(b, (uint8_t)(k << 2 | 1)); }
static void b_cancel(buf_t *b, int k) { b_byte(b, (uint8_t)(k << 2 | 2)); }

/* The config byte of fuzz_pushpull.c: mode 1 sync, 2 async, 3 ssp. */
static uint8_t cfg(int mode, int workers, int staleness) {
  return (uint8_t)((mode - 1) | (workers - 1) << 2 | staleness << 4);
}

/* One message with one slice of tensor nm. */
static void one(Factorps__V1__PushPullRequest *m, Factorps__V1__TensorSlice *s, Factorps__V1__TensorSlice **sp,
                const char *nm, uint64_t *shape, size_t nshape, int dtype, const void *data, size_t bytes,
                uint64_t off) {
  factorps__v1__tensor_slice__init(s);
  s->name = (char *)nm;
  s->shape = shape;
  s->n_shape = nshape;
  s->dtype = dtype;
  s->data.data = (uint8_t *)data;
  s->data.len = bytes;
  s->offset = off;
  *sp = s;
  m->grads = sp;
  m->n_grads = 1;
}

static void seeds_pushpull(void) {
  const char *T = "fuzz_pushpull";
  const int F32 = FACTORPS__V1__DTYPE__DTYPE_F32, BF16 = FACTORPS__V1__DTYPE__DTYPE_BF16;
  uint64_t s43[] = {4, 3}, s3[] = {3}, s22[] = {2, 2}, s34[] = {3, 4};
  Factorps__V1__PushPullRequest m = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  Factorps__V1__TensorSlice s[2], *sp[2];
  buf_t b;

  /* async: w whole, then half-close. */
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 48, 0);
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  put(T, "async-w", b.b, b.n);
  /* async: w in two slices over two messages, then b in bf16; skip_params. */
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 20, 0);
  b_msg(&b, 0, &m);
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 28, 5);
  b_msg(&b, 0, &m);
  one(&m, &s[0], &sp[0], "b", s3, 1, BF16, BF, 6, 0);
  m.skip_params = true;
  b_msg(&b, 0, &m);
  m.skip_params = false;
  b_close(&b, 0);
  put(T, "async-slices-bf16-skip", b.b, b.n);
  /* async: two slices of two tensors in one message. */
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 48, 0);
  factorps__v1__tensor_slice__init(&s[1]);
  s[1].name = "b";
  s[1].shape = s3;
  s[1].n_shape = 1;
  s[1].dtype = F32;
  s[1].data.data = (uint8_t *)F;
  s[1].data.len = 12;
  sp[1] = &s[1];
  m.n_grads = 2;
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  put(T, "async-two-tensors", b.b, b.n);
  /* sync, 2 workers: both push step 0 to w; the round completes. */
  b.n = 0;
  b_byte(&b, cfg(1, 2, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 48, 0);
  m.worker_id = 0;
  b_msg(&b, 0, &m);
  m.worker_id = 1;
  b_msg(&b, 1, &m);
  b_close(&b, 0);
  b_close(&b, 1);
  m.worker_id = 0;
  put(T, "sync-2-workers", b.b, b.n);
  /* Per-push settings: sync, 2 workers, lr/weight decay for w (worker 1
   * disagrees on lr), num_workers and expect_mode set. */
  {
    Factorps__V1__PushPullRequest__TensorPush tp = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__INIT, *tpp = &tp;
    tp.name = "w";
    tp.has_lr_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR;
    tp.lr = 0.05;
    tp.has_weight_decay_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_WEIGHT_DECAY_WEIGHT_DECAY;
    tp.weight_decay = 0.01;
    b.n = 0;
    b_byte(&b, cfg(1, 2, 0));
    one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 48, 0);
    m.tensors = &tpp;
    m.n_tensors = 1;
    m.num_workers = 2;
    m.expect_mode = FACTORPS__V1__MODE__MODE_SYNC;
    m.worker_id = 0;
    b_msg(&b, 0, &m);
    m.worker_id = 1;
    tp.lr = 0.5;
    b_msg(&b, 1, &m);
    b_close(&b, 0);
    b_close(&b, 1);
    put(T, "sync-tensor-push-disagree", b.b, b.n);
    /* async: w no_grad (settings only), b pushed at its own step 4. */
    Factorps__V1__PushPullRequest__TensorPush t2[2] = {FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__INIT,
                                                       FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__INIT};
    Factorps__V1__PushPullRequest__TensorPush *t2p[2] = {&t2[0], &t2[1]};
    t2[0].name = "w";
    t2[0].no_grad = true;
    t2[1].name = "b";
    t2[1].has_step_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_STEP_STEP;
    t2[1].step = 4;
    b.n = 0;
    b_byte(&b, cfg(2, 1, 0));
    one(&m, &s[0], &sp[0], "b", s3, 1, F32, F, 12, 0);
    m.tensors = t2p;
    m.n_tensors = 2;
    m.worker_id = 0;
    m.num_workers = 0;
    m.expect_mode = FACTORPS__V1__MODE__MODE_ASYNC;
    b_msg(&b, 0, &m);
    b_close(&b, 0);
    put(T, "async-no-grad-tensor-step", b.b, b.n);
    m.tensors = NULL;
    m.n_tensors = 0;
    m.expect_mode = 0;
  }
  /* sync, 2 workers: one pushes, then cancels while waiting. */
  b.n = 0;
  b_byte(&b, cfg(1, 2, 0));
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  b_cancel(&b, 0);
  put(T, "sync-cancel-waiting", b.b, b.n);
  /* sync, 1 worker: stale and ahead steps; duplicate in 2 calls. */
  b.n = 0;
  b_byte(&b, cfg(1, 1, 0));
  m.step = 3;
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  m.step = 0;
  put(T, "sync-ahead", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(1, 3, 0));
  b_msg(&b, 0, &m);
  b_msg(&b, 1, &m);
  b_close(&b, 0);
  b_close(&b, 1);
  put(T, "sync-duplicate-worker", b.b, b.n);
  /* ssp, 2 workers, staleness 0: worker 0 runs ahead and parks; worker 1
   * catches up and releases it. */
  b.n = 0;
  b_byte(&b, cfg(3, 2, 0));
  m.worker_id = 0;
  m.step = 1;
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  m.worker_id = 1;
  m.step = 0;
  b_msg(&b, 1, &m);
  b_close(&b, 1);
  m.worker_id = 0;
  put(T, "ssp-park-release", b.b, b.n);
  /* Errors: overlap, missing slice, NaN, unknown, not ready, wrong shape,
   * worker out of range, header change, bad dtype, odd bytes. */
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 20, 0);
  b_msg(&b, 0, &m);
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 20, 4);
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  put(T, "err-overlap", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 20, 0);
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  put(T, "err-missing", b.b, b.n);
  float nan[12] = {0, 0, 0, NAN};
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, nan, 48, 0);
  b_msg(&b, 0, &m);
  b_close(&b, 0);
  put(T, "err-nan", b.b, b.n);
  const char *bad_names[] = {"nope", "half", ""};
  const char *bad_files[] = {"err-unknown", "err-not-ready", "err-empty-name"};
  for (int i = 0; i < 3; i++) {
    b.n = 0;
    b_byte(&b, cfg(2, 1, 0));
    one(&m, &s[0], &sp[0], bad_names[i], s22, 2, F32, F, 16, 0);
    b_msg(&b, 0, &m);
    b_close(&b, 0);
    put(T, bad_files[i], b.b, b.n);
  }
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s34, 2, F32, F, 48, 0);
  b_msg(&b, 0, &m);
  put(T, "err-shape", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(1, 2, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 48, 0);
  m.worker_id = 5;
  b_msg(&b, 0, &m);
  m.worker_id = 0;
  put(T, "err-worker-range", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 20, 0);
  b_msg(&b, 0, &m);
  m.step = 9;
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 28, 5);
  b_msg(&b, 0, &m);
  m.step = 0;
  put(T, "err-header-change", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  one(&m, &s[0], &sp[0], "w", s43, 2, 9, F, 48, 0);
  b_msg(&b, 0, &m);
  one(&m, &s[0], &sp[0], "w", s43, 2, F32, F, 47, 0);
  b_msg(&b, 1, &m);
  put(T, "err-dtype-odd-bytes", b.b, b.n);
  /* Create first (config bit 6): a scalar and a 3-D tensor, then push to
   * both in one message. */
  {
    Factorps__V1__AdafactorConfig hf = FACTORPS__V1__ADAFACTOR_CONFIG__INIT;
    hf.flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF;
    uint64_t s234[] = {2, 3, 4};
    Factorps__V1__TensorSlice init[2];
    Factorps__V1__TensorCreate tc[2], *tcp[2] = {&tc[0], &tc[1]};
    const char *nm[2] = {"s", "cube"};
    for (int i = 0; i < 2; i++) {
      factorps__v1__tensor_slice__init(&init[i]);
      init[i].dtype = F32;
      init[i].data.data = (uint8_t *)F;
      init[i].data.len = i ? 96 : 4;
      factorps__v1__tensor_create__init(&tc[i]);
      tc[i].name = (char *)nm[i];
      tc[i].optimizer = &hf;
      tc[i].init = &init[i];
    }
    tc[1].shape = s234;
    tc[1].n_shape = 3;
    Factorps__V1__CreateRequest cr = FACTORPS__V1__CREATE_REQUEST__INIT;
    cr.tensors = tcp;
    cr.n_tensors = 2;
    cr.shard_count = 1;
    size_t n = protobuf_c_message_get_packed_size((const ProtobufCMessage *)&cr);
    b.n = 0;
    b_byte(&b, (uint8_t)(cfg(2, 1, 0) | 0x40));
    b_byte(&b, (uint8_t)(n & 0xff));
    b_byte(&b, (uint8_t)(n >> 8));
    protobuf_c_message_pack((const ProtobufCMessage *)&cr, b.b + b.n);
    b.n += n;
    one(&m, &s[0], &sp[0], "s", NULL, 0, F32, F, 4, 0);
    factorps__v1__tensor_slice__init(&s[1]);
    s[1].name = "cube";
    s[1].shape = s234;
    s[1].n_shape = 3;
    s[1].dtype = BF16;
    s[1].data.data = (uint8_t *)BF;
    s[1].data.len = 48;
    sp[1] = &s[1];
    m.n_grads = 2;
    b_msg(&b, 0, &m);
    b_close(&b, 0);
    put(T, "create-then-push", b.b, b.n);
  }
  /* Not a message at all; an empty stream. */
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  b_byte(&b, 0);
  b_byte(&b, 3);
  b_byte(&b, 0);
  b_byte(&b, 0xff);
  b_byte(&b, 0xff);
  b_byte(&b, 0xff);
  b_close(&b, 0);
  put(T, "err-malformed", b.b, b.n);
  b.n = 0;
  b_byte(&b, cfg(2, 1, 0));
  b_close(&b, 0);
  put(T, "empty-stream", b.b, b.n);
}

/* ---------------------------------------------------------------- HTTP */

static void http(const char *name, uint8_t opt, const char *req) {
  size_t n = strlen(req);
  uint8_t *p = malloc(n + 1);
  p[0] = opt;
  memcpy(p + 1, req, n);
  put("fuzz_http", name, p, n + 1);
  free(p);
}

static void seeds_http(void) {
  /* opt: bit 0 ready, bit 1 time out instead of EOF, bits 2-7 chunk/7 */
  http("get-metrics", 0, "GET /metrics HTTP/1.1\r\nHost: shard\r\nAccept: */*\r\n\r\n");
  http("get-metrics-chunked-reads", 1 << 2, "GET /metrics?x=1 HTTP/1.1\r\nHost: shard\r\n\r\n");
  http("head-healthz", 0, "HEAD /healthz HTTP/1.0\r\n\r\n");
  http("readyz-ready", 1, "GET /readyz HTTP/1.1\r\n\r\n");
  http("readyz-not-ready", 0, "GET /readyz HTTP/1.1\r\n\r\n");
  http("post-metrics", 0, "POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd");
  http("body-too-big", 0, "GET /metrics HTTP/1.1\r\nContent-Length: 5000\r\n\r\n");
  http("not-found", 0, "GET /nope HTTP/1.1\r\n\r\n");
  http("garbage", 0, "\x01\x02 / HTTP/9.9\r\n\r\n");
  http("incomplete-timeout", 2, "GET /metr");
  http("incomplete-eof", 0, "GET /metrics HTTP/1.1\r\nHost: sh");
  http("pipelined", 0, "GET /healthz HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n");
  char big[9000];
  int n = snprintf(big, sizeof big, "GET /");
  while (n < 1100) big[n++] = 'a';
  snprintf(big + n, sizeof big - (size_t)n, " HTTP/1.1\r\n\r\n");
  http("url-too-long", 3 << 2, big);
  n = snprintf(big, sizeof big, "GET /metrics HTTP/1.1\r\n");
  while (n < 8400) n += snprintf(big + n, sizeof big - (size_t)n, "X-Pad: %s\r\n", "0123456789abcdef");
  snprintf(big + n, sizeof big - (size_t)n, "\r\n");
  http("headers-too-big", 0, big);
}


/* -------------------------------------------------------------- wire */

/* One fuzz_wire input: the two cut-seed bytes, then the message bytes
 * (msg, n; raw when msg is not NULL), or m packed. */
static void put_wire(const char *name, uint16_t seed, const Factorps__V1__PushPullRequest *m, const uint8_t *raw,
                     size_t rn) {
  size_t n = m ? protobuf_c_message_get_packed_size(&m->base) : rn;
  uint8_t *p = malloc(n + 2);
  p[0] = (uint8_t)(seed >> 8);
  p[1] = (uint8_t)seed;
  if (m) protobuf_c_message_pack(&m->base, p + 2);
  else memcpy(p + 2, raw, rn);
  put("fuzz_wire", name, p, n + 2);
  free(p);
}

static void seeds_wire(void) {
  uint64_t s43[] = {4, 3}, s3[] = {3};
  Factorps__V1__PushPullRequest m = FACTORPS__V1__PUSH_PULL_REQUEST__INIT;
  Factorps__V1__TensorSlice s[2], *sp[2] = {&s[0], &s[1]};
  Factorps__V1__PushPullRequest__TensorPush tp = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__INIT, *tpp = &tp;
  for (int i = 0; i < 2; i++) factorps__v1__tensor_slice__init(&s[i]);
  s[0].name = "w";
  s[0].dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  s[0].shape = s43;
  s[0].n_shape = 2;
  s[0].offset = 2;
  s[0].data.data = (uint8_t *)F;
  s[0].data.len = 40;
  s[1].name = "b";
  s[1].dtype = FACTORPS__V1__DTYPE__DTYPE_BF16;
  s[1].shape = s3;
  s[1].n_shape = 1;
  s[1].data.data = (uint8_t *)BF;
  s[1].data.len = 6;
  tp.name = "w";
  tp.has_lr_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_LR_LR;
  tp.lr = 0.05;
  tp.has_step_case = FACTORPS__V1__PUSH_PULL_REQUEST__TENSOR_PUSH__HAS_STEP_STEP;
  tp.step = 7;
  m.worker_id = 3;
  m.step = 300;
  m.num_workers = 4;
  m.expect_mode = FACTORPS__V1__MODE__MODE_SYNC;
  m.push_id = UINT64_C(1) << 40;
  m.grads = sp;
  m.n_grads = 2;
  m.tensors = &tpp;
  m.n_tensors = 1;
  put_wire("full", 1, &m, NULL, 0);
  put_wire("full-other-cut", 0xbeef, &m, NULL, 0);
  m.n_tensors = 0;
  m.n_grads = 1;
  put_wire("one-slice", 7, &m, NULL, 0);
  /* Hand-made: fields out of order and repeated (the last wins), an
   * unpacked shape, an unknown field, then near misses. */
  static const uint8_t odd[] = {
      0x1a, 0x18,                   /* grads, 24 bytes: */
      0x2a, 0x04, 1, 2, 3, 4,       /*   data first */
      0x20, 0x01,                   /*   offset 1 */
      0x18, 0x04, 0x18, 0x03,       /*   shape 4, 3 unpacked */
      0x0a, 0x01, 'x', 0x0a, 0x01, 'w', /* name twice */
      0x10, 0x01,                   /*   dtype f32 */
      0x78, 0x05,                   /*   unknown field 15 */
      0x2a, 0x00,                   /*   data again, empty */
      0x08, 0x02,                   /* worker_id 2 after the slice */
      0x08, 0x01,                   /* and again: 1 wins */
  };
  put_wire("out-of-order", 3, NULL, odd, sizeof odd);
  put_wire("truncated", 3, NULL, odd, sizeof odd - 5);
  static const uint8_t wrong_type[] = {0x0d, 0, 0, 0, 0}; /* worker_id as fixed32 */
  put_wire("wrong-wire-type", 5, NULL, wrong_type, sizeof wrong_type);
  static const uint8_t bad_name[] = {0x1a, 0x04, 0x0a, 0x02, 'w', 0x01}; /* control character */
  put_wire("bad-name", 9, NULL, bad_name, sizeof bad_name);
  static const uint8_t long_varint[] = {0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  put_wire("long-varint", 11, NULL, long_varint, sizeof long_varint);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  outdir = argv[1];
  mkdir(outdir, 0755);
  for (int i = 0; i < 64; i++) {
    F[i] = 0.25f * (float)(i % 9) - 1.0f;
    uint32_t u;
    memcpy(&u, &F[i], 4);
    BF[i] = (uint16_t)(u >> 16);
  }
  seeds_create();
  seeds_create_split();
  seeds_pull();
  seeds_getstate();
  seeds_stats();
  seeds_pushpull();
  seeds_wire();
  seeds_http();
  return 0;
}

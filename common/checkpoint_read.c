/* Checkpoint reader: verification, loading, the newest-valid fallback and
 * listing. Every number read from a file is checked before it is used: a
 * hostile or damaged file is rejected with a reason, never trusted. */
#include "alloc.h"
#include "checkpoint_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sha256.h"

#define CHUNK ((size_t)1 << 20)

/* Fuzz builds (the libFuzzer/OSS-Fuzz convention) accept wrong digests, so
 * that mutated headers reach the parser instead of stopping at the hash. */
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
#define DIGEST_DIFFERS(a, b) ((void)(a), (void)(b), 0)
#else
#define DIGEST_DIFFERS(a, b) (strcmp((a), (b)) != 0)
#endif
#define MAX_EXACT 9007199254740992.0 /* 2^53: larger JSON numbers are not exact */

/* One array entry of the header. */
typedef struct entry_s {
  const char *key;                      /* in the cJSON tree */
  fps_shape_t shape;
  uint64_t begin, end;                  /* data_offsets */
  float *dest;                          /* load: where its bytes go */
  bool used;                            /* claimed by a tensor */
} entry_t;

/* One "tensor:<name>" of the metadata. */
typedef struct tmeta_s {
  const char *name;                     /* in the cJSON tree, after the prefix */
  fps_adafactor_hparams_t hp;
  uint64_t version, step;
  float rms;
  double last_lr, last_weight_decay;
  fps__ckpt_array_t arr[FPS__CKPT_KINDS];
  int n_arr;
  entry_t *ent[FPS__CKPT_KINDS];        /* the header entry of each array */
  fps_shape_t whole;                    /* a row block's whole shape */
  fps_ckpt_block_t map;                 /* n_blocks 0: whole; arrays owned until moved */
  fps_split_geom_t g;                   /* a row block's geometry */
} tmeta_t;

typedef struct reader_s {
  const char *path;
  int fd;
  uint64_t size;                        /* file size */
  uint8_t prefix[8];
  char *hdr;                            /* N bytes + NUL */
  uint64_t hlen;
  uint64_t data_bytes;
  cJSON *root;
  entry_t *e;
  size_t ne;
  tmeta_t *t;
  size_t nt;
  fps_ckpt_info_t info;
  char *why;
  size_t why_len;
} reader_t;

#define REJECT(r, code, ...)                    \
  do {                                          \
    fps__ckpt_why((r)->why, (r)->why_len, __VA_ARGS__); \
    return (code);                              \
  } while (0)

static int read_at(int fd, void *buf, size_t len, uint64_t off, size_t *got) {
  char *p = buf;
  *got = 0;
  while (len) {
    ssize_t n = pread(fd, p, len, (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return FPS_EIO;
    }
    if (n == 0) break;
    p += n;
    off += (uint64_t)n;
    len -= (size_t)n;
    *got += (size_t)n;
  }
  return 0;
}

static bool is_hex64(const char *s) {
  size_t i = 0;
  for (; s[i]; i++)
    if (i >= FPS_SHA256_HEX_LEN || !((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return false;
  return i == FPS_SHA256_HEX_LEN;
}

/* A JSON number that is a whole number in [0, 2^53]. */
static bool json_u53(const cJSON *n, uint64_t *out) {
  if (!cJSON_IsNumber(n)) return false;
  double d = n->valuedouble;
  if (!isfinite(d) || d < 0 || d > MAX_EXACT || floor(d) != d) return false;
  *out = (uint64_t)d;
  return true;
}

/* ------------------------------------------------------------ header */

static int read_header(reader_t *r) {
  size_t got;
  if (r->size < 8)
    REJECT(r, FPS_EFORMAT, "truncated: %" PRIu64 " bytes, shorter than the 8-byte header length",
           r->size);
  if (read_at(r->fd, r->prefix, 8, 0, &got) < 0 || got != 8)
    REJECT(r, FPS_EIO, "read: %s", got != 8 ? "short read" : strerror(errno));
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | r->prefix[i];
  if (n < 2 || n > FPS_CKPT_HEADER_MAX)
    REJECT(r, FPS_EFORMAT, "header length %" PRIu64 " is outside 2..%" PRIu64, n,
           FPS_CKPT_HEADER_MAX);
  if (n > r->size - 8)
    REJECT(r, FPS_EFORMAT, "truncated: the header needs %" PRIu64 " bytes, the file has %" PRIu64,
           8 + n, r->size);
  if ((8 + n) % 8 != 0)
    REJECT(r, FPS_EFORMAT, "header length %" PRIu64 " leaves the data section unaligned", n);
  r->hdr = fps_malloc((size_t)n + 1);
  if (!r->hdr) REJECT(r, FPS_ENOMEM, "out of memory for a %" PRIu64 "-byte header", n);
  if (read_at(r->fd, r->hdr, (size_t)n, 8, &got) < 0)
    REJECT(r, FPS_EIO, "read: %s", strerror(errno));
  if (got != n) REJECT(r, FPS_EFORMAT, "truncated while reading the header");
  r->hdr[n] = '\0';
  r->hlen = n;
  r->data_bytes = r->size - 8 - n;
  if (memchr(r->hdr, '\0', (size_t)n)) REJECT(r, FPS_EFORMAT, "header contains a NUL byte");
  if (r->hdr[0] != '{') REJECT(r, FPS_EFORMAT, "header does not start with '{'");
  const char *end = NULL;
  fps__ckpt_json_init();
  r->root = cJSON_ParseWithLengthOpts(r->hdr, (size_t)n, &end, false);
  if (!r->root) {
    size_t at = end && end >= r->hdr && end <= r->hdr + n ? (size_t)(end - r->hdr) : 0;
    REJECT(r, FPS_EFORMAT, "header is not valid JSON (near byte %zu)", at);
  }
  if (!cJSON_IsObject(r->root)) REJECT(r, FPS_EFORMAT, "header is not a JSON object");
  for (const char *p = end; p < r->hdr + n; p++)
    if (*p != ' ') REJECT(r, FPS_EFORMAT, "bytes after the header's JSON object are not spaces");
  return 0;
}

/* The header digest: SHA-256 of the prefix and header with the digest's own
 * 64 hex digits replaced by '0's. */
static int check_header_digest(reader_t *r, const char *want) {
  char pat[96];
  snprintf(pat, sizeof pat, "\"header_sha256\":\"%s\"", want);
  const char *at = strstr(r->hdr, pat);
  if (!at || strstr(at + 1, pat))
    REJECT(r, FPS_EFORMAT, "corrupted: header_sha256 is not where the writer puts it");
  size_t pos = (size_t)(at - r->hdr) + strlen("\"header_sha256\":\"");
  static const char zeros[FPS_SHA256_HEX_LEN] = {
      '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0',
      '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0',
      '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0',
      '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0', '0'};
  fps_sha256_t *h = NULL;
  int rc = fps_sha256_create(&h);
  if (rc < 0) REJECT(r, rc, "SHA-256 unavailable: %s", fps_strerror(rc));
  uint8_t dig[FPS_SHA256_LEN];
  rc = fps_sha256_update(h, r->prefix, 8);
  if (rc == 0) rc = fps_sha256_update(h, r->hdr, pos);
  if (rc == 0) rc = fps_sha256_update(h, zeros, sizeof zeros);
  if (rc == 0) rc = fps_sha256_update(h, r->hdr + pos + 64, (size_t)r->hlen - pos - 64);
  if (rc == 0) rc = fps_sha256_final(h, dig);
  fps_sha256_destroy(h);
  if (rc < 0) REJECT(r, rc, "SHA-256 failed");
  char hex[FPS_SHA256_HEX_LEN + 1];
  fps_sha256_hex(dig, hex);
  if (DIGEST_DIFFERS(hex, want))
    REJECT(r, FPS_EFORMAT, "corrupted: header SHA-256 is %s, the file says %s", hex, want);
  return 0;
}

static int entry_key_cmp(const void *a, const void *b) {
  return strcmp(((const entry_t *)a)->key, ((const entry_t *)b)->key);
}

static int entry_begin_cmp(const void *a, const void *b) {
  const entry_t *const *x = a, *const *y = b;
  if ((*x)->begin != (*y)->begin) return (*x)->begin < (*y)->begin ? -1 : 1;
  return 0;
}

static int parse_entry(reader_t *r, const cJSON *it, entry_t *e) {
  const cJSON *dtype = NULL, *shape = NULL, *offs = NULL;
  if (!cJSON_IsObject(it)) REJECT(r, FPS_EFORMAT, "header entry \"%.300s\" is not an object", it->string);
  for (const cJSON *f = it->child; f; f = f->next) {
    const cJSON **slot = strcmp(f->string, "dtype") == 0          ? &dtype
                         : strcmp(f->string, "shape") == 0        ? &shape
                         : strcmp(f->string, "data_offsets") == 0 ? &offs
                                                                  : NULL;
    if (!slot || *slot)
      REJECT(r, FPS_EFORMAT, "header entry \"%.300s\" has an unknown or duplicate field \"%.40s\"",
             it->string, f->string);
    *slot = f;
  }
  if (!dtype || !shape || !offs)
    REJECT(r, FPS_EFORMAT, "header entry \"%.300s\" lacks dtype, shape or data_offsets", it->string);
  if (!cJSON_IsString(dtype) || strcmp(dtype->valuestring, "F32") != 0)
    REJECT(r, FPS_EFORMAT, "header entry \"%.300s\" is not F32", it->string);
  if (!cJSON_IsArray(shape)) REJECT(r, FPS_EFORMAT, "shape of \"%.300s\" is not an array", it->string);
  e->key = it->string;
  e->shape.ndim = 0;
  for (const cJSON *d = shape->child; d; d = d->next) {
    uint64_t v;
    if (e->shape.ndim == FPS_MAX_DIMS)
      REJECT(r, FPS_EFORMAT, "shape of \"%.300s\" has more than %d dimensions", it->string,
             FPS_MAX_DIMS);
    if (!json_u53(d, &v) || v == 0)
      REJECT(r, FPS_EFORMAT, "shape of \"%.300s\" has a dimension that is not a positive integer",
             it->string);
    e->shape.dim[e->shape.ndim++] = v;
  }
  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_u53(offs->child, &e->begin) ||
      !json_u53(offs->child->next, &e->end))
    REJECT(r, FPS_EFORMAT, "data_offsets of \"%.300s\" are not two non-negative integers", it->string);
  if (e->begin > e->end || e->end > r->data_bytes) {
    if (e->end > r->data_bytes && e->begin <= e->end)
      REJECT(r, FPS_EFORMAT,
             "truncated: \"%.300s\" ends at data byte %" PRIu64 ", the data section has %" PRIu64,
             it->string, e->end, r->data_bytes);
    REJECT(r, FPS_EFORMAT, "data_offsets of \"%.300s\" are out of order", it->string);
  }
  return 0;
}

static bool shape_eq(const fps_shape_t *a, const fps_shape_t *b) {
  if (a->ndim != b->ndim) return false;
  for (uint32_t i = 0; i < a->ndim; i++)
    if (a->dim[i] != b->dim[i]) return false;
  return true;
}

enum {
#define MK_ENUM(k) MK_##k,
  FPS__CKPT_META_KEYS(MK_ENUM)
#undef MK_ENUM
  MK_COUNT
};
static const char *const mk_names[MK_COUNT] = {
#define MK_NAME(k) #k,
    FPS__CKPT_META_KEYS(MK_NAME)
#undef MK_NAME
};

static int parse_u32(const char *s, uint32_t *out) {
  uint64_t v;
  if (fps__ckpt_parse_u64(s, &v) < 0 || v > UINT32_MAX) return FPS_EFORMAT;
  *out = (uint32_t)v;
  return 0;
}

/* Everything but the data: metadata, entries, their layout. */
static int parse_structure(reader_t *r) {
  const cJSON *meta = NULL;
  size_t n_items = 0;
  for (const cJSON *it = r->root->child; it; it = it->next) n_items++;
  r->e = fps_calloc(n_items ? n_items : 1, sizeof *r->e);
  if (!r->e) REJECT(r, FPS_ENOMEM, "out of memory for %zu header entries", n_items);

  for (const cJSON *it = r->root->child; it; it = it->next) {
    if (strcmp(it->string, "__metadata__") == 0) {
      if (meta) REJECT(r, FPS_EFORMAT, "two __metadata__ entries");
      meta = it;
      continue;
    }
    int rc = parse_entry(r, it, &r->e[r->ne]);
    if (rc < 0) return rc;
    r->ne++;
  }
  if (!meta || !cJSON_IsObject(meta)) REJECT(r, FPS_EFORMAT, "no __metadata__ object: not a factorps checkpoint");
  /* Sized by the metadata, not the entries: a hostile file may describe
   * more tensors than it has arrays. */
  size_t n_meta = 0;
  for (const cJSON *it = meta->child; it; it = it->next) n_meta++;
  r->t = fps_calloc(n_meta ? n_meta : 1, sizeof *r->t);
  if (!r->t) REJECT(r, FPS_ENOMEM, "out of memory for %zu metadata entries", n_meta);

  /* Metadata: the fixed keys once each, then "tensor:<name>" keys. */
  const char *val[MK_COUNT] = {0};
  for (const cJSON *it = meta->child; it; it = it->next) {
    if (!cJSON_IsString(it))
      REJECT(r, FPS_EFORMAT, "metadata \"%.300s\" is not a string", it->string);
    if (strncmp(it->string, FPS__CKPT_TENSOR_PREFIX, strlen(FPS__CKPT_TENSOR_PREFIX)) == 0) {
      tmeta_t *t = &r->t[r->nt];
      t->name = it->string + strlen(FPS__CKPT_TENSOR_PREFIX);
      char nwhy[160];
      if (fps__ckpt_name_check(t->name, strlen(t->name), nwhy, sizeof nwhy) < 0)
        REJECT(r, FPS_EFORMAT, "metadata \"%.300s\": %s", it->string, nwhy);
      char twhy[256];
      int mrc = fps__ckpt_tensor_meta_parse(it->valuestring, &t->hp, &t->version, &t->step,
                                            &t->rms, &t->last_lr, &t->last_weight_decay,
                                            &t->whole, &t->map, twhy, sizeof twhy);
      if (mrc < 0)
        REJECT(r, mrc == FPS_ENOMEM ? FPS_ENOMEM : FPS_EFORMAT, "tensor \"%s\": %s", t->name, twhy);
      r->nt++;
      continue;
    }
    if (strcmp(it->string, FPS__CKPT_META_KEY_JOB) == 0) {
      if (r->info.shard.job_id[0]) REJECT(r, FPS_EFORMAT, "duplicate metadata key \"%s\"", it->string);
      if (fps_ckpt_job_check(it->valuestring) < 0)
        REJECT(r, FPS_EFORMAT, "bad job_id \"%.80s\"", it->valuestring);
      snprintf(r->info.shard.job_id, sizeof r->info.shard.job_id, "%s", it->valuestring);
      continue;
    }
    int k = 0;
    while (k < MK_COUNT && strcmp(it->string, mk_names[k]) != 0) k++;
    if (k == MK_COUNT) REJECT(r, FPS_EFORMAT, "unknown metadata key \"%.300s\"", it->string);
    if (val[k]) REJECT(r, FPS_EFORMAT, "duplicate metadata key \"%s\"", mk_names[k]);
    val[k] = it->valuestring;
  }
  for (int k = 0; k < MK_COUNT; k++)
    if (!val[k]) REJECT(r, FPS_EFORMAT, "incomplete: metadata lacks \"%s\"", mk_names[k]);

  if (strcmp(val[MK_format], FPS_CKPT_FORMAT) != 0)
    REJECT(r, FPS_EFORMAT, "format is \"%.64s\", not \"%s\"", val[MK_format], FPS_CKPT_FORMAT);
  uint64_t fv;
  if (fps__ckpt_parse_u64(val[MK_format_version], &fv) < 0 ||
      fv < FPS_CKPT_FORMAT_VERSION_WHOLE || fv > FPS_CKPT_FORMAT_VERSION)
    REJECT(r, FPS_EFORMAT, "format_version \"%.32s\" is not supported (this build reads %d to %d)",
           val[MK_format_version], FPS_CKPT_FORMAT_VERSION_WHOLE, FPS_CKPT_FORMAT_VERSION);
  fps_ckpt_info_t *info = &r->info;
  info->format_version = (uint32_t)fv;
  if (parse_u32(val[MK_shard_id], &info->shard.shard_id) < 0 ||
      parse_u32(val[MK_shard_count], &info->shard.shard_count) < 0 ||
      info->shard.shard_count == 0 || info->shard.shard_id >= info->shard.shard_count)
    REJECT(r, FPS_EFORMAT, "bad shard placement \"%.24s\"/\"%.24s\"", val[MK_shard_id],
           val[MK_shard_count]);
  if (fps__ckpt_mode_check(val[MK_mode]) < 0)
    REJECT(r, FPS_EFORMAT, "bad mode \"%.40s\"", val[MK_mode]);
  snprintf(info->shard.mode, sizeof info->shard.mode, "%s", val[MK_mode]);
  if (fps__ckpt_parse_u64(val[MK_sequence], &info->seq) < 0)
    REJECT(r, FPS_EFORMAT, "bad sequence \"%.32s\"", val[MK_sequence]);
  size_t clen = strlen(val[MK_created]);
  if (clen == 0 || clen >= sizeof info->created)
    REJECT(r, FPS_EFORMAT, "bad creation time (%zu bytes)", clen);
  for (size_t i = 0; i < clen; i++)
    if (val[MK_created][i] < 0x21 || val[MK_created][i] > 0x7e)
      REJECT(r, FPS_EFORMAT, "creation time is not printable ASCII");
  memcpy(info->created, val[MK_created], clen + 1);
  uint64_t count;
  if (fps__ckpt_parse_u64(val[MK_tensor_count], &count) < 0 || count != r->nt)
    REJECT(r, FPS_EFORMAT, "incomplete: tensor_count \"%.24s\" but %zu tensors described",
           val[MK_tensor_count], r->nt);
  if (!is_hex64(val[MK_data_sha256])) REJECT(r, FPS_EFORMAT, "data_sha256 is not 64 hex digits");
  memcpy(info->data_sha256, val[MK_data_sha256], sizeof info->data_sha256);
  info->tensors = r->nt;
  info->data_bytes = r->data_bytes;
  info->file_bytes = r->size;

  /* The file name's sequence number must be the one written inside, so a
   * renamed or copied file cannot jump the queue. */
  const char *base = strrchr(r->path, '/');
  base = base ? base + 1 : r->path;
  uint64_t name_seq;
  if (fps__ckpt_name_seq(base, &name_seq) && name_seq != info->seq)
    REJECT(r, FPS_EFORMAT, "file name says sequence %" PRIu64 ", the header says %" PRIu64,
           name_seq, info->seq);

  /* Each tensor claims exactly its arrays, with exactly their shapes. */
  if (r->ne) qsort(r->e, r->ne, sizeof *r->e, entry_key_cmp);
  for (size_t i = 1; i < r->ne; i++)
    if (strcmp(r->e[i - 1].key, r->e[i].key) == 0)
      REJECT(r, FPS_EFORMAT, "duplicate header entry \"%.300s\"", r->e[i].key);
  for (size_t i = 0; i < r->nt; i++) {
    tmeta_t *t = &r->t[i];
    char lwhy[200];
    /* The weights entry gives the tensor's shape, the rest follows. */
    entry_t probe = {.key = t->name};
    entry_t *pe = r->ne ? bsearch(&probe, r->e, r->ne, sizeof *r->e, entry_key_cmp) : NULL;
    if (!pe) REJECT(r, FPS_EFORMAT, "incomplete: no weights entry for tensor \"%s\"", t->name);
    int n;
    if (t->map.n_blocks) {
      /* A row block: the map gives the arrays' shapes, checked below like
       * any other entry's. */
      if (info->format_version < 2)
        REJECT(r, FPS_EFORMAT, "tensor \"%s\" is a row block, which format_version 1 cannot hold",
               t->name);
      if (fps_ckpt_block_check(&t->whole, &t->map, info->shard.shard_id, info->shard.shard_count,
                               lwhy, sizeof lwhy) < 0)
        REJECT(r, FPS_EFORMAT, "tensor \"%s\": bad block map: %s", t->name, lwhy);
      if (fps_split_geom_init(&t->g, &t->whole, t->map.bounds[t->map.block_index],
                              t->map.bounds[t->map.block_index + 1], lwhy, sizeof lwhy) < 0)
        REJECT(r, FPS_EFORMAT, "tensor \"%s\": %s", t->name, lwhy);
      n = fps__ckpt_block_layout(&t->g, &t->hp, t->arr, lwhy, sizeof lwhy);
      info->blocks++;
    } else {
      n = fps__ckpt_layout(&pe->shape, &t->hp, t->arr, lwhy, sizeof lwhy);
    }
    if (n < 0) REJECT(r, FPS_EFORMAT, "tensor \"%s\": %s", t->name, lwhy);
    t->n_arr = n;
    for (int j = 0; j < n; j++) {
      char key[FPS_CKPT_NAME_MAX + 8];
      snprintf(key, sizeof key, "%s%s", t->name, fps__ckpt_suffix(t->arr[j].kind));
      probe.key = key;
      entry_t *e = bsearch(&probe, r->e, r->ne, sizeof *r->e, entry_key_cmp);
      if (!e) REJECT(r, FPS_EFORMAT, "incomplete: no \"%s\" entry", key);
      if (e->used)
        REJECT(r, FPS_EFORMAT, "entry \"%s\" is claimed twice (tensor listed twice or names collide)",
               key);
      if (!shape_eq(&e->shape, &t->arr[j].shape))
        REJECT(r, FPS_EFORMAT, "entry \"%s\" has the wrong shape for its tensor", key);
      if (e->end - e->begin != t->arr[j].count * 4)
        REJECT(r, FPS_EFORMAT, "entry \"%s\": %" PRIu64 " bytes for %" PRIu64 " floats", key,
               e->end - e->begin, t->arr[j].count);
      e->used = true;
      t->ent[j] = e;
    }
  }
  for (size_t i = 0; i < r->ne; i++)
    if (!r->e[i].used)
      REJECT(r, FPS_EFORMAT, "header entry \"%.300s\" belongs to no tensor", r->e[i].key);
  return 0;
}

/* Arrays must tile the data section exactly: from 0, no gaps, no overlap,
 * up to its end (as safetensors itself requires). Returns the entries in
 * data order in *order (malloc'd). */
static int check_tiling(reader_t *r, entry_t ***order) {
  entry_t **o = fps_malloc((r->ne ? r->ne : 1) * sizeof *o);
  if (!o) REJECT(r, FPS_ENOMEM, "out of memory");
  for (size_t i = 0; i < r->ne; i++) o[i] = &r->e[i];
  if (r->ne) qsort(o, r->ne, sizeof *o, entry_begin_cmp);
  uint64_t at = 0;
  for (size_t i = 0; i < r->ne; i++) {
    if (o[i]->begin != at) {
      fps__ckpt_why(r->why, r->why_len, "arrays %s at data byte %" PRIu64,
                    o[i]->begin > at ? "leave a gap" : "overlap", at);
      fps_free(o);
      return FPS_EFORMAT;
    }
    at = o[i]->end;
  }
  if (at != r->data_bytes) {
    fps_free(o);
    REJECT(r, FPS_EFORMAT, "%" PRIu64 " bytes after the last array (data section %" PRIu64 ")",
           r->data_bytes - at, r->data_bytes);
  }
  *order = o;
  return 0;
}

/* Reads the data section in order, into each entry's dest (or a scratch
 * buffer when verifying), and checks its SHA-256. */
static int read_data(reader_t *r, entry_t **order) {
  char *scratch = NULL;
  fps_sha256_t *h = NULL;
  int rc = fps_sha256_create(&h);
  if (rc < 0) REJECT(r, rc, "SHA-256 unavailable");
  uint64_t off = 8 + r->hlen;
  for (size_t i = 0; i < r->ne && rc == 0; i++) {
    char *dst = (char *)order[i]->dest;
    uint64_t left = order[i]->end - order[i]->begin;
    if (!dst && left && !scratch && !(scratch = fps_malloc(CHUNK))) {
      rc = FPS_ENOMEM;
      fps__ckpt_why(r->why, r->why_len, "out of memory");
      break;
    }
    while (left && rc == 0) {
      size_t c = left < CHUNK ? (size_t)left : CHUNK;
      char *buf = dst ? dst : scratch;
      size_t got;
      if (read_at(r->fd, buf, c, off, &got) < 0) {
        rc = FPS_EIO;
        fps__ckpt_why(r->why, r->why_len, "read: %s", strerror(errno));
      } else if (got != c) {
        rc = FPS_EFORMAT;
        fps__ckpt_why(r->why, r->why_len, "truncated while reading (the file shrank)");
      } else {
        rc = fps_sha256_update(h, buf, c);
      }
      off += c;
      left -= c;
      if (dst) dst += c;
    }
  }
  uint8_t dig[FPS_SHA256_LEN];
  if (rc == 0 && (rc = fps_sha256_final(h, dig)) == 0) {
    char hex[FPS_SHA256_HEX_LEN + 1];
    fps_sha256_hex(dig, hex);
    if (DIGEST_DIFFERS(hex, r->info.data_sha256)) {
      rc = FPS_EFORMAT;
      fps__ckpt_why(r->why, r->why_len, "corrupted: data SHA-256 is %s, the header says %s", hex,
                    r->info.data_sha256);
    }
  }
  fps_sha256_destroy(h);
  fps_free(scratch);
  return rc;
}

void fps_ckpt_destroy(fps_ckpt_t *c) {
  if (!c) return;
  for (size_t i = 0; i < c->n_tensors; i++) {
    fps_free(c->tensors[i].param);
    fps_adafactor_state_destroy(&c->tensors[i].state);
    fps_split_state_destroy(&c->tensors[i].bstate);
    fps__ckpt_block_free(&c->tensors[i].block);
  }
  fps_free(c->tensors);
  fps_free(c);
}

/* Allocates the result and points every entry at its destination. */
static int alloc_result(reader_t *r, fps_ckpt_t **out) {
  fps_ckpt_t *c = fps_calloc(1, sizeof *c);
  if (!c || !(c->tensors = fps_calloc(r->nt ? r->nt : 1, sizeof *c->tensors))) {
    fps_free(c);
    REJECT(r, FPS_ENOMEM, "out of memory");
  }
  snprintf(c->path, sizeof c->path, "%s", r->path);
  for (size_t i = 0; i < r->nt; i++) {
    tmeta_t *t = &r->t[i];
    fps_ckpt_tensor_t *ct = &c->tensors[i];
    c->n_tensors = i + 1;
    snprintf(ct->name, sizeof ct->name, "%s", t->name);
    ct->hparams = t->hp;
    ct->version = t->version;
    ct->last_lr = t->last_lr;
    ct->last_weight_decay = t->last_weight_decay;
    const bool block = t->map.n_blocks != 0;
    int rc = block ? fps_split_state_init(&ct->bstate, &t->g, &t->hp)
                   : fps_adafactor_state_init(&ct->state, &t->arr[0].shape, &t->hp);
    void *p = NULL;
    if (rc == 0 && fps_aligned_alloc(&p, 64, (size_t)t->arr[0].count * sizeof(float)) != 0)
      rc = FPS_ENOMEM;
    if (rc < 0) {
      fps_ckpt_destroy(c);
      REJECT(r, rc, "tensor \"%s\": cannot allocate its state: %s", t->name, fps_strerror(rc));
    }
    ct->param = p;
    ct->state.step = t->step;
    ct->state.rms = t->rms;
    if (block) {
      ct->bstate.step = t->step;
      ct->bstate.rms = t->rms;
      ct->block = t->map; /* moved: the reader's cleanup skips it */
      memset(&t->map, 0, sizeof t->map);
    }
    for (int j = 0; j < t->n_arr; j++) {
      float *dst = j == 0 ? ct->param
                   : block ? fps__ckpt_split_array(&ct->bstate, t->arr[j].kind)
                           : fps__ckpt_state_array(&ct->state, t->arr[j].kind);
      if (!dst) {
        fps_ckpt_destroy(c);
        REJECT(r, FPS_ESTATE, "internal: kernel state of \"%s\" lacks %s", t->name,
               fps__ckpt_suffix(t->arr[j].kind));
      }
      t->ent[j]->dest = dst;
    }
  }
  *out = c;
  return 0;
}

static int read_file(const char *path, const fps_ckpt_expect_t *expect, fps_ckpt_t **load,
                     fps_ckpt_info_t *info, char *why, size_t why_len) {
  reader_t r;
  memset(&r, 0, sizeof r);
  r.path = path;
  r.why = why;
  r.why_len = why_len;
  r.fd = -1;
  entry_t **order = NULL;
  fps_ckpt_t *c = NULL;
  int rc;
  if (why && why_len) why[0] = '\0';
  if (!path) {
    fps__ckpt_why(why, why_len, "no path");
    return FPS_EINVAL;
  }
  /* O_NONBLOCK: opening a FIFO planted under a checkpoint's name must not
   * block the loader (regular files ignore the flag). */
  r.fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (r.fd < 0) {
    rc = errno == ENOENT ? FPS_ENOTFOUND : FPS_EIO;
    fps__ckpt_why(why, why_len, "open: %s", strerror(errno));
    goto fail;
  }
  struct stat st;
  if (fstat(r.fd, &st) < 0) {
    rc = FPS_EIO;
    fps__ckpt_why(why, why_len, "stat: %s", strerror(errno));
    goto fail;
  }
  if (!S_ISREG(st.st_mode)) {
    rc = FPS_EFORMAT;
    fps__ckpt_why(why, why_len, "not a regular file");
    goto fail;
  }
  r.size = (uint64_t)st.st_size;
  if ((rc = read_header(&r)) < 0) goto fail;

  /* The header digest first: if the header was damaged, say so rather
   * than report whatever field the damage happened to hit. */
  const cJSON *meta = cJSON_GetObjectItemCaseSensitive(r.root, "__metadata__");
  const cJSON *hd = cJSON_GetObjectItemCaseSensitive(meta, "header_sha256");
  if (!cJSON_IsString(hd) || !is_hex64(hd->valuestring)) {
    rc = FPS_EFORMAT;
    fps__ckpt_why(why, why_len, "incomplete: no header_sha256 in __metadata__");
    goto fail;
  }
  if ((rc = check_header_digest(&r, hd->valuestring)) < 0) goto fail;
  if ((rc = parse_structure(&r)) < 0) goto fail;
  if ((rc = check_tiling(&r, &order)) < 0) goto fail;

  if (expect) {
    const fps_ckpt_shard_t *s = &r.info.shard;
    if (s->shard_id != expect->shard_id || s->shard_count != expect->shard_count) {
      rc = FPS_ESTATE;
      fps__ckpt_why(why, why_len, "mismatched: written by shard %u of %u, this is shard %u of %u",
                    s->shard_id, s->shard_count, expect->shard_id, expect->shard_count);
      goto fail;
    }
    if (expect->mode && strcmp(expect->mode, s->mode) != 0) {
      rc = FPS_ESTATE;
      fps__ckpt_why(why, why_len, "mismatched: written in mode %s, this shard runs %s", s->mode,
                    expect->mode);
      goto fail;
    }
    /* Another job's volume, reused: its state is not this job's. */
    if (expect->job_id && *expect->job_id && s->job_id[0] && strcmp(expect->job_id, s->job_id) != 0) {
      rc = FPS_ESTATE;
      fps__ckpt_why(why, why_len, "mismatched: written for job '%s', this shard serves job '%s'", s->job_id,
                    expect->job_id);
      goto fail;
    }
  }
  if (load && (rc = alloc_result(&r, &c)) < 0) goto fail;
  if ((rc = read_data(&r, order)) < 0) goto fail;

  if (info) *info = r.info;
  if (load) {
    c->info = r.info;
    *load = c;
    c = NULL;
  }
  rc = 0;
fail:
  fps_ckpt_destroy(c);
  fps_free(order);
  fps_free(r.e);
  for (size_t i = 0; r.t && i < r.nt; i++) fps__ckpt_block_free(&r.t[i].map);
  fps_free(r.t);
  cJSON_Delete(r.root);
  fps_free(r.hdr);
  if (r.fd >= 0) close(r.fd);
  return rc;
}

int fps_ckpt_verify_file(const char *path, const fps_ckpt_expect_t *expect,
                         fps_ckpt_info_t *info, char *why, size_t why_len) {
  return read_file(path, expect, NULL, info, why, why_len);
}

/* One loaded array: every value finite, and >= 0 where it is a second
 * moment (a file written by a shard never holds anything else, since the
 * shard refuses non-finite gradients; a file that does was damaged or made
 * elsewhere, with its digests recomputed). 0 or FPS_EFORMAT naming the
 * tensor, the array and the element. */
static int check_values(const char *name, const char *what, const float *a, uint64_t n, bool moment,
                        char *why, size_t why_len) {
  for (uint64_t i = 0; a && i < n; i++) {
    if (isfinite(a[i]) && !(moment && a[i] < 0)) continue;
    fps__ckpt_why(why, why_len, "tensor \"%s\": %s element %" PRIu64 " is %g (%s)", name, what, i, (double)a[i],
                  isfinite(a[i]) ? "a second moment cannot be negative" : "not finite");
    return FPS_EFORMAT;
  }
  return 0;
}

static int check_tensor(const fps_ckpt_tensor_t *t, char *why, size_t why_len) {
  int rc;
  if (t->block.n_blocks) {
    const fps_split_state_t *s = &t->bstate;
    const fps_split_geom_t *g = &s->g;
    if ((rc = check_values(t->name, "the weights'", t->param, g->block_numel, false, why, why_len)) < 0 ||
        (rc = check_values(t->name, "row state's", s->row, g->factored ? g->row_hi - g->row_lo : 0, true, why,
                           why_len)) < 0 ||
        (rc = check_values(t->name, "col state's", s->col, g->factored ? g->nmat * g->cols : 0, true, why,
                           why_len)) < 0 ||
        (rc = check_values(t->name, "var state's", s->var, g->factored ? 0 : g->block_numel, true, why,
                           why_len)) < 0 ||
        (rc = check_values(t->name, "momentum's", s->mom, g->block_numel, false, why, why_len)) < 0)
      return rc;
    return 0;
  }
  const fps_adafactor_state_t *s = &t->state;
  if ((rc = check_values(t->name, "the weights'", t->param, s->numel, false, why, why_len)) < 0 ||
      (rc = check_values(t->name, "row state's", s->row, s->factored ? s->batch * s->rows : 0, true, why,
                         why_len)) < 0 ||
      (rc = check_values(t->name, "col state's", s->col, s->factored ? s->batch * s->cols : 0, true, why,
                         why_len)) < 0 ||
      (rc = check_values(t->name, "var state's", s->var, s->factored ? 0 : s->numel, true, why, why_len)) < 0 ||
      (rc = check_values(t->name, "momentum's", s->mom, s->numel, false, why, why_len)) < 0)
    return rc;
  return 0;
}

int fps_ckpt_load_file(const char *path, const fps_ckpt_expect_t *expect, fps_ckpt_t **out,
                       char *why, size_t why_len) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  int rc = read_file(path, expect, out, NULL, why, why_len);
  for (size_t i = 0; rc == 0 && i < (*out)->n_tensors; i++) rc = check_tensor(&(*out)->tensors[i], why, why_len);
  if (rc < 0 && *out) {
    fps_ckpt_destroy(*out);
    *out = NULL;
  }
  return rc;
}

/* ---------------------------------------------------------- directory */

static int open_dir(const char *dir, fps__ckpt_file_t **files, size_t *n) {
  if (!dir) return FPS_EINVAL;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? FPS_ENOTFOUND : FPS_EIO;
  int rc = fps__ckpt_scan(fd, files, n);
  close(fd);
  return rc;
}

static void log_reject(void *ctx, const char *path, int err, const char *why) {
  (void)ctx;
  fprintf(stderr, "factorps: checkpoint %s skipped (%s): %s\n", path, fps_err_name(err), why);
}

int fps_ckpt_load_newest(const char *dir, const fps_ckpt_expect_t *expect,
                         fps_ckpt_reject_fn on_reject, void *ctx, fps_ckpt_t **out) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  fps__ckpt_file_t *f = NULL;
  size_t n = 0;
  int rc = open_dir(dir, &f, &n);
  if (rc < 0) return rc;
  if (!on_reject) on_reject = log_reject;
  rc = n ? FPS_EFORMAT : FPS_ENOTFOUND;
  for (size_t i = 0; i < n; i++) {
    char path[FPS_CKPT_PATH_MAX], why[FPS_CKPT_WHY_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, f[i].name) >= sizeof path) {
      on_reject(ctx, f[i].name, FPS_EINVAL, "path too long");
      continue;
    }
    int r = fps_ckpt_load_file(path, expect, out, why, sizeof why);
    if (r == 0) {
      rc = 0;
      break;
    }
    /* Lack of memory says nothing about the file: falling back to an
     * older checkpoint would silently lose progress. */
    if (r == FPS_ENOMEM) {
      rc = r;
      break;
    }
    on_reject(ctx, path, r, why);
  }
  fps_free(f);
  return rc;
}

/* Verifies one file for a listing: with `values`, by loading it (the
 * values checked as the loader checks them; one read of the file). */
static int list_verify(const char *path, const fps_ckpt_expect_t *expect, bool values, fps_ckpt_info_t *info,
                       char *why, size_t why_len) {
  if (!values) return fps_ckpt_verify_file(path, expect, info, why, why_len);
  fps_ckpt_t *c = NULL;
  int rc = fps_ckpt_load_file(path, expect, &c, why, why_len);
  if (rc == 0) *info = c->info;
  fps_ckpt_destroy(c);
  return rc;
}

static int list_dir(const char *dir, const fps_ckpt_expect_t *expect, bool values, fps_ckpt_entry_t **out,
                    size_t *n) {
  if (!out || !n) return FPS_EINVAL;
  *out = NULL;
  *n = 0;
  fps__ckpt_file_t *f = NULL;
  size_t nf = 0;
  int rc = open_dir(dir, &f, &nf);
  if (rc < 0) return rc;
  fps_ckpt_entry_t *e = nf ? fps_calloc(nf, sizeof *e) : NULL;
  if (nf && !e) {
    fps_free(f);
    return FPS_ENOMEM;
  }
  for (size_t i = 0; i < nf; i++) {
    e[i].seq = f[i].seq;
    if ((size_t)snprintf(e[i].path, sizeof e[i].path, "%s/%s", dir, f[i].name) >= sizeof e[i].path) {
      e[i].status = FPS_EINVAL;
      snprintf(e[i].why, sizeof e[i].why, "path too long");
      continue;
    }
    e[i].status = list_verify(e[i].path, expect, values, &e[i].info, e[i].why, sizeof e[i].why);
  }
  fps_free(f);
  *out = e;
  *n = nf;
  return 0;
}

int fps_ckpt_list(const char *dir, const fps_ckpt_expect_t *expect, fps_ckpt_entry_t **out, size_t *n) {
  return list_dir(dir, expect, false, out, n);
}

int fps_ckpt_list_values(const char *dir, const fps_ckpt_expect_t *expect, fps_ckpt_entry_t **out, size_t *n) {
  return list_dir(dir, expect, true, out, n);
}

void fps_ckpt_list_free(fps_ckpt_entry_t *entries) { fps_free(entries); }

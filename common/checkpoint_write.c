/* Checkpoint writer: snapshots that own copies of the tensors, and the
 * atomic, durable write of one snapshot into a directory. */
#include "alloc.h"
#include "checkpoint_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sha256.h"

/* Hash and write in pieces this large: small enough to stay in cache
 * between hashing and writing, large enough for few system calls. */
#define CHUNK (UINT64_C(1) << 20)

typedef struct snap_tensor_s {
  char name[FPS_CKPT_NAME_MAX + 1];
  fps_adafactor_hparams_t hp;
  fps__ckpt_array_t arr[FPS__CKPT_KINDS]; /* file order, arr[0] the weights */
  int n_arr;
  float *data;                            /* every array back to back, file order
                                           * (borrowed: all but the weights) */
  uint64_t floats;                        /* elements of all its arrays */
  bool borrowed;                          /* weights referenced, not copied */
  const float *param;                     /* borrowed: the weights */
  void *ref;                              /* borrowed: what release() drops */
  bool copied;                            /* fps_ckpt_snapshot_copy was called */
  uint64_t version, step;
  float rms;
  double last_lr, last_weight_decay;      /* fps_ckpt_snapshot_set_applied */
  fps_ckpt_block_t map;                   /* n_blocks 0: a whole tensor; arrays owned */
  fps_split_geom_t g;                     /* a block's geometry (g.shape: the whole shape) */
} snap_tensor_t;

struct fps_ckpt_snapshot_s {
  fps_ckpt_shard_t shard;
  snap_tensor_t *t;
  size_t n, cap;
  uint64_t bytes;                         /* sum of floats * 4 */
  size_t blocks;                          /* tensors that are row blocks */
  void (*release)(void *ref);             /* non-NULL: weights are borrowed */
};

int fps_ckpt_snapshot_create(fps_ckpt_snapshot_t **out, uint32_t shard_id, uint32_t shard_count,
                             const char *mode) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  if (shard_count == 0 || shard_id >= shard_count || fps__ckpt_mode_check(mode) < 0)
    return FPS_EINVAL;
  fps_ckpt_snapshot_t *s = fps_calloc(1, sizeof *s);
  if (!s) return FPS_ENOMEM;
  s->shard.shard_id = shard_id;
  s->shard.shard_count = shard_count;
  snprintf(s->shard.mode, sizeof s->shard.mode, "%s", mode);
  *out = s;
  return 0;
}

int fps_ckpt_snapshot_set_job(fps_ckpt_snapshot_t *s, const char *job) {
  if (!s) return FPS_EINVAL;
  if (job && *job && fps_ckpt_job_check(job) < 0) return FPS_EINVAL;
  snprintf(s->shard.job_id, sizeof s->shard.job_id, "%s", job ? job : "");
  return 0;
}

void fps_ckpt_snapshot_destroy(fps_ckpt_snapshot_t *s) {
  if (!s) return;
  for (size_t i = 0; i < s->n; i++) {
    fps_free(s->t[i].data);
    if (s->t[i].ref) s->release(s->t[i].ref);
    fps__ckpt_block_free(&s->t[i].map);
  }
  fps_free(s->t);
  fps_free(s);
}

void fps_ckpt_snapshot_borrow_params(fps_ckpt_snapshot_t *s, void (*release)(void *ref)) {
  if (s && s->n == 0) s->release = release;
}

size_t fps_ckpt_snapshot_count(const fps_ckpt_snapshot_t *s) { return s ? s->n : 0; }
uint64_t fps_ckpt_snapshot_bytes(const fps_ckpt_snapshot_t *s) { return s ? s->bytes : 0; }

/* Appends t (its name, hparams and layout set; t->map owned by it on
 * success) with its copy buffers. */
static int snapshot_append(fps_ckpt_snapshot_t *s, snap_tensor_t *tp, const char *name,
                           const fps_adafactor_hparams_t *hp, size_t *idx, char *why,
                           size_t why_len) {
  snap_tensor_t t = *tp;
  snprintf(t.name, sizeof t.name, "%s", name);
  t.hp = *hp;
  t.last_lr = hp->has_lr ? hp->lr : 0.0;
  t.last_weight_decay = hp->weight_decay;
  for (int i = 0; i < t.n_arr; i++) t.floats += t.arr[i].count;
  if (t.floats > SIZE_MAX / sizeof(float)) {
    fps__ckpt_why(why, why_len, "tensor \"%s\" does not fit in memory", name);
    return FPS_EOVERFLOW;
  }
  if (s->n == s->cap) {
    size_t nc = s->cap ? 2 * s->cap : 16;
    snap_tensor_t *nt = fps_realloc(s->t, nc * sizeof *nt);
    if (!nt) goto nomem;
    s->t = nt;
    s->cap = nc;
  }
  t.borrowed = s->release != NULL;
  uint64_t own = t.floats - (t.borrowed ? t.arr[0].count : 0);
  t.data = fps_malloc((size_t)(own ? own : 1) * sizeof(float));
  if (!t.data) goto nomem;
  /* Touch every page now, outside the tensor's lock, so the copy under
   * the lock does not take the page faults. Not with zeros: compilers
   * turn malloc + memset(0) into calloc, which touches nothing. */
  memset(t.data, 0xff, (size_t)own * sizeof(float));
  s->t[s->n] = t;
  if (idx) *idx = s->n;
  s->n++;
  s->bytes += t.floats * sizeof(float);
  s->blocks += t.map.n_blocks != 0;
  return 0;
nomem:
  fps__ckpt_why(why, why_len, "out of memory for tensor \"%s\"", name);
  return FPS_ENOMEM;
}

int fps_ckpt_snapshot_add(fps_ckpt_snapshot_t *s, const char *name, const fps_shape_t *shape,
                          const fps_adafactor_hparams_t *hp, size_t *idx, char *why,
                          size_t why_len) {
  if (!s || !name || !shape || !hp) {
    fps__ckpt_why(why, why_len, "missing argument");
    return FPS_EINVAL;
  }
  int rc = fps__ckpt_name_check(name, strnlen(name, FPS_CKPT_NAME_MAX + 1), why, why_len);
  if (rc < 0) return rc;
  snap_tensor_t t;
  memset(&t, 0, sizeof t);
  rc = fps__ckpt_layout(shape, hp, t.arr, why, why_len);
  if (rc < 0) return rc;
  t.n_arr = rc;
  return snapshot_append(s, &t, name, hp, idx, why, why_len);
}

int fps_ckpt_snapshot_add_block(fps_ckpt_snapshot_t *s, const char *name, const fps_shape_t *shape,
                                const fps_adafactor_hparams_t *hp, const fps_ckpt_block_t *map,
                                size_t *idx, char *why, size_t why_len) {
  if (!s || !name || !shape || !hp || !map) {
    fps__ckpt_why(why, why_len, "missing argument");
    return FPS_EINVAL;
  }
  int rc = fps__ckpt_name_check(name, strnlen(name, FPS_CKPT_NAME_MAX + 1), why, why_len);
  if (rc < 0) return rc;
  char mwhy[256] = "";
  rc = fps_ckpt_block_check(shape, map, s->shard.shard_id, s->shard.shard_count, mwhy, sizeof mwhy);
  if (rc < 0) {
    fps__ckpt_why(why, why_len, "tensor \"%s\": block map: %s", name, mwhy);
    return FPS_EINVAL;
  }
  snap_tensor_t t;
  memset(&t, 0, sizeof t);
  rc = fps_split_geom_init(&t.g, shape, map->bounds[map->block_index],
                           map->bounds[map->block_index + 1], why, why_len);
  if (rc < 0) return rc;
  rc = fps__ckpt_block_layout(&t.g, hp, t.arr, why, why_len);
  if (rc < 0) return rc;
  t.n_arr = rc;
  if (fps__ckpt_block_copy(&t.map, map) < 0) {
    fps__ckpt_why(why, why_len, "out of memory for tensor \"%s\"", name);
    return FPS_ENOMEM;
  }
  rc = snapshot_append(s, &t, name, hp, idx, why, why_len);
  if (rc < 0) fps__ckpt_block_free(&t.map);
  return rc;
}

/* Copies param and the state arrays arr[kind] (NULL: the state has none
 * of that kind) into t's buffer in its layout's order. The state must hold
 * exactly the arrays the layout stores (FPS_ESHAPE otherwise). */
static int snapshot_fill(const fps_ckpt_snapshot_t *s, snap_tensor_t *t, uint64_t version,
                         const float *param, void *ref, float *const arr[FPS__CKPT_KINDS],
                         uint64_t step, float rms) {
  if (t->borrowed != (ref != NULL)) return FPS_EINVAL; /* the copy call of the other kind */
  bool want[FPS__CKPT_KINDS] = {false};
  for (int i = 0; i < t->n_arr; i++) want[t->arr[i].kind] = true;
  for (int k = FPS__CKPT_ROW; k < FPS__CKPT_KINDS; k++)
    if ((arr[k] != NULL) != want[k]) return FPS_ESHAPE;
  float *dst = t->data;
  for (int i = t->borrowed ? 1 : 0; i < t->n_arr; i++) {
    const float *src = i == 0 ? param : arr[t->arr[i].kind];
    memcpy(dst, src, (size_t)t->arr[i].count * sizeof(float));
    dst += t->arr[i].count;
  }
  if (t->borrowed) {
    if (t->ref) s->release(t->ref); /* copied again: the newer one */
    t->param = param;
    t->ref = ref;
  }
  t->version = version;
  t->step = step;
  t->rms = rms;
  t->copied = true;
  return 0;
}

int fps_ckpt_snapshot_copy(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                           const float *param, const fps_adafactor_state_t *st) {
  return fps_ckpt_snapshot_copy_ref(s, idx, version, param, NULL, st);
}

int fps_ckpt_snapshot_copy_ref(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                               const float *param, void *ref, const fps_adafactor_state_t *st) {
  if (!s || idx >= s->n || !param || !st || s->t[idx].map.n_blocks) return FPS_EINVAL;
  snap_tensor_t *t = &s->t[idx];
  const fps_shape_t *shape = &t->arr[0].shape;
  if (st->shape.ndim != shape->ndim || st->numel != t->arr[0].count) return FPS_ESHAPE;
  for (uint32_t d = 0; d < shape->ndim; d++)
    if (st->shape.dim[d] != shape->dim[d]) return FPS_ESHAPE;
  float *arr[FPS__CKPT_KINDS] = {NULL};
  for (int k = FPS__CKPT_ROW; k < FPS__CKPT_KINDS; k++) arr[k] = fps__ckpt_state_array(st, k);
  return snapshot_fill(s, t, version, param, ref, arr, st->step, st->rms);
}

int fps_ckpt_snapshot_copy_block(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                                 const float *param, const fps_split_state_t *st) {
  return fps_ckpt_snapshot_copy_block_ref(s, idx, version, param, NULL, st);
}

int fps_ckpt_snapshot_copy_block_ref(fps_ckpt_snapshot_t *s, size_t idx, uint64_t version,
                                     const float *param, void *ref, const fps_split_state_t *st) {
  if (!s || idx >= s->n || !param || !st || !s->t[idx].map.n_blocks) return FPS_EINVAL;
  snap_tensor_t *t = &s->t[idx];
  const fps_split_geom_t *a = &t->g, *b = &st->g;
  if (a->shape.ndim != b->shape.ndim || a->row_lo != b->row_lo || a->row_hi != b->row_hi ||
      a->cols != b->cols || a->nmat != b->nmat || a->block_numel != b->block_numel)
    return FPS_ESHAPE;
  for (uint32_t d = 0; d < a->shape.ndim; d++)
    if (a->shape.dim[d] != b->shape.dim[d]) return FPS_ESHAPE;
  float *arr[FPS__CKPT_KINDS] = {NULL};
  for (int k = FPS__CKPT_ROW; k < FPS__CKPT_KINDS; k++) arr[k] = fps__ckpt_split_array(st, k);
  return snapshot_fill(s, t, version, param, ref, arr, st->step, st->rms);
}

int fps_ckpt_snapshot_set_applied(fps_ckpt_snapshot_t *s, size_t idx, double last_lr,
                                  double last_weight_decay) {
  if (!s || idx >= s->n || !(last_lr >= 0) || !(last_weight_decay >= 0) || !isfinite(last_lr) ||
      !isfinite(last_weight_decay))
    return FPS_EINVAL;
  s->t[idx].last_lr = last_lr;
  s->t[idx].last_weight_decay = last_weight_decay;
  return 0;
}

/* ------------------------------------------------------------- header */

static int add_raw_u64(cJSON *arr, uint64_t v) {
  /* Raw text so integers print as integers however large (cJSON prints
   * numbers past 1e15 in exponent form, which readers would take as
   * floats). */
  char buf[24];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  cJSON *n = cJSON_CreateRaw(buf);
  if (!n) return FPS_ENOMEM;
  cJSON_AddItemToArray(arr, n);
  return 0;
}

static int meta_u64(cJSON *meta, const char *key, uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  return cJSON_AddStringToObject(meta, key, buf) ? 0 : FPS_ENOMEM;
}

static const char ZEROS64[] = "0000000000000000000000000000000000000000000000000000000000000000";

/* Finds the 64-character value of a metadata digest key in the printed
 * header; the writer's own output holds each exactly once. */
static char *find_digest(char *text, const char *key) {
  char pat[40];
  snprintf(pat, sizeof pat, "\"%s\":\"", key);
  char *p = strstr(text, pat);
  return p ? p + strlen(pat) : NULL;
}

static int key_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Fails if two array keys of the snapshot are equal ("a"+"/row" against a
 * tensor named "a/row", or a name added twice). */
static int check_keys_unique(const fps_ckpt_snapshot_t *s, char *why, size_t why_len) {
  size_t n = 0;
  for (size_t i = 0; i < s->n; i++) n += (size_t)s->t[i].n_arr;
  if (n == 0) return 0;
  char **keys = fps_calloc(n, sizeof *keys);
  if (!keys) return FPS_ENOMEM;
  int rc = 0;
  size_t k = 0;
  for (size_t i = 0; i < s->n && rc == 0; i++) {
    for (int j = 0; j < s->t[i].n_arr; j++) {
      size_t len = strlen(s->t[i].name) + 5;
      keys[k] = fps_malloc(len);
      if (!keys[k]) {
        rc = FPS_ENOMEM;
        break;
      }
      snprintf(keys[k], len, "%s%s", s->t[i].name, fps__ckpt_suffix(s->t[i].arr[j].kind));
      k++;
    }
  }
  if (rc == 0) {
    qsort(keys, n, sizeof *keys, key_cmp);
    for (size_t i = 1; i < n; i++) {
      if (strcmp(keys[i - 1], keys[i]) == 0) {
        fps__ckpt_why(why, why_len, "two arrays would be stored as \"%s\" (tensor names collide)",
                      keys[i]);
        rc = FPS_EEXISTS;
        break;
      }
    }
  }
  for (size_t i = 0; i < k; i++) fps_free(keys[i]);
  fps_free(keys);
  return rc;
}

/* Builds the header text with both digests zeroed and space padding, so
 * that 8 + *len is a multiple of 8. Returns the malloc'd text or NULL. */
static char *build_header(const fps_ckpt_snapshot_t *s, uint64_t seq, size_t *len) {
  char *text = NULL, *out = NULL;
  fps__ckpt_json_init();
  cJSON *root = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
  if (!root || !meta) goto done;

  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char created[40], date[24];
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(created, sizeof created, "%s.%09ldZ", date, (long)ts.tv_nsec);

  int rc = 0;
  rc |= cJSON_AddStringToObject(meta, "format", FPS_CKPT_FORMAT) ? 0 : FPS_ENOMEM;
  /* Version 1 when nothing needs version 2, so older builds still read it. */
  rc |= meta_u64(meta, "format_version",
                 s->blocks ? FPS_CKPT_FORMAT_VERSION : FPS_CKPT_FORMAT_VERSION_WHOLE);
  rc |= meta_u64(meta, "shard_id", s->shard.shard_id);
  rc |= meta_u64(meta, "shard_count", s->shard.shard_count);
  rc |= cJSON_AddStringToObject(meta, "mode", s->shard.mode) ? 0 : FPS_ENOMEM;
  /* Only when known: a file without a job is what earlier writers wrote. */
  if (s->shard.job_id[0])
    rc |= cJSON_AddStringToObject(meta, FPS__CKPT_META_KEY_JOB, s->shard.job_id) ? 0 : FPS_ENOMEM;
  rc |= meta_u64(meta, "sequence", seq);
  rc |= cJSON_AddStringToObject(meta, "created", created) ? 0 : FPS_ENOMEM;
  rc |= meta_u64(meta, "tensor_count", s->n);
  rc |= cJSON_AddStringToObject(meta, "data_sha256", ZEROS64) ? 0 : FPS_ENOMEM;
  rc |= cJSON_AddStringToObject(meta, "header_sha256", ZEROS64) ? 0 : FPS_ENOMEM;
  if (rc) goto done;

  uint64_t off = 0;
  for (size_t i = 0; i < s->n; i++) {
    const snap_tensor_t *t = &s->t[i];
    cJSON *tm_obj = fps__ckpt_tensor_meta(&t->hp, t->version, t->step, t->rms, t->last_lr,
                                           t->last_weight_decay, &t->g.shape, &t->map);
    char *tm_text = tm_obj ? cJSON_PrintUnformatted(tm_obj) : NULL;
    cJSON_Delete(tm_obj);
    if (!tm_text) goto done;
    char key[sizeof FPS__CKPT_TENSOR_PREFIX + FPS_CKPT_NAME_MAX];
    snprintf(key, sizeof key, "%s%s", FPS__CKPT_TENSOR_PREFIX, t->name);
    cJSON *added = cJSON_AddStringToObject(meta, key, tm_text);
    cJSON_free(tm_text);
    if (!added) goto done;

    for (int j = 0; j < t->n_arr; j++) {
      const fps__ckpt_array_t *a = &t->arr[j];
      char akey[FPS_CKPT_NAME_MAX + 8];
      snprintf(akey, sizeof akey, "%s%s", t->name, fps__ckpt_suffix(a->kind));
      cJSON *e = cJSON_AddObjectToObject(root, akey);
      if (!e || !cJSON_AddStringToObject(e, "dtype", "F32")) goto done;
      cJSON *shape = cJSON_AddArrayToObject(e, "shape");
      if (!shape) goto done;
      for (uint32_t d = 0; d < a->shape.ndim; d++)
        if (add_raw_u64(shape, a->shape.dim[d]) < 0) goto done;
      cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
      if (!offs || add_raw_u64(offs, off) < 0 || add_raw_u64(offs, off + a->count * 4) < 0)
        goto done;
      off += a->count * 4;
    }
  }
  text = cJSON_PrintUnformatted(root);
  if (!text) goto done;
  size_t n = strlen(text);
  size_t pad = (8 - (8 + n) % 8) % 8;
  out = fps_malloc(n + pad + 1);
  if (!out) goto done;
  memcpy(out, text, n);
  memset(out + n, ' ', pad);
  out[n + pad] = '\0';
  *len = n + pad;
done:
  cJSON_free(text);
  cJSON_Delete(root);
  return out;
}

/* --------------------------------------------------------------- I/O */

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return FPS_EIO;
    }
    if (w == 0) { /* no progress (seen under qemu-user at a size limit): never spin */
      errno = ENOSPC;
      return FPS_EIO;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

static int pwrite_all(int fd, const void *buf, size_t len, off_t off) {
  const char *p = buf;
  while (len) {
    ssize_t w = pwrite(fd, p, len, off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return FPS_EIO;
    }
    if (w == 0) {
      errno = ENOSPC;
      return FPS_EIO;
    }
    p += w;
    off += w;
    len -= (size_t)w;
  }
  return 0;
}

static void put_le64(uint8_t b[8], uint64_t v) {
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
}

/* Writes header placeholder and data into fd, then the final header.
 * Returns 0, FPS_EIO (errno kept) or another FPS_E*. */
static int write_file(int fd, const fps_ckpt_snapshot_t *s, char *header, size_t hlen,
                      char *why, size_t why_len) {
  uint8_t prefix[8];
  put_le64(prefix, hlen);
  fps_sha256_t *h = NULL;
  int rc = write_all(fd, prefix, 8);
  if (rc == 0) rc = write_all(fd, header, hlen);
  if (rc < 0) {
    fps__ckpt_why(why, why_len, "write: %s", strerror(errno));
    return rc;
  }
  rc = fps_sha256_create(&h);
  if (rc < 0) return rc;
  for (size_t i = 0; i < s->n && rc == 0; i++) {
    const snap_tensor_t *t = &s->t[i];
    /* Borrowed weights come first (file order), then the copied rest. */
    uint64_t wbytes = t->borrowed ? t->arr[0].count * sizeof(float) : 0;
    const char *piece[2] = {(const char *)t->param, (const char *)t->data};
    uint64_t plen[2] = {wbytes, t->floats * sizeof(float) - wbytes};
    for (int k = 0; k < 2 && rc == 0; k++) {
      const char *p = piece[k];
      uint64_t left = plen[k];
      while (left && rc == 0) {
        size_t c = (size_t)(left < CHUNK ? left : CHUNK);
        rc = fps_sha256_update(h, p, c);
        if (rc == 0 && (rc = write_all(fd, p, c)) < 0)
          fps__ckpt_why(why, why_len, "write: %s", strerror(errno));
        p += c;
        left -= c;
      }
    }
  }
  uint8_t dig[FPS_SHA256_LEN];
  char hex[FPS_SHA256_HEX_LEN + 1];
  if (rc == 0) rc = fps_sha256_final(h, dig);
  fps_sha256_destroy(h);
  h = NULL;
  if (rc < 0) return rc;

  char *dpos = find_digest(header, "data_sha256");
  char *hpos = find_digest(header, "header_sha256");
  if (!dpos || !hpos) {
    fps__ckpt_why(why, why_len, "internal: digest placeholders missing from the header");
    return FPS_ESTATE;
  }
  fps_sha256_hex(dig, hex);
  memcpy(dpos, hex, FPS_SHA256_HEX_LEN);
  /* The header digest covers the prefix and the header with its own value
   * still zero; then the value goes in. */
  rc = fps_sha256_create(&h);
  if (rc < 0) return rc;
  rc = fps_sha256_update(h, prefix, 8);
  if (rc == 0) rc = fps_sha256_update(h, header, hlen);
  if (rc == 0) rc = fps_sha256_final(h, dig);
  fps_sha256_destroy(h);
  if (rc < 0) return rc;
  fps_sha256_hex(dig, hex);
  memcpy(hpos, hex, FPS_SHA256_HEX_LEN);
  if ((rc = pwrite_all(fd, header, hlen, 8)) < 0) {
    fps__ckpt_why(why, why_len, "write: %s", strerror(errno));
    return rc;
  }
  if (fsync(fd) < 0) {
    fps__ckpt_why(why, why_len, "fsync: %s", strerror(errno));
    return FPS_EIO;
  }
  return 0;
}

/* Removes the temporary files a crashed writer left (we hold the lock, so
 * no live writer owns one). Best effort. */
static void remove_stale_temps(int dirfd) {
  int fd = dup(dirfd);
  if (fd < 0) return;
  DIR *d = fdopendir(fd);
  if (!d) {
    close(fd);
    return;
  }
  rewinddir(d); /* the dup shares the caller's directory offset */
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    const char *n = de->d_name;
    size_t len = strlen(n);
    static const char suf[] = ".safetensors.tmp";
    uint64_t seq;
    char base[256];
    if (len <= strlen(suf) + 1 || n[0] != '.' || strcmp(n + len - strlen(suf), suf) != 0) continue;
    /* ".ckpt-<seq>.safetensors.tmp" -> "ckpt-<seq>.safetensors" */
    snprintf(base, sizeof base, "%.*s", (int)(len - 5), n + 1);
    if (fps__ckpt_name_seq(base, &seq)) unlinkat(dirfd, n, 0);
  }
  closedir(d);
}

/* Deletes the oldest checkpoints so that `keep` remain, counting the new
 * one (seq), then fsyncs the directory. */
static int prune(int dirfd, uint64_t seq, unsigned keep, unsigned *pruned, char *why,
                 size_t why_len) {
  fps__ckpt_file_t *f = NULL;
  size_t n = 0;
  int rc = fps__ckpt_scan(dirfd, &f, &n);
  if (rc < 0) {
    fps__ckpt_why(why, why_len, "scan for pruning: %s", strerror(errno));
    return rc;
  }
  unsigned kept = 0;
  *pruned = 0;
  for (size_t i = 0; i < n; i++) {
    if (f[i].seq > seq) continue; /* cannot happen under the lock; never delete newer */
    if (kept < keep) {
      kept++;
      continue;
    }
    if (unlinkat(dirfd, f[i].name, 0) < 0 && errno != ENOENT) {
      fps__ckpt_why(why, why_len, "delete %s: %s", f[i].name, strerror(errno));
      rc = FPS_EIO;
      break;
    }
    (*pruned)++;
  }
  fps_free(f);
  if (*pruned && fsync(dirfd) < 0 && rc == 0) {
    fps__ckpt_why(why, why_len, "fsync of the directory after pruning: %s", strerror(errno));
    rc = FPS_EIO;
  }
  return rc;
}

int fps_ckpt_write(const char *dir, const fps_ckpt_snapshot_t *s, unsigned keep,
                   fps_ckpt_written_t *out, char *why, size_t why_len) {
  int rc, dirfd = -1, fd = -1;
  char *header = NULL;
  char tmp[80], final[64];
  bool tmp_exists = false;
  fps__ckpt_file_t *files = NULL;
  size_t nfiles = 0;
  fps_ckpt_written_t res;
  memset(&res, 0, sizeof res);
  if (!dir || !s || keep == 0) {
    fps__ckpt_why(why, why_len, "bad argument (keep must be >= 1)");
    return FPS_EINVAL;
  }
  for (size_t i = 0; i < s->n; i++) {
    if (!s->t[i].copied) {
      fps__ckpt_why(why, why_len, "tensor \"%s\" was added to the snapshot but never copied",
                    s->t[i].name);
      return FPS_ESTATE;
    }
  }
  if ((rc = check_keys_unique(s, why, why_len)) < 0) {
    if (rc == FPS_ENOMEM) fps__ckpt_why(why, why_len, "out of memory checking the array names");
    return rc;
  }

  dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) {
    rc = errno == ENOENT ? FPS_ENOTFOUND : FPS_EIO;
    fps__ckpt_why(why, why_len, "open %s: %s", dir, strerror(errno));
    goto fail;
  }
  /* One writer per directory: two would race for sequence numbers and
   * prune each other's files. The lock goes with the fd. */
  if (flock(dirfd, LOCK_EX | LOCK_NB) < 0) {
    rc = errno == EWOULDBLOCK ? FPS_EAGAIN : FPS_EIO;
    fps__ckpt_why(why, why_len, "lock %s: %s", dir,
                  errno == EWOULDBLOCK ? "another checkpoint writer holds it" : strerror(errno));
    goto fail;
  }
  remove_stale_temps(dirfd);
  if ((rc = fps__ckpt_scan(dirfd, &files, &nfiles)) < 0) {
    fps__ckpt_why(why, why_len, "scan %s: %s", dir,
                  rc == FPS_ENOMEM ? "out of memory" : strerror(errno));
    goto fail;
  }
  uint64_t seq = nfiles ? files[0].seq + 1 : 1;
  if (nfiles && files[0].seq == UINT64_MAX) {
    rc = FPS_EOVERFLOW;
    fps__ckpt_why(why, why_len, "sequence numbers exhausted in %s", dir);
    goto fail;
  }
  snprintf(final, sizeof final, "ckpt-%08" PRIu64 ".safetensors", seq);
  snprintf(tmp, sizeof tmp, ".%s.tmp", final);
  if ((size_t)snprintf(res.path, sizeof res.path, "%s/%s", dir, final) >= sizeof res.path) {
    rc = FPS_EINVAL;
    fps__ckpt_why(why, why_len, "checkpoint directory path is too long");
    goto fail;
  }

  size_t hlen = 0;
  header = build_header(s, seq, &hlen);
  if (!header) {
    rc = FPS_ENOMEM;
    fps__ckpt_why(why, why_len, "out of memory building the header");
    goto fail;
  }
  if (hlen > FPS_CKPT_HEADER_MAX) {
    rc = FPS_ELIMIT;
    fps__ckpt_why(why, why_len, "header of %zu bytes exceeds the safetensors limit", hlen);
    goto fail;
  }

  fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    rc = FPS_EIO;
    fps__ckpt_why(why, why_len, "create %s/%s: %s", dir, tmp, strerror(errno));
    goto fail;
  }
  tmp_exists = true;
  if ((rc = write_file(fd, s, header, hlen, why, why_len)) < 0) {
    if (rc == FPS_ENOMEM) fps__ckpt_why(why, why_len, "out of memory hashing %s/%s", dir, tmp);
    goto fail;
  }
  int cfd = fd;
  fd = -1;
  if (close(cfd) < 0) {
    rc = FPS_EIO;
    fps__ckpt_why(why, why_len, "close %s/%s: %s", dir, tmp, strerror(errno));
    goto fail;
  }
  if (renameat(dirfd, tmp, dirfd, final) < 0) {
    rc = FPS_EIO;
    fps__ckpt_why(why, why_len, "rename to %s: %s", res.path, strerror(errno));
    goto fail;
  }
  tmp_exists = false;
  /* The rename is durable only once the directory is synced; until then a
   * crash may lose the new file, never corrupt an old one. */
  if (fsync(dirfd) < 0) {
    rc = FPS_EIO;
    fps__ckpt_why(why, why_len, "fsync %s: %s", dir, strerror(errno));
    unlinkat(dirfd, final, 0);
    goto fail;
  }
  res.seq = seq;
  res.file_bytes = 8 + hlen + s->bytes;
  res.prune_err = prune(dirfd, seq, keep, &res.pruned, why, why_len);
  if (out) *out = res;
  rc = 0;
fail:
  if (fd >= 0) close(fd);
  if (tmp_exists) unlinkat(dirfd, tmp, 0);
  if (dirfd >= 0) close(dirfd);
  fps_free(files);
  fps_free(header);
  return rc;
}

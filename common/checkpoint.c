/* Checkpoint format helpers shared by the writer and the reader: which
 * arrays a tensor stores, tensor names, per-tensor metadata, directory
 * scans. The layout itself is documented in checkpoint.h. */
#include "alloc.h"
#include "checkpoint_internal.h"
#include "name.h"

#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* The per-tensor metadata lists every hyperparameter and the layout every
 * state array: if either struct grows, these fail so the format is
 * extended (and FPS_CKPT_FORMAT_VERSION considered) in the same change. */
_Static_assert(sizeof(fps_adafactor_hparams_t) == 80,
               "fps_adafactor_hparams_t changed: update the checkpoint tensor metadata");
_Static_assert(sizeof(fps_state_size_t) == 8 * sizeof(uint64_t),
               "fps_state_size_t changed: update the checkpoint array layout");

void fps__ckpt_why(char *why, size_t why_len, const char *fmt, ...) {
  if (!why || why_len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, why_len, fmt, ap);
  va_end(ap);
}

const char *const fps_ckpt_state_suffixes[] = {"/row", "/col", "/var", "/mom", NULL};

const char *fps__ckpt_suffix(int kind) {
  static const char *const suffix[FPS__CKPT_KINDS] = {"", "/row", "/col", "/var", "/mom"};
  return kind >= 0 && kind < FPS__CKPT_KINDS ? suffix[kind] : "?";
}

float *fps__ckpt_state_array(const fps_adafactor_state_t *st, int kind) {
  switch (kind) {
    case FPS__CKPT_ROW: return st->row;
    case FPS__CKPT_COL: return st->col;
    case FPS__CKPT_VAR: return st->var;
    case FPS__CKPT_MOM: return st->mom;
    default: return NULL;
  }
}

float *fps__ckpt_split_array(const fps_split_state_t *st, int kind) {
  switch (kind) {
    case FPS__CKPT_ROW: return st->row;
    case FPS__CKPT_COL: return st->col;
    case FPS__CKPT_VAR: return st->var;
    case FPS__CKPT_MOM: return st->mom;
    default: return NULL;
  }
}

int fps__ckpt_block_copy(fps_ckpt_block_t *dst, const fps_ckpt_block_t *src) {
  memset(dst, 0, sizeof *dst);
  if (src->n_blocks == 0) return 0;
  uint64_t *b = fps_malloc(((size_t)src->n_blocks + 1) * sizeof *b);
  uint32_t *sh = fps_malloc((size_t)src->n_blocks * sizeof *sh);
  if (!b || !sh) {
    fps_free(b);
    fps_free(sh);
    return FPS_ENOMEM;
  }
  memcpy(b, src->bounds, ((size_t)src->n_blocks + 1) * sizeof *b);
  memcpy(sh, src->block_shards, (size_t)src->n_blocks * sizeof *sh);
  *dst = *src;
  dst->bounds = b;
  dst->block_shards = sh;
  return 0;
}

void fps__ckpt_block_free(fps_ckpt_block_t *b) {
  if (!b) return;
  fps_free(b->bounds);
  fps_free(b->block_shards);
  memset(b, 0, sizeof *b);
}

int fps_ckpt_block_check(const fps_shape_t *shape, const fps_ckpt_block_t *b, uint32_t shard_id,
                         uint32_t shard_count, char *why, size_t why_len) {
  if (!shape || !b || !b->bounds || !b->block_shards) {
    fps__ckpt_why(why, why_len, "no block map");
    return FPS_EINVAL;
  }
  if (b->n_blocks < 2 || b->n_blocks > FPS_SPLIT_MAX_BLOCKS) {
    fps__ckpt_why(why, why_len, "%u blocks: a split tensor has 2..%d", b->n_blocks,
                  FPS_SPLIT_MAX_BLOCKS);
    return FPS_EINVAL;
  }
  char bwhy[200] = "";
  int rc = fps_split_bounds_validate(shape, b->bounds, b->n_blocks, bwhy, sizeof bwhy);
  if (rc < 0) {
    fps__ckpt_why(why, why_len, "bounds: %s", bwhy);
    return rc;
  }
  if (b->block_index >= b->n_blocks) {
    fps__ckpt_why(why, why_len, "block_index %u is not below the %u blocks", b->block_index,
                  b->n_blocks);
    return FPS_EINVAL;
  }
  if (b->shard_count == 0) {
    fps__ckpt_why(why, why_len, "the map's shard_count is 0");
    return FPS_EINVAL;
  }
  for (uint32_t i = 0; i < b->n_blocks; i++) {
    if (b->block_shards[i] >= b->shard_count || (i && b->block_shards[i] <= b->block_shards[i - 1])) {
      fps__ckpt_why(why, why_len,
                    "block_shards[%u] = %u: shard ids must increase and stay below shard_count %u",
                    i, b->block_shards[i], b->shard_count);
      return FPS_EINVAL;
    }
  }
  if (shard_count) {
    if (b->shard_count != shard_count) {
      fps__ckpt_why(why, why_len, "the map was made for %u shards, the file is of shard %u of %u",
                    b->shard_count, shard_id, shard_count);
      return FPS_EINVAL;
    }
    if (b->block_shards[b->block_index] != shard_id) {
      fps__ckpt_why(why, why_len, "block %u belongs to shard %u, the file is of shard %u",
                    b->block_index, b->block_shards[b->block_index], shard_id);
      return FPS_EINVAL;
    }
  }
  return 0;
}

int fps__ckpt_block_layout(const fps_split_geom_t *g, const fps_adafactor_hparams_t *hp,
                           fps__ckpt_array_t arr[FPS__CKPT_KINDS], char *why, size_t why_len) {
  int rc = fps_adafactor_validate(hp, why, why_len);
  if (rc < 0) return rc;
  if (!g || g->block_numel == 0 || g->shape.ndim == 0) {
    fps__ckpt_why(why, why_len, "a row block needs a tensor of at least one dimension");
    return FPS_EINVAL;
  }
  const uint64_t rows = g->row_hi - g->row_lo;
  fps__ckpt_array_t p = {.kind = FPS__CKPT_PARAM, .count = g->block_numel};
  if (g->factored) {
    p.shape = (fps_shape_t){.ndim = 2, .dim = {rows, g->cols}};
  } else {
    p.shape = (fps_shape_t){.ndim = 1, .dim = {rows}};
  }
  int n = 0;
  arr[n++] = p;
  if (g->factored) {
    arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_ROW, .shape = {.ndim = 1, .dim = {rows}},
                                   .count = rows};
    arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_COL,
                                   .shape = {.ndim = 2, .dim = {g->nmat, g->cols}},
                                   .count = g->nmat * g->cols};
  } else {
    arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_VAR, .shape = p.shape, .count = rows};
  }
  /* The same rule as fps_split_state_init: momentum only for hf with beta1. */
  if (hp->flavor == FPS_FLAVOR_HF && hp->has_beta1) {
    p.kind = FPS__CKPT_MOM;
    arr[n++] = p;
  }
  return n;
}

static void fps__ckpt_json_hooks(void) {
  cJSON_Hooks h = {.malloc_fn = fps_malloc, .free_fn = fps_free};
  cJSON_InitHooks(&h);
}

void fps__ckpt_json_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, fps__ckpt_json_hooks);
}

int fps__ckpt_layout(const fps_shape_t *shape, const fps_adafactor_hparams_t *hp,
                     fps__ckpt_array_t arr[FPS__CKPT_KINDS], char *why, size_t why_len) {
  uint64_t numel = 0;
  int rc = fps_shape_validate(shape, &numel, why, why_len);
  if (rc < 0) return rc;
  rc = fps_adafactor_validate(hp, why, why_len);
  if (rc < 0) return rc;
  /* The kernel decides which state arrays exist and how long they are; the
   * file shapes below must agree with its element counts. */
  fps_state_size_t sz;
  rc = fps_adafactor_state_size(shape, hp, &sz);
  if (rc < 0) return rc;

  int n = 0;
  arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_PARAM, .shape = *shape, .count = numel};
  if (sz.row || sz.col) {
    /* Factored over the last two dims: row = shape[:-1], col = shape[:-2] + [C]. */
    fps__ckpt_array_t row = {.kind = FPS__CKPT_ROW, .shape = *shape, .count = sz.row};
    row.shape.ndim = shape->ndim - 1;
    fps__ckpt_array_t col = {.kind = FPS__CKPT_COL, .shape = *shape, .count = sz.col};
    col.shape.ndim = shape->ndim - 1;
    col.shape.dim[shape->ndim - 2] = shape->dim[shape->ndim - 1];
    arr[n++] = row;
    arr[n++] = col;
  }
  if (sz.var) arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_VAR, .shape = *shape, .count = sz.var};
  if (sz.mom) arr[n++] = (fps__ckpt_array_t){.kind = FPS__CKPT_MOM, .shape = *shape, .count = sz.mom};
  for (int i = 0; i < n; i++) {
    uint64_t c = 1;
    for (uint32_t d = 0; d < arr[i].shape.ndim; d++) c *= arr[i].shape.dim[d];
    if (c != arr[i].count) {
      fps__ckpt_why(why, why_len, "internal: %s array has %" PRIu64 " elements, kernel says %" PRIu64,
                    fps__ckpt_suffix(arr[i].kind), c, arr[i].count);
      return FPS_ESTATE;
    }
  }
  return n;
}

int fps__ckpt_name_check(const char *name, size_t len, char *why, size_t why_len) {
  if (len == 0 || len > FPS_CKPT_NAME_MAX) {
    fps__ckpt_why(why, why_len, "tensor name is %zu bytes, must be 1..%d", len, FPS_CKPT_NAME_MAX);
    return FPS_EINVAL;
  }
  if (strcmp(name, "__metadata__") == 0) {
    fps__ckpt_why(why, why_len, "tensor name \"__metadata__\" is reserved by safetensors");
    return FPS_EINVAL;
  }
  /* The rule every name follows (common/name.h): UTF-8, no control
   * characters, which would be escaped in JSON and unreadable in logs. */
  char nwhy[256];
  if (fps_name_check(name, len, nwhy, sizeof nwhy) < 0) {
    fps__ckpt_why(why, why_len, "%s", nwhy);
    return FPS_EINVAL;
  }
  return 0;
}

int fps__ckpt_mode_check(const char *mode) {
  if (!mode) return FPS_EINVAL;
  size_t n = strlen(mode);
  if (n == 0 || n > FPS_CKPT_MODE_MAX) return FPS_EINVAL;
  for (size_t i = 0; i < n; i++) {
    char c = mode[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return FPS_EINVAL;
  }
  return 0;
}

int fps_ckpt_job_check(const char *job) {
  if (!job) return FPS_EINVAL;
  size_t n = strlen(job);
  if (n == 0 || n > FPS_CKPT_JOB_MAX) return FPS_EINVAL;
  for (size_t i = 0; i < n; i++) {
    char c = job[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == ':' || c == '-'))
      return FPS_EINVAL;
  }
  return 0;
}

int fps__ckpt_parse_u64(const char *s, uint64_t *out) {
  if (!s || !*s) return FPS_EFORMAT;
  if (s[0] == '0' && s[1] != '\0') return FPS_EFORMAT;
  uint64_t v = 0;
  for (const char *p = s; *p; p++) {
    if (*p < '0' || *p > '9') return FPS_EFORMAT;
    unsigned d = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return FPS_EFORMAT;
    v = v * 10 + d;
  }
  *out = v;
  return 0;
}

bool fps__ckpt_name_seq(const char *base, uint64_t *seq) {
  static const char pre[] = "ckpt-", suf[] = ".safetensors";
  size_t n = strlen(base);
  if (n <= strlen(pre) + strlen(suf) || strncmp(base, pre, strlen(pre)) != 0 ||
      strcmp(base + n - strlen(suf), suf) != 0)
    return false;
  size_t digits = n - strlen(pre) - strlen(suf);
  if (digits > 20) return false;
  char buf[21];
  memcpy(buf, base + strlen(pre), digits);
  buf[digits] = '\0';
  /* Zero padding is part of the name, so leading zeros are fine here. */
  const char *p = buf;
  while (p[0] == '0' && p[1] != '\0') p++;
  return fps__ckpt_parse_u64(p, seq) == 0;
}

/* ------------------------------------------------ per-tensor metadata */

static int add_str(cJSON *obj, const char *key, const char *val) {
  return cJSON_AddStringToObject(obj, key, val) ? 0 : FPS_ENOMEM;
}

static int add_double(cJSON *obj, const char *key, double v) {
  char buf[40];
  snprintf(buf, sizeof buf, "%.17g", v);
  return add_str(obj, key, buf);
}

static int add_u64(cJSON *obj, const char *key, uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  return add_str(obj, key, buf);
}

/* "a,b,c" of n decimals (at most 20 digits and a comma each). */
static char *join_u64(const uint64_t *v, size_t n) {
  char *s = fps_malloc(n * 21 + 1), *p = s;
  if (!s) return NULL;
  *p = '\0';
  for (size_t i = 0; i < n; i++) p += sprintf(p, i ? ",%" PRIu64 : "%" PRIu64, v[i]);
  return s;
}

static char *join_u32(const uint32_t *v, size_t n) {
  char *s = fps_malloc(n * 11 + 1), *p = s;
  if (!s) return NULL;
  *p = '\0';
  for (size_t i = 0; i < n; i++) p += sprintf(p, i ? ",%" PRIu32 : "%" PRIu32, v[i]);
  return s;
}

static int add_block_keys(cJSON *o, const fps_shape_t *whole, const fps_ckpt_block_t *map) {
  char *sh = join_u64(whole->dim, whole->ndim);
  char *bo = join_u64(map->bounds, (size_t)map->n_blocks + 1);
  char *bs = join_u32(map->block_shards, map->n_blocks);
  int rc = sh && bo && bs ? 0 : FPS_ENOMEM;
  if (rc == 0) {
    rc |= add_str(o, "shape", sh);
    rc |= add_u64(o, "block_index", map->block_index);
    rc |= add_str(o, "bounds", bo);
    rc |= add_str(o, "block_shards", bs);
    rc |= add_u64(o, "shard_count", map->shard_count);
  }
  fps_free(sh);
  fps_free(bo);
  fps_free(bs);
  return rc;
}

cJSON *fps__ckpt_tensor_meta(const fps_adafactor_hparams_t *hp, uint64_t version, uint64_t step,
                             float rms, double last_lr, double last_weight_decay,
                             const fps_shape_t *whole, const fps_ckpt_block_t *map) {
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  int rc = 0;
  rc |= add_u64(o, "version", version);
  rc |= add_u64(o, "step", step);
  /* A diverged run has a NaN or infinite RMS; store it as such, so the
   * checkpoint restores what was there rather than becoming unreadable. */
  if (isnan(rms)) rc |= add_str(o, "rms", "nan");
  else if (isinf(rms)) rc |= add_str(o, "rms", rms > 0 ? "inf" : "-inf");
  else rc |= add_double(o, "rms", (double)rms);
  rc |= add_str(o, "flavor", fps_flavor_name(hp->flavor));
  rc |= add_str(o, "has_lr", hp->has_lr ? "true" : "false");
  rc |= add_double(o, "lr", hp->lr);
  rc |= add_double(o, "decay", hp->decay);
  rc |= add_double(o, "eps1", hp->eps1);
  rc |= add_double(o, "eps2", hp->eps2);
  rc |= add_double(o, "clip", hp->clip);
  rc |= add_double(o, "weight_decay", hp->weight_decay);
  rc |= add_str(o, "maximize", hp->maximize ? "true" : "false");
  rc |= add_str(o, "has_beta1", hp->has_beta1 ? "true" : "false");
  rc |= add_double(o, "beta1", hp->beta1);
  rc |= add_str(o, "scale_parameter", hp->scale_parameter ? "true" : "false");
  rc |= add_str(o, "relative_step", hp->relative_step ? "true" : "false");
  rc |= add_str(o, "warmup_init", hp->warmup_init ? "true" : "false");
  rc |= add_double(o, "last_lr", last_lr);
  rc |= add_double(o, "last_weight_decay", last_weight_decay);
  if (whole && map && map->n_blocks) rc |= add_block_keys(o, whole, map);
  if (rc) {
    cJSON_Delete(o);
    return NULL;
  }
  return o;
}

static int parse_double(const char *s, double *out) {
  /* strtod would skip leading blanks and accept "nan"/"inf"; only what
   * "%.17g" of a finite double prints is accepted. */
  if (!(s[0] == '-' || (s[0] >= '0' && s[0] <= '9'))) return FPS_EFORMAT;
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || !isfinite(v)) return FPS_EFORMAT;
  *out = v;
  return 0;
}

static int parse_bool(const char *s, bool *out) {
  if (strcmp(s, "true") == 0) *out = true;
  else if (strcmp(s, "false") == 0) *out = false;
  else return FPS_EFORMAT;
  return 0;
}

/* Every key of the per-tensor object, each at most once; all required but
 * the last two (the values the last update applied, added after format
 * version 1's first writers: TM_OPTIONAL and later are optional) and the
 * block keys (TM_BLOCK and later: all or none). */
#define TENSOR_META_KEYS(X)                                                           \
  X(version) X(step) X(rms) X(flavor) X(has_lr) X(lr) X(decay) X(eps1) X(eps2) X(clip) \
  X(weight_decay) X(maximize) X(has_beta1) X(beta1) X(scale_parameter) X(relative_step) \
  X(warmup_init) X(last_lr) X(last_weight_decay) X(shape) X(block_index) X(bounds)      \
  X(block_shards) X(shard_count)

enum {
#define TM_ENUM(k) TM_##k,
  TENSOR_META_KEYS(TM_ENUM)
#undef TM_ENUM
  TM_COUNT
};
#define TM_OPTIONAL TM_last_lr
#define TM_BLOCK TM_shape

/* A list of at most `max` strict decimals joined by ",", into a new
 * array (fps_malloc). Returns the count (>= 1), 0 if malformed or too
 * long, -1 out of memory. */
static long parse_u64_list(const char *s, size_t max, uint64_t **out) {
  *out = NULL;
  size_t n = 1;
  for (const char *p = s; *p; p++) n += *p == ',';
  if (!*s || n > max) return 0;
  uint64_t *v = fps_malloc(n * sizeof *v);
  if (!v) return -1;
  const char *p = s;
  for (size_t i = 0; i < n; i++) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    char buf[24];
    if (len == 0 || len > 20) goto bad;
    memcpy(buf, p, len);
    buf[len] = '\0';
    if (fps__ckpt_parse_u64(buf, &v[i]) < 0) goto bad;
    p += len + (e ? 1 : 0);
  }
  *out = v;
  return (long)n;
bad:
  fps_free(v);
  return 0;
}

/* The block keys (all present). Returns 0, FPS_EFORMAT naming the key
 * (in *bad) or FPS_ENOMEM. */
static int parse_block_keys(const char *const *val, fps_shape_t *whole, fps_ckpt_block_t *map,
                            int *bad) {
  uint64_t *dims = NULL, *sh = NULL, v;
  memset(map, 0, sizeof *map);
  long n = parse_u64_list(val[TM_shape], FPS_MAX_DIMS, &dims);
  if (n <= 0) {
    *bad = TM_shape;
    return n < 0 ? FPS_ENOMEM : FPS_EFORMAT;
  }
  whole->ndim = (uint32_t)n;
  memcpy(whole->dim, dims, (size_t)n * sizeof *dims);
  fps_free(dims);
  int rc = FPS_EFORMAT;
  long nb = parse_u64_list(val[TM_bounds], FPS_SPLIT_MAX_BLOCKS + 1, &map->bounds);
  if (nb < 0) {
    rc = FPS_ENOMEM;
    goto fail;
  }
  if (nb < 2) {
    *bad = TM_bounds;
    goto fail;
  }
  map->n_blocks = (uint32_t)(nb - 1);
  long ns = parse_u64_list(val[TM_block_shards], FPS_SPLIT_MAX_BLOCKS, &sh);
  if (ns < 0) {
    rc = FPS_ENOMEM;
    goto fail;
  }
  if (ns != nb - 1) {
    *bad = TM_block_shards;
    goto fail;
  }
  map->block_shards = fps_malloc((size_t)ns * sizeof *map->block_shards);
  if (!map->block_shards) {
    rc = FPS_ENOMEM;
    goto fail;
  }
  for (long i = 0; i < ns; i++) {
    if (sh[i] > UINT32_MAX) {
      *bad = TM_block_shards;
      goto fail;
    }
    map->block_shards[i] = (uint32_t)sh[i];
  }
  if (fps__ckpt_parse_u64(val[TM_block_index], &v) < 0 || v > UINT32_MAX) {
    *bad = TM_block_index;
    goto fail;
  }
  map->block_index = (uint32_t)v;
  if (fps__ckpt_parse_u64(val[TM_shard_count], &v) < 0 || v > UINT32_MAX) {
    *bad = TM_shard_count;
    goto fail;
  }
  map->shard_count = (uint32_t)v;
  fps_free(sh);
  return 0;
fail:
  fps_free(sh);
  fps__ckpt_block_free(map);
  return rc;
}

static const char *const tm_names[TM_COUNT] = {
#define TM_NAME(k) #k,
    TENSOR_META_KEYS(TM_NAME)
#undef TM_NAME
};

int fps__ckpt_tensor_meta_parse(const char *text, fps_adafactor_hparams_t *hp, uint64_t *version,
                                uint64_t *step, float *rms, double *last_lr, double *last_weight_decay,
                                fps_shape_t *whole, fps_ckpt_block_t *map, char *why, size_t why_len) {
  const char *val[TM_COUNT] = {0};
  int rc = FPS_EFORMAT;
  memset(map, 0, sizeof *map);
  fps__ckpt_json_init();
  cJSON *o = cJSON_Parse(text);
  if (!o || !cJSON_IsObject(o)) {
    fps__ckpt_why(why, why_len, "tensor metadata is not a JSON object");
    goto fail;
  }
  for (const cJSON *it = o->child; it; it = it->next) {
    int k = 0;
    while (k < TM_COUNT && strcmp(it->string, tm_names[k]) != 0) k++;
    if (k == TM_COUNT) {
      fps__ckpt_why(why, why_len, "unknown tensor metadata key \"%.64s\"", it->string);
      goto fail;
    }
    if (val[k]) {
      fps__ckpt_why(why, why_len, "duplicate tensor metadata key \"%s\"", tm_names[k]);
      goto fail;
    }
    if (!cJSON_IsString(it)) {
      fps__ckpt_why(why, why_len, "tensor metadata \"%s\" is not a string", tm_names[k]);
      goto fail;
    }
    val[k] = it->valuestring;
  }
  for (int k = 0; k < TM_OPTIONAL; k++) {
    if (!val[k]) {
      fps__ckpt_why(why, why_len, "tensor metadata lacks \"%s\"", tm_names[k]);
      goto fail;
    }
  }

  fps_adafactor_hparams_t h;
  memset(&h, 0, sizeof h);
  double r = 0;
  int bad = -1;
  /* rms: a float printed exactly, or what a diverged run holds. */
  bool rms_ok = true;
  if (strcmp(val[TM_rms], "nan") == 0) r = NAN;
  else if (strcmp(val[TM_rms], "inf") == 0) r = INFINITY;
  else if (strcmp(val[TM_rms], "-inf") == 0) r = -INFINITY;
  else rms_ok = parse_double(val[TM_rms], &r) == 0 && fabs(r) <= FLT_MAX && (double)(float)r == r;
  if (fps__ckpt_parse_u64(val[TM_version], version) < 0 || *version > FPS_MAX_STEP) bad = TM_version;
  else if (fps__ckpt_parse_u64(val[TM_step], step) < 0 || *step > FPS_MAX_STEP) bad = TM_step;
  else if (!rms_ok) bad = TM_rms;
  else if (fps_flavor_parse(val[TM_flavor], &h.flavor) < 0) bad = TM_flavor;
  else if (parse_bool(val[TM_has_lr], &h.has_lr) < 0) bad = TM_has_lr;
  else if (parse_double(val[TM_lr], &h.lr) < 0) bad = TM_lr;
  else if (parse_double(val[TM_decay], &h.decay) < 0) bad = TM_decay;
  else if (parse_double(val[TM_eps1], &h.eps1) < 0) bad = TM_eps1;
  else if (parse_double(val[TM_eps2], &h.eps2) < 0) bad = TM_eps2;
  else if (parse_double(val[TM_clip], &h.clip) < 0) bad = TM_clip;
  else if (parse_double(val[TM_weight_decay], &h.weight_decay) < 0) bad = TM_weight_decay;
  else if (parse_bool(val[TM_maximize], &h.maximize) < 0) bad = TM_maximize;
  else if (parse_bool(val[TM_has_beta1], &h.has_beta1) < 0) bad = TM_has_beta1;
  else if (parse_double(val[TM_beta1], &h.beta1) < 0) bad = TM_beta1;
  else if (parse_bool(val[TM_scale_parameter], &h.scale_parameter) < 0) bad = TM_scale_parameter;
  else if (parse_bool(val[TM_relative_step], &h.relative_step) < 0) bad = TM_relative_step;
  else if (parse_bool(val[TM_warmup_init], &h.warmup_init) < 0) bad = TM_warmup_init;
  double llr = h.has_lr ? h.lr : 0.0, lwd = h.weight_decay;
  if (bad < 0 && val[TM_last_lr] && (parse_double(val[TM_last_lr], &llr) < 0 || llr < 0)) bad = TM_last_lr;
  if (bad < 0 && val[TM_last_weight_decay] && (parse_double(val[TM_last_weight_decay], &lwd) < 0 || lwd < 0))
    bad = TM_last_weight_decay;
  int nblock = 0;
  for (int k = TM_BLOCK; k < TM_COUNT; k++) nblock += val[k] != NULL;
  if (bad < 0 && nblock && nblock != TM_COUNT - TM_BLOCK) {
    for (int k = TM_BLOCK; k < TM_COUNT; k++)
      if (!val[k]) {
        fps__ckpt_why(why, why_len, "tensor metadata of a row block lacks \"%s\"", tm_names[k]);
        goto fail;
      }
  }
  if (bad < 0 && nblock && (rc = parse_block_keys(val, whole, map, &bad)) == FPS_ENOMEM) {
    fps__ckpt_why(why, why_len, "out of memory for a block map");
    goto fail;
  }
  rc = FPS_EFORMAT;
  if (bad >= 0) {
    fps__ckpt_why(why, why_len, "tensor metadata \"%s\" has a bad value \"%.40s\"", tm_names[bad],
                  val[bad]);
    goto fail;
  }
  char hwhy[160] = "";
  rc = fps_adafactor_validate(&h, hwhy, sizeof hwhy);
  if (rc < 0) {
    fps__ckpt_why(why, why_len, "invalid hyperparameters: %s", hwhy);
    goto fail;
  }
  *hp = h;
  *rms = (float)r;
  *last_lr = llr;
  *last_weight_decay = lwd;
  rc = 0;
fail:
  if (rc) fps__ckpt_block_free(map);
  cJSON_Delete(o);
  return rc;
}

/* ----------------------------------------------------- directory scan */

static int file_cmp_newest_first(const void *a, const void *b) {
  const fps__ckpt_file_t *x = a, *y = b;
  if (x->seq != y->seq) return x->seq < y->seq ? 1 : -1;
  return -strcmp(x->name, y->name);
}

int fps__ckpt_scan(int dirfd, fps__ckpt_file_t **files, size_t *n) {
  *files = NULL;
  *n = 0;
  /* fdopendir takes over its fd: scan through a duplicate so the caller's
   * fd (and the flock on it) stays open. */
  int fd = dup(dirfd);
  if (fd < 0) return FPS_EIO;
  DIR *d = fdopendir(fd);
  if (!d) {
    int e = errno;
    close(fd);
    errno = e;
    return FPS_EIO;
  }
  rewinddir(d);
  fps__ckpt_file_t *v = NULL;
  size_t len = 0, cap = 0;
  int rc = 0;
  for (;;) {
    errno = 0;
    struct dirent *de = readdir(d);
    if (!de) {
      if (errno) rc = FPS_EIO;
      break;
    }
    uint64_t seq;
    if (!fps__ckpt_name_seq(de->d_name, &seq) || strlen(de->d_name) >= sizeof v->name) continue;
    if (len == cap) {
      size_t nc = cap ? 2 * cap : 16;
      fps__ckpt_file_t *nv = fps_realloc(v, nc * sizeof *nv);
      if (!nv) {
        rc = FPS_ENOMEM;
        break;
      }
      v = nv;
      cap = nc;
    }
    v[len].seq = seq;
    snprintf(v[len].name, sizeof v[len].name, "%s", de->d_name);
    len++;
  }
  int e = errno;
  closedir(d);
  errno = e;
  if (rc < 0) {
    fps_free(v);
    return rc;
  }
  if (len) qsort(v, len, sizeof *v, file_cmp_newest_first);
  *files = v;
  *n = len;
  return 0;
}

/* ---------------------------------------------------- directory lease */

/* mkdir that survives a crash: the new entry lives in the parent, so the
 * parent is fsynced too. */
static int make_dir_durable(const char *dir) {
  if (mkdir(dir, 0700) < 0) return errno == EEXIST ? 0 : -1;
  char parent[FPS_CKPT_PATH_MAX];
  snprintf(parent, sizeof parent, "%s", dir);
  size_t n = strlen(parent);
  while (n > 1 && parent[n - 1] == '/') parent[--n] = '\0';
  char *slash = strrchr(parent, '/');
  if (!slash) snprintf(parent, sizeof parent, ".");
  else if (slash == parent) parent[1] = '\0';
  else *slash = '\0';
  int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  int e = errno;
  close(fd);
  errno = e;
  return rc;
}

int fps_ckpt_dir_lock(const char *dir, bool create, char *why, size_t why_len) {
  if (!dir || !*dir || strlen(dir) + sizeof "/.lock" > FPS_CKPT_PATH_MAX) {
    fps__ckpt_why(why, why_len, "no checkpoint directory, or its path is too long");
    return FPS_EINVAL;
  }
  if (create && make_dir_durable(dir) < 0) {
    fps__ckpt_why(why, why_len, "create %s: %s", dir, strerror(errno));
    return FPS_EIO;
  }
  struct stat st;
  if (stat(dir, &st) < 0) {
    int rc = errno == ENOENT ? FPS_ENOTFOUND : FPS_EIO;
    fps__ckpt_why(why, why_len, "%s: %s", dir, strerror(errno));
    return rc;
  }
  if (!S_ISDIR(st.st_mode)) {
    fps__ckpt_why(why, why_len, "%s is not a directory", dir);
    return FPS_EIO;
  }
  if (access(dir, W_OK | X_OK) < 0) {
    fps__ckpt_why(why, why_len, "%s is not writable: %s", dir, strerror(errno));
    return FPS_EIO;
  }
  char path[FPS_CKPT_PATH_MAX];
  snprintf(path, sizeof path, "%s/.lock", dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    fps__ckpt_why(why, why_len, "open %s: %s", path, strerror(errno));
    return FPS_EIO;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int e = errno;
    char pid[24] = "";
    ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
    pid[n > 0 ? n : 0] = '\0';
    pid[strcspn(pid, "\n")] = '\0';
    close(fd);
    if (e == EWOULDBLOCK) {
      fps__ckpt_why(why, why_len, "%s is in use by another shard process (pid %s)", dir,
                    pid[0] ? pid : "unknown");
      return FPS_EAGAIN;
    }
    fps__ckpt_why(why, why_len, "lock %s: %s", path, strerror(e));
    return FPS_EIO;
  }
  /* Only a diagnostic for the next process that finds the lock taken. */
  char buf[24];
  int len = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
  if (ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)len, 0) < 0) { /* best effort */
  }
  return fd;
}

/* Golden-vector cases: parse hparams.txt, run the steps, read/write the raw
 * float32 files. Shared by `factorps replay` and tests/unit. */
#include "golden.h"

#include "alloc.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "golden vectors are little-endian float32; a big-endian host needs byte swaps here"
#endif

const char *const fps_golden_state_names[FPS_GOLDEN_NSTATE] = {"row", "col", "var", "mom"};

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

void fps_golden_list_free(char **names, size_t n) {
  if (!names) return;
  for (size_t i = 0; i < n; i++) fps_free(names[i]);
  fps_free(names);
}

int fps_golden_list(const char *dir, char ***names_out, size_t *n_out, char *why, size_t why_len) {
  *names_out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d) return fps_errorf(FPS_EIO, why, why_len, "cannot open %s: %s", dir, strerror(errno));
  char **names = NULL;
  size_t n = 0, cap = 0;
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[PATH_MAX];
    struct stat sb;
    if (snprintf(path, sizeof path, "%s/%s/hparams.txt", dir, e->d_name) >= (int)sizeof path)
      continue;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (n == cap) {
      size_t nc = cap ? 2 * cap : 64;
      char **nn = fps_realloc(names, nc * sizeof *nn);
      if (!nn) {
        rc = FPS_ENOMEM;
        goto fail;
      }
      names = nn;
      cap = nc;
    }
    if (!(names[n] = fps_strdup(e->d_name))) {
      rc = FPS_ENOMEM;
      goto fail;
    }
    n++;
  }
  closedir(d);
  if (n) qsort(names, n, sizeof *names, cmp_str);
  *names_out = names;
  *n_out = n;
  return 0;
fail:
  closedir(d);
  fps_golden_list_free(names, n);
  return fps_errorf(rc, why, why_len, "out of memory listing %s", dir);
}

/* "none" -> has=false; else a finite or non-finite double (validation
 * later rejects non-finite). */
static int parse_opt_num(const char *v, bool *has, double *out) {
  if (!strcmp(v, "none")) {
    *has = false;
    return 0;
  }
  char *end;
  errno = 0;
  double d = strtod(v, &end);
  if (end == v || *end || errno == ERANGE) return -1;
  *has = true;
  *out = d;
  return 0;
}

static int parse_num(const char *v, double *out) {
  bool has;
  return parse_opt_num(v, &has, out) == 0 && has ? 0 : -1;
}

static int parse_bool(const char *v, bool *out) {
  if (!strcmp(v, "true")) *out = true;
  else if (!strcmp(v, "false")) *out = false;
  else return -1;
  return 0;
}

static int parse_shape(char *v, fps_shape_t *s) {
  memset(s, 0, sizeof *s);
  char *save = NULL;
  for (char *tok = strtok_r(v, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
    if (s->ndim >= FPS_MAX_DIMS) return -1;
    char *end;
    errno = 0;
    if (*tok == '-') return -1;
    unsigned long long d = strtoull(tok, &end, 10);
    if (end == tok || *end || errno) return -1;
    s->dim[s->ndim++] = d;
  }
  return 0;
}

int fps_golden_load(const char *dir, const char *name, fps_golden_case_t *c, char *why,
                    size_t why_len) {
  memset(c, 0, sizeof *c);
  if (snprintf(c->name, sizeof c->name, "%s", name) >= (int)sizeof c->name ||
      snprintf(c->dir, sizeof c->dir, "%s/%s", dir, name) >= (int)sizeof c->dir)
    return fps_errorf(FPS_EINVAL, why, why_len, "case path too long: %s/%s", dir, name);
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/hparams.txt", c->dir);
  FILE *f = fopen(path, "r");
  if (!f) return fps_errorf(FPS_EIO, why, why_len, "cannot open %s: %s", path, strerror(errno));

  /* Flavor first: the defaults depend on it, and the file's order is not
   * promised. So read all lines, then apply them. */
  char lines[64][512];
  size_t nl = 0;
  int rc = 0, ndim = -1;
  bool have_flavor = false, have_shape = false, have_steps = false;
  while (nl < 64 && fgets(lines[nl], sizeof lines[nl], f)) {
    size_t len = strlen(lines[nl]);
    if (len && lines[nl][len - 1] != '\n' && !feof(f)) {
      fclose(f);
      return fps_errorf(FPS_EFORMAT, why, why_len, "%s: line %zu too long", path, nl + 1);
    }
    while (len && (lines[nl][len - 1] == '\n' || lines[nl][len - 1] == '\r')) lines[nl][--len] = 0;
    if (len) nl++;
  }
  bool more = !feof(f);
  fclose(f);
  if (more) return fps_errorf(FPS_EFORMAT, why, why_len, "%s: too many lines", path);

  for (size_t i = 0; i < nl; i++)
    if (!strncmp(lines[i], "flavor ", 7)) {
      fps_flavor_t fl;
      if (fps_flavor_parse(lines[i] + 7, &fl))
        return fps_errorf(FPS_EFLAVOR, why, why_len, "%s: unknown flavor '%s'", path, lines[i] + 7);
      fps_adafactor_defaults(&c->hp, fl);
      have_flavor = true;
    }
  if (!have_flavor) return fps_errorf(FPS_EFORMAT, why, why_len, "%s: no flavor line", path);
  const bool hf = c->hp.flavor == FPS_FLAVOR_HF;

  for (size_t i = 0; i < nl; i++) {
    char *key = lines[i], *val = strchr(key, ' ');
    if (val) *val++ = 0;
    else val = key + strlen(key); /* "shape" of a 0-D tensor has no value */
    int bad = 0;
    if (!strcmp(key, "name") || !strcmp(key, "flavor")) {
    } else if (!strcmp(key, "shape")) {
      bad = parse_shape(val, &c->shape);
      have_shape = !bad;
    } else if (!strcmp(key, "ndim")) {
      double d;
      bad = parse_num(val, &d) || d < 0 || d > FPS_MAX_DIMS || d != floor(d);
      if (!bad) ndim = (int)d;
    } else if (!strcmp(key, "steps")) {
      double d;
      bad = parse_num(val, &d) || d < 1 || d > FPS_GOLDEN_MAX_STEPS || d != floor(d);
      if (!bad) c->steps = (unsigned)d;
      have_steps = !bad;
    } else if (!strcmp(key, "lr")) {
      bad = parse_opt_num(val, &c->hp.has_lr, &c->hp.lr);
    } else if (!strcmp(key, "eps1")) {
      bad = parse_num(val, &c->hp.eps1);
    } else if (!strcmp(key, "eps2")) {
      bad = parse_num(val, &c->hp.eps2);
    } else if (!strcmp(key, hf ? "clip_threshold" : "d")) {
      bad = parse_num(val, &c->hp.clip);
    } else if (!strcmp(key, hf ? "decay_rate" : "beta2_decay")) {
      bad = parse_num(val, &c->hp.decay);
    } else if (!strcmp(key, "weight_decay")) {
      bad = parse_num(val, &c->hp.weight_decay);
    } else if (!hf && !strcmp(key, "maximize")) {
      bad = parse_bool(val, &c->hp.maximize);
    } else if (hf && !strcmp(key, "beta1")) {
      bad = parse_opt_num(val, &c->hp.has_beta1, &c->hp.beta1);
    } else if (hf && !strcmp(key, "scale_parameter")) {
      bad = parse_bool(val, &c->hp.scale_parameter);
    } else if (hf && !strcmp(key, "relative_step")) {
      bad = parse_bool(val, &c->hp.relative_step);
    } else if (hf && !strcmp(key, "warmup_init")) {
      bad = parse_bool(val, &c->hp.warmup_init);
    } else if (!strcmp(key, "state")) {
      char *save = NULL;
      for (char *tok = strtok_r(val, " ", &save); tok && !bad; tok = strtok_r(NULL, " ", &save)) {
        int kind = -1;
        for (int s = 0; s < FPS_GOLDEN_NSTATE; s++)
          if (!strcmp(tok, fps_golden_state_names[s])) kind = s;
        if (kind < 0) bad = 1;
        else c->state_listed[kind] = true;
      }
    } else {
      /* An unknown setting could change the math: refuse it. */
      return fps_errorf(FPS_EFORMAT, why, why_len, "%s: unknown key '%s' for flavor %s", path, key,
                      fps_flavor_name(c->hp.flavor));
    }
    if (bad) return fps_errorf(FPS_EFORMAT, why, why_len, "%s: bad value '%s' for %s", path, val, key);
  }
  if (!have_shape || !have_steps)
    return fps_errorf(FPS_EFORMAT, why, why_len, "%s: needs shape and steps lines", path);
  if (ndim >= 0 && (uint32_t)ndim != c->shape.ndim)
    return fps_errorf(FPS_EFORMAT, why, why_len, "%s: ndim %d but shape has %u dims", path, ndim,
                    c->shape.ndim);
  char detail[256];
  rc = fps_shape_validate(&c->shape, &c->numel, detail, sizeof detail);
  if (rc) return fps_errorf(rc, why, why_len, "%s: %s", path, detail);
  rc = fps_adafactor_validate(&c->hp, detail, sizeof detail);
  if (rc) return fps_errorf(rc, why, why_len, "%s: %s", path, detail);
  return 0;
}

int fps_golden_read_f32(const char *path, float *buf, uint64_t n, char *why, size_t why_len) {
  FILE *f = fopen(path, "rb");
  if (!f) return fps_errorf(FPS_EIO, why, why_len, "cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  int rc = 0;
  if (fstat(fileno(f), &sb) != 0 || (uint64_t)sb.st_size != n * sizeof(float)) {
    rc = fps_errorf(FPS_EFORMAT, why, why_len, "%s: %lld bytes, expected %llu (%llu float32)", path,
                  (long long)sb.st_size, (unsigned long long)(n * sizeof(float)),
                  (unsigned long long)n);
  } else if (n && fread(buf, sizeof(float), (size_t)n, f) != n) {
    rc = fps_errorf(FPS_EIO, why, why_len, "%s: short read", path);
  }
  fclose(f);
  return rc;
}

int fps_golden_write_f32(const char *path, const float *buf, uint64_t n, char *why,
                         size_t why_len) {
  FILE *f = fopen(path, "wb");
  if (!f) return fps_errorf(FPS_EIO, why, why_len, "cannot create %s: %s", path, strerror(errno));
  size_t w = n ? fwrite(buf, sizeof(float), (size_t)n, f) : 0;
  int bad = w != n;
  if (fclose(f) != 0) bad = 1;
  return bad ? fps_errorf(FPS_EIO, why, why_len, "cannot write %s: %s", path, strerror(errno)) : 0;
}

void fps_golden_run_free(fps_golden_run_t *r) {
  if (!r) return;
  fps_free(r->params);
  fps_free(r->trace);
  fps_adafactor_state_destroy(&r->state);
  memset(r, 0, sizeof *r);
}

int fps_golden_run(const fps_golden_case_t *c, const fps_kernels_t *k, fps_pool_t *pool,
                   fps_golden_run_t *out, char *why, size_t why_len) {
  memset(out, 0, sizeof *out);
  int rc;
  float *param = NULL, *grad = NULL;
  char path[PATH_MAX + 64];
  if (c->numel > SIZE_MAX / sizeof(float) / c->steps)
    return fps_errorf(FPS_EOVERFLOW, why, why_len, "%s: too large to replay", c->name);
  const size_t n = (size_t)c->numel;
  out->steps = c->steps;
  out->numel = c->numel;
  out->params = fps_malloc((size_t)c->steps * n * sizeof(float));
  out->trace = fps_calloc(c->steps, sizeof *out->trace);
  param = fps_malloc(n * sizeof(float));
  grad = fps_malloc(n * sizeof(float));
  if (!out->params || !out->trace || !param || !grad) {
    rc = fps_errorf(FPS_ENOMEM, why, why_len, "%s: out of memory", c->name);
    goto fail;
  }
  rc = fps_adafactor_state_init(&out->state, &c->shape, &c->hp);
  if (rc) {
    fps_errorf(rc, why, why_len, "%s: cannot create state: %s", c->name, fps_strerror(rc));
    goto fail;
  }
  snprintf(path, sizeof path, "%s/param_0.bin", c->dir);
  if ((rc = fps_golden_read_f32(path, param, n, why, why_len))) goto fail;
  for (unsigned t = 1; t <= c->steps; t++) {
    snprintf(path, sizeof path, "%s/grad_%u.bin", c->dir, t);
    if ((rc = fps_golden_read_f32(path, grad, n, why, why_len))) goto fail;
    rc = fps_adafactor_step(k, &c->hp, &out->state, param, grad, pool, &out->trace[t - 1]);
    if (rc) {
      fps_errorf(rc, why, why_len, "%s: step %u failed: %s", c->name, t, fps_strerror(rc));
      goto fail;
    }
    memcpy(out->params + (size_t)(t - 1) * n, param, n * sizeof(float));
  }
  fps_free(param);
  fps_free(grad);
  return 0;
fail:
  fps_free(param);
  fps_free(grad);
  return rc;
}

const float *fps_golden_state_array(const fps_golden_run_t *r, int kind, uint64_t *n) {
  const fps_adafactor_state_t *st = &r->state;
  *n = 0;
  switch (kind) {
    case FPS_GOLDEN_ROW:
      if (st->row) *n = st->batch * st->rows;
      return st->row;
    case FPS_GOLDEN_COL:
      if (st->col) *n = st->batch * st->cols;
      return st->col;
    case FPS_GOLDEN_VAR:
      if (st->var) *n = st->numel;
      return st->var;
    case FPS_GOLDEN_MOM:
      if (st->mom) *n = st->numel;
      return st->mom;
  }
  return NULL;
}

static int mkdir_p(const char *path) {
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) return -1;
  for (char *p = tmp + 1; *p; p++)
    if (*p == '/') {
      *p = 0;
      if (mkdir(tmp, 0777) != 0 && errno != EEXIST) return -1;
      *p = '/';
    }
  return mkdir(tmp, 0777) != 0 && errno != EEXIST ? -1 : 0;
}

int fps_golden_write_results(const fps_golden_case_t *c, const fps_golden_run_t *r,
                             const char *out_dir, char *why, size_t why_len) {
  char dir[PATH_MAX], path[PATH_MAX + 32];
  if (snprintf(dir, sizeof dir, "%s/%s", out_dir, c->name) >= (int)sizeof dir)
    return fps_errorf(FPS_EINVAL, why, why_len, "output path too long");
  if (mkdir_p(dir) != 0)
    return fps_errorf(FPS_EIO, why, why_len, "cannot create %s: %s", dir, strerror(errno));
  for (unsigned t = 1; t <= r->steps; t++) {
    snprintf(path, sizeof path, "%s/param_%u.bin", dir, t);
    int rc = fps_golden_write_f32(path, r->params + (size_t)(t - 1) * r->numel, r->numel, why,
                                  why_len);
    if (rc) return rc;
  }
  for (int kind = 0; kind < FPS_GOLDEN_NSTATE; kind++) {
    uint64_t n;
    const float *a = fps_golden_state_array(r, kind, &n);
    if (!a) continue;
    snprintf(path, sizeof path, "%s/state_%s.bin", dir, fps_golden_state_names[kind]);
    int rc = fps_golden_write_f32(path, a, n, why, why_len);
    if (rc) return rc;
  }
  return 0;
}

/* Adafactor hyperparameters, shapes and state: defaults, validation (the
 * upstream constructors' rejections, never a silent fix-up), state sizes
 * and allocation. The step itself is in adafactor_step.c. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adafactor.h"
#include "error.h"

#include "alloc.h"

void fps_adafactor_defaults(fps_adafactor_hparams_t *hp, fps_flavor_t flavor) {
  memset(hp, 0, sizeof *hp);
  hp->flavor = flavor;
  hp->decay = -0.8;
  hp->eps2 = 1e-3;
  hp->clip = 1.0;
  hp->weight_decay = 0.0;
  hp->scale_parameter = true;
  if (flavor == FPS_FLAVOR_HF) {
    hp->has_lr = false; /* relative_step picks the lr */
    hp->lr = 0.0;
    hp->eps1 = 1e-30;
    hp->relative_step = true;
  } else {
    /* torch: always scales by RMS(param) and caps rho at lr, which is what
     * scale_parameter=true, relative_step=false mean in hf terms. */
    hp->has_lr = true;
    hp->lr = 1e-2;
    hp->eps1 = (double)FLT_EPSILON;
    hp->relative_step = false;
  }
}

int fps_flavor_parse(const char *s, fps_flavor_t *out) {
  if (s && !strcmp(s, "torch")) {
    *out = FPS_FLAVOR_TORCH;
    return 0;
  }
  if (s && !strcmp(s, "hf")) {
    *out = FPS_FLAVOR_HF;
    return 0;
  }
  return FPS_EFLAVOR;
}

const char *fps_flavor_name(fps_flavor_t f) {
  switch (f) {
    case FPS_FLAVOR_TORCH: return "torch";
    case FPS_FLAVOR_HF: return "hf";
  }
  return "unknown";
}

int fps_adafactor_validate(const fps_adafactor_hparams_t *hp, char *why, size_t why_len) {
  if (!hp) return fps_errorf(FPS_EINVAL, why, why_len, "no hyperparameters given");
  if (hp->flavor != FPS_FLAVOR_TORCH && hp->flavor != FPS_FLAVOR_HF)
    return fps_errorf(FPS_EFLAVOR, why, why_len, "unknown optimizer flavor %d (expected torch or hf)",
                    (int)hp->flavor);
  const bool hf = hp->flavor == FPS_FLAVOR_HF;
  const char *fl = fps_flavor_name(hp->flavor);
  /* Upstream names, so the message matches what the user typed. */
  const char *n_decay = hf ? "decay_rate" : "beta2_decay";
  const char *n_clip = hf ? "clip_threshold" : "d";
  struct {
    const char *name;
    double v;
    bool used;
  } nums[] = {
      {"lr", hp->lr, hp->has_lr},         {n_decay, hp->decay, true},
      {"eps1", hp->eps1, true},           {"eps2", hp->eps2, true},
      {n_clip, hp->clip, true},           {"weight_decay", hp->weight_decay, true},
      {"beta1", hp->beta1, hp->has_beta1},
  };
  for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
    if (nums[i].used && !isfinite(nums[i].v))
      return fps_errorf(FPS_EHPARAM, why, why_len, "%s must be finite, got %g", nums[i].name,
                      nums[i].v);

  if (hp->has_lr && hp->lr < 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "lr must be >= 0, got %g", hp->lr);
  if (hp->decay > 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "%s must be <= 0, got %g", n_decay, hp->decay);
  if (hp->eps1 < 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "eps1 must be >= 0, got %g", hp->eps1);
  if (hp->eps2 < 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "eps2 must be >= 0, got %g", hp->eps2);
  if (hp->clip <= 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "%s must be > 0, got %g", n_clip, hp->clip);
  /* torch.optim.Adafactor refuses d < 1 ("Clipping threshold d should be
   * >= 1"); transformers' clip_threshold has no such bound. */
  if (!hf && hp->clip < 1)
    return fps_errorf(FPS_EHPARAM, why, why_len, "d (the clipping threshold) must be >= 1 as in torch, got %g",
                    hp->clip);
  if (hp->weight_decay < 0)
    return fps_errorf(FPS_EHPARAM, why, why_len, "weight_decay must be >= 0, got %g",
                    hp->weight_decay);

  if (hf) {
    if (hp->maximize)
      return fps_errorf(FPS_EHPARAM, why, why_len, "maximize is a torch option; hf has none");
    if (hp->has_lr && hp->relative_step)
      return fps_errorf(FPS_EHPARAM, why, why_len,
                      "cannot combine a manual lr with relative_step=true");
    if (!hp->has_lr && !hp->relative_step)
      return fps_errorf(FPS_EHPARAM, why, why_len, "lr is required when relative_step=false");
    if (hp->warmup_init && !hp->relative_step)
      return fps_errorf(FPS_EHPARAM, why, why_len, "warmup_init=true requires relative_step=true");
    if (hp->has_beta1 && !(hp->beta1 >= 0 && hp->beta1 < 1))
      return fps_errorf(FPS_EHPARAM, why, why_len, "beta1 must be in [0, 1), got %g", hp->beta1);
  } else {
    if (!hp->has_lr) return fps_errorf(FPS_EHPARAM, why, why_len, "torch needs an lr");
    if (hp->has_beta1)
      return fps_errorf(FPS_EHPARAM, why, why_len, "beta1 is an hf option; %s has no momentum", fl);
    if (hp->relative_step)
      return fps_errorf(FPS_EHPARAM, why, why_len, "relative_step is an hf option; %s has none", fl);
    if (hp->warmup_init)
      return fps_errorf(FPS_EHPARAM, why, why_len, "warmup_init is an hf option; %s has none", fl);
    if (!hp->scale_parameter)
      return fps_errorf(FPS_EHPARAM, why, why_len,
                      "scale_parameter=false is an hf option; %s always scales", fl);
  }
  return 0;
}

/* Shortest of %.15g / %.17g that reads back as the same double, so 0.9
 * prints as "0.9" but values differing in the last bit still differ. */
static const char *fmt_num(char buf[32], double v) {
  snprintf(buf, 32, "%.15g", v);
  if (strtod(buf, NULL) != v) snprintf(buf, 32, "%.17g", v);
  return buf;
}

int fps_adafactor_hparams_diff(const fps_adafactor_hparams_t *a, const fps_adafactor_hparams_t *b,
                               char *why, size_t why_len) {
  if (a->flavor != b->flavor)
    return fps_errorf(FPS_EEXISTS, why, why_len, "flavor %s vs %s", fps_flavor_name(a->flavor),
                    fps_flavor_name(b->flavor));
#define FPS_DIFF_BOOL(f)                                                                 \
  if (a->f != b->f)                                                                      \
    return fps_errorf(FPS_EEXISTS, why, why_len, #f " %s vs %s", a->f ? "true" : "false", \
                    b->f ? "true" : "false");
#define FPS_DIFF_NUM(f)                                                                   \
  if (memcmp(&a->f, &b->f, sizeof a->f) != 0 && !(a->f == b->f)) {                       \
    char x[32], y[32];                                                                    \
    return fps_errorf(FPS_EEXISTS, why, why_len, #f " %s vs %s", fmt_num(x, a->f),         \
                    fmt_num(y, b->f));                                                    \
  }
  FPS_DIFF_BOOL(has_lr)
  if (a->has_lr) FPS_DIFF_NUM(lr)
  FPS_DIFF_NUM(decay)
  FPS_DIFF_NUM(eps1)
  FPS_DIFF_NUM(eps2)
  FPS_DIFF_NUM(clip)
  FPS_DIFF_NUM(weight_decay)
  FPS_DIFF_BOOL(maximize)
  FPS_DIFF_BOOL(has_beta1)
  if (a->has_beta1) FPS_DIFF_NUM(beta1)
  FPS_DIFF_BOOL(scale_parameter)
  FPS_DIFF_BOOL(relative_step)
  FPS_DIFF_BOOL(warmup_init)
#undef FPS_DIFF_BOOL
#undef FPS_DIFF_NUM
  return 0;
}

int fps_adafactor_hparams_diff_fixed(const fps_adafactor_hparams_t *a, const fps_adafactor_hparams_t *b,
                                     char *why, size_t why_len) {
  if (a->flavor == b->flavor && a->relative_step != b->relative_step)
    return fps_errorf(FPS_EEXISTS, why, why_len, "relative_step %s vs %s", a->relative_step ? "true" : "false",
                    b->relative_step ? "true" : "false");
  fps_adafactor_hparams_t x = *b;
  if (x.has_lr == a->has_lr) x.lr = a->lr;
  x.weight_decay = a->weight_decay;
  return fps_adafactor_hparams_diff(a, &x, why, why_len);
}

int fps_shape_validate(const fps_shape_t *s, uint64_t *numel, char *why, size_t why_len) {
  if (!s) return fps_errorf(FPS_EINVAL, why, why_len, "no shape given");
  if (s->ndim > FPS_MAX_DIMS)
    return fps_errorf(FPS_ESHAPE, why, why_len, "%u dimensions, at most %d allowed", s->ndim,
                    FPS_MAX_DIMS);
  uint64_t n = 1;
  for (uint32_t i = 0; i < s->ndim; i++) {
    if (s->dim[i] == 0)
      return fps_errorf(FPS_ESHAPE, why, why_len, "dimension %u is 0 (zero-sized tensors are not allowed)",
                      i);
    /* n * dim <= MAX  <=>  dim <= MAX / n, checked before multiplying. */
    if (s->dim[i] > FPS_MAX_NUMEL / n)
      return fps_errorf(FPS_EOVERFLOW, why, why_len,
                      "element count exceeds %llu at dimension %u (size %llu)",
                      (unsigned long long)FPS_MAX_NUMEL, i, (unsigned long long)s->dim[i]);
    n *= s->dim[i];
  }
  if (numel) *numel = n;
  return 0;
}

/* Factored layout of a validated shape: batch x rows x cols. */
static bool shape_factor(const fps_shape_t *s, uint64_t *batch, uint64_t *rows, uint64_t *cols) {
  if (s->ndim < 2) return false;
  uint64_t b = 1;
  for (uint32_t i = 0; i + 2 < s->ndim; i++) b *= s->dim[i];
  *batch = b;
  *rows = s->dim[s->ndim - 2];
  *cols = s->dim[s->ndim - 1];
  return true;
}

int fps_adafactor_state_size(const fps_shape_t *s, const fps_adafactor_hparams_t *hp,
                             fps_state_size_t *out) {
  uint64_t numel, batch, rows, cols;
  if (!s || !hp || !out) return FPS_EINVAL;
  int rc = fps_shape_validate(s, &numel, NULL, 0);
  if (rc) return rc;
  memset(out, 0, sizeof *out);
  if (shape_factor(s, &batch, &rows, &cols)) {
    out->row = batch * rows;
    out->col = batch * cols;
  } else {
    out->var = numel;
  }
  if (hp->flavor == FPS_FLAVOR_HF && hp->has_beta1) out->mom = numel;
  out->elements = out->row + out->col + out->var + out->mom;
  out->bytes = out->elements * sizeof(float);
  out->adamw_elements = 2 * numel;
  out->adamw_bytes = out->adamw_elements * sizeof(float);
  return 0;
}

static float *alloc_zeroed(uint64_t n) {
  if (n > SIZE_MAX / sizeof(float)) return NULL;
  return fps_calloc((size_t)n, sizeof(float));
}

int fps_adafactor_state_init(fps_adafactor_state_t *st, const fps_shape_t *s,
                             const fps_adafactor_hparams_t *hp) {
  if (!st) return FPS_EINVAL;
  memset(st, 0, sizeof *st);
  int rc = fps_adafactor_validate(hp, NULL, 0);
  if (rc) return rc;
  fps_state_size_t sz;
  rc = fps_adafactor_state_size(s, hp, &sz);
  if (rc) return rc;
  st->shape = *s;
  fps_shape_validate(s, &st->numel, NULL, 0);
  st->factored = shape_factor(s, &st->batch, &st->rows, &st->cols);
  if (!st->factored) {
    st->batch = 1;
    st->rows = 1;
    st->cols = st->numel;
  }
  if ((sz.row && !(st->row = alloc_zeroed(sz.row))) || (sz.col && !(st->col = alloc_zeroed(sz.col))) ||
      (sz.var && !(st->var = alloc_zeroed(sz.var))) || (sz.mom && !(st->mom = alloc_zeroed(sz.mom)))) {
    fps_adafactor_state_destroy(st);
    return FPS_ENOMEM;
  }
  return 0;
}

void fps_adafactor_state_destroy(fps_adafactor_state_t *st) {
  if (!st) return;
  fps_free(st->row);
  fps_free(st->col);
  fps_free(st->var);
  fps_free(st->mom);
  memset(st, 0, sizeof *st);
}

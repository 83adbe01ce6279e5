/* Wire-to-internal conversion and the validation every handler shares, so
 * the same bad input gets the same status and wording from every method. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "wire.h"

/* Strict UTF-8: no overlongs, no surrogates, nothing above U+10FFFF. */
static bool fps__utf8_valid(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    size_t k;
    unsigned min;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      k = 1, min = 0x80, c &= 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      k = 2, min = 0x800, c &= 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      k = 3, min = 0x10000, c &= 0x07;
    } else {
      return false;
    }
    for (size_t j = 1; j <= k; j++) {
      if (i + j >= n || (s[i + j] & 0xc0) != 0x80) return false;
      c = (c << 6) | (s[i + j] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return false;
    i += k + 1;
  }
  return true;
}

grpc_status_code fps_wire_name(const char *name, char *why, size_t why_len) {
  size_t n = name ? strlen(name) : 0;
  if (n == 0) {
    snprintf(why, why_len, "tensor name is empty (names are 1..%d bytes of UTF-8)", FPS_NAME_MAX);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (n > FPS_NAME_MAX) {
    snprintf(why, why_len, "tensor name '%.40s...' is %zu bytes long, longer than the limit of %d", name, n,
             FPS_NAME_MAX);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (!fps__utf8_valid((const unsigned char *)name, n)) {
    snprintf(why, why_len, "tensor name is not valid UTF-8");
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  return GRPC_STATUS_OK;
}

grpc_status_code fps_wire_shape(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out,
                                uint64_t *numel, char *why, size_t why_len) {
  memset(out, 0, sizeof *out);
  if (n > FPS_MAX_DIMS) {
    snprintf(why, why_len, "tensor '%s': shape has %zu dimensions, at most %d are supported", name, n,
             FPS_MAX_DIMS);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  out->ndim = (uint32_t)n;
  for (size_t i = 0; i < n; i++) out->dim[i] = dims[i];
  char kwhy[256] = "";
  int rc = fps_shape_validate(out, numel, kwhy, sizeof kwhy);
  if (rc < 0) {
    char sh[256];
    fps_shape_format(out, sh, sizeof sh);
    snprintf(why, why_len, "tensor '%s': invalid shape %s: %s", name, sh, kwhy);
    return rc == FPS_EOVERFLOW ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_INVALID_ARGUMENT;
  }
  return GRPC_STATUS_OK;
}

grpc_status_code fps_wire_hparams(const char *name, const Factorps__V1__AdafactorConfig *c,
                                  fps_adafactor_hparams_t *hp, char *why, size_t why_len) {
  if (!c) {
    snprintf(why, why_len, "tensor '%s': optimizer settings are missing", name);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (c->flavor != FACTORPS__V1__FLAVOR__FLAVOR_TORCH && c->flavor != FACTORPS__V1__FLAVOR__FLAVOR_HF) {
    snprintf(why, why_len, "tensor '%s': optimizer flavor %d is not torch (1) or hf (2)", name, (int)c->flavor);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  bool torch = c->flavor == FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
  const char *lacks = NULL;
  if (torch) {
    if (c->has_relative_step_case) lacks = "relative_step";
    else if (c->has_scale_parameter_case) lacks = "scale_parameter";
    else if (c->has_warmup_init_case) lacks = "warmup_init";
    else if (c->has_beta1_case) lacks = "beta1";
  } else if (c->has_maximize_case) {
    lacks = "maximize";
  }
  if (lacks) {
    snprintf(why, why_len, "tensor '%s': flavor %s has no setting '%s' (leave it absent)", name,
             torch ? "torch" : "hf", lacks);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  fps_adafactor_defaults(hp, torch ? FPS_FLAVOR_TORCH : FPS_FLAVOR_HF);
  if (c->has_lr_case) {
    hp->has_lr = true;
    hp->lr = c->lr;
  }
  if (c->has_beta2_decay_case) hp->decay = c->beta2_decay;
  if (c->has_eps1_case) hp->eps1 = c->eps1;
  if (c->has_eps2_case) hp->eps2 = c->eps2;
  if (c->has_clip_threshold_case) hp->clip = c->clip_threshold;
  if (c->has_weight_decay_case) hp->weight_decay = c->weight_decay;
  if (c->has_maximize_case) hp->maximize = c->maximize;
  if (c->has_relative_step_case) hp->relative_step = c->relative_step;
  if (c->has_scale_parameter_case) hp->scale_parameter = c->scale_parameter;
  if (c->has_warmup_init_case) hp->warmup_init = c->warmup_init;
  if (c->has_beta1_case) {
    hp->has_beta1 = true;
    hp->beta1 = c->beta1;
  }
  char kwhy[256] = "";
  if (fps_adafactor_validate(hp, kwhy, sizeof kwhy) < 0) {
    snprintf(why, why_len, "tensor '%s': invalid optimizer settings: %s", name, kwhy);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  return GRPC_STATUS_OK;
}

bool fps_shape_equal(const fps_shape_t *a, const fps_shape_t *b) {
  if (a->ndim != b->ndim) return false;
  for (uint32_t i = 0; i < a->ndim; i++)
    if (a->dim[i] != b->dim[i]) return false;
  return true;
}

grpc_status_code fps_wire_slice(const char *name, const Factorps__V1__TensorSlice *s,
                                const fps_shape_t *shape, uint64_t numel, bool shape_required,
                                uint64_t *count, char *why, size_t why_len) {
  size_t esz = fps_dtype_size((int)s->dtype);
  if (esz == 0) {
    snprintf(why, why_len, "tensor '%s': unsupported dtype %d (supported: DTYPE_F32 = 1, DTYPE_BF16 = 2)", name,
             (int)s->dtype);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  if (s->n_shape || shape_required) {
    bool same = s->n_shape == shape->ndim;
    for (size_t i = 0; same && i < s->n_shape; i++) same = s->shape[i] == shape->dim[i];
    if (!same) {
      char want[256], got[256] = "[";
      fps_shape_format(shape, want, sizeof want);
      size_t n = 1;
      for (size_t i = 0; i < s->n_shape && n < sizeof got - 24; i++)
        n += (size_t)snprintf(got + n, sizeof got - n, "%s%" PRIu64, i ? ", " : "", s->shape[i]);
      snprintf(got + n, sizeof got - n, "]");
      snprintf(why, why_len, "tensor '%s': wrong shape %s, the tensor's shape is %s", name, got, want);
      return GRPC_STATUS_INVALID_ARGUMENT;
    }
  }
  if (s->data.len % esz != 0) {
    snprintf(why, why_len, "tensor '%s': slice data is %zu bytes, not a whole number of %s elements", name,
             s->data.len, fps_dtype_name((int)s->dtype));
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  uint64_t n = s->data.len / esz;
  if (s->offset > numel || n > numel - s->offset) {
    snprintf(why, why_len,
             "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") is out of range: the tensor has %" PRIu64
             " elements (wrong element count for its shape?)",
             name, s->offset, s->offset + n, numel);
    return GRPC_STATUS_INVALID_ARGUMENT;
  }
  *count = n;
  return GRPC_STATUS_OK;
}

uint64_t fps_wire_first_nonfinite(int dtype, const uint8_t *data, uint64_t n) {
  if (dtype == FPS_DTYPE_F32) {
    for (uint64_t i = 0; i < n; i++) {
      uint32_t u;
      memcpy(&u, data + 4 * i, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return i;
    }
  } else if (dtype == FPS_DTYPE_BF16) {
    for (uint64_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, data + 2 * i, 2);
      if ((h & 0x7f80u) == 0x7f80u) return i;
    }
  }
  return n;
}

/* The rules every method shares: tensor names, shapes and slices, the
 * mode names, and what a worker ahead of a restored tensor must do. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "name.h"

void fps_shape_format(const fps_shape_t *s, char *buf, size_t len) {
  size_t n = 0;
  n += (size_t)snprintf(buf + n, len - n, "[");
  for (uint32_t i = 0; i < s->ndim && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, "%s%" PRIu64, i ? ", " : "", s->dim[i]);
  if (n < len) snprintf(buf + n, len - n, "]");
}

const char *fps_mode_name(int mode) {
  switch (mode) {
    case FPS_MODE_SYNC: return "sync";
    case FPS_MODE_ASYNC: return "async";
    case FPS_MODE_SSP: return "ssp";
    default: return "unknown";
  }
}

int fps_shard_name_check(const char *name, char *why, size_t why_len) {
  /* The rule lives in common/name.c (the client and the checkpoint format
   * share it). */
  return fps_name_check(name, name ? strlen(name) : 0, why, why_len) < 0 ? FPS_EINVAL : 0;
}

int fps_shard_shape_check(const char *name, const uint64_t *dims, size_t n, fps_shape_t *out, uint64_t *numel,
                          char *why, size_t why_len) {
  memset(out, 0, sizeof *out);
  if (n > FPS_MAX_DIMS) {
    snprintf(why, why_len, "tensor '%s': shape has %zu dimensions, at most %d are supported", name, n,
             FPS_MAX_DIMS);
    return FPS_EINVAL;
  }
  out->ndim = (uint32_t)n;
  for (size_t i = 0; i < n; i++) out->dim[i] = dims[i];
  char kwhy[256] = "";
  int rc = fps_shape_validate(out, numel, kwhy, sizeof kwhy);
  if (rc < 0) {
    char sh[256];
    fps_shape_format(out, sh, sizeof sh);
    snprintf(why, why_len, "tensor '%s': invalid shape %s: %s", name, sh, kwhy);
    return rc == FPS_EOVERFLOW ? FPS_EOVERFLOW : FPS_EINVAL;
  }
  return 0;
}

bool fps_shape_equal(const fps_shape_t *a, const fps_shape_t *b) {
  if (a->ndim != b->ndim) return false;
  for (uint32_t i = 0; i < a->ndim; i++)
    if (a->dim[i] != b->dim[i]) return false;
  return true;
}

int fps_shard_slice_check(const char *name, const fps_slice_t *s, const fps_shape_t *shape, uint64_t numel,
                          bool shape_required, uint64_t *count, char *why, size_t why_len) {
  size_t esz = fps_dtype_size(s->dtype);
  if (esz == 0) {
    snprintf(why, why_len, "tensor '%s': unsupported dtype %d (supported: DTYPE_F32 = 1, DTYPE_BF16 = 2)", name,
             s->dtype);
    return FPS_EINVAL;
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
      return FPS_EINVAL;
    }
  }
  if (s->len % esz != 0) {
    snprintf(why, why_len, "tensor '%s': slice data is %zu bytes, not a whole number of %s elements", name, s->len,
             fps_dtype_name(s->dtype));
    return FPS_EINVAL;
  }
  uint64_t n = s->len / esz;
  if (s->offset > numel || n > numel - s->offset) {
    /* offset + n may not fit in 64 bits (a hostile offset): name both. */
    if (s->offset > UINT64_MAX - n)
      snprintf(why, why_len,
               "tensor '%s': slice of %" PRIu64 " elements at offset %" PRIu64
               " is out of range: the tensor has %" PRIu64 " elements",
               name, n, s->offset, numel);
    else
      snprintf(why, why_len,
               "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") is out of range: the tensor has %" PRIu64
               " elements (wrong element count for its shape?)",
               name, s->offset, s->offset + n, numel);
    return FPS_EINVAL;
  }
  *count = n;
  return 0;
}

uint64_t fps_shard_first_nonfinite(int dtype, const uint8_t *data, uint64_t n) {
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

void fps_checkpoint_ahead_hint(const fps_tensor_t *t, char *buf, size_t len) {
  size_t n = strlen(buf);
  if (!t->restored_seq || n + 1 >= len) return;
  snprintf(buf + n, len - n,
           "; this shard restarted and restored the tensor from checkpoint %" PRIu64 " at version %" PRIu64
           ": pull this shard's tensors, take their versions as the step and push again"
           " (see docs/operations.md, Checkpoints and recovery)",
           t->restored_seq, t->restored_version);
}

/* The outcome of a call (fps_status_t), the codes' names, and the one
 * translation of the library's own failures (FPS_E*) into the code a
 * caller sees; a shard's refusal arrives as its gRPC status and passes as
 * is. The floor below every other file of the library. */
#include <stdarg.h>
#include <stdio.h>

#include "error.h"
#include "internal.h"
#include "name.h"

const char *fps_code_name(int code) {
  static const char *const names[] = {
      "OK",        "CANCELLED",         "UNKNOWN",        "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",   "UNIMPLEMENTED",    "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS",       "UNAUTHENTICATED"};
  if (code < 0 || code >= (int)(sizeof names / sizeof names[0])) return "UNKNOWN_CODE";
  return names[code];
}

static int fps__status_vset(fps_status_t *st, int code, int shard, const char *fmt, va_list ap) {
  if (st) {
    st->code = code;
    st->shard = shard;
    vsnprintf(st->message, sizeof st->message, fmt, ap);
    /* Messages carry names and the shard's text: keep them UTF-8 even
     * when vsnprintf cut one short (common/name.h). */
    fps_utf8_fix(st->message);
  }
  return code;
}

int fps__status_set(fps_status_t *st, int code, int shard, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fps__status_vset(st, code, shard, fmt, ap);
  va_end(ap);
  return code;
}

void fps__status_ok(fps_status_t *st) {
  if (st) {
    st->code = FPS_CODE_OK;
    st->shard = -1;
    st->message[0] = '\0';
  }
}

/* A code added to FPS_ERRNO_MAP but not here fails the build. */
#pragma GCC diagnostic error "-Wswitch-enum"

int fps__code_from_err(int err) {
  switch ((fps_errno_t)err) {
    case FPS_OK: return FPS_CODE_OK;
    case FPS_EINVAL:
    case FPS_ESHAPE:
    case FPS_EHPARAM:
    case FPS_EFLAVOR:
    case FPS_ENONFINITE:
    case FPS_EFORMAT: return FPS_CODE_INVALID_ARGUMENT;
    case FPS_ENOMEM:
    case FPS_EOVERFLOW:
    case FPS_ELIMIT: return FPS_CODE_RESOURCE_EXHAUSTED;
    case FPS_EUNSUPPORTED: return FPS_CODE_UNIMPLEMENTED;
    case FPS_ENOTFOUND: return FPS_CODE_NOT_FOUND;
    case FPS_EEXISTS:
    case FPS_EDUP: return FPS_CODE_ALREADY_EXISTS;
    case FPS_ESTATE:
    case FPS_ESTALE:
    case FPS_EAHEAD: return FPS_CODE_FAILED_PRECONDITION;
    case FPS_ETIMEOUT: return FPS_CODE_DEADLINE_EXCEEDED;
    case FPS_EUNAVAILABLE:
    case FPS_EAGAIN: return FPS_CODE_UNAVAILABLE;
    case FPS_ECANCELLED: return FPS_CODE_CANCELLED;
    case FPS_EAUTH: return FPS_CODE_UNAUTHENTICATED;
    case FPS_EPERM: return FPS_CODE_PERMISSION_DENIED;
    /* Inside the library a bad message is a shard's reply, not the
     * caller's argument (the server's table says INVALID_ARGUMENT). */
    case FPS_EPROTO:
    case FPS_EIO:
    case FPS_EINTERNAL: return FPS_CODE_INTERNAL;
    case FPS__ERRNO_FIRST:
    case FPS__ERRNO_END: break;
  }
  return FPS_CODE_INTERNAL;
}

int fps__status_err(fps_status_t *st, int err, int shard, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int code = fps__status_vset(st, fps__code_from_err(err), shard, fmt, ap);
  va_end(ap);
  return code;
}

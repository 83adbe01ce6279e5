/* The outcome of a call (fps_status_t) and the codes' names: the floor
 * below every other file of the library, placement.c's pure functions
 * included. */
#include <stdarg.h>
#include <stdio.h>

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

int fps__status_set(fps_status_t *st, int code, int shard, const char *fmt, ...) {
  if (st) {
    va_list ap;
    st->code = code;
    st->shard = shard;
    va_start(ap, fmt);
    vsnprintf(st->message, sizeof st->message, fmt, ap);
    va_end(ap);
    /* Messages carry names and the shard's text: keep them UTF-8 even
     * when vsnprintf cut one short (common/name.h). */
    fps_utf8_fix(st->message);
  }
  return code;
}

void fps__status_ok(fps_status_t *st) {
  if (st) {
    st->code = FPS_CODE_OK;
    st->shard = -1;
    st->message[0] = '\0';
  }
}

#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

const char *fps_strerror(int err) {
  switch (err) {
    case FPS_OK: return "success";
#define FPS_ERRNO_TEXT(name, text) case FPS_E##name: return text;
    FPS_ERRNO_MAP(FPS_ERRNO_TEXT)
#undef FPS_ERRNO_TEXT
    default: return "unknown error";
  }
}

const char *fps_err_name(int err) {
  switch (err) {
    case FPS_OK: return "FPS_OK";
#define FPS_ERRNO_NAME(name, text) case FPS_E##name: return "FPS_E" #name;
    FPS_ERRNO_MAP(FPS_ERRNO_NAME)
#undef FPS_ERRNO_NAME
    default: return "FPS_EUNKNOWN";
  }
}

const char *fps_u64_text(uint64_t v, char buf[FPS_U64_TEXT]) {
  if (v == UINT64_MAX) snprintf(buf, FPS_U64_TEXT, "2^64 - 1");
  else snprintf(buf, FPS_U64_TEXT, "%llu", (unsigned long long)v);
  return buf;
}

int fps_errorf(int rc, char *why, size_t why_len, const char *fmt, ...) {
  if (why && why_len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, why_len, fmt, ap);
    va_end(ap);
  }
  return rc;
}

void fps__assert_fail(const char *expr, const char *file, int line) {
  /* One write, like the log line: a crash report that stays whole. */
  fprintf(stderr, "factorps: assertion failed: %s (%s:%d)\n", expr, file, line);
  abort();
}

/* The log line (log.h): UTC time, program, level, message, on stderr. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

int fps__log_level = FPS_LOG_INFO;

void fps__log(int level, const char *fmt, ...) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  /* One fprintf per line keeps lines from different threads whole. */
  fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ factorps-server %s: %s\n", tm.tm_year + 1900,
          tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
          names[level < 0 ? 0 : level > 3 ? 3 : level], msg);
}

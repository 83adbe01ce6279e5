/* The shard's monotonic clock (see clock.h). */
#include "clock.h"

#include <time.h>

int64_t fps_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * INT64_C(1000000000) + ts.tv_nsec;
}

int64_t fps_clock_after(int64_t now_ns, double seconds) {
  if (!(seconds < 9.2e9)) return INT64_MAX; /* also NaN */
  if (seconds <= 0) return now_ns;
  double d = seconds * 1e9;
  if ((double)(INT64_MAX - now_ns) <= d) return INT64_MAX;
  return now_ns + (int64_t)d;
}

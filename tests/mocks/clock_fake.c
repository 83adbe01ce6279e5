/* A fake fps_now_ns() for unit tests, linked with -Wl,--wrap=fps_now_ns:
 * every call of the code under test reads fps_fake_now_ns instead of the
 * monotonic clock, so deadlines are reached by setting a number. */
#include <stdint.h>

#include "clock_fake.h"

int64_t fps_fake_now_ns = INT64_C(1000000000000);

int64_t __wrap_fps_now_ns(void);
int64_t __wrap_fps_now_ns(void) { return __atomic_load_n(&fps_fake_now_ns, __ATOMIC_RELAXED); }

void fps_fake_clock_advance(int64_t ns) { __atomic_fetch_add(&fps_fake_now_ns, ns, __ATOMIC_RELAXED); }

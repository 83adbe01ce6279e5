/* The shard's clock: monotonic nanoseconds since an arbitrary origin.
 *
 * Every deadline in the shard (sync rounds, ssp waits, calls) is a value of
 * this clock. It knows no gRPC: the transport converts gRPC's deadlines into
 * it. Unit tests replace it at link time (-Wl,--wrap=fps_now_ns, see
 * tests/mocks/clock_fake.c), so rules that depend on time run without
 * sleeping. */
#ifndef FPS_SERVER_CLOCK_H
#define FPS_SERVER_CLOCK_H

#include <stdint.h>

/* Monotonic time in ns (CLOCK_MONOTONIC). Thread-safe, never fails. */
int64_t fps_now_ns(void);

/* now + seconds, saturating at INT64_MAX (a huge --deadline means none). */
int64_t fps_clock_after(int64_t now_ns, double seconds);

#endif

/* The fake clock of the unit tests (clock_fake.c; link with
 * -Wl,--wrap=fps_now_ns). */
#ifndef FPS_TESTS_CLOCK_FAKE_H
#define FPS_TESTS_CLOCK_FAKE_H

#include <stdint.h>

/* What fps_now_ns() returns in the test. */
extern int64_t fps_fake_now_ns;
void fps_fake_clock_advance(int64_t ns);

#endif

/* The deadline timer: one thread that wakes every tick and runs the expiry
 * hooks the modules registered (sync rounds and ssp waits of the shard
 * core, calls of the transport), each with the current fps_now_ns().
 *
 * The timer knows nothing of what it expires: a hook is a function pointer
 * and its argument. Tests run the hooks directly with a fake time through
 * fps_timer_run() instead of starting the thread. gRPC-free. */
#ifndef FPS_SERVER_TIMER_H
#define FPS_SERVER_TIMER_H

#include <stdint.h>

typedef struct fps_timer_s fps_timer_t;

/* A hook: expire whatever is past its deadline at now_ns. Runs on the timer
 * thread (or the caller of fps_timer_run), with no timer lock held. */
typedef void (*fps_timer_hook_fn)(void *arg, int64_t now_ns);

#define FPS_TIMER_HOOKS_MAX 8
#define FPS_TIMER_TICK_NS INT64_C(20000000) /* 20 ms */

/* A stopped timer with no hooks; tick_ns 0 means FPS_TIMER_TICK_NS.
 * Returns 0 or FPS_ENOMEM. Free with fps_timer_destroy(). */
int fps_timer_create(fps_timer_t **out, int64_t tick_ns);
/* Registers a hook. REQUIRES: before fps_timer_start(). Returns 0 or
 * FPS_ELIMIT (more than FPS_TIMER_HOOKS_MAX). */
int fps_timer_add(fps_timer_t *t, fps_timer_hook_fn fn, void *arg);
/* Starts the thread. Returns 0 or FPS_ENOMEM. */
int fps_timer_start(fps_timer_t *t);
/* Runs every hook once, in registration order, with now_ns. */
void fps_timer_run(fps_timer_t *t, int64_t now_ns);
/* Stops and joins the thread (a tick in progress finishes first), then
 * frees the timer. NULL is a no-op. */
void fps_timer_destroy(fps_timer_t *t);

#endif

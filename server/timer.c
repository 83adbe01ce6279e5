/* The deadline timer thread (see timer.h). */
#include "timer.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "alloc.h"
#include "clock.h"
#include "error.h"

struct fps_timer_s {
  pthread_t th;
  bool running;                       /* th was started */
  pthread_mutex_t mu;                 /* guards stop */
  pthread_cond_t cv;                  /* CLOCK_MONOTONIC */
  bool stop;
  int64_t tick_ns;
  struct {
    fps_timer_hook_fn fn;
    void *arg;
  } hook[FPS_TIMER_HOOKS_MAX];
  int nhooks;                         /* fixed once started */
};

int fps_timer_create(fps_timer_t **out, int64_t tick_ns) {
  *out = NULL;
  fps_timer_t *t = fps_calloc(1, sizeof *t);
  if (!t) return FPS_ENOMEM;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&t->mu, NULL);
  t->tick_ns = tick_ns > 0 ? tick_ns : FPS_TIMER_TICK_NS;
  *out = t;
  return 0;
}

int fps_timer_add(fps_timer_t *t, fps_timer_hook_fn fn, void *arg) {
  if (t->nhooks == FPS_TIMER_HOOKS_MAX) return FPS_ELIMIT;
  t->hook[t->nhooks].fn = fn;
  t->hook[t->nhooks].arg = arg;
  t->nhooks++;
  return 0;
}

void fps_timer_run(fps_timer_t *t, int64_t now_ns) {
  for (int i = 0; i < t->nhooks; i++) t->hook[i].fn(t->hook[i].arg, now_ns);
}

static void *fps__timer_main(void *arg) {
  fps_timer_t *t = arg;
  pthread_mutex_lock(&t->mu);
  while (!t->stop) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)(t->tick_ns % 1000000000);
    ts.tv_sec += (time_t)(t->tick_ns / 1000000000);
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&t->cv, &t->mu, &ts);
    if (t->stop) break;
    pthread_mutex_unlock(&t->mu);
    fps_timer_run(t, fps_now_ns());
    pthread_mutex_lock(&t->mu);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

int fps_timer_start(fps_timer_t *t) {
  if (pthread_create(&t->th, NULL, fps__timer_main, t) != 0) return FPS_ENOMEM;
  t->running = true;
  return 0;
}

void fps_timer_destroy(fps_timer_t *t) {
  if (!t) return;
  if (t->running) {
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
  }
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  fps_free(t);
}

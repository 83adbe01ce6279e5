/* Fixed pthread pool: workers sleep on a condition variable, wake up for a
 * run (a generation counter tells a new run from a spurious wake-up), take
 * chunk indices from a shared counter and report when they finish. A run
 * waits only for the workers that joined it: one that wakes after the
 * caller has taken the last chunk (a busy machine may not schedule it for
 * milliseconds) stays out, so the run never waits on a sleeping thread
 * that has nothing left to do. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"

#define FPS_POOL_MAX_THREADS 256

struct fps_pool_s {
  pthread_mutex_t run_mu;   /* serialises fps_pool_run() callers */
  pthread_mutex_t mu;       /* guards everything below */
  pthread_cond_t wake;      /* workers wait here for a new generation */
  pthread_cond_t done;      /* the runner waits here for busy == 0 */
  unsigned nthreads;        /* workers + the calling thread */
  unsigned started;         /* workers actually started */
  pthread_t *tids;
  unsigned long generation; /* bumped once per run */
  int open;                 /* the current run still takes workers */
  unsigned busy;            /* workers that joined it and are still inside */
  int stop;
  fps_pool_fn fn;
  void *arg;
  size_t n;
  atomic_size_t next;       /* next chunk index to hand out */
};

static void pool_drain(fps_pool_t *p, fps_pool_fn fn, void *arg, size_t n) {
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (i >= n) break;
    fn(arg, i);
  }
}

static void *pool_worker(void *vp) {
  fps_pool_t *p = vp;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    if (!p->open) continue; /* woke after the run's chunks were all taken */
    p->busy++;
    fps_pool_fn fn = p->fn;
    void *arg = p->arg;
    size_t n = p->n;
    pthread_mutex_unlock(&p->mu);
    pool_drain(p, fn, arg, n);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0) pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int fps_pool_create(fps_pool_t **out, unsigned nthreads) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  if (nthreads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    nthreads = n > 0 ? (unsigned)n : 1;
  }
  if (nthreads > FPS_POOL_MAX_THREADS) return FPS_EINVAL;
  fps_pool_t *p = fps_calloc(1, sizeof *p);
  if (!p) return FPS_ENOMEM;
  p->nthreads = nthreads;
  pthread_mutex_init(&p->run_mu, NULL);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  atomic_init(&p->next, 0);
  if (nthreads > 1) {
    p->tids = fps_calloc(nthreads - 1, sizeof *p->tids);
    if (!p->tids) {
      fps_pool_destroy(p);
      return FPS_ENOMEM;
    }
    for (unsigned i = 0; i + 1 < nthreads; i++) {
      if (pthread_create(&p->tids[i], NULL, pool_worker, p) != 0) {
        fps_pool_destroy(p);
        return FPS_ELIMIT;
      }
      p->started++;
    }
  }
  *out = p;
  return 0;
}

void fps_pool_destroy(fps_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (unsigned i = 0; i < p->started; i++) pthread_join(p->tids[i], NULL);
  fps_free(p->tids);
  pthread_cond_destroy(&p->done);
  pthread_cond_destroy(&p->wake);
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->run_mu);
  fps_free(p);
}

unsigned fps_pool_threads(const fps_pool_t *p) { return p ? p->started + 1 : 1; }

void fps_pool_run(fps_pool_t *p, size_t n, fps_pool_fn fn, void *arg) {
  if (n == 0) return;
  if (!p || p->started == 0 || n == 1) {
    for (size_t i = 0; i < n; i++) fn(arg, i);
    return;
  }
  pthread_mutex_lock(&p->run_mu);
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  p->n = n;
  atomic_store(&p->next, 0);
  p->busy = 0;
  p->open = 1;
  p->generation++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);

  pool_drain(p, fn, arg, n);

  /* Every chunk is taken: close the run to workers not yet in it, and
   * wait for those in it to finish theirs. */
  pthread_mutex_lock(&p->mu);
  p->open = 0;
  while (p->busy) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->run_mu);
}

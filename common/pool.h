/* A small fixed pthread pool for splitting one big job into chunks.
 *
 * fps_pool_run() hands out chunk indices 0..n-1 to the pool's threads and
 * the calling thread, and returns when all are done. Which thread runs a
 * chunk is not deterministic; callers that need reproducible results make
 * each chunk write its own output slot and combine the slots in order. */
#ifndef FPS_POOL_H
#define FPS_POOL_H

#include <stddef.h>

typedef struct fps_pool_s fps_pool_t;

typedef void (*fps_pool_fn)(void *arg, size_t chunk);

/* Creates a pool that runs jobs on nthreads threads in total (the caller
 * counts as one, so nthreads - 1 are started). nthreads 0 means the number
 * of online CPUs. Returns 0 or FPS_EINVAL / FPS_ENOMEM / FPS_ELIMIT
 * (thread creation failed). */
int fps_pool_create(fps_pool_t **out, unsigned nthreads);
/* Stops and joins the threads. NULL is a no-op. Not while a run is going. */
void fps_pool_destroy(fps_pool_t *p);
/* Threads taking part in a run, caller included (1 for a NULL pool). */
unsigned fps_pool_threads(const fps_pool_t *p);
/* Runs fn(arg, i) for every i in [0, n). p NULL runs them all in order on
 * the calling thread. One run at a time per pool (runs are serialised by an
 * internal lock, so concurrent callers wait rather than interleave). */
void fps_pool_run(fps_pool_t *p, size_t n, fps_pool_fn fn, void *arg);

#endif

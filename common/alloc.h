/* The shard's one door to the heap: every allocation of the server, its
 * core and the common code it calls per request goes through these, so
 * that a test can count them and make the Nth one fail (SQLite's faultsim,
 * redis zmalloc, libuv uv__malloc).
 *
 * They behave exactly like their libc namesakes (same arguments, same NULL
 * and errno on failure, memory from the same heap: fps_free() and free()
 * are interchangeable) except when a fault is armed. Thread-safe.
 *
 * Disarmed (the normal state) an allocation costs one relaxed atomic load
 * beyond libc's own call. Armed, every allocation is counted (an atomic
 * add) and the chosen one returns NULL with errno = ENOMEM.
 *
 * gRPC's own allocations (gpr_malloc), OpenSSL's and zlib's do not pass
 * through here. */
#ifndef FPS_ALLOC_H
#define FPS_ALLOC_H

#include <stddef.h>
#include <stdint.h>

void *fps_malloc(size_t size);
void *fps_calloc(size_t n, size_t size);
/* On failure the old block is left untouched, as with realloc(). */
void *fps_realloc(void *p, size_t size);
char *fps_strdup(const char *s);
/* posix_memalign(): 0, or ENOMEM / EINVAL with *out unchanged. */
int fps_aligned_alloc(void **out, size_t align, size_t size);
/* NULL is a no-op. */
void fps_free(void *p);

/* ---------------------------------------------------------- fault injection
 * For tests. fps_alloc_fault_arm(nth, persist) restarts the count at 0 and
 * makes allocation number `nth` (1-based, counted from this call, over all
 * threads) fail; with `persist` every later one fails too. nth == 0 counts
 * without failing. fps_alloc_fault_disarm() returns to the uncounted fast
 * path. fps_alloc_calls() is the number of allocations since the last arm,
 * fps_alloc_failures() how many of them were made to fail. */
void fps_alloc_fault_arm(uint64_t nth, int persist);
void fps_alloc_fault_disarm(void);
uint64_t fps_alloc_calls(void);
uint64_t fps_alloc_failures(void);

#endif

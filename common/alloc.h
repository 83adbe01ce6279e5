/* The one door to the heap: every allocation of the server, its core, the
 * common code it calls per request and libfactorps goes through these, so
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

/* Two domains, each with its own fault counter. libfactorps compiles its
 * own copy of alloc.c (FPS_BUILDING_CLIENT): in its files the names below
 * stand for fps__client_* functions, and the library's fault injection is
 * fps_client_alloc_* (declared at the end), so that a test holding a shard
 * and a client in one process fails one side's allocations while the
 * other's run (tests/integration/test_alloc_sweep.c sweeps both). */
#ifdef FPS_BUILDING_CLIENT
#define fps_malloc fps__client_malloc
#define fps_calloc fps__client_calloc
#define fps_realloc fps__client_realloc
#define fps_strdup fps__client_strdup
#define fps_strndup fps__client_strndup
#define fps_aligned_alloc fps__client_aligned_alloc
#define fps_free fps__client_free
#define fps_alloc_fault_arm fps_client_alloc_fault_arm
#define fps_alloc_fault_disarm fps_client_alloc_fault_disarm
#define fps_alloc_calls fps_client_alloc_calls
#define fps_alloc_failures fps_client_alloc_failures
#endif

void *fps_malloc(size_t size);
void *fps_calloc(size_t n, size_t size);
/* On failure the old block is left untouched, as with realloc(). */
void *fps_realloc(void *p, size_t size);
char *fps_strdup(const char *s);
char *fps_strndup(const char *s, size_t n);
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

/* The same for libfactorps's domain (its static archive; the shared
 * library does not export them). */
void fps_client_alloc_fault_arm(uint64_t nth, int persist);
void fps_client_alloc_fault_disarm(void);
uint64_t fps_client_alloc_calls(void);
uint64_t fps_client_alloc_failures(void);

#endif

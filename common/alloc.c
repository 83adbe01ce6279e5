/* The allocation wrapper (alloc.h) and its fault injection.
 *
 * Compiled in always, not only in a test build: disarmed it adds one
 * relaxed load and a branch the CPU predicts to an allocation that costs
 * tens of nanoseconds anyway, and the sweep then tests the very code that
 * ships rather than a variant of it. */
#include "alloc.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static atomic_int fps__alloc_armed;       /* 0: uncounted fast path */
static atomic_uint_fast64_t fps__alloc_n; /* allocations since the arm */
static atomic_uint_fast64_t fps__alloc_nth;
static atomic_int fps__alloc_persist;
static atomic_uint_fast64_t fps__alloc_failed;

/* 1 if this allocation must fail. Counted only while armed. */
static int fps__alloc_fails(void) {
  if (__builtin_expect(atomic_load_explicit(&fps__alloc_armed, memory_order_relaxed) == 0, 1)) return 0;
  uint64_t k = atomic_fetch_add_explicit(&fps__alloc_n, 1, memory_order_relaxed) + 1;
  uint64_t nth = atomic_load_explicit(&fps__alloc_nth, memory_order_relaxed);
  if (nth == 0 || k < nth) return 0;
  if (k > nth && !atomic_load_explicit(&fps__alloc_persist, memory_order_relaxed)) return 0;
  atomic_fetch_add_explicit(&fps__alloc_failed, 1, memory_order_relaxed);
  errno = ENOMEM;
  return 1;
}

void *fps_malloc(size_t size) { return fps__alloc_fails() ? NULL : malloc(size); }

void *fps_calloc(size_t n, size_t size) { return fps__alloc_fails() ? NULL : calloc(n, size); }

void *fps_realloc(void *p, size_t size) { return fps__alloc_fails() ? NULL : realloc(p, size); }

char *fps_strdup(const char *s) { return fps__alloc_fails() ? NULL : strdup(s); }

char *fps_strndup(const char *s, size_t n) { return fps__alloc_fails() ? NULL : strndup(s, n); }

int fps_aligned_alloc(void **out, size_t align, size_t size) {
  if (fps__alloc_fails()) return ENOMEM;
  return posix_memalign(out, align, size);
}

void fps_free(void *p) { free(p); }

void fps_alloc_fault_arm(uint64_t nth, int persist) {
  atomic_store(&fps__alloc_armed, 0);
  atomic_store(&fps__alloc_n, 0);
  atomic_store(&fps__alloc_failed, 0);
  atomic_store(&fps__alloc_nth, nth);
  atomic_store(&fps__alloc_persist, persist != 0);
  atomic_store(&fps__alloc_armed, 1);
}

void fps_alloc_fault_disarm(void) { atomic_store(&fps__alloc_armed, 0); }

uint64_t fps_alloc_calls(void) { return atomic_load(&fps__alloc_n); }

uint64_t fps_alloc_failures(void) { return atomic_load(&fps__alloc_failed); }

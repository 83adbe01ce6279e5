/* Happens-before hints for ThreadSanitizer, where memory changes threads
 * through a library TSan cannot see into.
 *
 * Debian's gRPC is not built with -fsanitize=thread. When one thread starts
 * a batch with a tag and another takes that tag from the completion queue,
 * gRPC orders the two (its queue is a lock-free structure plus a futex), but
 * TSan sees two threads touching the same memory with nothing in between
 * and reports a race in our code. Likewise for a slice's destroy callback,
 * which gRPC may run on any thread. FPS_TSAN_RELEASE(p) just before handing
 * p to gRPC and FPS_TSAN_ACQUIRE(p) where gRPC hands it back state exactly
 * the ordering gRPC guarantees, nothing more, so races that are really ours
 * are still reported. Without TSan both are no-ops. */
#ifndef FPS_TSAN_H
#define FPS_TSAN_H

#if defined(__SANITIZE_THREAD__)
#define FPS_TSAN_ON 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FPS_TSAN_ON 1
#endif
#endif

#ifdef FPS_TSAN_ON
#include <sanitizer/tsan_interface.h>
#define FPS_TSAN_RELEASE(p) __tsan_release((void *)(p))
#define FPS_TSAN_ACQUIRE(p) __tsan_acquire((void *)(p))
#else
#define FPS_TSAN_RELEASE(p) ((void)(p))
#define FPS_TSAN_ACQUIRE(p) ((void)(p))
#endif

#endif

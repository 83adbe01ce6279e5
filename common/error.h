/* factorps error codes: 0 is success, failures are negative FPS_E* values.
 *
 * One X-macro generates the enum, fps_strerror() and fps_err_name(), so a new
 * code is added in exactly one place. */
#ifndef FPS_ERROR_H
#define FPS_ERROR_H

#include <stddef.h>
#include <stdint.h>

#define FPS_ERRNO_MAP(X)                                                  \
  X(INVAL, "invalid argument")                                             \
  X(NOMEM, "out of memory")                                                \
  X(SHAPE, "invalid shape")                                                \
  X(OVERFLOW, "size overflows")                                            \
  X(HPARAM, "invalid hyperparameter")                                      \
  X(FLAVOR, "unknown optimizer flavor")                                    \
  X(UNSUPPORTED, "not supported on this machine")                          \
  X(IO, "input/output error")                                              \
  X(FORMAT, "malformed input")                                             \
  X(NOTFOUND, "not found")                                                 \
  X(EXISTS, "already exists")                                              \
  X(STATE, "operation not valid in the current state")                     \
  X(NONFINITE, "non-finite value")                                         \
  X(PROTO, "bad message")                                                  \
  X(TIMEOUT, "deadline exceeded")                                          \
  X(UNAVAILABLE, "service unavailable")                                    \
  X(LIMIT, "resource limit reached")                                       \
  X(AGAIN, "try again")                                                    \
  X(STALE, "stale step")                                                   \
  X(AHEAD, "step ahead of the shard")                                      \
  X(DUP, "duplicate")                                                      \
  X(CANCELLED, "cancelled")                                                \
  X(AUTH, "not authenticated")                                             \
  X(PERM, "permission denied")                                             \
  X(INTERNAL, "internal error")

typedef enum fps_errno_e {
  FPS_OK = 0,
#define FPS_ERRNO_ENUM(name, text) FPS_E##name,
  FPS__ERRNO_FIRST = -1000,
  FPS_ERRNO_MAP(FPS_ERRNO_ENUM)
#undef FPS_ERRNO_ENUM
  FPS__ERRNO_END
} fps_errno_t;

/* Human-readable text for an FPS_E* code ("invalid argument"); never NULL. */
const char *fps_strerror(int err);
/* Writes the message (printf-style) into why[why_len] when why is not NULL
 * and returns rc: `return fps_errorf(FPS_EINVAL, why, len, "...", ...);`. */
int fps_errorf(int rc, char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A 64-bit count, version or step from a request, for a message: decimal,
 * but "2^64 - 1" for the all-ones value (a field a peer filled with ones,
 * never a count any tensor reaches), so no message shows a 20-digit
 * number the user cannot place. Writes buf[FPS_U64_TEXT], returns it. */
#define FPS_U64_TEXT 24
const char *fps_u64_text(uint64_t v, char buf[FPS_U64_TEXT]);
/* Symbolic name for an FPS_E* code ("FPS_EINVAL"); never NULL. */
const char *fps_err_name(int err);

/* Programmer errors are not error codes (redis serverAssert, SQLite
 * ALWAYS): FPS_ASSERT(cond) checks an invariant in every build and, when
 * it does not hold, writes the expression and where it stands to stderr
 * and aborts. Never for input a peer or a user controls: that is an
 * FPS_E* with a message. */
#define FPS_ASSERT(cond)                                             \
  do {                                                               \
    if (__builtin_expect(!(cond), 0)) fps__assert_fail(#cond, __FILE__, __LINE__); \
  } while (0)
void fps__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn, cold));

#endif

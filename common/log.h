/* The log line of the server's processes: one format for every floor of
 * factorps-server (the core, the transport, metrics, start-up), written by
 * one function so that lines from different threads stay whole:
 *
 *   2026-12-02T04:45:46.123Z factorps-server error: <message>
 *
 * Hot paths count (server/metrics) instead of logging. */
#ifndef FPS_LOG_H
#define FPS_LOG_H

typedef enum fps_log_level_e { FPS_LOG_ERROR = 0, FPS_LOG_WARN, FPS_LOG_INFO, FPS_LOG_DEBUG } fps_log_level_t;

/* The most verbose level written (--log-level); FPS_LOG_INFO at start. */
extern int fps__log_level;

/* Writes one line at `level` to stderr (UTC time, program, level,
 * message). Thread-safe. Use FPS_LOG, which checks the level first. */
void fps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Checks the level before evaluating the arguments. */
#define FPS_LOG(level, ...)                                      \
  do {                                                           \
    if ((level) <= fps__log_level) fps__log(level, __VA_ARGS__); \
  } while (0)

#endif

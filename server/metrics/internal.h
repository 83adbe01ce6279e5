/* Internals shared by the metrics files (registry, process collector, HTTP). */
#ifndef FPS_METRICS_INTERNAL_H
#define FPS_METRICS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

/* A growable text buffer. Appends after an allocation failure are no-ops and
 * leave `oom` set, so a renderer checks once at the end instead of after
 * every line. */
typedef struct fps__mbuf_s {
  char *p;      /* NUL-terminated when len > 0 */
  size_t len;   /* bytes used, without the NUL */
  size_t cap;   /* bytes allocated */
  bool oom;     /* an append failed: the content is incomplete */
} fps__mbuf_t;

void fps__mbuf_printf(fps__mbuf_t *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Appends the process_* series (resident memory, fds, CPU, start time),
 * each labelled with `labels` (e.g. shard="0"). */
void fps__metrics_render_process(fps__mbuf_t *b, const char *labels);

/* HTTP endpoint self-metrics, counted by http.c on its own thread. */
void fps__metrics_http_response(int status);
void fps__metrics_http_rejected(void);
void fps__metrics_http_connections_add(int delta);
/* /readyz without a callback reads this flag. */
bool fps__metrics_ready_get(void);

#endif

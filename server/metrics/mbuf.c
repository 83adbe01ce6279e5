/* The growable text buffer the renderers write into (internal.h): below
 * both the registry (metrics.c) and the process collector (process.c),
 * which call it and not each other's files. */
#include <stdarg.h>
#include <stdio.h>

#include "alloc.h"
#include "internal.h"

void fps__mbuf_printf(fps__mbuf_t *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    size_t room = b->cap - b->len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = true;
      return;
    }
    if ((size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap * 2 : 8192;
    while (cap - b->len <= (size_t)n) cap *= 2;
    char *p = fps_realloc(b->p, cap);
    if (p == NULL) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

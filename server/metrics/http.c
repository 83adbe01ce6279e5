/* The metrics/health HTTP endpoint: a libuv loop on its own thread, requests
 * parsed by http-parser (Debian's libhttp-parser-dev), one request per
 * connection (every response says Connection: close, which keeps the state
 * machine small and is what Prometheus copes with best for tiny bodies).
 *
 * Bounds, so a hostile or broken client costs little and never touches the
 * gRPC path (rendering reads atomics only):
 *   - at most max_connections open. A new connection is never turned away:
 *     at the limit it takes the place of the oldest one not in the middle of
 *     writing an answer (counted as rejected). Real clients (the kubelet's
 *     probes, Prometheus) send their request as soon as they connect and are
 *     answered in well under a millisecond, so only connections that sit
 *     idle or trickle bytes are ever evicted: open connections cannot starve
 *     /healthz and /readyz and get a healthy pod restarted;
 *   - one timer per connection covers the whole request, from accept: a
 *     client that trickles bytes gets 408 and is closed;
 *   - request line + headers at most max_header_bytes (431), URL at most
 *     FPS__URL_MAX (414), a declared body above max_body_bytes is 413; bodies
 *     are never read or buffered (the answer is decided once the headers are in);
 *   - after answering, the write side is shut down and the rest of the
 *     request is drained for a short linger, so the client reads the answer
 *     instead of a reset.
 * Each connection owns two handles (tcp, timer) and is freed in the close
 * callback of the last one. */
#include <http_parser.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <uv.h>

#include "alloc.h"
#include "error.h"
#include "internal.h"
#include "log.h"
#include "metrics.h"

#define FPS__URL_MAX 1024
#define FPS__LINGER_MS 1000
#define FPS__BACKLOG 1024

struct fps_metrics_http_s {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t stop;                  /* the only cross-thread entry point */
  uv_thread_t thread;
  int port;                         /* bound port */
  unsigned nconns;                  /* connections counted against the limit */
  struct conn_s *oldest, *newest;   /* the counted ones, in accept order */
  fps_metrics_http_opts_t o;        /* limits with defaults applied; listen not kept */
  http_parser_settings settings;
  char rbuf[16384];                 /* read buffer, consumed within read_cb */
};

typedef struct conn_s {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_write_t wreq;
  uv_shutdown_t sreq;
  http_parser parser;
  fps_metrics_http_t *h;
  struct conn_s *prev, *next;       /* accept order, while counted */
  char *out;                        /* response being written */
  int handles;                      /* open handles; freed at 0 */
  size_t head_bytes;                /* request line + headers so far */
  size_t url_len;
  char url[FPS__URL_MAX + 1];
  int status;                       /* decided answer, 0 while undecided */
  bool head_only;                   /* HEAD: headers without body */
  bool counted;                     /* counts against max_connections */
  bool responded;                   /* answer queued: now only draining */
  bool closing;
} conn_t;

static void conn_close_cb(uv_handle_t *handle) {
  conn_t *c = handle->data;
  if (--c->handles == 0) {
    fps_free(c->out);
    fps_free(c);
  }
}

static void conn_close(conn_t *c) {
  if (c->closing) return;
  c->closing = true;
  if (c->counted) {
    fps_metrics_http_t *h = c->h;
    if (c->prev) c->prev->next = c->next; else h->oldest = c->next;
    if (c->next) c->next->prev = c->prev; else h->newest = c->prev;
    h->nconns--;
    fps__metrics_http_connections_add(-1);
  }
  uv_close((uv_handle_t *)&c->tcp, conn_close_cb);
  uv_close((uv_handle_t *)&c->timer, conn_close_cb);
}

static const char *reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Internal Server Error";
  }
}

static void on_timer(uv_timer_t *t);

static void on_shutdown(uv_shutdown_t *req, int status) {
  /* Nothing: the drain in on_read or the linger timer closes the connection. */
  (void)req;
  (void)status;
}

static void on_write(uv_write_t *req, int status) {
  conn_t *c = req->data;
  fps_free(c->out);
  c->out = NULL;
  if (status < 0 || c->closing || !c->counted) {
    conn_close(c);
    return;
  }
  c->sreq.data = c;
  if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, on_shutdown) < 0) conn_close(c);
}

/* Queues the answer for c->status (rendering /metrics for a 200 on it) and
 * switches the connection to draining. */
static void conn_respond(conn_t *c) {
  fps_metrics_http_t *h = c->h;
  const char *ctype = "text/plain; charset=utf-8";
  char *body = NULL;
  size_t blen = 0;
  char small[64];
  if (c->status == 200 && strcmp(c->url, "/metrics") == 0) {
    if (h->o.collect) h->o.collect(h->o.arg);
    if (fps_metrics_render(&body, &blen) < 0) c->status = 500;
    ctype = "text/plain; version=0.0.4; charset=utf-8";
  }
  if (body == NULL) {
    const char *text = c->status == 200 ? (strcmp(c->url, "/readyz") == 0 ? "ready" : "ok")
                       : c->status == 503 && strcmp(c->url, "/readyz") == 0 ? "not ready"
                                                                              : reason(c->status);
    blen = (size_t)snprintf(small, sizeof small, "%s\n", text);
  }
  char head[512];
  int hn = snprintf(head, sizeof head,
                    "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                    "Cache-Control: no-store\r\n%sConnection: close\r\n\r\n",
                    c->status, reason(c->status), ctype, blen,
                    c->status == 405 ? "Allow: GET, HEAD\r\n" : "");
  size_t send_body = c->head_only ? 0 : blen;
  c->out = fps_malloc((size_t)hn + send_body);
  if (c->out == NULL) {
    fps_free(body);
    conn_close(c);
    return;
  }
  memcpy(c->out, head, (size_t)hn);
  if (send_body) memcpy(c->out + hn, body ? body : small, send_body);
  fps_free(body);
  fps__metrics_http_response(c->status);
  c->responded = true;
  /* Bound the drain too: a client that never closes is dropped. */
  uv_timer_start(&c->timer, on_timer, FPS__LINGER_MS, 0);
  uv_buf_t buf = uv_buf_init(c->out, (unsigned)((size_t)hn + send_body));
  c->wreq.data = c;
  if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &buf, 1, on_write) < 0) conn_close(c);
}

/* ------------------------------------------------------ parser callbacks */

static int on_url(http_parser *p, const char *at, size_t len) {
  conn_t *c = p->data;
  if (c->url_len + len > FPS__URL_MAX) {
    c->status = 414;
    return -1;
  }
  memcpy(c->url + c->url_len, at, len);
  c->url_len += len;
  c->url[c->url_len] = '\0';
  return 0;
}

/* RFC 9110 field names are tokens. http-parser (not built strict) lets
 * "Host : x" through as a field named "Host "; RFC 9112 5.1 says a server
 * MUST answer whitespace before the colon with 400, since proxies disagree
 * about what such a field means. Called per chunk of the name. */
static int on_header_field(http_parser *p, const char *at, size_t len) {
  conn_t *c = p->data;
  static const char tchar[] = "!#$%&'*+-.^_`|~";
  for (size_t i = 0; i < len; i++) {
    unsigned char ch = (unsigned char)at[i];
    bool ok = (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch != 0 && strchr(tchar, ch) != NULL);
    if (!ok) {
      c->status = 400;
      return -1;
    }
  }
  return 0;
}

/* The path of the request target: origin-form ("/metrics?x") as it is,
 * absolute-form ("http://host:port/metrics", which RFC 9112 3.2.2 says a
 * server MUST accept) reduced to its path; the query is dropped (Prometheus
 * may add parameters; they mean nothing here). Returns false if the target
 * is neither. */
static bool target_path(conn_t *c) {
  char *q = strchr(c->url, '?');
  if (q) *q = '\0';
  if (c->url[0] == '/') return true;
  struct http_parser_url u;
  http_parser_url_init(&u);
  if (http_parser_parse_url(c->url, strlen(c->url), 0, &u) != 0 || !(u.field_set & (1 << UF_SCHEMA)) ||
      !(u.field_set & (1 << UF_HOST)))
    return false;
  size_t sl = u.field_data[UF_SCHEMA].len;
  if (!((sl == 4 && strncasecmp(c->url, "http", 4) == 0) || (sl == 5 && strncasecmp(c->url, "https", 5) == 0)))
    return false;
  if (!(u.field_set & (1 << UF_PATH))) {
    strcpy(c->url, "/");
    return true;
  }
  memmove(c->url, c->url + u.field_data[UF_PATH].off, u.field_data[UF_PATH].len);
  c->url[u.field_data[UF_PATH].len] = '\0';
  return true;
}

/* Decides the answer from method, path and declared body size, then pauses
 * the parser: nothing after the headers is ever needed. */
static int on_headers_complete(http_parser *p) {
  conn_t *c = p->data;
  /* HTTP/1.x only. A request line without a version (HTTP/0.9) does not
   * follow RFC 9112's grammar: 400. A 2.0 or later one is well formed but
   * not spoken here (h2 needs its preface): 505. */
  if (p->http_major != 1) {
    c->status = p->http_major == 0 ? 400 : 505;
    http_parser_pause(p, 1);
    return 0;
  }
  if (!target_path(c)) {
    c->status = 400;
    http_parser_pause(p, 1);
    return 0;
  }
  bool known = strcmp(c->url, "/metrics") == 0 || strcmp(c->url, "/healthz") == 0 ||
               strcmp(c->url, "/readyz") == 0;
  bool get = p->method == HTTP_GET || p->method == HTTP_HEAD;
  c->head_only = p->method == HTTP_HEAD;
  if (!known)
    c->status = 404;
  else if (!get)
    c->status = 405;
  else if (p->content_length != ULLONG_MAX && p->content_length > c->h->o.max_body_bytes)
    c->status = 413;
  else if (strcmp(c->url, "/readyz") == 0) {
    fps_metrics_http_t *h = c->h;
    bool ready = h->o.ready ? h->o.ready(h->o.arg) : fps__metrics_ready_get();
    c->status = ready ? 200 : 503;
  } else
    c->status = 200;
  http_parser_pause(p, 1);
  return 0;
}

/* ------------------------------------------------------------ libuv side */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  conn_t *c = handle->data;
  (void)suggested;
  *buf = uv_buf_init(c->h->rbuf, sizeof c->h->rbuf);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = stream->data;
  if (nread < 0) {
    /* EOF or error: before an answer the client gave up; after it, the
     * drain is done. Either way the connection is finished. */
    conn_close(c);
    return;
  }
  if (nread == 0 || c->responded) return; /* draining: discard */
  size_t used = http_parser_execute(&c->parser, &c->h->settings, buf->base, (size_t)nread);
  enum http_errno err = HTTP_PARSER_ERRNO(&c->parser);
  /* The parser pauses right after the headers, so `used` counts exactly the
   * request line and header bytes of this read. */
  c->head_bytes += used;
  if (c->head_bytes > c->h->o.max_header_bytes && (c->status == 0 || c->status == 200))
    c->status = 431;
  if (c->status == 0 && err != HPE_OK && err != HPE_PAUSED)
    c->status = err == HPE_HEADER_OVERFLOW ? 431 : 400;
  /* http-parser reports "message complete" without headers for nothing;
   * a request that ended (used < nread without pause) is malformed too. */
  if (c->status == 0 && used != (size_t)nread && err == HPE_OK) c->status = 400;
  if (c->status != 0) conn_respond(c);
}

static void on_timer(uv_timer_t *t) {
  conn_t *c = t->data;
  if (c->responded) {
    conn_close(c); /* linger over */
    return;
  }
  c->status = 408;
  c->url[0] = '\0';
  conn_respond(c);
}

static void on_connection(uv_stream_t *server, int status) {
  fps_metrics_http_t *h = server->loop->data;
  if (status < 0) return; /* e.g. EMFILE: libuv already sheds the connection */
  conn_t *c = fps_calloc(1, sizeof *c);
  if (c == NULL) return;
  c->h = h;
  c->tcp.data = c;
  c->timer.data = c;
  uv_tcp_init(&h->loop, &c->tcp);
  uv_timer_init(&h->loop, &c->timer);
  c->handles = 2;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0) {
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, conn_close_cb);
    uv_close((uv_handle_t *)&c->timer, conn_close_cb);
    return;
  }
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  if (h->nconns >= h->o.max_connections) {
    /* At the limit: make room by closing the oldest connection that is not
     * writing an answer (waiting for its request, or lingering after the
     * answer went out); if every one is writing, the oldest. */
    conn_t *victim = h->oldest;
    for (conn_t *o = h->oldest; o; o = o->next)
      if (o->out == NULL) {
        victim = o;
        break;
      }
    fps__metrics_http_rejected();
    conn_close(victim);
  }
  c->counted = true;
  c->prev = h->newest;
  if (h->newest) h->newest->next = c; else h->oldest = c;
  h->newest = c;
  h->nconns++;
  fps__metrics_http_connections_add(1);
  uv_timer_start(&c->timer, on_timer, h->o.request_timeout_ms, 0);
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) conn_close(c);
}

static void walk_close(uv_handle_t *handle, void *arg) {
  (void)arg;
  if (handle->data != NULL)
    conn_close(handle->data);
  else if (!uv_is_closing(handle))
    uv_close(handle, NULL);
}

static void on_stop(uv_async_t *a) { uv_walk(a->loop, walk_close, NULL); }

static void loop_thread(void *arg) {
  fps_metrics_http_t *h = arg;
  uv_run(&h->loop, UV_RUN_DEFAULT);
}

/* Resolves "host:port", "[v6]:port" or ":port" (numeric port). */
static int parse_listen(const char *listen, struct sockaddr_storage *ss) {
  char host[256];
  const char *colon = strrchr(listen, ':');
  if (colon == NULL || colon[1] == '\0') return FPS_EINVAL;
  size_t hl = (size_t)(colon - listen);
  const char *hs = listen;
  if (hl >= 2 && listen[0] == '[' && listen[hl - 1] == ']') {
    hs++;
    hl -= 2;
  }
  if (hl >= sizeof host) return FPS_EINVAL;
  memcpy(host, hs, hl);
  host[hl] = '\0';
  char *end;
  long port = strtol(colon + 1, &end, 10);
  if (*end != '\0' || port < 0 || port > 65535) return FPS_EINVAL;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  if (getaddrinfo(hl ? host : NULL, colon + 1, &hints, &res) != 0 || res == NULL) {
    if (res) freeaddrinfo(res);
    return FPS_EINVAL;
  }
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return 0;
}

static int write_port_file(const char *path, int port) {
  char tmp[4096];
  if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return UV_ENAMETOOLONG;
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return UV_EIO;
  int ok = fprintf(f, "%d\n", port) > 0;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    remove(tmp);
    return UV_EIO;
  }
  return 0;
}

int fps_metrics_http_start(const fps_metrics_http_opts_t *opts, fps_metrics_http_t **out) {
  if (opts == NULL || opts->listen == NULL || out == NULL) return FPS_EINVAL;
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  if (parse_listen(opts->listen, &ss) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "metrics: bad listen address '%s' (want host:port)", opts->listen);
    return FPS_EINVAL;
  }
  fps_metrics_http_t *h = fps_calloc(1, sizeof *h);
  if (h == NULL) return FPS_ENOMEM;
  h->o = *opts;
  h->o.listen = NULL;
  h->o.port_file = NULL;
  if (!h->o.max_connections) h->o.max_connections = 128;
  if (!h->o.request_timeout_ms) h->o.request_timeout_ms = 5000;
  if (!h->o.max_header_bytes) h->o.max_header_bytes = 8192;
  if (!h->o.max_body_bytes) h->o.max_body_bytes = 1024;
  http_parser_settings_init(&h->settings);
  h->settings.on_url = on_url;
  h->settings.on_header_field = on_header_field;
  h->settings.on_headers_complete = on_headers_complete;

  /* libuv writes with plain write(): a peer that resets must not kill us. */
  signal(SIGPIPE, SIG_IGN);

  int rc = uv_loop_init(&h->loop);
  if (rc < 0) {
    fps_free(h);
    return FPS_EIO;
  }
  h->loop.data = h;
  /* Handles whose data is NULL are the listener and the async; on stop,
   * walk_close tells them from connections by that. */
  uv_tcp_init(&h->loop, &h->listener);
  h->listener.data = NULL;
  uv_async_init(&h->loop, &h->stop, on_stop);
  h->stop.data = NULL;
  rc = uv_tcp_bind(&h->listener, (const struct sockaddr *)&ss, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&h->listener, FPS__BACKLOG, on_connection);
  if (rc == 0) {
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    rc = uv_tcp_getsockname(&h->listener, (struct sockaddr *)&bound, &blen);
    if (rc == 0)
      h->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                            : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  }
  if (rc == 0 && opts->port_file && *opts->port_file) rc = write_port_file(opts->port_file, h->port);
  if (rc == 0) rc = uv_thread_create(&h->thread, loop_thread, h);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "metrics: cannot serve on '%s': %s", opts->listen, uv_strerror(rc));
    uv_close((uv_handle_t *)&h->listener, NULL);
    uv_close((uv_handle_t *)&h->stop, NULL);
    uv_run(&h->loop, UV_RUN_DEFAULT);
    uv_loop_close(&h->loop);
    fps_free(h);
    return FPS_EIO;
  }
  *out = h;
  return 0;
}

int fps_metrics_http_port(const fps_metrics_http_t *h) { return h ? h->port : -1; }

void fps_metrics_http_stop(fps_metrics_http_t *h) {
  if (h == NULL) return;
  uv_async_send(&h->stop);
  uv_thread_join(&h->thread);
  uv_loop_close(&h->loop);
  fps_free(h);
}

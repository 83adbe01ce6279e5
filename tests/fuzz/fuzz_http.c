/* libFuzzer target: the metrics endpoint's request path (server/metrics/
 * http.c), on in-memory bytes. The handler functions are static, so this
 * file includes http.c itself: the fuzzer runs that code unchanged, and
 * http.c keeps its narrow API.
 *
 * Each input is one connection. A real connection is replaced by one end
 * of a socketpair opened as the libuv stream (what the answer is written
 * to), set up the way on_connection() sets up an accepted one; the request
 * bytes are handed to on_read() in chunks, exactly as libuv would after
 * on_alloc(). Then the client either stops sending (the request timer
 * fires: on_timer) or closes (EOF), the loop runs the write, shutdown and
 * close callbacks, and the bytes that reached the other end are checked:
 * an answer, if any, must be a whole HTTP/1.1 response whose Content-Length
 * matches its body.
 *
 * Input: byte 0 = options (bit 0: /readyz says ready; bit 1: end with the
 * request timeout instead of EOF; bits 2-7: chunk size, 0 = one read), the
 * rest is the request as the client sends it. */
#include "http.c"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static fps_metrics_http_t *fz_h;

static void fz_setup(void) {
  fps_metrics_config_t mc = {.shard_id = 0, .shard_count = 1, .mode = "async", .workers = 1,
                             .simd = "scalar", .version = "fuzz"};
  fps_metrics_init(&mc);
  fz_h = calloc(1, sizeof *fz_h);
  if (fz_h == NULL) abort();
  /* The defaults fps_metrics_http_start() applies. */
  fz_h->o.max_connections = 128;
  fz_h->o.request_timeout_ms = 5000;
  fz_h->o.max_header_bytes = 8192;
  fz_h->o.max_body_bytes = 1024;
  http_parser_settings_init(&fz_h->settings);
  fz_h->settings.on_url = on_url;
  fz_h->settings.on_headers_complete = on_headers_complete;
  signal(SIGPIPE, SIG_IGN);
  if (uv_loop_init(&fz_h->loop) < 0) abort();
  fz_h->loop.data = fz_h;
}

static void fz_find(uv_handle_t *handle, void *arg) {
  void **want = arg;
  if (handle == want[0]) want[1] = handle;
}

/* Is the connection's tcp handle still in the loop (not yet freed)? */
static bool fz_alive(uv_tcp_t *tcp) {
  void *want[2] = {tcp, NULL};
  uv_walk(&fz_h->loop, fz_find, want);
  return want[1] != NULL;
}

/* The answer must be one whole response: status line, headers, and a body
 * of exactly Content-Length bytes (none for HEAD). */
static void fz_check_answer(const char *r, size_t n, int status, bool head_only) {
  char line[32];
  snprintf(line, sizeof line, "HTTP/1.1 %d ", status);
  if (n < strlen(line) || memcmp(r, line, strlen(line)) != 0) {
    fprintf(stderr, "fuzz_http: answer does not start with '%s'\n", line);
    abort();
  }
  const char *end = memmem(r, n, "\r\n\r\n", 4);
  const char *cl = memmem(r, n, "Content-Length: ", 16);
  if (end == NULL || cl == NULL || cl > end) {
    fprintf(stderr, "fuzz_http: answer without a header end or Content-Length\n");
    abort();
  }
  size_t want = (size_t)strtoull(cl + 16, NULL, 10);
  size_t body = n - (size_t)(end + 4 - r);
  if (body != (head_only ? 0 : want)) {
    fprintf(stderr, "fuzz_http: body is %zu bytes, Content-Length says %zu\n", body, want);
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (fz_h == NULL) fz_setup();
  if (size == 0) return 0;
  uint8_t opt = data[0];
  data++;
  size--;
  fps_metrics_ready_set(opt & 1);
  size_t chunk = (size_t)(opt >> 2) * 7;
  if (chunk == 0 || chunk > sizeof fz_h->rbuf) chunk = sizeof fz_h->rbuf;

  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) abort();
  /* Room for the largest /metrics answer, so the write completes at once. */
  int sz = 1 << 20;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);

  /* As on_connection() after uv_accept(). */
  conn_t *c = calloc(1, sizeof *c);
  if (c == NULL) abort();
  c->h = fz_h;
  c->tcp.data = c;
  c->timer.data = c;
  uv_tcp_init(&fz_h->loop, &c->tcp);
  uv_timer_init(&fz_h->loop, &c->timer);
  c->handles = 2;
  if (uv_tcp_open(&c->tcp, sv[0]) != 0) abort();
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  c->counted = true;
  fz_h->nconns++;
  fps__metrics_http_connections_add(1);
  uv_timer_start(&c->timer, on_timer, fz_h->o.request_timeout_ms, 0);

  /* The request, read by read as libuv would deliver it. Nothing here runs
   * the loop, so c stays allocated until the loop runs below. */
  uv_tcp_t *tcp = &c->tcp;
  for (size_t off = 0; off < size && !c->closing;) {
    size_t n = size - off < chunk ? size - off : chunk;
    uv_buf_t buf;
    on_alloc((uv_handle_t *)tcp, 65536, &buf);
    memcpy(buf.base, data + off, n);
    on_read((uv_stream_t *)tcp, (ssize_t)n, &buf);
    off += n;
  }
  int status = c->status;
  bool responded = c->responded, head_only = c->head_only;
  if (!responded && !c->closing && (opt & 2)) {
    on_timer(&c->timer); /* the request timer fired: 408 */
    status = c->status;
    responded = c->responded;
    head_only = c->head_only;
  }
  /* The write, its shutdown; then the client's EOF ends the drain. */
  for (int i = 0; i < 3; i++) uv_run(&fz_h->loop, UV_RUN_NOWAIT);
  if (fz_alive(tcp) && !c->closing) {
    uv_buf_t none = uv_buf_init(NULL, 0);
    on_read((uv_stream_t *)tcp, UV_EOF, &none);
  }
  uv_run(&fz_h->loop, UV_RUN_DEFAULT);
  if (fz_alive(tcp)) {
    fprintf(stderr, "fuzz_http: connection still open after EOF\n");
    abort();
  }
  if (fz_h->nconns != 0) {
    fprintf(stderr, "fuzz_http: connection count is %u after close\n", fz_h->nconns);
    abort();
  }

  static char answer[1 << 20];
  size_t got = 0;
  fcntl(sv[1], F_SETFL, O_NONBLOCK);
  for (;;) {
    ssize_t r = read(sv[1], answer + got, sizeof answer - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(sv[1]);
  if (responded) fz_check_answer(answer, got, status, head_only);
  else if (got != 0) {
    fprintf(stderr, "fuzz_http: %zu bytes sent without an answer being decided\n", got);
    abort();
  }
  return 0;
}

/* A minimal HTTP/1.1 GET of /metrics (Connection: close, read to EOF) and
 * a scan of the Prometheus text for named series: enough for tests, no
 * dependency. */
#include "scrape.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define SCRAPE_MAX (1u << 20) /* a shard's page is ~20 KB */

static char *http_get_metrics(int port, size_t *len) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return NULL;
  struct timeval tv = {2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  static const char req[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  char *buf = NULL;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) || write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1))
    goto fail;
  buf = malloc(SCRAPE_MAX + 1);
  if (!buf) goto fail;
  size_t n = 0;
  for (ssize_t r; n < SCRAPE_MAX && (r = read(fd, buf + n, SCRAPE_MAX - n)) != 0; n += (size_t)r)
    if (r < 0) goto fail; /* includes the 2 s timeout */
  close(fd);
  buf[n] = 0;
  if (strncmp(buf, "HTTP/1.1 200", 12)) {
    free(buf);
    return NULL;
  }
  *len = n;
  return buf;
fail:
  free(buf);
  close(fd);
  return NULL;
}

int fps_test_scrape(int port, const char *const *names, double *vals, size_t n) {
  size_t len;
  char *page = http_get_metrics(port, &len);
  if (!page) return -1;
  for (size_t i = 0; i < n; i++) {
    vals[i] = NAN;
    size_t nl = strlen(names[i]);
    /* A sample line starts with the name, then '{' or ' '. */
    for (char *p = page; (p = strstr(p, names[i])); p += nl) {
      if (p != page && p[-1] != '\n') continue;
      char *q = p + nl;
      if (*q == '{') q = strchr(q, '}');
      if (!q || (*q != '}' && *q != ' ')) continue;
      if (*q == '}') q++;
      vals[i] = strtod(q, NULL);
      break;
    }
  }
  free(page);
  return 0;
}

int fps_test_read_port(const char *path) {
  FILE *f = fopen(path, "r");
  int port = -1;
  if (!f) return -1;
  if (fscanf(f, "%d", &port) != 1) port = -1;
  fclose(f);
  return port;
}

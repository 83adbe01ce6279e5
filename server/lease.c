/* fps_lease_open: picks the backend by the spec's prefix (lease.h). */
#include <stdio.h>
#include <string.h>

#include "error.h"
#include "lease.h"
#include "log.h"

int fps_lease_spec_check(const char *spec, char *why, size_t len) {
  if (!strncmp(spec, "file:", 5)) {
    if (!spec[5]) {
      snprintf(why, len, "'file:' needs a path (file:PATH)");
      return FPS_EINVAL;
    }
    return 0;
  }
  if (!strncmp(spec, "etcd:", 5)) {
    /* etcd:HOST:PORT/KEY: a host, a decimal port, a non-empty key. */
    const char *a = spec + 5, *slash = strchr(a, '/');
    const char *colon = slash ? memrchr(a, ':', (size_t)(slash - a)) : NULL;
    size_t nd = colon ? strspn(colon + 1, "0123456789") : 0;
    if (!slash || !slash[1] || !colon || colon == a || nd == 0 || nd > 5 || colon + 1 + nd != slash) {
      snprintf(why, len, "'%s' must be etcd:HOST:PORT/KEY", spec);
      return FPS_EINVAL;
    }
    return 0;
  }
  snprintf(why, len, "'%s' names no lease backend (file:PATH or etcd:HOST:PORT/KEY)", spec);
  return FPS_EINVAL;
}

int fps_lease_open(const char *spec, double ttl_s, const char *holder, fps_lease_t **out) {
  char why[256];
  *out = NULL;
  if (fps_lease_spec_check(spec, why, sizeof why) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--lease %s", why);
    return FPS_EINVAL;
  }
  if (!strncmp(spec, "file:", 5)) return fps__lease_file_open(spec + 5, out);
#ifdef FPS_LEASE_ETCD
  return fps__lease_etcd_open(spec + 5, ttl_s, holder, out);
#else
  (void)ttl_s;
  (void)holder;
  FPS_LOG(FPS_LOG_ERROR, "--lease %s: this build has no etcd backend", spec);
  return FPS_EUNSUPPORTED;
#endif
}

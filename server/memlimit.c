/* The memory limit of this process (see memlimit.h). */
#include "memlimit.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A cgroup limit file: a decimal byte count, or "max". 0: none/unreadable. */
static uint64_t fps__memlimit_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char buf[64] = "";
  bool got = fgets(buf, sizeof buf, f) != NULL;
  fclose(f);
  if (!got || buf[0] < '0' || buf[0] > '9') return 0; /* "max", junk */
  char *end;
  unsigned long long v = strtoull(buf, &end, 10);
  return (*end == '\n' || *end == '\0') ? (uint64_t)v : 0;
}

/* The limit of the cgroup at PATH (as /proc/self/cgroup names it) of one
 * hierarchy mounted at mnt: the file at PATH, else at the mount point. */
static uint64_t fps__memlimit_cgroup(const char *root, const char *mnt, const char *path, const char *file,
                                     char *source, size_t source_len) {
  char p[4096];
  const char *paths[2] = {path, ""};
  for (int i = 0; i < 2; i++) {
    if (snprintf(p, sizeof p, "%s%s%s/%s", root, mnt, strcmp(paths[i], "/") ? paths[i] : "", file) >=
        (int)sizeof p)
      continue;
    uint64_t v = fps__memlimit_file(p);
    if (v) {
      snprintf(source, source_len, "cgroup %s", p);
      return v;
    }
  }
  return 0;
}

uint64_t fps_memlimit(const char *root, char *source, size_t source_len) {
  uint64_t phys = 0;
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages > 0 && psz > 0) phys = (uint64_t)pages * (uint64_t)psz;
  snprintf(source, source_len, "physical memory");
  char p[4096], line[4096];
  snprintf(p, sizeof p, "%s/proc/self/cgroup", root);
  FILE *f = fopen(p, "r");
  uint64_t lim = 0;
  char src[4200] = "";
  while (f && fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    /* "ID:CONTROLLERS:PATH" */
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2) continue;
    *c2 = '\0';
    char *ctl = c1 + 1, *path = c2 + 1, *save = NULL;
    uint64_t v = 0;
    char s[4200];
    if (!strcmp(line, "0") && !*ctl) {
      v = fps__memlimit_cgroup(root, "/sys/fs/cgroup", path, "memory.max", s, sizeof s);
      if (!v) v = fps__memlimit_cgroup(root, "/sys/fs/cgroup/unified", path, "memory.max", s, sizeof s);
    } else {
      for (char *tok = strtok_r(ctl, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (!strcmp(tok, "memory")) v = fps__memlimit_cgroup(root, "/sys/fs/cgroup/memory", path,
                                                             "memory.limit_in_bytes", s, sizeof s);
    }
    if (v && (!lim || v < lim)) {
      lim = v;
      snprintf(src, sizeof src, "%s", s);
    }
  }
  if (f) fclose(f);
  /* v1 says "unlimited" with a huge page-rounded number. */
  if (lim && (!phys || lim < phys)) {
    snprintf(source, source_len, "%s", src);
    return lim;
  }
  return phys;
}

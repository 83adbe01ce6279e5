/* The file lease (lease.h "file:PATH"): flock(2) LOCK_EX on PATH.
 *
 * Why flock: the kernel releases it the instant the holder's last
 * descriptor closes, and a process that dies closes every descriptor, so
 * a SIGKILLed primary frees the lease at once and the standby's next try
 * (within 5 ms) takes it. It serves replicas on one host (or a local
 * filesystem they share); across hosts use etcd.
 *
 * The term is a decimal counter in the file itself, read, incremented,
 * written and fsynced by each new holder while it holds the lock: two
 * holders are never at once, so the counter only grows, and the fsync
 * keeps it growing across a crash of the machine. After the term, the
 * holder keeps the standby-sync record (lease.h): "<term> in-sync" or
 * "<term> alone"; a bare "<term>" (a file no replica wrote a record in)
 * reads as in sync: nobody acknowledged anything alone yet. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "lease.h"
#include "log.h"

typedef struct fps_lease_file_s {
  fps_lease_t base;
  char *path;
  int fd;          /* open while held, else -1 */
  atomic_bool held;
  uint64_t term;   /* held: ours */
  int sync;        /* the record found at acquire: 1 in sync, 0 alone */
} fps_lease_file_t;

/* One non-blocking try: opens PATH and locks it. *got tells whether the
 * lock is ours (l->fd then holds it). */
static int fps__lease_file_lock_once(fps_lease_file_t *l, bool *got) {
  *got = false;
  int fd = open(l->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: open: %s", l->path, strerror(errno));
    return FPS_EIO;
  }
  int r;
  do r = flock(fd, LOCK_EX | LOCK_NB);
  while (r < 0 && errno == EINTR);
  if (r < 0) {
    int e = errno;
    close(fd);
    if (e == EWOULDBLOCK) return 0;
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: flock: %s", l->path, strerror(e));
    return FPS_EIO;
  }
  /* Locked; but if the path was unlinked or replaced meanwhile, the lock
   * is on a file nobody else will ever lock: try again on the new one. */
  struct stat a, b;
  if (fstat(fd, &a) < 0 || stat(l->path, &b) < 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
    close(fd);
    return 0;
  }
  l->fd = fd;
  *got = true;
  return 0;
}

/* Parses the record of buf (n bytes, NUL-terminated): "<term>\n",
 * "<term> in-sync\n" or "<term> alone\n"; an empty file is term 0, in
 * sync. 0 with *term and *sync (1 in sync, 0 alone), or FPS_EFORMAT. */
static int fps__lease_file_parse(const char *buf, ssize_t n, uint64_t *term, int *sync) {
  *term = 0;
  *sync = 1;
  if (n == 0) return 0;
  char *end;
  errno = 0;
  unsigned long long u = strtoull(buf, &end, 10);
  if (!strcmp(end, " alone\n")) *sync = 0, end += strlen(end);
  else if (!strcmp(end, " in-sync\n")) end += strlen(end);
  if (errno || end == buf || (*end && *end != '\n') || u >= UINT64_MAX) return FPS_EFORMAT;
  *term = u;
  return 0;
}

/* Reads the counter, writes counter + 1, fsyncs. REQUIRES: the lock. */
static int fps__lease_file_bump(fps_lease_file_t *l, uint64_t *term) {
  char buf[64];
  ssize_t n = pread(l->fd, buf, sizeof buf - 1, 0);
  if (n < 0) goto io;
  buf[n] = 0;
  uint64_t old = 0;
  if (fps__lease_file_parse(buf, n, &old, &l->sync) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: holds '%.*s', not a term counter: refusing to guess a term", l->path,
            (int)n, buf);
    return FPS_EFORMAT;
  }
  /* The record stays as the predecessor left it until we write ours. */
  int len = snprintf(buf, sizeof buf, "%" PRIu64 "%s\n", old + 1, l->sync ? " in-sync" : " alone");
  if (pwrite(l->fd, buf, (size_t)len, 0) != len || ftruncate(l->fd, len) < 0 || fsync(l->fd) < 0) goto io;
  *term = old + 1;
  l->term = old + 1;
  return 0;
io:
  FPS_LOG(FPS_LOG_ERROR, "lease file:%s: term counter: %s", l->path, strerror(errno));
  return FPS_EIO;
}

static int fps__lease_file_acquire(fps_lease_t *base, const atomic_bool *stop, uint64_t *term) {
  fps_lease_file_t *l = (fps_lease_file_t *)base;
  for (;;) {
    if (stop && atomic_load(stop)) return FPS_ECANCELLED;
    bool got;
    int rc = fps__lease_file_lock_once(l, &got);
    if (rc < 0) return rc;
    if (got) break;
    nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
  }
  int rc = fps__lease_file_bump(l, term);
  if (rc < 0) {
    close(l->fd); /* drops the lock */
    l->fd = -1;
    return rc;
  }
  atomic_store(&l->held, true);
  return 0;
}

static bool fps__lease_file_valid(fps_lease_t *base) {
  return atomic_load(&((fps_lease_file_t *)base)->held);
}

static void fps__lease_file_release(fps_lease_t *base) {
  fps_lease_file_t *l = (fps_lease_file_t *)base;
  atomic_store(&l->held, false);
  if (l->fd >= 0) close(l->fd); /* closing the only descriptor unlocks */
  l->fd = -1;
}

static void fps__lease_file_close(fps_lease_t *base) {
  fps_lease_file_t *l = (fps_lease_file_t *)base;
  fps__lease_file_release(base);
  fps_free(l->path);
  fps_free(l);
}

static int fps__lease_file_set_sync(fps_lease_t *base, bool in_sync) {
  fps_lease_file_t *l = (fps_lease_file_t *)base;
  if (!atomic_load(&l->held) || l->fd < 0) return FPS_EIO;
  char buf[64];
  int len = snprintf(buf, sizeof buf, "%" PRIu64 "%s\n", l->term, in_sync ? " in-sync" : " alone");
  if (pwrite(l->fd, buf, (size_t)len, 0) != len || ftruncate(l->fd, len) < 0 || fsync(l->fd) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: sync record: %s", l->path, strerror(errno));
    return FPS_EIO;
  }
  return 0;
}

static int fps__lease_file_get_sync(fps_lease_t *base) { return ((fps_lease_file_t *)base)->sync; }

/* The counter as the newest holder wrote it (under its lock, fsynced
 * before it acted on its term); read without the lock: a holder writes
 * the whole line with one pwrite. */
static int fps__lease_file_newest_term(fps_lease_t *base, uint64_t *term) {
  fps_lease_file_t *l = (fps_lease_file_t *)base;
  int fd = open(l->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: open: %s", l->path, strerror(errno));
    return FPS_EIO;
  }
  char buf[64];
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  int e = errno;
  close(fd);
  if (n < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease file:%s: read: %s", l->path, strerror(e));
    return FPS_EIO;
  }
  buf[n] = 0;
  int sync;
  return fps__lease_file_parse(buf, n, term, &sync); /* empty: no term granted yet */
}

static const fps_lease_ops_t fps__lease_file_ops = {fps__lease_file_acquire,     fps__lease_file_valid,
                                                    fps__lease_file_release,     fps__lease_file_close,
                                                    fps__lease_file_set_sync,    fps__lease_file_get_sync,
                                                    fps__lease_file_newest_term};

int fps__lease_file_open(const char *rest, fps_lease_t **out) {
  fps_lease_file_t *l = fps_calloc(1, sizeof *l);
  if (!l) return FPS_ENOMEM;
  l->base.ops = &fps__lease_file_ops;
  l->fd = -1;
  atomic_init(&l->held, false);
  if (!(l->path = fps_strdup(rest))) {
    fps_free(l);
    return FPS_ENOMEM;
  }
  /* Fail at start-up, not at the first failover, if the file cannot be
   * created or opened (a missing directory, no permission). */
  int fd = open(l->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--lease file:%s: %s", l->path, strerror(errno));
    fps_free(l->path);
    fps_free(l);
    return FPS_EIO;
  }
  close(fd);
  *out = &l->base;
  return 0;
}

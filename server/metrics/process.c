/* The standard process_* series (the names every Prometheus client library
 * uses, so stock dashboards and alerts work unchanged), read from /proc and
 * getrusage at scrape time, and glibc malloc's own totals. Linux only, like
 * the rest of factorps. */
#include <dirent.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static void gauge(fps__mbuf_t *b, const char *name, const char *type, const char *help,
                  const char *labels, double v) {
  fps__mbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %.17g\n", name, help, name, type, name,
                   labels, v);
}

static long open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL) return -1;
  long n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory stream's own descriptor */
}

/* Start time in seconds since the epoch: field 22 of /proc/self/stat (clock
 * ticks after boot) plus the boot time from /proc/stat. Also returns the
 * thread count (field 20). */
static int stat_fields(double *start, long *threads) {
  char buf[1024];
  FILE *f = fopen("/proc/self/stat", "r");
  if (f == NULL) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  /* The command name (field 2) may contain spaces and parentheses: start
   * after the last ')'. */
  char *p = strrchr(buf, ')');
  if (p == NULL) return -1;
  unsigned long long ticks = 0;
  long nthreads = 0;
  /* Fields 3..22 follow: skip 3..19, read 20 (threads), skip 21, read 22
   * (start time). %*s skips without the overflow risk of %*d. */
  if (sscanf(p + 2, "%*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %ld %*s %llu",
             &nthreads, &ticks) != 2)
    return -1;
  f = fopen("/proc/stat", "r");
  if (f == NULL) return -1;
  unsigned long long btime = 0;
  char line[256];
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "btime %llu", &btime) == 1) break;
  fclose(f);
  long hz = sysconf(_SC_CLK_TCK);
  if (btime == 0 || hz <= 0) return -1;
  *start = (double)btime + (double)ticks / (double)hz;
  *threads = nthreads;
  return 0;
}

void fps__metrics_render_process(fps__mbuf_t *b, const char *labels) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) == 0)
    gauge(b, "process_cpu_seconds_total", "counter", "User and system CPU time spent in seconds.",
          labels,
          (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
              ru.ru_stime.tv_usec / 1e6);

  long page = sysconf(_SC_PAGESIZE);
  FILE *f = fopen("/proc/self/statm", "r");
  if (f != NULL) {
    unsigned long long size = 0, resident = 0;
    if (fscanf(f, "%llu %llu", &size, &resident) == 2 && page > 0) {
      gauge(b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", labels,
            (double)resident * (double)page);
      gauge(b, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", labels,
            (double)size * (double)page);
    }
    fclose(f);
  }

  long fds = open_fds();
  if (fds >= 0)
    gauge(b, "process_open_fds", "gauge", "Number of open file descriptors.", labels, (double)fds);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    gauge(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.", labels,
          (double)rl.rlim_cur);

  /* Resident memory of a shard with --malloc-tune (no trim) is the heap's
   * high-water mark: the most that was ever in flight at once. What it
   * holds now is malloc's in-use total; a leak shows there as a trend
   * between idle moments (tests/load watches it). mallinfo2 walks the free
   * lists under the arena lock: cheap at scrape rate. Under ASan it reports
   * only what bypassed ASan's allocator. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  struct mallinfo2 mi = mallinfo2();
  gauge(b, "factorps_heap_in_use_bytes", "gauge", "Bytes malloc has handed out and not got back.", labels,
        (double)(mi.uordblks + mi.hblkhd));
  gauge(b, "factorps_heap_size_bytes", "gauge", "Bytes malloc holds from the system (arenas and mmapped chunks).",
        labels, (double)(mi.arena + mi.hblkhd));
#endif

  double start;
  long threads;
  if (stat_fields(&start, &threads) == 0) {
    gauge(b, "process_start_time_seconds", "gauge",
          "Start time of the process since unix epoch in seconds.", labels, start);
    gauge(b, "process_threads", "gauge", "Number of OS threads in the process.", labels,
          (double)threads);
  }
}

/* How much memory this process may use, for the defaults of --max-bytes:
 * the smaller of the physical memory and the limit of the memory cgroup
 * it runs in. A container's limit (a StatefulSet's 4 GiB) is far below
 * the host's RAM; sizing from the host, the kernel OOM-kills the shard
 * where it should have answered RESOURCE_EXHAUSTED. */
#ifndef FPS_SERVER_MEMLIMIT_H
#define FPS_SERVER_MEMLIMIT_H

#include <stddef.h>
#include <stdint.h>

/* The limit in bytes, or 0 if neither is known. The cgroup is found
 * through <root>/proc/self/cgroup: cgroup v2 (the "0::PATH" line) reads
 * <root>/sys/fs/cgroup/PATH/memory.max, v1 (the "memory" controller's
 * line) <root>/sys/fs/cgroup/memory/PATH/memory.limit_in_bytes; inside a
 * container's cgroup namespace PATH is "/" and the files sit at the mount
 * point, which is tried too. "max" (v2) or a value at or above the
 * physical memory (v1's "unlimited") is no limit. `root` is "" for the
 * real system (tests pass a fake tree). *source (source_len bytes) says
 * where the figure came from, for the start-up log. Thread-safe. */
uint64_t fps_memlimit(const char *root, char *source, size_t source_len);

#endif

/* The lease that makes one replica of a shard its primary (docs/shards.md,
 * "Standby replicas").
 *
 * Two processes serve one shard id; at most one holds the lease at any
 * time, and only the holder may acknowledge worker calls. The lease comes
 * from an existing service, never from the replicas voting among
 * themselves:
 *
 *   file:PATH            flock(2) LOCK_EX on PATH (lease_file.c): one host;
 *                        the kernel drops it the instant the holder dies.
 *   etcd:HOST:PORT/KEY   an etcd v3 lease with a TTL and a key created
 *                        under it by a Txn (lease_etcd.c); the sync
 *                        record below in KEY/sync.
 *
 * Each acquisition yields a term: a number that only grows over the
 * lease's life (file: a counter kept in the locked file; etcd: the key's
 * create revision). A replica that sees a higher term than its own knows
 * it has been replaced.
 *
 * A forked child shares a held file lease until it execs (descriptors
 * are O_CLOEXEC); the server never forks.
 *
 * Threads: one thread acquires and releases; fps_lease_valid may be
 * called from any thread at any time, and is cheap (a hot path asks it
 * before every acknowledgement). */
#ifndef FPS_LEASE_H
#define FPS_LEASE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "error.h"

typedef struct fps_lease_s fps_lease_t;

/* What every backend implements; a backend's object starts with an
 * fps_lease_t whose ops point at its table. */
typedef struct fps_lease_ops_s {
  int (*acquire)(fps_lease_t *l, const atomic_bool *stop, uint64_t *term);
  bool (*valid)(fps_lease_t *l);
  void (*release)(fps_lease_t *l);
  void (*close)(fps_lease_t *l);
  /* Optional (NULL: the backend keeps no sync record): see
   * fps_lease_set_sync / fps_lease_get_sync. */
  int (*set_sync)(fps_lease_t *l, bool in_sync);
  int (*get_sync)(fps_lease_t *l);
  /* See fps_lease_newest_term. */
  int (*newest_term)(fps_lease_t *l, uint64_t *term);
} fps_lease_ops_t;

struct fps_lease_s {
  const fps_lease_ops_t *ops;
};

/* Opens the lease named by `spec` ("file:PATH" or "etcd:HOST:PORT/KEY")
 * without acquiring it. `ttl_s` is the lease's time to live (etcd only;
 * the file lease lives as long as the process). `holder` (may be NULL)
 * names this process to the lease service, for operators: the address
 * clients should use (etcd stores it as the key's value).
 * Returns 0 and *out (free with fps_lease_close), FPS_EINVAL for a spec
 * that names no backend or a malformed one (a message on stderr),
 * FPS_EUNSUPPORTED for a backend this build lacks, FPS_EIO, FPS_ENOMEM. */
int fps_lease_open(const char *spec, double ttl_s, const char *holder, fps_lease_t **out);

/* Checks the shape of `spec` without opening anything (config.c).
 * Returns 0 or FPS_EINVAL with the reason written to why[0..len). */
int fps_lease_spec_check(const char *spec, char *why, size_t len);

/* Blocks until this process holds the lease, or until *stop becomes true
 * (checked at least every 10 ms). On success *term is the new term,
 * greater than every term handed out before by this lease. Returns 0,
 * FPS_ECANCELLED (stop was set; the lease is not held), FPS_EIO (the
 * service failed; the caller may retry). REQUIRES: the lease not held. */
static inline int fps_lease_acquire(fps_lease_t *l, const atomic_bool *stop, uint64_t *term) {
  return l->ops->acquire(l, stop, term);
}

/* True while this process holds the lease and may act on it (etcd:
 * before the expiry minus a safety margin, by this process's monotonic
 * clock; file: from acquire to release). Any thread; no blocking. */
static inline bool fps_lease_valid(fps_lease_t *l) { return l->ops->valid(l); }

/* Gives the lease up, so that the other replica can take it. No-op when
 * not held. */
static inline void fps_lease_release(fps_lease_t *l) { l->ops->release(l); }

/* The standby-sync record the lease service keeps with the lease
 * (REPLICA.md, CHANGED 08:15): whether the standby holds everything the
 * holder acknowledged. The holder writes it durably, out of sync BEFORE
 * it acknowledges anything alone, in sync once its standby caught up; the
 * next holder reads what its predecessor left right after acquiring.
 * set: 0, FPS_EIO (not written: the caller must not act on it),
 * FPS_EUNSUPPORTED (the backend keeps none). get: 1 in sync, 0 out of
 * sync, FPS_EUNSUPPORTED. REQUIRES: the lease held. */
static inline int fps_lease_set_sync(fps_lease_t *l, bool in_sync) {
  return l->ops->set_sync ? l->ops->set_sync(l, in_sync) : FPS_EUNSUPPORTED;
}
static inline int fps_lease_get_sync(fps_lease_t *l) {
  return l->ops->get_sync ? l->ops->get_sync(l) : FPS_EUNSUPPORTED;
}

/* A bound on every term this lease has handed out so far, read from the
 * service (held or not): file: the counter in the file; etcd: the store's
 * revision (a term is the revision of the Txn that created the key). A
 * term above it was never granted: a replica must not believe it (a
 * forged Replicate hello with term 2^64 - 1 would otherwise outrank every
 * real primary for good). 0, FPS_EIO (not read; the caller refuses),
 * FPS_EFORMAT (file: not a counter). Blocks up to the service's call
 * deadline (etcd: 2 s). */
static inline int fps_lease_newest_term(fps_lease_t *l, uint64_t *term) {
  return l->ops->newest_term(l, term);
}
/* Releases (if held) and frees. NULL is a no-op. */
static inline void fps_lease_close(fps_lease_t *l) {
  if (l) l->ops->close(l);
}

/* Backends' constructors (lease.c dispatches on the spec's prefix; `rest`
 * is the spec after "file:" / "etcd:"). */
int fps__lease_file_open(const char *rest, fps_lease_t **out);
int fps__lease_etcd_open(const char *rest, double ttl_s, const char *holder, fps_lease_t **out);

#endif

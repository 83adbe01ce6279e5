/* The process's replica (replica.h): the lease thread, the gate on worker
 * calls, what Stats, /readyz and /metrics show.
 *
 * The lease thread is the only one that acquires and releases the lease.
 * A standby that may compete (fps_role_may_compete) blocks in the
 * lease's acquire; the flag it passes is raised whenever it may no longer
 * compete (a primary's hello arrived) or the process stops. Once it holds
 * the lease with a new term it reads the predecessor's sync record (an
 * "alone" there makes this an unclean promotion: logged and counted),
 * puts "alone" on record for its own term, is promoted and starts sending
 * to its peer (replica_send.c). A primary's thread checks every 10 ms that the
 * lease is still valid (etcd: not past its expiry less a margin) and that
 * no higher term was seen; otherwise it steps down at once: from then on
 * it acknowledges nothing (fps_replica_may_ack is false before the
 * release), fails the calls that wait for an ack, and becomes a standby
 * that takes a state transfer before it may compete again. */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "lease.h"
#include "metrics.h"
#include "replica.h"
#include "replica_send.h"
#include "server.h"

struct fps_replica_s {
  fps_server_t *srv;
  fps_role_t role;
  fps_lease_t *lease;           /* NULL: solo */
  atomic_bool stop;             /* the process stops */
  atomic_bool abort_acquire;    /* stop, or this standby may no longer compete */
  pthread_t th;
  bool th_on;
  fps_rsend_t *send;            /* the primary's sending side */
  pthread_mutex_t commit_mu;    /* a standby's batch commit vs promotion */
};

int fps_replica_set_sync(fps_replica_t *r, bool in_sync) {
  int rc = fps_lease_set_sync(r->lease, in_sync);
  return rc == FPS_EUNSUPPORTED ? 0 : rc;
}

void fps_replica_commit_lock(fps_replica_t *r) { pthread_mutex_lock(&r->commit_mu); }
void fps_replica_commit_unlock(fps_replica_t *r) { pthread_mutex_unlock(&r->commit_mu); }

fps_role_t *fps_replica_role(fps_replica_t *r) { return &r->role; }

/* The sender's view of its replica (replica_send.h): replica_send.c
 * resumes this file through these, never by name. */
static void fps__replica_publish_cb(void *r) { fps_replica_publish(r); }
static int fps__replica_set_sync_cb(void *r, bool in_sync) { return fps_replica_set_sync(r, in_sync); }
static int fps__replica_refusal_cb(void *r, char *why, size_t why_len) { return fps_replica_refusal(r, why, why_len); }

int fps_replica_create(fps_server_t *srv, fps_replica_t **out) {
  *out = NULL;
  fps_replica_t *r = fps_calloc(1, sizeof *r);
  if (!r) return FPS_ENOMEM;
  r->srv = srv;
  bool replicated = *srv->cfg.replica_peer != 0;
  fps_role_init(&r->role, replicated);
  pthread_mutex_init(&r->commit_mu, NULL);
  atomic_init(&r->stop, false);
  atomic_init(&r->abort_acquire, false);
  if (replicated) {
    const char *self = *srv->cfg.replica_advertise ? srv->cfg.replica_advertise : srv->cfg.listen;
    int rc = fps_lease_open(srv->cfg.lease, srv->cfg.lease_ttl, self, &r->lease);
    fps_rsend_owner_t own = {.arg = r, .role = &r->role, .publish = fps__replica_publish_cb,
                             .set_sync = fps__replica_set_sync_cb, .refusal = fps__replica_refusal_cb};
    if (rc < 0 || (rc = fps_rsend_create(srv, &own, &r->send)) < 0) {
      fps_replica_destroy(r);
      return rc;
    }
  }
  *out = r;
  fps_replica_publish(r);
  return 0;
}

void fps_replica_publish(fps_replica_t *r) {
  fps_role_view_t v;
  fps_role_get(&r->role, &v);
  fps_metrics_replica_set(v.role, v.term, v.role == FPS_REPLICA_PRIMARY ? v.joined : v.joined && v.streaming,
                          v.failovers);
}

bool fps_replica_may_ack(fps_replica_t *r) {
  if (!r->lease) return true;
  fps_role_view_t v;
  fps_role_get(&r->role, &v);
  return v.role == FPS_REPLICA_PRIMARY && fps_lease_valid(r->lease);
}

int fps_replica_refusal(fps_replica_t *r, char *why, size_t wl) {
  if (!r || !r->lease) return 0;
  int rc = fps_role_refusal(&r->role, r->srv->cfg.shard_id, why, wl);
  if (rc == 0 && !fps_replica_may_ack(r)) {
    /* A primary whose lease lapsed between two checks of its thread. */
    snprintf(why, wl, "shard %u is stepping down (its lease is no longer valid); primary unknown",
             r->srv->cfg.shard_id);
    rc = FPS_EUNAVAILABLE;
  }
  return rc;
}

bool fps_replica_ready(void *arg) {
  fps_replica_t *r = arg;
  if (!fps_metrics_ready_get()) return false;
  fps_role_view_t v;
  fps_role_get(&r->role, &v);
  if (v.role == FPS_REPLICA_SOLO) return true;
  if (v.role == FPS_REPLICA_PRIMARY) return fps_lease_valid(r->lease);
  return v.joined && v.streaming;
}

int fps_replica_term_granted(fps_replica_t *r, uint64_t term, char *why, size_t wl) {
  if (!r || !r->lease) return 0; /* solo: fps_role_hello refuses */
  /* A term this process has seen came from the lease already (its own
   * acquisition, or a hello checked here): a primary reconnecting is
   * never held up by a lease service that is slow to answer. */
  fps_role_view_t v;
  fps_role_get(&r->role, &v);
  if (term <= v.term) return 0;
  uint64_t newest = 0;
  int rc = fps_lease_newest_term(r->lease, &newest);
  if (rc < 0) {
    snprintf(why, wl, "cannot read the lease (%s) to check term %" PRIu64 ": %s", r->srv->cfg.lease, term,
             fps_strerror(rc));
    return FPS_EUNAVAILABLE;
  }
  if (term > newest) {
    snprintf(why, wl, "term %" PRIu64 " was never granted: the lease's newest term is %" PRIu64, term, newest);
    return FPS_ESTATE;
  }
  return 0;
}

/* A hello of a standby-to-be arrived (rpc_replicate.c calls this through
 * fps_replica_hello_seen): a blocked acquire gives up. */
void fps_replica_kick(fps_replica_t *r) {
  if (r && !fps_role_may_compete(&r->role)) atomic_store(&r->abort_acquire, true);
}

static void fps__replica_sleep_ms(int ms) { nanosleep(&(struct timespec){0, (long)ms * 1000000L}, NULL); }

/* The primary stops acknowledging, fails its waiting calls, lets go. */
static void fps__replica_step_down(fps_replica_t *r, const char *why) {
  fps_role_view_t v;
  fps_role_get(&r->role, &v);
  FPS_LOG(FPS_LOG_WARN, "replica: shard %u steps down from primary (term %" PRIu64 "): %s", r->srv->cfg.shard_id,
          v.term, why);
  fps_rsend_stop_stream(r->send, why);
  /* Before the release: an etcd lease's revoke can take its whole call
   * deadline (2 s) when etcd is the reason the lease was lost, and the
   * role and /readyz must say "standby" from the moment it is one. */
  fps_replica_publish(r);
  fps_lease_release(r->lease);
}

static void *fps__replica_main(void *arg) {
  fps_replica_t *r = arg;
  while (!atomic_load(&r->stop)) {
    fps_role_view_t v;
    fps_role_get(&r->role, &v);
    if (v.role == FPS_REPLICA_PRIMARY) {
      /* Fenced by a higher term (the sender saw it): the role machine
       * already stepped down; here the lease goes. */
      if (!fps_lease_valid(r->lease)) {
        if (fps_role_lease_lost(&r->role)) fps__replica_step_down(r, "the lease is no longer valid");
      }
      fps__replica_sleep_ms(10);
      continue;
    }
    if (v.role == FPS_REPLICA_STANDBY && fps_lease_valid(r->lease)) {
      /* Stepped down by a fence while holding the lease. */
      fps__replica_step_down(r, "a higher term was seen");
      continue;
    }
    if (!fps_role_may_compete(&r->role)) {
      fps__replica_sleep_ms(10);
      continue;
    }
    atomic_store(&r->abort_acquire, false);
    if (!fps_role_may_compete(&r->role)) continue; /* a hello came in between */
    uint64_t term = 0;
    int rc = fps_lease_acquire(r->lease, &r->abort_acquire, &term);
    if (rc == FPS_ECANCELLED) {
      if (atomic_load(&r->stop)) break;
      continue;
    }
    if (rc < 0) {
      FPS_LOG(FPS_LOG_ERROR, "replica: cannot take the lease %s: %s; retrying", r->srv->cfg.lease, fps_strerror(rc));
      for (int i = 0; i < 50 && !atomic_load(&r->stop); i++) fps__replica_sleep_ms(10);
      continue;
    }
    /* What the previous holder left on record: "alone" means it may have
     * answered pushes this process never got (it dropped its standby,
     * then died or lost the lease). This process is promoted anyway (a
     * shard that stays down helps nobody) and says so: a log line and
     * factorps_replica_unclean_promotions_total (docs/shards.md). Then
     * "alone" goes on record for this term before anything is answered. */
    int rec = fps_lease_get_sync(r->lease);
    bool recorded = fps_replica_set_sync(r, false) == 0;
    /* Not between two installs of a batch being committed. */
    pthread_mutex_lock(&r->commit_mu);
    fps_role_view_t before;
    fps_role_get(&r->role, &before);
    bool promoted = recorded && fps_role_may_compete(&r->role) && fps_role_promote(&r->role, term) == 0;
    pthread_mutex_unlock(&r->commit_mu);
    if (promoted && rec == 0) {
      fps_metrics_replica_unclean_promotion();
      FPS_LOG(FPS_LOG_WARN, "replica: shard %u promoted (term %" PRIu64 ") although its lease says the previous "
              "primary answered pushes alone after dropping this standby: those pushes are not here, this "
              "state is older than what it acknowledged", r->srv->cfg.shard_id, term);
    }
    if (!promoted) {
      /* A primary's hello arrived while the lease was being taken: what
       * this process holds may lack what that primary acknowledged. */
      fps_lease_release(r->lease);
      FPS_LOG(FPS_LOG_WARN, "replica: took the lease (term %" PRIu64 ") but may not be primary now; released",
              term);
      continue;
    }
    FPS_LOG(FPS_LOG_INFO, "replica: shard %u is primary (term %" PRIu64 "); standby: %s", r->srv->cfg.shard_id, term,
            r->srv->cfg.replica_peer);
    fps_replica_publish(r);
    fps_rsend_start_stream(r->send, term);
    /* A cold start (no primary ever sent this process its state): its
     * split blocks are its checkpoint's, and compare versions with their
     * peers as a solo shard's do at start (main.c, xrecover.c). */
    if (!before.contacted) fps_shard_recover_start(r->srv->shard);
  }
  return NULL;
}

int fps_replica_start(fps_replica_t *r) {
  if (!r->lease) return 0;
  if (pthread_create(&r->th, NULL, fps__replica_main, r) != 0) return FPS_ENOMEM;
  r->th_on = true;
  return 0;
}

void fps_replica_stop(fps_replica_t *r) {
  if (!r) return;
  atomic_store(&r->stop, true);
  atomic_store(&r->abort_acquire, true);
  if (r->th_on) pthread_join(r->th, NULL);
  r->th_on = false;
  if (r->send) fps_rsend_stop_stream(r->send, "the shard is shutting down");
  if (r->lease) fps_lease_release(r->lease);
}

void fps_replica_destroy(fps_replica_t *r) {
  if (!r) return;
  fps_replica_stop(r);
  fps_rsend_destroy(r->send);
  fps_lease_close(r->lease);
  fps_role_destroy(&r->role);
  pthread_mutex_destroy(&r->commit_mu);
  fps_free(r);
}

int fps_replica_ack_wait(fps_replica_t *r, fps_tensor_t *const *t, const uint64_t *ver, const bool *changed, size_t n,
                         const fps_rkey_t *key,
                         void (*done)(void *arg, int err, const char *why), void *arg, char *why, size_t wl) {
  if (!r || !r->lease) return 0;
  int rc = fps_replica_refusal(r, why, wl);
  if (rc < 0) return rc;
  return fps_rsend_wait(r->send, t, ver, changed, n, key, done, arg);
}

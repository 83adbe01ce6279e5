/* The role machine of a replicated shard (replica.h): which of the two
 * processes may acknowledge, decided by terms that only grow. No gRPC, no
 * I/O: the callers (replica.c, rpc_replicate.c, replica_send.c) feed it
 * what they saw and act on what it says. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "error.h"
#include "replica.h"

const char *fps_replica_role_name(int role) {
  return role == FPS_REPLICA_PRIMARY ? "primary" : role == FPS_REPLICA_STANDBY ? "standby" : "solo";
}

void fps_role_init(fps_role_t *r, bool replicated) {
  memset(r, 0, sizeof *r);
  pthread_mutex_init(&r->mu, NULL);
  r->role = replicated ? FPS_REPLICA_STANDBY : FPS_REPLICA_SOLO;
}

void fps_role_destroy(fps_role_t *r) { pthread_mutex_destroy(&r->mu); }

void fps_role_get(fps_role_t *r, fps_role_view_t *out) {
  pthread_mutex_lock(&r->mu);
  out->role = r->role;
  out->term = r->term;
  out->joined = r->joined;
  out->streaming = r->streaming;
  out->contacted = r->contacted;
  memcpy(out->primary, r->primary, sizeof out->primary);
  out->stream = r->stream;
  out->failovers = r->failovers;
  pthread_mutex_unlock(&r->mu);
}

int fps_role_promote(fps_role_t *r, uint64_t term) {
  int rc = FPS_ESTATE;
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_STANDBY && term > r->term) {
    r->role = FPS_REPLICA_PRIMARY;
    r->term = term;
    r->joined = false; /* no standby has joined this term yet */
    r->streaming = false;
    r->primary[0] = 0;
    r->stream++; /* no stream of the standby it was is current */
    r->failovers++;
    rc = 0;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Primary -> standby, waiting for the next primary's state. REQUIRES mu. */
static void fps__role_step_down_locked(fps_role_t *r) {
  r->role = FPS_REPLICA_STANDBY;
  r->joined = false;
  r->streaming = false;
  r->contacted = true; /* it must take a state transfer before competing */
  r->primary[0] = 0;
  r->stream++;
}

bool fps_role_fence(fps_role_t *r, uint64_t term) {
  bool down = false;
  pthread_mutex_lock(&r->mu);
  if (r->role != FPS_REPLICA_SOLO && term > r->term) {
    if (r->role == FPS_REPLICA_PRIMARY) {
      fps__role_step_down_locked(r);
      down = true;
    } else {
      /* A standby that hears of a newer term than its stream's: what it
       * holds may be older than what that term acknowledged. */
      r->joined = false;
      r->contacted = true;
      r->stream++; /* the stream of the older term can no longer make it joined */
    }
    r->term = term;
  }
  pthread_mutex_unlock(&r->mu);
  return down;
}

bool fps_role_lease_lost(fps_role_t *r) {
  bool down = false;
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_PRIMARY) {
    fps__role_step_down_locked(r);
    down = true;
  }
  pthread_mutex_unlock(&r->mu);
  return down;
}

int fps_role_hello(fps_role_t *r, uint64_t term, const char *primary, uint64_t *stream, char *why, size_t wl) {
  int rc = 0;
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_SOLO) {
    snprintf(why, wl, "this shard runs solo (no --replica-peer): it takes no Replicate stream");
    rc = FPS_ESTATE;
  } else if (term < r->term) {
    snprintf(why, wl, "term %" PRIu64 " is older than %" PRIu64, term, r->term);
    rc = FPS_ESTATE;
  } else if (term == r->term && r->role == FPS_REPLICA_PRIMARY) {
    /* Two holders of one term cannot be: refuse rather than guess. */
    snprintf(why, wl, "term %" PRIu64 " is this primary's own term", term);
    rc = FPS_ESTATE;
  } else {
    if (r->role == FPS_REPLICA_PRIMARY) fps__role_step_down_locked(r);
    if (term > r->term) r->joined = false; /* a new primary: its transfer first */
    r->term = term;
    r->streaming = true;
    r->contacted = true;
    r->joined = false; /* this stream's transfer decides */
    snprintf(r->primary, sizeof r->primary, "%s", primary && *primary ? primary : "");
    *stream = ++r->stream;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

void fps_role_standby_joined(fps_role_t *r, uint64_t stream) {
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_STANDBY && r->stream == stream && r->streaming) r->joined = true;
  pthread_mutex_unlock(&r->mu);
}

void fps_role_stream_ended(fps_role_t *r, uint64_t stream) {
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_STANDBY && r->stream == stream) r->streaming = false;
  pthread_mutex_unlock(&r->mu);
}

void fps_role_primary_joined(fps_role_t *r, uint64_t term, bool joined) {
  pthread_mutex_lock(&r->mu);
  if (r->role == FPS_REPLICA_PRIMARY && r->term == term) r->joined = joined;
  pthread_mutex_unlock(&r->mu);
}

bool fps_role_may_compete(fps_role_t *r) {
  pthread_mutex_lock(&r->mu);
  bool ok = r->role == FPS_REPLICA_STANDBY && (r->joined || !r->contacted);
  pthread_mutex_unlock(&r->mu);
  return ok;
}

int fps_role_refusal(fps_role_t *r, uint32_t shard_id, char *why, size_t wl) {
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  if (r->role == FPS_REPLICA_STANDBY) {
    if (r->primary[0])
      snprintf(why, wl, "shard %u is a standby (term %" PRIu64 "); primary: %s", shard_id, r->term, r->primary);
    else
      snprintf(why, wl, "shard %u is a standby (term %" PRIu64 "); primary unknown", shard_id, r->term);
    rc = FPS_EUNAVAILABLE;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

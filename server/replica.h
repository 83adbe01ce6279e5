/* Standby replicas (docs/shards.md "Standby replicas"; the clients' side of
 * the contract is client/include/factorps/client.h, "Standby replicas").
 *
 * Two processes serve one shard id, each naming the other with
 * --replica-peer. The holder of the lease (lease.h) is the primary: the
 * only one that acknowledges worker calls. It streams every change it
 * makes to the other, the standby (Replicate: rpc_replicate.c receives,
 * replica_send.c sends), and answers a worker only after the standby
 * acknowledged what the answer depends on. Without --replica-peer the
 * process is solo and everything here stays out of the way.
 *
 * Files:
 *   replica_role.c  the role machine: solo / primary / standby, the term,
 *                   who may acknowledge, who may compete for the lease
 *                   (no gRPC; unit-tested alone)
 *   replica.c       the process's replica: the lease thread (acquire,
 *                   promote, watch validity), the gate on worker calls,
 *                   what Stats and /readyz show
 *   replica_send.c  the primary's side of Replicate: the stream, the
 *                   state transfer, the waits of calls for the ack
 *   rpc_replicate.c the standby's side: checks, installs, acks */
#ifndef FPS_REPLICA_H
#define FPS_REPLICA_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shard/shard.h"

enum { FPS_REPLICA_SOLO = 0, FPS_REPLICA_PRIMARY, FPS_REPLICA_STANDBY };

/* "solo", "primary", "standby". */
const char *fps_replica_role_name(int role);

/* ------------------------------------------------ replica_role.c */

/* The role machine. Terms only grow; the highest term seen decides:
 *
 *   solo      never changes (no --replica-peer).
 *   standby   -> primary: the lease was acquired with a term above every
 *             term seen (fps_role_promote).
 *   primary   -> standby: a higher term was seen (fps_role_fence: a
 *             standby's refusal, another primary's hello) or the lease
 *             was lost; it acknowledges nothing from that moment on.
 *
 * A standby competes for the lease only if it can take over without
 * losing anything acknowledged: once it has joined a primary's stream
 * (state transfer complete), or if no primary has ever streamed to it
 * since it started (a cold start: the first replica up wins). Thread-safe
 * (one mutex, never held while calling out). */
typedef struct fps_role_s {
  pthread_mutex_t mu;
  int role;                   /* FPS_REPLICA_* */
  uint64_t term;              /* primary: its lease's term; standby: the highest seen */
  bool joined;                /* standby: has a whole state from the primary of
                               * `term` (transfer done); primary: a standby
                               * acknowledged its transfer in this term */
  bool streaming;             /* standby: a primary's stream is open now */
  bool contacted;             /* standby: some primary streamed to it since start */
  char primary[256];          /* standby: the primary's address, "" unknown */
  uint64_t stream;            /* standby: the id of the newest accepted hello's stream */
  uint64_t failovers;         /* promotions of this process */
} fps_role_t;

/* A snapshot of the machine (for Stats, /readyz, messages). */
typedef struct fps_role_view_s {
  int role;
  uint64_t term;
  bool joined, streaming, contacted;
  char primary[256];
  uint64_t stream;
  uint64_t failovers;
} fps_role_view_t;

/* replicated false: solo for life; true: starts as a standby. */
void fps_role_init(fps_role_t *r, bool replicated);
void fps_role_destroy(fps_role_t *r);
void fps_role_get(fps_role_t *r, fps_role_view_t *out);
/* The lease was acquired with `term`: standby -> primary. 0, or
 * FPS_ESTATE (not a standby, or term not above the highest seen: the
 * caller must release the lease). */
int fps_role_promote(fps_role_t *r, uint64_t term);
/* `term` was seen from outside (a refusal, a Stats answer). A primary of
 * a lower term steps down to standby (not joined, contacted). Returns
 * true if it stepped down. */
bool fps_role_fence(fps_role_t *r, uint64_t term);
/* The lease is no longer valid: a primary steps down. True if it did. */
bool fps_role_lease_lost(fps_role_t *r);
/* A Replicate stream opens with `term` from `primary`: 0 and *stream, the
 * stream's id (this process is now that primary's standby, streaming, not
 * joined until this stream's transfer completes; a primary of a lower
 * term stepped down first; an older stream, of this term too, is no longer
 * the current one), FPS_ESTATE with why ("term T is older than U": a
 * lower term; an equal term on a primary; solo). */
int fps_role_hello(fps_role_t *r, uint64_t term, const char *primary, uint64_t *stream, char *why,
                   size_t why_len);
/* The stream `stream` completed its transfer (joined) or ended (streaming
 * false; joined stays: what it holds is still the newest state any
 * acknowledgement depended on, unless a later hello comes). A stream that
 * is no longer the current one changes nothing: a primary reconnecting
 * in the same term must not have its new stream marked ended by the old
 * one's end. */
void fps_role_standby_joined(fps_role_t *r, uint64_t stream);
void fps_role_stream_ended(fps_role_t *r, uint64_t stream);
/* The primary of `term` has a joined standby (or lost it). */
void fps_role_primary_joined(fps_role_t *r, uint64_t term, bool joined);
/* Whether a standby may try to take the lease now. */
bool fps_role_may_compete(fps_role_t *r);
/* Whether worker calls are served: 0, or FPS_EUNAVAILABLE with the
 * contract's message: "shard N is a standby (term T); primary: HOST:PORT"
 * (or "primary unknown"). */
int fps_role_refusal(fps_role_t *r, uint32_t shard_id, char *why, size_t why_len);

/* --------------------------------------------------- replica.c */

struct fps_server_s;
typedef struct fps_replica_s fps_replica_t;

/* The process's replica from srv->cfg (solo without --replica-peer):
 * opens the lease (not acquired yet). 0 or FPS_E* with the reason on
 * stderr. Free with fps_replica_destroy. */
int fps_replica_create(struct fps_server_s *srv, fps_replica_t **out);
/* Starts the lease thread (no-op when solo). */
int fps_replica_start(fps_replica_t *r);
/* Stops the lease thread and the sender, releases the lease. */
void fps_replica_stop(fps_replica_t *r);
void fps_replica_destroy(fps_replica_t *r);
fps_role_t *fps_replica_role(fps_replica_t *r);
/* True if this process may acknowledge worker calls now: solo, or primary
 * with a valid lease. */
bool fps_replica_may_ack(fps_replica_t *r);
/* The gate of worker calls (grpc_server.c admission): 0, or
 * FPS_EUNAVAILABLE with the message. */
int fps_replica_refusal(fps_replica_t *r, char *why, size_t why_len);
/* /readyz: a solo or primary process that is serving, or a joined standby
 * with its stream open. */
bool fps_replica_ready(void *r);
/* Publishes the role, term and joined flag to the metrics registry. */
void fps_replica_publish(fps_replica_t *r);
/* A standby's commit of a batch (rpc_replicate.c) and the lease thread's
 * promotion exclude each other: a promoted standby never holds half a
 * batch. */
void fps_replica_commit_lock(fps_replica_t *r);
void fps_replica_commit_unlock(fps_replica_t *r);
/* The primary's standby-sync record in its lease (lease.h): 0 (written,
 * or the backend keeps none), FPS_EIO. */
int fps_replica_set_sync(fps_replica_t *r, bool in_sync);
/* A hello's term against the lease (lease.h fps_lease_newest_term): 0
 * (granted: a term not above the highest this process has seen, or the
 * lease's newest is at least it; or solo), FPS_ESTATE with why ("term T
 * was never granted: the lease's newest term is U"), FPS_EUNAVAILABLE
 * (the lease could not be read). A term above the highest seen blocks up
 * to the lease service's call deadline. */
int fps_replica_term_granted(fps_replica_t *r, uint64_t term, char *why, size_t why_len);
/* A hello arrived: a standby blocked in the lease's acquire gives up. */
void fps_replica_kick(fps_replica_t *r);

/* The gate of every acknowledgement (Create, PushPull): changes to
 * t[0..n) (and a push's key) are about to be acknowledged. 0: answer now
 * (solo; no joined standby); FPS_EAGAIN: done(arg, err, why) runs once the
 * standby has them (err 0) or the primary stepped down (FPS_EUNAVAILABLE);
 * FPS_EUNAVAILABLE with why: this process may not acknowledge (standby,
 * lease lost); FPS_ENOMEM. r NULL: 0. ver, changed: as fps_rsend_wait's. */
struct fps_rkey_s;
int fps_replica_ack_wait(fps_replica_t *r, fps_tensor_t *const *t, const uint64_t *ver, const bool *changed, size_t n,
                         const struct fps_rkey_s *key,
                         void (*done)(void *arg, int err, const char *why), void *arg, char *why, size_t why_len);

#endif

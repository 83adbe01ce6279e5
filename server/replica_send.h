/* The primary's side of Replicate (replica.h): one stream to the standby,
 * the state transfer, the changes, and the calls waiting for the ack. */
#ifndef FPS_REPLICA_SEND_H
#define FPS_REPLICA_SEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "replica.h"
#include "shard/shard.h"

struct fps_server_s;
typedef struct fps_rsend_s fps_rsend_t;

/* What the sender needs of the replica that owns it (replica.c), handed
 * over at create so that this file never calls up into replica.c. */
typedef struct fps_rsend_owner_s {
  void *arg;                                     /* the replica */
  fps_role_t *role;                              /* its role machine */
  void (*publish)(void *arg);                    /* role, term, joined to the metrics */
  int (*set_sync)(void *arg, bool in_sync);      /* the lease's standby-sync record */
  int (*refusal)(void *arg, char *why, size_t why_len); /* the gate of worker calls */
} fps_rsend_owner_t;

/* The sender and its two threads (idle until a stream is wanted); owner is
 * copied. 0, FPS_ENOMEM, or the peer files' errors (printed). */
int fps_rsend_create(struct fps_server_s *srv, const fps_rsend_owner_t *owner, fps_rsend_t **out);
/* Stops the threads, frees everything. NULL is a no-op. */
void fps_rsend_destroy(fps_rsend_t *s);
/* This process became primary of `term`: stream to the peer (reconnecting
 * while it stays primary). */
void fps_rsend_start_stream(fps_rsend_t *s, uint64_t term);
/* No more stream (stepping down, shutting down): the stream is cancelled
 * and every waiting call fails with FPS_EUNAVAILABLE and why. */
void fps_rsend_stop_stream(fps_rsend_t *s, const char *why);

/* A push's idempotency key and the versions it made. */
typedef struct fps_rkey_s {
  uint32_t worker;
  uint64_t id, tensors;
  const uint64_t *v;
  uint32_t n;
} fps_rkey_t;

/* Called once when a waiting call may answer (err 0) or must fail (err
 * FPS_EUNAVAILABLE, why), on the sender's threads, with no lock held. */
typedef void (*fps_rsend_done_fn)(void *arg, int err, const char *why);

/* ver[k] for a tensor whose answer reports no version an image could
 * cover (a tensor still initialising). */
#define FPS_RSEND_UNNAMED UINT64_MAX

/* A call is about to acknowledge changes to tensors t[0..n) (applied
 * before this call) and, with key, a push's key: marks them for the
 * stream. Returns 0 (answer now: no standby has joined, the changes still
 * going to a standby being brought up; or nothing was marked and the
 * standby already acknowledged what covers the answer), or FPS_EAGAIN
 * (done runs once the joined standby acknowledged them, or when the
 * stream ends: err 0 if the primary goes on alone, FPS_EUNAVAILABLE if it
 * stepped down), or FPS_ENOMEM. ver (may be NULL: every tensor is marked,
 * naming no version): the version of each tensor the answer reports; a
 * tensor whose last mark named that same version is not marked again (the
 * W members of a sync round answer one after another, and the image the
 * first one's mark brings covers the others; a Create that finds a ready
 * tensor unchanged is covered by the mark that made it ready or stepped
 * it). changed (may be NULL: none): changed[k] marks t[k] whatever the
 * last mark named (a Create that wrote it), its mark naming ver[k].
 * Thread-safe; never blocks. */
int fps_rsend_wait(fps_rsend_t *s, fps_tensor_t *const *t, const uint64_t *ver, const bool *changed, size_t n,
                   const fps_rkey_t *key, fps_rsend_done_fn done, void *arg);

#endif

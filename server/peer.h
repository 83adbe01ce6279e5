/* The calling side of shard-to-shard Exchange: the sender the
 * shard core uses to carry a split tensor's partial sums to the other
 * shards holding its blocks (shard/shard.h, fps_xsend_fn).
 *
 * One gRPC channel per peer (--peers), secured like a worker's
 * (--peer-tls-ca, a client certificate with --peer-tls-cert/--peer-tls-key,
 * --peer-tls-server-name) and with the bearer token of --peer-token-file;
 * its own completion queue and thread. Every send is one unary Exchange
 * call with the core's deadline; UNAVAILABLE (peer down, restarting,
 * connection refused or lost) is retried with backoff until that deadline,
 * which is safe because a receiver answers OK to an identical retry. */
#ifndef FPS_SERVER_PEER_H
#define FPS_SERVER_PEER_H

#include <stdint.h>

#include "server.h"
#include "shard/shard.h"

typedef struct fps_peers_s fps_peers_t;

/* Reads and checks the peer TLS files and token (errors printed to stderr
 * naming the flag and the file), makes a channel to every other shard of
 * --peers and starts the thread. Needs grpc_init(). Returns 0 and *out,
 * FPS_EINVAL / FPS_EIO (bad files) or FPS_ENOMEM. */
int fps_peers_create(const fps_config_t *cfg, fps_peers_t **out);

/* fps_xsend_fn (ctx: the fps_peers_t). Thread-safe. Refuses at once
 * (done not called) with FPS_EINVAL for a shard that is not another shard
 * of --peers, FPS_EUNAVAILABLE once stopping, FPS_ENOMEM; otherwise done
 * runs exactly once, on the peers' thread (or the stopping thread), with
 * err 0 or: FPS_EUNAVAILABLE (no answer but UNAVAILABLE until the
 * deadline, or shutting down), FPS_ETIMEOUT (the peer did not answer in
 * time), or the peer's refusal as FPS_E* (UNAUTHENTICATED and
 * PERMISSION_DENIED: FPS_ESTATE); the message names the peer's index,
 * address and the cause. */
int fps_peers_send(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns,
                   fps_xsend_done_fn done, void *arg);

/* This shard is stopping (SIGTERM, before its exchanges drain): a peer
 * found unreachable (UNAVAILABLE) is not tried again, so the send fails at
 * once instead of at its deadline. A peer gone that early cannot apply a
 * step whose partials never reached it, and waiting for one to come back
 * would only hold the stop (the blocks agree on a version after the
 * restart). Sends that reach their peer go on as before. */
void fps_peers_stopping(fps_peers_t *p);

/* Stops sending: later sends are refused, sends waiting for a retry and
 * calls in flight fail with FPS_EUNAVAILABLE ("shutting down"); waits at
 * most wait_s for gRPC to finish the cancelled calls, then stops the
 * thread. Idempotent. */
void fps_peers_stop(fps_peers_t *p, double wait_s);
/* Stops (if not yet) and frees everything (gRPC objects before
 * grpc_shutdown). NULL is a no-op. */
void fps_peers_destroy(fps_peers_t *p);

/* A channel to `addr` with the peer credentials (--peer-tls-ca,
 * --peer-tls-cert/--peer-tls-key, --peer-tls-server-name) and the
 * "Bearer <token>" of --peer-token-file in *auth_header (NULL: none;
 * free with fps_free): the standby replica's stream (replica_send.c).
 * 0, or FPS_EINVAL / FPS_EIO (bad files, printed), FPS_ENOMEM. */
int fps_peer_channel(const fps_config_t *cfg, const char *addr, grpc_channel **out, char **auth_header);

#endif

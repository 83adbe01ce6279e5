/* A fake shard replica for the client's failover tests: a real gRPC server
 * on 127.0.0.1:0, in a thread of the test process, that answers every call
 * of every method with one fixed status (by default what a standby answers
 * worker calls: UNAVAILABLE "shard 0 is a standby ..."), and counts the
 * calls it refused. It reads no request: a client learns nothing from it
 * but the status. */
#ifndef FPS_TESTS_FAKE_REPLICA_H
#define FPS_TESTS_FAKE_REPLICA_H

typedef struct fps_fake_replica_s fps_fake_replica_t;

/* Starts one answering every call with `code` (a gRPC status code) and
 * `message`. Returns NULL if gRPC cannot listen. */
fps_fake_replica_t *fps_fake_replica_start(int code, const char *message);
/* "127.0.0.1:port". Valid until stop. */
const char *fps_fake_replica_addr(const fps_fake_replica_t *f);
/* Calls answered so far. */
int fps_fake_replica_calls(const fps_fake_replica_t *f);
/* Stops it (ends calls in flight) and frees it. NULL is a no-op. */
void fps_fake_replica_stop(fps_fake_replica_t *f);

#endif

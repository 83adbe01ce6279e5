/* The etcd lease (lease.h "etcd:HOST:PORT/KEY"), through etcd's own v3
 * gRPC API (proto/etcd/: the subset of etcd's rpc.proto this file calls).
 *
 * Taking the lease: when KEY is absent (KV.Range), LeaseGrant(TTL), then
 * one KV.Txn "if KEY's create_revision == 0 (it does not exist), put KEY =
 * holder under the lease". Only one Txn can create the key; it lives until
 * its lease is revoked or expires, so etcd, not the replicas, decides who
 * holds it. The term is the key's create revision (the Txn's revision):
 * etcd's revisions only grow, so every new holder's term is higher.
 *
 * Keeping it: a thread renews (LeaseKeepAlive) every TTL/3. Safety does
 * not rest on that thread: fps_lease_valid() compares this process's
 * monotonic clock with `valid_until` = the time the last successful grant
 * or renewal was SENT + the TTL etcd granted - a margin. etcd started the
 * TTL no earlier than it received that request, so the key outlives
 * valid_until by at least the margin (which covers clock-rate drift and
 * the gap between a check and the acknowledgement it allows). A renewal
 * that fails leaves valid_until where it is: the holder stops being valid
 * before etcd can expire the key and hand it to the other replica, even
 * while etcd is unreachable (partitioned, stopped, dead). Once the time
 * has passed the lease is lost for good: the thread stops renewing (a
 * late renewal would only keep the key from the other replica) and
 * revokes it; the replica must acquire again, with a new lease and a new
 * term.
 *
 * The standby-sync record (lease.h) is the key KEY/sync, outside any lease
 * (it must outlive its writer): "<term> alone" or "<term> in-sync". The
 * Txn that takes KEY reads it in the same revision, so a new holder sees
 * exactly what its predecessor left (absent: in sync, nobody answered
 * alone yet). A holder writes it with a Txn "if KEY's create_revision is
 * my term": a holder that lost the key (expired, revoked) can no longer
 * overwrite its successor's record, and a write that succeeded happened
 * while it held the lease.
 *
 * Failover after the holder dies takes up to the TTL (etcd expires the
 * key; it looks for expired leases every 500 ms) plus one poll (100 ms);
 * after a release (LeaseRevoke) one poll.
 *
 * HOST may name several members (a DNS name resolving to all of them, or
 * gRPC's "ipv4:10.0.0.1:2379,10.0.0.2:2379,..." list): calls go to them in
 * turn, so one member lost does not cost the lease.
 *
 * Plaintext and without etcd authentication: run etcd on a private network
 * (deploy/README.md). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "alloc.h"
#include "error.h"
#include "etcd/etcdserverpb/rpc.pb-c.h"
#include "lease.h"
#include "log.h"

#define FPS_ETCD_NS INT64_C(1000000000)
#define FPS_ETCD_MS INT64_C(1000000)
/* How often a waiting replica asks whether the key is free. */
#define FPS_ETCD_POLL_NS (100 * FPS_ETCD_MS)
/* How often *stop is checked while waiting (lease.h promises 10 ms). */
#define FPS_ETCD_STOP_NS (10 * FPS_ETCD_MS)
/* Deadline of a call that is not a renewal (Range, Grant, Txn, Revoke). */
#define FPS_ETCD_CALL_NS (2 * FPS_ETCD_NS)
/* A renewal that failed is retried this soon (while still valid). */
#define FPS_ETCD_RETRY_NS (100 * FPS_ETCD_MS)
/* The margin: a tenth of the TTL, at least this. */
#define FPS_ETCD_MARGIN_MIN_NS (200 * FPS_ETCD_MS)
/* A channel failing this long is replaced (peer.c: gRPC 1.51 can keep a
 * failed channel in TRANSIENT_FAILURE for seconds after etcd is back). */
#define FPS_ETCD_RENEW_CH_NS (250 * FPS_ETCD_MS)

typedef struct fps_lease_etcd_s {
  fps_lease_t base;
  char *target; /* "HOST:PORT", for gRPC and messages */
  char *key;    /* the key; its value names the holder */
  size_t key_len;
  char *sync_key; /* KEY/sync: the standby-sync record */
  size_t sync_key_len;
  char *holder;  /* this process, as stored in the key */
  int64_t ttl_s; /* asked of etcd (whole seconds, >= 1) */
  grpc_channel_credentials *creds;
  grpc_arg argv[4];
  grpc_channel_args args;
  pthread_mutex_t mu; /* ch, failing_since, the fields below it */
  pthread_cond_t cv;  /* wakes the renewer (CLOCK_MONOTONIC) */
  grpc_channel *ch;
  int64_t failing_since; /* ns, 0: the channel is not failing */
  int64_t id;            /* the lease held, 0: none */
  int64_t stale_id;      /* a lease lost or not revoked yet, 0: none */
  int64_t ttl_ns;        /* the TTL etcd granted to `id` */
  int64_t margin_ns;
  pthread_t renewer;
  bool renewer_on;
  bool renewer_stop;
  atomic_bool held;            /* acquired and not lost or released */
  _Atomic int64_t valid_until; /* monotonic ns (CLOCK_MONOTONIC) */
  _Atomic int64_t term;        /* of the lease held (KEY's create revision) */
  atomic_int sync;             /* the record found at acquire: 1 in sync, 0 alone */
  int last_acquire_err;        /* for logging a change of state once */
} fps_lease_etcd_t;

static int64_t fps__etcd_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * FPS_ETCD_NS + ts.tv_nsec;
}

static gpr_timespec fps__etcd_gpr(int64_t deadline_ns) {
  int64_t left = deadline_ns - fps__etcd_now();
  if (left < 0) left = 0;
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_nanos(left, GPR_TIMESPAN));
}

static bool fps__etcd_stopping(const atomic_bool *stop) { return stop && atomic_load(stop); }

/* protobuf-c's allocator on the house heap. */
static void *fps__etcd_alloc(void *data, size_t size) {
  (void)data;
  return fps_malloc(size);
}
static void fps__etcd_free(void *data, void *p) {
  (void)data;
  fps_free(p);
}
static ProtobufCAllocator fps__etcd_allocator = {fps__etcd_alloc, fps__etcd_free, NULL};

/* ------------------------------------------------------------ calls */

/* Why a call failed, for the caller's message. */
typedef struct fps_etcd_err_s {
  grpc_status_code code;
  char detail[256];
} fps_etcd_err_t;

/* Replaces the channel when it has been failing for a while. REQUIRES mu. */
static void fps__etcd_renew_channel_locked(fps_lease_etcd_t *l) {
  if (grpc_channel_check_connectivity_state(l->ch, 0) != GRPC_CHANNEL_TRANSIENT_FAILURE) {
    l->failing_since = 0;
    return;
  }
  int64_t now = fps__etcd_now();
  if (!l->failing_since) {
    l->failing_since = now;
    return;
  }
  if (now - l->failing_since < FPS_ETCD_RENEW_CH_NS) return;
  grpc_channel *fresh = grpc_channel_create(l->target, l->creds, &l->args);
  if (!fresh) return;
  grpc_channel_destroy(l->ch); /* calls on it keep their own references */
  l->ch = fresh;
  l->failing_since = 0;
}

/* One call of etcd's: sends `req`, waits for one answer until deadline_ns
 * (or *stop, checked every 10 ms: the call is then cancelled), unpacks it
 * as `rd` into *resp (free with protobuf_c_message_free_unpacked and
 * fps__etcd_allocator). All six ops go in one batch, which serves the
 * bidirectional LeaseKeepAlive as well: one request, the half-close, one
 * answer. Returns 0; FPS_EUNAVAILABLE (not reachable, no answer in time,
 * stopped), FPS_EIO (etcd refused: e->code and e->detail), FPS_EPROTO (an
 * answer that does not decode), FPS_ENOMEM. */
static int fps__etcd_call(fps_lease_etcd_t *l, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *rd, int64_t deadline_ns, const atomic_bool *stop,
                          ProtobufCMessage **resp, fps_etcd_err_t *e) {
  *resp = NULL;
  e->code = GRPC_STATUS_OK;
  e->detail[0] = 0;
  size_t n = protobuf_c_message_get_packed_size(req);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *send_bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  if (!send_bb || !cq) {
    if (send_bb) grpc_byte_buffer_destroy(send_bb);
    if (cq) grpc_completion_queue_destroy(cq);
    return FPS_ENOMEM;
  }
  pthread_mutex_lock(&l->mu);
  grpc_call *call = grpc_channel_create_call(l->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             grpc_slice_from_static_string(method), NULL,
                                             fps__etcd_gpr(deadline_ns), NULL);
  pthread_mutex_unlock(&l->mu);
  int rc = FPS_EIO;
  grpc_metadata_array init_md, trail_md;
  grpc_metadata_array_init(&init_md);
  grpc_metadata_array_init(&trail_md);
  grpc_byte_buffer *recv_bb = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  const char *error_string = NULL;
  if (!call) {
    snprintf(e->detail, sizeof e->detail, "cannot start a call to %s", l->target);
    goto done;
  }
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv_bb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  ops[5].data.recv_status_on_client.error_string = &error_string;
  if (grpc_call_start_batch(call, ops, 6, call, NULL) != GRPC_CALL_OK) {
    snprintf(e->detail, sizeof e->detail, "cannot start a call to %s", l->target);
    grpc_call_unref(call);
    goto done;
  }
  /* The call's deadline ends it; *stop cancels it. Either way gRPC then
   * completes the batch, so this wait ends. */
  bool cancelled = false;
  for (;;) {
    grpc_event ev = grpc_completion_queue_pluck(cq, call, fps__etcd_gpr(fps__etcd_now() + FPS_ETCD_STOP_NS), NULL);
    if (ev.type == GRPC_OP_COMPLETE) break;
    if (!cancelled && fps__etcd_stopping(stop)) {
      grpc_call_cancel(call, NULL);
      cancelled = true;
    }
  }
  grpc_call_unref(call);
  e->code = status;
  if (status != GRPC_STATUS_OK) {
    size_t dn = GRPC_SLICE_LENGTH(details);
    if (dn) snprintf(e->detail, sizeof e->detail, "%.*s", (int)dn, (const char *)GRPC_SLICE_START_PTR(details));
    else snprintf(e->detail, sizeof e->detail, "%s", error_string ? error_string : "no detail");
    if (status == GRPC_STATUS_UNAVAILABLE || status == GRPC_STATUS_DEADLINE_EXCEEDED ||
        status == GRPC_STATUS_CANCELLED) {
      rc = FPS_EUNAVAILABLE;
      pthread_mutex_lock(&l->mu);
      fps__etcd_renew_channel_locked(l);
      pthread_mutex_unlock(&l->mu);
    }
    goto done;
  }
  if (!recv_bb) {
    snprintf(e->detail, sizeof e->detail, "%s answered %s without a message", l->target, method);
    rc = FPS_EPROTO;
    goto done;
  }
  grpc_byte_buffer_reader rdr;
  if (!grpc_byte_buffer_reader_init(&rdr, recv_bb)) {
    rc = FPS_EPROTO;
    goto done;
  }
  grpc_slice flat = grpc_byte_buffer_reader_readall(&rdr);
  grpc_byte_buffer_reader_destroy(&rdr);
  *resp = protobuf_c_message_unpack(rd, &fps__etcd_allocator, GRPC_SLICE_LENGTH(flat), GRPC_SLICE_START_PTR(flat));
  grpc_slice_unref(flat);
  if (!*resp) {
    snprintf(e->detail, sizeof e->detail, "%s answered %s with a message that does not decode", l->target, method);
    rc = FPS_EPROTO;
    goto done;
  }
  rc = 0;
done:
  if (recv_bb) grpc_byte_buffer_destroy(recv_bb);
  grpc_byte_buffer_destroy(send_bb);
  grpc_metadata_array_destroy(&init_md);
  grpc_metadata_array_destroy(&trail_md);
  grpc_slice_unref(details);
  if (error_string) gpr_free((void *)error_string);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL).type != GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return rc;
}

static void fps__etcd_free_msg(ProtobufCMessage *m) {
  if (m) protobuf_c_message_free_unpacked(m, &fps__etcd_allocator);
}

/* LeaseRevoke(id): etcd deletes the keys under it at once. 0 also when
 * etcd no longer knows the lease (it expired: the same outcome). */
static int fps__etcd_revoke(fps_lease_etcd_t *l, int64_t id, int64_t deadline_ns) {
  Etcdserverpb__LeaseRevokeRequest req = ETCDSERVERPB__LEASE_REVOKE_REQUEST__INIT;
  req.id = id;
  ProtobufCMessage *resp;
  fps_etcd_err_t e;
  int rc = fps__etcd_call(l, "/etcdserverpb.Lease/LeaseRevoke", &req.base,
                          &etcdserverpb__lease_revoke_response__descriptor, deadline_ns, NULL, &resp, &e);
  fps__etcd_free_msg(resp);
  if (rc == FPS_EIO && e.code == GRPC_STATUS_NOT_FOUND) return 0;
  if (rc < 0)
    FPS_LOG(FPS_LOG_WARN, "lease etcd:%s/%s: revoking lease %lld: %s (etcd deletes the key when its TTL ends)",
            l->target, l->key, (long long)id, e.detail);
  return rc;
}

/* ---------------------------------------------------------- renewing */

/* The lease is gone (not renewed in time, or etcd says it no longer
 * exists): not valid from now on; revoked, so that a late renewal cannot
 * keep the key from the other replica. Renewer thread. */
static void fps__etcd_lost(fps_lease_etcd_t *l, const char *why) {
  atomic_store(&l->held, false);
  atomic_store(&l->valid_until, 0);
  pthread_mutex_lock(&l->mu);
  int64_t id = l->id;
  l->id = 0;
  l->stale_id = id;
  pthread_mutex_unlock(&l->mu);
  FPS_LOG(FPS_LOG_ERROR, "lease etcd:%s/%s: lost (%s): no longer primary", l->target, l->key, why);
  if (fps__etcd_revoke(l, id, fps__etcd_now() + FPS_ETCD_CALL_NS) == 0) {
    pthread_mutex_lock(&l->mu);
    if (l->stale_id == id) l->stale_id = 0;
    pthread_mutex_unlock(&l->mu);
  }
}

static void *fps__etcd_renewer(void *arg) {
  fps_lease_etcd_t *l = arg;
  pthread_mutex_lock(&l->mu);
  int64_t every = l->ttl_ns / 3;
  int64_t next = fps__etcd_now() + every;
  bool failing = false;
  for (;;) {
    while (!l->renewer_stop && fps__etcd_now() < next) {
      struct timespec ts = {(time_t)(next / FPS_ETCD_NS), (long)(next % FPS_ETCD_NS)};
      pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    }
    if (l->renewer_stop) break;
    int64_t id = l->id, ttl_ns = l->ttl_ns, margin = l->margin_ns;
    pthread_mutex_unlock(&l->mu);
    int64_t sent = fps__etcd_now();
    int64_t until = atomic_load(&l->valid_until);
    if (sent >= until) {
      fps__etcd_lost(l, "no renewal reached etcd within the TTL");
      pthread_mutex_lock(&l->mu);
      break;
    }
    Etcdserverpb__LeaseKeepAliveRequest req = ETCDSERVERPB__LEASE_KEEP_ALIVE_REQUEST__INIT;
    req.id = id;
    ProtobufCMessage *m;
    fps_etcd_err_t e;
    /* Half the renewal interval: a member that does not answer costs a
     * retry (to the next member) well inside the validity, and an answer
     * after the validity would not help anyway. */
    int64_t deadline = sent + every / 2 < until ? sent + every / 2 : until;
    int rc = fps__etcd_call(l, "/etcdserverpb.Lease/LeaseKeepAlive", &req.base,
                            &etcdserverpb__lease_keep_alive_response__descriptor, deadline, NULL, &m, &e);
    int64_t granted = rc == 0 ? ((Etcdserverpb__LeaseKeepAliveResponse *)m)->ttl : 0;
    fps__etcd_free_msg(m);
    if (rc == 0 && granted <= 0) {
      fps__etcd_lost(l, "etcd no longer knows the lease: it expired");
      pthread_mutex_lock(&l->mu);
      break;
    }
    if (rc == 0) {
      /* etcd renewed no earlier than `sent`: valid until sent + TTL. */
      int64_t v = sent + (granted * FPS_ETCD_NS < ttl_ns ? granted * FPS_ETCD_NS : ttl_ns) - margin;
      if (v > until) atomic_store(&l->valid_until, v);
      if (failing)
        FPS_LOG(FPS_LOG_INFO, "lease etcd:%s/%s: renewed again", l->target, l->key);
      failing = false;
      next = sent + every;
    } else {
      if (!failing)
        FPS_LOG(FPS_LOG_WARN,
                "lease etcd:%s/%s: renewal failed: %s; valid for %lld ms more unless a retry "
                "gets through",
                l->target, l->key, e.detail, (long long)((until - fps__etcd_now()) / FPS_ETCD_MS));
      failing = true;
      next = fps__etcd_now() + FPS_ETCD_RETRY_NS;
      if (next > until) next = until;
    }
    pthread_mutex_lock(&l->mu);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* Stops the renewer thread, if any. Not under mu. */
static void fps__etcd_stop_renewer(fps_lease_etcd_t *l) {
  pthread_mutex_lock(&l->mu);
  bool on = l->renewer_on;
  l->renewer_stop = true;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  if (on) pthread_join(l->renewer, NULL);
  pthread_mutex_lock(&l->mu);
  l->renewer_on = false;
  l->renewer_stop = false;
  pthread_mutex_unlock(&l->mu);
}

/* --------------------------------------------------------- acquiring */

/* Logs an acquisition problem when it differs from the last one logged,
 * so a standby waiting for hours writes one line, not one per poll. */
static void fps__etcd_note(fps_lease_etcd_t *l, int err, const char *what, const fps_etcd_err_t *e) {
  if (err == l->last_acquire_err) return;
  l->last_acquire_err = err;
  if (err == 0) return;
  FPS_LOG(FPS_LOG_WARN, "lease etcd:%s/%s: %s: %s; retrying", l->target, l->key, what, e->detail);
}

/* The sync record a won Txn read (its second response): 1 in sync (or
 * none: nobody answered alone yet), 0 alone. A value of another shape is
 * taken as alone: the pessimistic reading only flags a promotion. */
static int fps__etcd_sync_record(fps_lease_etcd_t *l, const Etcdserverpb__TxnResponse *t) {
  if (t->n_responses < 2 || t->responses[1]->response_case != ETCDSERVERPB__RESPONSE_OP__RESPONSE_RESPONSE_RANGE ||
      !t->responses[1]->response_range)
    return 1;
  const Etcdserverpb__RangeResponse *r = t->responses[1]->response_range;
  if (r->n_kvs == 0) return 1;
  const ProtobufCBinaryData *v = &r->kvs[0]->value;
  char buf[64];
  snprintf(buf, sizeof buf, "%.*s", (int)(v->len < sizeof buf ? v->len : sizeof buf - 1), (const char *)v->data);
  const char *sp = strchr(buf, ' ');
  if (sp && !strcmp(sp, " in-sync")) return 1;
  if (sp && !strcmp(sp, " alone")) return 0;
  FPS_LOG(FPS_LOG_WARN, "lease etcd:%s/%s: the sync record holds '%s', read as alone", l->target, l->sync_key, buf);
  return 0;
}

/* One try. Returns 1 (acquired: *term), 0 (held by another, or lost a
 * race), FPS_EUNAVAILABLE (etcd not reachable: try again), FPS_EIO (etcd
 * refused: a configuration problem), FPS_EPROTO, FPS_ENOMEM. */
static int fps__etcd_try(fps_lease_etcd_t *l, const atomic_bool *stop, uint64_t *term) {
  ProtobufCMessage *m = NULL;
  fps_etcd_err_t e;
  int rc;
  /* A lease lost earlier and not revoked yet may still hold the key. */
  pthread_mutex_lock(&l->mu);
  int64_t stale = l->stale_id;
  pthread_mutex_unlock(&l->mu);
  if (stale) {
    if ((rc = fps__etcd_revoke(l, stale, fps__etcd_now() + FPS_ETCD_CALL_NS)) < 0) return rc;
    pthread_mutex_lock(&l->mu);
    l->stale_id = 0;
    pthread_mutex_unlock(&l->mu);
  }
  /* A linearizable read first, so that a waiting replica does not grant
   * itself a lease every poll. */
  Etcdserverpb__RangeRequest rr = ETCDSERVERPB__RANGE_REQUEST__INIT;
  rr.key = (ProtobufCBinaryData){l->key_len, (uint8_t *)l->key};
  rc = fps__etcd_call(l, "/etcdserverpb.KV/Range", &rr.base, &etcdserverpb__range_response__descriptor,
                      fps__etcd_now() + FPS_ETCD_CALL_NS, stop, &m, &e);
  if (rc < 0) {
    fps__etcd_note(l, rc, "reading the key", &e);
    return rc;
  }
  size_t held_by_other = ((Etcdserverpb__RangeResponse *)m)->n_kvs;
  fps__etcd_free_msg(m);
  if (held_by_other) return 0;

  int64_t sent = fps__etcd_now();
  Etcdserverpb__LeaseGrantRequest gr = ETCDSERVERPB__LEASE_GRANT_REQUEST__INIT;
  gr.ttl = l->ttl_s;
  rc = fps__etcd_call(l, "/etcdserverpb.Lease/LeaseGrant", &gr.base, &etcdserverpb__lease_grant_response__descriptor,
                      sent + FPS_ETCD_CALL_NS, stop, &m, &e);
  if (rc < 0) {
    fps__etcd_note(l, rc, "LeaseGrant", &e);
    return rc;
  }
  Etcdserverpb__LeaseGrantResponse *g = (Etcdserverpb__LeaseGrantResponse *)m;
  int64_t id = g->id, granted = g->ttl;
  if (g->error && *g->error) snprintf(e.detail, sizeof e.detail, "%s", g->error);
  else snprintf(e.detail, sizeof e.detail, "lease %lld with TTL %lld s", (long long)id, (long long)granted);
  fps__etcd_free_msg(m);
  if (id == 0 || granted <= 0) {
    fps__etcd_note(l, FPS_EIO, "LeaseGrant refused", &e);
    return FPS_EIO;
  }
  int64_t ttl_ns = granted * FPS_ETCD_NS;
  int64_t margin = ttl_ns / 10 > FPS_ETCD_MARGIN_MIN_NS ? ttl_ns / 10 : FPS_ETCD_MARGIN_MIN_NS;
  int64_t valid_until = sent + ttl_ns - margin;

  /* If KEY does not exist (create_revision 0), create it under the
   * lease; otherwise read who has it. */
  Etcdserverpb__Compare cmp = ETCDSERVERPB__COMPARE__INIT;
  cmp.result = ETCDSERVERPB__COMPARE__COMPARE_RESULT__EQUAL;
  cmp.target = ETCDSERVERPB__COMPARE__COMPARE_TARGET__CREATE;
  cmp.key = rr.key;
  cmp.target_union_case = ETCDSERVERPB__COMPARE__TARGET_UNION_CREATE_REVISION;
  cmp.create_revision = 0;
  Etcdserverpb__PutRequest put = ETCDSERVERPB__PUT_REQUEST__INIT;
  put.key = rr.key;
  put.value = (ProtobufCBinaryData){strlen(l->holder), (uint8_t *)l->holder};
  put.lease = id;
  Etcdserverpb__RequestOp op = ETCDSERVERPB__REQUEST_OP__INIT;
  op.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_PUT;
  op.request_put = &put;
  /* The predecessor's sync record, read in the Txn's own revision. */
  Etcdserverpb__RangeRequest sr = ETCDSERVERPB__RANGE_REQUEST__INIT;
  sr.key = (ProtobufCBinaryData){l->sync_key_len, (uint8_t *)l->sync_key};
  Etcdserverpb__RequestOp rop = ETCDSERVERPB__REQUEST_OP__INIT;
  rop.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_RANGE;
  rop.request_range = &sr;
  Etcdserverpb__Compare *cmps[1] = {&cmp};
  Etcdserverpb__RequestOp *ops[2] = {&op, &rop};
  Etcdserverpb__TxnRequest tr = ETCDSERVERPB__TXN_REQUEST__INIT;
  tr.n_compare = 1;
  tr.compare = cmps;
  tr.n_success = 2;
  tr.success = ops;
  rc = fps__etcd_call(l, "/etcdserverpb.KV/Txn", &tr.base, &etcdserverpb__txn_response__descriptor,
                      fps__etcd_now() + FPS_ETCD_CALL_NS, stop, &m, &e);
  if (rc < 0) {
    /* The Txn may have been applied: revoke, which deletes the key if so
     * (or keep the id to revoke at the next try). */
    fps__etcd_note(l, rc, "Txn", &e);
    if (fps__etcd_revoke(l, id, fps__etcd_now() + FPS_ETCD_CALL_NS) < 0) {
      pthread_mutex_lock(&l->mu);
      l->stale_id = id;
      pthread_mutex_unlock(&l->mu);
    }
    return rc;
  }
  Etcdserverpb__TxnResponse *t = (Etcdserverpb__TxnResponse *)m;
  bool won = t->succeeded && t->header && t->header->revision > 0;
  int64_t revision = t->header ? t->header->revision : 0;
  int sync = won ? fps__etcd_sync_record(l, t) : 1;
  fps__etcd_free_msg(m);
  if (!won || fps__etcd_now() >= valid_until) {
    /* Another replica created the key first, or this took so long that
     * the lease is no longer safe to use: let it go. */
    if (fps__etcd_revoke(l, id, fps__etcd_now() + FPS_ETCD_CALL_NS) < 0) {
      pthread_mutex_lock(&l->mu);
      l->stale_id = id;
      pthread_mutex_unlock(&l->mu);
    }
    return 0;
  }
  pthread_mutex_lock(&l->mu);
  l->id = id;
  l->ttl_ns = ttl_ns;
  l->margin_ns = margin;
  atomic_store(&l->term, revision);
  atomic_store(&l->sync, sync);
  atomic_store(&l->valid_until, valid_until);
  atomic_store(&l->held, true);
  l->renewer_stop = false;
  if (pthread_create(&l->renewer, NULL, fps__etcd_renewer, l) != 0) {
    pthread_mutex_unlock(&l->mu);
    atomic_store(&l->held, false);
    atomic_store(&l->valid_until, 0);
    fps__etcd_revoke(l, id, fps__etcd_now() + FPS_ETCD_CALL_NS);
    pthread_mutex_lock(&l->mu);
    l->id = 0;
    pthread_mutex_unlock(&l->mu);
    return FPS_ENOMEM;
  }
  l->renewer_on = true;
  pthread_mutex_unlock(&l->mu);
  l->last_acquire_err = 0;
  *term = (uint64_t)revision;
  FPS_LOG(FPS_LOG_INFO, "lease etcd:%s/%s: acquired (term %lld, lease %lld, TTL %lld s, renewed every %lld ms)",
          l->target, l->key, (long long)revision, (long long)id, (long long)granted,
          (long long)(ttl_ns / 3 / FPS_ETCD_MS));
  return 1;
}

static int fps__lease_etcd_acquire(fps_lease_t *base, const atomic_bool *stop, uint64_t *term) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  /* A renewer left from a lease lost earlier has finished its work. */
  fps__etcd_stop_renewer(l);
  for (;;) {
    if (fps__etcd_stopping(stop)) return FPS_ECANCELLED;
    int rc = fps__etcd_try(l, stop, term);
    if (rc == 1) return 0;
    if (rc < 0 && rc != FPS_EUNAVAILABLE) return rc == FPS_ENOMEM ? rc : FPS_EIO;
    int64_t until = fps__etcd_now() + FPS_ETCD_POLL_NS;
    while (!fps__etcd_stopping(stop) && fps__etcd_now() < until)
      nanosleep(&(struct timespec){0, FPS_ETCD_STOP_NS}, NULL);
  }
}

static bool fps__lease_etcd_valid(fps_lease_t *base) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  return atomic_load(&l->held) && fps__etcd_now() < atomic_load(&l->valid_until);
}

static void fps__lease_etcd_release(fps_lease_t *base) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  /* Not valid from this instant, before anything else. */
  atomic_store(&l->held, false);
  atomic_store(&l->valid_until, 0);
  fps__etcd_stop_renewer(l);
  pthread_mutex_lock(&l->mu);
  int64_t id = l->id;
  l->id = 0;
  pthread_mutex_unlock(&l->mu);
  if (!id) return;
  /* Revoking deletes the key: the other replica takes it at its next
   * poll instead of after the TTL. */
  if (fps__etcd_revoke(l, id, fps__etcd_now() + FPS_ETCD_CALL_NS) < 0) {
    pthread_mutex_lock(&l->mu);
    l->stale_id = id;
    pthread_mutex_unlock(&l->mu);
  } else {
    FPS_LOG(FPS_LOG_INFO, "lease etcd:%s/%s: released", l->target, l->key);
  }
}

static void fps__lease_etcd_close(fps_lease_t *base) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  if (l->ch) {
    fps__lease_etcd_release(base);
    if (l->stale_id) fps__etcd_revoke(l, l->stale_id, fps__etcd_now() + FPS_ETCD_CALL_NS / 4);
    grpc_channel_destroy(l->ch);
  }
  if (l->creds) grpc_channel_credentials_release(l->creds);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv);
  fps_free(l->target);
  fps_free(l->key);
  fps_free(l->sync_key);
  fps_free(l->holder);
  fps_free(l);
  grpc_shutdown();
}

/* "<term> alone|in-sync" into KEY/sync, only while KEY is still the one
 * this holder created (its create revision is our term). */
static int fps__lease_etcd_set_sync(fps_lease_t *base, bool in_sync) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  if (!fps__lease_etcd_valid(base)) return FPS_EIO;
  int64_t term = atomic_load(&l->term);
  char val[64];
  int vlen = snprintf(val, sizeof val, "%lld %s", (long long)term, in_sync ? "in-sync" : "alone");
  Etcdserverpb__Compare cmp = ETCDSERVERPB__COMPARE__INIT;
  cmp.result = ETCDSERVERPB__COMPARE__COMPARE_RESULT__EQUAL;
  cmp.target = ETCDSERVERPB__COMPARE__COMPARE_TARGET__CREATE;
  cmp.key = (ProtobufCBinaryData){l->key_len, (uint8_t *)l->key};
  cmp.target_union_case = ETCDSERVERPB__COMPARE__TARGET_UNION_CREATE_REVISION;
  cmp.create_revision = term;
  Etcdserverpb__PutRequest put = ETCDSERVERPB__PUT_REQUEST__INIT;
  put.key = (ProtobufCBinaryData){l->sync_key_len, (uint8_t *)l->sync_key};
  put.value = (ProtobufCBinaryData){(size_t)vlen, (uint8_t *)val};
  Etcdserverpb__RequestOp op = ETCDSERVERPB__REQUEST_OP__INIT;
  op.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_PUT;
  op.request_put = &put;
  Etcdserverpb__Compare *cmps[1] = {&cmp};
  Etcdserverpb__RequestOp *ops[1] = {&op};
  Etcdserverpb__TxnRequest tr = ETCDSERVERPB__TXN_REQUEST__INIT;
  tr.n_compare = 1;
  tr.compare = cmps;
  tr.n_success = 1;
  tr.success = ops;
  ProtobufCMessage *m;
  fps_etcd_err_t e;
  int rc = fps__etcd_call(l, "/etcdserverpb.KV/Txn", &tr.base, &etcdserverpb__txn_response__descriptor,
                          fps__etcd_now() + FPS_ETCD_CALL_NS, NULL, &m, &e);
  bool ok = rc == 0 && ((Etcdserverpb__TxnResponse *)m)->succeeded;
  fps__etcd_free_msg(m);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "lease etcd:%s/%s: writing '%s': %s", l->target, l->sync_key, val, e.detail);
    return FPS_EIO;
  }
  if (!ok) {
    FPS_LOG(FPS_LOG_ERROR, "lease etcd:%s/%s: not writing '%s': the lease of term %lld is gone", l->target,
            l->sync_key, val, (long long)term);
    return FPS_EIO;
  }
  return 0;
}

static int fps__lease_etcd_get_sync(fps_lease_t *base) { return atomic_load(&((fps_lease_etcd_t *)base)->sync); }

/* The store's revision now (a linearizable Range of the key, whose value
 * is a short address): every term handed out is the revision of an
 * earlier Txn, so none exceeds it. Any thread (the lease thread's
 * acquisition may run beside it): it logs, rather than noting. */
static int fps__lease_etcd_newest_term(fps_lease_t *base, uint64_t *term) {
  fps_lease_etcd_t *l = (fps_lease_etcd_t *)base;
  Etcdserverpb__RangeRequest rr = ETCDSERVERPB__RANGE_REQUEST__INIT;
  rr.key = (ProtobufCBinaryData){l->key_len, (uint8_t *)l->key};
  ProtobufCMessage *m = NULL;
  fps_etcd_err_t e;
  int rc = fps__etcd_call(l, "/etcdserverpb.KV/Range", &rr.base, &etcdserverpb__range_response__descriptor,
                          fps__etcd_now() + FPS_ETCD_CALL_NS, NULL, &m, &e);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_WARN, "lease etcd:%s/%s: reading the store's revision: %s", l->target, l->key, e.detail);
    return FPS_EIO;
  }
  const Etcdserverpb__RangeResponse *r = (const Etcdserverpb__RangeResponse *)m;
  int64_t rev = r->header ? r->header->revision : 0;
  fps__etcd_free_msg(m);
  if (rev <= 0) return FPS_EIO;
  *term = (uint64_t)rev;
  return 0;
}

static const fps_lease_ops_t fps__lease_etcd_ops = {fps__lease_etcd_acquire, fps__lease_etcd_valid,
                                                    fps__lease_etcd_release, fps__lease_etcd_close,
                                                    fps__lease_etcd_set_sync, fps__lease_etcd_get_sync,
                                                    fps__lease_etcd_newest_term};

int fps__lease_etcd_open(const char *rest, double ttl_s, const char *holder, fps_lease_t **out) {
  *out = NULL;
  /* HOST:PORT/KEY (shape checked by fps_lease_spec_check): the key is
   * everything after the first '/'. */
  const char *slash = strchr(rest, '/');
  if (!slash || slash == rest || !slash[1]) {
    FPS_LOG(FPS_LOG_ERROR, "--lease etcd:%s must be etcd:HOST:PORT/KEY", rest);
    return FPS_EINVAL;
  }
  if (!(ttl_s > 0 && ttl_s <= 3600)) {
    FPS_LOG(FPS_LOG_ERROR, "--lease-ttl %g: the etcd lease needs more than 0 and at most 3600 seconds", ttl_s);
    return FPS_EINVAL;
  }
  grpc_init(); /* counted: fps__lease_etcd_close calls grpc_shutdown */
  fps_lease_etcd_t *l = fps_calloc(1, sizeof *l);
  if (!l) {
    grpc_shutdown();
    return FPS_ENOMEM;
  }
  l->base.ops = &fps__lease_etcd_ops;
  pthread_mutex_init(&l->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&l->cv, &ca);
  pthread_condattr_destroy(&ca);
  atomic_init(&l->held, false);
  atomic_init(&l->valid_until, 0);
  atomic_init(&l->term, 0);
  atomic_init(&l->sync, 1);
  /* etcd's TTL is whole seconds: round up (never shorter than asked).
   * etcd itself raises a TTL below its minimum (1.5 election timeouts: 2 s
   * with its defaults); the TTL it grants is the one used, and logged. */
  l->ttl_s = (int64_t)ttl_s;
  if ((double)l->ttl_s < ttl_s) l->ttl_s++;
  if ((double)l->ttl_s != ttl_s)
    FPS_LOG(FPS_LOG_INFO, "lease etcd:%s: --lease-ttl %g rounded up to %lld s (etcd counts whole seconds)", rest,
            ttl_s, (long long)l->ttl_s);
  size_t tlen = (size_t)(slash - rest);
  l->target = fps_malloc(tlen + 1);
  l->key = fps_strdup(slash + 1);
  l->holder = fps_strdup(holder && *holder ? holder : "unnamed");
  l->key_len = l->key ? strlen(l->key) : 0;
  l->sync_key_len = l->key_len + sizeof "/sync" - 1;
  l->sync_key = l->key ? fps_malloc(l->sync_key_len + 1) : NULL;
  if (!l->target || !l->key || !l->sync_key || !l->holder) goto nomem;
  memcpy(l->target, rest, tlen);
  l->target[tlen] = 0;
  snprintf(l->sync_key, l->sync_key_len + 1, "%s/sync", l->key);
  if (!(l->creds = grpc_insecure_credentials_create())) goto nomem;
  /* Reconnect soon after etcd comes back: a failover waits on it. */
  l->argv[0] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, .value.integer = 100};
  l->argv[1] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000};
  l->argv[2] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = 1 << 20};
  /* Every etcd member HOST resolves to (a DNS name of all members, or
   * gRPC's "ipv4:a:p,b:p" list), calls in turn: a member that is stopped
   * or cut off from its quorum fails one renewal, and the retry 100 ms
   * later goes to the next member, while the lease is still valid. (The
   * default, pick_first, stays on a member that accepts connections but no
   * longer answers, and the primary would lose its lease to it.) */
  l->argv[3] = (grpc_arg){.type = GRPC_ARG_STRING, .key = GRPC_ARG_SERVICE_CONFIG, .value.string = (char *)"{\"loadBalancingConfig\": [{\"round_robin\": {}}]}"};
  l->args = (grpc_channel_args){.num_args = 4, .args = l->argv};
  if (!(l->ch = grpc_channel_create(l->target, l->creds, &l->args))) {
    FPS_LOG(FPS_LOG_ERROR, "--lease etcd:%s: cannot make a channel to %s", rest, l->target);
    fps__lease_etcd_close(&l->base);
    return FPS_EINVAL;
  }
  *out = &l->base;
  return 0;
nomem:
  fps__lease_etcd_close(&l->base);
  return FPS_ENOMEM;
}

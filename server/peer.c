/* The calling side of Exchange (see peer.h).
 *
 * A send is one unary call whose six ops go in one batch, so each attempt
 * has exactly one completion on the peers' queue. The first attempt is
 * started on the caller's thread (no hand-off, no wake-up needed); the
 * peers' thread takes every completion, and retries an UNAVAILABLE attempt
 * after a backoff (50 ms doubling to 1 s) while the deadline allows; its
 * queue wait ends at the earliest retry that is due. done runs with no
 * lock of ours held, so it may send again.
 *
 * Locks: p->mu guards the live list, every send's call pointer and state,
 * the channels and `closed`; it is a leaf for the core (the core never
 * holds a lock of its own while calling fps_peers_send). */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
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
#include <openssl/crypto.h>

#include "alloc.h"
#include "auth.h"
#include "factorps/v1/factorps.pb-c.h"
#include "peer.h"
#include "status.h"

#define FPS_PEER_METHOD "/factorps.v1.ParameterServer/Exchange"
#define FPS_PEER_BACKOFF0_NS (INT64_C(50) * 1000000)
#define FPS_PEER_BACKOFF_MAX_NS (INT64_C(1000) * 1000000)
/* The thread's queue wait when no retry is due: how soon it notices a
 * stop whose calls gRPC never completed. */
#define FPS_PEER_POLL_NS (INT64_C(200) * 1000000)
/* A channel failing this long is replaced: gRPC 1.51 can keep a failed
 * channel in TRANSIENT_FAILURE for seconds after the peer is back (the
 * same rule as libfactorps, client/client.c). */
#define FPS_PEER_RENEW_NS (INT64_C(250) * 1000000)
#define FPS_PEER_TOKEN_MAX 4096

typedef struct fps_psend_s fps_psend_t;
struct fps_psend_s {
  fps_peers_t *p;
  uint32_t to;
  uint32_t alt;                /* which of the peer's replicas this attempt calls */
  uint32_t flips;              /* replicas tried since the last backoff */
  uint32_t attempts;
  char *name;                  /* the tensor, for messages */
  grpc_slice req;              /* the packed ExchangeRequest, every attempt */
  int64_t deadline_ns;         /* fps_now_ns clock */
  int64_t retry_at_ns;         /* waiting: when the next attempt starts */
  int64_t backoff_ns;
  fps_xsend_done_fn done;
  void *arg;
  bool waiting;                /* between attempts (no call) */
  bool orphaned;               /* done already called by a stop gRPC outlived */
  /* The attempt in flight (p->mu). */
  grpc_call *call;
  grpc_byte_buffer *send_bb, *recv_bb;
  grpc_metadata_array init_md, trail_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  char last[384];              /* why the previous attempt failed */
  fps_psend_t *prev, *next;    /* p->live */
};

struct fps_peers_s {
  uint32_t self, n;
  char **addrs;                /* [n] the --peers entries ("A" or "A|B"); addrs[self] unused */
  char **alt_addr;             /* [2n]: entry i's replicas at 2i, 2i + 1 (NULL: none) */
  uint32_t *nalt;              /* [n]: 1, or 2 for a shard with a standby */
  uint32_t *cur;               /* [n]: the replica that answered last */
  grpc_channel **ch;           /* [2n], as alt_addr; self's NULL */
  int64_t *failing_since;      /* [2n] ns, 0: not failing */
  size_t max_reply;            /* an answer's bytes at most (--max-message-bytes) */
  grpc_channel_credentials *creds;
  grpc_arg argv[6];
  grpc_channel_args args;
  char *server_name;
  char *auth_header;           /* "Bearer <token>", NULL: none */
  grpc_metadata auth_md;
  bool tls;
  double deadline_s;           /* --exchange-deadline, for messages */
  grpc_completion_queue *cq;
  pthread_t th;
  bool th_on;
  pthread_mutex_t mu;
  pthread_cond_t cv;           /* live count dropped (CLOCK_MONOTONIC) */
  bool closed;                 /* stopping: no new call */
  bool stopping;               /* this shard stops: no retry of UNAVAILABLE */
  bool th_stop;                /* the thread leaves at its next wake-up */
  bool stopped;
  bool abandoned;              /* gRPC kept calls past the stop: cq leaked */
  fps_psend_t *live;           /* in flight or waiting for a retry */
  size_t nlive;                /* of them not orphaned */
};

static const char *fps__grpc_code_name(grpc_status_code c) {
  static const char *const names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return (unsigned)c < sizeof names / sizeof names[0] ? names[c] : "UNKNOWN";
}

/* ------------------------------------------------------------ set-up */

/* The first line of --peer-token-file that is neither blank nor a '#'
 * comment (the format of --auth-token-file, whose first token a peer
 * would send). */
static int fps__peer_token(const char *path, char **header) {
  char *text = NULL;
  size_t text_len = 0;
  int rc = fps_auth_read_file("peer-token-file", path, &text, &text_len);
  if (rc < 0) return rc;
  fps_auth_warn_mode("peer-token-file", path);
  int lineno = 0;
  char *cursor = text;
  const char *line;
  size_t n;
  rc = fps_auth_token_next(&cursor, &lineno, "peer-token-file", path, &line, &n);
  if (rc == 1) {
    rc = FPS_EINVAL;
    if (n > FPS_PEER_TOKEN_MAX) {
      FPS_LOG(FPS_LOG_ERROR, "--peer-token-file '%s' line %d: token longer than %d bytes", path,
              lineno, FPS_PEER_TOKEN_MAX);
      goto done;
    }
    size_t len = n + sizeof "Bearer ";
    if (!(*header = fps_malloc(len))) {
      rc = FPS_ENOMEM;
      goto done;
    }
    snprintf(*header, len, "Bearer %s", line);
    rc = 0;
  } else if (rc == 0) {
    rc = FPS_EINVAL;
    FPS_LOG(FPS_LOG_ERROR, "--peer-token-file '%s' holds no token", path);
  }
done:
  OPENSSL_cleanse(text, text_len); /* the lines were cut in place: not strlen */
  fps_free(text);
  return rc;
}

/* Channel credentials from the peer TLS flags (checked shapes: config.c). */
static int fps__peer_creds(fps_peers_t *p, const fps_config_t *cfg) {
  if (!*cfg->peer_tls_ca) {
    p->creds = grpc_insecure_credentials_create();
    return p->creds ? 0 : FPS_ENOMEM;
  }
  char *ca = NULL, *cert = NULL, *key = NULL;
  int rc;
  if ((rc = fps_auth_read_file("peer-tls-ca", cfg->peer_tls_ca, &ca, NULL)) < 0) goto done;
  if ((rc = fps_auth_check_ca("peer-tls-ca", cfg->peer_tls_ca, ca)) < 0) goto done;
  if (*cfg->peer_tls_cert) {
    if ((rc = fps_auth_read_file("peer-tls-cert", cfg->peer_tls_cert, &cert, NULL)) < 0) goto done;
    if ((rc = fps_auth_read_file("peer-tls-key", cfg->peer_tls_key, &key, NULL)) < 0) goto done;
    fps_auth_warn_mode("peer-tls-key", cfg->peer_tls_key);
    if ((rc = fps_auth_check_pair("peer-tls-cert", cfg->peer_tls_cert, cert, "peer-tls-key", cfg->peer_tls_key,
                                  key)) < 0)
      goto done;
  }
  grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
  /* gRPC copies the PEM text. */
  p->creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
  rc = p->creds ? 0 : FPS_ENOMEM;
  p->tls = true;
done:
  if (key) OPENSSL_cleanse(key, strlen(key));
  fps_free(ca);
  fps_free(cert);
  fps_free(key);
  return rc;
}

static void *fps__peer_main(void *arg);

int fps_peers_create(const fps_config_t *cfg, fps_peers_t **out) {
  *out = NULL;
  fps_peers_t *p = fps_calloc(1, sizeof *p);
  if (!p) return FPS_ENOMEM;
  int rc = FPS_ENOMEM;
  p->self = cfg->shard_id;
  p->n = cfg->shard_count;
  p->deadline_s = cfg->exchange_deadline;
  pthread_mutex_init(&p->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&p->cv, &ca);
  pthread_condattr_destroy(&ca);
  p->addrs = fps_calloc(p->n, sizeof *p->addrs);
  p->alt_addr = fps_calloc(2 * (size_t)p->n, sizeof *p->alt_addr);
  p->nalt = fps_calloc(p->n, sizeof *p->nalt);
  p->cur = fps_calloc(p->n, sizeof *p->cur);
  p->ch = fps_calloc(2 * (size_t)p->n, sizeof *p->ch);
  p->failing_since = fps_calloc(2 * (size_t)p->n, sizeof *p->failing_since);
  if (!p->addrs || !p->alt_addr || !p->nalt || !p->cur || !p->ch || !p->failing_since) goto fail;
  p->max_reply = cfg->max_message_bytes && cfg->max_message_bytes < INT32_MAX ? (size_t)cfg->max_message_bytes
                                                                              : (size_t)INT32_MAX;
  const char *s = cfg->peers;
  for (uint32_t i = 0; i < p->n; i++) {
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    if (!(p->addrs[i] = fps_malloc(len + 1))) goto fail;
    memcpy(p->addrs[i], s, len);
    p->addrs[i][len] = 0;
    s = e ? e + 1 : s + len;
    /* "A|B": the shard's two replicas (config.c checked the shape). */
    const char *bar = strchr(p->addrs[i], '|');
    size_t l0 = bar ? (size_t)(bar - p->addrs[i]) : len;
    if (!(p->alt_addr[2 * i] = fps_malloc(l0 + 1))) goto fail;
    memcpy(p->alt_addr[2 * i], p->addrs[i], l0);
    p->alt_addr[2 * i][l0] = 0;
    p->nalt[i] = 1;
    if (bar) {
      if (!(p->alt_addr[2 * i + 1] = fps_strdup(bar + 1))) goto fail;
      p->nalt[i] = 2;
    }
  }
  if (*cfg->peer_token_file) {
    if ((rc = fps__peer_token(cfg->peer_token_file, &p->auth_header)) < 0) goto fail;
    p->auth_md.key = grpc_slice_from_static_string("authorization");
    p->auth_md.value = grpc_slice_from_static_string(p->auth_header);
    if (!*cfg->peer_tls_ca)
      FPS_LOG(FPS_LOG_WARN, "--peer-token-file without --peer-tls-ca: the token travels to the peers in "
               "plaintext");
  }
  if ((rc = fps__peer_creds(p, cfg)) < 0) goto fail;
  rc = FPS_ENOMEM;
  /* Short reconnect backoff: the retry loop here, not gRPC's default
   * 1-120 s, decides how long a restarting peer is tried. The minimum
   * connect timeout stays long enough for a busy peer's handshake. */
  p->argv[0] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                          .value.integer = 100};
  p->argv[1] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                          .value.integer = 5000};
  p->argv[2] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                          .value.integer = 1000};
  p->argv[3] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                          .value.integer = -1};
  /* A reply may bring a peer's partials (ExchangeResponse): as large as
   * the requests this shard takes. */
  p->argv[4] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                          .value.integer = (int)p->max_reply};
  size_t nargs = 5;
  if (*cfg->peer_tls_server_name) {
    if (!(p->server_name = fps_strdup(cfg->peer_tls_server_name))) goto fail;
    p->argv[nargs++] = (grpc_arg){.type = GRPC_ARG_STRING, .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                                  .value.string = p->server_name};
  }
  p->args = (grpc_channel_args){.num_args = nargs, .args = p->argv};
  for (uint32_t i = 0; i < p->n; i++) {
    if (i == p->self) continue;
    for (uint32_t k = 0; k < p->nalt[i]; k++)
      if (!(p->ch[2 * i + k] = grpc_channel_create(p->alt_addr[2 * i + k], p->creds, &p->args))) {
        FPS_LOG(FPS_LOG_ERROR, "--peers entry %u '%s': cannot make a channel to it", i, p->alt_addr[2 * i + k]);
        rc = FPS_EINVAL;
        goto fail;
      }
  }
  if (!(p->cq = grpc_completion_queue_create_for_next(NULL))) goto fail;
  if (pthread_create(&p->th, NULL, fps__peer_main, p) != 0) goto fail;
  p->th_on = true;
  FPS_LOG(FPS_LOG_INFO, "peers: %u shards, %s%s, exchange deadline %g s", p->n,
           !p->tls ? "plaintext" : *cfg->peer_tls_cert ? "TLS with a client certificate" : "TLS",
           p->auth_header ? ", bearer token" : "", p->deadline_s);
  *out = p;
  return 0;
fail:
  fps_peers_destroy(p);
  return rc;
}

/* ------------------------------------------------------------- sends */

static void fps__shutdown_msg(const fps_peers_t *p, const fps_psend_t *s, char *msg, size_t len);
static void fps__unreachable_msg(const fps_peers_t *p, const fps_psend_t *s, bool stopping, char *msg, size_t len);

static void fps__psend_free(fps_psend_t *s) {
  grpc_slice_unref(s->req);
  fps_free(s->name);
  fps_free(s);
}

static void fps__link(fps_peers_t *p, fps_psend_t *s) {
  s->prev = NULL;
  s->next = p->live;
  if (p->live) p->live->prev = s;
  p->live = s;
  p->nlive++;
}

static void fps__unlink(fps_peers_t *p, fps_psend_t *s) {
  if (s->prev) s->prev->next = s->next;
  else p->live = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
  p->nlive--;
  pthread_cond_broadcast(&p->cv);
}

/* Starts one attempt. REQUIRES p->mu. 0, or FPS_ETIMEOUT (no time left),
 * FPS_EIO (gRPC refused the call or its batch). */
static int fps__attempt_locked(fps_peers_t *p, fps_psend_t *s) {
  int64_t left = s->deadline_ns - fps_now_ns();
  if (left <= 0) return FPS_ETIMEOUT;
  gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_nanos(left, GPR_TIMESPAN));
  s->call = grpc_channel_create_call(p->ch[2 * s->to + s->alt], NULL, GRPC_PROPAGATE_DEFAULTS, p->cq,
                                     grpc_slice_from_static_string(FPS_PEER_METHOD), NULL, dl, NULL);
  if (!s->call) return FPS_EIO;
  grpc_metadata_array_init(&s->init_md);
  grpc_metadata_array_init(&s->trail_md);
  s->details = grpc_empty_slice();
  s->error_string = NULL;
  s->recv_bb = NULL;
  s->status = GRPC_STATUS_UNKNOWN;
  s->send_bb = grpc_raw_byte_buffer_create(&s->req, 1);
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = p->auth_header ? 1 : 0;
  ops[0].data.send_initial_metadata.metadata = p->auth_header ? &p->auth_md : NULL;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = s->send_bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &s->recv_bb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &s->trail_md;
  ops[5].data.recv_status_on_client.status = &s->status;
  ops[5].data.recv_status_on_client.status_details = &s->details;
  ops[5].data.recv_status_on_client.error_string = &s->error_string;
  if (grpc_call_start_batch(s->call, ops, 6, s, NULL) != GRPC_CALL_OK) {
    grpc_call_unref(s->call);
    s->call = NULL;
    grpc_byte_buffer_destroy(s->send_bb);
    s->send_bb = NULL;
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    return FPS_EIO;
  }
  s->attempts++;
  s->waiting = false;
  return 0;
}

int fps_peers_send(void *ctx, uint32_t to_shard, const fps_xmsg_t *m, int64_t deadline_ns,
                   fps_xsend_done_fn done, void *arg) {
  fps_peers_t *p = ctx;
  if (!p || !m || !m->name || !done || to_shard >= p->n || to_shard == p->self) return FPS_EINVAL;
  Factorps__V1__ExchangeRequest r = FACTORPS__V1__EXCHANGE_REQUEST__INIT;
  r.name = (char *)m->name;
  r.version = m->version;
  r.from_shard = m->from_shard;
  r.shard_count = m->shard_count;
  r.block_index = m->block_index;
  r.phase = (Factorps__V1__ExchangePhase)m->phase;
  r.attempt = m->attempt;
  r.stamp = m->stamp;
  r.want = m->want;
  r.partials.data = (uint8_t *)m->partials;
  r.partials.len = m->len;
  fps_psend_t *s = fps_calloc(1, sizeof *s);
  if (!s) return FPS_ENOMEM;
  if (!(s->name = fps_strdup(m->name))) {
    fps_free(s);
    return FPS_ENOMEM;
  }
  size_t n = protobuf_c_message_get_packed_size(&r.base);
  s->req = grpc_slice_malloc(n);
  protobuf_c_message_pack(&r.base, GRPC_SLICE_START_PTR(s->req));
  s->p = p;
  s->to = to_shard;
  s->deadline_ns = deadline_ns;
  s->backoff_ns = FPS_PEER_BACKOFF0_NS;
  s->done = done;
  s->arg = arg;
  pthread_mutex_lock(&p->mu);
  s->alt = p->cur[to_shard]; /* the replica that answered last */
  int rc = p->closed ? FPS_EUNAVAILABLE : fps__attempt_locked(p, s);
  if (rc == 0) fps__link(p, s);
  pthread_mutex_unlock(&p->mu);
  if (rc < 0) fps__psend_free(s);
  return rc;
}

/* The peer's status message (or gRPC's own error text) into buf. */
static void fps__details(const fps_psend_t *s, char *buf, size_t len) {
  size_t n = GRPC_SLICE_LENGTH(s->details);
  if (n) snprintf(buf, len, "%.*s", (int)n, (const char *)GRPC_SLICE_START_PTR(s->details));
  else snprintf(buf, len, "%s", s->error_string ? s->error_string : "no detail");
}

/* Replaces peer `to`'s channel when it has been failing for a while.
 * REQUIRES p->mu. Calls on the old channel hold their own references. */
static void fps__renew_locked(fps_peers_t *p, uint32_t to, int64_t now) {
  if (grpc_channel_check_connectivity_state(p->ch[to], 0) != GRPC_CHANNEL_TRANSIENT_FAILURE) {
    p->failing_since[to] = 0;
    return;
  }
  if (!p->failing_since[to]) {
    p->failing_since[to] = now;
    return;
  }
  if (now - p->failing_since[to] < FPS_PEER_RENEW_NS) return;
  grpc_channel *fresh = grpc_channel_create(p->alt_addr[to], p->creds, &p->args);
  if (!fresh) return;
  grpc_channel_destroy(p->ch[to]);
  p->ch[to] = fresh;
  p->failing_since[to] = 0;
}

/* The peer's answer (ExchangeResponse) into *r: its partials copied. A
 * reply that does not parse counts as empty (OK without anything). */
static void fps__reply(const fps_peers_t *p, grpc_byte_buffer *bb, fps_xreply_t *r) {
  memset(r, 0, sizeof *r);
  if (!bb) return;
  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, bb)) return;
  grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  size_t n = GRPC_SLICE_LENGTH(all);
  Factorps__V1__ExchangeResponse *m =
      n && n <= p->max_reply
          ? factorps__v1__exchange_response__unpack(NULL, n, GRPC_SLICE_START_PTR(all))
          : NULL;
  grpc_slice_unref(all);
  if (!m) return;
  r->applied = m->applied;
  r->committed = m->committed;
  if (m->partials.len && (r->partials = fps_malloc(m->partials.len))) {
    memcpy(r->partials, m->partials.data, m->partials.len);
    r->len = m->partials.len;
  }
  factorps__v1__exchange_response__free_unpacked(m, NULL);
}

/* One attempt's completion (the peers' thread): retry, or the outcome. */
static void fps__complete(fps_peers_t *p, fps_psend_t *s, bool success) {
  char detail[sizeof s->last], msg[1024];
  int err = 0;
  bool final = true;
  pthread_mutex_lock(&p->mu);
  grpc_call_unref(s->call);
  s->call = NULL;
  grpc_byte_buffer_destroy(s->send_bb);
  s->send_bb = NULL;
  grpc_status_code st = success ? s->status : GRPC_STATUS_UNAVAILABLE;
  fps_xreply_t reply = {0};
  grpc_byte_buffer *answer = s->recv_bb; /* read below if OK */
  s->recv_bb = NULL;
  grpc_metadata_array_destroy(&s->init_md);
  grpc_metadata_array_destroy(&s->trail_md);
  if (success) fps__details(s, detail, sizeof detail);
  else snprintf(detail, sizeof detail, "the call failed in the transport");
  grpc_slice_unref(s->details);
  s->details = grpc_empty_slice();
  if (s->error_string) gpr_free((void *)s->error_string);
  s->error_string = NULL;
  if (s->orphaned) {
    /* A stop gave up on this call and answered for it already. */
    pthread_mutex_unlock(&p->mu);
    if (answer) grpc_byte_buffer_destroy(answer);
    return;
  }
  int64_t now = fps_now_ns();
  if (st == GRPC_STATUS_OK) {
    p->failing_since[2 * s->to + s->alt] = 0;
    p->cur[s->to] = s->alt; /* the next sends start here */
  } else if (p->closed) {
    err = FPS_EUNAVAILABLE;
    fps__shutdown_msg(p, s, msg, sizeof msg);
  } else if (st == GRPC_STATUS_UNAVAILABLE) {
    snprintf(s->last, sizeof s->last, "%s", detail);
    fps__renew_locked(p, 2 * s->to + s->alt, now);
    /* A shard with a standby: the other replica at once (a standby
     * answers UNAVAILABLE, a dead primary fails in the transport); the
     * backoff only once both were tried. */
    bool flip = p->nalt[s->to] == 2 && ++s->flips < 2;
    if (p->nalt[s->to] == 2) s->alt ^= 1;
    int64_t wait = flip ? 0 : s->backoff_ns;
    if (!p->stopping && now + wait < s->deadline_ns) {
      s->retry_at_ns = now + wait;
      if (!flip) {
        s->flips = 0;
        s->backoff_ns = s->backoff_ns * 2 > FPS_PEER_BACKOFF_MAX_NS ? FPS_PEER_BACKOFF_MAX_NS : s->backoff_ns * 2;
      }
      s->waiting = true;
      final = false;
    } else {
      err = FPS_EUNAVAILABLE;
      fps__unreachable_msg(p, s, p->stopping, msg, sizeof msg);
    }
  } else if (st == GRPC_STATUS_DEADLINE_EXCEEDED) {
    err = FPS_ETIMEOUT;
    snprintf(msg, sizeof msg, "shard %u (%s) did not answer Exchange of '%s' within the deadline: %s", s->to,
             p->addrs[s->to], s->name, detail);
  } else {
    err = fps_err_from_status(st);
    snprintf(msg, sizeof msg, "shard %u (%s) refused Exchange of '%s': %s: %s%s", s->to, p->addrs[s->to],
             s->name, fps__grpc_code_name(st), detail,
             st == GRPC_STATUS_UNAUTHENTICATED
                 ? " (check --peer-token-file against the peer's --exchange-token-file or --auth-token-file)"
             : st == GRPC_STATUS_PERMISSION_DENIED
                 ? " (--peer-token-file must hold this shard's own line of the peer's --exchange-token-file)"
                 : "");
  }
  if (final) fps__unlink(p, s);
  pthread_mutex_unlock(&p->mu);
  if (final && !err) fps__reply(p, answer, &reply); /* OK: what the peer answered */
  if (answer) grpc_byte_buffer_destroy(answer);
  if (!final) {
    fps_xreply_free(&reply);
    return;
  }
  s->done(s->arg, err, err ? msg : NULL, err ? NULL : &reply);
  fps_xreply_free(&reply);
  fps__psend_free(s);
}

/* Starts the retries that are due; fails those without time left.
 * Returns when the next one is due (INT64_MAX: none). */
static int64_t fps__retries(fps_peers_t *p) {
  fps_psend_t *failed = NULL;
  int64_t next = INT64_MAX;
  pthread_mutex_lock(&p->mu);
  int64_t now = fps_now_ns();
  for (fps_psend_t *s = p->live, *nx; s; s = nx) {
    nx = s->next;
    if (!s->waiting) continue;
    if (s->retry_at_ns > now) {
      if (s->retry_at_ns < next) next = s->retry_at_ns;
      continue;
    }
    int rc = p->closed || p->stopping ? FPS_EUNAVAILABLE : fps__attempt_locked(p, s);
    if (rc == 0) continue;
    fps__unlink(p, s);
    s->next = failed;
    failed = s;
  }
  bool closed = p->closed, stopping = p->stopping;
  pthread_mutex_unlock(&p->mu);
  while (failed) {
    fps_psend_t *s = failed;
    failed = s->next;
    char msg[1024];
    if (closed) fps__shutdown_msg(p, s, msg, sizeof msg);
    else fps__unreachable_msg(p, s, stopping, msg, sizeof msg);
    s->done(s->arg, FPS_EUNAVAILABLE, msg, NULL);
    fps__psend_free(s);
  }
  return next;
}

static void *fps__peer_main(void *arg) {
  fps_peers_t *p = arg;
  for (;;) {
    int64_t next = fps__retries(p);
    pthread_mutex_lock(&p->mu);
    bool stop = p->th_stop;
    pthread_mutex_unlock(&p->mu);
    if (stop) break;
    int64_t now = fps_now_ns();
    int64_t wait = next == INT64_MAX || next - now > FPS_PEER_POLL_NS ? FPS_PEER_POLL_NS : next - now;
    if (wait < 0) wait = 0;
    grpc_event ev = grpc_completion_queue_next(
        p->cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_nanos(wait, GPR_TIMESPAN)), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) fps__complete(p, ev.tag, ev.success);
  }
  return NULL;
}

/* ---------------------------------------------------------- shutdown */

/* Peers objects whose stop gRPC outlived: kept reachable (their queue
 * and sends may still be written by gRPC), never freed. */
static pthread_mutex_t fps__peers_abandoned_mu = PTHREAD_MUTEX_INITIALIZER;
static fps_peers_t *fps__peers_abandoned;

static void fps__shutdown_msg(const fps_peers_t *p, const fps_psend_t *s, char *msg, size_t len) {
  snprintf(msg, len, "Exchange of '%s' to shard %u (%s) abandoned: this shard is shutting down", s->name,
           s->to, p->addrs[s->to]);
}

/* A send that found its peer UNAVAILABLE until its deadline, or until
 * this shard began stopping. */
static void fps__unreachable_msg(const fps_peers_t *p, const fps_psend_t *s, bool stopping, char *msg, size_t len) {
  snprintf(msg, len, "shard %u (%s) not reachable for Exchange of '%s' %s (%u attempts; last: UNAVAILABLE: %s)%s",
           s->to, p->addrs[s->to], s->name, stopping ? "while this shard stops" : "within the deadline", s->attempts,
           s->last,
           p->tls ? "; shard down, or the TLS handshake failed (check --peer-tls-ca, --peer-tls-cert and the name in "
                    "the peer's certificate)"
                  : "");
}

void fps_peers_stopping(fps_peers_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stopping = true;
  /* Sends waiting for a retry fail at the thread's next pass. */
  for (fps_psend_t *s = p->live; s; s = s->next)
    if (s->waiting) s->retry_at_ns = 0;
  pthread_mutex_unlock(&p->mu);
}

void fps_peers_stop(fps_peers_t *p, double wait_s) {
  if (!p) return;
  fps_psend_t *waiting = NULL;
  pthread_mutex_lock(&p->mu);
  if (p->stopped) {
    pthread_mutex_unlock(&p->mu);
    return;
  }
  p->stopped = true;
  p->closed = true;
  /* Calls in flight end CANCELLED (fps__complete reports them as
   * shutting down); sends between attempts fail here. */
  for (fps_psend_t *s = p->live, *nx; s; s = nx) {
    nx = s->next;
    if (s->call) {
      grpc_call_cancel(s->call, NULL);
    } else {
      fps__unlink(p, s);
      s->next = waiting;
      waiting = s;
    }
  }
  pthread_mutex_unlock(&p->mu);
  while (waiting) {
    fps_psend_t *s = waiting;
    waiting = s->next;
    char msg[512];
    fps__shutdown_msg(p, s, msg, sizeof msg);
    s->done(s->arg, FPS_EUNAVAILABLE, msg, NULL);
    fps__psend_free(s);
  }
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  int64_t ns = (int64_t)(wait_s * 1e9);
  until.tv_sec += (time_t)(ns / 1000000000);
  until.tv_nsec += (long)(ns % 1000000000);
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&p->mu);
  while (p->nlive > 0)
    if (pthread_cond_timedwait(&p->cv, &p->mu, &until) == ETIMEDOUT) break;
  fps_psend_t *orphans = NULL;
  if (p->nlive > 0) {
    /* gRPC did not finish the cancelled calls in time (seen under ASan by
     * libfactorps): answer for them now; their memory stays gRPC's and
     * the thread leaves without waiting for their completions. */
    p->abandoned = true;
    for (fps_psend_t *s = p->live; s; s = s->next) s->orphaned = true;
    orphans = p->live;
    p->nlive = 0;
  }
  p->th_stop = true;
  pthread_mutex_unlock(&p->mu);
  for (fps_psend_t *s = orphans; s; s = s->next) {
    char msg[512];
    fps__shutdown_msg(p, s, msg, sizeof msg);
    s->done(s->arg, FPS_EUNAVAILABLE, msg, NULL);
  }
  /* Nothing in flight (or abandoned): the thread drains the queue to
   * SHUTDOWN, or leaves at its next wake-up. */
  if (!p->abandoned) grpc_completion_queue_shutdown(p->cq);
  if (p->th_on) pthread_join(p->th, NULL);
  p->th_on = false;
  if (p->abandoned) FPS_LOG(FPS_LOG_WARN, "peers: gRPC kept cancelled Exchange calls past the stop; left to it");
}

void fps_peers_destroy(fps_peers_t *p) {
  if (!p) return;
  if (p->th_on) fps_peers_stop(p, 0.5);
  if (p->cq && !p->abandoned) {
    if (!p->stopped) {
      /* Never started (create failed): nothing was ever queued. */
      grpc_completion_queue_shutdown(p->cq);
      while (grpc_completion_queue_next(p->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
             GRPC_QUEUE_SHUTDOWN) {
      }
    }
    grpc_completion_queue_destroy(p->cq);
  }
  if (p->ch)
    for (uint32_t i = 0; i < 2 * p->n; i++)
      if (p->ch[i]) grpc_channel_destroy(p->ch[i]);
  if (p->creds) grpc_channel_credentials_release(p->creds);
  if (p->addrs)
    for (uint32_t i = 0; i < p->n; i++) fps_free(p->addrs[i]);
  if (p->alt_addr)
    for (uint32_t i = 0; i < 2 * p->n; i++) fps_free(p->alt_addr[i]);
  fps_free(p->addrs);
  fps_free(p->alt_addr);
  fps_free(p->nalt);
  fps_free(p->cur);
  fps_free(p->ch);
  fps_free(p->failing_since);
  fps_free(p->server_name);
  if (p->auth_header) OPENSSL_cleanse(p->auth_header, strlen(p->auth_header));
  fps_free(p->auth_header);
  if (p->abandoned) {
    pthread_mutex_lock(&fps__peers_abandoned_mu);
    fps__peers_abandoned = p;
    pthread_mutex_unlock(&fps__peers_abandoned_mu);
    return;
  }
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  fps_free(p);
}

/* ----------------------------------------- one channel for a replica */

int fps_peer_channel(const fps_config_t *cfg, const char *addr, grpc_channel **out, char **auth_header) {
  *out = NULL;
  *auth_header = NULL;
  fps_peers_t tmp; /* only its credential fields are used */
  memset(&tmp, 0, sizeof tmp);
  int rc;
  if (*cfg->peer_token_file && (rc = fps__peer_token(cfg->peer_token_file, auth_header)) < 0) return rc;
  if ((rc = fps__peer_creds(&tmp, cfg)) < 0) goto fail;
  grpc_arg argv[6];
  size_t nargs = 0;
  argv[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                             .value.integer = 100};
  argv[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                             .value.integer = 1000};
  argv[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                             .value.integer = -1};
  /* A standby that stops answering is dropped within a few seconds. */
  argv[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIME_MS, .value.integer = 1000};
  argv[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIMEOUT_MS, .value.integer = 2000};
  if (*cfg->peer_tls_server_name)
    argv[nargs++] = (grpc_arg){.type = GRPC_ARG_STRING, .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                               .value.string = cfg->peer_tls_server_name};
  grpc_channel_args args = {.num_args = nargs, .args = argv};
  *out = grpc_channel_create(addr, tmp.creds, &args);
  grpc_channel_credentials_release(tmp.creds);
  if (!*out) {
    rc = FPS_EINVAL;
    goto fail;
  }
  return 0;
fail:
  fps_free(*auth_header);
  *auth_header = NULL;
  return rc;
}

/* The client object: options, channels, tensor-list queries. The RPCs
 * live in tensors.c, push_pull.c and stats.c; the status helpers in
 * status.c. */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "internal.h"
#include "name.h"

#define FPS__MIN_MESSAGE_BYTES FPS_MESSAGE_BYTES_MIN /* common/fps_limits.h */
/* The largest reply message a shard sends (server.h FPS_REPLY_BUDGET plus
 * framing): shards cut replies at this size whatever the client sends. */
#define FPS__SHARD_REPLY_BYTES (4u * 1024u * 1024u)

double fps__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

gpr_timespec fps__deadline_after(double seconds) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                      gpr_time_from_micros((int64_t)(seconds * 1e6), GPR_TIMESPAN));
}

void fps_client_options_init(fps_client_options_t *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->deadline_seconds = 60.0;
  o->max_retries = 5;
  o->backoff_initial_seconds = 0.1;
  o->max_message_bytes = FPS_MESSAGE_BYTES_DEFAULT;
  o->push_chunk_bytes = FPS_PUSH_CHUNK_BYTES_DEFAULT;
}

static char *dup_str(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = fps_malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

static int options_check(const fps_client_options_t *o, fps_status_t *st) {
  if (!(o->deadline_seconds > 0 && o->deadline_seconds <= 86400.0))
    return fps__status_err(st, FPS_EINVAL, -1,
                           "deadline_seconds must be in (0, 86400], not %g", o->deadline_seconds);
  if (o->max_retries < 0 || o->max_retries > 100)
    return fps__status_err(st, FPS_EINVAL, -1,
                           "max_retries must be in [0, 100], not %d", o->max_retries);
  if (!(o->backoff_initial_seconds >= 0 && o->backoff_initial_seconds <= 60.0))
    return fps__status_err(st, FPS_EINVAL, -1,
                           "backoff_initial_seconds must be in [0, 60], not %g",
                           o->backoff_initial_seconds);
  /* gRPC sizes messages with int. */
  if (o->max_message_bytes < FPS__MIN_MESSAGE_BYTES || o->max_message_bytes > (1u << 30))
    return fps__status_err(st, FPS_EINVAL, -1,
                           "max_message_bytes must be in [64 KiB, 1 GiB], not %llu",
                           (unsigned long long)o->max_message_bytes);
  if (o->wire_dtype != 0 && o->wire_dtype != FPS_WIRE_F32 && o->wire_dtype != FPS_WIRE_BF16)
    return fps__status_err(st, FPS_EINVAL, -1,
                           "wire_dtype must be FPS_WIRE_F32 (1) or FPS_WIRE_BF16 (2), not %d",
                           o->wire_dtype);
  /* Refuse half a configuration rather than silently talk plaintext (or
   * without a certificate) to a shard the caller wants authenticated. */
  if (!o->tls_cert_file != !o->tls_key_file)
    return fps__status_err(st, FPS_EINVAL, -1,
                           "tls_cert_file and tls_key_file must be given together");
  if ((o->tls_cert_file || o->tls_server_name) && !o->tls_ca_file)
    return fps__status_err(st, FPS_EINVAL, -1,
                           "%s needs tls_ca_file (the CA that signed the shards' certificates)",
                           o->tls_cert_file ? "tls_cert_file" : "tls_server_name");
  if (o->tls_server_name && !o->tls_server_name[0])
    return fps__status_err(st, FPS_EINVAL, -1, "tls_server_name is empty");
  if (o->auth_token) {
    /* Visible ASCII only: an HTTP/2 header value, and no space that would
     * make "Bearer <token>" ambiguous. The token itself is never echoed. */
    size_t n = strlen(o->auth_token);
    if (n == 0)
      return fps__status_err(st, FPS_EINVAL, -1, "auth_token is empty");
    if (n > 4096)
      return fps__status_err(st, FPS_EINVAL, -1,
                             "auth_token is longer than 4096 bytes");
    for (size_t i = 0; i < n; i++)
      if (o->auth_token[i] < 0x21 || o->auth_token[i] > 0x7e)
        return fps__status_err(st, FPS_EINVAL, -1,
                               "auth_token may contain only visible ASCII characters (byte %zu "
                               "is not)",
                               i);
  }
  if (o->job_id) {
    size_t n = strlen(o->job_id);
    if (n == 0 || n > 64)
      return fps__status_err(st, FPS_EINVAL, -1, "job_id must be 1..64 bytes, not %zu", n);
    for (size_t i = 0; i < n; i++) {
      char ch = o->job_id[i];
      if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
            ch == '_' || ch == ':' || ch == '-'))
        return fps__status_err(st, FPS_EINVAL, -1,
                               "job_id may contain only [A-Za-z0-9._:-] (byte %zu is not)", i);
    }
  }
  return 0;
}

/* Reads a PEM file (at most 1 MiB) NUL-terminated into *out. */
static int read_pem(const char *path, const char *what, char **out, fps_status_t *st) {
  enum { PEM_MAX = 1 << 20 };
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t n = 0;
  *out = NULL;
  if (!f)
    return fps__status_err(st, FPS_EINVAL, -1, "%s '%s': %s", what, path,
                           strerror(errno));
  if (!(buf = fps_malloc(PEM_MAX + 1))) {
    fclose(f);
    return fps__status_err(st, FPS_ENOMEM, -1, "out of memory reading %s", what);
  }
  n = fread(buf, 1, PEM_MAX + 1, f);
  int bad = ferror(f);
  fclose(f);
  buf[n > PEM_MAX ? PEM_MAX : n] = 0;
  /* gRPC only looks at the files at the first handshake; catching an
   * obviously wrong file here gives the error a name. */
  const char *why = bad ? "read error" : n > PEM_MAX ? "larger than 1 MiB"
                      : strlen(buf) != n ? "contains a NUL byte"
                      : !strstr(buf, "-----BEGIN ") ? "not a PEM file" : NULL;
  if (why) {
    fps_free(buf);
    return fps__status_err(st, FPS_EINVAL, -1, "%s '%s': %s", what, path, why);
  }
  *out = buf;
  return 0;
}

/* Plaintext or TLS credentials from the options (checked already). */
static int make_credentials(const fps_client_options_t *o, grpc_channel_credentials **out,
                            fps_status_t *st) {
  char *ca = NULL, *cert = NULL, *key = NULL;
  int rc;
  *out = NULL;
  if (!o->tls_ca_file) {
    *out = grpc_insecure_credentials_create();
    return *out ? 0 : fps__status_err(st, FPS_ENOMEM, -1, "out of memory");
  }
  if ((rc = read_pem(o->tls_ca_file, "tls_ca_file", &ca, st))) goto done;
  if (o->tls_cert_file && (rc = read_pem(o->tls_cert_file, "tls_cert_file", &cert, st))) goto done;
  if (o->tls_key_file && (rc = read_pem(o->tls_key_file, "tls_key_file", &key, st))) goto done;
  grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
  /* gRPC copies the PEM text. */
  *out = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
  rc = *out ? 0 : fps__status_err(st, FPS_EINVAL, -1, "gRPC refused the TLS files");
done:
  fps_free(ca);
  fps_free(cert);
  if (key) {
    /* Do not leave the private key lying in freed heap memory. */
    volatile char *p = key;
    while (*p) *p++ = 0;
  }
  fps_free(key);
  return rc;
}

int fps__shard_conn_parse(fps__shard_conn_t *sc, size_t shard, const char *entry,
                          fps_status_t *st) {
  memset(sc, 0, sizeof *sc);
  size_t parts = 1;
  for (const char *p = entry; *p; p++) parts += *p == '|';
  if (parts > FPS_CLIENT_MAX_REPLICAS)
    return fps__status_err(st, FPS_EINVAL, (int)shard,
                           "shard %zu: address '%s' lists %zu replicas; at most %d", shard, entry,
                           parts, FPS_CLIENT_MAX_REPLICAS);
  const char *p = entry;
  for (size_t k = 0; k < parts; k++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    int rc = 0;
    if (len == 0) {
      rc = fps__status_err(st, FPS_EINVAL, (int)shard,
                           "shard %zu: address '%s' has an empty replica address (replica %zu)",
                           shard, entry, k);
    } else if (!(sc->r[k].addr = fps_strndup(p, len))) {
      rc = fps__status_err(st, FPS_ENOMEM, (int)shard, "out of memory");
    } else {
      /* The same process twice would make a failover go nowhere. */
      for (size_t j = 0; j < k && !rc; j++)
        if (!strcmp(sc->r[j].addr, sc->r[k].addr))
          rc = fps__status_err(st, FPS_EINVAL, (int)shard,
                               "shard %zu: address '%s' lists replica '%s' twice", shard, entry,
                               sc->r[k].addr);
    }
    if (rc) {
      for (size_t j = 0; j <= k && j < FPS_CLIENT_MAX_REPLICAS; j++) fps_free(sc->r[j].addr);
      memset(sc, 0, sizeof *sc);
      return rc;
    }
    sc->n = k + 1;
    p += len + 1;
  }
  atomic_init(&sc->current, 0);
  return 0;
}

/* Frees a shard's replica addresses and channels. */
static void shard_conn_free(fps__shard_conn_t *sc) {
  for (size_t k = 0; k < sc->n; k++) {
    if (sc->r[k].channel) grpc_channel_destroy(sc->r[k].channel);
    fps_free(sc->r[k].addr);
  }
  sc->n = 0;
}

fps_client_t *fps_client_create(const char *const *addrs, size_t n_shards,
                                const fps_client_options_t *opts, fps_status_t *status) {
  fps_client_options_t o;
  fps_client_t *c = NULL;
  int grpc_up = 0;

  if (opts)
    o = *opts;
  else
    fps_client_options_init(&o);
  if (!addrs || n_shards == 0 || n_shards > 65536) {
    fps__status_err(status, FPS_EINVAL, -1,
                    "need 1..65536 shard addresses, got %zu", addrs ? n_shards : 0);
    return NULL;
  }
  for (size_t i = 0; i < n_shards; i++) {
    if (!addrs[i] || !addrs[i][0]) {
      fps__status_err(status, FPS_EINVAL, (int)i, "shard %zu: empty address", i);
      return NULL;
    }
  }
  if (options_check(&o, status)) return NULL;

  c = fps_calloc(1, sizeof *c);
  if (!c) goto nomem;
  c->n_shards = n_shards;
  c->opts = o;
  c->opts.tls_ca_file = c->opts.tls_cert_file = c->opts.tls_key_file = NULL;
  c->opts.auth_token = c->opts.tls_server_name = c->opts.job_id = NULL;
  if (o.job_id) snprintf(c->job_id, sizeof c->job_id, "%s", o.job_id);
  c->tls = o.tls_ca_file != NULL;
  if (pthread_rwlock_init(&c->lock, NULL)) goto nomem_lock;
  if (pthread_mutex_init(&c->chan_mu, NULL)) {
    pthread_rwlock_destroy(&c->lock);
    goto nomem_lock;
  }
  if (o.auth_token) {
    size_t n = strlen(o.auth_token) + sizeof "Bearer ";
    c->auth_header = fps_malloc(n);
    if (!c->auth_header) goto nomem;
    snprintf(c->auth_header, n, "Bearer %s", o.auth_token);
  }
  c->addrs = fps_calloc(n_shards, sizeof *c->addrs);
  c->shards = fps_calloc(n_shards, sizeof *c->shards);
  if (!c->addrs || !c->shards) goto nomem;
  for (size_t i = 0; i < n_shards; i++) {
    if (!(c->addrs[i] = dup_str(addrs[i]))) goto nomem;
    if (fps__shard_conn_parse(&c->shards[i], i, addrs[i], status)) goto fail;
  }

  grpc_init();
  grpc_up = 1;
  {
    /* The receive limit must admit the shard's largest reply message,
     * which is up to FPS__SHARD_REPLY_BYTES whatever this client sends
     * (server/reply.c), so it is never below that; the send limit is the
     * caller's max_message_bytes. The slack covers framing. Reconnect backoff is kept short so the
     * client's own retry loop (not gRPC's default 1-120 s backoff) decides
     * how long an unreachable shard is tried. A local subchannel pool gives
     * each client its own connection, so W clients in one process (the load
     * generator's workers) do not share one TCP stream. */
    grpc_arg *args = c->chan_args;
    uint64_t recv = o.max_message_bytes > FPS__SHARD_REPLY_BYTES ? o.max_message_bytes : FPS__SHARD_REPLY_BYTES;
    int max_recv = (int)(recv + (1u << 20));
    int max_send = (int)(o.max_message_bytes + (1u << 20));
    args[0] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                         .value.integer = max_recv};
    args[1] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                         .value.integer = max_send};
    args[2] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                         .value.integer = 100};
    /* Despite its name this is the minimum connect timeout: the time a
     * TCP connect plus HTTP/2 handshake may take. 100 ms failed against a
     * busy (sanitizer-built) shard on a loaded 2-core machine. */
    args[3] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                         .value.integer = 5000};
    args[4] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                         .value.integer = 2000};
    args[5] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                         .key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL,
                         .value.integer = 1};
    /* The name the shards' certificates must carry, when it differs from
     * the host in the address (e.g. shards dialled by IP address). */
    args[6] = (grpc_arg){.type = GRPC_ARG_STRING,
                         .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                         .value.string = NULL};
    if (o.tls_server_name && !(c->server_name = dup_str(o.tls_server_name))) goto nomem;
    args[6].value.string = c->server_name;
    c->chan_ca = (grpc_channel_args){.num_args = o.tls_server_name ? 7 : 6, .args = args};
    if (make_credentials(&o, &c->creds, status)) goto fail;
    for (size_t i = 0; i < n_shards; i++)
      for (size_t k = 0; k < c->shards[i].n; k++) {
        fps__replica_t *r = &c->shards[i].r[k];
        if (!(r->channel = grpc_channel_create(r->addr, c->creds, &c->chan_ca))) {
          fps__status_err(status, FPS_EINVAL, (int)i,
                          "shard %zu: cannot create a channel to '%s'", i, r->addr);
          goto fail;
        }
      }
  }
  fps__status_ok(status);
  return c;

nomem_lock:
  fps_free(c);
  c = NULL;
nomem:
  fps__status_err(status, FPS_ENOMEM, -1, "out of memory creating the client");
fail:
  if (c) {
    if (c->shards)
      for (size_t i = 0; i < n_shards; i++) shard_conn_free(&c->shards[i]);
    if (c->addrs)
      for (size_t i = 0; i < n_shards; i++) fps_free(c->addrs[i]);
    fps_free(c->addrs);
    fps_free(c->shards);
    fps_free(c->server_name);
    if (c->creds) grpc_channel_credentials_release(c->creds);
    fps_free(c->auth_header);
    pthread_mutex_destroy(&c->chan_mu);
    pthread_rwlock_destroy(&c->lock);
    fps_free(c);
  }
  if (grpc_up) grpc_shutdown();
  return NULL;
}

/* How long a channel may fail before it is replaced: long enough that a
 * shard which is merely down is not hammered with new channels, short
 * against the seconds gRPC keeps a failed channel failing. */
#define FPS__CHANNEL_RENEW_SECONDS 0.25

grpc_connectivity_state fps__channel_state_locked(fps_client_t *c, int shard, int replica) {
  fps__replica_t *r = &c->shards[shard].r[replica];
  grpc_connectivity_state st = grpc_channel_check_connectivity_state(r->channel, 1);
  if (st != GRPC_CHANNEL_TRANSIENT_FAILURE) {
    r->failing_since = 0;
    return st;
  }
  double now = fps__now();
  if (r->failing_since == 0) {
    r->failing_since = now;
    return st;
  }
  if (now - r->failing_since < FPS__CHANNEL_RENEW_SECONDS) return st;
  /* Calls and connectivity watches on the old channel hold their own
   * references to it, so destroying it here is safe for them. */
  grpc_channel *fresh = grpc_channel_create(r->addr, c->creds, &c->chan_ca);
  if (!fresh) return st;
  grpc_channel_destroy(r->channel);
  r->channel = fresh;
  r->failing_since = 0;
  return grpc_channel_check_connectivity_state(fresh, 1);
}

void fps_client_destroy(fps_client_t *c) {
  if (!c) return;
  for (size_t i = 0; i < c->n_shards; i++) {
    shard_conn_free(&c->shards[i]);
    fps_free(c->addrs[i]);
  }
  fps_free(c->shards);
  fps_free(c->server_name);
  if (c->creds) grpc_channel_credentials_release(c->creds);
  fps_free(c->addrs);
  fps_free(c->auth_header);
  fps__tensor_list_free(&c->tensors);
  pthread_mutex_destroy(&c->chan_mu);
  pthread_rwlock_destroy(&c->lock);
  fps_free(c);
  grpc_shutdown();
}

size_t fps_client_shard_count(const fps_client_t *c) { return c ? c->n_shards : 0; }

int fps_client_shard_of(const fps_client_t *c, const char *name) {
  int shard = -1;
  if (!c || !name) return -1;
  pthread_rwlock_rdlock((pthread_rwlock_t *)&c->lock);
  const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, name);
  if (t) shard = t->shard;
  pthread_rwlock_unlock((pthread_rwlock_t *)&c->lock);
  return shard;
}

int fps_client_tensor_shape(const fps_client_t *c, const char *name, uint32_t *ndim,
                            uint64_t *shape) {
  int rc = -1;
  if (!c || !name) return -1;
  pthread_rwlock_rdlock((pthread_rwlock_t *)&c->lock);
  const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, name);
  if (t) {
    if (ndim) *ndim = t->ndim;
    if (shape) memcpy(shape, t->shape, sizeof t->shape);
    rc = 0;
  }
  pthread_rwlock_unlock((pthread_rwlock_t *)&c->lock);
  return rc;
}

int fps_client_tensor_blocks(const fps_client_t *c, const char *name, fps_block_t *blocks,
                             size_t cap) {
  int n = -1;
  if (!c || !name) return -1;
  if (!blocks) cap = 0; /* only the count, whatever cap says */
  pthread_rwlock_rdlock((pthread_rwlock_t *)&c->lock);
  const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, name);
  if (t) {
    const size_t nb = fps__block_count(t);
    const uint64_t C = fps__row_elems(t);
    for (size_t k = 0; k < nb && k < cap; k++) {
      const fps__block_t b = fps__block_at(t, k);
      blocks[k] = (fps_block_t){.tensor = (size_t)(t - c->tensors.t), .shard = b.shard,
                                .row_lo = b.row_lo, .row_hi = b.row_hi,
                                .bytes = (b.row_hi - b.row_lo) * C * 4};
    }
    n = (int)nb;
  }
  pthread_rwlock_unlock((pthread_rwlock_t *)&c->lock);
  return n;
}

/* The shard's security: TLS credentials and bearer tokens (see auth.h).
 *
 * OpenSSL parses the PEM files once at start-up only to give clear errors;
 * gRPC gets the PEM text itself and does the handshakes. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <grpc/support/alloc.h>

#include "auth.h"

#include "alloc.h"

#define FPS_AUTH_DIGEST 32 /* SHA-256 */

typedef struct fps_auth_token_s {
  unsigned char digest[FPS_AUTH_DIGEST]; /* SHA-256 of the token */
  unsigned roles;                        /* FPS_ROLE_* it grants */
  int64_t peer_shard;                    /* with FPS_ROLE_PEER; -1: any */
} fps_auth_token_t;

struct fps_auth_s {
  char *cert_pem;             /* --tls-cert, NULL: plaintext */
  char *key_pem;              /* --tls-key */
  char *client_ca_pem;        /* --tls-client-ca, NULL: no client certificates */
  bool cert_roles;            /* --tls-client-roles */
  fps_auth_token_t *token;    /* of every token file */
  size_t ntokens;             /* 0: no token check */
  size_t cap;                 /* token's capacity */
  char describe[96];
};

/* Last time (s, monotonic) a rejected call was logged: a client retrying a
 * wrong token in a loop must not flood the log. */
static atomic_int_fast64_t fps__auth_last_log_s;

/* Reads a whole file (at most FPS_AUTH_FILE_MAX bytes), NUL-terminated. */
int fps_auth_read_file(const char *flag, const char *path, char **out, size_t *len) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t n = 0;
  int rc = FPS_EIO;
  if (!f) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': %s", flag, path, strerror(errno));
    return FPS_EIO;
  }
  if (!(buf = fps_malloc(FPS_AUTH_FILE_MAX + 1))) {
    rc = FPS_ENOMEM;
    goto fail;
  }
  n = fread(buf, 1, FPS_AUTH_FILE_MAX + 1, f);
  if (ferror(f)) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': read error", flag, path);
    goto fail;
  }
  if (n > FPS_AUTH_FILE_MAX) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': larger than %u bytes", flag, path,
            FPS_AUTH_FILE_MAX);
    rc = FPS_EINVAL;
    goto fail;
  }
  buf[n] = 0;
  if (strlen(buf) != n) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': contains a NUL byte (not a PEM/text file)", flag,
            path);
    rc = FPS_EINVAL;
    goto fail;
  }
  fclose(f);
  *out = buf;
  if (len) *len = n;
  return 0;
fail:
  fclose(f);
  if (buf) OPENSSL_cleanse(buf, FPS_AUTH_FILE_MAX + 1); /* a secret read in part */
  fps_free(buf);
  return rc;
}

/* Secrets readable by others are worth a warning (not an error: a
 * container may run everything as one user on a private volume). */
void fps_auth_warn_mode(const char *flag, const char *path) {
  struct stat st;
  if (stat(path, &st) == 0 && (st.st_mode & 0077))
    FPS_LOG(FPS_LOG_WARN, "--%s '%s' is readable by group or others (mode %03o); chmod 600 it",
             flag, path, (unsigned)(st.st_mode & 0777));
}

/* Parses every certificate of a PEM bundle; returns the count (0: none or
 * junk) and the first one in *first (caller frees) if first is non-NULL. */
static int fps__auth_certs(const char *pem, X509 **first) {
  BIO *b = BIO_new_mem_buf(pem, -1);
  int n = 0;
  if (first) *first = NULL;
  if (!b) return 0;
  for (;;) {
    X509 *x = PEM_read_bio_X509(b, NULL, NULL, NULL);
    if (!x) break;
    if (n == 0 && first) *first = x;
    else X509_free(x);
    n++;
  }
  BIO_free(b);
  return n;
}

static int fps__auth_check_dates(const char *flag, const char *path, X509 *x) {
  if (X509_cmp_current_time(X509_get0_notAfter(x)) < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': the certificate has expired", flag, path);
    return FPS_EINVAL;
  }
  if (X509_cmp_current_time(X509_get0_notBefore(x)) > 0) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': the certificate is not valid yet", flag, path);
    return FPS_EINVAL;
  }
  return 0;
}

int fps_auth_check_pair(const char *cert_flag, const char *cert_path, const char *cert_pem,
                        const char *key_flag, const char *key_path, const char *key_pem) {
  X509 *cert = NULL;
  EVP_PKEY *key = NULL;
  BIO *b = NULL;
  int rc = FPS_EINVAL;
  if (fps__auth_certs(cert_pem, &cert) == 0) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': no PEM certificate in it", cert_flag, cert_path);
    goto fail;
  }
  if ((rc = fps__auth_check_dates(cert_flag, cert_path, cert)) < 0) goto fail;
  rc = FPS_EINVAL;
  if (!(b = BIO_new_mem_buf(key_pem, -1)) || !(key = PEM_read_bio_PrivateKey(b, NULL, NULL, NULL))) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s': no unencrypted PEM private key in it", key_flag, key_path);
    goto fail;
  }
  if (X509_check_private_key(cert, key) != 1) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s' does not belong to --%s '%s'", key_flag, key_path, cert_flag,
            cert_path);
    goto fail;
  }
  rc = 0;
fail:
  X509_free(cert);
  EVP_PKEY_free(key);
  BIO_free(b);
  return rc;
}

int fps_auth_check_ca(const char *flag, const char *path, const char *pem) {
  if (fps__auth_certs(pem, NULL) > 0) return 0;
  FPS_LOG(FPS_LOG_ERROR, "--%s '%s': no PEM certificate in it", flag, path);
  return FPS_EINVAL;
}

static int fps__auth_tls_load(fps_auth_t *a, const fps_config_t *cfg) {
  int rc;
  if ((rc = fps_auth_read_file("tls-cert", cfg->tls_cert, &a->cert_pem, NULL)) < 0) return rc;
  if ((rc = fps_auth_read_file("tls-key", cfg->tls_key, &a->key_pem, NULL)) < 0) return rc;
  fps_auth_warn_mode("tls-key", cfg->tls_key);
  if ((rc = fps_auth_check_pair("tls-cert", cfg->tls_cert, a->cert_pem, "tls-key", cfg->tls_key, a->key_pem)) < 0)
    return rc;
  if (*cfg->tls_client_ca) {
    if ((rc = fps_auth_read_file("tls-client-ca", cfg->tls_client_ca, &a->client_ca_pem, NULL)) < 0) return rc;
    if ((rc = fps_auth_check_ca("tls-client-ca", cfg->tls_client_ca, a->client_ca_pem)) < 0) return rc;
  }
  return 0;
}

static int fps__auth_digest(const char *s, size_t n, unsigned char out[FPS_AUTH_DIGEST]) {
  unsigned int len = 0;
  if (EVP_Digest(s, n, out, &len, EVP_sha256(), NULL) != 1 || len != FPS_AUTH_DIGEST) return FPS_EIO;
  return 0;
}

int fps_auth_token_next(char **cursor, int *lineno, const char *flag, const char *path,
                        const char **tok, size_t *n_out) {
  for (char *line = *cursor, *next; line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = 0;
    *cursor = next;
    ++*lineno;
    size_t n = strlen(line);
    while (n > 0 && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) line[--n] = 0;
    while (*line == ' ' || *line == '\t') line++, n--;
    if (n == 0 || *line == '#') continue;
    for (size_t i = 0; i < n; i++) {
      if (line[i] < 0x21 || line[i] > 0x7e) {
        FPS_LOG(FPS_LOG_ERROR,
                "--%s '%s' line %d: a token may contain only visible ASCII "
                "characters (no spaces)",
                flag, path, *lineno);
        return FPS_EINVAL;
      }
    }
    *tok = line;
    *n_out = n;
    return 1;
  }
  *cursor = NULL;
  return 0;
}

/* One token per line; blank lines and lines starting with '#' are skipped,
 * so a file can hold the old and the new token while clients rotate. Each
 * gets `roles`; with `peers` (--exchange-token-file) a line is
 * "<shard-id>:<token>" and the token may speak only for that shard. */
static int fps__auth_tokens_load(fps_auth_t *a, const char *flag, const char *path, unsigned roles, bool peers,
                                 uint32_t shard_count) {
  char *text = NULL;
  size_t text_len = 0, nfile = 0, max = peers ? FPS_AUTH_PEER_TOKENS_MAX : FPS_AUTH_TOKENS_MAX;
  int rc = fps_auth_read_file(flag, path, &text, &text_len);
  if (rc < 0) return rc;
  fps_auth_warn_mode(flag, path);
  rc = FPS_ENOMEM;
  fps_auth_token_t *grown = fps_realloc(a->token, (a->ntokens + max) * sizeof *grown);
  if (!grown) goto fail;
  a->token = grown;
  a->cap = a->ntokens + max;
  int lineno = 0;
  char *cursor = text;
  const char *line;
  size_t n;
  while ((rc = fps_auth_token_next(&cursor, &lineno, flag, path, &line, &n)) == 1) {
    int64_t peer = -1;
    if (peers) {
      /* "<shard-id>:<token>": the id in decimal, below --shard-count. */
      const char *colon = memchr(line, ':', n);
      char *end = NULL;
      unsigned long id = colon && colon > line && line[0] >= '0' && line[0] <= '9' ? strtoul(line, &end, 10) : 0;
      if (!colon || end != colon || id >= shard_count || colon + 1 == line + n) {
        FPS_LOG(FPS_LOG_ERROR,
                "--%s '%s' line %d: expected '<shard-id>:<token>' with a shard id "
                "below --shard-count %u",
                flag, path, lineno, shard_count);
        rc = FPS_EINVAL;
        goto fail;
      }
      peer = (int64_t)id;
      n -= (size_t)(colon + 1 - line);
      line = colon + 1;
    }
    if (n < 16)
      FPS_LOG(FPS_LOG_WARN, "--%s '%s' line %d: token shorter than 16 characters is easy to guess", flag, path,
               lineno);
    if (nfile == max) {
      FPS_LOG(FPS_LOG_ERROR, "--%s '%s': more than %zu tokens", flag, path, max);
      rc = FPS_EINVAL;
      goto fail;
    }
    fps_auth_token_t *t = &a->token[a->ntokens];
    if ((rc = fps__auth_digest(line, n, t->digest)) < 0) goto fail;
    t->roles = roles;
    t->peer_shard = peer;
    a->ntokens++;
    nfile++;
  }
  if (rc < 0) goto fail;
  rc = FPS_EINVAL;
  if (nfile == 0) {
    FPS_LOG(FPS_LOG_ERROR, "--%s '%s' holds no token", flag, path);
    goto fail;
  }
  rc = 0;
fail:
  /* The plaintext tokens do not outlive start-up. */
  /* text_len: the lines were cut in place, so strlen would stop at the
   * first one. */
  if (text) OPENSSL_cleanse(text, text_len);
  fps_free(text);
  return rc;
}

int fps_auth_create(const fps_config_t *cfg, fps_auth_t **out) {
  fps_auth_t *a = fps_calloc(1, sizeof *a);
  int rc = FPS_EINVAL;
  *out = NULL;
  if (!a) return FPS_ENOMEM;
  bool cert = *cfg->tls_cert, key = *cfg->tls_key, ca = *cfg->tls_client_ca;
  if (cert != key) {
    FPS_LOG(FPS_LOG_ERROR, "--tls-cert and --tls-key must be given together");
    goto fail;
  }
  if (ca && !cert) {
    FPS_LOG(FPS_LOG_ERROR, "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS "
                           "is TLS first)");
    goto fail;
  }
  if (cfg->tls_client_roles && !ca) {
    FPS_LOG(FPS_LOG_ERROR, "--tls-client-roles needs --tls-client-ca (roles come from the client "
                           "certificates it verifies)");
    goto fail;
  }
  a->cert_roles = cfg->tls_client_roles;
  if (cert && (rc = fps__auth_tls_load(a, cfg)) < 0) goto fail;
  /* The worker tokens keep every role no other file takes from them. */
  bool admins = *cfg->admin_token_file, peers = *cfg->exchange_token_file;
  unsigned worker_roles = FPS_ROLE_WORKER | (admins ? 0 : FPS_ROLE_ADMIN) | (peers ? 0 : FPS_ROLE_PEER);
  if ((admins || peers) && !*cfg->auth_token_file) {
    FPS_LOG(FPS_LOG_ERROR, "--%s needs --auth-token-file (the workers' tokens): without it "
                           "every call is let in and roles mean nothing",
            admins ? "admin-token-file" : "exchange-token-file");
    rc = FPS_EINVAL;
    goto fail;
  }
  if (*cfg->auth_token_file &&
      (rc = fps__auth_tokens_load(a, "auth-token-file", cfg->auth_token_file, worker_roles, false, 0)) < 0)
    goto fail;
  if (admins && (rc = fps__auth_tokens_load(a, "admin-token-file", cfg->admin_token_file,
                                            FPS_ROLE_WORKER | FPS_ROLE_ADMIN, false, 0)) < 0)
    goto fail;
  if (peers && (rc = fps__auth_tokens_load(a, "exchange-token-file", cfg->exchange_token_file, FPS_ROLE_PEER,
                                           true, cfg->shard_count)) < 0)
    goto fail;
  if (a->ntokens && !cert)
    FPS_LOG(FPS_LOG_WARN, "--auth-token-file without --tls-cert: tokens travel in plaintext and "
             "anyone on the path can read and replay them");
  snprintf(a->describe, sizeof a->describe, "%s%s%s",
           !cert ? "plaintext" : a->cert_roles ? "mutual TLS, roles from certificates" : ca ? "mutual TLS" : "TLS",
           a->ntokens ? ", bearer tokens" : "",
           !a->ntokens ? "" : admins && peers ? " (worker, admin, peer)" : admins ? " (worker, admin; workers are peers)"
                             : peers ? " (worker, peer; workers are admins)" : " (one role: every token may do everything)");
  *out = a;
  return 0;
fail:
  fps_auth_destroy(a);
  return rc;
}

void fps_auth_destroy(fps_auth_t *a) {
  if (!a) return;
  if (a->key_pem) OPENSSL_cleanse(a->key_pem, strlen(a->key_pem));
  fps_free(a->cert_pem);
  fps_free(a->key_pem);
  fps_free(a->client_ca_pem);
  fps_free(a->token);
  fps_free(a);
}

grpc_server_credentials *fps_auth_server_credentials(const fps_auth_t *a) {
  if (!a->cert_pem) return grpc_insecure_server_credentials_create();
  grpc_ssl_pem_key_cert_pair pair = {.private_key = a->key_pem, .cert_chain = a->cert_pem};
  /* With a client CA, a client without a certificate, or with one the CA
   * did not sign (or an expired one), fails the handshake: it never gets
   * as far as a call. */
  return grpc_ssl_server_credentials_create_ex(
      a->client_ca_pem, &pair, 1,
      a->client_ca_pem ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                       : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
      NULL);
}

static bool fps__slice_eq_ci(grpc_slice s, const char *lit) {
  size_t n = strlen(lit);
  if (GRPC_SLICE_LENGTH(s) != n) return false;
  const unsigned char *p = GRPC_SLICE_START_PTR(s);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = p[i];
    if (c >= 'A' && c <= 'Z') c = (unsigned char)(c + 32);
    if (c != (unsigned char)lit[i]) return false;
  }
  return true;
}

int fps_auth_check(const fps_auth_t *a, const grpc_metadata_array *md, fps_ident_t *id, char *why,
                   size_t why_len) {
  id->roles = 0;
  id->peer_shard = -1;
  if (!a || a->ntokens == 0) {
    id->roles = FPS_ROLE_ALL;
    return 0;
  }
  const grpc_metadata *found = NULL;
  size_t count = 0;
  for (size_t i = 0; i < md->count; i++) {
    if (fps__slice_eq_ci(md->metadata[i].key, "authorization")) {
      found = &md->metadata[i];
      count++;
    }
  }
  if (count == 0) {
    snprintf(why, why_len, "this shard requires a bearer token: send metadata 'authorization: "
                           "Bearer <token>'");
    return FPS_EAUTH;
  }
  if (count > 1) {
    snprintf(why, why_len, "more than one 'authorization' metadata entry");
    return FPS_EAUTH;
  }
  const char *v = (const char *)GRPC_SLICE_START_PTR(found->value);
  size_t n = GRPC_SLICE_LENGTH(found->value);
  static const char scheme[] = "bearer ";
  size_t sl = sizeof scheme - 1;
  bool bearer = n > sl;
  for (size_t i = 0; bearer && i < sl; i++) {
    char c = v[i];
    if (c >= 'A' && c <= 'Z') c = (char)(c + 32);
    bearer = c == scheme[i];
  }
  if (!bearer) {
    snprintf(why, why_len, "the 'authorization' metadata must be 'Bearer <token>'");
    return FPS_EAUTH;
  }
  /* Both sides hashed to 32 bytes: the comparison takes the same time
   * whatever the guess's length or how many leading bytes match. */
  unsigned char d[FPS_AUTH_DIGEST];
  if (fps__auth_digest(v + sl, n - sl, d) < 0) {
    snprintf(why, why_len, "cannot hash the bearer token");
    return FPS_EAUTH;
  }
  /* Every token compared (no early exit); the roles of all that match. */
  unsigned roles = 0;
  int64_t peer = -1;
  for (size_t i = 0; i < a->ntokens; i++) {
    const fps_auth_token_t *t = &a->token[i];
    unsigned mask = 0u - (unsigned)(CRYPTO_memcmp(d, t->digest, sizeof d) == 0);
    roles |= t->roles & mask;
    if (mask && t->peer_shard >= 0) peer = t->peer_shard;
  }
  if (roles) {
    id->roles = roles;
    id->peer_shard = peer;
    return 0;
  }
  snprintf(why, why_len, "the bearer token is not valid for this shard");
  return FPS_EAUTH;
}

void fps_auth_cert_roles_add(fps_cert_roles_t *cr, const char *v, size_t n) {
  static const char pre[] = "urn:factorps:";
  size_t pl = sizeof pre - 1;
  if (n <= pl || memcmp(v, pre, pl) != 0) return;
  v += pl;
  n -= pl;
  if (n == 6 && memcmp(v, "worker", 6) == 0) {
    cr->roles |= FPS_ROLE_WORKER;
    return;
  }
  if (n == 5 && memcmp(v, "admin", 5) == 0) {
    cr->roles |= FPS_ROLE_WORKER | FPS_ROLE_ADMIN;
    return;
  }
  if (n < 6 || n > 5 + 10 || memcmp(v, "peer:", 5) != 0) return;
  int64_t id = 0;
  for (size_t i = 5; i < n; i++) {
    if (v[i] < '0' || v[i] > '9') return;
    id = id * 10 + (v[i] - '0');
  }
  if (id > UINT32_MAX) return;
  /* A certificate that speaks for two shards speaks for neither. */
  if (cr->roles & FPS_ROLE_PEER && cr->shard != id) cr->two_shards = true;
  cr->roles |= FPS_ROLE_PEER;
  cr->shard = id;
}

int fps_auth_cert_roles_apply(const fps_cert_roles_t *cr, fps_ident_t *id, char *why, size_t why_len) {
  unsigned roles = cr->roles & ~(cr->two_shards ? FPS_ROLE_PEER : 0u);
  if (!roles) {
    id->roles = 0;
    snprintf(why, why_len, "the client certificate names no factorps role (a URI SAN "
                           "urn:factorps:worker, urn:factorps:admin or urn:factorps:peer:<shard-id>)");
    return FPS_EPERM;
  }
  /* The call keeps what both its token and its certificate grant. */
  id->roles &= roles;
  if (roles & FPS_ROLE_PEER) {
    if (id->peer_shard >= 0 && id->peer_shard != cr->shard) id->roles &= ~FPS_ROLE_PEER;
    id->peer_shard = cr->shard;
  }
  return 0;
}

int fps_auth_cert_limit(const fps_auth_t *a, grpc_call *call, fps_ident_t *id, char *why, size_t why_len) {
  if (!a || !a->cert_roles) return 0;
  fps_cert_roles_t cr = {.roles = 0, .shard = -1, .two_shards = false};
  grpc_auth_context *ctx = grpc_call_auth_context(call);
  if (ctx) {
    /* gRPC lists URI SANs under both names; the same URI twice is harmless. */
    const char *names[] = {GRPC_PEER_URI_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME};
    for (size_t k = 0; k < 2; k++) {
      grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ctx, names[k]);
      const grpc_auth_property *p;
      while ((p = grpc_auth_property_iterator_next(&it))) fps_auth_cert_roles_add(&cr, p->value, p->value_length);
    }
    grpc_auth_context_release(ctx);
  }
  return fps_auth_cert_roles_apply(&cr, id, why, why_len);
}

void fps_auth_call_ident(const fps_call_t *c, fps_ident_t *id) {
  char why[256];
  if (fps_auth_check(c->srv->auth, &c->md, id, why, sizeof why) < 0 ||
      fps_auth_cert_limit(c->srv->auth, c->call, id, why, sizeof why) < 0)
    id->roles = 0;
}

const char *fps_auth_role_name(unsigned role) {
  switch (role) {
    case FPS_ROLE_WORKER: return "worker";
    case FPS_ROLE_ADMIN: return "admin";
    case FPS_ROLE_PEER: return "peer";
    default: return "other";
  }
}

int fps_auth_allow(const fps_ident_t *id, unsigned need, const char *what, char *why, size_t why_len) {
  if ((id->roles & need) == need) return 0;
  snprintf(why, why_len, "%s needs the %s role: this call's token does not grant it", what,
           fps_auth_role_name(need & ~id->roles));
  return FPS_EPERM;
}

void fps__auth_log_refusal(grpc_call *call, const char *method, const char *why) {
  int64_t now = fps_now_ns() / 1000000000;
  int64_t last = atomic_load(&fps__auth_last_log_s);
  if (now == last || !atomic_compare_exchange_strong(&fps__auth_last_log_s, &last, now)) return;
  char *peer = grpc_call_get_peer(call);
  FPS_LOG(FPS_LOG_WARN, "%s from %s refused: %s (further refusals this second not logged)", method,
           peer ? peer : "?", why);
  gpr_free(peer);
}

const char *fps_auth_describe(const fps_auth_t *a) { return a ? a->describe : "plaintext"; }

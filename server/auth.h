/* The shard's security: TLS server credentials (optionally requiring and
 * verifying client certificates) and bearer tokens checked on every call,
 * each token granting roles:
 *
 *   worker  Create (without replace), PushPull, Pull, GetState, Stats;
 *   admin   what a worker may, plus Create's replace and Checkpoint
 *           (which prunes old files): anything that overwrites history;
 *   peer    Exchange, only as the shard its token names (from_shard).
 *
 * --auth-token-file lists worker tokens. --admin-token-file and
 * --exchange-token-file each take their role away from them: while one is
 * not given, the worker tokens hold that role too, so one token still runs
 * a one-machine job (and a job of several shards that trust each other).
 *
 * Everything that can be wrong with the files (missing, unreadable, not
 * PEM, a key that does not match its certificate, an expired certificate,
 * an empty token file) is found at start-up with a message naming the flag
 * and the file, instead of as failed handshakes later. */
#ifndef FPS_SERVER_AUTH_H
#define FPS_SERVER_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/status.h>

#include "server.h"

typedef struct fps_auth_s fps_auth_t;

/* Largest file read for a certificate, key, CA bundle or token list. */
#define FPS_AUTH_FILE_MAX (1u << 20)
/* Most tokens one --auth-token-file or --admin-token-file may list (one
 * per line), and one --exchange-token-file (one per peer shard). */
#define FPS_AUTH_TOKENS_MAX 64
#define FPS_AUTH_PEER_TOKENS_MAX 4096

/* Roles (bits of fps_ident_t.roles). */
#define FPS_ROLE_WORKER 1u
#define FPS_ROLE_ADMIN 2u
#define FPS_ROLE_PEER 4u
#define FPS_ROLE_ALL (FPS_ROLE_WORKER | FPS_ROLE_ADMIN | FPS_ROLE_PEER)

/* Who a call's credential says the caller is. */
typedef struct fps_ident_s {
  unsigned roles;             /* FPS_ROLE_* bits */
  int64_t peer_shard;         /* with FPS_ROLE_PEER: the shard it may speak for; -1: any */
} fps_ident_t;

/* Loads and checks --tls-cert, --tls-key, --tls-client-ca,
 * --auth-token-file, --admin-token-file and --exchange-token-file (its
 * lines "<shard-id>:<token>", ids below --shard-count). Returns 0 and *out (free with fps_auth_destroy), or
 * FPS_EINVAL / FPS_EIO / FPS_ENOMEM after printing the problem to stderr.
 * Flags that are empty switch their feature off. */
int fps_auth_create(const fps_config_t *cfg, fps_auth_t **out);
/* NULL is a no-op. REQUIRES: no call is being checked any more. */
void fps_auth_destroy(fps_auth_t *a);

/* The file helpers, shared with the calling side of Exchange (peer.c).
 * read_file: the whole file (at most FPS_AUTH_FILE_MAX bytes, no NUL),
 * NUL-terminated, into *out (fps_free it); errors name --flag and path.
 * warn_mode: logs a warning if others can read a secret.
 * check_pair: a certificate chain and the unencrypted key that belongs to
 * its first certificate, which is within its validity dates.
 * check_ca: at least one PEM certificate. All print the problem to stderr
 * and return FPS_EIO / FPS_EINVAL / FPS_ENOMEM. */
int fps_auth_read_file(const char *flag, const char *path, char **out, size_t *len);
void fps_auth_warn_mode(const char *flag, const char *path);
int fps_auth_check_pair(const char *cert_flag, const char *cert_path, const char *cert_pem,
                        const char *key_flag, const char *key_path, const char *key_pem);
int fps_auth_check_ca(const char *flag, const char *path, const char *pem);
/* The next token of a token file's text (read_file's), one per line;
 * blank lines and lines starting with '#' are skipped, surrounding blanks
 * trimmed. *cursor walks the text (start it at the text; the lines are
 * cut in place), *lineno counts lines (start it at 0). Returns 1 with
 * *tok / *n set (NUL-terminated in the text), 0 at the end, or FPS_EINVAL
 * after printing why (naming --flag, path and the line) for a token with
 * anything but visible ASCII: what an HTTP/2 header value carries
 * unchanged, and no space that would split "Bearer <token>". */
int fps_auth_token_next(char **cursor, int *lineno, const char *flag, const char *path,
                        const char **tok, size_t *n);

/* New server credentials for grpc_server_add_http2_port(): TLS (with
 * client certificates required and verified when --tls-client-ca is set) or
 * plaintext. Caller releases them. NULL on OOM. */
grpc_server_credentials *fps_auth_server_credentials(const fps_auth_t *a);

/* Checks a call's request metadata for "authorization: Bearer <token>"
 * when tokens are configured, and says in *id what it may do (everything,
 * with no tokens configured). Returns 0, or FPS_EAUTH (UNAUTHENTICATED
 * on the wire) with the reason in why (never the token).
 * Each token is compared as a SHA-256 digest with CRYPTO_memcmp, against
 * every configured token, so neither the time taken nor an early exit tells
 * how much of a guess was right or how long the token is. Thread-safe. */
int fps_auth_check(const fps_auth_t *a, const grpc_metadata_array *md, fps_ident_t *id, char *why,
                   size_t why_len);

/* With --tls-client-roles: narrows *id (fps_auth_check's) to the roles
 * the call's client certificate names in its URI SANs
 * (urn:factorps:worker; urn:factorps:admin, which includes worker;
 * urn:factorps:peer:<shard-id>, which also fixes the shard it speaks for:
 * a peer token of another shard then loses the peer role). Returns 0
 * (also without the flag), or FPS_EPERM with why for a certificate that
 * names no role. Thread-safe. */
int fps_auth_cert_limit(const fps_auth_t *a, grpc_call *call, fps_ident_t *id, char *why, size_t why_len);
/* Its two steps, for the tests: the roles a certificate's URI SANs name,
 * gathered one SAN at a time (start from {0, -1, false}; other URIs are
 * ignored), then applied to *id (0, or FPS_EPERM when none is named). */
typedef struct fps_cert_roles_s {
  unsigned roles;   /* FPS_ROLE_* bits named */
  int64_t shard;    /* the peer URI's shard id, -1: none */
  bool two_shards;  /* peer URIs of two shards: no peer role */
} fps_cert_roles_t;
void fps_auth_cert_roles_add(fps_cert_roles_t *cr, const char *v, size_t n);
int fps_auth_cert_roles_apply(const fps_cert_roles_t *cr, fps_ident_t *id, char *why, size_t why_len);

/* Whether id holds every role of `need` (FPS_ROLE_* bits): 0, or
 * FPS_EPERM (PERMISSION_DENIED) with why saying which role `what` needs. */
int fps_auth_allow(const fps_ident_t *id, unsigned need, const char *what, char *why, size_t why_len);

/* The identity of an admitted call, from its metadata again: for the
 * handlers whose rule depends on the request (Create's replace, Exchange's
 * from_shard). */
void fps_auth_call_ident(const fps_call_t *c, fps_ident_t *id);

/* "worker", "admin", ...: the roles that name a set of bits, for messages. */
const char *fps_auth_role_name(unsigned role);

/* Logs a refused call (peer, method, reason) at most once a second, so a
 * client retrying in a loop cannot flood the log. Thread-safe. */
void fps__auth_log_refusal(grpc_call *call, const char *method, const char *why);

/* "plaintext", "TLS" or "mutual TLS", plus ", bearer tokens" if set. */
const char *fps_auth_describe(const fps_auth_t *a);

#endif

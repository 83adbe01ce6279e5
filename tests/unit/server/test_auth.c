/* server/auth.c: TLS files and bearer tokens checked at start-up, and the
 * token check every call goes through. Certificates come from the
 * security tests' own generator (tests/security/gencerts.sh, the openssl
 * command-line tool), made once into a temporary directory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <grpc/grpc.h>

#include "alloc.h"
#include "auth.h"
#include "error.h"

static char dir[256];

static const char *path(const char *name) {
  static char buf[64][512];
  static int k;
  k = (k + 1) % 64;
  snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
  return buf[k];
}

static void write_file(const char *name, const void *data, size_t n) {
  FILE *f = fopen(path(name), "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

static char *read_token(const char *name) {
  static char tok[2][128];
  static int k;
  k = (k + 1) % 2;
  FILE *f = fopen(path(name), "r");
  assert_non_null(f);
  assert_non_null(fgets(tok[k], sizeof tok[k], f));
  fclose(f);
  tok[k][strcspn(tok[k], "\n")] = '\0';
  return tok[k];
}

/* Runs f with stderr captured into err (the messages a refusal prints). */
#define CAPTURE(err, expr)                              \
  ({                                                    \
    fflush(stderr);                                     \
    FILE *tmp_ = tmpfile();                             \
    int saved_ = dup(2);                                \
    dup2(fileno(tmp_), 2);                              \
    __typeof__(expr) r_ = (expr);                       \
    fflush(stderr);                                     \
    dup2(saved_, 2);                                    \
    close(saved_);                                      \
    rewind(tmp_);                                       \
    size_t n_ = fread((err), 1, sizeof(err) - 1, tmp_); \
    (err)[n_] = '\0';                                   \
    fclose(tmp_);                                       \
    r_;                                                 \
  })

static int setup(void **state) {
  (void)state;
  const char *gencerts = getenv("FPS_GENCERTS");
  if (!gencerts) return -1;
  snprintf(dir, sizeof dir, "%s/fps-auth-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(dir)) return -1;
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "sh '%s' '%s' >/dev/null 2>&1", gencerts, dir);
  if (system(cmd) != 0) return -1;
  grpc_init();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  grpc_shutdown();
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

static fps_config_t config(const char *cert, const char *key, const char *ca, const char *tokens) {
  fps_config_t c;
  memset(&c, 0, sizeof c);
  c.tls_cert = (char *)(cert ? path(cert) : "");
  c.tls_key = (char *)(key ? path(key) : "");
  c.tls_client_ca = (char *)(ca ? path(ca) : "");
  c.auth_token_file = (char *)(tokens ? path(tokens) : "");
  c.admin_token_file = (char *)"";
  c.exchange_token_file = (char *)"";
  c.shard_count = 1;
  return c;
}

static void read_file_refusals(void **state) {
  (void)state;
  char err[2048];
  char *text = NULL;
  size_t len = 0;
  assert_int_equal(CAPTURE(err, fps_auth_read_file("tls-cert", path("nope.pem"), &text, &len)), FPS_EIO);
  assert_non_null(strstr(err, "--tls-cert"));
  assert_non_null(strstr(err, "nope.pem"));
  write_file("nul.pem", "ab\0cd", 5);
  assert_int_equal(CAPTURE(err, fps_auth_read_file("tls-key", path("nul.pem"), &text, &len)), FPS_EINVAL);
  assert_non_null(strstr(err, "NUL"));
  char *big = malloc(FPS_AUTH_FILE_MAX + 1);
  memset(big, 'x', FPS_AUTH_FILE_MAX + 1);
  write_file("big.pem", big, FPS_AUTH_FILE_MAX + 1);
  free(big);
  assert_int_equal(CAPTURE(err, fps_auth_read_file("tls-client-ca", path("big.pem"), &text, &len)), FPS_EINVAL);
  assert_non_null(strstr(err, "larger than"));
  assert_int_equal(fps_auth_read_file("tls-cert", path("ca.pem"), &text, &len), 0);
  assert_int_equal(strlen(text), len);
  assert_non_null(strstr(text, "BEGIN CERTIFICATE"));
  fps_free(text);
}

static void pair_and_ca_checks(void **state) {
  (void)state;
  char err[2048];
  char *cert, *key, *ckey, *ecert, *ekey, *tok;
  assert_int_equal(fps_auth_read_file("c", path("server.pem"), &cert, NULL), 0);
  assert_int_equal(fps_auth_read_file("k", path("server.key"), &key, NULL), 0);
  assert_int_equal(fps_auth_read_file("k", path("client.key"), &ckey, NULL), 0);
  assert_int_equal(fps_auth_read_file("c", path("expired.pem"), &ecert, NULL), 0);
  assert_int_equal(fps_auth_read_file("k", path("expired.key"), &ekey, NULL), 0);
  assert_int_equal(fps_auth_read_file("t", path("token"), &tok, NULL), 0);
  assert_int_equal(fps_auth_check_pair("tls-cert", "s.pem", cert, "tls-key", "s.key", key), 0);
  assert_int_equal(CAPTURE(err, fps_auth_check_pair("tls-cert", "s.pem", cert, "tls-key", "c.key", ckey)),
                   FPS_EINVAL);
  assert_non_null(strstr(err, "--tls-key 'c.key' does not belong to --tls-cert 's.pem'"));
  assert_int_equal(CAPTURE(err, fps_auth_check_pair("tls-cert", "e.pem", ecert, "tls-key", "e.key", ekey)),
                   FPS_EINVAL);
  assert_non_null(strstr(err, "expired"));
  assert_int_equal(CAPTURE(err, fps_auth_check_pair("tls-cert", "t", tok, "tls-key", "s.key", key)), FPS_EINVAL);
  assert_non_null(strstr(err, "no PEM certificate"));
  assert_int_equal(CAPTURE(err, fps_auth_check_pair("tls-cert", "s.pem", cert, "tls-key", "t", tok)), FPS_EINVAL);
  assert_non_null(strstr(err, "no unencrypted PEM private key"));
  assert_int_equal(fps_auth_check_ca("tls-client-ca", "s.pem", cert), 0);
  assert_int_equal(CAPTURE(err, fps_auth_check_ca("tls-client-ca", "t", tok)), FPS_EINVAL);
  assert_non_null(strstr(err, "--tls-client-ca 't'"));
  fps_free(cert);
  fps_free(key);
  fps_free(ckey);
  fps_free(ecert);
  fps_free(ekey);
  fps_free(tok);
}

static void token_lines(void **state) {
  (void)state;
  char text[] = "# comment\r\n\n  abc  \r\n\t#x\ndef\nlast";
  char *cursor = text;
  int line = 0;
  const char *tok;
  size_t n;
  assert_int_equal(fps_auth_token_next(&cursor, &line, "f", "p", &tok, &n), 1);
  assert_int_equal(n, 3);
  assert_string_equal(tok, "abc");
  assert_int_equal(line, 3);
  assert_int_equal(fps_auth_token_next(&cursor, &line, "f", "p", &tok, &n), 1);
  assert_string_equal(tok, "def");
  assert_int_equal(fps_auth_token_next(&cursor, &line, "f", "p", &tok, &n), 1);
  assert_string_equal(tok, "last");
  assert_int_equal(line, 6);
  assert_int_equal(fps_auth_token_next(&cursor, &line, "f", "p", &tok, &n), 0);
  assert_null(cursor);
  /* A space inside, or a byte outside visible ASCII: refused, naming the line. */
  char err[1024];
  char spaced[] = "ok\nab cd\n";
  cursor = spaced;
  line = 0;
  assert_int_equal(fps_auth_token_next(&cursor, &line, "auth-token-file", "t.txt", &tok, &n), 1);
  assert_int_equal(CAPTURE(err, fps_auth_token_next(&cursor, &line, "auth-token-file", "t.txt", &tok, &n)),
                   FPS_EINVAL);
  assert_non_null(strstr(err, "--auth-token-file 't.txt' line 2"));
  char high[] = "caf\xc3\xa9";
  cursor = high;
  line = 0;
  assert_int_equal(CAPTURE(err, fps_auth_token_next(&cursor, &line, "f", "p", &tok, &n)), FPS_EINVAL);
}

static void create_describes_and_refuses(void **state) {
  (void)state;
  char err[4096];
  fps_auth_t *a = NULL;
  fps_config_t c = config(NULL, NULL, NULL, NULL);
  assert_int_equal(fps_auth_create(&c, &a), 0);
  assert_string_equal(fps_auth_describe(a), "plaintext");
  grpc_server_credentials *cr = fps_auth_server_credentials(a);
  assert_non_null(cr);
  grpc_server_credentials_release(cr);
  fps_auth_destroy(a);

  c = config("server.pem", "server.key", NULL, NULL);
  assert_int_equal(fps_auth_create(&c, &a), 0);
  assert_string_equal(fps_auth_describe(a), "TLS");
  cr = fps_auth_server_credentials(a);
  assert_non_null(cr);
  grpc_server_credentials_release(cr);
  fps_auth_destroy(a);

  c = config("server.pem", "server.key", "ca.pem", "tokens.txt");
  assert_int_equal(CAPTURE(err, fps_auth_create(&c, &a)), 0);
  assert_non_null(strstr(fps_auth_describe(a), "mutual TLS, bearer tokens"));
  fps_auth_destroy(a);
  fps_auth_destroy(NULL);

  /* Refusals: each FPS_EINVAL/FPS_EIO with *out NULL and a message. */
  write_file("empty-tokens.txt", "# none\n\n", 8);
  char many[80 * 20];
  size_t m = 0;
  for (int i = 0; i < FPS_AUTH_TOKENS_MAX + 1; i++) m += (size_t)sprintf(many + m, "token-number-%04d\n", i);
  write_file("many-tokens.txt", many, m);
  struct {
    fps_config_t c;
    int rc;
    const char *says;
  } cases[] = {
      {config("server.pem", NULL, NULL, NULL), FPS_EINVAL, "must be given together"},
      {config(NULL, NULL, "ca.pem", NULL), FPS_EINVAL, "--tls-client-ca needs --tls-cert"},
      {config("server.pem", "client.key", NULL, NULL), FPS_EINVAL, "does not belong"},
      {config("expired.pem", "expired.key", NULL, NULL), FPS_EINVAL, "expired"},
      {config("server.pem", "server.key", "token", NULL), FPS_EINVAL, "no PEM certificate"},
      {config("missing.pem", "server.key", NULL, NULL), FPS_EIO, "missing.pem"},
      {config(NULL, NULL, NULL, "empty-tokens.txt"), FPS_EINVAL, "holds no token"},
      {config(NULL, NULL, NULL, "many-tokens.txt"), FPS_EINVAL, "more than 64 tokens"},
      {config(NULL, NULL, NULL, "missing-tokens.txt"), FPS_EIO, "missing-tokens.txt"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    a = (fps_auth_t *)1;
    int rc = CAPTURE(err, fps_auth_create(&cases[k].c, &a));
    if (rc != cases[k].rc) fail_msg("case %zu: rc %d, want %d: %s", k, rc, cases[k].rc, err);
    assert_null(a);
    if (!strstr(err, cases[k].says)) fail_msg("case %zu: '%s' not in '%s'", k, cases[k].says, err);
  }
}

/* fps_auth_check with the given authorization values (key per value). */
static fps_ident_t last_id;
static int check(const fps_auth_t *a, char *why, size_t why_len, int n, const char *keys[], const char *values[]) {
  grpc_metadata md[4];
  grpc_metadata_array arr = {.count = (size_t)n, .capacity = 4, .metadata = md};
  for (int i = 0; i < n; i++) {
    memset(&md[i], 0, sizeof md[i]);
    md[i].key = grpc_slice_from_copied_string(keys[i]);
    md[i].value = grpc_slice_from_copied_string(values[i]);
  }
  memset(&last_id, 0xa5, sizeof last_id);
  int st = fps_auth_check(a, &arr, &last_id, why, why_len);
  for (int i = 0; i < n; i++) {
    grpc_slice_unref(md[i].key);
    grpc_slice_unref(md[i].value);
  }
  return st;
}

static void check_tokens_on_calls(void **state) {
  (void)state;
  char err[1024], why[256];
  fps_auth_t *a = NULL;
  fps_config_t c = config(NULL, NULL, NULL, "tokens.txt");
  assert_int_equal(CAPTURE(err, fps_auth_create(&c, &a)), 0);
  char good[160], good2[160], wrong[160], prefix[160], longer[200], lower[160];
  snprintf(good, sizeof good, "Bearer %s", read_token("token"));
  snprintf(good2, sizeof good2, "Bearer %s", read_token("token2"));
  snprintf(wrong, sizeof wrong, "Bearer %s", read_token("wrong-token"));
  snprintf(prefix, sizeof prefix, "%s", good);
  prefix[strlen(prefix) - 1] = '\0';
  snprintf(longer, sizeof longer, "%sx", good);
  snprintf(lower, sizeof lower, "bEaReR %s", read_token("token"));
  const char *auth[] = {"authorization", "Authorization"};

  assert_int_equal(check(a, why, sizeof why, 1, auth, (const char *[]){good}), 0);
  /* Without admin or exchange token files a worker token holds every role. */
  assert_int_equal(last_id.roles, FPS_ROLE_ALL);
  assert_int_equal(check(a, why, sizeof why, 1, auth, (const char *[]){good2}), 0);
  assert_int_equal(check(a, why, sizeof why, 1, auth + 1, (const char *[]){lower}), 0);
  const char *refused[] = {wrong, prefix, longer, "Bearer ", "Basic dXNlcjpwYXNz", read_token("token"), ""};
  for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++) {
    why[0] = '\0';
    assert_int_equal(check(a, why, sizeof why, 1, auth, &refused[k]), FPS_EAUTH);
    assert_true(strlen(why) > 0);
    /* The reason never echoes what the client sent. */
    if (strlen(refused[k]) > 8) assert_null(strstr(why, refused[k] + 7));
  }
  assert_int_equal(check(a, why, sizeof why, 0, NULL, NULL), FPS_EAUTH);
  assert_non_null(strstr(why, "requires a bearer token"));
  assert_int_equal(check(a, why, sizeof why, 2, (const char *[]){"authorization", "AUTHORIZATION"},
                         (const char *[]){good, good}),
                   FPS_EAUTH);
  assert_non_null(strstr(why, "more than one"));
  /* Other metadata does not count as a token. */
  assert_int_equal(check(a, why, sizeof why, 1, (const char *[]){"x-authorization"}, (const char *[]){good}),
                   FPS_EAUTH);
  fps_auth_destroy(a);
  /* Without tokens every call passes, and so does a NULL auth. */
  c = config(NULL, NULL, NULL, NULL);
  assert_int_equal(fps_auth_create(&c, &a), 0);
  assert_int_equal(check(a, why, sizeof why, 0, NULL, NULL), 0);
  assert_int_equal(last_id.roles, FPS_ROLE_ALL);
  assert_int_equal(check(NULL, why, sizeof why, 0, NULL, NULL), 0);
  assert_int_equal(last_id.roles, FPS_ROLE_ALL);
  fps_auth_destroy(a);
}

static void roles_of_tokens(void **state) {
  (void)state;
  char err[4096], why[256];
  const char *admin_tok = "admin-token-0123456789abcdef";
  const char *peer_tok = "peer-token-0123456789abcdef01";
  char line[128];
  write_file("admins.txt", admin_tok, strlen(admin_tok));
  snprintf(line, sizeof line, "1:%s\n", peer_tok);
  write_file("peers.txt", line, strlen(line));
  fps_config_t c = config(NULL, NULL, NULL, "tokens.txt");
  c.admin_token_file = (char *)path("admins.txt");
  c.exchange_token_file = (char *)path("peers.txt");
  c.shard_count = 2;
  fps_auth_t *a = NULL;
  assert_int_equal(CAPTURE(err, fps_auth_create(&c, &a)), 0);
  assert_non_null(strstr(fps_auth_describe(a), "(worker, admin, peer)"));
  char worker[160], admin[160], peer[160];
  snprintf(worker, sizeof worker, "Bearer %s", read_token("token"));
  snprintf(admin, sizeof admin, "Bearer %s", admin_tok);
  snprintf(peer, sizeof peer, "Bearer %s", peer_tok);
  const char *auth[] = {"authorization"};
  assert_int_equal(check(a, why, sizeof why, 1, auth, (const char *[]){worker}), 0);
  fps_ident_t w = last_id;
  assert_int_equal(w.roles, FPS_ROLE_WORKER);
  assert_int_equal(fps_auth_allow(&w, FPS_ROLE_WORKER, "PushPull", why, sizeof why), 0);
  assert_int_equal(fps_auth_allow(&w, FPS_ROLE_ADMIN, "Checkpoint", why, sizeof why),
                   FPS_EPERM);
  assert_string_equal(why, "Checkpoint needs the admin role: this call's token does not grant it");
  assert_int_equal(fps_auth_allow(&w, FPS_ROLE_PEER, "Exchange", why, sizeof why), FPS_EPERM);
  assert_int_equal(check(a, why, sizeof why, 1, auth, (const char *[]){admin}), 0);
  assert_int_equal(last_id.roles, FPS_ROLE_WORKER | FPS_ROLE_ADMIN);
  assert_int_equal(check(a, why, sizeof why, 1, auth, (const char *[]){peer}), 0);
  assert_int_equal(last_id.roles, FPS_ROLE_PEER);
  assert_int_equal(last_id.peer_shard, 1);
  fps_auth_destroy(a);

  /* The role files' refusals. */
  c = config(NULL, NULL, NULL, NULL);
  c.admin_token_file = (char *)path("admins.txt");
  a = (fps_auth_t *)1;
  assert_int_equal(CAPTURE(err, fps_auth_create(&c, &a)), FPS_EINVAL);
  assert_null(a);
  assert_non_null(strstr(err, "--admin-token-file needs --auth-token-file"));
  const char *bad_lines[] = {"2:abcdefabcdefabcdef\n", "x:abcdefabcdefabcdef\n", "1:\n", "abcdefabcdefabcdef\n"};
  for (size_t k = 0; k < 4; k++) {
    write_file("bad-peers.txt", bad_lines[k], strlen(bad_lines[k]));
    c = config(NULL, NULL, NULL, "tokens.txt");
    c.exchange_token_file = (char *)path("bad-peers.txt");
    c.shard_count = 2;
    a = (fps_auth_t *)1;
    assert_int_equal(CAPTURE(err, fps_auth_create(&c, &a)), FPS_EINVAL);
    assert_null(a);
    if (!strstr(err, "<shard-id>:<token>")) fail_msg("line '%s': %s", bad_lines[k], err);
  }
}

static void create_out_of_memory(void **state) {
  (void)state;
  char err[4096];
  fps_config_t c = config("server.pem", "server.key", "ca.pem", "tokens.txt");
  int failures = 0;
  for (uint64_t nth = 1; nth < 100; nth++) {
    fps_auth_t *a = (fps_auth_t *)1;
    fps_alloc_fault_arm(nth, 0);
    int rc = CAPTURE(err, fps_auth_create(&c, &a));
    uint64_t failed = fps_alloc_failures();
    fps_alloc_fault_disarm();
    if (failed == 0) {
      assert_int_equal(rc, 0);
      fps_auth_destroy(a);
      break;
    }
    if (rc != FPS_ENOMEM) fail_msg("allocation %lu failed: rc %d (%s)", (unsigned long)nth, rc, err);
    assert_null(a);
    failures++;
  }
  assert_true(failures >= 4);
}

/* --tls-client-roles: the URI SANs a certificate carries, narrowing what
 * its token granted. */
static fps_cert_roles_t uris(const char *const *v, size_t n) {
  fps_cert_roles_t cr = {.roles = 0, .shard = -1, .two_shards = false};
  for (size_t i = 0; i < n; i++) fps_auth_cert_roles_add(&cr, v[i], strlen(v[i]));
  return cr;
}

static void roles_of_certificate_uris(void **state) {
  (void)state;
  char why[256];
  fps_cert_roles_t cr = uris((const char *[]){"urn:factorps:worker"}, 1);
  assert_int_equal(cr.roles, FPS_ROLE_WORKER);
  cr = uris((const char *[]){"shard-0-a", "urn:factorps:admin"}, 2);
  assert_int_equal(cr.roles, FPS_ROLE_WORKER | FPS_ROLE_ADMIN);
  cr = uris((const char *[]){"urn:factorps:peer:12"}, 1);
  assert_int_equal(cr.roles, FPS_ROLE_PEER);
  assert_int_equal(cr.shard, 12);
  /* Not roles: other spellings, no or bad shard ids, a larger id than a shard can have. */
  const char *bad[] = {"urn:factorps:", "urn:factorps:workers", "urn:factorps:Worker", "URN:factorps:worker",
                       "urn:factorps:peer:", "urn:factorps:peer:1x", "urn:factorps:peer:-1",
                       "urn:factorps:peer:4294967296", "urn:factorps:peer:99999999999", "urn:other:worker",
                       "factorps:worker"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cr = uris(&bad[i], 1);
    assert_int_equal(cr.roles, 0);
  }
  cr = uris((const char *[]){"urn:factorps:peer:4294967295"}, 1);
  assert_int_equal(cr.shard, 4294967295);

  /* Applied: the token's roles narrowed to the certificate's. */
  fps_ident_t id = {.roles = FPS_ROLE_ALL, .peer_shard = -1};
  cr = uris((const char *[]){"urn:factorps:worker"}, 1);
  assert_int_equal(fps_auth_cert_roles_apply(&cr, &id, why, sizeof why), 0);
  assert_int_equal(id.roles, FPS_ROLE_WORKER);
  /* A peer certificate fixes the shard a one-token setup left open... */
  id = (fps_ident_t){.roles = FPS_ROLE_ALL, .peer_shard = -1};
  cr = uris((const char *[]){"urn:factorps:peer:3"}, 1);
  assert_int_equal(fps_auth_cert_roles_apply(&cr, &id, why, sizeof why), 0);
  assert_int_equal(id.roles, FPS_ROLE_PEER);
  assert_int_equal(id.peer_shard, 3);
  /* ...and a peer token of another shard loses the role. */
  id = (fps_ident_t){.roles = FPS_ROLE_PEER, .peer_shard = 2};
  assert_int_equal(fps_auth_cert_roles_apply(&cr, &id, why, sizeof why), 0);
  assert_int_equal(id.roles, 0);
  /* An admin certificate does not lift a worker token. */
  id = (fps_ident_t){.roles = FPS_ROLE_WORKER, .peer_shard = -1};
  cr = uris((const char *[]){"urn:factorps:admin"}, 1);
  assert_int_equal(fps_auth_cert_roles_apply(&cr, &id, why, sizeof why), 0);
  assert_int_equal(id.roles, FPS_ROLE_WORKER);
  /* Two shards' peer URIs: no peer role; nothing named: refused. */
  id = (fps_ident_t){.roles = FPS_ROLE_ALL, .peer_shard = -1};
  cr = uris((const char *[]){"urn:factorps:peer:1", "urn:factorps:peer:1", "urn:factorps:peer:2"}, 3);
  assert_true(cr.two_shards);
  assert_int_equal(fps_auth_cert_roles_apply(&cr, &id, why, sizeof why), FPS_EPERM);
  assert_int_equal(id.roles, 0);
  assert_non_null(strstr(why, "names no factorps role"));
  cr = uris((const char *[]){"urn:factorps:peer:1", "urn:factorps:peer:1", "urn:factorps:worker"}, 3);
  assert_false(cr.two_shards);
  assert_int_equal(cr.roles, FPS_ROLE_PEER | FPS_ROLE_WORKER);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(read_file_refusals),
      cmocka_unit_test(pair_and_ca_checks),
      cmocka_unit_test(token_lines),
      cmocka_unit_test(create_describes_and_refuses),
      cmocka_unit_test(check_tokens_on_calls),
      cmocka_unit_test(roles_of_tokens),
      cmocka_unit_test(create_out_of_memory),
      cmocka_unit_test(roles_of_certificate_uris),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

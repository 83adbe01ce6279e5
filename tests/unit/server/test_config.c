/* server/config.c: the one table behind factorps-server's flags, their
 * FACTORPS_* environment twins, defaults, validation and the start-up
 * dump. Every refusal is FPS_EINVAL with a message naming the flag (what
 * the shard exits 2 with); a failed load leaves nothing allocated. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "alloc.h"
#include "error.h"
#include "server.h"

/* Runs fps_config_load on argv (NULL-terminated list after the program
 * name) with stderr captured into err; returns its result. */
static int load(fps_config_t *cfg, char *err, size_t err_len, ...) {
  char *argv[64] = {"factorps-server"};
  int argc = 1;
  va_list ap;
  va_start(ap, err_len);
  for (char *a; (a = va_arg(ap, char *)) != NULL && argc < 63;) argv[argc++] = a;
  va_end(ap);
  argv[argc] = NULL;
  fflush(stderr);
  FILE *tmp = tmpfile();
  assert_non_null(tmp);
  int saved = dup(2);
  dup2(fileno(tmp), 2);
  int rc = fps_config_load(cfg, argc, argv);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(tmp);
  size_t n = fread(err, 1, err_len - 1, tmp);
  err[n] = '\0';
  fclose(tmp);
  return rc;
}

/* No FACTORPS_* variable of the test's environment leaks into a case. */
static int clean_env(void **state) {
  (void)state;
  extern char **environ;
  for (int again = 1; again;) {
    again = 0;
    for (char **e = environ; *e; e++)
      if (!strncmp(*e, "FACTORPS_", 9)) {
        char name[128];
        size_t n = strcspn(*e, "=");
        if (n >= sizeof name) n = sizeof name - 1;
        memcpy(name, *e, n);
        name[n] = '\0';
        unsetenv(name);
        again = 1;
        break;
      }
  }
  return 0;
}

static void defaults(void **state) {
  (void)state;
  fps_config_t c;
  char err[1024];
  assert_int_equal(load(&c, err, sizeof err, NULL), 0);
  assert_string_equal(c.listen, "127.0.0.1:50051");
  assert_int_equal(c.shard_id, 0);
  assert_int_equal(c.shard_count, 1);
  assert_int_equal(c.mode, FPS_MODE_SYNC);
  assert_int_equal(c.workers, 1);
  assert_int_equal(c.staleness, 2);
  assert_true(c.deadline == 60);
  assert_int_equal(c.max_message_bytes, 64u << 20);
  assert_int_equal(c.max_tensors, 1048576);
  assert_int_equal(c.apply_log, 4096);
  assert_int_equal(c.checkpoint_keep, 3);
  assert_int_equal(c.max_concurrent_calls, 4096);
  assert_int_equal(c.malloc_tune, 1);
  assert_int_equal(c.http2_bdp_probe, 0);
  assert_int_equal(c.http2_max_frame, 1u << 20);
  assert_int_equal(c.require_checkpoint, 0);
  assert_true(c.exchange_deadline == 10);
  assert_string_equal(c.tls_cert, "");
  assert_string_equal(c.simd, "auto");
  assert_string_equal(c.replica_peer, ""); /* solo */
  assert_string_equal(c.lease, "");
  assert_true(c.lease_ttl == 2);
  assert_string_equal(c.replica_advertise, "");
  /* The derived defaults: threads from the CPUs (at least 2), the memory
   * limits from the RAM, staging = max-bytes, the decode budget the larger
   * of a quarter of max-bytes and 4 largest messages. */
  assert_true(c.threads >= 2);
  assert_true(c.max_bytes > 0);
  assert_int_equal(c.max_staging_bytes, c.max_bytes);
  uint64_t four = c.max_message_bytes * 4;
  assert_int_equal(c.max_decode_bytes, c.max_bytes / 4 > four ? c.max_bytes / 4 : four);
  /* Nothing refused: no error line (info lines may say how a derived
   * default was chosen). */
  assert_null(strstr(err, "factorps-server error: "));
  fps_config_free(&c);
}

static void flag_wins_over_env_over_default(void **state) {
  (void)state;
  fps_config_t c;
  char err[1024];
  setenv("FACTORPS_WORKERS", "3", 1);
  setenv("FACTORPS_MODE", "ssp", 1);
  setenv("FACTORPS_MAX_MESSAGE_BYTES", "1048576", 1);
  assert_int_equal(load(&c, err, sizeof err, "--workers", "5", NULL), 0);
  assert_int_equal(c.workers, 5);
  assert_int_equal(c.mode, FPS_MODE_SSP);
  assert_int_equal(c.max_message_bytes, 1048576);
  fps_config_free(&c);
  assert_int_equal(load(&c, err, sizeof err, "--workers=7", "--mode=async", NULL), 0);
  assert_int_equal(c.workers, 7);
  assert_int_equal(c.mode, FPS_MODE_ASYNC);
  fps_config_free(&c);
  /* The replica flags and their twins. */
  setenv("FACTORPS_REPLICA_PEER", "127.0.0.1:6001", 1);
  setenv("FACTORPS_LEASE", "file:/tmp/fps-shard0.lease", 1);
  setenv("FACTORPS_LEASE_TTL", "5", 1);
  assert_int_equal(load(&c, err, sizeof err, "--replica-advertise", "10.0.0.5:50051", "--lease-ttl", "3", NULL), 0);
  assert_string_equal(c.replica_peer, "127.0.0.1:6001");
  assert_string_equal(c.lease, "file:/tmp/fps-shard0.lease");
  assert_true(c.lease_ttl == 3);
  assert_string_equal(c.replica_advertise, "10.0.0.5:50051");
  fps_config_free(&c);
  assert_int_equal(load(&c, err, sizeof err, "--lease", "etcd:127.0.0.1:2379/fps/shard0", NULL), 0);
  assert_string_equal(c.lease, "etcd:127.0.0.1:2379/fps/shard0");
  fps_config_free(&c);
  clean_env(NULL);
}

/* A bad value, as a flag and as its environment twin: FPS_EINVAL naming it. */
static void bad(const char *flag, const char *value) {
  fps_config_t c;
  char err[1024];
  char arg[256];
  snprintf(arg, sizeof arg, "--%s=%s", flag, value);
  int rc = load(&c, err, sizeof err, arg, NULL);
  if (rc != FPS_EINVAL) fail_msg("%s: rc %d, stderr '%s'", arg, rc, err);
  char name[64];
  snprintf(name, sizeof name, "--%s", flag);
  if (!strstr(err, name)) fail_msg("%s: the message does not name %s: '%s'", arg, name, err);
  /* A start-up error is a log line like any other (common/log.h). */
  if (!strstr(err, "Z factorps-server error: ")) fail_msg("%s: not an error log line: '%s'", arg, err);
  char env[128] = "FACTORPS_";
  for (size_t i = 0; flag[i]; i++) env[9 + i] = flag[i] == '-' ? '_' : (char)(flag[i] - 32 * (flag[i] >= 'a'));
  env[9 + strlen(flag)] = '\0';
  setenv(env, value, 1);
  rc = load(&c, err, sizeof err, NULL);
  unsetenv(env);
  if (rc != FPS_EINVAL) fail_msg("%s=%s: rc %d, stderr '%s'", env, value, rc, err);
  if (!strstr(err, env) && !strstr(err, name))
    fail_msg("%s=%s: the message names neither: '%s'", env, value, err);
}

static void bad_values_are_refused(void **state) {
  (void)state;
  /* Numbers: below, above, not numbers, negative, trailing junk, empty,
   * overflow, non-finite; choices and booleans. */
  bad("workers", "0");
  bad("workers", "65537");
  bad("shard-count", "0");
  bad("shard-id", "x");
  bad("staleness", "-1");
  bad("deadline", "0");
  bad("deadline", "nan");
  bad("deadline", "inf");
  bad("deadline", "1e400");
  bad("max-message-bytes", "65535");
  bad("max-message-bytes", "12abc");
  bad("max-message-bytes", "");
  bad("max-bytes", "99999999999999999999999");
  bad("threads", "257");
  bad("apply-log", "16777217");
  bad("checkpoint-keep", "0");
  bad("checkpoint-interval", "-1");
  bad("exchange-deadline", "0.001");
  bad("mode", "fast");
  bad("mode", "SYNC");
  bad("malloc-tune", "maybe");
  bad("http2-bdp-probe", "2");
  bad("http2-max-frame", "16383"); /* HTTP/2's smallest is 16384 */
  bad("http2-max-frame", "16777216");
  bad("log-level", "loud");
  bad("listen", "127.0.0.1:65536");
  bad("listen", "127.0.0.1:123456789012345678901");
  bad("metrics-listen", "nohost");
  bad("metrics-listen", "127.0.0.1:70000");
}

static void accepted_spellings(void **state) {
  (void)state;
  fps_config_t c;
  char err[1024];
  assert_int_equal(load(&c, err, sizeof err, "--malloc-tune", "off", "--http2-bdp-probe", "yes", "--listen",
                        "127.0.0.1:65535", "--listen", "unix:/tmp/x.sock", "--deadline", "0.001", NULL),
                   0);
  assert_int_equal(c.malloc_tune, 0);
  assert_int_equal(c.http2_bdp_probe, 1);
  /* The last occurrence wins; a unix: address is gRPC's to check. */
  assert_string_equal(c.listen, "unix:/tmp/x.sock");
  assert_true(c.deadline == 0.001);
  fps_config_free(&c);
  /* --require-checkpoint is a switch: alone it means true, =false is allowed. */
  assert_int_equal(load(&c, err, sizeof err, "--checkpoint-dir", "/tmp/ck", "--require-checkpoint", NULL), 0);
  assert_int_equal(c.require_checkpoint, 1);
  fps_config_free(&c);
  assert_int_equal(load(&c, err, sizeof err, "--require-checkpoint=false", NULL), 0);
  assert_int_equal(c.require_checkpoint, 0);
  fps_config_free(&c);
}

static void bad_combinations_are_refused(void **state) {
  (void)state;
  struct {
    const char *args[10];
    const char *says;
  } cases[] = {
      {{"--shard-id", "2", "--shard-count", "2"}, "--shard-id 2 must be below --shard-count 2"},
      {{"--listen", ""}, "--listen must not be empty"},
      {{"--tls-cert", "c.pem"}, "--tls-key"},
      {{"--tls-key", "k.pem"}, "--tls-cert"},
      {{"--tls-client-ca", "ca.pem"}, "--tls-client-ca needs --tls-cert"},
      {{"--checkpoint-interval", "5"}, "--checkpoint-interval needs --checkpoint-dir"},
      {{"--require-checkpoint"}, "--require-checkpoint needs --checkpoint-dir"},
      {{"--checkpoint-dir", "/tmp/x", "--checkpoint-interval", "0.001"}, "at least 0.01"},
      {{"--peer-tls-ca", "ca.pem"}, "--peer-tls-ca needs --peers"},
      {{"--shard-count", "2", "--peers", "127.0.0.1:1"}, "--peers lists 1 address"},
      {{"--shard-count", "2", "--peers", "127.0.0.1:1,"}, "entry 1 is empty"},
      {{"--shard-count", "2", "--peers", "127.0.0.1:5000,127.0.0.1:65536"}, "--peers"},
      {{"--shard-count", "2", "--peers", "a:1,b:2", "--peer-tls-cert", "c.pem"}, "--peer-tls-key"},
      {{"--shard-count", "2", "--peers", "a:1,b:2", "--peer-tls-server-name", "x"},
       "--peer-tls-server-name needs --peer-tls-ca"},
      {{"--lease", "file:/tmp/l"}, "--lease needs --replica-peer"},
      {{"--replica-advertise", "a:1"}, "--replica-advertise needs --replica-peer"},
      {{"--replica-peer", "127.0.0.1:5001"}, "--replica-peer needs --lease"},
      {{"--replica-peer", "127.0.0.1:5001", "--lease", "flock:/x"}, "names no lease backend"},
      {{"--replica-peer", "127.0.0.1:5001", "--lease", "file:"}, "needs a path"},
      {{"--replica-peer", "127.0.0.1:5001", "--lease", "etcd:h/k"}, "etcd:HOST:PORT/KEY"},
      {{"--replica-peer", "127.0.0.1", "--lease", "file:/tmp/l"}, "--replica-peer '127.0.0.1' must be host:port"},
      {{"--replica-peer", "h:70000", "--lease", "file:/tmp/l"}, "out of range"},
      {{"--replica-peer", "h:1", "--lease", "file:/tmp/l", "--replica-advertise", "x"},
       "--replica-advertise 'x' must be host:port"},
      {{"--replica-peer", "h:1", "--lease", "file:/tmp/l", "--lease-ttl", "0.01"}, "--lease-ttl"},
      {{"--shard-count", "2", "--peers", "a:1|c:3|d:4,b:2"}, "entry 0 names more than two replicas"},
      {{"--shard-count", "2", "--peers", "a:1|,b:2"}, "entry 0 names an empty replica"},
      {{"--shard-count", "2", "--peers", "a:1,|b:2"}, "entry 1 names an empty replica"},
      {{"--shard-count", "2", "--peers", "a:1,b:2|c"}, "--peers 'c' must be host:port"},
      {{"--no-such-flag"}, "unknown option"},
      {{"--workers"}, "missing value"},
      {{"stray"}, "unexpected argument 'stray'"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char *argv[12] = {"factorps-server"};
    int argc = 1;
    for (int i = 0; cases[k].args[i]; i++) argv[argc++] = (char *)cases[k].args[i];
    fps_config_t c;
    char err[1024];
    /* load() takes a va_list; spell the cases out through it. */
    int rc = load(&c, err, sizeof err, argc > 1 ? argv[1] : NULL, argc > 2 ? argv[2] : NULL,
                  argc > 3 ? argv[3] : NULL, argc > 4 ? argv[4] : NULL, argc > 5 ? argv[5] : NULL,
                  argc > 6 ? argv[6] : NULL, argc > 7 ? argv[7] : NULL, argc > 8 ? argv[8] : NULL,
                  argc > 9 ? argv[9] : NULL, argc > 10 ? argv[10] : NULL, NULL);
    if (rc != FPS_EINVAL) fail_msg("case %zu (%s ...): rc %d", k, argv[1], rc);
    if (!strstr(err, cases[k].says)) fail_msg("case %zu: '%s' not in '%s'", k, cases[k].says, err);
  }
}

static void help_and_version_return_1(void **state) {
  (void)state;
  fps_config_t c;
  char err[1024];
  /* Their text goes to stdout; keep the test's output readable. */
  fflush(stdout);
  int saved = dup(1);
  FILE *tmp = tmpfile();
  dup2(fileno(tmp), 1);
  int h = load(&c, err, sizeof err, "--help", NULL);
  int v = load(&c, err, sizeof err, "--version", NULL);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  rewind(tmp);
  char out[16384];
  size_t n = fread(out, 1, sizeof out - 1, tmp);
  out[n] = '\0';
  fclose(tmp);
  assert_int_equal(h, 1);
  assert_int_equal(v, 1);
  /* --help lists every flag with its environment twin and default. */
  assert_non_null(strstr(out, "--max-staging-bytes"));
  assert_non_null(strstr(out, "env FACTORPS_MAX_STAGING_BYTES, default 0"));
  assert_non_null(strstr(out, "env FACTORPS_LISTEN, default 127.0.0.1:50051"));
  assert_non_null(strstr(out, "factorps-server " FPS_VERSION));
}

/* The dump, fed back as flags, loads the same configuration. */
static char dumped[64][600];
static int n_dumped;
static void collect(const char *line) {
  assert_true(n_dumped < 64);
  snprintf(dumped[n_dumped++], sizeof dumped[0], "--%s", line);
}

static void dump_round_trips(void **state) {
  (void)state;
  fps_config_t c;
  char err[1024];
  assert_int_equal(load(&c, err, sizeof err, "--mode", "ssp", "--workers", "4", "--deadline", "2.5",
                        "--checkpoint-dir", "/tmp/ck", "--require-checkpoint", "--shard-count", "2",
                        "--peers", "h0:1,h1:2", NULL),
                   0);
  n_dumped = 0;
  fps_config_dump(&c, collect);
  assert_true(n_dumped >= 30);
  char *argv[66] = {"factorps-server"};
  for (int i = 0; i < n_dumped; i++) argv[i + 1] = dumped[i];
  char first[64][600];
  memcpy(first, dumped, sizeof first);
  int n_first = n_dumped;
  fps_config_t d;
  /* Through fps_config_load directly: the dump has more lines than load()'s
   * va_list spelling takes. */
  assert_int_equal(fps_config_load(&d, n_first + 1, argv), 0);
  n_dumped = 0;
  fps_config_dump(&d, collect);
  assert_int_equal(n_dumped, n_first);
  for (int i = 0; i < n_first; i++) assert_string_equal(dumped[i], first[i]);
  fps_shard_opts_t o;
  fps_config_shard_opts(&d, &o);
  assert_int_equal(o.mode, FPS_MODE_SSP);
  assert_int_equal(o.workers, 4);
  assert_true(o.deadline == 2.5);
  assert_string_equal(o.checkpoint_dir, "/tmp/ck");
  assert_int_equal(o.require_checkpoint, 1);
  assert_int_equal(o.shard_count, 2);
  fps_config_free(&c);
  fps_config_free(&d);
}

static void out_of_memory_is_enomem(void **state) {
  (void)state;
  /* Every allocation of a load failed in turn: FPS_ENOMEM each time (never a
   * bad value), and nothing left allocated (LeakSanitizer checks that). */
  int failures = 0;
  for (uint64_t nth = 1; nth < 200; nth++) {
    fps_config_t c;
    char err[1024];
    fps_alloc_fault_arm(nth, 0);
    int rc = load(&c, err, sizeof err, "--listen", "127.0.0.1:0", "--tls-cert", "c", "--tls-key", "k", NULL);
    uint64_t failed = fps_alloc_failures();
    fps_alloc_fault_disarm();
    if (failed == 0) {
      assert_int_equal(rc, 0);
      fps_config_free(&c);
      break;
    }
    assert_int_equal(rc, FPS_ENOMEM);
    failures++;
  }
  assert_true(failures >= 10);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(defaults, clean_env),
      cmocka_unit_test_setup(flag_wins_over_env_over_default, clean_env),
      cmocka_unit_test_setup(bad_values_are_refused, clean_env),
      cmocka_unit_test_setup(accepted_spellings, clean_env),
      cmocka_unit_test_setup(bad_combinations_are_refused, clean_env),
      cmocka_unit_test_setup(help_and_version_return_1, clean_env),
      cmocka_unit_test_setup(dump_round_trips, clean_env),
      cmocka_unit_test_setup(out_of_memory_is_enomem, clean_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

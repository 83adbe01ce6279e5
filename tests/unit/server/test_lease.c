/* server/lease.c + lease_file.c: the spec's shapes, and the file lease
 * between real processes: a second holder blocks while the first lives,
 * takes the lease the moment the first dies (SIGKILL, no clean-up), and
 * every acquisition gets a larger term. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "error.h"
#include "lease.h"

static char dir[64];
static char spec[128];

static int setup(void **state) {
  (void)state;
  snprintf(dir, sizeof dir, "/tmp/fps_lease_XXXXXX");
  if (!mkdtemp(dir)) return -1;
  snprintf(spec, sizeof spec, "file:%s/shard0.lease", dir);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  char p[160];
  snprintf(p, sizeof p, "%s/shard0.lease", dir);
  unlink(p);
  rmdir(dir);
  return 0;
}

static void test_spec_shapes(void **state) {
  (void)state;
  char why[256];
  assert_int_equal(fps_lease_spec_check("file:/x/y", why, sizeof why), 0);
  assert_int_equal(fps_lease_spec_check("etcd:127.0.0.1:2379/fps/shard0", why, sizeof why), 0);
  assert_int_equal(fps_lease_spec_check("etcd:[::1]:2379/k", why, sizeof why), 0);
  const char *bad[] = {"", "file:", "flock:/x", "etcd:", "etcd:host/k", "etcd:host:/k", "etcd::2379/k",
                       "etcd:host:2379", "etcd:host:2379/", "etcd:host:123456/k", "etcd:host:23x9/k"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    why[0] = 0;
    assert_int_equal(fps_lease_spec_check(bad[i], why, sizeof why), FPS_EINVAL);
    assert_true(why[0] != 0);
  }
  fps_lease_t *l = (fps_lease_t *)1;
  assert_int_equal(fps_lease_open("nope:x", 2, NULL, &l), FPS_EINVAL);
  assert_null(l);
  /* A path that cannot be created fails at open, not at failover time. */
  assert_int_equal(fps_lease_open("file:/nonexistent-dir-fps/x.lease", 2, NULL, &l), FPS_EIO);
  assert_null(l);
}

/* Sets *stop after `ms` milliseconds (a bounded wait for a blocked acquire). */
typedef struct {
  atomic_bool *stop;
  int ms;
  atomic_bool quit; /* the test is done with it: return without stopping */
} stopper_t;

/* Sleeps in 10 ms steps, so that it can be told to quit (pthread_cancel
 * would do, but ASan reports a thread cancelled in its sleep). */
static void *stopper(void *arg) {
  stopper_t *s = arg;
  for (int waited = 0; waited < s->ms; waited += 10) {
    if (atomic_load(&s->quit)) return NULL;
    nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
  }
  atomic_store(s->stop, true);
  return NULL;
}

/* Forks a holder: it acquires, writes its term to the pipe, then waits to
 * be killed. Returns its pid and its term. */
static pid_t fork_holder(uint64_t *term) {
  int p[2];
  assert_int_equal(pipe(p), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(p[0]);
    fps_lease_t *l;
    uint64_t t = 0;
    if (fps_lease_open(spec, 2, NULL, &l) < 0 || fps_lease_acquire(l, NULL, &t) < 0) _exit(1);
    if (write(p[1], &t, sizeof t) != sizeof t) _exit(1);
    for (int i = 0; i < 600; i++) sleep(1); /* bounded: the test kills it long before */
    _exit(0);
  }
  close(p[1]);
  assert_int_equal(read(p[0], term, sizeof *term), (ssize_t)sizeof *term);
  close(p[0]);
  return pid;
}

static void test_second_holder_waits_for_the_first_to_die(void **state) {
  (void)state;
  uint64_t t1;
  pid_t a = fork_holder(&t1);
  assert_true(t1 >= 1);

  fps_lease_t *l;
  assert_int_equal(fps_lease_open(spec, 2, NULL, &l), 0);
  assert_false(fps_lease_valid(l));
  /* The newest term granted, read by a replica that does not hold it. */
  uint64_t newest = 0;
  assert_int_equal(fps_lease_newest_term(l, &newest), 0);
  assert_int_equal(newest, t1);
  /* While A lives, B's acquire blocks until its stop flag is set. */
  atomic_bool stop;
  atomic_init(&stop, false);
  stopper_t st = {.stop = &stop, .ms = 200};
  pthread_t th;
  pthread_create(&th, NULL, stopper, &st);
  uint64_t t2 = 0;
  struct timespec t0, tn;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  assert_int_equal(fps_lease_acquire(l, &stop, &t2), FPS_ECANCELLED);
  clock_gettime(CLOCK_MONOTONIC, &tn);
  pthread_join(th, NULL);
  assert_false(fps_lease_valid(l));
  assert_true((tn.tv_sec - t0.tv_sec) * 1000 + (tn.tv_nsec - t0.tv_nsec) / 1000000 >= 150);

  /* A dies without a word: B gets the lease, with a larger term. */
  kill(a, SIGKILL);
  waitpid(a, NULL, 0);
  atomic_store(&stop, false);
  st.ms = 5000; /* bound: fail rather than hang */
  pthread_create(&th, NULL, stopper, &st);
  assert_int_equal(fps_lease_acquire(l, &stop, &t2), 0);
  assert_true(fps_lease_valid(l));
  assert_int_equal(t2, t1 + 1);
  atomic_store(&st.quit, true);
  pthread_join(th, NULL);

  /* While B holds it, a third process blocks; after B releases, it wins
   * with the next term. */
  pid_t c = fork();
  assert_true(c >= 0);
  if (c == 0) {
    /* The fork shares B's locked descriptor (flock locks belong to the
     * open file, not the process): close the child's copy, as exec would
     * (O_CLOEXEC), so that only B holds it. */
    fps_lease_release(l);
    fps_lease_t *lc;
    atomic_bool s2;
    atomic_init(&s2, false);
    uint64_t t3 = 0;
    if (fps_lease_open(spec, 2, NULL, &lc) < 0) _exit(1);
    stopper_t s = {.stop = &s2, .ms = 5000};
    pthread_t tt;
    pthread_create(&tt, NULL, stopper, &s);
    int rc = fps_lease_acquire(lc, &s2, &t3);
    _exit(rc == 0 && t3 == t2 + 1 ? 0 : 2);
  }
  usleep(100 * 1000);
  int status = 0;
  assert_int_equal(waitpid(c, &status, WNOHANG), 0); /* still blocked */
  fps_lease_release(l);
  assert_false(fps_lease_valid(l));
  assert_int_equal(waitpid(c, &status, 0), c);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);

  /* And B again: term t2 + 2, never a term handed out before. */
  uint64_t t4 = 0;
  assert_int_equal(fps_lease_acquire(l, NULL, &t4), 0);
  assert_int_equal(t4, t2 + 2);
  /* The sync record: nobody wrote one yet, so in sync. */
  assert_int_equal(fps_lease_get_sync(l), 1);
  /* B acknowledges alone: the next holder reads "out of sync", and the
   * term still grows. */
  assert_int_equal(fps_lease_set_sync(l, false), 0);
  fps_lease_release(l);
  assert_int_equal(fps_lease_set_sync(l, true), FPS_EIO); /* not held: nothing written */
  uint64_t t5 = 0;
  assert_int_equal(fps_lease_acquire(l, NULL, &t5), 0);
  assert_int_equal(t5, t4 + 1);
  assert_int_equal(fps_lease_get_sync(l), 0);
  assert_int_equal(fps_lease_set_sync(l, true), 0);
  fps_lease_release(l);
  assert_int_equal(fps_lease_acquire(l, NULL, &t5), 0);
  assert_int_equal(t5, t4 + 2);
  assert_int_equal(fps_lease_get_sync(l), 1);
  assert_int_equal(fps_lease_newest_term(l, &newest), 0); /* held, with its record */
  assert_int_equal(newest, t5);
  fps_lease_close(l);
}

/* A lock file that does not hold a counter is not guessed over. */
static void test_garbage_counter_refused(void **state) {
  (void)state;
  char p[160];
  snprintf(p, sizeof p, "%s/shard0.lease", dir);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs("twelve\n", f);
  fclose(f);
  fps_lease_t *l;
  assert_int_equal(fps_lease_open(spec, 2, NULL, &l), 0);
  uint64_t t = 0;
  assert_int_equal(fps_lease_acquire(l, NULL, &t), FPS_EFORMAT);
  assert_false(fps_lease_valid(l));
  assert_int_equal(fps_lease_newest_term(l, &t), FPS_EFORMAT);
  /* The failed try let go of the lock: another process can lock. */
  f = fopen(p, "w");
  fputs("41\n", f);
  fclose(f);
  assert_int_equal(fps_lease_acquire(l, NULL, &t), 0);
  assert_int_equal(t, 42);
  fps_lease_close(l);
  fps_lease_close(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_spec_shapes),
      cmocka_unit_test_setup_teardown(test_second_holder_waits_for_the_first_to_die, setup, teardown),
      cmocka_unit_test_setup_teardown(test_garbage_counter_refused, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

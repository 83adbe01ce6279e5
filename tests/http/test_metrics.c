/* The metrics registry: values land in the right series, the exposition is
 * well-formed, and the HTTP endpoint starts, reports its port and stops. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "error.h"
#include "metrics.h"

/* Allocation failure injection: the renderer grows its buffer with
 * realloc, wrapped at link time (-Wl,--wrap=realloc) to fail call N. */
static int realloc_fail_at = -1; /* -1: never */
static int realloc_calls;
void *__real_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n) {
  if (realloc_fail_at >= 0 && realloc_calls++ == realloc_fail_at) return NULL;
  return __real_realloc(p, n);
}

static char *render(void) {
  char *out = NULL;
  size_t len = 0;
  assert_int_equal(fps_metrics_render(&out, &len), 0);
  assert_non_null(out);
  assert_int_equal(strlen(out), len);
  return out;
}

static void assert_has(const char *text, const char *line) {
  if (strstr(text, line) == NULL) fail_msg("missing line: %s", line);
}

static void test_init_rejects_null(void **st) {
  (void)st;
  assert_int_equal(fps_metrics_init(NULL), FPS_EINVAL);
  assert_int_equal(fps_metrics_render(NULL, NULL), FPS_EINVAL);
}

static void test_rpc_series(void **st) {
  (void)st;
  fps_metrics_config_t c = {.shard_id = 7, .mode = "async", .simd = "avx2", .version = "9.9"};
  assert_int_equal(fps_metrics_init(&c), 0);
  fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, 0, 0.0003, 100, 200);
  fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, 0, 0.02, 1, 2);
  fps_metrics_rpc_observe(FPS_METRICS_PULL, 5, 0.5, 0, 0);
  fps_metrics_rpc_observe(FPS_METRICS_PULL, 99, 1.0, 0, 0);      /* out of range code */
  fps_metrics_rpc_observe(FPS_METRICS_PULL, -1, 1.0, 0, 0);
  fps_metrics_rpc_observe((fps_metrics_method_t)42, 0, 1.0, 0, 0); /* ignored */
  char *t = render();
  assert_has(t, "factorps_rpc_requests_total{shard=\"7\",method=\"PushPull\",code=\"OK\"} 2\n");
  assert_has(t, "factorps_rpc_requests_total{shard=\"7\",method=\"Pull\",code=\"NOT_FOUND\"} 1\n");
  assert_has(t, "factorps_rpc_requests_total{shard=\"7\",method=\"Pull\",code=\"UNKNOWN\"} 2\n");
  /* Zero error series are left out; the OK series is always there. */
  assert_null(strstr(t, "method=\"Create\",code=\"NOT_FOUND\""));
  assert_has(t, "factorps_rpc_requests_total{shard=\"7\",method=\"Create\",code=\"OK\"} 0\n");
  assert_has(t, "factorps_rpc_received_bytes_total{shard=\"7\",method=\"PushPull\"} 101\n");
  assert_has(t, "factorps_rpc_sent_bytes_total{shard=\"7\",method=\"PushPull\"} 202\n");
  /* Buckets are cumulative; 0.0003 <= 0.0005, 0.02 <= 0.025. */
  assert_has(t, "factorps_rpc_duration_seconds_bucket{shard=\"7\",method=\"PushPull\",le=\"0.00025\"} 0\n");
  assert_has(t, "factorps_rpc_duration_seconds_bucket{shard=\"7\",method=\"PushPull\",le=\"0.0005\"} 1\n");
  assert_has(t, "factorps_rpc_duration_seconds_bucket{shard=\"7\",method=\"PushPull\",le=\"0.025\"} 2\n");
  assert_has(t, "factorps_rpc_duration_seconds_bucket{shard=\"7\",method=\"PushPull\",le=\"+Inf\"} 2\n");
  assert_has(t, "factorps_rpc_duration_seconds_sum{shard=\"7\",method=\"PushPull\"} 0.0203\n");
  assert_has(t, "factorps_rpc_duration_seconds_count{shard=\"7\",method=\"PushPull\"} 2\n");
  assert_has(t, "factorps_build_info{shard=\"7\",version=\"9.9\",simd=\"avx2\"} 1\n");
  assert_has(t, "factorps_shard_info{shard=\"7\",mode=\"async\"} 1\n");
  assert_has(t, "# TYPE factorps_rpc_requests_total counter\n");
  assert_has(t, "# TYPE factorps_rpc_duration_seconds histogram\n");
  free(t);
}

static void test_state_and_update(void **st) {
  (void)st;
  fps_metrics_config_t c = {.shard_id = 0};
  assert_int_equal(fps_metrics_init(&c), 0);
  fps_metrics_state_t a = {.tensors = 1, .param_elements = 15, .row = 3, .col = 5,
                           .adamw_elements = 30};
  fps_metrics_state_t b = {.tensors = 1, .param_elements = 7, .var = 7, .mom = 7,
                           .adamw_elements = 14};
  fps_metrics_state_add(&a);
  fps_metrics_state_add(&b);
  fps_metrics_update_observe(0.5, 1000000000);
  fps_metrics_update_observe(-1, 0);            /* clamped, never corrupts the sum */
  fps_metrics_step_observe(4, 0.001);
  fps_metrics_staleness_observe(3);
  fps_metrics_waiting_add(3);
  fps_metrics_waiting_add(-1);
  fps_state_size_t sz = {.row = 2, .col = 3, .elements = 5, .bytes = 20, .adamw_elements = 12,
                         .adamw_bytes = 48};
  fps_metrics_rpc_bytes(FPS_METRICS_PULL, 5, 6);
  fps_metrics_rpc_bytes((fps_metrics_method_t)-1, 5, 6);
  fps_metrics_exchange_bytes(164, 0);
  fps_metrics_exchange_bytes(0, 328);
  fps_metrics_exchange_observe(true, 0.25);
  fps_metrics_exchange_observe(false, 0);
  assert_int_equal(fps_metrics_method_from_name("/factorps.v1.ParameterServer/PushPull"),
                   FPS_METRICS_PUSHPULL);
  assert_int_equal(fps_metrics_method_from_name("Stats"), FPS_METRICS_STATS);
  assert_int_equal(fps_metrics_method_from_name("unknown method"), -1);
  assert_int_equal(fps_metrics_method_from_name(NULL), -1);
  char *t = render();
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"row\"} 3\n");
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"col\"} 5\n");
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"var\"} 7\n");
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"momentum\"} 7\n");
  assert_has(t, "factorps_optimizer_state_bytes{shard=\"0\",kind=\"col\"} 20\n");
  assert_has(t, "factorps_adamw_equivalent_state_elements{shard=\"0\"} 44\n");
  assert_has(t, "factorps_adamw_equivalent_state_bytes{shard=\"0\"} 176\n");
  assert_has(t, "factorps_parameter_elements{shard=\"0\"} 22\n");
  assert_has(t, "factorps_parameter_bytes{shard=\"0\"} 88\n");
  assert_has(t, "factorps_tensors{shard=\"0\"} 2\n");
  assert_has(t, "factorps_update_bytes_total{shard=\"0\"} 1000000000\n");
  assert_has(t, "factorps_update_duration_seconds_count{shard=\"0\"} 2\n");
  assert_has(t, "factorps_update_duration_seconds_sum{shard=\"0\"} 0.5\n");
  assert_has(t, "factorps_update_throughput_bytes_per_second{shard=\"0\"} 2000000000\n");
  assert_has(t, "factorps_sync_steps_completed_total{shard=\"0\"} 1\n");
  assert_has(t, "factorps_sync_workers_waited_total{shard=\"0\"} 4\n");
  assert_has(t, "factorps_waiting_pushes{shard=\"0\"} 2\n");
  assert_has(t, "factorps_ssp_staleness_steps_bucket{shard=\"0\",le=\"2\"} 0\n");
  assert_has(t, "factorps_ssp_staleness_steps_bucket{shard=\"0\",le=\"4\"} 1\n");
  assert_has(t, "process_open_fds{shard=\"0\"} ");
  assert_has(t, "process_cpu_seconds_total{shard=\"0\"} ");
  assert_has(t, "factorps_rpc_received_bytes_total{shard=\"0\",method=\"Pull\"} 5\n");
  assert_has(t, "factorps_rpc_sent_bytes_total{shard=\"0\",method=\"Pull\"} 6\n");
  assert_has(t, "factorps_exchange_sent_bytes_total{shard=\"0\"} 164\n");
  assert_has(t, "factorps_exchange_received_bytes_total{shard=\"0\"} 328\n");
  assert_has(t, "factorps_exchange_failures_total{shard=\"0\"} 1\n");
  assert_has(t, "factorps_exchange_duration_seconds_count{shard=\"0\"} 1\n");
  assert_has(t, "factorps_exchange_duration_seconds_sum{shard=\"0\"} 0.25\n");
  free(t);

  fps_metrics_state_add_tensor(15, &sz);
  fps_metrics_state_add_tensor(15, NULL);
  t = render();
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"row\"} 5\n");
  assert_has(t, "factorps_adamw_equivalent_state_elements{shard=\"0\"} 56\n");
  assert_has(t, "factorps_parameter_elements{shard=\"0\"} 37\n");
  assert_has(t, "factorps_tensors{shard=\"0\"} 3\n");
  free(t);

  fps_metrics_state_add(NULL); /* ignored: the totals stay */
  t = render();
  assert_has(t, "factorps_tensors{shard=\"0\"} 3\n");
  assert_has(t, "factorps_optimizer_state_elements{shard=\"0\",kind=\"row\"} 5\n");
  free(t);
}

static void test_checkpoint_series(void **st) {
  (void)st;
  fps_metrics_config_t c = {.shard_id = 3, .checkpoint_interval = 300};
  assert_int_equal(fps_metrics_init(&c), 0);
  char *t = render();
  /* Before start-up decides: disabled, nothing written, every reason at 0. */
  assert_has(t, "factorps_checkpoint_interval_seconds{shard=\"3\"} 300\n");
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"disabled\"} 1\n");
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"restored\"} 0\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"no_space\"} 0\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"other\"} 0\n");
  assert_has(t, "factorps_checkpoint_last_success_timestamp_seconds{shard=\"3\"} 0\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_count{shard=\"3\"} 0\n");
  free(t);

  fps_metrics_restore_set(FPS_METRICS_RESTORE_RESTORED, 41, 1700000000.5, 2.25);
  fps_metrics_restore_set((fps_metrics_restore_t)99, 1, 1, 1); /* ignored */
  fps_metrics_update_observe(0.001, 10);
  fps_metrics_update_observe(0.001, 10);
  t = render();
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"disabled\"} 0\n");
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"restored\"} 1\n");
  assert_has(t, "factorps_checkpoint_restored_sequence{shard=\"3\"} 41\n");
  assert_has(t, "factorps_checkpoint_restore_duration_seconds{shard=\"3\"} 2.25\n");
  assert_has(t, "factorps_checkpoint_last_success_sequence{shard=\"3\"} 41\n");
  assert_has(t, "factorps_checkpoint_last_success_timestamp_seconds{shard=\"3\"} 1700000000.5\n");
  assert_has(t, "factorps_checkpoint_unsaved_updates{shard=\"3\"} 2\n");
  free(t);

  uint64_t mark = fps_metrics_checkpoint_mark();
  assert_int_equal(mark, 2);
  fps_metrics_update_observe(0.001, 10); /* races with the copy: still counted unsaved */
  fps_metrics_checkpoint_written(42, 1700000300.25, 1.5, 1000, mark);
  fps_metrics_checkpoint_written(43, 1700000600.75, 20, 3000, fps_metrics_checkpoint_mark());
  fps_metrics_checkpoint_failed(FPS_METRICS_CKPT_NO_SPACE);
  fps_metrics_checkpoint_failed(FPS_METRICS_CKPT_NO_SPACE);
  fps_metrics_checkpoint_failed(FPS_METRICS_CKPT_IO);
  fps_metrics_checkpoint_failed((fps_metrics_ckpt_reason_t)77); /* counted as other */
  fps_metrics_update_observe(0.001, 10);
  t = render();
  assert_has(t, "factorps_checkpoint_last_success_sequence{shard=\"3\"} 43\n");
  assert_has(t, "factorps_checkpoint_last_success_timestamp_seconds{shard=\"3\"} 1700000600.75\n");
  assert_has(t, "factorps_checkpoint_last_success_size_bytes{shard=\"3\"} 3000\n");
  assert_has(t, "factorps_checkpoint_written_bytes_total{shard=\"3\"} 4000\n");
  assert_has(t, "factorps_checkpoint_unsaved_updates{shard=\"3\"} 1\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_bucket{shard=\"3\",le=\"1\"} 0\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_bucket{shard=\"3\",le=\"2.5\"} 1\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_bucket{shard=\"3\",le=\"30\"} 2\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_sum{shard=\"3\"} 21.5\n");
  assert_has(t, "factorps_checkpoint_duration_seconds_count{shard=\"3\"} 2\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"no_space\"} 2\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"io\"} 1\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"other\"} 1\n");
  assert_has(t, "factorps_checkpoint_failures_total{shard=\"3\",reason=\"busy\"} 0\n");
  free(t);

  fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 5, 9, 0);
  t = render();
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"refused\"} 1\n");
  assert_has(t, "factorps_checkpoint_restore_outcome{shard=\"3\",outcome=\"restored\"} 0\n");
  assert_has(t, "factorps_checkpoint_restored_sequence{shard=\"3\"} 0\n");
  free(t);
}

static void test_http_start_stop(void **st) {
  (void)st;
  fps_metrics_http_t *h = NULL;
  char pf[64];
  snprintf(pf, sizeof pf, "/tmp/fps-test-metrics-%d.port", (int)getpid());
  fps_metrics_http_opts_t o = {.listen = "127.0.0.1:0", .port_file = pf};
  assert_int_equal(fps_metrics_http_start(&o, &h), 0);
  assert_true(fps_metrics_http_port(h) > 0);
  FILE *f = fopen(pf, "r");
  assert_non_null(f);
  int port = 0;
  assert_int_equal(fscanf(f, "%d", &port), 1);
  fclose(f);
  remove(pf);
  assert_int_equal(port, fps_metrics_http_port(h));
  /* The same port again is in use: reported at start, not later. */
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", fps_metrics_http_port(h));
  fps_metrics_http_t *h2 = NULL;
  fps_metrics_http_opts_t o2 = {.listen = addr};
  assert_int_equal(fps_metrics_http_start(&o2, &h2), FPS_EIO);
  assert_null(h2);
  fps_metrics_http_stop(h);
  fps_metrics_http_stop(NULL);

  const char *bad[] = {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:70000", "1.2.3.4.5:1",
                       "127.0.0.1:12ab", "[::1:5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    fps_metrics_http_opts_t b = {.listen = bad[i]};
    assert_int_equal(fps_metrics_http_start(&b, &h2), FPS_EINVAL);
  }
  assert_int_equal(fps_metrics_http_start(NULL, &h2), FPS_EINVAL);
  fps_metrics_http_opts_t nodir = {.listen = "127.0.0.1:0", .port_file = "/nonexistent/dir/p"};
  assert_int_equal(fps_metrics_http_start(&nodir, &h2), FPS_EIO);
  fps_metrics_http_opts_t v6 = {.listen = "[::1]:0"};
  if (fps_metrics_http_start(&v6, &h2) == 0) { /* hosts without IPv6 skip this */
    assert_true(fps_metrics_http_port(h2) > 0);
    fps_metrics_http_stop(h2);
  }
}

/* Every allocation of a render failing in turn: FPS_ENOMEM, nothing
 * leaked (ASan checks), and a later render works. */
static void test_render_oom_sweep(void **st) {
  (void)st;
  fps_metrics_config_t c = {.shard_id = 1};
  assert_int_equal(fps_metrics_init(&c), 0);
  fps_metrics_rpc_observe(FPS_METRICS_PUSHPULL, 0, 0.001, 1, 1);
  int n;
  for (n = 0; n < 64; n++) {
    realloc_calls = 0;
    realloc_fail_at = n;
    char *out = (char *)1;
    size_t len = 7;
    int rc = fps_metrics_render(&out, &len);
    realloc_fail_at = -1;
    if (rc == 0) {
      free(out);
      break;
    }
    assert_int_equal(rc, FPS_ENOMEM);
    assert_ptr_equal(out, (char *)1); /* a failed call changes nothing */
    assert_int_equal(len, 7);
  }
  assert_true(n > 0 && n < 64);
  free(render());
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_init_rejects_null),
      cmocka_unit_test(test_rpc_series),
      cmocka_unit_test(test_state_and_update),
      cmocka_unit_test(test_checkpoint_series),
      cmocka_unit_test(test_http_start_stop),
      cmocka_unit_test(test_render_oom_sweep),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Reads gauges from a shard's /metrics over loopback HTTP (the load test
 * watches the shard's heap through them). */
#ifndef FPS_TEST_SCRAPE_H
#define FPS_TEST_SCRAPE_H

#include <stddef.h>

/* GETs http://127.0.0.1:port/metrics (2 s bound) and stores, for each of
 * the n series names, the value of its first sample in vals[i] (NaN if
 * the series is absent). Returns 0, or -1 if the request failed. */
int fps_test_scrape(int port, const char *const *names, double *vals, size_t n);

/* The port a shard wrote to --metrics-port-file, or -1. */
int fps_test_read_port(const char *path);

#endif

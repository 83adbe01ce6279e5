#!/usr/bin/python3
"""Unit checks of the demo's report arithmetic (client/python/examples/
demo_report.py): /metrics parsing, histogram quantiles, per-interval series,
the state table's totals and ratios."""
import math
import os
import sys

sys.path.insert(0, os.path.join(sys.argv[1], "client/python/examples"))
import demo_report as d  # noqa: E402

METRICS = """# HELP factorps_rpc_duration_seconds RPC wall time
factorps_rpc_duration_seconds_bucket{shard="0",method="PushPull",le="0.001"} %d
factorps_rpc_duration_seconds_bucket{shard="0",method="PushPull",le="0.01"} %d
factorps_rpc_duration_seconds_bucket{shard="0",method="PushPull",le="+Inf"} %d
factorps_rpc_duration_seconds_bucket{shard="0",method="Pull",le="0.001"} 999
factorps_rpc_received_bytes_total{shard="0",method="PushPull"} %d
factorps_rpc_sent_bytes_total{shard="0",method="PushPull"} %d
"""

a = d.parse_metrics(METRICS % (0, 0, 0, 0, 0))
b = d.parse_metrics(METRICS % (50, 100, 100, 4_000_000, 2_000_000))
assert b["buckets"] == [(0.001, 50.0), (0.01, 100.0), (math.inf, 100.0)], b
assert (b["rx"], b["tx"]) == (4e6, 2e6), b
# Half the pushes below 1 ms: p50 is 1 ms; p90 is 80% into the (1, 10] ms bucket.
assert abs(d.quantile(0.5, b["buckets"]) - 0.001) < 1e-12
assert abs(d.quantile(0.9, b["buckets"]) - (0.001 + 0.009 * 0.8)) < 1e-12
assert d.quantile(0.5, [(0.001, 0.0), (math.inf, 0.0)]) is None
s = d.series_from_samples({0: [(0.0, a), (2.0, b)]})["0"]
assert s["t"] == [1.0] and s["in_mb_s"] == [2.0] and s["out_mb_s"] == [1.0], s
assert s["p50_ms"] == [1.0] and abs(s["p90_ms"][0] - 8.2) < 1e-9, s
# An interval in which no push finished has no point.
assert d.series_from_samples({0: [(0.0, b), (1.0, b)]})["0"]["t"] == []

stats = [dict(shard_id=0, tensors=2, param_elements=100, state_elements=20, state_bytes=80,
              adamw_elements=200, adamw_bytes=800),
         dict(shard_id=1, tensors=1, param_elements=50, state_elements=5, state_bytes=20,
              adamw_elements=100, adamw_bytes=400)]
rows = d.state_rows(stats)
assert [r["shard"] for r in rows] == ["0", "1", "total"]
assert rows[-1]["state"] == 25 and rows[-1]["adamw"] == 300 and rows[-1]["ratio"] == 12.0
assert rows[0]["ratio"] == 10.0 and rows[1]["ratio"] == 20.0
print("ok")

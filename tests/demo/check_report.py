#!/usr/bin/python3
"""Runs the main command's language-model job briefly (scripts/demo.sh
--prebuilt, few steps) and checks its report against what it printed:

- the demo succeeds and prints where the report went;
- the PNG exists, is a PNG, and has the size demo_report draws (FIG_INCHES x
  FIG_DPI pixels);
- the JSON beside it (exactly what write_report plots) matches the printed
  figures: the state table (per shard and total: tensors, parameters,
  Adafactor and AdamW elements and MB, ratio), the held-out loss, one loss
  and lr series per worker with one point per step, the lr series being
  the LambdaLR schedule, and push series for every shard;
- --no-plot writes the JSON and no PNG.

    check_report.py SOURCE_DIR BUILD_DIR
"""

import json
import os
import re
import struct
import subprocess
import sys
import tempfile

src, build = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(src, "client/python/examples"))
import demo_report  # noqa: E402
from train_lm import warmup_cosine  # noqa: E402

STEPS, WORKERS = 12, 2
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(out, *extra, steps=STEPS):
    cmd = [os.path.join(src, "scripts/demo.sh"), "--prebuilt", "--build-dir", build,
           "--steps", str(steps), "--workers", str(WORKERS), "--out", out, *extra, "--",
           "--max-loss", "5.4", "--eval-windows", "16", "--sample-bytes", "40"]
    r = subprocess.run(cmd, text=True, capture_output=True, timeout=900)
    print(r.stdout)
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        sys.exit(f"FAIL: demo exited {r.returncode}")
    return r.stdout


with tempfile.TemporaryDirectory(prefix="factorps-report.") as tmp:
    out = os.path.join(tmp, "out")
    text = run(out)
    png, js = os.path.join(out, "report.png"), os.path.join(out, "report.json")
    check(f"report: {js} and {png}" in text, "the demo prints both paths")
    with open(png, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n", "report.png is a PNG")
    w, h = struct.unpack(">II", head[16:24])
    want = (demo_report.FIG_INCHES[0] * demo_report.FIG_DPI,
            demo_report.FIG_INCHES[1] * demo_report.FIG_DPI)
    check((w, h) == want, f"report.png is {w}x{h}, expected {want[0]}x{want[1]}")
    check(os.path.getsize(png) > 20000, f"report.png has content ({os.path.getsize(png)} B)")
    with open(js) as f:
        data = json.load(f)

    # The state table, as printed, against the plotted rows.
    printed = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(\d+|total)\s+(\d+)\s+([\d,]+)\s+([\d,]+) el\s+([\d.e+-]+) MB\s+"
                     r"([\d,]+) el\s+([\d.e+-]+) MB\s+(\d+)x$", line)
        if m:
            printed[m.group(1)] = [m.group(i) for i in range(2, 9)]
    check(len(data["state"]) == 3 and set(printed) == {"0", "1", "total"},
          f"state rows: printed {sorted(printed)}, plotted {[r['shard'] for r in data['state']]}")
    for r in data["state"]:
        p = printed.get(r["shard"])
        if not p:
            continue
        mine = [str(r["tensors"]), f"{r['params']:,}", f"{r['state']:,}",
                f"{r['state_bytes'] / 1e6:.3g}", f"{r['adamw']:,}",
                f"{r['adamw_bytes'] / 1e6:.3g}", f"{r['ratio']:.0f}"]
        check(mine == p, f"shard {r['shard']}: plotted {mine}, printed {p}")
    tot = data["state"][-1]
    check(tot["state"] == sum(r["state"] for r in data["state"][:-1]), "total state is the sum")
    check(tot["ratio"] >= 100, f"AdamW/Adafactor {tot['ratio']:.0f}x, at least 100x")

    m = re.search(r"^held-out loss (\d+\.\d+) nats per byte", text, re.M)
    check(m and f"{data['heldout']['loss'][0]:.3f}" == m.group(1),
          f"held-out loss printed {m and m.group(1)}, plotted {data['heldout']['loss']}")
    check(sorted(data["workers"]) == [str(i) for i in range(WORKERS)], "one series per worker")
    sched = warmup_cosine(max(1, STEPS // 10), STEPS)
    for wid, s in data["workers"].items():
        check(s["step"] == list(range(1, STEPS + 1)), f"worker {wid}: one point per step")
        check(len(s["loss"]) == STEPS and all(0 < v < 10 for v in s["loss"]),
              f"worker {wid}: losses")
        lr0 = s["lr"][0] / sched(0)
        check(all(abs(v - lr0 * sched(i)) < 1e-12 for i, v in enumerate(s["lr"])),
              f"worker {wid}: the lr series is the LambdaLR schedule")
    check(data["workers"]["0"]["lr"] == data["workers"]["1"]["lr"], "both workers' lr agree")
    check(sorted(data["push"]) == ["0", "1"] and all(len(s["t"]) >= 1 and
                                                    len(s["t"]) == len(s["p99_ms"])
                                                    for s in data["push"].values()),
          "push series for both shards")
    for s in data["push"].values():
        check(all(a <= b <= c for a, b, c in zip(s["p50_ms"], s["p90_ms"], s["p99_ms"])),
              "p50 <= p90 <= p99")

    out2 = os.path.join(tmp, "noplot")
    text = run(out2, "--no-plot", steps=2)
    check(os.path.exists(os.path.join(out2, "report.json")) and
          not os.path.exists(os.path.join(out2, "report.png")),
          "--no-plot: JSON only")

if failures:
    sys.exit(f"{len(failures)} check(s) failed")
print("ok")

#!/usr/bin/python3
"""Push chunk sizes against each other, interleaved, on loopback.

    /usr/bin/python3 tests/bench/push_chunks.py [--build build] [--reps 3]
        [--chunks 0,8Mi] [--params 10M] [--workers 4] [--modes sync]
        [--wire f32] [--steps-10m 8] [--steps-100m 3] [--warmup 1]
        [--shard-flags=--http2-bdp-probe=true [--shard-flags=]]

For every (params, workers, mode, wire) the chunk sizes run interleaved,
A B A B ..., each on a fresh pair of shards (S = 2 on 127.0.0.1) with
`factorps load --model peer --push-chunk-bytes C` (0: one call per shard,
the unchunked path). --shard-flags given more than once makes every chunk
size run once per set of shard flags, interleaved too (an A/B of a shard
knob: --shard-flags= --shard-flags=--http2-bdp-probe=true). Printed per
configuration and contender: median steps/s, its ratio to the first one
listed (the baseline), the CPU-seconds per step of the shards and of the
load process (from /proc/PID/stat, utime + stime, whole run including
warm-up and Create), the larger shard's VmHWM (peak RSS, max over the runs),
plus the load average and the host's steal over the configuration: a busy
machine slows every contender of a round alike, so read the ratios.
Only loopback is used; every process started here is stopped on exit.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The shards start and stop as side_by_side's do; its children list is the
# one the exit path below cleans up.
from side_by_side import children, start_shards, stop  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def count(s):
    m = re.fullmatch(r"(\d+)([kKmMgG]?)(i?)", s)
    if not m:
        raise SystemExit(f"push_chunks: bad count {s!r}")
    base = 1024 if m.group(3) else 1000
    return int(m.group(1)) * base ** " kmg".index(m.group(2).lower() or " ")


def cpu_s(pid):
    """utime + stime of a process (and its waited-for children), seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            f = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in f[11:15]) / TICK
    except OSError:
        return float("nan")


def steal():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[7], sum(v)


def vm_hwm_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) / 1024 if m else float("nan")
    except OSError:
        return float("nan")


def run_once(a, tmp, n, w, mode, wire, chunk, flags, steps):
    procs, addrs = start_shards(a.build, tmp, mode, w, flags.split())
    try:
        cmd = [os.path.join(a.build, "client", "factorps"), "load", "--shards", ",".join(addrs),
               "--model", "peer", "--params", str(n), "--workers", str(w), "--steps",
               str(steps + a.warmup), "--warmup", str(a.warmup), "--mode-hint", mode,
               "--wire-dtype", wire, "--deadline", "900", "--push-chunk-bytes", str(chunk)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        children.append(p)
        out, _ = p.communicate(timeout=1800)
        children.remove(p)
        # The load process has exited: its CPU is in its parent's view only
        # through wait(); read it from the resource usage of children.
        shard_cpu = sum(cpu_s(x.pid) for x in procs)
        hwm = max(vm_hwm_mib(x.pid) for x in procs)
    finally:
        stop(procs)
    m = re.search(r"^RESULT .*$", out, re.M)
    if p.returncode or not m:
        raise RuntimeError(f"factorps load failed ({p.returncode}): {out[-2000:]}")
    kv = dict(x.split("=", 1) for x in m.group(0).split()[1:])
    return float(kv["steps_per_s"]), shard_cpu, hwm


def name(c):
    return f"chunk {c[0]}" + (f" {c[1]}" if c[1] else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", default="0,8Mi")
    ap.add_argument("--params", default="10M")
    ap.add_argument("--workers", default="4")
    ap.add_argument("--modes", default="sync")
    ap.add_argument("--wire", default="f32")
    ap.add_argument("--steps-10m", type=int, default=8)
    ap.add_argument("--steps-100m", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--shard-flags", action="append",
                    help="flags for every shard; repeated: one contender per set")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    flagsets = a.shard_flags or [""]
    chunks = [(count(c), f) for f in flagsets for c in a.chunks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for n in [count(x) for x in a.params.split(",")]:
            steps = a.steps_10m if n < 50_000_000 else a.steps_100m
            for w in [int(x) for x in a.workers.split(",")]:
                for mode in a.modes.split(","):
                    for wire in a.wire.split(","):
                        res = {c: [] for c in chunks}
                        st0, tot0 = steal()
                        t0 = time.time()
                        for r in range(a.reps):
                            for c in chunks:
                                before = os.times()
                                sps, shard_cpu, hwm = run_once(a, tmp, n, w, mode, wire, c[0], c[1],
                                                               steps)
                                after = os.times()
                                load_cpu = (after.children_user + after.children_system -
                                            before.children_user - before.children_system)
                                # Shards are stopped: their CPU lands in children too.
                                load_cpu -= shard_cpu
                                total_steps = steps + a.warmup
                                res[c].append((sps, shard_cpu / total_steps, load_cpu / total_steps,
                                               hwm))
                                log(f"  {n} W{w} {mode} {wire} {name(c)}: {sps:.3f} steps/s, "
                                    f"VmHWM {hwm:.0f} MiB")
                        st1, tot1 = steal()
                        la = os.getloadavg()
                        base = statistics.median(x[0] for x in res[chunks[0]])
                        print(f"{n} W{w} {mode} {wire}: {time.time() - t0:.0f} s, load {la[0]:.1f} "
                              f"{la[1]:.1f}, steal {100.0 * (st1 - st0) / max(1, tot1 - tot0):.0f}%")
                        for c in chunks:
                            med = statistics.median(x[0] for x in res[c])
                            print(f"  {name(c):>10}: steps/s {med:.3f} (runs "
                                  f"{' '.join(f'{x[0]:.3f}' for x in res[c])}), "
                                  f"x{med / base:.2f} of {name(chunks[0])}, CPU-s/step shards "
                                  f"{statistics.median(x[1] for x in res[c]):.3f} load "
                                  f"{statistics.median(x[2] for x in res[c]):.3f}, shard VmHWM "
                                  f"{max(x[3] for x in res[c]):.0f} MiB", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        stop([p for p in children if isinstance(p, subprocess.Popen)])

#!/usr/bin/python3
"""What a standby costs: steps/s with a standby per shard against without,
interleaved, on loopback.

    /usr/bin/python3 tests/bench/replica_cost.py [--build build] [--reps 3]
        [--params 10M,100M] [--workers 2] [--modes sync,async]
        [--steps-10m 8] [--steps-100m 3] [--warmup 1] [--json OUT]
        [--base-build OTHER_BUILD] [--standby-cpus LIST]
        [--split-min-bytes N]

For every (params, workers, mode) the two set-ups run interleaved, A B A B
..., each on fresh shards (S = 2 on 127.0.0.1) with `factorps load --model
peer`: "solo", two shards as today; "standby", the same two shards each
with a standby (--replica-peer, --lease file:), the load's --shards listing
both replicas of each shard ("p0|s0,p1|s1"); the load starts once both
standbys have joined (their primaries' /metrics). Printed per configuration:
median steps/s of each, standby / solo (the issue's target: >= 0.8), and
the bytes each primary sent its standby per step (factorps_replication_
sent_bytes_total over the load, which includes the Create's one transfer
of the initial values, divided by its steps) against the job's bytes per
step (gradients in + parameters out, all workers), and the CPU seconds
per step of each role (primaries, standbys, the load) from /proc over the
load. A busy machine slows
both set-ups of a round alike, so read the ratios. --standby-cpus 1 pins
the standbys to CPU 1 and everything else (the primaries, the solo shards,
the load) to the other CPUs, in both set-ups: the standbys as on a host of
their own, which is what they are for, instead of sharing the job's CPUs.
--split-min-bytes N: the load splits every tensor of at least N bytes
into row blocks over both shards (sync only), and the shards get --peers
(with standbys "p0|s0,p1|s1"): the cost of standbys for split blocks.
Only loopback is used; every process started here is stopped on exit.
"""

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
from fpsproc import free_ports  # noqa: E402  (the one shard launcher's port picker)
children = []


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def count(s):
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", s)
    if not m:
        raise SystemExit(f"replica_cost: bad count {s!r}")
    return int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]




def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p in children:
            children.remove(p)


def read_int(path):
    try:
        with open(path) as f:
            t = f.read().strip()
        return int(t) if t else None
    except (OSError, ValueError):
        return None


def pinned(cpus):
    """A preexec_fn that pins the child to `cpus` (None: no pinning)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def start(build, tmp, name, args, cpus=None):
    """One factorps-server on 127.0.0.1 with metrics: (proc, port, metrics port)."""
    pf, mf = os.path.join(tmp, name + ".port"), os.path.join(tmp, name + ".mport")
    for f in (pf, mf):
        if os.path.exists(f):
            os.unlink(f)
    listen = args.pop(0)
    lf = open(os.path.join(tmp, name + ".log"), "w")
    p = subprocess.Popen([os.path.join(build, "server", "factorps-server"), "--listen", listen,
                          "--port-file", pf, "--metrics-listen", "127.0.0.1:0",
                          "--metrics-port-file", mf, "--log-level", "warn", *args],
                         stdout=lf, stderr=subprocess.STDOUT, preexec_fn=pinned(cpus))
    children.append(p)
    for _ in range(1500):
        port, mport = read_int(pf), read_int(mf)
        if port and mport:
            return p, port, mport
        if p.poll() is not None:
            raise RuntimeError(f"{name} died: {open(os.path.join(tmp, name + '.log')).read()[-2000:]}")
        time.sleep(0.02)
    raise RuntimeError(f"{name} wrote no port")


def cpu_s(p):
    """CPU seconds (user + system) process p has used so far."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def metric(mport, name, label=""):
    """The value of metric `name` (the series whose labels include `label`,
    e.g. 'role="primary"'), or None."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    for m in re.finditer(r"^%s(?:\{([^}]*)\})? (\S+)$" % re.escape(name), text, re.M):
        if label in (m.group(1) or ""):
            return float(m.group(2))
    return None


def start_job(build, tmp, mode, w, standby, job_cpus=None, standby_cpus=None, split=False):
    """Two shards, each with a standby if `standby`: (procs, entries,
    metrics ports of the primaries). The CPUs: of the primaries (or solo
    shards) and of the standbys, None: any. split: the shards know each
    other (--peers), for split tensors."""
    procs, entries, mports = [], [], []
    ports = [free_ports(2) for _ in range(2)]
    peers = ",".join((f"127.0.0.1:{a}|127.0.0.1:{b}" if standby else f"127.0.0.1:{a}") for a, b in ports)
    try:
        for i in range(2):
            common = ["--shard-id", str(i), "--shard-count", "2", "--mode", mode, "--workers",
                      str(w), "--deadline", "600"] + (["--peers", peers] if split else [])
            if not standby:
                p, port, mport = start(build, tmp, f"s{i}", [f"127.0.0.1:{ports[i][0]}", *common], job_cpus)
                procs.append(p)
                entries.append(f"127.0.0.1:{port}")
                mports.append(mport)
                continue
            a, b = ports[i]
            lease = os.path.join(tmp, f"lease{i}")
            if os.path.exists(lease):
                os.unlink(lease)
            rep = lambda me, other: [f"127.0.0.1:{me}", *common, "--replica-peer",
                                     f"127.0.0.1:{other}", "--lease", "file:" + lease]
            p, _, mport = start(build, tmp, f"p{i}", rep(a, b), job_cpus)
            procs.append(p)
            for _ in range(500):  # the first one takes the lease
                if metric(mport, "factorps_replica_role", 'role="primary"') == 1:
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"shard {i}: no primary")
            s, _, _ = start(build, tmp, f"b{i}", rep(b, a), standby_cpus)
            procs.append(s)
            entries.append(f"127.0.0.1:{a}|127.0.0.1:{b}")
            mports.append(mport)
        if standby:
            for i, mport in enumerate(mports):
                for _ in range(1500):
                    if metric(mport, "factorps_replica_standby_joined") == 1:
                        break
                    time.sleep(0.02)
                else:
                    raise RuntimeError(f"shard {i}: the standby did not join")
        return procs, entries, mports
    except BaseException:
        stop(procs)
        raise


def run_once(a, tmp, n, w, mode, standby, steps, server_build=None):
    procs, entries, mports = start_job(server_build or a.build, tmp, mode, w, standby, a.job_cpus,
                                       a.standby_cpus, split=a.split_min_bytes > 0)
    try:
        sent0 = [metric(m, "factorps_replication_sent_bytes_total") or 0.0 for m in mports]
        cpu0 = [cpu_s(p) for p in procs]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = [os.path.join(a.build, "client", "factorps"), "load", "--shards", ",".join(entries),
               "--model", "peer", "--params", str(n), "--workers", str(w), "--steps",
               str(steps + a.warmup), "--warmup", str(a.warmup), "--mode-hint", mode,
               "--deadline", str(a.deadline)]
        if a.split_min_bytes:
            cmd += ["--split-min-bytes", str(a.split_min_bytes)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=3600, preexec_fn=pinned(a.job_cpus)).stdout
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu1 = [cpu_s(p) for p in procs]
        sent = sum((metric(m, "factorps_replication_sent_bytes_total") or 0.0) - s0
                   for m, s0 in zip(mports, sent0))
    finally:
        stop(procs)
    m = re.search(r"^RESULT .*$", out, re.M)
    if not m:
        raise RuntimeError(f"factorps load failed: {out[-2000:]}")
    kv = dict(x.split("=", 1) for x in m.group(0).split()[1:])
    # Steps the load made, Create aside: every worker's (async), or rounds (sync).
    total_steps = (steps + a.warmup) * (w if mode != "sync" else 1)
    # CPU seconds per step by role over the load (start_job's order: p0
    # b0 p1 b1 with standbys, s0 s1 without; the load is the only child
    # reaped meanwhile). Steps here are the load's: rounds (sync) or pushes.
    d = [y - x for x, y in zip(cpu0, cpu1)]
    role = {"primary": sum(d[0::2]) if standby else sum(d), "standby": sum(d[1::2]) if standby else 0.0,
            "load": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)}
    kv["cpu"] = {k: v / total_steps for k, v in role.items()}
    return float(kv["steps_per_s"]), sent / total_steps, kv


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--params", default="10M,100M")
    ap.add_argument("--workers", default="2")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--steps-10m", type=int, default=8)
    ap.add_argument("--steps-100m", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=300.0, help="of each load call")
    ap.add_argument("--json")
    ap.add_argument("--base-build", help="another build (e.g. of the base commit) whose factorps-server "
                    "also runs the standby set-up, interleaved (solo, base, this), for a before/after "
                    "ratio in one run; the load is --build's")
    ap.add_argument("--split-min-bytes", type=int, default=0,
                    help="split tensors of at least this many bytes over both shards (sync only)")
    ap.add_argument("--standby-cpus", help="CPUs of the standbys (e.g. 1); the rest run on the others")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    a.job_cpus = None
    if a.standby_cpus:
        a.standby_cpus = {int(x) for x in a.standby_cpus.split(",")}
        a.job_cpus = os.sched_getaffinity(0) - a.standby_cpus
        if not a.job_cpus or not a.standby_cpus <= os.sched_getaffinity(0):
            raise SystemExit("replica_cost: --standby-cpus must name CPUs of "
                             f"{sorted(os.sched_getaffinity(0))} and leave some to the job")
    arms = [("solo", False, None), ("standby", True, None)]
    if a.base_build:
        arms.insert(1, ("base", True, os.path.abspath(a.base_build)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [count(x) for x in a.params.split(",")]:
            steps = a.steps_10m if n < 50_000_000 else a.steps_100m
            for w in [int(x) for x in a.workers.split(",")]:
                for mode in a.modes.split(","):
                    res = {name: [] for name, _, _ in arms}
                    t0 = time.time()
                    for r in range(a.reps):
                        for name, standby, sb in arms:
                            sps, per_step, kv = run_once(a, tmp, n, w, mode, standby, steps, sb)
                            res[name].append((sps, per_step, kv))
                            log(f"  {n} W{w} {mode} {name}: {sps:.3f} steps/s")
                    sps = {k: statistics.median(x[0] for x in v) for k, v in res.items()}
                    extra = {k: statistics.median(x[1] for x in v) for k, v in res.items()}
                    solo = sps["solo"]
                    # The job's own bytes per step: gradients in and
                    # parameters out, 4 bytes each, per push (sync: W per round).
                    params = int(res["standby"][0][2]["params"])
                    job = 8 * params * (w if mode == "sync" else 1)
                    la = os.getloadavg()
                    print(f"{n} W{w} {mode}: {time.time() - t0:.0f} s, load {la[0]:.1f}", flush=True)
                    print(f"  solo    steps/s {solo:.3f} (runs "
                          f"{' '.join(f'{x[0]:.3f}' for x in res['solo'])})")
                    for k in res:
                        if k == "solo":
                            continue
                        print(f"  {k:7s} steps/s {sps[k]:.3f} (runs "
                              f"{' '.join(f'{x[0]:.3f}' for x in res[k])}), x{sps[k] / solo:.2f} "
                              f"of solo; replication {extra[k] / 1e6:.1f} MB per step, the job "
                              f"{job / 1e6:.1f} MB per step (x{extra[k] / job:.2f})", flush=True)
                    cpu = {name: {k: statistics.median(x[2]["cpu"][k] for x in v)
                                  for k in ("primary", "standby", "load")} for name, v in res.items()}
                    for name, c in cpu.items():
                        print(f"  cpu s/step {name:7s}: " + " ".join(f"{k} {v:.4f}" for k, v in c.items()),
                              flush=True)
                    results.append({"params": n, "workers": w, "mode": mode, "solo_steps_per_s": solo,
                                    "standby_steps_per_s": sps["standby"], "ratio": sps["standby"] / solo,
                                    "base_ratio": sps["base"] / solo if "base" in sps else None,
                                    "replication_bytes_per_step": extra["standby"],
                                    "job_bytes_per_step": job, "load_average": la[0],
                                    "cpu_s_per_step": cpu,
                                    "runs": {k: [x[0] for x in v] for k, v in res.items()}})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    finally:
        stop([p for p in children if isinstance(p, subprocess.Popen)])

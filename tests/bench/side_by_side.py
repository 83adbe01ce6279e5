#!/usr/bin/python3
"""factorps against the torch.distributed.rpc peer, side by side.

    /usr/bin/python3 tests/bench/side_by_side.py [--build build] [--reps 3]
        [--params 10M,100M] [--workers 2,4] [--modes sync,async] [--bf16|--no-bf16]
        [--peer-tcp|--no-peer-tcp] [--peer-tcp-channels mpt_uv]
        [--steps-10m 8] [--steps-100m 3] [--warmup 1] [--peers DIR] [--json OUT]
        [--iperf-seconds 5] [--no-iperf]

For every (params, workers, mode) the contenders run interleaved, A B C D A B
C D ..., each on a fresh pair of shards (S = 2 on 127.0.0.1), on the same
tensors: `factorps load --model peer` (64 tensors shaped like the peer's
model_shapes), fp32 on the wire; the same with --wire-dtype bf16; the peer,
../shared/peers/torch_rpc_ps.py (TensorPipe's default transport,
--synthetic-grads: the issue's baseline); and the same peer over plain TCP
("peer tcp": --transports uv --channels mpt_uv; with --transports uv alone
TensorPipe still moves the tensors between processes with CMA,
process_vm_readv, not through TCP). A busy machine slows every contender of
a round alike, so the ratios of the medians are the figures to read.

iperf3 measures the loopback before and after each configuration's runs,
both as one stream and as W x S parallel streams (-P, the job's connection
count: every worker holds one connection to each shard); bytes moved are
printed against both. Printed per configuration: median steps/s (per worker;
in sync, model steps), factorps / peer, factorps / peer tcp, bf16 / fp32,
bytes moved (gradients in + parameters out, all workers), and each shard's
peak RSS (VmHWM, max over the runs). For sync, each factorps shard's peak is
set against the sync memory bound (docs/shards.md, "Memory: copies of a tensor"):
1.15 x (its parameters + optimizer state) + its parameter bytes (the
round's fp32 sum) + the slices staged ahead of lower workers + 64 MiB,
with the sizes from the shard's Stats; with chunked pushes (the load's
default) those are up to (W - 1) x its parameter bytes as sent, with one
call per shard W x the largest message in flight (4 MiB).

The peer is a measuring tool outside the product: when its folder (default
../shared/peers next to the repository, or --peers / $FPS_PEERS_DIR) is
absent, its columns are skipped and factorps still runs. Only loopback is
used; every process started here is stopped on exit.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = "/usr/bin/python3"
children = []


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def count(s):
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", s)
    if not m:
        raise SystemExit(f"side_by_side: bad count {s!r}")
    return int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]


def vmhwm_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


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


def start_shards(build, tmp, mode, workers, flags=()):
    """Two shards on 127.0.0.1 (port 0), `flags` added to each: (procs, addrs)."""
    procs, addrs = [], []
    for i in range(2):
        pf = os.path.join(tmp, f"port{i}")
        if os.path.exists(pf):
            os.unlink(pf)
        lf = open(os.path.join(tmp, f"shard{i}.log"), "w")
        p = subprocess.Popen([os.path.join(build, "server", "factorps-server"), "--listen",
                              "127.0.0.1:0", "--shard-id", str(i), "--shard-count", "2", "--mode",
                              mode, "--workers", str(workers), "--deadline", "600", "--port-file",
                              pf, *flags], stdout=lf, stderr=subprocess.STDOUT)
        children.append(p)
        procs.append(p)
    for i, p in enumerate(procs):
        pf = os.path.join(tmp, f"port{i}")
        for _ in range(1000):
            if os.path.exists(pf) and os.path.getsize(pf) > 0:
                break
            if p.poll() is not None:
                stop(procs)
                raise RuntimeError(f"shard {i} died: {open(os.path.join(tmp, f'shard{i}.log')).read()}")
            time.sleep(0.02)
        addrs.append("127.0.0.1:" + open(pf).read().strip())
    return procs, addrs


def expect_params(n, k=64):
    """The element count of the peer's model_shapes(n, k), written out from
    its rule (torch_rpc_ps.py's docstring): L = (k-1)//6 layers of 12h^2+7h,
    k-1-6L vectors of h, an embedding (V, h) for the rest."""
    import math
    layers, extra = (k - 1) // 6, (k - 1) % 6
    h = max(64, int(math.sqrt(0.88 * n / (12 * layers)) // 64 * 64))
    used = layers * (12 * h * h + 7 * h) + extra * h
    return used + max(1, (n - used) // h) * h


def run_factorps(build, tmp, n, w, mode, steps, warmup, wire):
    procs, addrs = start_shards(build, tmp, mode, w)
    try:
        cmd = [os.path.join(build, "client", "factorps"), "load", "--shards", ",".join(addrs),
               "--model", "peer", "--params", str(n), "--workers", str(w), "--steps",
               str(steps + warmup), "--warmup", str(warmup), "--mode-hint", mode,
               "--wire-dtype", wire, "--deadline", "900"]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=1800)
        hwm = [vmhwm_mib(p.pid) for p in procs]  # read before the shards exit
        st = subprocess.run([os.path.join(build, "client", "factorps"), "stats", "--shards", ",".join(addrs),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)
    finally:
        stop(procs)
    try:
        shards = sorted(json.loads(st.stdout)["shards"], key=lambda x: x["shard_id"])
        bounds = [memory_bound_mib(x["param_bytes"] / MiB, x["state_bytes"] / MiB, w, wire=wire)
                  for x in shards]
    except (ValueError, KeyError):
        bounds = []
    m = re.search(r"^RESULT .*$", out.stdout, re.M)
    if out.returncode or not m:
        raise RuntimeError(f"factorps load failed ({out.returncode}): {out.stdout[-2000:]}")
    kv = dict(x.split("=", 1) for x in m.group(0).split()[1:])
    return {"steps_per_s": float(kv["steps_per_s"]), "gbps": float(kv["gb_per_s"]),
            "hwm": max(hwm), "hwms": hwm, "params": int(kv["params"]), "bounds": bounds}


MiB = float(1 << 20)
SHARDS = 2


def memory_bound_mib(param_mib, state_mib, workers, message_mib=4.0, frame_mib=1.0, chunked=True,
                     wire="f32"):
    """The sync memory bound for one shard holding param_mib of parameters
    and state_mib of optimizer state: an exact Adafactor step needs the
    round's whole fp32 sum (one more copy of the parameters) before any
    parameter may change, on top of 1.15 x what the shard holds and 64 MiB
    of fixed overhead. Slices that arrive ahead of the workers below them
    are staged as received: one call per shard (push_chunk_bytes 0) keeps
    them near one message per worker, and gRPC holds at most one HTTP/2
    frame more (the shard's --http2-max-frame); chunked pushes (the
    client's default) stage each higher worker's chunks whole while worker
    0 is behind, up to W - 1 gradients as sent (half in bf16)."""
    if chunked:
        ahead = (workers - 1) * param_mib * (0.5 if wire == "bf16" else 1.0)
    else:
        ahead = workers * (message_mib + frame_mib)
    return 1.15 * (param_mib + state_mib) + param_mib + ahead + 64.0


def run_peer(peers, n, w, mode, steps, warmup, channels=None):
    """One peer run; channels=None keeps TensorPipe's default transport and
    channel (the issue's baseline), a channel name forces the uv (TCP)
    transport with that channel."""
    cmd = [PY, os.path.join(peers, "torch_rpc_ps.py"), "--params", str(n), "--tensors", "64",
           "--workers", str(w), "--shards", str(SHARDS), "--steps", str(steps), "--warmup",
           str(warmup), "--mode", mode, "--synthetic-grads"]
    if channels:
        cmd += ["--transports", "uv", "--channels", channels]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=1800)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"peer failed ({out.returncode}): {out.stderr[-2000:]}")
    r = json.loads(lines[-1])
    if "error" in r:
        raise RuntimeError(f"peer error: {r['error'][-2000:]}")
    return {"steps_per_s": r["steps_per_s"], "gbps": r["pushed_GBps"],
            "hwm": max(s["vmhwm_MiB"] for s in r["servers"]),
            "hwms": [s["vmhwm_MiB"] for s in sorted(r["servers"], key=lambda s: s["shard"])],
            "params": r["params"]}


def iperf3(streams=1, seconds=5):
    """Loopback TCP bandwidth in GB/s, summed over `streams` parallel
    streams (iperf3 -P). iperf3 cannot listen on port 0: try a few random
    high ports."""
    import random
    for _ in range(5):
        port = random.randint(20000, 60000)
        srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children.append(srv)
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds),
                              "-P", str(streams), "-J"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stop([srv])
        if out.returncode == 0:
            return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
    return float("nan")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def shard_simd(tmp):
    """The kernel variant the shards reported at start-up ("... simd avx512)")."""
    try:
        m = re.search(r"simd (\w+)\)", open(os.path.join(tmp, "shard0.log")).read())
        return m.group(1) if m else "?"
    except OSError:
        return "?"


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def label_of(who, wire):
    return {("fps", "f32"): "fps/f32", ("fps", "bf16"): "fps/bf16", ("peer", None): "peer",
            ("peer", "tcp"): "peer tcp"}[(who, wire)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--params", default="10M,100M")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="also run factorps with --wire-dtype bf16 (default on)")
    ap.add_argument("--peer-tcp", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the peer over plain TCP (default on; needs the peer)")
    ap.add_argument("--peer-tcp-channels", default="mpt_uv",
                    help="TensorPipe channel of the peer tcp runs: mpt_uv (default) or basic")
    ap.add_argument("--steps-10m", type=int, default=8, help="timed steps at <= 10M params")
    ap.add_argument("--steps-100m", type=int, default=3, help="timed steps above 10M params")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--peers", default=os.environ.get("FPS_PEERS_DIR",
                                                        os.path.join(os.path.dirname(REPO), "shared", "peers")))
    ap.add_argument("--json", help="also write every run as JSON here")
    ap.add_argument("--iperf-seconds", type=int, default=5,
                    help="length of each iperf3 measurement (default 5)")
    ap.add_argument("--no-iperf", action="store_true", help="skip iperf3 (smoke tests)")
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    for b in ("server/factorps-server", "client/factorps"):
        if not os.access(os.path.join(build, b), os.X_OK):
            raise SystemExit(f"side_by_side: {build}/{b} not built (cmake --build {a.build})")
    if a.peer_tcp_channels not in ("mpt_uv", "basic"):
        raise SystemExit(f"side_by_side: --peer-tcp-channels {a.peer_tcp_channels!r}: "
                         "mpt_uv or basic (the channels that move tensors through TCP)")
    have_peer = os.path.isfile(os.path.join(a.peers, "torch_rpc_ps.py"))
    if not have_peer:
        log(f"side_by_side: no peer at {a.peers}: running factorps only")
    peer_tcp = have_peer and a.peer_tcp
    use_iperf = not a.no_iperf
    if use_iperf and not shutil.which("iperf3"):
        log("side_by_side: iperf3 not found (scripts/deps.sh test): its columns are skipped")
        use_iperf = False

    contenders = [("fps", "f32")] + ([("fps", "bf16")] if a.bf16 else []) + (
        [("peer", None)] if have_peer else []) + ([("peer", "tcp")] if peer_tcp else [])
    configs = [(count(n), n, int(w), m) for n in a.params.split(",") for m in a.modes.split(",")
               for w in a.workers.split(",")]
    runs = []
    tmp = tempfile.mkdtemp(prefix="fps-sbs-")
    print(f"# side by side: {SHARDS} shards on 127.0.0.1, {cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the start, "
          f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}", flush=True)
    nan = float("nan")

    def measure_loopback(w):  # {streams: GB/s}, one stream and one per connection of the job
        if not use_iperf:
            return {1: nan, w * SHARDS: nan}
        return {p: iperf3(p, a.iperf_seconds) for p in (1, w * SHARDS)}

    results = {}
    loopback = {}  # (label, w, mode) -> [before, after], each {streams: GB/s}
    failures = []
    for n, label, w, mode in configs:
        steps = a.steps_10m if n <= 10**7 else a.steps_100m
        conns = w * SHARDS
        before = measure_loopback(w)
        log(f"{label} W{w} {mode}: load average {os.getloadavg()[0]:.1f}; iperf3 before: "
            f"{before[1]:.2f} GB/s (1 stream), {before[conns]:.2f} GB/s (-P {conns})")
        for rep in range(a.reps):
            for who, wire in contenders:
                key = (label, w, mode, who, wire)
                try:
                    if who == "fps":
                        r = run_factorps(build, tmp, n, w, mode, steps, a.warmup, wire)
                    else:
                        r = run_peer(a.peers, n, w, mode, steps, a.warmup,
                                     a.peer_tcp_channels if wire == "tcp" else None)
                except Exception as e:  # one failed run must not hide the rest
                    log(f"side_by_side: {key} rep {rep}: {e}")
                    r = {"steps_per_s": nan, "gbps": nan, "hwm": nan}
                if who == "fps" and r.get("params") not in (None, expect_params(n)):
                    log(f"side_by_side: factorps load made {r['params']} parameters, "
                        f"the peer's shapes give {expect_params(n)}")
                    r["steps_per_s"] = nan
                if r["steps_per_s"] != r["steps_per_s"]:
                    failures.append(key)
                r.update(params_label=label, workers=w, mode=mode, who=who, wire=wire, rep=rep)
                runs.append(r)
                results.setdefault(key, []).append(r)
                log(f"{label} W{w} {mode} {label_of(who, wire)} rep {rep}: "
                    f"{r['steps_per_s']:.3f} steps/s, {r['gbps']:.3f} GB/s, VmHWM {r['hwm']:.0f} MiB")
        after = measure_loopback(w)
        log(f"{label} W{w} {mode}: iperf3 after: {after[1]:.2f} GB/s (1 stream), "
            f"{after[conns]:.2f} GB/s (-P {conns})")
        loopback[(label, w, mode)] = [before, after]

    print(f"# factorps shards' SIMD variant: {shard_simd(tmp)}; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"# medians of {a.reps} interleaved runs; steps/s per worker (sync: model steps); "
          f"GB/s = gradients in + parameters out, all workers (factorps fp32); iperf3 loopback "
          f"before / after each configuration, 1 stream and -P W x S streams (one per connection "
          f"of the job), `/ iperf3` against the mean of before and after"
          + ("" if not peer_tcp else f"; peer tcp = --transports uv --channels {a.peer_tcp_channels}")
          + "\n")
    hdr = ["params", "W", "mode", "factorps"]
    if have_peer:
        hdr += ["peer", "factorps / peer"]
    if peer_tcp:
        hdr += ["peer tcp", "factorps / peer tcp"]
    if a.bf16:
        hdr += ["factorps bf16", "bf16 / fp32"]
    hdr += ["GB/s"]
    if use_iperf:
        hdr += ["iperf3 1 stream GB/s", "/ iperf3 1", "iperf3 -P W x S GB/s", "/ iperf3 -P"]
    hdr += ["shards' VmHWM MiB", "sync bound MiB (VmHWM / bound)"]
    if have_peer:
        hdr += ["peer shards' VmHWM MiB"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))

    def ratio(x, y):
        return f"{x / y:.2f}" if x == x and y == y and y else "-"

    def per_shard(rs):  # each shard's peak over the runs, "shard 0 / shard 1"
        hs = [r["hwms"] for r in rs if r.get("hwms")]
        return " / ".join(f"{max(h[i] for h in hs):.0f}" for i in range(SHARDS)) if hs else "-"

    def bound(rs, mode):  # the bound per shard and the worst run's peak against it
        ok = [r for r in rs if r.get("bounds") and len(r["bounds"]) == SHARDS]
        if mode != "sync" or not ok:
            return "-"
        worst = [max(r["hwms"][i] / r["bounds"][i] for r in ok) for i in range(SHARDS)]
        return (" / ".join(f"{b:.0f}" for b in ok[0]["bounds"]) + " (" +
                " / ".join(f"{x:.2f}" for x in worst) + (", within)" if max(worst) <= 1 else ", OVER)"))

    for n, label, w, mode in configs:
        f, b, p, t = (results.get((label, w, mode, who, wire), []) for who, wire in
                      (("fps", "f32"), ("fps", "bf16"), ("peer", None), ("peer", "tcp")))
        fs, bs, ps, ts = (med([r["steps_per_s"] for r in x]) for x in (f, b, p, t))
        fg = med([r["gbps"] for r in f])
        row = [label, str(w), mode, f"{fs:.3f}"]
        if have_peer:
            row += [f"{ps:.3f}", ratio(fs, ps)]
        if peer_tcp:
            row += [f"{ts:.3f}", ratio(fs, ts)]
        if a.bf16:
            row += [f"{bs:.3f}", ratio(bs, fs)]
        row += [f"{fg:.2f}"]
        if use_iperf:
            ba = loopback[(label, w, mode)]
            for streams in (1, w * SHARDS):
                v = [x[streams] for x in ba]
                row += [f"{v[0]:.2f} / {v[1]:.2f}", ratio(fg, med(v))]
        row += [per_shard(f), bound(f, mode)]
        if have_peer:
            row += [per_shard(p)]
        print("| " + " | ".join(row) + " |", flush=True)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"iperf3_GBps": [{"params": k[0], "workers": k[1], "mode": k[2],
                                        "before": {str(s): g for s, g in v[0].items()},
                                        "after": {str(s): g for s, g in v[1].items()}}
                                       for k, v in loopback.items()],
                       "runs": runs}, out, indent=1)
    if failures:
        log(f"side_by_side: {len(failures)} run(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    finally:
        stop(list(children))

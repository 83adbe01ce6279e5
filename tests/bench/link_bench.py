#!/usr/bin/python3
"""factorps against the torch.distributed.rpc peer across a shaped network link.

    sudo /usr/bin/python3 tests/bench/link_bench.py [--rate 2.5] [--delay-us 0]
        [--params 10M,100M] [--workers 2,4] [--modes sync,async] [--reps 2]
        [--contenders fp32,bf16,peer] [--contender NAME:WIRE[:SERVER ARGS[:LOAD ARGS]]]
        [--server-arg ARG] [--load-arg ARG] [--processes] [--quick | --smoke]
        [--steps-10m 8] [--steps-100m 3] [--warmup 1] [--iperf-seconds 5]
        [--json OUT] [--build build] [--peers DIR] [--tag TAG] [--keep-void]

What users run: workers on one host, shards (S = 2) on another. Here the two
hosts are two network namespaces made for the run (fpslb-s-TAG holds the
shards, fpslb-w-TAG the workers) joined by one veth pair with addresses this
script assigns (192.168.213.1 and .2, /30, no default route, so nothing can
leave the pair). Each veth gets RPS over every CPU (without it a veth
delivers packets on the sending CPU and TCP loses ~40% to spurious
retransmits) and a `tbf rate R burst 128kb limit 8mb` on its egress: each
direction is one link of R Gbit/s. --delay-us D adds D microseconds of
one-way delay in each direction (round trip + 2 D) with the user-space
../shared/peers/net/nfq_delay.c (this kernel has no netem), built into a
temporary directory and fed by an iptables NFQUEUE rule in each namespace.

The link is checked with iperf3 before and after the runs: one stream each
way and both ways at once. TCP over MTU 1500 carries at most 1448/1514 of
what tbf counts; the run is VOID (exit 3, the table is still printed) if a
one-stream direction measured before the runs is more than 5% below that
goodput in its best of 3 tries (a busy machine can slow one iperf3 run;
the check is of the shaping). With a delay it is only reported: the delay
tool's jitter costs BBR 10-30%. The bound below uses the measured rate.

Contenders, interleaved (A B C A B C ...) on the same tensors, each on fresh
processes: factorps fp32 and bf16 on the wire (`factorps load --model peer`,
the peer's 64 tensor shapes, W worker threads in one process, or W processes
with --processes) against 2 factorps-server shards; and the peer,
../shared/peers/net/torch_rpc_ps_net.py (servers launcher in the shard
namespace, workers launcher in the worker namespace, TensorPipe over TCP).
--contender adds a factorps variant with its own server and load arguments
(an A/B of a knob), e.g. --contender 'bdp:f32:--http2-bdp-probe=true'.

Per configuration (medians over --reps):
  steps/s    per worker (sync: model steps)
  / bound    the link's step bound: one stream's measured rate over the
             larger direction's payload bytes per step (W x params x 4 B in
             fp32, x 2 B in bf16; gradients up, parameters down)
  ratios     factorps / peer, bf16 / fp32
  CPU s/step every process's CPU (utime + stime) over the timed window,
             shards + workers, and split; factorps from /proc/PID/stat sampled
             every 50 ms against the window `factorps load` reports
             (t_start, t_end on CLOCK_MONOTONIC); the peer from its own
             per-process CPU clocks over its timed window (the same counter,
             it prints them). Kernel work done in softirq outside these
             processes is not in them: the machine's softirq share is printed.
  VmHWM      shard peak RSS (max over the runs)
  steal      /proc/stat steal and load average around each run
The machine is shared: read ratios within one run, never absolute figures.

Cleanup on every exit path (normal, exception, SIGINT/SIGTERM/SIGHUP):
every process started is stopped, the iptables rules and qdiscs deleted,
then both namespaces. A run killed with SIGKILL leaves its namespaces; the
next run deletes any fpslb-* namespace whose owner process is gone.
Needs root, ip, tc, iperf3 (and iptables + gcc with --delay-us).
"""

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
import fpsproc  # noqa: E402  (tests/fpsproc.py: in_netns)
PY = "/usr/bin/python3"
SHARDS = 2
NET = "192.168.213."       # a /30 inside our own namespaces only
ADDR_S, ADDR_W = NET + "1", NET + "2"
DEV_S, DEV_W = "fpslb-s", "fpslb-w"
GOODPUT = 1448.0 / 1514.0   # TCP payload per byte tbf counts at MTU 1500
CLK_TCK = os.sysconf("SC_CLK_TCK")
nan = float("nan")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sh(*cmd, check=True, quiet=False):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    if r.returncode and not quiet:
        log(f"link_bench: {' '.join(cmd)}: {r.stderr.strip()}")
    return r


def count(s):
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", s)
    if not m:
        raise SystemExit(f"link_bench: bad count {s!r}")
    return int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else nan


def ratio(x, y):
    return f"{x / y:.2f}" if x == x and y == y and y else "-"


# --------------------------------------------------------------------- processes

class Procs:
    """Every process this script started, so that every exit path stops them."""

    def __init__(self):
        self.live = []

    def start(self, cmd, out, **kw):
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
        self.live.append(p)
        return p

    def stop(self, procs, sig=signal.SIGTERM, wait=20):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig) if getattr(p, "fps_group", False) else p.send_signal(sig)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL) if getattr(p, "fps_group", False) else p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
            if p in self.live:
                self.live.remove(p)

    def stop_all(self):
        self.stop(list(self.live), wait=10)


PROCS = Procs()


def vmhwm_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return nan


def proc_ticks(pid):
    """utime + stime of one process (all its threads), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            f = f.read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # fields 14 and 15 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            pass
    return out


class CpuSampler:
    """Samples /proc/PID/stat of named process trees every 50 ms, so the CPU
    of each process over any window can be read afterwards (a process that
    exits keeps its last sample)."""

    def __init__(self, roots, interval=0.05):
        self.roots = dict(roots)  # pid -> role ("shard", "workers", ...)
        self.role = dict(roots)
        self.series = {}          # pid -> [(monotonic, ticks)]
        self.tids = {}            # pid -> every thread id seen (for perf report --tid)
        self.stop_ev = threading.Event()
        self.th = threading.Thread(target=self.loop, args=(interval,), daemon=True)
        self.th.start()

    def loop(self, interval):
        n = 0
        while not self.stop_ev.is_set():
            if n % 10 == 0:  # children (--processes workers) are found once a half second
                for root, role in self.roots.items():
                    for k in descendants(root):
                        self.role.setdefault(k, role)
                for pid in list(self.role):
                    try:
                        self.tids.setdefault(pid, set()).update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
                    except OSError:
                        pass
            n += 1
            for pid in list(self.role):
                t, v = time.monotonic(), proc_ticks(pid)
                if v is not None:
                    self.series.setdefault(pid, []).append((t, v))
            self.stop_ev.wait(interval)

    def close(self):
        self.stop_ev.set()
        self.th.join()

    @staticmethod
    def at(series, t):
        """Ticks at time t, linear between samples, clamped to the ends."""
        if t <= series[0][0]:
            return series[0][1]
        for (t0, v0), (t1, v1) in zip(series, series[1:]):
            if t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
        return series[-1][1]

    def window(self, t0, t1):
        """{role: CPU-seconds in [t0, t1]} summed over the processes."""
        out = {}
        for pid, s in self.series.items():
            cpu = (self.at(s, t1) - self.at(s, t0)) / CLK_TCK
            out[self.role[pid]] = out.get(self.role[pid], 0.0) + cpu
        return out


def proc_stat():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v  # user nice system idle iowait irq softirq steal ...


def stat_delta(a, b):
    d = [y - x for x, y in zip(a, b)]
    tot = sum(d[:8]) or 1
    return {"steal": d[7] / tot, "softirq": d[6] / tot, "idle": (d[3] + d[4]) / tot}


# --------------------------------------------------------------------- the link

def ns_exec(ns, *cmd):
    return fpsproc.in_netns(ns, *cmd)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# A one-byte echo server (prints its port) and its client (prints the median
# of 200 round trips in ms), run inside the two namespaces.
RTT_ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""
RTT_PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for _ in range(200):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1e3)
"""


class Link:
    """Two namespaces, one shaped veth pair, optionally delayed. close() undoes
    everything open() did, in reverse, and may run after a partial open()."""

    def __init__(self, tag, rate_gbit, delay_us, peers_dir, tmp):
        self.tag, self.rate, self.delay_us, self.tmp = tag, rate_gbit, delay_us, tmp
        self.ns_s, self.ns_w = f"fpslb-s-{tag}", f"fpslb-w-{tag}"
        self.peers_dir = peers_dir
        self.made_ns, self.rules, self.qdiscs, self.delayers = [], [], [], []

    @staticmethod
    def delete_stale():
        """Namespaces of earlier runs whose owner is gone (killed with SIGKILL)."""
        r = sh("ip", "netns", "list", check=False, quiet=True)
        for line in r.stdout.splitlines():
            m = re.match(r"(fpslb-[sw]-(\d+))\b", line)
            if m and not pid_alive(int(m.group(2))):
                log(f"link_bench: deleting stale namespace {m.group(1)}")
                sh("ip", "netns", "delete", m.group(1), check=False)

    def open(self):
        for ns in (self.ns_s, self.ns_w):
            sh("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            sh(*ns_exec(ns, "ip", "link", "set", "lo", "up"))
        sh("ip", "link", "add", DEV_S, "netns", self.ns_s, "type", "veth", "peer", "name", DEV_W,
           "netns", self.ns_w)
        mask = format((1 << os.cpu_count()) - 1, "x")
        for ns, dev, addr in ((self.ns_s, DEV_S, ADDR_S), (self.ns_w, DEV_W, ADDR_W)):
            sh(*ns_exec(ns, "ip", "addr", "add", addr + "/30", "dev", dev))
            sh(*ns_exec(ns, "ip", "link", "set", dev, "up"))
            # The namespace's own sysfs (what `ip netns exec` mounts), in a
            # private mount namespace: /sys is a mount point even in a chroot.
            sh(*ns_exec(ns, "unshare", "-m", "--propagation", "unchanged", "sh", "-c",
                        f"mount --make-rprivate /sys && mount -t sysfs fps-sys /sys && "
                        f"echo {mask} > /sys/class/net/{dev}/queues/rx-0/rps_cpus"))
            sh(*ns_exec(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        f"{self.rate * 1000:.0f}mbit", "burst", "128kb", "limit", "8mb"))
            self.qdiscs.append((ns, dev))
        if self.delay_us:
            src = os.path.join(self.peers_dir, "net", "nfq_delay.c")
            exe = os.path.join(self.tmp, "nfq_delay")
            sh("gcc", "-O2", "-Wall", "-o", exe, src)
            for ns, dev in ((self.ns_s, DEV_S), (self.ns_w, DEV_W)):
                rule = ["-t", "raw", "-A", "PREROUTING", "-i", dev, "-j", "NFQUEUE", "--queue-num",
                        "0", "--queue-bypass"]
                sh(*ns_exec(ns, "iptables", *rule))
                self.rules.append((ns, rule))
                out = open(os.path.join(self.tmp, f"delay-{ns}.log"), "w")
                p = PROCS.start(ns_exec(ns, exe, "--queue", "0", "--delay-us", str(self.delay_us),
                                        "--rt", "--stats", os.path.join(self.tmp, f"delay-{ns}.json")),
                                out)
                self.delayers.append(p)
            time.sleep(0.3)
            for p in self.delayers:
                if p.poll() is not None:
                    raise RuntimeError(f"nfq_delay exited ({p.returncode}): see {self.tmp}")
        self.rtt_ms = self.rtt()

    def rtt(self):
        """Median TCP round trip of one byte across the idle link, in ms (and
        the proof that both directions carry packets)."""
        srv = PROCS.start(ns_exec(self.ns_s, PY, "-c", RTT_ECHO, ADDR_S), subprocess.PIPE)
        try:
            port = srv.stdout.readline().strip()
            r = subprocess.run(ns_exec(self.ns_w, PY, "-c", RTT_PING, ADDR_S, port.decode()),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
        finally:
            PROCS.stop([srv], wait=5)
        if r.returncode:
            raise RuntimeError(f"the link does not answer: {r.stderr.strip()}")
        return float(r.stdout)

    def close(self):
        PROCS.stop(self.delayers, wait=5)
        for ns, rule in reversed(self.rules):
            sh(*ns_exec(ns, "iptables", *["-D" if x == "-A" else x for x in rule]), check=False)
        for ns, dev in self.qdiscs:
            sh(*ns_exec(ns, "tc", "qdisc", "del", "dev", dev, "root"), check=False, quiet=True)
        # Whatever still runs inside our namespaces was started by this run
        # (a rank a launcher left behind): a namespace with a process in it
        # would outlive its name.
        for ns in self.made_ns:
            r = sh("ip", "netns", "pids", ns, check=False, quiet=True)
            for pid in (int(x) for x in r.stdout.split()):
                log(f"link_bench: killing leftover process {pid} in {ns}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Deleting a namespace deletes the veth pair with it.
        for ns in reversed(self.made_ns):
            sh("ip", "netns", "delete", ns, check=False)
        self.rules, self.qdiscs, self.made_ns, self.delayers = [], [], [], []

    def iperf(self, seconds, reverse=False, bidir=False, streams=1):
        """One TCP stream across the link in GB/s (payload): workers -> shards,
        shards -> workers with reverse, and each direction's rate at once
        with bidir. iperf3 listens on a port of our own namespace."""
        for attempt in range(3):
            port = str(5201 + attempt)
            srv = PROCS.start(ns_exec(self.ns_s, "iperf3", "-s", "-1", "-B", ADDR_S, "-p", port),
                              subprocess.DEVNULL)
            time.sleep(0.3)
            args = ["-R"] if reverse else ["--bidir"] if bidir else []
            r = subprocess.run(ns_exec(self.ns_w, "iperf3", "-c", ADDR_S, "-p", port, "-t",
                                       str(seconds), "-P", str(streams), "-J", *args),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               timeout=seconds + 30)
            PROCS.stop([srv], wait=5)
            if r.returncode != 0:
                continue
            # iperf3 can exit 0 with an "error" and no sums (a client that
            # lost its server under load): that try failed too.
            try:
                end = json.loads(r.stdout)["end"]
                if bidir:
                    return (end["sum_received"]["bits_per_second"] / 8e9,
                            end["sum_received_bidir_reverse"]["bits_per_second"] / 8e9)
                return end["sum_received"]["bits_per_second"] / 8e9
            except (ValueError, KeyError, TypeError):
                continue
        return (nan, nan) if bidir else nan

    def measure(self, seconds, want=0.0, tries=3, streams=1):
        """One stream each way, then both at once. A direction below `want`
        GB/s is measured again, up to `tries` times, keeping the best: the
        check is of the link's shaping, and a busy machine (other tenants'
        CPU, steal) can slow one iperf3 run without the link being short."""
        best = {}
        for key, rev in (("up", False), ("down", True)):
            v = [self.iperf(seconds, reverse=rev)]
            while len(v) < tries and not max(v) >= want:
                v.append(self.iperf(seconds, reverse=rev))
            best[key], best[key + "_tries"] = max(v), len(v)
        both = self.iperf(seconds, bidir=True)
        best.update(bidir_up=both[0], bidir_down=both[1])
        if streams > 1:  # as many streams as the job has connections, each way
            best["up_P"] = self.iperf(seconds, streams=streams)
            best["down_P"] = self.iperf(seconds, reverse=True, streams=streams)
        return best


# --------------------------------------------------------------------- contenders

class Contender:
    def __init__(self, name, kind, wire="f32", server_args=(), load_args=()):
        self.name, self.kind, self.wire = name, kind, wire
        self.server_args, self.load_args = list(server_args), list(load_args)

    def bytes_per_elem(self):
        return 2 if self.wire == "bf16" else 4


def parse_contender(spec, base_server, base_load):
    parts = spec.split(":", 3)
    if len(parts) < 2 or parts[1] not in ("f32", "bf16") or not parts[0]:
        raise SystemExit(f"link_bench: --contender {spec!r}: NAME:f32|bf16[:SERVER ARGS[:LOAD ARGS]]")
    srv = shlex.split(parts[2]) if len(parts) > 2 else []
    load = shlex.split(parts[3]) if len(parts) > 3 else []
    return Contender(parts[0], "fps", parts[1], base_server + srv, base_load + load)


def perf_start(out):
    """perf record of the whole machine (user and kernel). Recording one
    process (-p) yields no samples on this kernel (a guest without hardware
    counters), so every CPU is recorded and the report is cut per process."""
    return PROCS.start(["perf", "record", "-a", "-F", "999", "-o", out], subprocess.DEVNULL)


def perf_finish(rec, data, groups, who, title, dest):
    """Stops the recording and appends to dest: the machine's samples split
    into this run's groups of threads ({name: thread ids}) and the rest (other
    tenants), then perf_summary.py's report of each process in who ({name:
    its thread ids}). One `perf report --sort pid,sym` is cut by thread id
    here: perf report's --pid keeps only a process's main thread."""
    if rec.poll() is None:
        rec.send_signal(signal.SIGINT)
    try:
        rec.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    PROCS.stop([rec], wait=10)
    r = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-n", "--sort",
                        "pid,sym", "--percent-limit", "0"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
    head = next((l for l in r.stdout.splitlines() if l.startswith("# Samples:")), "# Samples: ?")
    share, rest = {k: 0.0 for k in groups}, {}
    syms = {k: {} for k in who}  # name -> {(space, sym): percent of the machine}
    rows = []  # sample counts, not the rounded percentages: thousands of rows add up
    for line in r.stdout.splitlines():
        m = re.match(r"\s*[0-9.]+%\s+(\d+)\s+(\d+):(\S+)\s+\[([k.])\]\s+(.*\S)\s*$", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(3), m.group(4), m.group(5)))
    total = sum(x[0] for x in rows) or 1
    for n, tid, comm, space, sym in rows:
        pct = 100.0 * n / total
        g = next((k for k, t in groups.items() if tid in t), None)
        if g:
            share[g] += pct
        else:
            rest[comm] = rest.get(comm, 0.0) + pct
        for name, tids in who.items():
            if tid in tids:
                syms[name][(space, sym)] = syms[name].get((space, sym), 0.0) + pct
    with open(dest, "a") as f:
        f.write(f"## {title}\n\nThe machine's samples (all CPUs): "
                + ", ".join(f"{k} {v:.1f}%" for k, v in share.items())
                + f"; everything else {sum(rest.values()):.1f}% ("
                + ", ".join(f"{c} {v:.1f}%" for c, v in sorted(rest.items(), key=lambda x: -x[1])[:6])
                + ")\n")
        for name, got in syms.items():
            rep = os.path.join(os.path.dirname(dest), re.sub(r"\W+", "_", f"{title} {name}") + ".txt")
            with open(rep, "w") as t:  # the shape perf_summary.py reads
                t.write(head + "\n")
                for (space, sym), pct in sorted(got.items(), key=lambda x: -x[1]):
                    t.write(f"  {pct:8.4f}%  [{space}] {sym}\n")
            summ = subprocess.run([PY, os.path.join(REPO, "tests", "bench", "perf_summary.py"),
                                   "--report", rep, "--top", "20"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            f.write(f"\n### {name} ({sum(got.values()):.1f}% of the machine's samples)\n"
                    f"```\n{summ.stdout}```\n")
        f.write("\n")


def run_fps(link, build, tmp, c, n, w, mode, steps, warmup, processes, profile=None):
    procs, ports = [], []
    for i in range(SHARDS):
        pf = os.path.join(tmp, f"port{i}")
        if os.path.exists(pf):
            os.unlink(pf)
        out = open(os.path.join(tmp, f"shard{i}.log"), "w")
        procs.append(PROCS.start(ns_exec(link.ns_s, os.path.join(build, "server", "factorps-server"),
                                         "--listen", ADDR_S + ":0", "--shard-id", str(i),
                                         "--shard-count", str(SHARDS), "--mode", mode, "--workers",
                                         str(w), "--deadline", "600", "--port-file", pf,
                                         *c.server_args), out))
    sampler = None
    try:
        for i, p in enumerate(procs):
            pf = os.path.join(tmp, f"port{i}")
            for _ in range(1000):
                if os.path.exists(pf) and os.path.getsize(pf) > 0:
                    break
                if p.poll() is not None:
                    raise RuntimeError(f"shard {i} died: "
                                       f"{open(os.path.join(tmp, f'shard{i}.log')).read()[-2000:]}")
                time.sleep(0.02)
            else:
                raise RuntimeError(f"shard {i} wrote no port")
            ports.append(open(pf).read().strip())
        shards = ",".join(f"{ADDR_S}:{p}" for p in ports)
        cmd = ns_exec(link.ns_w, os.path.join(build, "client", "factorps"), "load", "--shards", shards,
                      "--model", "peer", "--params", str(n), "--workers", str(w), "--steps",
                      str(steps + warmup), "--warmup", str(warmup), "--mode-hint", mode,
                      "--wire-dtype", c.wire, "--deadline", "900",
                      *(["--processes"] if processes else []), *c.load_args)
        out = open(os.path.join(tmp, "load.log"), "w+")
        rec = None
        if profile:  # perf takes a second or two to start recording on a busy machine
            rec = perf_start(os.path.join(tmp, "perf.data"))
            time.sleep(2)
        load = PROCS.start(cmd, out)
        roles = {p.pid: "shards" for p in procs}
        roles[load.pid] = "workers"
        sampler = CpuSampler(roles)
        load_hwm = nan
        try:
            deadline = time.monotonic() + 1800
            while load.poll() is None and time.monotonic() < deadline:
                hw = vmhwm_mib(load.pid)  # a peak: the last reading is the largest
                load_hwm = hw if hw == hw else load_hwm
                time.sleep(0.2)
        finally:
            PROCS.stop([load], wait=10)
            sampler.close()
            if rec:  # (directory, title)
                def tids(role):
                    return set().union(*(t for p, t in sampler.tids.items() if sampler.role.get(p) == role))
                perf_finish(rec, os.path.join(tmp, "perf.data"),
                            {"shards": tids("shards"), "workers": tids("workers"),
                             "perf": {rec.pid}},
                            {"shard 0": sampler.tids.get(procs[0].pid, set()),
                             "workers (factorps load)": tids("workers")},
                            profile[1], os.path.join(profile[0], "profiles.md"))
        hwm = [vmhwm_mib(p.pid) for p in procs]  # before the shards exit
    finally:
        if sampler and sampler.th.is_alive():
            sampler.close()
        PROCS.stop(procs)
    out.seek(0)
    text = out.read()
    m = re.search(r"^RESULT .*$", text, re.M)
    if load.returncode or not m:
        raise RuntimeError(f"factorps load failed ({load.returncode}): {text[-2000:]}")
    kv = dict(x.split("=", 1) for x in m.group(0).split()[1:])
    t0, t1 = float(kv["t_start"]), float(kv["t_end"])
    cpu = sampler.window(t0, t1)
    timed = int(kv["steps"])
    return {"steps_per_s": float(kv["steps_per_s"]), "gbps": float(kv["gb_per_s"]),
            "params": int(kv["params"]), "hwm": max(hwm), "hwms": hwm, "workers_hwm": load_hwm,
            "cpu_shards": cpu.get("shards", nan) / timed, "cpu_workers": cpu.get("workers", nan) / timed,
            "p50_ms": float(kv["p50_ms"]), "p99_ms": float(kv["p99_ms"])}


PEER_PORT = [29500]


def run_peer(link, peers, tmp, n, w, mode, steps, warmup):
    """The peer split over the two namespaces: shard ranks (and the TCPStore
    on ADDR_S) in one, worker ranks in the other. Its JSON carries every
    rank's own CPU clock over the timed window."""
    exch = tempfile.mkdtemp(prefix="x", dir=tmp)
    PEER_PORT[0] = 29500 + (PEER_PORT[0] - 29499) % 400  # a fresh port: no TIME_WAIT surprises
    common = [os.path.join(peers, "net", "torch_rpc_ps_net.py"), "--params", str(n), "--tensors",
              "64", "--workers", str(w), "--shards", str(SHARDS), "--steps", str(steps), "--warmup",
              str(warmup), "--mode", mode, "--synthetic-grads", "--master-addr", ADDR_S,
              "--master-port", str(PEER_PORT[0]), "--exchange", exch, "--timeout", "1200"]
    slog = open(os.path.join(tmp, "peer-servers.log"), "w")
    wlog = open(os.path.join(tmp, "peer-workers.log"), "w+")
    # Each launcher spawns its ranks: own process groups, stopped whole.
    srv = PROCS.start(ns_exec(link.ns_s, PY, *common, "--role", "servers", "--ifname", DEV_S), slog,
                      start_new_session=True)
    srv.fps_group = True
    time.sleep(0.5)
    wrk = PROCS.start(ns_exec(link.ns_w, PY, *common, "--role", "workers", "--ifname", DEV_W), wlog,
                      start_new_session=True)
    wrk.fps_group = True
    try:
        deadline = time.monotonic() + 1500
        while wrk.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    finally:
        PROCS.stop([wrk, srv], wait=10)
    wlog.seek(0)
    lines = [l for l in wlog.read().splitlines() if l.startswith("{")]
    if not lines:
        wlog.seek(0)
        raise RuntimeError(f"peer failed ({wrk.returncode}): {wlog.read()[-2000:]}"
                           f"{open(os.path.join(tmp, 'peer-servers.log')).read()[-1000:]}")
    r = json.loads(lines[-1])
    if "error" in r:
        raise RuntimeError(f"peer error: {r['error'][-2000:]}")
    wall, timed = r["wall_s"], r["steps"]
    cs = sum(s["cpu_cores"] * s["window_s"] for s in r["servers"])
    cw = sum(x["cpu_cores"] * wall for x in r["workers_detail"])
    return {"steps_per_s": r["steps_per_s"], "gbps": r["pushed_GBps"], "params": r["params"],
            "hwm": max(s["vmhwm_MiB"] for s in r["servers"]),
            "hwms": [s["vmhwm_MiB"] for s in sorted(r["servers"], key=lambda s: s["shard"])],
            "workers_hwm": max(x["vmhwm_MiB"] for x in r["workers_detail"]),
            "cpu_shards": cs / timed, "cpu_workers": cw / timed,
            "p50_ms": r["push_latency_ms"]["step_p50"], "p99_ms": r["push_latency_ms"]["step_p99"]}


# --------------------------------------------------------------------- main

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def git(where, *args):
    """git's output in `where`, "" if it fails or git is not installed (a
    source tree without git, a fresh machine)."""
    try:
        r = subprocess.run(["git", "-C", where, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    except OSError:
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def default_peers():
    """../shared/peers beside the repository; from a git worktree, beside the
    main checkout (the worktree's common git directory's parent)."""
    common = git(REPO, "rev-parse", "--path-format=absolute", "--git-common-dir")
    for top in (REPO, os.path.dirname(common) if common else REPO):
        cand = os.path.join(os.path.dirname(top), "shared", "peers")
        if os.path.isdir(cand):
            return cand
    return os.path.join(os.path.dirname(REPO), "shared", "peers")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--peers", default=os.environ.get("FPS_PEERS_DIR", default_peers()),
                    help="the peer baselines (default ../shared/peers beside the main checkout)")
    ap.add_argument("--rate", type=float, default=2.5, help="tbf rate of each direction, Gbit/s")
    ap.add_argument("--delay-us", type=int, default=0, help="added one-way delay, each direction")
    ap.add_argument("--params", default="10M,100M")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--contenders", default="fp32,bf16,peer",
                    help="built-in contenders in order: fp32, bf16, peer")
    ap.add_argument("--contender", action="append", default=[], metavar="NAME:WIRE[:SRV[:LOAD]]",
                    help="an extra factorps contender with its own server / load arguments")
    ap.add_argument("--server-arg", action="append", default=[], help="to every factorps-server")
    ap.add_argument("--load-arg", action="append", default=[], help="to every factorps load")
    ap.add_argument("--processes", action="store_true", help="factorps workers as W processes")
    ap.add_argument("--steps-10m", type=int, default=8, help="timed steps at <= 10M params")
    ap.add_argument("--steps-100m", type=int, default=3, help="timed steps above 10M params")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iperf-seconds", type=int, default=5)
    ap.add_argument("--iperf-streams", type=int, default=1,
                    help="also measure N parallel streams each way (e.g. W x S, the job's connections)")
    ap.add_argument("--profile", metavar="DIR",
                    help="after each configuration's timed runs, one more run of each factorps "
                         "contender under perf record (the whole load, set-up included); each "
                         "command's share of the machine and "
                         "perf_summary.py's report of shard 0 and of the workers go to "
                         "DIR/profiles.md")
    ap.add_argument("--quick", action="store_true", help="10M W2 sync+async, 1 rep, 3 s iperf3")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: 1M W2 sync, 2 steps, 1 s iperf3, never void (the ctest)")
    ap.add_argument("--keep-void", action="store_true", help="exit 0 even when the link is void")
    ap.add_argument("--tag", default=str(os.getpid()), help="namespace suffix (default: our pid)")
    ap.add_argument("--json", help="also write every run as JSON here")
    a = ap.parse_args(argv)
    if a.quick:
        a.params, a.workers, a.reps, a.iperf_seconds = "10M", "2", 1, 3
    if a.smoke:
        a.params, a.workers, a.modes, a.reps, a.iperf_seconds = "1M", "2", "sync", 1, 1
        a.steps_10m, a.warmup, a.keep_void = 2, 1, True
    if not re.fullmatch(r"[A-Za-z0-9]{1,8}", a.tag):
        ap.error("--tag: 1-8 letters or digits")
    return a


def main(a):
    build = os.path.abspath(a.build)
    for b in ("server/factorps-server", "client/factorps"):
        if not os.access(os.path.join(build, b), os.X_OK):
            raise SystemExit(f"link_bench: {build}/{b} not built (cmake --build {a.build})")
    if os.geteuid() != 0:
        raise SystemExit("link_bench: needs root (network namespaces, tc)")
    need = ["ip", "tc", "iperf3"] + (["iptables", "gcc"] if a.delay_us else [])
    missing = [t for t in need if not shutil.which(t)]
    if missing:
        raise SystemExit(f"link_bench: missing {', '.join(missing)}")
    have_peer = os.path.isfile(os.path.join(a.peers, "net", "torch_rpc_ps_net.py"))
    if a.delay_us and not os.path.isfile(os.path.join(a.peers, "net", "nfq_delay.c")):
        raise SystemExit(f"link_bench: --delay-us needs {a.peers}/net/nfq_delay.c")
    contenders = []
    for name in a.contenders.split(","):
        if name == "fp32":
            contenders.append(Contender("fp32", "fps", "f32", a.server_arg, a.load_arg))
        elif name == "bf16":
            contenders.append(Contender("bf16", "fps", "bf16", a.server_arg, a.load_arg))
        elif name == "peer":
            if have_peer:
                contenders.append(Contender("peer", "peer"))
            else:
                log(f"link_bench: no peer at {a.peers}/net: its columns are skipped")
        elif name:
            raise SystemExit(f"link_bench: unknown contender {name!r} (fp32, bf16, peer)")
    contenders += [parse_contender(s, a.server_arg, a.load_arg) for s in a.contender]
    names = [c.name for c in contenders]
    if len(set(names)) != len(names) or not contenders:
        raise SystemExit(f"link_bench: contender names must be unique and present: {names}")
    configs = [(count(n), n, int(w), m) for n in a.params.split(",") for m in a.modes.split(",")
               for w in a.workers.split(",")]

    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        if not shutil.which("perf"):
            raise SystemExit("link_bench: --profile needs perf (Debian: linux-perf)")
    tmp = tempfile.mkdtemp(prefix="fps-link-")
    Link.delete_stale()
    link = Link(a.tag, a.rate, a.delay_us, a.peers, tmp)
    runs, results, failures = [], {}, []
    try:
        link.open()
        la0 = os.getloadavg()
        print(f"# link bench: {SHARDS} shards in {link.ns_s}, workers in {link.ns_w}, veth + tbf "
              f"{a.rate:g} Gbit/s each way, added one-way delay {a.delay_us} us, TCP RTT "
              f"{link.rtt_ms:.3f} ms; {cpu_model()}, {os.cpu_count()} CPUs; load average "
              f"{la0[0]:.1f}; {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}; binaries of "
              f"{git_head(build)}", flush=True)
        st0 = proc_stat()
        goodput = a.rate / 8 * GOODPUT
        before = link.measure(a.iperf_seconds, 0.95 * goodput, streams=a.iperf_streams)
        st1 = proc_stat()
        void = [k for k in ("up", "down") if not before[k] >= 0.95 * goodput]
        print(f"# iperf3 before ({a.iperf_seconds} s each, steal {stat_delta(st0, st1)['steal']:.0%}): "
              f"one stream up {before['up']:.3f} GB/s, down {before['down']:.3f} (best of "
              f"{before['up_tries']} and {before['down_tries']}), both at once "
              f"{before['bidir_up']:.3f} + {before['bidir_down']:.3f}; TCP goodput of R "
              f"{goodput:.3f} GB/s (one stream up / goodput {before['up'] / goodput:.3f})", flush=True)
        if a.iperf_streams > 1:
            print(f"# iperf3 -P {a.iperf_streams}: up {before['up_P']:.3f} GB/s, down "
                  f"{before['down_P']:.3f}", flush=True)
        if void and not a.delay_us:
            print(f"# VOID: one stream {', '.join(void)} below 0.95 of R's TCP goodput", flush=True)
        rate_up = before["up"] if before["up"] == before["up"] else goodput
        rate_down = before["down"] if before["down"] == before["down"] else goodput
        for n, label, w, mode in configs:
            steps = a.steps_10m if n <= 10**7 else a.steps_100m
            for rep in range(a.reps):
                for c in contenders:
                    s0, l0 = proc_stat(), os.getloadavg()[0]
                    try:
                        if c.kind == "fps":
                            r = run_fps(link, build, tmp, c, n, w, mode, steps, a.warmup, a.processes)
                        else:
                            r = run_peer(link, a.peers, tmp, n, w, mode, steps, a.warmup)
                    except Exception as e:  # one failed run must not hide the rest
                        log(f"link_bench: {label} W{w} {mode} {c.name} rep {rep}: {e}")
                        r = {"steps_per_s": nan, "gbps": nan, "hwm": nan}
                        failures.append((label, w, mode, c.name))
                    r.update(stat_delta(s0, proc_stat()), load=l0, params_label=label, workers=w,
                             mode=mode, who=c.name, rep=rep)
                    # The step bound of this contender: one stream's rate over
                    # the larger direction's payload per step.
                    bpe = c.bytes_per_elem()
                    p = r.get("params", n)
                    r["bound"] = min(rate_up, rate_down) * 1e9 / (w * p * bpe)
                    runs.append(r)
                    results.setdefault((label, w, mode, c.name), []).append(r)
                    log(f"{label} W{w} {mode} {c.name} rep {rep}: {r['steps_per_s']:.3f} steps/s "
                        f"({r['steps_per_s'] / r['bound']:.2f} of bound), CPU s/step shards "
                        f"{r.get('cpu_shards', nan):.3f} workers {r.get('cpu_workers', nan):.3f}, "
                        f"steal {r['steal']:.0%}, VmHWM {r['hwm']:.0f} MiB")
            if a.profile:  # one more run of each factorps contender, recorded, not timed
                for c in contenders:
                    if c.kind != "fps":
                        continue
                    try:
                        run_fps(link, build, tmp, c, n, w, mode, steps, a.warmup, a.processes,
                                (a.profile, f"{label} W{w} {mode} {c.name}"))
                    except Exception as e:
                        log(f"link_bench: profile {label} W{w} {mode} {c.name}: {e}")
            ps = [r.get("params") for c in contenders for r in results.get((label, w, mode, c.name), [])]
            if len({x for x in ps if x}) > 1:
                log(f"link_bench: {label}: contenders ran different parameter counts {set(ps)}")
        st2 = proc_stat()
        after = link.measure(a.iperf_seconds, tries=1)
        print(f"# iperf3 after: one stream up {after['up']:.3f} GB/s, down {after['down']:.3f}, "
              f"both at once {after['bidir_up']:.3f} + {after['bidir_down']:.3f}; load average "
              f"{os.getloadavg()[0]:.1f}; steal over the whole run {stat_delta(st1, st2)['steal']:.1%}")
        report(a, contenders, configs, results)
        if a.delay_us:
            for ns in (link.ns_s, link.ns_w):
                PROCS.stop([p for p in link.delayers], wait=5)
                try:
                    print(f"# nfq_delay {ns}: " + open(os.path.join(tmp, f"delay-{ns}.json")).read()
                          .strip().splitlines()[-1][:400])
                except (OSError, IndexError):
                    pass
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"rate_gbit": a.rate, "delay_us": a.delay_us, "rtt_ms": link.rtt_ms,
                           "iperf_before": before, "iperf_after": after, "runs": runs}, f, indent=1)
    finally:
        PROCS.stop_all()
        link.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        log(f"link_bench: {len(failures)} run(s) failed")
        return 1
    if void and not a.delay_us and not a.keep_void:
        return 3
    return 0


def git_head(build):
    """The commit the binaries in build were configured from (its source
    tree's HEAD, "+changes" when that tree has uncommitted edits)."""
    src = REPO
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    src = line.split("=", 1)[1].strip()
    except OSError:
        pass
    rev = git(src, "rev-parse", "--short", "HEAD")
    return (rev or "?") + ("+changes" if git(src, "status", "--porcelain", "--untracked-files=no") else "")


def report(a, contenders, configs, results):
    fps = [c for c in contenders if c.kind == "fps"]
    peer = next((c for c in contenders if c.kind == "peer"), None)
    base = fps[0] if fps else None
    print(f"\n# medians of {a.reps} interleaved runs; steps/s per worker (sync: model steps); "
          "/ bound = steps/s over the link's step bound for that contender's bytes; CPU = "
          "CPU-seconds per step, shards + workers (shards / workers)\n")
    hdr = ["params", "W", "mode"]
    for c in contenders:
        hdr += [f"{c.name} steps/s", "/ bound"]
    if peer:
        hdr += [f"{c.name} / peer" for c in fps]
    if base:
        hdr += [f"{c.name} / {base.name}" for c in fps[1:]]
    hdr += [f"{c.name} CPU s/step" for c in contenders]
    if peer:
        hdr += [f"{c.name} CPU / peer" for c in fps]
    hdr += [f"{c.name} shard VmHWM MiB" for c in contenders]
    hdr += ["steal", "softirq", "load avg"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for n, label, w, mode in configs:
        rs = {c.name: results.get((label, w, mode, c.name), []) for c in contenders}
        sp = {k: med([r["steps_per_s"] for r in v]) for k, v in rs.items()}
        fr = {k: med([r["steps_per_s"] / r["bound"] for r in v]) for k, v in rs.items()}
        cpu = {k: (med([r.get("cpu_shards", nan) for r in v]), med([r.get("cpu_workers", nan) for r in v]))
               for k, v in rs.items()}
        row = [label, str(w), mode]
        for c in contenders:
            row += [f"{sp[c.name]:.3f}", f"{fr[c.name]:.2f}"]
        if peer:
            row += [ratio(sp[c.name], sp[peer.name]) for c in fps]
        if base:
            row += [ratio(sp[c.name], sp[base.name]) for c in fps[1:]]
        for c in contenders:
            s, wk = cpu[c.name]
            row += [f"{s + wk:.3f} ({s:.3f} / {wk:.3f})"]
        if peer:
            row += [ratio(sum(cpu[c.name]), sum(cpu[peer.name])) for c in fps]
        for c in contenders:
            h = [r["hwm"] for r in rs[c.name] if r["hwm"] == r["hwm"]]
            row += [f"{max(h):.0f}" if h else "-"]
        allr = [r for v in rs.values() for r in v]
        st = [r["steal"] for r in allr]
        si = [r["softirq"] for r in allr]
        la = [r["load"] for r in allr]
        row += [f"{min(st):.0%}-{max(st):.0%}" if st else "-", f"{med(si):.0%}",
                f"{min(la):.1f}-{max(la):.1f}" if la else "-"]
        print("| " + " | ".join(row) + " |", flush=True)


def on_signal(sig, _frame):
    raise SystemExit(128 + sig)  # unwinds through every finally


if __name__ == "__main__":
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    args = parse_args(sys.argv[1:])
    try:
        rc = main(args)
    finally:
        PROCS.stop_all()
    sys.exit(rc)

"""Harness of the standby-replica tests: one shard served by two
factorps-server processes, replicas 0 and 1, that name each other
(--replica-peer) and share a file lease (--lease file:PATH); training
workers as processes (_worker.py) that reach the shard through the entry
"replica0|replica1"; and a monitor process per replica (_monitor.py)
that logs its Stats (role, term, joined, per-tensor version and checksum)
every 50 ms.

On loopback (Pair(topo=None)) the replicas listen on 127.0.0.1. With a
Topology the replicas and the workers live in three network namespaces the
test creates, joined by three veth links that can be cut one by one:
  w  <-wa-> a   10.77.1.1 - 10.77.1.2   workers to replica 0
  w  <-wb-> b   10.77.2.1 - 10.77.2.2   workers to replica 1
  a  <-ab-> b   10.77.3.1 - 10.77.3.2   replica to replica (the stream)
Every process the harness starts dies with the test process
(PR_SET_PDEATHSIG); close() stops them and deletes the namespaces.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "client", "python"))
import fpsproc  # noqa: E402  (tests/fpsproc.py: the one launcher of factorps-server)

SERVER = fpsproc.SERVER
PY = sys.executable
TENSORS = ("emb", "w", "b")  # _worker.SHAPES
PORT = 50051  # inside the namespaces: each replica has its own


def _die_with_parent():
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def is_root():
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args, check=True):
    # ip(8) is not built with a sanitizer: not the ASan runtime the ASan
    # build preloads into Python.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(fpsproc.ip_argv(*args), capture_output=True, text=True, timeout=20, env=env)
    if check and r.returncode:
        raise RuntimeError("ip %s: %s" % (" ".join(args), r.stderr.strip()))
    return r


class Topology:
    """Three network namespaces (workers, replica 0, replica 1) and the
    three links between them (see the module comment)."""

    LINKS = {"wa": ("w", "a", 1), "wb": ("w", "b", 2), "ab": ("a", "b", 3)}

    def __init__(self):
        self._reap()
        tag = "%d" % (os.getpid() % 10000000)
        self.ns = {k: "fpsrep%s%s" % (tag, k) for k in "wab"}
        self.dev = {}
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for link, (x, y, net) in self.LINKS.items():
                dx, dy = "fr%s%s%s" % (tag, link, x), "fr%s%s%s" % (tag, link, y)
                self.dev[link] = ((x, dx), (y, dy))
                _ip("link", "add", dx, "netns", self.ns[x], "type", "veth", "peer", "name", dy,
                    "netns", self.ns[y])
                for host, (node, dev) in enumerate(((x, dx), (y, dy)), 1):
                    _ip("-n", self.ns[node], "addr", "add", "10.77.%d.%d/24" % (net, host), "dev", dev)
                    _ip("-n", self.ns[node], "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _reap():
        """Deletes the namespaces of earlier runs whose test process is gone
        (one killed by a timeout could not close() them)."""
        out = _ip("netns", "list", check=False).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            pid = name[len("fpsrep"):-1]
            if name.startswith("fpsrep") and pid.isdigit() and not os.path.exists("/proc/" + pid):
                _ip("netns", "del", name, check=False)

    def prefix(self, node):
        """Runs a command inside node's namespace ("w", "a", "b")."""
        return fpsproc.in_netns(self.ns[node])

    def cut(self, link):
        for node, dev in self.dev[link]:
            _ip("-n", self.ns[node], "link", "set", dev, "down")

    def heal(self, link):
        for node, dev in self.dev[link]:
            _ip("-n", self.ns[node], "link", "set", dev, "up")

    def close(self):
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)


class Pair:
    """Replicas 0 and 1 of shard 0 (of 1) in `mode` for `workers` workers,
    each with its monitor. Replica 0 starts first and so takes the lease.
    A shard of a larger job (loopback only): shard_count, the replicas'
    `ports` (picked by the caller, who also needs them for --peers in
    `extra`), `rest` (the other shards' entries, after this one in the
    workers' --shards) and `worker_args` (more _worker.py flags)."""

    def __init__(self, mode, workers=2, topo=None, extra=(), shard_count=1, ports=None, rest=(),
                 worker_args=(), checkpoint_interval=None):
        self.mode, self.workers, self.topo, self.extra = mode, workers, topo, list(extra)
        # Each replica's own --checkpoint-dir (in self.dir) with this
        # --checkpoint-interval: a restarted replica then restores its own
        # older state before it takes its primary's.
        self.checkpoint_interval = checkpoint_interval
        self.shard_count, self.worker_args = shard_count, [str(a) for a in worker_args]
        self.dir = tempfile.mkdtemp(prefix="fps-replica-")
        self.lease = os.path.join(self.dir, "lease")
        self.procs = [None, None]
        self.monitors = []
        self.workers_procs = []
        self.stop_file = os.path.join(self.dir, "stop")
        if topo is None:
            self.ports = list(ports) if ports else fpsproc.free_ports(2)
            self.listen = ["127.0.0.1:%d" % p for p in self.ports]
            self.worker_addr = list(self.listen)
            self.peer_addr = list(self.listen)
            self.local_addr = list(self.listen)
        else:
            self.listen = ["0.0.0.0:%d" % PORT] * 2
            self.worker_addr = ["10.77.1.2:%d" % PORT, "10.77.2.2:%d" % PORT]
            self.peer_addr = ["10.77.3.1:%d" % PORT, "10.77.3.2:%d" % PORT]
            self.local_addr = ["127.0.0.1:%d" % PORT] * 2
        self.entry = "|".join(self.worker_addr)
        self.shards = ",".join([self.entry, *rest])
        try:
            for i in (0, 1):
                self.start(i)
                with open(self.monitor_log(i) + ".err", "ab") as err:
                    self.monitors.append(subprocess.Popen(
                        [*self.prefix(i), PY, os.path.join(HERE, "_monitor.py"),
                         self.local_addr[i], self.monitor_log(i), *TENSORS],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                        env=self.client_env(), preexec_fn=_die_with_parent))
                if i == 0:
                    self.wait(lambda: self.role(0) == "primary", 20, "replica 0 to be primary")
            self.wait(lambda: self.role(1) == "standby", 20, "replica 1 to be a standby")
        except BaseException:
            self.close()
            raise

    # ---- processes

    def prefix(self, i):
        return self.topo.prefix("ab"[i]) if self.topo else []

    def client_env(self):
        env = dict(os.environ)
        env.pop("FACTORPS_SHARDS", None)
        return env

    def start(self, i):
        """Starts replica i (again, after a kill: on its own address)."""
        metrics = "127.0.0.1:0" if self.topo is None else None
        args = ["--shard-id", "0", "--shard-count", str(self.shard_count), "--mode", self.mode,
                "--workers", str(self.workers), "--replica-peer", self.peer_addr[1 - i],
                "--replica-advertise", self.worker_addr[i], "--lease", "file:" + self.lease,
                "--log-level", os.environ.get("FPS_REPLICA_LOG", "info"), *self.extra]
        if self.checkpoint_interval is not None:
            args += ["--checkpoint-dir", os.path.join(self.dir, "ckpt%d" % i),
                     "--checkpoint-interval", str(self.checkpoint_interval)]
        end = time.monotonic() + 20
        while True:
            try:
                sp = fpsproc.ShardProcess(args, listen=self.listen[i], prefix=self.prefix(i),
                                          dir=self.dir, name="replica%d" % i, timeout=20,
                                          die_with_parent=True, metrics_listen=metrics)
                break
            except fpsproc.ServerExited as e:
                # The port of a process killed a moment ago may still be
                # held by its closing sockets.
                if "listen" not in e.err or time.monotonic() > end:
                    raise
                time.sleep(0.1)
        sp.log.close()
        self.procs[i] = sp

    def kill(self, i, sig=signal.SIGKILL):
        """Sends `sig` to replica i and waits for it; returns when it was
        sent (CLOCK_MONOTONIC)."""
        sp = self.procs[i]
        t = time.monotonic()
        sp.proc.send_signal(sig)
        sp.proc.wait(30)
        self.procs[i] = None
        return t

    def metric(self, i, name):
        """Replica i's value of metric `name` (loopback only), or None."""
        import re
        import urllib.request
        sp = self.procs[i]
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % sp.metrics_port,
                                      timeout=10).read().decode()
        m = re.search(r"^%s(?:\{[^}]*\})? (\S+)$" % re.escape(name), text, re.M)
        return float(m.group(1)) if m else None

    def log(self, i):
        try:
            with open(os.path.join(self.dir, "replica%d.log" % i), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def start_workers(self, seed=1, steps=None, final=None, deadline=5.0):
        """Starts the workers (until the stop file, or `steps` steps)."""
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        prefix = self.topo.prefix("w") if self.topo else []
        self.worker_logs = []
        for w in range(self.workers):
            log = os.path.join(self.dir, "worker%d.jsonl" % w)
            self.worker_logs.append(log)
            cmd = [*prefix, PY, os.path.join(HERE, "_worker.py"), "--shards", self.shards,
                   "--worker", str(w), "--workers", str(self.workers), "--mode", self.mode,
                   "--seed", str(seed), "--log", log, "--deadline", str(deadline),
                   *self.worker_args]
            cmd += ["--steps", str(steps)] if steps is not None else ["--stop-file", self.stop_file]
            if final:
                cmd += ["--final", final]
            with open(log + ".err", "ab") as err:
                self.workers_procs.append(subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    env=self.client_env(), preexec_fn=_die_with_parent))

    def stop_workers(self, timeout=120):
        """Stops the workers at one step (past every worker's) and waits;
        returns the pushes each worker got acknowledged (a list)."""
        target = max([s for s in (self.acked_steps(w) for w in range(self.workers))] + [0]) + 2
        with open(self.stop_file + ".tmp", "w") as f:
            f.write(str(target))
        os.replace(self.stop_file + ".tmp", self.stop_file)
        self.join_workers(timeout)
        return [self.acked_steps(w) for w in range(self.workers)]

    def join_workers(self, timeout=120):
        end = time.monotonic() + timeout
        for p in self.workers_procs:
            try:
                p.wait(max(1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise AssertionError("a worker did not finish within %g s:\n%s" %
                                     (timeout, self.worker_errors()))
        bad = [p.returncode for p in self.workers_procs if p.returncode]
        self.workers_procs = []
        if bad:
            raise AssertionError("workers exited with %s:\n%s" % (bad, self.worker_errors()))

    def worker_errors(self):
        out = []
        for log in self.worker_logs:
            try:
                with open(log + ".err", errors="replace") as f:
                    out.append(f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    def close(self):
        for p in self.workers_procs + self.monitors:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sp in self.procs:
            if sp is not None:
                sp.kill()
        if os.environ.get("FPS_REPLICA_KEEP"):  # to read the logs of a failed run
            sys.stderr.write("replica test files kept in %s\n" % self.dir)
        else:
            shutil.rmtree(self.dir, True)

    # ---- what the logs say

    def monitor_log(self, i):
        return os.path.join(self.dir, "monitor%d.jsonl" % i)

    def samples(self, i):
        return _read_jsonl(self.monitor_log(i))

    def last(self, i, since=None):
        """Replica i's newest monitor sample (taken after `since`), or None."""
        s = self.samples(i)
        if not s or (since is not None and s[-1]["t"] <= since):
            return None
        return s[-1]

    def role(self, i):
        """Replica i's role now, from its monitor's newest sample (None if
        it has not answered for 0.5 s)."""
        s = self.last(i, since=time.monotonic() - 0.5)
        return s.get("role") if s and "err" not in s else None

    def joined(self, i):
        s = self.last(i, since=time.monotonic() - 0.5)
        return bool(s and s.get("role") == "primary" and s.get("joined"))

    def primary(self):
        roles = [self.role(i) for i in (0, 1)]
        return roles.index("primary") if roles.count("primary") == 1 else None

    def wait(self, pred, timeout, what):
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise AssertionError("no %s within %g s\nreplica 0:\n%s\nreplica 1:\n%s\n"
                                     "workers' last errors:\n%s" %
                                     (what, timeout, self.log(0), self.log(1),
                                      self.last_errors()))
            time.sleep(0.02)

    def last_errors(self):
        out = []
        for log in getattr(self, "worker_logs", []):
            errs = [r for r in _read_jsonl(log) if "err" in r]
            if errs:
                out.append(errs[-1].get("msg", errs[-1]["err"]))
        return "\n".join(out)

    def acks(self, w):
        return [r for r in _read_jsonl(self.worker_logs[w]) if "v" in r]

    def acked_steps(self, w):
        a = self.acks(w)
        return a[-1]["step"] + 1 if a else 0

    def wait_progress(self, steps, timeout, what="training to go on"):
        """Until every worker acknowledged `steps` more pushes."""
        base = [len(self.acks(w)) for w in range(self.workers)]
        self.wait(lambda: all(len(self.acks(w)) >= base[w] + steps for w in range(self.workers)),
                  timeout, what)


def _read_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


# ---- checks shared by the tests

def stall_after(acks_by_worker, t_kill, window=5.0):
    """The job's stall after a kill: per worker the longest wait for an
    acknowledgement in the `window` seconds after t_kill (from the kill or
    the previous acknowledgement, whichever is later), the largest over the
    workers. An upper bound of "the first successful step after the kill"
    that a reply already on its way before the kill cannot shorten."""
    worst = 0.0
    for acks in acks_by_worker:
        prev, longest, seen = t_kill, 0.0, False
        for r in acks:
            if r["t"] <= t_kill:
                continue
            if r["t"] > t_kill + window:
                break
            longest = max(longest, r["t"] - max(prev, t_kill))
            prev, seen = r["t"], True
        if not seen:
            return float("inf")
        worst = max(worst, longest)
    return worst


def one_acknowledger(samples_by_replica):
    """Never two processes acknowledging for the shard: over all monitor
    samples in time order, a term is held as primary by one process only,
    and no process reports itself primary under a term older than one
    another process already held. Returns a list of violations."""
    events = sorted((s["t"], i, s) for i, ss in enumerate(samples_by_replica) for s in ss
                    if s.get("role") == "primary")
    holder, newest, bad = {}, (0, None), []
    for t, i, s in events:
        term = s.get("term", 0)
        if holder.setdefault(term, i) != i:
            bad.append("t=%.3f: term %d primary on replica %d and on replica %d" %
                       (t, term, holder[term], i))
        if term < newest[0] and newest[1] != i:
            bad.append("t=%.3f: replica %d primary under term %d after replica %d held term %d" %
                       (t, i, term, newest[1], newest[0]))
        if term > newest[0]:
            newest = (term, i)
    return bad


def summary(xs):
    xs = sorted(xs)
    if not xs:
        return "none"
    return "median %.3f s, max %.3f s over %d" % (xs[len(xs) // 2], xs[-1], len(xs))

"""Shared helpers of the Python tests: paths, real shard processes, timeouts.

Every test starts real factorps-server processes on 127.0.0.1:0 (the bound
port comes back through --port-file; tests/fpsproc.py starts them) and
kills them at the end, so a test never depends on a fixed port or on
another test's servers.

Environment (set by tests/python/CMakeLists.txt; tests that need a missing
one are skipped when run by hand, never silently passed under ctest, which
sets them all):
  FACTORPS_SERVER       path of factorps-server
  FACTORPS_LIB          path of libfactorps.so (read by the package itself)
  FACTORPS_TEST_SERVER_ENV  optional "K=V|K=V" extra environment for servers
                        (the ASan build uses it to undo the Python side's
                        LD_PRELOAD and leak-check settings)
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.dirname(HERE))
import fpsproc  # noqa: E402  (tests/fpsproc.py: the one launcher of factorps-server)
from fpsproc import free_ports  # noqa: E402,F401  (re-exported)

SERVER = os.environ.get("FACTORPS_SERVER", "")
START_TIMEOUT = 20.0  # seconds for a shard to write its port file


def need_server(test):
    """Skips `test` (class or function) when no server binary is configured."""
    if SERVER and os.access(SERVER, os.X_OK):
        return test
    return unittest.skip("FACTORPS_SERVER not set (run through ctest)")(test)


class Shards:
    """N real shards of one job: `with Shards(2, workers=2) as s: s.addrs`."""

    def __init__(self, n=1, mode="sync", workers=1, deadline=None, extra=(), checkpoint=None,
                 peers=False, metrics=False):
        """`checkpoint`: seconds between checkpoints; each shard then gets its
        own --checkpoint-dir (kept across restart()), so a restarted shard
        comes back from its newest checkpoint. `peers`: every shard gets
        --peers (all shards' addresses, for split tensors), so the ports are
        chosen before the shards start (free loopback ports; a start that
        finds one taken is retried on fresh ports). `metrics`: each shard
        serves /metrics on a loopback port of its own (see rpc_count())."""
        self.n, self.mode, self.workers = n, mode, workers
        self.metrics = metrics
        self.metrics_ports = [None] * n
        self.deadline, self.extra = deadline, list(extra)
        self.checkpoint = checkpoint
        self.peers = peers
        self.dir = tempfile.mkdtemp(prefix="fps-pytest-")
        self.procs = [None] * n
        self.ports = [0] * n
        try:
            for attempt in range(3 if peers else 1):
                if peers:
                    self.ports = free_ports(n)
                try:
                    for i in range(n):
                        self.start(i, self.ports[i])
                    break
                except RuntimeError:
                    if attempt == 2 or not peers:
                        raise
                    for i in range(n):
                        self.kill(i)
        except BaseException:
            self.close()
            raise

    @property
    def addrs(self):
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self, i, port=0):
        """Starts shard i (on `port`, or a fresh one) and waits for its port."""
        args = ["--shard-id", str(i), "--shard-count", str(self.n), "--mode", self.mode,
                "--workers", str(self.workers), "--log-level", "warn"]
        if self.deadline is not None:
            args += ["--deadline", str(self.deadline)]
        if self.checkpoint is not None:
            args += ["--checkpoint-dir", os.path.join(self.dir, f"ckpt{i}"),
                     "--checkpoint-interval", str(self.checkpoint)]
        if self.peers:
            args += ["--peers", ",".join(self.addrs)]
        args += self.extra
        sp = fpsproc.ShardProcess(args, server=SERVER, listen=f"127.0.0.1:{port}", dir=self.dir,
                                  name=f"shard{i}",
                                  metrics_listen="127.0.0.1:0" if self.metrics else None,
                                  timeout=START_TIMEOUT)
        sp.log.close()  # the process holds its own descriptor; log() reads the file
        self.procs[i] = sp.proc
        self.ports[i] = sp.port
        self.metrics_ports[i] = sp.metrics_port

    def rpc_count(self, method, shards=None):
        """Calls of `method` ("GetState", "PushPull", ...) the shards
        (all, or the indices in `shards`) answered so far, whatever their
        code: the sum of their factorps_rpc_requests_total{method=...}
        (needs metrics=True)."""
        import http.client
        import re
        total = 0
        for i, port in enumerate(self.metrics_ports):
            if shards is not None and i not in shards:
                continue
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                c.request("GET", "/metrics")
                text = c.getresponse().read().decode()
            finally:
                c.close()
            for m in re.finditer(r'^factorps_rpc_requests_total\{([^}]*)\} (\S+)$', text, re.M):
                if f'method="{method}"' in m.group(1):
                    total += float(m.group(2))
        return int(total)

    def log(self, i):
        try:
            with open(os.path.join(self.dir, f"shard{i}.log"), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def kill(self, i, sig=signal.SIGKILL):
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs[i] = None

    def restart(self, i):
        """Kills shard i (SIGKILL) and starts a new one on the same port: empty,
        or with `checkpoint` from its newest checkpoint."""
        port = self.ports[i]
        self.kill(i)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.start(i, port)
                return
            except RuntimeError:
                # The old socket may linger a moment; the port is ours to reuse.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self):
        for i in range(len(self.procs)):
            self.kill(i, signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TorchrunJob:
    """A 2-process torchrun job (loopback rendezvous) started in the
    background, so that a test module can run it beside its single-process
    tests: most of either is importing torch and transformers, which two
    cores do side by side. wait() returns (exit code, the output's tail)."""

    def __init__(self, script, args, nproc=2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
               str(free_ports(1)[0]), script] + list(args)
        self.out = tempfile.TemporaryFile()
        # Its own session: kill() ends the workers torchrun started too.
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = "timeout"
        self.out.seek(0)
        return rc, self.out.read().decode(errors="replace")[-4000:]

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()


def _worker_main(target, idx, args, q):
    try:
        q.put((idx, True, target(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put((idx, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_workers(target, args_list, timeout=120):
    """Runs target(*args) in one process per args tuple and returns their
    results in order; raises (after killing the rest) if one fails, dies or
    the whole run exceeds `timeout`. Processes are spawned, not forked: a
    forked child would inherit gRPC's and OpenMP's threads in a broken state.
    `target` must be a module-level function."""
    import multiprocessing as mp
    import queue
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(target, i, a, q), daemon=True)
             for i, a in enumerate(args_list)]
    for p in procs:
        p.start()
    results = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < len(procs):
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers did not finish within {timeout}s")
            try:
                idx, ok, val = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if i not in results and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"worker {dead[0]} died with {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"worker {idx} failed: {val}")
            results[idx] = val
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [results[i] for i in range(len(procs))]


def run_threads(target, args_list, timeout=120):
    """Like run_workers, but one thread of this process per args tuple (each
    worker opens its own connection; libfactorps releases the GIL in its
    calls, so sync rounds across the threads complete): much cheaper than
    a process that imports torch. Raises the first worker's exception."""
    import threading
    results, errors = {}, []

    def body(i, args):
        try:
            results[i] = target(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i, a), daemon=True)
               for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"workers did not finish within {timeout}s")
    return [results[i] for i in range(len(args_list))]

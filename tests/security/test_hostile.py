#!/usr/bin/python3
"""Hostile clients while a job trains (the hostile-client load test).

Two workers train one tensor on a sync shard that runs with the three role
files (workers, admins, peers), a checkpoint directory and /metrics. Twice
over, the same training (same gradients, so bit-identical results): once
undisturbed, once while clients without a token or with the wrong role run
every attack below, each in a process of its own, in bounded loops,
over loopback:

  stalled    6 unauthenticated Create streams stalled inside 16 MiB messages
  unauth     no token: Create with replace and 1 MiB of init, PushPull as
             worker 0, a Pull naming w 1,000 times, Checkpoint, GetState
  worker     a worker token doing what needs another role: Create with
             replace, Checkpoint, Exchange
  peer       a peer token (shard 1's) doing what it may not: PushPull,
             Create, the 1,000-name Pull, Exchange as shard 0
  rules      a worker token breaking the rules: a Create of __metadata__,
             the 1,000-name Pull, a push as worker 7 of 2, a 512 KiB Create
             of empty tensors and a 512 KiB Pull of empty names (which
             protobuf-c would decode into 100x and 52x their size)
  otherjob   a worker token of another job (its own job_id): a Create of
             the job's tensor w and of a tensor of its own
  slowhdr    256 connections with header blocks that never end
  http       200 idle connections to /metrics' port, and the probes

Rapid reset is not among them: the shard does not hold it and a front
proxy does (tests/security/test_front_proxy.py).

Checked: training completes, with weights bit-identical to the
undisturbed run's and the version the workers' steps make (nothing the
hostile clients sent was applied, no tensor of theirs exists, no
checkpoint was written); every hostile call got its refusal code, never
OK; the probes answered 200; the shard's peak RSS exceeds the undisturbed
run's by less than RSS_BOUND (the bound documented in docs/operations.md).

The workers' push p99 against the undisturbed run's is a measurement, not
a check, in the default run: it is printed. On 2 shared cores, and under
a sanitizer that slows the shard several times over, one burst of other
load doubles a p99 by itself (CI once measured 2.1x, 2.9x and 2.2x in three
ASan trials). `--full` is the benchmark: it also checks the p99 within 2x
(a trial repeated up to 3 times until one meets it; an attack that really
slowed the workers would miss every time).

Default: 300 steps per worker, one undisturbed and one hostile run (about
15 s). `--full` (or FPS_HOSTILE_FULL=1): 1,500 steps, two of each,
interleaved (undisturbed, hostile, undisturbed, hostile), p99s compared
pooled.
Usage: FPS_SERVER=build/server/factorps-server FPS_PROTO_DIR=proto \\
       /usr/bin/python3 tests/security/test_hostile.py [--full]"""
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))

import numpy as np  # noqa: E402

import fpsharness as H  # noqa: E402
from test_receive_window import DATA, END_HEADERS, FRAME, HEADERS, SETTINGS, Conn, frame, literal  # noqa: E402

FULL = os.environ.get("FPS_HOSTILE_FULL") == "1"
SHAPE = [256, 256]
RSS_BOUND = int((32 << 20) * float(os.environ.get("FPS_RSS_BOUND_SCALE", "1")))  # ASan: x2 (CMakeLists)
ATTACKS = ("stalled", "unauth", "worker", "peer", "rules", "otherjob", "slowhdr", "http")
JOB = "train-1"  # the job_id the workers' Create names
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0)


def steps():
    return 1500 if FULL else 300


def peak_rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def grads(k, worker):
    g = np.random.default_rng(1000 * k + worker).standard_normal(SHAPE[0] * SHAPE[1]).astype(np.float32)
    return {"w": (SHAPE, g * 0.01)}


# ------------------------------------------------------------- attackers
# Each runs in its own process (python3 test_hostile.py --attack KIND ...):
# its CPU and GIL are not the workers'. It loops until STOP exists (at most
# 600 s), pausing between rounds, and prints one JSON line of what it saw.


def grpc_codes(calls, stop, pause=0.02):
    """Runs calls() rounds: each yields (what, callable); counts the status
    codes by what. Returns {what: {code: n}}."""
    seen = {}
    end = time.monotonic() + 600
    while not os.path.exists(stop) and time.monotonic() < end:
        for what, fn in calls():
            try:
                r = fn()
                if hasattr(r, "__iter__") and not hasattr(r, "ListFields"):
                    for _ in r:
                        pass
                code = "OK"
            except Exception as e:  # noqa: BLE001 - the code is the result
                code = e.code().name if hasattr(e, "code") else repr(e)[:80]
            d = seen.setdefault(what, {})
            d[code] = d.get(code, 0) + 1
        time.sleep(pause)
    return seen


def attack(kind, addr, tokens, metrics_port, stop):
    pb, pbg, grpc = H.stubs()

    def stub(token):
        ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
        s = pbg.ParameterServerStub(ch)
        return H.WithMetadata(s, [("authorization", "Bearer " + token)]) if token else s

    def tok(name):
        with open(os.path.join(tokens, name)) as f:
            return f.read().split()[-1].split(":")[-1]

    opt = H.optimizer()
    init = pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0, data=bytes(1 << 20))
    replace = pb.CreateRequest(shard_id=0, shard_count=2, tensors=[
        pb.TensorCreate(name="w", shape=SHAPE, optimizer=opt, replace=True, init=init)])
    evil = pb.CreateRequest(shard_id=0, shard_count=2, tensors=[pb.TensorCreate(name="evil", shape=[4], optimizer=opt)])
    meta = pb.CreateRequest(shard_id=0, shard_count=2, tensors=[
        pb.TensorCreate(name="__metadata__", shape=[4], optimizer=opt)])
    pull1000 = pb.PullRequest(names=["w"] * 1000)
    other_w = pb.CreateRequest(shard_id=0, shard_count=2, job_id="other-job", tensors=[
        pb.TensorCreate(name="w", shape=SHAPE, optimizer=opt)])
    other_t = pb.CreateRequest(shard_id=0, shard_count=2, job_id="other-job", tensors=[
        pb.TensorCreate(name="other", shape=[4], optimizer=opt)])
    exch = pb.ExchangeRequest(name="w", version=0, from_shard=0, shard_count=2)
    g = grads(0, 0)

    def push(s, worker):
        return lambda: s.PushPull(H.grad_messages(worker, 0, g), timeout=10)

    def raw(token, method, body):
        """A call of `method` with body as its message, bytes as they are."""
        ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
        path = "/factorps.v1.ParameterServer/" + method
        mc = ch.unary_stream(path) if method == "Pull" else ch.unary_unary(path)
        return lambda: mc(body, timeout=10, metadata=[("authorization", "Bearer " + token)])

    # 512 KiB of empty TensorCreates, or of empty names: 50 MiB and 26 MiB
    # decoded, beyond RSS_BOUND, at a quarter of the CPU of 2 MiB.
    tiny = b"\x0a\x00" * (1 << 18)

    if kind in ("unauth", "worker", "peer", "rules", "otherjob"):
        if kind == "rules":
            tiny_create, tiny_pull = raw(tok("workers"), "Create", tiny), raw(tok("workers"), "Pull", tiny)
        s = stub({"unauth": None, "worker": tok("workers"), "peer": tok("peers"), "rules": tok("workers"),
                  "otherjob": tok("workers")}[kind])
        calls = {
            "unauth": lambda: [("create replace", lambda: s.Create(replace, timeout=10)),
                               ("push", push(s, 0)),
                               ("pull x1000", lambda: s.Pull(pull1000, timeout=10)),
                               ("checkpoint", lambda: s.Checkpoint(pb.CheckpointRequest(), timeout=10)),
                               ("getstate", lambda: s.GetState(pb.GetStateRequest(names=["w"]), timeout=10))],
            "worker": lambda: [("create replace", lambda: s.Create(replace, timeout=10)),
                               ("checkpoint", lambda: s.Checkpoint(pb.CheckpointRequest(), timeout=10)),
                               ("exchange", lambda: s.Exchange(exch, timeout=10))],
            "peer": lambda: [("push", push(s, 0)),
                             ("create", lambda: s.Create(evil, timeout=10)),
                             ("pull x1000", lambda: s.Pull(pull1000, timeout=10)),
                             ("exchange as shard 0", lambda: s.Exchange(exch, timeout=10))],
            "rules": lambda: [("create __metadata__", lambda: s.Create(meta, timeout=10)),
                              ("pull x1000", lambda: s.Pull(pull1000, timeout=10)),
                              ("push as worker 7", push(s, 7)),
                              ("create of 512 KiB of empty tensors", tiny_create),
                              ("pull of 512 KiB of empty names", tiny_pull)],
            "otherjob": lambda: [("create w", lambda: s.Create(other_w, timeout=10)),
                                 ("create other", lambda: s.Create(other_t, timeout=10))],
        }[kind]
        print("ready", flush=True)
        return grpc_codes(calls, stop)
    if kind == "stalled":
        hdrs = (literal(b":method", b"POST") + literal(b":scheme", b"http") +
                literal(b":path", b"/factorps.v1.ParameterServer/Create") + literal(b":authority", addr.encode()) +
                literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))
        body = b"\x00" + struct.pack(">I", 16 << 20)
        conns, answered = [], 0
        for _ in range(6):
            c = Conn(addr)
            conns.append(c)
            c.send(PREFACE + frame(HEADERS, END_HEADERS, 1, hdrs))
            sent, idle = 0, time.monotonic()
            # Whatever the shard's windows let in, then stall.
            while not c.closed and time.monotonic() - idle < 0.5:
                n = min(FRAME, c.conn_window, c.stream_window)
                if n <= 0:
                    c.pump(0.05)
                    continue
                c.send(frame(DATA, 0, 1, (body + bytes(n))[:n] if sent == 0 else bytes(n)))
                sent += n
                c.conn_window -= n
                c.stream_window -= n
                idle = time.monotonic()
                c.pump(0)
        print("ready", flush=True)
        end = time.monotonic() + 600
        while not os.path.exists(stop) and time.monotonic() < end:
            for c in conns:
                c.pump(0.01)
            time.sleep(0.05)
        answered = sum(1 for c in conns if c.closed)
        return {"stalled streams": {"held": len(conns), "answered": answered}}
    if kind == "slowhdr":
        host, port = addr.rsplit(":", 1)
        hdrs = (literal(b":method", b"POST") + literal(b":scheme", b"http") +
                literal(b":path", b"/factorps.v1.ParameterServer/Stats") + literal(b":authority", addr.encode()))
        socks = []
        for _ in range(256):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(PREFACE + frame(HEADERS, 0, 1, hdrs[:len(hdrs) // 2]))
            socks.append(s)
        print("ready", flush=True)
        end = time.monotonic() + 600
        while not os.path.exists(stop) and time.monotonic() < end:
            time.sleep(0.05)
        for s in socks:
            s.close()
        return {"slow header connections": {"held": len(socks)}}
    if kind == "http":
        socks = [socket.create_connection(("127.0.0.1", metrics_port), timeout=5) for _ in range(200)]
        print("ready", flush=True)
        codes = {}
        end = time.monotonic() + 600
        while not os.path.exists(stop) and time.monotonic() < end:
            for path in ("/healthz", "/readyz"):
                c = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=5)
                try:
                    c.request("GET", path)
                    code = str(c.getresponse().status)
                except OSError as e:
                    code = repr(e)[:60]
                finally:
                    c.close()
                codes[code] = codes.get(code, 0) + 1
            time.sleep(0.05)
        for s in socks:
            s.close()
        return {"probes behind 200 idle connections": codes}
    raise ValueError(kind)


# Refusals each hostile call may get: anything else (OK above all) fails.
EXPECTED = {
    "unauth": {"UNAUTHENTICATED"},
    "worker": {"PERMISSION_DENIED"},
    "peer": {"PERMISSION_DENIED"},
    "rules": {"INVALID_ARGUMENT", "FAILED_PRECONDITION"},
    "otherjob": {"FAILED_PRECONDITION"},
}
# Calls refused for their size before they are decoded, not for their content.
EXPECTED_CALLS = {
    "create of 512 KiB of empty tensors": {"RESOURCE_EXHAUSTED"},
    "pull of 512 KiB of empty names": {"RESOURCE_EXHAUSTED"},
}


# ------------------------------------------------------------------ job


def run_job(hostile, n_steps):
    """One training of 2 workers x n_steps on a fresh shard; with hostile,
    every attacker process runs meanwhile. Returns a dict."""
    d = tempfile.mkdtemp(prefix="fps-hostile-")
    tokens = os.path.join(d, "tokens")
    os.mkdir(tokens)
    for name, line in (("workers", os.urandom(16).hex()), ("admins", os.urandom(16).hex()),
                       ("peers", "1:" + os.urandom(16).hex())):
        with open(os.path.join(tokens, name), "w") as f:
            f.write(line + "\n")
        os.chmod(os.path.join(tokens, name), 0o600)
    with open(os.path.join(tokens, "workers")) as f:
        wtok = f.read().strip()
    ckdir = os.path.join(d, "ckpt")
    mport = os.path.join(d, "metrics.port")
    # Shard 0 of 2 (shard 1 is not started): the peer file can then name
    # another shard than this one.
    srv = H.Server("--shard-id", "0", "--shard-count", "2", "--mode", "sync", "--workers", "2", "--auth-token-file", os.path.join(tokens, "workers"),
                   "--admin-token-file", os.path.join(tokens, "admins"),
                   "--exchange-token-file", os.path.join(tokens, "peers"), "--checkpoint-dir", ckdir,
                   "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", mport)
    procs, res = {}, {"hostile": hostile}
    stop = os.path.join(d, "stop")
    try:
        with open(mport) as f:
            metrics_port = int(f.read())
        pb, pbg, grpc = H.stubs()
        ch = grpc.insecure_channel(srv.addr, options=[("grpc.max_receive_message_length", 64 << 20)])
        stub = H.WithMetadata(pbg.ParameterServerStub(ch), [("authorization", "Bearer " + wtok)])
        init = np.random.default_rng(1).standard_normal(SHAPE[0] * SHAPE[1]).astype(np.float32)
        # The job's first Create names it (the whole init fits one message).
        stub.Create(pb.CreateRequest(shard_id=0, shard_count=2, job_id=JOB, tensors=[pb.TensorCreate(
            name="w", shape=SHAPE, optimizer=H.optimizer(),
            init=pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0, data=init.tobytes()))]), timeout=60)
        res["rss0"] = peak_rss(srv.proc.pid)
        if hostile:
            for kind in ATTACKS:
                procs[kind] = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--attack", kind, srv.addr, tokens, str(metrics_port),
                     stop], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
            for kind, p in procs.items():
                line = p.stdout.readline()  # "ready": its connections are open, its first round next
                if line.strip() != "ready":
                    raise AssertionError("attacker %s did not start: %s %s" % (kind, line, p.stderr.read()[-2000:]))
            time.sleep(0.3)
        lat = [[], []]
        errors = []

        def worker(wid):
            for k in range(n_steps):
                t0 = time.monotonic()
                try:
                    H.push(stub, wid, k, grads(k, wid), timeout=60)
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append((wid, k, repr(e)[:300]))
                    return
                lat[wid].append(time.monotonic() - t0)

        ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        t_start = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        res["train_seconds"] = time.monotonic() - t_start
        res["lat"] = lat[0] + lat[1]
        res["errors"] = errors
        if hostile:
            open(stop, "w").close()
            res["attacks"] = {}
            for kind, p in procs.items():
                out, err = p.communicate(timeout=60)
                lines = [x for x in out.splitlines() if x.startswith("{")]
                if p.returncode != 0 or not lines:
                    raise AssertionError("attacker %s failed (%s): %s" % (kind, p.returncode, err[-2000:]))
                res["attacks"][kind] = json.loads(lines[-1])
        res["rss1"] = peak_rss(srv.proc.pid)
        params, versions = H.pull(stub, {"w": SHAPE})
        res["w"], res["version"] = params["w"], versions["w"]
        res["tensors"] = sorted(H.stats(stub)[1])
        res["ckpt_files"] = sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []
        ch.close()
    finally:
        open(stop, "w").close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        res["exit"] = srv.terminate(30)  # SIGTERM: a clean stop, after all that
        res["sanitizer"] = srv.sanitizer_report()
        srv.remove()
        shutil.rmtree(d, ignore_errors=True)
    return res


def summary(runs):
    lines = []
    for r in runs:
        lines.append("%-11s %d pushes in %.2f s: p50 %.2f ms, p99 %.2f ms; shard peak RSS %.1f MiB (%.1f before "
                     "training)" % ("hostile" if r["hostile"] else "undisturbed", len(r["lat"]), r["train_seconds"],
                                    pct(r["lat"], 0.5) * 1e3, pct(r["lat"], 0.99) * 1e3, r["rss1"] / 2 ** 20,
                                    r["rss0"] / 2 ** 20))
        for kind, seen in sorted(r.get("attacks", {}).items()):
            lines.append("  %-8s %s" % (kind, json.dumps(seen, sort_keys=True)))
    return "\n".join(lines)


class Hostile(unittest.TestCase):
    def test_training_survives_hostile_clients(self):
        n = steps()
        order = (False, True, False, True) if FULL else (False, True)
        # The p99 ratio is a measurement on a machine shared with other
        # work: a burst of someone else's load in one run can double a p99
        # on its own. The benchmark (--full) repeats a trial (the runs
        # above) up to 3 times until one meets the bound; an attack that
        # really slows the workers fails every trial. The default run only
        # reports it. Everything else must hold in every run.
        runs, ratios = [], []
        for _ in range(3 if FULL else 1):
            trial = [run_job(h, n) for h in order]
            runs += trial
            q = pct([x for r in trial if not r["hostile"] for x in r["lat"]], 0.99)
            h = pct([x for r in trial if r["hostile"] for x in r["lat"]], 0.99)
            ratios.append((h, q))
            if h <= 2 * q:
                break
        text = summary(runs)
        print(text)
        quiet = [r for r in runs if not r["hostile"]]
        hostile = [r for r in runs if r["hostile"]]
        for r in runs:
            self.assertEqual(r["errors"], [], text)
            self.assertEqual(len(r["lat"]), 2 * n, text)
            self.assertEqual(r["version"], n, text)  # one step applied per round, no more
            self.assertEqual(r["tensors"], ["w"], text)
            self.assertEqual(r["exit"], 0, text)
            self.assertIsNone(r["sanitizer"])
            self.assertEqual([f for f in r["ckpt_files"] if f.startswith("ckpt-")], [], text)
            # Bit-identical training: nothing else was applied.
            np.testing.assert_array_equal(r["w"], quiet[0]["w"])
        for r in hostile:
            for kind in ATTACKS:
                self.assertIn(kind, r["attacks"], text)
            for kind, allowed in EXPECTED.items():
                for what, codes in r["attacks"][kind].items():
                    self.assertTrue(codes, (kind, what))
                    self.assertLessEqual(set(codes), EXPECTED_CALLS.get(what, allowed),
                                         "%s %s: %s\n%s" % (kind, what, codes, text))
            self.assertEqual(set(r["attacks"]["http"]["probes behind 200 idle connections"]), {"200"}, text)
            self.assertLess(r["rss1"] - max(q["rss1"] for q in quiet), RSS_BOUND, text)
        print("push p99 hostile / undisturbed per trial: %s" %
              ", ".join("%.2f / %.2f ms" % (h * 1e3, q * 1e3) for h, q in ratios))
        if FULL:
            self.assertLessEqual(ratios[-1][0], 2 * ratios[-1][1],
                                 "push p99 hostile vs undisturbed, %d trials: %s\n%s" % (len(ratios), ratios, text))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--attack":
        _, _, kind, addr, tokdir, mport, stopfile = sys.argv
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        print(json.dumps(attack(kind, addr, tokdir, int(mport), stopfile)), flush=True)
        sys.exit(0)
    if "--full" in sys.argv:
        sys.argv.remove("--full")
        FULL = True
    unittest.main()

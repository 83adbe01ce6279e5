#!/usr/bin/python3
"""A failed call changes nothing: a PushPull whose
gradient was sent whole but whose stream never half-closed (cancelled, past
the client's or the shard's deadline, worker process killed) applies
nothing, in every mode; a sync round never completes with a dead worker's
gradient; a sync call naming several tensors applies all or none of them;
a retry with the same push_id after a lost reply is applied once.
Each test checks the status, the tensor afterwards and the counters."""
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [3, 4]
N = 12
HERE = os.path.dirname(os.path.abspath(__file__))


def counters(stub):
    s, ts = H.stats(stub)
    return (s.shard.pushes, s.shard.push_errors, s.shard.updates), {k: v.version for k, v in ts.items()}


class Base(unittest.TestCase):
    ARGS = ()

    @classmethod
    def setUpClass(cls):
        cls.pb, cls.pbg, cls.grpc = H.stubs()
        cls.srv = H.Server(*cls.ARGS)
        cls.p0 = np.arange(N, dtype=np.float32) / 7

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def fresh(self, name):
        H.create(self.srv.stub, name, SHAPE, self.p0)
        return counters(self.srv.stub)

    def stalled(self, name, worker=0, step=0, hold=30):
        """Messages carrying the whole gradient, then a stream that stays
        open (no half-close) until the event is set."""
        ev = threading.Event()
        msgs = list(H.grad_messages(worker, step, {name: (SHAPE, np.ones(N, np.float32))}))

        def gen():
            yield from msgs
            ev.wait(hold)
        return gen(), ev

    def assertNothingApplied(self, name, before, errors=1):
        (p0, e0, u0), _ = before
        (p1, e1, u1), vers = counters(self.srv.stub)
        self.assertEqual(vers[name], 0, "the aborted push was applied")
        got, ver = H.pull(self.srv.stub, {name: SHAPE})
        np.testing.assert_array_equal(got[name].reshape(-1), self.p0)
        self.assertEqual((p1, u1), (p0, u0))
        self.assertEqual(e1, e0 + errors)

    def wait_errors(self, want, timeout=10):
        t0 = time.monotonic()
        while counters(self.srv.stub)[0][1] < want and time.monotonic() - t0 < timeout:
            time.sleep(0.05)

    def cancel_case(self, name):
        before = self.fresh(name)
        gen, ev = self.stalled(name)
        call = self.srv.stub.PushPull(gen, timeout=30)
        time.sleep(0.5)  # everything sent and staged
        call.cancel()
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(call)
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.CANCELLED)
        ev.set()
        self.wait_errors(before[0][1] + 1)
        self.assertNothingApplied(name, before)

    def client_deadline_case(self, name):
        before = self.fresh(name)
        gen, ev = self.stalled(name)
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(self.srv.stub.PushPull(gen, timeout=1.0))
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.DEADLINE_EXCEEDED)
        ev.set()
        self.wait_errors(before[0][1] + 1)
        self.assertNothingApplied(name, before)

    def killed_case(self, name, worker=0):
        """A worker process sends its whole gradient and is killed before
        it half-closes."""
        before = self.fresh(name)
        code = r'''
import os, signal, sys, time
sys.path.insert(0, %r)
import numpy as np, fpsharness as H
pb, pbg, grpc = H.stubs()
ch = grpc.insecure_channel(%r)
stub = pbg.ParameterServerStub(ch)
msgs = list(H.grad_messages(%d, 0, {%r: (%r, np.ones(%d, np.float32))}))
def gen():
    yield from msgs
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)
for _ in stub.PushPull(gen(), timeout=30):
    pass
''' % (HERE, self.srv.addr, worker, name, SHAPE, N)
        env = dict(os.environ)
        p = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
        self.assertEqual(p.returncode, -signal.SIGKILL)
        self.wait_errors(before[0][1] + 1)
        time.sleep(0.3)
        self.assertNothingApplied(name, before)
        return before


class Async(Base):
    ARGS = ("--mode", "async", "--deadline", 30)

    def test_cancel_before_half_close(self):
        self.cancel_case("c")

    def test_client_deadline_before_half_close(self):
        self.client_deadline_case("d")

    def test_killed_worker_before_half_close(self):
        self.killed_case("k")


class AsyncShardDeadline(Base):
    ARGS = ("--mode", "async", "--deadline", 1)

    def test_shard_deadline_before_half_close(self):
        before = self.fresh("s")
        gen, ev = self.stalled("s")
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(self.srv.stub.PushPull(gen, timeout=None))
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.DEADLINE_EXCEEDED)
        ev.set()
        self.wait_errors(before[0][1] + 1)
        self.assertNothingApplied("s", before)


class Ssp(Base):
    ARGS = ("--mode", "ssp", "--workers", 2, "--staleness", 4, "--deadline", 30)

    def test_cancel_before_half_close(self):
        self.cancel_case("c")

    def test_client_deadline_before_half_close(self):
        self.client_deadline_case("d")

    def test_killed_worker_before_half_close(self):
        self.killed_case("k")


class Sync(Base):
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 30)

    def test_cancel_before_half_close(self):
        self.cancel_case("c")

    def test_last_worker_of_round_killed(self):
        # Worker 1 pushes and waits; worker 0, the last of the round, sends
        # its whole gradient and dies before half-closing: the round must
        # not complete with it. Worker 0's gradient was summed as it came,
        # and a sum cannot be taken apart: the round is aborted, worker 1
        # fails with UNAVAILABLE naming worker 0 (a client retries it), and
        # nothing is applied.
        # Order matters and is waited for, not slept for: worker 0's process
        # starts (Python, numpy, grpc, the stubs: seconds on a loaded
        # machine) and connects before worker 1 pushes, worker 1's gradient
        # is at the shard before worker 0 pushes, and worker 1's deadline
        # only has to cover worker 0's push and death. (Worker 1 used to
        # start first with a 4 s deadline; when worker 0's start-up took
        # over 3 s, the round timed out before worker 0 came.)
        name = "r"
        before = self.fresh(name)
        w0 = self.killed_worker_ready(name)
        received = H.stats(self.srv.stub)[0].shard.bytes_received
        res = {}

        def w1():
            try:
                res["r"] = H.push(self.srv.stub, 1, 0, {name: (SHAPE, np.full(N, 3.0, np.float32))}, timeout=20)
            except self.grpc.RpcError as e:
                res["r"] = e
        th = threading.Thread(target=w1)
        th.start()
        t0 = time.monotonic()
        while H.stats(self.srv.stub)[0].shard.bytes_received < received + 4 * N:
            self.assertLess(time.monotonic() - t0, 20, "worker 1's gradient never reached the shard")
            time.sleep(0.02)
        time.sleep(0.2)  # its half-close follows its last message at once
        self.killed_worker_go(w0)
        th.join(30)
        self.assertFalse(th.is_alive(), "worker 1's call did not end")
        self.assertIsInstance(res["r"], self.grpc.RpcError, "worker 1 got a reply from a round with a dead worker")
        self.assertEqual(res["r"].code(), self.grpc.StatusCode.UNAVAILABLE, res["r"].details())
        self.assertIn("worker 0's call failed", res["r"].details())
        self.assertIn("nothing was applied", res["r"].details())
        self.assertNothingApplied(name, before, errors=2)

    def killed_worker_ready(self, name):
        """Starts worker 0's process and waits until it is connected and
        ready to push; killed_worker_go() lets it push its whole gradient
        and kill itself before half-closing."""
        code = r'''
import os, signal, sys, time
sys.path.insert(0, %r)
import numpy as np, fpsharness as H
pb, pbg, grpc = H.stubs()
ch = grpc.insecure_channel(%r)
grpc.channel_ready_future(ch).result(timeout=60)
stub = pbg.ParameterServerStub(ch)
msgs = list(H.grad_messages(0, 0, {%r: (%r, np.ones(%d, np.float32))}))
print("ready", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(3)
def gen():
    yield from msgs
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)
for _ in stub.PushPull(gen(), timeout=30):
    pass
''' % (HERE, self.srv.addr, name, SHAPE, N)
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        line = p.stdout.readline()  # ends at its exit too, then empty
        self.assertEqual(line.strip(), "ready", "worker 0's process failed before it was ready")
        return p

    def killed_worker_go(self, p):
        p.stdin.write("go\n")
        p.stdin.flush()
        self.assertEqual(p.wait(timeout=60), -signal.SIGKILL)


class SyncMulti(Base):
    """A call's tensors are applied together or not at all (item 3)."""
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 2)

    def pushes(self, calls):
        """Runs each (worker, {name: grad}) call in its own thread: the
        result or the RpcError of each, in order."""
        res = [None] * len(calls)

        def run(i, worker, grads):
            try:
                res[i] = H.push(self.srv.stub, worker, 0, {n: (SHAPE, g) for n, g in grads.items()}, timeout=20)
            except self.grpc.RpcError as e:
                res[i] = e
        ths = []
        for i, (w, g) in enumerate(calls):
            # In this order: each call's gradient is at the shard before the
            # next starts (a fixed sleep was not enough on a loaded machine,
            # see test_last_worker_of_round_killed).
            received = H.stats(self.srv.stub)[0].shard.bytes_received
            ths.append(threading.Thread(target=run, args=(i, w, g)))
            ths[-1].start()
            t0 = time.monotonic()
            while H.stats(self.srv.stub)[0].shard.bytes_received < received + 4 * N * len(g):
                self.assertLess(time.monotonic() - t0, 20, "call %d's gradient never reached the shard" % i)
                time.sleep(0.02)
            time.sleep(0.1)  # its half-close follows its last message at once
        for th in ths:
            th.join(30)
            self.assertFalse(th.is_alive(), "a call did not end")
        return res

    def test_multi_tensor_deadline_applies_nothing(self):
        # Worker 0 pushes {x, y}, worker 1 only {x}: x's round is full but
        # y's never is; at the deadline both calls fail, x and y unchanged.
        H.create(self.srv.stub, "x", SHAPE, self.p0)
        (p0, e0, u0), _ = self.fresh("y")
        one = np.ones(N, np.float32)
        res = self.pushes([(0, {"x": one, "y": one}), (1, {"x": 2 * one})])
        for r in res:
            self.assertIsInstance(r, self.grpc.RpcError, "a call of a failed set got a reply")
            self.assertEqual(r.code(), self.grpc.StatusCode.DEADLINE_EXCEEDED, r.details())
            self.assertIn("tensor 'y' step 0: sync round timed out", r.details())
            self.assertIn("waiting for workers 1 (1 of 2 missing)", r.details())
            self.assertIn("none of the 2 rounds", r.details())
        (p, e, u), vers = counters(self.srv.stub)
        self.assertEqual((vers["x"], vers["y"]), (0, 0))
        self.assertEqual((p, e, u), (p0, e0 + 2, u0))
        got, ver = H.pull(self.srv.stub, {"x": SHAPE, "y": SHAPE})
        self.assertEqual(ver, {"x": 0, "y": 0})
        for n in "xy":
            np.testing.assert_array_equal(got[n].reshape(-1), self.p0)

    def test_multi_tensor_split_calls_apply_together(self):
        # Worker 1 sends {u} and {v} in two calls: one set with worker 0's
        # {u, v}, applied at once when the last call arrives.
        H.create(self.srv.stub, "u", SHAPE, self.p0)
        (p0, e0, u0), _ = self.fresh("v")
        one = np.ones(N, np.float32)
        res = self.pushes([(0, {"u": one, "v": one}), (1, {"u": 3 * one}), (1, {"v": 3 * one})])
        for r in res:
            self.assertNotIsInstance(r, self.grpc.RpcError, getattr(r, "details", lambda: "")())
        self.assertEqual(res[0][1], {"u": 1, "v": 1})
        self.assertEqual(res[1][1], {"u": 1})
        self.assertEqual(res[2][1], {"v": 1})
        np.testing.assert_array_equal(res[0][0]["u"], res[1][0]["u"])
        np.testing.assert_array_equal(res[0][0]["v"], res[2][0]["v"])
        (p, e, u), vers = counters(self.srv.stub)
        self.assertEqual((vers["u"], vers["v"]), (1, 1))
        self.assertEqual((p, e, u), (p0 + 3, e0, u0 + 2))


def id_messages(worker, step, name, g, push_id):
    msgs = list(H.grad_messages(worker, step, {name: (SHAPE, g)}))
    for m in msgs:
        m.push_id = push_id
    return msgs


class RetryAsync(Base):
    ARGS = ("--mode", "async", "--deadline", 30)

    def push_id(self, name, pid, g=None, worker=0):
        g = np.ones(N, np.float32) if g is None else g
        return H.collect(self.srv.stub.PushPull(iter(id_messages(worker, 0, name, g, pid)), timeout=20),
                         {name: SHAPE})

    def test_retry_after_lost_reply_applied_once(self):
        (p0, e0, u0), _ = self.fresh("a")
        # The reply is lost: the stream half-closed whole, then the client
        # went away before reading the answer.
        call = self.srv.stub.PushPull(iter(id_messages(0, 0, "a", np.ones(N, np.float32), 41)), timeout=20)
        call.cancel()
        time.sleep(0.5)
        (_, _, u1), vers = counters(self.srv.stub)
        first_applied = vers["a"]
        self.assertIn(first_applied, (0, 1))
        # The retry: applied at most once in all.
        got, ver = self.push_id("a", 41)
        self.assertEqual(ver["a"], 1)
        again, ver2 = self.push_id("a", 41)  # and again: still once
        self.assertEqual(ver2["a"], 1)
        np.testing.assert_array_equal(got["a"], again["a"])
        (p, e, u), vers = counters(self.srv.stub)
        self.assertEqual(vers["a"], 1)
        self.assertEqual(u, u0 + 1)
        # A new push_id is a new push; the same id of another worker too.
        _, ver = self.push_id("a", 42)
        self.assertEqual(ver["a"], 2)
        _, ver = self.push_id("a", 41, worker=9)
        self.assertEqual(ver["a"], 3)
        # A late retry is told the version its first attempt made, with the
        # current params.
        late, ver = self.push_id("a", 41)
        self.assertEqual(ver["a"], 1)
        now, _ = H.pull(self.srv.stub, {"a": SHAPE})
        np.testing.assert_array_equal(late["a"], now["a"])
        # A "retry" that names other tensors is refused.
        self.fresh("b")
        with self.assertRaises(self.grpc.RpcError) as cm:
            self.push_id("b", 41)
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("applied to other tensors", cm.exception.details())
        (p, e, u), vers = counters(self.srv.stub)
        self.assertEqual((u, vers["a"], vers["b"]), (u0 + 3, 3, 0))

    def test_push_id_must_not_change_mid_stream(self):
        before = self.fresh("m")
        msgs = list(H.grad_messages(0, 0, {"m": (SHAPE, np.ones(N, np.float32))}, slice_elems=6))
        msgs[0].push_id, msgs[1].push_id = 5, 6
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(self.srv.stub.PushPull(iter(msgs), timeout=10))
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("push_id changed", cm.exception.details())
        self.assertNothingApplied("m", before)


class RetrySync(Base):
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 30)

    def test_sync_retry_and_in_flight(self):
        (p0, e0, u0), _ = self.fresh("s")
        res = {}

        def w0():
            res["r"] = H.collect(self.srv.stub.PushPull(iter(id_messages(0, 0, "s", np.ones(N, np.float32), 7)),
                                                        timeout=20), {"s": SHAPE})
        th = threading.Thread(target=w0)
        th.start()
        time.sleep(0.4)
        # The same key while the first is parked in its round: UNAVAILABLE.
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(self.srv.stub.PushPull(iter(id_messages(0, 0, "s", np.ones(N, np.float32), 7)), timeout=10))
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.UNAVAILABLE, cm.exception.details())
        self.assertIn("still being applied", cm.exception.details())
        got1 = H.collect(self.srv.stub.PushPull(iter(id_messages(1, 0, "s", np.full(N, 3.0, np.float32), 7)),
                                                timeout=20), {"s": SHAPE})
        th.join(20)
        self.assertEqual(res["r"][1]["s"], 1)
        # Worker 0 retries after the round: answered, not a new round.
        again = H.collect(self.srv.stub.PushPull(iter(id_messages(0, 0, "s", np.ones(N, np.float32), 7)),
                                                 timeout=5), {"s": SHAPE})
        self.assertEqual(again[1]["s"], 1)
        np.testing.assert_array_equal(again[0]["s"], got1[0]["s"])
        (p, e, u), vers = counters(self.srv.stub)
        self.assertEqual((vers["s"], u, e), (1, u0 + 1, e0 + 1))
        self.assertEqual(p, p0 + 3)  # two round members and the answered retry


if __name__ == "__main__":
    unittest.main()


class SyncBackpressure(Base):
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 60)

    def test_held_call_resumes_and_sums_exactly(self):
        # Worker 1 streams a 12 MiB gradient while worker 0 has sent only its
        # first slice and waits: the shard stops reading worker 1 once about
        # 4 MiB of it are staged (backpressure) and reads on as worker 0's
        # slices arrive. Neither may hang, and both must get the update of
        # (g0 + g1) / 2 bit for bit, as a one-worker shard computes it.
        shape, n, name = [3072, 1024], 3072 * 1024, "bp"
        rng = np.random.default_rng(5)
        p0 = (0.5 * rng.standard_normal(n)).astype(np.float32)
        g = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        H.create(self.srv.stub, name, shape, p0)
        before = H.stats(self.srv.stub)[0].shard.bytes_received
        msgs0 = list(H.grad_messages(0, 0, {name: (shape, g[0])}, slice_elems=1 << 18))
        msgs1 = list(H.grad_messages(1, 0, {name: (shape, g[1])}, slice_elems=1 << 20))
        go = threading.Event()

        def stream0():
            yield msgs0[0]
            go.wait(60)
            yield from msgs0[1:]

        res = {}

        def worker(k, it):
            try:
                res[k] = H.collect(self.srv.stub.PushPull(it, timeout=60), {name: shape})
            except Exception as e:  # noqa: BLE001  (reported below)
                res[k] = e

        t0 = threading.Thread(target=worker, args=(0, stream0()))
        t0.start()
        end = time.monotonic() + 30
        while H.stats(self.srv.stub)[0].shard.bytes_received < before + (1 << 18) * 4:
            self.assertLess(time.monotonic(), end, "worker 0's first slice never arrived")
            time.sleep(0.01)
        t1 = threading.Thread(target=worker, args=(1, iter(msgs1)))
        t1.start()
        time.sleep(0.5)  # lets worker 1 run into the hold; nothing is timed
        go.set()
        t0.join(90)
        t1.join(90)
        self.assertFalse(t0.is_alive() or t1.is_alive(), "a held call never resumed")
        for k in (0, 1):
            self.assertNotIsInstance(res[k], Exception, res[k])
            self.assertEqual(res[k][1][name], 1)
        np.testing.assert_array_equal(res[0][0][name], res[1][0][name])
        ref = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(ref.stub, name, shape, p0)
            avg = (g[0] + g[1]) / np.float32(2)
            want, _ = H.push(ref.stub, 0, 0, {name: (shape, avg)})
        finally:
            ref.stop()
        np.testing.assert_array_equal(res[0][0][name], want[name])

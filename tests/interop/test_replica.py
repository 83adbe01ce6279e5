#!/usr/bin/python3
"""Standby replicas, server side (docs/shards.md "Standby replicas"): a
primary and a standby of one shard with --lease file:, driven by a grpcio
client that talks to whichever replica is primary.

- the standby refuses worker calls with UNAVAILABLE naming the primary,
  and Stats shows the roles, terms and that the standby joined;
- pushes in sync and async are acknowledged only once the standby has
  them: after SIGKILL of the primary the standby takes over (lease, term
  + 1) with every acknowledged push (versions and checksums equal to what
  the primary had acknowledged, parameters bit-identical), and a retry of
  an acknowledged push (same push_id) is answered from the window, not
  applied again;
- the old primary, restarted, rejoins as standby by state transfer while
  the new primary serves, and ends with the same checksums;
- bad Replicate input (wrong shard id, count, mode, workers, lower term,
  missing hello, seq gaps, malformed pieces) is refused and changes
  nothing.
"""
import os
import shutil
import sys
import tempfile
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fpsharness as H  # noqa: E402

SHAPES = {"w": [64, 48], "b": [48]}


class Pair:
    """Two replicas of shard 0 on fixed loopback ports, each naming the
    other, one lease file. a and b are fpsharness.Server (or None)."""

    def __init__(self, *args):
        self.dir = tempfile.mkdtemp(prefix="fps-replica-")
        self.lease = os.path.join(self.dir, "shard0.lease")
        self.args = [str(a) for a in args]
        for attempt in range(5):
            self.ports = H.free_ports(2)
            try:
                self.a = self.start(0)
                self.wait_role(self.a, "primary")
                self.b = self.start(1)
                return
            except H.ServerExited as e:
                self.close()
                if "cannot listen" not in e.err or attempt == 4:
                    raise

    def addr(self, i):
        return "127.0.0.1:%d" % self.ports[i]

    def start(self, i):
        return H.Server(*self.args, "--replica-peer", self.addr(1 - i), "--lease", "file:" + self.lease,
                        listen=self.addr(i))

    def stats(self, srv):
        return H.stats(srv.stub)

    def wait_role(self, srv, role, joined=None, seconds=20):
        end = time.monotonic() + seconds
        while True:
            s, _ = self.stats(srv)
            if s.shard.replica_role == role and (joined is None or s.shard.standby_joined == joined):
                return s
            if time.monotonic() > end:
                raise AssertionError("%s: role %s joined %s, wanted %s/%s" % (
                    srv.addr, s.shard.replica_role, s.shard.standby_joined, role, joined))
            time.sleep(0.02)

    def close(self):
        for s in (getattr(self, "a", None), getattr(self, "b", None)):
            if s is not None and s.proc.poll() is None:
                s.kill()
        shutil.rmtree(self.dir, True)


def stop_process(proc):
    """SIGSTOP, then wait (bounded) until every thread is stopped: the
    signal returns before the stop takes hold, and a thread still running
    on another CPU could acknowledge what the test sends next."""
    import signal
    proc.send_signal(signal.SIGSTOP)
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not stop within 5 s")


def checksums(srv):
    _, ts = H.stats(srv.stub)
    return {n: (t.version, t.checksum) for n, t in ts.items()}


def push_id_messages(worker, step, grads, push_id):
    for m in H.grad_messages(worker, step, grads):
        m.push_id = push_id
        yield m


class Replica(unittest.TestCase):
    def setUp(self):
        self.pb, self.pbg, self.grpc = H.stubs()
        self.rng = np.random.default_rng(5)
        self.init = {n: (0.3 * self.rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}

    def grads(self):
        return {n: (s, self.rng.standard_normal(s).astype(np.float32)) for n, s in SHAPES.items()}

    def create_all(self, stub):
        for n, s in SHAPES.items():
            H.create(stub, n, s, self.init[n])

    def push(self, stub, worker, step, grads, push_id):
        shapes = {k: v[0] for k, v in grads.items()}
        return H.collect(stub.PushPull(push_id_messages(worker, step, grads, push_id), timeout=60), shapes)

    def failover(self, mode, workers):
        pair = Pair("--mode", mode, "--workers", workers)
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            s = pair.wait_role(b, "standby", joined=True)
            self.assertEqual(s.shard.replica_peer, pair.addr(0))
            sa = pair.wait_role(a, "primary", joined=True)
            self.assertGreaterEqual(sa.shard.term, 1)
            self.assertEqual(s.shard.term, sa.shard.term)
            # The standby serves no worker call, and says who does.
            with self.assertRaises(self.grpc.RpcError) as cm:
                H.pull(b.stub, {"w": SHAPES["w"]})
            self.assertEqual(cm.exception.code(), self.grpc.StatusCode.UNAVAILABLE)
            self.assertIn("shard 0 is a standby (term %d); primary: %s" % (sa.shard.term, pair.addr(0)),
                          cm.exception.details())
            # Training: each acknowledged step is on the standby already.
            acked = {}
            last = None
            pid = 1
            for step in range(6):
                gs = [self.grads() for _ in range(workers)]
                outs = [None] * workers

                def run(w, step=step, gs=gs, outs=outs, pid=pid):
                    outs[w] = self.push(a.stub, w, step, gs[w], pid + w)
                threads = [H.threading.Thread(target=run, args=(w,), daemon=True) for w in range(workers)]
                for t in threads:
                    t.start()
                H.join(threads, "step %d" % step)
                pid += workers
                last = (outs[0], gs, pid - workers)
                for n in SHAPES:
                    acked[n] = outs[0][1][n]
            want = checksums(a)
            self.assertEqual({n: v for n, (v, _) in want.items()}, acked)
            got = checksums(b)
            self.assertEqual(got, want)  # the standby holds the same bits, before any failover
            shard_sum = a.stub.Stats(self.pb.StatsRequest(include_checksum=True), timeout=30).shard.state_checksum
            self.assertNotEqual(shard_sum, 0)
            self.assertEqual(b.stub.Stats(self.pb.StatsRequest(include_checksum=True), timeout=30).shard.state_checksum,
                             shard_sum)
            self.assertEqual(a.stub.Stats(self.pb.StatsRequest(), timeout=30).shard.state_checksum, 0)
            params_a, _ = H.pull(a.stub, SHAPES)
            # SIGKILL the primary: the standby takes the lease with term + 1.
            a.kill()
            pair.a = None
            t0 = time.monotonic()
            s = pair.wait_role(b, "primary")
            took = time.monotonic() - t0
            self.assertEqual(s.shard.term, sa.shard.term + 1)
            self.assertLess(took, 5.0)
            self.assertNotIn("answered pushes alone", b.stderr())
            self.assertEqual(checksums(b), want)
            params_b, vb = H.pull(b.stub, SHAPES)
            for n in SHAPES:
                np.testing.assert_array_equal(params_b[n], params_a[n])
            self.assertEqual(vb, acked)
            # A retry of the last acknowledged push is answered from the
            # window (its key was on the standby), not applied again.
            (params_last, vers_last), gs, first_pid = last
            got_p, got_v = self.push(b.stub, 0, 5, gs[0], first_pid) if mode == "async" else (None, None)
            if mode == "async":
                self.assertEqual(got_v, vers_last)
                self.assertEqual(checksums(b), want)
            # Training goes on on the new primary.
            if workers == 1:
                out = self.push(b.stub, 0, vb["w"], self.grads(), 1000)
                self.assertEqual(out[1]["w"], vb["w"] + 1)
        finally:
            pair.close()

    def test_sync_failover(self):
        self.failover("sync", 1)

    def test_sync_two_workers_failover(self):
        self.failover("sync", 2)

    def test_async_failover(self):
        self.failover("async", 1)

    def push_once_then_stop_standby(self, pair):
        """Creates the tensors on the pair's primary, waits until its
        standby joined, pushes once (version 1), then stops the standby
        (SIGSTOP; the caller sends SIGCONT)."""
        self.create_all(pair.a.stub)
        pair.wait_role(pair.a, "primary", joined=True)
        self.push(pair.a.stub, 0, 0, self.grads(), 1)
        stop_process(pair.b.proc)

    def held_until_standby_runs(self, pair, call, what):
        """With the pair's standby stopped, runs call() in a thread: it must
        not return within 0.7 s; then SIGCONT, and it must. Its result."""
        import signal
        import threading
        out = {}
        t = threading.Thread(target=lambda: out.update(r=call()), daemon=True)
        try:
            t.start()
            t.join(0.7)
            self.assertTrue(t.is_alive(), "%s was answered while its standby was stopped" % what)
        finally:
            pair.b.proc.send_signal(signal.SIGCONT)
        H.join([t], "%s after SIGCONT" % what)
        return out["r"]

    def test_ack_waits_for_the_standby(self):
        """A push is answered only once the joined standby has it: with the
        standby stopped (SIGSTOP) the answer does not come; once it runs
        again, it does, and the standby holds what was answered."""
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.push_once_then_stop_standby(pair)
            r = self.held_until_standby_runs(pair, lambda: self.push(a.stub, 0, 0, self.grads(), 2), "the push")
            self.assertEqual(r[1]["w"], 2)
            self.assertEqual(checksums(b), checksums(a))
        finally:
            pair.close()

    def test_create_of_a_ready_tensor_is_not_shipped_again(self):
        """Every worker Creates the model; only the Create that made or
        changed a tensor waits for the standby to get its image. With the
        standby stopped (SIGSTOP), a Create that finds the tensors ready
        and unchanged (with values or without) is answered at once, at
        their version; a Create of a new tensor is not, until the standby
        runs again and holds it."""
        import threading
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.push_once_then_stop_standby(pair)
            out = {}
            again = threading.Thread(target=lambda: out.update(
                w=H.create(a.stub, "w", SHAPES["w"], self.init["w"], timeout=30),
                b=H.create(a.stub, "b", SHAPES["b"], timeout=30)), daemon=True)
            again.start()
            H.join([again], "a Create of ready tensors while the standby is stopped", seconds=10)
            for n in SHAPES:
                info = out[n].tensors[0]
                self.assertTrue(info.ready and not info.created, info)
                self.assertEqual(info.version, 1, n)
            c = self.held_until_standby_runs(
                pair, lambda: H.create(a.stub, "c", [8, 8], np.ones([8, 8], np.float32), timeout=30),
                "a new tensor's Create")
            self.assertTrue(c.tensors[0].created)
            want = checksums(a)
            self.assertEqual(sorted(want), ["b", "c", "w"])
            self.assertEqual(checksums(b), want)
        finally:
            pair.close()

    def test_transfer_keys_never_ahead_of_its_images(self):
        """A push applied while the state transfer runs has its key in the
        window the transfer sends: by transfer_done the standby must also
        hold that push's tensor at least at the version the key names, or
        a retry after a promotion would be answered from a key whose update
        the standby lacks. A fake standby (this test's Replicate server)
        reads the transfer slowly while a worker pushes one tensor at a
        time; every key received before transfer_done is checked against
        the newest image of its tensor received before it."""
        import threading
        from concurrent import futures
        pb, pbg, grpc = self.pb, self.pbg, self.grpc
        names = ["t%d" % i for i in range(6)]
        shape = [512, 1024]
        got = {"images": {}, "keys": [], "done": False}

        class FakeStandby(pbg.ParameterServerServicer):
            def Replicate(self, requests, context):
                term = 0
                for m in requests:
                    if m.HasField("hello"):
                        term = m.hello.term
                    if not got["done"]:
                        for t in m.tensors:
                            if t.offset + len(t.data) == t.total_bytes:  # its last piece
                                got["images"][t.name] = max(got["images"].get(t.name, 0), t.version)
                        got["keys"] += [(k.push_id, list(k.versions)) for k in m.keys]
                        got["done"] = m.transfer_done
                        if m.tensors:
                            time.sleep(0.15)  # a slow reader: the pushes go on meanwhile
                    yield pb.ReplicateResponse(acked=m.seq, term=term)

        fake_port = H.free_ports(1)[0]
        d = tempfile.mkdtemp(prefix="fps-replica-")
        a = fake = None
        stop = threading.Event()
        try:
            a = H.Server("--mode", "async", "--replica-peer", "127.0.0.1:%d" % fake_port,
                         "--lease", "file:" + os.path.join(d, "lease"))
            rng = np.random.default_rng(9)
            for n in names:
                H.create(a.stub, n, shape, (0.3 * rng.standard_normal(shape)).astype(np.float32),
                         slice_elems=1 << 20)
            pushed = {}

            def pusher():
                i = 0
                while not stop.is_set() and i < 2000:
                    n = names[i % len(names)]
                    pushed[1000 + i] = n
                    g = {n: (shape, rng.standard_normal(shape).astype(np.float32))}
                    self.push(a.stub, 0, 0, g, 1000 + i)
                    i += 1

            t = threading.Thread(target=pusher, daemon=True)
            t.start()
            time.sleep(0.2)
            fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                               options=[("grpc.max_receive_message_length", 1 << 30)])
            pbg.add_ParameterServerServicer_to_server(FakeStandby(), fake)
            fake.add_insecure_port("127.0.0.1:%d" % fake_port)
            fake.start()
            end = time.monotonic() + 60
            while not got["done"] and time.monotonic() < end:
                time.sleep(0.05)
            stop.set()
            H.join([t], "the pusher")
            self.assertTrue(got["done"], "no transfer_done within 60 s")
            self.assertEqual(sorted(got["images"]), names)
            during = [(pid, v) for pid, v in got["keys"] if pid in pushed]
            self.assertTrue(during, "no push was applied before transfer_done")
            behind = [(pid, pushed[pid], v[0], got["images"][pushed[pid]]) for pid, v in during
                      if v[0] > got["images"][pushed[pid]]]
            self.assertEqual(behind, [], "keys (push_id, tensor, key version, image version) ahead of "
                             "the newest image sent before transfer_done")
        finally:
            stop.set()
            if fake is not None:
                fake.stop(0)
            if a is not None:
                a.kill()
            shutil.rmtree(d, True)

    def test_standby_lost_primary_goes_on(self):
        """A standby that dies is dropped: the primary answers alone."""
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            pair.wait_role(a, "primary", joined=True)
            b.kill()
            pair.b = None
            t0 = time.monotonic()
            out = self.push(a.stub, 0, 0, self.grads(), 1)
            self.assertEqual(out[1]["w"], 1)
            self.assertLess(time.monotonic() - t0, 5.0)
            s = pair.wait_role(a, "primary", joined=False)
            self.assertEqual(s.shard.replica_role, "primary")
        finally:
            pair.close()

    def test_higher_term_fences_the_primary(self):
        """A primary that learns of a higher term stops acknowledging at
        once: here a stream of a newer term reaches its standby (as a new
        primary's would after a partition), the standby refuses the old
        primary's stream with "term T is older than U", and the old
        primary steps down: its waiting push and every later call fail
        UNAVAILABLE."""
        import threading
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            sa = pair.wait_role(a, "primary", joined=True)
            sb, _ = H.stats(b.stub)
            pb = self.pb
            hello = pb.ReplicateHello(shard_id=0, shard_count=1, term=sa.shard.term + 5, mode=pb.MODE_ASYNC,
                                      workers=1, simd=sb.shard.simd, primary="127.0.0.1:9")
            release = threading.Event()

            def stream():
                yield pb.ReplicateRequest(seq=1, hello=hello)
                release.wait(30)
            # A real new primary took the lease first (a standby refuses a
            # term the lease never granted): its counter moves as a new
            # holder's acquisition moves it.
            with open(pair.lease, "w") as f:
                f.write("%d in-sync\n" % (sa.shard.term + 5))
            call = b.stub.Replicate(stream(), timeout=60)
            self.assertEqual(next(call).acked, 1)
            try:
                with self.assertRaises(self.grpc.RpcError) as cm:
                    self.push(a.stub, 0, 0, self.grads(), 7)
                self.assertEqual(cm.exception.code(), self.grpc.StatusCode.UNAVAILABLE)
                s = pair.wait_role(a, "standby")
                self.assertEqual(s.shard.term, sa.shard.term + 5)
                with self.assertRaises(self.grpc.RpcError) as cm:
                    H.pull(a.stub, {"w": SHAPES["w"]})
                self.assertEqual(cm.exception.code(), self.grpc.StatusCode.UNAVAILABLE)
                self.assertIn("is a standby (term %d)" % (sa.shard.term + 5), cm.exception.details())
            finally:
                release.set()
                call.cancel()
        finally:
            pair.close()

    def test_forged_streams_cannot_wedge_the_pair(self):
        """Replicate calls from a client that is not the primary (without
        token files any client may make them: operations.md, security).
        A hello of a term the lease never granted (term + 1, 2^64 - 1) is
        refused by both replicas and fences nobody; a message refused for
        its commit before transfer_done installs none of its tensors; a
        hello of the current term takes the standby's stream for a moment,
        but the real primary's next message is refused ("a newer stream of
        term T replaced this one"), it reconnects, its transfer makes the
        standby joined again, and a SIGKILL of the primary still fails
        over. Before, the 2^64 - 1 hello left both replicas standbys for
        good, and the current-term one left the standby unjoined (never
        promoted) while the primary kept acknowledging."""
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            pb = self.pb
            self.create_all(a.stub)
            pair.wait_role(b, "standby", joined=True)
            sa = pair.wait_role(a, "primary", joined=True)
            self.push(a.stub, 0, 0, self.grads(), 1)
            term = sa.shard.term
            hello = dict(shard_id=0, shard_count=1, term=term, mode=pb.MODE_ASYNC, workers=1, simd=sa.shard.simd,
                         primary="127.0.0.1:1")
            for srv in (a, b):
                for t in (term + 1, 2**64 - 1):
                    with self.assertRaises(self.grpc.RpcError) as cm:
                        list(srv.stub.Replicate(iter([pb.ReplicateRequest(
                            seq=1, hello=pb.ReplicateHello(**dict(hello, term=t)))]), timeout=10))
                    self.assertEqual(cm.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION)
                    self.assertIn("term %d was never granted: the lease's newest term is %d" % (t, term),
                                  cm.exception.details())
            sa = pair.wait_role(a, "primary", joined=True)
            self.assertEqual(sa.shard.term, term)
            self.assertEqual(H.stats(b.stub)[0].shard.term, term)

            deadline = time.monotonic() + 10
            while checksums(b) != checksums(a) and time.monotonic() < deadline:
                time.sleep(0.02)
            before = checksums(b)
            self.assertEqual(before, checksums(a))
            cfg = pb.AdafactorConfig(flavor=pb.FLAVOR_TORCH, lr=0.01, beta2_decay=-0.8, eps1=2.0**-23, eps2=1e-3,
                                     clip_threshold=1, weight_decay=0, maximize=False)
            image = pb.ReplicaTensor(name="x", shape=[4], config=cfg, version=1, step=1, state_elements=[0, 0, 4, 0],
                                     total_bytes=32, data=np.ones(8, "<f4").tobytes())
            forged = [pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**hello)),
                      pb.ReplicateRequest(seq=2, tensors=[image], commit=True, transfer_done=True)]
            with self.assertRaises(self.grpc.RpcError) as cm:
                list(b.stub.Replicate(iter(forged), timeout=10))
            self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("a commit before transfer_done", cm.exception.details())
            self.assertEqual(checksums(b), before)  # no 'x', nothing else changed
            # The primary's stream was replaced: it reconnects and its
            # transfer makes the standby joined again.
            pair.wait_role(b, "standby", joined=True)
            pair.wait_role(a, "primary", joined=True)
            r = self.push(a.stub, 0, 1, self.grads(), 2)
            self.assertEqual(r[1]["w"], 2)
            a.kill()
            s = pair.wait_role(b, "primary")
            self.assertGreater(s.shard.term, term)
            _, ts = H.stats(b.stub)
            self.assertEqual({n: t.version for n, t in ts.items()}, {"w": 2, "b": 2})
        finally:
            pair.close()

    def test_answered_alone_then_killed_is_said(self):
        """REPLICA.md CHANGED 08:15: the standby stalls (SIGSTOP) past the
        stream's keepalive, the primary drops it and answers alone (after
        recording "alone" in the lease), then the primary is SIGKILLed.
        The standby, promoted, never serves the older state silently: it
        logs that the previous primary answered alone, and the pushes it
        answered alone are indeed not there. A clean failover says
        nothing of the kind."""
        import signal
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            pair.wait_role(a, "primary", joined=True)
            self.push(a.stub, 0, 0, self.grads(), 1)
            with open(pair.lease) as f:
                self.assertTrue(f.read().endswith(" in-sync\n"))
            stop_process(b.proc)
            try:
                # Answered once the primary dropped the stalled standby.
                t0 = time.monotonic()
                out = self.push(a.stub, 0, 0, self.grads(), 2)
                self.assertEqual(out[1]["w"], 2)
                self.assertGreater(time.monotonic() - t0, 1.0)
                with open(pair.lease) as f:
                    self.assertTrue(f.read().endswith(" alone\n"))
                out = self.push(a.stub, 0, 0, self.grads(), 3)  # alone at once
                self.assertEqual(out[1]["w"], 3)
                a.kill()
                pair.a = None
            finally:
                b.proc.send_signal(signal.SIGCONT)
            s = pair.wait_role(b, "primary")
            self.assertIn("previous primary answered pushes alone", b.stderr())
            _, ts = H.stats(b.stub)
            self.assertEqual(ts["w"].version, 1)  # 2 and 3 were answered alone
        finally:
            pair.close()

    def test_rejoin_while_training(self):
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            pair.wait_role(b, "standby", joined=True)
            for i in range(3):
                self.push(a.stub, 0, 0, self.grads(), 10 + i)
            a.kill()
            pair.a = None
            pair.wait_role(b, "primary")
            # Training on b while the old primary comes back as standby.
            a2 = pair.a = pair.start(0)
            for i in range(5):
                self.push(b.stub, 0, 0, self.grads(), 100 + i)
            pair.wait_role(a2, "standby", joined=True)
            pair.wait_role(b, "primary", joined=True)
            self.push(b.stub, 0, 0, self.grads(), 200)
            self.assertEqual(checksums(a2), checksums(b))
            _, ts = H.stats(b.stub)
            self.assertEqual(ts["w"].version, 9)
        finally:
            pair.close()

    def test_small_messages_share_and_cut_images(self):
        # Pieces of 32 KiB (--max-message-bytes 64 KiB): the small tensors'
        # images share one message, the big one's is cut across several,
        # on the stream and in a state transfer; the bits come out equal.
        pair = Pair("--mode", "async", "--max-message-bytes", "65536")
        try:
            a, b = pair.a, pair.b
            big = [96, 128]
            self.create_all(a.stub)
            H.create(a.stub, "big", big, (0.3 * self.rng.standard_normal(big)).astype(np.float32))
            pair.wait_role(b, "standby", joined=True)
            for i in range(3):
                g = dict(self.grads(), big=(big, self.rng.standard_normal(big).astype(np.float32)))
                self.push(a.stub, 0, 0, g, 300 + i)
            want = checksums(a)
            self.assertEqual(want["big"][0], 3)
            self.assertEqual(checksums(b), want)
            b.kill()
            b = pair.b = pair.start(1)
            pair.wait_role(b, "standby", joined=True)
            self.assertEqual(checksums(b), want)
        finally:
            pair.close()

    def test_bad_replicate_input_changes_nothing(self):
        pair = Pair("--mode", "async")
        try:
            a, b = pair.a, pair.b
            self.create_all(a.stub)
            pair.wait_role(b, "standby", joined=True)
            self.push(a.stub, 0, 0, self.grads(), 1)
            # Acknowledged once the standby has the update; it installs it
            # a moment later, so wait for the version before comparing.
            deadline = time.monotonic() + 20
            while any(v != 1 for v, _ in checksums(b).values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            before = checksums(b)
            self.assertTrue(all(v == 1 for v, _ in before.values()), before)
            sb, _ = H.stats(b.stub)
            pb = self.pb
            hello = dict(shard_id=0, shard_count=1, term=sb.shard.term, mode=pb.MODE_ASYNC, workers=1,
                         simd=sb.shard.simd, primary="127.0.0.1:1")
            cases = [
                ([pb.ReplicateRequest(seq=1)], "first message must carry the hello"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, shard_id=3)))], "shard 3 of 1"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, shard_count=2)))], "of 2"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, mode=pb.MODE_SYNC)))],
                 "--mode sync"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, workers=2)))], "--workers 2"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, simd="nope")))], "kernels"),
                ([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**dict(hello, term=sb.shard.term - 1)))],
                 "term %d is older than %d" % (sb.shard.term - 1, sb.shard.term)),
            ]
            # The standby reads a tensor's data where gRPC received it and
            # unpacks the rest: framing it cannot walk is refused whole.
            first = pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**hello)).SerializeToString()
            raw = b._channel.stream_stream("/factorps.v1.ParameterServer/Replicate",
                                           request_serializer=lambda x: x,
                                           response_deserializer=pb.ReplicateResponse.FromString)
            for bad in (b"\x1a\x05\x0a\x01w\x62", b"\x1a\x03\x62\x05\x00", b"\x1a\x09\x62\x20ab",
                        b"\x1a\x7fxy"):
                with self.assertRaises(self.grpc.RpcError) as cm:
                    list(raw(iter([first + bad]), timeout=10))
                self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT, bad)
                self.assertIn("malformed ReplicateRequest", cm.exception.details())
            # Pieces are decoded one by one: their count is bounded, and
            # together they stay within the whole message's decode bound.
            with self.assertRaises(self.grpc.RpcError) as cm:
                list(raw(iter([first + b"\x1a\x00" * 5000]), timeout=10))
            self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("5000 tensor pieces in one message (at most 4096)", cm.exception.details())
            with self.assertRaises(self.grpc.RpcError) as cm:
                list(raw(iter([first + b"\x1a\x02\x10\x01" * 4000]), timeout=10))
            self.assertEqual(cm.exception.code(), self.grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("bytes of memory allowed", cm.exception.details())
            for msgs, says in cases:
                with self.assertRaises(self.grpc.RpcError) as cm:
                    list(b.stub.Replicate(iter(msgs), timeout=10))
                self.assertEqual(cm.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION
                                 if "hello" not in says else self.grpc.StatusCode.INVALID_ARGUMENT, says)
                self.assertIn(says, cm.exception.details())
            self.assertEqual(checksums(b), before)
            # The lower-term refusal above must not have disturbed the real
            # stream: the primary still has its joined standby.
            s = pair.wait_role(a, "primary", joined=True)
            self.assertEqual(s.shard.term, sb.shard.term)
            # A solo shard refuses any stream.
            solo = H.Server("--mode", "async")
            try:
                with self.assertRaises(self.grpc.RpcError) as cm:
                    list(solo.stub.Replicate(iter([pb.ReplicateRequest(seq=1, hello=pb.ReplicateHello(**hello))]),
                                             timeout=10))
                self.assertEqual(cm.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("runs solo", cm.exception.details())
                s, _ = H.stats(solo.stub)
                self.assertEqual((s.shard.replica_role, s.shard.term, s.shard.standby_joined), ("solo", 0, False))
            finally:
                solo.stop()
        finally:
            pair.close()


if __name__ == "__main__":
    unittest.main()

"""Sync slices staged by reference, through a real server on loopback.

Workers 1 and 2 stream their whole gradient while worker 0 is held back,
so their slices arrive before the worker below may be summed and are
staged as the received messages; when worker 0 streams, they are
checked, converted and summed. The result must be bit-identical to a
one-worker replay of ((g0 + g1) + g2) / 3 in fp32 (fp32 and bf16 wire),
and a NaN in a staged slice must fail that worker's call with
INVALID_ARGUMENT naming the element, the others with UNAVAILABLE, and
leave the tensor unchanged. The same with gzip-compressed messages (staged
as their inflated copies). A SIGTERM while staged references are held
(plain and compressed) exits 0 with every buffer freed (the ASan run's
leak check) and fails the waiting calls."""
import re
import threading
import time
import unittest
import urllib.request

import numpy as np

import fpsharness as H

SHAPE = [300, 400]
SLICE = 20000  # several messages per gradient


def push(stub, w, step, g, dtype=None, compression=None, timeout=60, push_id=0):
    """Worker w's gradient g of tensor "s" in SLICE-element messages."""
    msgs = list(H.grad_messages(w, step, {"s": (SHAPE, g)}, slice_elems=SLICE, dtype=dtype))
    for m in msgs:
        m.push_id = push_id
    got, _ = H.collect(stub.PushPull(iter(msgs), timeout=timeout, compression=compression), {"s": SHAPE})
    return got["s"]


def compressible(rng):
    """A gradient gzip shrinks (multiples of 1/8 in [-1, 1)), so gRPC
    really sends its messages compressed."""
    return (rng.integers(-8, 8, SHAPE) / 8).astype(np.float32)


def sync_server(*args):
    """A 3-worker sync shard with metrics on a free port (.mport)."""
    mport = H.free_ports(1)[0]
    srv = H.Server("--mode", "sync", "--workers", 3, "--metrics-listen", "127.0.0.1:%d" % mport, *args)
    srv.mport = mport
    return srv


def wait_waiting(tc, srv, n):
    """Until the shard's factorps_waiting_pushes is n (the calls joined
    their rounds: every slice of theirs has arrived)."""
    t0 = time.monotonic()
    while True:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % srv.mport, timeout=30) as r:
            text = r.read().decode()
        m = re.search(r"^factorps_waiting_pushes(?:\{[^}]*\})? (\S+)$", text, re.M)
        if m and float(m.group(1)) == n:
            return
        tc.assertLess(time.monotonic() - t0, 60, "never %d calls waiting in their rounds" % n)
        time.sleep(0.05)


class StagedRef(unittest.TestCase):
    def _round(self, srv, grads, step, dtype=None, compression=None, push_ids=(0, 0, 0)):
        """Workers 2 and 1 first, worker 0 once they are staged; returns
        {worker: (params or None, error or None)}."""
        out = {}

        def worker(w):
            try:
                out[w] = (push(srv.stub, w, step, grads[w], dtype=dtype, compression=compression,
                               push_id=push_ids[w]), None)
            except Exception as e:  # checked by the caller
                out[w] = (None, e)

        ths = [threading.Thread(target=worker, args=(w,), daemon=True) for w in (2, 1)]
        for t in ths:
            t.start()
        # Both wait in the round: worker 0 has sent nothing, so every slice
        # of theirs is staged.
        wait_waiting(self, srv, 2)
        ths.append(threading.Thread(target=worker, args=(0,), daemon=True))
        ths[-1].start()
        H.join(ths, "the round's workers")
        return out

    def _replay(self, p0, g):
        srv = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            got, _ = H.push(srv.stub, 0, 0, {"s": (SHAPE, g)})
            return got["s"]
        finally:
            srv.stop()

    def _check(self, dtype, compression=None):
        pb, _, _ = H.stubs()
        rng = np.random.default_rng(7)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        if compression is None:
            grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        else:
            grads = [compressible(rng) for _ in range(3)]
        if dtype == pb.DTYPE_BF16:  # what the shard sums is the decoded value
            grads = [H.from_bf16(H.to_bf16(g.reshape(-1))).reshape(SHAPE) for g in grads]
        want = np.asarray(self._replay(p0, ((grads[0] + grads[1]) + grads[2]) / np.float32(3))).reshape(-1)
        if dtype == pb.DTYPE_BF16:  # replies come in the first slice's dtype
            want = H.from_bf16(H.to_bf16(want))
        srv = sync_server("--deadline", 60)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            out = self._round(srv, grads, 0, dtype=dtype, compression=compression)
            for w in range(3):
                self.assertIsNone(out[w][1], out[w][1])
                np.testing.assert_array_equal(np.asarray(out[w][0]).reshape(-1), want)
        finally:
            srv.stop()

    def test_out_of_order_matches_replay(self):
        self._check(None)

    def test_out_of_order_bf16_matches_replay(self):
        pb, _, _ = H.stubs()
        self._check(pb.DTYPE_BF16)

    def test_out_of_order_gzip_matches_replay(self):
        _, _, grpc = H.stubs()
        self._check(None, grpc.Compression.Gzip)

    def test_out_of_order_gzip_bf16_matches_replay(self):
        pb, _, grpc = H.stubs()
        self._check(pb.DTYPE_BF16, grpc.Compression.Gzip)

    def test_bad_value_in_staged_slice(self):
        self._bad_value(None)

    def test_bad_value_in_staged_gzip_slice(self):
        _, _, grpc = H.stubs()
        self._bad_value(grpc.Compression.Gzip)

    def _bad_value(self, compression):
        _, _, grpc = H.stubs()
        rng = np.random.default_rng(8)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        if compression is None:
            grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        else:
            grads = [compressible(rng) for _ in range(3)]
        bad_at = 3 * SLICE + 123
        grads[2].reshape(-1)[bad_at] = np.nan
        srv = sync_server("--deadline", 60)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            t0 = time.monotonic()
            out = self._round(srv, grads, 0, compression=compression)
            self.assertLess(time.monotonic() - t0, 50)  # failed when found, not at the deadline
            e2 = out[2][1]
            self.assertIsNotNone(e2)
            self.assertEqual(e2.code(), grpc.StatusCode.INVALID_ARGUMENT, e2)
            self.assertIn("tensor 's': gradient element %d is NaN" % bad_at, e2.details())
            for w in (0, 1):
                self.assertIsNotNone(out[w][1])
                self.assertEqual(out[w][1].code(), grpc.StatusCode.UNAVAILABLE, out[w][1])
            got, ver = H.pull(srv.stub, {"s": SHAPE})
            self.assertEqual(ver["s"], 0)
            np.testing.assert_array_equal(np.asarray(got["s"]).reshape(-1), p0.reshape(-1))
        finally:
            srv.stop()

    def test_retry_same_push_id_after_bad_staged_value(self):
        """The round a bad staged value failed applied nothing, so a retry
        of every worker with the same push_id is applied, not answered
        as a replay."""
        _, _, grpc = H.stubs()
        rng = np.random.default_rng(10)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        bad = [g.copy() for g in grads]
        bad[2].reshape(-1)[5 * SLICE + 7] = np.inf
        ids = (1001, 2002, 3003)
        want = np.asarray(self._replay(p0, ((grads[0] + grads[1]) + grads[2]) / np.float32(3))).reshape(-1)
        srv = sync_server("--deadline", 60)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            out = self._round(srv, bad, 0, push_ids=ids)
            self.assertEqual(out[2][1].code(), grpc.StatusCode.INVALID_ARGUMENT, out[2][1])
            self.assertIn("gradient element %d is Inf" % (5 * SLICE + 7), out[2][1].details())
            for w in (0, 1):
                self.assertEqual(out[w][1].code(), grpc.StatusCode.UNAVAILABLE, out[w][1])
            out = self._round(srv, grads, 0, push_ids=ids)
            for w in range(3):
                self.assertIsNone(out[w][1], out[w][1])
                np.testing.assert_array_equal(np.asarray(out[w][0]).reshape(-1), want)
            _, ver = H.pull(srv.stub, {"s": SHAPE})
            self.assertEqual(ver["s"], 1)
        finally:
            srv.stop()

    def _sigterm_staged(self, compression):
        """Workers 2 and 1 wait in their round with every slice staged by
        reference (worker 0 never pushes); SIGTERM: stop() checks exit 0
        and no sanitizer report; both calls fail."""
        _, _, grpc = H.stubs()
        rng = np.random.default_rng(9)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        grads = [compressible(rng) for _ in range(3)]
        srv = sync_server("--deadline", 120)
        err = {}

        def worker(w):
            try:
                push(srv.stub, w, 0, grads[w], compression=compression, timeout=100)
            except grpc.RpcError as e:
                err[w] = e.code()

        ths = []
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            ths = [threading.Thread(target=worker, args=(w,), daemon=True) for w in (2, 1)]
            for t in ths:
                t.start()
            wait_waiting(self, srv, 2)  # every slice of theirs staged
        finally:
            srv.stop(timeout=30)
            H.join(ths, "the staged workers")
        for w in (1, 2):
            self.assertIn(err.get(w), (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err)

    def test_sigterm_with_staged_references(self):
        self._sigterm_staged(None)

    def test_sigterm_with_staged_gzip_references(self):
        _, _, grpc = H.stubs()
        self._sigterm_staged(grpc.Compression.Gzip)


if __name__ == "__main__":
    unittest.main()

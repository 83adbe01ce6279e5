"""Sync slices staged by reference, through a real server on loopback.

Workers 1 and 2 stream their whole gradient while worker 0 is held back,
so their slices arrive before the worker below may be summed and are
staged as the received messages; when worker 0 streams, they are
checked, converted and summed. The result must be bit-identical to a
one-worker replay of ((g0 + g1) + g2) / 3 in fp32 (fp32 and bf16 wire),
and a NaN in a staged slice must fail that worker's call with
INVALID_ARGUMENT naming the element, the others with UNAVAILABLE, and
leave the tensor unchanged."""
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [300, 400]
SLICE = 20000  # several messages per gradient


class StagedRef(unittest.TestCase):
    def _round(self, srv, grads, step, dtype=None):
        """Workers 2 and 1 first, worker 0 once they are staged; returns
        {worker: (params or None, error or None)}."""
        out = {}

        def worker(w):
            try:
                got, ver = H.push(srv.stub, w, step, {"s": (SHAPE, grads[w])}, slice_elems=SLICE, dtype=dtype,
                                  timeout=60)
                out[w] = (got["s"], None)
            except Exception as e:  # checked by the caller
                out[w] = (None, e)

        ths = [threading.Thread(target=worker, args=(w,)) for w in (2, 1)]
        for t in ths:
            t.start()
        time.sleep(1.0)  # their streams are received (and staged) by now
        ths.append(threading.Thread(target=worker, args=(0,)))
        ths[-1].start()
        for t in ths:
            t.join(90)
        return out

    def _replay(self, p0, g):
        srv = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            got, _ = H.push(srv.stub, 0, 0, {"s": (SHAPE, g)})
            return got["s"]
        finally:
            srv.stop()

    def _check(self, dtype):
        pb, _, _ = H.stubs()
        rng = np.random.default_rng(7)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        if dtype == pb.DTYPE_BF16:  # what the shard sums is the decoded value
            grads = [H.from_bf16(H.to_bf16(g.reshape(-1))).reshape(SHAPE) for g in grads]
        want = np.asarray(self._replay(p0, ((grads[0] + grads[1]) + grads[2]) / np.float32(3))).reshape(-1)
        if dtype == pb.DTYPE_BF16:  # replies come in the first slice's dtype
            want = H.from_bf16(H.to_bf16(want))
        srv = H.Server("--mode", "sync", "--workers", 3, "--deadline", 60)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            out = self._round(srv, grads, 0, dtype=dtype)
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

    def test_bad_value_in_staged_slice(self):
        _, _, grpc = H.stubs()
        rng = np.random.default_rng(8)
        p0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        bad_at = 3 * SLICE + 123
        grads[2].reshape(-1)[bad_at] = np.nan
        srv = H.Server("--mode", "sync", "--workers", 3, "--deadline", 60)
        try:
            H.create(srv.stub, "s", SHAPE, p0)
            t0 = time.monotonic()
            out = self._round(srv, grads, 0)
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


if __name__ == "__main__":
    unittest.main()

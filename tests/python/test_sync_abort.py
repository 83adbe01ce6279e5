"""A 2-worker sync training loop survives a worker's call dying mid-stream.

The shard sums sync gradients as their slices arrive, so once part of a
dead call's gradient is in a round's sum the round is aborted: the other
worker's call fails with UNAVAILABLE, and the client (libfactorps, under the
Python package) must retry it with its push_id until the round completes.
Here worker 1's first attempt at step 1 is a raw grpcio stream that sends
half its gradient, is summed on top of worker 0's whole gradient, and is
cancelled; worker 1 then pushes normally. Every step must match a local
replay of (g0 + g1) / 2, and the shard must have seen the aborted attempt.
"""

import os
import sys
import threading
import time
import unittest

import numpy as np

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import REPO, Shards, need_server
import factorps
from factorps.reference import ReferenceAdafactor

sys.path.insert(0, os.path.join(REPO, "tests", "interop"))
import fpsharness as H  # noqa: E402  (grpcio stubs generated from the proto)

SHAPE = (600, 500)
N = SHAPE[0] * SHAPE[1]
HALF = N // 2


def _wait_for(pred, what, timeout=30.0):
    """Polls pred() until true; the bound is only a hang guard."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@need_server
class SyncAbortTest(unittest.TestCase):
    def test_training_loop_survives_a_stream_cut_after_its_sum(self):
        rng = np.random.default_rng(11)
        w0 = (0.5 * rng.standard_normal(SHAPE)).astype(np.float32)
        pb, pbg, grpc = H.stubs()
        with Shards(1, mode="sync", workers=2, deadline=30) as shards:
            c0 = factorps.connect(shards.addrs, worker_id=0, deadline=30)
            c1 = factorps.connect(shards.addrs, worker_id=1, deadline=30)
            self.addCleanup(c0.close)
            self.addCleanup(c1.close)
            c0.create([factorps.TensorSpec("w", SHAPE, w0)])
            c1.create([factorps.TensorSpec("w", SHAPE)])
            channel = grpc.insecure_channel(shards.addrs[0])
            self.addCleanup(channel.close)
            stub = pbg.ParameterServerStub(channel)
            ref = ReferenceAdafactor(SHAPE, "torch")
            want = w0
            for step in range(4):
                g = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)]
                res = {}

                def worker0():
                    try:
                        res[0] = c0.push_pull({"w": g[0]})
                    except Exception as e:  # noqa: BLE001  (reported below)
                        res[0] = e

                if step == 1:
                    before = c0.stats()[0]
                    # Worker 1's first half arrives first (staged: worker 0
                    # has sent nothing), then worker 0's whole gradient, which
                    # sums that half too; then worker 1's call dies.
                    cut = threading.Event()
                    first = pb.PushPullRequest(worker_id=1, step=step, grads=[pb.TensorSlice(
                        name="w", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0,
                        data=g[1].reshape(-1)[:HALF].tobytes())])

                    def stream():
                        yield first
                        cut.wait(60)

                    call = stub.PushPull(stream(), timeout=60)
                    _wait_for(lambda: c0.stats()[0]["bytes_received"] >= before["bytes_received"] + HALF * 4,
                              "worker 1's first half")
                    th = threading.Thread(target=worker0)
                    th.start()
                    _wait_for(lambda: c0.stats()[0]["bytes_received"] >= before["bytes_received"] + (HALF + N) * 4,
                              "worker 0's gradient")
                    call.cancel()
                    cut.set()
                    with self.assertRaises(grpc.RpcError) as cm:
                        list(call)
                    self.assertEqual(cm.exception.code(), grpc.StatusCode.CANCELLED)
                    # Worker 0's call was aborted (UNAVAILABLE naming worker
                    # 1) and retried by the client: it now waits for worker 1.
                    _wait_for(lambda: c0.stats()[0]["push_errors"] >= before["push_errors"] + 2,
                              "the aborted round's failed calls")
                    self.assertTrue(th.is_alive(), "worker 0 finished a round without worker 1")
                else:
                    th = threading.Thread(target=worker0)
                    th.start()
                p1, v1 = c1.push_pull({"w": g[1]})
                th.join(60)
                self.assertFalse(th.is_alive())
                self.assertNotIsInstance(res[0], Exception, res.get(0))
                p0, v0 = res[0]
                want = ref.step(want, (g[0] + g[1]) / np.float32(2))
                self.assertEqual(v0["w"], step + 1)
                self.assertEqual(v1["w"], step + 1)
                # One update for both, bit for bit; the reference within the
                # tolerance of test_client (another implementation of the math).
                np.testing.assert_array_equal(p0["w"], p1["w"])
                np.testing.assert_allclose(p0["w"], want, rtol=0, atol=2e-6 * (step + 1))
            stats = c0.stats()[0]
            self.assertEqual(stats["updates"], 4)


if __name__ == "__main__":
    unittest.main()

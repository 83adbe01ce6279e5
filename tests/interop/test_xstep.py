#!/usr/bin/python3
"""The cross-shard step of a split tensor between real shards:
two shards of one sync job (--peers, plaintext on loopback) each hold one
row block of a [6, 5] tensor (rows 0-1 and 2-5); one worker pushes each
block's gradient rows to its shard, the shards exchange partial sums over
Exchange and each applies the whole tensor's update to its rows. The
blocks put together must equal the same tensor held whole by a single
shard within check_vectors.py's param tolerance (scaled 1e-5) for 3 steps,
and Stats counts the exchanges. Then a peer killed: the surviving shard's
push fails UNAVAILABLE within --exchange-deadline naming the peer, and its
block is unchanged (version and params from Pull)."""
import concurrent.futures as cf
import unittest

import numpy as np

import fpsharness as H

SHAPE = [6, 5]
BOUNDS = [0, 2, 6]
PTOL = 1e-5


def block_create(pb, stub, i, init):
    lo, hi = BOUNDS[i] * SHAPE[1], BOUNDS[i + 1] * SHAPE[1]
    sl = pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0, data=init.reshape(-1)[lo:hi].astype("<f4").tobytes())
    tc = pb.TensorCreate(name="emb", shape=SHAPE, optimizer=H.optimizer(), init=sl,
                         split=pb.SplitBlock(block_index=i, bounds=BOUNDS, block_shards=[0, 1], shard_count=2))
    return stub.Create(pb.CreateRequest(shard_id=i, shard_count=2, tensors=[tc]), timeout=30)


def block_push(stub, i, step, g, timeout=60):
    """One worker's push of block i's rows (block-local offsets, whole shape)."""
    pb, _, _ = H.stubs()
    lo, hi = BOUNDS[i] * SHAPE[1], BOUNDS[i + 1] * SHAPE[1]
    data = g.reshape(-1)[lo:hi].astype("<f4").tobytes()
    msg = pb.PushPullRequest(worker_id=0, step=step, grads=[
        pb.TensorSlice(name="emb", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0, data=data)])
    out, ver = None, None
    for r in stub.PushPull(iter([msg]), timeout=timeout):
        for s in r.params:
            vals = np.frombuffer(s.data, dtype="<f4")
            if out is None:
                out = np.full(hi - lo, np.nan, dtype=np.float32)
            out[s.offset:s.offset + vals.size] = vals
        for v in r.versions:
            ver = v.version
    return out, ver


def scaled(a, ref, prev):
    d = np.max(np.abs(a.astype(np.float64) - ref))
    den = max(np.max(np.abs(ref)), np.max(np.abs(ref.astype(np.float64) - prev)))
    return d / den if den > 0 else (0.0 if d == 0 else np.inf)


class CrossShardStep(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()

    def test_two_shards_step_like_one(self):
        rng = np.random.default_rng(12)
        init = rng.standard_normal(SHAPE).astype(np.float32)
        whole = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(whole.stub, "emb", SHAPE, init)
            with H.Job(2, "--mode", "sync", "--workers", 1, "--exchange-deadline", 10) as job, \
                    cf.ThreadPoolExecutor(2) as ex:
                for i in range(2):
                    block_create(self.pb, job.stub(i), i, init)
                prev = init.astype(np.float64)
                for step in range(3):
                    g = rng.standard_normal(SHAPE).astype(np.float32)
                    ref, rv = H.push(whole.stub, 0, step, {"emb": (SHAPE, g)})
                    self.assertEqual(rv["emb"], step + 1)
                    futs = [ex.submit(block_push, job.stub(i), i, step, g) for i in range(2)]
                    parts = [f.result() for f in futs]
                    for _, v in parts:
                        self.assertEqual(v, step + 1)
                    got = np.concatenate([p for p, _ in parts]).reshape(SHAPE)
                    err = scaled(got, ref["emb"].astype(np.float64), prev)
                    self.assertLessEqual(err, PTOL, "step %d: param scaled error %.3e" % (step, err))
                    prev = ref["emb"].astype(np.float64)
                for i in range(2):
                    st, tensors = H.stats(job.stub(i))
                    self.assertEqual(st.shard.exchange_steps, 3)
                    self.assertEqual(st.shard.exchange_failures, 0)
                    self.assertGreater(st.shard.exchange_sent_bytes, 0)
                    self.assertEqual(st.shard.exchange_sent_bytes, st.shard.exchange_received_bytes)
                    self.assertGreater(st.shard.exchange_seconds_sum, 0)
                    self.assertEqual(tensors["emb"].version, 3)
        finally:
            whole.stop()

    def test_peer_killed_fails_the_step_everywhere_here(self):
        rng = np.random.default_rng(7)
        init = rng.standard_normal(SHAPE).astype(np.float32)
        with H.Job(2, "--mode", "sync", "--workers", 1, "--exchange-deadline", 2) as job:
            for i in range(2):
                block_create(self.pb, job.stub(i), i, init)
            job.kill(1)
            g = rng.standard_normal(SHAPE).astype(np.float32)
            with self.assertRaises(self.grpc.RpcError) as cm:
                block_push(job.stub(0), 0, 0, g, timeout=30)
            e = cm.exception
            self.assertEqual(e.code(), self.grpc.StatusCode.UNAVAILABLE, e.details())
            self.assertIn("tensor 'emb'", e.details())
            self.assertIn("shard 1", e.details())
            self.assertIn("nothing was applied", e.details())
            pb = self.pb
            got, ver = H.collect(job.stub(0).Pull(pb.PullRequest(names=["emb"]), timeout=30),
                                 {"emb": [BOUNDS[1] * SHAPE[1]]})
            self.assertEqual(ver["emb"], 0)
            np.testing.assert_array_equal(got["emb"], init.reshape(-1)[:BOUNDS[1] * SHAPE[1]])
            st, _ = H.stats(job.stub(0))
            self.assertEqual(st.shard.exchange_failures, 1)
            self.assertEqual(st.shard.exchange_steps, 0)


if __name__ == "__main__":
    unittest.main()

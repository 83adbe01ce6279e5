#!/usr/bin/python3
"""Cross-shard steps of a split tensor over the shards' own secured calls:
shards call each other with the workers' transport and
credentials, the calling shard presenting its client certificate where
the peer demands mutual TLS and sending a bearer token from the peer's
--auth-token-file. A step through every security kind equals the unsplit
update; a shard that lacks the client certificate or sends a wrong token
makes the step fail UNAVAILABLE on every block, naming the peer and the
cause, and nothing is applied.

Two shards (sync, one worker), a [6, 4] torch tensor in blocks of 2 and 4
rows, a grpcio client generated from the proto (fpsharness); tolerance as
in test_interop (2e-6 of the largest value) against float64
torch_adafactor_step."""
import threading
import unittest

import numpy as np

import fpsharness as H

SHAPE = [6, 4]
BOUNDS = [0, 2, 6]


class SplitSecurity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, cls.pbg, cls.grpc = H.stubs()

    def start(self, security):
        return H.Job(2, "--mode", "sync", "--workers", 1, "--exchange-deadline", 2, security=security)

    def create(self, job, init):
        pb = self.pb
        flat = init.reshape(-1)
        for b in range(2):
            lo, hi = BOUNDS[b] * SHAPE[1], BOUNDS[b + 1] * SHAPE[1]
            tc = pb.TensorCreate(name="emb", shape=SHAPE, optimizer=H.optimizer(),
                                 init=pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0, data=flat[lo:hi].tobytes()),
                                 split=pb.SplitBlock(block_index=b, bounds=BOUNDS, block_shards=[0, 1],
                                                     shard_count=2))
            job.stub(b).Create(pb.CreateRequest(shard_id=b, shard_count=2, tensors=[tc]), timeout=30)

    def step(self, job, grad):
        """Pushes both blocks at once; {block: rows} or {block: RpcError}."""
        pb = self.pb
        out = {}

        def one(b):
            lo, hi = BOUNDS[b] * SHAPE[1], BOUNDS[b + 1] * SHAPE[1]
            req = pb.PushPullRequest(worker_id=0, step=0, grads=[pb.TensorSlice(
                name="emb", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0, data=grad.reshape(-1)[lo:hi].tobytes())])
            try:
                rows = np.full(hi - lo, np.nan, np.float32)
                for r in job.stub(b).PushPull(iter([req]), timeout=60):
                    for s in r.params:
                        v = np.frombuffer(s.data, "<f4")
                        rows[s.offset:s.offset + v.size] = v
                out[b] = rows
            except self.grpc.RpcError as e:
                out[b] = e
        th = [threading.Thread(target=one, args=(b,), name="push block %d" % b, daemon=True) for b in range(2)]
        for t in th:
            t.start()
        H.join(th, "the step's block pushes")
        return out

    def data(self):
        rng = np.random.default_rng(7)
        return rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)

    def test_step_in_every_security_kind(self):
        p0, g = self.data()
        want = H.torch_adafactor_step(p0, g, np.zeros(SHAPE[0]), np.zeros(SHAPE[1]), None, 1).astype(np.float32)
        for kind in H.Security.KINDS:
            with self.subTest(kind=kind), self.start(kind) as job:
                self.create(job, p0)
                out = self.step(job, g)
                for b in range(2):
                    self.assertIsInstance(out[b], np.ndarray, "block %d: %s" % (b, out[b]))
                    lo, hi = BOUNDS[b] * SHAPE[1], BOUNDS[b + 1] * SHAPE[1]
                    np.testing.assert_allclose(out[b], want.reshape(-1)[lo:hi], rtol=0,
                                               atol=2e-6 * np.abs(want).max())

    def assertRefusedStep(self, security, cause):
        p0, g = self.data()
        with self.start(security) as job:
            self.create(job, p0)
            out = self.step(job, g)
            for b in range(2):
                self.assertIsInstance(out[b], self.grpc.RpcError, "block %d's step succeeded" % b)
                self.assertEqual(out[b].code(), self.grpc.StatusCode.UNAVAILABLE, out[b].details())
            # The shard whose calls were refused names the peer and why.
            details = " | ".join(out[b].details() for b in range(2))
            self.assertIn(cause, details)
            self.assertTrue(any(a in details for a in job.addrs), details)
            for b in range(2):
                _, tensors = H.stats(job.stub(b))
                self.assertEqual(tensors["emb"].version, 0, "block %d applied a refused step" % b)
                got, _ = H.pull(job.stub(b), {"emb": [(BOUNDS[b + 1] - BOUNDS[b]) * SHAPE[1]]})
                lo, hi = BOUNDS[b] * SHAPE[1], BOUNDS[b + 1] * SHAPE[1]
                np.testing.assert_array_equal(got["emb"], p0.reshape(-1)[lo:hi])

    def test_peer_without_client_certificate_is_refused(self):
        self.assertRefusedStep(H.Security("mtls", peer_overrides={"--peer-tls-cert": None, "--peer-tls-key": None}),
                               "not reachable")

    def test_wrong_peer_token_is_refused(self):
        wrong = H.Security("token")
        wrong.peer_overrides["--peer-token-file"] = wrong.path("wrong-token")
        self.assertRefusedStep(wrong, "UNAUTHENTICATED")


if __name__ == "__main__":
    unittest.main()

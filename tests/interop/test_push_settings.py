#!/usr/bin/python3
"""Per-push settings on the wire (PushPullRequest.tensors, num_workers,
expect_mode), driven with grpcio: every refusal gets its exact status and a
message naming the tensor and the problem, and leaves the shard as it was
(Stats and Pull); the accepted cases apply exactly what a tensor created
with those settings would (compared with a reference shard, bit for bit)."""
import math
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [3, 4]
N = 12


class Base(unittest.TestCase):
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 20)

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.srv = H.Server(*cls.ARGS)
        cls.p0 = np.arange(N, dtype=np.float32) / 7
        H.create(cls.srv.stub, "w", SHAPE, cls.p0, opt=H.optimizer(weight_decay=0.25))
        H.create(cls.srv.stub, "h", SHAPE, cls.p0, opt=H.optimizer("hf"))  # relative_step

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def setUp(self):
        _, ts = H.stats(self.srv.stub)
        self.before = {k: (v.version, v.ready) for k, v in ts.items()}

    def assertUnchanged(self):
        _, ts = H.stats(self.srv.stub)
        self.assertEqual({k: (v.version, v.ready) for k, v in ts.items()}, self.before)
        got, ver = H.pull(self.srv.stub, {"w": SHAPE, "h": SHAPE})
        np.testing.assert_array_equal(got["w"].reshape(-1), self.p0)
        np.testing.assert_array_equal(got["h"].reshape(-1), self.p0)

    def assertStatus(self, fn, code, *words):
        with self.assertRaises(self.grpc.RpcError) as cm:
            fn()
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())
        return e.details()

    def tp(self, name="w", **kw):
        return self.pb.PushPullRequest.TensorPush(name=name, **kw)

    def grad(self, name="w", value=1.0):
        return self.pb.TensorSlice(name=name, dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=0,
                                   data=np.full(N, value, np.float32).tobytes())

    def msg(self, grads=(), tensors=(), worker=0, step=0, **kw):
        return self.pb.PushPullRequest(worker_id=worker, step=step, grads=list(grads), tensors=list(tensors),
                                       **kw)

    def call(self, *msgs, timeout=10):
        return H.collect(self.srv.stub.PushPull(iter(msgs), timeout=timeout), {"w": SHAPE, "h": SHAPE})


class Refusals(Base):
    def test_negative_lr(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(lr=-1.0)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "per-push", "lr must be >= 0")
        self.assertUnchanged()

    def test_nan_lr(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(lr=math.nan)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "lr must be finite")
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(lr=math.inf)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "lr must be finite")
        self.assertUnchanged()

    def test_negative_weight_decay(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(weight_decay=-0.1)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "weight_decay must be >= 0")
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(weight_decay=math.nan)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "weight_decay must be finite")
        self.assertUnchanged()

    def test_lr_for_relative_step(self):
        # hf with relative_step=true: the relative step size decides the lr.
        self.assertStatus(lambda: self.call(self.msg([self.grad("h")], [self.tp("h", lr=1e-3)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'h'", "relative_step=true", "send no lr")
        self.assertUnchanged()

    def test_unknown_tensor(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp("nope", lr=1.0)])),
                          self.grpc.StatusCode.NOT_FOUND, "'nope'", "not found")
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp("", lr=1.0)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "name is empty")
        self.assertUnchanged()

    def test_two_tensor_pushes(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(lr=0.1), self.tp(lr=0.1)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "two TensorPush")
        self.assertStatus(lambda: self.call(self.msg([], [self.tp(no_grad=True)]),
                                            self.msg([], [self.tp(no_grad=True)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "two TensorPush")
        self.assertUnchanged()

    def test_tensor_push_after_first_slice(self):
        half = np.ones(6, np.float32).tobytes()
        s0 = self.pb.TensorSlice(name="w", dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=0, data=half)
        s1 = self.pb.TensorSlice(name="w", dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=6, data=half)
        self.assertStatus(lambda: self.call(self.msg([s0]), self.msg([s1], [self.tp(lr=0.1)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "after its first gradient slice")
        self.assertUnchanged()

    def test_no_grad_with_slices(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(no_grad=True)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "no_grad")
        self.assertUnchanged()

    def test_tensor_step_stale_and_ahead(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(step=4)])),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "'w'", "step 4", "ahead of shard")
        # The call's step is wrong but the tensor's own step is right: the
        # tensor's wins (the round then waits for worker 1: give up early).
        self.assertStatus(lambda: self.call(self.msg([self.grad()], [self.tp(step=0)], step=3), timeout=0.5),
                          self.grpc.StatusCode.DEADLINE_EXCEEDED)
        time.sleep(0.3)
        self.assertUnchanged()

    def test_num_workers_mismatch(self):
        t0 = time.monotonic()
        self.assertStatus(lambda: self.call(self.msg([self.grad()], num_workers=3)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "3 workers", "expects 2", "--workers")
        # At the first message, never after the 20 s round deadline.
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertUnchanged()

    def test_worker_id_beyond_w(self):
        t0 = time.monotonic()
        self.assertStatus(lambda: self.call(self.msg([self.grad()], worker=2, num_workers=2)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "worker id 2", "2 workers")
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertUnchanged()

    def test_expect_mode_mismatch(self):
        self.assertStatus(lambda: self.call(self.msg([self.grad()], expect_mode=self.pb.MODE_ASYNC)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "async", "sync mode")
        self.assertStatus(lambda: self.call(self.msg([self.grad()], expect_mode=9)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "unknown (9)", "sync mode")
        self.assertUnchanged()

    def test_header_change_mid_stream(self):
        half = np.ones(6, np.float32).tobytes()
        s0 = self.pb.TensorSlice(name="w", dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=0, data=half)
        s1 = self.pb.TensorSlice(name="w", dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=6, data=half)
        self.assertStatus(lambda: self.call(self.msg([s0], num_workers=2), self.msg([s1], num_workers=0)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "num_workers", "changed within one")
        self.assertUnchanged()

    def round(self, m0, m1):
        """Two workers' calls at once; returns [(result or RpcError)] x 2."""
        out = [None, None]

        def run(i, msgs):
            try:
                out[i] = self.call(*msgs, timeout=15)
            except self.grpc.RpcError as e:
                out[i] = e
        th = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate((m0, m1))]
        for t in th:
            t.start()
        for t in th:
            t.join(20)
        return out

    def test_sync_lr_disagreement(self):
        r = self.round([self.msg([self.grad()], [self.tp(lr=0.01)], worker=0)],
                       [self.msg([self.grad()], [self.tp(lr=0.02)], worker=1)])
        for e in r:
            self.assertIsInstance(e, self.grpc.RpcError)
            self.assertEqual(e.code(), self.grpc.StatusCode.FAILED_PRECONDITION, e.details())
            for w in ("'w'", "step 0", "lr", "worker 0 sent 0.01", "worker 1 sent 0.02", "nothing was applied"):
                self.assertIn(w, e.details())
        self.assertUnchanged()

    def test_sync_weight_decay_disagreement(self):
        # Absent means Create's value (0.25).
        r = self.round([self.msg([self.grad()], worker=0)],
                       [self.msg([self.grad()], [self.tp(weight_decay=0.5)], worker=1)])
        for e in r:
            self.assertIsInstance(e, self.grpc.RpcError)
            self.assertEqual(e.code(), self.grpc.StatusCode.FAILED_PRECONDITION, e.details())
            for w in ("'w'", "weight_decay", "worker 0 sent 0.25", "worker 1 sent 0.5"):
                self.assertIn(w, e.details())
        self.assertUnchanged()

    def test_sync_no_grad_mix(self):
        r = self.round([self.msg([self.grad()], worker=0)],
                       [self.msg([], [self.tp(no_grad=True)], worker=1)])
        for e in r:
            self.assertIsInstance(e, self.grpc.RpcError)
            self.assertEqual(e.code(), self.grpc.StatusCode.FAILED_PRECONDITION, e.details())
            for w in ("'w'", "workers 0 pushed one", "workers 1 said no_grad", "nothing was applied"):
                self.assertIn(w, e.details())
        self.assertUnchanged()

    def test_sync_all_no_grad(self):
        # Every worker skips "w": the round completes, nothing is applied,
        # both get the current params at the current version.
        r = self.round([self.msg([], [self.tp(no_grad=True)], worker=0)],
                       [self.msg([], [self.tp(no_grad=True)], worker=1)])
        for res in r:
            self.assertNotIsInstance(res, self.grpc.RpcError, getattr(res, "details", lambda: "")())
            got, ver = res
            self.assertEqual(ver, {"w": 0})
            np.testing.assert_array_equal(got["w"].reshape(-1), self.p0)
        self.assertUnchanged()

    def test_sync_skip_step_wins_over_a_gradient(self):
        # Worker 1 found an Inf (AMP): no_grad + skip_step. The round
        # completes with nothing applied for both, worker 0's gradient
        # dropped; both replies carry the unchanged version.
        r = self.round([self.msg([self.grad()], worker=0)],
                       [self.msg([], [self.tp(no_grad=True, skip_step=True)], worker=1)])
        for res in r:
            self.assertNotIsInstance(res, self.grpc.RpcError, getattr(res, "details", lambda: "")())
            got, ver = res
            self.assertEqual(ver, {"w": 0})
            np.testing.assert_array_equal(got["w"].reshape(-1), self.p0)
        self.assertUnchanged()

    def test_skip_step_needs_no_grad(self):
        self.assertStatus(lambda: self.call(self.msg([], [self.tp(skip_step=True)])),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "skip_step needs no_grad")
        self.assertUnchanged()

    def test_create_lr_or_weight_decay_differs(self):
        # lr and weight_decay change per push: a Create that differs only
        # in them matches; the first Create's values stay the defaults.
        r = H.create(self.srv.stub, "w", SHAPE, opt=H.optimizer(lr=0.5, weight_decay=0.75))
        self.assertFalse(r.tensors[0].created)
        self.assertTrue(r.tensors[0].ready)
        self.assertUnchanged()

    def test_create_fixed_settings_differ(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "w", SHAPE, opt=H.optimizer(eps2=0.01)),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'w'", "eps2 0.001 vs 0.01", "fixed",
                          "lr and weight_decay may change per push")
        self.assertStatus(lambda: H.create(self.srv.stub, "w", SHAPE, opt=H.optimizer("hf", lr=0.1,
                                                                                       relative_step=False)),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'w'", "flavor torch vs hf")
        self.assertStatus(lambda: H.create(self.srv.stub, "h", SHAPE, opt=H.optimizer("hf", lr=0.1,
                                                                                       relative_step=False)),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'h'", "relative_step true vs false")
        self.assertStatus(lambda: H.create(self.srv.stub, "h", SHAPE, opt=H.optimizer("hf", beta1=0.9)),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'h'", "has_beta1 false vs true")
        self.assertStatus(lambda: H.create(self.srv.stub, "w", [4, 3]),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'w'", "[3, 4]", "[4, 3]", "fixed")
        self.assertUnchanged()


class Applied(unittest.TestCase):
    """What a push's settings apply, against reference shards whose tensors
    were created with those settings: bit for bit."""

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()

    def push_ref(self, opt, grads, p0):
        ref = H.Server("--mode", "async")
        try:
            H.create(ref.stub, "t", SHAPE, p0, opt=opt)
            out = None
            for s, g in enumerate(grads):
                out, _ = H.push(ref.stub, 0, s, {"t": (SHAPE, g)})
            _, ts = H.stats(ref.stub, log=16)
            return out["t"], ts["t"]
        finally:
            ref.stop()

    def test_sync_schedule_and_apply_log(self):
        srv = H.Server("--mode", "sync", "--workers", 2, "--deadline", 20)
        try:
            p0 = np.linspace(-1, 1, N, dtype=np.float32)
            H.create(srv.stub, "t", SHAPE, p0)  # torch defaults: lr 1e-2, wd 0
            g = [np.linspace(0.5, -1, N, dtype=np.float32), np.linspace(-2, 1, N, dtype=np.float32)]
            first = None
            lrs, wds = [0.05, 0.2], [0.0, 0.1]
            for s in range(2):
                res = [None, None]

                def run(i):
                    tp = self.pb.PushPullRequest.TensorPush(name="t", lr=lrs[s], weight_decay=wds[s])
                    m = self.pb.PushPullRequest(worker_id=i, step=s, num_workers=2,
                                                expect_mode=self.pb.MODE_SYNC, tensors=[tp],
                                                grads=[self.pb.TensorSlice(name="t", dtype=self.pb.DTYPE_F32,
                                                                           shape=SHAPE, data=g[s].tobytes())])
                    res[i] = H.collect(srv.stub.PushPull(iter([m]), timeout=15), {"t": SHAPE})
                th = [threading.Thread(target=run, args=(i,)) for i in range(2)]
                for t in th:
                    t.start()
                for t in th:
                    t.join(20)
                self.assertEqual(res[0][1], {"t": s + 1})
                np.testing.assert_array_equal(res[0][0]["t"], res[1][0]["t"])
                if s == 0:
                    first = res[0][0]["t"]
            _, ts = H.stats(srv.stub, log=8)
            log = ts["t"].apply_log
            self.assertEqual([(r.lr, r.weight_decay, r.step) for r in log], [(0.05, 0.0, 0), (0.2, 0.1, 1)])
        finally:
            srv.stop()
        # Step 0 equals a shard whose tensor has lr 0.05 from Create (sync
        # W=2 with equal gradients averages to the same gradient, exactly).
        want, _ = self.push_ref(H.optimizer(lr=0.05), [g[0]], p0)
        np.testing.assert_array_equal(first, want)

    def test_async_no_grad_keeps_params_and_version(self):
        srv = H.Server("--mode", "async")
        try:
            p0 = np.linspace(-1, 1, N, dtype=np.float32)
            H.create(srv.stub, "frozen", SHAPE, p0, opt=H.optimizer(weight_decay=0.5))
            H.create(srv.stub, "live", SHAPE, p0)
            g = np.ones(N, np.float32)
            for s in range(3):
                m = self.pb.PushPullRequest(
                    worker_id=0, step=s,
                    tensors=[self.pb.PushPullRequest.TensorPush(name="frozen", no_grad=True)],
                    grads=[self.pb.TensorSlice(name="live", dtype=self.pb.DTYPE_F32, shape=SHAPE,
                                               data=g.tobytes())])
                out, ver = H.collect(srv.stub.PushPull(iter([m]), timeout=15), {"frozen": SHAPE, "live": SHAPE})
                self.assertEqual(ver, {"frozen": 0, "live": s + 1})
                np.testing.assert_array_equal(out["frozen"].reshape(-1), p0)
            _, ts = H.stats(srv.stub, log=8)
            self.assertEqual(len(ts["frozen"].apply_log), 0)
            self.assertEqual(ts["frozen"].version, 0)
            # Its first real update, at its own step 0 within a call at step 3.
            m = self.pb.PushPullRequest(
                worker_id=0, step=3,
                tensors=[self.pb.PushPullRequest.TensorPush(name="frozen", step=0)],
                grads=[self.pb.TensorSlice(name="frozen", dtype=self.pb.DTYPE_F32, shape=SHAPE, data=g.tobytes())])
            out, ver = H.collect(srv.stub.PushPull(iter([m]), timeout=15), {"frozen": SHAPE})
            self.assertEqual(ver, {"frozen": 1})
            _, ts = H.stats(srv.stub, log=8)
            self.assertEqual([(r.step, r.lr, r.weight_decay) for r in ts["frozen"].apply_log], [(0, 0.01, 0.5)])
        finally:
            srv.stop()
        want, _ = self.push_ref(H.optimizer(weight_decay=0.5), [g], p0)
        np.testing.assert_array_equal(out["frozen"], want)

    def test_hf_relative_step_log_and_trainer_lr(self):
        srv = H.Server("--mode", "async")
        try:
            p0 = np.linspace(-1, 1, N, dtype=np.float32)
            H.create(srv.stub, "r", SHAPE, p0, opt=H.optimizer("hf"))
            H.create(srv.stub, "t", SHAPE, p0, opt=H.optimizer("hf", lr=1e-3, relative_step=False))
            g = np.linspace(-1, 2, N, dtype=np.float32)
            for s in range(3):
                m = self.pb.PushPullRequest(
                    worker_id=0, step=s,
                    tensors=[self.pb.PushPullRequest.TensorPush(name="r", weight_decay=0.01),
                             self.pb.PushPullRequest.TensorPush(name="t", lr=0.0)],  # lr 0: allowed
                    grads=[self.pb.TensorSlice(name=n, dtype=self.pb.DTYPE_F32, shape=SHAPE, data=g.tobytes())
                           for n in ("r", "t")])
                out, _ = H.collect(srv.stub.PushPull(iter([m]), timeout=15), {"r": SHAPE, "t": SHAPE})
            _, ts = H.stats(srv.stub, log=8)
            # relative step: min(1e-2, 1/sqrt(t)) = 1e-2 for t = 1..3.
            self.assertEqual([(r.lr, r.weight_decay) for r in ts["r"].apply_log], [(0.01, 0.01)] * 3)
            self.assertEqual([r.lr for r in ts["t"].apply_log], [0.0] * 3)
            np.testing.assert_array_equal(out["t"].reshape(-1), p0)  # lr 0 moves nothing
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main()

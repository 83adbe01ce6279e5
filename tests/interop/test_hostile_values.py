#!/usr/bin/python3
"""Every integer and enum field of the requests at its extremes (what a
hostile client or a negative number cast to unsigned sends: 2^64-1, 2^63,
2^32, 2^32-1; enums -1, 2^31-1 and the first unknown value), and every
per-push float setting NaN, +-Inf and negative. Each case must get the
documented status (docs/wire.md "Errors", the proto's field comments) at once,
never after a deadline, with a message naming the tensor or the field and
the value; the shard's state (tensor count, versions, readiness, params)
must stay exactly as it was, and the server must exit 0 at the end.

The shard runs sync with 2 workers, so a push that were wrongly accepted
would wait for worker 1 and time out instead of answering: the test would
see DEADLINE_EXCEEDED, not the expected code."""
import unittest

import numpy as np

import fpsharness as H

SHAPE = [3, 4]
N = 12
U64 = [2 ** 64 - 1, 2 ** 63, 2 ** 32, 2 ** 32 - 1]
U32 = [2 ** 32 - 1, 2 ** 31, 65536]
ENUM = [-1, 2 ** 31 - 1, 3]


class HostileValues(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.srv = H.Server("--mode", "sync", "--workers", 2, "--deadline", 20)
        cls.p0 = np.arange(N, dtype=np.float32) / 7
        H.create(cls.srv.stub, "w", SHAPE, cls.p0)

    @classmethod
    def tearDownClass(cls):
        rc, err = cls.srv.stop()
        assert rc == 0, err

    def setUp(self):
        self.before = self.state()

    def tearDown(self):
        self.assertEqual(self.state(), self.before, "the shard's state changed")

    def state(self):
        _, ts = H.stats(self.srv.stub)
        params, versions = H.pull(self.srv.stub, {"w": SHAPE})
        return ({k: (v.version, v.ready) for k, v in ts.items()}, versions,
                params["w"].tobytes())

    def slice(self, **kw):
        d = dict(name="w", dtype=self.pb.DTYPE_F32, shape=SHAPE, offset=0,
                 data=np.ones(N, np.float32).tobytes())
        d.update(kw)
        return self.pb.TensorSlice(**d)

    def push(self, tensors=(), grads=None, **fields):
        fields.setdefault("worker_id", 0)
        fields.setdefault("step", 0)
        req = self.pb.PushPullRequest(grads=[grads or self.slice()], tensors=list(tensors),
                                      **fields)
        return lambda: list(self.srv.stub.PushPull(iter([req]), timeout=15))

    def create(self, **tensor):
        tensor.setdefault("optimizer", H.optimizer())
        req = self.pb.CreateRequest(shard_id=0, shard_count=1,
                                    tensors=[self.pb.TensorCreate(**tensor)])
        return lambda: self.srv.stub.Create(req, timeout=15)

    def refused(self, call, code, *words):
        with self.assertRaises(self.grpc.RpcError) as cm:
            call()
        e = cm.exception
        self.assertEqual(e.code(), getattr(self.grpc.StatusCode, code), e.details())
        for w in words:
            self.assertIn(str(w), e.details())
        return e.details()

    def test_push_offset(self):
        for v in U64:
            with self.subTest(offset=v):
                msg = self.refused(self.push(grads=self.slice(offset=v)), "INVALID_ARGUMENT",
                                   "tensor 'w'", v, "out of range", "12 elements")
                # The end of the slice must not wrap around 2^64.
                if v > 2 ** 64 - 1 - N:
                    self.assertIn(f"slice of {N} elements at offset {v}", msg)
                else:
                    self.assertIn(f"[{v}, {v + N})", msg)

    def test_push_shape(self):
        for v in U64:
            for shape in ([v, 4], [3, v], [v], [v, v, v]):
                with self.subTest(shape=shape):
                    self.refused(self.push(grads=self.slice(shape=shape)), "INVALID_ARGUMENT",
                                 "tensor 'w'", "wrong shape", v, "[3, 4]")

    def test_push_step(self):
        for v in U64:
            with self.subTest(step=v):
                self.refused(self.push(step=v), "FAILED_PRECONDITION", "tensor 'w'", v,
                             "ahead of shard")
                self.refused(self.push(tensors=[self.pb.PushPullRequest.TensorPush(
                    name="w", step=v)], push_id=v), "FAILED_PRECONDITION", "tensor 'w'", v,
                    "ahead of shard")

    def test_push_worker_and_job_fields(self):
        for v in U32:
            with self.subTest(worker_id=v):
                self.refused(self.push(worker_id=v), "FAILED_PRECONDITION", f"worker id {v}",
                             "--workers")
                self.refused(self.push(num_workers=v), "FAILED_PRECONDITION", v, "--workers")
        for v in ENUM:
            with self.subTest(expect_mode=v):
                self.refused(self.push(expect_mode=v), "FAILED_PRECONDITION", f"({v})",
                             "sync mode")

    def test_dtypes(self):
        for v in ENUM:
            with self.subTest(dtype=v):
                self.refused(self.push(grads=self.slice(dtype=v)), "INVALID_ARGUMENT",
                             "tensor 'w'", f"unsupported dtype {v}")
                self.refused(lambda: list(self.srv.stub.Pull(
                    self.pb.PullRequest(names=["w"], dtype=v), timeout=15)),
                    "INVALID_ARGUMENT", f"unsupported dtype {v}")
                self.refused(self.create(name="w", shape=SHAPE, init=self.slice(dtype=v)),
                             "INVALID_ARGUMENT", f"unsupported dtype {v}")

    def test_push_settings_not_finite_or_negative(self):
        TP = self.pb.PushPullRequest.TensorPush
        for x in (float("nan"), float("inf"), float("-inf"), -1.0, -1e-300):
            for field in ("lr", "weight_decay"):
                with self.subTest(field=field, value=x):
                    self.refused(self.push(tensors=[TP(name="w", **{field: x})]),
                                 "INVALID_ARGUMENT", "tensor 'w'", field)

    def test_create_shape(self):
        for v in U64:
            with self.subTest(dim=v):
                # Beyond the shard's element limit (docs/wire.md: limits are
                # RESOURCE_EXHAUSTED), the overflowing product included.
                # The message names the tensor and the shape or the limit.
                for shape in ([v, v], [2, v, 3]):
                    msg = self.refused(self.create(name="big", shape=shape), "RESOURCE_EXHAUSTED",
                                       "tensor 'big'")
                    self.assertTrue(str(v) in msg or "--max-bytes" in msg, msg)

    def test_create_flavor_and_placement(self):
        for v in ENUM:
            with self.subTest(flavor=v):
                self.refused(self.create(name="f", shape=[2],
                                         optimizer=self.pb.AdafactorConfig(flavor=v)),
                             "INVALID_ARGUMENT", "tensor 'f'", f"flavor {v}")
        for v in U32:
            with self.subTest(shard=v):
                req = self.pb.CreateRequest(shard_id=v, shard_count=v, tensors=[
                    self.pb.TensorCreate(name="f", shape=[2], optimizer=H.optimizer())])
                self.refused(lambda: self.srv.stub.Create(req, timeout=15), "FAILED_PRECONDITION",
                             v)

    def test_create_state_offset(self):
        for v in U64:
            with self.subTest(offset=v):
                st = self.pb.StateSlice(name="r", kind=self.pb.STATE_ROW, offset=v,
                                        data=np.zeros(3, np.float32).tobytes())
                msg = self.refused(self.create(name="r", shape=SHAPE, step=5, init_state=[st]),
                                   "INVALID_ARGUMENT", "tensor 'r'", v, "out of range")
                self.assertNotIn(", 2)", msg)  # no wrapped-around end

    def test_stats_and_getstate_limits(self):
        for v in U32:
            with self.subTest(apply_log_limit=v):
                r = self.srv.stub.Stats(self.pb.StatsRequest(include_tensors=True,
                                                             apply_log_limit=v), timeout=15)
                self.assertEqual([t.name for t in r.tensors], ["w"])
        self.refused(lambda: list(self.srv.stub.GetState(
            self.pb.GetStateRequest(names=["w", "w"]), timeout=15)),
            "INVALID_ARGUMENT", "'w'", "twice")


if __name__ == "__main__":
    unittest.main()

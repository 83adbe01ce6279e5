#!/usr/bin/python3
"""Bad input, one test each: every case must get the right gRPC status and a
message naming the tensor and the problem, and leave the shard's state as it
was (checked with Stats and Pull). One server per test class; the server
must then exit 0 without sanitizer reports."""
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [3, 4]
N = 12


class BadInputBase(unittest.TestCase):
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 20, "--max-message-bytes", 1 << 20)

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.srv = H.Server(*cls.ARGS)
        cls.p0 = np.arange(N, dtype=np.float32) / 7
        H.create(cls.srv.stub, "w", SHAPE, cls.p0)

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def setUp(self):
        _, ts = H.stats(self.srv.stub)
        self.before = {k: (v.version, v.ready) for k, v in ts.items()}
        self.before_count = len(ts)

    def assertUnchanged(self, name="w"):
        s, ts = H.stats(self.srv.stub)
        self.assertEqual(len(ts), self.before_count, "a tensor was added")
        self.assertEqual({k: (v.version, v.ready) for k, v in ts.items()}, self.before)
        if name == "w":
            got, ver = H.pull(self.srv.stub, {"w": SHAPE})
            np.testing.assert_array_equal(got["w"].reshape(-1), self.p0)
            self.assertEqual(ver["w"], 0)

    def assertStatus(self, fn, code, *words):
        with self.assertRaises(self.grpc.RpcError) as cm:
            fn()
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())
        return e.details()

    def slice(self, name="w", offset=0, data=None, dtype=None, shape=SHAPE):
        data = np.ones(N, np.float32) if data is None else data
        return self.pb.TensorSlice(name=name, dtype=self.pb.DTYPE_F32 if dtype is None else dtype,
                                   shape=shape, offset=offset,
                                   data=data.tobytes() if isinstance(data, np.ndarray) else data)

    def pushmsgs(self, *slices, worker=0, step=0):
        return [self.pb.PushPullRequest(worker_id=worker, step=step, grads=[s]) for s in slices]

    def pushpull(self, msgs, timeout=10):
        return list(self.srv.stub.PushPull(iter(msgs), timeout=timeout))


class BadInput(BadInputBase):
    def test_unknown_tensor_push(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(name="nope"))),
                          self.grpc.StatusCode.NOT_FOUND, "'nope'", "not found")
        self.assertUnchanged()

    def test_unknown_tensor_pull(self):
        self.assertStatus(lambda: H.pull(self.srv.stub, {"w": SHAPE, "nope": [1]}),
                          self.grpc.StatusCode.NOT_FOUND, "'nope'", "not found")
        self.assertUnchanged()

    def test_pull_repeated_name(self):
        # A Pull naming a tensor many times would be answered with as many
        # copies: refused as GetState refuses it.
        req = self.pb.PullRequest(names=["w"] * 1000)
        self.assertStatus(lambda: list(self.srv.stub.Pull(req, timeout=10)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "Pull", "'w'", "named twice")
        req = self.pb.PullRequest(names=["w", "nope", "w"])
        self.assertStatus(lambda: list(self.srv.stub.Pull(req, timeout=10)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "named twice")
        self.assertUnchanged()

    def test_wrong_shape(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(shape=[4, 3]))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "wrong shape [4, 3]", "[3, 4]")
        self.assertUnchanged()

    def test_wrong_shape_create(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "w", [3, 5]),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'w'", "[3, 4]", "[3, 5]")
        self.assertUnchanged()

    def test_create_settings_differ(self):
        # lr and weight_decay may differ (they change per push); the rest
        # is fixed at the first Create.
        self.assertStatus(lambda: H.create(self.srv.stub, "w", SHAPE, opt=H.optimizer(eps2=0.5)),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'w'", "eps2")
        self.assertUnchanged()

    def test_wrong_element_count(self):
        # 13 elements for a 12-element [3, 4] tensor.
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=np.ones(13, np.float32)))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "out of range", "12 elements")
        self.assertUnchanged()

    def test_wrong_element_count_create(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "fresh", [2, 2], np.ones(5, np.float32)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'fresh'", "out of range")
        self.assertUnchanged()

    def test_partial_element_bytes(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=b"\0" * 7))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "not a whole number")
        self.assertUnchanged()

    def test_unsupported_dtype(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(dtype=7))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "unsupported dtype 7")
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(dtype=0))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "unsupported dtype 0")
        self.assertUnchanged()

    def test_nan_gradient(self):
        g = np.ones(N, np.float32)
        g[5] = np.nan
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=g))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "element 5", "NaN")
        self.assertUnchanged()

    def test_inf_gradient(self):
        g = np.ones(N, np.float32)
        g[11] = -np.inf
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=g))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "element 11", "Inf")
        self.assertUnchanged()

    def test_huge_gradient(self):
        # Finite, but its square overflows the fp32 second-moment statistics
        # and would turn the tensor into NaN for every worker.
        g = np.ones(N, np.float32)
        g[3] = 1e20
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=g))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "element 3", "2^63")
        self.assertUnchanged()

    def test_nan_in_second_slice(self):
        g = np.ones(6, np.float32)
        bad = g.copy()
        bad[2] = np.nan
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(data=g), self.slice(offset=6, data=bad))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "element 8", "NaN")
        self.assertUnchanged()

    def test_slice_out_of_range(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(offset=10, data=np.ones(5, np.float32)))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "[10, 15)", "out of range")
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(offset=2 ** 63, data=np.ones(1, np.float32)))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "out of range")
        self.assertUnchanged()

    def test_overlapping_slices(self):
        a = self.slice(offset=0, data=np.ones(8, np.float32))
        b = self.slice(offset=4, data=np.ones(8, np.float32))
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(a, b)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "[4, 12)", "overlaps")
        self.assertUnchanged()

    def test_overlapping_init_slices(self):
        H.create(self.srv.stub, "init2", [10], None)  # initialising, no values yet
        self.setUp()
        one = self.pb.TensorSlice(dtype=self.pb.DTYPE_F32, offset=0, data=np.ones(6, np.float32).tobytes())
        two = self.pb.TensorSlice(dtype=self.pb.DTYPE_F32, offset=5, data=np.ones(5, np.float32).tobytes())
        req = self.pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
            self.pb.TensorCreate(name="init2", shape=[10], optimizer=H.optimizer(), init=one),
            self.pb.TensorCreate(name="init2", shape=[10], optimizer=H.optimizer(), init=two)])
        self.assertStatus(lambda: self.srv.stub.Create(req, timeout=10),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'init2'", "overlaps")
        self.assertUnchanged()
        # Still initialising: push and pull are refused.
        self.assertStatus(lambda: H.pull(self.srv.stub, {"init2": [10]}),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "'init2'", "initialising")
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(name="init2", shape=[10],
                                                                         data=np.ones(10, np.float32)))),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "'init2'", "initialising")

    def test_missing_slices(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(offset=0, data=np.ones(4, np.float32)),
                                                              self.slice(offset=8, data=np.ones(4, np.float32)))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "missing slices", "8 of 12",
                          "first missing element 4")
        self.assertUnchanged()

    def test_empty_name(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "", [2]),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "name is empty")
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(name=""))),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "name is empty")
        self.assertUnchanged()

    def test_overlong_name(self):
        long = "x" * 257
        self.assertStatus(lambda: H.create(self.srv.stub, long, [2]),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "257 bytes", "limit of 256", "xxxx")
        H.create(self.srv.stub, "y" * 256, [1], np.zeros(1, np.float32))  # 256 is fine
        self.setUp()
        self.assertStatus(lambda: H.pull(self.srv.stub, {long: [2]}),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "257 bytes")
        self.assertUnchanged()

    def test_worker_beyond_w(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(), worker=2)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "worker id 2", "2 workers")
        self.assertUnchanged()

    def test_stale_and_ahead_step(self):
        self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(), step=3)),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "'w'", "ahead of shard")
        self.assertUnchanged()

    def test_worker_step_change_mid_stream(self):
        msgs = self.pushmsgs(self.slice(offset=0, data=np.ones(6, np.float32))) + \
            self.pushmsgs(self.slice(offset=6, data=np.ones(6, np.float32)), worker=1)
        self.assertStatus(lambda: self.pushpull(msgs), self.grpc.StatusCode.INVALID_ARGUMENT, "changed")
        self.assertUnchanged()

    def test_wrong_shard(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "elsewhere", [2], shard_id=1, shard_count=2),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "shard 1 of 2", "shard 0 of 1")
        self.assertUnchanged()

    def test_bad_optimizer(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "o", [2], opt=H.optimizer("torch", beta1=0.9)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'o'", "beta1")
        self.assertStatus(lambda: H.create(self.srv.stub, "o", [2], opt=H.optimizer("hf", lr=0.1)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'o'")
        self.assertStatus(lambda: H.create(self.srv.stub, "o", [2], opt=self.pb.AdafactorConfig()),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'o'", "flavor")
        self.assertStatus(lambda: H.create(self.srv.stub, "o", [2, 0]),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'o'", "shape")
        self.assertUnchanged()

    def test_nan_init(self):
        v = np.ones(4, np.float32)
        v[3] = np.nan
        self.assertStatus(lambda: H.create(self.srv.stub, "n", [4], v),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'n'", "element 3")
        self.assertUnchanged()

    def test_malformed_protobuf(self):
        ch = self.srv.channel()
        garbage = b"\xff\xff\xff\xff\x0f\x0a\x80"
        for method in ("Create", "Stats"):
            call = ch.unary_unary("/factorps.v1.ParameterServer/" + method)
            self.assertStatus(lambda: call(garbage, timeout=10), self.grpc.StatusCode.INVALID_ARGUMENT,
                              "malformed", method)
        pull = ch.unary_stream("/factorps.v1.ParameterServer/Pull")
        self.assertStatus(lambda: list(pull(garbage, timeout=10)), self.grpc.StatusCode.INVALID_ARGUMENT,
                          "malformed")
        pp = ch.stream_stream("/factorps.v1.ParameterServer/PushPull")
        good = self.pushmsgs(self.slice(offset=0, data=np.ones(6, np.float32)))[0].SerializeToString()
        self.assertStatus(lambda: list(pp(iter([good, garbage]), timeout=10)),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "malformed PushPullRequest")
        ch.close()
        self.assertUnchanged()

    def test_random_and_mutated_messages(self):
        # Random bytes and bit-flipped valid requests to every method: each
        # gets a status (never a crash or hang), and nothing changes.
        rng = np.random.default_rng(1234)
        ch = self.srv.channel()
        pb = self.pb
        valid = {
            "Create": pb.CreateRequest(shard_id=0, shard_count=1, tensors=[pb.TensorCreate(
                name="w", shape=SHAPE, optimizer=H.optimizer(),
                init=pb.TensorSlice(dtype=pb.DTYPE_F32, data=self.p0.tobytes()))]).SerializeToString(),
            "Stats": pb.StatsRequest(include_tensors=True, apply_log_limit=3).SerializeToString(),
            "Pull": pb.PullRequest(names=["w"]).SerializeToString(),
        }
        pp_valid = self.pushmsgs(self.slice(data=np.ones(N, np.float32)), step=5)[0].SerializeToString()
        calls = {m: ch.unary_unary("/factorps.v1.ParameterServer/" + m) for m in ("Create", "Stats")}
        calls["Pull"] = lambda b, timeout: list(ch.unary_stream("/factorps.v1.ParameterServer/Pull")(b, timeout=timeout))
        pp = ch.stream_stream("/factorps.v1.ParameterServer/PushPull")
        calls["PushPull"] = lambda b, timeout: list(pp(iter([b]), timeout=2))
        valid["PushPull"] = pp_valid
        for i in range(120):
            for m, fn in calls.items():
                if i % 2:
                    b = bytearray(valid[m])
                    for _ in range(1 + i % 5):
                        b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
                    b = bytes(b)
                else:
                    b = rng.bytes(int(rng.integers(1, 64)))
                try:
                    fn(b, timeout=10)
                except self.grpc.RpcError as e:
                    self.assertNotIn(e.code(), (self.grpc.StatusCode.UNAVAILABLE, self.grpc.StatusCode.INTERNAL,
                                                self.grpc.StatusCode.UNKNOWN), e.details())
        ch.close()
        # Mutations may have created odd new tensors (valid requests); "w"
        # itself must be untouched: step 5 is never its version.
        got, ver = H.pull(self.srv.stub, {"w": SHAPE})
        np.testing.assert_array_equal(got["w"].reshape(-1), self.p0)
        self.assertEqual(ver["w"], 0)

    def test_message_above_limit(self):
        # The server runs with --max-message-bytes 1 MiB; send 2 MiB.
        big = np.ones(1 << 19, np.float32)
        H.create(self.srv.stub, "big", [1 << 19], big, slice_elems=1 << 17)
        self.setUp()
        msg = self.pb.PushPullRequest(worker_id=0, step=0, grads=[
            self.pb.TensorSlice(name="big", dtype=self.pb.DTYPE_F32, shape=[1 << 19], offset=0, data=big.tobytes())])
        code = self.grpc.StatusCode.RESOURCE_EXHAUSTED
        self.assertStatus(lambda: self.pushpull([msg]), code)
        self.assertUnchanged()

    def test_duplicate_push_sync(self):
        g0 = np.full(N, 1.0, np.float32)
        g1 = np.full(N, 3.0, np.float32)
        H.create(self.srv.stub, "d", SHAPE, self.p0)
        first = {}

        def w0():
            first["r"] = H.push(self.srv.stub, 0, 0, {"d": (SHAPE, g0)}, timeout=20)

        th = threading.Thread(target=w0)
        th.start()
        time.sleep(0.3)
        self.assertStatus(lambda: H.push(self.srv.stub, 0, 0, {"d": (SHAPE, g0)}, timeout=10),
                          self.grpc.StatusCode.ALREADY_EXISTS, "'d'", "duplicate", "worker 0")
        _, ts = H.stats(self.srv.stub)
        self.assertEqual(ts["d"].version, 0)
        got1, ver = H.push(self.srv.stub, 1, 0, {"d": (SHAPE, g1)}, timeout=20)
        th.join(20)
        self.assertEqual(ver["d"], 1)
        np.testing.assert_array_equal(first["r"][0]["d"], got1["d"])
        # Counted once: the update equals one step with (g0 + g1) / 2 = 2.
        ref = H.Server("--workers", 1)
        try:
            H.create(ref.stub, "d", SHAPE, self.p0)
            want, _ = H.push(ref.stub, 0, 0, {"d": (SHAPE, np.full(N, 2.0, np.float32))})
        finally:
            ref.stop()
        np.testing.assert_array_equal(got1["d"], want["d"])
        # A late duplicate of an applied step is stale.
        self.assertStatus(lambda: H.push(self.srv.stub, 0, 0, {"d": (SHAPE, g0)}, timeout=10),
                          self.grpc.StatusCode.FAILED_PRECONDITION, "'d'", "stale")

    def test_cancelled_push_is_withdrawn(self):
        # A parked sync push whose client cancels no longer counts: the
        # worker can push the same step again, and the round uses that one.
        H.create(self.srv.stub, "c", SHAPE, self.p0)
        call = self.srv.stub.PushPull(iter(H.grad_messages(0, 0, {"c": (SHAPE, np.full(N, 100.0, np.float32))})),
                                      timeout=20)
        th = threading.Thread(target=lambda: self.assertRaises(self.grpc.RpcError, list, call))
        th.start()
        time.sleep(0.3)
        call.cancel()
        th.join(10)
        time.sleep(0.2)
        res = {}
        th = threading.Thread(target=lambda: res.update(
            r=H.push(self.srv.stub, 0, 0, {"c": (SHAPE, np.full(N, 1.0, np.float32))}, timeout=20)))
        th.start()
        time.sleep(0.3)
        got, ver = H.push(self.srv.stub, 1, 0, {"c": (SHAPE, np.full(N, 3.0, np.float32))}, timeout=20)
        th.join(20)
        self.assertEqual(ver["c"], 1)
        ref = H.Server("--workers", 1)
        try:
            H.create(ref.stub, "c", SHAPE, self.p0)
            want, _ = H.push(ref.stub, 0, 0, {"c": (SHAPE, np.full(N, 2.0, np.float32))})
        finally:
            ref.stop()
        np.testing.assert_array_equal(got["c"], want["c"])
        np.testing.assert_array_equal(res["r"][0]["c"], want["c"])

    def test_sync_round_deadline(self):
        # Worker 1 never comes: the call fails before its own deadline with
        # a message naming the missing worker; the tensor is unchanged.
        t0 = time.monotonic()
        self.assertStatus(lambda: H.push(self.srv.stub, 0, 0, {"w": (SHAPE, np.ones(N, np.float32))}, timeout=1.5),
                          self.grpc.StatusCode.DEADLINE_EXCEEDED, "'w'", "waiting for workers 1",
                          "unchanged")
        self.assertLess(time.monotonic() - t0, 5)
        self.assertUnchanged()
        # The round is gone: worker 0 can push step 0 again.
        self.assertStatus(lambda: H.push(self.srv.stub, 0, 0, {"w": (SHAPE, np.ones(N, np.float32))}, timeout=1.0),
                          self.grpc.StatusCode.DEADLINE_EXCEEDED, "waiting for workers 1")
        self.assertUnchanged()


class ServerDeadline(BadInputBase):
    """--deadline applies to calls that set none, and to sync rounds."""
    ARGS = ("--mode", "sync", "--workers", 3, "--deadline", 1)

    def test_round_deadline_without_client_deadline(self):
        t0 = time.monotonic()
        self.assertStatus(lambda: H.push(self.srv.stub, 1, 0, {"w": (SHAPE, np.ones(N, np.float32))}, timeout=None),
                          self.grpc.StatusCode.DEADLINE_EXCEEDED, "'w'", "workers 0, 2", "2 of 3 missing")
        self.assertLess(time.monotonic() - t0, 5)
        self.assertUnchanged()

    def test_stalled_stream_hits_deadline(self):
        # A client that never half-closes is cut off at the server deadline.
        ev = threading.Event()

        def gen():
            yield self.pushmsgs(self.slice(offset=0, data=np.ones(6, np.float32)))[0]
            ev.wait(10)

        t0 = time.monotonic()
        self.assertStatus(lambda: self.pushpull(gen(), timeout=None), self.grpc.StatusCode.DEADLINE_EXCEEDED,
                          "deadline")
        ev.set()
        self.assertLess(time.monotonic() - t0, 5)
        self.assertUnchanged()


class Limits(BadInputBase):
    ARGS = ("--mode", "async", "--max-tensors", 3, "--max-bytes", 4096)

    def test_too_many_tensors(self):
        H.create(self.srv.stub, "a", [1], np.zeros(1, np.float32))
        self.setUp()
        pb = self.pb
        req = pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
            pb.TensorCreate(name="b", shape=[1], optimizer=H.optimizer()),
            pb.TensorCreate(name="c", shape=[1], optimizer=H.optimizer())])
        self.assertStatus(lambda: self.srv.stub.Create(req, timeout=10),
                          self.grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-tensors")
        self.assertUnchanged()

    def test_too_many_bytes(self):
        self.assertStatus(lambda: H.create(self.srv.stub, "huge", [1024]),
                          self.grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-bytes")
        self.assertUnchanged()


class CheckpointNames(BadInputBase):
    """Names whose keys would collide in the checkpoint format were
    accepted, and from then on every checkpoint failed (SIGTERM exited 1
    without saving): refused at Create, naming both."""

    @classmethod
    def setUpClass(cls):
        import tempfile
        cls.ckpt = tempfile.mkdtemp(prefix="fps-ckpt-names-")
        cls.ARGS = ("--mode", "async", "--checkpoint-dir", cls.ckpt)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        import shutil
        super().tearDownClass()
        shutil.rmtree(cls.ckpt, True)

    def test_colliding_names_refused(self):
        C = self.grpc.StatusCode
        one = np.ones(2, np.float32)
        self.assertStatus(lambda: H.create(self.srv.stub, "__metadata__", [2], one),
                          C.INVALID_ARGUMENT, "'__metadata__'", "reserved")
        self.assertStatus(lambda: H.create(self.srv.stub, "w/row", [2], one),
                          C.INVALID_ARGUMENT, "'w/row'", "'w'")
        H.create(self.srv.stub, "v/col", [2], one)  # fine alone ...
        self.assertStatus(lambda: H.create(self.srv.stub, "v", [2], one),  # ... but not then "v"
                          C.INVALID_ARGUMENT, "'v'", "'v/col'")
        # Both in one call.
        pb = self.pb
        req = pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
            pb.TensorCreate(name=n, shape=[2], optimizer=H.optimizer()) for n in ("q", "q/mom")])
        self.assertStatus(lambda: self.srv.stub.Create(req, timeout=10), C.INVALID_ARGUMENT, "'q/mom'", "'q'")
        _, ts = H.stats(self.srv.stub)
        self.assertEqual(sorted(ts), ["v/col", "w"])
        # Checkpoints still work.
        r = self.srv.stub.Checkpoint(pb.CheckpointRequest(), timeout=30)
        self.assertEqual(r.tensors, 2)


class StagingLimit(BadInputBase):
    ARGS = ("--mode", "async", "--max-staging-bytes", 6000)

    def test_staging_limit(self):
        H.create(self.srv.stub, "s", [2048], np.zeros(2048, np.float32))
        self.setUp()
        self.assertStatus(lambda: H.push(self.srv.stub, 0, 0, {"s": ([2048], np.ones(2048, np.float32))}),
                          self.grpc.StatusCode.RESOURCE_EXHAUSTED, "'s'", "--max-staging-bytes")
        # A Pull references the published parameters (no tensor-sized
        # buffer): the limit does not apply to it.
        vals, _ = H.pull(self.srv.stub, {"s": [2048]})
        np.testing.assert_array_equal(vals["s"], np.zeros(2048, np.float32))
        _, ts = H.stats(self.srv.stub)
        self.assertEqual(ts["s"].version, 0)
        # Buffers are given back: 150 small pushes stay under 6000 bytes.
        for step in range(150):
            H.push(self.srv.stub, 0, step, {"w": (SHAPE, np.ones(N, np.float32))})


if __name__ == "__main__":
    unittest.main()

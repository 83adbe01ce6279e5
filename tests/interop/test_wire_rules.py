#!/usr/bin/python3
"""Wire rules every method shares: names with NUL or control
characters, status messages that stay UTF-8 when cut, protobuf messages that
repeat an embedded field (the parts merge), torch's d >= 1. Each case checks
the exact status, that the shard's state is unchanged, and the counters."""
import threading
import time
import unittest

import numpy as np

import fpsharness as H
from test_bad_input import BadInputBase, N, SHAPE


class Names(BadInputBase):
    ARGS = ("--mode", "async")

    def counters(self):
        s, _ = H.stats(self.srv.stub)
        return s.shard.pushes, s.shard.push_errors, s.shard.updates

    def test_nul_name_does_not_alias(self):
        # "w\0evil" is valid UTF-8; as a C string it would be "w".
        bad = "w\0evil"
        c0 = self.counters()
        for name, byte, at in ((bad, "0x00", 1), ("w\x1b[2J", "0x1b", 1), ("w\x7f", "0x7f", 1),
                               ("\nw", "0x0a", 0)):
            self.assertStatus(lambda: H.create(self.srv.stub, name, SHAPE, np.zeros(N, np.float32)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "control character (%s) at byte %d" % (byte, at))
            self.assertStatus(lambda: H.pull(self.srv.stub, {name: SHAPE}),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "control character (%s)" % byte)
            self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(name=name))),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "control character (%s)" % byte)
        # The message shows the name escaped, and no push counted as OK.
        d = self.assertStatus(lambda: self.pushpull(self.pushmsgs(self.slice(name=bad))),
                              self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("'w\\x00evil'", d)
        self.assertUnchanged()
        p, e, u = self.counters()
        self.assertEqual((p, u), c0[::2])
        self.assertEqual(e, c0[1] + 5)
        # A control character in a Create's init slice name too.
        pb = self.pb
        req = pb.CreateRequest(shard_id=0, shard_count=1, tensors=[pb.TensorCreate(
            name="w", shape=SHAPE, optimizer=H.optimizer(),
            init=pb.TensorSlice(name="w\0", dtype=pb.DTYPE_F32, data=np.ones(N, np.float32).tobytes()))])
        self.assertStatus(lambda: self.srv.stub.Create(req, timeout=10), self.grpc.StatusCode.INVALID_ARGUMENT,
                          "control character (0x00)")
        self.assertUnchanged()

    def test_status_message_cut_on_a_character(self):
        # 'a' + 200 two-byte characters: the old message cut the name at byte
        # 40, in the middle of a character.
        long = "a" + "é" * 200
        for fn in (lambda: H.create(self.srv.stub, long, [2]), lambda: H.pull(self.srv.stub, {long: [2]}),
                   lambda: self.pushpull(self.pushmsgs(self.slice(name=long)))):
            with self.assertRaises(self.grpc.RpcError) as cm:
                fn()
            e = cm.exception
            self.assertEqual(e.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
            d = e.details()
            self.assertNotIn("\ufffd", d)
            d.encode("utf-8")  # never a lone surrogate
            self.assertIn("'a" + "é" * 19 + "...'", d)
            self.assertIn("401 bytes long", d)
        # A 4-byte character cut by the limit: still whole characters only.
        self.assertStatus(lambda: H.create(self.srv.stub, "😀" * 70, [2]),
                          self.grpc.StatusCode.INVALID_ARGUMENT, "'" + "😀" * 10 + "...'", "280 bytes")
        self.assertUnchanged()


class Merge(BadInputBase):
    """Protobuf: a singular embedded message sent in several parts merges."""
    ARGS = ("--mode", "async")

    def test_repeated_embedded_message_merges(self):
        pb = self.pb
        ch = self.srv.channel()
        create = ch.unary_unary("/factorps.v1.ParameterServer/Create")
        # One TensorCreate in two parts: the optimizer is split (flavor in
        # the first, eps2 in the second), the init slice too (dtype first,
        # data second).
        part1 = pb.TensorCreate(name="m", shape=[2], optimizer=pb.AdafactorConfig(flavor=pb.FLAVOR_TORCH),
                                init=pb.TensorSlice(dtype=pb.DTYPE_F32)).SerializeToString()
        part2 = pb.TensorCreate(optimizer=pb.AdafactorConfig(eps2=0.5),
                                init=pb.TensorSlice(data=np.array([1, 2], np.float32).tobytes())).SerializeToString()
        tc = part1 + part2
        self.assertEqual(pb.TensorCreate.FromString(tc).optimizer.eps2, 0.5)  # what protobuf says it means
        req = pb.CreateRequest(shard_id=0, shard_count=1).SerializeToString() + b"\x0a" + bytes([len(tc)]) + tc
        resp = pb.CreateResponse.FromString(create(req, timeout=10))
        self.assertTrue(resp.tensors[0].created and resp.tensors[0].ready)
        got, ver = H.pull(self.srv.stub, {"m": [2]})
        np.testing.assert_array_equal(got["m"], [1, 2])
        # The merged settings are the tensor's: the same Create in one part
        # matches, one without eps2=0.5 does not (eps2 is fixed at Create;
        # lr would not do here: it may differ, it changes per push).
        H.create(self.srv.stub, "m", [2], opt=H.optimizer(eps2=0.5))
        self.assertStatus(lambda: H.create(self.srv.stub, "m", [2]), self.grpc.StatusCode.ALREADY_EXISTS, "'m'",
                          "eps2")
        # The tensor works like any other.
        _, ver = H.push(self.srv.stub, 0, 0, {"m": ([2], np.ones(2, np.float32))}, timeout=10)
        self.assertEqual(ver["m"], 1)
        s, ts = H.stats(self.srv.stub)
        self.assertEqual(ts["m"].version, 1)
        self.assertEqual((s.shard.pushes, s.shard.push_errors, s.shard.updates), (1, 0, 1))
        ch.close()


class TorchD(BadInputBase):
    ARGS = ("--mode", "async")

    def test_torch_d_below_one_refused(self):
        for d in (0.5, 0.999, 1e-9):
            self.assertStatus(lambda: H.create(self.srv.stub, "d", [2], opt=H.optimizer("torch", clip_threshold=d)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "'d'", "must be >= 1")
        self.assertUnchanged()
        H.create(self.srv.stub, "d1", [2], np.zeros(2, np.float32), opt=H.optimizer("torch", clip_threshold=1.0))
        # hf's clip_threshold has no such bound upstream.
        H.create(self.srv.stub, "h", [2], np.zeros(2, np.float32),
                 opt=H.optimizer("hf", clip_threshold=0.5, relative_step=True))
        _, ts = H.stats(self.srv.stub)
        self.assertEqual(set(ts), {"w", "d1", "h"})


class Simd(unittest.TestCase):
    """FACTORPS_SIMD=auto (docs/shards.md) and --simd auto over the environment."""

    def simd_of(self, *args, env=None):
        srv = H.Server(*args, env=env)
        try:
            s, _ = H.stats(srv.stub)
            return s.shard.simd
        finally:
            srv.stop()

    def test_simd_auto_env_and_flag(self):
        H.stubs()
        best = self.simd_of(env={"FACTORPS_SIMD": ""})
        self.assertIn(best, ("scalar", "avx2", "avx512", "neon"))
        self.assertEqual(self.simd_of(env={"FACTORPS_SIMD": "auto"}), best)
        self.assertEqual(self.simd_of("--simd", "scalar", env={"FACTORPS_SIMD": "auto"}), "scalar")
        if best == "scalar":
            self.skipTest("this CPU has no SIMD variant: the flag cannot be told from the env")
        # The flag wins over the environment, "auto" included.
        self.assertEqual(self.simd_of("--simd", "auto", env={"FACTORPS_SIMD": "scalar"}), best)


class Metadata(BadInputBase):
    """Request metadata is capped at 8 KiB (GRPC_ARG_MAX_METADATA_SIZE). gRPC
    1.51's C core answers an oversized header block by closing that HTTP/2
    connection (docs/operations.md, Security); calls on other connections go on."""
    ARGS = ("--mode", "sync", "--workers", 2, "--deadline", 20)

    def conn(self):
        # grpcio shares one connection between a process's channels to the
        # same address unless told otherwise.
        return self.grpc.insecure_channel(self.srv.addr, options=[("grpc.use_local_subchannel_pool", 1)])

    def test_oversized_metadata_spares_other_connections(self):
        H.create(self.srv.stub, "md", SHAPE, self.p0)
        parked = {}
        a = self.conn()
        stub_a = H.stubs()[1].ParameterServerStub(a)

        def w0():
            try:
                parked["r"] = H.push(stub_a, 0, 0, {"md": (SHAPE, np.ones(N, np.float32))}, timeout=20)
            except self.grpc.RpcError as e:
                parked["r"] = e
        th = threading.Thread(target=w0)
        th.start()
        time.sleep(0.5)
        b = self.conn()
        stats_b = b.unary_unary("/factorps.v1.ParameterServer/Stats")
        req = self.pb.StatsRequest().SerializeToString()
        stats_b(req, timeout=10, metadata=[("x-pad", "a" * 6000)])  # under the cap
        with self.assertRaises(self.grpc.RpcError) as cm:
            stats_b(req, timeout=10, metadata=[("x-pad", "a" * 9000)])
        self.assertIn(cm.exception.code(), (self.grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            self.grpc.StatusCode.UNAVAILABLE), cm.exception.details())
        b.close()
        # Worker 0's call on connection A is still parked; worker 1 completes
        # the round on a third connection, and both get the update.
        c = self.conn()
        _, ver = H.push(H.stubs()[1].ParameterServerStub(c), 1, 0, {"md": (SHAPE, np.ones(N, np.float32))},
                        timeout=20)
        c.close()
        th.join(20)
        self.assertEqual(ver["md"], 1)
        self.assertNotIsInstance(parked["r"], Exception, parked["r"])
        self.assertEqual(parked["r"][1]["md"], 1)
        a.close()
        s, ts = H.stats(self.srv.stub)
        self.assertEqual(ts["md"].version, 1)
        self.assertEqual((s.shard.pushes, s.shard.updates), (2, 1))


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/python3
"""Compressed requests: the shard inflates a gzip/deflate message
itself, only after the token and the call limit admitted the call, and never
past --max-message-bytes, so a gzip bomb costs at most that much memory.
Each case checks the status, the shard's peak RSS, its state and counters."""
import os
import tempfile
import unittest

import numpy as np

import fpsharness as H

LIMIT = 1 << 20
BOMB = 96 << 20  # inflated size; about 96 KiB of gzip on the wire
TOKEN = "s3cret-token-for-compression"


class Compression(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, cls.pbg, cls.grpc = H.stubs()
        cls.tmp = tempfile.mkdtemp(prefix="fps-gz-")
        tokens = os.path.join(cls.tmp, "tokens")
        with open(tokens, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(tokens, 0o600)
        cls.srv = H.Server("--mode", "async", "--max-message-bytes", LIMIT, "--auth-token-file", tokens)
        cls.md = [("authorization", "Bearer " + TOKEN)]
        # A Stats request padded with an unknown bytes field of zeros: valid
        # protobuf of BOMB bytes that gzip shrinks about a thousandfold.
        pad = b"\0" * BOMB
        n, key = BOMB, b"\xfa\x07"  # field 127, length-delimited
        var = bytearray()
        while True:
            var.append((n & 0x7f) | (0x80 if n > 0x7f else 0))
            n >>= 7
            if not n:
                break
        cls.bomb = cls.pb.StatsRequest().SerializeToString() + key + bytes(var) + pad

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def channel(self):
        # The client's own send limit would refuse the inflated size first.
        return self.grpc.insecure_channel(self.srv.addr, options=[("grpc.max_send_message_length", -1)])

    def call(self, method, req, md, compression):
        ch = self.channel()
        try:
            return ch.unary_unary("/factorps.v1.ParameterServer/" + method)(
                req, timeout=60, metadata=md, compression=compression)
        finally:
            ch.close()

    def status(self, *a):
        with self.assertRaises(self.grpc.RpcError) as cm:
            self.call(*a)
        return cm.exception.code(), cm.exception.details()

    def stats(self):
        r = self.pb.StatsResponse.FromString(self.call("Stats", self.pb.StatsRequest(include_tensors=True)
                                                       .SerializeToString(), self.md, None))
        return (r.shard.pushes, r.shard.push_errors, r.shard.updates), {t.name: t.version for t in r.tensors}

    def test_small_compressed_request_works(self):
        for comp in (self.grpc.Compression.Gzip, self.grpc.Compression.Deflate):
            name = "gz%d" % int(comp)
            req = self.pb.CreateRequest(shard_id=0, shard_count=1, tensors=[self.pb.TensorCreate(
                name=name, shape=[1000], optimizer=H.optimizer(),
                init=self.pb.TensorSlice(dtype=self.pb.DTYPE_F32, data=np.zeros(1000, np.float32).tobytes()))])
            resp = self.pb.CreateResponse.FromString(self.call("Create", req.SerializeToString(), self.md, comp))
            self.assertTrue(resp.tensors[0].ready)
            self.assertEqual(self.stats()[1][name], 0)

    def test_gzip_bomb_without_token(self):
        rss0 = H.peak_rss(self.srv.proc.pid)
        before = self.stats()
        code, details = self.status("Stats", self.bomb, [], self.grpc.Compression.Gzip)
        self.assertEqual(code, self.grpc.StatusCode.UNAUTHENTICATED, details)
        code, details = self.status("Create", self.bomb, [("authorization", "Bearer wrong")],
                                    self.grpc.Compression.Gzip)
        self.assertEqual(code, self.grpc.StatusCode.UNAUTHENTICATED, details)
        grown = H.peak_rss(self.srv.proc.pid) - rss0
        print("gzip bomb without token: shard peak RSS +%.1f MiB" % (grown / 2 ** 20))
        self.assertLess(grown, 16 << 20, "peak RSS grew %d MiB" % (grown >> 20))
        self.assertEqual(self.stats(), before)

    def test_gzip_bomb_with_token(self):
        rss0 = H.peak_rss(self.srv.proc.pid)
        before = self.stats()
        for method in ("Stats", "Create", "Pull"):
            code, details = self.status(method, self.bomb, self.md, self.grpc.Compression.Gzip)
            self.assertEqual(code, self.grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            self.assertIn("inflates to more than --max-message-bytes", details)
        # PushPull: the same bomb as a stream message.
        ch = self.channel()
        pp = ch.stream_stream("/factorps.v1.ParameterServer/PushPull")
        with self.assertRaises(self.grpc.RpcError) as cm:
            list(pp(iter([self.bomb]), timeout=60, metadata=self.md, compression=self.grpc.Compression.Gzip))
        ch.close()
        self.assertEqual(cm.exception.code(), self.grpc.StatusCode.RESOURCE_EXHAUSTED, cm.exception.details())
        self.assertIn("inflates to more than --max-message-bytes", cm.exception.details())
        grown = H.peak_rss(self.srv.proc.pid) - rss0
        print("gzip bomb with token: shard peak RSS +%.1f MiB" % (grown / 2 ** 20))
        self.assertLess(grown, 16 << 20, "peak RSS grew %d MiB" % (grown >> 20))
        (pushes, errors, updates), tensors = self.stats()
        self.assertEqual(tensors, before[1])
        self.assertEqual((pushes, errors, updates), (before[0][0], before[0][1] + 1, before[0][2]))


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/python3
"""Split tensors on the wire (issue 12, in progress): a Create carrying a
SplitBlock gets its block map checked exactly as the proto says (another
shard count or another shard's block: FAILED_PRECONDITION naming both;
inconsistent geometry: INVALID_ARGUMENT naming the field); a consistent
block is then refused with FAILED_PRECONDITION by a shard without --peers
("this shard has no --peers") or in async/ssp mode ("split tensors need
--mode sync"). Every refusal leaves the shard without the tensor. Exchange
requests are validated as the proto says and then refused (NOT_FOUND: no
block here, or FAILED_PRECONDITION for a tensor held whole). One server
(shard 1 of 3, sync) and, for the mode rule, one in async mode."""
import struct
import unittest

import fpsharness as H

SHAPE = [2, 3, 4]  # 6 flattened rows of 4 columns


class SplitCreate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.srv = H.Server("--shard-id", 1, "--shard-count", 3)

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def create(self, srv=None, **split):
        pb = self.pb
        srv = srv or self.srv
        block = dict(block_index=1, bounds=[0, 2, 5, 6], block_shards=[0, 1, 2], shard_count=3)
        block.update(split)
        tc = pb.TensorCreate(name="emb", shape=SHAPE, optimizer=H.optimizer(),
                             split=pb.SplitBlock(**block))
        return srv.stub.Create(pb.CreateRequest(shard_id=1, shard_count=3, tensors=[tc]),
                               timeout=30)

    def assertRefused(self, code, words, srv=None, **split):
        srv = srv or self.srv
        with self.assertRaises(self.grpc.RpcError) as cm:
            self.create(srv=srv, **split)
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())
        _, tensors = H.stats(srv.stub)
        self.assertNotIn("emb", tensors, "a refused block left a tensor behind")

    def test_consistent_block_needs_peers(self):
        self.assertRefused(self.grpc.StatusCode.FAILED_PRECONDITION,
                           ["tensor 'emb'", "this shard has no --peers"])

    def test_consistent_block_needs_sync(self):
        srv = H.Server("--shard-id", 1, "--shard-count", 3, "--mode", "async")
        try:
            self.assertRefused(self.grpc.StatusCode.FAILED_PRECONDITION,
                               ["tensor 'emb'", "async mode", "split tensors need --mode sync"],
                               srv=srv)
            # The map is checked first, in any mode.
            self.assertRefused(self.grpc.StatusCode.INVALID_ARGUMENT, ["split.block_index 3"],
                               srv=srv, block_index=3)
        finally:
            srv.stop()

    def test_other_shard_count(self):
        self.assertRefused(self.grpc.StatusCode.FAILED_PRECONDITION,
                           ["placed for 2 shards", "one of 3"],
                           shard_count=2, bounds=[0, 2, 6], block_shards=[0, 1])

    def test_other_shards_block(self):
        self.assertRefused(self.grpc.StatusCode.FAILED_PRECONDITION,
                           ["split block 2 is placed on shard 2", "this is shard 1"],
                           block_index=2)

    def test_inconsistent_geometry(self):
        inv = self.grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            (dict(bounds=[0, 2, 5, 7]), ["split.bounds", "ends at row 7, not at 6"]),
            (dict(bounds=[1, 2, 5, 6]), ["split.bounds", "starts at row 1"]),
            (dict(bounds=[0, 5, 5, 6]), ["split.bounds", "must increase"]),
            (dict(bounds=[0, 6], block_shards=[1], block_index=0), ["2 to 4096 blocks"]),
            (dict(bounds=[]), ["split.bounds has 0 entries"]),
            (dict(block_shards=[0, 1]), ["split.block_shards has 2 entries for 3 blocks"]),
            (dict(block_shards=[1, 1, 2]), ["must increase", "block 1 is on shard 1"]),
            (dict(block_shards=[0, 1, 3]), ["split.block_shards[2] is shard 3 of 3"]),
            (dict(block_index=3), ["split.block_index 3 of 3 blocks"]),
        ]
        for split, words in cases:
            with self.subTest(split=split):
                self.assertRefused(inv, words, **split)

    def exchange(self, **kw):
        pb = self.pb
        # Valid stats partials of block 0 ([0, 2) of 6 rows, 1 matrix of 4 columns):
        # the 64-byte header, then rsum, rmin, colsum[4], s[4] (f64), col_old[4] (f32).
        hdr = struct.pack("<IBBBBQQQQQdd", 0x58535046, 1, 1, 1, 0, 0, 2, 4, 0, 1, 0.0, 0.0)
        body = struct.pack("<10d4f", *([0.0] * 14))
        req = dict(name="emb", version=0, from_shard=0, shard_count=3, block_index=0,
                   phase=pb.EXCHANGE_PHASE_STATS, partials=hdr + body)
        req.update(kw)
        return self.srv.stub.Exchange(pb.ExchangeRequest(**req), timeout=30)

    def assertExchange(self, code, words, **kw):
        with self.assertRaises(self.grpc.RpcError) as cm:
            self.exchange(**kw)
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())

    def test_exchange_validates_then_finds_no_block(self):
        C = self.grpc.StatusCode
        self.assertExchange(C.NOT_FOUND, ["tensor 'emb' from shard 0", "holds no row block"])
        self.assertExchange(C.INVALID_ARGUMENT, ["name"], name="")
        self.assertExchange(C.INVALID_ARGUMENT, ["phase 0"], phase=0)
        self.assertExchange(C.FAILED_PRECONDITION, ["one of 2 shards", "one of 3"], shard_count=2)
        self.assertExchange(C.INVALID_ARGUMENT, ["from_shard 1 is not another shard"],
                            from_shard=1)
        self.assertExchange(C.INVALID_ARGUMENT, ["from_shard 3"], from_shard=3)
        self.assertExchange(C.INVALID_ARGUMENT, ["header alone is 64"], partials=b"FPSX")
        self.assertExchange(C.INVALID_ARGUMENT, ["phase 1 (stats), expected 2 (u2)"],
                            phase=self.pb.EXCHANGE_PHASE_U2)
        with self.assertRaises(self.grpc.RpcError) as cm:
            self.exchange(partials=b"\0" * 64)
        self.assertIn("magic", cm.exception.details())
        _, tensors = H.stats(self.srv.stub)
        self.assertNotIn("emb", tensors)

    def test_exchange_for_a_whole_tensor(self):
        pb = self.pb
        self.srv.stub.Create(pb.CreateRequest(shard_id=1, shard_count=3, tensors=[
            pb.TensorCreate(name="whole", shape=[3, 4], optimizer=H.optimizer())]), timeout=30)
        self.assertExchange(self.grpc.StatusCode.FAILED_PRECONDITION,
                            ["tensor 'whole'", "holds the tensor whole"], name="whole")

if __name__ == "__main__":
    unittest.main()

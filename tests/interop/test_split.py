#!/usr/bin/python3
"""Split tensors on the wire: a Create carrying a
SplitBlock gets its block map checked exactly as the proto says (another
shard count or another shard's block: FAILED_PRECONDITION naming both;
inconsistent geometry: INVALID_ARGUMENT naming the field); a consistent
block is then refused with FAILED_PRECONDITION by a shard without --peers
("this shard has no --peers") or in async/ssp mode ("split tensors need
--mode sync"). Every refusal leaves the shard without the tensor. Exchange
requests are validated as the proto says and then refused (NOT_FOUND: no
block here, or FAILED_PRECONDITION for a tensor held whole). One server
(shard 1 of 3, sync) and, for the mode rule, one in async mode."""
import re
import struct
import threading
import unittest
import urllib.request

import numpy as np

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

class SplitBlocks(unittest.TestCase):
    """Blocks held by a two-shard job with --peers: [5, 4] in rows [0, 2)
    on shard 0 and [2, 5) on shard 1, through Create, Pull, GetState,
    Stats and /metrics, block-local everywhere; create-or-match of the map;
    pushes to the blocks step them together."""

    SHAPE = [5, 4]
    BOUNDS = [0, 2, 5]

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.mports = H.free_ports(2)
        cls.job = H.Job(2, shard_args=[["--metrics-listen", "127.0.0.1:%d" % p] for p in cls.mports])

    @classmethod
    def tearDownClass(cls):
        cls.job.stop()

    def tc(self, name, b, init=None, **kw):
        pb = self.pb
        split = kw.pop("split", None) or pb.SplitBlock(block_index=b, bounds=self.BOUNDS,
                                                       block_shards=[0, 1], shard_count=2)
        if init is not None:
            kw["init"] = pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0,
                                        data=np.asarray(init, dtype="<f4").tobytes())
        return pb.TensorCreate(name=name, shape=self.SHAPE, optimizer=H.optimizer(), split=split,
                               **kw)

    def create(self, b, *tcs):
        return self.job.stub(b).Create(self.pb.CreateRequest(shard_id=b, shard_count=2,
                                                             tensors=list(tcs)), timeout=30)

    def pull_block(self, b, name):
        """(values at block-local offsets, version, the slices' shapes)."""
        vals, version, shapes = {}, None, set()
        for r in self.job.stub(b).Pull(self.pb.PullRequest(names=[name]), timeout=30):
            for sl in r.params:
                shapes.add(tuple(sl.shape))
                for i, v in enumerate(np.frombuffer(sl.data, dtype="<f4")):
                    vals[sl.offset + i] = v
            for v in r.versions:
                version = v.version
        n = len(vals)
        self.assertEqual(sorted(vals), list(range(n)))
        return np.array([vals[i] for i in range(n)], dtype=np.float32), version, shapes

    def get_state(self, b, name):
        arrays, info = {}, None
        for r in self.job.stub(b).GetState(self.pb.GetStateRequest(names=[name]), timeout=30):
            for sl in r.slices:
                arrays.setdefault(sl.kind, {})
                for i, v in enumerate(np.frombuffer(sl.data, dtype="<f4")):
                    arrays[sl.kind][sl.offset + i] = v
            for t in r.tensors:
                info = t
        out = {k: np.array([d[i] for i in range(len(d))], dtype=np.float32) for k, d in arrays.items()}
        return out, info

    def assertRpc(self, code, words, fn, *args):
        with self.assertRaises(self.grpc.RpcError) as cm:
            fn(*args)
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())

    def test_create_pull_getstate_stats(self):
        pb = self.pb
        full = np.arange(20, dtype=np.float32).reshape(5, 4) / 7
        for b in (0, 1):
            lo, hi = self.BOUNDS[b], self.BOUNDS[b + 1]
            r = self.create(b, self.tc("emb", b, init=full[lo:hi].reshape(-1)))
            self.assertTrue(r.tensors[0].created)
            self.assertTrue(r.tensors[0].ready)
            self.assertEqual(r.tensors[0].initialised_elements, (hi - lo) * 4)
            vals, version, shapes = self.pull_block(b, "emb")
            np.testing.assert_array_equal(vals, full[lo:hi].reshape(-1))
            self.assertEqual(version, 0)
            self.assertEqual(shapes, {tuple(self.SHAPE)})
            st, info = self.get_state(b, "emb")
            self.assertEqual(info.row_elements, hi - lo)
            self.assertEqual(info.col_elements, 4)
            self.assertEqual(info.var_elements, 0)
            self.assertEqual(info.step, 0)
            np.testing.assert_array_equal(st[pb.STATE_ROW], np.zeros(hi - lo, np.float32))
            np.testing.assert_array_equal(st[pb.STATE_COL], np.zeros(4, np.float32))
            resp, tensors = H.stats(self.job.stub(b))
            t = tensors["emb"]
            self.assertEqual(list(t.shape), self.SHAPE)
            self.assertTrue(t.factored)
            self.assertEqual(t.param_elements, (hi - lo) * 4)
            self.assertEqual(t.param_bytes, (hi - lo) * 16)
            self.assertEqual(t.state.row_elements, hi - lo)
            self.assertEqual(t.state.col_elements, 4)
            self.assertTrue(t.HasField("split"))
            self.assertEqual(t.split.block_index, b)
            self.assertEqual(list(t.split.bounds), self.BOUNDS)
            self.assertEqual(list(t.split.block_shards), [0, 1])
            self.assertEqual(t.split.shard_count, 2)
            self.assertGreaterEqual(resp.shard.split_blocks, 1)
            blocks = [x for x in resp.tensors if x.HasField("split")]
            self.assertEqual(resp.shard.split_blocks, len(blocks))
            self.assertEqual(resp.shard.split_param_bytes, sum(x.param_bytes for x in blocks))
            self.assertEqual(resp.shard.param_bytes, sum(x.param_bytes for x in resp.tensors))

    def test_metrics(self):
        self.create(1, self.tc("g", 1, init=np.zeros(12, np.float32)))
        self.create(1, self.pb.TensorCreate(name="whole", shape=[3], optimizer=H.optimizer()))
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mports[1], timeout=30) as r:
            text = r.read().decode()

        def metric(name):
            m = re.search(r'^%s\{shard="1"\} (\S+)$' % name, text, re.M)
            self.assertIsNotNone(m, name)
            return float(m.group(1))

        self.assertEqual(metric("factorps_split_blocks"), 1)
        self.assertEqual(metric("factorps_split_block_parameter_bytes"), 48)
        self.assertEqual(metric("factorps_parameter_bytes"), 48 + 12)
        self.assertEqual(metric("factorps_tensors"), 2)

    def test_create_or_match(self):
        C = self.grpc.StatusCode
        init = np.ones(8, np.float32)
        self.create(0, self.tc("m", 0, init=init))
        r = self.create(0, self.tc("m", 0, init=np.zeros(8, np.float32)))
        self.assertFalse(r.tensors[0].created)
        vals, _, _ = self.pull_block(0, "m")
        np.testing.assert_array_equal(vals, init)  # the first values win
        other = self.pb.SplitBlock(block_index=0, bounds=[0, 3, 5], block_shards=[0, 1],
                                   shard_count=2)
        self.assertRpc(C.ALREADY_EXISTS, ["tensor 'm'", "split.bounds [0, 2, 5], not [0, 3, 5]"],
                       self.create, 0, self.tc("m", 0, split=other))
        whole = self.pb.TensorCreate(name="m", shape=self.SHAPE, optimizer=H.optimizer())
        self.assertRpc(C.ALREADY_EXISTS, ["tensor 'm'", "as block 0 of a split tensor"],
                       self.create, 0, whole)
        # The init slice is the block's: 8 elements on shard 0, not 20.
        self.assertRpc(C.INVALID_ARGUMENT, ["tensor 'n'", "out of range: the tensor has 8"],
                       self.create, 0, self.tc("n", 0, init=np.zeros(20, np.float32)))
        _, tensors = H.stats(self.job.stub(0))
        self.assertNotIn("n", tensors)

    def test_resume_with_block_state(self):
        pb = self.pb
        row = np.array([0.5, 0.25, 2.0], np.float32)
        col = np.array([1, 2, 3, 4], np.float32) / 8
        state = [pb.StateSlice(kind=pb.STATE_ROW, offset=0, data=row.tobytes()),
                 pb.StateSlice(kind=pb.STATE_COL, offset=0, data=col.tobytes())]
        p = np.linspace(-1, 1, 12, dtype=np.float32)
        r = self.create(1, self.tc("r", 1, init=p, step=4, init_state=state))
        self.assertTrue(r.tensors[0].ready)
        self.assertEqual(r.tensors[0].version, 4)
        st, info = self.get_state(1, "r")
        self.assertEqual((info.version, info.step), (4, 4))
        np.testing.assert_array_equal(st[pb.STATE_ROW], row)
        np.testing.assert_array_equal(st[pb.STATE_COL], col)
        vals, version, _ = self.pull_block(1, "r")
        np.testing.assert_array_equal(vals, p)
        self.assertEqual(version, 4)

    def push_block(self, b, name, step, g):
        """Worker 0's push of block b's gradient rows (block-local)."""
        pb = self.pb
        msgs = [pb.PushPullRequest(worker_id=0, step=step, grads=[pb.TensorSlice(
            name=name, dtype=pb.DTYPE_F32, shape=self.SHAPE, offset=0,
            data=np.ascontiguousarray(g, dtype="<f4").tobytes())])]
        vals, version = {}, None
        for r in self.job.stub(b).PushPull(iter(msgs), timeout=60):
            for sl in r.params:
                for k, v in enumerate(np.frombuffer(sl.data, dtype="<f4")):
                    vals[sl.offset + k] = v
            for v in r.versions:
                version = v.version
        return np.array([vals[k] for k in range(len(vals))], dtype=np.float32), version

    def test_push_steps_every_block(self):
        """Blocks made by Create step as the whole tensor would: each
        shard's push waits for the other's partials; the replies are the
        whole tensor's torch step (float64 reference, 1e-6 of the largest
        value), the column state is the same bits on both shards."""
        pb = self.pb
        rng = np.random.default_rng(12)
        p = rng.standard_normal((5, 4)).astype(np.float32)
        for b in (0, 1):
            lo, hi = self.BOUNDS[b], self.BOUNDS[b + 1]
            self.create(b, self.tc("s", b, init=p[lo:hi].reshape(-1)))
        row, col = np.zeros(5), np.zeros(4)
        for step in range(2):
            g = rng.standard_normal((5, 4)).astype(np.float32)
            want = H.torch_adafactor_step(p, g, row, col, None, step + 1)
            out = [None, None]

            def run(b):
                lo, hi = self.BOUNDS[b], self.BOUNDS[b + 1]
                out[b] = self.push_block(b, "s", step, g[lo:hi].reshape(-1))

            threads = [threading.Thread(target=run, args=(b,)) for b in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for b in (0, 1):
                self.assertIsNotNone(out[b], "shard %d's push failed" % b)
                lo, hi = self.BOUNDS[b], self.BOUNDS[b + 1]
                vals, version = out[b]
                self.assertEqual(version, step + 1)
                np.testing.assert_allclose(vals, want[lo:hi].reshape(-1), rtol=0,
                                           atol=1e-6 * np.abs(want).max())
            p = np.concatenate([out[0][0], out[1][0]]).reshape(5, 4)
        states = [self.get_state(b, "s") for b in (0, 1)]
        self.assertEqual(states[0][0][pb.STATE_COL].tobytes(), states[1][0][pb.STATE_COL].tobytes())
        np.testing.assert_allclose(states[0][0][pb.STATE_COL], col, rtol=1e-6)
        np.testing.assert_allclose(np.concatenate([states[0][0][pb.STATE_ROW],
                                                   states[1][0][pb.STATE_ROW]]), row, rtol=1e-6)
        for b in (0, 1):
            self.assertEqual(states[b][1].step, 2)
            resp, tensors = H.stats(self.job.stub(b))
            self.assertEqual(tensors["s"].version, 2)
            self.assertGreaterEqual(resp.shard.exchange_steps, 2)


if __name__ == "__main__":
    unittest.main()

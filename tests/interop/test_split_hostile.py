#!/usr/bin/python3
"""Hostile Exchange requests to a real shard. Any client with
the token can call Exchange, so shard 0 of a two-shard sync job holding
block 0 (rows [0, 2)) of a [6, 5] tensor gets requests that imitate shard
1's partials of block 1 with one thing wrong each: every one must be
refused with the status and a message naming the problem as the proto's
Exchange comment says, and leave the block exactly as it was (Stats,
Pull and GetState unchanged, no step counted). Then a real step of both
blocks must still work and match the same tensor held whole within
check_vectors.py's param tolerance (scaled 1e-5)."""
import concurrent.futures as cf
import math
import struct
import unittest

import numpy as np

import fpsharness as H
from test_xstep import BOUNDS, PTOL, SHAPE, block_create, block_push, scaled

COLS = SHAPE[1]


def partials(phase=1, kind=1, row_lo=2, row_hi=6, cols=COLS, mtx_lo=0, nmat=1, psq=1.0, u2=0.0,
             rsum=4.0, rmin=0.5, colsum=None, s=None, col_old=None, magic=0x58535046, version=1):
    """Block 1's partials in the wire form of common/adafactor_split.h:
    the 64-byte header, then per matrix rsum, rmin, colsum[C], S[C] (f64)
    and col_old[C] (f32). The defaults are well formed and plausible."""
    hdr = struct.pack("<IBBBBQQQQQdd", magic, version, phase, kind, 0, row_lo, row_hi, cols, mtx_lo,
                      nmat, psq, u2)
    colsum = [0.25] * COLS if colsum is None else colsum
    s = [0.5] * COLS if s is None else s
    col_old = [0.0] * COLS if col_old is None else col_old
    body = struct.pack("<2d", rsum, rmin) + struct.pack("<%dd" % COLS, *colsum) + \
        struct.pack("<%dd" % COLS, *s) + struct.pack("<%df" % COLS, *col_old)
    return hdr + body


class SplitHostile(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()

    def exchange(self, stub, **kw):
        pb = self.pb
        req = dict(name="emb", version=0, from_shard=1, shard_count=2, block_index=1,
                   phase=pb.EXCHANGE_PHASE_STATS, partials=partials())
        req.update(kw)
        return stub.Exchange(pb.ExchangeRequest(**req), timeout=30)

    def snapshot(self, stub):
        """What a refused request must leave as it was."""
        pb = self.pb
        st, tensors = H.stats(stub)
        t = tensors["emb"]
        shard = (st.shard.updates, st.shard.exchange_steps, st.shard.exchange_failures,
                 st.shard.exchange_received_bytes, st.shard.split_blocks)
        got, ver = H.collect(stub.Pull(pb.PullRequest(names=["emb"]), timeout=30),
                             {"emb": [BOUNDS[1] * COLS]})
        state = [r.SerializeToString() for r in stub.GetState(pb.GetStateRequest(names=["emb"]), timeout=30)]
        return shard, (t.version, t.ready), ver["emb"], got["emb"].tobytes(), state

    def test_refused_requests_change_nothing_then_a_step_works(self):
        C = self.grpc.StatusCode
        U2 = self.pb.EXCHANGE_PHASE_U2
        nan, inf = math.nan, math.inf
        # (status, words the message must hold, request fields)
        cases = [
            (C.INVALID_ARGUMENT, ["Exchange", "name"], dict(name="")),
            (C.INVALID_ARGUMENT, ["Exchange", "name"], dict(name="x" * 300)),
            (C.INVALID_ARGUMENT, ["tensor 'emb'", "phase 0"], dict(phase=0)),
            (C.INVALID_ARGUMENT, ["phase 7"], dict(phase=7)),
            (C.FAILED_PRECONDITION, ["one of 3 shards", "one of 2"], dict(shard_count=3)),
            (C.INVALID_ARGUMENT, ["from_shard 0 is not another shard", "this is shard 0"],
             dict(from_shard=0)),
            (C.INVALID_ARGUMENT, ["from_shard 9"], dict(from_shard=9)),
            (C.INVALID_ARGUMENT, ["no partials given"], dict(partials=b"")),
            (C.INVALID_ARGUMENT, ["header alone is 64"], dict(partials=partials()[:63])),
            (C.INVALID_ARGUMENT, ["magic"], dict(partials=partials(magic=0))),
            (C.INVALID_ARGUMENT, ["version 9"], dict(partials=partials(version=9))),
            (C.INVALID_ARGUMENT, ["kind 7"], dict(partials=partials(kind=7))),
            (C.INVALID_ARGUMENT, ["phase 2 (u2), expected 1 (stats)"], dict(partials=partials(phase=2))),
            (C.INVALID_ARGUMENT, ["rows [6, 6) are empty"], dict(partials=partials(row_lo=6))),
            (C.INVALID_ARGUMENT, ["do not match their header"], dict(partials=partials(nmat=1 << 60))),
            (C.INVALID_ARGUMENT, ["do not match their header", "of 2^64 - 1 columns: more than 2^64 bytes"],
             dict(partials=partials(cols=(1 << 64) - 1))),
            (C.INVALID_ARGUMENT, ["do not match their header"], dict(partials=partials()[:-1])),
            (C.INVALID_ARGUMENT, ["header sum p^2 is nan"], dict(partials=partials(psq=nan))),
            (C.INVALID_ARGUMENT, ["row-statistic sum of matrix 0 is inf"], dict(partials=partials(rsum=inf))),
            (C.INVALID_ARGUMENT, ["row-statistic min of matrix 0 is -1"], dict(partials=partials(rmin=-1.0))),
            (C.INVALID_ARGUMENT, ["column sum of g^2 of matrix 0, column 2 is nan"],
             dict(partials=partials(colsum=[0.25, 0.25, nan, 0.25, 0.25]))),
            (C.INVALID_ARGUMENT, ["column state of matrix 0, column 4 is inf"],
             dict(partials=partials(col_old=[0, 0, 0, 0, inf]))),
            (C.INVALID_ARGUMENT, ["phase 1 (stats), expected 2 (u2)"], dict(phase=U2)),
            (C.NOT_FOUND, ["tensor 'nope' from shard 1", "holds no row block"], dict(name="nope")),
            (C.FAILED_PRECONDITION, ["block 0 from shard 1 is not in this shard's map"],
             dict(block_index=0)),
            (C.FAILED_PRECONDITION, ["not in this shard's map"], dict(block_index=5)),
            (C.FAILED_PRECONDITION, ["more than one step ahead", "diverged"], dict(version=1000)),
            (C.FAILED_PRECONDITION, ["version 2^64 - 1, more than one step ahead", "2^64 - 1 steps behind them", "diverged"],
             dict(version=(1 << 64) - 1)),
            (C.FAILED_PRECONDITION, ["do not fit block 1", "diverged"],
             dict(partials=partials(row_lo=0, row_hi=4))),
            (C.FAILED_PRECONDITION, ["do not fit block 1", "diverged"], dict(partials=partials(mtx_lo=1))),
            (C.FAILED_PRECONDITION, ["column state of matrix 0", "diverged"],
             dict(partials=partials(col_old=[0, 0, 1.0, 0, 0]))),
        ]
        rng = np.random.default_rng(31)
        init = rng.standard_normal(SHAPE).astype(np.float32)
        whole = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(whole.stub, "emb", SHAPE, init)
            with H.Job(2, "--mode", "sync", "--workers", 1, "--exchange-deadline", 10) as job, \
                    cf.ThreadPoolExecutor(2) as ex:
                for i in range(2):
                    block_create(self.pb, job.stub(i), i, init)
                stub = job.stub(0)
                before = self.snapshot(stub)
                for code, words, kw in cases:
                    with self.subTest(kw=repr(kw)[:80]):
                        with self.assertRaises(self.grpc.RpcError) as cm:
                            self.exchange(stub, **kw)
                        e = cm.exception
                        self.assertEqual(e.code(), code, e.details())
                        for w in words:
                            self.assertIn(w, e.details())
                        # All ones in a 64-bit field reads as 2^64 - 1, not 20 digits.
                        self.assertNotIn("18446744073709551615", e.details())
                        self.assertEqual(self.snapshot(stub), before)
                # The job still steps, like the tensor held whole.
                prev = init.astype(np.float64)
                for step in range(2):
                    g = rng.standard_normal(SHAPE).astype(np.float32)
                    ref, _ = H.push(whole.stub, 0, step, {"emb": (SHAPE, g)})
                    futs = [ex.submit(block_push, job.stub(i), i, step, g) for i in range(2)]
                    parts = [f.result() for f in futs]
                    for _, v in parts:
                        self.assertEqual(v, step + 1)
                    got = np.concatenate([p for p, _ in parts]).reshape(SHAPE)
                    err = scaled(got, ref["emb"].astype(np.float64), prev)
                    self.assertLessEqual(err, PTOL, "step %d: param scaled error %.3e" % (step, err))
                    prev = ref["emb"].astype(np.float64)
                # A step that is over: refused, and the next step still works.
                before = self.snapshot(stub)
                with self.assertRaises(self.grpc.RpcError) as cm:
                    self.exchange(stub, version=0)
                self.assertEqual(cm.exception.code(), C.FAILED_PRECONDITION, cm.exception.details())
                self.assertIn("tensor 'emb'", cm.exception.details())
                self.assertEqual(self.snapshot(stub), before)
                g = rng.standard_normal(SHAPE).astype(np.float32)
                ref, _ = H.push(whole.stub, 0, 2, {"emb": (SHAPE, g)})
                parts = [f.result() for f in [ex.submit(block_push, job.stub(i), i, 2, g) for i in range(2)]]
                got = np.concatenate([p for p, _ in parts]).reshape(SHAPE)
                err = scaled(got, ref["emb"].astype(np.float64), prev)
                self.assertLessEqual(err, PTOL, "step 2: param scaled error %.3e" % err)
                st, _ = H.stats(stub)
                self.assertEqual(st.shard.exchange_steps, 3)
                self.assertEqual(st.shard.exchange_failures, 0)
        finally:
            whole.stop()


if __name__ == "__main__":
    unittest.main()

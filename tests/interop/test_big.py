#!/usr/bin/python3
"""A 1 GiB tensor round trip with default settings: Create in slices, one
PushPull, one Pull, all through a grpcio client. Memory is kept sane: the
gradient is one reused 4 MiB slice, results are checked chunk by chunk.

Also, run directly, a throughput probe (not a test):
  FPS_SERVER=... python3 test_big.py --bench [MiB]"""
import sys
import time
import unittest

import numpy as np

import fpsharness as H

ROWS, COLS = 16384, 16384          # 2^28 fp32 = 1 GiB
BASE = ((np.arange(1024) - 512) / 1024).astype(np.float32)


def ones_messages(pb, name, shape, n, worker=0, step=0):
    data = np.ones(H.SLICE_ELEMS, np.float32).tobytes()
    for off in range(0, n, H.SLICE_ELEMS):
        k = min(H.SLICE_ELEMS, n - off)
        yield pb.PushPullRequest(worker_id=worker, step=step, grads=[pb.TensorSlice(
            name=name, dtype=pb.DTYPE_F32, shape=shape, offset=off, data=data[:4 * k])])


def check_chunks(testcase, got, want_row):
    """got: (n,) float32 whose every 1024-block should equal want_row."""
    blocks = got.reshape(-1, 1024)
    for i in range(0, blocks.shape[0], 8192):
        err = np.abs(blocks[i:i + 8192] - want_row).max()
        testcase.assertLess(err, 1e-6, "block %d" % i)


class Big(unittest.TestCase):
    def test_one_gib_round_trip(self):
        pb, _, _ = H.stubs()
        n = ROWS * COLS
        srv = H.Server()  # default settings
        try:
            p0 = np.tile(BASE, n // 1024)
            t0 = time.monotonic()
            r = H.create(srv.stub, "big", [ROWS, COLS], p0, timeout=600)
            self.assertTrue(r.tensors[0].ready)
            del p0
            t1 = time.monotonic()
            got, ver = H.collect(srv.stub.PushPull(ones_messages(pb, "big", [ROWS, COLS], n), timeout=600),
                                 {"big": [ROWS, COLS]})
            t2 = time.monotonic()
            self.assertEqual(ver, {"big": 1})
            # grad == 1 everywhere: V == 1, U == 1, RMS(U) == 1, so the step
            # is p - alpha with alpha = max(eps2, RMS(p0)) * min(lr, 1).
            alpha = max(1e-3, float(np.sqrt(np.mean(BASE.astype(np.float64) ** 2)))) * 1e-2
            want = (BASE.astype(np.float64) - alpha).astype(np.float32)
            check_chunks(self, got["big"].reshape(-1), want)
            del got
            t3 = time.monotonic()
            pulled, ver = H.pull(srv.stub, {"big": [ROWS, COLS]}, timeout=600)
            t4 = time.monotonic()
            self.assertEqual(ver, {"big": 1})
            check_chunks(self, pulled["big"].reshape(-1), want)
            del pulled
            s, ts = H.stats(srv.stub)
            self.assertEqual(ts["big"].param_bytes, 1 << 30)
            self.assertEqual((ts["big"].state.row_elements, ts["big"].state.col_elements), (ROWS, COLS))
            print("\n1 GiB: create %.1f s, pushpull %.1f s, pull %.1f s" % (t1 - t0, t2 - t1, t4 - t3))
        finally:
            srv.stop(timeout=120)


def bench(mib):
    """Push/pull MB/s for one tensor of `mib` MiB on loopback (medians of 3)."""
    pb, _, _ = H.stubs()
    n = mib * (1 << 18)
    srv = H.Server("--mode", "async")
    try:
        H.create(srv.stub, "t", [n], np.zeros(n, np.float32))
        pp, pl = [], []
        for step in range(3):
            t0 = time.monotonic()
            H.collect(srv.stub.PushPull(ones_messages(pb, "t", [n], n, step=step), timeout=600), {"t": [n]})
            pp.append(time.monotonic() - t0)
            t0 = time.monotonic()
            H.pull(srv.stub, {"t": [n]})
            pl.append(time.monotonic() - t0)
        mb = n * 4 / 1e6
        print("%d MiB: pushpull %.0f MB/s each way (%.0f MB/s both), pull %.0f MB/s" % (
            mib, mb / np.median(pp), 2 * mb / np.median(pp), mb / np.median(pl)))
    finally:
        srv.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--bench":
        bench(int(sys.argv[2]) if len(sys.argv) > 2 else 64)
    else:
        unittest.main()

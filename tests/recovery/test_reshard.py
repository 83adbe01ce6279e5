"""Resharding in the middle of a training run: a job trains on 2
shards with split tensors, checkpoints, is resharded to 3 shards with
`factorps checkpoint reshard`, trains on, is resharded back to 2 and trains
on. After each reshard the restored parameters equal the checkpointed ones
bit for bit, and after 10 more steps they equal an uninterrupted run on 2
shards within rtol 1e-5 / atol 1e-6 (the blocks' partial sums are combined
in another order on another shard count, so float rounding may differ).

Shards: fpsharness.Job (tests/interop: --peers, loopback ports), one
--checkpoint-dir each; the worker is libfactorps through the Python package.
"""
import os
import subprocess
import sys
import tempfile
import shutil
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))

from _recovery import CLI, need_server  # noqa: E402  (puts client/python on sys.path)
import fpsharness as H  # noqa: E402
import factorps  # noqa: E402

SPLIT = 2048  # bytes: "emb" (4 KiB) and "bias" (2.4 KB) are split, "w" is not
RTOL, ATOL = 1e-5, 1e-6
SPECS = [
    ("emb", (64, 16), {"flavor": "torch"}),
    ("bias", (600,), {"flavor": "hf", "lr": 1e-2, "relative_step": False, "beta1": 0.9}),
    ("w", (16, 8), {"flavor": "torch"}),
]


def init_values():
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s, _ in SPECS}


def targets():
    rng = np.random.default_rng(11)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s, _ in SPECS}


def grads_of(params, tgt, step):
    """A deterministic gradient of the current params (a quadratic pull
    towards the targets, plus a step-dependent wiggle)."""
    out = {}
    for i, (n, s, _) in enumerate(SPECS):
        wiggle = np.float32(0.01) * np.sin(np.arange(np.prod(s), dtype=np.float32) + step + i).reshape(s)
        out[n] = (params[n] - tgt[n] + wiggle).astype(np.float32)
    return out


class Trainer:
    """One worker of a job on `job`'s shards, from `params` at `step`."""

    def __init__(self, job, params, step):
        self.client = factorps.connect([s.addr for s in job.servers], split_min_bytes=SPLIT, deadline=60)
        self.client.create([{"name": n, "shape": s, "optimizer": o, "init": params[n]} for n, s, o in SPECS])
        self.step = step

    def pull(self):
        return {n: np.array(a, copy=True) for n, a in self.client.pull([n for n, _, _ in SPECS])[0].items()}

    def train(self, params, tgt, steps):
        for _ in range(steps):
            p, _ = self.client.push_pull(grads_of(params, tgt, self.step), step=self.step)
            params = {n: np.array(p[n], copy=True) for n, _, _ in SPECS}
            self.step += 1
        return params

    def close(self):
        self.client.close()


def job(n, dirs=None):
    extra = [["--checkpoint-dir", d] for d in dirs] if dirs else None
    return H.Job(n, "--mode", "sync", "--workers", "1", shard_args=extra)


def reshard(count, ins, outs):
    p = subprocess.run([CLI, "checkpoint", "reshard", "--shard-count", str(count), "--split-min-bytes",
                        str(SPLIT), *ins, *outs], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError("reshard to %d failed (%d): %s%s" % (count, p.returncode, p.stdout, p.stderr))
    return p.stdout


@need_server
class Reshard(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-reshard-")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def dirs(self, tag, n):
        return [os.path.join(self.root, "%s%d" % (tag, i)) for i in range(n)]

    def assert_close(self, got, want, what):
        for n, _, _ in SPECS:
            np.testing.assert_allclose(got[n], want[n], rtol=RTOL, atol=ATOL, err_msg="%s: %s" % (what, n))

    def test_reshard_2_3_2_mid_run(self):
        init, tgt = init_values(), targets()
        # The uninterrupted run: 30 steps on 2 shards.
        with job(2) as j:
            t = Trainer(j, init, 0)
            for n in ("emb", "bias"):
                self.assertEqual(len(t.client.blocks(n)), 2, n)
            self.assertEqual(len(t.client.blocks("w")), 1)
            ref10 = t.train(init, tgt, 10)
            ref20 = t.train(ref10, tgt, 10)
            ref30 = t.train(ref20, tgt, 10)
            t.close()
        # The same job, resharded 2 -> 3 after step 10 and 3 -> 2 after 20.
        a, b, c = self.dirs("a", 2), self.dirs("b", 3), self.dirs("c", 2)
        with job(2, a) as j:
            t = Trainer(j, init, 0)
            p10 = t.train(init, tgt, 10)
            np.testing.assert_array_equal(p10["emb"], ref10["emb"])  # same shards, same run
            t.client.checkpoint()
            t.close()
        out = reshard(3, a, b)
        self.assertIn("resharded 3 tensors (2 split) of 2 shards onto 3 shards", out)
        with job(3, b) as j:
            t = Trainer(j, init, 10)
            for n in ("emb", "bias"):
                self.assertEqual(len(t.client.blocks(n)), 3, n)
            restored = t.pull()
            for n, _, _ in SPECS:
                np.testing.assert_array_equal(restored[n], p10[n], err_msg="restored on 3 shards: " + n)
            p20 = t.train(restored, tgt, 10)
            self.assert_close(p20, ref20, "10 steps after 2 -> 3")
            t.client.checkpoint()
            t.close()
        self.assertIn("(2 split) of 3 shards onto 2 shards", reshard(2, b, c))
        with job(2, c) as j:
            t = Trainer(j, init, 20)
            restored = t.pull()
            for n, _, _ in SPECS:
                np.testing.assert_array_equal(restored[n], p20[n], err_msg="restored on 2 shards: " + n)
            p30 = t.train(restored, tgt, 10)
            self.assert_close(p30, ref30, "10 steps after 3 -> 2")
            t.close()
        for n, _, _ in SPECS:  # it trained: far from where it started
            self.assertGreater(float(np.max(np.abs(p30[n] - init[n]))), 0.05, n)
        worst = max(float(np.max(np.abs(p30[n] - ref30[n]))) for n, _, _ in SPECS)
        print("max |resharded - uninterrupted| after 30 steps: %.3g" % worst)


if __name__ == "__main__":
    unittest.main()

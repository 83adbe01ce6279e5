#!/usr/bin/python3
"""A shard that fails during a cross-shard step of a split tensor (issue
12). SIGKILLed: every block's call fails, nothing is applied anywhere
(Stats versions and Pull on the surviving shards), and after the killed
shard restarts from its checkpoint the next step (another gradient)
succeeds on every block and equals the unsplit update. Also a peer that
stops answering mid-step (SIGSTOP: the waiting blocks fail UNAVAILABLE
naming it, nothing applied, the retry succeeds once it runs again), and
SIGTERM to a shard whose block's step is waiting for a peer.

Three shards in sync mode (one worker) that know each other (--peers),
each with its own --checkpoint-dir; one [7, 5] torch tensor split into
blocks of 2, 1 and 4 rows (a single-row block included). Driven with a
grpcio client generated from the proto (fpsharness), block by block as the
contract says: each shard gets its block's Create and its block's gradient
rows with block-local offsets.

"During the step": the blocks on shards 0 and 1 are pushed and wait for
shard 2's partials; shard 2 is then killed, so its block's push fails too
(its shard is gone) and the two waiting pushes fail UNAVAILABLE within the
exchange deadline. The reference is torch_adafactor_step (float64) on the
whole tensor; tolerance as in test_interop: 2e-6 of the largest value."""
import os
import shutil
import signal
import tempfile
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [7, 5]
BOUNDS = [0, 2, 3, 7]
SHARDS = 3
EXCHANGE_DEADLINE = 3
LONG_DEADLINE = 30  # long_job()'s


def block_rows(b):
    return BOUNDS[b], BOUNDS[b + 1]


class SplitKill(unittest.TestCase):
    def setUp(self):
        self.pb, self.pbg, self.grpc = H.stubs()
        self.dir = tempfile.mkdtemp(prefix="fps-split-kill-")
        dirs = [os.path.join(self.dir, "shard%d" % i) for i in range(SHARDS)]
        self.job = H.Job(SHARDS, "--mode", "sync", "--workers", 1, "--exchange-deadline", EXCHANGE_DEADLINE,
                         "--deadline", 30, shard_args=[["--checkpoint-dir", d] for d in dirs])

    def tearDown(self):
        try:
            self.job.stop()
        finally:
            shutil.rmtree(self.dir, True)

    def create(self, init):
        pb = self.pb
        flat = init.reshape(-1)
        for b in range(SHARDS):
            lo, hi = block_rows(b)
            cols = SHAPE[1]
            tc = pb.TensorCreate(name="emb", shape=SHAPE, optimizer=H.optimizer(),
                                 init=pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0,
                                                     data=flat[lo * cols:hi * cols].tobytes()),
                                 split=pb.SplitBlock(block_index=b, bounds=BOUNDS, block_shards=list(range(SHARDS)),
                                                     shard_count=SHARDS))
            self.job.stub(b).Create(pb.CreateRequest(shard_id=b, shard_count=SHARDS, tensors=[tc]), timeout=30)

    def push_block(self, b, step, grad, out):
        """Pushes block b's rows of grad (block-local offsets); out[b] gets
        ("ok", rows) or ("error", code, details)."""
        pb = self.pb
        lo, hi = block_rows(b)
        cols = SHAPE[1]
        part = grad.reshape(-1)[lo * cols:hi * cols]
        req = pb.PushPullRequest(worker_id=0, step=step, grads=[
            pb.TensorSlice(name="emb", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0, data=part.tobytes())])
        # A channel of its own: stopping the shard closes the job's.
        ch = self.job[b].channel()
        try:
            rows = np.full(part.size, np.nan, np.float32)
            for r in self.pbg.ParameterServerStub(ch).PushPull(iter([req]), timeout=60):
                for s in r.params:
                    v = np.frombuffer(s.data, "<f4")
                    rows[s.offset:s.offset + v.size] = v
            out[b] = ("ok", rows)
        except self.grpc.RpcError as e:
            out[b] = ("error", e.code(), e.details())
        finally:
            ch.close()

    def push_all(self, step, grad, blocks):
        out = {}
        th = [threading.Thread(target=self.push_block, args=(b, step, grad, out), name="push block %d" % b,
                         daemon=True) for b in blocks]
        for t in th:
            t.start()
        return th, out

    def block_state(self, b):
        """(version, rows) of shard b's block."""
        _, tensors = H.stats(self.job.stub(b))
        lo, hi = block_rows(b)
        got = {}
        for r in self.job.stub(b).Pull(self.pb.PullRequest(names=["emb"]), timeout=30):
            for s in r.params:
                v = np.frombuffer(s.data, "<f4")
                got[s.offset] = v
        rows = np.concatenate([got[k] for k in sorted(got)])
        self.assertEqual(rows.size, (hi - lo) * SHAPE[1])
        return tensors["emb"].version, rows

    def assertUntouched(self, b, p0):
        """Shard b's block still at version 0 with p0's rows: nothing applied."""
        version, rows = self.block_state(b)
        self.assertEqual(version, 0)
        lo, hi = block_rows(b)
        np.testing.assert_array_equal(rows, p0.reshape(-1)[lo * SHAPE[1]:hi * SHAPE[1]])

    def assertUnavailable(self, out, b, msg=None):
        """Block b's push failed UNAVAILABLE."""
        self.assertEqual(out[b][0], "error", msg or out[b])
        self.assertEqual(out[b][1], self.grpc.StatusCode.UNAVAILABLE, out[b])

    def assertRowsClose(self, b, rows, want):
        lo, hi = block_rows(b)
        w = want.reshape(-1)[lo * SHAPE[1]:hi * SHAPE[1]]
        np.testing.assert_allclose(rows, w, rtol=0, atol=2e-6 * np.abs(want).max())

    def test_kill_during_step_applies_nothing_then_recovers(self):
        rng = np.random.default_rng(12)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g1 = rng.standard_normal(SHAPE).astype(np.float32)
        g2 = rng.standard_normal(SHAPE).astype(np.float32)
        g3 = rng.standard_normal(SHAPE).astype(np.float32)
        row, col = np.zeros(SHAPE[0]), np.zeros(SHAPE[1])
        self.create(p0)

        # Step 0 on every block: the unsplit update.
        th, out = self.push_all(0, g1, range(SHARDS))
        H.join(th, "step 0's pushes")
        p1 = H.torch_adafactor_step(p0, g1, row, col, None, 1).astype(np.float32)
        for b in range(SHARDS):
            self.assertEqual(out[b][0], "ok", out[b])
            self.assertRowsClose(b, out[b][1], p1)
        for b in range(SHARDS):
            self.job.stub(b).Checkpoint(self.pb.CheckpointRequest(), timeout=60)

        # Step 1: blocks 0 and 1 wait for block 2's partials; shard 2 dies.
        before = [self.block_state(b) for b in (0, 1)]
        th, out = self.push_all(1, g2, [0, 1])
        time.sleep(0.5)  # both pushes at their shards, waiting for block 2
        self.job.kill(2)
        self.push_block(2, 1, g2, out)
        H.join(th, "step 1's pushes (shard 2 killed)")
        for b in range(SHARDS):
            self.assertEqual(out[b][0], "error", "block %d's push succeeded with its peer dead" % b)
            self.assertEqual(out[b][1], self.grpc.StatusCode.UNAVAILABLE, out[b])
        for b in (0, 1):
            self.assertIn("shard 2", out[b][2])
            version, rows = self.block_state(b)
            self.assertEqual(version, 1, "shard %d applied a step its peer never joined" % b)
            np.testing.assert_array_equal(rows, before[b][1])
            self.assertRowsClose(b, rows, p1)

        # Shard 2 back from its checkpoint: the next step (another batch's
        # gradient: the survivors must not hold on to the failed step's
        # partials) succeeds everywhere.
        self.job.restart(2)
        version, rows = self.block_state(2)
        self.assertEqual(version, 1)
        self.assertRowsClose(2, rows, p1)
        th, out = self.push_all(1, g3, range(SHARDS))
        H.join(th, "step 1's pushes after the restart")
        p2 = H.torch_adafactor_step(p1, g3, row, col, None, 2).astype(np.float32)
        for b in range(SHARDS):
            self.assertEqual(out[b][0], "ok", out[b])
            self.assertRowsClose(b, out[b][1], p2)
            self.assertEqual(self.block_state(b)[0], 2)


    def test_frozen_peer_then_retry(self):
        """A peer that stops answering mid-step (SIGSTOP): the waiting
        blocks fail UNAVAILABLE at the exchange deadline naming it, nothing
        is applied; once it runs again (SIGCONT) the retried step (the same
        gradient, as libfactorps retries with its push_id) succeeds on every
        block and equals the unsplit update."""
        rng = np.random.default_rng(13)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g1 = rng.standard_normal(SHAPE).astype(np.float32)
        row, col = np.zeros(SHAPE[0]), np.zeros(SHAPE[1])
        self.create(p0)
        self.job[2].proc.send_signal(signal.SIGSTOP)
        try:
            th, out = self.push_all(0, g1, [0, 1])
            H.join(th, "the pushes while shard 2 is frozen")
        finally:
            self.job[2].proc.send_signal(signal.SIGCONT)
        for b in (0, 1):
            self.assertUnavailable(out, b)
            self.assertIn("shard 2", out[b][2])
            self.assertUntouched(b, p0)
        th, out = self.push_all(0, g1, range(SHARDS))
        H.join(th, "the retried step's pushes")
        p1 = H.torch_adafactor_step(p0, g1, row, col, None, 1).astype(np.float32)
        for b in range(SHARDS):
            self.assertEqual(out[b][0], "ok", out[b])
            self.assertRowsClose(b, out[b][1], p1)
            self.assertEqual(self.block_state(b)[0], 1)

    def test_sigterm_with_a_step_waiting(self):
        """SIGTERM to a shard whose block's step waits for a peer: its push
        fails UNAVAILABLE, it exits 0 within the shutdown bound (as
        test_sigterm), and the peer whose step it was part of applies
        nothing."""
        rng = np.random.default_rng(14)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g1 = rng.standard_normal(SHAPE).astype(np.float32)
        self.create(p0)
        th, out = self.push_all(0, g1, [0, 1])
        time.sleep(0.5)  # both pushes at their shards, waiting for block 2
        t0 = time.monotonic()
        rc, _ = self.job[0].stop()
        took = time.monotonic() - t0
        self.assertEqual(rc, 0)
        self.assertLess(took, 5.0, "shard 0 took %.1f s to exit with a step waiting" % took)
        H.join(th, "the pushes around shard 0's SIGTERM")
        for b in (0, 1):
            self.assertUnavailable(out, b, "block %d's push succeeded without block 2" % b)
        self.assertUntouched(1, p0)

    def long_job(self):
        """The job again with a 30 s exchange deadline, so that a wait for
        the deadline cannot pass for a prompt failure."""
        self.job.stop()
        dirs = [os.path.join(self.dir, "long%d" % i) for i in range(SHARDS)]
        self.job = H.Job(SHARDS, "--mode", "sync", "--workers", 1, "--exchange-deadline", LONG_DEADLINE,
                         "--deadline", 60, shard_args=[["--checkpoint-dir", d] for d in dirs])

    def test_sigterm_before_its_step_begins(self):
        """SIGTERM to a shard holding a peer's partials for a step it has
        not begun (its own block's push has not come): it tells the
        waiting blocks (ABORT) before it stops its peer calls, so their
        pushes fail UNAVAILABLE at once, not at the exchange deadline, and
        nothing is applied. A long deadline here (30 s) tells the two apart;
        the ABORTs used to be cancelled unsent by the stop."""
        self.long_job()
        rng = np.random.default_rng(15)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g1 = rng.standard_normal(SHAPE).astype(np.float32)
        self.create(p0)
        th, out = self.push_all(0, g1, [1, 2])
        time.sleep(0.5)  # blocks 1 and 2 begun, their partials kept at shard 0
        t0 = time.monotonic()
        rc, _ = self.job[0].stop()
        self.assertEqual(rc, 0)
        H.join(th, "the pushes around shard 0's SIGTERM", 60)
        took = time.monotonic() - t0
        self.assertLess(took, 10.0, "the waiting blocks failed %.1f s after shard 0's SIGTERM (deadline 30 s)" %
                        took)
        for b in (1, 2):
            self.assertUnavailable(out, b, "block %d's push succeeded without block 0" % b)
            self.assertIn("shard 0 is shutting down", out[b][2])
            self.assertUntouched(b, p0)

    def test_sigterm_while_a_peer_is_gone(self):
        """SIGTERM to a shard whose step cannot reach a peer that is gone
        (SIGKILLed before the step): the stopping shard does not retry the
        unreachable peer until the exchange deadline; its push fails
        UNAVAILABLE and it exits 0 within seconds. Nothing is applied."""
        self.long_job()
        rng = np.random.default_rng(16)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g1 = rng.standard_normal(SHAPE).astype(np.float32)
        self.create(p0)
        self.job.kill(0)
        th, out = self.push_all(0, g1, [1])
        time.sleep(0.5)  # block 1 begun, its sends to shard 0 refused and retried
        t0 = time.monotonic()
        rc, _ = self.job[1].stop()
        took = time.monotonic() - t0
        self.assertEqual(rc, 0)
        self.assertLess(took, 10.0, "shard 1 took %.1f s to stop with shard 0 gone (deadline %d s)" %
                        (took, LONG_DEADLINE))
        H.join(th, "block 1's push around its shard's SIGTERM")
        self.assertUnavailable(out, 1, "block 1's push succeeded without block 0")
        self.job.restart(1)
        self.assertUntouched(1, p0)


if __name__ == "__main__":
    unittest.main()

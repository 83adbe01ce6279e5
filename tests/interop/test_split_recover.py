#!/usr/bin/python3
"""A split tensor comes back to one version by itself, in
the three ways the blocks used to be left apart:

- a block shard SIGKILLed and restarted from an older checkpoint (its
  block behind the others': refused forever before);
- SIGTERM to a block shard while its step waits for a peer: the step in
  flight finishes on every block (the stopping shard completes it before it
  stops) or fails on every block;
- three shards, one whose step failed (its exchange deadline passed) while
  another then received every partial: no block applies unless every block
  does (the COMMIT round of 3+ blocks).

Three shards in sync mode (one worker), each with its own --checkpoint-dir,
one [7, 5] torch tensor split into blocks of 2, 1 and 4 rows, driven block
by block with the grpcio client (fpsharness), as test_split_kill.py does.
Anchors (FACTORPS_SPLIT_ANCHOR_STEPS: a block's state kept on disk every N
versions, the same versions on every shard) every step here. The reference
is torch_adafactor_step (float64) on the whole tensor; tolerance 2e-6 of
the largest value."""
import os
import shutil
import tempfile
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [7, 5]
BOUNDS = [0, 2, 3, 7]
SHARDS = 3
AGREE_SECONDS = 15  # bound on the blocks coming back to one version


def block_rows(b):
    return BOUNDS[b], BOUNDS[b + 1]


class SplitRecover(unittest.TestCase):
    def start(self, shard_args=None, exchange_deadline=5):
        self.pb, self.pbg, self.grpc = H.stubs()
        self.dir = tempfile.mkdtemp(prefix="fps-split-recover-")
        dirs = [os.path.join(self.dir, "shard%d" % i) for i in range(SHARDS)]
        extra = shard_args or [[] for _ in range(SHARDS)]
        env = dict(os.environ, FACTORPS_SPLIT_ANCHOR_STEPS="1")
        self.job = H.Job(SHARDS, "--mode", "sync", "--workers", 1, "--exchange-deadline", exchange_deadline,
                         "--deadline", 30, env=env,
                         shard_args=[["--checkpoint-dir", d] + extra[i] for i, d in enumerate(dirs)])

    def tearDown(self):
        try:
            if getattr(self, "job", None):
                self.job.stop()
        finally:
            if getattr(self, "dir", None):
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
        pb = self.pb
        lo, hi = block_rows(b)
        cols = SHAPE[1]
        part = grad.reshape(-1)[lo * cols:hi * cols]
        req = pb.PushPullRequest(worker_id=0, step=step, grads=[
            pb.TensorSlice(name="emb", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0, data=part.tobytes())])
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
        th = [threading.Thread(target=self.push_block, args=(b, step, grad, out), daemon=True) for b in blocks]
        for t in th:
            t.start()
        return th, out

    def step_all(self, step, grad):
        th, out = self.push_all(step, grad, range(SHARDS))
        H.join(th, "step %d's pushes" % step)
        for b in range(SHARDS):
            self.assertEqual(out[b][0], "ok", out[b])
        return out

    def block_state(self, b):
        _, tensors = H.stats(self.job.stub(b))
        got = {}
        for r in self.job.stub(b).Pull(self.pb.PullRequest(names=["emb"]), timeout=30):
            for s in r.params:
                got[s.offset] = np.frombuffer(s.data, "<f4")
        return tensors["emb"].version, np.concatenate([got[k] for k in sorted(got)])

    def versions(self):
        return [H.stats(self.job.stub(b))[1]["emb"].version for b in range(SHARDS)]

    def wait_one_version(self):
        """The blocks' versions once they agree (polled, bounded)."""
        until = time.monotonic() + AGREE_SECONDS
        while True:
            v = self.versions()
            if len(set(v)) == 1:
                return v[0]
            if time.monotonic() > until:
                self.fail("the blocks stayed at versions %s for %d s" % (v, AGREE_SECONDS))
            time.sleep(0.1)

    def assertRowsClose(self, b, rows, want):
        lo, hi = block_rows(b)
        w = want.reshape(-1)[lo * SHAPE[1]:hi * SHAPE[1]]
        np.testing.assert_allclose(rows, w, rtol=0, atol=2e-6 * np.abs(want).max())

    def replay(self, p0, grads):
        row, col = np.zeros(SHAPE[0]), np.zeros(SHAPE[1])
        p = p0
        for i, g in enumerate(grads):
            p = H.torch_adafactor_step(p, g, row, col, None, i + 1).astype(np.float32)
        return p

    def test_restart_behind_comes_back_to_one_version(self):
        """SIGKILL of a block shard whose checkpoint is 3 steps old: it
        restarts behind the others and the blocks agree again by themselves
        (here on the newest version every block still holds: 5), with the
        parameters of that version; the next step succeeds everywhere."""
        self.start()
        rng = np.random.default_rng(21)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(6)]
        self.create(p0)
        for s in range(2):
            self.step_all(s, grads[s])
        self.job.stub(1).Checkpoint(self.pb.CheckpointRequest(), timeout=60)
        for s in range(2, 5):
            self.step_all(s, grads[s])
        self.assertEqual(self.versions(), [5, 5, 5])
        self.job.kill(1)
        self.job.restart(1)
        v = self.wait_one_version()
        self.assertEqual(v, 5, "the job went back further than the newest version every block holds")
        want = self.replay(p0, grads[:v])
        for b in range(SHARDS):
            self.assertRowsClose(b, self.block_state(b)[1], want)
        self.step_all(v, grads[5])
        want = self.replay(p0, grads[:v] + [grads[5]])
        for b in range(SHARDS):
            version, rows = self.block_state(b)
            self.assertEqual(version, v + 1)
            self.assertRowsClose(b, rows, want)

    def send_versions(self, to, frm, versions, stamp):
        """shard `frm`'s VERSIONS list of its block, as its peer sends it."""
        pb = self.pb
        self.job.stub(to).Exchange(pb.ExchangeRequest(
            name="emb", version=versions[0], from_shard=frm, shard_count=SHARDS, block_index=frm,
            phase=pb.EXCHANGE_PHASE_VERSIONS, partials=b"".join(v.to_bytes(8, "little") for v in versions),
            stamp=stamp), timeout=10)

    def start_at_version_4(self, seed):
        """A new job whose split tensor took 4 steps on every block; the
        generator its gradients came from, for the next ones."""
        self.start()
        rng = np.random.default_rng(seed)
        self.create(rng.standard_normal(SHAPE).astype(np.float32))
        for s in range(4):
            self.step_all(s, rng.standard_normal(SHAPE).astype(np.float32))
        self.assertEqual(self.versions(), [4, 4, 4])
        return rng

    def test_late_versions_list_moves_nothing(self):
        """The lists of versions the blocks send each other in a recovery
        carry their sender's clock. A list made before its sender's latest
        step message (it was on its way while the blocks agreed and stepped
        on) is out of date and moves nothing; the same lists made later
        move the block back. Before the stamps, a late list from an earlier
        recovery moved a block back alone and the job stopped (CI, 2026-12-02)."""
        rng = self.start_at_version_4(5)
        for frm in (1, 2):  # made long before their step messages
            self.send_versions(0, frm, [2], stamp=1)
        time.sleep(1.0)
        self.assertEqual(self.versions(), [4, 4, 4], "an out-of-date list moved a block")
        self.assertEqual(H.stats(self.job.stub(0))[1]["emb"].split_lost_steps, 0)
        now = time.time_ns() + 10**9
        for frm in (1, 2):  # the same lists, made now: shard 0 goes back to 2
            self.send_versions(0, frm, [2], stamp=now)
        until = time.monotonic() + AGREE_SECONDS
        while H.stats(self.job.stub(0))[1]["emb"].split_lost_steps < 2:
            self.assertLess(time.monotonic(), until, "shard 0 never moved to the version of the lists")
            time.sleep(0.05)
        # The others' true lists, made later still: its own anchors hold 4,
        # as theirs do, so it moves forward to 4 (whatever order the lists
        # came in), and the next step succeeds everywhere.
        for frm in (1, 2):
            self.send_versions(0, frm, [4, 3, 2], stamp=now + 10**9)
        self.assertEqual(self.wait_one_version(), 4)
        self.step_all(4, rng.standard_normal(SHAPE).astype(np.float32))
        self.assertEqual(self.versions(), [5, 5, 5])

    def test_far_future_stamp_holds_lists_back_briefly(self):
        """A list stamped far in the future (a forged Exchange, or a peer
        whose clock jumped) counts as at most 10 s past the receiver's
        clock: the block's true lists, stamped now, count again within
        that, and the blocks come back to one version. Unbounded, the
        forged stamp made every later list of that block look out of date
        and kept the blocks apart for good."""
        rng = self.start_at_version_4(6)
        self.send_versions(0, 1, [4], stamp=2**63)  # forged: block 1 holds only 4
        # A recovery to version 2, as blocks 1 and 2 would announce it, the
        # announcements repeated as the shards repeat theirs.
        t0 = time.monotonic()
        while H.stats(self.job.stub(0))[1]["emb"].split_lost_steps < 2:
            self.assertLess(time.monotonic() - t0, 10 + AGREE_SECONDS,
                            "block 0 never took block 1's lists after a far-future stamp")
            for frm in (1, 2):
                self.send_versions(0, frm, [2], stamp=time.time_ns())
            time.sleep(0.5)
        print("block 0 moved to the lists' version %.1f s after the far-future stamp" % (time.monotonic() - t0))
        stamp = time.time_ns() + 10**9
        for frm in (1, 2):
            self.send_versions(0, frm, [4, 3, 2], stamp=stamp)
        self.assertEqual(self.wait_one_version(), 4)
        self.step_all(4, rng.standard_normal(SHAPE).astype(np.float32))
        self.assertEqual(self.versions(), [5, 5, 5])

    def test_sigterm_mid_exchange_finishes_everywhere(self):
        """SIGTERM to shard 1 while its block's step waits for block 2's
        partials, which come 0.5 s later: the step finishes (or fails) on
        every block alike, shard 1 exits 0, and restarted from its final
        checkpoint it is at the other blocks' version."""
        self.start()
        rng = np.random.default_rng(22)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g = rng.standard_normal(SHAPE).astype(np.float32)
        self.create(p0)
        th, out = self.push_all(0, g, [0, 1])
        time.sleep(0.5)  # blocks 0 and 1 wait for block 2
        stopped = {}
        st = threading.Thread(target=lambda: stopped.setdefault("rc", self.job[1].stop()[0]), daemon=True)
        st.start()
        time.sleep(0.5)
        self.push_block(2, 0, g, out)
        H.join(th + [st], "the pushes around shard 1's SIGTERM")
        self.assertEqual(stopped.get("rc"), 0)
        kinds = [out[b][0] for b in range(SHARDS)]
        self.assertEqual(len(set(kinds)), 1, "the step applied on some blocks only: %s" % out)
        self.job.restart(1)
        self.assertEqual(len(set(self.versions())), 1, "versions %s after the restart" % self.versions())
        v = self.versions()[0]
        want = self.replay(p0, [g][:v])
        for b in range(SHARDS):
            self.assertRowsClose(b, self.block_state(b)[1], want)

    def test_three_shards_no_apply_after_a_refusal(self):
        """Shard 1's step fails at its exchange deadline (1 s) while shards
        0 and 2 wait longer (4 s); block 2 is pushed after that: block 0
        then holds every partial and every acknowledgement but must not
        apply (no block applies unless every block does: shard 1 never
        commits). The retry then succeeds everywhere."""
        self.start(shard_args=[[], ["--exchange-deadline", 1], []], exchange_deadline=4)
        rng = np.random.default_rng(23)
        p0 = rng.standard_normal(SHAPE).astype(np.float32)
        g = rng.standard_normal(SHAPE).astype(np.float32)
        self.create(p0)
        th, out = self.push_all(0, g, [0, 1])
        time.sleep(2.0)  # shard 1's exchange deadline has passed
        self.push_block(2, 0, g, out)
        H.join(th, "the pushes of the step shard 1 abandoned")
        self.assertEqual(out[1][0], "error", out[1])
        self.assertEqual(out[2][0], "error", out[2])
        self.assertEqual(out[0][0], "error", "block 0 applied a step blocks 1 and 2 failed: %s" % (out[0],))
        self.assertEqual(self.wait_one_version(), 0)
        self.step_all(0, g)
        want = self.replay(p0, [g])
        for b in range(SHARDS):
            version, rows = self.block_state(b)
            self.assertEqual(version, 1)
            self.assertRowsClose(b, rows, want)


if __name__ == "__main__":
    unittest.main()

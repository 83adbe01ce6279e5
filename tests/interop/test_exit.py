#!/usr/bin/python3
"""Exit codes docs/shards.md promises: SIGTERM exits 1 when the final checkpoint
cannot be written (the last updates are not on disk), 0 when there is
nothing to write."""
import os
import shutil
import signal
import tempfile
import time
import unittest

import numpy as np

import fpsharness as H


class FinalCheckpoint(unittest.TestCase):
    def run_shard(self, create, break_dir):
        H.stubs()
        root = tempfile.mkdtemp(prefix="fps-exit-")
        ck = os.path.join(root, "ck")
        srv = H.Server("--mode", "async", "--checkpoint-dir", ck)
        try:
            if create:
                H.create(srv.stub, "w", [4], np.zeros(4, np.float32))
                H.push(srv.stub, 0, 0, {"w": ([4], np.ones(4, np.float32))})
            if break_dir:
                shutil.rmtree(ck)  # the shard's lease fd stays, the directory is gone
            srv._channel.close() if srv._channel else None
            srv.proc.send_signal(signal.SIGTERM)
            rc = srv.proc.wait(timeout=60)
            return rc, srv.stderr()
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()
            srv.proc.stdout.close()
            srv.log.close()
            shutil.rmtree(srv.dir, True)
            shutil.rmtree(root, True)

    def test_sigterm_exit_codes(self):
        rc, err = self.run_shard(create=True, break_dir=True)
        self.assertEqual(rc, 1, err)
        self.assertIn("checkpoint", err)
        self.assertNotIn("stopped cleanly", err)
        rc, err = self.run_shard(create=True, break_dir=False)
        self.assertEqual(rc, 0, err)
        rc, err = self.run_shard(create=False, break_dir=False)  # nothing to write
        self.assertEqual(rc, 0, err)


class UnchangedCheckpoint(unittest.TestCase):
    """A checkpoint is written only when the state changed since the newest
    one this process wrote or loaded: SIGTERM does not rewrite an unchanged
    shard, and the periodic writer notices every change, a replace too."""

    def setUp(self):
        self.pb, _, _ = H.stubs()
        self.root = tempfile.mkdtemp(prefix="fps-unchanged-")
        self.ck = os.path.join(self.root, "ck")
        self.srv = None

    def tearDown(self):
        if self.srv and self.srv.proc.poll() is None:
            self.srv.proc.kill()
            self.srv.proc.wait()
        shutil.rmtree(self.root, True)

    def files(self):
        return sorted(f for f in os.listdir(self.ck) if f.endswith(".safetensors"))

    def start(self, *args):
        self.srv = H.Server("--mode", "async", "--checkpoint-dir", self.ck, *args)
        return self.srv

    def sigterm(self):
        self.srv.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.srv.proc.wait(timeout=60), 0, self.srv.stderr())
        return self.srv.stderr()

    def test_sigterm_skips_an_unchanged_shard(self):
        srv = self.start()
        H.create(srv.stub, "w", [4], np.zeros(4, np.float32))
        H.push(srv.stub, 0, 0, {"w": ([4], np.ones(4, np.float32))})
        srv.stub.Checkpoint(self.pb.CheckpointRequest(), timeout=60)
        self.assertEqual(len(self.files()), 1)
        err = self.sigterm()
        self.assertIn("nothing changed since", err)
        self.assertEqual(len(self.files()), 1)
        # Restored and left alone: still nothing to write.
        srv = self.start()
        err = self.sigterm()
        self.assertIn("nothing changed since", err)
        self.assertEqual(len(self.files()), 1)
        # Restored, and the workers' matching re-Create (as every worker
        # sends on start, the values ignored): still nothing to write.
        srv = self.start()
        r = H.create(srv.stub, "w", [4], np.full(4, 9, np.float32))
        self.assertEqual((r.tensors[0].created, r.tensors[0].version), (False, 1))
        err = self.sigterm()
        self.assertIn("nothing changed since", err)
        self.assertEqual(len(self.files()), 1)
        # One update after the restore: the final checkpoint holds it.
        srv = self.start()
        H.push(srv.stub, 0, 1, {"w": ([4], np.ones(4, np.float32))})
        err = self.sigterm()
        self.assertNotIn("nothing changed since", err)
        self.assertEqual(len(self.files()), 2)
        srv = self.start()
        _, ver = H.pull(srv.stub, {"w": [4]})
        self.assertEqual(ver["w"], 2)

    def test_periodic_checkpoint_sees_a_replace(self):
        # A replace changes params and version without an update: the
        # periodic writer must still write it (a crash then restores it).
        srv = self.start("--checkpoint-interval", "0.2")
        H.create(srv.stub, "w", [4], np.zeros(4, np.float32))
        H.push(srv.stub, 0, 0, {"w": ([4], np.ones(4, np.float32))})
        deadline = time.time() + 30
        while not self.files() and time.time() < deadline:
            time.sleep(0.05)
        self.assertTrue(self.files(), "no periodic checkpoint")
        n = len(self.files())
        new = np.full(4, 0.25, np.float32)
        sl = self.pb.TensorSlice(dtype=self.pb.DTYPE_F32, offset=0, data=new.tobytes())
        srv.stub.Create(self.pb.CreateRequest(shard_id=0, shard_count=1, tensors=[self.pb.TensorCreate(
            name="w", shape=[4], optimizer=H.optimizer(), init=sl, replace=True)]), timeout=60)
        while len(self.files()) == n and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let a write in progress finish
        srv.proc.kill()  # no final checkpoint: only the periodic one counts
        srv.proc.wait()
        srv = self.start()
        got, ver = H.pull(srv.stub, {"w": [4]})
        self.assertEqual(ver["w"], 0)
        np.testing.assert_array_equal(got["w"], new)


if __name__ == "__main__":
    unittest.main()

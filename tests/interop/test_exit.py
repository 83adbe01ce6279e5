#!/usr/bin/python3
"""Exit codes the README promises: SIGTERM exits 1 when the final checkpoint
cannot be written (the last updates are not on disk), 0 when there is
nothing to write."""
import os
import shutil
import signal
import tempfile
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


if __name__ == "__main__":
    unittest.main()

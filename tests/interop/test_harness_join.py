#!/usr/bin/python3
"""fpsharness.join, which the split tests use for their push threads: a
thread that never ends fails the test within the bound, naming what it was
for and printing every thread's stack (where it waits), instead of leaving
the test to CTest's TIMEOUT without a word; threads that end are joined."""
import sys
import tempfile
import threading
import time
import unittest

import fpsharness as H


class HarnessJoin(unittest.TestCase):
    def test_finished_threads_are_joined(self):
        th = [threading.Thread(target=time.sleep, args=(0.05,), daemon=True) for _ in range(3)]
        for t in th:
            t.start()
        H.join(th, "sleepers", seconds=30)
        self.assertFalse(any(t.is_alive() for t in th))

    def test_hung_thread_fails_with_its_stack(self):
        never = threading.Event()

        def wait_for_good():
            never.wait()
        t = threading.Thread(target=wait_for_good, name="push block 7", daemon=True)
        t.start()
        err = sys.stderr
        try:
            with tempfile.TemporaryFile("w+") as f:
                sys.stderr = f
                with self.assertRaises(AssertionError) as cm:
                    H.join([t], "the probe's pushes", seconds=0.3)
                sys.stderr = err
                f.seek(0)
                stacks = f.read()
        finally:
            sys.stderr = err
            never.set()
            t.join()
        self.assertIn("the probe's pushes: thread(s) push block 7 did not finish within 0.3 s", str(cm.exception))
        self.assertIn("push block 7 still running", stacks)
        self.assertIn("wait_for_good", stacks)  # the hung thread's own frame


if __name__ == "__main__":
    unittest.main()

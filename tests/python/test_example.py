"""The demo's worker script (client/python/examples/train_digits.py) runs
end to end: 2 workers against 2 sync shards, one epoch, report printed.
(How fast and how accurate the full demo is belongs to scripts/demo.sh, not
to a test.)"""

import os
import subprocess
import sys
import unittest

import _support
from _support import Shards, need_server

SCRIPT = os.path.join(_support.REPO, "client", "python", "examples", "train_digits.py")


@need_server
class ExampleTest(unittest.TestCase):
    def test_two_workers_one_epoch(self):
        with Shards(2, workers=2) as shards:
            cmd = [sys.executable, SCRIPT, "--shards", ",".join(shards.addrs), "--workers", "2",
                   "--epochs", "1", "--min-accuracy", "0", "--deadline", "30"]
            procs = [subprocess.Popen(cmd + ["--worker-id", str(w)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for w in range(2)]
            outs = []
            try:
                for p in procs:
                    outs.append(p.communicate(timeout=120)[0])
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            for p, out in zip(procs, outs):
                self.assertEqual(p.returncode, 0, out)
            lead = outs[0]
            for needle in ("epoch   1/1", "held-out accuracy", "Adafactor state",
                           "AdamW would keep", "fc1.w", "p50 ms", "final held-out accuracy"):
                self.assertIn(needle, lead)
            self.assertEqual(outs[1].strip(), "")  # only worker 0 reports


if __name__ == "__main__":
    unittest.main()

"""The old primary rejoins as the standby while training runs:
kill the primary, let the standby take over and training go on, start
the old primary again: it takes a state transfer from the new primary
while the workers keep pushing, joins, and afterwards both replicas hold
the same bits (per-tensor version and checksum) and every acknowledged
push is applied once. The new primary's term is above the old one's."""
import unittest

from _common import SEED, report, wait_in_sync
from _replica import Pair, one_acknowledger


class RejoinTest(unittest.TestCase):
    def test_old_primary_rejoins_as_standby(self):
        pair = Pair("async")
        self.addCleanup(pair.close)
        pair.start_workers(seed=SEED)
        pair.wait_progress(5, 60, "training to start")
        pair.wait(lambda: pair.joined(0), 30, "replica 1 to join")
        term0 = pair.last(0)["term"]
        pair.kill(0)
        pair.wait(lambda: pair.role(1) == "primary", 10, "replica 1 promoted")
        pair.wait_progress(20, 60, "training on replica 1")
        pair.start(0)
        pair.wait(lambda: pair.role(0) == "standby", 20, "replica 0 back as a standby")
        pair.wait(lambda: pair.joined(1), 60, "replica 0 to join while training runs")
        pair.wait_progress(20, 60, "training with the rejoined standby")
        self.assertEqual(pair.role(0), "standby")
        self.assertGreater(pair.last(1)["term"], term0)
        pair.stop_workers()
        acked = sum(len(pair.acks(w)) for w in range(pair.workers))
        a, b = wait_in_sync(self, pair)
        for name, (version, _) in b["tensors"].items():
            self.assertEqual(version, acked, name)
        self.assertEqual(one_acknowledger([pair.samples(0), pair.samples(1)]), [])
        report("rejoin", pushes=acked, checksums="equal")


if __name__ == "__main__":
    unittest.main()

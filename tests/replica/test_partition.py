"""Partitions, in network namespaces this test creates (root
only): the two replicas and the workers each in their own namespace,
joined by veth links (_replica.Topology) that are cut by taking them
down, 2-worker sync training throughout:
- primary from standby (link ab): the primary drops its standby and
  trains on alone (the standby cannot take the lease the primary holds);
  after the heal the standby rejoins;
- workers from primary (their link to it): nothing is acknowledged while
  cut (the primary holds the lease, the standby refuses), the workers
  retry each push under its key, and training goes on after the heal.
Each CUTS times (FPS_REPLICA_FULL=1: 10). Afterwards: never two processes
acknowledging for the shard (every replica's role and term over time),
every push acknowledged once and applied once (versions), parameters bit
for bit those of an uninterrupted run, and both replicas equal."""
import os
import random
import time
import unittest

import numpy as np

from _common import (CUTS, SEED, check_bit_identical, check_sync_acks, reference_run, report,
                     summary, wait_in_sync)
from _replica import Pair, Topology, is_root, one_acknowledger, stall_after


@unittest.skipUnless(is_root(), "network namespaces need root")
class PartitionTest(unittest.TestCase):
    def run_cuts(self, which):
        topo = Topology()
        self.addCleanup(topo.close)
        pair = Pair("sync", topo=topo)
        self.addCleanup(pair.close)
        final = os.path.join(pair.dir, "final.npz")
        pair.start_workers(seed=SEED, final=final, deadline=3.0)
        pair.wait_progress(3, 60, "training to start")
        rng = random.Random(3)
        heal_waits, cut_stalls = [], []
        for k in range(CUTS):
            p = pair.primary()
            self.assertIsNotNone(p, "no single primary before cut %d" % k)
            pair.wait(lambda: pair.joined(p), 60, "the standby to join (cut %d)" % k)
            pair.wait_progress(2, 60)
            link = "ab" if which == "standby" else "wa" if p == 0 else "wb"
            time.sleep(rng.uniform(0.0, 0.15))
            topo.cut(link)
            t_cut = time.monotonic()  # down once `ip` returned (it may take a while to start)
            try:
                if which == "standby":
                    pair.wait_progress(3, 60, "training without the standby (cut %d)" % k)
                else:
                    time.sleep(1.0)
            finally:
                t = time.monotonic()
                topo.heal(link)
            if which == "standby":
                # How long the primary held its acknowledgements before it
                # dropped the unreachable standby and went on alone.
                cut_stalls.append(stall_after([pair.acks(w) for w in range(pair.workers)], t_cut,
                                              t - t_cut))
            if which == "workers":
                # Cut off from the primary, the workers reach only the
                # standby, which must acknowledge nothing.
                during = [a for w in range(pair.workers) for a in pair.acks(w)
                          if t_cut + 0.1 < a["t"] < t]
                if during:
                    self.fail("cut %d (link %s, %.3f..%.3f): %d pushes acknowledged while cut "
                              "from the primary, the first at %.3f: %s" %
                              (k, link, t_cut, t, len(during), during[0]["t"], during[0]))
            pair.wait_progress(2, 60, "training after the heal (cut %d)" % k)
            heal_waits.append(time.monotonic() - t)
            self.assertEqual(pair.primary(), p, "the primary changed during cut %d" % k)
        pair.wait(lambda: pair.joined(pair.primary() or 0), 60, "the standby to join at the end")
        steps = pair.stop_workers()
        steps = check_sync_acks(self, pair, steps)
        with np.load(final) as z:
            got = {k: z[k].copy() for k in z.files}
        check_bit_identical(self, got, reference_run("sync", 2, steps))
        wait_in_sync(self, pair)
        self.assertEqual(one_acknowledger([pair.samples(0), pair.samples(1)]), [])
        extra = {"stall_when_cut": summary(cut_stalls).replace(" ", "_")} if cut_stalls else {}
        report("partition_" + which, cuts=CUTS, steps=steps,
               training_again_after_heal="max_%.3f_s" % max(heal_waits), **extra)

    def test_primary_from_standby(self):
        self.run_cuts("standby")

    def test_workers_from_primary(self):
        self.run_cuts("workers")


if __name__ == "__main__":
    unittest.main()

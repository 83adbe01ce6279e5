"""A standby the primary dropped never takes over with an older state
silently (the lead's hole in the safety argument, 08:15): the primary
loses its standby (SIGSTOP: the stream stalls, the primary drops it and
goes on acknowledging alone), then the primary is SIGKILLed and the
standby resumes. The lease is free and the standby holds less than what
was acknowledged. It may stay out of service (never primary: nothing
acknowledged), or take over holding every acknowledged version, or take
over with the older state and say so: the lease recorded that the old
primary answered alone, and the promoted process counts an unclean
promotion (factorps_replica_unclean_promotions_total, docs/shards.md).
And a clean failover counts no unclean promotion."""
import signal
import time
import unittest

from _common import SEED, report
from _replica import Pair


class StaleStandbyTest(unittest.TestCase):
    def test_dropped_standby_never_takes_over_silently(self):
        pair = Pair("sync")
        self.addCleanup(pair.close)
        pair.start_workers(seed=SEED)
        pair.wait_progress(5, 60, "training to start")
        p = pair.primary()
        self.assertIsNotNone(p)
        s = 1 - p
        pair.wait(lambda: pair.joined(p), 30, "the standby to join")
        standby = pair.procs[s].proc
        standby.send_signal(signal.SIGSTOP)
        try:
            # The primary drops the silent standby and acknowledges alone.
            pair.wait(lambda: (pair.last(p) or {}).get("joined") == 0 and
                      pair.role(p) == "primary", 30, "the primary to drop its standby")
            pair.wait_progress(5, 60, "the primary to acknowledge alone")
            acked = max(v for w in range(pair.workers) for a in pair.acks(w)
                        for v in a["v"].values())
            t_kill = pair.kill(p)
        finally:
            standby.send_signal(signal.SIGCONT)
        # Watch what the standby does for a while.
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            time.sleep(0.05)
        promoted = [x for x in pair.samples(s) if x["t"] > t_kill and x.get("role") == "primary"]
        after = [a for w in range(pair.workers) for a in pair.acks(w) if a["t"] > t_kill + 0.1]
        unclean = pair.metric(s, "factorps_replica_unclean_promotions_total")
        older = {}
        if promoted:
            older = {n: v[0] for n, v in promoted[0]["tensors"].items() if v[0] < acked}
            if older:
                self.assertGreaterEqual(unclean or 0, 1, "replica %d took over with tensors %s "
                                        "older than version %d, which the workers were "
                                        "acknowledged, and did not say so" % (s, older, acked))
            else:
                for a in after:
                    for n, v in a["v"].items():
                        self.assertGreater(v, acked, "after the takeover tensor %s was "
                                           "acknowledged at version %d, at or below %d "
                                           "acknowledged before" % (n, v, acked))
        else:
            self.assertEqual(after, [], "acknowledged with no primary")
        report("stale_standby", acked_before_kill=acked,
               standby=("stayed_out_of_service" if not promoted else
                        "promoted_with_older_state_and_said_so" if older else "promoted_whole"),
               unclean_promotions=unclean)

    def test_clean_failover_is_not_flagged(self):
        # The counter must not cry wolf: a failover from a joined standby
        # holds everything acknowledged and counts nothing.
        pair = Pair("sync")
        self.addCleanup(pair.close)
        pair.start_workers(seed=SEED)
        pair.wait_progress(5, 60, "training to start")
        p = pair.primary()
        self.assertIsNotNone(p)
        pair.wait(lambda: pair.joined(p), 30, "the standby to join")
        pair.wait_progress(5, 60)
        pair.kill(p)
        pair.wait(lambda: pair.role(1 - p) == "primary", 10, "the standby promoted")
        pair.wait_progress(5, 60, "training after the failover")
        self.assertEqual(pair.metric(1 - p, "factorps_replica_unclean_promotions_total"), 0)


if __name__ == "__main__":
    unittest.main()

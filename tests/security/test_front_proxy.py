"""Rapid reset and slow headers through the front proxy of the deploy files
(nghttpx from Debian 12's nghttp2-proxy, deploy/proxy/nghttpx.conf).

Debian's gRPC 1.51 has no defence against rapid reset: the same floods
straight at a shard grow it past 1 GiB within seconds and leave it at its
call limit, answering nothing (tests/bench/h2_flood.py without --proxy;
docs/operations.md, Security). Through the proxy the shard must stay
within a small bound of its undisturbed memory and keep serving a
concurrent worker through every phase. Loopback only, bounded phases
(FPS_FLOOD_PHASE seconds each, default 2, a phase stretched up to 8 times
that until the worker has had 5 pushes in it)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
sys.path.insert(0, os.path.dirname(HERE))

import fpsproxy  # noqa: E402
import h2_flood  # noqa: E402

PHASE = float(os.environ.get("FPS_FLOOD_PHASE", "2"))
# The documented bound (docs/operations.md): the shard's peak RSS grows by
# less than this over its undisturbed run while the floods go on.
RSS_BOUND = int((16 << 20) * float(os.environ.get("FPS_RSS_BOUND_SCALE", "1")))


@unittest.skipUnless(fpsproxy.available(), "nghttpx missing: scripts/deps.sh installs nghttp2-proxy")
class FrontProxy(unittest.TestCase):
    def test_floods_through_the_proxy_leave_the_shard_serving(self):
        res = h2_flood.measure(PHASE, proxy=True, min_pushes=5)
        text = h2_flood.report(res)
        print(text)
        self.assertEqual(res["errors"], [], text)
        # The floods really ran: 500+ half-open streams, 10k+ resets.
        self.assertGreaterEqual(res["sent"]["slow_headers"][0], 100, text)
        self.assertGreaterEqual(res["sent"]["rapid_reset"][0], 10000, text)
        for name in h2_flood.PHASES:
            # The worker is served in every phase (straight at the shard,
            # it gets one push through in the rapid-reset phase and none
            # after).
            self.assertGreaterEqual(len(res["lat"].get(name, [])), 5, name + "\n" + text)
            self.assertLess(h2_flood.pct(res["lat"][name], 0.99), 5.0, name + "\n" + text)
        self.assertLess(res["rss1"] - res["rss0"], RSS_BOUND, text)
        self.assertTrue(res["answer"].startswith("version of w = "), text)


if __name__ == "__main__":
    unittest.main()

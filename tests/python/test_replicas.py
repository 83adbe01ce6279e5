"""Shard entries that list replicas ("a:p|b:p", standby replicas) go through the
Python package, factorps.torch ($FACTORPS_SHARDS) and the CLI untouched:
libfactorps reads them. Each entry here lists a port nothing listens on
first and a real shard next, so a call only succeeds if the whole entry
reached libfactorps and it went on to the second replica. The failover
between real primary and standby processes is tests/replica/."""

import json
import os
import shutil
import subprocess
import tempfile
import time
import unittest
from unittest import mock

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, free_ports, fpsproc, need_server
import factorps
from factorps.errors import InvalidArgumentError
from factorps.torch import RemoteAdafactor

CLI = os.environ.get("FACTORPS_CLI", "")  # ctest sets it


def _entries(addrs):
    """Each shard's entry: a dead replica, then the real one."""
    dead = free_ports(len(addrs))
    return ["127.0.0.1:%d|%s" % (p, a) for p, a in zip(dead, addrs)]


@need_server
class ReplicaEntryTest(unittest.TestCase):
    def setUp(self):
        self.shards = Shards(2, mode="async")
        self.addCleanup(self.shards.close)
        self.entries = _entries(self.shards.addrs)

    def check_client(self, shards_arg):
        c = factorps.connect(shards_arg, deadline=20, max_retries=0)
        self.addCleanup(c.close)
        self.assertEqual(c.shard_count, 2)
        self.assertEqual(c.shards, self.entries)
        specs = [factorps.TensorSpec("a", (8, 4), np.ones((8, 4), np.float32)),
                 factorps.TensorSpec("b", (16,), np.ones(16, np.float32))]
        c.create(specs)
        self.assertEqual({c.shard_of("a"), c.shard_of("b")}, {0, 1})
        _, versions = c.push_pull({"a": np.ones((8, 4), np.float32), "b": np.ones(16, np.float32)})
        self.assertEqual(versions, {"a": 1, "b": 1})
        stats = c.stats()
        self.assertEqual([s["updates"] for s in stats], [1, 1])

    def test_list_of_entries(self):
        self.check_client(self.entries)

    def test_comma_separated_string(self):
        self.check_client(",".join(self.entries))

    def test_push_id_retry_is_applied_once(self):
        # What a worker does after a push raised with its outcome unknown
        # (tests/replica's partitions): the same key again is not applied
        # twice, whichever replica answers.
        c = factorps.connect(self.entries, deadline=20, max_retries=0)
        self.addCleanup(c.close)
        c.create([factorps.TensorSpec("a", (8, 4), np.ones((8, 4), np.float32))])
        g = {"a": np.full((8, 4), 0.5, np.float32)}
        p1, v1 = c.push_pull(g, push_id=12345)
        p2, v2 = c.push_pull(g, push_id=12345)
        self.assertEqual((v1, v2), ({"a": 1}, {"a": 1}))
        np.testing.assert_array_equal(p1["a"], p2["a"])
        _, v3 = c.push_pull(g)
        self.assertEqual(v3, {"a": 2})
        with self.assertRaisesRegex(InvalidArgumentError, "push_id"):
            c.push_pull(g, push_id=0)

    def test_bad_entry_names_it(self):
        with self.assertRaisesRegex(InvalidArgumentError, r"shard 1: address 'x:1\|x:1' lists "
                                                          r"replica 'x:1' twice"):
            factorps.connect([self.shards.addrs[0], "x:1|x:1"])

    @unittest.skipUnless(CLI, "FACTORPS_CLI not set (run through ctest)")
    def test_cli_bad_entry_is_a_usage_error(self):
        # Exit 2 like any bad flag (it was 1, as for a shard that is down).
        for entry in ("|", "x:1|x:1"):
            r = subprocess.run([CLI, "stats", "--shards", entry], capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("factorps stats: INVALID_ARGUMENT: shard 0: address", r.stderr)

    def test_torch_from_the_environment(self):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["FACTORPS_SHARDS"] = ",".join(self.entries)
        with mock.patch.dict(os.environ, env, clear=True):
            p = torch.nn.Parameter(torch.ones(3, 2))
            opt = RemoteAdafactor([("p", p)], deadline=20, mode="async")
            try:
                self.assertEqual(opt.client.shards, self.entries)
                for _ in range(2):
                    p.grad = torch.ones(3, 2)
                    opt.step()
                self.assertEqual(opt.remote_step, 2)
            finally:
                opt.close()

    @unittest.skipUnless(CLI, "FACTORPS_CLI not set (run through ctest)")
    def test_cli_stats(self):
        out = subprocess.run([CLI, "stats", "--json", "--deadline", "20", "--shards",
                              ",".join(self.entries)], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        doc = json.loads(out.stdout)
        self.assertEqual([s["address"] for s in doc["shards"]], self.entries)
        self.assertEqual([s["shard_id"] for s in doc["shards"]], [0, 1])


@need_server
class ReplicaStatsTest(unittest.TestCase):
    """A real primary and standby (--replica-peer, --lease file:): the
    entry lists the standby first; calls end at the primary, and Stats
    says who answered, its role, term and standby, and the checksums."""

    def start(self, i, ports, lease):
        sp = fpsproc.ShardProcess(
            ["--shard-id", "0", "--shard-count", "1", "--mode", "async", "--log-level", "warn",
             "--replica-peer", "127.0.0.1:%d" % ports[1 - i], "--lease", "file:" + lease],
            listen="127.0.0.1:%d" % ports[i], dir=self.dir, name="r%d" % i, die_with_parent=True)
        self.addCleanup(sp.kill)
        return sp

    def wait_role(self, addr, role, joined=None):
        c = factorps.connect([addr], deadline=5, max_retries=0)
        try:
            end = time.monotonic() + 20
            while True:
                s = c.stats()[0]
                if s["replica_role"] == role and (joined is None or s["standby_joined"] == joined):
                    return s
                if time.monotonic() > end:
                    self.fail("%s is %s (joined %s), not %s" % (addr, s["replica_role"],
                                                               s["standby_joined"], role))
                time.sleep(0.02)
        finally:
            c.close()

    def test_stats_of_a_replicated_shard(self):
        self.dir = tempfile.mkdtemp(prefix="fps-pyreplica-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        ports = free_ports(2)
        lease = os.path.join(self.dir, "lease")
        addrs = ["127.0.0.1:%d" % p for p in ports]
        self.start(0, ports, lease)
        self.wait_role(addrs[0], "primary")
        self.start(1, ports, lease)
        self.wait_role(addrs[0], "primary", joined=1)
        c = factorps.connect(addrs[1] + "|" + addrs[0], deadline=20, max_retries=0)
        self.addCleanup(c.close)
        c.create([factorps.TensorSpec("a", (8, 4), np.ones((8, 4), np.float32))])
        _, v = c.push_pull({"a": np.full((8, 4), 0.5, np.float32)})
        self.assertEqual(v, {"a": 1})
        s = c.stats()[0]
        self.assertEqual((s["replica_role"], s["replica"], s["standby_joined"]), ("primary", 1, 1))
        self.assertEqual(s["replica_peer"], addrs[1])
        self.assertGreaterEqual(s["term"], 1)
        primary = c.tensor_stats("a")
        self.assertEqual(primary["version"], 1)
        self.assertNotEqual(primary["checksum"], 0)
        standby = factorps.connect([addrs[1]], deadline=5, max_retries=0)
        self.addCleanup(standby.close)
        t = standby.stats()[0]
        self.assertEqual((t["replica_role"], t["term"]), ("standby", s["term"]))
        # The shard-wide hash is asked only of an entry listing replicas.
        self.assertNotEqual(s["state_checksum"], 0)
        self.assertEqual(t["state_checksum"], 0)
        st = standby.tensor_stats("a")
        self.assertEqual((st["version"], st["checksum"]), (1, primary["checksum"]))
        if CLI:
            out = subprocess.run([CLI, "stats", "--shards", addrs[1] + "|" + addrs[0]],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("replica: primary (answered by replica 1), term %d, peer %s, standby "
                          "joined, checksum %016x" % (s["term"], addrs[1], s["state_checksum"]),
                          out.stdout)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/python3
"""Multi-host test: two shards, a worker and Prometheus, each in its own
network namespace, joined by veth pairs to a bridge in a "switch"
namespace, with addresses of the test's own (10.213.0.0/24, which exists
only inside these namespaces). The layout mirrors the Kubernetes manifests:
one host per shard pod, workers elsewhere, Prometheus scraping over the
network. Training steps and scrapes all cross the veth links; nothing uses
loopback except each process's own ports.

Needs root and `ip netns` (iproute2) with veth and bridge support; skips
with a message otherwise. Environment: FACTORPS_SERVER (set by ctest).
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fpsgrpc as F  # noqa: E402
from test_shard_metrics import check_prometheus_state  # noqa: E402

SERVER = os.environ.get("FACTORPS_SERVER", "")
HERE = os.path.dirname(os.path.abspath(__file__))
SUBNET = "10.213.0"


def ip(*args, check=True):
    return subprocess.run(F.fpsproc.ip_argv(*args), capture_output=True, text=True, timeout=30,
                          check=check)


def netns_problem():
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) not installed"
    probe = "fps%dprobe" % os.getpid()
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return "ip netns add failed: " + r.stderr.strip()
    try:
        r = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return "no bridge support in this kernel: " + r.stderr.strip()
        r = ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb",
               check=False)
        if r.returncode != 0:
            return "no veth support in this kernel: " + r.stderr.strip()
    finally:
        ip("netns", "del", probe, check=False)
    return None


def remove_stale_namespaces():
    """Namespaces of an earlier run that was killed before its cleanup (the
    pid in the name is gone)."""
    import re
    r = ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        m = re.match(r"^(fps(\d+)\w+)", line)
        if m and not os.path.exists("/proc/%s" % m.group(2)):
            ip("netns", "del", m.group(1), check=False)


class Net:
    """Namespaces `<tag>sw` (bridge) and one per node, node k at SUBNET.(k+1)."""

    def __init__(self, nodes):
        self.tag = "fps%d" % os.getpid()
        self.sw = self.tag + "sw"
        self.ns = {}
        self.addr = {}
        self.created = []
        try:
            self._add_ns(self.sw)
            ip("-n", self.sw, "link", "add", "br0", "type", "bridge")
            ip("-n", self.sw, "link", "set", "br0", "up")
            for k, node in enumerate(nodes):
                ns = "%s%s" % (self.tag, node)
                self._add_ns(ns)
                # Created inside the namespaces: the root namespace never
                # sees these links.
                ip("-n", self.sw, "link", "add", "p%d" % k, "type", "veth",
                   "peer", "name", "eth0", "netns", ns)
                ip("-n", self.sw, "link", "set", "p%d" % k, "master", "br0")
                ip("-n", self.sw, "link", "set", "p%d" % k, "up")
                a = "%s.%d" % (SUBNET, k + 1)
                ip("-n", ns, "addr", "add", a + "/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                self.ns[node], self.addr[node] = ns, a
        except BaseException:
            self.destroy()
            raise

    def _add_ns(self, ns):
        ip("netns", "add", ns)
        self.created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def exec_prefix(self, node):
        return F.fpsproc.in_netns(self.ns[node])

    def destroy(self):
        for ns in reversed(self.created):
            ip("netns", "del", ns, check=False)
        self.created = []


_problem = netns_problem()


@unittest.skipIf(_problem, "multi-host test skipped: %s" % _problem)
@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class MultiHostTest(unittest.TestCase):
    def test_steps_and_scrapes_cross_links(self):
        remove_stale_namespaces()
        net = Net(["shard0", "shard1", "worker", "prom"])
        shards, prom = [], None
        try:
            for i in range(2):
                node = "shard%d" % i
                shards.append(F.Shard(SERVER, i, 2, host=net.addr[node],
                                      prefix=net.exec_prefix(node)))
            # The worker: its own namespace, reaching the shards only through
            # the bridge.
            r = subprocess.run(
                [*net.exec_prefix("worker"), sys.executable, os.path.join(HERE, "fpsgrpc.py"),
                 "worker", "--shards", ",".join(s.addr for s in shards), "--steps", "4"],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            summary = json.loads(r.stdout.strip().splitlines()[-1])
            self.assertEqual(summary["pushed"], [4, 4])
            # Loopback is really out of the picture: the shard address is not
            # reachable from the root namespace.
            self.assertNotEqual(shards[0].host, "127.0.0.1")

            # Prometheus in its own namespace scrapes both shards over the links.
            prom = F.Prometheus(["%s:%d" % (s.host, s.metrics_port) for s in shards],
                                host=net.addr["prom"], prefix=net.exec_prefix("prom"),
                                query_prefix=net.exec_prefix("prom"))
            check_prometheus_state(self, prom, shards)
            pushes = prom.query('factorps_rpc_requests_total{method="PushPull",code="OK"}')
            self.assertEqual(sorted(int(v) for _, v in pushes), [4, 4])
            self.assertEqual(sorted(m["instance"] for m, _ in pushes),
                             sorted("%s:%d" % (s.host, s.metrics_port) for s in shards))
        finally:
            if prom:
                prom.stop()
            rcs = [s.stop() for s in shards]
            net.destroy()
        self.assertEqual(rcs, [0, 0])


if __name__ == "__main__":
    unittest.main(verbosity=2)

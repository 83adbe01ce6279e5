#!/usr/bin/python3
"""docs/shards.md's Configuration table, as a user reads it, against
factorps-server:

- every flag of the table is in --help, with its environment twin
  (FACTORPS_ + the flag's name), and where the table gives a plain default
  (a number, a word, true/false) --help shows the same default;
- "a bad value exits 2 with a message": a bad value of every flag that
  takes a number, a choice or a boolean, given as the flag and as its
  environment twin, exits 2 naming it, and so do bad combinations
  (--tls-cert without --tls-key, --tls-client-ca without TLS) and
  addresses whose port is beyond 65535 (gRPC would silently bind the port
  modulo 2^16: 127.0.0.1:99999 listened on 34463).
"""
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import fpsharness as H

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "shards.md")

# flag -> a bad value (numbers out of range or not numbers, unknown choices,
# non-booleans).
BAD = {
    "--shard-id": "x", "--shard-count": "0", "--mode": "fast", "--workers": "0",
    "--staleness": "-1", "--deadline": "0", "--max-message-bytes": "1", "--threads": "9999",
    "--kernel-threads": "-2", "--max-tensors": "0", "--max-bytes": "lots",
    "--max-staging-bytes": "1e30", "--apply-log": "nan", "--simd": "sse9",
    "--malloc-tune": "maybe", "--http2-bdp-probe": "2", "--http2-max-frame": "100", "--checkpoint-interval": "-5",
    "--checkpoint-keep": "0", "--max-concurrent-calls": "0", "--exchange-deadline": "0",
    "--log-level": "loud",
    "--listen": "127.0.0.1:99999", "--metrics-listen": "127.0.0.1:70000",
}


def run(args, env=None, timeout=30):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FACTORPS_")}
    e.update(env or {})
    return subprocess.run([H.SERVER] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=e, stdin=subprocess.DEVNULL)


def env_name(flag):
    return "FACTORPS_" + flag[2:].upper().replace("-", "_")


def table():
    """[(flags, default cell)] of docs/shards.md's Configuration table."""
    rows, on = [], False
    with open(DOC) as f:
        for line in f:
            if line.startswith("| flag | default | meaning |"):
                on = True
                continue
            if on and not line.startswith("|"):
                break
            if on and not line.startswith("| ---"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                rows.append((re.findall(r"`(--[a-z0-9-]+)`", cells[0]), cells[1]))
    return rows


def help_defaults(text):
    """{flag: default string} from --help."""
    out, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+(--[a-z0-9-]+)\s", line)
        if m:
            flag = m.group(1)
        m = re.search(r"env (FACTORPS_[A-Z0-9_]+)(?:, default (.*))?$", line)
        if m and flag:
            out[flag] = (m.group(1), (m.group(2) or "").strip())
    return out


class Flags(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        r = run(["--help"])
        assert r.returncode == 0, r.stderr
        cls.help = help_defaults(r.stdout)
        cls.rows = table()

    def test_table_was_parsed(self):
        flags = [f for fs, _ in self.rows for f in fs]
        self.assertGreaterEqual(len(flags), 30, flags)
        self.assertIn("--http2-bdp-probe", flags)

    def test_every_flag_in_help_with_its_env_twin(self):
        for flags, _ in self.rows:
            for f in flags:
                with self.subTest(flag=f):
                    self.assertIn(f, self.help, f"{f} is in docs/shards.md but not in --help")
                    self.assertEqual(self.help[f][0], env_name(f))

    def test_plain_defaults_match_help(self):
        checked = 0
        for flags, cell in self.rows:
            vals = [v.strip().strip("`") for v in cell.split(",")]
            if len(vals) != len(flags):
                continue
            for f, v in zip(flags, vals):
                if not re.fullmatch(r"[0-9.]+|[a-z]+|[0-9.:]+", v) or v in ("off", "none"):
                    continue
                with self.subTest(flag=f):
                    self.assertEqual(self.help[f][1], v, f"{f}: docs/shards.md says {v}")
                    checked += 1
        self.assertGreaterEqual(checked, 12)

    def test_bad_values_exit_2(self):
        for flag, bad in sorted(BAD.items()):
            for how in ("flag", "env"):
                with self.subTest(flag=flag, how=how, value=bad):
                    if how == "flag":
                        r = run([flag, bad])
                    else:
                        r = run([], {env_name(flag): bad})
                    self.assertEqual(r.returncode, 2, r.stderr)
                    self.assertTrue(flag in r.stderr or env_name(flag) in r.stderr, r.stderr)
                    self.assertNotIn("listening on", r.stderr + r.stdout)

    def test_bad_combinations_and_addresses_exit_2(self):
        cases = [
            (["--tls-cert", "x.pem"], "--tls-key"),
            (["--tls-key", "x.key"], "--tls-cert"),
            (["--tls-client-ca", "ca.pem"], "--tls-cert"),
            (["--metrics-listen", "nohost"], "host:port"),
            (["--listen", "127.0.0.1:123456789012345678901"], "out of range"),
            (["--listen", "bogus"], "host:port"),
            (["--shard-count", "2", "--peers", "127.0.0.1:5000,127.0.0.1:65536"], "--peers"),
        ]
        for args, word in cases:
            with self.subTest(args=args):
                r = run(args)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn(word, r.stderr)

    def test_valid_ports_still_start(self):
        srv = H.Server(listen="127.0.0.1:0")
        try:
            H.stats(srv.stub)
        finally:
            srv.stop()

    def test_a_unix_socket_listens(self):
        """--listen unix:PATH (no port) serves, and says where."""
        _, pbg, grpc = H.stubs()
        d = tempfile.mkdtemp(prefix="fps-unix-")
        sock = "unix:" + os.path.join(d, "shard.sock")
        srv = H.Server(listen=sock)
        try:
            self.assertIn("listening on %s (" % sock, srv.line)
            with grpc.insecure_channel(sock) as ch:
                H.stats(pbg.ParameterServerStub(ch))
        finally:
            srv.stop()
            shutil.rmtree(d, ignore_errors=True)


class MemoryLimit(unittest.TestCase):
    """--max-bytes used to default to half the host's RAM,
    ignoring the container's memory limit, so the kernel OOM-killed the
    shard instead of it answering RESOURCE_EXHAUSTED. A shard in a mount
    namespace of its own whose memory cgroup file says 64 MiB (the limit
    file at the cgroup mount point, as inside a container's cgroup
    namespace) holds at most 32 MiB of parameters."""

    def test_max_bytes_from_the_cgroup_limit(self):
        import shutil
        if os.geteuid() != 0 or not shutil.which("unshare"):
            self.skipTest("needs root and unshare(1) for a private mount namespace")
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        v2 = any(l.startswith("0::") for l in lines) and os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        limit = 64 << 20
        # Only this shard's private mount namespace sees the fake tree
        # (unshare -m makes its mounts private): the real cgroups are untouched.
        if v2:
            fake = 'mount -t tmpfs none /sys/fs/cgroup && echo %d > /sys/fs/cgroup/memory.max' % limit
        else:
            fake = ('mount -t tmpfs none /sys/fs/cgroup && mkdir /sys/fs/cgroup/memory /sys/fs/cgroup/unified && '
                    'echo %d > /sys/fs/cgroup/memory/memory.limit_in_bytes' % limit)
        # /sys, not /, made private: / is not a mount point in a chroot.
        prefix = ["unshare", "-m", "--propagation", "unchanged", "sh", "-c",
                  "mount --make-rprivate /sys && " + fake + ' && exec "$0" "$@"']
        import fpsproc
        srv = fpsproc.ShardProcess(("--mode", "async"), prefix=prefix)
        try:
            _, pbg, grpc = H.stubs()
            ch = grpc.insecure_channel(srv.addr)
            stub = pbg.ParameterServerStub(ch)
            # 40 MiB of parameters: over half the limit, refused as the
            # documented RESOURCE_EXHAUSTED naming --max-bytes.
            with self.assertRaises(grpc.RpcError) as cm:
                H.create(stub, "big", [10 << 20], timeout=30)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, cm.exception.details())
            self.assertIn("--max-bytes", cm.exception.details())
            self.assertIn(str(limit // 2), cm.exception.details())
            H.create(stub, "small", [1 << 20], timeout=30)  # 4 MiB fits
            ch.close()
            self.assertIn("--max-bytes %d: half of %d bytes (cgroup " % (limit // 2, limit), srv.stderr())
        finally:
            self.assertEqual(srv.terminate(), 0, srv.stderr()[-3000:])
            srv.remove()


if __name__ == "__main__":
    unittest.main()

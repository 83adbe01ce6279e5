#!/usr/bin/python3
"""Shards that know each other: --peers and the peer TLS/token
flags at start-up, and fpsharness.Job, which starts a multi-shard job on
loopback ports it picks (the harness h12cli's end-to-end tests build on).

The transport itself (Exchange calls between shards: TLS, mutual TLS,
tokens, a peer down or silent, shutdown) is tested in C against real
shards: tests/integration/test_peer.c."""
import os
import socket
import stat
import subprocess
import tempfile
import unittest

import fpsharness as H


def run_server(*args, timeout=30):
    """factorps-server with args that must make it refuse to start."""
    return subprocess.run([H.SERVER, "--listen", "127.0.0.1:0"] + [str(a) for a in args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)


class Flags(unittest.TestCase):
    def refused(self, args, needle):
        r = run_server(*args)
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 2, err)
        self.assertIn(needle, err)

    def test_peers_count_and_entries(self):
        self.refused(["--shard-count", 3, "--peers", "127.0.0.1:1,127.0.0.1:2"],
                     "--peers lists 2 addresses; it must list all 3 shards")
        self.refused(["--shard-count", 2, "--peers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"],
                     "--peers lists 3 addresses")
        self.refused(["--shard-count", 3, "--peers", "127.0.0.1:1,,127.0.0.1:3"], "--peers entry 1 is empty")
        self.refused(["--shard-count", 2, "--peers", "127.0.0.1:1,"], "--peers entry 1 is empty")
        # Dialled, so each needs its port (gRPC would dial 443), as --replica-peer does.
        self.refused(["--shard-count", 2, "--peers", "a,b"], "--peers 'a' must be host:port")

    def test_peer_flags_need_peers(self):
        for flag in ("--peer-tls-ca", "--peer-tls-cert", "--peer-tls-key", "--peer-tls-server-name",
                     "--peer-token-file"):
            self.refused([flag, "x"], "%s needs --peers" % flag)

    def test_tls_flag_combinations(self):
        c = H.certs()
        peers = ["--shard-count", 2, "--peers", "127.0.0.1:1,127.0.0.1:2"]
        self.refused(peers + ["--peer-tls-ca", os.path.join(c, "ca.pem"), "--peer-tls-cert",
                              os.path.join(c, "client.pem")],
                     "--peer-tls-cert and --peer-tls-key must be given together")
        self.refused(peers + ["--peer-tls-cert", os.path.join(c, "client.pem"), "--peer-tls-key",
                              os.path.join(c, "client.key")],
                     "--peer-tls-cert needs --peer-tls-ca")
        self.refused(peers + ["--peer-tls-server-name", "shard.factorps.test"],
                     "--peer-tls-server-name needs --peer-tls-ca")

    def test_bad_files(self):
        c = H.certs()
        peers = ["--shard-count", 2, "--peers", "127.0.0.1:1,127.0.0.1:2"]
        missing = os.path.join(c, "no-such-file")
        self.refused(peers + ["--peer-tls-ca", missing], "--peer-tls-ca '%s': No such file" % missing)
        self.refused(peers + ["--peer-tls-ca", os.path.join(c, "token")], "--peer-tls-ca '%s': no PEM certificate"
                     % os.path.join(c, "token"))
        self.refused(peers + ["--peer-tls-ca", os.path.join(c, "ca.pem"), "--peer-tls-cert",
                              os.path.join(c, "client.pem"), "--peer-tls-key", os.path.join(c, "other.key")],
                     "does not belong to --peer-tls-cert")
        self.refused(peers + ["--peer-tls-ca", os.path.join(c, "ca.pem"), "--peer-tls-cert",
                              os.path.join(c, "expired.pem"), "--peer-tls-key", os.path.join(c, "expired.key")],
                     "the certificate has expired")
        self.refused(peers + ["--peer-token-file", missing], "--peer-token-file '%s'" % missing)
        with tempfile.TemporaryDirectory() as d:
            empty = os.path.join(d, "empty")
            with open(empty, "w") as f:
                f.write("# only a comment\n\n")
            os.chmod(empty, stat.S_IRUSR | stat.S_IWUSR)
            self.refused(peers + ["--peer-token-file", empty], "holds no token")
            spaced = os.path.join(d, "spaced")
            with open(spaced, "w") as f:
                f.write("two words\n")
            os.chmod(spaced, stat.S_IRUSR | stat.S_IWUSR)
            self.refused(peers + ["--peer-token-file", spaced], "only visible ASCII")

    def test_exchange_deadline_bounds(self):
        self.refused(["--exchange-deadline", 0], "--exchange-deadline must be a number")
        self.refused(["--exchange-deadline", "nan"], "--exchange-deadline must be a number")

    def test_help_and_environment(self):
        r = subprocess.run([H.SERVER, "--help"], stdout=subprocess.PIPE, timeout=30)
        out = r.stdout.decode()
        for flag in ("--peers", "--peer-tls-ca", "--peer-tls-cert", "--peer-tls-key", "--peer-tls-server-name",
                     "--peer-token-file", "--exchange-deadline", "FACTORPS_PEERS"):
            self.assertIn(flag, out)
        # The environment twin is read and checked like the flag.
        r = subprocess.run([H.SERVER, "--listen", "127.0.0.1:0", "--shard-count", "2"],
                           env=dict(os.environ, FACTORPS_PEERS="127.0.0.1:1"), stderr=subprocess.PIPE, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--peers lists 1 address", r.stderr.decode())


class Jobs(unittest.TestCase):
    def test_every_security_kind(self):
        """A 3-shard job per kind: every shard up, told the others, serving
        its clients with that security, and exiting 0 on SIGTERM."""
        pb, _, _ = H.stubs()
        want = {"plain": "plaintext", "tls": "TLS", "mtls": "TLS with a client certificate",
                "token": "plaintext, bearer token", "mtls+token": "TLS with a client certificate, bearer token"}
        for kind in H.Security.KINDS:
            with self.subTest(kind=kind):
                with H.Job(3, "--mode", "sync", "--log-level", "debug", security=kind) as job:
                    self.assertEqual(len(set(job.addrs)), 3)
                    for i in range(3):
                        r, _ = H.stats(job.stub(i))
                        self.assertEqual((r.shard.shard_id, r.shard.shard_count), (i, 3))
                        self.assertIn("peers: 3 shards, %s, exchange deadline 10 s" % want[kind], job[i].stderr())
                        self.assertIn("peers=" + ",".join(job.addrs), job[i].stderr())
                    # Each shard's Exchange handler answers a peer's call.
                    part = bytes(64)
                    with self.assertRaises(Exception) as cm:
                        job.stub(1).Exchange(pb.ExchangeRequest(name="w", from_shard=0, shard_count=3,
                                                                phase=pb.EXCHANGE_PHASE_STATS, partials=part),
                                             timeout=10)
                    self.assertEqual(cm.exception.code().name, "INVALID_ARGUMENT")  # zero magic

    def test_client_options(self):
        s = H.Security("mtls+token")
        o = s.client_options()
        self.assertEqual(set(o), {"tls_ca_file", "tls_cert_file", "tls_key_file", "auth_token"})
        self.assertEqual(o["auth_token"], s.token_value())
        self.assertEqual(H.Security("plain").client_options(), {})

    def test_port_race_restarts_the_job(self):
        """A port taken between picking and binding: the job starts again
        on fresh ports instead of failing."""
        taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        real = H.free_ports
        calls = []

        def first_taken(n):
            ports = real(n)
            calls.append(ports)
            if len(calls) == 1:
                ports[1] = taken.getsockname()[1]
            return ports
        H.free_ports = first_taken
        try:
            with H.Job(2) as job:
                self.assertEqual(len(calls), 2)
                self.assertNotIn(taken.getsockname()[1], job.ports)
                H.stats(job.stub(1))
        finally:
            H.free_ports = real
            taken.close()

    def test_kill_and_restart_on_the_same_port(self):
        with H.Job(2) as job:
            port = job.ports[1]
            job.kill(1)
            self.assertIsNotNone(job[1].proc.returncode)
            job.restart(1)
            self.assertEqual(job[1].port, port)
            r, _ = H.stats(job.stub(1))
            self.assertEqual(r.shard.shard_id, 1)


if __name__ == "__main__":
    unittest.main()

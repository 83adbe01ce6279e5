"""The deploy files' TLS material (deploy/make-tls.sh), used as they use it.

MakeTls: what the script issues (names, keys 0600, chains, server names,
the peer's shard id), that a second run keeps everything, that more shards
or --renew issue only what they should, and the Kubernetes Secrets.

ShardTls: a factorps-server serving the generated server certificate with
the generated CA as --tls-client-ca admits the generated worker, peer and
admin certificates and refuses a client without one, one of another CA and
one that dials it by another replica's name.

ComposePair: shard 0's two replicas exactly as deploy/docker-compose.yml
defines them (environment, nghttpx proxy argv, files; paths mapped into a
temporary directory, ports onto loopback): each proxy serves mutual TLS
with its replica's certificate, the replicas replicate to each other
through the proxies with their peer certificate, and a worker with the
worker certificate trains through the primary's (grpcio, and libfactorps
through `factorps stats` with the compose worker's TLS arguments); without
a certificate the proxy refuses it, without a token the shard does.

CertificateRoles: --tls-client-roles, with the role URIs make-tls.sh
writes: each certificate only its role's calls, with or without tokens,
a peer certificate only for its own shard. Loopback only."""
import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "interop"))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "deploy"))

import fpsharness as H  # noqa: E402
import fpsproc  # noqa: E402
import fpsproxy  # noqa: E402

MAKE_TLS = os.path.join(REPO, "deploy", "make-tls.sh")
CLI = os.environ.get("FACTORPS_CLI", os.path.join(REPO, "build", "client", "factorps"))
HAVE_OPENSSL = shutil.which("openssl") is not None


def make_tls(d, *args, check=True):
    return subprocess.run([MAKE_TLS, *args, d], capture_output=True, text=True, timeout=120, check=check)


def read(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


def snapshot(d):
    return {n: read(d, n) for n in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, n))}


def x509(d, name, *what):
    return subprocess.run(["openssl", "x509", "-in", os.path.join(d, name), "-noout", *what],
                          capture_output=True, text=True, check=True).stdout


def roles(n):
    out = {"ca.crt", "worker.crt", "worker.key", "admin.crt", "admin.key"}
    for i in range(n):
        out |= {"server-%d-a.crt" % i, "server-%d-a.key" % i, "server-%d-b.crt" % i, "server-%d-b.key" % i,
                "peer-%d.crt" % i, "peer-%d.key" % i}
    return out


@unittest.skipUnless(HAVE_OPENSSL, "openssl missing")
class MakeTls(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-make-tls-")
        self.d = os.path.join(self.root, "tls")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def verify(self, names):
        r = subprocess.run(["openssl", "verify", "-CAfile", os.path.join(self.d, "ca.crt")]
                           + [os.path.join(self.d, n) for n in names], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_issues_keeps_and_renews(self):
        make_tls(self.d)
        first = snapshot(self.d)
        self.assertEqual(set(first), roles(2))
        self.assertTrue(os.path.isfile(os.path.join(self.d, "ca-private", "ca.key")))
        for n in first:
            mode = os.stat(os.path.join(self.d, n)).st_mode & 0o777
            self.assertEqual(mode, 0o600 if n.endswith(".key") else 0o644, n)
        self.verify(n for n in first if n.endswith(".crt") and n != "ca.crt")
        # Server names: the compose service and both Kubernetes forms.
        san = x509(self.d, "server-1-b.crt", "-ext", "subjectAltName,extendedKeyUsage")
        for name in ("DNS:shard-1-b", "DNS:factorps-shard-b-1.factorps-shard",
                     "DNS:factorps-shard-b-1.factorps-shard.factorps.svc.cluster.local", "TLS Web Server"):
            self.assertIn(name, san)
        peer = x509(self.d, "peer-1.crt", "-subject", "-ext", "subjectAltName,extendedKeyUsage")
        self.assertIn("CN = peer-1", peer)
        self.assertIn("URI:urn:factorps:peer:1", peer)
        self.assertIn("TLS Web Client", peer)
        self.assertIn("OU = worker", x509(self.d, "worker.crt", "-subject"))
        self.assertIn("OU = admin", x509(self.d, "admin.crt", "-subject"))

        # Again: nothing changes.
        make_tls(self.d)
        self.assertEqual(snapshot(self.d), first)
        # More shards: only the new shard's files are issued.
        make_tls(self.d, "--shards", "3")
        now = snapshot(self.d)
        self.assertEqual(set(now), roles(3))
        self.assertEqual({n: now[n] for n in first}, first)
        self.verify(["server-2-a.crt", "server-2-b.crt", "peer-2.crt"])
        # --renew: new keys and certificates under the same CA.
        make_tls(self.d, "--shards", "3", "--renew")
        renewed = snapshot(self.d)
        self.assertEqual(renewed["ca.crt"], first["ca.crt"])
        for n in renewed:
            if n != "ca.crt":
                self.assertNotEqual(renewed[n], now[n], n)
        self.verify(n for n in renewed if n.endswith(".crt") and n != "ca.crt")
        # Without the CA key nothing new can be signed, and nothing is lost.
        os.rename(os.path.join(self.d, "ca-private", "ca.key"), os.path.join(self.root, "ca.key"))
        r = make_tls(self.d, "--shards", "4", check=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("ca.key", r.stderr)
        self.assertEqual(snapshot(self.d), renewed)
        # --force: a new CA and everything under it.
        make_tls(self.d, "--force")
        forced = snapshot(self.d)
        self.assertNotEqual(forced["ca.crt"], first["ca.crt"])
        self.verify(n for n in forced if n.endswith(".crt") and n != "ca.crt" and n in roles(2))

    def test_ca_key_elsewhere_and_kubernetes_secrets(self):
        import yaml
        ca_dir = os.path.join(self.root, "ca")
        out = make_tls(self.d, "--ca-dir", ca_dir, "--namespace", "train", "--kubernetes").stdout
        self.assertFalse(os.path.exists(os.path.join(self.d, "ca-private")))
        self.assertTrue(os.path.isfile(os.path.join(ca_dir, "ca.key")))
        self.assertIn("factorps-shard-a-0.factorps-shard.train.svc",
                      x509(self.d, "server-0-a.crt", "-ext", "subjectAltName"))
        docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d}
        self.assertEqual(set(docs), {"factorps-tls-shard", "factorps-tls-worker"})
        for d in docs.values():
            self.assertEqual((d["kind"], d["metadata"]["namespace"]), ("Secret", "train"))
            for k, v in d["data"].items():
                self.assertEqual(base64.b64decode(v), read(self.d, k), k)
        self.assertEqual(set(docs["factorps-tls-worker"]["data"]), {"ca.crt", "worker.crt", "worker.key"})
        self.assertEqual(set(docs["factorps-tls-shard"]["data"]),
                         roles(2) - {"worker.crt", "worker.key", "admin.crt", "admin.key"})
        self.assertNotIn(base64.b64encode(read(ca_dir, "ca.key")).decode(), out)


def channel(d, addr, name, client="worker", token=None):
    """A grpcio channel to addr over TLS, trusting d's CA, presenting
    d's `client` certificate (None: none), expecting the server name."""
    _, _, grpc = H.stubs()
    creds = grpc.ssl_channel_credentials(root_certificates=read(d, "ca.crt"),
                                         private_key=read(d, client + ".key") if client else None,
                                         certificate_chain=read(d, client + ".crt") if client else None)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(addr, creds, options=[("grpc.ssl_target_name_override", name)])


def refused(test, d, addr, name, client, token, code):
    pb, pbg, grpc = H.stubs()
    ch = channel(d, addr, name, client, token)
    try:
        with test.assertRaises(grpc.RpcError) as cm:
            H.stats(pbg.ParameterServerStub(ch), timeout=10)
        test.assertEqual(cm.exception.code(), getattr(grpc.StatusCode, code), cm.exception.details())
    finally:
        ch.close()


def write_tokens(d, count):
    """The files compose's tokens service writes."""
    os.makedirs(d, exist_ok=True)
    tok = {"workers": os.urandom(16).hex(), "admins": os.urandom(16).hex()}
    peers = [os.urandom(16).hex() for _ in range(count)]
    files = dict(tok, peers="".join("%d:%s\n" % (i, t) for i, t in enumerate(peers)))
    files.update({"peer-%d" % i: t for i, t in enumerate(peers)})
    for k, v in files.items():
        p = os.path.join(d, k)
        with open(p, "w") as f:
            f.write(v.rstrip("\n") + "\n")
        os.chmod(p, 0o600)
    return tok


@unittest.skipUnless(HAVE_OPENSSL and os.access(fpsproc.SERVER, os.X_OK), "openssl or FPS_SERVER missing")
class ShardTls(unittest.TestCase):
    def test_generated_certificates_on_a_shard(self):
        root = tempfile.mkdtemp(prefix="fps-deploy-tls-")
        d, other = os.path.join(root, "tls"), os.path.join(root, "other")
        make_tls(d)
        make_tls(other)
        tok = write_tokens(os.path.join(root, "tokens"), 1)
        srv = H.Server("--mode", "async", "--tls-cert", os.path.join(d, "server-0-a.crt"),
                       "--tls-key", os.path.join(d, "server-0-a.key"), "--tls-client-ca", os.path.join(d, "ca.crt"),
                       "--auth-token-file", os.path.join(root, "tokens", "workers"),
                       "--admin-token-file", os.path.join(root, "tokens", "admins"),
                       "--exchange-token-file", os.path.join(root, "tokens", "peers"))
        try:
            _, pbg, _ = H.stubs()
            ch = channel(d, srv.addr, "shard-0-a", "worker", tok["workers"])
            try:
                stub = pbg.ParameterServerStub(ch)
                H.create(stub, "w", [4, 4], np.zeros(16, np.float32))
                H.push(stub, 0, 0, {"w": ([4, 4], np.ones(16, np.float32))})
                _, versions = H.pull(stub, {"w": [4, 4]})
                self.assertEqual(versions, {"w": 1})
            finally:
                ch.close()
            # The Kubernetes name of the same replica, the peer and admin
            # certificates: all admitted by the handshake.
            for name, client in (("factorps-shard-a-0.factorps-shard", "worker"), ("shard-0-a", "peer-0"),
                                 ("shard-0-a", "admin")):
                ch = channel(d, srv.addr, name, client, tok["workers"])
                try:
                    _, tensors = H.stats(pbg.ParameterServerStub(ch), timeout=10)
                    self.assertEqual(list(tensors), ["w"], (name, client))
                finally:
                    ch.close()
            refused(self, d, srv.addr, "shard-0-a", None, tok["workers"], "UNAVAILABLE")  # no certificate
            refused(self, other, srv.addr, "shard-0-a", "worker", tok["workers"], "UNAVAILABLE")  # other CA
            refused(self, d, srv.addr, "shard-0-b", "worker", tok["workers"], "UNAVAILABLE")  # other replica's name
            refused(self, d, srv.addr, "shard-0-a", "worker", None, "UNAUTHENTICATED")  # TLS alone is not enough
        finally:
            srv.stop()
            shutil.rmtree(root, ignore_errors=True)


@unittest.skipUnless(HAVE_OPENSSL and os.access(fpsproc.SERVER, os.X_OK), "openssl or FPS_SERVER missing")
class CertificateRoles(unittest.TestCase):
    """--tls-client-roles: the role URIs make-tls.sh writes into the client
    certificates limit what a call may do, with or without tokens, and a
    peer certificate speaks for its own shard only."""

    def setUp(self):
        self.pb, self.pbg, self.grpc = H.stubs()
        self.root = tempfile.mkdtemp(prefix="fps-cert-roles-")
        self.d = os.path.join(self.root, "tls")
        make_tls(self.d, "--shards", "3")
        # A certificate of the same CA that names no role.
        key, crt = os.path.join(self.d, "norole.key"), os.path.join(self.d, "norole.crt")
        subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", crt + ".csr", "-subj", "/CN=norole"],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", crt + ".csr", "-CA", os.path.join(self.d, "ca.crt"),
                        "-CAkey", os.path.join(self.d, "ca-private", "ca.key"), "-set_serial", "7", "-days", "2",
                        "-out", crt], check=True, capture_output=True)
        self.channels = []

    def tearDown(self):
        for ch in self.channels:
            ch.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def server(self, *extra):
        return H.Server("--mode", "async", "--shard-id", 1, "--shard-count", 3, "--tls-client-roles", "true",
                        "--checkpoint-dir", os.path.join(self.root, "ckpt"),
                        "--tls-cert", os.path.join(self.d, "server-1-a.crt"),
                        "--tls-key", os.path.join(self.d, "server-1-a.key"),
                        "--tls-client-ca", os.path.join(self.d, "ca.crt"), *extra)

    def calls(self, srv, client, token=None):
        pb = self.pb
        ch = channel(self.d, srv.addr, "shard-1-a", client, token)
        self.channels.append(ch)
        stub = self.pbg.ParameterServerStub(ch)
        w = np.ones(12, np.float32)

        def exchange(shard):
            return lambda: stub.Exchange(pb.ExchangeRequest(name="w", from_shard=shard, shard_count=3,
                                                            phase=pb.EXCHANGE_PHASE_STATS), timeout=10)
        return {
            "Create": lambda: H.create(stub, "w", [3, 4], w, shard_id=1, shard_count=3, timeout=10),
            "PushPull": lambda: H.push(stub, 0, 1, {"w": ([3, 4], w)}, timeout=10),
            "Stats": lambda: H.stats(stub, timeout=10),
            "Checkpoint": lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=10),
            "Exchange 0": exchange(0),
            "Exchange 2": exchange(2),
        }

    def code(self, fn):
        try:
            fn()
            return None
        except self.grpc.RpcError as e:
            return e.code().name

    def expect(self, srv, client, want, token=None):
        calls = self.calls(srv, client, token)
        for method, code in want.items():
            with self.subTest(client=client, token=bool(token), method=method):
                got = self.code(calls[method])
                # Past admission (an Exchange finds no block of 'w' here, a
                # Checkpoint of an empty shard has nothing to write).
                if code == "reaches the shard":
                    self.assertNotIn(got, ("PERMISSION_DENIED", "UNAUTHENTICATED"))
                else:
                    self.assertEqual(got, code)

    def test_roles_from_certificates_alone(self):
        srv = self.server()
        try:
            D = "PERMISSION_DENIED"
            self.expect(srv, "worker", {"Create": None, "PushPull": None, "Stats": None, "Checkpoint": D,
                                        "Exchange 0": D})
            self.expect(srv, "admin", {"Stats": None, "Checkpoint": None, "Exchange 0": D})
            self.expect(srv, "peer-0", {"Stats": D, "PushPull": D, "Checkpoint": D, "Exchange 2": D,
                                        "Exchange 0": "reaches the shard"})
            self.expect(srv, "norole", {"Stats": D, "Exchange 0": D})
        finally:
            srv.stop()

    def test_token_and_certificate_both_limit(self):
        tok = write_tokens(os.path.join(self.root, "tokens"), 3)
        t = os.path.join(self.root, "tokens")
        # One token file: the worker token holds every role, the certificate limits it.
        srv = self.server("--auth-token-file", os.path.join(t, "workers"))
        try:
            D = "PERMISSION_DENIED"
            self.expect(srv, "worker", {"Stats": None, "Checkpoint": D}, token=tok["workers"])
            self.expect(srv, "admin", {"Checkpoint": "reaches the shard"}, token=tok["workers"])
            self.expect(srv, "peer-0", {"Exchange 0": "reaches the shard", "Exchange 2": D}, token=tok["workers"])
            self.expect(srv, "admin", {"Stats": "UNAUTHENTICATED"})  # the certificate does not replace the token
        finally:
            srv.stop()
        # Per-role tokens: an admin certificate with a worker token is a worker;
        # shard 0's peer certificate with shard 2's peer token is no peer.
        srv = self.server("--auth-token-file", os.path.join(t, "workers"), "--admin-token-file",
                          os.path.join(t, "admins"), "--exchange-token-file", os.path.join(t, "peers"))
        try:
            with open(os.path.join(t, "peer-2")) as f:
                peer2 = f.read().strip()
            self.expect(srv, "admin", {"Checkpoint": "PERMISSION_DENIED"}, token=tok["workers"])
            self.expect(srv, "admin", {"Checkpoint": "reaches the shard"}, token=tok["admins"])
            self.expect(srv, "peer-0", {"Exchange 0": "PERMISSION_DENIED", "Exchange 2": "PERMISSION_DENIED"},
                        token=peer2)
            self.expect(srv, "peer-2", {"Exchange 2": "reaches the shard"}, token=peer2)
        finally:
            srv.stop()

    def test_needs_client_ca(self):
        with self.assertRaises(fpsproc.ServerExited) as cm:
            H.Server("--tls-client-roles", "true", "--tls-cert", os.path.join(self.d, "server-1-a.crt"),
                     "--tls-key", os.path.join(self.d, "server-1-a.key"))
        self.assertIn("--tls-client-roles needs --tls-client-ca", cm.exception.err)


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        return r.read().decode()


def gauge(text, name, labels=""):
    m = re.search(r"^%s\{[^}]*%s[^}]*\} (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else None


@unittest.skipUnless(HAVE_OPENSSL and fpsproxy.available() and os.access(fpsproc.SERVER, os.X_OK),
                     "openssl, nghttpx or FPS_SERVER missing")
class ComposePair(unittest.TestCase):
    """Shard 0's replicas and their proxies as the compose file has them."""

    def setUp(self):
        import layouts
        self.root = tempfile.mkdtemp(prefix="fps-deploy-tls-pair-")
        self.procs, self.proxies = [], []
        self.pair = sorted((s for s in layouts.compose_shards() if s.shard_id == 0), key=lambda s: s.name)
        self.assertEqual([s.name for s in self.pair], ["shard-0-a", "shard-0-b"])

    def tearDown(self):
        for p in self.procs:
            if p.proc.poll() is None:
                p.kill()
        for p in self.proxies:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    def host(self, path, data):
        """A container path of the compose file, in this test's directory."""
        for mp, sub in (("/var/lib/factorps-tls", "tls"), ("/var/lib/factorps-tokens", "tokens"),
                        ("/var/lib/factorps-lease", "leases"), ("/var/lib/factorps", data),
                        ("/etc/factorps/nghttpx.conf", None)):
            if path == mp or path.startswith(mp + "/"):
                if sub is None:
                    return fpsproxy.CONF
                return os.path.join(self.root, sub) + path[len(mp):]
        return path

    def start_proxy(self, s, front, back):
        argv = []
        for a in s.proxy:
            if a.startswith("--frontend="):
                self.assertNotIn("no-tls", a)
                a = "--frontend=127.0.0.1,%d" % front
            elif a.startswith("--backend="):
                a = "--backend=127.0.0.1,%d;;proto=h2" % back
            elif a.startswith("--") and "=/" in a:
                k, v = a.split("=", 1)
                a = k + "=" + self.host(v, None)
            else:
                a = self.host(a, None)
            argv.append(a)
        argv[0] = fpsproxy.NGHTTPX
        log = open(os.path.join(self.root, s.name + "-proxy.log"), "ab")
        self.proxies.append(subprocess.Popen(argv + ["--errorlog-file=/dev/stderr"], stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log))
        log.close()

    def test_replicas_and_worker_over_mutual_tls(self):
        d = os.path.join(self.root, "tls")
        # As compose's tls service runs it (its --shards and --ca-dir).
        make_tls(d, "--shards", "2", "--ca-dir", os.path.join(self.root, "ca"))
        tok = write_tokens(os.path.join(self.root, "tokens"), 2)
        os.makedirs(os.path.join(self.root, "leases"))
        fronts, backs = fpsproc.free_ports(2), fpsproc.free_ports(2)
        for i, s in enumerate(self.pair):
            data = "data-" + s.name
            os.makedirs(os.path.join(self.root, data))
            env = {k: self.host(v, data) if v.startswith("/") else v for k, v in s.env.items()
                   if k.startswith("FACTORPS_")}
            env["FACTORPS_LEASE"] = "file:" + self.host(s.env["FACTORPS_LEASE"][5:], data)
            # The other replica, through its proxy on loopback: dialled by
            # IP, so its certificate's name is given.
            other = self.pair[1 - i]
            env["FACTORPS_REPLICA_PEER"] = "127.0.0.1:%d" % fronts[1 - i]
            env["FACTORPS_REPLICA_ADVERTISE"] = "127.0.0.1:%d" % fronts[i]
            env["FACTORPS_PEER_TLS_SERVER_NAME"] = other.hostname
            env.pop("FACTORPS_LISTEN")
            env.pop("FACTORPS_METRICS_LISTEN")
            self.assertEqual(os.path.basename(s.argv[0]), "factorps-server")
            self.start_proxy(s, fronts[i], backs[i])
            self.procs.append(fpsproc.ShardProcess(s.argv[1:], listen="127.0.0.1:%d" % backs[i],
                                                   metrics_listen="127.0.0.1:0", env=env,
                                                   dir=self.root, name=s.name, die_with_parent=True))

        def role_of(p):
            t = metrics(p.metrics_port)
            return next((r for r in ("primary", "standby", "solo")
                         if gauge(t, "factorps_replica_role", 'role="%s"' % r) == 1), None)

        def logs():
            out = []
            for p in self.procs:
                out.append(p.stderr()[-3000:])
            for n in os.listdir(self.root):
                if n.endswith("-proxy.log"):
                    with open(os.path.join(self.root, n), errors="replace") as f:
                        out.append(n + ":\n" + f.read()[-2000:])
            return "\n".join(out)

        deadline = time.time() + 60
        while True:
            got = sorted(role_of(p) or "" for p in self.procs)
            joined = [gauge(metrics(p.metrics_port), "factorps_replica_standby_joined") for p in self.procs]
            if got == ["primary", "standby"] and 1 in joined:
                break
            if time.time() > deadline:
                self.fail("roles %s, joined %s:\n%s" % (got, joined, logs()))
            time.sleep(0.1)
        p = 0 if role_of(self.procs[0]) == "primary" else 1
        addr, name = "127.0.0.1:%d" % fronts[p], self.pair[p].hostname

        # The worker, as the compose worker dials: CA, worker certificate, token.
        _, pbg, _ = H.stubs()
        ch = channel(d, addr, name, "worker", tok["workers"])
        try:
            stub = pbg.ParameterServerStub(ch)
            H.create(stub, "w", [8, 8], np.zeros(64, np.float32), shard_count=2)
            for step in range(5):
                H.push(stub, 0, step, {"w": ([8, 8], np.full(64, 0.1, np.float32))})
            _, versions = H.pull(stub, {"w": [8, 8]})
            self.assertEqual(versions, {"w": 5})
        finally:
            ch.close()
        # Replicated to the standby through its proxy, with the peer certificate.
        deadline = time.time() + 30
        while True:
            sums = [gauge(metrics(q.metrics_port), "factorps_state_checksum") for q in self.procs]
            if sums[0] is not None and sums[0] == sums[1] and sums[0] != 0:
                break
            if time.time() > deadline:
                self.fail("standby checksum %s:\n%s" % (sums, logs()))
            time.sleep(0.1)
        # libfactorps through the proxy: the compose worker's TLS and token
        # arguments, given to `factorps stats`.
        if CLI and os.access(CLI, os.X_OK):
            import layouts
            cmd = layouts.compose_config()["services"]["worker"]["command"]
            args = []
            for flag in ("--tls-ca", "--tls-cert", "--tls-key", "--token-file"):
                args += [flag, self.host(cmd[cmd.index(flag) + 1], None)]
            r = subprocess.run([CLI, "stats", "--shards", addr, "--tls-server-name", name, "--json"] + args,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn('"pushes": 5,', r.stdout)
            self.assertIn('"standby_joined": true', r.stdout)
        # The proxy refuses a client without a certificate or of another CA;
        # behind it the shard still wants the token.
        other = os.path.join(self.root, "other")
        make_tls(other)
        refused(self, d, addr, name, None, tok["workers"], "UNAVAILABLE")
        refused(self, other, addr, name, "worker", tok["workers"], "UNAVAILABLE")
        refused(self, d, addr, name, "worker", None, "UNAUTHENTICATED")
        for q in self.procs:
            q.terminate()


if __name__ == "__main__":
    unittest.main()

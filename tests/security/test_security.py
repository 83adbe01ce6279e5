#!/usr/bin/python3
"""Security tests from Python: a grpcio client (stubs generated at test time
by tests/interop/fpsharness.py, code nobody on this project wrote) and the
factorps package, against real shards with TLS, mutual TLS and tokens.

The grpcio side checks every method, the PushPull stream included, and the
malformed ways of sending a token that libfactorps never produces; the
package side checks that connect(tls_*=..., auth_token=...) reaches the C
options. Certificates come from gencerts.sh (openssl CLI).

Environment (set by CMake): FPS_SERVER, FPS_PROTO_DIR, FPS_GENCERTS, and
FACTORPS_LIB for the package tests (absent in sanitizer builds: then they
are skipped; the C tests cover libfactorps there).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "interop"))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

import fpsharness as H  # noqa: E402

CERTS = None


def setUpModule():
    global CERTS
    CERTS = tempfile.mkdtemp(prefix="fps-sec-py-")
    script = os.environ.get("FPS_GENCERTS", os.path.join(HERE, "gencerts.sh"))
    subprocess.run(["sh", script, CERTS], check=True, timeout=60)


def tearDownModule():
    shutil.rmtree(CERTS, True)


def cert(name):
    return os.path.join(CERTS, name)


def read(name):
    with open(cert(name), "rb") as f:
        return f.read()


def token(name="token"):
    return read(name).decode().strip()


def secure_server(*extra):
    return H.Server("--mode", "async", "--tls-cert", cert("server.pem"), "--tls-key", cert("server.key"),
                    "--tls-client-ca", cert("ca.pem"), "--auth-token-file", cert("tokens.txt"), *extra)


class WithMetadata:
    """A stub whose every call carries fixed metadata (or none)."""

    def __init__(self, stub, md):
        self._stub, self._md = stub, md

    def __getattr__(self, name):
        fn = getattr(self._stub, name)
        return lambda *a, **kw: fn(*a, metadata=self._md, **kw)


class Grpcio(unittest.TestCase):
    def channel(self, srv, client="client", call_token=None):
        _, _, grpc = H.stubs()
        creds = grpc.ssl_channel_credentials(root_certificates=read("ca.pem"),
                                             private_key=read(client + ".key") if client else None,
                                             certificate_chain=read(client + ".pem") if client else None)
        if call_token:
            # grpcio's own bearer-token credentials: the standard way a
            # gRPC client sends "authorization: Bearer <token>".
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(call_token))
        return grpc.secure_channel(srv.addr, creds)

    def test_every_method_needs_the_token(self):
        pb, pbg, grpc = H.stubs()
        srv = secure_server()
        try:
            good_ch = self.channel(srv, call_token=token())
            good = pbg.ParameterServerStub(good_ch)
            init = np.arange(12, dtype=np.float32)
            H.create(good, "w", [3, 4], init)
            H.push(good, 0, 0, {"w": ([3, 4], np.ones(12, np.float32))})
            before, versions = H.pull(good, {"w": [3, 4]})
            self.assertEqual(versions, {"w": 1})
            st_before, _ = H.stats(good)

            bare_ch = self.channel(srv)
            bare = pbg.ParameterServerStub(bare_ch)
            wrong = token("wrong-token")
            variants = {
                "missing": [],
                "wrong": [("authorization", "Bearer " + wrong)],
                "not bearer": [("authorization", "Basic " + token())],
                "no space": [("authorization", "Bearer" + token())],
                "empty": [("authorization", "Bearer ")],
                "twice": [("authorization", "Bearer " + token()), ("authorization", "Bearer " + wrong)],
                "prefix": [("authorization", "Bearer " + token()[:-1])],
                "longer": [("authorization", "Bearer " + token() + "0")],
            }
            for what, md in variants.items():
                stub = WithMetadata(bare, md)
                calls = {
                    "Create": lambda: H.create(stub, "evil", [2], np.ones(2, np.float32), timeout=10),
                    "PushPull": lambda: H.push(stub, 0, 1, {"w": ([3, 4], np.ones(12, np.float32))},
                                               timeout=10),
                    "Pull": lambda: H.pull(stub, {"w": [3, 4]}, timeout=10),
                    "Stats": lambda: H.stats(stub, timeout=10),
                }
                if hasattr(pb, "CheckpointRequest"):
                    calls["Checkpoint"] = lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=10)
                if hasattr(pb, "GetStateRequest"):
                    calls["GetState"] = lambda: list(stub.GetState(pb.GetStateRequest(names=["w"]), timeout=10))
                for method, call in calls.items():
                    with self.subTest(token=what, method=method):
                        with self.assertRaises(grpc.RpcError) as cm:
                            call()
                        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED,
                                         cm.exception.details())
                        # The reply never echoes what was sent.
                        self.assertNotIn(wrong, cm.exception.details() or "")
                        self.assertNotIn(token(), cm.exception.details() or "")
            # An unknown method is refused before it is found unknown.
            nope = bare_ch.unary_unary("/factorps.v1.ParameterServer/Nope")
            with self.assertRaises(grpc.RpcError) as cm:
                nope(b"", timeout=10)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

            # Nothing changed; the second token of the file works too.
            two = pbg.ParameterServerStub(self.channel(srv, call_token=token("token2")))
            after, versions = H.pull(two, {"w": [3, 4]})
            self.assertEqual(versions, {"w": 1})
            np.testing.assert_array_equal(after["w"], before["w"])
            st_after, tensors = H.stats(two)
            self.assertEqual(list(tensors), ["w"])
            self.assertEqual(st_after.shard.pushes, st_before.shard.pushes)
            self.assertEqual(st_after.shard.pushes, 1)
            good_ch.close()
            bare_ch.close()
        finally:
            srv.stop()

    def test_handshake_refusals_are_unavailable(self):
        _, pbg, grpc = H.stubs()
        srv = secure_server()
        try:
            for what, ch in [("plaintext", grpc.insecure_channel(srv.addr)),
                             ("no certificate", self.channel(srv, client=None, call_token=token())),
                             ("other CA", self.channel(srv, client="other", call_token=token())),
                             ("expired", self.channel(srv, client="expired", call_token=token()))]:
                with self.subTest(what):
                    stub = pbg.ParameterServerStub(ch)
                    with self.assertRaises(grpc.RpcError) as cm:
                        H.create(stub, "evil", [2], np.ones(2, np.float32), timeout=10)
                    self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
                    ch.close()
            # Every channel closed before the interpreter exits: grpcio can
            # crash in its own teardown with a TLS channel still open (the
            # test then reported OK and exited non-zero, 1 run in 7 here).
            ch = self.channel(srv, call_token=token())
            try:
                _, tensors = H.stats(pbg.ParameterServerStub(ch))
                self.assertEqual(tensors, {})
            finally:
                ch.close()
        finally:
            srv.stop()


class Roles(unittest.TestCase):
    """Roles: one credential must not grant everything. Worker, admin
    and peer tokens: each role may do its own calls only, refused calls
    change nothing, a peer token speaks for its own shard only; one token
    alone keeps every role (the one-machine setup)."""

    def setUp(self):
        self.pb, self.pbg, self.grpc = H.stubs()
        self.dir = tempfile.mkdtemp(prefix="fps-roles-")
        self.tok = {r: os.urandom(24).hex() for r in ("worker", "admin", "peer0", "peer2", "stranger")}
        self.files = {}
        for name, lines in [("workers", [self.tok["worker"]]), ("admins", [self.tok["admin"]]),
                            ("peers", ["0:" + self.tok["peer0"], "2:" + self.tok["peer2"]])]:
            path = os.path.join(self.dir, name)
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            os.chmod(path, 0o600)
            self.files[name] = path
        self.channels = []

    def tearDown(self):
        for ch in self.channels:
            ch.close()
        shutil.rmtree(self.dir, True)

    def stub(self, srv, who):
        ch = self.grpc.insecure_channel(srv.addr)
        self.channels.append(ch)
        return WithMetadata(self.pbg.ParameterServerStub(ch), [("authorization", "Bearer " + self.tok[who])])

    def calls(self, stub):
        pb = self.pb
        w = np.ones(12, np.float32)
        replace = pb.TensorCreate(name="w", shape=[3, 4], optimizer=H.optimizer(), replace=True,
                                  init=pb.TensorSlice(dtype=pb.DTYPE_F32, data=np.zeros(12, np.float32).tobytes()))
        return {
            "Create": lambda: H.create(stub, "w", [3, 4], w, shard_id=1, shard_count=3, timeout=10),
            "Create replace": lambda: stub.Create(pb.CreateRequest(shard_id=1, shard_count=3, tensors=[replace]),
                                                  timeout=10),
            "PushPull": lambda: H.push(stub, 0, 1, {"w": ([3, 4], w)}, timeout=10),
            "Pull": lambda: H.pull(stub, {"w": [3, 4]}, timeout=10),
            "GetState": lambda: list(stub.GetState(pb.GetStateRequest(names=["w"]), timeout=10)),
            "Stats": lambda: H.stats(stub, timeout=10),
            "Checkpoint": lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=10),
            "Exchange": lambda: stub.Exchange(pb.ExchangeRequest(name="w", from_shard=0, shard_count=3,
                                                                 phase=pb.EXCHANGE_PHASE_STATS), timeout=10),
        }

    def code(self, fn):
        try:
            fn()
            return None
        except self.grpc.RpcError as e:
            return e.code(), e.details()

    def test_each_role_its_own_calls(self):
        C = self.grpc.StatusCode
        ckpt = os.path.join(self.dir, "ckpt")
        srv = H.Server("--mode", "async", "--shard-id", 1, "--shard-count", 3, "--checkpoint-dir", ckpt,
                       "--auth-token-file", self.files["workers"], "--admin-token-file", self.files["admins"],
                       "--exchange-token-file", self.files["peers"])
        try:
            worker, admin = self.stub(srv, "worker"), self.stub(srv, "admin")
            H.create(worker, "w", [3, 4], np.arange(12, dtype=np.float32), shard_id=1, shard_count=3)
            H.push(worker, 0, 0, {"w": ([3, 4], np.ones(12, np.float32))})
            before, versions = H.pull(worker, {"w": [3, 4]})
            self.assertEqual(versions, {"w": 1})
            # What each role may not do: PERMISSION_DENIED naming the role.
            denied = {"worker": ["Create replace", "Checkpoint", "Exchange"],
                      "admin": ["Exchange"],
                      "peer0": ["Create", "Create replace", "PushPull", "Pull", "GetState", "Stats",
                                "Checkpoint"]}
            needs = {"Create replace": "admin", "Checkpoint": "admin", "Exchange": "peer"}
            for who, methods in denied.items():
                calls = self.calls(self.stub(srv, who))
                for method in methods:
                    with self.subTest(who=who, method=method):
                        got = self.code(calls[method])
                        self.assertIsNotNone(got, "%s may %s" % (who, method))
                        self.assertEqual(got[0], C.PERMISSION_DENIED, got[1])
                        # A peer is refused at the method (Create needs a worker).
                        need = needs.get(method if who != "peer0" else method.split()[0], "worker")
                        self.assertIn("the %s role" % need, got[1])
                        self.assertNotIn(self.tok[who], got[1])
            # An unknown token is still UNAUTHENTICATED.
            got = self.code(self.calls(self.stub(srv, "stranger"))["Stats"])
            self.assertEqual(got[0], C.UNAUTHENTICATED, got[1])
            # Nothing the refused calls sent was applied.
            after, versions = H.pull(worker, {"w": [3, 4]})
            self.assertEqual(versions, {"w": 1})
            np.testing.assert_array_equal(after["w"], before["w"])
            self.assertEqual(H.stats(worker)[0].shard.pushes, 1)
            self.assertEqual([f for f in os.listdir(ckpt) if f.endswith(".safetensors")] if os.path.exists(ckpt) else [],
                             [], "a worker's Checkpoint wrote a file")
            # What each may do: workers their calls, the admin its own too.
            wcalls = self.calls(worker)
            for method in ("Create", "PushPull", "Pull", "GetState", "Stats"):
                with self.subTest(who="worker", method=method):
                    self.assertIsNone(self.code(wcalls[method]))
            acalls = self.calls(admin)
            for method in ("Create", "Create replace", "PushPull", "Pull", "GetState", "Stats", "Checkpoint"):
                with self.subTest(who="admin", method=method):
                    self.assertIsNone(self.code(acalls[method]))
            # A peer token speaks for its own shard only: shard 2's token
            # with from_shard 0 is refused; shard 0's reaches the core
            # (which holds no block of 'w': NOT_FOUND).
            ex = self.pb.ExchangeRequest(name="w", from_shard=0, shard_count=3, phase=self.pb.EXCHANGE_PHASE_STATS)
            got = self.code(lambda: self.stub(srv, "peer2").Exchange(ex, timeout=10))
            self.assertEqual(got[0], C.PERMISSION_DENIED, got[1])
            self.assertIn("from_shard 0", got[1])
            self.assertIn("shard 2's", got[1])
            got = self.code(lambda: self.stub(srv, "peer0").Exchange(ex, timeout=10))
            self.assertNotIn(got[0], (C.PERMISSION_DENIED, C.UNAUTHENTICATED), got[1])
        finally:
            srv.stop()

    def test_one_token_keeps_every_role(self):
        ckpt = os.path.join(self.dir, "ckpt")
        srv = H.Server("--mode", "async", "--shard-id", 1, "--shard-count", 3, "--checkpoint-dir", ckpt,
                       "--auth-token-file", self.files["workers"])
        try:
            calls = self.calls(self.stub(srv, "worker"))
            for method in ("Create", "Create replace", "PushPull", "Pull", "GetState", "Stats", "Checkpoint"):
                with self.subTest(method=method):
                    self.assertIsNone(self.code(calls[method]))
            got = self.code(calls["Exchange"])
            self.assertNotIn(got[0], (self.grpc.StatusCode.PERMISSION_DENIED,
                                      self.grpc.StatusCode.UNAUTHENTICATED), got[1])
        finally:
            srv.stop()

    def test_bad_role_files_stop_the_start(self):
        bad = os.path.join(self.dir, "bad")
        for lines, words in [(["5:" + "a" * 32], "below --shard-count 3"), (["x:" + "a" * 32], "<shard-id>:<token>"),
                             (["1:"], "<shard-id>:<token>"), (["a" * 32], "<shard-id>:<token>")]:
            with open(bad, "w") as f:
                f.write("\n".join(lines) + "\n")
            with self.subTest(lines=lines):
                with self.assertRaises(H.ServerExited) as cm:
                    H.Server("--shard-count", 3, "--auth-token-file", self.files["workers"],
                             "--exchange-token-file", bad)
                self.assertIn("--exchange-token-file", cm.exception.err)
                self.assertIn(words, cm.exception.err)
                self.assertEqual(cm.exception.code, 2)
        # Bad flags exit 2, like the peers' files (these exited 1).
        with self.assertRaises(H.ServerExited) as cm:
            H.Server("--admin-token-file", self.files["admins"])
        self.assertIn("needs --auth-token-file", cm.exception.err)
        self.assertEqual(cm.exception.code, 2)
        with self.assertRaises(H.ServerExited) as cm:
            H.Server("--auth-token-file", os.path.join(self.dir, "missing"))
        self.assertIn("--auth-token-file", cm.exception.err)
        self.assertEqual(cm.exception.code, 2)


@unittest.skipUnless(os.environ.get("FACTORPS_LIB"), "FACTORPS_LIB not set (sanitizer build)")
class Package(unittest.TestCase):
    def test_connect_options(self):
        import factorps
        srv = secure_server()
        try:
            opts = dict(tls_ca_file=cert("ca.pem"), tls_cert_file=cert("client.pem"),
                        tls_key_file=cert("client.key"), deadline=10, max_retries=0)
            with factorps.connect([srv.addr], auth_token=token(), **opts) as c:
                c.create([{"name": "w", "shape": [2, 3], "init": np.ones((2, 3), np.float32)}])
                params, versions = c.push_pull({"w": np.full((2, 3), 0.5, np.float32)})
                self.assertEqual(versions["w"], 1)
                before = params["w"].copy()
            for kw, err in [({}, factorps.UnauthenticatedError),
                            ({"auth_token": token("wrong-token")}, factorps.UnauthenticatedError),
                            ({"auth_token": token(), "tls_cert_file": cert("other.pem"),
                              "tls_key_file": cert("other.key")}, factorps.UnavailableError),
                            ({"auth_token": token(), "tls_server_name": "evil.example"},
                             factorps.UnavailableError)]:
                with self.subTest(kw=sorted(kw)):
                    o = dict(opts, **kw)
                    with factorps.connect([srv.addr], **o) as c:
                        with self.assertRaises(err):
                            c.stats()
            with self.assertRaises(factorps.InvalidArgumentError):
                factorps.connect([srv.addr], tls_cert_file=cert("client.pem"))
            with factorps.connect([srv.addr], auth_token=token("token2"),
                                  tls_server_name="shard.factorps.test", **opts) as c:
                c.discover()
                params, versions = c.pull(["w"])
                self.assertEqual(versions["w"], 1)
                np.testing.assert_array_equal(params["w"], before)
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main()

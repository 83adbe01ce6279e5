#!/usr/bin/python3
"""Interop harness: a real factorps-server process and a grpcio client that
nobody on this project wrote, generated at test time from the wire contract.

Stubs come from protoc + grpc_python_plugin (Debian's protobuf-compiler and
protobuf-compiler-grpc) into a temporary directory; the generated modules
are imported under private names so they never clash with the project's own
`factorps` Python package.

Multi-shard jobs whose shards know each other (--peers, for split tensors):
Job(n, ...) picks free loopback ports, starts shards 0..n-1 on them with the
same --peers list (again on fresh ports if one was taken meanwhile), with
plaintext, TLS, mutual TLS and bearer-token variants (certificates from
tests/security/gencerts.sh); kill() and restart() a shard on its port.

Environment (set by CMake): FPS_SERVER (factorps-server binary), FPS_PROTO_DIR
(the proto/ directory); FPS_GENCERTS (gencerts.sh, default the repo's);
FPS_TEST_TIMEOUT (the test's CTest TIMEOUT: arms the watchdog below).
"""
import atexit
import faulthandler
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import fpsproc  # noqa: E402  (tests/fpsproc.py: the one launcher of factorps-server)
from fpsproc import SANITIZER_MARKERS, SERVER, ServerExited, free_ports  # noqa: E402,F401
PROTO_DIR = os.environ.get("FPS_PROTO_DIR", os.path.join(REPO, "proto"))
GENCERTS = os.environ.get("FPS_GENCERTS", os.path.join(REPO, "tests", "security", "gencerts.sh"))

MiB = 1 << 20
MAX_MSG = 64 * MiB
SLICE_ELEMS = MiB  # 4 MiB of fp32 per slice, like libfactorps' default

_mods = None

_live = weakref.WeakSet()  # Servers started here: the watchdog kills those still running


def _watchdog(seconds):
    """gRPC 1.51 now and then never ends a cancelled call (tests/load counts
    them); grpcio then waits for it for good, and CTest's TIMEOUT kills the
    test without a word. Shortly before that, print every thread's stack
    (which wait is stuck), kill the shards this process started, fail."""
    def fire():
        sys.stderr.write("fpsharness: still running after %d s (5 s before CTest's TIMEOUT): a wait that "
                         "never ended, most likely a gRPC call; every thread's stack:\n" % seconds)
        faulthandler.dump_traceback(all_threads=True)
        for srv in list(_live):
            if srv.proc.poll() is None:
                srv.proc.kill()
            shutil.rmtree(srv.dir, True)
        os._exit(1)
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


if os.environ.get("FPS_TEST_TIMEOUT", "").isdigit() and int(os.environ["FPS_TEST_TIMEOUT"]) > 10:
    _watchdog(int(os.environ["FPS_TEST_TIMEOUT"]) - 5)


# How long a test thread doing one gRPC call (timeout=60 s in these tests)
# may take before it counts as hung: its own deadline plus room for a
# loaded machine.
JOIN_SECONDS = 90


def join(threads, what, seconds=JOIN_SECONDS):
    """Joins threads, all within `seconds`. One still running then is a wait
    that never ended (a call past its own deadline): print every thread's
    stack and fail naming `what`, instead of hanging until the watchdog or
    CTest's TIMEOUT. Threads should be daemons, so a hung one cannot keep
    the process alive after the failure."""
    end = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        sys.stderr.write("fpsharness: %s: %s still running after %g s; every thread's stack:\n"
                         % (what, ", ".join(stuck), seconds))
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        raise AssertionError("%s: thread(s) %s did not finish within %g s (stacks on stderr)"
                             % (what, ", ".join(stuck), seconds))


def stubs():
    """(pb2, pb2_grpc, grpc), generated once per process."""
    global _mods
    if _mods is not None:
        return _mods
    import grpc
    out = tempfile.mkdtemp(prefix="fps-interop-")
    atexit.register(shutil.rmtree, out, True)
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.run(["protoc", "--proto_path=" + PROTO_DIR, "--python_out=" + out,
                    "--grpc_python_out=" + out, "--plugin=protoc-gen-grpc_python=" + plugin,
                    "factorps/v1/factorps.proto"], check=True, timeout=120)
    gen = os.path.join(out, "factorps", "v1")
    # Load the message module under a private name, and point the service
    # module's "from factorps.v1 import factorps_pb2" at it.
    spec = importlib.util.spec_from_file_location("fps_interop_pb2", os.path.join(gen, "factorps_pb2.py"))
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    with open(os.path.join(gen, "factorps_pb2_grpc.py")) as f:
        src = f.read()
    src = src.replace("from factorps.v1 import factorps_pb2 as", "import fps_interop_pb2 as")
    sys.modules["fps_interop_pb2"] = pb
    pbg = type(sys)("fps_interop_pb2_grpc")
    exec(compile(src, "factorps_pb2_grpc.py", "exec"), pbg.__dict__)
    _mods = (pb, pbg, grpc)
    return _mods


class Server(fpsproc.ShardProcess):
    """factorps-server on `listen` (default 127.0.0.1:0), started by the
    tests' one launcher (tests/fpsproc.py); stop() checks it exits 0 and
    clean. `security` (a Security, or None for plaintext) says how
    channel() and stub reach it. `line` is its "listening on" line."""

    def __init__(self, *args, timeout=30, env=None, listen="127.0.0.1:0", security=None):
        self.args = args
        self.security = security
        super().__init__(args, listen=listen, env=env, timeout=timeout, first_line=True)
        self.line = self.first_line
        self.addr = "127.0.0.1:%d" % self.port
        self._channel = None
        self._stub = None
        _live.add(self)

    def channel(self):
        _, _, grpc = stubs()
        opts = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
        if self.security is not None and self.security.tls:
            return grpc.secure_channel(self.addr, self.security.grpc_credentials(), options=opts)
        return grpc.insecure_channel(self.addr, options=opts)

    @property
    def stub(self):
        """A stub for this shard; with a token, every call carries it."""
        if self._stub is None:
            _, pbg, _ = stubs()
            self._channel = self.channel()
            self._stub = pbg.ParameterServerStub(self._channel)
            md = self.security.metadata() if self.security is not None else []
            if md:
                self._stub = WithMetadata(self._stub, md)
        return self._stub

    def _close_channel(self):
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def kill(self):
        """SIGKILL (no checkpoint, no clean exit); waits for it."""
        self._close_channel()
        super().kill()
        self.remove()

    def stop(self, timeout=60):
        """SIGTERM; returns (exit code, stderr). Raises if it hangs or a
        sanitizer reported anything."""
        self._close_channel()
        rc = self.terminate(timeout)
        err = self.stderr()
        self.remove()
        if rc is None:
            raise AssertionError("factorps-server did not exit within %d s of SIGTERM:\n%s" % (timeout, err))
        for m in SANITIZER_MARKERS:
            if m in err:
                raise AssertionError("sanitizer report from factorps-server:\n" + err)
        if rc != 0:
            raise AssertionError("factorps-server exited %d:\n%s" % (rc, err))
        return rc, err


class WithMetadata:
    """A stub whose every call carries fixed metadata (a bearer token)."""

    def __init__(self, stub, md):
        self._stub, self._md = stub, md

    def __getattr__(self, name):
        fn = getattr(self._stub, name)
        return lambda *a, **kw: fn(*a, metadata=self._md, **kw)


# ------------------------------------------------------ multi-shard jobs

_certs_dir = None


def certs():
    """A directory of test certificates and tokens (gencerts.sh), made once
    per process: ca.pem, server.pem/.key (127.0.0.1, ::1, localhost,
    shard.factorps.test), client.pem/.key, token, tokens.txt, ..."""
    global _certs_dir
    if _certs_dir is None:
        d = tempfile.mkdtemp(prefix="fps-certs-")
        atexit.register(shutil.rmtree, d, True)
        subprocess.run(["sh", GENCERTS, d], check=True, timeout=120, stdout=subprocess.DEVNULL)
        _certs_dir = d
    return _certs_dir


class Security:
    """How a job's shards serve and call each other, and how a client
    reaches them. kind: "plain", "tls", "mtls" (shards require client
    certificates, and present client.pem to each other), "token"
    (plaintext with bearer tokens) or "mtls+token". peer_overrides
    replace the calling side's flags (e.g. {"--peer-token-file": path} to
    give shards a wrong token)."""

    KINDS = ("plain", "tls", "mtls", "token", "mtls+token")

    def __init__(self, kind="plain", peer_overrides=None):
        if kind not in self.KINDS:
            raise ValueError("security kind %r (one of %s)" % (kind, ", ".join(self.KINDS)))
        self.kind = kind
        self.tls = kind in ("tls", "mtls", "mtls+token")
        self.mtls = kind in ("mtls", "mtls+token")
        self.token = kind in ("token", "mtls+token")
        self.peer_overrides = dict(peer_overrides or {})
        self.dir = certs() if kind != "plain" else None

    def path(self, name):
        return os.path.join(self.dir, name)

    def server_args(self):
        a = []
        if self.tls:
            a += ["--tls-cert", self.path("server.pem"), "--tls-key", self.path("server.key")]
        if self.mtls:
            a += ["--tls-client-ca", self.path("ca.pem")]
        if self.token:
            a += ["--auth-token-file", self.path("tokens.txt")]
        return a

    def peer_args(self):
        flags = {}
        if self.tls:
            flags["--peer-tls-ca"] = self.path("ca.pem")
        if self.mtls:
            flags["--peer-tls-cert"] = self.path("client.pem")
            flags["--peer-tls-key"] = self.path("client.key")
        if self.token:
            flags["--peer-token-file"] = self.path("token")
        flags.update(self.peer_overrides)
        a = []
        for k, v in flags.items():
            if v is not None:
                a += [k, v]
        return a

    def token_value(self):
        with open(self.path("token")) as f:
            return f.read().strip()

    def metadata(self):
        return [("authorization", "Bearer " + self.token_value())] if self.token else []

    def grpc_credentials(self):
        _, _, grpc = stubs()

        def read(n):
            with open(self.path(n), "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem"),
            private_key=read("client.key") if self.mtls else None,
            certificate_chain=read("client.pem") if self.mtls else None)

    def client_options(self):
        """Keyword arguments for factorps.connect() (libfactorps' TLS and
        token options)."""
        o = {}
        if self.tls:
            o["tls_ca_file"] = self.path("ca.pem")
        if self.mtls:
            o["tls_cert_file"] = self.path("client.pem")
            o["tls_key_file"] = self.path("client.key")
        if self.token:
            o["auth_token"] = self.token_value()
        return o


class Job:
    """n shards of one job (--shard-id i --shard-count n), each told every
    shard's address with --peers, on 127.0.0.1 ports picked first. `args`
    go to every shard, shard_args[i] to shard i only. If a shard cannot
    listen because its port was taken between picking and binding, the
    whole job starts again on fresh ports (up to `attempts` times)."""

    def __init__(self, n, *args, security="plain", shard_args=None, env=None, timeout=30, attempts=5,
                 peers=True):
        self.n = n
        self.security = security if isinstance(security, Security) else Security(security)
        self.args = [str(a) for a in args]
        self.shard_args = [[str(a) for a in (shard_args[i] if shard_args else [])] for i in range(n)]
        self.env = env
        self.timeout = timeout
        self.use_peers = peers
        self.servers = [None] * n
        for attempt in range(attempts):
            self.ports = free_ports(n)
            self.addrs = ["127.0.0.1:%d" % p for p in self.ports]
            try:
                for i in range(n):
                    self.servers[i] = self._start(i)
                return
            except ServerExited as e:
                self._kill_all()
                if "cannot listen" not in e.err or attempt == attempts - 1:
                    raise

    def shard_argv(self, i):
        a = ["--shard-id", i, "--shard-count", self.n]
        if self.use_peers:
            a += ["--peers", ",".join(self.addrs)] + self.security.peer_args()
        return a + self.security.server_args() + self.args + self.shard_args[i]

    def _start(self, i):
        return Server(*self.shard_argv(i), timeout=self.timeout, env=self.env, listen=self.addrs[i],
                      security=self.security)

    def _kill_all(self):
        for i, s in enumerate(self.servers):
            if s is not None and s.proc.poll() is None:
                s.kill()
            self.servers[i] = None

    def __getitem__(self, i):
        return self.servers[i]

    def stub(self, i):
        return self.servers[i].stub

    def kill(self, i):
        """SIGKILLs shard i (its port stays in --peers of the others)."""
        self.servers[i].kill()

    def restart(self, i, attempts=50):
        """Starts shard i again, same flags and port (retrying while the
        port is still held by the dying process's sockets)."""
        for attempt in range(attempts):
            try:
                self.servers[i] = self._start(i)
                return self.servers[i]
            except ServerExited as e:
                if "cannot listen" not in e.err or attempt == attempts - 1:
                    raise
                time.sleep(0.1)

    def stop(self):
        """SIGTERMs every shard still running; raises (after stopping all)
        if one hung, crashed or reported a sanitizer error."""
        errors = []
        for s in self.servers:
            if s is None or s.proc.returncode is not None:
                continue
            try:
                s.stop()
            except AssertionError as e:
                errors.append(str(e))
        if errors:
            raise AssertionError("\n".join(errors))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.stop()
        else:
            self._kill_all()
        return False


# ------------------------------------------------------------ client helpers

def optimizer(flavor="torch", **fields):
    pb, _, _ = stubs()
    cfg = pb.AdafactorConfig(flavor=pb.FLAVOR_TORCH if flavor == "torch" else pb.FLAVOR_HF)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


def create(stub, name, shape, init=None, opt=None, shard_id=0, shard_count=1, slice_elems=SLICE_ELEMS,
           timeout=60):
    """Creates one tensor, sending init (np.float32) in as many Create calls
    as slices. Returns the last CreateResponse."""
    pb, _, _ = stubs()
    opt = opt or optimizer()
    if init is None:
        req = pb.CreateRequest(shard_id=shard_id, shard_count=shard_count,
                               tensors=[pb.TensorCreate(name=name, shape=shape, optimizer=opt)])
        return stub.Create(req, timeout=timeout)
    flat = np.ascontiguousarray(init, dtype=np.float32).reshape(-1)
    resp = None
    for off in range(0, max(flat.size, 1), slice_elems):
        part = flat[off:off + slice_elems]
        sl = pb.TensorSlice(dtype=pb.DTYPE_F32, offset=off, data=part.tobytes())
        req = pb.CreateRequest(shard_id=shard_id, shard_count=shard_count,
                               tensors=[pb.TensorCreate(name=name, shape=shape, optimizer=opt, init=sl)])
        resp = stub.Create(req, timeout=timeout)
    return resp


def grad_messages(worker, step, grads, slice_elems=SLICE_ELEMS, dtype=None, skip_params=False):
    """PushPullRequest messages for {name: (shape, np.float32 array)}."""
    pb, _, _ = stubs()
    dtype = pb.DTYPE_F32 if dtype is None else dtype
    first = True
    for name, (shape, g) in grads.items():
        flat = np.ascontiguousarray(g, dtype=np.float32).reshape(-1)
        for off in range(0, flat.size, slice_elems):
            part = flat[off:off + slice_elems]
            data = part.tobytes() if dtype == pb.DTYPE_F32 else to_bf16(part).tobytes()
            yield pb.PushPullRequest(worker_id=worker, step=step, skip_params=skip_params and first,
                                     grads=[pb.TensorSlice(name=name, dtype=dtype, shape=shape, offset=off,
                                                           data=data)])
            first = False


def collect(responses, shapes):
    """Reassembles streamed PushPull/Pull responses: ({name: array}, {name: version})."""
    pb, _, _ = stubs()
    out, versions = {}, {}
    for r in responses:
        for s in r.params:
            n = int(np.prod(shapes[s.name])) if shapes[s.name] else 1
            if s.name not in out:
                out[s.name] = np.full(n, np.nan, dtype=np.float32)
            if s.dtype == pb.DTYPE_F32:
                vals = np.frombuffer(s.data, dtype="<f4")
            else:
                vals = from_bf16(np.frombuffer(s.data, dtype="<u2"))
            out[s.name][s.offset:s.offset + vals.size] = vals
        for v in r.versions:
            versions[v.name] = v.version
    return {k: v.reshape(shapes[k]) for k, v in out.items()}, versions


def push(stub, worker, step, grads, timeout=60, **kw):
    shapes = {k: v[0] for k, v in grads.items()}
    return collect(stub.PushPull(grad_messages(worker, step, grads, **kw), timeout=timeout), shapes)


def pull(stub, names_shapes, timeout=60, dtype=0):
    pb, _, _ = stubs()
    return collect(stub.Pull(pb.PullRequest(names=list(names_shapes), dtype=dtype), timeout=timeout), names_shapes)


def proc_status_bytes(pid, field):
    """A size field of /proc/PID/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError("no %s in /proc/%d/status" % (field, pid))


def peak_rss(pid):
    """The process's peak resident set (VmHWM), bytes."""
    return proc_status_bytes(pid, "VmHWM")


def stats(stub, log=0, timeout=30):
    pb, _, _ = stubs()
    r = stub.Stats(pb.StatsRequest(include_tensors=True, apply_log_limit=log), timeout=timeout)
    return r, {t.name: t for t in r.tensors}


def to_bf16(a):
    """fp32 -> bf16 bits, round to nearest even (NaN kept)."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def from_bf16(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------- numpy Adafactor (torch)

def torch_adafactor_step(param, grad, row, col, var, t, lr=1e-2, decay=-0.8, eps1=None, eps2=1e-3, d=1.0):
    """One torch.optim.Adafactor step in float64 (tests/vectors/README.md),
    default hyperparameters, no weight decay. Returns the new param (f64);
    row/col/var are updated in place. t is the step after the increment."""
    eps1 = np.finfo(np.float32).eps if eps1 is None else eps1
    p = param.astype(np.float64)
    g = grad.astype(np.float64)
    w = t ** decay
    rho = min(lr, 1 / np.sqrt(t))
    alpha = max(eps2, np.sqrt(np.mean(p * p))) * rho

    def lerp(a, b):
        return a + w * (b - a) if abs(w) < 0.5 else b - (b - a) * (1 - w)

    if p.ndim >= 2:
        row[...] = lerp(row, np.mean(g * g, axis=-1))
        col[...] = lerp(col, np.mean(g * g, axis=-2))
        v = row[..., :, None] * col[..., None, :] / np.maximum(np.mean(row, axis=-1)[..., None, None], eps1)
    else:
        var[...] = lerp(var, g * g)
        v = var
    u = g / np.sqrt(np.maximum(v, eps1 * eps1))
    denom = max(1.0, np.sqrt(np.mean(u * u)) / d)
    return p - (alpha / denom) * u

#!/usr/bin/python3
"""Interop harness: a real factorps-server process and a grpcio client that
nobody on this project wrote, generated at test time from the wire contract.

Stubs come from protoc + grpc_python_plugin (Debian's protobuf-compiler and
protobuf-compiler-grpc) into a temporary directory; the generated modules
are imported under private names so they never clash with the project's own
`factorps` Python package.

Environment (set by CMake): FPS_SERVER (factorps-server binary), FPS_PROTO_DIR
(the proto/ directory).
"""
import atexit
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SERVER = os.environ.get("FPS_SERVER", os.path.join(REPO, "build", "server", "factorps-server"))
PROTO_DIR = os.environ.get("FPS_PROTO_DIR", os.path.join(REPO, "proto"))

MiB = 1 << 20
MAX_MSG = 64 * MiB
SLICE_ELEMS = MiB  # 4 MiB of fp32 per slice, like libfactorps' default

_mods = None


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


SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "ThreadSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")


class Server:
    """factorps-server on 127.0.0.1:0; stop() checks it exits 0 and clean."""

    def __init__(self, *args, timeout=30, env=None):
        self.dir = tempfile.mkdtemp(prefix="fps-server-")
        self.port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "stderr.log")
        self.log = open(self.log_path, "wb")
        env = dict(os.environ, **(env or {}))
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        cmd = [SERVER, "--listen", "127.0.0.1:0", "--port-file", self.port_file] + [str(a) for a in args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        t0 = time.monotonic()
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise RuntimeError("factorps-server exited early (%d): %s" % (self.proc.returncode, self.stderr()))
            if time.monotonic() - t0 > timeout:
                self.proc.kill()
                raise RuntimeError("factorps-server did not write its port file in %d s" % timeout)
            time.sleep(0.02)
        with open(self.port_file) as f:
            self.port = int(f.read())
        self.addr = "127.0.0.1:%d" % self.port
        self.line = self.proc.stdout.readline().decode()
        self._channel = None
        self._stub = None

    def stderr(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def channel(self):
        _, _, grpc = stubs()
        return grpc.insecure_channel(self.addr, options=[
            ("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)])

    @property
    def stub(self):
        if self._stub is None:
            _, pbg, _ = stubs()
            self._channel = self.channel()
            self._stub = pbg.ParameterServerStub(self._channel)
        return self._stub

    def stop(self, timeout=60):
        """SIGTERM; returns (exit code, stderr). Raises if it hangs or a
        sanitizer reported anything."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("factorps-server did not exit within %d s of SIGTERM:\n%s" % (timeout, self.stderr()))
        self.proc.stdout.close()
        err = self.stderr()
        self.log.close()
        shutil.rmtree(self.dir, True)
        for m in SANITIZER_MARKERS:
            if m in err:
                raise AssertionError("sanitizer report from factorps-server:\n" + err)
        if rc != 0:
            raise AssertionError("factorps-server exited %d:\n%s" % (rc, err))
        return rc, err


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

#!/usr/bin/python3
"""Helpers of the shard metrics tests: real factorps-server processes, a
grpcio client generated from proto/ at test time, and HTTP scrapes.

The grpcio stubs are generated into a temporary directory with protoc and
grpc_python_plugin (Debian's protobuf-compiler, protobuf-compiler-grpc), so
the tests depend only on the wire contract, not on libfactorps.

Also a command-line worker, run inside a network namespace by the
multi-host test:
  fpsgrpc.py worker --shards A,B --steps N   (prints one JSON line)
"""
import argparse
import atexit
import http.client
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

_stubs = None


def stubs():
    """(pb2, pb2_grpc, grpc), generated once per process."""
    global _stubs
    if _stubs is None:
        import grpc
        out = tempfile.mkdtemp(prefix="fps-stubs-")
        atexit.register(shutil.rmtree, out, True)
        plugin = shutil.which("grpc_python_plugin")
        if plugin is None:
            raise RuntimeError("grpc_python_plugin not found (protobuf-compiler-grpc)")
        subprocess.run(["protoc", "--proto_path=" + os.path.join(REPO, "proto"),
                        "--python_out=" + out, "--grpc_python_out=" + out,
                        "--plugin=protoc-gen-grpc_python=" + plugin,
                        "factorps/v1/factorps.proto"], check=True, timeout=60)
        sys.path.insert(0, out)
        pb = importlib.import_module("factorps.v1.factorps_pb2")
        pbg = importlib.import_module("factorps.v1.factorps_pb2_grpc")
        _stubs = (pb, pbg, grpc)
    return _stubs


# The tensors of each shard: (name, shape, optimizer fields). Shard i of a
# job holds TENSORS[i % 2], renamed with its id, so state figures differ
# per shard and are known exactly.
TENSORS = [
    [("w", [64, 33], {"flavor": "torch"}),
     ("b", [7], {"flavor": "torch"}),
     ("m", [2, 3, 4], {"flavor": "hf", "lr": 0.01, "relative_step": False, "beta1": 0.9})],
    [("w", [128, 17], {"flavor": "hf"}),
     ("e", [5], {"flavor": "hf", "lr": 0.01, "relative_step": False, "beta1": 0.9}),
     ("s", [], {"flavor": "torch"})],
]


def shard_tensors(shard_id):
    return [("s%d.%s" % (shard_id, n), shape, opt) for n, shape, opt in TENSORS[shard_id % 2]]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def expected_state(tensors):
    """The issue's definition: rows + cols for factored tensors (ndim >= 2,
    over the last two dims, leading dims a batch), numel otherwise, plus
    numel for momentum (hf with beta1); AdamW = 2 x numel."""
    e = {"row": 0, "col": 0, "var": 0, "momentum": 0, "params": 0, "adamw": 0, "tensors": 0}
    for _, shape, opt in tensors:
        n = numel(shape)
        if len(shape) >= 2:
            batch = numel(shape[:-2])
            e["row"] += batch * shape[-2]
            e["col"] += batch * shape[-1]
        else:
            e["var"] += n
        if opt.get("beta1") is not None:
            e["momentum"] += n
        e["params"] += n
        e["adamw"] += 2 * n
        e["tensors"] += 1
    e["elements"] = e["row"] + e["col"] + e["var"] + e["momentum"]
    return e


def _slice(pb, name, shape, arr, offset=0):
    return pb.TensorSlice(name=name, dtype=pb.DTYPE_F32, shape=shape, offset=offset,
                          data=np.ascontiguousarray(arr, dtype="<f4").tobytes())


def create(stub, shard_id, shard_count, tensors, timeout=30):
    pb, _, _ = stubs()
    req = pb.CreateRequest(shard_id=shard_id, shard_count=shard_count)
    rng = np.random.default_rng(shard_id)
    for name, shape, opt in tensors:
        cfg = pb.AdafactorConfig(flavor=pb.FLAVOR_TORCH if opt["flavor"] == "torch"
                                 else pb.FLAVOR_HF)
        for k, v in opt.items():
            if k != "flavor":
                setattr(cfg, k, v)
        init = rng.standard_normal(numel(shape)).astype("<f4")
        req.tensors.append(pb.TensorCreate(name=name, shape=shape, optimizer=cfg,
                                           init=_slice(pb, name, shape, init)))
    return stub.Create(req, timeout=timeout)


def push(stub, worker_id, step, tensors, timeout=30, skip_params=False):
    """One PushPull of every tensor; returns (params bytes received, versions)."""
    pb, _, _ = stubs()
    rng = np.random.default_rng(step * 1000 + worker_id)
    grads = [_slice(pb, n, shape, rng.standard_normal(numel(shape)).astype("<f4") * 0.01)
             for n, shape, _ in tensors]
    req = pb.PushPullRequest(worker_id=worker_id, step=step, grads=grads,
                             skip_params=skip_params)
    got, versions = 0, {}
    for resp in stub.PushPull(iter([req]), timeout=timeout):
        got += sum(len(p.data) for p in resp.params)
        versions.update({v.name: v.version for v in resp.versions})
    return got, versions


def pull(stub, names, timeout=30):
    pb, _, _ = stubs()
    got = 0
    for resp in stub.Pull(pb.PullRequest(names=names), timeout=timeout):
        got += sum(len(p.data) for p in resp.params)
    return got


def channel(addr):
    _, pbg, grpc = stubs()
    ch = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)])
    return ch, pbg.ParameterServerStub(ch)


def http_get(host, port, path, timeout=10.0, method="GET"):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()
    finally:
        c.close()


def metric(text, name, **labels):
    """Value of the first sample of `name` with (at least) these labels."""
    import re
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$', line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(m.group(4))
    return None


# The one launcher of factorps-server (tests/fpsproc.py) and its helpers,
# re-exported for the metrics tests.
sys.path.insert(0, os.path.dirname(HERE))
import fpsproc  # noqa: E402
from fpsproc import _die_with_parent as die_with_parent, server_env  # noqa: E402,F401


class Shard(fpsproc.ShardProcess):
    """One factorps-server process with its metrics endpoint, on `host`.
    `prefix` runs it through another command (e.g. ["ip", "netns", "exec",
    ns]); it dies with the test process."""

    def __init__(self, server, shard_id, shard_count, host="127.0.0.1", mode="sync",
                 workers=1, prefix=(), extra=()):
        self.id = shard_id
        args = ["--shard-id", shard_id, "--shard-count", shard_count, "--mode", mode,
                "--workers", workers, *extra]
        try:
            super().__init__(args, server=server, listen="%s:0" % host, metrics_listen="%s:0" % host,
                             prefix=prefix, timeout=20, name="shard%d" % shard_id,
                             die_with_parent=True)
        except RuntimeError as e:
            raise RuntimeError("shard %d did not start: %s" % (shard_id, e)) from None
        self.p = self.proc

    def read_log(self):
        return self.stderr()[-4000:]

    def scrape(self, path="/metrics"):
        return http_get(self.host, self.metrics_port, path)

    def stop(self):
        """SIGTERM, then the exit code (0 expected: a clean shutdown), or
        "hung" if it did not exit within 20 s. The log stays on failure."""
        rc = self.terminate(20)
        if rc is None:
            return "hung"
        if rc == 0:
            self.remove()
        return rc


def read_text(path):
    with open(path) as f:
        return f.read()


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus with deploy/prometheus/prometheus.yml, unchanged
    except 1 s scrape and rule evaluation intervals, and a targets file for `targets`
    (host:port of each shard's metrics endpoint)."""

    def __init__(self, targets, host="127.0.0.1", prefix=(), query_prefix=()):
        # query_prefix: run API requests through this command (a namespace
        # the test process is not in).
        self.query_prefix = list(query_prefix)
        self.dir = tempfile.mkdtemp(prefix="fps-prom-")
        cfg = read_text(os.path.join(REPO, "deploy", "prometheus", "prometheus.yml"))
        cfg = cfg.replace("scrape_interval: 15s", "scrape_interval: 1s")
        cfg = cfg.replace("evaluation_interval: 15s", "evaluation_interval: 1s")
        cfg = cfg.replace("scrape_timeout: 5s", "scrape_timeout: 1s")
        cfg = cfg.replace("refresh_interval: 30s", "refresh_interval: 1s")
        write_text(os.path.join(self.dir, "prometheus.yml"), cfg)
        shutil.copy(os.path.join(REPO, "deploy", "prometheus", "alerts.yml"), self.dir)
        os.makedirs(os.path.join(self.dir, "targets"))
        with open(os.path.join(self.dir, "targets", "test.yml"), "w") as f:
            f.write("- targets: [%s]\n  labels: {deployment: test}\n"
                    % ", ".join('"%s"' % t for t in targets))
        self.host = host
        for _ in range(5):
            # In a fresh namespace every port is free; on loopback ask the kernel.
            self.port = free_port() if not prefix else 9090
            self.log = open(os.path.join(self.dir, "log"), "w+")
            self.p = subprocess.Popen(
                [*prefix, "prometheus", "--config.file=" + os.path.join(self.dir, "prometheus.yml"),
                 "--storage.tsdb.path=" + os.path.join(self.dir, "data"),
                 "--web.listen-address=%s:%d" % (host, self.port)],
                stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            deadline = time.time() + 30
            while time.time() < deadline and self.p.poll() is None:
                try:
                    if self.api_raw("/-/ready")[0] == 200:
                        return
                except OSError:
                    pass
                time.sleep(0.1)
            self.stop()
        raise RuntimeError("prometheus did not start:\n" + self.read_log())

    def read_log(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def api_raw(self, path):
        if not self.query_prefix:
            return http_get(self.host, self.port, path, timeout=5)
        r = subprocess.run([*self.query_prefix, sys.executable, os.path.abspath(__file__), "get",
                            "--host", self.host, "--port", str(self.port), "--path", path],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise OSError("get %s failed: %s" % (path, r.stderr[-500:]))
        doc = json.loads(r.stdout)
        return doc["status"], {}, doc["body"].encode()

    def query(self, q):
        """Instant query: list of (labels dict, float value)."""
        from urllib.parse import quote
        st, _, body = self.api_raw("/api/v1/query?query=" + quote(q))
        doc = json.loads(body)
        if st != 200 or doc.get("status") != "success":
            raise RuntimeError("query %r failed: %s" % (q, body[:500]))
        return [(r["metric"], float(r["value"][1])) for r in doc["data"]["result"]]

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        shutil.rmtree(self.dir, True)


def run_worker(shards, steps, worker_id=0):
    """Creates every shard's tensors and runs `steps` sync steps against all
    shards (shard i at index i). Returns a summary dict."""
    chans = [channel(a) for a in shards]
    n = len(shards)
    pushed = [0] * n
    received = 0
    for i, (_, stub) in enumerate(chans):
        create(stub, i, n, shard_tensors(i))
    for step in range(steps):
        for i, (_, stub) in enumerate(chans):
            got, versions = push(stub, worker_id, step, shard_tensors(i))
            received += got
            pushed[i] += 1
            assert all(v == step + 1 for v in versions.values()), versions
    for ch, _ in chans:
        ch.close()
    return {"pushed": pushed, "received_bytes": received, "steps": steps}


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--shards", required=True)
    w.add_argument("--steps", type=int, default=5)
    g = sub.add_parser("get")
    g.add_argument("--host", required=True)
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--path", required=True)
    a = ap.parse_args()
    if a.cmd == "worker":
        print(json.dumps(run_worker(a.shards.split(","), a.steps)), flush=True)
    else:
        st, _, body = http_get(a.host, a.port, a.path, timeout=5)
        print(json.dumps({"status": st, "body": body.decode("utf-8", "replace")}))


if __name__ == "__main__":
    main()

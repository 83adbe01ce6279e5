#!/usr/bin/python3
"""Fragmented requests against an unrelated push.

One factorps-server (async). A separate process (its own GIL) pushes a
small tensor "u" in a loop and records each push's latency. The main
process first lets it run alone (baseline), then, for the same length of
time, sends fragmented traffic for other tensors, over and over:
  - a Create of about 10 MB made of 320k one-element init slices (a new
    tensor each time, so every one is decoded, checked and copied);
  - two concurrent PushPulls of about 4.5 MB, 200k one-element slices each,
    to a tensor "p".
Reports the unrelated push's p50, p99 and worst latency in both windows and
their ratios (same run, same machine load). Not a test: no assertion.

  /usr/bin/python3 tests/bench/fragmented.py [--seconds 6] [--threads N]
                                             [--server build/server/factorps-server]
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))

CREATE_SLICES = 320_000
PUSH_SLICES = 200_000
U_ELEMS = 1024


def pusher(addr, seconds, out_path):
    """The unrelated client: (monotonic start, latency) of every push."""
    import fpsharness
    pb, pbg, grpc = fpsharness.stubs()
    ch = grpc.insecure_channel(addr)
    stub = pbg.ParameterServerStub(ch)
    grad = (b"\x00\x00\x80\x3a") * U_ELEMS  # 1e-3 as float32
    rec = []
    t_end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < t_end:
        req = pb.PushPullRequest(worker_id=0, step=step, grads=[
            pb.TensorSlice(name="u", dtype=pb.DTYPE_F32, shape=[U_ELEMS], offset=0, data=grad)])
        t0 = time.monotonic()
        for _ in stub.PushPull(iter([req]), timeout=60):
            pass
        rec.append((t0, time.monotonic() - t0))
        step += 1
    with open(out_path, "w") as f:
        json.dump(rec, f)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each window")
    ap.add_argument("--server", default=None)
    ap.add_argument("--threads", type=int, default=0, help="the shard's --threads (0: its default)")
    ap.add_argument("--extra", nargs="*", default=[], help="more factorps-server flags")
    ap.add_argument("--only", choices=["create", "push"], help="one kind of fragmented request only")
    ap.add_argument("--creates", type=int, default=12, help="Creates prepared (each a new tensor)")
    ap.add_argument("--pusher", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pusher:
        pusher(a.pusher[0], float(a.pusher[1]), a.pusher[2])
        return
    if a.server:
        os.environ["FPS_SERVER"] = a.server
    import fpsharness
    pb, pbg, grpc = fpsharness.stubs()
    srv = fpsharness.Server("--mode", "async", "--log-level", "warn", "--threads", a.threads, *a.extra)
    try:
        stub = srv.stub
        torch = pb.AdafactorConfig(flavor=pb.FLAVOR_TORCH)
        zeros = b"\x00" * 4
        stub.Create(pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
            pb.TensorCreate(name="u", shape=[U_ELEMS], optimizer=torch, init=pb.TensorSlice(
                name="u", dtype=pb.DTYPE_F32, shape=[U_ELEMS], offset=0, data=zeros * U_ELEMS)),
            pb.TensorCreate(name="p", shape=[PUSH_SLICES], optimizer=torch, init=pb.TensorSlice(
                name="p", dtype=pb.DTYPE_F32, shape=[PUSH_SLICES], offset=0, data=zeros * PUSH_SLICES))]),
            timeout=60)

        # The fragmented requests, serialised once (the client's own cost
        # stays out of the windows as far as possible).
        one = b"\x00\x00\x80\x3f"
        def create_bytes(name):
            return pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
                pb.TensorCreate(name=name, shape=[CREATE_SLICES], optimizer=torch, init=pb.TensorSlice(
                    dtype=pb.DTYPE_F32, offset=i, data=one)) for i in range(CREATE_SLICES)]).SerializeToString()
        creates = [create_bytes("frag%d" % k) for k in range(a.creates)]
        push_msg = [pb.PushPullRequest(worker_id=w, step=0, grads=[
            pb.TensorSlice(name="p", dtype=pb.DTYPE_F32, shape=[PUSH_SLICES], offset=i, data=one) for i in range(PUSH_SLICES)])
            .SerializeToString() for w in (1, 2)]
        print("fragmented: Create %.1f MB (%d slices), PushPull %.1f MB (%d slices)" %
              (len(creates[0]) / 1e6, CREATE_SLICES, len(push_msg[0]) / 1e6, PUSH_SLICES), flush=True)
        ident = lambda b: b
        create_raw = srv.channel().unary_unary("/factorps.v1.ParameterServer/Create",
                                              request_serializer=ident, response_deserializer=ident)
        push_chs = [srv.channel() for _ in range(2)]
        push_raw = [ch.stream_stream("/factorps.v1.ParameterServer/PushPull",
                                     request_serializer=ident, response_deserializer=ident) for ch in push_chs]

        out = os.path.join(srv.dir, "pusher.json")
        pusher_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--pusher", srv.addr,
                                        str(2 * a.seconds + 1.0), out])
        time.sleep(0.5)  # its channel up
        b0 = time.monotonic()
        time.sleep(a.seconds)
        f0 = time.monotonic()
        creates_done = pushes_done = 0
        create_s = []
        k = 0
        while time.monotonic() < f0 + a.seconds:
            t0 = time.monotonic()
            if a.only != "push":
                if k == len(creates):
                    break  # every Create must make a new tensor: no more prepared
                create_raw(creates[k], timeout=120)
                create_s.append(time.monotonic() - t0)
                creates_done += 1
                k += 1
            if a.only == "create":
                continue
            errs = []
            def push(i):
                try:
                    for _ in push_raw[i](iter([push_msg[i]]), timeout=120):
                        pass
                except grpc.RpcError as e:  # a stale step in async is fine; count it
                    errs.append(e.code())
            th = [threading.Thread(target=push, args=(i,)) for i in range(2)]
            for t in th:
                t.start()
            for t in th:
                t.join()
            pushes_done += 2
        f1 = time.monotonic()
        pusher_proc.wait(timeout=120)
        with open(out) as f:
            rec = json.load(f)
        base = [l for t, l in rec if b0 <= t and t + l <= f0]
        frag = [l for t, l in rec if f0 <= t < f1]
        print("fragmented traffic: %d Creates (%.3f s each, median), %d PushPulls in %.1f s" %
              (creates_done, quantile(create_s, 0.5), pushes_done, f1 - f0))
        print("unrelated push, %d alone:      p50 %.2f ms  p99 %.2f ms  worst %.2f ms" %
              (len(base), 1e3 * quantile(base, 0.5), 1e3 * quantile(base, 0.99), 1e3 * max(base)))
        print("unrelated push, %d fragmented: p50 %.2f ms  p99 %.2f ms  worst %.2f ms" %
              (len(frag), 1e3 * quantile(frag, 0.5), 1e3 * quantile(frag, 0.99), 1e3 * max(frag)))
        print("ratio fragmented/alone: p50 %.2f  p99 %.2f  worst %.2f" %
              (quantile(frag, 0.5) / quantile(base, 0.5), quantile(frag, 0.99) / quantile(base, 0.99),
               max(frag) / max(base)))
        for ch in push_chs:
            ch.close()
    finally:
        srv.stop()


if __name__ == "__main__":
    main()

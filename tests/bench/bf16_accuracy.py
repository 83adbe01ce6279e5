#!/usr/bin/python3
"""The accuracy cost of bf16 on the wire: one short training run twice.

    FACTORPS_LIB=build/client/libfactorps.so PYTHONPATH=client/python \\
        /usr/bin/python3 tests/bench/bf16_accuracy.py [--build build] [--steps 300]

A 2-layer MLP (64 -> 256 -> 1, tanh) learns a fixed random teacher on 4096
samples by full-batch MSE; numpy computes the gradients, one factorps
shard (async, torch-flavor Adafactor, lr 1e-2) applies them. The run is
repeated with wire_dtype "f32" and "bf16" from the same start, and the
script prints both final losses, their ratio, and the relative distance
of the bf16 run's fp32 master weights (read with pull(), exact) from the
fp32 run's. With bf16 the worker computes each gradient at the bf16
parameters it received, and the shard gets the gradient rounded to bf16.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
import factorps  # noqa: E402


def start_shard(build, tmp):
    pf = os.path.join(tmp, "port")
    p = subprocess.Popen([os.path.join(build, "server", "factorps-server"), "--listen",
                          "127.0.0.1:0", "--mode", "async", "--port-file", pf],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        if os.path.exists(pf) and os.path.getsize(pf):
            return p, "127.0.0.1:" + open(pf).read().strip()
        time.sleep(0.02)
    p.kill()
    raise SystemExit("bf16_accuracy: the shard did not start")


def train(addr, wire, steps, data, init):
    X, y = data
    names = ["w1", "b1", "w2", "b2"]
    with factorps.connect([addr], wire_dtype=wire, deadline=60) as c:
        c.create([factorps.TensorSpec(f"{wire}.{k}", init[k].shape, init[k]) for k in names])
        p = {k: init[k].copy() for k in names}
        losses = []
        for _ in range(steps):
            h = np.tanh(X @ p["w1"].T + p["b1"])
            out = h @ p["w2"].T + p["b2"]
            err = out - y
            losses.append(float(np.mean(err ** 2)))
            d_out = 2.0 * err / len(X)
            g = {"w2": d_out.T @ h, "b2": d_out.sum(0)}
            d_h = (d_out @ p["w2"]) * (1.0 - h ** 2)
            g["w1"] = d_h.T @ X
            g["b1"] = d_h.sum(0)
            got, _ = c.push_pull({f"{wire}.{k}": g[k].astype(np.float32) for k in names})
            p = {k: got[f"{wire}.{k}"] for k in names}
        master, _ = c.pull([f"{wire}.{k}" for k in names])
        return losses, {k: master[f"{wire}.{k}"] for k in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4096, 64)).astype(np.float32)
    teacher = rng.standard_normal((64, 1)).astype(np.float32) / 8
    y = (np.sin(X @ teacher * 3) + 0.1 * rng.standard_normal((4096, 1))).astype(np.float32)
    init = {"w1": (rng.standard_normal((256, 64)) / 8).astype(np.float32),
            "b1": np.zeros(256, np.float32),
            "w2": (rng.standard_normal((1, 256)) / 16).astype(np.float32),
            "b2": np.zeros(1, np.float32)}
    with tempfile.TemporaryDirectory() as tmp:
        shard, addr = start_shard(os.path.abspath(a.build), tmp)
        try:
            lf, pf = train(addr, "f32", a.steps, (X, y), init)
            lb, pb = train(addr, "bf16", a.steps, (X, y), init)
        finally:
            shard.terminate()
            shard.wait()
    num = sum(float(np.sum((pb[k].astype(np.float64) - pf[k]) ** 2)) for k in pf)
    den = sum(float(np.sum(pf[k].astype(np.float64) ** 2)) for k in pf)
    print(f"steps {a.steps}: loss at start {lf[0]:.6f}; final loss f32 {lf[-1]:.6f}, "
          f"bf16 {lb[-1]:.6f} (bf16/f32 {lb[-1] / lf[-1]:.4f}); "
          f"|w_bf16 - w_f32| / |w_f32| = {np.sqrt(num / den):.2e}")


if __name__ == "__main__":
    main()

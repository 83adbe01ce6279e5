"""One training worker of the replica tests, run as its own process
(inside a network namespace for the partition tests): pushes seeded
gradients to one replicated shard and logs every acknowledgement.

    _worker.py --shards ENTRY --worker W --workers N --mode sync|async
               --log PATH [--steps S | --stop-file PATH] [--final PATH]
               [--split-min-bytes N]

Each push has its own idempotency key, kept until the push is
acknowledged: a push that raised (its outcome unknown: a deadline during
a partition) is sent again under the same key, so the shard applies it at
most once and the log holds each push once. The log has one JSON line per
acknowledged push {"w", "step", "t0", "t" (CLOCK_MONOTONIC, shared by all
processes of the machine), "v" (versions), "tries"} and one per failed
attempt {"w", "step", "t", "err"}. With --stop-file the worker runs until
that file holds a step count and stops there (in sync every worker must
stop at the same step). --final: worker 0 pulls every tensor at the end
and writes them (np.savez) there. --split-min-bytes: connect's
split_min_bytes (tensors at least that big are split into row blocks over
the shards; 0, the default: never).
"""
import argparse
import json
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))
import factorps  # noqa: E402
from factorps.errors import Error  # noqa: E402

# Small tensors (a step takes milliseconds), both kinds of state: factored
# matrices and a vector.
SHAPES = {"emb": (256, 64), "w": (64, 48), "b": (48,)}


def grads_for(seed, worker, step):
    rng = np.random.default_rng([seed, worker, step])
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def init_values(seed):
    rng = np.random.default_rng([seed, 999])
    return {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


def stop_at(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mode", choices=("sync", "async"), required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log", required=True)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--stop-file")
    ap.add_argument("--final")
    ap.add_argument("--deadline", type=float, default=5.0)
    ap.add_argument("--run-seconds", type=float, default=600.0)
    ap.add_argument("--split-min-bytes", type=int, default=0)
    a = ap.parse_args()
    end = time.monotonic() + a.run_seconds
    c = factorps.connect(a.shards, worker_id=a.worker, deadline=a.deadline, max_retries=5,
                         backoff=0.05, split_min_bytes=a.split_min_bytes)
    init = init_values(a.seed)
    specs = [factorps.TensorSpec(n, s, init[n]) for n, s in SHAPES.items()]
    while True:  # the shard may be failing over while the job starts
        try:
            c.create(specs)
            break
        except Error:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    rnd = random.Random((a.seed << 8) ^ a.worker ^ os.getpid())
    log = open(a.log, "a", buffering=1)
    step = 0
    while time.monotonic() < end:
        if a.steps is not None and step >= a.steps:
            break
        if a.stop_file:
            target = stop_at(a.stop_file)
            if target is not None and step >= target:
                break
        g = grads_for(a.seed, a.worker, step)
        key = rnd.getrandbits(63) + 1
        t0, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                _, versions = c.push_pull(g, step=step, want_params=False, push_id=key,
                                          num_workers=a.workers, expect_mode=a.mode)
                break
            except Error as e:
                log.write(json.dumps({"w": a.worker, "step": step, "t": time.monotonic(),
                                      "err": type(e).__name__, "msg": str(e)[:300]}) + "\n")
                if a.mode == "sync" and "stale push" in str(e):
                    # A retry of a push whose round was applied is answered
                    # from its key, on whichever replica holds the round
                    # (the standby gets all of a round's keys with its
                    # result): "stale" would mean a lost key.
                    raise
                if time.monotonic() > end:
                    raise
                time.sleep(0.02)
        log.write(json.dumps({"w": a.worker, "step": step, "t0": t0, "t": time.monotonic(),
                              "v": versions, "tries": tries}) + "\n")
        step += 1
    if a.final and a.worker == 0:
        # Sync: once the last round is acknowledged every tensor stands at it.
        while True:
            try:
                params, versions = c.pull()
                break
            except Error:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        np.savez(a.final, **params, **{"version." + n: np.uint64(v) for n, v in versions.items()})
    c.close()
    log.close()


if __name__ == "__main__":
    main()

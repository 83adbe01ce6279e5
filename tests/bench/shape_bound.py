#!/usr/bin/python3
"""The shape bound of a step across a link: how much of the link's step
bound a chunked push can reach at best, whatever the CPUs do.

    /usr/bin/python3 tests/bench/shape_bound.py [--params 10M,100M]
        [--workers 2,4] [--chunks 0,2Mi,4Mi,8Mi] [--wire f32,bf16] [--shards 2]
        [--wire-chunks]

A shard applies a tensor only once it has the whole gradient (its factored
statistics need every row), and in sync only once every worker's gradient is
in, so the way down has nothing of a chunk to carry until that chunk is up.
This is a fluid model of one step with the tensors `factorps load --model
peer` uses (the peer's 64 shapes): the client's placement (largest first
onto the lightest shard) and its chunk plan (libfactorps plan_chunks:
largest items first, cut at the target, at most 32 chunks per shard, the
first chunk sent the first one of at most 2 x target; the target counts 4
bytes per element whatever the wire dtype, as libfactorps does, so that bf16
cuts the chunks fp32 cuts, or wire bytes with --wire-chunks, as it did
before). Every worker x shard flow uploads its chunks back to back, the up
link shared fairly among the flows still uploading; a chunk's reply (as many
bytes as its request) may start once every worker's copy is up (sync) or its
own is (async), the down link shared fairly among the replies in flight.
Both directions run at the same rate; nothing costs time but bytes on the
link. Every worker starts its step at the same moment: right for sync,
pessimistic for async, whose workers drift out of phase so that one's
replies overlap another's upload (async runs can pass its figure). Printed:
the chunks per shard, the largest chunk, and upload bytes / step time, the
fraction of the link's step bound (link_bench.py's "/ bound") this shape
allows. Ties of equal sizes are broken arbitrarily here (by name in the
client), which can move a figure by a point.
"""

import argparse
import math


def model_shapes(n, k=64):
    """The peer's K tensors of about n elements (its model_shapes())."""
    layers, extra = (k - 1) // 6, (k - 1) % 6
    h = max(64, int(math.sqrt(0.88 * n / (12 * layers)) // 64 * 64))
    layer = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h), (3 * h,), (4 * h,)]
    shapes = layer * layers
    used = sum(math.prod(s) for s in shapes) + extra * h
    return [(max(1, (n - used) // h), h)] + shapes + [(h,)] * extra


def place(sizes, shards):
    load, out = [0] * shards, [[] for _ in range(shards)]
    for b in sorted(sizes, reverse=True):
        s = load.index(min(load))
        load[s] += b
        out[s].append(b)
    return out


def plan(items, target):
    """Chunk byte counts of one shard's push, in sending order."""
    total = sum(items)
    if not target or total <= target:
        return [total]
    target = max(target, total // 32 + 1)
    chunks, b = [], 0
    for i, x in enumerate(sorted(items, reverse=True)):
        b += x
        if b >= target or i + 1 == len(items):
            chunks.append(b)
            b = 0
    first = next((f for f, c in enumerate(chunks) if c <= 2 * target), 0)
    return [chunks[first]] + chunks[:first] + chunks[first + 1:]


def step_time(plans, workers, sync):
    up = {(w, s): [0, plans[s][0]] for w in range(workers) for s in range(len(plans))}
    arrived, down, t = {}, [], 0.0
    while up or down:
        nu, nd = len(up), len(down)
        dt = min([r[1] * nu for r in up.values()] + [d * nd for d in down])
        t += dt
        for r in up.values():
            r[1] -= dt / nu
        down = [d - dt / nd for d in down if d - dt / nd > 1e-9]
        for key in [k for k, r in up.items() if r[1] <= 1e-9]:
            s, j = key[1], up[key][0]
            arrived[s, j] = arrived.get((s, j), 0) + 1
            if not sync:
                down.append(plans[s][j])
            elif arrived[s, j] == workers:
                down += [plans[s][j]] * workers
            if j + 1 < len(plans[s]):
                up[key] = [j + 1, plans[s][j + 1]]
            else:
                del up[key]
    return t


def count(s):
    s = s.strip()
    for suffix, mult in (("Mi", 1 << 20), ("Ki", 1 << 10), ("M", 10**6), ("k", 10**3)):
        if s.endswith(suffix):
            return int(float(s[:-len(suffix)]) * mult)
    return int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="10M,100M")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--chunks", default="0,2Mi,4Mi,8Mi")
    ap.add_argument("--wire", default="f32,bf16")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--wire-chunks", action="store_true",
                    help="chunk targets in wire bytes (libfactorps before it counted fp32 bytes)")
    a = ap.parse_args()
    for n in [count(x) for x in a.params.split(",")]:
        shapes = model_shapes(n)
        for w in [int(x) for x in a.workers.split(",")]:
            for wire in a.wire.split(","):
                esz = 2 if wire == "bf16" else 4
                per = place([math.prod(s) * esz for s in shapes], a.shards)
                for target in [count(x) for x in a.chunks.split(",")]:
                    # The plan cuts at the target in its unit, the link
                    # carries wire bytes.
                    scale = 1 if a.wire_chunks else esz / 4
                    plans = [plan(p, max(1, int(target * scale)) if target else 0) for p in per]
                    upload = w * sum(map(sum, plans))
                    bounds = [upload / step_time(plans, w, sync) for sync in (True, False)]
                    print(f"{n / 1e6:g}M W{w} {wire} chunk {target / 2**20:g} MiB: chunks per shard "
                          f"{[len(p) for p in plans]}, largest {max(map(max, plans)) / 1e6:.1f} MB, "
                          f"shape bound sync {bounds[0]:.2f} async {bounds[1]:.2f}")


if __name__ == "__main__":
    main()

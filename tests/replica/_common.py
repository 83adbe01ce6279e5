"""What the replica tests share: loop counts, the reference run, the
checks on the workers' acknowledgements and the replicas' checksums.

Loop counts: ctest runs a few kills and cuts so that the suite stays short;
the full counts are one variable away:
    FPS_REPLICA_FULL=1 ctest -L replica     (20 kills per mode, 10 cuts each)
or FPS_REPLICA_KILLS=N / FPS_REPLICA_CUTS=N. Each test prints its numbers
("replica-result: ...") to stdout; docs/operations.md records a full run.
To read a run's logs: FPS_REPLICA_KEEP=1 keeps its files, FPS_REPLICA_LOG=debug
sets the servers' --log-level.
"""
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np

import _replica
from _replica import PY, HERE, Pair, fpsproc, one_acknowledger, summary  # noqa: F401

FULL = os.environ.get("FPS_REPLICA_FULL") == "1"
KILLS = int(os.environ.get("FPS_REPLICA_KILLS") or (20 if FULL else 4))
CUTS = int(os.environ.get("FPS_REPLICA_CUTS") or (10 if FULL else 3))
SEED = 7


def report(name, **kw):
    text = " ".join("%s=%s" % kv for kv in kw.items())
    sys.stdout.write("replica-result: %s %s\n" % (name, text))
    sys.stdout.flush()


def reference_run(mode, workers, steps, seed=SEED):
    """The same job on one solo shard, never interrupted: the final
    parameters (sync: what a replicated run must equal bit for bit)."""
    d = tempfile.mkdtemp(prefix="fps-replica-ref-")
    sp = fpsproc.ShardProcess(["--shard-id", "0", "--shard-count", "1", "--mode", mode,
                               "--workers", str(workers), "--log-level", "warn"],
                              dir=d, name="ref", die_with_parent=True)
    try:
        import subprocess
        final = os.path.join(d, "final.npz")
        procs = [subprocess.Popen([PY, os.path.join(HERE, "_worker.py"), "--shards", sp.addr,
                                   "--worker", str(w), "--workers", str(workers), "--mode", mode,
                                   "--seed", str(seed), "--log", os.path.join(d, "w%d" % w),
                                   "--steps", str(steps), "--final", final])
                 for w in range(workers)]
        for p in procs:
            if p.wait(300) != 0:
                raise AssertionError("reference worker failed")
        with np.load(final) as z:
            return {k: z[k].copy() for k in z.files}
    finally:
        sp.kill()
        import shutil
        shutil.rmtree(d, True)


def check_sync_acks(tc, pair, per_worker):
    """Every worker stopped at the same step count and got its pushes
    0..steps-1 acknowledged once each, push s at version s + 1 of every
    tensor: no round lost, none applied twice. Returns the step count."""
    tc.assertEqual(len(set(per_worker)), 1, "sync workers stopped at different steps: %s" %
                   per_worker)
    steps = per_worker[0]
    for w in range(pair.workers):
        acks = pair.acks(w)
        tc.assertEqual([a["step"] for a in acks], list(range(steps)), "worker %d" % w)
        for a in acks:
            for name, v in a["v"].items():
                if v != a["step"] + 1:
                    tc.fail("worker %d step %d: tensor %s at version %d, not %d" %
                            (w, a["step"], name, v, a["step"] + 1))
    return steps


def check_bit_identical(tc, final, ref):
    tc.assertEqual(sorted(final), sorted(ref))
    for k in ref:
        a, b = final[k], ref[k]
        tc.assertEqual(a.shape, b.shape, k)
        if a.dtype == np.float32 and not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            diff = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
            tc.fail("tensor %s: %d of %d elements differ from the uninterrupted run" %
                    (k, diff, a.size))
        elif a.dtype != np.float32:
            tc.assertEqual(int(a), int(b), k)


def wait_in_sync(tc, pair, timeout=30):
    """Until both replicas report the same version of every tensor with
    the standby joined; returns their samples. Checksums must then be
    equal (and set)."""
    def same():
        p = pair.primary()
        if p is None or not pair.joined(p):
            return False
        since = time.monotonic() - 0.3
        a, b = pair.last(0, since), pair.last(1, since)
        return bool(a and b and a.get("tensors") and a["tensors"] == b["tensors"])
    try:
        pair.wait(same, timeout, "replicas at the same versions")
    except AssertionError:
        a, b = pair.last(0), pair.last(1)
        tc.fail("replicas differ after the run: replica 0 %s, replica 1 %s" %
                (a and a.get("tensors"), b and b.get("tensors")))
    a, b = pair.last(0), pair.last(1)
    for n, (v, ck) in a["tensors"].items():
        tc.assertNotEqual(ck, 0, "tensor %s has no checksum" % n)
        tc.assertEqual(b["tensors"][n], [v, ck], "tensor %s: replicas differ" % n)
    return a, b


def kill_loop(tc, mode, kills, rng, sig=signal.SIGKILL, **pair_args):
    """Trains with 2 workers and SIGKILLs (or `sig`s) the primary `kills`
    times; each time the stopped process comes back as the standby.
    Returns (pair, steps, stalls, final). pair_args: Pair's (a shard of a
    larger job)."""
    pair = Pair(mode, **pair_args)
    tc.addCleanup(pair.close)
    final = os.path.join(pair.dir, "final.npz")
    pair.start_workers(seed=SEED, final=final)
    pair.wait_progress(3, 60, "training to start")
    kill_times = []
    for k in range(kills):
        p = pair.primary()
        tc.assertIsNotNone(p, "no single primary before kill %d" % k)
        pair.wait(lambda: pair.joined(p), 60, "the standby to join (kill %d)" % k)
        pair.wait_progress(2, 60)
        time.sleep(rng.uniform(0.0, 0.15))
        kill_times.append(pair.kill(p, sig))
        pair.wait(lambda: pair.role(1 - p) == "primary", 10,
                  "replica %d promoted after kill %d" % (1 - p, k))
        pair.wait_progress(2, 60, "training to go on after kill %d" % k)
        pair.start(p)
    pair.wait(lambda: pair.joined(pair.primary() or 0), 60, "the standby to join at the end")
    pair.wait_progress(2, 60)
    steps = pair.stop_workers()
    acks = [pair.acks(w) for w in range(pair.workers)]
    stalls = []
    for i, t in enumerate(kill_times):
        window = (kill_times[i + 1] - t) if i + 1 < len(kill_times) else 5.0
        stalls.append(_replica.stall_after(acks, t, min(window, 5.0)))
    return pair, steps, stalls, final

#!/usr/bin/python3
"""A split job that always comes back to one version: three
sync shards (W = 2 workers) train one [96, 64] torch tensor split into three
row blocks while a block shard is SIGKILLed at random moments (inside an
exchange, an apply, a checkpoint or an anchor write: the job checkpoints
every 0.05 s, anchors every 2 versions) and, in a second run, SIGTERMed during
steps; each time it is restarted on its port (from its own checkpoint) and
nobody tells the job anything.

Each time: the blocks come back to one version by themselves, training goes
on (the next step succeeds on every block), and what a surviving shard
undid is reported (TensorStats.split_lost_steps grows by at least what its
version went back). At the end the parameters are BIT-identical to a
replay of the steps that survived: one unsplit shard pushed the same
gradients (g(step, worker), a function of the step only) for as many steps
as the job's final version.

The two workers are raw grpcio clients (fpsharness) in lockstep, as DDP
workers are (their collectives synchronise them every step): each try both
push every block at once (one thread per push, a new push_id each); on any
error they wait until every block reports one version and go on from it
(what factorps.torch does after a restore).

FPS_SPLIT_CHAOS_ROUNDS (default 4) kills of each kind; 20 is the issue's
count (docs/operations.md has the numbers of a 20 + 20 run).

A third run SIGTERMs every shard at once during steps (docker compose down,
a namespace deleted), FPS_SPLIT_CHAOS_ALL_ROUNDS times (default 5), with a
long exchange deadline: each shard must exit well within it (a shard that
stopped before its step began once left a peer waiting the whole
deadline), and the restarted job comes back to one version as above."""
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import fpsharness as H

SHAPE = [96, 64]
BOUNDS = [0, 40, 41, 96]  # a one-row block in the middle
SHARDS = 3
W = 2
ROUNDS = int(os.environ.get("FPS_SPLIT_CHAOS_ROUNDS", "4"))
ALL_ROUNDS = int(os.environ.get("FPS_SPLIT_CHAOS_ALL_ROUNDS", "5"))
ALL_DEADLINE = 30  # the exchange deadline of the every-shard run
ALL_STOP_S = 10    # the bound on each shard's exit in it
AGREE_S = 60       # bound on coming back to one version after an event
STEPS_AFTER = 3    # steps that must succeed after each event


def grad(step, worker):
    rng = np.random.default_rng(1000 * step + worker)
    return (rng.standard_normal(SHAPE) * 0.1).astype(np.float32)


class Chaos:
    """The job, its two workers and the bookkeeping of one run."""

    def __init__(self, test, kind):
        self.t = test
        self.kind = kind
        self.pb, self.pbg, self.grpc = H.stubs()
        self.dir = tempfile.mkdtemp(prefix="fps-split-chaos-")
        dirs = [os.path.join(self.dir, "shard%d" % i) for i in range(SHARDS)]
        xdeadline = ALL_DEADLINE if kind == "term_all" else 2
        self.job = H.Job(SHARDS, "--mode", "sync", "--workers", W, "--exchange-deadline", xdeadline, "--deadline", 5,
                         "--checkpoint-interval", 0.05, "--split-anchor-steps", 2,
                         shard_args=[["--checkpoint-dir", d] for d in dirs])
        self.p0 = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
        self.stop = threading.Event()
        self.errors = []
        self.done_steps = 0         # steps that succeeded on every block
        self.lock = threading.Lock()
        self.down = set()           # shards being killed / restarted

    def close(self):
        self.stop.set()
        try:
            self.job.stop()
        finally:
            shutil.rmtree(self.dir, True)

    def create(self):
        pb = self.pb
        flat = self.p0.reshape(-1)
        for b in range(SHARDS):
            lo, hi = BOUNDS[b], BOUNDS[b + 1]
            tc = pb.TensorCreate(name="emb", shape=SHAPE, optimizer=H.optimizer(),
                                 init=pb.TensorSlice(dtype=pb.DTYPE_F32, offset=0,
                                                     data=flat[lo * SHAPE[1]:hi * SHAPE[1]].tobytes()),
                                 split=pb.SplitBlock(block_index=b, bounds=BOUNDS, block_shards=list(range(SHARDS)),
                                                     shard_count=SHARDS))
            self.job.stub(b).Create(pb.CreateRequest(shard_id=b, shard_count=SHARDS, tensors=[tc]), timeout=30)

    def stats(self, b, timeout=2):
        ch = self.job[b].channel()
        try:
            r = self.pbg.ParameterServerStub(ch).Stats(self.pb.StatsRequest(include_tensors=True), timeout=timeout)
            return {t.name: t for t in r.tensors}["emb"]
        finally:
            ch.close()

    def versions(self):
        """Every block's version, or None if a shard does not answer."""
        out = []
        for b in range(SHARDS):
            try:
                out.append(self.stats(b).version)
            except Exception:
                return None
        return out

    def agreed(self, bound=AGREE_S, final=False):
        until = time.monotonic() + bound
        last = None
        while time.monotonic() < until and (final or not self.stop.is_set()):
            v = self.versions()
            last = v
            if v is not None and len(set(v)) == 1:
                return v[0]
            time.sleep(0.05)
        self.dump_logs()
        raise AssertionError("the blocks did not come back to one version within %d s (last seen %s)" %
                             (bound, last))

    def push_block(self, w, b, step, pid, out):
        pb = self.pb
        lo, hi = BOUNDS[b], BOUNDS[b + 1]
        part = grad(step, w).reshape(-1)[lo * SHAPE[1]:hi * SHAPE[1]]
        req = pb.PushPullRequest(worker_id=w, step=step, push_id=pid, grads=[
            pb.TensorSlice(name="emb", dtype=pb.DTYPE_F32, shape=SHAPE, offset=0, data=part.tobytes())])
        try:
            ch = self.job[b].channel()
        except Exception as e:  # the shard object is being replaced
            out[b] = ("error", repr(e))
            return
        try:
            version = None
            for r in self.pbg.ParameterServerStub(ch).PushPull(iter([req]), timeout=20):
                for v in r.versions:
                    version = v.version
            out[b] = ("ok", version)
        except self.grpc.RpcError as e:
            out[b] = ("error", "%s: %s" % (e.code(), e.details()))
        finally:
            ch.close()

    def trainer(self):
        """The two workers in lockstep (as DDP / torchrun workers are, their
        collectives synchronise every step): each try, both push every
        block at once, each push with a new push_id; all six OK with the
        next version: a step; anything else: on from the agreed version."""
        try:
            step = 0
            ids = random.Random(100)
            while not self.stop.is_set():
                out = {}
                pids = [ids.getrandbits(63) + 1 for _ in range(W)]
                th = [threading.Thread(target=self.push_block, args=(w, b, step, pids[w], out.setdefault(w, {})),
                                       daemon=True) for w in range(W) for b in range(SHARDS)]
                for t in th:
                    t.start()
                for t in th:
                    t.join(60)
                if all(out[w].get(b, ("error",))[0] == "ok" and out[w][b][1] == step + 1
                       for w in range(W) for b in range(SHARDS)):
                    step += 1
                    with self.lock:
                        self.done_steps += 1
                    continue
                step = self.agreed()
        except Exception as e:  # reported by the main thread
            if not self.stop.is_set():
                self.errors.append("trainer: %r" % e)

    def wait_steps(self, n, bound=AGREE_S):
        """Until both workers saw n more steps succeed everywhere."""
        with self.lock:
            base = self.done_steps
        until = time.monotonic() + bound
        while True:
            self.t.assertEqual(self.errors, [])
            with self.lock:
                if self.done_steps >= base + n:
                    return
            if time.monotonic() >= until:
                self.dump_logs()
                self.t.fail("training did not go on (%s)" % self.versions())
            time.sleep(0.02)

    def dump_logs(self):
        """Every shard's log so far, to find out why a run did not go on."""
        for b in range(SHARDS):
            try:
                log = self.job[b].stderr()
            except Exception as e:
                log = repr(e)
            print("---- shard %d log (last 12000 chars) ----\n%s" % (b, log[-12000:]), file=sys.stderr)

    def event(self, i, rnd):
        victim = rnd.randrange(SHARDS)
        time.sleep(rnd.uniform(0.0, 0.25))  # a random moment of the training
        before = {}
        for b in range(SHARDS):
            if b != victim:
                try:
                    s = self.stats(b)
                    before[b] = (s.version, s.split_lost_steps)
                except Exception:
                    pass
        t0 = time.monotonic()
        if self.kind == "kill":
            self.job.kill(victim)
        elif self.kind == "term":
            rc, _ = self.job[victim].stop()
            self.t.assertEqual(rc, 0)
        else:
            return self.stop_all(i)
        self.job.restart(victim)
        v = self.agreed()
        self.wait_steps(STEPS_AFTER)
        took = time.monotonic() - t0
        lost = 0
        for b, (ver, lost0) in before.items():
            s = self.stats(b)
            if ver > v:  # went back: it must say so
                self.t.assertGreaterEqual(s.split_lost_steps - lost0, ver - v,
                                          "shard %d went back from %d to %d unreported" % (b, ver, v))
            lost = max(lost, s.split_lost_steps - lost0)
        print("%s %2d: shard %d; versions before %s; agreed on %d; steps undone %d; back in %.2f s" %
              (self.kind, i, victim, {b: x[0] for b, x in before.items()}, v, lost, took), file=sys.stderr)
        return lost, took

    def stop_all(self, i):
        """SIGTERM to every shard at once; each must exit within ALL_STOP_S
        (far below the exchange deadline) with status 0. Then all start
        again and agree on a version."""
        t0 = time.monotonic()
        took, errs = {}, []

        def one(b):
            try:
                self.job[b].stop()
                took[b] = time.monotonic() - t0
            except Exception as e:
                errs.append("shard %d: %s" % (b, e))

        th = [threading.Thread(target=one, args=(b,)) for b in range(SHARDS)]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        self.t.assertEqual(errs, [])
        slow = {b: round(s, 2) for b, s in took.items() if s >= ALL_STOP_S}
        self.t.assertEqual(slow, {}, "shards that took %d s or more to stop (exchange deadline %d s)" %
                           (ALL_STOP_S, ALL_DEADLINE))
        for b in range(SHARDS):
            self.job.restart(b)
        v = self.agreed()
        self.wait_steps(STEPS_AFTER)
        back = time.monotonic() - t0
        print("term_all %2d: stopped in %s s; agreed on %d; back in %.2f s" %
              (i, [round(took[b], 2) for b in range(SHARDS)], v, back), file=sys.stderr)
        return 0, back

    def replay(self, steps):
        """The final parameters of an unsplit shard given the same steps."""
        s = H.Server("--mode", "sync", "--workers", W)
        try:
            H.create(s.stub, "emb", SHAPE, init=self.p0)
            params = self.p0
            for step in range(steps):
                res = {}

                def one(w):
                    res[w] = H.push(s.stub, w, step, {"emb": (SHAPE, grad(step, w))})

                th = [threading.Thread(target=one, args=(w,)) for w in range(W)]
                for t in th:
                    t.start()
                for t in th:
                    t.join(60)
                params = res[0][0]["emb"]
                self.t.assertEqual(res[0][1]["emb"], step + 1)
            return params
        finally:
            s.stop()

    def final_params(self):
        got = []
        for b in range(SHARDS):
            params, versions = H.pull(self.job.stub(b), {"emb": [BOUNDS[b + 1] - BOUNDS[b], SHAPE[1]]})
            got.append(params["emb"])
        return np.concatenate(got)


class SplitChaos(unittest.TestCase):
    def run_kind(self, kind, seed):
        c = Chaos(self, kind)
        try:
            c.create()
            th = [threading.Thread(target=c.trainer, daemon=True)]
            for t in th:
                t.start()
            c.wait_steps(5)
            rnd = random.Random(seed)
            lost, times = [], []
            for i in range(ALL_ROUNDS if kind == "term_all" else ROUNDS):
                lo, took = c.event(i, rnd)
                lost.append(lo)
                times.append(took)
            c.stop.set()
            for t in th:
                t.join(90)
            self.assertEqual(c.errors, [])
            v = c.agreed(AGREE_S, final=True)
            final = c.final_params()
            print("%s: %d events, all back to one version; final version %d; steps undone per event %s (total "
                  "%d); back within max %.2f s, median %.2f s" %
                  (kind, len(times), v, lost, sum(lost), max(times), sorted(times)[len(times) // 2]), file=sys.stderr)
            want = c.replay(v)
            np.testing.assert_array_equal(final, want.reshape(final.shape))
        finally:
            c.close()

    def test_sigkill_at_random_moments(self):
        self.run_kind("kill", 22)

    def test_sigterm_during_steps(self):
        self.run_kind("term", 23)

    def test_sigterm_to_every_shard_at_once(self):
        self.run_kind("term_all", 24)


if __name__ == "__main__":
    unittest.main()

"""Learning-rate schedules through RemoteAdafactor / RemoteHFAdafactor.

torch.optim.lr_scheduler's LambdaLR (linear warmup then linear decay, the
shape of transformers' get_linear_schedule_with_warmup), StepLR,
CosineAnnealingLR and OneCycleLR(cycle_momentum=False) drive the optimizer
for 50 steps, with 1 and 2 workers, in sync and async mode; at step 25 the
loop also writes param_groups[0]["weight_decay"], as user code may. The
parameters are compared with factorps.reference.ReferenceAdafactor (checked
against the golden vectors) driven by the same lr and weight decay values:

- sync: the reference steps once per round with the workers' mean gradient;
- async: each tensor's apply log (worker, step, and the lr / weight decay the
  shard applied) gives the order the shard applied the pushes in; the
  reference replays that order, and the logged lr / wd must equal the
  schedule's values exactly.

Gradients are fixed functions of (worker, step, tensor), so the replay is
exact whatever the order. The two workers run as threads of this process
(each with its own connection), which keeps the test fast.

Tolerance (the golden vectors' "param scaled" metric, over the whole run):
    max|remote - reference| <= TOL * max(max|reference|, 1e-3), TOL = 1e-5,
the checker's per-step bound, here for 50 steps; measured worst: see
MEASURED below. So that a wrong schedule cannot pass inside it, the same
reference run with a constant lr must differ from the remote result by at
least 100x the bound.
"""

import threading
import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
import factorps
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

STEPS = 50
TOL = 1e-5
LR = 1e-2
SHAPES = {"w": (12, 8), "t": (2, 3, 5), "b": (8,), "s": ()}
MEASURED = {}  # name -> worst relative error, printed by tearDownModule


def init_values():
    rng = np.random.default_rng(1234)
    return {n: np.array(0.5 * rng.standard_normal(s), np.float32) for n, s in SHAPES.items()}


def grad(worker, step, name):
    seed = [worker, step, sorted(SHAPES).index(name)]
    return np.array(np.random.default_rng(seed).standard_normal(SHAPES[name]), np.float32)


def wd_at(step):
    return 0.01 if step < 25 else 0.05


def linear_warmup_decay(warmup, total):
    def f(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return f


SCHEDULES = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(10, STEPS)),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, total_steps=STEPS, cycle_momentum=False),
}


def train(addrs, worker, workers, mode, sched, namespace, out, cls=RemoteAdafactor, **hp):
    """One worker: 50 steps with schedule `sched`; out[worker] = (final
    params, [(lr, wd) per step])."""
    init = init_values()
    params = {n: torch.nn.Parameter(torch.from_numpy(init[n].copy())) for n in SHAPES}
    opt = cls(list(params.items()), shards=addrs, worker_id=worker, num_workers=workers,
              mode=mode, namespace=namespace, deadline=30, **hp)
    try:
        scheduler = SCHEDULES[sched](opt)
        used = []
        for step in range(STEPS):
            if step == 25:
                opt.param_groups[0]["weight_decay"] = wd_at(step)
            for n, p in params.items():
                p.grad = torch.from_numpy(grad(worker, step, n))
            used.append((float(opt.param_groups[0]["lr"]),
                         float(opt.param_groups[0]["weight_decay"])))
            opt.step()
            scheduler.step()
        out[worker] = ({n: p.detach().numpy().copy() for n, p in params.items()}, used)
    finally:
        opt.close()


def run_job(addrs, workers, mode, sched, namespace, **kw):
    out, errors = {}, []

    def body(w):
        try:
            train(addrs, w, workers, mode, sched, namespace, out, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a worker did not finish in 120 s")
    return [out[w] for w in range(workers)]


def reference_sync(workers, used, flavor="torch", **hp):
    init = init_values()
    out = {}
    for n in SHAPES:
        ref = ReferenceAdafactor(SHAPES[n], flavor, **hp)
        p = init[n]
        for step, (lr, wd) in enumerate(used):
            g = np.mean([grad(w, step, n).astype(np.float64) for w in range(workers)], axis=0)
            p = ref.step(p, g, lr=lr, weight_decay=wd)
        out[n] = p
    return out


@need_server
class SchedulesTest(unittest.TestCase):
    def check(self, got, want, what, constant=None):
        for n in SHAPES:
            scale = max(float(np.max(np.abs(want[n]))), 1e-3)
            err = float(np.max(np.abs(got[n].astype(np.float64) - want[n])))
            MEASURED[f"{what} {n}"] = err / scale
            self.assertLessEqual(err, TOL * scale, f"{what}: tensor {n}: max|diff| {err:.3g} > "
                                 f"{TOL * scale:.3g}")
            if constant is not None:
                off = float(np.max(np.abs(constant[n].astype(np.float64) - got[n])))
                self.assertGreater(off, 100 * TOL * scale,
                                   f"{what}: {n}: the schedule made no difference")

    def sync_runs(self, workers):
        with Shards(2, mode="sync", workers=workers) as shards:
            for sched in SCHEDULES:
                results = run_job(shards.addrs, workers, "sync", sched, f"{sched}/",
                                  weight_decay=0.01)
                final, used = results[0]
                for other, used_o in results[1:]:
                    self.assertEqual(used_o, used)
                    for n in SHAPES:
                        np.testing.assert_array_equal(other[n], final[n], f"workers differ: {n}")
                lrs = [lr for lr, _ in used]
                self.assertGreater(max(lrs) - min(lrs), 0.4 * LR, f"{sched}: lr did not move")
                want = reference_sync(workers, used, lr=LR, weight_decay=0.01)
                constant = reference_sync(workers, [(LR, wd_at(s)) for s in range(STEPS)],
                                          lr=LR, weight_decay=0.01)
                self.check(final, want, f"sync x{workers} {sched}", constant)

    def async_runs(self, workers):
        with Shards(2, mode="async", workers=workers) as shards:
            for sched in SCHEDULES:
                results = run_job(shards.addrs, workers, "async", sched, f"{sched}/",
                                  weight_decay=0.01)
                # Read the shards once every worker is done: their values
                # and each tensor's apply order.
                with factorps.connect(shards.addrs) as c:
                    c.discover()
                    names = [f"{sched}/{n}" for n in SHAPES]
                    params, _ = c.pull(names)
                    logs = {n: c.tensor_stats(f"{sched}/{n}", log=workers * STEPS)["apply_log"]
                            for n in SHAPES}
                init = init_values()
                want = {}
                for n in SHAPES:
                    log = logs[n]
                    self.assertEqual(len(log), workers * STEPS, n)
                    ref = ReferenceAdafactor(SHAPES[n], "torch", lr=LR, weight_decay=0.01)
                    p = init[n]
                    for rec in log:
                        lr, wd = results[rec["worker_id"]][1][rec["step"]]
                        # The shard applied exactly the values this step sent.
                        self.assertEqual((rec["lr"], rec["weight_decay"]), (lr, wd), rec)
                        p = ref.step(p, grad(rec["worker_id"], rec["step"], n), lr=lr,
                                     weight_decay=wd)
                    want[n] = p
                self.check({n: params[f"{sched}/{n}"] for n in SHAPES}, want,
                           f"async x{workers} {sched}")

    def test_sync_one_worker(self):
        self.sync_runs(1)

    def test_sync_two_workers(self):
        self.sync_runs(2)

    def test_async_one_worker(self):
        self.async_runs(1)

    def test_async_two_workers(self):
        self.async_runs(2)

    def test_hf_external_lr_schedule(self):
        hp = dict(lr=1e-3, relative_step=False, scale_parameter=False, weight_decay=0.01)
        with Shards(2, mode="sync", workers=1) as shards:
            (final, used), = run_job(shards.addrs, 1, "sync", "lambda", "hf/",
                                        cls=RemoteHFAdafactor, **hp)
        want = reference_sync(1, used, "hf", **hp)
        self.assertEqual(used[0][0], 0.0)  # warmup starts at 0
        self.check(final, want, "hf lambda")


def tearDownModule():
    if MEASURED:
        worst = max(MEASURED, key=MEASURED.get)
        print(f"\nworst relative error {MEASURED[worst]:.3g} ({worst}); bound {TOL}")


if __name__ == "__main__":
    unittest.main()

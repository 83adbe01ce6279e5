"""Parity: training through RemoteAdafactor ends where the local reference
Adafactor (factorps.reference, itself checked against the golden vectors)
ends when fed the same gradients.

- 1 worker, sync: the reference is fed that worker's gradients.
- 2 workers, sync: the reference is fed the average of both workers'
  gradients; both workers end with bit-identical parameters.
Both flavors, default hyperparameters and parameter groups with different
ones, over a model with matrices, a 3-D tensor (factored over its last two
dims), vectors and a 0-D scalar.

Tolerance (float32): for every tensor, after STEPS steps,
    max|remote - reference| <= STEPS * TOL * max(max|reference|, 1e-3),
TOL = 1e-6 per step: about 8 float32 roundings (eps 1.2e-7) of the
parameter's scale; the shard computes in float32, the reference in float64
and rounds where upstream stores float32. Measured worst: 3e-7 after 8 steps
(groups with weight decay), 3e-8 at defaults. The same test also requires
every tensor to have moved by at least 100x that bound, so that an update
that is off by a few per cent cannot hide inside the tolerance.
"""

import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server, run_workers
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

STEPS = 8
TOL = 1e-6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.w1 = torch.nn.Parameter(0.5 * torch.randn(10, 7, generator=g))
        self.b1 = torch.nn.Parameter(0.1 * torch.randn(7, generator=g))
        self.w2 = torch.nn.Parameter(0.5 * torch.randn(7, 3, generator=g))
        self.t3 = torch.nn.Parameter(0.5 * torch.randn(2, 3, 4, generator=g))
        self.s = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = torch.tanh(x @ self.w1 + self.b1)
        return h @ self.w2 * self.s + self.t3.mean(dim=(0, 2))


# Each config: (flavor, groups): groups are (names, hyperparameter overrides).
CONFIGS = {
    "torch_default": ("torch", [(["w1", "b1", "w2", "t3", "s"], {})]),
    "torch_groups": ("torch", [(["w1", "b1"], {"lr": 3e-2, "weight_decay": 0.05}),
                               (["w2", "t3", "s"], {"lr": 1e-3, "maximize": False,
                                                    "eps": (1e-6, 1e-2), "d": 2.0})]),
    "hf_default": ("hf", [(["w1", "b1", "w2", "t3", "s"], {})]),
    "hf_groups": ("hf", [(["w1", "b1"], {"beta1": 0.9, "weight_decay": 0.01}),
                         (["w2", "t3", "s"], {"lr": 1e-3, "relative_step": False,
                                              "scale_parameter": False})]),
}


def _ref_hparams(flavor, group):
    """RemoteAdafactor group overrides -> ReferenceAdafactor keyword args."""
    hp = dict(group)
    if "eps" in hp:
        hp["eps1"], hp["eps2"] = hp.pop("eps")
    return hp


def train_worker(addrs, worker_id, num_workers, config, steps):
    """One worker process: returns (initial params, per-step grads, final params)."""
    torch.set_num_threads(1)
    flavor, groups = CONFIGS[config]
    model = Net()
    named = dict(model.named_parameters())
    init = {n: p.detach().numpy().copy() for n, p in named.items()}
    cls = RemoteAdafactor if flavor == "torch" else RemoteHFAdafactor
    opt = cls([dict(params=[(n, named[n]) for n in names], **hp) for names, hp in groups],
              shards=addrs, worker_id=worker_id, num_workers=num_workers, deadline=30)
    opt.setup()
    g = torch.Generator().manual_seed(100 + worker_id)
    x, y = torch.randn(32, 10, generator=g), torch.randn(32, 3, generator=g)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append({n: p.grad.numpy().copy() for n, p in named.items()})
        opt.step()
    final = {n: p.detach().numpy().copy() for n, p in named.items()}
    opt.close()
    return init, grads, final


def reference_run(config, init, grads_per_step):
    flavor, groups = CONFIGS[config]
    refs, params = {}, {}
    for names, hp in groups:
        for n in names:
            refs[n] = ReferenceAdafactor(init[n].shape, flavor, **_ref_hparams(flavor, hp))
            params[n] = init[n]
    for grads in grads_per_step:
        for n in params:
            params[n] = refs[n].step(params[n], grads[n])
    return params


@need_server
class ParityTest(unittest.TestCase):
    def assert_close(self, got, want, init, steps, what):
        for n in want:
            scale = max(float(np.max(np.abs(want[n]))), 1e-3)
            bound = TOL * steps * scale
            err = float(np.max(np.abs(got[n].astype(np.float64) - want[n])))
            self.assertLessEqual(err, bound,
                                 f"{what}: tensor {n}: max|diff| {err:.3g}, bound {bound:.3g}")
            moved = float(np.max(np.abs(want[n].astype(np.float64) - init[n])))
            self.assertGreater(moved, 100 * bound, f"{what}: tensor {n} barely moved")

    def one_worker(self, config):
        with Shards(2, mode="sync", workers=1) as shards:
            (init, grads, final), = run_workers(train_worker,
                                                [(shards.addrs, 0, 1, config, STEPS)])
        want = reference_run(config, init, grads)
        self.assert_close(final, want, init, STEPS, config)

    def two_workers(self, config):
        with Shards(2, mode="sync", workers=2) as shards:
            results = run_workers(train_worker, [(shards.addrs, w, 2, config, STEPS)
                                                 for w in range(2)])
        (init0, grads0, final0), (_, grads1, final1) = results
        for n in final0:
            np.testing.assert_array_equal(final0[n], final1[n], f"workers differ on {n}")
        avg = [{n: (a[n].astype(np.float64) + b[n]) / 2 for n in a}
               for a, b in zip(grads0, grads1)]
        # The workers' data differ, so the averaged run differs from either.
        self.assertFalse(np.array_equal(grads0[0]["w1"], grads1[0]["w1"]))
        want = reference_run(config, init0, avg)
        self.assert_close(final0, want, init0, STEPS, config + " x2")

    def test_torch_one_worker(self):
        self.one_worker("torch_default")

    def test_hf_one_worker(self):
        self.one_worker("hf_default")

    def test_torch_groups_one_worker(self):
        self.one_worker("torch_groups")

    def test_hf_groups_one_worker(self):
        self.one_worker("hf_groups")

    def test_torch_two_workers(self):
        self.two_workers("torch_default")

    def test_hf_two_workers(self):
        self.two_workers("hf_groups")


if __name__ == "__main__":
    unittest.main()

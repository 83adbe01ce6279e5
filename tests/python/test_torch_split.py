"""RemoteAdafactor with a split embedding.

A small language-model-like net (a 64 x 12 embedding, a projection and a
bias) trains through RemoteAdafactor on shards started with --peers, with
split_min_bytes set so that the embedding, and only it, is cut into row
blocks (factorps.placement_plan is checked to say so). Both flavors (hf
with momentum and weight decay), 12 steps, 1 worker, sync:

- the split run over 2 and 3 shards ends where the unsplit run (the same
  job on 2 shards without splitting) ends, within
      max|split - unsplit| <= STEPS * 1e-6 * max(max|unsplit|, 1e-3)
  per tensor (test_parity's bound against the reference Adafactor: both
  runs use the shards' fp32 kernel, the split one sums its partials in
  another order); and both end within the same bound of factorps.reference
  (the numpy Adafactor checked against the golden vectors) fed the
  gradients of the unsplit run. Every tensor must move by at least 100x
  the bound, so a wrong update cannot hide in it;
- state_dict() of a run split over 3 shards holds the whole tensors' state
  (the upstream shapes), and loaded into a new optimizer on new shards
  split over 2 (another block map), and on 1 shard whole, the run continues
  to where the uninterrupted split run ends, within the same bound.
"""

import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
import factorps
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

STEPS = 12
TOL = 1e-6
VOCAB, WIDTH, OUT = 64, 12, 5
EMB_BYTES = VOCAB * WIDTH * 4

HPARAMS = {
    "torch": {"weight_decay": 0.01},
    "hf": {"lr": 1e-2, "relative_step": False, "scale_parameter": True, "beta1": 0.9,
           "weight_decay": 0.01},
}


class EmbNet(torch.nn.Module):
    def __init__(self, seed=4321):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(0.5 * torch.randn(VOCAB, WIDTH, generator=g))
        self.proj = torch.nn.Parameter(0.5 * torch.randn(WIDTH, OUT, generator=g))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(OUT, generator=g))

    def forward(self, tokens):
        return torch.tanh(self.emb[tokens].mean(1)) @ self.proj + self.bias


def batch(step):
    g = torch.Generator().manual_seed(77 + step)
    return torch.randint(0, VOCAB, (24, 6), generator=g), torch.randint(0, OUT, (24,), generator=g)


def make_opt(flavor, model, addrs, split):
    cls = RemoteAdafactor if flavor == "torch" else RemoteHFAdafactor
    return cls(model.named_parameters(), shards=addrs, num_workers=1, deadline=60,
               split_min_bytes=split, **HPARAMS[flavor])


def train(opt, model, steps, start=0):
    """Trains `steps` steps; returns the gradients of each step."""
    grads = []
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()})
        opt.step()
    return grads


def params_of(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def run(flavor, addrs, split, steps=STEPS):
    torch.manual_seed(0)
    model = EmbNet()
    init = params_of(model)
    opt = make_opt(flavor, model, addrs, split)
    try:
        grads = train(opt, model, steps)
    finally:
        opt.close()
    return init, grads, params_of(model)


def reference(flavor, init, grads):
    hp = dict(HPARAMS[flavor])
    refs = {n: ReferenceAdafactor(init[n].shape, flavor, **hp) for n in init}
    params = dict(init)
    for g in grads:
        params = {n: refs[n].step(params[n], g[n]) for n in params}
    return params


@need_server
class SplitEmbeddingTest(unittest.TestCase):
    def assert_close(self, got, want, init, steps, what):
        for n in want:
            scale = max(float(np.max(np.abs(want[n]))), 1e-3)
            bound = TOL * steps * scale
            err = float(np.max(np.abs(got[n].astype(np.float64) - want[n])))
            self.assertLessEqual(err, bound, f"{what}: {n}: max|diff| {err:.3g} > {bound:.3g}")
            moved = float(np.max(np.abs(want[n].astype(np.float64) - init[n])))
            self.assertGreater(moved, 100 * bound, f"{what}: {n} barely moved")

    def test_plan_splits_only_the_embedding(self):
        shapes = {n: tuple(p.shape) for n, p in EmbNet().named_parameters()}
        for S in (2, 3):
            plan, _ = factorps.placement_plan(shapes, S, EMB_BYTES)
            self.assertEqual(len(plan["emb"]), S, plan)
            self.assertEqual([len(plan[n]) for n in ("proj", "bias")], [1, 1], plan)

    def split_matches_unsplit(self, flavor):
        with Shards(2) as s:
            init, grads, whole = run(flavor, s.addrs, 0)
        self.assert_close(whole, reference(flavor, init, grads), init, STEPS,
                          f"{flavor} unsplit vs reference")
        for S in (2, 3):
            with Shards(S, peers=True) as s:
                init_s, _, split = run(flavor, s.addrs, EMB_BYTES)
            for n in init:
                np.testing.assert_array_equal(init_s[n], init[n])
            self.assert_close(split, whole, init, STEPS, f"{flavor} split over {S} vs unsplit")
            self.assert_close(split, reference(flavor, init, grads), init, STEPS,
                              f"{flavor} split over {S} vs reference")

    def test_torch_split_matches_unsplit(self):
        self.split_matches_unsplit("torch")

    def test_hf_split_matches_unsplit(self):
        self.split_matches_unsplit("hf")

    def test_state_dict_moves_across_shard_counts(self):
        flavor, half = "hf", STEPS // 2
        with Shards(3, peers=True) as s:
            init, _, straight = run(flavor, s.addrs, EMB_BYTES)
        with Shards(3, peers=True) as s:
            torch.manual_seed(0)
            model = EmbNet()
            opt = make_opt(flavor, model, s.addrs, EMB_BYTES)
            train(opt, model, half)
            saved_model = {k: v.clone() for k, v in model.state_dict().items()}
            saved = opt.state_dict()
            opt.close()
        emb_state = saved["state"][0]  # the embedding's, whole (hf's upstream shapes)
        self.assertEqual(tuple(emb_state["exp_avg_sq_row"].shape), (VOCAB,))
        self.assertEqual(tuple(emb_state["exp_avg_sq_col"].shape), (WIDTH,))
        self.assertEqual(tuple(emb_state["exp_avg"].shape), (VOCAB, WIDTH))
        self.assertEqual(int(emb_state["step"]), half)
        for S, peers, split in ((2, True, EMB_BYTES), (1, False, 0)):
            with self.subTest(shards=S), Shards(S, peers=peers) as s:
                model = EmbNet()
                model.load_state_dict(saved_model)
                opt = make_opt(flavor, model, s.addrs, split)
                opt.load_state_dict(saved)
                try:
                    train(opt, model, STEPS - half, start=half)
                finally:
                    opt.close()
                self.assert_close(params_of(model), straight, init, STEPS,
                                  f"resumed on {S} shard(s) vs uninterrupted")


if __name__ == "__main__":
    unittest.main()

"""RemoteAdafactor in the training loop a PyTorch user writes.

What docs/pytorch.md promises, called the way torch.optim
code calls an optimizer:

- a model with two param groups of different lr and weight_decay, a frozen
  parameter (requires_grad=False) and a parameter the forward never uses,
  driven by opt.step(closure) (the closure calls zero_grad(set_to_none=True),
  forward and backward and returns the loss) and by
  torch.optim.lr_scheduler.ReduceLROnPlateau, the one scheduler that writes
  param_groups[i]["lr"] from the loss rather than from a step count;
- every step is checked on its own against factorps.reference (checked
  against the golden vectors): the parameters after step() equal the
  reference step from the parameters and gradients before it, with the
  group's lr and weight decay of that step; the frozen and unused parameters
  keep their values bit for bit and their shard version (no update, no
  weight decay); the shards' apply log records each group's own lr and
  weight decay;
- zero_grad(set_to_none=False) (gradients of zeros, not None) is a real
  push: every parameter with a gradient, zeros included, is stepped;
- float64, bfloat16 and float16 parameters and a non-contiguous one are
  stepped as float32 copies and receive the shards' values in their dtype;
- a state_dict() taken mid-run with two groups and a ReduceLROnPlateau,
  saved with torch.save to bytes and loaded into a new optimizer on new,
  empty shards, continues bit for bit where the uninterrupted run goes.

Tolerance (the golden vectors' per-step "param scaled" metric):
    max|remote - reference| <= TOL * max(max|reference|, 1e-3), TOL = 1e-5.
So that a wrong lr (the groups' differ 5x, a halving 2x) cannot pass
inside it, each step must move every stepped parameter by more than 10x the
bound.
"""

import io
import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

TOL = 1e-5
STEPS = 12
LRS = (2e-2, 4e-3)
WDS = (0.0, 0.1)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.enc = torch.nn.Parameter(0.5 * torch.randn(6, 9, generator=g))
        self.enc_b = torch.nn.Parameter(0.1 * torch.randn(9, generator=g))
        self.head = torch.nn.Parameter(0.5 * torch.randn(9, 4, generator=g))
        self.frozen = torch.nn.Parameter(0.5 * torch.randn(4, 4, generator=g),
                                         requires_grad=False)
        self.unused = torch.nn.Parameter(0.5 * torch.randn(5, generator=g))

    def forward(self, x):
        return torch.tanh(x @ self.enc + self.enc_b) @ self.head @ self.frozen

    def groups(self):
        return [{"params": [("enc", self.enc), ("enc_b", self.enc_b)], "lr": LRS[0],
                 "weight_decay": WDS[0]},
                {"params": [("head", self.head), ("frozen", self.frozen),
                            ("unused", self.unused)], "lr": LRS[1], "weight_decay": WDS[1]}]


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def make(addrs, flavor, namespace):
    model = Model()
    if flavor == "torch":
        opt = RemoteAdafactor(model.groups(), shards=addrs, namespace=namespace, deadline=30)
    else:
        opt = RemoteHFAdafactor(model.groups(), lr=LRS[0], shards=addrs, namespace=namespace,
                                deadline=30,
                                relative_step=False, scale_parameter=False, warmup_init=False)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    return model, opt, sched


def closure_for(model, opt, step):
    x, y = data(step)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    return closure


def plateau_loss(step):
    """The metric fed to ReduceLROnPlateau: falling, but worse than the best
    at steps 4 and 8, so (patience 0) the lr halves twice."""
    return 100.0 if step in (4, 8) else float(20 - step)


def ref_hp(flavor):
    return {} if flavor == "torch" else dict(relative_step=False, scale_parameter=False,
                                             warmup_init=False)


@need_server
class LoopTest(unittest.TestCase):
    def run_checked(self, flavor):
        with Shards(2, mode="sync", workers=1) as shards:
            model, opt, sched = make(shards.addrs, flavor, "loop/")
            try:
                group_of = {n: gi for gi, g in enumerate(model.groups())
                            for n, _ in g["params"]}
                refs = {n: ReferenceAdafactor(tuple(p.shape), flavor, lr=LRS[group_of[n]],
                                              weight_decay=WDS[group_of[n]], **ref_hp(flavor))
                        for n, p in model.named_parameters()}
                fixed = {n: model.get_parameter(n).detach().clone() for n in ("frozen", "unused")}
                sent = []  # per step: (lr, wd) of each group
                for step in range(STEPS):
                    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
                    hps = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
                    sent.append(hps)
                    loss = opt.step(closure_for(model, opt, step))
                    self.assertIsInstance(loss, torch.Tensor)
                    for n in ("frozen", "unused"):
                        self.assertIsNone(model.get_parameter(n).grad, n)
                    for n, p in model.named_parameters():
                        if n in fixed:
                            continue
                        lr, wd = hps[group_of[n]]
                        g = p.grad.detach().numpy()
                        want = refs[n].step(before[n], g, lr=lr, weight_decay=wd)
                        got = p.detach().numpy()
                        scale = max(float(np.max(np.abs(want))), 1e-3)
                        err = float(np.max(np.abs(got.astype(np.float64) - want)))
                        self.assertLessEqual(err, TOL * scale,
                                             f"{flavor} step {step} {n}: max|diff| {err:.3g}")
                        # The step moved the parameter far beyond the bound, so
                        # a wrong lr (off by 2x or more) cannot pass inside it.
                        moved = float(np.max(np.abs(got.astype(np.float64) - before[n])))
                        self.assertGreater(moved, 10 * TOL * scale, f"{n} step {step}")
                    sched.step(plateau_loss(step))
                self.assertEqual([g["lr"] for g in opt.param_groups],
                                 [LRS[0] / 4, LRS[1] / 4], "ReduceLROnPlateau halves twice")
                self.assertEqual(sent[5], [(LRS[0] / 2, WDS[0]), (LRS[1] / 2, WDS[1])])
                for n, v in fixed.items():
                    self.assertTrue(torch.equal(model.get_parameter(n).detach(), v), n)
                _, versions = opt.client.pull([f"loop/{n}" for n in ("enc", "head", "unused")])
                self.assertEqual(versions, {"loop/enc": STEPS, "loop/head": STEPS,
                                            "loop/unused": 0})
                # requires_grad=False never travels: not even created.
                self.assertEqual(sum(st["tensors"] for st in opt.client.stats()), 4)
                for n, gi in (("enc", 0), ("enc_b", 0), ("head", 1)):
                    log = opt.client.tensor_stats(f"loop/{n}", log=STEPS)["apply_log"]
                    self.assertEqual(len(log), STEPS, n)
                    for rec, hps in zip(log, sent):
                        self.assertAlmostEqual(rec["lr"], hps[gi][0], delta=1e-9 * LRS[0],
                                               msg=f"{n} step {rec['step']}")
                        self.assertAlmostEqual(rec["weight_decay"], hps[gi][1], delta=1e-9,
                                               msg=f"{n} step {rec['step']}")
                self.assertEqual(opt.state[model.frozen], {})
                # The state of a parameter without gradient stayed zero.
                st = opt.state[model.unused]
                for k, t in st.items():
                    if torch.is_tensor(t) and k != "step":
                        self.assertEqual(float(t.abs().sum()), 0.0, f"frozen state {k}")
            finally:
                opt.close()

    def test_two_groups_closure_plateau_frozen_torch(self):
        self.run_checked("torch")

    def test_two_groups_closure_plateau_frozen_hf(self):
        self.run_checked("hf")

    def test_zero_grad_set_to_none_false_pushes_zeros(self):
        with Shards(1, mode="sync", workers=1) as shards:
            model, opt, _ = make(shards.addrs, "torch", "zeros/")
            try:
                opt.step(closure_for(model, opt, 0))
                opt.zero_grad(set_to_none=False)
                self.assertTrue(all(p.grad is not None for p in
                                    (model.enc, model.enc_b, model.head)))
                before = model.head.detach().numpy().copy()
                opt.step()
                # A zero gradient is stepped: the update is zero, weight decay
                # (group 1: 0.1) still shrinks the parameter.
                want = before * (1.0 - LRS[1] * WDS[1])
                np.testing.assert_allclose(model.head.detach().numpy(), want, rtol=1e-6,
                                           atol=1e-7)
                _, v = opt.client.pull(["zeros/head", "zeros/unused"])
                self.assertEqual(v, {"zeros/head": 2, "zeros/unused": 0})
            finally:
                opt.close()

    def test_other_dtypes_and_non_contiguous_parameters(self):
        """docs/pytorch.md: parameters are CPU float32, others go through a float32
        copy. The shards step the float32 values of float64, bfloat16 and
        float16 parameters (and of a non-contiguous float32 one, in its
        logical C order), and each parameter receives the shards' values in
        its own dtype."""
        with Shards(1, mode="sync", workers=1) as shards:
            for dt in (torch.float64, torch.bfloat16, torch.float16):
                g = torch.Generator().manual_seed(3)
                w = torch.nn.Parameter((0.5 * torch.randn(4, 6, generator=g)).to(dt))
                nc = torch.nn.Parameter(torch.randn(6, 4, generator=g).t())
                self.assertFalse(nc.is_contiguous())
                ns = f"{str(dt)[6:]}/"
                opt = RemoteAdafactor([("w", w), ("nc", nc)], shards=shards.addrs, namespace=ns)
                refs = {n: ReferenceAdafactor(tuple(p.shape), "torch") for n, p in
                        (("w", w), ("nc", nc))}
                want = {"w": w.detach().float().numpy().copy(), "nc": nc.detach().numpy().copy()}
                try:
                    for step in range(3):
                        w.grad = torch.linspace(-1, 1, 24).reshape(4, 6).to(dt) * (step + 1)
                        nc.grad = torch.linspace(2, -1, 24).reshape(6, 4).t().contiguous()
                        for n, p in (("w", w), ("nc", nc)):
                            want[n] = refs[n].step(want[n], p.grad.float().numpy())
                        opt.step()
                    held, _ = opt.client.pull([ns + "w", ns + "nc"])
                    for n, p in (("w", w), ("nc", nc)):
                        got = held[ns + n].reshape(p.shape)
                        scale = max(float(np.max(np.abs(want[n]))), 1e-3)
                        err = float(np.max(np.abs(got.astype(np.float64) - want[n])))
                        self.assertLessEqual(err, TOL * scale, f"{dt} {n}: {err:.3g}")
                        self.assertEqual(p.dtype, dt if n == "w" else torch.float32)
                        self.assertTrue(torch.equal(p.detach(), torch.from_numpy(got).to(p.dtype)),
                                        f"{dt} {n}: the parameter is not the shards' value")
                finally:
                    opt.close()

    def test_state_dict_round_trip_continues_bit_for_bit(self):
        split, total = 5, 10

        def train(opt, model, sched, steps):
            for step in steps:
                opt.step(closure_for(model, opt, step))
                sched.step(plateau_loss(step))

        with Shards(2) as a:
            model, opt, sched = make(a.addrs, "torch", "rt/")
            train(opt, model, sched, range(total))
            straight = {n: p.detach().clone() for n, p in model.named_parameters()}
            straight_lr = [g["lr"] for g in opt.param_groups]
            opt.close()
        with Shards(2) as b:
            model, opt, sched = make(b.addrs, "torch", "rt/")
            train(opt, model, sched, range(split))
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            opt.close()
        buf.seek(0)
        ck = torch.load(buf)
        self.assertEqual(len(ck["opt"]["param_groups"]), 2)
        with Shards(2) as c:  # new, empty shards, new objects
            model, opt, sched = make(c.addrs, "torch", "rt/")
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            self.assertEqual([g["lr"] for g in opt.param_groups],
                             [g["lr"] for g in ck["opt"]["param_groups"]])
            train(opt, model, sched, range(split, total))
            self.assertEqual([g["lr"] for g in opt.param_groups], straight_lr)
            for n, p in model.named_parameters():
                self.assertTrue(torch.equal(p.detach(), straight[n]), f"{n} differs after resume")
            opt.close()


if __name__ == "__main__":
    unittest.main()

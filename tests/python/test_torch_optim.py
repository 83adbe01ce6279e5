"""factorps.torch.RemoteAdafactor as a torch.optim.Optimizer: arguments,
names, creation and start-up, None gradients, closures, state_dict, new
parameter groups, and what it refuses."""

import copy
import inspect
import os
import pydoc
import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
import factorps
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

NOWHERE = ["127.0.0.1:1"]  # connection is lazy: fine for argument checks


def _params():
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g))]


def _steps(opt, ps, n=1):
    """n steps of opt with every gradient of ps all ones."""
    for _ in range(n):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()


class ArgumentsTest(unittest.TestCase):
    def setUp(self):
        # The launcher defaults read these; the tests set them explicitly.
        for k in ("RANK", "WORLD_SIZE", "FACTORPS_SHARDS"):
            if k in os.environ:
                self.addCleanup(os.environ.__setitem__, k, os.environ.pop(k))

    def test_torch_defaults_and_names(self):
        opt = RemoteAdafactor(_params(), shards=NOWHERE)
        g = opt.param_groups[0]
        self.assertEqual((g["lr"], g["beta2_decay"], g["eps"], g["d"], g["weight_decay"],
                          g["foreach"], g["maximize"]),
                         (1e-2, -0.8, (None, 1e-3), 1.0, 0.0, None, False))
        self.assertEqual(opt.defaults, {k: v for k, v in g.items() if k != "params"})
        self.assertEqual(opt.param_names(), ["g0.p0", "g0.p1"])
        self.assertIsInstance(opt, torch.optim.Optimizer)
        opt.close()

    def test_signatures_are_upstreams(self):
        sig = inspect.signature(RemoteAdafactor)
        ps = list(sig.parameters.values())
        self.assertEqual([p.name for p in ps[:6]],
                         ["params", "lr", "beta2_decay", "eps", "d", "weight_decay"])
        self.assertEqual([p.default for p in ps[1:6]], [1e-2, -0.8, (None, 1e-3), 1.0, 0.0])
        for name in ("foreach", "maximize", "shards", "worker_id", "num_workers", "mode",
                     "namespace", "on_existing"):
            self.assertEqual(sig.parameters[name].kind, inspect.Parameter.KEYWORD_ONLY, name)
        self.assertIn("beta2_decay: float = -0.8", pydoc.render_doc(RemoteAdafactor))
        hf = list(inspect.signature(RemoteHFAdafactor).parameters.values())
        self.assertEqual([(p.name, p.default) for p in hf[1:10]],
                         [("lr", None), ("eps", (1e-30, 1e-3)), ("clip_threshold", 1.0),
                          ("decay_rate", -0.8), ("beta1", None), ("weight_decay", 0.0),
                          ("scale_parameter", True), ("relative_step", True),
                          ("warmup_init", False)])
        self.assertTrue(all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in hf[10:]))
        # maximize is keyword-only, as upstream.
        with self.assertRaises(TypeError):
            RemoteAdafactor(_params(), 1e-2, -0.8, (None, 1e-3), 1.0, 0.0, True,
                            shards=NOWHERE)

    def test_hf_defaults_and_positional_order(self):
        opt = RemoteHFAdafactor(_params(), shards=NOWHERE)
        g = opt.param_groups[0]
        self.assertEqual((g["lr"], g["eps"], g["clip_threshold"], g["decay_rate"], g["beta1"],
                          g["weight_decay"], g["scale_parameter"], g["relative_step"],
                          g["warmup_init"]),
                         (None, (1e-30, 1e-3), 1.0, -0.8, None, 0.0, True, True, False))
        opt2 = RemoteHFAdafactor(_params(), 1e-3, (1e-30, 1e-3), 1.0, -0.8, 0.9, 0.0, False,
                                 False, shards=NOWHERE)
        g2 = opt2.param_groups[0]
        self.assertEqual((g2["lr"], g2["beta1"], g2["relative_step"]), (1e-3, 0.9, False))
        self.assertEqual(opt2.flavor, "hf")

    def test_arguments_of_the_other_flavor_are_refused(self):
        with self.assertRaises(TypeError):
            RemoteHFAdafactor(_params(), beta2_decay=-0.5, shards=NOWHERE)
        with self.assertRaises(TypeError):
            RemoteAdafactor(_params(), clip_threshold=1.0, shards=NOWHERE)
        with self.assertRaises(TypeError):  # the old spelling: use RemoteHFAdafactor
            RemoteAdafactor(_params(), flavor="hf", shards=NOWHERE)

    def test_upstream_validation(self):
        bad = [dict(lr=-1.0), dict(beta2_decay=0.5), dict(eps=(-1.0, 1e-3)), dict(d=0.5),
               dict(weight_decay=-0.1), dict(lr=torch.tensor([1e-2, 1e-3]))]
        for kw in bad:
            with self.assertRaises(ValueError, msg=kw):
                RemoteAdafactor(_params(), shards=NOWHERE, **kw)
        with self.assertRaisesRegex(ValueError, "Cannot combine manual `lr` and "
                                    "`relative_step=True`"):
            RemoteHFAdafactor(_params(), lr=1e-3, shards=NOWHERE)
        with self.assertRaisesRegex(ValueError, "`warmup_init=True` requires"):
            RemoteHFAdafactor(_params(), lr=1e-3, warmup_init=True, relative_step=False,
                              shards=NOWHERE)
        with self.assertRaisesRegex(ValueError, "requires a manual `lr`"):
            RemoteHFAdafactor(_params(), relative_step=False, shards=NOWHERE)
        # Per group too.
        with self.assertRaises(ValueError):
            RemoteAdafactor([{"params": _params(), "lr": -2.0}], shards=NOWHERE)
        for kw in (dict(mode="fast"), dict(on_existing="replace")):
            with self.assertRaises(ValueError, msg=kw):
                RemoteAdafactor(_params(), shards=NOWHERE, **kw)

    def test_worker_and_shards_are_required(self):
        with self.assertRaisesRegex(ValueError, "FACTORPS_SHARDS"):
            RemoteAdafactor(_params())
        with self.assertRaisesRegex(ValueError, "worker_id=2 num_workers=2"):
            RemoteAdafactor(_params(), shards=NOWHERE, worker_id=2, num_workers=2)

    def test_named_parameters_and_namespace(self):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        opt = RemoteAdafactor(model.named_parameters(), shards=NOWHERE, namespace="m/")
        self.assertEqual(opt.param_names(), ["m/0.weight", "m/0.bias", "m/1.weight", "m/1.bias"])
        self.assertEqual(opt.param_groups[0]["param_names"],
                         ["0.weight", "0.bias", "1.weight", "1.bias"])
        named = list(model.named_parameters())
        opt = RemoteAdafactor([{"params": named[:2]}, {"params": named[2:], "lr": 1e-3}],
                              shards=NOWHERE)
        self.assertEqual(opt.param_names(), ["0.weight", "0.bias", "1.weight", "1.bias"])
        p = torch.nn.Parameter(torch.ones(2))
        with self.assertRaisesRegex(ValueError, "named"):
            RemoteAdafactor([("x", p), ("x", torch.nn.Parameter(torch.ones(2)))],
                            shards=NOWHERE)


@need_server
class RemoteTest(unittest.TestCase):
    def setUp(self):
        self.shards = Shards(2, workers=1)
        self.addCleanup(self.shards.close)

    def opt(self, params, **kw):
        kw.setdefault("deadline", 10)
        o = RemoteAdafactor(params, shards=self.shards.addrs, **kw)
        self.addCleanup(o.close)
        return o

    def test_step_updates_in_place(self):
        ps = _params()
        ptrs = [p.data_ptr() for p in ps]
        init = [p.detach().numpy().copy() for p in ps]
        opt = self.opt(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        self.assertEqual([p.data_ptr() for p in ps], ptrs)
        for p, p0 in zip(ps, init):
            want = ReferenceAdafactor(p0.shape, "torch").step(p0, np.ones_like(p0))
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=0, atol=1e-6)
        self.assertEqual(opt.remote_step, 1)

    def test_low_precision_eps1_is_the_dtype_eps(self):
        # eps=(None, ...) is torch.finfo(param.dtype).eps upstream: 2^-7
        # for bf16, 2^-10 for fp16. Gradients whose mean square (1e-6) lies
        # between fp32's eps (1.2e-7) and those tell the two apart.
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                g = torch.Generator().manual_seed(3)
                p = torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype))
                p.grad = (torch.randn(4, 3, generator=g) * 1e-3).to(dtype)
                p0, g0 = p.detach().float().numpy(), p.grad.float().numpy()
                name = str(dtype).replace("torch.", "w_")
                opt = self.opt([(name, p)])
                opt.step()
                got = opt.client.pull([name])[0][name]  # the shard's fp32 master
                eps = float(torch.finfo(dtype).eps)
                want = ReferenceAdafactor(p0.shape, "torch", eps1=eps).step(p0, g0)
                fp32 = ReferenceAdafactor(p0.shape, "torch").step(p0, g0)
                self.assertGreater(np.abs(want - fp32).max(), 1e-3)  # the case tells
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
                opt.close()

    def test_none_gradients_are_not_stepped(self):
        # A parameter without a gradient gets no update (no_grad on
        # the wire), as in torch: its shard version stays 0.
        ps = _params()
        before = [p.detach().clone() for p in ps]
        opt = self.opt(ps)
        ps[0].grad = torch.ones_like(ps[0])  # ps[1].grad stays None
        opt.step()
        torch.testing.assert_close(ps[1].detach(), before[1], rtol=0, atol=0)
        self.assertFalse(torch.equal(ps[0].detach(), before[0]))
        _, versions = opt.client.pull(want_params=False)
        self.assertEqual(sorted(versions.values()), [0, 1])

    def test_closure(self):
        p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        opt = self.opt([p], lr=0.1)

        def closure():
            opt.zero_grad()
            loss = (p ** 2).sum()
            loss.backward()
            return loss

        loss = opt.step(closure)
        self.assertAlmostEqual(loss.item(), 5.0, places=5)
        self.assertLess((p ** 2).sum().item(), 5.0)

    def test_fixed_hparams_refuse_to_change(self):
        ps = _params()
        opt = self.opt(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        before = [p.detach().clone() for p in ps]
        opt.param_groups[0]["beta2_decay"] = -0.5
        with self.assertRaisesRegex(ValueError, "beta2_decay changed from -0.8 to -0.5 after "
                                    "the tensors were created; only lr and weight_decay"):
            opt.step()
        for a, b in zip(ps, before):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)

    def test_param_group_added_mid_training_is_refused_in_sync(self):
        ps = _params()
        opt = self.opt(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        extra = torch.nn.Parameter(torch.ones(5, 2))
        opt.add_param_group({"params": [extra], "weight_decay": 0.1})
        extra.grad = torch.ones(5, 2)
        for p in ps:
            p.grad = torch.ones_like(p)
        # The old tensors are at version 1, the new one at 0: each travels
        # with its own step (TensorPush.step), so the sync shard takes both.
        opt.step()
        _, versions = opt.client.pull(want_params=False)
        self.assertEqual(sorted(versions.values()), [1, 2, 2])

    def test_tensors_stay_where_their_state_is_when_a_group_is_added(self):
        # Shapes whose largest-first placement on 2 shards changes once a
        # 3 x 3 tensor joins (the 8-element bias would move to the other
        # shard, and be created there afresh: state lost, the old copy left
        # behind, with 2 workers a job that could not go on). The tensors
        # the shards hold stay where they are; the new one goes where the
        # plan puts it.
        g = torch.Generator().manual_seed(4)
        shapes = {"a.w": (8, 6), "b.w": (3, 8), "c.w": (3, 8), "a.b": (8,), "b.b": (3,), "c.b": (3,)}
        named = [(n, torch.nn.Parameter(torch.randn(*s, generator=g))) for n, s in shapes.items()]
        extra = torch.nn.Parameter(torch.ones(3, 3))

        def step(ps):
            for p in ps:
                p.grad = torch.ones_like(p)
            opt.step()
        opt = self.opt(named)
        for _ in range(3):
            step([p for _, p in named])
        where = {n: opt.client.shard_of(n) for n in shapes}
        opt.add_param_group({"params": [("extra", extra)]})
        for _ in range(2):
            step([p for _, p in named] + [extra])
        self.assertEqual({n: opt.client.shard_of(n) for n in shapes}, where)
        _, versions = opt.client.pull(want_params=False)
        self.assertEqual(versions, {**{n: 5 for n in shapes}, "extra": 2})
        self.assertEqual([float(opt.state[p]["step"]) for _, p in named], [5.0] * len(named))
        self.assertEqual(sum(s["tensors"] for s in opt.client.stats()), len(shapes) + 1)  # each held once

    def test_a_shard_that_lost_its_tensors_says_so(self):
        ps = _params()
        opt = self.opt(ps)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        for i in range(2):
            self.shards.restart(i)  # no checkpoint: they come back empty
        for p in ps:
            p.grad = torch.ones_like(p)
        with self.assertRaisesRegex(factorps.NotFoundError, r"restarted without a checkpoint .*"
                                    r"load_state_dict\(\), then step\(\)"):
            opt.step()
        # What the message says to do puts them back.
        opt.load_state_dict(saved)
        opt.step()
        self.assertEqual(opt.remote_step, 2)

    def test_recovery_timeout_is_named(self):
        ps = _params()
        opt = self.opt(ps, recovery_timeout=1.0, deadline=1.0)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        for i in range(2):
            self.shards.kill(i)  # never back
        for p in ps:
            p.grad = torch.ones_like(p)
        with self.assertRaisesRegex(factorps.UnavailableError, r"still failing after recovery_timeout=1 s"):
            opt.step()

    def test_a_second_run_on_live_shards(self):
        ps = _params()
        opt = self.opt(ps)
        _steps(opt, ps, 3)
        trained = [p.detach().clone() for p in ps]

        # "Run 2": a fresh model (other initial values) and optimizer. The
        # shards hold its tensor names: an error unless the run says what to do.
        ps2 = [torch.nn.Parameter(torch.zeros_like(p)) for p in ps]
        opt2 = self.opt(ps2)
        with self.assertRaisesRegex(factorps.AlreadyExistsError,
                                    r"already hold 2 of this job's 2 tensors .*'g0.p0' at "
                                    r"version 3.*on_existing='adopt'"):
            opt2.setup()
        for p in ps2:
            torch.testing.assert_close(p.detach(), torch.zeros_like(p), rtol=0, atol=0)
        opt3 = self.opt(ps2, on_existing="adopt")
        opt3.setup()
        self.assertEqual(opt3.remote_step, 3)
        for a, b in zip(ps2, trained):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
        for p in ps2:
            p.grad = torch.ones_like(p)
        opt3.step()
        self.assertEqual(opt3.remote_step, 4)

    def test_load_state_dict_checks_the_model(self):
        opt = self.opt(_params())
        sd = opt.state_dict()
        other = self.opt([torch.nn.Parameter(torch.ones(4, 3)),
                          torch.nn.Parameter(torch.ones(4))])
        with self.assertRaisesRegex(ValueError, "shape"):
            other.load_state_dict(sd)
        hf = RemoteHFAdafactor(_params(), shards=self.shards.addrs)
        self.addCleanup(hf.close)
        with self.assertRaisesRegex(ValueError, "flavor"):
            hf.load_state_dict(sd)
        with self.assertRaises(ValueError):
            opt.load_state_dict({"state": {}, "param_groups": []})

    def test_load_state_dict_refuses_values_the_shards_would(self):
        # A NaN or negative second moment, or a step past 2^53, was accepted
        # here; the next step() then had one shard take its tensors and
        # another refuse them: the model at two versions, every step failing.
        ps = _params()
        opt = self.opt(ps)
        _steps(opt, ps, 2)
        sd = opt.state_dict()
        key = next(k for k in sd["state"][0] if k.endswith("row_var") or k == "exp_avg_sq_row")
        for bad, words in ((float("nan"), "not finite"), (-1.0, "cannot be negative")):
            broken = copy.deepcopy(sd)
            broken["state"][0][key].view(-1)[0] = bad
            with self.assertRaisesRegex(ValueError, words):
                opt.load_state_dict(broken)
        broken = copy.deepcopy(sd)
        broken["state"][0]["step"] = torch.tensor(2.0 ** 60)
        with self.assertRaisesRegex(ValueError, r"0\.\.2\^53"):
            opt.load_state_dict(broken)
        _steps(opt, ps)  # nothing changed: training goes on
        self.assertEqual(opt.remote_step, 3)

    def test_frozen_after_a_step_then_unfrozen(self):
        # Freezing a parameter after it travelled, then unfreezing it (staged
        # fine-tuning), made every later step() raise KeyError.
        p = torch.nn.Parameter(torch.ones(3))
        q = torch.nn.Parameter(torch.ones(3))
        opt = self.opt([("p", p), ("q", q)], lr=0.1)
        p.grad, q.grad = torch.ones(3), torch.ones(3)
        opt.step()
        q.requires_grad_(False)
        q.grad = None
        p.grad = torch.ones(3)
        opt.step()
        q_frozen = q.detach().clone()
        q.requires_grad_(True)
        for _ in range(2):
            p.grad, q.grad = torch.ones(3), torch.ones(3)
            opt.step()
        self.assertTrue(bool((q.detach() < q_frozen).all()), q)
        # A change made while frozen is written to the shards, as any local
        # change is.
        q.requires_grad_(False)
        with torch.no_grad():
            q.fill_(5.0)
        q.requires_grad_(True)
        p.grad, q.grad = torch.ones(3), torch.zeros(3)
        opt.step()
        params, _ = opt.client.pull(["q"])
        np.testing.assert_allclose(params["q"], 5.0, atol=0.01)

    def test_recovery_timeout_must_be_a_number(self):
        for bad in (float("nan"), float("inf"), -1.0):
            with self.assertRaisesRegex(ValueError, "recovery_timeout"):
                RemoteAdafactor(_params(), shards=self.shards.addrs, recovery_timeout=bad)

    def test_num_workers_must_match_the_shards(self):
        opt = self.opt(_params(), num_workers=2, worker_id=0)  # shards run 1 worker
        with self.assertRaisesRegex(factorps.FailedPreconditionError, "num_workers=2"):
            opt.setup()

    def test_worker_1_waits_for_worker_0_values(self):
        with Shards(1, workers=2) as shards:
            a = [torch.nn.Parameter(torch.full((3, 2), 5.0))]
            b = [torch.nn.Parameter(torch.zeros(3, 2))]
            o1 = RemoteAdafactor(b, shards=shards.addrs, worker_id=1, num_workers=2, deadline=2)
            self.addCleanup(o1.close)
            # Nobody has sent values yet: worker 1 gives up at the deadline.
            with self.assertRaises(factorps.DeadlineExceededError):
                o1.setup()
            o0 = RemoteAdafactor(a, shards=shards.addrs, worker_id=0, num_workers=2,
                                 deadline=10)
            self.addCleanup(o0.close)
            o0.setup()
            o1.setup()
            torch.testing.assert_close(b[0].detach(), torch.full((3, 2), 5.0))


if __name__ == "__main__":
    unittest.main()

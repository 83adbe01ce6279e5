"""RemoteAdafactor's visible state and state dict, against real shards.

- optimizer.state has the upstream names and shapes (torch.optim.Adafactor:
  step, row_var [..., R, 1], col_var [..., 1, C], variance; transformers:
  step, RMS, exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq, exp_avg), equal to
  the reference's state within the golden vectors' state tolerance (relative
  1e-4 with a floor of 1e-6 * max; momentum 1e-5 of its max), and the
  classic size sum equals the shards' Stats figures (plus one scalar per
  tensor: torch's step tensor, transformers' RMS tensor).
- A state dict that does not match is a ValueError naming the tensor.
- transformers' AdafactorSchedule (a local equivalent) reads the shard's
  relative-step lr through _get_lr, and a scheduler's lr in a relative-step
  group is ignored, as transformers ignores it.
- A local change of a parameter in a 2-worker sync job is an error.
"""

import unittest
from contextlib import ExitStack

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _torch_support import Net, loss_step
from _support import Shards, need_server, run_threads
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

STATE_TOL = 1e-4
PARAM_TOL = 1e-5
W0 = np.array(0.5 * np.random.default_rng(1234).standard_normal((12, 8)), np.float32)


def _state_close(test, got, want, what):
    got = got.detach().double().numpy().reshape(-1)
    want = np.asarray(want, np.float64).reshape(-1)
    floor = 1e-6 * max(float(np.max(np.abs(want))), 1e-30)
    rel = np.abs(got - want) / np.maximum(np.abs(want), floor)
    test.assertLessEqual(float(np.max(rel)), STATE_TOL, what)


def _size_sum(opt):
    return sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


@need_server
class StateTest(unittest.TestCase):
    def test_torch_state_names_shapes_values_and_size(self):
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            opt = RemoteAdafactor(model.named_parameters(), weight_decay=0.01,
                                  shards=shards.addrs)
            stack.callback(opt.close)
            # Before the first step: zeros at step 0, the sizes of what the
            # step creates (torch.distributed.checkpoint loads into them).
            self.assertEqual(len(opt.state), 4)
            for st in opt.state.values():
                self.assertEqual(float(st["step"]), 0.0)
                self.assertTrue(all(float(t.abs().sum()) == 0 for t in st.values()))
            refs = {n: ReferenceAdafactor(p.shape, "torch", weight_decay=0.01)
                    for n, p in init.items()}
            want = dict(init)
            for step in range(3):
                loss_step(model, opt, 0, step)
                for n, p in model.named_parameters():
                    want[n] = refs[n].step(want[n], p.grad.numpy())
            named = dict(model.named_parameters())
            for n, p in named.items():
                st = opt.state[p]
                if p.dim() >= 2:
                    self.assertEqual(sorted(st), ["col_var", "row_var", "step"], n)
                    self.assertEqual(list(st["row_var"].shape), list(p.shape[:-1]) + [1], n)
                    self.assertEqual(list(st["col_var"].shape),
                                     list(p.shape[:-2]) + [1, p.shape[-1]], n)
                    _state_close(self, st["row_var"], refs[n].row, n + " row_var")
                    _state_close(self, st["col_var"], refs[n].col, n + " col_var")
                else:
                    self.assertEqual(sorted(st), ["step", "variance"], n)
                    self.assertEqual(st["variance"].shape, p.shape, n)
                    _state_close(self, st["variance"], refs[n].var, n + " variance")
                self.assertTrue(torch.is_tensor(st["step"]))
                self.assertEqual((st["step"].dtype, float(st["step"])), (torch.float32, 3.0))
            stats = opt.client.stats()
            elements = sum(s["state_elements"] for s in stats)
            self.assertEqual(_size_sum(opt), elements + len(named))  # + the step tensors
            adafactor = sum(t.numel() * t.element_size() for s in opt.state.values()
                            for k, t in s.items() if k != "step")
            self.assertEqual(adafactor, sum(s["state_bytes"] for s in stats))
            # 10x7: 17, 7: 7, 2x7x3: 2*(7+3), (): 1
            self.assertEqual(elements, 17 + 7 + 20 + 1)
            sd = opt.state_dict()
            self.assertEqual(sorted(sd["state"]), [0, 1, 2, 3])
            self.assertEqual(sorted(sd["state"][0]), ["col_var", "row_var", "step"])

    def test_hf_state_names_and_get_lr(self):
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            opt = RemoteHFAdafactor(model.named_parameters(), beta1=0.9, shards=shards.addrs)
            stack.callback(opt.close)
            refs = {n: ReferenceAdafactor(p.shape, "hf", beta1=0.9) for n, p in init.items()}
            want = dict(init)
            for step in range(3):
                loss_step(model, opt, 0, step)
                for n, p in model.named_parameters():
                    want[n] = refs[n].step(want[n], p.grad.numpy())
            named = dict(model.named_parameters())
            for n, p in named.items():
                st = opt.state[p]
                if p.dim() >= 2:
                    self.assertEqual(sorted(st), ["RMS", "exp_avg", "exp_avg_sq_col",
                                                  "exp_avg_sq_row", "step"], n)
                    self.assertEqual(st["exp_avg_sq_row"].shape, p.shape[:-1], n)
                    self.assertEqual(st["exp_avg_sq_col"].shape, p.shape[:-2] + p.shape[-1:], n)
                    _state_close(self, st["exp_avg_sq_row"], refs[n].row, n)
                    _state_close(self, st["exp_avg_sq_col"], refs[n].col, n)
                else:
                    self.assertEqual(sorted(st), ["RMS", "exp_avg", "exp_avg_sq", "step"], n)
                    _state_close(self, st["exp_avg_sq"], refs[n].var, n)
                self.assertEqual(st["exp_avg"].shape, p.shape)
                scale = float(np.max(np.abs(refs[n].mom)))
                err = float(np.max(np.abs(st["exp_avg"].double().numpy() - refs[n].mom)))
                self.assertLessEqual(err, 1e-5 * scale, n + " exp_avg")
                self.assertEqual(st["step"], 3)
                self.assertAlmostEqual(float(st["RMS"]) / refs[n].rms, 1.0, delta=1e-6)
                # transformers' _get_lr: the lr of the last update.
                lr = RemoteHFAdafactor._get_lr(opt.param_groups[0], st)
                want_lr = min(1e-2, 1 / np.sqrt(3)) * max(1e-3, refs[n].rms)
                self.assertAlmostEqual(float(lr) / want_lr, 1.0, delta=1e-6)
            stats = opt.client.stats()
            self.assertEqual(_size_sum(opt), sum(s["state_elements"] for s in stats)
                             + len(named))  # + the RMS tensors


@need_server
class StateDictTest(unittest.TestCase):
    def test_mismatching_state_dict(self):
        with Shards(1) as shards, ExitStack() as stack:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            loss_step(model, opt, 0, 0)
            sd = opt.state_dict()
            bad = {k: v for k, v in sd.items()}
            bad["state"] = {k: dict(v) for k, v in sd["state"].items()}
            bad["state"][0]["row_var"] = torch.zeros(10, 2)
            other = RemoteAdafactor(Net().named_parameters(), shards=shards.addrs)
            stack.callback(other.close)
            with self.assertRaisesRegex(ValueError, r"tensor 'w1': state 'row_var' has shape "
                                        r"\[10, 2\], this parameter needs \[10, 1\]"):
                other.load_state_dict(bad)
            del bad["state"][0]["row_var"]
            with self.assertRaisesRegex(ValueError, r"tensor 'w1'.*missing \['row_var'\]"):
                other.load_state_dict(bad)
            hf = RemoteHFAdafactor(Net().named_parameters(), shards=shards.addrs)
            stack.callback(hf.close)
            with self.assertRaisesRegex(ValueError, "flavor 'torch', this optimizer is 'hf'"):
                hf.load_state_dict(sd)
            renamed = RemoteAdafactor(Net().named_parameters(), namespace="x/",
                                      shards=shards.addrs)
            stack.callback(renamed.close)
            with self.assertRaisesRegex(ValueError, "tensor names differ"):
                renamed.load_state_dict(sd)


class AdafactorScheduleLike(torch.optim.lr_scheduler.LambdaLR):
    """What transformers' AdafactorSchedule does (written out here: the
    machine has no transformers): a proxy that reports the optimizer's own
    relative-step learning rate through _get_lr(group, state)."""

    def __init__(self, optimizer, initial_lr=0.0):
        for group in optimizer.param_groups:
            group["initial_lr"] = initial_lr
        super().__init__(optimizer, lambda _: initial_lr)
        for group in optimizer.param_groups:
            del group["initial_lr"]

    def get_lr(self):
        opt = self.optimizer
        lrs = [opt._get_lr(group, opt.state[group["params"][0]]) for group in opt.param_groups
               if group["params"][0].grad is not None]
        return lrs or self.base_lrs


@need_server
class RelativeStepTest(unittest.TestCase):
    def test_adafactor_schedule_reads_the_shards_lr(self):
        """transformers' recipe: Adafactor(relative_step=True, warmup_init=True,
        lr=None) + AdafactorSchedule. The schedule writes lr=0.0 (and later its
        readings) into the groups; the shard ignores them, as transformers
        does, and the schedule reports the lr the shard applied."""
        with Shards(1, mode="sync", workers=1) as shards, ExitStack() as stack:
            p = torch.nn.Parameter(torch.from_numpy(W0.copy()))
            opt = RemoteHFAdafactor([("w", p)], scale_parameter=True, relative_step=True,
                                    warmup_init=True, lr=None, shards=shards.addrs)
            stack.callback(opt.close)
            sched = AdafactorScheduleLike(opt)
            self.assertEqual(opt.param_groups[0]["lr"], 0.0)
            ref = ReferenceAdafactor((12, 8), "hf", warmup_init=True)
            want = W0
            for step in range(8):
                g = np.array(np.random.default_rng(step).standard_normal((12, 8)), np.float32)
                p.grad = torch.from_numpy(g)
                if step == 4:
                    opt.param_groups[0]["lr"] = 123.0  # ignored in a relative-step group
                opt.step()
                sched.step()
                want = ref.step(want, g)
                rel = min(1e-6 * (step + 1), 1.0 / np.sqrt(step + 1))
                lr_t = rel * max(1e-3, ref.rms)
                got = float(sched.get_last_lr()[0])
                self.assertAlmostEqual(got / lr_t, 1.0, delta=1e-6, msg=f"step {step}")
                st = opt.state[p]
                self.assertEqual(st["step"], step + 1)
                err = float(np.max(np.abs(p.detach().numpy().astype(np.float64) - want)))
                self.assertLessEqual(err, PARAM_TOL * float(np.max(np.abs(want))), f"step {step}")


@need_server
class LocalChangeTest(unittest.TestCase):
    def test_local_change_in_a_two_worker_sync_job_is_an_error(self):
        with Shards(1, workers=2) as shards:
            res = run_threads(_change_worker, [(shards.addrs, w) for w in range(2)])
            self.assertEqual(res, ["changed locally"] * 2)

def _change_worker(addrs, worker):
    model = Net()
    opt = RemoteAdafactor(model.named_parameters(), shards=addrs, worker_id=worker,
                          num_workers=2, deadline=20)
    loss_step(model, opt, worker, 0)
    with torch.no_grad():
        model.w1.zero_()
    try:
        loss_step(model, opt, worker, 1)
    except RuntimeError as e:
        opt.close()
        return "changed locally" if "'w1'" in str(e) and "changed locally" in str(e) else str(e)
    opt.close()
    return "no error"


if __name__ == "__main__":
    unittest.main()

"""RemoteAdafactor: resume on new shards, and who owns the weights.

- A run saved with torch.save after 20 steps and resumed in a new process
  against new, empty shards ends, after 20 more steps, bit-for-bit where an
  uninterrupted run ends (same worker count, same data), both flavors.
- on_existing="overwrite" replaces what the shards hold (fresh state, this
  process's weights), "adopt" takes it.
- A parameter changed locally between steps (in place, new storage, or
  through .data) is written to the shards with the optimizer state kept:
  the run matches the reference Adafactor fed the changed values.
"""

import os
import tempfile
import unittest
from contextlib import ExitStack

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _torch_support import Net, loss_step
from _support import Shards, need_server, run_threads, run_workers
from factorps.reference import ReferenceAdafactor
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

STATE_TOL = 1e-4
PARAM_TOL = 1e-5
W0 = np.array(0.5 * np.random.default_rng(1234).standard_normal((12, 8)), np.float32)


def resume_worker(addrs, flavor, steps, save_path, load_path, workers=1, worker=0):
    """Trains `steps` steps (after loading `load_path` if given) and saves
    to `save_path` if given; returns the final params."""
    torch.set_num_threads(1)
    model = Net()
    cls = RemoteAdafactor if flavor == "torch" else RemoteHFAdafactor
    hp = dict(weight_decay=0.01) if flavor == "torch" else dict(
        lr=1e-3, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.01)
    opt = cls(model.named_parameters(), shards=addrs, worker_id=worker, num_workers=workers,
              deadline=30, **hp)
    lam = lambda s: min(1.0, (s + 1) / 30)  # noqa: E731 - a warmup across the resume point
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    start = 0
    if load_path:
        ck = torch.load(load_path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["step"]
    for step in range(start, start + steps):
        loss_step(model, opt, worker, step)
        sched.step()
    if save_path:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "step": start + steps}, save_path)
    out = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt.close()
    return out


@need_server
class ResumeTest(unittest.TestCase):
    def resume(self, flavor):
        with tempfile.TemporaryDirectory() as tmp:
            ck = os.path.join(tmp, "ck.pt")
            with Shards(2) as a:
                straight, = run_workers(resume_worker, [(a.addrs, flavor, 40, None, None)])
            with Shards(2) as b:
                run_workers(resume_worker, [(b.addrs, flavor, 20, ck, None)])
            saved = torch.load(ck)["opt"]
            self.assertEqual(saved["factorps"]["versions"], [20] * 4)
            self.assertEqual(len(saved["state"]), 4)
            with Shards(2) as c:  # new, empty shards
                resumed, = run_workers(resume_worker, [(c.addrs, flavor, 20, None, ck)])
        for n in straight:
            np.testing.assert_array_equal(resumed[n], straight[n], f"{flavor}: {n}")

    def test_resume_torch_on_new_shards(self):
        self.resume("torch")

    def test_resume_two_sync_workers_on_new_shards(self):
        # Worker 0 saves; both workers resume from that file (their weights
        # and the shards' state are the same in a sync job). Threads, not
        # processes: the one-worker cases above cover the new processes.
        def job(addrs, steps, save, load):
            return run_threads(resume_worker, [(addrs, "torch", steps, save if w == 0 else None,
                                                load, 2, w) for w in range(2)])
        with tempfile.TemporaryDirectory() as tmp:
            ck = os.path.join(tmp, "ck.pt")
            with Shards(2, workers=2) as a:
                straight = job(a.addrs, 40, None, None)
            with Shards(2, workers=2) as b:
                job(b.addrs, 20, ck, None)
            with Shards(2, workers=2) as c:
                resumed = job(c.addrs, 20, None, ck)
        for w in range(2):
            for n in straight[0]:
                np.testing.assert_array_equal(resumed[w][n], straight[0][n], f"worker {w}: {n}")

    def test_resume_hf_beta1_on_new_shards(self):
        self.resume("hf")

@need_server
class OwnershipTest(unittest.TestCase):
    def test_overwrite_and_adopt(self):
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            for step in range(3):
                loss_step(model, opt, 0, step)
            fresh = Net(seed=99)
            values = {n: p.detach().clone() for n, p in fresh.named_parameters()}
            over = RemoteAdafactor(fresh.named_parameters(), on_existing="overwrite",
                                   shards=shards.addrs)
            stack.callback(over.close)
            over.setup()
            self.assertEqual(set(over._versions.values()), {0})
            for n, p in fresh.named_parameters():
                torch.testing.assert_close(p.detach(), values[n], rtol=0, atol=0)
                self.assertEqual(float(over.state[p]["step"]), 0.0)
            third = Net(seed=5)
            adopt = RemoteAdafactor(third.named_parameters(), on_existing="adopt",
                                    shards=shards.addrs)
            stack.callback(adopt.close)
            adopt.setup()
            for n, p in third.named_parameters():
                torch.testing.assert_close(p.detach(), values[n], rtol=0, atol=0)

    def test_load_state_dict_rewinds_live_shards(self):
        import copy
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            for step in range(3):
                loss_step(model, opt, 0, step)
            saved = copy.deepcopy(opt.state_dict())
            weights = copy.deepcopy(model.state_dict())
            for step in range(3, 6):
                loss_step(model, opt, 0, step)
            model.load_state_dict(weights)
            opt.load_state_dict(saved)  # the default: the loaded state replaces the shards'
            opt.setup()
            self.assertEqual(set(opt._versions.values()), {3})
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), weights[n], rtol=0, atol=0)
            st = opt.state[model.w1]
            self.assertEqual(float(st["step"]), 3.0)
            torch.testing.assert_close(st["row_var"], saved["state"][0]["row_var"], rtol=0,
                                       atol=0)

    def test_local_change_is_written_with_the_state_kept(self):
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            refs = {n: ReferenceAdafactor(v.shape, "torch") for n, v in init.items()}
            want = dict(init)
            for step in range(6):
                if step == 2:
                    with torch.no_grad():
                        model.w1.mul_(0.5)              # in place: the version counter
                    want["w1"] = model.w1.detach().numpy().copy()
                if step == 3:
                    model.b1.data = torch.full((7,), 0.25)  # new storage
                    want["b1"] = model.b1.detach().numpy().copy()
                if step == 4:
                    model.s.data.fill_(2.0)             # through .data: the checksum
                    want["s"] = np.float32(2.0).reshape(())
                loss_step(model, opt, 0, step)
                for n, p in model.named_parameters():
                    want[n] = refs[n].step(want[n], p.grad.numpy())
            for n, p in model.named_parameters():
                scale = max(float(np.max(np.abs(want[n]))), 1e-3)
                err = float(np.max(np.abs(p.detach().double().numpy() - want[n])))
                self.assertLessEqual(err, PARAM_TOL * scale, n)
                self.assertEqual(opt._versions[n], 6, n)  # the state and step went on


if __name__ == "__main__":
    unittest.main()

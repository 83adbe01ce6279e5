"""Accelerate around RemoteAdafactor on real shards: the
usual loop (accelerator.prepare, accelerator.backward, optimizer.step(),
lr_scheduler.step(), optimizer.zero_grad(), then optimizer.state.values()),
with accelerator.save_state / load_state resume on new, empty shards and on
the same shards; a tiny GPT-2 from a config learns stdlib source bytes.
Then two workers under torchrun (accelerate_worker.py) on sync shards,
resumed on new ones.
Needs accelerate and transformers (the PyTorch 2 test venv); Debian's
python3 has neither and skips (tests/allowed-skips.txt)."""

import gc
import logging
import os
import tempfile
import unittest
from contextlib import ExitStack

import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, TorchrunJob, need_server
from _lm_support import Windows, text, tiny_gpt2
from factorps.errors import AlreadyExistsError
from factorps.torch import RemoteAdafactor

try:
    import accelerate
    import transformers  # noqa: F401  (the model)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
except ImportError:
    accelerate = None

STEPS, CUT = 6, 3


def _job(shards, seed=0):
    """The material's setup: model, optimizer, loader, schedule, prepared."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2(seed)
    opt = RemoteAdafactor(model.named_parameters(), lr=0.1, weight_decay=0.01, shards=shards)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    loader = torch.utils.data.DataLoader(Windows(text(), 4 * STEPS), batch_size=4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    return accelerator, model, opt, loader, sched


def _train(accelerator, model, opt, loader, sched, steps):
    for _, batch in zip(range(steps), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


@need_server
@unittest.skipUnless(accelerate is not None, "accelerate / transformers are not installed")
class AccelerateTest(unittest.TestCase):
    def setUp(self):
        logging.getLogger("factorps.torch").setLevel(logging.ERROR)

    def test_loop_state_save_and_load_state(self):
        with ExitStack() as stack:
            ckpt = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-acc-"))
            shards = stack.enter_context(Shards(2))
            acc, model, opt, loader, sched = _job(shards.addrs)
            stack.callback(opt.optimizer.close)
            probe = next(iter(loader))
            with torch.no_grad():
                start = float(model(**probe).loss)
            _train(acc, model, opt, loader, sched, CUT)
            acc.save_state(ckpt)
            it = iter(loader)
            for _ in range(CUT):
                next(it)
            _train(acc, model, opt, it, sched, STEPS - CUT)
            with torch.no_grad():
                self.assertLess(float(model(**probe).loss), start - 0.05)  # it learns
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
            lr = sched.get_last_lr()
            # optimizer.state through the wrapper: the factored sizes.
            params = dict(model.named_parameters())
            sizes = sum(t.numel() for s in opt.state.values() for t in s.values()
                        if torch.is_tensor(t))
            want = sum((p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()) + 1
                       for p in params.values())  # + the step scalar
            self.assertEqual(sizes, want)
            self.assertLess(sizes * 5, 2 * sum(p.numel() for p in params.values()))

            # The same job again on these shards, without load_state: prepare()
            # loads the optimizer's empty state, which must not overwrite.
            acc2, m2, o2, l2, s2 = _job(shards.addrs)
            stack.callback(o2.optimizer.close)
            with self.assertRaises(AlreadyExistsError):
                _train(acc2, m2, o2, l2, s2, 1)

            # load_state on new, empty shards and on the same shards (which
            # hold step STEPS: the saved state replaces it); training then
            # continues exactly where the saved run did.
            fresh = stack.enter_context(Shards(2))
            for addrs in (fresh.addrs, shards.addrs):
                acc3, m3, o3, l3, s3 = _job(addrs, seed=1)
                stack.callback(o3.optimizer.close)
                acc3.load_state(ckpt)
                _train(acc3, m3, o3, acc3.skip_first_batches(l3, CUT), s3, STEPS - CUT)
                for n, p in m3.named_parameters():
                    self.assertTrue(torch.equal(p.detach(), final[n]), n)
                self.assertEqual(s3.get_last_lr(), lr)
                self.assertEqual(set(o3.optimizer._versions.values()), {STEPS})


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_worker.py")
_CLEANUP = ExitStack()
_JOB = {}  # TwoProcessTest's torchrun job and its directory (setUpModule)


def setUpModule():
    # TwoProcessTest's torchrun job (accelerate_worker.py in 2 processes)
    # starts first and runs while AccelerateTest runs in this process (each
    # is mostly imports and start-up).
    if accelerate is None or not (_support.SERVER and os.access(_support.SERVER, os.X_OK)):
        return
    # The Trainer / Accelerate call gc.collect() at every run (free_memory):
    # leave the modules' objects out of every collection (0.17 s of CPU each
    # with transformers loaded, nothing frozen).
    gc.freeze()
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-acc2-"))
        ckpt = os.path.join(tmp, "ckpt")
        shards = stack.enter_context(Shards(2, workers=2, deadline=30))
        fresh = stack.enter_context(Shards(2, workers=2, deadline=30))
        job = TorchrunJob(WORKER, [",".join(shards.addrs), ",".join(fresh.addrs), tmp, ckpt])
        stack.callback(job.kill)
        _CLEANUP.enter_context(stack.pop_all())
    _JOB.update(job=job, tmp=tmp)


def tearDownModule():
    _CLEANUP.close()


@need_server
@unittest.skipUnless(accelerate is not None, "accelerate / transformers are not installed")
class TwoProcessTest(unittest.TestCase):
    def test_torchrun_two_workers_save_and_load_state(self):
        rc, log = _JOB["job"].wait(240)
        self.assertEqual(rc, 0, log)
        tmp = _JOB["tmp"]
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
        runs = {k: [r[k] for r in ranks] for k in ("train", "resume")}
        train, resume = runs["train"], runs["resume"]
        for r in train + resume:
            self.assertEqual(r["workers"], 2)
            self.assertEqual(set(r["versions"].values()), {6})
            self.assertEqual(r["sizes"], 7 + 10 + 7 + 2 * 7 + 2 * 3 + 1 + 4)
        # Both workers hold the shards' weights; the resumed run on new,
        # empty shards ends exactly where the uninterrupted one did.
        for n, p in train[0]["params"].items():
            for r in (train[1], resume[0], resume[1]):
                self.assertTrue(torch.equal(r["params"][n], p), n)
        self.assertEqual(resume[0]["lr"], train[0]["lr"])


if __name__ == "__main__":
    unittest.main()

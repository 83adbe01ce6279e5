"""The Hugging Face Trainer with its Adafactor on real shards:
a tiny GPT-2 built from a config (random weights, no download)
learns bytes of Python's own standard library sources. Training, evaluation,
save_steps checkpoints, resume_from_checkpoint on the same shards and on
new empty ones, optimizer.state beside AdamW's sizes, names stable whatever
the grouping. Needs transformers (the PyTorch 2 test venv); Debian's
python3 has none and skips (tests/allowed-skips.txt)."""

import gc
import glob
import logging
import os
import tempfile
import unittest
from contextlib import ExitStack

import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, TorchrunJob, need_server
from _lm_support import WINDOW, Windows, text, tiny_gpt2

try:
    import transformers
    from transformers import Trainer, TrainingArguments
except ImportError:
    transformers = None

if transformers is not None:
    from factorps.hf import trainer_optimizer
    from factorps.errors import AlreadyExistsError

STEPS, SAVE = 6, 3


def _trainer(out, shards, train_args=(), **options):
    data = text()
    model = tiny_gpt2()
    args = TrainingArguments(**dict(dict(
        output_dir=out, optim="adafactor", learning_rate=1e-2, weight_decay=0.01,
        per_device_train_batch_size=4, per_device_eval_batch_size=8, max_steps=STEPS,
        save_steps=SAVE, eval_strategy="steps", eval_steps=SAVE, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=False), **dict(train_args)))
    trainer = Trainer(model=model, args=args,
                      train_dataset=Windows(data, 64, 0),
                      eval_dataset=Windows(data, 16, 64 * WINDOW),
                      optimizer_cls_and_kwargs=trainer_optimizer(args, model, shards=shards,
                                                                         **options))
    trainer.remove_callback(transformers.PrinterCallback)  # quiet logs
    return trainer


def _close(trainer):
    opt = trainer.optimizer
    if opt is not None:
        getattr(opt, "optimizer", opt).close()


def _values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@need_server
@unittest.skipUnless(transformers is not None, "transformers is not installed")
class TrainerTest(unittest.TestCase):
    def setUp(self):
        transformers.logging.set_verbosity_error()
        logging.getLogger("factorps.torch").setLevel(logging.ERROR)

    def test_train_eval_save_resume(self):
        with ExitStack() as stack:
            out = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-trainer-"))
            shards = stack.enter_context(Shards(2))
            # One run of STEPS steps, a checkpoint every SAVE steps.
            a = _trainer(out, shards.addrs)
            stack.callback(_close, a)
            res = a.train()
            self.assertEqual(res.global_step, STEPS)
            evals = [h["eval_loss"] for h in a.state.log_history if "eval_loss" in h]
            self.assertEqual(len(evals), STEPS // SAVE)
            losses = [h["loss"] for h in a.state.log_history if "loss" in h]
            self.assertLess(losses[-1], losses[0])  # it learns
            self.assertTrue(all(torch.isfinite(torch.tensor(evals))))
            final = _values(a.model)
            opt = a.optimizer.optimizer
            # Names are the model's, whatever the Trainer's weight-decay groups.
            names = dict(a.model.named_parameters())
            self.assertEqual(len(opt.param_groups), 2)
            self.assertEqual(sorted(opt.param_names()), sorted(names))
            self.assertEqual(sum(s["tensors"] for s in opt.client.stats()), len(names))
            self.assertEqual({g["weight_decay"] for g in opt.param_groups}, {0.01, 0.0})
            # optimizer.state beside AdamW's: the factored sizes.
            adafactor = sum(t.numel() for s in a.optimizer.state.values()
                            for t in s.values() if torch.is_tensor(t))
            adamw = 2 * sum(p.numel() for p in names.values())
            want = sum((p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()) + 1
                       for p in names.values())  # + the RMS scalar
            self.assertEqual(adafactor, want)
            self.assertLess(adafactor * 5, adamw)
            ckpt = os.path.join(out, f"checkpoint-{SAVE}")
            self.assertTrue(os.path.isfile(os.path.join(ckpt, "optimizer.pt")),
                            sorted(glob.glob(out + "/*")))

            # The same job started again on the same shards without a resume:
            # the shards' tensors are not silently replaced.
            again = _trainer(tempfile.mkdtemp(dir=out), shards.addrs)
            stack.callback(_close, again)
            with self.assertRaises(AlreadyExistsError):
                again.train()

            # Resumed from the step-3 checkpoint on new, empty shards, and on
            # the same shards (which hold step 6: the checkpoint replaces it).
            fresh = stack.enter_context(Shards(2))
            for addrs in (fresh.addrs, shards.addrs):
                b = _trainer(out, addrs)
                stack.callback(_close, b)
                res = b.train(resume_from_checkpoint=ckpt)
                self.assertEqual(res.global_step, STEPS)
                for n, p in b.model.named_parameters():  # exactly the uninterrupted run
                    self.assertTrue(torch.equal(p.detach(), final[n]), n)
                self.assertEqual(set(b.optimizer.optimizer._versions.values()), {STEPS})
                self.assertEqual(b.evaluate()["eval_loss"], a.evaluate()["eval_loss"])

    def test_attach_with_gradient_accumulation(self):
        """One process, gradient_accumulation_steps=2: the Trainer runs the
        first micro-batch's backward in accelerator.no_sync(), which without
        DDP holds nothing back; attach() makes it hold the hooks' pushes, so
        the summed gradient leaves once. The weights equal a run without
        attach() bit for bit (same gradients, same shards' update)."""
        from factorps.hf import attach
        final = []
        for attached in (False, True):
            with ExitStack() as stack:
                out = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-trainer-ga-"))
                shards = stack.enter_context(Shards(1))
                t = _trainer(out, shards.addrs, train_args=dict(
                    gradient_accumulation_steps=2, max_grad_norm=0, save_strategy="no",
                    eval_strategy="no"))
                stack.callback(_close, t)
                if attached:
                    attach(t)
                self.assertEqual(t.train().global_step, STEPS)
                self.assertEqual(set(t.optimizer.optimizer._versions.values()), {STEPS})
                final.append(_values(t.model))
        for n, p in final[0].items():
            self.assertTrue(torch.equal(final[1][n], p), n)


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_worker.py")
_CLEANUP = ExitStack()
_JOB = {}  # TwoWorkerTest's torchrun job and its directory (setUpModule)


def setUpModule():
    # TwoWorkerTest's torchrun job starts first and runs while TrainerTest
    # runs in this process (each is mostly imports and start-up).
    if transformers is None or not (_support.SERVER and os.access(_support.SERVER, os.X_OK)):
        return
    # The Trainer / Accelerate call gc.collect() at every run (free_memory):
    # leave the modules' objects out of every collection (0.17 s of CPU each
    # with transformers loaded, nothing frozen).
    gc.freeze()
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-trainer2-"))
        shards = stack.enter_context(Shards(2, workers=2, deadline=30))
        fresh = stack.enter_context(Shards(2, workers=2, deadline=30))
        job = TorchrunJob(WORKER, [",".join(shards.addrs), ",".join(fresh.addrs), tmp])
        stack.callback(job.kill)
        _CLEANUP.enter_context(stack.pop_all())
    _JOB.update(job=job, tmp=tmp)


def tearDownModule():
    _CLEANUP.close()


@need_server
@unittest.skipUnless(transformers is not None, "transformers is not installed")
class TwoWorkerTest(unittest.TestCase):
    def test_torchrun_ddp_hook_checkpoint_resume(self):
        rc, log = _JOB["job"].wait(300)
        self.assertEqual(rc, 0, log)
        tmp = _JOB["tmp"]
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
        for r in ranks:
            for run in ("train", "resume"):
                self.assertEqual(r[run]["ddp"], "DistributedDataParallel")
                self.assertEqual(r[run]["workers"], 2)
                self.assertEqual(set(r[run]["versions"].values()), {4})
        # Both workers end with the shards' weights; resumed on new, empty
        # shards from the step-2 checkpoint, training ends exactly there too.
        want = ranks[0]["train"]["params"]
        for n, t in want.items():
            for got in (ranks[1]["train"], ranks[0]["resume"], ranks[1]["resume"]):
                self.assertTrue(torch.equal(got["params"][n], t), n)
        self.assertEqual(ranks[0]["resume"]["eval_loss"], ranks[0]["train"]["eval_loss"])


if __name__ == "__main__":
    unittest.main()

"""One process of a torchrun-launched Hugging Face Trainer job
(test_torch_trainer):

    python -m torch.distributed.run --nproc_per_node 2 trainer_worker.py \
        SHARDS FRESH_SHARDS OUT

The Trainer wraps the tiny GPT-2 in DistributedDataParallel;
factorps.hf.attach() puts factorps' DDP hook in place of its all-reduce.
Trains STEPS steps on SHARDS with a checkpoint every SAVE steps, then a new
Trainer resumes from the first checkpoint on FRESH_SHARDS (new, empty; in
the same processes: a second torchrun would double the test's time). Each
rank writes both runs' final parameters and evaluation losses to
OUT/rank<r>.pt.
"""

import gc
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _support  # noqa: E402,F401  (puts client/python on sys.path)
import transformers  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from _lm_support import WINDOW, Windows, text, tiny_gpt2  # noqa: E402
from factorps.hf import attach, trainer_optimizer  # noqa: E402

STEPS, SAVE = 4, 2


def run(shards, out, resume):
    data = text()
    model = tiny_gpt2(0 if resume is None else 7)
    args = TrainingArguments(
        output_dir=out, optim="adafactor", learning_rate=1e-2, weight_decay=0.01,
        max_grad_norm=0, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        max_steps=STEPS, save_steps=SAVE, eval_strategy="steps", eval_steps=SAVE,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(data, 64, 0),
                      eval_dataset=Windows(data, 16, 64 * WINDOW),
                      optimizer_cls_and_kwargs=trainer_optimizer(args, model, shards=shards,
                                                                 mode="sync"))
    trainer.remove_callback(transformers.PrinterCallback)
    attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.optimizer
    result = {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
              "versions": dict(opt._versions), "workers": opt.num_workers,
              "eval_loss": trainer.evaluate()["eval_loss"],
              "ddp": type(trainer.model_wrapped).__name__}
    opt.close()
    return result


def main():
    gc.freeze()  # the Trainer's gc.collect() at every run skips the imported modules
    transformers.logging.set_verbosity_error()
    logging.getLogger("factorps.torch").setLevel(logging.ERROR)
    shards, fresh, out = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
    ckpts = os.path.join(out, "ckpts")
    result = {"train": run(shards, ckpts, None)}
    result["resume"] = run(fresh, ckpts, os.path.join(ckpts, f"checkpoint-{SAVE}"))
    rank = torch.distributed.get_rank()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()

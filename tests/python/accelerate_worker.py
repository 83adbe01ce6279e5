"""One process of a torchrun-launched Accelerate job (test_torch_accelerate):

    python -m torch.distributed.run --nproc_per_node 2 accelerate_worker.py \
        SHARDS FRESH_SHARDS OUT CKPT

Trains STEPS steps on SHARDS with accelerator.save_state(CKPT) after CUT of
them; then a new model and optimizer on FRESH_SHARDS (new, empty) load
CKPT with accelerator.load_state() and run the remaining steps (in the same
processes: starting torchrun twice would double the test's time). Each
rank writes both runs' final parameters to OUT/rank<r>.pt. The model is _torch_support's Net
(no transformers import: torchrun starts one interpreter per worker).
"""

import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _support  # noqa: E402,F401  (puts client/python on sys.path)
from _torch_support import Net  # noqa: E402
from accelerate import Accelerator, DistributedDataParallelKwargs  # noqa: E402
from factorps.torch import RemoteAdafactor  # noqa: E402

STEPS, CUT = 6, 3


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 16 * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(10, generator=g), torch.randn(3, generator=g)


def run(accelerator, shards, seed, ckpt, resume):
    """The usual loop: prepare, backward, step, schedule, zero_grad. Fresh:
    STEPS steps with save_state(ckpt) after CUT; resume: load_state(ckpt)
    and the steps after CUT."""
    model = Net(seed=seed)
    opt = RemoteAdafactor(model.named_parameters(), lr=0.05, weight_decay=0.01, shards=shards,
                          mode="sync", deadline=30)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    loader = torch.utils.data.DataLoader(Batches(), batch_size=8)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    attach = getattr(sys.modules["factorps.torch"], "attach", None)
    if attach is not None:  # gradients go to the shards instead of DDP's all-reduce
        attach(model, opt)  # what prepare() returned: attach takes its factorps optimizer
    first = 0
    if resume:
        accelerator.load_state(ckpt)
        loader = accelerator.skip_first_batches(loader, CUT)
        first = CUT
    for step, (x, y) in zip(range(first, STEPS), loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if not resume and step == CUT - 1:
            accelerator.save_state(ckpt)
    sizes = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    out = {"params": {n: p.detach().clone() for n, p in
                      accelerator.unwrap_model(model).named_parameters()},
           "versions": dict(opt.optimizer._versions), "sizes": sizes,
           "lr": sched.get_last_lr(), "workers": opt.optimizer.num_workers}
    opt.optimizer.close()
    accelerator.free_memory()  # forget the prepared objects: the next run prepares its own
    return out


def main():
    gc.freeze()  # accelerator.free_memory()'s gc.collect() skips the imported modules
    shards, fresh, out, ckpt = (sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3],
                                sys.argv[4])
    # DDP with .grad as views of its buckets (docs/pytorch.md: no copies
    # into the buckets and back with factorps' hook).
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    result = {"train": run(accelerator, shards, 1234, ckpt, False),
              "resume": run(accelerator, fresh, 99, ckpt, True)}
    torch.save(result, os.path.join(out, f"rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()

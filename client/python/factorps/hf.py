"""factorps.hf: the Hugging Face Trainer with its Adafactor on factorps shards.

    from transformers import Trainer, TrainingArguments
    from factorps.hf import trainer_optimizer

    args = TrainingArguments("out", optim="adafactor", learning_rate=1e-3, ...)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held_out,
                      optimizer_cls_and_kwargs=trainer_optimizer(args, model, shards=[...]))
    trainer.train()            # or trainer.train(resume_from_checkpoint=True)

transformers has no registry of `optim=` names; `optimizer_cls_and_kwargs`
is the Trainer's hook for an optimizer class of one's own (its
create_optimizer() builds it from the Trainer's weight-decay groups).
`trainer_optimizer()` fills it with what `optim="adafactor"` selects
(transformers' Adafactor with the Trainer's learning rate,
scale_parameter=False, relative_step=False; the Trainer's lr schedule and
weight-decay groups apply) as `RemoteHFAdafactor`, with the tensors named
after `model.named_parameters()` whatever the grouping.

Several workers (torchrun): the Trainer wraps the model in
DistributedDataParallel, whose all-reduce must give way to factorps' DDP hook:
`attach(trainer)` attaches it when training begins (factorps.torch.attach on
the wrapped model). The hook sends the gradients as backward makes them, so
the Trainer's gradient clipping must be off (`max_grad_norm=0`). Gradient
accumulation works as without attach: the Trainer's no_sync() holds the
pushes of the earlier micro-batches back, with DDP or without.

Checkpoints (`save_steps`) hold `optimizer.state_dict()`, that is the
shards' state; `resume_from_checkpoint` loads it, onto the same shards (it
replaces what they hold) or onto new, empty ones (it creates the tensors
with it), and training continues from the checkpoint's step.
"""

import contextlib
import math
from typing import Any, Dict, Iterator, Tuple

from .torch import RemoteHFAdafactor

__all__ = ["trainer_optimizer", "attach"]


def trainer_optimizer(args: Any, model: Any, **options: Any) -> Tuple[type, Dict[str, Any]]:
    """(RemoteHFAdafactor, kwargs) for `Trainer(optimizer_cls_and_kwargs=...)`:
    the optimizer `args.optim` ("adafactor") selects, on the shards.

    args: the TrainingArguments (optim="adafactor"; any other optim is a
        ValueError: the shards run Adafactor only).
    model: the model the Trainer trains (names the tensors).
    options: RemoteHFAdafactor's factorps options (shards=, namespace=,
        on_existing=, mode=, ...) and any of its hyperparameters to set
        instead of transformers' choice (e.g. beta1=0.9).
    """
    from transformers import Trainer

    optim = getattr(args.optim, "value", args.optim)
    if optim != "adafactor":
        raise ValueError(f"TrainingArguments(optim={optim!r}): factorps runs Adafactor; use "
                         "optim='adafactor' (transformers' Adafactor, on the shards)")
    _restore_cpu_n()
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs = dict(kwargs, names_from=model)
    kwargs.update(options)
    return RemoteHFAdafactor, kwargs


_cpu_n_registered = False


def _restore_cpu_n() -> None:
    """Lets torch.load restore storages saved at "cpu:N". transformers 4.57
    resumes a multi-process CPU job by loading optimizer.pt with
    map_location=args.device, torch.device("cpu", rank), and torch.load
    knows only "cpu": the resume would fail (for any optimizer with tensor
    state). A CPU storage stays where it is; other locations are left to
    torch (None)."""
    global _cpu_n_registered
    if _cpu_n_registered:
        return
    import torch

    def restore(storage: Any, location: str) -> Any:
        return storage if location.startswith("cpu:") else None

    torch.serialization.register_package(5, lambda obj: None, restore)
    _cpu_n_registered = True


def attach(trainer: Any, **options: Any) -> None:
    """Makes `trainer` push its gradients during backward: when training
    begins (after the Trainer wrapped the model in DDP under torchrun),
    factorps.torch.attach(trainer.model_wrapped, the optimizer, **options)
    registers DDP's communication hook, or without DDP per-parameter hooks.
    Needs TrainingArguments(max_grad_norm=0): a gradient clipped after
    backward would not be the one already sent (ValueError otherwise)."""
    from transformers import TrainerCallback

    from .torch import _RemoteAdafactorBase, attach as attach_model

    if trainer.args.max_grad_norm:
        raise ValueError(f"TrainingArguments(max_grad_norm={trainer.args.max_grad_norm}): "
                         "gradients leave for the shards during backward, so the Trainer "
                         "cannot clip them afterwards; pass max_grad_norm=0")

    class _Attach(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            if not isinstance(opt, _RemoteAdafactorBase):
                raise TypeError("factorps.hf.attach(): the Trainer's optimizer is "
                                f"{type(opt).__name__}, not a factorps one (trainer_optimizer)")
            if opt._overlap is None:
                # fp16: the Trainer's GradScaler drives step() (see
                # factorps.torch.attach's grad_scaler).
                kw = dict(options)
                kw.setdefault("grad_scaler", getattr(trainer.accelerator, "scaler", None))
                handle = attach_model(trainer.model_wrapped, opt, **kw)
                _accumulate_through(trainer.accelerator, handle)
                _measure_without_writing(trainer.accelerator)

    trainer.add_callback(_Attach())


def _accumulate_through(accelerator: Any, handle: Any) -> None:
    """With gradient_accumulation_steps > 1 the Trainer runs the earlier
    micro-batches' backward inside `accelerator.no_sync(model)`, which
    holds DDP's all-reduce back but, without DDP (one process), does
    nothing: attach()'s per-parameter hooks would push each micro-batch.
    The accelerator's no_sync now also enters the no_sync() of the handle
    attached last, so the summed gradient leaves once, with the last
    micro-batch."""
    accelerator._factorps_handle = handle
    if getattr(accelerator, "_factorps_no_sync", False):
        return
    no_sync = accelerator.no_sync

    @contextlib.contextmanager
    def no_sync_too(model: Any) -> Iterator[None]:
        with no_sync(model), accelerator._factorps_handle.no_sync():
            yield

    accelerator.no_sync = no_sync_too
    accelerator._factorps_no_sync = True


def _measure_without_writing(accelerator: Any) -> None:
    """transformers 5 logs every step's gradient norm through
    `accelerator.clip_grad_norm_(parameters, inf)` even with
    max_grad_norm=0. That multiplies each gradient by 1.0 in place (and
    unscales them under a GradScaler): the values stay, but the write moves
    each gradient's version, and attach() takes that for a gradient changed
    after backward sent it. With an infinite max_norm nothing is clipped,
    so this accelerator measures the norm without writing (a GradScaler's
    scale divided out, as its unscale_ would); a finite max_norm still
    clips, which attach() refuses at step()."""
    import torch

    if getattr(accelerator, "_factorps_measures", False):
        return
    clip = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if not (isinstance(max_norm, (int, float)) and math.isinf(max_norm) and max_norm > 0):
            return clip(parameters, max_norm, norm_type)
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        with torch.no_grad():
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads]),
                norm_type)
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            norm = norm / scaler.get_scale()
        return norm

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator._factorps_measures = True

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
the Trainer's gradient clipping must be off (`max_grad_norm=0`).

Checkpoints (`save_steps`) hold `optimizer.state_dict()`, that is the
shards' state; `resume_from_checkpoint` loads it, onto the same shards (it
replaces what they hold) or onto new, empty ones (it creates the tensors
with it), and training continues from the checkpoint's step.
"""

from typing import Any, Dict, Tuple

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
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs = dict(kwargs, names_from=model)
    kwargs.update(options)
    return RemoteHFAdafactor, kwargs


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
                attach_model(trainer.model_wrapped, opt, **kw)

    trainer.add_callback(_Attach())

"""factorps.torch: torch.optim optimizers whose Adafactor runs on factorps shards.

    from factorps.torch import RemoteAdafactor
    opt = RemoteAdafactor(model.named_parameters(), lr=1e-2)   # torch.optim.Adafactor's arguments
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step(); sched.step(); opt.zero_grad()

`RemoteAdafactor` takes torch.optim.Adafactor's arguments (PyTorch >= 2.5),
`RemoteHFAdafactor` transformers' Adafactor's, both with the same
keyword-only factorps options (see `_RemoteAdafactorBase`). What is the same
as the local optimizer and what is not:

- Ownership: the shards hold the master weights and the optimizer state once
  the first step() (or setup()) has created the tensors. Every step() pushes
  the gradients and writes the shards' fresh values into the parameters in
  place. At the first step worker 0's values initialise the tensors and the
  other workers wait for them and start from them. If the shards already hold
  a tensor of that name (another job, an earlier run), `on_existing` decides:
  "error" (the default, unless a state dict was loaded), "adopt" (continue
  from the shards' weights and state), "overwrite" (replace them by this
  process's weights and a fresh state, or by the loaded state dict's). Only
  a loaded state that has been stepped counts: loading a state dict whose
  every step is 0 (what accelerate.prepare() and the Trainer do with the
  optimizer's own state_dict()) keeps the "error" default.
  `namespace` is prefixed to every tensor name so that jobs can share shards.
- Names: (name, parameter) pairs name the tensors, or `names_from=model`
  for bare tensors, else group/position ("g0.p1"). torch.compile's
  "_orig_mod." and DDP's leading "module." (and FSDP's and checkpoint
  wrappers') are dropped, so a job resumed with or without them finds the
  same tensors.
- Parameters with requires_grad=False never travel: they are not created on
  the shards, pushed or pulled (a parameter unfrozen later is created at the
  next step, from its local value).
- A parameter changed locally between steps (a reloaded layer, a
  re-initialisation: seen by its version counter, storage and checksum) is
  written to the shards before the next push, with the shard's optimizer
  state kept (worker 0; in a multi-worker sync job, or on another worker, it
  is an error instead, because the other workers' copies would not follow).
- Per step, each param group's current `lr` and `weight_decay` travel with the
  push, so every torch.optim.lr_scheduler (and any code that writes
  `param_groups[i]["lr"]`) works; hf groups with relative_step=True ignore
  `lr` (the shard's relative step applies), as transformers does. The other
  hyperparameters are fixed when the tensors are created: changing one later
  is a ValueError that says which.
- A parameter whose .grad is None is not updated and not decayed (as torch);
  in a sync job the workers must agree on which parameters have gradients.
- Non-finite gradients skip the step (AMP's rule): under a GradScaler
  (`scaler.step(opt)` always reaches step(), which unscales and reads the
  scaler's found_inf) or, without one, when any gradient holds a NaN or an
  Inf (a warning names the tensor). The push says skip_step: in a sync job
  the round then applies nothing for any worker, so all of them skip that
  step together. Nothing is applied, the versions stay; `last_step_skipped`
  and `skipped_steps` say so on every worker.
- `optimizer.state[p]` is the shard's state under the upstream names and
  shapes (torch: step, row_var [..., R, 1] and col_var [..., 1, C], or
  variance; hf: step, RMS, exp_avg_sq_row / exp_avg_sq_col or exp_avg_sq,
  exp_avg with beta1), read from the shards when first accessed after a
  step (`state[p]` reads p's tensor only): a read-only snapshot. Every
  travelling parameter has an entry (zeros at step 0 before its first
  update, also before the first step: torch.distributed.checkpoint loads
  into them), so the sizes add up to the shards' Stats.
- state_dict() / load_state_dict() carry that state (and, under "factorps",
  names, shapes and versions); resuming against new, empty shards creates the
  tensors with the loaded state and step, and continues exactly. So does
  torch.distributed.checkpoint's get_state_dict() / set_state_dict(), which
  never steps this optimizer on fake gradients (its state is never empty).
  load_state_dict() hooks run as in torch (pre hooks before the checks).
- Recovery: when a shard restarts from its checkpoint, or a push fails in the
  middle (UNAVAILABLE, a stale or ahead step, a split tensor's blocks left at
  different versions, which the shards then agree on), step() pulls what the shards
  hold, redoes the push of what was not applied, and logs once (logger
  "factorps.torch") how many updates were lost; it gives up with the error
  after `recovery_timeout` seconds. A shard that restarted empty (no
  checkpoint) raises NotFoundError. In a multi-worker sync job a restore can
  leave the workers pairing their pushes one step apart (only a worker that
  got the last round's reply before the kill knows it completed); a worker
  whose round partner then never comes drops that one update after the round
  deadline.
- `foreach` is accepted and ignored (the shards run their own kernels).
- Overlap and DDP: `attach(model, opt)` (before the first forward) makes
  backward push the gradients in buckets as they are ready, so step() only
  waits for the replies; under DistributedDataParallel it is the comm hook
  that replaces DDP's all-reduce. Without it, a DDP-wrapped model fails at
  the first step() (DDP's all-reduce plus the push would move every
  gradient twice, or apply the average once per worker). See
  factorps.overlap.
"""

import inspect
import logging
import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.optim import Optimizer

from .client import Client, TensorSpec, state_sizes
from .overlap import Overlap, _WeakIdSet, check_ddp
from .errors import (AbortedError, AlreadyExistsError, DataLossError, DeadlineExceededError, Error,
                     FailedPreconditionError, NotFoundError, UnavailableError)

__all__ = ["RemoteAdafactor", "RemoteHFAdafactor", "attach"]

ParamsT = Union[Iterable[Tensor], Iterable[Tuple[str, Tensor]], Iterable[Dict[str, Any]]]

log = logging.getLogger("factorps.torch")

ON_EXISTING = ("error", "adopt", "overwrite")

# torch 1.13's zero_grad() zeroes in place by default, 2.x sets to None.
_ZERO_GRAD_SET_TO_NONE = inspect.signature(Optimizer.zero_grad).parameters[
    "set_to_none"].default

# Group keys that are not hyperparameters (ours, and what schedulers add).
_TORCH_FIXED = ("beta2_decay", "eps", "d", "maximize")
_HF_FIXED = ("eps", "clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step",
             "warmup_init")


def _num(x: Any) -> Any:
    return float(x.item()) if isinstance(x, Tensor) else x


def _split_named(params: List[Any]) -> Tuple[List[Any], Optional[List[str]]]:
    """(tensors, names or None) from a list of tensors or of (name, tensor) pairs."""
    if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                      for p in params):
        return [p for _, p in params], [n for n, _ in params]
    return params, None


# Module wrappers that put a component into parameter names without being
# part of the model: torch.compile's OptimizedModule, FSDP's and activation
# checkpointing's wrappers (anywhere in a name), DDP's "module." (leading).
_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _normalize_name(name: str) -> str:
    """`name` without the components wrappers add, so that a job resumed with
    or without torch.compile or DDP finds the same tensors on the shards
    ("module._orig_mod.fc.weight" -> "fc.weight")."""
    parts = [c for c in name.split(".") if c not in _WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def _name_map(names_from: Any) -> Dict[int, str]:
    """id(param) -> name from `names_from`: a torch.nn.Module (its
    named_parameters()), a {name: param} mapping or (name, param) pairs.
    Gives parameters passed as bare tensors (e.g. the Trainer's weight-decay
    groups) their model names instead of group/position names."""
    if names_from is None:
        return {}
    if isinstance(names_from, torch.nn.Module):
        pairs = list(names_from.named_parameters())
    elif isinstance(names_from, Mapping):
        pairs = list(names_from.items())
    else:
        pairs = list(names_from)
    out: Dict[int, str] = {}
    for n, p in pairs:
        if not (isinstance(n, str) and isinstance(p, Tensor)):
            raise TypeError("names_from must be a Module, a {name: parameter} mapping or "
                            f"(name, parameter) pairs, got an item ({type(n).__name__}, "
                            f"{type(p).__name__})")
        out.setdefault(id(p), n)
    return out


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _launcher(worker_id: Optional[int], num_workers: Optional[int]) -> Tuple[int, int, str]:
    """Worker id and count: the arguments, else torch.distributed's rank and
    world size when it is initialised, else RANK / WORLD_SIZE, else 0 / 1."""
    src = "arguments"
    if worker_id is None or num_workers is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank, world, src = dist.get_rank(), dist.get_world_size(), "torch.distributed"
        elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            src = f"RANK={os.environ.get('RANK', '')!s} WORLD_SIZE={os.environ.get('WORLD_SIZE', '')}"
        else:
            rank, world, src = 0, 1, "defaults"
        worker_id = rank if worker_id is None else worker_id
        num_workers = world if num_workers is None else num_workers
    worker_id, num_workers = int(worker_id), int(num_workers)
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id must be in [0, num_workers), got worker_id={worker_id} "
                         f"num_workers={num_workers} (from {src})")
    return worker_id, num_workers, src


def _fingerprint(p: Tensor) -> Tuple[int, int, float]:
    """What tells a local change of `p` between steps: its version counter
    (in-place ops), its storage (`p.data = ...`) and a checksum (writes
    through `p.data`, which bypass the counter). Computed twice per step
    over every parameter, so the checksum is a float32 sum (one read of an
    fp32 parameter; a float64 sum converted first: 4x the time, and 9% of
    a worker's CPU per step at 20M parameters, docs/performance.md).
    Deterministic, so equal for unchanged values; a change that leaves the
    float32 sum bit for bit the same goes unseen (as a permutation would
    with any sum)."""
    return (p._version, p.data_ptr(), float(p.detach().sum(dtype=torch.float32)))


def _same_fingerprint(a: Tuple[int, int, float], b: Tuple[int, int, float]) -> bool:
    return a[:2] == b[:2] and (a[2] == b[2] or (math.isnan(a[2]) and math.isnan(b[2])))


class _ShardState(Mapping):
    """`optimizer.state`: param -> the shard's state under upstream names,
    fetched (GetState) on first access after each step: `state[p]` reads
    p's tensor only (hf: "step" and "RMS", which transformers'
    AdafactorSchedule reads every step, without a read: _HFParamState),
    iteration reads them all. A snapshot: writing
    into it changes nothing on the shards. Every parameter that travels
    (requires_grad) has an entry, zeros before its first update."""

    def __init__(self, opt: "_RemoteAdafactorBase") -> None:
        self._opt = opt

    def _all(self) -> Dict[Tensor, Dict[str, Any]]:
        return self._opt._fetch_state()

    def __getitem__(self, p: Tensor) -> Mapping:
        if isinstance(p, Tensor) and id(p) in self._opt._names:
            if self._opt.flavor == "hf" and p.requires_grad:
                return _HFParamState(self._opt, p)
            got = self._opt._fetch_state(p)
            if p in got:
                return got[p]
            return {}  # frozen: like torch's defaultdict for a parameter never stepped
        raise KeyError(p)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._all())

    # Whole reads (state_dict(), state.values()) get plain dicts, one
    # GetState of every tensor; state[p] of a hf parameter is lazy.
    def items(self) -> Any:
        return self._all().items()

    def values(self) -> Any:
        return self._all().values()

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, p: object) -> bool:
        return p in self._all()

    def __bool__(self) -> bool:
        # torch.distributed.checkpoint's _init_optim_state() steps an
        # optimizer whose state is empty with zero gradients to create it:
        # this state exists (on the shards, or at setup) for every tensor.
        return any(p.requires_grad for p in self._opt._params())

    def __repr__(self) -> str:
        return f"<factorps shard state of {len(self._opt._names)} tensors>"


class _HFParamState(Mapping):
    """`optimizer.state[p]` of a RemoteHFAdafactor parameter: "step" and
    "RMS" (all that transformers' AdafactorSchedule reads, through
    `_get_lr`, every step) come from what this worker tracks (see
    `_RemoteAdafactorBase._scalars_of`), without a GetState per step; any
    other key reads p's state from its shard."""

    def __init__(self, opt: "_RemoteAdafactorBase", p: Tensor) -> None:
        self._opt, self._p = opt, p

    def _full(self) -> Dict[str, Any]:
        return self._opt._fetch_state(self._p).get(self._p, {})

    def __getitem__(self, key: str) -> Any:
        if key in ("step", "RMS"):
            sc = self._opt._scalars_of(self._p)
            if sc is not None:
                return sc[0] if key == "step" else torch.tensor(sc[1], dtype=torch.float32)
        return self._full()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._full())

    def __len__(self) -> int:
        return len(self._full())


class _RemoteAdafactorBase(Optimizer):
    """What both flavors share. The factorps options (keyword-only):

    shards: "host:port" of every shard, in shard order (a list or one
        comma-separated string). Default: $FACTORPS_SHARDS.
    worker_id, num_workers: this worker and the job's worker count. Default:
        torch.distributed's rank and world size when it is initialised, else
        $RANK and $WORLD_SIZE (torchrun), else 0 and 1. Sent with every push:
        the shards refuse a count that is not theirs at once.
    mode: "sync", "async" or "ssp": checked against the shards at the first
        step (None: any).
    namespace: prefix of every tensor name on the shards, so that several
        jobs can share them.
    on_existing: "error", "adopt" or "overwrite": what the first step does
        when the shards already hold a tensor of this job's name (None: "error",
        or after load_state_dict() "overwrite" with the loaded state).
    client: an open factorps.Client to use instead of connecting.
    deadline, max_retries, client_options: the Client's (seconds per call,
        retries of unreachable shards, further factorps.connect options).
    recovery_timeout: seconds step() spends re-synchronising after a failed
        push before it raises (default: `deadline`).
    split_min_bytes: parameters of at least this many bytes are cut into row
        blocks over several shards (factorps.connect's option; 0, the
        default, never splits; factorps.SPLIT_MIN_BYTES_DEFAULT is the
        recommended 32 MiB). The update stays exactly the unsplit one; the
        shards need --peers and --mode sync. Not used with client=.
    names_from: a torch.nn.Module (or {name: parameter}, or (name,
        parameter) pairs) naming the parameters passed as bare tensors:
        `RemoteAdafactor(groups, names_from=model)` names the tensors after
        model.named_parameters() whatever the grouping (the Trainer's
        weight-decay groups), so names stay stable across runs.

    Names drop the components module wrappers add (torch.compile's
    "_orig_mod.", FSDP's and activation checkpointing's wrapper modules
    anywhere, DDP's leading "module."), so a job resumed with or without
    torch.compile or DDP finds the same tensors.
    """

    flavor = ""
    _FIXED: Tuple[str, ...] = ()

    def _init_remote(self, params: ParamsT, defaults: Dict[str, Any], *,
                     shards: Optional[Union[str, Sequence[str]]], worker_id: Optional[int],
                     num_workers: Optional[int], mode: Optional[str], namespace: str,
                     on_existing: Optional[str], client: Optional[Client], deadline: float,
                     max_retries: int, recovery_timeout: Optional[float],
                     client_options: Optional[Dict[str, Any]], split_min_bytes: int = 0,
                     names_from: Any = None) -> None:
        if mode not in (None, "sync", "async", "ssp"):
            raise ValueError(f"mode must be 'sync', 'async', 'ssp' or None, not {mode!r}")
        if on_existing not in (None,) + ON_EXISTING:
            raise ValueError(f"on_existing must be one of {ON_EXISTING} or None, not "
                             f"{on_existing!r}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        self.worker_id, self.num_workers, self._launcher_src = _launcher(worker_id, num_workers)
        if client is None:
            if shards is None:
                shards = os.environ.get("FACTORPS_SHARDS") or None
            if not shards:
                raise ValueError(f"{type(self).__name__} needs shards=[\"host:port\", ...] "
                                 "(or $FACTORPS_SHARDS, or client=)")
        self.mode = mode
        self.namespace = namespace
        self.on_existing = on_existing
        self.deadline = float(deadline)
        self.recovery_timeout = float(self.deadline if recovery_timeout is None
                                      else recovery_timeout)
        if not (math.isfinite(self.recovery_timeout) and self.recovery_timeout >= 0):
            # NaN would never compare as passed: step() would retry for good.
            raise ValueError(f"recovery_timeout must be a finite number of seconds >= 0, "
                             f"got {recovery_timeout!r}")
        self._names: Dict[int, str] = {}      # id(param) -> tensor name on the shards
        self._names_from = _name_map(names_from)  # id(param) -> model name, for bare tensors
        self._travel: set = set()             # id(param) of the tensors setup() created
        self.skipped_steps = 0                # steps skipped for a non-finite gradient
        self.last_step_skipped = False
        self._created = False
        self._fixed: List[Dict[str, Any]] = []  # per group: the values fixed at creation
        self._versions: Dict[str, int] = {}   # tensor name -> its version (last seen)
        self._pushes = 0                      # this worker's completed pushes (async/ssp)
        self._dirty = False                   # a push failed: re-read values and versions
        self._restored = False                # a shard went back to a checkpoint
        self._pool: Optional[ThreadPoolExecutor] = None
        # Every parameter that travelled, frozen since or not: one frozen
        # after a step and unfrozen later is compared with its value when it
        # last travelled (a change made meanwhile is written like any other).
        self._prints: Dict[int, Tuple[int, int, float]] = {}
        self._loaded: Optional[Dict[Tensor, Dict[str, Any]]] = None
        self._state_cache: Optional[Dict[Tensor, Dict[str, Any]]] = None
        self._state_one: Dict[Tensor, Dict[str, Any]] = {}  # state[p] reads since the step
        # hf: id(param) -> (step, RMS, version) of its last update, for the
        # parameters whose state[p] was read (AdafactorSchedule's first
        # parameter of each group), and their (version, RMS) before the
        # step's push: see _scalars_of().
        self._scalars: Dict[int, Tuple[int, float, int]] = {}
        self._scalars_pre: Dict[int, Tuple[int, float]] = {}
        self._shard_mode: Optional[str] = None
        self._own_client = False
        self._overlap: Optional[Overlap] = None   # attach(): pushes during backward
        self._ddp_attached = _WeakIdSet()         # DDP modules with our comm hook
        self._ddp_checked = False                 # check_ddp() ran since creation
        self.client: Optional[Client] = None
        super().__init__(params, defaults)
        if client is not None:
            self.client = client
        else:
            opts = dict(client_options or {})
            if split_min_bytes:
                opts["split_min_bytes"] = split_min_bytes
            self.client = Client(shards, worker_id=self.worker_id, deadline=self.deadline,
                                 max_retries=max_retries, **opts)
            self._own_client = True
        self.client.worker_id = self.worker_id

    # -- torch.optim.Optimizer plumbing ------------------------------------------

    @property
    def state(self) -> _ShardState:  # type: ignore[override]
        return _ShardState(self)

    @state.setter
    def state(self, value: Any) -> None:
        # Optimizer.__init__ assigns an empty defaultdict: the state lives on
        # the shards. Anything else comes through __setstate__.
        if value:
            raise AttributeError("optimizer.state is read from the shards; use "
                                 "load_state_dict() to set it")

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Optimizer.load_state_dict() ends here with the loaded, re-keyed
        # state (before its post hooks). Only a state that has been stepped
        # may replace the shards' tensors: accelerate.prepare() and the
        # Trainer load an optimizer's own state_dict() before its first
        # step (every step 0), which must leave the overwrite guard alone.
        state = dict(state)
        loaded = state.pop("state", None)
        super().__setstate__(state)
        kept = {k: v for k, v in (loaded or {}).items()
                if isinstance(k, Tensor) and v and _loaded_step(v) > 0}
        self._loaded = kept or None
        for g in self.param_groups:
            g["eps"] = tuple(g["eps"])
        self._created = False
        self._forget_state()

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(f"{type(self).__name__} holds a connection to the shards and cannot be "
                        "pickled; save state_dict() instead")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's; a group may hold (name, tensor) pairs (the names are
        kept under "param_names", as PyTorch >= 2.6 does). A group added
        after the first step is created at the next one (its tensors start
        at version 0 and step with the others)."""
        if getattr(self, "_overlap", None) is not None:
            raise RuntimeError("add_param_group() after factorps.torch.attach(): the hooks "
                               "would miss the new parameters; add the group before attach()")
        param_group = dict(param_group)
        ps = param_group["params"]
        if not isinstance(ps, Tensor):
            ps, names = _split_named(list(ps))
            param_group["params"] = ps
            if names is not None:
                param_group["param_names"] = names
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            self._validate_group(g)
            for p in g["params"]:
                if p.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse parameters")
                if torch.is_complex(p):
                    raise ValueError(f"{type(self).__name__} does not support complex "
                                     "parameters")
            names = g.get("param_names")
            if names is not None and len(names) != len(g["params"]):
                raise ValueError("param_names and params differ in length")
            taken = set(self._names.values())
            new = {}
            for pi, p in enumerate(g["params"]):
                if names is not None:
                    local = names[pi]
                elif id(p) in self._names_from:
                    local = self._names_from[id(p)]
                else:
                    local = f"g{gi}.p{pi}"
                name = self.namespace + _normalize_name(local)
                if name in taken:
                    raise ValueError(f"two parameters are both named '{name}'")
                taken.add(name)
                new[id(p)] = name
        except BaseException:
            self.param_groups.pop()
            raise
        self._names.update(new)
        self._created = False  # the job's tensor list changed: create again
        self._ddp_checked = False

    def _validate_group(self, g: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _wire_config(self, g: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def _tensor_config(self, cfg: Dict[str, Any], p: Tensor) -> Dict[str, Any]:
        """The group's `cfg` as it applies to parameter `p` (its dtype)."""
        return cfg

    def _push_hparams(self, gi: int, g: Dict[str, Any]) -> Dict[str, float]:
        """This step's lr / weight_decay of group `gi` for the push."""
        raise NotImplementedError

    def _state_view(self, p: Tensor, st: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def _state_arrays(self, p: Tensor, name: str, st: Dict[str, Any],
                      group: Dict[str, Any]) -> Tuple[int, Dict[str, Any], float]:
        """Validates a loaded state of `p` (in `group`) and returns (step,
        {kind: flat array}, rms) for Create."""
        raise NotImplementedError

    # -- names ------------------------------------------------------------------

    def param_names(self) -> List[str]:
        """Tensor names on the shards, in group/parameter order (namespace included)."""
        return [self._names[id(p)] for g in self.param_groups for p in g["params"]]

    def _params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _live(self) -> List[Tensor]:
        """The parameters that travel: requires_grad=False ones (frozen
        layers, LoRA's base weights) are never created, pushed or pulled."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @property
    def remote_step(self) -> int:
        """Sync: the version most tensors are at (the next push's step);
        async/ssp: this worker's completed pushes."""
        if self._shard_mode == "sync" and self._versions:
            return Counter(self._versions.values()).most_common(1)[0][0]
        return self._pushes

    # -- creation and ownership -------------------------------------------------

    def _check_shards(self) -> None:
        first = self.client.stats()[0]
        mode, workers = first["mode"], int(first.get("workers") or 0)
        if self.mode is not None and mode != self.mode:
            raise FailedPreconditionError(
                f"the shards run {mode} mode, but this optimizer expects mode={self.mode!r}")
        if mode in ("sync", "ssp") and workers and workers != self.num_workers:
            raise FailedPreconditionError(
                f"the shards run {mode} mode for {workers} workers, but this optimizer has "
                f"num_workers={self.num_workers} (from {self._launcher_src})")
        self._shard_mode = mode

    def _existing(self, names: List[str]) -> Dict[str, Dict[str, Any]]:
        """The tensors of `names` the shards already hold with values."""
        found = self.client.holds(names)
        out = {}
        for name in found:
            ts = self.client.tensor_stats(name)
            if ts["ready"]:
                out[name] = ts
        return out

    @torch.no_grad()
    def setup(self) -> None:
        """Creates the job's tensors on the shards (see on_existing) and pulls
        their values into the parameters. The first step() calls it; call it
        yourself to start every worker from the same weights before the first
        forward pass."""
        self._check_shards()
        params = self._live()
        names = [self._names[id(p)] for p in params]
        loaded = self._loaded
        policy = self.on_existing or ("overwrite" if loaded is not None else "error")
        existing: Dict[str, Dict[str, Any]] = {}
        if self.worker_id == 0:
            # Tensors this optimizer created itself are not "existing",
            # unless a loaded state dict is to replace them.
            existing = self._existing([n for n in names
                                       if loaded is not None or n not in self._versions])
            if existing and policy == "error":
                some = sorted(existing)
                raise AlreadyExistsError(
                    f"the shards already hold {len(some)} of this job's {len(names)} tensors "
                    f"({', '.join(repr(n) for n in some[:4])}{', ...' if len(some) > 4 else ''}"
                    f", e.g. '{some[0]}' at version {existing[some[0]]['version']}); pass "
                    "on_existing='adopt' to continue from them, 'overwrite' to replace them, "
                    "or another namespace= for a separate job")
        if self.worker_id != 0 and self.client.shard_count > 1:
            # Where the shards hold this job's tensors already (worker 0's
            # holds() above asked too): create() keeps them there, so a group
            # added or a parameter unfrozen since the first step, or a worker
            # restarted into a running job, moves no tensor away from its
            # state, and every worker places the new ones alike. A split
            # tensor worker 0 is still creating can look incomplete: then
            # the plan alone places (it did so for worker 0 as well).
            try:
                self.client.discover()
            except DataLossError:
                pass
        specs = []
        for g in self.param_groups:
            cfg = self._wire_config(g)
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                name = self._names[id(p)]
                spec = TensorSpec(name, tuple(p.shape), None, self._tensor_config(cfg, p))
                st = loaded.get(p) if loaded is not None else None
                if self.worker_id != 0 and st:
                    # Register at the step worker 0 resumes it at (a Create at
                    # another step would be refused while it is being created).
                    spec.step = self._state_arrays(p, name, st, g)[0]
                if self.worker_id == 0:
                    spec.init = p.detach()
                    if name in existing:
                        if policy == "overwrite":
                            spec.replace = True
                        else:
                            st = None  # adopt: the shards' values and state win
                    if st:
                        spec.step, spec.state, spec.rms = self._state_arrays(p, name, st, g)
                        if not spec.step:
                            spec.state = None  # never updated: a fresh state
                specs.append(spec)
        self.client.create(specs)
        _, versions = self.client.pull(names, out={n: p for n, p in zip(names, params)})
        gone = [n for n in names if versions[n] == 0 and self._versions.get(n, 0) > 0]
        self._versions = dict(versions)
        self._dirty = False
        if existing and policy == "adopt":
            log.info("factorps: adopted %d tensors the shards already held", len(existing))
        self._pushes = 0
        self._loaded = None
        self._forget_state()
        self._scalars, self._scalars_pre = {}, {}
        self._fixed = [{k: g[k] for k in self._FIXED} for g in self.param_groups]
        self._prints.update({id(p): _fingerprint(p) for p in params})
        self._travel = {id(p) for p in params}
        self._created = True
        if gone:
            raise FailedPreconditionError(
                f"{len(gone)} tensor(s) of this job ('{gone[0]}', ...) are back at version 0: "
                "their shard restarted without a checkpoint and lost their weights and "
                "optimizer state (versions went back to 0). They were created again from this "
                "worker's current values with a fresh state; step() continues from there")

    # -- state ------------------------------------------------------------------

    def _forget_state(self) -> None:
        self._state_cache = None
        self._state_one = {}

    def _initial_state(self) -> Dict[Tensor, Dict[str, Any]]:
        """Before setup(): what the next step creates the tensors with (the
        loaded state, else zeros at step 0)."""
        loaded = self._loaded or {}
        out: Dict[Tensor, Dict[str, Any]] = {}
        for g in self.param_groups:
            has_mom = self.flavor == "hf" and g.get("beta1") is not None
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if p in loaded:
                    out[p] = loaded[p]
                    continue
                zeros = {k: np.zeros(n, np.float32) for k, n in
                         state_sizes(tuple(p.shape), has_mom).items()}
                out[p] = self._state_view(p, dict(step=0, rms=0.0, row=zeros.get("row"),
                                                  col=zeros.get("col"), var=zeros.get("var"),
                                                  mom=zeros.get("mom")))
        return out

    def _fetch_state(self, one: Optional[Tensor] = None) -> Dict[Tensor, Dict[str, Any]]:
        """param -> state view of every travelling parameter, or with `one`
        at least of that one (a GetState of its tensor only)."""
        if not self._created or self.client is None:
            return self._initial_state()
        if self._state_cache is not None:
            return self._state_cache
        if one is not None:
            if one not in self._state_one and id(one) in self._travel:
                name = self._names[id(one)]
                self._state_one[one] = self._state_view(one, self.client.get_state([name])[name])
            return self._state_one
        params = [p for p in self._params() if id(p) in self._travel]
        names = [self._names[id(p)] for p in params]
        got = self.client.get_state(names)
        self._state_cache = {p: self._state_view(p, got[n]) for p, n in zip(params, names)}
        return self._state_cache

    def _scalars_of(self, p: Tensor) -> Optional[Tuple[int, float, int]]:
        """(step, RMS, version) of `p`'s last update on its shard, without a
        GetState once `p` is watched: the first call reads them (and marks
        `p`), then every step() tracks them. An update adds one to the
        tensor's version and to its step, and reports as RMS the
        parameter's RMS before it (transformers' Adafactor), which is this
        worker's copy when it holds the master's exact values (fp32) at the
        version the update started from. Whenever that chain breaks (a
        version that moved by more than this worker's own update, as with
        other async workers; a restore; another dtype) the next call reads
        the shard again. None before the tensors exist."""
        if not self._created or self.client is None or id(p) not in self._travel:
            return None
        if self._overlap is not None:
            self._overlap.wait_all()
        self._track_scalars()
        sc = self._scalars.get(id(p))
        if sc is not None:
            return sc
        view = self._state_one.get(p)  # read since the last step
        if view is None:
            name = self._names[id(p)]
            st = self.client.get_state([name])[name]
            view = self._state_one[p] = self._state_view(p, st)
            if p.dtype == torch.float32 and st["version"] == self._versions.get(name):
                # The update that made this version started from the
                # values this worker holds now: track from here.
                self._scalars[id(p)] = (int(st["step"]), float(st["rms"]), int(st["version"]))
        return int(view["step"]), float(view["RMS"]), -1

    def _scalars_before_push(self) -> None:
        """Before a step's first push: the version and RMS of every watched
        parameter, which its update is about to start from."""
        self._track_scalars()
        if not self._scalars:
            return
        by_id = {id(q): q for q in self._live()}
        for pid, (_, _, ver) in self._scalars.items():
            p = by_id.get(pid)
            if p is not None and self._versions.get(self._names[pid]) == ver:
                # As transformers' Adafactor._rms (float32).
                rms = float(p.detach().norm(2) / (p.numel() ** 0.5))
                self._scalars_pre[pid] = (ver, rms)

    def _track_scalars(self) -> None:
        """Moves the watched parameters' (step, RMS, version) to their
        current version (after the replies of the pushes noted)."""
        pre, self._scalars_pre = self._scalars_pre, {}
        for pid, (step, rms, ver) in list(self._scalars.items()):
            v = self._versions.get(self._names[pid], ver)
            if v == ver:
                continue
            got = pre.get(pid)
            if got is not None and got[0] == ver and v == ver + 1:
                self._scalars[pid] = (step + 1, got[1], v)
            else:
                del self._scalars[pid]

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict (the shards' state under upstream names, the
        param groups), plus under "factorps" the tensor names, shapes,
        versions, flavor, namespace and worker count."""
        sd = super().state_dict()
        params = self._params()
        sd["factorps"] = {
            "format": 2,
            "flavor": self.flavor,
            "namespace": self.namespace,
            "names": [self._names[id(p)] for p in params],
            "shapes": [list(p.shape) for p in params],
            "versions": [self._versions.get(self._names[id(p)], 0) for p in params],
            "num_workers": self.num_workers,
            "mode": self._shard_mode,
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class (or of the upstream optimizer with
        the same names): the next step() creates the tensors with its state
        and step (on_existing default: overwrite what the shards hold).
        A dict that does not match these parameters is a ValueError.
        A state whose every step is 0 (an optimizer's state_dict() before its
        first step) loads the param groups only: it never replaces what the
        shards hold. register_load_state_dict_pre_hook() hooks run first
        (they may rewrite the dict), post hooks last, as in torch."""
        state_dict = dict(state_dict)
        pre_hooks = getattr(self, "_optimizer_load_state_dict_pre_hooks", None)
        for hook in list((pre_hooks or {}).values()):
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        meta = state_dict.get("factorps")
        params = self._params()
        names = [self._names[id(p)] for p in params]
        if meta is not None:
            if meta.get("format") != 2:
                raise ValueError(f"this state dict has factorps format {meta.get('format')!r}, "
                                 "this version reads format 2 (format 1 held no optimizer "
                                 "state: resume from the shards with on_existing='adopt')")
            if meta.get("flavor") != self.flavor:
                raise ValueError(f"the state dict is of flavor {meta.get('flavor')!r}, this "
                                 f"optimizer is {self.flavor!r}")
            if list(meta["names"]) != names:
                diff = next(i for i, (a, b) in enumerate(zip(list(meta["names"]) + [None] * len(
                    names), names + [None] * len(meta["names"]))) if a != b)
                raise ValueError(f"the state dict's tensor names differ from this optimizer's "
                                 f"at position {diff}: {meta['names'][diff:diff + 1]} vs "
                                 f"{names[diff:diff + 1]}")
            for name, shape, p in zip(names, meta["shapes"], params):
                if list(p.shape) != list(shape):
                    raise ValueError(f"tensor '{name}' has shape {list(p.shape)}, the state "
                                     f"dict says {list(shape)}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError(f"the state dict's parameter groups have "
                             f"{[len(s['params']) for s in saved]} parameters, this optimizer's "
                             f"{[len(g['params']) for g in self.param_groups]}")
        # Check everything before anything changes (as torch maps it: by order).
        for s, g in zip(saved, self.param_groups):
            if "param_names" in s and "param_names" in g and [
                    _normalize_name(n) for n in s["param_names"]] != [
                    _normalize_name(n) for n in g["param_names"]]:
                raise ValueError(f"the state dict's group names {s['param_names'][:3]}... "
                                 f"differ from {g['param_names'][:3]}...")
            merged = dict(g, **{k: v for k, v in s.items() if k != "params"})
            merged["eps"] = tuple(merged["eps"])
            self._validate_group(merged)
            for idx, p in zip(s["params"], g["params"]):
                st = state_dict["state"].get(idx)
                if st:
                    self._state_arrays(p, self._names[id(p)], st, merged)
        # torch's load_state_dict() without the pre hooks, which ran above;
        # it ends in __setstate__ (self._loaded), then the post hooks.
        if pre_hooks:
            self._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()
        try:
            super().load_state_dict(state_dict)
        finally:
            if pre_hooks:
                self._optimizer_load_state_dict_pre_hooks = pre_hooks

    # -- step -------------------------------------------------------------------

    def _check_fixed(self) -> None:
        for gi, (g, fixed) in enumerate(zip(self.param_groups, self._fixed)):
            for k, v in fixed.items():
                now = tuple(g[k]) if isinstance(g[k], list) else g[k]
                if now != v:
                    raise ValueError(
                        f"param group {gi}: {k} changed from {v!r} to {now!r} after the tensors "
                        f"were created; only lr and weight_decay may change during training "
                        f"(they travel with every push). {k} is fixed on the shards (it "
                        "decides the state's layout or the update rule); create a new "
                        "optimizer with on_existing='overwrite' to change it")

    def _write_local_changes(self) -> None:
        changed = [p for p in self._live()
                   if not _same_fingerprint(self._prints[id(p)], _fingerprint(p))]
        if not changed:
            return
        names = [self._names[id(p)] for p in changed]
        some = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        if self.worker_id != 0 or (self._shard_mode == "sync" and self.num_workers > 1):
            raise RuntimeError(
                f"parameter(s) {some} changed locally since the last step; the shards hold the "
                "master weights, and the next step would overwrite the change. "
                + ("Only worker 0 can write a change to the shards (its copy is the job's)."
                   if self.worker_id != 0 else
                   "In a sync job with several workers a change cannot be written mid-round: "
                   "make it before the first step, or save state_dict(), change the model and "
                   "resume with load_state_dict() in a new optimizer."))
        states = self.client.get_state(names)
        specs = []
        by_name = dict(zip(names, changed))
        for g in self.param_groups:
            cfg = self._wire_config(g)
            for p in g["params"]:
                if id(p) not in self._travel:
                    continue
                name = self._names[id(p)]
                spec = TensorSpec(name, tuple(p.shape), None, self._tensor_config(cfg, p))
                if name in by_name:
                    st = states[name]
                    spec.init = p.detach()
                    spec.replace = True
                    spec.step = st["version"] if st["step"] else 0
                    spec.rms = st["rms"]
                    if spec.step:
                        spec.state = {k: st[k] for k in ("row", "col", "var", "mom")
                                      if st[k] is not None}
                specs.append(spec)
        self.client.create(specs)
        log.info("factorps: wrote %d locally changed parameter(s) to the shards (%s)",
                 len(names), some)
        for p in changed:
            self._prints[id(p)] = _fingerprint(p)
            self._scalars.pop(id(p), None)
        self._forget_state()

    # GradScaler.step() hands this optimizer the step (with found_inf and
    # grad_scale, or on torch < 2.1 itself as grad_scaler=) instead of
    # skipping it on a worker that found an inf: the push then tells the
    # shards, and every worker skips the same step (see step()).
    _step_supports_amp_scaling = True

    def _amp(self, grad_scaler: Any) -> Tuple[Optional[bool], Optional[Tensor]]:
        """(found_inf, grad_scale) of a GradScaler driving this step: None,
        None without one; grad_scale None when the gradients are unscaled."""
        if grad_scaler is not None:  # torch < 2.1: the scaler itself
            st = grad_scaler._per_optimizer_states[id(self)]
            if getattr(st["stage"], "name", "") == "READY":
                grad_scaler.unscale_(self)
            return any(float(v) != 0 for v in st["found_inf_per_device"].values()), None
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step()
        if found_inf is None:
            return None, None
        return float(found_inf) != 0, getattr(self, "grad_scale", None)

    @staticmethod
    def _nonfinite(grads: Dict[str, Optional[Tensor]]) -> Optional[str]:
        """The first tensor whose gradient holds a NaN or an Inf (a float32
        sum of finite gradients cannot overflow below the shards' 2^63
        limit on an element)."""
        for name, g in grads.items():
            if g is not None and not math.isfinite(float(g.sum(dtype=torch.float32))):
                return name
        return None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None,
             **kwargs: Any) -> Optional[float]:
        """Performs a single optimization step on the shards: pushes every
        parameter's gradient with its group's current lr and weight decay and
        writes the updated values into the parameters in place.

        A non-finite gradient skips the step: a GradScaler's found_inf (the
        gradients are unscaled here; the scaler backs off as usual), or
        without one any NaN or Inf (logged as a warning naming the tensor).
        The step is skipped on every worker: this one pushes no gradient and
        (sync) the shards apply nothing for that step; `last_step_skipped`
        and `skipped_steps` count it.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ov = self._overlap
        if ov is not None and ov._started:
            # attach(): backward pushed the buckets; send the rest and wait.
            if grad_scaler is not None or getattr(self, "found_inf", None) is not None:
                ov.finish()
                raise RuntimeError(
                    "this GradScaler was not given to factorps.torch.attach(): backward "
                    "already pushed the scaled gradients (this step was applied with them). "
                    "Pass it: attach(model, optimizer, grad_scaler=scaler), so that step() "
                    "unscales and skips as AMP expects, on every worker")
            ov.finish()
            return loss
        if ov is not None:
            ov.wait_all()  # wait="forward": the last step's replies
        if not self._ddp_checked:
            check_ddp(self)
            self._ddp_checked = True
        if self._needs_setup():
            self.setup()  # first step, or a parameter was unfrozen since
        else:
            self._check_fixed()
            if self._dirty:
                self._refresh()
            self._write_local_changes()
        grads: Dict[str, Optional[Tensor]] = {}
        settings: Dict[str, Dict[str, Any]] = {}
        out: Dict[str, Tensor] = {}
        for gi, g in enumerate(self.param_groups):
            hp = self._push_hparams(gi, g)
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                name = self._names[id(p)]
                s = dict(hp)
                if p.grad is None:
                    s["no_grad"] = True
                    grads[name] = None
                else:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                           "gradients")
                    grads[name] = p.grad
                settings[name] = s
                out[name] = p
        found_inf, scale = self._amp(grad_scaler)
        if found_inf is None:
            bad = self._nonfinite(grads)
            if bad is not None:
                log.warning("factorps: worker %d: the gradient of '%s' holds a NaN or an Inf; "
                            "this step is skipped", self.worker_id, bad)
            found_inf = bad is not None
        elif scale is not None and not found_inf:
            inv = scale.double().reciprocal().float()  # as GradScaler.unscale_()
            for gr in grads.values():
                if gr is not None:
                    gr.mul_(inv.to(gr.device))
        with_grad = [n for n, gr in grads.items() if gr is not None]
        if found_inf:
            # Nothing to apply; the push still tells the shards and brings
            # the current values (async/ssp: it keeps this worker's clock).
            for n in grads:
                grads[n] = None
                settings[n] = dict(settings[n], no_grad=True, skip_step=True)
        before = {n: self._versions.get(n, 0) for n in with_grad}
        self._scalars_before_push()
        try:
            self._push(grads, settings, out)
        except BaseException:
            # Some shards may have applied it: re-read where every tensor
            # stands before the next push.
            self._dirty = True
            raise
        finally:
            self._forget_state()
            self._prints.update({id(p): _fingerprint(p) for p in self._live()})
        # sync: a round another worker skipped leaves the versions where
        # they were.
        self.last_step_skipped = bool(found_inf) or bool(
            self._shard_mode == "sync" and with_grad
            and all(self._versions.get(n, 0) == v for n, v in before.items()))
        self.skipped_steps += self.last_step_skipped
        return loss

    def _needs_setup(self) -> bool:
        """The tensors are not created yet, or a parameter was unfrozen since."""
        return not self._created or any(id(p) not in self._travel for p in self._live())

    def _prepare(self) -> None:
        """What must happen before a step's pushes and may rewrite the
        parameters: creating the tensors (setup) or, after a failed push,
        re-reading them. attach() runs it before forward."""
        if self._needs_setup():
            self.setup()
        elif self._dirty:
            self._refresh()

    def _push_settings(self) -> Dict[int, Dict[str, float]]:
        """id(param) -> this step's push settings (its group's lr, weight decay)."""
        out = {}
        for gi, g in enumerate(self.param_groups):
            hp = self._push_hparams(gi, g)
            for p in g["params"]:
                out[id(p)] = hp
        return out

    def _fingerprint_of(self, pid: int) -> Tuple[int, int, float]:
        return _fingerprint(self._overlap._by_id[pid])

    def zero_grad(self, set_to_none: bool = _ZERO_GRAD_SET_TO_NONE) -> None:
        """As torch's. With attach(wait="forward"), zeroing in place first
        waits for the pushes that may still read the gradients."""
        if self._overlap is not None and not set_to_none:
            self._overlap.wait_all()
        super().zero_grad(set_to_none)

    def _refresh(self) -> None:
        """Re-reads every parameter's value and version from the shards."""
        params = self._live()
        names = [self._names[id(p)] for p in params]
        _, versions = self.client.pull(names, out=dict(zip(names, params)))
        self._versions.update(versions)
        self._prints.update({id(p): _fingerprint(p) for p in params})
        self._dirty = False

    def _push_once(self, names: List[str], grads: Dict[str, Optional[Tensor]],
                   settings: Dict[str, Dict[str, Any]], out: Dict[str, Tensor]) -> Dict[str, int]:
        sync = self._shard_mode == "sync"
        if sync:
            step = Counter(self._versions[n] for n in names).most_common(1)[0][0]
            settings = {n: dict(settings[n], step=self._versions[n])
                        if self._versions[n] != step else settings[n] for n in names}
        else:
            step = self._pushes
            settings = {n: settings[n] for n in names}
        _, versions = self.client.push_pull(
            {n: grads[n] for n in names}, step=step, out={n: out[n] for n in names},
            num_workers=self.num_workers, expect_mode=self.mode, settings=settings)
        return versions

    @staticmethod
    def _recoverable(e: Error) -> bool:
        if isinstance(e, (UnavailableError, DeadlineExceededError, AbortedError)):
            return True
        # A split tensor's step that applied on some blocks only: the shards
        # bring the blocks back to one version by themselves
        # (docs/operations.md), so pull and go on like after a restore.
        if isinstance(e, DataLossError) and "row blocks report different versions" in e.message:
            return True
        return isinstance(e, FailedPreconditionError) and (
            "stale push" in e.message or "ahead of shard" in e.message)

    def _push(self, grads: Dict[str, Optional[Tensor]], settings: Dict[str, Dict[str, Any]],
              out: Dict[str, Tensor]) -> None:
        """Pushes everything, one call per shard in parallel, so that a shard
        that fails and recovers does not hold up the others' sync rounds
        (which other workers' recovery may need to complete)."""
        groups: Dict[int, List[str]] = {}
        for n in grads:
            groups.setdefault(self.client.shard_of(n), []).append(n)
        if len(groups) == 1:
            self._push_group(list(grads), grads, settings, out)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=len(self.client.shards),
                                                thread_name_prefix="factorps-push")
            futures = [self._pool.submit(self._push_group, names, grads, settings, out)
                       for names in groups.values()]
            errors = [f.exception() for f in futures]  # waits for every shard
            for err in errors:
                if err is not None:
                    raise err
        self._pushes += 1

    def _push_group(self, pending: List[str], grads: Dict[str, Optional[Tensor]],
                    settings: Dict[str, Dict[str, Any]], out: Dict[str, Tensor]) -> None:
        give_up = time.monotonic() + self.recovery_timeout
        first_error: Optional[Error] = None
        lost: Dict[str, int] = {}
        pause = 0.05
        while True:
            try:
                versions = self._push_once(pending, grads, settings, out)
            except Error as e:
                if isinstance(e, NotFoundError) and self._created:
                    raise NotFoundError(
                        f"{e.message}; this optimizer created it there before: the shard "
                        "restarted without a checkpoint (no --checkpoint-dir) and lost its "
                        "tensors. Resume from a saved optimizer state_dict (load_state_dict(), "
                        "then step()) to put them back", shard=e.shard) from e
                if not self._recoverable(e):
                    raise
                if first_error is None:
                    first_error = e
                log.debug("worker %d: push of %d tensors failed: %s", self.worker_id,
                          len(pending), e)
                if time.monotonic() >= give_up:
                    raise self._gave_up(e) from e
                pending = self._resync(pending, e, out, lost, give_up)
                if not pending:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            self._versions.update(versions)
            break
        if first_error is not None:
            if lost:
                self._restored = True
                log.warning(
                    "factorps: recovered from %s: %d tensor(s) went back to their shard's "
                    "checkpoint, %d update(s) lost (e.g. '%s': %d); training continues",
                    first_error, len(lost), sum(lost.values()), next(iter(lost)),
                    next(iter(lost.values())))
            else:
                log.warning("factorps: recovered from %s; no update lost", first_error)

    def _gave_up(self, e: Error) -> Error:
        """The error step() raises once recovery_timeout has passed."""
        return type(e)(f"{e.message} (still failing after recovery_timeout={self.recovery_timeout:g} s)",
                       shard=e.shard)

    def _partner_gone(self, e: Error) -> bool:
        return isinstance(e, DeadlineExceededError) and "waiting for worker" in e.message

    def _resync(self, pending: List[str], e: Error, out: Dict[str, Tensor],
                lost: Dict[str, int], give_up: float) -> List[str]:
        """After a failed push: reads every pending tensor's value and version
        (waiting for a restarting shard until `give_up`) and returns what
        still has to be pushed."""
        pause = 0.05
        while True:
            try:
                _, now = self.client.pull(pending, out={n: out[n] for n in pending})
                break
            except Error as pe:
                log.debug("worker %d: resync pull failed: %s", self.worker_id, pe)
                if not isinstance(pe, (UnavailableError, DeadlineExceededError)):
                    raise
                if time.monotonic() >= give_up:
                    raise self._gave_up(pe) from pe
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
        redo = []
        sent_all = [self._versions[n] for n in pending]
        for n in pending:
            sent, v = self._versions[n], now[n]
            if v < sent:
                lost[n] = lost.get(n, 0) + sent - v
            if self._shard_mode == "sync":
                # A sync round at `sent` completes only with this worker's
                # push: one past it means ours was applied.
                if v == sent + 1:
                    pass
                elif v == sent and self._restored and self._partner_gone(e):
                    # After a restore the workers may pair their pushes one
                    # step apart (whether a round completed just before the
                    # kill is known only to the worker that got its reply):
                    # the partner of this round is not coming. Drop this
                    # update, which brings the pairing back in step.
                    lost[n] = lost.get(n, 0) + 1
                else:
                    redo.append(n)
            elif v < sent or e.shard < 0 or self.client.shard_of(n) == e.shard:
                redo.append(n)
            self._versions[n] = v
        log.debug("worker %d: resync: sent %s, now %s, redo %s", self.worker_id,
                  {n: sent_v for n, sent_v in zip(pending, sent_all)}, dict(now), redo)
        return redo

    def close(self) -> None:
        """Closes the connection if this optimizer opened it."""
        if self._overlap is not None:
            self._overlap.remove()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._own_client and self.client is not None:
            self.client.close()


class RemoteAdafactor(_RemoteAdafactorBase):
    r"""torch.optim.Adafactor (PyTorch >= 2.5) with its state and update on factorps shards.

    Args:
        params: iterable of parameters, of (name, parameter) pairs (e.g.
            ``model.named_parameters()``: the names become the tensor names),
            or of dicts defining parameter groups.
        lr (float, Tensor, optional): upper bound of the relative step size
            rho_t and coefficient of the weight decay (default: 1e-2); may
            change every step (schedulers).
        beta2_decay (float, optional): decay rate of beta2 (default: -0.8).
        eps (Tuple[float, float], optional): epsilon1 (None: the dtype's
            machine epsilon) and epsilon2 (default: (None, 1e-3)).
        d (float, optional): clipping threshold of the update's RMS (default: 1.0).
        weight_decay (float, optional): decoupled weight decay coefficient
            (default: 0.0); may change every step.
        foreach (bool, optional): accepted for compatibility; no effect.
        maximize (bool, optional): maximize the objective (default: False).

    The factorps options (shards, worker_id, num_workers, mode, namespace,
    on_existing, client, deadline, max_retries, recovery_timeout,
    client_options, split_min_bytes, names_from) are described in the module and in
    ``_RemoteAdafactorBase``.
    """

    flavor = "torch"
    _FIXED = _TORCH_FIXED

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, Tensor] = 1e-2,
        beta2_decay: float = -0.8,
        eps: Tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        shards: Optional[Union[str, Sequence[str]]] = None,
        worker_id: Optional[int] = None,
        num_workers: Optional[int] = None,
        mode: Optional[str] = None,
        namespace: str = "",
        on_existing: Optional[str] = None,
        client: Optional[Client] = None,
        deadline: float = 60.0,
        max_retries: int = 5,
        recovery_timeout: Optional[float] = None,
        client_options: Optional[Dict[str, Any]] = None,
        split_min_bytes: int = 0,
        names_from: Any = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": tuple(eps), "d": d,
                    "weight_decay": weight_decay, "foreach": foreach, "maximize": maximize}
        self._validate_group(defaults)
        self._init_remote(params, defaults, shards=shards, worker_id=worker_id,
                          num_workers=num_workers, mode=mode, namespace=namespace,
                          on_existing=on_existing, client=client, deadline=deadline,
                          max_retries=max_retries, recovery_timeout=recovery_timeout,
                          client_options=client_options, split_min_bytes=split_min_bytes,
                          names_from=names_from)

    def _validate_group(self, g: Dict[str, Any]) -> None:
        """torch.optim.Adafactor's checks, for every group."""
        lr = _num(g["lr"])
        if len(tuple(g["eps"])) != 2:
            raise ValueError(f"eps must be a pair (eps1, eps2), got {g['eps']!r}")
        eps1, eps2 = g["eps"]
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= g["beta2_decay"]:
            raise ValueError(f"beta2_decay should be <= 0 but is: {g['beta2_decay']}")
        if eps1 is not None and not 0.0 <= eps1:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps1}")
        if not 0.0 <= eps2:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps2}")
        if not 1.0 <= g["d"]:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {g['d']}")
        if not 0.0 <= g["weight_decay"]:
            raise ValueError(f"weight_decay should be >= 0 but is: {g['weight_decay']}")

    def _wire_config(self, g: Dict[str, Any]) -> Dict[str, Any]:
        eps1, eps2 = g["eps"]
        return dict(flavor="torch", lr=_num(g["lr"]), beta2_decay=g["beta2_decay"], eps1=eps1,
                    eps2=eps2, clip_threshold=g["d"], weight_decay=_num(g["weight_decay"]),
                    maximize=bool(g["maximize"]))

    def _tensor_config(self, cfg: Dict[str, Any], p: Tensor) -> Dict[str, Any]:
        # eps1=None is torch.finfo(param.dtype).eps upstream (torch 2.5 to
        # 2.13 at least): 2^-7 for a bf16 parameter, 2^-10 for fp16, not
        # fp32's 2^-23. The shards default to fp32's, so send the
        # parameter's own. (Upstream takes the first parameter's dtype for
        # a whole group; a group mixing dtypes gets each one's here.)
        if cfg["eps1"] is None and p.dtype != torch.float32:
            return dict(cfg, eps1=float(torch.finfo(p.dtype).eps))
        return cfg

    def _push_hparams(self, gi: int, g: Dict[str, Any]) -> Dict[str, float]:
        lr, wd = float(_num(g["lr"])), float(_num(g["weight_decay"]))
        if not (math.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"param group {gi}: lr must be finite and >= 0, got {lr}")
        if not (math.isfinite(wd) and wd >= 0.0):
            raise ValueError(f"param group {gi}: weight_decay must be finite and >= 0, got {wd}")
        return {"lr": lr, "weight_decay": wd}

    def _state_view(self, p: Tensor, st: Dict[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"step": torch.tensor(float(st["step"]), dtype=torch.float32)}
        shape = list(p.shape)
        if p.dim() > 1:
            out["row_var"] = torch.from_numpy(st["row"]).reshape(shape[:-1] + [1])
            out["col_var"] = torch.from_numpy(st["col"]).reshape(shape[:-2] + [1, shape[-1]])
        else:
            out["variance"] = torch.from_numpy(st["var"]).reshape(shape)
        return out

    def _state_arrays(self, p: Tensor, name: str, st: Dict[str, Any],
                      group: Dict[str, Any]) -> Tuple[int, Dict[str, Any], float]:
        shape = list(p.shape)
        if p.dim() > 1:
            want = {"row_var": shape[:-1] + [1], "col_var": shape[:-2] + [1, shape[-1]]}
        else:
            want = {"variance": shape}
        return _check_state(name, st, want, ("step",), {"row_var": "row", "col_var": "col",
                                                        "variance": "var"}, None)


class RemoteHFAdafactor(_RemoteAdafactorBase):
    r"""transformers' Adafactor with its state and update on factorps shards.

    Args (transformers' names, order and defaults):
        params: iterable of parameters, of (name, parameter) pairs, or of dicts
            defining parameter groups.
        lr (float, optional): the external learning rate (with
            relative_step=False; may change every step).
        eps (Tuple[float, float], optional): regularisation constants for the
            square gradient and the parameter scale (default: (1e-30, 1e-3)).
        clip_threshold (float, optional): threshold of the update's RMS (default: 1.0).
        decay_rate (float, optional): coefficient for the running average of
            the square (default: -0.8).
        beta1 (float, optional): coefficient of the running average of the
            update (default: None, no first moment).
        weight_decay (float, optional): weight decay (default: 0.0); may change
            every step.
        scale_parameter (bool, optional): scale the lr by the parameter's RMS
            (default: True).
        relative_step (bool, optional): use the time-dependent relative step
            instead of `lr` (default: True).
        warmup_init (bool, optional): warm the relative step up from 1e-6*t
            (default: False).

    The factorps options are keyword-only, as in RemoteAdafactor. With
    relative_step=True the shard computes the learning rate; `_get_lr(group,
    state)` reports it from `optimizer.state`, so transformers'
    AdafactorSchedule reads the real value, and a scheduler's `lr` in such a
    group is ignored, as transformers ignores it.
    """

    flavor = "hf"
    _FIXED = _HF_FIXED

    def __init__(
        self,
        params: ParamsT,
        lr: Optional[float] = None,
        eps: Tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: Optional[float] = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        *,
        shards: Optional[Union[str, Sequence[str]]] = None,
        worker_id: Optional[int] = None,
        num_workers: Optional[int] = None,
        mode: Optional[str] = None,
        namespace: str = "",
        on_existing: Optional[str] = None,
        client: Optional[Client] = None,
        deadline: float = 60.0,
        max_retries: int = 5,
        recovery_timeout: Optional[float] = None,
        client_options: Optional[Dict[str, Any]] = None,
        split_min_bytes: int = 0,
        names_from: Any = None,
    ) -> None:
        if lr is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        defaults = {"lr": lr, "eps": tuple(eps), "clip_threshold": clip_threshold,
                    "decay_rate": decay_rate, "beta1": beta1, "weight_decay": weight_decay,
                    "scale_parameter": scale_parameter, "relative_step": relative_step,
                    "warmup_init": warmup_init}
        self._validate_group(defaults)
        self._init_remote(params, defaults, shards=shards, worker_id=worker_id,
                          num_workers=num_workers, mode=mode, namespace=namespace,
                          on_existing=on_existing, client=client, deadline=deadline,
                          max_retries=max_retries, recovery_timeout=recovery_timeout,
                          client_options=client_options, split_min_bytes=split_min_bytes,
                          names_from=names_from)

    @staticmethod
    def _get_lr(param_group: Dict[str, Any], param_state: Dict[str, Any]) -> float:
        """The learning rate of the last update of a parameter with state
        `param_state` (transformers' Adafactor._get_lr)."""
        rel_step_sz = param_group["lr"]
        if param_group["relative_step"]:
            t = param_state["step"]
            rel_step_sz = min(1e-6 * t if param_group["warmup_init"] else 1e-2,
                              1.0 / math.sqrt(t))
        scale = 1.0
        if param_group["scale_parameter"]:
            scale = max(param_group["eps"][1], param_state["RMS"])
        return scale * rel_step_sz

    def _validate_group(self, g: Dict[str, Any]) -> None:
        if len(tuple(g["eps"])) != 2:
            raise ValueError(f"eps must be a pair (eps1, eps2), got {g['eps']!r}")
        if g["warmup_init"] and not g["relative_step"]:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        if g["lr"] is None and not g["relative_step"]:
            # transformers fails at its first step(); the shards need an lr.
            raise ValueError("`relative_step=False` requires a manual `lr`")

    def _wire_config(self, g: Dict[str, Any]) -> Dict[str, Any]:
        eps1, eps2 = g["eps"]
        lr = None if g["relative_step"] else _num(g["lr"])
        return dict(flavor="hf", lr=lr, beta2_decay=g["decay_rate"], eps1=eps1, eps2=eps2,
                    clip_threshold=g["clip_threshold"], weight_decay=_num(g["weight_decay"]),
                    beta1=g["beta1"], scale_parameter=bool(g["scale_parameter"]),
                    relative_step=bool(g["relative_step"]), warmup_init=bool(g["warmup_init"]))

    def _push_hparams(self, gi: int, g: Dict[str, Any]) -> Dict[str, float]:
        wd = float(_num(g["weight_decay"]))
        if not (math.isfinite(wd) and wd >= 0.0):
            raise ValueError(f"param group {gi}: weight_decay must be finite and >= 0, got {wd}")
        out = {"weight_decay": wd}
        if not g["relative_step"]:  # else the shard's relative step; group["lr"] is ignored
            if g["lr"] is None:
                raise ValueError(f"param group {gi}: relative_step=False requires an lr")
            lr = float(_num(g["lr"]))
            if not (math.isfinite(lr) and lr >= 0.0):
                raise ValueError(f"param group {gi}: lr must be finite and >= 0, got {lr}")
            out["lr"] = lr
        return out

    def _state_view(self, p: Tensor, st: Dict[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"step": int(st["step"])}
        shape = list(p.shape)
        if st["mom"] is not None:
            out["exp_avg"] = torch.from_numpy(st["mom"]).reshape(shape)
        if p.dim() >= 2:
            out["exp_avg_sq_row"] = torch.from_numpy(st["row"]).reshape(shape[:-1])
            out["exp_avg_sq_col"] = torch.from_numpy(st["col"]).reshape(shape[:-2] + shape[-1:])
        else:
            out["exp_avg_sq"] = torch.from_numpy(st["var"]).reshape(shape)
        out["RMS"] = torch.tensor(st["rms"], dtype=torch.float32)
        return out

    def _state_arrays(self, p: Tensor, name: str, st: Dict[str, Any],
                      group: Dict[str, Any]) -> Tuple[int, Dict[str, Any], float]:
        shape = list(p.shape)
        if p.dim() >= 2:
            want = {"exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:]}
        else:
            want = {"exp_avg_sq": shape}
        if group["beta1"] is not None:
            want["exp_avg"] = shape
        return _check_state(name, st, want, ("step", "RMS"),
                            {"exp_avg_sq_row": "row", "exp_avg_sq_col": "col",
                             "exp_avg_sq": "var", "exp_avg": "mom"}, "RMS")


def attach(model: torch.nn.Module, optimizer: _RemoteAdafactorBase, *,
           bucket_cap_mb: float = 25.0, wait: str = "step",
           grad_scaler: Any = None) -> Overlap:
    """Makes backward push the gradients of `optimizer`'s parameters while it
    runs (see factorps.overlap): through a DDP communication hook when `model`
    is a DistributedDataParallel (instead of its all-reduce; DDP's own
    bucket_cap_mb decides the buckets), else through per-parameter
    post-accumulate-grad hooks in buckets of `bucket_cap_mb` MiB (PyTorch >=
    2.1; an older torch pushes in step() as without attach). Call it once,
    after wrapping and before the first forward. step() then waits for the
    replies; with wait="forward" it returns at once and each module's
    forward waits for its own parameters. Returns the handle (`no_sync()`
    for gradient accumulation, `remove()`).

    Mixed precision: with a GradScaler (`scaler.step(optimizer)`), pass it
    as `grad_scaler=scaler`. A step must then be skipped whole, on every
    worker and shard, when any gradient is non-finite, which only step()
    can know (after the last gradient): the hooks send nothing and step()
    unscales, checks and pushes as without attach (under DDP the hook
    still replaces the all-reduce, so gradients travel once, but nothing
    overlaps backward). An enabled GradScaler that attach() was not given
    makes the first backward raise before anything leaves
    (`grad_scaler=False`: it drives another optimizer). Without a scaler
    every bucket is checked before it leaves: a NaN or Inf in the step's
    first bucket skips the step on every worker (as step() without attach
    does); one found after finite buckets left makes step() raise
    FloatingPointError on every worker (those tensors were updated, the rest
    skipped: workers and shards still agree)."""
    # Accelerate's prepare() wraps the optimizer (AcceleratedOptimizer);
    # the factorps one is its .optimizer.
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(optimizer, _RemoteAdafactorBase) and isinstance(inner, _RemoteAdafactorBase):
        optimizer = inner
    if not isinstance(optimizer, _RemoteAdafactorBase):
        raise TypeError(f"attach() needs a factorps optimizer, not {type(optimizer).__name__}")
    if optimizer._overlap is not None:
        raise RuntimeError("this optimizer is already attached to a model")
    optimizer._overlap = Overlap(optimizer, model, bucket_cap_mb, wait, grad_scaler)
    return optimizer._overlap


def _loaded_step(st: Mapping) -> float:
    """The step of one parameter's loaded state (0 when it has none)."""
    step = st.get("step", 0)
    try:
        return float(step.item() if isinstance(step, Tensor) else step)
    except (TypeError, ValueError, RuntimeError):
        return 1.0  # not a number: let _check_state() name the problem


def _check_state(name: str, st: Dict[str, Any], want: Dict[str, List[int]],
                 scalars: Tuple[str, ...], kinds: Dict[str, str],
                 rms_key: Optional[str]) -> Tuple[int, Dict[str, Any], float]:
    """Validates one parameter's loaded state against the names and shapes
    this tensor needs and returns (step, {kind: flat float32 array}, rms)."""
    have = set(st)
    need = set(want) | set(scalars)
    if have != need:
        raise ValueError(f"tensor '{name}': the state dict holds {sorted(have)}, this optimizer "
                         f"needs {sorted(need)} (missing {sorted(need - have)}, unexpected "
                         f"{sorted(have - need)})")
    step = st["step"]
    if isinstance(step, Tensor) and step.numel() != 1:
        raise ValueError(f"tensor '{name}': step must be one number, got a tensor of shape "
                         f"{list(step.shape)}")
    try:
        step_f = float(step.item() if isinstance(step, Tensor) else step)
    except (TypeError, ValueError):
        raise ValueError(f"tensor '{name}': step must be a number, got {step!r}") from None
    # At most 2^53 (the shards' bound: a version counted from it stays exact).
    if not (0 <= step_f <= 2 ** 53 and step_f == int(step_f)):
        raise ValueError(f"tensor '{name}': step must be a whole number in 0..2^53, got {step_f}")
    arrays = {}
    for key, shape in want.items():
        t = st[key]
        if not isinstance(t, Tensor):
            raise ValueError(f"tensor '{name}': state '{key}' is a {type(t).__name__}, not a "
                             "tensor")
        if list(t.shape) != list(shape):
            raise ValueError(f"tensor '{name}': state '{key}' has shape {list(t.shape)}, this "
                             f"parameter needs {list(shape)}")
        a = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).numpy()
        # What the shards would refuse, refused here, before anything
        # changes: a Create refused on one shard after another took its
        # tensors would leave the model at two versions.
        moment = kinds[key] != "mom"
        bad = ~np.isfinite(a) | ((a < 0) if moment else False)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"tensor '{name}': state '{key}' element {i} is {a[i]} "
                             f"({'a second moment cannot be negative' if np.isfinite(a[i]) else 'not finite'})")
        arrays[kinds[key]] = a
    rms = 0.0
    if rms_key is not None:
        r = st[rms_key]
        rms = float(r.item() if isinstance(r, Tensor) else r)
        if not math.isfinite(rms) or rms < 0:
            raise ValueError(f"tensor '{name}': {rms_key} must be finite and >= 0, got {rms}")
    return int(step_f), arrays, rms

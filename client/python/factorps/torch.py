"""factorps.torch: a torch.optim.Optimizer whose Adafactor runs on the shards.

    from factorps.torch import RemoteAdafactor
    opt = RemoteAdafactor(model.parameters(), lr=1e-2,          # torch's names
                          shards=["127.0.0.1:7000", "127.0.0.1:7001"],
                          worker_id=rank, num_workers=world)
    loss.backward(); opt.step(); opt.zero_grad()

Constructor: torch.optim.Adafactor's arguments and defaults (PyTorch >= 2.5:
lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0,
maximize=False), or with flavor="hf" transformers' Adafactor's (lr=None,
eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
weight_decay=0.0, scale_parameter=True, relative_step=True,
warmup_init=False; `RemoteHFAdafactor` takes them in transformers'
positional order). Passing an argument the chosen flavor does not have is a
TypeError. Parameter groups may override any of them.

Behaviour, and where it differs from a local optimizer:
- Tensor names: "g{group}.p{index}" (e.g. "g0.p3"), or the names from
  `model.named_parameters()` if `params` holds (name, tensor) pairs; both
  with `name_prefix` in front (to share shards between models). Every worker
  must build the optimizer over the same parameter list.
- The first step() (or an explicit setup()) creates the tensors on the
  shards, idempotently: worker 0 sends its initial values, the other workers
  register without values and wait for them; then every worker pulls the
  shards' values into its parameters, so all start from the same weights
  (a rerun against live shards resumes from their weights and versions).
- step() pushes every parameter's .grad and writes the fresh values into the
  parameters in place. A parameter whose .grad is None is pushed as zeros:
  sync rounds need every worker's push for every tensor. Unlike a local
  Adafactor (which skips such a parameter) the shard still counts a step and
  applies weight decay to it.
- Hyperparameters are fixed when the tensors are created (the shards hold
  them). Changing a group's hyperparameters afterwards (e.g. an LR
  scheduler) raises ValueError at the next step() instead of being ignored.
- state_dict() holds no optimizer tensors (those live on the shards, and
  persisting them is the shards' job): it records the hyperparameters, the
  tensor names and shapes, the shard addresses, worker id/count and the
  step. load_state_dict() checks that the names and shapes match and
  restores hyperparameters and the step; setup() then warns if the shards'
  versions disagree with that step.
- Errors from the shards raise factorps.Error subclasses, and a failed
  step() does not advance the step. A rejected push (NaN gradient, wrong
  shape) changes nothing anywhere and may be retried. If a shard fails in
  the middle (restart, crash), other shards may already have applied the
  step and written their parameters; setup() re-reads every value and
  version, and refuses a sync job whose shards no longer agree on the step.
"""

import warnings

import torch
from torch.optim import Optimizer

from .client import Client, TensorSpec
from .errors import FailedPreconditionError

__all__ = ["RemoteAdafactor", "RemoteHFAdafactor"]

_UNSET = object()

TORCH_DEFAULTS = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0,
                      maximize=False, foreach=None)
HF_DEFAULTS = dict(lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                   weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False)
_DEFAULTS = {"torch": TORCH_DEFAULTS, "hf": HF_DEFAULTS}
# Group keys that are ours, not hyperparameters.
_META_KEYS = {"params", "param_names", "initial_lr", "foreach"}


def _num(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else x


def _validate_group(flavor, g):
    """Upstream's constructor checks, applied to every group."""
    if flavor == "torch":
        lr = _num(g["lr"])
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
    else:
        if g["lr"] is not None and g["relative_step"]:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if g["warmup_init"] and not g["relative_step"]:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        if g["lr"] is None and not g["relative_step"]:
            raise ValueError("`relative_step=False` requires a manual `lr`")
    if len(tuple(g["eps"])) != 2:
        raise ValueError(f"eps must be a pair (eps1, eps2), got {g['eps']!r}")


def _wire_config(flavor, g):
    """A group's hyperparameters in the wire contract's names (factorps.optimizer_config)."""
    eps1, eps2 = g["eps"]
    if flavor == "torch":
        return dict(flavor="torch", lr=_num(g["lr"]), beta2_decay=g["beta2_decay"], eps1=eps1,
                    eps2=eps2, clip_threshold=g["d"], weight_decay=g["weight_decay"],
                    maximize=bool(g["maximize"]))
    return dict(flavor="hf", lr=_num(g["lr"]), beta2_decay=g["decay_rate"], eps1=eps1, eps2=eps2,
                clip_threshold=g["clip_threshold"], weight_decay=g["weight_decay"],
                beta1=g["beta1"], scale_parameter=bool(g["scale_parameter"]),
                relative_step=bool(g["relative_step"]), warmup_init=bool(g["warmup_init"]))


def _hparams(g):
    return {k: (_num(v) if not isinstance(v, (tuple, list)) else tuple(v))
            for k, v in g.items() if k not in _META_KEYS}


def _split_named(params):
    """(tensors, names or None) from a list of tensors or of (name, tensor) pairs."""
    params = list(params)
    if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                      for p in params):
        return [p for _, p in params], [n for n, _ in params]
    return params, None


class RemoteAdafactor(Optimizer):
    """Adafactor whose state and update live on factorps shards (see the module doc)."""

    def __init__(self, params, lr=_UNSET, beta2_decay=_UNSET, eps=_UNSET, d=_UNSET,
                 weight_decay=_UNSET, maximize=_UNSET, *, foreach=_UNSET, flavor="torch",
                 clip_threshold=_UNSET, decay_rate=_UNSET, beta1=_UNSET,
                 scale_parameter=_UNSET, relative_step=_UNSET, warmup_init=_UNSET,
                 shards=None, worker_id=0, num_workers=1, name_prefix="", client=None,
                 deadline=60.0, max_retries=5, client_options=None):
        if flavor not in _DEFAULTS:
            raise ValueError(f"flavor must be 'torch' or 'hf', not {flavor!r}")
        given = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                     maximize=maximize, foreach=foreach, clip_threshold=clip_threshold,
                     decay_rate=decay_rate, beta1=beta1, scale_parameter=scale_parameter,
                     relative_step=relative_step, warmup_init=warmup_init)
        defaults = dict(_DEFAULTS[flavor])
        for key, value in given.items():
            if value is _UNSET:
                continue
            if key not in defaults:
                hint = {"beta2_decay": "decay_rate", "d": "clip_threshold",
                        "decay_rate": "beta2_decay", "clip_threshold": "d"}.get(key)
                raise TypeError(f"RemoteAdafactor(flavor={flavor!r}) has no argument {key!r}"
                                + (f" (this flavor calls it {hint!r})" if hint else ""))
            defaults[key] = value
        if not 0 <= int(worker_id) < int(num_workers):
            raise ValueError(f"worker_id must be in [0, num_workers), got {worker_id} of "
                             f"{num_workers}")
        if client is None and not shards:
            raise ValueError("RemoteAdafactor needs shards=[\"host:port\", ...] (or client=)")
        self.flavor = flavor
        self.worker_id = int(worker_id)
        self.num_workers = int(num_workers)
        self.name_prefix = str(name_prefix)
        self._names = {}       # id(param) -> tensor name
        self._created = False
        self._created_hparams = None
        self._zeros = {}
        self._loaded_step = None

        # Groups: accept tensors, (name, tensor) pairs, or dicts of either.
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        groups = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            g["params"], names = _split_named(ps)
            if names is not None:
                g["param_names"] = names
            groups.append(g)
        super().__init__(groups, defaults)

        if client is not None:
            self.client, self._own_client = client, False
        else:
            self.client = Client(shards, worker_id=self.worker_id, deadline=deadline,
                                 max_retries=max_retries, **(client_options or {}))
            self._own_client = True
        self.client.worker_id = self.worker_id

    # -- groups and names -------------------------------------------------------

    def add_param_group(self, param_group):
        names = param_group.get("param_names")
        ps = param_group["params"]
        if names is None and not isinstance(ps, torch.Tensor):
            ps, names = _split_named(ps)
            param_group = dict(param_group, params=ps)
            if names is not None:
                param_group["param_names"] = names
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        _validate_group(self.flavor, g)
        for p in g["params"]:
            if p.is_sparse:
                raise ValueError("RemoteAdafactor does not support sparse parameters")
        names = g.get("param_names")
        if names is not None and len(names) != len(g["params"]):
            raise ValueError("param_names and params differ in length")
        taken = set(self._names.values())
        for pi, p in enumerate(g["params"]):
            name = self.name_prefix + (names[pi] if names is not None else f"g{gi}.p{pi}")
            if name in taken:
                raise ValueError(f"two parameters are both named '{name}'")
            taken.add(name)
            self._names[id(p)] = name
        # A new group changes the job's tensor list: create again at next step.
        self._created = False

    def param_names(self):
        """Tensor names, in group/parameter order (what the shards see)."""
        return [self._names[id(p)] for g in self.param_groups for p in g["params"]]

    # -- remote set-up ----------------------------------------------------------

    def _specs(self):
        specs = []
        for g in self.param_groups:
            cfg = _wire_config(self.flavor, g)
            for p in g["params"]:
                # Worker 0's values win; the others wait for them.
                init = p.detach() if self.worker_id == 0 else None
                specs.append(TensorSpec(self._names[id(p)], tuple(p.shape), init, cfg))
        return specs

    @torch.no_grad()
    def setup(self):
        """Creates the tensors on the shards (idempotent) and pulls their values
        into the parameters. step() calls it the first time; call it yourself to
        start every worker from the same weights before the first forward pass."""
        self.client.create(self._specs())
        params = [p for g in self.param_groups for p in g["params"]]
        _, versions = self.client.pull([self._names[id(p)] for p in params],
                                       out={self._names[id(p)]: p for p in params})
        vs = set(versions.values())
        # Sync shards require step == every tensor's version, so a worker that
        # joins live shards continues at their version.
        mode, shard_workers = None, None
        try:
            first = self.client.stats()[0]
            mode, shard_workers = first["mode"], first.get("workers")
        except Exception:  # noqa: BLE001 - stats are informational here
            pass
        if mode == "sync" and shard_workers and shard_workers != self.num_workers:
            # Otherwise every sync round would wait for workers that never
            # come (or finish without some), and fail only at the deadline.
            raise FailedPreconditionError(
                f"the shards run sync mode for {shard_workers} workers, but this optimizer "
                f"was told num_workers={self.num_workers}")
        if mode == "sync":
            if len(vs) != 1:
                raise FailedPreconditionError(
                    f"shards hold tensors at different versions {sorted(vs)}; a sync job "
                    "needs them equal (restore every shard from the same checkpoint)")
            self.client.step = vs.pop()
        else:
            self.client.step = 0
        if self._loaded_step is not None and self._loaded_step != self.client.step:
            warnings.warn(f"factorps: the loaded state_dict is at step {self._loaded_step} "
                          f"but the shards are at step {self.client.step}; continuing from "
                          "the shards'")
        self._created = True
        self._created_hparams = [_hparams(g) for g in self.param_groups]

    # -- step -----------------------------------------------------------------

    def _grad_of(self, p, name):
        if p.grad is None:
            z = self._zeros.get(name)
            if z is None or z.shape != p.shape:
                z = self._zeros[name] = torch.zeros(p.shape, dtype=torch.float32)
            return z
        if p.grad.is_sparse:
            raise RuntimeError("RemoteAdafactor does not support sparse gradients")
        return p.grad

    @torch.no_grad()
    def step(self, closure=None):
        """Pushes every parameter's gradient and writes back the fresh values."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._created:
            self.setup()
        elif [_hparams(g) for g in self.param_groups] != self._created_hparams:
            raise ValueError(
                "RemoteAdafactor: a parameter group's hyperparameters changed after the tensors "
                "were created; the shards keep the values they were created with (no LR "
                "schedulers). Create the optimizer with the final values.")
        grads, out = {}, {}
        for g in self.param_groups:
            for p in g["params"]:
                name = self._names[id(p)]
                grads[name] = self._grad_of(p, name)
                out[name] = p
        self.client.push_pull(grads, out=out)
        return loss

    @property
    def remote_step(self):
        """Steps the shards have applied for this worker (the next push's step)."""
        return self.client.step

    # -- state ----------------------------------------------------------------

    def state_dict(self):
        groups, index = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            packed["params"] = list(range(index, index + len(g["params"])))
            packed["param_names"] = [self._names[id(p)] for p in g["params"]]
            index += len(g["params"])
            groups.append(packed)
        params = [p for g in self.param_groups for p in g["params"]]
        return {
            "state": {},  # Adafactor's tensors live on the shards
            "param_groups": groups,
            "factorps": {
                "format": 1,
                "flavor": self.flavor,
                "shards": list(self.client.shards),
                "worker_id": self.worker_id,
                "num_workers": self.num_workers,
                "names": [self._names[id(p)] for p in params],
                "shapes": [list(p.shape) for p in params],
                "step": self.client.step,
            },
        }

    def load_state_dict(self, state_dict):
        meta = state_dict.get("factorps")
        if meta is None or meta.get("format") != 1:
            raise ValueError("not a RemoteAdafactor state_dict (no 'factorps' section)")
        if meta["flavor"] != self.flavor:
            raise ValueError(f"state_dict is for flavor {meta['flavor']!r}, optimizer is "
                             f"{self.flavor!r}")
        params = [p for g in self.param_groups for p in g["params"]]
        names = [self._names[id(p)] for p in params]
        if meta["names"] != names:
            raise ValueError("state_dict names differ from this optimizer's parameters: "
                             f"{meta['names'][:5]}... vs {names[:5]}...")
        for name, shape, p in zip(names, meta["shapes"], params):
            if list(p.shape) != list(shape):
                raise ValueError(f"parameter '{name}' has shape {list(p.shape)}, state_dict "
                                 f"says {shape}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("state_dict has a different group structure")
        for s, g in zip(saved, self.param_groups):
            for k, v in s.items():
                if k not in ("params", "param_names"):
                    g[k] = tuple(v) if k == "eps" else v
            _validate_group(self.flavor, g)
        self._loaded_step = int(meta["step"])
        if not self._created:
            self.client.step = self._loaded_step

    def close(self):
        """Closes the connection if this optimizer opened it."""
        if self._own_client:
            self.client.close()

    def __repr__(self):
        return (f"RemoteAdafactor(flavor={self.flavor!r}, shards={self.client.shards}, "
                f"worker {self.worker_id}/{self.num_workers}, {len(self._names)} tensors)")


class RemoteHFAdafactor(RemoteAdafactor):
    """RemoteAdafactor(flavor="hf") with transformers' Adafactor positional order."""

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                 decay_rate=-0.8, beta1=None, weight_decay=0.0, scale_parameter=True,
                 relative_step=True, warmup_init=False, **remote):
        super().__init__(params, lr=lr, eps=eps, clip_threshold=clip_threshold,
                         decay_rate=decay_rate, beta1=beta1, weight_decay=weight_decay,
                         scale_parameter=scale_parameter, relative_step=relative_step,
                         warmup_init=warmup_init, flavor="hf", **remote)

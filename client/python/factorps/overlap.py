"""factorps.overlap: gradients leave for the shards during backward.

    opt = RemoteAdafactor(model.named_parameters(), ...)
    model = DistributedDataParallel(model)      # or not: a single process
    factorps.torch.attach(model, opt)           # before the first forward
    for x, y in loader:
        loss_fn(model(x), y).backward()         # buckets are pushed as they fill
        opt.step(); opt.zero_grad()             # step() waits for the replies

With `attach`, a step's gradients are pushed in buckets while backward still
runs, instead of all at once inside step():

- Under DistributedDataParallel, attach registers a DDP communication hook:
  each bucket DDP hands over is pushed to the shards *instead of* being
  all-reduced (the shards average the workers' gradients in sync mode, or
  apply each in async/ssp), so every gradient crosses the network once. The
  hook returns at once; `.grad` keeps the local gradient.
- Without DDP, per-parameter `register_post_accumulate_grad_hook` hooks
  (PyTorch >= 2.1) collect parameters into buckets of `bucket_cap_mb` and push
  each bucket when it is full; the last one at the end of backward. With an
  older torch attach does nothing and step() pushes everything (as without
  attach).
- step() sends what no hook sent (parameters whose gradient arrived some
  other way, or that have none: they must still join a sync round), waits
  for every reply and returns. The replies write the fresh parameters.
- `wait="forward"`: step() returns without waiting; each module's forward
  pre-hook waits for the replies of its own parameters (`recurse=False`),
  and the attached model's forward post-hook for all the rest, so the next
  forward can start before the last reply but never reads a stale weight.
  A module that reads another module's parameters in its forward (not a
  registered child's own use of them) must not be used with this mode.
- A gradient travels as backward produced it: changing `.grad` between
  backward and step() (clip_grad_norm_) cannot change what was sent, so
  step() raises instead of ignoring it. A GradScaler must be given to
  attach (`grad_scaler=`): then step() pushes (see `attach`). Without one,
  each bucket is checked for NaN/Inf before it leaves (see `_judge`). A second backward
  before step() (gradient accumulation) raises too, unless the earlier
  micro-batches run inside `handle.no_sync()` (or DDP's `model.no_sync()`).

A model wrapped in DDP whose optimizer is a factorps one and that has no
hook attached fails at the first step (see `check_ddp`): DDP's all-reduce
and then the push would move every gradient twice (sync) or apply the
averaged gradient once per worker (async/ssp).
"""

import contextlib
import gc
import logging
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import Tensor

# Pushes of one step's buckets are blocking library calls running at once; a
# sync push returns only when every worker sent that bucket. Buckets are sent
# in the same order on every worker, but a bucket whose rounds are linked to
# a later one (see README, sync mode) needs that one sent too, so the pool
# must never hold a step's pushes back: size it beyond any step's bucket
# count (threads start only when needed).
_MAX_INFLIGHT = 64

WAIT_MODES = ("step", "forward")

log = logging.getLogger("factorps.torch")


def has_grad_hooks() -> bool:
    """Whether this torch has per-parameter post-accumulate-grad hooks."""
    return hasattr(Tensor, "register_post_accumulate_grad_hook")


def _ddp_class() -> Optional[type]:
    mod = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(mod, "DistributedDataParallel", None)


class Overlap:
    """The pushes of one optimizer's steps while backward runs. Made by
    `factorps.torch.attach`; `remove()` takes its hooks away again."""

    def __init__(self, opt: Any, model: torch.nn.Module, bucket_cap_mb: float,
                 wait: str, grad_scaler: Any = None) -> None:
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {WAIT_MODES}, not {wait!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.opt = opt
        self.wait = wait
        self.bucket_bytes = int(bucket_cap_mb * (1 << 20))
        self.ddp = False
        self.grad_hooks = False
        # With a GradScaler every gradient must be seen before any leaves
        # (a skipped step is skipped everywhere or nowhere): the hooks hold
        # nothing back from step(), which pushes as without attach.
        self.hold = grad_scaler not in (None, False) and _scaler_enabled(grad_scaler)
        self._scalers_checked = grad_scaler is not None
        self._bad: Optional[str] = None   # a non-finite gradient of this step
        self._sent_finite = False         # a gradient of this step left before it
        self._handles: List[Any] = []
        self._lock = threading.RLock()  # hooks, step() and waits may nest
        self._pool = ThreadPoolExecutor(max_workers=_MAX_INFLIGHT,
                                        thread_name_prefix="factorps-overlap")
        self._no_sync = False
        self._started = False          # a backward of this step has pushed
        self._sent: Dict[int, Future] = {}      # id(param) -> the future of its push
        self._unwaited: Dict[int, Future] = {}  # sent, reply not yet seen by anyone
        self._futures: List[Future] = []
        self._open: List[Tensor] = []  # grad-hook path: the bucket being filled
        self._open_ids: set = set()
        self._open_bytes = 0
        self._grads: Dict[int, Any] = {}  # id(param) -> (grad, grad._version) at backward's end
        self._by_id = {id(p): p for p in opt._params()}
        self._attach(model)

    # -- wiring -----------------------------------------------------------------

    def _attach(self, model: torch.nn.Module) -> None:
        ddp_cls = _ddp_class()
        inner = model
        if ddp_cls is not None and isinstance(model, ddp_cls):
            model.register_comm_hook(self, _ddp_comm_hook)
            self.ddp = True
            self.opt._ddp_attached.add(model)
            inner = model.module
        elif has_grad_hooks() and not self.hold:
            for p in self._by_id.values():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
            self.grad_hooks = True
        self._handles.append(model.register_forward_pre_hook(self._root_pre_hook))
        if self.wait == "forward":
            for m in inner.modules():
                if any(id(p) in self._by_id for p in m.parameters(recurse=False)):
                    self._handles.append(m.register_forward_pre_hook(self._module_pre_hook))
            self._handles.append(model.register_forward_hook(self._root_post_hook))

    def remove(self) -> None:
        """Removes the forward and gradient hooks (a DDP comm hook cannot be
        unregistered: DDP has no such call) after waiting for pushes in
        flight (their errors belong to a step nobody completes: dropped)."""
        futs = list(self._unwaited.values())
        for f in futs:
            f.exception()
        self._unwaited.clear()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.opt._overlap is self:
            self.opt._overlap = None
        self._pool.shutdown()

    @property
    def active(self) -> bool:
        """Whether hooks push during backward (False on a torch without
        post-accumulate-grad hooks and without DDP, or with a GradScaler:
        step() pushes)."""
        return (self.ddp or self.grad_hooks) and not self.hold

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside push nothing; the
        first one outside (or step()) sends the summed gradients."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    # -- hooks ------------------------------------------------------------------

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        # Anything that rewrites the parameters from the shards (the first
        # setup, a re-read after a failed push) happens here, before forward
        # reads them, never while backward runs.
        if self.opt._needs_setup() or self.opt._dirty:
            self.wait_all()
            self.opt._prepare()

    def _module_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            fut = self._unwaited.get(id(p))
            if fut is not None:
                self._settle([fut])

    def _root_post_hook(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        # Parameters no module used in forward: the next backward (which
        # writes gradient memory these pushes may still read) must not start
        # before their replies.
        self.wait_all()

    def _grad_hook(self, p: Tensor) -> None:
        if self._no_sync or p.grad is None:
            return
        with self._lock:
            self._start()
            if id(p) in self._sent or id(p) in self._open_ids:
                self._twice(self.opt._names[id(p)])
            self._open.append(p)
            self._open_ids.add(id(p))
            self._open_bytes += p.grad.numel() * p.grad.element_size()
            if self._open_bytes >= self.bucket_bytes:
                self._send_open()

    def _bucket(self, params: List[Tensor], grads: List[Tensor]) -> None:
        if not self._handles:
            raise RuntimeError("the factorps optimizer of this DDP model was closed (or its "
                               "attach() removed); DDP cannot unregister a comm hook")
        if self.hold:
            return  # step() pushes; .grad keeps this rank's own gradient
        with self._lock:
            self._start()
            self._send(params, grads)

    # -- a step -----------------------------------------------------------------

    def _start(self, in_backward: bool = True) -> None:
        """The first push of a step (lock held)."""
        if self._started:
            return
        if not self._scalers_checked:
            _refuse_unseen_scaler(opt_name=type(self.opt).__name__)
            self._scalers_checked = True
        opt = self.opt
        self.wait_all()
        if opt._needs_setup() or opt._dirty:
            # No forward pre-hook ran (the attached model's forward was not
            # called): do it now; on worker 0 this writes nothing new, on
            # others it may, which is why attach() wants the forward.
            opt._prepare()
        opt._check_fixed()
        opt._write_local_changes()
        opt._scalars_before_push()
        self._settings = opt._push_settings()
        self._before = dict(opt._versions)
        self._bad, self._sent_finite = None, False
        self._started = True
        if in_backward:
            # Runs once the whole backward is done (after DDP's own
            # finalisation, queued earlier): the last bucket leaves, and the
            # gradients are recorded for step()'s check that nobody changed
            # them since.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        with self._lock:
            self._send_open()
        if self.ddp:
            # DDP queues its own finalisation (which writes the buckets into
            # .grad) when its last bucket is ready, after this callback:
            # record the gradients after that one has run.
            torch.autograd.Variable._execution_engine.queue_callback(self._record_grads)
        else:
            self._record_grads()

    def _record_grads(self) -> None:
        with self._lock:
            for pid in self._sent:
                g = self._by_id[pid].grad
                self._grads[pid] = (g, None if g is None else g._version)

    def _send_open(self) -> None:
        if self._open:
            self._send(self._open, [p.grad for p in self._open])
            self._open, self._open_ids, self._open_bytes = [], set(), 0

    @staticmethod
    def _twice(name: str) -> None:
        raise RuntimeError(
            f"parameter '{name}' got a second gradient before step(): with "
            "factorps.torch.attach() every backward pushes its gradients. For gradient "
            "accumulation run the earlier micro-batches' backward inside `handle.no_sync()` "
            "(DDP: `model.no_sync()`); otherwise call step() after each backward")

    def _send(self, params: List[Tensor], grads: List[Optional[Tensor]]) -> None:
        opt = self.opt
        names = []
        by_shard: Dict[int, List[str]] = {}
        gd: Dict[str, Optional[Tensor]] = {}
        out: Dict[str, Tensor] = {}
        settings: Dict[str, Dict[str, Any]] = {}
        mine = []
        for p, g in zip(params, grads):
            pid = id(p)
            name = opt._names.get(pid)
            if name is None:
                continue  # not this optimizer's (DDP buckets hold every parameter)
            if pid in self._sent:
                self._twice(name)
            if g is not None and g.is_sparse:
                raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients")
            mine.append((p, g, name))
        # A non-finite gradient: this bucket and every later one of the step
        # leave without gradients, saying skip_step, so that in sync mode
        # no worker's round of those tensors applies anything (and nobody
        # waits for a gradient that never comes). What left before stays
        # applied: finish() tells.
        if self._bad is None:
            self._bad = opt._nonfinite({n: g for _, g, n in mine})
            if self._bad is not None:
                log.warning("factorps: worker %d: the gradient of '%s' holds a NaN or an Inf; "
                            "the rest of this step is skipped", opt.worker_id, self._bad)
        for p, g, name in mine:
            names.append(name)
            s = dict(self._settings[id(p)])
            if g is None or self._bad is not None:
                s["no_grad"] = True
                if self._bad is not None:
                    s["skip_step"] = True
                g = None
            else:
                self._sent_finite = True
            gd[name], out[name], settings[name] = g, p, s
            by_shard.setdefault(opt.client.shard_of(name), []).append(name)
        # One call per shard, as step() does: a shard that fails and recovers
        # does not hold the others' rounds up.
        futs = {}
        for shard_names in by_shard.values():
            futs[tuple(shard_names)] = self._pool.submit(opt._push_group, shard_names, gd,
                                                         settings, out)
        for shard_names, fut in futs.items():
            self._futures.append(fut)
            for n in shard_names:
                pid = id(out[n])
                self._sent[pid] = fut
                self._unwaited[pid] = fut

    def finish(self) -> None:
        """step(): sends what no hook sent, checks the sent gradients were not
        changed since, and (wait="step") waits for every reply."""
        opt = self.opt
        with self._lock:
            self._start(in_backward=False)
            self._send_open()
            changed = []
            for pid, (g, v) in self._grads.items():
                p = self._by_id[pid]
                if p.grad is not g or (g is not None and g._version != v):
                    changed.append(opt._names[pid])
            rest = [p for p in opt._live() if id(p) not in self._sent]
            with_grad = [opt._names[pid] for pid, (g, _) in self._grads.items() if g is not None]
            with_grad += [opt._names[id(p)] for p in rest if p.grad is not None]
            if rest:
                self._send(rest, [p.grad for p in rest])
            futures, self._futures = self._futures, []
            self._sent, self._grads, self._started = {}, {}, False
        try:
            if changed:
                self.wait_all()
                some = ", ".join(repr(n) for n in changed[:3])
                raise RuntimeError(
                    f"the gradient of {some}{', ...' if len(changed) > 3 else ''} changed after "
                    "backward had pushed it to the shards (clip_grad_norm_, GradScaler.unscale_ "
                    "or another write to .grad between backward() and step()): with "
                    "factorps.torch.attach() gradients travel during backward, as produced. "
                    "This step's pushes were applied without the change; drop attach() to "
                    "change gradients before step()")
            opt.last_step_skipped = self._bad is not None and not self._sent_finite
            if self.wait == "step":
                self._settle(futures)
                self._judge(with_grad)
            else:
                # The replies come later: only this worker's own partial
                # step is known now.
                opt.skipped_steps += opt.last_step_skipped
                if self._bad is not None and self._sent_finite:
                    raise FloatingPointError(self._partial("the tensors sent before it were "
                                                           "updated"))
        finally:
            opt._pushes += 1
            opt._forget_state()

    def _judge(self, with_grad: List[str]) -> None:
        """After the replies: whether the step was skipped (a non-finite
        gradient here, or in sync mode another worker's skipped the rounds:
        the versions did not move), and FloatingPointError when only part
        of it was applied."""
        opt = self.opt
        moved = [n for n in with_grad if opt._versions.get(n, 0) != self._before.get(n, 0)]
        sync = opt._shard_mode == "sync"
        if sync and with_grad and not moved:
            opt.last_step_skipped = True
        opt.skipped_steps += opt.last_step_skipped
        partial = (self._bad is not None and self._sent_finite) or (
            sync and 0 < len(moved) < len(with_grad))
        if partial:
            missed = sorted(set(with_grad) - set(moved))
            raise FloatingPointError(self._partial(
                f"{len(with_grad) - len(missed)} of {len(with_grad)} tensors were updated, the "
                f"rest ({', '.join(repr(n) for n in missed[:3])}"
                f"{', ...' if len(missed) > 3 else ''}) skipped this step"))

    def _partial(self, what: str) -> str:
        where = f"here: {self._bad!r}" if self._bad is not None else "on another worker"
        return (f"a non-finite gradient ({where}) was found after earlier buckets of this step "
                f"had left for the shards: {what} (in sync mode on every worker). The workers "
                "and shards agree on every tensor; training may go on. For a step that is "
                "skipped whole, pass grad_scaler= to factorps.torch.attach() (step() then sees "
                "every gradient before any leaves)")

    def _settle(self, futures: List[Future]) -> None:
        """Waits for `futures`; records the new parameters' fingerprints;
        raises the first error (after all of them finished)."""
        err = None
        for fut in futures:
            e = fut.exception()
            if e is not None and err is None:
                err = e
        done = set(map(id, futures))
        with self._lock:
            for pid in [pid for pid, f in self._unwaited.items() if id(f) in done]:
                del self._unwaited[pid]
                self.opt._prints[pid] = self.opt._fingerprint_of(pid)
        if err is not None:
            self.opt._dirty = True
            raise err

    def wait_all(self) -> None:
        """Waits for every push sent so far (raising the first error)."""
        futs = list({id(f): f for f in self._unwaited.values()}.values())
        if futs:
            self._settle(futs)

    def pending(self) -> int:
        """Parameters whose reply nobody has waited for yet."""
        return len(self._unwaited)


def _ddp_comm_hook(state, bucket):  # DDP refuses annotations other than its own
    """The DDP communication hook: pushes the bucket instead of all-reducing
    it and returns at once. The bucket's memory stays untouched until the
    next backward, which starts only after step() (or the forward hooks)
    waited for these pushes."""
    state._bucket(list(bucket.parameters()), list(bucket.gradients()))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _scaler_enabled(scaler: Any) -> bool:
    enabled = getattr(scaler, "is_enabled", None)
    return bool(enabled()) if callable(enabled) else True


def _refuse_unseen_scaler(opt_name: str) -> None:
    """Raises, before a step's first push, if an enabled GradScaler exists
    that attach() was not given: backward would push the scaled gradients
    before the scaler could unscale them or skip the step. Looks at the
    live objects once per attach()."""
    classes = tuple(c for c in (
        getattr(getattr(torch, "amp", None), "GradScaler", None),
        getattr(getattr(getattr(torch, "cuda", None), "amp", None), "GradScaler", None))
        if isinstance(c, type))
    if not classes:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), classes) and _scaler_enabled(obj):
            raise RuntimeError(
                f"a GradScaler exists, but factorps.torch.attach() was not given it: backward "
                f"would push the scaled gradients before the scaler could unscale them or skip "
                f"a step with an Inf. Pass it: attach(model, optimizer, grad_scaler=scaler) "
                f"(then every gradient is checked before any leaves, and a skipped step is "
                f"skipped on every worker); or attach(..., grad_scaler=False) if it does not "
                f"drive this {opt_name}")


def check_ddp(opt: Any) -> None:
    """Raises if a DistributedDataParallel module wraps parameters of `opt`
    without factorps' hook: DDP would all-reduce every gradient and step()
    push it again (sync: twice the traffic; async/ssp: the average applied
    once per worker). Looks at the live objects once per tensor creation."""
    ddp_cls = _ddp_class()
    if ddp_cls is None:
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        # DDP needs the default process group: without one no DDP module
        # exists, and the scan (0.1-0.5 s with transformers loaded) is saved.
        return
    ids = {id(p) for p in opt._params()}
    for obj in gc.get_objects():
        # type(), not isinstance(): some module objects warn on __class__.
        if issubclass(type(obj), ddp_cls) and obj not in opt._ddp_attached:
            if any(id(p) in ids for p in obj.module.parameters()):
                raise RuntimeError(
                    f"this {type(opt).__name__}'s parameters are wrapped in "
                    "DistributedDataParallel without factorps' communication hook: DDP would "
                    "all-reduce every gradient and step() push it again (sync mode: every "
                    "gradient crosses the network twice; async/ssp: the averaged gradient is "
                    "applied once per worker). Call factorps.torch.attach(ddp_model, optimizer) "
                    "once after wrapping, before the first forward: the gradients then go to "
                    "the shards instead of being all-reduced, during backward")


class _WeakIdSet:
    """A set of objects by identity that does not keep them alive."""

    def __init__(self) -> None:
        self._refs: Dict[int, Any] = {}

    def add(self, obj: Any) -> None:
        self._refs[id(obj)] = weakref.ref(obj)

    def __contains__(self, obj: Any) -> bool:
        r = self._refs.get(id(obj))
        return r is not None and r() is obj

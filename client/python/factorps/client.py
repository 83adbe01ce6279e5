"""The factorps client: a thin ctypes binding over libfactorps.

Placement, slicing, retries and deadlines all happen in the C library; this
module only converts Python values to C arguments and back. What it does
check itself is what C cannot: the library reads `numel` floats from every
pointer it is given, and only Python knows how long a Python buffer is, so
every buffer is checked against the shape registered by `create()` before
its pointer leaves Python.

Buffers: a C-contiguous float32 numpy array, or a contiguous float32 CPU
torch tensor, is passed by pointer (no copy), in and out. Anything else
(float64, non-contiguous, GPU) goes through a temporary float32 copy.
"""

import ctypes
import operator
import threading
from collections import OrderedDict

import numpy as np

from . import _lib
from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, error_for

# The optimizer fields of the wire contract (AdafactorConfig), by flavor.
# A value of None means "absent": the shard uses the flavor's upstream default.
OPTIM_FIELDS = ("lr", "beta2_decay", "eps1", "eps2", "clip_threshold", "weight_decay",
                "maximize", "relative_step", "scale_parameter", "warmup_init", "beta1")
FLAVOR_FIELDS = {
    "torch": {"lr", "beta2_decay", "eps1", "eps2", "clip_threshold", "weight_decay", "maximize"},
    "hf": {"lr", "beta2_decay", "eps1", "eps2", "clip_threshold", "weight_decay",
           "relative_step", "scale_parameter", "warmup_init", "beta1"},
}
_BOOL_FIELDS = {"maximize", "relative_step", "scale_parameter", "warmup_init"}
_FLAVORS = {"torch": _lib.FLAVOR_TORCH, "hf": _lib.FLAVOR_HF}


def _torch_module():
    # torch is optional for the core binding: only look at it if loaded.
    import sys
    return sys.modules.get("torch")


def _is_torch(x):
    t = _torch_module()
    return t is not None and isinstance(x, t.Tensor)


def _cstr(value, what):
    """`value` as the C string the library gets: a str without NUL (C
    would end it there) that encodes to UTF-8."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a str, not {type(value).__name__}")
    if "\0" in value:
        raise InvalidArgumentError(f"{what} {value!r} holds a NUL character")
    try:
        return value.encode()
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{what} {value!r} is not valid Unicode: {e.reason}") from None


def _uint(value, what, bits, lo=0):
    """`value` as an int in lo..2^bits-1: a float, a str or a value past the
    C field would be truncated or wrapped by ctypes."""
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, not {value!r}") from None
    if isinstance(value, bool) or not lo <= v < 1 << bits:
        raise InvalidArgumentError(f"{what} must be an int in {lo}..2^{bits}-1, got {value!r}")
    return v


def _shape_tuple(shape, what):
    if isinstance(shape, (str, bytes)):
        raise InvalidArgumentError(f"{what}: shape must be a sequence of ints, not {shape!r}")
    try:
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise InvalidArgumentError(f"{what}: shape must be a sequence of ints, not {shape!r}") from None
    if len(out) > _lib.MAX_DIMS:
        raise InvalidArgumentError(f"{what}: {len(out)} dims, at most {_lib.MAX_DIMS} supported")
    if any(s < 1 or s >= 1 << 63 for s in out):
        raise InvalidArgumentError(f"{what}: every dim must be in 1..2^63-1, got {out}")
    return out


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _check_shape(name, have, want, role):
    if tuple(have) != tuple(want):
        raise InvalidArgumentError(
            f"tensor '{name}': {role} has shape {tuple(have)}, but the tensor was created "
            f"with shape {tuple(want)}")


class _In:
    """A read-only float32 view of a Python buffer, for one C call."""

    def __init__(self, x, name, shape, role):
        if _is_torch(x):
            torch = _torch_module()
            t = x.detach()
            if t.is_sparse or t.device.type == "meta" or t.is_complex():
                raise InvalidArgumentError(
                    f"tensor '{name}': {role} must be a dense real tensor with values, not "
                    f"{'sparse' if t.is_sparse else t.device.type if t.device.type == 'meta' else t.dtype}")
            _check_shape(name, t.shape, shape, role)
            # A lazily negated view (x.conj().imag) holds the values before
            # the negation: resolve it, or the raw bytes go out sign-flipped.
            if getattr(t, "is_neg", lambda: False)():
                t = t.resolve_neg()
            if not (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()):
                t = t.to(device="cpu", dtype=torch.float32).contiguous()
            self.keep = t
            self.ptr = ctypes.cast(t.data_ptr(), _lib.c_float_p)
            return
        a = np.asarray(x)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer) or
                a.dtype == np.bool_):
            raise InvalidArgumentError(f"tensor '{name}': {role} must hold real numbers, not "
                                       f"{a.dtype}")
        _check_shape(name, a.shape, shape, role)
        a = np.ascontiguousarray(a, dtype=np.float32)  # no copy if already so
        self.keep = a
        self.ptr = a.ctypes.data_as(_lib.c_float_p)


class _Out:
    """A writable float32 destination for one C call; finish() copies back
    if the caller's buffer could not be written directly."""

    def __init__(self, x, name, shape):
        self.target = None
        if x is None:
            self.result = np.empty(shape, np.float32)
            self.buf = self.result
        elif _is_torch(x):
            torch = _torch_module()
            _check_shape(name, x.shape, shape, "output")
            # Checked before the call, not at the copy back after it (the
            # push would then be applied and reported as failed).
            if not x.is_floating_point() or x.is_sparse or x.device.type == "meta":
                raise InvalidArgumentError(
                    f"tensor '{name}': output must be a dense floating-point tensor with "
                    f"storage, not {'sparse' if x.is_sparse else x.dtype} on {x.device.type}")
            if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
                raise InvalidArgumentError(f"tensor '{name}': output has overlapping elements "
                                           "(an expanded view); pass a tensor of its own")
            self.result = x
            if (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and
                    not getattr(x, "is_neg", lambda: False)()):
                self.buf = x
            else:
                self.buf = torch.empty(shape, dtype=torch.float32)
                self.target = x
            self.ptr = ctypes.cast(self.buf.data_ptr(), _lib.c_float_p)
            return
        else:
            if not isinstance(x, np.ndarray):
                raise InvalidArgumentError(
                    f"tensor '{name}': output must be a numpy array or torch tensor, "
                    f"not {type(x).__name__}")
            _check_shape(name, x.shape, shape, "output")
            if not np.issubdtype(x.dtype, np.floating):
                raise InvalidArgumentError(f"tensor '{name}': output must be a floating-point "
                                           f"array, not {x.dtype} (values would be cut)")
            self.result = x
            if x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable:
                self.buf = x
            else:
                if not x.flags.writeable:
                    raise InvalidArgumentError(f"tensor '{name}': output array is read-only")
                self.buf = np.empty(shape, np.float32)
                self.target = x
        self.ptr = self.buf.ctypes.data_as(_lib.c_float_p)

    def finish(self):
        if self.target is None:
            return
        if _is_torch(self.target):
            torch = _torch_module()
            with torch.no_grad():
                self.target.copy_(self.buf)
        else:
            np.copyto(self.target, self.buf, casting="unsafe")


def optimizer_config(flavor="torch", **hparams):
    """An Adafactor config for `create()`, in the wire contract's field names.

    flavor "torch" takes lr, beta2_decay, eps1, eps2, clip_threshold (torch's
    d), weight_decay, maximize; "hf" takes lr, beta2_decay (hf's decay_rate),
    eps1, eps2, clip_threshold, weight_decay, relative_step, scale_parameter,
    warmup_init, beta1. None (or leaving a field out) means the upstream
    default. Fields the flavor does not have raise InvalidArgumentError, as
    the shard would.
    """
    if flavor not in _FLAVORS:
        raise InvalidArgumentError(f"unknown optimizer flavor {flavor!r} (torch or hf)")
    bad = set(hparams) - FLAVOR_FIELDS[flavor]
    if bad:
        raise InvalidArgumentError(f"flavor '{flavor}' has no hyperparameter(s) {sorted(bad)}")
    return dict(hparams, flavor=flavor)


def _fill_optim(cfg, optim, name):
    if optim is not None and not isinstance(optim, dict):
        raise InvalidArgumentError(f"tensor '{name}': optimizer must be a dict (optimizer_config(...)), "
                                   f"not {optim!r}")
    optim = dict(optim or {"flavor": "torch"})
    flavor = optim.pop("flavor", "torch")
    optim = optimizer_config(flavor, **optim)
    optim.pop("flavor")
    cfg.flavor = _FLAVORS[flavor]
    for key, value in optim.items():
        if value is None:
            continue
        try:
            setattr(cfg, key, int(bool(value)) if key in _BOOL_FIELDS else float(value))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"tensor '{name}': bad value {value!r} for {key}")
        setattr(cfg, "has_" + key, 1)


STATE_KINDS = ("row", "col", "var", "mom")
MODES = {None: 0, "sync": 1, "async": 2, "ssp": 3}


def state_sizes(shape, has_mom=False):
    """{kind: elements} of a tensor's Adafactor state in the wire's flat layouts
    (tests/vectors/README.md): factored (ndim >= 2) row = lead*R, col = lead*C,
    otherwise var = numel; mom = numel with hf beta1."""
    shape = tuple(int(s) for s in shape)
    out = {}
    if len(shape) >= 2:
        lead = _numel(shape[:-2])
        out["row"], out["col"] = lead * shape[-2], lead * shape[-1]
    else:
        out["var"] = _numel(shape)
    if has_mom:
        out["mom"] = _numel(shape)
    return out


class TensorSpec:
    """One tensor for `Client.create()`: name, shape, optional initial values
    (`init`, any float array of that shape; None registers the tensor and
    waits for another worker's values) and an optimizer config (a dict from
    `optimizer_config()`; default: torch flavor, upstream defaults).

    Resume and ownership (with `init`): `step` > 0 starts the tensor at that
    Adafactor step and version, with `state` = {"row", "col" | "var", "mom"
    (hf beta1)}: flat float arrays in the layouts of `state_sizes()`, and
    `rms` (hf's RMS scalar). `replace=True` replaces a tensor the shards
    already hold (params, state, step, version) instead of matching it."""

    __slots__ = ("name", "shape", "init", "optimizer", "step", "state", "rms", "replace")

    def __init__(self, name, shape, init=None, optimizer=None, step=0, state=None, rms=0.0,
                 replace=False):
        self.name = name
        self.shape = shape
        self.init = init
        self.optimizer = optimizer
        self.step = step
        self.state = state
        self.rms = rms
        self.replace = replace

    def __repr__(self):
        init = "<values>" if self.init is not None else None
        extra = ""
        if self.step:
            extra += f", step={self.step}, state={sorted(self.state or {})}"
        if self.replace:
            extra += ", replace=True"
        return (f"TensorSpec({self.name!r}, {tuple(self.shape)!r}, init={init}, "
                f"optimizer={self.optimizer!r}{extra})")


class Client:
    """A connection to every shard of one job. Use `factorps.connect()`.

    Thread-safe like libfactorps: several threads may call push_pull/pull/stats
    at once; close() waits for calls in flight.

    Not fork-safe: gRPC's threads do not survive fork(), so a Client used in
    a forked child breaks the parent's for good; connect in the child (fork
    DataLoader workers that never touch the client are fine). A call runs
    in C: Ctrl-C (KeyboardInterrupt) is raised when it returns, at most
    `deadline` seconds later.
    """

    def __init__(self, shards, *, worker_id=0, deadline=60.0, max_retries=5, backoff=0.1,
                 max_message_bytes=4 << 20, tls_ca_file=None, tls_cert_file=None,
                 tls_key_file=None, auth_token=None, tls_server_name=None, wire_dtype="f32",
                 split_min_bytes=0, push_chunk_bytes=None, job_id=None):
        if isinstance(shards, str):
            shards = [s for s in shards.split(",") if s.strip()]
        try:
            shards = [str(s).strip() for s in shards]
        except TypeError:
            raise InvalidArgumentError(f"connect: shards must be a list of addresses or a "
                                       f"comma-separated str, not {shards!r}") from None
        if not shards:
            raise InvalidArgumentError("connect: need at least one shard address")
        worker_id = _uint(worker_id, "connect: worker_id", 32)
        max_retries = _uint(max_retries, "connect: max_retries", 31)
        max_message_bytes = _uint(max_message_bytes, "connect: max_message_bytes", 64)
        wire = {"f32": 1, "fp32": 1, "float32": 1, "bf16": 2, "bfloat16": 2}.get(
            str(wire_dtype).lower())
        if wire is None:
            raise InvalidArgumentError(f"connect: wire_dtype must be 'f32' or 'bf16', got {wire_dtype!r}")
        split_min_bytes = _uint(split_min_bytes, "connect: split_min_bytes (0: never split)", 64)
        if push_chunk_bytes is not None:
            push_chunk_bytes = _uint(push_chunk_bytes, "connect: push_chunk_bytes (0: one call per shard)", 64)
        self._lib = _lib.load()
        self.shards = list(shards)
        self.worker_id = int(worker_id)
        self.step = 0  # pushes completed; push_pull's default `step`
        self._shapes = OrderedDict()
        self._has_mom = {}  # name -> whether its state has momentum (from create())
        self._cv = threading.Condition()
        self._inflight = 0
        self._exclusive = False
        self._closed = False

        opts = _lib.ClientOptions()
        self._lib.fps_client_options_init(ctypes.byref(opts))
        opts.deadline_seconds = float(deadline)
        opts.max_retries = int(max_retries)
        opts.backoff_initial_seconds = float(backoff)
        opts.max_message_bytes = int(max_message_bytes)
        opts.wire_dtype = wire
        opts.split_min_bytes = split_min_bytes
        if push_chunk_bytes is not None:  # None: libfactorps' default
            opts.push_chunk_bytes = push_chunk_bytes
        self.split_min_bytes = split_min_bytes
        # Keep the encoded strings alive as long as the options struct.
        self._opt_strings = [None if v is None else _cstr(str(v), "connect: " + what)
                             for v, what in ((tls_ca_file, "tls_ca_file"), (tls_cert_file, "tls_cert_file"),
                                             (tls_key_file, "tls_key_file"), (auth_token, "auth_token"),
                                             (tls_server_name, "tls_server_name"), (job_id, "job_id"))]
        (opts.tls_ca_file, opts.tls_cert_file, opts.tls_key_file,
         opts.auth_token, opts.tls_server_name, opts.job_id) = self._opt_strings
        addrs = (ctypes.c_char_p * len(shards))(*[_cstr(s, "connect: shard address") for s in shards])
        st = _lib.Status()
        handle = self._lib.fps_client_create(addrs, len(shards), ctypes.byref(opts),
                                             ctypes.byref(st))
        if not handle:
            raise error_for(st.code or 3, st.message.decode(errors="replace") or
                            "fps_client_create failed", st.shard)
        self._handle = handle

    # -- plumbing -------------------------------------------------------

    def _enter(self, exclusive=False):
        """Counts a call in flight; exclusive calls (create, discover, close)
        wait until no other call is in flight and keep new ones out, which is
        what client.h requires of them."""
        with self._cv:
            while self._exclusive or (exclusive and self._inflight):
                self._cv.wait()
            if self._closed:
                raise FailedPreconditionError("client is closed")
            self._inflight += 1
            if exclusive:
                self._exclusive = True
            return self._handle

    def _leave(self, exclusive=False):
        with self._cv:
            self._inflight -= 1
            if exclusive:
                self._exclusive = False
            self._cv.notify_all()

    def _call(self, fn, *args, exclusive=False):
        st = _lib.Status()
        h = self._enter(exclusive)
        try:
            rc = fn(h, *args, ctypes.byref(st))
        finally:
            self._leave(exclusive)
        if rc != 0:
            msg = st.message.decode(errors="replace") or f"{fn.__name__} failed"
            raise error_for(rc, msg, st.shard)

    def _shape_of(self, name, h):
        """The shape the library will read `name` with, asked from the
        library itself (its tensor list is what counts)."""
        ndim = ctypes.c_uint32()
        dims = (ctypes.c_uint64 * _lib.MAX_DIMS)()
        if self._lib.fps_client_tensor_shape(h, _cstr(name, "tensor name"), ctypes.byref(ndim), dims) == 0:
            return tuple(int(dims[i]) for i in range(ndim.value))
        raise NotFoundError(f"tensor '{name}' is not in this client's tensor list "
                            "(call create() first)")

    @staticmethod
    def _items(mapping, what):
        if mapping is None:
            return []
        if hasattr(mapping, "items"):
            return list(mapping.items())
        try:
            return [(n, v) for n, v in mapping]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{what}: expected a dict or (name, array) pairs")

    # -- API --------------------------------------------------------------

    @property
    def shard_count(self):
        return len(self.shards)

    def create(self, tensors):
        """Registers the job's full tensor list (idempotent; see client.h).

        `tensors`: TensorSpec objects, or dicts with the same keys. Every
        worker must pass the same names, shapes and optimizer configs (the
        placement is computed from this list). Tensors with `init` get those
        initial values unless another worker's values were there first;
        tensors without wait (up to the deadline) for another worker's.
        Replaces any earlier tensor list of this client.
        """
        specs = []
        for t in tensors:
            if isinstance(t, dict):
                t = TensorSpec(**t)
            elif not isinstance(t, TensorSpec):
                t = TensorSpec(*t)
            specs.append(t)
        if not specs:
            raise InvalidArgumentError("create: empty tensor list")
        defs = (_lib.TensorDef * len(specs))()
        keep = []
        shapes = OrderedDict()
        for d, t in zip(defs, specs):
            if not isinstance(t.name, str) or not t.name:
                raise InvalidArgumentError(f"create: tensor name must be a non-empty str, "
                                           f"got {t.name!r}")
            if t.name in shapes:
                raise InvalidArgumentError(f"create: tensor '{t.name}' listed twice")
            shape = _shape_tuple(t.shape, f"tensor '{t.name}'")
            shapes[t.name] = shape
            name = _cstr(t.name, "create: tensor name")
            keep.append(name)
            d.name = name
            d.ndim = len(shape)
            for i, s in enumerate(shape):
                d.shape[i] = s
            _fill_optim(d.optim, t.optimizer, t.name)
            if t.init is not None:
                buf = _In(t.init, t.name, shape, "init")
                keep.append(buf)
                d.init = buf.ptr
            if t.step or t.state or t.replace:
                keep += self._fill_resume(d, t, shape)
        # If the call fails, C's tensor list is unknown: allow no push until
        # a create succeeds, rather than validate against stale shapes. (The
        # list is swapped, never emptied while the call runs: other threads'
        # calls read it.)
        try:
            self._call(self._lib.fps_client_create_tensors, defs, len(specs), exclusive=True)
        except BaseException:
            self._shapes = OrderedDict()
            raise
        self._shapes = shapes
        self._has_mom = {t.name: (t.optimizer or {}).get("flavor") == "hf"
                         and (t.optimizer or {}).get("beta1") is not None for t in specs}

    @staticmethod
    def _fill_resume(d, t, shape):
        """Sets the resume/replace fields of one fps_tensor_def_t; returns the
        buffers to keep alive."""
        keep = []
        step = _uint(t.step or 0, f"tensor '{t.name}': step", 64)
        if (t.state or t.replace) and t.init is None:
            raise InvalidArgumentError(f"tensor '{t.name}': a state or replace needs init values")
        state = dict(t.state or {})
        bad = set(state) - set(STATE_KINDS)
        if bad:
            raise InvalidArgumentError(f"tensor '{t.name}': unknown state kind(s) {sorted(bad)} "
                                       f"(expected {STATE_KINDS})")
        if step and t.init is not None:
            want = state_sizes(shape, "mom" in state)
            if set(state) != set(want):
                raise InvalidArgumentError(
                    f"tensor '{t.name}' of shape {shape}: state must hold {sorted(want)}, "
                    f"got {sorted(state)}")
            for kind, n in want.items():
                buf = _In(np.asarray(state[kind], np.float32).reshape(-1)
                          if not _is_torch(state[kind]) else state[kind].reshape(-1),
                          t.name, (n,), f"state {kind}")
                keep.append(buf)
                setattr(d, "state_" + kind, buf.ptr)
        elif state:
            raise InvalidArgumentError(f"tensor '{t.name}': state without a step > 0")
        d.step = step
        d.rms = float(t.rms or 0.0)
        d.replace = int(bool(t.replace))
        return keep

    def tensors(self):
        """{name: shape} of the tensor list from the last successful create()."""
        return dict(self._shapes)

    def shard_of(self, name):
        """The shard index `name` is placed on (the library's placement), or -1."""
        h = self._enter()
        try:
            return self._lib.fps_client_shard_of(h, _cstr(name, "tensor name"))
        finally:
            self._leave()

    def blocks(self, name):
        """The row blocks `name` is placed in, [(shard, row_lo, row_hi), ...]
        in row order (rows of its [..., R, C] view; elements for ndim <= 1):
        one block of all its rows for a whole tensor, several for a split
        one. NotFoundError if it is not in the tensor list."""
        fn = self._lib.fps_client_tensor_blocks
        h = self._enter()
        try:
            n = fn(h, _cstr(name, "tensor name"), None, 0)
            if n < 0:
                raise NotFoundError(f"tensor '{name}' is not in this client's tensor list")
            arr = (_lib.Block * n)()
            fn(h, _cstr(name, "tensor name"), arr, n)
        finally:
            self._leave()
        return [(int(b.shard), int(b.row_lo), int(b.row_hi)) for b in arr]

    def discover(self):
        """Replaces the tensor list with the tensors the shards hold, so that a
        tool that did not create them can pull them by name (pull(names),
        get_state(names)). Returns how many. tensors() and the name-less
        defaults of pull() and get_state() list what create() registered,
        which is nothing after discover()."""
        fn = self._lib.fps_client_discover
        found = ctypes.c_size_t()
        self._shapes = OrderedDict()
        self._has_mom = {}
        self._call(fn, ctypes.byref(found), exclusive=True)
        return int(found.value)

    def holds(self, names):
        """The subset of `names` that the shards hold now, as {name: shape}
        (one Stats exchange). Leaves this client without a tensor list: call
        create() next."""
        self.discover()
        h = self._enter()
        try:
            out = OrderedDict()
            for name in names:
                try:
                    out[name] = self._shape_of(name, h)
                except NotFoundError:
                    pass
            return out
        finally:
            self._leave()

    def tensor_stats(self, name, log=0):
        """Per-tensor figures of `name` (shape, version, ready, factored,
        flavor, sizes, optimizer state and AdamW's for comparison) as a dict,
        with its last `log` applied updates under "apply_log" (oldest first:
        dicts of worker_id, step, version, and the lr and weight_decay
        applied)."""
        fn = self._lib.fps_client_tensor_stats
        ts = _lib.TensorStats()
        cap = max(0, int(log))
        recs = (_lib.ApplyRecord * max(cap, 1))()
        got = ctypes.c_size_t()
        self._call(fn, _cstr(name, "tensor name"), ctypes.byref(ts), recs if cap else None, cap,
                   ctypes.byref(got))
        d = {}
        for field, _ in _lib.TensorStats._fields_:
            v = getattr(ts, field)
            if isinstance(v, bytes):
                v = v.decode(errors="replace")
            d[field] = v
        d["shape"] = tuple(int(ts.shape[i]) for i in range(ts.ndim))
        d["flavor"] = {1: "torch", 2: "hf"}.get(ts.flavor, ts.flavor)
        d["apply_log"] = [{f: getattr(r, f) for f, _ in _lib.ApplyRecord._fields_}
                          for r in recs[:got.value]]
        return d

    def push_pull(self, grads, *, step=None, out=None, worker_id=None, want_params=True,
                  num_workers=None, expect_mode=None, settings=None, push_id=None):
        """Pushes gradients and returns (params, versions).

        `grads`: {name: array} (or (name, array) pairs) with each tensor's
        full shape. `step`: this worker's completed pushes before this one
        (default: the client's own counter, `self.step`, advanced after every
        successful push). `out`: optional {name: array/tensor} to write the
        fresh params into (may be the grads themselves); missing names get
        new numpy arrays. With want_params=False no params are returned
        (versions only). On error an Error is raised, `self.step` does not
        advance, and outputs may be partly written (some shards may have
        applied the step: pull() tells where each tensor stands).

        As fps_client_push_pull_ex: `num_workers` (the job's worker
        count; the shards refuse a mismatch at once), `expect_mode` ("sync",
        "async", "ssp": refused if the shards run another), and `settings`
        {name: {"lr": float, "weight_decay": float, "no_grad": bool, "step":
        int, "skip_step": bool}}: this update's lr / weight decay, no
        gradient this step (the grad may then be None: no update, no decay),
        this tensor's step if it differs from `step`, this worker skips the
        step (with no_grad; sync: the round applies nothing for anyone).
        `push_id`: the push's idempotency key (1..2^64-1; default: a fresh
        one). Pass the key of a push that raised (DEADLINE_EXCEEDED,
        CANCELLED: its outcome unknown) with the same grads to retry it: the
        shards apply it at most once.
        """
        items = self._items(grads, "push_pull grads")
        if not items:
            raise InvalidArgumentError("push_pull: no gradients")
        out = dict(self._items(out, "push_pull out"))
        settings = dict(settings or {})
        pushed = {name for name, _ in items}
        for what, keys in (("settings", settings), ("out", out)):
            stray = sorted(str(k) for k in keys if k not in pushed)
            if stray:
                # A typo would otherwise apply the defaults (settings) or
                # drop the values (out) without a word.
                raise InvalidArgumentError(f"push_pull: {what} names tensor(s) {stray} this call "
                                           f"does not push")
        for name, s_ in settings.items():
            if not isinstance(s_, dict):
                raise InvalidArgumentError(f"tensor '{name}': settings must be a dict, not {s_!r}")
        if expect_mode not in MODES:
            raise InvalidArgumentError(f"push_pull: expect_mode must be one of "
                                       f"{sorted(m for m in MODES if m)} or None, not "
                                       f"{expect_mode!r}")
        if push_id is not None:
            push_id = _uint(push_id, "push_pull: push_id", 64, lo=1)
        extended = (bool(settings) or num_workers is not None or expect_mode is not None or
                    push_id is not None)
        fn_ex = self._lib.fps_client_push_pull_ex if extended else None
        n = len(items)
        names = (ctypes.c_char_p * n)()
        gptr = (_lib.c_float_p * n)()
        pptr = (_lib.c_float_p * n)()
        versions = (ctypes.c_uint64 * n)()
        per = (_lib.TensorPush * n)() if extended else None
        keep, outs = [], []
        step = _uint(self.step if step is None else step, "push_pull: step", 64)
        wid = _uint(self.worker_id if worker_id is None else worker_id, "push_pull: worker_id", 32)
        if num_workers is not None:
            num_workers = _uint(num_workers, "push_pull: num_workers", 32)
        st = _lib.Status()
        h = self._enter()
        try:
            for i, (name, g) in enumerate(items):
                shape = self._shape_of(name, h)
                bname = _cstr(name, "tensor name")
                keep.append(bname)
                names[i] = bname
                s = settings.get(name) or {}
                no_grad = bool(s.get("no_grad"))
                if extended:
                    self._fill_push(per[i], name, s)
                if g is None:
                    if not no_grad:
                        raise InvalidArgumentError(f"tensor '{name}': gradient is None "
                                                   "(set no_grad in its settings)")
                else:
                    gin = _In(g, name, shape, "gradient")
                    keep.append(gin)
                    gptr[i] = gin.ptr
                if want_params:
                    o = _Out(out.get(name), name, shape)
                    outs.append((name, o))
                    pptr[i] = o.ptr
            if extended:
                args = _lib.PushArgs()
                args.worker_id = wid
                args.num_workers = int(num_workers or 0)
                args.step = int(step)
                args.expect_mode = MODES[expect_mode]
                args.push_id = int(push_id or 0)
                rc = fn_ex(h, ctypes.byref(args), names, gptr, per, pptr, versions, n,
                           ctypes.byref(st))
            else:
                rc = self._lib.fps_client_push_pull(h, wid, int(step), names, gptr, pptr,
                                                    versions, n, ctypes.byref(st))
        finally:
            self._leave()
        if rc != 0:
            raise error_for(rc, st.message.decode(errors="replace"), st.shard)
        self.step = int(step) + 1
        params = OrderedDict()
        for name, o in outs:
            o.finish()
            params[name] = o.result
        return params, OrderedDict((name, int(versions[i])) for i, (name, _) in enumerate(items))

    @staticmethod
    def _fill_push(p, name, s):
        bad = set(s) - {"lr", "weight_decay", "no_grad", "step", "skip_step"}
        if bad:
            raise InvalidArgumentError(f"tensor '{name}': unknown push setting(s) {sorted(bad)}")
        for key in ("lr", "weight_decay"):
            v = s.get(key)
            if v is None:
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"tensor '{name}': bad {key} {v!r}")
            setattr(p, "has_" + key, 1)
            setattr(p, key, v)
        p.no_grad = int(bool(s.get("no_grad")))
        p.skip_step = int(bool(s.get("skip_step")))
        if s.get("step") is not None:
            p.has_step = 1
            p.step = _uint(s["step"], f"tensor '{name}': settings step", 64)

    def get_state(self, names=None):
        """Reads the Adafactor state of `names` (default: every tensor of the
        last create()) from their shards: {name: {"version", "step", "rms",
        "lr", "weight_decay", "row", "col", "var", "mom"}}, the arrays flat
        float32 in the layouts of `state_sizes()` (None for kinds the tensor
        does not have). Each tensor is read at one version."""
        fn = self._lib.fps_client_get_state
        if names is None:
            names = list(self._shapes)
        elif isinstance(names, str):
            names = [names]
        names = list(names)
        if not names:
            return OrderedDict()
        n = len(names)
        cnames = (ctypes.c_char_p * n)()
        infos = (_lib.TensorState * n)()
        ptrs = {k: (_lib.c_float_p * n)() for k in STATE_KINDS}
        arrays = {k: [None] * n for k in STATE_KINDS}
        keep = []
        h = self._enter()
        try:
            unknown = False
            for i, name in enumerate(names):
                shape = self._shape_of(name, h)
                b = _cstr(name, "tensor name")
                keep.append(b)
                cnames[i] = b
                has_mom = self._has_mom.get(name)
                if has_mom is None:
                    unknown = True
                    continue
                for kind, size in state_sizes(shape, has_mom).items():
                    a = np.empty(size, np.float32)
                    arrays[kind][i] = a
                    ptrs[kind][i] = a.ctypes.data_as(_lib.c_float_p)
        finally:
            self._leave()
        if unknown:
            # Sizes first (NULL arrays), then the data.
            self._call(fn, cnames, n, infos, None, None, None, None)
            for i in range(n):
                for kind in STATE_KINDS:
                    size = int(getattr(infos[i], kind + "_elements"))
                    if size:
                        a = np.empty(size, np.float32)
                        arrays[kind][i] = a
                        ptrs[kind][i] = a.ctypes.data_as(_lib.c_float_p)
        self._call(fn, cnames, n, infos, ptrs["row"], ptrs["col"], ptrs["var"], ptrs["mom"])
        out = OrderedDict()
        for i, name in enumerate(names):
            info = infos[i]
            d = {"version": int(info.version), "step": int(info.step), "rms": float(info.rms),
                 "lr": float(info.lr), "weight_decay": float(info.weight_decay)}
            for kind in STATE_KINDS:
                a = arrays[kind][i]
                got = int(getattr(info, kind + "_elements"))
                if a is not None and got != a.size:
                    raise InvalidArgumentError(
                        f"tensor '{name}': the shard reports {got} {kind} state elements, "
                        f"expected {a.size}")
                d[kind] = a
            out[name] = d
        return out

    def pull(self, names=None, *, out=None, want_params=True):
        """Reads current values: returns (params, versions) for `names`
        (default: every tensor of the last create()). `out` as in push_pull;
        want_params=False reads versions only."""
        if names is None:
            names = list(self._shapes)
        elif isinstance(names, str):
            names = [names]
        names = list(names)
        if not names:
            raise InvalidArgumentError("pull: no tensor names")
        out = dict(self._items(out, "pull out"))
        n = len(names)
        cnames = (ctypes.c_char_p * n)()
        pptr = (_lib.c_float_p * n)()
        versions = (ctypes.c_uint64 * n)()
        keep, outs = [], []
        st = _lib.Status()
        h = self._enter()
        try:
            for i, name in enumerate(names):
                shape = self._shape_of(name, h)
                b = _cstr(name, "tensor name")
                keep.append(b)
                cnames[i] = b
                if want_params:
                    o = _Out(out.get(name), name, shape)
                    outs.append((name, o))
                    pptr[i] = o.ptr
            rc = self._lib.fps_client_pull(h, cnames, pptr, versions, n, ctypes.byref(st))
        finally:
            self._leave()
        if rc != 0:
            raise error_for(rc, st.message.decode(errors="replace"), st.shard)
        params = OrderedDict()
        for name, o in outs:
            o.finish()
            params[name] = o.result
        return params, OrderedDict((name, int(versions[i])) for i, name in enumerate(names))

    def stats(self):
        """One dict per shard (index = shard id) with the fields of the wire
        contract's ShardStats: sizes, optimizer-state elements/bytes and what
        AdamW would need, push counts, latency quantiles, uptime."""
        n = self.shard_count
        arr = (_lib.ShardStats * n)()
        self._call(self._lib.fps_client_stats, arr, n)
        out = []
        for s in arr:
            d = {}
            for field, _ in _lib.ShardStats._fields_:
                v = getattr(s, field)
                d[field] = v.decode(errors="replace") if isinstance(v, bytes) else v
            out.append(d)
        return out

    def checkpoint(self):
        """Asks every shard to write a durable checkpoint now (into its
        --checkpoint-dir) and returns one dict per shard: path, sequence,
        bytes, tensors, seconds. Raises like every call (FAILED_PRECONDITION
        if a shard has no --checkpoint-dir)."""
        n = self.shard_count
        arr = (_lib.CheckpointInfo * n)()
        self._call(self._lib.fps_client_checkpoint, arr, n)
        return [{"path": a.path.decode(errors="replace"), "sequence": a.sequence, "bytes": a.bytes,
                 "tensors": a.tensors, "seconds": a.seconds} for a in arr]

    def close(self):
        """Waits for calls in flight, then frees the connection. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                self._cv.wait()
            handle, self._handle = self._handle, None
        self._lib.fps_client_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not getattr(self, "_closed", True) and getattr(self, "_handle", None):
                self.close()
        except Exception:
            pass


def placement_plan(tensors, shard_count, split_min_bytes=0):
    """Where libfactorps places `tensors` ({name: shape} or (name, shape)
    pairs) on `shard_count` shards, without a network: the map every worker
    computes (fps_client_placement_plan). Returns ({name: [(shard, row_lo,
    row_hi), ...]}, [bytes per shard]): a tensor's blocks in row order, rows
    of its [..., R, C] view (elements for ndim <= 1); a whole tensor has one
    block of all its rows."""
    lib = _lib.load()
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    n, S = len(items), int(shard_count)
    if S < 1:
        raise InvalidArgumentError(f"placement_plan: shard_count must be >= 1, got {shard_count}")
    defs = (_lib.TensorDef * max(n, 1))()
    keep = []
    for i, (name, shape) in enumerate(items):
        shape = _shape_tuple(shape, f"tensor '{name}'")
        b = _cstr(name, "tensor name")
        keep.append(b)
        defs[i].name = b
        defs[i].ndim = len(shape)
        for d, v in enumerate(shape):
            defs[i].shape[d] = v
    st = _lib.Status()
    got = ctypes.c_size_t()
    cap = n * S + 1
    blocks = (_lib.Block * cap)()
    shard_bytes = (ctypes.c_uint64 * S)()
    rc = lib.fps_client_placement_plan(defs, n, S, int(split_min_bytes), blocks, cap,
                                       ctypes.byref(got), shard_bytes, ctypes.byref(st))
    if rc:
        raise error_for(rc, st.message.decode(errors="replace"), st.shard)
    out = OrderedDict((str(name), []) for name, _ in items)
    for b in blocks[:got.value]:
        out[str(items[b.tensor][0])].append((int(b.shard), int(b.row_lo), int(b.row_hi)))
    return out, [int(x) for x in shard_bytes]


def connect(shards, **options):
    """Connects to a factorps job: `shards` is a list of "host:port" (shard i
    at index i) or one comma-separated string. Options: worker_id (default
    0), deadline (seconds per call, 60), max_retries (on UNAVAILABLE, 5),
    backoff (first retry delay, 0.1 s), max_message_bytes (4 MiB),
    tls_ca_file (PEM CA: TLS), tls_cert_file + tls_key_file (PEM: mutual
    TLS), auth_token (bearer token), tls_server_name (the name the shards'
    certificates carry, when not the address's host), wire_dtype ("f32",
    the default, or "bf16": push_pull sends gradients rounded to bf16 and
    receives the parameters as bf16, half the bytes each way; arrays stay
    float32 and the shards keep fp32 weights; pull() stays exact fp32),
    split_min_bytes (0, the default: never; otherwise every tensor of at
    least that many bytes is cut into row blocks over several shards, which
    then exchange partial sums each step so the update stays the unsplit
    one; needs every shard started with --peers, in --mode sync; see
    SPLIT_MIN_BYTES_DEFAULT and the README's "Split tensors"),
    push_chunk_bytes (None: libfactorps' default, 8 MiB; each push goes to
    each shard as concurrent calls over chunks of its tensors of at least
    this many bytes of fp32 gradient, in bf16 too, so parameters flow back
    while gradients still flow up; 0: one call per shard; docs/client.md),
    job_id (None; the job's identity, 1..64 bytes of [A-Za-z0-9._:-], the
    same for every worker of a job: a shard serving another job, e.g. one
    that restored another job's checkpoint, refuses create() with
    FailedPreconditionError naming both).
    Connection is lazy: an unreachable shard fails the first call; a failed
    TLS handshake raises UnavailableError, a missing or wrong token
    UnauthenticatedError."""
    return Client(shards, **options)

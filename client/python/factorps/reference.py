"""A small, readable reference Adafactor in numpy (float64 math, float32 storage).

This is the optimizer the shards run, written once more in the plainest
possible form so that the Python tests can check a shard's results without
trusting the C kernels: torch 1.13 (Debian's) has no torch.optim.Adafactor.
It follows tests/vectors/README.md line by line and is checked against the
golden vectors there (tests/python/test_reference.py).

Like upstream, params and optimizer state are stored as float32 after every
step; the arithmetic in between is float64, so any difference from a shard is
the shard's float32 rounding, not ours.

    ref = ReferenceAdafactor(shape, flavor="torch", lr=1e-2)
    param = ref.step(param, grad)   # float32 arrays in, float32 array out
    param = ref.step(param, grad, lr=5e-3, weight_decay=0.01)  # this step's values (schedules)
"""

import math

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)

# Upstream defaults, in the wire contract's names (AdafactorConfig): torch's
# beta2_decay/d and hf's decay_rate/clip_threshold share beta2_decay and
# clip_threshold there.
TORCH_DEFAULTS = dict(lr=1e-2, beta2_decay=-0.8, eps1=None, eps2=1e-3, d=1.0,
                      weight_decay=0.0, maximize=False)
HF_DEFAULTS = dict(lr=None, eps1=1e-30, eps2=1e-3, clip_threshold=1.0, decay_rate=-0.8,
                   beta1=None, weight_decay=0.0, scale_parameter=True, relative_step=True,
                   warmup_init=False)


def _rms(x):
    return math.sqrt(float(np.mean(np.square(x)))) if x.size else 0.0


def state_elements(shape, flavor="torch", beta1=None):
    """Optimizer-state elements Adafactor keeps for a tensor (no step/RMS scalars)."""
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape, dtype=np.int64))
    if len(shape) >= 2:
        n = int(np.prod(shape[:-2], dtype=np.int64)) * (shape[-2] + shape[-1])
    else:
        n = numel
    if flavor == "hf" and beta1 is not None:
        n += numel
    return n


def adamw_state_elements(shape):
    """What AdamW keeps for the same tensor: exp_avg and exp_avg_sq."""
    return 2 * int(np.prod(tuple(shape), dtype=np.int64))


class ReferenceAdafactor:
    """Adafactor for one tensor of a fixed shape, in one flavor ("torch" or "hf").

    Hyperparameters use the upstream names of the flavor (torch: lr,
    beta2_decay, eps1, eps2, d, weight_decay, maximize; hf: lr, eps1, eps2,
    clip_threshold, decay_rate, beta1, weight_decay, scale_parameter,
    relative_step, warmup_init). Unknown names are an error.
    """

    def __init__(self, shape, flavor="torch", **hparams):
        if flavor not in ("torch", "hf"):
            raise ValueError(f"unknown flavor {flavor!r} (expected 'torch' or 'hf')")
        defaults = TORCH_DEFAULTS if flavor == "torch" else HF_DEFAULTS
        unknown = set(hparams) - set(defaults)
        if unknown:
            raise TypeError(f"{flavor} Adafactor has no hyperparameter(s) {sorted(unknown)}")
        self.flavor = flavor
        self.hp = dict(defaults, **hparams)
        if flavor == "torch" and self.hp["eps1"] is None:
            self.hp["eps1"] = FLOAT32_EPS
        if flavor == "hf":
            if self.hp["lr"] is not None and self.hp["relative_step"]:
                raise ValueError("hf Adafactor: cannot combine a manual lr with relative_step=True")
            if self.hp["warmup_init"] and not self.hp["relative_step"]:
                raise ValueError("hf Adafactor: warmup_init=True requires relative_step=True")
            if self.hp["lr"] is None and not self.hp["relative_step"]:
                raise ValueError("hf Adafactor: lr is required when relative_step=False")
        self.shape = tuple(int(s) for s in shape)
        self.factored = len(self.shape) >= 2
        self.step_count = 0
        self.rms = 0.0  # hf's RMS state: RMS(param) before the last step
        lead = self.shape[:-2]
        # Canonical flat layouts of tests/vectors: row = lead*R, col = lead*C.
        if self.factored:
            self.row = np.zeros(lead + (self.shape[-2],), np.float32)
            self.col = np.zeros(lead + (self.shape[-1],), np.float32)
            self.var = None
        else:
            self.row = self.col = None
            self.var = np.zeros(self.shape, np.float32)
        self.mom = None
        if flavor == "hf" and self.hp["beta1"] is not None:
            self.mom = np.zeros(self.shape, np.float32)

    def step(self, param, grad, lr=None, weight_decay=None):
        """Returns the param (float32, same shape) after one step with `grad`.

        `lr` / `weight_decay` (optional) replace the constructor's values for
        this step and the following ones, as a learning-rate scheduler writing
        a param group does (hf with relative_step=True ignores `lr`, as
        transformers does)."""
        if lr is not None:
            if not (math.isfinite(lr) and lr >= 0.0):
                raise ValueError(f"lr must be finite and >= 0, got {lr}")
            if not (self.flavor == "hf" and self.hp["relative_step"]):
                self.hp["lr"] = float(lr)
        if weight_decay is not None:
            if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
                raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
            self.hp["weight_decay"] = float(weight_decay)
        param = np.asarray(param, np.float32)
        grad = np.asarray(grad, np.float32)
        if param.shape != self.shape or grad.shape != self.shape:
            raise ValueError(f"shape mismatch: tensor {self.shape}, param {param.shape}, "
                             f"grad {grad.shape}")
        p = param.astype(np.float64)
        g = grad.astype(np.float64)
        if self.flavor == "torch":
            p = self._torch(p, g)
        else:
            p = self._hf(p, g)
        return p.astype(np.float32)

    def _torch(self, p, g):
        hp = self.hp
        if hp["maximize"]:
            g = -g
        # The step counter is a float32 tensor upstream.
        self.step_count = float(np.float32(self.step_count + 1))
        t = self.step_count
        w = t ** hp["beta2_decay"]
        rho = min(hp["lr"], 1.0 / math.sqrt(t))
        alpha = max(hp["eps2"], _rms(p)) * rho  # RMS before weight decay
        if hp["weight_decay"] != 0.0:
            p = p * (1.0 - hp["lr"] * hp["weight_decay"])
        g2 = g * g
        eps1 = hp["eps1"]
        if self.factored:
            row = self.row.astype(np.float64)
            col = self.col.astype(np.float64)
            row = row + w * (g2.mean(axis=-1) - row)
            col = col + w * (g2.mean(axis=-2) - col)
            self.row = row.astype(np.float32)
            self.col = col.astype(np.float32)
            row, col = self.row.astype(np.float64), self.col.astype(np.float64)
            # The clamp is at eps1 (not eps1**2), as upstream.
            mean_row = np.maximum(row.mean(axis=-1), eps1)
            v = row[..., :, None] * col[..., None, :] / mean_row[..., None, None]
        else:
            var = self.var.astype(np.float64)
            var = var + w * (g2 - var)
            self.var = var.astype(np.float32)
            v = self.var.astype(np.float64)
        u = g / np.sqrt(np.maximum(v, eps1 * eps1))
        denom = max(1.0, _rms(u) / hp["d"])
        return p - (alpha / denom) * u

    def _hf(self, p, g):
        hp = self.hp
        self.step_count += 1
        t = self.step_count
        rms = _rms(p)
        self.rms = rms
        if hp["relative_step"]:
            rel = min(1e-6 * t if hp["warmup_init"] else 1e-2, 1.0 / math.sqrt(t))
        else:
            rel = hp["lr"]
        lr_t = rel * (max(hp["eps2"], rms) if hp["scale_parameter"] else 1.0)
        b2 = 1.0 - t ** hp["decay_rate"]
        sq = g * g + hp["eps1"]  # eps added before averaging, as upstream
        if self.factored:
            row = b2 * self.row.astype(np.float64) + (1.0 - b2) * sq.mean(axis=-1)
            col = b2 * self.col.astype(np.float64) + (1.0 - b2) * sq.mean(axis=-2)
            self.row = row.astype(np.float32)
            self.col = col.astype(np.float32)
            row, col = self.row.astype(np.float64), self.col.astype(np.float64)
            r = 1.0 / np.sqrt(row / row.mean(axis=-1, keepdims=True))
            c = 1.0 / np.sqrt(col)
            u = r[..., :, None] * c[..., None, :] * g
        else:
            v = b2 * self.var.astype(np.float64) + (1.0 - b2) * sq
            self.var = v.astype(np.float32)
            u = g / np.sqrt(self.var.astype(np.float64))
        u = u / max(_rms(u) / hp["clip_threshold"], 1.0)
        u = u * lr_t
        if self.mom is not None:
            m = hp["beta1"] * self.mom.astype(np.float64) + (1.0 - hp["beta1"]) * u
            self.mom = m.astype(np.float32)
            u = self.mom.astype(np.float64)
        if hp["weight_decay"] != 0.0:
            p = p + p * (-hp["weight_decay"] * lr_t)
        return p - u

    def state_arrays(self):
        """The final state as flat float32 arrays, named as in tests/vectors."""
        out = {}
        for key in ("row", "col", "var", "mom"):
            a = getattr(self, key)
            if a is not None:
                out[key] = a.reshape(-1)
        return out

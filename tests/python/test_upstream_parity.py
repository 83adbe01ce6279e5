"""Parity with the upstream optimizers themselves, through real shards.

RemoteAdafactor runs beside torch.optim.Adafactor (foreach=False and
foreach=True), RemoteHFAdafactor beside transformers.optimization.Adafactor,
each pair fed the same gradients for STEPS steps under the same lr
scheduler, over a 1-D, a 2-D and a 3-D parameter. After every step the
parameters are compared, at the end the optimizer state, name by name
(`optimizer.state[p]` keys and shapes must be upstream's), with the
metrics and tolerances of tests/vectors (its check_vectors.compare_case
does the comparing):
  param scaled   max|remote-upstream| / max(max|upstream|, its last update) <= 1e-5
  param upd-rel  max|remote-upstream| / its last update                   <= 1e-3
                 (on steps whose update is >= 1e-3 max|upstream|)
  state rel      second moments, relative with a floor of 1e-6 max       <= 1e-4
  mom scaled     hf's exp_avg, max|diff| / max|upstream|                  <= 1e-5
and `step` equal. bf16 parameters (torch flavor): the shards keep fp32
master weights where upstream updates the bf16 tensor itself, so the same
tolerances apply against upstream running on an fp32 copy with the bf16
epsilon (torch.finfo(bfloat16).eps, what eps1=None means for a bf16
parameter), and the bf16 parameter must be that master rounded to bf16;
the distance to upstream's all-bf16 run is reported beside it.

Needs PyTorch >= 2.5 (torch.optim.Adafactor) and transformers: under
Debian's torch 1.13 every case skips (tests/allowed-skips.txt); the torch2
run (scripts/venv.sh) has both. FPS_PARITY_TABLE=FILE writes the results
as the markdown table of docs/pytorch.md.
"""

import math
import os
import sys
import unittest

import numpy as np
import torch

import _support
from _support import Shards, need_server
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

sys.path.insert(0, os.path.join(_support.REPO, "tests", "vectors"))
from check_vectors import compare_case  # noqa: E402  (the golden vectors' metrics)

try:
    from transformers.optimization import Adafactor as HFAdafactor
except ImportError:
    HFAdafactor = None
UPSTREAM = hasattr(torch.optim, "Adafactor") and HFAdafactor is not None
WHY = (f"torch {torch.__version__}" + ("" if hasattr(torch.optim, "Adafactor") else
                                       " has no torch.optim.Adafactor")
       + ("" if HFAdafactor is not None else ", no transformers"))

STEPS = 60
WARMUP = 10
SHAPES = {"v": (7,), "m": (6, 5), "t": (2, 4, 3)}
PTOL, UTOL, STOL = 1e-5, 1e-3, 1e-4  # tests/vectors/README.md


def schedule(step):
    """Linear warmup, then cosine decay to 10%: every step's lr differs."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    frac = (step - WARMUP) / (STEPS - WARMUP)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


# Option sets: (name, keyword arguments as upstream takes them).
TORCH_SETS = [
    ("defaults", {}),
    ("lr=1e-3", {"lr": 1e-3}),
    ("lr=1, wd=0.01", {"lr": 1.0, "weight_decay": 0.01}),
    ("weight_decay=0.1", {"weight_decay": 0.1}),
    ("beta2_decay=-0.5", {"beta2_decay": -0.5}),
    ("eps=(1e-6, 1e-2)", {"eps": (1e-6, 1e-2)}),
    ("eps=(None, 0.1)", {"eps": (None, 0.1)}),
    ("d=2", {"d": 2.0}),
    ("d=1.5, maximize", {"d": 1.5, "maximize": True}),
]
HF_SETS = [
    ("defaults (relative_step)", {}),
    ("warmup_init", {"warmup_init": True}),
    ("beta1=0.9", {"beta1": 0.9}),
    ("Trainer: lr=1e-3, no scale, no rel", {"lr": 1e-3, "scale_parameter": False,
                                            "relative_step": False}),
    ("lr=1e-2, beta1, wd=0.01, no rel", {"lr": 1e-2, "beta1": 0.9, "weight_decay": 0.01,
                                         "relative_step": False}),
    ("clip_threshold=0.5, decay_rate=-0.5", {"clip_threshold": 0.5, "decay_rate": -0.5}),
    ("eps=(1e-20, 1e-2), no scale", {"eps": (1e-20, 1e-2), "scale_parameter": False}),
    ("weight_decay=0.1, warmup_init", {"weight_decay": 0.1, "warmup_init": True}),
]

# Upstream state name -> the vectors' state kind.
KINDS = {"row_var": "row", "col_var": "col", "variance": "var", "exp_avg_sq_row": "row",
         "exp_avg_sq_col": "col", "exp_avg_sq": "var", "exp_avg": "mom"}

_results = []  # rows of the parity table


def _init(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return {n: (0.5 * torch.randn(s, generator=g)).to(dtype) for n, s in SHAPES.items()}


def _grads(seed, dtype):
    """STEPS gradients per tensor; their scale varies between steps and
    rows, and two steps are spikes (x50), so the clip and the factored
    estimate both matter."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(STEPS):
        scale = 50.0 if t in (17, 41) else 0.3 + (t % 5) * 0.2
        out.append({n: (scale * torch.randn(s, generator=g)
                        * torch.linspace(0.2, 2.0, s[0]).reshape((-1,) + (1,) * (len(s) - 1)))
                    .to(dtype) for n, s in SHAPES.items()})
    return out


def _scheduler(opt):
    """LambdaLR(schedule), or transformers' AdafactorSchedule for an hf
    optimizer with relative_step (it has no lr to schedule: the proxy
    reports the one Adafactor computed, through _get_lr and the state)."""
    if opt.param_groups[0].get("relative_step"):
        from transformers.optimization import AdafactorSchedule
        return AdafactorSchedule(opt)
    return torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def _run(opt, params, grads, lrs=None):
    """Trains `params` with `opt` under its scheduler; returns every step's
    params (float64 numpy, step 0 = the initial values). Appends the lr the
    scheduler reports after each step to `lrs`."""
    sched = _scheduler(opt)
    traj = [{n: p.detach().double().numpy().copy() for n, p in params.items()}]
    for grads_t in grads:
        for n, p in params.items():
            p.grad = grads_t[n].clone()
        opt.step()
        sched.step()
        if lrs is not None:
            lrs.append(sched.get_last_lr()[0])
        traj.append({n: p.detach().double().numpy().copy() for n, p in params.items()})
    return traj


def _state(opt, params):
    """{name: {state key: value}} of `opt` (float64 numpy arrays, step a float)."""
    out = {}
    for n, p in params.items():
        st = opt.state[p]
        out[n] = {k: (float(v) if k == "step" else
                      torch.as_tensor(v).detach().double().numpy().copy())
                  for k, v in st.items()}
    return out


def _compare(test, what, remote, upstream, r_state, u_state):
    """Runs check_vectors' metrics on every tensor; returns the worst of each."""
    worst = {"param_scaled": 0.0, "param_upd_rel": 0.0, "state_rel": 0.0, "mom_scaled": 0.0,
             "resolved": 0, "mom": False}
    for n in SHAPES:
        test.assertEqual(sorted(r_state[n]), sorted(u_state[n]), f"{what}: {n}: state names")
        test.assertEqual(r_state[n]["step"], u_state[n]["step"], f"{what}: {n}: step")
        data = {}
        for t, (r, u) in enumerate(zip(remote, upstream)):
            data[f"p{t}"] = (r[n].reshape(-1), u[n].reshape(-1))
        files = {"param_init": "p0", "params": [f"p{t}" for t in range(1, len(remote))],
                 "state": {}}
        shapes = {}
        for key, kind in KINDS.items():
            if key in u_state[n]:
                test.assertEqual(r_state[n][key].shape, u_state[n][key].shape,
                                 f"{what}: {n}: state {key} shape")
                data[kind] = (r_state[n][key].reshape(-1), u_state[n][key].reshape(-1))
                files["state"][kind] = kind
                shapes[kind] = list(u_state[n][key].shape)
        case = {"shape": list(SHAPES[n]), "files": files, "state_shapes_upstream": shapes}
        met, fails = compare_case(case, None, None, PTOL, UTOL, STOL, True,
                                  load_ref=lambda rel, k: data[rel][1],
                                  load_impl=lambda rel, k: data[rel][0])
        if "RMS" in u_state[n]:  # hf: the RMS of the param before the last step
            r, u = float(r_state[n]["RMS"]), float(u_state[n]["RMS"])
            rel = abs(r - u) / max(abs(u), 1e-30)
            met["state_rel"] = max(met["state_rel"], rel)
            if rel > STOL:
                fails.append(f"state RMS: rel err {rel:.3e} > {STOL:g}")
        test.assertEqual(fails, [], f"{what}: tensor {n} ({SHAPES[n]})")
        for k in ("param_scaled", "param_upd_rel", "state_rel", "mom_scaled"):
            worst[k] = max(worst[k], met[k])
        # Steps whose update the upd-rel metric resolves (as compare_case).
        worst["resolved"] += sum(
            float(np.max(np.abs(b[1] - a[1]))) >= 1e-3 * float(np.max(np.abs(b[1])))
            for a, b in zip([data[f"p{t}"] for t in range(len(remote) - 1)],
                            [data[f"p{t}"] for t in range(1, len(remote))]))
        worst["mom"] = worst["mom"] or "mom" in data
    return worst


def _row(flavor, name, worst, extra=""):
    _results.append((flavor, name, worst, extra))


@need_server
@unittest.skipUnless(UPSTREAM, f"needs torch.optim.Adafactor and transformers ({WHY})")
class UpstreamParity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.shards = Shards(2, mode="sync", workers=1)

    @classmethod
    def tearDownClass(cls):
        cls.shards.close()
        table = os.environ.get("FPS_PARITY_TABLE")
        if table and _results:
            with open(table, "w") as f:
                f.write(format_table())

    def remote(self, cls, params, ns, **kw):
        opt = cls(list(params.items()), shards=self.shards.addrs, namespace=ns + "/",
                  deadline=30, **kw)
        self.addCleanup(opt.close)
        return opt

    def test_torch_fp32(self):
        for i, (name, kw) in enumerate(TORCH_SETS):
            with self.subTest(options=name):
                init, grads = _init(10 + i, torch.float32), _grads(100 + i, torch.float32)
                mine = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                opt = self.remote(RemoteAdafactor, mine, f"torch{i}", **kw)
                remote = _run(opt, mine, grads)
                r_state = _state(opt, mine)
                for foreach in (False, True):
                    theirs = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                    up = torch.optim.Adafactor(list(theirs.values()), foreach=foreach, **kw)
                    upstream = _run(up, theirs, grads)
                    worst = _compare(self, f"{name} foreach={foreach}", remote, upstream,
                                     r_state, _state(up, theirs))
                    _row("torch", f"{name}, foreach={foreach}", worst)

    def test_torch_bf16(self):
        # eps1=None is the bf16 epsilon upstream; the shards' fp32 master
        # follows upstream's update run in fp32 from the same values.
        bf16_eps = torch.finfo(torch.bfloat16).eps
        for i, (name, kw) in enumerate([("defaults", {}), ("lr=1, wd=0.01, maximize",
                                                          {"lr": 1.0, "weight_decay": 0.01,
                                                           "maximize": True})]):
            with self.subTest(options=name):
                init, grads = _init(50 + i, torch.bfloat16), _grads(150 + i, torch.bfloat16)
                mine = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                opt = self.remote(RemoteAdafactor, mine, f"bf16_{i}", **kw)
                sched = _scheduler(opt)
                names = opt.param_names()
                remote = [{n: v.double().numpy() for n, v in init.items()}]
                for grads_t in grads:
                    for n, p in mine.items():
                        p.grad = grads_t[n].clone()
                    opt.step()
                    sched.step()
                    master, _ = opt.client.pull(names)
                    step = {n: master[f"bf16_{i}/{n}"].astype(np.float64) for n in mine}
                    for n, p in mine.items():  # the parameter is the master, rounded
                        want = torch.from_numpy(master[f"bf16_{i}/{n}"]).to(torch.bfloat16)
                        self.assertTrue(torch.equal(p.detach(), want), f"{name}: {n}")
                    remote.append(step)
                r_state = _state(opt, mine)
                fp32kw = dict(kw, eps=(bf16_eps, 1e-3))
                for foreach in (False, True):
                    theirs = {n: torch.nn.Parameter(v.float()) for n, v in init.items()}
                    up = torch.optim.Adafactor(list(theirs.values()), foreach=foreach, **fp32kw)
                    upstream = _run(up, theirs, [{n: g.float() for n, g in gt.items()}
                                                 for gt in grads])
                    worst = _compare(self, f"bf16 {name} foreach={foreach}", remote, upstream,
                                     r_state, _state(up, theirs))
                    # Upstream on the bf16 tensors themselves (bf16 math and state).
                    pure = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                    upb = torch.optim.Adafactor(list(pure.values()), foreach=foreach, **kw)
                    pure_traj = _run(upb, pure, grads)
                    mine_end = {n: p.detach().double().numpy() for n, p in mine.items()}
                    dist = max(float(np.max(np.abs(mine_end[n] - pure_traj[-1][n])))
                               / float(np.max(np.abs(pure_traj[-1][n]))) for n in SHAPES)
                    _row("torch", f"bf16 params: {name}, foreach={foreach}", worst,
                         f"{dist:.1e}")

    def test_hf(self):
        for i, (name, kw) in enumerate(HF_SETS):
            with self.subTest(options=name):
                init, grads = _init(70 + i, torch.float32), _grads(170 + i, torch.float32)
                mine = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                opt = self.remote(RemoteHFAdafactor, mine, f"hf{i}", **kw)
                r_lrs, u_lrs = [], []
                remote = _run(opt, mine, grads, r_lrs)
                theirs = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
                up = HFAdafactor(list(theirs.values()), **kw)
                upstream = _run(up, theirs, grads, u_lrs)
                # The scheduler reports the same lr (AdafactorSchedule: the
                # first parameter's, from its step and RMS).
                np.testing.assert_allclose(r_lrs, u_lrs, rtol=STOL, atol=0, err_msg=name)
                worst = _compare(self, name, remote, upstream, _state(opt, mine),
                                 _state(up, theirs))
                _row("hf", name, worst)


def format_table():
    """One markdown table per flavor, as docs/pytorch.md shows them."""
    out = []
    for flavor, title in (("torch", "`RemoteAdafactor` against `torch.optim.Adafactor`"),
                          ("hf", "`RemoteHFAdafactor` against transformers' `Adafactor`")):
        rows = sorted((r for r in _results if r[0] == flavor),
                      key=lambda r: r[1].startswith("bf16"))
        if not rows:
            continue
        last = "bf16: to all-bf16 upstream" if flavor == "torch" else f"momentum (<= {PTOL:g})"
        out += [f"{title}, worst over the 3 parameters and {STEPS} steps:", "",
                f"| options | steps | param scaled (<= {PTOL:g}) | param upd-rel (<= {UTOL:g}) "
                f"| state rel (<= {STOL:g}) | {last} |", "|---" * 6 + "|"]
        for _, name, w, extra in rows:
            # No step resolved: every update was below 1e-3 max|param| (warmup_init).
            upd = f"{w['param_upd_rel']:.1e}" if w["resolved"] else "-"
            if flavor == "hf":
                extra = f"{w['mom_scaled']:.1e}" if w["mom"] else "-"
            out.append(f"| {name} | {STEPS} | {w['param_scaled']:.1e} | {upd} | "
                       f"{w['state_rel']:.1e} | {extra or '-'} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    unittest.main()

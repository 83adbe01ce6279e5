"""One torchrun worker of test_torch_overlap's AMP jobs (not a test itself).

    python -m torch.distributed.run --nproc_per_node 2 ... amp_worker.py \
        --shards A,B --steps N --bad STEP --out DIR

Two phases on sync shards, each _torch_support.Net in DistributedDataParallel
(gloo, CPU, several buckets) with factorps.torch.attach and float16 autocast:
"scaler": a GradScaler given to attach(); at step --bad rank 1's gradient of
w1 (the first layer: DDP's last bucket) is Inf. "nan": no scaler; at step
--bad rank 1's loss is NaN. Writes DIR/rank<R>.pt: per phase and step
whether step() said skipped, the parameters after every step, the scales,
the versions.
"""

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _support  # noqa: E402,F401  (puts client/python on sys.path)
from _torch_support import Net, batch  # noqa: E402
from factorps.torch import RemoteAdafactor, attach  # noqa: E402


def phase(a, rank, name):
    model = Net()
    opt = RemoteAdafactor(model.named_parameters(), shards=a.shards, namespace=name + "/",
                          deadline=20)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if name == "scaler" else None
    handle = attach(ddp, opt, grad_scaler=scaler) if scaler is not None else attach(ddp, opt)
    out = {"skipped": [], "params": [], "scales": [], "active": handle.active}
    for step in range(a.steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        bad = rank == 1 and step == a.bad
        hook = model.w1.register_hook(lambda g: g * float("inf")) if bad and scaler else None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        if bad and scaler is None:
            loss = loss * float("nan")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            out["scales"].append(float(scaler.get_scale()))
        else:
            loss.backward()
            opt.step()
        if hook is not None:
            hook.remove()
        out["skipped"].append(opt.last_step_skipped)
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    out["versions"] = dict(opt._versions)
    opt.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bad", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    try:
        result["scaler"] = phase(a, rank, "scaler")
        gc.collect()  # the first phase's GradScaler is gone: attach() looks for live ones
        dist.barrier()
        result["nan"] = phase(a, rank, "nan")
        dist.barrier()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()
    torch.save(result, os.path.join(a.out, f"rank{rank}.pt"))
    if "error" not in result:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

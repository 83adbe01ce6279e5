"""One torchrun worker of test_torch_overlap's DDP jobs (not a test itself).

    python -m torch.distributed.run --nproc_per_node 2 ... ddp_worker.py \
        --shards A,B --variant hook|hookview|nohook --steps N --out DIR [--mode async]

Trains _torch_support.Net wrapped in DistributedDataParallel (gloo, CPU) with
RemoteAdafactor in sync (or async) mode, each rank on its own batches, and writes
DIR/rank<R>.pt: the final parameters, whether every step's .grad after
backward was exactly this rank's local gradient (an all-reduce would have
averaged it with the other rank's), DDP's own record of the comm hook, and,
on rank 0, the shards' bytes_received before and after the steps.
"""

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _support  # noqa: E402,F401  (puts client/python on sys.path)
from _torch_support import Net, batch  # noqa: E402
from factorps.torch import RemoteAdafactor, attach  # noqa: E402


def bytes_received(opt):
    return sum(int(s["bytes_received"]) for s in opt.client.stats())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--variant", choices=("hook", "hookview", "nohook"), required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    try:
        model = Net()
        opt = RemoteAdafactor(model.named_parameters(), shards=a.shards, mode=a.mode,
                              deadline=20)
        # A tiny bucket cap: several buckets, so several pushes per step.
        # hookview: .grad is a view of DDP's buckets (the setting the docs
        # recommend with the hook: no copies into the buckets and back).
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=1e-4, gradient_as_bucket_view=a.variant == "hookview")
        if a.variant != "nohook":
            attach(ddp, opt)
            # Create the tensors (worker 0's initial values travel once)
            # before counting the bytes the steps move.
            opt.setup()
        before = bytes_received(opt) if rank == 0 else None
        dist.barrier()  # no push before rank 0 has counted
        local_ok = []
        for step in range(a.steps):
            x, y = batch(rank, step)
            # This rank's own gradient, from the same weights, without DDP.
            loss = torch.nn.functional.mse_loss(model(x), y)
            local = torch.autograd.grad(loss, list(model.parameters()))
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            local_ok.append(all(torch.equal(p.grad, g)
                                for p, g in zip(model.parameters(), local)))
            opt.step()
        dist.barrier()
        result.update(params={n: p.detach().clone() for n, p in model.named_parameters()},
                      local_ok=local_ok, versions=dict(opt._versions))
        if rank == 0:
            result.update(bytes_before=before, bytes_after=bytes_received(opt))
        if hasattr(ddp, "_get_ddp_logging_data"):
            result["comm_hook"] = ddp._get_ddp_logging_data().get("comm_hook")
        opt.close()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()
    torch.save(result, os.path.join(a.out, f"rank{rank}.pt"))
    # No barrier or destroy on failure: the other rank may be stuck in a
    # collective; torchrun ends the group when both processes exit.
    if "error" not in result:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Overlap of the pushes with backward (factorps.torch.attach), measured.

    FACTORPS_LIB=build/client/libfactorps.so /work/venv2/bin/python \\
        tests/bench/ddp_overlap.py [--build build] [--layers 20] [--width 1000] \\
        [--batch 64] [--steps 4] [--reps 5] [--no-ddp] [--link-gbit R]

Two sync shards and a 2-worker torchrun job (gloo on loopback, one thread
per worker) train an MLP of `layers` Linear(width, width) layers (20 x 1000
x 1000: 20M parameters, 80 MB of fp32 gradients per worker and step) under
DistributedDataParallel with attach() (--no-ddp: two plain worker
processes with the per-parameter gradient hooks). Each rep runs, back to
back in the same processes, `steps` steps of three kinds, in rotating
order so that the machine's load falls on all of them alike:

  compute   forward + backward inside no_sync(): no communication at all
  serial    the same, then step() pushes everything (step()-only pushes,
            what a job without attach() does): its step() alone is `comm`
  overlap   forward + backward with the hooks pushing buckets as they
            fill, then step() waits for the replies

and prints the medians over reps of rank 0's mean step time per kind, with
overlap / max(compute, comm) (the target is <= 1.2) and overlap / serial.
The first step of each kind in each rep is a warm-up and not counted. Not a
test: no assertion. The load average is printed before and after.

--link-gbit R (root): the shards run in one network namespace and the
workers in another, joined by a veth pair shaped to R Gbit/s each way
(tests/bench/link_bench.py's Link: addresses it assigns inside the two
namespaces it creates and deletes), so that communication waits for a
link instead of competing for the CPU with compute.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "tests"))

KINDS = ("compute", "serial", "overlap")


def worker(a):
    import torch
    import torch.distributed as dist
    from factorps.torch import RemoteAdafactor, attach

    torch.set_num_threads(1)
    if a.ddp:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
    opt = RemoteAdafactor(model.named_parameters(), shards=a.shards, mode="sync",
                          worker_id=rank, num_workers=2, deadline=120)
    net = torch.nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=a.bucket_view) if a.ddp else model
    handle = attach(net, opt)
    opt.setup()
    no_sync = net.no_sync if a.ddp else handle.no_sync
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, a.width, generator=g)

    def one(kind):
        """One step of `kind`: (total seconds, step() seconds, CPU seconds of
        this process, its push threads included)."""
        opt.zero_grad()
        c0 = time.process_time()
        t0 = time.perf_counter()
        if kind == "overlap":
            net(x).square().mean().backward()
        else:
            with no_sync():
                net(x).square().mean().backward()
        t1 = time.perf_counter()
        if kind != "compute":
            opt.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, time.process_time() - c0

    out = []
    for rep in range(a.reps):
        order = KINDS[rep % 3:] + KINDS[:rep % 3]
        row = {}
        for kind in order:
            one(kind)  # warm-up
            if a.ddp:
                dist.barrier()
            if a.profile and rank == 0 and rep == a.reps - 1:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    times = [one(kind) for _ in range(a.steps)]
                print(f"== rank 0, {kind}, {a.steps} steps: torch.profiler, by self CPU time")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            else:
                times = [one(kind) for _ in range(a.steps)]
            row[kind] = statistics.mean(t for t, _, _ in times)
            row[kind + "_cpu"] = statistics.mean(c for _, _, c in times)
            if kind == "serial":
                row["comm"] = statistics.mean(s for _, s, _ in times)
        out.append(row)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    opt.close()
    if a.ddp:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-ddp", dest="ddp", action="store_false")
    ap.add_argument("--link-gbit", type=float, default=0.0)
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True): .grad is a view of DDP's buckets")
    ap.add_argument("--profile", action="store_true",
                    help="rank 0's last rep of each kind under torch.profiler (printed)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    import fpsproc
    link = None
    if a.link_gbit:
        sys.path.insert(0, HERE)
        import link_bench
        link = link_bench.Link(os.getpid(), a.link_gbit, 0, None, tempfile.mkdtemp())
        link_bench.Link.delete_stale()
        try:
            link.open()
        except BaseException:
            link.close()
            raise
    os.environ.setdefault("FACTORPS_LIB", os.path.join(a.build, "client", "libfactorps.so"))
    server = os.path.join(a.build, "server", "factorps-server")
    load0 = os.getloadavg()
    where = {} if link is None else dict(prefix=link_bench.ns_exec(link.ns_s),
                                         listen=link_bench.ADDR_S + ":0")
    shards = []
    try:
        for i in range(2):
            shards.append(fpsproc.ShardProcess(
                ["--shard-id", str(i), "--shard-count", "2", "--mode", "sync", "--workers", "2",
                 "--deadline", "120"], server=server, name=f"shard{i}", die_with_parent=True,
                **where))
    except BaseException:
        for s in shards:
            s.kill()
        if link is not None:
            link.close()
        raise
    tmp = tempfile.mkdtemp(prefix="fps-overlap-")
    out = os.path.join(tmp, "rank0.json")
    port = fpsproc.free_ports(1)[0]
    script = [os.path.abspath(__file__), "--worker", "--shards",
              ",".join(s.addr for s in shards), "--out", out, "--layers", str(a.layers),
              "--width", str(a.width), "--batch", str(a.batch), "--steps", str(a.steps),
              "--reps", str(a.reps)] + ([] if a.ddp else ["--no-ddp"]) + (
                  ["--bucket-view"] if a.bucket_view else []) + (
                  ["--profile"] if a.profile else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    inside = [] if link is None else link_bench.ns_exec(link.ns_w)
    shard_cpu_start = [_cpu_seconds(s.proc.pid) for s in shards]
    try:
        if a.ddp:
            procs = [subprocess.Popen(inside + [sys.executable, "-m", "torch.distributed.run",
                                       "--nnodes", "1", "--nproc_per_node", "2",
                                       "--master_addr", "127.0.0.1", "--master_port", str(port)]
                                      + script, env=env)]
        else:
            procs = [subprocess.Popen(inside + [sys.executable] + script,
                                      env=dict(env, RANK=str(r), WORLD_SIZE="2"))
                     for r in range(2)]
        for p in procs:
            if p.wait(timeout=3600) != 0:
                sys.exit(f"worker exited with {p.returncode}")
        with open(out) as f:
            rows = json.load(f)
        shard_cpu_end = [_cpu_seconds(s.proc.pid) for s in shards]
    finally:
        for s in shards:
            s.kill()
            s.remove()
        if link is not None:
            link.close()
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    shard_cpu = sum(shard_cpu_end) - sum(shard_cpu_start)
    med = {k: statistics.median(r[k] for r in rows) for k in KINDS + ("comm",)}
    bound = max(med["compute"], med["comm"])
    params = a.layers * (a.width * a.width + a.width)
    print(f"{'DDP comm hook' if a.ddp else 'gradient hooks'}: {params / 1e6:.1f}M parameters, "
          f"batch {a.batch}, 2 workers, 2 sync shards, {a.reps} reps x {a.steps} steps")
    print(f"load average before {load0[0]:.1f}, after {load1[0]:.1f} (1 min)"
          + ("" if link is None else f"; shards across a {a.link_gbit:g} Gbit/s veth link"))
    print("| rep | compute s | comm s | serial s | overlap s | overlap / max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['compute']:.3f} | {r['comm']:.3f} | {r['serial']:.3f} | "
              f"{r['overlap']:.3f} | {r['overlap'] / max(r['compute'], r['comm']):.2f} |")
    print(f"| median | {med['compute']:.3f} | {med['comm']:.3f} | {med['serial']:.3f} | "
          f"{med['overlap']:.3f} | {med['overlap'] / bound:.2f} |")
    print(f"overlap / max(compute, comm) = {med['overlap'] / bound:.2f} (target <= 1.2); "
          f"overlap / serial = {med['overlap'] / med['serial']:.2f}")
    # What the step costs in CPU, against the cores there are: compute and
    # communication are both CPU work here (backward; the push's copies and
    # gRPC; the shards' decoding and Adafactor), so on a machine without an
    # idle core they cannot overlap, whatever the order of the work.
    cpu = {k: statistics.median(r[k + "_cpu"] for r in rows) for k in KINDS}
    pushed_steps = 2 * a.reps * (a.steps + 1)  # serial + overlap steps, warm-ups included
    shard_per_step = shard_cpu / pushed_steps
    need = 2 * cpu["serial"] + shard_per_step
    print(f"CPU per step (medians): worker compute {cpu['compute']:.3f} s, worker compute + "
          f"push {cpu['serial']:.3f} s (overlap: {cpu['overlap']:.3f} s), both shards "
          f"{shard_per_step:.3f} s; 2 workers + "
          f"shards need {need:.3f} CPU-s per step: {need / os.cpu_count():.3f} s on "
          f"{os.cpu_count()} idle cores")


def _cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()

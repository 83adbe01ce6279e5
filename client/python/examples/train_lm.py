#!/usr/bin/env python3
"""One data-parallel worker training a byte-level transformer language model through factorps.

scripts/demo.sh starts the shards and W of these workers (default 2); by hand:

    /usr/bin/python3 train_lm.py --shards 127.0.0.1:7000,127.0.0.1:7001 \\
        --worker-id 0 --workers 2 --out /tmp/lm

The text is the Python standard library's own source (the top-level *.py
files of the running interpreter's library directory, e.g.
/usr/lib/python3.11/, which every machine with python3 has; nothing is
downloaded), read as bytes: every 20th file (sorted by name) is held out,
the rest is cut into W contiguous parts, one per worker. Each step a worker
takes `--batch` random windows of `--context` bytes from its own part.

The model is a small decoder-only transformer (pre-norm blocks: RMSNorm,
causal multi-head attention, RMSNorm, 4x MLP with GELU; learned positions;
the output layer tied to the byte embedding; no biases), trained with

    opt = RemoteAdafactor(model.named_parameters(), lr=..., shards=...,
                          worker_id=..., num_workers=...)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine)

against sync shards (every worker's gradient is averaged into each update;
each push carries the scheduler's current lr). Worker 0 shows one progress bar (steps, loss,
tokens/s, ETA), then evaluates the held-out loss, prints a sample of
generated text, the shards' state beside AdamW's, their push figures, and
writes the report (PNG + the plotted figures as JSON). It exits with status
3 if the held-out loss is not below --max-loss.
"""

import argparse
import glob
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package, when run from the source tree
sys.path.insert(0, HERE)

import factorps  # noqa: E402
import demo_report  # noqa: E402
from factorps.torch import RemoteAdafactor  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", required=True, help="comma-separated host:port of every shard")
    ap.add_argument("--metrics", default="",
                    help="comma-separated host:port of the shards' /metrics (worker 0 samples "
                         "them for the report)")
    ap.add_argument("--worker-id", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8, help="windows per worker per step")
    ap.add_argument("--context", type=int, default=128, help="bytes per window")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.03,
                    help="torch flavor: peak lr (relative to each tensor's RMS, capped at "
                         "1/sqrt(step))")
    ap.add_argument("--warmup", type=int, default=0, help="warmup steps (default: steps/10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds per call")
    ap.add_argument("--max-loss", type=float, default=2.3,
                    help="worker 0 exits with status 3 unless the held-out loss (nats per "
                         "byte) ends below this")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--sample-bytes", type=int, default=400)
    ap.add_argument("--out", required=True, help="directory for the workers' series and "
                                                 "the report")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG (the JSON still)")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ data

def corpus_files():
    lib = os.path.dirname(os.__file__)  # /usr/lib/python3.X
    files = sorted(glob.glob(os.path.join(lib, "*.py")))
    if len(files) < 40:
        raise SystemExit(f"train_lm: only {len(files)} .py files in {lib}")
    return lib, files


def load_data(worker_id, workers):
    """(this worker's training bytes, held-out bytes, total training bytes,
    the library directory)."""
    lib, files = corpus_files()
    held = [f for i, f in enumerate(files) if i % 20 == 0]
    train = [f for i, f in enumerate(files) if i % 20 != 0]

    def cat(fs):
        return np.frombuffer(b"".join(open(f, "rb").read() + b"\n" for f in fs), np.uint8)
    tr, te = cat(train), cat(held)
    part = np.array_split(tr, workers)[worker_id]
    return torch.from_numpy(part.astype(np.int64)), torch.from_numpy(te.astype(np.int64)), \
        len(tr), lib, len(train), len(held)


def windows(data, starts, ctx):
    idx = torch.as_tensor(starts).unsqueeze(1) + torch.arange(ctx + 1)
    w = data[idx]
    return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------ model

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteLM(nn.Module):
    def __init__(self, d, layers, heads, ctx):
        super().__init__()
        self.ctx = ctx
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.register_buffer("mask", torch.ones(ctx, ctx, dtype=torch.bool).triu(1),
                             persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                      "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, x):
        h = self.embed(x) + self.pos[:x.shape[1]]
        for blk in self.blocks:
            h = blk(h, self.mask)
        return self.norm(h) @ self.embed.weight.t()  # tied output layer

    @torch.no_grad()
    def generate(self, prompt, n, temperature=0.8, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.tensor(list(prompt), dtype=torch.long).unsqueeze(0)
        for _ in range(n):
            logits = self(x[:, -self.ctx:])[0, -1] / temperature
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
            x = torch.cat([x, nxt.view(1, 1)], 1)
        return bytes(x[0].tolist())


def warmup_cosine(warmup, steps, floor=0.1):
    """LambdaLR factor: linear warmup to 1, then cosine down to `floor`."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


@torch.no_grad()
def heldout_loss(model, data, n, ctx, seed=1234):
    model.eval()
    starts = np.random.default_rng(seed).integers(0, len(data) - ctx - 1, n)
    total = 0.0
    for i in range(0, n, 16):
        x, y = windows(data, starts[i:i + 16], ctx)
        total += F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1),
                                 reduction="sum").item()
    model.train()
    return total / (n * ctx)


def ngram_baselines(train, held):
    """Held-out loss of byte unigram and bigram counts (add-one) from the
    whole training text: what a model without longer context reaches."""
    tr, te = train.numpy(), held.numpy()
    uni = np.bincount(tr, minlength=256) + 1.0
    big = np.bincount(tr[:-1] * 256 + tr[1:], minlength=65536).reshape(256, 256) + 1.0
    return (float(-np.log(uni / uni.sum())[te].mean()),
            float(-np.log(big / big.sum(1, keepdims=True))[te[:-1], te[1:]].mean()))


def wait_for(paths, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.1)
    return False


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # workers share the machine with each other and the shards
    torch.manual_seed(args.seed)
    lead = args.worker_id == 0
    os.makedirs(args.out, exist_ok=True)
    data, held, n_train, lib, nf_train, nf_held = load_data(args.worker_id, args.workers)
    if lead:  # from the whole training text, not only worker 0's part
        uni, big = ngram_baselines(torch.cat([load_data(w, args.workers)[0]
                                              for w in range(args.workers)]), held)
    model = ByteLM(args.d_model, args.layers, args.heads, args.context)
    named = list(model.named_parameters())
    n_params = sum(p.numel() for _, p in named)

    warmup = args.warmup or max(1, args.steps // 10)
    opt = RemoteAdafactor(named, lr=args.lr, shards=args.shards.split(","),
                          worker_id=args.worker_id, num_workers=args.workers,
                          deadline=args.deadline)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, args.steps))
    lr_label = f"lr (LambdaLR: {warmup} warmup steps, then cosine to 10% of {args.lr:g})"
    opt.setup()  # every worker now holds worker 0's initial weights

    tokens_per_step = args.workers * args.batch * args.context
    if lead:
        print(f"lm: byte-level transformer, {args.layers} layers, d_model {args.d_model}, "
              f"{args.heads} heads, context {args.context}: {n_params:,} parameters\n"
              f"lm: text: {lib}/*.py, {nf_train} files ({n_train / 1e6:.2f} MB) in "
              f"{args.workers} parts, {nf_held} files ({len(held) / 1e6:.2f} MB) held out\n"
              f"lm: {args.steps} steps x {args.workers} workers x {args.batch} windows x "
              f"{args.context} bytes ({tokens_per_step:,} tokens per step), optimizer "
              f"RemoteAdafactor, {lr_label}", flush=True)
    addrs = [a for a in args.metrics.split(",") if a]
    sampler = demo_report.MetricsSampler(addrs) if lead and addrs else None
    rng = np.random.default_rng(args.seed * 1000 + args.worker_id)
    steps, losses, lrs = [], [], []
    bar = None
    if lead:
        tty = sys.stderr.isatty()
        bar = tqdm(total=args.steps, unit="step", desc="training", dynamic_ncols=True,
                   mininterval=0.5 if tty else 15, file=sys.stderr)
    if sampler:
        sampler.start()
    t0, c0 = time.monotonic(), time.process_time()
    ema = None
    for step in range(args.steps):
        lr_now = opt.param_groups[0]["lr"]  # what this step's push carries
        x, y = windows(data, rng.integers(0, len(data) - args.context - 1, args.batch),
                       args.context)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        lv = loss.item()
        steps.append(step + 1)
        losses.append(round(lv, 5))
        lrs.append(lr_now)
        if bar is not None:
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            el = time.monotonic() - t0
            bar.set_postfix_str(f"loss {ema:.3f}, {tokens_per_step * (step + 1) / el:,.0f} tok/s",
                                refresh=False)
            bar.update(1)
    train_seconds = time.monotonic() - t0
    cpu_seconds = time.process_time() - c0
    if bar is not None:
        bar.close()
    with open(os.path.join(args.out, f"worker-{args.worker_id}.json.tmp"), "w") as f:
        json.dump(dict(step=steps, loss=losses, lr=lrs, seconds=train_seconds,
                       cpu_seconds=cpu_seconds), f)
    os.rename(os.path.join(args.out, f"worker-{args.worker_id}.json.tmp"),
              os.path.join(args.out, f"worker-{args.worker_id}.json"))
    if not lead:
        opt.close()
        return 0

    if sampler:
        sampler.stop()
    hl = heldout_loss(model, held, args.eval_windows, args.context)
    first = losses[0]
    print(f"\nheld-out loss {hl:.3f} nats per byte ({hl / math.log(2):.2f} bits; the first "
          f"training batch: {first:.3f}; uniform bytes {math.log(256):.3f}, byte unigram counts "
          f"{uni:.3f}, bigram counts {big:.3f}) after "
          f"{args.steps} steps, {train_seconds:.1f} s of training "
          f"({tokens_per_step * args.steps / train_seconds:,.0f} tokens/s; worker 0 used "
          f"{cpu_seconds:.1f} CPU-seconds)")
    prompt = b"def "
    sample = model.generate(prompt, args.sample_bytes, seed=args.seed)
    print("\nsample (prompt 'def ', temperature 0.8):\n" + "-" * 72)
    print(sample.decode("utf-8", "replace"))
    print("-" * 72 + "\n")

    stats = opt.client.stats()
    rows = demo_report.print_state_table(stats)
    print()
    demo_report.print_push_table(stats, train_seconds)

    paths = [os.path.join(args.out, f"worker-{w}.json") for w in range(args.workers)]
    if not wait_for(paths, 60):
        print("train_lm: the other workers' series did not arrive", file=sys.stderr)
        return 1
    workers = {}
    for w, p in enumerate(paths):
        with open(p) as f:
            workers[str(w)] = json.load(f)
    data_out = dict(
        title=(f"factorps: byte-level transformer ({n_params:,} parameters) on the Python "
               f"standard library, {args.workers} workers, {len(stats)} sync shards, "
               f"RemoteAdafactor"),
        workers=workers, lr_label=lr_label,
        heldout=dict(step=[args.steps], loss=[round(hl, 5)]), loss_bar=args.max_loss,
        state=rows, push=demo_report.series_from_samples(sampler.samples) if sampler else {},
        params=n_params, train_seconds=train_seconds,
        baselines=dict(unigram=round(uni, 4), bigram=round(big, 4)))
    png = os.path.join(args.out, "report.png")
    written = demo_report.write_report(png, data_out, plot=not args.no_plot)
    print(f"\nreport: {' and '.join(written)}")
    ok = hl < args.max_loss
    print(f"\nheld-out loss {hl:.3f} {'is below' if ok else 'is NOT below'} the bar "
          f"{args.max_loss:g} nats per byte; Adafactor state {rows[-1]['state']:,} elements "
          f"({demo_report.mb_str(rows[-1]['state_bytes'])}) against AdamW's "
          f"{rows[-1]['adamw']:,} ({demo_report.mb_str(rows[-1]['adamw_bytes'])}): "
          f"{rows[-1]['ratio']:.0f}x less", flush=True)
    opt.close()
    return 0 if ok else 3


if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        sys.exit(main())
    except factorps.Error as e:
        print(f"worker: {e}", file=sys.stderr)
        sys.exit(1)

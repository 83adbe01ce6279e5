"""What scripts/demo.sh shows: the shards' state table, push figures, the
metrics sampled while training runs, and the report image.

- state_rows(stats) / print_state_table(): each shard's Adafactor state
  (elements, MB) beside what AdamW would keep, and the total;
- MetricsSampler: a thread that scrapes every shard's /metrics once a
  second (PushPull latency histogram, payload bytes in and out);
- series_from_samples(): per shard and interval, p50/p90/p99 push latency
  (interpolated within the histogram's buckets, as Prometheus'
  histogram_quantile does) and MB/s in and out;
- write_report(): the plotted figures as JSON, and the PNG (matplotlib, Agg
  backend): loss per worker against steps with the learning rate, state per
  shard beside AdamW's (log scale), push latency percentiles and MB/s per
  shard over time.
"""

import json
import math
import os
import threading
import time
import urllib.request

import matplotlib

matplotlib.use("Agg")  # no display: render straight to the PNG
import matplotlib.pyplot as plt  # noqa: E402

# The report image's size in pixels (figsize x dpi); tests check it.
FIG_INCHES = (14, 9)
FIG_DPI = 100


def mb(n_bytes):
    return n_bytes / 1e6


def mb_str(n_bytes):
    """MB with 3 significant digits, so small states do not print as 0.000."""
    return f"{n_bytes / 1e6:.3g} MB"


def state_rows(stats):
    """One dict per shard and a 'total' one: tensors, params, Adafactor and
    AdamW state (elements, bytes) and the ratio."""
    rows = []
    for s in stats:
        rows.append(dict(shard=str(s["shard_id"]), tensors=s["tensors"],
                         params=s["param_elements"], state=s["state_elements"],
                         state_bytes=s["state_bytes"], adamw=s["adamw_elements"],
                         adamw_bytes=s["adamw_bytes"]))
    tot = dict(shard="total")
    for k in ("tensors", "params", "state", "state_bytes", "adamw", "adamw_bytes"):
        tot[k] = sum(r[k] for r in rows)
    rows.append(tot)
    for r in rows:
        r["ratio"] = r["adamw"] / max(r["state"], 1)
    return rows


def print_state_table(stats):
    rows = state_rows(stats)
    print("Optimizer state held by the shards (factored second moments), from Stats:")
    print(f"  {'shard':<6}{'tensors':>8}{'params':>12}   {'Adafactor state':>24}   "
          f"{'AdamW would keep':>26}   {'AdamW/Adafactor':>15}")
    for r in rows:
        print(f"  {r['shard']:<6}{r['tensors']:>8}{r['params']:>12,}   "
              f"{r['state']:>10,} el {mb_str(r['state_bytes']):>11}   "
              f"{r['adamw']:>12,} el {mb_str(r['adamw_bytes']):>11}   {r['ratio']:>14.0f}x")
    return rows


def print_push_table(stats, train_seconds):
    print(f"Pushes (gradients in, fresh parameters out), over {train_seconds:.1f} s of "
          "training:")
    print(f"  {'shard':<6}{'pushes':>8}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
          f"{'pushes/s':>10}{'in MB/s':>9}{'out MB/s':>9}{'kernel GB/s':>13}  simd")
    for s in stats:
        n = max(s["pushes"], 1)
        kernel = (s["update_bytes"] / s["update_seconds_sum"] / 1e9
                  if s["update_seconds_sum"] > 0 else 0.0)
        print(f"  {s['shard_id']:<6}{s['pushes']:>8}{s['push_errors']:>8}"
              f"{1e3 * s['push_seconds_p50']:>9.2f}{1e3 * s['push_seconds_p99']:>9.2f}"
              f"{1e3 * s['push_seconds_sum'] / n:>9.2f}"
              f"{s['pushes'] / train_seconds:>10.1f}"
              f"{mb(s['bytes_received']) / train_seconds:>9.1f}"
              f"{mb(s['bytes_sent']) / train_seconds:>9.1f}{kernel:>13.2f}  {s['simd']}")
    print("  (sync mode: a push's latency includes waiting for the slowest worker's gradient)")


# ------------------------------------------------------------ /metrics

def parse_metrics(text, method="PushPull"):
    """The PushPull latency histogram (cumulative counts by upper bound) and
    the payload byte counters from one /metrics scrape."""
    buckets, rx, tx = {}, 0.0, 0.0
    want = f'method="{method}"'
    for line in text.splitlines():
        if line.startswith("#") or want not in line:
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("factorps_rpc_duration_seconds_bucket"):
            le = name.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] = float(value)
        elif name.startswith("factorps_rpc_received_bytes_total"):
            rx = float(value)
        elif name.startswith("factorps_rpc_sent_bytes_total"):
            tx = float(value)
    return dict(buckets=sorted(buckets.items()), rx=rx, tx=tx)


class MetricsSampler(threading.Thread):
    """Scrapes each shard's /metrics every `interval` seconds until stop()."""

    def __init__(self, addrs, interval=1.0):
        super().__init__(daemon=True)
        self.addrs, self.interval = addrs, interval
        self.samples = {i: [] for i in range(len(addrs))}  # shard -> [(t, parsed)]
        self._stop_ev = threading.Event()
        self.t0 = time.monotonic()
        # Loopback only: never through an http_proxy from the environment.
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    def scrape(self):
        for i, a in enumerate(self.addrs):
            try:
                with self._open(f"http://{a}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue  # a missed scrape only widens one interval
            self.samples[i].append((time.monotonic() - self.t0, parse_metrics(text)))

    def run(self):
        self.scrape()
        while not self._stop_ev.wait(self.interval):
            self.scrape()

    def stop(self):
        self._stop_ev.set()
        self.join()
        self.scrape()  # the end of the run


def quantile(q, buckets):
    """histogram_quantile: q-quantile of cumulative (le, count) buckets,
    linear within a bucket; None if the histogram is empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo  # beyond the last finite bound: report that bound
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = le, count
    return lo


def series_from_samples(samples, max_points=120):
    """Per shard: interval midpoints (s), p50/p90/p99 push latency (ms) of
    the pushes that finished in each interval, and MB/s in and out. A long
    run's 1 s scrapes are grouped into longer intervals (at most max_points
    per shard); 'window' is how many scrapes one interval spans."""
    out = {}
    for shard, ss in samples.items():
        k = max(1, math.ceil((len(ss) - 1) / max_points))
        d = dict(window=k, t=[], p50_ms=[], p90_ms=[], p99_ms=[], in_mb_s=[], out_mb_s=[])
        for (t0, a), (t1, b) in zip(ss[::k], ss[k::k]):
            dt = t1 - t0
            if dt <= 0:
                continue
            prev = dict(a["buckets"])
            delta = [(le, c - prev.get(le, 0.0)) for le, c in b["buckets"]]
            qs = [quantile(q, delta) for q in (0.5, 0.9, 0.99)]
            if qs[0] is None:
                continue  # no push finished in this interval
            d["t"].append(round((t0 + t1) / 2, 3))
            for k, v in zip(("p50_ms", "p90_ms", "p99_ms"), qs):
                d[k].append(round(1e3 * v, 4))
            d["in_mb_s"].append(round(mb(b["rx"] - a["rx"]) / dt, 4))
            d["out_mb_s"].append(round(mb(b["tx"] - a["tx"]) / dt, 4))
        out[str(shard)] = d
    return out


# ------------------------------------------------------------ the report

def write_report(path_png, data, plot=True):
    """Writes data as JSON beside the PNG (same name, .json), then the PNG
    unless plot is False. data: title, workers ({id: {step, loss, lr}}),
    lr_label, heldout ({step, loss}), loss_bar, state (state_rows),
    push (series_from_samples). Returns the paths written."""
    path_json = os.path.splitext(path_png)[0] + ".json"
    with open(path_json, "w") as f:
        json.dump(data, f, indent=1)
    if not plot:
        return [path_json]
    fig, axes = plt.subplots(2, 2, figsize=FIG_INCHES, dpi=FIG_DPI)
    fig.suptitle(data["title"], fontsize=13)

    ax = axes[0][0]
    for wid, w in sorted(data["workers"].items()):
        ax.plot(w["step"], w["loss"], lw=0.8, alpha=0.85, label=f"worker {wid} (training batch)")
    h = data.get("heldout")
    if h:
        ax.plot(h["step"], h["loss"], "ko-", ms=5, lw=1.2, label="held-out")
    if data.get("loss_bar") is not None:
        ax.axhline(data["loss_bar"], color="red", ls=":", lw=1,
                   label=f"bar {data['loss_bar']:g}")
    for name, v in sorted((data.get("baselines") or {}).items()):
        ax.axhline(v, color="gray", ls="--", lw=0.8, label=f"byte {name} counts {v:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("Loss per worker, learning rate")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    w0 = data["workers"][sorted(data["workers"])[0]]
    ax2.plot(w0["step"], w0["lr"], color="tab:green", lw=1.5, ls="--", label=data["lr_label"])
    ax2.set_ylabel("learning rate", color="tab:green")
    ax2.set_ylim(0, max(w0["lr"]) * 1.15 if w0["lr"] else 1)
    l1, n1 = ax.get_legend_handles_labels()
    l2, n2 = ax2.get_legend_handles_labels()
    ax.legend(l1 + l2, n1 + n2, fontsize=8, loc="upper right")

    ax = axes[0][1]
    rows = data["state"]
    xs = range(len(rows))
    wdt = 0.38
    b1 = ax.bar([x - wdt / 2 for x in xs], [r["state"] for r in rows], wdt, label="Adafactor")
    b2 = ax.bar([x + wdt / 2 for x in xs], [r["adamw"] for r in rows], wdt, label="AdamW would keep")
    for bars, key in ((b1, "state_bytes"), (b2, "adamw_bytes")):
        for bar, r in zip(bars, rows):
            ax.annotate(mb_str(r[key]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"shard {r['shard']}\n{r['ratio']:.0f}x" if r["shard"] != "total"
                        else f"total\n{r['ratio']:.0f}x" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("optimizer state (fp32 elements, log scale)")
    ax.set_title("Optimizer state per shard: Adafactor beside AdamW")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1][0]
    styles = {"p50_ms": "-", "p90_ms": "--", "p99_ms": ":"}
    for i, (shard, s) in enumerate(sorted(data["push"].items())):
        for k, ls in styles.items():
            ax.plot(s["t"], s[k], ls, color=f"C{i}", lw=1.2,
                    label=f"shard {shard} {k[:3]}")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("PushPull latency (ms, log scale)")
    win = max([s.get("window", 1) for s in data["push"].values()] or [1])
    ax.set_title(f"Push latency percentiles per shard (from /metrics, per {win} s)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[1][1]
    for i, (shard, s) in enumerate(sorted(data["push"].items())):
        ax.plot(s["t"], s["in_mb_s"], "-", color=f"C{i}", lw=1.2,
                label=f"shard {shard} gradients in")
        ax.plot(s["t"], s["out_mb_s"], "--", color=f"C{i}", lw=1.2,
                label=f"shard {shard} parameters out")
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("MB/s")
    ax.set_title(f"Bytes per second per shard (per {win} s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)

    fig.tight_layout()
    fig.savefig(path_png)
    plt.close(fig)
    return [path_json, path_png]

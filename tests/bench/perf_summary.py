#!/usr/bin/python3
"""Summarises one factorps shard's `perf record` data: the top symbols and
the share of the samples that go to each part of the data path.

    /usr/bin/python3 tests/bench/perf_summary.py PERF_DATA [--top 15] [--perf /usr/bin/perf]
    /usr/bin/python3 tests/bench/perf_summary.py --report REPORT_TXT [--top 15]

PERF_DATA is run through `perf report --stdio --no-children --sort sym`;
--report reads the text of such a report instead (e.g. one made on another
machine).

The groups (percent of all the shard's samples, user and kernel):
  user-space copies     memmove/memcpy in the shard (the target:
                        at most one user pass per received gradient byte,
                        none per sent parameter byte)
  decode / sum kernels  the gradient check + convert + sync sum
                        (fps_dtype_*, sum_*, decode_f32, bf16_decode, add_f32, div_f32)
  bf16 encode           parameters encoded for bf16 replies
  Adafactor kernels     row_stats, row_scaled, var_update, row_u2_clamped,
                        apply_rowcol, apply_elem, finish_scalars
  kernel TCP copies     the kernel's copies between sockets and user memory
                        (_copy_to_iter, _copy_from_iter, copy_user_*, skb_copy_*, ...;
                        kernel memcpy too: in a shard that is almost all socket buffers)
  page faults, zeroing  first touches of fresh memory and its unmapping
                        (clear_page, *page_fault*, pte_offset_map*, zap_*, ...)
  other user / other kernel
Symbol names are matched by pattern; a symbol in no group counts as "other".
"""

import argparse
import re
import subprocess
import sys

# Order matters: the first group whose pattern matches a symbol takes it.
GROUPS = [
    ("user-space copies (memmove/memcpy)", ".", r"mem(move|cpy)"),
    ("decode / sum kernels", ".",
     r"^(fps_dtype_\w+|(sum_f32|sum_bf16|decode_f32|bf16_decode|add_f32|div_f32)_\w+)$"),
    ("bf16 encode", ".", r"^bf16_encode_\w+$"),
    ("Adafactor kernels", ".",
     r"^((row_stats|row_scaled|var_update|row_u2_clamped|apply_rowcol|apply_elem)_\w+"
     r"|finish_scalars|fps_adafactor\w*)$"),
    ("kernel TCP copies", "k",
     r"^(_copy_to_iter|_copy_from_iter|copy_page_(to|from)_iter|copy_user\w*|"
     r"rep_movs_alternative|skb_copy\w*|__skb_datagram_iter|simple_copy_to_iter|"
     r"csum_partial_copy\w*|__pi_memcpy|memcpy\w*)$"),
    ("page faults, zeroing", "k",
     r"(clear_page|page_fault|mm_fault|anonymous_page|clear_huge_page|folio_zero|"
     r"alloc_pages|get_page_from_freelist|pte_offset_map|^zap_|unmap_page)"),
]


def parse(report):
    """(samples, event name, [(percent, 'k' or '.', symbol)]) from `perf
    report --stdio`."""
    samples, event, rows = "?", "?", []
    for line in report.splitlines():
        m = re.match(r"# Samples: (\S+)\s+of event '([^']+)'", line)
        if m:
            samples, event = m.group(1), m.group(2)
            continue
        m = re.match(r"\s*([0-9.]+)%\s+\[([k.])\]\s+(.*\S)\s*$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3)))
    return samples, event, rows


def group_of(space, sym):
    for name, where, pat in GROUPS:  # where: "." user space, "k" kernel
        if where == space and re.search(pat, sym):
            return name
    return "other kernel" if space == "k" else "other user"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?")
    ap.add_argument("--report", help="the text of `perf report --stdio --no-children --sort sym`")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--perf", default="/usr/bin/perf")
    a = ap.parse_args()
    if (a.data is None) == (a.report is None):
        ap.error("give either PERF_DATA or --report REPORT_TXT")
    if a.report:
        with open(a.report) as f:
            text = f.read()
    else:
        out = subprocess.run([a.perf, "report", "-i", a.data, "--stdio", "--no-children",
                              "--sort", "sym", "--percent-limit", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        if out.returncode:
            raise SystemExit(f"perf_summary: perf report failed on {a.data} ({out.returncode})")
        text = out.stdout
    samples, event, rows = parse(text)
    if not rows:
        raise SystemExit(f"perf_summary: no samples in {a.report or a.data}")
    total = sum(p for p, _, _ in rows)  # ~100; kept to normalise rounding
    user = sum(p for p, s, _ in rows if s == ".")
    print(f"# {samples} samples of {event} in {len(rows)} symbols; user {100 * user / total:.1f}%, "
          f"kernel {100 * (total - user) / total:.1f}% of the shard's samples")
    print(f"\ntop {a.top} symbols (% of the shard's samples):")
    for p, s, sym in sorted(rows, reverse=True)[:a.top]:
        print(f"  {100 * p / total:6.2f}%  [{s}] {sym:<48} {group_of(s, sym)}")
    shares = {}
    for p, s, sym in rows:
        g = group_of(s, sym)
        shares[g] = shares.get(g, 0.0) + p
    print("\ngroups (% of the shard's samples):")
    for name in [g[0] for g in GROUPS] + ["other user", "other kernel"]:
        print(f"  {100 * shares.get(name, 0.0) / total:6.2f}%  {name}")


if __name__ == "__main__":
    sys.exit(main())

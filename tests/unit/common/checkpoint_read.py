#!/usr/bin/python3
"""Reads a factorps checkpoint with nothing but json, hashlib and numpy, and
writes one the C loader accepts: the format (common/checkpoint.h) is usable
without factorps.

With the CLI as a second argument, `factorps checkpoint verify` is run on
what Python wrote: ok as written, BAD (not finite) with a NaN weight whose
digests were recomputed, as the shard's loader refuses it.

Usage: checkpoint_read.py PATH/TO/ckpt_sample [PATH/TO/factorps]
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

KINDS = {"": 0, "/row": 1, "/col": 2, "/var": 3, "/mom": 4}
ZEROS = "0" * 64


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def read(path):
    """Returns (header dict, metadata dict, data bytes), checking both digests."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little")
        raw = f.read(n)
        data = f.read()
    if (8 + n) % 8:
        fail("data section not 8-byte aligned")
    header = json.loads(raw)
    meta = header.pop("__metadata__")
    if not all(isinstance(v, str) for v in meta.values()):
        fail("metadata values must all be strings (safetensors)")
    # Version 2 only for files that hold row blocks (checkpoint.h ROW BLOCKS).
    blocks = any("bounds" in json.loads(v) for k, v in meta.items() if k.startswith("tensor:"))
    if meta["format"] != "factorps.checkpoint" or meta["format_version"] != ("2" if blocks else "1"):
        fail("format: %r %r" % (meta["format"], meta["format_version"]))
    if hashlib.sha256(data).hexdigest() != meta["data_sha256"]:
        fail("data_sha256 does not match the data section")
    # header_sha256: the header with its own value zeroed.
    want = meta["header_sha256"]
    pat = ('"header_sha256":"%s"' % want).encode()
    if raw.count(pat) != 1:
        fail("header_sha256 not found exactly once")
    zeroed = raw.replace(pat, ('"header_sha256":"%s"' % ZEROS).encode())
    if hashlib.sha256(prefix + zeroed).hexdigest() != want:
        fail("header_sha256 does not match the header")
    return header, meta, data


def arrays(header, data):
    """Every stored array as numpy, keyed by its header key."""
    out = {}
    spans = []
    for key, e in header.items():
        if e["dtype"] != "F32":
            fail("%s: dtype %s" % (key, e["dtype"]))
        b, end = e["data_offsets"]
        a = np.frombuffer(data[b:end], dtype="<f4").reshape(e["shape"])
        out[key] = a
        spans.append((b, end))
    spans.sort()
    at = 0
    for b, end in spans:  # safetensors: arrays tile the data section
        if b != at:
            fail("gap or overlap at %d" % at)
        at = end
    if at != len(data):
        fail("arrays do not cover the data section")
    return out


def check_pattern(header, meta, data):
    names = [k[len("tensor:"):] for k in meta if k.startswith("tensor:")]
    if int(meta["tensor_count"]) != len(names):
        fail("tensor_count")
    arr = arrays(header, data)
    seen = set()
    for i, name in enumerate(names):
        tm = json.loads(meta["tensor:" + name])
        if int(tm["version"]) != 7 + i or int(tm["step"]) != 40 + i:
            fail("%s: version/step %s/%s" % (name, tm["version"], tm["step"]))
        if np.float32(float(tm["rms"])) != np.float32(0.25 * (i + 1)):
            fail("%s: rms %s" % (name, tm["rms"]))
        float(tm["lr"])  # every double parses as a Python float
        for suffix, k in KINDS.items():
            key = name + suffix
            if key not in arr:
                continue
            seen.add(key)
            a = arr[key].reshape(-1)
            want = np.float32(i * 1000 + k * 100) + np.arange(a.size, dtype=np.float32) * np.float32(0.5)
            if not np.array_equal(a, want):
                fail("%s: values differ from the pattern" % key)
        # Factored tensors: row is shape[:-1], col is shape[:-2] + [C].
        shape = header[name]["shape"]
        if len(shape) >= 2:
            if header[name + "/row"]["shape"] != shape[:-1]:
                fail("%s/row shape" % name)
            if header[name + "/col"]["shape"] != shape[:-2] + shape[-1:]:
                fail("%s/col shape" % name)
        elif header[name + "/var"]["shape"] != shape:
            fail("%s/var shape" % name)
    if seen != set(header):
        fail("arrays that belong to no tensor: %s" % (set(header) - seen))
    return names, arr


def check_blocks(header, meta, data):
    """A file of ckpt_sample's write-blocks: each tensor a row block, its
    arrays laid out as checkpoint.h says and filled with the pattern."""
    arr = arrays(header, data)
    names = [k[len("tensor:"):] for k in meta if k.startswith("tensor:")]
    for i, name in enumerate(names):
        tm = json.loads(meta["tensor:" + name])
        shape = [int(d) for d in tm["shape"].split(",")]
        bounds = [int(b) for b in tm["bounds"].split(",")]
        k = int(tm["block_index"])
        if tm["block_shards"] != "0,1" or tm["shard_count"] != meta["shard_count"] or k != 1:
            fail("%s: block map %r" % (name, tm))
        lo, hi = bounds[k], bounds[k + 1]
        cols = shape[-1] if len(shape) >= 2 else 1
        want = {"": [hi - lo, cols] if len(shape) >= 2 else [hi - lo]}
        if len(shape) >= 2:
            rows = shape[-2]
            want["/row"] = [hi - lo]
            want["/col"] = [(hi - 1) // rows - lo // rows + 1, cols]
        else:
            want["/var"] = [hi - lo]
        if name + "/mom" in header:
            want["/mom"] = want[""]
        for suffix, sh in want.items():
            key = name + suffix
            if header[key]["shape"] != sh:
                fail("%s: shape %s, want %s" % (key, header[key]["shape"], sh))
            a = arr[key].reshape(-1)
            pat = np.float32(i * 1000 + KINDS[suffix] * 100) + np.arange(a.size, dtype=np.float32) * np.float32(0.5)
            if not np.array_equal(a, pat):
                fail("%s: values differ from the pattern" % key)
        if set(k2 for k2 in header if k2 == name or k2.startswith(name + "/")) != {name + s for s in want}:
            fail("%s: arrays %s" % (name, sorted(header)))
    return names


def write(path, header, meta, arr, order):
    """A third-party writer following checkpoint.h: arrays in `order`."""
    meta = dict(meta)
    hdr = {}
    off = 0
    chunks = []
    for key in order:
        a = np.ascontiguousarray(arr[key], dtype="<f4")
        hdr[key] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        chunks.append(a.tobytes())
        off += a.nbytes
    data = b"".join(chunks)
    meta["data_sha256"] = hashlib.sha256(data).hexdigest()
    meta["header_sha256"] = ZEROS
    # ensure_ascii (the default) escapes the non-ASCII name: the C reader
    # must decode \\u escapes too.
    text = json.dumps(dict([("__metadata__", meta)] + list(hdr.items())), separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    prefix = len(text).to_bytes(8, "little")
    digest = hashlib.sha256(prefix + text).hexdigest()
    text = text.replace(('"header_sha256":"%s"' % ZEROS).encode(), ('"header_sha256":"%s"' % digest).encode())
    with open(path, "wb") as f:
        f.write(prefix + text + data)


def main():
    tool = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="fps-ckpt-py-") as d:
        path = subprocess.run([tool, "write", d], check=True, capture_output=True, text=True).stdout.strip()
        header, meta, data = read(path)
        names, arr = check_pattern(header, meta, data)
        if meta["shard_id"] != "1" or meta["shard_count"] != "2" or meta["mode"] != "sync":
            fail("placement %s/%s %s" % (meta["shard_id"], meta["shard_count"], meta["mode"]))
        print("read %s: %d tensors, %d arrays, %d data bytes" % (os.path.basename(path), len(names), len(arr), len(data)))

        # Python writes (arrays in reverse order, a new sequence): C loads it.
        meta2 = dict(meta, sequence="2")
        out = os.path.join(d, "ckpt-00000002.safetensors")
        write(out, header, meta2, arr, list(reversed(list(header))))
        r = subprocess.run([tool, "check", out], capture_output=True, text=True)
        if r.returncode != 0:
            fail("C loader rejected the Python-written file: " + r.stderr + r.stdout)
        print(r.stdout.strip())

        if len(sys.argv) > 2:
            cli = sys.argv[2]
            r = subprocess.run([cli, "checkpoint", "verify", d], capture_output=True, text=True)
            if r.returncode != 0:
                fail("verify refused the Python-written file: " + r.stdout + r.stderr)
            # Right digests over a NaN weight: verify says BAD, as the
            # shard's loader would skip it (it said ok, byte for byte).
            bad_dir = os.path.join(d, "nan")
            os.mkdir(bad_dir)
            arr_nan = {k: np.array(v) for k, v in arr.items()}
            first = next(k for k in header if "/" not in k)
            arr_nan[first].reshape(-1)[0] = np.nan
            write(os.path.join(bad_dir, "ckpt-00000002.safetensors"), header, meta2, arr_nan, list(header))
            r = subprocess.run([cli, "checkpoint", "verify", bad_dir], capture_output=True, text=True)
            if r.returncode != 1 or "not finite" not in r.stdout:
                fail("verify of a NaN weight: exit %d: %s" % (r.returncode, r.stdout + r.stderr))
            print("verify: ok as written, BAD with a NaN weight")

        # One flipped data bit: C must reject it as corrupted.
        with open(out, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x04]))
        r = subprocess.run([tool, "check", out], capture_output=True, text=True)
        if r.returncode == 0 or "corrupted" not in r.stderr:
            fail("flipped bit not detected: " + r.stderr)

    # Row blocks of split tensors: format_version 2, the block layout.
    with tempfile.TemporaryDirectory(prefix="fps-ckpt-py-") as d:
        path = subprocess.run([tool, "write-blocks", d], check=True, capture_output=True, text=True).stdout.strip()
        header, meta, data = read(path)
        names = check_blocks(header, meta, data)
        print("read %s: %d row blocks" % (os.path.basename(path), len(names)))
    print("ok")


if __name__ == "__main__":
    main()

"""Helpers of the recovery tests: shards with a checkpoint directory each,
the `factorps checkpoint verify` CLI, and file damage.

Built on tests/python/_support.py (real factorps-server processes on
127.0.0.1:0, port files, logs); this module only adds what checkpoints need.
"""

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from _support import SERVER, Shards, need_server  # noqa: E402,F401 (re-exported)

CLI = os.environ.get("FACTORPS_CLI", "")


class CkptShards(Shards):
    """Shards whose shard i checkpoints into ROOT/shard<i> (ROOT is made
    here and removed by close()). `ckpt` holds extra flags for every
    shard, e.g. ["--checkpoint-interval", "0.2"]."""

    def __init__(self, n=1, ckpt=(), root=None, **kw):
        self.root = root or tempfile.mkdtemp(prefix="fps-ckpt-")
        self.own_root = root is None
        self.ckpt = list(ckpt)
        super().__init__(n, **kw)

    def ckdir(self, i):
        return os.path.join(self.root, f"shard{i}")

    def start(self, i, port=0):
        base = self.extra
        # info: the restore and every checkpoint are logged at that level.
        self.extra = base + ["--checkpoint-dir", self.ckdir(i), "--log-level", "info"] + self.ckpt
        try:
            super().start(i, port)
        finally:
            self.extra = base

    def log_path(self, i):
        """Shard i's whole log (all its restarts; log() returns the tail)."""
        return os.path.join(self.dir, f"shard{i}.log")

    def files(self, i):
        """The checkpoint files of shard i, oldest first (temp files not included)."""
        d = self.ckdir(i)
        return sorted(os.path.join(d, f) for f in os.listdir(d)
                      if f.startswith("ckpt-") and f.endswith(".safetensors"))

    def close(self):
        try:
            super().close()
        finally:
            if self.own_root:
                shutil.rmtree(self.root, ignore_errors=True)


def verify(d, *extra, timeout=120):
    """Runs `factorps checkpoint verify d`; returns (exit status, output)."""
    p = subprocess.run([CLI, "checkpoint", "verify", d, *extra], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout + p.stderr


def truncate(path, keep_fraction=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))


def flip_byte(path, offset_from_end=100):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - offset_from_end)
        b = f.read(1)
        f.seek(size - offset_from_end)
        f.write(bytes([b[0] ^ 0x40]))

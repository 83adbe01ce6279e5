"""factorps.torch.attach under DistributedDataParallel, against real shards:
a 2-worker torchrun job (gloo on loopback, sync shards) with the comm hook
trains to a reference Adafactor fed the workers' mean gradient, each
gradient reaches the shards once (their bytes_received) and .grad stays each
rank's own gradient (no all-reduce averaged it); without the hook the first
step raises and nothing is applied. Also what attach() does on a torch
without post-accumulate-grad hooks (1.13): step() pushes, same result.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import HERE, Shards, free_ports, need_server
from _torch_support import Net, batch, overlap_pair
import factorps
from factorps import overlap
from factorps.reference import ReferenceAdafactor

TOL = 1e-6  # per step, relative to the largest value (as test_parity)

# Debian's torch 1.13 launcher fails on Python 3.11 (its Std enum lookup
# returns None): there the two ranks are started with the variables torchrun
# would set.
_TORCHRUN_WORKS = int(torch.__version__.split(".")[0]) >= 2


def _torchrun(shards, variant, steps, timeout=120, mode="sync"):
    """Runs ddp_worker.py as a 2-worker torchrun job (gloo, loopback) and
    returns both ranks' results. (About 15 s on an idle machine, mostly
    three torch imports; the timeout is for a machine shared by many.)"""
    return torchrun_job("ddp_worker.py", ["--shards", ",".join(shards.addrs), "--variant",
                                          variant, "--steps", str(steps), "--mode", mode],
                        timeout)


def torchrun_job(worker, args, timeout=120):
    """Runs tests/python/`worker` with `args` + ["--out", DIR] as a 2-worker
    torchrun job (gloo, loopback) and returns both ranks' DIR/rank<R>.pt."""
    out = tempfile.mkdtemp(prefix="fps-ddp-")
    port = free_ports(1)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE)
    script = [os.path.join(HERE, worker)] + list(args) + ["--out", out]
    if _TORCHRUN_WORKS:
        runs = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                  "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                  str(port)] + script, env)]
    else:
        runs = [([sys.executable] + script,
                 dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(2)]
    # Each in its own process group, so that a timeout kills the workers
    # torchrun started too.
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for cmd, e in runs]
    log = ""
    try:
        end = time.monotonic() + timeout
        for p in procs:
            log += p.communicate(timeout=max(1.0, end - time.monotonic()))[0].decode(
                errors="replace")
        res = []
        for r in range(2):
            path = os.path.join(out, f"rank{r}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} wrote no result:\n" + log[-4000:])
            res.append(torch.load(path))
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(out, ignore_errors=True)


def _reference(steps):
    """Net's parameters after `steps` sync steps of 2 workers: the mean of
    both workers' gradients into the reference Adafactor (torch defaults)."""
    model = Net()
    refs = {n: ReferenceAdafactor(tuple(p.shape), "torch") for n, p in model.named_parameters()}
    for step in range(steps):
        grads = []
        for w in range(2):
            x, y = batch(w, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        with torch.no_grad():
            for (n, p), g0, g1 in zip(model.named_parameters(), *grads):
                mean = ((g0.double() + g1.double()) / 2).float().numpy()
                new = refs[n].step(p.detach().numpy().copy(), mean)
                p.copy_(torch.from_numpy(np.asarray(new, dtype=np.float32)))
    return {n: p.detach() for n, p in model.named_parameters()}


@need_server
@unittest.skipIf(os.environ.get("FACTORPS_TEST_ASAN"), "gloo's C++ exceptions vs the preloaded ASan runtime (see tests/allowed-skips.txt)")
class DDPTest(unittest.TestCase):
    def test_hook_sync_two_workers_gradients_travel_once(self):
        steps = 4
        with Shards(2, workers=2, deadline=20) as shards:
            # DDP(gradient_as_bucket_view=True), as docs/pytorch.md
            # recommends with the hook; the async case below runs without.
            res = _torchrun(shards, "hookview", steps)
        for r in res:
            self.assertNotIn("error", r, r.get("trace"))
            # .grad stayed this rank's own gradient: no all-reduce ran.
            self.assertEqual(r["local_ok"], [True] * steps)
            if "comm_hook" in r:
                self.assertEqual(r["comm_hook"], "_ddp_comm_hook")
            self.assertEqual(set(r["versions"].values()), {steps})
        want = _reference(steps)
        for n, p in res[0]["params"].items():
            torch.testing.assert_close(p, res[1]["params"][n], rtol=0, atol=0)
            scale = max(float(want[n].abs().max()), 1e-3)
            err = float((p - want[n]).abs().max())
            self.assertLessEqual(err, steps * TOL * scale, n)
        # Every gradient reached the shards once per worker and step: the
        # shards received exactly 2 workers x steps x the parameters' bytes.
        numel = sum(p.numel() for p in res[0]["params"].values())
        self.assertEqual(res[0]["bytes_after"] - res[0]["bytes_before"], 2 * steps * 4 * numel)

    def test_hook_async_applies_each_workers_own_gradient_once(self):
        # Without the hook each worker would push the all-reduced mean, so
        # the shards would apply the average twice per step.
        steps = 3
        with Shards(2, mode="async", workers=2, deadline=20) as shards:
            res = _torchrun(shards, "hook", steps, mode="async")
            with factorps.connect(shards.addrs) as c:
                c.discover()
                versions = {n: c.tensor_stats(n)["version"] for n in res[0]["params"]}
        for r in res:
            self.assertNotIn("error", r, r.get("trace"))
            self.assertEqual(r["local_ok"], [True] * steps)
        # One update per worker and step, each with that worker's gradient.
        self.assertEqual(set(versions.values()), {2 * steps})
        numel = sum(p.numel() for p in res[0]["params"].values())
        self.assertEqual(res[0]["bytes_after"] - res[0]["bytes_before"], 2 * steps * 4 * numel)

    def test_ddp_without_hook_fails_at_first_step(self):
        with Shards(1, workers=2, deadline=20) as shards:
            res = _torchrun(shards, "nohook", 3)
            with factorps.connect(shards.addrs) as c:
                stats = c.stats()
        for r in res:
            self.assertIn("error", r)
            self.assertIn("without factorps' communication hook", r["error"])
            self.assertIn("factorps.torch.attach(ddp_model, optimizer)", r["error"])
        self.assertEqual(stats[0]["updates"], 0)
        self.assertEqual(stats[0]["tensors"], 0)


@need_server
class NoGradHooksTest(unittest.TestCase):
    def test_no_grad_hooks_pushes_in_step(self):
        # What an older torch (1.13) gets: attach() adds no gradient hooks
        # and step() pushes everything, with the same result.
        with Shards(1) as shards, mock.patch.object(overlap, "has_grad_hooks", lambda: False):
            a, b, oa, h = overlap_pair(self, shards, 3)
            self.assertFalse(h.active)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()

"""Recovery inside RemoteAdafactor.step(): a 2-worker sync training during
which shard 1 is SIGKILLed and restarted from its checkpoint 5 times
finishes by itself, with no code in the training loop.

The shards checkpoint every CHECKPOINT seconds; a restarted shard comes back
from its newest checkpoint, so it has lost the updates since then. The
workers notice (a push fails: UNAVAILABLE, or a step ahead of the restored
shard), pull what the shards hold, redo the push and log what was lost.

Bounds: every step() returns within RECOVERY + DEADLINE seconds: DEADLINE is
the shards' and the client's deadline (a push in flight ends within it),
RECOVERY the optimizer's recovery_timeout, after which it would raise
(measured: the longest step 0.36-0.37 s over 4 runs, since libfactorps
replaces a channel gRPC keeps failing after the shard is back; before that
10-21 s. A worker whose sync partner paired one step apart after a restore
would wait one round deadline, then drop that update), and the final loss on the whole data set differs from
an undisturbed run's by at most LOSS_BOUND times the starting loss (each
restart loses the updates since the shard's last checkpoint, 10-25 steps
here; measured: a difference of 0.002-0.02 of the starting loss 0.70, see
the test's printout), and is below a tenth of the starting loss.
"""

import glob
import logging
import os
import threading
import time
import unittest

import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
from factorps.torch import RemoteAdafactor

STEPS = 160
KILL_AT = (20, 45, 70, 95, 120)
CHECKPOINT = 0.05
DEADLINE = 8.0
RECOVERY = 3 * DEADLINE
LOSS_BOUND = 0.05


def data(worker):
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(8, 4, generator=g)
    g = torch.Generator().manual_seed(100 + worker)
    x = torch.randn(64, 8, generator=g)
    return x, torch.tanh(x @ teacher)


def model():
    # A generator of its own: the workers build their models in parallel threads.
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


def full_loss(m):
    with torch.no_grad():
        return sum(float(torch.nn.functional.mse_loss(m(x), y))
                   for x, y in (data(0), data(1))) / 2


def train(addrs, worker, progress, out):
    m = model()
    opt = RemoteAdafactor(m.named_parameters(), lr=3e-2, shards=addrs, worker_id=worker,
                          num_workers=2, mode="sync", deadline=DEADLINE,
                          recovery_timeout=RECOVERY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    x, y = data(worker)
    longest = 0.0
    try:
        for step in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            t0 = time.monotonic()
            opt.step()
            longest = max(longest, time.monotonic() - t0)
            sched.step()
            progress[worker] = step + 1
        out[worker] = (full_loss(m), longest,
                       {n: p.detach().clone() for n, p in m.named_parameters()})
    finally:
        opt.close()


def run(shards, kills=()):
    progress, out, errors = [0, 0], {}, []

    def body(w):
        try:
            train(shards.addrs, w, progress, out)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    restarts = 0
    ckpt = os.path.join(shards.dir, "ckpt1")
    for at in kills:
        while min(progress) < at and not errors and any(t.is_alive() for t in threads):
            time.sleep(0.002)
        # A restart before shard 1's first checkpoint would come back empty
        # (NOT_FOUND: its weights are gone), which is not what this tests.
        end = time.monotonic() + 10
        while not glob.glob(os.path.join(ckpt, "ckpt-*")) and time.monotonic() < end:
            time.sleep(0.01)
        if errors or not any(t.is_alive() for t in threads):
            break
        shards.restart(1)  # SIGKILL, then a new shard 1 from its newest checkpoint
        restarts += 1
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("training did not finish")
    return out, restarts


@need_server
class RecoveryTest(unittest.TestCase):
    def test_five_shard_restarts_from_checkpoints(self):
        with Shards(2, workers=2, deadline=DEADLINE, checkpoint=CHECKPOINT) as shards:
            calm, _ = run(shards)
        with Shards(2, workers=2, deadline=DEADLINE, checkpoint=CHECKPOINT) as shards:
            with self.assertLogs("factorps.torch", logging.WARNING) as logs:
                rough, restarts = run(shards, KILL_AT)
        self.assertEqual(restarts, 5)
        recovered = [r for r in logs.output if "recovered from" in r]
        # A restart that lost nothing while no push was in flight needs no
        # recovery (libfactorps's own retry reaches the new shard); most do.
        self.assertGreaterEqual(len(recovered), 1, logs.output)
        self.assertTrue(any("update(s) lost" in r for r in recovered), recovered)
        loss0 = full_loss(model())
        (calm_loss, calm_longest, _), (rough_loss, rough_longest, _) = calm[0], rough[0]
        print(f"\nloss: start {loss0:.4f}, undisturbed {calm_loss:.4f}, with 5 restarts "
              f"{rough_loss:.4f} (difference {abs(rough_loss - calm_loss) / loss0:.4f} of the "
              f"start, bound {LOSS_BOUND}); "
              f"longest step {calm_longest:.2f} s undisturbed, {rough_longest:.2f} s with "
              f"restarts; {len(recovered)} recoveries logged")
        for w in range(2):
            self.assertLess(rough[w][1], RECOVERY + DEADLINE, f"worker {w}: a step took too long")
        # Undisturbed, both workers end with the same weights (sync). With the
        # restarts they may differ by the update a worker dropped at the end
        # (see the module doc): both must end within the bound.
        for n, p in calm[0][2].items():
            torch.testing.assert_close(p, calm[1][2][n], rtol=0, atol=0)
        self.assertLess(calm_loss, 0.1 * loss0)
        for w in range(2):
            self.assertLess(rough[w][0], 0.1 * loss0, f"worker {w}")
            self.assertLessEqual(abs(rough[w][0] - calm_loss), LOSS_BOUND * loss0, f"worker {w}")


if __name__ == "__main__":
    unittest.main()

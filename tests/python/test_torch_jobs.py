"""RemoteAdafactor in jobs: frozen and unused parameters, namespaces,
launcher defaults, worker count and mode checks, against real shards.
Each test states its exact outcome."""

import os
import time
import unittest
from contextlib import ExitStack
from unittest import mock

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _torch_support import Net, batch, loss_step
from _support import Shards, need_server, run_threads
import factorps
from factorps.torch import RemoteAdafactor


@need_server
class NamespaceTest(unittest.TestCase):
    def test_namespaces_share_shards(self):
        with Shards(2) as shards, ExitStack() as stack:
            alone = Net()
            with Shards(2) as other:
                o = RemoteAdafactor(alone.named_parameters(), shards=other.addrs)
                for step in range(4):
                    loss_step(alone, o, 0, step)
                o.close()
            a, b = Net(), Net()
            oa = RemoteAdafactor(a.named_parameters(), namespace="jobA/", shards=shards.addrs)
            ob = RemoteAdafactor(b.named_parameters(), namespace="jobB/", shards=shards.addrs)
            stack.callback(oa.close)
            stack.callback(ob.close)
            for step in range(4):
                loss_step(a, oa, 0, step)
                if step < 2:
                    loss_step(b, ob, 0, step)
            self.assertEqual(sum(s["tensors"] for s in oa.client.stats()), 8)
            for (n, pa), pal in zip(a.named_parameters(), alone.parameters()):
                torch.testing.assert_close(pa.detach(), pal.detach(), rtol=0, atol=0)
            self.assertEqual(set(ob._versions.values()), {2})
            self.assertEqual(sorted(ob._versions), sorted("jobB/" + n for n, _ in
                                                           b.named_parameters()))


def _frozen_worker(addrs, worker, workers, mode, disagree=False):
    model = Net()
    model.b1.requires_grad_(False)           # frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = RemoteAdafactor(model.named_parameters(), weight_decay=0.1, shards=addrs,
                          worker_id=worker, num_workers=workers, mode=mode, deadline=20)
    t0 = time.monotonic()
    try:
        for step in range(4):
            x, y = batch(worker, step)
            opt.zero_grad(set_to_none=True)
            out = torch.tanh(x @ model.w1 + model.b1) @ model.t3[0]   # s unused: grad None
            if disagree and worker == 1:
                out = out * model.s
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
    except factorps.Error as e:
        return ("error", type(e).__name__, e.message, time.monotonic() - t0)
    finally:
        opt.close()
    return ("ok", {n: torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()},
            dict(opt._versions))


@need_server
class FrozenTest(unittest.TestCase):
    def check(self, results):
        for status, unchanged, versions in results:
            self.assertEqual(status, "ok")
            self.assertEqual(unchanged, {"w1": False, "b1": True, "t3": False, "s": True})
            self.assertNotIn("b1", versions)  # requires_grad=False: never on the shards
            self.assertEqual(versions["s"], 0)
            self.assertGreater(versions["w1"], 0)

    def test_sync_one_worker(self):
        with Shards(2) as shards:
            self.check(run_threads(_frozen_worker, [(shards.addrs, 0, 1, "sync")]))

    def test_sync_two_workers(self):
        with Shards(2, workers=2) as shards:
            self.check(run_threads(_frozen_worker, [(shards.addrs, w, 2, "sync")
                                                    for w in range(2)]))

    def test_async_two_workers(self):
        with Shards(2, mode="async", workers=2) as shards:
            self.check(run_threads(_frozen_worker, [(shards.addrs, w, 2, "async")
                                                    for w in range(2)]))

    def test_sync_workers_that_disagree_get_an_error_not_a_hang(self):
        with Shards(1, workers=2, deadline=20) as shards:
            res = run_threads(_frozen_worker, [(shards.addrs, w, 2, "sync", True)
                                               for w in range(2)])
        for status, cls, message, seconds in res:
            self.assertEqual((status, cls), ("error", "FailedPreconditionError"), message)
            self.assertIn("'s'", message)
            self.assertLess(seconds, 10.0)


def _env(**kw):
    """os.environ without the launcher variables, plus `kw`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "FACTORPS_SHARDS")}
    env.update(kw)
    return mock.patch.dict(os.environ, env, clear=True)


@need_server
class LauncherTest(unittest.TestCase):
    def make(self, **kw):
        p = torch.nn.Parameter(torch.ones(3, 2))
        opt = RemoteAdafactor([("p", p)], deadline=5, **kw)
        return opt, p

    def test_environment_defaults(self):
        with Shards(1) as shards:
            addrs = ",".join(shards.addrs)
            with _env(FACTORPS_SHARDS=addrs):
                opt, p = self.make()
                self.assertEqual((opt.worker_id, opt.num_workers, opt.client.shards),
                                 (0, 1, shards.addrs))
                p.grad = torch.ones(3, 2)
                opt.step()
                self.assertEqual(opt.remote_step, 1)
                opt.close()
        with _env(FACTORPS_SHARDS="127.0.0.1:1", RANK="3", WORLD_SIZE="4"):
            opt, _ = self.make()
            self.assertEqual((opt.worker_id, opt.num_workers), (3, 4))
            opt.close()
            opt, _ = self.make(worker_id=1)  # an argument wins over its variable
            self.assertEqual((opt.worker_id, opt.num_workers), (1, 4))
            opt.close()
        with _env(FACTORPS_SHARDS="127.0.0.1:1", RANK="4", WORLD_SIZE="4"):
            with self.assertRaisesRegex(ValueError, r"worker_id=4 num_workers=4 \(from RANK=4 "
                                        r"WORLD_SIZE=4\)"):
                self.make()
        with _env(FACTORPS_SHARDS="127.0.0.1:1", RANK="x"):
            with self.assertRaisesRegex(ValueError, "RANK='x' is not an integer"):
                self.make()
        with _env():
            with self.assertRaisesRegex(ValueError, "FACTORPS_SHARDS"):
                self.make()

    @unittest.skipIf(os.environ.get("FACTORPS_TEST_ASAN"),
                     "torch.distributed's C++ exceptions trip ASan's __cxa_throw interceptor "
                     "in a CPython that preloads the ASan runtime (a CHECK failure inside ASan)")
    def test_torch_distributed_wins_over_the_environment(self):
        import socket
        import torch.distributed as dist
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        self.addCleanup(dist.destroy_process_group)
        with _env(FACTORPS_SHARDS="127.0.0.1:1", RANK="3", WORLD_SIZE="4"):
            opt, _ = self.make()
            self.assertEqual((opt.worker_id, opt.num_workers), (0, 1))
            opt.close()


@need_server
class WorkerCountTest(unittest.TestCase):
    def test_wrong_count_fails_at_once(self):
        with Shards(1, workers=2, deadline=30) as shards, ExitStack() as stack:
            p = torch.nn.Parameter(torch.ones(3, 2))
            opt = RemoteAdafactor([("p", p)], shards=shards.addrs, worker_id=0, num_workers=3,
                                  deadline=30)
            stack.callback(opt.close)
            t0 = time.monotonic()
            with self.assertRaisesRegex(factorps.FailedPreconditionError,
                                        "sync mode for 2 workers, but this optimizer has "
                                        "num_workers=3"):
                opt.step()
            self.assertLess(time.monotonic() - t0, 5.0)
            wrong = RemoteAdafactor([("p", p)], shards=shards.addrs, mode="async",
                                    worker_id=0, num_workers=2)
            stack.callback(wrong.close)
            with self.assertRaisesRegex(factorps.FailedPreconditionError,
                                        "the shards run sync mode, but this optimizer expects "
                                        "mode='async'"):
                wrong.step()
            # The shards check it too, in every push, without waiting for a round.
            with factorps.connect(shards.addrs, worker_id=0, deadline=30) as c:
                c.create([factorps.TensorSpec("q", (2,), np.ones(2))])
                t0 = time.monotonic()
                with self.assertRaises(factorps.FailedPreconditionError) as cm:
                    c.push_pull({"q": np.ones(2)}, num_workers=3)
                self.assertLess(time.monotonic() - t0, 5.0)
                self.assertIn("3", cm.exception.message)
                with self.assertRaises(factorps.FailedPreconditionError):
                    c.push_pull({"q": np.ones(2)}, num_workers=2, expect_mode="async")
                t0 = time.monotonic()
                with self.assertRaises(factorps.Error) as cm:
                    c.push_pull({"q": np.ones(2)}, worker_id=2, num_workers=2)
                self.assertLess(time.monotonic() - t0, 5.0)
                self.assertIn("worker", cm.exception.message)


if __name__ == "__main__":
    unittest.main()

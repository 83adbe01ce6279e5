"""factorps.torch.attach without DDP (post-accumulate-grad hooks, PyTorch
>= 2.1), against real shards: buckets leave during backward (the parameters
have their new values before step()), results equal a step()-only run bit
for bit, gradient accumulation with no_sync(), a changed gradient or a
second backward refused; wait="forward": step() returns with replies
outstanding and the next forward still reads only fresh weights. Skipped
as a whole on a torch without those hooks (Debian's 1.13).
"""

import os
import threading
import time
import unittest

import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
from _torch_support import Net, batch, overlap_loop as _loop, overlap_pair
import factorps
from factorps import overlap
from factorps.torch import RemoteAdafactor, attach

needs_grad_hooks = unittest.skipUnless(overlap.has_grad_hooks(),
                                       "torch without register_post_accumulate_grad_hook")


@need_server
@needs_grad_hooks
class GradHookTest(unittest.TestCase):
    def test_buckets_leave_during_backward(self):
        seen = []
        with Shards(2) as shards:
            holder = {}

            def before_step(step):
                # One sync worker: each bucket's round completes as it is
                # pushed, so the parameters already hold the new values.
                oa = holder["opt"]
                oa._overlap.wait_all()
                seen.append(dict(oa._versions))

            a, b = Net(), Net()
            oa = RemoteAdafactor(a.named_parameters(), shards=shards.addrs, namespace="a/")
            ob = RemoteAdafactor(b.named_parameters(), shards=shards.addrs, namespace="b/")
            holder["opt"] = oa
            self.addCleanup(oa.close)
            self.addCleanup(ob.close)
            h = attach(a, oa, bucket_cap_mb=1e-4)
            self.assertTrue(h.active)
            pushes0 = sum(s["pushes"] for s in oa.client.stats())
            _loop(a, oa, 3, before_step=before_step)
            _loop(b, ob, 3)
            pushes = sum(s["pushes"] for s in oa.client.stats()) - pushes0
        self.assertEqual(seen, [{f"a/{n}": s + 1 for n in ("w1", "b1", "t3", "s")}
                                for s in range(3)])
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
        # Buckets of about one tensor, plus the plain run's one call per
        # shard and step: more calls than step()-only pushes would make.
        self.assertGreaterEqual(pushes, 3 * 4)

    def test_accumulation_with_no_sync(self):
        with Shards(1) as shards:
            a, b, oa, h = overlap_pair(self, shards, 3, accumulate=3)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)

    def test_second_backward_without_no_sync_raises(self):
        with Shards(1) as shards:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            self.addCleanup(opt.close)
            attach(model, opt)
            x, y = batch(0, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            with self.assertRaisesRegex(RuntimeError, r"second gradient before step\(\).*"
                                        r"no_sync"):
                torch.nn.functional.mse_loss(model(x), y).backward()

    def test_gradient_changed_after_backward_raises(self):
        with Shards(1) as shards:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            self.addCleanup(opt.close)
            attach(model, opt)
            x, y = batch(0, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with self.assertRaisesRegex(RuntimeError, r"changed after backward had pushed"):
                opt.step()


@need_server
@needs_grad_hooks
class NonFiniteTest(unittest.TestCase):
    """A non-finite gradient with attach(): with a GradScaler given to it
    the step is skipped whole (step() sees every gradient before any
    leaves), exactly as without attach; without a scaler, a NaN in the
    first bucket skips the step, one found after finite buckets left makes
    step() say so (FloatingPointError); an enabled GradScaler attach() was
    not given is refused before anything leaves."""

    def _amp_step(self, model, opt, scaler, step, inf_in_w1=False, clip=False):
        x, y = batch(0, step)
        opt.zero_grad()
        # w1 is the first layer: its gradient is the last one backward makes.
        hook = model.w1.register_hook(lambda g: g * float("inf")) if inf_in_w1 else None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        if clip:  # the AMP recipe's clipping: unscale first
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()

    def test_grad_scaler_given_to_attach_skips_the_step_whole(self):
        self._scaler_run(clip=False)

    def test_grad_scaler_with_unscale_and_clipping(self):
        self._scaler_run(clip=True)

    def _scaler_run(self, clip):
        with Shards(1) as shards:
            a, b = Net(), Net()
            oa = RemoteAdafactor(a.named_parameters(), shards=shards.addrs, namespace="a/")
            ob = RemoteAdafactor(b.named_parameters(), shards=shards.addrs, namespace="b/")
            self.addCleanup(oa.close)
            self.addCleanup(ob.close)
            sa = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
            sb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
            h = attach(a, oa, bucket_cap_mb=1e-4, grad_scaler=sa)  # many buckets otherwise
            self.assertFalse(h.active)  # step() pushes: it alone sees every gradient
            for step in range(4):
                before = {n: p.detach().clone() for n, p in a.named_parameters()}
                self._amp_step(a, oa, sa, step, inf_in_w1=step == 2, clip=clip)
                self._amp_step(b, ob, sb, step, inf_in_w1=step == 2, clip=clip)
                self.assertEqual(oa.last_step_skipped, step == 2, f"step {step}")
                self.assertEqual(sa.get_scale(), sb.get_scale())
                # Bit for bit the run without attach (which skips as AMP does).
                for p, q in zip(a.parameters(), b.parameters()):
                    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
                if step == 2:  # nothing of it applied, not even the finite buckets
                    for n, p in a.named_parameters():
                        self.assertTrue(torch.equal(p.detach(), before[n]), n)
            self.assertEqual(sa.get_scale(), 2.0 ** 7)  # backed off once
            self.assertEqual(oa.skipped_steps, 1)
            self.assertEqual(set(oa._versions.values()), {3})

    def test_a_scaler_not_given_to_attach_is_refused_before_anything_leaves(self):
        with Shards(1) as shards:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            self.addCleanup(opt.close)
            scaler = torch.amp.GradScaler("cpu")
            attach(model, opt)
            x, y = batch(0, 0)
            raised = None
            try:
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            except RuntimeError as e:
                raised = str(e)
            del scaler
            self.assertIsNotNone(raised)
            self.assertIn("grad_scaler=scaler", raised)
            pushes = sum(s["pushes"] for s in opt.client.stats())
            self.assertEqual(pushes, 0)

    def make(self, shards, wait="step"):
        model = Net()
        opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
        self.addCleanup(opt.close)
        attach(model, opt, bucket_cap_mb=1e-4, wait=wait)  # buckets [s, t3] then [b1, w1]
        return model, opt

    def test_nan_in_the_first_bucket_skips_the_step(self):
        with Shards(1) as shards:
            model, opt = self.make(shards)
            _loop(model, opt, 1)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            x, y = batch(0, 1)
            opt.zero_grad()
            with self.assertLogs("factorps.torch", "WARNING"):  # the first bucket's check
                torch.nn.functional.mse_loss(model(x) * float("nan"), y).backward()
                opt.step()
            self.assertTrue(opt.last_step_skipped)
            for n, p in model.named_parameters():
                self.assertTrue(torch.equal(p.detach(), before[n]), n)
            self.assertEqual(set(opt._versions.values()), {1})
            _loop(model, opt, 1)  # and the next step is a normal one
            self.assertFalse(opt.last_step_skipped)
            self.assertEqual(set(opt._versions.values()), {2})

    def test_nan_after_finite_buckets_left_raises_on_step(self):
        with Shards(1) as shards:
            model, opt = self.make(shards)
            x, y = batch(0, 0)
            hook = model.w1.register_hook(lambda g: g * float("nan"))
            torch.nn.functional.mse_loss(model(x), y).backward()
            hook.remove()
            with self.assertRaisesRegex(FloatingPointError, r"here: 'w1'.* 2 of 4 tensors"):
                opt.step()
            self.assertEqual(opt._versions, {"s": 1, "t3": 1, "b1": 0, "w1": 0})
            # The shards hold what the worker holds; training goes on.
            _loop(model, opt, 1)
            self.assertEqual(opt._versions, {"s": 2, "t3": 2, "b1": 1, "w1": 1})

    def test_nan_after_finite_buckets_left_raises_with_wait_forward(self):
        # step() does not wait for the replies, but this worker knows.
        with Shards(1) as shards:
            model, opt = self.make(shards, wait="forward")
            x, y = batch(0, 0)
            hook = model.w1.register_hook(lambda g: g * float("nan"))
            torch.nn.functional.mse_loss(model(x), y).backward()
            hook.remove()
            with self.assertRaisesRegex(FloatingPointError, r"here: 'w1'"):
                opt.step()
            opt._overlap.wait_all()
            self.assertEqual(opt._versions, {"s": 1, "t3": 1, "b1": 0, "w1": 0})


@need_server
@unittest.skipUnless(overlap.has_grad_hooks(), "torch without register_post_accumulate_grad_hook")
@unittest.skipIf(os.environ.get("FACTORPS_TEST_ASAN"), "gloo's C++ exceptions vs the preloaded "
                 "ASan runtime (see tests/allowed-skips.txt)")
class TwoWorkerNonFiniteTest(unittest.TestCase):
    def test_ddp_hook_skips_on_every_worker(self):
        # amp_worker.py: with a GradScaler given to attach, rank 1's Inf in
        # its last bucket; without one, rank 1's NaN loss. Both ranks skip
        # that same step, whole, and end equal.
        from test_torch_ddp import torchrun_job
        steps, bad = 4, 1
        with Shards(2, workers=2) as shards:
            res = torchrun_job("amp_worker.py", ["--shards", ",".join(shards.addrs), "--steps",
                                                 str(steps), "--bad", str(bad)], timeout=240)
        for r in res:
            self.assertNotIn("error", r, r.get("trace"))
        for ph in ("scaler", "nan"):
            r0, r1 = res[0][ph], res[1][ph]
            want = [s == bad for s in range(steps)]
            self.assertEqual(r0["skipped"], want, ph)
            self.assertEqual(r1["skipped"], want, ph)
            for s in range(steps):
                for n, p in r0["params"][s].items():
                    self.assertTrue(torch.equal(p, r1["params"][s][n]), f"{ph} step {s} {n}")
            for n, p in r0["params"][bad].items():
                self.assertTrue(torch.equal(p, r0["params"][bad - 1][n]), f"{ph} {n} moved")
            self.assertEqual(set(r0["versions"].values()), {steps - 1}, ph)
        # Each rank's scaler backs off on its own Inf only.
        s0, s1 = res[0]["scaler"]["scales"], res[1]["scaler"]["scales"]
        self.assertEqual(s0[bad], s0[bad - 1])
        self.assertEqual(s1[bad], s1[bad - 1] / 2)
        self.assertFalse(res[0]["scaler"]["active"])
        self.assertTrue(res[0]["nan"]["active"])


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.l1 = torch.nn.Linear(10, 16)
        self.l2 = torch.nn.Linear(16, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


@need_server
@needs_grad_hooks
class ForwardWaitTest(unittest.TestCase):
    def test_forward_reads_only_fresh_weights(self):
        """Worker 1 pushes each step 1 s late, so worker 0's step()
        returns with its replies outstanding; its next forward must still
        see exactly the weights worker 1 got back from the same round."""
        steps = 3
        with Shards(1, workers=2, deadline=20) as shards:
            m0, m1 = _Two(), _Two()
            o0 = RemoteAdafactor(m0.named_parameters(), shards=shards.addrs, worker_id=0,
                                 num_workers=2, mode="sync", deadline=20)
            o1 = RemoteAdafactor(m1.named_parameters(), shards=shards.addrs, worker_id=1,
                                 num_workers=2, mode="sync", deadline=20)
            self.addCleanup(o0.close)
            self.addCleanup(o1.close)
            h = attach(m0, o0, bucket_cap_mb=1e-4, wait="forward")
            seen, fresh, pending = [], [], []

            def record(module, args):
                # Registered after attach()'s own pre-hooks: sees what the
                # module's forward reads.
                if module is m0.l1:
                    seen.append([])
                seen[-1] += [p.detach().clone() for p in module.parameters()]
            m0.l1.register_forward_pre_hook(record)
            m0.l2.register_forward_pre_hook(record)

            def worker1():
                o1.setup()
                for step in range(steps):
                    x, y = batch(1, step)
                    o1.zero_grad()
                    torch.nn.functional.mse_loss(m1(x), y).backward()
                    time.sleep(1.0)
                    o1.step()
                    fresh.append([p.detach().clone() for p in m1.parameters()])

            t = threading.Thread(target=worker1)
            t.start()
            try:
                for step in range(steps):
                    x, y = batch(0, step)
                    o0.zero_grad()
                    torch.nn.functional.mse_loss(m0(x), y).backward()
                    o0.step()
                    # Replies still outstanding as step() returns.
                    pending.append(sum(not f.done() for f in set(h._unwaited.values())))
                with torch.no_grad():
                    m0(x)  # the forward after the last step
            finally:
                t.join(60)
            self.assertFalse(t.is_alive())
        self.assertTrue(all(n > 0 for n in pending), pending)
        self.assertEqual(len(seen), steps + 1)
        for step in range(steps):
            for got, want in zip(seen[step + 1], fresh[step]):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()

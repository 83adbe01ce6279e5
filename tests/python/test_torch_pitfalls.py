"""The usual ways of running a PyTorch job that used to go wrong, each
against real shards: the overwrite guard after an empty
load_state_dict(), GradScaler and non-finite gradients, torch.distributed
.checkpoint, load_state_dict hooks, frozen parameters, torch.compile / DDP
name prefixes and transformers' AdafactorSchedule. Cases that need an API
Debian's PyTorch 1.13 lacks (torch.amp.GradScaler on the CPU, optimizer
hooks, torch.distributed.checkpoint.state_dict) or transformers skip there
(tests/allowed-skips.txt)."""

import logging
import tempfile
import time
import unittest
from contextlib import ExitStack

import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _torch_support import Net, batch, loss_step
from _support import Shards, need_server, run_threads
from factorps.errors import AlreadyExistsError
from factorps.torch import RemoteAdafactor, RemoteHFAdafactor

try:
    from transformers.optimization import AdafactorSchedule
except ImportError:  # Debian's python3 has no transformers
    AdafactorSchedule = None

HAS_CPU_SCALER = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
HAS_LOAD_HOOKS = hasattr(torch.optim.Optimizer, "register_load_state_dict_pre_hook")
try:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
except ImportError:
    get_state_dict = None


def _values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Values:
    """A name -> tensor dict with a module's named_parameters()."""

    def __init__(self, values):
        self.values = values

    def named_parameters(self):
        return iter(self.values.items())


def _assert_same(test, model, want, exact=True):
    for n, p in model.named_parameters():
        if exact:
            test.assertTrue(torch.equal(p.detach(), want[n]), n)
        else:
            torch.testing.assert_close(p.detach(), want[n], msg=n)


def _tensor_count(opt):
    return sum(s["tensors"] for s in opt.client.stats())


@need_server
class OverwriteGuardTest(unittest.TestCase):
    def test_empty_state_roundtrip_keeps_the_guard(self):
        with Shards(1) as shards, ExitStack() as stack:
            a = Net()
            oa = RemoteAdafactor(a.named_parameters(), shards=shards.addrs)
            for step in range(3):
                loss_step(a, oa, 0, step)
            trained = _values(a)
            oa.close()
            b = Net(seed=99)
            ob = RemoteAdafactor(b.named_parameters(), shards=shards.addrs)
            stack.callback(ob.close)
            # What accelerate.prepare() and the Trainer do before training.
            ob.load_state_dict(ob.state_dict())
            with self.assertRaises(AlreadyExistsError):
                loss_step(b, ob, 0, 0)
            c = Net(seed=5)
            oc = RemoteAdafactor(c.named_parameters(), shards=shards.addrs, on_existing="adopt")
            stack.callback(oc.close)
            oc.setup()
            _assert_same(self, c, trained)
            self.assertEqual(set(oc._versions.values()), {3})


@need_server
class FrozenTest(unittest.TestCase):
    def test_frozen_parameters_never_travel(self):
        with Shards(2) as shards, ExitStack() as stack:
            model = Net()
            model.b1.requires_grad_(False)
            frozen = model.b1.detach().clone()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            seen = []
            real = opt.client.push_pull

            def spy(grads, **kw):  # the real call, recording what travels
                seen.append(sorted(grads))
                return real(grads, **kw)

            opt.client.push_pull = spy
            for step in range(3):
                loss_step(model, opt, 0, step)
            self.assertEqual(sorted(n for names in seen for n in names),
                             sorted(["s", "t3", "w1"] * 3))
            self.assertEqual(_tensor_count(opt), 3)
            self.assertTrue(torch.equal(model.b1.detach(), frozen))
            self.assertEqual(opt.state[model.b1], {})
            # Unfrozen, it is created at the next step and steps from there.
            model.b1.requires_grad_(True)
            seen.clear()
            loss_step(model, opt, 0, 3)
            self.assertEqual(sorted(n for names in seen for n in names), ["b1", "s", "t3", "w1"])
            self.assertEqual(_tensor_count(opt), 4)
            self.assertEqual(opt._versions["b1"], 1)
            self.assertEqual(opt._versions["w1"], 4)


@need_server
class NamePrefixTest(unittest.TestCase):
    def test_compiled_and_ddp_names_find_the_same_tensors(self):
        with Shards(2) as shards, ExitStack() as stack:
            a = Net()
            oa = RemoteAdafactor(a.named_parameters(), shards=shards.addrs)
            for step in range(3):
                loss_step(a, oa, 0, step)
            trained = _values(a)
            oa.close()
            b = Net(seed=42)
            if hasattr(torch, "compile"):
                named = list(torch.compile(b, backend="eager").named_parameters())
                self.assertTrue(named[0][0].startswith("_orig_mod."), named[0][0])
            else:  # torch 1.13: the names torch.compile gives
                named = [("_orig_mod." + n, p) for n, p in b.named_parameters()]
            # DistributedDataParallel around it adds a leading "module.".
            named = [("module." + n, p) for n, p in named]
            ob = RemoteAdafactor(named, shards=shards.addrs, on_existing="adopt")
            stack.callback(ob.close)
            ob.setup()
            self.assertEqual(ob.param_names(), ["w1", "b1", "t3", "s"])
            self.assertEqual(_tensor_count(ob), 4)
            _assert_same(self, b, trained)
            loss_step(b, ob, 0, 3)
            self.assertEqual(set(ob._versions.values()), {4})


@need_server
@unittest.skipUnless(HAS_LOAD_HOOKS, "this torch has no optimizer load_state_dict hooks")
class LoadHookTest(unittest.TestCase):
    def test_load_hooks_run_before_validation(self):
        with Shards(1) as first, Shards(1) as fresh, ExitStack() as stack:
            a = Net()
            oa = RemoteAdafactor(a.named_parameters(), shards=first.addrs)
            for step in range(2):
                loss_step(a, oa, 0, step)
            sd = oa.state_dict()
            oa.close()
            # An older layout of the same state, which a pre hook maps back.
            old = dict(sd, state={k: {"old_" + key: v for key, v in st.items()}
                                  for k, st in sd["state"].items()})
            b = Net(seed=3)
            ob = RemoteAdafactor(b.named_parameters(), shards=fresh.addrs)
            stack.callback(ob.close)
            calls = []

            def pre(opt, state_dict):
                calls.append("pre")
                return dict(state_dict, state={k: {key[4:]: v for key, v in st.items()}
                                               for k, st in state_dict["state"].items()})

            ob.register_load_state_dict_pre_hook(pre)
            ob.register_load_state_dict_post_hook(
                lambda opt: calls.append(("post", opt._loaded is not None)))
            ob.load_state_dict(old)
            self.assertEqual(calls, ["pre", ("post", True)])
            b.load_state_dict(a.state_dict())
            ob.setup()
            index = {id(p): i for i, p in enumerate(ob._params())}
            for p, st in ob.state.items():
                want = sd["state"][index[id(p)]]
                for key, t in st.items():
                    torch.testing.assert_close(t, want[key], rtol=0, atol=0)


@need_server
@unittest.skipUnless(get_state_dict is not None, "this torch has no "
                     "torch.distributed.checkpoint.state_dict")
class DistributedCheckpointTest(unittest.TestCase):
    def test_get_and_set_state_dict_resume_exactly(self):
        steps, cut = 6, 3
        with Shards(2) as s_ref, Shards(2) as s_a, Shards(2) as s_b, ExitStack() as stack:
            ref = Net()
            oref = RemoteAdafactor(ref.named_parameters(), weight_decay=0.01, shards=s_ref.addrs)
            stack.callback(oref.close)
            for step in range(steps):
                loss_step(ref, oref, 0, step)
            a = Net()
            oa = RemoteAdafactor(a.named_parameters(), weight_decay=0.01, shards=s_a.addrs)
            stack.callback(oa.close)
            for step in range(cut):
                loss_step(a, oa, 0, step)
            msd, osd = get_state_dict(a, oa)
            ckpt = stack.enter_context(tempfile.TemporaryDirectory(prefix="fps-dcp-"))
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            b = Net(seed=77)
            ob = RemoteAdafactor(b.named_parameters(), weight_decay=0.01, shards=s_b.addrs)
            stack.callback(ob.close)
            msd, osd = get_state_dict(b, ob)  # the template: no step on fake gradients
            self.assertEqual(_tensor_count(ob), 0)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            set_state_dict(b, ob, model_state_dict=msd, optim_state_dict=osd)
            self.assertEqual(_tensor_count(ob), 0)
            for step in range(cut, steps):
                loss_step(b, ob, 0, step)
            _assert_same(self, b, _values(ref))
            self.assertEqual(set(ob._versions.values()), {steps})


def _scaled_step(model, opt, scaler, worker, step, poison=False):
    x, y = batch(worker, step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if poison:
        model.w1.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


def _sync_worker(addrs, worker, scaled, poison_step, steps=3):
    """One of two sync workers; worker 1's gradient holds an Inf at
    `poison_step`. Returns (skipped flags, versions, values, seconds)."""
    model = Net()
    opt = RemoteAdafactor(model.named_parameters(), shards=addrs, worker_id=worker,
                          num_workers=2, deadline=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None
    skipped = []
    t0 = time.monotonic()
    try:
        for step in range(steps):
            x, y = batch(worker, step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            (scaler.scale(loss) if scaled else loss).backward()
            if worker == 1 and step == poison_step:
                model.w1.grad[0, 0] = float("inf")
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            skipped.append(getattr(opt, "last_step_skipped", None))
    finally:
        opt.close()
    return skipped, dict(opt._versions), _values(model), time.monotonic() - t0


@need_server
class NonFiniteTest(unittest.TestCase):
    def check_sync_workers_skip_together(self, scaled):
        with Shards(2, workers=2, deadline=20) as shards:
            logging.getLogger("factorps.torch").setLevel(logging.ERROR)
            try:
                res = run_threads(_sync_worker, [(shards.addrs, w, scaled, 1) for w in range(2)])
            finally:
                logging.getLogger("factorps.torch").setLevel(logging.NOTSET)
        for skipped, versions, _, seconds in res:
            self.assertEqual(skipped, [False, True, False])
            self.assertEqual(set(versions.values()), {2})
            self.assertLess(seconds, 10.0)  # nobody waited for a round deadline
        _assert_same(self, _Values(res[0][2]), res[1][2])

    def test_sync_workers_skip_a_nan_step_together(self):
        self.check_sync_workers_skip_together(scaled=False)

    @unittest.skipUnless(HAS_CPU_SCALER, "this torch has no CPU GradScaler (torch.amp)")
    def test_sync_workers_skip_a_scaler_step_together(self):
        self.check_sync_workers_skip_together(scaled=True)

    @unittest.skipUnless(HAS_CPU_SCALER, "this torch has no CPU GradScaler (torch.amp)")
    def test_grad_scaler_step_reaches_the_optimizer(self):
        with Shards(1) as s_ref, Shards(1) as shards, ExitStack() as stack:
            ref = Net()
            oref = RemoteAdafactor(ref.named_parameters(), shards=s_ref.addrs)
            stack.callback(oref.close)
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            calls = []
            real = opt.step
            opt.step = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
            _scaled_step(model, opt, scaler, 0, 0)
            loss_step(ref, oref, 0, 0)
            # A power-of-two scale unscales exactly: the same update.
            _assert_same(self, model, _values(ref))
            before = _values(model)
            _scaled_step(model, opt, scaler, 0, 1, poison=True)
            self.assertEqual(len(calls), 2)  # reached the optimizer, which skipped it
            self.assertTrue(opt.last_step_skipped)
            self.assertEqual(opt.skipped_steps, 1)
            _assert_same(self, model, before)
            self.assertEqual(set(opt._versions.values()), {1})
            self.assertEqual(scaler.get_scale(), 2.0 ** 9)  # backed off as usual
            _scaled_step(model, opt, scaler, 0, 2)
            self.assertFalse(opt.last_step_skipped)
            loss_step(ref, oref, 0, 2)
            _assert_same(self, model, _values(ref))
            self.assertEqual(set(opt._versions.values()), {2})

    def test_nan_without_a_scaler_skips_the_step(self):
        with Shards(1) as shards, ExitStack() as stack:
            model = Net()
            opt = RemoteAdafactor(model.named_parameters(), shards=shards.addrs)
            stack.callback(opt.close)
            loss_step(model, opt, 0, 0)
            before = _values(model)
            x, y = batch(0, 1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            model.t3.grad[1, 2, 0] = float("nan")
            with self.assertLogs("factorps.torch", logging.WARNING) as logs:
                opt.step()
            self.assertIn("'t3'", logs.output[0])
            self.assertTrue(opt.last_step_skipped)
            _assert_same(self, model, before)
            self.assertEqual(set(opt._versions.values()), {1})
            loss_step(model, opt, 0, 2)
            self.assertFalse(opt.last_step_skipped)
            self.assertEqual(set(opt._versions.values()), {2})


@need_server
@unittest.skipUnless(AdafactorSchedule is not None, "transformers is not installed")
class AdafactorScheduleTest(unittest.TestCase):
    """transformers' AdafactorSchedule reads `opt.state[first param]["step"]`
    and `["RMS"]` of every group each sched.step(): served from what the
    worker tracks, never a GetState per step (counted by the shards'
    factorps_rpc_requests_total), and equal to transformers' own
    Adafactor's learning rates for the same gradients."""

    STEPS = 8

    def _run(self, **hp):
        from transformers.optimization import Adafactor, get_adafactor_schedule
        with Shards(2, metrics=True) as shards, ExitStack() as stack:
            model, ref = Net(), Net()
            groups = [{"params": [("w1", model.w1), ("b1", model.b1)]},
                      {"params": [("t3", model.t3), ("s", model.s)]}]
            opt = RemoteHFAdafactor(groups, shards=shards.addrs, **hp)
            stack.callback(opt.close)
            ref_opt = Adafactor([{"params": [ref.w1, ref.b1]}, {"params": [ref.t3, ref.s]}],
                                **hp)
            # get_adafactor_schedule() is AdafactorSchedule's factory.
            sched = (get_adafactor_schedule if hp else AdafactorSchedule)(opt)
            ref_sched = AdafactorSchedule(ref_opt)
            reads = []
            for step in range(self.STEPS):
                loss_step(model, opt, 0, step)
                loss_step(ref, ref_opt, 0, step)
                sched.step()
                ref_sched.step()
                reads.append(shards.rpc_count("GetState"))
                got, want = sched.get_last_lr(), ref_sched.get_last_lr()
                self.assertEqual(len(got), 2)
                for g, w in zip(got, want):
                    self.assertAlmostEqual(float(g) / float(w), 1.0, delta=1e-5,
                                           msg=f"step {step}: lrs {got} vs transformers' {want}")
            # The first sched.step() reads each group's first tensor once;
            # no step after it reads any state.
            self.assertLessEqual(reads[0], 2, reads)
            self.assertEqual(reads[1:], [reads[0]] * (self.STEPS - 1),
                             f"GetState calls after each sched.step(): {reads}")
            # state_dict() holds plain dicts (torch's load_state_dict
            # rebuilds each value by its type).
            for st in opt.state_dict()["state"].values():
                self.assertIs(type(st), dict)
            # What was served is what the shards hold.
            full = opt.client.get_state(["w1", "t3"])
            for p, n in ((model.w1, "w1"), (model.t3, "t3")):
                self.assertEqual(opt.state[p]["step"], full[n]["step"])
                self.assertEqual(full[n]["step"], self.STEPS)
                self.assertAlmostEqual(float(opt.state[p]["RMS"]) / full[n]["rms"], 1.0,
                                       delta=1e-6)

    def test_relative_step_lr_without_a_state_read_per_step(self):
        self._run()

    def test_warmup_init_lr_without_a_state_read_per_step(self):
        self._run(warmup_init=True)

    def test_async_workers_fall_back_to_reading_the_shard(self):
        # Another worker's update between two of ours breaks the tracked
        # chain (the RMS before that update is not this worker's copy):
        # the schedule then reads the shard, and still reports its lr.
        with Shards(1, mode="async", metrics=True) as shards, ExitStack() as stack:
            models = [Net(), Net()]
            opts = [RemoteHFAdafactor([("w1", m.w1), ("b1", m.b1), ("t3", m.t3), ("s", m.s)],
                                      shards=shards.addrs, worker_id=i, num_workers=2,
                                      on_existing="adopt")
                    for i, m in enumerate(models)]
            for o in opts:
                stack.callback(o.close)
            sched = AdafactorSchedule(opts[0])
            for step in range(3):
                for i in (0, 1):
                    loss_step(models[i], opts[i], i, step)
                before = shards.rpc_count("GetState")
                sched.step()
                self.assertEqual(shards.rpc_count("GetState"), before + 1, f"step {step}")
                full = opts[0].client.get_state(["w1"])["w1"]
                want = opts[0]._get_lr(opts[0].param_groups[0],
                                       {"step": full["step"], "RMS": full["rms"]})
                self.assertAlmostEqual(float(sched.get_last_lr()[0]) / want, 1.0, delta=1e-6)


if __name__ == "__main__":
    unittest.main()

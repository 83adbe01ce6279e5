"""Error paths of the binding: every failure is a factorps.Error with the
gRPC status, in bounded time, and leaves the shards usable.

Covered: unreachable shard, wrong shapes, a tensor whose shape changed
between runs, NaN/Inf gradients, a shard restarted (empty) or killed in the
middle of training, and a sync round that never completes.
"""

import math
import socket
import time
import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
import factorps
from factorps.torch import RemoteAdafactor


def _free_port():
    """A loopback port nobody listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class UnreachableTest(unittest.TestCase):
    def test_unreachable_shard_fails_within_the_deadline(self):
        c = factorps.connect([f"127.0.0.1:{_free_port()}"], deadline=2.0, max_retries=1,
                             backoff=0.05)
        self.addCleanup(c.close)
        t0 = time.monotonic()
        with self.assertRaises(factorps.Error) as cm:
            c.create([factorps.TensorSpec("w", (3, 2), np.ones((3, 2)))])
        elapsed = time.monotonic() - t0
        self.assertIn(cm.exception.code_name, ("UNAVAILABLE", "DEADLINE_EXCEEDED"))
        self.assertEqual(cm.exception.shard, 0)
        self.assertLess(elapsed, 10.0)
        # The same for stats, and for a second shard that is up.
        with self.assertRaises((factorps.UnavailableError, factorps.DeadlineExceededError)):
            c.stats()

    @need_server
    def test_one_unreachable_shard_of_two_is_named(self):
        with Shards(1) as up:
            c = factorps.connect([up.addrs[0], f"127.0.0.1:{_free_port()}"], deadline=2.0,
                                 max_retries=1, backoff=0.05)
            self.addCleanup(c.close)
            with self.assertRaises(factorps.Error) as cm:
                c.stats()
            self.assertEqual(cm.exception.shard, 1)


@need_server
class ShardErrorsTest(unittest.TestCase):
    def setUp(self):
        self.shards = Shards(1, mode="sync", workers=1)
        self.addCleanup(self.shards.close)
        self.c = factorps.connect(self.shards.addrs, deadline=10)
        self.addCleanup(self.c.close)
        self.w0 = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
        self.c.create([factorps.TensorSpec("w", (4, 3), self.w0),
                       factorps.TensorSpec("b", (3,), np.zeros(3))])

    def test_wrong_gradient_shape(self):
        for bad in (np.ones((3, 4), np.float32), np.ones(12, np.float32),
                    np.ones((4, 3, 1), np.float32), torch.ones(5, 3)):
            with self.assertRaises(factorps.InvalidArgumentError) as cm:
                self.c.push_pull({"w": bad, "b": np.ones(3)})
            self.assertIn("'w'", str(cm.exception))
            self.assertIn("(4, 3)", str(cm.exception))
        self.assertEqual(self.c.step, 0)
        params, versions = self.c.pull()
        np.testing.assert_array_equal(params["w"], self.w0)
        self.assertEqual(versions["w"], 0)

    def test_wrong_output_shape(self):
        with self.assertRaises(factorps.InvalidArgumentError):
            self.c.pull(["w"], out={"w": np.zeros((2, 6), np.float32)})
        with self.assertRaises(factorps.InvalidArgumentError):
            self.c.pull(["w"], out={"w": np.zeros((4, 3), np.float32)[:, :2]})

    def test_unknown_tensor(self):
        with self.assertRaises(factorps.NotFoundError):
            self.c.push_pull({"nope": np.ones(3)})
        with self.assertRaises(factorps.NotFoundError):
            self.c.pull(["nope"])

    def test_bad_create_arguments(self):
        for spec in (factorps.TensorSpec("z", (0, 3)), factorps.TensorSpec("", (3,)),
                     factorps.TensorSpec("deep", (1,) * 9),
                     factorps.TensorSpec("i", (2,), np.ones(3))):
            with self.assertRaises(factorps.InvalidArgumentError, msg=repr(spec)):
                self.c.create([spec])

    def test_invalid_hyperparameters_are_rejected(self):
        with self.assertRaises(factorps.InvalidArgumentError):
            self.c.create([factorps.TensorSpec(
                "hf_bad", (2, 2), np.ones((2, 2)),
                factorps.optimizer_config("hf", lr=1e-3, relative_step=True))])

    def test_tensor_changed_shape_between_runs(self):
        # Run 2 of a job whose model changed: same name, other shape.
        with factorps.connect(self.shards.addrs, deadline=10) as run2:
            with self.assertRaises(factorps.AlreadyExistsError) as cm:
                run2.create([factorps.TensorSpec("w", (5, 3), np.ones((5, 3))),
                             factorps.TensorSpec("b", (3,), np.zeros(3))])
            self.assertIn("w", cm.exception.message)
            # Same shape, other fixed optimizer settings: also a mismatch
            # (lr and weight_decay may differ: they change per push).
            with self.assertRaises(factorps.AlreadyExistsError):
                run2.create([factorps.TensorSpec("w", (4, 3), self.w0,
                                                 factorps.optimizer_config("torch", eps2=0.5)),
                             factorps.TensorSpec("b", (3,), np.zeros(3))])
            # The unchanged model still attaches, and sees run 1's values.
            run2.create([factorps.TensorSpec("w", (4, 3), np.ones((4, 3))),
                         factorps.TensorSpec("b", (3,), np.zeros(3))])
            np.testing.assert_array_equal(run2.pull(["w"])[0]["w"], self.w0)

    def test_a_refused_shape_reads_as_a_precondition(self):
        # A Create refused (ALREADY_EXISTS) still sets the client's list, so
        # reads then name a shape the shard does not hold. Smaller than the
        # shard's, they reported INTERNAL ("reply slice ... outside"), larger
        # FAILED_PRECONDITION; both say now that the shapes differ.
        for shape in ((2,), (5, 3)):
            with self.subTest(shape=shape), factorps.connect(self.shards.addrs, deadline=10) as other:
                with self.assertRaises(factorps.AlreadyExistsError):
                    other.create([factorps.TensorSpec("w", shape, np.ones(shape))])
                with self.assertRaisesRegex(factorps.FailedPreconditionError, "differs from the client's"):
                    other.pull(["w"])
                with self.assertRaisesRegex(factorps.FailedPreconditionError, "not fit the client's shape"):
                    other.get_state(["w"])

    def test_nonfinite_gradients_change_nothing(self):
        for bad in (math.nan, math.inf, -math.inf):
            g = np.ones((4, 3), np.float32)
            g[2, 1] = bad
            with self.assertRaises(factorps.InvalidArgumentError) as cm:
                self.c.push_pull({"w": g, "b": np.ones(3)})
            self.assertIn("w", cm.exception.message)
            self.assertEqual(self.c.step, 0)
        params, versions = self.c.pull()
        np.testing.assert_array_equal(params["w"], self.w0)
        self.assertEqual(versions, {"w": 0, "b": 0})
        # The same step with finite gradients then goes through.
        _, versions = self.c.push_pull({"w": np.ones((4, 3)), "b": np.ones(3)})
        self.assertEqual(versions, {"w": 1, "b": 1})

    def test_nan_through_the_optimizer(self):
        p = torch.nn.Parameter(torch.ones(4, 2))
        opt = RemoteAdafactor([("p", p)], client=self.c)
        p.grad = torch.ones(4, 2)
        opt.step()
        before = p.detach().clone()
        p.grad = torch.full((4, 2), float("nan"))
        # Skipped, as AMP expects (the shard would refuse it: INVALID_ARGUMENT).
        with self.assertLogs("factorps.torch", "WARNING") as logs:
            opt.step()
        self.assertIn("'p'", logs.output[0])
        self.assertTrue(opt.last_step_skipped)
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
        self.assertEqual(opt.remote_step, 1)
        p.grad = torch.ones(4, 2)
        opt.step()  # recovers: same step, finite gradient
        self.assertEqual(opt.remote_step, 2)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


@need_server
@need_server
class BindingInputTest(unittest.TestCase):
    """What the binding must refuse itself, as InvalidArgumentError, before
    a pointer or an integer reaches C: an audit of the package as a careless
    caller uses it found values that ctypes wrapped (worker_id 2^32 pushed
    as worker 0), names cut at a NUL, a lazily negated torch view read
    sign-flipped, an int32 `out` cut silently, an expanded `out` failing
    only after the push was applied, a typo in `settings` ignored, and
    built-in exceptions where the binding's classes were promised."""

    def setUp(self):
        self.shards = Shards(1, mode="async")
        self.addCleanup(self.shards.close)
        self.c = factorps.connect(self.shards.addrs, deadline=10)
        self.addCleanup(self.c.close)
        self.c.create([factorps.TensorSpec("w", (2,), np.ones(2, np.float32))])

    def test_refused_before_c(self):
        bad = {
            "connect worker_id 2^32": lambda: factorps.connect(self.shards.addrs, worker_id=2 ** 32),
            "connect max_retries 2^32": lambda: factorps.connect(self.shards.addrs, max_retries=2 ** 32),
            "connect max_message_bytes 2^70": lambda: factorps.connect(self.shards.addrs, max_message_bytes=2 ** 70),
            "connect None": lambda: factorps.connect(None),
            "job_id with NUL": lambda: factorps.connect(self.shards.addrs, job_id="a\0b"),
            "name with NUL": lambda: self.c.push_pull({"w\0x": np.ones(2)}),
            "name with a surrogate": lambda: self.c.create([factorps.TensorSpec("\ud800", (2,))]),
            "shape as a str": lambda: self.c.create([factorps.TensorSpec("s", "12")]),
            "shape of floats": lambda: self.c.create([factorps.TensorSpec("f", (2.7, 4))]),
            "shape past 2^63": lambda: self.c.create([factorps.TensorSpec("h", (2 ** 64 + 2,))]),
            "optimizer as a str": lambda: self.c.create([factorps.TensorSpec("o", (2,), optimizer="torch")]),
            "object init": lambda: self.c.create([factorps.TensorSpec("x", (2,), np.array([1, None]))]),
            "complex gradient": lambda: self.c.push_pull({"w": np.ones(2, np.complex64)}),
            "step 2^64+1": lambda: self.c.push_pull({"w": np.ones(2)}, step=2 ** 64 + 1),
            "num_workers 2^32+1": lambda: self.c.push_pull({"w": np.ones(2)}, num_workers=2 ** 32 + 1),
            "settings of a tensor not pushed": lambda: self.c.push_pull({"w": np.ones(2)},
                                                                          settings={"W": {"lr": 0.0}}),
            "settings not a dict": lambda: self.c.push_pull({"w": np.ones(2)}, settings={"w": 0.1}),
            "out of a tensor not pushed": lambda: self.c.push_pull({"w": np.ones(2)},
                                                                     out={"W": np.empty(2, np.float32)}),
            "int32 out": lambda: self.c.push_pull({"w": np.ones(2)}, out={"w": np.empty(2, np.int32)}),
            "expanded torch out": lambda: self.c.push_pull({"w": np.ones(2)},
                                                            out={"w": torch.zeros(1).expand(2)}),
            "meta torch out": lambda: self.c.pull(["w"], out={"w": torch.empty(2, device="meta")}),
            "sparse gradient": lambda: self.c.push_pull({"w": torch.ones(2).to_sparse()}),
        }
        for what, call in bad.items():
            with self.subTest(what):
                with self.assertRaises(factorps.InvalidArgumentError):
                    call()
        # Nothing of that was applied.
        self.assertEqual(self.c.pull(["w"])[1]["w"], 0)

    def test_a_negated_view_is_read_as_its_values(self):
        x = torch.tensor([1 + 2j, 3 + 4j]).conj().imag  # [-2, -4], lazily negated
        self.c.create([factorps.TensorSpec("n", (2,), init=x)])
        np.testing.assert_array_equal(self.c.pull(["n"])[0]["n"], [-2.0, -4.0])
        out = torch.tensor([1 + 0j, 1 + 0j]).conj().imag  # written through a negated view
        self.c.pull(["n"], out={"n": out})
        np.testing.assert_array_equal(out.resolve_neg().numpy(), [-2.0, -4.0])

    def test_a_closed_client_is_a_failed_precondition(self):
        c = factorps.connect(self.shards.addrs)
        c.close()
        with self.assertRaisesRegex(factorps.FailedPreconditionError, "client is closed"):
            c.pull(["w"])


class RestartTest(unittest.TestCase):
    """A shard dies or restarts in the middle of training: the worker gets a
    clear error in bounded time (never a hang)."""

    def _train(self, shards, deadline=4.0):
        model = _model()
        opt = RemoteAdafactor(model.parameters(), shards=shards.addrs, deadline=deadline,
                              max_retries=2, client_options={"backoff": 0.05})
        self.addCleanup(opt.close)
        x, y = torch.randn(16, 6), torch.randn(16, 2)

        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        return opt, step

    def test_shard_restarted_empty(self):
        with Shards(2) as shards:
            opt, step = self._train(shards)
            shards.restart(1)
            t0 = time.monotonic()
            with self.assertRaises(factorps.Error) as cm:
                step()
            self.assertLess(time.monotonic() - t0, 15.0)
            # The restarted shard has no tensors: NOT_FOUND, or a shard
            # reached too early: UNAVAILABLE. Either names shard 1.
            self.assertIn(cm.exception.code_name,
                          ("NOT_FOUND", "FAILED_PRECONDITION", "UNAVAILABLE"), str(cm.exception))
            self.assertEqual(cm.exception.shard, 1, str(cm.exception))
            # Shard 0 applied that step, the new shard 1 is empty: re-reading
            # the shards recreates shard 1's tensors at version 0 and then
            # refuses to go on with shards that disagree on the step.
            with self.assertRaisesRegex(factorps.FailedPreconditionError, "versions"):
                opt.setup()

    def test_shard_killed(self):
        with Shards(2) as shards:
            opt, step = self._train(shards)
            shards.kill(0)
            t0 = time.monotonic()
            with self.assertRaises((factorps.UnavailableError, factorps.DeadlineExceededError)):
                step()
            self.assertLess(time.monotonic() - t0, 15.0)


@need_server
class SyncDeadlineTest(unittest.TestCase):
    def test_missing_worker_ends_in_deadline_not_hang(self):
        with Shards(1, workers=2, deadline=2) as shards:
            with factorps.connect(shards.addrs, worker_id=0, deadline=5) as c:
                c.create([factorps.TensorSpec("w", (2, 2), np.ones((2, 2)))])
                t0 = time.monotonic()
                with self.assertRaises(factorps.Error) as cm:
                    c.push_pull({"w": np.ones((2, 2))})  # worker 1 never pushes
                self.assertLess(time.monotonic() - t0, 12.0)
                self.assertIn(cm.exception.code_name, ("DEADLINE_EXCEEDED", "ABORTED",
                                                       "UNAVAILABLE"))


if __name__ == "__main__":
    unittest.main()

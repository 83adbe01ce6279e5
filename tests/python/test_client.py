"""The factorps binding against real shards: create, push_pull, pull, stats,
zero-copy buffers, threads, close."""

import threading
import unittest

import numpy as np
import torch

import _support  # noqa: F401  (puts client/python on sys.path)
from _support import Shards, need_server
import factorps
from factorps.reference import ReferenceAdafactor, adamw_state_elements, state_elements

SHAPES = {"emb": (40, 16), "w1": (16, 8), "b1": (8,), "w3d": (2, 3, 5), "scalar": ()}


def _init(seed=0):
    rng = np.random.default_rng(seed)
    return {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


@need_server
class ClientTest(unittest.TestCase):
    def setUp(self):
        self.shards = Shards(2, mode="sync", workers=1)
        self.addCleanup(self.shards.close)
        self.client = factorps.connect(self.shards.addrs, worker_id=0, deadline=20)
        self.addCleanup(self.client.close)
        self.init = _init()
        self.client.create([factorps.TensorSpec(n, SHAPES[n], self.init[n]) for n in SHAPES])

    def test_pull_returns_initial_values(self):
        params, versions = self.client.pull()
        self.assertEqual(list(params), list(SHAPES))
        for n in SHAPES:
            np.testing.assert_array_equal(params[n], self.init[n])
            self.assertEqual(params[n].dtype, np.float32)
            self.assertEqual(versions[n], 0)

    def test_placement_uses_both_shards(self):
        where = {n: self.client.shard_of(n) for n in SHAPES}
        self.assertEqual(set(where.values()), {0, 1}, where)
        self.assertEqual(self.client.shard_of("no-such-tensor"), -1)

    def test_chunked_push_equals_one_call(self):
        # push_chunk_bytes=1: a call per tensor (or per few small ones) to
        # each shard, against one call per shard on a second pair of shards:
        # the same parameters and versions, bit for bit, and more calls.
        other = Shards(2, mode="sync", workers=1)
        self.addCleanup(other.close)
        one = factorps.connect(other.addrs, deadline=20, push_chunk_bytes=0)
        self.addCleanup(one.close)
        one.create([factorps.TensorSpec(n, SHAPES[n], self.init[n]) for n in SHAPES])
        chunked = factorps.connect(self.shards.addrs, deadline=20, push_chunk_bytes=1)
        self.addCleanup(chunked.close)
        chunked.create([factorps.TensorSpec(n, SHAPES[n], None) for n in SHAPES])
        rng = np.random.default_rng(3)
        for _ in range(3):
            grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
            got, gv = chunked.push_pull(grads)
            want, wv = one.push_pull(grads)
            self.assertEqual(gv, wv)
            for n in SHAPES:
                np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        calls = sum(s["pushes"] for s in chunked.stats())
        self.assertEqual(sum(s["pushes"] for s in one.stats()), 3 * 2)
        self.assertGreater(calls, 3 * 2)
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.connect(self.shards.addrs, push_chunk_bytes=-1)

    def test_bf16_cuts_the_chunks_fp32_cuts(self):
        # push_chunk_bytes counts fp32 bytes whatever the wire dtype: four
        # 250-element tensors (1000 fp32 bytes each) with a 2000-byte chunk
        # are two calls per push in fp32 and in bf16 alike (in bf16 wire
        # bytes they would fit one chunk of 2000 and go as one call).
        shapes = {f"t{i}": (250,) for i in range(4)}
        calls = {}
        for wire in ("f32", "bf16"):
            shards = Shards(1, mode="sync", workers=1)
            self.addCleanup(shards.close)
            c = factorps.connect(shards.addrs, deadline=20, push_chunk_bytes=2000, wire_dtype=wire)
            self.addCleanup(c.close)
            c.create([factorps.TensorSpec(n, s, np.zeros(s, np.float32)) for n, s in shapes.items()])
            c.push_pull({n: np.ones(s, np.float32) for n, s in shapes.items()})
            calls[wire] = c.stats()[0]["pushes"]
        self.assertEqual(calls, {"f32": 2, "bf16": 2})

    def test_push_pull_matches_reference(self):
        refs = {n: ReferenceAdafactor(s, "torch") for n, s in SHAPES.items()}
        want = dict(self.init)
        rng = np.random.default_rng(1)
        for step in range(4):
            grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
            params, versions = self.client.push_pull(grads)
            self.assertEqual(self.client.step, step + 1)
            for n in SHAPES:
                want[n] = refs[n].step(want[n], grads[n])
                self.assertEqual(versions[n], step + 1)
                np.testing.assert_allclose(params[n], want[n], rtol=0, atol=2e-6 * (step + 1),
                                           err_msg=n)

    def test_outputs_are_written_in_place(self):
        grads = {n: np.full(s, 0.1, np.float32) for n, s in SHAPES.items()}
        out_np = np.zeros(SHAPES["w1"], np.float32)
        out_t = torch.zeros(SHAPES["emb"])
        ptr = out_t.data_ptr()
        # A transposed (non-contiguous) view cannot be written by pointer: the
        # binding must copy back into it.
        base = torch.zeros(SHAPES["w3d"][::-1])
        out_view = base.permute(2, 1, 0)
        self.assertFalse(out_view.is_contiguous())
        params, _ = self.client.push_pull(grads, out={"w1": out_np, "emb": out_t,
                                                      "w3d": out_view})
        self.assertIs(params["w1"], out_np)
        self.assertIs(params["emb"], out_t)
        self.assertEqual(out_t.data_ptr(), ptr)
        fresh, _ = self.client.pull()
        np.testing.assert_array_equal(out_np, fresh["w1"])
        np.testing.assert_array_equal(out_t.numpy(), fresh["emb"])
        np.testing.assert_array_equal(out_view.numpy(), fresh["w3d"])
        self.assertFalse(np.array_equal(fresh["w1"], self.init["w1"]))

    def test_other_dtypes_and_torch_grads_are_accepted(self):
        grads = {n: torch.randn(s, dtype=torch.float64) for n, s in SHAPES.items()}
        grads["b1"] = np.arange(8, dtype=np.int64)  # any real numbers convert
        _, versions = self.client.push_pull(grads, want_params=False)
        self.assertEqual(set(versions.values()), {1})

    def test_versions_only(self):
        params, versions = self.client.pull(want_params=False)
        self.assertEqual(params, {})
        self.assertEqual(set(versions.values()), {0})

    def test_skip_step_reaches_the_shard(self):
        # skip_step alone must travel (the shard refuses it without no_grad)
        # rather than be dropped, which pushed and applied the gradient.
        grads = {n: np.ones(s, np.float32) for n, s in SHAPES.items()}
        with self.assertRaisesRegex(factorps.InvalidArgumentError, "skip_step needs no_grad"):
            self.client.push_pull(grads, settings={"w1": {"skip_step": True}})
        _, versions = self.client.pull(want_params=False)
        self.assertEqual(versions["w1"], 0)
        # With no_grad (what an AMP step with an Inf sends): nothing applied.
        params, versions = self.client.push_pull(
            {"w1": None}, settings={"w1": {"no_grad": True, "skip_step": True}})
        self.assertEqual(versions["w1"], 0)
        np.testing.assert_array_equal(params["w1"], self.init["w1"])

    def test_stats_per_shard(self):
        self.client.push_pull({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
        stats = self.client.stats()
        self.assertEqual(len(stats), 2)
        for i, s in enumerate(stats):
            self.assertEqual(s["shard_id"], i)
            self.assertEqual(s["shard_count"], 2)
            self.assertEqual(s["mode"], "sync")
            mine = [n for n in SHAPES if self.client.shard_of(n) == i]
            self.assertEqual(s["tensors"], len(mine))
            self.assertEqual(s["state_elements"], sum(state_elements(SHAPES[n]) for n in mine))
            self.assertEqual(s["state_bytes"], 4 * s["state_elements"])
            self.assertEqual(s["adamw_elements"], sum(adamw_state_elements(SHAPES[n])
                                                      for n in mine))
            self.assertEqual(s["pushes"], 1)
            self.assertGreater(s["push_seconds_sum"], 0.0)
            self.assertIsInstance(s["simd"], str)

    def test_tensor_stats(self):
        self.client.push_pull({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
        t = self.client.tensor_stats("emb", log=4)
        self.assertEqual(t["name"], "emb")
        self.assertEqual(t["shape"], SHAPES["emb"])
        self.assertEqual(t["version"], 1)
        self.assertTrue(t["factored"])
        self.assertEqual(t["flavor"], "torch")
        self.assertEqual(t["state_elements"], 40 + 16)
        # The values the update applied: the Create defaults (torch lr 1e-2, wd 0).
        self.assertEqual(t["apply_log"], [dict(worker_id=0, step=0, version=1, lr=1e-2, weight_decay=0.0)])

    def test_threads_share_one_client(self):
        errors = []

        def reader():
            try:
                for _ in range(20):
                    params, _ = self.client.pull()
                    np.testing.assert_array_equal(params["b1"], self.init["b1"])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])

    def test_close_is_idempotent_and_final(self):
        c = factorps.connect(self.shards.addrs)
        with c:
            c.create([factorps.TensorSpec(n, SHAPES[n], self.init[n]) for n in SHAPES])
            c.pull(["b1"])
        c.close()
        with self.assertRaises(factorps.Error) as cm:
            c.pull(["b1"])
        self.assertEqual(cm.exception.code_name, "FAILED_PRECONDITION")

    def test_second_worker_without_init_gets_worker0_values(self):
        with factorps.connect(self.shards.addrs, worker_id=1, deadline=5) as c:
            c.create([factorps.TensorSpec(n, SHAPES[n]) for n in SHAPES])
            params, _ = c.pull()
            for n in SHAPES:
                np.testing.assert_array_equal(params[n], self.init[n])


@need_server
class LargeTensorTest(unittest.TestCase):
    def test_tensor_larger_than_a_message(self):
        # 4.8 MB through the default 4 MiB messages: the library slices,
        # Python passes one pointer per tensor either way.
        shape = (1200, 1000)
        rng = np.random.default_rng(3)
        w0 = rng.standard_normal(shape).astype(np.float32)
        g = rng.standard_normal(shape).astype(np.float32)
        with Shards(1) as shards, factorps.connect(shards.addrs, deadline=30) as c:
            c.create([factorps.TensorSpec("big", shape, w0)])
            np.testing.assert_array_equal(c.pull(["big"])[0]["big"], w0)
            g_copy = g.copy()
            params, _ = c.push_pull({"big": g}, out={"big": g})  # in place, aliasing the grad
            self.assertIs(params["big"], g)
            want = ReferenceAdafactor(shape, "torch").step(w0, g_copy)
            np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
            np.testing.assert_array_equal(c.pull(["big"])[0]["big"], g)

    def test_small_message_limit(self):
        # A client that sends in 256 KiB messages must still take the
        # shard's replies, which come in messages of up to 4 MiB.
        shape = (1200, 1000)
        w0 = np.full(shape, 0.25, np.float32)
        with Shards(1) as shards, factorps.connect(shards.addrs, deadline=30,
                                                   max_message_bytes=256 * 1024) as c:
            c.create([factorps.TensorSpec("big", shape, w0)])
            np.testing.assert_array_equal(c.pull(["big"])[0]["big"], w0)
            params, versions = c.push_pull({"big": np.ones(shape, np.float32)})
            self.assertEqual(versions["big"], 1)
            self.assertTrue(np.all(params["big"] < 0.25))

    def test_second_worker_sends_one_message_of_a_ready_tensor(self):
        # Every worker Creates the model with its values; the first values
        # win. Once a reply says the tensor is ready, the rest of its
        # values is not sent: in 256 KiB messages a 4.8 MB tensor takes
        # about 19 Creates from the first worker and 1 from the next.
        shape = (1200, 1000)
        w0 = np.full(shape, 0.25, np.float32)
        with Shards(1, metrics=True) as shards:
            first = shards.rpc_count("Create")
            with factorps.connect(shards.addrs, deadline=30, max_message_bytes=256 * 1024) as a:
                a.create([factorps.TensorSpec("big", shape, w0)])
            uploads = shards.rpc_count("Create") - first
            self.assertGreater(uploads, 10)
            with factorps.connect(shards.addrs, deadline=30, max_message_bytes=256 * 1024) as b:
                b.create([factorps.TensorSpec("big", shape, np.ones(shape, np.float32))])
                self.assertEqual(shards.rpc_count("Create") - first - uploads, 1)
                np.testing.assert_array_equal(b.pull(["big"])[0]["big"], w0)

    def test_bf16_on_the_wire(self):
        # wire_dtype="bf16": the shard gets the gradient rounded to bf16,
        # steps its fp32 weights, and push_pull returns them rounded to
        # bf16; pull() still reads the exact fp32 master weights.
        shape = (300, 257)
        rng = np.random.default_rng(5)
        w0 = rng.standard_normal(shape).astype(np.float32)
        g = rng.standard_normal(shape).astype(np.float32)

        def bf16(x):  # round to nearest even, as libfactorps does (no NaN here)
            u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
            return u.astype(np.uint32).view(np.float32)

        with Shards(1) as shards, factorps.connect(shards.addrs, deadline=30,
                                                   wire_dtype="bf16") as c:
            c.create([factorps.TensorSpec("w", shape, w0)])
            np.testing.assert_array_equal(c.pull(["w"])[0]["w"], w0)  # create is exact fp32
            params, versions = c.push_pull({"w": g})
            self.assertEqual(versions["w"], 1)
            master = c.pull(["w"])[0]["w"]
            np.testing.assert_array_equal(params["w"], bf16(master))
            self.assertFalse(np.array_equal(params["w"], master))
            want = ReferenceAdafactor(shape, "torch").step(w0, bf16(g))
            np.testing.assert_allclose(master, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))

class OptionsTest(unittest.TestCase):
    def test_bad_options_raise_before_any_network(self):
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.connect([])
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.connect(["127.0.0.1:1"], worker_id=-1)
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.connect(["127.0.0.1:1"], wire_dtype="fp8")
        for bad in (-1, 1 << 64, 1.5, "32Mi", True):
            with self.subTest(split_min_bytes=bad):
                with self.assertRaises(factorps.InvalidArgumentError) as cm:
                    factorps.connect(["127.0.0.1:1"], split_min_bytes=bad)
                self.assertIn("split_min_bytes", str(cm.exception))
        with factorps.connect(["127.0.0.1:1"],
                              split_min_bytes=factorps.SPLIT_MIN_BYTES_DEFAULT) as c:
            self.assertEqual(c.split_min_bytes, 32 << 20)
        with factorps.connect(["127.0.0.1:1"]) as c:
            self.assertEqual(c.split_min_bytes, 0)  # never splits unless asked
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.optimizer_config("torch", beta1=0.9)  # an hf-only field
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.optimizer_config("adam")

    def test_placement_plan(self):
        # emb (320 bytes) splits at 64 bytes: bias (12 bytes) goes first to
        # shard 0, then emb is water-filled (L = 166: 154 bytes = 5 rows on
        # shard 0, the rest on shard 1); at 0 nothing splits.
        plan, shard_bytes = factorps.placement_plan({"emb": (10, 8), "bias": (3,)}, 2, 64)
        self.assertEqual(plan["emb"], [(0, 0, 5), (1, 5, 10)])
        self.assertEqual(plan["bias"], [(0, 0, 3)])
        self.assertEqual(shard_bytes, [172, 160])
        plan, shard_bytes = factorps.placement_plan([("emb", (10, 8)), ("bias", (3,))], 2)
        self.assertEqual(plan, {"emb": [(0, 0, 10)], "bias": [(1, 0, 3)]})
        self.assertEqual(shard_bytes, [320, 12])
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.placement_plan({"a": (2,), "b": (0,)}, 2)
        with self.assertRaises(factorps.InvalidArgumentError):
            factorps.placement_plan({"a": (2,)}, 0)

    def test_blocks_follow_the_plan(self):
        # The tensor list is the client's once create() validated it, even
        # when no shard answers (nothing listens on port 1).
        with factorps.connect(["127.0.0.1:1"] * 2, split_min_bytes=64, deadline=1,
                              max_retries=0) as c:
            with self.assertRaises(factorps.Error):
                c.create([factorps.TensorSpec("emb", (10, 8), init=np.zeros((10, 8))),
                          factorps.TensorSpec("bias", (3,), init=np.zeros(3))])
            self.assertEqual(c.blocks("emb"), [(0, 0, 5), (1, 5, 10)])
            self.assertEqual(c.blocks("bias"), [(0, 0, 3)])
            self.assertEqual(c.shard_of("emb"), 0)
            with self.assertRaises(factorps.NotFoundError):
                c.blocks("nope")

    def test_errors_carry_status(self):
        e = factorps.errors.error_for(14, "shard 1 (x): gone", 1)
        self.assertIsInstance(e, factorps.UnavailableError)
        self.assertIsInstance(e, factorps.Error)
        self.assertEqual((e.code, e.code_name, e.shard), (14, "UNAVAILABLE", 1))
        self.assertIn("gone", str(e))
        self.assertEqual(factorps.errors.error_for(99, "x").code_name, "CODE_99")


if __name__ == "__main__":
    unittest.main()

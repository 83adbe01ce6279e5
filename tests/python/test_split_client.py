"""libfactorps' routing of split tensors, through real shards.

With split_min_bytes=1 every tensor of >= 2 rows is cut into the plan's row
blocks. Created with a resume state (step > 0: params, row and column
statistics or variance, hf momentum, RMS), every block's shard gets its
part, and reading back assembles the whole tensor exactly:
  - Pull returns the initial values bit for bit, at version = step;
  - GetState returns the state given, bit for bit (the column statistics
    of a matrix several blocks touch come from each of them and must agree),
    with the step and RMS;
  - Client.blocks() says where each block went, and the shards' Stats count
    the blocks' bytes: the plan's bytes per shard.
Shapes: a matrix over 3 shards, a 3-D tensor over 4 (blocks spanning
matrices, a one-row block), a 1-D tensor over 2; torch and hf with beta1.
Stats count each shard's blocks and their exchange (`factorps stats`
prints both). Pushes: with wire_dtype bf16 the fresh params come back in bf16 from
every block's shard into the caller's array at the block's rows; a run
split over 3 shards gets exactly the bf16 params (and versions) the same
run gets from one shard holding everything whole (the split step is
bit-identical to the whole one, tests/python/test_split_golden.py).
A client that did not create the tensors (discover) rebuilds each split
tensor's blocks from the shards' Stats and pulls it whole; Stats and
tensor_stats show the blocks, and a block lost with its shard (restarted
empty) makes discover fail with DATA_LOSS naming the block and the shard.
A shard without --peers refuses a block with FAILED_PRECONDITION, and the
error names the tensor and the shard.
"""

import os
import subprocess
import unittest

import numpy as np

from _support import Shards, need_server
import factorps

RNG = np.random.default_rng(12)
CLI = os.environ.get("FACTORPS_CLI", "")  # ctest sets it

TENSORS = {
    # name: (shape, flavor options, shard count)
    "mat": ((7, 5), factorps.optimizer_config("torch"), 3),
    "cube": ((3, 2, 4), factorps.optimizer_config("hf", beta1=0.9), 4),
    "vec": ((7,), factorps.optimizer_config("hf", beta1=0.9), 2),
}


def resume_spec(name, shape, opt, step=3):
    init = RNG.standard_normal(shape).astype(np.float32)
    has_mom = opt.get("beta1") is not None
    state = {k: np.abs(RNG.standard_normal(n)).astype(np.float32) + 0.01
             for k, n in factorps.client.state_sizes(shape, False).items()}
    if has_mom:
        state["mom"] = RNG.standard_normal(int(np.prod(shape))).astype(np.float32)
    rms = 0.75 if opt["flavor"] == "hf" else 0.0
    return factorps.TensorSpec(name, shape, init=init, optimizer=opt, step=step, state=state,
                               rms=rms)


@need_server
class SplitRoutingTest(unittest.TestCase):
    def test_resume_state_round_trips_exactly(self):
        for name, (shape, opt, S) in TENSORS.items():
            with self.subTest(tensor=name, shards=S), Shards(S, peers=True) as s:
                spec = resume_spec(name, shape, opt)
                filler = factorps.TensorSpec("filler", (3,), init=np.ones(3, np.float32))
                with factorps.connect(s.addrs, split_min_bytes=16) as c:
                    c.create([spec, filler])
                    plan, shard_bytes = factorps.placement_plan(
                        {name: shape, "filler": (3,)}, S, 16)
                    self.assertEqual(c.blocks(name), plan[name])
                    self.assertGreater(len(plan[name]), 1, plan)
                    params, versions = c.pull([name])
                    np.testing.assert_array_equal(params[name].reshape(shape), spec.init)
                    self.assertEqual(versions[name], 3)
                    st = c.get_state([name])[name]
                    self.assertEqual((st["version"], st["step"]), (3, 3))
                    self.assertAlmostEqual(st["rms"], spec.rms, places=6)
                    for kind, want in spec.state.items():
                        np.testing.assert_array_equal(st[kind], want, f"{name} {kind}")
                    stats = c.stats()
                    self.assertEqual([x["param_bytes"] for x in stats], shard_bytes)

    def test_blocks_span_matrices_and_single_rows(self):
        plan, _ = factorps.placement_plan({"cube": (3, 2, 4), "filler": (3,)}, 4, 16)
        rows = [(lo, hi) for _, lo, hi in plan["cube"]]
        self.assertTrue(any(hi - lo == 1 for lo, hi in rows), rows)
        self.assertTrue(any(lo // 2 != (hi - 1) // 2 for lo, hi in rows), rows)

    def bf16_run(self, addrs, split):
        rng = np.random.default_rng(5)
        init = {"mat": rng.standard_normal((7, 5)).astype(np.float32),
                "vec": rng.standard_normal(9).astype(np.float32)}
        out = []
        with factorps.connect(addrs, split_min_bytes=split, wire_dtype="bf16") as c:
            c.create([factorps.TensorSpec(n, a.shape, init=a) for n, a in init.items()])
            if split:
                self.assertTrue(all(len(c.blocks(n)) > 1 for n in init), init)
            for step in range(3):
                grads = {n: rng.standard_normal(a.shape).astype(np.float32)
                         for n, a in init.items()}
                params, versions = c.push_pull(grads)
                self.assertEqual(set(versions.values()), {step + 1})
                out.append({n: np.array(p) for n, p in params.items()})
            if split:
                # Each shard's blocks, exchanged every step.
                held = [sum(sh == i for n in init for sh, _, _ in c.blocks(n)) for i in range(3)]
                for st, k in zip(c.stats(), held):
                    self.assertEqual(st["split_blocks"], k, st)
                    self.assertGreaterEqual(st["exchange_steps"], 3, st)
                    self.assertEqual(st["exchange_failures"], 0, st)
                    self.assertGreater(st["exchange_sent_bytes"], 0, st)
                if CLI:
                    text = subprocess.run([CLI, "stats", "--shards", ",".join(addrs)], check=True,
                                          stdout=subprocess.PIPE, text=True, timeout=60).stdout
                    for k in held:
                        self.assertIn(f"of which split-tensor blocks {k} ", text)
                    self.assertEqual(text.count("exchange: "), 3, text)
        return out

    def test_bf16_replies_land_at_each_blocks_rows(self):
        with Shards(1) as s:
            whole = self.bf16_run(s.addrs, 0)
        with Shards(3, peers=True) as s:
            split = self.bf16_run(s.addrs, 16)
        for w, p in zip(whole, split):
            for n in w:
                np.testing.assert_array_equal(p[n], w[n], n)

    def test_discover_rebuilds_the_blocks(self):
        with Shards(3, peers=True) as s:
            spec = resume_spec("mat", (7, 5), factorps.optimizer_config("torch"))
            with factorps.connect(s.addrs, split_min_bytes=16) as c:
                c.create([spec])
                blocks = c.blocks("mat")
            self.assertEqual(len(blocks), 3)
            with factorps.connect(s.addrs) as d:  # no split_min_bytes: the shards say
                self.assertEqual(d.discover(), 1)
                self.assertEqual(d.blocks("mat"), blocks)
                params, versions = d.pull(["mat"])
                np.testing.assert_array_equal(params["mat"].reshape(7, 5), spec.init)
                self.assertEqual(versions["mat"], 3)
                stats = d.stats()
                self.assertEqual([x["split_blocks"] for x in stats], [1, 1, 1])
                self.assertEqual([x["split_param_bytes"] for x in stats],
                                 [(hi - lo) * 5 * 4 for _, lo, hi in blocks])
                ts = d.tensor_stats("mat")
                self.assertEqual((ts["shape"], ts["n_blocks"], ts["block_index"]), ((7, 5), 3, 0))
                self.assertEqual((ts["row_lo"], ts["row_hi"]), blocks[0][1:])
            s.restart(1)  # empty: block 1 is gone
            with factorps.connect(s.addrs) as d:
                with self.assertRaises(factorps.DataLossError) as cm:
                    d.discover()
                self.assertIn("tensor 'mat' block 1", str(cm.exception))
                self.assertIn("shard 1", str(cm.exception))

    def test_a_refused_block_shard_ends_the_push(self):
        """A block shard restarted from an older checkpoint refuses the next
        push (FAILED_PRECONDITION); the other block's shard waits out its
        exchange deadline for partials that never come (UNAVAILABLE).
        libfactorps retried that shard up to max_retries times, an exchange
        deadline each (a minute with the defaults), for a call that had
        failed; now the refusal ends the call after one attempt, and it is
        what the call reports."""
        with Shards(2, peers=True, checkpoint=3600, extra=["--exchange-deadline", "2"], metrics=True) as s, \
                factorps.connect(s.addrs, split_min_bytes=1024, deadline=60) as c:
            rng = np.random.default_rng(3)
            c.create([factorps.TensorSpec("emb", (64, 16), init=rng.standard_normal((64, 16)).astype(np.float32)),
                      factorps.TensorSpec("b", (16,), init=np.zeros(16, np.float32))])
            self.assertEqual(len(c.blocks("emb")), 2)
            grads = {"emb": np.ones((64, 16), np.float32), "b": np.ones(16, np.float32)}
            for _ in range(2):
                c.push_pull(grads)
            c.checkpoint()  # every block and tensor at version 2
            for _ in range(2):
                c.push_pull(grads)  # version 4, not in the checkpoint
            gone = c.shard_of("b")
            other = 1 - gone
            s.restart(gone)  # back at version 2, 'b' with it
            c.stats()  # the channel to the new process is up (its first call could fail locally)
            before = s.rpc_count("PushPull", shards=[other])
            with self.assertRaises(factorps.FailedPreconditionError) as cm:
                c.push_pull(grads)
            self.assertIn(f"shard {gone}", str(cm.exception))
            self.assertEqual(s.rpc_count("PushPull", shards=[other]) - before, 1)

    def test_blocks_apart_for_good_are_refused_at_once(self):
        """Without anchors, a block shard restarted one step behind leaves
        the blocks at versions no block can go back to. The shards learn it
        from each other's version lists, and both then refused steps: the
        restarted one at once, the other only after its exchange deadline,
        waiting for partials that could never come (30 s here, per push).
        Now both refuse at once, naming every block's versions, and a
        replace of the tensor (a new history) lets it train again."""
        import time
        with Shards(2, peers=True, checkpoint=3600, metrics=True,
                    extra=["--exchange-deadline", "30", "--split-anchor-steps", "0"]) as s, \
                factorps.connect(s.addrs, split_min_bytes=1024, deadline=60) as c:
            init = np.random.default_rng(4).standard_normal((64, 16)).astype(np.float32)
            c.create([factorps.TensorSpec("emb", (64, 16), init=init)])
            self.assertEqual(len(c.blocks("emb")), 2)
            grads = {"emb": np.ones((64, 16), np.float32)}
            for _ in range(2):
                c.push_pull(grads)
            c.checkpoint()  # both blocks at version 2
            c.push_pull(grads)  # version 3, not in the checkpoint
            s.restart(0)  # block 0 back at version 2
            apart = "no version is held by every block"
            end = time.monotonic() + 20
            while not all(apart in s.log(i) for i in range(2)) and time.monotonic() < end:
                time.sleep(0.05)
            self.assertTrue(all(apart in s.log(i) for i in range(2)), s.log(0) + s.log(1))
            before = s.rpc_count("PushPull")
            t0 = time.monotonic()
            with self.assertRaises(factorps.FailedPreconditionError) as cm:
                c.push_pull(grads)
            # Far below the 30 s exchange deadline: nobody waited for it.
            self.assertLess(time.monotonic() - t0, 15)
            self.assertIn(apart, str(cm.exception))
            self.assertRegex(str(cm.exception), r"this block \[[23]\], shard [01] \[[23]\]")
            # At most one call per shard (the first refusal may cancel the
            # other), no retries.
            self.assertIn(s.rpc_count("PushPull") - before, (1, 2))
            c.create([factorps.TensorSpec("emb", (64, 16), init=init, replace=True)])
            _, versions = c.push_pull(grads, step=0)
            self.assertEqual(versions["emb"], 1)

    def test_a_replace_drops_the_old_anchors(self):
        """A replace starts the tensor's history again, so the anchors of
        the old one (versions the blocks could agree on after a crash) go,
        from the disk too: otherwise shards restarted later would find the
        same old versions on every block and roll back into the old
        history. An anchor after the replace is of the new history."""
        with Shards(2, peers=True, checkpoint=3600, extra=["--split-anchor-steps", "1"]) as s, \
                factorps.connect(s.addrs, split_min_bytes=1024, deadline=60) as c:
            init = np.random.default_rng(5).standard_normal((64, 16)).astype(np.float32)
            c.create([factorps.TensorSpec("emb", (64, 16), init=init)])
            grads = {"emb": np.ones((64, 16), np.float32)}
            for _ in range(3):
                c.push_pull(grads)

            def anchors():
                found = []
                for i in range(2):
                    for root, _, files in os.walk(os.path.join(s.dir, f"ckpt{i}", "anchors")):
                        found += [f for f in files if f.startswith("ckpt-")]
                return found

            self.assertEqual(len(anchors()), 6)  # versions 1, 2, 3 on both shards
            c.create([factorps.TensorSpec("emb", (64, 16), init=init, replace=True)])
            self.assertEqual(anchors(), [])
            c.push_pull(grads, step=0)
            self.assertEqual(len(anchors()), 2)  # version 1 of the new history

    def test_shard_without_peers_refuses_a_block(self):
        with Shards(2) as s, factorps.connect(s.addrs, split_min_bytes=16, deadline=20) as c:
            with self.assertRaises(factorps.FailedPreconditionError) as cm:
                c.create([factorps.TensorSpec("mat", (7, 5), init=np.zeros((7, 5)))])
            msg = str(cm.exception)
            self.assertIn("'mat'", msg)
            self.assertIn("no --peers", msg)
            self.assertRegex(msg, r"shard \d")


if __name__ == "__main__":
    unittest.main()

"""The golden vectors through the service with every tensor split into row
blocks over 2, 3 and 4 shards.

Every golden case with >= 2 rows (rows of the [..., R, C] view; elements
for 1-D) runs its 5 steps through real shards (sync, 1 worker, --peers)
with split_min_bytes=1, i.e. every such tensor cut into row blocks by the
placement plan. All cases of a shard count run in one job, so each tensor
is water-filled onto shards that already hold other cases' blocks: the
blocks come out of unequal sizes, some of a single row, some spanning the
matrices of a 3-D tensor (the test checks the plan has each kind; blocks
spanning matrices come out over 3 shards). A case
the plan leaves whole (the lightest shard could take all of it) runs again
in a further round with the remaining ones, until every case was split.

Checked, per shard count:
  - the params after every step and the final state (GetState: the whole
    tensor's state assembled from the blocks) pass
    tests/vectors/check_vectors.py --require-state with its own tolerances;
  - so does the final state read from the shards' checkpoints (written
    after the last step, read with tests/unit/common/checkpoint_read.py, numpy
    only: each file holds its shard's blocks, and the blocks' copies of a
    matrix's column state must agree), and the checkpoints' params equal
    the last step's;
  - the split run against the unsplit run of the same cases (one shard,
    every tensor whole): params after every step within
    max|split - whole| <= 1e-6 * max(max|whole|, max|whole step|) and
    state within 1e-6 relative (floor 1e-6 * max): both sides run the same
    kernel, the split one sums its double-precision partials in another
    order, so they may differ by a few float32 roundings and no more.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import _support
from _support import Shards, need_server
import factorps

sys.path.insert(0, os.path.join(_support.REPO, "tests", "unit", "common"))
import checkpoint_read  # noqa: E402  (the numpy-only checkpoint reader)

VECTORS = os.path.join(_support.REPO, "tests", "vectors")
ROOT = os.path.join(VECTORS, "adafactor")
STEPS = 5
PARAM_TOL = 1e-6
STATE_TOL = 1e-6


def rows_of(shape):
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // shape[-1] if len(shape) >= 2 else n


def load_cases():
    with open(os.path.join(ROOT, "index.json")) as f:
        index = json.load(f)
    return index, [c for c in index["cases"] if rows_of(c["shape"]) >= 2]


def optimizer_of(case):
    """A golden case's resolved hyperparameters as factorps.optimizer_config."""
    hp = case["hparams"]
    if case["flavor"] == "torch":
        return factorps.optimizer_config(
            "torch", lr=hp["lr"], beta2_decay=hp["beta2_decay"], eps1=hp["eps1"],
            eps2=hp["eps2"], clip_threshold=hp["d"], weight_decay=hp["weight_decay"],
            maximize=hp["maximize"])
    return factorps.optimizer_config(
        "hf", lr=hp["lr"], beta2_decay=hp["decay_rate"], eps1=hp["eps1"], eps2=hp["eps2"],
        clip_threshold=hp["clip_threshold"], weight_decay=hp["weight_decay"],
        relative_step=hp["relative_step"], scale_parameter=hp["scale_parameter"],
        warmup_init=hp["warmup_init"], beta1=hp["beta1"])


def f32(path, shape=None):
    a = np.fromfile(path, "<f4")
    return a.reshape(shape) if shape is not None else a


def run_round(addrs, cases, split, prefix, out):
    """Creates `cases` (named prefix + case name) on the shards, pushes their
    5 steps in one call per step, reads their state, and writes the results
    in check_vectors.py's layout under out/<case>/."""
    with factorps.connect(addrs, split_min_bytes=split, deadline=120) as c:
        specs = []
        for case in cases:
            init = f32(os.path.join(ROOT, case["files"]["param_init"]), case["shape"])
            specs.append(factorps.TensorSpec(prefix + case["name"], tuple(case["shape"]),
                                             init=init, optimizer=optimizer_of(case)))
        c.create(specs)
        for t in range(1, STEPS + 1):
            grads = {prefix + case["name"]:
                     f32(os.path.join(ROOT, case["files"]["grads"][t - 1]), case["shape"])
                     for case in cases}
            params, versions = c.push_pull(grads, step=t - 1)
            for case in cases:
                name = prefix + case["name"]
                assert versions[name] == t, (name, versions[name], t)
                d = os.path.join(out, case["name"])
                os.makedirs(d, exist_ok=True)
                np.asarray(params[name], "<f4").tofile(os.path.join(d, f"param_{t}.bin"))
        states = c.get_state([prefix + case["name"] for case in cases])
        for case in cases:
            st = states[prefix + case["name"]]
            assert st["version"] == STEPS and st["step"] == STEPS, (case["name"], st)
            for kind in factorps.client.STATE_KINDS:
                if st.get(kind) is not None:
                    st[kind].astype("<f4").tofile(
                        os.path.join(out, case["name"], f"state_{kind}.bin"))


def state_from_checkpoints(paths, cases, out, prefix):
    """Assembles every case's whole state (and last params) from the
    shards' checkpoint files into out/<case>/, in check_vectors.py's
    layout, from the tensors named prefix[case] + case (the round that
    split it); returns {case: params} from the files."""
    shapes = {c["name"]: tuple(c["shape"]) for c in cases}
    whole, params = {}, {}
    for path in paths:
        header, meta, data = checkpoint_read.read(path)
        arr = checkpoint_read.arrays(header, data)
        for key in meta:
            if not key.startswith("tensor:"):
                continue
            name = key[len("tensor:"):]
            rnd, case = name.split("/", 1)
            if prefix.get(case) != rnd + "/":
                continue  # a round that left this case whole
            tm = json.loads(meta[key])
            shape = shapes[case]
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            C = shape[-1] if len(shape) >= 2 else 1
            R = shape[-2] if len(shape) >= 2 else 1
            lo, hi = 0, numel // C
            if "bounds" in tm:
                bounds = [int(b) for b in tm["bounds"].split(",")]
                k = int(tm["block_index"])
                lo, hi = bounds[k], bounds[k + 1]
            st = whole.setdefault(case, {})
            p = params.setdefault(case, np.full(numel, np.nan, np.float32))
            p[lo * C:hi * C] = arr[name].reshape(-1)
            for kind, size, at, n in (("row", numel // C, lo, hi - lo),
                                      ("col", numel // R, lo // R * C, None),
                                      ("var", numel, lo, hi - lo),
                                      ("mom", numel, lo * C, (hi - lo) * C)):
                a = arr.get(f"{name}/{kind}")
                if a is None:
                    continue
                a = a.reshape(-1)
                dst = st.setdefault(kind, np.full(size, np.nan, np.float32))
                seg = dst[at:at + a.size]
                shared = ~np.isnan(seg)
                if kind == "col" and shared.any():
                    assert np.array_equal(seg[shared], a[shared]), \
                        f"{case}: blocks' column state differs in {path}"
                seg[:] = a
    for case, st in whole.items():
        for kind, a in st.items():
            assert not np.isnan(a).any(), f"{case}: {kind} state not covered by the checkpoints"
            a.astype("<f4").tofile(os.path.join(out, case, f"state_{kind}.bin"))
    return params


def check_vectors(index, cases, results):
    """check_vectors.py --require-state on exactly `cases` (a filtered
    index beside links to their directories)."""
    vdir = tempfile.mkdtemp(prefix="fps-golden-")
    try:
        sub = dict(index, cases=cases)
        with open(os.path.join(vdir, "index.json"), "w") as f:
            json.dump(sub, f)
        for case in cases:
            os.symlink(os.path.join(ROOT, case["name"]), os.path.join(vdir, case["name"]))
        return subprocess.run([sys.executable, os.path.join(VECTORS, "check_vectors.py"), vdir,
                               results, "--require-state"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
    finally:
        shutil.rmtree(vdir, ignore_errors=True)


@need_server
class SplitGoldenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.index, cls.cases = load_cases()
        cls.tmp = tempfile.mkdtemp(prefix="fps-split-golden-")
        # The unsplit run: one shard, every tensor whole.
        cls.whole = os.path.join(cls.tmp, "whole")
        with Shards(1) as s:
            run_round(s.addrs, cls.cases, 0, "", cls.whole)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_cases_cover_the_shapes(self):
        shapes = {tuple(c["shape"]) for c in self.cases}
        self.assertTrue({(7,), (3, 5), (2, 3, 4), (64, 33)} <= shapes, shapes)
        self.assertGreaterEqual(len(self.cases), 90)

    def test_unsplit_run_passes_the_checker(self):
        proc = check_vectors(self.index, self.cases, self.whole)
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])

    def split_run(self, n_shards):
        out = os.path.join(self.tmp, f"split{n_shards}")
        left = list(self.cases)
        blocks, prefix = {}, {}
        # checkpoint: every shard gets a --checkpoint-dir (an hour apart:
        # the test writes the one it reads).
        with Shards(n_shards, peers=True, checkpoint=3600) as s:
            for rnd in range(8):
                if not left:
                    break
                plan, _ = factorps.placement_plan(
                    [(c["name"], c["shape"]) for c in left], n_shards, 1)
                run_round(s.addrs, left, 1, f"r{rnd}/", out)
                done = [c for c in left if len(plan[c["name"]]) > 1]
                for c in done:
                    blocks[c["name"]] = plan[c["name"]]
                    prefix[c["name"]] = f"r{rnd}/"
                # A case the plan left whole ran whole: run it again, split.
                left = [c for c in left if len(plan[c["name"]]) == 1]
            with factorps.connect(s.addrs) as c:
                files = [x["path"] for x in c.checkpoint()]
            # The results again, with the state from the checkpoints (of
            # the round that split each case: a later round's results of a
            # case overwrote the earlier, whole run's in `out`).
            ck = os.path.join(self.tmp, f"ckpt{n_shards}")
            for case in self.cases:
                shutil.copytree(os.path.join(out, case["name"]), os.path.join(ck, case["name"]))
                for f in os.listdir(os.path.join(ck, case["name"])):
                    if f.startswith("state_"):
                        os.unlink(os.path.join(ck, case["name"], f))
            params = state_from_checkpoints(files, self.cases, ck, prefix)
        self.assertEqual(left, [], "cases the plan never split")
        for case in self.cases:
            last = f32(os.path.join(out, case["name"], f"param_{STEPS}.bin"))
            np.testing.assert_array_equal(params[case["name"]], last, case["name"])
        return out, ck, blocks

    def check_geometry(self, blocks, n_shards, spanning):
        """The plan has blocks of unequal sizes and one-row blocks, uses every
        shard, and (if `spanning`) has blocks spanning two matrices."""
        by_name = {c["name"]: c for c in self.cases}
        sizes, one_row, spans, shards = set(), 0, 0, set()
        for name, bl in blocks.items():
            shape = by_name[name]["shape"]
            sizes.add(len({hi - lo for _, lo, hi in bl}) > 1)
            for shard, lo, hi in bl:
                shards.add(shard)
                one_row += hi - lo == 1
                if len(shape) >= 3 and lo // shape[-2] != (hi - 1) // shape[-2]:
                    spans += 1
        self.assertIn(True, sizes, "no tensor with blocks of unequal sizes")
        self.assertGreater(one_row, 0, "no block of a single row")
        if spanning:
            self.assertGreater(spans, 0, "no block spanning two matrices")
        self.assertEqual(shards, set(range(n_shards)))

    def compare_with_whole(self, out):
        worst_p = worst_s = 0.0
        identical = 0
        for case in self.cases:
            same = True
            name, shape = case["name"], case["shape"]
            prev = f32(os.path.join(ROOT, case["files"]["param_init"]))
            for t in range(1, STEPS + 1):
                w = f32(os.path.join(self.whole, name, f"param_{t}.bin"))
                s = f32(os.path.join(out, name, f"param_{t}.bin"))
                scale = max(float(np.abs(w).max()), float(np.abs(w - prev).max()), 1e-30)
                err = float(np.abs(s.astype(np.float64) - w).max()) / scale
                self.assertLessEqual(err, PARAM_TOL, f"{name} step {t}: split vs whole {err:.3g}")
                worst_p, same = max(worst_p, err), same and np.array_equal(s, w)
                prev = w
            for kind in factorps.client.STATE_KINDS:
                wp = os.path.join(self.whole, name, f"state_{kind}.bin")
                sp = os.path.join(out, name, f"state_{kind}.bin")
                self.assertEqual(os.path.exists(wp), os.path.exists(sp), f"{name} {kind}")
                if not os.path.exists(wp):
                    continue
                w, s = f32(wp).astype(np.float64), f32(sp).astype(np.float64)
                if kind == "mom":
                    err = float(np.abs(s - w).max()) / max(float(np.abs(w).max()), 1e-30)
                else:
                    floor = max(float(np.abs(w).max()) * 1e-6, np.finfo(np.float64).tiny)
                    err = float((np.abs(s - w) / np.maximum(np.abs(w), floor)).max())
                self.assertLessEqual(err, STATE_TOL, f"{name} state {kind}: split vs whole {err:.3g}")
                worst_s, same = max(worst_s, err), same and np.array_equal(s, w)
            identical += same
        print(f"\n{os.path.basename(out)}: split vs whole: worst param {worst_p:.3g}, worst state "
              f"{worst_s:.3g}, {identical} of {len(self.cases)} cases bit-identical")

    def run_shard_count(self, n_shards):
        out, ck, blocks = self.split_run(n_shards)
        # The plan is deterministic: over 3 shards it cuts (2, 3, 4) cases
        # inside a matrix (over 2 and 4 it happens to cut between them).
        self.check_geometry(blocks, n_shards, spanning=n_shards == 3)
        proc = check_vectors(self.index, self.cases, out)
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
        proc = check_vectors(self.index, self.cases, ck)
        self.assertEqual(proc.returncode, 0, "state from the checkpoints:\n" + proc.stdout[-4000:])
        self.compare_with_whole(out)
        self.compare_with_whole(ck)

    def test_split_over_2_shards(self):
        self.run_shard_count(2)

    def test_split_over_3_shards(self):
        self.run_shard_count(3)

    def test_split_over_4_shards(self):
        self.run_shard_count(4)


if __name__ == "__main__":
    unittest.main()

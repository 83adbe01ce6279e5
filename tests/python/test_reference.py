"""The reference Adafactor (factorps.reference) against the golden vectors.

The parity tests trust factorps.reference to say what a shard should
compute; this test is why that trust is earned: the reference replays every
case of tests/vectors/adafactor and tests/vectors/check_vectors.py (the
vectors' own checker, with its own tolerances) must accept all of them.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import _support  # noqa: F401  (puts the package on sys.path)
from factorps.reference import ReferenceAdafactor, adamw_state_elements, state_elements

VECTORS = os.path.join(_support.REPO, "tests", "vectors")


class ReferenceVectorsTest(unittest.TestCase):
    def test_every_golden_case(self):
        root = os.path.join(VECTORS, "adafactor")
        with open(os.path.join(root, "index.json")) as f:
            index = json.load(f)
        self.assertGreater(len(index["cases"]), 100)
        with tempfile.TemporaryDirectory() as out:
            for case in index["cases"]:
                shape = tuple(case["shape"])
                hp = dict(case["hparams"])
                ref = ReferenceAdafactor(shape, case["flavor"], **hp)
                param = np.fromfile(os.path.join(root, case["files"]["param_init"]),
                                    "<f4").reshape(shape)
                os.makedirs(os.path.join(out, case["name"]), exist_ok=True)
                for t, gpath in enumerate(case["files"]["grads"], start=1):
                    grad = np.fromfile(os.path.join(root, gpath), "<f4").reshape(shape)
                    param = ref.step(param, grad)
                    param.astype("<f4").tofile(os.path.join(out, case["name"], f"param_{t}.bin"))
                for key, arr in ref.state_arrays().items():
                    arr.astype("<f4").tofile(os.path.join(out, case["name"], f"state_{key}.bin"))
                self.assertEqual(state_elements(shape, case["flavor"], hp.get("beta1")),
                                 case["state_elements"], case["name"])
                self.assertEqual(adamw_state_elements(shape), case["adamw_state_elements"])
            proc = subprocess.run([sys.executable, os.path.join(VECTORS, "check_vectors.py"),
                                   root, out, "--require-state"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=300)
            self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])

    def test_hf_rejects_upstream_invalid_combinations(self):
        with self.assertRaises(ValueError):
            ReferenceAdafactor((2, 2), "hf", lr=1e-3)  # lr with relative_step
        with self.assertRaises(ValueError):
            ReferenceAdafactor((2, 2), "hf", lr=1e-3, relative_step=False, warmup_init=True)
        with self.assertRaises(TypeError):
            ReferenceAdafactor((2, 2), "torch", clip_threshold=1.0)


if __name__ == "__main__":
    unittest.main()

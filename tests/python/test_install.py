"""Packaging: `pip install ./client/python` works offline and bundles
libfactorps, and the package finds its library in each documented place
($FACTORPS_LIB, next to the package, the build tree)."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import _support
from _support import Shards, need_server

PKG_SRC = os.path.join(_support.REPO, "client", "python")

SMOKE = r"""
import sys, numpy as np, factorps
print(factorps.library_path())
with factorps.connect(sys.argv[1].split(","), deadline=10) as c:
    c.create([factorps.TensorSpec("w", (3, 2), np.ones((3, 2)))])
    params, versions = c.push_pull({"w": np.ones((3, 2))})
    assert versions == {"w": 1}, versions
    assert params["w"].shape == (3, 2)
print("OK")
"""


def _env_without_lib(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("FACTORPS_LIB", "PYTHONPATH")}
    env.update(extra)
    return env


@need_server
class InstallTest(unittest.TestCase):
    def setUp(self):
        self.lib = os.environ.get("FACTORPS_LIB")
        if not self.lib:
            self.skipTest("FACTORPS_LIB not set (run through ctest)")
        self.tmp = tempfile.mkdtemp(prefix="fps-pyinst-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.shards = Shards(1)
        self.addCleanup(self.shards.close)

    def run_smoke(self, env, cwd):
        proc = subprocess.run([sys.executable, "-c", SMOKE, ",".join(self.shards.addrs)],
                              env=env, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stdout)
        self.assertTrue(proc.stdout.rstrip().endswith("OK"), proc.stdout)
        return proc.stdout.splitlines()[0]

    def test_pip_install_bundles_the_library(self):
        # Build from a copy: an in-tree build would leave build/ and
        # *.egg-info in the source directory.
        src = os.path.join(self.tmp, "src")
        shutil.copytree(PKG_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                   "*.egg-info"))
        site = os.path.join(self.tmp, "site")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                               "--no-cache-dir", "--disable-pip-version-check", "--target", site,
                               src], env=dict(os.environ, FACTORPS_LIB=self.lib),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=240)
        self.assertEqual(proc.returncode, 0, proc.stdout)
        bundled = os.path.join(site, "factorps", "libfactorps.so")
        self.assertTrue(os.path.isfile(bundled), os.listdir(os.path.join(site, "factorps")))
        # Imported from the install, without FACTORPS_LIB, the bundled copy wins.
        used = self.run_smoke(_env_without_lib(PYTHONPATH=site), self.tmp)
        self.assertEqual(os.path.realpath(used), os.path.realpath(bundled))

    def test_factorps_lib_overrides(self):
        used = self.run_smoke(_env_without_lib(PYTHONPATH=PKG_SRC, FACTORPS_LIB=self.lib),
                              self.tmp)
        self.assertEqual(os.path.realpath(used), os.path.realpath(self.lib))

    def test_bad_factorps_lib_is_a_clear_error(self):
        proc = subprocess.run([sys.executable, "-c", "import factorps; factorps.connect('x:1')"],
                              env=_env_without_lib(PYTHONPATH=PKG_SRC,
                                                   FACTORPS_LIB="/nonexistent/libfactorps.so"),
                              cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=60)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("LibraryNotFoundError", proc.stdout)
        self.assertIn("/nonexistent/libfactorps.so", proc.stdout)

    def test_build_tree_is_found_from_the_source_tree(self):
        rel = os.path.relpath(os.path.realpath(self.lib), os.path.realpath(_support.REPO))
        parts = rel.split(os.sep)
        if rel.startswith("..") or not parts[0].startswith("build") or parts[1:2] != ["client"]:
            self.skipTest(f"library {self.lib} is not in <repo>/build*/client/")
        used = self.run_smoke(_env_without_lib(PYTHONPATH=PKG_SRC), self.tmp)
        self.assertTrue(os.path.realpath(used).startswith(os.path.realpath(_support.REPO)), used)


if __name__ == "__main__":
    unittest.main()

"""Packaging: `pip install ./client/python` works offline and bundles
libfactorps (built here, from the build tree, or by cmake), an installed
package needs no FACTORPS_LIB or LD_LIBRARY_PATH, and the package finds
its library in each documented place ($FACTORPS_LIB, next to the package,
the build tree)."""

import os
import re
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


SMOKE_TORCH = r"""
import sys, torch, factorps, factorps.torch
p = torch.nn.Parameter(torch.ones(3, 2))
opt = factorps.torch.RemoteAdafactor([("w", p)], shards=sys.argv[1].split(","), deadline=10)
p.grad = torch.ones(3, 2)
opt.step()
assert not torch.equal(p.detach(), torch.ones(3, 2)), p
opt.close()
print(factorps.library_path())
print("OK")
"""

# Build droppings of an in-tree `pip install ./client/python`.
DROPPINGS = [os.path.join(PKG_SRC, d) for d in ("build", "factorps.egg-info")]


def _env_without_lib(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("FACTORPS_LIB", "PYTHONPATH", "LD_LIBRARY_PATH", "PIP_TARGET")}
    env.update(extra)
    return env


def _fresh_venv(where):
    """A new venv with pip (Debian's python3-venv), seeing numpy and torch of
    the interpreter running this test (Debian's, or the torch2 venv's)
    through a .pth file, and nothing else of it."""
    import numpy
    import torch
    proc = subprocess.run([sys.executable, "-m", "venv", where], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"python -m venv failed: {proc.stdout}")
    py = os.path.join(where, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    dirs = sorted({os.path.dirname(os.path.dirname(m.__file__)) for m in (numpy, torch)})
    with open(os.path.join(site, "host-packages.pth"), "w") as f:
        f.write("\n".join(dirs) + "\n")
    return py


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
                               "--no-build-isolation", "--no-cache-dir",
                               "--disable-pip-version-check", "--target", site,
                               src], env=dict(os.environ, FACTORPS_LIB=self.lib),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=240)
        self.assertEqual(proc.returncode, 0, proc.stdout)
        bundled = os.path.join(site, "factorps", "libfactorps.so")
        self.assertTrue(os.path.isfile(bundled), os.listdir(os.path.join(site, "factorps")))
        # Imported from the install, without FACTORPS_LIB, the bundled copy wins.
        used = self.run_smoke(_env_without_lib(PYTHONPATH=site), self.tmp)
        self.assertEqual(os.path.realpath(used), os.path.realpath(bundled))

    def test_fresh_venv_pip_install_then_import_factorps_torch(self):
        # What a user types, from the repository root: no FACTORPS_LIB, no
        # LD_LIBRARY_PATH, no index (--no-build-isolation: the venv's own
        # setuptools builds). The library comes from this source tree's
        # build (tests run from <repo>/build*) or, failing that, cmake.
        py = _fresh_venv(os.path.join(self.tmp, "venv"))
        fresh = [d for d in DROPPINGS if not os.path.exists(d)]
        for d in fresh:
            self.addCleanup(shutil.rmtree, d, True)
        # Offline when the venv can build a wheel itself (setuptools with
        # the wheel package: Debian's python3-wheel); else pip's isolated
        # build fetches setuptools from the configured index.
        offline = subprocess.run([py, "-c", "import setuptools, wheel"], env=_env_without_lib(),
                                 cwd=self.tmp).returncode == 0
        flags = ["--no-index", "--no-build-isolation"] if offline else []
        proc = subprocess.run([py, "-m", "pip", "install", *flags, "--no-cache-dir",
                               "--disable-pip-version-check",
                               "./client/python"], env=_env_without_lib(), cwd=_support.REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout)
        out = subprocess.run([py, "-c", SMOKE_TORCH, ",".join(self.shards.addrs)],
                             env=_env_without_lib(), cwd=self.tmp, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout)
        used, ok = out.stdout.strip().splitlines()[-2:]
        self.assertEqual(ok, "OK")
        self.assertTrue(os.path.realpath(used).startswith(os.path.realpath(self.tmp)),
                        f"loaded {used}, not the venv's own copy")

    def test_without_a_built_library_cmake_builds_one(self):
        # A copy of the package, FACTORPS_BUILD_LIB=1: no build tree is
        # used; setup.py configures and builds libfactorps from the source
        # tree (FACTORPS_SOURCE_DIR) into a temporary directory.
        src = os.path.join(self.tmp, "src")
        shutil.copytree(PKG_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                   "*.egg-info"))
        site = os.path.join(self.tmp, "site")
        env = _env_without_lib(FACTORPS_BUILD_LIB="1", FACTORPS_SOURCE_DIR=_support.REPO)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-index",
                               "--no-deps", "--no-build-isolation", "--no-cache-dir",
                               "--disable-pip-version-check", "--target", site, src],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
        self.assertIn("factorps: building libfactorps with cmake", proc.stdout)
        used = self.run_smoke(_env_without_lib(PYTHONPATH=site), self.tmp)
        self.assertEqual(os.path.realpath(used),
                         os.path.realpath(os.path.join(site, "factorps", "libfactorps.so")))

    def test_version_is_the_projects(self):
        with open(os.path.join(_support.REPO, "CMakeLists.txt")) as f:
            cmake = re.search(r"project\(factorps VERSION ([0-9.]+)", f.read()).group(1)
        with open(os.path.join(PKG_SRC, "pyproject.toml")) as f:
            py = re.search(r'^version = "([0-9.]+)"', f.read(), re.M).group(1)
        self.assertEqual(py, cmake)

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

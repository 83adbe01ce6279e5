"""Builds the factorps wheel with libfactorps inside (pyproject.toml holds
the metadata; this file only adds the library).

Which libfactorps goes in, the first that applies:
1. $FACTORPS_LIB, a built libfactorps.so (an error if it is not a file);
2. unless FACTORPS_BUILD_LIB=1: the newest <repo>/build*/client/libfactorps.so
   of the source tree this directory sits in (plain build/ first: a
   sanitizer build needs its runtime preloaded);
3. one built here with cmake from that source tree (or $FACTORPS_SOURCE_DIR)
   into a temporary directory: the Debian packages of scripts/deps.sh build
   are enough.
No library is an error: an installed factorps must find its own.

The wheel holds a native library, so it is tagged for this platform and
Python, not as pure Python.
"""

import glob
import os
import shutil
import subprocess
import tempfile

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _source_dir():
    src = os.environ.get("FACTORPS_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
    if not os.path.isfile(os.path.join(src, "client", "include", "factorps", "client.h")):
        return None
    return src


def _built_lib():
    env = os.environ.get("FACTORPS_LIB")
    if env:
        if not os.path.isfile(env):
            raise SystemExit(f"FACTORPS_LIB={env} is not a file")
        return env
    src = _source_dir()
    if os.environ.get("FACTORPS_BUILD_LIB") == "1" or src is None:
        return None
    built = glob.glob(os.path.join(src, "build*", "client", "libfactorps.so"))
    built.sort(key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))) != "build",
                              -os.path.getmtime(p)))
    return built[0] if built else None


def _cmake_lib(tmp):
    src = _source_dir()
    if src is None:
        raise SystemExit("factorps: no libfactorps to bundle: set FACTORPS_LIB to a built "
                         "libfactorps.so, or FACTORPS_SOURCE_DIR to the factorps source tree "
                         "to build one with cmake")
    build = os.path.join(tmp, "build")
    print(f"factorps: building libfactorps with cmake from {src}")
    subprocess.run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                    "-DFPS_BUILD_TESTS=OFF", "-DFPS_BUILD_BENCH=OFF"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, "--target", "factorps", "-j",
                    str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return os.path.join(build, "client", "libfactorps.so")


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "factorps", "libfactorps.so")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="factorps-lib-") as tmp:
            lib = _built_lib() or _cmake_lib(tmp)
            # Resolve symlinks: copy the real file under the plain name.
            shutil.copyfile(os.path.realpath(lib), dest)
        print(f"factorps: bundled {lib}")


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(packages=["factorps"], zip_safe=False, cmdclass={"build_py": BuildPyWithLib},
      distclass=BinaryDistribution)

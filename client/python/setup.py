"""Installs the factorps Python package: pip install ./client/python

A plain setup.py (no pyproject.toml build-system table) on purpose: pip then
builds with the setuptools already installed (Debian's python3-setuptools)
instead of fetching one into an isolated build environment, so installing
works offline.

libfactorps: if FACTORPS_LIB points at the library, or a build tree next to
this directory has one (<repo>/build*/client/libfactorps.so), it is copied
into the package, where factorps looks first. Otherwise the package finds
the library at run time ($FACTORPS_LIB, the build tree, the system path).
"""

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_lib():
    env = os.environ.get("FACTORPS_LIB")
    if env:
        if not os.path.isfile(env):
            raise SystemExit(f"FACTORPS_LIB={env} is not a file")
        return env
    repo = os.path.dirname(os.path.dirname(HERE))
    built = glob.glob(os.path.join(repo, "build*", "client", "libfactorps.so"))
    # The plain build first: a sanitizer build needs its runtime preloaded.
    built.sort(key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))) != "build",
                              -os.path.getmtime(p)))
    return built[0] if built else None


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        lib = _find_lib()
        dest = os.path.join(self.build_lib, "factorps")
        if lib:
            os.makedirs(dest, exist_ok=True)
            # Resolve symlinks: copy the real file under the plain name.
            shutil.copyfile(os.path.realpath(lib), os.path.join(dest, "libfactorps.so"))
            print(f"factorps: bundled {lib}")
        else:
            print("factorps: no libfactorps.so bundled; it will be looked up at run time")


setup(
    name="factorps",
    version="0.1.0",
    description="Python workers for the factorps parameter server (ctypes over libfactorps)",
    packages=["factorps"],
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"torch": ["torch"]},
    cmdclass={"build_py": BuildPyWithLib},
    zip_safe=False,
)

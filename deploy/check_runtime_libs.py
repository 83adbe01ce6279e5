#!/usr/bin/python3
"""Checks that the runtime stage of deploy/Dockerfile installs the Debian
package of every shared library the given binaries need (DT_NEEDED), so the
image cannot start with a missing library after a new dependency.

Usage: check_runtime_libs.py BINARY...   (exit 0 ok, 1 missing, 77 no dpkg)
"""
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def runtime_packages():
    with open(os.path.join(HERE, "Dockerfile")) as f:
        text = f.read()
    final = text.split("\nFROM ")[-1]  # the last stage is the image
    m = re.search(r"apt-get install -y -q --no-install-recommends\s*\\\s*\n(.*?)(?:\\\s*\n\s*&&|\n\n)",
                  final, re.S)
    if not m:
        sys.exit("check_runtime_libs: no apt-get install in the final stage of the Dockerfile")
    return set(m.group(1).replace("\\", " ").split())


def needed(binary):
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def package_of(lib):
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
              "/lib/aarch64-linux-gnu", "/usr/lib", "/lib"):
        path = os.path.join(d, lib)
        if os.path.exists(path):
            r = subprocess.run(["dpkg", "-S", os.path.realpath(path)], capture_output=True,
                               text=True)
            if r.returncode != 0:
                r = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
            if r.returncode == 0:
                return r.stdout.split(":")[0].strip()
    return None


def main():
    if not shutil.which("dpkg") or not shutil.which("readelf"):
        print("check_runtime_libs: needs dpkg and readelf")
        return 77
    want = runtime_packages()
    base = {"libc6"}  # in every Debian image
    missing = []
    for b in sys.argv[1:]:
        for lib in needed(b):
            pkg = package_of(lib)
            if pkg is None:
                missing.append("%s: %s (no package found)" % (b, lib))
            elif pkg not in want | base:
                missing.append("%s: %s is in package %s, not installed by the image"
                               % (b, lib, pkg))
            else:
                print("%s: %s -> %s" % (os.path.basename(b), lib, pkg))
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 1
    print("runtime stage installs: " + " ".join(sorted(want)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""CI's fresh-machine check of the main command (scripts/demo.sh).

A fresh Debian 12 machine has its required-priority packages; demo.sh adds
`scripts/deps.sh --list demo` and whatever apt pulls in with them (Depends
and Pre-Depends, recursively; Recommends are not installed). This script
computes that set from the installed packages and fails if the demo uses
anything outside it, without needing a fresh machine:

1. pkg-config sees only the .pc files of those packages (PKG_CONFIG_LIBDIR
   points at a directory of links to them), and `scripts/demo.sh
   --build-only` configures and builds the demo's way into a scratch
   directory, the linker tracing every file it reads;
2. every file the build read from outside the tree (headers, from the
   compilers' dependency files; libraries and objects, from the linker's
   trace; the tools and paths CMake found) must belong to one of those
   packages, and so must every library the built programs load;
3. so must every Python module the demo's workers import.

A dependency missing from the demo's list therefore fails here, naming the
file and the package it came from.

    /usr/bin/python3 scripts/check_demo_deps.py [--keep DIR] [--without PKG...]

--without drops packages from the list (the test of this check: dropping
libcjson-dev must fail).
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"
# The demo's Python entry points: their imports (all at the top of each
# file) are what the workers load.
DEMO_MODULES = ["train_digits", "train_lm", "demo_report"]


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, **kw).stdout


def installed_packages():
    """name -> dict(deps=[[alternatives]], provides=[...], priority, essential)."""
    out = sh("dpkg-query", "-W", "-f",
             "${Package}\t${db:Status-Abbrev}\t${Priority}\t${Essential}\t${Pre-Depends}\t"
             "${Depends}\t${Provides}\t${Architecture}\n")
    native = sh("dpkg", "--print-architecture").strip()
    pk = {}
    for line in out.splitlines():
        name, status, prio, ess, pre, dep, prov, arch = (line.split("\t") + [""] * 8)[:8]
        # Only the machine's own architecture (and arch: all): foreign
        # packages (the NEON tests' arm64 libraries) are never the demo's.
        if not status.startswith("ii") or arch not in (native, "all"):
            continue

        def groups(s):
            res = []
            for g in filter(None, (x.strip() for x in s.split(","))):
                res.append([re.split(r"[\s(:]", a.strip(), maxsplit=1)[0] for a in g.split("|")])
            return res
        pk[name] = dict(deps=groups(pre) + groups(dep), priority=prio, essential=ess == "yes",
                        provides=[g[0] for g in groups(prov)], arch=arch)
    return pk


def closure(want, pk):
    providers = {}
    for n, p in pk.items():
        for v in p["provides"]:
            providers.setdefault(v, []).append(n)
    base = [n for n, p in pk.items() if p["essential"] or p["priority"] == "required"]
    base.append("apt")  # debootstrap --variant=minbase: required + apt
    seen, todo = set(), list(base) + list(want)
    while todo:
        n = todo.pop()
        if n in seen or n not in pk:
            continue
        seen.add(n)
        for alts in pk[n]["deps"]:
            for a in alts:  # apt takes the first alternative it can satisfy
                if a in pk:
                    todo.append(a)
                    break
                if a in providers:
                    todo.append(sorted(providers[a])[0])
                    break
    return seen


def norm(p):
    """The path with its directories resolved (usr-merge: /lib is /usr/lib)."""
    d, b = os.path.split(os.path.abspath(p))
    return os.path.join(os.path.realpath(d), b)


def owner(path):
    r = subprocess.run(["dpkg", "-S", path], text=True, capture_output=True)
    if r.returncode == 0:
        return r.stdout.split(":")[0]
    r = subprocess.run(["dpkg", "-S", os.path.realpath(path)], text=True, capture_output=True)
    return r.stdout.split(":")[0] if r.returncode == 0 else "no package"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", help="build here and keep it (default: a scratch directory)")
    ap.add_argument("--without", nargs="*", default=[], help="drop these from the demo's list")
    args = ap.parse_args()

    subprocess.run([os.path.join(ROOT, "scripts/deps.sh"), "demo"], check=True)  # as root: installs
    want = [p for p in sh(os.path.join(ROOT, "scripts/deps.sh"), "--list", "demo").split()
            if p not in args.without]
    pk = installed_packages()
    missing = [p for p in want if p not in pk]
    if missing:
        sys.exit(f"check-demo-deps: not installed here, cannot check: {' '.join(missing)}")
    pkgs = closure(want, pk)
    files = sh("dpkg-query", "-L", *(f"{n}:{pk[n]['arch']}" for n in sorted(pkgs))).splitlines()
    owned = set()
    for f in files:
        if f.startswith("/"):
            owned.add(norm(f))
    print(f"check-demo-deps: {len(want)} listed packages, {len(pkgs)} with their dependencies "
          f"and the base system, {len(owned)} files")

    work = args.keep or tempfile.mkdtemp(prefix="factorps-demodeps.")
    try:
        pcdir = os.path.join(work, "pkgconfig")
        os.makedirs(pcdir, exist_ok=True)
        for f in files:
            if f.endswith(".pc") and "/pkgconfig/" in f and os.path.isfile(f):
                dst = os.path.join(pcdir, os.path.basename(f))
                if not os.path.lexists(dst):
                    os.symlink(f, dst)
        build = os.path.join(work, "build")
        env = dict(os.environ, PKG_CONFIG_LIBDIR=pcdir, LDFLAGS="-Wl,--trace")
        for v in ("PKG_CONFIG_PATH", "CMAKE_PREFIX_PATH", "CPATH", "C_INCLUDE_PATH",
                  "LIBRARY_PATH"):
            env.pop(v, None)
        r = subprocess.run([os.path.join(ROOT, "scripts/demo.sh"), "--build-only",
                            "--build-dir", build], env=env, text=True)
        if r.returncode:
            sys.exit("check-demo-deps: FAILED: the demo's build does not work with only the "
                     "demo's packages (see above)")
        used = {}  # path -> what read it
        # What a bare interpreter loads (site hooks of whatever else is
        # installed here) is not the demo's doing.
        ignore = set(sh(PY, "-c", "import sys\nfor m in list(sys.modules.values()):\n"
                        "    f = getattr(m, '__file__', None)\n    if f: print(f)\n").split())

        def use(path, why):
            if not path.startswith("/"):
                return
            a = os.path.abspath(path)
            if (a.startswith(ROOT + "/") or a.startswith(work + "/") or not os.path.isfile(a)
                    or a in ignore):
                return
            used.setdefault(a, why)

        for d in glob.glob(os.path.join(build, "**", "*.d"), recursive=True):
            text = open(d, errors="replace").read().replace("\\\n", " ")
            for tok in text.split():
                if not tok.endswith(":"):
                    use(tok, "compiler (" + os.path.relpath(d, build) + ")")
        for line in open(os.path.join(build, "demo-build.log"), errors="replace"):
            m = re.match(r"^(/[^\s()]+)", line.strip())
            if m and not line.startswith("/usr/bin/ld:"):
                use(m.group(1), "linker")
        for line in open(os.path.join(build, "CMakeCache.txt"), errors="replace"):
            m = re.match(r"^([A-Za-z_0-9]+):(FILEPATH|PATH)=(/.*)$", line.strip())
            if m:
                use(m.group(3), "CMake " + m.group(1))
        progs = [os.path.join(build, "server/factorps-server"),
                 os.path.join(build, "client/libfactorps.so")]
        for prog in progs:
            for line in sh("ldd", prog).splitlines():
                m = re.search(r"(/\S+) \(0x", line)
                if m:
                    use(m.group(1), "ldd " + os.path.basename(prog))
        # The workers' Python modules (imported, not run).
        code = ("import sys, os\n"
                f"sys.path[:0] = [{os.path.join(ROOT, 'client/python/examples')!r}, "
                f"{os.path.join(ROOT, 'client/python')!r}]\n"
                f"os.environ['FACTORPS_LIB'] = {progs[1]!r}\n"
                "import importlib\n"
                f"for m in {DEMO_MODULES!r}:\n"
                "    if os.path.exists(os.path.join(sys.path[0], m + '.py')):\n"
                "        importlib.import_module(m)\n"
                "for m in list(sys.modules.values()):\n"
                "    f = getattr(m, '__file__', None)\n"
                "    if f: print(f)\n")
        # setuptools (a test package) installs a hook that swaps its own
        # distutils in for the standard library's; without it (as on a
        # fresh machine) the standard one is used: ask for that.
        for f in sh(PY, "-c", code, env=dict(env, SETUPTOOLS_USE_DISTUTILS="stdlib")).splitlines():
            use(f, "python")
        bad = sorted(p for p in used if norm(p) not in owned and norm(os.path.realpath(p))
                     not in owned)
        print(f"check-demo-deps: the build and the workers used {len(used)} files from outside "
              "the tree")
        if bad:
            for p in bad:
                print(f"  {p}: from {owner(p)}, used by {used[p]}", file=sys.stderr)
            sys.exit(f"check-demo-deps: FAILED: {len(bad)} files come from packages the demo's "
                     "list (scripts/deps.sh) does not pull in")
        print("check-demo-deps: ok: the demo needs only its package list")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

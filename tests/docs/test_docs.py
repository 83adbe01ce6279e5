#!/usr/bin/python3
"""What README.md and docs/*.md name, checked against the tree and the
built programs, so that the pages cannot drift from the code:

- every relative link resolves to a file, and every #anchor into a
  markdown file to one of its headings (GitHub's slugs);
- every repository path they name in backticks (scripts/..., tests/...,
  server/..., globs included) exists, and every build/... program is a
  target of some CMakeLists.txt;
- every --flag of a factorps-server or factorps <command> invocation they
  show is in that program's --help, and every row of the shard-flag
  tables in docs/operations.md names server flags with the environment
  twins --help gives;
- every FACTORPS_* variable they name is a server flag's twin or is read
  somewhere in the source;
- every factorps_* / process_* metric they name is in deploy/README.md's
  table (which tests/http/test_metrics_doc.py checks, both ways, against a
  real shard's /metrics);
- the ctest labels docs/contributing.md lists are exactly the labels the
  build registers.

The flag table of docs/shards.md is checked in more depth (defaults, bad
values) by tests/interop/test_flags.py.

Environment (set by ctest): FACTORPS_SERVER, FACTORPS_CLI (program paths),
FPS_CTEST and FPS_BUILD_DIR (for the label list).
"""
import glob
import os
import re
import subprocess
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Other pages whose links are checked too.
LINKED = PAGES + ["deploy/README.md", "client/python/README.md", "tests/vectors/README.md"]
SERVER = os.environ.get("FACTORPS_SERVER", "")
CLI = os.environ.get("FACTORPS_CLI", "")
SUBCOMMANDS = ("stats", "pull", "load", "checkpoint", "plan", "replay")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def prose_and_code(text):
    """(spans, code_lines): the `...` spans outside fenced blocks, and the
    lines inside them."""
    spans, code, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
        else:
            spans += re.findall(r"`([^`]+)`", line)
    return spans, code


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(text):
    out, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = re.match(r"(#{1,6}) (.*)", line)
        if m and not fenced:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def helps():
    """{program: set of --flags} for the server and every CLI command."""
    out = {}
    r = subprocess.run([SERVER, "--help"], capture_output=True, text=True, timeout=30)
    out["factorps-server"] = set(re.findall(r"^\s+(--[a-z0-9-]+)", r.stdout, re.M))
    out["factorps-server-env"] = dict(
        re.findall(r"^\s+(--[a-z0-9-]+)\s.*\n\s+env (FACTORPS_[A-Z0-9_]+)", r.stdout, re.M))
    for c in SUBCOMMANDS:
        r = subprocess.run([CLI, c, "--help"], capture_output=True, text=True, timeout=30)
        out["factorps " + c] = set(re.findall(r"--[a-z0-9-]+", r.stdout + r.stderr)) | {"--help"}
    return out


def invocations(text):
    """[(program, [flags])] of every factorps-server / factorps <command>
    written in a backtick span or a code line."""
    spans, code = prose_and_code(text)
    out = []
    for piece in spans + code:
        # A span or line may hold several commands; each runs to the next
        # one or to a shell separator.
        for seg in re.split(r"&&|;|\|(?!\|)|#", piece):
            m = re.search(r"(?<![\w./-])(factorps-server|factorps (%s))\b(.*)" % "|".join(SUBCOMMANDS), seg)
            if m:
                prog = m.group(1)
                out.append((prog, re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", m.group(3))))
    return out


def metric_names(text):
    """Metric names in backticks; `a_{b,c}_d` is a_b_d and a_c_d, while a
    brace at the end opens the labels (`name{method,code}`)."""
    names = set()
    spans, code = prose_and_code(text)
    for span in spans + code:
        for tok in re.findall(r"\b((?:factorps|process)_[a-z0-9_]*(?:\{[a-z0-9_,]+\}_[a-z0-9_]+)?)", span):
            m = re.match(r"(.*?)\{([a-z0-9_,]+)\}(.*)", tok)
            parts = [m.group(1) + v + m.group(3) for v in m.group(2).split(",")] if m else [tok]
            for p in parts:
                p = p.rstrip("_")
                # process_vm_readv and the like are not metrics: the
                # process collector's names end in a unit.
                if p.startswith("process_") and not re.search(r"_(bytes|fds|total|seconds)$", p):
                    continue
                names.add(p)
    return names


class Docs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.text = {p: read(p) for p in LINKED}

    def test_pages_exist_and_readme_is_short(self):
        self.assertGreaterEqual(len(PAGES), 7, PAGES)
        self.assertLessEqual(self.text["README.md"].count("\n"), 200, "README.md is the front page")

    def test_links_resolve(self):
        checked = 0
        for page in LINKED:
            for target in re.findall(r"\]\(([^)\s]+)\)", self.text[page]):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                with self.subTest(page=page, link=target):
                    self.assertTrue(os.path.exists(os.path.join(ROOT, dest)), f"{dest} does not exist")
                    if anchor and dest.endswith(".md"):
                        self.assertIn(anchor, anchors(read(dest)), f"no heading #{anchor} in {dest}")
                    checked += 1
        self.assertGreaterEqual(checked, 20)

    def test_paths_exist(self):
        cmake = "".join(read(os.path.relpath(p, ROOT)) for p in
                        glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True))
        targets = set(re.findall(r"add_executable\(\s*([\w-]+)", cmake))
        targets |= set(re.findall(r"OUTPUT_NAME ([\w-]+)", cmake))
        checked = 0
        for page in PAGES:
            spans, code = prose_and_code(self.text[page])
            words = [s.split()[0] for s in spans if s.split()] + [l.split()[0] for l in code if l.split()]
            for w in words:
                w = w.rstrip(".,:;)")
                if w.startswith("build/"):
                    name = os.path.basename(w)
                    if "/bin/" in w or "/bench/" in w or "/" + name == w[5:]:
                        # a program the build makes, not an output file
                        if "." not in name and name:
                            with self.subTest(page=page, program=w):
                                self.assertIn(name, targets, f"{w}: no such build target")
                            checked += 1
                    continue
                if not re.match(r"(scripts|tests|server|client|common|deploy|proto|docs|\.ci)/", w):
                    continue
                if re.search(r"[<>]|\.\.\.|[A-Z]{2,}", w.split("/", 1)[1]):
                    continue  # a placeholder (DIR, <case>, ...)
                with self.subTest(page=page, path=w):
                    self.assertTrue(glob.glob(os.path.join(ROOT, w)), f"{w} does not exist")
                checked += 1
        self.assertGreaterEqual(checked, 40)

    @unittest.skipUnless(SERVER and CLI, "FACTORPS_SERVER / FACTORPS_CLI not set")
    def test_invocation_flags_exist(self):
        h = helps()
        self.assertGreaterEqual(len(h["factorps-server"]), 30)
        checked = 0
        for page in PAGES:
            for prog, flags in invocations(self.text[page]):
                for f in flags:
                    with self.subTest(page=page, program=prog, flag=f):
                        self.assertIn(f, h[prog], f"{page}: {prog} has no {f}")
                    checked += 1
        self.assertGreaterEqual(checked, 30)

    @unittest.skipUnless(SERVER and CLI, "FACTORPS_SERVER / FACTORPS_CLI not set")
    def test_shard_flag_tables(self):
        envs = helps()["factorps-server-env"]
        rows = 0
        on = False
        for line in self.text["docs/operations.md"].splitlines():
            if line.startswith("| shard flag (env) |"):
                on = True
                continue
            if on and not line.startswith("|"):
                on = False
            if not on or line.startswith("|---") or line.startswith("| ---"):
                continue
            first = line.strip("|").split("|")[0]
            flags = re.findall(r"(--[a-z0-9-]+)", first)
            twins = re.findall(r"(FACTORPS_[A-Z0-9_]+)", first)
            self.assertTrue(flags, line)
            rows += 1
            for f in flags:
                with self.subTest(flag=f):
                    self.assertIn(f, envs, f"{f} is not a server flag")
            for t in twins:
                with self.subTest(env=t):
                    self.assertIn(t, envs.values(), f"{t} is no server flag's twin")
        self.assertGreaterEqual(rows, 8)

    @unittest.skipUnless(SERVER, "FACTORPS_SERVER not set")
    def test_environment_variables_exist(self):
        envs = set(helps()["factorps-server-env"].values())
        source = []
        for d in ("client", "server", "common", "scripts", "deploy"):
            for p in glob.glob(os.path.join(ROOT, d, "**", "*"), recursive=True):
                if os.path.isfile(p) and not p.endswith(".md"):
                    try:
                        with open(p, encoding="utf-8") as f:
                            source.append(f.read())
                    except UnicodeDecodeError:
                        pass
        source = "\n".join(source)
        named = set()
        for page in PAGES:
            named |= set(re.findall(r"\bFACTORPS_[A-Z0-9_]*[A-Z0-9]", self.text[page]))
        self.assertGreaterEqual(len(named), 10)
        for v in sorted(named):
            with self.subTest(env=v):
                self.assertTrue(v in envs or v in source, f"{v} is read nowhere")

    def test_metrics_are_in_the_table(self):
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "metrics_doc", os.path.join(ROOT, "tests", "http", "test_metrics_doc.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        table = mod.documented()
        self.assertGreaterEqual(len(table), 30)
        named = set()
        for page in PAGES:
            named |= metric_names(self.text[page])
        self.assertGreaterEqual(len(named), 20)
        for n in sorted(named):
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            with self.subTest(metric=n):
                self.assertTrue(n in table or base in table, f"{n} is not in deploy/README.md's table")

    @unittest.skipUnless(os.environ.get("FPS_CTEST") and os.environ.get("FPS_BUILD_DIR"),
                         "FPS_CTEST / FPS_BUILD_DIR not set")
    def test_labels_match_ctest(self):
        r = subprocess.run([os.environ["FPS_CTEST"], "--test-dir", os.environ["FPS_BUILD_DIR"],
                            "--print-labels"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        real = set(re.findall(r"^\s+(\S+)$", r.stdout.split("All Labels:", 1)[1], re.M))
        listed, on = set(), False
        for line in self.text["docs/contributing.md"].splitlines():
            if line.startswith("| label | what |"):
                on = True
                continue
            if on and not line.startswith("|"):
                break
            if on and not line.startswith("| ---"):
                listed |= set(re.findall(r"`([a-z0-9_]+)`", line.strip("|").split("|")[0]))
        self.assertGreaterEqual(len(real), 5, r.stdout)
        # Some labels exist only in some configurations (torch2 needs the
        # venv scripts/test.sh makes): a listed label must be registered by
        # this build or named in a LABELS property of some CMakeLists.txt.
        declared = set()
        for p in glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True):
            for m in re.findall(r'LABELS\s+"?([a-z0-9_;]+)', read(os.path.relpath(p, ROOT))):
                declared |= set(m.split(";"))
        self.assertEqual(sorted(listed - real - declared), [], "listed in docs/contributing.md, not a ctest label")
        self.assertEqual(sorted(real - listed), [], "ctest labels docs/contributing.md does not list")


if __name__ == "__main__":
    unittest.main()

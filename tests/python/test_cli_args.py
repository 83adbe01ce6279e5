"""The `factorps` CLI's argument errors, against docs/client.md: a bad flag,
a missing or extra operand, an option the client refuses exit 2 with a
message naming the problem; nothing is written for a command that cannot
run. Found by an audit of the CLI as a careless user would call it:

- `load` exited 1 (like a shard that is down) when the client refused its
  options (a job id, a message size, an entry naming one replica twice);
- `--params` too small for a model exited 1, as out of memory would;
- a number with a leading space, " -1", wrapped to 2^64-1 and ran;
- an extra or missing operand printed the usage without saying which;
- `pull --out FILE` emptied FILE before finding that a name was unknown;
- `plan` printed a split 1-D tensor's shape as [N, 0];
- `load` did not tell the shards its worker count;
- `load --threads --processes` took the last; `replay --case` matching
  nothing said the directory held no cases, after "replayed 0 case(s)".
"""
import os
import subprocess
import tempfile
import unittest

from _support import Shards, need_server

CLI = os.environ.get("FACTORPS_CLI", "")


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


@unittest.skipUnless(CLI, "FACTORPS_CLI not set (run through ctest)")
class CliArgsTest(unittest.TestCase):
    def assertUsage(self, r, words):
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(words, r.stderr)

    def test_operands(self):
        self.assertUsage(run("stats", "--shards", "127.0.0.1:1", "extra"), "unexpected argument 'extra'")
        self.assertUsage(run("load", "--shards", "127.0.0.1:1", "extra"), "unexpected argument 'extra'")
        self.assertUsage(run("checkpoint", "bogus"), "unexpected argument 'bogus'")
        self.assertUsage(run("pull", "--shards", "127.0.0.1:1"), "missing the NAME")
        self.assertUsage(run("checkpoint", "verify"), "missing the checkpoint DIR")
        self.assertUsage(run("replay"), "missing VECTORS_DIR and OUT_DIR")
        self.assertUsage(run("replay", "a", "b", "c"), "unexpected argument 'c'")
        self.assertUsage(run("load", "--shards", "127.0.0.1:1", "--threads", "--processes"),
                         "--threads and --processes exclude each other")

    def test_numbers(self):
        self.assertUsage(run("plan", "--shard-count", " -18446744073709551612", "--params", "1M"),
                         "--shard-count must be an integer")
        self.assertUsage(run("replay", "--threads", " -1", "a", "b"), "--threads must be an integer")
        for cmd in ("plan", "load"):
            args = ["--shard-count", "4"] if cmd == "plan" else ["--shards", "127.0.0.1:1"]
            self.assertUsage(run(cmd, *args, "--params", "1"), "--params 1 is too small for a model")

    def test_replay_names_a_case_filter_that_matches_nothing(self):
        vectors = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vectors", "adafactor")
        with tempfile.TemporaryDirectory() as out:
            r = run("replay", vectors, out, "--case", "zzz")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, r"no case of the \d+ in \S+ matches --case 'zzz'")
        self.assertEqual(r.stdout, "")  # no "replayed 0 case(s)" line

    def test_plan_prints_every_dimension(self):
        r = run("plan", "--shard-count", "4", "--split-min-bytes", "1Ki")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("split layer000.ln1 [1000]:", r.stdout)
        self.assertNotIn(", 0]:", r.stdout)

    @need_server
    def test_load_options_the_client_refuses(self):
        with Shards(1, mode="async") as s:
            a = s.addrs[0]
            base = ["load", "--shards", a, "--workers", "1", "--params", "100k", "--steps", "2"]
            for extra in (["--job-id", "bad/id"], ["--max-message", "100"]):
                r = run(*base, *extra)
                self.assertUsage(r, "INVALID_ARGUMENT")
            r = run("load", "--shards", a + "|" + a, "--workers", "1", "--params", "100k", "--steps", "2")
            self.assertUsage(r, "twice")
            self.assertEqual(run(*base).returncode, 0)  # the same, without them, runs

    @need_server
    def test_load_names_a_worker_count_the_shards_do_not_run(self):
        # It did not pass num_workers: a wrong --workers showed as a stale
        # push on the next run (or a round that never filled).
        with Shards(1, mode="sync", workers=1) as s:
            r = run("load", "--shards", s.addrs[0], "--workers", "2", "--params", "1k", "--steps", "2")
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("says the job has 2 workers, but this sync shard expects 1", r.stderr)

    @need_server
    def test_load_with_a_worker_id_says_which_worker_it_runs(self):
        # It printed "2 worker threads" for the one worker it ran.
        with Shards(1, mode="sync", workers=2) as s:
            cmd = [CLI, "load", "--shards", s.addrs[0], "--workers", "2", "--params", "1k", "--steps", "2"]
            procs = [subprocess.Popen(cmd + ["--worker-id", str(w)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for w in (0, 1)]
            try:
                outs = [p.communicate(timeout=60) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            for w, (p, (out, err)) in enumerate(zip(procs, outs)):
                self.assertEqual(p.returncode, 0, err)
                self.assertIn("1 shard(s), worker %d of 2," % w, out)
                self.assertNotIn("worker threads", out)

    @need_server
    def test_pull_out_is_kept_for_an_unknown_name(self):
        with Shards(1, mode="async") as s, tempfile.TemporaryDirectory() as d:
            self.assertEqual(run("load", "--shards", s.addrs[0], "--workers", "1", "--params", "1k",
                                 "--steps", "2").returncode, 0)
            keep = os.path.join(d, "keep.bin")
            with open(keep, "wb") as f:
                f.write(b"precious data")
            r = run("pull", "--shards", s.addrs[0], "--out", keep, "embed.tok", "nope")
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("no shard holds tensor 'nope'", r.stderr)
            with open(keep, "rb") as f:
                self.assertEqual(f.read(), b"precious data")
            r = run("pull", "--shards", s.addrs[0], "--out", keep, "embed.tok")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertGreater(os.path.getsize(keep), 13)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/python3
"""The checkpoint metrics and alerts against the real factorps-server on
loopback: the checkpoint series after real checkpoints, a real failure (the directory
taken away; a full file system in a private mount namespace), and the
restore outcome and sequence of a restarted shard; promtool accepts it all.
Then a real Prometheus with deploy/prometheus/ (alerts.yml unchanged)
scrapes real shards whose checkpoints fail, grow old and restart empty, and
each checkpoint alert becomes active.

Environment: FACTORPS_SERVER (factorps-server path; set by ctest).
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fpsgrpc as F  # noqa: E402

SERVER = os.environ.get("FACTORPS_SERVER", "")
INTERVAL = 0.3


def wait_for(fn, what, timeout=20):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.05)


def scrape(shard):
    st, _, body = shard.scrape()
    assert st == 200, st
    return body.decode()


def promtool_ok(tc, text):
    if not shutil.which("promtool"):
        return
    r = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                       capture_output=True, timeout=30)
    tc.assertEqual(r.returncode, 0, (r.stdout + r.stderr).decode())


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class CheckpointSeries(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-ckmetrics-")
        self.ck = os.path.join(self.root, "ck")
        self.shards = []

    def tearDown(self):
        for s in self.shards:
            if s.p.poll() is None:
                s.stop()
        shutil.rmtree(self.root, True)

    def start(self, *extra, prefix=()):
        s = F.Shard(SERVER, 0, 1, mode="async", prefix=prefix,
                    extra=["--checkpoint-dir", self.ck, "--checkpoint-interval", str(INTERVAL),
                           *extra])
        self.shards.append(s)
        return s

    def test_written_failed_restored(self):
        s = self.start()
        t = scrape(s)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="empty"), 1)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="restored"), 0)
        self.assertEqual(F.metric(t, "factorps_checkpoint_interval_seconds"), INTERVAL)
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_timestamp_seconds"), 0)
        tensors = F.shard_tensors(0)
        ch, stub = F.channel(s.addr)
        F.create(stub, 0, 1, tensors)
        for step in range(3):
            F.push(stub, 0, step, tensors)
        t0 = time.time()
        # The periodic write after the pushes: unsaved drops to 0.
        t = wait_for(lambda: (lambda t: t if F.metric(t, "factorps_checkpoint_unsaved_updates") == 0
                              and F.metric(t, "factorps_checkpoint_last_success_sequence") >= 1
                              else None)(scrape(s)), "the first periodic checkpoint")
        files = sorted(glob.glob(os.path.join(self.ck, "ckpt-*.safetensors")))
        seq = F.metric(t, "factorps_checkpoint_last_success_sequence")
        self.assertEqual(os.path.basename(files[-1]), "ckpt-%08d.safetensors" % seq)
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_size_bytes"),
                         os.path.getsize(files[-1]))
        self.assertGreaterEqual(F.metric(t, "factorps_checkpoint_written_bytes_total"),
                                os.path.getsize(files[-1]))
        self.assertGreaterEqual(F.metric(t, "factorps_checkpoint_duration_seconds_count"), 1)
        ts = F.metric(t, "factorps_checkpoint_last_success_timestamp_seconds")
        self.assertLess(abs(ts - t0), 10)
        self.assertAlmostEqual(ts, os.path.getmtime(files[-1]), delta=2)
        self.assertEqual(F.metric(t, "factorps_checkpoint_failures_total", reason="no_directory"), 0)
        promtool_ok(self, t)

        # Take the directory away: the next periodic write fails, the pushes
        # stay unsaved, the last success stays where it was.
        os.rename(self.ck, self.ck + ".away")
        F.push(stub, 0, 3, tensors)
        t = wait_for(lambda: (lambda t: t if F.metric(t, "factorps_checkpoint_failures_total",
                                                      reason="no_directory") >= 1 else None)(scrape(s)),
                     "a failed checkpoint")
        self.assertEqual(F.metric(t, "factorps_checkpoint_unsaved_updates"), len(tensors))
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_sequence"), seq)
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_timestamp_seconds"), ts)
        self.assertEqual(F.metric(t, "factorps_checkpoint_failures_total", reason="io"), 0)
        promtool_ok(self, t)
        os.rename(self.ck + ".away", self.ck)
        t = wait_for(lambda: (lambda t: t if F.metric(t, "factorps_checkpoint_unsaved_updates") == 0
                              else None)(scrape(s)), "the retry after the failure")
        seq2 = F.metric(t, "factorps_checkpoint_last_success_sequence")
        self.assertEqual(seq2, seq + 1)
        ch.close()
        self.assertEqual(s.stop(), 0)  # SIGTERM: nothing changed, no final write needed

        # Restart on the same directory: restored, with the sequence.
        newest = sorted(glob.glob(os.path.join(self.ck, "ckpt-*.safetensors")))[-1]
        s = self.start("--require-checkpoint")
        t = scrape(s)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="restored"), 1)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="empty"), 0)
        rseq = int(os.path.basename(newest)[5:-12])
        self.assertGreaterEqual(rseq, seq2)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restored_sequence"), rseq)
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_sequence"), rseq)
        # The restored checkpoint's "created" is the last success until a new write.
        self.assertAlmostEqual(F.metric(t, "factorps_checkpoint_last_success_timestamp_seconds"),
                               os.path.getmtime(newest), delta=2)
        self.assertGreater(F.metric(t, "factorps_checkpoint_restore_duration_seconds"), 0)
        self.assertEqual(F.metric(t, "factorps_checkpoint_unsaved_updates"), 0)
        self.assertEqual(F.metric(t, "factorps_tensors"), len(tensors))
        promtool_ok(self, t)
        self.assertEqual(s.stop(), 0)

    def test_no_checkpoint_dir_is_disabled(self):
        s = F.Shard(SERVER, 0, 1, mode="async")
        self.shards.append(s)
        t = scrape(s)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="disabled"), 1)
        self.assertEqual(F.metric(t, "factorps_checkpoint_interval_seconds"), 0)

    def test_full_file_system_is_no_space(self):
        # A 16 KiB tmpfs in the shard's own mount namespace holds one
        # checkpoint of these tensors, not two (the new one is complete
        # before the old one is pruned).
        why = F.fpsproc.private_mounts_problem()
        if why:
            self.skipTest("a private tmpfs: " + why)
        os.makedirs(self.ck)
        mount = ('mount -t tmpfs -o size=16k fps-ck "%s" && exec "$0" "$@"' % self.ck)
        s = self.start(prefix=["unshare", "-m", "--propagation", "private", "sh", "-c", mount])
        tensors = F.shard_tensors(0)
        ch, stub = F.channel(s.addr)
        F.create(stub, 0, 1, tensors)
        F.push(stub, 0, 0, tensors)
        wait_for(lambda: F.metric(scrape(s), "factorps_checkpoint_last_success_sequence") == 1,
                 "the first checkpoint")
        F.push(stub, 0, 1, tensors)
        t = wait_for(lambda: (lambda t: t if F.metric(t, "factorps_checkpoint_failures_total",
                                                      reason="no_space") >= 1 else None)(scrape(s)),
                     "a no_space failure")
        self.assertEqual(F.metric(t, "factorps_checkpoint_failures_total", reason="io"), 0)
        self.assertEqual(F.metric(t, "factorps_checkpoint_last_success_sequence"), 1)
        ch.close()
        # The final checkpoint fails too: the exit status says so.
        self.assertEqual(s.stop(), 1)


def active_alerts(prom, name):
    """Labels of the ALERTS series of alert `name` (pending or firing)."""
    return [m for m, v in prom.query('ALERTS{alertname="%s"}' % name) if v == 1]


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
@unittest.skipUnless(shutil.which("prometheus"), "prometheus not installed")
class AlertsWithPrometheus(unittest.TestCase):
    """Shard 0 of 2 restores a checkpoint, then its directory vanishes while
    it keeps being trained: FactorpsCheckpointFailing (reason no_directory)
    fires and, once the last checkpoint is 3 intervals old,
    FactorpsCheckpointTooOld is pending (its `for` is 5 minutes). Shard 1
    starts empty beside the restored shard 0: FactorpsShardRestartedEmpty."""

    def test_checkpoint_alerts_become_active(self):
        root = tempfile.mkdtemp(prefix="fps-ckalerts-")
        ck0, ck1 = os.path.join(root, "ck0"), os.path.join(root, "ck1")
        iv = "1"
        flags = ["--checkpoint-interval", iv]
        shards, prom = [], None
        try:
            tensors = F.shard_tensors(0)
            first = F.Shard(SERVER, 0, 2, mode="async", extra=["--checkpoint-dir", ck0, *flags])
            shards.append(first)
            ch, stub = F.channel(first.addr)
            F.create(stub, 0, 2, tensors)
            F.push(stub, 0, 0, tensors)
            ch.close()
            self.assertEqual(first.stop(), 0)  # final checkpoint
            s0 = F.Shard(SERVER, 0, 2, mode="async",
                         extra=["--checkpoint-dir", ck0, "--require-checkpoint", *flags])
            s1 = F.Shard(SERVER, 1, 2, mode="async", extra=["--checkpoint-dir", ck1, *flags])
            shards += [s0, s1]
            prom = F.Prometheus(["%s:%d" % (s.host, s.metrics_port) for s in (s0, s1)])
            # Prometheus must have seen the failure counters at 0 first.
            wait_for(lambda: len(prom.query('factorps_checkpoint_failures_total{reason="no_directory"}'))
                     == 2, "both shards scraped", timeout=40)
            time.sleep(1.5)
            self.assertEqual(active_alerts(prom, "FactorpsCheckpointFailing"), [])
            os.rename(ck0, ck0 + ".away")
            ch, stub = F.channel(s0.addr)
            for step in range(1, 4):
                F.push(stub, 0, step, tensors)
            ch.close()

            def alert(name, **labels):
                got = active_alerts(prom, name)
                return [m for m in got if all(m.get(k) == v for k, v in labels.items())]
            fail = wait_for(lambda: alert("FactorpsCheckpointFailing", shard="0"),
                            "FactorpsCheckpointFailing", timeout=40)
            self.assertEqual(fail[0]["reason"], "no_directory")
            self.assertEqual(fail[0]["alertstate"], "firing")
            old = wait_for(lambda: alert("FactorpsCheckpointTooOld", shard="0"),
                           "FactorpsCheckpointTooOld", timeout=40)
            self.assertEqual(old[0]["alertstate"], "pending")
            empty = wait_for(lambda: alert("FactorpsShardRestartedEmpty"),
                             "FactorpsShardRestartedEmpty", timeout=40)
            self.assertEqual([m["shard"] for m in empty], ["1"])
            # Shard 1 is idle and healthy: no checkpoint alert of its own.
            self.assertEqual(alert("FactorpsCheckpointFailing", shard="1"), [])
            self.assertEqual(alert("FactorpsCheckpointTooOld", shard="1"), [])
            os.rename(ck0 + ".away", ck0)
        except BaseException:
            for s in shards:
                print(s.read_log(), file=sys.stderr)
            if prom:
                print(prom.read_log(), file=sys.stderr)
            raise
        finally:
            if prom:
                prom.stop()
            for s in shards:
                if s.p.poll() is None:
                    s.stop()
            shutil.rmtree(root, True)


if __name__ == "__main__":
    unittest.main(verbosity=2)

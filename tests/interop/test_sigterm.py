#!/usr/bin/python3
"""SIGTERM under load exits in bounded time (also with split tensors,
SigtermSplit): two shards,
one worker (`factorps load`) pushing a 10M-parameter model through both;
SIGTERM both shards 20 times, restarting them in between. Every exit must
be code 0 within BOUND_S of the signal (the shard promises 1 s plus the
final checkpoint's write time; none is configured here). The measured
times are printed.

gRPC's TCP backup poller used to hold the exit in grpc_shutdown_blocking()
for 10 s whenever a large reply's write had needed it."""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import unittest

import fpsharness as H

CLI = os.environ.get("FPS_CLI", os.path.join(H.REPO, "build", "client", "factorps"))
ROUNDS = int(os.environ.get("FPS_SIGTERM_ROUNDS", "20"))
SPLIT_ROUNDS = int(os.environ.get("FPS_SIGTERM_SPLIT_ROUNDS", "5"))
BOUND_S = 5.0


class Sigterm(unittest.TestCase):
    def round(self):
        shards = [H.Server("--mode", "async", "--shard-id", i, "--shard-count", 2) for i in range(2)]
        load = None
        # A file, not a pipe: the load's progress output must never block it.
        log = tempfile.TemporaryFile()
        try:
            load = subprocess.Popen([CLI, "load", "--shards", ",".join(s.addr for s in shards), "--workers", "1",
                                     "--params", "10M", "--steps", "1000000"],
                                    stdout=subprocess.DEVNULL, stderr=log)
            # Pushing: both shards have applied updates.
            t0 = time.monotonic()
            while True:
                ups = [H.stats(s.stub)[0].shard.updates for s in shards]
                if min(ups) >= 64:  # two steps of the load's 32 tensors
                    break
                if load.poll() is not None:
                    log.seek(0)
                    self.fail("factorps load exited: %s" % log.read().decode(errors="replace"))
                self.assertLess(time.monotonic() - t0, 120, "the load never pushed")
                time.sleep(0.05)
            for s in shards:
                s._channel.close()
                s._channel = s._stub = None
            t0 = time.monotonic()
            for s in shards:
                s.proc.send_signal(15)
            took = []
            for s in shards:
                rc = s.proc.wait(timeout=60)
                took.append(time.monotonic() - t0)
                self.assertEqual(rc, 0, s.stderr())
                for m in H.SANITIZER_MARKERS:
                    self.assertNotIn(m, s.stderr())
            return took
        finally:
            if load is not None:
                load.kill()
                load.wait()
            log.close()
            for s in shards:
                if s.proc.poll() is None:
                    s.proc.kill()
                    s.proc.wait()
                s.proc.stdout.close()
                s.log.close()

    def test_sigterm_under_load_exits_in_bounded_time(self):
        H.stubs()
        times = []
        for i in range(ROUNDS):
            took = self.round()
            times += took
            print("round %2d: shards exited %.3f s and %.3f s after SIGTERM" % (i, took[0], took[1]), file=sys.stderr)
        print("SIGTERM under load, %d exits: median %.3f s, max %.3f s (bound %.1f s)" %
              (len(times), statistics.median(times), max(times), BOUND_S), file=sys.stderr)
        self.assertLess(max(times), BOUND_S, times)


class SigtermSplit(unittest.TestCase):
    """The same with split tensors: two sync shards that know
    each other (--peers), the load's tensors of 4 MiB and more cut into
    row blocks, so cross-shard steps and their Exchange calls are in
    flight when SIGTERM comes. Every exit 0 within BOUND_S.

    A stopping shard finishes a step whose exchange has begun, bounded by
    --exchange-deadline (+ 1 s): when both shards stop at once, one can
    wait for a peer that has already gone (about 1 run in 16 under load,
    with the default 10 s deadline: a 10.1 s exit). The job runs with a
    2 s deadline so that the documented bound fits in BOUND_S."""

    def round(self):
        job = H.Job(2, "--mode", "sync", "--workers", 1, "--exchange-deadline", 2)
        load = None
        log = tempfile.TemporaryFile()
        try:
            load = subprocess.Popen([CLI, "load", "--shards", ",".join(job.addrs), "--workers", "1", "--params",
                                     "10M", "--steps", "1000000", "--mode-hint", "sync", "--split-min-bytes", "4Mi"],
                                    stdout=subprocess.DEVNULL, stderr=log)
            t0 = time.monotonic()
            while True:
                steps = [H.stats(s.stub)[0].shard.exchange_steps for s in job.servers]
                if min(steps) >= 4:  # cross-shard steps on both shards
                    break
                if load.poll() is not None:
                    log.seek(0)
                    self.fail("factorps load exited: %s" % log.read().decode(errors="replace"))
                self.assertLess(time.monotonic() - t0, 120, "the load never stepped a split tensor")
                time.sleep(0.05)
            for s in job.servers:
                s._channel.close()
                s._channel = s._stub = None
            t0 = time.monotonic()
            for s in job.servers:
                s.proc.send_signal(15)
            took = []
            for s in job.servers:
                rc = s.proc.wait(timeout=60)
                took.append(time.monotonic() - t0)
                self.assertEqual(rc, 0, s.stderr())
                for m in H.SANITIZER_MARKERS:
                    self.assertNotIn(m, s.stderr())
            return took
        finally:
            if load is not None:
                load.kill()
                load.wait()
            log.close()
            for s in job.servers:
                if s.proc.poll() is None:
                    s.proc.kill()
                    s.proc.wait()
                s.proc.stdout.close()
                s.log.close()
                shutil.rmtree(s.dir, True)

    def test_sigterm_with_split_steps_exits_in_bounded_time(self):
        H.stubs()
        times = []
        for i in range(SPLIT_ROUNDS):
            took = self.round()
            times += took
            print("split round %2d: shards exited %.3f s and %.3f s after SIGTERM" % (i, took[0], took[1]),
                  file=sys.stderr)
        print("SIGTERM with split steps, %d exits: median %.3f s, max %.3f s (bound %.1f s)" %
              (len(times), statistics.median(times), max(times), BOUND_S), file=sys.stderr)
        self.assertLess(max(times), BOUND_S, times)


if __name__ == "__main__":
    unittest.main()

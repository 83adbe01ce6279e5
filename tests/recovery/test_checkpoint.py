"""Checkpoints and recovery of one shard: the Checkpoint RPC, SIGTERM,
damaged files, --require-checkpoint, and SIGKILL in the middle of a large
write. Every test runs real shards (see _recovery.py) and checks what is on
disk with `factorps checkpoint verify`."""

import json
import os
import re
import signal
import subprocess
import threading
import time
import unittest

import numpy as np

from _recovery import CLI, SERVER, CkptShards, Shards, flip_byte, need_server, truncate, verify

import factorps
from factorps import TensorSpec, optimizer_config

RNG = np.random.default_rng(7)
SPECS = [
    # factored (row/col state), unfactored (var), hf with momentum (mom)
    ("m", (12, 9), optimizer_config("torch", lr=0.01)),
    ("v", (17,), optimizer_config("torch", lr=0.02, weight_decay=0.01)),
    ("h", (5, 4), optimizer_config("hf", lr=0.001, relative_step=False, beta1=0.9)),
]
INIT = {n: RNG.standard_normal(s).astype(np.float32) for n, s, _ in SPECS}
GRADS = [{n: RNG.standard_normal(s).astype(np.float32) for n, s, _ in SPECS} for _ in range(8)]


def connect(addrs, **kw):
    kw.setdefault("deadline", 20)
    c = factorps.connect(addrs, **kw)
    c.create([TensorSpec(n, s, init=INIT[n], optimizer=o) for n, s, o in SPECS])
    return c


def push(c, k):
    params, versions = c.push_pull(GRADS[k], step=k)
    return {n: np.array(p) for n, p in params.items()}, dict(versions)


def one_checkpoint_then_kill(ck):
    """Shard 0 of `ck` pushes once, checkpoints and is SIGKILLed: returns
    its one checkpoint file's path and bytes."""
    c = connect(ck.addrs)
    push(c, 0)
    c.checkpoint()
    c.close()
    ck.kill(0)
    (path,) = ck.files(0)
    with open(path, "rb") as f:
        return path, f.read()


def wait_exit(proc, timeout=30):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise


@need_server
class Checkpoints(unittest.TestCase):
    def test_rpc_checkpoint_restart_restores_everything(self):
        # Two identical one-shard jobs: `ref` is never restarted, `ck` is
        # checkpointed, killed and restored; identical further steps must
        # then give bit-identical params (so the optimizer state came back).
        with CkptShards(1) as ref, CkptShards(1) as ck:
            cr, cc = connect(ref.addrs), connect(ck.addrs)
            for k in range(3):
                push(cr, k)
                push(cc, k)
            info = cc.checkpoint()
            self.assertEqual(len(info), 1)
            self.assertEqual(info[0]["tensors"], 3)
            self.assertEqual(info[0]["sequence"], 1)
            self.assertTrue(os.path.exists(info[0]["path"]), info)
            self.assertEqual(os.path.getsize(info[0]["path"]), info[0]["bytes"])
            before, vb = cc.pull()
            before = {n: np.array(p) for n, p in before.items()}
            cc.close()
            ck.restart(0)  # SIGKILL, then a fresh process on the same port
            self.assertIn("restored 3 tensors", ck.log(0))
            cc = factorps.connect(ck.addrs, deadline=20)
            cc.create([TensorSpec(n, s, init=INIT[n], optimizer=o) for n, s, o in SPECS])
            after, va = cc.pull()
            self.assertEqual(dict(va), dict(vb))
            self.assertEqual(dict(va), {"m": 3, "v": 3, "h": 3})
            for n in before:
                np.testing.assert_array_equal(np.array(after[n]), before[n], err_msg=n)
            for k in range(3, 6):
                pr, vr = push(cr, k)
                pc, vc = push(cc, k)
                self.assertEqual(vr, vc)
                for n in pr:
                    np.testing.assert_array_equal(pc[n], pr[n], err_msg=f"{n} after step {k}")
            cr.close()
            cc.close()
            rc, out = verify(ck.ckdir(0), "--shard-id", "0", "--shard-count", "1", "--mode", "sync")
            self.assertEqual(rc, 0, out)

    def test_ahead_of_restored_shard_says_what_to_do(self):
        with CkptShards(1) as ck:
            c = connect(ck.addrs)
            push(c, 0)
            c.checkpoint()
            push(c, 1)
            push(c, 2)
            c.close()
            ck.restart(0)
            c = factorps.connect(ck.addrs, deadline=20)
            c.create([TensorSpec(n, s, init=INIT[n], optimizer=o) for n, s, o in SPECS])
            with self.assertRaises(factorps.FailedPreconditionError) as cm:
                c.push_pull(GRADS[3], step=3)
            msg = str(cm.exception)
            self.assertIn("ahead of shard", msg)
            self.assertRegex(msg, r"restored the tensor from checkpoint 1 at version 1")
            self.assertIn("pull", msg)
            # The documented recovery: pull, take the versions as the step.
            _, versions = c.pull()
            self.assertEqual(set(dict(versions).values()), {1})
            c.push_pull(GRADS[3], step=1)
            c.close()

    def test_sigterm_writes_a_final_checkpoint(self):
        with CkptShards(1) as ck:
            c = connect(ck.addrs)
            push(c, 0)
            push(c, 1)
            c.close()
            self.assertEqual(ck.files(0), [])
            ck.procs[0].send_signal(signal.SIGTERM)
            self.assertEqual(wait_exit(ck.procs[0]), 0, ck.log(0))
            ck.procs[0] = None
            files = ck.files(0)
            self.assertEqual(len(files), 1, files)
            rc, out = verify(ck.ckdir(0))
            self.assertEqual(rc, 0, out)
            ck.start(0, ck.ports[0])
            c = factorps.connect(ck.addrs, deadline=20)
            c.create([TensorSpec(n, s, init=INIT[n], optimizer=o) for n, s, o in SPECS])
            _, v = c.pull()
            self.assertEqual(dict(v), {"m": 2, "v": 2, "h": 2})
            c.close()

    def test_truncated_and_corrupted_checkpoints_are_skipped(self):
        with CkptShards(1, ckpt=["--checkpoint-keep", "5"]) as ck:
            c = connect(ck.addrs)
            for k in range(3):
                push(c, k)
                c.checkpoint()  # sequence k+1 holds version k+1
            c.close()
            ck.kill(0)
            f1, f2, f3 = ck.files(0)
            flip_byte(f2)         # data corrupted: SHA-256 mismatch
            truncate(f3, 0.6)     # truncated
            rc, out = verify(ck.ckdir(0))
            self.assertEqual(rc, 1, out)
            self.assertEqual(len(re.findall(r"^BAD ", out, re.M)), 2, out)
            ck.start(0, ck.ports[0])
            log = ck.log(0)
            self.assertRegex(log, r"checkpoint \S*ckpt-0+3\.safetensors skipped \(FPS_EFORMAT\): .*trying the previous")
            self.assertRegex(log, r"checkpoint \S*ckpt-0+2\.safetensors skipped \(FPS_EFORMAT\): .*trying the previous")
            self.assertRegex(log, r"restored 3 tensors .*ckpt-0+1\.safetensors")
            c = factorps.connect(ck.addrs, deadline=20)
            c.create([TensorSpec(n, s, init=INIT[n], optimizer=o) for n, s, o in SPECS])
            _, v = c.pull()
            self.assertEqual(dict(v), {"m": 1, "v": 1, "h": 1})
            c.close()

    def test_mismatched_placement_is_skipped(self):
        with CkptShards(1) as ck:
            c = connect(ck.addrs)
            push(c, 0)
            c.checkpoint()
            c.close()
            ck.kill(0)
            # The same directory given to a shard of another mode.
            ck.mode = "async"
            with self.assertRaises(RuntimeError):
                ck.ckpt = ["--require-checkpoint"]
                ck.start(0)
            self.assertRegex(ck.log(0), r"skipped \(FPS_ESTATE\)")

    def test_unloadable_files_are_moved_aside_not_pruned(self):
        # A restart with a wrong flag (here the mode) skipped the job's
        # checkpoints and then pruned them after --checkpoint-keep writes:
        # the trained state was gone. Now they are moved into unloaded/.
        with CkptShards(1) as ck:
            f1, before = one_checkpoint_then_kill(ck)
            ck.mode = "async" if ck.mode != "async" else "sync"
            ck.ckpt = ["--checkpoint-keep", "1"]
            ck.start(0)
            c = connect(ck.addrs)
            for k in range(3):
                push(c, k)
                c.checkpoint()
            c.close()
            aside = os.path.join(ck.ckdir(0), "unloaded", os.path.basename(f1))
            self.assertTrue(os.path.exists(aside), os.listdir(ck.ckdir(0)))
            with open(aside, "rb") as f:
                self.assertEqual(f.read(), before)
            self.assertRegex(ck.log(0), r"moved \S*ckpt-0+1\.safetensors to \S*unloaded/ckpt-0+1\.safetensors")
            rc, out = verify(os.path.join(ck.ckdir(0), "unloaded"))
            self.assertEqual(rc, 0, out)

    def test_a_second_set_aside_keeps_the_first(self):
        # Wrong flag, then the right one: the shard started empty under the
        # wrong mode numbers its files from 1 again, and the right restart
        # set those aside under the same names, over the job's own files in
        # unloaded/ (rename replaces): the trained state was gone. Now the
        # second file takes the next free name.
        with CkptShards(1) as ck:
            mode = ck.mode
            f1, trained = one_checkpoint_then_kill(ck)
            ck.mode = "async" if mode != "async" else "sync"
            ck.start(0)
            f2, _ = one_checkpoint_then_kill(ck)  # ckpt-00000001 again, of the wrong mode
            self.assertEqual(os.path.basename(f2), os.path.basename(f1))
            ck.mode = mode
            ck.start(0)
            unloaded = os.path.join(ck.ckdir(0), "unloaded")
            self.assertEqual(sorted(os.listdir(unloaded)),
                             ["ckpt-00000001-2.safetensors", "ckpt-00000001.safetensors"])
            with open(os.path.join(unloaded, "ckpt-00000001.safetensors"), "rb") as f:
                self.assertEqual(f.read(), trained)
            self.assertRegex(ck.log(0), r"moved \S*ckpt-0+1\.safetensors to \S*unloaded/ckpt-0+1-2\.safetensors")

    def test_require_checkpoint_refuses_to_start(self):
        with CkptShards(1) as ck:
            c = connect(ck.addrs)
            push(c, 0)
            c.checkpoint()
            c.close()
            ck.kill(0)
            for f in ck.files(0):
                truncate(f, 0.3)
            ck.ckpt = ["--require-checkpoint"]
            with self.assertRaisesRegex(RuntimeError, "exited with 3"):
                ck.start(0)
            log = ck.log(0)
            self.assertIn("holds no valid checkpoint and --require-checkpoint is set", log)
            self.assertFalse(os.path.exists(os.path.join(ck.dir, "shard0.port")))
            # An empty directory is refused too, and nothing is written into it.
            empty = os.path.join(ck.root, "empty")
            p = subprocess.run([SERVER, "--listen", "127.0.0.1:0", "--checkpoint-dir", empty,
                                "--require-checkpoint"], capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 3, p.stderr)
            self.assertIn("holds no checkpoint", p.stderr)
            self.assertEqual([f for f in os.listdir(empty) if "ckpt" in f], [])

    def test_interval_writes_only_when_something_changed(self):
        with CkptShards(1, ckpt=["--checkpoint-interval", "0.1", "--checkpoint-keep", "100"]) as ck:
            c = connect(ck.addrs)
            push(c, 0)
            time.sleep(1.0)
            n1 = len(ck.files(0))
            self.assertGreaterEqual(n1, 1)
            self.assertLessEqual(n1, 2)  # idle: no new file every 0.1 s
            push(c, 1)
            end = time.monotonic() + 10
            while len(ck.files(0)) == n1 and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(0.5)
            self.assertEqual(len(ck.files(0)), n1 + 1)
            c.close()
            rc, out = verify(ck.ckdir(0))
            self.assertEqual(rc, 0, out)

    def test_cli_checkpoint_and_flags(self):
        with CkptShards(2, mode="async") as ck:
            c = connect(ck.addrs)
            c.push_pull(GRADS[0], step=0)
            c.close()
            p = subprocess.run([CLI, "checkpoint", "--shards", ",".join(ck.addrs)], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertRegex(p.stdout, r"shard 0 .*sequence 1 .*ckpt-0+1\.safetensors")
            self.assertRegex(p.stdout, r"shard 1 .*sequence 1 ")
            for i in range(2):
                rc, out = verify(ck.ckdir(i), "--shard-id", str(i), "--shard-count", "2")
                self.assertEqual(rc, 0, out)
                rc, out = verify(ck.ckdir(i), "--shard-id", str(1 - i), "--shard-count", "2")
                self.assertEqual(rc, 1, out)  # placement mismatch is a bad file for that shard
                rc, out = verify(ck.ckdir(i), "--mode", "sync")
                self.assertEqual(rc, 1, out)
            # Bad flags are usage errors (exit 2, saying which), not bad files.
            for args, says in [(("--mode", "weird"), "--mode must be sync, async or ssp, not 'weird'"),
                               (("--shard-id", "5", "--shard-count", "2"), "--shard-id 5 must be below --shard-count 2"),
                               (("--shard-id", "1"), "--shard-id and --shard-count go together")]:
                rc, out = verify(ck.ckdir(0), *args)
                self.assertEqual(rc, 2, out)
                self.assertIn(says, out)
        with CkptShards(1) as empty:
            p = subprocess.run([CLI, "checkpoint", "--shards", empty.addrs[0]], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 1)
            self.assertIn("FAILED_PRECONDITION", p.stderr)
            self.assertIn("no tensors to write", p.stderr)
            empty.procs[0].send_signal(signal.SIGTERM)
            self.assertEqual(wait_exit(empty.procs[0]), 0, empty.log(0))
            empty.procs[0] = None
            self.assertEqual(empty.files(0), [])  # an empty shard writes (and prunes) nothing
        with Shards(1) as plain:  # no --checkpoint-dir
            p = subprocess.run([CLI, "checkpoint", "--shards", plain.addrs[0]], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 1)
            self.assertIn("FAILED_PRECONDITION", p.stderr)
            self.assertIn("without --checkpoint-dir", p.stderr)
        rc, out = verify("/nonexistent/fps-ckpt")
        self.assertEqual(rc, 1, out)
        for args, msg in ((["--checkpoint-interval", "1"], "--checkpoint-interval needs --checkpoint-dir"),
                          (["--require-checkpoint"], "--require-checkpoint needs --checkpoint-dir"),
                          (["--checkpoint-dir", "/tmp/x", "--require-checkpoint=maybe"], "true or false"),
                          (["--checkpoint-dir", "/tmp/x", "--checkpoint-keep", "0"], "--checkpoint-keep")):
            p = subprocess.run([SERVER, "--listen", "127.0.0.1:0", *args], capture_output=True, text=True,
                               timeout=30, stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(msg, p.stderr)


def file_job(path):
    """The "job_id" in a checkpoint file's metadata (None without one)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))["__metadata__"].get("job_id")


@need_server
class JobIdentity(unittest.TestCase):
    """A checkpoint volume reused by another job: the shard must not resume
    that job's weights silently (the Creates of the new job match by name
    and shape, so nothing else would notice)."""

    def test_another_jobs_checkpoint_is_refused(self):
        with CkptShards(1) as ck:
            c = connect(ck.addrs, job_id="job-a")
            push(c, 0)
            info = c.checkpoint()
            c.close()
            self.assertEqual(file_job(info[0]["path"]), "job-a")
            ck.restart(0)
            self.assertIn("restored 3 tensors", ck.log(0))
            # Without --job-id the restored file's job is the shard's: the
            # new job's Create is refused, naming the file and both jobs.
            with self.assertRaises(factorps.FailedPreconditionError) as cm:
                connect(ck.addrs, job_id="job-b")
            msg = str(cm.exception)
            for want in ("'job-a'", "'job-b'", os.path.basename(info[0]["path"])):
                self.assertIn(want, msg)
            # Its own job and an older client (no job id) still resume.
            c = connect(ck.addrs, job_id="job-a")
            _, versions = c.pull()
            self.assertEqual(set(dict(versions).values()), {1})
            c.close()
            connect(ck.addrs).close()
            ck.kill(0)
            # With --job-id the file is refused at restore, named with both
            # jobs, and moved aside (never pruned): the shard starts empty.
            ck.extra = ["--job-id", "job-b"]
            ck.start(0)
            log = ck.log(0)
            self.assertRegex(log, r"checkpoint \S*ckpt-0+1\.safetensors skipped \(FPS_ESTATE\): "
                                  r"mismatched: written for job 'job-a', this shard serves job 'job-b'")
            self.assertIn("starting empty", log)
            aside = os.path.join(ck.ckdir(0), "unloaded", os.path.basename(info[0]["path"]))
            self.assertEqual(file_job(aside), "job-a")
            with self.assertRaises(factorps.FailedPreconditionError):
                connect(ck.addrs, job_id="job-a")
            c = connect(ck.addrs, job_id="job-b")
            _, versions = c.pull()
            self.assertEqual(set(dict(versions).values()), {0})
            push(c, 0)
            info = c.checkpoint()
            c.close()
            self.assertEqual(file_job(info[0]["path"]), "job-b")

    def test_first_create_fixes_the_job(self):
        with CkptShards(1) as ck:
            connect(ck.addrs).close()  # names no job: none fixed yet
            c = connect(ck.addrs, job_id="run-1")
            with self.assertRaisesRegex(factorps.FailedPreconditionError,
                                        r"serves job 'run-1' \(from the first Create\).*'run-2'"):
                connect(ck.addrs, job_id="run-2")
            with self.assertRaises(factorps.InvalidArgumentError):
                connect(ck.addrs, job_id="bad id")
            push(c, 0)
            info = c.checkpoint()
            c.close()
            self.assertEqual(file_job(info[0]["path"]), "run-1")
            rc, out = verify(ck.ckdir(0))
            self.assertEqual(rc, 0, out)
            self.assertIn("job run-1", out)
            # The CLI's --job-id (the deploy files' workers use it).
            p = subprocess.run([CLI, "load", "--shards", ck.addrs[0], "--workers", "1", "--params", "1k",
                                "--steps", "2", "--mode-hint", "sync", "--job-id", "run-2"],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertIn("'run-2'", p.stderr + p.stdout)
            p = subprocess.run([CLI, "load", "--shards", ck.addrs[0], "--workers", "1", "--params", "1k",
                                "--steps", "2", "--mode-hint", "sync", "--job-id", "run-1"],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 0, p.stderr)


@need_server
class CheckpointRpc(unittest.TestCase):
    """Checkpoint calls are written by a thread of their own, not by the
    threads that serve calls, and the calls that arrive while a write runs
    share the next write. Before, each call wrote on the poller that took
    it: a dozen of them held every poller (--threads 2 here), and Stats
    waited behind all of their writes."""

    N = 12

    def big_shard(self, ck):
        c = factorps.connect(ck.addrs, deadline=120)
        # 64 MiB of weights: a write (SHA-256, write, fsync) takes a good
        # part of a second, far longer than a Stats round trip.
        w = np.ones((4096, 4096), np.float32)
        c.create([TensorSpec("big", w.shape, init=w, optimizer=optimizer_config("torch", lr=0.01))])
        c.push_pull({"big": w * 0.001}, step=0)
        return c

    def concurrent_checkpoints(self, ck, during=None):
        """N Checkpoint calls released together (one client each); returns
        their replies with the monotonic time each came back, and what
        `during` returned (called once they were all sent)."""
        clients = [factorps.connect(ck.addrs, deadline=120) for _ in range(self.N)]
        go = threading.Barrier(self.N + 1)
        out = [None] * self.N

        def one(k):
            go.wait(30)
            info = clients[k].checkpoint()[0]
            out[k] = (time.monotonic(), info)

        ts = [threading.Thread(target=one, args=(k,)) for k in range(self.N)]
        for t in ts:
            t.start()
        go.wait(30)
        got = during() if during else None
        for t in ts:
            t.join(180)
        for c in clients:
            c.close()
        self.assertTrue(all(out), "a Checkpoint call did not return")
        return out, got

    def test_stats_answers_while_checkpoints_are_written(self):
        with CkptShards(1, extra=["--threads", "2"], ckpt=["--checkpoint-keep", "100"]) as ck:
            c = self.big_shard(ck)
            c.stats()  # connected

            def stats_now():
                time.sleep(0.05)  # the Checkpoint calls are in
                t0 = time.monotonic()
                c.stats()
                return t0, time.monotonic()

            out, (t0, t1) = self.concurrent_checkpoints(ck, stats_now)
            c.close()
            first = min(t for t, _ in out)
            # The order is the point: Stats came back while the first
            # write still ran. Before, it came after ~N writes.
            self.assertLess(t1, first, f"Stats answered {t1 - first:.3f} s after the first Checkpoint")
            self.assertLess(t1 - t0, 1.0)

    def test_concurrent_calls_share_one_write(self):
        with CkptShards(1, extra=["--threads", "2"], ckpt=["--checkpoint-keep", "100"]) as ck:
            self.big_shard(ck).close()
            out, _ = self.concurrent_checkpoints(ck)
            seqs = sorted(info["sequence"] for _, info in out)
            # The first call may start a write alone; every call that came
            # while it ran is served by the one next write. Before: N writes.
            self.assertLessEqual(len(set(seqs)), 2, seqs)
            self.assertGreaterEqual(seqs.count(seqs[-1]), self.N // 2, seqs)
            self.assertEqual(len(ck.files(0)), len(set(seqs)))
            paths = {info["sequence"]: info["path"] for _, info in out}
            for _, info in out:
                self.assertEqual(info["path"], paths[info["sequence"]])
            rc, text = verify(ck.ckdir(0))
            self.assertEqual(rc, 0, text)


@need_server
class KillDuringWrite(unittest.TestCase):
    # A 1-D tensor keeps a full second moment: 2 x 4 bytes per element on
    # disk, so 40M elements make a 320 MB checkpoint (several seconds of
    # writing on this machine, plenty of time to kill it inside the write).
    N = int(os.environ.get("FPS_RECOVERY_BIG_ELEMENTS", 40_000_000))

    def test_sigkill_inside_a_large_write_then_recover(self):
        with CkptShards(1, extra=["--max-message-bytes", str(64 << 20)]) as ck:
            c = factorps.connect(ck.addrs, deadline=120, max_message_bytes=64 << 20)
            init = np.linspace(-1, 1, self.N, dtype=np.float32)
            small = np.zeros(8, np.float32)
            c.create([TensorSpec("big", (self.N,), init=init), TensorSpec("small", (8,), init=small)])
            first = c.checkpoint()[0]
            mbps = first["bytes"] / 1e6 / max(first["seconds"], 1e-9)
            print(f"\ncheckpoint of {first['bytes'] / 1e6:.0f} MB in {first['seconds']:.2f} s: "
                  f"{mbps:.0f} MB/s", flush=True)
            # Pushes to a small tensor while the big one is written: they
            # wait for no more than a tensor's copy (they never share a lock
            # with the write).
            c.push_pull({"big": np.full(self.N, 0.5, np.float32), "small": small}, step=0,
                        want_params=False)
            lat, stop = [], threading.Event()

            def pusher():
                k = 1
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        c.push_pull({"small": np.ones(8, np.float32)}, step=k, want_params=False)
                    except factorps.Error:
                        return
                    lat.append(time.monotonic() - t0)
                    k += 1

            th = threading.Thread(target=pusher)
            th.start()
            second = c.checkpoint()[0]
            stop.set()
            th.join(30)
            self.assertGreater(len(lat), 0)
            print(f"pushes to another tensor during a {second['seconds']:.2f} s checkpoint: "
                  f"{len(lat)}, max latency {max(lat) * 1e3:.1f} ms, median "
                  f"{sorted(lat)[len(lat) // 2] * 1e3:.2f} ms", flush=True)
            m = re.findall(r"longest tensor lock ([0-9.]+) s", ck.log(0))
            if m:
                print(f"longest tensor lock held for a copy: {float(m[-1]) * 1e3:.1f} ms", flush=True)
            c.push_pull({"big": np.full(self.N, 0.25, np.float32)}, step=1, want_params=False)
            good = ck.files(0)
            self.assertEqual(len(good), 2)
            # Now a third checkpoint, killed as soon as its temp file appears.
            d = ck.ckdir(0)
            err = []
            t = threading.Thread(target=lambda: err.append(self._try(c.checkpoint)))
            t.start()
            end = time.monotonic() + 60
            tmp = []
            while time.monotonic() < end and not tmp:
                tmp = [f for f in os.listdir(d) if f.endswith(".tmp")]
                time.sleep(0.002)
            self.assertTrue(tmp, "no temporary checkpoint file appeared")
            time.sleep(0.05)  # inside the write (it takes seconds)
            ck.kill(0)
            t.join(150)
            self.assertFalse(t.is_alive())
            self.assertIsInstance(err[0], factorps.Error)  # the call saw the crash
            self.assertEqual(ck.files(0), good)  # no partial checkpoint under a final name
            self.assertTrue([f for f in os.listdir(d) if f.endswith(".tmp")])
            rc, out = verify(d)
            self.assertEqual(rc, 0, out)
            self.assertIn("temporary file of an interrupted write", out)
            ck.start(0, ck.ports[0])
            self.assertRegex(ck.log(0), r"restored 2 tensors .*ckpt-0+2\.safetensors")
            m = re.findall(r"restored 2 tensors \((\d+) bytes.* in ([0-9.]+) s", ck.log(0))
            if m:
                print(f"restore of {int(m[-1][0]) / 1e6:.0f} MB at start-up: {float(m[-1][1]):.2f} s",
                      flush=True)
            c.close()
            c = factorps.connect(ck.addrs, deadline=120, max_message_bytes=64 << 20)
            c.create([TensorSpec("big", (self.N,)), TensorSpec("small", (8,))])
            p, v = c.pull(["big"])
            self.assertEqual(dict(v)["big"], 1)
            self.assertFalse(np.array_equal(np.array(p["big"]), init))
            # The next write removes the leftover temporary file.
            c.checkpoint()
            self.assertEqual([f for f in os.listdir(d) if f.endswith(".tmp")], [])
            rc, out = verify(d)
            self.assertEqual(rc, 0, out)
            c.close()

    @staticmethod
    def _try(fn):
        try:
            return fn()
        except factorps.Error as e:
            return e


if __name__ == "__main__":
    unittest.main()

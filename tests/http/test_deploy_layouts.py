#!/usr/bin/python3
"""Shards started exactly as deploy/ configures them, killed
and restarted the way the orchestrator would, come back with their state
from the configured volume. No Docker engine or cluster: the shard
definitions come from the shipped files themselves (deploy/layouts.py:
Dockerfile + `docker-compose config` for compose, `kubectl kustomize` or
its fallback for the StatefulSet), so the test cannot drift from them.

What is exactly as shipped: the argument vector (the StatefulSet's
`/bin/sh -c 'exec /usr/local/bin/factorps-server --shard-id ${HOSTNAME##*-}'`
included), every environment variable, the hostname, the working
directory, the checkpoint path on the volume. Emulated (as root, in a
private mount namespace per shard): the read-only root filesystem, the
volume bind-mounted at its mount path (owned as Docker initialises a named
volume, or as Kubernetes' fsGroup leaves a claim), a tmpfs /tmp, the image's
/usr/local/bin/factorps-server (the binary just built, bind-mounted there),
and the unprivileged user 10001. Replaced, because every container has its
own network namespace: the listen addresses (127.0.0.1:0 plus port files in
a control directory). Without root or unshare the same argv and env run
with the container paths mapped under a temporary directory.

The orchestrator's actions: a stop is SIGTERM (docker-compose stop, pod
deletion) and a crash is SIGKILL; a restart runs the same definition on the
same volume (compose restart: unless-stopped; the StatefulSet recreating
factorps-shard-<i> with claim data-factorps-shard-<i>).

Environment: FACTORPS_SERVER, FACTORPS_CLI (set by ctest).
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "deploy"))
import fpsgrpc as F  # noqa: E402
import layouts  # noqa: E402

SERVER = os.environ.get("FACTORPS_SERVER", "")
CLI = os.environ.get("FACTORPS_CLI", "")
IMAGE_SERVER = "/usr/local/bin/factorps-server"
IMAGE_CLI = "/usr/local/bin/factorps"


def can_namespace():
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs x /mnt && mount -o remount,ro,bind / && ! touch /x-ro-probe"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


NAMESPACE = can_namespace()

# Runs inside the shard's own mount namespace, as root, then drops to the
# image's user: $1.. is the shard's argv.
NS_SCRIPT = r'''
set -e
mount -t tmpfs -o mode=0755 fps-varlib /var/lib
for m in $FPS_MOUNTS; do
  mkdir -p "${m#*=}"
  mount --bind "${m%%=*}" "${m#*=}"
done
mkdir -p /var/lib/fps-ctl && mount --bind "$FPS_CTL" /var/lib/fps-ctl
mount -o remount,ro,bind /var/lib
for t in $FPS_TMPFS; do mount -t tmpfs -o size=64m,mode=1777 fps-tmp "$t"; done
mount -t tmpfs -o mode=0755 fps-bin /usr/local/bin
touch /usr/local/bin/factorps-server && mount --bind "$FPS_BIN" /usr/local/bin/factorps-server
mount -o remount,ro,bind /usr/local/bin
if [ "$FPS_RO" = 1 ]; then mount -o remount,ro,bind /; fi
cd "$FPS_WORKDIR"
exec setpriv --reuid="$FPS_UID" --regid="$FPS_GID" --clear-groups --inh-caps=-all \
  env -i $FPS_ENV "$@"
'''


class Volume:
    """A persistent volume: a directory outliving every container run on it.
    Initialised as the orchestrator does: compose copies the image's
    /var/lib/factorps (owned 10001:10001, 0755); a Kubernetes claim is a
    root-owned directory that fsGroup makes group 10001, g+rws."""

    def __init__(self, root, name, layout, uid, gid, fs_group):
        self.path = os.path.join(root, name)
        os.makedirs(self.path)
        if os.geteuid() == 0:
            if layout == "compose":
                os.chown(self.path, uid, gid)
                os.chmod(self.path, 0o755)
            else:
                os.chown(self.path, 0, fs_group)
                os.chmod(self.path, 0o2775)


class Container:
    """One run of a layouts.Shard on its volume(s)."""

    def __init__(self, shard, volumes, root):
        self.shard = shard
        self.ctl = tempfile.mkdtemp(prefix="ctl-", dir=root)
        os.chmod(self.ctl, 0o777)
        env = dict(shard.env)
        env["HOSTNAME"] = shard.hostname
        env["FACTORPS_LISTEN"] = "127.0.0.1:0"
        env["FACTORPS_METRICS_LISTEN"] = "127.0.0.1:0"
        for k, v in F.server_env().items():  # sanitizer options of the build under test
            if k.startswith(("ASAN_", "UBSAN_", "LSAN_", "TSAN_")):
                env[k] = v
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        argv = list(shard.argv)
        if NAMESPACE:
            env["FACTORPS_PORT_FILE"] = "/var/lib/fps-ctl/port"
            env["FACTORPS_METRICS_PORT_FILE"] = "/var/lib/fps-ctl/metrics-port"
            mounts = " ".join("%s=%s" % (volumes[vol].path, mp)
                              for mp, (vol, persistent) in shard.mounts.items() if persistent)
            penv = {"FPS_MOUNTS": mounts, "FPS_CTL": self.ctl, "FPS_TMPFS": " ".join(shard.tmpfs),
                    "FPS_BIN": SERVER, "FPS_RO": "1" if shard.read_only else "0",
                    "FPS_WORKDIR": shard.workdir, "FPS_UID": str(shard.user[0]),
                    "FPS_GID": str(shard.user[1]),
                    "FPS_ENV": " ".join("%s=%s" % kv for kv in sorted(env.items())),
                    "PATH": env["PATH"]}
            assert not any(re.search(r"\s", v) for v in env.values()), "env values with spaces"
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", NS_SCRIPT, "ns"] + argv
            popen_env, cwd = penv, "/"
        else:
            # Container paths mapped under the run's root directory.
            def host(p):
                for mp, (vol, persistent) in shard.mounts.items():
                    if persistent and (p == mp or p.startswith(mp + "/")):
                        return volumes[vol].path + p[len(mp):]
                return p
            for k in list(env):
                if k in ("FACTORPS_CHECKPOINT_DIR",):
                    env[k] = host(env[k])
            argv = [a.replace(IMAGE_SERVER, SERVER) for a in argv]
            env["FACTORPS_PORT_FILE"] = os.path.join(self.ctl, "port")
            env["FACTORPS_METRICS_PORT_FILE"] = os.path.join(self.ctl, "metrics-port")
            cmd, popen_env, cwd = argv, env, host(shard.workdir)
        self.log_path = os.path.join(self.ctl, "log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen(cmd, env=popen_env, cwd=cwd, stdout=self.log,
                                  stderr=subprocess.STDOUT, preexec_fn=F.die_with_parent)
        pf, mpf = os.path.join(self.ctl, "port"), os.path.join(self.ctl, "metrics-port")
        deadline = time.time() + 60
        while True:
            if self.p.poll() is not None:
                raise RuntimeError("%s exited %d:\n%s" % (shard.name, self.p.returncode, self.read_log()))
            try:
                self.port = int(F.read_text(pf))
                self.metrics_port = int(F.read_text(mpf))
                break
            except (OSError, ValueError):
                pass
            if time.time() > deadline:
                self.p.kill()
                raise RuntimeError("%s did not start:\n%s" % (shard.name, self.read_log()))
            time.sleep(0.02)
        self.addr = "127.0.0.1:%d" % self.port

    def read_log(self):
        try:
            return F.read_text(self.log_path)[-4000:]
        except OSError:
            return ""

    def metrics(self):
        st, _, body = F.http_get("127.0.0.1", self.metrics_port, "/metrics")
        assert st == 200
        return body.decode()

    def ready(self):
        return F.http_get("127.0.0.1", self.metrics_port, "/readyz")[0] == 200

    def end(self, sig, timeout=60):
        """The orchestrator stops (SIGTERM) or kills (SIGKILL) the container."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.log.close()
        return rc


def pull_values(addr, names):
    pb, _, _ = F.stubs()
    ch, stub = F.channel(addr)
    out, versions = {}, {}
    try:
        for resp in stub.Pull(pb.PullRequest(names=names), timeout=30):
            for p in resp.params:
                out.setdefault(p.name, {})[p.offset] = p.data
            versions.update({v.name: v.version for v in resp.versions})
    finally:
        ch.close()
    return {n: b"".join(d[k] for k in sorted(d)) for n, d in out.items()}, versions


def wait_ready(c, timeout=60):
    deadline = time.time() + timeout
    while not c.ready():
        if c.p.poll() is not None or time.time() > deadline:
            raise AssertionError("%s never became ready:\n%s" % (c.shard.name, c.read_log()))
        time.sleep(0.05)


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class RestartRestores(unittest.TestCase):
    """Train both shards, stop shard 1 (SIGTERM) and restart it, train it
    more, kill it (SIGKILL) and restart it: each time it comes back ready
    with the state of its last checkpoint, read from its own volume."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-layout-")
        os.chmod(self.root, 0o755)
        self.running = []

    def tearDown(self):
        for c in self.running:
            if c.p.poll() is None:
                c.end(signal.SIGKILL)
        shutil.rmtree(self.root, True)

    def start(self, shard, volumes):
        c = Container(shard, volumes, self.root)
        self.running.append(c)
        return c

    def run_layout(self, shards):
        self.assertEqual(len(shards), 2)
        volumes = {}
        for s in shards:
            for mp, (vol, persistent) in s.mounts.items():
                if persistent:
                    volumes[vol] = Volume(self.root, vol, s.layout, s.user[0], s.user[1],
                                          s.fs_group if s.fs_group is not None else s.user[1])
        ckdir = shards[1].option("checkpoint-dir")
        mp, vol, _ = shards[1].volume_of(ckdir)
        host_ckdir = volumes[vol].path + ckdir[len(mp):]
        count = int(shards[0].option("shard-count"))
        ids = []
        cs = [self.start(s, volumes) for s in shards]
        for c in cs:
            wait_ready(c)
            t = c.metrics()
            ids.append(int(re.search(r'^factorps_shards\{shard="(\d+)"', t, re.M).group(1)))
            self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="empty"), 1)
            self.assertEqual(F.metric(t, "factorps_checkpoint_interval_seconds"),
                             float(c.shard.option("checkpoint-interval")))
        self.assertEqual(ids, [0, 1], "shard ids from the definitions")
        tensors = {i: F.shard_tensors(i) for i in ids}
        for i, c in zip(ids, cs):
            ch, stub = F.channel(c.addr)
            F.create(stub, i, count, tensors[i])
            for step in range(3):
                F.push(stub, 0, step, tensors[i])
            ch.close()
        names = {i: [n for n, _, _ in tensors[i]] for i in ids}
        peer_before = pull_values(cs[0].addr, names[0])
        before, vers = pull_values(cs[1].addr, names[1])
        self.assertEqual(set(vers.values()), {3})

        # Orchestrator stop: SIGTERM writes the final checkpoint onto the volume.
        self.assertEqual(cs[1].end(signal.SIGTERM), 0, cs[1].read_log())
        files = sorted(glob.glob(os.path.join(host_ckdir, "ckpt-*.safetensors")))
        self.assertEqual(len(files), 1, os.listdir(volumes[vol].path))
        if NAMESPACE:
            # Written by the image's user, nothing else on the volume; the
            # read-only root and /tmp took nothing.
            self.assertEqual(os.stat(files[0]).st_uid, shards[1].user[0])
            self.assertEqual(sorted(os.listdir(volumes[vol].path)), [os.path.basename(ckdir)])
        seq = int(os.path.basename(files[0])[5:-12])

        c = self.start(shards[1], volumes)
        wait_ready(c)
        t = c.metrics()
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="restored"), 1)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restored_sequence"), seq)
        after, vers = pull_values(c.addr, names[1])
        self.assertEqual(after, before, "state after a stop and restart")
        self.assertEqual(set(vers.values()), {3})

        # More training, then a crash before the next periodic checkpoint
        # (the interval is a minute or more): the restart loses exactly the
        # updates since the last checkpoint, no more.
        ch, stub = F.channel(c.addr)
        for step in range(3, 5):
            F.push(stub, 0, step, tensors[1])
        ch.close()
        t = c.metrics()
        self.assertEqual(F.metric(t, "factorps_checkpoint_unsaved_updates"), 2 * len(tensors[1]))
        self.assertEqual(c.end(signal.SIGKILL), -signal.SIGKILL)
        c = self.start(shards[1], volumes)
        wait_ready(c)
        t = c.metrics()
        self.assertEqual(F.metric(t, "factorps_checkpoint_restore_outcome", outcome="restored"), 1)
        self.assertEqual(F.metric(t, "factorps_checkpoint_restored_sequence"), seq)
        after, vers = pull_values(c.addr, names[1])
        self.assertEqual(after, before, "state after a crash and restart")
        self.assertEqual(set(vers.values()), {3})
        # The peer kept its state throughout.
        self.assertEqual(pull_values(cs[0].addr, names[0]), peer_before)
        # A clean stop of both: each writes its final checkpoint.
        self.assertEqual(c.end(signal.SIGTERM), 0, c.read_log())
        self.assertEqual(cs[0].end(signal.SIGTERM), 0, cs[0].read_log())
        for s in shards:
            d = s.option("checkpoint-dir")
            mp, v, _ = s.volume_of(d)
            self.assertTrue(glob.glob(os.path.join(volumes[v].path + d[len(mp):], "ckpt-*")), s)

    def test_compose_layout(self):
        self.run_layout(layouts.compose_shards())

    def test_statefulset_layout(self):
        self.run_layout(layouts.k8s_shards(layouts.kustomize("kubernetes")))


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK) and CLI and os.access(CLI, os.X_OK),
                     "FACTORPS_SERVER or FACTORPS_CLI not set")
class SyncOverlay(unittest.TestCase):
    """deploy/kubernetes-sync: the shards as its StatefulSet says (sync, W
    workers) and W worker pods as its Indexed Job says (pod i: worker i,
    --workers from the same setting) train together; only --shards (the
    cluster DNS names) and --steps (a test's length) are replaced."""

    def test_sync_shards_and_indexed_workers_agree(self):
        root = tempfile.mkdtemp(prefix="fps-sync-")
        os.chmod(root, 0o755)
        running = []
        try:
            docs = layouts.kustomize("kubernetes-sync")
            shards = layouts.k8s_shards(docs)
            job, wc = layouts.worker_job(docs)
            W = job["spec"]["parallelism"]
            self.assertEqual(job["spec"]["completions"], W)
            volumes = {}
            for s in shards:
                self.assertEqual(s.option("mode"), "sync")
                self.assertEqual(int(s.option("workers")), W)
                for mp, (vol, persistent) in s.mounts.items():
                    if persistent:
                        volumes[vol] = Volume(root, vol, s.layout, s.user[0], s.user[1], s.fs_group)
            cs = []
            for s in shards:
                c = Container(s, volumes, root)
                running.append(c)
                cs.append(c)
            for c in cs:
                wait_ready(c)
            procs = []
            for index in range(W):
                env = {e["name"]: e["value"] for e in wc["env"] if "value" in e}
                env["WORKER_ID"] = str(index)  # the Job controller's completion index
                argv = [layouts._k8s_expand(a, env) for a in wc["command"]]
                argv[0] = CLI if argv[0] == IMAGE_CLI else argv[0]
                argv[argv.index("--shards") + 1] = ",".join(c.addr for c in cs)
                argv[argv.index("--steps") + 1] = "3"
                self.assertEqual(argv[argv.index("--worker-id") + 1], str(index))
                self.assertEqual(argv[argv.index("--workers") + 1], str(W))
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True, preexec_fn=F.die_with_parent))
            outs = [p.communicate(timeout=240)[0] for p in procs]
            for p, out in zip(procs, outs):
                self.assertEqual(p.returncode, 0, out)
                self.assertIn("RESULT", out)
            for c in cs:
                t = c.metrics()
                # Every round waited for all W workers.
                rounds = F.metric(t, "factorps_sync_steps_completed_total")
                self.assertGreater(rounds, 0)
                self.assertEqual(F.metric(t, "factorps_sync_workers_waited_total"), W * rounds)
                self.assertEqual(c.end(signal.SIGTERM), 0, c.read_log())
        finally:
            for c in running:
                if c.p.poll() is None:
                    c.end(signal.SIGKILL)
            shutil.rmtree(root, True)


class LayoutsCheckCatches(unittest.TestCase):
    """deploy/check.sh's assertions (layouts.check) fail on the mistakes that
    lose a shard's state (no volume, a checkpoint directory off the volume,
    ...), in a copy of deploy/ with one thing broken."""

    def broken(self, path, old, new, renderer="mini"):
        tmp = tempfile.mkdtemp(prefix="fps-deploy-copy-")
        try:
            d = os.path.join(tmp, "deploy")
            shutil.copytree(os.path.join(REPO, "deploy"), d)
            f = os.path.join(d, path)
            text = F.read_text(f)
            self.assertIn(old, text)
            F.write_text(f, text.replace(old, new))
            saved = layouts.HERE
            layouts.HERE = d
            try:
                return layouts.check(renderer)
            finally:
                layouts.HERE = saved
        finally:
            shutil.rmtree(tmp, True)

    def assertCaught(self, problems, *words):
        self.assertTrue(any(all(w in p for w in words) for p in problems), problems)

    def test_shipped_files_pass(self):
        self.assertEqual(layouts.check("mini"), [])

    def test_no_claim_template(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", "  volumeClaimTemplates:",
                        "  unusedClaimTemplates:")
        self.assertCaught(p, "kubernetes factorps-shard-0", "not on a persistent volume")

    def test_checkpoints_on_tmpfs(self):
        p = self.broken("docker-compose.yml", "FACTORPS_CHECKPOINT_DIR: /var/lib/factorps/checkpoints",
                        "FACTORPS_CHECKPOINT_DIR: /tmp/checkpoints")
        self.assertCaught(p, "compose shard-0", "not on a persistent volume")

    def test_no_interval(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", 'value: "300"', 'value: "0"')
        self.assertCaught(p, "kubernetes factorps-shard-1", "no periodic checkpoints")

    def test_grace_too_short(self):
        p = self.broken("docker-compose.yml", "stop_grace_period: 60s", "stop_grace_period: 10s")
        self.assertCaught(p, "compose shard-1", "too short")

    def test_sync_counts_disagree(self):
        p = self.broken("kubernetes-sync/kustomization.yaml", "          - spec.parallelism\n", "")
        self.assertCaught(p, "kubernetes-sync", "parallelism")

    def test_no_budget(self):
        p = self.broken("kubernetes/kustomization.yaml", "  - pod-disruption-budget.yaml\n", "")
        self.assertCaught(p, "kubernetes: no PodDisruptionBudget")


if __name__ == "__main__":
    unittest.main(verbosity=2)

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
a control directory), and the replica addresses: the other replica
(FACTORPS_REPLICA_PEER, a loopback port), the advertised address (dropped:
the listen address), and an etcd lease's endpoint (a real etcd the test
starts on loopback; the key is kept). Not run: the front proxies, so the
shards dial each other (and the workers the shards) directly, without the
TLS the proxies terminate (FACTORPS_PEER_TLS_* and the workers' --tls-*
are dropped); tests/security/test_deploy_tls.py runs a replica pair with
its proxies and the material deploy/make-tls.sh issues. Without root or unshare the same
argv and env run with the container paths mapped under a temporary
directory (a file lease's path too).

Each layout defines two replicas per shard (a primary and a standby, which
the lease picks). RestartRestores runs one replica of each shard, which
takes its lease and serves alone; Failover runs both replicas of one shard
and kills the primary.

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
mount -t tmpfs -o mode=0755 fps-bin /usr/local/bin
touch /usr/local/bin/factorps-server && mount --bind "$FPS_BIN" /usr/local/bin/factorps-server
mount -o remount,ro,bind /usr/local/bin
# Last of the host's paths: a tmpfs /tmp hides a tree checked out under it.
for t in $FPS_TMPFS; do mount -t tmpfs -o size=64m,mode=1777 fps-tmp "$t"; done
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


class Tokens:
    """The per-role token files the shipped files make the shards require,
    written where the orchestrator would put them: into compose's named
    volume (as its one-shot tokens service does: owned by the image's
    user, 0600) or into a directory bind-mounted where Kubernetes mounts
    the Secret (root-owned, group fsGroup, 0440). .worker: the worker
    token; .host(path): the host file of a token path in the containers."""

    FLAGS = ("auth-token-file", "admin-token-file", "exchange-token-file", "peer-token-file")

    def __init__(self, root, shards, volumes):
        count = int(shards[0].option("shard-count"))
        peer = [os.urandom(16).hex() for _ in range(count)]
        self.worker = os.urandom(16).hex()
        self.text = {"workers": self.worker + "\n", "admins": os.urandom(16).hex() + "\n",
                     "peers": "".join("%d:%s\n" % (i, t) for i, t in enumerate(peer))}
        self.text.update({"peer-%d" % i: t + "\n" for i, t in enumerate(peer)})
        self.dirs = {}  # container directory -> host directory
        for s in shards:
            for flag in self.FLAGS:
                path = s.option(flag)
                if not path:
                    continue
                mp, vol, persistent = s.volume_of(path)
                if persistent:
                    host, owner, mode = volumes[vol].path, s.user, 0o600
                else:  # a Kubernetes Secret
                    key = "secret:" + s.secrets[mp]
                    if key not in volumes:
                        volumes[key] = Volume(root, key.replace(":", "-"), "secret", 0, 0, 0)
                        os.chmod(volumes[key].path, 0o755)
                    host, owner, mode = volumes[key].path, (0, s.fs_group), 0o440
                self.dirs[mp] = host
                f = os.path.join(host, os.path.basename(path))
                F.write_text(f, self.text[os.path.basename(path)])
                if os.geteuid() == 0:
                    os.chown(f, *owner)
                os.chmod(f, mode)

    def host(self, path):
        for mp, host in self.dirs.items():
            if path.startswith(mp + "/"):
                return host + path[len(mp):]
        return path


class Authed:
    """A stub whose every call carries the worker token."""

    def __init__(self, stub, token):
        self._stub, self._md = stub, [("authorization", "Bearer " + token)]

    def __getattr__(self, name):
        fn = getattr(self._stub, name)
        return lambda *a, **kw: fn(*a, metadata=self._md, **kw)


def channel(addr, token):
    ch, stub = F.channel(addr)
    return ch, Authed(stub, token)


class Container:
    """One run of a layouts.Shard on its volume(s)."""

    def __init__(self, shard, volumes, root, replace=None):
        """replace: environment entries put in place of the shipped ones
        (the replica addresses, see the top); None values are dropped."""
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
        # No proxy runs here (see the top): the other replica is dialled as
        # it listens, in plaintext.
        for k in ("FACTORPS_PEER_TLS_CA", "FACTORPS_PEER_TLS_CERT", "FACTORPS_PEER_TLS_KEY"):
            env.pop(k, None)
        for k, v in (replace or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        argv = list(shard.argv)
        if NAMESPACE:
            env["FACTORPS_PORT_FILE"] = "/var/lib/fps-ctl/port"
            env["FACTORPS_METRICS_PORT_FILE"] = "/var/lib/fps-ctl/metrics-port"
            mounts = " ".join(["%s=%s" % (volumes[vol].path, mp)
                               for mp, (vol, persistent) in shard.mounts.items() if persistent] +
                              ["%s=%s" % (volumes["secret:" + name].path, mp)
                               for mp, name in shard.secrets.items() if "secret:" + name in volumes])
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
                for mp, name in shard.secrets.items():
                    if p.startswith(mp + "/") and "secret:" + name in volumes:
                        return volumes["secret:" + name].path + p[len(mp):]
                return p
            for k in list(env):
                if k in ("FACTORPS_CHECKPOINT_DIR", "FACTORPS_AUTH_TOKEN_FILE", "FACTORPS_ADMIN_TOKEN_FILE",
                         "FACTORPS_EXCHANGE_TOKEN_FILE", "FACTORPS_PEER_TOKEN_FILE"):
                    env[k] = host(env[k])
                elif k == "FACTORPS_LEASE" and env[k].startswith("file:"):
                    env[k] = "file:" + host(env[k][5:])
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


def pull_values(addr, names, token):
    pb, _, _ = F.stubs()
    ch, stub = channel(addr, token)
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


class Etcd:
    """A one-member etcd on loopback ports with its data in `root` (Debian's
    etcd-server, scripts/deps.sh), for the layouts whose lease is etcd's."""

    def __init__(self, root):
        self.port, peer = F.free_port(), F.free_port()
        client, peer = "http://127.0.0.1:%d" % self.port, "http://127.0.0.1:%d" % peer
        self.log = open(os.path.join(root, "etcd.log"), "w")
        self.p = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", os.path.join(root, "etcd"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
             peer, "--initial-cluster", "t=" + peer], stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=F.die_with_parent)
        deadline = time.time() + 30
        while True:
            try:
                if b'"health":"true"' in F.http_get("127.0.0.1", self.port, "/health", timeout=2)[2]:
                    break
            except OSError:
                pass
            if self.p.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("etcd did not start: " + F.read_text(self.log.name)[-2000:])
            time.sleep(0.05)

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.log.close()


ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def replica_env(shard, peer_addr, etcd):
    """The replica addresses of a definition, replaced for loopback (see the
    top): its other replica at peer_addr, an etcd lease at `etcd`."""
    out = {"FACTORPS_REPLICA_PEER": peer_addr, "FACTORPS_REPLICA_ADVERTISE": None}
    lease = shard.option("lease") or ""
    if lease.startswith("etcd:"):
        if etcd is None:
            raise unittest.SkipTest("no etcd binary (scripts/deps.sh installs etcd-server)")
        out["FACTORPS_LEASE"] = "etcd:127.0.0.1:%d/%s" % (etcd.port, lease.split("/", 1)[1])
    return out


def uses_etcd(shards):
    return any((s.option("lease") or "").startswith("etcd:") for s in shards)


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class RestartRestores(unittest.TestCase):
    """Train both shards (one replica of each: its standby is never
    started, so it takes the lease and serves alone), stop shard 1 (SIGTERM)
    and restart it, train it more, kill it (SIGKILL) and restart it: each
    time it comes back ready with the state of its last checkpoint, read
    from its own volume."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-layout-")
        os.chmod(self.root, 0o755)
        self.running = []
        self.etcd = None

    def tearDown(self):
        for c in self.running:
            if c.p.poll() is None:
                c.end(signal.SIGKILL)
        if self.etcd:
            self.etcd.stop()
        shutil.rmtree(self.root, True)

    def start(self, shard, volumes):
        c = Container(shard, volumes, self.root, self.replace[shard.name])
        self.running.append(c)
        return c

    def run_layout(self, all_shards):
        self.assertEqual(len(all_shards), 4, "2 shards x (primary + standby)")
        # One replica per shard: the first definition of each shard id.
        shards = [sorted((s for s in all_shards if s.shard_id == i), key=lambda s: s.name)[0]
                  for i in (0, 1)]
        if uses_etcd(shards) and os.access(ETCD, os.X_OK):
            self.etcd = Etcd(self.root)
        self.replace = {s.name: replica_env(s, "127.0.0.1:%d" % F.free_port(), self.etcd) for s in shards}
        volumes = {}
        for s in shards:
            for mp, (vol, persistent) in s.mounts.items():
                if persistent and vol not in volumes:  # the lease and token volumes are shared
                    volumes[vol] = Volume(self.root, vol, s.layout, s.user[0], s.user[1],
                                          s.fs_group if s.fs_group is not None else s.user[1])
        tok = Tokens(self.root, shards, volumes).worker
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
            ch, stub = channel(c.addr, tok)
            F.create(stub, i, count, tensors[i])
            for step in range(3):
                F.push(stub, 0, step, tensors[i])
            ch.close()
        names = {i: [n for n, _, _ in tensors[i]] for i in ids}
        peer_before = pull_values(cs[0].addr, names[0], tok)
        before, vers = pull_values(cs[1].addr, names[1], tok)
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
        after, vers = pull_values(c.addr, names[1], tok)
        self.assertEqual(after, before, "state after a stop and restart")
        self.assertEqual(set(vers.values()), {3})

        # More training, then a crash before the next periodic checkpoint
        # (the interval is a minute or more): the restart loses exactly the
        # updates since the last checkpoint, no more.
        ch, stub = channel(c.addr, tok)
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
        after, vers = pull_values(c.addr, names[1], tok)
        self.assertEqual(after, before, "state after a crash and restart")
        self.assertEqual(set(vers.values()), {3})
        # The peer kept its state throughout.
        self.assertEqual(pull_values(cs[0].addr, names[0], tok), peer_before)
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
    """deploy/kubernetes-sync: the shard replicas as its StatefulSets say
    (sync, W workers, a primary and a standby per shard, an etcd lease) and
    W worker pods as its Indexed Job says (pod i: worker i, --workers from
    the same setting) train together; only --shards (the cluster DNS names,
    each shard's replicas joined by '|' as shipped), --steps (a test's
    length) and the replica addresses (see the top) are replaced."""

    def test_sync_shards_and_indexed_workers_agree(self):
        root = tempfile.mkdtemp(prefix="fps-sync-")
        os.chmod(root, 0o755)
        running = []
        etcd = None
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
                    if persistent and vol not in volumes:
                        volumes[vol] = Volume(root, vol, s.layout, s.user[0], s.user[1], s.fs_group)
            tokens = Tokens(root, shards, volumes)
            if uses_etcd(shards):
                if not os.access(ETCD, os.X_OK):
                    self.skipTest("no etcd binary (scripts/deps.sh installs etcd-server)")
                etcd = Etcd(root)
            # Fixed loopback ports, so that the replicas of a shard can name
            # each other.
            ports = {s.name: F.free_port() for s in shards}
            cs = []
            for s in shards:
                peer = next(x for x in shards if x.shard_id == s.shard_id and x is not s)
                r = replica_env(s, "127.0.0.1:%d" % ports[peer.name], etcd)
                r["FACTORPS_LISTEN"] = "127.0.0.1:%d" % ports[s.name]
                c = Container(s, volumes, root, r)
                running.append(c)
                cs.append(c)
            for c in cs:
                wait_ready(c)  # a standby is ready once it has joined its primary
            procs = []
            for index in range(W):
                env = {e["name"]: e["value"] for e in wc["env"] if "value" in e}
                env["WORKER_ID"] = str(index)  # the Job controller's completion index
                argv = [layouts._k8s_expand(a, env) for a in wc["command"]]
                argv[0] = CLI if argv[0] == IMAGE_CLI else argv[0]
                argv[argv.index("--shards") + 1] = ",".join(
                    "|".join(c.addr for c in cs if c.shard.shard_id == i)
                    for i in sorted({c.shard.shard_id for c in cs}))
                argv[argv.index("--steps") + 1] = "3"
                # The Secret's workers key, where the Job mounts it.
                i = argv.index("--token-file") + 1
                argv[i] = tokens.host(argv[i])
                # The shards themselves, not their TLS proxies (see the top).
                for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
                    i = argv.index(flag)
                    del argv[i:i + 2]
                self.assertEqual(argv[argv.index("--worker-id") + 1], str(index))
                self.assertEqual(argv[argv.index("--workers") + 1], str(W))
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True, preexec_fn=F.die_with_parent))
            outs = [p.communicate(timeout=240)[0] for p in procs]
            for p, out in zip(procs, outs):
                self.assertEqual(p.returncode, 0, out)
                self.assertIn("RESULT", out)
            primaries = 0
            for c in cs:
                t = c.metrics()
                if F.metric(t, "factorps_replica_role", role="primary") != 1:
                    continue
                primaries += 1
                # Every round waited for all W workers.
                rounds = F.metric(t, "factorps_sync_steps_completed_total")
                self.assertGreater(rounds, 0)
                self.assertEqual(F.metric(t, "factorps_sync_workers_waited_total"), W * rounds)
            self.assertEqual(primaries, len(cs) // 2, "one primary per shard")
            for c in cs:
                self.assertEqual(c.end(signal.SIGTERM), 0, c.read_log())
        finally:
            for c in running:
                if c.p.poll() is None:
                    c.end(signal.SIGKILL)
            if etcd:
                etcd.stop()
            shutil.rmtree(root, True)


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class Failover(unittest.TestCase):
    """Both replicas of shard 0, as each layout defines them (compose: a
    file lease on the shared volume; StatefulSets: an etcd lease): exactly
    one becomes primary, the other a standby; SIGKILL of the primary, and
    the standby is primary within the lease's failover time (file: at
    once; etcd: the TTL) plus start-up slack; the killed one, restarted,
    comes back as the standby; and with etcd paused past the TTL. Roles
    are read from /metrics."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="fps-failover-")
        os.chmod(self.root, 0o755)
        self.running = []
        self.etcd = None

    def tearDown(self):
        for c in self.running:
            if c.p.poll() is None:
                c.end(signal.SIGKILL)
        if self.etcd:
            self.etcd.stop()
        shutil.rmtree(self.root, True)

    def role(self, c):
        t = c.metrics()
        for r in ("primary", "standby", "solo"):
            if F.metric(t, "factorps_replica_role", role=r) == 1:
                return r
        return None

    def wait_roles(self, cs, want, timeout):
        deadline = time.time() + timeout
        while True:
            got = sorted(self.role(c) for c in cs)
            if got == sorted(want):
                return
            if time.time() > deadline:
                raise AssertionError("roles %s, not %s:\n%s" % (got, want, "\n".join(c.read_log() for c in cs)))
            time.sleep(0.05)

    def start_pair(self, all_shards):
        """Starts both replicas of shard 0; returns them, a function that
        starts replica i again, and the lease's TTL (0: a file lease)."""
        pair = sorted((s for s in all_shards if s.shard_id == 0), key=lambda s: s.name)
        self.assertEqual(len(pair), 2)
        if uses_etcd(pair) and os.access(ETCD, os.X_OK):
            self.etcd = Etcd(self.root)
        volumes = {}
        for s in pair:
            for mp, (vol, persistent) in s.mounts.items():
                if persistent and vol not in volumes:
                    volumes[vol] = Volume(self.root, vol, s.layout, s.user[0], s.user[1],
                                          s.fs_group if s.fs_group is not None else s.user[1])
        Tokens(self.root, pair, volumes)
        # Fixed loopback ports, so that each can name the other.
        ports = [F.free_port() for _ in pair]
        replace = []
        for i, s in enumerate(pair):
            r = replica_env(s, "127.0.0.1:%d" % ports[1 - i], self.etcd)
            r["FACTORPS_LISTEN"] = "127.0.0.1:%d" % ports[i]
            replace.append(r)

        def start(i):
            c = Container(pair[i], volumes, self.root, replace[i])
            self.running.append(c)
            return c
        ttl = float(pair[0].option("lease-ttl") or 2) if uses_etcd(pair) else 0.0
        return pair, [start(0), start(1)], start, ttl

    def run_pair(self, all_shards):
        pair, cs, start, ttl = self.start_pair(all_shards)
        self.wait_roles(cs, ["primary", "standby"], 30)
        p = 0 if self.role(cs[0]) == "primary" else 1
        killed = time.time()
        self.assertEqual(cs[p].end(signal.SIGKILL), -signal.SIGKILL)
        self.wait_roles([cs[1 - p]], ["primary"], ttl + 10)
        print("%s: SIGKILL of the primary to the standby's promotion: %.2f s (lease TTL %s)"
              % (pair[0].layout, time.time() - killed, ttl or "file"), file=sys.stderr)
        cs[p] = start(p)
        self.wait_roles(cs, ["primary", "standby"], 30)
        self.assertEqual(self.role(cs[1 - p]), "primary")

    def test_statefulset_etcd_paused(self):
        """etcd stops answering (SIGSTOP) for longer than the TTL: the primary
        stops being primary before the TTL has passed, no moment shows two
        primaries, and once etcd answers again one replica is primary and
        the other its standby."""
        pair, cs, start, ttl = self.start_pair(layouts.k8s_shards(layouts.kustomize("kubernetes")))
        self.assertGreater(ttl, 0)
        self.wait_roles(cs, ["primary", "standby"], 30)
        self.etcd.p.send_signal(signal.SIGSTOP)
        paused = time.time()
        none_since = None
        try:
            while time.time() < paused + ttl + 2:
                n = sorted(self.role(c) for c in cs).count("primary")
                self.assertLessEqual(n, 1, "two primaries")
                if n == 0 and none_since is None:
                    none_since = time.time()
                time.sleep(0.02)
        finally:
            self.etcd.p.send_signal(signal.SIGCONT)
        self.assertIsNotNone(none_since, "still primary with etcd stopped past the TTL")
        print("statefulset: etcd stopped to no primary: %.2f s (lease TTL %s)" % (none_since - paused, ttl),
              file=sys.stderr)
        self.assertLess(none_since - paused, ttl)
        resumed = time.time()
        deadline = resumed + ttl + 15
        while True:
            roles = sorted(self.role(c) for c in cs)
            self.assertLessEqual(roles.count("primary"), 1, "two primaries")
            if roles == ["primary", "standby"]:
                break
            if time.time() > deadline:
                raise AssertionError("roles %s after etcd resumed:\n%s" % (roles, "\n".join(c.read_log() for c in cs)))
            time.sleep(0.02)
        print("statefulset: etcd resumed to primary + standby again: %.2f s" % (time.time() - resumed), file=sys.stderr)

    def test_compose_pair(self):
        self.run_pair(layouts.compose_shards())

    def test_statefulset_pair(self):
        self.run_pair(layouts.k8s_shards(layouts.kustomize("kubernetes")))


class LayoutsCheckCatches(unittest.TestCase):
    """deploy/check.sh's assertions (layouts.check) fail on the mistakes that
    lose a shard's state (no volume, a checkpoint directory off the volume,
    ...), in a copy of deploy/ with one thing broken."""

    def broken(self, path, old, new, renderer="mini", count=-1, more=()):
        """layouts.check on a copy of deploy/ with `old` replaced by `new`
        in `path` (and each (path, old, new) of `more`)."""
        tmp = tempfile.mkdtemp(prefix="fps-deploy-copy-")
        try:
            d = os.path.join(tmp, "deploy")
            shutil.copytree(os.path.join(REPO, "deploy"), d)
            for path, old, new in [(path, old, new)] + list(more):
                f = os.path.join(d, path)
                text = F.read_text(f)
                self.assertIn(old, text)
                F.write_text(f, text.replace(old, new, count))
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
        self.assertCaught(p, "kubernetes factorps-shard-a-0", "not on a persistent volume")

    def test_checkpoints_on_tmpfs(self):
        p = self.broken("docker-compose.yml", "FACTORPS_CHECKPOINT_DIR: /var/lib/factorps/checkpoints",
                        "FACTORPS_CHECKPOINT_DIR: /tmp/checkpoints")
        self.assertCaught(p, "compose shard-0", "not on a persistent volume")

    def test_no_interval(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", 'value: "300"', 'value: "0"')
        self.assertCaught(p, "kubernetes factorps-shard-a-1", "no periodic checkpoints")

    def test_grace_too_short(self):
        p = self.broken("docker-compose.yml", "stop_grace_period: 60s", "stop_grace_period: 10s")
        self.assertCaught(p, "compose shard-1", "too short")

    def test_sync_counts_disagree(self):
        p = self.broken("kubernetes-sync/kustomization.yaml", "          - spec.parallelism\n", "")
        self.assertCaught(p, "kubernetes-sync", "parallelism")

    def test_no_standby(self):
        p = self.broken("docker-compose.yml", "FACTORPS_REPLICA_PEER: shard-1-a:50051",
                        "FACTORPS_REPLICA_PEER: shard-0-a:50051")
        self.assertCaught(p, "compose shard-1-b", "is not its other replica")

    def test_shared_lease(self):
        p = self.broken("docker-compose.yml", "FACTORPS_LEASE: file:/var/lib/factorps-lease/shard-1.lease",
                        "FACTORPS_LEASE: file:/var/lib/factorps-lease/shard-0.lease")
        self.assertCaught(p, "compose: shards [0, 1] share the lease")

    def test_no_anti_affinity(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", "requiredDuringSchedulingIgnoredDuringExecution",
                        "preferredDuringSchedulingIgnoredDuringExecution")
        self.assertCaught(p, "kubernetes", "no required per-node anti-affinity")

    def test_sets_drift(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", 'value: "300"', 'value: "301"', count=1)
        self.assertCaught(p, "kubernetes", "differ in more than")

    def test_unknown_flag(self):
        help_text = "  --shard-id  the id\n  env FACTORPS_SHARD_ID\n"
        bad = layouts.check("mini", help_text)
        self.assertCaught(bad, "FACTORPS_LEASE is not in factorps-server --help")

    def test_no_worker_tokens(self):
        p = self.broken("docker-compose.yml", "    FACTORPS_AUTH_TOKEN_FILE: /var/lib/factorps-tokens/workers\n", "")
        self.assertCaught(p, "compose shard-0-a", "--auth-token-file")

    def test_shard_port_open_beside_the_proxy(self):
        p = self.broken("kubernetes/shard-statefulset.yaml", "value: 127.0.0.1:50052", "value: 0.0.0.0:50052")
        self.assertCaught(p, "kubernetes factorps-shard-a-0", "not on loopback")

    def test_no_proxy(self):
        p = self.broken("docker-compose.yml", "    network_mode: service:shard-1-b\n", "")
        self.assertCaught(p, "compose shard-1-b", "no nghttpx front proxy")

    def test_tls_taken_out(self):
        # Five breakages in one copy (each check renders every layout).
        p = self.broken("kubernetes/shard-statefulset.yaml", "--frontend=0.0.0.0,50051\n",
                        "--frontend=0.0.0.0,50051;no-tls\n", count=1,
                        more=[("docker-compose.yml", "    - --verify-client\n", ""),
                              ("docker-compose.yml", "server-1-b.crt", "server-1-a.crt"),
                              ("kubernetes/shard-statefulset.yaml",
                               "value: /var/lib/factorps-tls/peer-$(SHARD_INDEX).crt",
                               "value: /var/lib/factorps-tls/peer-0.crt"),
                              ("kubernetes-sync/worker-sync.yaml", "            - --tls-ca\n", "")])
        self.assertCaught(p, "kubernetes factorps-shard-a-1", "frontend is not TLS")
        self.assertCaught(p, "compose shard-0-a", "does not require client certificates")
        self.assertCaught(p, "compose shard-1-b", "server-1-b.key/.crt")
        self.assertCaught(p, "kubernetes factorps-shard-a-1", "peer certificate peer-1")
        self.assertCaught(p, "kubernetes-sync: the worker does not dial with the CA")

    def test_no_budget(self):
        p = self.broken("kubernetes/kustomization.yaml", "  - pod-disruption-budget.yaml\n", "")
        self.assertCaught(p, "kubernetes: no PodDisruptionBudget")


if __name__ == "__main__":
    unittest.main(verbosity=2)

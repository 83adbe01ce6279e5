#!/usr/bin/python3
"""The shard definitions deploy/ ships, read from the files themselves: the
image (Dockerfile: ENTRYPOINT, USER, WORKDIR, ENV), the compose services
(as `docker-compose config` renders them), the StatefulSet of
deploy/kubernetes and of the sync overlay deploy/kubernetes-sync (as
`kubectl kustomize` renders them, or the small renderer below when kubectl
is absent). deploy/check.sh asserts on them; tests/http/test_deploy_layouts.py
starts shards exactly as they say.

Usage: layouts.py check [SERVER]   (exit 0: every assertion holds; 1 otherwise)
SERVER: a factorps-server binary; every flag and FACTORPS_* variable the
definitions use must be in its --help.
"""
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


class Shard:
    """One shard container as the orchestrator would start it.
    argv: the process's argument vector (entrypoint + command, shell forms
    left to /bin/sh as the image would run them); env: the environment on
    top of the image's; mounts: {container path: (volume name, persistent)};
    read_only: read-only root; tmpfs: container paths of tmpfs mounts;
    user: (uid, gid); fs_group: the volume's group (Kubernetes fsGroup);
    workdir; grace: seconds between SIGTERM and SIGKILL; hostname;
    secrets: {container path: secret name} of Kubernetes Secret mounts
    (also in mounts, not persistent); proxy: the argv of the front proxy
    beside it (compose: the service in its network namespace; Kubernetes:
    the pod's container "proxy"), or None; proxy_mounts: {container path:
    volume or Secret name} of the proxy; replica: "a" or "b"."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self):
        return "Shard(%s)" % self.name

    def option(self, flag):
        """The value a flag gets: from argv (--flag V / --flag=V), else from
        the environment (FACTORPS_FLAG), else None."""
        for i, a in enumerate(self.argv):
            if a == "--" + flag and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if a.startswith("--" + flag + "="):
                return a.split("=", 1)[1]
        return self.env.get("FACTORPS_" + flag.upper().replace("-", "_"))

    def volume_of(self, path):
        """(mount point, volume name, persistent) holding `path`, or None."""
        best = None
        for mp, (vol, persistent) in self.mounts.items():
            if path == mp or path.startswith(mp.rstrip("/") + "/"):
                if best is None or len(mp) > len(best[0]):
                    best = (mp, vol, persistent)
        return best


def _load(path, all_docs=False):
    with open(path) as f:
        return list(yaml.safe_load_all(f)) if all_docs else yaml.safe_load(f)


# --------------------------------------------------------------- image

def image():
    """ENTRYPOINT, USER, WORKDIR and ENV of the runtime stage."""
    with open(os.path.join(HERE, "Dockerfile")) as f:
        text = f.read()
    final = text.split("\nFROM ")[-1]
    joined = re.sub(r"\\\n\s*", " ", final)
    env, entry, user, workdir = {}, None, None, "/"
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("ENV "):
            for tok in shlex.split(line[4:]):
                k, v = tok.split("=", 1)
                env[k] = v
        elif line.startswith("ENTRYPOINT "):
            entry = json.loads(line[len("ENTRYPOINT "):])
        elif line.startswith("USER "):
            uid, _, gid = line[5:].strip().partition(":")
            user = (int(uid), int(gid or uid))
        elif line.startswith("WORKDIR "):
            workdir = line[8:].strip()
    return {"env": env, "entrypoint": entry, "user": user, "workdir": workdir}


# ------------------------------------------------------------- compose

def _subst(value, environ):
    """${VAR:-default} and ${VAR} as compose substitutes them."""
    def one(m):
        name, dflt = m.group(1), m.group(3)
        v = environ.get(name)
        return v if v not in (None, "") else (dflt or "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", one, value)


_compose_cache = {}


def compose_config(environ=None):
    """The compose file as docker-compose renders it (variables, anchors,
    merges); without docker-compose, PyYAML plus the ${VAR:-d} rule."""
    environ = dict(os.environ if environ is None else environ)
    path = os.path.join(HERE, "docker-compose.yml")
    if shutil.which("docker-compose"):
        with open(path, "rb") as f:
            key = (path, f.read(), tuple(sorted(environ.items())))
        if key not in _compose_cache:
            out = subprocess.run(["docker-compose", "-f", path, "config"], capture_output=True,
                                 text=True, env=environ, timeout=60, check=True).stdout
            _compose_cache[key] = out
        return yaml.safe_load(_compose_cache[key])

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return _subst(x, environ) if isinstance(x, str) else x
    return walk(_load(path))


def _seconds(s):
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(s))
    if not m or not s:
        raise ValueError("duration %r" % s)
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0)


def _compose_mounts(svc, named):
    """{container path: (volume name, persistent)} of a compose service."""
    mounts = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            src, _, rest = v.partition(":")
            tgt = rest.split(":")[0]
            v = {"type": "volume" if not src.startswith((".", "/")) else "bind",
                 "source": src, "target": tgt}
        # A named volume outlives the container; a bind mount is the
        # host's business; anonymous volumes are not persistent.
        persistent = v.get("type") == "volume" and v.get("source") in named
        mounts[v["target"]] = (v.get("source"), persistent)
    return mounts


def compose_shards(environ=None):
    cfg = compose_config(environ)
    img = image()
    named = set((cfg.get("volumes") or {}).keys())
    shards = []
    for name, svc in sorted(cfg["services"].items()):
        if not str(svc.get("image", "")).split(":")[0].endswith("factorps"):
            continue  # Prometheus, Grafana: other images
        entry = svc.get("entrypoint", img["entrypoint"])
        if isinstance(entry, str):
            entry = shlex.split(entry)
        if not entry or os.path.basename(entry[0]) != "factorps-server":
            continue
        cmd = svc.get("command") or []
        if isinstance(cmd, str):
            cmd = shlex.split(cmd)
        env = dict(img["env"])
        e = svc.get("environment") or {}
        if isinstance(e, list):
            e = dict(x.split("=", 1) for x in e)
        env.update({k: "" if v is None else str(v) for k, v in e.items()})
        mounts = _compose_mounts(svc, named)
        tmpfs = svc.get("tmpfs") or []
        tmpfs = [tmpfs] if isinstance(tmpfs, str) else list(tmpfs)
        user = img["user"]
        if svc.get("user"):
            uid, _, gid = str(svc["user"]).partition(":")
            user = (int(uid), int(gid or uid))
        proxy, proxy_mounts = None, {}
        for other in cfg["services"].values():
            if other.get("network_mode") == "service:" + name:
                pe = other.get("entrypoint") or []
                pe = shlex.split(pe) if isinstance(pe, str) else list(pe)
                pc = other.get("command") or []
                pc = shlex.split(pc) if isinstance(pc, str) else list(pc)
                proxy = pe + pc
                proxy_mounts = {k: v[0] for k, v in _compose_mounts(other, named).items()}
        shards.append(Shard(
            name=name, layout="compose", argv=list(entry) + list(cmd), env=env, mounts=mounts,
            secrets={}, proxy=proxy, proxy_mounts=proxy_mounts, replica=name[-1],
            read_only=bool(svc.get("read_only")), tmpfs=[t.split(":")[0] for t in tmpfs],
            user=user, fs_group=None, workdir=svc.get("working_dir", img["workdir"]),
            grace=_seconds(svc.get("stop_grace_period", "10s")), hostname=svc.get("hostname", name),
            restart=svc.get("restart", "no"), shard_id=int(env.get("FACTORPS_SHARD_ID", "0")),
            replica_set=None))
    return shards


# ---------------------------------------------------------- kubernetes

def _merge(base, patch):
    """Strategic merge as kustomize applies it to the fields used here:
    maps merge, lists of maps with `name` merge by name, other lists and
    scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        names = [x["name"] for x in out]
        for p in patch:
            if p["name"] in names:
                i = names.index(p["name"])
                out[i] = _merge(out[i], p)
            else:
                out.insert(0, copy.deepcopy(p))  # kustomize puts new entries first
                names.insert(0, p["name"])
        return out
    return copy.deepcopy(patch)


def _path(doc, field):
    """Splits kustomize's fieldPath (a.b.[name=x].c) and walks to the parent."""
    parts = re.findall(r"\[[^\]]*\]|[^.\[\]]+", field)
    cur = doc
    for p in parts[:-1]:
        cur = _step(cur, p)
    return cur, parts[-1]


def _step(cur, p):
    if p.startswith("["):
        k, v = p[1:-1].split("=", 1)
        return next(x for x in cur if x.get(k) == v)
    return cur[int(p)] if isinstance(cur, list) else cur[p]


def _patch_applies(target, patch, doc):
    """A patch applies to the document it names, or, with a target, to
    every document of the target's kind whose labels match its
    labelSelector (k=v,...; the only selector form deploy/ uses)."""
    if not target:
        return doc["kind"] == patch["kind"] and doc["metadata"]["name"] == patch["metadata"]["name"]
    if doc["kind"] != target.get("kind", doc["kind"]):
        return False
    if "name" in target and doc["metadata"]["name"] != target["name"]:
        return False
    labels = doc["metadata"].get("labels") or {}
    for term in filter(None, (target.get("labelSelector") or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k.strip()) != v.strip():
            return False
    return True


def _mini_kustomize(d):
    """The subset of kustomize deploy/ uses: resources (files and
    directories), namespace, patches (strategic merge, by file), and
    replacements from one field to others, local-config sources dropped."""
    k = _load(os.path.join(d, "kustomization.yaml"))
    docs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(d, r))
        docs += _mini_kustomize(p) if os.path.isdir(p) else [x for x in _load(p, True) if x]
    for p in k.get("patches", []):
        patch = _load(os.path.join(d, p["path"]))
        if p.get("target"):
            # A targeted patch's own name is a placeholder: never applied.
            patch = dict(patch, metadata={k: v for k, v in patch["metadata"].items() if k != "name"})
        for i, doc in enumerate(docs):
            if _patch_applies(p.get("target"), patch, doc):
                docs[i] = _merge(doc, patch)
    for r in k.get("replacements", []):
        s = r["source"]
        src = next(x for x in docs if x["kind"] == s["kind"] and x["metadata"]["name"] == s["name"])
        parent, last = _path(src, s["fieldPath"])
        value = _step(parent, last)
        for t in r["targets"]:
            for doc in docs:
                if doc["kind"] == t["select"]["kind"] and doc["metadata"]["name"] == t["select"]["name"]:
                    for f in t["fieldPaths"]:
                        parent, last = _path(doc, f)
                        old = _step(parent, last)
                        # kustomize keeps the target's type: a number stays a number.
                        v = int(value) if isinstance(old, int) and not isinstance(old, bool) else value
                        if isinstance(parent, list):
                            parent[int(last)] = v
                        else:
                            parent[last] = v
    docs = [x for x in docs if (x.get("metadata", {}).get("annotations") or {})
            .get("config.kubernetes.io/local-config") != "true"]
    if k.get("namespace"):
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = k["namespace"]
    return docs


def kustomize(d, renderer=None):
    """The documents `kubectl apply -k d` would apply. renderer: "kubectl",
    "mini", or None (kubectl when installed)."""
    d = os.path.join(HERE, d)
    if renderer == "kubectl" or (renderer is None and shutil.which("kubectl")):
        out = subprocess.run(["kubectl", "kustomize", d], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return [x for x in yaml.safe_load_all(out) if x]
    return _mini_kustomize(d)


def _k8s_expand(s, env):
    """$(VAR) in command/args, as the kubelet expands it ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


def _field_ref(path, pod_name, namespace, index, labels):
    """The downward API values the shard pods use."""
    refs = {"metadata.name": pod_name, "metadata.namespace": namespace,
            "metadata.labels['apps.kubernetes.io/pod-index']": str(index)}
    refs.update({"metadata.labels['%s']" % k: v for k, v in labels.items()})
    return refs[path]


def _container_env(c, base, pod_name, namespace, index, labels):
    """A container's environment as the kubelet sets it: base, then its
    env entries in order ($(VAR) expanded from those before)."""
    env = dict(base)
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = _k8s_expand(str(e["value"]), env)
        elif "fieldRef" in (e.get("valueFrom") or {}):
            env[e["name"]] = _field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], pod_name, namespace,
                                        index, labels)
    return env


def shard_sets(docs):
    """The StatefulSets whose pods run a container named "shard"."""
    return [x for x in docs if x["kind"] == "StatefulSet"
            and any(c["name"] == "shard" for c in x["spec"]["template"]["spec"]["containers"])]


def k8s_shards(docs):
    img = image()
    shards = []
    for sts in shard_sets(docs):
        spec = sts["spec"]
        pod = spec["template"]["spec"]
        c = next(x for x in pod["containers"] if x["name"] == "shard")
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []}
        vols = {v["name"]: v for v in pod.get("volumes") or []}
        psc, csc = pod.get("securityContext") or {}, c.get("securityContext") or {}
        uid = csc.get("runAsUser", psc.get("runAsUser", img["user"][0]))
        gid = csc.get("runAsGroup", psc.get("runAsGroup", img["user"][1]))
        namespace = sts["metadata"].get("namespace", "default")
        for i in range(spec["replicas"]):
            hostname = "%s-%d" % (sts["metadata"]["name"], i)
            labels = spec["template"]["metadata"].get("labels") or {}
            env = _container_env(c, dict(img["env"], HOSTNAME=hostname), hostname, namespace, i, labels)
            argv = [_k8s_expand(a, env) for a in (c.get("command") or img["entrypoint"])]
            argv += [_k8s_expand(a, env) for a in c.get("args") or []]
            mounts, tmpfs, secrets = {}, [], {}
            for m in c.get("volumeMounts") or []:
                if m["name"] in vols and "secret" in vols[m["name"]]:
                    secrets[m["mountPath"]] = vols[m["name"]]["secret"]["secretName"]
                if m["name"] in claims:
                    mounts[m["mountPath"]] = ("%s-%s" % (m["name"], hostname), True)
                elif m["name"] in vols and "emptyDir" in vols[m["name"]]:
                    tmpfs.append(m["mountPath"])
                    mounts[m["mountPath"]] = (m["name"], False)
                else:
                    mounts[m["mountPath"]] = (m["name"], False)
            px = next((x for x in pod["containers"] if x["name"] == "proxy"), None)
            proxy, proxy_mounts = None, {}
            if px:
                proxy_mounts = {m["mountPath"]: (vols[m["name"]].get("secret") or {}).get("secretName",
                                                                                        m["name"])
                                for m in px.get("volumeMounts") or [] if m["name"] in vols}
                penv = _container_env(px, dict(img["env"], HOSTNAME=hostname), hostname, namespace, i,
                                      labels)
                proxy = [_k8s_expand(a, penv) for a in (px.get("command") or []) + (px.get("args") or [])]
            shards.append(Shard(
                name=hostname, layout="statefulset", argv=argv, env=env, mounts=mounts,
                secrets=secrets, proxy=proxy, proxy_mounts=proxy_mounts,
                replica=sts["metadata"]["name"][-1],
                read_only=bool(csc.get("readOnlyRootFilesystem")), tmpfs=tmpfs, user=(uid, gid),
                fs_group=psc.get("fsGroup"), workdir=c.get("workingDir", img["workdir"]),
                grace=pod.get("terminationGracePeriodSeconds", 30), hostname=hostname,
                restart="pod", shard_id=i, replica_set=sts["metadata"]["name"]))
    return shards


def worker_job(docs):
    job = next(x for x in docs if x["kind"] == "Job")
    c = job["spec"]["template"]["spec"]["containers"][0]
    return job, c


# ---------------------------------------------------------------- check

# The final checkpoint of the documented shard (1 GiB of parameters, a
# 1.03 GB file) took 4-10 s here; the grace must cover 5 s of call draining
# plus that write on a disk several times slower.
MIN_GRACE_S = 30


def _flags_named(shard):
    """(flag, where) for every --flag in the argv (a shell command's words
    included) and every FACTORPS_* variable of the environment."""
    out = []
    for a in shard.argv:
        out += [(f, "argv") for f in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", a)]
    out += [(k, "env") for k in shard.env if k.startswith("FACTORPS_")]
    return out


def _set_labels(sts):
    return sts["spec"]["template"]["metadata"]["labels"]


def _strip_set(sts, me, other):
    """The StatefulSet with its own set's name and replica label, and the set
    it avoids, replaced by placeholders: equal for two sets that differ in
    nothing else."""
    text = yaml.safe_dump(sts, sort_keys=True)
    return (text.replace("factorps-shard-%s" % me, "factorps-shard-SELF")
            .replace("factorps-shard-%s" % other, "factorps-shard-OTHER")
            .replace("factorps.io/replica: %s\n" % me, "factorps.io/replica: SELF\n")
            .replace("factorps.io/replica: %s\n" % other, "factorps.io/replica: OTHER\n"))


def check_replicas(layouts, need, server_help=None):
    """A standby per shard: every shard id has exactly two definitions, each
    naming the other as --replica-peer (by its advertised address) and the
    same lease, one lease per shard; file leases on a volume both mount.
    The workers list each shard's two replicas. With server_help (the
    output of factorps-server --help), every flag and FACTORPS_* variable
    the definitions use exists."""
    for layout, shards in layouts:
        ids = {}
        for s in shards:
            ids.setdefault(s.shard_id, []).append(s)
        count = int(shards[0].option("shard-count") or 1) if shards else 0
        need(sorted(ids) == list(range(count)),
             "%s: shard ids %s, not 0..%d" % (layout, sorted(ids), count - 1))
        leases = {}
        for i, pair in sorted(ids.items()):
            need(len(pair) == 2, "%s shard %d: %d definitions, not a primary and a standby"
                 % (layout, i, len(pair)))
            if len(pair) != 2:
                continue
            for me, other in (pair, pair[::-1]):
                where = "%s %s" % (layout, me.name)
                adv = other.option("replica-advertise") or other.option("listen")
                need(me.option("replica-peer") and me.option("replica-peer") == adv,
                     "%s: --replica-peer %s is not its other replica (%s advertises %s)"
                     % (where, me.option("replica-peer"), other.name, adv))
                need(me.option("lease") and me.option("lease") == other.option("lease"),
                     "%s: lease %s differs from %s's %s" % (where, me.option("lease"), other.name,
                                                             other.option("lease")))
                lease = me.option("lease") or ""
                if lease.startswith("file:"):
                    v, w = me.volume_of(lease[5:]), other.volume_of(lease[5:])
                    need(v and w and v[1] == w[1] and v[2],
                         "%s: file lease %s is not on one persistent volume both replicas mount"
                         % (where, lease))
            leases.setdefault(pair[0].option("lease"), []).append(i)
        for lease, owners in leases.items():
            need(len(owners) == 1, "%s: shards %s share the lease %s" % (layout, owners, lease))
        if server_help is not None:
            for s in shards:
                for flag, how in _flags_named(s):
                    name = "--" + flag if how == "argv" else flag
                    need(re.search(r"(?<![\w-])%s\b" % re.escape(name), server_help),
                         "%s %s: %s is not in factorps-server --help" % (layout, s.name, name))


def check_anti_affinity(docs, name, need):
    """Two shard StatefulSets, each with required anti-affinity (per node)
    against the other's pods and not its own, equal in everything else."""
    sets = shard_sets(docs)
    need(len(sets) == 2, "%s: %d shard StatefulSets, not two (a replica set per standby)"
         % (name, len(sets)))
    if len(sets) != 2:
        return
    for me, other in (sets, sets[::-1]):
        terms = (((me["spec"]["template"]["spec"].get("affinity") or {}).get("podAntiAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        sel_other = [t for t in terms if t.get("topologyKey") == "kubernetes.io/hostname"
                     and all(_set_labels(other).get(k) == v
                             for k, v in t["labelSelector"]["matchLabels"].items())
                     and not all(_set_labels(me).get(k) == v
                                 for k, v in t["labelSelector"]["matchLabels"].items())]
        need(sel_other, "%s: %s has no required per-node anti-affinity against %s's pods"
             % (name, me["metadata"]["name"], other["metadata"]["name"]))
        need(me["spec"]["replicas"] == other["spec"]["replicas"],
             "%s: the two shard StatefulSets have different replicas" % name)
    a, b = sorted(sets, key=lambda x: x["metadata"]["name"])
    ma, mb = a["metadata"]["name"][-1], b["metadata"]["name"][-1]
    need(_strip_set(a, ma, mb) == _strip_set(b, mb, ma),
         "%s: %s and %s differ in more than their name, replica label and avoided set"
         % (name, a["metadata"]["name"], b["metadata"]["name"]))


def _worker_shards(cmd):
    return cmd[cmd.index("--shards") + 1]


_made = {}


def make_tls_files(shards):
    """The file names deploy/make-tls.sh writes for `shards` shards (it is
    run into a temporary directory, once per script text and count), or
    None without openssl."""
    if not shutil.which("openssl"):
        return None
    script = os.path.join(HERE, "make-tls.sh")
    with open(script) as f:
        key = (f.read(), shards)
    if key not in _made:
        tmp = tempfile.mkdtemp(prefix="fps-layouts-tls-")
        try:
            subprocess.run([script, "--shards", str(shards), tmp], check=True, capture_output=True,
                           timeout=120)
            _made[key] = set(os.listdir(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _made[key]


def check_tls(s, where, need, tls_files):
    """Mutual TLS on the proxy with this replica's certificate, the shard
    dialling its other replica with its shard's peer certificate, every
    file on a mounted volume or Secret and among those make-tls.sh writes
    (tls_files; None: not checked)."""
    px = s.proxy or []

    def mounted(path, mounts):
        return any(path.startswith(mp.rstrip("/") + "/") for mp in mounts)

    def made(path):
        need(tls_files is None or os.path.basename(path) in tls_files,
             "%s: %s is not a file deploy/make-tls.sh writes" % (where, path))
    fronts = [a for a in px if a.startswith("--frontend=")]
    need(fronts and not any("no-tls" in a for a in fronts),
         "%s: the proxy's frontend is not TLS (%r)" % (where, fronts))
    ca = [a.split("=", 1)[1] for a in px if a.startswith("--verify-client-cacert=")]
    need("--verify-client" in px and len(ca) == 1 and mounted(ca[0], s.proxy_mounts),
         "%s: the proxy does not require client certificates of a mounted CA (%r)" % (where, px))
    want = "server-%d-%s" % (s.shard_id, s.replica)
    files = px[-2:] if len(px) >= 2 else []
    need([os.path.basename(f) for f in files] == [want + ".key", want + ".crt"]
         and all(mounted(f, s.proxy_mounts) for f in files),
         "%s: the proxy's key and certificate are not its replica's %s.key/.crt on a mounted "
         "volume (%r)" % (where, want, files))
    for f in ca + files:
        made(f)
    peer = {k: s.option("peer-tls-" + k) for k in ("ca", "cert", "key")}
    need([os.path.basename(v or "") for v in peer.values()]
         == ["ca.crt", "peer-%d.crt" % s.shard_id, "peer-%d.key" % s.shard_id]
         and all(s.volume_of(v) for v in peer.values()),
         "%s: the shard does not dial its other replica with the CA and its peer certificate "
         "peer-%d on a mounted volume (%r)" % (where, s.shard_id, peer))
    for v in peer.values():
        if v:
            made(v)


def check(renderer=None, server_help=None):
    """Every assertion deploy/ promises; returns a list of failures."""
    bad = []

    def need(cond, what):
        if not cond:
            bad.append(what)

    layouts = [("compose", compose_shards()),
               ("compose sync", compose_shards(dict(os.environ, FACTORPS_MODE="sync",
                                                    FACTORPS_WORKERS="3"))),
               ("kubernetes", k8s_shards(kustomize("kubernetes", renderer))),
               ("kubernetes-sync", k8s_shards(kustomize("kubernetes-sync", renderer)))]
    tls_files = make_tls_files(max([int(s.option("shard-count") or 1) for _, x in layouts for s in x] + [1]))
    for layout, shards in layouts:
        need(shards, "%s: no shard definition found" % layout)
        for s in shards:
            where = "%s %s" % (layout, s.name)
            d = s.option("checkpoint-dir")
            need(d and d.startswith("/"), "%s: no absolute checkpoint directory" % where)
            if not d:
                continue
            vol = s.volume_of(d)
            need(vol is not None and vol[2],
                 "%s: checkpoint directory %s is not on a persistent volume (%r)" % (where, d, vol))
            need(vol is None or vol[0] != d,
                 "%s: checkpoint directory %s is the mount point itself (use a subdirectory: "
                 "a volume root may hold lost+found)" % (where, d))
            iv = float(s.option("checkpoint-interval") or 0)
            need(iv > 0, "%s: no periodic checkpoints (--checkpoint-interval %s)" % (where, iv))
            need(int(s.option("checkpoint-keep") or 3) >= 2, "%s: keep fewer than 2" % where)
            need(s.grace >= MIN_GRACE_S, "%s: %ss between SIGTERM and SIGKILL is too short for the "
                 "final checkpoint (at least %ss)" % (where, s.grace, MIN_GRACE_S))
            need(s.read_only, "%s: root filesystem is writable" % where)
            need(s.option("require-checkpoint") in (None, "false", "true"),
                 "%s: FACTORPS_REQUIRE_CHECKPOINT must be true or false" % where)
            # Secure by default: a token file per role, from a mounted
            # volume or Secret (never the image), and the shard's gRPC on
            # loopback behind an nghttpx front proxy (rapid reset).
            for flag in ("auth-token-file", "admin-token-file", "exchange-token-file"):
                f = s.option(flag)
                need(f and s.volume_of(f) is not None,
                     "%s: no --%s on a mounted volume or Secret (%r)" % (where, flag, f))
            listen = s.option("listen") or ""
            need(listen.startswith("127.0.0.1:"),
                 "%s: the shard's gRPC listens on %r, not on loopback behind its proxy" % (where, listen))
            port = listen.rsplit(":", 1)[-1]
            need(bool(s.proxy) and os.path.basename(s.proxy[0]) == "nghttpx"
                 and "--backend=127.0.0.1,%s;;proto=h2" % port in s.proxy,
                 "%s: no nghttpx front proxy forwarding to its gRPC port (%r)" % (where, s.proxy))
            check_tls(s, where, need, tls_files)
    check_replicas(layouts, need, server_help)
    # The workers list each shard's replicas (advertised addresses) in id order.
    for layout, shards, cmd in (
            ("compose", layouts[0][1], compose_config()["services"]["worker"]["command"]),
            ("kubernetes", layouts[2][1], worker_job(kustomize("kubernetes", renderer))[1]["command"]),
            ("kubernetes-sync", layouts[3][1],
             worker_job(kustomize("kubernetes-sync", renderer))[1]["command"])):
        want = ",".join("|".join(s.option("replica-advertise") for s in
                                 sorted((x for x in shards if x.shard_id == i), key=lambda x: x.name))
                        for i in sorted({x.shard_id for x in shards}))
        need(_worker_shards(cmd) == want, "%s: the worker's --shards %s is not the replicas %s"
             % (layout, _worker_shards(cmd), want))
    for name in ("kubernetes", "kubernetes-sync"):
        check_anti_affinity(kustomize(name, renderer), name, need)
    # The workers dial over TLS with the worker certificate.
    for layout, cmd in (("compose", compose_config()["services"]["worker"]["command"]),
                        ("kubernetes", worker_job(kustomize("kubernetes", renderer))[1]["command"]),
                        ("kubernetes-sync", worker_job(kustomize("kubernetes-sync", renderer))[1]["command"])):
        got = {f: cmd[cmd.index(f) + 1] if f in cmd else None for f in ("--tls-ca", "--tls-cert", "--tls-key")}
        need([os.path.basename(v or "") for v in got.values()] == ["ca.crt", "worker.crt", "worker.key"],
             "%s: the worker does not dial with the CA and the worker certificate (%r)" % (layout, got))
    # Compose sync: the same variable sets the shards' and the worker's count.
    cfg = compose_config(dict(os.environ, FACTORPS_MODE="sync", FACTORPS_WORKERS="3"))
    w = cfg["services"]["worker"]["command"]
    need(w[w.index("--workers") + 1] == "3", "compose sync: worker --workers is not FACTORPS_WORKERS")
    for s in layouts[1][1]:
        need(s.option("workers") == "3" and s.option("mode") == "sync",
             "compose sync: %s does not take FACTORPS_MODE/FACTORPS_WORKERS" % s.name)
    # Kubernetes sync: W in one place.
    docs = kustomize("kubernetes-sync", renderer)
    job, c = worker_job(docs)
    env = {e["name"]: e.get("value") for e in c.get("env") or []}
    par, comp = job["spec"].get("parallelism"), job["spec"].get("completions")
    for s in k8s_shards(docs):
        need(s.option("mode") == "sync", "kubernetes-sync: %s is not in sync mode" % s.name)
        need(str(s.option("workers")) == str(par) == str(comp) == env.get("FACTORPS_WORKERS"),
             "kubernetes-sync: shard workers %s, Job parallelism %s, completions %s, worker env %s"
             % (s.option("workers"), par, comp, env.get("FACTORPS_WORKERS")))
    need(isinstance(par, int) and par >= 1, "kubernetes-sync: parallelism %r is not a count" % par)
    need(job["spec"].get("completionMode") == "Indexed", "kubernetes-sync: the Job is not Indexed")
    cmd = c["command"]
    need(cmd[cmd.index("--workers") + 1] == "$(FACTORPS_WORKERS)",
         "kubernetes-sync: the worker's --workers is not $(FACTORPS_WORKERS)")
    need(cmd[cmd.index("--worker-id") + 1] == "$(WORKER_ID)" and "WORKER_ID" in env,
         "kubernetes-sync: the worker's --worker-id is not its completion index")
    # Kubernetes: the budget selects the shard pods; claims are retained.
    for name in ("kubernetes", "kubernetes-sync"):
        docs = kustomize(name, renderer)
        pdb = [x for x in docs if x["kind"] == "PodDisruptionBudget"
               and (x["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "shard"]
        need(len(pdb) == 1, "%s: no PodDisruptionBudget" % name)
        for sts in shard_sets(docs):
            if pdb:
                sel = pdb[0]["spec"]["selector"]["matchLabels"]
                labels = sts["spec"]["template"]["metadata"]["labels"]
                need(all(labels.get(k) == v for k, v in sel.items()),
                     "%s: the PodDisruptionBudget does not select the shard pods" % name)
            need(sts["spec"].get("persistentVolumeClaimRetentionPolicy", {}).get("whenDeleted")
                 == "Retain", "%s: claims are not retained when the StatefulSet is deleted" % name)
            fsg = sts["spec"]["template"]["spec"].get("securityContext", {}).get("fsGroup")
            need(fsg is not None, "%s: no fsGroup, the shard user may not write the volume" % name)
    return bad


def main():
    if sys.argv[1:2] != ["check"] or len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    server_help = None
    if len(sys.argv) == 3:
        server_help = subprocess.run([sys.argv[2], "--help"], capture_output=True, text=True,
                                     timeout=60).stdout
        if "--shard-id" not in server_help:
            print("FAIL %s --help printed no options" % sys.argv[2])
            return 1
    renderer = "kubectl" if shutil.which("kubectl") else "mini"
    bad = check(renderer, server_help)
    if renderer == "kubectl":
        # The small renderer must agree with kustomize wherever both exist.
        for d in ("kubernetes", "kubernetes-sync"):
            a = [s.__dict__ for s in k8s_shards(kustomize(d, "kubectl"))]
            b = [s.__dict__ for s in k8s_shards(kustomize(d, "mini"))]
            if a != b:
                bad.append("%s: the fallback renderer disagrees with kubectl kustomize" % d)
    for b in bad:
        print("FAIL " + b)
    print("%d shard definitions checked (%s renderer): %s"
          % (sum(len(x) for x in (compose_shards(), k8s_shards(kustomize("kubernetes", renderer)),
                                  k8s_shards(kustomize("kubernetes-sync", renderer)))),
             renderer, "ok" if not bad else "%d problems" % len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

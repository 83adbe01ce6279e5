#!/usr/bin/env bash
# Static checks of deploy/ (no Docker engine or cluster needed):
#   yamllint on every YAML file, `docker-compose config` on the compose file,
#   `promtool check config` on both Prometheus configurations, and every
#   PromQL expression of the Grafana dashboard through `promtool check rules`,
#   the alert unit tests (`promtool test rules`), and every shipped shard
#   definition (compose, compose in sync, the StatefulSets, their sync overlay)
#   through layouts.py: checkpoints on a persistent volume, an interval,
#   a grace period for the final checkpoint, sync worker counts in one place,
#   a standby per shard (two definitions naming each other, one lease per
#   shard, the workers listing both), the two replica sets kept off each
#   other's nodes, mutual TLS on every front proxy with its replica's
#   certificate, peers and workers dialling with theirs (files that
#   make-tls.sh writes, and its Kubernetes Secrets the ones the manifests
#   mount), and, with FACTORPS_SERVER set (ctest sets it), every flag
#   and FACTORPS_* variable they use present in `factorps-server --help`.
# Usage: [FACTORPS_SERVER=build/server/factorps-server] deploy/check.sh
#   (exit 0: all good; 77: a tool is missing)
set -euo pipefail
cd "$(dirname "$0")"
py=/usr/bin/python3
for tool in yamllint docker-compose promtool "$py"; do
  if ! command -v "$tool" >/dev/null; then
    echo "deploy/check.sh: $tool not installed (scripts/deps.sh test installs it)" >&2
    exit 77
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== yamllint"
yamllint -c .yamllint.yml -s .

echo "== docker-compose config"
docker-compose -f docker-compose.yml config -q
docker-compose -f docker-compose.yml --profile dashboards config --services | sort | tr '\n' ' '
echo

echo "== promtool check config (file discovery)"
promtool check config prometheus/prometheus.yml

echo "== promtool check rules (alerts)"
promtool check rules prometheus/alerts.yml

echo "== promtool test rules (alert unit tests)"
promtool test rules prometheus/alerts_test.yml

echo "== promtool check config (kubernetes ConfigMap)"
"$py" - "$tmp/k8s-prometheus.yml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open("kubernetes/prometheus-config.yaml"))
open(sys.argv[1], "w").write(doc["data"]["prometheus.yml"])
PY
# Debian's Prometheus is built without Kubernetes discovery; there only the
# YAML itself can be checked.
if ! out=$(promtool check config "$tmp/k8s-prometheus.yml" 2>&1); then
  if grep -q "field kubernetes_sd_configs not found" <<<"$out"; then
    echo "skipped: this promtool has no kubernetes_sd_configs (Debian build)"
  else
    echo "$out" >&2
    exit 1
  fi
else
  echo "$out"
fi

echo "== Grafana dashboard PromQL"
"$py" - "$tmp/dashboard-rules.yml" <<'PY'
import json, sys, yaml
d = json.load(open("grafana/dashboards/factorps.json"))
exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
assert exprs, "dashboard has no queries"
rules = []
for i, e in enumerate(exprs):
    # Grafana variables become what Grafana substitutes at query time.
    e = e.replace("$__rate_interval", "1m").replace("$shard", ".*")
    rules.append({"record": "factorps:dashboard_check_%d" % i, "expr": e})
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[1], "w"))
print("%d expressions" % len(exprs))
PY
promtool check rules "$tmp/dashboard-rules.yml"

echo "== kubernetes manifests reference the right ports and probes"
"$py" - <<'PY'
import yaml
docs = {}
for f in ("shard-statefulset.yaml", "shard-service.yaml", "worker-job.yaml", "kustomization.yaml",
          "etcd.yaml"):
    docs[f] = [d for d in yaml.safe_load_all(open("kubernetes/" + f)) if d]
svc = docs["shard-service.yaml"][0]
assert svc["spec"]["clusterIP"] == "None", "the shard Service must be headless"
sets = docs["shard-statefulset.yaml"]
assert [s["kind"] for s in sets] == ["StatefulSet", "StatefulSet"], "two replica sets"
for sts in sets:
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "Service selects it"
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["FACTORPS_SHARD_COUNT"]) == sts["spec"]["replicas"], "shard count != replicas"
    assert env["FACTORPS_LEASE"].startswith("etcd:factorps-etcd:2379/"), env["FACTORPS_LEASE"]
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert env["FACTORPS_METRICS_LISTEN"].endswith(":" + ann["prometheus.io/port"])
etcd = {d["kind"] + "/" + d["metadata"]["name"]: d for d in docs["etcd.yaml"]}
assert etcd["Service/factorps-etcd"]["spec"]["ports"][0]["port"] == 2379
assert etcd["StatefulSet/factorps-etcd"]["spec"]["replicas"] % 2 == 1, "an odd etcd quorum"
assert "etcd.yaml" in docs["kustomization.yaml"][0]["resources"]
n = sets[0]["spec"]["replicas"]
w = docs["worker-job.yaml"][0]["spec"]["template"]["spec"]["containers"][0]["command"]
shards = w[w.index("--shards") + 1].split(",")
assert shards == ["factorps-shard-a-%d.factorps-shard:50051|factorps-shard-b-%d.factorps-shard:50051" % (i, i)
                  for i in range(n)], shards
print("ok")
PY
echo "== make-tls.sh: the Secrets it prints are the ones the manifests mount"
if command -v openssl >/dev/null; then
  ./make-tls.sh --kubernetes "$tmp/tls" 2>/dev/null >"$tmp/tls-secrets.yaml"
  "$py" - "$tmp/tls-secrets.yaml" <<'PY'
import sys, yaml
made = {d["metadata"]["name"]: set(d["data"]) for d in yaml.safe_load_all(open(sys.argv[1])) if d}
assert not any("ca.key" in k or "admin" in k for keys in made.values() for k in keys), made
for f in ("shard-statefulset.yaml", "worker-job.yaml"):
    for doc in yaml.safe_load_all(open("kubernetes/" + f)):
        spec = doc["spec"]["template"]["spec"]
        vols = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                name = vols.get(m["name"], "")
                if not name.startswith("factorps-tls"):
                    continue
                assert name in made, "%s mounts Secret %s, which make-tls.sh does not make" % (f, name)
                # Every file of the mount the container names is a key of it.
                words = (c.get("command") or []) + [e.get("value", "") for e in c.get("env", [])]
                for w in words:
                    for p in str(w).replace("=", " ").split():
                        if p.startswith(m["mountPath"] + "/"):
                            key = p[len(m["mountPath"]) + 1:].replace("$(SHARD_INDEX)", "0").replace("$(REPLICA)", "b")
                            assert key in made[name], "%s: %s is not a key of %s" % (f, p, name)
print("ok:", ", ".join("%s (%d keys)" % (k, len(v)) for k, v in sorted(made.items())))
PY
else
  echo "skipped: no openssl"
fi

echo "== shard definitions: checkpoints on persistent volumes, sync worker counts, standbys"
if [[ -n ${FACTORPS_SERVER:-} ]]; then
  "$py" layouts.py check "$FACTORPS_SERVER"
else
  echo "(FACTORPS_SERVER not set: the flags are not checked against factorps-server --help)"
  "$py" layouts.py check
fi

echo "deploy/check.sh: all checks passed"

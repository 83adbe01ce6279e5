#!/usr/bin/python3
"""Every metric deploy/README.md's table lists (docs/operations.md's
"Monitoring" points users there for the full list), checked against a real shard's /metrics:

- the name exists (a `# TYPE` line; a histogram's _bucket/_sum/_count);
- its type is the documented one (gauge, counter, histogram);
- every series carries exactly the documented labels plus `shard` (and `le`
  on a histogram's buckets), as docs/operations.md promises ("Every series is labelled
  shard");
- where the table enumerates a label's values (kind, reason, outcome), every
  listed value has a series, and no other value does;
- the reverse: every factorps_ series the shard exports is in the table, so
  the table is the full list.

The table is parsed, not copied: a row added, renamed or retyped on either
side fails here. The shard first serves real traffic (Create, sync pushes,
Pull, Stats, a failed push) so that the per-method series exist.

Environment: FACTORPS_SERVER (factorps-server path; set by ctest).
"""
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fpsgrpc as F  # noqa: E402

SERVER = os.environ.get("FACTORPS_SERVER", "")
DOC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "deploy", "README.md")


def documented():
    """{name: (type or None, set of labels, {label: set of values})} from the
    table rows of deploy/README.md whose first cell names metrics."""
    out = {}
    with open(DOC) as f:
        for line in f:
            if not line.startswith("| `"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 4:
                continue
            first, kind, labels = cells[0], cells[1], cells[2]
            names = []
            for tok in re.findall(r"`([a-z_]+)`", first):
                if tok.startswith("_"):
                    # `a_b_elements` / `_bytes`: the shorthand replaces the
                    # first name's last word.
                    names.append(names[-1].rsplit("_", 1)[0] + tok if tok != "_sequence"
                                 else names[-1] + tok)
                else:
                    names.append(tok)
            names = [n for n in names if n.startswith(("factorps_", "process_"))]
            if not names:
                continue
            m = re.match(r"(gauge|counter|histogram)", kind)
            label_names = set(re.findall(r"`([a-z_]+)`", labels))
            values = {}
            for lab, vals in re.findall(r"`([a-z_]+)` = ([a-z_, ]+)", labels):
                values[lab] = {v.strip() for v in vals.split(",") if v.strip()}
            for n in names:
                out[n] = (m.group(1) if m else None, label_names, values)
    return out


def exported(text):
    """{name: type} and [(name, {labels})] of every sample line."""
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? ", line)
            labels = dict(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
            samples.append((m.group(1), labels))
    return types, samples


def family(name, types):
    """The metric family a sample name belongs to."""
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and types.get(base) == "histogram":
            return base
    return None


@unittest.skipUnless(SERVER and os.access(SERVER, os.X_OK), "FACTORPS_SERVER not set")
class MetricsTableTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = documented()
        cls.shard = F.Shard(SERVER, 0, 1)
        try:
            F.run_worker([cls.shard.addr], 2)
            ch, stub = F.channel(cls.shard.addr)
            pb, _, grpc = F.stubs()
            F.pull(stub, [n for n, _, _ in F.shard_tensors(0)])
            stub.Stats(pb.StatsRequest(include_tensors=True), timeout=10)
            try:
                F.push(stub, 0, 9, [("no.such.tensor", [3], {})])
            except grpc.RpcError:
                pass
            ch.close()
            st, _, body = cls.shard.scrape()
            assert st == 200, st
            cls.types, cls.samples = exported(body.decode())
        except BaseException:
            print(cls.shard.read_log(), file=sys.stderr)
            cls.shard.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        assert cls.shard.stop() == 0

    def test_table_was_parsed(self):
        # A parser that finds nothing would pass everything below.
        self.assertGreaterEqual(len(self.doc), 50, sorted(self.doc))
        self.assertEqual(self.doc["factorps_rpc_duration_seconds"][:2],
                         ("histogram", {"method"}))
        self.assertIn("factorps_checkpoint_last_success_size_bytes", self.doc)
        self.assertIn("factorps_adamw_equivalent_state_bytes", self.doc)

    def test_every_documented_metric_exists_with_its_type(self):
        for name, (kind, _, _) in sorted(self.doc.items()):
            with self.subTest(metric=name):
                self.assertIn(name, self.types, f"{name} is documented but not exported")
                if kind is not None:
                    self.assertEqual(self.types[name], kind, name)

    def test_every_exported_factorps_metric_is_documented(self):
        missing = sorted(n for n in self.types if n.startswith("factorps_") and n not in self.doc)
        self.assertEqual(missing, [], "exported but not in deploy/README.md's table")

    def test_labels_are_the_documented_ones(self):
        seen_values = {}
        for sample, labels in self.samples:
            name = family(sample, self.types)
            if name not in self.doc:
                continue
            _, want, values = self.doc[name]
            want = set(want) | {"shard"}
            if sample.endswith("_bucket") and self.types.get(name) == "histogram":
                want.add("le")
            with self.subTest(sample=sample, labels=labels):
                self.assertEqual(set(labels), want, sample)
                self.assertEqual(labels.get("shard"), "0")
            for lab in values:
                if lab in labels:
                    seen_values.setdefault((name, lab), set()).add(labels[lab])
        for name, (_, _, values) in self.doc.items():
            for lab, vals in values.items():
                with self.subTest(metric=name, label=lab):
                    self.assertEqual(seen_values.get((name, lab), set()), vals,
                                     f"{name}: values of {lab}")

    def test_documented_sample_values(self):
        """A few figures the table defines exactly, after this traffic."""
        text = self.shard.scrape()[2].decode()
        self.assertEqual(F.metric(text, "factorps_shard_info", mode="sync", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_ready", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_shards", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_workers", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_checkpoint_restore_outcome",
                                  outcome="disabled", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_checkpoint_interval_seconds", shard="0"), 0)
        self.assertEqual(F.metric(text, "factorps_rpc_requests_total", method="PushPull",
                                  code="NOT_FOUND", shard="0"), 1)
        self.assertEqual(F.metric(text, "factorps_sync_steps_completed_total", shard="0"),
                         2 * len(F.shard_tensors(0)))


if __name__ == "__main__":
    unittest.main()

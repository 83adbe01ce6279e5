"""The 100M load models split over 2, 3 and 4 shards: balanced.

`factorps load --model peer|gpt --params 100M --split-min-bytes 32Mi` (the
recommended threshold, FPS_SPLIT_MIN_BYTES_DEFAULT) runs 2 steps against
shards started with --peers, in sync mode; then Stats, as the shards report
it, must show max/min shard parameter bytes <= 1.05, the shards' bytes
adding up to the model, their tensors to its tensor count plus one more
block per extra shard, and one block of the embedding (the one tensor above
the threshold) on every shard. Placed whole, the default gpt model's
embedding (40% of it) leaves max/min at 1.33 over 3 shards and 2.00 over 4.
"""

import os
import subprocess
import unittest

from _support import Shards, need_server
import factorps

CLI = os.environ.get("FACTORPS_CLI", "")


def result_line(out):
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return dict(kv.split("=", 1) for kv in line.split()[1:])


@need_server
class LoadBalanceTest(unittest.TestCase):
    def balance(self, n_shards, model="peer"):
        self.assertTrue(CLI and os.access(CLI, os.X_OK),
                        f"FACTORPS_CLI ({CLI!r}) is not the factorps binary (ctest sets it)")
        with Shards(n_shards, peers=True, deadline=120) as s:
            proc = subprocess.run(
                [CLI, "load", "--model", model, "--params", "100M", "--workers", "1",
                 "--steps", "2", "--warmup", "1", "--deadline", "300",
                 "--split-min-bytes", "32Mi", "--shards", ",".join(s.addrs)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                env={k: v for k, v in os.environ.items() if k != "FACTORPS_SHARDS"})
            self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + "\n" +
                             "\n".join(s.log(i) for i in range(n_shards)))
            with factorps.connect(s.addrs, deadline=60) as c:
                stats = c.stats()
        per_shard = [st["param_bytes"] for st in stats]
        ratio = max(per_shard) / min(per_shard)
        print(f"{model}, {n_shards} shards: param bytes {per_shard}, max/min {ratio:.4f}")
        self.assertLessEqual(ratio, 1.05, per_shard)
        # Every parameter once, and every tensor with the embedding held
        # as one block per shard.
        self.assertEqual(sum(per_shard), 4 * int(result_line(proc.stdout)["params"]))
        n_tensors = int(proc.stdout.split(" parameters in ")[1].split()[0])
        self.assertEqual(sum(st["tensors"] for st in stats), n_tensors + n_shards - 1)
        self.assertEqual([st["split_blocks"] for st in stats], [1] * n_shards)
        self.assertTrue(all(st["tensors"] >= 1 for st in stats))

    def test_two_shards(self):
        self.balance(2)

    def test_three_shards(self):
        self.balance(3)

    def test_four_shards(self):
        self.balance(4)

    def test_gpt_model_over_three_and_four_shards(self):
        self.balance(3, "gpt")
        self.balance(4, "gpt")


if __name__ == "__main__":
    unittest.main()

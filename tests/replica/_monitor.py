"""Watches one replica process: its Stats every PERIOD seconds, one JSON
line each, until killed (run inside the process's network namespace for
the partition tests, where only it can reach the process).

    _monitor.py ADDR LOG [TENSOR...]

A line is {"t" (CLOCK_MONOTONIC), "role", "term", "joined", "updates",
"pushes", "tensors": {name: [version, checksum]}} or {"t", "err"} when
the process does not answer (dead, or cut off).
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))
import factorps  # noqa: E402
from factorps.errors import Error  # noqa: E402

PERIOD = 0.05


def main():
    addr, path, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    log = open(path, "a", buffering=1)
    c = factorps.connect([addr], deadline=1.0, max_retries=0)
    while True:
        t = time.monotonic()
        try:
            s = c.stats()[0]
            line = {"t": t, "role": s.get("replica_role", ""), "term": s.get("term", 0),
                    "joined": s.get("standby_joined", 0), "updates": s["updates"],
                    "pushes": s["pushes"], "tensors": {}}
            for n in names:
                try:
                    ts = c.tensor_stats(n)
                    line["tensors"][n] = [ts["version"], ts.get("checksum", 0)]
                except Error:
                    pass
        except Error as e:
            line = {"t": t, "err": type(e).__name__}
        log.write(json.dumps(line) + "\n")
        time.sleep(max(0.0, PERIOD - (time.monotonic() - t)))


if __name__ == "__main__":
    main()

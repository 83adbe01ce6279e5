#!/usr/bin/python3
"""The shard's HTTP/2 receive windows stay gRPC's fixed ones: no BDP probing.

BDP probing (gRPC's default) sends a PING with the data it receives and
grows every stream's window to the bandwidth-delay estimate; a push the
shard is not reading yet then holds that many received bytes in gRPC's
buffers, per stream (measured: 150-200 MiB more peak RSS per shard at W = 4,
see grpc_server.c). This test speaks raw HTTP/2 to the shard over loopback
(so nothing in between can hide a frame), streams a 16 MiB gRPC message
into a PushPull call within the windows the shard grants, answers every
PING, and checks that the shard sent no PING of its own and never granted
the stream more than the message it waits for plus gRPC's 64 KiB
lookahead and one frame. It also checks the largest DATA frame the shard accepts
(--http2-max-frame) and that frames of that size go through."""
import select
import socket
import struct
import time
import unittest

import fpsharness as H

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_HEADERS, ACK = 0x4, 0x1
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
MESSAGE = 16 << 20  # the gRPC message's payload bytes
LOOKAHEAD = 64 << 10
FRAME = 16384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE
SHARD_FRAME = 1 << 20  # the shard's default --http2-max-frame


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name, value):
    """HPACK literal header field without indexing, new name, no Huffman."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class Conn:
    def __init__(self, addr):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.buf = b""
        self.pings = 0          # PINGs the shard sent (not ACKs of ours)
        self.conn_window = 65535
        self.stream_window = 65535
        self.initial = 65535
        self.granted = 65535    # stream-1 bytes the shard allowed in total
        self.closed = None      # why stream 1 or the connection ended
        self.max_frame = FRAME  # the largest DATA frame the shard accepts
        self.largest = 0        # the largest DATA frame sent

    def send(self, data):
        self.sock.sendall(data)

    def pump(self, wait):
        """Reads and handles whatever frames arrive within `wait` seconds."""
        r, _, _ = select.select([self.sock], [], [], wait)
        if not r:
            return
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            self.closed = self.closed or "connection closed"
            return
        self.buf += chunk
        while len(self.buf) >= 9:
            n = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + n:
                break
            kind, flags = self.buf[3], self.buf[4]
            stream = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload = self.buf[9:9 + n]
            self.buf = self.buf[9 + n:]
            self.handle(kind, flags, stream, payload)

    def handle(self, kind, flags, stream, payload):
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload), 6):
                ident, value = struct.unpack(">HI", payload[i:i + 6])
                if ident == SETTINGS_MAX_FRAME_SIZE:
                    self.max_frame = value
                if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                    self.stream_window += value - self.initial
                    self.granted += value - self.initial
                    self.initial = value
            self.send(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.pings += 1
            self.send(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.conn_window += inc
            elif stream == 1:
                self.stream_window += inc
                self.granted += inc
        elif kind == RST_STREAM and stream == 1:
            self.closed = self.closed or "RST_STREAM"
        elif kind == GOAWAY:
            self.closed = self.closed or "GOAWAY"
        elif kind == HEADERS and stream == 1 and flags & 0x1:
            self.closed = self.closed or "trailers"


class ReceiveWindow(unittest.TestCase):
    def push_message(self, *flags):
        """Streams the 16 MiB message into a PushPull call of a new shard
        started with flags, within the windows it grants, until the shard
        answers; returns the connection's record."""
        srv = H.Server("--mode", "sync", "--workers", 2, *flags)
        try:
            c = Conn(srv.addr)
            c.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
            hdrs = (literal(b":method", b"POST") + literal(b":scheme", b"http") +
                    literal(b":path", b"/factorps.v1.ParameterServer/PushPull") +
                    literal(b":authority", srv.addr.encode()) +
                    literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))
            c.send(frame(HEADERS, END_HEADERS, 1, hdrs))
            # Not a valid request (zeros): the shard reads it whole first.
            body = b"\x00" + struct.pack(">I", MESSAGE) + bytes(MESSAGE)
            sent, t0 = 0, time.monotonic()
            while sent < len(body) and not c.closed:
                self.assertLess(time.monotonic() - t0, 60, "the shard stopped granting window at %d" % sent)
                n = min(c.max_frame, len(body) - sent, c.conn_window, c.stream_window)
                if n <= 0:
                    c.pump(0.5)
                    continue
                c.send(frame(DATA, 0, 1, body[sent:sent + n]))
                c.largest = max(c.largest, n)
                sent += n
                c.conn_window -= n
                c.stream_window -= n
                c.pump(0)
            self.assertEqual(sent, len(body), "stream ended early: %s" % c.closed)
            end = time.monotonic() + 5
            while not c.closed and time.monotonic() < end:
                c.pump(0.2)
            self.assertEqual(c.closed, "trailers", "the shard should answer the bad message with a status")
            c.sock.close()
            return c, len(body)
        finally:
            srv.stop()

    def test_no_bdp_probe_while_receiving(self):
        c, size = self.push_message()
        self.assertEqual(c.pings, 0, "the shard probes the bandwidth-delay product (PINGs): its "
                         "receive windows grow with it")
        # gRPC counts a frame it has received but not yet handed to the
        # reader both as received and as still wanted: up to one frame more.
        self.assertLessEqual(c.granted, size + LOOKAHEAD + 65535 + c.max_frame,
                             "the shard granted the stream more than the message it reads")

    def test_bdp_probe_when_asked(self):
        c, _ = self.push_message("--http2-bdp-probe", "true")
        self.assertGreater(c.pings, 0, "--http2-bdp-probe true should let gRPC probe the "
                           "bandwidth-delay product (it sends PINGs with the data it receives)")

    def test_large_frames_by_default(self):
        # Fewer frames, less CPU per byte on both ends (docs/performance.md).
        c, _ = self.push_message()
        self.assertEqual(c.max_frame, SHARD_FRAME, "the shard should accept 1 MiB DATA frames")
        self.assertGreater(c.largest, FRAME, "no frame larger than 16 KiB was sent, so none was tested")

    def test_max_frame_flag(self):
        c, _ = self.push_message("--http2-max-frame", str(64 << 10))
        self.assertEqual(c.max_frame, 64 << 10)
        self.assertEqual(c.largest, 64 << 10)
        c, _ = self.push_message("--http2-max-frame", "0")
        self.assertEqual(c.max_frame, FRAME, "--http2-max-frame 0 should keep HTTP/2's 16 KiB")
        self.assertEqual(c.largest, FRAME)


if __name__ == "__main__":
    unittest.main()

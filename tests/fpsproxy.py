"""nghttpx (Debian's nghttp2-proxy) in front of a shard, configured by the
deploy files' own deploy/proxy/nghttpx.conf: the tests run the HTTP/2
floods through exactly what the deployments put in front of a shard.

FrontProxy(backend="127.0.0.1:PORT") listens on a free loopback port
(.addr); close() stops it. Environment: FPS_NGHTTPX (default: nghttpx on
PATH, then /usr/sbin/nghttpx)."""
import os
import shutil
import socket
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONF = os.path.join(REPO, "deploy", "proxy", "nghttpx.conf")
NGHTTPX = os.environ.get("FPS_NGHTTPX") or shutil.which("nghttpx") or "/usr/sbin/nghttpx"


def available():
    return os.access(NGHTTPX, os.X_OK)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FrontProxy:
    def __init__(self, backend, conf=CONF, timeout=10):
        host, port = backend.rsplit(":", 1)
        self.dir = tempfile.mkdtemp(prefix="fps-proxy-")
        self.log_path = os.path.join(self.dir, "nghttpx.log")
        self.proc = None
        for _ in range(3):  # a free port can be taken before nghttpx binds it
            self.port = free_port()
            self.addr = "127.0.0.1:%d" % self.port
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [NGHTTPX, "--conf", conf, "--frontend=127.0.0.1,%d;no-tls" % self.port,
                     "--backend=%s,%s;;proto=h2" % (host, port), "--errorlog-file=" + self.log_path],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self._stop()
        raise RuntimeError("nghttpx did not start: " + self.log())

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def _stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def close(self):
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Starting factorps-server processes for the tests: the one place that
knows how (argv, environment, port files, log, stopping).

Every Python test that needs a real shard goes through ShardProcess, either
directly or through the suite's own front:

- tests/interop/fpsharness.py: Server (a grpcio stub on top) and Job
  (n shards that know each other through --peers, security variants);
- tests/python/_support.py: Shards (n shards of one job for the package
  and factorps.torch tests; tests/recovery builds on it);
- tests/http/fpsgrpc.py: Shard (with the metrics endpoint, optionally
  inside a network namespace).

A shard listens on 127.0.0.1:0 unless told otherwise; the port it bound
comes back through --port-file (and --metrics-port-file), so no test
depends on a fixed port. The server reads FACTORPS_<FLAG> variables as
flags, so none of the test process's are passed on; the environment of
the server is the test's minus those, plus FACTORPS_TEST_SERVER_ENV
("K=V|K=" sets or removes variables: the ASan build undoes the Python
side's LD_PRELOAD there), plus what the caller passes.

Environment: FPS_SERVER or FACTORPS_SERVER (the factorps-server binary).
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SERVER = (os.environ.get("FPS_SERVER") or os.environ.get("FACTORPS_SERVER")
          or os.path.join(REPO, "build", "server", "factorps-server"))

SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "ThreadSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")


def server_env(extra=None):
    """The environment a shard is started with (see the module comment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTORPS_")}
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    for kv in filter(None, os.environ.get("FACTORPS_TEST_SERVER_ENV", "").split("|")):
        k, _, v = kv.partition("=")
        if v:
            env[k] = v
        else:
            env.pop(k, None)
    env.update(extra or {})
    return env


def in_netns(ns, *cmd):
    """argv running cmd inside network namespace ns (one `ip netns add`
    made). nsenter joins that namespace and nothing else: `ip netns exec`
    and `ip -n` first make / a slave mount, which fails where / is not a
    mount point (a chroot, such as a freshly debootstrapped Debian)."""
    return ["nsenter", "--net=/run/netns/" + ns, *cmd]


def ip_argv(*args):
    """argv of `ip ARGS`, with a leading `-n NS` run through in_netns()."""
    if len(args) >= 2 and args[0] == "-n":
        return in_netns(args[1], "ip", *args[2:])
    return ["ip", *args]


def private_mounts_problem():
    """None if this process can make a mount namespace whose mounts stay
    its own (`unshare -m --propagation private`); else why not: not root,
    no unshare(1), or / is not a mount point (a chroot)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare(1)"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        return "no private mount namespace here (/ is not a mount point, as in a chroot): " + r.stderr.strip()
    return None


def free_ports(n, host="127.0.0.1"):
    """n distinct ports nothing listened on a moment ago (bound at once, then
    closed: another process may still take one before the shard does, so
    callers that pick ports first retry on ServerExited "cannot listen")."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ServerExited(RuntimeError):
    """factorps-server exited before it listened: its exit code and log."""

    def __init__(self, code, err):
        super().__init__("factorps-server exited with %d before it listened: %s" % (code, err))
        self.code, self.err = code, err


def _die_with_parent():
    """Child side: SIGTERM the shard when the test process dies, so a killed
    test leaves no shard behind."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (FileNotFoundError, ValueError):
        return None  # not written, or not complete yet


class ShardProcess:
    """One factorps-server process: `args` after --listen/--port-file.

    dir/name: where the port file (NAME.port) and the log (NAME.log, opened
    for appending, so a restarted shard keeps one log) go; by default a
    fresh temporary directory that remove() deletes. metrics_listen adds
    --metrics-listen and waits for the metrics port too. first_line: the
    server's stdout is a pipe and its first line (the "listening on" line)
    is read into first_line; otherwise stdout and stderr both go to the
    log. prefix runs the server through another command (ip netns exec).

    Raises ServerExited if the process exits before it listened, and
    RuntimeError if it writes no port within `timeout` seconds (it is
    killed then)."""

    def __init__(self, args=(), *, server=None, listen="127.0.0.1:0", metrics_listen=None, env=None,
                 prefix=(), timeout=30, dir=None, name="shard", first_line=False,
                 die_with_parent=False):
        self.own_dir = dir is None
        self.dir = dir if dir is not None else tempfile.mkdtemp(prefix="fps-server-")
        self.port_file = os.path.join(self.dir, name + ".port")
        self.metrics_port_file = os.path.join(self.dir, name + ".metrics-port")
        self.log_path = os.path.join(self.dir, name + ".log")
        for f in (self.port_file, self.metrics_port_file):
            if os.path.exists(f):
                os.unlink(f)
        self.host = listen.rsplit(":", 1)[0]
        cmd = [*prefix, server or SERVER, "--listen", listen, "--port-file", self.port_file]
        if metrics_listen is not None:
            cmd += ["--metrics-listen", metrics_listen, "--metrics-port-file", self.metrics_port_file]
        cmd += [str(a) for a in args]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if first_line else self.log,
                                     stderr=self.log if first_line else subprocess.STDOUT,
                                     env=server_env(env),
                                     preexec_fn=_die_with_parent if die_with_parent else None)
        end = time.monotonic() + timeout
        while True:
            self.port = _read_int(self.port_file)
            self.metrics_port = _read_int(self.metrics_port_file) if metrics_listen is not None else None
            if self.port is not None and (metrics_listen is None or self.metrics_port is not None):
                break
            if self.proc.poll() is not None:
                err = self.stderr()
                self._close_files()
                self.remove()
                raise ServerExited(self.proc.returncode, err)
            if time.monotonic() > end:
                self.kill()
                raise RuntimeError("factorps-server wrote no port within %g s:\n%s"
                                   % (timeout, self.stderr()[-4000:]))
            time.sleep(0.02)
        self.addr = "%s:%d" % (self.host, self.port)
        self.first_line = self.proc.stdout.readline().decode() if first_line else None

    def stderr(self):
        """The whole log (stderr, and stdout unless first_line)."""
        if not self.log.closed:
            self.log.flush()
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return "(log removed)"

    def sanitizer_report(self):
        """The log if a sanitizer reported anything in it, else None."""
        err = self.stderr()
        return err if any(m in err for m in SANITIZER_MARKERS) else None

    def _close_files(self):
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if not self.log.closed:
            self.log.close()

    def kill(self, sig=signal.SIGKILL, timeout=10):
        """Sends `sig` (SIGKILL: no checkpoint, no clean exit) and waits,
        escalating to SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._close_files()

    def terminate(self, timeout=60):
        """SIGTERM and the exit code, or None if it did not exit within
        `timeout` seconds (it is SIGKILLed then)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        self._close_files()
        return rc

    def remove(self):
        """Deletes the temporary directory this process made (not a dir
        the caller gave)."""
        if self.own_dir:
            shutil.rmtree(self.dir, True)

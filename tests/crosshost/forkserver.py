# SPDX-License-Identifier: BSD-3-Clause
"""A fork server for the Python programs that netns.Hosts.run starts inside a
host (`python -m module ...`, `python -c code ...`, `python script.py ...`),
so that each does not import torch afresh: ~2 s of CPU per interpreter (4 s
where no .pyc had been written), and the cross-host tests start about 60.

The server imports numpy, torch and torch_rpc_ext once, runs no torch compute
and starts no thread (so a fork copies no half-held lock; see
torch_rpc_ext/_preloaded.py), and forks a child per request. What runs under
`ip netns exec NS timeout ...` is fork_client.py (stdlib only, ~20 ms): it
sends its argv, environment, directory, fds 0-2 and network namespace
(/proc/self/ns/net). The child takes the fds, joins that namespace (setns),
starts a session of its own, takes the environment and directory, and runs
the program as `__main__`, ending as an interpreter does (non-daemon
threads joined, atexit handlers, libc's exit()). The client then exits as
the program did (its code, or the same signal), so the test's Popen,
`timeout` and Hosts.close see what they would of the program itself.
Signals the client gets (SIGTERM from `timeout`, SIGINT, ...) go to the
child's process group; a client that dies (SIGKILL from Hosts.close or
`timeout --kill-after`) takes that group with it, and a child dies with the
server (PR_SET_PDEATHSIG), which ends when the process that started it does
(its stdin closes).

What an interpreter reads only as it starts or while importing numpy, torch
or torch_rpc_ext (PYTHON* flags, PYTHONPATH's effect on those imports) is
the server's; PYTHONPATH's entries and the program's directory are put
first on sys.path as Python would. The child keeps the server's mount
namespace (`ip netns exec` also remounts /sys for the namespace; nothing
here reads /sys/class/net: getifaddrs, /proc/self/ns/net and /proc/sys/net
follow setns). `TORCH_RPC_EXT_TEST_START=spawn` starts fresh interpreters.
"""

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("numpy", "torch", "torch_rpc_ext")
CLIENT = Path(__file__).with_name("fork_client.py")
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MAX_REQUEST = 1 << 20
_server: tuple[subprocess.Popen, str] | None = None


def send(sock: socket.socket, obj, fds=()) -> None:
    """One message: a 4-byte length, then JSON (with fds, SCM_RIGHTS)."""
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def take(buf: bytearray):
    """The first whole message in buf (removed from it), or None."""
    if len(buf) < 4:
        return None
    (size,) = struct.unpack("!I", buf[:4])
    if size > MAX_REQUEST:
        raise ValueError(f"a message of {size} bytes")
    if len(buf) < 4 + size:
        return None
    obj = json.loads(bytes(buf[4 : 4 + size]))
    del buf[: 4 + size]
    return obj


# Used by netns.Hosts.run.


def wanted(argv, env) -> bool:
    """Whether argv runs under the fork server: the forms `python -m`,
    `python -c` and `python script.py` (no interpreter flags)."""
    if (os.environ if env is None else env).get("TORCH_RPC_EXT_TEST_START", "") == "spawn":
        return False
    return len(argv) > 1 and argv[0] == sys.executable and (
        argv[1] in ("-m", "-c") or not argv[1].startswith("-"))


def client_argv(argv) -> list[str]:
    """The client's command line for argv (the server started on first use;
    it ends with this process)."""
    global _server
    if _server is None or _server[0].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="trxh-fork"), "socket")
        proc = subprocess.Popen([sys.executable, str(Path(__file__)), path],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                cwd=Path(__file__).resolve().parents[2])
        if proc.stdout.readline().strip() != b"ready":
            proc.kill()
            raise RuntimeError(f"the fork server did not start (exit {proc.wait()})")
        _server = (proc, path)
    return [sys.executable, str(CLIENT), _server[1], "--", *argv[1:]]


# The child.


def _run_program(args: list[str]) -> int:
    """Run args (what follows `python`) as __main__; its exit code."""
    import runpy
    import traceback
    import types

    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _child(request: dict, fds: list[int], server_fds: list[int], server_dir: str) -> None:
    """In the forked child: become the program the client was started as."""
    libc = ctypes.CDLL(None, use_errno=True)
    code = 1
    try:
        for fd in server_fds:
            os.close(fd)
        for fd, to in zip(fds[:3], (0, 1, 2)):
            os.dup2(fd, to)  # first: what goes wrong below is told the test
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                  signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGPIPE, signal.SIGXFSZ):  # as Python starts
            signal.signal(s, signal.SIG_IGN)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            raise RuntimeError("the fork server died")
        os.setsid()
        if libc.setns(fds[3], CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        args = request["args"]
        first = {"-m": request["cwd"], "-c": ""}.get(args[0]) or os.path.dirname(
            os.path.abspath(args[0]))
        if sys.path and sys.path[0] == server_dir:
            del sys.path[0]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [first, *extra]
        code = _run_program(args)
        import atexit
        import threading

        threading._shutdown()  # as an interpreter's exit: non-daemon threads first
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        print("forkserver: the child could not become the program:", file=sys.stderr)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # libc's exit(): C atexit handlers and static destructors run, as at
        # an interpreter's exit (a crash there fails the test). Without the
        # GIL (CDLL), as _preloaded.py's children: a destructor that joins
        # a thread which needs the GIL to end would wait for ever with it.
        libc.exit(code & 0xFF)


# The server.


def _kill(pid: int, sig: int) -> None:
    """sig to pid's group, or to pid before its setsid() made one."""
    for fn in (os.killpg, os.kill):
        try:
            return fn(pid, sig)
        except ProcessLookupError:
            pass


class _Server:
    def __init__(self, path: str):
        self.path = path
        self.dir = sys.path[0]
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", 0))
        self.sel.register(sys.stdin, selectors.EVENT_READ, ("parent", 0))
        self.children = {}  # pid -> [conn, pidfd, buffer]

    def serve(self) -> None:
        print("ready", flush=True)
        while True:
            for key, _ in self.sel.select():
                what, pid = key.data
                try:
                    if what == "parent":
                        if not os.read(sys.stdin.fileno(), 4096):  # the test run is over
                            return self.close()
                    elif what == "accept":
                        self.accept()
                    elif pid in self.children:
                        (self.reap if what == "exit" else self.forward)(pid)
                except Exception as e:  # one request's trouble, not the server's
                    print(f"forkserver: {what} {pid}: {e!r}", file=sys.stderr)
                    if pid in self.children:
                        _kill(pid, signal.SIGKILL)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        fds = []
        try:
            conn.settimeout(10)
            buf = bytearray()
            request = None
            while request is None:
                msg, got, _, _ = socket.recv_fds(conn, 65536, 8)
                fds += got
                if not msg:
                    raise EOFError("the client went before its request")
                buf += msg
                request = take(buf)
            if len(fds) != 4 or not request.get("args"):
                raise ValueError(f"a request with {len(fds)} fds: {request!r}")
            conn.settimeout(None)
            pid = os.fork()
        except Exception:
            for fd in fds:
                os.close(fd)
            conn.close()
            raise
        if pid == 0:
            server_fds = [self.sel.fileno(), self.listener.fileno(), conn.fileno()]
            for c, pidfd, _ in self.children.values():
                server_fds += [c.fileno(), pidfd]
            _child(request, fds, server_fds, self.dir)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            _kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            conn.close()
            raise
        self.children[pid] = [conn, pidfd, buf]  # buf: signals sent with the request
        self.sel.register(conn, selectors.EVENT_READ, ("client", pid))
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        self._signals(pid)

    def _signals(self, pid: int) -> None:
        buf = self.children[pid][2]
        while (msg := take(buf)) is not None:
            _kill(pid, msg["signal"])

    def forward(self, pid: int) -> None:
        """A signal from the client, or its end."""
        conn, _, buf = self.children[pid]
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:  # the client died: so does the program
            self.sel.unregister(conn)
            _kill(pid, signal.SIGKILL)
            return
        buf += data
        self._signals(pid)

    def reap(self, pid: int) -> None:
        conn, pidfd, _ = self.children.pop(pid)
        _kill(pid, signal.SIGKILL)  # what it left in its group (a zombie keeps the id)
        _, status = os.waitpid(pid, 0)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        try:
            send(conn, {"status": status})
        except OSError:
            pass
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        for pid in self.children:
            _kill(pid, signal.SIGKILL)
        os.unlink(self.path)
        os.rmdir(os.path.dirname(self.path))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the test run's
    for name in PRELOAD:
        __import__(name)
    _Server(sys.argv[1]).serve()

# SPDX-License-Identifier: BSD-3-Clause
"""A fork server for Python programs started inside a host's network
namespace (netns.Hosts.run): `python -m module ...`, `python -c code ...` or
`python script.py ...` without a fresh import of torch each.

An interpreter that imports torch spends ~2 s of CPU doing it (4 s where no
.pyc had been written); the cross-host tests start about 60 such workers.
The server imports numpy, torch and torch_rpc_ext once, runs no torch
compute and starts no thread (so a fork copies no half-held lock; see
torch_rpc_ext/_preloaded.py), and forks a child per request.

What runs under `ip netns exec NS timeout ...` is the client (this file,
`--client`, stdlib only: ~20 ms): it sends the server its argv, environment,
working directory, its fds 0-2 and its network namespace (/proc/self/ns/net)
and waits. The server's child joins that namespace (setns), takes the fds,
environment and directory, and runs the program as `__main__`; when it ends,
the client exits as it did (its code, or the same signal), so the test's
Popen, `timeout` and Hosts.close see what they would of the program itself.
Signals the client is sent (SIGTERM from `timeout`, SIGINT, ...) go to the
child's process group; a client that dies (SIGKILL from Hosts.close or from
`timeout --kill-after`) takes the child's group with it, and a child dies
with the server (PR_SET_PDEATHSIG). What an interpreter reads only as it
starts or while importing numpy, torch or torch_rpc_ext (PYTHON* flags,
PYTHONPATH's effect on those imports) is the server's; PYTHONPATH's entries
and the program's directory are put first on sys.path as Python would.
"""

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import sys

PRELOAD = ("numpy", "torch", "torch_rpc_ext")
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
MAX_REQUEST = 1 << 20


def _send(sock: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


# The client.

def client(path: str, args: list[str]) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    _send(sock, {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2, netns])
    os.close(netns)

    def forward(signum, _frame):
        try:
            _send(sock, {"signal": signum})
        except OSError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    try:
        (size,) = struct.unpack("!I", _recv_exact(sock, 4))
        reply = json.loads(_recv_exact(sock, size))
    except (EOFError, OSError) as e:
        print(f"forkserver client: the server closed before the program ended ({e!r})",
              file=sys.stderr)
        return 1
    if "error" in reply:
        print(f"forkserver: {reply['error']}", file=sys.stderr)
        return 1
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


# The server.

def _run_program(args: list[str]) -> int:
    """Run args (what follows `python`) as the interpreter would, as
    __main__; its exit code."""
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


def _child(request: dict, fds: list[int], server_fds: list[int]) -> None:
    """In the forked child: become the program the client was started as."""
    libc = ctypes.CDLL(None, use_errno=True)
    code = 1
    try:
        for fd in server_fds:
            os.close(fd)
        for s in (*FORWARDED, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setpgid(0, 0)
        if libc.setns(fds[3], CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
        for fd, to in zip(fds[:3], (0, 1, 2)):
            os.dup2(fd, to)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        args = request["args"]
        first = request["cwd"] if args[0] in ("-m", "-c") else os.path.dirname(
            os.path.abspath(args[0]))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [first, *extra]
        code = _run_program(args)
        import atexit

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
        # an interpreter's exit (a crash there fails the test).
        libc.exit(code & 0xFF)


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    children = {}  # pid -> (conn, pidfd)
    by_conn = {}  # conn -> pid
    print("ready", flush=True)

    def kill(pid, sig):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    while True:
        for key, _ in sel.select():
            what = key.data
            if what == "parent":  # the test run is over
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in children:
                        kill(pid, signal.SIGKILL)
                    return
            elif what == "accept":
                conn, _ = listener.accept()
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 8)
                    (size,) = struct.unpack("!I", msg[:4])
                    while len(msg) < 4 + size:
                        more = conn.recv(4 + size - len(msg))
                        if not more:
                            raise EOFError("request cut short")
                        msg += more
                    request = json.loads(msg[4:4 + size])
                    if len(fds) != 4 or not request.get("args"):
                        raise ValueError(f"a request with {len(fds)} fds and {request!r}")
                except (OSError, ValueError, EOFError) as e:
                    try:
                        _send(conn, {"error": f"bad request: {e}"})
                    except OSError:
                        pass
                    conn.close()
                    continue
                server_fds = [sel.fileno(), listener.fileno(), conn.fileno()] + [
                    c.fileno() for c in by_conn] + [p for _, p in children.values()]
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, server_fds)
                try:
                    os.setpgid(pid, pid)  # as the child does: a signal may come first
                except OSError:
                    pass
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pid] = (conn, pidfd)
                by_conn[conn] = pid
                sel.register(conn, selectors.EVENT_READ, ("client", pid))
                sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
            elif what[0] == "client":  # a forwarded signal, or the client died
                pid = what[1]
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    kill(pid, signal.SIGKILL)
                    continue
                while len(data) >= 4:
                    (size,) = struct.unpack("!I", data[:4])
                    kill(pid, json.loads(data[4:4 + size])["signal"])
                    data = data[4 + size:]
            else:  # the child exited
                pid = what[1]
                conn, pidfd = children.pop(pid)
                _, status = os.waitpid(pid, 0)
                kill(pid, signal.SIGKILL)  # what it left in its group
                sel.unregister(pidfd)
                os.close(pidfd)
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                if by_conn.pop(conn, None) is not None:
                    try:
                        sel.unregister(conn)
                    except KeyError:
                        pass
                conn.close()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "--client" and sys.argv[3] == "--":
        sys.exit(client(sys.argv[2], sys.argv[4:]))
    else:
        sys.exit("usage: forkserver.py --serve PATH | --client PATH -- PYTHON-ARGS...")

# SPDX-License-Identifier: BSD-3-Clause
"""`fork_client.py SOCKET -- PYTHON-ARGS...`: run PYTHON-ARGS (what would follow
`python`) as a child of forkserver.py's server at SOCKET, in this process's
network namespace, with its stdin, stdout, stderr, environment and
directory; exit as the program did. Signals this process gets are passed on
to the program. What netns.Hosts.run starts inside a host (forkserver.py
says why); stdlib only, so it starts in milliseconds."""

import os
import signal
import socket
import struct
import sys

from forkserver import send, take  # this file's directory is sys.path[0]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def main(path: str, args: list[str]) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)

    def forward(signum, _frame):
        try:
            send(sock, {"signal": signum})
        except OSError:
            pass

    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    send(sock, {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2, netns])
    os.close(netns)
    for s in FORWARDED:  # (after the request: a signal's frame never comes first)
        signal.signal(s, forward)
    buf = bytearray()
    try:
        while (reply := take(buf)) is None:
            data = sock.recv(4096)
            if not data:
                raise EOFError("no answer")
            buf += data
    except (EOFError, OSError, ValueError, struct.error) as e:
        print(f"fork_client: the fork server closed before the program ended ({e})",
              file=sys.stderr)
        return 1
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: fork_client.py SOCKET -- PYTHON-ARGS...")
    sys.exit(main(sys.argv[1], sys.argv[3:]))

# SPDX-License-Identifier: BSD-3-Clause
"""The backend's log lines in Python's ``logging`` (docs/observability.md, "Logs").

The agent logs from its own threads (connections refused or lost, peers
declared dead, ...), in C++ and without the GIL. By default each line goes to
stderr as text (``TORCH_RPC_EXT_LOG_FORMAT=json``: one JSON object a line).
``to_python()`` hands them to a logger instead, so that the handlers and
formatters a program already has (JSON, syslog, a log shipper) take them::

    import logging, torch_rpc_ext.logs
    logging.basicConfig(format="%(asctime)s %(name)s %(worker)s %(levelname)s %(message)s")
    torch_rpc_ext.logs.to_python()

``TORCH_RPC_EXT_LOG_FORMAT=python`` does the same at import, for programs
that are not changed (the launcher's). Each record is made for the logger
(``torch_rpc_ext`` unless named) with the line's own time, its level
(WARNING, or DEBUG with ``TORCH_RPC_EXT_LOG=debug`` or a logger enabled for
DEBUG when ``to_python`` was called), and ``worker``: the name of the worker
this process runs (None before ``init_rpc``). One thread of ours takes the
lines (they wait in a queue of 10,000 at most; more are dropped and
counted, and a warning says how many). While the logger has no handler,
nor any logger above it (where Python would write the bare message), the
lines go to stderr as they would unrouted: time, worker and pid kept. A
forked child routes its lines too; at exit, lines go to stderr again once
those queued were handed over.
"""

import atexit
import logging
import os
import sys
import threading
import time
from typing import Optional, Union

from torch_rpc_ext import _C

__all__ = ["LOGGER_NAME", "to_python", "to_stderr", "routed_to"]

LOGGER_NAME = "torch_rpc_ext"
_PREFIX = "torch_rpc_ext: "
_BATCH = 256
_WAIT_MS = 200

_lock = threading.Lock()
# (thread, stop, logger) while routed.
_drain = None
_hooks = False
# Reports a handler's failure as logging does (handleError), for our thread.
_failures = logging.Handler()


def to_python(logger: Union[logging.Logger, str, None] = None) -> logging.Logger:
    """Send the backend's log lines to ``logger`` (a Logger or its name;
    default ``logging.getLogger("torch_rpc_ext")``) rather than stderr.
    Returns the logger. Calling it again moves them to another logger."""
    if logger is None:
        logger = logging.getLogger(LOGGER_NAME)
    elif isinstance(logger, str):
        logger = logging.getLogger(logger)
    elif not isinstance(logger, logging.Logger):
        raise TypeError(
            "torch_rpc_ext.logs.to_python takes a logging.Logger or a logger's "
            f"name, not {type(logger).__name__}"
        )
    with _lock:
        left = _stop_locked()
        _start_locked(logger)
        _install_hooks_locked()
    _emit_left(left)
    return logger


def to_stderr() -> None:
    """Write the backend's log lines to stderr again (the default), once the
    lines already queued for the logger were handed to it."""
    with _lock:
        left = _stop_locked()
    _emit_left(left)


def routed_to() -> Optional[logging.Logger]:
    """The logger the lines go to, or None while they go to stderr."""
    drain = _drain
    return None if drain is None else drain[2]


def _start_locked(logger: logging.Logger) -> None:
    global _drain
    stop = threading.Event()
    _C._logs_route(True, logger.isEnabledFor(logging.DEBUG))
    thread = threading.Thread(
        target=_run, args=(stop, logger), name="torch_rpc_ext-logs", daemon=True
    )
    thread.start()
    _drain = (thread, stop, logger)


def _stop_locked():
    """Stop the thread; returns (logger, lines it left) for _emit_left, which
    runs outside the lock (a handler may log, or take its time)."""
    global _drain
    if _drain is None:
        return None
    thread, stop, logger = _drain
    _drain = None
    # New lines go to stderr from here; the thread hands over the batch it
    # holds, takes no other, and ends. Waited for as long as that takes: a
    # line queued is a line promised to the logger (at exit too, where the
    # daemon thread would otherwise die in the middle of its batch).
    _C._logs_route(False, False)
    stop.set()
    if thread is not threading.current_thread():
        while thread.is_alive():
            thread.join(1)
    return logger, _C._logs_take(1 << 30, 0)


def _emit_left(left) -> None:
    if left is not None:
        logger, (records, dropped) = left
        _emit(logger, records, dropped)


def _run(stop: threading.Event, logger: logging.Logger) -> None:
    while not stop.is_set():
        try:
            records, dropped = _C._logs_take(_BATCH, _WAIT_MS)
        except Exception:  # memory ran out decoding a line: try again
            continue
        _emit(logger, records, dropped)


def _emit(logger: logging.Logger, records, dropped: int) -> None:
    for level, unix_ns, worker, line in records:
        _handle(logger, level, line, worker, unix_ns)
    if dropped:
        _handle(
            logger, logging.WARNING,
            f"{_PREFIX}{dropped} log lines of torch_rpc_ext were dropped: more "
            "than 10000 waited for this logger's thread", "", time.time_ns(),
        )


def _handle(logger, level: int, line: str, worker: str, unix_ns: int) -> None:
    # Nothing a logger, a record factory or a handler raises ends the
    # thread: it is reported as logging reports a handler's failure.
    record = None
    try:
        if not logger.isEnabledFor(level):
            return
        if not logger.hasHandlers():
            # Python's last resort would write the bare message: no time,
            # worker or pid. The line goes as it would have gone unrouted.
            sys.stderr.write(_C._log_line(level, unix_ns, worker, line) + "\n")
            sys.stderr.flush()
            return
        message = line[len(_PREFIX):] if line.startswith(_PREFIX) else line
        record = logger.makeRecord(
            logger.name, level, "torch_rpc_ext", 0, message, (), None
        )
        record.worker = worker or None
        record.threadName = "torch_rpc_ext"
        # The line's own time; relativeCreated moves with it (its unit of
        # reckoning changed in Python 3.13, a difference does not).
        created = unix_ns / 1e9
        record.relativeCreated += (created - record.created) * 1000
        record.created = created
        record.msecs = (unix_ns % 1_000_000_000) / 1e6
        logger.handle(record)
    except Exception:
        _failures.handleError(record)


def _after_fork_in_child() -> None:
    # The parent's thread is not in the child, and the C++ side starts
    # unrouted there (logging.cpp); a lock held at the fork stays held.
    # (os.fork and what calls it, e.g. multiprocessing's fork start method;
    # a fork from C++ alone starts the child's lines on stderr.)
    global _drain, _lock
    _lock = threading.Lock()
    drain, _drain = _drain, None
    if drain is not None:
        with _lock:
            _start_locked(drain[2])


def _install_hooks_locked() -> None:
    global _hooks
    if _hooks:
        return
    _hooks = True
    os.register_at_fork(after_in_child=_after_fork_in_child)
    # Registered after the package's own exit hook, so it runs before it.
    atexit.register(to_stderr)

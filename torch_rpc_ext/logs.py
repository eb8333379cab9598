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
import traceback
from typing import Optional, Union

from torch_rpc_ext import _C

__all__ = ["LOGGER_NAME", "to_python", "to_stderr", "routed_to"]

LOGGER_NAME = "torch_rpc_ext"
_PREFIX = "torch_rpc_ext: "
_BATCH = 256
_WAIT_MS = 200

# Held only briefly, never while waiting for a thread: a handler of ours may
# call to_python() or to_stderr() itself.
_lock = threading.Lock()
_drain = None  # the _Drain while routed
_last = None  # the thread that drained last (a new one waits for it)
_hooks = False
# Reports a handler's failure as logging does (handleError), for our thread.
_failures = logging.Handler()
# How long exit waits for the handlers to take the lines still queued.
_EXIT_WAIT_S = 10.0


class _Drain:
    """One thread handing lines to one logger until stopped. Stopped by a
    move to another logger, it leaves the queue to its successor (which
    waits for it to end first, so the order holds); stopped by to_stderr,
    it hands over what is queued (routing is off: nothing more comes)."""

    def __init__(self, logger: logging.Logger, predecessor):
        self.logger = logger
        self.stop = threading.Event()
        self.hand_over_rest = False
        self.thread = threading.Thread(
            target=self._run, args=(predecessor,), name="torch_rpc_ext-logs", daemon=True
        )
        self.thread._torch_rpc_ext_drain = True  # type: ignore[attr-defined]

    def _run(self, predecessor) -> None:
        if predecessor is not None:
            predecessor.join()  # its batch first
        while not self.stop.is_set():
            try:
                records, dropped = _C._logs_take(_BATCH, _WAIT_MS)
            except Exception:  # memory ran out decoding a line: try again
                continue
            _emit(self.logger, records, dropped)
        if self.hand_over_rest:
            _emit(self.logger, *_C._logs_take(1 << 30, 0))


def to_python(logger: Union[logging.Logger, str, None] = None) -> logging.Logger:
    """Send the backend's log lines to ``logger`` (a Logger or its name;
    default ``logging.getLogger("torch_rpc_ext")``) rather than stderr.
    Returns the logger. Calling it again moves them to another logger: the
    lines queued then go to the new one, after those the old one was
    handing over."""
    global _drain, _last
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
        if _drain is not None:
            _drain.stop.set()  # routing stays on: the queue keeps new lines
        _C._logs_route(True, logger.isEnabledFor(logging.DEBUG))
        _drain = _Drain(logger, _last)
        _last = _drain.thread
        _drain.thread.start()
        _install_hooks_locked()
    return logger


def to_stderr() -> None:
    """Write the backend's log lines to stderr again (the default), once the
    lines already queued for the logger were handed to it. (Called by a
    handler of that logger, it returns at once; its thread hands them over
    once the handler returns.)"""
    _to_stderr(None)


def routed_to() -> Optional[logging.Logger]:
    """The logger the lines go to, or None while they go to stderr."""
    drain = _drain
    return None if drain is None else drain.logger


def _to_stderr(wait_s: Optional[float]) -> None:
    global _drain
    with _lock:
        drain, _drain = _drain, None
        if drain is None:
            return
        # New lines go to stderr from here; the thread hands over the batch
        # it holds and those queued, and ends.
        _C._logs_route(False, False)
        drain.hand_over_rest = True
        drain.stop.set()
    # A handler on a drain thread (this one or its predecessor, which the
    # thread waits for) must not wait: the thread ends once it returns.
    if getattr(threading.current_thread(), "_torch_rpc_ext_drain", False):
        return
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while drain.thread.is_alive():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        drain.thread.join(1 if left is None else min(1, left))


def _note(logger: logging.Logger, level: int, message: str, *args,
          exc_info: bool = False) -> None:
    """A record of the package's Python modules (``torch_rpc_ext.elastic``,
    ``torch_rpc_ext._torch_private``; children of ``torch_rpc_ext``). Where
    the program's logging has a handler for ``logger``, the record goes to
    it, as any module's would. With none (where Python's last resort would
    write the bare message), it is a line of the core's: in the format
    ``TORCH_RPC_EXT_LOG_FORMAT`` picks, with time, worker and pid, silenced
    by ``TORCH_RPC_EXT_LOG=off`` (``error`` keeps errors), and routed as
    the core's lines are (a traceback, if any, in the message). The
    program's levels apply either way (``logger.isEnabledFor``)."""
    if not logger.isEnabledFor(level):
        return  # the program's levels, or logging.disable(), said no
    if logger.hasHandlers():
        try:
            logger.log(level, message, *args, exc_info=exc_info)
        except Exception:  # a handler that raised: said, and we go on
            _failures.handleError(None)
        return
    # Nothing raises from here (the membership thread calls this in its
    # except block: it would end the thread).
    try:
        text = message % args if args else message
    except Exception:  # an argument whose str() or repr() raises
        text = f"{message} (its {len(args)} argument(s) failed to format)"
    if exc_info:
        text += "\n" + traceback.format_exc().rstrip("\n")
    # Bytes: what UTF-8 cannot hold (a lone surrogate in an exception's
    # text) is escaped in the line rather than raising here.
    _C._log(logging.ERROR if level >= logging.ERROR else logging.WARNING, b"",
            text.encode("utf-8", "backslashreplace"))


def _at_exit() -> None:
    # A line queued is a line promised to the logger: exit waits for the
    # handlers to take them, for _EXIT_WAIT_S at most (a handler stuck on a
    # dead destination would hold the exit for good); what is still queued
    # then goes to stderr.
    _to_stderr(_EXIT_WAIT_S)
    records, dropped = _C._logs_take(1 << 30, 0)
    for level, unix_ns, worker, line in records:
        sys.stderr.write(_C._log_line(level, unix_ns, worker, line) + "\n")
    sys.stderr.flush()


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
        if not logger.hasHandlers():
            # Python's last resort would write the bare message: no time,
            # worker or pid. The line goes as it would have gone unrouted
            # (TORCH_RPC_EXT_LOG chose it: the core made it).
            sys.stderr.write(_C._log_line(level, unix_ns, worker, line) + "\n")
            sys.stderr.flush()
            return
        if not logger.isEnabledFor(level):
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
    global _drain, _last, _lock
    _lock = threading.Lock()
    drain, _drain, _last = _drain, None, None
    if drain is not None:
        to_python(drain.logger)
        # multiprocessing's children leave by os._exit(), past atexit: the
        # lines still queued are handed over by a finalizer of theirs
        # (registered after the fork's own clean-up of the finalizers).
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.register_after_fork(_FORK_TOKEN, _finalize_in_mp_child)


class _Token:
    pass


_FORK_TOKEN = _Token()


def _finalize_in_mp_child(_token) -> None:
    sys.modules["multiprocessing.util"].Finalize(None, _at_exit, exitpriority=0)


def _install_hooks_locked() -> None:
    global _hooks
    if _hooks:
        return
    _hooks = True
    os.register_at_fork(after_in_child=_after_fork_in_child)
    # Registered after the package's own exit hook, so it runs before it.
    atexit.register(_at_exit)

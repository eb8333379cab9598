# SPDX-License-Identifier: BSD-3-Clause
"""The agent's log lines: what each says (time, level, worker, pid), as text,
as JSON, or handed to Python's logging (torch_rpc_ext.logs;
docs/observability.md, "Logs"). The lines come from a real agent refusing a
stranger's bytes, in a process of its own (the log settings are read once a
process), or from a thread of ours through _testing.log."""

import calendar
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import torch_rpc_ext
from torch_rpc_ext import _C, _testing

SECRET = "0123456789abcdefghijklmnopqrstuv"

# One worker that refuses a connection whose first bytes are not ours, then
# prints what its Python logger got (with TORCH_RPC_EXT_LOG_FORMAT=python).
SOLO = textwrap.dedent(
    f"""
    import json, logging, os, socket, sys, time
    got = []
    class Keep(logging.Handler):
        def emit(self, record):
            got.append(dict(name=record.name, level=record.levelno, created=record.created,
                            worker=record.worker, message=record.getMessage(),
                            thread=record.threadName))
    logging.getLogger("torch_rpc_ext").addHandler(Keep())
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(torch_rpc_ext.free_port())
    rpc.init_rpc("solo", rank=0, world_size=1, backend=rpc.BackendType.TORCH_RPC_EXT,
                 rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(secret="{SECRET}"))
    host, port = rpc.api._get_current_rpc_agent().address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"not a handshake" * 8)
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline and torch_rpc_ext.logs.routed_to():
        time.sleep(0.05)
    if not torch_rpc_ext.logs.routed_to():
        time.sleep(1)
    s.close()
    rpc.shutdown()
    print("GOT " + json.dumps(got), flush=True)
    """
)


def quiet_env(**env):
    """This process's environment without the log settings a developer may
    have set, plus ``env``."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("TORCH_RPC_EXT_LOG", "TORCH_RPC_EXT_LOG_FORMAT")}
    return {**base, **env}


def run_solo(env, timeout=90):
    env = quiet_env(TORCH_RPC_EXT_TRANSPORTS="tcp", **env)
    before = time.time()
    out = subprocess.run([sys.executable, "-c", SOLO], capture_output=True, text=True,
                         env=env, timeout=timeout)
    return out, before, time.time()


def refusals(stderr):
    return [line for line in stderr.splitlines() if "refused connection" in line]


def test_a_warning_says_its_time_worker_and_pid_as_text():
    out, before, after = run_solo({})
    assert out.returncode == 0, out.stderr
    lines = refusals(out.stderr)
    assert lines, out.stderr
    m = re.match(
        r"\[W (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z solo pid=(\d+)\] "
        r"torch_rpc_ext: solo refused connection tcp from 127\.0\.0\.1:\d+: .*bad magic",
        lines[0],
    )
    assert m, lines[0]
    stamp = calendar.timegm(time.strptime(m.group(1)[:19], "%Y-%m-%dT%H:%M:%S"))
    assert before - 1 <= stamp <= after + 1
    assert int(m.group(2)) > 0


def test_a_warning_is_one_json_object_with_format_json():
    out, before, after = run_solo({"TORCH_RPC_EXT_LOG_FORMAT": "json"})
    assert out.returncode == 0, out.stderr
    lines = [line for line in refusals(out.stderr) if line.startswith("{")]
    assert lines, out.stderr
    rec = json.loads(lines[0])
    assert set(rec) == {"time", "level", "logger", "worker", "pid", "message"}
    assert (rec["level"], rec["logger"], rec["worker"]) == ("warning", "torch_rpc_ext", "solo")
    assert rec["message"].startswith("solo refused connection tcp from 127.0.0.1:")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", rec["time"])
    stamp = calendar.timegm(time.strptime(rec["time"][:19], "%Y-%m-%dT%H:%M:%S"))
    assert before - 1 <= stamp <= after + 1
    assert isinstance(rec["pid"], int) and rec["pid"] > 0


def test_a_warning_goes_to_pythons_logging_with_format_python():
    out, before, after = run_solo({"TORCH_RPC_EXT_LOG_FORMAT": "python"})
    assert out.returncode == 0, out.stderr
    # Handed to the logger, not written to stderr.
    assert not refusals(out.stderr), out.stderr
    got = json.loads(out.stdout.split("GOT ", 1)[1])
    rec = next(r for r in got if "refused connection" in r["message"])
    assert rec["name"] == "torch_rpc_ext"
    assert rec["level"] == logging.WARNING
    assert rec["worker"] == "solo"
    assert rec["message"].startswith("solo refused connection tcp from 127.0.0.1:")
    assert rec["thread"] == "torch_rpc_ext"
    assert before - 1 <= rec["created"] <= after + 1


@pytest.mark.parametrize(
    "name,value,said",
    [
        ("TORCH_RPC_EXT_LOG", "verbose", "TORCH_RPC_EXT_LOG='verbose' is not a log level"),
        ("TORCH_RPC_EXT_LOG_FORMAT", "xml", "TORCH_RPC_EXT_LOG_FORMAT='xml' is not a log format"),
    ],
)
def test_a_log_setting_that_is_not_known_fails_init_rpc_naming_it(name, value, said):
    out, _, _ = run_solo({name: value})
    assert out.returncode != 0
    assert said in out.stderr, out.stderr[-2000:]


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def logger():
    # The level is read once a process: these tests need the default.
    if os.environ.get("TORCH_RPC_EXT_LOG", "warning") != "warning" or os.environ.get(
        "TORCH_RPC_EXT_LOG_FORMAT", "text"
    ) != "text":
        pytest.skip("TORCH_RPC_EXT_LOG or _FORMAT is set in this process's environment")
    log = logging.getLogger("torch_rpc_ext.test_logs")
    log.propagate = False
    keep = Keep()
    log.addHandler(keep)
    log.setLevel(logging.WARNING)
    yield log, keep
    torch_rpc_ext.logs.to_stderr()
    log.removeHandler(keep)


def test_lines_come_in_order_and_to_stderr_again_once_unrouted(logger, capfd):
    log, keep = logger
    assert torch_rpc_ext.logs.to_python(log) is log
    assert torch_rpc_ext.logs.routed_to() is log
    _testing.log(True, "torch_rpc_ext: one", 3)
    # A debug line is not made for a logger at WARNING.
    _testing.log(False, "torch_rpc_ext: quiet")
    torch_rpc_ext.logs.to_stderr()
    assert torch_rpc_ext.logs.routed_to() is None
    assert [r.getMessage() for r in keep.records] == ["one"] * 3
    assert all(r.levelno == logging.WARNING and r.name == log.name for r in keep.records)
    assert "torch_rpc_ext: one" not in capfd.readouterr().err
    _testing.log(True, "torch_rpc_ext: after")
    assert "torch_rpc_ext: after" in capfd.readouterr().err
    assert len(keep.records) == 3


def test_lines_keep_their_order_when_moved_to_another_logger(logger, capfd):
    log, keep = logger
    other = Keep()
    log2 = logging.getLogger("torch_rpc_ext.test_logs.other")
    log2.propagate = False
    log2.addHandler(other)
    try:
        torch_rpc_ext.logs.to_python(log)
        for n in range(3000):
            _testing.log(True, f"torch_rpc_ext: {n}")
            if n % 500 == 250:  # to the other logger and back, lines in flight
                torch_rpc_ext.logs.to_python(log2 if n % 1000 == 250 else log)
        torch_rpc_ext.logs.to_stderr()
    finally:
        log2.removeHandler(other)
    got = sorted(keep.records + other.records, key=lambda r: r.created)
    assert [r.getMessage() for r in got] == [str(n) for n in range(3000)]
    # None went to stderr while the lines moved.
    assert "torch_rpc_ext: " not in capfd.readouterr().err


def test_debug_lines_are_made_for_a_logger_enabled_for_debug(logger):
    log, keep = logger
    log.setLevel(logging.DEBUG)
    torch_rpc_ext.logs.to_python(log)
    _testing.log(False, "torch_rpc_ext: detail")
    torch_rpc_ext.logs.to_stderr()
    assert [(r.levelno, r.getMessage()) for r in keep.records] == [(logging.DEBUG, "detail")]


def test_lines_more_than_the_queue_holds_are_counted_and_said(logger):
    log, keep = logger
    # Routed with no one taking: the queue fills.
    _C._logs_route(True, False)
    try:
        _testing.log(True, "torch_rpc_ext: flood", 10_003)
    finally:
        torch_rpc_ext.logs.to_python(log)  # the thread takes what waited
    torch_rpc_ext.logs.to_stderr()
    messages = [r.getMessage() for r in keep.records]
    assert messages.count("flood") == 10_000
    assert messages.count(
        "3 log lines of torch_rpc_ext were dropped: more than 10000 waited for this "
        "logger's thread"
    ) == 1
    assert len(messages) == 10_001


# A program whose lines go to logger "x", written on stdout with their pid.
TO_STDOUT = textwrap.dedent(
    """
    import logging, sys
    import torch_rpc_ext
    from torch_rpc_ext import _testing
    log = logging.getLogger("x")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(process)d %(message)s"))
    log.addHandler(h)
    torch_rpc_ext.logs.to_python(log)
    """
)


def test_a_forked_child_hands_its_lines_to_the_logger_too():
    code = TO_STDOUT + textwrap.dedent(
        """
        import os
        pid = os.fork()
        if pid == 0:
            _testing.log(True, "torch_rpc_ext: from the child")
            torch_rpc_ext.logs.to_stderr()
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        _testing.log(True, "torch_rpc_ext: from the parent")
        torch_rpc_ext.logs.to_stderr()
        print("child", pid)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=quiet_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    child = lines[-1].split()[1]
    assert f"{child} from the child" in lines, out.stdout
    assert any(line.endswith(" from the parent") and not line.startswith(child)
               for line in lines), out.stdout
    assert "from the" not in out.stderr


def test_a_multiprocessing_fork_child_hands_over_its_last_lines():
    """multiprocessing's children leave by os._exit(), past atexit."""
    code = TO_STDOUT + textwrap.dedent(
        """
        import multiprocessing as mp
        def child(n):
            _testing.log(True, f"torch_rpc_ext: last {n}", 200)
        procs = [mp.get_context("fork").Process(target=child, args=(n,)) for n in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print("codes", [p.exitcode for p in procs], flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=quiet_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "codes [0, 0, 0]" in out.stdout, out.stdout
    for n in range(3):
        assert sum(line.endswith(f" last {n}") for line in out.stdout.splitlines()) == 200
    assert "last" not in out.stderr


def test_json_strings_escape_what_json_cannot_hold():
    text = b'a"b\\c\n\x01\x7f caf\xc3\xa9 \xff \xed\xa0\x80 \xf0\x9f\x98\x80'
    out = _testing.log_json_string(text)
    assert out == (
        b'"a\\"b\\\\c\\n\\u0001\\u007f caf\xc3\xa9 \\ufffd \\ufffd\\ufffd\\ufffd '
        b'\xf0\x9f\x98\x80"'
    )
    assert json.loads(out) == 'a"b\\c\n\x01\x7f café \ufffd \ufffd\ufffd\ufffd \U0001f600'


def test_a_logger_with_no_handler_gets_the_line_as_it_would_go_unrouted():
    """A program that never set up logging: Python's last resort would write
    the bare message, without time, worker or pid."""
    code = textwrap.dedent(
        """
        import logging, sys
        import torch_rpc_ext
        from torch_rpc_ext import _testing
        torch_rpc_ext.logs.to_python()
        _testing.log(True, "torch_rpc_ext: nobody set up logging")
        torch_rpc_ext.logs.to_stderr()
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
        torch_rpc_ext.logs.to_python()
        _testing.log(True, "torch_rpc_ext: now a handler takes it")
        torch_rpc_ext.logs.to_stderr()
        """
    )
    for fmt in ("text", "json"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=quiet_env(TORCH_RPC_EXT_LOG_FORMAT=fmt), timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "WARNING now a handler takes it\n", out.stdout
        (line,) = out.stderr.splitlines()
        if fmt == "text":
            assert re.fullmatch(
                r"\[W \S+Z - pid=\d+\] torch_rpc_ext: nobody set up logging", line
            ), line
        else:
            rec = json.loads(line)
            assert (rec["worker"], rec["message"]) == (None, "nobody set up logging")


def test_a_failing_record_factory_or_handler_is_reported_and_lines_go_on(logger, capfd):
    log, keep = logger

    class Fails(logging.Handler):
        def emit(self, record):
            if record.getMessage() == "handler fails":
                raise RuntimeError("this handler fails")

    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        if record.msg == "factory fails":
            raise RuntimeError("this factory fails")
        record.worker = "set by the factory"  # ours is set after it
        return record

    fails = Fails()
    log.addHandler(fails)
    logging.setLogRecordFactory(factory)
    try:
        torch_rpc_ext.logs.to_python(log)
        for line in ("factory fails", "handler fails", "after both"):
            _testing.log(True, f"torch_rpc_ext: {line}")
        torch_rpc_ext.logs.to_stderr()
    finally:
        logging.setLogRecordFactory(old_factory)
        log.removeHandler(fails)
    assert [r.getMessage() for r in keep.records] == ["handler fails", "after both"]
    assert all(r.worker is None for r in keep.records)  # no worker in this process
    err = capfd.readouterr().err
    assert "this factory fails" in err and "this handler fails" in err


def test_error_level_silences_debug_lines_for_a_logger_at_debug_too():
    code = textwrap.dedent(
        """
        import logging
        import torch_rpc_ext
        from torch_rpc_ext import _testing
        got = []
        class Keep(logging.Handler):
            def emit(self, record):
                got.append(record.getMessage())
        log = logging.getLogger("x")
        log.setLevel(logging.DEBUG)
        log.addHandler(Keep())
        torch_rpc_ext.logs.to_python(log)
        _testing.log(False, "torch_rpc_ext: detail")
        _testing.log(True, "torch_rpc_ext: warned")
        torch_rpc_ext.logs.to_stderr()
        print("GOT", got)
        """
    )
    for level, want in (("error", "GOT []"), ("warning", "GOT ['detail', 'warned']")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=quiet_env(TORCH_RPC_EXT_LOG=level), timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want, (level, out.stdout)


def test_the_python_packages_notes_are_json_with_format_json():
    """The launcher's note and the one on TensorPipe-only options come from
    the Python package, before the agent exists: with json, they are JSON
    objects as the core's lines are (a log shipper reading JSON lines would
    choke on text), the launcher's naming the worker it is about."""
    code = textwrap.dedent(
        """
        import os
        import torch.distributed.rpc as rpc
        import torch_rpc_ext
        from torch_rpc_ext import _launcher
        _launcher.install()  # what the launcher does in each worker
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(torch_rpc_ext.free_port())
        opts = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])
        rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
        rpc.shutdown()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=quiet_env(TORCH_RPC_EXT_LOG_FORMAT="json"), timeout=90)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(r["worker"], r["message"][:41]) for r in records] == [
        (None, "ignoring TensorPipe-only settings _transp"),
        ("solo", "torch_rpc_ext.run: worker 'solo' (rank 0)"),
    ]
    assert all(r["level"] == "warning" and r["logger"] == "torch_rpc_ext" for r in records)


# A dynamic group of one whose membership callback raises at its own leave
# (torch_rpc_ext.elastic logs it through Python's logging).
FAILING_CALLBACK = textwrap.dedent(
    """
    import logging, os, sys, tempfile
    got = []
    if sys.argv[1] == "handler":
        class Keep(logging.Handler):
            def emit(self, record):
                got.append((record.name, record.levelno, record.getMessage(),
                            record.exc_info is not None))
        logging.getLogger().addHandler(Keep())
    if sys.argv[1] == "critical":
        logging.getLogger("torch_rpc_ext").setLevel(logging.CRITICAL)
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    @torch_rpc_ext.elastic.on_membership_change
    def fails(event):
        raise ValueError("callback failed on purpose")
    class BadRepr:  # a callback whose repr raises and whose error UTF-8 cannot hold
        def __repr__(self):
            raise TypeError("no repr")
        def __call__(self, event):
            raise ValueError("lone surrogate \\ud800")
    torch_rpc_ext.elastic.on_membership_change(BadRepr())
    @torch_rpc_ext.elastic.on_membership_change
    def last(event):
        print("LAST", event.kind, flush=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    rpc.init_rpc("solo", rank=0, backend=rpc.BackendType.TORCH_RPC_EXT,
                 rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
                     init_method="file://" + store))
    rpc.shutdown()
    print("GOT", got, flush=True)
    """
)


def run_failing_callback(how, **env):
    return subprocess.run([sys.executable, "-c", FAILING_CALLBACK, how], capture_output=True,
                          text=True, env=quiet_env(TORCH_RPC_EXT_TRANSPORTS="tcp", **env),
                          timeout=90)


def test_the_python_modules_errors_follow_the_format_when_logging_is_not_set_up():
    """torch_rpc_ext.elastic's error, in a program that never set up
    logging: a JSON object with format json (Python's last resort wrote it as
    text, a line a JSON reader chokes on), the traceback in its message; the
    text line has time, worker and pid. A callback whose repr raises, and
    whose error holds what UTF-8 cannot, is said too, and the callbacks after
    it still run (the thread survives). Errors pass TORCH_RPC_EXT_LOG=error;
    off, or the program's own level for the logger, silences them."""
    out = run_failing_callback("bare", TORCH_RPC_EXT_LOG_FORMAT="json")
    assert out.returncode == 0, out.stderr
    assert "LAST leave" in out.stdout, out.stdout
    records = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    failed = [r for r in records if "membership callback" in r["message"]]
    assert len(failed) == 2, out.stderr
    rec = failed[0]
    assert (rec["level"], rec["logger"], rec["worker"]) == ("error", "torch_rpc_ext", "solo")
    assert rec["message"].startswith("membership callback <function fails at ")
    assert "ValueError: callback failed on purpose" in rec["message"]
    assert "Traceback (most recent call last)" in rec["message"]
    assert "argument(s) failed to format" in failed[1]["message"]
    assert "ValueError: lone surrogate \\ud800" in failed[1]["message"]

    out = run_failing_callback("bare")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\[E \S+Z solo pid=\d+\] torch_rpc_ext: membership callback <function "
                     r"fails at \S+> failed$", out.stderr, re.M), out.stderr
    assert "ValueError: callback failed on purpose" in out.stderr

    out = run_failing_callback("bare", TORCH_RPC_EXT_LOG="error")
    assert out.returncode == 0, out.stderr
    assert "ValueError: callback failed on purpose" in out.stderr

    for how, env in (("bare", {"TORCH_RPC_EXT_LOG": "off"}), ("critical", {})):
        out = run_failing_callback(how, **env)
        assert out.returncode == 0, out.stderr
        assert "LAST leave" in out.stdout, out.stdout
        assert "membership callback" not in out.stderr and "ValueError" not in out.stderr


def test_the_python_modules_warnings_go_to_the_programs_handlers_when_it_has_them():
    out = run_failing_callback("handler", TORCH_RPC_EXT_LOG_FORMAT="json")
    assert out.returncode == 0, out.stderr
    # (The BadRepr callback's record fails in the handler: logging reports
    # that on stderr, as it does for any record, not as a line of ours.)
    assert not [line for line in out.stderr.splitlines()
                if line.startswith("{") and "membership callback" in line], out.stderr
    assert "('torch_rpc_ext.elastic', 40, 'torch_rpc_ext: membership callback <function fails" \
        in out.stdout, out.stdout
    assert "failed', True)" in out.stdout, out.stdout
    assert "LAST leave" in out.stdout, out.stdout

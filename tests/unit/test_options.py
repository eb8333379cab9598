# SPDX-License-Identifier: BSD-3-Clause
"""RpcExtBackendOptions: defaults, validation with clear errors, no side effects;
one source for defaults and limits (the core), which the README states."""

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch.distributed import rpc

from torch_rpc_ext import _C, RpcExtBackendOptions, _testing, secrets
from torch_rpc_ext.backend import _agent_options, _dynamic_devices

README = Path(__file__).resolve().parents[2] / "README.md"
SPEC = _C.option_spec()  # {name: (default, min, max)}
PYTHON_ONLY = {"device_maps", "devices"}


def test_defaults_match_upstream_constants(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_TRANSPORTS", raising=False)
    monkeypatch.delenv("TORCH_RPC_EXT_CHANNELS", raising=False)
    opts = RpcExtBackendOptions()
    assert isinstance(opts, _C._RpcExtBackendOptionsBase)
    assert isinstance(opts, rpc.RpcBackendOptions)
    assert opts.rpc_timeout == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
    assert opts.init_method == rpc.constants.DEFAULT_INIT_METHOD
    assert opts.num_worker_threads == rpc.constants.DEFAULT_NUM_WORKER_THREADS
    assert opts.transports == ("shm", "tcp")
    assert opts.device_maps == {}
    assert opts.devices is None
    assert not opts.uses_cuda()


def test_base_fields_stay_writable():
    opts = RpcExtBackendOptions(rpc_timeout=5, init_method="tcp://127.0.0.1:1")
    opts.rpc_timeout = 7.5
    opts.init_method = "file:///tmp/x"
    assert (opts.rpc_timeout, opts.init_method) == (7.5, "file:///tmp/x")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_worker_threads": 0}, "num_worker_threads must be >= 1"),
        ({"num_worker_threads": 2.5}, "num_worker_threads must be an int"),
        ({"num_worker_threads": True}, "num_worker_threads must be an int"),
        ({"rpc_timeout": -1}, "rpc_timeout must be a finite number >= 0"),
        ({"rpc_timeout": float("inf")}, "rpc_timeout must be a finite number"),
        ({"rpc_timeout": True}, "rpc_timeout must be a finite number"),
        ({"rpc_timeout": 1e300}, "rpc_timeout must be a finite number"),
        ({"handshake_timeout": float("inf")}, "handshake_timeout must be > 0"),
        ({"handshake_timeout": float("nan")}, "handshake_timeout must be > 0"),
        ({"heartbeat_timeout": float("inf")}, r"heartbeat_timeout must be 0 \(off\)"),
        ({"heartbeat_timeout": float("nan")}, r"heartbeat_timeout must be 0 \(off\)"),
        ({"transports": ()}, "transports must name at least one"),
        ({"transports": ("carrier-pigeon",)}, r"unknown transports \['carrier-pigeon'\]"),
        ({"transports": ("tcp", "tcp")}, "lists a transport twice"),
        ({"channels": ("basic",)}, r"unknown channels \['basic'\].*always on"),
        ({"channels": ("shm_ring", "shm_ring")}, "lists a channel twice"),
        ({"address": ""}, "address must be a non-empty str"),
        ({"secret": b"short"}, "secret must be at least 16 bytes"),
        ({"max_frame_bytes": 10}, "max_frame_bytes must be an int >= 1024"),
        ({"handshake_timeout": 0}, "handshake_timeout must be > 0"),
        ({"device_maps": {"w1": {"cuda": "cuda:0"}}}, "needs an index"),
        ({"device_maps": {"w1": {"tpu:0": "cpu"}}}, "not a device|only cpu and cuda"),
        ({"device_maps": {"w1": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}},
         "`device_map` only supports 1-to-1 mapping"),
        ({"devices": ["banana"]}, "is not a device"),
        ({"devices": ["cpu"]}, "`set_devices` expect a list of CUDA devices"),
        ({"cuda_zero_copy": 1}, "cuda_zero_copy must be a bool"),
        ({"cuda_ipc_memory_limit": 1.5}, "cuda_ipc_memory_limit must be an int >= 0"),
        ({"cuda_ipc_memory_limit": True}, "cuda_ipc_memory_limit must be an int >= 0"),
        ({"shm_frame_ring_bytes": 4096}, r"shm_frame_ring_bytes must be 0 \(off\) or a multiple"),
        ({"shm_frame_ring_bytes": 65536 + 1}, "shm_frame_ring_bytes must be 0"),
        ({"shm_frame_ring_bytes": 128 << 20}, r"in \[65536, 67108864\]"),
        ({"shm_frame_ring_bytes": True}, "shm_frame_ring_bytes must be 0"),
    ],
)
def test_bad_options_are_rejected_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RpcExtBackendOptions(**kwargs)


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("max_frame_bytes", 0, "max_frame_bytes must be an int >= 1024"),
        ("num_worker_threads", -3, "num_worker_threads must be >= 1"),
        ("busy_poll_us", -5, r"busy_poll_us must be an int in \[0, "),
        ("rpc_timeout", float("inf"), "rpc_timeout must be a finite number"),
        ("heartbeat_timeout", float("nan"), r"heartbeat_timeout must be 0 \(off\)"),
        ("cuda_zero_copy", 1, "cuda_zero_copy must be a bool"),
        ("hold_off_exempt", ["10.0.0.5/8"], "'10.0.0.5/8' is not an address or a network .*host bits"),
        ("hold_off_exempt", ["10.0.0.0/33"], "'10.0.0.0/33' is not an address or a network"),
        ("hold_off_exempt", ["localhost"], "'localhost' is not an address or a network"),
    ],
)
def test_an_option_set_after_construction_is_checked_as_at_construction(name, bad, match):
    """Upstream's code sets options as attributes too; before session 94 a
    later assignment reached the core unchecked (max_frame_bytes = 0: init
    went through and every call failed)."""
    opts = RpcExtBackendOptions()
    before = getattr(opts, name)
    with pytest.raises(ValueError, match=match):
        setattr(opts, name, bad)
    assert getattr(opts, name) == before
    opts.num_worker_threads = 3
    opts.heartbeat_timeout = 2
    assert (opts.num_worker_threads, opts.heartbeat_timeout) == (3, 2.0)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        RpcExtBackendOptions(4)  # type: ignore[misc]


def test_set_device_map_merges_and_refuses_remaps():
    opts = RpcExtBackendOptions()
    opts.set_device_map("w1", {0: 1})
    opts.set_device_map("w1", {"cuda:2": "cuda:3"})
    assert opts.device_maps["w1"] == {
        torch.device("cuda:0"): torch.device("cuda:1"),
        torch.device("cuda:2"): torch.device("cuda:3"),
    }
    assert opts.uses_cuda()
    # TensorPipe's texts; two devices mapped to one across calls is left to
    # init's check of every worker's maps (tests/rpc/test_device_maps.py).
    with pytest.raises(ValueError, match="`set_device_map` only supports 1-to-1 mapping"):
        opts.set_device_map("w1", {0: 2})
    opts.set_device_map("w1", {4: 1})
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        opts.set_device_map("w1", {-1: 0})
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        opts.set_device_map("w1", {0: -1})


def test_construction_does_not_touch_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("options touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    opts = RpcExtBackendOptions(device_maps={"w1": {"cuda:0": "cuda:1"}})
    assert opts.uses_cuda()


def test_secret_accepts_str_and_bytes():
    assert RpcExtBackendOptions(secret="abcdefgh12345678").secret == b"abcdefgh12345678"
    assert RpcExtBackendOptions(secret=b"y" * 16 + b"0123456789abcdef").secret == (
        b"y" * 16 + b"0123456789abcdef")


@pytest.mark.parametrize(
    "secret, why",
    [
        ("x" * 40, "it has 1 distinct bytes"),
        ("abcabcabcabcabcabc", "it has 3 distinct bytes"),
        ("abcdefgh" * 3, "it repeats its first 8 bytes"),
        ("0123456789" * 2, "it repeats its first 10 bytes"),
    ],
)
def test_a_weak_secret_is_refused_naming_why(secret, why, monkeypatch):
    with pytest.raises(ValueError, match=f"secret is too weak to use: {why}"):
        RpcExtBackendOptions(secret=secret)
    monkeypatch.setenv("TORCH_RPC_EXT_SECRET", secret)
    with pytest.raises(ValueError, match=f"TORCH_RPC_EXT_SECRET is too weak to use: {why}"):
        _agent_options(RpcExtBackendOptions())


def test_every_user_secret_is_stretched_alike():
    """What the agent gets is PBKDF2 of the secret, the same from options
    and from the environment; a secret the group makes itself (None) is
    left to the agent."""
    key = _agent_options(RpcExtBackendOptions(secret="correct horse battery")).secret
    assert key == secrets.stretch(b"correct horse battery") and len(key) == 32
    assert key != b"correct horse battery"
    assert _agent_options(RpcExtBackendOptions()).secret is None


def test_transports_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_TRANSPORTS", " tcp ")
    assert RpcExtBackendOptions().transports == ("tcp",)
    assert RpcExtBackendOptions(transports=["shm"]).transports == ("shm",)
    monkeypatch.setenv("TORCH_RPC_EXT_TRANSPORTS", "shm,ib")
    with pytest.raises(ValueError, match=r"unknown transports \['ib'\]"):
        RpcExtBackendOptions()


def test_channels_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_CHANNELS", "shm_slab, shm_ring,tcp_lanes")
    assert RpcExtBackendOptions().channels == ("shm_slab", "shm_ring", "tcp_lanes")
    assert RpcExtBackendOptions(channels=["shm_ring"]).channels == ("shm_ring",)
    monkeypatch.setenv("TORCH_RPC_EXT_CHANNELS", "basic")
    assert RpcExtBackendOptions().channels == ()
    monkeypatch.setenv("TORCH_RPC_EXT_CHANNELS", "tcp_lanes,mpt")
    with pytest.raises(ValueError, match=r"unknown channels \['mpt'\]"):
        RpcExtBackendOptions()


def test_channels_default_to_the_registry_and_may_be_narrowed(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_CHANNELS", raising=False)
    # Every CPU channel but tcp_lanes, which is opt in.
    assert RpcExtBackendOptions().channels == ("shm_slab", "shm_ring")
    assert _C.channel_names("cpu") == ["shm_slab", "shm_ring", "tcp_lanes"]
    assert _C.channel_names() == ["shm_slab", "shm_ring", "cuda_ipc", "cuda_self", "cuda_ring",
                                  "cuda_staged", "tcp_lanes"]
    assert RpcExtBackendOptions(channels=("shm_slab", "tcp_lanes")).channels == ("shm_slab", "tcp_lanes")
    assert RpcExtBackendOptions(channels="shm_ring").channels == ("shm_ring",)
    assert RpcExtBackendOptions(channels=()).channels == ()


def test_device_channels_default_to_every_cuda_channel_and_may_force_staging():
    assert RpcExtBackendOptions().device_channels == ("cuda_ipc", "cuda_self", "cuda_ring", "cuda_staged")
    opts = RpcExtBackendOptions(device_channels="cuda_staged")
    assert opts.device_channels == ("cuda_staged",)
    assert "device_channels=('cuda_staged',)" in repr(opts)
    for bad in ((), ("shm_slab",), ("cuda_nvlink",)):
        with pytest.raises(ValueError, match="device_channels must name one or more of"):
            RpcExtBackendOptions(device_channels=bad)
    with pytest.raises(ValueError, match="lists a channel twice"):
        RpcExtBackendOptions(device_channels=("cuda_ipc", "cuda_ipc"))


# ---- one source of truth: the core, the Python signature, the README ------


def _sizes(text: str) -> str:
    """'16 GiB' -> '17179869184' (and KiB, MiB)."""
    shift = {"K": 10, "M": 20, "G": 30}
    return re.sub(
        r"(\d+) ([KMG])iB", lambda m: str(int(m[1]) << shift[m[2]]), text
    )


def _readme_options_section() -> str:
    section = README.read_text().split("\n## Options\n", 1)[1]
    return _sizes(section.split("\n## ", 1)[0])


def _readme_defaults() -> dict:
    """The keywords of the `RpcExtBackendOptions(*, ...)` line."""
    section = _readme_options_section()
    m = re.search(r"`RpcExtBackendOptions\(\*,(.*?)\)`", section, re.S)
    assert m, "README's Options section has no `RpcExtBackendOptions(*, ...)` line"
    call = ast.parse(f"f({m[1]})", mode="eval").body
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def _readme_limits() -> dict:
    """{name: (min, max)} from `name >= x`, `len(name) >= x`, `x <= name <= y`."""
    section = _readme_options_section()
    limits = {}
    for m in re.finditer(r"`(?:len\((\w+)\)|(\w+)) >= ([\d.]+)`", section):
        limits[m[1] or m[2]] = (ast.literal_eval(m[3]), None)
    for m in re.finditer(r"`([\d.]+) <= (\w+) <= ([\d.]+)`", section):
        limits[m[2]] = (ast.literal_eval(m[1]), ast.literal_eval(m[3]))
    return limits


def _signature_defaults() -> dict:
    params = list(inspect.signature(RpcExtBackendOptions.__init__).parameters.values())
    assert all(p.kind is p.KEYWORD_ONLY for p in params[1:])
    return {p.name: p.default for p in params[1:]}


def test_signature_core_and_readme_agree_on_defaults(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_TRANSPORTS", raising=False)
    monkeypatch.delenv("TORCH_RPC_EXT_CHANNELS", raising=False)
    signature, readme = _signature_defaults(), _readme_defaults()
    assert set(readme) == set(signature)
    assert set(SPEC) == set(signature) - PYTHON_ONLY
    core = _C._RpcExtBackendOptionsBase()  # AgentOptions' own initializers
    effective = RpcExtBackendOptions()
    for name, default in signature.items():
        if name in PYTHON_ONLY:
            assert readme[name] is None and default is None, name
            continue
        want = SPEC[name][0]
        assert getattr(core, name) == want, f"AgentOptions default of {name}"
        # None in the signature means "resolved at construction" (transports,
        # channels: the environment, else the core's default).
        assert default == want or default is None, f"signature default of {name}"
        assert getattr(effective, name) == want, f"effective default of {name}"
        assert readme[name] == want, f"README default of {name}"
    # transport::TransportOptions, which the agent fills from AgentOptions.
    for name, value in _testing.transport_option_defaults().items():
        assert value == SPEC[name][0], f"TransportOptions default of {name}"


def test_readme_states_the_core_limits():
    core = {n: (lo, hi) for n, (_, lo, hi) in SPEC.items() if (lo, hi) != (None, None)}
    assert _readme_limits() == core


def _limit_cases():
    for name, (_, lo, hi) in SPEC.items():
        if name == "secret":
            yield name, bytes(range(65, 65 + lo)), bytes(range(65, 64 + lo))
            continue
        if lo is not None:
            below = lo - 1 if isinstance(lo, int) else (lo / 2 if lo > 0 else lo - 0.5)
            yield name, lo, below
        if hi is not None:
            yield name, hi, hi + 1


@pytest.mark.parametrize("name, ok, bad", list(_limit_cases()))
def test_validation_enforces_the_core_limits(name, ok, bad):
    assert getattr(RpcExtBackendOptions(**{name: ok}), name) == ok
    with pytest.raises(ValueError, match=name):
        RpcExtBackendOptions(**{name: bad})


def test_heartbeat_zero_means_off_below_the_minimum():
    assert RpcExtBackendOptions(heartbeat_timeout=0).heartbeat_timeout == 0


def test_the_agent_gets_a_copy_with_the_secret_from_the_environment(monkeypatch):
    import torch_rpc_ext.testing as faulty
    from torch_rpc_ext.backend import _agent_options

    opts = faulty.FaultyRpcExtBackendOptions(
        num_fail_sends=2,
        messages_to_fail=["SCRIPT_CALL"],
        messages_to_delay={"PYTHON_CALL": 1.5},
        busy_poll_us=7,
        transports=["tcp"],
        rpc_timeout=3,
    )
    monkeypatch.setenv("TORCH_RPC_EXT_SECRET", "env-secret-0123456789")
    out = _agent_options(opts)
    assert type(out) is _C._RpcExtBackendOptionsBase
    assert (out.busy_poll_us, out.transports, out.rpc_timeout) == (7, ("tcp",), 3)
    assert (out._num_fail_sends, out._messages_to_fail) == (2, ["SCRIPT_CALL"])
    assert out._messages_to_delay == {"PYTHON_CALL": 1.5}
    assert out.secret == secrets.stretch(b"env-secret-0123456789") and opts.secret is None
    assert _agent_options(RpcExtBackendOptions(secret=b"opt-secret-0123456789")).secret == (
        secrets.stretch(b"opt-secret-0123456789"))
    monkeypatch.setenv("TORCH_RPC_EXT_SECRET", "short")
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_SECRET must be at least 16"):
        _agent_options(opts)


def test_device_channels_are_not_listed_in_channels():
    with pytest.raises(ValueError, match=r"\['cuda_ipc'\], which carry CUDA tensors"):
        RpcExtBackendOptions(channels=["shm_slab", "cuda_ipc"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"encryption": "on"}, 'encryption must be "auto", "always" or "off", got \'on\''),
        ({"encryption": True}, "encryption must be"),
        ({"tls_cert": "/nonexistent/cert.pem"}, "tls_cert: '/nonexistent/cert.pem' is not a readable file"),
        ({"tls_cert": ""}, "tls_cert must be a path"),
    ],
)
def test_bad_encryption_options_are_rejected_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match) if "'" in match else match):
        RpcExtBackendOptions(**kwargs)


def test_mutual_tls_takes_its_three_files_together(tmp_path, monkeypatch):
    for var in ("TORCH_RPC_EXT_ENCRYPTION", "TORCH_RPC_EXT_TLS_CERT", "TORCH_RPC_EXT_TLS_KEY",
                "TORCH_RPC_EXT_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("-")
    with pytest.raises(ValueError, match="tls_cert, tls_key given without tls_ca"):
        RpcExtBackendOptions(tls_cert=str(cert), tls_key=str(key))
    with pytest.raises(ValueError, match='given but encryption is "off"'):
        RpcExtBackendOptions(tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca), encryption="off")
    o = RpcExtBackendOptions(tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca))
    assert (o.encryption, o.tls_cert, o.tls_key, o.tls_ca) == ("auto", str(cert), str(key), str(ca))
    # The environment fills what the arguments leave out, and is checked
    # the same way, naming the variable.
    monkeypatch.setenv("TORCH_RPC_EXT_ENCRYPTION", "always")
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_CERT", str(cert))
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_KEY", str(key))
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_CA", str(ca))
    o = RpcExtBackendOptions()
    assert (o.encryption, o.tls_ca) == ("always", str(ca))
    assert RpcExtBackendOptions(encryption="auto").encryption == "auto"
    monkeypatch.setenv("TORCH_RPC_EXT_ENCRYPTION", "yes")
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_ENCRYPTION must be"):
        RpcExtBackendOptions()
    monkeypatch.setenv("TORCH_RPC_EXT_ENCRYPTION", "auto")
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_TLS_CA: .* is not a readable file"):
        RpcExtBackendOptions()


def test_hold_off_exemptions_are_networks_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_HOLD_OFF_EXEMPT", raising=False)
    assert RpcExtBackendOptions().hold_off_exempt == ()
    o = RpcExtBackendOptions(hold_off_exempt=["10.0.0.0/8", "fd00::/8", "192.168.1.7", "::1"])
    assert o.hold_off_exempt == ("10.0.0.0/8", "fd00::/8", "192.168.1.7/32", "::1/128")
    assert _agent_options(o).hold_off_exempt == o.hold_off_exempt
    # A netmask is written as its prefix, which the core reads.
    assert RpcExtBackendOptions(hold_off_exempt=["10.0.0.0/255.0.0.0"]).hold_off_exempt == ("10.0.0.0/8",)
    for bad, match in [
        ("10.0.0.0/8", "must be a sequence of addresses or networks"),
        (["10.0.0.5/8"], "'10.0.0.5/8' is not an address or a network .*host bits set"),
        (["fe80::1%eth0"], "a scoped address names no network"),
        (["host.example.com"], "'host.example.com' is not an address or a network"),
    ]:
        with pytest.raises(ValueError, match=f"^hold_off_exempt.*{match}"):
            RpcExtBackendOptions(hold_off_exempt=bad)
    monkeypatch.setenv("TORCH_RPC_EXT_HOLD_OFF_EXEMPT", " 10.0.0.0/8 ,192.168.1.7")
    assert RpcExtBackendOptions().hold_off_exempt == ("10.0.0.0/8", "192.168.1.7/32")
    assert RpcExtBackendOptions(hold_off_exempt=()).hold_off_exempt == ()
    monkeypatch.setenv("TORCH_RPC_EXT_HOLD_OFF_EXEMPT", "10.0.0.0/8,10.1.0.0/8")
    with pytest.raises(ValueError, match="^TORCH_RPC_EXT_HOLD_OFF_EXEMPT: '10.1.0.0/8' .*host bits"):
        RpcExtBackendOptions()
    monkeypatch.delenv("TORCH_RPC_EXT_HOLD_OFF_EXEMPT")
    # Any iterable, once; set afterwards, checked and written as at construction.
    assert RpcExtBackendOptions(hold_off_exempt=(n for n in ["10.0.0.0/8"])).hold_off_exempt == ("10.0.0.0/8",)
    o.hold_off_exempt = ["10.0.0.0/255.0.0.0", "10.1.2.3"]
    assert o.hold_off_exempt == ("10.0.0.0/8", "10.1.2.3/32")
    with pytest.raises(ValueError, match="hold_off_exempt must be a sequence"):
        o.hold_off_exempt = 8
    # The core refuses what it cannot read, whoever sets its field.
    core = _C._RpcExtBackendOptionsBase()
    for bad, match in [("0.0.0.0\x00junk", "holding a NUL byte"), ("10.0.0.0/33", "prefix is not 0 to 32"),
                       ("10.0.0.0/255.0.0.0", "prefix is not 0 to 32"), ("10.0.0.5/8", "host bits set beyond /8")]:
        with pytest.raises(ValueError, match=match):
            core.hold_off_exempt = [bad]


@pytest.mark.parametrize(
    "entries, source, inside",
    [
        (["10.0.0.0/8"], "10.255.1.2", True),
        (["10.0.0.0/8"], "11.0.0.1", False),
        (["10.0.0.0/8"], "10.1.2.3:0", True),  # tcp_lanes names a source with port 0
        (["192.168.4.0/22"], "192.168.7.255", True),
        (["192.168.4.0/22"], "192.168.8.0", False),
        (["127.0.0.3/32"], "127.0.0.3", True),
        (["127.0.0.3/32"], "127.0.0.4", False),
        (["0.0.0.0/0"], "203.0.113.9", True),
        (["0.0.0.0/0"], "::1", False),  # IPv4 networks hold no IPv6 address...
        (["10.0.0.0/8"], "::ffff:10.0.0.7", True),  # ...but a mapped IPv4 one
        (["fc00::/7"], "fdff::1", True),
        (["fc00::/7"], "fc00::1", True),
        (["fd00::/8"], "fc00::1", False),
        (["fe80::/10"], "[fe80::1%eth0]:0", True),  # lanes: brackets, scope, port
        (["fe80::/10"], "[fe80::1%eth0]", True),  # the listener: brackets, scope
        (["10.0.0.0/8"], "[::ffff:10.0.0.7]", True),  # the listener's dual-stack IPv4 peer
        (["::ffff:10.0.0.0/104"], "10.9.9.9", True),  # an IPv4 network written mapped
        (["::ffff:10.0.0.0/104"], "11.0.0.1", False),
        (["fe80::/10"], "fec0::1", False),
        (["::1/128"], "[::1]:0", True),
        (["10.0.0.0/8", "::1/128"], "local", False),  # the shm listener's name for its peers
        ([], "10.0.0.1", False),
    ],
)
def test_a_source_lies_in_an_exempt_network_as_the_transports_name_it(entries, source, inside):
    assert _testing.address_ranges_contain(entries, source) is inside


def test_devices_assigned_or_changed_after_construction_still_count():
    # uses_cuda() read .type of each entry: a list assigned since (strings,
    # ints) failed init on that worker after a store round, its peers left
    # waiting out the store's timeout.
    o = RpcExtBackendOptions()
    o.devices = ["cuda:1"]
    assert o.uses_cuda()
    o = RpcExtBackendOptions()
    o.device_maps["w0"] = {0: 1}
    assert o.uses_cuda()
    o = RpcExtBackendOptions()
    o.device_maps["w0"] = {"cpu": "cpu"}
    assert not o.uses_cuda()


def test_a_dynamic_members_device_rules_where_they_differ_from_upstreams(monkeypatch):
    """docs/elastic.md, "Device maps": CUDA devices only; a device named
    twice counts once; a map from a device outside ``devices`` widens
    them (upstream's dynamic check refuses the last two, takes the
    first)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for maps in ({"w1": {"cpu": 0}}, {"w1": {0: "cpu"}}):
        with pytest.raises(ValueError, match="a dynamic group maps CUDA devices only"):
            _dynamic_devices("w0", RpcExtBackendOptions(device_maps=maps))
    twice = RpcExtBackendOptions(devices=[0, 0])
    assert _dynamic_devices("w0", twice) == [torch.device("cuda", 0)]
    widened = RpcExtBackendOptions(devices=[0], device_maps={"w1": {1: 0}})
    assert _dynamic_devices("w0", widened) == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_dynamic_members_map_to_itself_publishes_its_targets(monkeypatch):
    """In a dynamic group a member publishes the devices it receives on; a
    map to itself receives on its targets, which no peer's join checks.
    Before, {0: 1} to itself published cuda:0 only, and every such call
    failed at receive ("a tensor arrived for cuda:1, which is not among
    the devices of w0"); a static group's device list has them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    opts = RpcExtBackendOptions(device_maps={"w0": {0: 1}, "w1": {1: 0}})
    assert _dynamic_devices("w0", opts) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    only_peer = RpcExtBackendOptions(device_maps={"w1": {0: 1}})
    assert _dynamic_devices("w0", only_peer) == [torch.device("cuda", 0)]
    with pytest.raises(ValueError, match="sees 2 CUDA device"):
        _dynamic_devices("w0", RpcExtBackendOptions(device_maps={"w0": {0: 2}}))

# SPDX-License-Identifier: BSD-3-Clause
"""Options for ``rpc.init_rpc(backend=rpc.BackendType.TORCH_RPC_EXT, ...)``."""

import math
import os
from collections.abc import Mapping, Sequence

import torch

from torch_rpc_ext import _C, secrets
from torch_rpc_ext._tls_options import (
    check_encryption,
    check_hold_off_exempt,
    check_peer_names,
)

__all__ = ["RpcExtBackendOptions", "DEFAULT_MAX_FRAME_BYTES"]

# Defaults and limits are the core's (csrc/common/option_defaults.h):
# {name: (default, min, max)}, None where there is none.
_SPEC = _C.option_spec()
_DEFAULT = {name: spec[0] for name, spec in _SPEC.items()}
_MIN = {name: spec[1] for name, spec in _SPEC.items()}
_MAX = {name: spec[2] for name, spec in _SPEC.items()}

DEFAULT_MAX_FRAME_BYTES = _DEFAULT["max_frame_bytes"]  # 16 GiB
DeviceLike = int | str | torch.device


def _device(d: DeviceLike, what: str) -> torch.device:
    if isinstance(d, int) and not isinstance(d, bool):
        # torch.device(int) would probe the accelerator; an int means CUDA.
        # A negative index raises torch's own RuntimeError ("Device index
        # must not be negative"), as TensorPipe's options do.
        return torch.device("cuda", d)
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError) as e:
        if "must not be negative" in str(e):
            raise
        raise ValueError(f"{what}: {d!r} is not a device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: only cpu and cuda devices are supported, got {dev}")
    if dev.type == "cuda" and dev.index is None:
        raise ValueError(f"{what}: {dev} needs an index, e.g. cuda:0")
    return dev


def _check_map(to: str, device_map: Mapping[DeviceLike, DeviceLike]) -> dict:
    if not isinstance(to, str) or not to:
        raise ValueError(f"device map target must be a worker name, got {to!r}")
    if not isinstance(device_map, Mapping):
        raise ValueError(f"device map for {to} must be a dict, got {device_map!r}")
    out: dict[torch.device, torch.device] = {}
    reverse: dict[torch.device, torch.device] = {}
    for k, v in device_map.items():
        k, v = _device(k, f"device map for {to}"), _device(v, f"device map for {to}")
        if v in reverse:
            # TensorPipe's text (torch/distributed/rpc/options.py).
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {k} and {reverse[v]} to {v}"
            )
        out[k] = v
        reverse[v] = k
    return out


def _cuda_device(d: DeviceLike) -> torch.device:
    dev = _device(d, "devices")
    if dev.type != "cuda":
        # TensorPipe's text.
        raise ValueError(
            "`set_devices` expect a list of CUDA devices, but got "
            f"device type {dev.type}."
        )
    return dev


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Seconds the core's milliseconds hold with room to spare (about 31 years).
_MAX_SECONDS = 1e9


def _is_seconds(v: object) -> bool:
    # A finite number of seconds the core can hold: NaN compares false with
    # every bound, infinity or a huge value overflows the core's milliseconds
    # (before session 94: a negative duration, every handshake failed).
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and abs(v) <= _MAX_SECONDS)


def _check_num_worker_threads(v: object) -> None:
    if not _is_int(v):
        raise ValueError(f"num_worker_threads must be an int, got {v!r}")
    if v < (lo := _MIN["num_worker_threads"]):
        raise ValueError(f"num_worker_threads must be >= {lo}, got {v}")


def _check_rpc_timeout(v: object) -> None:
    lo = _MIN["rpc_timeout"]
    if not _is_seconds(v) or v < lo:
        raise ValueError(
            f"rpc_timeout must be a finite number >= {lo:g} (0: none), got {v!r}")


def _check_max_frame_bytes(v: object) -> None:
    lo = _MIN["max_frame_bytes"]
    if not _is_int(v) or v < lo:
        raise ValueError(f"max_frame_bytes must be an int >= {lo}, got {v!r}")


def _check_handshake_timeout(v: object) -> None:
    lo = _MIN["handshake_timeout"]
    if not _is_seconds(v) or v < lo:
        raise ValueError(
            f"handshake_timeout must be > 0 (at least {lo:g} seconds, finite), "
            f"got {v!r}")


def _check_heartbeat_timeout(v: object) -> None:
    lo = _MIN["heartbeat_timeout"]
    if not _is_seconds(v) or v < 0 or 0 < v < lo:
        raise ValueError(
            f"heartbeat_timeout must be 0 (off) or >= {lo:g} seconds (finite), "
            f"got {v!r}")


def _check_busy_poll_us(v: object) -> None:
    lo, hi = _MIN["busy_poll_us"], _MAX["busy_poll_us"]
    if not _is_int(v) or not lo <= v <= hi:
        raise ValueError(f"busy_poll_us must be an int in [{lo}, {hi}], got {v!r}")


def _check_poll_on_caller_cpu(v: object) -> None:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"poll_on_caller_cpu must be a bool or None, got {v!r}")


def _check_max_cached_receive_bytes(v: object) -> None:
    lo = _MIN["max_cached_receive_bytes"]
    if not _is_int(v) or v < lo:
        raise ValueError(f"max_cached_receive_bytes must be an int >= {lo}, got {v!r}")


def _check_shm_frame_ring_bytes(v: object) -> None:
    lo, hi = _MIN["shm_frame_ring_bytes"], _MAX["shm_frame_ring_bytes"]
    if not _is_int(v) or not (v == 0 or lo <= v <= hi) or v % 4096 != 0:
        raise ValueError(
            f"shm_frame_ring_bytes must be 0 (off) or a multiple of 4096 in "
            f"[{lo}, {hi}], got {v!r}")


def _check_bool(name: str):
    def check(v: object) -> None:
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    return check


def _check_cuda_ipc_memory_limit(v: object) -> None:
    lo = _MIN["cuda_ipc_memory_limit"]
    if not _is_int(v) or v < lo:
        raise ValueError(
            f"cuda_ipc_memory_limit must be an int >= {lo} (0: no bound), got {v!r}")


# The options of one value each, checked at construction and whenever one
# is set afterwards (before session 94 a later assignment, upstream style,
# went to the core unchecked: max_frame_bytes = 0 failed every call).
_SCALAR_CHECKS = {
    "num_worker_threads": _check_num_worker_threads,
    "rpc_timeout": _check_rpc_timeout,
    "max_frame_bytes": _check_max_frame_bytes,
    "handshake_timeout": _check_handshake_timeout,
    "heartbeat_timeout": _check_heartbeat_timeout,
    "busy_poll_us": _check_busy_poll_us,
    "poll_on_caller_cpu": _check_poll_on_caller_cpu,
    "max_cached_receive_bytes": _check_max_cached_receive_bytes,
    "shm_frame_ring_bytes": _check_shm_frame_ring_bytes,
    "cuda_zero_copy": _check_bool("cuda_zero_copy"),
    "cuda_ipc_memory_limit": _check_cuda_ipc_memory_limit,
    "shm_peers_any_user": _check_bool("shm_peers_any_user"),
}


def _check_scalars(**values: object) -> None:
    for name, value in values.items():
        _SCALAR_CHECKS[name](value)


class RpcExtBackendOptions(_C._RpcExtBackendOptionsBase):
    """Configuration of the TORCH_RPC_EXT agent.

    Constructing options has no side effects; everything is validated here and
    applied by ``init_rpc``. A keyword-only subclass of the core's
    ``_C._RpcExtBackendOptionsBase`` (itself a ``torch.distributed.rpc.
    RpcBackendOptions``), which holds every value but ``device_maps`` and
    ``devices`` and owns every default and limit (``_C.option_spec()``).

    Args:
        num_worker_threads: Core threads of the agent's pool, which fails
            timed-out and disconnected calls, releases sent tensors and runs
            fault-injection delays. Requests and completions do not wait for
            it: the transport thread that reads them runs them, and a blocked
            request hands that role to a new thread (docs/architecture.md),
            so no value can deadlock nested RPCs.
        rpc_timeout: Default timeout of one RPC, in seconds (0: none).
        init_method: Rendezvous URL, as in ``init_process_group``.
        device_maps: ``{worker: {local_device: remote_device}}``, as in
            TensorPipe.
        devices: Local devices the agent may use; defaults to those in
            ``device_maps``.
        transports: Transports by preference. ``"shm"`` (a Unix socket that
            passes shared memory) is used with peers on the same host,
            ``"tcp"`` with the others. Defaults to ``TORCH_RPC_EXT_TRANSPORTS``
            (comma-separated), else ``("shm", "tcp")``.
        channels: Channels for tensor bytes by preference, used with a peer
            when both offer them and the transport can host them:
            ``"shm_slab"`` (the receiver's tensor views a shared slab: no
            receive-side copy) and ``"shm_ring"`` (a shared ring, one copy
            per side), both for segments of 64 KiB or more over ``shm``. A
            segment no channel takes travels in the transport's stream
            (``"basic"``, always on); ``()`` sends everything that way.
            ``"tcp_lanes"`` stripes tensors of 1 MiB or more over several
            TCP connections per peer across hosts. Defaults to
            ``TORCH_RPC_EXT_CHANNELS`` (comma-separated; ``basic`` alone:
            the stream only), else ``("shm_slab", "shm_ring")`` and, on
            encrypted connections only, ``tcp_lanes`` (the cipher's work
            spread over the lanes' threads;
            ``TORCH_RPC_EXT_LANES_WHEN_ENCRYPTED=0`` keeps them off). Named
            here, lanes serve every TCP connection.
        device_channels: Channels for CUDA tensors by preference, used when
            ``device_maps`` or ``devices`` name a GPU: ``"cuda_ipc"`` (the
            sender copies into device memory of its own that the receiver
            maps once and copies out of into torch's allocator: processes
            of one host sharing the device), ``"cuda_self"`` (a worker's
            calls to itself: the sender copies into a pooled device block
            that the receiver reads, nothing through host memory),
            ``"cuda_ring"`` (one host, where cuda_ipc cannot join the two
            devices: tensors of 1 MiB or more in chunks through a ring of
            pinned shared memory, copied out and in chunk by chunk, no
            socket) and ``"cuda_staged"`` (through pinned host memory in
            chunks, copied out and in as the stream goes: any peer, any two
            devices).
            ``("cuda_staged",)`` forces staging.
        shm_peers_any_user: The shm transport's socket (Linux's abstract
            namespace: any local process can connect to it) accepts only
            processes of this worker's user and root (``SO_PEERCRED``);
            ``True`` admits every local user's, which then still has to
            prove the group secret.
        cuda_zero_copy: Received CUDA tensors view the device memory the
            channel brought them in (the sender's, for ``cuda_ipc``) instead
            of a copy in torch's caching allocator: one device-to-device
            copy fewer per tensor, but ``record_stream`` and a future's
            ``wait()`` cannot see such memory, so a received tensor is safe
            only on the stream that was current when it arrived (the
            callee's function, ``wait()``'s caller) unless it stays alive
            until the work on other streams is done (docs/guide.md,
            "Streams"). Off by default.
        cuda_ipc_memory_limit: Bytes of device memory, per device, that
            ``cuda_ipc``'s blocks may hold in this process (they live beside
            torch's caching allocator; idle ones are freed after 5 s), with
            the landing memory it grants peers ahead under the landing pool
            (docs/cuda.md, "Grants"; at most half the bound; unused ones
            taken back after 10 s).
            Past it, or when the device is out of memory even after torch
            freed its cached blocks, a tensor goes by the next channel
            instead (a grant past it is not made: its tensors land by copy).
            0: no bound. Default 2 GiB.
        address: IP address to listen on and advertise. Defaults to
            ``TORCH_RPC_EXT_ADDR``, else the first IPv4 address of
            ``TORCH_RPC_EXT_SOCKET_IFNAME``, else the hostname's address,
            else 127.0.0.1.
        secret: Group secret every connection must prove it knows (at least
            16 bytes, 8 of them distinct, not one short run repeated;
            stretched with PBKDF2 at ``init_rpc``). Defaults to
            ``TORCH_RPC_EXT_SECRET``, else a random secret rank 0 creates at
            rendezvous and seals to each rank through the store
            (docs/security.md).
        encryption: TLS 1.3 on TCP connections: ``"auto"`` (the default)
            encrypts every connection whose peer address is not loopback,
            that is every one that leaves the host; ``"always"`` encrypts
            loopback ones too; ``"off"`` sends in the clear (for links you
            trust, such as a private fabric). shm connections never need it
            (one kernel). Defaults to ``TORCH_RPC_EXT_ENCRYPTION``, else
            ``"auto"``. Every worker must use the same setting; a mismatch
            fails the connection naming it. Without certificates, TLS is
            keyed from the group secret (each connection's pre-shared key
            from a password-authenticated exchange, CPace, so a recording
            gives nothing to test a guessed passphrase against; an
            ephemeral key exchange on top): nothing to manage.
        tls_cert, tls_key, tls_ca: PEM files for mutual TLS instead of the
            pre-shared key: this worker's certificate chain and private
            key, and the CA that must have signed every peer's certificate.
            All three or none. Default ``TORCH_RPC_EXT_TLS_CERT``,
            ``TORCH_RPC_EXT_TLS_KEY``, ``TORCH_RPC_EXT_TLS_CA``.
        tls_peer_names: With mutual TLS, who a peer must be, beside being
            signed by ``tls_ca``: glob patterns (``fnmatch``: ``*``, ``?``,
            ``[...]``), one of which must match one of the peer
            certificate's names (its DNS and URI subject alternative names,
            or its subject's CN when it has none), e.g.
            ``("spiffe://cluster.local/ns/train/sa/*",)`` or
            ``("*.workers.example.com",)``. Both ends check, at every
            connection; a certificate that matches none fails it naming its
            names. Default ``TORCH_RPC_EXT_TLS_PEER_NAMES`` (comma-separated),
            else ``()``: any certificate the CA signed.
        hold_off_exempt: Addresses and networks (``"10.0.0.0/8"``,
            ``"fd00::/8"``, ``"10.1.2.3"``) never held off. A source whose
            proofs are refused 8 times within 10 s (a wrong secret, a failed
            TLS handshake) has its connections closed unread for 30 s, on
            the listener and on tcp_lanes' (docs/security.md, "online
            guesser"); where several workers share one address (a NAT, a
            host's other jobs), one started with the wrong secret holds its
            neighbours off with itself. Listed sources are not held off;
            their refusals are counted (``hold_off_exempt_failures``).
            Default ``TORCH_RPC_EXT_HOLD_OFF_EXEMPT`` (comma-separated),
            else ``()``.
        max_frame_bytes: Largest message accepted or sent; a peer announcing
            more is disconnected before anything is allocated.
        handshake_timeout: Seconds a new connection has to authenticate.
        heartbeat_timeout: Seconds a connection may show no sign of life
            (nothing received, nothing of ours accepted) before it is
            declared dead and its pending calls fail naming the peer; idle
            connections are pinged every ``heartbeat_timeout / 5`` seconds,
            so a silent partition or a frozen peer is detected. A large
            tensor held for its stripes on lanes that carry nothing for
            twice this fails its connection naming the lanes. 0 disables.
        busy_poll_us: After serving a request, a transport thread polls for
            the next one this many microseconds before sleeping in the kernel,
            which saves a wake-up (tens of microseconds on a VM) when calls
            come back to back. A caller polls likewise for the response to a
            lone call, and after its last call in flight completes (an
            rpc_sync loop sends the next one at once). Adaptive: polls that
            keep finding nothing are skipped for a while. Costs up to this
            much CPU per call when calls are spaced further apart. 0 never
            polls; at most 10000.
        poll_on_caller_cpu: A transport thread about to poll for the
            response to a lone call (an ``rpc_sync``) moves to the CPU of the
            thread that made the call, which waits then (its affinity
            narrowed to that CPU and given back at once: nothing runs
            narrowed). Where a call's threads (the caller, its transport
            thread, the callee's) outnumber the CPUs, this keeps the two
            polling threads apart; else the scheduler often puts them on one
            CPU and each waits behind the other at every call. ``None`` (the
            default): on where the thread calling ``init_rpc`` may run on at
            most 2 CPUs.
        shm_frame_ring_bytes: Each direction of a connection to a worker on
            this host sends its frames through a shared-memory ring of this
            many bytes instead of its Unix socket: a frame costs a copy in and
            a copy out and no system call while the receiver is polling. A
            multiple of 4096 in [64 KiB, 64 MiB], or 0: the socket.
        max_cached_receive_bytes: Receive buffers for tensors of 1 MiB or more
            are recycled (already faulted in, huge-page backed); this bounds
            the idle cache. Idle buffers go back to the OS after 2 s.

    Raises:
        ValueError: An option is out of range or of the wrong kind.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = _DEFAULT["num_worker_threads"],
        rpc_timeout: float = _DEFAULT["rpc_timeout"],
        init_method: str = _DEFAULT["init_method"],
        device_maps: Mapping[str, Mapping[DeviceLike, DeviceLike]] | None = None,
        devices: Sequence[DeviceLike] | None = None,
        transports: Sequence[str] | None = None,
        channels: Sequence[str] | None = None,
        device_channels: Sequence[str] = _DEFAULT["device_channels"],
        address: str | None = _DEFAULT["address"],
        secret: bytes | str | None = _DEFAULT["secret"],
        encryption: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        tls_peer_names: Sequence[str] | None = None,
        hold_off_exempt: Sequence[str] | None = None,
        max_frame_bytes: int = _DEFAULT["max_frame_bytes"],
        handshake_timeout: float = _DEFAULT["handshake_timeout"],
        heartbeat_timeout: float = _DEFAULT["heartbeat_timeout"],
        busy_poll_us: int = _DEFAULT["busy_poll_us"],
        poll_on_caller_cpu: bool | None = _DEFAULT["poll_on_caller_cpu"],
        max_cached_receive_bytes: int = _DEFAULT["max_cached_receive_bytes"],
        shm_frame_ring_bytes: int = _DEFAULT["shm_frame_ring_bytes"],
        cuda_zero_copy: bool = _DEFAULT["cuda_zero_copy"],
        cuda_ipc_memory_limit: int = _DEFAULT["cuda_ipc_memory_limit"],
        shm_peers_any_user: bool = _DEFAULT["shm_peers_any_user"],
    ) -> None:
        _check_scalars(**{k: v for k, v in locals().items() if k in _SCALAR_CHECKS})
        if not isinstance(init_method, str):
            raise ValueError(f"init_method must be a str, got {init_method!r}")
        if transports is None:
            env = os.environ.get("TORCH_RPC_EXT_TRANSPORTS", "")
            transports = tuple(t.strip() for t in env.split(",") if t.strip())
            transports = transports or _DEFAULT["transports"]
        if isinstance(transports, str):
            transports = (transports,)
        transports = tuple(transports)
        known = _C.transport_names()
        if not transports:
            raise ValueError(f"transports must name at least one of {known}")
        if unknown := sorted(set(transports) - set(known)):
            raise ValueError(f"unknown transports {unknown}; known: {known}")
        if len(set(transports)) != len(transports):
            raise ValueError(f"transports lists a transport twice: {transports}")
        # Left at its default, `channels` also puts tcp_lanes on encrypted
        # connections (across hosts with TLS: the cipher's work spread over
        # the lanes' threads); TORCH_RPC_EXT_LANES_WHEN_ENCRYPTED=0 keeps
        # them off. Named, they serve every TCP connection; left out of a
        # `channels` given, none.
        lanes_when_encrypted = False
        if channels is None:
            env = os.environ.get("TORCH_RPC_EXT_CHANNELS", "")
            channels = tuple(c.strip() for c in env.split(",") if c.strip())
            if channels == ("basic",):
                channels = ()  # the stream alone
            else:
                lanes_when_encrypted = not channels and os.environ.get(
                    "TORCH_RPC_EXT_LANES_WHEN_ENCRYPTED", "1") != "0"
                channels = channels or _DEFAULT["channels"]
        if isinstance(channels, str):
            channels = (channels,)
        channels = tuple(channels)
        known = _C.channel_names("cpu")
        if device := sorted(set(channels) & set(_C.channel_names("cuda"))):
            raise ValueError(
                f"channels lists {device}, which carry CUDA tensors: "
                f"channels names the CPU channels {known}; device channels "
                f"follow device_maps"
            )
        if unknown := sorted(set(channels) - set(known)):
            raise ValueError(
                f"unknown channels {unknown}; known: {known} (the stream, "
                f"'basic', carries what no channel takes and is always on)"
            )
        if len(set(channels)) != len(channels):
            raise ValueError(f"channels lists a channel twice: {channels}")
        if isinstance(device_channels, str):
            device_channels = (device_channels,)
        device_channels = tuple(device_channels)
        known = _C.channel_names("cuda")
        if not device_channels or set(device_channels) - set(known):
            raise ValueError(
                f"device_channels must name one or more of {known}, "
                f"got {device_channels!r}"
            )
        if len(set(device_channels)) != len(device_channels):
            raise ValueError(
                f"device_channels lists a channel twice: {device_channels}"
            )
        if address is not None and (not isinstance(address, str) or not address):
            raise ValueError(f"address must be a non-empty str, got {address!r}")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and (
            not isinstance(secret, bytes) or len(secret) < _MIN["secret"]
        ):
            raise ValueError(f"secret must be at least {_MIN['secret']} bytes")
        if secret is not None and (why := secrets.weakness(secret)):
            raise ValueError(f"secret is too weak to use: {why}")
        encryption, tls_files = check_encryption(encryption, tls_cert, tls_key, tls_ca, _DEFAULT["encryption"])
        tls_peer_names = check_peer_names(tls_peer_names, tls_files[0] is not None)
        hold_off_exempt = check_hold_off_exempt(hold_off_exempt)
        super().__init__(float(rpc_timeout), init_method)
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        self.devices = [_cuda_device(d) for d in devices] if devices is not None else None
        # The rest is stored in the core's fields (_RpcExtBackendOptionsBase).
        self.num_worker_threads = num_worker_threads
        self.transports = transports
        self.channels = channels
        self._lanes_when_encrypted = lanes_when_encrypted
        self.device_channels = device_channels
        self.address = address
        self.secret = secret
        self.encryption = encryption
        self.tls_cert, self.tls_key, self.tls_ca = tls_files
        self.tls_peer_names = tls_peer_names
        self.hold_off_exempt = hold_off_exempt
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout = float(handshake_timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.busy_poll_us = busy_poll_us
        self.poll_on_caller_cpu = poll_on_caller_cpu
        self.max_cached_receive_bytes = max_cached_receive_bytes
        self.shm_frame_ring_bytes = shm_frame_ring_bytes
        self.cuda_zero_copy = cuda_zero_copy
        self.cuda_ipc_memory_limit = cuda_ipc_memory_limit
        self.shm_peers_any_user = shm_peers_any_user

    def __setattr__(self, name: str, value: object) -> None:
        # An option set after construction is checked as the constructor
        # checks it (upstream's code sets options this way too).
        if (check := _SCALAR_CHECKS.get(name)) is not None:
            check(value)
        if name == "hold_off_exempt":  # (normalised as at construction)
            value = check_hold_off_exempt(value)
        super().__setattr__(name, value)

    def set_device_map(self, to: str, device_map: Mapping[DeviceLike, DeviceLike]) -> None:
        """Map local devices to devices of worker ``to``, merged with what was
        set before, with TensorPipe's semantics: ints are CUDA indices,
        ``"cpu"`` keys map CPU tensors to a device of the callee, responses
        follow the inverse map. Two local devices mapped to one remote device
        across calls is caught at ``init_rpc``, as upstream does.

        Raises:
            ValueError: a device is malformed, one map sends two devices to
                one, or a device already mapped is mapped elsewhere (the
                texts of ``TensorPipeRpcBackendOptions``).
            RuntimeError: a negative device index (torch's own).
        """
        new = _check_map(to, device_map)
        merged = dict(self.device_maps.get(to, {}))
        for k, v in new.items():
            if k in merged and merged[k] != v:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, trying"
                    f" to map {k} to {v} and {merged[k]}"
                )
            merged[k] = v
        self.device_maps[to] = merged

    def set_devices(self, devices: Sequence[DeviceLike]) -> None:
        """Set the local (CUDA) devices the agent may use."""
        self.devices = [_cuda_device(d) for d in devices]

    def uses_cuda(self) -> bool:
        """Whether any device map or device names a CUDA device."""
        devs = list(self.devices or [])
        for m in self.device_maps.values():
            devs += list(m.keys()) + list(m.values())
        # (Any device-like value: the lists may have been assigned or
        # changed in place since the constructor checked them.)
        return any(_device(d, "a device").type == "cuda" for d in devs)

    def __repr__(self) -> str:
        if "device_maps" not in self.__dict__:
            # __init__ refused its arguments before the C++ part existed
            # (a traceback's locals show such an object): reading that part
            # would crash.
            return "RpcExtBackendOptions(<not constructed>)"
        return (
            f"RpcExtBackendOptions(num_worker_threads={self.num_worker_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, "
            f"transports={self.transports}, channels={self.channels}, "
            f"device_channels={self.device_channels}, "
            f"cuda_zero_copy={self.cuda_zero_copy}, "
            f"address={self.address!r}, encryption={self.encryption!r}, "
            f"max_frame_bytes={self.max_frame_bytes})"
        )

# SPDX-License-Identifier: BSD-3-Clause
"""Construct and init handlers of the TORCH_RPC_EXT backend; idempotent registration."""

import os
from typing import Any

import torch
from torch.distributed.rpc import constants

from torch_rpc_ext import _C, _torch_private, secrets, store_records
from torch_rpc_ext._tensorpipe_options import translate_options
from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "TORCH_RPC_EXT"


def _construct_options(
    rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = constants.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> RpcExtBackendOptions:
    return RpcExtBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _agent_options(opts: RpcExtBackendOptions) -> "_C._RpcExtBackendOptionsBase":
    """What the agent takes: a copy of the core part of ``opts`` (which stays
    as given), with the secret from ``TORCH_RPC_EXT_SECRET`` if ``opts`` has
    none, stretched (torch_rpc_ext/secrets.py).
    """
    out = _C._RpcExtBackendOptionsBase(opts)
    if out.secret is None and (env := os.environ.get("TORCH_RPC_EXT_SECRET")):
        if len(env.encode()) < (least := _C.option_spec()["secret"][1]):
            raise ValueError(f"TORCH_RPC_EXT_SECRET must be at least {least} bytes")
        if why := secrets.weakness(env.encode()):
            raise ValueError(f"TORCH_RPC_EXT_SECRET is too weak to use: {why}")
        out.secret = env.encode()
    if out.secret is not None:
        out.secret = secrets.stretch(out.secret)
    return out


_DEVICES_KEY = "torch_rpc_ext/devices/"
_COUNT_KEY = "torch_rpc_ext/device_count/"
_READ_KEY = "torch_rpc_ext/devices_read/"


def _gathered(
    store: Any, rank: int, world_size: int, key: str, record: bytes, decode: Any
) -> list:
    """Publish ``record`` under ``key`` and read every worker's, each checked
    by ``decode`` (store_records: JSON, never a pickle; the store is
    unauthenticated). One request: ``multi_get`` waits for keys not set yet,
    as ``get`` does."""
    store.set(f"{key}{rank}", record)
    values = store.multi_get([f"{key}{r}" for r in range(world_size)])
    return [decode(v, r, f"{key}{r}") for r, v in enumerate(values)]


def _check_device_maps(
    store: Any, name: str, rank: int, world_size: int, opts: RpcExtBackendOptions
) -> tuple[dict, list]:
    """Gather every worker's device maps and devices through the store and
    check them with upstream's validator, so a bad map fails init on every
    worker with TensorPipe's text (before any agent exists). Returns this
    worker's reverse maps and devices.

    A group where nobody names a device costs one store round and never asks
    torch about CUDA. Otherwise a second round publishes device counts: the
    real one from the workers whose own maps and devices, or a map to them,
    name a CUDA device (so no other worker asks torch about CUDA), 0 from
    the others, whose count no check reads.
    """
    mine = store_records.encode_devices(name, opts.device_maps, opts.devices or [])
    entries = _gathered(
        store, rank, world_size, _DEVICES_KEY, mine, store_records.decode_devices
    )
    names = [n for n, _, _ in entries]
    maps = {n: m for n, m, _ in entries}
    devices = {n: d for n, _, d in entries}
    if not any(maps.values()) and not any(devices.values()):
        return {}, []
    count = torch.cuda.device_count() if _names_cuda(opts, name, maps) else 0
    counts = dict(zip(names, _gathered(
        store, rank, world_size, _COUNT_KEY, store_records.encode_count(count),
        store_records.decode_count,
    )))
    store.set(f"{_READ_KEY}{rank}", b"1")
    try:
        return _torch_private.validate_device_maps(names, counts, maps, devices, name)
    except ValueError:
        # Every worker fails alike. Rank 0 hosts the store under torch's
        # rendezvous and takes it down as it fails: it waits until the
        # others have read.
        if rank == 0:
            store.wait([f"{_READ_KEY}{r}" for r in range(1, world_size)])
        raise


def _names_cuda(opts: RpcExtBackendOptions, name: str, maps: dict) -> bool:
    """Whether this worker's own maps and devices, or a map that targets it,
    name a CUDA device (only then is torch asked for a device count)."""
    if opts.uses_cuda():
        return True
    return any(
        dev.type == "cuda" for m in maps.values() for dev in m.get(name, {}).values()
    )


def _init_backend(
    store: Any,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: Any,
) -> Any:
    # TensorPipe's options are taken as the launcher takes them: a program
    # that changes only its backend runs (TensorPipe-only settings reported).
    rpc_backend_options = translate_options(rpc_backend_options)
    # A name torch's WorkerInfo refuses fails here, in its words, before this
    # worker publishes it (its peers read it as a record no worker wrote).
    torch.distributed.rpc.WorkerInfo(name, 0)
    # 0 is a dynamic group, as upstream's init_rpc and TensorPipe take it.
    world_size = world_size or None
    metrics_port = _metrics_port()  # a bad value fails before anything starts
    if metrics_port is not None:
        # So does a port taken (before this worker's rendezvous, which its
        # peers would otherwise wait in until their timeout).
        from torch_rpc_ext import metrics

        metrics_port = metrics.serve_env_port(metrics_port)
    # OpenTelemetry, where a provider is configured: before the agent (and
    # torch's Python call handler) starts.
    from torch_rpc_ext import tracing

    tracing.enable_if_configured()
    _claim_group_kind(store, dynamic=world_size is None)
    if world_size is None:
        return _init_dynamic(store, name, rank, rpc_backend_options, metrics_port)
    # (Before the store rounds: a bad TORCH_RPC_EXT_SECRET fails here, not
    # after its peers went on to wait in the agent's rendezvous.)
    options = _agent_options(rpc_backend_options)
    reverse, devices = _check_device_maps(store, name, rank, world_size, rpc_backend_options)
    # The devices whose tensors need a device channel (a CPU-to-CPU map
    # needs none).
    devices = [d for d in devices if d.type == "cuda"]
    if devices:
        # Only reachable where the maps name GPUs this machine has.
        _prepare_cuda(options, devices)
    if devices or any(rpc_backend_options.device_maps.values()) or any(reverse.values()):
        # Maps between the CPU and a GPU apply on a worker without GPUs of
        # its own too: {0: "cpu"} to it, its replies go back by {"cpu": 0}.
        options._device_maps = rpc_backend_options.device_maps
        options._reverse_device_maps = reverse
    # Before the agent, which serves calls from its rendezvous on: a peer's
    # first call may ask where the metrics are.
    _serve_metrics(store, name, metrics_port)
    agent = _C.Agent(store, name, rank, world_size, options)
    try:
        from torch_rpc_ext import elastic

        _torch_private.install_shutdown(elastic.stop_membership)
        _torch_private.install_builtin_frontend(
            _C._invoke_rpc_builtin, _C._set_invoke_rpc_builtin_fallback,
            _C._invoke_rpc, _C._set_invoke_rpc_fallback)
        _torch_private.init_rpc_states(agent)
    except Exception:
        _torch_private.release_agent()
        agent.shutdown()
        raise
    return agent


def _metrics_port() -> int | None:
    """TORCH_RPC_EXT_METRICS_PORT: Prometheus metrics from init_rpc, for a
    program one does not edit (torch_rpc_ext.metrics)."""
    import os

    if not os.environ.get("TORCH_RPC_EXT_METRICS_PORT", "").strip():
        return None
    from torch_rpc_ext import metrics

    return metrics.port_from_env()


def _serve_metrics(store: Any, name: str, port: int | None) -> None:
    if port is not None:
        from torch_rpc_ext import metrics

        metrics.serve_from_env(store, name, port)


def _prepare_cuda(options: Any, devices: list) -> None:
    """What a worker with CUDA devices needs before a peer can send it a
    CUDA tensor: torch's CUDA state (its caching allocator has no tables for
    a device until torch's lazy init, which a worker that never used CUDA
    itself, a parameter server say, has not run: its first CUDA tensor would
    fail; torch's own backend registry does the same for TensorPipe), then
    the copy kernels (read from the package, before the agent connects to
    anyone). The agent warms each device's context, streams and kernels as
    it starts, and checks torch's state again before it first allocates.
    Then the agent's devices, and their landing pools where those are on
    (torch_rpc_ext._cuda.landing_pool: the memory granted to peers, which
    their large tensors arrive in as torch's memory, so not under
    cuda_zero_copy)."""
    torch.cuda.init()
    from torch_rpc_ext._cuda import landing_pool, load_kernels

    load_kernels()
    options._devices = devices
    if landing_pool.enabled() and not options.cuda_zero_copy:
        options._landing_pools = landing_pool.landing_pools(devices)


_GROUP_KIND_KEY = "torch_rpc_ext/group_kind"
# Where a dynamic group's membership log lives, on the store beneath
# init_rpc's per-call prefix (so a process that calls init_rpc again, under
# another prefix, finds the same group).
_ELASTIC_PREFIX = "torch_rpc_ext/elastic/default/"


def _claim_group_kind(store: Any, dynamic: bool) -> None:
    """The first member decides whether the group is static or dynamic;
    a member of the other kind fails with upstream's text."""
    kind = b"dynamic" if dynamic else b"static"
    if store.compare_set(_GROUP_KIND_KEY, b"", kind) != kind:
        raise RuntimeError(
            "RPC group mixes statically and dynamically initialized members "
            "which is not supported."
        )


def _dynamic_devices(name: str, opts: RpcExtBackendOptions) -> list:
    """The CUDA devices a member of a dynamic group uses: those it names in
    ``devices``, the sources of its maps, and the targets of a map to
    itself. Its maps are checked here
    against its own devices; against its peers' when it joins (their
    records name the devices they receive on: dynamic_devices.h)."""
    maps = opts.device_maps or {}
    named = list(opts.devices or [])
    if not maps and not named:
        return []
    count = torch.cuda.device_count()

    def local(device: torch.device, what: str) -> torch.device:
        if device.type != "cuda":
            raise ValueError(
                f"TORCH_RPC_EXT: {name}'s {what} names {device}: a dynamic group maps "
                "CUDA devices only"
            )
        if device.index is None or device.index >= count:
            raise ValueError(
                f"TORCH_RPC_EXT: {name}'s {what} names {device}, but this process "
                f"sees {count} CUDA device(s)"
            )
        return device

    devices = {local(d, "devices") for d in named}
    for peer, mapping in maps.items():
        targets = list(mapping.values())
        for target in targets:
            if target.type != "cuda" or target.index is None:
                raise ValueError(
                    f"TORCH_RPC_EXT: {name}'s device map to {peer} names {target}: a "
                    "dynamic group maps CUDA devices only"
                )
        if len(set(targets)) != len(targets):
            raise ValueError(
                f"TORCH_RPC_EXT: {name}'s device map to {peer} maps two devices to one "
                f"({dict(mapping)})"
            )
        devices |= {local(d, f"device map to {peer}") for d in mapping}
        if peer == name:
            # A map to itself receives on its targets too: no peer's join
            # checks them against what it publishes (a static group's
            # device list takes reverse maps' targets the same way).
            devices |= {local(t, f"device map to {peer}") for t in targets}
    return sorted(devices, key=lambda d: d.index)


def _init_dynamic(store: Any, name: str, rank: int, opts: RpcExtBackendOptions,
                  metrics_port: int | None = None) -> Any:
    """Join (or start) the dynamic group whose membership log is in ``store``."""
    import torch.distributed as dist

    options = _agent_options(opts)
    devices = _dynamic_devices(name, opts)
    if devices:
        _prepare_cuda(options, devices)
        options._device_maps = opts.device_maps
        options._reverse_device_maps = {}  # per peer, from its join record
    base = getattr(store, "underlying_store", store)
    _serve_metrics(store, name, metrics_port)  # before the agent serves calls
    agent = _C.Agent(dist.PrefixStore(_ELASTIC_PREFIX, base), name, rank, 0, options)
    try:
        from torch_rpc_ext import elastic

        _torch_private.install_shutdown(elastic.stop_membership)
        _torch_private.install_builtin_frontend(
            _C._invoke_rpc_builtin, _C._set_invoke_rpc_builtin_fallback,
            _C._invoke_rpc, _C._set_invoke_rpc_fallback)
        _torch_private.init_rpc_states(agent)
        elastic.start_event_thread(agent)
    except Exception:
        _torch_private.release_agent()
        agent.shutdown()
        raise
    return agent


def register() -> Any:
    """Register TORCH_RPC_EXT (once) and return its ``BackendType`` member."""
    return _torch_private.register_backend(
        BACKEND_NAME, _construct_options, _init_backend
    )

# SPDX-License-Identifier: BSD-3-Clause
"""What workers publish in the c10d store at ``init_rpc``, as versioned JSON.

The store has no authentication: anyone who reaches its port can write
there. So nothing read from it is unpickled or trusted: each value is a
small JSON object with a version, checked field by field, and anything else
fails ``init_rpc`` naming the rank and the key, before any agent exists.

Two records, one per worker and per round (backend.py, ``_gathered``):

- devices: ``{"v": 1, "name": "worker0", "maps": {"worker1": {"cuda:0":
  "cuda:1"}}, "devices": ["cuda:0"]}``: the worker's name, device maps and
  devices, as upstream's validator takes them;
- device count: ``{"v": 1, "count": 2}``.
"""

import json
import re
from typing import Any

import torch

__all__ = [
    "MAX_RECORD_BYTES",
    "decode_count",
    "decode_devices",
    "encode_count",
    "encode_devices",
]

VERSION = 1
# A worker's maps name at most every peer once; 1 MiB is far past any real
# group's (a map is a few dozen bytes a peer).
MAX_RECORD_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_:\-]{1,127}")  # WorkerInfo's names
# A device map's target is any name the user gave (upstream's validator
# refuses one that is no worker's, in its own words, on every worker).
_MAX_TARGET = 1024
_DEVICE = re.compile(r"(cpu|cuda:(\d{1,4}))")
_MAX_DEVICES = 4096


def _device_text(device: Any) -> str:
    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type == "cuda" and d.index is not None:
        return f"cuda:{d.index}"
    raise ValueError(f"a device map or devices entry names {d}: only cpu and cuda:<index>")


def encode_devices(name: str, maps: dict, devices: list) -> bytes:
    """One worker's device record."""
    return json.dumps(
        {
            "v": VERSION,
            "name": name,
            "maps": {
                peer: {_device_text(s): _device_text(t) for s, t in m.items()}
                for peer, m in (maps or {}).items()
            },
            "devices": [_device_text(d) for d in devices or []],
        },
        sort_keys=True,
    ).encode()


def encode_count(count: int) -> bytes:
    return json.dumps({"v": VERSION, "count": int(count)}).encode()


class _Bad(ValueError):
    pass


def _load(raw: bytes, fields: set[str]) -> dict:
    if not isinstance(raw, (bytes, bytearray)):
        raise _Bad(f"not bytes but {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise _Bad(f"{len(raw)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Bad(f"not JSON ({bytes(raw[:16])!r}...)") from None
    if not isinstance(value, dict):
        raise _Bad(f"a JSON {type(value).__name__}, not an object")
    if value.get("v") != VERSION:
        raise _Bad(f"version {value.get('v')!r}, this build reads {VERSION}")
    if set(value) != fields:
        raise _Bad(f"fields {sorted(value)}, expected {sorted(fields)}")
    return value


def _device(text: Any) -> torch.device:
    if not isinstance(text, str) or not _DEVICE.fullmatch(text):
        raise _Bad(f"device {str(text)[:40]!r} is not cpu or cuda:<index>")
    return torch.device(text)


def _name(text: Any, what: str) -> str:
    if not isinstance(text, str) or not _NAME.fullmatch(text):
        raise _Bad(f"{what} {str(text)[:40]!r} is not a worker name")
    return text


def _checked(decode):
    def wrapper(raw: bytes, rank: int, key: str):
        try:
            return decode(raw)
        except _Bad as e:
            raise ValueError(
                f"TORCH_RPC_EXT: rank {rank}'s record under {key!r} in the rendezvous "
                f"store is malformed ({e}); something other than a torch_rpc_ext worker "
                "of this version wrote it (the store is unauthenticated: see "
                "docs/security.md)"
            ) from None

    wrapper.__doc__ = decode.__doc__
    return wrapper


@_checked
def decode_devices(raw: bytes) -> tuple[str, dict, list]:
    """(name, maps, devices) of a device record, as torch.device values."""
    value = _load(raw, {"v", "name", "maps", "devices"})
    name = _name(value["name"], "name")
    maps, devices = value["maps"], value["devices"]
    if not isinstance(maps, dict) or len(maps) > 1 << 16:
        raise _Bad("maps is not an object of peers")
    if not isinstance(devices, list) or len(devices) > _MAX_DEVICES:
        raise _Bad("devices is not a list of devices")
    out_maps = {}
    for peer, mapping in maps.items():
        if not isinstance(mapping, dict) or len(mapping) > _MAX_DEVICES:
            raise _Bad(f"the map to {peer[:40]!r} is not an object of devices")
        if not peer or len(peer) > _MAX_TARGET:
            raise _Bad(f"the map to {peer[:40]!r} names no peer")
        out_maps[peer] = {_device(s): _device(t) for s, t in mapping.items()}
    return name, out_maps, [_device(d) for d in devices]


@_checked
def decode_count(raw: bytes) -> int:
    """The device count of a count record."""
    value = _load(raw, {"v", "count"})
    count = value["count"]
    if type(count) is not int or not 0 <= count <= _MAX_DEVICES:
        raise _Bad(f"count {str(count)[:20]} is not 0..{_MAX_DEVICES}")
    return count

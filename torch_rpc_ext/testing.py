# SPDX-License-Identifier: BSD-3-Clause
"""Fault injection for tests: the FAULTY_TORCH_RPC_EXT backend.

Importing this module registers ``rpc.BackendType.FAULTY_TORCH_RPC_EXT``, the
counterpart of upstream's ``FAULTY_TENSORPIPE`` with the same knobs::

    import torch_rpc_ext.testing
    opts = torch_rpc_ext.testing.FaultyRpcExtBackendOptions(
        num_fail_sends=3,                       # fail the first 3 sends ...
        messages_to_fail=["RREF_FORK_REQUEST"], # ... of each message of these types
        messages_to_delay={"SCRIPT_CALL": 1.5}, # hold these back 1.5 s before writing
    )

A failed send's future carries an RPC error of type INTENTIONAL_FAILURE, so
upstream's retrying senders (RRef and dist-autograd control messages) retry
it. Delays do not block the caller: the message waits on the agent's pool
while its timeout runs. Everything else is the TORCH_RPC_EXT agent.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.rpc import constants

from torch_rpc_ext import _torch_private
from torch_rpc_ext.backend import _init_backend
from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = ["FAULTY_BACKEND_NAME", "FaultyRpcExtBackendOptions", "register_faulty"]

FAULTY_BACKEND_NAME = "FAULTY_TORCH_RPC_EXT"


class FaultyRpcExtBackendOptions(RpcExtBackendOptions):
    """RpcExtBackendOptions plus fault injection (tests only)."""

    def __init__(
        self,
        *,
        num_fail_sends: int = 0,
        messages_to_fail: Sequence[str] = (),
        messages_to_delay: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(num_fail_sends, bool) or not isinstance(num_fail_sends, int) or num_fail_sends < 0:
            raise ValueError(f"num_fail_sends must be an int >= 0, got {num_fail_sends!r}")
        messages_to_delay = dict(messages_to_delay or {})
        for name, seconds in messages_to_delay.items():
            if not isinstance(seconds, (int, float)) or seconds < 0:
                raise ValueError(f"messages_to_delay[{name!r}] must be >= 0 seconds, got {seconds!r}")
        super().__init__(**kwargs)
        self.num_fail_sends = num_fail_sends
        self.messages_to_fail = list(messages_to_fail)
        self.messages_to_delay = messages_to_delay

    def _fault_injection(self) -> tuple[int, list[str], dict[str, float]]:
        return self.num_fail_sends, self.messages_to_fail, self.messages_to_delay


def _construct_options(
    rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = constants.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> FaultyRpcExtBackendOptions:
    return FaultyRpcExtBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def register_faulty() -> Any:
    """Register FAULTY_TORCH_RPC_EXT (once) and return its ``BackendType`` member."""
    return _torch_private.register_backend(FAULTY_BACKEND_NAME, _construct_options, _init_backend)


FAULTY_BACKEND = register_faulty()

# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext.scripting without processes: the registry's API, names,
and the operators' contracts with TorchScript (no RPC needed)."""

import sys

import pytest
import torch

from torch_rpc_ext import scripting


def double(x):
    return x * 2


@torch.jit.script
def script_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_register_list_replace_and_unregister():
    scripting.register("unit.double", double)
    scripting.register("unit.script_double", script_double)
    listed = scripting.registered()
    assert listed["unit.double"] == "python"
    assert listed["unit.script_double"].startswith("torchscript __torch__.")
    scripting.register("unit.double", script_double)  # replaced
    assert scripting.registered()["unit.double"].startswith("torchscript ")
    assert scripting.unregister("unit.double") is True
    assert scripting.unregister("unit.double") is False
    assert scripting.unregister("unit.script_double") is True
    assert "unit.double" not in scripting.registered()


@pytest.mark.parametrize("name", ["", "a..b", ".a", "a.", "1abc", "a-b", "a b", "x" * 257])
def test_names_must_be_dotted_identifiers(name):
    with pytest.raises(ValueError, match="invalid remote function name"):
        scripting.register(name, double)
    assert name not in scripting.registered()


def test_functions_and_fakes_must_be_callable():
    with pytest.raises(TypeError, match="must be callable, got int"):
        scripting.register("unit.not_callable", 3)
    with pytest.raises(TypeError, match="fake for 'unit.bad_fake' must be callable"):
        scripting.register("unit.bad_fake", double, fake="shape")
    assert not {"unit.not_callable", "unit.bad_fake"} & set(scripting.registered())


def test_calls_without_rpc_say_so():
    with pytest.raises(RuntimeError, match="RPC is not initialized in this process"):
        scripting.rpc_sync("worker1", "unit.double", torch.ones(1))
    with pytest.raises(RuntimeError, match="RPC is not initialized in this process"):
        torch.ops.torch_rpc_ext.call_tensors("worker1", "unit.double", [torch.ones(1)], "")


def test_torchscript_keeps_a_call_whose_value_is_unused():
    # CONSERVATIVE alias analysis marks the call as a side effect; with
    # upstream's default (FROM_SCHEMA) dead-code elimination removes it.
    @torch.jit.script
    def notify(x: torch.Tensor) -> torch.Tensor:
        torch.ops.torch_rpc_ext.rpc_sync("worker1", "unit.double", (x,))
        return x

    graph = notify.graph.copy()
    torch._C._jit_pass_dce(graph)
    kinds = [n.kind() for n in graph.nodes()]
    assert "torch_rpc_ext::rpc_sync" in kinds


def test_operator_schemas():
    ops = torch.ops.torch_rpc_ext
    assert str(ops.rpc_sync.default._schema) == (
        "torch_rpc_ext::rpc_sync(str to, str name, Any? args=None, float timeout=-1.) -> Any"
    )
    assert str(ops.rpc_async.default._schema).endswith("-> Future(Any)")
    assert str(ops.call_tensors.default._schema) == (
        "torch_rpc_ext::call_tensors(str to, str name, Tensor[] args, "
        'str constants="", float timeout=-1., str outputs="") -> Tensor[]'
    )


def test_compiled_call_outputs_round_trip():
    # What the fake returns and call_tensors holds the real outputs to.
    outs = [((4, 3), torch.float32), ((), torch.bfloat16), ((0,), torch.int64)]
    text = scripting._encode_outputs(outs)
    assert text == "3|float32:4,3|bfloat16:|int64:0"
    assert scripting._decode_outputs(text) == outs
    assert scripting._decode_outputs(scripting._encode_outputs([])) == []
    for bad in ("2|float32:4", "1|float33:4", "1|Tensor:4", "x|float32:4", "-1"):
        with pytest.raises(ValueError, match="malformed compiled-call outputs"):
            scripting._decode_outputs(bad)


def test_compiled_call_constants_go_back_to_their_positions():
    from torch_rpc_ext import _C

    t = torch.ones(1)
    encoded = scripting._encode_constants(((0, None), (2, 2.5), (3, "a=b"), (4, True), (5, -7)))
    args = _C._scripting.compiled_arguments([t, t * 2], encoded)
    assert args[0] is None and args[2] == 2.5 and args[3] == "a=b"
    assert args[4] is True and args[5] == -7
    assert torch.equal(args[1], t) and torch.equal(args[6], t * 2)
    for bad in ("0=x1", "0=i12abc", "-1=i3", "0=b2", "0=n1", "0", "0=i99999999999999999999"):
        with pytest.raises(ValueError, match="malformed compiled-call constant"):
            _C._scripting.compiled_arguments([t], bad)
    with pytest.raises(ValueError, match="position 0 given twice"):
        _C._scripting.compiled_arguments([t], "0=i1\x1f0=i2")
    assert not scripting._encodable(2**63) and scripting._encodable(2**63 - 1)
    assert not scripting._encodable("a\x1fb") and scripting._encodable(2.5)
    with pytest.raises(ValueError, match="out of range"):
        _C._scripting.compiled_arguments([], "1=i3")


def test_importing_the_package_leaves_dynamo_unimported():
    """A worker that never compiles does not pay for torch._dynamo (1.7 s of
    every process's start on 2 cores, when scripting.py imported it)."""
    import subprocess

    code = "import sys, torch_rpc_ext; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_assume_constant_result_without_dynamo_marks_what_dynamos_does():
    """The shim sets exactly what torch._dynamo.assume_constant_result sets on
    this torch (a torch that changes the decorator fails here)."""
    import torch._dynamo

    from torch_rpc_ext import _torch_private

    def theirs():
        pass

    def ours():
        pass

    torch._dynamo.assume_constant_result(theirs)
    dynamo = sys.modules.pop("torch._dynamo")
    try:
        _torch_private.assume_constant_result(ours)
    finally:
        sys.modules["torch._dynamo"] = dynamo
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}

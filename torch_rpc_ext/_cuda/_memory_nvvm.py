# SPDX-License-Identifier: BSD-3-Clause
"""The compiled side of _memory.py: numba intrinsics over global memory.

Each turns a uint64 address into a pointer in the global address space
(``inttoptr``, addrspace 1) and emits one load or store with the natural
alignment, so NVVM prints ``ld.global.u8`` ... ``ld.global.v2.u64``. Anything
but a uint64 address (or a value of another width) fails to type, which keeps
the kernels' index math in uint64 (a signed operand would turn it into f64).
"""

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

__all__ = [
    "copy16",
    "load_u8",
    "load_u16",
    "load_u32",
    "load_u64",
    "store_u8",
    "store_u16",
    "store_u32",
    "store_u64",
]

_GLOBAL = 1  # NVVM's global address space


def _pointer(builder, addr, lltype):
    return builder.inttoptr(addr, ir.PointerType(lltype, addrspace=_GLOBAL))


def _make_load(bits: int):
    value_type = getattr(types, f"uint{bits}")

    def load(typingctx, addr):
        if addr != types.uint64:
            return None

        def codegen(context, builder, sig, args):
            ptr = _pointer(builder, args[0], ir.IntType(bits))
            return builder.load(ptr, align=bits // 8)

        return value_type(types.uint64), codegen

    load.__name__ = f"load_u{bits}"
    return intrinsic(load)


def _make_store(bits: int):
    value_type = getattr(types, f"uint{bits}")

    def store(typingctx, addr, value):
        if addr != types.uint64 or value != value_type:
            return None

        def codegen(context, builder, sig, args):
            ptr = _pointer(builder, args[0], ir.IntType(bits))
            builder.store(args[1], ptr, align=bits // 8)
            return context.get_dummy_value()

        return types.void(types.uint64, value_type), codegen

    store.__name__ = f"store_u{bits}"
    return intrinsic(store)


load_u8, load_u16, load_u32, load_u64 = (_make_load(b) for b in (8, 16, 32, 64))
store_u8, store_u16, store_u32, store_u64 = (_make_store(b) for b in (8, 16, 32, 64))


@intrinsic
def copy16(typingctx, dst, src):
    if dst != types.uint64 or src != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.IntType(64), 2)
        value = builder.load(_pointer(builder, args[1], vector), align=16)
        builder.store(value, _pointer(builder, args[0], vector), align=16)
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64), codegen

"""Arrays from raw addresses inside numba code: `u8_at(address)` / `f32_at(address)` turn an
int64 address into a typed pointer for `numba.carray`. The one-call decode step passes
its weights this way (an int64 table, not a numba typed list, whose methods compile at
every start) and calls each block type's product through a C function pointer
(`call_void`). The
caller keeps the arrays alive."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _pointer_codegen(context, builder, sig, args):
    return builder.inttoptr(args[0], context.get_value_type(sig.return_type))


@intrinsic
def u8_at(typingctx, address):
    """The int64 `address` as a uint8 pointer."""
    if not isinstance(address, types.Integer):
        return None
    return types.CPointer(types.uint8)(address), _pointer_codegen


@intrinsic
def f32_at(typingctx, address):
    """The int64 `address` as a float32 pointer."""
    if not isinstance(address, types.Integer):
        return None
    return types.CPointer(types.float32)(address), _pointer_codegen


@intrinsic
def call_void(typingctx, address, args):
    """Call the C function at int64 `address` with `args`, a tuple of int64, returning
    nothing (a `numba.cfunc` of signature void(int64, ...): its `.address`)."""
    if not (isinstance(address, types.Integer) and isinstance(args, types.BaseTuple)
            and all(isinstance(t, types.Integer) for t in args.types)):
        return None

    def codegen(context, builder, sig, llargs):
        i64 = ir.IntType(64)
        vals = [context.cast(builder, v, t, types.int64)
                for v, t in zip(cgutils.unpack_tuple(builder, llargs[1], len(args.types)), args.types)]
        fnty = ir.FunctionType(ir.VoidType(), [i64] * len(vals))
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), vals)
        return context.get_dummy_value()

    return types.none(address, args), codegen

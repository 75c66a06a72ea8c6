"""Per-type numba functions made from one template and a type's registry entry
(`backends.quant.registry`): the pair loader it names, bound as the template's global
`_load2`, under a name of the type's own.

Why a copy of the template with its own globals and name, not a closure: numba's on-disk
cache (numba/core/caching.py, 0.68) names a function's index file by its qualname and
first line, and keys entries by signature and hashes of the bytecode and of the pickled
closure cells. A dispatcher pickles with a uuid drawn fresh in each process, so a closure
over a loader would never hit the cache (and would add an entry every start); closures
from one factory would also share one index file. A copy with the loader as a global has
no cells (its key is stable) and its own qualname (its own index file), exactly like a
hand-written function per type.
"""

from __future__ import annotations

import importlib
import types

from panechat.backends.quant.registry import QuantType


def loader_of(t: QuantType):
    """The CPU pair loader that `t.cpu_loader` names ("module:function")."""
    return _named(t.cpu_loader)


def _named(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def packed_columns_of(t: QuantType):
    """The column product over repacked weights that `t.cpu_packed` names, or None; its AMX
    form (`t.cpu_amx`, the same bits) where `uses_amx(t)`."""
    if not t.cpu_packed:
        return None
    return _named(t.cpu_amx if uses_amx(t) else t.cpu_packed)


def uses_amx(t: QuantType) -> bool:
    """Whether `t`'s repacked product runs in its AMX form: it has one (`cpu_amx`) and this
    process may run AMX tiles (`amx_tiles.enabled()`)."""
    if not (t.cpu_packed and t.cpu_amx):
        return False
    from panechat.backends.cpu import amx_tiles

    return amx_tiles.enabled()


def packed_activations(t: QuantType) -> str:
    """The rows `t`'s repacked column product takes: "int16" (`packed32.quantized_rows`) or
    "q8k" (`q8k_dot.quantized_rows`), its module's ACTIVATIONS."""
    module, _, _ = t.cpu_packed.partition(":")
    return getattr(importlib.import_module(module), "ACTIVATIONS", "int16")


def cacheable(t: QuantType) -> bool:
    """Whether `t`'s generated code may go to numba's on-disk cache: only when its loader is
    panechat's own (a loader elsewhere, a test's, is not in the sources that key the cache)."""
    return t.cpu_loader.startswith("panechat.")


def bind_loader(template, name: str, load2):
    """A copy of the plain function `template` named `name` (a valid identifier) whose global
    `_load2` is `load2`; the other globals are the template module's."""
    if not name.isidentifier():
        raise ValueError(f"{name!r} is no function name")
    g = dict(template.__globals__, _load2=load2)
    f = types.FunctionType(template.__code__, g, name, template.__defaults__)
    f.__qualname__ = name
    return f


def kernel_name(prefix: str, t: QuantType, amx: bool = False) -> str:
    """The generated function's name for type `t`: "_linear_q4_k" for ("_linear", Q4_K);
    "_packed_q4_k_amx" for ("_packed", Q4_K, amx) (its own cache entry)."""
    return f"{prefix}_{t.name.lower()}" + ("_amx" if amx else "")

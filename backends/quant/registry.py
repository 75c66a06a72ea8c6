"""The GGML tensor types panechat reads: one entry per type, the one place a type is described
(ggml's `type_traits`, ggml.c, is the model).

An entry says what a type is (its ggml id, block geometry, where its f16 scales sit) and
which code reads it: the CPU pair loader by "module:function" name, and the CuPy kernel
family by key. backends/quant imports no backend, so the entries name that code as data;
backends/cpu and backends/cuda look the names up and build their kernel tables from here
(`quant_kernels` generates each type's numba kernels, `block_tasks` its one-call step
function and code). Adding a type is one `QuantType` here, plus its loader where the
arithmetic is new. `register` / `unregister` do the same at run time (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

_CPU = "panechat.backends.cpu.quant_kernels:"  # where the built-in pair loaders live
_PACKED = "panechat.backends.cpu."  # the module of a product over repacked records ("packed32:q4_0_columns")


@dataclass(frozen=True)
class QuantType:
    """One tensor type. A row of `block_weights` values is stored as blocks of `block_bytes`
    bytes (F32/F16/BF16: blocks of one value). `f16_at`: the bytes of each block's f16 scales
    (d first, then dmin or m). `scales_at_load`: the CPU kernels take those scales widened to
    float32 arrays [N, K / block_weights] at load (d, then dmin or d again), instead of
    reading them from the block in the kernel. `cpu_loader`: "module:function" of the CPU
    pair loader (`block_linear`'s load2), "" when the CPU keeps no blocks of it. `cuda_form`:
    the CuPy kernel family that reads it as stored ("" when none does). `cpu_packed`:
    "module:function" of the CPU column-range product over weights repacked at load into
    records of 16 columns (`repack`), against activations rounded to int16 per 32
    (`packed32`) or to 8 bits per 256 (llama.cpp's Q8_K: `packed256`): every weight of the
    type is repacked and every product of it uses that instead of the float32 pair-loader
    kernels; "" for none. `cpu_amx`: "module:function" of the same product (the same bits)
    where AMX tiles may run (`amx_tiles.enabled()`), choosing by row count between its tile
    products and `cpu_packed`'s; "" for none."""

    name: str
    type_id: int
    block_weights: int
    block_bytes: int
    f16_at: tuple[int, ...] = ()
    scales_at_load: bool = False
    cpu_loader: str = ""
    cuda_form: str = ""
    cpu_packed: str = ""
    cpu_amx: str = ""

    def fits(self, k: int) -> bool:
        """Whether a row of k values is whole blocks."""
        return k > 0 and k % self.block_weights == 0

    def row_bytes(self, k: int) -> int:
        """Bytes of a stored row of k values (whole blocks)."""
        return k // self.block_weights * self.block_bytes


def _block(name, type_id, weights, nbytes, f16_at, cuda_form="", at_load=False, packed="", amx="") -> QuantType:
    return QuantType(name, type_id, weights, nbytes, f16_at, at_load, f"{_CPU}_pair_{name.lower()}", cuda_form,
                     packed and f"{_PACKED}{packed}", amx and f"{_PACKED}{amx}")


# In the order messages list them (`read_types_text`); ids from ggml.h enum ggml_type,
# geometry from ggml-common.h (= gguf.GGML_QUANT_SIZES).
_BUILT_IN = (
    QuantType("F32", 0, 1, 4),
    QuantType("F16", 1, 1, 2),
    QuantType("BF16", 30, 1, 2),
    _block("Q4_0", 2, 32, 18, (0,), "q4", packed="packed32:q4_0_columns", amx="amx_blocks32:q4_0_columns_amx"),
    _block("Q4_1", 3, 32, 20, (0, 2), "q4", packed="packed32:q4_1_columns"),
    _block("Q5_0", 6, 32, 22, (0,), "q5"),
    _block("Q5_1", 7, 32, 24, (0, 2), "q5"),
    _block("Q8_0", 8, 32, 34, (0,), "q80", packed="packed32:q8_0_columns", amx="amx_blocks32:q8_0_columns_amx"),
    _block("Q2_K", 10, 256, 84, (80, 82), at_load=True),
    _block("Q3_K", 11, 256, 110, (108,), at_load=True),
    _block("Q4_K", 12, 256, 144, (0, 2), "q4k", at_load=True, packed="packed256:q4_k_columns",
           amx="packed256:q4_k_columns_amx"),
    _block("Q5_K", 13, 256, 176, (0, 2), "q5k", at_load=True, packed="packed256:q5_k_columns",
           amx="packed256:q5_k_columns_amx"),
    _block("Q6_K", 14, 256, 210, (208,), "q6k", at_load=True, packed="packed256:q6_k_columns",
           amx="packed256:q6_k_columns_amx"),
    _block("IQ4_NL", 20, 32, 18, (0,)),
    _block("IQ4_XS", 23, 256, 136, (0,), at_load=True),
)

_TYPES: dict[str, QuantType] = {t.name: t for t in _BUILT_IN}
_BY_ID: dict[int, QuantType] = {t.type_id: t for t in _BUILT_IN}


def get(name: str) -> QuantType | None:
    """The entry of type `name` ("Q4_K"), or None for a type panechat does not read."""
    return _TYPES.get(name)


def by_id(type_id: int) -> QuantType | None:
    """The entry of ggml type id `type_id`, or None."""
    return _BY_ID.get(type_id)


def types() -> tuple[QuantType, ...]:
    """Every registered type, in registration order."""
    return tuple(_TYPES.values())


def block_types() -> tuple[QuantType, ...]:
    """The types the CPU keeps in their blocks (those with a pair loader), in order."""
    return tuple(t for t in _TYPES.values() if t.cpu_loader)


def read_types_text() -> str:
    """The types panechat reads, for messages: "F32, F16, BF16, Q4_0, ..."."""
    return ", ".join(_TYPES)


def register(t: QuantType) -> None:
    """Add a type (raises ValueError when its name or id is taken)."""
    if t.name in _TYPES or t.type_id in _BY_ID:
        raise ValueError(f"quant type {t.name} (id {t.type_id}) is already registered")
    _TYPES[t.name], _BY_ID[t.type_id] = t, t


def unregister(name: str) -> None:
    """Remove the type `name` (a no-op when absent)."""
    t = _TYPES.pop(name, None)
    if t is not None:
        del _BY_ID[t.type_id]

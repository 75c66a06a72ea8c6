"""The CUDA C source of the CuPy backend's kernels and what describes it.

The C lives in kernels.cu and its parts (common, weights, linear, norm, activation, rope_kv,
attention, sampling .cuh); SOURCE is that text as one string (`cu_files.read_cu`) followed
by the linear_* entry points, generated here: one thin extern "C" kernel per weight format
and tile of constants.py's lists. Also here: the NVRTC options (the IEEE flags and the -D
defines of the geometry from constants.py), the kernel names, and their C signatures (which
the emulation checks every launch against). The numerical contract is in the package
docstring.
"""

from __future__ import annotations

import re

from panechat.backends.cuda.kernels.constants import BLOCK_KINDS, COL_TILES, CUDA_DEFINES, LINEAR_KINDS, ROW_TILES
from panechat.backends.cuda.kernels.cu_files import read_cu

_LINEAR_SIGNATURES = {
    "f32": ("const float* __restrict__ w", "WF32 ww{w, K};"),
    "f16": ("const unsigned short* __restrict__ w", "WF16 ww{w, K};"),
    "bf16": ("const unsigned short* __restrict__ w", "WBF16 ww{w, K};"),
    "q8": ("const signed char* __restrict__ q, const float* __restrict__ d, const float* __restrict__ m",
           "WQ8 ww{q, d, m, K, has_m, gshift};"),
    "q80": ("const signed char* __restrict__ q, const unsigned short* __restrict__ d", "WQ80 ww{q, d, K};"),
    "q4k": ("const unsigned char* __restrict__ b", "WQ4K ww{b, K};"),
    "q5k": ("const unsigned char* __restrict__ b", "WQ5K ww{b, K};"),
    "q6k": ("const unsigned char* __restrict__ b, const unsigned short* __restrict__ d", "WQ6K ww{b, d, K};"),
    "q4": ("const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, "
           "const unsigned short* __restrict__ m", "WQ4 ww{qs, d, m, K, has_m};"),
    "q5": ("const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, "
           "const unsigned short* __restrict__ m, const unsigned int* __restrict__ qh", "WQ5 ww{qs, d, m, qh, K, has_m};"),
}


def linear_kernel_name(kind: str, tm: int, nc: int) -> str:
    """Vector kernels linear_{kind}_{TM}_{NC}; the any-K scalar kernel is linear_{kind}_s."""
    return f"linear_{kind}_{tm}_{nc}" if tm else f"linear_{kind}_s"


def _linear_wrappers() -> str:
    """The extern "C" entry points: each builds its weight view (weights.cuh) and calls
    linear.cuh's linear_vec or linear_scalar; `_LINEAR_SIGNATURES` holds their C parameters."""
    out = []
    for kind, (wparams, make) in _LINEAR_SIGNATURES.items():
        extra = {"q8": ", int has_m, int gshift", "q4": ", int has_m", "q5": ", int has_m"}.get(kind, "")
        variants = [(tm, nc) for tm in ROW_TILES for nc in COL_TILES]
        if kind not in BLOCK_KINDS:  # q8, q4 need K % 32 == 0: always the vector kernels
            variants.append((0, 0))
        for tm, nc in variants:
            call = (f"linear_vec<{tm}, {nc}>(x, ww, out, M, N, K, add, add_mode, nw, eps, norm);" if tm
                    else "linear_scalar(x, ww, out, M, N, K, add, add_mode, nw, eps, norm);")
            out.append(
                f'extern "C" __global__ void __launch_bounds__(NT) {linear_kernel_name(kind, tm, nc)}(\n'
                f"        const float* __restrict__ x, {wparams}, float* __restrict__ out,\n"
                f"        int M, int N, int K{extra}, const float* __restrict__ add, int add_mode,\n"
                f"        const float* __restrict__ nw, float eps, int norm) {{\n"
                f"    {make}\n"
                f"    {call}\n"
                f"}}\n"
            )
    return "\n".join(out)


SOURCE = read_cu("kernels.cu") + "\n" + _linear_wrappers()

#: NVRTC options: no FMA contraction, no flush-to-zero, IEEE division and square root
#: (build_module passes exactly these: CuPy's own compile path would add -ftz=true), and
#: the geometry the source uses, from constants.py.
OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
           *(f"-D{name}={value}" for name, value in CUDA_DEFINES.items()))

KERNEL_NAMES = tuple(
    [linear_kernel_name(k, tm, nc) for k in LINEAR_KINDS for tm in ROW_TILES for nc in COL_TILES]
    + [linear_kernel_name(k, 0, 0) for k in LINEAR_KINDS if k not in BLOCK_KINDS]
    + ["rms_norm", "silu_mul", "gelu_mul", "rope", "rope_kv_write_f16", "rope_kv_write_f32", "kv_write",
       "attn_scores_f16", "attn_scores_f32", "attn_softmax_v_f16",
       "attn_softmax_v_f32", "sample_rows"]
)


def kernel_signatures(source: str = SOURCE) -> dict[str, list[tuple[str, bool]]]:
    """{kernel name: [(C type without qualifiers, is_pointer), ...]} of the extern "C"
    kernels in `source` (used to check every launch's arguments in the emulation)."""
    sigs = {}
    pat = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\w+\)\s*)?(\w+)\(([^)]*)\)')
    for name, params in pat.findall(source):
        plist = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", " ").replace("const ", " ").split())
            is_ptr = "*" in p
            ctype = p.replace("*", " ").rsplit(None, 1)[0].strip()  # drop the parameter name
            plist.append((ctype, is_ptr))
        sigs[name] = plist
    return sigs

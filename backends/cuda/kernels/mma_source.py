"""The CUDA C source of the tensor-core (MMA) products, opt-in (`PANECHAT_CUPY_MMA=1`), as
its own NVRTC module: `mma_split_x` and the `mma_linear_*` kernels, their names and
compile options. The C is in mma.cu; MMA_SOURCE is its text followed by the mma_linear_*
entry points generated here (one per weight format and tile). The contract (what
`mma_emulation.py` models) is:

x split (bit-specified, IEEE only): per row r, mx = max_k |x[r, k]|; s = 141 - (biased
exponent of mx), clamped to [-120, 120] (s = 120 for mx = 0 or subnormal, 0 for inf/NaN),
so that |v| = |x * 2^s| < 2^15; hi = f16_rn(v), lo = f16_rn(v - hi) (the subtraction is
exact); for bf16 weights three bf16 parts: hi = bf16_rn(v), mid = bf16_rn(v - hi), lo =
bf16_rn(v - hi - mid); xinv[r] = 2^-s. With mins, xsum[r, b] = the sequential float32
sum (from +0) of v over weight group b. Rows M .. Mpad - 1 (padding to the token tile)
are zeros, xinv 1. The parts are one buffer [2 or 3, Mpad, K].

Product (swap-AB: weights are the 16-row A side of mma.m16n8k16, tokens the 8-column B
side; f16 x f16 -> f32, or bf16 x bf16 -> f32 for BF16 weights, whose bits are used as
stored): K in chunks of 32; chunk c belongs to warp c % 8 of the block.
Within a chunk, mma j (0, 1) covers k = 32c + 16j .. + 15 (thread t of a quad holds the 4
consecutive k 16j + 4t .. + 3 in the fragment slots {2t, 2t+1, 2t+8, 2t+9}). Per weight
group g (32 k, or 16 for Q6_K): P = 0; for each mma j of the group: P = mma(W_j, hi_j, P);
P = mma(W_j, lo_j, P) (bf16: hi, mid, lo). Then acc_w = acc_w + P (f16 weights), or acc_w = fma(d, P, acc_w)
and, with mins, acc_w = fma(m, xsum, acc_w) (q8 codes, exact in f16;
bf16 weights: acc_w + P). The 8 warp sums
are added ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)), times xinv[r], then + add.
A token's arithmetic depends on K alone: never on M, on the tile, or on its column in the
tile (the mma computes each output element from its own row and column). Only the
summation inside one mma instruction is the hardware's (not IEEE-specified).
"""

from __future__ import annotations

from panechat.backends.cuda.kernels.constants import CUDA_DEFINES
from panechat.backends.cuda.kernels.cu_files import read_cu

MMA_KINDS = ("f16", "bf16", "q8", "q80", "q4")  # q80, q4: Q8_0 / Q4_x in GGUF block form
MMA_TILES = ((1, 1), (1, 2), (2, 4))  # (WT weight tiles of 16 rows, TT token tiles of 8) per block
MMA_CHUNK = 32  # k per chunk; chunk c -> warp c % MMA_WARPS
MMA_WARPS = 8


def mma_kernel_name(kind: str, wt: int, tt: int) -> str:
    return f"mma_linear_{kind}_{wt}_{tt}"


def _wrappers() -> str:
    """The extern "C" entry points: each builds its weight view and calls mma.cu's template."""
    out = []
    heads = {  # bf16 weights: their bits are the A fragment as they are (MF16 loads 16-bit words)
        "f16": ("const unsigned short* __restrict__ w", "", "MF16 ww{w, N, K};", "false, false"),
        "bf16": ("const unsigned short* __restrict__ w", "", "MF16 ww{w, N, K};", "false, true"),
        "q8": ("const signed char* __restrict__ q, const float* __restrict__ d, const float* __restrict__ m",
               ", int has_m, int gshift", "MQ<0> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
        "q80": ("const signed char* __restrict__ q, const unsigned short* __restrict__ d, "
                "const unsigned short* __restrict__ m", ", int has_m, int gshift",
                "MQ<1> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
        "q4": ("const unsigned char* __restrict__ q, const unsigned short* __restrict__ d, "
               "const unsigned short* __restrict__ m", ", int has_m, int gshift",
               "MQ<2> ww{q, d, m, N, K, has_m, gshift};", "true, false"),
    }
    for kind in MMA_KINDS:
        wparams, extra, make, flags = heads[kind]
        for wt, tt in MMA_TILES:
            out.append(
                f'extern "C" __global__ void __launch_bounds__(NT) {mma_kernel_name(kind, wt, tt)}(\n'
                f"        const unsigned short* __restrict__ xp, const float* __restrict__ xinv,\n"
                f"        const float* __restrict__ xsum, {wparams},\n"
                f"        float* __restrict__ out, int M, int N, int K{extra}, const float* __restrict__ add,\n"
                f"        int add_mode) {{\n"
                f"    {make}\n"
                f"    mma_linear<{wt}, {tt}, {flags}>(xp, xinv, xsum, ww, out, M, N, K, add, add_mode);\n"
                f"}}\n")
    return "\n".join(out)


MMA_SOURCE = read_cu("mma.cu") + "\n" + _wrappers()

#: the same IEEE flags as the CUDA-core module (source.OPTIONS); mma.sync needs sm_80+.
MMA_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
               *(f"-D{name}={value}" for name, value in CUDA_DEFINES.items()))
MMA_MIN_CC = 80

MMA_KERNEL_NAMES = tuple(["mma_split_x"] + [mma_kernel_name(k, wt, tt) for k in MMA_KINDS for wt, tt in MMA_TILES])

"""The kernels' geometry, defined once: the CUDA source receives the ones it uses as -D
defines (`CUDA_DEFINES`, added to the NVRTC options in source.py); the launchers and the
emulation import them from here."""

from __future__ import annotations

from panechat.backends.paged_kv import BLOCK_TOKENS

NT = 256  # threads per block of every kernel; part of the rms/attention contract
WARP = 32  # lanes of a warp (the hardware's; the source's shuffles assume it)
WARPS = NT // WARP  # warps per block: block_sum's fixed tree adds exactly 8
OCTET = 8  # consecutive k per lane step in linear (the width of its vector loads)
ROW_TILES = (1, 2, 4, 8, 16)  # TM: rows per warp tile in linear
COL_TILES = (1, 4)  # NC: output columns per warp in linear
WIDE_N = 8192  # linear uses NC = 4 when N > WIDE_N (enough blocks either way)
KSPLIT = 4  # blocks per (row, head) that share the score computation
MAX_HEAD_DIM = 256  # attention keeps a query row in MAX_HEAD_DIM / WARP registers per lane
LINEAR_KINDS = ("f32", "f16", "bf16", "q8", "q80", "q4", "q5", "q4k", "q5k", "q6k")
BLOCK_KINDS = ("q8", "q80", "q4", "q5", "q4k", "q5k", "q6k")  # kinds in 32/16-weight groups: K % 32 == 0, vector kernels only
BT = BLOCK_TOKENS  # positions per paged KV block (the attention kernels index blocks with it)
QBLOCK = 32  # weights per quantisation block (q8 scales)

#: what the CUDA source is compiled with (`-DNAME=value`)
CUDA_DEFINES = {"NT": NT, "WARPS": WARPS, "KSPLIT": KSPLIT, "MAX_HEAD_DIM": MAX_HEAD_DIM, "BT": BT}


def cdiv(a: int, b: int) -> int:
    """Ceiling division (grid sizes)."""
    return -(-a // b)

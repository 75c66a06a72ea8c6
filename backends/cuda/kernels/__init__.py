"""CUDA kernels of the CuPy backend, one job per module:

  constants.py  the geometry (NT, KSPLIT, tiles, ...), defined once; the CUDA source gets
                it as -D defines
  kernels.cu    the CUDA C (its parts: common, weights, linear, norm, activation, rope_kv,
                attention, sampling .cuh); mma.cu the tensor-core products (mma_source.py)
  cu_files.py   reads a .cu file as one string, its parts inlined
  source.py     SOURCE (kernels.cu's text and the generated linear_* entry points), its
                NVRTC options, kernel names, signatures
  build.py      NVRTC: PTX without a GPU, the device's module cached on disk
  launch.py     `Kernels`: tile choice, grids and argument lists of every launch
  emulation.py  the numpy emulation of every kernel, and `EmulatedModule`

Importing this package needs neither cupy nor a GPU: the source is read as text, the launch
wrappers take any object with CuPy's ``RawModule.get_function`` interface, and the
emulation is plain numpy. The names below are re-exported here.

Why own kernels
---------------
panechat promises that batching never changes an answer: a row's logits are bit-identical
whether it is decoded alone or beside other rows, at any row position. cuBLAS chooses its
algorithm (tile shapes, split-K, tensor-core paths) by problem shape, so an output row's
summation order -- and its last bits -- changes with the number of rows M. The kernels
(kernels.cu) fix each output element's arithmetic in the source, independent of M and of the
row's position; only the *tiling* (which elements one block computes together) may vary
with the shapes, and tiling never changes how one element is computed.

The numerical contract (what emulation.py reproduces bit for bit)
-----------------------------------------------------------------
Every product-sum is an explicit ``__fmaf_rn`` chain and every other addition an explicit
``__fadd_rn`` (the compiler may neither contract nor reorder them; the module is also
compiled with ``--fmad=false``, ``--ftz=false``, IEEE division and square root, by NVRTC
directly -- see ``build.build_module``). Float32 throughout, subnormals kept.

* ``linear`` out[m, n] = sum_k x[m, k] * w[n, k]: element k belongs to *lane*
  ``(k // 8) % 32`` (octets of 8 consecutive k, dealt round-robin to the 32 lanes of a
  warp); each lane runs one fma chain from +0 over its k in increasing order; the 32 lane
  sums are combined by the xor butterfly ``v += shfl_xor(v, h)`` for h = 16, 8, 4, 2, 1.
  The weight is dequantized exactly in registers (f16 -> f32 by cvt; q8: ``q * d`` is
  exact, then ``+ m`` rounded once, as numpy_kernels.dequantize_q8 does; q80, Q8_0 blocks:
  ``q * d`` with d float16 as stored; q4, Q4_0/Q4_1 blocks with the codes nibble-packed as
  stored: ``(q - 8) * d`` or ``q * d + m``). Each lane loads its next PF octets before it
  uses the first (loads in flight), which does not change the order. The order
  depends on K alone. A warp computes NC in {1, 4} columns x TM in {1, 2, 4, 8, 16} rows
  with vector loads (K % 8 == 0); TM is picked from M and NC from N, which only regroups
  elements. Any other K runs ``linear_*_s`` (scalar loads, one row and column per warp)
  with the same order.
* ``linear`` with a fused norm (``norm`` = 1): the input element is ``(x * inv) * nw[k]``
  with inv from ``rms_inv`` -- the rms_norm kernel's own computation, below -- formed in
  registers: bit for bit the rms_norm kernel followed by the plain product.
* ``rms_norm`` per row of D: thread t (of 256) runs an fma chain of x*x over k = t,
  t+256, ...; a block sum (butterfly within each warp, then ((w0+w1)+(w2+w3)) +
  ((w4+w5)+(w6+w7)) over the 8 warps); inv = 1 / sqrt(sum / D + eps);
  y = (x * inv) * weight.
* ``attention`` per (row, head), keys t = 0..pos of the row's sequence, read from the paged
  store through its block table (key t: block table[t // 16], offset t % 16; float16
  converted exactly), kv head h // (H/G):
  score[t] = (fma chain over d = lane + 32 i, butterfly) * scale; m = max; e[t] =
  expf_pc(score[t] - m) (``expf_pc`` is a Cephes expf from plain IEEE operations, the same
  formula as numpy_kernels._expf); sum = block sum of per-thread chains over t = thread,
  thread+256, ...; out[d] = (((p_0 + p_1) + p_2) ...) * (1 / sum) where p_s[d] is an fma
  chain of e[t] * v[t, d] over t = s, s+S, s+2S, ... with S = 256 // D.
* ``silu_mul`` y = (g / (1 + expf_pc(min(-g, 88)))) * u, elementwise.
* ``gelu_mul`` i = 0.7978845608028654 * (g + ((0.044715 * g) * g) * g); t = 1 - 2 /
  (expf_pc(min(2 i, 88)) + 1) (tanh); y = ((0.5 * g) * (1 + t)) * u, elementwise.
* ``attention`` with a sliding window W > 0 (gemma3's local layers): keys t0 = max(0, P - W)
  .. P - 1 only, the threads' and key subsets' strides counted from t0.
* ``rope_kv_write_f16`` / ``_f32`` (one launch a layer): q turned by ``rope``'s arithmetic
  (``rope_one``, shared), k turned the same way and v stored straight into the paged KV
  blocks (block table -> block, position % 16 -> offset); float16 by ``cvt.rn.f16.f32``
  (round to nearest even, as numpy's astype and the CuPy scatter it replaces).
* ``sample_rows`` (one block per row): see the comment above the kernel in sampling.cuh.

Rows, the row's position in the batch, other rows' slots and positions, and the number of
rows never enter an element's arithmetic, so every kernel is batch-invariant by
construction; ``CupyBackend.self_check`` and ``scripts/gpu_check.py`` verify it on the
device, and the latter also compares every kernel with ``EmulatedModule`` bit for bit.
"""

from panechat.backends.cuda.kernels.build import build_module, compile_ptx
from panechat.backends.cuda.kernels.constants import KSPLIT, MAX_HEAD_DIM, NT, WIDE_N
from panechat.backends.cuda.kernels.emulation import (
    EmulatedModule,
    block_sum256,
    dequantize,
    emulate_attention,
    emulate_gelu_mul,
    emulate_linear,
    emulate_rms_norm,
    emulate_rope_kv_write,
    emulate_silu_mul,
    expf_pc,
    fma_f32,
    tree32,
)
from panechat.backends.cuda.kernels.launch import Kernels, col_tile, row_tile
from panechat.backends.cuda.kernels.source import KERNEL_NAMES, OPTIONS, SOURCE, kernel_signatures

__all__ = [
    "SOURCE", "OPTIONS", "KERNEL_NAMES", "NT", "KSPLIT", "MAX_HEAD_DIM", "WIDE_N", "Kernels", "EmulatedModule",
    "fma_f32", "tree32", "block_sum256", "emulate_linear", "emulate_rms_norm", "emulate_attention",
    "emulate_silu_mul", "emulate_gelu_mul", "emulate_rope_kv_write", "expf_pc", "dequantize", "row_tile", "col_tile", "compile_ptx", "build_module",
    "kernel_signatures",
]

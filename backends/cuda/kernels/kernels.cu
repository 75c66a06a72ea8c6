// The CuPy backend's CUDA-core kernels: one NVRTC program. source.py reads this file with its
// parts inlined (each once, in the order below), appends the linear_* entry points (one per
// weight format and tile, from constants.py's lists) and build.py compiles it with
// source.OPTIONS. The numerical contract is documented in backends/cuda/kernels/__init__.py.
//
// Defines (from constants.CUDA_DEFINES, passed as -D; none has a default):
//   NT            threads per block (256)
//   WARPS         warps per block, NT / 32 (8)
//   KSPLIT        blocks per (row, head) that share the attention scores (4)
//   MAX_HEAD_DIM  the largest head dimension attention keeps in registers (256)
//   BT            positions per paged KV block (16)
// Standalone (every kernel but the linear_* entry points):
//   nvcc -ptx -arch=sm_90 --fmad=false --ftz=false --prec-div=true --prec-sqrt=true -DNT=256 -DWARPS=8 -DKSPLIT=4 -DMAX_HEAD_DIM=256 -DBT=16 kernels.cu
#include "common.cuh"
#include "weights.cuh"
#include "linear.cuh"
#include "norm.cuh"
#include "activation.cuh"
#include "rope_kv.cuh"
#include "attention.cuh"
#include "sampling.cuh"

"""The tensor-core (MMA) mode of the CuPy backend, opt-in: `PANECHAT_CUPY_MMA=1` (or
`CupyBackend(mma=True)`). When on, every `linear` whose weight the MMA kernels take (F16,
BF16, and the int8 codes of Q8_0 / Q4_x / Q5_x / K-quants; K % 32 == 0) runs on tensor cores
at every batch size, B = 1 included: the mode is chosen by the weight, never by the
number of rows, so a conversation gets the same tokens alone or in any batch. The
kernels, their contract and error bound: kernels/mma.cu, kernels/mma_source.py, mma_emulation.py;
device checks: mma_check.py; docs/cupy.md, "Tensor-core mode"."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np

from panechat.backends.cuda.kernels.build import build_module
from panechat.backends.cuda.kernels.mma_emulation import EmulatedMmaModule
from panechat.backends.cuda.kernels.mma_launch import MmaKernels
from panechat.backends.cuda.kernels.mma_source import MMA_MIN_CC, MMA_OPTIONS, MMA_SOURCE
from panechat.backends.errors import BackendUnavailable, one_line

ENV = "PANECHAT_CUPY_MMA"

#: self-check weights added when the mode is on: K of many chunks (each warp 2-3 of them),
#: N not a multiple of the 16-row tile, a min per group (Q4_1)
MMA_CHECK_LINEAR = (("F16", 72, 544), ("Q8_0", 40, 288), ("Q4_1", 24, 320))


def with_mma_checks(plan: Any) -> Any:
    """The backend's CheckPlan with MMA_CHECK_LINEAR added (the mode's start-up check)."""
    return replace(plan, linear=tuple(plan.linear) + MMA_CHECK_LINEAR)


def mma_requested(option: bool | None = None) -> bool:
    """The explicit option if given, else PANECHAT_CUPY_MMA (1 / on / true / yes)."""
    if option is not None:
        return bool(option)
    return os.environ.get(ENV, "0").strip().lower() in ("1", "on", "true", "yes")


def build_mma(cp: Any) -> MmaKernels:
    """The compiled MMA kernels for the current device, or BackendUnavailable in one line."""
    cc = int(cp.cuda.Device().compute_capability)
    if cc < MMA_MIN_CC:
        raise BackendUnavailable(f"{ENV}=1 needs an sm_{MMA_MIN_CC} or newer GPU (this one is sm_{cc}); "
                                 f"unset {ENV} to use the CUDA-core kernels")
    try:
        kernels = MmaKernels(build_module(cp, source=MMA_SOURCE, options=MMA_OPTIONS, stem="mma"), cp)
        kernels.compile_all()
    except Exception as e:
        raise BackendUnavailable(f"the CuPy backend cannot build its tensor-core kernels "
                                 f"({one_line(e, with_type=True)}); unset {ENV} to use the CUDA-core kernels") from None
    return kernels


def emulated_mma() -> MmaKernels:
    """The MMA launches on numpy arrays, run by the numpy model (EmulatedMmaModule)."""
    return MmaKernels(EmulatedMmaModule(), np)

"""RoPE scaling of a model's global layers, as llama.cpp applies it (ggml `rope_yarn`).

Every kind comes down to two things the backend's `rope_tables` takes: a divisor per
rotary pair (the angle of pair i at position p is p * base^(-2i/d) / divisor_i) and one
multiplier of cos and sin (`mscale`).

- frequency factors from the file (`rope_freqs.weight`: Llama 3.x; phi3's
  `rope_factors_long/short.weight`, long when the context per sequence exceeds the
  original one, as llama.cpp's `get_rope_factors`) divide the base frequencies;
- "linear" (and "longrope") multiply every angle by freq_scale = 1 / factor;
- "yarn" (ext_factor 1, or the file's rope.scaling.yarn_ext_factor) mixes per pair the
  interpolated angle (times freq_scale) and the extrapolated one by a ramp over the pairs
  between the correction dims of beta_fast and beta_slow, weighted by ext_factor, and
  multiplies cos/sin by 1 + 0.1 ln(factor) (llama.cpp's `get_mscale`);
- `rope.scaling.attn_factor` multiplies cos/sin in every case (phi3 128k).
"""

from __future__ import annotations

import math

import numpy as np

from panechat.engine.model.args import ModelArgs


def global_rope(a: ModelArgs, file_factors: np.ndarray | None) -> tuple[np.ndarray | None, float]:
    """(divisor per rotary pair [rope_dim/2] float64 or None for none, cos/sin multiplier)
    of the global layers of `a`, given the frequency factors the file holds (or None)."""
    half = a.rope_dim // 2
    factors = None if file_factors is None else np.asarray(file_factors, np.float64).reshape(-1)
    if factors is not None and factors.shape != (half,):
        raise ValueError(f"RoPE frequency factors have {factors.size} values, the model needs {half}")
    mscale = a.rope_attn_factor
    scale = a.rope_freq_scale
    if scale == 1.0:
        return factors, mscale
    base = np.ones(half) if factors is None else factors
    if a.yarn_ext_factor:
        ramp = _yarn_ramp(a) * a.yarn_ext_factor
        mix = scale * (1.0 - ramp) + ramp  # theta = theta_extrap * mix
        if 1.0 / scale > 1.0:
            mscale *= 1.0 + 0.1 * math.log(1.0 / scale)
        return base / mix, mscale
    return base / scale, mscale


def _yarn_ramp(a: ModelArgs) -> np.ndarray:
    """Per pair, 1 where the angle is extrapolated (high frequencies) and 0 where it is
    interpolated, linear in between (ggml `rope_yarn_ramp` with ext_factor 1)."""
    lo, hi = _yarn_corr_dims(a.rope_dim, a.rope_orig_ctx, a.rope_base, a.yarn_beta_fast, a.yarn_beta_slow)
    y = (np.arange(a.rope_dim // 2) - lo) / max(0.001, hi - lo)
    return 1.0 - np.clip(y, 0.0, 1.0)


def _yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                    beta_slow: float) -> tuple[float, float]:
    """ggml `ggml_rope_yarn_corr_dims`: the pairs whose wavelength spans beta_fast and
    beta_slow rotations over the original context."""
    def dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))

"""Block quantization of token rows to float8_e4m3fn: the reference of the dispatch kernels' own quantization.

``dispatch(x, ids, quantize=jnp.float8_e4m3fn)`` with bf16 ``x`` gives the ``expert_x`` / ``expert_scales`` of
``dispatch(*quantize_rows(x, scale_block), ...)``: the NVSHMEM kernels quantize each row as they send it (no XLA op
of its own), with this arithmetic in float32, bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import Array

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# amax times this float32 (not amax / 448: XLA may turn a division by a constant into this product, a rounding apart)
INV_FP8_MAX = float(np.float32(1.0) / np.float32(FP8_MAX))


def quantize_rows(x: Array, scale_block: int) -> tuple[Array, Array]:
    """x [N, H] (any float dtype) -> (float8_e4m3fn [N, H], float32 scales [N, H // scale_block]).

    Per block of ``scale_block`` elements, in float32: ``scale = amax * float32(1 / 448)`` (1 for an all-zero block)
    and ``q = x * (1 / scale)`` saturated at ±448 and rounded to nearest even; ``q * scale`` approximates x. A
    block with a NaN has scale 1 and keeps its NaN; one with an infinity has scale inf and NaN in its place.
    """
    rows, hidden = x.shape
    if hidden % scale_block:
        raise ValueError(f"hidden ({hidden}) must be a multiple of scale_block ({scale_block})")
    blocks = x.astype(jnp.float32).reshape(rows, hidden // scale_block, scale_block)
    # NaN propagates explicitly: XLA:CPU's vectorized max and clamp may skip it.
    amax = jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.nan, jnp.max(jnp.abs(blocks), axis=-1))
    scales = jnp.where(amax > 0, amax * jnp.float32(INV_FP8_MAX), jnp.float32(1.0))
    inverse = jnp.float32(1.0) / scales  # one division per block, then products (as the kernels)
    scaled = blocks * inverse[..., None]
    q = jnp.where(jnp.isnan(scaled), scaled, jnp.clip(scaled, -FP8_MAX, FP8_MAX))  # the kernels' satfinite
    return q.astype(jnp.float8_e4m3fn).reshape(rows, hidden), scales

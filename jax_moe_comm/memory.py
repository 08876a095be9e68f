"""What a model's communication takes in GPU memory, computed from its config alone (no mesh, no GPU).

One MoEComm serves every MoE layer of a model (see MoEComm), so its symmetric heap is the model's, whatever the
number of layers; ``expert_x`` is allocated by XLA per call, ``capacity`` rows. ``python -m jax_moe_comm.memory``
prints the README's table for DeepSeek-R1's MoE layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import nvshmem_backend
from .config import MoECommConfig, Options

GIB = 2**30


def heap_bytes(cfg: MoECommConfig, world: int, grad_dtype: Any = None, staging: bool = False,
               max_bytes: int | None = None,
               low_latency_max_tokens: int = Options.low_latency_max_tokens) -> int:
    """Symmetric heap per GPU of one MoEComm of `cfg` over `world` EP ranks (``comm.symmetric_bytes``): its buffer set,
    for an fp8 payload with grad_dtype sized for the backward round trips' rows too. ``staging``: with the buffers of
    the path to peers off NVLink. ``max_bytes``: MoEComm's max_symmetric_bytes (the windowed heap where the config
    needs more). ``low_latency_max_tokens``: MoEComm's (the low-latency path's buffers where it is taken). A
    differentiated MoEComm at world > 1 adds its weights exchange's buffers (``weights_exchange_bytes``)."""
    shared = () if grad_dtype is None else (cfg.gradient_config(world, grad_dtype),)
    return nvshmem_backend.symmetric_bytes(cfg, world, staging, shared, max_bytes, low_latency_max_tokens)


def weights_exchange_bytes(cfg: MoECommConfig, world: int, staging: bool = False,
                           low_latency_max_tokens: int = Options.low_latency_max_tokens) -> int:
    """Symmetric heap per GPU of the backward's weights exchange, which a MoEComm differentiated with its custom VJP
    allocates at world > 1 besides its buffer set (rows of K float32 weights; autodiff.py); 0 at world 1.
    ``low_latency_max_tokens``: MoEComm's (the exchange takes the low-latency path where its rows allow)."""
    if world == 1:
        return 0
    return nvshmem_backend.symmetric_bytes(cfg.weights_exchange_config(world), world, staging,
                                           low_latency_max_tokens=low_latency_max_tokens)


def expert_x_bytes(cfg: MoECommConfig, world: int) -> int:
    """Bytes of one dispatch's expert_x and expert_scales on each rank: capacity rows of the payload and its scales."""
    return cfg.capacity_for(world) * (cfg.hidden * np.dtype(cfg.dtype).itemsize + 4 * cfg.scale_cols)


def r1_config(max_tokens: int, **fields: Any) -> MoECommConfig:
    """DeepSeek-R1's MoE layer: H 7168, 256 experts, top-8, fp8 tokens with 128-element block scales, bf16 out."""
    return MoECommConfig(num_experts=256, experts_per_token=8, hidden=7168, max_tokens=max_tokens,
                         dtype=jnp.float8_e4m3fn, scale_block=128, out_dtype=jnp.bfloat16, **fields)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def r1_table(worlds=(2, 8, 64), tokens=(128, 4096), capacity_factor: float = 1.25) -> str:
    """The README's table of R1 (gradients in bf16) by EP size and tokens per rank: the heap of the whole model on
    NVLink (a trained one: with the backward's weights exchange), what the staging buffers add off NVLink, and
    expert_x per call at the worst-case capacity and at `capacity_factor`."""
    lines = [f"| EP | tokens/rank | heap | + staging | expert_x | expert_x at {capacity_factor} |",
             "|---:|---:|---:|---:|---:|---:|"]
    for world in worlds:
        for t in tokens:
            cfg = r1_config(t)
            factored = dataclasses.replace(cfg, capacity_factor=capacity_factor)
            heap = heap_bytes(cfg, world, jnp.bfloat16) + weights_exchange_bytes(cfg, world)
            staged = heap_bytes(cfg, world, jnp.bfloat16, staging=True) + weights_exchange_bytes(cfg, world, True)
            lines.append(f"| {world} | {t:,} | {_gib(heap)} | {_gib(staged - heap)} | "
                         f"{_gib(expert_x_bytes(cfg, world))} | {_gib(expert_x_bytes(factored, world))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(r1_table())

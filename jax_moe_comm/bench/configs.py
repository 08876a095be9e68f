"""The bench's configs (R1, V2-Lite), its random inputs and the expected round trip they are checked against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_comm

AXIS = "ep"
EPS = 1e-3  # weight of the previous output in the next input of a chain
TOLERANCE = 2e-2
FP8 = np.dtype(jnp.float8_e4m3fn)
BF16 = np.dtype(jnp.bfloat16)
Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One MoE layer's communication shape (per rank: ``tokens`` rows, set per run)."""

    name: str
    hidden: int
    experts: int
    topk: int
    dtype: np.dtype  # dispatch payload
    combine_dtype: np.dtype  # expert_y and the output
    scale_block: int | None = None  # fp8 only

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def scale_cols(self) -> int:
        return self.hidden // self.scale_block if self.is_fp8 else 0

    def moe_config(self, tokens: int) -> jax_moe_comm.MoECommConfig:
        return jax_moe_comm.MoECommConfig(
            num_experts=self.experts, experts_per_token=self.topk, hidden=self.hidden, max_tokens=tokens,
            dtype=self.dtype, scale_block=self.scale_block, out_dtype=self.combine_dtype)

    def describe(self) -> dict:
        return {"hidden": self.hidden, "experts": self.experts, "topk": self.topk, "dtype": self.dtype.name,
                "combine_dtype": self.combine_dtype.name, "scale_block": self.scale_block}


CONFIGS = {
    "r1": BenchConfig("r1", 7168, 256, 8, FP8, BF16, 128),
    "v2lite": BenchConfig("v2lite", 2048, 64, 6, BF16, BF16),
}
# --quick: the same shapes of traffic, small enough for CPU tests (E divisible by up to 16 devices).
QUICK_CONFIGS = {
    "r1": BenchConfig("r1", 256, 32, 8, FP8, BF16, 128),
    "v2lite": BenchConfig("v2lite", 128, 16, 6, BF16, BF16),
}
DEFAULT_TOKENS = (1, 8, 128, 512, 4096)
# A chain of 4: the timed difference is 3 round trips, so a busy CPU's jitter cannot make it negative as easily.
QUICK = {"tokens": (8,), "chain": 4, "repeats": 2}


def seeded(*keys: int) -> np.random.Generator:
    return np.random.default_rng(list(keys))


def make_tokens(rng: np.random.Generator, cfg: BenchConfig, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Host x [rows, H] in the payload dtype and, for fp8, float32 block scales [rows, H // B]."""
    x = rng.standard_normal((rows, cfg.hidden), np.float32)
    if not cfg.is_fp8:
        return x.astype(cfg.dtype), None
    blocks = x.reshape(rows, cfg.scale_cols, cfg.scale_block)
    scales = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / 448.0
    quantized = (blocks / scales[:, :, None]).reshape(rows, cfg.hidden).astype(FP8)
    return quantized, scales.astype(np.float32)


def make_routing(rng: np.random.Generator, cfg: BenchConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform routing: each token picks topk distinct experts; weights are positive and sum to 1 per token."""
    ids = np.argpartition(rng.random((rows, cfg.experts)), cfg.topk - 1, axis=1)[:, :cfg.topk].astype(np.int32)
    weights = rng.random((rows, cfg.topk)).astype(np.float32) + 0.1
    return ids, weights / weights.sum(axis=1, keepdims=True)


def remote_rows(ids: np.ndarray, experts: int, world: int) -> int:
    """(token, slot) pairs, over all ranks, whose expert lives on another rank than the token."""
    tokens = ids.shape[0] // world
    src = np.arange(ids.shape[0])[:, None] // tokens
    return int(np.sum((ids >= 0) & (ids // (experts // world) != src)))


def round_trip_bytes(cfg: BenchConfig, ids: np.ndarray, world: int) -> float:
    """Bytes one rank moves per round trip, averaged over ranks (see the module docstring)."""
    rows = remote_rows(ids, cfg.experts, world)
    dispatch = rows * (cfg.hidden * cfg.dtype.itemsize + 4 * cfg.scale_cols)
    return (dispatch + rows * cfg.hidden * cfg.combine_dtype.itemsize) / world


def expert_stand_in(cfg: BenchConfig, rows: Array, scales: Array | None = None) -> Array:
    """The experts' cheap elementwise stand-in: 2 * dequantized rows, in the combine dtype."""
    r = rows.astype(jnp.float32)
    if scales is not None:
        n = rows.shape[0]
        r = (r.reshape(n, cfg.scale_cols, cfg.scale_block) * scales[:, :, None]).reshape(n, cfg.hidden)
    return (2.0 * r).astype(cfg.combine_dtype)


def expected_round_trip(cfg: BenchConfig, x: np.ndarray, scales: np.ndarray | None, ids: np.ndarray,
                        weights: np.ndarray) -> np.ndarray:
    """NumPy brute force: y[t] = sum_k w[t, k] * expert_stand_in(x[t]) (float32, -1 slots skipped)."""
    r = x.astype(np.float32)
    if scales is not None:
        r = (r.reshape(len(r), cfg.scale_cols, cfg.scale_block) * scales[:, :, None]).reshape(r.shape)
    e = (2.0 * r).astype(cfg.combine_dtype).astype(np.float32)
    w = np.where(ids >= 0, weights, 0.0).sum(axis=1, dtype=np.float32)
    return e * w[:, None]

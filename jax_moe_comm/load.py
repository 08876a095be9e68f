"""Expert load: how many rows each expert gets, and what a capacity drops, from the routing alone.

The counts are the routing's (every live slot of every rank's tokens, each DP group's tokens once), so they do not
depend on how the rows travelled. The NVSHMEM dispatch counts them in its kernels, from the ids rows every rank
receives; the reference backend sums each rank's own (a psum of E integers, which XLA removes when nothing reads
it). What a capacity drops follows from them on each rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from .config import Geometry, round_up
from .reference import live_slots
from .types import Dispatched


def expert_counts(geo: Geometry, topk_ids: Array, num_tokens: Array) -> Array:
    """int32 [E]: live slots routed to each expert over the EP group (per shard, inside shard_map). Replica j of a
    DP group counts its tokens i with i % dp_size == j, so the sum over ranks counts each group's tokens once."""
    T, E, dp = geo.T, geo.cfg.num_experts, geo.cfg.dp_size
    rank = jax.lax.axis_index(geo.axis_name)
    token = jnp.arange(T, dtype=jnp.int32)
    mine = (token < num_tokens) & (token % dp == rank % dp)
    live = mine[:, None] & live_slots(geo, topk_ids)
    local = jnp.zeros((E,), jnp.int32).at[jnp.where(live, topk_ids, E).reshape(-1)].add(1, mode="drop")
    return jax.lax.psum(local, geo.axis_name)


def dropped_rows(geo: Geometry, counts: Array) -> Array:
    """int32 []: this rank's rows that do not fit: past each local expert's own capacity (capacity_per="expert"),
    or landing at or past capacity in the layout (each local expert's rows start at the padded sizes of the experts
    before it)."""
    L, align, capacity = geo.L, geo.cfg.align, geo.capacity
    rank = jax.lax.axis_index(geo.axis_name)
    rows = jax.lax.dynamic_slice_in_dim(counts, rank * L, L)
    per_expert = rows if geo.expert_capacity is None else jnp.minimum(rows, geo.expert_capacity)
    padded = round_up(per_expert, align) if align > 1 else per_expert
    start = jnp.cumsum(padded) - padded
    kept = jnp.clip(capacity - start, 0, per_expert)
    return jnp.sum(rows - kept).astype(jnp.int32)


def kept_group_sizes(geo: Geometry, group_sizes: Array) -> Array:
    """group_sizes cut at capacity: each expert's rows below it (what a dropping dispatch packed)."""
    end = jnp.cumsum(group_sizes)
    start = end - group_sizes
    return (jnp.clip(end, 0, geo.capacity) - jnp.clip(start, 0, geo.capacity)).astype(jnp.int32)


def with_load(geo: Geometry, d: Dispatched) -> Dispatched:
    """d with its expert counts (the backend's, when its dispatch counted them) and dropped rows (and, when the
    MoEComm drops overflow, the kept group sizes)."""
    counts = d.expert_counts
    if counts is None:
        counts = expert_counts(geo, d.handle.topk_ids, d.handle.num_tokens)
    group_sizes = kept_group_sizes(geo, d.group_sizes) if geo.cfg.overflow == "drop" else d.group_sizes
    return Dispatched(d.expert_x, d.expert_scales, group_sizes, d.handle, counts, dropped_rows(geo, counts))

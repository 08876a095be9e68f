"""A brute-force NumPy oracle of dispatch/combine, written from the semantics alone.

Plain Python loops over ranks, experts, groups, tokens and slots; it shares no code with ``jax_moe_comm``.
Inputs are given per DP group (``[G, max_tokens, ...]``, G = world // dp_size) or per rank (``[world, ...]``);
rank r belongs to group r // dp_size.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class ShardLayout:
    """What dispatch must return on one rank (the receive layout), as NumPy arrays."""

    expert_x: np.ndarray            # [capacity, H] payload dtype
    expert_scales: np.ndarray | None  # [capacity, H // B] float32 (fp8 only)
    group_sizes: np.ndarray         # [L] int32, padded counts
    row_origin: np.ndarray          # [capacity] int32, (g * max_tokens + t) * K + k, or -1
    rows_needed: int                # sum(group_sizes) before truncation to capacity


def routing_error(topk_ids: np.ndarray, num_tokens: np.ndarray, num_experts: int) -> str | None:
    """The routing error dispatch must report for per-group ids [G, T, K], or None.

    Only rows t < num_tokens[g] are looked at. Returns "outside" for an id outside [-1, E) and "repeated" for an
    expert named twice in one token's row.
    """
    for g in range(topk_ids.shape[0]):
        for t in range(int(num_tokens[g])):
            seen = set()
            for k in range(topk_ids.shape[2]):
                e = int(topk_ids[g, t, k])
                if e < -1 or e >= num_experts:
                    return "outside"
                if e >= 0:
                    if e in seen:
                        return "repeated"
                    seen.add(e)
    return None


def routed(topk_ids, g: int, t: int, k: int) -> bool:
    """Whether slot k of token t of group g routes its row: a slot naming the expert of an earlier slot of the same
    token is dropped (the repeat is an error, and the earlier slot keeps the row)."""
    e = int(topk_ids[g, t, k])
    return e >= 0 and all(int(topk_ids[g, t, j]) != e for j in range(k))


def dispatch(x, topk_ids, num_tokens, scales=None, *, world, dp_size, num_experts, align, capacity,
             expert_capacity=None):
    """Receive layout of every rank.

    x [G, T, H], topk_ids [G, T, K], num_tokens [G], scales [G, T, H // B] or None. Returns a list of
    ``world`` ShardLayout. Rank r, local expert l (global e = r * L + l) receives, ordered by (g, t), one row per
    (group g, token t < num_tokens[g], slot k) with topk_ids[g, t, k] == e and no earlier slot of the token naming
    e; each expert's run is padded with zero rows to a multiple of ``align``; rows past the last expert's run are
    zero / -1. With ``expert_capacity`` (capacity_per="expert") each expert keeps only its first ``expert_capacity``
    rows in that order; ``rows_needed`` then counts the kept rows, padded.
    """
    num_groups, max_tokens, k_slots = topk_ids.shape
    assert num_groups * dp_size == world
    num_local = num_experts // world
    hidden = x.shape[2]
    layouts = []
    for rank in range(world):
        rows, scale_rows, origins, group_sizes = [], [], [], []
        for local in range(num_local):
            expert = rank * num_local + local
            count = 0
            for g in range(num_groups):
                for t in range(int(num_tokens[g])):
                    for k in range(k_slots):
                        if int(topk_ids[g, t, k]) == expert and routed(topk_ids, g, t, k):
                            if expert_capacity is not None and count == expert_capacity:
                                continue  # past the expert's own capacity: dropped
                            rows.append(x[g, t])
                            if scales is not None:
                                scale_rows.append(scales[g, t])
                            origins.append((g * max_tokens + t) * k_slots + k)
                            count += 1
            padded = count
            while padded % align:
                padded += 1
            for _ in range(padded - count):
                rows.append(np.zeros(hidden, x.dtype))
                if scales is not None:
                    scale_rows.append(np.zeros(scales.shape[2], np.float32))
                origins.append(-1)
            group_sizes.append(padded)

        expert_x = np.zeros((capacity, hidden), x.dtype)
        row_origin = np.full((capacity,), -1, np.int32)
        expert_scales = None if scales is None else np.zeros((capacity, scales.shape[2]), np.float32)
        for p in range(min(len(rows), capacity)):
            expert_x[p] = rows[p]
            row_origin[p] = origins[p]
            if scales is not None:
                expert_scales[p] = scale_rows[p]
        layouts.append(ShardLayout(expert_x, expert_scales, np.array(group_sizes, np.int32), row_origin, len(rows)))
    return layouts


def combine(expert_y, layouts, topk_ids, topk_weights, num_tokens, *, dp_size, num_experts, out_dtype):
    """Combined output of every rank, [world, T, H] out_dtype.

    expert_y [world, capacity, H] (any float dtype), ``layouts`` from :func:`dispatch` (to find the row of each
    (group, token, slot)), per-group topk_ids [G, T, K] and num_tokens [G], per-rank topk_weights [world, T, K].
    y[t] = sum over k = 0..K-1 of w[t, k] * expert_y[row(t, k)], accumulated in float32 in slot order; -1 slots
    and slots whose row is not in the layout (past capacity) add nothing; rows t >= num_tokens are zero.
    """
    world, _, hidden = expert_y.shape
    num_groups, max_tokens, k_slots = topk_ids.shape
    num_local = num_experts // world
    where = {}  # origin -> (rank, row), from the oracle's own layout
    for rank in range(world):
        for p, origin in enumerate(layouts[rank].row_origin):
            if origin >= 0:
                where[int(origin)] = (rank, p)

    out = np.zeros((world, max_tokens, hidden), out_dtype)
    for rank in range(world):
        g = rank // dp_size
        for t in range(int(num_tokens[g])):
            acc = np.zeros(hidden, np.float32)
            for k in range(k_slots):
                e = int(topk_ids[g, t, k])
                if not routed(topk_ids, g, t, k):
                    continue
                found = where.get((g * max_tokens + t) * k_slots + k)
                if found is None:  # its row did not fit in capacity (overflow="drop"): it adds nothing
                    continue
                src_rank, p = found
                assert src_rank == e // num_local
                acc = acc + np.float32(topk_weights[rank, t, k]) * expert_y[src_rank, p].astype(np.float32)
            out[rank, t] = acc.astype(out_dtype)
    return out

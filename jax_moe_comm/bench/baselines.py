"""Dispatch + combine built from XLA collectives only: the baselines the NVSHMEM backend is measured against.

Both run per shard, inside ``jax.shard_map`` over the EP axis, with the input contract of ``MoEComm``:

    x             [T, H]        payload (any float dtype; float8_e4m3fn travels with ``scales``)
    scales        [T, H // B]   float32 block scales of an fp8 payload, or None
    topk_ids      int32 [T, K]  expert ids in [0, E), or -1 for an unused slot
    topk_weights  float32 [T, K]

Every token is valid (no ``num_tokens``), one rank per DP group (``dp_size == 1``). Expert ``e`` lives on rank
``e // (E // world)``. The round trip returns ``y[t] = sum_k w[t, k] * expert_fn(x[t])_(expert topk_ids[t, k])``,
summed in float32 in slot order and cast to ``out_dtype`` (default: the dtype ``expert_fn`` returns).

``expert_fn`` maps the received rows to the expert outputs, row for row: it is called as ``expert_fn(rows)`` or,
when ``scales`` are given, ``expert_fn(rows, row_scales)``. Rows that hold no token (padding) are zeros and
their outputs are ignored.

- ``ragged_*`` (MaxText style): sort the (token, slot) rows by expert, exchange the per-expert counts with
  ``all_gather``, ``jax.lax.ragged_all_to_all`` exactly the rows each peer needs, regroup the received rows by
  local expert (``group_sizes`` makes them ``ragged_dot``-ready), and the same way back. Not implemented by
  XLA:CPU (compiling it there fails with UNIMPLEMENTED).
- ``padded_*`` (worst-case capacity): one ``jax.lax.all_to_all`` of a ``[world, T * K, H]`` buffer per direction,
  each peer's chunk holding the rows for that peer sorted by expert and zero-padded to ``T * K`` rows (the most a
  rank can send to one peer). The receiver gets ``expert_ids`` (local expert of each row, -1 for padding).

The halves (``*_dispatch`` / ``*_combine``) return and take plain pytrees, so the baselines can be used in a model
the way ``MoEComm.dispatch`` / ``MoEComm.combine`` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

__all__ = [
    "PaddedDispatched",
    "RaggedDispatched",
    "padded_combine",
    "padded_dispatch",
    "padded_round_trip",
    "ragged_combine",
    "ragged_dispatch",
    "ragged_round_trip",
]


def _pytree(cls, meta=()):
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=list(meta))


@_pytree
class RaggedDispatched:
    """What ``ragged_dispatch`` returns on one shard (R = world * T * K rows, the most a rank can receive).

    expert_x:      [R, H] payload rows grouped by local expert, inside an expert by (source rank, token);
                   rows past ``sum(group_sizes)`` are zeros.
    expert_scales: [R, H // B] float32 (fp8 payloads) or None, same order.
    group_sizes:   int32 [L] rows per local expert.
    order:         int32 [T * K] sender side: (token * K + slot) of each row in expert-sorted order.
    local_order:   int32 [R] receiver side: received-buffer row of each expert_x row.
    pair_sizes:    int32 [world(src), world(dst)] rows each rank sends each rank.
    topk_ids:      int32 [T, K] this rank's routing.
    """

    expert_x: Array
    expert_scales: Array | None
    group_sizes: Array
    order: Array
    local_order: Array
    pair_sizes: Array
    topk_ids: Array


@_pytree
class PaddedDispatched:
    """What ``padded_dispatch`` returns on one shard (C = T * K rows per peer).

    expert_x:      [world * C, H] payload; chunk s holds source rank s's rows for this rank, sorted by expert,
                   then zero padding.
    expert_scales: [world * C, H // B] float32 (fp8) or None.
    expert_ids:    int32 [world * C] local expert of each row, -1 for padding.
    dest:          int32 [T * K] sender side: destination rank of each expert-sorted row (world for none).
    pos:           int32 [T * K] its row inside the destination's chunk.
    order:         int32 [T * K] (token * K + slot) of each expert-sorted row.
    topk_ids:      int32 [T, K] this rank's routing.
    """

    expert_x: Array
    expert_scales: Array | None
    expert_ids: Array
    dest: Array
    pos: Array
    order: Array
    topk_ids: Array


def _world(axis_name: str) -> int:
    return jax.lax.axis_size(axis_name)


def _sort_by_expert(topk_ids: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """(key [T*K]: expert id or E for an unused slot, order: stable sort of the rows by key, counts [E])."""
    flat = topk_ids.reshape(-1)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return key, order, counts


def _inverse(perm: Array) -> Array:
    """The inverse permutation (a scatter of an iota: cheaper than a second sort)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _exclusive_cumsum(a: Array, axis: int = 0) -> Array:
    return jnp.cumsum(a, axis=axis) - a


def _apply_expert(expert_fn: Callable, rows: Array, scales: Array | None) -> Array:
    return expert_fn(rows) if scales is None else expert_fn(rows, scales)


def _weighted_sum(rows: Array, topk_ids: Array, topk_weights: Array, out_dtype) -> Array:
    """rows [T * K, H] in (token, slot) order -> y [T, H] = sum_k w[t, k] * rows[t, k] in float32, slot order."""
    T, K = topk_ids.shape
    rows = rows.reshape(T, K, -1).astype(jnp.float32)
    weights = jnp.where(topk_ids >= 0, topk_weights.astype(jnp.float32), 0.0)
    acc = jnp.zeros((T, rows.shape[-1]), jnp.float32)
    for k in range(K):
        acc = acc + weights[:, k, None] * rows[:, k]
    return acc.astype(out_dtype)


# ragged_all_to_all (MaxText style) ---------------------------------------------------------------------------


def ragged_dispatch(x: Array, topk_ids: Array, *, num_experts: int, axis_name: str,
                    scales: Array | None = None) -> RaggedDispatched:
    """Sends each (token, slot) row to its expert's rank with ``ragged_all_to_all``; see RaggedDispatched."""
    T, K = topk_ids.shape
    world = _world(axis_name)
    L = num_experts // world
    R = world * T * K
    me = jax.lax.axis_index(axis_name)
    _, order, counts = _sort_by_expert(topk_ids, num_experts)
    token = order // K

    all_counts = jax.lax.all_gather(counts, axis_name).reshape(world, world, L)  # [src, dst rank, local expert]
    pair_sizes = all_counts.sum(2)  # [src, dst]
    send_sizes = pair_sizes[me]
    recv_sizes = pair_sizes[:, me]
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = _exclusive_cumsum(pair_sizes, axis=0)[me]  # where my chunk starts in each receiver

    def exchange(rows: Array) -> Array:
        out = jnp.zeros((R,) + rows.shape[1:], rows.dtype)
        return jax.lax.ragged_all_to_all(rows, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)

    recv_x = exchange(x[token])
    recv_scales = None if scales is None else exchange(scales[token])

    # Regroup by local expert: the buffer holds source 0's rows (expert-sorted), then source 1's, ...
    mine = jax.lax.dynamic_index_in_dim(all_counts, me, axis=1, keepdims=False)  # [src, L]
    segment = jnp.repeat(jnp.tile(jnp.arange(L, dtype=jnp.int32), world), mine.reshape(-1), total_repeat_length=R)
    segment = jnp.where(jnp.arange(R) < mine.sum(), segment, L)
    local_order = jnp.argsort(segment, stable=True).astype(jnp.int32)
    return RaggedDispatched(
        expert_x=recv_x[local_order],
        expert_scales=None if recv_scales is None else recv_scales[local_order],
        group_sizes=mine.sum(0).astype(jnp.int32),
        order=order,
        local_order=local_order,
        pair_sizes=pair_sizes,
        topk_ids=topk_ids,
    )


def ragged_combine(expert_y: Array, d: RaggedDispatched, topk_weights: Array, *, axis_name: str,
                   out_dtype=None) -> Array:
    """Sends expert outputs [R, H] (in ``d.expert_x`` order) home and returns y [T, H]."""
    T, K = d.topk_ids.shape
    me = jax.lax.axis_index(axis_name)
    send_sizes = d.pair_sizes[:, me]  # back to each source what it sent me
    recv_sizes = d.pair_sizes[me]
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = _exclusive_cumsum(d.pair_sizes, axis=1)[:, me]  # my chunk's start in each source's rows
    back = expert_y[_inverse(d.local_order)]  # received-buffer order
    out = jnp.zeros((T * K,) + expert_y.shape[1:], expert_y.dtype)
    rows = jax.lax.ragged_all_to_all(back, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
    rows = rows[_inverse(d.order)]  # (token, slot) order
    return _weighted_sum(rows, d.topk_ids, topk_weights, out_dtype or expert_y.dtype)


def ragged_round_trip(x: Array, topk_ids: Array, topk_weights: Array, *, num_experts: int, axis_name: str,
                      expert_fn: Callable, scales: Array | None = None, out_dtype=None) -> Array:
    """``ragged_combine(expert_fn(ragged_dispatch(...).expert_x), ...)``: y [T, H]."""
    d = ragged_dispatch(x, topk_ids, num_experts=num_experts, axis_name=axis_name, scales=scales)
    expert_y = _apply_expert(expert_fn, d.expert_x, d.expert_scales)
    return ragged_combine(expert_y, d, topk_weights, axis_name=axis_name, out_dtype=out_dtype)


# all_to_all at worst-case capacity ---------------------------------------------------------------------------


def padded_dispatch(x: Array, topk_ids: Array, *, num_experts: int, axis_name: str,
                    scales: Array | None = None) -> PaddedDispatched:
    """Sends each (token, slot) row to its expert's rank in a padded ``all_to_all``; see PaddedDispatched."""
    T, K = topk_ids.shape
    world = _world(axis_name)
    L = num_experts // world
    C = T * K
    key, order, _ = _sort_by_expert(topk_ids, num_experts)
    key_sorted = key[order]
    dest = key_sorted // L  # world for unused slots (key == E)
    counts = jnp.bincount(dest, length=world + 1)
    pos = (jnp.arange(C, dtype=jnp.int32) - _exclusive_cumsum(counts)[dest]).astype(jnp.int32)
    token = order // K

    def exchange(rows: Array, fill) -> Array:
        staging = jnp.full((world, C) + rows.shape[1:], fill, rows.dtype).at[dest, pos].set(rows, mode="drop")
        recv = jax.lax.all_to_all(staging, axis_name, split_axis=0, concat_axis=0, tiled=True)
        return recv.reshape((world * C,) + rows.shape[1:])

    return PaddedDispatched(
        expert_x=exchange(x[token], 0),
        expert_scales=None if scales is None else exchange(scales[token], 0),
        expert_ids=exchange(jnp.where(key_sorted < num_experts, key_sorted % L, -1), -1),
        dest=dest,
        pos=pos,
        order=order,
        topk_ids=topk_ids,
    )


def padded_combine(expert_y: Array, d: PaddedDispatched, topk_weights: Array, *, axis_name: str,
                   out_dtype=None) -> Array:
    """Sends expert outputs [world * T * K, H] (in ``d.expert_x`` order) home and returns y [T, H]."""
    T, K = d.topk_ids.shape
    world = _world(axis_name)
    back = jax.lax.all_to_all(expert_y.reshape((world, T * K) + expert_y.shape[1:]), axis_name,
                              split_axis=0, concat_axis=0, tiled=True)
    rows = back.at[d.dest, d.pos].get(mode="fill", fill_value=0)  # expert-sorted order
    rows = rows[_inverse(d.order)]  # (token, slot) order
    return _weighted_sum(rows, d.topk_ids, topk_weights, out_dtype or expert_y.dtype)


def padded_round_trip(x: Array, topk_ids: Array, topk_weights: Array, *, num_experts: int, axis_name: str,
                      expert_fn: Callable, scales: Array | None = None, out_dtype=None) -> Array:
    """``padded_combine(expert_fn(padded_dispatch(...).expert_x), ...)``: y [T, H]."""
    d = padded_dispatch(x, topk_ids, num_experts=num_experts, axis_name=axis_name, scales=scales)
    expert_y = _apply_expert(expert_fn, d.expert_x, d.expert_scales)
    return padded_combine(expert_y, d, topk_weights, axis_name=axis_name, out_dtype=out_dtype)

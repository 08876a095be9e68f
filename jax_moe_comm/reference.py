"""The reference backend: pure JAX collectives inside shard_map, one function per kernel phase.

It is the oracle of the NVSHMEM backend (same layout, same handle, bit-for-bit) and the backend of every
machine without NVSHMEM. Each phase mirrors its kernel:

  dispatch_send  count rows per destination, pack a staging buffer per destination rank, transfer
                 (the kernel puts each row into the destination's slot; here one padded ``all_to_all``)
  dispatch_recv  order the arrived rows by (local expert, source DP group, token), pack them, write the handle
  combine_send   send every valid expert row home to all replicas of its source DP group
  combine_recv   weighted fp32 sum of each token's K rows, in slot order

and the fused ``dispatch`` and ``combine`` compose them (the kernels fuse each pair into one kernel).

All functions run per shard, inside shard_map over the mesh; their collectives name only the EP axes
(``geo.axis_name``, a tuple), so each EP group exchanges among its own ranks. Plain JAX AD differentiates them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from . import errors
from .config import Geometry, round_up
from .quantize import quantize_rows
from .types import CombineHandle, Dispatched, pytree_dataclass


@pytree_dataclass
class PendingDispatch:
    """Rows in flight after dispatch_send (per shard). ``recv_meta`` [world, rows_per_peer] int32 holds, for each
    row that arrived from source rank s, ``(local_expert * max_tokens + token) * K + slot``, or -1."""

    recv_x: Array
    recv_scales: Array | None
    recv_meta: Array
    topk_ids: Array
    num_tokens: Array
    status: Array
    topk_weights: Array | None = None  # given to dispatch_send: into the handle, for combine


@pytree_dataclass
class PendingCombine:
    """Expert rows in flight after combine_send: ``recv_y`` [world, rows_per_peer, H] and ``recv_slot``
    [world, rows_per_peer] int32 (``token * K + slot`` on this rank, -1 for none)."""

    recv_y: Array
    recv_slot: Array
    topk_ids: Array
    num_tokens: Array
    status: Array
    topk_weights: Array | None  # given to combine_send (else to combine_recv)


def _first_true(mask: Array, values: Array) -> tuple[Array, Array]:
    """(row index, value) of the first True entry of a [T, K] mask in row-major order; (0, 0) if none."""
    flat = jnp.argmax(mask.reshape(-1))
    return flat // mask.shape[1], values.reshape(-1)[flat]


def live_slots(geo: Geometry, topk_ids: Array) -> Array:
    """[T, K] bool: the slots that route somewhere, as the kernels decide: an id in [0, E) that no earlier slot of
    the token names (a repeated id is an error, and its later slot is dropped)."""
    valid = (topk_ids >= 0) & (topk_ids < geo.cfg.num_experts)
    same = topk_ids[:, :, None] == topk_ids[:, None, :]
    earlier = jnp.tril(jnp.ones((geo.K, geo.K), bool), k=-1)  # [k, j]: j < k
    return valid & ~jnp.any(same & earlier & valid[:, None, :], axis=2)


def _validate_routing(geo: Geometry, topk_ids: Array, live: Array, rank: Array) -> Array:
    """Status word: an id outside [-1, E) or a repeated id within one token (valid rows only)."""
    bad = live[:, None] & ((topk_ids < -1) | (topk_ids >= geo.cfg.num_experts))
    repeated = live[:, None] & (topk_ids >= 0) & (topk_ids < geo.cfg.num_experts) & ~live_slots(geo, topk_ids)
    code = jnp.where(bad.any(), errors.BAD_EXPERT_ID, 0) | jnp.where(repeated.any(), errors.REPEATED_EXPERT_ID, 0)
    token, value = _first_true(jnp.where(bad.any(), bad, repeated), topk_ids)
    return errors.status(code, 0, rank, token, value)


def _exchange(geo: Geometry, per_peer: Array) -> Array:
    """[world(dest), ...] on every rank -> [world(src), ...]: the transfer of both directions."""
    return jax.lax.all_to_all(per_peer, geo.axis_name, split_axis=0, concat_axis=0, tiled=True)


def _scatter_rows(shape_rows: tuple, index: tuple, rows: Array, fill) -> Array:
    """rows scattered into a new array filled with `fill`; out-of-range indices are dropped (never written)."""
    out = jnp.full(shape_rows + rows.shape[1:], fill, rows.dtype)
    return out.at[index].set(rows, mode="drop")


def dispatch_send(geo: Geometry, x: Array, topk_ids: Array, scales: Array | None, num_tokens: Array,
                  topk_weights: Array | None = None, after: Array | None = None) -> PendingDispatch:
    """Counts rows per destination rank and packs them into per-peer staging slots, then transfers. `after` orders
    the NVSHMEM backend's call (see dispatch).

    Ordering inside a destination's staging is by (token, slot), so the receiver's layout is deterministic.
    Replica j of a DP group sends tokens i with i % dp_size == j. topk_weights, if given, go into the handle. A bf16
    x of an fp8 MoEComm is quantized first (MoEComm.dispatch's quantize).
    """
    T, K = geo.T, geo.K
    if geo.cfg.is_fp8 and x.dtype == jnp.bfloat16:  # dispatch(..., quantize=...): the kernels' quantization
        x, scales = quantize_rows(x, geo.cfg.scale_block)
    rank = jax.lax.axis_index(geo.axis_name)
    token = jnp.arange(T, dtype=jnp.int32)
    live = token < num_tokens
    status = _validate_routing(geo, topk_ids, live, rank)

    mine = live & (token % geo.cfg.dp_size == rank % geo.cfg.dp_size)
    sends = mine[:, None] & live_slots(geo, topk_ids)
    dest = jnp.where(sends, topk_ids // geo.L, geo.world).reshape(-1)  # world = "nowhere"
    order = jnp.argsort(dest, stable=True)  # by destination, then (token, slot)
    dest_sorted = dest[order]
    counts = jnp.bincount(dest, length=geo.world + 1)
    start = jnp.cumsum(counts) - counts
    pos = jnp.arange(T * K, dtype=jnp.int32) - start[dest_sorted]
    tok_sorted, slot_sorted = order // K, order % K
    local_expert = topk_ids.reshape(-1)[order] % geo.L
    meta = jnp.where(dest_sorted < geo.world, (local_expert * T + tok_sorted) * K + slot_sorted, -1)

    index = (dest_sorted, pos)
    staging_shape = (geo.world, geo.rows_per_peer)
    recv_x = _exchange(geo, _scatter_rows(staging_shape, index, x[tok_sorted], 0))
    recv_meta = _exchange(geo, _scatter_rows(staging_shape, index, meta.astype(jnp.int32), -1))
    recv_scales = None
    if scales is not None:
        recv_scales = _exchange(geo, _scatter_rows(staging_shape, index, scales[tok_sorted], 0))
    return PendingDispatch(recv_x, recv_scales, recv_meta, topk_ids, num_tokens, status, topk_weights)


def dispatch_recv(geo: Geometry, p: PendingDispatch) -> Dispatched:
    """Packs arrived rows by (local expert, source DP group, token), pads each expert to `align`, and writes
    the handle. Rows past `capacity` are dropped and, unless the config's overflow policy is "drop", fail the call."""
    T, K, L = geo.T, geo.K, geo.L
    meta = p.recv_meta.reshape(-1)
    arrived = meta >= 0
    src_group = (jnp.arange(geo.world, dtype=jnp.int32) // geo.cfg.dp_size).repeat(geo.rows_per_peer)
    local_expert, token, slot = meta // (T * K), (meta // K) % T, meta % K
    sort_key = jnp.where(arrived, (local_expert * geo.num_dp + src_group) * T + token, L * geo.num_dp * T)
    order = jnp.argsort(sort_key, stable=True)
    expert_sorted = jnp.where(arrived, local_expert, L)[order]

    counts = jnp.bincount(expert_sorted, length=L + 1)[:L].astype(jnp.int32)
    per_expert = geo.expert_capacity  # capacity_per="expert": each expert keeps its first rows in this order
    kept = counts if per_expert is None else jnp.minimum(counts, per_expert)
    group_sizes = round_up(kept, geo.cfg.align) if geo.cfg.align > 1 else kept
    first_unpadded = jnp.cumsum(counts) - counts
    first_packed = jnp.cumsum(group_sizes) - group_sizes
    expert_or_last = jnp.minimum(expert_sorted, L - 1)
    rank_in_expert = jnp.arange(meta.shape[0], dtype=jnp.int32) - first_unpadded[expert_or_last]
    fits = (expert_sorted < L) & (rank_in_expert < kept[expert_or_last])
    row = jnp.where(fits, first_packed[expert_or_last] + rank_in_expert, geo.capacity)
    row = jnp.where(row < geo.capacity, row, geo.capacity)  # overflowing rows are dropped, never written

    needed = jnp.sum(group_sizes)
    rank = jax.lax.axis_index(geo.axis_name)
    pooled = needed > geo.capacity
    code = lambda over: jnp.where(over & (geo.cfg.overflow == "error"), errors.CAPACITY_OVERFLOW, 0)  # noqa: E731
    overflow = errors.status(code(pooled), 1, rank, needed, geo.capacity)
    if per_expert is not None:  # the first expert over its capacity (the kernels report the same)
        over = counts > per_expert
        first = jnp.argmax(over)
        overflow = errors.first_failure(overflow, errors.status(code(over.any()), 1, rank, counts[first], per_expert))

    origin = jnp.where(arrived, (src_group * T + token) * K + slot, -1)[order]
    cap = (geo.capacity,)
    expert_x = _scatter_rows(cap, (row,), p.recv_x.reshape((-1,) + p.recv_x.shape[2:])[order], 0)
    expert_scales = None
    if p.recv_scales is not None:
        expert_scales = _scatter_rows(cap, (row,), p.recv_scales.reshape((-1,) + p.recv_scales.shape[2:])[order], 0)
    row_origin = _scatter_rows(cap, (row,), origin, -1)
    handle = CombineHandle(row_origin=row_origin, topk_ids=p.topk_ids, num_tokens=p.num_tokens,
                           status=errors.first_failure(p.status, overflow), topk_weights=p.topk_weights)
    return Dispatched(expert_x=expert_x, expert_scales=expert_scales, group_sizes=group_sizes, handle=handle)


def combine_send(geo: Geometry, expert_y: Array, handle: CombineHandle,
                 topk_weights: Array | None = None) -> PendingCombine:
    """Sends each valid expert row to every replica of its source DP group, tagged with its (token, slot). The
    weights, if given here (or None with weights in the handle: those), are kept for combine_recv (the kernels'
    pre-reduction is a speed matter only)."""
    T, K = geo.T, geo.K
    if topk_weights is None:
        topk_weights = handle.topk_weights
    origin = handle.row_origin
    has_token = origin >= 0
    group = jnp.where(has_token, origin // (T * K), geo.num_dp)
    order = jnp.argsort(group, stable=True)
    group_sorted = group[order]
    counts = jnp.bincount(group, length=geo.num_dp + 1)
    start = jnp.cumsum(counts) - counts
    pos = jnp.arange(origin.shape[0], dtype=jnp.int32) - start[group_sorted]
    index = (group_sorted, pos)
    per_group = (geo.num_dp, geo.rows_per_peer)
    rows = _scatter_rows(per_group, index, expert_y[order], 0)
    slots = _scatter_rows(per_group, index, (origin % (T * K))[order], -1)
    replica_group = jnp.arange(geo.world) // geo.cfg.dp_size  # destination rank -> its DP group
    return PendingCombine(
        recv_y=_exchange(geo, rows[replica_group]),
        recv_slot=_exchange(geo, slots[replica_group]),
        topk_ids=handle.topk_ids,
        num_tokens=handle.num_tokens,
        status=handle.status,
        topk_weights=topk_weights,
    )


def round_trip_status(geo: Geometry, own: Array) -> Array:
    """The round trip's status, the same on every rank: the lowest rank's first failure (the kernels publish each
    rank's to every rank and merge them alike)."""
    every = jax.lax.all_gather(own, geo.axis_name)  # [world, STATUS_WORDS]
    first = jnp.argmax(every[:, errors.CODE] != 0)
    return every[first]


def combine_recv(geo: Geometry, q: PendingCombine, topk_weights: Array | None) -> Array:
    """y[i] = sum_k w[i, k] * row(i, k) in fp32, k in order; dead slots and rows >= num_tokens give 0. NaN on every
    rank when the round trip failed on any. topk_weights may be None when combine_send had them."""
    T, K = geo.T, geo.K
    topk_weights = q.topk_weights if topk_weights is None else topk_weights
    slot = q.recv_slot.reshape(-1)
    slot = jnp.where(slot >= 0, slot, T * K)  # -1 would wrap around; send it out of range instead
    rows = q.recv_y.reshape((-1,) + q.recv_y.shape[2:]).astype(jnp.float32)
    by_slot = _scatter_rows((T * K,), (slot,), rows, 0).reshape(T, K, -1)
    live = jnp.arange(T) < q.num_tokens
    weights = jnp.where(live[:, None] & live_slots(geo, q.topk_ids), topk_weights.astype(jnp.float32), 0.0)
    acc = jnp.zeros(by_slot.shape[::2], jnp.float32)
    for k in range(K):  # fixed summation order: the kernel adds slots 0..K-1 the same way
        acc = acc + weights[:, k, None] * by_slot[:, k]
    status = round_trip_status(geo, q.status)
    if geo.check_errors:  # True or "sync": every rank raises here, after the last transfer, if the round trip failed
        acc = errors.check_if_failed(status, after=acc)  # y depends on it: an eager shard_map raises at its read
    y = jnp.where(live[:, None], acc, 0.0).astype(geo.cfg.out_dtype)
    return jnp.where(status[errors.CODE] != 0, jnp.asarray(jnp.nan, y.dtype), y)


def dispatch(geo: Geometry, x: Array, topk_ids: Array, scales: Array | None, num_tokens: Array,
             topk_weights: Array | None = None, after: Array | None = None) -> Dispatched:
    """The fused call (the NVSHMEM backend runs it as one kernel): dispatch_recv(dispatch_send(...)). `after` orders
    the NVSHMEM backend's call; here every step is a pure function of its inputs, with no buffers to reuse."""
    return dispatch_recv(geo, dispatch_send(geo, x, topk_ids, scales, num_tokens, topk_weights))


def combine(geo: Geometry, expert_y: Array, handle: CombineHandle, topk_weights: Array | None,
            weights_at: str) -> Array:
    """The fused call, the weights given to combine_send (``weights_at`` "send") or to combine_recv: the same sums
    here either way (the NVSHMEM backend pre-reduces with the send). None: the handle's (given to dispatch)."""
    if topk_weights is None:
        topk_weights = handle.topk_weights
    if weights_at == "send":
        return combine_recv(geo, combine_send(geo, expert_y, handle, topk_weights), None)
    return combine_recv(geo, combine_send(geo, expert_y, handle, None), topk_weights)

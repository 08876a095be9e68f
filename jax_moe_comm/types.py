"""The pytrees that travel between the phases: what dispatch returns and what combine needs.

Both backends produce these same types with the same contents, so a handle from one phase can be inspected,
saved through ``jax.lax.scan`` carries, or compared across backends in tests.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import Array


def pytree_dataclass(cls=None, *, static: tuple[str, ...] = ()):
    """A frozen dataclass registered as a pytree: every field is an array leaf (None is an empty subtree) except
    the `static` ones, which are part of the tree's structure."""

    def register(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        data = [n for n in names if n not in static]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(static))

    return register if cls is None else register(cls)


@pytree_dataclass(static=("rows",))
class CombineHandle:
    """Everything combine needs to send expert outputs home. Per shard:

    row_origin: int32 [capacity]. For packed row p, ``(src_group * max_tokens + token) * K + slot``: the DP
        group that sent it, the token's index there, and the top-k slot it fills. -1 for rows that hold no
        token (alignment padding and the unused tail).
    topk_ids:   int32 [max_tokens, K], this rank's own routing (combine_recv counts each token's valid slots).
    num_tokens: int32 [], this rank's valid token count; output rows >= num_tokens are zero.
    status:     int32 [8] (errors.STATUS_WORDS), the first error dispatch found on this rank: {code, phase, rank,
        detail_a, detail_b, epoch, 0, 0}, zeros if none (errors.py). Dispatch records errors instead of raising them so
        that every rank finishes the round trip; how the round trip's error is raised is MoEComm's check_errors.
    topk_weights: float32 [max_tokens, K], the weights given to dispatch, or None. With them combine takes no
        weights of its own; on the NVSHMEM backend's NVLink path they travelled with the tokens' ids, so the
        pre-reduced combine_send does not exchange them.
    grad_link:  float32 [1], zero (its value is never read). In a differentiated step, whether it carries a
        gradient tells combine's gradient rule whether dispatch's follows it (they share one backward round trip;
        autodiff.py). None in a handle made by hand: combine's rule then finishes the backward round trip itself.
    rows:       static int, the tokens n of a dispatch given fewer than max_tokens (combine returns [n, H]); None:
        max_tokens. The arrays above always have max_tokens rows.
    """

    row_origin: Array
    topk_ids: Array
    num_tokens: Array
    status: Array
    topk_weights: Array | None = None
    grad_link: Array | None = None
    rows: int | None = None


@pytree_dataclass
class Dispatched:
    """The result of dispatch on one shard.

    expert_x:      [capacity, H] payload dtype. Rows grouped by local expert (expert 0's rows first), inside an
                   expert ordered by (source DP group, source token index). Each expert's run is padded with zero
                   rows to a multiple of ``align``; rows past ``sum(group_sizes)`` hold no token.
    expert_scales: [capacity, H // scale_block] float32 for fp8 payloads, else None; same row order.
    group_sizes:   int32 [L], rows per local expert including alignment padding (``jax.lax.ragged_dot``-ready);
                   with ``overflow="drop"`` the rows kept (their sum is at most capacity).
    handle:        CombineHandle for ``combine``.
    expert_counts: int32 [E], the load of every expert of the layer: live (token, slot) pairs routed to it over
                   the whole EP group, each DP group's tokens once, before any drop; the same on every rank. For
                   load-balancing losses and monitoring; computed on the device: by the NVSHMEM dispatch's kernels
                   (no collective), or on the reference backend a psum of E integers (removed when nothing reads it).
                   In a round trip that failed on a protocol error (a late or dead peer; y is NaN) the NVSHMEM counts
                   hold only what arrived.
    dropped_rows:  int32 [], rows for this rank's experts that did not fit in capacity (0 unless it overflowed).
    expert_ids:    int32 [capacity], each row's local expert (0 .. L-1: the run it is in), -1 for rows holding no
                   token (alignment padding, the tail past ``sum(group_sizes)``): e.g. per-expert biases or scales.
    expert_weights: float32 [capacity], each row's top-k weight when the weights went with dispatch
                   (``topk_weights=``) of a ``MoEComm(expert_weights=True)``, 0 for rows holding no token; else
                   None. Differentiable: its gradient reaches the weights given to dispatch (for routers that scale a
                   token by its weight before the expert).
    """

    expert_x: Array
    expert_scales: Array | None
    group_sizes: Array
    handle: CombineHandle
    expert_counts: Array | None = None
    dropped_rows: Array | None = None
    expert_ids: Array | None = None
    expert_weights: Array | None = None

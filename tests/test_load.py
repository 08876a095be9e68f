"""Capacity factor, the "drop" overflow policy and the expert-load counts, on the reference backend against the
NumPy oracle (tests/oracle.py). The NVSHMEM backend computes the counts with the same code (jax_moe_comm/load.py)
and drops the same rows (tests/gpu: the kernel harness's "drop" cases).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import drop_slots, ep_mesh, skewed_topk, uniform_topk
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import MoEComm, MoECommConfig

WORLD, E, K, H, T = 4, 8, 3, 16, 12


# Capacity as a factor of the average load ------------------------------------------------------------------
@pytest.mark.parametrize(("factor", "align", "dp_size", "want"), [
    (1.0, 1, 1, 2 * math.ceil(4 * 12 * 3 / 8)),      # L = 2 experts a rank, 18 rows each on average
    (1.25, 1, 1, 2 * math.ceil(1.25 * 18)),
    (1.25, 8, 1, 2 * 24),                              # each expert's share rounded up to align
    (1.0, 1, 2, 2 * math.ceil(2 * 12 * 3 / 8)),       # two DP groups send, not four ranks
    (100.0, 1, 1, 4 * 12 * 2),                         # never more than the worst case (min(K, L) = 2)
])
def test_capacity_factor_is_the_average_load_per_expert_times_the_factor(factor, align, dp_size, want):
    cfg = MoECommConfig(E, K, H, T, capacity_factor=factor, align=align, dp_size=dp_size)
    assert cfg.capacity_for(WORLD) == want
    assert MoEComm(cfg, ep_mesh(WORLD), backend="reference").capacity == want


@pytest.mark.parametrize(("fields", "message"), [
    (dict(capacity_factor=0.0), "capacity_factor must be a positive number"),
    (dict(capacity_factor=float("inf")), "capacity_factor must be a positive number"),
    (dict(capacity_factor="2"), "capacity_factor must be a positive number"),
    (dict(capacity_factor=1.5, capacity=10), "not both"),
    (dict(overflow="truncate"), "overflow must be one of"),
])
def test_bad_capacity_options_name_the_argument(fields, message):
    with pytest.raises(ValueError, match=message):
        MoECommConfig(E, K, H, T, **fields)


# The round trip under a capacity that overflows -----------------------------------------------------------------
def _problem(rng, dp_size=1):
    """Per-group inputs where expert 0 gets every token: x [G, T, H], ids [G, T, K], num_tokens [G], weights
    [world, T, K] (replicas of a group hold the same tokens and weights)."""
    groups = WORLD // dp_size
    x = rng.standard_normal((groups, T, H)).astype(np.float32)
    ids = drop_slots(rng, skewed_topk(rng, (groups, T), E, K), 0.1)
    num_tokens = rng.integers(T // 2, T + 1, groups).astype(np.int32)
    weights = np.repeat(rng.random((groups, T, K)).astype(np.float32), dp_size, axis=0)
    return x, ids, num_tokens, weights


def _round_trip(comm, x, ids, num_tokens, weights):
    """dispatch, expert_y = 2 * expert_x, combine through the global view: (Dispatched, y) as NumPy."""
    dp = comm.cfg.dp_size

    def per_rank(a):
        return jnp.asarray(np.repeat(a, dp, axis=0).reshape((-1,) + a.shape[2:]))

    @jax.jit
    def step(x, ids, n, w):
        d = jax_moe_comm.dispatch(comm, x, ids, num_tokens=n)
        return d, jax_moe_comm.combine(comm, 2 * d.expert_x, d.handle, w)

    d, y = step(per_rank(x), per_rank(ids), jnp.asarray(np.repeat(num_tokens, dp)), jnp.asarray(weights.reshape(-1, K)))
    return jax.tree.map(np.asarray, d), np.asarray(y)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_drop_keeps_the_rows_that_fit_and_their_slots_combine_alone(dp_size, rng, seed):
    """With overflow="drop" the layout is the oracle's cut at capacity, group_sizes count the rows kept, the dropped
    slots add nothing to y, dropped_rows counts them, and nothing fails (the default check_errors=True raises)."""
    capacity = 10
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, dp_size=dp_size, capacity=capacity,
                        align=2, overflow="drop")
    comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference")
    x, ids, num_tokens, weights = _problem(rng, dp_size)
    d, y = _round_trip(comm, x, ids, num_tokens, weights)

    layouts = oracle.dispatch(x, ids, num_tokens, world=WORLD, dp_size=dp_size, num_experts=E, align=2,
                              capacity=capacity)
    assert layouts[0].rows_needed > capacity, "rank 0 must overflow, or the test shows nothing"
    L = E // WORLD
    for rank, want in enumerate(layouts):
        rows = slice(rank * capacity, (rank + 1) * capacity)
        np.testing.assert_array_equal(d.expert_x[rows], want.expert_x, err_msg=f"rank {rank} expert_x (seed={seed})")
        np.testing.assert_array_equal(d.handle.row_origin[rows], want.row_origin, err_msg=f"rank {rank} row_origin")
        end = np.cumsum(want.group_sizes)
        kept = np.clip(end, 0, capacity) - np.clip(end - want.group_sizes, 0, capacity)
        np.testing.assert_array_equal(d.group_sizes[rank * L:(rank + 1) * L], kept, err_msg=f"rank {rank} sizes")
        real = int(np.sum(want.row_origin >= 0))
        assert d.dropped_rows[rank] == _real_rows(layouts[rank], ids, num_tokens, rank, L) - real

    expert_y = np.stack([2 * lay.expert_x for lay in layouts])
    want_y = oracle.combine(expert_y, layouts, ids, weights, num_tokens, dp_size=dp_size, num_experts=E,
                            out_dtype=np.float32)
    np.testing.assert_allclose(y.reshape(WORLD, T, H), want_y, rtol=1e-6, atol=1e-6, err_msg=f"y (seed={seed})")
    assert not np.isnan(y).any()


def _real_rows(layout, ids, num_tokens, rank, num_local) -> int:
    """Rows the routing sends to `rank`'s experts (before any capacity): live slots naming them."""
    rows = 0
    for g in range(ids.shape[0]):
        for t in range(int(num_tokens[g])):
            for k in range(K):
                if oracle.routed(ids, g, t, k) and int(ids[g, t, k]) // num_local == rank:
                    rows += 1
    return rows


def test_error_policy_fails_the_same_overflow(rng):
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, capacity=10)
    comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference")
    message = r"capacity is 10 .* or drop what does not fit \(overflow=\"drop\"\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _round_trip(comm, *_problem(rng))


def test_drop_trains_like_plain_ad(rng, seed):
    """Gradients through a dropping round trip (custom VJP rules) equal plain AD's: dropped slots get none."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, capacity_factor=1.0, overflow="drop")
    x, ids, num_tokens, weights = _problem(rng)
    expert_w = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)

    def grads(custom_vjp):
        comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=custom_vjp)

        def per_shard(x, ids, n, w, ew):
            d = comm.dispatch(x, ids, num_tokens=n[0])
            rows = jnp.tanh(jax.lax.ragged_dot(d.expert_x, ew, d.group_sizes))
            return comm.combine(rows, d.handle, w)

        mapped = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))
        loss = lambda x, w, ew: jnp.sum(mapped(x, ids.reshape(-1, K), num_tokens, w, ew) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.reshape(-1, H), weights.reshape(-1, K), expert_w)

    got, want = grads(True), grads(False)
    for name, g, v in zip(("x", "topk_weights", "expert weights"), got, want, strict=True):
        scale = float(np.abs(v).max())
        assert scale > 0, f"d loss / d {name} is all zero"
        np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5 * scale, err_msg=f"d loss / d {name} (seed={seed})")


# Expert-load counts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp_size", [1, 2])
def test_expert_counts_are_the_routings_load_of_every_expert_on_every_rank(dp_size, rng, seed):
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, dp_size=dp_size)
    comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference")
    x, _, num_tokens, weights = _problem(rng, dp_size)
    ids = drop_slots(rng, uniform_topk(rng, (WORLD // dp_size, T), E, K), 0.2)
    ids[0, 0, 1] = ids[0, 0, 0]  # a repeated id: an error, and its later slot is not counted
    comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors=False)
    d, _ = _round_trip(comm, x, ids, num_tokens, weights)
    want = np.zeros(E, np.int32)
    for g in range(ids.shape[0]):
        for t in range(int(num_tokens[g])):
            for k in range(K):
                if oracle.routed(ids, g, t, k):
                    want[ids[g, t, k]] += 1
    np.testing.assert_array_equal(d.expert_counts.reshape(WORLD, E), np.tile(want, (WORLD, 1)),
                                  err_msg=f"seed={seed}")
    assert (d.dropped_rows == 0).all()


def test_unread_counts_cost_no_collective():
    """XLA removes the counts' psum when nothing reads them: a round trip has no all-reduce of its own."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference")
    x = jnp.zeros((WORLD * T, H), jnp.float32)
    ids = jnp.zeros((WORLD * T, K), jnp.int32).at[:, 1].set(1).at[:, 2].set(2)
    w = jnp.ones((WORLD * T, K), jnp.float32)

    def hlo(read_counts):
        def step(x, ids, w):
            d = jax_moe_comm.dispatch(comm, x, ids)
            y = jax_moe_comm.combine(comm, d.expert_x, d.handle, w)
            return (y, d.expert_counts) if read_counts else y
        return jax.jit(step).lower(x, ids, w).compile().as_text()

    assert "all-reduce" not in hlo(False)
    assert "all-reduce" in hlo(True)


# The heap of a whole model -------------------------------------------------------------------------------------
def test_the_readme_heap_table_is_the_librarys():
    from pathlib import Path

    from jax_moe_comm import memory

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    begin, end = "<!-- memory:begin -->", "<!-- memory:end -->"
    shown = readme[readme.index(begin) + len(begin):readme.index(end)].strip()
    assert shown == memory.r1_table(), "regenerate the README's table with python -m jax_moe_comm.memory"


def test_r1_whole_model_heap_at_ep8_fits_2_gib():
    """One MoEComm (fp8 forward, bf16 gradients) serves all 58 MoE layers, their backward pass and remat: its heap is
    the model's. On NVLink at EP8 and 4096 tokens per rank that is at most 2 GiB."""
    from jax_moe_comm import memory

    heap = memory.heap_bytes(memory.r1_config(4096), 8, jnp.bfloat16)
    assert heap <= 2 * memory.GIB, f"{heap / memory.GIB:.2f} GiB"


def test_r1_whole_model_heap_at_ep64_fits_4_gib():
    """At EP64 the model's heap is the dispatch slots of the bf16 gradient rows (a source's tokens at [world][T]) and
    the combine rows at [T][K] (pre-reduced rows placed per token, not per rank): at most 4 GiB at 4096 tokens."""
    from jax_moe_comm import memory

    heap = memory.heap_bytes(memory.r1_config(4096), 64, jnp.bfloat16)
    assert heap <= 4 * memory.GIB, f"{heap / memory.GIB:.2f} GiB"


def test_the_backward_round_trips_share_the_forwards_buffers():
    """An fp8 MoEComm with grad_dtype holds one buffer set, each buffer the larger of the forward's (fp8 rows and
    scales) and the backward's (grad_dtype rows): not the sum of two sets."""
    from jax_moe_comm import memory, nvshmem_backend

    cfg = memory.r1_config(4096)
    grad = cfg.gradient_config(8, jnp.bfloat16)
    forward, backward = (nvshmem_backend.symmetric_layout(c, 8) for c in (cfg, grad))
    shared = nvshmem_backend.symmetric_layout(cfg, 8, shared_with=(grad,))
    assert shared.keys() == forward.keys() == backward.keys()
    assert all(shared[name][1] == max(forward[name][1], backward[name][1]) for name in shared)
    assert shared["dispatch_slots"][1] == backward["dispatch_slots"][1] > forward["dispatch_slots"][1]
    total = memory.heap_bytes(cfg, 8, jnp.bfloat16)
    assert total == sum(size for _, size in shared.values())
    assert total < sum(size for _, size in forward.values()) + sum(size for _, size in backward.values())

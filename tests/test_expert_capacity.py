"""Per-expert capacity (MoECommConfig(capacity_per="expert")): each local expert keeps at most C_e rows, the first in
the receive layout's order (source DP group, then source token); the rows past it are dropped as overflow."""

from __future__ import annotations

import differential
import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc


def _one_hot_routing(world, T, E, expert):
    """Every token of every rank picks `expert` in slot 0 and expert (expert + 1) % E in slot 1."""
    ids = np.zeros((world * T, 2), np.int32)
    ids[:, 0] = expert
    ids[:, 1] = (expert + 1) % E
    return ids


def _round_trip(comm, x, ids, w):
    def fn(x, ids, w):
        d = comm.dispatch(x, ids)
        y = comm.combine(d.expert_x.astype(comm.cfg.out_dtype), d.handle, w)
        return d.expert_x, d.group_sizes, d.handle.row_origin, d.dropped_rows.reshape(1), y

    spec = P("ep")
    return jax.jit(jax.shard_map(fn, mesh=comm.mesh, in_specs=spec, out_specs=spec))(x, ids, w)


def test_capacity_factor_one_keeps_each_experts_share_not_the_ranks_pool():
    # 2 ranks, 4 experts (2 per rank), 8 tokens per rank, K=2: average load 8 rows per expert. All 16 tokens pick
    # experts 0 and 1 (both on rank 0): pooled, rank 0's 16 rows go to expert 0 alone; per expert each keeps 8.
    world, T, E, K, H = 2, 8, 4, 2, 8
    mesh = ep_mesh(world)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(world * T, H)), jnp.float32)
    ids = jnp.asarray(_one_hot_routing(world, T, E, 0))
    w = jnp.ones((world * T, K), jnp.float32)
    kept = {}
    for per in ("rank", "expert"):
        cfg = jmc.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, capacity_factor=1.0,
                                overflow="drop", capacity_per=per)
        comm = jmc.MoEComm(cfg, mesh, "ep", backend="reference")
        _, sizes, origin, dropped, _ = _round_trip(comm, x, ids, w)
        kept[per] = (np.asarray(sizes).reshape(world, 2)[0].tolist(), int(np.asarray(dropped)[0]))
    assert kept["rank"] == ([16, 0], 16)  # the pool of 16 rows: expert 0 takes it all, expert 1 none
    assert kept["expert"] == ([8, 8], 16)  # 8 each


def test_an_expert_keeps_its_first_rows_by_source_group_then_token_and_dropped_slots_add_zero():
    world, T, E, K, H, C = 2, 8, 4, 2, 8, 3
    mesh = ep_mesh(world)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(world * T, H)).astype(np.float32)
    ids = _one_hot_routing(world, T, E, 0)
    w = rng.uniform(size=(world * T, K)).astype(np.float32)
    cfg = jmc.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, capacity=C, overflow="drop",
                            capacity_per="expert")
    comm = jmc.MoEComm(cfg, mesh, "ep", backend="reference")
    assert comm.capacity == 2 * C
    expert_x, sizes, origin, dropped, y = _round_trip(comm, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w))
    origin = np.asarray(origin).reshape(world, -1)
    # Expert 0 keeps tokens 0, 1, 2 of group 0 (slot 0); expert 1 the same tokens' slot 1.
    assert origin[0].tolist() == [0 * K + 0, 1 * K + 0, 2 * K + 0, 0 * K + 1, 1 * K + 1, 2 * K + 1]
    assert (origin[1] == -1).all()
    assert np.asarray(dropped).tolist() == [2 * (world * T - C), 0]
    y = np.asarray(y)
    want = np.zeros_like(y)
    want[:C] = (w[:C, :1] + w[:C, 1:]) * x[:C]  # the kept tokens; every other token's slots were dropped
    np.testing.assert_allclose(y, want, rtol=1e-6)
    # The same layout as the oracle's.
    group_ids = ids.reshape(world, T, K)
    layouts = oracle.dispatch(x.reshape(world, T, H), group_ids, np.full(world, T), world=world, dp_size=1,
                              num_experts=E, align=1, capacity=2 * C, expert_capacity=C)
    for r in range(world):
        assert origin[r].tolist() == layouts[r].row_origin.tolist()
        np.testing.assert_array_equal(np.asarray(expert_x).reshape(world, -1, H)[r], layouts[r].expert_x)


def test_overflow_error_names_the_experts_rows_and_capacity():
    world, T, E, K, H = 2, 4, 4, 2, 8
    cfg = jmc.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, capacity=4, capacity_per="expert")
    comm = jmc.MoEComm(cfg, ep_mesh(world), "ep", backend="reference")
    x = jnp.ones((world * T, H), jnp.float32)
    ids = jnp.asarray(_one_hot_routing(world, T, E, 2))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"8 rows arrived but capacity is 4 \(4 too many\).*"
                       r"capacity_factor in proportion.*of each local expert with capacity_per=\"expert\""):
        jax.block_until_ready(_round_trip(comm, x, ids, jnp.ones((world * T, K), jnp.float32)))


def test_the_config_says_what_capacity_counts():
    cfg = jmc.MoECommConfig(16, 2, 64, 32, capacity_factor=1.25, capacity_per="expert", align=4)
    assert "capacity_per='expert'" in repr(cfg)
    # world 4: 4 local experts, average 4 groups * 32 tokens * 2 / 16 = 16 rows per expert, times 1.25 = 20
    # (a multiple of align).
    assert cfg.expert_capacity_for(4) == 20
    assert cfg.capacity_for(4) == 4 * 20
    default = jmc.MoECommConfig(16, 2, 64, 32, capacity_per="expert")
    assert default.expert_capacity_for(4) == 4 * 32  # every row it can get
    assert default.capacity_for(4) == default.worst_case_rows(4) == 4 * 32 * 2  # at most the worst case
    with pytest.raises(ValueError, match=r"capacity \(6 rows per expert, capacity_per='expert'\) must be a multiple "
                                         r"of align \(4\): give capacity=8"):
        jmc.MoECommConfig(16, 2, 64, 32, capacity=6, align=4, capacity_per="expert")
    with pytest.raises(ValueError, match="capacity_per must be one of"):
        jmc.MoECommConfig(16, 2, 64, 32, capacity_per="token")
    comm = jmc.MoEComm(cfg, ep_mesh(4), "ep", backend="reference")
    assert "capacity_per='expert'" in repr(comm)
    # The kernels get it with the other sizes.
    from jax_moe_comm import nvshmem_backend
    assert nvshmem_backend.kernel_sizes(cfg, 4, 0)["expert_capacity"] == 20
    assert nvshmem_backend.kernel_sizes(jmc.MoECommConfig(16, 2, 64, 32), 4, 0)["expert_capacity"] == 0


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sizing", ["explicit", "factor", "default"])
def test_draws_with_per_expert_capacity_agree_with_the_oracle(world, sizing):
    base = differential.Setup(world=world, payload="bfloat16", out_dtype="float32", E=4 * world, K=3, H=64, T=16,
                              align=2, overflow="drop", capacity_per="expert", weights_at="combine")
    setup = {"explicit": dict(capacity=4), "factor": dict(capacity_factor=1.0), "default": {}}[sizing]
    import dataclasses
    setup = dataclasses.replace(base, **setup)
    for routing in ("uniform", "skewed"):
        draw = differential.Draw(setup, differential.Inputs(seed=7 + world, routing=routing, num_tokens="partial"))
        assert differential.run_draw(draw, "reference", ep_mesh(world)) is None, draw.to_json()

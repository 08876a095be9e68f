"""EP over one mesh axis or a tuple of axes of a multi-axis mesh, per EP group against the NumPy oracle.

On a mesh with axes besides the EP axes, every coordinate of those axes is an independent EP group of ``world``
ranks. Each group draws its own random routing and tokens here, and each group's results (layout, combined output,
gradients) must equal the oracle (tests/oracle.py) run on that group's tokens alone: a token exchanged with another
group would show. Both the per-shard API (the user's shard_map over the whole mesh) and the global view are
checked, forward and backward, and the compiled HLO shows that the global view partitions an input sharded over
fewer axes (or replicated) without any collective besides the EP exchange.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import named_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dispatch_combine import assert_bits_equal, assert_combined_close
from test_layers import dense_moe

import jax_moe_comm as jmc
from jax_moe_comm import MoEComm, MoECommConfig
from jax_moe_comm.layers import init_moe_params, moe_layer, moe_layer_shard, param_specs, shard_params

E, K, H, T, ALIGN = 16, 3, 16, 8, 2


@dataclasses.dataclass(frozen=True)
class MeshCase:
    """A mesh (axis sizes and names) and the MoEComm axes on it."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    axis_name: str | tuple[str, ...] = "ep"
    batch_axes: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        mesh = "x".join(f"{n}{s}" for n, s in zip(self.names, self.shape, strict=True))
        ep = self.axis_name if isinstance(self.axis_name, str) else "+".join(self.axis_name)
        return f"{mesh}-EP={ep}" + ("" if self.batch_axes is None else f"-batch={'+'.join(self.batch_axes)}")

    @property
    def mesh(self):
        return named_mesh(self.shape, self.names)


EP8 = MeshCase((8,), ("ep",))
DATA2_EP4 = MeshCase((2, 4), ("data", "ep"))
DATA4_EP2 = MeshCase((4, 2), ("data", "ep"))
COMPOUND = MeshCase((2, 2, 2), ("data", "context", "expert"), ("context", "expert"))  # MaxText's compound EP axis
COMPOUND_REVERSED = MeshCase((2, 2, 2), ("data", "context", "expert"), ("expert", "context"))  # not in mesh order
EP_FIRST = MeshCase((4, 2), ("ep", "data"))  # the EP axis is not the last one
BATCH_SUBSET = MeshCase((2, 2, 2), ("data", "pipe", "ep"), batch_axes=("data",))  # "pipe" holds replicas


@functools.cache
def comm_for(case: MeshCase, dp_size: int = 1, custom_vjp: bool = False) -> MoEComm:
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, dp_size=dp_size, align=ALIGN)
    return MoEComm(cfg, case.mesh, case.axis_name, backend="reference", batch_axes=case.batch_axes,
                   custom_vjp=custom_vjp)


def num_batch(comm: MoEComm) -> int:
    """Batch coordinates of the global view (EP groups that see different tokens)."""
    return comm.num_shards // comm.world


# Inputs, per EP group ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Group:
    """One EP group's inputs, per DP group (the oracle's view): x/ids/weights [num_dp, T, ...], num_tokens
    [num_dp]."""

    x: np.ndarray
    ids: np.ndarray
    num_tokens: np.ndarray
    weights: np.ndarray


def draw_groups(rng, routing, comm: MoEComm, scenario: str = "dropped_slots") -> list[Group]:
    """Fresh random routing, tokens and weights for every batch coordinate of the global view."""
    dp, num_dp = comm.cfg.dp_size, comm.world // comm.cfg.dp_size
    groups = []
    for _ in range(num_batch(comm)):
        r = routing(scenario, world=comm.world, dp_size=dp, num_experts=E, k=K, max_tokens=T)
        x = rng.standard_normal((num_dp, T, H)).astype(np.float32)
        weights = rng.random((num_dp, T, K)).astype(np.float32)
        groups.append(Group(x, r.topk_ids, r.num_tokens, weights))
    return groups


def per_rank(comm: MoEComm, a: np.ndarray) -> np.ndarray:
    """[num_dp, T, ...] of one group -> [world, T, ...]: each DP group's rows on each of its replicas."""
    return np.repeat(a, comm.cfg.dp_size, axis=0)


def global_inputs(comm: MoEComm, groups: list[Group]) -> tuple[np.ndarray, ...]:
    """(x [N*T, H], ids [N*T, K], num_tokens [N], weights [N*T, K]) in the global view's block order: batch
    coordinate g's world blocks, then g + 1's."""
    def stack(field, rows):
        return np.concatenate([per_rank(comm, getattr(g, field)) for g in groups]).reshape((-1,) + rows)
    n = np.concatenate([per_rank(comm, g.num_tokens) for g in groups])
    return stack("x", (H,)), stack("ids", (K,)), n, stack("weights", (K,))


def layouts_of(comm: MoEComm, group: Group, x: np.ndarray | None = None) -> list[oracle.ShardLayout]:
    return oracle.dispatch(group.x if x is None else x, group.ids, group.num_tokens, world=comm.world,
                           dp_size=comm.cfg.dp_size, num_experts=E, align=ALIGN, capacity=comm.capacity)


def blocks(a, comm: MoEComm, g: int) -> np.ndarray:
    """Batch coordinate g's world blocks of a global-view array, [world, rows per block, ...]."""
    a = np.asarray(a)
    a = a.reshape((num_batch(comm), comm.world, -1) + a.shape[1:])
    return a[g]


def _lift(tree):
    """Per-shard scalars -> [1], so shard_map can concatenate them."""
    return jax.tree.map(lambda a: a.reshape(1) if a.ndim == 0 else a, tree)


# Forward ----------------------------------------------------------------------------------------------------
@functools.cache
def round_trip_fn(case: MeshCase, dp_size: int, view: str):
    """jit((x, ids, num_tokens, expert_y, weights) -> (Dispatched, y)) through the per-shard calls in a shard_map
    over the whole mesh ("shard") or the global-view functions ("global")."""
    comm = comm_for(case, dp_size)
    if view == "global":
        def run(x, ids, n, expert_y, w):
            d = jmc.dispatch(comm, x, ids, num_tokens=n)
            return d, jmc.combine(comm, expert_y, d.handle, w)
        return jax.jit(run)

    def per_shard(x, ids, n, expert_y, w):
        d = comm.dispatch(x, ids, num_tokens=n.reshape(()))
        return _lift(d), comm.combine(expert_y, d.handle, w)
    spec = comm.batch_spec
    return jax.jit(jax.shard_map(per_shard, mesh=comm.mesh, in_specs=spec, out_specs=spec))


FORWARD_CASES = [(EP8, 1), (EP8, 2), (DATA2_EP4, 1), (DATA2_EP4, 2), (DATA4_EP2, 1), (DATA4_EP2, 2), (COMPOUND, 1),
                 (COMPOUND, 2), (COMPOUND_REVERSED, 1), (EP_FIRST, 1), (EP_FIRST, 2), (BATCH_SUBSET, 1)]


@pytest.mark.parametrize("view", ["shard", "global"])
@pytest.mark.parametrize(("case", "dp_size"), FORWARD_CASES, ids=[f"{c.id}-dp{dp}" for c, dp in FORWARD_CASES])
def test_each_ep_group_equals_the_oracle_on_its_own_tokens(case, dp_size, view, rng, seed, routing):
    """Dispatch's layout (bit for bit) and combine's output of every EP group equal the oracle of that group."""
    comm = comm_for(case, dp_size)
    groups = draw_groups(rng, routing, comm)
    x, ids, n, w = global_inputs(comm, groups)
    expert_y = rng.standard_normal((comm.num_shards * comm.capacity, H)).astype(np.float32)
    d, y = round_trip_fn(case, dp_size, view)(x, ids, n, expert_y, w)

    assert d.expert_x.shape == (comm.num_shards * comm.capacity, H)
    assert d.group_sizes.shape == (comm.num_shards * comm.num_local_experts,)
    assert d.handle.num_tokens.shape == (comm.num_shards,) and y.shape == (comm.num_shards * T, H)
    for g, group in enumerate(groups):
        layouts = layouts_of(comm, group)
        for rank, want in enumerate(layouts):
            where = f"batch coordinate {g}, EP rank {rank}"
            assert_bits_equal(blocks(d.group_sizes, comm, g)[rank], want.group_sizes, f"{where} group_sizes", seed)
            assert_bits_equal(blocks(d.handle.row_origin, comm, g)[rank], want.row_origin, f"{where} row_origin",
                              seed)
            assert_bits_equal(blocks(d.expert_x, comm, g)[rank], want.expert_x, f"{where} expert_x", seed)
        assert_bits_equal(blocks(d.handle.topk_ids, comm, g).reshape(-1, K),
                          per_rank(comm, group.ids).reshape(-1, K), f"group {g} handle.topk_ids", seed)
        assert_bits_equal(blocks(d.handle.num_tokens, comm, g).reshape(-1), per_rank(comm, group.num_tokens),
                          f"group {g} handle.num_tokens", seed)
        want_y = oracle.combine(blocks(expert_y, comm, g), layouts, group.ids, per_rank(comm, group.weights),
                                group.num_tokens, dp_size=dp_size, num_experts=E, out_dtype=np.float32)
        assert_combined_close(blocks(y, comm, g), want_y, "float32", seed)


# Gradients --------------------------------------------------------------------------------------------------
@functools.cache
def loss_and_grad_fn(case: MeshCase, dp_size: int, custom_vjp: bool, view: str):
    """jit(value_and_grad) of L = sum(y * cotangent), y = combine(ragged_dot(dispatch(x), W)), w.r.t. the
    per-DP-group x [B*num_dp*T, H], weights [B*num_dp*T, K] and the expert weights W [E, H, H]; y comes back as
    the aux. Each DP group's tokens and weights go to all its replicas (so the gradients are the group's)."""
    comm = comm_for(case, dp_size, custom_vjp)
    spec, expert_spec = comm.batch_spec, P(comm.ep_axes)  # expert weights: dim 0 over the EP axes

    def to_replicas(a):  # [B * num_dp * T, ...] -> [N * T, ...]: a rank's block is its DP group's
        a = a.reshape((-1, T) + a.shape[1:])
        return jnp.repeat(a, dp_size, axis=0).reshape((-1,) + a.shape[2:])

    def experts(expert_x, group_sizes, w_local):
        return jax.lax.ragged_dot(expert_x, w_local, group_sizes, precision=jax.lax.Precision.HIGHEST)

    if view == "global":
        experts_everywhere = jax.shard_map(experts, mesh=comm.mesh, in_specs=(spec, spec, expert_spec),
                                           out_specs=spec)

        def forward(x, ids, n, w, expert_w):
            d = jmc.dispatch(comm, x, ids, num_tokens=n)
            return jmc.combine(comm, experts_everywhere(d.expert_x, d.group_sizes, expert_w), d.handle, w)
    else:
        def per_shard(x, ids, n, w, w_local):
            d = comm.dispatch(x, ids, num_tokens=n.reshape(()))
            return comm.combine(experts(d.expert_x, d.group_sizes, w_local), d.handle, w)
        forward = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=(spec, spec, spec, spec, expert_spec),
                                out_specs=spec)

    def loss(x, w, expert_w, ids, n, cotangent):
        y = forward(to_replicas(x), ids, n, to_replicas(w), expert_w)
        return jnp.sum(y * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def oracle_grads(comm: MoEComm, group: Group, expert_w: np.ndarray, cotangent: np.ndarray):
    """y and the gradients of L = sum(y * cotangent) for one EP group, built on the oracle's layout.

    cotangent [world, T, H]. Returns (y [world, T, H], dx [num_dp, T, H], dw [num_dp, T, K], dW [E, H, H]). The
    replicas of a DP group share its tokens and weights, so their cotangents add up; the cotangent rows dispatched
    with the same routing land in the tokens' layout (row for row), each scaled by its slot's weight.
    """
    dp, world, L = comm.cfg.dp_size, comm.world, comm.num_local_experts
    num_dp = world // dp
    layouts = layouts_of(comm, group)
    cot_layouts = layouts_of(comm, group, cotangent.reshape(num_dp, dp, T, H).sum(axis=1))
    expert_y = np.zeros((world, comm.capacity, H), np.float32)
    d_expert_x = np.zeros_like(expert_y)
    dw = np.zeros((num_dp, T, K), np.float32)
    d_expert_w = np.zeros((E, H, H), np.float32)
    for rank in range(world):
        start = 0
        for local, size in enumerate(layouts[rank].group_sizes):
            rows, start, e = slice(start, start + size), start + size, rank * L + local
            origin = layouts[rank].row_origin[rows]
            has = origin >= 0
            o = np.where(has, origin, 0)
            g, t, k = o // (T * K), (o // K) % T, o % K
            x_rows, cot_rows = layouts[rank].expert_x[rows], cot_layouts[rank].expert_x[rows]
            expert_y[rank, rows] = x_rows @ expert_w[e]
            d_rows = np.where(has, group.weights[g, t, k], 0)[:, None] * cot_rows  # d L / d expert_y rows
            d_expert_w[e] += x_rows.T @ d_rows
            d_expert_x[rank, rows] = d_rows @ expert_w[e].T
            dw[g[has], t[has], k[has]] = np.sum(cot_rows * expert_y[rank, rows], axis=1)[has]
    y = oracle.combine(expert_y, layouts, group.ids, per_rank(comm, group.weights), group.num_tokens, dp_size=dp,
                       num_experts=E, out_dtype=np.float32)
    ones = np.ones((world, T, K), np.float32)  # dx[t]: the sum of its live slots' row gradients
    dx = oracle.combine(d_expert_x, layouts, group.ids, ones, group.num_tokens, dp_size=dp, num_experts=E,
                        out_dtype=np.float32)[::dp]
    return y, dx, dw, d_expert_w


def assert_close(actual, expected, what: str, seed: int, rtol: float = 2e-5) -> None:
    expected = np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=rtol * scale,
                               err_msg=f"{what} (seed={seed})")


GRAD_CASES = [(EP8, 1, False), (EP8, 2, True), (DATA2_EP4, 1, True), (DATA2_EP4, 2, False), (DATA2_EP4, 2, True),
              (DATA4_EP2, 1, False), (DATA4_EP2, 1, True), (COMPOUND, 1, False), (COMPOUND, 2, True),
              (COMPOUND_REVERSED, 2, False), (EP_FIRST, 1, True), (EP_FIRST, 2, False)]


@pytest.mark.parametrize("view", ["shard", "global"])
@pytest.mark.parametrize(("case", "dp_size", "custom_vjp"), GRAD_CASES,
                         ids=[f"{c.id}-dp{dp}" + ("-custom_vjp" if v else "") for c, dp, v in GRAD_CASES])
def test_gradients_of_each_ep_group_equal_the_oracle(case, dp_size, custom_vjp, view, rng, seed, routing):
    """jax.grad through dispatch -> ragged_dot experts -> combine: each group's d/dx and d/dweights are the
    oracle's of that group; d/dW (W shared by every group) is the sum of the groups' oracle gradients."""
    comm = comm_for(case, dp_size, custom_vjp)
    groups = draw_groups(rng, routing, comm)
    _, ids, n, _ = global_inputs(comm, groups)
    x = np.concatenate([g.x for g in groups]).reshape(-1, H)
    w = np.concatenate([g.weights for g in groups]).reshape(-1, K)
    expert_w = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    cotangent = rng.standard_normal((comm.num_shards * T, H)).astype(np.float32)

    (_, y), (dx, dw, d_expert_w) = loss_and_grad_fn(case, dp_size, custom_vjp, view)(x, w, expert_w, ids, n,
                                                                                    cotangent)
    num_dp = comm.world // dp_size
    dx, dw = np.asarray(dx).reshape(-1, num_dp, T, H), np.asarray(dw).reshape(-1, num_dp, T, K)
    want_d_expert_w = np.zeros_like(expert_w)
    for g, group in enumerate(groups):
        want_y, want_dx, want_dw, want_group_d_expert_w = oracle_grads(comm, group, expert_w,
                                                                       blocks(cotangent, comm, g))
        assert_close(blocks(y, comm, g), want_y, f"group {g} y", seed)
        assert_close(dx[g], want_dx, f"group {g} d L / d x", seed)
        assert_close(dw[g], want_dw, f"group {g} d L / d topk_weights", seed)
        want_d_expert_w += want_group_d_expert_w
    assert_close(d_expert_w, want_d_expert_w, "d L / d expert weights (summed over the EP groups)", seed)
    assert np.abs(want_d_expert_w).max() > 0 and np.abs(dx).max() > 0, f"nothing was routed (seed={seed})"


# The global view partitions without an extra exchange -------------------------------------------------------
COLLECTIVES = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter")


def collectives_of(fn, *args: jax.ShapeDtypeStruct) -> tuple[collections.Counter, set]:
    """(count of each collective op, the replica groups they name) in the HLO of fn compiled for `args`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(",
                                                             text))
    groups = {tuple(tuple(int(d) for d in group.split(",")) for group in re.findall(r"\{([\d,]+)\}", listed))
              for listed in re.findall(r"replica_groups=\{((?:\{[\d,]+\},?)+)\}", text)}
    return ops, groups


def ep_groups(comm: MoEComm) -> tuple[tuple[int, ...], ...]:
    """The devices (positions in the mesh, = device ids here) of each EP group, each in EP rank order."""
    names = list(comm.mesh.axis_names)
    others = [a for a in names if a not in comm.ep_axes]
    ids = np.arange(comm.mesh.devices.size).reshape(comm.mesh.devices.shape)
    ids = ids.transpose([names.index(a) for a in (*others, *comm.ep_axes)])  # EP axes last, in the order given
    return tuple(tuple(int(d) for d in group) for group in ids.reshape(-1, comm.world))


def round_trip(comm: MoEComm):
    def fn(x, ids, w):
        d = jmc.dispatch(comm, x, ids)
        return jmc.combine(comm, d.expert_x, d.handle, w)
    return fn


def abstract(comm: MoEComm, spec: P, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(comm.mesh, spec))


HLO_CASES = [DATA2_EP4, COMPOUND_REVERSED, EP_FIRST, BATCH_SUBSET]


@pytest.mark.parametrize("case", HLO_CASES, ids=[c.id for c in HLO_CASES])
def test_global_view_slices_inputs_locally_instead_of_exchanging_them(case):
    """The compiled round trip has the same collectives whether the batch comes sharded ``batch_spec``, sharded
    P("data") or replicated: such an input is sliced locally (no reshard), and every collective runs within the EP
    groups. An input sharded over the EP axis alone would have to move, and the count shows that."""
    comm = comm_for(case)
    rows = comm.num_shards * T

    def inputs(spec):  # x, topk_ids, topk_weights
        return (abstract(comm, spec, (rows, H), jnp.float32), abstract(comm, spec, (rows, K), jnp.int32),
                abstract(comm, spec, (rows, K), jnp.float32))
    fn = round_trip(comm)
    want_ops, want_groups = collectives_of(fn, *inputs(comm.batch_spec))
    assert want_ops["all-to-all"] >= 1, want_ops  # the EP exchange itself
    assert want_groups == {ep_groups(comm)}, (want_groups, ep_groups(comm))
    for spec in (P("data"), P()):
        assert collectives_of(fn, *inputs(spec)) == (want_ops, want_groups), spec

    if case == DATA2_EP4:  # the count sees a reshard: rows sharded over "ep" only must move between data rows
        ops, _ = collectives_of(fn, *inputs(P("ep")))
        assert sum(ops.values()) > sum(want_ops.values()), (ops, want_ops)



@pytest.mark.parametrize("case", [DATA2_EP4, COMPOUND_REVERSED], ids=[DATA2_EP4.id, COMPOUND_REVERSED.id])
def test_moe_layer_slices_inputs_locally_instead_of_exchanging_them(case):
    """The same for the layer's forward, its expert weights sharded over the EP axes and the router replicated."""
    comm = comm_for(case)
    params = init_moe_params(jax.random.key(0), hidden=H, ffn=8, num_experts=E)
    abstract_params = jax.tree.map(lambda a, s: abstract(comm, s, a.shape, a.dtype), params,
                                   param_specs(params, comm.ep_axes), is_leaf=lambda leaf: isinstance(leaf, P))
    layer = functools.partial(moe_layer, comm)
    found = [collectives_of(layer, abstract_params, abstract(comm, spec, (comm.num_shards * T, H), jnp.float32))
             for spec in (comm.batch_spec, P("data"), P())]
    assert found[0][0]["all-to-all"] >= 1 and found[0][1] == {ep_groups(comm)}, found[0]
    assert found[1] == found[0] and found[2] == found[0], found


def test_a_mesh_with_explicit_axes_takes_every_batch_sharding():
    """``jax.make_mesh`` gives Explicit axes, where shard_map takes only arrays sharded as its in_specs: the global
    view and the layer reshard a batch sharded P("data") or replicated themselves, with the same collectives and the
    same results as from one sharded ``batch_spec``."""
    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    comm = MoEComm(small_config(dtype=jnp.float32, out_dtype=jnp.float32), mesh, "ep")
    rows = comm.num_shards * comm.cfg.max_tokens
    params = init_moe_params(jax.random.key(0), hidden=comm.cfg.hidden, ffn=8, num_experts=comm.cfg.num_experts)
    specs = param_specs(params, comm.ep_axes)
    placed_params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs,
                                 is_leaf=lambda leaf: isinstance(leaf, P))
    x = np.asarray(jax.random.normal(jax.random.key(1), (rows, comm.cfg.hidden)))
    layer = jax.jit(functools.partial(moe_layer, comm))
    ids = np.argsort(np.random.default_rng(0).random((rows, comm.cfg.num_experts)), 1)[:, :comm.cfg.experts_per_token]
    outs, ops = [], []
    for spec in (comm.batch_spec, P("data"), P()):
        sharded = jax.device_put(x, NamedSharding(mesh, spec))
        outs.append(np.asarray(layer(placed_params, sharded)))
        ops.append(collectives_of(round_trip(comm), abstract(comm, spec, (rows, comm.cfg.hidden), jnp.float32),
                                  abstract(comm, spec, ids.shape, jnp.int32),
                                  abstract(comm, spec, ids.shape, jnp.float32)))
    assert np.array_equal(outs[1], outs[0]) and np.array_equal(outs[2], outs[0])
    assert ops[1] == ops[0] and ops[2] == ops[0], ops
    assert ops[0][0]["all-to-all"] >= 1


# The layer on multi-axis meshes ------------------------------------------------------------------------------
LAYER_CASES = [DATA2_EP4, COMPOUND, EP_FIRST]


@functools.cache
def layer_loss_fn(case: MeshCase, view: str):
    """jit(value_and_grad) of <moe_layer(params, x), cotangent> w.r.t. (params, x), the layer's output as aux."""
    comm = comm_for(case)
    if view == "global":
        apply = functools.partial(moe_layer, comm)
    else:  # the user's own shard_map over the whole mesh around the per-shard layer
        def apply(params, x):
            mapped = jax.shard_map(functools.partial(moe_layer_shard, comm), mesh=comm.mesh,
                                   in_specs=(param_specs(params, comm.ep_axes), comm.batch_spec),
                                   out_specs=comm.batch_spec)
            return mapped(params, x)

    def loss(params, x, cotangent):
        y = apply(params, x)
        return jnp.sum(y * cotangent), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def dense_loss(params, x, cotangent):
    y = dense_moe(params, x, K)
    return jnp.sum(y * cotangent), y


@pytest.mark.parametrize("view", ["shard", "global"])
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c.id for c in LAYER_CASES])
def test_moe_layer_on_a_multi_axis_mesh_equals_dense(case, view, rng, seed):
    """moe_layer (global view) and moe_layer_shard (in the user's shard_map over the whole mesh) equal the dense
    single-device layer, forward and gradients (the expert weights' gradient sums every EP group's)."""
    comm = comm_for(case)
    params = init_moe_params(jax.random.key(int(rng.integers(2**31))), hidden=H, ffn=24, num_experts=E,
                             shared_ffn=8)
    x = rng.standard_normal((comm.num_shards * T, H)).astype(np.float32)
    cotangent = rng.standard_normal(x.shape).astype(np.float32)
    placed = shard_params(comm, params)
    assert placed["gate"].sharding.spec == param_specs(params, comm.ep_axes)["gate"]
    (_, y), (d_params, dx) = layer_loss_fn(case, view)(placed, x, cotangent)
    (_, want_y), (want_d_params, want_dx) = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1),
                                                                       has_aux=True))(params, x, cotangent)
    assert_close(y, want_y, "y", seed)
    assert_close(dx, want_dx, "d x", seed)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(d_params)[0], jax.tree.leaves(want_d_params),
                                 strict=True):
        assert_close(got, want, f"d params{jax.tree_util.keystr(path)}", seed)


def test_training_step_on_a_data_and_ep_mesh(rng, seed):
    """A train step of the global-view layer on a ("data", "ep") mesh, the batch sharded over both axes: its
    gradient equals the dense single-device one, and a few SGD steps lower the loss."""
    comm = comm_for(DATA2_EP4)
    x_sharding = NamedSharding(comm.mesh, comm.batch_spec)
    teacher = init_moe_params(jax.random.key(int(rng.integers(2**31))), hidden=H, ffn=24, num_experts=E)
    student = init_moe_params(jax.random.key(int(rng.integers(2**31))), hidden=H, ffn=24, num_experts=E)
    x = jax.device_put(rng.standard_normal((comm.num_shards * T, H)).astype(np.float32), x_sharding)
    target = jax.device_put(np.asarray(dense_moe(teacher, x, K)), x_sharding)

    def loss_fn(params, x, target):
        return jnp.mean(jnp.square(moe_layer(comm, params, x) - target))

    def dense_loss_fn(params, x, target):
        return jnp.mean(jnp.square(dense_moe(params, x, K) - target))

    @jax.jit
    def train_step(params, x, target, lr=0.5):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

    params = shard_params(comm, student)
    _, _, grads = train_step(params, x, target)
    want = jax.jit(jax.grad(dense_loss_fn))(student, np.asarray(x), np.asarray(target))
    for (path, got), ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want), strict=True):
        assert_close(got, ref, f"d loss / d params{jax.tree_util.keystr(path)}", seed, rtol=1e-4)
    assert grads["gate"].sharding.spec == P("ep")  # each device keeps the gradient of its own experts

    losses = []
    for _ in range(16):
        params, loss, _ = train_step(params, x, target)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], f"{losses} (seed={seed})"


# Arguments --------------------------------------------------------------------------------------------------
def small_config(**fields) -> MoECommConfig:
    return MoECommConfig(**({"num_experts": 8, "experts_per_token": 2, "hidden": 16, "max_tokens": 4} | fields))


def test_axes_properties_and_repr():
    mesh = COMPOUND.mesh
    comm = MoEComm(small_config(), mesh, ("context", "expert"), backend="reference")
    assert comm.ep_axes == ("context", "expert") and comm.axis_name == ("context", "expert")
    assert comm.world == 4 and comm.batch_axes == ("data",) and comm.num_shards == 8
    assert comm.batch_spec == P(("data", "context", "expert"))
    assert "ep_axes=('context', 'expert')" in repr(comm) and "batch_axes=('data',)" in repr(comm)

    one_axis = MoEComm(small_config(), EP_FIRST.mesh, "ep", backend="reference")
    assert one_axis.axis_name == "ep" and one_axis.ep_axes == ("ep",) and one_axis.world == 4
    assert one_axis.batch_spec == P(("data", "ep"))  # batch axes first, whatever the mesh order
    assert MoEComm(small_config(), EP8.mesh, backend="reference").batch_spec == P("ep")

    replicated = MoEComm(small_config(), mesh, ["context", "expert"], backend="reference", batch_axes=())
    assert replicated.ep_axes == ("context", "expert") and replicated.num_shards == 4
    assert replicated.batch_spec == P(("context", "expert")) and "batch_axes=()" in repr(replicated)
    subset = MoEComm(small_config(), BATCH_SUBSET.mesh, "ep", backend="reference", batch_axes="data")
    assert subset.batch_axes == ("data",) and subset.num_shards == 4

    fp8 = small_config(dtype=jnp.float8_e4m3fn, scale_block=8)
    with_grads = MoEComm(fp8, mesh, ("context", "expert"), backend="reference", grad_dtype=jnp.bfloat16)
    assert with_grads._phases.grad.geo.axis_name == ("context", "expert")  # the backward's round trips


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"axis_name": ("context", "tp")},
     r"^axis_name \('context', 'tp'\) names 'tp', which is not an axis of the mesh \('data', 'context', 'expert'\)"),
    ({"axis_name": "tp"}, r"^axis_name 'tp' is not an axis of the mesh \('data', 'context', 'expert'\)"),
    ({"axis_name": ("expert", "expert")}, r"^axis_name \('expert', 'expert'\) names mesh axis 'expert' twice"),
    ({"axis_name": ()}, r"^axis_name must name at least one mesh axis"),
    ({"axis_name": ("context", 3)}, r"^axis_name must be a mesh axis name or a tuple of them, got \('context', 3\)"),
    ({"axis_name": None}, r"^axis_name must be a mesh axis name or a tuple of them, got None"),
    ({"axis_name": "expert", "batch_axes": ("data", "pipe")},
     r"^batch_axes \('data', 'pipe'\) names 'pipe', which is not an axis of the mesh"),
    ({"axis_name": ("context", "expert"), "batch_axes": ("data", "expert")},
     r"^batch_axes \('data', 'expert'\) must not name an EP axis \(axis_name \('context', 'expert'\)\): 'expert'"),
    ({"axis_name": "expert", "batch_axes": ("data", "data")}, r"^batch_axes \('data', 'data'\) names mesh axis "
                                                               r"'data' twice"),
    ({"axis_name": "expert", "batch_axes": 0}, r"^batch_axes must be a mesh axis name or a tuple of them, got 0"),
])
def test_axes_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEComm(small_config(), COMPOUND.mesh, backend="reference", **kwargs)


def test_world_errors_name_the_compound_axis():
    with pytest.raises(ValueError, match=r"^num_experts \(6\) must be a multiple of the size of mesh axes "
                                         r"\('context', 'expert'\) \(4\)"):
        MoEComm(small_config(num_experts=6), COMPOUND.mesh, ("context", "expert"), backend="reference")
    with pytest.raises(ValueError, match=r"^dp_size \(3\) must divide the size of mesh axes \('context', 'expert'\) "
                                         r"\(4\)"):
        MoEComm(small_config(dp_size=3), COMPOUND.mesh, ("context", "expert"), backend="reference")


def test_global_view_shapes_are_checked_against_num_shards():
    comm = MoEComm(small_config(dtype=jnp.float32), DATA2_EP4.mesh, backend="reference")
    x, ids = jnp.zeros((8 * 4, 16), jnp.float32), jnp.full((8 * 4, 2), -1, jnp.int32)
    with pytest.raises(ValueError, match=r"^num_tokens must have shape \(8,\) = \(num_shards,\) \(one count per "
                                         r"rank\), got shape \(4,\)"):
        jmc.dispatch(comm, x, ids, num_tokens=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"^x must have num_shards \* max_tokens = 8 \* 4 rows \(one block per rank, "
                                         r"sharded P\(\('data', 'ep'\),\); batch_axes=\(\) replicates"):
        jmc.dispatch(comm, x[:16], ids[:16])  # world * max_tokens rows: a batch for one data row only
    handle = jax.eval_shape(lambda: jmc.dispatch(comm, x, ids)).handle
    with pytest.raises(ValueError, match=r"^expert_y must have num_shards \* capacity = 8 \* 32 rows"):
        jmc.combine(comm, jnp.zeros((comm.world * comm.capacity, 16), jnp.float32), handle,
                    jnp.ones((8 * 4, 2), jnp.float32))
    params = init_moe_params(jax.random.key(0), hidden=16, ffn=8, num_experts=8)
    with pytest.raises(ValueError, match=r"^x must have shape \(32, 16\) = \(num_shards \* max_tokens, hidden\)"):
        moe_layer(comm, params, x[:16])


@pytest.mark.parametrize("backend", ["reference", "nvshmem stand-in"])
def test_the_global_views_results_hold_no_zero_sized_array(backend):
    """Named regression: the handle's grad_link was float32 [0]. Passed from the global dispatch's shard_map to the
    global combine's, a zero-sized array made XLA:GPU's Shardy partitioner crash (SIGSEGV while compiling) whenever
    several processes shared one GPU, so every global-view program failed to compile there."""
    from conftest import nvshmem_stand_in

    comm = MoEComm(small_config(dtype=jnp.float32), DATA2_EP4.mesh, backend="reference", custom_vjp=True)
    comm = nvshmem_stand_in(comm) if backend == "nvshmem stand-in" else comm
    x, ids = jnp.zeros((8 * 4, 16), jnp.float32), jnp.full((8 * 4, 2), -1, jnp.int32)
    d = jax.eval_shape(lambda: jmc.dispatch(comm, x, ids))
    empty = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(d) if leaf.size == 0]
    assert empty == [], f"zero-sized results of the global dispatch: {empty}"

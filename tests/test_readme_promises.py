"""Independent checks of what README.md promises, on the reference backend (8 virtual CPU devices).

Every expectation here is computed from the README's words (a NumPy model written for this file), never copied
from the library's output. Each test's docstring quotes or paraphrases the sentence it checks.
"""

from __future__ import annotations

import inspect
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh, named_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc

F32 = jnp.float32


# Helpers ----------------------------------------------------------------------------------------------------
def make_comm(*, world=4, E=8, K=2, H=4, T=3, align=1, dp=1, mesh=None, axis="ep", cfg_kw=None, **opts):
    cfg = jmc.MoECommConfig(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T, dtype=F32, out_dtype=F32,
                            dp_size=dp, align=align, **(cfg_kw or {}))
    return jmc.MoEComm(cfg, mesh if mesh is not None else ep_mesh(world), axis, backend="reference", **opts)


def distinct_ids(rng, shape, num_experts, k, pool=None):
    """[*shape, k] int32 ids, each token's k ids distinct (drawn from `pool`, default all experts)."""
    pool = np.arange(num_experts) if pool is None else np.asarray(pool)
    ids = np.empty(tuple(shape) + (k,), np.int32)
    for index in np.ndindex(*shape):
        ids[index] = rng.choice(pool, size=k, replace=False)
    return ids


def random_problem(rng, *, world, E, K, H, T, dp=1, unused=0.0, partial=True):
    """Per-group x [G, T, H], ids [G, T, K], weights [G, T, K], num_tokens [G] (groups' replicas share them)."""
    G = world // dp
    x = rng.standard_normal((G, T, H)).astype(np.float32)
    ids = distinct_ids(rng, (G, T), E, K)
    if unused:
        ids[rng.random(ids.shape) < unused] = -1
    weights = rng.random((G, T, K)).astype(np.float32)
    if partial:
        nt = rng.integers(0, T + 1, size=G).astype(np.int32)
        nt[0] = T  # at least one full group
    else:
        nt = np.full(G, T, np.int32)
    return x, ids, weights, nt


def per_rank(a, dp):
    """Per-group array [G, ...] -> per-rank rows (every group repeated over its dp replicas), flattened over T."""
    a = np.repeat(a, dp, axis=0)
    return a.reshape((-1,) + a.shape[2:]) if a.ndim >= 2 else a


def expected_layout(x, ids, nt, *, world, E, align, capacity=None):
    """The receive layout of every rank, from "The receive layout" section of the README.

    Rank r holds its L = E / world local experts, expert 0 first; inside an expert rows are ordered by (source
    group, source token); each expert's run is padded with zero rows to a multiple of `align`; group_sizes count
    with the padding; row_origin[p] = (group * max_tokens + token) * K + slot, -1 for none. Returns per rank
    (rows [n, H], origins [n], group_sizes [L]) before any truncation to capacity.
    """
    G, T, K = ids.shape
    L = E // world
    out = []
    for r in range(world):
        rows, origins, sizes = [], [], []
        for l_ in range(L):
            e = r * L + l_
            n = 0
            for g in range(G):
                for t in range(int(nt[g])):
                    for k in range(K):
                        if ids[g, t, k] == e:
                            rows.append(x[g, t])
                            origins.append((g * T + t) * K + k)
                            n += 1
            pad = -n % align
            rows += [np.zeros(x.shape[-1], x.dtype)] * pad
            origins += [-1] * pad
            sizes.append(n + pad)
        rows = np.array(rows, x.dtype).reshape(-1, x.shape[-1])
        out.append((rows, np.array(origins, np.int64), np.array(sizes, np.int64)))
    return out


def expected_combine(expert_y, layout, ids, weights, nt, *, dp):
    """y[t] = sum_k w[t, k] * expert_y[row of (t, k)] for t < num_tokens, zero after; a -1 slot adds nothing.

    expert_y [world, capacity, H], layout from expected_layout (rows past capacity add nothing), ids / nt per group,
    weights per rank [world, T, K]. Returns [world, T, H] float64.
    """
    world = expert_y.shape[0]
    G, T, K = ids.shape
    capacity = expert_y.shape[1]
    where = {}
    for r, (_, origins, _) in enumerate(layout):
        for p, o in enumerate(origins):
            if o >= 0 and p < capacity:
                where[int(o)] = (r, p)
    y = np.zeros((world, T, expert_y.shape[2]))
    for r in range(world):
        g = r // dp
        for t in range(int(nt[g])):
            for k in range(K):
                if ids[g, t, k] < 0:
                    continue
                found = where.get((g * T + t) * K + k)
                if found is not None:
                    y[r, t] += float(weights[r, t, k]) * expert_y[found].astype(np.float64)
    return y


def run_shards(comm, fn, *args):
    """Runs fn per shard under jit(shard_map) on comm's 1-D mesh; every output gets a leading per-rank axis."""
    axis = comm.axis_name

    def body(*a):
        return jax.tree.map(lambda v: v[None], fn(*a))

    spec = P(axis)
    return jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=spec, out_specs=spec))(*args)


def dispatch_outputs(comm, x, ids, nt, weights, expert_y):
    """Per rank: expert_x, group_sizes, row_origin, expert_counts, dropped_rows and the combine of expert_y."""

    def fn(x, ids, nt, w, ey):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        y = comm.combine(ey[0], d.handle, w)
        return d.expert_x, d.group_sizes, d.handle.row_origin, d.expert_counts, d.dropped_rows, y

    out = run_shards(comm, fn, x, ids, nt, weights, expert_y)
    return [np.asarray(o) for o in out]


def check_layout(comm, got_x, got_sizes, got_origin, layout):
    cap = comm.capacity
    for r, (rows, origins, sizes) in enumerate(layout):
        assert rows.shape[0] <= cap, "the default capacity must hold the worst case"
        np.testing.assert_array_equal(got_sizes[r], sizes, err_msg=f"group_sizes of rank {r}")
        n = rows.shape[0]
        np.testing.assert_array_equal(got_origin[r, :n], origins, err_msg=f"row_origin of rank {r}")
        np.testing.assert_array_equal(got_x[r, :n], rows, err_msg=f"expert_x of rank {r}")
        # rows past sum(group_sizes) hold no token
        assert (got_origin[r, n:] == -1).all(), f"rank {r}: a row past sum(group_sizes) names a token"


# The receive layout -----------------------------------------------------------------------------------------
LAYOUT_CONFIGS = [  # world, dp, E, K, H, T, align
    (4, 1, 8, 2, 4, 3, 1),
    (4, 1, 8, 2, 4, 5, 4),
    (8, 2, 16, 3, 4, 4, 2),
    (2, 1, 6, 3, 8, 5, 3),
]


@pytest.mark.parametrize("world,dp,E,K,H,T,align", LAYOUT_CONFIGS)
def test_receive_layout_order_padding_and_row_origin(rng, world, dp, E, K, H, T, align):
    """README: expert_x holds the local experts, expert 0 first, rows ordered by (source DP group, source token),
    each run padded with zero rows to a multiple of `align`, group_sizes count the padding, rows past
    sum(group_sizes) hold no token, row_origin[p] = (group * max_tokens + token) * K + slot (-1: none)."""
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=align, dp=dp)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, dp=dp, unused=0.2)
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)
    got = dispatch_outputs(comm, per_rank(x, dp), per_rank(ids, dp), np.repeat(nt, dp), per_rank(w, dp), ey)
    layout = expected_layout(x, ids, nt, world=world, E=E, align=align)
    check_layout(comm, got[0], got[1], got[2], layout)
    # padding rows are zero rows
    for r, (rows, origins, _) in enumerate(layout):
        assert not got[0][r, : rows.shape[0]][origins < 0].any()


def test_receive_layout_feeds_ragged_dot(rng):
    """README: `(expert_x, group_sizes)` feeds `jax.lax.ragged_dot` directly (each local expert's rows meet its
    weights)."""
    world, E, K, H, T, align = 4, 8, 2, 4, 4, 2
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=align)
    x, ids, wts, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T)
    W = rng.standard_normal((E, H, H)).astype(np.float32)

    def fn(x, ids, nt, Wl):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return jax.lax.ragged_dot(d.expert_x, Wl, d.group_sizes), d.handle.row_origin

    out, origin = run_shards(comm, fn, per_rank(x, 1), per_rank(ids, 1), nt, W)
    out, origin = np.asarray(out), np.asarray(origin)
    L = E // world
    for r in range(world):
        for p, o in enumerate(origin[r]):
            if o < 0:
                continue
            g, rem = divmod(int(o), T * K)
            t, k = divmod(rem, K)
            e = ids[g, t, k]
            assert e // L == r
            np.testing.assert_allclose(out[r, p], x[g, t] @ W[e], rtol=1e-5, atol=1e-5)


def test_layout_depends_on_routing_alone(rng):
    """README: "The layout depends on the routing alone": other payloads, same group_sizes and row_origin."""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T)
    ey = np.zeros((world, comm.capacity, H), np.float32)
    a = dispatch_outputs(comm, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    b = dispatch_outputs(comm, per_rank(x * 3 - 1, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])


def test_capacity_defaults_to_worst_case(rng):
    """README: "`capacity` defaults to the worst case": every token of every group sends all K rows to one rank's
    experts, nothing is dropped and the layout is the README's."""
    world, E, K, H, T, align = 4, 8, 2, 4, 3, 2
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=align)
    L = E // world
    x = rng.standard_normal((world, T, H)).astype(np.float32)
    ids = distinct_ids(rng, (world, T), E, K, pool=np.arange(L))  # all rows to rank 0
    nt = np.full(world, T, np.int32)
    w = rng.random((world, T, K)).astype(np.float32)
    worst = world * T * min(K, L)  # rows, before padding
    assert comm.capacity >= worst
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)
    got = dispatch_outputs(comm, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    layout = expected_layout(x, ids, nt, world=world, E=E, align=align)
    check_layout(comm, got[0], got[1], got[2], layout)
    assert not np.isnan(got[5]).any()
    np.testing.assert_array_equal(got[4].reshape(world), 0)
    expected = expected_combine(ey, layout, ids, per_rank(w, 1).reshape(world, T, K), nt, dp=1)
    np.testing.assert_allclose(got[5], expected, rtol=1e-5, atol=1e-5)


def exact_worst_case(G, T, K, L, align):
    """The most rows a rank can need: each local expert at most G*T rows (ids are distinct per token), the rank at
    most G*T*min(K, L), each run padded to a multiple of align (brute force over the L counts)."""
    return max(sum(-(-c // align) * align for c in counts)
               for counts in itertools.product(range(G * T + 1), repeat=L) if sum(counts) <= G * T * min(K, L))


CAPACITY_CONFIGS = [  # world, dp, E, K, T, align
    (4, 1, 8, 2, 3, 1), (8, 2, 16, 2, 3, 1), (4, 2, 8, 2, 2, 1), (2, 1, 4, 2, 2, 3), (4, 1, 8, 3, 2, 1),
    (4, 1, 8, 2, 3, 2), (8, 2, 16, 3, 2, 4), (4, 1, 8, 1, 3, 4),
]


@pytest.mark.parametrize("world,dp,E,K,T,align", CAPACITY_CONFIGS)
def test_default_capacity_holds_the_worst_case(world, dp, E, K, T, align):
    """README: "`capacity` defaults to a size every routing fits": never fewer rows than a rank can receive (G
    groups, not world ranks, send: replicas share the sending), and not sized by world ranks when dp_size > 1."""
    G, L = world // dp, E // world
    comm = make_comm(world=world, E=E, K=K, T=T, align=align, dp=dp)
    worst = exact_worst_case(G, T, K, L, align)
    assert comm.capacity >= worst
    assert comm.capacity < worst + L * align + align, "capacity far above the worst case"


@pytest.mark.parametrize("world,dp", [(4, 1), (8, 2)])
def test_expert_counts_is_every_experts_load(rng, world, dp):
    """README: "`d.expert_counts` `[E]` is every expert's load" (rows each expert receives, no padding; a DP
    group's replicas share the sending, so its tokens count once)."""
    E, K, H, T = 2 * world, 3, 4, 5
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=4, dp=dp)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, dp=dp, unused=0.2)
    ey = np.zeros((world, comm.capacity, H), np.float32)
    got = dispatch_outputs(comm, per_rank(x, dp), per_rank(ids, dp), np.repeat(nt, dp), per_rank(w, dp), ey)
    load = np.zeros(E, np.int64)
    for g in range(world // dp):
        for t in range(nt[g]):
            for e in ids[g, t]:
                if e >= 0:
                    load[e] += 1
    assert got[3].shape == (world, E)
    for r in range(world):
        np.testing.assert_array_equal(got[3][r], load)


# Combine ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,dp,E,K,H,T,align", LAYOUT_CONFIGS[:3])
def test_combine_is_weighted_sum_of_expert_rows(rng, world, dp, E, K, H, T, align):
    """README (Use): combine(y, handle, topk_weights) gives y[t] = sum_k topk_weights[t, k] * y[row of (t, k)];
    padding rows and rows past sum(group_sizes) contribute nothing."""
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=align, dp=dp)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, dp=dp, unused=0.15)
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)  # garbage in padding rows too
    got = dispatch_outputs(comm, per_rank(x, dp), per_rank(ids, dp), np.repeat(nt, dp), per_rank(w, dp), ey)
    layout = expected_layout(x, ids, nt, world=world, E=E, align=align)
    w_rank = per_rank(w, dp).reshape(world, T, K)
    expected = expected_combine(ey, layout, ids, w_rank, nt, dp=dp)
    np.testing.assert_allclose(got[5].reshape(world, T, H), expected, rtol=1e-5, atol=1e-6)


def test_round_trip_identity_experts(rng):
    """README (Use/demo): dispatch, identity experts, combine: y[t] = (sum of t's weights over used slots) * x[t]."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.25)

    def fn(x, ids, nt, w):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return comm.combine(d.expert_x, d.handle, w)

    y = np.asarray(run_shards(comm, fn, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1)))
    scale = np.where(ids >= 0, w, 0).sum(-1, keepdims=True)
    expected = scale * x
    expected[np.arange(T)[None, :] >= nt[:, None]] = 0
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


# num_tokens / -1 ----------------------------------------------------------------------------------------------
def test_num_tokens_rows_past_it_give_zeros(rng):
    """README: "`num_tokens`: a traced int32 per shard; rows past it give zeros" (and its tokens are not sent)."""
    world, E, K, H, T = 4, 8, 2, 4, 5
    comm = make_comm(world=world, E=E, K=K, H=H, T=T)
    x, ids, w, _ = random_problem(rng, world=world, E=E, K=K, H=H, T=T, partial=False)
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)

    def fn(x, ids, nt, w, ey):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return comm.combine(ey[0], d.handle, w), d.handle.row_origin

    compiled = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda v: v[None], fn(*a)), mesh=comm.mesh,
                                     in_specs=P("ep"), out_specs=P("ep")))
    for nt in (np.array([0, 1, 4, 5], np.int32), np.array([2, 0, 5, 3], np.int32)):
        garbage = ids.copy()  # rows past num_tokens are no tokens: their ids (even invalid ones) must not matter
        for g in range(world):
            garbage[g, nt[g]:, :] = [E + 5, -7] if g % 2 else [1, 1]
        y, origin = compiled(per_rank(x, 1), per_rank(garbage, 1), nt, per_rank(w, 1), ey)
        assert not np.isnan(y).any()
        y, origin = np.asarray(y), np.asarray(origin)
        for g in range(world):
            assert not y[g, nt[g]:].any(), f"rows past num_tokens={nt[g]} of rank {g} are not zero"
        sent = origin[origin >= 0]
        g_of, t_of = (sent // K) // T, (sent // K) % T
        assert (t_of < nt[g_of]).all(), "a token past num_tokens was dispatched"
        layout = expected_layout(x, ids, nt, world=world, E=E, align=1)
        expected = expected_combine(ey, layout, ids, w, nt, dp=1)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_minus_one_is_an_unused_slot(rng):
    """README: "An id of `-1` is an unused slot": it sends no row and adds nothing; a token of only -1 gives 0."""
    world, E, K, H, T = 4, 8, 3, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, partial=False)
    ids[:, 0, :] = -1          # token 0 of every group: no slot used
    ids[:, 1, 0] = -1          # token 1: its first slot unused
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)
    got = dispatch_outputs(comm, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    origin = got[2]
    used = origin[origin >= 0]
    assert not np.isin(used, [(g * T + 0) * K + k for g in range(world) for k in range(K)]).any()
    assert not np.isin(used, [(g * T + 1) * K + 0 for g in range(world)]).any()
    assert not got[5][:, 0].any(), "a token with only -1 slots must combine to zero"
    layout = expected_layout(x, ids, nt, world=world, E=E, align=1)
    check_layout(comm, got[0], got[1], got[2], layout)
    np.testing.assert_allclose(got[5], expected_combine(ey, layout, ids, w, nt, dp=1), rtol=1e-5, atol=1e-6)


# Options ----------------------------------------------------------------------------------------------------
README_DEFAULTS = {
    "backend": "auto", "custom_vjp": None, "grad_dtype": None, "check_errors": True, "timeout_s": 30.0,
    "prereduce_min_tokens": 64, "ids_first_min_tokens": 1024, "low_latency_max_tokens": 0, "staged": False,
    "max_symmetric_bytes": None, "max_sms": None, "send_stream": None, "batch_axes": None,
    "expert_weights": False,
}
RESOLVED = {"backend", "custom_vjp", "batch_axes"}  # documented as resolved choices ("auto", None: ...)


def test_options_defaults_match_readme_table():
    """README (Options): every behaviour choice is a keyword argument of `MoEComm` with the table's default."""
    params = inspect.signature(jmc.MoEComm).parameters
    for name, default in README_DEFAULTS.items():
        assert name in params, f"{name} is not an argument of MoEComm"
        assert params[name].default == default and type(params[name].default) is type(default), (
            f"{name}: signature default {params[name].default!r}, README {default!r}")


def test_options_shown_in_repr():
    """README (Options): "Every behaviour choice is a keyword argument of `MoEComm`, shown in its `repr`"."""
    cfg = jmc.MoECommConfig(num_experts=8, experts_per_token=2, hidden=4, max_tokens=3, dtype=F32, out_dtype=F32)
    text = repr(jmc.MoEComm(cfg, ep_mesh(4), "ep"))
    for name, default in README_DEFAULTS.items():
        assert f"{name}=" in text, f"{name} missing from repr: {text}"
        if name not in RESOLVED:
            assert f"{name}={default!r}" in text, f"{name}: repr {text}"
    assert "backend='reference'" in text  # "auto" on CPU: "nvshmem if initialized", else reference
    changed = dict(check_errors="sync", timeout_s=5.0, prereduce_min_tokens=2, ids_first_min_tokens=3,
                   low_latency_max_tokens=7, staged=True, max_sms=4, send_stream="own", custom_vjp=True)
    text = repr(jmc.MoEComm(cfg, ep_mesh(4), "ep", backend="reference", **changed))
    for name, value in changed.items():
        assert f"{name}={value!r}" in text, f"{name}={value!r} not shown in repr: {text}"


OPTION_VARIANTS = [
    dict(backend="auto"),
    dict(custom_vjp=True),
    dict(check_errors=False),
    dict(check_errors="sync"),
    dict(timeout_s=1.0),
    dict(prereduce_min_tokens=1),
    dict(ids_first_min_tokens=1),
    dict(low_latency_max_tokens=4096),
    dict(staged=True),
    dict(max_sms=1),
    dict(send_stream="xla_async"),
    dict(send_stream="own"),
    dict(max_symmetric_bytes=4096),
]
OPTION_COMBOS = [  # several non-defaults at once (float32, tight tolerance)
    dict(backend="auto", custom_vjp=True, check_errors="sync", timeout_s=1.0),
    dict(prereduce_min_tokens=1, ids_first_min_tokens=1, low_latency_max_tokens=4096, staged=True, max_sms=2,
         max_symmetric_bytes=4096, check_errors=False),
]


def test_options_do_not_change_results(rng):
    """README (Options): "None changes the results beyond the output dtype's rounding" (reference backend, float32,
    several options at once: layout and counts bit for bit, combine to float32 rounding)."""
    world, E, K, H, T, align = 4, 8, 2, 4, 4, 2
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)
    base_comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=align)
    ey = rng.standard_normal((world, base_comm.capacity, H)).astype(np.float32)
    args = (per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    base = dispatch_outputs(base_comm, *args)
    for opts in OPTION_COMBOS:
        cfg = base_comm.cfg
        comm = jmc.MoEComm(cfg, ep_mesh(world), "ep", **({"backend": "reference"} | opts))
        assert comm.capacity == base_comm.capacity, opts
        got = dispatch_outputs(comm, *args)
        for name, a, b in zip(("expert_x", "group_sizes", "row_origin", "expert_counts", "dropped_rows"),
                              got[:5], base[:5], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} differs with {opts}")
        np.testing.assert_allclose(got[5], base[5], rtol=2 * np.finfo(np.float32).eps * K, atol=1e-6,
                                   err_msg=f"combine differs with {opts}")


# Capacity and overflow ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_capacity_factor_sizes_by_average_load(factor):
    """README: "`capacity_factor=1.25` sizes `expert_x` by the average load" (memory table: 1.25 x G*T*K/world
    rows); never above the worst-case default."""
    world, E, K, T = 4, 8, 2, 16
    comm = make_comm(world=world, E=E, K=K, T=T, cfg_kw=dict(capacity_factor=factor))
    worst = make_comm(world=world, E=E, K=K, T=T).capacity
    average = world * T * K / world
    assert math.ceil(factor * average) <= comm.capacity <= max(worst, math.ceil(factor * average))
    assert comm.capacity <= math.ceil(factor * average) + 16, "capacity far above capacity_factor x average load"


def test_overflow_drop_drops_rows_past_capacity(rng):
    """README: `overflow="drop"` drops rows past `capacity` (their slots add zero; `d.dropped_rows` counts
    them), no failure."""
    world, E, K, H, T, cap = 4, 8, 2, 4, 6, 5
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, cfg_kw=dict(capacity=cap, overflow="drop"))
    assert comm.capacity == cap
    x = rng.standard_normal((world, T, H)).astype(np.float32)
    ids = distinct_ids(rng, (world, T), E, K, pool=np.arange(1, E))
    ids[..., 0] = 0  # everybody also picks expert 0 (hot), slot 0
    nt = np.full(world, T, np.int32)
    w = rng.random((world, T, K)).astype(np.float32)
    ey = rng.standard_normal((world, cap, H)).astype(np.float32)
    got = dispatch_outputs(comm, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)
    layout = expected_layout(x, ids, nt, world=world, E=E, align=1)
    assert layout[0][0].shape[0] > cap  # the test does overflow
    for r, (rows, origins, _) in enumerate(layout):
        kept = min(rows.shape[0], cap)
        np.testing.assert_array_equal(got[2][r, :kept], origins[:kept])
        np.testing.assert_array_equal(got[0][r, :kept], rows[:kept])
        assert int(got[4][r]) == int((origins[cap:] >= 0).sum()), f"dropped_rows of rank {r}"
        assert int(got[1][r].sum()) <= cap
    assert not np.isnan(got[5]).any()
    expected = expected_combine(ey, layout, ids, w, nt, dp=1)  # rows past capacity add nothing
    np.testing.assert_allclose(got[5], expected, rtol=1e-5, atol=1e-6)


def test_overflow_error_gives_nan_and_next_round_trip_is_fine(rng):
    """README (Errors): more rows than `capacity` is a routing error: every rank finishes with NaN output (with
    check_errors=False the error stays in handle.status); the next round trip is fine."""
    world, E, K, H, T, cap = 4, 8, 2, 4, 6, 5
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, cfg_kw=dict(capacity=cap), check_errors=False)
    x = rng.standard_normal((world, T, H)).astype(np.float32)
    bad = distinct_ids(rng, (world, T), E, K, pool=np.arange(1, E))
    bad[..., 0] = 0
    good = np.zeros_like(bad) - 1
    good[:, 0] = distinct_ids(rng, (world,), E, K)  # one token per group: fits in 5 rows per rank
    nt = np.full(world, T, np.int32)
    w = rng.random((world, T, K)).astype(np.float32)

    def fn(x, ids, nt, w):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return comm.combine(d.expert_x, d.handle, w), d.handle.status

    y, status = run_shards(comm, fn, per_rank(x, 1), per_rank(bad, 1), nt, per_rank(w, 1))
    assert np.isnan(np.asarray(y)).any(axis=(1, 2)).all(), "every rank must finish with NaN output"
    assert np.asarray(status).any(), "the error must stay in handle.status"
    y, status = run_shards(comm, fn, per_rank(x, 1), per_rank(good, 1), nt, per_rank(w, 1))
    assert not np.isnan(np.asarray(y)).any()
    scale = np.where(good >= 0, w, 0).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(y), scale * x, rtol=1e-6, atol=1e-6)


def test_routing_error_raised_where_outputs_are_read(rng):
    """README (Errors): check_errors=True on the reference backend raises jax.errors.JaxRuntimeError when the failed
    step's outputs are read, its text naming the bad id and token (e.g. "expert id 99 of token 3 is outside
    [-1, num_experts)")."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = distinct_ids(rng, (world * T,), E, K)
    ids[3, 1] = 99  # rank 0, token 3
    w = rng.random((world * T, K)).astype(np.float32)

    def fn(x, ids, w):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x, d.handle, w)

    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        np.asarray(run_shards(comm, fn, x, ids, w))
    text = str(info.value)
    assert "jax_moe_comm" in text and "expert id 99 of token 3" in text and "outside [-1, " in text, text


# Weights with the dispatch ------------------------------------------------------------------------------------
def test_weights_with_dispatch_bit_for_bit_gradients_included(rng):
    """README: `comm.dispatch(x, ids, topk_weights=w)`, then `comm.combine(y, d.handle)`: the same result bit for
    bit, gradients included."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)
    W = (rng.standard_normal((E, H, H)) / 2).astype(np.float32)
    c = rng.standard_normal((world * T, H)).astype(np.float32)

    def layer(at_dispatch):
        def fn(x, ids, nt, w, Wl):
            if at_dispatch:
                d = comm.dispatch(x, ids, num_tokens=nt[0], topk_weights=w)
            else:
                d = comm.dispatch(x, ids, num_tokens=nt[0])
            y = jax.lax.ragged_dot(d.expert_x, Wl, d.group_sizes)
            return comm.combine(y, d.handle) if at_dispatch else comm.combine(y, d.handle, w)

        sm = jax.shard_map(fn, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))

        def loss(x, w, W):
            out = sm(x, jnp.asarray(per_rank(ids, 1)), jnp.asarray(nt), w, W)
            return jnp.sum(out * c), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    args = (per_rank(x, 1), per_rank(w, 1), W)
    (la, ya), ga = layer(True)(*args)
    (lb, yb), gb = layer(False)(*args)
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))
    for name, a, b in zip(("x", "topk_weights", "W"), ga, gb, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"gradient of {name}")
    assert np.asarray(ga[1]).any()


# Split halves -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights_to", ["combine_send", "combine_recv", "dispatch"])
def test_split_halves_match_fused_calls(rng, weights_to):
    """README: split halves `dispatch_send`/`dispatch_recv`, `combine_send`/`combine_recv` (weights to either
    half) give what the fused calls give."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)

    def fused(x, ids, nt, w):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return d.expert_x, d.group_sizes, d.handle.row_origin, comm.combine(d.expert_x * 2, d.handle, w)

    def split(x, ids, nt, w):
        kw = dict(topk_weights=w) if weights_to == "dispatch" else {}
        d = comm.dispatch_recv(comm.dispatch_send(x, ids, num_tokens=nt[0], **kw))
        if weights_to == "combine_send":
            y = comm.combine_recv(comm.combine_send(d.expert_x * 2, d.handle, w))
        elif weights_to == "combine_recv":
            y = comm.combine_recv(comm.combine_send(d.expert_x * 2, d.handle), w)
        else:
            y = comm.combine_recv(comm.combine_send(d.expert_x * 2, d.handle))
        return d.expert_x, d.group_sizes, d.handle.row_origin, y

    args = (per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1))
    a = run_shards(comm, fused, *args)
    b = run_shards(comm, split, *args)
    for u, v in zip(a[:3], b[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_allclose(np.asarray(a[3]), np.asarray(b[3]), rtol=1e-6, atol=1e-6)
    scale = np.where(ids >= 0, w, 0).sum(-1, keepdims=True) * 2
    expected = scale * x
    expected[np.arange(T)[None, :] >= nt[:, None]] = 0
    np.testing.assert_allclose(np.asarray(b[3]).reshape(world, T, H), expected, rtol=1e-6, atol=1e-6)


def _split_round_trip(comm, T, K):
    def split(x, ids):
        d = comm.dispatch_recv(comm.dispatch_send(x, ids))
        return comm.combine_recv(comm.combine_send(d.expert_x, d.handle, jnp.ones((T, K), F32)))

    return jax.shard_map(split, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))


def test_split_halves_refuse_a_gradient_with_custom_vjp():
    """README (Autodiff): "Split halves: plain AD only (`custom_vjp=False`)": with custom_vjp (the NVSHMEM
    backend's default) a gradient through them is refused with a ValueError naming the half."""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, custom_vjp=True)
    ids = np.tile(np.arange(K, dtype=np.int32), (world * T, 1))
    sm = _split_round_trip(comm, T, K)
    x = np.ones((world * T, H), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(sm)(x, ids)), 2.0)  # the forward is untouched
    with pytest.raises(ValueError, match="dispatch_send has no gradient with custom_vjp=True"):
        jax.grad(lambda x: sm(x, ids).sum())(x)


def test_split_halves_differentiate_by_plain_ad():
    """README (Autodiff): "Split halves: plain AD only (`custom_vjp=False`)": without custom_vjp (the reference
    backend's default) jax.grad through them equals the fused calls' gradient."""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T)
    assert not comm.custom_vjp
    ids = np.tile(np.arange(K, dtype=np.int32), (world * T, 1))
    x = np.random.default_rng(0).standard_normal((world * T, H)).astype(np.float32)

    def fused(x, ids):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x * d.expert_x, d.handle, jnp.ones((T, K), F32))

    def split(x, ids):
        d = comm.dispatch_recv(comm.dispatch_send(x, ids))
        return comm.combine_recv(comm.combine_send(d.expert_x * d.expert_x, d.handle, jnp.ones((T, K), F32)))

    grads = [jax.jit(jax.grad(lambda x, f=f: jax.shard_map(f, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))(
        x, ids).sum()))(x) for f in (fused, split)]  # jitted: eager, each primitive compiles on its own (minutes)
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-6)
    np.testing.assert_allclose(grads[0], 2 * K * x, rtol=1e-5)  # y[t] = K * x[t]**2 (weights 1)


# Global view --------------------------------------------------------------------------------------------------
def test_global_view_matches_shard_map(rng):
    """README: `jmc.dispatch(comm, x, ids, ...)` / `jmc.combine(comm, y, handle, w)` take arrays sharded over the
    batch and EP axes (`x` is `[comm.num_shards * max_tokens, H]`), no shard_map: same results as per shard."""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    assert comm.num_shards == world
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)
    ey = rng.standard_normal((world, comm.capacity, H)).astype(np.float32)
    per_shard = dispatch_outputs(comm, per_rank(x, 1), per_rank(ids, 1), nt, per_rank(w, 1), ey)

    sharding = NamedSharding(comm.mesh, comm.batch_spec)
    put = lambda a: jax.device_put(jnp.asarray(a), sharding)  # noqa: E731

    @jax.jit
    def glob(x, ids, nt, w, ey):
        d = jmc.dispatch(comm, x, ids, num_tokens=nt)
        return d.expert_x, d.group_sizes, d.handle.row_origin, jmc.combine(comm, ey, d.handle, w)

    got = glob(put(per_rank(x, 1)), put(per_rank(ids, 1)), put(nt), put(per_rank(w, 1)),
               put(ey.reshape(world * comm.capacity, H)))
    np.testing.assert_array_equal(np.asarray(got[0]).reshape(per_shard[0].shape), per_shard[0])
    np.testing.assert_array_equal(np.asarray(got[1]).reshape(per_shard[1].shape), per_shard[1])
    np.testing.assert_array_equal(np.asarray(got[2]).reshape(per_shard[2].shape), per_shard[2])
    np.testing.assert_array_equal(np.asarray(got[3]).reshape(per_shard[5].shape), per_shard[5])

    # "a batch ... replicated, is sliced locally": the same results from replicated inputs
    rep = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(comm.mesh, P()))  # noqa: E731
    got_rep = glob(rep(per_rank(x, 1)), rep(per_rank(ids, 1)), rep(nt), rep(per_rank(w, 1)),
                   put(ey.reshape(world * comm.capacity, H)))
    for a, b in zip(got, got_rep, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Any mesh -----------------------------------------------------------------------------------------------------
def test_any_mesh_other_axes_select_independent_ep_groups(rng):
    """README: "`axis_name` is one mesh axis or a tuple; the other axes' coordinates select independent EP
    groups": on a ("data", "ep") 2x4 mesh each data row is its own EP group of 4 with the README's layout."""
    E, K, H, T, align = 8, 2, 4, 3, 2
    mesh = named_mesh((2, 4), ("data", "ep"))
    comm = make_comm(world=4, E=E, K=K, H=H, T=T, align=align, mesh=mesh, axis="ep")
    assert comm.world == 4
    probs = [random_problem(rng, world=4, E=E, K=K, H=H, T=T, unused=0.1) for _ in range(2)]
    x = np.stack([per_rank(p[0], 1) for p in probs])           # [2, 4*T, H]
    ids = np.stack([per_rank(p[1], 1) for p in probs])
    nt = np.stack([p[3] for p in probs])                       # [2, 4]
    w = np.stack([per_rank(p[2], 1) for p in probs])

    def fn(x, ids, nt, w):
        d = comm.dispatch(x[0], ids[0], num_tokens=nt[0, 0])
        y = comm.combine(d.expert_x, d.handle, w[0])
        return d.expert_x[None, None], d.group_sizes[None, None], d.handle.row_origin[None, None], y[None]

    spec = P("data", "ep")
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(x, ids, nt, w)
    ex, gs, ro, y = (np.asarray(o) for o in out)
    for row, (px, pids, pw, pnt) in enumerate(probs):
        layout = expected_layout(px, pids, pnt, world=4, E=E, align=align)
        check_layout(comm, ex[row], gs[row], ro[row], layout)
        scale = np.where(pids >= 0, pw, 0).sum(-1, keepdims=True)
        expected = scale * px
        expected[np.arange(T)[None, :] >= pnt[:, None]] = 0
        np.testing.assert_allclose(y[row].reshape(4, T, H), expected, rtol=1e-6, atol=1e-6)


def test_any_mesh_tuple_axis_name_is_one_ep_group(rng):
    """README: `axis_name` may be a tuple (`("context", "expert")`): the axes together form one EP group."""
    E, K, H, T = 16, 2, 4, 2
    mesh = named_mesh((2, 4), ("context", "expert"))
    comm = make_comm(world=8, E=E, K=K, H=H, T=T, mesh=mesh, axis=("context", "expert"))
    assert comm.world == 8
    x, ids, w, nt = random_problem(rng, world=8, E=E, K=K, H=H, T=T)

    def fn(x, ids, nt):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return d.handle.row_origin[None], d.group_sizes[None]

    spec = P(("context", "expert"))
    ro, gs = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(per_rank(x, 1),
                                                                                 per_rank(ids, 1), nt)
    layout = expected_layout(x, ids, nt, world=8, E=E, align=1)
    for r, (_, origins, sizes) in enumerate(layout):
        np.testing.assert_array_equal(np.asarray(gs)[r], sizes)
        np.testing.assert_array_equal(np.asarray(ro)[r, : origins.shape[0]], origins)


# fp8 ----------------------------------------------------------------------------------------------------------
def test_fp8_expert_scales_follow_the_rows(rng):
    """README: `dtype=jnp.float8_e4m3fn` with float32 `scales [max_tokens, hidden // scale_block]`;
    `d.expert_scales` follows the rows (and fp8 rows arrive unchanged)."""
    world, E, K, H, T, B = 4, 8, 2, 8, 3, 4
    cfg = jmc.MoECommConfig(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T, dtype=jnp.float8_e4m3fn,
                            scale_block=B, out_dtype=F32)
    comm = jmc.MoEComm(cfg, ep_mesh(world), "ep", backend="reference")
    x32, ids, _, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T)
    x8 = np.asarray(jnp.asarray(x32).astype(jnp.float8_e4m3fn))
    scales = rng.random((world, T, H // B)).astype(np.float32) + 0.5

    def fn(x, s, ids, nt):
        d = comm.dispatch(x, ids, scales=s, num_tokens=nt[0])
        return d.expert_x[None], d.expert_scales[None], d.handle.row_origin[None]

    ex, es, ro = run_shards(comm, fn, per_rank(x8, 1), per_rank(scales, 1), per_rank(ids, 1), nt)
    ex, es, ro = np.asarray(ex)[:, 0], np.asarray(es)[:, 0], np.asarray(ro)[:, 0]
    layout = expected_layout(x8.astype(np.float32), ids, nt, world=world, E=E, align=1)
    for r, (rows, origins, _) in enumerate(layout):
        n = rows.shape[0]
        np.testing.assert_array_equal(ro[r, :n], origins)
        np.testing.assert_array_equal(ex[r, :n].astype(np.float32), rows)
        for p, o in enumerate(origins):
            g, t = divmod(int(o) // K, T)
            np.testing.assert_array_equal(es[r, p], scales[g, t])


# Errors -------------------------------------------------------------------------------------------------------
def _names(text, arg):
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])", text) is not None


def _per_shard_call(comm, fn, *args):
    return jax.jit(jax.shard_map(fn, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)


BAD_CALLS = {  # name -> (argument the message must name, per-shard body, shard inputs [world, ...] built in test)
    "x_hidden": "x",
    "x_tokens": "x",
    "topk_ids_k": "topk_ids",
    "topk_ids_dtype": "topk_ids",
    "topk_weights_shape": "topk_weights",
    "dispatch_topk_weights_shape": "topk_weights",
    "expert_y_rows": "expert_y",
    "expert_y_hidden": "expert_y",
    "num_tokens_dtype": "num_tokens",
    "x_dtype": "x",
    "no_weights": "topk_weights",
    "weights_twice": "topk_weights",
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_value_error_naming_them(case):
    """README (Errors): "Bad arguments raise `ValueError` naming the argument and the fix"."""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T)
    x = np.zeros((world * T, H), np.float32)
    ids = np.tile(np.arange(K, dtype=np.int32), (world * T, 1))
    w = np.ones((world * T, K), np.float32)
    cap = comm.capacity

    def run(xs, idss, ws, ey_shape=(cap, H), nt_dtype=np.int32, weights_at_dispatch=False, weights_at_combine=True):
        nt = np.full((world,), T, nt_dtype)

        def fn(x, ids, w, nt):
            kw = dict(topk_weights=w) if weights_at_dispatch else {}
            d = comm.dispatch(x, ids, num_tokens=nt[0], **kw)
            ey = jnp.zeros(ey_shape, F32)
            return comm.combine(ey, d.handle, w) if weights_at_combine else comm.combine(ey, d.handle)

        return _per_shard_call(comm, fn, xs, idss, ws, nt)

    calls = {
        "x_hidden": lambda: run(np.zeros((world * T, H + 1), np.float32), ids, w),
        "x_tokens": lambda: run(np.zeros((world * (T + 1), H), np.float32), np.tile(ids[:1], (world * (T + 1), 1)),
                                np.ones((world * (T + 1), K), np.float32)),
        "topk_ids_k": lambda: run(x, np.tile(np.arange(K + 1, dtype=np.int32), (world * T, 1)), w),
        "topk_ids_dtype": lambda: run(x, ids.astype(np.float32), w),
        "topk_weights_shape": lambda: run(x, ids, np.ones((world * T, K + 1), np.float32)),
        "dispatch_topk_weights_shape": lambda: run(x, ids, np.ones((world * T, K + 1), np.float32),
                                                   weights_at_dispatch=True, weights_at_combine=False),
        "expert_y_rows": lambda: run(x, ids, w, ey_shape=(cap + 1, H)),
        "expert_y_hidden": lambda: run(x, ids, w, ey_shape=(cap, H + 2)),
        "num_tokens_dtype": lambda: run(x, ids, w, nt_dtype=np.float32),
        "x_dtype": lambda: run(x.astype(np.float16), ids, w),
        "no_weights": lambda: run(x, ids, w, weights_at_combine=False),               # weights nowhere
        "weights_twice": lambda: run(x, ids, w, weights_at_dispatch=True),            # to dispatch and to combine
    }
    with pytest.raises(ValueError) as info:
        calls[case]()
    assert _names(str(info.value), BAD_CALLS[case]), f"message does not name {BAD_CALLS[case]!r}: {info.value}"


CONFIG_ERRORS = [
    ("num_experts", lambda: make_comm(world=4, E=6)),                      # not divisible by the EP world
    ("overflow", lambda: make_comm(cfg_kw=dict(overflow="bogus"))),
    ("backend", lambda: jmc.MoEComm(make_comm().cfg, ep_mesh(4), "ep", backend="bogus")),
    ("check_errors", lambda: make_comm(check_errors="bogus")),
    ("align", lambda: make_comm(align=0)),
    ("experts_per_token", lambda: make_comm(E=8, K=9)),
    ("dp_size", lambda: make_comm(world=4, dp=3)),
    ("axis_name", lambda: make_comm(axis="nope")),
]


@pytest.mark.parametrize("arg,build", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_bad_configuration_raises_value_error_naming_it(arg, build):
    """README (Errors): "Bad arguments raise `ValueError` naming the argument" (configuration and options)."""
    with pytest.raises(ValueError) as info:
        build()
    assert _names(str(info.value), arg), f"message does not name {arg!r}: {info.value}"


# Autodiff -----------------------------------------------------------------------------------------------------
def dense_moe(x, ids, w, W, nt):
    """Dense formulation: y[t] = sum_k w[t, k] * (x[t] @ W[ids[t, k]]) for t < num_tokens and ids >= 0."""
    per_slot = jnp.einsum("th,tkhj->tkj", x, W[jnp.maximum(ids, 0)])
    mask = (ids >= 0) & (jnp.arange(x.shape[0])[:, None] < nt)
    return jnp.einsum("tk,tkj->tj", jnp.where(mask, w, 0.0), per_slot)


@pytest.mark.parametrize("custom_vjp", [None, True])
def test_grad_matches_dense_formulation(rng, custom_vjp):
    """README: "`jax.grad` works through `dispatch` / `combine`" on the reference backend: the gradients of x,
    topk_weights and the expert weights are those of the dense computation."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2, custom_vjp=custom_vjp)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)
    W = (rng.standard_normal((E, H, H)) / 2).astype(np.float32)
    c = rng.standard_normal((world, T, H)).astype(np.float32)

    def fn(x, ids, nt, w, Wl):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return comm.combine(jax.lax.ragged_dot(d.expert_x, Wl, d.group_sizes), d.handle, w)

    sm = jax.shard_map(fn, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))
    ids_r = jnp.asarray(per_rank(ids, 1))

    def loss(x, w, W):
        return jnp.sum(sm(x, ids_r, jnp.asarray(nt), w, W) * c.reshape(world * T, H))

    def dense_loss(x, w, W):
        ys = [dense_moe(x[g], ids[g], w[g], W, nt[g]) for g in range(world)]
        return jnp.sum(jnp.stack(ys) * c)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(per_rank(x, 1), per_rank(w, 1), W)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, W)
    for name, a, b in zip(("x", "topk_weights", "W"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a).reshape(np.shape(b)), np.asarray(b), rtol=1e-5, atol=1e-5,
                                   err_msg=f"gradient of {name}")


def test_grad_dp_groups_summed_over_replicas(rng):
    """README: "`dp_size` consecutive ranks hold identical tokens; they share the sending (x's gradient: exact summed
    over a group's replicas)": the replicas' x gradients sum to the dense gradient of the shared tokens."""
    world, dp, E, K, H, T = 4, 2, 8, 2, 4, 3
    G = world // dp
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, dp=dp)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, dp=dp)
    W = (rng.standard_normal((E, H, H)) / 2).astype(np.float32)
    c = rng.standard_normal((world, T, H)).astype(np.float32)  # every replica its own cotangent

    def fn(x, ids, nt, w, Wl):
        d = comm.dispatch(x, ids, num_tokens=nt[0])
        return comm.combine(jax.lax.ragged_dot(d.expert_x, Wl, d.group_sizes), d.handle, w)

    sm = jax.shard_map(fn, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))
    ids_r, nt_r = jnp.asarray(per_rank(ids, dp)), jnp.asarray(np.repeat(nt, dp))

    def loss(x_groups, w_groups, W):  # replicate the group's tokens onto its dp ranks inside the function
        xr = jnp.repeat(x_groups, dp, axis=0).reshape(world * T, H)
        wr = jnp.repeat(w_groups, dp, axis=0).reshape(world * T, K)
        return jnp.sum(sm(xr, ids_r, nt_r, wr, W) * c.reshape(world * T, H))

    def dense_loss(x, w, W):
        total = 0.0
        for r in range(world):
            g = r // dp
            total = total + jnp.sum(dense_moe(x[g], ids[g], w[g], W, nt[g]) * c[r])
        return total

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, W)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, W)
    assert np.shape(got[0]) == (G, T, H)
    for name, a, b in zip(("x", "topk_weights", "W"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"gradient of {name}")


# More from "Use" and "Errors" ---------------------------------------------------------------------------------
def test_fp8_quantize_in_dispatch_dequantizes_to_x(rng):
    """README: bf16 `x` with `quantize=jnp.float8_e4m3fn` (quantized in the kernel); `d.expert_scales` follows the
    rows: expert_x * expert_scales (per scale_block) is x to fp8 rounding."""
    world, E, K, H, T, B = 4, 8, 2, 8, 3, 4
    cfg = jmc.MoECommConfig(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T, dtype=jnp.float8_e4m3fn,
                            scale_block=B)
    comm = jmc.MoEComm(cfg, ep_mesh(world), "ep", backend="reference")
    x32, ids, _, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T)
    x32 = x32 * np.array([1.0, 100.0, 0.01, 3.0, 1.0, 1e3, 1.0, 0.5], np.float32)  # blocks of different scales
    xb = np.asarray(jnp.asarray(x32).astype(jnp.bfloat16).astype(F32))

    def fn(x, ids, nt):
        d = comm.dispatch(x.astype(jnp.bfloat16), ids, num_tokens=nt[0], quantize=jnp.float8_e4m3fn)
        return d.expert_x.astype(F32)[None], d.expert_scales[None], d.handle.row_origin[None]

    ex, es, ro = (np.asarray(o)[:, 0] for o in run_shards(comm, fn, per_rank(xb, 1), per_rank(ids, 1), nt))
    layout = expected_layout(xb, ids, nt, world=world, E=E, align=1)
    for r, (rows, origins, _) in enumerate(layout):
        n = rows.shape[0]
        np.testing.assert_array_equal(ro[r, :n], origins)
        deq = ex[r, :n] * np.repeat(es[r, :n], B, axis=1)
        amax = np.repeat(np.abs(rows).reshape(n, H // B, B).max(-1), B, axis=1)
        assert (np.abs(deq - rows) <= np.abs(rows) / 16 + amax * 2.0**-9 + 1e-30).all(), f"rank {r}"


def test_moecomm_error_is_a_jax_runtime_error():
    """README: "`comm.check()` and `comm.close()` raise `jmc.MoECommError`, a subclass" of JaxRuntimeError."""
    assert issubclass(jmc.MoECommError, jax.errors.JaxRuntimeError)
    comm = make_comm()
    comm.check()  # nothing failed: no error


@pytest.mark.parametrize("check_errors", [True, "sync"])
def test_routing_error_message_is_the_readme_text(rng, check_errors):
    """README (Errors): the error is raised as `jax.errors.JaxRuntimeError`, "e.g. `ABORTED: jax_moe_comm:
    dispatch_send failed on rank 0: expert id 99 of token 3 is outside [-1, num_experts)` (its first line, CPU or
    GPU)": the first line wherever a compiled check is installed (the CUDA extension or the status module)."""
    world, E, K, H, T = 4, 8, 2, 4, 4
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, check_errors=check_errors)
    ids = distinct_ids(rng, (world * T,), E, K)
    ids[3, 1] = 99  # rank 0, token 3

    def fn(x, ids, w):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x, d.handle, w)

    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        np.asarray(run_shards(comm, fn, np.ones((world * T, H), np.float32), ids, np.ones((world * T, K), np.float32)))
    lines = str(info.value).rstrip().splitlines()
    ours = r"jax_moe_comm: \w+ failed on rank 0: expert id 99 of token 3 is outside \[-1, num_experts\)"
    if jmc.build_info()["cuda"] or jmc._native.status_ext is not None:
        assert re.fullmatch("ABORTED: " + ours, lines[0]), lines[:3]
    else:  # a build without the compiled modules: a host callback's stack, then our message
        assert re.fullmatch("MoECommError: " + ours, lines[-1]), lines[-3:]


@pytest.mark.parametrize("error", ["outside", "repeated"])
def test_routing_error_nan_on_every_rank_then_fine(rng, error):
    """README (Errors): "Routing errors (an id outside [-1, E), one expert twice in a token ...): every rank
    finishes the round trip with NaN output. The next round trip is fine." (check_errors=False: in handle.status)"""
    world, E, K, H, T = 4, 8, 2, 4, 3
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, check_errors=False)
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, partial=False)
    bad = ids.copy()
    bad[1, 2] = [E + 3, 0] if error == "outside" else [5, 5]

    def fn(x, ids, w):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x, d.handle, w), d.handle.status

    y, status = run_shards(comm, fn, per_rank(x, 1), per_rank(bad, 1), per_rank(w, 1))
    assert np.isnan(np.asarray(y)).any(axis=(1, 2)).all(), "every rank must finish with NaN output"
    assert np.asarray(status).any()
    y, status = run_shards(comm, fn, per_rank(x, 1), per_rank(ids, 1), per_rank(w, 1))
    np.testing.assert_allclose(np.asarray(y), w.sum(-1, keepdims=True) * x, rtol=1e-6, atol=1e-6)
    assert not np.asarray(status).any()


def test_global_view_on_two_axis_mesh(rng):
    """README: the global view takes arrays sharded over the batch and EP axes (`x` is `[comm.num_shards *
    max_tokens, H]`, sharded `comm.batch_spec`); `batch_axes` None: the other axes."""
    E, K, H, T = 8, 2, 4, 3
    mesh = named_mesh((2, 4), ("data", "ep"))
    comm = make_comm(world=4, E=E, K=K, H=H, T=T, mesh=mesh, axis="ep")
    assert comm.num_shards == 8
    probs = [random_problem(rng, world=4, E=E, K=K, H=H, T=T, unused=0.1) for _ in range(2)]
    x = np.concatenate([per_rank(p[0], 1) for p in probs])     # data row 0's shards first (row-major mesh)
    ids = np.concatenate([per_rank(p[1], 1) for p in probs])
    w = np.concatenate([per_rank(p[2], 1) for p in probs])
    nt = np.concatenate([p[3] for p in probs])
    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, comm.batch_spec))  # noqa: E731

    @jax.jit
    def glob(x, ids, nt, w):
        d = jmc.dispatch(comm, x, ids, num_tokens=nt)
        return jmc.combine(comm, d.expert_x * 2, d.handle, w)

    y = np.asarray(glob(put(x), put(ids), put(nt), put(w))).reshape(2, 4, T, H)
    for row, (px, pids, pw, pnt) in enumerate(probs):
        scale = np.where(pids >= 0, pw, 0).sum(-1, keepdims=True) * 2
        expected = scale * px
        expected[np.arange(T)[None, :] >= pnt[:, None]] = 0
        np.testing.assert_allclose(y[row], expected, rtol=1e-6, atol=1e-6)
    same = make_comm(world=4, E=E, K=K, H=H, T=T, mesh=mesh, axis="ep", batch_axes=("data",))
    assert same.batch_spec == comm.batch_spec and same.num_shards == comm.num_shards


def test_one_comm_serves_every_layer_in_scan_and_grad(rng):
    """README: one `MoEComm` per model, its buffers serve every layer and the backward pass; works inside `jit`,
    `shard_map`, `lax.scan` and `grad`: a scanned 2-layer model matches the dense model, gradients too."""
    world, E, K, H, T, layers = 4, 8, 2, 4, 3, 2
    comm = make_comm(world=world, E=E, K=K, H=H, T=T, align=2)
    x = rng.standard_normal((world, T, H)).astype(np.float32)
    ids = np.stack([distinct_ids(rng, (world, T), E, K) for _ in range(layers)])     # [layers, world, T, K]
    w = rng.random((layers, world, T, K)).astype(np.float32)
    W = (rng.standard_normal((layers, E, H, H)) / 2).astype(np.float32)

    def fn(x, ids, w, Ws):  # ids/w [layers, T, K] per shard, Ws [layers, L, H, H]
        def step(h, xs):
            i, wt, Wl = xs
            d = comm.dispatch(h, i)
            return h + comm.combine(jax.lax.ragged_dot(d.expert_x, Wl, d.group_sizes), d.handle, wt), None
        return jax.lax.scan(step, x, (ids, w, Ws))[0]

    sm = jax.shard_map(fn, mesh=comm.mesh, in_specs=(P("ep"), P(None, "ep"), P(None, "ep"), P(None, "ep")),
                       out_specs=P("ep"))
    ids_r = jnp.asarray(ids.reshape(layers, world * T, K))

    def loss(x, w, W):
        return jnp.sum(jnp.sin(sm(x.reshape(world * T, H), ids_r, w.reshape(layers, world * T, K), W)))

    def dense_loss(x, w, W):
        total = 0.0
        for g in range(world):
            h = x[g]
            for layer in range(layers):
                h = h + dense_moe(h, ids[layer, g], w[layer, g], W[layer], T)
            total = total + jnp.sum(jnp.sin(h))
        return total

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, W)
    want = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(x, w, W)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for name, a, b in zip(("x", "topk_weights", "W"), got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


def test_options_bf16_results_within_output_rounding(rng):
    """README (Options): "None changes the results beyond the output dtype's rounding": bf16 rows and output, every
    option within one bf16 rounding of the exact weighted sum (and the dispatched rows bit for bit)."""
    world, E, K, H, T, align = 4, 8, 3, 8, 4, 2
    cfg = jmc.MoECommConfig(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T, align=align)
    assert cfg.dtype == jnp.bfloat16 and cfg.out_dtype == jnp.bfloat16  # README example's defaults
    x, ids, w, nt = random_problem(rng, world=world, E=E, K=K, H=H, T=T, unused=0.1)
    xb = jnp.asarray(per_rank(x, 1)).astype(jnp.bfloat16)
    layout = expected_layout(np.asarray(xb.astype(F32)).reshape(world, T, H), ids, nt, world=world, E=E, align=align)
    for opts in [{}] + OPTION_VARIANTS:
        comm = jmc.MoEComm(cfg, ep_mesh(world), "ep", **({"backend": "reference"} | opts))

        def fn(x, ids, nt, w, comm=comm):
            d = comm.dispatch(x, ids, num_tokens=nt[0])
            y = comm.combine((d.expert_x.astype(F32) * 1.5).astype(jnp.bfloat16), d.handle, w)
            return d.expert_x[None], y

        ex, y = run_shards(comm, fn, xb, per_rank(ids, 1), nt, per_rank(w, 1))
        assert y.dtype == jnp.bfloat16, opts
        ex = np.asarray(ex.astype(F32))[:, 0]
        for r, (rows, _, _) in enumerate(layout):
            np.testing.assert_array_equal(ex[r, : rows.shape[0]], rows, err_msg=f"{opts}")
        ey = np.asarray(jnp.asarray(ex * 1.5).astype(jnp.bfloat16).astype(F32))
        exact = expected_combine(ey, layout, ids, w, nt, dp=1)
        got = np.asarray(y.astype(F32)).reshape(world, T, H)
        assert (np.abs(got - exact) <= np.abs(exact) * 2.0**-8 + 1e-30).all(), f"{opts}: beyond bf16 rounding"

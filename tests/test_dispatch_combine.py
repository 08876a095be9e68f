"""dispatch/combine on the reference backend against the brute-force NumPy oracle (tests/oracle.py).

Layouts (expert_x, expert_scales, group_sizes, handle.row_origin) must match the oracle bit for bit; combined
values within a tolerance of the output dtype. Every case runs on 2, 4 or 8 forced CPU devices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from conftest import SCENARIOS, Routing, ep_mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import MoEComm, MoECommConfig


# Cases ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One static configuration (world, MoECommConfig fields) plus the dtype of the expert outputs fed to combine."""

    world: int
    dp_size: int
    num_experts: int
    k: int
    hidden: int
    max_tokens: int
    dtype: str
    out_dtype: str
    align: int = 1
    scale_block: int | None = None
    capacity: int | None = None
    expert_y_dtype: str | None = None  # default: out_dtype (expert_y may not be wider than out_dtype)

    @property
    def id(self) -> str:
        parts = [f"w{self.world}", f"dp{self.dp_size}", f"E{self.num_experts}", f"K{self.k}", f"H{self.hidden}",
                 f"T{self.max_tokens}", f"{self.dtype}->{self.out_dtype}"]
        if self.align > 1:
            parts.append(f"align{self.align}")
        if self.capacity is not None:
            parts.append(f"cap{self.capacity}")
        return "-".join(parts)

    @property
    def num_groups(self) -> int:
        return self.world // self.dp_size

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    def config(self) -> MoECommConfig:
        return MoECommConfig(self.num_experts, self.k, self.hidden, self.max_tokens, dtype=jnp.dtype(self.dtype),
                             scale_block=self.scale_block, out_dtype=jnp.dtype(self.out_dtype),
                             dp_size=self.dp_size, capacity=self.capacity, align=self.align)

    def with_capacity(self, capacity: int) -> Case:
        return dataclasses.replace(self, capacity=capacity)


CASES = [
    Case(2, 1, 4, 2, 32, 8, "bfloat16", "bfloat16"),
    Case(4, 1, 8, 2, 16, 8, "float32", "float32"),
    Case(8, 1, 16, 8, 16, 8, "bfloat16", "float32", expert_y_dtype="bfloat16"),        # K = 8
    Case(8, 2, 8, 1, 16, 8, "float16", "float16"),                                     # L = 1, K = 1
    Case(4, 2, 8, 2, 64, 8, "float8_e4m3fn", "bfloat16", scale_block=16),              # fp8 + scales
    Case(8, 4, 16, 4, 16, 8, "float32", "float32", align=4),                           # dp 4, align
    Case(4, 4, 4, 2, 16, 8, "bfloat16", "bfloat16", align=2),                          # one DP group, L = 1
    Case(2, 2, 2, 1, 16, 8, "float32", "float32"),                                     # world 2 = one group
    Case(8, 1, 32, 8, 32, 8, "float8_e4m3fn", "float32", align=8, scale_block=16),     # fp8, K = 8, align 8
    Case(4, 1, 8, 1, 256, 16, "bfloat16", "float32", align=3, expert_y_dtype="float16"),  # odd align, H 256
    Case(2, 1, 16, 8, 16, 16, "float32", "float32"),                                   # K = L = 8
    Case(8, 2, 64, 8, 16, 4, "bfloat16", "float16", align=2),
]
CASE_IDS = [case.id for case in CASES]


@functools.cache
def comm_for(case: Case) -> MoEComm:
    return MoEComm(case.config(), ep_mesh(case.world), axis_name="ep", backend="reference")


def _lift(tree):
    """Per-shard scalars -> [1], so shard_map can concatenate them over "ep"."""
    return jax.tree.map(lambda a: a.reshape(1) if a.ndim == 0 else a, tree)


def _shard_mapped(case: Case, per_shard):
    comm = comm_for(case)
    return jax.jit(jax.shard_map(lambda *a: _lift(per_shard(comm, *a)), mesh=comm.mesh,
                                 in_specs=P("ep"), out_specs=P("ep")))


@functools.cache
def fused_fn(case: Case):
    """(x, topk_ids, scales, num_tokens[world], expert_y, topk_weights) -> (Dispatched, y), per-shard fused calls."""
    def per_shard(comm, x, ids, scales, n, expert_y, w):
        d = comm.dispatch(x, ids, scales, n.reshape(()))
        return d, comm.combine(expert_y, d.handle, w)
    return _shard_mapped(case, per_shard)


@functools.cache
def split_fn(case: Case, weights_at: str = "recv"):
    """Same as fused_fn through dispatch_send/dispatch_recv/combine_send/combine_recv, the weights given to
    combine_recv or (weights_at="send") to combine_send."""
    def per_shard(comm, x, ids, scales, n, expert_y, w):
        d = comm.dispatch_recv(comm.dispatch_send(x, ids, scales, n.reshape(())))
        if weights_at == "send":
            return d, comm.combine_recv(comm.combine_send(expert_y, d.handle, w))
        return d, comm.combine_recv(comm.combine_send(expert_y, d.handle), w)
    return _shard_mapped(case, per_shard)


@functools.cache
def global_fn(case: Case):
    """Same as fused_fn through the global-view jax_moe_comm.dispatch/combine inside jit."""
    comm = comm_for(case)

    def run(x, ids, scales, n, expert_y, w):
        d = jax_moe_comm.dispatch(comm, x, ids, scales, n)
        return d, jax_moe_comm.combine(comm, expert_y, d.handle, w)
    return jax.jit(run)


# Inputs -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Problem:
    """Random inputs of one call, per group (oracle) and per rank (package)."""

    case: Case
    routing: object
    x: np.ndarray              # [G, T, H] payload dtype
    scales: np.ndarray | None  # [G, T, H // B] float32
    weights: np.ndarray        # [world, T, K] float32 (identical within a DP group)
    seed: int

    def layouts(self, capacity: int):
        c = self.case
        return oracle.dispatch(self.x, self.routing.topk_ids, self.routing.num_tokens, self.scales, world=c.world,
                               dp_size=c.dp_size, num_experts=c.num_experts, align=c.align, capacity=capacity)

    def global_args(self, expert_y: np.ndarray):
        """Arguments of fused_fn/split_fn/global_fn: rank-major arrays concatenated over the EP axis."""
        c = self.case
        ids, n = self.routing.per_rank(c.dp_size)
        x = np.repeat(self.x, c.dp_size, axis=0).reshape(c.world * c.max_tokens, c.hidden)
        scales = None
        if self.scales is not None:
            scales = np.repeat(self.scales, c.dp_size, axis=0).reshape(c.world * c.max_tokens, -1)
        w = self.weights.reshape(c.world * c.max_tokens, c.k)
        return x, ids, scales, n, expert_y.reshape(-1, c.hidden), w

    def random_expert_y(self, rng, capacity: int) -> np.ndarray:
        dtype = np.dtype(self.case.expert_y_dtype or self.case.out_dtype)
        return rng.standard_normal((self.case.world, capacity, self.case.hidden)).astype(dtype)


def draw_routing(routing, case: Case, scenario: str):
    """A random conftest.Routing of `scenario` for `case`."""
    return routing(scenario, world=case.world, dp_size=case.dp_size, num_experts=case.num_experts, k=case.k,
                   max_tokens=case.max_tokens)


def make_problem(rng, seed, case: Case, r) -> Problem:
    """Random payload, scales and weights for routing `r` (weights are identical within a DP group)."""
    shape = (case.num_groups, case.max_tokens)
    x = rng.standard_normal(shape + (case.hidden,)).astype(np.float32)
    x = (4 * x).astype(ml_dtypes.float8_e4m3fn) if case.is_fp8 else x.astype(np.dtype(case.dtype))
    scales = None
    if case.is_fp8:
        scales = rng.uniform(0.01, 2.0, shape + (case.hidden // case.scale_block,)).astype(np.float32)
    weights = np.repeat(rng.random(shape + (case.k,)).astype(np.float32), case.dp_size, axis=0)
    return Problem(case, r, x, scales, weights, seed)


# Assertions -------------------------------------------------------------------------------------------------
def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bits_equal(actual, expected, what: str, seed: int) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape} (seed={seed})"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype} (seed={seed})"
    mismatch = np.argwhere(bits(actual) != bits(expected))
    assert mismatch.size == 0, (f"{what}: {len(mismatch)} elements differ, first at {tuple(mismatch[0])}: "
                                f"{actual[tuple(mismatch[0])]} != {expected[tuple(mismatch[0])]} (seed={seed})")


def assert_layout_matches(d, layouts, problem: Problem, capacity: int) -> None:
    """d: a global Dispatched from fused_fn/global_fn (per-rank arrays concatenated over "ep")."""
    c, seed = problem.case, problem.seed
    num_local = c.num_experts // c.world
    expert_x = np.asarray(d.expert_x).reshape(c.world, capacity, c.hidden)
    row_origin = np.asarray(d.handle.row_origin).reshape(c.world, capacity)
    group_sizes = np.asarray(d.group_sizes).reshape(c.world, num_local)
    ids, n = problem.routing.per_rank(c.dp_size)
    for rank, want in enumerate(layouts):
        where = f"rank {rank}"
        assert_bits_equal(group_sizes[rank], want.group_sizes, f"{where} group_sizes", seed)
        assert_bits_equal(row_origin[rank], want.row_origin, f"{where} handle.row_origin", seed)
        assert_bits_equal(expert_x[rank], want.expert_x, f"{where} expert_x", seed)
        if c.is_fp8:
            scales = np.asarray(d.expert_scales).reshape(c.world, capacity, -1)
            assert_bits_equal(scales[rank], want.expert_scales, f"{where} expert_scales", seed)
        else:
            assert d.expert_scales is None
    assert_bits_equal(d.handle.topk_ids, ids, "handle.topk_ids (the rank's own)", seed)
    assert_bits_equal(d.handle.num_tokens, n, "handle.num_tokens (the rank's own)", seed)


def assert_combined_close(y, expected: np.ndarray, out_dtype: str, seed: int) -> None:
    """y [world * T, H] vs the oracle [world, T, H], both already in out_dtype."""
    y = np.asarray(y).reshape(expected.shape)
    assert y.dtype == np.dtype(out_dtype), f"combine returned {y.dtype}, want {out_dtype}"
    tol = {"float32": (1e-6, 1e-5), "float16": (2e-3, 1e-3), "bfloat16": (1e-2, 1e-2)}[out_dtype]
    np.testing.assert_allclose(y.astype(np.float32), expected.astype(np.float32), rtol=tol[0], atol=tol[1],
                               err_msg=f"combined output vs oracle (seed={seed})")


def run_and_check(fn, problem: Problem, rng, capacity: int):
    """Runs fn on random inputs, checks layout and combine against the oracle; returns (args, outputs)."""
    c = problem.case
    layouts = problem.layouts(capacity)
    expert_y = problem.random_expert_y(rng, capacity)
    args = problem.global_args(expert_y)
    d, y = fn(*args)
    assert_layout_matches(d, layouts, problem, capacity)
    want = oracle.combine(expert_y, layouts, problem.routing.topk_ids, problem.weights, problem.routing.num_tokens,
                          dp_size=c.dp_size, num_experts=c.num_experts, out_dtype=np.dtype(c.out_dtype))
    assert_combined_close(y, want, c.out_dtype, problem.seed)
    return args, (d, y)


# Layout and values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_dispatch_layout_and_combine_match_oracle(case, scenario, rng, seed, routing):
    """dispatch packs rows by (local expert, source group, token) with align padding, bit-exact vs the oracle;
    combine returns the fp32 slot-ordered weighted sum on every replica, zero rows past num_tokens."""
    problem = make_problem(rng, seed, case, draw_routing(routing, case, scenario))
    run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_default_capacity_is_the_worst_case(case):
    """Default capacity = max_tokens * num_dp * min(K, L), plus room for each local expert's align padding."""
    num_local = case.num_experts // case.world
    worst = case.max_tokens * case.num_groups * min(case.k, num_local)
    capacity = comm_for(case).capacity
    assert capacity >= worst
    if case.align == 1:
        assert capacity == worst


WORST_CASES = [CASES[5], CASES[9]]  # K > L with align 4; K = 1 with align 3


@pytest.mark.parametrize("case", WORST_CASES, ids=[c.id for c in WORST_CASES])
def test_worst_case_routing_fits_default_capacity(case, rng, seed):
    """Every token of every group picks min(K, L) experts of rank 0 (the most one rank can receive, plus random
    align padding): the default capacity holds it without error."""
    num_local = case.num_experts // case.world
    here = min(case.k, num_local)
    ids = np.empty((case.num_groups, case.max_tokens, case.k), np.int32)
    for g, t in np.ndindex(case.num_groups, case.max_tokens):
        elsewhere = num_local + rng.choice(case.num_experts - num_local, case.k - here, replace=False)
        ids[g, t] = rng.permutation(np.concatenate([rng.choice(num_local, here, replace=False), elsewhere]))
    problem = make_problem(rng, seed, case, Routing(ids, np.full(case.num_groups, case.max_tokens, np.int32)))
    assert problem.layouts(10**6)[0].rows_needed >= case.max_tokens * case.num_groups * here
    run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_split_halves_equal_fused_calls_bit_for_bit(case, rng, seed, routing):
    """dispatch_send/dispatch_recv and combine_send/combine_recv give exactly the fused results."""
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "dropped_slots"))
    args, fused = run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)
    for weights_at in ("recv", "send"):
        assert_trees_bits_equal(split_fn(case, weights_at)(*args), fused,
                                f"split (weights to combine_{weights_at}) vs fused", seed)


def assert_trees_bits_equal(actual, expected, what: str, seed: int) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual), strict=True):
        assert_bits_equal(b, a, f"{what} {jax.tree_util.keystr(path)}", seed)


def small_problem():
    """CASES[0]'s MoEComm, unit weights, and zero inputs with every slot -1 (for argument checks)."""
    comm = comm_for(CASES[0])
    cfg = comm.cfg
    T, K, H = cfg.max_tokens, cfg.experts_per_token, cfg.hidden
    x = jnp.zeros((comm.world * T, H), cfg.dtype)
    ids = jnp.zeros((comm.world * T, K), jnp.int32) - 1
    return comm, jnp.ones((T, K), jnp.float32), x, ids


def test_weights_go_to_exactly_one_combine_half():
    """combine_recv refuses the weights when combine_send had them, and needs them when it did not."""
    comm, w, x, ids = small_problem()
    cfg = comm.cfg

    def per_shard(weights_at_send, weights_at_recv):
        def f(x, ids):
            d = comm.dispatch(x, ids)
            q = comm.combine_send(d.expert_x.astype(cfg.out_dtype), d.handle, weights_at_send)
            return comm.combine_recv(q, weights_at_recv)
        return jax.shard_map(f, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))

    for at_send, at_recv in ((w, w), (None, None)):
        with pytest.raises(ValueError, match="topk_weights must be given to exactly one of dispatch, combine_send"):
            jax.eval_shape(per_shard(at_send, at_recv), x, ids)


@functools.cache
def weights_to_dispatch_fn(case: Case, split: bool):
    """fused_fn's inputs and outputs, the weights given to dispatch (into the handle) instead of combine; through
    the fused calls or the four halves."""
    def per_shard(comm, x, ids, scales, n, expert_y, w):
        if split:
            d = comm.dispatch_recv(comm.dispatch_send(x, ids, scales, n.reshape(()), topk_weights=w))
            return d, comm.combine_recv(comm.combine_send(expert_y, d.handle))
        d = comm.dispatch(x, ids, scales, n.reshape(()), topk_weights=w)
        return d, comm.combine(expert_y, d.handle)
    return _shard_mapped(case, per_shard)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_weights_given_to_dispatch_equal_weights_given_to_combine(case, rng, seed, routing):
    """Weights given to dispatch land in the handle and give combine's result bit for bit, fused or split."""
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "dropped_slots"))
    args, (d_want, y_want) = run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)
    for split in (False, True):
        d, y = weights_to_dispatch_fn(case, split)(*args)
        assert_bits_equal(d.handle.topk_weights, args[-1], "handle.topk_weights", seed)
        d = dataclasses.replace(d, handle=dataclasses.replace(d.handle, topk_weights=None))
        assert_trees_bits_equal((d, y), (d_want, y_want), f"weights to dispatch (split={split}) vs to combine", seed)


def test_weights_given_to_dispatch_are_the_only_ones():
    """With weights in the handle, combine and combine_send refuse more; without, combine needs them."""
    comm, w, x, ids = small_problem()
    cfg = comm.cfg

    def per_shard(to_dispatch, to_combine, split):
        def f(x, ids):
            d = comm.dispatch(x, ids, topk_weights=to_dispatch)
            expert_y = d.expert_x.astype(cfg.out_dtype)
            if split:
                return comm.combine_recv(comm.combine_send(expert_y, d.handle, to_combine))
            return comm.combine(expert_y, d.handle, to_combine)
        return jax.shard_map(f, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))

    with pytest.raises(ValueError, match=r"topk_weights went with dispatch .*: give none to combine(?!_send)"):
        jax.eval_shape(per_shard(w, w, False), x, ids)
    with pytest.raises(ValueError, match="topk_weights went with dispatch .*: give none to combine_send"):
        jax.eval_shape(per_shard(w, w, True), x, ids)
    with pytest.raises(ValueError, match="topk_weights is required: give them to combine or to dispatch"):
        jax.eval_shape(per_shard(None, None, False), x, ids)
    with pytest.raises(ValueError, match=r"topk_weights must have a float dtype \(cast to float32 inside\)"):
        jax.eval_shape(per_shard(w.astype(jnp.int32), None, False), x, ids)


@pytest.mark.parametrize("threshold, weights_at", [(None, ["recv", "recv", "send"]), (1, ["send"] * 3),
                                                   (129, ["recv"] * 3)])
def test_fused_combine_sends_the_weights_from_the_prereduce_threshold(threshold, weights_at):
    """The fused combine gives the weights to combine_send (expert-side pre-reduction on NVLink) from
    prereduce_min_tokens tokens per rank (default 64) and to combine_recv below it."""
    options = {} if threshold is None else {"prereduce_min_tokens": threshold}
    got = [MoEComm(MoECommConfig(8, 2, 16, max_tokens), ep_mesh(2), backend="reference", **options).combine_weights_at
           for max_tokens in (1, 63, 64 if threshold is None else 128)]
    assert got == weights_at


def test_the_low_latency_path_takes_the_weights_at_combine_recv():
    """The low-latency path's combine is per slot: from low_latency_max_tokens down, the weights go to combine_recv
    even above prereduce_min_tokens; where the path is not taken (staged, rows not of whole 8-byte pairs) the
    prereduce threshold decides as before."""
    def at(max_tokens, hidden=16, **options):
        cfg = MoECommConfig(8, 2, hidden, max_tokens)
        return MoEComm(cfg, ep_mesh(2), backend="reference", **options).combine_weights_at

    assert MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference").options.low_latency_max_tokens == 0
    assert at(128, low_latency_max_tokens=128) == "recv"
    assert at(129, low_latency_max_tokens=128) == "send"
    assert at(128, low_latency_max_tokens=128, staged=True) == "send"
    assert at(128, hidden=12, low_latency_max_tokens=128) == "send"
    assert "low_latency_max_tokens=128" in repr(MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference",
                                                         low_latency_max_tokens=128))


@pytest.mark.parametrize("name", ["prereduce_min_tokens", "ids_first_min_tokens", "low_latency_max_tokens"])
@pytest.mark.parametrize("value", ["many", -1, 2.5, True])
def test_thresholds_must_be_non_negative_ints(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a non-negative int \\(tokens per rank\\), got "):
        MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference", **{name: value})


@pytest.mark.parametrize("name, value, message", [
    ("timeout_s", 0, r"timeout_s must be a number of seconds in \(0, 86400\], got 0"),
    ("timeout_s", "30", r"timeout_s must be a number of seconds in \(0, 86400\], got '30'"),
    ("staged", 1, "staged must be a bool, got 1"),
    ("check_errors", "later", "check_errors must be True, False or 'sync', got 'later'"),
    ("max_sms", 0, r"max_sms must be None or a positive int \(SMs each kernel may use\), got 0"),
    ("max_sms", 8.0, r"max_sms must be None or a positive int \(SMs each kernel may use\), got 8.0"),
])
def test_options_are_validated(name, value, message):
    with pytest.raises(ValueError, match=message):
        MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference", **{name: value})


def test_every_option_is_in_the_repr_and_options():
    """The repr names every option with its value, defaults included, so a log line says how a layer runs."""
    comm = MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference", timeout_s=5, staged=True,
                   ids_first_min_tokens=0)
    text = repr(comm)
    for field in dataclasses.fields(comm.options):
        assert f"{field.name}={getattr(comm.options, field.name)!r}" in text
    assert (comm.options.timeout_s, comm.options.staged, comm.options.ids_first_min_tokens) == (5.0, True, 0)
    assert comm.options.check_errors is True and comm.options.prereduce_min_tokens == 64


def test_the_sm_budget_bounds_every_kernel_grid():
    """max_sms reaches the kernels as Sizes::max_blocks (0: no bound), and the weights exchange has the same
    budget as the round trips."""
    from jax_moe_comm import nvshmem_backend

    cfg = MoECommConfig(8, 2, 16, 4)
    assert nvshmem_backend.kernel_sizes(cfg, 2, 0)["max_blocks"] == 0
    assert nvshmem_backend.kernel_sizes(cfg, 2, 0, max_sms=16)["max_blocks"] == 16
    comm = MoEComm(cfg, ep_mesh(2), backend="reference", custom_vjp=True, max_sms=16)
    assert "max_sms=16" in repr(comm)
    assert comm._weights_geo.options.max_sms == 16


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_global_view_equals_per_shard_calls(case, rng, seed, routing):
    """jax_moe_comm.dispatch/combine inside jit equal the per-shard calls inside a user shard_map, bit for bit
    (per-shard scalars become [1]: handle.num_tokens is [world])."""
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "mixed_num_tokens"))
    args, per_shard = run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)
    global_view = global_fn(case)(*args)
    assert global_view[0].handle.num_tokens.shape == (case.world,)
    assert global_view[1].shape == (case.world * case.max_tokens, case.hidden)
    leaves = jax.tree_util.tree_leaves_with_path(per_shard)
    assert len(leaves) == len(jax.tree.leaves(global_view))
    for (path, a), b in zip(leaves, jax.tree.leaves(global_view), strict=True):
        assert_bits_equal(b, a, f"global view vs per-shard {jax.tree_util.keystr(path)}", seed)


def test_num_tokens_none_means_every_token_is_valid(rng, seed, routing):
    """num_tokens=None dispatches all max_tokens rows, like num_tokens == max_tokens."""
    case = CASES[1]
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "uniform_full"))
    comm = comm_for(case)

    def per_shard(x, ids):
        return _lift(comm.dispatch(x, ids))
    fn = jax.jit(jax.shard_map(per_shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))
    x, ids, *_ = problem.global_args(problem.random_expert_y(rng, comm.capacity))
    d = fn(x, ids)
    assert_layout_matches(d, problem.layouts(comm.capacity), problem, comm.capacity)


def test_rows_without_a_token_do_not_leak_into_combine(rng, seed, routing):
    """NaN in expert_y rows that hold no token (padding, tail) and NaN weights on -1 slots or rows past
    num_tokens change nothing: those contribute exactly nothing."""
    case = CASES[5]  # align 4: there are padding rows
    comm = comm_for(case)
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "dropped_slots"))
    ids, n = problem.routing.per_rank(case.dp_size)
    ids = ids.reshape(case.world, case.max_tokens, case.k)
    dead = (ids < 0) | (np.arange(case.max_tokens)[None, :, None] >= n[:, None, None])
    clean_weights = problem.weights.copy()
    problem.weights = np.where(dead, np.float32(np.nan), problem.weights).astype(np.float32)
    layouts = problem.layouts(comm.capacity)
    expert_y = problem.random_expert_y(rng, comm.capacity)
    for rank, layout in enumerate(layouts):
        expert_y[rank, layout.row_origin < 0] = np.nan
    d, y = fused_fn(case)(*problem.global_args(expert_y))
    y = np.asarray(y)
    assert np.isfinite(y).all(), f"NaN leaked from a row/slot without a token (seed={seed})"
    problem.weights = clean_weights
    want = oracle.combine(expert_y, layouts, problem.routing.topk_ids, clean_weights,
                          problem.routing.num_tokens, dp_size=case.dp_size, num_experts=case.num_experts,
                          out_dtype=np.dtype(case.out_dtype))
    assert_combined_close(y, want, case.out_dtype, seed)


# Capacity ---------------------------------------------------------------------------------------------------
CAPACITY_CASES = [CASES[1], CASES[5]]  # align 1; align 4 (padding counts against capacity)


def _rows_needed(problem: Problem) -> list[int]:
    return [layout.rows_needed for layout in problem.layouts(10**6)]


@pytest.mark.parametrize("base", CAPACITY_CASES, ids=[c.id for c in CAPACITY_CASES])
def test_smaller_capacity_that_fits_works(base, rng, seed, routing):
    """An explicit capacity equal to the largest per-rank row count (padding included) gives the oracle layout."""
    problem = make_problem(rng, seed, base, draw_routing(routing, base, "uniform_full"))
    capacity = max(_rows_needed(problem))
    case = base.with_capacity(capacity)
    assert capacity < comm_for(base).capacity
    problem.case = case
    assert comm_for(case).capacity == capacity
    run_and_check(fused_fn(case), problem, rng, capacity)


@pytest.mark.parametrize("base", CAPACITY_CASES, ids=[c.id for c in CAPACITY_CASES])
def test_capacity_overflow_raises(base, rng, seed, routing):
    """Receiving more rows than capacity fails the call with a message naming capacity (here on every rank)."""
    problem = make_problem(rng, seed, base, draw_routing(routing, base, "uniform_full"))
    needed = _rows_needed(problem)
    while min(needed) < 2:  # every rank must overflow (see test_error_on_one_rank_raises_instead_of_hanging)
        problem = make_problem(rng, seed, base, draw_routing(routing, base, "uniform_full"))
        needed = _rows_needed(problem)
    case = base.with_capacity(min(needed) - 1)
    problem.case = case
    args = problem.global_args(problem.random_expert_y(rng, case.capacity))
    with pytest.raises(Exception, match=r"rows arrived but capacity is \d+ \(\d+ too many\): raise "
                                        r"MoECommConfig.capacity to at least \d+"):
        jax.block_until_ready(fused_fn(case)(*args))
    assert_next_valid_call_works(case, rng, seed, routing, "num_tokens_zero")  # fits any capacity


def assert_next_valid_call_works(case: Case, rng, seed, routing, scenario: str = "uniform_partial") -> None:
    """After a failed call the same compiled function serves a valid call on the same devices."""
    problem = make_problem(rng, seed, case, draw_routing(routing, case, scenario))
    run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)


# Routing errors ---------------------------------------------------------------------------------------------
ERROR_CASES = [CASES[1], CASES[5]]  # dp 1, dp 4


def _routing_with_error_in_every_group(rng, routing, case: Case, kind: str, bad_value: int = 0):
    r = routing("uniform_partial", world=case.world, dp_size=case.dp_size, num_experts=case.num_experts,
                k=case.k, max_tokens=case.max_tokens)
    ids = r.topk_ids
    for g in range(case.num_groups):
        t = int(rng.integers(r.num_tokens[g]))
        slot = int(rng.integers(case.k))
        if kind == "outside":
            ids[g, t, slot] = bad_value
        else:
            ids[g, t, slot] = ids[g, t, (slot + 1) % case.k]
    assert oracle.routing_error(ids, r.num_tokens, case.num_experts) == kind
    return r


@pytest.mark.parametrize("bad_id", [-2, "E", "E+100"])
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.id for c in ERROR_CASES])
def test_expert_id_outside_range_raises(case, bad_id, rng, seed, routing):
    """An id < -1 or >= num_experts in a valid row fails the call, naming the token and the id."""
    value = {"E": case.num_experts, "E+100": case.num_experts + 100}.get(bad_id, bad_id)
    r = _routing_with_error_in_every_group(rng, routing, case, "outside", value)
    problem = make_problem(rng, seed, case, r)
    args = problem.global_args(problem.random_expert_y(rng, comm_for(case).capacity))
    with pytest.raises(Exception, match=rf"expert id {value} of token \d+ is outside \[-1, num_experts\)"):
        jax.block_until_ready(fused_fn(case)(*args))
    assert_next_valid_call_works(case, rng, seed, routing)


@pytest.mark.parametrize("case", [c for c in ERROR_CASES if c.k > 1], ids=[c.id for c in ERROR_CASES if c.k > 1])
def test_repeated_expert_in_one_token_raises(case, rng, seed, routing):
    """A token naming the same expert in two top-k slots fails the call."""
    r = _routing_with_error_in_every_group(rng, routing, case, "repeated")
    problem = make_problem(rng, seed, case, r)
    args = problem.global_args(problem.random_expert_y(rng, comm_for(case).capacity))
    with pytest.raises(Exception, match=r"token \d+ names expert \d+ in two top-k slots"):
        jax.block_until_ready(fused_fn(case)(*args))
    assert_next_valid_call_works(case, rng, seed, routing)


def test_invalid_ids_past_num_tokens_are_ignored(rng, seed, routing):
    """Rows t >= num_tokens may hold any ids (out of range, repeated): no error, and they are not sent."""
    case = CASES[1]
    problem = make_problem(rng, seed, case, draw_routing(routing, case, "uniform_partial"))
    ids, n = problem.routing.per_rank(case.dp_size)
    assert oracle.routing_error(problem.routing.topk_ids, problem.routing.num_tokens, case.num_experts) is None
    full = np.full_like(problem.routing.num_tokens, case.max_tokens)
    if case.max_tokens > int(problem.routing.num_tokens.min()):
        assert oracle.routing_error(problem.routing.topk_ids, full, case.num_experts) is not None
    run_and_check(fused_fn(case), problem, rng, comm_for(case).capacity)


ONE_RANK_ERROR_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_moe_comm as m
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    comm = m.MoEComm(m.MoECommConfig(4, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32), mesh)
    def f(x, ids):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x, d.handle, jnp.ones(ids.shape, jnp.float32))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    ids = np.tile(np.array([[0, 2]], np.int32), (8, 1))
    ids[1, 0] = 99  # token 1 of rank 0 only; rank 1 is fine
    try:
        jax.block_until_ready(fn(np.ones((8, 16), np.float32), ids))
    except Exception as exc:
        print("RAISED:", exc)
    else:
        print("NO ERROR")
""")


def test_error_on_one_rank_raises_instead_of_hanging(tmp_path):
    """A bad id held by one rank only still fails the call with the message (run in a subprocess: a hang must
    not take the test session down)."""
    script = tmp_path / "one_rank_error.py"
    script.write_text(ONE_RANK_ERROR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=12, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the call hung instead of raising")
    assert "RAISED:" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "expert id 99 of token 1 is outside [-1, num_experts)" in done.stdout

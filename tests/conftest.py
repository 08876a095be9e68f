"""Shared test setup: 8 forced CPU devices, meshes, per-run random seeds and routing generators.

Randomness is fresh every run. Each test that uses ``rng`` prints its seed and the failure report shows it;
rerun a failure with ``MOE_TEST_SEED=<seed>``.
"""

from __future__ import annotations

import os
from pathlib import Path

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_moe_comm  # noqa: E402

NUM_DEVICES = 8

# The package under test: the installed one (site-packages) when the suite runs against a wheel, the source tree in an
# editable install. Child processes get PACKAGE_HOME on PYTHONPATH and start in CHILD_CWD, so they run that same copy
# (a child started in the source tree with -m would import the tree's package, not the installed one).
REPO = Path(__file__).resolve().parent.parent
PACKAGE_HOME = Path(jax_moe_comm.__file__).resolve().parent.parent
CHILD_CWD = REPO if PACKAGE_HOME == REPO else REPO / "tests"


def pytest_report_header(config):
    return f"jax_moe_comm under test: {Path(jax_moe_comm.__file__).resolve().parent}"


# Meshes -----------------------------------------------------------------------------------------------------
@functools.cache
def ep_mesh(world: int, axis_name: str = "ep") -> Mesh:
    """A 1-D mesh of the first `world` CPU devices over `axis_name`."""
    assert len(jax.devices()) >= NUM_DEVICES, "conftest must force 8 host devices before jax is imported"
    return Mesh(np.array(jax.devices()[:world]), (axis_name,))


@functools.cache
def named_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of the first prod(shape) CPU devices (row-major in device order) with axes `names` of sizes `shape`,
    e.g. named_mesh((2, 4), ("data", "ep"))."""
    assert len(jax.devices()) >= NUM_DEVICES, "conftest must force 8 host devices before jax is imported"
    assert len(shape) == len(names), (shape, names)
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


@pytest.fixture
def make_mesh():
    return ep_mesh


# Compiled programs ------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def drop_compiled_programs_after_each_module():
    """Each XLA:CPU executable holds a few memory mappings while it is cached, and the test modules cache their jitted
    functions. The whole suite in one process would hold thousands of executables and reach the kernel's mapping
    limit (vm.max_map_count, 65,530 by default), where XLA:CPU's compiler dies with a segmentation fault. So the
    caches are cleared once a module ends: a module's programs are compiled again only if another module runs them."""
    yield
    jax.clear_caches()


# Seeds ------------------------------------------------------------------------------------------------------
@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or MOE_TEST_SEED), printed and attached to the failure report."""
    env = os.environ.get("MOE_TEST_SEED")
    value = int(env) if env else int(np.random.default_rng().integers(0, 2**63 - 1))
    request.node.moe_seed = value
    print(f"seed={value}")
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed_value = getattr(item, "moe_seed", None)
    if report.failed and seed_value is not None:
        report.sections.append(("random seed", f"seed={seed_value}; rerun with MOE_TEST_SEED={seed_value}"))


# Routing ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Routing:
    """Per-DP-group routing: topk_ids [G, T, K] int32, num_tokens [G] int32 (replicas of a group share it)."""

    topk_ids: np.ndarray
    num_tokens: np.ndarray

    def per_rank(self, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(topk_ids [world * T, K], num_tokens [world]): every group repeated over its dp_size replicas."""
        ids = np.repeat(self.topk_ids, dp_size, axis=0)
        return ids.reshape(-1, ids.shape[-1]), np.repeat(self.num_tokens, dp_size)


def uniform_topk(rng, shape: tuple[int, int], experts, k: int) -> np.ndarray:
    """[G, T] tokens, each with k distinct experts drawn uniformly from `experts` (an int E or a list)."""
    pool = np.arange(experts) if np.isscalar(experts) else np.asarray(experts)
    ids = np.empty(shape + (k,), np.int32)
    for index in np.ndindex(*shape):
        ids[index] = rng.choice(pool, size=k, replace=False)
    return ids


def skewed_topk(rng, shape: tuple[int, int], num_experts: int, k: int, hot_expert: int = 0) -> np.ndarray:
    """Every token picks `hot_expert` (in a random slot); its other slots are distinct uniform experts."""
    others = [e for e in range(num_experts) if e != hot_expert]
    ids = uniform_topk(rng, shape, others, k)
    for index in np.ndindex(*shape):
        ids[index + (rng.integers(k),)] = hot_expert
    return ids


def avoiding_rank_topk(rng, shape, num_experts: int, k: int, world: int, rank: int) -> np.ndarray:
    """Uniform distinct top-k that never picks an expert of `rank`: that rank receives nothing."""
    num_local = num_experts // world
    allowed = [e for e in range(num_experts) if e // num_local != rank]
    assert len(allowed) >= k, "config too small for a rank that receives nothing"
    return uniform_topk(rng, shape, allowed, k)


def drop_slots(rng, ids: np.ndarray, fraction: float = 0.3) -> np.ndarray:
    """Sets a random `fraction` of the slots to -1 (some tokens may lose every slot)."""
    ids = ids.copy()
    ids[rng.random(ids.shape) < fraction] = -1
    return ids


def garbage_past_num_tokens(rng, ids: np.ndarray, num_tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """Fills rows t >= num_tokens[g] with ids that would be errors in a valid row (out of range, repeated)."""
    ids = ids.copy()
    bad = np.array([num_experts, num_experts + 7, -2, -1000, 2**30], np.int32)
    for g in range(ids.shape[0]):
        for t in range(int(num_tokens[g]), ids.shape[1]):
            if rng.random() < 0.5:
                ids[g, t] = rng.choice(bad, size=ids.shape[2])
            else:
                ids[g, t] = rng.integers(0, num_experts)  # the same expert in every slot
    return ids


def random_num_tokens(rng, kind: str, num_groups: int, max_tokens: int) -> np.ndarray:
    """num_tokens per group: "full", "partial" (1..max_tokens-1), "zero", or "mixed" (each group any of those)."""
    def one(kind_):
        if kind_ == "full":
            return max_tokens
        if kind_ == "zero":
            return 0
        return int(rng.integers(1, max_tokens)) if max_tokens > 1 else 1
    if kind == "mixed":
        kinds = ["zero", "partial", "full"]
        chosen = [kinds[g % 3] for g in range(num_groups)]
        rng.shuffle(chosen)
        return np.array([one(c) for c in chosen], np.int32)
    return np.array([one(kind)] * num_groups, np.int32)


SCENARIOS = {
    "uniform_full": "uniform distinct top-k, every token valid",
    "uniform_partial": "uniform top-k, a partial num_tokens per group, invalid ids past num_tokens",
    "num_tokens_zero": "num_tokens == 0 in every group (ids past it are garbage)",
    "mixed_num_tokens": "groups with 0, partial and full num_tokens in one call",
    "all_to_expert0": "every token picks expert 0 (other slots distinct)",
    "rank_receives_nothing": "no token picks an expert of one random rank",
    "dropped_slots": "random -1 slots (tokens may lose every slot), partial num_tokens",
}


def make_routing(rng, scenario: str, *, world: int, dp_size: int, num_experts: int, k: int,
                 max_tokens: int) -> Routing:
    """A random Routing for one of SCENARIOS."""
    shape = (world // dp_size, max_tokens)
    count = {"uniform_partial": "partial", "num_tokens_zero": "zero", "mixed_num_tokens": "mixed",
             "dropped_slots": "partial"}.get(scenario, "full")
    num_tokens = random_num_tokens(rng, count, shape[0], max_tokens)
    if scenario == "all_to_expert0":
        ids = skewed_topk(rng, shape, num_experts, k, hot_expert=0)
    elif scenario == "rank_receives_nothing":
        ids = avoiding_rank_topk(rng, shape, num_experts, k, world, int(rng.integers(world)))
    else:
        ids = uniform_topk(rng, shape, num_experts, k)
    if scenario == "dropped_slots":
        ids = drop_slots(rng, ids)
    ids = garbage_past_num_tokens(rng, ids, num_tokens, num_experts)
    return Routing(ids, num_tokens)


@pytest.fixture
def routing(rng):
    """routing(scenario, world=, dp_size=, num_experts=, k=, max_tokens=) -> Routing, drawn from this test's rng."""
    return functools.partial(make_routing, rng)


def standalone_cpu_env() -> dict[str, str]:
    """Environment for a package tool run as a subprocess: this one minus the 8-device XLA_FLAGS above and any
    outer launcher's JAX_* wiring, on the CPU platform (the tool then sets up its own devices)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
    env["PYTHONPATH"] = str(PACKAGE_HOME)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def kernel_eqns(jaxpr, tainted=()) -> list[tuple[object, bool]]:
    """(equation, whether an operand depends on a `tainted` variable) of every kernel call in a jaxpr, in program
    order, into nested jaxprs (jit, shard_map, custom rules), whose operands map one to one onto their inputs (an
    equation with a tainted input taints all its outputs)."""
    tainted = set(tainted)
    found = []
    for eqn in jaxpr.eqns:
        hit = any(not isinstance(v, jax.extend.core.Literal) and v in tainted for v in eqn.invars)
        if eqn.primitive.name == "jmc_kernel_call":
            found.append((eqn, hit))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            inner = [w for v, w in zip(eqn.invars, sub.invars, strict=False)
                     if not isinstance(v, jax.extend.core.Literal) and v in tainted]
            found += kernel_eqns(sub, inner)
            hit = hit or bool(inner)
        if hit:
            tainted.update(eqn.outvars)
    return found


def kernel_calls(fn, *args) -> list[tuple[str, int]]:
    """(custom-call target, context) of every kernel call in fn's program, in program order (traced only: nothing
    runs). The context names the buffer set (the plan) the call runs on."""
    return [(eqn.params["target"], int(dict(eqn.params["attributes"]).get("context", -1)))
            for eqn, _ in kernel_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def kernel_targets(fn, *args) -> list[str]:
    """The custom-call targets of the kernel calls in fn's program, in program order (traced only: nothing runs)."""
    return [target for target, _ in kernel_calls(fn, *args)]


ROUND_TRIPS_CONTEXT, WEIGHTS_EXCHANGE_CONTEXT = 1, 2  # the stand-in plans' contexts (nvshmem_stand_in)


def nvshmem_stand_in(comm, p2p: bool = True):
    """`comm` (a reference-backend MoEComm with custom_vjp=True) with the NVSHMEM backend's phases on stand-in plans:
    its programs trace and lower on CPU (nothing runs; the kernels' calls name the plans' contexts above)."""
    from jax_moe_comm import autodiff
    from jax_moe_comm import nvshmem_backend as nb

    def plan(geo, ctx):
        return nb.Plan(geo, ctx=ctx, p2p=p2p, rank=0, layout={}, window_slots=None)

    weights = None
    if comm._phases.weights is not None:
        geo = comm._phases.weights.geo
        weights = autodiff.Phases(nb, plan(geo, WEIGHTS_EXCHANGE_CONTEXT), geo, "recv")
    comm._phases = autodiff.Phases(nb, plan(comm._geo, ROUND_TRIPS_CONTEXT), comm._geo, comm.combine_weights_at,
                                   weights=weights)
    return comm

"""Differential testing over the whole option space: one backend against the reference backend and the NumPy oracle.

A *draw* is a Setup (everything that is compiled: the config, the MoEComm options, where the weights go, fused or
split halves, the call pattern) and an Inputs (what one run feeds it: a seed, the routing's kind, how many tokens
count). Hypothesis draws them together (``draws``); draws that share a Setup share its compiled functions.

Each run compares the backend under test with

- the oracle (tests/oracle.py), for one round trip: the layout bit for bit (expert_x rows and scales up to the kept
  rows, group_sizes, row_origin), expert_counts and dropped_rows exactly, combine within the output dtype's
  tolerance; and the error the contract names, where it names one (capacity overflow, an id outside [-1, E));
- the reference backend with plain JAX AD, for the call patterns (a Python loop of layers, lax.scan of layers, each
  with or without jax.checkpoint and its policies, grad / value_and_grad, an optax train step, a decode step with a
  traced num_tokens): outputs, losses, gradients and updated parameters within tolerance.

    run_draw(draw, backend)    # one draw: None, or what differs
    replay(json_text, backend) # the draw a failure printed

On the GPU, tests/gpu/xla_differential.py runs the NVSHMEM backend this way (world 1 through XLA); on the CPU,
tests/test_differential.py runs a seeded sample with the reference backend's custom VJP under test.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import oracle
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc
from jax_moe_comm.launch import host_gather
from jax_moe_comm.quantize import quantize_rows

PAYLOADS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "quantize")  # quantize: bf16 x, fp8 rows
WEIGHTS_AT = ("combine", "dispatch", "combine_send", "combine_recv", "dispatch_send")  # the last three: split halves
PATTERNS = ("one", "loop", "scan", "train", "decode")
POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable, "dots": jax.checkpoint_policies.dots_saveable,
            "everything": jax.checkpoint_policies.everything_saveable}
ROUTINGS = ("uniform", "skewed", "one_hot", "dropped", "bad_id")  # bad_id: one id outside [-1, E) (one round trip)
# Relative error bounds (max |a - b| / max |b| for one round trip; norm ratios for the patterns), by output dtype.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
PATTERN_TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 8e-3}
# An fp8 pattern requantizes every layer's input, so a last-bit difference between the backends (a kernel's
# rounding, XLA's fusion) can flip fp8 roundings (3 mantissa bits) and move a small problem's gradients by percents:
# with one token, one expert and 3 layers in bf16, multiplying every layer's MoE output by 1 + 2**-10 already moves
# the experts' gradients 1.5-2.5%, by 1 + 2**-8 (one bf16 ulp) 2.6-2.7%. Such a pattern's bound per leaf is also
# twice the reference's own change under one ulp (a rounding difference in the forward and one in the backward).
SENSITIVITY_PERTURBATION = 2.0 ** -8


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a draw compiles. ``options``: MoEComm keyword arguments as (name, value) pairs ("window_slots": the
    max_symmetric_bytes that leaves the config a window of that many slots per source). ``remat``: a POLICIES key, or
    None for no jax.checkpoint; ``grad``: None, "grad" or "value_and_grad" (loop and scan); ``frozen_x``: the train
    step leaves x untrained (a frozen embedding: the first layer's dispatch is then not differentiated, and
    combine's gradient rule finishes its backward round trip)."""

    world: int
    payload: str
    out_dtype: str
    E: int
    K: int
    H: int
    T: int
    scale_block: int | None = None
    align: int = 1
    capacity: int | None = None
    capacity_factor: float | None = None
    overflow: str = "error"
    dp_size: int = 1
    weights_at: str = "combine"
    check_errors: Any = True
    options: tuple = ()
    pattern: str = "one"
    layers: int = 1
    remat: str | None = None
    grad: str | None = None
    frozen_x: bool = False
    capacity_per: str = "rank"

    @property
    def split(self) -> bool:
        return self.weights_at in ("combine_send", "combine_recv", "dispatch_send")

    def config(self) -> jmc.MoECommConfig:
        dtype = jnp.float8_e4m3fn if self.payload == "quantize" else self.payload
        return jmc.MoECommConfig(self.E, self.K, self.H, self.T, dtype=dtype, out_dtype=self.out_dtype,
                                 scale_block=self.scale_block, dp_size=self.dp_size, capacity=self.capacity,
                                 capacity_factor=self.capacity_factor, align=self.align, overflow=self.overflow,
                                 capacity_per=self.capacity_per)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What one run of a Setup gets: its seed, the routing's kind (ROUTINGS) and num_tokens ("full", "zero",
    "partial": drawn per DP group in [0, T])."""

    seed: int
    routing: str = "uniform"
    num_tokens: str = "full"


@dataclasses.dataclass(frozen=True)
class Draw:
    setup: Setup
    inputs: Inputs

    def to_json(self) -> str:
        return json.dumps({"setup": dataclasses.asdict(self.setup), "inputs": dataclasses.asdict(self.inputs)})

    @staticmethod
    def from_json(text: str) -> Draw:
        data = json.loads(text)
        setup = dict(data["setup"])
        setup["options"] = tuple(tuple(o) for o in setup["options"])
        return Draw(Setup(**setup), Inputs(**data["inputs"]))


# Draws the tester failed on the GPU, replayed by name before every sample (tests/gpu/xla_differential.py). The
# experts' gradients 4-5% from the reference (bound 4e-2) with x quantized to fp8, bf16 outputs, one token, one expert,
# three or four layers: the reference itself moves them 2.6-3.3% under SENSITIVITY_PERTURBATION (fp8 requantization),
# so fp8 patterns are bounded by their own sensitivity too.
REGRESSIONS = {
    "quantize bf16, E1 K1 T1, 3-layer loop: experts' gradients": (
        '{"setup": {"world": 1, "payload": "quantize", "out_dtype": "bfloat16", "E": 1, "K": 1, "H": 192, "T": 1, '
        '"scale_block": 64, "align": 16, "capacity": null, "capacity_factor": null, "overflow": "drop", "dp_size": 1, '
        '"weights_at": "combine", "check_errors": true, "options": [["low_latency_max_tokens", 1], '
        '["prereduce_min_tokens", 1]], "pattern": "loop", "layers": 3, "remat": null, "grad": "value_and_grad", '
        '"frozen_x": false}, "inputs": {"seed": 85257, "routing": "dropped", "num_tokens": "partial"}}'),
}


# The generator ----------------------------------------------------------------------------------------------
@st.composite
def setups(draw, world: int = 1, patterns: tuple[str, ...] = PATTERNS, small: bool = False) -> Setup:
    """A Setup for `world` ranks: every option with every other, within what the contract accepts. `small`: rows
    of at most 256 elements and at most 65 tokens (the CPU sample)."""
    # One round trip (checked against the oracle, errors included) as often as the other patterns together.
    pattern = draw(st.sampled_from(patterns if len(patterns) == 1 else
                                   ("one",) * (len(patterns) - 1) + tuple(p for p in patterns if p != "one")))
    payload = draw(st.sampled_from(PAYLOADS))
    fp8 = payload in ("float8_e4m3fn", "quantize")
    out_dtype = draw(st.sampled_from(("bfloat16", "float32") if fp8 or payload == "bfloat16" else
                                     ("float16", "float32") if payload == "float16" else ("float32",)))
    dp_size = draw(st.sampled_from([d for d in (1, 2) if world % d == 0]))
    L = draw(st.sampled_from((1, 1, 2, 4, 8)))  # local experts (1: E == world)
    E = L * world
    K = draw(st.integers(1, min(E, 8)))
    scale_block = draw(st.sampled_from((16, 32, 64, 128))) if fp8 else None
    if fp8:
        H = scale_block * draw(st.sampled_from((1, 2, 3) if small else (1, 2, 3, 6, 56)))
    else:  # 100, 2880: not multiples of 128
        H = draw(st.sampled_from((8, 64, 100, 128) if small else (8, 64, 100, 128, 256, 2880)))
    T = draw(st.sampled_from((1, 2, 5, 8, 16, 32, 63, 64, 65) + (() if small else (100, 128, 200))))
    align = draw(st.sampled_from((1, 1, 2, 4, 8, 16)))
    many = pattern != "one"  # the patterns compare with the reference backend: no expected failure
    overflow = draw(st.sampled_from(("drop",) if many else ("error", "drop")))
    capacity = capacity_factor = None
    size = draw(st.sampled_from(("worst", "explicit", "factor")))
    worst = jmc.MoECommConfig(E, K, H, T, dp_size=dp_size, align=align).worst_case_rows(world)
    capacity_per = draw(st.sampled_from(("rank", "rank", "expert")))
    if size == "explicit" and capacity_per == "expert":  # rows per expert, a multiple of align
        per_expert = max(1, (world // dp_size) * T // draw(st.sampled_from((1, 2, 3, 4, 8, 16))))
        capacity = -(-per_expert // align) * align
    elif size == "explicit":  # often a cut inside some expert's padded run
        capacity = max(1, worst // draw(st.sampled_from((1, 2, 3, 4, 8))) - draw(st.integers(0, 2 * align)))
    elif size == "factor":
        capacity_factor = draw(st.sampled_from((0.5, 1.0, 1.25, 2.0)))
    if many and overflow == "error":
        capacity = capacity_factor = None
    weights_at = draw(st.sampled_from(WEIGHTS_AT if pattern == "one" else ("combine", "dispatch")))
    options = {}
    for name, choices in (("prereduce_min_tokens", (T, T + 1, 64)), ("ids_first_min_tokens", (T, T + 1, 1024)),
                          ("low_latency_max_tokens", (0, T, max(T - 1, 0)))):
        value = draw(st.sampled_from(choices))
        if value != {"prereduce_min_tokens": 64, "ids_first_min_tokens": 1024, "low_latency_max_tokens": 0}[name]:
            options[name] = value
    max_sms = draw(st.sampled_from((None, None, 1, 3)))  # an SM budget: grids of at most that many blocks
    if max_sms is not None:
        options["max_sms"] = max_sms
    transport = draw(st.sampled_from(("stores", "stores", "staged", "window")))
    slots = -(-T // dp_size)
    if transport == "staged":
        options["staged"] = True
    elif transport == "window" and slots > 1:
        options["window_slots"] = draw(st.sampled_from(sorted({1, max(1, slots // 3), max(1, slots // 2),
                                                                slots - 1})))
    check_errors = draw(st.sampled_from((True, True, False))) if pattern == "one" else True
    layers, remat, grad, frozen_x = 1, None, None, False
    if pattern in ("loop", "scan"):
        layers = draw(st.integers(1, 4))
        remat = draw(st.sampled_from((None, "nothing", "dots", "everything")))
        grad = draw(st.sampled_from((None, "grad", "value_and_grad")))
    elif pattern in ("train", "decode"):
        layers = draw(st.integers(1, 3))
        remat = draw(st.sampled_from((None, "nothing"))) if pattern == "train" else None
        frozen_x = pattern == "train" and (dp_size > 1 or draw(st.booleans()))  # DP replicas' x must stay equal
    if pattern in ("decode",) and weights_at == "dispatch":
        weights_at = "combine"
    if fp8 and payload == "float8_e4m3fn" and (grad or pattern == "train"):
        payload = "quantize"  # gradients reach x through a quantizing dispatch (fp8 x has no gradient)
    return Setup(world, payload, out_dtype, E, K, H, T, scale_block, align, capacity, capacity_factor, overflow,
                 dp_size, weights_at, check_errors, tuple(sorted(options.items())), pattern, layers, remat, grad,
                 frozen_x, capacity_per)


@st.composite
def inputs(draw, setup: Setup) -> Inputs:
    routings = ROUTINGS if setup.pattern == "one" else ROUTINGS[:-1]
    return Inputs(draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(routings)),
                  draw(st.sampled_from(("full", "zero", "partial") if setup.pattern != "decode" else ("full",))))


def draws(world: int = 1, runs_per_setup: int = 1, patterns: tuple[str, ...] = PATTERNS, small: bool = False):
    """Lists of `runs_per_setup` Draws of one Setup (a compilation shared by its runs)."""
    return setups(world, patterns, small).flatmap(
        lambda s: st.lists(inputs(s), min_size=runs_per_setup, max_size=runs_per_setup).map(
            lambda runs: [Draw(s, i) for i in runs]))


def sample(world: int, setups_wanted: int, runs_per_setup: int, seed: int,
           patterns: tuple[str, ...] = PATTERNS, small: bool = False) -> list[list[Draw]]:
    """`setups_wanted` groups of `runs_per_setup` Draws, the same for the same arguments: hypothesis generates ten
    times as many (it starts from its simplest examples, and repeats some) and a seeded choice keeps a spread of the
    distinct ones."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    groups: list[list[Draw]] = []

    @hypothesis_seed(seed)
    @settings(max_examples=10 * setups_wanted, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(draws(world, runs_per_setup, patterns, small))
    def collect(group):
        groups.append(group)

    collect()
    unique = list({g[0].setup: g for g in groups}.values())  # hypothesis repeats its simple examples
    keep = np.random.default_rng(seed).choice(len(unique), min(setups_wanted, len(unique)), replace=False)
    return [unique[i] for i in sorted(keep)]


# Inputs as arrays -------------------------------------------------------------------------------------------
def _routing(rng, kind: str, rows: int, E: int, K: int) -> np.ndarray:
    """topk_ids [rows, K]: distinct experts per token (a repeated id is an error of its own, tested elsewhere)."""
    ids = np.argsort(rng.random((rows, E)), axis=1)[:, :K].astype(np.int32)
    if kind == "skewed":  # expert 0 in most tokens' first slot
        first = np.where(rng.random(rows) < 0.8, 0, ids[:, 0])
        rest = np.argsort(rng.random((rows, E)), axis=1)
        ids = np.stack([first] + [np.zeros(rows, np.int32)] * (K - 1), axis=1).astype(np.int32)
        for t in range(rows):
            others = [e for e in rest[t] if e != first[t]]
            ids[t, 1:] = others[:K - 1]
    elif kind == "one_hot":  # every token names expert `hot` in a random slot
        hot = int(rng.integers(E))
        for t in range(rows):
            if hot not in ids[t]:
                ids[t, rng.integers(K)] = hot
    elif kind == "dropped":  # random -1 slots
        ids = np.where(rng.random(ids.shape) < 0.3, -1, ids).astype(np.int32)
    elif kind == "bad_id":  # one id outside [-1, E), on a token that counts (token 0 of group 0)
        ids[0, K - 1] = E + int(rng.integers(0, 3))
    return ids


@dataclasses.dataclass
class Arrays:
    """One run's host arrays, per rank ([world * T, ...]; a DP group's ranks hold the same rows) and per group."""

    x: np.ndarray  # float32 (cast to the payload by the caller), or bf16 rows for quantize
    scales: np.ndarray | None
    ids: np.ndarray
    weights: np.ndarray
    num_tokens: np.ndarray  # [world]
    layer_ids: np.ndarray  # [layers, world * T, K]
    experts: np.ndarray  # [layers, E, H, H] float32
    router: np.ndarray  # [layers, H, E] float32
    target: np.ndarray  # [world * T, H] float32


def _per_group(a: np.ndarray, world: int, dp: int, T: int) -> np.ndarray:
    """Each DP group's first rank's rows, copied to the group's other ranks."""
    a = a.reshape((world // dp, dp, T) + a.shape[1:])
    return np.broadcast_to(a[:, :1], a.shape).reshape((world * T,) + a.shape[3:]).copy()


def make_arrays(setup: Setup, inp: Inputs) -> Arrays:
    s, rng = setup, np.random.default_rng(inp.seed)
    rows, dp = s.world * s.T, s.dp_size
    x = rng.standard_normal((rows, s.H)).astype(np.float32)
    scales = None
    if s.payload == "float8_e4m3fn":
        x = np.clip(x * 64, -448, 448)
        scales = (rng.random((rows, s.H // s.scale_block)) + 0.5).astype(np.float32)
    ids = _routing(rng, inp.routing, rows, s.E, s.K)
    weights = rng.random((rows, s.K)).astype(np.float32)
    counts = {"full": np.full(s.world, s.T), "zero": np.zeros(s.world),
              "partial": rng.integers(0, s.T + 1, s.world)}[inp.num_tokens].astype(np.int32)
    layer_ids = np.stack([_routing(rng, inp.routing, rows, s.E, s.K) for _ in range(s.layers)])
    x, ids, weights = (_per_group(a, s.world, dp, s.T) for a in (x, ids, weights))
    scales = None if scales is None else _per_group(scales, s.world, dp, s.T)
    layer_ids = np.stack([_per_group(a, s.world, dp, s.T) for a in layer_ids])
    counts = _per_group(counts.reshape(s.world, 1), s.world, dp, 1).reshape(s.world)
    experts = (rng.standard_normal((s.layers, s.E, s.H, s.H)) / np.sqrt(s.H)).astype(np.float32)
    router = (rng.standard_normal((s.layers, s.H, s.E)) / np.sqrt(s.H)).astype(np.float32)
    target = _per_group(rng.standard_normal((rows, s.H)).astype(np.float32), s.world, dp, s.T)
    return Arrays(x, scales, ids, weights, counts, layer_ids, experts, router, target)


# MoEComms -------------------------------------------------------------------------------------------------
def window_bound(cfg: jmc.MoECommConfig, world: int, slots: int, grad_dtype=None) -> int:
    """The max_symmetric_bytes that leaves `cfg` at `world` ranks a window of `slots` slots per source."""
    from jax_moe_comm import _native, nvshmem_backend

    shared = () if grad_dtype is None else (cfg.gradient_config(world, grad_dtype),)
    layout = nvshmem_backend.symmetric_layout(cfg, world, _native.measurement_build(), False, shared, slots)
    return sum(size for _, size in layout.values())


def make_comm(setup: Setup, mesh: Mesh, backend: str, custom_vjp: bool | None = None) -> jmc.MoEComm:
    cfg = setup.config()
    options = dict(setup.options)
    grad_dtype = jnp.bfloat16 if cfg.is_fp8 and (setup.grad or setup.pattern == "train") else None
    if "window_slots" in options:
        options["max_symmetric_bytes"] = window_bound(cfg, setup.world, options.pop("window_slots"), grad_dtype)
    return jmc.MoEComm(cfg, mesh, "ep", backend, custom_vjp=custom_vjp, grad_dtype=grad_dtype,
                       check_errors=setup.check_errors, **options)


# One round trip against the oracle --------------------------------------------------------------------------
def _stand_in_expert(rows, scales, out_dtype):
    """The expert of a one-round-trip draw: rows (dequantized for fp8) times 1.5, in the output dtype."""
    rows = rows.astype(jnp.float32)
    if scales is not None:
        rows = rows * jnp.repeat(scales, rows.shape[1] // scales.shape[1], axis=1)
    return (rows * 1.5).astype(out_dtype)


def _np_stand_in_expert(rows, scales, out_dtype):
    rows = rows.astype(np.float32)
    if scales is not None:
        rows = rows * np.repeat(scales, rows.shape[1] // scales.shape[1], axis=1)
    return (rows * np.float32(1.5)).astype(out_dtype)


def one_round_trip(comm: jmc.MoEComm, setup: Setup):
    """A jitted shard_map of one round trip as the Setup says (fused calls, or the split halves with the weights at
    one of their places): (Dispatched, y)."""
    quantize = jnp.float8_e4m3fn if setup.payload == "quantize" else None
    out_dtype = comm.cfg.out_dtype

    def shard(x, ids, scales, n, w):
        n = n.reshape(())
        at = setup.weights_at
        if not setup.split:
            d = comm.dispatch(x, ids, scales, n, w if at == "dispatch" else None, quantize)
            y = _stand_in_expert(d.expert_x, d.expert_scales, out_dtype)
            return d, comm.combine(y, d.handle, None if at == "dispatch" else w)
        p = comm.dispatch_send(x, ids, scales, n, w if at == "dispatch_send" else None, quantize)
        d = comm.dispatch_recv(p)
        y = _stand_in_expert(d.expert_x, d.expert_scales, out_dtype)
        q = comm.combine_send(y, d.handle, w if at == "combine_send" else None)
        return d, comm.combine_recv(q, w if at == "combine_recv" else None)

    lift = lambda tree: jax.tree.map(lambda a: a.reshape(1) if a.ndim == 0 else a, tree)  # noqa: E731
    return jax.jit(jax.shard_map(lambda *a: lift(shard(*a)), mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))


EP = P("ep")


def _global(mesh: Mesh, a: np.ndarray | None, spec: P = EP):
    if a is None:
        return None
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])


def _expected_one(setup: Setup, arr: Arrays):
    """The oracle's layout per rank, combine [world, T, H], expert counts [E], and the contract's error text (or
    None)."""
    s, cfg = setup, setup.config()
    G, T = s.world // s.dp_size, s.T
    x, scales = arr.x, arr.scales
    if s.payload == "quantize":
        q, qs = quantize_rows(jnp.asarray(x, jnp.bfloat16), cfg.scale_block)
        x, scales = np.asarray(q), np.asarray(qs)
    else:
        x = np.asarray(jnp.asarray(x, cfg.dtype))
    first = np.arange(G) * s.dp_size * T  # each group's first rank's rows
    group = lambda a: np.stack([a[f:f + T] for f in first]) if a is not None else None  # noqa: E731
    counts = arr.num_tokens[::s.dp_size]
    capacity, per_expert = cfg.capacity_for(s.world), cfg.expert_capacity_for(s.world)
    layouts = oracle.dispatch(group(x), group(arr.ids), counts, group(scales), world=s.world, dp_size=s.dp_size,
                              num_experts=s.E, align=s.align, capacity=capacity, expert_capacity=per_expert)
    live = np.zeros(s.E, np.int64)
    for g in range(G):
        for t in range(int(counts[g])):
            for k in range(s.K):
                if oracle.routed(group(arr.ids), g, t, k) and group(arr.ids)[g, t, k] < s.E:
                    live[group(arr.ids)[g, t, k]] += 1
    error = None
    bad = oracle.routing_error(group(arr.ids), counts, s.E)
    if bad == "outside":
        error = "is outside [-1, num_experts)"
    elif s.overflow == "error" and (any(lay.rows_needed > capacity for lay in layouts)
                                    or (per_expert is not None and (live > per_expert).any())):
        error = "capacity"
    expert_y = np.stack([_np_stand_in_expert(lay.expert_x, lay.expert_scales, np.dtype(s.out_dtype))
                         for lay in layouts])
    y = oracle.combine(expert_y, layouts, group(arr.ids), arr.weights.reshape(s.world, T, s.K), counts,
                       dp_size=s.dp_size, num_experts=s.E, out_dtype=np.dtype(s.out_dtype))
    return layouts, y, live, error


def check_one(setup: Setup, arr: Arrays, got) -> str | None:
    """What one round trip's results (Dispatched, y, both global) differ in from the oracle, or None."""
    s, cfg = setup, setup.config()
    layouts, want_y, live, error = _expected_one(setup, arr)
    d, y = got
    if error is not None:  # the contract's error: NaN everywhere (raised by the caller's check, see run_inputs)
        y = np.asarray(y, np.float32)
        return None if np.isnan(y).all() else f"expected a failed round trip ({error}), got finite outputs"
    L, capacity = s.E // s.world, cfg.capacity_for(s.world)
    sizes = np.asarray(d.group_sizes).reshape(s.world, L)
    origin = np.asarray(d.handle.row_origin).reshape(s.world, capacity)
    expert_x = np.asarray(d.expert_x).reshape((s.world, capacity, s.H))
    for r, lay in enumerate(layouts):
        end = np.cumsum(lay.group_sizes)
        kept = np.clip(end, 0, capacity) - np.clip(end - lay.group_sizes, 0, capacity)
        if not np.array_equal(sizes[r], kept):
            return f"rank {r}: group_sizes {sizes[r].tolist()}, the oracle's {kept.tolist()}"
        if not np.array_equal(origin[r], lay.row_origin):
            bad = np.flatnonzero(origin[r] != lay.row_origin)[:4]
            return f"rank {r}: row_origin differs at rows {bad.tolist()}"
        used = int(kept.sum())
        if not np.array_equal(expert_x[r, :used].view(np.uint8), lay.expert_x[:used].view(np.uint8)):
            bad = np.flatnonzero((expert_x[r, :used] != lay.expert_x[:used]).any(axis=1))[:4]
            return f"rank {r}: expert_x rows {bad.tolist()} differ"
        if cfg.is_fp8:
            scales = np.asarray(d.expert_scales).reshape(s.world, capacity, -1)
            if not np.array_equal(scales[r, :used], lay.expert_scales[:used]):
                return f"rank {r}: expert_scales differ"
        dropped = int(np.asarray(d.dropped_rows).reshape(s.world)[r])
        want_dropped = int(live[r * L:(r + 1) * L].sum()) - int((lay.row_origin >= 0).sum())  # token rows cut
        if dropped != want_dropped:
            return f"rank {r}: dropped_rows {dropped}, the oracle's {want_dropped}"
    counts = np.asarray(d.expert_counts).reshape(-1, s.E)
    if not (counts == live).all():
        return f"expert_counts {counts[0].tolist()}, the oracle's {live.tolist()}"
    y32, want32 = np.asarray(y, np.float32).reshape(want_y.shape), want_y.astype(np.float32)
    if not np.isfinite(y32).all():
        return "non-finite outputs"
    err = float(np.abs(y32 - want32).max() / max(np.abs(want32).max(), 1e-30)) if want32.size else 0.0
    if err > TOLERANCE[s.out_dtype]:
        return f"combine relative error {err:.2e} > {TOLERANCE[s.out_dtype]}"
    return None


# The call patterns against the reference backend --------------------------------------------------------------
def _layer(comm: jmc.MoEComm, setup: Setup, perturb: float, x, ids, router, experts, n):
    """One residual MoE layer per shard: weights from a float32 router at the given ids (no discrete choice, so both
    backends route alike), experts tanh(ragged_dot) in float32, x + combine (times 1 + perturb: see
    SENSITIVITY_PERTURBATION)."""
    cfg = comm.cfg
    logits = x @ router  # [T, E]
    w = jax.nn.softmax(jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=1), axis=1)
    quantize = jnp.float8_e4m3fn if setup.payload == "quantize" else None
    rows_in = x.astype(jnp.bfloat16 if quantize is not None else cfg.dtype)
    scales = None
    if setup.payload == "float8_e4m3fn":
        rows_in, scales = quantize_rows(x.astype(jnp.bfloat16), cfg.scale_block)
        scales = jax.lax.stop_gradient(scales)
    given = setup.weights_at == "dispatch"
    d = comm.dispatch(rows_in, ids, scales, n, w if given else None, quantize)
    rows = d.expert_x.astype(jnp.float32)
    if d.expert_scales is not None:
        rows = rows * jnp.repeat(d.expert_scales, cfg.scale_block, axis=1)
    y = jnp.tanh(jax.lax.ragged_dot(rows, experts, d.group_sizes, precision=jax.lax.Precision.HIGHEST))
    out = comm.combine(y.astype(cfg.out_dtype), d.handle, None if given else w).astype(jnp.float32)
    return x + (out * (1 + perturb) if perturb else out)


def _model(comm: jmc.MoEComm, setup: Setup, perturb: float = 0.0):
    """The per-shard model of a pattern: (x, layer_ids, router, experts, n) -> x after `layers` layers."""
    layer = functools.partial(_layer, comm, setup, perturb)
    if setup.remat is not None:
        layer = jax.checkpoint(layer, policy=POLICIES[setup.remat])

    def model(x, layer_ids, router, experts, n):
        n = n.reshape(())
        if setup.pattern == "scan":
            return jax.lax.scan(lambda x, p: (layer(x, *p, n), None), x, (layer_ids, router, experts))[0]
        for i in range(setup.layers):
            x = layer(x, layer_ids[i], router[i], experts[i], n)
        return x

    return model


SPECS = (P("ep"), P(None, "ep"), P(), P(None, "ep"), P("ep"))  # x, layer_ids, router, experts, num_tokens


def pattern_fn(comm: jmc.MoEComm, setup: Setup, perturb: float = 0.0):
    """The jitted function of a loop / scan / train / decode Setup, taking (x, layer_ids, router, experts, n, target)
    global arrays; returns a pytree of float arrays to compare. perturb: every layer's output times 1 + perturb."""
    model = _model(comm, setup, perturb)
    mapped = jax.shard_map(model, mesh=comm.mesh, in_specs=SPECS, out_specs=P("ep"))

    def loss(x, layer_ids, router, experts, n, target):
        return jnp.mean((mapped(x, layer_ids, router, experts, n) - target) ** 2)

    if setup.pattern == "decode":  # one compiled step, any num_tokens: the caller runs it with several
        return jax.jit(lambda x, layer_ids, router, experts, n, target: mapped(x, layer_ids, router, experts, n))
    if setup.pattern == "train":
        import optax

        # Plain SGD with momentum: an update proportional to the gradient (Adam's first step is its sign, which
        # turns a last-bit difference of a near-zero gradient into a whole step).
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))

        # Two steps in one jit (a loop of steps): with x frozen the first layer's dispatch has no gradient rule run.
        @jax.jit
        def train(x, layer_ids, router, experts, n, target):
            params = {"router": router, "experts": experts, **({} if setup.frozen_x else {"x": x})}
            state = opt.init(params)
            ids = layer_ids
            for _ in range(2):  # the second step's routing weights come from updated parameters
                value, grads = jax.value_and_grad(
                    lambda p, ids=ids: loss(p.get("x", x), ids, p["router"], p["experts"], n, target))(params)
                updates, state = opt.update(grads, state, params)
                params = optax.apply_updates(params, updates)
                # The routing is drawn data here; a model's comes from its router, which the step trained, so the
                # next step's routing depends on this step's parameters (0 * a parameter): with x frozen that is what
                # orders the next step's first dispatch after this step's round trips (docs/design.md, caveats).
                ids = layer_ids + (0 * jnp.sum(params["router"])).astype(layer_ids.dtype)
            return {"loss": value, **params}

        return train
    if setup.grad is not None:
        def grads(*args):
            value, (dx, d_router, d_experts) = jax.value_and_grad(loss, argnums=(0, 2, 3))(*args)
            out = {"dx": dx, "router": d_router, "experts": d_experts}
            return out if setup.grad == "grad" else {"loss": value, **out}

        return jax.jit(grads)
    return jax.jit(lambda x, layer_ids, router, experts, n, target: mapped(x, layer_ids, router, experts, n))


def pattern_args(mesh: Mesh, arr: Arrays, num_tokens: np.ndarray | None = None) -> tuple:
    n = arr.num_tokens if num_tokens is None else num_tokens
    return (_global(mesh, arr.x), _global(mesh, arr.layer_ids, P(None, "ep")), _global(mesh, arr.router, P()),
            _global(mesh, arr.experts, P(None, "ep")), _global(mesh, n), _global(mesh, arr.target))


def relative_errors(got, want) -> list[float]:
    """Per leaf: the norm of got - want over the norm of want."""
    return [float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
            / max(float(np.linalg.norm(np.asarray(b, np.float64))), 1e-30)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]


def compare_trees(got, want, tol: float, what: str, floors: list[float] | None = None) -> str | None:
    """None if every leaf of `got` is within `tol` of `want` (norm ratio), or within its floor (``floors``: per leaf,
    twice the reference's own change under SENSITIVITY_PERTURBATION), else what differs, with every leaf's error
    (and norm) for the diagnosis."""
    named = jax.tree_util.tree_flatten_with_path(got)[0]
    failed, report = None, []
    floors = floors or [0.0] * len(named)
    errors = relative_errors(got, want)
    for (path, a), b, err, floor in zip(named, jax.tree.leaves(want), errors, floors, strict=True):
        i = jax.tree_util.keystr(path) or "output"
        if not np.isfinite(np.asarray(a, np.float64)).all():
            return f"{what} {i}: non-finite values"
        scale = max(float(np.linalg.norm(np.asarray(b, np.float64))), 1e-30)
        bound = max(tol, 2 * floor)
        report.append(f"{i} {err:.1e} of {scale:.1e}" + (f" (bound {bound:.1e})" if bound > tol else ""))
        if err > bound and failed is None:
            failed = f"{what} {i}: relative error {err:.2e} > {bound:.1e}"
    return None if failed is None else f"{failed} (every leaf: {', '.join(report)})"


# Running draws ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Compiled:
    """A Setup's MoEComms and functions, reused by every run of the Setup."""

    setup: Setup
    mesh: Mesh
    backend: str
    comm: jmc.MoEComm
    fn: Any
    reference: jmc.MoEComm | None = None
    reference_fn: Any = None
    sensitivity_fn: Any = None  # fp8 patterns: the reference with every layer's output perturbed (see run_inputs)

    def close(self) -> None:
        self.comm.close()


def compile_setup(setup: Setup, mesh: Mesh, backend: str) -> Compiled:
    """The backend under test (``backend``: "nvshmem", or "reference" with the custom VJP) and, for the patterns, the
    reference backend with plain AD. A quantizing dispatch's gradient is straight through by contract (the custom
    VJP's), which plain AD through the quantizer is not: there the reference runs the custom VJP too."""
    custom = None if backend == "nvshmem" else True
    comm = make_comm(setup, mesh, backend, custom_vjp=custom)
    if setup.pattern == "one":
        return Compiled(setup, mesh, backend, comm, one_round_trip(comm, setup))
    reference = make_comm(setup, mesh, "reference", custom_vjp=setup.payload == "quantize")
    sensitivity = pattern_fn(reference, setup, SENSITIVITY_PERTURBATION) if setup.config().is_fp8 else None
    return Compiled(setup, mesh, backend, comm, pattern_fn(comm, setup), reference, pattern_fn(reference, setup),
                    sensitivity)


def _one_args(setup: Setup, mesh: Mesh, arr) -> list:
    """A single round trip's global arguments: x, ids, scales, num_tokens, weights."""
    x = arr.x.astype(jnp.bfloat16 if setup.payload == "quantize" else setup.config().dtype)
    return [_global(mesh, a) for a in (x, arr.ids, arr.scales, arr.num_tokens, arr.weights)]


def compile_ahead(c: Compiled, inp: Inputs) -> None:
    """Compiles a single-round-trip Setup for its runs' shapes now (every run of a Setup has the same). With several
    processes a first call that compiles can leave one process later than ``timeout_s`` behind another (processes
    sharing one GPU compile at different speeds), which the library rightly reports as a late peer; compiling first,
    then meeting at a barrier, makes the round trips' timing the kernels' alone."""
    if c.setup.pattern == "one":
        c.fn = c.fn.lower(*_one_args(c.setup, c.mesh, make_arrays(c.setup, inp))).compile()


def run_inputs(c: Compiled, inp: Inputs) -> str | None:
    """One run of a compiled Setup: None, or what differs."""
    setup, mesh = c.setup, c.mesh
    arr = make_arrays(setup, inp)
    tol = max(PATTERN_TOLERANCE[setup.out_dtype], PATTERN_TOLERANCE.get(setup.payload, 4e-2))
    if setup.pattern == "one":
        args = _one_args(setup, mesh, arr)
        error = _expected_one(setup, arr)[3]
        try:
            got = host_gather(c.fn(*args))
            if c.backend == "nvshmem" and setup.check_errors is not False:
                c.comm.check()  # raises a failure the device reported (routing errors: once)
        except jax.errors.JaxRuntimeError as exc:
            if error is None:
                return f"raised {type(exc).__name__}: {str(exc)[-300:]}"
            if error not in str(exc):
                return f"raised, but not the contract's error ({error}): {str(exc)[-300:]}"
            return None
        if error is not None and setup.check_errors is not False and c.backend == "reference":
            return f"the contract's error ({error}) was not raised"
        if error is not None and setup.check_errors is True and c.backend == "nvshmem":
            return f"the contract's error ({error}) was not raised by comm.check()"
        return check_one(setup, arr, got)
    if setup.pattern == "decode":
        rng = np.random.default_rng(inp.seed + 1)
        for _ in range(3):  # the same compiled step with other token counts
            n = _per_group(rng.integers(0, setup.T + 1, setup.world).reshape(setup.world, 1).astype(np.int32),
                           setup.world, setup.dp_size, 1).reshape(setup.world)
            args = pattern_args(mesh, arr, n)
            got, want = host_gather(c.fn(*args)), host_gather(c.reference_fn(*args))
            problem = compare_trees(got, want, tol, f"decode (num_tokens {n.tolist()})")
            if problem:
                return problem
        size = getattr(c.fn, "_cache_size", None)
        if size is not None and size() != 1:
            return f"the decode step compiled {size()} times"
        return None
    args = pattern_args(mesh, arr)
    got, want = host_gather(c.fn(*args)), host_gather(c.reference_fn(*args))
    floors = None if c.sensitivity_fn is None else relative_errors(host_gather(c.sensitivity_fn(*args)), want)
    if setup.dp_size > 1 and isinstance(got, dict) and "dx" in got:
        # A DP group's replicas hold the same tokens: the custom VJP guarantees their gradients' sum (the weights'
        # cotangent is shared out equally, see autodiff.py), which is what reaches anything computed before them.
        got["dx"], want["dx"] = (_group_sum(a, setup) for a in (got["dx"], want["dx"]))
    return compare_trees(got, want, tol, setup.pattern + (f" {setup.grad}" if setup.grad else ""), floors)


def _group_sum(dx: np.ndarray, setup: Setup) -> np.ndarray:
    """[world * T, H] -> [groups, T, H]: each DP group's replicas' rows summed."""
    return dx.reshape(setup.world // setup.dp_size, setup.dp_size, setup.T, -1).sum(axis=1)


def run_draw(draw: Draw, backend: str, mesh: Mesh | None = None) -> str | None:
    """One draw on its own (compiles its Setup): None, or what differs."""
    mesh = mesh or Mesh(np.array(jax.devices()[:draw.setup.world]), ("ep",))
    c = compile_setup(draw.setup, mesh, backend)
    try:
        return run_inputs(c, draw.inputs)
    finally:
        c.close()


if __name__ == "__main__":  # python tests/differential.py '<a draw's JSON>': the draw on CPU devices (reference)
    import sys

    problem = run_draw(Draw.from_json(sys.argv[1]), "reference")
    print(problem or "PASS")
    sys.exit(1 if problem else 0)

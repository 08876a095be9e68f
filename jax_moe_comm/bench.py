"""Dispatch + combine latency: this library's backends against XLA-collective baselines, side by side.

    python -m jax_moe_comm.bench --quick                                  # CPU, 8 simulated devices, seconds
    python -m jax_moe_comm.bench --backends reference,padded --configs v2lite --tokens 1,128
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.bench --json benchmarks/results/h200x2.json

Backends: ``nvshmem`` (MoEComm, CUDA kernels; one GPU per process, so through the launcher), ``reference``
(MoEComm, pure-JAX collectives), ``ragged`` (``baselines.ragged_*``: MaxText-style ``ragged_all_to_all``; not
implemented by XLA:CPU), ``padded`` (``baselines.padded_*``: ``all_to_all`` at worst-case capacity) and ``floor``
(the protocol's floor on NVLink, ffi/probe.cu: per direction one kernel that moves the T rows to the peer, fences,
signals and waits, with no routing and no layout; its result is not checked), ``floor_flagged`` (the same in words
that carry their own validity: no fence, no signal, twice the bytes; what a low-latency protocol would pay). Every
backend runs per shard inside ``jax.shard_map`` over the mesh axis "ep" of all devices, with the same inputs.

Configs (per rank: ``tokens`` rows of x; expert stand-in: dequantize, multiply by 2, cast to the combine dtype):

    r1      H 7168, E 256, K 8, dispatch float8_e4m3fn + float32 scales (block 128), combine bfloat16
    v2lite  H 2048, E 64,  K 6, bfloat16 both ways

Timing (DESIGN.md §8): one ``jit`` holds an unrolled chain of N round trips (a Python loop, N copies; round trip
i+1 dispatches ``x + 1e-3 * y_i``, so XLA can neither reorder nor overlap them). ``total_us`` = (time of the
N-chain - time of the 1-chain) / (N - 1), median over repeats (each program is timed with block_until_ready and
time.perf_counter; best of 3 calls when a call takes < 50 ms); each repeat draws a fresh uniform routing (distinct
top-k per token) on the host and uploads it before the clock starts. Programs are compiled and run once before
timing. ``dispatch_us`` / ``combine_us`` time a chain of dispatches (next x depends on the received rows) and a
chain of combines (next expert_y depends on y) the same way; null for nvshmem, whose protocol only allows
alternating halves. Each step includes the cheap elementwise dependency update (T x H elements). The expert
stand-in runs once per chain, in the first round trip (the one checked); later round trips combine its output with
one row replaced from their own dispatch's rows (data ties only: XLA may drop an optimization barrier and then merge
identical collectives; the bench refuses a chain that lost steps), so ``total_us`` is the round trip without expert
work.

Bandwidth: ``gbps = bytes / total_us``, with ``bytes`` the traffic of one round trip per rank, averaged over ranks
and repeats and counted from the routing (not from padding):

    rows  = number of (token, slot) pairs whose expert lives on another rank than the token
    bytes = rows * (H * payload_itemsize + 4 * H / scale_block)    # dispatch (scales: fp8 only)
          + rows * H * combine_itemsize                            # combine
    bytes /= world

A backend that cannot run a size (not implemented on the platform, out of memory, wrong result, ...) gets an
``error`` string in its row instead of stopping the run. The first repeat's round trip of each backend is checked
against the reference backend (or, without it, a NumPy brute force): relative error < 2e-2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import _native, baselines, nvshmem_backend
from jax_moe_comm._cli import prepare_process
from jax_moe_comm.launch import initialize_distributed

AXIS = "ep"
ALL_BACKENDS = ("nvshmem", "nvshmem_unchecked", "reference", "ragged", "padded", "floor", "floor_flagged")
UNCHECKED = "nvshmem_unchecked"  # MoEComm(backend="nvshmem", check_errors=False): the price of the default check
PROBES = ("floor", "floor_flagged")  # not round trips: run only when named, their results not checked
EPS = 1e-3  # weight of the previous output in the next input of a chain
TOLERANCE = 2e-2
NVSHMEM_MIN_HEAP = 1 << 30
COMPILE_THREADS = max(1, min(6, (os.cpu_count() or 1) // 4))  # XLA compiles use several cores each
FP8 = np.dtype(jnp.float8_e4m3fn)
BF16 = np.dtype(jnp.bfloat16)
Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One MoE layer's communication shape (per rank: ``tokens`` rows, set per run)."""

    name: str
    hidden: int
    experts: int
    topk: int
    dtype: np.dtype  # dispatch payload
    combine_dtype: np.dtype  # expert_y and the output
    scale_block: int | None = None  # fp8 only

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def scale_cols(self) -> int:
        return self.hidden // self.scale_block if self.is_fp8 else 0

    def moe_config(self, tokens: int) -> jax_moe_comm.MoECommConfig:
        return jax_moe_comm.MoECommConfig(
            num_experts=self.experts, experts_per_token=self.topk, hidden=self.hidden, max_tokens=tokens,
            dtype=self.dtype, scale_block=self.scale_block, out_dtype=self.combine_dtype)

    def describe(self) -> dict:
        return {"hidden": self.hidden, "experts": self.experts, "topk": self.topk, "dtype": self.dtype.name,
                "combine_dtype": self.combine_dtype.name, "scale_block": self.scale_block}


CONFIGS = {
    "r1": BenchConfig("r1", 7168, 256, 8, FP8, BF16, 128),
    "v2lite": BenchConfig("v2lite", 2048, 64, 6, BF16, BF16),
}
# --quick: the same shapes of traffic, small enough for CPU tests (E divisible by up to 16 devices).
QUICK_CONFIGS = {
    "r1": BenchConfig("r1", 256, 32, 8, FP8, BF16, 128),
    "v2lite": BenchConfig("v2lite", 128, 16, 6, BF16, BF16),
}
DEFAULT_TOKENS = (1, 8, 128, 512, 4096)
# A chain of 4: the timed difference is 3 round trips, so a busy CPU's jitter cannot make it negative as easily.
QUICK = {"tokens": (8,), "chain": 4, "repeats": 2}


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------


def seeded(*keys: int) -> np.random.Generator:
    return np.random.default_rng(list(keys))


def make_tokens(rng: np.random.Generator, cfg: BenchConfig, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Host x [rows, H] in the payload dtype and, for fp8, float32 block scales [rows, H // B]."""
    x = rng.standard_normal((rows, cfg.hidden), np.float32)
    if not cfg.is_fp8:
        return x.astype(cfg.dtype), None
    blocks = x.reshape(rows, cfg.scale_cols, cfg.scale_block)
    scales = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / 448.0
    quantized = (blocks / scales[:, :, None]).reshape(rows, cfg.hidden).astype(FP8)
    return quantized, scales.astype(np.float32)


def make_routing(rng: np.random.Generator, cfg: BenchConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform routing: each token picks topk distinct experts; weights are positive and sum to 1 per token."""
    ids = np.argpartition(rng.random((rows, cfg.experts)), cfg.topk - 1, axis=1)[:, :cfg.topk].astype(np.int32)
    weights = rng.random((rows, cfg.topk)).astype(np.float32) + 0.1
    return ids, weights / weights.sum(axis=1, keepdims=True)


def remote_rows(ids: np.ndarray, experts: int, world: int) -> int:
    """(token, slot) pairs, over all ranks, whose expert lives on another rank than the token."""
    tokens = ids.shape[0] // world
    src = np.arange(ids.shape[0])[:, None] // tokens
    return int(np.sum((ids >= 0) & (ids // (experts // world) != src)))


def round_trip_bytes(cfg: BenchConfig, ids: np.ndarray, world: int) -> float:
    """Bytes one rank moves per round trip, averaged over ranks (see the module docstring)."""
    rows = remote_rows(ids, cfg.experts, world)
    dispatch = rows * (cfg.hidden * cfg.dtype.itemsize + 4 * cfg.scale_cols)
    return (dispatch + rows * cfg.hidden * cfg.combine_dtype.itemsize) / world


def expert_stand_in(cfg: BenchConfig, rows: Array, scales: Array | None = None) -> Array:
    """The experts' cheap elementwise stand-in: 2 * dequantized rows, in the combine dtype."""
    r = rows.astype(jnp.float32)
    if scales is not None:
        n = rows.shape[0]
        r = (r.reshape(n, cfg.scale_cols, cfg.scale_block) * scales[:, :, None]).reshape(n, cfg.hidden)
    return (2.0 * r).astype(cfg.combine_dtype)


def expected_round_trip(cfg: BenchConfig, x: np.ndarray, scales: np.ndarray | None, ids: np.ndarray,
                        weights: np.ndarray) -> np.ndarray:
    """NumPy brute force: y[t] = sum_k w[t, k] * expert_stand_in(x[t]) (float32, -1 slots skipped)."""
    r = x.astype(np.float32)
    if scales is not None:
        r = (r.reshape(len(r), cfg.scale_cols, cfg.scale_block) * scales[:, :, None]).reshape(r.shape)
    e = (2.0 * r).astype(cfg.combine_dtype).astype(np.float32)
    w = np.where(ids >= 0, weights, 0.0).sum(axis=1, dtype=np.float32)
    return e * w[:, None]


# ----------------------------------------------------------------------------------------------------------------
# Backends: per-shard dispatch -> (rows, row_scales, aux) and combine(expert_y, aux, w) -> y
# ----------------------------------------------------------------------------------------------------------------


class Impl:
    """One backend for one (config, tokens): per-shard halves with a common shape."""

    name = ""
    halves = True  # whether dispatch and combine may run (and be timed) on their own

    def dispatch(self, x, scales, ids, w):
        raise NotImplementedError

    def combine(self, expert_y, aux, w):
        raise NotImplementedError

    def close(self) -> None:
        pass


class CommImpl(Impl):
    """MoEComm, backend "nvshmem" or "reference"; "nvshmem_unchecked": nvshmem with check_errors=False."""

    def __init__(self, name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, check_errors: bool,
                 weights_to: str = "combine") -> None:
        self.name = name
        backend = "nvshmem" if name == UNCHECKED else name
        self.halves = backend != "nvshmem"
        self.weights_to = weights_to  # "dispatch": the weights go with dispatch, combine takes none
        self.comm = jax_moe_comm.MoEComm(cfg.moe_config(tokens), mesh, AXIS, backend=backend,
                                         check_errors=check_errors and name != UNCHECKED)

    def dispatch(self, x, scales, ids, w):
        d = self.comm.dispatch(x, ids, scales, topk_weights=w if self.weights_to == "dispatch" else None)
        return d.expert_x, d.expert_scales, (d.group_sizes, d.handle)

    def combine(self, expert_y, aux, w):
        return self.comm.combine(expert_y, aux[1], None if self.weights_to == "dispatch" else w)

    def close(self) -> None:
        self.comm.close()


class BaselineImpl(Impl):
    """baselines.ragged_* or baselines.padded_*."""

    def __init__(self, name: str, cfg: BenchConfig) -> None:
        self.name = name
        self.cfg = cfg
        self._dispatch = getattr(baselines, f"{name}_dispatch")
        self._combine = getattr(baselines, f"{name}_combine")

    def dispatch(self, x, scales, ids, w):
        d = self._dispatch(x, ids, num_experts=self.cfg.experts, axis_name=AXIS, scales=scales)
        return d.expert_x, d.expert_scales, d

    def combine(self, expert_y, aux, w):
        return self._combine(expert_y, aux, w, axis_name=AXIS, out_dtype=self.cfg.combine_dtype)


class FloorImpl(Impl):
    """The protocol's floor on this machine (ffi/probe.cu): each direction one kernel that stores the T rows (x,
    then the expert outputs) into the peer, fences, signals and waits, and copies what landed into its result, with
    no routing and no layout. The chain and its glue are the other backends'; its result is no round trip's (not
    checked). Only with the NVSHMEM backend (NVLink). flagged: the bytes in words that carry their own validity, no
    fence and no signal ("floor_flagged")."""

    halves = False

    def __init__(self, cfg: BenchConfig, tokens: int, mesh: Mesh, flagged: bool = False) -> None:
        self.name = "floor_flagged" if flagged else "floor"
        self.comm = jax_moe_comm.MoEComm(cfg.moe_config(tokens), mesh, AXIS, backend="nvshmem", check_errors=False)
        plan = self.comm._plan
        if not plan.p2p:
            self.comm.close()
            raise RuntimeError("the floor probe needs NVLink stores to every peer")
        self._probe = lambda a: nvshmem_backend.probe_exchange(plan, a, flagged)  # per shard, as every Impl's

    def dispatch(self, x, scales, ids, w):
        return self._probe(x), scales, None

    def combine(self, expert_y, aux, w):
        return self._probe(expert_y)

    def close(self) -> None:
        self.comm.close()


def make_impl(name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, check_errors: bool = True,
              weights_to: str = "combine") -> Impl:
    if name in PROBES:
        return FloorImpl(cfg, tokens, mesh, flagged=name == "floor_flagged")
    if name in ("nvshmem", UNCHECKED, "reference"):
        return CommImpl(name, cfg, tokens, mesh, check_errors, weights_to)
    return BaselineImpl(name, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Chains: n steps in one jit, each step's input depending on the previous step's output
# ----------------------------------------------------------------------------------------------------------------


def _step(a: Array, b: Array, extra: Array | float = 0.0) -> Array:
    """a + EPS * (b[:len(a)] + extra) in float32, back in a's dtype (the cheap dependency between chained steps)."""
    return (a.astype(jnp.float32) + EPS * (b[: a.shape[0]].astype(jnp.float32) + extra)).astype(a.dtype)


def _touch(tree) -> Array:
    """A float32 scalar that depends on every leaf of `tree` (so XLA keeps every output of a dispatch)."""
    return sum((jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree)), jnp.float32(0))


def _metadata(aux) -> list:
    """The small leaves of a dispatch's aux (routing metadata), without the payload rows."""
    if isinstance(aux, (baselines.RaggedDispatched, baselines.PaddedDispatched)):
        aux = dataclasses.replace(aux, expert_x=None, expert_scales=None)
    return jax.tree.leaves(aux)


def _set_leading_rows(a: Array, rows: Array) -> Array:
    """a with its first rows.shape[0] rows replaced by rows. A dynamic_update_slice: ``a.at[:n].set(rows)`` lowers to
    a scatter, and where n is all of a's rows to one whose indices are an empty constant, which XLA:GPU (jax 0.11.2)
    died compiling inside shard_map (the floor's chain at one token per rank; benchmarks/NOTES.md, entry 25)."""
    return jax.lax.dynamic_update_slice_in_dim(a, rows, 0, axis=0)


def round_trip_chain(impl: Impl, cfg: BenchConfig, n: int) -> Callable:
    """n round trips, each tied to the last by data (never by an optimization barrier alone: XLA may drop a
    barrier before it merges identical collectives, and the chain then runs as one round trip). Only the first runs
    the expert stand-in (its result is the one checked); later ones combine that same expert_y with one row replaced
    from their own dispatch's rows and scales (an in-place one-row update, not a pass over the receive buffer). The
    next dispatch takes x + EPS * y (every element of y read, as a residual add reads it) and scales updated from
    y likewise, so no two collectives of the chain have the same inputs."""

    def body(x, scales, ids, w):
        y = expert_y = None
        for _ in range(n):
            rows, row_scales, aux = impl.dispatch(x, scales, ids, w)
            if expert_y is None:
                expert_y = expert_stand_in(cfg, rows, row_scales)
            else:  # combine starts after this dispatch has delivered its rows (and their scales)
                extra = 0.0 if row_scales is None else row_scales[:1, :1]
                expert_y = _set_leading_rows(expert_y, _step(expert_y[:1], rows[:1], extra))
            y = impl.combine(expert_y, aux, w)
            x = _step(x, y)
            if scales is not None:
                scales = _step(scales, y[:, : scales.shape[1]])
        return x, y

    return body


def dispatch_chain(impl: Impl, cfg: BenchConfig, n: int) -> Callable:
    def body(x, scales, ids, w):
        for _ in range(n):
            rows, row_scales, aux = impl.dispatch(x, scales, ids, w)
            extra = 1e-9 * _touch(_metadata(aux))
            if row_scales is not None:
                extra = extra + 1e-9 * jnp.sum(row_scales[: x.shape[0]])
            x = _step(x, rows, extra)
        return x

    return body


def combine_chain(impl: Impl, cfg: BenchConfig, n: int) -> Callable:
    def body(x, scales, ids, w):
        rows, row_scales, aux = impl.dispatch(x, scales, ids, w)  # once, outside the chain
        expert_y = expert_stand_in(cfg, rows, row_scales)
        y = None
        for _ in range(n):
            y = impl.combine(expert_y, aux, w)
            expert_y = _set_leading_rows(expert_y, _step(expert_y[: y.shape[0]], y))
        return y, expert_y

    return body


def lower_chain(body: Callable, mesh: Mesh, args: tuple):
    """jit(shard_map(body)) over the EP axis, every argument and result sharded by rows, lowered for `args`."""
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))).lower(*args)


# A collective, or one of this package's FFI calls, in a compiled program's optimized HLO.
_COMMUNICATION_OP = re.compile(
    r"\b(?:ragged-all-to-all|all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?:-start)?\(|"
    r'custom_call_target="jmc_')


def communication_ops(compiled) -> int:
    """How many communication ops XLA kept in a compiled chain (each round trip has at least one per direction)."""
    return len(_COMMUNICATION_OP.findall(compiled.as_text()))


def merged_steps(pair, n: int, per_step: int) -> str | None:
    """Why a compiled (1-chain, n-chain) pair cannot time one step: XLA merged or dropped chained steps."""
    one, many = (communication_ops(fn) for fn in pair)
    if many - one >= per_step * (n - 1):
        return None
    return (f"XLA merged chained steps: {many} communication ops in the {n}-chain, {one} in the 1-chain "
            f"(expected at least {per_step} more per step)")


def timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def best_time(fn, args, short_s: float = 0.05) -> float:
    """Seconds of one call; the best of three when a call is short (host jitter only ever adds time)."""
    t = timed(fn, args)
    return min(t, timed(fn, args), timed(fn, args)) if t < short_s else t


def per_step_us(pair, args, n: int) -> float:
    """(time of the n-chain - time of the 1-chain) / (n - 1), in microseconds."""
    one, many = pair
    t1 = best_time(one, args)
    tn = best_time(many, args)
    return (tn - t1) / (n - 1) * 1e6


# ----------------------------------------------------------------------------------------------------------------
# Multi-process helpers: every process makes the same calls in the same order
# ----------------------------------------------------------------------------------------------------------------


def all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([int(ok)], np.int32))))


def global_sum(values: Sequence[float]) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values.astype(np.float32))).reshape(-1, len(values)).sum(0)


def to_global(host: np.ndarray | None, mesh: Mesh) -> Array | None:
    if host is None:
        return None
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(AXIS)), lambda index: host[index])


def local_rows(array: Array) -> list[tuple[slice, np.ndarray]]:
    """(row slice, host data) of each addressable shard of a row-sharded global array."""
    return [(shard.index[0], np.asarray(shard.data)) for shard in array.addressable_shards]


def relative_error(actual: Array, expected_host: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| over the whole global array (each process adds its own rows)."""
    num = den = 0.0
    for rows, data in local_rows(actual):
        want = expected_host[rows].astype(np.float64)
        num += float(np.sum((data.astype(np.float64) - want) ** 2))
        den += float(np.sum(want**2))
    num, den = global_sum([num, den])
    return float(np.sqrt(num / max(den, 1e-300)))


def short_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for marker in ("UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "Out of memory", "out of memory"):
        if marker in text:
            text = text[text.index(marker):]
            break
    return f"{type(exc).__name__}: {text[:400]}"


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    backend: str
    config: str
    tokens: int
    dispatch_us: float | None = None
    combine_us: float | None = None
    total_us: float | None = None
    total_us_each: list[float] | None = None  # every repeat's round trip (total_us is their median): the spread
    gbps: float | None = None
    bytes: float | None = None
    rel_err: float | None = None
    error: str | None = None
    note: str | None = None  # e.g. a time below this machine's timing resolution

    def record(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("error", "note")}
        for key in ("dispatch_us", "combine_us", "total_us", "gbps", "bytes"):
            if out[key] is not None:
                out[key] = round(out[key], 3)
        if out["total_us_each"] is not None:
            out["total_us_each"] = [round(t, 3) for t in out["total_us_each"]]
        if self.error:
            out["error"] = self.error
        if self.note:
            out["note"] = self.note
        return out


def median_or_none(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def timing_note(repeats: list[float], n: int) -> str | None:
    """What a row's repeats say about the timing itself: a repeat at or below zero is one where the n-chain took no
    longer than the 1-chain, so the host's jitter (or the processes' skew at a call's start) was larger than n - 1
    round trips; the median is then kept as measured, and a longer chain (--chain) is the way to a firmer time."""
    low = sum(t <= 0 for t in repeats)
    if not low:
        return None
    if statistics.median(repeats) <= 0:
        return (f"below this machine's timing resolution: the {n}-chain took no longer than the 1-chain "
                "(a busy CPU's jitter exceeds the round trip)")
    return (f"{low} of {len(repeats)} repeats at or below zero: the jitter between calls exceeds {n - 1} round "
            "trips, so this median is loose; a longer --chain firms it")


class Progress:
    """tqdm on stderr when installed and stderr is a terminal (else one line per step); silent on processes other
    than 0."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def bench_backend(name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, inputs: dict, args,
                  expected_y: dict) -> Row:
    """Times one backend at one size. Every process takes the same path (agreeing on failures)."""
    row = Row(name, cfg.name, tokens)
    world = mesh.size
    n = args.chain
    impl = None
    try:
        impl = make_impl(name, cfg, tokens, mesh, args.check_errors, args.weights_to)
        error = None
    except Exception as exc:  # noqa: BLE001 (reported in the row)
        error = short_error(exc)
    if not all_processes_ok(error is None):
        row.error = error or "failed on another process"
        return row

    routing = inputs["routing"]
    x, scales = inputs["x"], inputs["scales"]

    def device_args(r):
        ids, w = routing(r)
        return (x, scales, to_global(ids, mesh), to_global(w, mesh))

    args0 = device_args(0)
    builders = {"total": round_trip_chain}
    if impl.halves and args.halves:
        builders.update(dispatch=dispatch_chain, combine=combine_chain)
    compiled, errors = {}, {}
    try:
        # Trace and lower one by one, then compile the (up to) six programs in parallel threads.
        lowered = {}
        for part, build in builders.items():
            try:
                lowered[part] = [lower_chain(build(impl, cfg, steps), mesh, args0) for steps in (1, n)]
            except Exception as exc:  # noqa: BLE001
                errors[part] = short_error(exc)
        with concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
            futures = {part: [pool.submit(lo.compile) for lo in pair] for part, pair in lowered.items()}
            for part, pair in futures.items():
                try:
                    compiled[part] = tuple(f.result() for f in pair)
                except Exception as exc:  # noqa: BLE001
                    errors[part] = short_error(exc)
        for part, pair in list(compiled.items()):  # a round trip sends both ways; a half, one way
            reason = merged_steps(pair, n, 2 if part == "total" else 1)
            if reason is not None:
                del compiled[part]
                errors[part] = reason
        for part in builders:  # every process must run the same programs
            if not all_processes_ok(part in compiled) and part in compiled:
                del compiled[part]
                errors[part] = "failed on another process"
        if "total" not in compiled:
            row.error = errors.get("total", "failed on another process")
            return row
        # Warm-up (first executions set up communicators) and the correctness check on repeat 0's routing.
        error = None
        try:
            for pair in compiled.values():
                for fn in pair:
                    jax.block_until_ready(fn(*args0))
            y = compiled["total"][0](*args0)[1]
        except Exception as exc:  # noqa: BLE001
            error = short_error(exc)
        if not all_processes_ok(error is None):
            row.error = error or "failed on another process"
            return row
        if name not in PROBES:  # a probe's result is the bytes moved, no round trip's: nothing to check
            if "reference" in expected_y and name != "reference":
                row.rel_err = relative_error(y, expected_y["reference"])
                against = "the reference backend"
            else:
                row.rel_err = relative_error(y, expected_y["numpy"])
                against = "the NumPy brute force"
            if name == "reference" and row.rel_err < TOLERANCE:
                host = np.zeros(y.shape, np.float32)  # only this process's rows are filled (and ever read)
                for rows, data in local_rows(y):
                    host[rows] = data
                expected_y["reference"] = host
            if not row.rel_err < TOLERANCE:
                errors["check"] = f"wrong result: relative error {row.rel_err:.2e} against {against}"
        del y

        times = {part: [] for part in compiled}
        nbytes = []
        error = None
        try:
            for r in range(args.repeats):
                dev = device_args(r) if r else args0  # uploaded before the clock starts
                jax.block_until_ready(dev)
                for part, pair in compiled.items():
                    times[part].append(per_step_us(pair, dev, n))
                nbytes.append(round_trip_bytes(cfg, routing(r)[0], world))
        except Exception as exc:  # noqa: BLE001
            error = short_error(exc)
        if not all_processes_ok(error is None):
            errors["run"] = error or "failed on another process"
        row.total_us = median_or_none(times.get("total", []))
        row.total_us_each = times.get("total") or None
        row.dispatch_us = median_or_none(times.get("dispatch", []))
        row.combine_us = median_or_none(times.get("combine", []))
        if nbytes and row.total_us:
            row.bytes = float(np.mean(nbytes))
            row.gbps = row.bytes / (row.total_us * 1e-6) / 1e9 if row.total_us > 0 else None
        row.note = timing_note(times.get("total", []), n)
        if errors:
            row.error = "; ".join(f"{part}: {text}" if part in ("dispatch", "combine") else text
                                  for part, text in errors.items())
        return row
    finally:
        if impl is not None:
            impl.close()


def available_backends(mesh: Mesh, nvshmem_reason: str | None) -> tuple[list[str], dict[str, str]]:
    """(backends that can run here, {backend: why not} for the others)."""
    why_not = {}
    if nvshmem_reason is not None:
        why_not.update(dict.fromkeys(("nvshmem", UNCHECKED, *PROBES), nvshmem_reason))
    # ragged_all_to_all: XLA:CPU cannot compile it; XLA:GPU with one GPU per process runs it only through its NCCL
    # send/recv fallback, which is off by default (the call fails at run time). Probe with a tiny round trip.
    error = None
    try:
        world = mesh.size
        cfg = BenchConfig("probe", 8, world, 1, np.dtype(np.float32), np.dtype(np.float32))
        args = (to_global(np.ones((world, 8), np.float32), mesh), None,
                to_global(((np.arange(world) + 1) % world).astype(np.int32).reshape(world, 1), mesh),
                to_global(np.ones((world, 1), np.float32), mesh))
        jax.block_until_ready(lower_chain(round_trip_chain(BaselineImpl("ragged", cfg), cfg, 1), mesh, args)
                              .compile()(*args))
    except Exception as exc:  # noqa: BLE001
        error = short_error(exc)
        if "fallback to NCCL" in error:
            error = ("XLA:GPU runs ragged_all_to_all across processes only through NCCL send/recv, which is off: "
                     "time it in one process (python -m jax_moe_comm.bench, all GPUs on one mesh), or allow it with "
                     "XLA_FLAGS=--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true (seen to hang on "
                     f"jax 0.11.2). {error}")
    if not all_processes_ok(error is None):
        why_not["ragged"] = error or "failed on another process"
    return [b for b in ALL_BACKENDS if b not in why_not], why_not


def start_nvshmem(wanted: bool, configs: list[BenchConfig], tokens: list[int], mesh: Mesh) -> str | None:
    """Initializes NVSHMEM (heap sized for the largest config) where it can run; returns why not, or None."""
    one_gpu = [d.platform for d in jax.local_devices()] == ["gpu"]
    if not wanted:
        return "not requested"
    if not (one_gpu and jax_moe_comm.build_info()["cuda"]):
        return _native.unavailable_reason(mesh) or "needs one GPU per process (python -m jax_moe_comm.launch)"
    heap = 0
    for cfg in configs:
        for t in tokens:
            try:
                comm = jax_moe_comm.MoEComm(cfg.moe_config(t), mesh, AXIS, backend="reference")
                heap = max(heap, comm.symmetric_bytes)
            except ValueError:
                pass
    heap = max(NVSHMEM_MIN_HEAP, int(heap * 1.25) + (256 << 20))
    try:
        jax_moe_comm.initialize(symmetric_size=heap)  # the first call fixes the heap size
    except Exception as exc:  # noqa: BLE001
        return short_error(exc)
    return _native.unavailable_reason(mesh)


def git_commit() -> str:
    if os.environ.get("JMC_COMMIT"):
        return os.environ["JMC_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line(argv: Sequence[str]) -> str:
    """The command that ran this (through the launcher: its command, rebuilt from the environment it sets)."""
    cmd = "-m jax_moe_comm.bench" + (" " + shlex.join(argv) if argv else "")
    if "JAX_PROCESS_ID" in os.environ:
        n = os.environ.get("JAX_LOCAL_WORLD", os.environ.get("JAX_NUM_PROCESSES", "?"))
        return f"python -m jax_moe_comm.launch -n {n} -- {cmd}"
    return f"python {cmd}"


def format_table(rows: list[dict]) -> str:
    """A plain-text table of the rows (times in microseconds)."""
    head = ("config", "tokens", "backend", "total_us", "dispatch_us", "combine_us", "GB/s", "error")

    def num(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [(r["config"], str(r["tokens"]), r["backend"], num(r["total_us"]), num(r.get("dispatch_us")),
              num(r.get("combine_us")), num(r.get("gbps"), 2), (r.get("error") or r.get("note") or "")[:70])
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if 2 < i < 7 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def plot_record(record: dict, path: str | Path) -> bool:
    """Latency vs tokens per backend, log-log, one panel per config; False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    configs = list(dict.fromkeys(r["config"] for r in record["rows"]))
    fig, axes = plt.subplots(1, max(1, len(configs)), figsize=(5.5 * max(1, len(configs)), 4.2), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=False):
        rows = [r for r in record["rows"] if r["config"] == config and r.get("total_us")]
        for backend in sorted(dict.fromkeys(r["backend"] for r in rows), key=ALL_BACKENDS.index):
            pts = sorted((r["tokens"], r["total_us"]) for r in rows if r["backend"] == backend and r["total_us"] > 0)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(config)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("dispatch + combine (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{record.get('device', '')}, world {record.get('world', '?')}, {record.get('date', '')[:10]}, "
                 f"commit {record.get('commit', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None,
                   help=f"comma-separated, of {','.join(ALL_BACKENDS)} (default: every one available here but the "
                        f"probes, {' and '.join(PROBES)}, and {UNCHECKED})")
    p.add_argument("--configs", default="r1,v2lite", help="comma-separated, of r1,v2lite (default both)")
    p.add_argument("--tokens", default=None,
                   help=f"tokens per rank, comma-separated (default {','.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--chain", type=int, default=None, help="round trips in the timed chain, >= 2 (default 20)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, each with a fresh routing (default 5)")
    p.add_argument("--seed", type=int, default=None, help="routing seed (default: random, shared by all processes)")
    p.add_argument("--no-halves", dest="halves", action="store_false",
                   help="skip timing dispatch and combine on their own (faster)")
    p.add_argument("--no-check", dest="check_errors", action="store_false",
                   help="MoEComm(check_errors=False): time without the per-round-trip error callback")
    p.add_argument("--weights-to", choices=("combine", "dispatch"), default="combine",
                   help="where the MoEComm backends get the top-k weights (default combine; dispatch: they go with "
                        "the tokens' ids, and the NVLink path's pre-reduced combine exchanges none)")
    p.add_argument("--json", default=None, help="write the record (see benchmarks/README.md) to this path")
    p.add_argument("--plot", default=None, help="write a PNG: latency vs tokens per backend, log-log")
    p.add_argument("--quick", action="store_true",
                   help="tiny hidden sizes and expert counts, 8 tokens, chain 2, 2 repeats (CPU tests)")
    args = p.parse_args(argv)
    quick = QUICK if args.quick else {}
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(quick.get("tokens", DEFAULT_TOKENS))
    args.chain = args.chain if args.chain is not None else quick.get("chain", 20)
    args.repeats = args.repeats if args.repeats is not None else quick.get("repeats", 5)
    table = QUICK_CONFIGS if args.quick else CONFIGS
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in table]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")
    args.config_list = [table[c] for c in names]
    if args.backends is not None:
        args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in args.backends if b not in ALL_BACKENDS]
        if unknown:
            p.error(f"unknown backend(s) {unknown}; choose from {list(ALL_BACKENDS)}")
    if args.chain < 2:
        p.error("--chain must be >= 2")
    if args.repeats < 1 or any(t < 1 for t in args.tokens):
        p.error("--repeats and --tokens must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    initialize_distributed()  # (0, 1) and nothing to do without the launcher
    leader = jax.process_index() == 0
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    world = mesh.size

    wants_nvshmem = args.backends is None or bool({"nvshmem", UNCHECKED, *PROBES} & set(args.backends))
    nvshmem_reason = start_nvshmem(wants_nvshmem, args.config_list, args.tokens, mesh)
    available, why_not = available_backends(mesh, nvshmem_reason)
    # The probes only when named: they are not round trips.
    backends = args.backends if args.backends is not None else [b for b in available if b not in (*PROBES, UNCHECKED)]
    # The reference backend first: the others are checked against its result.
    backends = sorted(backends, key=lambda b: b != "reference")
    if leader:
        for b, why in why_not.items():
            if why != "not requested":
                print(f"backend {b} unavailable: {why}", file=sys.stderr)

    seed = args.seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))
        if jax.process_count() > 1:
            seed = int(multihost_utils.broadcast_one_to_all(np.int32(seed)))

    device = jax.devices()[0]
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": f"{len(jax.devices())}x {device.device_kind if device.platform != 'cpu' else 'cpu'}",
        "world": world,
        "processes": jax.process_count(),
        "command": command_line(argv),
        "jax": jax.__version__,
        "chain": args.chain,
        "repeats": args.repeats,
        "check_errors": args.check_errors,
        "weights_to": args.weights_to,
        "seed": seed,
        "configs": {c.name: c.describe() for c in args.config_list},
        "complete": False,
        "rows": [],
    }

    def write_json() -> None:  # after every size too, so that an interrupted run keeps what it measured
        if leader and args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")

    progress = Progress(len(args.config_list) * len(args.tokens) * len(backends), leader)
    for ci, cfg in enumerate(args.config_list):
        for tokens in args.tokens:
            n_rows = world * tokens
            x_host, scales_host = make_tokens(seeded(seed, ci, tokens), cfg, n_rows)
            cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

            def routing(r, cfg=cfg, ci=ci, tokens=tokens, n_rows=n_rows, cache=cache):
                if r not in cache:
                    cache[r] = make_routing(seeded(seed, ci, tokens, r + 1), cfg, n_rows)
                return cache[r]

            inputs = {"x": to_global(x_host, mesh), "scales": to_global(scales_host, mesh), "routing": routing}
            ids0, w0 = routing(0)
            expected = {"numpy": expected_round_trip(cfg, x_host, scales_host, ids0, w0)}
            for name in backends:
                if name in why_not:
                    row = Row(name, cfg.name, tokens, error=f"unavailable: {why_not[name]}")
                elif cfg.experts % world:
                    row = Row(name, cfg.name, tokens, error=f"{cfg.experts} experts do not divide over {world} ranks")
                else:
                    row = bench_backend(name, cfg, tokens, mesh, inputs, args, expected)
                record["rows"].append(row.record())
                progress.step(f"{cfg.name} tokens={tokens} {name}: "
                              + (f"{row.total_us:.1f} us" if row.total_us is not None else "error"))
            del inputs, expected
            write_json()
    progress.close()

    record["complete"] = True
    write_json()
    if leader:
        print(f"jax_moe_comm bench: {record['device']}, world {world}, {jax.process_count()} process(es), "
              f"jax {jax.__version__}, chain {args.chain}, repeats {args.repeats}, seed {seed}")
        print(format_table(record["rows"]))
        if args.json:
            print(f"wrote {args.json}")
        if args.plot and plot_record(record, args.plot):
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

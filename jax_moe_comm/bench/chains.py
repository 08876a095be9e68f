"""Chains: n steps in one jit, each step's input depending on the previous step's output, and how they are timed."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm.layers import shared_expert

from . import baselines
from .configs import AXIS, EPS, Array, BenchConfig, expert_stand_in
from .impls import Impl


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


def _expert_again(cfg: BenchConfig) -> Callable:
    """(expert_y, rows, scales) -> expert_y, differentiated as expert_stand_in(cfg, rows, scales): a later step's
    expert output under grad. Its value is the first step's (no pass over the rows, and one buffer that every
    combine keeps as its residual, where an updated copy per step would be copied whole); its rows' cotangent is the
    stand-in's, over every row, as a layer's expert backward gives it (reading the whole weighted expert_dy)."""

    @jax.custom_vjp
    def again(expert_y, rows, scales):
        return expert_y

    def forward(expert_y, rows, scales):
        return expert_y, (rows, scales)

    def backward(residuals, ct):
        rows, scales = residuals
        _, stand_in_vjp = jax.vjp(lambda r: expert_stand_in(cfg, r, scales), rows)
        return None, stand_in_vjp(ct)[0], None

    again.defvjp(forward, backward)
    return again


def round_trip_chain(impl: Impl, cfg: BenchConfig, n: int, shared_ffn: int | None = None,
                     shared_at: str = "dispatch", differentiated: bool = False) -> Callable:
    """n round trips, each tied to the last by data (never by an optimization barrier alone: XLA may drop a
    barrier before it merges identical collectives, and the chain then runs as one round trip). Only the first runs
    the expert stand-in (its result is the one checked); later ones combine that same expert_y with one row replaced
    from their own dispatch's rows and scales (an in-place one-row update, not a pass over the receive buffer), or,
    `differentiated` (backward_chain's), with _expert_again's value (the same buffer, no copy) and gradient. The
    next dispatch takes x + EPS * y (every element of y read, as a residual add reads it) and scales updated from
    y likewise, so no two collectives of the chain have the same inputs. shared_ffn, shared_at: overlapped_chain's."""
    again = _expert_again(cfg) if differentiated else None

    def body(x, scales, ids, w):
        weights = None if shared_ffn is None else shared_expert_weights(cfg, shared_ffn)
        y = expert_y = first_y = shared = None

        def placed(pending):  # the shared expert between a send half and its receive
            return impl.between(pending, lambda h, sw: shared_expert(h.astype(jnp.bfloat16), sw), x, weights)

        for _ in range(n):
            if weights is not None and shared_at == "dispatch":
                pending = impl.dispatch_send(x, scales, ids, w)
                shared, pending = placed(pending)
                rows, row_scales, aux = impl.dispatch_recv(pending)
            else:
                rows, row_scales, aux = impl.dispatch(x, scales, ids, w)
            if expert_y is None:
                expert_y = first_y = expert_stand_in(cfg, rows, row_scales)
            elif again is not None:  # combine takes this dispatch's handle: it starts after this dispatch
                expert_y = again(first_y, rows, row_scales)
            else:  # combine starts after this dispatch has delivered its rows (and their scales)
                extra = 0.0 if row_scales is None else row_scales[:1, :1]
                expert_y = _set_leading_rows(expert_y, _step(expert_y[:1], rows[:1], extra))
            if weights is not None and shared_at == "combine":
                pending = impl.combine_send(expert_y, aux, w)
                shared, pending = placed(pending)
                y = impl.combine_recv(pending)
            else:
                y = impl.combine(expert_y, aux, w)
            x = _step(x, y) if weights is None else _step(x, y.astype(jnp.float32) + shared)
            if scales is not None:
                scales = _step(scales, y[:, : scales.shape[1]])
        return x, y

    return body


def backward_chain(impl: Impl, cfg: BenchConfig, n: int) -> Callable:
    """round_trip_chain's n round trips and their backward (jax.grad, with respect to the top-k weights): every
    round trip of the chain then has a backward round trip too (dy dispatched, the row gradients combined home; the
    first step's x depends on no weight, so its backward combine is one of zero rows). Returns (the chain's x, the
    weights' gradient), the latter the result the check compares. Each step's expert output is _expert_again's: no
    copy of expert_y per step, and the rows' cotangent whole, so a step's backward is what a layer's costs."""
    forward = round_trip_chain(impl, cfg, n, differentiated=True)

    def body(x, scales, ids, w):
        loss = lambda w: jnp.sum(forward(x, scales, ids, w)[0].astype(jnp.float32))  # noqa: E731
        return x, jax.grad(loss)(w)

    return body


def shared_expert_weights(cfg: BenchConfig, ffn: int) -> dict:
    """A shared expert of width ``ffn`` (bfloat16 [H, ffn], [H, ffn], [ffn, H]), drawn inside the program: once per
    call, so the per-step time (n-chain minus 1-chain) does not see it."""
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"gate": (cfg.hidden, ffn), "up": (cfg.hidden, ffn), "down": (ffn, cfg.hidden)}
    return {name: (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)
            for k, (name, shape) in zip(keys, shapes.items(), strict=True)}


def compute_chain(impl: Impl, cfg: BenchConfig, n: int, ffn: int) -> Callable:
    """n shared experts (layers.shared_expert: a SwiGLU of width ``ffn`` over the T tokens, in bfloat16), each on
    the last one's output: the compute ``overlapped_chain`` places between the split halves, timed alone."""

    def body(x, scales, ids, w):
        weights = shared_expert_weights(cfg, ffn)
        s = None
        for _ in range(n):
            s = shared_expert(x.astype(jnp.bfloat16), weights)
            x = _step(x, s)
        return x, s

    return body


def overlapped_chain(impl: Impl, cfg: BenchConfig, n: int, ffn: int, at: str = "dispatch") -> Callable:
    """round_trip_chain's n round trips with compute_chain's shared expert between the split halves of the dispatch
    (at="dispatch") or of the combine (at="combine"), placed there by MoEComm.between, as a layer places it (it
    reads x, not the rows in flight); the next step takes x + EPS * (y + the shared expert's output). Against the
    round trip and the compute timed alone, this says how much of the round trip the compute hides."""
    return round_trip_chain(impl, cfg, n, shared_ffn=ffn, shared_at=at)


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

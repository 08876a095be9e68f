"""Errors found on the device, raised to the user.

Every phase produces a status word ``int32[4] = {code, phase, detail_a, detail_b}`` (code 0 = fine) on the
device. Dispatch records its status in the handle and carries on, so that every rank still completes the round
trip (raising on one rank mid-protocol would leave its peers waiting); the combine that completes the round trip
raises, through a host callback, when any phase's code is non-zero. Inside ``jit`` the error surfaces as
``jax.errors.JaxRuntimeError`` whose message contains the text below, when the result is waited on (e.g.
``block_until_ready``). The device never writes out of bounds in the meantime: offending rows are dropped.
Both backends use this; the codes match ``ffi/context.h``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

BAD_EXPERT_ID = 1        # an id outside [-1, num_experts)
REPEATED_EXPERT_ID = 2   # one token names the same expert in two top-k slots
CAPACITY_OVERFLOW = 4    # the rows this rank receives exceed `capacity`
TIMEOUT = 8              # a peer never arrived (NVSHMEM backend)
OUT_OF_ORDER = 16        # a phase ran while the MoEComm expected another one (NVSHMEM backend)
STATUS_WORDS = 4
PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


class MoECommError(RuntimeError):
    """A dispatch/combine call failed on the device (bad routing, overflow, a peer timing out, or calls out of
    protocol order)."""


def describe(code: int, phase: int, rank: int, detail_a: int, detail_b: int) -> str:
    parts = []
    if code & BAD_EXPERT_ID:
        parts.append(f"expert id {detail_b} of token {detail_a} is outside [-1, num_experts)")
    if code & REPEATED_EXPERT_ID:
        parts.append(f"token {detail_a} names expert {detail_b} in two top-k slots (ids must be distinct)")
    if code & CAPACITY_OVERFLOW:
        parts.append(f"{detail_a} rows arrived but capacity is {detail_b}; raise MoECommConfig.capacity")
    if code & TIMEOUT:
        parts.append(f"timed out waiting for rank {detail_a} (JAX_MOE_COMM_TIMEOUT_S); did every rank make the call?")
    if code & OUT_OF_ORDER:
        expected = PHASES[detail_a] if 0 <= detail_a < len(PHASES) else detail_a
        parts.append(f"it ran while this MoEComm expected {expected}: a MoEComm carries one round trip at a time "
                     "(dispatch_send, dispatch_recv, combine_send, combine_recv); use one MoEComm per round trip "
                     "that overlaps another")
    name = PHASES[phase] if 0 <= phase < len(PHASES) else f"phase {phase}"
    return f"jax_moe_comm: {name} failed on rank {rank}: " + "; ".join(parts)


def status(code, phase: int, detail_a=0, detail_b=0) -> Array:
    """A status word built from traced values (the reference backend's equivalent of the kernels' report)."""
    return jnp.stack([jnp.asarray(v, jnp.int32) for v in (code, phase, detail_a, detail_b)])


def first_failure(*statuses: Array) -> Array:
    """The earliest non-zero status of a call's phases, else zeros."""
    out = jnp.where(statuses[-1][0] != 0, statuses[-1], 0)
    for s in reversed(statuses[:-1]):
        out = jnp.where(s[0] != 0, s, out)
    return out


def _raise_if_error(word, rank, after) -> None:
    del after
    # As host values first: under an eager shard_map (jax 0.11) the callback gets arrays that cannot be iterated.
    code, phase, a, b = (int(v) for v in np.asarray(word).reshape(-1)[:4])
    if code != 0:
        raise MoECommError(describe(code, phase, int(np.asarray(rank)), a, b))


def check(word: Array, rank: Array, after: Array) -> None:
    """Raises MoECommError (through the runtime) when the traced status word's code is non-zero.

    `after` is any value computed by the call's last transfer: the callback consumes it, so XLA cannot schedule
    the raise before that transfer (where it would leave peers waiting in a collective)."""
    jax.debug.callback(_raise_if_error, word, jnp.asarray(rank, jnp.int32), after.reshape(-1)[:1])

"""Routing errors found on the device, raised to the user.

The device computes an int32 error word per call (0 = fine) plus two integers of detail; a host callback
raises when the word is non-zero. Inside ``jit`` the error surfaces as ``jax.errors.JaxRuntimeError`` whose
message contains the text below, when the result is waited on (e.g. ``block_until_ready``). The device never
writes out of bounds in the meantime: offending rows are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BAD_EXPERT_ID = 1        # an id outside [-1, num_experts)
REPEATED_EXPERT_ID = 2   # one token names the same expert in two top-k slots
CAPACITY_OVERFLOW = 4    # the rows this rank receives exceed `capacity`


class MoECommError(RuntimeError):
    """A dispatch/combine call failed on the device (bad routing, overflow, or a peer timing out)."""


def describe(code: int, phase: str, rank: int, detail_a: int, detail_b: int) -> str:
    parts = []
    if code & BAD_EXPERT_ID:
        parts.append(f"expert id {detail_b} of token {detail_a} is outside [-1, num_experts)")
    if code & REPEATED_EXPERT_ID:
        parts.append(f"token {detail_a} names expert {detail_b} in two top-k slots (ids must be distinct)")
    if code & CAPACITY_OVERFLOW:
        parts.append(f"{detail_a} rows arrived but capacity is {detail_b}; raise MoECommConfig.capacity")
    return f"jax_moe_comm: {phase} failed on rank {rank}: " + "; ".join(parts)


def _raise_if_error(code, rank, detail_a, detail_b, *, phase: str) -> None:
    if int(code) != 0:
        raise MoECommError(describe(int(code), phase, int(rank), int(detail_a), int(detail_b)))


def check(code, rank, detail_a, detail_b, *, phase: str) -> None:
    """Raises MoECommError (through the runtime) when the traced int32 `code` is non-zero."""
    args = [jnp.asarray(v, jnp.int32) for v in (code, rank, detail_a, detail_b)]
    jax.debug.callback(lambda *a: _raise_if_error(*a, phase=phase), *args)

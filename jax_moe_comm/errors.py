"""Errors found on the device, and how they reach the user.

Every phase produces a status word ``int32[8] = {code, phase, rank, detail_a, detail_b, epoch, 0, 0}`` (code 0 = fine;
``rank`` is the rank that found the error, ``epoch`` the round trip's number on its MoEComm). A round trip's status
is the same on every rank: each rank publishes the first error it finds to every other rank, and each combine ends
with the lowest rank's. So every rank of a job fails the same round trip with the same message, and none is left
waiting for another.

Routing errors (an id outside ``[-1, num_experts)``, one expert twice in a token's top-k, more rows than
``capacity``) drop the offending rows and let the round trip finish everywhere; its combined output is NaN on every
rank. Protocol failures (a peer that never arrives, phases out of order) also make the MoEComm refuse every later
call (NaN results) until ``MoEComm.reset()``. How the error is raised is ``MoEComm(check_errors=...)``: see comm.py.
The codes match ``ffi/context.h``; the texts below are the only ones, also given to the kernels' check handler.

What the user catches. An error found in a step (the reference backend's check at the end of the failed round trip,
``check_errors="sync"``, the NVSHMEM backend's check in front of a round trip) stops the step's computation on every
rank and is raised by JAX where the step's outputs are read, jitted or eager, as JAX's own
``jax.errors.JaxRuntimeError``: its text is XLA's code and our message, ``ABORTED: jax_moe_comm: <phase> failed on
rank <r>: ...`` (in a build without the compiled modules the reference backend's check is a host callback: then the
message comes last, below the line per frame that JAX writes of the callback's stack). ``MoEComm.check()`` raises
``MoECommError`` from host code, a subclass of ``jax.errors.JaxRuntimeError`` (and of ``RuntimeError``). So
``except jax.errors.JaxRuntimeError`` catches both, ``except MoECommError`` what ``check()`` raises. Each error is
printed once: JAX's per-device log records of our callback's error are dropped, and JAX does not raise the failed
step again at exit (``_forget_own_failures``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

BAD_EXPERT_ID = 1        # an id outside [-1, num_experts)
REPEATED_EXPERT_ID = 2   # one token names the same expert in two top-k slots
CAPACITY_OVERFLOW = 4    # the rows this rank receives exceed `capacity`
TIMEOUT = 8              # a peer never arrived (NVSHMEM backend)
OUT_OF_ORDER = 16        # a phase ran while the MoEComm expected another one (NVSHMEM backend)
REFUSED = 32             # set on the failure a refused phase reports (the MoEComm failed earlier)
FATAL = TIMEOUT | OUT_OF_ORDER  # protocol failures: the MoEComm refuses every later call until reset()
STATUS_WORDS = 8
CODE, PHASE, RANK, DETAIL_A, DETAIL_B, EPOCH = range(6)
PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")

HEADER = "jax_moe_comm: {phase} failed on rank {rank}: "
PARTS = {
    BAD_EXPERT_ID: "expert id {b} of token {a} is outside [-1, num_experts)",
    REPEATED_EXPERT_ID: "token {a} names expert {b} in two top-k slots (ids must be distinct; the later slot is "
                        "dropped)",
    CAPACITY_OVERFLOW: "{a} rows arrived but capacity is {b} ({over} too many): raise MoECommConfig.capacity to at "
                       "least {a} (or capacity_factor in proportion), or drop what does not fit (overflow=\"drop\"); "
                       "capacity counts the rows of a rank with capacity_per=\"rank\", of each local expert with "
                       "capacity_per=\"expert\"",
    TIMEOUT: "timed out waiting for rank {a} (MoEComm timeout_s: did every rank make the call?)",
    OUT_OF_ORDER: "it ran while this MoEComm expected {expected}: a MoEComm carries one round trip at a time "
                  "(dispatch_send, dispatch_recv, combine_send, combine_recv); round trips that no data orders "
                  "(two models side by side) need a MoEComm each",
    REFUSED: "(refused: the MoEComm had failed before this call)",
}
JOINER = "; "
FATAL_SUFFIX = "; this MoEComm now refuses every call until comm.reset() (collective), or build a new one"


# Our texts inside any error's message (a JaxRuntimeError's carries one after JAX's own prefix).
_OWN_TEXT = re.compile(re.escape(HEADER).replace(re.escape("{phase}"), r"\S+").replace(re.escape("{rank}"), r"-?\d+"))


class MoECommError(jax.errors.JaxRuntimeError):
    """A dispatch/combine round trip failed on the device (bad routing, overflow, a peer timing out, or calls out
    of protocol order). The message names the phase, the rank that found the error and what to change.

    Raised as such by host code (``MoEComm.check()``). From a step's computation the same message reaches the user
    in JAX's ``jax.errors.JaxRuntimeError``, of which this is a subclass: ``except jax.errors.JaxRuntimeError``
    catches both."""


class _OwnErrorsRaisedOnce(logging.Filter):
    """JAX logs a failing host callback's error once per device before raising it: ours is raised, so its log
    records are dropped (other callbacks' are kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], MoECommError))


for _name in ("jax._src.callback", "jax._src.debugging"):
    logging.getLogger(_name).addFilter(_OwnErrorsRaisedOnce())


def describe(words) -> str:
    """The text of a status (its int32 words), as the user sees it."""
    code, phase, rank, a, b = (int(words[i]) for i in (CODE, PHASE, RANK, DETAIL_A, DETAIL_B))

    def phase_name(p: int) -> str:
        return PHASES[p] if 0 <= p < len(PHASES) else f"phase {p}"

    values = {"a": a, "b": b, "over": a - b, "expected": phase_name(a)}
    parts = [text.format(**values) for bit, text in PARTS.items() if code & bit]
    return (HEADER.format(phase=phase_name(phase), rank=rank) + JOINER.join(parts)
            + (FATAL_SUFFIX if code & FATAL else ""))


def give_texts_to(ext) -> None:
    """The texts above to a compiled module's check handler (the CUDA extension's or the status module's, which
    raise them as an XLA error), once per process, and its constants checked against these."""
    constants = ext.constants()
    ours = {"status_words": STATUS_WORDS, "fatal_codes": FATAL, "refused": REFUSED}
    if any(constants[k] != v for k, v in ours.items()):
        raise RuntimeError(f"jax_moe_comm: the constants of {ext.__name__} {constants} differ from errors.py's "
                           f"{ours}; rebuild the package")
    ext.set_messages(HEADER, PARTS, JOINER, FATAL_SUFFIX, list(PHASES))


def status(code, phase: int, rank, detail_a=0, detail_b=0) -> Array:
    """A status word built from traced values (the reference backend's equivalent of the kernels' report)."""
    return jnp.stack([jnp.asarray(v, jnp.int32) for v in (code, phase, rank, detail_a, detail_b, 0, 0, 0)])


def first_failure(*statuses: Array) -> Array:
    """The earliest non-zero status of a call's phases, else zeros."""
    out = jnp.where(statuses[-1][CODE] != 0, statuses[-1], 0)
    for s in reversed(statuses[:-1]):
        out = jnp.where(s[CODE] != 0, s, out)
    return out


def raise_if_failed(words) -> None:
    """Raises MoECommError for a status's host words whose code is non-zero."""
    words = np.asarray(words).reshape(-1)  # host values first: an eager shard_map may hand over unindexable arrays
    if int(words[CODE]) != 0:
        raise MoECommError(describe(words))


def _check_errors(words, after):
    """The host callback: raises in one frame of ours (JAX writes every frame of the callback's stack into the
    runtime error's text), else returns 0."""
    del after
    words = np.asarray(words).reshape(-1)
    if int(words[CODE]) != 0:
        raise MoECommError(describe(words))
    return np.zeros((), np.int32)


def _callback_check(word: Array, after: Array) -> Array:
    # pure_callback, not jax.debug.callback (which logs the error once per device) nor io_callback (whose effect
    # jax.checkpoint refuses): XLA keeps it because its result is used, and a recomputed one raises the same.
    return jax.pure_callback(_check_errors, jax.ShapeDtypeStruct((), jnp.int32), word, after)


_RAISE_TARGET = "jmc_raise_if_failed"


@functools.cache
def _raise_target_registered() -> tuple[str, ...]:
    """Registers the status check's FFI handler (the failure's text as the call's own error), once per process: the
    CUDA extension's for the CPU and the GPU (ffi/handlers.cu, ffi/status.cc), else the status module's for the CPU
    (ffi/status.cc). The platforms it serves; () without either (a build without a C++ toolchain's modules)."""
    from . import _native
    module = _native.ext if _native.ext is not None else _native.status_ext
    if module is None:
        return ()
    give_texts_to(module)
    handlers = module.raise_if_failed_handlers()
    for platform, capsule in handlers.items():
        jax.ffi.register_ffi_target(_RAISE_TARGET, capsule, platform=platform)
    return tuple(p.lower() for p in handlers)


def check_now(word: Array, after: Array) -> Array:
    """Fails the computation with MoECommError's message when the traced status word's code is non-zero (the user
    catches JAX's jax.errors.JaxRuntimeError where the outputs are read). It synchronizes with the device. Every rank
    holds the same round trip status, so every rank raises at the same check and none is left waiting in a
    collective for one that stopped.

    The check is an FFI handler (the CUDA extension's on the CPU and the GPU, else the status module's on the CPU):
    the error's text is XLA's code and our message (``ABORTED: jax_moe_comm: ...``). Without one (a platform no
    handler serves, or a build without the compiled modules) it is a host callback, and JAX writes the callback's
    stack before our message.

    `after` is any value computed by the call's last transfer: the check consumes it, so XLA cannot schedule the
    raise before that transfer. Returns `after`, bit for bit, made to depend on the check: callers use it in place
    of `after`, so the error also reaches the outputs where each primitive runs as its own computation (an eager
    shard_map, where a check without consumers fails only its runtime token and nothing raises). No JVP, and none
    needed (its inputs carry no tangent, its int32 result none either)."""
    operand = jax.lax.stop_gradient(after.reshape(-1)[:1])
    platforms = _raise_target_registered()
    if platforms:
        handler = jax.ffi.ffi_call(_RAISE_TARGET, jax.ShapeDtypeStruct((), jnp.int32))
        ok = jax.lax.platform_dependent(word, operand, default=_callback_check, **dict.fromkeys(platforms, handler))
    else:
        ok = _callback_check(word, operand)
    return jnp.where(ok == 0, after, jnp.zeros_like(after))


def _no_op() -> None:
    pass


def _check_failed(word: Array, after: Array) -> Array:
    # The debug callback (a no-op) gives the step JAX's debug effect: JAX then dispatches it through its Python path,
    # which raises the check's failure as JaxRuntimeError in every process model (the C++ fast path of a
    # multi-process CPU job raised it as ValueError). Being in this branch, it runs only when the round trip failed.
    jax.debug.callback(_no_op)
    return check_now(word, after)


def check_if_failed(word: Array, after: Array) -> Array:
    """check_now, run only when the status's code is non-zero (a conditional on the device): a round trip that
    succeeds costs no check and no synchronization; a failed one raises at its end, as check_now does.
    Returns `after`, bit for bit, made to depend on the conditional."""
    return jax.lax.cond(word[CODE] != 0, _check_failed, lambda word, after: after, word, after)


def _forget_own_failures() -> None:
    """At exit JAX waits for the computations it dispatched last (``jax.effects_barrier()``, in two atexit hooks of
    its own, ``jax._src.dispatch.wait_for_tokens`` and ``jax._src.api.clean_up``, registered before this one and so
    run after it) and re-raises a failure found there once per hook ("Exception ignored in atexit callback", the
    whole message again), skipping the rest of its shutdown (clearing backends, ``jax.distributed.shutdown()``).
    Every computation with a host callback leaves such a runtime token, whichever callback flavour. A failure whose
    text is ours is a step's error, raised where the step's outputs are read: its tokens are dropped here (no public
    API clears a failed one), every other failure is left to JAX. (A step whose outputs are never read then
    reports nothing, as JAX does for a failed computation without host callbacks.)"""
    try:
        from jax._src import dispatch
        tables = (dispatch.runtime_tokens.current_tokens, dispatch.runtime_tokens.output_runtime_tokens)
    except (ImportError, AttributeError):  # a JAX without these: its own behaviour
        return
    for table in tables:
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except Exception as exc:  # only our own failures are dropped
                if _OWN_TEXT.search(str(exc)):
                    table.pop(key, None)


atexit.register(_forget_own_failures)  # after jax's own hooks (imported above): run before them

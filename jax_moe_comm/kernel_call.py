"""The kernels' XLA custom calls as one JAX primitive, whose effect JAX may rematerialize.

``jax.ffi.ffi_call(..., has_side_effect=True)`` marks its call with JAX's FFI effect, which ``jax.checkpoint``
refuses ("Effects not supported in partial-eval of checkpoint/remat"). A round trip must be side-effecting for XLA
(never dropped, never merged), and it may be recomputed: a recomputed round trip is one round trip more, run by every
rank at the same point of the same program, so the protocol stays in step (docs/design.md, "One buffer set for a
whole model"). So the calls go through this primitive, with an effect of its own that is allowed under remat, custom
derivatives and control flow, and lowered like ffi_call's (an FFI custom call with has_side_effect) between
optimization barriers (see _lowering).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import core, effects  # no public API registers an effect type or its permissions
from jax._src.lib.mlir.dialects import hlo  # the optimization barrier's op (as JAX's own lowerings build it)
from jax.extend.core import Primitive
from jax.interpreters import mlir


@dataclasses.dataclass(frozen=True)
class KernelEffect(effects.Effect):
    """A jax_moe_comm kernel call: kept and never merged by XLA; allowed where a round trip may be recomputed or
    repeated."""

    def __str__(self) -> str:
        return "jax_moe_comm kernel"


_EFFECT = KernelEffect()
for allowed in (effects.lowerable_effects, effects.control_flow_allowed_effects, effects.remat_allowed_effects,
                effects.custom_derivatives_allowed_effects):
    allowed.add_type(KernelEffect)

kernel_call_p = Primitive("jmc_kernel_call")
kernel_call_p.multiple_results = True


def _abstract_eval(*avals_in, target: str, results: tuple, attributes: tuple, passthrough: bool = False):
    del target, attributes
    core.standard_vma_rule("jmc_kernel_call", *avals_in)  # as ffi_call's: results on the current mesh
    outs = tuple(r.update(sharding=core.get_cur_mesh_sharding()) if r.sharding.mesh.empty else r for r in results)
    return outs + (tuple(avals_in) if passthrough else ()), {_EFFECT}


kernel_call_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *operands, target: str, results: tuple, attributes: tuple, passthrough: bool = False):
    """ffi_call's lowering, between optimization barriers: XLA:GPU's dynamic-slice fusion clones a custom call whose
    operand is a slice of a loop's buffer (a lax.scan's per-layer inputs) or whose result goes into one (a lax.scan
    stacking residuals for the backward pass, under jax.checkpoint the calls' own results), side effect or not, and
    keeps the original: the kernel then ran twice per iteration. Between barriers (no copy, no kernel) no operand
    and no result of the call matches such a pattern, whoever uses them.

    ``passthrough``: the operands, as the call received them (after the first barrier, the very buffers it reads),
    come out after its results through the second barrier, which forwards buffers without copying them: a later
    call that takes them keeps those buffers live until it runs (a send half on a stream of its own reads them
    until its receive half)."""
    operands = hlo.OptimizationBarrierOp(operands).results if operands else operands
    if passthrough:
        ctx = ctx.replace(avals_out=ctx.avals_out[:len(results)])
    outs = jax.ffi.ffi_lowering(target, has_side_effect=True)(ctx, *operands, **dict(attributes))
    outs = [*outs, *operands] if passthrough else outs
    return hlo.OptimizationBarrierOp(outs).results if outs else outs


mlir.register_lowering(kernel_call_p, _lowering, platform="cuda")


def kernel_call(target: str, results: Any, *args, _passthrough: bool = False, **attributes) -> Any:
    """``jax.ffi.ffi_call(target, results, has_side_effect=True)(*args, **attributes)`` on this primitive. `results`:
    a ShapeDtypeStruct or a sequence of them (the result then a list); attributes: numpy scalars. `_passthrough`:
    returns (results, the operands as the call read them) (see _lowering)."""
    # Operands varying over different manual axes (shard_map) are made to vary over all of them, as a primitive's
    # operands must (a no-op in the program).
    vma = frozenset().union(*(varying_axes(a) for a in args))
    args = tuple(varying_over(a, vma) for a in args)
    many = isinstance(results, Sequence)
    avals = tuple(core.shaped_abstractify(r).update(dtype=r.dtype) for r in (results if many else (results,)))
    outs = kernel_call_p.bind(*args, target=target, results=avals, attributes=tuple(sorted(attributes.items())),
                              passthrough=_passthrough)
    outs, kept = outs[:len(avals)], tuple(outs[len(avals):])
    outs = list(outs) if many else outs[0]
    return (outs, kept) if _passthrough else outs


def varying_axes(a) -> frozenset:
    """The manual mesh axes over which a per-shard value varies (shard_map's type; empty outside one)."""
    return aval_varying_axes(jax.typeof(a))


def aval_varying_axes(aval) -> frozenset:
    """varying_axes of a value of type `aval`."""
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_over(a, axes: frozenset):
    """`a`, made to vary over `axes` too (shard_map's type; a no-op in the program)."""
    missing = tuple(sorted(axes - varying_axes(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a

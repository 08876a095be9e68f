"""The fused dispatch and combine of one backend on one buffer set (Phases), and their custom VJPs, built from the
backend's own phases.

The NVSHMEM phases are custom calls that JAX cannot differentiate; these rules give them gradients (the default
there, ``MoEComm(custom_vjp=None)``). The reference backend uses plain JAX AD unless given ``custom_vjp=True``,
which is how the rules are tested against plain AD on CPU (and against the reference on GPUs).

- dispatch backward: a combine of the row cotangents with weight 1 on every live slot (row gradients summed per
  token, unweighted); each replica keeps the tokens it sent. Scales, ids and counts get no gradient.
- combine backward: a dispatch of ``dy`` with the same routing (so its rows land in the forward's layout), scaled
  on the expert side by each row's weight, plus ``dw[t, k] = <dy[t], expert_y[row(t, k)]>`` computed per row on the
  expert side and sent home. At world > 1 the weights go out and the per-row dot products come home through a round
  trip of this library's own on a buffer set of its own (``Phases.weights``: rows of K float32 weights, the same
  routing hence the same layout), so the backward issues no XLA collective; at world 1 every row is local.

A training step's backward is then one more round trip on the same MoEComm (for an fp8 payload, on its
``grad_dtype`` buffer set, so that ``dy`` travels unquantized; the layout is the forward's, as the routing is):
combine's rule dispatches ``dy`` (tied to the forward's output by an operand it never reads, so it starts after the
forward round trip), dispatch's rule combines the row gradients (which depend on the expert computation's
backward, hence on that dispatch). One MoEComm carries one round trip at a time; the NVSHMEM kernels check the
phase order on the device and fail with a message (errors.OUT_OF_ORDER) instead of mixing two round trips' rows.
When the dispatch is not differentiated (x frozen) its rule never runs: the handle's grad_link tells combine's rule
so, and it finishes the round trip with a combine of zero rows (docs/design.md, "Autodiff").
With ``dp_size > 1`` the replicas' ``dy`` are summed before the dispatch (an ``all_gather``, the one XLA collective
of a backward), each replica keeps ``dx`` of the tokens it sent, and the group's ``dw`` is shared out equally over
its replicas (their sum is exact; so is any gradient of the replicas' identical weights).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from .config import Geometry
from .kernel_call import aval_varying_axes, varying_axes, varying_over
from .types import CombineHandle, Dispatched


def with_grad_link(d: Dispatched) -> Dispatched:
    """d with its handle's grad_link (see _combine_fwd): every dispatch's handle has one, whatever made it, so handles
    have one structure whether or not the custom VJPs are used."""
    # One element, not zero: a zero-sized array passed between the global view's two shard_maps made XLA:GPU's
    # Shardy partitioner crash (SIGSEGV) when several processes share one GPU.
    return dataclasses.replace(d, handle=dataclasses.replace(d.handle, grad_link=jnp.zeros((1,), jnp.float32)))


@dataclasses.dataclass(frozen=True)
class Phases:
    """One backend's phases (``impl``: reference or nvshmem_backend) on one buffer set (``plan``: that backend's),
    with the fused calls the VJP rules below are made of. ``grad``: the buffer set of an fp8 layer's backward round
    trip (gradients never travel in fp8), or None."""

    impl: ModuleType
    plan: Any
    geo: Geometry
    weights_at: str  # where the fused combine gives the weights: "send" or "recv"
    grad: Phases | None = None
    # The backward's weights exchange (see _exchange_weights), on buffers of its own: needed by combine's rule at
    # world > 1 (None at world 1, and in the phases of grad).
    weights: Phases | None = None

    def dispatch(self, x, topk_ids, scales, num_tokens, topk_weights=None, after=None) -> Dispatched:
        """after: an array this dispatch must run after (the backward's dispatch of dy: the forward's output)."""
        return with_grad_link(self.impl.dispatch(self.plan, x, topk_ids, scales, num_tokens, topk_weights, after))

    def combine(self, expert_y, handle, topk_weights) -> Array:
        return self.impl.combine(self.plan, expert_y, handle, topk_weights, self.weights_at)

    def dispatch_beside(self, place, x, topk_ids, scales, num_tokens, topk_weights=None, after=None):
        """(the dispatch, what `place` computed): the dispatch in split halves, `place` (pending -> (its result,
        pending)) between them."""
        p = self.impl.dispatch_send(self.plan, x, topk_ids, scales, num_tokens, topk_weights, after)
        out, p = place(p)
        return with_grad_link(self.impl.dispatch_recv(self.plan, p)), out

    def combine_beside(self, place, expert_y, handle, topk_weights):
        """(the combine, what `place` computed): the combine in split halves, the weights given where the fused call
        gives them (weights_at), `place` between them."""
        if self.weights_at == "send":  # None: the handle's, which count as given to the send
            q = self.impl.combine_send(self.plan, expert_y, handle, topk_weights)
            out, q = place(q)
            return self.impl.combine_recv(self.plan, q, None), out
        weights = handle.topk_weights if topk_weights is None else topk_weights
        q = self.impl.combine_send(self.plan, expert_y, dataclasses.replace(handle, topk_weights=None), None)
        out, q = place(q)
        return self.impl.combine_recv(self.plan, q, weights), out

    def backward(self) -> Phases:
        """The phases whose buffers carry the backward round trip: these, or for an fp8 payload grad's."""
        if not self.geo.cfg.is_fp8:
            return self
        if self.grad is None:
            raise NotImplementedError("gradients through an fp8 dispatch travel in a wider dtype: create the MoEComm "
                                      "with grad_dtype=jnp.bfloat16 (or float16/float32), which allocates the "
                                      "backward round trip's buffers")
        return self.grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch(phases: Phases, x: Array, topk_ids: Array, scales: Array | None, num_tokens: Array,
             topk_weights: Array | None = None) -> Dispatched:
    return phases.dispatch(x, topk_ids, scales, num_tokens, topk_weights)


def _dispatch_fwd(phases, *args):
    x, topk_ids, scales, num_tokens, topk_weights = custom_vjp_primal_tree_values(args)
    d = phases.dispatch(x, topk_ids, scales, num_tokens, topk_weights)
    return d, _dispatch_residuals(phases, x, d)


def _dispatch_residuals(phases: Phases, x: Array, d: Dispatched) -> tuple:
    quantized = np.dtype(x.dtype) != phases.geo.cfg.dtype  # dispatch(..., quantize=...): bf16 x, fp8 rows
    # x's dtype, and for a quantizing dispatch the scales: the rows' gradient w.r.t. x passes the quantization
    # straight through (x ~ expert_x * scale, so d/dx = d/d expert_x / scale).
    return d.handle, jnp.zeros((0,), x.dtype), d.expert_scales if quantized else None


def _dispatch_bwd(phases, residuals, ct: Dispatched, place=None):
    """place: with dispatch_beside, the compute's VJP placed between the backward combine's halves (pending ->
    pending), or None."""
    cfg = phases.geo.cfg
    handle, x_dtype, quantized_scales = residuals[0], residuals[1].dtype, residuals[2]
    rows = ct.expert_x
    # Weights given to dispatch only pass into the handle: their cotangent is the one combine gave the handle's.
    d_weights = ct.handle.topk_weights
    d_weights = None if handle.topk_weights is None or isinstance(d_weights, SymbolicZero) else d_weights
    opened = not isinstance(ct.handle.grad_link, SymbolicZero)  # combine's rule dispatched dy and left this open
    if not opened and isinstance(rows, SymbolicZero):  # neither rule has anything to send
        return None, None, None, None, d_weights
    rows = jnp.zeros(rows.shape, rows.dtype) if isinstance(rows, SymbolicZero) else rows
    if quantized_scales is not None:
        rows = rows.astype(jnp.float32) / jnp.repeat(quantized_scales, cfg.scale_block, axis=1)
    rows = rows.astype(cfg.out_dtype)  # combine carries rows no wider than out_dtype
    live = (handle.topk_ids >= 0).astype(jnp.float32)  # combine drops dead slots and tokens >= num_tokens itself
    backward = phases.backward()
    if not opened:
        # Combine's rule did not run, or finished its round trip itself (it saw no gradient on the link: the handle
        # under stop_gradient): open one with a dispatch of zero rows on the same routing (the combine's kernels
        # read what that routing's dispatch stored), after the rows, which come after everything it depends on.
        zeros = jnp.zeros((cfg.max_tokens, cfg.hidden), backward.geo.cfg.dtype)
        opening = backward.dispatch(zeros, handle.topk_ids, None, handle.num_tokens, after=rows).expert_x
        rows = rows + _tie(opening).astype(rows.dtype)  # so the combine runs after it
    if place is None:
        dx = backward.combine(rows, handle, live)
    else:
        dx, _ = backward.combine_beside(lambda q: (None, place(q)), rows, handle, live)
    dx = dx.astype(x_dtype)  # x's cotangent has x's dtype
    dp = cfg.dp_size
    if dp > 1:  # every replica received the group's dx; each replica's x only sent the tokens it owns
        own = jnp.arange(cfg.max_tokens) % dp == jax.lax.axis_index(phases.geo.axis_name) % dp
        dx = jnp.where(own[:, None], dx, jnp.zeros_like(dx))
    if d_weights is not None and varying_axes(dx) <= varying_axes(d_weights):
        # dx is unread when x is frozen: the weights' gradient then orders this combine. (Weights replicated over the
        # EP axes have a replicated gradient, which a per-rank tie cannot join.)
        d_weights = d_weights + _tie(dx)
    return dx, None, None, None, d_weights


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


def _joined(*arrays: Array) -> Array:
    """float32 [n], the first element of each array: an operand (a dispatch's `after`) that exists only once every
    one of them does."""
    return jnp.stack([a.reshape(-1)[0].astype(jnp.float32) for a in arrays])


def _tie(a: Array) -> Array:
    """A float32 zero computed from a's first element (NaN if that is NaN): added to a value that is read, it makes
    XLA run the call that produced `a` before whatever reads that value (XLA keeps 0 * x for floats)."""
    return a.reshape(-1)[0].astype(jnp.float32) * 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine(phases: Phases, expert_y: Array, handle: CombineHandle, topk_weights: Array | None) -> Array:
    return phases.combine(expert_y, handle, topk_weights)


def _combine_fwd(phases, *args):
    expert_y, handle, topk_weights = custom_vjp_primal_tree_values(args)
    y = phases.combine(expert_y, handle, topk_weights)
    return y, _combine_residuals(args[1], expert_y, handle, topk_weights, y)


def _combine_residuals(handle_primal, expert_y, handle, topk_weights, y) -> tuple:
    # The link carries a gradient when the dispatch was differentiated, so that its rule will combine the backward
    # round trip that this rule's dispatch of dy opens (JAX can also give it one on the way, through a scan carry,
    # an optimization barrier or a cond output: docs/design.md, "Autodiff").
    dispatch_follows = handle_primal.grad_link is not None and handle_primal.grad_link.perturbed
    done = y.reshape(-1)[:1]  # a value of the forward's last transfer: orders the backward's transfers after it
    return expert_y, handle, topk_weights, done, jnp.zeros((int(dispatch_follows),), jnp.float32)


def _summed_to(ct: Array, primal: Array) -> Array:
    """`ct` summed over the mesh axes it varies over and `primal` does not: a primal replicated over an axis (the same
    on every rank of it) has for gradient the sum of every rank's, as plain AD's transpose of shard_map's implicit
    broadcast gives (one psum: the user's replicated input asks for it)."""
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def _exchange_weights(exchange: Phases | None, topk_weights: Array, handle: CombineHandle, slot: Array,
                      has_token: Array, row_dot: Array, after: Array) -> tuple[Array, Array]:
    """(each row's weight [capacity], dw [T, K] float32) through one round trip of the weights exchange on the
    forward's routing, which gives its rows the forward's layout: the dispatch takes each token's K weights to its
    rows (row p keeps column slot(p)); the combine brings row p's dot product home in column slot(p) of a row of
    zeros, with weight 1 on every live slot, so column k of token t sums slot k's row alone. `after`: the backward's
    dispatch of dy (this round trip follows the later layer's, whose gradients that dispatch needed)."""
    if exchange is None:
        raise ValueError("combine's gradient at world > 1 needs the phases' weights exchange (Phases.weights)")
    cfg = exchange.geo.cfg
    columns = jnp.arange(cfg.hidden)
    rows = jnp.zeros((cfg.max_tokens, cfg.hidden), jnp.float32).at[:, :cfg.experts_per_token].set(
        topk_weights.astype(jnp.float32))
    sent = exchange.impl.dispatch(exchange.plan, rows, handle.topk_ids, None, handle.num_tokens, None, after)
    row_weight = jnp.where(has_token, jnp.sum(jnp.where(columns == slot[:, None], sent.expert_x, 0.0), axis=1), 0.0)
    dots = jnp.where((columns == slot[:, None]) & has_token[:, None], row_dot[:, None], 0.0)
    live = (handle.topk_ids >= 0).astype(jnp.float32)
    home = exchange.impl.combine(exchange.plan, dots, sent.handle, live, "recv")
    return row_weight, home[:, :cfg.experts_per_token]


def _handle_cotangent(handle: CombineHandle, d_weights: Array | None) -> CombineHandle:
    """The handle's cotangent: d_weights for the weights it carries (given to dispatch), zeros for its integers, and
    a (data-free) gradient for its grad_link: it tells dispatch's rule that this rule opened the backward round
    trip."""
    def zero(a):
        return np.zeros(a.shape, jax.dtypes.float0)

    return CombineHandle(row_origin=zero(handle.row_origin), topk_ids=zero(handle.topk_ids),
                         num_tokens=zero(handle.num_tokens), status=zero(handle.status), topk_weights=d_weights,
                         grad_link=None if handle.grad_link is None else handle.grad_link * 0)  # its vma


def _combine_bwd(phases, residuals, dy, place=None):
    """place: with combine_beside, the compute's VJP placed between the backward dispatch's halves (pending ->
    pending), or None."""
    backward = phases.backward()
    expert_y, handle, given_weights, done, dispatch_follows = residuals
    dy = jnp.zeros(dy.shape, dy.dtype) if isinstance(dy, SymbolicZero) else dy
    topk_weights = handle.topk_weights if given_weights is None else given_weights
    cfg, axis, world = phases.geo.cfg, phases.geo.axis_name, phases.geo.world
    T, K, dp = cfg.max_tokens, cfg.experts_per_token, cfg.dp_size
    rank = jax.lax.axis_index(axis)
    if dp > 1:  # every replica of a DP group combined the same rows: their dy add up (one all_gather, T·H a rank)
        all_dy = jax.lax.all_gather(dy.astype(jnp.float32), axis)  # [world, T, H]
        dy = all_dy.reshape(world // dp, dp, T, -1).sum(axis=1)[rank // dp].astype(dy.dtype)
    # dy[t] to every row that token t filled: the forward's routing, hence the forward's layout. This dispatch
    # reuses this MoEComm's buffers, so it must not start before the forward round trip has ended, and dy need not
    # depend on y (a linear loss): `after` makes the forward's output its operand. It holds dy too: the dispatch's
    # error check (check_errors=True) takes `after` alone, and must not run before dy exists (the later layers'
    # backward round trips launched), else it waits for round trips queued behind itself.
    dy_args = (dy.astype(backward.geo.cfg.dtype), handle.topk_ids, None, handle.num_tokens)
    if place is None:
        expert_dy = backward.dispatch(*dy_args, after=_joined(done, dy)).expert_x
    else:
        expert_dy = backward.dispatch_beside(lambda p: (None, place(p)), *dy_args, after=_joined(done, dy))[0].expert_x
    expert_dy = expert_dy.astype(jnp.float32)
    origin = handle.row_origin
    has_token = origin >= 0
    slot = jnp.where(has_token, origin % K, 0)
    row_dot = jnp.where(has_token, jnp.sum(expert_dy * expert_y.astype(jnp.float32), axis=-1), 0.0)  # [capacity]
    if world == 1:  # every row is this rank's own token: origin = token * K + slot
        row_weight = jnp.where(has_token, topk_weights.reshape(-1)[jnp.where(has_token, origin, 0)], 0.0)
        index = jnp.where(has_token, origin, T * K)  # others dropped
        d_weights = jnp.zeros((T * K,), jnp.float32).at[index].add(row_dot, mode="drop").reshape(T, K)
    else:
        row_weight, d_weights = _exchange_weights(phases.weights, topk_weights, handle, slot, has_token, row_dot,
                                                  after=expert_dy)
    d_expert_y = (row_weight[:, None] * expert_dy).astype(expert_y.dtype)
    if world > 1:  # the exchange's round trip ends before whatever the experts' backward feeds
        d_expert_y = d_expert_y + _tie(d_weights).astype(d_expert_y.dtype)
    # With DP replicas the dots hold the group's dy: the sum of the replicas' weight gradients, shared out equally
    # (exact for anything computed from the replicas' identical weights; each replica's own share would need its
    # own dy dispatched).
    d_weights = (d_weights / dp).astype(topk_weights.dtype)
    if dispatch_follows.shape[0] == 0:
        # The dispatch was not differentiated (its x needs no gradient: a frozen embedding), so no rule of its will
        # combine: this one finishes the round trip with a combine of zero rows (its result unread, so tied to what
        # is read).
        # Zero rows made from the backward dispatch's: XLA runs this combine after that dispatch.
        zero_rows = (expert_dy * 0).astype(cfg.out_dtype)
        closed = backward.combine(zero_rows, handle, jnp.zeros((T, K), jnp.float32))
        tie = _tie(closed)
        d_expert_y, d_weights = d_expert_y + tie.astype(d_expert_y.dtype), d_weights + tie.astype(d_weights.dtype)
    d_weights = _summed_to(d_weights, topk_weights)
    if given_weights is None or handle.grad_link is not None:  # weights or link: a cotangent goes to the handle
        handle_ct = _handle_cotangent(handle, d_weights if given_weights is None else None)
        return d_expert_y, handle_ct, None if given_weights is None else d_weights
    return d_expert_y, None, d_weights


combine.defvjp(_combine_fwd, _combine_bwd, symbolic_zeros=True)


# A round trip with a computation beside it ---------------------------------------------------------------------
# dispatch_beside and combine_beside run the round trip in split halves with `compute(*args)` between them (so a
# send_stream can overlap it), and differentiate the whole: their rules are dispatch's and combine's, with the
# compute's VJP placed between the halves of the backward round trip, which thereby overlaps it too. `compute`
# differentiates its `args` only (JAX refuses a gradient through a value it closes over).


def between(pending, compute, *args):
    """(compute(*args), pending): the compute after the send that made `pending` and before the receive that takes it.
    Two optimization barriers tie `args` to the send's result and the receive's operands to the compute's."""
    args, pending = jax.lax.optimization_barrier((args, pending))
    out = compute(*args)
    out, pending = jax.lax.optimization_barrier((out, pending))
    return out, pending


def _vjp_kept(vjps: list, compute, *args):
    """compute(*args), its VJP appended to `vjps` (the residual of a beside rule's forward)."""
    out, vjp = jax.vjp(compute, *args)
    vjps.append(vjp)
    return out


def _instantiated(ct):
    """A cotangent pytree with its symbolic zeros made arrays (varying over the mesh axes their primal varies over)."""
    def one(c):
        if not isinstance(c, SymbolicZero):
            return c
        if c.aval.dtype == jax.dtypes.float0:
            return np.zeros(c.aval.shape, jax.dtypes.float0)
        return varying_over(jnp.zeros(c.aval.shape, c.aval.dtype), aval_varying_axes(c.aval))
    return jax.tree.map(one, ct)


def _variance(args) -> list:
    """Per leaf of `args`, a zero-sized float32 array varying over the mesh axes the leaf varies over: between's
    barrier makes every argument vary as the rows in flight do, so the compute's cotangents vary over those axes too,
    and each is summed back to its argument's (_summed_to), as plain AD's transpose of that cast does."""
    return [varying_over(jnp.zeros((0,), jnp.float32), varying_axes(a)) for a in jax.tree.leaves(args)]


def _args_cotangent(cts, variance: list):
    leaves, tree = jax.tree.flatten(cts)
    summed = [c if c.dtype == jax.dtypes.float0 else _summed_to(c, v) for c, v in zip(leaves, variance, strict=True)]
    return jax.tree.unflatten(tree, summed)


def _backward_place(vjp, ct_out, variance: list, ct_args: list):
    """The compute's VJP of `ct_out` between the backward round trip's halves, its cotangents (each summed to its
    argument's variance) appended to `ct_args`."""
    def place(pending):
        cts, pending = between(pending, vjp, _instantiated(ct_out))
        ct_args.append(_args_cotangent(cts, variance))
        return pending
    return place


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def dispatch_beside(phases: Phases, compute, args: tuple, x: Array, topk_ids: Array, scales: Array | None,
                    num_tokens: Array, topk_weights: Array | None = None) -> tuple[Dispatched, Any]:
    return phases.dispatch_beside(lambda p: between(p, compute, *args), x, topk_ids, scales, num_tokens,
                                  topk_weights)


def _dispatch_beside_fwd(phases, compute, *primals):
    args, x, topk_ids, scales, num_tokens, topk_weights = custom_vjp_primal_tree_values(primals)
    vjps = []
    d, out = phases.dispatch_beside(lambda p: between(p, functools.partial(_vjp_kept, vjps, compute), *args), x,
                                    topk_ids, scales, num_tokens, topk_weights)
    return (d, out), (_dispatch_residuals(phases, x, d), vjps[0], _variance(args))


def _dispatch_beside_bwd(phases, compute, residuals, cts):
    dispatch_residuals, vjp, variance = residuals
    ct_d, ct_out = cts
    ct_args = []
    dx, _, _, _, d_weights = _dispatch_bwd(phases, dispatch_residuals, ct_d,
                                           _backward_place(vjp, ct_out, variance, ct_args))
    if not ct_args:  # no backward round trip (nothing to send): the compute's VJP alone
        ct_args.append(_args_cotangent(vjp(_instantiated(ct_out)), variance))
    return ct_args[0], dx, None, None, None, d_weights


dispatch_beside.defvjp(_dispatch_beside_fwd, _dispatch_beside_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def combine_beside(phases: Phases, compute, args: tuple, expert_y: Array, handle: CombineHandle,
                   topk_weights: Array | None) -> tuple[Array, Any]:
    return phases.combine_beside(lambda q: between(q, compute, *args), expert_y, handle, topk_weights)


def _combine_beside_fwd(phases, compute, *primals):
    args, expert_y, handle, topk_weights = custom_vjp_primal_tree_values(primals)
    vjps = []
    y, out = phases.combine_beside(lambda q: between(q, functools.partial(_vjp_kept, vjps, compute), *args),
                                   expert_y, handle, topk_weights)
    return (y, out), (_combine_residuals(primals[2], expert_y, handle, topk_weights, y), vjps[0], _variance(args))


def _combine_beside_bwd(phases, compute, residuals, cts):
    combine_residuals, vjp, variance = residuals
    dy, ct_out = cts
    ct_args = []
    d_expert_y, handle_ct, d_weights = _combine_bwd(phases, combine_residuals, dy,
                                                     _backward_place(vjp, ct_out, variance, ct_args))
    return ct_args[0], d_expert_y, handle_ct, d_weights


combine_beside.defvjp(_combine_beside_fwd, _combine_beside_bwd, symbolic_zeros=True)

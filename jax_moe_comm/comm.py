"""Public API: MoEComm, its per-shard calls, and the global-view wrappers.

Per-shard calls (``comm.dispatch`` ...) run inside the user's ``shard_map`` over the mesh (over the EP axes at
least); the module-level ``dispatch``/``combine`` take arrays sharded over the batch and EP axes (``comm.batch_spec``)
and need no user-written shard_map.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import sys
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import autodiff, errors, load, memory, nvshmem_backend, reference, runtime
from .config import Geometry, MoECommConfig, Options
from .types import CombineHandle, Dispatched

BACKENDS = ("auto", "nvshmem", "reference")
COMBINE_DTYPES = [np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)]


_OPEN: weakref.WeakSet = weakref.WeakSet()  # this process's open NVSHMEM MoEComms with check_errors=True
_exit_report_registered = False


def _report_unraised_at_exit() -> None:
    """At interpreter exit: the failure of each open NVSHMEM MoEComm that no check has raised (a failed last step whose
    outputs nobody read, with no check after it) is printed once. Registered after NVSHMEM's finalize (initialize), so
    it runs before it."""
    for comm in list(_OPEN):
        text = comm._take_unraised()
        if text is not None:
            print(f"{text} (reported at exit: no check raised it)", file=sys.stderr, flush=True)


def _axis_names(name: str, value: Any) -> tuple[str, ...]:
    """`value` (one axis name or a tuple/list of them) as a tuple; ValueError naming `name` otherwise."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
        raise ValueError(f"{name} must be a mesh axis name or a tuple of them, got {value!r}")
    return tuple(names)


def _check_axes(name: str, axes: tuple[str, ...], mesh: Mesh) -> None:
    """ValueError naming `name` unless every axis is a distinct axis of `mesh`."""
    mesh_axes = tuple(mesh.axis_names)
    for axis in axes:
        if axis not in mesh_axes:
            which = "" if len(axes) == 1 else f" names {axis!r}, which"
            raise ValueError(f"{name} {axes[0] if len(axes) == 1 else axes!r}{which} is not an axis of the mesh "
                             f"{mesh_axes}")
        if axes.count(axis) > 1:
            raise ValueError(f"{name} {axes!r} names mesh axis {axis!r} twice")


def ep_axes_of(axis_name: str | tuple[str, ...], mesh: Mesh) -> tuple[str, ...]:
    """The EP axes named by `axis_name` (one mesh axis or a tuple of them), validated against `mesh`."""
    axes = _axis_names("axis_name", axis_name)
    if not axes:
        raise ValueError("axis_name must name at least one mesh axis (the EP axes), got ()")
    _check_axes("axis_name", axes, mesh)
    return axes


def batch_axes_of(batch_axes: str | tuple[str, ...] | None, ep_axes: tuple[str, ...], mesh: Mesh) -> tuple[str, ...]:
    """The global view's batch axes: `batch_axes` validated (mesh axes, none of them an EP axis), or for None every
    mesh axis that is not an EP axis, in mesh order."""
    if batch_axes is None:
        return tuple(a for a in mesh.axis_names if a not in ep_axes)
    axes = _axis_names("batch_axes", batch_axes)
    _check_axes("batch_axes", axes, mesh)
    shared = [a for a in axes if a in ep_axes]
    if shared:
        raise ValueError(f"batch_axes {axes!r} must not name an EP axis (axis_name {ep_axes!r}): {shared[0]!r} is both")
    return axes


def context_mesh() -> Mesh | None:
    """The concrete mesh the program runs under (``jax.set_mesh``), or None; also while tracing under ``jit``, where
    ``jax.sharding.get_mesh`` refuses (hence ``jax._src.mesh.get_concrete_mesh`` first, where this JAX has it)."""
    from jax._src import mesh as mesh_lib
    get = getattr(mesh_lib, "get_concrete_mesh", None) or getattr(jax.sharding, "get_mesh", None)
    mesh = None if get is None else get()
    return None if mesh is None or getattr(mesh, "empty", False) or not isinstance(mesh, Mesh) else mesh


def _mesh_shape(mesh) -> tuple:
    return tuple(zip(mesh.axis_names, (int(mesh.shape[a]) for a in mesh.axis_names), strict=True))


def _describe_mesh(mesh) -> str:
    return "{" + ", ".join(f"{name!r}: {size}" for name, size in _mesh_shape(mesh)) + "}"


def _device_ids(mesh) -> list[int]:
    return [int(d.id) for d in np.asarray(mesh.devices).flat]


def check_program_mesh(mesh: Mesh, method: str) -> None:
    """ValueError naming both meshes unless the program's mesh (the abstract mesh in context: ``jax.set_mesh``'s, or
    the mesh of the shard_map being traced) is none or has `mesh`'s axes and sizes, and the concrete mesh in context
    (``jax.set_mesh``'s), if any, has `mesh`'s devices in `mesh`'s order."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    program = None if get is None else get()
    if program is None or getattr(program, "empty", True):
        return
    fix = ("JAX needs one mesh across the program: build the MoEComm on the mesh the model already uses, "
           "MoEComm(cfg, model_mesh, axis_name=<its expert axis or axes>), or with mesh=None under "
           "`with jax.set_mesh(model_mesh):`")
    if _mesh_shape(program) != _mesh_shape(mesh):
        raise ValueError(f"jax_moe_comm: MoEComm.{method} runs under the mesh {_describe_mesh(program)} but the "
                         f"MoEComm was built on the mesh {_describe_mesh(mesh)}; {fix}")
    concrete = context_mesh()
    if concrete is not None and _mesh_shape(concrete) == _mesh_shape(mesh) \
            and _device_ids(concrete) != _device_ids(mesh):
        raise ValueError(f"jax_moe_comm: MoEComm.{method} runs under the mesh {_describe_mesh(concrete)} of devices "
                         f"{_device_ids(concrete)} but the MoEComm was built on the mesh {_describe_mesh(mesh)} of "
                         f"devices {_device_ids(mesh)} (the same axes, other devices or another order); {fix}")


def dim0_spec(axes: tuple[str, ...]) -> P:
    """PartitionSpec of an array whose dim 0 is sharded over `axes` (row-major, in this order)."""
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


def _check_array(name: str, value: Any, shape: tuple, dtypes: tuple | None, dtype_rule: str = "") -> Array:
    """ValueError naming `name` unless `value` has `shape` and one of `dtypes`."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{name} must be an array of shape {shape}, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (per shard), got {tuple(value.shape)}")
    if dtypes is not None and np.dtype(value.dtype) not in [np.dtype(d) for d in dtypes]:
        rule = dtype_rule or " or ".join(np.dtype(d).name for d in dtypes)
        raise ValueError(f"{name} must have dtype {rule}, got {np.dtype(value.dtype).name}")
    return value


class MoEComm:
    """Dispatch/combine for one MoE layer over the EP axes ``axis_name`` of a mesh.

    Args:
      cfg: the layer's MoECommConfig.
      mesh: the jax Mesh the model already uses, holding the EP axes; it may have other axes (data, tensor,
        pipeline ...). None (default): the mesh set in context (``with jax.set_mesh(mesh):``), ValueError if none is.
        JAX needs one mesh across a program: a call under another mesh (``jax.set_mesh``, or a shard_map over
        another mesh) raises a ValueError naming both.
      axis_name: the EP axis, or a tuple of mesh axes that together form it (a compound EP axis, e.g.
        ``("context", "expert")``). ``world`` is the product of their sizes; a device's EP rank is its row-major
        index over them in the order given (``jax.lax.axis_index(axis_name)``), and rank r holds experts
        r*L .. r*L + L - 1. The coordinates of the other mesh axes select independent EP groups: each group's
        ``world`` ranks exchange tokens only among themselves (``dp_size`` counts replicas inside a group).
      batch_axes: (keyword) the mesh axes besides the EP axes over which the global view's batch (dim 0) is sharded.
        None (default): every other mesh axis, in mesh order. Mesh axes in neither set hold replicas of the global
        view's inputs, and each of their coordinates repeats the same exchange. See ``batch_spec``.
      backend: "reference" (pure JAX collectives, any platform), "nvshmem" (CUDA kernels; needs the CUDA
        extension and ``jax_moe_comm.initialize()``), or "auto" (nvshmem when available, else reference).
      custom_vjp: differentiate the fused ``dispatch``/``combine`` with the rules of ``autodiff.py`` (built from
        the backend's own phases) instead of plain JAX AD. None (default): True on the NVSHMEM backend (its custom
        calls have no other gradient), False on the reference backend (plain AD through its collectives). With
        True the split halves refuse a gradient (ValueError), alike on both backends; a round trip in split halves
        with ``beside=`` (``dispatch``) is differentiable either way.
      grad_dtype: for float8_e4m3fn payloads only: the dtype (bfloat16, float16 or float32) in which gradients
        travel. Differentiating an fp8 dispatch with the custom VJP needs it: the backward round trip then runs on a
        second buffer set of that dtype (on the NVSHMEM backend: allocated here, ``symmetric_bytes`` counts it), so
        ``dy`` reaches the experts unquantized. None (default): no fp8 gradients, no second buffer set.
      check_errors: how a failed round trip is raised (routing errors, capacity overflow, a peer timing out, phases
        out of order; see errors.py). Whatever the setting, a failed round trip's combine output is NaN on every
        rank, and after a protocol failure every later call of this MoEComm returns NaN at once until ``reset()``.

        - True (default): as a ``jax.errors.JaxRuntimeError`` carrying MoECommError's message, on every rank at
          the same call, without a host synchronization per round trip. On the NVSHMEM backend a host-side check in
          front of each round trip raises a failure of the previous jitted call (its first round trip waits until
          the GPU has finished that call's round trips) or of this call from the second round trip after the failed
          one (the host runs at most two round trips ahead of the GPU); the failed step's own outputs are NaN and
          read without error. ``check()`` raises one reported since; ``close()`` raises one that no check raised, and
          at interpreter exit one is printed (stderr). On the reference backend every rank raises at the end of the
          failed round trip (a check on the device's conditional: it runs only when the round trip failed).
        - "sync": at the end of the failed round trip on every backend (on the NVSHMEM backend a check which
          synchronizes the stream every round trip: for debugging).
        - False: nothing is raised; dispatch's own errors stay readable in ``handle.status``, and ``check()``
          raises what the GPU reported.
      timeout_s: seconds a kernel waits for a peer before the round trip fails (NVSHMEM backend). One wait that
        times out ends every wait of the job at once (the failing rank tells every other), so a dead or late peer
        costs one timeout.
      prereduce_min_tokens: from this ``max_tokens`` on, the fused ``combine`` gives the weights to combine_send,
        and the NVSHMEM backend's NVLink path then sums each token's rows on the expert side (one row per token and
        expert rank travels back instead of one per slot); below it they go to combine_recv. Default 64, chosen by
        measurement (benchmarks/NOTES.md): at few tokens the weights' own exchange costs more than the rows it
        saves. ``combine_weights_at`` says which. The same sums either way, within out_dtype's rounding.
      ids_first_min_tokens: from this ``max_tokens`` on (with one replica per DP group, NVLink path), the fused
        ``dispatch`` sends every ids row before any row, so the receive's layout and this rank's own rows are made
        while the rows to peers are on the link. Default 1024, chosen by measurement (benchmarks/NOTES.md): below it
        the extra grid barrier costs more than it hides. The same results bit for bit.
      low_latency_max_tokens: up to this ``max_tokens`` (every peer on NVLink, unwindowed, ``hidden`` a multiple of
        8 and an even number of scale blocks), the fused ``dispatch`` and ``combine`` take the low-latency path: the
        token counts, ids and rows travel in 8-byte words that each carry 4 data bytes and the round trip's epoch,
        so a receiver polls the data itself and no fence, block count or signal stands between a row and its
        reader (twice the bytes on the link; buffers of their own, ``symmetric_bytes`` counts them). Its combine
        sends rows per slot (``combine_weights_at`` is "recv"), so weights given to dispatch stay in the handle; a
        dispatch that quantizes bf16 rows takes the other path. Under ``max_symmetric_bytes`` the path is taken only
        where its buffers fit unwindowed. Default 0 (never), chosen by measurement (benchmarks/NOTES.md): on one H200
        the path is 2-6 µs slower per round trip at 1-32 tokens (its dispatch copies read twice the bytes, a warp
        per row); what it saves, the fences and signals between GPUs, has not been measured on two GPUs. The same
        layout and results bit for bit.
      staged: send through symmetric staging buffers and put-with-signal even where NVLink stores reach every peer
        (the path to peers off NVLink; True tests it on one node). The same results bit for bit.
      max_symmetric_bytes: a bound on the round trips' share of ``symmetric_bytes`` (per GPU; the backward's weights
        exchange, whose rows are K float32 weights, comes on top). None (default): no bound, every row of a round
        trip has its own slot. Below what the config needs, the rows travel in rounds through buffers of one round
        (``window_tokens`` tokens of every DP group a round: the fewest rounds that fit, the tokens split evenly
        among them): the same layout and results bit for bit, at the cost of grid barriers and signal exchanges per
        round (two of each in a dispatch, one or two in a combine); the split halves then overlap nothing: each runs
        its fused call in its second half (``dispatch_recv``, ``combine_recv``). NVLink peers only; a ValueError when
        not even a round of one token per rank fits, or with ``staged=True``.
      expert_weights: True: a dispatch given ``topk_weights`` also returns each row's weight,
        ``Dispatched.expert_weights`` (for routers that scale a token by its weight before the expert), read from the
        tokens' ranks through an XLA ``all_gather`` of every rank's [max_tokens, K] float32 weights at world > 1 (plain
        AD differentiates it). False (default): ``expert_weights`` is None and no collective is added (processes
        sharing one GPU cannot run XLA collectives).
      max_sms: a bound on the SMs each of the NVSHMEM backend's kernels runs on (its grid at most that many blocks
        of 256 threads; the pre-reduced combine's blocks are 512 wide then, the fused one run as its two halves), so
        that compute placed between the split halves, or on another stream, keeps the other SMs. None (default): no
        bound; each kernel sizes its grid from its work, up to several blocks per SM. A smaller budget makes every
        round trip slower and leaves more of the GPU to the caller (the bench measures both: benchmarks/README.md).
        The same results bit for bit.
      send_stream: where the NVSHMEM backend runs the send halves (``dispatch_send``, ``combine_send``), so that
        what XLA schedules between a send and its receive can run beside it. None (default): on XLA's compute
        stream in program order (the work between the halves then starts when the send's kernel ends).
        ``"xla_async"``: XLA's stream annotation (``compute_on("gpu_stream:1")``): each send is an async start/done
        pair on an XLA stream of its own, XLA keeping its operands live and joining it before its receive.
        ``"own"``: a stream of this library's, created with the MoEComm: the send starts after what XLA queued
        before it, its receive makes XLA's stream wait for it and takes its operands (XLA keeps them live until
        then); these halves are then never captured into command buffers. Pair it with ``max_sms`` so the send
        leaves SMs to the compute. It acts on the split halves and on ``beside=`` round trips (whose backward round
        trips run in split halves too); the fused calls and the reference backend are unchanged. The same results
        bit for bit.

    On the NVSHMEM backend's NVLink path the fused ``dispatch`` and ``combine`` run one kernel each (send, then
    receive), the split halves two; the results are the same.

    Per-shard calls (``comm.dispatch`` ...) run inside the user's ``shard_map`` over the mesh (every axis, or the EP
    axes at least) and exchange among the ranks of the caller's EP group. The global view (``jax_moe_comm.dispatch``
    / ``combine``, ``layers.moe_layer``) takes arrays whose dim 0 is ``num_shards`` per-shard blocks sharded
    ``batch_spec`` = ``P((*batch_axes, *ep_axes))``: block ``g * world + r`` is EP rank r of the batch coordinate g
    (row-major over batch_axes). It builds one shard_map over the whole mesh, so an input sharded over fewer axes (or
    replicated) is sliced locally, with no communication besides the EP exchange.

    One MoEComm carries one round trip at a time: dispatch_send, dispatch_recv, combine_send, combine_recv, then
    the next dispatch. Data dependencies give XLA that order within a round trip, between the layers of a model and
    between the forward and backward round trips (with custom_vjp; under jax.checkpoint the round trips are not
    recomputed), so one MoEComm serves every layer of a model: its symmetric memory does not grow with depth.
    Round trips that no data orders need a MoEComm each (e.g. two models computed side by side in one step). On the
    NVSHMEM backend a phase that runs out of this order does nothing and the round trip fails with an "expected
    <phase>" MoECommError; the reference backend has no buffers to share and accepts any order.
    """

    def __init__(self, cfg: MoECommConfig, mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "ep",
                 backend: str = "auto", *, batch_axes: str | tuple[str, ...] | None = None,
                 custom_vjp: bool | None = None, grad_dtype: Any = None, check_errors: bool | str = True,
                 timeout_s: float = 30.0, prereduce_min_tokens: int = 64, ids_first_min_tokens: int = 1024,
                 low_latency_max_tokens: int = 0, staged: bool = False,
                 max_symmetric_bytes: int | None = None, max_sms: int | None = None,
                 send_stream: str | None = None, expert_weights: bool = False) -> None:
        if not isinstance(cfg, MoECommConfig):
            raise ValueError(f"cfg must be a MoECommConfig, got {type(cfg).__name__}")
        if mesh is None:
            mesh = context_mesh()
            if mesh is None:
                raise ValueError("mesh is None and no mesh is set: give the model's mesh, MoEComm(cfg, mesh, "
                                 "axis_name=...), or build the MoEComm under `with jax.set_mesh(mesh):`")
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh (the one the model shards over), got "
                             f"{type(mesh).__name__}")
        ep_axes = ep_axes_of(axis_name, mesh)
        self._ep_axes = ep_axes
        self.batch_axes = batch_axes_of(batch_axes, ep_axes, mesh)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(expert_weights, bool):
            raise ValueError(f"expert_weights must be a bool, got {expert_weights!r}")
        self.expert_weights = expert_weights
        options = Options(check_errors=check_errors, timeout_s=timeout_s, prereduce_min_tokens=prereduce_min_tokens,
                          ids_first_min_tokens=ids_first_min_tokens, low_latency_max_tokens=low_latency_max_tokens,
                          staged=staged, max_symmetric_bytes=max_symmetric_bytes, max_sms=max_sms,
                          send_stream=send_stream)
        self.cfg = cfg
        self.mesh = mesh
        self.axis_name = axis_name if isinstance(axis_name, str) else ep_axes  # as given (a list becomes a tuple)
        self.world = math.prod(int(mesh.shape[a]) for a in ep_axes)
        cfg.validate_world(self.world, ep_axes)
        self.backend = runtime.resolve_backend(backend, mesh)
        self.options = options
        self._geo = Geometry(cfg, self.world, ep_axes, options)
        self.custom_vjp = self.backend == "nvshmem" if custom_vjp is None else bool(custom_vjp)
        if grad_dtype is not None:
            if not cfg.is_fp8:
                raise ValueError(f"grad_dtype is only for float8_e4m3fn payloads; dtype is {cfg.dtype.name} (its "
                                 "gradients travel in that dtype)")
            if np.dtype(grad_dtype) not in COMBINE_DTYPES:
                raise ValueError(f"grad_dtype must be bfloat16, float16 or float32, got {np.dtype(grad_dtype).name}")
        self.grad_dtype = None if grad_dtype is None else np.dtype(grad_dtype)
        # An fp8 layer's backward round trips (see autodiff.py) carry grad_dtype rows on the same buffers, each
        # buffer sized for the larger of the two configs; they run in turn with the forward's (data orders them).
        grad_geo = None if grad_dtype is None else Geometry(cfg.gradient_config(self.world, grad_dtype), self.world,
                                                            ep_axes, options)
        self._shared_with = () if grad_geo is None else (grad_geo.cfg,)
        # The window of a job on NVLink (the reference backend has no heap, but refuses the same bounds).
        self._window_slots, low_latency = nvshmem_backend.window_and_path(
            cfg, self.world, options.max_symmetric_bytes, options.staged, self._shared_with,
            low_latency_max_tokens=options.low_latency_max_tokens)
        # The low-latency path's combine is per slot: the weights go to combine_recv there.
        prereduce = cfg.max_tokens >= options.prereduce_min_tokens and not low_latency
        self.combine_weights_at = "send" if prereduce else "recv"
        # Combine's gradient rule at world > 1 sends the weights out and their gradients home through a round trip
        # of its own on buffers of its own (autodiff.py): the backward then issues no XLA collective. Its failures
        # are raised by check(), close() and at exit, not by a check in front of each of its round trips: its
        # routing is the forward's, whose round trip has reported any routing error already (only its protocol
        # failures are its own).
        self._custom_vjp_given = custom_vjp
        self._weights_geo = None
        if self.custom_vjp and self.world > 1:
            self._weights_geo = Geometry(cfg.weights_exchange_config(self.world), self.world, ep_axes,
                                         dataclasses.replace(options, max_symmetric_bytes=None, check_errors=False))
        weights_geo = self._weights_geo
        if self.backend == "nvshmem":
            impl, plan = nvshmem_backend, nvshmem_backend.create_plan(self._geo, mesh, self._shared_with)
            grad_plan = None if grad_geo is None else nvshmem_backend.share_plan(plan, grad_geo)
            try:
                weights_plan = None if weights_geo is None else nvshmem_backend.create_plan(weights_geo, mesh)
            except Exception:
                if grad_plan is not None:
                    nvshmem_backend.destroy_plan(grad_plan)
                nvshmem_backend.destroy_plan(plan)
                raise
        else:
            impl, plan, grad_plan, weights_plan = reference, self._geo, grad_geo, weights_geo
        grad = None if grad_geo is None else autodiff.Phases(impl, grad_plan, grad_geo, self.combine_weights_at)
        weights = None if weights_geo is None else autodiff.Phases(impl, weights_plan, weights_geo, "recv")
        self._phases = autodiff.Phases(impl, plan, self._geo, self.combine_weights_at, grad, weights)
        # The custom VJPs take symbolic zeros (autodiff.py), which an eager shard_map refuses; inside jit every
        # composition takes them, so the differentiable calls are jitted (a no-op inside a caller's jit).
        self._dispatch_vjp = jax.jit(lambda *args: autodiff.dispatch(self._phases, *args))
        self._combine_vjp = jax.jit(lambda *args: autodiff.combine(self._phases, *args))
        # With a computation beside the round trip (its function static: a jit of its own per function).
        self._dispatch_beside_vjp = jax.jit(lambda compute, *args: autodiff.dispatch_beside(self._phases, compute,
                                                                                            *args), static_argnums=0)
        self._combine_beside_vjp = jax.jit(lambda compute, *args: autodiff.combine_beside(self._phases, compute,
                                                                                          *args), static_argnums=0)
        if self.backend == "nvshmem" and self.options.check_errors is True:  # failures raised later: see close()
            global _exit_report_registered
            _OPEN.add(self)
            if not _exit_report_registered:
                atexit.register(_report_unraised_at_exit)
                _exit_report_registered = True

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    # Axes and the global view's layout ---------------------------------------------------------------
    @property
    def ep_axes(self) -> tuple[str, ...]:
        """The EP axes as a tuple (``("ep",)`` for ``axis_name="ep"``)."""
        return self._ep_axes

    @property
    def batch_spec(self) -> P:
        """PartitionSpec of dim 0 of the global view's arrays: sharded over ``batch_axes`` then the EP axes."""
        return dim0_spec((*self.batch_axes, *self.ep_axes))

    @property
    def num_shards(self) -> int:
        """Per-shard blocks along dim 0 of the global view's arrays: the product of the batch axes' sizes times
        ``world`` (x has ``num_shards * max_tokens`` rows)."""
        return math.prod(int(self.mesh.shape[a]) for a in self.batch_axes) * self.world

    def check(self) -> None:
        """Raises MoECommError for a failure the device has reported and no check has raised yet (NVSHMEM backend;
        no synchronization: call it after the step's outputs are ready, e.g. after the last step). A routing error
        is raised once; a protocol failure until ``reset()``. The reference backend raises in the round trip."""
        for plan in self._plans():  # an fp8 layer's backward round trips share the first's host words
            try:
                nvshmem_backend.raise_pending(plan)
            except errors.MoECommError as exc:
                if self._reports(plan, str(exc)):
                    raise

    def reset(self) -> None:
        """After a failure, the MoEComm as created (NVSHMEM backend; collective: every process calls it, after the
        failed step has ended). Waits for this device's queued work. A no-op on the reference backend, which keeps
        no state between calls."""
        for plan in self._plans():  # an fp8 layer's backward round trips share the first's state
            nvshmem_backend.reset_plan(plan)

    def close(self) -> None:
        """Frees the NVSHMEM symmetric buffers (collective: every process closes its MoEComm in the same order). With
        check_errors=True it waits for this device's queued work first and then raises MoECommError for a failure that
        no check has raised (after freeing: the MoEComm is closed either way)."""
        if self.backend == "nvshmem" and self._phases is not None:
            unraised = self._take_unraised() if self in _OPEN else None
            if self._phases.grad is not None:  # before the buffers it shares
                nvshmem_backend.destroy_plan(self._phases.grad.plan)
            for plan in self._plans():
                nvshmem_backend.destroy_plan(plan)
            self._phases = None
            _OPEN.discard(self)
            if unraised is not None:
                raise errors.MoECommError(unraised)

    def _reports(self, plan, text: str) -> bool:
        """Whether a failure of `plan` is raised: the weights exchange's routing errors are the forward's, which its
        own round trip reports; its protocol failures (a peer late, phases out of order) are its own."""
        exchange = self._phases is not None and self._phases.weights is not None and plan is self._phases.weights.plan
        return not exchange or text.endswith(errors.FATAL_SUFFIX)

    def _take_unraised(self) -> str | None:
        """The first failure of this MoEComm's plans that no check has raised (waits for this device's queued work),
        now counted as raised; None if there is none."""
        found = None
        for plan in self._plans():
            text = nvshmem_backend.take_unraised(plan)
            if found is None and text is not None and self._reports(plan, text):
                found = text
        return found

    def _plans(self) -> list:
        """The NVSHMEM plans with buffers and protocol state of their own: the round trips', then the backward's
        weights exchange's (none on the reference backend or once closed)."""
        if self.backend != "nvshmem" or self._phases is None:
            return []
        return [self._phases.plan] + ([] if self._phases.weights is None else [self._phases.weights.plan])

    # Static sizes ------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Rows of ``expert_x`` per shard."""
        return self._geo.capacity

    @property
    def num_local_experts(self) -> int:
        return self._geo.L

    @property
    def symmetric_bytes(self) -> int:
        """NVSHMEM symmetric heap this MoEComm takes per GPU on the NVSHMEM backend: what it allocated (with the
        staging buffers only where a peer is off NVLink or ``staged=True``). The reference backend uses none; it
        reports the figure of a job on NVLink, for sizing NVSHMEM_SYMMETRIC_SIZE. One MoEComm serves every layer of
        a model, so this is the model's heap (an fp8 payload's backward round trips in grad_dtype included: they
        share the buffers, each sized for the larger config; with custom_vjp at world > 1, the backward's weights
        exchange included: buffers of its own, rows of K float32 weights)."""
        if self.backend == "nvshmem" and self._phases is not None:
            return sum(nvshmem_backend.plan_bytes(plan) for plan in self._plans())
        total = nvshmem_backend.symmetric_bytes(self.cfg, self.world, staging=self.options.staged,
                                                shared_with=self._shared_with,
                                                max_bytes=self.options.max_symmetric_bytes,
                                                low_latency_max_tokens=self.options.low_latency_max_tokens)
        # With the weights exchange that an NVSHMEM MoEComm of these options would allocate (custom_vjp by default).
        if self.world > 1 and (self._weights_geo is not None or self._custom_vjp_given is None):
            total += memory.weights_exchange_bytes(self.cfg, self.world, self.options.staged,
                                                   self.options.low_latency_max_tokens)
        return total

    @property
    def window_tokens(self) -> int | None:
        """Tokens of each DP group that one round of a windowed round trip moves (``max_symmetric_bytes``), or None:
        no window, every row in one round."""
        slots = self._window_slots
        if self.backend == "nvshmem" and self._phases is not None:
            slots = self._phases.plan.window_slots  # the job's: as allocated
        return None if slots is None else slots * self.cfg.dp_size

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items())
        return (f"MoEComm(world={self.world}, ep_axes={self.ep_axes!r}, batch_axes={self.batch_axes!r}, "
                f"backend={self.backend!r}, capacity={self.capacity}, "
                f"custom_vjp={self.custom_vjp}, grad_dtype={self.grad_dtype}, {options}, "
                f"expert_weights={self.expert_weights}, cfg={self.cfg})")

    # Argument checks ---------------------------------------------------------------------------------
    def _rows_of(self, x) -> int:
        """The tokens per shard of a call: x's rows, 1 <= n <= max_tokens; ValueError naming x otherwise."""
        c = self.cfg
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != 2:
            raise ValueError(f"x must be an array [n, hidden] (n <= max_tokens = {c.max_tokens}), got "
                             f"{type(x).__name__ if shape is None else tuple(shape)}")
        n = int(shape[0])
        if not 1 <= n <= c.max_tokens:
            raise ValueError(f"x has {n} rows per shard; one MoEComm takes 1 to max_tokens ({c.max_tokens}): raise "
                             "MoECommConfig.max_tokens to the largest batch (per shard) the model runs")
        return n

    def _padded(self, a, rows: int, fill=0):
        """a [rows, ...] padded with `fill` to [max_tokens, ...] (None stays None)."""
        pad = self.cfg.max_tokens - rows
        if a is None or pad == 0:
            return a
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)

    def _prepare_dispatch(self, x, topk_ids, scales, num_tokens, topk_weights, quantize):
        """The dispatch's arguments checked and padded to max_tokens rows: (n, x, topk_ids, scales, num_tokens,
        topk_weights as float32 or None)."""
        n = self._rows_of(x)
        num_tokens = self._check_dispatch_args(x, topk_ids, scales, num_tokens, quantize, rows=n)
        if topk_weights is not None:
            topk_weights = self._check_weights(topk_weights, n)
        return (n, self._padded(x, n), self._padded(topk_ids, n, -1), self._padded(scales, n), num_tokens,
                self._padded(topk_weights, n))

    def _check_dispatch_args(self, x, topk_ids, scales, num_tokens, quantize=None, rows=None):
        c = self.cfg
        n = c.max_tokens if rows is None else rows
        if quantize is not None:
            if not c.is_fp8 or np.dtype(quantize) != c.dtype:
                raise ValueError("quantize must be the MoEComm's fp8 payload dtype (MoECommConfig(dtype="
                                 f"jnp.float8_e4m3fn)); got quantize={np.dtype(quantize).name} with dtype "
                                 f"{c.dtype.name}")
            _check_array("x", x, (n, c.hidden), (jnp.bfloat16,), "bfloat16 (quantize takes bf16 rows)")
            if scales is not None:
                raise ValueError("scales must be None with quantize: the dispatch computes them")
        else:
            _check_array("x", x, (n, c.hidden), (c.dtype,))
        _check_array("topk_ids", topk_ids, (n, c.experts_per_token), (jnp.int32,))
        if c.is_fp8 and quantize is None:
            if scales is None:
                raise ValueError("scales is required for float8_e4m3fn payloads: "
                                 "float32 [max_tokens, hidden // scale_block]")
            _check_array("scales", scales, (n, c.scale_cols), (jnp.float32,))
        elif scales is not None and not c.is_fp8:
            raise ValueError(f"scales is only for float8_e4m3fn payloads; dtype is {c.dtype.name}")
        if num_tokens is None:
            return jnp.int32(n)
        num_tokens = jnp.asarray(num_tokens)
        if num_tokens.shape != () or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise ValueError("num_tokens must be an integer scalar (per shard), "
                             f"got {num_tokens.dtype}{list(num_tokens.shape)}")
        return jnp.clip(num_tokens.astype(jnp.int32), 0, n)

    def _check_handle(self, handle):
        if not isinstance(handle, CombineHandle):
            raise ValueError(f"handle must be the CombineHandle from dispatch, got {type(handle).__name__}")

    def _check_combine_args(self, expert_y, handle):
        self._check_handle(handle)
        _check_array("expert_y", expert_y, (self.capacity, self.cfg.hidden), None)
        dtype, out = np.dtype(expert_y.dtype), self.cfg.out_dtype
        if dtype not in COMBINE_DTYPES or dtype.itemsize > out.itemsize:
            raise ValueError(f"expert_y must have dtype bfloat16, float16 or float32 no wider than out_dtype "
                             f"({out.name}); got {dtype.name}")

    def _check_weights(self, topk_weights, rows: int | None = None) -> Array:
        """topk_weights [rows, K] of a float dtype (default rows: max_tokens), as float32 (differentiable)."""
        c = self.cfg
        rows = c.max_tokens if rows is None else rows
        _check_array("topk_weights", topk_weights, (rows, c.experts_per_token), None)
        if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
            raise ValueError(f"topk_weights must have a float dtype (cast to float32 inside), got "
                             f"{np.dtype(topk_weights.dtype).name}")
        return topk_weights.astype(jnp.float32)

    def _check_combine_weights(self, handle: CombineHandle, topk_weights, where: str = "combine") -> None:
        """Weights given to dispatch (in the handle) are the combine's: then none may be given to it. The backends
        read None with a handle that has weights as "the handle's, sent with dispatch"."""
        if handle.topk_weights is not None:
            if topk_weights is not None:
                raise ValueError(f"topk_weights went with dispatch (they are in the handle): give none to {where}")
        elif topk_weights is not None:
            self._check_weights(topk_weights, handle.rows or self.cfg.max_tokens)

    # Per-shard API (inside shard_map over the mesh: the EP axes at least) -------------------------------
    def dispatch_send(self, x: Array, topk_ids: Array, scales: Array | None = None,
                      num_tokens: Array | None = None, topk_weights: Array | None = None, quantize: Any = None):
        """Starts sending tokens to their experts' ranks; returns a pending pytree for ``dispatch_recv``.

        x: [max_tokens, H] cfg.dtype (bfloat16 with ``quantize``); topk_ids: int32 [max_tokens, K] in [-1, E);
        scales: float32 [max_tokens, H // B] (fp8 only, none with ``quantize``); num_tokens: int32 scalar, rows >=
        num_tokens are ignored; topk_weights: [max_tokens, K] of a float dtype (cast to float32) or None, the
        combine's weights sent now (see ``dispatch``); quantize: see ``dispatch``. The split halves take max_tokens
        rows (the fused ``dispatch`` takes fewer).
        """
        self._check_program_mesh("dispatch_send")
        num_tokens = self._check_dispatch_args(x, topk_ids, scales, num_tokens, quantize)
        if topk_weights is not None:
            topk_weights = self._check_weights(topk_weights)
        x, scales, topk_weights = self._without_gradient("dispatch_send", x, scales, topk_weights)
        return self._phases.impl.dispatch_send(self._phases.plan, x, topk_ids, scales, num_tokens, topk_weights)

    def dispatch_recv(self, pending) -> Dispatched:
        """Waits for the rows of ``dispatch_send`` and returns them packed by local expert."""
        self._check_program_mesh("dispatch_recv")
        d = self._phases.impl.dispatch_recv(self._phases.plan, pending)
        d = load.with_load(self._geo, autodiff.with_grad_link(d))
        return self._with_row_fields(d, d.handle.topk_weights)

    def dispatch(self, x: Array, topk_ids: Array, scales: Array | None = None,
                 num_tokens: Array | None = None, topk_weights: Array | None = None,
                 quantize: Any = None, *, beside: tuple | None = None):
        """``dispatch_recv(dispatch_send(...))``: see Dispatched for the layout. Differentiable (see custom_vjp).
        With ``beside``, ``(Dispatched, compute's result)``: see ``beside`` below.

        x: [n, H] cfg.dtype (bfloat16 with ``quantize``), any n from 1 to max_tokens: one MoEComm serves every batch
        size up to its maximum (padded to max_tokens inside; ``combine`` then returns [n, H]); topk_ids int32 [n, K]
        in [-1, E); scales float32 [n, H // B] (fp8); num_tokens: int32 scalar, default n, clipped to [0, n]: rows
        from it on are ignored.

        topk_weights ([n, K] of any float dtype, cast to float32; optional): the combine's weights, given here instead
        of to combine (they land in ``handle.topk_weights``, and combine then takes none), and each row's weight in
        ``expert_weights``. The NVSHMEM backend's NVLink path sends them with the tokens' ids, so its pre-reduced
        combine need not exchange them (one signal round trip less).

        quantize (``jnp.float8_e4m3fn``, for an fp8 MoEComm): x is bfloat16 and the dispatch quantizes it, with block
        scales of ``scale_block``: the same expert_x / expert_scales as ``dispatch(*quantize_rows(x, scale_block),
        ...)`` (jax_moe_comm.quantize), bit for bit; NaN and infinities stay non-finite (see quantize_rows). The
        NVSHMEM kernels quantize each row as they send it, so no XLA op of its own runs. Gradients pass the
        quantization straight through to x (``grad_dtype`` as for fp8; the cotangent of the fp8 expert_x is fp8, as
        JAX gives a cotangent its primal's dtype).

        beside: ``(compute, *args)``, e.g. a shared expert: ``compute(*args)`` runs between the round trip's halves
        (as ``between`` places it) and the result is ``(Dispatched, compute(*args))``. Differentiable with the round
        trip, custom_vjp included: compute's VJP runs between the halves of the backward round trip, so with a
        ``send_stream`` it overlaps the send half forward and backward. compute must not call this MoEComm, and
        differentiates only its args (JAX refuses a gradient through a value it closes over)."""
        self._check_program_mesh("dispatch")
        n, x, topk_ids, scales, num_tokens, topk_weights = self._prepare_dispatch(x, topk_ids, scales, num_tokens,
                                                                                  topk_weights, quantize)
        args = (x, topk_ids, scales, num_tokens, topk_weights)
        if beside is not None:
            d, out = self._beside(beside, self._dispatch_beside_vjp, self._phases.dispatch_beside, *args)
        elif self.custom_vjp:
            d = self._dispatch_vjp(*args)
        else:
            d = self._phases.dispatch(*args)
        d = self._with_row_fields(load.with_load(self._geo, d), topk_weights)
        if n != self.cfg.max_tokens:
            d = dataclasses.replace(d, handle=dataclasses.replace(d.handle, rows=n))
        return d if beside is None else (d, out)

    def _beside(self, beside, fused_vjp, phases_call, *operands):
        """(a round trip in split halves with compute(*args) between them, its result): with custom_vjp its rules
        (which differentiate args), else plain AD."""
        if not (isinstance(beside, tuple) and beside and callable(beside[0])):
            raise ValueError(f"beside must be a tuple (function, *args), the computation between the halves; got "
                             f"{type(beside).__name__}")
        compute, *args = beside
        if self.custom_vjp:
            try:  # a static argument of the jitted rule: one that cannot be hashed (a module) is hashed by identity
                hash(compute)
            except TypeError:
                compute = functools.partial(compute)
            return fused_vjp(compute, tuple(args), *operands)
        return phases_call(lambda p: autodiff.between(p, compute, *args), *operands)

    def _with_row_fields(self, d: Dispatched, topk_weights: Array | None) -> Dispatched:
        """d with each row's local expert (``expert_ids``, -1 where no token) and, given the weights [max_tokens, K]
        float32 and MoEComm(expert_weights=True), its weight (``expert_weights``): from group_sizes and row_origin,
        alike on every backend. The weights come from their tokens' ranks through an all_gather of every rank's
        [max_tokens, K] (plain AD differentiates it); at world 1 every row is local."""
        origin = d.handle.row_origin
        has_token = origin >= 0
        ends = jnp.cumsum(d.group_sizes)
        expert = jnp.searchsorted(ends, jnp.arange(origin.shape[0], dtype=ends.dtype), side="right")
        expert_ids = jnp.where(has_token, expert, -1).astype(jnp.int32)
        expert_weights = None
        if topk_weights is not None and self.expert_weights:
            if self.world == 1:
                every = topk_weights.reshape(-1)
            else:  # [world, T, K], group g's tokens on its first replica, rank g * dp_size
                every = jax.lax.all_gather(topk_weights, self._ep_axes)[::self.cfg.dp_size].reshape(-1)
            expert_weights = jnp.where(has_token, every[jnp.where(has_token, origin, 0)], 0.0)
        return dataclasses.replace(d, expert_ids=expert_ids, expert_weights=expert_weights)

    def combine_send(self, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None):
        """Starts sending expert outputs [capacity, H] back to their tokens' ranks (bf16/fp16/fp32, no wider
        than out_dtype). The weights [max_tokens, K] go either here or to combine_recv; given here, the NVSHMEM
        backend sums each token's rows on the expert side and sends one row per (token, expert rank) instead of
        one per slot (rows in the output dtype: within its rounding of the per-slot sum). With weights in the handle
        (given to dispatch) none are given here or to combine_recv: they count as given here."""
        self._check_program_mesh("combine_send")
        self._check_combine_args(expert_y, handle)
        self._check_combine_weights(handle, topk_weights, "combine_send")
        handle, topk_weights = self._full_rows(handle, topk_weights)
        expert_y, topk_weights = self._without_gradient("combine_send", expert_y, topk_weights)
        return self._phases.impl.combine_send(self._phases.plan, expert_y, handle, topk_weights)

    def combine_recv(self, pending, topk_weights: Array | None = None) -> Array:
        """Waits for the expert rows and returns y [max_tokens, H] out_dtype, y[i] = sum_k w[i,k] row(i,k) (max_tokens
        rows even after a dispatch of fewer: slice them). topk_weights: [max_tokens, K] of a float dtype, here
        exactly when combine_send did not get them (nor dispatch)."""
        self._check_program_mesh("combine_recv")
        if topk_weights is not None:
            topk_weights = self._check_weights(topk_weights)
        if (topk_weights is None) == (getattr(pending, "topk_weights", None) is None):
            raise ValueError("topk_weights must be given to exactly one of dispatch, combine_send and combine_recv")
        (topk_weights,) = self._without_gradient("combine_recv", topk_weights)
        return self._phases.impl.combine_recv(self._phases.plan, pending, topk_weights)

    def between(self, pending, compute, *args):
        """``compute(*args)`` placed between a send half and its receive: after the send that made ``pending``
        (``dispatch_send`` or ``combine_send``) and before the receive that takes it. Returns ``(compute's result,
        pending)``; give that ``pending`` to the receive.

        Nothing else orders work that does not use the rows in flight: XLA's scheduler may put it before the send or
        after the receive. With ``send_stream`` set, work so placed runs beside the send's kernel. Two
        ``lax.optimization_barrier``s tie ``args`` to the send's result and the receive's operands to the compute's;
        no kernel of its own, the same results on every backend, differentiable through ``compute``."""
        return autodiff.between(pending, compute, *args)

    def _without_gradient(self, method: str, *arrays):
        """`arrays` as they are (None kept); with custom_vjp, each one's derivative raises a ValueError naming
        `method`: the gradient rules are the fused calls' (the NVSHMEM kernels have no other), so a split half
        refuses a gradient alike on both backends. Without custom_vjp (the reference backend's plain AD) JAX
        differentiates the split halves."""
        if not self.custom_vjp:
            return arrays
        refuse = _refusing_derivative(method)
        return tuple(None if a is None else refuse(a) for a in arrays)

    def combine(self, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None, *,
                weighted: bool = True, beside: tuple | None = None):
        """``combine_recv(combine_send(expert_y, handle), topk_weights)``: y [n, H] out_dtype for a dispatch of n
        tokens, y[i] = sum_k w[i,k] row(i,k). Differentiable (see custom_vjp). topk_weights: [n, K] of any float
        dtype (cast to float32), unless dispatch got them (then None: the handle's are used). With ``beside``
        (see ``dispatch``), ``(y, compute's result)``.

        weighted: True (default) weighs each slot's row as above; False sums the live slots' rows with weight 1 and
        takes no weights (the handle's are ignored): for routers that scale each row by its weight before the expert
        (``d.expert_x * d.expert_weights[:, None]``, the weights given to dispatch), so they are applied once."""
        self._check_program_mesh("combine")
        if not isinstance(weighted, bool):
            raise ValueError(f"weighted must be a bool, got {weighted!r}")
        if not weighted:
            if topk_weights is not None:
                raise ValueError("weighted=False sums the rows with weight 1: give no topk_weights")
            self._check_handle(handle)
            handle = dataclasses.replace(handle, topk_weights=None)
            topk_weights = jnp.ones((handle.rows or self.cfg.max_tokens, self.cfg.experts_per_token), jnp.float32)
        self._check_combine_args(expert_y, handle)
        if handle.topk_weights is None and topk_weights is None:
            raise ValueError("topk_weights is required: give them to combine or to dispatch")
        self._check_combine_weights(handle, topk_weights)
        rows = handle.rows or self.cfg.max_tokens
        handle, topk_weights = self._full_rows(handle, topk_weights)
        if beside is not None:
            y, out = self._beside(beside, self._combine_beside_vjp, self._phases.combine_beside, expert_y, handle,
                                  topk_weights)
        elif self.custom_vjp:
            y = self._combine_vjp(expert_y, handle, topk_weights)
        else:
            y = self._phases.combine(expert_y, handle, topk_weights)
        y = y if rows == self.cfg.max_tokens else y[:rows]
        return y if beside is None else (y, out)

    def _full_rows(self, handle: CombineHandle, topk_weights):
        """(the handle as the backends take it, without rows; the weights float32, padded to max_tokens rows)."""
        rows = handle.rows or self.cfg.max_tokens
        if topk_weights is not None:
            topk_weights = self._padded(self._check_weights(topk_weights, rows), rows)
        return (handle if handle.rows is None else dataclasses.replace(handle, rows=None)), topk_weights

    def _check_program_mesh(self, method: str) -> None:
        """ValueError naming both meshes when the program runs under another mesh than this MoEComm's (``jax.set_mesh``
        or a shard_map over another mesh): JAX's own error ("should be the same across the entire program") names
        neither."""
        check_program_mesh(self.mesh, method)


@functools.cache
def _refusing_derivative(method: str):
    """The identity, whose derivative (taken only where a tangent flows) raises a ValueError naming `method`."""

    @jax.custom_jvp
    def identity(a):
        return a

    @identity.defjvp
    def _refuse(primals, tangents):
        raise ValueError(f"{method} has no gradient with custom_vjp=True (the NVSHMEM backend's default): "
                         "differentiate comm.dispatch and comm.combine (the fused calls), or put the split halves "
                         "under jax.lax.stop_gradient")

    return identity


# Global view --------------------------------------------------------------------------------------------
def _lift_scalars(tree):
    """Per-shard scalars become [1] so they can be concatenated over the batch and EP axes."""
    return jax.tree.map(lambda a: a.reshape(1) if a.ndim == 0 else a, tree)


def placed(mesh: Mesh, tree, specs):
    """``tree`` sharded as ``specs`` (a PartitionSpec or a matching tree of them) for a shard_map over ``mesh``. On a
    mesh with Explicit axes (``jax.make_mesh``'s default) shard_map takes only arrays already sharded as its
    in_specs, so they are resharded here; from fewer axes (``P("data")``, replicated) to more that is a local slice.
    On Auto axes shard_map does the same by itself."""
    if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return tree
    if isinstance(specs, P):
        return jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, specs)), tree)
    return jax.tree.map(lambda a, s: jax.sharding.reshard(a, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda leaf: leaf is None)


def _per_shard(comm: MoEComm, fn, *args):
    """fn on every shard of the whole mesh: dim 0 of every argument and result split as ``comm.batch_spec``.
    Mapping every mesh axis (not only the EP axes) is what lets XLA slice an input sharded over fewer axes locally
    instead of resharding it, and keeps the EP groups of different batch coordinates apart."""
    check_program_mesh(comm.mesh, "global view")
    spec = comm.batch_spec
    mapped = jax.shard_map(lambda *a: _lift_scalars(fn(*a)), mesh=comm.mesh, in_specs=spec, out_specs=spec)
    return mapped(*placed(comm.mesh, args, spec))


def _check_global_rows(comm: MoEComm, name: str, value: Any, rows_per_shard: int, what: str) -> None:
    """ValueError naming `name` unless dim 0 of `value` (if an array) holds num_shards blocks of rows_per_shard rows.
    Checked before the shard_map, whose per-shard message would not say what the global shape must be."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] == comm.num_shards * rows_per_shard:
        return  # not an array: the per-shard checks name the problem
    raise ValueError(f"{name} must have num_shards * {what} = {comm.num_shards} * {rows_per_shard} rows (one block per "
                     f"rank, sharded {comm.batch_spec}; batch_axes=() replicates the batch over the other mesh axes), "
                     f"got shape {tuple(shape)}")


def _check_global_num_tokens(comm: MoEComm, num_tokens: Any) -> None:
    """ValueError unless num_tokens is an integer array [num_shards]: one count per rank (per block of x)."""
    if not hasattr(num_tokens, "shape") or tuple(num_tokens.shape) != (comm.num_shards,):
        got = f"shape {tuple(num_tokens.shape)}" if hasattr(num_tokens, "shape") else type(num_tokens).__name__
        raise ValueError(f"num_tokens must have shape ({comm.num_shards},) = (num_shards,) (one count per rank), "
                         f"got {got}")
    if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(f"num_tokens must be integer (one count per rank), got {np.dtype(num_tokens.dtype).name}")


def dispatch(comm: MoEComm, x: Array, topk_ids: Array, scales: Array | None = None,
             num_tokens: Array | None = None, topk_weights: Array | None = None, quantize: Any = None) -> Dispatched:
    """Global-view dispatch on arrays sharded ``comm.batch_spec`` on dim 0 (usable inside ``jit``).

    With N = ``comm.num_shards`` (= world on a mesh of the EP axes only; block ``g * world + r`` is EP rank r of
    batch coordinate g): x [N * max_tokens, H]; topk_ids int32 [N * max_tokens, K]; scales float32
    [N * max_tokens, H // B] (fp8); num_tokens int32 [N] (one count per block) or None; topk_weights float32
    [N * max_tokens, K] or None; quantize (see MoEComm.dispatch).
    Returns a Dispatched whose arrays are the per-shard results concatenated in block order:
    expert_x [N * capacity, H], group_sizes [N * L], handle.row_origin [N * capacity], handle.num_tokens [N],
    expert_counts [N * E] (every block the same counts), dropped_rows [N].
    """

    for name, value in (("x", x), ("topk_ids", topk_ids), ("scales", scales), ("topk_weights", topk_weights)):
        _check_global_rows(comm, name, value, comm.cfg.max_tokens, "max_tokens")
    if num_tokens is not None:
        _check_global_num_tokens(comm, num_tokens)

    def shard_fn(x, topk_ids, scales, num_tokens, topk_weights):
        count = None if num_tokens is None else num_tokens.reshape(())
        return comm.dispatch(x, topk_ids, scales, count, topk_weights, quantize)

    return _per_shard(comm, shard_fn, x, topk_ids, scales, num_tokens, topk_weights)


def combine(comm: MoEComm, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None) -> Array:
    """Global-view combine (N = ``comm.num_shards``): expert_y [N * capacity, H], the global handle from
    ``dispatch``, topk_weights float32 [N * max_tokens, K] (None when dispatch got them) -> y [N * max_tokens, H]
    out_dtype, sharded ``comm.batch_spec``."""

    _check_global_rows(comm, "expert_y", expert_y, comm.capacity, "capacity")
    _check_global_rows(comm, "topk_weights", topk_weights, comm.cfg.max_tokens, "max_tokens")

    def shard_fn(expert_y, handle, topk_weights):
        handle = dataclasses.replace(handle, num_tokens=handle.num_tokens.reshape(()))
        return comm.combine(expert_y, handle, topk_weights)

    return _per_shard(comm, shard_fn, expert_y, handle, topk_weights)

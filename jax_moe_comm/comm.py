"""Public API: MoEComm, its per-shard calls, and the global-view wrappers.

Per-shard calls (``comm.dispatch`` ...) run inside the user's ``shard_map`` over ``axis_name``; the module-level
``dispatch``/``combine`` take arrays sharded over that axis and need no user-written shard_map.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import autodiff, nvshmem_backend, reference, runtime
from .config import Geometry, MoECommConfig, Options
from .types import CombineHandle, Dispatched

BACKENDS = ("auto", "nvshmem", "reference")
COMBINE_DTYPES = [np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)]


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
    """Dispatch/combine for one MoE layer over the mesh axis ``axis_name``.

    Args:
      cfg: the layer's MoECommConfig.
      mesh: a jax Mesh with an axis named ``axis_name`` (the EP axis; other axes are left alone).
      axis_name: the EP axis; its size is the world.
      backend: "reference" (pure JAX collectives, any platform), "nvshmem" (CUDA kernels; needs the CUDA
        extension and ``jax_moe_comm.initialize()``), or "auto" (nvshmem when available, else reference).
      custom_vjp: differentiate the fused ``dispatch``/``combine`` with the rules of ``autodiff.py`` (built from
        the backend's own phases) instead of plain JAX AD. None (default): True on the NVSHMEM backend (its custom
        calls have no other gradient), False on the reference backend (plain AD through its collectives).
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
          one (the host runs at most two round trips ahead of the GPU). On the reference backend every rank raises
          at the end of the failed round trip (a host callback). ``check()`` raises one reported since.
        - "sync": at the end of the failed round trip on every backend (a host callback, which synchronizes the
          stream every round trip: for debugging).
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
      staged: send through symmetric staging buffers and put-with-signal even where NVLink stores reach every peer
        (the path to peers off NVLink; True tests it on one node). The same results bit for bit.

    On the NVSHMEM backend's NVLink path the fused ``dispatch`` and ``combine`` run one kernel each (send, then
    receive), the split halves two; the results are the same.

    One MoEComm carries one round trip at a time: dispatch_send, dispatch_recv, combine_send, combine_recv, then
    the next dispatch. Data dependencies give XLA that order within a round trip (and, with custom_vjp, between
    the forward and backward round trips); independent round trips need a MoEComm each (e.g. one per layer, and
    separate ones for two models in one step). On the NVSHMEM backend a phase that runs out of this order does
    nothing and the round trip fails with an "expected <phase>" MoECommError; the reference backend has no
    buffers to share and accepts any order.
    """

    def __init__(self, cfg: MoECommConfig, mesh: Mesh, axis_name: str = "ep", backend: str = "auto", *,
                 custom_vjp: bool | None = None, grad_dtype: Any = None, check_errors: bool | str = True,
                 timeout_s: float = 30.0, prereduce_min_tokens: int = 64, ids_first_min_tokens: int = 1024,
                 staged: bool = False) -> None:
        if not isinstance(cfg, MoECommConfig):
            raise ValueError(f"cfg must be a MoECommConfig, got {type(cfg).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        options = Options(check_errors=check_errors, timeout_s=timeout_s, prereduce_min_tokens=prereduce_min_tokens,
                          ids_first_min_tokens=ids_first_min_tokens, staged=staged)
        self.cfg = cfg
        self.mesh = mesh
        self.axis_name = axis_name
        self.world = int(mesh.shape[axis_name])
        cfg.validate_world(self.world, axis_name)
        self.backend = runtime.resolve_backend(backend, mesh)
        self.options = options
        self._geo = Geometry(cfg, self.world, axis_name, options)
        self.custom_vjp = self.backend == "nvshmem" if custom_vjp is None else bool(custom_vjp)
        if grad_dtype is not None:
            if not cfg.is_fp8:
                raise ValueError(f"grad_dtype is only for float8_e4m3fn payloads; dtype is {cfg.dtype.name} (its "
                                 "gradients travel in that dtype)")
            if np.dtype(grad_dtype) not in COMBINE_DTYPES:
                raise ValueError(f"grad_dtype must be bfloat16, float16 or float32, got {np.dtype(grad_dtype).name}")
        self.grad_dtype = None if grad_dtype is None else np.dtype(grad_dtype)
        self.combine_weights_at = "send" if cfg.max_tokens >= options.prereduce_min_tokens else "recv"
        if self.backend == "nvshmem":
            impl, plan = nvshmem_backend, nvshmem_backend.create_plan(self._geo, mesh)
        else:
            impl, plan = reference, self._geo
        # The buffers of an fp8 layer's backward round trip (see autodiff.py), in grad_dtype.
        self._grad_comm = None if grad_dtype is None else MoEComm(
            dataclasses.replace(cfg, dtype=grad_dtype, scale_block=None, capacity=self.capacity), mesh, axis_name,
            backend=self.backend, custom_vjp=False, **dataclasses.asdict(options))
        self._phases = autodiff.Phases(impl, plan, self._geo, self.combine_weights_at,
                                       None if self._grad_comm is None else self._grad_comm._phases)

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    def check(self) -> None:
        """Raises MoECommError for a failure the device has reported and no check has raised yet (NVSHMEM backend;
        no synchronization: call it after the step's outputs are ready, e.g. after the last step). A routing error
        is raised once; a protocol failure until ``reset()``. The reference backend raises in the round trip."""
        if self.backend == "nvshmem" and self._phases is not None:
            nvshmem_backend.raise_pending(self._phases.plan)
            if self._grad_comm is not None:
                self._grad_comm.check()

    def reset(self) -> None:
        """After a failure, the MoEComm as created (NVSHMEM backend; collective: every process calls it, after the
        failed step has ended). Waits for this device's queued work. A no-op on the reference backend, which keeps
        no state between calls."""
        if self.backend == "nvshmem" and self._phases is not None:
            nvshmem_backend.reset_plan(self._phases.plan)
            if self._grad_comm is not None:
                self._grad_comm.reset()

    def close(self) -> None:
        """Frees the NVSHMEM symmetric buffers (collective: every process closes its MoEComm in the same order)."""
        if self.backend == "nvshmem" and self._phases is not None:
            nvshmem_backend.destroy_plan(self._phases.plan)
            self._phases = None
        if self._grad_comm is not None:
            self._grad_comm.close()

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
        """NVSHMEM symmetric heap this config takes per GPU on the NVSHMEM backend (0 bytes are used by the
        reference backend; the figure is reported for sizing NVSHMEM_SYMMETRIC_SIZE)."""
        grad = self._grad_comm.symmetric_bytes if self._grad_comm is not None else 0
        return nvshmem_backend.symmetric_bytes(self.cfg, self.world) + grad

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items())
        return (f"MoEComm(world={self.world}, backend={self.backend!r}, capacity={self.capacity}, "
                f"custom_vjp={self.custom_vjp}, grad_dtype={self.grad_dtype}, {options}, cfg={self.cfg})")

    # Argument checks ---------------------------------------------------------------------------------
    def _check_dispatch_args(self, x, topk_ids, scales, num_tokens):
        c = self.cfg
        _check_array("x", x, (c.max_tokens, c.hidden), (c.dtype,))
        _check_array("topk_ids", topk_ids, (c.max_tokens, c.experts_per_token), (jnp.int32,))
        if c.is_fp8:
            if scales is None:
                raise ValueError("scales is required for float8_e4m3fn payloads: "
                                 "float32 [max_tokens, hidden // scale_block]")
            _check_array("scales", scales, (c.max_tokens, c.scale_cols), (jnp.float32,))
        elif scales is not None:
            raise ValueError(f"scales is only for float8_e4m3fn payloads; dtype is {c.dtype.name}")
        if num_tokens is None:
            return jnp.int32(c.max_tokens)
        num_tokens = jnp.asarray(num_tokens)
        if num_tokens.shape != () or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise ValueError("num_tokens must be an integer scalar (per shard), "
                             f"got {num_tokens.dtype}{list(num_tokens.shape)}")
        return jnp.clip(num_tokens.astype(jnp.int32), 0, c.max_tokens)

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

    def _check_weights(self, topk_weights):
        c = self.cfg
        _check_array("topk_weights", topk_weights, (c.max_tokens, c.experts_per_token), (jnp.float32,))

    def _check_combine_weights(self, handle: CombineHandle, topk_weights, where: str = "combine") -> None:
        """Weights given to dispatch (in the handle) are the combine's: then none may be given to it. The backends
        read None with a handle that has weights as "the handle's, sent with dispatch"."""
        if handle.topk_weights is not None:
            if topk_weights is not None:
                raise ValueError(f"topk_weights went with dispatch (they are in the handle): give none to {where}")
        elif topk_weights is not None:
            self._check_weights(topk_weights)

    # Per-shard API (inside shard_map over axis_name) -------------------------------------------------
    def dispatch_send(self, x: Array, topk_ids: Array, scales: Array | None = None,
                      num_tokens: Array | None = None, topk_weights: Array | None = None):
        """Starts sending tokens to their experts' ranks; returns a pending pytree for ``dispatch_recv``.

        x: [max_tokens, H] cfg.dtype; topk_ids: int32 [max_tokens, K] in [-1, E); scales: float32
        [max_tokens, H // B] (fp8 only); num_tokens: int32 scalar, rows >= num_tokens are ignored;
        topk_weights: float32 [max_tokens, K] or None, the combine's weights sent now (see ``dispatch``).
        """
        num_tokens = self._check_dispatch_args(x, topk_ids, scales, num_tokens)
        if topk_weights is not None:
            self._check_weights(topk_weights)
        return self._phases.impl.dispatch_send(self._phases.plan, x, topk_ids, scales, num_tokens, topk_weights)

    def dispatch_recv(self, pending) -> Dispatched:
        """Waits for the rows of ``dispatch_send`` and returns them packed by local expert."""
        return self._phases.impl.dispatch_recv(self._phases.plan, pending)

    def dispatch(self, x: Array, topk_ids: Array, scales: Array | None = None,
                 num_tokens: Array | None = None, topk_weights: Array | None = None) -> Dispatched:
        """``dispatch_recv(dispatch_send(...))``: see Dispatched for the layout. Differentiable (see custom_vjp).

        topk_weights (float32 [max_tokens, K], optional): the combine's weights, given here instead of to combine
        (they land in ``handle.topk_weights``, and combine then takes none). The NVSHMEM backend's NVLink path sends
        them with the tokens' ids, so its pre-reduced combine need not exchange them (one signal round trip less)."""
        num_tokens = self._check_dispatch_args(x, topk_ids, scales, num_tokens)
        if topk_weights is not None:
            self._check_weights(topk_weights)
        if self.custom_vjp:
            return autodiff.dispatch(self._phases, x, topk_ids, scales, num_tokens, topk_weights)
        return self._phases.dispatch(x, topk_ids, scales, num_tokens, topk_weights)

    def combine_send(self, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None):
        """Starts sending expert outputs [capacity, H] back to their tokens' ranks (bf16/fp16/fp32, no wider
        than out_dtype). The weights [max_tokens, K] go either here or to combine_recv; given here, the NVSHMEM
        backend sums each token's rows on the expert side and sends one row per (token, expert rank) instead of
        one per slot (rows in the output dtype: within its rounding of the per-slot sum). With weights in the handle
        (given to dispatch) none are given here or to combine_recv: they count as given here."""
        self._check_combine_args(expert_y, handle)
        self._check_combine_weights(handle, topk_weights, "combine_send")
        return self._phases.impl.combine_send(self._phases.plan, expert_y, handle, topk_weights)

    def combine_recv(self, pending, topk_weights: Array | None = None) -> Array:
        """Waits for the expert rows and returns y [max_tokens, H] out_dtype, y[i] = sum_k w[i,k] row(i,k).
        topk_weights: here exactly when combine_send did not get them (nor dispatch)."""
        if topk_weights is not None:
            self._check_weights(topk_weights)
        if (topk_weights is None) == (getattr(pending, "topk_weights", None) is None):
            raise ValueError("topk_weights must be given to exactly one of dispatch, combine_send and combine_recv")
        return self._phases.impl.combine_recv(self._phases.plan, pending, topk_weights)

    def combine(self, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None) -> Array:
        """``combine_recv(combine_send(expert_y, handle), topk_weights)``. Differentiable (see custom_vjp).
        topk_weights: float32 [max_tokens, K], unless dispatch got them (then None: the handle's are used)."""
        self._check_combine_args(expert_y, handle)
        if handle.topk_weights is None and topk_weights is None:
            raise ValueError("topk_weights is required: give them to combine or to dispatch")
        self._check_combine_weights(handle, topk_weights)
        if self.custom_vjp:
            return autodiff.combine(self._phases, expert_y, handle, topk_weights)
        return self._phases.combine(expert_y, handle, topk_weights)


# Global view --------------------------------------------------------------------------------------------
def _lift_scalars(tree):
    """Per-shard scalars become [1] so they can be concatenated over the EP axis."""
    return jax.tree.map(lambda a: a.reshape(1) if a.ndim == 0 else a, tree)


def _per_shard(comm: MoEComm, fn, *args):
    spec = P(comm.axis_name)
    mapped = jax.shard_map(lambda *a: _lift_scalars(fn(*a)), mesh=comm.mesh, in_specs=spec, out_specs=spec)
    return mapped(*args)


def dispatch(comm: MoEComm, x: Array, topk_ids: Array, scales: Array | None = None,
             num_tokens: Array | None = None, topk_weights: Array | None = None) -> Dispatched:
    """Global-view dispatch on arrays sharded over ``comm.axis_name`` (usable inside ``jit``).

    x: [world * max_tokens, H]; topk_ids: int32 [world * max_tokens, K]; scales: float32
    [world * max_tokens, H // B] (fp8); num_tokens: int32 [world] (one count per rank) or None; topk_weights:
    float32 [world * max_tokens, K] or None (see MoEComm.dispatch).
    Returns a Dispatched whose arrays are the per-shard results concatenated over the EP axis:
    expert_x [world * capacity, H], group_sizes [E], handle.num_tokens [world].
    """

    if num_tokens is not None:
        _check_array("num_tokens", num_tokens, (comm.world,), None)
        if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise ValueError(f"num_tokens must be integer (one count per rank), got {np.dtype(num_tokens.dtype).name}")

    def shard_fn(x, topk_ids, scales, num_tokens, topk_weights):
        count = None if num_tokens is None else num_tokens.reshape(())
        return comm.dispatch(x, topk_ids, scales, count, topk_weights)

    return _per_shard(comm, shard_fn, x, topk_ids, scales, num_tokens, topk_weights)


def combine(comm: MoEComm, expert_y: Array, handle: CombineHandle, topk_weights: Array | None = None) -> Array:
    """Global-view combine: expert_y [world * capacity, H], the global handle from ``dispatch``,
    topk_weights float32 [world * max_tokens, K] (None when dispatch got them) -> y [world * max_tokens, H]
    out_dtype."""

    def shard_fn(expert_y, handle, topk_weights):
        handle = dataclasses.replace(handle, num_tokens=handle.num_tokens.reshape(()))
        return comm.combine(expert_y, handle, topk_weights)

    return _per_shard(comm, shard_fn, expert_y, handle, topk_weights)

"""A ready-made expert-parallel MoE layer: plain functions over a params pytree (no framework).

    params = init_moe_params(key, hidden=H, ffn=F, num_experts=E, shared_ffn=Fs)   # global shapes
    y = moe_layer(comm, shard_params(comm, params), x)   # global view: x [num_shards * T, H], comm.batch_spec
    y = moe_layer_shard(comm, params_shard, x)           # per shard, inside your shard_map over the mesh

One layer, per rank of an EP group (``world`` ranks, each holding ``L = E / world`` experts):

    x [T, H] ──route──────────> topk_ids int32 [T, K], topk_weights f32 [T, K]   softmax top-k (fp32)
      ──comm.dispatch────────> expert_x [capacity, H]   rows grouped by local expert, group_sizes [L]
      ──SwiGLU experts───────> expert_y [capacity, H]   jax.lax.ragged_dot with this rank's L experts
      ──comm.combine─────────> y [T, H] = sum_k w[t, k] expert_y[row(t, k)]  (+ s)
      ──shared expert────────> s [T, H]   (optional; with MoEComm(send_stream=...) beside the combine's halves,
                                           comm.combine(..., beside=...), its backward beside the backward's)

The params pytree (a dict; global shapes, E experts, H hidden, F expert width, Fs shared-expert width):

    router  float32 [H, E]     replicated; the router always runs in float32
    gate    dtype   [E, H, F]  sharded over the EP axes on dim 0 (rank r holds experts r*L .. r*L + L - 1),
                               replicated over the other mesh axes (every EP group holds all E experts)
    up      dtype   [E, H, F]  sharded like gate
    down    dtype   [E, F, H]  sharded like gate
    shared  (optional) {"gate": [H, Fs], "up": [H, Fs], "down": [Fs, H]}, replicated

Expert weights are cast to ``comm.cfg.dtype`` for the matmuls (accumulation in float32), so float32 master weights
train a bfloat16 layer. On the reference backend the layer is differentiable with plain JAX AD with respect to the
params and ``x``; ``topk_ids`` are integers and get no gradient, the router learns through ``topk_weights``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .comm import MoEComm, dim0_spec, placed

__all__ = [
    "EXPERT_KEYS",
    "init_moe_params",
    "moe_layer",
    "moe_layer_shard",
    "param_specs",
    "route",
    "shard_params",
    "shared_expert",
    "swiglu_experts",
]

EXPERT_KEYS = ("gate", "up", "down")  # sharded over the EP axis on dim 0; everything else is replicated

_F32 = dict(preferred_element_type=jnp.float32)


def _opts(dtype) -> dict:
    # float32 payloads get full-precision matmuls (no TF32 on GPU); narrower inputs are exact in any case.
    precision = jax.lax.Precision.HIGHEST if np.dtype(dtype) == np.dtype(jnp.float32) else None
    return dict(precision=precision, **_F32)


# ------------------------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------------------------


def init_moe_params(key: Array, *, hidden: int, ffn: int, num_experts: int, shared_ffn: int | None = None,
                    dtype: Any = jnp.float32) -> dict:
    """Random parameters of one MoE layer (global shapes; see the module docstring for the pytree).

    Every matrix is drawn from N(0, 1 / fan_in). The router is float32 whatever ``dtype`` is; the expert (and
    shared-expert) weights are ``dtype``. With ``shared_ffn`` the params get a ``"shared"`` SwiGLU expert of width
    ``shared_ffn`` that every token goes through.
    """
    for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if shared_ffn is not None and (not isinstance(shared_ffn, (int, np.integer)) or shared_ffn < 1):
        raise ValueError(f"shared_ffn must be a positive int or None, got {shared_ffn!r}")
    keys = jax.random.split(key, 7)

    def normal(k, shape, fan_in, dt=dtype):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(dt)

    params = {
        "router": normal(keys[0], (hidden, num_experts), hidden, jnp.float32),
        "gate": normal(keys[1], (num_experts, hidden, ffn), hidden),
        "up": normal(keys[2], (num_experts, hidden, ffn), hidden),
        "down": normal(keys[3], (num_experts, ffn, hidden), ffn),
    }
    if shared_ffn is not None:
        params["shared"] = {
            "gate": normal(keys[4], (hidden, shared_ffn), hidden),
            "up": normal(keys[5], (hidden, shared_ffn), hidden),
            "down": normal(keys[6], (shared_ffn, hidden), shared_ffn),
        }
    return params


def param_specs(params: dict, axis_name: str | tuple[str, ...]) -> dict:
    """PartitionSpecs of a params pytree: the expert weights sharded over the EP axes ``axis_name`` (one mesh axis
    or a tuple, e.g. ``comm.ep_axes``) on dim 0, the rest replicated (P())."""
    expert_spec = dim0_spec((axis_name,) if isinstance(axis_name, str) else tuple(axis_name))

    def spec(name: str, value) -> Any:
        leaf_spec = expert_spec if name in EXPERT_KEYS else P()
        return jax.tree.map(lambda _: leaf_spec, value)

    return {name: spec(name, value) for name, value in params.items()}


def shard_params(comm: MoEComm, params: dict) -> dict:
    """``params`` placed on ``comm.mesh``: expert weights sharded over the EP axes, the rest replicated.

    Single-process only (it uses ``jax.device_put``); with several processes build the params inside
    ``jax.jit(init, out_shardings=...)`` with the shardings of ``param_specs`` instead.
    """
    specs = param_specs(params, comm.ep_axes)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(comm.mesh, s)), params, specs,
                        is_leaf=lambda leaf: isinstance(leaf, P))


# ------------------------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------------------------


def route(x: Array, router_w: Array, k: int, renormalize: bool = True) -> tuple[Array, Array]:
    """The router: x [T, H], router_w [H, E] -> (topk_ids int32 [T, K], topk_weights float32 [T, K]).

    softmax(x @ router_w) in float32, then each token's k most probable experts (distinct, most probable first).
    With ``renormalize`` their probabilities are rescaled to sum to 1. Differentiable through the weights.
    """
    logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    top_probs, topk_ids = jax.lax.top_k(probs, k)  # [T, K] each
    if renormalize:
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return topk_ids.astype(jnp.int32), top_probs


def swiglu_experts(expert_x: Array, group_sizes: Array, gate: Array, up: Array, down: Array) -> Array:
    """Every local expert on its rows: expert_x [capacity, H], group_sizes int32 [L] -> float32 [capacity, H].

    gate / up [L, H, F], down [L, F, H] (cast to expert_x's dtype). Rows come grouped by local expert, which is the
    layout ``jax.lax.ragged_dot`` multiplies by one weight matrix per group; expert l computes
    ``(silu(x @ gate[l]) * (x @ up[l])) @ down[l]``. Rows past ``sum(group_sizes)`` come out zero.
    """
    dtype = expert_x.dtype
    opts = _opts(dtype)
    g = jax.lax.ragged_dot(expert_x, gate.astype(dtype), group_sizes, **opts)  # [capacity, F]
    u = jax.lax.ragged_dot(expert_x, up.astype(dtype), group_sizes, **opts)  # [capacity, F]
    h = (jax.nn.silu(g) * u).astype(dtype)
    return jax.lax.ragged_dot(h, down.astype(dtype), group_sizes, **opts)  # [capacity, H]


def shared_expert(x: Array, shared: dict) -> Array:
    """The shared SwiGLU expert on every token: x [T, H] -> float32 [T, H]; weights cast to x's dtype."""
    dtype = x.dtype
    opts = _opts(dtype)
    g = jnp.dot(x, shared["gate"].astype(dtype), **opts)
    u = jnp.dot(x, shared["up"].astype(dtype), **opts)
    h = (jax.nn.silu(g) * u).astype(dtype)
    return jnp.dot(h, shared["down"].astype(dtype), **opts)


def _check_params(comm: MoEComm, params: dict, per_shard: bool) -> None:
    c = comm.cfg
    H, E = c.hidden, c.num_experts
    n = comm.num_local_experts if per_shard else E
    where = "params_shard" if per_shard else "params"
    missing = [key for key in ("router", *EXPERT_KEYS) if key not in params]
    if missing:
        raise ValueError(f"{where} is missing {missing}; build it with init_moe_params")
    F = params["gate"].shape[-1]
    expected = {"router": (H, E), "gate": (n, H, F), "up": (n, H, F), "down": (n, F, H)}
    for key, shape in expected.items():
        if tuple(params[key].shape) != shape:
            rule = f" (this rank's L = {n} experts)" if per_shard and key != "router" else ""
            raise ValueError(f"{where}[{key!r}] must have shape {shape}{rule}, got {tuple(params[key].shape)}")
    if "shared" in params:
        shared = params["shared"]
        Fs = shared["gate"].shape[-1]
        for key, shape in {"gate": (H, Fs), "up": (H, Fs), "down": (Fs, H)}.items():
            if tuple(shared[key].shape) != shape:
                raise ValueError(f"{where}['shared'][{key!r}] must have shape {shape}, got {tuple(shared[key].shape)}")


# ------------------------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------------------------


def moe_layer_shard(comm: MoEComm, params_shard: dict, x: Array, num_tokens: Array | None = None) -> Array:
    """One MoE layer on one rank, inside the caller's ``shard_map`` over the mesh (over ``comm.ep_axes`` at least;
    the rank exchanges with the ranks of its EP group).

    Args:
      comm: the model's MoEComm (cfg.dtype bfloat16, float16 or float32; fp8 payloads need scales the layer does
        not compute). One serves every layer of a model whose layers each take the previous one's output: their
        round trips, forward and backward, are ordered by data (docs/design.md, "One buffer set for a whole
        model").
      params_shard: this rank's view of the params: ``router`` [H, E] and ``shared`` replicated, ``gate`` / ``up``
        [L, H, F] and ``down`` [L, F, H] this rank's ``L = E / world`` experts.
      x: [max_tokens, H], any float dtype: the router sees it in float32, the experts in ``cfg.dtype``.
      num_tokens: optional int32 scalar; rows >= num_tokens are ignored and their outputs are zero.

    Returns:
      y [max_tokens, H] ``cfg.out_dtype``: ``sum_k w[t, k] SwiGLU_{ids[t, k]}(x[t])`` plus the shared expert.
    """
    c = comm.cfg
    if c.is_fp8:
        raise ValueError("moe_layer does not quantize activations: use a MoEComm with dtype bfloat16, float16 or "
                         "float32 (call comm.dispatch with scales yourself for fp8)")
    _check_params(comm, params_shard, per_shard=True)
    if tuple(x.shape) != (c.max_tokens, c.hidden):
        raise ValueError(f"x must have shape {(c.max_tokens, c.hidden)} (per shard), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a float array, got {np.dtype(x.dtype).name}")

    topk_ids, topk_weights = route(x, params_shard["router"], c.experts_per_token)
    xc = x.astype(c.dtype)  # the payload dtype must be cfg.dtype
    d = comm.dispatch(xc, topk_ids, num_tokens=num_tokens)
    expert_y = swiglu_experts(d.expert_x, d.group_sizes, params_shard["gate"], params_shard["up"],
                              params_shard["down"]).astype(c.out_dtype)  # no wider than out_dtype
    if "shared" not in params_shard:
        return comm.combine(expert_y, d.handle, topk_weights)
    if comm.options.send_stream is not None:
        # Independent of the rows in flight: beside the combine's send (the longer half at world 1), forward and
        # backward. Without a send stream the split halves would only cost the fused call's speed.
        y, shared = comm.combine(expert_y, d.handle, topk_weights, beside=(shared_expert, xc, params_shard["shared"]))
    else:
        y, shared = comm.combine(expert_y, d.handle, topk_weights), shared_expert(xc, params_shard["shared"])
    if num_tokens is not None:  # combine zeroes rows >= num_tokens; do the same for the shared expert
        live = jnp.arange(c.max_tokens) < jnp.asarray(num_tokens).astype(jnp.int32)
        shared = jnp.where(live[:, None], shared, 0.0)
    return (y.astype(jnp.float32) + shared).astype(c.out_dtype)


def moe_layer(comm: MoEComm, params: dict, x: Array, num_tokens: Array | None = None) -> Array:
    """Global view of ``moe_layer_shard`` (usable inside ``jit``); builds the ``shard_map`` over the whole mesh.

    Args:
      params: global shapes (``gate`` [E, H, F] ...), ideally placed by ``shard_params`` / ``param_specs``
        (expert weights sharded over ``comm.ep_axes`` on dim 0, the rest replicated).
      x: [num_shards * max_tokens, H] (N = ``comm.num_shards``: world times the batch axes' sizes), sharded
        ``comm.batch_spec`` on dim 0: block ``g * world + r`` (rows of T) is EP rank r of batch coordinate g. An x
        sharded over fewer axes, or replicated, is sliced locally.
      num_tokens: optional int32 [N], the valid rows of each block.

    Returns:
      y [N * max_tokens, H] ``cfg.out_dtype``, sharded ``comm.batch_spec``.
    """
    _check_params(comm, params, per_shard=False)
    rows = comm.num_shards * comm.cfg.max_tokens
    if x.ndim != 2 or x.shape[0] != rows:
        raise ValueError(f"x must have shape ({rows}, {comm.cfg.hidden}) = (num_shards * max_tokens, hidden), "
                         f"got {tuple(x.shape)}")
    batch = comm.batch_spec
    specs = param_specs(params, comm.ep_axes)
    if num_tokens is None:
        fn = lambda p, x: moe_layer_shard(comm, p, x)  # noqa: E731
        return jax.shard_map(fn, mesh=comm.mesh, in_specs=(specs, batch), out_specs=batch)(
            *placed(comm.mesh, (params, x), (specs, batch)))
    num_tokens = jnp.asarray(num_tokens)
    if num_tokens.shape != (comm.num_shards,) or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(f"num_tokens must be an integer array of shape ({comm.num_shards},) (one count per rank), "
                         f"got {num_tokens.dtype}{list(num_tokens.shape)}")
    fn = lambda p, x, n: moe_layer_shard(comm, p, x, n.reshape(()))  # noqa: E731
    return jax.shard_map(fn, mesh=comm.mesh, in_specs=(specs, batch, batch), out_specs=batch)(
        *placed(comm.mesh, (params, x, num_tokens), (specs, batch, batch)))

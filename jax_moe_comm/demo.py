"""One expert-parallel MoE layer, forward, checked against a dense computation.

    python -m jax_moe_comm.demo                                    # CPU: 8 simulated devices, reference backend
    python -m jax_moe_comm.demo --dtype bfloat16 --tokens 16       # any size / dtype (see --help)
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.demo     # GPUs: one process per GPU, NVSHMEM backend

The layer, per rank of the mesh axis "ep" (``world`` ranks, each holding ``L = E / world`` experts):

    x [T, H] ──router──> ids [T, K], weights [T, K]        softmax(x @ w_router), top-k, renormalised
      ──comm.dispatch──> expert_x [capacity, H]            rows grouped by local expert, group_sizes [L]
      ──SwiGLU experts─> expert_y [capacity, H]            ragged_dot with this rank's L experts' weights
      ──comm.combine───> y [T, H]                          y[t] = sum_k weights[t, k] * expert_y[row(t, k)]

The dense check computes, on one device in float32, for every token t: ``sum_k w[t,k] * SwiGLU_{ids[t,k]}(x[t])``.
The demo exits with status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import nvshmem_backend, runtime
from jax_moe_comm._cli import prepare_process
from jax_moe_comm.launch import host_gather, initialize_distributed

AXIS = "ep"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Relative error (Frobenius norm) allowed against the float32 dense result. float32 payloads are computed with
# full-precision matmuls (no TF32), so only summation order differs; bfloat16 rounds x@W products, the SwiGLU
# activations, the expert outputs and the result to 8 mantissa bits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
NVSHMEM_DEFAULT_HEAP = 1 << 30  # NVSHMEM's own default NVSHMEM_SYMMETRIC_SIZE


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Weights:
    """The layer's parameters. Global shapes (E experts, H hidden, F SwiGLU width); per rank, the expert weights
    are this rank's slice of L = E / world experts.

    w_router: float32 [H, E], replicated (the router runs in float32 whatever the payload dtype).
    w_gate:   payload dtype [E, H, F], sharded over experts.
    w_up:     payload dtype [E, H, F], sharded over experts.
    w_down:   payload dtype [E, F, H], sharded over experts.
    """

    w_router: np.ndarray | Array
    w_gate: np.ndarray | Array
    w_up: np.ndarray | Array
    w_down: np.ndarray | Array


jax.tree_util.register_dataclass(Weights, data_fields=["w_router", "w_gate", "w_up", "w_down"], meta_fields=[])
WEIGHT_SPECS = Weights(w_router=P(), w_gate=P(AXIS), w_up=P(AXIS), w_down=P(AXIS))


def route(x: Array, w_router: Array, k: int) -> tuple[Array, Array]:
    """The router: x [T, H] -> (topk_ids int32 [T, K], topk_weights float32 [T, K]).

    Each token picks its k most probable experts; their probabilities are renormalised to sum to 1.
    """
    logits = jnp.dot(x.astype(jnp.float32), w_router, precision=jax.lax.Precision.HIGHEST)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, topk_ids = jax.lax.top_k(probs, k)  # [T, K] each, distinct experts per token
    return topk_ids.astype(jnp.int32), top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)


def swiglu_experts(expert_x: Array, group_sizes: Array, w: Weights) -> Array:
    """Runs every local expert on its rows: expert_x [capacity, H], group_sizes int32 [L] -> [capacity, H] float32.

    Rows arrive grouped by local expert (expert 0's ``group_sizes[0]`` rows first, ...), which is exactly the
    layout ``jax.lax.ragged_dot`` multiplies by one weight matrix per group: w_gate / w_up [L, H, F], w_down
    [L, F, H]. Expert l computes ``(silu(x @ w_gate[l]) * (x @ w_up[l])) @ w_down[l]``. Rows past
    ``sum(group_sizes)`` hold no token; combine ignores them.
    """
    # Full-precision float32 matmuls (no TF32 on GPU); bfloat16 inputs are exact in any case.
    opts = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    gate = jax.lax.ragged_dot(expert_x, w.w_gate, group_sizes, **opts)  # [capacity, F]
    up = jax.lax.ragged_dot(expert_x, w.w_up, group_sizes, **opts)  # [capacity, F]
    hidden = (jax.nn.silu(gate) * up).astype(expert_x.dtype)
    return jax.lax.ragged_dot(hidden, w.w_down, group_sizes, **opts)  # [capacity, H]


def moe_layer_shard(comm: jax_moe_comm.MoEComm, x: Array, w: Weights) -> tuple[Array, Array, Array, Array]:
    """One MoE layer on one rank (runs inside shard_map over "ep").

    x: [T, H] payload dtype, this rank's tokens; w: this rank's view of Weights (w_gate [L, H, F], ...).
    Returns y [T, H] out dtype, and for inspection topk_ids int32 [T, K], topk_weights float32 [T, K] and
    group_sizes int32 [L] (tokens received per local expert).
    """
    topk_ids, topk_weights = route(x, w.w_router, comm.cfg.experts_per_token)
    d = comm.dispatch(x, topk_ids)  # tokens travel to the ranks that own their experts
    expert_y = swiglu_experts(d.expert_x, d.group_sizes, w)
    y = comm.combine(expert_y.astype(comm.cfg.out_dtype), d.handle, topk_weights)  # and come back, weighted
    return y, topk_ids, topk_weights, d.group_sizes


def make_moe_layer(comm: jax_moe_comm.MoEComm) -> Callable[[Array, Weights], tuple[Array, Array, Array, Array]]:
    """The jitted layer on global arrays: x [world * T, H] sharded over "ep", Weights sharded as WEIGHT_SPECS.

    Returns (y [world * T, H], topk_ids [world * T, K], topk_weights [world * T, K], group_sizes [E]); every
    output is the per-rank results concatenated over "ep", so group_sizes[e] counts the tokens of expert e.
    """
    layer = jax.shard_map(
        lambda x, w: moe_layer_shard(comm, x, w),
        mesh=comm.mesh,
        in_specs=(P(AXIS), WEIGHT_SPECS),
        out_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
    )
    return jax.jit(layer)


# ----------------------------------------------------------------------------------------------------------------
# Inputs, dense reference, check
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(seed: int, tokens: int, hidden: int, ffn: int, experts: int, dtype) -> tuple[np.ndarray, Weights]:
    """Host inputs from a fixed seed, identical on every process: x [tokens, H] and Weights (global shapes).

    x and the expert weights are already rounded to the payload dtype, so the dense check sees the same values.
    """
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], fan_in: int, dt=dtype) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(dt)

    x = normal((tokens, hidden), 1)
    weights = Weights(
        w_router=normal((hidden, experts), hidden, np.float32),
        w_gate=normal((experts, hidden, ffn), hidden),
        w_up=normal((experts, hidden, ffn), hidden),
        w_down=normal((experts, ffn, hidden), ffn),
    )
    return x, weights


def to_global(host: np.ndarray, mesh: Mesh, spec: P) -> Array:
    """A global jax.Array from a host array every process holds in full; each device gets its slice."""
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])


def dense_reference(x: np.ndarray, w: Weights, topk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer without any communication, in float32 numpy on the host.

    x [N, H]; topk_ids [N, K] the experts the layer picked. Returns (y [N, H], router logits [N, E]).
    y[t] = sum_k w[t,k] * SwiGLU_{ids[t,k]}(x[t]), with w the renormalised dense softmax at the picked ids.
    Using the layer's picks (and checking them against ``logits`` separately) keeps a near-tie in the router
    from flipping one pick and failing the comparison of everything else.
    """
    x = x.astype(np.float32)
    logits = x @ w.w_router  # [N, E]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    picked = np.take_along_axis(probs, topk_ids, axis=1)
    topk_weights = picked / picked.sum(axis=1, keepdims=True)  # [N, K]

    y = np.zeros_like(x)
    for e in np.unique(topk_ids):
        tok, slot = np.nonzero(topk_ids == e)  # the tokens that picked expert e, and in which slot
        xe = x[tok]
        gate = xe @ w.w_gate[e].astype(np.float32)
        up = xe @ w.w_up[e].astype(np.float32)
        out = (gate / (1 + np.exp(-gate)) * up) @ w.w_down[e].astype(np.float32)
        np.add.at(y, tok, topk_weights[tok, slot, None] * out)
    return y, logits


def picks_are_top_k(logits: np.ndarray, topk_ids: np.ndarray, tol: float = 1e-4) -> bool:
    """True when every token's picked experts are a top-k of its dense logits (ties within ``tol`` allowed)."""
    chosen = np.zeros(logits.shape, bool)
    np.put_along_axis(chosen, topk_ids, True, axis=1)
    lowest_chosen = np.where(chosen, logits, np.inf).min(axis=1)
    highest_other = np.where(chosen, -np.inf, logits).max(axis=1)
    distinct = all(len(set(row)) == len(row) for row in topk_ids.tolist())
    return distinct and bool(np.all(lowest_chosen >= highest_other - tol))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norms, float64)."""
    diff = np.linalg.norm(actual.astype(np.float64) - expected.astype(np.float64))
    return float(diff / max(np.linalg.norm(expected.astype(np.float64)), 1e-30))


def histogram_line(counts: np.ndarray, bins: int = 6) -> str:
    """'min 8  mean 16.0  max 26  | tokens:experts  8-11:10 12-15:21 ...': how many experts got how many tokens."""
    lo, hi = int(counts.min()), int(counts.max())
    width = max(1, -(-(hi - lo + 1) // bins))
    edges = range(lo, hi + 1, width)
    label = (lambda a: f"{a}") if width == 1 else (lambda a: f"{a}-{a + width - 1}")
    buckets = " ".join(f"{label(a)}:{int(np.sum((counts >= a) & (counts < a + width)))}" for a in edges)
    return f"min {lo}  mean {counts.mean():.1f}  max {hi}  | tokens:experts  {buckets}"


def time_layer(layer: Callable, args: tuple, iters: int) -> tuple[float, float]:
    """(seconds of the first call: compile + run, median seconds of ``iters`` later calls)."""
    start = time.perf_counter()
    jax.block_until_ready(layer(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(layer(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.demo", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank, T (default 32)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size, H (default 256)")
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU width of each expert, F (default 2 * hidden)")
    p.add_argument("--experts", type=int, default=64, help="experts, E; a multiple of the world (default 64)")
    p.add_argument("--topk", type=int, default=4, help="experts per token, K (default 4)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="payload dtype (default float32)")
    p.add_argument("--backend", choices=jax_moe_comm.comm.BACKENDS, default="auto",
                   help="auto: nvshmem when available (GPUs, CUDA extension, one GPU per process), else reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs, the same on every process (default 0)")
    p.add_argument("--iters", type=int, default=10, help="timed calls after the warm-up (default 10)")
    return p.parse_args(argv)


def start_runtime(backend: str, cfg: jax_moe_comm.MoECommConfig) -> None:
    """Joins the launcher's job (if any) and, where the NVSHMEM backend may be used, initializes NVSHMEM."""
    initialize_distributed()  # (0, 1) and nothing to do without the launcher
    one_gpu = [d.platform for d in jax.local_devices()] == ["gpu"]
    if backend == "nvshmem" or (backend == "auto" and one_gpu and jax_moe_comm.build_info()["cuda"]):
        heap = max(NVSHMEM_DEFAULT_HEAP, 2 * nvshmem_backend.symmetric_bytes(cfg, len(jax.devices()), staging=True))
        runtime.initialize(symmetric_size=heap)  # a clear error if the extension is missing


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    ffn = args.ffn or 2 * args.hidden
    cfg = jax_moe_comm.MoECommConfig(num_experts=args.experts, experts_per_token=args.topk, hidden=args.hidden,
                                     max_tokens=args.tokens, dtype=dtype, out_dtype=dtype)
    start_runtime(args.backend, cfg)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    comm = jax_moe_comm.MoEComm(cfg, mesh, axis_name=AXIS, backend=args.backend)
    world, leader = comm.world, jax.process_index() == 0

    # Inputs: the same host arrays on every process; each device takes its slice.
    x_host, w_host = make_inputs(args.seed, world * args.tokens, args.hidden, ffn, args.experts, dtype)
    x = to_global(x_host, mesh, P(AXIS))
    w = jax.tree.map(lambda spec, host: to_global(host, mesh, spec), WEIGHT_SPECS, w_host,
                     is_leaf=lambda leaf: isinstance(leaf, P))

    layer = make_moe_layer(comm)
    first_s, per_layer_s = time_layer(layer, (x, w), args.iters)
    y, topk_ids, _, group_sizes = layer(x, w)

    # Check (every process, so that all exit with the same status): gather the global results to the host.
    y, topk_ids, group_sizes = host_gather((y, topk_ids, group_sizes))
    y_dense, logits = dense_reference(x_host, w_host, topk_ids)
    error, tol = relative_error(y.astype(np.float32), y_dense), TOLERANCE[args.dtype]
    router_ok = picks_are_top_k(logits, topk_ids)
    routed_ok = int(group_sizes.sum()) == world * args.tokens * args.topk
    ok = error <= tol and router_ok and routed_ok

    if leader:
        platform = mesh.devices.flat[0].platform
        print("jax_moe_comm demo: one MoE layer forward (router -> dispatch -> SwiGLU experts -> combine)")
        print(f"  backend         {comm.backend}  ({platform}, {jax.process_count()} process(es))")
        print(f"  world           {world} ranks on mesh axis {AXIS!r}, {comm.num_local_experts} experts per rank")
        print(f"  config          {args.tokens} tokens/rank, hidden {args.hidden}, ffn {ffn}, {args.experts} experts, "
              f"top-{args.topk}, {args.dtype}, capacity {comm.capacity} rows/rank")
        print(f"  tokens/expert   {histogram_line(group_sizes)}")
        print(f"  router          top-k picks {'match' if router_ok else 'DIFFER from'} the dense router; "
              f"{int(group_sizes.sum())} of {world * args.tokens * args.topk} (token, expert) pairs routed")
        print(f"  vs dense        relative error {error:.2e} (tolerance {tol:.0e})  {'PASS' if ok else 'FAIL'}")
        print(f"  time            {per_layer_s * 1e3:.3f} ms per layer (median of {args.iters}; "
              f"first call with compile {first_s:.2f} s)")
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

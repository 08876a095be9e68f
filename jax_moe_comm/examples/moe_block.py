"""A transformer block with an MoE feed-forward, written as a model codebase writes it (equinox modules, its own
mesh, jitted optax steps), its token movement done by dispatch -> ragged_dot -> combine; checked against the same
block computed densely (every token through its experts by a gather, no communication).

    python -m jax_moe_comm.examples.moe_block                         # CPU: 8 devices, mesh ("data": 2, "expert": 4)
    python -m jax_moe_comm.examples.moe_block --router sigmoid_group  # DeepSeek-V3 style routing
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.moe_block --backend nvshmem   # on GPUs

Routers (``--router``): ``softmax`` (top-k of the softmax, weights as they are), ``softmax_renorm`` (the top-k
weights renormalized to 1), ``sigmoid_group`` (sigmoid scores, a selection bias, group-limited top-k: the best
``topk_groups`` expert groups first, weights normalized and times ``--scaling``), ``softmax_input`` (Llama 4 style:
each row scaled by its weight before the expert, ``d.expert_weights``, and combined with weight 1). A shared expert
runs beside the routed ones. The MoEComm takes the model's mesh from ``jax.set_mesh``, each shard dispatches fewer
tokens than ``max_tokens``, and the capacity is per expert.
"""

from __future__ import annotations

import argparse
import os

if __name__ == "__main__":  # 8 CPU devices for the reference backend (GPUs, where present, are jax's devices)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_comm as jmc  # noqa: E402

ROUTERS = ("softmax", "softmax_renorm", "sigmoid_group", "softmax_input")


def route(logits, bias, router: str, k: int, groups: int, topk_groups: int, scaling: float):
    """(ids int32 [n, k], weights float32 [n, k]) of a router on logits [n, E]."""
    if router in ("softmax", "softmax_renorm", "softmax_input"):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, k)
        if router == "softmax_renorm":
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return ids.astype(jnp.int32), weights
    # sigmoid_group: choose by score + bias within the best groups, weigh by the scores alone.
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    chosen = scores + jax.lax.stop_gradient(bias)
    n, num_experts = scores.shape
    per_group = chosen.reshape(n, groups, num_experts // groups)
    group_score = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)  # [n, groups]
    _, best = jax.lax.top_k(group_score, topk_groups)
    group_mask = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], best].set(True)
    masked = jnp.where(jnp.repeat(group_mask, num_experts // groups, axis=1), chosen, -jnp.inf)
    _, ids = jax.lax.top_k(masked, k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * scaling
    return ids.astype(jnp.int32), weights


def swiglu(x, w_in, w_gate, w_out):
    return (jax.nn.silu(x @ w_gate) * (x @ w_in)) @ w_out


class MoEBlock(eqx.Module):
    """RMSNorm -> causal self-attention -> RMSNorm -> routed experts + a shared expert, residual around each."""

    wqkv: jax.Array
    wo: jax.Array
    router: jax.Array
    router_bias: jax.Array
    w_in: jax.Array     # [E, H, F], sharded over the expert axis
    w_gate: jax.Array
    w_out: jax.Array    # [E, F, H]
    shared: tuple

    def __init__(self, key, hidden: int, ffn: int, num_experts: int):
        ks = jax.random.split(key, 8)
        n = lambda k, shape, fan: jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan)  # noqa: E731
        self.wqkv = n(ks[0], (hidden, 3 * hidden), hidden)
        self.wo = n(ks[1], (hidden, hidden), hidden)
        self.router = n(ks[2], (hidden, num_experts), hidden)
        self.router_bias = jnp.zeros((num_experts,), jnp.float32)
        self.w_in = n(ks[3], (num_experts, hidden, ffn), hidden)
        self.w_gate = n(ks[4], (num_experts, hidden, ffn), hidden)
        self.w_out = n(ks[5], (num_experts, ffn, hidden), ffn)
        self.shared = (n(ks[6], (hidden, ffn), hidden), n(ks[7], (hidden, ffn), hidden),
                       n(ks[6], (ffn, hidden), ffn))


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def attention(m: MoEBlock, x):
    """Single-head causal attention, x [b, s, H] (per shard: whole sequences)."""
    q, k, v = jnp.split(_norm(x) @ m.wqkv, 3, axis=-1)
    scores = jnp.einsum("bqh,bkh->bqk", q, k) / np.sqrt(x.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    return x + jnp.einsum("bqk,bkh->bqh", jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1), v) @ m.wo


def moe_sharded(m: MoEBlock, x, comm: jmc.MoEComm, args):
    """The block per shard (inside shard_map): x [b, s, H] -> [b, s, H]; the experts' weights are this rank's."""
    h = attention(m, x)
    b, s, hidden = h.shape
    tokens = _norm(h).reshape(b * s, hidden)  # n = b * s tokens, up to max_tokens
    ids, weights = route(tokens @ m.router, m.router_bias, args.router, args.k, args.groups, args.topk_groups,
                         args.scaling)
    d = comm.dispatch(tokens.astype(comm.cfg.dtype), ids, topk_weights=weights)
    rows = d.expert_x.astype(jnp.float32)
    if args.router == "softmax_input":
        rows = rows * d.expert_weights[:, None]
    ffn = jax.nn.silu(jax.lax.ragged_dot(rows, m.w_gate, d.group_sizes)) * jax.lax.ragged_dot(
        rows, m.w_in, d.group_sizes)
    expert_y = jax.lax.ragged_dot(ffn, m.w_out, d.group_sizes).astype(comm.cfg.out_dtype)
    routed = comm.combine(expert_y, d.handle, weighted=args.router != "softmax_input")
    return h + (routed.astype(jnp.float32) + swiglu(tokens, *m.shared)).reshape(b, s, hidden)


def moe_dense(m: MoEBlock, x, args, dtype):
    """The same block without communication: each token's k experts by a gather (global arrays, replicated first:
    a reference, not a sharding plan)."""
    m, x = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), (m, x))
    h = attention(m, x)
    b, s, hidden = h.shape
    tokens = _norm(h).reshape(b * s, hidden)
    ids, weights = route(tokens @ m.router, m.router_bias, args.router, args.k, args.groups, args.topk_groups,
                         args.scaling)
    rows = jnp.repeat(tokens.astype(dtype).astype(jnp.float32)[:, None, :], args.k, axis=1)  # [n, k, H]
    if args.router == "softmax_input":
        rows = rows * weights[:, :, None]
    ffn = jax.nn.silu(jnp.einsum("nkh,nkhf->nkf", rows, m.w_gate[ids])) * jnp.einsum("nkh,nkhf->nkf", rows,
                                                                                      m.w_in[ids])
    out = jnp.einsum("nkf,nkfh->nkh", ffn, m.w_out[ids])
    routed = out.sum(axis=1) if args.router == "softmax_input" else jnp.einsum("nk,nkh->nh", weights, out)
    return h + (routed + swiglu(tokens, *m.shared)).reshape(b, s, hidden)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="reference", choices=("reference", "nvshmem", "auto"))
    p.add_argument("--router", default="softmax_renorm", choices=ROUTERS)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--groups", type=int, default=4, help="expert groups (sigmoid_group)")
    p.add_argument("--topk-groups", type=int, default=2, help="groups each token may pick from (sigmoid_group)")
    p.add_argument("--scaling", type=float, default=2.5, help="routed scaling factor (sigmoid_group)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per shard")
    p.add_argument("--seq", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16, help="the MoEComm's bound of tokens per shard")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--custom-vjp", action="store_true", help="the NVSHMEM backend's gradient rules on any backend")
    args = p.parse_args(argv)

    if args.backend != "reference":
        from jax_moe_comm.launch import initialize_distributed
        initialize_distributed()
        jmc.initialize(symmetric_size="2G")
    devices = jax.devices()
    data = 2 if len(devices) % 2 == 0 and len(devices) >= 4 and args.backend == "reference" else 1
    mesh = jax.make_mesh((data, len(devices) // data), ("data", "expert"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    dtype = jnp.dtype(args.dtype)
    cfg = jmc.MoECommConfig(args.experts, args.k, args.hidden, args.max_tokens, dtype=dtype, out_dtype=dtype,
                            capacity_per="expert")
    with jax.set_mesh(mesh):
        # No mesh given: the one in context, the model's.
        comm = jmc.MoEComm(cfg, axis_name="expert", backend=args.backend, custom_vjp=args.custom_vjp or None,
                           expert_weights=args.router == "softmax_input")
        print(comm)
        model = MoEBlock(jax.random.key(0), args.hidden, args.ffn, args.experts)
        batch = args.batch * mesh.size
        kx, ky = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (batch, args.seq, args.hidden), jnp.float32)
        target = jax.random.normal(ky, (batch, args.seq, args.hidden), jnp.float32)
        rows = P(("data", "expert"))
        specs = MoEBlock(jax.random.key(0), 1, 1, args.experts)  # a pytree of the model's shape for its specs
        specs = jax.tree.map(lambda _: P(), specs)
        specs = eqx.tree_at(lambda m: (m.w_in, m.w_gate, m.w_out), specs, (P("expert"),) * 3)
        model = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), model, specs)
        x, target = (jax.device_put(a, jax.sharding.NamedSharding(mesh, rows)) for a in (x, target))
        block = jax.shard_map(lambda m, x: moe_sharded(m, x, comm, args), in_specs=(specs, rows), out_specs=rows)

        def loss(m, x, target):
            return jnp.mean((block(m, x) - target) ** 2)

        def dense_loss(m, x, target):
            return jnp.mean((moe_dense(m, x, args, dtype) - target) ** 2)

        optimizer = optax.adam(1e-2)
        state = optimizer.init(model)

        @jax.jit
        def step(model, state, x, target):
            value, grads = jax.value_and_grad(loss)(model, x, target)
            dense_value, dense_grads = jax.value_and_grad(dense_loss)(model, x, target)
            updates, state = optimizer.update(grads, state, model)
            gap = jnp.max(jnp.stack([jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12) for a, b in
                                     zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads), strict=True)]))
            return optax.apply_updates(model, updates), state, value, dense_value, gap

        tolerance = 1e-4 if dtype == jnp.float32 else 5e-2
        worst = 0.0
        for i in range(args.steps):
            model, state, value, dense_value, gap = step(model, state, x, target)
            rel = abs(float(value) - float(dense_value)) / abs(float(dense_value))
            worst = max(worst, rel, float(gap))
            print(f"step {i}: loss {float(value):.6f} (dense {float(dense_value):.6f}), "
                  f"gradients within {float(gap):.1e}")
        y, want = jax.jit(block)(model, x), jax.jit(lambda m, x: moe_dense(m, x, args, dtype))(model, x)
        out_gap = float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want)))
        worst = max(worst, out_gap)
        print(f"{args.router}: output within {out_gap:.1e} of the dense block after {args.steps} steps")
        if worst > tolerance:
            raise SystemExit(f"moe_block: the MoE block is {worst:.1e} from the dense one (> {tolerance})")
    if args.backend != "reference":
        comm.close()
    return worst


if __name__ == "__main__":
    main()

"""Gradients through dispatch -> per-expert linear (ragged_dot) -> combine equal those of a dense computation.

The dense reference runs on one device with no communication: for every valid token,
y[t] = sum_k w[t, k] * x[t] @ W[ids[t, k]] (slots with id -1 and tokens t >= num_tokens give nothing), and the
loss is sum(y ** 2). The expert-parallel loss takes each DP group's tokens once and hands them to every replica
of the group, so its gradients with respect to the group's x and weights must equal the dense ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig

H, T = 16, 8


@dataclasses.dataclass(frozen=True)
class GradCase:
    world: int
    dp_size: int
    num_experts: int
    k: int
    align: int = 1
    replicas: str = "mean"  # how the loss reads a DP group's replicas: "mean" of all, or "first" only
    custom_vjp: bool = False  # the rules of autodiff.py (the NVSHMEM backend's gradients) instead of plain AD
    weights_to: str = "combine"  # where the loss gives the top-k weights: "combine", or "dispatch" (via the handle)

    @property
    def num_groups(self) -> int:
        return self.world // self.dp_size

    @property
    def id(self) -> str:
        return (f"w{self.world}-dp{self.dp_size}-E{self.num_experts}-K{self.k}-align{self.align}"
                f"-{self.replicas}" + ("-custom_vjp" if self.custom_vjp else "")
                + ("-weights_to_dispatch" if self.weights_to == "dispatch" else ""))


GRAD_CASES = [
    GradCase(4, 1, 8, 2),
    GradCase(4, 2, 8, 3, align=4),
    GradCase(4, 2, 8, 3, align=4, replicas="first"),
    GradCase(8, 2, 8, 2),  # one local expert per rank
    GradCase(4, 1, 8, 2, custom_vjp=True),
    GradCase(4, 1, 8, 3, align=4, custom_vjp=True),
    GradCase(8, 1, 8, 2, custom_vjp=True),  # one local expert per rank
    GradCase(4, 2, 8, 3, align=4, custom_vjp=True),
    GradCase(4, 2, 8, 3, align=4, replicas="first", custom_vjp=True),
    GradCase(8, 4, 8, 2, custom_vjp=True),
    GradCase(4, 1, 8, 2, weights_to="dispatch"),
    GradCase(4, 1, 8, 3, align=4, custom_vjp=True, weights_to="dispatch"),
    GradCase(4, 2, 8, 3, align=4, custom_vjp=True, weights_to="dispatch"),
]


@functools.cache
def ep_loss_and_grad(case: GradCase):
    """jit(value_and_grad) of the expert-parallel loss w.r.t. (x [G*T, H], topk_weights [G*T, K], W [E, H, H])."""
    cfg = MoECommConfig(case.num_experts, case.k, H, T, dtype=jnp.float32, out_dtype=jnp.float32,
                        dp_size=case.dp_size, align=case.align)
    comm = MoEComm(cfg, ep_mesh(case.world), backend="reference", custom_vjp=case.custom_vjp)

    def per_shard(x, ids, num_tokens, weights, w_local):
        if case.weights_to == "dispatch":
            d = comm.dispatch(x, ids, num_tokens=num_tokens.reshape(()), topk_weights=weights)
            expert_y = jax.lax.ragged_dot(d.expert_x, w_local, d.group_sizes)
            return comm.combine(expert_y, d.handle)
        d = comm.dispatch(x, ids, num_tokens=num_tokens.reshape(()))
        expert_y = jax.lax.ragged_dot(d.expert_x, w_local, d.group_sizes)
        return comm.combine(expert_y, d.handle, weights)

    mapped = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))

    def to_replicas(a):  # [G * T, ...] -> [world * T, ...]: every replica of a group holds its tokens
        a = a.reshape((case.num_groups, T) + a.shape[1:])
        return jnp.repeat(a, case.dp_size, axis=0).reshape((case.world * T,) + a.shape[2:])

    def loss(x, weights, expert_w, ids, num_tokens):
        y = mapped(to_replicas(x), to_replicas(ids), jnp.repeat(num_tokens, case.dp_size), to_replicas(weights),
                   expert_w)
        y = y.reshape(case.num_groups, case.dp_size, T, H)
        if case.replicas == "first":
            return jnp.sum(y[:, 0] ** 2)
        return jnp.sum(y**2) / case.dp_size

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def dense_loss(x, weights, expert_w, ids, num_tokens):
    """Single-device reference: x [G*T, H], weights/ids [G*T, K], num_tokens [G], expert_w [E, H, H]."""
    groups = num_tokens.shape[0]
    token = jnp.arange(groups * T) % T
    live = token < jnp.repeat(num_tokens, T)
    valid = live[:, None] & (ids >= 0)
    per_slot = jnp.einsum("th,tkhj->tkj", x, expert_w[jnp.clip(ids, 0, expert_w.shape[0] - 1)],
                          precision=jax.lax.Precision.HIGHEST)
    y = jnp.sum(jnp.where(valid, weights, 0.0)[:, :, None] * per_slot, axis=1)
    return jnp.sum(y**2)


dense_loss_and_grad = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c.id for c in GRAD_CASES])
def test_gradients_match_dense_reference(case, rng, seed, routing):
    """d loss / d (x, topk_weights, expert weights) through dispatch and combine equal the dense gradients,
    with -1 slots and a partial num_tokens (tokens past it get zero gradient)."""
    r = routing("dropped_slots", world=case.world, dp_size=case.dp_size, num_experts=case.num_experts, k=case.k,
                max_tokens=T)
    ids = r.topk_ids.reshape(case.num_groups * T, case.k)
    x = rng.standard_normal((case.num_groups * T, H)).astype(np.float32)
    weights = rng.random((case.num_groups * T, case.k)).astype(np.float32)
    expert_w = (rng.standard_normal((case.num_experts, H, H)) / np.sqrt(H)).astype(np.float32)
    args = (x, weights, expert_w, ids, r.num_tokens)

    loss, grads = ep_loss_and_grad(case)(*args)
    want_loss, want_grads = dense_loss_and_grad(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"loss (seed={seed})")
    for name, got, want in zip(("x", "topk_weights", "expert weights"), grads, want_grads, strict=True):
        scale = float(np.max(np.abs(want))) or 1.0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=f"d loss / d {name} (seed={seed})")

    dead = np.arange(case.num_groups * T) % T >= np.repeat(r.num_tokens, T)
    assert not np.asarray(grads[0])[dead].any(), f"tokens past num_tokens got a gradient (seed={seed})"
    assert not np.asarray(grads[1])[(ids < 0) | dead[:, None]].any(), f"-1 slots got a weight gradient (seed={seed})"


@pytest.mark.parametrize(("changes", "message"), [
    ({"dtype": jnp.float8_e4m3fn, "scale_block": 16}, "grad_dtype=jnp.bfloat16"),
])
def test_custom_vjp_limits_are_explicit(changes, message):
    """The custom VJP (the NVSHMEM backend's gradients) refuses what it does not support yet, by name."""
    fields = dict(num_experts=8, experts_per_token=2, hidden=H, max_tokens=T, dtype=jnp.float32,
                  out_dtype=jnp.float32) | changes
    cfg = MoECommConfig(**fields)
    comm = MoEComm(cfg, ep_mesh(4), backend="reference", custom_vjp=True)
    fp8 = cfg.is_fp8

    def loss(x, ids, w):
        def shard(x, ids, w):
            scales = jnp.ones((T, cfg.scale_cols), jnp.float32) if fp8 else None
            d = comm.dispatch(x.astype(cfg.dtype), ids, scales)
            return comm.combine(d.expert_x.astype(jnp.float32), d.handle, w)
        return jnp.sum(jax.shard_map(shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))(x, ids, w) ** 2)

    ids = np.tile(np.array([[0, 5]], np.int32), (4 * T, 1))
    with pytest.raises(NotImplementedError, match=message):
        jax.grad(loss)(np.ones((4 * T, H), np.float32), ids, np.ones((4 * T, 2), np.float32))


# Compositions: the custom VJP under jax.checkpoint, lax.scan over layers, and two MoEComms in one step give the
# gradients of plain AD. (On CPU the reference backend stands in for the NVSHMEM one; tests/gpu runs the same
# compositions on the kernels, where they also exercise the ordering of the backward round trips.)
LAYERS, WORLD, E, K = 3, 4, 8, 2


def _layer(comm, x, ids, w, expert_w, remat=False):
    """One MoE layer per shard: x [T, H] -> x + combine(tanh(ragged_dot(dispatch(x), expert_w))), the experts
    optionally under jax.checkpoint (recomputed in the backward pass; the round trips are not)."""
    d = comm.dispatch(x, ids)
    experts = lambda rows, ew: jnp.tanh(jax.lax.ragged_dot(rows, ew, d.group_sizes))  # noqa: E731
    return x + comm.combine((jax.checkpoint(experts) if remat else experts)(d.expert_x, expert_w), d.handle, w)


def _composition_grads(composition: str, custom_vjp: bool):
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    mesh = ep_mesh(WORLD)
    comms = [MoEComm(cfg, mesh, backend="reference", custom_vjp=custom_vjp) for _ in range(2)]
    def per_shard(x, ids, w, expert_w):  # expert_w [LAYERS, L, H, H] (this rank's experts of every layer)
        if composition == "remat":  # the experts under jax.checkpoint (whole layers: tests/test_one_buffer_set.py)
            for i in range(LAYERS):
                x = _layer(comms[0], x, ids[i], w[i], expert_w[i], remat=True)
        elif composition == "scan":
            def body(x, per_layer):
                return _layer(comms[0], x, *per_layer), None
            x, _ = jax.lax.scan(body, x, (ids, w, expert_w))
        else:  # two instances: a student and a teacher path in one step, interleaved layer by layer
            y = x
            for i in range(LAYERS):
                x = _layer(comms[0], x, ids[i], w[i], expert_w[i])
                y = _layer(comms[1], y, ids[i], w[i], 0.5 * expert_w[i])
            x = x + y
        return x

    spec = P("ep")
    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, P(None, "ep"), P(None, "ep"), P(None, "ep")),
                           out_specs=spec)
    return jax.jit(jax.grad(lambda x, ids, w, ew: jnp.sum(mapped(x, ids, w, ew) ** 2), argnums=(0, 2, 3)))


@pytest.mark.parametrize("composition", ["remat", "scan", "two_instances"])
def test_custom_vjp_composes_like_plain_ad(composition, rng, seed):
    ids = np.stack([np.argsort(rng.random((WORLD * T, E)), axis=1)[:, :K] for _ in range(LAYERS)]).astype(np.int32)
    ids[:, ::5, 1] = -1  # some dropped slots
    x = rng.standard_normal((WORLD * T, H)).astype(np.float32)
    w = rng.random((LAYERS, WORLD * T, K)).astype(np.float32)
    expert_w = (rng.standard_normal((LAYERS, E, H, H)) / (2 * np.sqrt(H))).astype(np.float32)
    got = _composition_grads(composition, True)(x, ids, w, expert_w)
    want = _composition_grads(composition, False)(x, ids, w, expert_w)
    for name, g, v in zip(("x", "topk_weights", "expert weights"), got, want, strict=True):
        scale = float(np.max(np.abs(v))) or 1.0
        np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=f"{composition}: d loss / d {name} (seed={seed})")
        assert np.abs(v).max() > 0, f"{composition}: d loss / d {name} is all zero, the test would not see a bug"


# fp8 forward, wider gradients: the backward round trip of an fp8 layer runs on a grad_dtype buffer set.
FP8_BLOCK = 8


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [N, H] -> (float8_e4m3fn [N, H], float32 scales [N, H // FP8_BLOCK]), per-block amax scaling."""
    blocks = x.reshape(x.shape[0], -1, FP8_BLOCK)
    scales = np.maximum(np.abs(blocks).max(-1), 1e-6) / 448.0
    q = (blocks / scales[..., None]).reshape(x.shape)
    return np.asarray(jnp.asarray(q).astype(jnp.float8_e4m3fn)), scales.astype(np.float32)


@pytest.mark.parametrize(("grad_dtype", "rtol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)],
                         ids=["float32", "bfloat16"])
def test_fp8_dispatch_differentiates_with_wider_gradients(grad_dtype, rtol, rng, seed):
    """d loss / d (topk_weights, expert weights) through an fp8 dispatch equal the dense gradients of the
    dequantized tokens, to grad_dtype's precision: dy reaches the experts in grad_dtype, not fp8."""
    world, num_experts, k = 4, 8, 2
    cfg = MoECommConfig(num_experts, k, H, T, dtype=jnp.float8_e4m3fn, scale_block=FP8_BLOCK,
                        out_dtype=jnp.float32)
    comm = MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=True, grad_dtype=grad_dtype)
    x8, scales = _quantize(rng.standard_normal((world * T, H)).astype(np.float32))
    ids = np.argsort(rng.random((world * T, num_experts)), axis=1)[:, :k].astype(np.int32)
    ids[::3, 1] = -1
    w = rng.random((world * T, k)).astype(np.float32)
    expert_w = (rng.standard_normal((num_experts, H, H)) / np.sqrt(H)).astype(np.float32)

    def per_shard(x8, scales, ids, w, ew):
        d = comm.dispatch(x8, ids, scales)
        rows = d.expert_x.astype(jnp.float32) * jnp.repeat(d.expert_scales, FP8_BLOCK, axis=1)
        return comm.combine(jnp.tanh(jax.lax.ragged_dot(rows, ew, d.group_sizes)), d.handle, w)

    mapped = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))
    got = jax.jit(jax.grad(lambda w, ew: jnp.sum(mapped(x8, scales, ids, w, ew) ** 2), argnums=(0, 1)))(w, expert_w)

    def dense(w, ew):
        x = jnp.asarray(x8).astype(jnp.float32) * jnp.repeat(scales, FP8_BLOCK, axis=1)
        per_slot = jnp.tanh(jnp.einsum("th,tkhj->tkj", x, ew[jnp.clip(ids, 0)], precision=jax.lax.Precision.HIGHEST))
        return jnp.sum(jnp.sum(jnp.where(ids >= 0, w, 0.0)[:, :, None] * per_slot, axis=1) ** 2)

    want = jax.jit(jax.grad(dense, argnums=(0, 1)))(w, expert_w)
    for name, g, v in zip(("topk_weights", "expert weights"), got, want, strict=True):
        scale = float(np.max(np.abs(v)))
        assert scale > 0
        np.testing.assert_allclose(g, v, rtol=rtol, atol=rtol * scale, err_msg=f"d loss / d {name} (seed={seed})")


def test_grad_dtype_is_for_fp8_payloads_only():
    cfg = MoECommConfig(8, 2, H, T, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="grad_dtype is only for float8_e4m3fn payloads"):
        MoEComm(cfg, ep_mesh(4), backend="reference", grad_dtype=jnp.float32)
    fp8 = MoECommConfig(8, 2, H, T, dtype=jnp.float8_e4m3fn, scale_block=FP8_BLOCK)
    with pytest.raises(ValueError, match="grad_dtype must be bfloat16, float16 or float32"):
        MoEComm(fp8, ep_mesh(4), backend="reference", grad_dtype=jnp.int32)

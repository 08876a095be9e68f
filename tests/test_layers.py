"""jax_moe_comm.layers: the MoE layer equals a dense single-device computation, forward and gradients.

The dense reference runs on one device without communication: every token goes through every expert and the
outputs are weighted by a [T, E] matrix holding the renormalised top-k router probabilities (zero elsewhere).
It is written here independently of the layer (einsum over all experts, no ragged_dot, no dispatch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig
from jax_moe_comm.layers import init_moe_params, moe_layer, moe_layer_shard, param_specs, route, shard_params

WORLD, E, K, H, F, FS, T = 4, 8, 2, 16, 24, 12, 8
HI = jax.lax.Precision.HIGHEST


def dense_moe(params: dict, x: jax.Array, k: int) -> jax.Array:
    """The layer on one device in float32: y[t] = sum_e gates[t, e] SwiGLU_e(x[t]) (+ shared expert)."""
    x = x.astype(jnp.float32)
    probs = jax.nn.softmax(jnp.dot(x, params["router"], precision=HI), axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    gates = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], ids].set(top / top.sum(-1, keepdims=True))
    g = jnp.einsum("th,ehf->tef", x, params["gate"], precision=HI)
    u = jnp.einsum("th,ehf->tef", x, params["up"], precision=HI)
    out = jnp.einsum("tef,efh->teh", jax.nn.silu(g) * u, params["down"], precision=HI)
    y = jnp.einsum("te,teh->th", gates, out, precision=HI)
    if "shared" in params:
        s = params["shared"]
        y = y + jnp.dot(jax.nn.silu(jnp.dot(x, s["gate"], precision=HI)) * jnp.dot(x, s["up"], precision=HI),
                        s["down"], precision=HI)
    return y


@functools.cache
def make_comm(dtype=jnp.float32, **options) -> MoEComm:
    cfg = MoECommConfig(E, K, H, T, dtype=dtype, out_dtype=dtype)
    return MoEComm(cfg, ep_mesh(WORLD), backend="reference", **options)


def make_inputs(rng: np.random.Generator, shared: bool) -> tuple[dict, jax.Array, jax.Array]:
    key = jax.random.key(int(rng.integers(2**31)))
    params = init_moe_params(key, hidden=H, ffn=F, num_experts=E, shared_ffn=FS if shared else None)
    x = jnp.asarray(rng.standard_normal((WORLD * T, H), np.float32))
    cotangent = jnp.asarray(rng.standard_normal((WORLD * T, H), np.float32))
    return params, x, cotangent


@functools.cache
def layer_fn(view: str, shared: bool, **options):
    """jit(value_and_grad) of <y, cotangent> w.r.t. (params, x), plus y, for one view of the layer."""
    comm = make_comm(**options)
    if view == "global":
        def apply(params, x):
            return moe_layer(comm, params, x)
    else:  # the user's own shard_map around the per-shard layer
        def apply(params, x):
            specs = param_specs(params, comm.axis_name)
            mapped = jax.shard_map(lambda p, xs: moe_layer_shard(comm, p, xs), mesh=comm.mesh,
                                   in_specs=(specs, P("ep")), out_specs=P("ep"))
            return mapped(params, x)

    def loss(params, x, cotangent):
        y = apply(params, x)
        return jnp.sum(y * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def dense_fn():
    def loss(params, x, cotangent):
        y = dense_moe(params, x, K)
        return jnp.sum(y * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def assert_close(actual, expected, what: str, rtol: float = 1e-5) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    atol = rtol * max(np.abs(expected).max(), 1e-30)  # relative to the array's scale for entries near zero
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


# With a send_stream the shared expert goes beside the combine (comm.combine(..., beside=...)): differentiated by the
# custom VJP rules (the NVSHMEM backend's default) or by plain AD.
BESIDE = {"fused": {}, "beside_custom_vjp": dict(send_stream="own", custom_vjp=True),
          "beside_plain_ad": dict(send_stream="own", custom_vjp=False)}


@pytest.mark.parametrize("options", BESIDE)
@pytest.mark.parametrize("shared", [False, True], ids=["no_shared", "shared"])
@pytest.mark.parametrize("view", ["shard", "global"])
def test_layer_and_grads_match_dense(rng, view: str, shared: bool, options: str) -> None:
    params, x, cotangent = make_inputs(rng, shared)
    comm = make_comm()
    (value, y), (dparams, dx) = layer_fn(view, shared, **BESIDE[options])(shard_params(comm, params), x, cotangent)
    (value_ref, y_ref), (dparams_ref, dx_ref) = dense_fn()(params, x, cotangent)

    assert y.dtype == jnp.float32 and y.shape == (WORLD * T, H)
    assert_close(y, y_ref, "y")
    # <y, cotangent> sums terms of both signs: compare it at the scale of the terms, not of the (cancelled) sum.
    assert abs(float(value) - float(value_ref)) <= 1e-5 * float(jnp.sum(jnp.abs(y_ref * cotangent)))
    assert_close(dx, dx_ref, "dx")
    assert jax.tree.structure(dparams) == jax.tree.structure(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(dparams)
    flat_ref = jax.tree.leaves(dparams_ref)
    for (path, leaf), ref in zip(flat, flat_ref, strict=True):
        assert_close(leaf, ref, f"d{jax.tree_util.keystr(path)}")
    assert float(jnp.abs(dparams["router"]).max()) > 0  # the router learns through the top-k weights


def test_num_tokens_zeroes_rows_and_keeps_the_rest(rng) -> None:
    params, x, _ = make_inputs(rng, shared=True)
    comm = make_comm()
    num_tokens = jnp.asarray([T, 3, 0, 5], jnp.int32)
    y = np.asarray(jax.jit(lambda p, x, n: moe_layer(comm, p, x, n))(shard_params(comm, params), x, num_tokens))
    y_ref = np.asarray(dense_moe(params, x, K))
    live = (np.arange(T)[None, :] < np.asarray(num_tokens)[:, None]).reshape(-1)
    assert np.all(y[~live] == 0)
    assert_close(y[live], y_ref[live], "y (valid rows)")


def test_bfloat16_layer_is_close_to_dense(rng) -> None:
    """bfloat16 payloads with float32 master weights: the layer casts; ~1e-2 relative error from rounding."""
    params, x, _ = make_inputs(rng, shared=True)
    comm = make_comm(jnp.bfloat16)
    y = jax.jit(lambda p, x: moe_layer(comm, p, x))(shard_params(comm, params), x)
    assert y.dtype == jnp.bfloat16
    ids, _ = route(x, params["router"], K)  # routing is float32 on both sides: the same picks
    y_ref = dense_moe(params, x, K)
    err = np.linalg.norm(np.asarray(y, np.float32) - y_ref) / np.linalg.norm(y_ref)
    assert err < 3e-2, err
    assert ids.dtype == jnp.int32 and ids.shape == (WORLD * T, K)


def test_route_renormalizes_and_picks_the_largest(rng) -> None:
    x = jnp.asarray(rng.standard_normal((T, H), np.float32))
    w = jnp.asarray(rng.standard_normal((H, E), np.float32))
    ids, weights = route(x, w, K)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    probs = np.asarray(jax.nn.softmax(x @ w, axis=-1))
    assert np.array_equal(np.asarray(ids), np.argsort(-probs, axis=-1)[:, :K])
    _, raw = route(x, w, K, renormalize=False)
    np.testing.assert_allclose(np.asarray(raw), np.take_along_axis(probs, np.asarray(ids), -1), rtol=1e-5)


def test_bad_shapes_raise_value_error() -> None:
    comm = make_comm()
    params = init_moe_params(jax.random.key(0), hidden=H, ffn=F, num_experts=E)
    with pytest.raises(ValueError, match="x must have shape"):
        moe_layer(comm, params, jnp.zeros((T, H)))
    with pytest.raises(ValueError, match=r"params\['router'\]"):
        moe_layer(comm, {**params, "router": jnp.zeros((H, E + 1))}, jnp.zeros((WORLD * T, H)))
    with pytest.raises(ValueError, match="ffn must be a positive int"):
        init_moe_params(jax.random.key(0), hidden=H, ffn=0, num_experts=E)

"""What a model that already has its mesh and batch shapes needs: the MoEComm on the model's mesh (or the one in
context), any number of tokens up to max_tokens, weights of any float dtype, and each row's expert and weight on the
expert side."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh, named_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc

E, K, H, T = 8, 2, 16, 8


def _cfg(**kw):
    return jmc.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32, **kw)


def _routing(n_rows, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n_rows)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, size=(n_rows, K)).astype(np.float32))


def _dense(x, ids, w, experts):
    """y[t] = sum_k w[t, k] * x[t] @ experts[ids[t, k]]."""
    return jnp.einsum("tk,tkh->th", w, jnp.einsum("th,tkhj->tkj", x, experts[ids]))


def test_a_moecomm_on_the_models_own_mesh_runs_under_jax_set_mesh():
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8])
    comm = jmc.MoEComm(_cfg(), mesh, axis_name="ep", backend="reference")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8 * T, H)), jnp.float32)
    ids, w = _routing(8 * T)
    experts = jnp.asarray(np.random.default_rng(2).normal(size=(E, H, H)) / 4, jnp.float32)

    def layer(x, ids, w, experts):
        d = comm.dispatch(x, ids)
        local = jax.lax.dynamic_slice_in_dim(experts, jax.lax.axis_index("ep") * comm.num_local_experts,
                                             comm.num_local_experts)
        return comm.combine(jax.lax.ragged_dot(d.expert_x, local, d.group_sizes), d.handle, w)

    spec = P(("dp", "ep"))
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731 (the model's shardings)
        f = jax.jit(jax.shard_map(layer, in_specs=(spec, spec, spec, P()), out_specs=spec))
        y = f(put(x, spec), put(ids, spec), put(w, spec), put(experts, P()))
        assert jmc.MoEComm(_cfg(), axis_name="ep", backend="reference").mesh == mesh  # mesh=None: the context's
    np.testing.assert_allclose(np.asarray(y), np.asarray(_dense(x, ids, w, experts)), rtol=1e-5, atol=1e-5)


def test_another_mesh_in_context_raises_our_error_naming_both_meshes_and_the_fix():
    model_mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
    comm = jmc.MoEComm(_cfg(), ep_mesh(8), "ep", backend="reference")
    x = jnp.zeros((8 * T, H), jnp.float32)
    ids, w = _routing(8 * T)
    with jax.set_mesh(model_mesh):
        with pytest.raises(ValueError, match=r"^jax_moe_comm: MoEComm.global view runs under the mesh \{'dp': 2, "
                                             r"'tp': 4\} but the MoEComm was built on the mesh \{'ep': 8\}.*"
                                             r"MoEComm\(cfg, model_mesh, axis_name="):
            jax.jit(lambda x, ids: jmc.dispatch(comm, x, ids))(x, ids)
    auto_mesh = named_mesh((2, 4), ("dp", "tp"))  # a shard_map over the model's mesh, the MoEComm on another
    fn = jax.shard_map(lambda x, ids: comm.dispatch(x, ids).expert_x, mesh=auto_mesh, in_specs=P(("dp", "tp")),
                       out_specs=P(("dp", "tp")))
    with pytest.raises(ValueError, match=r"MoEComm.dispatch runs under the mesh \{'dp': 2, 'tp': 4\}"):
        jax.jit(fn)(x, ids)


def test_the_same_axes_over_other_devices_in_context_raise_our_error_naming_both_device_orders():
    devices = jax.devices()[:8]
    comm = jmc.MoEComm(_cfg(), jax.make_mesh((8,), ("ep",), devices=devices), "ep", backend="reference")
    x = jnp.zeros((8 * T, H), jnp.float32)
    ids, _ = _routing(8 * T)
    with jax.set_mesh(jax.make_mesh((8,), ("ep",), devices=devices[::-1])):
        with pytest.raises(ValueError, match=r"^jax_moe_comm: MoEComm.global view runs under the mesh \{'ep': 8\} of "
                                             r"devices \[7, 6, 5, 4, 3, 2, 1, 0\] but the MoEComm was built on the "
                                             r"mesh \{'ep': 8\} of devices \[0, 1, 2, 3, 4, 5, 6, 7\]"):
            jax.jit(lambda x, ids: jmc.dispatch(comm, x, ids))(x, ids)


def test_mesh_none_without_a_mesh_in_context_says_what_to_give():
    with pytest.raises(ValueError, match=r"mesh is None and no mesh is set: give the model's mesh"):
        jmc.MoEComm(_cfg(), axis_name="ep", backend="reference")


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("n", [1, 5, T])
def test_fewer_tokens_than_max_tokens_and_bf16_weights_give_the_dense_result_and_gradients(world, n):
    mesh = ep_mesh(world)
    L = E // world
    comm = jmc.MoEComm(_cfg(), mesh, "ep", backend="reference", custom_vjp=True)
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(world * n, H)), jnp.float32)
    ids, w = _routing(world * n, seed=n)
    w = w.astype(jnp.bfloat16)
    experts = jnp.asarray(rng.normal(size=(E, H, H)) / 4, jnp.float32)

    def per_shard(x, ids, w, local):
        d = comm.dispatch(x, ids)
        y = comm.combine(jax.lax.ragged_dot(d.expert_x, local, d.group_sizes), d.handle, w)
        assert y.shape == (n, H)
        return y

    spec = P("ep")
    moe = jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec)

    def loss(x, w, experts):
        return jnp.sum(jnp.sin(moe(x, ids, w, experts)))

    def dense_loss(x, w, experts):
        return jnp.sum(jnp.sin(_dense(x, ids, w.astype(jnp.float32), experts)))

    assert experts.shape[0] == world * L
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, experts)
    want = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(x, w, experts)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, h in zip(got[1], want[1], strict=True):
        assert g.dtype == h.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32), rtol=2e-2, atol=2e-3)


def test_more_tokens_than_max_tokens_is_refused_naming_the_fix():
    comm = jmc.MoEComm(_cfg(), ep_mesh(1), "ep", backend="reference")
    ids, _ = _routing(T + 1)
    fn = jax.shard_map(lambda x, ids: comm.dispatch(x, ids).expert_x, mesh=comm.mesh, in_specs=P("ep"),
                       out_specs=P("ep"))
    with pytest.raises(ValueError, match=r"x has 9 rows per shard; one MoEComm takes 1 to max_tokens \(8\): raise "
                                         r"MoECommConfig.max_tokens"):
        fn(jnp.zeros((T + 1, H), jnp.float32), ids)


@pytest.mark.parametrize("world,dp_size", [(1, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("custom_vjp", [False, True])
def test_each_row_knows_its_expert_and_weight_and_scaling_the_input_by_it_differentiates(world, dp_size, custom_vjp):
    mesh = ep_mesh(world)
    comm = jmc.MoEComm(_cfg(dp_size=dp_size, align=4), mesh, "ep", backend="reference", custom_vjp=custom_vjp,
                       expert_weights=True)
    assert "expert_weights=True" in repr(comm)
    L, G = E // world, world // dp_size
    rng = np.random.default_rng(world + dp_size)
    replicated = lambda a: a.reshape(G, T, -1).repeat(dp_size, axis=0).reshape(world * T, -1)  # noqa: E731
    x = replicated(jnp.asarray(rng.normal(size=(G * T, H)), jnp.float32))
    ids, w = (replicated(a) for a in _routing(G * T, seed=3))
    experts = jnp.asarray(rng.normal(size=(E, H, H)) / 4, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(E, H)), jnp.float32)

    def per_shard(x, ids, w, local, local_bias):
        d = comm.dispatch(x, ids, topk_weights=w)
        # Llama 4 style: each row scaled by its weight before the expert; a per-expert bias read by expert_ids.
        rows = d.expert_x * d.expert_weights[:, None]
        out = jax.lax.ragged_dot(rows, local, d.group_sizes) + jnp.where(
            d.expert_ids[:, None] >= 0, local_bias[jnp.maximum(d.expert_ids, 0)], 0.0)
        return comm.combine(out, d.handle, weighted=False)

    def moe(x, w, experts, bias):
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, ids, w, experts, bias)

    def dense(x, w, experts, bias):
        scaled = x[:, None, :] * w[:, :, None]  # [t, k, h]
        return jnp.einsum("tkh,tkhj->tj", scaled, experts[ids]) + bias[ids].sum(axis=1)

    def loss(f):
        return lambda x, w, experts, bias: jnp.sum(jnp.cos(f(x, w, experts, bias)))

    got = jax.jit(jax.value_and_grad(loss(moe), argnums=(1, 2, 3)))(x, w, experts, bias)
    want = jax.value_and_grad(loss(dense), argnums=(1, 2, 3))(x, w, experts, bias)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    # The DP replicas' weights are one parameter: their gradients summed over the replicas are the dense one's.
    np.testing.assert_allclose(np.asarray(got[1][0]).reshape(G, dp_size, T, K).sum(1),
                               np.asarray(want[1][0]).reshape(G, dp_size, T, K).sum(1), rtol=1e-4, atol=1e-4)
    for g, h in zip(got[1][1:], want[1][1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-4)

    plain = jmc.MoEComm(_cfg(dp_size=dp_size, align=4), mesh, "ep", backend="reference")

    def ids_and_sizes(x, ids):
        assert plain.dispatch(x, ids, topk_weights=ids * 0.5).expert_weights is None  # not asked for: no all_gather
        d = comm.dispatch(x, ids)
        return d.expert_ids, d.group_sizes, d.handle.row_origin, d.expert_weights is None

    spec = P("ep")
    out = jax.jit(jax.shard_map(ids_and_sizes, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec, P())))(x, ids)
    eid, sizes, origin = (np.asarray(a).reshape(world, -1) for a in out[:3])
    assert out[3]  # no weights given to dispatch: no expert_weights
    for r in range(world):
        runs = np.repeat(np.arange(L), sizes[r])  # expert l's run of group_sizes[l] rows, then the tail
        want_ids = np.concatenate([runs, np.full(comm.capacity - runs.size, -1)])
        want_ids[origin[r] < 0] = -1  # alignment padding and the tail: no token
        assert eid[r].tolist() == want_ids.tolist()

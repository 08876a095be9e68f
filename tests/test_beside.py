"""dispatch(..., beside=f) and combine(..., beside=f): the round trip in split halves with f() between them, and its
gradient with f's VJP between the backward round trip's halves. On the reference backend: the same values and
gradients as the fused calls with f computed on its own, with the custom VJP rules and with plain AD; for the
NVSHMEM backend (lowered for CUDA on CPU: no kernel runs here; tests/gpu runs them) the backward's halves around
f's VJP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P
from test_send_stream import _depends, _shard_eqns

from jax_moe_comm import MoEComm, MoECommConfig, autodiff, nvshmem_backend
from jax_moe_comm.config import Geometry, Options

T, H, E, K = 4, 16, 8, 2


def _model(comm, beside: bool, weights_to: str, rows: int):
    """A scan of two checkpointed layers, each a round trip with a shared expert (two matmuls) computed beside its
    dispatch and its combine, or on its own; the loss's value and its gradient w.r.t. x, the weights and the shared
    experts' matrices."""
    def shard(x, ids, w, mats):
        def layer(h, m):
            h_rows, ids_rows, w_rows = h[:rows], ids[:rows], w[:rows]
            shared_in = (lambda h, m: jnp.tanh(h @ m), h, m)
            with_dispatch = w_rows if weights_to == "dispatch" else None
            if beside:
                d, a = comm.dispatch(h_rows, ids_rows, topk_weights=with_dispatch, beside=shared_in)
            else:
                d, a = comm.dispatch(h_rows, ids_rows, topk_weights=with_dispatch), shared_in[0](h, m)
            expert_y = jnp.sin(d.expert_x) * 2.0
            with_combine = w_rows if weights_to == "combine" else None
            shared_out = (jnp.matmul, a, m)
            if beside:
                y, b = comm.combine(expert_y, d.handle, with_combine, beside=shared_out)
            else:
                y, b = comm.combine(expert_y, d.handle, with_combine), a @ m
            return h.at[:rows].add(y) + b, None

        y = jax.lax.scan(jax.checkpoint(layer), x, mats)[0]
        return (y * y).sum()[None]

    f = jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep"))
    return jax.jit(jax.value_and_grad(lambda x, ids, w, mats: f(x, ids, w, mats).sum(), argnums=(0, 2, 3)))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("weights_to", ["combine", "dispatch"])
@pytest.mark.parametrize("prereduce_min_tokens", [1, 64])
@pytest.mark.parametrize("rows", [T, T - 1])
def test_beside_computes_what_the_fused_calls_compute(world, weights_to, prereduce_min_tokens, rows):
    """The loss and the gradients (x, weights, shared experts) with the shared expert beside the round trips equal
    those with it computed on its own: with the custom VJP rules (bit for bit) and with plain AD, which agree."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    rng = np.random.default_rng(world * 7 + rows)
    x = jnp.asarray(rng.standard_normal((world * T, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]), jnp.int32)
    w = jnp.asarray(rng.random((world * T, K)), jnp.float32)
    mats = jnp.asarray(rng.standard_normal((2, H, H)) / H, jnp.float32)
    results = {}
    for custom_vjp in (True, False):
        comm = MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=custom_vjp,
                       prereduce_min_tokens=prereduce_min_tokens)
        for beside in (True, False):
            value, grads = _model(comm, beside, weights_to, rows)(x, ids, w, mats)
            results[custom_vjp, beside] = [np.asarray(a) for a in (value, *grads)]
    assert all(np.abs(a).sum() > 0 for a in results[True, True])
    for custom_vjp in (True, False):
        for a, b in zip(results[custom_vjp, True], results[custom_vjp, False], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"custom_vjp={custom_vjp}")
    for a, b in zip(results[True, True], results[False, True], strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_beside_refuses_what_is_not_a_function():
    comm = MoEComm(MoECommConfig(E, K, H, T), ep_mesh(1), backend="reference")
    x, ids = jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, K), jnp.int32).at[:, 1].set(1)
    with pytest.raises(ValueError, match=r"beside must be a tuple \(function, \*args\)"):
        jax.shard_map(lambda x, ids: comm.dispatch(x, ids, beside=x)[0].expert_x, mesh=comm.mesh,
                      in_specs=(P("ep"), P("ep")), out_specs=P("ep"))(x, ids)


def _phases(mode):
    """The NVSHMEM backend's phases on a plan of a made-up context id (nothing runs), world 1."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    geo = Geometry(cfg, 1, ("ep",), Options(send_stream=mode, check_errors=False))
    plan = nvshmem_backend.Plan(geo, 7, True, 0, {}, None)
    return autodiff.Phases(nvshmem_backend, plan, geo, "send")


@pytest.mark.parametrize("which", ["dispatch", "combine"])
def test_the_backward_runs_the_vjp_between_its_own_halves(which):
    """The gradient of a round trip with a matmul beside it: the matmul's VJP (a dot of the cotangent) runs after
    the backward round trip's send half, forked onto the library's stream (send_stream="own"), and before its
    receive. The backward of a dispatch is a combine, that of a combine a dispatch."""
    phases = _phases("own")
    mesh = ep_mesh(1)
    backward = {"dispatch": "combine", "combine": "dispatch"}[which]

    def shard(x, ids, w, m):
        def loss(x, w, m):
            d, a = autodiff.dispatch_beside(phases, jnp.matmul, (x, m), x, ids, None, jnp.int32(T), None)
            if which == "dispatch":
                return (d.expert_x * 3.0).sum() + (a * a).sum()
            shared = lambda m, x: jnp.tanh(m * 3.0) @ x.T  # noqa: E731
            y, b = autodiff.combine_beside(phases, shared, (m, x), d.expert_x, d.handle, w)
            return (y * y).sum() + (b * b).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, m)

    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=(P("ep"), P("ep"), P())))
    eqns = _shard_eqns(f, jnp.zeros((T, H), jnp.float32), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K)),
                       jnp.eye(H))
    targets = [e.params.get("target") for e in eqns]
    sends = [i for i, t in enumerate(targets) if t == f"jmc_{backward}_send_own"]
    recvs = [i for i, t in enumerate(targets) if t == f"jmc_{backward}_recv_own"]
    assert len(sends) == len(recvs) == (1 if which == "dispatch" else 2)
    send, recv = eqns[sends[-1]], eqns[recvs[-1]]  # the backward's (a dispatch's forward is a dispatch too)
    dots = [e for e in eqns[sends[-1]:recvs[-1]] if e.primitive.name == "dot_general"]
    assert dots, "no dot between the backward's halves"
    assert all(_depends(eqns, d.outvars[0], send.outvars[0]) for d in dots)
    assert any(_depends(eqns, v, dots[-1].outvars[0]) for v in recv.invars)


def test_beside_differentiates_its_args_and_refuses_a_closed_over_gradient():
    """With the custom VJP rules compute's gradient reaches what it takes as args; JAX refuses (with its own error) a
    gradient through a value compute closes over, never giving it a silent zero."""
    comm = MoEComm(MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32), ep_mesh(1),
                   backend="reference", custom_vjp=True)
    ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1))

    def grads(closed: bool):
        def shard(x, ids, m):
            def loss(x, m):
                beside = (lambda h: h @ m, x) if closed else (jnp.matmul, x, m)
                d, a = comm.dispatch(x, ids, beside=beside)
                return d.expert_x.sum() + (a * a).sum()
            return jax.grad(loss, argnums=(0, 1))(x, m)
        f = jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=(P("ep"), P()))
        return jax.jit(f)(jnp.ones((T, H)), ids, jnp.eye(H))

    dx, dm = grads(closed=False)
    np.testing.assert_allclose(dm, 2 * jnp.ones((T, H)).T @ jnp.ones((T, H)), rtol=1e-6)  # d/dm sum((x m)^2), m = I
    np.testing.assert_allclose(dx, 1.0 * K + 2 * jnp.ones((T, H)), rtol=1e-6)  # K rows per token, plus 2 x m m^T
    with pytest.raises(Exception, match="closed-over value"):
        grads(closed=True)


def test_beside_takes_a_callable_that_cannot_be_hashed():
    """A module-like callable (unhashable, as a dataclass holding arrays is) goes beside the round trip as it is."""
    class Scale:
        __hash__ = None

        def __call__(self, h, s):
            return h * s

    comm = MoEComm(MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32), ep_mesh(1),
                   backend="reference", custom_vjp=True)
    ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1))

    def shard(x, ids, s):
        return jax.grad(lambda s: comm.dispatch(x, ids, beside=(Scale(), x, s))[1].sum())(s)

    f = jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=P())
    np.testing.assert_allclose(jax.jit(f)(jnp.full((T, H), 0.5), ids, jnp.float32(3.0)), 0.5 * T * H)

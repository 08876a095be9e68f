"""MoEComm(send_stream=...): validated, shown, the same results on the reference backend, and on the NVSHMEM backend
the lowering each mode asks XLA for (lowered for CUDA on CPU: no kernel runs here; tests/gpu runs them)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig, nvshmem_backend
from jax_moe_comm.config import Geometry, Options

MODES = (None, "xla_async", "own")


@pytest.mark.parametrize("value", ["side", "XLA_ASYNC", 1, True, ("own",)])
def test_send_stream_is_validated(value):
    with pytest.raises(ValueError, match=r"send_stream must be one of \(None, 'xla_async', 'own'\), got "):
        MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference", send_stream=value)


@pytest.mark.parametrize("mode", MODES)
def test_send_stream_is_an_option_in_the_repr(mode):
    comm = MoEComm(MoECommConfig(8, 2, 16, 4), ep_mesh(2), backend="reference", send_stream=mode)
    assert comm.options.send_stream == mode
    assert f"send_stream={mode!r}" in repr(comm)


def _layer(comm, world):
    """Split halves with a matmul between each pair, in a lax.scan of two layers under jax.checkpoint, and its
    gradient: every result as numpy."""
    cfg = comm.cfg

    def shard(x, ids, w, mats):
        def one(h, m):
            p = comm.dispatch_send(h, ids)
            between = jnp.tanh(h @ m)  # what the send's stream may overlap
            d = comm.dispatch_recv(p)
            q = comm.combine_send(d.expert_x * 2.0, d.handle, w)
            between = between @ m
            return comm.combine_recv(q) + between, d.group_sizes

        y, sizes = jax.lax.scan(jax.checkpoint(one), x, mats)
        return y, sizes[None]

    f = jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()),
                              out_specs=(P("ep"), P("ep"))))
    rng = np.random.default_rng(5)
    T, H, E, K = cfg.max_tokens, cfg.hidden, cfg.num_experts, cfg.experts_per_token
    x = jnp.asarray(rng.standard_normal((world * T, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]), jnp.int32)
    w = jnp.asarray(rng.random((world * T, K)), jnp.float32)
    mats = jnp.asarray(rng.standard_normal((2, H, H)) / H, jnp.float32)
    y, sizes = f(x, ids, w, mats)
    grads = jax.grad(lambda x, mats: f(x, ids, w, mats)[0].sum(), argnums=(0, 1))(x, mats)
    return [np.asarray(a) for a in (y, sizes, *grads)]


def test_split_halves_give_the_same_bits_in_every_mode():
    """Reference backend: the option changes nothing of what a round trip computes, forward and gradient, in
    jit + shard_map + lax.scan + jax.checkpoint."""
    world = 4
    cfg = MoECommConfig(8, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32)
    results = {m: _layer(MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=False, send_stream=m), world)
               for m in MODES}
    assert np.abs(results[None][0]).sum() > 0
    for mode in MODES[1:]:
        for a, b in zip(results[mode], results[None], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"send_stream={mode!r}")


def _lowered_dispatch_halves(mode: str | None, check_errors=False) -> str:
    """The StableHLO of the NVSHMEM backend's dispatch_send, a matmul, dispatch_recv, lowered for CUDA (a plan of a
    made-up context id: nothing runs)."""
    cfg = MoECommConfig(8, 2, 16, 4)
    geo = Geometry(cfg, 1, ("ep",), Options(send_stream=mode, check_errors=check_errors))
    plan = nvshmem_backend.Plan(geo, 7, True, 0, {}, None)
    mesh = ep_mesh(1)

    def shard(x, ids, m):
        p = nvshmem_backend.dispatch_send(plan, x, ids, None, jnp.int32(cfg.max_tokens))
        between = x.astype(jnp.float32) @ m
        d = nvshmem_backend.dispatch_recv(plan, p)
        return d.expert_x, between

    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=(P("ep"), P("ep"))))
    args = (jax.ShapeDtypeStruct((4, 16), jnp.bfloat16), jax.ShapeDtypeStruct((4, 2), jnp.int32),
            jax.ShapeDtypeStruct((16, 16), jnp.float32))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{target}(" in line]


def test_default_lowering_runs_the_send_on_xla_stream():
    text = _lowered_dispatch_halves(None)
    (send,) = _calls(text, "jmc_dispatch_send")
    assert "side_stream = 0" in send
    (recv,) = _calls(text, "jmc_dispatch_recv")
    assert recv.split("(", 1)[1].split(")", 1)[0].count("%") == 1  # the send's status alone
    assert "_xla_stream_annotation" not in text and "_own" not in text


def test_xla_async_wraps_the_send_in_a_stream_annotation():
    text = _lowered_dispatch_halves("xla_async")
    (send,) = _calls(text, "jmc_dispatch_send")
    assert "side_stream = 0" in send
    annotated = [line for line in text.splitlines() if "call @compute_on" in line]
    assert len(annotated) == 1 and '_xla_stream_annotation = "1"' in annotated[0]
    assert 'inlineable = "false"' in annotated[0]
    assert len(_calls(text, "jmc_dispatch_recv")) == 1


@pytest.mark.parametrize("check_errors", [False, True])
def test_own_stream_forks_the_send_and_keeps_its_operands_to_the_receive(check_errors):
    """send_stream="own": the "_own" targets (never in a command buffer), side_stream = 1 on the send, and the
    receive takes the send's operands as they come out of the send's barrier (the buffers the kernel reads)."""
    text = _lowered_dispatch_halves("own", check_errors)
    assert not _calls(text, "jmc_dispatch_send") and not _calls(text, "jmc_dispatch_recv")
    (send,) = _calls(text, "jmc_dispatch_send_own")
    assert "side_stream = 1" in send
    (recv,) = _calls(text, "jmc_dispatch_recv_own")
    send_operands = send.split("(", 1)[1].split(")", 1)[0].count("%")
    recv_operands = recv.split("(", 1)[1].split(")", 1)[0].count("%")
    assert send_operands == 6 and recv_operands == 1 + send_operands
    assert "_xla_stream_annotation" not in text


def _shard_eqns(f, *args) -> list:
    """The equations inside the shard_map of jit(shard_map(...)) f, in trace order."""
    eqns = jax.make_jaxpr(f)(*args).eqns
    while eqns[0].primitive.name != "shard_map" or len(eqns) > 1:
        (eqns,) = [getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"]).eqns for e in eqns if "jaxpr" in e.params]
    return getattr(eqns[0].params["jaxpr"], "jaxpr", eqns[0].params["jaxpr"]).eqns


def _depends(eqns, out, on) -> bool:
    """Whether variable `out` is computed from variable `on` through `eqns`."""
    reached = {on}
    for e in eqns:
        if any(isinstance(v, jax.extend.core.Var) and v in reached for v in e.invars):
            reached.update(e.outvars)
    return out in reached


@pytest.mark.parametrize("placed", [True, False])
def test_between_orders_the_compute_after_the_send_and_before_the_receive(placed):
    """comm.between ties the compute to the send's result and the receive to the compute's, so XLA cannot move it
    before the send or after the receive (without it nothing does: the check fails as it must)."""
    cfg = MoECommConfig(8, 2, 16, 4)
    plan = nvshmem_backend.Plan(Geometry(cfg, 1, ("ep",), Options(send_stream="own")), 7, True, 0, {}, None)
    mesh = ep_mesh(1)
    comm = MoEComm(cfg, mesh, backend="reference")

    def shard(x, ids, m):
        p = nvshmem_backend.dispatch_send(plan, x, ids, None, jnp.int32(cfg.max_tokens))
        compute = lambda h, m: jnp.tanh(h.astype(jnp.float32) @ m)  # noqa: E731
        between, p = comm.between(p, compute, x, m) if placed else (compute(x, m), p)
        return nvshmem_backend.dispatch_recv(plan, p).expert_x, between

    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=(P("ep"), P("ep"))))
    eqns = _shard_eqns(f, jnp.zeros((4, 16), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), jnp.eye(16))
    targets = [e.params.get("target") for e in eqns]
    send = eqns[targets.index("jmc_dispatch_send_own")]
    recv = eqns[targets.index("jmc_dispatch_recv_own")]
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    after_send = _depends(eqns, dot.outvars[0], send.outvars[0])
    before_recv = any(_depends(eqns, v, dot.outvars[0]) for v in recv.invars)
    assert (after_send, before_recv) == ((True, True) if placed else (False, False))


def test_between_gives_the_same_bits_and_gradients():
    """Reference backend, scan + checkpoint + grad: a layer whose compute sits in comm.between (between each pair of
    halves) computes what it computes without, forward and gradient."""
    world = 2
    cfg = MoECommConfig(8, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=False, send_stream="own")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((world * 4, 16)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(8, 2, replace=False) for _ in range(world * 4)]), jnp.int32)
    w = jnp.asarray(rng.random((world * 4, 2)), jnp.float32)
    mats = jnp.asarray(rng.standard_normal((2, 16, 16)) / 16, jnp.float32)

    def run(placed):
        def shard(x, ids, w, mats):
            def one(h, m):
                compute = lambda h, m: jnp.tanh(h @ m)  # noqa: E731
                p = comm.dispatch_send(h, ids)
                a, p = comm.between(p, compute, h, m) if placed else (compute(h, m), p)
                d = comm.dispatch_recv(p)
                q = comm.combine_send(d.expert_x * 2.0, d.handle, w)
                b, q = comm.between(q, compute, a, m) if placed else (compute(a, m), q)
                return comm.combine_recv(q) + b, None

            return jax.lax.scan(jax.checkpoint(one), x, mats)[0]

        f = jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep")))
        grads = jax.grad(lambda x, mats: f(x, ids, w, mats).sum(), argnums=(0, 1))(x, mats)
        return [np.asarray(a) for a in (f(x, ids, w, mats), *grads)]

    placed, plain = run(True), run(False)
    assert np.abs(plain[0]).sum() > 0 and np.abs(plain[2]).sum() > 0
    for a, b in zip(placed, plain, strict=True):
        np.testing.assert_array_equal(a, b)

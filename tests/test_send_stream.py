"""MoEComm(send_stream=...): validated, shown, the same results on the reference backend, and on the NVSHMEM backend
the lowering each mode asks XLA for (lowered for CUDA on CPU: no kernel runs here; tests/gpu runs them)."""

from __future__ import annotations

import jax
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

"""How a failed round trip reaches the user (reference backend, 8 CPU devices).

A round trip that fails anywhere fails everywhere: every rank ends it with the same status, its combined output is
NaN on every rank, and with the default ``check_errors=True`` every rank raises the same message at the same call,
so that a step of many MoE layers stops with one error instead of leaving devices waiting in a later collective.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import errors

WORLD, T, H, E, K = 4, 4, 8, 8, 2


def _round_trip(check_errors):
    cfg = jax_moe_comm.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors=check_errors)

    def shard(x, ids, w):
        d = comm.dispatch(x, ids)
        return d.handle.status, d.handle.row_origin, d.expert_x, comm.combine(d.expert_x, d.handle, w)

    return jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))


def _inputs(bad_rank: int | None = 0, bad_id: int = 99):
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    if bad_rank is not None:
        ids[bad_rank * T + 1, 1] = bad_id  # token 1 of that rank
    return np.ones((WORLD * T, H), np.float32), ids, np.ones((WORLD * T, K), np.float32)


def test_without_checks_nothing_is_raised_and_the_output_is_nan_on_every_rank():
    """check_errors=False: dispatch's error word stays in the handle of the rank that found it, the round trip
    completes, and its combined output is NaN everywhere (never a number computed without the bad slot)."""
    status, _, _, y = jax.block_until_ready(_round_trip(check_errors=False)(*_inputs(bad_rank=2)))
    status = np.asarray(status).reshape(WORLD, errors.STATUS_WORDS)
    assert status[2, errors.CODE] == errors.BAD_EXPERT_ID
    assert tuple(status[2, [errors.RANK, errors.DETAIL_A, errors.DETAIL_B]]) == (2, 1, 99)
    assert not status[[0, 1, 3]].any()
    assert np.isnan(np.asarray(y)).all()


def test_the_same_call_with_checks_raises_and_the_next_valid_call_works():
    x, ids, w = _inputs()
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 0: expert id 99 of token 1 is outside"):
        jax.block_until_ready(_round_trip(check_errors=True)(x, ids, w))
    *_, y = jax.block_until_ready(_round_trip(check_errors=True)(*_inputs(bad_rank=None)))
    np.testing.assert_array_equal(np.asarray(y), np.full((WORLD * T, H), 2.0))  # weights 1 on both slots


@pytest.mark.parametrize("mode", [True, "sync"])
def test_an_error_on_one_rank_raises_on_every_rank_with_that_ranks_message(mode):
    """Rank 3's bad id: the message names rank 3 (the lowest rank with an error), whichever device raises."""
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 3: expert id 8 of token 1"):
        jax.block_until_ready(_round_trip(check_errors=mode)(*_inputs(bad_rank=3, bad_id=E)))


def test_check_errors_must_be_true_false_or_sync():
    cfg = jax_moe_comm.MoECommConfig(E, K, H, T)
    with pytest.raises(ValueError, match="check_errors must be True, False or 'sync', got 'later'"):
        jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors="later")
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds in \(0, 86400\], got 0"):
        jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", timeout_s=0)


# Duplicate ids ------------------------------------------------------------------------------------------------
def test_a_repeated_id_drops_the_later_slot_like_the_oracle_and_raises():
    """One expert twice in a token's top-k: the later slot is dropped (no row, no weight), as the kernels do and
    the oracle says, and the round trip fails with the repeat named."""
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    ids[1] = [3, 3]  # token 1 of rank 0
    x = np.arange(WORLD * T * H, dtype=np.float32).reshape(WORLD * T, H)
    w = np.ones((WORLD * T, K), np.float32)
    _, row_origin, expert_x, y = jax.block_until_ready(_round_trip(check_errors=False)(x, ids, w))
    layouts = oracle.dispatch(x.reshape(WORLD, T, H), ids.reshape(WORLD, T, K), np.full(WORLD, T), world=WORLD,
                              dp_size=1, num_experts=E, align=1, capacity=T * WORLD * min(K, E // WORLD))
    capacity = layouts[0].row_origin.shape[0]
    row_origin = np.asarray(row_origin).reshape(WORLD, capacity)
    expert_x = np.asarray(expert_x).reshape(WORLD, capacity, H)
    for rank, want in enumerate(layouts):
        np.testing.assert_array_equal(row_origin[rank], want.row_origin)
        np.testing.assert_array_equal(expert_x[rank], want.expert_x)
    assert (row_origin == 1 * K + 1).sum() == 0, "the repeated slot got a row"
    assert np.isnan(np.asarray(y)).all()
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 0: token 1 names expert 3 in two top-k slots"):
        jax.block_until_ready(_round_trip(check_errors=True)(x, ids, w))


# Many layers in one step -------------------------------------------------------------------------------------
CHAIN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_moe_comm as jmc
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    cfg = jmc.MoECommConfig(16, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32)
    shared = sys.argv[1] == "shared"
    comms = [jmc.MoEComm(cfg, mesh)] * 4 if shared else [jmc.MoEComm(cfg, mesh) for _ in range(4)]
    def step(x, ids):
        w = jnp.ones(ids.shape[1:], jnp.float32)
        for layer, comm in enumerate(comms):
            d = comm.dispatch(x, ids[layer])
            x = x + comm.combine(d.expert_x * 0.5, d.handle, w)
        return x
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("ep"), P(None, "ep")), out_specs=P("ep")))
    ids = np.tile(np.array([[0, 9]], np.int32), (4, 32, 1))
    ids[1, 13, 0] = 16  # layer 1, token 1 of rank 3
    start = time.time()
    try:
        jax.block_until_ready(fn(np.ones((32, 16), np.float32), ids))
    except Exception as exc:
        print(f"RAISED in {time.time() - start:.1f}s:", str(exc).splitlines()[-1])
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize("comms", ["one per layer", "shared"])
def test_a_bad_id_in_one_layer_of_a_many_layer_step_raises_one_error_quickly(tmp_path, comms):
    """Four MoE layers in one jitted step, a bad id in layer 1 on one rank: one error with its message, at once,
    instead of the other devices waiting in a later layer's collective until XLA aborts the process (run in a
    subprocess: an abort or a hang must not take the test session down)."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("XLA_FLAGS", None)
    try:
        done = subprocess.run([sys.executable, str(script), "shared" if comms == "shared" else "per layer"],
                              capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the step hung instead of raising")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAISED in" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "dispatch_send failed on rank 3: expert id 16 of token 1 is outside [-1, num_experts)" in done.stdout
    seconds = float(done.stdout.split("RAISED in ")[1].split("s:")[0])
    assert seconds < 10, f"the error took {seconds}s"

"""MoEComm(check_errors=False): no host callback, nothing raised; dispatch's error stays in handle.status."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import errors

WORLD, T, H = 4, 4, 8


def _round_trip(check_errors: bool):
    cfg = jax_moe_comm.MoECommConfig(8, 2, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors=check_errors)

    def shard(x, ids, w):
        d = comm.dispatch(x, ids)
        return comm.combine(d.expert_x, d.handle, w), d.handle.status

    return jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))


def test_without_checks_a_bad_id_is_reported_in_the_handle_not_raised():
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    ids[1, 1] = 99  # token 1 of rank 0
    x = np.ones((WORLD * T, H), np.float32)
    w = np.ones((WORLD * T, 2), np.float32)
    y, status = jax.block_until_ready(_round_trip(check_errors=False)(x, ids, w))
    status = np.asarray(status).reshape(WORLD, errors.STATUS_WORDS)
    assert status[0, 0] == errors.BAD_EXPERT_ID and tuple(status[0, 2:]) == (1, 99)
    assert not status[1:].any()
    np.testing.assert_array_equal(np.asarray(y)[1], np.ones(H))  # the bad slot was dropped, the good one kept


def test_the_same_call_with_checks_raises():
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    ids[1, 1] = 99
    x = np.ones((WORLD * T, H), np.float32)
    w = np.ones((WORLD * T, 2), np.float32)
    try:
        jax.block_until_ready(_round_trip(check_errors=True)(x, ids, w))
    except Exception as exc:  # JaxRuntimeError carrying MoECommError's text
        assert "expert id 99 of token 1 is outside [-1, num_experts)" in str(exc)
    else:
        raise AssertionError("no error raised")
    jax.block_until_ready(_round_trip(check_errors=True)(x, np.where(ids == 99, 1, ids), w))  # clears the error

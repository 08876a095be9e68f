"""dispatch(x, ids, quantize=float8_e4m3fn): bf16 rows quantized by the dispatch, with block scales. The reference
backend here (the NVSHMEM kernels quantize as they send: tests/gpu, the "quantize" cases, against the same
reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import MoEComm, MoECommConfig, quantize_rows

WORLD, E, K, H, T, BLOCK = 4, 8, 2, 64, 8, 16


def numpy_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule, written out: per block, scale = amax * float32(1 / 448) (1 if all zero), q = x * (1 / scale)
    saturated at 448 and rounded to nearest even (ml_dtypes' float8_e4m3fn)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(-1)
    scales = np.where(amax > 0, amax * (np.float32(1) / np.float32(448)), np.float32(1)).astype(np.float32)
    q = np.clip(blocks * (np.float32(1) / scales)[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), scales


def test_quantize_rows_is_block_amax_scaling_rounded_to_nearest_even(rng):
    x = (rng.standard_normal((6, H)) * rng.choice([1e-3, 1.0, 300.0], (6, 1))).astype(jnp.bfloat16)
    x[2, :BLOCK] = 0  # an all-zero block: scale 1, zeros
    q, scales = quantize_rows(jnp.asarray(x), BLOCK)
    want_q, want_scales = numpy_quantize(np.asarray(x, np.float32), BLOCK)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert scales[2, 0] == 1.0 and not np.asarray(q, np.float32)[2, :BLOCK].any()
    # Each block's largest element maps to +-448 exactly: the full range is used.
    assert np.all(np.abs(np.asarray(q, np.float32)).reshape(6, -1, BLOCK).max(-1)[np.asarray(scales) != 1] == 448)


def test_non_finite_inputs_stay_non_finite():
    """A NaN keeps its place (its block's amax is NaN: scale 1, the other elements unscaled, clipped to +-448); an
    infinity makes its block's scale inf, itself NaN (inf * 0) and the rest zero: every such block dequantizes to
    NaN or inf somewhere, never to finite numbers alone. The kernels follow the same rule (tests/gpu: "NaN and
    inf")."""
    block = 128  # R1's: XLA:CPU's vectorized max skips NaN at such sizes, which the quantizer must not
    x = np.ones((32, 4 * block), np.float32)
    x[1, 2], x[2, 3], x[3, 4] = np.nan, np.inf, -np.inf
    q, scales = quantize_rows(jnp.asarray(x, jnp.bfloat16), block)
    q, scales = np.asarray(q, np.float32), np.asarray(scales)
    assert np.isnan(q[1, 2]) and scales[1, 0] == 1.0 and np.all(np.delete(q[1, :block], 2) == 1.0)
    for row, col in ((2, 3), (3, 4)):
        assert scales[row, 0] == np.inf and np.isnan(q[row, col])
        assert not np.delete(q[row, :block], col).any()
    assert np.all(np.isfinite(q[:, block:])) and np.all(scales[:, 1:] == scales[0, 1])  # other blocks unchanged
    assert np.all(np.isfinite(q[4:])) and np.all(scales[4:] == scales[0, 1])


def _comm(**options) -> MoEComm:
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float8_e4m3fn, scale_block=BLOCK, out_dtype=jnp.float32)
    return MoEComm(cfg, ep_mesh(WORLD), backend="reference", **options)


def test_quantizing_dispatch_equals_dispatching_quantized_rows(rng, seed):
    comm = _comm()
    x = jnp.asarray(rng.standard_normal((WORLD * T, H)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((WORLD * T, E)), axis=1)[:, :K], jnp.int32)
    w = jnp.asarray(rng.random((WORLD * T, K)), jnp.float32)

    @jax.jit
    def both(x, ids, w):
        q, scales = quantize_rows(x, BLOCK)
        in_dispatch = jax_moe_comm.dispatch(comm, x, ids, quantize=jnp.float8_e4m3fn)
        first = jax_moe_comm.dispatch(comm, q, ids, scales)
        ys = [jax_moe_comm.combine(comm, d.expert_x.astype(jnp.float32) * d.expert_scales.repeat(BLOCK, 1),
                                   d.handle, w) for d in (in_dispatch, first)]
        return in_dispatch, first, ys

    got, want, (y_got, y_want) = both(x, ids, w)
    for name in ("expert_x", "expert_scales", "group_sizes"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{name} (seed={seed})")
    np.testing.assert_array_equal(np.asarray(got.handle.row_origin), np.asarray(want.handle.row_origin))
    np.testing.assert_array_equal(np.asarray(y_got), np.asarray(y_want))
    # The dequantized rows are the tokens to fp8's precision.
    assert np.abs(np.asarray(y_got)).max() > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(quantize=jnp.bfloat16), "quantize must be the MoEComm's fp8 payload dtype"),
    (dict(quantize=jnp.float8_e4m3fn, scales=np.ones((T, H // BLOCK), np.float32)), "scales must be None"),
])
def test_bad_quantize_arguments_name_the_fix(kwargs, message):
    comm = _comm()
    x = jnp.zeros((T, H), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        comm.dispatch(x, jnp.zeros((T, K), jnp.int32), **kwargs)


def test_quantize_takes_bf16_rows_and_fp8_comms_only():
    with pytest.raises(ValueError, match="x must have dtype bfloat16"):
        _comm().dispatch(jnp.zeros((T, H), jnp.float32), jnp.zeros((T, K), jnp.int32), quantize=jnp.float8_e4m3fn)
    bf16 = MoEComm(MoECommConfig(E, K, H, T), ep_mesh(WORLD), backend="reference")
    with pytest.raises(ValueError, match="quantize must be the MoEComm's fp8 payload dtype"):
        bf16.dispatch(jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, K), jnp.int32), quantize=jnp.float8_e4m3fn)


def test_gradients_pass_the_quantization_straight_through(rng, seed):
    """With linear experts and a linear loss, d loss / d x does not depend on the rows: through a quantizing
    dispatch (custom VJP, gradients in float32) it equals the unquantized float32 model's, to fp8's precision (the
    cotangent of the fp8 expert_x is fp8, as JAX gives a cotangent its primal's dtype; the loss is scaled so that it
    stays in fp8's normal range)."""
    x = rng.standard_normal((WORLD * T, H)).astype(np.float32)
    ids = np.argsort(rng.random((WORLD * T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((WORLD * T, K)).astype(np.float32)
    expert_w = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    c = (1000 * rng.standard_normal((WORLD * T, H))).astype(np.float32)

    def dx(comm, quantize):
        def per_shard(x, ids, w, ew, c):
            if quantize:
                d = comm.dispatch(x.astype(jnp.bfloat16), ids, quantize=jnp.float8_e4m3fn)
                rows = d.expert_x.astype(jnp.float32) * jnp.repeat(d.expert_scales, BLOCK, axis=1)
            else:
                d = comm.dispatch(x, ids)
                rows = d.expert_x
            y = comm.combine(jax.lax.ragged_dot(rows, ew, d.group_sizes), d.handle, w)
            return jnp.sum(y * c, keepdims=True)
        mapped = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))
        return jax.jit(jax.grad(lambda x: jnp.sum(mapped(x, ids, w, expert_w, c))))(x)

    f32 = MoEComm(MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32), ep_mesh(WORLD),
                  backend="reference", custom_vjp=True)
    got = dx(_comm(custom_vjp=True, grad_dtype=jnp.float32), True)
    want = dx(f32, False)
    scale = float(np.abs(want).max())
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=0.15, atol=0.05 * scale, err_msg=f"seed={seed}")

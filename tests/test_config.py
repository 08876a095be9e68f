"""Every configuration and argument error: ValueError naming the argument (RuntimeError for an unavailable backend).

These checks run at construction or trace time, before any collective, so most tests call the per-shard methods
directly with per-shard shapes; one test shows the same errors inside shard_map and through the global view.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import CombineHandle, MoEComm, MoECommConfig, errors

E, K, H, T = 8, 2, 32, 4
BASE = dict(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T)


def config(**overrides) -> MoECommConfig:
    return MoECommConfig(**{**BASE, **overrides})


# MoECommConfig ----------------------------------------------------------------------------------------------
def test_valid_config_defaults():
    """Defaults: bf16 payload and output, dp_size 1, align 1, default capacity, no scale_block (non-fp8)."""
    cfg = config()
    assert cfg.dtype == np.dtype(jnp.bfloat16) and cfg.out_dtype == np.dtype(jnp.bfloat16)
    assert (cfg.dp_size, cfg.align, cfg.capacity, cfg.scale_block) == (1, 1, None, None)


def test_fp8_scale_block_defaults_to_128():
    assert config(hidden=256, dtype=jnp.float8_e4m3fn).scale_block == 128


@pytest.mark.parametrize("name", ["num_experts", "experts_per_token", "hidden", "max_tokens", "dp_size", "align"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4", None])
def test_sizes_must_be_positive_ints(name, value):
    """num_experts, experts_per_token, hidden, max_tokens, dp_size and align: positive ints (not bool/float/str)."""
    with pytest.raises(ValueError, match=rf"^{name} must be a positive int"):
        config(**{name: value})


def test_numpy_integer_sizes_are_accepted():
    cfg = config(num_experts=np.int64(8), hidden=np.int32(32))
    assert (cfg.num_experts, cfg.hidden) == (8, 32) and type(cfg.num_experts) is int


@pytest.mark.parametrize("value", [0, -3, 1.5])
def test_capacity_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=r"^capacity must be a positive int"):
        config(capacity=value)


def test_experts_per_token_at_most_num_experts():
    """K > E is rejected; K == E is fine."""
    with pytest.raises(ValueError, match=r"^experts_per_token must be <= num_experts \(8\), got 9"):
        config(experts_per_token=9)
    assert config(experts_per_token=E).experts_per_token == E


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.int32, jnp.int8, jnp.float8_e5m2, "float64"])
def test_payload_dtype_must_be_supported(dtype):
    """dtype: bfloat16, float16, float32 or float8_e4m3fn."""
    with pytest.raises(ValueError, match=r"^dtype must be one of bfloat16, float16, float32, float8_e4m3fn"):
        config(dtype=dtype)


@pytest.mark.parametrize("dtype", [object(), "not-a-dtype"])
def test_payload_dtype_must_be_a_dtype(dtype):
    with pytest.raises(ValueError, match=r"^dtype must be a dtype"):
        config(dtype=dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_supported_payload_dtypes(dtype):
    block = 16 if dtype == "float8_e4m3fn" else None
    assert config(dtype=jnp.dtype(dtype), scale_block=block).dtype == np.dtype(dtype)


@pytest.mark.parametrize("out_dtype", [jnp.float8_e4m3fn, jnp.float64, jnp.int32])
def test_out_dtype_must_be_supported(out_dtype):
    """out_dtype: bfloat16, float16 or float32 (fp8 is a payload dtype only)."""
    with pytest.raises(ValueError, match=r"^out_dtype must be one of bfloat16, float16, float32"):
        config(out_dtype=out_dtype)


def test_out_dtype_must_be_a_dtype():
    with pytest.raises(ValueError, match=r"^out_dtype must be a dtype"):
        config(out_dtype=object())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_scale_block_only_for_fp8(dtype):
    with pytest.raises(ValueError, match=r"^scale_block is only for dtype float8_e4m3fn"):
        config(dtype=dtype, scale_block=16)


@pytest.mark.parametrize("block", [0, -16, 2.0])
def test_fp8_scale_block_must_be_a_positive_int(block):
    with pytest.raises(ValueError, match=r"^scale_block must be a positive int"):
        config(dtype=jnp.float8_e4m3fn, scale_block=block)


def test_fp8_scale_block_must_divide_hidden():
    with pytest.raises(ValueError, match=r"^hidden \(32\) must be a multiple of scale_block \(12\)"):
        config(dtype=jnp.float8_e4m3fn, scale_block=12)
    with pytest.raises(ValueError, match=r"^hidden \(32\) must be a multiple of scale_block \(128\)"):
        config(dtype=jnp.float8_e4m3fn)  # the default block


def test_row_origin_bound_waits_for_the_world():
    """(group * max_tokens + token) * K + slot is an int32, a bound that depends on num_dp: the config alone accepts
    max_tokens**2 * K beyond 2**31, and so does MoEComm while num_dp * max_tokens * K fits (the bound tested below)."""
    cfg = config(max_tokens=2**16, experts_per_token=1, align=1)
    assert MoEComm(cfg, ep_mesh(8)).capacity == 8 * 2**16  # worst case: every token of 8 ranks to one expert


# MoEComm -----------------------------------------------------------------------------------------------------
def test_world_must_be_divisible_by_dp_size():
    with pytest.raises(ValueError, match=r"^dp_size \(3\) must divide the size of mesh axis 'ep' \(4\)"):
        MoEComm(config(dp_size=3), ep_mesh(4))


def test_num_experts_must_be_a_multiple_of_world():
    with pytest.raises(ValueError, match=r"^num_experts \(6\) must be a multiple of the size of mesh axis 'ep' \(4\)"):
        MoEComm(config(num_experts=6), ep_mesh(4))


def test_row_origin_must_fit_int32_for_the_world():
    """num_dp * max_tokens * K must fit in int32 once the world is known."""
    cfg = config(num_experts=2**28, experts_per_token=2**28, max_tokens=1)
    with pytest.raises(ValueError, match=r"num_dp \* max_tokens \* experts_per_token must fit in int32"):
        MoEComm(cfg, ep_mesh(8))


def test_axis_name_must_be_a_mesh_axis():
    with pytest.raises(ValueError, match=r"^axis_name 'tp' is not an axis of the mesh \('ep',\)"):
        MoEComm(config(), ep_mesh(2), axis_name="tp")


def test_axis_name_selects_the_ep_axis_of_a_2d_mesh():
    """Other mesh axes are left alone; the world is the size of axis_name."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"))
    assert MoEComm(config(), mesh, axis_name="ep").world == 4
    assert MoEComm(config(), mesh, axis_name="dp").world == 2


def test_cfg_must_be_a_config():
    with pytest.raises(ValueError, match=r"^cfg must be a MoECommConfig"):
        MoEComm(BASE, ep_mesh(2))


@pytest.mark.parametrize("backend", ["cuda", "", "Reference", None])
def test_backend_name_must_be_known(backend):
    with pytest.raises(ValueError, match=r"^backend must be one of \('auto', 'nvshmem', 'reference'\)"):
        MoEComm(config(), ep_mesh(2), backend=backend)


def test_nvshmem_backend_on_cpu_raises_with_a_reason():
    """Asking for NVSHMEM where it cannot run is a RuntimeError that says why (no silent fallback)."""
    with pytest.raises(RuntimeError, match=r"backend='nvshmem' is not available: .+") as info:
        MoEComm(config(), ep_mesh(2), backend="nvshmem")
    assert "CUDA" in str(info.value) or "cuda" in str(info.value)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_auto_and_reference_backends_run_the_reference_on_cpu(backend):
    assert MoEComm(config(), ep_mesh(2), backend=backend).backend == "reference"


# Per-call arguments ------------------------------------------------------------------------------------------
WORLD = 2


@pytest.fixture(scope="module")
def comm() -> MoEComm:
    return MoEComm(config(dtype=jnp.float32), ep_mesh(WORLD))


@pytest.fixture(scope="module")
def fp8_comm() -> MoEComm:
    return MoEComm(config(dtype=jnp.float8_e4m3fn, scale_block=16), ep_mesh(WORLD))


def good_dispatch_args(dtype=jnp.float32):
    return jnp.zeros((T, H), dtype), jnp.zeros((T, K), jnp.int32)


@pytest.mark.parametrize(("x", "message"), [
    (jnp.zeros((T + 1, H), jnp.float32), r"^x has 5 rows per shard; one MoEComm takes 1 to max_tokens \(4\)"),
    (jnp.zeros((T, H - 1), jnp.float32), r"^x must have shape \(4, 32\)"),
    (jnp.zeros((T,), jnp.float32), r"^x must be an array \[n, hidden\] \(n <= max_tokens = 4\), got \(4,\)"),
    (jnp.zeros((T, H), jnp.bfloat16), r"^x must have dtype float32, got bfloat16"),
    ([[0.0] * H] * T, r"^x must be an array \[n, hidden\] \(n <= max_tokens = 4\), got list"),
])
def test_x_shape_and_dtype(comm, x, message):
    """dispatch: x [n, H] with 1 <= n <= max_tokens, in the config's dtype."""
    with pytest.raises(ValueError, match=message):
        comm.dispatch(x, jnp.zeros((len(x), K), jnp.int32))


@pytest.mark.parametrize(("x", "message"), [
    (jnp.zeros((T + 1, H), jnp.float32), r"^x must have shape \(4, 32\) \(per shard\), got \(5, 32\)"),
    (jnp.zeros((T - 1, H), jnp.float32), r"^x must have shape \(4, 32\) \(per shard\), got \(3, 32\)"),
    (jnp.zeros((T, H - 1), jnp.float32), r"^x must have shape \(4, 32\)"),
    (jnp.zeros((T,), jnp.float32), r"^x must have shape \(4, 32\)"),
    (jnp.zeros((T, H), jnp.bfloat16), r"^x must have dtype float32, got bfloat16"),
    ([[0.0] * H] * T, r"^x must be an array of shape \(4, 32\), got list"),
])
def test_x_shape_and_dtype_of_the_split_send(comm, x, message):
    """dispatch_send: x exactly [max_tokens, H] (the split halves take no other row count)."""
    with pytest.raises(ValueError, match=message):
        comm.dispatch_send(x, jnp.zeros((len(x), K), jnp.int32))


@pytest.mark.parametrize(("ids", "message"), [
    (jnp.zeros((T, K + 1), jnp.int32), r"^topk_ids must have shape \(4, 2\) \(per shard\), got \(4, 3\)"),
    (jnp.zeros((T * 2, K), jnp.int32), r"^topk_ids must have shape \(4, 2\)"),
    (jnp.zeros((T, K), jnp.uint32), r"^topk_ids must have dtype int32, got uint32"),
    (np.zeros((T, K), np.int64), r"^topk_ids must have dtype int32, got int64"),
    (jnp.zeros((T, K), jnp.float32), r"^topk_ids must have dtype int32, got float32"),
])
def test_topk_ids_shape_and_dtype(comm, ids, message):
    with pytest.raises(ValueError, match=message):
        comm.dispatch(jnp.zeros((T, H), jnp.float32), ids)


def test_fp8_requires_scales(fp8_comm):
    with pytest.raises(ValueError, match=r"^scales is required for float8_e4m3fn payloads"):
        fp8_comm.dispatch(*good_dispatch_args(jnp.float8_e4m3fn))


@pytest.mark.parametrize(("scales", "message"), [
    (jnp.zeros((T, H // 16 + 1), jnp.float32), r"^scales must have shape \(4, 2\) \(per shard\), got \(4, 3\)"),
    (jnp.zeros((T, H // 16), jnp.bfloat16), r"^scales must have dtype float32, got bfloat16"),
])
def test_fp8_scales_shape_and_dtype(fp8_comm, scales, message):
    with pytest.raises(ValueError, match=message):
        fp8_comm.dispatch(*good_dispatch_args(jnp.float8_e4m3fn), scales=scales)


def test_scales_are_rejected_for_non_fp8_payloads(comm):
    with pytest.raises(ValueError, match=r"^scales is only for float8_e4m3fn payloads; dtype is float32"):
        comm.dispatch(*good_dispatch_args(), scales=jnp.ones((T, 1), jnp.float32))


@pytest.mark.parametrize(("num_tokens", "message"), [
    (jnp.array([2], jnp.int32), r"^num_tokens must be an integer scalar \(per shard\), got int32\[1\]"),
    (jnp.array([1, 2], jnp.int32), r"^num_tokens must be an integer scalar"),
    (jnp.float32(2.0), r"^num_tokens must be an integer scalar \(per shard\), got float32\[\]"),
    (2.0, r"^num_tokens must be an integer scalar"),
])
def test_num_tokens_must_be_an_integer_scalar(comm, num_tokens, message):
    with pytest.raises(ValueError, match=message):
        comm.dispatch(*good_dispatch_args(), num_tokens=num_tokens)


def _handle(comm: MoEComm) -> CombineHandle:
    return CombineHandle(row_origin=jnp.full((comm.capacity,), -1, jnp.int32), topk_ids=jnp.zeros((T, K), jnp.int32),
                         num_tokens=jnp.int32(T), status=jnp.zeros((errors.STATUS_WORDS,), jnp.int32))


EXPERT_Y_DTYPE = r"^expert_y must have dtype bfloat16, float16 or float32 no wider than out_dtype \(bfloat16\); got "


@pytest.mark.parametrize("method", ["combine", "combine_send"])
@pytest.mark.parametrize(("rows", "dtype", "message"), [
    (1, jnp.bfloat16, r"^expert_y must have shape \(\d+, 32\) \(per shard\), got \(\d+, 32\)"),
    (-1, jnp.bfloat16, r"^expert_y must have shape \(\d+, 32\) \(per shard\), got \(\d+, 32\)"),
    (0, jnp.int32, EXPERT_Y_DTYPE + "int32"),
    (0, jnp.float8_e4m3fn, EXPERT_Y_DTYPE + "float8_e4m3fn"),
    (0, jnp.float32, EXPERT_Y_DTYPE + "float32"),  # wider than out_dtype
    (0, np.float64, EXPERT_Y_DTYPE + "float64"),
])
def test_expert_y_shape_and_dtype(comm, method, rows, dtype, message):
    """expert_y: [capacity, H], bfloat16/float16/float32 and no wider than out_dtype (bfloat16 here)."""
    expert_y = np.zeros((comm.capacity + rows, H), dtype)
    args = (expert_y, _handle(comm)) + ((jnp.zeros((T, K), jnp.float32),) if method == "combine" else ())
    with pytest.raises(ValueError, match=message):
        getattr(comm, method)(*args)


@pytest.mark.parametrize("hidden", [H - 1, H + 1])
def test_expert_y_hidden_must_match(comm, hidden):
    with pytest.raises(ValueError, match=r"^expert_y must have shape"):
        comm.combine_send(jnp.zeros((comm.capacity, hidden), jnp.bfloat16), _handle(comm))


@pytest.mark.parametrize("method", ["combine", "combine_send"])
def test_handle_must_be_a_combine_handle(comm, method):
    args = (jnp.zeros((comm.capacity, H), jnp.bfloat16), {"row_origin": None})
    args += (jnp.zeros((T, K), jnp.float32),) if method == "combine" else ()
    with pytest.raises(ValueError, match=r"^handle must be the CombineHandle from dispatch, got dict"):
        getattr(comm, method)(*args)


@pytest.mark.parametrize("method", ["combine", "combine_send", "combine_recv"])
@pytest.mark.parametrize(("weights", "message"), [
    (jnp.zeros((T, K + 1), jnp.float32), r"^topk_weights must have shape \(4, 2\) \(per shard\), got \(4, 3\)"),
    (jnp.zeros((T, K), jnp.int32), r"^topk_weights must have a float dtype \(cast to float32 inside\), got int32"),
])
def test_topk_weights_shape_and_dtype(comm, method, weights, message):
    """topk_weights: [max_tokens, K] of a float dtype (any: test_model_integration runs bfloat16), checked before
    anything is sent."""
    expert_y = jnp.zeros((comm.capacity, H), jnp.bfloat16)
    args = (None, weights) if method == "combine_recv" else (expert_y, _handle(comm), weights)
    with pytest.raises(ValueError, match=message):
        getattr(comm, method)(*args)


def test_argument_errors_surface_when_tracing_inside_shard_map(comm):
    """Inside a user's shard_map the per-shard shapes are checked at trace time."""
    mapped = jax.shard_map(lambda x, ids: comm.dispatch(x, ids).expert_x, mesh=comm.mesh, in_specs=P("ep"),
                           out_specs=P("ep"))
    x = jnp.zeros((WORLD * T, H + 1), jnp.float32)  # hidden is wrong
    with pytest.raises(ValueError, match=r"^x must have shape \(4, 32\) \(per shard\), got \(4, 33\)"):
        jax.jit(mapped)(x, jnp.zeros((WORLD * T, K), jnp.int32))


def test_global_view_checks_per_shard_shapes(comm):
    """The global-view wrappers take [world * max_tokens, ...] arrays and report per-shard shapes."""
    ids = jnp.zeros((WORLD * T, K), jnp.int32)
    with pytest.raises(ValueError, match=r"^x must have dtype float32, got float16"):
        jax.jit(lambda x, i: jax_moe_comm.dispatch(comm, x, i))(jnp.zeros((WORLD * T, H), jnp.float16), ids)
    with pytest.raises(ValueError, match=r"^topk_ids must have shape \(4, 2\) \(per shard\), got \(4, 3\)"):
        jax_moe_comm.dispatch(comm, jnp.zeros((WORLD * T, H), jnp.float32), jnp.zeros((WORLD * T, K + 1), jnp.int32))
    with pytest.raises(ValueError, match=r"^num_tokens must be integer \(one count per rank\)"):
        jax_moe_comm.dispatch(comm, jnp.zeros((WORLD * T, H), jnp.float32), ids,
                              num_tokens=jnp.zeros((WORLD,), jnp.float32))


def test_global_view_num_tokens_must_be_one_count_per_rank(comm):
    """Global-view num_tokens is int32 [world]; any other shape is a ValueError naming num_tokens."""
    ids = jnp.zeros((WORLD * T, K), jnp.int32)
    with pytest.raises(ValueError, match=r"num_tokens"):
        jax_moe_comm.dispatch(comm, jnp.zeros((WORLD * T, H), jnp.float32), ids,
                              num_tokens=jnp.zeros((WORLD, 2), jnp.int32))


def _layout_end(layout):
    return max(offset + size for offset, size in layout.values())


# The symmetric layout is computed in Python alone (also where the extension is absent, for sizing the heap); the
# extension carves its buffers by these names.
@pytest.mark.parametrize("fields", [
    dict(num_experts=8, experts_per_token=2, hidden=64, max_tokens=16),
    dict(num_experts=12, experts_per_token=3, hidden=100, max_tokens=5, dp_size=3, align=4, out_dtype=jnp.float32),
    dict(num_experts=256, experts_per_token=8, hidden=7168, max_tokens=128, dtype=jnp.float8_e4m3fn,
         scale_block=128),
], ids=["small", "dp3-align4", "r1"])
def test_the_symmetric_layout_tiles_its_bytes_with_aligned_buffers(fields):
    from jax_moe_comm import nvshmem_backend

    cfg = MoECommConfig(**fields)
    for world in (3, 6) if cfg.dp_size == 3 else (2, 4):
        layout = nvshmem_backend.symmetric_layout(cfg, world)
        end = 0
        for name, (offset, size) in layout.items():
            assert offset == end and offset % 16 == 0 and size % 16 == 0 and size > 0, (name, offset, size)
            end = offset + size
        assert nvshmem_backend.symmetric_bytes(cfg, world, low_latency_max_tokens=0) == end
        sizes = nvshmem_backend.kernel_sizes(cfg, world, rank=0)
        assert layout["dispatch_slots"][1] >= world * sizes["slots_per_source"] * sizes["token_stride"]
        assert layout["round_failures"][1] == 2 * world * errors.STATUS_WORDS * 4
        # Rows per slot, or pre-reduced rows (one per distinct expert rank of a token, at most K): one [T][K] region
        # for either, whatever the world size.
        stride = sizes["combine_stride"]
        assert layout["combine_rows"][1] == cfg.max_tokens * cfg.experts_per_token * stride
        # The staging buffers only where a job sends through them: a token's row once per rank it goes to (and once
        # quantized), and the expert rows per slot or the pre-reduced rows (one per source token with a live slot
        # here); the routes and counts that say where the packed rows went.
        staging_only = ("dispatch_staging", "dispatch_routes", "dispatch_counts", "dest_rows", "combine_staging",
                        "group_routes", "group_counts")
        assert not set(staging_only) & set(layout)
        staged = nvshmem_backend.symmetric_layout(cfg, world, staging=True)
        assert staged["dispatch_staging"][1] >= (
            cfg.max_tokens * (min(cfg.experts_per_token, world) + 1) * sizes["token_stride"])
        assert staged["combine_staging"][1] >= max(sizes["capacity"], world * sizes["slots_per_source"]) * stride
        assert staged["dispatch_routes"][1] >= world * sizes["slots_per_source"] * cfg.experts_per_token * 4
        assert nvshmem_backend.symmetric_bytes(cfg, world, staging=True) == end + sum(
            staged[name][1] for name in staging_only)
        # The low-latency path's buffers only where its fused calls take it (few tokens, rows of whole 8-byte
        # pairs, NVLink): words of 4 data bytes and the epoch, twice the rows' bytes.
        flagged = nvshmem_backend.symmetric_layout(cfg, world, flagged=True)
        assert flagged["flagged_rows"][1] >= 2 * world * sizes["slots_per_source"] * (
            sizes["payload_bytes"] + 4 * sizes["scale_cols"])
        assert flagged["flagged_combine"][1] == 2 * cfg.max_tokens * cfg.experts_per_token * stride
        takes = cfg.max_tokens <= 32 and cfg.hidden % 8 == 0
        assert nvshmem_backend.takes_flagged_path(cfg, 32, False) is takes
        assert not nvshmem_backend.takes_flagged_path(cfg, 32, True)
        assert nvshmem_backend.symmetric_bytes(cfg, world, low_latency_max_tokens=32) == _layout_end(
            flagged if takes else layout)
        assert "flagged_rows" not in staged

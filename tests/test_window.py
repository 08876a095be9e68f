"""max_symmetric_bytes: a bounded symmetric heap. Above the bound the rows of a round trip travel in rounds through
buffers of one round (the window); the routing (ids, weights, flags) keeps a word per token, so every rank knows the
whole layout before any row moves. The kernels' rounds run on the GPU tests (tests/gpu); here, the sizes."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from conftest import ep_mesh, kernel_eqns, kernel_targets

from jax_moe_comm import MoEComm, MoECommConfig, memory
from jax_moe_comm import nvshmem_backend as nb

R1 = MoECommConfig(num_experts=256, experts_per_token=8, hidden=7168, max_tokens=4096, dtype=jnp.float8_e4m3fn,
                   out_dtype=jnp.bfloat16)
SMALL = MoECommConfig(num_experts=8, experts_per_token=2, hidden=64, max_tokens=16, dp_size=2)


def heap(cfg: MoECommConfig, world: int, window_slots: int | None, shared_with=()) -> int:
    layout = nb.symmetric_layout(cfg, world, False, False, shared_with, window_slots)
    return sum(size for _, size in layout.values())


def test_a_heap_within_the_bound_has_no_window():
    full = nb.symmetric_bytes(R1, 8)
    assert nb.window_slots_for(R1, 8, full) is None
    assert nb.window_slots_for(R1, 8, None) is None
    assert nb.symmetric_bytes(R1, 8, max_bytes=full) == full


def rounds_of(slots: int, window: int) -> int:
    return -(-slots // window)


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("fraction", [2, 3, 8])
def test_the_window_takes_the_fewest_rounds_that_fit_split_evenly(world, fraction):
    """R1 at 4096 tokens per rank (4096 slots per source): the window fits, one round fewer would not, and the slots
    are split evenly among the rounds (e.g. four rounds of 1024, not three of the largest window that fits and a
    short fourth)."""
    bound = heap(R1, world, None) // fraction
    window = nb.window_slots_for(R1, world, bound)
    rounds = rounds_of(4096, window)
    assert heap(R1, world, window) <= bound
    assert heap(R1, world, rounds_of(4096, rounds - 1)) > bound  # one round fewer does not fit
    assert window == rounds_of(4096, rounds)  # the slots split evenly: no round fuller than needed
    assert nb.symmetric_bytes(R1, world, max_bytes=bound) == heap(R1, world, window)


def test_windowed_row_buffers_hold_one_round_and_the_routing_stays_whole():
    world, slots = 4, 3  # SMALL: 8 slots per source (16 tokens, 2 replicas), 3 a round: 6 tokens per DP group
    whole = nb.symmetric_layout(SMALL, world)
    windowed = nb.symmetric_layout(SMALL, world, window_slots=slots)
    sizes = nb.kernel_sizes(SMALL, world, 0, window_slots=slots)
    assert (sizes["slots_per_source"], sizes["window_slots"]) == (8, 3)
    round16 = lambda n: -(-n // 16) * 16  # noqa: E731
    assert windowed["dispatch_slots"][1] == round16(world * slots * sizes["token_stride"])
    assert windowed["combine_rows"][1] == round16(slots * SMALL.dp_size * SMALL.experts_per_token *
                                                  sizes["combine_stride"])
    for name in ("dispatch_ids", "combine_weights", "combine_flags", "row_of"):
        assert windowed[name][1] == whole[name][1], name
    for name in ("window_ready", "dispatch_window_free", "combine_window_free"):
        assert windowed[name][1] == whole[name][1] == round16(world * 8), name


def test_an_fp8_layers_backward_shares_the_window():
    """The gradient config's rows (bf16) are the wider ones: the window is chosen for the shared buffers."""
    grad = R1.gradient_config(8, jnp.bfloat16)
    bound = heap(R1, 8, None, (grad,)) // 4
    window = nb.window_slots_for(R1, 8, bound, shared_with=(grad,))
    assert heap(R1, 8, window, (grad,)) <= bound < heap(R1, 8, rounds_of(4096, rounds_of(4096, window) - 1), (grad,))
    assert window < nb.window_slots_for(R1, 8, bound)


def test_a_bound_below_one_round_of_one_slot_is_refused():
    with pytest.raises(ValueError, match=r"max_symmetric_bytes=1000 is below the smallest windowed heap of this "
                                         r"config \(\d+ bytes, one slot per source a round\)"):
        MoEComm(R1, ep_mesh(8), backend="reference", max_symmetric_bytes=1000)


def test_the_staged_path_has_no_window():
    with pytest.raises(ValueError, match="needs a windowed round trip .* NVLink peers only: not with staged=True"):
        MoEComm(R1, ep_mesh(8), backend="reference", staged=True, max_symmetric_bytes=heap(R1, 8, None) // 2)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "1GiB"])
def test_max_symmetric_bytes_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=r"max_symmetric_bytes must be None or a positive int \(bytes per GPU\), got "):
        MoEComm(SMALL, ep_mesh(4), backend="reference", max_symmetric_bytes=value)


def test_a_moecomm_reports_its_window_and_bounded_heap():
    bound = heap(R1, 8, None) // 3
    comm = MoEComm(R1, ep_mesh(8), backend="reference", max_symmetric_bytes=bound)
    assert comm.symmetric_bytes <= bound
    assert comm.window_tokens == nb.window_slots_for(R1, 8, bound) * R1.dp_size
    assert f"max_symmetric_bytes={bound}" in repr(comm)
    assert MoEComm(R1, ep_mesh(8), backend="reference").window_tokens is None


def test_a_whole_r1_model_at_ep64_fits_a_one_gib_bound():
    """The model's heap (forward, backward in bf16, remat: one buffer set) under max_symmetric_bytes=1 GiB."""
    cfg = memory.r1_config(4096)
    unbounded = memory.heap_bytes(cfg, 64, jnp.bfloat16)
    bounded = memory.heap_bytes(cfg, 64, jnp.bfloat16, max_bytes=memory.GIB)
    assert bounded <= memory.GIB < unbounded


@pytest.mark.parametrize("window_slots, weights_at, calls", [
    (None, "send", ["jmc_dispatch_send", "jmc_dispatch_recv", "jmc_combine_send", "jmc_combine_recv"]),
    (3, "send", ["jmc_dispatch", "jmc_combine"]),
    (3, "recv", ["jmc_dispatch", "jmc_combine"]),
])
def test_the_split_halves_of_a_windowed_plan_run_the_fused_calls(window_slots, weights_at, calls):
    """A round's send waits for the previous round's receive, so one kernel must do both: on a windowed plan
    dispatch_send and combine_send launch nothing, and their second halves launch the fused calls."""
    from jax.sharding import PartitionSpec as P

    from jax_moe_comm.config import Geometry, Options

    cfg, world = MoECommConfig(8, 2, 64, 16, dtype=jnp.bfloat16), 2
    geo = Geometry(cfg, world, ("ep",), Options(check_errors=False))
    plan = nb.Plan(geo, ctx=1, p2p=True, rank=0, layout={}, window_slots=window_slots)

    def halves(x, ids, w):
        n = jnp.int32(cfg.max_tokens)
        d = nb.dispatch_recv(plan, nb.dispatch_send(plan, x, ids, None, n))
        q = nb.combine_send(plan, d.expert_x, d.handle, w if weights_at == "send" else None)
        return nb.combine_recv(plan, q, w if weights_at == "recv" else None)

    mapped = jax.shard_map(halves, mesh=ep_mesh(world), in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.zeros((world * cfg.max_tokens, cfg.hidden), jnp.bfloat16)
    ids = jnp.zeros((world * cfg.max_tokens, cfg.experts_per_token), jnp.int32)
    w = jnp.zeros((world * cfg.max_tokens, cfg.experts_per_token), jnp.float32)
    assert kernel_targets(mapped, x, ids, w) == calls


def kernel_calls(fn, *args) -> list:
    """The kernel calls of fn's program (target, operand shapes, attributes), in program order (traced only)."""
    return [(eqn.params["target"], [v.aval.shape for v in eqn.invars], dict(eqn.params["attributes"]))
            for eqn, _ in kernel_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


@pytest.mark.parametrize("flagged", [False, True])
def test_a_low_latency_plan_sends_no_weights_with_its_dispatch(flagged):
    """The low-latency path's combine reads the weights at home (rows per slot): weights given to dispatch stay out
    of its call (they would make the kernel take the other path) and the combine is told none were sent."""
    from jax.sharding import PartitionSpec as P

    from jax_moe_comm.config import Geometry, Options

    cfg, world = MoECommConfig(8, 2, 64, 16, dtype=jnp.bfloat16), 2
    geo = Geometry(cfg, world, ("ep",), Options(check_errors=False))
    plan = nb.Plan(geo, ctx=1, p2p=True, rank=0, layout={}, window_slots=None, flagged=flagged)

    def round_trip(x, ids, w):
        d = nb.dispatch(plan, x, ids, None, jnp.int32(cfg.max_tokens), topk_weights=w)
        return nb.combine(plan, d.expert_x, d.handle, None, "recv")

    mapped = jax.shard_map(round_trip, mesh=ep_mesh(world), in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.zeros((world * cfg.max_tokens, cfg.hidden), jnp.bfloat16)
    ids = jnp.zeros((world * cfg.max_tokens, cfg.experts_per_token), jnp.int32)
    w = jnp.zeros((world * cfg.max_tokens, cfg.experts_per_token), jnp.float32)
    (dispatch, dispatch_shapes, _), (combine, _, combine_attrs) = kernel_calls(mapped, x, ids, w)
    assert (dispatch, combine) == ("jmc_dispatch", "jmc_combine")
    sent_weights = dispatch_shapes[4]  # x, scales, ids, num_tokens, weights, after
    assert sent_weights == ((0,) if flagged else (cfg.max_tokens, cfg.experts_per_token))
    assert int(combine_attrs["weights_sent"]) == (0 if flagged else 1)
    assert int(combine_attrs["reduced"]) == 0


def test_a_bound_keeps_the_low_latency_path_only_where_its_buffers_fit():
    """Under max_symmetric_bytes the low-latency path's buffers are part of the unwindowed heap: a bound that holds
    them keeps the path; one that holds only the other path's buffers keeps every row in one round without the path
    (no window needed); below that, rounds as before."""
    cfg = MoECommConfig(32, 8, 512, 1, dtype=jnp.float8_e4m3fn, scale_block=128)
    world = 8
    plain = nb.symmetric_bytes(cfg, world, low_latency_max_tokens=0)
    flagged = nb.symmetric_bytes(cfg, world, low_latency_max_tokens=32)
    assert flagged > plain
    assert nb.window_and_path(cfg, world, None, low_latency_max_tokens=32) == (None, True)
    assert nb.window_and_path(cfg, world, flagged, low_latency_max_tokens=32) == (None, True)
    assert nb.window_and_path(cfg, world, plain, low_latency_max_tokens=32) == (None, False)
    assert nb.symmetric_bytes(cfg, world, max_bytes=plain, low_latency_max_tokens=32) == plain
    assert nb.window_and_path(cfg, world, None, low_latency_max_tokens=0) == (None, False)

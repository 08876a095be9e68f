"""A training step's MoE traffic is this library's own: the NVSHMEM backend's forward and backward issue no XLA
collective.

Combine's gradient needs each row's routing weight on the expert side and each row's dot product with dy at home;
at world > 1 both travel through a round trip of the library's own (autodiff.py, the weights exchange) instead of
``all_gather``s. So processes that share one GPU, where NCCL refuses every XLA collective, can train, and a
backward pass at world > 1 adds nothing to XLA's collective stream.

The NVSHMEM backend's program is lowered here on stand-in plans (nothing runs): the lowered module of a jitted
training step (forward, backward, update) holds kernel calls and no collective beyond the user's own, which these
steps avoid (each rank holds its own copy of the router, and its own loss). The same step on the reference backend
is the check that the count sees collectives where there are some.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh, nvshmem_stand_in
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig, MoECommError, errors, memory

E, K, H, T, LAYERS = 8, 2, 16, 8, 2
COLLECTIVE = re.compile(r"stablehlo\.(all_gather|all_reduce|all_to_all|collective_permute|reduce_scatter|"
                        r"collective_broadcast)\b")


def collectives(fn, *args) -> list[str]:
    """The collectives of fn's module lowered for CUDA (StableHLO, before XLA's own partitioning), in order."""
    return COLLECTIVE.findall(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())


def train_step(comm: MoEComm, weights_to: str, scan: bool, trains_x: bool, reads_load: bool = False):
    """One SGD step of a stack of MoE layers (router top-K, dispatch, tanh experts by ragged_dot, combine), every
    rank with its own copy of the router and its own loss: user code without a collective. reads_load: each layer's
    output also depends on its dispatch's expert_counts and dropped_rows (as a balancing loss or a monitor would)."""
    world = comm.world

    def layer(x, router, experts):
        topk_weights, topk_ids = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), K)
        d = comm.dispatch(x, topk_ids, topk_weights=topk_weights if weights_to == "dispatch" else None)
        expert_y = jnp.tanh(jax.lax.ragged_dot(d.expert_x, experts, d.group_sizes))
        y = x + comm.combine(expert_y, d.handle, topk_weights if weights_to == "combine" else None)
        if reads_load:
            y = y + 1e-3 * (jnp.max(d.expert_counts) + d.dropped_rows).astype(y.dtype)
        return y

    def loss(params, x):  # per shard: router [1, LAYERS, H, E] (this rank's copy), experts [LAYERS, L, H, H]
        router = params["router"][0]
        if scan:
            body = jax.checkpoint(lambda x, p: (layer(x, *p), None))
            x = jax.lax.scan(body, x, (router, params["experts"]))[0]
        else:
            for i in range(LAYERS):
                x = layer(x, router[i], params["experts"][i])
        return jnp.mean(x**2)

    def shard_step(params, x):
        trained = {**params, "x": x} if trains_x else params
        value, grads = jax.value_and_grad(lambda p: loss(p, p["x"] if trains_x else x))(trained)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, {k: grads[k] for k in params})
        return params, value.reshape(1)

    specs = {"router": P("ep"), "experts": P(None, "ep")}
    step = jax.shard_map(shard_step, mesh=comm.mesh, in_specs=(specs, P("ep")), out_specs=(specs, P("ep")))
    rng = np.random.default_rng(0)
    params = {"router": jnp.asarray(rng.standard_normal((world, LAYERS, H, E)), jnp.float32),
              "experts": jnp.asarray(rng.standard_normal((LAYERS, E, H, H)) / np.sqrt(H), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((world * T, H)), jnp.float32)
    return step, params, x


def comm_for(world: int, backend: str) -> MoEComm:
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=True, check_errors=False)
    return nvshmem_stand_in(comm) if backend == "nvshmem" else comm


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("weights_to", ["combine", "dispatch"])
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan of checkpointed layers"])
@pytest.mark.parametrize("trains_x", [True, False], ids=["x trained", "x frozen"])
def test_a_training_step_issues_no_xla_collective(world, weights_to, scan, trains_x):
    step, params, x = train_step(comm_for(world, "nvshmem"), weights_to, scan, trains_x)
    assert collectives(step, params, x) == []


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan of checkpointed layers"])
def test_reading_the_expert_load_issues_no_xla_collective(world, scan):
    """expert_counts and dropped_rows come out of the NVSHMEM dispatch's kernels: a balancing loss that reads them
    adds no psum."""
    step, params, x = train_step(comm_for(world, "nvshmem"), "combine", scan, True, reads_load=True)
    assert collectives(step, params, x) == []


@pytest.mark.parametrize("world", [2, 4])
def test_the_count_sees_the_reference_backends_collectives(world):
    """The same step through the reference backend's collectives: the count is not blind."""
    step, params, x = train_step(comm_for(world, "reference"), "combine", False, True, reads_load=True)
    found = collectives(step, params, x)
    assert "all_to_all" in found and "all_reduce" in found, found


def test_the_weights_exchange_gives_the_all_gather_rules_gradients():
    """World 4, reference backend, custom VJP (whose weights exchange runs on the reference's own all_to_all): the
    step's gradients equal plain AD's."""
    results = []
    for custom in (True, False):
        cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
        comm = MoEComm(cfg, ep_mesh(4), backend="reference", custom_vjp=custom)
        step, params, x = train_step(comm, "combine", True, True)
        results.append(jax.jit(step)(params, x))
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


class _HostWords:
    """nvshmem_backend's host-side failure reports, as they behave, on plans named by strings: a routing error is
    raised once, a protocol failure until reset; take_unraised gives one that no check raised."""

    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = dict(failures)
        self.raised: set[str] = set()

    def raise_pending(self, plan) -> None:
        text = self.failures.get(plan)
        if text is not None:
            self.raised.add(plan)
            if not text.endswith(errors.FATAL_SUFFIX):
                del self.failures[plan]
            raise MoECommError(text)

    def take_unraised(self, plan) -> str | None:
        if plan in self.raised or plan not in self.failures:
            return None
        self.raised.add(plan)
        return self.failures[plan]

    def destroy_plan(self, plan) -> None:
        pass


BAD_ID = errors.describe([errors.BAD_EXPERT_ID, 0, 1, 3, 99, 1, 0, 0])
TIMED_OUT = errors.describe([errors.TIMEOUT, 1, 0, 1, 0, 2, 0, 0])


@pytest.mark.parametrize(("exchange_failure", "then"), [(BAD_ID, [None, None]), (TIMED_OUT, [TIMED_OUT] * 2)],
                         ids=["routing error: raised once", "protocol failure: its own"])
def test_the_weights_exchange_reports_only_its_own_failures(monkeypatch, exchange_failure, then):
    """The exchange's dispatch checks the forward's routing again, so a bad id is recorded on both buffer sets: it is
    raised once (by the round trips' set), while a protocol failure of the exchange is its own and is raised."""
    from jax_moe_comm import comm as comm_module

    comm = comm_for(2, "reference")
    comm._phases = dataclasses.replace(comm._phases, plan="round trips",
                                       weights=dataclasses.replace(comm._phases.weights, plan="exchange"))
    comm.backend = "nvshmem"
    monkeypatch.setattr(comm_module, "nvshmem_backend", _HostWords({"round trips": BAD_ID,
                                                                    "exchange": exchange_failure}))
    for want in [BAD_ID, *then]:
        if want is None:
            comm.check()  # raises nothing
        else:
            with pytest.raises(MoECommError) as info:
                comm.check()
            assert str(info.value) == want


def test_an_unraised_routing_error_of_the_exchange_is_not_reported_at_close(monkeypatch):
    """At close() (and exit) only failures no check raised are reported; the exchange's copy of a routing error is
    the round trips' own, reported once."""
    from jax_moe_comm import comm as comm_module

    comm = comm_for(2, "reference")
    comm._phases = dataclasses.replace(comm._phases, plan="round trips",
                                       weights=dataclasses.replace(comm._phases.weights, plan="exchange"))
    comm.backend = "nvshmem"
    monkeypatch.setattr(comm_module, "nvshmem_backend", _HostWords({"round trips": BAD_ID, "exchange": BAD_ID}))
    assert comm._take_unraised() == BAD_ID
    assert comm._take_unraised() is None


def test_symmetric_bytes_counts_the_exchange_as_an_nvshmem_job_allocates_it():
    """comm.symmetric_bytes sizes NVSHMEM's heap: on the reference backend it is the figure of the NVSHMEM MoEComm
    of the same options (custom_vjp by default there), the low-latency path's buffers included."""
    cfg = MoECommConfig(E, 6, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    for world in (1, 2, 4):
        base = memory.heap_bytes(cfg, world, low_latency_max_tokens=T)
        exchange = memory.weights_exchange_bytes(cfg, world, low_latency_max_tokens=T)
        assert (exchange > 0) == (world > 1)
        assert exchange > memory.weights_exchange_bytes(cfg, world) or world == 1  # its low-latency buffers
        for custom_vjp, total in ((None, base + exchange), (True, base + exchange), (False, base)):
            comm = MoEComm(cfg, ep_mesh(world), backend="reference", custom_vjp=custom_vjp, low_latency_max_tokens=T)
            assert comm.symmetric_bytes == total, (world, custom_vjp)

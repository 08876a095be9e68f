"""Every backward round trip is whole, whatever a training step differentiates.

A layer's backward is one round trip shared by two gradient rules (autodiff.py): combine's rule dispatches dy, and
dispatch's rule combines the row gradients. When the dispatch is not differentiated (its x needs no gradient: a
frozen embedding, or a model that trains only the experts and the router), dispatch's rule never runs, and before
the fix the next round trip found a dispatch where a combine belonged ("expected combine_send" on the GPU). The
handle's grad_link tells combine's rule whether dispatch's follows; when it does not, combine's rule finishes the
round trip itself.

Here the NVSHMEM backend's program is traced with a stand-in plan (nothing runs): its kernel calls, in program
order, must form whole round trips, one after the other; and the reference backend with the same rules
(custom_vjp=True) gives plain AD's gradients in the same steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROUND_TRIPS_CONTEXT, WEIGHTS_EXCHANGE_CONTEXT, ep_mesh, kernel_calls, kernel_eqns, nvshmem_stand_in
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig

WORLD, E, K, H, T, LAYERS = 2, 8, 2, 16, 8, 3
ROUND_TRIP = {True: ["dispatch", "combine"],  # NVLink path: the fused calls
              False: ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]}


def nvshmem_comm(p2p: bool) -> MoEComm:
    """A MoEComm whose phases are the NVSHMEM backend's on a stand-in plan: traceable and lowerable on CPU."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    return nvshmem_stand_in(MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=True, check_errors=False),
                            p2p)


def kernel_order(fn, *args, context: int = ROUND_TRIPS_CONTEXT) -> list[str]:
    """The kernel calls of fn's program on one plan (`context`) in program order (their targets without "jmc_")."""
    return [target.removeprefix("jmc_") for target, ctx in kernel_calls(fn, *args) if ctx == context]


def two_steps(comm: MoEComm, trains: tuple[str, ...], weights_to: str = "combine", scan: bool = False):
    """Two SGD steps in one function of (x, ids, params), differentiating only the params named in `trains`
    ("x", "router", "experts"). Layer: x + combine(tanh(ragged_dot(dispatch(x), experts)), softmax gates)."""

    def layer(x, ids, router, experts):
        gates = jax.nn.softmax(jnp.take_along_axis(x @ router, jnp.maximum(ids, 0), axis=1), axis=-1)
        d = comm.dispatch(x, ids, topk_weights=gates if weights_to == "dispatch" else None)
        expert_y = jnp.tanh(jax.lax.ragged_dot(d.expert_x, experts, d.group_sizes))
        return x + comm.combine(expert_y, d.handle, gates if weights_to == "combine" else None)

    def model(x, ids, router, experts):
        if scan:
            step = jax.checkpoint(lambda x, p: (layer(x, *p), None))
            return jax.lax.scan(step, x, (ids, router, experts))[0]
        for i in range(LAYERS):
            x = layer(x, ids[i], router[i], experts[i])
        return x

    mapped = jax.shard_map(model, mesh=comm.mesh, in_specs=(P("ep"), P(None, "ep"), P(), P(None, "ep")),
                           out_specs=P("ep"))

    def steps(x, ids, params):
        losses = []
        for _ in range(2):
            def loss(trained, params=params):
                p = {**params, **trained}
                return jnp.mean(mapped(p["x"], ids, p["router"], p["experts"]) ** 2)

            value, grads = jax.value_and_grad(loss)({name: params[name] for name in trains})
            params = {**params, **{name: params[name] - 0.1 * grads[name] for name in trains}}
            losses.append(value)
        return jnp.stack(losses), params

    return steps


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.argsort(rng.random((WORLD * T, E)), axis=1)[:, :K] for _ in range(LAYERS)]).astype(np.int32)
    ids[:, ::3, 1] = -1
    params = {"x": rng.standard_normal((WORLD * T, H)).astype(np.float32),
              "router": rng.standard_normal((LAYERS, H, E)).astype(np.float32),
              "experts": (rng.standard_normal((LAYERS, E, H, H)) / np.sqrt(H)).astype(np.float32)}
    return params["x"], ids, params


TRAINED = [("router", "experts"), ("experts",), ("router",), ("x", "router", "experts")]


@pytest.mark.parametrize("p2p", [True, False], ids=["fused", "four phases"])
@pytest.mark.parametrize("weights_to", ["combine", "dispatch"])
@pytest.mark.parametrize("trains", TRAINED, ids=["+".join(t) for t in TRAINED])
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan of checkpointed layers"])
def test_every_backward_round_trip_is_whole(p2p, weights_to, trains, scan):
    """Two training steps in one jit: the kernel calls form whole round trips in program order (forward: one per
    layer; backward: one per layer, the first layer's too when its x is frozen), and so do the weights exchange's
    (one per layer's backward)."""
    x, ids, params = inputs()
    step = two_steps(nvshmem_comm(p2p), trains, weights_to, scan)
    trip = ROUND_TRIP[p2p]
    layers = 1 if scan else LAYERS  # a scan's body is traced once
    for context, trips_per_layer in ((ROUND_TRIPS_CONTEXT, 2), (WEIGHTS_EXCHANGE_CONTEXT, 1)):
        order = kernel_order(step, x, ids, params, context=context)
        assert order == trip * (len(order) // len(trip)), (context, order)
        assert len(order) == 2 * layers * trips_per_layer * len(trip), (context, order)  # two steps


@pytest.mark.parametrize("weights_to", ["combine", "dispatch"])
@pytest.mark.parametrize("trains", TRAINED[:3], ids=["+".join(t) for t in TRAINED[:3]])
def test_the_rules_give_plain_ad_gradients_with_x_frozen(weights_to, trains):
    """Where combine's rule finishes the round trip itself (x frozen), the custom VJP still equals plain AD."""
    x, ids, params = inputs(1)
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    results = [jax.jit(two_steps(MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=custom), trains,
                                 weights_to))(x, ids, params) for custom in (True, False)]
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _one_layer_grad(comm: MoEComm, loss_of):
    """jax.grad of loss_of(x, d, comm) w.r.t. x, per shard, d = comm.dispatch(x, ids)."""
    def loss(x, ids):
        return loss_of(x, comm.dispatch(x, ids), comm)

    return jax.shard_map(jax.grad(loss), mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep"))


def _gates(x):
    """Routing weights computed from x (per shard, like a router's)."""
    return jax.nn.softmax(x[:, :K], axis=-1)


HALF_LINKED = {
    # the combine's output does not reach the loss, expert_x does: dispatch's rule opens a round trip itself
    "combine unread": lambda x, d, comm: (comm.combine(d.expert_x, d.handle, _gates(x)), jnp.sum(d.expert_x ** 2))[1],
    # the handle under stop_gradient: combine's rule closes its own round trip, dispatch's opens another
    "handle under stop_gradient": lambda x, d, comm: jnp.sum(comm.combine(
        jnp.tanh(d.expert_x), jax.tree.map(jax.lax.stop_gradient, d.handle), _gates(x)) ** 2),
}


@pytest.mark.parametrize("name", sorted(HALF_LINKED))
def test_a_rule_whose_partner_does_not_run_makes_whole_round_trips_itself(name):
    comm = nvshmem_comm(True)
    x, ids, _ = inputs()
    order = kernel_order(_one_layer_grad(comm, HALF_LINKED[name]), x, ids[0])
    assert order == ["dispatch", "combine"] * (len(order) // 2) and len(order) >= 4, order


@pytest.mark.parametrize("name", sorted(HALF_LINKED))
def test_those_rules_still_give_plain_ad_gradients(name):
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    x, ids, _ = inputs(2)
    got, want = (jax.jit(_one_layer_grad(MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=custom),
                                         HALF_LINKED[name]))(x, ids[0]) for custom in (True, False))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_an_eager_shard_map_differentiates_through_the_custom_vjp():
    """Outside jit (an eager shard_map, which refuses custom VJPs with symbolic zeros by itself), forward and
    gradient run and equal plain AD's."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    x, ids, _ = inputs(3)

    def loss_of(x, d, comm):
        return jnp.sum(comm.combine(jnp.tanh(d.expert_x), d.handle, _gates(x)) ** 2)

    got = _one_layer_grad(MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=True), loss_of)(x, ids[0])
    plain = MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=False)
    want = jax.jit(_one_layer_grad(plain, loss_of))(x, ids[0])  # plain AD's, compiled once (eager: each op alone)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_the_backward_dispatch_is_checked_after_its_dy():
    """With check_errors=True a host-side check runs in front of each dispatch and waits for the round trip two
    before it. The backward's dispatch of dy must be checked after dy exists, i.e. after the later layers' backward
    round trips have been launched: a check that XLA may run as soon as the forward's output exists would count a
    round trip the host has not launched and wait for work queued behind itself (until its deadline)."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = nvshmem_stand_in(MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=True, check_errors=True))
    x, ids, params = inputs()

    def backward(x, ids, experts, dy):
        def layer(x):
            d = comm.dispatch(x, ids)
            return comm.combine(jnp.tanh(jax.lax.ragged_dot(d.expert_x, experts, d.group_sizes)), d.handle,
                                jax.nn.softmax(x[:, :K], axis=-1))
        return jax.vjp(layer, x)[1](dy)[0]

    mapped = jax.shard_map(backward, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep")),
                           out_specs=P("ep"))
    closed = jax.make_jaxpr(mapped)(x, ids[0], params["experts"][0], x)
    dy = closed.jaxpr.invars[3]
    calls = [(eqn.params["target"], hit) for eqn, hit in kernel_eqns(closed.jaxpr, [dy])]
    checks = [hit for target, hit in calls if target == "jmc_check"]
    # The forward's dispatch and the backward's dispatch of dy (the weights exchange's failures are raised by
    # check(), close() and at exit: its routing errors are the forward's).
    assert checks == [False, True], calls


@pytest.mark.parametrize("weights_to", ["combine", "dispatch"])
def test_replicated_weights_get_the_sum_of_every_ranks_gradient(weights_to):
    """Routing weights replicated over the EP axis inside shard_map (in_specs P()): the custom VJP returns their
    gradient replicated, the sum over the ranks, as plain AD does (it failed on the cotangent's type before)."""
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    x, ids, params = inputs(2)
    w = jax.nn.softmax(jnp.asarray(np.random.default_rng(3).standard_normal((T, K)), jnp.float32), axis=-1)
    grads = []
    for custom in (True, False):
        comm = MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=custom)

        def layer(x, ids, experts, w, comm=comm):
            d = comm.dispatch(x, ids, topk_weights=w if weights_to == "dispatch" else None)
            y = jnp.tanh(jax.lax.ragged_dot(d.expert_x, experts, d.group_sizes))
            return comm.combine(y, d.handle, w if weights_to == "combine" else None)

        mapped = jax.shard_map(layer, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()), out_specs=P("ep"))
        loss = lambda x, experts, w, f=mapped: jnp.sum(f(x, ids[0][:WORLD * T], experts, w) ** 2)  # noqa: E731
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, params["experts"][0], w))
    for got, want in zip(grads[0], grads[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

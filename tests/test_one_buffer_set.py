"""One MoEComm (one buffer set) serves every layer of a model: forward, backward and rematerialization.

A MoEComm carries one round trip at a time. In a model the order of the round trips is given by data: layer i + 1
dispatches layer i's output, and in the backward pass layer i's round trips take the cotangent that layer i + 1's
produced. Under jax.checkpoint the NVSHMEM backend's round trips are not recomputed: their custom calls have an
effect, so JAX keeps their results for the backward pass (test_kernel_calls_under_checkpoint_run_once); the
reference backend, which has no buffers, recomputes its collectives. So a 58-layer model trains on one MoEComm, and
its symmetric memory is that of one MoEComm whatever the depth. See docs/design.md, "One buffer set for a whole
model".

Here, on the reference backend, the custom VJP (the NVSHMEM backend's gradient rules) with every whole layer under
jax.checkpoint, in a Python loop and in a lax.scan, gives the gradients and SGD steps of plain AD.
tests/gpu/nvshmem_cases.py runs the loop on the kernels, where two interleaved round trips would fail with
"expected <phase>".
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm import MoEComm, MoECommConfig

LAYERS, WORLD, E, K, H, T = 58, 4, 8, 2, 8, 4
SGD_STEPS, LEARNING_RATE = 2, 1e-4  # small steps: the losses go down smoothly, the two rules stay comparable
LOOP, SCAN = "loop of rematerialized layers", "scan of a rematerialized layer"
# router [layers, H, E] replicated; experts [layers, E, H, H] sharded over the EP axis on dim 1 (on dim 0 per layer)
PARAM_SPECS = {"router": P(), "experts": P(None, "ep")}


def make_comm(custom_vjp: bool, **options) -> MoEComm:
    cfg = MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    return MoEComm(cfg, ep_mesh(WORLD), backend="reference", custom_vjp=custom_vjp, **options)


def moe_model(comm: MoEComm, layers: int, composition: str):
    """(train_step, comms) of a `layers`-deep residual MoE model on `comm`. train_step(params, x, ids) -> (loss,
    grads, params after one SGD step), loss = sum(model(x) ** 2); comms: every MoEComm a layer ran its round trips
    on, filled in as jax traces the layers.

    Per shard, layer i: x [T, H] -> x + combine(tanh(ragged_dot(dispatch(x, ids[i]), experts[i])), gates), the
    gates a softmax of the router's logits of the K experts in ids[i] (routing given as data: no discrete choice
    depends on x, so the two gradient rules see the same round trips). The whole layer, round trips included, is
    under jax.checkpoint: the backward pass recomputes it."""
    comms: set[MoEComm] = set()

    @jax.checkpoint
    def layer(x, ids, router, experts):
        comms.add(comm)
        logits = jnp.take_along_axis(x @ router, jnp.maximum(ids, 0), axis=1)
        d = comm.dispatch(x, ids)
        expert_y = jnp.tanh(jax.lax.ragged_dot(d.expert_x, experts, d.group_sizes))
        return x + comm.combine(expert_y, d.handle, jax.nn.softmax(logits, axis=-1))

    if composition == SCAN:
        def per_shard(params, x, ids):  # ids [layers, T, K]; experts [layers, L, H, H]: this rank's experts
            per_layer = (ids, params["router"], params["experts"])
            return jax.lax.scan(lambda x, p: (layer(x, *p), None), x, per_layer)[0]

        model = jax.shard_map(per_shard, mesh=comm.mesh, in_specs=(PARAM_SPECS, P("ep"), P(None, "ep")),
                              out_specs=P("ep"))
    else:
        # One jitted layer, called once per layer: XLA compiles the layer once, where one program of 58 unrolled
        # layers takes minutes to compile on CPU (tests/gpu/nvshmem_cases.py jits the whole loop).
        one_layer = jax.jit(jax.shard_map(layer, mesh=comm.mesh, in_specs=(P("ep"), P("ep"), P(), P("ep")),
                                          out_specs=P("ep")))

        def model(params, x, ids):
            for i in range(layers):
                x = one_layer(x, ids[i], params["router"][i], params["experts"][i])
            return x

    def train_step(params, x, ids):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(model(p, x, ids) ** 2))(params)
        return loss, grads, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return (jax.jit(train_step) if composition == SCAN else train_step), comms


@functools.cache
def cached_train_step(composition: str, custom_vjp: bool):
    return moe_model(make_comm(custom_vjp), LAYERS, composition)[0]


def model_inputs(rng, layers: int = LAYERS) -> tuple[dict, np.ndarray, np.ndarray]:
    """(params, x [WORLD * T, H], ids [layers, WORLD * T, K]): distinct experts per token, some -1 slots; experts
    scaled by 1 / sqrt(layers) so the residual stream and its gradients stay of order one through every layer."""
    ids = np.stack([np.argsort(rng.random((WORLD * T, E)), axis=1)[:, :K] for _ in range(layers)]).astype(np.int32)
    ids[:, ::5, 1] = -1
    params = {"router": rng.standard_normal((layers, H, E)).astype(np.float32),
              "experts": (rng.standard_normal((layers, E, H, H)) / np.sqrt(H * layers)).astype(np.float32)}
    return params, rng.standard_normal((WORLD * T, H)).astype(np.float32), ids


def assert_close_per_layer(got: dict, want: dict, what: str) -> None:
    """got == want within float32 rounding through 58 layers, each layer against its own scale, and no layer all
    zero (a test of values that are zero could not see a bug)."""
    for name in ("router", "experts"):
        for i in range(want[name].shape[0]):
            scale = float(np.max(np.abs(want[name][i])))
            assert scale > 0, f"{what}: {name} of layer {i} is all zero"
            np.testing.assert_allclose(got[name][i], want[name][i], rtol=1e-4, atol=1e-4 * scale,
                                       err_msg=f"{what}: {name} of layer {i}")


def train(train_step, params, x, ids) -> tuple[list[tuple[float, dict]], dict]:
    """SGD_STEPS steps: ([(loss, grads) of each step], the params after the last)."""
    history = []
    for _ in range(SGD_STEPS):
        loss, grads, params = train_step(params, x, ids)
        history.append((float(loss), jax.tree.map(np.asarray, grads)))
    return history, jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("composition", [LOOP, SCAN])
def test_58_layers_on_one_moecomm_train_like_plain_ad(composition, rng, seed):
    """SGD on a 58-layer model whose every layer runs on one MoEComm, each whole layer rematerialized: the custom
    VJP's losses, gradients and parameters equal plain AD's at every step, and the loss goes down."""
    params, x, ids = model_inputs(rng)
    history, final = train(cached_train_step(composition, True), params, x, ids)
    want_history, want_final = train(cached_train_step(composition, False), params, x, ids)
    for i, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(history, want_history, strict=True)):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"{composition}: loss at step {i} (seed={seed})")
        assert_close_per_layer(grads, want_grads, f"{composition}: d loss / d params at step {i} (seed={seed})")
    assert_close_per_layer(final, want_final, f"{composition}: params after {SGD_STEPS} steps (seed={seed})")
    losses = [loss for loss, _ in want_history]
    assert losses[-1] < losses[0], f"{composition}: SGD did not lower the loss {losses} (seed={seed})"


@pytest.mark.parametrize("composition", [LOOP, SCAN])
def test_symmetric_memory_does_not_grow_with_the_number_of_layers(composition, rng):
    """Tracing the whole train step (forward, backward, recomputation) of a 1-layer and a 58-layer model: each ran
    every round trip on the one MoEComm it was given, so the model's symmetric memory is that MoEComm's at any depth
    (one MoEComm per layer would take 58 times as much)."""
    model_bytes = {}
    for layers in (1, LAYERS):
        comm = make_comm(True)
        train_step, comms = moe_model(comm, layers, composition)
        jax.eval_shape(train_step, *model_inputs(rng, layers))
        assert comms == {comm}, f"{layers} layers ran on {len(comms)} MoEComms"
        model_bytes[layers] = sum(c.symmetric_bytes for c in comms)
    assert model_bytes[1] == model_bytes[LAYERS] == comm.symmetric_bytes > 0, model_bytes


def test_a_default_moecomm_differentiates_under_whole_layer_checkpoint(rng, seed):
    """A MoEComm with its default options (check_errors=True) under whole-layer jax.checkpoint: the custom VJP's
    gradients equal plain AD's."""
    params, x, ids = model_inputs(rng, layers=2)
    _, grads, _ = moe_model(make_comm(True), 2, LOOP)[0](params, x, ids)
    _, want, _ = moe_model(make_comm(False), 2, LOOP)[0](params, x, ids)
    for name in ("router", "experts"):
        scale = float(np.max(np.abs(want[name])))
        assert scale > 0
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=f"d loss / d {name} (seed={seed})")


def test_kernel_calls_under_checkpoint_run_once():
    """The NVSHMEM backend's custom calls (kernel_call: an effect jax.checkpoint accepts) inside a custom VJP under
    whole-layer jax.checkpoint: lowered for CUDA, 3 layers give 3 forward and 3 backward calls, each kept by XLA (a
    side effect); the forward calls are not recomputed in the backward pass (their results are kept)."""
    from jax_moe_comm.kernel_call import kernel_call

    def call(x):  # a stand-in kernel: its result varies over the EP axis, like the backend's (_varying); one
        # operand that does not vary (as the backend's empty ones), which kernel_call makes vary like the others
        y = kernel_call("jmc_stand_in", jax.ShapeDtypeStruct(x.shape, x.dtype), x, jnp.zeros((0,), jnp.int32),
                        context=np.int64(0))
        return jax.lax.pcast(y, ("ep",), to="varying")

    @jax.custom_vjp
    def round_trip(x):
        return call(x)

    round_trip.defvjp(lambda x: (call(x), None), lambda _, ct: (call(ct),))

    def loss(x):
        for _ in range(3):
            x = jax.checkpoint(lambda x: jnp.tanh(round_trip(x)))(x)
        return jnp.sum(x ** 2)

    step = jax.shard_map(jax.grad(loss), mesh=ep_mesh(2), in_specs=P("ep"), out_specs=P("ep"))
    hlo = jax.jit(step).trace(jnp.ones((4, 8), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in hlo.splitlines() if "jmc_stand_in" in line]
    assert len(calls) == 6, "\n".join(calls)
    assert all("has_side_effect = true" in line for line in calls), "\n".join(calls)


def test_every_kernel_call_sits_between_optimization_barriers():
    """A lax.scan over jax.checkpoint-ed layers, differentiated, lowered for CUDA: every kernel call, forward and
    backward, takes its operands from an optimization barrier and gives its results to one, whoever uses them (under
    jax.checkpoint the forward scan stacks the call's own results as residuals). XLA:GPU's dynamic-slice fusion
    cloned calls whose operands are slices of a loop's buffers, or whose results go into one, and kept the originals:
    each phase then ran twice ("it ran while this MoEComm expected combine_send")."""
    from jax_moe_comm.kernel_call import kernel_call

    def call(x):
        y = kernel_call("jmc_stand_in", jax.ShapeDtypeStruct(x.shape, x.dtype), x, context=np.int64(0))
        return jax.lax.pcast(y, ("ep",), to="varying")

    @jax.custom_vjp
    def round_trip(x):
        return call(x)

    round_trip.defvjp(lambda x: (call(x), None), lambda _, ct: (call(ct),))
    layer = jax.checkpoint(lambda x, w: (jnp.tanh(round_trip(x) @ w), None))
    loss = lambda x, w: jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)  # noqa: E731
    step = jax.shard_map(jax.grad(loss, argnums=1), mesh=ep_mesh(2), in_specs=(P("ep"), P()), out_specs=P())
    hlo = jax.jit(step).trace(jnp.ones((4, 8), jnp.float32), jnp.ones((3, 8, 8), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    lines = hlo.splitlines()
    calls = [i for i, line in enumerate(lines) if "jmc_stand_in" in line]
    assert len(calls) == 2, "\n".join(lines[i] for i in calls)  # one in the forward scan's body, one in the backward's
    for i in calls:
        operand = re.search(r"custom_call @jmc_stand_in\((%[\w#]+)\)", lines[i]).group(1).split("#")[0]
        result = lines[i].split("=")[0].strip().split(":")[0]
        assert re.search(rf"{re.escape(operand)}(:\d+)? = stablehlo.optimization_barrier", hlo), lines[i]
        assert re.search(rf"= stablehlo.optimization_barrier {re.escape(result)}\b", hlo), lines[i]

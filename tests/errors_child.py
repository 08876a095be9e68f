"""Child process for tests/test_check_errors.py: a bad expert id in a multi-layer step, on CPU devices.

    python tests/errors_child.py VIEW OUTCOME [LAYERS] [CHECK]

VIEW: "shard_map" (per-shard calls inside the user's shard_map, under jax.jit), "global" (jax_moe_comm.dispatch and
combine under jax.jit) or "eager" (jax_moe_comm.dispatch and combine, no jit). OUTCOME: "caught" (the step in a
``try``; prints what was caught and exits), "later" (a valid step first, then the failing one in a ``try``: the
failing call of an already compiled step) or "uncaught" (the error ends the process). The device count comes from
the parent's XLA_FLAGS, or under jax_moe_comm.launch one CPU device per process. Layer 1 of LAYERS (default 3; layer
0 when there is one) gets the id ``num_experts`` on the last rank's token 1. CHECK: "handler" (default: the CUDA
extension's check where it is installed, else the status module's), "status_module" (the status module's, as in an
install without the CUDA extension) or "callback" (the host callback of an install without either).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc
from jax_moe_comm.launch import initialize_distributed

E, K, H, T = 16, 2, 8, 4


def main(view: str, outcome: str, layers: int) -> None:
    world = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    cfg = jmc.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comms = [jmc.MoEComm(cfg, mesh, backend="reference") for _ in range(layers)]

    def per_shard(x, ids):
        w = jnp.ones(ids.shape[1:], jnp.float32)
        for layer, comm in enumerate(comms):
            d = comm.dispatch(x, ids[layer])
            x = x + comm.combine(d.expert_x * 0.5, d.handle, w)
        return x

    def global_view(x, ids):
        w = jnp.ones(ids.shape[1:], jnp.float32)
        for layer, comm in enumerate(comms):
            d = jmc.dispatch(comm, x, ids[layer])
            x = x + jmc.combine(comm, d.expert_x * 0.5, d.handle, w)
        return x

    if view == "shard_map":
        step = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("ep"), P(None, "ep")), out_specs=P("ep")))
    else:
        step = jax.jit(global_view) if view == "global" else global_view
    good = np.tile(np.array([[0, 9]], np.int32), (layers, world * T, 1))
    bad = good.copy()
    bad[min(1, layers - 1), (world - 1) * T + 1, 0] = E
    x = np.ones((world * T, H), np.float32)
    if jax.process_count() > 1:  # global arrays from every process's copy of the host data
        def placed(a, spec):
            return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])
        x, good, bad = placed(x, P("ep")), placed(good, P(None, "ep")), placed(bad, P(None, "ep"))

    if outcome == "later":
        jax.block_until_ready(step(x, good))
    if outcome == "uncaught":
        jax.block_until_ready(step(x, bad))
        print("NO ERROR")
        return
    try:
        jax.block_until_ready(step(x, bad))
    except Exception as exc:  # noqa: BLE001 (what was raised is the result)
        print(f"CAUGHT {type(exc).__module__}.{type(exc).__qualname__} "
              f"is_jax_runtime_error={isinstance(exc, jax.errors.JaxRuntimeError)}")
        lines = str(exc).splitlines()
        print("FIRST LINE:", lines[0])
        if len(lines) > 1:
            print("LAST LINE:", lines[-1])
    else:
        print("NO ERROR")
    # The failed step stays the last one: a later step would replace the failed runtime tokens JAX waits for at exit.


if __name__ == "__main__":
    if "JAX_COORDINATOR_ADDRESS" in os.environ:  # under jax_moe_comm.launch
        initialize_distributed()
    if sys.argv[4:] == ["callback"]:  # as an install without the compiled modules checks
        jmc.errors._raise_target_registered = lambda: ()
    elif sys.argv[4:] == ["status_module"]:  # as an install without the CUDA extension checks
        jmc._native.ext = None
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    print("EXITING NORMALLY")

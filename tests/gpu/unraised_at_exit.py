"""A failed last step whose outputs are read, then a normal exit with the MoEComm still open (NVSHMEM backend, any
number of processes): the failure, which no check raised, is printed once at exit.

    python -m jax_moe_comm.launch -n 1 -- tests/gpu/unraised_at_exit.py

Prints "OUTPUTS NaN" after reading the step's outputs; the caller counts the message in stderr.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc
from jax_moe_comm.launch import initialize_distributed

initialize_distributed()
jmc.initialize(symmetric_size="1G")
mesh = Mesh(np.array(jax.devices()), ("ep",))
world, T = mesh.size, 16
comm = jmc.MoEComm(jmc.MoECommConfig(8, 2, 64, T, dtype=jnp.float32, out_dtype=jnp.float32), mesh, "ep", "nvshmem")


def placed(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("ep")), lambda index: a[index])


ids = np.tile(np.array([[0, 5]], np.int32), (world * T, 1))
ids[3::T, 1] = 99  # every rank's token 3


@jax.jit
def step(x, ids, w):
    d = jmc.dispatch(comm, x, ids)
    return jmc.combine(comm, d.expert_x, d.handle, w)


y = step(placed(np.ones((world * T, 64), np.float32)), placed(ids), placed(np.ones((world * T, 2), np.float32)))
assert np.isnan(np.asarray(y.addressable_shards[0].data)).all()
print("OUTPUTS NaN", flush=True)

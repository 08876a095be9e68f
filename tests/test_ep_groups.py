"""The NVSHMEM backend's EP groups: which devices exchange with which, and in what rank order.

``nvshmem_backend.ep_group`` decides, from the mesh alone, the PEs one MoEComm's kernels address. It must number a
group's ranks exactly as ``jax.lax.axis_index`` numbers them over the EP axes (the reference backend's and the
layout's rank), and keep every other axis's coordinate fixed.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_moe_comm.nvshmem_backend import ep_group

MESHES = [
    # (mesh shape, mesh axes, EP axes)
    ((8,), ("ep",), ("ep",)),
    ((2, 4), ("data", "ep"), ("ep",)),
    ((4, 2), ("data", "ep"), ("ep",)),
    ((4, 2), ("ep", "data"), ("ep",)),
    ((2, 2, 2), ("data", "context", "expert"), ("context", "expert")),
    ((2, 2, 2), ("data", "context", "expert"), ("expert", "context")),
    ((2, 2, 2), ("context", "data", "expert"), ("context", "expert")),
]


def _axis_index_of_every_device(mesh: Mesh, ep_axes: tuple[str, ...]) -> dict:
    """{device: jax.lax.axis_index(ep_axes) on that device}, computed by JAX inside a shard_map."""
    spec = P(tuple(mesh.axis_names))
    ranks = jax.shard_map(lambda: jax.lax.axis_index(ep_axes).reshape(1), mesh=mesh, in_specs=(),
                          out_specs=spec)()
    return {shard.device: int(np.asarray(shard.data)[0]) for shard in ranks.addressable_shards}


@pytest.mark.parametrize("shape, names, ep_axes", MESHES)
def test_group_ranks_are_jax_axis_index(shape, names, ep_axes):
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
    axis_index = _axis_index_of_every_device(mesh, ep_axes)
    world = int(np.prod([mesh.shape[a] for a in ep_axes]))
    for device in mesh.devices.flat:
        rank, group = ep_group(mesh, ep_axes, device)
        assert len(group) == world and group[rank] == device
        assert rank == axis_index[device]
        assert [axis_index[d] for d in group] == list(range(world))  # every member numbered as JAX numbers it
        where = {d: np.argwhere(mesh.devices == d)[0] for d in group}
        others = [i for i, name in enumerate(names) if name not in ep_axes]
        assert len({tuple(where[d][others]) for d in group}) == 1  # one coordinate on every other axis


def test_groups_partition_the_mesh():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "ep"))
    groups = {tuple(d.id for d in ep_group(mesh, ("ep",), device)[1]) for device in mesh.devices.flat}
    assert groups == {tuple(d.id for d in row) for row in mesh.devices}


def test_a_device_outside_the_mesh_is_refused():
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    with pytest.raises(ValueError, match="not in the mesh"):
        ep_group(mesh, ("ep",), jax.devices()[5])

"""Global arrays onto every process's host without an XLA collective.

Checking code of a multi-process job must not issue XLA collectives where several processes share one GPU (NCCL
refuses two ranks on one device). Each process puts its addressable shards into the jax.distributed key-value store
and reads every other process's; every process must gather the same trees in the same order.
"""

from __future__ import annotations

import itertools
import pickle

import jax
import numpy as np

_calls = itertools.count()  # the same sequence on every process
TIMEOUT_MS = 300_000


def host_gather(tree):
    """`tree` with every array leaf as a NumPy array of its global value (None leaves stay None)."""
    leaves, treedef = jax.tree.flatten(tree)
    if jax.process_count() == 1:
        return treedef.unflatten([np.asarray(a) for a in leaves])
    from jax._src import distributed

    client = distributed.global_state.client
    call, me = next(_calls), jax.process_index()
    out = []
    for i, a in enumerate(leaves):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            out.append(np.asarray(a))
            continue
        key = f"jax_moe_comm_tests/gather/{call}/{i}"
        pieces = [(shard.index, np.asarray(shard.data)) for shard in a.addressable_shards if shard.replica_id == 0]
        client.key_value_set_bytes(f"{key}/{me}", pickle.dumps(pieces))
        full = np.zeros(a.shape, a.dtype)
        for process in range(jax.process_count()):
            for index, data in pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{process}", TIMEOUT_MS)):
                full[index] = data
        client.wait_at_barrier(f"{key}/read", TIMEOUT_MS)  # every process has read every piece: free them
        client.key_value_delete(f"{key}/{me}")
        out.append(full)
    return treedef.unflatten(out)


def from_process_0(key: str, make):
    """make() of process 0, on every process (JSON-serializable; through the key-value store): the same seed or draws
    everywhere."""
    import json

    if jax.process_count() == 1:
        return make()
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_index() == 0:
        client.key_value_set(f"jax_moe_comm_tests/{key}", json.dumps(make()))
    return json.loads(client.blocking_key_value_get(f"jax_moe_comm_tests/{key}", TIMEOUT_MS))

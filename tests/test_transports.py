"""Simulated nodes: a test hook that makes one machine run a multi-node job's transports (stores to the peers of a
node, NVSHMEM puts to the others). The kernels' side runs on a GPU (the kernel harness and the GPU cases with
--ranks-per-node); here, the hook's contract."""

from __future__ import annotations

import pytest

from jax_moe_comm import nvshmem_backend


def test_simulated_nodes_hold_inside_and_restore_after():
    assert nvshmem_backend._ranks_per_node is None
    with nvshmem_backend.simulated_nodes(2):
        assert nvshmem_backend._ranks_per_node == 2
        with nvshmem_backend.simulated_nodes(4):
            assert nvshmem_backend._ranks_per_node == 4
        assert nvshmem_backend._ranks_per_node == 2
    assert nvshmem_backend._ranks_per_node is None


def test_simulated_nodes_restore_after_an_error():
    with pytest.raises(RuntimeError, match="inside"), nvshmem_backend.simulated_nodes(2):
        raise RuntimeError("inside")
    assert nvshmem_backend._ranks_per_node is None


@pytest.mark.parametrize("ranks_per_node", [0, -1])
def test_simulated_nodes_need_a_rank_per_node(ranks_per_node):
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        with nvshmem_backend.simulated_nodes(ranks_per_node):
            pass


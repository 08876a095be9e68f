"""Smallest NVSHMEM check: initialize on every rank and print how (run through jax_moe_comm.launch)."""

import jax

import jax_moe_comm as jmc
from jax_moe_comm.launch import initialize_distributed

initialize_distributed()
rt = jmc.initialize()
print(f"rank {rt.rank}/{rt.world} on {rt.device}: NVSHMEM up via {rt.bootstrap}; build {jmc.build_info()}", flush=True)
jax.effects_barrier()

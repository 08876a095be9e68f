"""Smallest NVSHMEM check: initialize on every rank and print how (run through jax_moe_comm.launch)."""

import sys

import jax

import jax_moe_comm as jmc
from jax_moe_comm.launch import initialize_distributed

initialize_distributed()
rt = jmc.initialize(bootstrap=sys.argv[1] if len(sys.argv) > 1 else "auto")  # auto, nvshmem4py or extension
print(f"rank {rt.rank}/{rt.world} on {rt.device}: NVSHMEM up via {rt.bootstrap}; build {jmc.build_info()}", flush=True)
jax.effects_barrier()

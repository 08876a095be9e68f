"""Runnable examples built on jax_moe_comm.

    python -m jax_moe_comm.examples.train                                      # CPU: 8 virtual devices
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.train       # GPUs: one process per GPU
    python -m jax_moe_comm.examples.decode                                     # greedy decoding, one jitted step
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.decode      # for every batch size
"""

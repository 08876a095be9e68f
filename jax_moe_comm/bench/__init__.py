"""Dispatch + combine latency: this library's backends against XLA-collective baselines, side by side.

    python -m jax_moe_comm.bench --quick                                  # CPU, 8 simulated devices, seconds
    python -m jax_moe_comm.bench --backends reference,padded --configs v2lite --tokens 1,128
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.bench --json benchmarks/results/h200x2.json

Backends: ``nvshmem`` (MoEComm, CUDA kernels; one GPU per process, so through the launcher), ``reference``
(MoEComm, pure-JAX collectives), ``ragged`` (``baselines.ragged_*``: MaxText-style ``ragged_all_to_all``; not
implemented by XLA:CPU), ``padded`` (``baselines.padded_*``: ``all_to_all`` at worst-case capacity) and ``floor``
(the protocol's floor on NVLink, ffi/probe.cu: per direction one kernel that moves the T rows to the peer, fences,
signals and waits, with no routing and no layout; its result is not checked), ``floor_flagged`` (the same in words
that carry their own validity: no fence, no signal, twice the bytes; what a low-latency protocol would pay). Every
backend runs per shard inside ``jax.shard_map`` over the mesh axis "ep" of all devices, with the same inputs.

Configs (per rank: ``tokens`` rows of x; expert stand-in: dequantize, multiply by 2, cast to the combine dtype):

    r1      H 7168, E 256, K 8, dispatch float8_e4m3fn + float32 scales (block 128), combine bfloat16
    v2lite  H 2048, E 64,  K 6, bfloat16 both ways

Timing: one ``jit`` holds an unrolled chain of N round trips (a Python loop, N copies; round trip
i+1 dispatches ``x + 1e-3 * y_i``, so XLA can neither reorder nor overlap them). ``total_us`` = (time of the
N-chain - time of the 1-chain) / (N - 1), median over repeats (each program is timed with block_until_ready and
time.perf_counter; best of 3 calls when a call takes < 50 ms); each repeat draws a fresh uniform routing (distinct
top-k per token) on the host and uploads it before the clock starts. Programs are compiled and run once before
timing. ``dispatch_us`` / ``combine_us`` time a chain of dispatches (next x depends on the received rows) and a
chain of combines (next expert_y depends on y) the same way; null for nvshmem, whose protocol only allows
alternating halves. Each step includes the cheap elementwise dependency update (T x H elements). The expert
stand-in runs once per chain, in the first round trip (the one checked); later round trips combine its output with
one row replaced from their own dispatch's rows (data ties only: XLA may drop an optimization barrier and then merge
identical collectives; the bench refuses a chain that lost steps), so ``total_us`` is the round trip without expert
work.

Bandwidth: ``gbps = bytes / total_us``, with ``bytes`` the traffic of one round trip per rank, averaged over ranks
and repeats and counted from the routing (not from padding):

    rows  = number of (token, slot) pairs whose expert lives on another rank than the token
    bytes = rows * (H * payload_itemsize + 4 * H / scale_block)    # dispatch (scales: fp8 only)
          + rows * H * combine_itemsize                            # combine
    bytes /= world

A backend that cannot run a size (not implemented on the platform, out of memory, wrong result, ...) gets an
``error`` string in its row instead of stopping the run. The first repeat's round trip of each backend is checked
against the reference backend (or, without it, a NumPy brute force): relative error < 2e-2.
"""

from __future__ import annotations

from .chains import (
    combine_chain,
    communication_ops,
    dispatch_chain,
    lower_chain,
    merged_steps,
    per_step_us,
    round_trip_chain,
)
from .cli import main, parse_args
from .configs import AXIS, CONFIGS, QUICK_CONFIGS, BenchConfig, expert_stand_in, make_routing, make_tokens, seeded
from .impls import ALL_BACKENDS, PROBES, UNCHECKED, make_impl
from .measure import available_backends, start_nvshmem, timing_note, to_global
from .record import plot_record

__all__ = [
    "ALL_BACKENDS", "AXIS", "CONFIGS", "PROBES", "QUICK_CONFIGS", "UNCHECKED", "BenchConfig", "available_backends",
    "combine_chain", "communication_ops", "dispatch_chain", "expert_stand_in", "lower_chain", "main", "make_impl",
    "make_routing", "make_tokens", "merged_steps", "parse_args", "per_step_us", "plot_record", "round_trip_chain",
    "seeded", "start_nvshmem", "timing_note", "to_global",
]

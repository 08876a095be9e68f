"""Round trips through the four kernels (and the two fused kernels) with no XLA on the GPU, checked against the
reference backend on the CPU.

    python -m jax_moe_comm.launch -n 2 -- tests/gpu/kernel_harness.py [--only "name|name"] [--seed N]

The program compute-sanitizer checks: under memcheck a process running XLA:GPU programs crashed the sanitizer
(tests/gpu/LAST_RUN.md), so here JAX stays on the CPU. JAX computes the expected layout and values (the reference
backend over `world` local CPU devices), and jax.distributed carries the NVSHMEM unique id. Device memory comes from
cuda-python's runtime bindings, and the extension's `launch_phase` runs the same launch helpers as the FFI handlers.
--staged forces the staged put path (MoEComm's staged=True), as in the GPU cases. On the NVLink path every case also
runs through the fused kernels (`launch_phase` "dispatch" and "combine"), whose results must equal the four kernels' bit
for bit; `--marks` (the measurement build) times the fused kernels, or with --split the four.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import os
import re
import sys
import time

# Before jax is imported: nothing of XLA may use the GPU; the reference runs over one CPU device per rank.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           + os.environ.get("JAX_NUM_PROCESSES", "2"))
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "2G")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: differential, oracle

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from cuda.bindings import runtime as cudart  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from kernel_marks import MARKS, PHASES, format_marks, format_rates, row_bytes_by_phase  # noqa: E402
from nvshmem_cases import TOLERANCE, replicate_groups, routing, window_bound  # noqa: E402

import jax_moe_comm as jmc  # noqa: E402
from jax_moe_comm import _native, errors, nvshmem_backend, runtime  # noqa: E402
from jax_moe_comm.config import Options  # noqa: E402
from jax_moe_comm.launch import from_process_0, initialize_distributed  # noqa: E402
from jax_moe_comm.nvshmem_backend import create_context as create_backend_context  # noqa: E402
from jax_moe_comm.nvshmem_backend import kernel_sizes, row_type  # noqa: E402

C = jmc.MoECommConfig
IDS_FIRST = {"ids_first_min_tokens": 1, "low_latency_max_tokens": 0}  # MoEComm options
OTHER_PATH = {"low_latency_max_tokens": 0}  # not the low-latency path (flagged words), which RUN takes at few tokens
QUANTIZE = {"quantize": True}  # the case's x is bf16, quantized by the dispatch (not a MoEComm option)
NONFINITE = {"nonfinite": True}  # the case's x holds NaN and infinities (not a MoEComm option)
PARTIAL = {"partial": True}  # each rank's num_tokens drawn in [0, max_tokens] (not a MoEComm option)


def WINDOW(slots):  # noqa: N802 (options, like IDS_FIRST)
    """The max_symmetric_bytes that leaves the case's config a window of `slots` slots per source (create_context;
    an even split of its slots, as MoEComm makes windows, or it gets the even split below it)."""
    return {"window_slots": slots}


def FP8(num_experts, k, hidden, max_tokens, block):  # noqa: N802 (a config maker, like C)
    return C(num_experts, k, hidden, max_tokens, dtype=jnp.float8_e4m3fn, scale_block=block)
CASES = {
    "fp32 K2": (C(8, 2, 128, 16, dtype=jnp.float32, out_dtype=jnp.float32), "uniform"),
    "bf16 K8 E32": (C(32, 8, 256, 32, dtype=jnp.bfloat16), "uniform"),
    "fp8+scales K8": (C(32, 8, 512, 16, dtype=jnp.float8_e4m3fn, scale_block=128), "uniform"),
    "-1 slots": (C(8, 4, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32), "dropped"),
    "skewed: all to expert 0": (C(8, 3, 64, 32, dtype=jnp.bfloat16), "skewed"),
    "bf16 H 7168: rows past one pass of loads": (C(16, 4, 7168, 16, dtype=jnp.bfloat16), "uniform"),
    "bf16 H 100: rows not 16-byte aligned": (C(8, 2, 100, 16, dtype=jnp.bfloat16), "uniform"),
    # 80,000 arrivals: more than 256 per block of dispatch_recv (its grid is at most two blocks per SM, 264 here,
    # in the fused kernel at most co-residency), so each block places its share over several batches of 256.
    "many tokens: several batches per block": (C(16, 2, 128, 40000, dtype=jnp.float32, out_dtype=jnp.float32),
                                               "uniform"),
    # The fused dispatch's ids-first order (ffi/dispatch.cu; by itself from 1024 tokens per rank, as in the case
    # above), forced at a few tokens (MoEComm's ids_first_min_tokens).
    "ids first: fp8+scales K8": (C(32, 8, 512, 16, dtype=jnp.float8_e4m3fn, scale_block=128), "uniform", IDS_FIRST),
    "ids first: skewed": (C(8, 3, 64, 32, dtype=jnp.bfloat16), "skewed", IDS_FIRST),
    "ids first: -1 slots": (C(8, 4, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32), "dropped", IDS_FIRST),
    # overflow="drop": every token to expert 0, a capacity of 20 rows (with align 4): the rows past it are dropped
    # as the reference drops them, their slots add nothing, and nothing fails.
    "drop: skewed past capacity": (C(8, 3, 64, 32, dtype=jnp.bfloat16, capacity=20, align=4, overflow="drop"),
                                   "skewed"),
    "drop: skewed past capacity, staged puts": (C(8, 3, 64, 32, dtype=jnp.bfloat16, capacity=20, align=4,
                                                  overflow="drop"), "skewed", {"staged": True}),
    "drop: ids first, capacity factor 1": (C(8, 3, 64, 32, dtype=jnp.bfloat16, capacity_factor=1.0, overflow="drop"),
                                           "skewed", IDS_FIRST),
    # Regressions: capacities that cut inside an expert's padded run. The receive zeroed the padding up to the run's
    # end, past capacity: into the memory after expert_x (XLA's next buffers; the guards here).
    "drop: a cut inside a padded run": (C(16, 4, 128, 32, dtype=jnp.bfloat16, align=8, capacity=60, overflow="drop"),
                                        "uniform"),
    "drop: one row, align 16": (C(8, 1, 2880, 2, dtype=jnp.float16, out_dtype=jnp.float32, align=16, capacity=6,
                                  overflow="drop"), "uniform", PARTIAL),  # E 8: a multiple of 2, 4 and 8 PEs
    "drop: one hot expert, quantize B32": (C(8, 2, 2880, 200, dtype=jnp.float8_e4m3fn, scale_block=32, align=4,
                                             capacity=26, overflow="drop"), "one_hot", {**QUANTIZE, **PARTIAL}),
    # dispatch(..., quantize=float8_e4m3fn): bf16 rows quantized as they are sent, against the reference quantizer:
    # in registers (B 128, R1's shape), in registers with a block of one 16-element word per lane (B 16), the
    # generic path (B 96: not a power of two of words), staged puts (quantized into staging), and ids-first
    # options (quantizing dispatches send first).
    "quantize: B128 K8": (FP8(32, 8, 512, 16, 128), "uniform", QUANTIZE),
    "quantize: B128 H7168": (FP8(16, 4, 7168, 16, 128), "uniform", QUANTIZE),
    "quantize: B16": (FP8(16, 4, 256, 16, 16), "dropped", QUANTIZE),
    "quantize: B96, generic": (FP8(8, 2, 384, 16, 96), "skewed", QUANTIZE),
    "quantize: staged puts": (FP8(32, 8, 512, 16, 128), "uniform", {**QUANTIZE, "staged": True}),
    "quantize: ids first": (FP8(32, 8, 512, 16, 128), "uniform", {**QUANTIZE, **IDS_FIRST}),
    # NaN and infinities stay non-finite as in the reference quantizer (a NaN's block: scale 1, the NaN kept; an
    # infinity's: scale inf, NaN in its place), by the word-by-word path and the generic one.
    "quantize: NaN and inf": (FP8(32, 8, 512, 16, 128), "uniform", {**QUANTIZE, **NONFINITE}),
    "quantize: NaN and inf, generic": (FP8(8, 2, 384, 16, 96), "uniform", {**QUANTIZE, **NONFINITE}),
    # max_symmetric_bytes below the config's heap: the fused kernels move the rows in rounds through buffers of one
    # round (ffi/dispatch.cu, ffi/combine.cu), the same layout and sums; every round has rows from every rank.
    "windowed: bf16 K8 E32, 3 rounds": (C(32, 8, 256, 32, dtype=jnp.bfloat16), "uniform", WINDOW(11)),
    "windowed: fp8+scales K8, a slot a round": (FP8(32, 8, 512, 16, 128), "uniform", WINDOW(1)),
    "windowed: skewed, -1 slots": (C(8, 4, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32), "dropped", WINDOW(6)),
    "windowed: drop, skewed past capacity": (C(8, 3, 64, 32, dtype=jnp.bfloat16, capacity=20, align=4,
                                                overflow="drop"), "skewed", WINDOW(7)),
    "windowed: quantize B128": (FP8(32, 8, 512, 16, 128), "uniform", {**QUANTIZE, **WINDOW(4)}),
    "windowed: quantize B96, generic": (FP8(8, 2, 384, 16, 96), "skewed", {**QUANTIZE, **WINDOW(3)}),
    "windowed: bf16 H 7168": (C(16, 4, 7168, 16, dtype=jnp.bfloat16), "uniform", WINDOW(6)),
    "windowed: many tokens, rounds of 2500": (C(16, 2, 128, 10000, dtype=jnp.float32, out_dtype=jnp.float32),
                                              "uniform", WINDOW(2500)),
    "windowed: skewed, num_tokens partial": (C(8, 3, 64, 32, dtype=jnp.bfloat16), "skewed", {**PARTIAL, **WINDOW(5)}),
    # DP groups of two replicas (identical tokens; each sends its share: tokens t with t % 2 == its place).
    "dp_size 2, num_tokens partial": (C(8, 2, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32, dp_size=2),
                                      "uniform", PARTIAL),
    "windowed: dp_size 2, num_tokens partial": (C(8, 2, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32, dp_size=2),
                                                "uniform", {**PARTIAL, **WINDOW(3)}),
    # An SM budget (MoEComm(max_sms=...)): every kernel's grid cut to that many blocks, down to one.
    "SM budget 1: fp8+scales K8": (FP8(32, 8, 512, 16, 128), "uniform", {"max_sms": 1}),
    "SM budget 3: many tokens": (C(16, 2, 128, 40000, dtype=jnp.float32, out_dtype=jnp.float32), "uniform",
                                 {"max_sms": 3}),
    "SM budget 2: ids first, skewed": (C(8, 3, 64, 32, dtype=jnp.bfloat16), "skewed", {**IDS_FIRST, "max_sms": 2}),
    "SM budget 2: staged puts, quantize": (FP8(32, 8, 512, 16, 128), "uniform", {**QUANTIZE, "staged": True,
                                                                                "max_sms": 2}),
    "SM budget 1: windowed, 3 rounds": (C(32, 8, 256, 32, dtype=jnp.bfloat16), "uniform", {**WINDOW(11), "max_sms": 1}),
    "SM budget 4: dp_size 2, num_tokens partial": (C(8, 2, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32,
                                                     dp_size=2), "uniform", {**PARTIAL, "max_sms": 4}),
}
TOO_SLOW_UNDER_SANITIZER = {"many tokens: several batches per block"}
WEIGHTS_AT = {"send": "at combine_send", "recv": "at combine_recv", "dispatch": "given to dispatch_send"}




def checked(result):
    err, *rest = result
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class DeviceArrays:
    """Device copies of host arrays (and zeroed outputs), freed together. Each allocation is followed by a guard of
    GUARD_BYTES holding GUARD_BYTE: ``check_guards`` finds a kernel that wrote past the end of a buffer (as XLA's
    neighbouring buffers would have taken it)."""

    GUARD_BYTES, GUARD_BYTE = 256 << 10, 0xA5

    def __init__(self):
        self.ptrs = []
        self.guards = []  # (guard address, the buffer's name)

    def alloc(self, nbytes: int, name: str = "buffer") -> int:
        size = max(nbytes, 16)
        ptr = int(checked(cudart.cudaMalloc(size + self.GUARD_BYTES)))
        checked(cudart.cudaMemset(ptr, 0, size))
        checked(cudart.cudaMemset(ptr + nbytes, self.GUARD_BYTE, size - nbytes + self.GUARD_BYTES))
        self.ptrs.append(ptr)
        self.guards.append((ptr + nbytes, name))
        return ptr

    def check_guards(self) -> None:
        """AssertionError naming the buffers whose guard a kernel overwrote."""
        hit = [name for at, name in self.guards
               if not (self.get(at, (self.GUARD_BYTES,), np.uint8) == self.GUARD_BYTE).all()]
        assert not hit, f"a kernel wrote past the end of {', '.join(hit)}"

    def put(self, host: np.ndarray) -> int:
        ptr = self.alloc(np.asarray(host).nbytes)
        self.set(ptr, host)
        return ptr

    @staticmethod
    def set(ptr: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        if host.nbytes:
            checked(cudart.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))

    @staticmethod
    def get(ptr: int, shape, dtype) -> np.ndarray:
        out = np.zeros(shape, dtype)
        if out.nbytes:
            checked(cudart.cudaMemcpy(out.ctypes.data, ptr, out.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return out

    def free(self):
        for ptr in self.ptrs:
            checked(cudart.cudaFree(ptr))
        self.ptrs, self.guards = [], []


# This run's MoEComm options (--timeout-s, --staged), and the low-latency path wherever a case's config takes it
# (few tokens; OTHER_PATH turns it off).
RUN = {"timeout_s": 30.0, "staged": False, "low_latency_max_tokens": 32}


def create_context(cfg, world, rank, pes=None, **options):
    """Collective: a context of `cfg` for this rank, as MoEComm makes one with these options (and this run's), for
    the EP group of PEs `pes` (by rank; default every PE). Returns (context id, its Sizes)."""
    if "window_slots" in options:  # WINDOW
        options = dict(options)
        options["max_symmetric_bytes"] = window_bound(cfg, world, options.pop("window_slots"))
    opts = Options(**{**RUN, **options})
    ctx, _, window = create_backend_context(cfg, world, rank, opts, pes)
    return ctx, kernel_sizes(cfg, world, rank, _native.ext.sm_count(), opts.timeout_s, window, opts.max_sms)


@functools.cache
def _reference_round_trip(cfg, world, quantize):
    """The jitted reference round trip of one config (compiled once for every case and draw that uses it)."""
    mesh = Mesh(np.array(jax.local_devices()[:world]), ("ep",))
    comm = jmc.MoEComm(cfg, mesh, "ep", backend="reference", check_errors=False)  # a failed one gives NaN

    @jax.jit
    def round_trip(x, ids, scales, n, w):
        d = jmc.dispatch(comm, x, ids, scales, n, quantize=cfg.dtype if quantize else None)
        y = (d.expert_x.astype(jnp.float32) * 1.5).astype(cfg.out_dtype)  # the stand-in expert of the GPU cases
        y = jmc.combine(comm, y, d.handle, w)
        return d.expert_x, d.expert_scales, d.group_sizes, d.handle.row_origin, y, d.expert_counts

    return mesh, round_trip


def reference_round_trip(cfg, world, x, ids, w, scales, counts, quantize=False):
    """The reference backend over `world` local CPU devices: (expert_x, scales, group_sizes, row_origin, y,
    expert_counts [world * E]: each rank's the same), global.
    `quantize`: x is bf16 and the fp8 dispatch quantizes it (scales None)."""
    mesh, round_trip = _reference_round_trip(cfg, world, quantize)

    def put(a):
        return None if a is None else jax.device_put(a, NamedSharding(mesh, P("ep")))

    out = round_trip(put(x.astype(jnp.bfloat16 if quantize else cfg.dtype)), put(ids), put(scales), put(counts),
                     put(w))
    return jax.tree.map(np.asarray, out)


def round_trip_buffers(mem, p2p, cfg, sizes, x, ids, w, scales, n, weights_at, quantize=False):
    """This rank's inputs on the device, zeroed outputs (expert_y too), and the four phases' launch_phase arguments
    with the weights at combine_send (`weights_at` "send": pre-reduced, as the backend does), at
    combine_recv (rows per slot), or given to dispatch_send ("dispatch", NVLink path: stored with the ids on every
    rank, then pre-reduced with no exchange in combine_send). Returns (phase arguments in phase order, {output name:
    device pointer}); `fused` turns the first into the two fused kernels' arguments. `quantize`: x goes in as bf16
    and dispatch_send quantizes it (no scales)."""
    reduced = weights_at == "send" or (p2p and weights_at == "dispatch")
    T, H = cfg.max_tokens, cfg.hidden
    cap, L = sizes["capacity"], sizes["local_experts"]
    status = [mem.alloc(4 * errors.STATUS_WORDS) for _ in range(4)]
    x_d = mem.put(x.astype(jnp.bfloat16 if quantize else cfg.dtype))
    ids_d, w_d, n_d = mem.put(ids), mem.put(w), mem.put(np.int32([n]))
    scales_d = mem.put(scales if scales is not None and not quantize else np.zeros((T, 0), np.float32))
    out = dict(expert_x=mem.alloc(cap * H * np.dtype(cfg.dtype).itemsize, "expert_x"),
               expert_scales=mem.alloc(cap * cfg.scale_cols * 4, "expert_scales"),
               group_sizes=mem.alloc(L * 4, "group_sizes"), row_origin=mem.alloc(cap * 4, "row_origin"),
               expert_counts=mem.alloc(cfg.num_experts * 4, "expert_counts"),
               expert_y=mem.alloc(cap * H * np.dtype(cfg.out_dtype).itemsize, "expert_y"),
               out=mem.alloc(T * H * np.dtype(cfg.out_dtype).itemsize, "out"))
    code = row_type(cfg.out_dtype)
    sent = p2p and weights_at == "dispatch"
    args = [
        dict(x=x_d, scales=scales_d, topk_ids=ids_d, num_tokens=n_d, status=status[0], topk_weights=w_d if sent else 0,
             quantize=int(quantize)),
        dict(expert_x=out["expert_x"], expert_scales=out["expert_scales"], group_sizes=out["group_sizes"],
             row_origin=out["row_origin"], expert_counts=out["expert_counts"], status=status[1]),
        dict(expert_y=out["expert_y"], elem_bytes=np.dtype(cfg.out_dtype).itemsize, row_origin=out["row_origin"],
             status=status[2], prereduce_weights=w_d if reduced else 0, in_dtype=code, partial_dtype=code,
             weights_sent=int(sent)),
        dict(topk_ids=ids_d, topk_weights=w_d, num_tokens=n_d, out=out["out"], rows_dtype=code, out_dtype=code,
             status=status[3], reduced=int(reduced)),
    ]
    return args, dict(out, status=status)


def fused_args(args):
    """The four phases' launch_phase arguments as the fused kernels' ("dispatch", "combine"): each pair's arguments
    together, its statuses as send_status and recv_status."""
    def pair(send, recv):
        return {**send, **recv, "send_status": send["status"], "recv_status": recv["status"]}
    return [pair(args[0], args[1]), pair(args[2], args[3])]


def fused_choices(p2p: bool, windowed: bool) -> tuple[bool, ...]:
    """The ways a context runs a round trip (fused: False, the four kernels; True, the two fused ones): the fused
    kernels need NVLink, and a windowed context runs them alone (its rounds wait on the other half)."""
    return (True,) if windowed else (False, True)[:2 if p2p else 1]


def round_trip_launches(args, fused):
    """[(phase, arguments)] of dispatch, then of combine: two kernels each, or one (fused)."""
    if fused:
        dispatch, combine = fused_args(args)
        return [[("dispatch", dispatch)], [("combine", combine)]]
    return [list(zip(PHASES[:2], args[:2], strict=True)), list(zip(PHASES[2:], args[2:], strict=True))]


def kernel_round_trip(ctx, p2p, cfg, sizes, x, ids, w, scales, n, weights_at, fused=False, quantize=False):
    """This rank's round trip through the four kernels, or the two fused ones (legacy default stream): the
    reference's outputs, this rank's part (expert_x, expert_scales, group_sizes, row_origin, y), then the four
    statuses and expert_counts [E]. The stand-in expert runs on the host between dispatch and combine."""
    T, H = cfg.max_tokens, cfg.hidden
    cap, L = sizes["capacity"], sizes["local_experts"]
    mem = DeviceArrays()
    try:
        args, out = round_trip_buffers(mem, p2p, cfg, sizes, x, ids, w, scales, n, weights_at, quantize)
        ext = _native.ext
        dispatch, combine = round_trip_launches(args, fused)
        for phase, a in dispatch:
            ext.launch_phase(ctx, phase, a)
        checked(cudart.cudaDeviceSynchronize())
        mem.check_guards()
        expert_x = DeviceArrays.get(out["expert_x"], (cap, H), cfg.dtype)
        DeviceArrays.set(out["expert_y"], (expert_x.astype(np.float32) * 1.5).astype(cfg.out_dtype))
        for phase, a in combine:
            ext.launch_phase(ctx, phase, a)
        checked(cudart.cudaDeviceSynchronize())
        mem.check_guards()
        return (expert_x, DeviceArrays.get(out["expert_scales"], (cap, cfg.scale_cols), np.float32),
                DeviceArrays.get(out["group_sizes"], (L,), np.int32),
                DeviceArrays.get(out["row_origin"], (cap,), np.int32),
                DeviceArrays.get(out["out"], (T, H), cfg.out_dtype),
                [DeviceArrays.get(s, (errors.STATUS_WORDS,), np.int32) for s in out["status"]],
                DeviceArrays.get(out["expert_counts"], (cfg.num_experts,), np.int32))
    finally:
        mem.free()


def run_entry(case, rank, world, seed):
    """A CASES entry (cfg, routing kind[, MoEComm options, with QUANTIZE: bf16 x quantized by the dispatch]) through
    run_case."""
    cfg, kind, *options = case
    options = dict(options[0]) if options else {}
    quantize = bool(options.pop("quantize", False))
    nonfinite = bool(options.pop("nonfinite", False))
    partial = bool(options.pop("partial", False))
    return run_case(rank, world, seed, cfg, kind, options=options, quantize=quantize, nonfinite=nonfinite,
                    partial=partial)


def run_case(rank, world, seed, cfg, kind, repeats=2, options=None, pes=None, quantize=False, nonfinite=False,
             partial=False):
    """One case on this rank of `world` ranks (the EP group of PEs `pes`, by rank; default every PE). `quantize`:
    x is bf16 and the fp8 dispatch quantizes it, against the reference quantizer. `nonfinite`: some rows of x hold
    a NaN, +inf or -inf. `partial`: each rank's num_tokens drawn in [0, max_tokens]. With dp_size > 1 the ranks of
    a DP group get the same inputs."""
    rng = np.random.default_rng(seed)
    T, H, K = cfg.max_tokens, cfg.hidden, cfg.experts_per_token
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, kind, world * T, cfg, world)
    w = rng.random((world * T, K)).astype(np.float32)
    counts = np.full(world, T, np.int32)
    scales = (rng.random((world * T, cfg.scale_cols)) + 0.5).astype(np.float32) if cfg.is_fp8 else None
    if quantize:
        scales = None
        x[:: max(T // 3, 1), : cfg.scale_block] = 0.0  # some all-zero blocks (scale 1)
    if nonfinite:
        x[1::5, 3], x[2::5, cfg.hidden - 1], x[3::7, 0] = np.nan, np.inf, -np.inf
    if partial:
        counts = rng.integers(0, T + 1, world).astype(np.int32)
    if cfg.dp_size > 1:
        x, ids, w = (replicate_groups(a, world, cfg.dp_size, T) for a in (x, ids, w))
        scales = None if scales is None else replicate_groups(scales, world, cfg.dp_size, T)
        counts = replicate_groups(counts.reshape(world, 1), world, cfg.dp_size, 1).reshape(world)
    ref = reference_round_trip(cfg, world, x, ids, w, scales, counts, quantize)
    ctx, sizes = create_context(cfg, world, rank, pes, **(options or {}))
    try:
        p2p = bool(_native.ext.context_p2p(ctx))
        cap, L = sizes["capacity"], sizes["local_experts"]
        rows = slice(rank * T, (rank + 1) * T)
        # Pre-reduced, with the weights given to combine_send or to dispatch_send (NVLink only), and per slot,
        # through the four kernels and (NVLink only) the two fused ones, each `repeats` times: later round trips
        # reuse the buffers the earlier ones reset.
        split_y = {}
        windowed = sizes["window_slots"] < sizes["slots_per_source"]
        for fused in fused_choices(p2p, windowed):
            for weights_at in (("send", "dispatch", "recv") if p2p else ("send", "recv")) * repeats:
                got = kernel_round_trip(ctx, p2p, cfg, sizes, x[rows], ids[rows], w[rows],
                                        None if scales is None else scales[rows], int(counts[rank]), weights_at,
                                        fused, quantize)
                used, err = check_round_trip(got, ref, rank, T, cap, L, cfg, weights_at)
                y = got[4]
                if fused and weights_at in split_y:  # the four kernels' device code: the same sums, bit for bit
                    assert np.array_equal(y.view(np.uint8), split_y[weights_at].view(np.uint8)), \
                        f"fused combine (weights {WEIGHTS_AT[weights_at]}) differs from the four kernels'"
                split_y.setdefault(weights_at, y)
                if weights_at == "dispatch":  # the same weights, the same pre-reduction: the same bits
                    assert np.array_equal(y.view(np.uint8), split_y["send"].view(np.uint8)), \
                        "weights given to dispatch give another combine than weights given to combine_send"
        combines = ("pre-reduced (weights to combine_send, to dispatch) and per slot" if p2p
                    else "pre-reduced (weights to combine_send) and per slot")
        kernels = "four kernels, then the two fused ones (the same bits)" if p2p else "four kernels"
        if _native.ext.context_flagged(ctx):
            kernels += ("; the fused ones per slot on the low-latency path (flagged words), the same bits as the "
                        "other path")
            other, other_sizes = create_context(cfg, world, rank, pes, **{**(options or {}), **OTHER_PATH})
            try:
                assert not _native.ext.context_flagged(other)
                inputs = (x[rows], ids[rows], w[rows], None if scales is None else scales[rows], int(counts[rank]))
                flagged = kernel_round_trip(ctx, p2p, cfg, sizes, *inputs, "recv", True, quantize)
                plain = kernel_round_trip(other, p2p, cfg, other_sizes, *inputs, "recv", True, quantize)
                for name, a, b in zip(("expert_x", "expert_scales", "group_sizes", "row_origin", "y"), flagged[:5],
                                      plain[:5], strict=True):
                    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                        f"the low-latency path's {name} differs from the other path's"
            finally:
                _native.ext.destroy_context(other)
        if windowed:
            rounds = -(-sizes["slots_per_source"] // sizes["window_slots"])
            kernels = (f"the two fused ones in {rounds} rounds of {sizes['window_slots']} slots, the same bits as "
                       "unwindowed")
            whole_options = {k: v for k, v in (options or {}).items() if k != "window_slots"}
            whole, whole_sizes = create_context(cfg, world, rank, pes, **whole_options)
            try:  # the same inputs with every row in one round: the same sums, bit for bit
                for weights_at in split_y:
                    got = kernel_round_trip(whole, p2p, cfg, whole_sizes, x[rows], ids[rows], w[rows],
                                            None if scales is None else scales[rows], int(counts[rank]), weights_at,
                                            True, quantize)
                    assert np.array_equal(got[4].view(np.uint8), split_y[weights_at].view(np.uint8)), \
                        f"windowed combine (weights {WEIGHTS_AT[weights_at]}) differs from the unwindowed one"
            finally:
                _native.ext.destroy_context(whole)
        return (f"rows {used}, combine rel err {err:.1e}, {'NVLink stores' if p2p else 'staged puts'}, "
                f"{repeats} trips {combines}, {kernels}")
    finally:
        _native.ext.destroy_context(ctx)


def draw_case(cfg, world, seed, num_tokens=None):
    """Fresh inputs of one round trip of `cfg` (the same on every rank: x, ids, w, scales, counts; `num_tokens` per
    rank, default max_tokens) and the reference's outputs."""
    rng = np.random.default_rng(seed)
    T, H, K = cfg.max_tokens, cfg.hidden, cfg.experts_per_token
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, "uniform", world * T, cfg, world)
    w = rng.random((world * T, K)).astype(np.float32)
    scales = (rng.random((world * T, cfg.scale_cols)) + 0.5).astype(np.float32) if cfg.is_fp8 else None
    counts = np.full(world, T if num_tokens is None else num_tokens, np.int32)
    return (x, ids, w, scales, counts), reference_round_trip(cfg, world, x, ids, w, scales, counts)


def shared_buffer_set(rank, world, seed, window_slots: int | None = None) -> str:
    """An fp8 config and its bf16 gradient config on one buffer set (share_context), as an fp8 layer's forward and
    backward round trips share a MoEComm's: round trips of the two in turn each give the reference's outputs (the
    bf16 rows in buffers sized for both); a dispatch of one while a round trip of the other is open fails as out of
    order on every rank, refusing both; a reset of either restores both. `window_slots`: both windowed (WINDOW),
    the fused kernels alone."""
    cfg = FP8(32, 8, 512, 16, 128)
    grad = cfg.gradient_config(world, jnp.bfloat16)
    bound = None if window_slots is None else window_bound(cfg, world, window_slots, (grad,))
    ext, opts = _native.ext, Options(**{**RUN, "max_symmetric_bytes": bound})
    owner, layout, window = create_backend_context(cfg, world, rank, opts, None, (grad,))
    sizes = kernel_sizes(cfg, world, rank, ext.sm_count(), opts.timeout_s, window, opts.max_sms)
    grad_sizes = kernel_sizes(grad, world, rank, ext.sm_count(), opts.timeout_s, window, opts.max_sms)
    shared = ext.share_context(owner, grad_sizes, layout, opts.ids_first_min_tokens)
    T, rows = cfg.max_tokens, slice(rank * cfg.max_tokens, (rank + 1) * cfg.max_tokens)
    try:
        assert ext.context_bytes(shared) == 0, "a shared context allocated symmetric memory"
        p2p = bool(ext.context_p2p(owner))

        def trip(ctx, c, s, case_seed, weights_at, fused):
            (x, ids, w, scales, _), ref = draw_case(c, world, case_seed)
            got = kernel_round_trip(ctx, p2p, c, s, x[rows], ids[rows], w[rows],
                                    None if scales is None else scales[rows], T, weights_at, fused)
            check_round_trip(got, ref, rank, T, s["capacity"], s["local_experts"], c, weights_at)

        both = [(owner, cfg, sizes), (shared, grad, grad_sizes)]
        kernels = fused_choices(p2p, window is not None)
        ways = [(w, f) for f in kernels for w in ("send", "recv")]
        try:  # the reset below is collective: every rank makes it, whatever it found wrong first
            for i, (weights_at, fused) in enumerate(ways):
                for j, (ctx, c, s) in enumerate(both):
                    trip(ctx, c, s, seed + 2 * i + j, weights_at, fused)
            # The fp8 dispatch, then the bf16 one before the fp8 combine.
            mem = DeviceArrays()
            try:
                statuses = []
                for ctx, c, s in both:
                    (x, ids, w, scales, _), _ = draw_case(c, world, seed + 100)
                    args, out = round_trip_buffers(mem, p2p, c, s, x[rows], ids[rows], w[rows],
                                                   None if scales is None else scales[rows], T, "recv")
                    for phase, a in round_trip_launches(args, window is not None)[0]:
                        ext.launch_phase(ctx, phase, a)
                    checked(cudart.cudaDeviceSynchronize())
                    statuses.append(DeviceArrays.get(out["status"][0], (errors.STATUS_WORDS,), np.int32))
            finally:
                mem.free()
            assert statuses[0][errors.CODE] == 0, f"the fp8 dispatch failed: {errors.describe(statuses[0])}"
            interleaved = errors.describe(statuses[1])
            assert statuses[1][errors.CODE] & errors.OUT_OF_ORDER and "expected combine_send" in interleaved, \
                interleaved
        finally:
            ext.reset_context(shared)  # collective; the owner's state too
        for j, (ctx, c, s) in enumerate(reversed(both)):
            trip(ctx, c, s, seed + 200 + j, "recv", window is not None)
        rounds = "" if window is None else f", rounds of {window} slots"
        return (f"{len(ways)} x fp8 then bf16 round trips correct on {ext.context_bytes(owner)} B{rounds}; "
                f"interleaved: {interleaved.split(': ', 1)[-1][:60]}; after reset both correct")
    finally:
        ext.destroy_context(shared)
        ext.destroy_context(owner)


def ep_groups(rank, world, seed, cfg, kind, options=None) -> str:
    """Two EP groups of world / 2 PEs each, interleaved (PEs 0, 2, 4, .. and 1, 3, 5, ..: the groups of a mesh
    ("ep", "data") whose data axis is the minor one): each group's round trips, on data of its own, against the
    reference over that group alone. Both groups run at once on one symmetric allocation per PE."""
    if world < 4 or world % 2:
        raise ValueError(f"EP groups need an even world of 4 or more PEs, got {world}")
    group, group_rank, group_world = rank % 2, rank // 2, world // 2
    pes = [group + 2 * r for r in range(group_world)]
    info = run_case(group_rank, group_world, seed + 1000 * group, cfg, kind, options=options, pes=pes)
    return f"2 groups of {group_world} PEs, group {group} PEs {pes}: {info}"


GROUP_CASES = {
    "EP groups: bf16 K8 E32": (C(32, 8, 256, 32, dtype=jnp.bfloat16), "uniform"),
    "EP groups: fp8+scales K8, staged puts": (C(32, 8, 512, 16, dtype=jnp.float8_e4m3fn, scale_block=128),
                                              "uniform", {"staged": True}),
}


def _nan_bits(rows: np.ndarray) -> np.ndarray:
    """The bytes of float8_e4m3fn rows with every NaN as 0x7f (its two encodings differ in sign only, and which one
    a NaN computed from inf * 0 gets is the processor's choice); other dtypes' bytes as they are."""
    bits = rows.view(np.uint8).copy()
    if rows.dtype == jnp.float8_e4m3fn:
        bits[(bits & 0x7F) == 0x7F] = 0x7F
    return bits


def check_round_trip(got, ref, rank, T, cap, L, cfg, weights_at):
    """One round trip's outputs against the reference's: the layout bit for bit, y within the dtype's tolerance.
    Returns (rows used, y's relative error)."""
    rows = slice(rank * T, (rank + 1) * T)
    expert_x, expert_scales, group_sizes, row_origin, y, status, expert_counts = got
    assert all(not s.any() for s in status), f"status words {status}"
    ref_sizes = ref[2][rank * L:(rank + 1) * L]
    if cfg.overflow == "drop":  # the kernels give the layout's sizes; MoEComm cuts them at capacity (load.py)
        end = np.cumsum(group_sizes)
        group_sizes = np.clip(end, 0, cap) - np.clip(end - group_sizes, 0, cap)
    assert np.array_equal(group_sizes, ref_sizes), "group_sizes differ"
    assert np.array_equal(row_origin, ref[3][rank * cap:(rank + 1) * cap]), "row_origin differs"
    assert np.array_equal(expert_counts, ref[5][:cfg.num_experts]), "expert_counts differ"
    used = int(ref_sizes.sum())
    ref_x = ref[0][rank * cap:rank * cap + used]
    assert np.array_equal(_nan_bits(expert_x[:used]), _nan_bits(ref_x)), "expert_x differs"
    if cfg.is_fp8:
        assert np.array_equal(expert_scales[:used], ref[1][rank * cap:rank * cap + used]), "scales differ"
    y32, ref32 = y.astype(np.float32), ref[4][rows].astype(np.float32)
    assert np.array_equal(np.isnan(y32), np.isnan(ref32)), "y is NaN elsewhere than the reference's"
    finite = ~np.isnan(ref32)
    y32, ref32 = y32[finite], ref32[finite]
    err = float(np.abs(y32 - ref32).max(initial=0.0) / max(np.abs(ref32).max(initial=0.0), 1e-30))
    tol = TOLERANCE[np.dtype(cfg.out_dtype).name]
    assert err <= tol, f"combine rel err {err:.2e} (weights {WEIGHTS_AT[weights_at]}) > {tol}"
    return used, err


def marks_table(rank, world, config, tokens, trips, weights_to="combine", split=False, options=None):
    """Where each kernel's time goes (the measurement build): `trips` round trips of the bench config at `tokens` per
    rank, the two fused kernels on the NVLink path (`split`, or off it: the four; their phases stamp the same marks)
    queued back to back (expert_y is zeros: values do not matter here), each trip's kernel marks read after it. The
    weights go where the fused combine gives them by default (MoEComm's prereduce_min_tokens), given to dispatch_send
    when `weights_to` is "dispatch" and the combine pre-reduces (as the bench's --weights-to dispatch).
    `options`: MoEComm options of the context (e.g. low_latency_max_tokens). Prints, per phase, the median µs from
    `start` to each later mark, and the median gap from the previous phase's `end` to this one's `start` (launch
    and queueing); then each phase's rows in GB/s per SM (kernel_marks.py: the routing's row bytes over its span)."""
    from jax_moe_comm import bench

    cfg = bench.CONFIGS[config].moe_config(tokens)
    rng = np.random.default_rng(7)
    T, H, K = cfg.max_tokens, cfg.hidden, cfg.experts_per_token
    all_ids = routing(rng, "uniform", world * T, cfg, world)
    ids = all_ids[rank * T:(rank + 1) * T]
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    scales = (rng.random((T, cfg.scale_cols)) + 0.5).astype(np.float32)
    ext = _native.ext
    ctx, sizes = create_context(cfg, world, rank, **(options or {}))
    mem = DeviceArrays()
    try:
        p2p, flagged = bool(ext.context_p2p(ctx)), bool(ext.context_flagged(ctx))
        fused = p2p and not split
        prereduce = cfg.max_tokens >= Options(**(options or {})).prereduce_min_tokens and not flagged
        weights_at = "send" if prereduce else "recv"
        if weights_to == "dispatch" and p2p and weights_at == "send":
            weights_at = "dispatch"
        phase_args, _ = round_trip_buffers(mem, p2p, cfg, sizes, x, ids, w, scales, T, weights_at)
        launches = [launch for half in round_trip_launches(phase_args, fused) for launch in half]
        rows = []
        for _ in range(trips):
            for phase, a in launches:
                ext.launch_phase(ctx, phase, a)
            checked(cudart.cudaDeviceSynchronize())
            got = ext.take_kernel_marks(ctx)
            if not got:
                raise SystemExit("no kernel marks: their buffer could not be allocated")
            rows.append(np.array(got, np.int64).reshape(len(PHASES), len(MARKS)))
        marks = np.stack(rows[1:])  # the first trip also waits for the peer's start-up
        print(f"rank {rank}: {config} T={tokens}, {'NVLink stores' if p2p else 'staged puts'}, "
              f"{'two fused kernels' if fused else 'four kernels'}"
              f"{' (the low-latency path)' if fused and flagged else ''}, weights {WEIGHTS_AT[weights_at]}, median of "
              f"{len(marks)} trips, us from the kernel's start (gap: from the previous kernel's end)")
        print("\n".join(format_marks(marks)), flush=True)
        payload_bytes = H * np.dtype(cfg.dtype).itemsize + 4 * cfg.scale_cols
        moved = row_bytes_by_phase(all_ids, world, rank, cfg.num_experts, payload_bytes,
                                   H * np.dtype(cfg.out_dtype).itemsize, prereduce)
        print(format_rates(marks, moved, ext.sm_count()), flush=True)
    finally:
        mem.free()
        ext.destroy_context(ctx)


# Faults ------------------------------------------------------------------------------------------------------
# Injected into real round trips between real ranks (PEs sharing one GPU work too). Every round trip's outcome is
# "correct" (its round-trip status clean and every output equal to the reference's) or the failure's text (status
# non-zero on every rank, y NaN); a clean status with a wrong output fails the case: a fault must never become a
# wrong number.
FAULT_TIMEOUT_S = 2.0


def round_trip_outcome(ctx, p2p, cfg, sizes, rank, inputs, ref, weights_at, fused):
    """(outcome, seconds) of one round trip through the kernels: "correct", or the round trip's failure text."""
    x, ids, w, scales, counts = inputs
    T = cfg.max_tokens
    rows = slice(rank * T, (rank + 1) * T)
    start = time.time()
    got = kernel_round_trip(ctx, p2p, cfg, sizes, x[rows], ids[rows], w[rows], None if scales is None else scales[rows],
                            int(counts[rank]), weights_at, fused)
    took = time.time() - start
    trip = got[5][3]  # combine_recv's status: the round trip's, every rank's first failure merged
    if trip[errors.CODE] == 0:
        check_round_trip(got, ref, rank, T, sizes["capacity"], sizes["local_experts"], cfg, weights_at)
        return "correct", took
    assert np.isnan(got[4].astype(np.float32)).all(), f"a failed round trip gave numbers: {errors.describe(trip)}"
    return errors.describe(trip), took


def failing_rank(text: str) -> int:
    """The rank a failure's text names as the one that found it ("... failed on rank 3: ...")."""
    return int(re.search(r"failed on rank (\d+):", text).group(1))


def host_barrier(name: str) -> None:
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"jax_moe_comm/harness/{name}", 120_000)


def fault_round_trips(rank, world, seed, absent_rank_skips: bool, window_slots: int | None = None,
                      low_latency: bool = False) -> str:
    """The last rank comes 2 x timeout late to round trip 1 (or skips it: `absent_rank_skips`), then five more
    round trips follow, then a collective reset and one more. Round trip 1 fails on every rank within one timeout;
    the five after it are refused at once with the same failure named; after the reset the round trip is correct.
    `window_slots`: windowed (WINDOW), rows in rounds. `low_latency`: the fused kernels on the low-latency path
    (flagged words, rows per slot); else the other path, pre-reduced."""
    cfg = C(4 * world, 2, 64, 16, dtype=jnp.float32, out_dtype=jnp.float32)
    options = {} if low_latency else dict(OTHER_PATH)
    ctx, sizes = create_context(cfg, world, rank, timeout_s=FAULT_TIMEOUT_S,
                                **(WINDOW(window_slots) if window_slots else {}), **options)
    ext = _native.ext
    try:
        p2p = bool(ext.context_p2p(ctx))
        assert bool(ext.context_flagged(ctx)) == (low_latency and p2p), "not the path the case is for"
        weights_at = "recv" if low_latency else "send"
        late = world - 1
        outcomes, times = [], []
        for trip in range(6):
            inputs, ref = draw_case(cfg, world, seed + trip)
            if trip == 0 and rank == late:
                if absent_rank_skips:
                    host_barrier(f"skipped_{seed}")  # the others' round trip 1 has ended
                    outcomes.append("skipped")
                    times.append(0.0)
                    continue
                time.sleep(2 * FAULT_TIMEOUT_S)
            outcome, took = round_trip_outcome(ctx, p2p, cfg, sizes, rank, inputs, ref, weights_at, p2p)
            if trip == 0 and absent_rank_skips:
                host_barrier(f"skipped_{seed}")
            outcomes.append(outcome)
            times.append(took)
        first = outcomes[0] if not (absent_rank_skips and rank == late) else outcomes[1]
        held = ext.host_failure(ctx)
        try:  # the reset below is collective: every rank makes it, whatever it found wrong first
            assert f"timed out waiting for rank {late}" in first, f"round trip 1 on rank {rank}: {first}"
            assert all(o != "correct" for o in outcomes), f"a round trip after the failure ran: {outcomes}"
            assert len({o for o in outcomes if o != "skipped"}) == 1, f"the failure changed: {outcomes}"
            if rank != late:
                assert times[0] < 1.5 * FAULT_TIMEOUT_S, f"round trip 1 took {times[0]:.1f}s: more than one timeout"
            # Refused at once: well within a timeout (processes time-slicing one GPU take a few hundred ms a call).
            assert max(times[1:]) < FAULT_TIMEOUT_S / 2, f"a refused round trip took {max(times[1:]):.1f}s"
            # The host raises the failure of the lowest rank that published one, the same text in every process; a
            # round trip's status holds this rank's first. They differ where two ranks timed out at once.
            assert held[errors.CODE] == errors.TIMEOUT and held[errors.DETAIL_A] == late, \
                f"the host words hold another failure: {errors.describe(held)}"
            assert held[errors.RANK] <= failing_rank(first), \
                f"the host words name rank {held[errors.RANK]}, not the lowest that failed: {first}"
        finally:
            ext.reset_context(ctx)
        inputs, ref = draw_case(cfg, world, seed + 6)
        after, _ = round_trip_outcome(ctx, p2p, cfg, sizes, rank, inputs, ref, weights_at, p2p)
        assert after == "correct", f"after reset: {after}"
        assert ext.host_failure(ctx)[errors.CODE] == 0
        return (f"trip 1 failed in {times[0]:.1f}s (timeout {FAULT_TIMEOUT_S:.0f}s): {first.split(': ', 1)[1][:70]}; "
                f"5 refused in <= {max(times[1:]) * 1e3:.0f} ms; after reset correct")
    finally:
        ext.destroy_context(ctx)


def fault_overflow(rank, world, seed, window_slots: int | None = None, low_latency: bool = False) -> str:
    """T = 4096 into a capacity of 512 (`low_latency`: T = 32 into 64, the fused kernels per slot on the low-latency
    path): every rank's round trip ends in well under a timeout (no combine waits for rows that were dropped) with
    the overflow named on every rank, for rows per slot and pre-reduced rows, four kernels and fused (windowed,
    `window_slots`: fused alone, in rounds); then a round trip that fits is correct."""
    tokens, capacity = (32, 64) if low_latency else (4096, 512)
    cfg = C(16, 4, 128, tokens, dtype=jnp.float32, out_dtype=jnp.float32, capacity=capacity)
    # Longer waits than the other faults': eight PEs time-slicing one GPU took over 2 s for this round trip.
    timeout_s = 5 * FAULT_TIMEOUT_S
    ctx, sizes = create_context(cfg, world, rank, timeout_s=timeout_s, **(WINDOW(window_slots) if window_slots else {}))
    try:
        p2p = bool(_native.ext.context_p2p(ctx))
        inputs, ref = draw_case(cfg, world, seed)
        slowest, texts = 0.0, set()
        assert bool(_native.ext.context_flagged(ctx)) == (low_latency and p2p), "not the path the case is for"
        for fused in fused_choices(p2p, bool(window_slots)):
            for weights_at in ("recv", "send"):
                outcome, took = round_trip_outcome(ctx, p2p, cfg, sizes, rank, inputs, ref, weights_at, fused)
                assert f"rows arrived but capacity is {capacity}" in outcome, outcome
                slowest, texts = max(slowest, took), texts | {outcome}
        assert slowest < timeout_s / 2, f"an overflowing round trip took {slowest:.1f}s"
        assert _native.ext.host_failure(ctx)[errors.CODE] == errors.CAPACITY_OVERFLOW
        inputs, ref = draw_case(cfg, world, seed + 1, num_tokens=4 if low_latency else 32)
        fits, _ = round_trip_outcome(ctx, p2p, cfg, sizes, rank, inputs, ref, "recv", bool(window_slots))
        assert fits == "correct", fits
        return f"{len(texts)} text(s), slowest {slowest * 1e3:.0f} ms: {sorted(texts)[0].split(': ', 1)[1][:80]}"
    finally:
        _native.ext.destroy_context(ctx)


def traffic_per_rank(rank, world, seed) -> str:
    """Staged puts (to every peer with --staged or none given, else to the other simulated nodes' ranks): what one round
    trip with pre-reduced rows sends each rank it puts to, as the kernels count it (the measurement build's
    take_traffic), at 16 and 256 tokens per rank. Whatever the token count, the dispatch sends each such rank at most
    four puts (the ids, the routes, the counts, one run of rows) and the combine two (the weights, one run of partial
    rows; dp_size runs at dp_size > 1), with the same signals; their bytes grow with the rows. The round trips are
    correct."""
    ext = _native.ext
    staged = {} if RUN["staged"] or nvshmem_backend._ranks_per_node else {"staged": True}
    seen = {}
    for tokens in (16, 256):
        cfg = C(4 * world, 4, 64, tokens, dtype=jnp.float32, out_dtype=jnp.float32)
        ctx, sizes = create_context(cfg, world, rank, **OTHER_PATH, **staged)
        try:
            remote = [d for d, direct in enumerate(ext.context_direct(ctx)) if not direct and d != rank]
            assert remote and not ext.context_p2p(ctx), "no rank is reached by puts"
            inputs, ref = draw_case(cfg, world, seed + tokens)
            ext.take_traffic(ctx)  # from zero
            outcome, _ = round_trip_outcome(ctx, False, cfg, sizes, rank, inputs, ref, "send", False)
            assert outcome == "correct", outcome
            words = np.array(ext.take_traffic(ctx), np.int64)
            per_phase = words[:len(PHASES) * world * 2].reshape(len(PHASES), world, 2)
            seen[tokens] = {name: per_phase[i, remote] for i, name in enumerate(PHASES)}
            seen[tokens]["signals"] = words[len(PHASES) * world * 2:][remote]
        finally:
            ext.destroy_context(ctx)
    few, many = seen[16], seen[256]
    for phase, most in (("dispatch_send", 4), ("combine_send", 2)):
        puts = few[phase][:, 0], many[phase][:, 0]
        assert (puts[0] <= most).all() and (puts[1] <= most).all(), f"{phase} puts per rank: {puts[0]}, {puts[1]}"
        assert (many[phase][:, 1] > few[phase][:, 1]).all(), f"{phase} bytes: {few[phase][:, 1]}, {many[phase][:, 1]}"
    for phase in ("dispatch_recv", "combine_recv"):
        assert not few[phase].any() and not many[phase].any(), f"{phase} put: {few[phase]}, {many[phase]}"
    assert np.array_equal(few["signals"], many["signals"]), f"signals per rank: {few['signals']}, {many['signals']}"
    return (f"{len(remote)} ranks by puts; per rank at T=16 / 256: dispatch {few['dispatch_send'][:, 0].max()} / "
            f"{many['dispatch_send'][:, 0].max()} puts ({few['dispatch_send'][:, 1].max()} / "
            f"{many['dispatch_send'][:, 1].max()} bytes), combine {few['combine_send'][:, 0].max()} / "
            f"{many['combine_send'][:, 0].max()} puts ({few['combine_send'][:, 1].max()} / "
            f"{many['combine_send'][:, 1].max()} bytes), {few['signals'].max()} signals")


FAULTS = {
    "fault: a rank 2 x timeout late, then 5 round trips": lambda r, w, s: fault_round_trips(r, w, s, False),
    "fault: a rank that never arrives, then 5 round trips": lambda r, w, s: fault_round_trips(r, w, s, True),
    "fault: capacity overflow at T=4096": fault_overflow,
    "low-latency fault: a rank 2 x timeout late, then 5 round trips": lambda r, w, s: fault_round_trips(
        r, w, s, False, None, True),
    "low-latency fault: a rank that never arrives, then 5 round trips": lambda r, w, s: fault_round_trips(
        r, w, s, True, None, True),
    "low-latency fault: capacity overflow at T=32": lambda r, w, s: fault_overflow(r, w, s, None, True),
    "windowed fault: a rank 2 x timeout late, then 5 round trips": lambda r, w, s: fault_round_trips(r, w, s, False, 4),
    "windowed fault: capacity overflow at T=4096, rounds of 1024": lambda r, w, s: fault_overflow(r, w, s, 1024),
    "shared buffer set: fp8 and bf16 round trips in turn, interleaving refused": shared_buffer_set,
    "windowed shared buffer set: fp8 and bf16 in turn, interleaving refused": lambda r, w, s: shared_buffer_set(
        r, w, s, 4),
    "traffic: puts per rank off NVLink do not grow with the tokens": traffic_per_rank,
}


def kernel_draws(world: int, count: int, seed: int) -> list[str]:
    """`count` differential draws of one round trip at `world` PEs (tests/differential.py's generator: config, options,
    routing and token counts together; two runs per config), as JSON: those the kernels run without a failure by
    contract (ids in range; a capacity overflow only where it drops)."""
    import differential

    found: list[str] = []
    for group in differential.sample(world, -(-count // 2), 2, seed, patterns=("one",)):
        for draw in group:
            s, inputs = draw.setup, draw.inputs
            if inputs.routing == "bad_id":
                inputs = dataclasses.replace(inputs, routing="uniform")
            if s.overflow == "error":
                s = dataclasses.replace(s, capacity=None, capacity_factor=None)
            found.append(differential.Draw(s, inputs).to_json())
    return found[:count]


def run_kernel_draw(rank: int, world: int, text: str) -> str:
    """One kernel draw (kernel_draws) through run_case: every send path and kernel the context runs, against the
    reference; the options of the draw's MoEComm (staged, window, ids-first and low-latency thresholds)."""
    import differential

    draw = differential.Draw.from_json(text)
    s, inputs = draw.setup, draw.inputs
    options = {k: v for k, v in s.options if k != "prereduce_min_tokens"}  # the harness runs every weights place
    options.setdefault("low_latency_max_tokens", 0)
    if RUN["staged"] or nvshmem_backend._ranks_per_node:
        options.pop("window_slots", None)  # a window runs on NVLink peers only: off it, the same draw unwindowed
    kind = {"one_hot": "one_hot", "skewed": "skewed", "dropped": "dropped"}.get(inputs.routing, "uniform")
    return run_case(rank, world, inputs.seed, s.config(), kind, repeats=1, options=options,
                    quantize=s.payload == "quantize", partial=inputs.num_tokens != "full")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=int(os.environ.get("JMC_SEED", time.time_ns() % 2**31)))
    parser.add_argument("--only", default="", help="run the cases whose name contains this (alternatives: a|b)")
    parser.add_argument("--marks", default="", metavar="T,T,...",
                        help="instead of the cases: where each kernel's time goes (R1, these tokens per rank; the "
                             "measurement build)")
    parser.add_argument("--weights-to", choices=("combine", "dispatch"), default="combine",
                        help="with --marks: give the weights to dispatch where the combine pre-reduces")
    parser.add_argument("--split", action="store_true", help="with --marks: the four kernels, not the two fused ones")
    parser.add_argument("--low-latency-max-tokens", type=int, default=Options().low_latency_max_tokens,
                        help="with --marks: MoEComm's low_latency_max_tokens (0: never the low-latency path; default "
                             "MoEComm's, as the bench)")
    parser.add_argument("--staged", action="store_true", help="MoEComm's staged=True: staged puts even on NVLink")
    parser.add_argument("--ranks-per-node", type=int, default=0, metavar="N",
                        help="simulated nodes of N ranks: peers on other nodes reached by NVSHMEM puts, the others by "
                             "stores (nvshmem_backend.simulated_nodes)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="MoEComm's timeout_s of the cases")
    parser.add_argument("--case-limit", type=float, default=280.0, help="seconds before a case that has not "
                        "returned dumps every stack and ends the rank (memcheck slows the kernels down)")
    parser.add_argument("--differential", type=int, default=0, metavar="N",
                        help="instead of the cases: N differential draws (tests/differential.py) of one round trip")
    parser.add_argument("--replay", default="", metavar="JSON", help="instead of the cases: the one draw printed")
    args = parser.parse_args()
    rank, world = initialize_distributed()
    if _native.ext is None:
        raise SystemExit(_native.unavailable_reason_text())
    checked(cudart.cudaSetDevice(0))  # the launcher gives each process one visible GPU
    uid = runtime._share_unique_id(rank, world, 120.0)
    if _native.ext.init(uid, rank, world, 0) != 0:
        raise SystemExit("NVSHMEM initialization failed")
    seed = from_process_0("kernel_harness_seed", lambda: args.seed)  # every rank draws the same data
    RUN.update(timeout_s=args.timeout_s, staged=args.staged)
    nodes = contextlib.ExitStack()  # held to the end of the run
    if args.ranks_per_node:
        nodes.enter_context(nvshmem_backend.simulated_nodes(args.ranks_per_node))
    if args.marks:
        if not _native.ext.measurement_build():
            raise SystemExit("--marks needs the measurement build (JAX_MOE_COMM_MEASUREMENT=ON)")
        for tokens in (int(t) for t in args.marks.split(",")):
            marks_table(rank, world, "r1", tokens, trips=50, weights_to=args.weights_to, split=args.split,
                        options={"low_latency_max_tokens": args.low_latency_max_tokens})
        _native.ext.finalize()
        return 0
    passed = failed = 0
    cases = {name: (lambda r, w, s, c=case: run_entry(c, r, w, s)) for name, case in CASES.items()}
    if world >= 4:
        cases.update({name: (lambda r, w, s, c=case: ep_groups(r, w, s, *c)) for name, case in GROUP_CASES.items()})
    cases = {**cases, **FAULTS}
    if args.differential or args.replay:
        texts = [args.replay] if args.replay else from_process_0(f"draws_{seed}", lambda: kernel_draws(
            world, args.differential, seed))
        cases = {f"draw {i}": (lambda r, w, s, t=text: run_kernel_draw(r, w, t)) for i, text in enumerate(texts)}
        replay = dict(zip(cases, texts, strict=True))
    for i, (name, case) in enumerate(cases.items()):
        if args.only and not any(p in name for p in args.only.split("|")):
            continue
        if (args.staged or args.ranks_per_node) and "windowed" in name:
            print(f"SKIP {name}: a windowed round trip runs on NVLink peers only (not with --staged or "
                  "--ranks-per-node)", flush=True)
            continue
        dp_size = CASES[name][0].dp_size if name in CASES else 1
        if world % dp_size:
            print(f"SKIP {name}: dp_size {dp_size} needs a world it divides (world {world})", flush=True)
            continue
        if name.startswith("traffic") and not _native.ext.measurement_build():
            print(f"SKIP {name}: the measurement build only (JAX_MOE_COMM_MEASUREMENT=ON)", flush=True)
            continue
        if name in TOO_SLOW_UNDER_SANITIZER and os.environ.get("JMC_UNDER_SANITIZER"):
            print(f"SKIP {name}: too slow under compute-sanitizer ({os.environ['JMC_UNDER_SANITIZER']})", flush=True)
            continue
        t0 = time.time()
        faulthandler.dump_traceback_later(args.case_limit, exit=True)  # a rank left waiting: stacks, then exit
        try:
            info, ok = case(rank, world, seed + i), True
        except Exception as exc:  # report and go on (both ranks run every case: create_context is collective)
            info, ok = f"{type(exc).__name__}: {str(exc)[:300]}", False
        faulthandler.cancel_dump_traceback_later()
        passed, failed = passed + ok, failed + (not ok)
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t0:.1f}s, seed {seed + i}): {info}", flush=True)
        if not ok and (args.differential or args.replay):
            print(f"  replay: tests/gpu/kernel_harness.py --replay '{replay[name]}'", flush=True)
    if rank == 0:
        if args.differential:
            print(f"differential: {passed + failed} draws, {failed} failures (world {world}, seed {seed})", flush=True)
        print(f"{passed} passed, {failed} failed", flush=True)
    _native.ext.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

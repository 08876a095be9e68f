"""Measuring one backend at one size across processes: its rows, checked against the expected round trip."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import statistics
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import runtime

from .chains import (
    backward_chain,
    combine_chain,
    compute_chain,
    dispatch_chain,
    lower_chain,
    merged_steps,
    overlapped_chain,
    per_step_us,
    round_trip_chain,
)
from .configs import AXIS, TOLERANCE, Array, BenchConfig, round_trip_bytes
from .impls import ALL_BACKENDS, PROBES, QUANTIZE, UNCHECKED, BaselineImpl, make_impl

NVSHMEM_MIN_HEAP = 1 << 30
COMPILE_THREADS = max(1, min(6, (os.cpu_count() or 1) // 4))  # XLA compiles use several cores each


def all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([int(ok)], np.int32))))


def global_sum(values: Sequence[float]) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values.astype(np.float32))).reshape(-1, len(values)).sum(0)


def to_global(host: np.ndarray | None, mesh: Mesh) -> Array | None:
    if host is None:
        return None
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(AXIS)), lambda index: host[index])


def local_rows(array: Array) -> list[tuple[slice, np.ndarray]]:
    """(row slice, host data) of each addressable shard of a row-sharded global array."""
    return [(shard.index[0], np.asarray(shard.data)) for shard in array.addressable_shards]


def relative_error(actual: Array, expected_host: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| over the whole global array (each process adds its own rows)."""
    num = den = 0.0
    for rows, data in local_rows(actual):
        want = expected_host[rows].astype(np.float64)
        num += float(np.sum((data.astype(np.float64) - want) ** 2))
        den += float(np.sum(want**2))
    num, den = global_sum([num, den])
    return float(np.sqrt(num / max(den, 1e-300)))


def short_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for marker in ("UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "Out of memory", "out of memory"):
        if marker in text:
            text = text[text.index(marker):]
            break
    return f"{type(exc).__name__}: {text[:400]}"


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    backend: str
    config: str
    tokens: int
    dispatch_us: float | None = None
    combine_us: float | None = None
    total_us: float | None = None
    total_us_each: list[float] | None = None  # every repeat's round trip (total_us is their median): the spread
    compute_us: float | None = None  # --overlap: the shared expert alone
    overlapped_us: float | None = None  # --overlap: the round trip with the shared expert between its halves
    hidden_us: float | None = None  # --overlap: total + compute - overlapped, what the overlap saved
    gbps: float | None = None
    bytes: float | None = None
    rel_err: float | None = None
    error: str | None = None
    note: str | None = None  # e.g. a time below this machine's timing resolution
    send_stream: str | None = None  # --overlap: the MoEComm's send_stream of this row (None: XLA's stream)

    def record(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("error", "note")}
        for key in ("dispatch_us", "combine_us", "total_us", "compute_us", "overlapped_us", "hidden_us", "gbps",
                    "bytes"):
            if out[key] is not None:
                out[key] = round(out[key], 3)
        if out["total_us_each"] is not None:
            out["total_us_each"] = [round(t, 3) for t in out["total_us_each"]]
        if self.error:
            out["error"] = self.error
        if self.note:
            out["note"] = self.note
        return out


def median_or_none(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def timing_note(repeats: list[float], n: int) -> str | None:
    """What a row's repeats say about the timing itself: a repeat at or below zero is one where the n-chain took no
    longer than the 1-chain, so the host's jitter (or the processes' skew at a call's start) was larger than n - 1
    round trips; the median is then kept as measured, and a longer chain (--chain) is the way to a firmer time."""
    low = sum(t <= 0 for t in repeats)
    if not low:
        return None
    if statistics.median(repeats) <= 0:
        return (f"below this machine's timing resolution: the {n}-chain took no longer than the 1-chain "
                "(a busy CPU's jitter exceeds the round trip)")
    return (f"{low} of {len(repeats)} repeats at or below zero: the jitter between calls exceeds {n - 1} round "
            "trips, so this median is loose; a longer --chain firms it")


class Progress:
    """tqdm on stderr when installed and stderr is a terminal (else one line per step); silent on processes other
    than 0."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def bench_backend(name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, inputs: dict, args,
                  expected_y: dict) -> Row:
    """Times one backend at one size. Every process takes the same path (agreeing on failures)."""
    row = Row(name, cfg.name, tokens)
    world = mesh.size
    n = args.chain
    impl = None
    try:
        impl = make_impl(name, cfg, tokens, mesh, args.check_errors, args.weights_to, args.options, args.backward)
        error = None
    except Exception as exc:  # noqa: BLE001 (reported in the row)
        error = short_error(exc)
    if not all_processes_ok(error is None):
        row.error = error or "failed on another process"
        return row

    routing = inputs["routing"]
    x, scales = impl.inputs(inputs["x"], inputs["scales"])

    def device_args(r):
        ids, w = routing(r)
        return (x, scales, to_global(ids, mesh), to_global(w, mesh))

    args0 = device_args(0)
    builders = {"total": backward_chain if args.backward else round_trip_chain}
    if args.overlap:
        if not impl.split:
            impl.close()
            row.error = "--overlap needs a dispatch in split halves (the MoEComm backends)"
            return row
        builders.update(compute=functools.partial(compute_chain, ffn=args.overlap),
                        overlapped=functools.partial(overlapped_chain, ffn=args.overlap, at=args.overlap_at))
    elif impl.halves and args.halves and not args.backward:
        builders.update(dispatch=dispatch_chain, combine=combine_chain)
    compiled, errors = {}, {}
    try:
        # Trace and lower one by one, then compile the (up to) six programs in parallel threads.
        lowered = {}
        for part, build in builders.items():
            try:
                lowered[part] = [lower_chain(build(impl, cfg, steps), mesh, args0) for steps in (1, n)]
            except Exception as exc:  # noqa: BLE001
                errors[part] = short_error(exc)
        with concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
            futures = {part: [pool.submit(lo.compile) for lo in pair] for part, pair in lowered.items()}
            for part, pair in futures.items():
                try:
                    compiled[part] = tuple(f.result() for f in pair)
                except Exception as exc:  # noqa: BLE001
                    errors[part] = short_error(exc)
        for part, pair in list(compiled.items()):  # a round trip sends both ways; a half, one way
            if part == "compute":  # no communication to count
                continue
            reason = merged_steps(pair, n, 2 if part in ("total", "overlapped") else 1)
            if reason is not None:
                del compiled[part]
                errors[part] = reason
        for part in builders:  # every process must run the same programs
            if not all_processes_ok(part in compiled) and part in compiled:
                del compiled[part]
                errors[part] = "failed on another process"
        if "total" not in compiled:
            row.error = errors.get("total", "failed on another process")
            return row
        # Warm-up (first executions set up communicators) and the correctness check on repeat 0's routing.
        error = None
        try:
            for pair in compiled.values():
                for fn in pair:
                    jax.block_until_ready(fn(*args0))
            y = compiled["total"][0](*args0)[1]
        except Exception as exc:  # noqa: BLE001
            error = short_error(exc)
        if not all_processes_ok(error is None):
            row.error = error or "failed on another process"
            return row
        if name not in PROBES:  # a probe's result is the bytes moved, no round trip's: nothing to check
            if "reference" in expected_y and name != "reference":
                row.rel_err = relative_error(y, expected_y["reference"])
                against = "the reference backend"
            elif args.backward:  # the brute force has no gradients: plain AD on the reference backend is the check
                row.note = "backward: unchecked (the reference backend did not run)" if name != "reference" else None
                against = None
            else:
                row.rel_err = relative_error(y, expected_y["numpy"])
                against = "the NumPy brute force"
            if name == "reference" and (row.rel_err is None or row.rel_err < TOLERANCE):
                host = np.zeros(y.shape, np.float32)  # only this process's rows are filled (and ever read)
                for rows, data in local_rows(y):
                    host[rows] = data
                expected_y["reference"] = host
            if row.rel_err is not None and not row.rel_err < TOLERANCE:
                errors["check"] = f"wrong result: relative error {row.rel_err:.2e} against {against}"
        del y

        times = {part: [] for part in compiled}
        nbytes = []
        error = None
        try:
            for r in range(args.repeats):
                dev = device_args(r) if r else args0  # uploaded before the clock starts
                jax.block_until_ready(dev)
                for part, pair in compiled.items():
                    times[part].append(per_step_us(pair, dev, n))
                nbytes.append(round_trip_bytes(cfg, routing(r)[0], world))
        except Exception as exc:  # noqa: BLE001
            error = short_error(exc)
        if not all_processes_ok(error is None):
            errors["run"] = error or "failed on another process"
        row.total_us = median_or_none(times.get("total", []))
        row.total_us_each = times.get("total") or None
        row.dispatch_us = median_or_none(times.get("dispatch", []))
        row.combine_us = median_or_none(times.get("combine", []))
        row.compute_us = median_or_none(times.get("compute", []))
        row.overlapped_us = median_or_none(times.get("overlapped", []))
        if None not in (row.total_us, row.compute_us, row.overlapped_us):
            row.hidden_us = row.total_us + row.compute_us - row.overlapped_us
        if nbytes and row.total_us and not args.backward:  # the bytes of a forward round trip
            row.bytes = float(np.mean(nbytes))
            row.gbps = row.bytes / (row.total_us * 1e-6) / 1e9 if row.total_us > 0 else None
        row.note = timing_note(times.get("total", []), n) or row.note
        if errors:
            row.error = "; ".join(f"{part}: {text}" if part in ("dispatch", "combine", "compute", "overlapped")
                                  else text
                                  for part, text in errors.items())
        return row
    finally:
        if impl is not None:
            impl.close()


def available_backends(mesh: Mesh, nvshmem_reason: str | None) -> tuple[list[str], dict[str, str]]:
    """(backends that can run here, {backend: why not} for the others)."""
    why_not = {}
    if nvshmem_reason is not None:
        why_not.update(dict.fromkeys(("nvshmem", UNCHECKED, QUANTIZE, *PROBES), nvshmem_reason))
    # ragged_all_to_all: XLA:CPU cannot compile it; XLA:GPU with one GPU per process runs it only through its NCCL
    # send/recv fallback, which is off by default (the call fails at run time). Probe with a tiny round trip.
    error = None
    try:
        world = mesh.size
        cfg = BenchConfig("probe", 8, world, 1, np.dtype(np.float32), np.dtype(np.float32))
        args = (to_global(np.ones((world, 8), np.float32), mesh), None,
                to_global(((np.arange(world) + 1) % world).astype(np.int32).reshape(world, 1), mesh),
                to_global(np.ones((world, 1), np.float32), mesh))
        jax.block_until_ready(lower_chain(round_trip_chain(BaselineImpl("ragged", cfg), cfg, 1), mesh, args)
                              .compile()(*args))
    except Exception as exc:  # noqa: BLE001
        error = short_error(exc)
        if "fallback to NCCL" in error:
            error = ("XLA:GPU runs ragged_all_to_all across processes only through NCCL send/recv, which is off: "
                     "time it in one process (python -m jax_moe_comm.bench, all GPUs on one mesh), or allow it with "
                     "XLA_FLAGS=--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true (seen to hang on "
                     f"jax 0.11.2). {error}")
    if not all_processes_ok(error is None):
        why_not["ragged"] = error or "failed on another process"
    return [b for b in ALL_BACKENDS if b not in why_not], why_not


def start_nvshmem(wanted: bool, configs: list[BenchConfig], tokens: list[int], mesh: Mesh) -> str | None:
    """Initializes NVSHMEM (heap sized for the largest config) where it can run; returns why not, or None."""
    one_gpu = [d.platform for d in jax.local_devices()] == ["gpu"]
    if not wanted:
        return "not requested"
    if not (one_gpu and jax_moe_comm.build_info()["cuda"]):
        return runtime.unavailable_reason(mesh) or "needs one GPU per process (python -m jax_moe_comm.launch)"
    heap = 0
    for cfg in configs:
        for t in tokens:
            try:
                comm = jax_moe_comm.MoEComm(cfg.moe_config(t), mesh, AXIS, backend="reference")
                heap = max(heap, comm.symmetric_bytes)
            except ValueError:
                pass
    heap = max(NVSHMEM_MIN_HEAP, int(heap * 1.25) + (256 << 20))
    try:
        jax_moe_comm.initialize(symmetric_size=heap)  # the first call fixes the heap size
    except Exception as exc:  # noqa: BLE001
        return short_error(exc)
    return runtime.unavailable_reason(mesh)

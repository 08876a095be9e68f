"""The kernel marks' layout and how they are printed (kernel_harness.py --marks): each phase's median µs from its
start to each later mark, and its rows in GB/s per SM. The row bytes are counted from the routing alone, before any
drop (capacity), each byte read or written once: a lower bound on a phase's traffic, whatever the path; the ids,
layout and signals are left out."""

from __future__ import annotations

import numpy as np

from jax_moe_comm.errors import PHASES

MARKS = ("start", "waited", "worked", "closed", "all_done", "end", "step1", "step2")  # ffi/context.h, enum Mark


def format_marks(marks: np.ndarray) -> list[str]:
    """marks [trips, phase, mark] (globaltimer ns, 0 = not stamped): a row per phase, medians in µs."""
    lines = [f"{'phase':14s} {'gap':>7s} " + " ".join(f"{m:>8s}" for m in MARKS[1:])]
    for i, phase in enumerate(PHASES):
        start = marks[:, i, 0]
        gap = f"{np.median(start - marks[:, i - 1, 5]) / 1e3:7.1f}" if i else f"{'-':>7s}"  # trip 1: host sync
        cells = []
        for j in range(1, len(MARKS)):
            stamped = marks[:, i, j] > 0
            cells.append(f"{np.median(marks[stamped, i, j] - start[stamped]) / 1e3:8.1f}" if stamped.any()
                         else f"{'-':>8s}")
        lines.append(f"{phase:14s} {gap} " + " ".join(cells))
    trip = np.median(marks[:, -1, 5] - marks[:, 0, 0]) / 1e3
    lines.append(f"round trip (dispatch_send start to combine_recv end): {trip:.1f} us")
    return lines


def row_bytes_by_phase(all_ids: np.ndarray, world: int, rank: int, num_experts: int, payload_bytes: int,
                       out_bytes: int, prereduce: bool) -> dict[str, int]:
    """all_ids [world * T, K]: every rank's top-k ids (rank r's tokens at [r * T, (r + 1) * T); < 0: no slot).
    payload_bytes: one dispatched row (payload and scales); out_bytes: one combined row (hidden * the out dtype's
    bytes). Returns the bytes of rank `rank`'s
    - "dispatch": the fan-out on arrival: each arriving token's row read once, written to each of its slots here;
    - "combine_send": the slot rows here read, and written to their tokens' ranks: one partial row per (token,
      this rank) when pre-reduced, else one row per slot;
    - "combine_recv": this rank's tokens' rows read (partial rows: one per rank holding one of its slots; else one
      per slot) and its output rows written."""
    all_ids = np.asarray(all_ids)
    tokens = all_ids.shape[0] // world
    local = num_experts // world
    live = all_ids >= 0
    expert_rank = np.where(live, all_ids // local, -1)
    here = expert_rank == rank  # [world * T, K]: slots whose expert is on this rank
    slots_here = int(here.sum())
    tokens_here = int(here.any(axis=1).sum())  # arriving tokens (one row each, whatever its slots here)
    own = expert_rank[rank * tokens:(rank + 1) * tokens]
    partial_rows = sum(int((own == r).any(axis=1).sum()) for r in range(world))  # (token, rank holding a slot)
    sent = tokens_here if prereduce else slots_here
    received = partial_rows if prereduce else int((own >= 0).sum())
    return {
        "dispatch": (tokens_here + slots_here) * payload_bytes,
        "combine_send": (slots_here + sent) * out_bytes,
        "combine_recv": (received + tokens) * out_bytes,
    }


def gb_per_s_per_sm(row_bytes: int, microseconds: float, sm_count: int) -> float:
    """GB/s per SM (1 GB/s = 1,000 bytes per µs): the row bytes over a phase's time, spread over the device's SMs."""
    return row_bytes / (microseconds * 1e3) / sm_count if microseconds > 0 and sm_count > 0 else float("nan")


def format_rates(marks: np.ndarray, row_bytes: dict[str, int], sm_count: int) -> str:
    """marks [trips, phase, mark] (ns, PHASES x MARKS): the rows' GB/s per SM of each phase's copies over the marks'
    medians, the dispatch from dispatch_send's start to dispatch_recv's end (its two phases overlap in the fused
    kernel), each combine phase from its start to its end."""
    start, end = MARKS.index("start"), MARKS.index("end")
    at = {name: PHASES.index(name) for name in PHASES}
    spans = {"dispatch": marks[:, at["dispatch_recv"], end] - marks[:, at["dispatch_send"], start],
             "combine_send": marks[:, at["combine_send"], end] - marks[:, at["combine_send"], start],
             "combine_recv": marks[:, at["combine_recv"], end] - marks[:, at["combine_recv"], start]}
    cells = []
    for name, span in spans.items():
        us = float(np.median(span)) / 1e3
        rate = gb_per_s_per_sm(row_bytes[name], us, sm_count)
        cells.append(f"{name} {row_bytes[name] / 1e6:.1f} MB in {us:.1f} us = {rate:.2f}")
    return f"rows' GB/s per SM ({sm_count} SMs): " + "; ".join(cells)

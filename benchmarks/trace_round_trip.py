"""Where a round trip's time goes: traces the bench's jitted chain of round trips with jax.profiler and prints the
GPU activity per kernel name and the device timeline of one chain call (rank 0; every rank with --all-ranks).

    python -m jax_moe_comm.launch -n 2 -- benchmarks/trace_round_trip.py --tokens 128 [--check] [--chain 4]
        [--option prereduce_min_tokens=1] [--all-ranks] [--backward] [--overlap [FFN] --overlap-at combine]
        [--overlap [FFN] --compute-alone]

Needs CUPTI (shipped with jax's CUDA plugin); without it the trace holds host events only and this says so.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import sys
import tempfile

import jax
import numpy as np
from jax.sharding import Mesh

from jax_moe_comm import bench
from jax_moe_comm._cli import prepare_process
from jax_moe_comm.bench.chains import backward_chain, compute_chain, overlapped_chain
from jax_moe_comm.bench.cli import OPTION_NAMES, OVERLAP_AT, SHARED_EXPERT_FFN, parse_option
from jax_moe_comm.launch import initialize_distributed


def load_trace(log_dir: str) -> list[dict]:
    paths = glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True) + glob.glob(
        f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not paths:
        return []
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict]) -> list[dict]:
    """Complete events on GPU tracks (processes whose name mentions a GPU/device stream)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "GPU" in name or "gpu" in name or "device" in name.lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def print_by_name(title: str, events: list[dict], rows: int) -> None:
    """Count, median and total duration per event name (the `rows` names with the most time)."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.get("name", "")[:70]].append(e["dur"])
    print(f"{title:70s} {'count':>6s} {'median us':>9s} {'total us':>9s}")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"{name:70s} {len(durs):6d} {np.median(durs):9.1f} {sum(durs):9.1f}")


def main() -> int:
    prepare_process()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="nvshmem")
    p.add_argument("--config", default="r1")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--chain", type=int, default=4)
    p.add_argument("--check", action="store_true", help="MoEComm(check_errors=True), the default's deferred check")
    p.add_argument("--all-ranks", action="store_true",
                   help="every rank prints its report (a kernel that waits measures its peer's lateness too)")
    p.add_argument("--host", action="store_true",
                   help="also the host's activity per event name (XLA's thunks, command buffer updates, FFI calls)")
    p.add_argument("--option", dest="options", type=parse_option, action="append", default=[], metavar="NAME=VALUE",
                   help=f"a MoEComm option, repeatable; NAME of {', '.join(OPTION_NAMES)}")
    p.add_argument("--backward", action="store_true",
                   help="the bench's --backward chain: each round trip and its gradient w.r.t. the top-k weights")
    p.add_argument("--overlap", type=int, nargs="?", const=SHARED_EXPERT_FFN, default=None, metavar="FFN",
                   help="the bench's --overlap chain: a shared expert of width FFN between split halves")
    p.add_argument("--overlap-at", choices=OVERLAP_AT, default=OVERLAP_AT[0],
                   help="with --overlap: the halves the shared expert goes between")
    p.add_argument("--compute-alone", action="store_true",
                   help="with --overlap: the shared expert's chain alone (the bench's compute_us), no round trip")
    p.add_argument("--timeline", type=int, default=30, help="device events of the timeline printed (the last ones)")
    args = p.parse_args()
    if args.overlap is not None and args.backward:
        p.error("--overlap traces forward round trips (not --backward)")
    if args.compute_alone and args.overlap is None:
        p.error("--compute-alone goes with --overlap")
    options = dict(args.options)
    initialize_distributed()
    mesh = Mesh(np.array(jax.devices()), (bench.AXIS,))
    cfg = bench.CONFIGS[args.config]
    if args.backend == "nvshmem" or args.backend in bench.PROBES:  # the probes run on a MoEComm too
        reason = bench.start_nvshmem(True, [cfg], [args.tokens], mesh)
        if reason:
            print(f"nvshmem unavailable: {reason}", file=sys.stderr)
            return 1
    n_rows = mesh.size * args.tokens
    x, scales = bench.make_tokens(bench.seeded(1, args.tokens), cfg, n_rows)
    ids, w = bench.make_routing(bench.seeded(2, args.tokens), cfg, n_rows)
    dev = tuple(bench.to_global(a, mesh) for a in (x, scales, ids, w))
    impl = bench.make_impl(args.backend, cfg, args.tokens, mesh, check_errors=args.check, options=options,
                           backward=args.backward)
    if args.compute_alone:
        body = compute_chain(impl, cfg, args.chain, args.overlap)
    elif args.overlap is not None:
        body = overlapped_chain(impl, cfg, args.chain, args.overlap, args.overlap_at)
    else:
        body = (backward_chain if args.backward else bench.round_trip_chain)(impl, cfg, args.chain)
    fn = bench.lower_chain(body, mesh, dev).compile()
    for _ in range(3):
        jax.block_until_ready(fn(*dev))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(3):
                jax.block_until_ready(fn(*dev))
        events = load_trace(log_dir)
    impl.close()
    if jax.process_index() != 0 and not args.all_ranks:
        return 0
    gpu = device_events(events)
    shape = (" backward" if args.backward else f" shared expert {args.overlap} alone" if args.compute_alone
             else f" overlap {args.overlap} at {args.overlap_at}" if args.overlap else "")
    print(f"{args.backend} {args.config} T={args.tokens} chain {args.chain}{shape} "
          f"check={args.check} options={options}: "
          f"{len(events)} trace events, {len(gpu)} on GPU tracks")
    if not gpu:
        names = collections.Counter(e.get("name", "") for e in events if e.get("ph") == "X")
        print("no GPU events (CUPTI missing?); most frequent host events:", names.most_common(15))
        return 0
    # The median, not the mean: the first round trip of each call also waits for the peer's host to launch.
    print_by_name("kernel / activity", gpu, 25)
    if args.host:  # what the host does per call: time spent per event name, over the 3 traced calls
        gpu_ids = {id(e) for e in gpu}
        print_by_name("host event", [e for e in events if e.get("ph") == "X" and "dur" in e and id(e) not in gpu_ids],
                      30)
    # The last chain call: device events in start order, with the gap before each and the stream (track) of each.
    gpu.sort(key=lambda e: e["ts"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    print(f"device span of 3 calls: {span:.1f} us")
    tail = gpu[-min(len(gpu), args.timeline):]
    prev_end = tail[0]["ts"]
    for e in tail:
        start, gap = e["ts"] - tail[0]["ts"], e["ts"] - prev_end
        track = str(e.get("tid", ""))[-6:]
        print(f"  +{start:9.1f}  gap {gap:8.1f}  dur {e['dur']:8.1f}  {track:>6s}  {e['name'][:60]}")
        prev_end = max(prev_end, e["ts"] + e["dur"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

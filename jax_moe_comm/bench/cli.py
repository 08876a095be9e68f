"""python -m jax_moe_comm.bench: its arguments and its run."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jax_moe_comm._cli import prepare_process
from jax_moe_comm.config import Options
from jax_moe_comm.launch import initialize_distributed

from .configs import (
    AXIS,
    CONFIGS,
    DEFAULT_TOKENS,
    QUICK,
    QUICK_CONFIGS,
    expected_round_trip,
    make_routing,
    make_tokens,
    seeded,
)
from .impls import ALL_BACKENDS, PROBES, QUANTIZE, UNCHECKED
from .measure import Progress, Row, available_backends, bench_backend, start_nvshmem, to_global
from .record import command_line, format_table, git_commit, plot_record

SHARED_EXPERT_FFN = 2048  # DeepSeek-R1's shared expert width: --overlap's compute by default
OVERLAP_AT = ("dispatch", "combine")  # --overlap-at: the halves the shared expert goes between
DESCRIPTION = "Dispatch + combine latency: this library's backends against XLA-collective baselines"
# MoEComm's options that --option may set (check_errors has --no-check and the nvshmem_unchecked backend).
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options) if f.name != "check_errors")


def parse_option(text: str) -> tuple[str, object]:
    """NAME=VALUE for a MoEComm option; VALUE a Python literal (1024, 2.5, True)."""
    name, sep, value = text.partition("=")
    if not sep or name not in OPTION_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, NAME of {', '.join(OPTION_NAMES)}; got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a Python literal") from None


SEND_STREAM_NAMES = ("none", "own", "xla_async")  # MoEComm's send_stream values, None written "none"
SEND_STREAM_BACKENDS = ("nvshmem", UNCHECKED, QUANTIZE)  # where send_stream changes anything


def send_streams(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str | None]:
    """The send_stream values each NVSHMEM row of --overlap is timed with ([None] without --overlap, or with
    send_stream among the --option's)."""
    if args.send_streams is not None and args.overlap is None:
        p.error("--send-streams goes with --overlap")
    if args.overlap is None or "send_stream" in args.options:
        return [args.options.get("send_stream")]
    names = [n.strip() for n in (args.send_streams or ",".join(SEND_STREAM_NAMES)).split(",") if n.strip()]
    unknown = [n for n in names if n not in SEND_STREAM_NAMES]
    if unknown or not names:
        p.error(f"--send-streams: unknown {unknown}; choose from {','.join(SEND_STREAM_NAMES)}")
    return [None if n == "none" else n for n in dict.fromkeys(names)]


def with_send_stream(args: argparse.Namespace, name: str, stream: str | None) -> argparse.Namespace:
    """args, with MoEComm(send_stream=stream) for an NVSHMEM backend's row (unchanged for the others)."""
    if name not in SEND_STREAM_BACKENDS or args.options.get("send_stream") == stream:
        return args
    return argparse.Namespace(**{**vars(args), "options": {**args.options, "send_stream": stream}})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None,
                   help=f"comma-separated, of {','.join(ALL_BACKENDS)} (default: every one available here but the "
                        f"probes, {' and '.join(PROBES)}, {UNCHECKED} and {QUANTIZE})")
    p.add_argument("--configs", default="r1,v2lite", help="comma-separated, of r1,v2lite (default both)")
    p.add_argument("--tokens", default=None,
                   help=f"tokens per rank, comma-separated (default {','.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--chain", type=int, default=None, help="round trips in the timed chain, >= 2 (default 20)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, each with a fresh routing (default 5)")
    p.add_argument("--seed", type=int, default=None, help="routing seed (default: random, shared by all processes)")
    p.add_argument("--no-halves", dest="halves", action="store_false",
                   help="skip timing dispatch and combine on their own (faster)")
    p.add_argument("--no-check", dest="check_errors", action="store_false",
                   help="MoEComm(check_errors=False) on every MoEComm backend (nvshmem_unchecked: beside nvshmem)")
    p.add_argument("--option", dest="options", type=parse_option, action="append", default=[], metavar="NAME=VALUE",
                   help=f"a MoEComm option for the MoEComm backends, repeatable; NAME of {', '.join(OPTION_NAMES)}")
    p.add_argument("--weights-to", choices=("combine", "dispatch"), default="combine",
                   help="where the MoEComm backends get the top-k weights (default combine; dispatch: they go with "
                        "the tokens' ids, and the NVLink path's pre-reduced combine exchanges none)")
    p.add_argument("--backward", action="store_true",
                   help="time forward and backward round trips: each step of the chain is a round trip and its "
                        "gradient's (jax.grad with respect to the top-k weights); no halves, no probes")
    p.add_argument("--overlap", type=int, nargs="?", const=SHARED_EXPERT_FFN, default=None, metavar="FFN",
                   help="time a round trip with compute between split halves (--overlap-at; a shared expert of "
                        f"width FFN over the tokens, default {SHARED_EXPERT_FFN}: R1's), beside the round trip and "
                        "the compute alone; hidden_us is what the overlap saved. MoEComm backends; no halves")
    p.add_argument("--overlap-at", choices=OVERLAP_AT, default=OVERLAP_AT[0],
                   help="with --overlap: the split halves the shared expert goes between (MoEComm.between): the "
                        "dispatch's (default) or the combine's")
    p.add_argument("--send-streams", default=None, metavar="LIST",
                   help="with --overlap: MoEComm(send_stream=...) values timed side by side on the NVSHMEM backends, "
                        f"comma-separated, of {','.join(SEND_STREAM_NAMES)} (default all: none is XLA's stream, "
                        "today's); rows name theirs as backend/mode")
    p.add_argument("--json", default=None, help="write the record (see benchmarks/README.md) to this path")
    p.add_argument("--plot", default=None, help="write a PNG: latency vs tokens per backend, log-log")
    p.add_argument("--quick", action="store_true",
                   help="tiny hidden sizes and expert counts, 8 tokens, chain 2, 2 repeats (CPU tests)")
    args = p.parse_args(argv)
    args.options = dict(args.options)
    quick = QUICK if args.quick else {}
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(quick.get("tokens", DEFAULT_TOKENS))
    args.chain = args.chain if args.chain is not None else quick.get("chain", 20)
    args.repeats = args.repeats if args.repeats is not None else quick.get("repeats", 5)
    table = QUICK_CONFIGS if args.quick else CONFIGS
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in table]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")
    args.config_list = [table[c] for c in names]
    if args.backends is not None:
        args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in args.backends if b not in ALL_BACKENDS]
        if unknown:
            p.error(f"unknown backend(s) {unknown}; choose from {list(ALL_BACKENDS)}")
    if args.chain < 2:
        p.error("--chain must be >= 2")
    if args.overlap is not None and (args.overlap < 1 or args.backward):
        p.error("--overlap takes a positive shared-expert width and times forward round trips (not --backward)")
    args.send_streams = send_streams(p, args)
    if args.repeats < 1 or any(t < 1 for t in args.tokens):
        p.error("--repeats and --tokens must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    initialize_distributed()  # (0, 1) and nothing to do without the launcher
    leader = jax.process_index() == 0
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    world = mesh.size

    wants_nvshmem = args.backends is None or bool({"nvshmem", UNCHECKED, QUANTIZE, *PROBES} & set(args.backends))
    nvshmem_reason = start_nvshmem(wants_nvshmem, args.config_list, args.tokens, mesh)
    available, why_not = available_backends(mesh, nvshmem_reason)
    # The probes only when named: they are not round trips.
    backends = args.backends if args.backends is not None else [b for b in available
                                                                 if b not in (*PROBES, UNCHECKED, QUANTIZE)]
    # The reference backend first: the others are checked against its result.
    backends = sorted(backends, key=lambda b: b != "reference")
    if leader:
        for b, why in why_not.items():
            if why != "not requested":
                print(f"backend {b} unavailable: {why}", file=sys.stderr)

    seed = args.seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))
        if jax.process_count() > 1:
            seed = int(multihost_utils.broadcast_one_to_all(np.int32(seed)))

    device = jax.devices()[0]
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": f"{len(jax.devices())}x {device.device_kind if device.platform != 'cpu' else 'cpu'}",
        "world": world,
        "processes": jax.process_count(),
        "command": command_line(argv),
        "jax": jax.__version__,
        "chain": args.chain,
        "repeats": args.repeats,
        "check_errors": args.check_errors,
        "weights_to": args.weights_to,
        "backward": args.backward,
        "overlap": args.overlap,
        "overlap_at": args.overlap_at if args.overlap else None,
        "options": args.options,
        "seed": seed,
        "configs": {c.name: c.describe() for c in args.config_list},
        "complete": False,
        "rows": [],
    }

    def write_json() -> None:  # after every size too, so that an interrupted run keeps what it measured
        if leader and args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")

    def streams_of(name: str) -> list[str | None]:  # --overlap: the send streams this backend's rows are timed with
        return args.send_streams if name in SEND_STREAM_BACKENDS else [args.options.get("send_stream")]

    progress = Progress(len(args.config_list) * len(args.tokens) * sum(len(streams_of(b)) for b in backends), leader)
    for ci, cfg in enumerate(args.config_list):
        for tokens in args.tokens:
            n_rows = world * tokens
            x_host, scales_host = make_tokens(seeded(seed, ci, tokens), cfg, n_rows)
            cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

            def routing(r, cfg=cfg, ci=ci, tokens=tokens, n_rows=n_rows, cache=cache):
                if r not in cache:
                    cache[r] = make_routing(seeded(seed, ci, tokens, r + 1), cfg, n_rows)
                return cache[r]

            inputs = {"x": to_global(x_host, mesh), "scales": to_global(scales_host, mesh), "routing": routing}
            ids0, w0 = routing(0)
            expected = {"numpy": expected_round_trip(cfg, x_host, scales_host, ids0, w0)}
            for name in backends:
                if name in why_not:
                    rows = [Row(name, cfg.name, tokens, error=f"unavailable: {why_not[name]}")]
                elif cfg.experts % world:
                    why = f"{cfg.experts} experts do not divide over {world} ranks"
                    rows = [Row(name, cfg.name, tokens, error=why)]
                else:
                    rows = [bench_backend(name, cfg, tokens, mesh, inputs, with_send_stream(args, name, stream),
                                          expected) for stream in streams_of(name)]
                for row, stream in zip(rows, streams_of(name) if len(rows) > 1 else [None], strict=True):
                    row.send_stream = None if len(rows) == 1 else stream or "none"
                    record["rows"].append(row.record())
                    progress.step(f"{cfg.name} tokens={tokens} {row.backend}"
                                  + (f"/{row.send_stream}" if row.send_stream else "") + ": "
                                  + (f"{row.total_us:.1f} us" if row.total_us is not None else "error"))
            del inputs, expected
            write_json()
    progress.close()

    record["complete"] = True
    write_json()
    if leader:
        print(f"jax_moe_comm bench: {record['device']}, world {world}, {jax.process_count()} process(es), "
              f"jax {jax.__version__}, chain {args.chain}, repeats {args.repeats}, seed {seed}"
              + (", forward + backward round trips" if args.backward else "")
              + (f", a shared expert of width {args.overlap} between the {args.overlap_at}'s halves" if args.overlap
                 else ""))
        print(format_table(record["rows"]))
        if args.json:
            print(f"wrote {args.json}")
        if args.plot and plot_record(record, args.plot):
            print(f"wrote {args.plot}")
    return 0

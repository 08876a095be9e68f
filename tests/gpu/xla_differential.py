"""The differential tester (tests/differential.py) on the NVSHMEM backend through XLA: one process per GPU, or
several processes sharing one GPU, for correctness alone. Sharing needs `--patterns one` (a single round trip,
checked against the oracle through the key-value store, jax_moe_comm.launch.host_gather: the call patterns' reference
backend runs XLA collectives, which NCCL refuses between processes on one GPU) and XLA:GPU's autotuning kept per
process (shared through the distributed store, both processes' first compile was still waiting after 110 s on an
H200).

    python -m jax_moe_comm.launch -n 1 -- tests/gpu/xla_differential.py --setups 50 --runs 4 [--seed S] [--regressions]
    python -m jax_moe_comm.launch -n 1 -- tests/gpu/xla_differential.py --replay '<a draw's JSON>'
    python -m jax_moe_comm.launch -n 1 -- tests/gpu/xla_differential.py --replay-file draws.jsonl
    python -m jax_moe_comm.launch -n 2 --cpu -- tests/gpu/xla_differential.py --backend reference ...   # CPU
    CUDA_VISIBLE_DEVICES=0,0 NVSHMEM_DISABLE_NCCL=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
      XLA_FLAGS=--xla_gpu_shard_autotuning=false python -m jax_moe_comm.launch -n 2 -- \
      tests/gpu/xla_differential.py --patterns one --small --symmetric-size 2G ...        # 2 processes, one GPU

Draws `setups` Setups (config, options, call pattern) with `runs` inputs each; each Setup is compiled once for its
runs (with several processes, a single round trip's Setup is compiled on every process before its runs meet at a
barrier: differential.compile_ahead). Every run is compared with the oracle (one round trip) or the reference backend
with plain AD (the patterns).
Prints a line per failure with the command that replays it, then "differential: N draws, F failures".
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
import traceback

sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: differential, oracle

import differential  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402  (the key-value store's client: a barrier between the processes)
from jax.sharding import Mesh  # noqa: E402

import jax_moe_comm as jmc  # noqa: E402
from jax_moe_comm.launch import from_process_0, initialize_distributed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", type=int, default=50)
    parser.add_argument("--runs", type=int, default=4, help="inputs per Setup (one compilation)")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("JMC_SEED", time.time_ns() % 2**31)),
                        help="the draws' seed (several processes: process 0's, so that every process draws alike)")
    parser.add_argument("--replay", default="", metavar="JSON", help="one draw, as a failure printed it")
    parser.add_argument("--replay-file", default="", metavar="PATH",
                        help="draws to replay, one JSON per line ('#' lines skipped), each its own Setup")
    parser.add_argument("--regressions", action="store_true",
                        help="first the named draws of earlier failures (differential.REGRESSIONS), at world 1")
    parser.add_argument("--small", action="store_true", help="rows of at most 256 elements, at most 65 tokens")
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"),
                        help="the backend under test (reference: its custom VJP, on any platform)")
    parser.add_argument("--patterns", default=",".join(differential.PATTERNS),
                        help="the call patterns drawn, comma-separated (processes sharing one GPU: one)")
    parser.add_argument("--symmetric-size", default="8G", help="jax_moe_comm.initialize's symmetric heap per process")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds after which no further Setup starts (0: none); the summary counts what ran")
    parser.add_argument("--setup-limit", type=float, default=240.0,
                        help="seconds after which a Setup that has not finished dumps every stack and ends the rank")
    args = parser.parse_args()
    faulthandler.enable()  # a crash prints every thread's stack
    initialize_distributed()
    # A rank stopped from outside (the launcher passing on a timeout's SIGTERM) prints every thread's stack too, then
    # runs the handler it replaces (the distributed runtime's, installed by initialize_distributed).
    faulthandler.register(signal.SIGTERM, chain=True)
    if args.backend == "nvshmem":
        jmc.initialize(symmetric_size=args.symmetric_size)
    world = jax.process_count()
    args.seed = from_process_0("xla_differential_seed", lambda: args.seed)  # each process's clock differs
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    if args.replay or args.replay_file:
        lines = [args.replay] if args.replay else open(args.replay_file).read().splitlines()
        groups = [[differential.Draw.from_json(line)] for line in lines if line.strip() and not line.startswith("#")]
    else:
        patterns = tuple(args.patterns.split(","))
        unknown = set(patterns) - set(differential.PATTERNS)
        if unknown:
            parser.error(f"--patterns: unknown {sorted(unknown)}; choose from {', '.join(differential.PATTERNS)}")
        groups = differential.sample(world, args.setups, args.runs, args.seed, patterns, small=args.small)
    if args.regressions and world == 1:
        named = [differential.Draw.from_json(text) for text in differential.REGRESSIONS.values()]
        groups = [[draw] for draw in named] + groups
    draws = failures = 0
    t_start = time.time()
    for group in groups:
        if args.time_limit and time.time() - t_start > args.time_limit and world == 1:  # ranks decide alike only alone
            print(f"time limit: {len(groups) - groups.index(group)} setups not run", flush=True)
            break
        setup = group[0].setup
        if jax.process_index() == 0:  # before it runs: a crash names the draw
            print(f"running {group[0].to_json()}", flush=True)
        faulthandler.dump_traceback_later(args.setup_limit, exit=True)
        t0 = time.time()
        try:
            compiled = differential.compile_setup(setup, mesh, args.backend)
            if world > 1:  # every process compiled before any calls: see differential.compile_ahead
                differential.compile_ahead(compiled, group[0].inputs)
                distributed.global_state.client.wait_at_barrier(f"jmc_differential_{groups.index(group)}", 600_000)
        except Exception as exc:  # a Setup that does not build fails all its runs
            traceback.print_exc()
            compiled, problems = None, [f"building: {type(exc).__name__}: {str(exc)[:300]}"] * len(group)
        if compiled is not None:
            problems = []
            for draw in group:
                try:
                    problems.append(differential.run_inputs(compiled, draw.inputs))
                except Exception as exc:
                    traceback.print_exc()
                    problems.append(f"{type(exc).__name__}: {str(exc)[-300:]}")
            compiled.close()
        faulthandler.cancel_dump_traceback_later()
        for draw, problem in zip(group, problems, strict=True):
            draws, failures = draws + 1, failures + (problem is not None)
            if problem is not None and jax.process_index() == 0:
                print(f"FAIL {problem}\n  replay: python -m jax_moe_comm.launch -n {world} -- "
                      f"tests/gpu/xla_differential.py --backend {args.backend} --replay '{draw.to_json()}'", flush=True)
        if jax.process_index() == 0:
            print(f"setup {setup.pattern} {setup.payload} E{setup.E} K{setup.K} H{setup.H} T{setup.T} "
                  f"{dict(setup.options)} {setup.weights_at} ({time.time() - t0:.1f}s): "
                  f"{sum(p is not None for p in problems)} of {len(group)} failed", flush=True)
    if jax.process_index() == 0:
        print(f"differential: {draws} draws, {failures} failures (world {world}, seed {args.seed}, "
              f"{time.time() - t_start:.0f}s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    if jax.process_count() > 1:
        # Process 0 hosts the key-value store: leaving before the others have left it kills their last calls
        # (a fatal "Socket closed" in the other process). The shutdown waits for every process.
        jax.distributed.shutdown()
    os._exit(code)  # skip interpreter teardown (NVSHMEM and the runtime's tokens after failed draws)

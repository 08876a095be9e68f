"""The differential tester (tests/differential.py) on the NVSHMEM backend through XLA, one process per GPU (or
several processes sharing one: the checking code issues no XLA collective, see jax_moe_comm.launch.host_gather).

    python -m jax_moe_comm.launch -n 1 -- tests/gpu/xla_differential.py --setups 50 --runs 4 [--seed S] [--regressions]
    python -m jax_moe_comm.launch -n 1 -- tests/gpu/xla_differential.py --replay '<a draw's JSON>'
    python -m jax_moe_comm.launch -n 2 --cpu -- tests/gpu/xla_differential.py --backend reference ...   # CPU

Draws `setups` Setups (config, options, call pattern) with `runs` inputs each; each Setup is compiled once for its
runs. Every run is compared with the oracle (one round trip) or the reference backend with plain AD (the patterns).
Prints a line per failure with the command that replays it, then "differential: N draws, F failures".
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import traceback

sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: differential, oracle

import differential  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_moe_comm as jmc  # noqa: E402
from jax_moe_comm.launch import initialize_distributed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", type=int, default=50)
    parser.add_argument("--runs", type=int, default=4, help="inputs per Setup (one compilation)")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("JMC_SEED", time.time_ns() % 2**31)))
    parser.add_argument("--replay", default="", metavar="JSON", help="one draw, as a failure printed it")
    parser.add_argument("--regressions", action="store_true",
                        help="first the named draws of earlier failures (differential.REGRESSIONS), at world 1")
    parser.add_argument("--small", action="store_true", help="rows of at most 256 elements, at most 65 tokens")
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"),
                        help="the backend under test (reference: its custom VJP, on any platform)")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds after which no further Setup starts (0: none); the summary counts what ran")
    parser.add_argument("--setup-limit", type=float, default=240.0,
                        help="seconds after which a Setup that has not finished dumps every stack and ends the rank")
    args = parser.parse_args()
    faulthandler.enable()  # a crash prints every thread's stack
    initialize_distributed()
    if args.backend == "nvshmem":
        jmc.initialize(symmetric_size="8G")
    world = jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    if args.replay:
        groups = [[differential.Draw.from_json(args.replay)]]
    else:
        groups = differential.sample(world, args.setups, args.runs, args.seed, small=args.small)
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
    os._exit(code)  # skip interpreter teardown (NVSHMEM and the runtime's tokens after failed draws)

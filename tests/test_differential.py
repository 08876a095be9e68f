"""The differential tester's CPU sample (tests/differential.py): the reference backend with the custom VJP (the
rules the NVSHMEM backend differentiates with) against the NumPy oracle and plain AD, over generated Setups: every
option with every other and every call pattern, at 1, 2, 4 and 8 ranks.

The sample is seeded (the same draws every run; MOE_DIFFERENTIAL_SEED draws others). A failure prints the draw and
the command that replays it. The NVSHMEM backend runs the same tester on the GPU (tests/gpu/xla_differential.py, and
kernel_harness.py --differential).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import differential
import jax
import numpy as np
import pytest
from conftest import standalone_cpu_env
from jax.sharding import Mesh

SEED = int(os.environ.get("MOE_DIFFERENTIAL_SEED", 20261202))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_a_seeded_sample_of_the_option_space_agrees_with_the_oracle_and_plain_ad(world):
    mesh = Mesh(np.array(jax.devices()[:world]), ("ep",))
    failures = []
    for group in differential.sample(world, setups_wanted=5, runs_per_setup=2, seed=SEED + world, small=True):
        compiled = differential.compile_setup(group[0].setup, mesh, "reference")
        for draw in group:
            problem = differential.run_inputs(compiled, draw.inputs)
            if problem is not None:
                failures.append(f"{problem}\n  replay: {sys.executable} tests/differential.py '{draw.to_json()}'")
        compiled.close()
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("seed", [["--seed", str(SEED)], []], ids=["seeded", "each process's clock"])
def test_a_sample_across_two_processes_gathers_without_collectives_and_agrees(seed):
    """The GPU runner itself (tests/gpu/xla_differential.py) on two CPU processes under the launcher, the reference
    backend under test: global arrays built from each process's host data, results gathered through the
    jax.distributed key-value store (jax_moe_comm.launch.host_gather: no XLA collective, which processes sharing
    one GPU cannot run). Without --seed every process draws process 0's seed (each one's own clock would give the
    processes different programs)."""
    runner = Path(__file__).resolve().parent / "gpu" / "xla_differential.py"
    setups = "3" if seed else "2"
    done = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", "2", "--cpu", "--", str(runner),
                           "--backend", "reference", "--small", "--setups", setups, "--runs", "2", *seed],
                          capture_output=True, text=True, timeout=600, env=standalone_cpu_env())
    output = done.stdout + done.stderr
    assert f"[rank 0] differential: {2 * int(setups)} draws, 0 failures (world 2" in done.stdout, output[-4000:]
    assert done.returncode == 0, output[-4000:]


def test_the_runner_replays_a_file_of_draws_each_as_its_own_setup(tmp_path):
    """--replay-file: one draw's JSON per line, '#' lines and blank lines skipped (a call's list of chosen draws)."""
    draws = [differential.Draw(differential.Setup(1, "bfloat16", "bfloat16", 4, 2, 64, 8), differential.Inputs(1)),
             differential.Draw(differential.Setup(1, "float32", "float32", 8, 3, 32, 5, weights_at="dispatch"),
                               differential.Inputs(2, "dropped", "partial"))]
    listed = tmp_path / "draws.jsonl"
    listed.write_text("# chosen draws\n" + "\n\n".join(draw.to_json() for draw in draws) + "\n")
    runner = Path(__file__).resolve().parent / "gpu" / "xla_differential.py"
    done = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", "1", "--cpu", "--", str(runner),
                           "--backend", "reference", "--replay-file", str(listed)],
                          capture_output=True, text=True, timeout=600, env=standalone_cpu_env())
    output = done.stdout + done.stderr
    assert "[rank 0] differential: 2 draws, 0 failures (world 1" in done.stdout, output[-4000:]
    assert done.stdout.count("[rank 0] setup one ") == 2 and " E8 K3 H32 T5 " in done.stdout, output[-4000:]
    assert done.returncode == 0, output[-4000:]


@pytest.mark.parametrize("name", sorted(differential.REGRESSIONS))
def test_every_named_regression_replays(name):
    """The named draws of earlier GPU failures stay valid draws: each replays on the reference backend (its custom
    VJP against plain AD or the oracle), as the GPU runner replays them on the NVSHMEM backend (--regressions)."""
    draw = differential.Draw.from_json(differential.REGRESSIONS[name])
    assert differential.run_draw(draw, "reference") is None


def test_an_fp8_pattern_moves_by_percents_under_a_last_bit_perturbation():
    """Why fp8 patterns are bounded by their own sensitivity: in the named draw whose experts' gradients differed by
    4-5% on the GPU, the reference itself moves them by more than 2% when every layer's MoE output is multiplied by
    1 + 2**-8 (one bf16 ulp), as fp8 requantization of the next layer's input amplifies it."""
    draw = differential.Draw.from_json(differential.REGRESSIONS["quantize bf16, E1 K1 T1, 3-layer loop: experts' "
                                                                 "gradients"])
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    compiled = differential.compile_setup(draw.setup, mesh, "reference")
    args = differential.pattern_args(mesh, differential.make_arrays(draw.setup, draw.inputs))
    want = compiled.reference_fn(*args)
    moved = dict(zip(sorted(want), differential.relative_errors(compiled.sensitivity_fn(*args), want), strict=True))
    compiled.close()
    assert moved["experts"] > 2e-2, moved

"""The NVSHMEM backend against the reference backend on 2 GPUs (skipped without them).

The cases live in nvshmem_cases.py, which needs one process per GPU; this test runs it through the launcher.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_moe_comm as jmc


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


pytestmark = [
    pytest.mark.skipif(not jmc.build_info()["cuda"], reason="built without the CUDA extension"),
    pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (runs on the GPU machine: tests/gpu/run.sh)"),
]


def test_nvshmem_matches_reference_on_two_gpus():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    cases = Path(__file__).with_name("nvshmem_cases.py")
    proc = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", "2", "--", str(cases)],
                          capture_output=True, text=True, timeout=900, env=env)
    print(proc.stdout[-20000:])
    print(proc.stderr[-20000:], file=sys.stderr)
    assert proc.returncode == 0, "some NVSHMEM cases failed (see output)"
    assert " 0 failed" in proc.stdout

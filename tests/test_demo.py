"""End-to-end runs of ``python -m jax_moe_comm.demo`` on the CPU platform, as real subprocesses.

The demo forces its own 8 host devices when started without the launcher, so the subprocess gets an environment
without conftest's XLA_FLAGS and without any outer launcher's JAX_* wiring.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import CHILD_CWD, standalone_cpu_env

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60
SMALL = ["--tokens", "8", "--hidden", "64", "--experts", "16", "--topk", "2", "--iters", "2"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=standalone_cpu_env(), cwd=CHILD_CWD, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _check_passed(r: subprocess.CompletedProcess[str], world: int) -> None:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FAIL" not in r.stdout, r.stdout
    assert "reference" in r.stdout, r.stdout
    assert f"{world} ranks" in r.stdout, r.stdout


def test_demo_float32_on_8_cpu_devices() -> None:
    r = _run("-m", "jax_moe_comm.demo", *SMALL)
    _check_passed(r, world=8)
    assert "float32" in r.stdout


def test_demo_bfloat16_on_8_cpu_devices() -> None:
    r = _run("-m", "jax_moe_comm.demo", *SMALL, "--dtype", "bfloat16")
    _check_passed(r, world=8)
    assert "bfloat16" in r.stdout


def test_demo_through_the_launcher_two_cpu_processes() -> None:
    """Two processes (one CPU device each): global inputs, cross-process gather, only rank 0 prints."""
    r = _run("-m", "jax_moe_comm.launch", "-n", "2", "--cpu", "--", "-m", "jax_moe_comm.demo", *SMALL)
    _check_passed(r, world=2)
    # Rank 1 prints nothing of the summary (gloo's own connection line may still appear).
    summary = [line for line in r.stdout.splitlines() if any(key in line for key in ("demo:", "backend", "PASS"))]
    assert len(summary) == 3 and all(line.startswith("[rank 0] ") for line in summary), r.stdout


# What the distributed runtime prints when a process leaves the job out of order (gRPC calls to a coordinator that has
# gone, watches cancelled under a live client); a job that succeeded should end without any of them.
UNCLEAN_EXIT = ("WatchTasksAsync", "Connection refused", "CANCELLED", "UNAVAILABLE", "Failed to disconnect")


def test_a_successful_launch_exits_quietly() -> None:
    """The demo in two processes succeeds and its stderr holds no distributed-runtime warning (the failure tests in
    test_launch.py check that a failed job still names the rank and its status)."""
    r = _run("-m", "jax_moe_comm.launch", "-n", "2", "--cpu", "--", "-m", "jax_moe_comm.demo", *SMALL)
    _check_passed(r, world=2)
    assert [line for line in r.stderr.splitlines() if any(word in line for word in UNCLEAN_EXIT)] == [], r.stderr

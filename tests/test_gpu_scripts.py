"""The GPU scripts' own helpers, run here on the reference backend: a helper broken on the CPU would fail every GPU
case at once, on a machine whose time is scarce."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import ep_mesh

import jax_moe_comm as jmc

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import nvshmem_cases  # noqa: E402


def test_make_comm_gives_the_running_cases_options():
    cfg = jmc.MoECommConfig(8, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = nvshmem_cases.make_comm(cfg, ep_mesh(2), "reference", timeout_s=3.0)
    assert isinstance(comm, jmc.MoEComm) and comm.world == 2 and comm.timeout_s == 3.0
    nvshmem_cases.OPTIONS.update(staged=True)
    try:
        assert nvshmem_cases.make_comm(cfg, ep_mesh(2), "reference").options.staged
    finally:
        nvshmem_cases.OPTIONS.clear()


@pytest.mark.parametrize("probe", ["first_pass_probe.cu", "copy_floor_probe.cu"])
def test_the_standalone_probes_compile_for_the_gpu_machine(probe, tmp_path):
    """run.sh builds these with nvcc on the GPU machine (PROBE=1, COPY_PROBE=1); the same command here."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    source = Path(__file__).parent / "gpu" / probe
    built = subprocess.run([nvcc, "-O3", "-arch=sm_90", "-std=c++17", "-o", str(tmp_path / "probe"), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    assert (tmp_path / "probe").stat().st_size > 0

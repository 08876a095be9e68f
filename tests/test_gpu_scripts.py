"""The GPU scripts' own helpers, run here on the reference backend: a helper broken on the CPU would fail every GPU
case at once, on a machine whose time is scarce."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh

import jax_moe_comm as jmc

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import nvshmem_cases  # noqa: E402
from kernel_marks import format_rates, gb_per_s_per_sm, row_bytes_by_phase  # noqa: E402


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


def test_the_marks_count_each_phases_row_bytes_from_the_routing():
    """World 2, 4 experts (rank 0: 0 and 1, rank 1: 2 and 3), two tokens per rank, K 2, rows of 10 bytes out and 100
    back. Rank 0 receives tokens 0, 1 and 3 (4 slots); its own tokens' experts sit on rank 0 (token 0) and on both
    ranks (token 1)."""
    ids = np.array([[0, 1], [0, 2], [3, 2], [1, -1]])
    rank0 = row_bytes_by_phase(ids, 2, 0, 4, 10, 100, prereduce=True)
    assert rank0 == {"dispatch": (3 + 4) * 10, "combine_send": (4 + 3) * 100, "combine_recv": (3 + 2) * 100}
    slots = row_bytes_by_phase(ids, 2, 0, 4, 10, 100, prereduce=False)
    assert slots == {"dispatch": 70, "combine_send": (4 + 4) * 100, "combine_recv": (4 + 2) * 100}
    rank1 = row_bytes_by_phase(ids, 2, 1, 4, 10, 100, prereduce=True)
    assert rank1 == {"dispatch": (2 + 3) * 10, "combine_send": (3 + 2) * 100, "combine_recv": (2 + 2) * 100}
    assert gb_per_s_per_sm(264_000_000, 100.0, 132) == pytest.approx(20.0)
    assert np.isnan(gb_per_s_per_sm(1, 0.0, 132))


def test_the_marks_print_each_phases_rows_per_sm_over_its_median_span():
    """Three trips' marks (ns): the dispatch from dispatch_send's start to dispatch_recv's end, each combine phase
    from its own start to its end; 264 MB over 100 µs on 132 SMs is 20 GB/s per SM."""
    marks = np.zeros((3, 4, 8), np.int64)
    for trip, extra in enumerate((0, 1_000, 50_000)):  # the median drops the slow trip
        marks[trip, 0, 0], marks[trip, 1, 5] = 0, 100_000 + extra
        marks[trip, 2, 0], marks[trip, 2, 5] = 200_000, 400_000 + extra
        marks[trip, 3, 0], marks[trip, 3, 5] = 500_000, 550_000 + extra
    moved = {"dispatch": 264_000_000, "combine_send": 264_000_000, "combine_recv": 66_000_000}
    line = format_rates(marks, moved, 132)
    assert line.startswith("rows' GB/s per SM (132 SMs): ")
    assert "dispatch 264.0 MB in 101.0 us = 19.80" in line
    assert "combine_send 264.0 MB in 201.0 us = 9.95" in line
    assert "combine_recv 66.0 MB in 51.0 us = 9.80" in line

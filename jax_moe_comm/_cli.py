"""Process set-up shared by the package's command-line tools (demo, bench, examples.train)."""

from __future__ import annotations

import os


def prepare_process(cpu_devices: int = 8) -> None:
    """Call first in a tool's main(), before anything asks JAX for devices (XLA reads these variables when it
    creates its backends, not when jax is imported).

    Standalone on a CPU-only machine: simulate `cpu_devices` devices, so the tool runs the way it would on that
    many accelerators. Under ``jax_moe_comm.launch``: leave room outside XLA's preallocated pool (75% of the GPU
    by default) for NVSHMEM's symmetric heap.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    launched = "JAX_PROCESS_ID" in os.environ
    if (os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu") and not launched
            and "xla_force_host_platform_device_count" not in flags):
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    if launched:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

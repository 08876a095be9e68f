"""Finds the CUDA extension (NVSHMEM host API + kernels) and picks a backend.

The extension is optional: a build without nvcc or without the NVSHMEM headers installs a pure-Python
package, and asking for ``backend="nvshmem"`` then raises an error that says why.
"""

from __future__ import annotations

import importlib.util

from jax.sharding import Mesh

try:
    from . import _nvshmem_ext as ext  # built by CMake when nvcc and NVSHMEM are found
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # CPU-only build, or the NVSHMEM host library cannot be loaded
    ext = None
    _built = importlib.util.find_spec(f"{__package__}._nvshmem_ext") is not None
    IMPORT_ERROR = str(exc) if _built else "the CUDA extension was not built (CPU-only install)"


def build_info() -> dict:
    """What this install was built with: {'cuda': bool, ...}; the extension adds NVSHMEM/CUDA versions."""
    if ext is None:
        return {"cuda": False, "reason": IMPORT_ERROR}
    return {"cuda": True, **ext.build_info()}


def unavailable_reason_text() -> str:
    return ("jax_moe_comm was built without its CUDA extension (no nvcc or no nvidia-nvshmem headers at build "
            f"time; import error: {IMPORT_ERROR}). Reinstall with the [cuda13] or [cuda12] extra (see README).")


def unavailable_reason(mesh: Mesh) -> str | None:
    """Why the NVSHMEM backend cannot serve `mesh`, or None when it can."""
    from . import runtime

    if ext is None:
        return unavailable_reason_text()
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"gpu"}:
        return f"the NVSHMEM backend needs a mesh of CUDA GPUs, got platforms {sorted(platforms)}"
    if runtime.current() is None:
        return "NVSHMEM is not initialized on this process; call jax_moe_comm.initialize() first"
    return None


def resolve_backend(backend: str, mesh: Mesh) -> str:
    if backend == "reference":
        return "reference"
    reason = unavailable_reason(mesh)
    if reason is None:
        return "nvshmem"
    if backend == "nvshmem":
        raise RuntimeError(f"backend='nvshmem' is not available: {reason}")
    return "reference"

"""Finds the CUDA extension (NVSHMEM host API + kernels).

The extension is optional: a build without nvcc or without the NVSHMEM headers installs a pure-Python
package, and asking for ``backend="nvshmem"`` then raises an error that says why (runtime.resolve_backend).
"""

from __future__ import annotations

import importlib.util

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


def measurement_build() -> bool:
    """Whether the extension is the measurement build (kernel marks, the bench's floor probes)."""
    return ext is not None and bool(ext.measurement_build())


def unavailable_reason_text() -> str:
    return ("jax_moe_comm was built without its CUDA extension (no nvcc or no nvidia-nvshmem headers at build "
            f"time; import error: {IMPORT_ERROR}). Reinstall with the [cuda13] or [cuda12] extra (see README).")

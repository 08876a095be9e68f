"""Finds the CUDA extension (NVSHMEM host API + kernels) and the status module (the status check's CPU handler).

The extension is optional: a build without nvcc or without the NVSHMEM headers installs a pure-Python
package, and asking for ``backend="nvshmem"`` then raises an error that says why (runtime.resolve_backend).
"""

from __future__ import annotations

import importlib.util


def _missing_library_text(exc: ImportError) -> str:
    """The import error of a built extension, with what to install when it is NVSHMEM's host library (not bundled:
    it comes from the nvidia-nvshmem wheel of the extension's CUDA major, found in the same site-packages)."""
    if "libnvshmem_host" not in str(exc):
        return str(exc)
    try:
        from . import _build_config as built
    except ImportError:  # a build older than that file
        return f"{exc}; install the nvidia-nvshmem-cu12 or -cu13 wheel of this build's CUDA major"
    return (f"{exc}: NVSHMEM's host library is missing. This extension was built for CUDA {built.CUDA_MAJOR} with "
            f"NVSHMEM {built.NVSHMEM_VERSION}; install it with pip install \"{built.NVSHMEM_WHEEL}>="
            f"{built.NVSHMEM_VERSION},<{int(built.NVSHMEM_VERSION.split('.')[0]) + 1}\" (or the package's "
            f"[cuda{built.CUDA_MAJOR}] extra) into the environment that holds jax_moe_comm")


try:
    from . import _nvshmem_ext as ext  # built by CMake when nvcc and NVSHMEM are found
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # CPU-only build, or the NVSHMEM host library cannot be loaded
    ext = None
    _built = importlib.util.find_spec(f"{__package__}._nvshmem_ext") is not None
    IMPORT_ERROR = _missing_library_text(exc) if _built else "the CUDA extension was not built (CPU-only install)"


try:
    from . import _status_ext as status_ext  # the status check's CPU handler (plain C++, built beside or without ext)
except ImportError:  # a build without nanobind or jax at build time
    status_ext = None


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

"""NVSHMEM bootstrap for the NVSHMEM backend: one process per GPU, wired by ``jax.distributed``.

    jax.distributed.initialize(...)      # or jax_moe_comm.launch, which does it
    jax_moe_comm.initialize()            # NVSHMEM on every process; idempotent
    ...
    jax_moe_comm.finalize()              # at exit (also registered with atexit)

Rank 0 creates the NVSHMEM unique id; it travels through the jax.distributed key-value store. The host library is
initialized by nvshmem4py when it is installed, else by the extension itself; either way the extension then
attaches its own device state (each separately device-linked library has its own copy of it).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

from . import _native

_UID_KEY = "jax_moe_comm/nvshmem_unique_id"
# NVLink multicast is never used by this library; keep NVSHMEM from setting it up.
_SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What initialize() set up on this process."""

    rank: int
    world: int
    device: jax.Device
    bootstrap: str  # "nvshmem4py" or "extension"


_runtime: Runtime | None = None  # NVSHMEM is process-wide state; this records it


def _ext():
    if _native.ext is None:
        raise RuntimeError(_native.unavailable_reason_text())
    return _native.ext


def _share_unique_id(rank: int, world: int, timeout_s: float) -> bytes:
    ext = _ext()
    if world == 1:
        return ext.unique_id()
    from jax._src import distributed  # the key-value store of jax.distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax_moe_comm.initialize() needs jax.distributed.initialize() first (or run the script "
                           "through python -m jax_moe_comm.launch)")
    if rank == 0:
        client.key_value_set(_UID_KEY, ext.unique_id().hex())
    return bytes.fromhex(client.blocking_key_value_get(_UID_KEY, int(timeout_s * 1000)))


def _init_with_nvshmem4py(uid: bytes, rank: int, world: int, ordinal: int) -> bool:
    """Initializes the host library through nvshmem4py; False when nvshmem4py is not installed."""
    try:
        import nvshmem.core as nvshmem_core
        from cuda.core import Device
    except ImportError:
        return False
    device = Device(ordinal)
    device.set_current()
    unique_id = nvshmem_core.get_unique_id(empty=True)
    np.asarray(unique_id._data).view(np.uint8)[:] = np.frombuffer(uid, np.uint8)
    nvshmem_core.init(device=device, uid=unique_id, rank=rank, nranks=world, initializer_method="uid")
    return True


BOOTSTRAPS = ("auto", "nvshmem4py", "extension")


def initialize(symmetric_size: int | str | None = None, timeout_s: float = 120.0, bootstrap: str = "auto") -> Runtime:
    """Initializes NVSHMEM on this process (idempotent). Call after ``jax.distributed.initialize()``.

    Args:
      symmetric_size: NVSHMEM symmetric heap per GPU (bytes, or a string such as "4G"); sets
        ``NVSHMEM_SYMMETRIC_SIZE`` unless that is already set. It must hold ``comm.symmetric_bytes`` of every
        MoEComm; it lives outside XLA's preallocated pool (see ``XLA_PYTHON_CLIENT_MEM_FRACTION``).
      timeout_s: how long ranks wait for rank 0's unique id.
      bootstrap: who initializes NVSHMEM's host library: "nvshmem4py", "extension" (this package's own init), or
        "auto" (default: nvshmem4py when installed, else the extension). The extension attaches its own device
        state either way.
    """
    global _runtime
    if bootstrap not in BOOTSTRAPS:
        raise ValueError(f"bootstrap must be one of {BOOTSTRAPS}, got {bootstrap!r}")
    if _runtime is not None:
        return _runtime
    ext = _ext()
    local = jax.local_devices()
    if len(local) != 1 or local[0].platform != "gpu":
        raise RuntimeError(f"the NVSHMEM backend needs exactly one GPU per process, this process has {local}; "
                           "start one process per GPU (python -m jax_moe_comm.launch -n N -- script.py)")
    for key, value in _SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if symmetric_size is not None:
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(symmetric_size))
    rank, world = jax.process_index(), jax.process_count()
    ordinal = local[0].local_hardware_id
    uid = _share_unique_id(rank, world, timeout_s)
    if bootstrap == "nvshmem4py" and not _init_with_nvshmem4py(uid, rank, world, ordinal):
        raise RuntimeError("bootstrap='nvshmem4py' but nvshmem4py (nvshmem.core and cuda.core) is not installed")
    if bootstrap == "auto":
        bootstrap = "nvshmem4py" if _init_with_nvshmem4py(uid, rank, world, ordinal) else "extension"
    status = ext.init(uid, rank, world, ordinal)  # initializes, or attaches after nvshmem4py
    if status != 0 or ext.my_pe() != rank or ext.n_pes() != world:
        raise RuntimeError(f"NVSHMEM init failed on rank {rank}: status {status}, pe {ext.my_pe()}/{ext.n_pes()}")
    built = tuple(int(v) for v in ext.build_info()["nvshmem"].split("."))
    loaded = tuple(ext.host_version())
    if loaded[0] != built[0] or loaded < built:
        raise RuntimeError(f"libnvshmem_host {loaded} is older than, or a different major version from, the NVSHMEM "
                           f"{built} this extension was built with; install a matching nvidia-nvshmem wheel")
    _runtime = Runtime(rank=rank, world=world, device=local[0], bootstrap=bootstrap)
    atexit.register(finalize)
    return _runtime


def current() -> Runtime | None:
    """The Runtime of this process, or None before initialize()."""
    return _runtime


def finalize() -> None:
    """Finalizes NVSHMEM (after every MoEComm is closed); a no-op when not initialized."""
    global _runtime
    if _runtime is None:
        return
    if _runtime.bootstrap == "nvshmem4py":
        import nvshmem.core as nvshmem_core

        nvshmem_core.finalize()
    else:
        _ext().finalize()
    _runtime = None


def unavailable_reason(mesh: Mesh) -> str | None:
    """Why the NVSHMEM backend cannot serve `mesh`, or None when it can."""
    if _native.ext is None:
        return _native.unavailable_reason_text()
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"gpu"}:
        return f"the NVSHMEM backend needs a mesh of CUDA GPUs, got platforms {sorted(platforms)}"
    if _runtime is None:
        return "NVSHMEM is not initialized on this process; call jax_moe_comm.initialize() first"
    return None


def resolve_backend(backend: str, mesh: Mesh) -> str:
    """The backend "auto" means on `mesh` (nvshmem when it can serve it), or the one asked for if it can."""
    if backend == "reference":
        return "reference"
    reason = unavailable_reason(mesh)
    if reason is None:
        return "nvshmem"
    if backend == "nvshmem":
        raise RuntimeError(f"backend='nvshmem' is not available: {reason}")
    if {d.platform for d in mesh.devices.flat} == {"gpu"}:  # GPUs that run the slow path should say so
        warnings.warn(f"jax_moe_comm: backend='auto' runs the reference backend on this GPU mesh: {reason}",
                      stacklevel=3)
    return "reference"

"""The package version, for scikit-build-core (pyproject.toml): BASE, plus a local label "+cuNN" when the build
compiles the CUDA extension with the CUDA NN toolkit, e.g. 0.1.0+cu13 (a CPU-only build: 0.1.0).

The label is decided before CMake runs, from what CMakeLists.txt looks for: nvcc ($CUDACXX, else nvcc at PATH,
else /usr/local/cuda) and NVSHMEM ($NVSHMEM_HOME, else the nvidia.nvshmem package of the building Python);
CMakeLists.txt stops the build when it finds otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

BASE = "0.1.0"
OFF = {"0", "off", "false", "no", "n"}


def nvcc_path() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def nvshmem_found() -> bool:
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        return (Path(home) / "include" / "nvshmem.h").is_file()
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:
        return False
    return spec is not None and any((Path(p) / "include" / "nvshmem.h").is_file()
                                    for p in spec.submodule_search_locations or [])


def cuda_major() -> int | None:
    """The CUDA major the extension will be built with, or None for a CPU-only build."""
    if os.environ.get("JAX_MOE_COMM_CUDA", "ON").strip().lower() in OFF:
        return None
    nvcc = nvcc_path()
    if nvcc is None or not nvshmem_found():
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"release (\d+)\.", out)
    return int(found.group(1)) if found else None


def version() -> str:
    major = cuda_major()
    return BASE if major is None else f"{BASE}+cu{major}"


def dynamic_metadata(field: str, settings: object = None, project: object = None) -> str:
    if field != "version":
        raise ValueError(f"build_version.py gives the version only, not {field!r}")
    return version()


if __name__ == "__main__":
    print(version())

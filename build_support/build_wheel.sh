#!/usr/bin/env bash
# Builds the wheel of this source tree for the Python running it, into OUTDIR (default: dist/):
#   bash build_support/build_wheel.sh [OUTDIR]
# Needs the build tools, jax and, for the CUDA extension, nvcc and the nvidia-nvshmem-cuNN wheel of nvcc's major
# installed in that Python (README, Install). With the extension the wheel is repaired to its manylinux tag
# (auditwheel; NVSHMEM's host library and the driver excluded: they come from their own wheel and the system) and
# its SASS is listed (cuobjdump at PATH or $CUOBJDUMP): sm_80, sm_90 and sm_100 must be there.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
start=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  python -m pip wheel "$ROOT" --no-build-isolation --no-deps -w "$RAW" -v
wheel=$(ls "$RAW"/jax_moe_comm-*.whl)
echo "jax_moe_comm wheel: built $(basename "$wheel") in $((SECONDS - start)) s"
# The listing is read whole before it is searched: `grep -q` in a pipe may stop reading first, and under pipefail the
# writer's broken pipe then read as "no extension" (an unrepaired, unchecked wheel).
listing=$(python -m zipfile -l "$wheel")
if ! grep -q "_nvshmem_ext" <<< "$listing"; then
  cp "$wheel" "$OUTDIR/"
  echo "jax_moe_comm wheel: CPU-only (no CUDA extension): $OUTDIR/$(basename "$wheel")"
  exit 0
fi
python -m auditwheel repair --exclude libnvshmem_host.so.3 --exclude libcuda.so.1 -w "$OUTDIR" "$wheel"
repaired=$(ls -t "$OUTDIR"/jax_moe_comm-*manylinux*.whl)
repaired=${repaired%%$'\n'*}  # the newest
python -m auditwheel show "$repaired"
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$CUOBJDUMP" ]; then
  echo "jax_moe_comm wheel: no cuobjdump (pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP): SASS not checked" >&2
  exit 1
fi
unpacked=$RAW/unpacked
python -m zipfile -e "$repaired" "$unpacked"
ext=$(ls "$unpacked"/jax_moe_comm/_nvshmem_ext*.so)
elf=$("$CUOBJDUMP" --list-elf "$ext")
echo "$elf"
"$CUOBJDUMP" --list-ptx "$ext" 2>&1 || true
for arch in sm_80 sm_90 sm_100; do
  grep -q "\.$arch\.cubin" <<< "$elf" || { echo "jax_moe_comm wheel: no $arch SASS in $ext" >&2; exit 1; }
done
echo "jax_moe_comm wheel: $repaired (SASS sm_80 sm_90 sm_100)"

#!/usr/bin/env bash
# The wheel on a GPU machine, offline: build this tree's wheel, install it into the environment that holds the
# machine's jax and NVSHMEM (--no-deps; uninstalled at the end), then from a folder outside the source tree run the
# demo at world 1 and the GPU cases at world 1 and with two processes on GPU 0. Summary in $OUT/summary.txt. (Not a
# fresh venv: the machine's jax lives in a venv, which a --system-site-packages venv does not see, and the extension
# loads NVSHMEM's host library from the nvidia-nvshmem wheel beside it.)
#   OUT=/tmp/out bash tests/gpu/wheel_check.sh        (or WHEEL=1 bash tests/gpu/run.sh)
# WHEEL_FILE=path: install that wheel (e.g. the one CI built) instead of building one here. WHEEL_CASES /
# WHEEL_SHARED_CASES: the cases' --only at world 1 / with two processes (default: every case).
set -u -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jmc_wheel_out}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
mkdir -p "$OUT"
unset PYTHONPATH
step() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
result() { local rc=$1; shift; echo "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (exit $rc)") $*" | tee -a "$OUT/summary.txt"; }
unclean() { grep -c -E "WatchTasksAsync|Connection refused|CANCELLED|UNAVAILABLE" "$1"; }

step "$(date -u +%FT%TZ) wheel check, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "${WHEEL_FILE:-}" ]; then
  mkdir -p "$WORK/dist" && cp "$WHEEL_FILE" "$WORK/dist/"
  step "the given wheel: $(basename "$WHEEL_FILE") sha256 $(sha256sum "$WHEEL_FILE" | cut -c1-16)"
else
  step "build (offline, no isolation)"
  CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-8} timeout 1200 "$PY" -m pip wheel "$ROOT" --no-build-isolation --no-deps \
    --no-index -w "$WORK/dist" > "$OUT/wheel_build.log" 2>&1
  rc=$?; result $rc "pip wheel: $(ls "$WORK"/dist 2>/dev/null)"
  [ $rc = 0 ] || { tail -40 "$OUT/wheel_build.log" | tee -a "$OUT/summary.txt"; exit 1; }
fi
step "install into $("$PY" -c 'import sys; print(sys.prefix)') (--no-deps)"
timeout 300 "$PY" -m pip install --no-deps --no-index --force-reinstall "$WORK"/dist/*.whl > "$OUT/install.log" 2>&1
rc=$?; result $rc "install"; [ $rc = 0 ] || exit 1
trap '"$PY" -m pip uninstall -y jax_moe_comm > /dev/null 2>&1' EXIT
PYV=$(command -v "$PY")
cd "$WORK"  # outside the source tree: nothing of it on sys.path
timeout 300 "$PYV" - > "$OUT/import.log" 2>&1 <<'PY'
import os, sys, sysconfig
import jax_moe_comm
where = os.path.realpath(jax_moe_comm.__file__)
print("jax_moe_comm:", where, jax_moe_comm.build_info())
assert where.startswith(os.path.realpath(sysconfig.get_paths()["purelib"])), f"imported {where}, not the wheel"
assert jax_moe_comm.build_info()["cuda"], jax_moe_comm.build_info()
PY
rc=$?; result $rc "import from the venv: $(tail -1 "$OUT/import.log")"; [ $rc = 0 ] || exit 1

step "demo, world 1"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 600 "$PYV" -m jax_moe_comm.launch -n 1 -- -m jax_moe_comm.demo \
  > "$OUT/demo.log" 2> "$OUT/demo.err"
rc=$?; result $rc "demo world 1 ($(unclean "$OUT/demo.err") distributed-runtime warning lines on stderr)"
grep -E "PASS|FAIL|backend" "$OUT/demo.log" | tee -a "$OUT/summary.txt"
CASES=$ROOT/tests/gpu/nvshmem_cases.py
step "GPU cases, world 1"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 1200 "$PYV" -m jax_moe_comm.launch -n 1 -- "$CASES" \
  ${WHEEL_CASES:+--only "$WHEEL_CASES"} > "$OUT/cases_world1.log" 2> "$OUT/cases_world1.err"
rc=$?; result $rc "cases world 1 ($(unclean "$OUT/cases_world1.err") warning lines)"
grep -E "^\[rank 0\] (FAIL|[0-9]+ passed)" "$OUT/cases_world1.log" | tee -a "$OUT/summary.txt"
step "GPU cases, two processes on GPU 0"
CUDA_VISIBLE_DEVICES=0,0 NVSHMEM_DISABLE_NCCL=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout 1800 \
  "$PYV" -m jax_moe_comm.launch -n 2 -- "$CASES" --reference-on-cpu --symmetric-size 2G \
  ${WHEEL_SHARED_CASES:+--only "$WHEEL_SHARED_CASES"} > "$OUT/cases_shared2.log" 2> "$OUT/cases_shared2.err"
rc=$?; result $rc "cases, 2 processes on GPU 0 ($(unclean "$OUT/cases_shared2.err") warning lines)"
grep -E "^\[rank 0\] (FAIL|[0-9]+ passed)" "$OUT/cases_shared2.log" | tee -a "$OUT/summary.txt"
rm -rf "$WORK"

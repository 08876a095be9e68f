#!/usr/bin/env bash
# Build the CUDA extension and run the GPU tests, demo and benchmark on a machine with 2 GPUs (one call).
#   bash tests/gpu/run.sh            # logs under $OUT (or /tmp/jmc_gpu_out)
# Optional: CASES=TEXT / CASES_SKIP=TEXT pick cases by name; SANITIZE=TEXT runs that case under compute-sanitizer;
# BENCH="args" runs python -m jax_moe_comm.bench with those arguments through the launcher (BENCH_SINGLE: in one
# process driving both GPUs); TRACE="args;args" runs
# benchmarks/trace_round_trip.py (GPU time per kernel) once per argument list; TESTS=0 skips bootstrap, launcher,
# cases and demo (build + bench/trace only), TESTS=cases keeps the cases alone; TRAIN="args" runs the training example on both backends and compares.
# Builds offline (every build dependency is expected installed); wheels in a .whl/ folder (nvshmem4py) are installed
# into /tmp/site first (that machine installs nothing from the network). Prints a summary last.
set -u -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
export NVSHMEM_REMOTE_TRANSPORT=none XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 JAX_MOE_COMM_TIMEOUT_S=10 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jmc_gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
step() { echo "=== $*" | tee -a "$OUT/summary.txt"; }

step "$(date -u +%FT%TZ) commit ${JMC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi -L | tee -a "$OUT/summary.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import jax; print('jax', jax.__version__)" | tee -a "$OUT/summary.txt"
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
for tool in compute-sanitizer; do echo "$tool: $(command -v $tool || echo absent)"; done | tee -a "$OUT/summary.txt"

step "build"
timeout 400 cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
  -DJAX_MOE_COMM_CUDA_ARCHITECTURES="${ARCHS:-90}" > "$OUT/build.log" 2>&1 &&
  timeout 400 cmake --build build/gpu >> "$OUT/build.log" 2>&1 &&
  cp build/gpu/_nvshmem_ext*.so jax_moe_comm/ || { tail -30 "$OUT/build.log"; step "build FAILED"; exit 1; }
python3 -c "import jax_moe_comm as j; print(j.build_info())" | tee -a "$OUT/summary.txt"

if [ "${TESTS:-1}" = 1 ]; then
step "bootstrap (nvshmem4py, else the extension's own init)"
if ! timeout 120 python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/bootstrap_probe.py 2>&1 | tee "$OUT/bootstrap.log"; then
  export JAX_MOE_COMM_BOOTSTRAP=extension
  timeout 120 python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/bootstrap_probe.py 2>&1 | tee -a "$OUT/bootstrap.log"
fi
grep "NVSHMEM up" "$OUT/bootstrap.log" | tee -a "$OUT/summary.txt"

step "launcher: 2 nodes x 1 GPU on one host"
port=$((20000 + RANDOM % 10000))
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$node timeout 120 python3 -m jax_moe_comm.launch -n 1 --nnodes 2 --node-rank $node \
    --coordinator 127.0.0.1:$port -- tests/gpu/bootstrap_probe.py > "$OUT/two_nodes_$node.log" 2>&1 &
  pids[$node]=$!
done
wait "${pids[0]}"; rc0=$?; wait "${pids[1]}"; rc1=$?
grep -h "NVSHMEM up" "$OUT"/two_nodes_*.log | tee -a "$OUT/summary.txt"
step "two-node launch exit codes $rc0 $rc1"
fi

if [ "${TESTS:-1}" != 0 ]; then  # TESTS=cases: the cases alone
step "NVSHMEM vs reference cases"
timeout 900 python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/nvshmem_cases.py ${CASES:+--only "$CASES"} \
  ${CASES_SKIP:+--skip "$CASES_SKIP"} \
  > "$OUT/cases.log" 2>&1
rc=$?
grep -E "^\[rank 0\] (PASS|FAIL|[0-9]+ passed)" "$OUT/cases.log" | tee -a "$OUT/summary.txt"
step "cases exit code $rc"
fi

if [ "${TESTS:-1}" = 1 ]; then
step "demo through the launcher"
timeout 300 python3 -m jax_moe_comm.launch -n 2 -- python -m jax_moe_comm.demo > "$OUT/demo.log" 2>&1
rc=$?
grep "^\[rank 0\]   " "$OUT/demo.log" | tee -a "$OUT/summary.txt"
step "demo exit code $rc"
fi

if [ -n "${TRAIN:-}" ]; then  # the training example on both backends, losses compared
  step "train example: nvshmem vs reference ($TRAIN)"
  for backend in nvshmem reference; do
    timeout 300 python3 -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.train --backend $backend $TRAIN \
      --log-json "$OUT/train_$backend.json" > "$OUT/train_$backend.log" 2>&1
    echo "$backend: exit $? $(grep -h '^\[rank 0\] held-out loss' "$OUT/train_$backend.log")" | tee -a "$OUT/summary.txt"
  done
  python3 tests/gpu/compare_losses.py "$OUT/train_nvshmem.json" "$OUT/train_reference.json" 2>&1 | tee -a "$OUT/summary.txt"
fi

if [ -n "${BENCH:-}" ]; then
  step "bench"
  timeout 500 python3 -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.bench $BENCH > "$OUT/bench.log" 2>&1
  tail -40 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${BENCH_SINGLE:-}" ]; then  # one process driving both GPUs (the ragged baseline needs it)
  step "bench, one process: $BENCH_SINGLE"
  timeout 400 python3 -m jax_moe_comm.bench $BENCH_SINGLE > "$OUT/bench_single.log" 2>&1
  tail -25 "$OUT/bench_single.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${TRACE:-}" ]; then  # ';'-separated argument lists for benchmarks/trace_round_trip.py
  IFS=';' read -ra traces <<< "$TRACE"
  for targs in "${traces[@]}"; do
    step "trace: $targs"
    timeout 300 python3 -m jax_moe_comm.launch -n 2 -- benchmarks/trace_round_trip.py $targs > "$OUT/trace.log" 2>&1
    grep "^\[rank 0\]" "$OUT/trace.log" | grep -v -E "W[0-9]{4}|GRPC|Source Location|grpc_util|^\[rank 0\] $" | tail -100 \
      | tee -a "$OUT/summary.txt"
  done
fi
if [ -n "${SANITIZE:-}" ]; then  # last: a crash under the sanitizer must not leave GPU memory taken for later steps
  step "compute-sanitizer memcheck: $SANITIZE"
  timeout 300 compute-sanitizer --tool memcheck --target-processes all --print-limit 1000 \
    python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/nvshmem_cases.py --only "$SANITIZE" > "$OUT/sanitizer.log" 2>&1
  rc=$?
  grep -E "^\[rank 0\] (PASS|FAIL|[0-9]+ passed)" "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"
  echo "memory errors (Invalid/out of bounds/misaligned): $(grep -c -E '========= (Invalid|Out of bounds|Misaligned)' \
    "$OUT/sanitizer.log"); other reports: $(grep -c '========= Program hit' "$OUT/sanitizer.log") CUDA API errors" \
    | tee -a "$OUT/summary.txt"
  grep -E "========= (Invalid|Out of bounds|Misaligned)" -A3 "$OUT/sanitizer.log" | head -12 | tee -a "$OUT/summary.txt"
  step "sanitizer exit code $rc"
fi
step "done"

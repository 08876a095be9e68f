#!/usr/bin/env bash
# Build the CUDA extension and run the GPU tests, demo and benchmark on a machine with 2 GPUs (one call).
#   bash tests/gpu/run.sh            # summary.txt and logs.tar.gz (every log) under $OUT (or /tmp/jmc_gpu_out)
# Optional, all by environment variable:
#   CASES / CASES_SKIP = "a|b"  run / skip the cases whose name contains a or b
#   TESTS=0 | cases             skip bootstrap, launcher, cases and demo | run the cases alone (default: all)
#   TRAIN="args"                the training example on both backends through the launcher, losses compared
#   DECODE="args"               the decode example through the launcher (RANKS processes), checked against its dense
#                               model
#   BENCH="args"                python -m jax_moe_comm.bench through the launcher (one process per GPU); BENCH_JSON=name:
#                               its record written to $OUT/name (tests/gpu/try_patches.sh: a record per run)
#   MEASURE=1|0                 build the measurement instruments (kernel marks, floor probes, traffic counts) or not;
#                               by default when MARKS is set, BENCH/BENCH_SINGLE/TRACE/CASES names a floor probe or
#                               HARNESS_ONLY the traffic case
#   BOOTSTRAP=auto|nvshmem4py|extension  jax_moe_comm.initialize's bootstrap in the cases
#   RANKS=1                     the cases, BENCH, TRACE and MARKS on one GPU (world 1: no peer; default 2)
#   BENCH_SINGLE="args"         the bench in one process driving both GPUs (the ragged baseline needs that)
#   OVERLAP_PROBE="args"        tests/gpu/overlap_probe.py on GPU 0 ("1": its defaults, R1 rows at 4096 tokens, max_sms
#                               24): whether each MoEComm(send_stream=...) runs the send beside the GEMM between the
#                               halves (timings, a trace's kernel overlap, the verdicts; its JSON under $OUT)
#   TRACE="args;args"           benchmarks/trace_round_trip.py (GPU time per kernel), once per argument list
#   MARKS="1,128"               the kernel harness's step-by-step kernel timings (R1, those tokens per rank; the
#                               measurement build); MARKS_ENVS="A=1;B=2" repeats them under each of those environments
#                               MARKS_ARGS="--weights-to dispatch": weights given to dispatch where combine pre-reduces
#   HARNESS=1                   the kernel harness's cases (no XLA: four kernels and the two fused ones) and its faults
#                               (HARNESS_RANKS="2 4 8": at each of those world sizes; HARNESS_ONLY: their --only;
#                               HARNESS_CASES=0: not the cases; HARNESS_DIFFERENTIAL=N: then N differential draws)
#   DIFFERENTIAL="S R [L]"      the differential tester through XLA (tests/gpu/xla_differential.py), RANKS processes: S
#                               setups (config, options, call pattern) of R runs each, against the oracle and the
#                               reference backend (L: seconds after which no setup starts), after the named draws of
#                               earlier failures (differential.REGRESSIONS)
#   SHARED_XLA="2 4 8"          XLA with that many processes on GPU 0 (for checking only: they time-slice one GPU): the
#                               demo, the decode example (DECODE's arguments) and the cases (the reference backend on
#                               each process's CPU devices; SHARED_CASES / SHARED_SKIP: their --only / --skip;
#                               SHARED_TIMEOUT: seconds for them at each N, default 900). Each case's result line
#                               reaches summary.txt as it ends, so a call cut short keeps the cases it finished
#   SIMULATED_NODES=K           the SHARED_XLA cases and the HARNESS cases and draws on K simulated nodes
#                               (--ranks-per-node N/K at N processes): peers on other nodes reached by NVSHMEM puts,
#                               those of a node by stores, in one round trip (the transports of a multi-node job, on
#                               one machine; a draw's window is left out there: windows run on NVLink peers only)
#   SHARED_DEMO=0               SHARED_XLA without the demo and the decode example (the cases alone)
#   SHARED_DIFFERENTIAL="S R"   with SHARED_XLA: then the differential tester at each N on GPU 0, S setups of R runs of
#                               single round trips (--patterns one --small; XLA:GPU's autotuning kept per process)
#   SHARED_GPU=1                with HARNESS: its two ranks on GPU 0, two NVSHMEM PEs sharing one GPU (for a machine
#                               with one GPU): the kernels' protocol between two ranks, checked without NVLink; XLA's
#                               NCCL refuses two ranks on one GPU, so the XLA cases cannot run that way
#   PROBE=1                     tests/gpu/first_pass_probe.cu: load, TLB and instruction-fetch latency in a fresh launch
#   COPY_PROBE=1 | "args"       tests/gpu/copy_floor_probe.cu: the fan-out's and the weighted sums' speed by copy style,
#                               with every SM and under an SM budget, beside their memset / read floors
#   SANITIZE="case|case"        the kernel harness (tests/gpu/kernel_harness.py: no XLA on the GPU), plain and under
#                               compute-sanitizer (SANITIZE_TOOLS, default "memcheck"), XLA:GPU alone under memcheck,
#                               then those cases under memcheck (NVLink path, then
#                               staged path; SANITIZE_STAGED="0" the first alone; SANITIZE_BOOTSTRAP=extension;
#                               SANITIZE_STARTUP=1 start-up alone first; SANITIZE_XLA_FLAGS for XLA under it;
#                               SANITIZE_HARNESS_STAGED="0" the harness on the NVLink path alone; SANITIZE_CASES=0
#                               the harness alone, without XLA)
#   WHEEL=1                     tests/gpu/wheel_check.sh alone: the wheel built offline, installed into a fresh venv,
#                               the demo and the cases run from it outside the source tree (then exits)
# Builds offline (every build dependency is expected installed); wheels in a .whl/ folder (nvshmem4py) are installed
# into /tmp/site first (that machine installs nothing from the network). Prints a summary last.
set -u -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
export NVSHMEM_REMOTE_TRANSPORT=none XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jmc_gpu_out}
LOGS=${LOGS:-/tmp/jmc_gpu_logs}  # packed into $OUT/logs.tar.gz at exit (few files come back from a device call)
mkdir -p "$OUT" "$LOGS"
export JMC_HLO_DIR=$LOGS  # the composition cases write their optimized HLO there
trap 'tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null' EXIT
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
step() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
# Rank 0's line per case (PASS, FAIL or SKIP) and its count, from a cases or harness log, into the summary.
case_results() { grep -E "^\[rank 0\] (PASS|FAIL|SKIP|[0-9]+ passed)" "$1" | tee -a "$OUT/summary.txt"; }
# The same lines as a run prints them (stdin: its output, kept whole in log $1): a call cut short keeps what ended.
results_as_they_come() {
  tee "$1" | grep --line-buffered -E "^\[rank 0\] (PASS|FAIL|SKIP|[0-9]+ passed)" | tee -a "$OUT/summary.txt"
}
# What compute-sanitizer reported in a log: device-side errors (memory access, races, barriers, uninitialized reads:
# count and the first ones), CUDA API errors, and each rank's summary line.
sanitizer_summary() {
  local found='========= (Invalid|Out of bounds|Misaligned|Error:|WARN|.*hazard detected|Barrier error|Uninitialized)'
  echo "device-side errors: $(grep -c -E "$found" "$1"); CUDA API errors reported: $(grep -c '========= Program hit' \
    "$1")" | tee -a "$OUT/summary.txt"
  grep -E "$found" -A3 "$1" | head -12 | tee -a "$OUT/summary.txt"
  grep -E "(ERROR|RACECHECK) SUMMARY" "$1" | tee -a "$OUT/summary.txt"  # one line per rank's sanitizer
}

if [ "${WHEEL:-0}" = 1 ]; then
  OUT=$OUT bash tests/gpu/wheel_check.sh
  exit $?
fi
step "$(date -u +%FT%TZ) commit ${JMC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi -L | tee -a "$OUT/summary.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import jax; print('jax', jax.__version__)" | tee -a "$OUT/summary.txt"
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
for tool in compute-sanitizer; do echo "$tool: $(command -v $tool || echo absent)"; done | tee -a "$OUT/summary.txt"

step "build"
# From scratch: on a machine kept warm between calls the objects of an earlier tree can look newer than these sources.
[ "${KEEP_BUILD:-0}" = 1 ] || rm -rf build/gpu
# The measurement build (kernel marks, the floor probes) when something here uses it; MEASURE=1/0 to say.
case "${MARKS:-}${BENCH:-}${BENCH_SINGLE:-}${TRACE:-}${CASES:-}" in *floor*|[0-9]*) measure=1 ;; *) measure=0 ;; esac
[ -n "${MARKS:-}" ] && measure=1
case "${HARNESS_ONLY:-}" in *traffic*) measure=1 ;; esac
measure=${MEASURE:-$measure}
echo "measurement build: $measure" | tee -a "$OUT/summary.txt"
timeout 400 cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
  -DJAX_MOE_COMM_MEASUREMENT=$([ "$measure" = 1 ] && echo ON || echo OFF) \
  -DJAX_MOE_COMM_CUDA_ARCHITECTURES="${ARCHS:-90}" > "$LOGS/build.log" 2>&1 &&
  timeout 400 cmake --build build/gpu >> "$LOGS/build.log" 2>&1 &&
  cp build/gpu/_nvshmem_ext*.so jax_moe_comm/ || { tail -30 "$LOGS/build.log"; step "build FAILED"; exit 1; }
python3 -c "import jax_moe_comm as j; print(j.build_info())" | tee -a "$OUT/summary.txt"

gpus=$(nvidia-smi -L | grep -c "^GPU")
if [ "${TESTS:-1}" = 1 ] && [ "$gpus" -lt 2 ]; then
  step "bootstrap, two-node launch and demo: SKIP (they need 2 GPUs; this machine has $gpus)"
elif [ "${TESTS:-1}" = 1 ]; then
step "bootstrap (nvshmem4py, else the extension's own init)"
BOOTSTRAP=${BOOTSTRAP:-auto}
if ! timeout 120 python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/bootstrap_probe.py $BOOTSTRAP 2>&1 | tee "$LOGS/bootstrap.log"; then
  BOOTSTRAP=extension
  timeout 120 python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/bootstrap_probe.py $BOOTSTRAP 2>&1 | tee -a "$LOGS/bootstrap.log"
fi
grep "NVSHMEM up" "$LOGS/bootstrap.log" | tee -a "$OUT/summary.txt"

step "launcher: 2 nodes x 1 GPU on one host"
port=$((20000 + RANDOM % 10000))
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$node timeout 120 python3 -m jax_moe_comm.launch -n 1 --nnodes 2 --node-rank $node \
    --coordinator 127.0.0.1:$port -- tests/gpu/bootstrap_probe.py > "$LOGS/two_nodes_$node.log" 2>&1 &
  pids[$node]=$!
done
wait "${pids[0]}"; rc0=$?; wait "${pids[1]}"; rc1=$?
grep -h "NVSHMEM up" "$LOGS"/two_nodes_*.log | tee -a "$OUT/summary.txt"
step "two-node launch exit codes $rc0 $rc1"
fi

if [ -n "${DIFFERENTIAL:-}" ]; then  # "setups runs"
  read -r d_setups d_runs d_limit <<< "$DIFFERENTIAL"
  step "differential tester through XLA, ${RANKS:-2} rank(s): $d_setups setups x $d_runs runs"
  timeout 900 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- tests/gpu/xla_differential.py --setups "$d_setups" \
    --runs "$d_runs" --time-limit "${d_limit:-0}" --regressions > "$LOGS/differential.log" 2>&1
  rc=$?
  grep -E "^\[rank 0\] (FAIL|  replay|differential:|time limit)" "$LOGS/differential.log" | tee -a "$OUT/summary.txt"
  step "differential exit code $rc"
fi

if [ "${TESTS:-1}" != 0 ]; then  # TESTS=cases: the cases alone
step "NVSHMEM vs reference cases, ${RANKS:-2} rank(s)"
timeout 900 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- tests/gpu/nvshmem_cases.py --bootstrap "${BOOTSTRAP:-auto}" \
  ${CASES:+--only "$CASES"} \
  ${CASES_SKIP:+--skip "$CASES_SKIP"} \
  2>&1 | results_as_they_come "$LOGS/cases.log"
rc=${PIPESTATUS[0]}
step "cases exit code $rc"
fi

if [ "${TESTS:-1}" != 0 ]; then  # a failure no check raised is printed once at exit
step "an unraised failure at exit, ${RANKS:-2} rank(s)"
timeout 120 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- tests/gpu/unraised_at_exit.py > "$LOGS/unraised.log" 2>&1
rc=$?
step "unraised at exit: exit code $rc, outputs read: $(grep -c '^\[rank 0\] OUTPUTS NaN' "$LOGS/unraised.log"), \
message printed by rank 0: $(grep '^\[rank 0\]' "$LOGS/unraised.log" | grep -c 'expert id 99 of token 3 is outside')"
fi


if [ "${TESTS:-1}" = 1 ] && [ "$gpus" -ge 2 ]; then
step "demo through the launcher"
timeout 300 python3 -m jax_moe_comm.launch -n 2 -- python -m jax_moe_comm.demo > "$LOGS/demo.log" 2>&1
rc=$?
grep "^\[rank 0\]   " "$LOGS/demo.log" | tee -a "$OUT/summary.txt"
step "demo exit code $rc"
fi

if [ -n "${TRAIN:-}" ]; then  # the training example on both backends, losses compared
  step "train example: nvshmem vs reference ($TRAIN)"
  for backend in nvshmem reference; do
    timeout 300 python3 -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.train --backend $backend $TRAIN \
      --log-json "$LOGS/train_$backend.json" > "$LOGS/train_$backend.log" 2>&1
    echo "$backend: exit $? $(grep -h '^\[rank 0\] held-out loss' "$LOGS/train_$backend.log")" | tee -a "$OUT/summary.txt"
  done
  python3 tests/gpu/compare_losses.py "$LOGS/train_nvshmem.json" "$LOGS/train_reference.json" 2>&1 | tee -a "$OUT/summary.txt"
fi

if [ -n "${DECODE:-}" ]; then
  step "decode example, ${RANKS:-2} rank(s): $DECODE"
  timeout 300 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- -m jax_moe_comm.examples.decode $DECODE \
    > "$LOGS/decode.log" 2>&1
  rc=$?
  grep -E "^\[rank 0\] .*(PASS|FAIL|tokens/s|backend)" "$LOGS/decode.log" | tee -a "$OUT/summary.txt"
  step "decode exit code $rc"
fi

if [ -n "${BENCH:-}" ]; then
  step "bench"
  timeout 500 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- -m jax_moe_comm.bench $BENCH \
    ${BENCH_JSON:+--json "$OUT/$BENCH_JSON"} > "$LOGS/bench.log" 2>&1
  tail -40 "$LOGS/bench.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${BENCH_SINGLE:-}" ]; then  # one process driving both GPUs (the ragged baseline needs it)
  step "bench, one process: $BENCH_SINGLE"
  timeout 400 python3 -m jax_moe_comm.bench $BENCH_SINGLE > "$LOGS/bench_single.log" 2>&1
  tail -25 "$LOGS/bench_single.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${OVERLAP_PROBE:-}" ]; then  # traces and optimized HLO into the logs, the JSON records into $OUT
  step "overlap probe: $OVERLAP_PROBE"
  probe_args=$([ "$OVERLAP_PROBE" = 1 ] || echo "$OVERLAP_PROBE")
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 tests/gpu/overlap_probe.py $probe_args --out "$LOGS/overlap_probe" \
    > "$LOGS/overlap_probe.log" 2>&1
  rc=$?
  grep -E "^(\[flag|VERDICT)" "$LOGS/overlap_probe.log" | tee -a "$OUT/summary.txt"
  cp "$LOGS"/overlap_probe/*.json "$OUT/" 2>/dev/null
  [ "$rc" = 0 ] || tail -20 "$LOGS/overlap_probe.log" | tee -a "$OUT/summary.txt"
  step "overlap probe exit code $rc"
fi
if [ -n "${TRACE:-}" ]; then  # ';'-separated argument lists for benchmarks/trace_round_trip.py
  IFS=';' read -ra traces <<< "$TRACE"
  for i in "${!traces[@]}"; do
    targs=${traces[$i]}
    step "trace: $targs"
    timeout 300 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- benchmarks/trace_round_trip.py $targs \
      > "$LOGS/trace_$i.log" 2>&1
    grep "^\[rank 0\]" "$LOGS/trace_$i.log" | grep -v -E "W[0-9]{4}|GRPC|Source Location|grpc_util|^\[rank 0\] $" | tail -100 \
      | tee -a "$OUT/summary.txt"
  done
fi
for n in ${SHARED_XLA:-}; do  # N processes on GPU 0: every XLA program of theirs free of XLA collectives (NCCL
  # refuses two ranks on one GPU); each process computes the reference on n CPU devices of its own.
  shared="CUDA_VISIBLE_DEVICES=0$(printf ',0%.0s' $(seq 2 $n)) NVSHMEM_DISABLE_NCCL=1 PYTHONFAULTHANDLER=1 \
XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.5 / $n, 3))") \
XLA_FLAGS=--xla_force_host_platform_device_count=$n"
  per_node=${SIMULATED_NODES:+$((n / SIMULATED_NODES))}
  # The demo and the decode example first: a call cut short by its time limit keeps them.
  if [ "${SHARED_DEMO:-1}" = 1 ]; then
    step "demo, $n processes on GPU 0"
    env $shared timeout 150 python3 -m jax_moe_comm.launch -n $n -- python -m jax_moe_comm.demo \
      > "$LOGS/shared_demo_$n.log" 2>&1
    rc=$?
    grep "^\[rank 0\]   " "$LOGS/shared_demo_$n.log" | tee -a "$OUT/summary.txt"
    step "demo ($n processes on GPU 0) exit code $rc"
    step "decode example, $n processes on GPU 0: ${DECODE:-}"
    env $shared timeout 150 python3 -m jax_moe_comm.launch -n $n -- -m jax_moe_comm.examples.decode ${DECODE:-} \
      > "$LOGS/shared_decode_$n.log" 2>&1
    rc=$?
    grep -E "^\[rank 0\] .*(PASS|FAIL|tokens/s|backend)" "$LOGS/shared_decode_$n.log" | tee -a "$OUT/summary.txt"
    step "decode ($n processes on GPU 0) exit code $rc"
  fi
  step "XLA cases, $n processes on GPU 0 (the reference on CPU)${per_node:+, simulated nodes of $per_node}"
  env $shared timeout "${SHARED_TIMEOUT:-900}" python3 -m jax_moe_comm.launch -n $n -- tests/gpu/nvshmem_cases.py \
    --reference-on-cpu --symmetric-size 2G ${SHARED_CASES:+--only "$SHARED_CASES"} \
    ${per_node:+--ranks-per-node "$per_node"} \
    ${SHARED_SKIP:+--skip "$SHARED_SKIP"} 2>&1 | results_as_they_come "$LOGS/shared_cases_$n.log"
  rc=${PIPESTATUS[0]}
  step "cases ($n processes on GPU 0) exit code $rc"
  if [ -n "${SHARED_DIFFERENTIAL:-}" ]; then
    read -r d_setups d_runs <<< "$SHARED_DIFFERENTIAL"
    step "differential tester through XLA, $n processes on GPU 0: $d_setups setups x $d_runs runs, single round trips"
    env $shared XLA_FLAGS="--xla_force_host_platform_device_count=$n --xla_gpu_shard_autotuning=false" \
      timeout "${SHARED_TIMEOUT:-900}" python3 -m jax_moe_comm.launch -n $n -- tests/gpu/xla_differential.py \
      --patterns one --small --symmetric-size 2G --setups "$d_setups" --runs "$d_runs" \
      > "$LOGS/shared_differential_$n.log" 2>&1
    rc=$?
    grep -E "^\[rank 0\] (FAIL|  replay|differential:)" "$LOGS/shared_differential_$n.log" | tee -a "$OUT/summary.txt"
    step "differential ($n processes on GPU 0) exit code $rc"
  fi
done
if [ "${HARNESS:-0}" = 1 ]; then  # HARNESS_RANKS="2 4 8": once per world size; HARNESS_ONLY: its --only
  for n in ${HARNESS_RANKS:-2}; do
    shared=""; [ "${SHARED_GPU:-0}" = 1 ] && shared="CUDA_VISIBLE_DEVICES=0$(printf ',0%.0s' $(seq 2 $n))"
    per_node=${SIMULATED_NODES:+$((n / SIMULATED_NODES))}
    if [ "${HARNESS_CASES:-1}" = 1 ]; then
      step "kernel harness cases, $n ranks (no XLA on the GPU)${shared:+, every rank on GPU 0}${per_node:+, simulated \
nodes of $per_node}"
      env $shared NVSHMEM_DISABLE_NCCL=1 timeout 400 python3 -m jax_moe_comm.launch -n $n \
        -- tests/gpu/kernel_harness.py ${HARNESS_ONLY:+--only "$HARNESS_ONLY"} \
        ${per_node:+--ranks-per-node "$per_node"} 2>&1 \
        | results_as_they_come "$LOGS/harness_$n.log"
      rc=${PIPESTATUS[0]}
      step "kernel harness ($n ranks) exit code $rc"
    fi
    if [ -n "${HARNESS_DIFFERENTIAL:-}" ]; then
      step "kernel harness: $HARNESS_DIFFERENTIAL differential draws, $n ranks${shared:+, every rank on GPU 0}${per_node:+, \
simulated nodes of $per_node}"
      env $shared NVSHMEM_DISABLE_NCCL=1 timeout 600 python3 -m jax_moe_comm.launch -n $n \
        -- tests/gpu/kernel_harness.py --differential "$HARNESS_DIFFERENTIAL" ${per_node:+--ranks-per-node "$per_node"} \
        > "$LOGS/harness_differential_$n.log" 2>&1
      rc=$?
      grep -E "^\[rank 0\] (FAIL|  replay|differential:)" "$LOGS/harness_differential_$n.log" | tee -a "$OUT/summary.txt"
      step "kernel harness differential ($n ranks) exit code $rc"
    fi
  done
fi
if [ "${PROBE:-0}" = 1 ]; then
  step "first-pass probe (one GPU)"
  nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/first_pass_probe tests/gpu/first_pass_probe.cu > "$LOGS/probe.log" 2>&1 &&
    CUDA_VISIBLE_DEVICES=0 timeout 120 /tmp/first_pass_probe >> "$LOGS/probe.log" 2>&1
  step "probe exit code $?"
  cat "$LOGS/probe.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${COPY_PROBE:-}" ]; then  # COPY_PROBE="1" or its arguments ("--tokens 4096 --sms 24 --reps 11")
  step "copy floor probe (one GPU)"
  args=${COPY_PROBE#1}
  nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/copy_floor_probe tests/gpu/copy_floor_probe.cu > "$LOGS/copy_probe.log" 2>&1 &&
    CUDA_VISIBLE_DEVICES=0 timeout 300 /tmp/copy_floor_probe $args >> "$LOGS/copy_probe.log" 2>&1
  step "copy floor probe exit code $?"
  cat "$LOGS/copy_probe.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${MARKS:-}" ]; then  # where each kernel's time goes (kernel harness, no XLA): MARKS="1,128"
  # MARKS_ENVS="A=1;B=2 C=3": the marks again under each of those environments (e.g. NVSHMEM settings).
  IFS=';' read -ra mark_envs <<< "${MARKS_ENVS:-}"
  for i in -1 "${!mark_envs[@]}"; do
    extra=""; [ "$i" -ge 0 ] && extra=${mark_envs[$i]}
    step "kernel marks: R1, tokens $MARKS${extra:+, with $extra}"
    env $extra timeout 200 python3 -m jax_moe_comm.launch -n "${RANKS:-2}" -- tests/gpu/kernel_harness.py \
      --marks "$MARKS" ${MARKS_ARGS:-} \
      > "$LOGS/marks_$((i + 1)).log" 2>&1
    grep -E "^\[rank [0-9]\] (rank|phase|dispatch|combine|round trip|rows|no kernel)" "$LOGS/marks_$((i + 1)).log" \
      | tee -a "$OUT/summary.txt"
  done
fi
if [ -n "${SANITIZE:-}" ]; then  # last: a crash under the sanitizer must not leave GPU memory taken for later steps
  # SANITIZE_STARTUP=1: start-up alone under the sanitizer first (NVSHMEM init through each bootstrap, no kernel of
  # ours), to tell a crash in start-up from one in the cases.
  for boot in ${SANITIZE_STARTUP:+nvshmem4py extension}; do
    step "compute-sanitizer memcheck: start-up only (bootstrap $boot)"
    NVSHMEM_DISABLE_NCCL=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 \
      python3 -m jax_moe_comm.launch -n 2 -- tests/gpu/under_sanitizer.py tests/gpu/bootstrap_probe.py $boot \
      > "$LOGS/sanitizer_startup_$boot.log" 2>&1
    rc=$?
    grep -E "NVSHMEM up|ERROR SUMMARY|killed by" "$LOGS/sanitizer_startup_$boot.log" | tee -a "$OUT/summary.txt"
    step "sanitizer (start-up, $boot) exit code $rc"
  done
  # The kernel harness: round trips through the four kernels with JAX on the CPU (no XLA:GPU in the process),
  # checked against the reference; plain first (so a harness failure is not taken for the sanitizer's), then under
  # each of SANITIZE_TOOLS (default memcheck), on both send paths. NVSHMEM without its NCCL teams: at init NCCL
  # queries kernels built for other GPUs (cudaFuncGetAttributes -> "no kernel image"), 24 API errors per rank that
  # are NCCL's own; we use no NVSHMEM collective but barrier_all.
  for staged in ${SANITIZE_HARNESS_STAGED:-0 1}; do
    for tool in none ${SANITIZE_TOOLS:-memcheck}; do
      step "kernel harness (staged $staged, sanitizer: $tool)"
      log="$LOGS/harness_staged${staged}_$tool.log"
      wrap=""; [ $tool != none ] && wrap=tests/gpu/under_sanitizer.py
      flag=""; [ $staged = 1 ] && flag=--staged
      SANITIZER_TOOL=$tool NVSHMEM_DISABLE_NCCL=1 timeout 300 \
        python3 -m jax_moe_comm.launch -n 2 -- $wrap tests/gpu/kernel_harness.py $flag --timeout-s 60 \
        > "$log" 2>&1  # 60 s waits: a sanitizer slows one rank more than the other
      rc=$?
      case_results "$log"
      [ $tool != none ] && sanitizer_summary "$log"
      step "kernel harness exit code $rc"
    done
  done
fi
if [ -n "${SANITIZE:-}" ] && [ "${SANITIZE_CASES:-1}" != 0 ]; then
  # XLA:GPU alone under memcheck (one GPU, no jax_moe_comm imported): tells whether the XLA cases below can run
  # under the sanitizer at all, whatever our kernels do.
  step "compute-sanitizer memcheck: XLA:GPU alone (a jnp sum on one GPU, no jax_moe_comm)"
  CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONFAULTHANDLER=1 \
    XLA_FLAGS="${XLA_FLAGS:-} ${SANITIZE_XLA_FLAGS---xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=}" \
    timeout 150 python3 tests/gpu/under_sanitizer.py -c \
    "import jax, jax.numpy as jnp; print('XLA alone:', jax.devices(), float(jnp.arange(8.0).sum()))" \
    > "$LOGS/sanitizer_xla_alone.log" 2>&1
  rc=$?
  grep -E "^XLA alone" "$LOGS/sanitizer_xla_alone.log" | tee -a "$OUT/summary.txt"
  sanitizer_summary "$LOGS/sanitizer_xla_alone.log"
  step "XLA:GPU alone under memcheck: exit code $rc"
  # SANITIZE_BOOTSTRAP=extension: the cases with the extension's own NVSHMEM init (no nvshmem4py / cuda-python).
  boot=${SANITIZE_BOOTSTRAP:-nvshmem4py}
  for staged in ${SANITIZE_STAGED:-0 1}; do  # the NVLink store path, then the staged put path
    step "compute-sanitizer memcheck: $SANITIZE (staged $staged, bootstrap $boot)"
    log="$LOGS/sanitizer_staged$staged.log"
    flag=""; [ $staged = 1 ] && flag=--staged
    # One sanitizer per worker (not around the launcher), memory allocated on demand (no 50% preallocation), and
    # NVSHMEM without its NCCL teams: NCCL's communicator init crashed (SIGSEGV) under memcheck before any kernel of
    # ours ran (we use no NVSHMEM collective but barrier_all).
    # XLA without autotuning and without its own CUDA graphs (SANITIZE_XLA_FLAGS): both launch work of XLA's under
    # the sanitizer that is not ours (cudaFuncGetAttributes on kernels without an sm_90 image was reported there).
    XLA_FLAGS="${XLA_FLAGS:-} ${SANITIZE_XLA_FLAGS---xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=}" \
    PYTHONFAULTHANDLER=1 NVSHMEM_DISABLE_NCCL=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m jax_moe_comm.launch -n 2 -- \
      tests/gpu/under_sanitizer.py tests/gpu/nvshmem_cases.py --only "$SANITIZE" --case-limit 280 $flag \
      --bootstrap "$boot" > "$log" 2>&1
    rc=$?
    case_results "$log"
    sanitizer_summary "$log"
    grep -v -E "=========|^\[rank 1\]" "$log" | tail -12 | tee -a "$OUT/summary.txt"  # how it ended
    step "sanitizer exit code $rc"
  done
fi
step "done"

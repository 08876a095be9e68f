#!/usr/bin/env bash
# Compares prepared changes in one call on the GPU machine: tests/gpu/run.sh once on the tree as it is ("base"),
# then once per patch, each applied alone and reverted after. Each run's summary.txt, logs.tar.gz and bench record
# (BENCH_JSON) go to <name>/ in $OUT/runs.tar.gz (one file for every run); the comparable lines (cases and harness
# counts, marks round trips, bench rows) are printed last, and kept in $OUT/try_patches.txt.
#   git diff main...small-t-steps > exp_small_t.patch    # here: a patch is a file in the tree (untracked is fine)
#   PATCHES="exp_small_t.patch exp_t4096.patch" RUN_ENV="TESTS=cases HARNESS=1 MARKS=1,128,4096" \
#     bash tests/gpu/try_patches.sh                        # there
# RUN_ENV: run.sh's variables for every run (quoted values allowed); BASE_ENV: more of them for the base run alone
# (e.g. TESTS=cases: the cases once); RUN_TIMEOUT: seconds per run (default 300); BASE=0 leaves the base run out.
# "base" in PATCHES runs the tree as it is again (base_2, ...): A, B, A measures the noise of an A/B in the same call.
set -u -o pipefail
cd "$(dirname "$0")/../.."
root=${OUT:-/tmp/jmc_gpu_out}
mkdir -p "$root"
runs=()
[ "${BASE:-1}" = 0 ] || runs+=(base)
runs+=(${PATCHES:-})
names=()
for p in "${runs[@]}"; do
  name=$(basename "$p" .patch)
  [ -d "$root/$name" ] && name=${name}_$(($(ls -d "$root/$name"* | wc -l) + 1))  # a run repeated
  if [ "$p" != base ] && ! patch -s -p1 --dry-run < "$p" > /dev/null 2>&1; then
    echo "##### $name: the patch does not apply to this tree" | tee -a "$root/try_patches.txt"
    continue
  fi
  [ "$p" != base ] && patch -s -p1 < "$p"
  mkdir -p "$root/$name"
  vars=${RUN_ENV:-}
  [ "$name" = base ] && vars="$vars ${BASE_ENV:-}"  # the first base run alone
  eval "OUT=$root/$name LOGS=/tmp/jmc_logs_$name JMC_COMMIT=${JMC_COMMIT:-unknown}+$name $(printf '%s' "$vars")" \
    timeout "${RUN_TIMEOUT:-300}" bash tests/gpu/run.sh > /dev/null 2>&1
  [ "$p" != base ] && patch -s -R -p1 < "$p"
  names+=("$name")
done
for name in "${names[@]}"; do
  echo "##### $name"
  grep -E "passed|failed|FAIL|build FAILED|round trip|^\[rank 0\] (dispatch|combine)_|^(\[rank 0\] )?(r1|v2lite) " \
    "$root/$name/summary.txt" | grep -v "^\[rank 0\] PASS"
done | tee -a "$root/try_patches.txt"
tar czf "$root/runs.tar.gz" -C "$root" "${names[@]}" && (cd "$root" && rm -rf "${names[@]}")

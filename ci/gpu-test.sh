#!/usr/bin/env bash
# The GPU test suite, on a machine with a CUDA GPU: install for that GPU's architecture, run every
# test, then the GPU tests under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).
# Usage: ci/gpu-test.sh [LOG_DIR]     (FP8KTURBOV_CUDA_ARCHITECTURES overrides the architecture)
# Set FP8KTURBOV_SKIP_INSTALL=1 to test the package already installed, SANITIZER_TOOLS to run some
# of the tools only (e.g. "memcheck racecheck"), PYTEST_ARGS / SANITIZER_PYTEST_ARGS to pass
# options to pytest (e.g. a test selection for runs under a time limit).
# SANITIZER_SHARDS=N splits the GPU tests into N shards (every N-th test); then every (tool, shard)
# runs as its own process, all at once, spread over the visible GPUs (sanitized runs are slow: on a
# machine with many cores and GPUs this cuts the wall time several-fold), except that a GPU runs
# only one initcheck process at a time. Default 1: one tool at a time, each over all the GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir="${1:-build/gpu-test-logs}"
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
if [ -z "${FP8KTURBOV_CUDA_ARCHITECTURES:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)
  export FP8KTURBOV_CUDA_ARCHITECTURES="${cc}-real"
fi
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
if [ "${FP8KTURBOV_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps . >"$log_dir/install.log" 2>&1 \
    || { tail -n 40 "$log_dir/install.log"; exit 1; }
fi
status=0
python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$log_dir/pytest.log" | tail -n 15 \
  || status=1

tools=(${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck})
# Under the sanitizer, leave out the installed C example's run: it first builds the library and the
# example with nvcc, whose processes the sanitizer follows too (about 300 s a run); its kernels are
# the ones the other tests check. And the bench tests time without their gate: with it, they never
# finished under initcheck.
sanitized_args=(--deselect tests/test_cmake_package.py::test_example_runs_on_gpu ${SANITIZER_PYTEST_ARGS:-})
shards=${SANITIZER_SHARDS:-1}
# Shard k holds every shards-th GPU test in collection order, so that each mixes slow and fast ones.
test_ids=()
if (( shards > 1 )); then
  mapfile -t test_ids < <(python3 -m pytest tests -m gpu -q -p no:cacheprovider --collect-only "${sanitized_args[@]}" | grep '::')
fi
shard_tests() { local k=$1 i; for i in "${!test_ids[@]}"; do (( i % shards == k )) && echo "${test_ids[$i]}"; done; }
gpus=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}
IFS=, read -r -a gpu_list <<<"$gpus"

# sanitize TOOL SHARD GPU: one compute-sanitizer run; its log is sanitizer-TOOL[-shardK].log.
sanitize() {
  local tool=$1 k=$2 gpu=$3 log="$log_dir/sanitizer-$1.log"
  local tests=(tests)
  if (( shards > 1 )); then log="$log_dir/sanitizer-$tool-shard$k.log"; mapfile -t tests < <(shard_tests "$k"); fi
  CUDA_VISIBLE_DEVICES=$gpu FP8KTURBOV_TEST_NO_TIMING_GATE=1 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 -m pytest "${tests[@]}" -m gpu -q -x -p no:cacheprovider --durations=15 "${sanitized_args[@]}" >"$log" 2>&1
  local rc=$?
  local label="$tool"
  (( shards > 1 )) && label="$tool, shard $k of $shards"
  echo "== compute-sanitizer --tool $label: exit $rc"
  tail -n 3 "$log"
  return $rc
}

if (( shards == 1 )); then
  for tool in "${tools[@]}"; do sanitize "$tool" 0 "$gpus" || status=1; done
else
  pids=()
  job=0
  for tool in "${tools[@]}"; do
    if [[ $tool == initcheck ]]; then
      # Several initcheck processes on one GPU disturb each other's runs: 6 or 8 at once over the
      # multi-threaded write test, 3 of 14 runs failed with CUDA_ERROR_ILLEGAL_ADDRESS or reported
      # uploaded inputs as uninitialized; one at a time, 0 of 6 (memcheck, 8 at once: 0 of 8).
      # So each GPU runs its initcheck shards one after another.
      for g in "${!gpu_list[@]}"; do
        (
          rc=0
          for (( k = g; k < shards; k += ${#gpu_list[@]} )); do sanitize initcheck "$k" "${gpu_list[g]}" || rc=1; done
          exit $rc
        ) &
        pids+=($!)
      done
      continue
    fi
    for (( k = 0; k < shards; ++k )); do
      sanitize "$tool" "$k" "${gpu_list[job % ${#gpu_list[@]}]}" &
      pids+=($!)
      job=$((job + 1))
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
fi
exit $status

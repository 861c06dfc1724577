#!/usr/bin/env bash
# The GPU test suite, on a machine with a CUDA GPU: install for that GPU's architecture, run every
# test, then the GPU tests under compute-sanitizer (memcheck, racecheck,
# initcheck, synccheck).
# Usage: ci/gpu-test.sh [LOG_DIR]     (FP8KTURBOV_CUDA_ARCHITECTURES overrides the architecture)
# Set FP8KTURBOV_SKIP_INSTALL=1 to test the package already installed, SANITIZER_TOOLS to run some
# of the tools only (e.g. "memcheck racecheck"), PYTEST_ARGS / SANITIZER_PYTEST_ARGS to pass
# options to pytest (e.g. a test selection for runs under a time limit).
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
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 -m pytest tests -m gpu -q -x -p no:cacheprovider ${SANITIZER_PYTEST_ARGS:-} \
    >"$log_dir/sanitizer-$tool.log" 2>&1 || status=1
  tail -n 4 "$log_dir/sanitizer-$tool.log"
done
exit $status

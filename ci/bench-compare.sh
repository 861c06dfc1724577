#!/usr/bin/env bash
# Times a baseline checkout against this tree on the local GPU: both are installed (the baseline
# into a private folder, this tree with pip), then `python -m fp8kturbov bench --json` runs ROUNDS
# times for each, interleaved, and `python -m fp8kturbov compare` prints the rows side by side: the
# medians over the rounds, their change and each round's. For showing that a change leaves a path
# as fast as it was, or how much faster it is (docs/PERFORMANCE.md).
# Usage: ci/bench-compare.sh BASELINE_DIR [BENCH_OPTIONS...]
#   e.g. git worktree add ../base main && ci/bench-compare.sh ../base --op decode --head-dim 128,256
# Environment: ROUNDS (default 3), OUT_DIR (default build/bench-compare), MAX_SLOWDOWN (a percentage;
# the script fails where a row's median over the rounds is slower by more), FP8KTURBOV_SKIP_INSTALL=1 (this
# tree is installed already), FP8KTURBOV_CUDA_ARCHITECTURES (default: the GPU's).
set -euo pipefail
cd "$(dirname "$0")/.."
base_dir=$(cd "${1:?usage: ci/bench-compare.sh BASELINE_DIR [BENCH_OPTIONS...]}" && pwd)
shift
out_dir="${OUT_DIR:-build/bench-compare}"
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
if [ -z "${FP8KTURBOV_CUDA_ARCHITECTURES:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)
  export FP8KTURBOV_CUDA_ARCHITECTURES="${cc}-real"
fi
base_pkg="$out_dir/baseline-package"
rm -rf "$base_pkg"
python3 -m pip install --no-build-isolation --no-deps --target "$base_pkg" "$base_dir" >"$out_dir/install-baseline.log" 2>&1 \
  || { tail -n 40 "$out_dir/install-baseline.log"; exit 1; }
if [ "${FP8KTURBOV_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps . >"$out_dir/install.log" 2>&1 \
    || { tail -n 40 "$out_dir/install.log"; exit 1; }
fi
# Run from another folder, so that `python -m fp8kturbov` imports the installed packages, not
# this tree's sources.
bench() { (cd "$out_dir" && PYTHONPATH="${1:-}" python3 -m fp8kturbov bench --no-progress --json "$2" "${@:3}" >/dev/null); }
rounds=${ROUNDS:-3}
further=()
for (( round = 1; round <= rounds; ++round )); do
  bench "$base_pkg" "$out_dir/baseline-$round.json" "$@"
  bench "" "$out_dir/candidate-$round.json" "$@"
  (( round > 1 )) && further+=(--round "$out_dir/baseline-$round.json" "$out_dir/candidate-$round.json")
done
gate=()
[ -n "${MAX_SLOWDOWN:-}" ] && gate=(--max-slowdown "$MAX_SLOWDOWN")
python3 -m fp8kturbov compare "$out_dir/baseline-1.json" "$out_dir/candidate-1.json" "${further[@]}" "${gate[@]}"

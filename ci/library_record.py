"""Check what a built library records about its build: the CUDA major of its runtime and the commit.

Usage: python ci/library_record.py LIBRARY CUDA_MAJOR COMMIT

Loads LIBRARY (no GPU needed: loading starts no CUDA) and reads fp8kturbov_cuda_runtime_version()
and fp8kturbov_build_commit(). Prints them; exits 1 where the runtime is not of CUDA_MAJOR or the
commit is not COMMIT (a wheel of one major built with another's nvcc, a commit lost on the way),
2 on bad usage or a library that does not load.
"""

from __future__ import annotations

import ctypes
import sys


def record(library: str) -> tuple[int, str]:
    """(CUDART_VERSION the library was built with, its build commit)."""
    loaded = ctypes.CDLL(library)
    loaded.fp8kturbov_cuda_runtime_version.restype = ctypes.c_int
    loaded.fp8kturbov_build_commit.restype = ctypes.c_char_p
    return loaded.fp8kturbov_cuda_runtime_version(), loaded.fp8kturbov_build_commit().decode()


def mismatches(runtime: int, commit: str, major: int, want_commit: str) -> list[str]:
    """What differs from the build asked for, one line each."""
    found = []
    if runtime // 1000 != major:
        found.append(f"built with the CUDA {runtime // 1000}.{runtime % 1000 // 10} runtime, not CUDA {major}")
    if commit != want_commit:
        found.append(f"records commit {commit!r}, not {want_commit!r}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit():
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    library, major, want_commit = argv[0], int(argv[1]), argv[2]
    try:
        runtime, commit = record(library)
    except (OSError, AttributeError) as exc:
        print(f"library_record: {library}: {exc}", file=sys.stderr)
        return 2
    print(f"{library}: CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}, commit {commit}")
    problems = mismatches(runtime, commit, major, want_commit)
    for problem in problems:
        print(f"ERROR: {library} {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Check that a built library holds exactly the CUDA code an architecture list asks for.

Usage: python ci/fatbin_archs.py LIBRARY "ARCHITECTURES" [CUOBJDUMP]

ARCHITECTURES is CMake's CUDA_ARCHITECTURES syntax ("80-real;90-real;90": "N-real" is sm_N machine
code, "N-virtual" compute_N PTX, a plain "N" both). The library's fatbin is read with cuobjdump
(--list-elf, --list-ptx; CUOBJDUMP defaults to the one on PATH). Prints what was found and exits 1
where it differs from what was asked for (a missing or an extra architecture), 2 on bad usage.
"""

from __future__ import annotations

import re
import subprocess
import sys

_ENTRY = re.compile(r"\.(sm|compute)_(\d+[a-z]?)\.(cubin|ptx)\s*$")


def expected(architectures: str) -> set[str]:
    """The fatbin entries ("sm_90" machine code, "compute_90" PTX) a CMake architecture list asks for."""
    wanted: set[str] = set()
    for item in filter(None, (part.strip() for part in architectures.split(";"))):
        number, _, kind = item.partition("-")
        if not re.fullmatch(r"\d+[a-z]?", number) or kind not in ("", "real", "virtual"):
            raise ValueError(f"{item!r} is not a CMake CUDA architecture (N, N-real or N-virtual)")
        if kind in ("", "real"):
            wanted.add(f"sm_{number}")
        if kind in ("", "virtual"):
            wanted.add(f"compute_{number}")
    return wanted


def found(listing: str) -> set[str]:
    """The entries cuobjdump --list-elf / --list-ptx lists ("ELF file 1: lib.1.sm_90.cubin")."""
    entries = set()
    for line in listing.splitlines():
        match = _ENTRY.search(line)
        if match:
            kind, number, suffix = match.groups()
            entries.add(f"{'sm' if suffix == 'cubin' else 'compute'}_{number}")
    return entries


def listing(library: str, cuobjdump: str) -> str:
    out = []
    for flag in ("--list-elf", "--list-ptx"):
        ran = subprocess.run([cuobjdump, flag, library], capture_output=True, text=True)
        # No PTX at all is an answer ("No PTX file found"), not a failure of the tool.
        if ran.returncode != 0 and "No PTX file found" not in ran.stderr + ran.stdout:
            raise RuntimeError(f"{cuobjdump} {flag} {library} failed: {ran.stderr.strip() or ran.stdout.strip()}")
        out.append(ran.stdout)
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    library, architectures = argv[0], argv[1]
    cuobjdump = argv[2] if len(argv) == 3 else "cuobjdump"
    try:
        want = expected(architectures)
        have = found(listing(library, cuobjdump))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"fatbin_archs: {exc}", file=sys.stderr)
        return 2
    print(f"{library}: {' '.join(sorted(have)) or 'no CUDA code'} (asked for {architectures})")
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        print(f"ERROR: the library's CUDA code differs from {architectures!r}: "
              f"missing {missing or 'none'}, extra {extra or 'none'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

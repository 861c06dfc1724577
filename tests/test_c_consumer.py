"""The C ABI from C: tests/c/test_c_abi.c, compiled against fp8kturbov.h alone, links the library
that ``fp8kturbov.library_path()`` names and must exit 0. Needs a C compiler, no GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import fp8kturbov

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "c" / "test_c_abi.c"
INCLUDE = REPO / "cuda" / "include"


def test_c_consumer(tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc)")
    if not (INCLUDE / "fp8kturbov.h").exists():
        pytest.skip(f"{INCLUDE} not found (tests run from a checkout)")
    library = fp8kturbov.library_path().resolve()
    exe = tmp_path / "test_c_abi"
    compile_cmd = [cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{INCLUDE}",
                   str(SOURCE), f"-L{library.parent}", f"-l:{library.name}",
                   f"-Wl,-rpath,{library.parent}", "-o", str(exe)]
    built = subprocess.run(compile_cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(compile_cmd)}\n{built.stdout}{built.stderr}"
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip().endswith(" passed, 0 failed"), ran.stdout

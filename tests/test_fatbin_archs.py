"""ci/fatbin_archs.py, the wheel builder's check that a library holds the CUDA code asked for:
CMake's architecture syntax read as fatbin entries, cuobjdump's listing parsed, and (where a
cuobjdump is found) the loaded library checked against a list it does and does not match."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

import fp8kturbov

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "fatbin_archs.py"
spec = importlib.util.spec_from_file_location("fatbin_archs", SCRIPT)
fatbin_archs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fatbin_archs)


@pytest.mark.parametrize("architectures, entries", [
    ("90-real", {"sm_90"}),
    ("80-real;89-real;90-real;100-real;120", {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120"}),
    ("80-real;89-real;90-real;90", {"sm_80", "sm_89", "sm_90", "compute_90"}),
    ("90a-real;90-virtual", {"sm_90a", "compute_90"}),
])
def test_cmake_architectures_as_fatbin_entries(architectures, entries):
    assert fatbin_archs.expected(architectures) == entries


@pytest.mark.parametrize("bad", ["sm_90", "90-fake", "ninety"])
def test_a_list_that_is_not_cmake_syntax_is_refused(bad):
    with pytest.raises(ValueError, match="is not a CMake CUDA architecture"):
        fatbin_archs.expected(bad)


def test_cuobjdump_listings_are_read():
    listing = ("ELF file    1: libfp8kturbov.1.sm_80.cubin\nELF file    2: libfp8kturbov.2.sm_90.cubin\n"
               "PTX file    1: libfp8kturbov.1.sm_90.ptx\ncuobjdump info : something else\n")
    assert fatbin_archs.found(listing) == {"sm_80", "sm_90", "compute_90"}


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found is None:
        pytest.skip("no cuobjdump")
    return found


def test_the_loaded_library_is_checked_against_its_own_code(capsys):
    cuobjdump = _cuobjdump()
    library = str(fp8kturbov.library_path())
    have = fatbin_archs.found(fatbin_archs.listing(library, cuobjdump))
    assert have, "the library holds no CUDA code"
    own = ";".join(f"{e[3:]}-real" if e.startswith("sm_") else f"{e[8:]}-virtual" for e in sorted(have))
    assert fatbin_archs.main([library, own, cuobjdump]) == 0
    assert fatbin_archs.main([library, own + ";75-real", cuobjdump]) == 1
    assert "missing ['sm_75']" in capsys.readouterr().err

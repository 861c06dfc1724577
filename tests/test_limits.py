"""CPU tests, no library needed: the defaults and limits Python mirrors (fp8kturbov._limits) and
the package version equal the header's macros."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fp8kturbov
from fp8kturbov import _limits

HEADER = Path(__file__).resolve().parents[1] / "cuda" / "include" / "fp8kturbov.h"

# Python constant -> the header macro it mirrors.
MIRRORED = {"MAX_Q_LEN": "FP8KTURBOV_MAX_QUERY_LEN",
            "DEFAULT_SPARSE_V_THRESHOLD": "FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD",
            "DEFAULT_V_BITS": "FP8KTURBOV_DEFAULT_V_BITS"}


def header_number(name: str) -> int | float:
    """The value of ``#define <name> <number>`` in the header (a float literal's ``f`` dropped)."""
    if not HEADER.exists():
        pytest.skip(f"{HEADER} not found (tests run from a checkout)")
    found = re.search(rf"^#define\s+{name}\s+([0-9][0-9.eE+-]*)f?\s*$", HEADER.read_text(), re.M)
    assert found, f"{name} is not a number macro of the header"
    text = found.group(1)
    return float(text) if any(c in text for c in ".eE") else int(text)


@pytest.mark.parametrize("constant, macro", MIRRORED.items())
def test_each_mirrored_limit_equals_its_header_macro(constant, macro):
    value = getattr(_limits, constant)
    assert value == header_number(macro) and type(value) is type(header_number(macro))


def test_the_python_defaults_are_the_mirrored_constants():
    assert fp8kturbov.CacheLayout.__dataclass_fields__["v_bits"].default == _limits.DEFAULT_V_BITS
    assert fp8kturbov.arrays.MAX_Q_LEN == _limits.MAX_Q_LEN
    assert fp8kturbov._lib.ROTATION_HEAD_DIMS is _limits.ROTATION_HEAD_DIMS


def test_the_package_version_is_the_header_s():
    major, minor, patch = (header_number(f"FP8KTURBOV_VERSION_{part}") for part in ("MAJOR", "MINOR", "PATCH"))
    assert fp8kturbov.__version__ == f"{major}.{minor}.{patch}"

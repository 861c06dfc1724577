"""Python values as C scalars, range-checked: ctypes would silently wrap anything out of range."""

from __future__ import annotations

import math
import operator
from typing import Any

from ._errors import InvalidValueError, Status

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
F32_MAX = 3.4028234663852886e38


def unsigned(name: str, value: Any, limit: int) -> int:
    """``value`` as an unsigned C integer of at most ``limit``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= limit:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not an integer in [0, {limit}]")
    return number


def float32(name: str, value: Any) -> float:
    """``value`` as a float that fits float32 (NaN and infinities pass: the library judges them)."""
    number = None
    if not isinstance(value, (str, bytes, bytearray)):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            number = None
    if number is None:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not a number")
    if math.isfinite(number) and abs(number) > F32_MAX:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} overflows float32")
    return number


def pointer(name: str, value: Any) -> int:
    """``value`` as a device address (a 64-bit unsigned integer)."""
    return unsigned(name, value, U64_MAX)

"""Python values as C scalars, range-checked: ctypes would silently wrap anything out of range."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from ._errors import InvalidValueError, Status

I32_MAX = 2**31 - 1  # the C ABI's int32 positions (sequence lengths, page ids, query_start)
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
F32_MAX = 3.4028234663852886e38


def unsigned(name: str, value: Any, limit: int) -> int:
    """``value`` as an unsigned C integer of at most ``limit``."""
    number = integer(value)
    if number is None or not 0 <= number <= limit:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not an integer in [0, {limit}]")
    return number


def integer(value: Any) -> int | None:
    """``value`` as a Python int where it is an integer (NumPy's too), not a bool; else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def float32(name: str, value: Any) -> float:
    """``value`` as a float that fits float32 (NaN and infinities pass: the library judges them);
    a bool, or a non-zero value that float32 would round to 0, is refused."""
    number = None
    if not isinstance(value, (str, bytes, bytearray, bool, np.bool_)):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            number = None
    if number is None:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not a number")
    if math.isfinite(number) and abs(number) > F32_MAX:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} overflows float32")
    if number != 0.0 and np.float32(number) == 0.0:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} underflows float32 (it would be 0)")
    return number


def pointer(name: str, value: Any) -> int:
    """``value`` as a device address (a 64-bit unsigned integer)."""
    return unsigned(name, value, U64_MAX)

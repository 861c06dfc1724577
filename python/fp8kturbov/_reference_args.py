"""The NumPy reference's argument rules (`reference`): those of the C entry points
(cuda/src/api/*_entries.cu, checks.cu), in their words, after the C-type range checks of the Python
package (`_scalars`); each rule is written once and called by every entry that has it."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _scalars
from ._limits import ROTATION_HEAD_DIMS
from ._scalars import I32_MAX, U32_MAX

GROUP_ELEMS = 16
"""Elements per V group (one scale byte each), FORMAT.md §3."""
V_BITS = (2, 3, 4)
"""The V code widths of FORMAT.md §3 (the keys of `reference.CODEBOOKS`)."""
V_ENCODERS = ("matched_norm", "mse", "projection")
"""Values of `reference.encode_v`'s ``encoder``; the first is the default (FORMAT.md §3.2)."""
_MAX_Q_HEADS = 65535
"""Most query heads of a decode (a grid dimension of the kernels)."""


# ---------------------------------------------------------------------------------------------------
# Argument rules: those of the C entry points (cuda/src/api/*_entries.cu), in their words, after the
# C-type range checks of the Python package (`_scalars`: an integer that its uint32_t / uint64_t holds,
# a number that float32 holds); each rule is written once and called by every entry that has it.
# ---------------------------------------------------------------------------------------------------
def _u32(name: str, value: Any) -> int:
    """``value`` as the ``uint32_t`` parameter of the library that bears this name."""
    return _scalars.unsigned(name, value, U32_MAX)


def _f32(name: str, value: Any) -> np.float32:
    """``value`` as the ``float`` the library would receive (NaN and infinities pass: rules judge them)."""
    return np.float32(_scalars.float32(name, value))


def _check_bits(bits: Any) -> int:
    value = _u32("bits", bits)
    if value not in V_BITS:
        raise ValueError(f"bits = {value} is not 2, 3 or 4")
    return value


def _check_head_dim(head_dim: Any) -> int:
    value = _u32("head_dim", head_dim)
    if value == 0 or value % GROUP_ELEMS != 0:
        raise ValueError(f"head_dim = {value} is not a positive multiple of {GROUP_ELEMS}")
    return value


def _check_nonzero(name: str, value: Any) -> int:
    number = _u32(name, value)
    if number == 0:
        raise ValueError(f"{name} = 0")
    return number


def _check_page_shape(block_size: Any, num_kv_heads: Any, head_dim: Any) -> tuple[int, int, int]:
    """``(block_size, num_kv_heads, head_dim)`` as ints, after the library's shape rules in its order."""
    head_dim = _check_head_dim(head_dim)
    num_kv_heads = _check_nonzero("num_kv_heads", num_kv_heads)
    return _check_nonzero("block_size", block_size), num_kv_heads, head_dim


def _check_row_stride(name: str, stride: Any, row_elems: int) -> int:
    """A token-row stride (``key_stride``, ``value_stride``, elements): rows must not overlap."""
    value = _u32(name, stride)
    if value < row_elems:
        raise ValueError(f"{name} = {value} is smaller than a row ({row_elems} elements)")
    return value


def _check_k_scale(k_scale: Any) -> None:
    scale = _f32("k_scale", k_scale)
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"k_scale = {float(scale):g} must be finite and positive")


def _check_k_reciprocal(k_scale: Any) -> None:
    """The write multiplies by ``1/k_scale`` (FORMAT.md §2): below ~2^-128 that is inf in float32, and a
    zero key would become NaN."""
    scale = _f32("k_scale", k_scale)
    with np.errstate(over="ignore", divide="ignore"):
        reciprocal = np.float32(1.0) / scale
    if not np.isfinite(reciprocal):
        raise ValueError(f"k_scale = {float(scale):g} is too small: 1/k_scale overflows float")


def _check_score_scale(inv_sqrt_d: Any, k_scale: Any) -> None:
    """The kernels scale scores by ``inv_sqrt_d · k_scale`` in float32: it must be finite, and a nonzero
    ``inv_sqrt_d`` must not make it 0 (every score would be)."""
    inv, scale = _f32("inv_sqrt_d", inv_sqrt_d), _f32("k_scale", k_scale)
    if not np.isfinite(inv):
        raise ValueError(f"inv_sqrt_d = {float(inv):g} is not finite")
    with np.errstate(over="ignore", under="ignore"):
        product = inv * scale
    if not np.isfinite(product):
        raise ValueError(f"inv_sqrt_d * k_scale = {float(inv):g} * {float(scale):g} overflows float")
    if inv != 0 and product == 0:
        raise ValueError(f"inv_sqrt_d * k_scale = {float(inv):g} * {float(scale):g} underflows float to 0")


def _check_finite_non_negative(name: str, value: Any) -> None:
    """``sparse_v_threshold`` and ``soft_cap``: 0 is off, and every other value must be a real threshold."""
    number = _f32(name, value)
    if not (np.isfinite(number) and number >= 0):
        raise ValueError(f"{name} = {float(number):g} must be finite and >= 0")


def _check_rotation(rotation: Any, head_dim: int) -> None:
    """``rotation`` (the C ``v_rotation``): a bool; on, FORMAT.md §6 must define it for ``head_dim``."""
    if not isinstance(rotation, (bool, np.bool_)):
        raise TypeError(f"rotation = {rotation!r} is not a bool (False: none, True: Hadamard)")
    if rotation:
        _check_rotation_dim(head_dim)


def _check_encoder(encoder: Any) -> None:
    if not isinstance(encoder, str) or encoder not in V_ENCODERS:
        raise ValueError(f"encoder = {encoder!r} is not one of {', '.join(V_ENCODERS)}")


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _float_data(name: str, values: ArrayLike) -> NDArray:
    """``values`` as an array of floating-point data: integers are not data (bf16 bits are not values)."""
    array = np.asarray(values)
    if array.dtype.kind != "f" and array.dtype != _BFLOAT16:
        raise TypeError(f"{name} has dtype {array.dtype}, not floating-point data (float32 or bfloat16)")
    return array


def _integers(name: str, values: ArrayLike, low: int, high: int, what: str) -> NDArray:
    """``values`` as an integer array whose entries are all ``what``, i.e. in ``[low, high]``. Nothing is
    wrapped or truncated: another dtype is a TypeError, an entry outside the range a ValueError."""
    array = np.asarray(values)
    if array.size == 0:  # an empty list has no dtype to judge
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {array.dtype}, not an integer dtype")
    dtype_range = np.iinfo(array.dtype)
    if low <= dtype_range.min and dtype_range.max <= high:  # every value of the dtype is one
        return array
    if int(array.min()) < low or int(array.max()) > high:
        bad = next(int(v) for v in array.flat if not low <= int(v) <= high)
        raise ValueError(f"{name} holds {bad}, which is not {what}")
    return array


def _bytes(name: str, values: ArrayLike) -> NDArray[np.uint8]:
    return _integers(name, values, 0, 255, "a byte (0 ... 255)").astype(np.uint8, copy=False)


def _index_array(name: str, values: ArrayLike, c_type: type[np.integer]) -> NDArray[np.int64]:
    """Slots, page ids, lengths or offsets as int64, each entry within the C type the library reads."""
    limits = np.iinfo(c_type)
    return _integers(name, values, int(limits.min), int(limits.max), f"an {limits.dtype}").astype(np.int64)


def _pool(name: str, pool: Any) -> NDArray[np.uint8]:
    """A K or V pool: a flat uint8 NumPy array (the write edits it in place)."""
    if not (isinstance(pool, np.ndarray) and pool.dtype == np.uint8 and pool.ndim == 1):
        found = f"dtype {pool.dtype}, shape {pool.shape}" if isinstance(pool, np.ndarray) else type(pool).__name__
        raise TypeError(f"{name} must be a flat uint8 NumPy array (a pool), not {found}")
    return pool


def _check_last_axis(name: str, array: NDArray, multiple: int, unit: str) -> int:
    """The length of ``array``'s last axis, a multiple of ``multiple`` ``unit``."""
    if array.ndim == 0 or array.shape[-1] % multiple != 0:
        raise ValueError(f"{name} has shape {array.shape}: its last axis must be a multiple of {multiple} {unit}")
    return array.shape[-1]


def _check_entries(name: str, array: NDArray, count: int, count_name: str) -> None:
    if array.size < count:
        raise ValueError(f"{name} has {array.size} entries, fewer than {count_name} = {count}")


def _token_rows(name: str, values: ArrayLike, num_rows: int, stride_name: str, stride: int,
                row_elems: int) -> NDArray:
    """``values`` as flat data holding ``num_rows`` rows of ``row_elems`` elements, ``stride`` apart."""
    flat = _float_data(name, values).reshape(-1)
    needed = (num_rows - 1) * stride + row_elems if num_rows > 0 else 0
    if flat.size < needed:
        raise ValueError(f"{name} has {flat.size} elements: {num_rows} rows of {row_elems}, {stride_name} = {stride} "
                         f"apart, need {needed}")
    return flat




def _check_q_heads(num_q_heads: Any, num_kv_heads: int) -> int:
    """GQA (FORMAT.md §1): query head ``h`` reads KV head ``h // G``; at most `_MAX_Q_HEADS` of them."""
    value = _u32("num_q_heads", num_q_heads)
    if value == 0 or value % num_kv_heads != 0:
        raise ValueError(f"num_q_heads = {value} is not a positive multiple of num_kv_heads = {num_kv_heads}")
    if value > _MAX_Q_HEADS:
        raise ValueError(f"num_q_heads = {value} exceeds {_MAX_Q_HEADS}")
    return value


def _check_table_width(max_blocks_per_seq: Any, block_size: int) -> int:
    """``max_blocks_per_seq``: at least one page, and at most `I32_MAX` positions per table row (the kernels' int32)."""
    value = _check_nonzero("max_blocks_per_seq", max_blocks_per_seq)
    if value * block_size > I32_MAX:
        raise ValueError(f"max_blocks_per_seq * block_size = {value} * {block_size} exceeds 2^31 - 1 positions")
    return value


def _check_q_stride(q_stride: Any, q_row_elems: int) -> int:
    value = _u32("q_stride", q_stride)
    if value < q_row_elems:
        raise ValueError(f"q_stride = {value} is smaller than num_q_heads * head_dim = {q_row_elems}")
    return value


def _block_tables(block_tables: ArrayLike, num_seqs: int, max_blocks_per_seq: int) -> NDArray[np.int64]:
    """``block_tables`` as ``[num_seqs, max_blocks_per_seq]`` int32 page ids (row-major, FORMAT.md §5)."""
    tables = _index_array("block_tables", block_tables, np.int32)
    if tables.size != num_seqs * max_blocks_per_seq:
        raise ValueError(f"block_tables has {tables.size} entries, not num_seqs * max_blocks_per_seq = "
                         f"{num_seqs} * {max_blocks_per_seq}")
    return tables.reshape(num_seqs, max_blocks_per_seq)


def _check_rotation_dim(head_dim: int) -> None:
    if head_dim not in ROTATION_HEAD_DIMS:
        dims = ", ".join(map(str, ROTATION_HEAD_DIMS[:-1])) + f" or {ROTATION_HEAD_DIMS[-1]}"
        raise ValueError(f"the rotation needs head_dim {dims} (the format's sign tables), not head_dim = {head_dim}")

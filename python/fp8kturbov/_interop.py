"""Array arguments of the tensor API, whatever their protocol, and the checks every call makes.

Arrays are recognised in this order:

- ``torch.Tensor``, read through its own attributes (torch's ``__cuda_array_interface__`` has no
  bfloat16);
- ``cupy.ndarray`` (bfloat16 is CuPy 14's ``ml_dtypes.bfloat16``);
- any object with ``__cuda_array_interface__`` (bfloat16 as typestr ``'<V2'``, what
  ``ml_dtypes.bfloat16`` exports); the device is asked from the CUDA driver, since CAI omits it;
- any object with ``__dlpack__`` and ``__dlpack_device__`` on ``kDLCUDA`` or ``kDLCUDAManaged``
  (bfloat16 is ``kDLBfloat``, 16 bits).

torch and CuPy are never imported here: an object can only be a torch tensor if torch is already
imported. Strides of an `ArrayArgument` are in ELEMENTS.
"""

from __future__ import annotations

import ctypes
import enum
import math
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from . import _device
from ._errors import ArgumentError, InvalidValueError, Status
from ._lib import VEncoder, VRotation
from ._limits import MAX_Q_LEN, ROTATION_HEAD_DIMS
from ._scalars import U64_MAX, integer
from .layout import CacheLayout


# ---- One array argument, whatever the protocol --------------------------------------------------
@dataclass(frozen=True)
class ArrayArgument:
    """What a launch needs of one array argument."""

    name: str
    kind: str                  # "torch", "cupy", "cai" or "dlpack"
    ptr: int                   # device address of element 0
    dtype: str                 # NumPy-style name: "bfloat16", "int64", "int32", "uint8", ...
    itemsize: int              # bytes per element
    shape: tuple[int, ...]
    strides: tuple[int, ...]   # ELEMENTS
    device: int | None         # CUDA ordinal; None where the protocol does not say (CAI)
    readonly: bool = False
    stream: int | None = None  # the producer's stream (CAI v3), which the launch must follow

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def instance_of(obj: Any, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module``."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _from_torch(name: str, tensor: Any) -> ArrayArgument:
    if not tensor.is_cuda:
        raise ArgumentError(name, f"a tensor on {tensor.device}", "CUDA device memory")
    return ArrayArgument(name, "torch", tensor.data_ptr(), str(tensor.dtype).removeprefix("torch."),
                  tensor.element_size(), tuple(tensor.shape), tuple(tensor.stride()),
                  tensor.device.index)


def _from_cupy(name: str, array: Any) -> ArrayArgument:
    # CuPy strides are bytes, always whole elements.
    return ArrayArgument(name, "cupy", array.data.ptr, array.dtype.name, array.itemsize,
                  tuple(array.shape), tuple(s // array.itemsize for s in array.strides),
                  array.device.id)


def _cai_dtype(typestr: str) -> tuple[str, int]:
    """(name, bytes per element) of a CAI ``typestr``. bfloat16 has no NumPy type code: it arrives
    as ``'<V2'``, which is what ``ml_dtypes.bfloat16`` exports."""
    if typestr == "<V2":
        return "bfloat16", 2
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        return f"typestr {typestr!r}", 1
    if dtype.byteorder == ">":
        return f"big-endian {dtype.name}", dtype.itemsize
    return dtype.name, dtype.itemsize


#: The CUDA Array Interface versions read (3 added "stream"), and the values its "stream" may not
#: take: 0 is ambiguous (legacy or per-thread default), which version 3 forbids.
CAI_VERSIONS = (0, 1, 2, 3)


def _is_int(value: Any) -> bool:
    return integer(value) is not None


def _cai_ints(value: Any, count: int | None) -> bool:
    """Whether ``value`` is a tuple (or list) of ``count`` (any number where None) ints."""
    return (isinstance(value, (tuple, list)) and (count is None or len(value) == count)
            and all(_is_int(v) for v in value))


def _check_cai(name: str, interface: Any) -> None:
    """Refuse a ``__cuda_array_interface__`` that breaks the interface's rules (version 3, read to
    the letter), naming the argument and the field."""
    def refuse(found: str, expected: str) -> ArgumentError:
        return ArgumentError(name, f"__cuda_array_interface__ {found}", expected)

    if not isinstance(interface, dict):
        raise refuse(f"of type {type(interface).__name__}", "a dict")
    missing = [key for key in ("version", "shape", "typestr", "data") if key not in interface]
    if missing:
        raise refuse(f"without {', '.join(map(repr, missing))}", "the keys version, shape, typestr and data")
    version = interface["version"]
    if not _is_int(version) or int(version) not in CAI_VERSIONS:
        raise refuse(f"version {version!r}", f"one of {', '.join(map(str, CAI_VERSIONS))}")
    shape = interface["shape"]
    if not _cai_ints(shape, None) or any(int(size) < 0 for size in shape):
        raise refuse(f"shape {shape!r}", "a tuple of sizes >= 0")
    if not isinstance(interface["typestr"], str):
        raise refuse(f"typestr {interface['typestr']!r}", "a string")
    data = interface["data"]
    if (not isinstance(data, (tuple, list)) or len(data) != 2 or not _is_int(data[0])
            or not 0 <= int(data[0]) <= U64_MAX or not isinstance(data[1], (bool, np.bool_))):
        raise refuse(f"data {data!r}", "(pointer, read-only flag): an int in [0, 2^64) and a bool")
    strides = interface.get("strides")
    if strides is not None and not _cai_ints(strides, len(shape)):
        raise refuse(f"strides {strides!r}", f"None or {len(shape)} ints (one per dimension)")
    if "stream" in interface and interface["stream"] is not None:
        stream = interface["stream"]
        if int(version) < 3:
            raise refuse(f"stream in version {version}", "no stream before version 3")
        if not _is_int(stream) or not 0 < int(stream) <= U64_MAX:
            raise refuse(f"stream {stream!r}", "None or a handle in [1, 2^64) (0 is not allowed)")


def _from_cai(name: str, interface: Any) -> ArrayArgument:
    _check_cai(name, interface)
    if interface.get("mask") is not None:
        raise ArgumentError(name, "a masked array", "no mask")
    dtype, itemsize = _cai_dtype(interface["typestr"])
    shape = tuple(int(size) for size in interface["shape"])
    ptr, readonly = interface["data"]
    byte_strides = interface.get("strides")
    if byte_strides is None:
        strides = _c_strides(shape)
    elif any(int(s) % itemsize for s in byte_strides):
        raise ArgumentError(name, f"strides {list(byte_strides)} bytes",
                            f"multiples of the {itemsize}-byte element")
    else:
        strides = tuple(int(s) // itemsize for s in byte_strides)
    stream = interface.get("stream")  # v3; absent before
    return ArrayArgument(name, "cai", int(ptr), dtype, itemsize, shape, strides, None,
                  bool(readonly), None if stream is None else int(stream))


# DLPack (dlpack.h): the structs a capsule points to, the dtype codes and device types used here.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version_major", ctypes.c_uint32), ("version_minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DL_FLAG_READ_ONLY = 1
_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13
_DL_DEVICE_NAMES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 10: "kDLROCM",
                    13: "kDLCUDAManaged"}
_DL_DTYPES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
              (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
              (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16"}
# Own prototypes rather than ctypes.pythonapi's shared ones, whose argtypes other code may set.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _dl_tensor(name: str, capsule: Any) -> tuple[_DLTensor, bool]:
    """The DLTensor inside a ``__dlpack__`` capsule (valid while the capsule lives) and whether
    the producer marked it read-only. The capsule is not consumed: when it is collected, its
    destructor calls the producer's deleter."""
    label = _capsule_name(capsule)
    address = _capsule_pointer(capsule, label)
    if label == b"dltensor":  # DLManagedTensor starts with its DLTensor
        return _DLTensor.from_address(address), False
    if label == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(address)
        return managed.dl_tensor, bool(managed.flags & _DL_FLAG_READ_ONLY)
    raise TypeError(f"{name}: __dlpack__ returned a capsule named {label!r}, expected 'dltensor'")


def from_dlpack(name: str, obj: Any, dlpack_stream: int) -> tuple[ArrayArgument, Any]:
    """The array and its capsule, which the caller keeps until the launch is queued."""
    device_type, device_id = (int(v) for v in obj.__dlpack_device__())
    if device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        label = _DL_DEVICE_NAMES.get(device_type, "not CUDA")
        raise ArgumentError(name, f"DLPack device type {device_type} ({label})",
                            "CUDA device memory (kDLCUDA or kDLCUDAManaged)")
    capsule = obj.__dlpack__(stream=dlpack_stream)
    tensor, readonly = _dl_tensor(name, capsule)
    # The capsule's own device rules: a producer whose __dlpack_device__ says CUDA but whose
    # tensor lies elsewhere would hand the kernels a host pointer.
    if tensor.device.device_type != device_type or tensor.device.device_id != device_id:
        found = _DL_DEVICE_NAMES.get(tensor.device.device_type, f"type {tensor.device.device_type}")
        raise ArgumentError(name, f"a DLPack capsule on {found} device {tensor.device.device_id}",
                            f"the device its __dlpack_device__ names ({_DL_DEVICE_NAMES[device_type]} "
                            f"device {device_id})")
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _DL_DTYPES.get((code, bits)) if lanes == 1 else None
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = (tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides
               else _c_strides(shape))  # NULL strides: row-major
    array = ArrayArgument(name, "dlpack", (tensor.data or 0) + tensor.byte_offset,
                   dtype or f"DLPack dtype (code {code}, bits {bits}, lanes {lanes})",
                   max(1, bits * lanes // 8), shape, strides, tensor.device.device_id, readonly)
    return array, capsule


def describe(name: str, obj: Any) -> ArrayArgument | None:
    """``obj`` described; None for a DLPack-only object, which is exported once the launch stream
    is known (the export takes it)."""
    if instance_of(obj, "torch", "Tensor"):
        return _from_torch(name, obj)
    if instance_of(obj, "cupy", "ndarray"):
        return _from_cupy(name, obj)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cai(name, interface)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return None
    raise TypeError(f"{name}: {type(obj).__name__} is not an array: expected a torch tensor, a "
                    f"CuPy array, or an object with __cuda_array_interface__ or __dlpack__")


def describe_now(name: str, obj: Any) -> ArrayArgument:
    """``obj`` described outside a launch (pools): DLPack exports ask for no synchronisation
    (stream -1), and the capsule is dropped at once because ``obj`` keeps owning the memory."""
    array = describe(name, obj)
    return array if array is not None else from_dlpack(name, obj, -1)[0]


# ---- Checks -------------------------------------------------------------------------------------
def _is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major contiguous, ignoring the stride of dims of size 1 (as torch does)."""
    if 0 in shape:
        return True
    step = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def check_array(array: ArrayArgument, dtype: str | None, shape: tuple[int | None, ...],
                 shape_text: str, *, dense_from: int = 0) -> None:
    """``array`` has ``dtype`` (None: any), a shape matching ``shape`` (None: any size there),
    and row-major contiguous dims from ``dense_from`` on."""
    if dtype is not None and array.dtype != dtype:
        raise ArgumentError(array.name, f"dtype {array.dtype}", dtype)
    if len(array.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(array.shape, shape)):
        raise ArgumentError(array.name, f"shape {list(array.shape)}", shape_text)
    if not _is_dense(array.shape[dense_from:], array.strides[dense_from:]):
        dense = ["*"] * dense_from + list(_c_strides(array.shape[dense_from:]))
        raise ArgumentError(array.name, f"strides {list(array.strides)} (elements)",
                            f"[{', '.join(map(str, dense))}] (contiguous)")


def check_writable(array: ArrayArgument) -> None:
    if array.readonly:
        raise ArgumentError(array.name, "a read-only array", "writable memory")


def row_stride(array: ArrayArgument, row_elems: int) -> int:
    """Elements from one row (dim 0) to the next. With at most one row the stride means nothing
    (torch reports anything for a dim of size 1) and the dense one is passed."""
    if array.shape[0] <= 1:
        return row_elems
    if array.strides[0] < row_elems:
        raise ArgumentError(array.name, f"row stride {array.strides[0]} elements",
                            f">= {row_elems} (rows must not overlap)")
    return array.strides[0]


def check_token_rows(array: ArrayArgument, layout: CacheLayout) -> int:
    """bf16 ``[num_tokens, H*D]`` or ``[num_tokens, H, D]`` with dense rows; the row stride is
    free. Returns it, in elements."""
    heads, dim = layout.num_kv_heads, layout.head_dim
    shape = (None, heads, dim) if len(array.shape) == 3 else (None, heads * dim)
    check_array(array, "bfloat16", shape,
                 f"[num_tokens, {heads * dim}] or [num_tokens, {heads}, {dim}]", dense_from=1)
    return row_stride(array, heads * dim)


def check_max_q_len(max_q_len: Any) -> int:
    """``max_q_len`` as an int in ``1..MAX_Q_LEN`` (a host value: the library never reads
    ``query_start`` on the host)."""
    try:
        value = None if isinstance(max_q_len, bool) else operator.index(max_q_len)
    except TypeError:
        value = None
    if value is None or not 1 <= value <= MAX_Q_LEN:
        raise ArgumentError("max_q_len", repr(max_q_len), f"an int in 1..{MAX_Q_LEN}")
    return value


def positive_finite(name: str, value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise InvalidValueError(Status.INVALID_VALUE,
                                f"{name} = {value!r}, expected finite and > 0")
    return value


def common_device(arrays: Iterable[ArrayArgument], device: int | None, owner: str) -> int | None:
    """The one device all ``arrays`` are on; ``device`` (that of ``owner``) when already known."""
    for array in arrays:
        found = array.device if array.device is not None else _device.pointer_device(array.name, array.ptr)
        if found is None:
            continue
        if device is None:
            device, owner = found, array.name
        elif found != device:
            raise ArgumentError(array.name, f"memory on CUDA device {found}",
                                f"device {device} (that of {owner})")
    return device


# ---- Options ------------------------------------------------------------------------------------
E = TypeVar("E", bound=enum.Enum)


def _enum_option(name: str, value: Any, options: type[E]) -> E:
    """``value`` as a member of the enum ``options``: a member, or a member's lower-case name."""
    if isinstance(value, options):
        return value
    names = [member.name.lower() for member in options]
    if isinstance(value, str) and value in names:
        return options[value.upper()]
    raise ArgumentError(name, repr(value), f"a {options.__name__} or one of {', '.join(map(repr, names))}")


def v_rotation_option(v_rotation: Any, layout: CacheLayout) -> VRotation:
    """``v_rotation`` as a :class:`VRotation` (or its lower-case name), defined for the layout."""
    v_rotation = _enum_option("v_rotation", v_rotation, VRotation)
    if v_rotation != VRotation.NONE and layout.head_dim not in ROTATION_HEAD_DIMS:
        raise ArgumentError("v_rotation", v_rotation.name.lower(),
                            f"none for head_dim {layout.head_dim} (FORMAT.md §6 rotates {ROTATION_HEAD_DIMS})")
    return v_rotation


def v_encoder_option(v_encoder: Any) -> VEncoder:
    return _enum_option("v_encoder", v_encoder, VEncoder)

"""Tensor-level API: arrays in, checked, launched through :mod:`fp8kturbov.ops`.

``write_kv``, ``paged_decode`` and ``dequantize_kv`` take arrays instead of raw pointers, check
dtype, shape, strides and device (an :class:`ArgumentError` names the argument, what was found and
what was expected), and call the generic launchers ``ops.reshape_and_cache`` /
``ops.paged_decode_attn`` / ``ops.dequantize``.
:class:`KVCache` holds one layer's K and V pools with their :class:`CacheLayout` and ``k_scale``,
and in checked mode the error word its launches report out-of-range indices in
(:mod:`fp8kturbov.checked`).

Arrays are recognised in this order:

- ``torch.Tensor``, read through its own attributes (torch's ``__cuda_array_interface__`` has no
  bfloat16);
- ``cupy.ndarray`` (bfloat16 is CuPy 14's ``ml_dtypes.bfloat16``);
- any object with ``__cuda_array_interface__`` (bfloat16 as typestr ``'<V2'``, what
  ``ml_dtypes.bfloat16`` exports); the device is asked from the CUDA driver, since CAI omits it;
- any object with ``__dlpack__`` and ``__dlpack_device__`` on ``kDLCUDA`` or ``kDLCUDAManaged``
  (bfloat16 is ``kDLBfloat``, 16 bits).

torch and CuPy are never imported here except to allocate for their backend: an object can only
be a torch tensor if torch is already imported.

Streams. A call launches on the first of:

1. the ``stream`` argument (anything ``ops.stream_handle`` takes, or a ``torch.cuda.Stream`` /
   ``cupy.cuda.Stream``);
2. the stream of the first array argument that has one, in signature order: a torch tensor gives
   ``torch.cuda.current_stream(device)``, a CuPy array ``cupy.cuda.get_current_stream(device)``,
   a CAI v3 object its ``stream`` field (1 = legacy default, 2 = per-thread default);
3. the legacy default stream (0).

Ordering after the producers, never by host synchronisation: when a CAI object names a stream
other than the launch stream, an event is recorded on that stream and the launch stream waits for
it (CAI v3 requires the consumer to do so). DLPack objects are exported with
``__dlpack__(stream=launch stream)``, which makes the producer order its own work first (DLPack's
rule). Torch tensors and CuPy arrays carry no producer stream: as with torch's own operators, work
on the current stream is ordered, and a caller passing another ``stream`` orders it itself. The
cache's pools are described once, when the :class:`KVCache` is built, and take no part.

Units: ``*_bytes`` are bytes; strides of arrays are passed to the library in ELEMENTS. Launches
are asynchronous: every array must stay alive, and with stream-ordered allocators unreused, until
the launch stream has passed the call, as for any CUDA kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import importlib
import math
import operator
import sys
import weakref
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import ops
from ._errors import CudaError, InvalidValueError, Status
from ._lib import ROTATION_HEAD_DIMS, VEncoder, VRotation
from .layout import CacheLayout

if TYPE_CHECKING:
    from .checked import ErrorWord

__all__ = ["ArgumentError", "DeviceBuffer", "KVCache", "dequantize_kv", "paged_decode", "write_kv"]

BACKENDS = ("torch", "cupy", "cuda")
#: The library's limit on the query rows of one sequence in a multi-token decode (``max_q_len``).
MAX_Q_LEN = 16


class ArgumentError(InvalidValueError):
    """An array argument is not what the call needs (memory kind, dtype, shape, strides, device).

    ``argument`` is the parameter's name; ``found`` and ``expected`` describe the mismatch."""

    def __init__(self, argument: str, found: str, expected: str) -> None:
        super().__init__(Status.INVALID_VALUE, f"{argument}: {found}, expected {expected}")
        self.argument = argument
        self.found = found
        self.expected = expected


# ---- One array argument, whatever the protocol --------------------------------------------------
@dataclass(frozen=True)
class _Array:
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


def _instance_of(obj: Any, module: str, cls: str) -> bool:
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


def _from_torch(name: str, tensor: Any) -> _Array:
    if not tensor.is_cuda:
        raise ArgumentError(name, f"a tensor on {tensor.device}", "CUDA device memory")
    return _Array(name, "torch", tensor.data_ptr(), str(tensor.dtype).removeprefix("torch."),
                  tensor.element_size(), tuple(tensor.shape), tuple(tensor.stride()),
                  tensor.device.index)


def _from_cupy(name: str, array: Any) -> _Array:
    # CuPy strides are bytes, always whole elements.
    return _Array(name, "cupy", array.data.ptr, array.dtype.name, array.itemsize,
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


def _from_cai(name: str, interface: dict[str, Any]) -> _Array:
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
    return _Array(name, "cai", int(ptr or 0), dtype, itemsize, shape, strides, None,
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


def _from_dlpack(name: str, obj: Any, dlpack_stream: int) -> tuple[_Array, Any]:
    """The array and its capsule, which the caller keeps until the launch is queued."""
    device_type, _ = (int(v) for v in obj.__dlpack_device__())
    if device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        label = _DL_DEVICE_NAMES.get(device_type, "not CUDA")
        raise ArgumentError(name, f"DLPack device type {device_type} ({label})",
                            "CUDA device memory (kDLCUDA or kDLCUDAManaged)")
    capsule = obj.__dlpack__(stream=dlpack_stream)
    tensor, readonly = _dl_tensor(name, capsule)
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _DL_DTYPES.get((code, bits)) if lanes == 1 else None
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = (tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides
               else _c_strides(shape))  # NULL strides: row-major
    array = _Array(name, "dlpack", (tensor.data or 0) + tensor.byte_offset,
                   dtype or f"DLPack dtype (code {code}, bits {bits}, lanes {lanes})",
                   max(1, bits * lanes // 8), shape, strides, tensor.device.device_id, readonly)
    return array, capsule


def _describe(name: str, obj: Any) -> _Array | None:
    """``obj`` described; None for a DLPack-only object, which is exported once the launch stream
    is known (the export takes it)."""
    if _instance_of(obj, "torch", "Tensor"):
        return _from_torch(name, obj)
    if _instance_of(obj, "cupy", "ndarray"):
        return _from_cupy(name, obj)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cai(name, interface)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return None
    raise TypeError(f"{name}: {type(obj).__name__} is not an array: expected a torch tensor, a "
                    f"CuPy array, or an object with __cuda_array_interface__ or __dlpack__")


def _describe_now(name: str, obj: Any) -> _Array:
    """``obj`` described outside a launch (pools): DLPack exports ask for no synchronisation
    (stream -1), and the capsule is dropped at once because ``obj`` keeps owning the memory."""
    array = _describe(name, obj)
    return array if array is not None else _from_dlpack(name, obj, -1)[0]


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


def _check_array(array: _Array, dtype: str | None, shape: tuple[int | None, ...],
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


def _check_writable(array: _Array) -> None:
    if array.readonly:
        raise ArgumentError(array.name, "a read-only array", "writable memory")


def _row_stride(array: _Array, row_elems: int) -> int:
    """Elements from one row (dim 0) to the next. With at most one row the stride means nothing
    (torch reports anything for a dim of size 1) and the dense one is passed."""
    if array.shape[0] <= 1:
        return row_elems
    if array.strides[0] < row_elems:
        raise ArgumentError(array.name, f"row stride {array.strides[0]} elements",
                            f">= {row_elems} (rows must not overlap)")
    return array.strides[0]


def _check_token_rows(array: _Array, layout: CacheLayout) -> int:
    """bf16 ``[num_tokens, H*D]`` or ``[num_tokens, H, D]`` with dense rows; the row stride is
    free. Returns it, in elements."""
    heads, dim = layout.num_kv_heads, layout.head_dim
    shape = (None, heads, dim) if len(array.shape) == 3 else (None, heads * dim)
    _check_array(array, "bfloat16", shape,
                 f"[num_tokens, {heads * dim}] or [num_tokens, {heads}, {dim}]", dense_from=1)
    return _row_stride(array, heads * dim)


def _check_max_q_len(max_q_len: Any) -> int:
    """``max_q_len`` as an int in ``1..MAX_Q_LEN`` (a host value: the library never reads
    ``query_start`` on the host)."""
    try:
        value = None if isinstance(max_q_len, bool) else operator.index(max_q_len)
    except TypeError:
        value = None
    if value is None or not 1 <= value <= MAX_Q_LEN:
        raise ArgumentError("max_q_len", repr(max_q_len), f"an int in 1..{MAX_Q_LEN}")
    return value


def _positive_finite(name: str, value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise InvalidValueError(Status.INVALID_VALUE,
                                f"{name} = {value!r}, expected finite and > 0")
    return value


# ---- The CUDA driver: device queries, contexts, stream ordering, cuMemAlloc ---------------------
@functools.cache
def _driver() -> Any:
    """``cuda.bindings.driver`` after ``cuInit``, or None where no driver or device is usable:
    then nothing is asked of it and a launch reports CUDA_ERROR from the library."""
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
    except Exception:  # no cuda-python, or no driver library at all
        return None
    return driver if err == driver.CUresult.CUDA_SUCCESS else None


def _cu(result: tuple, call: str) -> Any:
    """The value of a cuda.bindings call ``(CUresult, *values)``; CudaError on failure."""
    err, *values = result
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorName(err)
        raise CudaError(Status.CUDA_ERROR, f"{call}: {text.decode() if text else int(err)}")
    return values[0] if values else None


def _require_driver() -> Any:
    driver = _driver()
    if driver is None:
        raise CudaError(Status.CUDA_ERROR, "no usable CUDA driver (cuInit failed)")
    return driver


def _pointer_device(name: str, ptr: int) -> int | None:
    """CUDA device ordinal of the allocation holding ``ptr``; None where the driver cannot tell
    (no driver, no context current): the library then reports what goes wrong at launch."""
    driver = _driver()
    if driver is None or ptr == 0:
        return None
    err, ordinal = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:  # not allocated, mapped or registered
        raise ArgumentError(name, f"address {ptr:#x}, unknown to the CUDA driver",
                            "CUDA device memory")
    return int(ordinal) if err == driver.CUresult.CUDA_SUCCESS else None


def _common_device(arrays: Iterable[_Array], device: int | None, owner: str) -> int | None:
    """The one device all ``arrays`` are on; ``device`` (that of ``owner``) when already known."""
    for array in arrays:
        found = array.device if array.device is not None else _pointer_device(array.name, array.ptr)
        if found is None:
            continue
        if device is None:
            device, owner = found, array.name
        elif found != device:
            raise ArgumentError(array.name, f"memory on CUDA device {found}",
                                f"device {device} (that of {owner})")
    return device


@contextlib.contextmanager
def _primary_context(device: int) -> Iterator[Any]:
    """``device``'s primary context current on this thread (and retained) inside the block."""
    driver = _require_driver()
    handle = _cu(driver.cuDeviceGet(device), "cuDeviceGet")
    context = _cu(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    try:
        _cu(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
        try:
            yield driver
        finally:
            driver.cuCtxPopCurrent()
    finally:
        driver.cuDevicePrimaryCtxRelease(handle)


@contextlib.contextmanager
def _on_device(device: int | None) -> Iterator[None]:
    """Launch with the arrays' device current, like torch's device guard: the library launches
    in the current context (and sizes workspaces for its device)."""
    driver = _driver()
    if driver is not None and device is not None:
        err, current = driver.cuCtxGetDevice()
        if err != driver.CUresult.CUDA_SUCCESS or int(current) != device:
            with _primary_context(device):
                yield
            return
    yield


def _same_stream(a: int, b: int) -> bool:
    """0 and 1 both name the legacy default stream (1 is how CAI and DLPack write it)."""
    return (a if a > 1 else 0) == (b if b > 1 else 0)


def _stream_wait(consumer: int, producer: int) -> None:
    """Work queued on ``consumer`` from now on waits for the work queued on ``producer`` so far:
    an event, device-side; the host does not wait."""
    driver = _require_driver()
    event = _cu(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    try:
        _cu(driver.cuEventRecord(event, driver.CUstream(producer)), "cuEventRecord")
        _cu(driver.cuStreamWaitEvent(driver.CUstream(consumer), event, 0), "cuStreamWaitEvent")
    finally:
        driver.cuEventDestroy(event)  # allowed while pending: released once the device passes it


def _free_device_buffer(ptr: int, device: int) -> None:
    driver = _driver()
    if driver is None:
        return
    handle = _cu(driver.cuDeviceGet(device), "cuDeviceGet")
    with _primary_context(device):
        driver.cuMemFree(ptr)
    driver.cuDevicePrimaryCtxRelease(handle)  # the reference DeviceBuffer took at allocation


class DeviceBuffer:
    """``nbytes`` BYTES of uninitialised device memory from ``cuMemAlloc`` (the "cuda" backend).

    Freed by :meth:`close`, at the end of a ``with`` block, or when garbage-collected. Holds a
    reference on the device's primary context meanwhile (the memory lives in it). Exposes
    ``__cuda_array_interface__`` (1-D uint8, no stream), so it goes wherever an array does.
    ``cuMemFree`` may make the host wait for the device: free at teardown, not per step.
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.nbytes = int(nbytes)
        self.device = int(device)
        self.ptr = 0
        self._closed = False
        if self.nbytes < 0:
            raise ValueError(f"nbytes: {self.nbytes}, expected >= 0")
        if self.nbytes == 0:  # cuMemAlloc refuses 0 bytes; an empty buffer has no address
            self._finalizer = None
            return
        with _primary_context(self.device) as driver:
            self.ptr = int(_cu(driver.cuMemAlloc(self.nbytes), "cuMemAlloc"))
            # Our own reference: if the context's last one went, the memory would go with it.
            handle = _cu(driver.cuDeviceGet(self.device), "cuDeviceGet")
            _cu(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
        self._finalizer = weakref.finalize(self, _free_device_buffer, self.ptr, self.device)
        # At exit the process releases device memory anyway, and the driver may be gone.
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "stream": None, "version": 3}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the memory now (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self.ptr = 0
        self._closed = True

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeviceBuffer(nbytes={self.nbytes}, device={self.device}, ptr={self.ptr:#x})"


def _import_backend(backend: str) -> Any:
    try:
        return importlib.import_module(backend)
    except ImportError as exc:
        raise ImportError(f"backend={backend!r} needs the {backend} package: {exc}") from exc


def _allocate(backend: str, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    """Uninitialised device memory from ``backend`` on CUDA device ``device``: a dense torch or
    CuPy array of ``shape`` and ``dtype`` ("uint8" or "bfloat16"; CuPy's bfloat16 is
    ``ml_dtypes.bfloat16``, CuPy >= 14), or for "cuda" a :class:`DeviceBuffer` of ``shape[0]``
    BYTES (uint8 only)."""
    if backend == "torch":
        torch = _import_backend("torch")
        return torch.empty(shape, dtype=getattr(torch, dtype), device=torch.device("cuda", device))
    if backend == "cupy":
        cupy = _import_backend("cupy")
        if dtype == "bfloat16":
            element = importlib.import_module("ml_dtypes").bfloat16
        else:
            element = cupy.uint8
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=element)
    (nbytes,) = shape
    return DeviceBuffer(nbytes, device)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")


# ---- The cache object ---------------------------------------------------------------------------
@dataclass(eq=False)
class KVCache:
    """One layer's K and V pools (1-D uint8 device arrays), their layout and the K scale.

    Build it with :meth:`wrap` (pools the caller owns; the constructor does the same) or
    :meth:`allocate` (pools this object owns). ``k_pool``/``v_pool`` are the array objects;
    ``k_ptr``/``v_ptr`` their device addresses; ``device`` the CUDA ordinal (None where no driver
    can tell); ``backend`` where :meth:`decode_workspace` and :func:`dequantize_kv` allocate
    ("torch" or "cupy" for such pools, else "cuda"). Pool sizes are checked in BYTES against
    ``layout.k_pool_bytes`` / ``layout.v_pool_bytes`` (larger pools are accepted; the pages past
    ``num_blocks`` are unused).

    ``checked=True`` turns on checked mode (see :mod:`fp8kturbov.checked`): the cache owns an
    :class:`~fp8kturbov.ErrorWord` on its device (``error_word``; None when unchecked), and
    :func:`write_kv`, :func:`paged_decode` and :func:`dequantize_kv` on it pass
    ``num_blocks = layout.num_blocks`` and that word, so that slots and block-table entries
    outside the first ``layout.num_blocks`` pages are skipped instead of reaching past them.
    :meth:`check_errors` raises :class:`~fp8kturbov.CacheIndexError` for what was skipped; the
    launches never wait for the device, :meth:`check_errors` waits for the stream it is given.

    ``v_rotation`` (a :class:`~fp8kturbov.VRotation` or its lower-case name; head_dim 128, 256 or
    512 for "hadamard"): how V is kept, FORMAT.md §6. :func:`write_kv` rotates each V head before
    it is quantised and :func:`paged_decode` rotates each output head back, so a cache is always
    written and read the same way; :func:`dequantize_kv` returns V as stored (rotated).
    """

    k_pool: Any = field(repr=False)
    v_pool: Any = field(repr=False)
    layout: CacheLayout
    k_scale: float
    checked: bool = False
    v_rotation: VRotation = VRotation.NONE
    backend: str = field(init=False)
    device: int | None = field(init=False)
    k_ptr: int = field(init=False, repr=False)
    v_ptr: int = field(init=False, repr=False)
    owns_memory: bool = field(init=False, default=False)
    closed: bool = field(init=False, default=False)
    error_word: ErrorWord | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        self.k_scale = _positive_finite("k_scale", self.k_scale)
        _check_checked_mode(self.checked, self.layout)
        self.v_rotation = _v_rotation(self.v_rotation, self.layout)
        pools = (_describe_now("k_pool", self.k_pool), _describe_now("v_pool", self.v_pool))
        for pool, needed in zip(pools, (self.layout.k_pool_bytes, self.layout.v_pool_bytes)):
            _check_array(pool, "uint8", (None,), "[bytes] (1-D)")
            if pool.nbytes < needed:
                raise ArgumentError(pool.name, f"{pool.nbytes} bytes",
                                    f"at least layout.{pool.name}_bytes = {needed}")
            _check_writable(pool)
        self.device = _common_device(pools, None, "")
        self.k_ptr, self.v_ptr = pools[0].ptr, pools[1].ptr
        self.backend = pools[0].kind if pools[0].kind in ("torch", "cupy") else "cuda"
        if self.checked:
            from .checked import ErrorWord  # imported here: fp8kturbov.checked imports this module

            self.error_word = ErrorWord(self.device or 0)

    @classmethod
    def wrap(cls, k_pool: Any, v_pool: Any, layout: CacheLayout, k_scale: float, *,
             checked: bool = False, v_rotation: VRotation | str = VRotation.NONE) -> KVCache:
        """A cache over pools the caller allocated and keeps owning (any array kind of the
        module docstring; 1-D uint8, contiguous, writable, on one device). ``checked``,
        ``v_rotation``: see the class docstring."""
        return cls(k_pool, v_pool, layout, k_scale, checked, v_rotation)

    @classmethod
    def allocate(cls, layout: CacheLayout, k_scale: float, *, backend: str = "torch",
                 device: int = 0, checked: bool = False,
                 v_rotation: VRotation | str = VRotation.NONE) -> KVCache:
        """A cache with new, uninitialised pools from ``backend`` ("torch", "cupy", or "cuda" for
        ``cuMemAlloc`` through cuda.bindings) on CUDA device ``device``. The cache owns them:
        :meth:`close` (or the end of a ``with`` block) releases them; "cuda" memory is also freed
        when the pools are garbage-collected. ``checked``, ``v_rotation``: see the class docstring."""
        _check_backend(backend)
        _check_layout(layout)
        _positive_finite("k_scale", k_scale)
        _check_checked_mode(checked, layout)
        _v_rotation(v_rotation, layout)
        k_pool = _allocate(backend, (layout.k_pool_bytes,), "uint8", device)
        v_pool = _allocate(backend, (layout.v_pool_bytes,), "uint8", device)
        cache = cls(k_pool, v_pool, layout, k_scale, checked, v_rotation)
        cache.owns_memory = True
        return cache

    def decode_workspace(self, num_seqs: int, num_q_heads: int, max_blocks_per_seq: int,
                         sliding_window: int = 0, max_q_len: int = 1) -> Any:
        """Scratch for :func:`paged_decode` with this shape: ``ops.paged_decode_workspace_bytes``
        BYTES (sized for this cache's device, whose SM count sets the split and the head groups)
        of uninitialised memory from this cache's backend, as a 1-D uint8 array (a
        :class:`DeviceBuffer` for "cuda"; empty when neither would help). ``max_q_len`` (1..16):
        the query rows per sequence of a multi-token decode, as passed to :func:`paged_decode`
        with ``query_start`` (the workspace grows with it). Allocate once, reuse every step: a
        decode whose shape needs more than the buffer holds runs unsplit, one KV head per CTA
        (slower, no less correct)."""
        layout = _open(self).layout
        max_q_len = _check_max_q_len(max_q_len)
        with _on_device(self.device):
            nbytes = ops.paged_decode_workspace_bytes(
                max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs, num_q_heads=num_q_heads,
                q_stride=num_q_heads * layout.head_dim, sliding_window=sliding_window,
                k_scale=self.k_scale, max_q_len=max_q_len, **self._layout_args())
        return _allocate(self.backend, (nbytes,), "uint8", self.device or 0)

    def check_errors(self, stream: Any = None) -> None:
        """Raise :class:`~fp8kturbov.CacheIndexError` if the launches on this cache queued on
        ``stream`` so far met slots or block-table entries outside ``layout.num_blocks`` pages
        (or seq_lens or query_start out of range), after zeroing the error word for the next ones
        (:meth:`ErrorWord.check <fp8kturbov.ErrorWord.check>`). The host waits for ``stream``
        (any kind the launches take). An :class:`ArgumentError` if the cache is not checked."""
        if _open(self).error_word is None:
            raise ArgumentError("cache", "a KVCache built with checked=False",
                                "one built with checked=True")
        self.error_word.check(stream)

    def close(self) -> None:
        """Release the pools and the error word: owned "cuda" memory and the error word are
        freed, torch/CuPy memory goes back to its allocator once unreferenced, wrapped memory
        stays the caller's. Call it once the work on the pools is done. Idempotent; the cache
        is unusable afterwards."""
        if self.owns_memory:
            for pool in (self.k_pool, self.v_pool):
                if isinstance(pool, DeviceBuffer):
                    pool.close()
        if self.error_word is not None:
            self.error_word.close()
            self.error_word = None
        self.k_pool = self.v_pool = None
        self.k_ptr = self.v_ptr = 0
        self.closed = True

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _layout_args(self) -> dict[str, int]:
        """The launchers' layout arguments (counts; page strides and sections in BYTES)."""
        layout = self.layout
        return dict(num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_size=layout.block_size, v_bits=layout.v_bits,
                    k_block_stride_bytes=layout.k_block_stride_bytes,
                    v_block_stride_bytes=layout.v_block_stride_bytes,
                    v_data_section_bytes=layout.v_data_section_bytes)

    def _checked_args(self) -> dict[str, int]:
        """The launchers' checked-mode arguments: pages per pool and the error word's device
        address, or zeros (unchecked)."""
        if self.error_word is None:
            return dict(num_blocks=0, error_flags=0)
        return dict(num_blocks=self.layout.num_blocks, error_flags=self.error_word.ptr)


def _check_layout(layout: Any) -> None:
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout: {type(layout).__name__}, expected fp8kturbov.CacheLayout")


def _check_checked_mode(checked: Any, layout: CacheLayout) -> None:
    if not isinstance(checked, bool):
        raise TypeError(f"checked: {type(checked).__name__}, expected bool")
    if checked and layout.num_blocks == 0:  # to the library, num_blocks = 0 means unchecked
        raise ArgumentError("layout", "num_blocks = 0", "at least one page with checked=True")


def _open(cache: Any) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: {type(cache).__name__}, expected fp8kturbov.KVCache")
    if cache.closed:
        raise ArgumentError("cache", "a closed KVCache", "an open one")
    return cache


# ---- One call: its arrays and its stream --------------------------------------------------------
def _stream_argument(stream: Any) -> int:
    """The handle of an explicit ``stream``: torch and CuPy stream objects (older releases lack
    ``__cuda_stream__``), else whatever ``ops.stream_handle`` takes."""
    library = type(stream).__module__.partition(".")[0]
    if library == "torch" and hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if library == "cupy" and hasattr(stream, "ptr"):
        return int(stream.ptr)
    return ops.stream_handle(stream)


def _implied_stream(arrays: Iterable[_Array]) -> int:
    """Rule 2 of the module docstring, else the legacy default stream."""
    for array in arrays:
        if array.kind == "torch":
            return int(sys.modules["torch"].cuda.current_stream(array.device).cuda_stream)
        if array.kind == "cupy":
            return int(sys.modules["cupy"].cuda.get_current_stream(array.device).ptr)
        if array.stream is not None:
            return array.stream
    return 0


@dataclass
class _Call:
    """The array arguments of one call, described, and the stream it launches on."""

    arrays: dict[str, _Array]
    stream: int
    exports: list[Any]  # DLPack capsules, kept until the launch is queued

    @classmethod
    def gather(cls, stream: Any, **objects: Any) -> _Call:
        """Describe ``objects`` (None ones are left out), then pick the launch stream."""
        described = {name: _describe(name, obj) for name, obj in objects.items() if obj is not None}
        handle = (_stream_argument(stream) if stream is not None
                  else _implied_stream(a for a in described.values() if a is not None))
        exports = []
        for name, array in described.items():
            if array is None:
                # DLPack writes the legacy default stream as 1 (0 is ambiguous there).
                described[name], capsule = _from_dlpack(name, objects[name], handle or 1)
                exports.append(capsule)
        return cls(described, handle, exports)

    def __getitem__(self, name: str) -> _Array:
        return self.arrays[name]

    def get(self, name: str) -> _Array | None:
        return self.arrays.get(name)

    def wait_for_producers(self) -> None:
        """CAI v3: order the launch stream after every other stream an array names."""
        waited: list[int] = []
        for array in self.arrays.values():
            producer = array.stream
            if producer is None or _same_stream(producer, self.stream) or producer in waited:
                continue
            _stream_wait(self.stream, producer)
            waited.append(producer)

    @contextlib.contextmanager
    def launching(self, cache: KVCache) -> Iterator[None]:
        """Check the devices, then make the launch device current and the stream ordered."""
        device = _common_device(self.arrays.values(), cache.device, "cache")
        with _on_device(device):
            self.wait_for_producers()
            yield


# ---- The operations -----------------------------------------------------------------------------
def write_kv(key: Any, value: Any, cache: KVCache, slot_mapping: Any, *,
             k_scale: float | None = None, v_encoder: VEncoder | str = VEncoder.MATCHED_NORM,
             stream: Any = None) -> None:
    """Write token rows into the cache (``reshape_and_cache``, docs/format.md §4).

    ``key``, ``value``: bf16 ``[num_tokens, num_kv_heads*head_dim]`` or
    ``[num_tokens, num_kv_heads, head_dim]``, each row contiguous, any row stride (ELEMENTS) of
    at least a row. ``slot_mapping``: int64 ``[num_tokens]``, contiguous; ``slot = page *
    block_size + offset``, a negative slot writes nothing; on a checked cache a slot past
    ``layout.num_blocks`` pages is skipped and reported (:meth:`KVCache.check_errors`).
    ``k_scale`` defaults to ``cache.k_scale``. ``v_encoder``: a :class:`~fp8kturbov.VEncoder` or
    its lower-case name ("matched_norm", the default, or "mse"; the reference's ``encoder``).
    Streams: see the module docstring. Asynchronous; returns nothing.
    """
    layout = _open(cache).layout
    encoder = _v_encoder(v_encoder)
    call = _Call.gather(stream, key=key, value=value, slot_mapping=slot_mapping)
    key_stride = _check_token_rows(call["key"], layout)
    value_stride = _check_token_rows(call["value"], layout)
    num_tokens = call["key"].shape[0]
    if call["value"].shape[0] != num_tokens:
        raise ArgumentError("value", f"{call['value'].shape[0]} rows", f"{num_tokens} (as key)")
    _check_array(call["slot_mapping"], "int64", (num_tokens,), f"[{num_tokens}] (num_tokens)")
    with call.launching(cache):
        ops.reshape_and_cache(
            key=call["key"].ptr, value=call["value"].ptr, k_cache=cache.k_ptr,
            v_cache=cache.v_ptr, slot_mapping=call["slot_mapping"].ptr, num_tokens=num_tokens, key_stride=key_stride, value_stride=value_stride,
            k_scale=cache.k_scale if k_scale is None else k_scale, v_encoder=encoder,
            v_rotation=cache.v_rotation, stream=call.stream, **cache._layout_args(),
            **cache._checked_args())


E = TypeVar("E", bound=enum.Enum)


def _enum_option(name: str, value: Any, options: type[E]) -> E:
    """``value`` as a member of the enum ``options``: a member, or a member's lower-case name."""
    if isinstance(value, options):
        return value
    names = [member.name.lower() for member in options]
    if isinstance(value, str) and value in names:
        return options[value.upper()]
    raise ArgumentError(name, repr(value), f"a {options.__name__} or one of {', '.join(map(repr, names))}")


def _v_rotation(v_rotation: Any, layout: CacheLayout) -> VRotation:
    """``v_rotation`` as a :class:`VRotation` (or its lower-case name), defined for the layout."""
    v_rotation = _enum_option("v_rotation", v_rotation, VRotation)
    if v_rotation != VRotation.NONE and layout.head_dim not in ROTATION_HEAD_DIMS:
        raise ArgumentError("v_rotation", v_rotation.name.lower(),
                            f"none for head_dim {layout.head_dim} (FORMAT.md §6 rotates {ROTATION_HEAD_DIMS})")
    return v_rotation


def _v_encoder(v_encoder: Any) -> VEncoder:
    return _enum_option("v_encoder", v_encoder, VEncoder)


def paged_decode(q: Any, cache: KVCache, block_tables: Any, seq_lens: Any, *, out: Any = None,
                 inv_sqrt_d: float | None = None, sliding_window: int = 0,
                 sparse_v_threshold: float = 1e-3, workspace: Any = None,
                 sinks: Any = None, soft_cap: float = 0.0, query_start: Any = None,
                 max_q_len: int | None = None, stream: Any = None) -> Any:
    """Paged decode attention over the cache (docs/format.md §5); returns ``out``.

    ``q``: bf16 ``[num_seqs, num_q_heads, head_dim]`` (with ``query_start``:
    ``[num_query_rows, num_q_heads, head_dim]``), heads contiguous, any row stride (ELEMENTS) of at
    least ``num_q_heads*head_dim``; ``num_q_heads`` a multiple of the cache's ``num_kv_heads``.
    ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``, rows contiguous, any row stride
    (ELEMENTS) of at least ``max_blocks_per_seq``. The split plan is sized for
    ``max_blocks_per_seq * block_size`` positions, not for ``seq_lens``: where an engine's table
    rows are sized for its longest context, pass the column slice of the batch's pages
    (``block_tables[:, :pages]``, pages enough for its longest sequence), and size the workspace
    with the same ``max_blocks_per_seq``. A batch of mixed lengths is planned for its longest
    sequence; where that plan has several long splits per sequence, the sequences share its CTAs
    by their ``seq_lens`` on the device (docs/api.md). ``seq_lens``: int32 ``[num_seqs]``, contiguous.
    ``out``: bf16, dense, q's shape; None allocates it like q (torch or CuPy q only; on their
    allocator's current stream). ``inv_sqrt_d`` defaults to
    ``head_dim**-0.5``; ``sliding_window`` 0 is off; ``sparse_v_threshold`` 0 is exact.
    ``workspace``: any contiguous writable device array (its size in BYTES is passed), e.g. from
    :meth:`KVCache.decode_workspace`; None runs unsplit. On a checked cache, block-table entries
    outside ``layout.num_blocks`` pages are left out and out-of-range seq_lens clamped, both
    reported (:meth:`KVCache.check_errors`). ``sinks``: float32 ``[num_q_heads]``, contiguous,
    one attention-sink logit per query head (in score units), joining the softmax denominator
    only; None for none. ``soft_cap`` > 0: scores become ``soft_cap·tanh(score / soft_cap)``; 0 is
    off. A cache with ``v_rotation`` (:class:`KVCache`) gets each output head rotated back.

    Multi-token decode (speculative or chunked decode): ``query_start``, int32 ``[num_seqs + 1]``,
    contiguous, on the device like ``block_tables``, non-decreasing from 0: sequence ``s`` owns the
    rows ``query_start[s] .. query_start[s+1]-1`` of q and out, ``q_len = query_start[s+1] -
    query_start[s]`` (0 to ``min(max_q_len, seq_len)``); its token ``i`` attends the positions
    before ``seq_len - q_len + i + 1``, the sliding window counting back from there. ``num_seqs``
    is then ``block_tables.shape[0]`` and ``num_query_rows = q.shape[0]`` (rows past
    ``query_start[num_seqs]`` are not written). ``max_q_len``: the largest ``q_len``, a host int in
    1..16, required with ``query_start`` (the library never reads ``query_start`` on the host, so
    nothing synchronises) and refused without it; size the workspace with the same value. A checked cache
    also reports a ``query_start`` that breaks these rules (the sequence is skipped). None: one
    query row per sequence. Streams: see the module docstring.
    """
    layout = _open(cache).layout
    multi_token = query_start is not None
    if multi_token:
        max_q_len = _check_max_q_len(max_q_len)
    elif max_q_len is not None:
        raise ArgumentError("max_q_len", repr(max_q_len), "None without query_start")
    if out is None:
        out = _new_output(q)
    call = _Call.gather(stream, q=q, block_tables=block_tables, seq_lens=seq_lens, out=out,
                        workspace=workspace, sinks=sinks, query_start=query_start)
    q_array, heads, dim = call["q"], layout.num_kv_heads, layout.head_dim
    rows_text = "num_query_rows" if multi_token else "num_seqs"
    _check_array(q_array, "bfloat16", (None, None, dim), f"[{rows_text}, num_q_heads, {dim}]",
                 dense_from=1)
    num_rows, num_q_heads = q_array.shape[:2]
    if num_q_heads == 0 or num_q_heads % heads:
        raise ArgumentError("q", f"{num_q_heads} query heads",
                            f"a positive multiple of the cache's num_kv_heads = {heads}")
    q_stride = _row_stride(q_array, num_q_heads * dim)
    if call.get("sinks") is not None:
        _check_array(call["sinks"], "float32", (num_q_heads,), f"[{num_q_heads}] (num_q_heads)")
    if multi_token:
        _check_array(call["block_tables"], "int32", (None, None), "[num_seqs, max_blocks_per_seq]",
                     dense_from=1)
        num_seqs = call["block_tables"].shape[0]
        _check_array(call["query_start"], "int32", (num_seqs + 1,),
                     f"[{num_seqs + 1}] (num_seqs + 1)")
        query_row_args = dict(query_start=call["query_start"].ptr, max_q_len=max_q_len,
                              num_query_rows=num_rows)
    else:
        num_seqs = num_rows
        _check_array(call["block_tables"], "int32", (num_seqs, None),
                     f"[{num_seqs} (num_seqs), max_blocks_per_seq]", dense_from=1)
        query_row_args = dict(query_start=0, max_q_len=0, num_query_rows=0)
    max_blocks_per_seq = call["block_tables"].shape[1]
    block_tables_stride = _row_stride(call["block_tables"], max_blocks_per_seq)
    _check_array(call["seq_lens"], "int32", (num_seqs,), f"[{num_seqs}] (num_seqs)")
    _check_array(call["out"], "bfloat16", q_array.shape, f"{list(q_array.shape)} (as q)")
    _check_writable(call["out"])
    scratch = call.get("workspace")
    if scratch is not None:
        _check_array(scratch, None, (None,) * len(scratch.shape), "any shape")
        _check_writable(scratch)
    with call.launching(cache):
        ops.paged_decode_attn(
            q=q_array.ptr, k_cache=cache.k_ptr, v_cache=cache.v_ptr, output=call["out"].ptr,
            block_tables=call["block_tables"].ptr, seq_lens=call["seq_lens"].ptr,
            max_blocks_per_seq=max_blocks_per_seq, block_tables_stride=block_tables_stride,
            num_seqs=num_seqs, num_q_heads=num_q_heads,
            inv_sqrt_d=dim ** -0.5 if inv_sqrt_d is None else inv_sqrt_d, k_scale=cache.k_scale,
            q_stride=q_stride, sliding_window=sliding_window,
            sparse_v_threshold=sparse_v_threshold,
            workspace=scratch.ptr if scratch is not None else 0,
            workspace_bytes=scratch.nbytes if scratch is not None else 0,
            sinks=call["sinks"].ptr if call.get("sinks") is not None else 0, soft_cap=soft_cap,
            v_rotation=cache.v_rotation, stream=call.stream, **query_row_args, **cache._layout_args(),
            **cache._checked_args())
    return out


def _new_output(q: Any) -> Any:
    """A dense array of q's shape and dtype from q's own library (its allocator, on its current
    stream); other array kinds need ``out``."""
    if _instance_of(q, "torch", "Tensor"):
        return sys.modules["torch"].empty(tuple(q.shape), dtype=q.dtype, device=q.device)
    if _instance_of(q, "cupy", "ndarray"):
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(q.device.id):
            return cupy.empty(q.shape, dtype=q.dtype)
    raise TypeError(f"out: None needs q to be a torch tensor or a CuPy array, "
                    f"got {type(q).__name__}; pass out")


def dequantize_kv(cache: KVCache, slot_mapping: Any, key: Any = None, value: Any = None, *,
                  stream: Any = None) -> tuple[Any, Any]:
    """Read cached token rows back into bf16 (``dequantize``, the inverse of the write); returns
    ``(key, value)``.

    ``slot_mapping``: int64 ``[num_tokens]``, contiguous; ``slot = page * block_size + offset``, a
    negative slot gives a row of zeros, and so does, on a checked cache, a slot past
    ``layout.num_blocks`` pages (reported: :meth:`KVCache.check_errors`). ``key``, ``value``:
    writable bf16 ``[num_tokens, num_kv_heads*head_dim]`` or
    ``[num_tokens, num_kv_heads, head_dim]``, each row contiguous, any row stride (ELEMENTS) of at
    least a row; only the row elements are written. None allocates a dense
    ``[num_tokens, num_kv_heads, head_dim]`` array from the cache's backend on its device (torch
    or CuPy pools only, on their allocator's current stream; a "cuda"-backend cache needs both
    outputs). Elements are ``E4M3(K byte) * cache.k_scale`` and
    ``level[code] * E4M3(group scale)``, computed in float32 and rounded to bf16 (docs/format.md
    §2, §3). Streams: see the module docstring. Asynchronous.
    """
    layout = _open(cache).layout
    call = _Call.gather(stream, slot_mapping=slot_mapping, key=key, value=value)
    _check_array(call["slot_mapping"], "int64", (None,), "[num_tokens] (1-D)")
    num_tokens = call["slot_mapping"].shape[0]
    outputs = {"key": key, "value": value}
    strides = {}
    for name in outputs:
        if outputs[name] is None:
            outputs[name] = _new_token_rows(cache, name, num_tokens)
            call.arrays[name] = _describe(name, outputs[name])
        strides[name] = _check_token_rows(call[name], layout)
        if call[name].shape[0] != num_tokens:
            raise ArgumentError(name, f"{call[name].shape[0]} rows",
                                f"{num_tokens} (as slot_mapping)")
        _check_writable(call[name])
    with call.launching(cache):
        ops.dequantize(
            k_cache=cache.k_ptr, v_cache=cache.v_ptr, slot_mapping=call["slot_mapping"].ptr,
            key=call["key"].ptr, value=call["value"].ptr, num_tokens=num_tokens,
            key_stride=strides["key"], value_stride=strides["value"], k_scale=cache.k_scale,
            stream=call.stream, **cache._layout_args(), **cache._checked_args())
    return outputs["key"], outputs["value"]


def _new_token_rows(cache: KVCache, name: str, num_tokens: int) -> Any:
    """A dense bf16 ``[num_tokens, num_kv_heads, head_dim]`` array from the cache's backend, on
    its device; "cuda" pools have no bf16 arrays to go with them."""
    if cache.backend not in ("torch", "cupy"):
        raise TypeError(f"{name}: None needs a cache with torch or CuPy pools, got backend "
                        f"{cache.backend!r}; pass {name}")
    shape = (num_tokens, cache.layout.num_kv_heads, cache.layout.head_dim)
    return _allocate(cache.backend, shape, "bfloat16", cache.device or 0)

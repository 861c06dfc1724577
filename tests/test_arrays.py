"""CPU tests of the tensor-level API (fp8kturbov.arrays): argument checks, stream resolution, KVCache.

No GPU is needed. Arrays are fakes with nonzero but fake device addresses: objects with
``__cuda_array_interface__`` (v3), objects with ``__dlpack__`` that hand out real DLPack capsules
built here from dlpack.h, and stand-ins for torch tensors and CuPy arrays installed as fake
``torch`` / ``cupy`` modules. Device ordinals of fake addresses come from a table (the real lookup
asks the CUDA driver). Launches are replaced by a recorder that keeps the keyword arguments, so
these tests also pass on a GPU machine; the only calls that reach the library with fake pointers
(expecting CUDA_ERROR) run only where conftest finds no usable GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import subprocess
import sys
import types
from types import SimpleNamespace
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import gpu_unavailable_reason
from fake_driver import FakeDriver
from fp8kturbov import ArgumentError, CacheLayout, KVCache, _device, ops

LAYOUT = CacheLayout(num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64, v_bits=3)
H, D = LAYOUT.num_kv_heads, LAYOUT.head_dim
N = H * D  # elements of one token row
T = 5      # tokens per write
S, HQ, MAX_BLOCKS = 3, 4, 6  # decode: sequences, query heads, block-table width
ROWS, Q_LEN = 7, 4  # multi-token decode: query rows of q and out, max_q_len
K_SCALE = 0.05
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}


def no_gpu() -> bool:
    """Fake pointers may reach the library only where no GPU is usable (and cuda.bindings could
    have found one)."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return gpu_unavailable_reason() is not None


only_without_gpu = pytest.mark.skipif(not no_gpu(), reason="fake pointers must never reach a GPU")
REAL_POINTER_DEVICE = _device.pointer_device  # before the autouse fixture below replaces it


# ---- Fake device memory ---------------------------------------------------------------------------
_addresses = itertools.count(0x7F00_0000_0000, 0x100_0000)
FAKE_DEVICES: dict[int, int] = {}


def fake_address(device: int = 0) -> int:
    ptr = next(_addresses)
    FAKE_DEVICES[ptr] = device
    return ptr


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


@pytest.fixture(autouse=True)
def fake_pointer_devices(monkeypatch):
    """CAI arrays' devices from the table instead of the CUDA driver."""
    monkeypatch.setattr(_device, "pointer_device",
                        lambda name, ptr: FAKE_DEVICES.get(ptr, 0) if ptr else None)


class FakeCAI:
    """``__cuda_array_interface__`` v3; ``strides`` in ELEMENTS here, exported in bytes."""

    TYPESTR = {"bfloat16": "<V2", "float16": "<f2", "float32": "<f4", "int64": "<i8", "int32": "<i4",
               "uint8": "|u1", "int8": "|i1"}

    def __init__(self, shape, dtype, *, strides=None, device=0, readonly=False, stream=None,
                 typestr=None, version=3, **extra):
        self.ptr = fake_address(device)
        byte_strides = None if strides is None else tuple(s * ITEMSIZE[dtype] for s in strides)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr or self.TYPESTR[dtype],
            "data": (self.ptr, readonly), "strides": byte_strides, "version": version, **extra}
        if version >= 3:
            self.__cuda_array_interface__["stream"] = stream


# DLPack structs written from dlpack.h, independently of the module under test.
class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8),
                ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


class FakeDLPack:
    """``__dlpack__`` / ``__dlpack_device__`` handing out real capsules (no deleter); records the
    ``stream`` each export was asked for. ``readonly`` needs the versioned capsule."""

    CODES = {"bfloat16": (4, 16), "float16": (2, 16), "float32": (2, 32), "int64": (0, 64),
             "int32": (0, 32), "uint8": (1, 8), "int8": (0, 8)}

    def __init__(self, shape, dtype, *, strides=None, device=0, readonly=False, device_type=2,
                 byte_offset=0, lanes=1):
        self.base = fake_address(device)
        self.ptr = self.base + byte_offset
        self.requested_streams: list[Any] = []
        self._device = (device_type, device)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * len(shape))(*strides)
        code, bits = self.CODES[dtype]
        self._tensor = DLTensor(self.base, device_type, device, len(shape), code, bits, lanes,
                                ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64)),
                                ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                                if self._strides is not None else None, byte_offset)
        self._readonly = readonly

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None):
        self.requested_streams.append(stream)
        if self._readonly:
            self._managed = DLManagedTensorVersioned(1, 0, None, None, 1, self._tensor)
            return _capsule_new(ctypes.addressof(self._managed), b"dltensor_versioned", None)
        self._managed = DLManagedTensor(self._tensor, None, None)
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)


# ---- Fake torch and CuPy ----------------------------------------------------------------------------
TORCH_STREAM, CUPY_STREAM = 0x7051, 0xC0B1


class TorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class TorchDevice:
    def __init__(self, type: str, index: int | None = None) -> None:
        self.type, self.index = type, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """The torch.Tensor attributes the module reads; ``device=None`` is a CPU tensor."""

    def __init__(self, shape, dtype, *, strides=None, device=0, **_):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = dtype if isinstance(dtype, TorchDtype) else TorchDtype(dtype)
        self._strides = tuple(strides) if strides is not None else c_strides(self.shape)
        self.is_cuda = device is not None
        self.device = TorchDevice("cuda", device) if self.is_cuda else TorchDevice("cpu")
        self.ptr = fake_address(device or 0)

    def stride(self):
        return self._strides

    def data_ptr(self):
        return self.ptr

    def element_size(self):
        return ITEMSIZE[self.dtype.name]


class FakeCupyArray:
    def __init__(self, shape, dtype, *, strides=None, device=0, **_):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(s * self.itemsize for s in (strides or c_strides(self.shape)))
        self.ptr = fake_address(device)
        self.data = SimpleNamespace(ptr=self.ptr)
        self.device = SimpleNamespace(id=device)


@pytest.fixture
def stream_queries() -> list[tuple[str, Any]]:
    """(library, device) of every current-stream query the fake torch / CuPy answered."""
    return []


@pytest.fixture
def fake_torch(monkeypatch, stream_queries):
    torch = types.ModuleType("torch")
    torch.Tensor = FakeTensor
    torch.bfloat16, torch.uint8 = TorchDtype("bfloat16"), TorchDtype("uint8")
    torch.device = TorchDevice
    torch.empty = lambda shape, dtype, device: FakeTensor(shape, dtype, device=device.index)

    def current_stream(device=None):
        stream_queries.append(("torch", device))
        return SimpleNamespace(cuda_stream=TORCH_STREAM)

    torch.cuda = SimpleNamespace(current_stream=current_stream)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


@pytest.fixture
def fake_cupy(monkeypatch, stream_queries):
    cupy = types.ModuleType("cupy")
    cupy.ndarray = FakeCupyArray
    cupy.uint8 = np.uint8
    cupy.empty = lambda shape, dtype: FakeCupyArray(shape, dtype)

    def get_current_stream(device_id=-1):
        stream_queries.append(("cupy", device_id))
        return SimpleNamespace(ptr=CUPY_STREAM)

    cupy.cuda = SimpleNamespace(get_current_stream=get_current_stream,
                                Device=lambda device: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


KINDS = {"cai": FakeCAI, "dlpack": FakeDLPack, "torch": FakeTensor, "cupy": FakeCupyArray}


@pytest.fixture(params=list(KINDS))
def make(request) -> Callable[..., Any]:
    """A factory ``make(shape, dtype, *, strides=None, device=0)`` of each array kind in turn."""
    if request.param in ("torch", "cupy"):
        request.getfixturevalue(f"fake_{request.param}")
    return KINDS[request.param]


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """Every launch, stream wait and device switch, recorded instead of done."""
    calls: list[tuple[str, tuple, dict]] = []
    for op in ("reshape_and_cache", "paged_decode_attn", "paged_prefill_attn", "dequantize"):
        monkeypatch.setattr(ops, op, lambda *args, _op=op, **kw: calls.append((_op, args, kw)))
    monkeypatch.setattr(_device, "stream_wait", lambda *args: calls.append(("wait", args, {})))

    def on_device(device):
        calls.append(("device", (device,), {}))
        return contextlib.nullcontext()

    monkeypatch.setattr(_device, "on_device", on_device)
    return calls


def launched(calls, op: str) -> dict[str, Any]:
    """The keyword arguments of the one launch of ``op`` (all are passed by keyword)."""
    found = [(args, kw) for name, args, kw in calls if name == op]
    assert len(found) == 1 and found[0][0] == (), calls
    return found[0][1]


def make_cache(*, checked: bool = False, **pool_options) -> KVCache:
    return KVCache.wrap(FakeCAI((LAYOUT.k_pool_bytes,), "uint8", **pool_options),
                        FakeCAI((LAYOUT.v_pool_bytes,), "uint8", **pool_options), LAYOUT, K_SCALE,
                        checked=checked)


def write_args(make) -> dict[str, Any]:
    return dict(key=make((T, H, D), "bfloat16"), value=make((T, N), "bfloat16"),
                slot_mapping=make((T,), "int64"))


def decode_args(make) -> dict[str, Any]:
    return dict(q=make((S, HQ, D), "bfloat16"), block_tables=make((S, MAX_BLOCKS), "int32"),
                seq_lens=make((S,), "int32"), out=make((S, HQ, D), "bfloat16"))


def multi_token_decode_args(make) -> dict[str, Any]:
    """A multi-token decode's arguments: ROWS query rows over S sequences."""
    return dict(q=make((ROWS, HQ, D), "bfloat16"), block_tables=make((S, MAX_BLOCKS), "int32"),
                seq_lens=make((S,), "int32"), out=make((ROWS, HQ, D), "bfloat16"),
                query_start=make((S + 1,), "int32"), max_q_len=Q_LEN)


def dequantize_args(make) -> dict[str, Any]:
    return dict(slot_mapping=make((T,), "int64"), key=make((T, H, D), "bfloat16"),
                value=make((T, N), "bfloat16"))


LAYOUT_ARGS = dict(num_kv_heads=H, head_dim=D, block_size=LAYOUT.block_size, v_bits=3,
                   k_block_stride_bytes=LAYOUT.k_block_stride_bytes,
                   v_block_stride_bytes=LAYOUT.v_block_stride_bytes,
                   v_data_section_bytes=LAYOUT.v_data_section_bytes)
UNCHECKED_ARGS = dict(num_blocks=0, error_flags=0)  # what a cache built without checked=True passes


# ---- Valid calls: what reaches the launchers ----------------------------------------------------------
def test_write_passes_pointers_element_strides_and_the_layout(make, launches):
    cache = make_cache()
    args = write_args(make)
    args["key"] = make((T, H, D), "bfloat16", strides=(N + 40, D, 1))  # padded rows
    fp8kturbov.write_kv(cache=cache, **args)
    kw = launched(launches, "reshape_and_cache")
    assert kw == dict(key=args["key"].ptr, value=args["value"].ptr, k_cache=cache.k_ptr,
                      v_cache=cache.v_ptr, slot_mapping=args["slot_mapping"].ptr, num_tokens=T,
                      key_stride=N + 40, value_stride=N, k_scale=K_SCALE, stream=kw["stream"],
                      v_encoder=fp8kturbov.VEncoder.MATCHED_NORM, v_rotation=fp8kturbov.VRotation.NONE,
                      **LAYOUT_ARGS, **UNCHECKED_ARGS)
    assert ("device", (0,), {}) in launches


@pytest.mark.parametrize("given, passed", [("mse", fp8kturbov.VEncoder.MSE),
                                           (fp8kturbov.VEncoder.MSE, fp8kturbov.VEncoder.MSE),
                                           ("projection", fp8kturbov.VEncoder.PROJECTION),
                                           ("matched_norm", fp8kturbov.VEncoder.MATCHED_NORM)])
def test_write_passes_the_v_encoder(make, launches, given, passed):
    fp8kturbov.write_kv(cache=make_cache(), v_encoder=given, **write_args(make))
    assert launched(launches, "reshape_and_cache")["v_encoder"] is passed


@pytest.mark.parametrize("given", ["MSE", "nvfp4", "Projection", 1, 2, None])
def test_write_refuses_an_unknown_v_encoder(make, launches, given):
    with pytest.raises(fp8kturbov.ArgumentError, match="v_encoder"):
        fp8kturbov.write_kv(cache=make_cache(), v_encoder=given, **write_args(make))
    assert not any(name == "reshape_and_cache" for name, *_ in launches)


ROTATABLE = CacheLayout(num_blocks=8, block_size=16, num_kv_heads=2, head_dim=128, v_bits=3)


@pytest.mark.parametrize("given", ["hadamard", fp8kturbov.VRotation.HADAMARD])
def test_a_rotated_cache_is_written_and_decoded_rotated(make, launches, given):
    cache = KVCache.wrap(FakeCAI((ROTATABLE.k_pool_bytes,), "uint8"), FakeCAI((ROTATABLE.v_pool_bytes,), "uint8"),
                         ROTATABLE, K_SCALE, v_rotation=given)
    assert cache.v_rotation is fp8kturbov.VRotation.HADAMARD
    rows = 4
    fp8kturbov.write_kv(make((rows, 256), "bfloat16"), make((rows, 256), "bfloat16"), cache,
                        make((rows,), "int64"))
    fp8kturbov.paged_decode(make((1, 4, 128), "bfloat16"), cache, make((1, 2), "int32"), make((1,), "int32"),
                            out=make((1, 4, 128), "bfloat16"))
    assert launched(launches, "reshape_and_cache")["v_rotation"] is fp8kturbov.VRotation.HADAMARD
    assert launched(launches, "paged_decode_attn")["v_rotation"] is fp8kturbov.VRotation.HADAMARD


@pytest.mark.parametrize("given, layout, match", [("HADAMARD", ROTATABLE, "VRotation or one of"),
                                                  (1, ROTATABLE, "VRotation or one of"),
                                                  ("hadamard", LAYOUT, "head_dim 64")])
def test_a_cache_refuses_a_rotation_it_cannot_have(given, layout, match):
    pools = FakeCAI((layout.k_pool_bytes,), "uint8"), FakeCAI((layout.v_pool_bytes,), "uint8")
    with pytest.raises(fp8kturbov.ArgumentError, match=match):
        KVCache.wrap(*pools, layout, K_SCALE, v_rotation=given)


def test_the_rotation_head_dims_are_the_reference_s():
    from fp8kturbov import _lib, reference
    assert _lib.ROTATION_HEAD_DIMS == reference.ROTATION_DIMS


def test_the_package_imports_without_ml_dtypes():
    """ml-dtypes is an extra (the NumPy reference's): the package itself must not need it."""
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "import fp8kturbov\n"
            "try:\n    import fp8kturbov.reference\nexcept ImportError:\n    print('reference: needs ml_dtypes')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "reference: needs ml_dtypes"  # the block above did take effect


def test_write_k_scale_override_and_single_row_stride(launches):
    cache = make_cache()
    # One token: torch reports any stride for a dim of size 1; the dense one is passed.
    fp8kturbov.write_kv(FakeCAI((1, N), "bfloat16", strides=(3, 1)), FakeCAI((1, H, D), "bfloat16"),
                        cache, FakeCAI((1,), "int64", strides=(5,)), k_scale=2.5)
    kw = launched(launches, "reshape_and_cache")
    assert (kw["key_stride"], kw["value_stride"], kw["k_scale"]) == (N, N, 2.5)


def test_decode_passes_shapes_strides_defaults_and_returns_out(make, launches):
    cache = make_cache()
    args = decode_args(make)
    args["q"] = make((S, HQ, D), "bfloat16", strides=(HQ * D + 8, D, 1))
    workspace = make((1000,), "float32")
    got = fp8kturbov.paged_decode(cache=cache, workspace=workspace, sliding_window=7, **args)
    assert got is args["out"]
    kw = launched(launches, "paged_decode_attn")
    assert kw == dict(q=args["q"].ptr, k_cache=cache.k_ptr, v_cache=cache.v_ptr,
                      output=args["out"].ptr, block_tables=args["block_tables"].ptr,
                      seq_lens=args["seq_lens"].ptr, max_blocks_per_seq=MAX_BLOCKS, num_seqs=S,
                      num_q_heads=HQ, inv_sqrt_d=D ** -0.5, k_scale=K_SCALE, q_stride=HQ * D + 8, sliding_window=7,
                      sparse_v_threshold=None, workspace=workspace.ptr, workspace_bytes=4000,
                      sinks=0, soft_cap=0.0, query_start=0, max_q_len=0, num_query_rows=0,
                      v_rotation=fp8kturbov.VRotation.NONE, block_tables_stride=MAX_BLOCKS,
                      stream=kw["stream"], **LAYOUT_ARGS, **UNCHECKED_ARGS)


@pytest.mark.parametrize("multi_token", [False, True])
def test_decode_passes_the_row_stride_of_a_column_slice_of_block_tables(make, launches, multi_token):
    """block_tables[:, :pages] of a wider table: max_blocks_per_seq is the slice's width and
    block_tables_stride its row stride (elements)."""
    args = multi_token_decode_args(make) if multi_token else decode_args(make)
    args["block_tables"] = make((S, MAX_BLOCKS), "int32", strides=(MAX_BLOCKS + 5, 1))
    fp8kturbov.paged_decode(cache=make_cache(), **args)
    kw = launched(launches, "paged_decode_attn")
    assert (kw["block_tables"], kw["max_blocks_per_seq"], kw["block_tables_stride"]) == (
        args["block_tables"].ptr, MAX_BLOCKS, MAX_BLOCKS + 5)


def test_decode_passes_query_start_and_takes_num_seqs_from_the_block_tables(make, launches):
    cache = make_cache()
    args = multi_token_decode_args(make)
    args["q"] = make((ROWS, HQ, D), "bfloat16", strides=(HQ * D + 8, D, 1))
    assert fp8kturbov.paged_decode(cache=cache, **args) is args["out"]
    kw = launched(launches, "paged_decode_attn")
    assert (kw["q"], kw["output"], kw["q_stride"]) == (args["q"].ptr, args["out"].ptr, HQ * D + 8)
    assert (kw["num_seqs"], kw["max_blocks_per_seq"], kw["num_q_heads"]) == (S, MAX_BLOCKS, HQ)
    assert (kw["query_start"], kw["max_q_len"], kw["num_query_rows"]) == (
        args["query_start"].ptr, Q_LEN, ROWS)


def test_prefill_passes_chunks_lse_and_the_cache(make, launches):
    cache = make_cache()
    args = multi_token_decode_args(make)
    args["q"] = make((ROWS, HQ, D), "bfloat16", strides=(HQ * D + 8, D, 1))
    lse, sinks = make((ROWS, HQ), "float32"), make((HQ,), "float32")
    got = fp8kturbov.paged_prefill(cache=cache, lse=lse, sinks=sinks, soft_cap=20.0, sliding_window=9, **args)
    assert got is args["out"]
    kw = launched(launches, "paged_prefill_attn")
    assert kw == dict(q=args["q"].ptr, k_cache=cache.k_ptr, v_cache=cache.v_ptr, output=args["out"].ptr,
                      block_tables=args["block_tables"].ptr, seq_lens=args["seq_lens"].ptr,
                      query_start=args["query_start"].ptr, lse=lse.ptr, max_blocks_per_seq=MAX_BLOCKS,
                      block_tables_stride=MAX_BLOCKS, num_seqs=S, num_q_heads=HQ, inv_sqrt_d=D ** -0.5,
                      k_scale=K_SCALE, q_stride=HQ * D + 8, max_q_len=Q_LEN, num_query_rows=ROWS,
                      sliding_window=9, sinks=sinks.ptr, soft_cap=20.0, v_rotation=fp8kturbov.VRotation.NONE,
                      workspace=0, workspace_bytes=0, stream=kw["stream"], **LAYOUT_ARGS, **UNCHECKED_ARGS)


@pytest.mark.parametrize("name, shape, dtype, match", [
    ("lse", (ROWS, HQ + 1), "float32", "lse"), ("lse", (ROWS, HQ), "bfloat16", "lse"),
    ("query_start", (S,), "int32", "query_start"), ("seq_lens", (S,), "int64", "seq_lens"),
    ("out", (ROWS + 1, HQ, D), "bfloat16", "out"), ("sinks", (HQ,), "bfloat16", "sinks")])
def test_prefill_refuses_mis_shaped_arrays_before_launching(make, launches, name, shape, dtype, match):
    args = multi_token_decode_args(make) | {name: make(shape, dtype)}
    with pytest.raises(ArgumentError, match=match):
        fp8kturbov.paged_prefill(cache=make_cache(), **args)
    assert not any(op == "paged_prefill_attn" for op, *_ in launches)


@pytest.mark.parametrize("max_q_len", [1, 16, np.int64(5)])
def test_decode_accepts_max_q_len_from_1_to_16(launches, max_q_len):
    args = multi_token_decode_args(FakeCAI) | {"max_q_len": max_q_len}
    fp8kturbov.paged_decode(cache=make_cache(), **args)
    passed = launched(launches, "paged_decode_attn")["max_q_len"]
    assert passed == max_q_len and type(passed) is int


def test_decode_refuses_max_q_len_without_query_start(launches):
    with pytest.raises(ArgumentError) as error:
        fp8kturbov.paged_decode(cache=make_cache(), max_q_len=1, **decode_args(FakeCAI))
    assert (error.value.argument, error.value.found) == ("max_q_len", "1")
    assert error.value.expected == "None without query_start"
    assert launches == []


@pytest.mark.parametrize("multi_token, encoder", [(False, "mse"), (True, "mse"), (False, "projection")])
def test_decode_passes_the_fused_append(make, launches, multi_token, encoder):
    """One new K/V row per query row (3-D keys with padded rows, 2-D values), its slots and the V
    encoder reach the launch with the rows' element strides."""
    args = multi_token_decode_args(make) if multi_token else decode_args(make)
    rows = ROWS if multi_token else S
    key = make((rows, H, D), "bfloat16", strides=(N + 16, D, 1))
    value, slots = make((rows, N), "bfloat16"), make((rows,), "int64")
    fp8kturbov.paged_decode(cache=make_cache(), append_key=key, append_value=value, append_slot_mapping=slots,
                            v_encoder=encoder, **args)
    kw = launched(launches, "paged_decode_attn")
    assert (kw["append_key"], kw["append_value"], kw["append_slot_mapping"]) == (key.ptr, value.ptr, slots.ptr)
    assert (kw["append_key_stride"], kw["append_value_stride"], kw["v_encoder"]) == (
        N + 16, N, fp8kturbov.VEncoder[encoder.upper()])
    assert not any(name == "reshape_and_cache" for name, *_ in launches)  # no write launch of its own


@pytest.mark.parametrize("given, argument", [
    (dict(append_key=True, append_value=True), "append_key"),  # rows without slots
    (dict(append_slot_mapping=True, append_value=True), "append_key"),
    (dict(append_slot_mapping=True, append_key=True), "append_value"),
    (dict(v_encoder="mse"), "v_encoder"),  # an encoder with nothing to encode
    (dict(append_slot_mapping=True, append_key=True, append_value=True, rows=S + 1), "append_key"),
    (dict(append_slot_mapping=True, append_key=True, append_value=True, slot_dtype="int32"),
     "append_slot_mapping"),
])
def test_decode_refuses_an_incomplete_or_mismatched_fused_append(make, launches, given, argument):
    given = dict(given)
    rows, slot_dtype = given.pop("rows", S), given.pop("slot_dtype", "int64")
    arrays = {"append_key": make((rows, N), "bfloat16"), "append_value": make((rows, N), "bfloat16"),
              "append_slot_mapping": make((rows,), slot_dtype)}
    options = {name: arrays[name] if value is True else value for name, value in given.items()}
    with pytest.raises(ArgumentError) as error:
        fp8kturbov.paged_decode(cache=make_cache(), **options, **decode_args(make))
    assert error.value.argument == argument
    assert launches == []


def test_decode_passes_sinks_and_soft_cap(make, launches):
    args = decode_args(make)
    sinks = make((HQ,), "float32")
    fp8kturbov.paged_decode(cache=make_cache(), sinks=sinks, soft_cap=30.0, **args)
    kw = launched(launches, "paged_decode_attn")
    assert (kw["sinks"], kw["soft_cap"]) == (sinks.ptr, 30.0)


@pytest.mark.parametrize("shape, dtype", [((HQ + 1,), "float32"), ((HQ,), "bfloat16"), ((1, HQ), "float32")])
def test_decode_refuses_sinks_of_another_shape_or_dtype(make, launches, shape, dtype):
    with pytest.raises(fp8kturbov.ArgumentError, match="sinks"):
        fp8kturbov.paged_decode(cache=make_cache(), sinks=make(shape, dtype), **decode_args(make))
    assert not any(name == "paged_decode_attn" for name, *_ in launches)


def test_decode_explicit_scalars_and_no_workspace(launches):
    cache = make_cache()
    args = decode_args(FakeCAI)
    # One block per sequence: the stride of a dim of size 1 does not matter.
    args["block_tables"] = FakeCAI((S, 1), "int32", strides=(1, 99))
    fp8kturbov.paged_decode(cache=cache, inv_sqrt_d=0.5, sparse_v_threshold=0.0, **args)
    kw = launched(launches, "paged_decode_attn")
    assert (kw["inv_sqrt_d"], kw["sparse_v_threshold"], kw["workspace"], kw["workspace_bytes"]) == (
        0.5, 0.0, 0, 0)


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_decode_allocates_out_like_q(request, launches, library):
    request.getfixturevalue(f"fake_{library}")
    args = decode_args(KINDS[library])
    del args["out"]
    out = fp8kturbov.paged_decode(cache=make_cache(), **args)
    assert isinstance(out, KINDS[library]) and tuple(out.shape) == (S, HQ, D)
    assert launched(launches, "paged_decode_attn")["output"] == out.ptr


def test_decode_without_out_needs_a_torch_or_cupy_q(launches):
    args = decode_args(FakeCAI)
    del args["out"]
    with pytest.raises(TypeError, match="^out: "):
        fp8kturbov.paged_decode(cache=make_cache(), **args)
    assert launches == []


def test_dequantize_passes_pointers_element_strides_and_the_layout(make, launches):
    cache = make_cache()
    args = dequantize_args(make)
    args["key"] = make((T, H, D), "bfloat16", strides=(N + 24, D, 1))  # padded rows
    key, value = fp8kturbov.dequantize_kv(cache=cache, **args)
    assert key is args["key"] and value is args["value"]
    kw = launched(launches, "dequantize")
    assert kw == dict(k_cache=cache.k_ptr, v_cache=cache.v_ptr, slot_mapping=args["slot_mapping"].ptr,
                      key=args["key"].ptr, value=args["value"].ptr, num_tokens=T, key_stride=N + 24,
                      value_stride=N, k_scale=K_SCALE, stream=kw["stream"], **LAYOUT_ARGS,
                      **UNCHECKED_ARGS)
    assert ("device", (0,), {}) in launches


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_dequantize_allocates_outputs_from_the_cache_backend(request, launches, library):
    request.getfixturevalue(f"fake_{library}")
    make = KINDS[library]
    cache = KVCache.wrap(make((LAYOUT.k_pool_bytes,), "uint8"), make((LAYOUT.v_pool_bytes,), "uint8"),
                         LAYOUT, K_SCALE)
    given = make((T, N), "bfloat16")
    key, value = fp8kturbov.dequantize_kv(cache, make((T,), "int64"), value=given)
    assert isinstance(key, make) and tuple(key.shape) == (T, H, D) and value is given
    assert "bfloat16" in str(key.dtype)
    kw = launched(launches, "dequantize")
    assert (kw["key"], kw["value"], kw["key_stride"]) == (key.ptr, given.ptr, N)


def test_dequantize_without_outputs_needs_torch_or_cupy_pools(launches):
    with pytest.raises(TypeError, match="^value: None needs a cache with torch or CuPy pools"):
        fp8kturbov.dequantize_kv(make_cache(), FakeCAI((T,), "int64"), FakeCAI((T, N), "bfloat16"))
    assert launches == []


@pytest.mark.parametrize("kind", ["cai", "dlpack"])
def test_dequantize_refuses_read_only_outputs(launches, kind):
    args = dequantize_args(FakeCAI)
    args["value"] = KINDS[kind]((T, N), "bfloat16", readonly=True)
    with pytest.raises(ArgumentError, match="^INVALID_VALUE: value: a read-only array"):
        fp8kturbov.dequantize_kv(cache=make_cache(), **args)
    assert launches == []


def test_dlpack_capsule_fields_are_read(launches):
    cache = make_cache()
    key = FakeDLPack((T, N), "bfloat16", strides=(N + 16, 1), byte_offset=64)
    fp8kturbov.write_kv(key, FakeDLPack((T, H, D), "bfloat16", readonly=True), cache,
                        FakeDLPack((T,), "int64"))
    kw = launched(launches, "reshape_and_cache")
    assert kw["key"] == key.base + 64 and kw["key_stride"] == N + 16


# ---- Invalid arguments: each names the argument, nothing is launched -----------------------------------
WRITE_ERRORS = {
    "key dtype": ("key", lambda m: m((T, N), "float16"), "dtype float16"),
    "value dtype": ("value", lambda m: m((T, N), "float32"), "dtype float32"),
    "key row size": ("key", lambda m: m((T, N + 16), "bfloat16"), f"shape [{T}, {N + 16}]"),
    "key heads": ("key", lambda m: m((T, 4, D // 2), "bfloat16"), f"shape [{T}, 4, {D // 2}]"),
    "key 1-D": ("key", lambda m: m((T * N,), "bfloat16"), "shape"),
    "key row not dense": ("key", lambda m: m((T, H, D), "bfloat16", strides=(N, 1, H)), "strides"),
    "value strided": ("value", lambda m: m((T, N), "bfloat16", strides=(2 * N, 2)), "strides"),
    "key rows overlap": ("key", lambda m: m((T, N), "bfloat16", strides=(N // 2, 1)),
                         f"row stride {N // 2} elements"),
    "value rows": ("value", lambda m: m((T + 1, N), "bfloat16"), f"{T + 1} rows"),
    "slots dtype": ("slot_mapping", lambda m: m((T,), "int32"), "dtype int32"),
    "slots length": ("slot_mapping", lambda m: m((T - 1,), "int64"), f"shape [{T - 1}]"),
    "slots 2-D": ("slot_mapping", lambda m: m((T, 1), "int64"), "shape"),
    "slots strided": ("slot_mapping", lambda m: m((T,), "int64", strides=(2,)), "strides [2]"),
    "value device": ("value", lambda m: m((T, N), "bfloat16", device=1), "device 1"),
    "slots device": ("slot_mapping", lambda m: m((T,), "int64", device=3), "device 3"),
}


DECODE_ERRORS = {
    "q dtype": ("q", lambda m: m((S, HQ, D), "float32"), "dtype float32"),
    "q 2-D": ("q", lambda m: m((S, HQ * D), "bfloat16"), "shape"),
    "q head_dim": ("q", lambda m: m((S, HQ, 2 * D), "bfloat16"), "shape"),
    "q heads": ("q", lambda m: m((S, 3, D), "bfloat16"), "3 query heads"),
    "q no heads": ("q", lambda m: m((S, 0, D), "bfloat16"), "0 query heads"),
    "q heads strided": ("q", lambda m: m((S, HQ, D), "bfloat16", strides=(2 * HQ * D, 2 * D, 1)),
                        "strides"),
    "q rows overlap": ("q", lambda m: m((S, HQ, D), "bfloat16", strides=(D, D, 1)), "row stride"),
    "tables dtype": ("block_tables", lambda m: m((S, MAX_BLOCKS), "int64"), "dtype int64"),
    "tables rows": ("block_tables", lambda m: m((S + 1, MAX_BLOCKS), "int32"), "shape"),
    "tables transposed": ("block_tables",
                          lambda m: m((S, MAX_BLOCKS), "int32", strides=(1, S)), "strides"),
    "tables rows overlap": ("block_tables",
                            lambda m: m((S, MAX_BLOCKS), "int32", strides=(MAX_BLOCKS - 1, 1)), "row stride"),
    "lens dtype": ("seq_lens", lambda m: m((S,), "int64"), "dtype int64"),
    "lens length": ("seq_lens", lambda m: m((S + 2,), "int32"), "shape"),
    "out dtype": ("out", lambda m: m((S, HQ, D), "float16"), "dtype float16"),
    "out shape": ("out", lambda m: m((S, HQ * D), "bfloat16"), "shape"),
    "out padded": ("out", lambda m: m((S, HQ, D), "bfloat16", strides=(HQ * D + 8, D, 1)), "strides"),
    "workspace strided": ("workspace", lambda m: m((64,), "uint8", strides=(2,)), "strides"),
    "out device": ("out", lambda m: m((S, HQ, D), "bfloat16", device=1), "device 1"),
    "workspace device": ("workspace", lambda m: m((64,), "uint8", device=2), "device 2"),
}


MULTI_TOKEN_DECODE_ERRORS = {
    "max_q_len missing": ("max_q_len", lambda m: None, "None"),
    "max_q_len 0": ("max_q_len", lambda m: 0, "0"),
    "max_q_len 17": ("max_q_len", lambda m: 17, "17"),
    "max_q_len float": ("max_q_len", lambda m: 4.0, "4.0"),
    "max_q_len bool": ("max_q_len", lambda m: True, "True"),
    "query_start dtype": ("query_start", lambda m: m((S + 1,), "int64"), "dtype int64"),
    "query_start length": ("query_start", lambda m: m((S,), "int32"), f"shape [{S}]"),
    "query_start 2-D": ("query_start", lambda m: m((S + 1, 1), "int32"), "shape"),
    "query_start strided": ("query_start", lambda m: m((S + 1,), "int32", strides=(2,)), "strides [2]"),
    "query_start device": ("query_start", lambda m: m((S + 1,), "int32", device=1), "device 1"),
    "q dtype": ("q", lambda m: m((ROWS, HQ, D), "float32"), "dtype float32"),
    "out rows": ("out", lambda m: m((ROWS + 1, HQ, D), "bfloat16"), f"shape [{ROWS + 1}, {HQ}, {D}]"),
    "out one row per sequence": ("out", lambda m: m((S, HQ, D), "bfloat16"), f"shape [{S}, {HQ}, {D}]"),
    "tables 1-D": ("block_tables", lambda m: m((S * MAX_BLOCKS,), "int32"), "shape"),
    "lens vs tables": ("seq_lens", lambda m: m((S + 1,), "int32"), f"shape [{S + 1}]"),
}


DEQUANTIZE_ERRORS = {
    "slots dtype": ("slot_mapping", lambda m: m((T,), "int32"), "dtype int32"),
    "slots 2-D": ("slot_mapping", lambda m: m((T, 1), "int64"), "shape [5, 1]"),
    "slots strided": ("slot_mapping", lambda m: m((T,), "int64", strides=(2,)), "strides [2]"),
    "key dtype": ("key", lambda m: m((T, H, D), "float32"), "dtype float32"),
    "key heads": ("key", lambda m: m((T, 2 * H, D // 2), "bfloat16"), f"shape [{T}, {2 * H}, {D // 2}]"),
    "key rows": ("key", lambda m: m((T - 1, H, D), "bfloat16"), f"{T - 1} rows"),
    "value rows": ("value", lambda m: m((T + 1, N), "bfloat16"), f"{T + 1} rows"),
    "value strided": ("value", lambda m: m((T, N), "bfloat16", strides=(2 * N, 2)), "strides"),
    "value rows overlap": ("value", lambda m: m((T, N), "bfloat16", strides=(N - 16, 1)),
                           f"row stride {N - 16} elements"),
    "key device": ("key", lambda m: m((T, H, D), "bfloat16", device=2), "device 2"),
}


# (operation, its valid arguments, its error cases), for the one test below.
OPERATIONS = {"write": (fp8kturbov.write_kv, write_args, WRITE_ERRORS),
              "decode": (fp8kturbov.paged_decode, decode_args, DECODE_ERRORS),
              "multi-token decode": (fp8kturbov.paged_decode, multi_token_decode_args,
                                     MULTI_TOKEN_DECODE_ERRORS),
              "dequantize": (fp8kturbov.dequantize_kv, dequantize_args, DEQUANTIZE_ERRORS)}


@pytest.mark.parametrize("op, case", [(op, case) for op, (_, _, errors) in OPERATIONS.items()
                                      for case in errors])
def test_rejects_and_names_the_argument(make, launches, op, case):
    call, valid_args, errors = OPERATIONS[op]
    argument, build, found = errors[case]
    args = valid_args(make)
    args[argument] = build(make)
    with pytest.raises(ArgumentError) as error:
        call(cache=make_cache(), **args)
    assert error.value.argument == argument
    assert found in error.value.found and error.value.message.startswith(f"{argument}: ")
    assert launches == []


@pytest.mark.parametrize("kind", ["cai", "dlpack"])
@pytest.mark.parametrize("argument", ["out", "workspace"])
def test_read_only_outputs_are_refused(launches, kind, argument):
    args = decode_args(FakeCAI)
    args["workspace"] = FakeCAI((64,), "uint8")
    args[argument] = KINDS[kind](args[argument].__cuda_array_interface__["shape"],
                                 "bfloat16" if argument == "out" else "uint8", readonly=True)
    with pytest.raises(ArgumentError, match=f"^INVALID_VALUE: {argument}: a read-only array"):
        fp8kturbov.paged_decode(cache=make_cache(), **args)
    assert launches == []


def test_arguments_on_the_host_are_refused(fake_torch, launches):
    cache = make_cache()
    args = write_args(FakeCAI)
    for host, found in [(FakeTensor((T, N), "bfloat16", device=None), "a tensor on cpu"),
                        (np.zeros((T, N), np.float32), "DLPack device type 1 (kDLCPU)"),
                        (FakeDLPack((T, N), "bfloat16", device_type=3), "(kDLCUDAHost)")]:
        with pytest.raises(ArgumentError, match="^INVALID_VALUE: key: ") as error:
            fp8kturbov.write_kv(host, args["value"], cache, args["slot_mapping"])
        assert found in error.value.found and "CUDA device memory" in error.value.expected
    assert launches == []


def test_the_cache_device_must_match(launches):
    cache = make_cache(device=1)
    assert cache.device == 1
    with pytest.raises(ArgumentError, match="expected device 1 \\(that of cache\\)"):
        fp8kturbov.write_kv(cache=cache, **write_args(FakeCAI))
    assert launches == []


@pytest.mark.parametrize("bad, pattern", [
    ([1, 2, 3], "^key: list is not an array"),
    (object(), "^key: object is not an array"),
])
def test_non_arrays_are_type_errors(launches, bad, pattern):
    args = write_args(FakeCAI)
    args["key"] = bad
    with pytest.raises(TypeError, match=pattern):
        fp8kturbov.write_kv(cache=make_cache(), **args)


def test_cai_and_dlpack_oddities(launches):
    """Descriptions that fail before any check of the call: unknown dtypes, odd strides, masks."""
    big_endian = FakeCAI((T, N), "int64", typestr=">i8")
    bad_strides = FakeCAI((T, N), "bfloat16")
    bad_strides.__cuda_array_interface__["strides"] = (2 * N, 3)
    masked = FakeCAI((T, N), "bfloat16", mask=object())
    vector = FakeDLPack((T, N), "bfloat16", lanes=2)
    cases = [(big_endian, "dtype big-endian int64"), (bad_strides, "strides [256, 3] bytes"),
             (masked, "a masked array"), (vector, "dtype DLPack dtype (code 4, bits 16, lanes 2)")]
    for key, found in cases:
        with pytest.raises(ArgumentError) as error:
            fp8kturbov.write_kv(key, FakeCAI((T, N), "bfloat16"), make_cache(), FakeCAI((T,), "int64"))
        assert (error.value.argument, error.value.found) == ("key", found)
    assert launches == []


def test_a_closed_or_missing_cache_is_refused(launches):
    cache = make_cache()
    with cache:
        pass
    assert cache.closed and cache.k_pool is None and cache.k_ptr == 0
    with pytest.raises(ArgumentError, match="^INVALID_VALUE: cache: a closed KVCache"):
        fp8kturbov.write_kv(cache=cache, **write_args(FakeCAI))
    with pytest.raises(ArgumentError, match="cache: a closed KVCache"):
        fp8kturbov.paged_decode(cache=cache, **decode_args(FakeCAI))
    with pytest.raises(TypeError, match="^cache: dict, expected fp8kturbov.KVCache"):
        fp8kturbov.write_kv(cache={}, **write_args(FakeCAI))
    assert launches == []


def test_argument_error_is_an_invalid_value_error():
    error = ArgumentError("key", "dtype float16", "bfloat16")
    assert isinstance(error, fp8kturbov.InvalidValueError) and isinstance(error, ValueError)
    assert error.status == fp8kturbov.Status.INVALID_VALUE
    assert str(error) == "INVALID_VALUE: key: dtype float16, expected bfloat16"


# ---- Streams --------------------------------------------------------------------------------------------
def launch_stream(calls, op: str = "reshape_and_cache") -> int:
    return launched(calls, op)["stream"]


def waits(calls) -> list[tuple[int, int]]:
    """(launch stream, producer stream) of every event wait."""
    return [args for name, args, _ in calls if name == "wait"]


def test_explicit_stream_wins_and_cai_producers_are_waited_for(launches, fake_torch):
    key = FakeCAI((T, N), "bfloat16", stream=0x99)
    value = FakeTensor((T, N), "bfloat16")
    fp8kturbov.write_kv(key, value, make_cache(), FakeCAI((T,), "int64", stream=0x99), stream=0x1234)
    assert launch_stream(launches) == 0x1234
    assert waits(launches) == [(0x1234, 0x99)]  # once per distinct producer stream


class TorchStream:
    """Like torch.cuda.Stream: a ``cuda_stream`` attribute, defined in a torch module."""
    __module__ = "torch.cuda.streams"

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class CupyStream:
    __module__ = "cupy.cuda.stream"

    def __init__(self, handle: int) -> None:
        self.ptr = handle


class ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0x5E)


@pytest.mark.parametrize("stream, handle", [
    (0, 0), (0x77, 0x77), (TorchStream(0x71), 0x71), (CupyStream(0x72), 0x72),
    (ProtocolStream(), 0x5E),
], ids=["zero", "int", "torch", "cupy", "protocol"])
def test_explicit_stream_kinds(launches, stream, handle):
    fp8kturbov.write_kv(cache=make_cache(), stream=stream,
                        **write_args(lambda *a, **k: FakeCAI(*a, stream=0x31, **k)))
    assert launch_stream(launches) == handle
    assert waits(launches) == [(handle, 0x31)]


def test_explicit_cuda_bindings_stream(launches):
    driver = pytest.importorskip("cuda.bindings.driver")
    fp8kturbov.write_kv(cache=make_cache(), stream=driver.CUstream(0x4242), **write_args(FakeCAI))
    assert launch_stream(launches) == 0x4242


def test_explicit_stream_of_the_wrong_type(launches):
    with pytest.raises(TypeError, match="stream"):
        fp8kturbov.write_kv(cache=make_cache(), stream="default", **write_args(FakeCAI))
    assert launches == []


def test_first_cai_stream_is_the_launch_stream(launches):
    key = FakeCAI((T, N), "bfloat16")  # no stream: no ordering asked for
    value = FakeCAI((T, N), "bfloat16", stream=0x10)
    slots = FakeCAI((T,), "int64", stream=0x20)
    fp8kturbov.write_kv(key, value, make_cache(), slots)
    assert launch_stream(launches) == 0x10
    assert waits(launches) == [(0x10, 0x20)]


def test_legacy_default_stream_spellings_need_no_wait(launches):
    """CAI writes the legacy default stream as 1; the launch names it 0 or 1, the same stream."""
    fp8kturbov.write_kv(FakeCAI((T, N), "bfloat16", stream=1), FakeCAI((T, N), "bfloat16"),
                        make_cache(), FakeCAI((T,), "int64"), stream=0)
    assert launch_stream(launches) == 0 and waits(launches) == []


def test_per_thread_default_stream_is_distinct(launches):
    fp8kturbov.write_kv(FakeCAI((T, N), "bfloat16", stream=2), FakeCAI((T, N), "bfloat16", stream=1),
                        make_cache(), FakeCAI((T,), "int64"))
    assert launch_stream(launches) == 2 and waits(launches) == [(2, 1)]


def test_without_streams_the_legacy_default_stream(launches):
    fp8kturbov.write_kv(FakeCAI((T, N), "bfloat16", version=2), FakeCAI((T, N), "bfloat16"),
                        make_cache(), FakeCAI((T,), "int64"))
    assert launch_stream(launches) == 0 and waits(launches) == []


def test_torch_tensor_gives_torchs_current_stream(launches, fake_torch, stream_queries):
    value = FakeCAI((T, N), "bfloat16", stream=0x10)  # later in the signature: waited for
    fp8kturbov.write_kv(FakeTensor((T, N), "bfloat16", device=0), value, make_cache(),
                        FakeCAI((T,), "int64"))
    assert launch_stream(launches) == TORCH_STREAM
    assert stream_queries == [("torch", 0)]
    assert waits(launches) == [(TORCH_STREAM, 0x10)]


def test_cupy_array_gives_cupys_current_stream(launches, fake_cupy, stream_queries):
    fp8kturbov.paged_decode(FakeCupyArray((S, HQ, D), "bfloat16"), make_cache(),
                            **{k: v for k, v in decode_args(FakeCAI).items() if k != "q"})
    assert launch_stream(launches, "paged_decode_attn") == CUPY_STREAM
    assert stream_queries == [("cupy", 0)]


def test_dlpack_exports_are_asked_for_the_launch_stream(launches):
    dlpack = write_args(FakeDLPack)
    fp8kturbov.write_kv(cache=make_cache(), **dlpack)
    assert launch_stream(launches) == 0
    assert all(a.requested_streams == [1] for a in dlpack.values())  # DLPack's legacy default
    launches.clear()
    dlpack = write_args(FakeDLPack)
    dlpack["value"] = FakeCAI((T, N), "bfloat16", stream=0x44)
    fp8kturbov.write_kv(cache=make_cache(), **dlpack)
    assert launch_stream(launches) == 0x44
    assert dlpack["key"].requested_streams == dlpack["slot_mapping"].requested_streams == [0x44]


def test_nothing_is_imported_behind_the_callers_back():
    code = ("import sys, fp8kturbov; "
            "assert not {'torch', 'cupy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- KVCache --------------------------------------------------------------------------------------------
def test_wrap_reads_pools(make, launches):
    k_pool, v_pool = make((LAYOUT.k_pool_bytes + 64,), "uint8"), make((LAYOUT.v_pool_bytes,), "uint8")
    cache = KVCache.wrap(k_pool, v_pool, LAYOUT, K_SCALE)
    assert (cache.k_ptr, cache.v_ptr, cache.device, cache.k_scale) == (k_pool.ptr, v_pool.ptr, 0, K_SCALE)
    assert cache.backend == {FakeTensor: "torch", FakeCupyArray: "cupy"}.get(type(k_pool), "cuda")
    assert cache.k_pool is k_pool and not cache.owns_memory
    cache.close()
    assert cache.closed and cache.v_ptr == 0


POOL_ERRORS = {
    "k too small": ("k_pool", lambda m: m((LAYOUT.k_pool_bytes - 1,), "uint8"),
                    f"{LAYOUT.k_pool_bytes - 1} bytes",
                    f"at least layout.k_pool_bytes = {LAYOUT.k_pool_bytes}"),
    "v too small": ("v_pool", lambda m: m((16,), "uint8"),
                    "16 bytes", f"at least layout.v_pool_bytes = {LAYOUT.v_pool_bytes}"),
    "k dtype": ("k_pool", lambda m: m((LAYOUT.k_pool_bytes,), "int8"), "dtype int8", "uint8"),
    "v 2-D": ("v_pool", lambda m: m((LAYOUT.num_blocks, LAYOUT.v_block_stride_bytes), "uint8"),
              f"shape [{LAYOUT.num_blocks}, {LAYOUT.v_block_stride_bytes}]", "[bytes] (1-D)"),
    "k strided": ("k_pool", lambda m: m((LAYOUT.k_pool_bytes,), "uint8", strides=(2,)),
                  "strides [2] (elements)", "[1] (contiguous)"),
    "v device": ("v_pool", lambda m: m((LAYOUT.v_pool_bytes,), "uint8", device=1),
                 "memory on CUDA device 1", "device 0 (that of k_pool)"),
}


@pytest.mark.parametrize("case", list(POOL_ERRORS))
def test_wrap_checks_pools(make, case):
    argument, build, found, expected = POOL_ERRORS[case]
    pools = {"k_pool": make((LAYOUT.k_pool_bytes,), "uint8"), "v_pool": make((LAYOUT.v_pool_bytes,), "uint8")}
    pools[argument] = build(make)
    with pytest.raises(ArgumentError) as error:
        KVCache.wrap(layout=LAYOUT, k_scale=K_SCALE, **pools)
    assert (error.value.argument, error.value.found, error.value.expected) == (argument, found, expected)


def test_wrap_checks_layout_scale_and_writability():
    k_pool, v_pool = FakeCAI((LAYOUT.k_pool_bytes,), "uint8"), FakeCAI((LAYOUT.v_pool_bytes,), "uint8")
    with pytest.raises(TypeError, match="^layout: dict, expected fp8kturbov.CacheLayout"):
        KVCache.wrap(k_pool, v_pool, {}, K_SCALE)
    for scale in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(fp8kturbov.InvalidValueError, match="k_scale"):
            KVCache.wrap(k_pool, v_pool, LAYOUT, scale)
    with pytest.raises(ArgumentError, match="v_pool: a read-only array"):
        KVCache.wrap(k_pool, FakeCAI((LAYOUT.v_pool_bytes,), "uint8", readonly=True), LAYOUT, K_SCALE)


def test_allocate_checks_its_arguments_first():
    with pytest.raises(ValueError, match="^backend: 'numpy', expected one of 'torch', 'cupy', 'cuda'"):
        KVCache.allocate(LAYOUT, K_SCALE, backend="numpy")
    with pytest.raises(TypeError, match="^layout: "):
        KVCache.allocate("layout", K_SCALE, backend="cuda")
    with pytest.raises(fp8kturbov.InvalidValueError, match="k_scale"):
        KVCache.allocate(LAYOUT, -2.0, backend="cuda")


def test_allocate_through_the_fake_torch(fake_torch):
    with KVCache.allocate(LAYOUT, K_SCALE, backend="torch", device=0) as cache:
        assert isinstance(cache.k_pool, FakeTensor) and cache.k_pool.shape == (LAYOUT.k_pool_bytes,)
        assert cache.v_pool.shape == (LAYOUT.v_pool_bytes,) and cache.owns_memory
        assert cache.backend == "torch" and cache.device == 0
    assert cache.closed and cache.k_pool is None


def test_allocate_without_the_backend_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes ``import cupy`` fail
    with pytest.raises(ImportError, match="backend='cupy' needs the cupy package"):
        KVCache.allocate(LAYOUT, K_SCALE, backend="cupy")


def test_decode_workspace_is_sized_by_the_library_and_allocated_by_the_backend(monkeypatch, fake_torch,
                                                                              launches):
    queries = []
    monkeypatch.setattr(ops, "paged_decode_workspace_bytes", lambda **kw: queries.append(kw) or 4096)
    cache = KVCache.wrap(FakeTensor((LAYOUT.k_pool_bytes,), "uint8"),
                         FakeTensor((LAYOUT.v_pool_bytes,), "uint8"), LAYOUT, K_SCALE)
    workspace = cache.decode_workspace(S, HQ, MAX_BLOCKS, sliding_window=9)
    assert isinstance(workspace, FakeTensor) and workspace.shape == (4096,)
    assert workspace.dtype is fake_torch.uint8
    assert queries == [dict(max_blocks_per_seq=MAX_BLOCKS, num_seqs=S, num_q_heads=HQ, q_stride=HQ * D,
                            sliding_window=9, k_scale=K_SCALE, max_q_len=1, **LAYOUT_ARGS)]
    assert ("device", (0,), {}) in launches  # sized on the cache's device
    cache.decode_workspace(S, HQ, MAX_BLOCKS, max_q_len=Q_LEN)
    assert queries[-1]["max_q_len"] == Q_LEN


def test_prefill_workspace_is_sized_by_the_library_for_the_chunks(monkeypatch, fake_torch, launches):
    queries = []
    monkeypatch.setattr(ops, "paged_prefill_workspace_bytes", lambda **kw: queries.append(kw) or 2048)
    cache = KVCache.wrap(FakeTensor((LAYOUT.k_pool_bytes,), "uint8"),
                         FakeTensor((LAYOUT.v_pool_bytes,), "uint8"), LAYOUT, K_SCALE)
    workspace = cache.prefill_workspace(S, HQ, MAX_BLOCKS, Q_LEN, ROWS, sliding_window=5)
    assert isinstance(workspace, FakeTensor) and workspace.shape == (2048,)
    assert queries == [dict(max_blocks_per_seq=MAX_BLOCKS, num_seqs=S, num_q_heads=HQ, q_stride=HQ * D,
                            sliding_window=5, k_scale=K_SCALE, max_q_len=Q_LEN, num_query_rows=ROWS,
                            **LAYOUT_ARGS)]
    assert ("device", (0,), {}) in launches  # sized on the cache's device


def test_prefill_passes_its_workspace(make, launches):
    workspace = make((300,), "uint8")
    fp8kturbov.paged_prefill(cache=make_cache(), workspace=workspace, **multi_token_decode_args(make))
    kw = launched(launches, "paged_prefill_attn")
    assert (kw["workspace"], kw["workspace_bytes"]) == (workspace.ptr, 300)


@pytest.mark.parametrize("max_q_len", [0, 17, None, 2.0])
def test_decode_workspace_refuses_max_q_len_outside_1_to_16(monkeypatch, max_q_len):
    monkeypatch.setattr(ops, "paged_decode_workspace_bytes", lambda **kw: pytest.fail("queried"))
    with pytest.raises(ArgumentError) as error:
        make_cache().decode_workspace(S, HQ, MAX_BLOCKS, max_q_len=max_q_len)
    assert (error.value.argument, error.value.found) == ("max_q_len", repr(max_q_len))


def test_empty_workspace_from_the_cuda_backend(monkeypatch):
    monkeypatch.setattr(ops, "paged_decode_workspace_bytes", lambda **kw: 0)
    with make_cache().decode_workspace(S, HQ, MAX_BLOCKS) as workspace:
        assert isinstance(workspace, fp8kturbov.DeviceBuffer) and workspace.ptr == 0
        assert not workspace.closed and workspace.nbytes == 0
        assert workspace.__cuda_array_interface__["shape"] == (0,)
    assert workspace.closed
    workspace.close()  # idempotent


# ---- Fully valid calls reach the library (no GPU here: it answers CUDA_ERROR) --------------------------
@only_without_gpu
def test_valid_calls_reach_the_library(make):
    cache = make_cache()
    with pytest.raises(fp8kturbov.CudaError):
        fp8kturbov.write_kv(cache=cache, **write_args(make))
    with pytest.raises(fp8kturbov.CudaError):
        fp8kturbov.paged_decode(cache=cache, **decode_args(make))
    with pytest.raises(fp8kturbov.CudaError):
        fp8kturbov.paged_decode(cache=cache, **multi_token_decode_args(make))
    with pytest.raises(fp8kturbov.CudaError):
        fp8kturbov.dequantize_kv(cache=cache, **dequantize_args(make))


def test_library_checks_still_apply():
    """A rule only the library knows (k_scale > 0 on a per-call override) comes back as its error
    (checked before anything touches a pointer, so safe on a GPU machine too)."""
    with pytest.raises(fp8kturbov.InvalidValueError, match="k_scale"):
        fp8kturbov.write_kv(cache=make_cache(), k_scale=-1.0, **write_args(FakeCAI))


@only_without_gpu
def test_cuda_backend_and_workspace_need_a_driver():
    with pytest.raises(fp8kturbov.CudaError):
        KVCache.allocate(LAYOUT, K_SCALE, backend="cuda")
    with pytest.raises(fp8kturbov.CudaError):
        make_cache().decode_workspace(S, HQ, MAX_BLOCKS)


# ---- The driver bookkeeping, against a fake cuda.bindings.driver (the driver fixture) ----------------
def test_device_buffer_allocates_in_and_holds_the_primary_context(driver):
    buffer = fp8kturbov.DeviceBuffer(1024, device=1)
    assert driver.live == {buffer.ptr: (1024, 1)} and driver.stack == []
    assert driver.references[1] == 1  # held while the memory lives
    assert buffer.__cuda_array_interface__["data"] == (buffer.ptr, False)
    buffer.close()
    buffer.close()
    assert driver.live == {} and driver.references[1] == 0 and buffer.closed and buffer.ptr == 0
    with pytest.raises(ValueError, match="nbytes"):
        fp8kturbov.DeviceBuffer(-1)


def test_device_buffer_is_freed_when_collected(driver):
    import gc

    buffer = fp8kturbov.DeviceBuffer(64)
    del buffer
    gc.collect()
    assert driver.live == {} and driver.references[0] == 0


def test_allocate_cuda_backend_owns_and_frees(driver):
    with KVCache.allocate(LAYOUT, K_SCALE, backend="cuda", device=0) as cache:
        assert cache.backend == "cuda" and cache.owns_memory
        assert sorted(n for n, _ in driver.live.values()) == sorted(
            [LAYOUT.k_pool_bytes, LAYOUT.v_pool_bytes])
    assert driver.live == {} and driver.references[0] == 0


def test_wrapped_pools_are_not_freed(driver):
    k_pool = fp8kturbov.DeviceBuffer(LAYOUT.k_pool_bytes)
    v_pool = fp8kturbov.DeviceBuffer(LAYOUT.v_pool_bytes)
    KVCache.wrap(k_pool, v_pool, LAYOUT, K_SCALE).close()
    assert len(driver.live) == 2 and not k_pool.closed


@pytest.mark.parametrize("current, pushed", [([0], [1]), ([1], []), ([], [1])],
                         ids=["other device", "same device", "no context"])
def test_on_device_makes_the_arrays_device_current(driver, current, pushed):
    driver.stack[:] = current
    with _device.on_device(1):
        assert driver.stack == current + pushed
        assert driver.references[1] == len(pushed)
    assert driver.stack == current and driver.references[1] == 0
    with _device.on_device(None):
        assert driver.stack == current


def test_stream_wait_is_an_event(driver):
    _device.stream_wait(0x50, 0x70)
    assert driver.log == [("create", 2), ("record", 0x70), ("wait", 0x50), ("destroy",)]


def test_pointer_device_asks_the_driver(driver):
    driver.pointer_devices = {0x1000: (0, 1),
                              0x2000: (FakeDriver.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)}
    assert REAL_POINTER_DEVICE("key", 0x1000) == 1
    assert REAL_POINTER_DEVICE("key", 0x2000) is None  # the driver cannot tell: the library will
    assert REAL_POINTER_DEVICE("key", 0) is None
    with pytest.raises(ArgumentError, match="key: address 0x3000, unknown to the CUDA driver"):
        REAL_POINTER_DEVICE("key", 0x3000)


# ---- Checked mode: the cache's error word (fake driver) -------------------------------------------------
def test_checked_cache_passes_its_pages_and_error_word(driver, launches):
    cache = make_cache(checked=True)
    word = cache.error_word
    assert isinstance(word, fp8kturbov.ErrorWord) and word.device == cache.device == 0
    assert driver.live[word.ptr] == (4, 0) and driver.word(word.ptr) == 0
    fp8kturbov.write_kv(cache=cache, **write_args(FakeCAI))
    fp8kturbov.paged_decode(cache=cache, **decode_args(FakeCAI))
    fp8kturbov.paged_prefill(cache=cache, **multi_token_decode_args(FakeCAI))
    fp8kturbov.dequantize_kv(cache=cache, **dequantize_args(FakeCAI))
    for op in ("reshape_and_cache", "paged_decode_attn", "paged_prefill_attn", "dequantize"):
        kw = launched(launches, op)
        assert (kw["num_blocks"], kw["error_flags"]) == (LAYOUT.num_blocks, word.ptr), op


def test_checked_cache_reports_and_zeroes_its_error_word(driver):
    cache = make_cache(checked=True, device=1)
    word = cache.error_word
    assert word.device == 1 and driver.live[word.ptr] == (4, 1)  # on the pools' device
    cache.check_errors()
    driver.set_word(word.ptr, fp8kturbov.IndexErrorFlags.BLOCK_TABLE)
    driver.log.clear()
    with pytest.raises(fp8kturbov.CacheIndexError) as info:
        cache.check_errors(stream=TorchStream(0x40))
    assert info.value.flags == fp8kturbov.IndexErrorFlags.BLOCK_TABLE
    assert driver.log == [("copy", 0x40, 1), ("sync", 0x40, 1), ("memset", 0x40, 1)]
    assert driver.word(word.ptr) == 0
    cache.check_errors(stream=TorchStream(0x40))  # reported once
    cache.close()
    assert cache.error_word is None and word.closed and word.ptr not in driver.live
    assert driver.references[1] == 0
    with pytest.raises(ArgumentError, match="a closed KVCache"):
        cache.check_errors()


def test_unchecked_cache_has_no_error_word(driver):
    cache = make_cache()
    assert cache.error_word is None and not cache.checked and driver.live == {}
    with pytest.raises(ArgumentError) as info:
        cache.check_errors()
    assert (info.value.argument, info.value.found) == ("cache", "a KVCache built with checked=False")


@pytest.mark.parametrize("checked", [1, "yes", None, np.bool_(True)], ids=repr)
def test_checked_must_be_a_bool(driver, checked):
    with pytest.raises(TypeError, match="^checked: "):
        make_cache(checked=checked)
    with pytest.raises(TypeError, match="^checked: "):
        KVCache.allocate(LAYOUT, K_SCALE, backend="cuda", checked=checked)
    assert driver.live == {}  # refused before anything was allocated


def test_checked_cache_needs_pages(driver):
    """num_blocks = 0 would tell the library "unchecked": a checked cache of no pages is refused."""
    empty = CacheLayout(num_blocks=0, block_size=16, num_kv_heads=H, head_dim=D, v_bits=3)
    pools = FakeCAI((0,), "uint8"), FakeCAI((0,), "uint8")
    assert KVCache.wrap(*pools, empty, K_SCALE).error_word is None
    for build in (lambda: KVCache.wrap(*pools, empty, K_SCALE, checked=True),
                  lambda: KVCache.allocate(empty, K_SCALE, backend="cuda", checked=True)):
        with pytest.raises(ArgumentError) as info:
            build()
        assert (info.value.argument, info.value.found) == ("layout", "num_blocks = 0")
    assert driver.live == {}


def test_allocate_checked_owns_pools_and_word(driver, monkeypatch):
    monkeypatch.setattr(_device, "pointer_device", REAL_POINTER_DEVICE)  # the pools' device
    with KVCache.allocate(LAYOUT, K_SCALE, backend="cuda", device=1, checked=True) as cache:
        assert sorted(n for n, _ in driver.live.values()) == sorted(
            [4, LAYOUT.k_pool_bytes, LAYOUT.v_pool_bytes])
        assert driver.live[cache.error_word.ptr] == (4, 1)
    assert driver.live == {} and driver.references[1] == 0


def test_checked_cache_needs_a_driver(monkeypatch):
    monkeypatch.setattr(_device, "driver", lambda: None)
    with pytest.raises(fp8kturbov.CudaError, match="no usable CUDA driver"):
        make_cache(checked=True)


def test_a_launch_switches_device_and_waits_through_the_driver(driver, monkeypatch):
    """write_kv without the recorder: the device guard and the event wait run for real (on the
    fake driver) around the launch."""
    seen = []
    monkeypatch.setattr(ops, "reshape_and_cache",
                        lambda **kw: seen.append((list(driver.stack), list(driver.log), kw["stream"])))
    args = write_args(lambda *a, **k: FakeCAI(*a, device=1, stream=0x31, **k))
    fp8kturbov.write_kv(cache=make_cache(device=1), stream=0x40, **args)
    assert seen == [([1], [("create", 2), ("record", 0x31), ("wait", 0x40), ("destroy",)], 0x40)]
    assert driver.stack == [] and driver.references[1] == 0

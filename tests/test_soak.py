"""GPU tests: a soak of one cache, and a leak check of what owns device memory or the library.

- **Soak**: one checked `KVCache` (the "cuda" backend), every slot written first, then a long random
  sequence of `write_kv`, `paged_decode` and `dequantize_kv` calls through the tensor API on one
  stream, mirrored by the NumPy reference: each decode is compared with the float64 reference
  (relative error per head <= 1e-2), each dequantize byte for byte, and every 25 steps the whole
  pools with the reference's. Every 50th write also holds a slot past the pools, which
  `check_errors` must report (SLOT); otherwise it must find nothing. 300 steps by default,
  FP8KTURBOV_SOAK_STEPS=<n> for a longer run.
- **Leaks**: `KVCache` (allocated, checked), `DeviceBuffer`, `ErrorWord` and the loader
  (`fp8kturbov._lib._load`, a fresh load of the library) created 2000 times each by default,
  FP8KTURBOV_SOAK_CREATIONS=100000 for the full count; half of them closed (the loader's library has
  no close), half only dropped. Every object must be collected and its device memory freed (its
  buffers' finalizers have run), and the process's resident memory must stay flat. With
  FP8KTURBOV_SOAK_CREATIONS set, the device's free memory must stay flat too: run those alone
  (`-k leak`, no -n), as the free memory is the whole device's.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections import Counter

import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head
from fp8kturbov import _lib
from fp8kturbov import reference as ref
from test_checked_mode import DeviceArray
from test_collateral_writes import BF16, POISON
from test_gpu_kernels import assert_pools_equal, random_rows

pytestmark = pytest.mark.gpu

STEPS = int(os.environ.get("FP8KTURBOV_SOAK_STEPS", "300"))
POOL_CHECK_EVERY, BAD_WRITE_EVERY = 25, 50
CREATIONS = int(os.environ.get("FP8KTURBOV_SOAK_CREATIONS", "2000"))
DEVICE_MEMORY_CHECKED = "FP8KTURBOV_SOAK_CREATIONS" in os.environ
HOST_SLACK_BYTES = 16 << 20  # resident memory may grow this much (allocator arenas), no more
DEVICE_SLACK_BYTES = 64 << 20


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


def address(array: DeviceArray) -> int:
    return array.__cuda_array_interface__["data"][0]


class Soak:
    """The cache, the reference's copy of its pools, and the steps on both."""

    def __init__(self, device, rng: np.random.Generator) -> None:
        self.device, self.rng = device, rng
        self.bits = int(rng.choice([2, 3, 4]))
        head_dim = int(rng.choice([64, 128, 256]))
        self.layout = fp8kturbov.CacheLayout(num_blocks=48, block_size=16, num_kv_heads=2, head_dim=head_dim,
                                             v_bits=self.bits)
        self.rotation = head_dim in ref.ROTATION_DIMS and bool(rng.random() < 0.5)
        self.k_scale = 0.05
        self.cache = fp8kturbov.KVCache.allocate(self.layout, self.k_scale, backend="cuda", checked=True,
                                                 v_rotation="hadamard" if self.rotation else "none")
        self.k_pool = np.zeros(self.layout.k_pool_bytes, np.uint8)
        self.v_pool = np.zeros(self.layout.v_pool_bytes, np.uint8)
        # Packed pages: writing every slot sets every byte of both pools.
        self.write(np.arange(self.layout.num_slots, dtype=np.int64))
        self.check_pools()

    def write(self, slots: np.ndarray, outside: int = 0) -> None:
        """Write fresh rows at ``slots`` (distinct) and ``outside`` slots past the pools."""
        layout, n = self.layout, self.layout.row_elems
        all_slots = self.rng.permutation(np.concatenate([slots, layout.num_slots + 3 + np.arange(outside)]))
        key = random_rows(self.rng, len(all_slots), n, n, hostile=False)
        value = random_rows(self.rng, len(all_slots), n, n, hostile=False)
        fp8kturbov.write_kv(DeviceArray(self.device, key), DeviceArray(self.device, value), self.cache,
                            DeviceArray(self.device, all_slots.astype(np.int64)), stream=self.device.stream)
        kept = all_slots < layout.num_slots
        ref.write_cache(key[kept], value[kept], self.k_pool, self.v_pool, all_slots[kept], int(kept.sum()),
                        layout.num_kv_heads, layout.head_dim, layout.block_size, n, n, self.k_scale,
                        layout.k_block_stride_bytes, layout.v_block_stride_bytes, layout.v_data_section_bytes,
                        self.bits, rotation=self.rotation)
        if outside:
            with pytest.raises(fp8kturbov.CacheIndexError) as caught:
                self.cache.check_errors(self.device.stream)
            assert caught.value.flags == fp8kturbov.IndexErrorFlags.SLOT
        self.cache.check_errors(self.device.stream)  # nothing (left) to report

    def decode(self) -> None:
        layout, rng = self.layout, self.rng
        num_seqs, group_size = int(rng.integers(1, 5)), int(rng.choice([1, 4, 8]))
        num_q_heads = layout.num_kv_heads * group_size
        seq_lens = rng.integers(0, 301, num_seqs).astype(np.int32)
        max_blocks_per_seq = int(-(-seq_lens.max() // layout.block_size)) + 1
        tables = rng.integers(0, layout.num_blocks, (num_seqs, max_blocks_per_seq)).astype(np.int32)
        window = int(rng.choice([0, 0, 40]))
        q = rng.standard_normal((num_seqs, num_q_heads, layout.head_dim)).astype(BF16)
        poison = np.full(q.shape, POISON, np.uint16)
        out = DeviceArray(self.device, poison.view(BF16))
        workspace = self.cache.decode_workspace(num_seqs, num_q_heads, max_blocks_per_seq, window)
        fp8kturbov.paged_decode(DeviceArray(self.device, q), self.cache, DeviceArray(self.device, tables),
                                DeviceArray(self.device, seq_lens), out=out, sliding_window=window,
                                sparse_v_threshold=0.0, workspace=workspace, stream=self.device.stream)
        self.cache.check_errors(self.device.stream)
        got = self.device.download(address(out), poison).view(BF16).astype(np.float64)
        want = ref.paged_decode(q, self.k_pool, self.v_pool, tables, seq_lens, max_blocks_per_seq, num_seqs,
                                num_q_heads, layout.num_kv_heads, layout.head_dim, layout.block_size,
                                layout.head_dim ** -0.5, self.k_scale, num_q_heads * layout.head_dim,
                                layout.v_block_stride_bytes, layout.v_data_section_bytes, window, self.bits,
                                k_block_stride_bytes=layout.k_block_stride_bytes, rotation=self.rotation)
        assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
        err = relative_error_per_head(got, want)
        assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"

    def dequantize(self) -> None:
        layout, n = self.layout, self.layout.row_elems
        slots = self.rng.integers(-1, layout.num_slots, int(self.rng.integers(1, 33))).astype(np.int64)
        poison = np.full((len(slots), n), POISON, np.uint16)
        key, value = DeviceArray(self.device, poison.view(BF16)), DeviceArray(self.device, poison.view(BF16))
        fp8kturbov.dequantize_kv(self.cache, DeviceArray(self.device, slots), key, value, stream=self.device.stream)
        self.cache.check_errors(self.device.stream)
        want_key, want_value = ref.dequantize_cache(
            self.k_pool, self.v_pool, slots, len(slots), layout.num_kv_heads, layout.head_dim, layout.block_size,
            self.k_scale, layout.k_block_stride_bytes, layout.v_block_stride_bytes, layout.v_data_section_bytes,
            self.bits)
        assert_pools_equal(self.device.download(address(key), poison), want_key.view(np.uint16), "key rows")
        assert_pools_equal(self.device.download(address(value), poison), want_value.view(np.uint16), "value rows")

    def check_pools(self) -> None:
        assert_pools_equal(self.device.download(self.cache.k_ptr, self.k_pool), self.k_pool, "K pool")
        assert_pools_equal(self.device.download(self.cache.v_ptr, self.v_pool), self.v_pool, "V pool")


def test_soak_of_one_cache_matches_reference(device, rng):
    soak = Soak(device, rng)
    tally = Counter()
    try:
        for step in range(1, STEPS + 1):
            kind = str(rng.choice(["write", "decode", "dequantize"], p=[0.4, 0.4, 0.2]))
            tally[kind] += 1
            if kind == "write":
                count = int(rng.integers(1, 33))
                soak.write(rng.choice(soak.layout.num_slots, count, replace=False).astype(np.int64),
                           outside=int(tally["write"] % BAD_WRITE_EVERY == 0))
            elif kind == "decode":
                soak.decode()
            else:
                soak.dequantize()
            if step % POOL_CHECK_EVERY == 0:
                soak.check_pools()
            device.free_all()  # this step's inputs and outputs
        soak.check_pools()
    finally:
        soak.cache.close()
    print(f"soak: {STEPS} steps on one cache (bits {soak.bits}, head_dim {soak.layout.head_dim}, rotation "
          f"{soak.rotation}): {tally['write']} writes ({tally['write'] // BAD_WRITE_EVERY} with a slot past the "
          f"pools), {tally['decode']} decodes, {tally['dequantize']} dequantizes, "
          f"{STEPS // POOL_CHECK_EVERY + 2} whole-pool comparisons")


# ---- Leaks ------------------------------------------------------------------------------------------


def resident_bytes() -> int:
    """The process's resident memory (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def free_device_bytes() -> int:
    from gpu_util import check_driver_result, cu

    free, _total = check_driver_result(cu.cuMemGetInfo())
    return int(free)


def owned_buffers(obj) -> list:
    """The `DeviceBuffer`s that ``obj`` owns."""
    if isinstance(obj, fp8kturbov.DeviceBuffer):
        return [obj]
    if isinstance(obj, fp8kturbov.ErrorWord):
        return [obj._buffer]
    if isinstance(obj, fp8kturbov.KVCache):
        return [obj.k_pool, obj.v_pool, obj.error_word._buffer]
    return []  # the loader's library


CREATE = {
    "KVCache": lambda: fp8kturbov.KVCache.allocate(fp8kturbov.CacheLayout(16, 16, 2, 128, 3), 0.05, backend="cuda",
                                                   checked=True),
    "DeviceBuffer": lambda: fp8kturbov.DeviceBuffer(1 << 20),
    "ErrorWord": lambda: fp8kturbov.ErrorWord(0),
    "loader": _lib._load,
}


def create_and_drop(make, count: int) -> None:
    """``count`` objects from ``make``, every other one closed (where it has a close), the rest only
    dropped; afterwards every one must be collected and every buffer it owned freed (its finalizer
    run)."""
    pending = []  # finalizers of the objects and buffers not released yet (reference cycles)
    for i in range(count):
        obj = make()
        watched = [weakref.finalize(obj, int), *(buffer._finalizer for buffer in owned_buffers(obj))]
        # The class's close: the attributes of a loaded library (ctypes.CDLL) are its symbols, libc's
        # close among them, which ``obj.close()`` would call on whatever descriptor a register held.
        close = getattr(type(obj), "close", None)
        if i % 2 and close is not None:
            close(obj)
        del obj
        pending += [f for f in watched if f.alive]
        if i % 1000 == 999:
            gc.collect()
            pending = [f for f in pending if f.alive]
    gc.collect()
    left = sum(f.alive for f in pending)
    assert left == 0, f"{left} objects or device buffers of {count} creations still alive"


@pytest.mark.parametrize("kind", CREATE)
def test_leak_check_of_creations(device, kind):
    make = CREATE[kind]
    create_and_drop(make, max(CREATIONS // 10, 10))  # warm-up: caches, arenas, the driver's pools
    host, free = resident_bytes(), free_device_bytes()
    create_and_drop(make, CREATIONS)
    grown = resident_bytes() - host
    assert grown <= HOST_SLACK_BYTES, f"{CREATIONS} creations of {kind}: resident memory grew by {grown >> 20} MiB"
    lost = free - free_device_bytes()
    if DEVICE_MEMORY_CHECKED:
        assert lost <= DEVICE_SLACK_BYTES, f"{CREATIONS} creations of {kind}: {lost >> 20} MiB of device memory gone"
    print(f"leak: {CREATIONS} creations of {kind}: resident memory {grown / 2**20:+.1f} MiB, device free memory "
          f"{-lost / 2**20:+.1f} MiB{'' if DEVICE_MEMORY_CHECKED else ' (not judged: other processes share it)'}")

"""GPU tests of checked mode (``num_blocks`` > 0 with a device ``error_flags`` word).

- **write**: slots whose page is ``>= num_blocks`` are skipped (their bytes, and the guards past the
  pools where they would land, keep the canary) and raise ``FP8KTURBOV_INDEX_ERROR_SLOT``; the other
  slots' bytes equal the reference's. With every slot in range the word stays 0.
- **dequantize**: such slots give rows of zeros and raise the same bit; the others match the
  reference.
- **decode**: block-table entries of attended positions that are negative or ``>= num_blocks`` are
  left out of the softmax (the output equals the reference over the remaining pages) and raise
  ``FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE``; a ``seq_len`` outside ``[0, max_blocks_per_seq * block_size]``
  is clamped and raises ``FP8KTURBOV_INDEX_ERROR_SEQ_LEN``. Entries past a sequence's length (the
  tables hold -7 there) are not checked. With valid tables the checked output is bit-identical to
  the unchecked one. Pages of 16 slots (a tile per page) and of 8 (tiles across pages), split and
  unsplit, and over 8 KV heads read in groups of 4 (head groups).
"""

from __future__ import annotations

import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head
from fp8kturbov import reference as ref
from test_collateral_writes import (BF16, K_SCALE, KEY_PAD, PADDING, VALUE_PAD, DecodeSetup, Guarded,
                                    WriteLayout, assert_unchanged, bf16_rows)
from test_gpu_kernels import assert_head_groups_planned

pytestmark = pytest.mark.gpu

FLAGS = fp8kturbov.IndexErrorFlags  # fp8kturbov_index_error_t
SLOT, BLOCK_TABLE, SEQ_LEN = FLAGS.SLOT, FLAGS.BLOCK_TABLE, FLAGS.SEQ_LEN


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


def out_of_range_slots(layout: WriteLayout) -> np.ndarray:
    """Slots of pages ``num_blocks`` (its first and last slot), ``num_blocks + 1`` and far beyond."""
    first = layout.num_blocks * layout.block_size
    return np.array([first, first + layout.block_size - 1, first + layout.block_size + 3, 2**40], dtype=np.int64)


# ---- Write and dequantize ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("bad", [True, False], ids=["out_of_range", "all_in_range"])
def test_checked_write_skips_out_of_range_slots(device, rng, bits, head_dim, bad):
    layout = WriteLayout(bits, head_dim, padded=True)
    good = rng.choice(layout.num_slots, size=layout.num_slots // 2, replace=False).astype(np.int64)
    parts = [good, PADDING] + ([out_of_range_slots(layout)] if bad else [])
    slots = rng.permutation(np.concatenate(parts).astype(np.int64))
    n = layout.n
    key = bf16_rows(rng, len(slots), n + KEY_PAD, n)
    value = bf16_rows(rng, len(slots), n + VALUE_PAD, n)
    k_canary = rng.integers(0, 256, layout.num_blocks * layout.k_stride, dtype=np.uint8)
    v_canary = rng.integers(0, 256, layout.num_blocks * layout.v_stride, dtype=np.uint8)
    # Guards of a page and more past each pool: a skipped slot would have written into them.
    k_pool = Guarded(device, rng, k_canary, guard_bytes=-(-2 * layout.k_stride // 256) * 256)
    v_pool = Guarded(device, rng, v_canary, guard_bytes=-(-2 * layout.v_stride // 256) * 256)
    inputs = [device.upload(a) for a in (key.view(np.uint16), value.view(np.uint16), slots)]
    word = fp8kturbov.ErrorWord(0)
    fp8kturbov.reshape_and_cache(*inputs[:2], k_pool.address, v_pool.address, inputs[2],
                                 num_tokens=len(slots), key_stride=n + KEY_PAD, value_stride=n + VALUE_PAD,
                                 num_blocks=layout.num_blocks, error_flags=word.ptr,
                                 stream=device.stream, **layout.scalars())
    got_k, got_v = k_pool.download(), v_pool.download()  # also checks the guards
    assert word.read(device.stream) == (SLOT if bad else 0)
    want_k, want_v = k_canary.copy(), v_canary.copy()
    in_range = slots < layout.num_slots  # the reference writes the in-range and padding slots only
    ref.write_cache(key[in_range], value[in_range], want_k, want_v, slots[in_range], int(in_range.sum()),
                    layout.num_kv_heads, head_dim, layout.block_size, n + KEY_PAD, n + VALUE_PAD, K_SCALE,
                    layout.k_stride, layout.v_stride, layout.v_data, bits)
    assert_unchanged(got_k, want_k, "K pool against the reference")
    assert_unchanged(got_v, want_v, "V pool against the reference")
    assert np.any(got_k != k_canary), "the write changed nothing: the test proves nothing"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_checked_dequantize_gives_zero_rows_for_out_of_range_slots(device, rng, bits):
    layout = WriteLayout(bits, 128, padded=True)
    n = layout.n
    k_pool = rng.integers(0, 256, layout.num_blocks * layout.k_stride, dtype=np.uint8)
    v_pool = rng.integers(0, 256, layout.num_blocks * layout.v_stride, dtype=np.uint8)
    everything = np.arange(layout.num_slots)
    ref.write_cache(bf16_rows(rng, layout.num_slots, n, n), bf16_rows(rng, layout.num_slots, n, n), k_pool,
                    v_pool, everything, layout.num_slots, layout.num_kv_heads, 128, layout.block_size, n, n,
                    K_SCALE, layout.k_stride, layout.v_stride, layout.v_data, bits)
    slots = rng.permutation(np.concatenate([rng.choice(everything, 24, replace=False), PADDING,
                                            out_of_range_slots(layout)]).astype(np.int64))
    poison = np.full((len(slots), n), np.nan, dtype=BF16)
    key_out, value_out = device.upload(poison.view(np.uint16)), device.upload(poison.view(np.uint16))
    word = fp8kturbov.ErrorWord(0)
    fp8kturbov.dequantize(device.upload(k_pool), device.upload(v_pool), device.upload(slots), key_out, value_out,
                          num_tokens=len(slots), key_stride=n, value_stride=n, num_blocks=layout.num_blocks,
                          error_flags=word.ptr, stream=device.stream, **layout.scalars())
    got_key = device.download(key_out, poison.view(np.uint16))
    got_value = device.download(value_out, poison.view(np.uint16))
    assert word.read(device.stream) == SLOT
    # The reference reads the in-range slots; the others must be zero rows like padding.
    in_range = slots < layout.num_slots
    want_key, want_value = ref.dequantize_cache(k_pool, v_pool, np.where(in_range, slots, -1), len(slots),
                                                layout.num_kv_heads, 128, layout.block_size, K_SCALE,
                                                layout.k_stride, layout.v_stride, layout.v_data, bits)
    assert_unchanged(got_key, want_key.view(np.uint16), "dequantized key rows")
    assert_unchanged(got_value, want_value.view(np.uint16), "dequantized value rows")
    assert np.all(got_key[~in_range] == 0), "an out-of-range slot must give a row of +0"


# ---- Decode ----------------------------------------------------------------------------------------


class SmallPageSetup(DecodeSetup):
    """Pages of 8 slots: a 16-token tile spans two pages (the kernel's per-row page path)."""

    block_size = 8


def remaining_pages(setup: DecodeSetup, tables: np.ndarray, seq_lens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Tables and lengths of the positions checked mode keeps: the length clamped to the table,
    the pages out of range dropped. Only the last page of a sequence can be partial, so dropping
    pages and shortening the length describes exactly the remaining positions (the softmax does not
    depend on their order)."""
    B = setup.block_size
    capacity = setup.max_blocks_per_seq * B
    kept_tables = np.full_like(tables, -7)
    kept_lens = np.zeros_like(seq_lens)
    for s in range(setup.num_seqs):
        length = min(max(int(seq_lens[s]), 0), capacity)
        pages = tables[s, :-(-length // B)]
        good = (pages >= 0) & (pages < setup.num_blocks)
        kept_tables[s, :good.sum()] = pages[good]
        sizes = np.minimum(B, length - B * np.arange(len(pages)))  # positions of each page
        kept_lens[s] = sizes[good].sum()
    return kept_tables, kept_lens


def run_decode(device, rng, setup: DecodeSetup, split: bool, checked: bool) -> tuple[np.ndarray, int]:
    """Decode the setup (tables and lengths as they are now); returns (output as float64, the word)."""
    out_bytes = np.full((setup.num_seqs, setup.num_q_heads, setup.head_dim), 0x7FC1, dtype=np.uint16)
    out = device.upload(out_bytes)
    workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**setup.scalars()) if split else 0
    word = fp8kturbov.ErrorWord(0)
    fp8kturbov.paged_decode_attn(
        device.upload(setup.q.view(np.uint16)), device.upload(setup.k_pool), device.upload(setup.v_pool), out,
        device.upload(setup.block_tables), device.upload(setup.seq_lens),
        workspace=device.upload(np.zeros(max(workspace_bytes, 1), dtype=np.uint8)),
        workspace_bytes=workspace_bytes, num_blocks=setup.num_blocks if checked else 0,
        error_flags=word.ptr if checked else 0, stream=device.stream, **setup.scalars())
    return device.download(out, out_bytes).view(BF16).astype(np.float64), word.read(device.stream)


class HeadGroupSetup(DecodeSetup):
    """8 KV heads and block tables of 65536 positions: with 64 sequences and 2- or 3-bit V the
    plan reads the KV heads in groups of 4 (its workspace holds 4 partials per split)."""

    num_kv_heads, table_blocks = 8, 4096


SETUPS = [DecodeSetup, SmallPageSetup]


@pytest.mark.parametrize("setup_type", SETUPS, ids=["page16", "page8"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_checked_decode_of_valid_tables_matches_unchecked(device, rng, setup_type, bits, head_dim, split):
    """Valid tables (their unused entries hold -7): no flag, and bit for bit the unchecked output."""
    setup = setup_type(rng, bits, head_dim, [300, 1, 77, 1000, 0, 16])
    unchecked, _ = run_decode(device, rng, setup, split, checked=False)
    checked, flags = run_decode(device, rng, setup, split, checked=True)
    assert flags == 0
    assert np.array_equal(checked, unchecked), "checked mode changed the result of valid tables"
    assert relative_error_per_head(checked, setup.reference()).max() <= 1e-2


@pytest.mark.parametrize("setup_type", SETUPS, ids=["page16", "page8"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_checked_decode_leaves_out_pages_out_of_range(device, rng, setup_type, bits, head_dim, split):
    check_out_of_range_pages_left_out(device, rng, setup_type(rng, bits, head_dim, [700, 45, 300, 9, 512]), split)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_checked_decode_with_head_groups_leaves_out_pages_out_of_range(device, rng, bits, head_dim):
    setup = HeadGroupSetup(rng, bits, head_dim, [700, 45, 300, 9, 512, *rng.integers(0, 40, 59)])
    assert_head_groups_planned(**setup.scalars())
    check_out_of_range_pages_left_out(device, rng, setup, split=True)


def check_out_of_range_pages_left_out(device, rng, setup: DecodeSetup, split: bool) -> None:
    """Out-of-range page ids in sequences 0, 2 and 3 (all of 3's) and past sequence 4's length:
    flagged, and the output that of the remaining pages."""
    B = setup.block_size
    bad_ids = [setup.num_blocks, setup.num_blocks + 1000, -1, -5, np.iinfo(np.int32).min, np.iinfo(np.int32).max]
    for s, count in ((0, 6), (2, 1), (3, None)):  # every page of sequence 3: no position left
        pages = -(-int(setup.seq_lens[s]) // B)
        for j in rng.choice(pages, size=pages if count is None else count, replace=False):
            setup.block_tables[s, j] = rng.choice(bad_ids)
    setup.block_tables[4, -(-512 // B):] = setup.num_blocks + 7  # past seq_len: never read, not checked
    got, flags = run_decode(device, rng, setup, split, checked=True)
    assert flags == BLOCK_TABLE
    kept_tables, kept_lens = remaining_pages(setup, setup.block_tables[:setup.num_seqs], setup.seq_lens[:setup.num_seqs])
    assert kept_lens[3] == 0 and kept_lens[0] < setup.seq_lens[0]
    assert np.all(got[3] == 0), "a sequence without any position left gives zeros"
    setup.block_tables[:setup.num_seqs], setup.seq_lens[:setup.num_seqs] = kept_tables, kept_lens
    err = relative_error_per_head(got, setup.reference())
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("setup_type", SETUPS, ids=["page16", "page8"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_checked_decode_reports_and_clamps_seq_len(device, rng, setup_type, split):
    setup = setup_type(rng, 3, 128, [64, 200, 33])
    capacity = setup.max_blocks_per_seq * setup.block_size
    setup.block_tables[1, :] = rng.choice(setup.num_blocks, setup.max_blocks_per_seq, replace=False)
    setup.seq_lens[0] = -3           # clamped to 0: zeros
    setup.seq_lens[1] = capacity + 5  # clamped to the table, whose pages are all valid here
    got, flags = run_decode(device, rng, setup, split, checked=True)
    assert flags == SEQ_LEN
    assert np.all(got[0] == 0)
    _, unchecked_flags = run_decode(device, rng, setup, split, checked=False)
    assert unchecked_flags == 0, "unchecked mode must not touch the word"
    setup.seq_lens[:2] = [0, capacity]
    err = relative_error_per_head(got, setup.reference())
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


def test_checked_decode_reports_both_kinds(device, rng):
    """A length past the table, whose entries past the sequence's pages are -7: both bits."""
    setup = DecodeSetup(rng, 4, 128, [40, 100])
    setup.seq_lens[0] = setup.max_blocks_per_seq * setup.block_size + 1
    got, flags = run_decode(device, rng, setup, split=True, checked=True)
    assert flags == SEQ_LEN | BLOCK_TABLE
    kept_tables, kept_lens = remaining_pages(setup, setup.block_tables[:2], setup.seq_lens[:2])
    assert kept_lens[0] == 48  # the three pages of 40 positions, now full; -7 entries dropped
    setup.block_tables[:2], setup.seq_lens[:2] = kept_tables, kept_lens
    assert relative_error_per_head(got, setup.reference()).max() <= 1e-2


# ---- The Python layer ----------------------------------------------------------------------------


class DeviceArray:
    """An uploaded host array as the Python layer sees a device array (``__cuda_array_interface__``;
    bf16 as typestr ``<V2``)."""

    def __init__(self, device, host: np.ndarray) -> None:
        typestr = "<V2" if host.dtype == BF16 else host.dtype.str
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": typestr, "strides": None,
                                         "data": (device.upload(host), False), "version": 3, "stream": None}


def test_checked_cache_raises_after_the_stream_and_then_resets(device, rng):
    """A KVCache built with checked=True: write_kv with a slot past the pools, then paged_decode with
    a page id past them; each time check_errors raises CacheIndexError with that flag, and then finds
    the word zeroed."""
    layout = fp8kturbov.CacheLayout(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=128, v_bits=3)
    n = layout.row_elems
    with fp8kturbov.KVCache.allocate(layout, K_SCALE, backend="cuda", checked=True) as cache:
        # Page 0 whole (the decode below reads it; the pools start uninitialised), then a slot past
        # the pools.
        slots = np.append(np.arange(layout.block_size), layout.num_slots + 5).astype(np.int64)
        rows = len(slots)
        fp8kturbov.write_kv(DeviceArray(device, bf16_rows(rng, rows, n, n)),
                            DeviceArray(device, bf16_rows(rng, rows, n, n)), cache, DeviceArray(device, slots),
                            stream=device.stream)
        with pytest.raises(fp8kturbov.CacheIndexError) as caught:
            cache.check_errors(device.stream)
        assert caught.value.flags == SLOT
        cache.check_errors(device.stream)  # zeroed when it raised

        q = bf16_rows(rng, 1, 8 * 128, 8 * 128).reshape(1, 8, 128)
        fp8kturbov.paged_decode(DeviceArray(device, q), cache, DeviceArray(device, np.array([[0, 9]], np.int32)),
                                DeviceArray(device, np.array([20], np.int32)),
                                out=DeviceArray(device, np.zeros((1, 8, 128), BF16)), stream=device.stream)
        with pytest.raises(fp8kturbov.CacheIndexError) as caught:
            cache.check_errors(device.stream)
        assert caught.value.flags == BLOCK_TABLE and "BLOCK_TABLE" in str(caught.value)
        cache.check_errors(device.stream)

"""GPU tests: the kernels against the NumPy reference on fresh random inputs, and the golden vectors.

Pools and outputs are poisoned before each launch and compared whole, so a stray or missing write
shows. Cache bytes must match exactly (the kernels encode each group sequentially, as the
reference does); decode outputs are compared per (sequence, head) by relative error against the
float64 reference.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head, shuffled_block_tables, widened_rows
from fp8kturbov import reference as ref

pytestmark = pytest.mark.gpu

GOLDEN = sorted((Path(__file__).parent / "data" / "golden").glob("*.npz"))
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


def random_rows(rng, num_rows: int, stride: int, row_elems: int, *, hostile: bool) -> np.ndarray:
    """bf16 rows [num_rows, stride]: N(0, 1) data, 1/8 of the rows x10, 5 % of the groups zero;
    with ``hostile`` also a few NaN and ±Inf elements. Padding beyond the row is NaN so that
    reading it would show."""
    rows = np.full((num_rows, stride), np.nan, dtype=np.float32)
    data = rng.standard_normal((num_rows, row_elems)).astype(np.float32)
    data[rng.random(num_rows) < 1 / 8] *= 10
    groups = data.reshape(num_rows, -1, 16)
    groups[rng.random(groups.shape[:2]) < 0.05] = 0
    if hostile:
        flat = data.reshape(-1)
        picks = rng.choice(flat.size, size=3, replace=False)
        flat[picks] = [np.nan, np.inf, -np.inf]
    rows[:, :row_elems] = data
    return rows.astype(BF16)


# The searching encoders' edge cases, as (share of the groups, factor) on bf16 groups: scales small
# enough that subnormal scale bytes win, sums of squares that are subnormal (2^-70) or vanish while
# the codes' dot product does not (2^-90), and sums that overflow float32 for some or all of the
# candidates (2^61, 2^64; the projection encoder's |x|² at 2^64, which falls back to matched-norm).
SEARCH_EDGE_FACTORS = {"mse": ((0.05, 2.0**-12), (0.03, 2.0**61), (0.02, 2.0**64)),
                       "projection": ((0.05, 2.0**-12), (0.02, 2.0**-70), (0.02, 2.0**-90),
                                      (0.03, 2.0**61), (0.02, 2.0**64))}


def add_search_edge_groups(rng, groups: np.ndarray, encoder: str) -> None:
    """Scales shares of the bf16 groups ``[..., 16]`` in place by `SEARCH_EDGE_FACTORS`; for the
    projection encoder also gives 3 % of the groups an outlier (one element x 2^8), whose codes'
    angle is decided by few candidates."""
    pick = rng.random(groups.shape[:-1])
    start = 0.0
    for share, factor in SEARCH_EDGE_FACTORS[encoder]:
        groups[(pick >= start) & (pick < start + share)] *= BF16(factor)
        start += share
    if encoder == "projection":
        outliers = (pick >= start) & (pick < start + 0.03)
        groups[outliers, rng.integers(16)] *= BF16(2.0**8)


def random_slots(rng, num_tokens: int, num_slots: int) -> np.ndarray:
    slots = rng.choice(num_slots, size=num_tokens, replace=False).astype(np.int64)
    slots[rng.random(num_tokens) < 0.1] = -1
    return slots


def random_pool(rng, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def assert_pools_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = np.flatnonzero(got != want)
    assert diff.size == 0, f"{what}: {diff.size} bytes differ, first at {diff[:8].tolist()}"


# ---- Cache write ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("entry, row_pad", [("fixed", (32, 16)), ("generic", (32, 16)),
                                            ("generic", (3, 1)), ("mse", (32, 16)),
                                            ("rotated", (3, 1)), ("rotated_mse", (32, 16)),
                                            ("projection", (3, 1)), ("rotated_projection", (32, 16))],
                         ids=["fixed", "generic", "odd_row_strides", "mse_encoder", "rotated",
                              "rotated_mse", "projection_encoder", "rotated_projection"])
def test_write_matches_reference_byte_for_byte(device, rng, bits, head_dim, entry, row_pad):
    """Rotated (FORMAT §6): each V head rotated by the threads holding its groups, in the float32
    arithmetic of reference.rotate_f32; a NaN or Inf spreads over its head, in both."""
    rotation = entry.startswith("rotated")
    if rotation and head_dim not in ref.ROTATION_DIMS:
        pytest.skip("FORMAT §6 defines no rotation for this head_dim")
    num_kv_heads, block_size, num_blocks, num_tokens = 2, 16, 12, 150
    n = num_kv_heads * head_dim
    layout = fp8kturbov.CacheLayout(num_blocks, block_size, num_kv_heads, head_dim, bits)
    # Padded strides: pages and rows longer than packed, so stride handling is exercised.
    k_stride = layout.k_block_stride_bytes + 48
    v_data = layout.v_data_section_bytes + 8
    v_stride = v_data + ref.v_scale_section_bytes(block_size, num_kv_heads, head_dim) + 24
    # Row strides in elements: multiples of 8 take the 16-byte load path, odd ones the other.
    key_stride, value_stride = n + row_pad[0], n + row_pad[1]
    key = random_rows(rng, num_tokens, key_stride, n, hostile=True)
    value = random_rows(rng, num_tokens, value_stride, n, hostile=True)
    encoder = next((e for e in SEARCH_EDGE_FACTORS if entry.endswith(e)), "matched_norm")
    if encoder in SEARCH_EDGE_FACTORS:
        add_search_edge_groups(rng, value[:, :n].reshape(num_tokens, -1, 16), encoder)
    slots = random_slots(rng, num_tokens, num_blocks * block_size)
    k_pool = random_pool(rng, num_blocks * k_stride)
    v_pool = random_pool(rng, num_blocks * v_stride)

    want_k, want_v = k_pool.copy(), v_pool.copy()
    ref.write_cache(key, value, want_k, want_v, slots, num_tokens, num_kv_heads, head_dim,
                    block_size, key_stride, value_stride, 0.05, k_stride, v_stride, v_data, bits,
                    encoder=encoder, rotation=rotation)

    k_dev, v_dev = device.upload(k_pool), device.upload(v_pool)
    ptrs = [device.upload(key.view(np.uint16)), device.upload(value.view(np.uint16)), k_dev, v_dev,
            device.upload(slots)]
    if entry == "fixed":
        launcher = getattr(fp8kturbov, f"reshape_and_cache_fp8k_turbo{bits}v")
        launcher(*ptrs, num_tokens, num_kv_heads, head_dim, block_size, key_stride, value_stride,
                 0.05, k_stride, v_stride, v_data, stream=device.stream)
    else:
        fp8kturbov.reshape_and_cache(
            *ptrs, num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, key_stride=key_stride, value_stride=value_stride, k_scale=0.05,
            v_bits=bits, k_block_stride_bytes=k_stride, v_block_stride_bytes=v_stride,
            v_data_section_bytes=v_data, v_encoder=fp8kturbov.VEncoder[encoder.upper()],
            v_rotation=int(rotation), stream=device.stream)
    assert_pools_equal(device.download(k_dev, k_pool), want_k, "K pool")
    assert_pools_equal(device.download(v_dev, v_pool), want_v, "V pool")
    assert not np.array_equal(want_k, k_pool), "the write changed nothing: the test proves nothing"


def assert_packed_write_matches_reference(device, rng, key, value, slots, bits, num_kv_heads, head_dim,
                                          block_size, num_blocks, encoder="matched_norm"):
    """Writes the token rows (bf16 [tokens, num_kv_heads * head_dim], unpadded) at `slots` into packed
    pools of random bytes, by the reference and by the kernel; both pools must match byte for byte."""
    num_tokens, n = len(value), num_kv_heads * head_dim
    k_stride = ref.k_page_bytes(block_size, num_kv_heads, head_dim)
    v_data = ref.v_data_section_bytes(block_size, num_kv_heads, head_dim, bits)
    v_stride = ref.v_page_bytes(block_size, num_kv_heads, head_dim, bits)
    k_pool, v_pool = random_pool(rng, num_blocks * k_stride), random_pool(rng, num_blocks * v_stride)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    ref.write_cache(key, value, want_k, want_v, slots, num_tokens, num_kv_heads, head_dim, block_size,
                    n, n, 0.05, k_stride, v_stride, v_data, bits, encoder=encoder)
    k_dev, v_dev = device.upload(k_pool), device.upload(v_pool)
    fp8kturbov.reshape_and_cache(
        device.upload(key.view(np.uint16)), device.upload(value.view(np.uint16)), k_dev, v_dev,
        device.upload(slots), num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, key_stride=n, value_stride=n, k_scale=0.05, v_bits=bits,
        k_block_stride_bytes=k_stride, v_block_stride_bytes=v_stride, v_data_section_bytes=v_data,
        v_encoder=fp8kturbov.VEncoder[encoder.upper()], stream=device.stream)
    assert_pools_equal(device.download(k_dev, k_pool), want_k, "K pool")
    assert_pools_equal(device.download(v_dev, v_pool), want_v, "V pool")


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("encoder", ["mse", "projection"])
def test_large_search_write_matches_reference_byte_for_byte(device, rng, bits, encoder):
    """A write of more groups than the searching encoders search with a warp each (16384): one
    thread per group searches (the MSE encoder tightening its bound as it goes); the bytes are
    still the reference's."""
    num_kv_heads, head_dim, block_size, num_tokens = 2, 128, 16, 1100  # 17600 groups
    n = num_kv_heads * head_dim
    num_blocks = -(-num_tokens // block_size) + 2
    key = random_rows(rng, num_tokens, n, n, hostile=True)
    value = random_rows(rng, num_tokens, n, n, hostile=True)
    add_search_edge_groups(rng, value.reshape(num_tokens, -1, 16), encoder)
    slots = random_slots(rng, num_tokens, num_blocks * block_size)
    assert_packed_write_matches_reference(device, rng, key, value, slots, bits, num_kv_heads, head_dim,
                                          block_size, num_blocks, encoder=encoder)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_max", [1.0, 3.0])
def test_write_codes_every_bf16_value(device, rng, bits, group_max):
    """Every finite bf16 value x with |x| <= group_max, 15 to a group whose largest element is
    group_max, so that x * (kMax / group_max) sweeps the whole scaled range, from subnormals to
    the top level: the V codes (FORMAT §3.2 step 3, found by code cell from 3 bits and by two
    comparisons with 2) and scales must be the reference's, byte for byte."""
    all_bf16 = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32)
    sweep = all_bf16[np.isfinite(all_bf16) & (np.abs(all_bf16) <= group_max)]
    sweep = np.concatenate([sweep, np.zeros(-sweep.size % 15, np.float32)])
    groups = np.concatenate([np.full((sweep.size // 15, 1), group_max, np.float32), sweep.reshape(-1, 15)], axis=1)
    num_kv_heads, head_dim, block_size = 2, 128, 16
    n = num_kv_heads * head_dim
    groups = np.concatenate([groups, np.zeros((-len(groups) % (n // 16), 16), np.float32)])
    value = groups.reshape(-1, n).astype(BF16)
    num_tokens = len(value)
    key = random_rows(rng, num_tokens, n, n, hostile=False)
    num_blocks = -(-num_tokens // block_size)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)  # no padding: every row written
    assert_packed_write_matches_reference(device, rng, key, value, slots, bits, num_kv_heads, head_dim,
                                          block_size, num_blocks)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_write_reproduces_golden_pools(device, path):
    g = np.load(path)
    bits, n = int(g["bits"]), int(g["num_kv_heads"]) * int(g["head_dim"])
    k_dev, v_dev = device.upload(g["k_pool_before"]), device.upload(g["v_pool_before"])
    launcher = getattr(fp8kturbov, f"reshape_and_cache_fp8k_turbo{bits}v")
    launcher(device.upload(g["key_bf16_bits"]), device.upload(g["value_bf16_bits"]), k_dev, v_dev,
             device.upload(g["slot_mapping"]), len(g["slot_mapping"]), int(g["num_kv_heads"]),
             int(g["head_dim"]), int(g["block_size"]), n, n, float(g["k_scale"]),
             int(g["k_block_stride_bytes"]), int(g["v_block_stride_bytes"]),
             int(g["v_data_section_bytes"]), stream=device.stream)
    assert_pools_equal(device.download(k_dev, g["k_pool_after"]), g["k_pool_after"], "K pool")
    assert_pools_equal(device.download(v_dev, g["v_pool_after"]), g["v_pool_after"], "V pool")


# ---- Paged decode --------------------------------------------------------------------------------


class DecodeCase:
    """A random paged cache (written by the reference) with ragged sequences and a shuffled page
    table, plus queries and a poisoned output. ``q_lens``: query tokens per sequence (multi-token
    decode through ``query_start``); None is one query row per sequence without it."""

    def __init__(self, rng, bits, head_dim, group_size, window, *, q_gain=1.0, seq_lens=None,
                 block_size=16, v_pad=16, num_kv_heads=2, q_lens=None, rotation=False,
                 max_blocks_per_seq=None):
        self.bits, self.head_dim, self.window, self.rotation = bits, head_dim, window, rotation
        self.num_kv_heads, self.block_size = num_kv_heads, block_size
        self.num_q_heads = self.num_kv_heads * group_size
        self.seq_lens = np.array(seq_lens or [0, 1, 17, 100, 250, 64], dtype=np.int32)
        self.num_seqs = len(self.seq_lens)
        blocks_needed = -(-self.seq_lens // self.block_size)
        self.max_blocks_per_seq = max_blocks_per_seq or int(blocks_needed.max()) + 1
        self.num_blocks = int(blocks_needed.sum()) + 5
        n = self.num_kv_heads * head_dim
        # Padded K pages: exercises the K page stride the original ignored.
        self.k_stride = ref.k_page_bytes(self.block_size, self.num_kv_heads, head_dim) + 32
        self.v_data = ref.v_data_section_bytes(self.block_size, self.num_kv_heads, head_dim, bits)
        self.v_stride = ref.v_page_bytes(self.block_size, self.num_kv_heads, head_dim, bits) + v_pad
        self.k_scale, self.inv_sqrt_d = 0.05, float(1 / np.sqrt(head_dim))

        self.block_tables = shuffled_block_tables(rng, blocks_needed, self.num_blocks, self.max_blocks_per_seq)

        num_slots = self.num_blocks * self.block_size
        self.k_pool = random_pool(rng, self.num_blocks * self.k_stride)
        self.v_pool = random_pool(rng, self.num_blocks * self.v_stride)
        keys = random_rows(rng, num_slots, n, n, hostile=False)
        values = random_rows(rng, num_slots, n, n, hostile=False)
        ref.write_cache(keys, values, self.k_pool, self.v_pool, np.arange(num_slots), num_slots,
                        self.num_kv_heads, head_dim, self.block_size, n, n, self.k_scale,
                        self.k_stride, self.v_stride, self.v_data, bits, rotation=rotation)
        self.query_start = None if q_lens is None else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.num_rows = self.num_seqs if q_lens is None else int(self.query_start[-1])
        self.q_stride = self.num_q_heads * head_dim + 8
        q = rng.standard_normal((self.num_rows, self.q_stride)).astype(np.float32) * q_gain
        self.q = q.astype(BF16)

    def multi_token_scalars(self) -> dict:
        """The launch's multi-token fields: none without ``q_lens``, else ``max_q_len`` and
        ``num_query_rows`` (``query_start`` is a device address, added by `run`)."""
        if self.query_start is None:
            return {}
        return dict(max_q_len=max(int(np.diff(self.query_start).max()), 1), num_query_rows=self.num_rows)

    def reference(self, sparse_v_threshold=0.0, *, sinks=None, soft_cap=0.0, rotation=None):
        return ref.paged_decode(
            self.q, self.k_pool, self.v_pool, self.block_tables, self.seq_lens,
            self.max_blocks_per_seq, self.num_seqs, self.num_q_heads, self.num_kv_heads,
            self.head_dim, self.block_size, self.inv_sqrt_d, self.k_scale, self.q_stride,
            self.v_stride, self.v_data, self.window, self.bits,
            k_block_stride_bytes=self.k_stride, sparse_v_threshold=sparse_v_threshold,
            query_start=self.query_start, sinks=sinks, soft_cap=soft_cap,
            rotation=self.rotation if rotation is None else rotation)

    def scalars(self, sparse_v_threshold=0.0) -> dict:
        """The launch's scalar arguments (one query row per sequence)."""
        return dict(
            max_blocks_per_seq=self.max_blocks_per_seq, num_seqs=self.num_seqs,
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, block_size=self.block_size, inv_sqrt_d=self.inv_sqrt_d,
            k_scale=self.k_scale, q_stride=self.q_stride, v_bits=self.bits,
            k_block_stride_bytes=self.k_stride, v_block_stride_bytes=self.v_stride,
            v_data_section_bytes=self.v_data, sliding_window=self.window,
            sparse_v_threshold=sparse_v_threshold)

    def run(self, device, sparse_v_threshold, **options):
        """The kernel's output (`prepare`'s launch, once)."""
        launch, out, poison = self.prepare(device, sparse_v_threshold, **options)
        launch()
        return device.download(out, poison).view(BF16).astype(np.float64)

    def prepare(self, device, sparse_v_threshold, *, split=True, sinks=None, soft_cap=0.0,
                table_width=None):
        """The device buffers of one decode: ``(launch, out, poison)``, where ``launch()`` enqueues
        it on ``device.stream`` and ``out`` is the address of its output, filled with ``poison``
        (bf16 NaN bits). With ``split`` the context is split over CTAs (workspace given,
        poisoned), else each (sequence, KV head) runs in one CTA. ``sinks``: float32
        [num_q_heads] or None; ``soft_cap``: 0 = off. ``table_width``: block-table rows of that
        many entries (``block_tables_stride``), the table's in their first ``max_blocks_per_seq``
        and INT32_MAX, a page far outside the pools, in the rest; None: rows as wide as the table."""
        scalars = self.scalars(sparse_v_threshold)
        tables, table_args = self.block_tables, {}
        if table_width is not None:
            tables = widened_rows(self.block_tables, table_width)
            table_args["block_tables_stride"] = table_width
        multi_token = self.multi_token_scalars()
        workspace_bytes = (fp8kturbov.paged_decode_workspace_bytes(
            **scalars, max_q_len=multi_token.get("max_q_len", 0)) if split else 0)
        workspace = device.upload(np.full(workspace_bytes // 4, np.nan, dtype=np.float32))
        self.workspace = (workspace, workspace_bytes)  # the last prepared launch's, for inspection
        if multi_token:
            multi_token["query_start"] = device.upload(self.query_start)
        out_shape = (self.num_rows, self.num_q_heads, self.head_dim)
        poison = np.full(out_shape, 0x7FC1, dtype=np.uint16)  # a bf16 NaN
        out = device.upload(poison)
        pointers = (device.upload(self.q.view(np.uint16)), device.upload(self.k_pool),
                    device.upload(self.v_pool), out, device.upload(tables), device.upload(self.seq_lens))
        sinks_address = 0 if sinks is None else device.upload(np.asarray(sinks, dtype=np.float32))

        def launch():
            fp8kturbov.paged_decode_attn(
                *pointers, workspace=workspace, workspace_bytes=workspace_bytes, sinks=sinks_address,
                soft_cap=soft_cap, v_rotation=int(self.rotation), stream=device.stream, **scalars,
                **multi_token, **table_args)

        return launch, out, poison


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("group_size", [1, 4, 8, 12])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_decode_matches_float64_reference(device, rng, bits, head_dim, group_size, window, split):
    case = DecodeCase(rng, bits, head_dim, group_size, window)
    got = case.run(device, sparse_v_threshold=0.0, split=split)
    want = case.reference()
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("options", ["sinks", "soft_cap", "both"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_decode_sinks_and_soft_cap_match_reference(device, rng, bits, head_dim, options, split):
    """Sinks around the scores' range (some dominate their row) and a cap that bends the largest
    scores (with the cap, q is scaled up so that scores reach several caps); seq_len 0 still gives
    zeros."""
    case = DecodeCase(rng, bits, head_dim, 4, 40, q_gain=1.0 if options == "sinks" else 8.0)
    sinks = (rng.standard_normal(case.num_q_heads) * 4).astype(np.float32) if options != "soft_cap" else None
    soft_cap = 5.0 if options != "sinks" else 0.0
    got = case.run(device, 0.0, split=split, sinks=sinks, soft_cap=soft_cap)
    want = case.reference(sinks=sinks, soft_cap=soft_cap)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
    assert not np.allclose(want, case.reference(), atol=1e-3), "the options changed nothing: the test proves nothing"
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("multi_token", [False, True], ids=["one_token", "multi_token"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_rotated_decode_matches_reference(device, rng, bits, head_dim, multi_token, split):
    """A cache written rotated (FORMAT §6) and decoded with v_rotation: each output head is rotated
    back, by the decode's epilogue, or after the merge of the splits."""
    case = DecodeCase(rng, bits, head_dim, 4, 40, q_lens=MULTI_TOKEN_Q_LENS if multi_token else None,
                      rotation=True)
    got = case.run(device, 0.0, split=split)
    want = case.reference()
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert not np.allclose(want, case.reference(rotation=False), atol=1e-3), "the test proves nothing"
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


# Ragged query tokens per sequence (0 … 16, never more than its seq_len) for DecodeCase's
# default seq_lens [0, 1, 17, 100, 250, 64]: a group of 12 heads times 16 tokens spans 24 CTAs.
MULTI_TOKEN_Q_LENS = [0, 1, 16, 5, 16, 3]


@pytest.mark.parametrize("bits, head_dim", [(2, 64), (3, 128), (4, 256), (3, 512)])
@pytest.mark.parametrize("group_size", [1, 4, 12])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_multi_token_decode_matches_reference(device, rng, bits, head_dim, group_size, window, split):
    """query_start with ragged q_len: each token attends causally up to itself (window counted
    back from it), CTAs holding columns of several tokens mask per column."""
    case = DecodeCase(rng, bits, head_dim, group_size, window, q_lens=MULTI_TOKEN_Q_LENS)
    got = case.run(device, sparse_v_threshold=0.0, split=split)
    want = case.reference()
    assert got.shape[0] == sum(MULTI_TOKEN_Q_LENS)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"
    # The causal rule matters: the first token of a 16-token chunk differs from its last.
    first, last = case.query_start[2], case.query_start[3] - 1
    assert not np.allclose(want[first], want[last], atol=1e-3), "the test proves nothing"


@pytest.mark.parametrize("bits, head_dim", [(2, 128), (4, 256)])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_multi_token_decode_with_sinks_and_soft_cap(device, rng, bits, head_dim, split):
    """Sinks and soft-capping combine with multi-token decode (sparse V: see
    test_sparse_v_error_is_bounded)."""
    case = DecodeCase(rng, bits, head_dim, 4, 40, q_gain=8.0, q_lens=MULTI_TOKEN_Q_LENS)
    sinks = (rng.standard_normal(case.num_q_heads) * 4).astype(np.float32)
    got = case.run(device, 0.0, split=split, sinks=sinks, soft_cap=5.0)
    err = relative_error_per_head(got, case.reference(sinks=sinks, soft_cap=5.0))
    assert not np.isnan(got).any() and err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


def run_multi_token(device, case: DecodeCase, query_start: np.ndarray, max_q_len: int, num_query_rows: int,
                    *, checked: bool, split: bool) -> tuple[np.ndarray, int]:
    """Decode ``case`` with the given multi-token fields (``query_start`` possibly inconsistent)
    into a poisoned output of ``case.num_rows`` rows; returns (output as float64, error word)."""
    scalars = dict(
        max_blocks_per_seq=case.max_blocks_per_seq, num_seqs=case.num_seqs, num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, block_size=case.block_size,
        inv_sqrt_d=case.inv_sqrt_d, k_scale=case.k_scale, q_stride=case.q_stride, v_bits=case.bits,
        k_block_stride_bytes=case.k_stride, v_block_stride_bytes=case.v_stride,
        v_data_section_bytes=case.v_data, sliding_window=case.window, sparse_v_threshold=0.0,
        max_q_len=max_q_len)
    workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**scalars) if split else 0
    poison = np.full((case.num_rows, case.num_q_heads, case.head_dim), 0x7FC1, dtype=np.uint16)
    out = device.upload(poison)
    word = fp8kturbov.ErrorWord(0)
    fp8kturbov.paged_decode_attn(
        device.upload(case.q.view(np.uint16)), device.upload(case.k_pool), device.upload(case.v_pool), out,
        device.upload(case.block_tables), device.upload(case.seq_lens),
        workspace=device.upload(np.full(max(workspace_bytes // 4, 1), np.nan, dtype=np.float32)),
        workspace_bytes=workspace_bytes, query_start=device.upload(query_start.astype(np.int32)),
        num_query_rows=num_query_rows, num_blocks=case.num_blocks if checked else 0,
        error_flags=word.ptr if checked else 0, stream=device.stream, **scalars)
    flags = word.read(device.stream)
    word.close()
    return device.download(out, poison).view(BF16).astype(np.float64), flags


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_checked_multi_token_decode_skips_and_reports_bad_query_start(device, rng, split):
    """seq_lens [0, 1, 17, 100, 250, 64]; query_start [-1, 0, 1, 5, 8, 24, 26] with max_q_len 8
    and num_query_rows 25: sequence 0 starts below 0, sequence 4 has 16 > max_q_len tokens and
    sequence 5 ends past num_query_rows. Checked: those are skipped (rows 8..25 keep the poison)
    and reported, sequences 1-3 (rows 0..7) match the reference. Unchecked: the word is untouched,
    sequence 5 (which only the row count rules out) is computed."""
    case = DecodeCase(rng, 3, 128, 4, 0, q_lens=[0, 1, 4, 3, 16, 2])  # 26 rows
    query_start = np.array([-1, 0, 1, 5, 8, 24, 26])
    valid = np.array([0, 0, 1, 5, 8, 8, 8])  # the same rows without sequences 0, 4 and 5
    got, flags = run_multi_token(device, case, query_start, 8, 25, checked=True, split=split)
    assert flags == int(fp8kturbov.IndexErrorFlags.QUERY_START)
    assert np.isnan(got[8:]).all(), "a skipped sequence's rows must not be written"
    case.query_start = valid
    err = relative_error_per_head(got[:8], case.reference()[:8])
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"
    got, flags = run_multi_token(device, case, query_start, 8, 25, checked=False, split=split)
    assert flags == 0
    assert np.isnan(got[8:24]).all() and not np.isnan(got[24:]).any()


def test_checked_multi_token_decode_reports_more_tokens_than_positions(device, rng):
    """Sequence 1 holds one position but two query tokens: reported; its first token attends
    nothing (zeros), its second the one position, as the causal rule gives them."""
    case = DecodeCase(rng, 2, 64, 4, 0, q_lens=[0, 2, 4, 3, 16, 2])
    got, flags = run_multi_token(device, case, case.query_start, 16, case.num_rows, checked=True, split=False)
    assert flags == int(fp8kturbov.IndexErrorFlags.QUERY_START)
    assert np.all(got[0] == 0)
    # The reference, without row 0: sequence 1 keeps its second token only, a valid chunk.
    case.q, case.query_start = case.q[1:], case.query_start - np.minimum(case.query_start, 1)
    want = case.reference()
    err = relative_error_per_head(got[1:], want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("window", [0, 1000])
def test_long_contexts_split_over_ctas(device, rng, bits, head_dim, window):
    """Long and ragged sequences, few of them: the plan splits each context over many CTAs."""
    case = DecodeCase(rng, bits, head_dim, 4, window, seq_lens=[3001, 0, 1, 777, 1500])
    got = case.run(device, sparse_v_threshold=0.0)
    err = relative_error_per_head(got, case.reference())
    assert not np.isnan(got).any() and np.all(got[1] == 0)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"
    again = case.run(device, sparse_v_threshold=0.0)
    assert np.array_equal(got, again), "a fixed plan must give identical results"


def assert_head_groups_planned(**scalars) -> None:
    """The plan for these launch scalars reads the KV heads in groups of 4: its workspace holds 4
    partials (one per token stream) per split and query head, where one KV head per CTA needs one
    per split."""
    workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**scalars)
    partial_bytes = scalars["num_seqs"] * scalars["num_q_heads"] * (scalars["head_dim"] + 2) * 4  # bytes
    assert workspace_bytes > 0 and workspace_bytes % (4 * partial_bytes) == 0, (workspace_bytes, partial_bytes)


def head_group_case(rng, bits, q_gain=1.0) -> DecodeCase:
    """64 sequences over 8 KV heads (GQA 4, head_dim 128) with tables of 8192 positions: the plan
    reads the KV heads in groups of 4 (asserted). Sequences of 2100, 1000 and 0 positions, the rest
    short."""
    seq_lens = rng.integers(0, 60, 64)
    seq_lens[:3] = [2100, 1000, 0]
    case = DecodeCase(rng, bits, 128, 4, 0, q_gain=q_gain, seq_lens=seq_lens.tolist(), num_kv_heads=8,
                      max_blocks_per_seq=512)
    assert_head_groups_planned(**case.scalars())
    return case


@pytest.mark.parametrize("bits, head_dim, head_groups", [(3, 128, False), (4, 256, False), (3, 128, True)])
def test_decode_captured_in_a_graph_repeats_the_direct_launch(device, rng, bits, head_dim, head_groups):
    """A split decode captured into a CUDA graph (on sm_90 with a CUDA 12.3 or later driver, the
    merge kernel joined to the decode kernel by a programmatic edge) and replayed twice over a
    re-poisoned output writes what the launch outside the graph wrote, bit for bit (a fixed plan).
    Also with head groups (head_group_case)."""
    if head_groups:
        case = head_group_case(rng, bits)
    else:
        case = DecodeCase(rng, bits, head_dim, 4, 0, seq_lens=[3001, 0, 1, 777, 1500])
    launch, out, poison = case.prepare(device, 0.0)
    launch()
    direct = device.download(out, poison)
    got = direct.view(BF16).astype(np.float64)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert relative_error_per_head(got, case.reference()).max() <= 1e-2
    graph = device.capture(launch)
    for _ in range(2):
        device.write(out, poison)
        device.replay(graph)
        assert np.array_equal(device.download(out, poison), direct), "the graph's replay differs"


@pytest.mark.parametrize("plan", ["split", "head_groups"])
def test_wider_table_rows_decode_as_the_compact_table(device, rng, plan):
    """Block-table rows wider than max_blocks_per_seq (block_tables_stride), as an engine's rows
    sized for its longest context: the decode reads the first max_blocks_per_seq entries of each
    row and plans as for the compact table, so its output is the compact table's bit for bit. The
    entries past them are pages far outside the pools, which would fault if read."""
    if plan == "head_groups":
        case = head_group_case(rng, 3)
    else:
        case = DecodeCase(rng, 3, 128, 4, 0, seq_lens=[3001, 0, 1, 777, 1500])
    compact = case.run(device, 0.0)
    assert not np.isnan(compact).any(), "an output element was left unwritten (poison NaN)"
    assert relative_error_per_head(compact, case.reference()).max() <= 1e-2
    wide = case.run(device, 0.0, table_width=2 * case.max_blocks_per_seq + 3)
    assert np.array_equal(wide, compact), "wider rows changed the output"


def written_partials(device, case: DecodeCase) -> tuple[int, int]:
    """The partials that the workspace of the case's last launch holds room for, and those that the
    launch wrote (the workspace is poisoned with NaN; a written partial has a denominator)."""
    address, nbytes = case.workspace
    partials = device.download(address, np.empty(nbytes // 4, np.float32)).reshape(-1, case.head_dim + 2)
    return partials.shape[0], int((~np.isnan(partials[:, -1])).sum())


@pytest.mark.parametrize("bits, layout", [(2, "one_token"), (3, "one_token"), (4, "one_token"), (2, "multi_token"),
                                          (3, "multi_token"), (4, "multi_token"), (2, "head_groups"), (3, "head_groups")])
def test_split_slots_shared_by_length_match_reference(device, rng, bits, layout):
    """Sequences over 8 KV heads (GQA 4), on an H200-sized GPU. For 8 sequences in tables of 8192
    positions the plan has 8 splits of 64 tiles per sequence; for 16 in tables of 32768
    (head_groups) 4 splits of 512 tiles, whose token streams are long enough for head groups
    (asserted). Either way the sequences share the split slots by length (docs/api.md): the long
    ones take as many splits as their tiles allow, the short ones one each, and the slots after the
    last share stay idle. The output matches the reference, and fewer partials were written than
    equal shares write (the workspace is poisoned with NaN: an idle slot writes none, where equal
    shares write a partial per slot and query row)."""
    q_lens = [2, 0, 1, 2, 1, 0, 1, 2] if layout == "multi_token" else None
    if layout == "head_groups":
        seq_lens = [20000, 0, 1, 300, 5000, 0, 17, 9000, 40, 2, 0, 600, 3, 1200, 7, 64]
        max_blocks_per_seq = 2048
    else:
        seq_lens, max_blocks_per_seq = [4096, 0, 1, 100, 16, 0, 3, 50], 512
    case = DecodeCase(rng, bits, 128, 4, 0, seq_lens=seq_lens, max_blocks_per_seq=max_blocks_per_seq,
                      num_kv_heads=8, q_lens=q_lens)
    if layout == "head_groups":
        assert_head_groups_planned(**case.scalars())
    got = case.run(device, 0.0)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert relative_error_per_head(got, case.reference()).max() <= 1e-2
    room, written = written_partials(device, case)
    max_q_len = case.multi_token_scalars().get("max_q_len", 1)
    splits = room // (case.num_seqs * max_q_len * case.num_q_heads)  # x 4 with head groups
    equal_shares_write = splits * sum(q_lens or [1] * case.num_seqs) * case.num_q_heads  # partials
    assert splits >= 4 and 0 < written < equal_shares_write, (splits, written, equal_shares_write)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 256, 512])
def test_split_slots_shared_by_length_at_other_head_dims(device, rng, bits, head_dim):
    """The shares at the other head dims, whose CTAs stream 4, 2 or 1 token streams: three
    sequences over 2 KV heads (GQA 2) in tables of 131072 positions, which plan 22 to 110 splits
    of 75 to 376 tiles per sequence at 1 to 5 CTAs per SM, so that the sequences share the split
    slots whatever the shape's occupancy. The long sequence (250 tiles) takes one split
    per 8 tiles, fewer than the slots, so some stay idle. The output matches the reference, and
    fewer partials were written than equal shares write."""
    case = DecodeCase(rng, bits, head_dim, 2, 0, seq_lens=[4000, 0, 40], num_kv_heads=2,
                      max_blocks_per_seq=131072 // 16)
    got = case.run(device, 0.0)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
    assert relative_error_per_head(got, case.reference()).max() <= 1e-2
    room, written = written_partials(device, case)
    splits = room // (case.num_seqs * case.num_q_heads)
    assert splits >= 4 and 0 < written < splits * case.num_seqs * case.num_q_heads, (splits, written)


@pytest.mark.parametrize("bits, head_dim", [(2, 64), (3, 128), (4, 128), (2, 256), (4, 512)])
@pytest.mark.parametrize("window", [0, 40])
def test_batch_of_several_waves_matches_reference(device, rng, bits, head_dim, window):
    """120 sequences of random lengths (zeros among them) over 16 KV heads, unsplit: 1920 CTAs, more
    than 9 per multiprocessor of 132, so the grid runs in several waves whatever the shape's
    occupancy. Every output element is written and matches the reference."""
    seq_lens = [int(x) for x in rng.integers(0, 300, size=120)]
    seq_lens[::17] = [0] * len(seq_lens[::17])
    case = DecodeCase(rng, bits, head_dim, 2, window, seq_lens=seq_lens, num_kv_heads=16)
    got = case.run(device, 0.0, split=False)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
    assert relative_error_per_head(got, case.reference()).max() <= 1e-2


@pytest.mark.parametrize("bits, head_dim, group_size, num_kv_heads, block_size, window", [
    (2, 64, 4, 8, 16, 0), (3, 128, 4, 8, 16, 0), (2, 128, 1, 8, 8, 4500), (3, 128, 1, 8, 8, 4500),
    (2, 128, 8, 4, 16, 0), (3, 64, 8, 4, 8, 0), (3, 64, 3, 12, 32, 4100), (2, 128, 3, 12, 32, 4100)])
def test_head_groups_match_reference(device, rng, bits, head_dim, group_size, num_kv_heads, block_size,
                                     window):
    """2- and 3-bit V. A grid that fills the GPU (about 512 (sequence, KV head) pairs) over block
    tables of 65536 positions (or windows of over 4096, which the first sequence exceeds): every
    warp's token stream is at least 64 tiles long (the plan takes them from the table and the
    window, not from seq_lens; with more CTAs per multiprocessor, as 2-bit head_dim 64 has, it
    splits more), so the KV heads are read in groups of 4 (docs/api.md). Most sequences attend short,
    ragged or empty ranges; the long ones cross the 32-tile batches of page ids of a warp's
    stream. Without a workspace the same decode runs unsplit, one KV head per CTA: both match the
    reference, and a fixed plan repeats its result bit for bit."""
    num_seqs = -(-512 // num_kv_heads)
    seq_lens = rng.integers(0, 40, num_seqs)
    seq_lens[:4] = [window + 333 if window else 2100, 0, 1500, 1]
    case = DecodeCase(rng, bits, head_dim, group_size, window, seq_lens=seq_lens.tolist(),
                      block_size=block_size, num_kv_heads=num_kv_heads,
                      max_blocks_per_seq=(8192 if window else 65536) // block_size)
    assert_head_groups_planned(**case.scalars())
    want = case.reference()
    for split in (True, False):
        got = case.run(device, sparse_v_threshold=0.0, split=split)
        assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
        assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
        err = relative_error_per_head(got, want)
        assert err.max() <= 1e-2, f"split={split}: max relative error per head {err.max():.3g}"
        if split:
            assert np.array_equal(got, case.run(device, sparse_v_threshold=0.0)), "a fixed plan repeats its result"


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("options", ["sinks", "soft_cap", "sparse_v"])
def test_head_groups_with_options_match_reference(device, rng, bits, options):
    """Head groups (as above) with attention sinks, soft-capping or sparse V, whose merge and
    votes then run per warp."""
    case = head_group_case(rng, bits, q_gain=4.0)
    sinks = rng.standard_normal(case.num_q_heads).astype(np.float32) * 3 if options == "sinks" else None
    soft_cap = 5.0 if options == "soft_cap" else 0.0
    tau = 1e-3 if options == "sparse_v" else 0.0
    got = case.run(device, sparse_v_threshold=tau, sinks=sinks, soft_cap=soft_cap)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    want = case.reference(sinks=sinks, soft_cap=soft_cap)
    if options == "sparse_v":
        deviation = np.linalg.norm(got - want, axis=-1)
        bound = skippable_mass_times_norm(case, tau) + 1e-2 * np.linalg.norm(want, axis=-1) + 1e-6
        assert np.all(deviation <= bound), (deviation - bound).max()
    else:
        err = relative_error_per_head(got, want)
        assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("block_size, v_pad", [(16, 4), (1, 4), (8, 16), (24, 8)])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_decode_page_layouts(device, rng, bits, head_dim, block_size, v_pad, split):
    """Block sizes that are not a multiple of 16 (a tile spans pages: page ids per row) and V page
    strides that allow only 4- or 8-byte copies; without a split, the 3001-position sequence has
    each warp stream more than 32 tiles (the page ids come in batches of 32 tiles)."""
    case = DecodeCase(rng, bits, head_dim, 4, 0, seq_lens=[3001, 1, 100, 250], block_size=block_size,
                      v_pad=v_pad)
    got = case.run(device, sparse_v_threshold=0.0, split=split)
    err = relative_error_per_head(got, case.reference())
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim, num_kv_heads", [(64, 10), (128, 9), (256, 6), (512, 3)])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_decode_many_kv_heads(device, rng, bits, head_dim, num_kv_heads, block_size, split):
    """Many KV heads, counts that are not powers of two: each head's slice of a token row sits at
    its own offset of the pages' rows (3 to 10 heads per row)."""
    case = DecodeCase(rng, bits, head_dim, 2, 0, seq_lens=[700, 1, 0, 129], block_size=block_size,
                      num_kv_heads=num_kv_heads)
    got = case.run(device, sparse_v_threshold=0.0, split=split)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN)"
    assert np.all(got[case.seq_lens == 0] == 0), "seq_len 0 must give zeros"
    err = relative_error_per_head(got, case.reference())
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("q_lens", [None, [16, 5, 1, 0, 3]], ids=["one_token", "multi_token"])
def test_sparse_v_error_is_bounded(device, rng, bits, head_dim, q_lens):
    """Skipped rows all satisfy exp(s - M) <= tau (M the final max), so the deviation from the
    exact result is at most the softmax mass of such rows times their V norm (plus rounding)."""
    tau = 1e-3
    case = DecodeCase(rng, bits, head_dim, 4, 0, q_gain=4.0, seq_lens=[300, 129, 1, 0, 513], q_lens=q_lens)
    got = case.run(device, sparse_v_threshold=tau)
    exact = case.reference()
    bound = skippable_mass_times_norm(case, tau)
    deviation = np.linalg.norm(got - exact, axis=-1)
    rounding = 1e-2 * np.linalg.norm(exact, axis=-1)
    assert np.all(deviation <= bound + rounding + 1e-6), (deviation - bound - rounding).max()


def skippable_mass_times_norm(case: DecodeCase, tau: float) -> np.ndarray:
    """Per (query row, query head): sum over its attended positions with exp(s_p - M) <= tau of
    softmax_p * ||v_p||, from the reference's own dequantisation (s_p soft-capped where the case
    caps, M the row's largest score). A sink only adds to the softmax's denominator, so leaving it
    out gives an upper bound; a rotation keeps the norms."""
    d, group = case.head_dim, case.num_q_heads // case.num_kv_heads
    n = case.num_kv_heads * d
    row_data = n * case.bits // 8
    soft_cap = getattr(case, "soft_cap", 0.0)

    def rows_of(pool, starts, width):  # the bytes [start, start + width) at each start
        return pool[starts[:, None] + np.arange(width)]

    bound = np.zeros((case.num_rows, case.num_q_heads))
    q = case.q.astype(np.float64)
    kv = np.arange(case.num_q_heads) // group
    starts = np.arange(case.num_seqs + 1) if case.query_start is None else case.query_start
    rows = [(s, int(starts[s]) + i, int(case.seq_lens[s]) - int(starts[s + 1] - starts[s]) + i + 1)
            for s in range(case.num_seqs) for i in range(int(starts[s + 1] - starts[s]))]
    for s, row, length in rows:  # length: the row's attended end
        start = max(0, length - case.window) if case.window else 0
        positions = np.arange(start, length)
        if positions.size == 0:
            continue
        pages = case.block_tables[s, positions // case.block_size].astype(np.int64)
        offsets = positions % case.block_size
        k = ref.decode_k(rows_of(case.k_pool, pages * case.k_stride + offsets * n, n), case.k_scale)
        v = ref.decode_v(rows_of(case.v_pool, pages * case.v_stride + offsets * row_data, row_data),
                         rows_of(case.v_pool, pages * case.v_stride + case.v_data + offsets * (n // 16), n // 16),
                         case.bits)
        k = k.astype(np.float64).reshape(-1, case.num_kv_heads, d)
        v_norms = np.linalg.norm(v.astype(np.float64).reshape(-1, case.num_kv_heads, d), axis=-1)
        scores = np.einsum("phd,hd->ph", k[:, kv], q[row, :case.num_q_heads * d].reshape(-1, d)) * case.inv_sqrt_d
        if soft_cap > 0:
            scores = soft_cap * np.tanh(scores / soft_cap)
        weights = np.exp(scores - scores.max(axis=0))
        skipped = np.where(weights <= tau, weights, 0.0)
        bound[row] = (skipped * v_norms[:, kv]).sum(axis=0) / weights.sum(axis=0)
    return bound


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_decode_matches_golden_output(device, path):
    g = np.load(path)
    bits, d = int(g["bits"]), int(g["head_dim"])
    num_seqs, num_q_heads = g["q_bf16_bits"].shape[:2]
    out_poison = np.full(g["out_bf16_bits"].shape, 0x7FC1, dtype=np.uint16)
    out = device.upload(out_poison)
    launcher = getattr(fp8kturbov, f"paged_decode_attn_fp8k_turbo{bits}v")
    launcher(device.upload(g["q_bf16_bits"]), device.upload(g["decode_k_pool"]),
             device.upload(g["decode_v_pool"]), out, device.upload(g["block_tables"]),
             device.upload(g["seq_lens"]), g["block_tables"].shape[1], num_seqs, num_q_heads,
             int(g["num_kv_heads"]), d, int(g["block_size"]), float(g["inv_sqrt_d"]),
             float(g["k_scale"]), num_q_heads * d, int(g["v_block_stride_bytes"]),
             int(g["v_data_section_bytes"]), int(g["sliding_window"]), stream=device.stream)
    got = device.download(out, out_poison).view(BF16).astype(np.float64)
    want = g["out_bf16_bits"].view(BF16).astype(np.float64)
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head vs the original: {err.max():.3g}"

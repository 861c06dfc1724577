"""The NaN/Inf policy of docs/RELIABILITY.md §4: what a NaN or an infinity in the inputs or in the
cache does, and how far it reaches.

CPU tests check the policy against the NumPy reference (the write is byte-exact there, so the cache
bytes the kernels must produce are the reference's). Tests marked ``gpu`` run the kernels with
planted NaN/Inf and compare against a clean run of the same kernel: every output row and every pool
byte outside the documented reach must be bit-identical, and what the reach holds is NaN where
the float64 reference gives NaN.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import shuffled_block_tables
from fp8kturbov import reference as ref

BF16 = ml_dtypes.bfloat16
MID_CODE = {4: 8, 3: 4, 2: 2}  # the code of ±0 (the smallest positive level)


# ---- Helpers -----------------------------------------------------------------------------------


def bf16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(BF16)


def v_codes(data: np.ndarray, bits: int) -> np.ndarray:
    return ref.unpack_codes(data, bits)


class WriteCase:
    """Rows for one write: ``num_tokens`` tokens, 2 KV heads, packed pages, random pools."""

    def __init__(self, rng, bits: int, head_dim: int = 64, num_tokens: int = 6, k_scale: float = 0.05):
        self.bits, self.head_dim, self.k_scale = bits, head_dim, k_scale
        self.num_kv_heads, self.block_size, self.num_blocks = 2, 16, 3
        self.n = self.num_kv_heads * head_dim
        self.num_tokens = num_tokens
        self.k_stride = ref.k_page_bytes(self.block_size, self.num_kv_heads, head_dim)
        self.v_data = ref.v_data_section_bytes(self.block_size, self.num_kv_heads, head_dim, bits)
        self.v_stride = ref.v_page_bytes(self.block_size, self.num_kv_heads, head_dim, bits)
        self.key = bf16(rng.standard_normal((num_tokens, self.n)))
        self.value = bf16(rng.standard_normal((num_tokens, self.n)))
        self.slots = rng.choice(self.num_blocks * self.block_size, size=num_tokens,
                                replace=False).astype(np.int64)
        self.k_pool = rng.integers(0, 256, self.num_blocks * self.k_stride, dtype=np.uint8)
        self.v_pool = rng.integers(0, 256, self.num_blocks * self.v_stride, dtype=np.uint8)

    def reference(self, key=None, value=None):
        k, v = self.k_pool.copy(), self.v_pool.copy()
        ref.write_cache(self.key if key is None else key, self.value if value is None else value,
                        k, v, self.slots, self.num_tokens, self.num_kv_heads, self.head_dim,
                        self.block_size, self.n, self.n, self.k_scale, self.k_stride,
                        self.v_stride, self.v_data, self.bits)
        return k, v

    def k_row(self, token: int) -> slice:
        page, offset = divmod(int(self.slots[token]), self.block_size)
        start = page * self.k_stride + offset * self.n
        return slice(start, start + self.n)

    def v_group_data(self, token: int, group: int) -> slice:
        page, offset = divmod(int(self.slots[token]), self.block_size)
        start = page * self.v_stride + offset * self.n * self.bits // 8 + group * 2 * self.bits
        return slice(start, start + 2 * self.bits)

    def v_group_scale(self, token: int, group: int) -> int:
        page, offset = divmod(int(self.slots[token]), self.block_size)
        return page * self.v_stride + self.v_data + offset * self.n // 16 + group

    def run(self, device, key=None, value=None, k_scale=None):
        k_dev, v_dev = device.upload(self.k_pool), device.upload(self.v_pool)
        fp8kturbov.reshape_and_cache(
            device.upload((self.key if key is None else key).view(np.uint16)),
            device.upload((self.value if value is None else value).view(np.uint16)),
            k_dev, v_dev, device.upload(self.slots), num_tokens=self.num_tokens,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
            key_stride=self.n, value_stride=self.n,
            k_scale=self.k_scale if k_scale is None else k_scale, v_bits=self.bits,
            k_block_stride_bytes=self.k_stride, v_block_stride_bytes=self.v_stride,
            v_data_section_bytes=self.v_data, stream=device.stream)
        return device.download(k_dev, self.k_pool), device.download(v_dev, self.v_pool)


def changed(a: np.ndarray, b: np.ndarray) -> set[int]:
    return set(np.flatnonzero(a != b).tolist())


class DecodeCase:
    """A paged cache written by the reference: 2 KV heads, GQA group of 4 (one CTA chunk), ragged
    sequences, a shuffled page table, packed pages; query ~ N(0, 1)/4 (every |q| < 2)."""

    def __init__(self, rng, bits: int = 4, head_dim: int = 128, seq_lens=(0, 1, 17, 100, 250),
                 window: int = 0, group_size: int = 4):
        self.bits, self.head_dim, self.window = bits, head_dim, window
        self.num_kv_heads, self.block_size, self.group_size = 2, 16, group_size
        self.num_q_heads = self.num_kv_heads * group_size
        self.seq_lens = np.array(seq_lens, dtype=np.int32)
        self.num_seqs = len(self.seq_lens)
        blocks = -(-self.seq_lens // self.block_size) + 1  # one spare page after each sequence
        self.blocks = blocks
        self.max_blocks_per_seq = int(blocks.max())
        self.num_blocks = int(blocks.sum())
        self.n = n = self.num_kv_heads * head_dim
        self.k_stride = ref.k_page_bytes(self.block_size, self.num_kv_heads, head_dim)
        self.v_data = ref.v_data_section_bytes(self.block_size, self.num_kv_heads, head_dim, bits)
        self.v_stride = ref.v_page_bytes(self.block_size, self.num_kv_heads, head_dim, bits)
        self.k_scale, self.inv_sqrt_d = 0.05, float(1 / np.sqrt(head_dim))
        self.block_tables = shuffled_block_tables(rng, blocks, self.num_blocks, self.max_blocks_per_seq, unused=0)
        slots = self.num_blocks * self.block_size
        self.k_pool = np.zeros(self.num_blocks * self.k_stride, dtype=np.uint8)
        self.v_pool = np.zeros(self.num_blocks * self.v_stride, dtype=np.uint8)
        keys = bf16(rng.standard_normal((slots, n)))
        values = bf16(rng.standard_normal((slots, n)))
        ref.write_cache(keys, values, self.k_pool, self.v_pool, np.arange(slots), slots,
                        self.num_kv_heads, head_dim, self.block_size, n, n, self.k_scale,
                        self.k_stride, self.v_stride, self.v_data, bits)
        self.q_stride = self.num_q_heads * head_dim
        self.q = bf16(rng.standard_normal((self.num_seqs, self.q_stride)) / 4)

    def _page_offset(self, seq: int, pos: int) -> tuple[int, int]:
        return int(self.block_tables[seq, pos // self.block_size]), pos % self.block_size

    def k_byte(self, seq: int, pos: int, kv_head: int, d: int) -> int:
        page, offset = self._page_offset(seq, pos)
        return page * self.k_stride + offset * self.n + kv_head * self.head_dim + d

    def v_scale_byte(self, seq: int, pos: int, kv_head: int, group: int) -> int:
        page, offset = self._page_offset(seq, pos)
        return page * self.v_stride + self.v_data + offset * self.n // 16 + kv_head * self.head_dim // 16 + group

    def heads_of(self, kv_head: int) -> range:
        return range(kv_head * self.group_size, (kv_head + 1) * self.group_size)

    def reference(self, q=None, k_pool=None, v_pool=None, seq_lens=None, sparse_v_threshold=0.0):
        with np.errstate(invalid="ignore", over="ignore"):
            return ref.paged_decode(
                self.q if q is None else q, self.k_pool if k_pool is None else k_pool,
                self.v_pool if v_pool is None else v_pool, self.block_tables,
                self.seq_lens if seq_lens is None else seq_lens, self.max_blocks_per_seq,
                self.num_seqs, self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
                self.inv_sqrt_d, self.k_scale, self.q_stride, self.v_stride, self.v_data,
                self.window, self.bits, k_block_stride_bytes=self.k_stride,
                sparse_v_threshold=sparse_v_threshold)

    def run(self, device, q=None, k_pool=None, v_pool=None, *, split=True, sparse_v_threshold=0.0):
        scalars = dict(
            max_blocks_per_seq=self.max_blocks_per_seq, num_seqs=self.num_seqs,
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=self.block_size, inv_sqrt_d=self.inv_sqrt_d, k_scale=self.k_scale,
            q_stride=self.q_stride, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
            v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data,
            sliding_window=self.window, sparse_v_threshold=sparse_v_threshold)
        workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**scalars) if split else 0
        workspace = device.upload(np.full(max(workspace_bytes // 4, 1), np.nan, dtype=np.float32))
        poison = np.full((self.num_seqs, self.num_q_heads, self.head_dim), 0x7FC1, dtype=np.uint16)
        out = device.upload(poison)
        k_pool = self.k_pool if k_pool is None else k_pool
        v_pool = self.v_pool if v_pool is None else v_pool
        k_dev, v_dev = device.upload(k_pool), device.upload(v_pool)
        fp8kturbov.paged_decode_attn(
            device.upload((self.q if q is None else q).view(np.uint16)), k_dev, v_dev, out,
            device.upload(self.block_tables), device.upload(self.seq_lens), workspace=workspace,
            workspace_bytes=workspace_bytes, stream=device.stream, **scalars)
        got = device.download(out, poison).view(BF16).astype(np.float64)
        # The decode never writes the cache: the pools must come back unchanged.
        assert np.array_equal(device.download(k_dev, k_pool), k_pool), "decode changed the K pool"
        assert np.array_equal(device.download(v_dev, v_pool), v_pool), "decode changed the V pool"
        return got


def assert_rows_identical(got: np.ndarray, clean: np.ndarray, affected: set[tuple[int, int]]) -> None:
    """Every (sequence, head) row outside ``affected`` is bit-identical to the clean run's."""
    for s in range(got.shape[0]):
        for h in range(got.shape[1]):
            if (s, h) in affected:
                continue
            assert np.array_equal(got[s, h], clean[s, h]), f"row (seq {s}, head {h}) changed"


# ---- Write, against the reference (CPU) -----------------------------------------------------------


def test_k_bytes_of_nan_and_inf():
    """FORMAT §2: NaN of either sign -> 0x7F, +Inf -> 0x7E (+448), -Inf -> 0xFE (-448)."""
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, 1e30, -1e30], dtype=np.float32)
    assert ref.encode_k(x, 0.05).tolist() == [0x7F, 0x7F, 0x7E, 0xFE, 0x00, 0x7E, 0xFE]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nan_in_v_group_makes_that_group_nan_only(rng, bits):
    x = rng.standard_normal(64).astype(np.float32)
    x[16 + 5] = np.nan  # group 1, element 5
    data, scales = ref.encode_v(x, bits)
    zeroed = x.copy()
    zeroed[16 + 5] = 0.0  # the NaN element does not move amax (fmax ignores NaN)
    clean_data, clean_scales = ref.encode_v(zeroed, bits)
    codes, clean_codes = v_codes(data, bits), v_codes(clean_data, bits)
    assert scales[1] == 0x7F, "n2 = NaN -> NaN scale byte"
    assert codes[16 + 5] == 0, "NaN compares false with every bound -> code 0"
    others = np.arange(64) != 16 + 5
    assert np.array_equal(codes[others], clean_codes[others]), "the other codes are unaffected"
    assert np.array_equal(np.delete(scales, 1), np.delete(clean_scales, 1)), "other groups unaffected"
    decoded = ref.decode_v(data, scales, bits)
    assert np.isnan(decoded[16:32]).all(), "the whole group reads back NaN"
    assert np.isfinite(np.delete(decoded, np.s_[16:32])).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("inf", [np.inf, -np.inf])
def test_inf_in_v_group_reads_back_finite_and_wrong(rng, bits, inf):
    """Known gap (RELIABILITY.md §4.1): amax = inf -> inv = 0 -> every finite element gets the code
    of ±0, the infinite one (inf·0 = NaN) code 0; n2 = inf -> scale saturates to 448 (0x7E). The
    group reads back finite: ±Inf becomes 448·level[0] (negative, whatever the sign of the Inf)."""
    x = rng.standard_normal(32).astype(np.float32)
    x[3] = inf
    data, scales = ref.encode_v(x, bits)
    codes = v_codes(data, bits)
    assert scales[0] == 0x7E
    assert codes[3] == 0
    assert np.all(np.delete(codes[:16], 3) == MID_CODE[bits])
    decoded = ref.decode_v(data, scales, bits)
    levels = ref.CODEBOOKS[bits]
    assert decoded[3] == np.float32(448) * levels[0] < 0
    assert np.all(np.delete(decoded[:16], 3) == np.float32(448) * levels[MID_CODE[bits]])
    assert np.array_equal(scales[1:], ref.encode_v(x[16:], bits)[1]), "group 1 unaffected"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nan_and_inf_in_one_group_is_nan(bits):
    x = np.ones(16, dtype=np.float32)
    x[0], x[1] = np.inf, np.nan
    _, scales = ref.encode_v(x, bits)
    assert scales[0] == 0x7F


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_write_confines_nan_inf_to_their_row_and_group(rng, bits):
    case = WriteCase(rng, bits)
    key, value = case.key.copy(), case.value.copy()
    key[2, [0, 7, 100]] = bf16([np.nan, np.inf, -np.inf])
    value[4, 16 + 3] = BF16(np.nan)    # token 4, group 1
    value[1, 5 * 16 + 9] = BF16(np.inf)  # token 1, group 5
    clean_k, clean_v = case.reference()
    got_k, got_v = case.reference(key, value)
    row = case.k_row(2)
    assert changed(got_k, clean_k) <= {row.start + 0, row.start + 7, row.start + 100}
    assert got_k[row][[0, 7, 100]].tolist() == [0x7F, 0x7E, 0xFE]
    allowed = set(range(case.v_group_data(4, 1).start, case.v_group_data(4, 1).stop))
    allowed |= set(range(case.v_group_data(1, 5).start, case.v_group_data(1, 5).stop))
    allowed |= {case.v_group_scale(4, 1), case.v_group_scale(1, 5)}
    assert changed(got_v, clean_v) <= allowed
    assert got_v[case.v_group_scale(4, 1)] == 0x7F
    assert got_v[case.v_group_scale(1, 5)] == 0x7E


def test_tiny_k_scale_turns_zero_keys_into_nan():
    """Why the write refuses a k_scale below ~2^-128 (RELIABILITY.md §4.6, tested in test_abi.py):
    the fp32 reciprocal is inf, so FORMAT §2 would turn a zero key into 0·inf = NaN (0x7F)."""
    tiny = 1e-39  # positive, finite, subnormal: accepted by the host validation
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.float32(1.0) / np.float32(tiny) == np.inf
        assert ref.encode_k(np.array([0.0, 1e-3, -1e-3], np.float32), tiny).tolist() == [0x7F, 0x7E, 0xFE]
    assert ref.encode_k(np.array([0.0], np.float32), 2.0 ** -126).tolist() == [0x00]


# ---- Decode, against the reference (CPU) ----------------------------------------------------------


def test_reference_nan_k_byte_reaches_its_kv_group_of_its_sequence(rng):
    case = DecodeCase(rng)
    clean = case.reference()
    k_pool = case.k_pool.copy()
    k_pool[case.k_byte(3, 37, 1, 5)] = 0x7F  # sequence 3, position 37, KV head 1
    got = case.reference(k_pool=k_pool)
    affected = {(3, h) for h in case.heads_of(1)}
    for s, h in affected:
        assert np.isnan(got[s, h]).all()
    assert_rows_identical(got, clean, affected)


def test_reference_nan_v_scale_reaches_its_16_elements_of_its_kv_group(rng):
    case = DecodeCase(rng)
    clean = case.reference()
    v_pool = case.v_pool.copy()
    v_pool[case.v_scale_byte(4, 200, 0, 2)] = 0x7F  # sequence 4, position 200, KV head 0, group 2
    got = case.reference(v_pool=v_pool)
    affected = {(4, h) for h in case.heads_of(0)}
    for s, h in affected:
        assert np.isnan(got[s, h, 32:48]).all()
        assert np.array_equal(np.delete(got[s, h], np.s_[32:48]), np.delete(clean[s, h], np.s_[32:48]))
    assert_rows_identical(got, clean, affected)


def test_reference_nan_q_reaches_its_own_row(rng):
    case = DecodeCase(rng)
    clean = case.reference()
    q = case.q.copy()
    q[2, 5 * case.head_dim + 9] = BF16(np.nan)  # sequence 2, head 5
    got = case.reference(q=q)
    assert np.isnan(got[2, 5]).all()
    assert_rows_identical(got, clean, {(2, 5)})


def test_reference_ignores_nan_outside_the_attended_positions(rng):
    """A NaN K byte or V scale at a position beyond seq_len or before the sliding window is never
    read."""
    case = DecodeCase(rng, window=40)
    clean = case.reference()
    k_pool, v_pool = case.k_pool.copy(), case.v_pool.copy()
    for pos in (100, 101, 111):  # beyond seq_len 100, same or next page
        k_pool[case.k_byte(3, pos, 0, 0)] = 0x7F
        v_pool[case.v_scale_byte(3, pos, 1, 0)] = 0x7F
    for pos in (0, 59):  # before the window start 100 - 40 = 60
        k_pool[case.k_byte(3, pos, 1, 3)] = 0x7F
        v_pool[case.v_scale_byte(3, pos, 0, 1)] = 0x7F
    got = case.reference(k_pool=k_pool, v_pool=v_pool)
    assert np.array_equal(got, clean)


# ---- The kernels (GPU) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_gpu_write_nan_inf_bytes_and_confinement(device, rng, bits, head_dim):
    case = WriteCase(rng, bits, head_dim)
    key, value = case.key.copy(), case.value.copy()
    key[2, [0, 7, 33]] = bf16([np.nan, np.inf, -np.inf])
    key[3, 1] = BF16(-np.nan)
    value[4, 16 + 3] = BF16(np.nan)
    value[1, 2 * 16 + 9] = BF16(-np.inf)
    value[5, 0], value[5, 1] = BF16(np.inf), BF16(np.nan)
    got_k, got_v = case.run(device, key, value)
    want_k, want_v = case.reference(key, value)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v), "bytes differ from reference"
    clean_k, clean_v = case.run(device)
    rows = [case.k_row(2), case.k_row(3)]
    assert changed(got_k, clean_k) <= {rows[0].start, rows[0].start + 7, rows[0].start + 33, rows[1].start + 1}
    assert got_k[rows[0]][[0, 7, 33]].tolist() == [0x7F, 0x7E, 0xFE] and got_k[rows[1]][1] == 0x7F
    allowed = {case.v_group_scale(4, 1), case.v_group_scale(1, 2), case.v_group_scale(5, 0)}
    for t, g in ((4, 1), (1, 2), (5, 0)):
        allowed |= set(range(case.v_group_data(t, g).start, case.v_group_data(t, g).stop))
    assert changed(got_v, clean_v) <= allowed
    assert [got_v[case.v_group_scale(t, g)] for t, g in ((4, 1), (1, 2), (5, 0))] == [0x7F, 0x7E, 0x7F]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_gpu_nan_k_byte_makes_its_kv_group_of_its_sequence_nan(device, rng, head_dim, split):
    """RELIABILITY.md §4.3: a NaN score makes the denominator NaN, and every head of the KV group
    of that sequence comes out NaN, as in the reference. Nothing else changes."""
    case = DecodeCase(rng, head_dim=head_dim)
    clean = case.run(device, split=split)
    k_pool = case.k_pool.copy()
    k_pool[case.k_byte(3, 37, 1, 5)] = 0x7F
    k_pool[case.k_byte(4, 249, 0, head_dim - 1)] = 0xFF
    got = case.run(device, k_pool=k_pool, split=split)
    affected = {(3, h) for h in case.heads_of(1)} | {(4, h) for h in case.heads_of(0)}
    for s, h in affected:
        assert np.isnan(got[s, h]).all(), f"(seq {s}, head {h}): {got[s, h][:4]}"
    assert_rows_identical(got, clean, affected)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_gpu_nan_key_alone_in_a_tile_is_not_dropped(device, rng, split):
    """A tile whose only valid row has a NaN score, met while the warp stream's running max is
    still -inf: the NaN is no maximum, but its weight is NaN all the same. seq_len 17: position 16
    is alone in tile 1, the first tile of warp stream 1."""
    case = DecodeCase(rng, head_dim=128, seq_lens=(17, 100))
    clean = case.run(device, split=split)
    k_pool = case.k_pool.copy()
    k_pool[case.k_byte(0, 16, 0, 0)] = 0x7F
    got = case.run(device, k_pool=k_pool, split=split)
    affected = {(0, h) for h in case.heads_of(0)}
    for s, h in affected:
        assert np.isnan(got[s, h]).all(), f"head {h}: {got[s, h][:4]}"
    assert_rows_identical(got, clean, affected)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_gpu_nan_v_scale_reaches_its_16_elements_of_its_kv_group(device, rng, bits, head_dim, split):
    case = DecodeCase(rng, bits=bits, head_dim=head_dim)
    clean = case.run(device, split=split)
    v_pool = case.v_pool.copy()
    v_pool[case.v_scale_byte(4, 200, 0, 2)] = 0x7F  # sequence 4, KV head 0, elements 32..47
    got = case.run(device, v_pool=v_pool, split=split)
    affected = {(4, h) for h in case.heads_of(0)}
    for s, h in affected:
        assert np.isnan(got[s, h, 32:48]).all()
        assert np.array_equal(np.delete(got[s, h], np.s_[32:48]), np.delete(clean[s, h], np.s_[32:48]))
    assert_rows_identical(got, clean, affected)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_gpu_nan_q_makes_its_own_row_nan_only(device, rng, head_dim, split):
    """RELIABILITY.md §4.3: every score of the head is NaN and so is its row, as in the reference.
    The clean run has 0 in place of the NaN, so the chunk's query scale is the same."""
    case = DecodeCase(rng, head_dim=head_dim)
    q_zero, q_nan = case.q.copy(), case.q.copy()
    q_zero[2, 5 * head_dim + 9] = BF16(0.0)
    q_nan[2, 5 * head_dim + 9] = BF16(np.nan)
    clean = case.run(device, q=q_zero, split=split)
    got = case.run(device, q=q_nan, split=split)
    assert np.isnan(got[2, 5]).all()
    assert_rows_identical(got, clean, {(2, 5)})


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_gpu_inf_q_reaches_its_own_row_only(device, rng, split):
    """RELIABILITY.md §4.3: the chunk's fp16 query scale comes from the finite elements only, so
    an Inf changes its own head alone: scores of both signs of infinity (random keys), a NaN row as
    in the reference. Head 6 of the same CTA chunk holds a 4.0, which a scale widened by the Inf
    would push past fp16's range."""
    case = DecodeCase(rng, head_dim=128)
    clean_q = case.q.copy()
    clean_q[3, 6 * 128 + 1] = BF16(4.0)  # sequence 3, head 6 (KV head 1)
    q = clean_q.copy()
    q[3, 4 * 128 + 0] = BF16(np.inf)     # sequence 3, head 4: same chunk; 0 in the clean run
    clean_q[3, 4 * 128 + 0] = BF16(0.0)
    clean = case.run(device, q=clean_q, split=split)
    got = case.run(device, q=q, split=split)
    assert np.isnan(got[3, 4]).all()
    assert_rows_identical(got, clean, {(3, 4)})


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_gpu_nan_outside_the_attended_positions_is_never_read(device, rng, head_dim, split):
    """Masked rows load zero K bytes and a zero V scale: NaN bytes beyond seq_len (in the
    sequence's own pages) or before the sliding window change nothing."""
    case = DecodeCase(rng, head_dim=head_dim, window=40)
    clean = case.run(device, split=split)
    k_pool, v_pool = case.k_pool.copy(), case.v_pool.copy()
    for s, length in enumerate(case.seq_lens.tolist()):
        beyond = range(length, min(length + 20, int(case.blocks[s]) * case.block_size))  # own pages
        before = range(0, max(0, length - case.window))
        for pos in (*beyond, *before):
            for kv in range(case.num_kv_heads):
                for d in range(0, head_dim, 16):
                    k_pool[case.k_byte(s, pos, kv, d)] = 0x7F
                    v_pool[case.v_scale_byte(s, pos, kv, d // 16)] = 0x7F
    got = case.run(device, k_pool=k_pool, v_pool=v_pool, split=split)
    assert np.array_equal(got, clean)


# ---- Prefill (§4.4) -------------------------------------------------------------------------------


class PrefillCase(DecodeCase):
    """DecodeCase's cache with a chunk of query tokens per sequence: ``q_lens[s]`` rows, the last
    positions of ``seq_lens[s]``. The default contexts are long and the grid small, so that the plan
    splits them where it is given a workspace; chunks of at most 16 tokens (64 query rows) take the
    64-row kernel, longer ones the warp-specialised one where the device has it."""

    def __init__(self, rng, bits: int = 4, head_dim: int = 128, seq_lens=(1000, 600, 5, 1, 0),
                 q_lens=(16, 10, 5, 1, 0), window: int = 0):
        super().__init__(rng, bits=bits, head_dim=head_dim, seq_lens=seq_lens, window=window)
        self.q_lens = np.array(q_lens, dtype=np.int32)
        self.query_start = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
        self.num_rows = int(self.query_start[-1])
        self.q = bf16(rng.standard_normal((self.num_rows, self.q_stride)) / 4)

    def row(self, seq: int, token: int) -> int:
        return int(self.query_start[seq]) + token

    def attending(self, seq: int, pos: int) -> list[int]:
        """The query rows of sequence ``seq`` whose positions include ``pos``."""
        rows = []
        for i in range(int(self.q_lens[seq])):
            end = int(self.seq_lens[seq]) - int(self.q_lens[seq]) + i + 1
            begin = max(0, end - self.window) if self.window else 0
            if begin <= pos < end:
                rows.append(self.row(seq, i))
        return rows

    def reference(self, q=None, k_pool=None, v_pool=None):
        with np.errstate(invalid="ignore", over="ignore"):
            return ref.paged_prefill(
                self.q if q is None else q, self.k_pool if k_pool is None else k_pool,
                self.v_pool if v_pool is None else v_pool, self.block_tables, self.seq_lens, self.query_start,
                self.max_blocks_per_seq, self.num_seqs, self.num_q_heads, self.num_kv_heads, self.head_dim,
                self.block_size, self.inv_sqrt_d, self.k_scale, self.q_stride, self.v_stride, self.v_data,
                self.window, self.bits, k_block_stride_bytes=self.k_stride)

    def run(self, device, q=None, k_pool=None, v_pool=None, *, split=True):
        """(output, lse) of the kernels; with ``split``, given the workspace the plan asks for (the
        default contexts split; chunks of 8 or more query tiles also expand), else none."""
        scalars = dict(
            max_blocks_per_seq=self.max_blocks_per_seq, num_seqs=self.num_seqs, num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
            inv_sqrt_d=self.inv_sqrt_d, k_scale=self.k_scale, q_stride=self.q_stride, v_bits=self.bits,
            k_block_stride_bytes=self.k_stride, v_block_stride_bytes=self.v_stride,
            v_data_section_bytes=self.v_data, sliding_window=self.window, max_q_len=int(self.q_lens.max()),
            num_query_rows=self.num_rows)
        workspace_bytes = fp8kturbov.paged_prefill_workspace_bytes(**scalars) if split else 0
        assert workspace_bytes > 0 or not split, "the plan asks no workspace for this case"
        workspace = device.upload(np.full(max(workspace_bytes // 4, 1), np.nan, dtype=np.float32))
        out_poison = np.full((self.num_rows, self.num_q_heads, self.head_dim), 0x7FC1, dtype=np.uint16)
        lse_poison = np.full((self.num_rows, self.num_q_heads), 12345.0, dtype=np.float32)
        out, lse = device.upload(out_poison), device.upload(lse_poison)
        fp8kturbov.paged_prefill_attn(
            device.upload((self.q if q is None else q).view(np.uint16)),
            device.upload(self.k_pool if k_pool is None else k_pool),
            device.upload(self.v_pool if v_pool is None else v_pool), out, device.upload(self.block_tables),
            device.upload(self.seq_lens), device.upload(self.query_start), lse=lse, workspace=workspace,
            workspace_bytes=workspace_bytes, stream=device.stream, **scalars)
        return (device.download(out, out_poison).view(BF16).astype(np.float64),
                device.download(lse, lse_poison).astype(np.float64))


def assert_prefill_rows_identical(got, clean, affected: set[tuple[int, int]]) -> None:
    """Outputs and log-denominators of every (row, head) outside ``affected`` bit-identical."""
    assert_rows_identical(got[0], clean[0], affected)
    keep = np.ones(clean[1].shape, dtype=bool)
    for r, h in affected:
        keep[r, h] = False
    assert np.array_equal(got[1][keep], clean[1][keep]), "an lse outside the reach changed"


def assert_nan_rows(got, affected: set[tuple[int, int]]) -> None:
    for r, h in affected:
        assert np.isnan(got[0][r, h]).all(), f"(row {r}, head {h}): {got[0][r, h][:4]}"
        assert np.isnan(got[1][r, h]), f"(row {r}, head {h}): lse {got[1][r, h]}"


def test_reference_prefill_nan_k_byte_reaches_the_rows_attending_it(rng):
    case = PrefillCase(rng, seq_lens=(70, 40, 5), q_lens=(8, 20, 5))
    clean = case.reference()
    k_pool = case.k_pool.copy()
    k_pool[case.k_byte(1, 30, 1, 5)] = 0x7F  # sequence 1 (chunk from position 20), KV head 1
    got = case.reference(k_pool=k_pool)
    affected = {(r, h) for r in case.attending(1, 30) for h in case.heads_of(1)}
    assert len(case.attending(1, 30)) == 10  # tokens 10..19 of the chunk, not 0..9
    assert_nan_rows(got, affected)
    assert_prefill_rows_identical(got, clean, affected)


def test_reference_prefill_nan_v_scale_reaches_its_16_elements_of_the_rows_attending_it(rng):
    case = PrefillCase(rng, seq_lens=(70, 40, 5), q_lens=(8, 20, 5))
    clean = case.reference()
    v_pool = case.v_pool.copy()
    v_pool[case.v_scale_byte(1, 30, 0, 2)] = 0x7F  # KV head 0, elements 32..47
    got = case.reference(v_pool=v_pool)
    affected = {(r, h) for r in case.attending(1, 30) for h in case.heads_of(0)}
    for r, h in affected:
        assert np.isnan(got[0][r, h, 32:48]).all()
        assert np.array_equal(np.delete(got[0][r, h], np.s_[32:48]), np.delete(clean[0][r, h], np.s_[32:48]))
    assert_rows_identical(got[0], clean[0], affected)
    assert np.array_equal(got[1], clean[1]), "V does not enter the denominators"


def test_reference_prefill_nan_q_reaches_its_own_row(rng):
    case = PrefillCase(rng, seq_lens=(70, 40, 5), q_lens=(8, 20, 5))
    clean = case.reference()
    q = case.q.copy()
    q[case.row(1, 3), 5 * case.head_dim + 9] = BF16(np.nan)
    got = case.reference(q=q)
    assert_nan_rows(got, {(case.row(1, 3), 5)})
    assert_prefill_rows_identical(got, clean, {(case.row(1, 3), 5)})


# The two kernels; "expanded": chunks of at least 8 warp-specialised query tiles (300 x 4 query heads)
# read the context expanded into the workspace where they are given one.
PREFILL_CHUNKS = {"short": (16, 10, 5, 1, 0), "long": (16, 120, 5, 1, 0), "expanded": (16, 300, 5, 1, 0)}
split_ids = pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
chunk_ids = pytest.mark.parametrize("chunks", list(PREFILL_CHUNKS))


@pytest.mark.gpu
@split_ids
@chunk_ids
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_prefill_nan_k_byte_makes_the_rows_attending_it_nan(device, rng, head_dim, chunks, split):
    """§4.4: a NaN score makes the row's denominator NaN, in the part of the context that holds
    it: the row and its lse are NaN, split or not, as in the reference. Sequence 0's position
    500 lies before its chunk (every token attends it); sequence 1's lies inside its chunk."""
    case = PrefillCase(rng, head_dim=head_dim, q_lens=PREFILL_CHUNKS[chunks])
    inside = 600 - int(case.q_lens[1]) + 3  # attended by tokens 3.. of sequence 1's chunk
    clean = case.run(device, split=split)
    k_pool = case.k_pool.copy()
    k_pool[case.k_byte(0, 500, 1, 5)] = 0x7F
    k_pool[case.k_byte(1, inside, 0, head_dim - 1)] = 0xFF
    got = case.run(device, k_pool=k_pool, split=split)
    affected = ({(r, h) for r in case.attending(0, 500) for h in case.heads_of(1)}
                | {(r, h) for r in case.attending(1, inside) for h in case.heads_of(0)})
    assert_nan_rows(got, affected)
    assert_prefill_rows_identical(got, clean, affected)


@pytest.mark.gpu
@split_ids
@chunk_ids
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gpu_prefill_nan_v_scale_reaches_its_16_elements(device, rng, bits, chunks, split):
    """§4.4: the rows attending the position get NaN in exactly the group's 16 elements; rows of
    the same sequence and KV group that do not attend it may get NaN there too (their weight 0
    times NaN in the same tile's product), nothing else; the denominators do not change."""
    case = PrefillCase(rng, bits=bits, q_lens=PREFILL_CHUNKS[chunks])
    pos = 600 - int(case.q_lens[1]) + 3
    clean = case.run(device, split=split)
    v_pool = case.v_pool.copy()
    v_pool[case.v_scale_byte(1, pos, 0, 2)] = 0x7F  # elements 32..47
    got = case.run(device, v_pool=v_pool, split=split)
    reach = {(case.row(1, i), h) for i in range(int(case.q_lens[1])) for h in case.heads_of(0)}
    for r, h in reach:
        nan = np.isnan(got[0][r, h])
        if r in case.attending(1, pos):
            assert nan[32:48].all(), f"(row {r}, head {h})"
        assert not np.delete(nan, np.s_[32:48]).any(), f"(row {r}, head {h}): NaN outside the group"
        same = np.array_equal(got[0][r, h], clean[0][r, h])
        assert same or np.array_equal(np.delete(got[0][r, h], np.s_[32:48]), np.delete(clean[0][r, h], np.s_[32:48]))
    assert_rows_identical(got[0], clean[0], reach)
    assert np.array_equal(got[1], clean[1]), "V does not enter the denominators"


@pytest.mark.gpu
@split_ids
@chunk_ids
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_gpu_prefill_nan_or_inf_q_reaches_its_own_row_only(device, rng, bad, head_dim, chunks, split):
    """§4.4: the query tile's fp16 gain is taken over finite elements only, so a NaN or an Inf
    changes its own (row, head) alone: NaN scores, or scores of both signs of infinity (random
    keys), and a NaN row and lse, as in the reference. The clean run has 0 in its place; the same
    tile holds a 4.0 (head 6), which a gain widened by the Inf would push out of fp16's range."""
    case = PrefillCase(rng, head_dim=head_dim, q_lens=PREFILL_CHUNKS[chunks])
    row = case.row(1, 7)
    clean_q = case.q.copy()
    clean_q[row, 6 * head_dim + 1] = BF16(4.0)
    q = clean_q.copy()
    q[row, 5 * head_dim + 9] = BF16(bad)  # head 5: 0 in the clean run
    clean_q[row, 5 * head_dim + 9] = BF16(0.0)
    clean = case.run(device, q=clean_q, split=split)
    got = case.run(device, q=q, split=split)
    assert_nan_rows(got, {(row, 5)})
    assert_prefill_rows_identical(got, clean, {(row, 5)})


@pytest.mark.gpu
@split_ids
@chunk_ids
def test_gpu_prefill_nan_outside_the_attended_positions_is_never_read(device, rng, chunks, split):
    """NaN K bytes and V scales beyond seq_len (in the sequence's own pages) and before every chunk
    token's window change nothing."""
    case = PrefillCase(rng, q_lens=PREFILL_CHUNKS[chunks], window=300)
    clean = case.run(device, split=split)
    k_pool, v_pool = case.k_pool.copy(), case.v_pool.copy()
    for s, length in enumerate(case.seq_lens.tolist()):
        beyond = range(length, min(length + 20, int(case.blocks[s]) * case.block_size))
        before = range(0, max(0, length - int(case.q_lens[s]) + 1 - case.window))
        for pos in (*beyond, *before):
            for kv in range(case.num_kv_heads):
                for d in range(0, case.head_dim, 16):
                    k_pool[case.k_byte(s, pos, kv, d)] = 0x7F
                    v_pool[case.v_scale_byte(s, pos, kv, d // 16)] = 0x7F
    got = case.run(device, k_pool=k_pool, v_pool=v_pool, split=split)
    assert np.array_equal(got[0], clean[0]) and np.array_equal(got[1], clean[1])

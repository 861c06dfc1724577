"""GPU tests: a write changes only its slots' bytes, a decode only its output rows.

Every buffer a launch is given sits between guard regions of fresh random bytes in one allocation,
and starts filled with a canary (random bytes for pools, a bf16 NaN for outputs). After the launch:

- **write**: every byte of the K pages, the V data sections, the V scale sections, the padding
  between sections and pages, and the guards that no written slot addresses (FORMAT §2, §3) still
  holds its canary; the addressed bytes equal the reference's. Slots -1 and other negative ones are
  mixed in, and page 0's first and the last page's last slot are written. Each case runs with two
  canaries (random bytes, then their complement), so a stray byte cannot go unseen by equalling
  the canary. The inputs (rows, slot mapping) are unchanged.
- **decode**: the output rows of the ``num_seqs`` sequences are all written (no NaN canary left),
  rows of sequences with seq_len 0 are zeros (FORMAT §5), the others match the float64 reference;
  the guard rows before and after the output, the guards around the workspace, a further sequence
  in the tables past ``num_seqs``, and every input (q, pools, tables, lengths) are unchanged.

The row-level checks of tests/test_gpu_kernels.py compare whole pools with the reference; these
tests add the guards, the explicit byte map (independent of the reference), and the edge slots.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head, shuffled_block_tables
from fp8kturbov import reference as ref

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
POISON = 0x7FC1  # a bf16 NaN: an output element still holding it was not written
K_SCALE = 0.05
HEAD_DIMS = [64, 128, 256, 512]
#: Negative slots: padding, which must write nothing (FORMAT §4).
PADDING = [-1, -1, -1, -1, -1, -1, -16, np.iinfo(np.int64).min]
#: Elements after each key / value row of the write's inputs: a multiple of 8 takes the 16-byte load
#: path, an odd one the element-wise one.
KEY_PAD, VALUE_PAD = 8, 3


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


class Guarded:
    """A host image of ``guard | body | guard`` (the guards fresh random bytes, a multiple of 256
    long so the body keeps the allocation's alignment), uploaded as one device buffer; ``address``
    is the body's."""

    def __init__(self, device, rng, body: np.ndarray, guard_bytes: int = 4096) -> None:
        assert guard_bytes % 256 == 0
        self.device, self.guard_bytes = device, guard_bytes
        self.body = np.ascontiguousarray(body)
        self.image = np.concatenate([rng.integers(0, 256, guard_bytes, dtype=np.uint8),
                                     self.body.view(np.uint8).reshape(-1),
                                     rng.integers(0, 256, guard_bytes, dtype=np.uint8)])
        self.base = device.upload(self.image)
        self.address = self.base + guard_bytes

    def download(self) -> np.ndarray:
        """The body as it is on the device (shaped like ``body``); asserts that both guards are
        unchanged."""
        got = self.device.download(self.base, self.image)
        g = self.guard_bytes
        for name, part in (("before", slice(0, g)), ("after", slice(len(got) - g, len(got)))):
            differ = np.flatnonzero(got[part] != self.image[part])
            assert differ.size == 0, (f"the guard {name} the buffer: {differ.size} bytes changed, "
                                      f"first at {differ[:8].tolist()}")
        return got[g:len(got) - g].view(self.body.dtype).reshape(self.body.shape)


def bf16_rows(rng, num_rows: int, stride: int, row_elems: int) -> np.ndarray:
    """bf16 ``[num_rows, stride]``: N(0, 1) data, 1/8 of the rows x10, NaN padding beyond
    ``row_elems`` (a read of it would show)."""
    rows = np.full((num_rows, stride), np.nan, dtype=np.float32)
    data = rng.standard_normal((num_rows, row_elems)).astype(np.float32)
    data[rng.random(num_rows) < 1 / 8] *= 10
    rows[:, :row_elems] = data
    return rows.astype(BF16)


def assert_unchanged(got: np.ndarray, want: np.ndarray, what: str) -> None:
    differ = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
    assert differ.size == 0, f"{what} changed: {differ.size} bytes, first at {differ[:8].tolist()}"


# ---- Cache write ---------------------------------------------------------------------------------


class WriteLayout:
    """Pages of 16 slots, 2 KV heads, ``num_blocks`` pages; ``padded``: 32 bytes after each K
    page, 8 between the V data and scale sections, 24 after each V page."""

    num_kv_heads, block_size, num_blocks = 2, 16, 6

    def __init__(self, bits: int, head_dim: int, padded: bool) -> None:
        self.bits, self.head_dim = bits, head_dim
        self.n = self.num_kv_heads * head_dim
        args = (self.block_size, self.num_kv_heads, head_dim)
        pad = (32, 8, 24) if padded else (0, 0, 0)
        self.k_stride = ref.k_page_bytes(*args) + pad[0]
        self.v_data = ref.v_data_section_bytes(*args, bits) + pad[1]
        self.v_stride = self.v_data + ref.v_scale_section_bytes(*args) + pad[2]
        self.num_slots = self.num_blocks * self.block_size

    def scalars(self) -> dict:
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
                    k_scale=K_SCALE, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
                    v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data)

    def slot_bytes(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Masks of the K and V pool bytes that ``slots`` address (FORMAT §2, §3): the K row, the
        V row's codes in the data section and its scale bytes in the scale section."""
        k_mask = np.zeros(self.num_blocks * self.k_stride, dtype=bool)
        v_mask = np.zeros(self.num_blocks * self.v_stride, dtype=bool)
        data_bytes, scale_bytes = self.n * self.bits // 8, self.n // 16
        for slot in slots[slots >= 0]:
            page, offset = divmod(int(slot), self.block_size)
            k = page * self.k_stride + offset * self.n
            k_mask[k:k + self.n] = True
            data = page * self.v_stride + offset * data_bytes
            v_mask[data:data + data_bytes] = True
            scale = page * self.v_stride + self.v_data + offset * scale_bytes
            v_mask[scale:scale + scale_bytes] = True
        return k_mask, v_mask


def run_write(device, rng, layout: WriteLayout, slots: np.ndarray, k_canary: np.ndarray,
              v_canary: np.ndarray, num_tokens: int | None = None):
    """Write random rows (padded row strides) to ``slots`` into guarded pools holding the
    canaries; returns ``(key, value, got_k, got_v)``, having checked the guards and the inputs."""
    n = layout.n
    num_tokens = len(slots) if num_tokens is None else num_tokens
    key_stride, value_stride = n + KEY_PAD, n + VALUE_PAD
    key = bf16_rows(rng, len(slots), key_stride, n)
    value = bf16_rows(rng, len(slots), value_stride, n)
    k_pool, v_pool = Guarded(device, rng, k_canary), Guarded(device, rng, v_canary)
    inputs = [Guarded(device, rng, a) for a in (key.view(np.uint16), value.view(np.uint16), slots)]
    fp8kturbov.reshape_and_cache(*(g.address for g in inputs[:2]), k_pool.address, v_pool.address,
                                 inputs[2].address, num_tokens=num_tokens, key_stride=key_stride,
                                 value_stride=value_stride, stream=device.stream, **layout.scalars())
    got_k, got_v = k_pool.download(), v_pool.download()
    for name, buffer in zip(("key", "value", "slot_mapping"), inputs):
        assert_unchanged(buffer.download(), buffer.body, f"input {name}")
    return key, value, got_k, got_v


def region_of(layout: WriteLayout, pool: str, index: int) -> str:
    """Where byte ``index`` of a pool lies, for messages."""
    if pool == "K":
        page, at = divmod(index, layout.k_stride)
        return f"K page {page} byte {at}" + (" (page padding)" if at >= layout.block_size * layout.n else "")
    page, at = divmod(index, layout.v_stride)
    section = "data" if at < layout.v_data else "scale"
    return f"V page {page} byte {at} ({section} section)"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_write_changes_only_its_slots_bytes(device, rng, bits, head_dim, padded):
    """Half the slots, page 0's first and the last page's last among them, and padding slots."""
    layout = WriteLayout(bits, head_dim, padded)
    last = layout.num_slots - 1
    chosen = rng.choice(np.arange(1, last), size=layout.num_slots // 2 - 2, replace=False)
    slots = rng.permutation(np.concatenate([[0, last], chosen, PADDING]).astype(np.int64))
    k_mask, v_mask = layout.slot_bytes(slots)

    k_random = rng.integers(0, 256, len(k_mask), dtype=np.uint8)
    v_random = rng.integers(0, 256, len(v_mask), dtype=np.uint8)
    for k_canary, v_canary in ((k_random, v_random), (~k_random, ~v_random)):
        key, value, got_k, got_v = run_write(device, rng, layout, slots, k_canary, v_canary)
        for pool, got, canary, mask in (("K", got_k, k_canary, k_mask), ("V", got_v, v_canary, v_mask)):
            stray = np.flatnonzero((got != canary) & ~mask)
            assert stray.size == 0, (f"{pool} pool: {stray.size} bytes outside the written slots changed, "
                                     f"first: {[region_of(layout, pool, int(i)) for i in stray[:4]]}")
        want_k, want_v = k_canary.copy(), v_canary.copy()
        ref.write_cache(key, value, want_k, want_v, slots, len(slots), layout.num_kv_heads, head_dim,
                        layout.block_size, layout.n + KEY_PAD, layout.n + VALUE_PAD, K_SCALE, layout.k_stride,
                        layout.v_stride, layout.v_data, bits)
        for pool, got, want in (("K", got_k, want_k), ("V", got_v, want_v)):
            differ = np.flatnonzero(got != want)
            assert differ.size == 0, (f"{pool} pool: {differ.size} bytes differ from the reference, "
                                      f"first: {[region_of(layout, pool, int(i)) for i in differ[:4]]}")
        assert np.any(got_k[k_mask] != k_canary[k_mask]), "the write changed nothing: the test proves nothing"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("case", ["padding_only", "zero_tokens"])
def test_write_of_nothing_changes_nothing(device, rng, bits, case):
    """Only negative slots, or ``num_tokens = 0`` with real buffers: no byte changes."""
    layout = WriteLayout(bits, 128, padded=True)
    if case == "padding_only":
        slots, num_tokens = np.array(PADDING, dtype=np.int64), None
    else:
        slots, num_tokens = rng.choice(layout.num_slots, size=8, replace=False).astype(np.int64), 0
    k_canary = rng.integers(0, 256, layout.num_blocks * layout.k_stride, dtype=np.uint8)
    v_canary = rng.integers(0, 256, layout.num_blocks * layout.v_stride, dtype=np.uint8)
    _, _, got_k, got_v = run_write(device, rng, layout, slots, k_canary, v_canary, num_tokens)
    assert_unchanged(got_k, k_canary, "K pool")
    assert_unchanged(got_v, v_canary, "V pool")


# ---- Paged decode --------------------------------------------------------------------------------


class DecodeSetup:
    """Sequences of ``seq_lens`` over shuffled pages of a cache the reference wrote whole (random
    bytes before), 2 KV heads, 4 query heads per KV head, padded query rows (NaN padding). The
    tables and lengths hold one sequence more than ``num_seqs`` (64 positions): a decode that
    went past ``num_seqs`` would write its rows into the guard after the output."""

    num_kv_heads, group_size, block_size = 2, 4, 16
    table_blocks = 0  # entries per block table at least (beyond the sequences' own pages: -7)

    def __init__(self, rng, bits: int, head_dim: int, seq_lens: list[int]) -> None:
        self.bits, self.head_dim = bits, head_dim
        self.num_q_heads = self.num_kv_heads * self.group_size
        self.num_seqs = len(seq_lens)
        n = self.num_kv_heads * head_dim
        all_lens = np.array(list(seq_lens) + [64], dtype=np.int32)
        blocks = -(-all_lens // self.block_size)
        self.max_blocks_per_seq = max(int(blocks.max()) + 1, self.table_blocks)
        self.num_blocks = int(blocks.sum()) + 2
        self.block_tables = shuffled_block_tables(rng, blocks, self.num_blocks, self.max_blocks_per_seq)
        self.seq_lens = all_lens

        args = (self.block_size, self.num_kv_heads, head_dim)
        self.k_stride = ref.k_page_bytes(*args) + 16
        self.v_data = ref.v_data_section_bytes(*args, bits)
        self.v_stride = ref.v_page_bytes(*args, bits) + 8
        num_slots = self.num_blocks * self.block_size
        self.k_pool = rng.integers(0, 256, self.num_blocks * self.k_stride, dtype=np.uint8)
        self.v_pool = rng.integers(0, 256, self.num_blocks * self.v_stride, dtype=np.uint8)
        ref.write_cache(bf16_rows(rng, num_slots, n, n), bf16_rows(rng, num_slots, n, n), self.k_pool,
                        self.v_pool, np.arange(num_slots), num_slots, self.num_kv_heads, head_dim,
                        self.block_size, n, n, K_SCALE, self.k_stride, self.v_stride, self.v_data, bits)
        self.q_stride = self.num_q_heads * head_dim + 8
        self.q = bf16_rows(rng, len(all_lens), self.q_stride, self.num_q_heads * head_dim)

    def scalars(self) -> dict:
        return dict(max_blocks_per_seq=self.max_blocks_per_seq, num_seqs=self.num_seqs,
                    num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    block_size=self.block_size, inv_sqrt_d=float(self.head_dim**-0.5), k_scale=K_SCALE,
                    q_stride=self.q_stride, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
                    v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data,
                    sliding_window=0, sparse_v_threshold=0.0)

    def reference(self) -> np.ndarray:
        s = self.scalars()
        return ref.paged_decode(self.q, self.k_pool, self.v_pool, self.block_tables[:self.num_seqs],
                                self.seq_lens[:self.num_seqs], self.max_blocks_per_seq, self.num_seqs,
                                self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
                                s["inv_sqrt_d"], K_SCALE, self.q_stride, self.v_stride, self.v_data, 0,
                                self.bits, k_block_stride_bytes=self.k_stride)

    def run(self, device, rng, split: bool) -> np.ndarray:
        """Decode into an output between guards of two sequences' rows each; returns the output
        as float64, having checked the guards (output and workspace) and every input."""
        row_bytes = self.num_q_heads * self.head_dim * 2
        out = Guarded(device, rng, np.full((self.num_seqs, self.num_q_heads, self.head_dim), POISON,
                                           dtype=np.uint16), guard_bytes=2 * row_bytes)
        workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**self.scalars()) if split else 0
        workspace = Guarded(device, rng, np.full(workspace_bytes // 4, np.nan, dtype=np.float32))
        inputs = {name: Guarded(device, rng, array) for name, array in (
            ("q", self.q.view(np.uint16)), ("k_cache", self.k_pool), ("v_cache", self.v_pool),
            ("block_tables", self.block_tables), ("seq_lens", self.seq_lens))}
        fp8kturbov.paged_decode_attn(
            inputs["q"].address, inputs["k_cache"].address, inputs["v_cache"].address, out.address,
            inputs["block_tables"].address, inputs["seq_lens"].address, workspace=workspace.address,
            workspace_bytes=workspace_bytes, stream=device.stream, **self.scalars())
        got = out.download()
        workspace.download()  # checks its guards; the workspace itself is scratch
        for name, buffer in inputs.items():
            assert_unchanged(buffer.download(), buffer.body, f"input {name}")
        return got.view(BF16).astype(np.float64)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("seq_lens", [[0, 37, 0, 160, 1, 0], [0, 0, 0]], ids=["ragged", "all_empty"])
def test_decode_writes_only_its_output_rows(device, rng, bits, head_dim, split, seq_lens):
    setup = DecodeSetup(rng, bits, head_dim, seq_lens)
    got = setup.run(device, rng, split)
    assert not np.isnan(got).any(), "an output element was left unwritten (NaN canary)"
    empty = np.array(seq_lens) == 0
    assert np.all(got[empty] == 0), "a sequence with seq_len 0 must give zeros (FORMAT §5)"
    want = setup.reference()
    err = relative_error_per_head(got, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"


def test_decode_of_no_sequences_writes_nothing(device, rng):
    """``num_seqs = 0`` with real buffers: a successful no-op; the output keeps its canary."""
    setup = DecodeSetup(rng, 3, 128, [])
    got = setup.run(device, rng, split=False)
    assert got.size == 0

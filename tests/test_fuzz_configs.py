"""The configuration model of the differential GPU fuzz (tests/fuzz_configs.py), without a GPU.

A seed replays its configuration, inputs and reference results exactly; every configuration keeps
the rules the fuzz relies on (alignments, slots and page ids inside the pools without checked
mode, no NaN data before a decode, the sparse-V bound's assumptions); the NumPy reference, which
follows the library's argument rules, accepts every step; the library's host checks accept every
launch (on a machine without a GPU they pass and the launch itself fails); and over a few
thousand seeds every option the fuzz is meant to try turns up.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ml_dtypes")

import fp8kturbov  # noqa: E402
from conftest import gpu_unavailable_reason, relative_error_per_head  # noqa: E402
from fp8kturbov import reference as ref  # noqa: E402
from fp8kturbov._limits import MAX_Q_LEN, ROTATION_HEAD_DIMS  # noqa: E402
from fuzz_configs import (ALIGNMENT, DECODE_HEAD_DIMS, DecodeRun, DecodeStep, DequantizeRun, DequantizeStep,  # noqa: E402
                          FuzzCase, FuzzConfig, WriteRun, WriteStep, draw_config, written_pools)

SEEDS = range(60)  # about 3 s of reference work, twice


def case_arrays(case: FuzzCase) -> list[np.ndarray]:
    """Every array a case holds: its inputs and the reference's results."""
    arrays = [case.k_pool, case.v_pool, case.final_k_pool, case.final_v_pool]
    for run in case.runs:
        arrays += [a for a in vars(run).values() if isinstance(a, np.ndarray)]
    return arrays


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_a_seed_replays_its_configuration_and_inputs(seed):
    first, again = FuzzCase(draw_config(seed)), FuzzCase(draw_config(seed))
    assert first.config == again.config
    arrays, replayed = case_arrays(first), case_arrays(again)
    assert len(arrays) == len(replayed)
    for a, b in zip(arrays, replayed):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    other = draw_config(seed + 1)
    assert other != first.config, "neighbouring seeds gave the same configuration"


@pytest.mark.parametrize("seed", range(12))
def test_the_pools_of_a_case_are_the_reference_write_of_every_slot(seed):
    """`written_pools` (all rows at once) writes the bytes `reference.write_cache` writes, and
    leaves the padding between sections and pages as it was."""
    layout = draw_config(seed).layout
    rng = np.random.default_rng(seed)
    background = [rng.integers(0, 256, layout.num_blocks * s, dtype=np.uint8) for s in (layout.k_stride, layout.v_stride)]
    key, value = (rng.standard_normal((layout.num_slots, layout.n)).astype(np.float32) for _ in range(2))
    got = [pool.copy() for pool in background]
    written_pools(layout, *got, key, value)
    want = [pool.copy() for pool in background]
    ref.write_cache(key, value, *want, np.arange(layout.num_slots), layout.num_slots, layout.num_kv_heads,
                    layout.head_dim, layout.block_size, layout.n, layout.n, layout.k_scale, layout.k_stride,
                    layout.v_stride, layout.v_data, layout.bits)
    for name, g, w in zip(("K pool", "V pool"), got, want):
        assert np.array_equal(g, w), f"{name}: {np.count_nonzero(g != w)} bytes differ"


def check_step_rules(config, step) -> None:
    layout = config.layout
    for name, offset in step.offsets.items():
        assert offset % ALIGNMENT[name] == 0, (name, offset)
    assert 0 <= step.stream < config.num_streams
    if not layout.checked:
        assert getattr(step, "num_outside", 0) == 0
    if isinstance(step, (WriteStep, DequantizeStep)):
        assert min(step.key_stride, step.value_stride) >= layout.n
    if isinstance(step, WriteStep):
        assert step.entry == "generic" or (not layout.checked and not layout.rotation and step.encoder == "matched_norm")
    if isinstance(step, DecodeStep):
        assert layout.head_dim in DECODE_HEAD_DIMS
        assert step.q_stride >= layout.num_kv_heads * step.group_size * layout.head_dim
        assert step.max_blocks_per_seq >= -(-max(step.seq_lens) // layout.block_size)
        if step.q_lens is not None:
            assert 1 <= step.max_q_len <= MAX_Q_LEN
            assert all(q <= min(step.max_q_len, length) for q, length in zip(step.q_lens, step.seq_lens))
        if step.bad_pages or step.bad_seq_len:
            assert layout.checked and step.window == 0 and step.q_lens is None
        if step.sparse_v_threshold != 0:
            assert not step.sinks and step.soft_cap == 0, "the sparse-V bound is that of plain softmax rows"
        if step.entry == "fixed":
            assert layout.k_packed and not layout.rotation and not layout.checked and step.workspace == "none"


def check_run_rules(case: FuzzCase, run) -> None:
    layout = case.config.layout
    if isinstance(run, WriteRun):
        inside = run.slots[(run.slots >= 0) & (run.slots < layout.num_slots)]
        assert len(np.unique(inside)) == len(inside), "a slot written twice in one launch races"
        assert layout.checked or np.all(run.slots < layout.num_slots)
    if isinstance(run, DequantizeRun):
        assert layout.checked or np.all(run.slots < layout.num_slots)
    if isinstance(run, DecodeRun):
        assert np.all(np.isfinite(run.expected)), "a decode of NaN-free data is finite"
        if not layout.checked:
            capacity = run.step.max_blocks_per_seq * layout.block_size
            assert np.all((run.seq_lens >= 0) & (run.seq_lens <= capacity))
            tables = run.block_tables
            for s, length in enumerate(run.seq_lens):
                pages = tables[s, :-(-int(length) // layout.block_size)]
                assert np.all((pages >= 0) & (pages < layout.num_blocks)), "an attended page outside the pools"
        assert run.bound.shape == run.expected.shape[:-1] and np.all(run.bound >= 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_configurations_keep_the_rules_and_the_reference_accepts_them(seed):
    """Building the case runs the reference on every step: it raises for anything the library
    refuses (python/fp8kturbov/_reference_args.py)."""
    config = draw_config(seed)
    layout = config.layout
    assert config.steps and 1 <= config.num_streams <= 4
    assert layout.k_stride % 16 == 0 and layout.v_stride % 4 == 0 and layout.v_data % 4 == 0
    assert layout.k_offset % 16 == 0 and layout.v_offset % 4 == 0
    assert not layout.rotation or layout.head_dim in ROTATION_HEAD_DIMS
    hostile = any(isinstance(s, WriteStep) and s.hostile for s in config.steps)
    assert not (hostile and any(isinstance(s, DecodeStep) for s in config.steps)), "NaN data and a decode"
    for step in config.steps:
        check_step_rules(config, step)
    case = FuzzCase(config)
    for run in case.runs:
        check_run_rules(case, run)


def no_token_config() -> FuzzConfig:
    """A write and a dequantize of no tokens (the fuzz draws them now and then) on seed 0's layout."""
    layout = draw_config(0).layout
    offsets = {"key": 2, "value": 0, "slot_mapping": 8}
    return FuzzConfig(0, "small", layout, 1, (
        WriteStep("generic", "matched_norm", 0, 0, 0, layout.n + 1, layout.n, False, 0, offsets),
        DequantizeStep(0, 0, 0, layout.n, layout.n + 8, 0, offsets)))


def test_steps_of_no_tokens_change_nothing():
    case = FuzzCase(no_token_config())
    assert [run.num_tokens for run in case.runs] == [0, 0]
    assert np.array_equal(case.final_k_pool, case.k_pool) and np.array_equal(case.final_v_pool, case.v_pool)
    assert all(run.buffers()["key"].size == 0 for run in case.runs)


FAKE_BASE = 1 << 40  # device addresses that no allocation holds: nothing may launch on them


def fake_addresses(run, layout) -> dict[str, int]:
    """An address for every buffer of ``run`` and for the pools, each in a 4 GiB region of its own
    at the step's offset."""
    names = ["k_cache", "v_cache", *run.buffers()]
    offsets = dict(run.step.offsets, k_cache=layout.k_offset, v_cache=layout.v_offset)
    return {name: FAKE_BASE + (i << 32) + offsets[name] for i, name in enumerate(names)}


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="launches on fake addresses need a machine without a GPU")
@pytest.mark.parametrize("seed", [*SEEDS, "no tokens"])
def test_the_library_accepts_every_launch(seed):
    """Every launch's arguments pass the library's checks: without a GPU the call then fails
    launching (CUDA_ERROR), never on an argument; a write or dequantize of no tokens launches
    nothing and succeeds."""
    case = FuzzCase(no_token_config() if seed == "no tokens" else draw_config(seed))
    layout = case.config.layout
    checked = case.checked_args(error_flags=FAKE_BASE - 4096)
    for run in case.runs:
        extra = {}
        if isinstance(run, DecodeRun):
            extra["workspace"] = (FAKE_BASE - (1 << 32), run.workspace_bytes(1 << 20))
        if getattr(run, "num_tokens", None) == 0:
            run.launch(fake_addresses(run, layout), stream=0, checked=checked)
            continue
        with pytest.raises(fp8kturbov.CudaError):
            run.launch(fake_addresses(run, layout), stream=0, checked=checked, **extra)


def test_the_model_tries_every_option():
    """Over 3000 seeds (configurations only) every value of every option turns up, and a quarter
    of the configurations are small enough for compute-sanitizer."""
    seen: dict[str, set] = {}

    def saw(name: str, value) -> None:
        seen.setdefault(name, set()).add(value)

    configs = [draw_config(seed) for seed in range(3000)]
    for config in configs:
        layout = config.layout
        for name in ("bits", "head_dim", "num_kv_heads", "block_size", "rotation", "checked"):
            saw(name, getattr(layout, name))
        saw("padded K pages", not layout.k_packed)
        saw("size", config.size)
        saw("streams", config.num_streams)
        for step in config.steps:
            saw("step", type(step).__name__)
            if isinstance(step, WriteStep):
                saw("write entry", step.entry)
                saw("encoder", step.encoder)
                saw("write outside slots", step.num_outside > 0)
                saw("hostile rows", step.hostile)
            if isinstance(step, DequantizeStep):
                saw("dequantize outside slots", step.num_outside > 0)
            if isinstance(step, DecodeStep):
                B = layout.block_size
                saw("decode entry", step.entry)
                saw("group size", step.group_size)
                for length in step.seq_lens:
                    saw("seq_len", "0" if length == 0 else "1" if length == 1 else
                        "page edge" if length % B in (0, 1, B - 1) else "long" if length >= 500 else "other")
                saw("multi-token", step.q_lens is not None)
                saw("window", step.window > 0)
                saw("sinks", step.sinks)
                saw("soft cap", step.soft_cap > 0)
                saw("sparse_v_threshold", step.sparse_v_threshold)
                saw("workspace", step.workspace)
                saw("wider table rows", step.table_width is not None)
                saw("bad pages", step.bad_pages > 0)
                saw("bad seq_len", step.bad_seq_len)
                saw("odd q_stride", step.q_stride % 2 == 1)
    expected = {
        "bits": {2, 3, 4}, "head_dim": set(DECODE_HEAD_DIMS), "rotation": {True, False},
        "checked": {True, False}, "padded K pages": {True, False}, "size": {"small", "medium", "long"},
        "streams": {1, 2, 3, 4}, "step": {"WriteStep", "DecodeStep", "DequantizeStep"},
        "write entry": {"generic", "fixed"}, "encoder": {"matched_norm", "mse", "projection"},
        "write outside slots": {True, False}, "hostile rows": {True, False},
        "dequantize outside slots": {True, False}, "decode entry": {"generic", "fixed"},
        "group size": {1, 2, 3, 4, 5, 8, 12, 16}, "seq_len": {"0", "1", "page edge", "long", "other"},
        "multi-token": {True, False}, "window": {True, False}, "sinks": {True, False},
        "soft cap": {True, False}, "sparse_v_threshold": {0.0, None, 1e-3, 1e-2},
        "workspace": {"none", "full", "partial", "larger"}, "wider table rows": {True, False},
        "bad pages": {True, False}, "bad seq_len": {None, "negative", "beyond"}, "odd q_stride": {True, False},
    }
    for name, values in expected.items():
        assert values <= seen[name], f"{name}: never {values - seen[name]}"
    assert {1, 8, 16, 24, 64} <= seen["block_size"] and {1, 8} <= seen["num_kv_heads"]
    small = sum(config.size == "small" for config in configs)
    assert 0.2 < small / len(configs) < 0.3


def test_the_decode_bound_holds_weights_too_small_for_fp16():
    """Configuration 3309511811361126977 (found by the GPU fuzz): on two heads the largest score falls on
    a V group of zeros and every other weight lies e^-39 or more below it, so the exact output is
    about 1e-17 against V rows of norm 8, and the kernels, whose fp16 weights flush the rest, write 0.
    The bound allows that there, and a zero output nowhere else."""
    run = FuzzCase(draw_config(3309511811361126977)).runs[0]
    assert isinstance(run, DecodeRun)
    tiny = np.linalg.norm(run.expected, axis=-1) < 1e-10
    assert tiny.sum() == 2
    flushed = np.where(tiny[..., None], 0.0, run.expected)
    assert relative_error_per_head(flushed, run.expected, run.bound).max() <= 1e-2
    assert np.all(relative_error_per_head(np.zeros_like(run.expected), run.expected, run.bound)[~tiny] > 0.5)

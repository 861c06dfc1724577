"""The prefill's split planner (cuda/src/plan/prefill_plan.cc), host-side: built from its source with a
plain C++ compiler (tests/plan/prefill_plan_cli.cc), fed random prefills, and its plans checked against
the rules the kernels and the workspace query rely on. Needs a C++ compiler (skipped otherwise); no
GPU, no library."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, build_filter, run_filter
SOURCES = [REPO / "tests/plan/prefill_plan_cli.cc", REPO / "cuda/src/plan/prefill_plan.cc"]
FIELDS = ("head_dim num_seqs num_q_heads num_kv_heads max_blocks_per_seq block_size max_q_len num_query_rows "
          "multiprocessors ctas_per_sm workspace_bytes query_rows").split()
# The planner's constants (cuda/src/plan/prefill_plan.h), as the rules below state them.
QUERY_ROWS = (64, 128)  # rows per CTA: the 64-row kernel, the warp-specialised one
MIN_SPLIT_TILES = 4
MAX_SPLITS = 256
MAX_WAVES = 2
MIN_EXPAND_QUERY_TILES = 8  # warp-specialised query tiles per KV head from which the context is expanded
UINT64_MAX = 2**64 - 1


def kv_tile(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def expanded_tile_bytes(head_dim: int) -> int:
    """A dequantized tile: fp16 K and V of kv_tile positions, then a flag per position, in 128 bytes."""
    return 4 * kv_tile(head_dim) * head_dim + 128


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_filter(tmp_path_factory, "prefill_plan_cli", SOURCES)


def plan_all(planner: Path, prefills: list[dict]) -> list[dict]:
    return run_filter(planner, prefills, FIELDS,
                      "num_splits split_positions needed_bytes tiles_per_seq expanded_tiles".split())


@st.composite
def prefills(draw) -> dict:
    kv = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_seqs = draw(st.one_of(st.integers(1, 4), st.integers(1, 256)))
    block_size = draw(st.sampled_from([1, 8, 16, 32, 64]))
    max_blocks = draw(st.integers(1, 8192))
    max_q_len = draw(st.integers(1, min(max_blocks * block_size, 20000)))
    return dict(head_dim=draw(st.sampled_from([64, 128, 256])), num_seqs=num_seqs,
                num_q_heads=kv * draw(st.sampled_from([1, 2, 4, 8, 16])), num_kv_heads=kv,
                max_blocks_per_seq=max_blocks, block_size=block_size, max_q_len=max_q_len,
                num_query_rows=num_seqs * max_q_len, multiprocessors=draw(st.sampled_from([1, 8, 108, 132])),
                ctas_per_sm=draw(st.integers(1, 4)),
                workspace_bytes=draw(st.sampled_from([0, 4096, 1 << 20, 1 << 30, UINT64_MAX])),
                query_rows=draw(st.sampled_from(QUERY_ROWS)))


def check_plan(p: dict, plan: dict) -> None:
    tile = kv_tile(p["head_dim"])
    positions = p["max_blocks_per_seq"] * p["block_size"]
    splits, split_positions = plan["num_splits"], plan["split_positions"]
    group = p["num_q_heads"] // p["num_kv_heads"]
    assert plan["tiles_per_seq"] == math.ceil(p["max_q_len"] * group / p["query_rows"])
    assert plan["needed_bytes"] <= p["workspace_bytes"], "the plan needs more workspace than it has"
    # Whole tiles per split, every position of a table row in one split, no split empty.
    assert split_positions % tile == 0
    assert (splits - 1) * split_positions < positions <= splits * split_positions
    # The expanded context: every tile of a table row, only for the warp-specialised kernel's chunks
    # of several query tiles, after the partials (128-byte aligned).
    partials = 0 if splits == 1 else 4 * splits * p["num_query_rows"] * p["num_q_heads"] * (p["head_dim"] + 1)
    eligible = (p["query_rows"] == 128 and plan["tiles_per_seq"] >= MIN_EXPAND_QUERY_TILES
                and p["num_seqs"] <= 65535)
    expanded = plan["expanded_tiles"]
    assert expanded in (0, math.ceil(positions / tile)) and (eligible or expanded == 0)
    expanded_bytes = p["num_seqs"] * p["num_kv_heads"] * expanded * expanded_tile_bytes(p["head_dim"])
    assert plan["needed_bytes"] == (-(-partials // 128) * 128 + expanded_bytes if expanded else partials)
    if eligible and p["workspace_bytes"] == UINT64_MAX:
        assert expanded > 0, "a chunk of several query tiles reads the expanded context where it fits"
    if splits == 1:
        return
    base_ctas = p["num_seqs"] * plan["tiles_per_seq"] * p["num_kv_heads"]
    slots = p["multiprocessors"] * p["ctas_per_sm"]
    assert base_ctas < slots, "a grid that fills the device is not split"
    assert splits <= MAX_SPLITS and split_positions >= MIN_SPLIT_TILES * tile
    assert base_ctas * splits <= MAX_WAVES * slots, "more waves than the planner allows"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(prefills(), min_size=1, max_size=20))
def test_plans_keep_the_kernels_rules(planner: Path, batch: list[dict]):
    for p, plan in zip(batch, plan_all(planner, batch), strict=True):
        check_plan(p, plan)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefills())
def test_the_workspace_a_plan_asks_for_gives_that_plan(planner: Path, p: dict):
    """``paged_prefill_workspace_bytes`` plans with unlimited workspace and reports what that plan needs:
    a prefill given exactly that much must plan the same; with less, another plan that fits; with none,
    unsplit and without the expanded context."""
    [wanted] = plan_all(planner, [dict(p, workspace_bytes=UINT64_MAX)])
    [given_exactly, given_less, given_none] = plan_all(
        planner, [dict(p, workspace_bytes=wanted["needed_bytes"]),
                  dict(p, workspace_bytes=max(wanted["needed_bytes"] - 1, 0)), dict(p, workspace_bytes=0)])
    assert given_exactly == wanted
    assert given_none["num_splits"] == 1 and given_none["expanded_tiles"] == 0 and given_none["needed_bytes"] == 0
    if wanted["needed_bytes"] > 0:
        assert given_less != wanted


def test_short_chunks_over_long_contexts_split_and_long_chunks_do_not(planner: Path):
    """The planner's purpose, on shapes whose answer is plain (32 query / 8 KV heads, head_dim 128, 132
    multiprocessors of 3 CTAs): a 16-token chunk over 32K positions (8 CTAs) splits into one to two
    waves' worth of CTAs; an 8192-token chunk (4096 CTAs) fills the device alone."""
    common = dict(head_dim=128, num_seqs=1, num_q_heads=32, num_kv_heads=8, max_blocks_per_seq=2048, block_size=16,
                  multiprocessors=132, ctas_per_sm=3, workspace_bytes=UINT64_MAX, query_rows=64)
    short, long = plan_all(planner, [dict(common, max_q_len=16, num_query_rows=16),
                                     dict(common, max_q_len=8192, num_query_rows=8192)])
    slots = 132 * 3
    assert slots <= 8 * short["num_splits"] <= MAX_WAVES * slots and long["num_splits"] == 1


def test_long_chunks_read_the_expanded_context(planner: Path):
    """A chunk of many warp-specialised query tiles per KV head (2048 tokens of 4 query heads: 64) reads
    every tile of its table row dequantized once (32K positions: 512 tiles of 64 at head_dim 128, each
    (sequence, KV head) its own), where the workspace holds them; without that workspace it dequantizes
    per CTA; the 64-row kernel never expands, nor a 128-token chunk (4 query tiles)."""
    common = dict(head_dim=128, num_seqs=1, num_q_heads=32, num_kv_heads=8, max_blocks_per_seq=2048, block_size=16,
                  max_q_len=2048, num_query_rows=2048, multiprocessors=132, ctas_per_sm=1)
    full, none, rows64, short = plan_all(
        planner, [dict(common, workspace_bytes=UINT64_MAX, query_rows=128), dict(common, workspace_bytes=0, query_rows=128),
                  dict(common, workspace_bytes=UINT64_MAX, query_rows=64),
                  dict(common, workspace_bytes=UINT64_MAX, query_rows=128, max_q_len=128, num_query_rows=128)])
    assert full["expanded_tiles"] == 512 and full["num_splits"] == 1
    assert full["needed_bytes"] == 8 * 512 * (4 * 64 * 128 + 128)
    assert none["expanded_tiles"] == 0 and rows64["expanded_tiles"] == 0
    assert short["tiles_per_seq"] == 4 and short["expanded_tiles"] == 0

"""The decode's split planner (cuda/src/plan/), host-side: built from its source with a plain C++
compiler (tests/plan/plan_cli.cc), fed random decodes, and its plans checked against the rules the
kernels rely on. Needs a C++ compiler (skipped otherwise); no GPU, no library."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, build_filter, run_filter
SOURCES = [REPO / "tests/plan/plan_cli.cc", REPO / "cuda/src/plan/decode_plan.cc"]
FIELDS = ("v_bits head_dim num_seqs num_q_heads num_kv_heads max_blocks_per_seq block_size sliding_window "
          "max_q_len query_start rotation multiprocessors ctas_per_sm head_group_ctas_per_sm workspace_bytes").split()
# The planner's constants (cuda/src/plan/decode_plan.h), as the rules below state them.
TILE = 16
HEADS_PER_CTA = 8
WARPS = 4
MAX_PARTIALS = 1024
MIN_SPLIT_TILES = 8
MAX_WAVES = 8
SHARE_MIN_SPLITS, SHARE_MIN_SPLIT_TILES = 4, 64
HEAD_GROUP_MIN_STREAM_TILES = 64
UINT64_MAX = 2**64 - 1


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_filter(tmp_path_factory, "plan_cli", SOURCES)


def plan_all(planner: Path, decodes: list[dict]) -> list[dict]:
    names = "chunks_per_group num_splits split_tokens length_shares stream_partials needed_bytes tiles".split()
    return run_filter(planner, decodes, FIELDS, names)


def streams_per_cta(head_dim: int) -> int:
    return WARPS // (head_dim // 128 if head_dim > 128 else 1)


@st.composite
def decodes(draw) -> dict:
    kv = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32]))
    query_start = draw(st.booleans())
    return dict(v_bits=draw(st.sampled_from([2, 3, 4])), head_dim=draw(st.sampled_from([64, 128, 256, 512])),
                num_seqs=draw(st.one_of(st.integers(1, 4), st.integers(1, 512))), num_q_heads=kv * draw(st.sampled_from([1, 2, 4, 6, 8, 16])),
                num_kv_heads=kv, max_blocks_per_seq=draw(st.integers(1, 8192)),
                block_size=draw(st.sampled_from([1, 8, 16, 32, 64, 256])),
                sliding_window=draw(st.sampled_from([0, 0, 1, 100, 4096])),
                max_q_len=draw(st.integers(2, 16)) if query_start else draw(st.sampled_from([0, 1])),
                query_start=int(query_start), rotation=int(draw(st.booleans())),
                multiprocessors=draw(st.sampled_from([1, 8, 108, 132])), ctas_per_sm=draw(st.integers(1, 5)),
                head_group_ctas_per_sm=draw(st.integers(0, 5)),
                workspace_bytes=draw(st.sampled_from([0, 4096, 1 << 20, 1 << 30, UINT64_MAX])))


def check_plan(d: dict, plan: dict) -> None:
    rows = max(d["max_q_len"], 1)
    streams = streams_per_cta(d["head_dim"])
    splits, split_tokens, partials = plan["num_splits"], plan["split_tokens"], plan["stream_partials"]
    assert plan["chunks_per_group"] == math.ceil(rows * d["num_q_heads"] // d["num_kv_heads"] / HEADS_PER_CTA)
    assert splits >= 1 and partials in (1, streams) and splits * partials <= MAX_PARTIALS
    assert plan["needed_bytes"] <= d["workspace_bytes"], "the plan needs more workspace than it has"
    tiles = plan["tiles"]
    if splits > 1:
        # Whole tiles per token stream, no split shorter than the minimum, none empty, all covered.
        assert split_tokens % (TILE * streams) == 0 and split_tokens >= MIN_SPLIT_TILES * TILE
        assert (splits - 1) * split_tokens < tiles * TILE <= splits * split_tokens
        base_ctas = d["num_seqs"] * d["num_kv_heads"] * plan["chunks_per_group"]
        slots = d["multiprocessors"] * d["ctas_per_sm"]
        assert base_ctas * splits <= max(MAX_WAVES * slots, base_ctas) + base_ctas, "more waves than the planner allows"
        assert base_ctas * splits < 2**31
    if plan["length_shares"]:
        assert d["num_seqs"] > 1 and splits >= SHARE_MIN_SPLITS and split_tokens // TILE >= SHARE_MIN_SPLIT_TILES
    if partials > 1:  # head groups: only where an instance exists and the decode is the default one
        assert d["v_bits"] <= 3 and d["head_dim"] <= 128 and not d["query_start"] and not d["rotation"]
        assert plan["chunks_per_group"] == 1 and d["num_kv_heads"] % WARPS == 0
        assert d["head_group_ctas_per_sm"] == d["ctas_per_sm"]
        stream_tiles = math.ceil(min(tiles, split_tokens // TILE) / streams)
        assert stream_tiles >= HEAD_GROUP_MIN_STREAM_TILES


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(decodes(), min_size=1, max_size=20))
def test_plans_keep_the_kernels_rules(planner: Path, batch: list[dict]):
    for d, plan in zip(batch, plan_all(planner, batch), strict=True):
        check_plan(d, plan)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(decodes())
def test_the_workspace_a_plan_asks_for_gives_that_plan(planner: Path, d: dict):
    """``paged_decode_workspace_bytes`` plans with unlimited workspace and reports what that plan needs:
    a decode given exactly that much must plan the same (and with none, it runs unsplit)."""
    unlimited = dict(d, workspace_bytes=UINT64_MAX)
    [wanted] = plan_all(planner, [unlimited])
    [given_exactly, given_none] = plan_all(planner, [dict(d, workspace_bytes=wanted["needed_bytes"]),
                                                     dict(d, workspace_bytes=0)])
    assert given_exactly == wanted
    assert given_none["num_splits"] == 1 and given_none["stream_partials"] == 1 and given_none["needed_bytes"] == 0


def test_long_single_sequences_split_and_short_batches_do_not(planner: Path):
    """The planner's purpose, on two shapes whose answer is plain: one sequence of 128K tokens on 132
    multiprocessors splits; 132 x 4 sequences of 1 page fill the GPU without splits."""
    common = dict(v_bits=3, head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16, sliding_window=0, max_q_len=1,
                  query_start=0, rotation=0, multiprocessors=132, ctas_per_sm=4, head_group_ctas_per_sm=4,
                  workspace_bytes=UINT64_MAX)
    long, short = plan_all(planner, [dict(common, num_seqs=1, max_blocks_per_seq=8192),
                                     dict(common, num_seqs=528, max_blocks_per_seq=1)])
    assert long["num_splits"] > 1 and short["num_splits"] == 1

"""``compare``: two ``bench --json`` files matched row by row (no GPU: the files are built from
the fake rows of test_bench)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp8kturbov.tools.bench.config
import fp8kturbov.tools.bench.rows
import fp8kturbov.tools.bench.timing
from fp8kturbov.tools import bench, compare
from fp8kturbov.tools.cli import main
from test_bench import DEVICE, fake_rows
from test_cli import run_module

DECODE_8X8K = bench.config.Shape("decode", 3, 8, 8192, 128, 32, 8, 16)
WRITE_128 = bench.config.Shape("write", 3, 128, 0, 128, 32, 8, 16)


def timed_row(shape: bench.config.Shape, median_us: float) -> dict:
    """A bench row of ``shape`` measured at ``median_us`` µs per launch."""
    result = bench.rows.Result.for_shape(shape)
    result.record(bench.timing.Timing.of([median_us]), 4000.0)
    return dataclasses.asdict(result)


def with_median(row: dict, median_us: float) -> dict:
    return {**row, "median_us": median_us}


def baseline_rows() -> list[dict]:
    """fake_rows (read, copy, launch, decode 1x32768 at 14.5 µs, a skipped decode, write 16 tok at
    3.0 µs) and a decode 8x8192 that the candidate lacks."""
    return fake_rows() + [timed_row(DECODE_8X8K, 40.0)]


def candidate_rows() -> list[dict]:
    """fake_rows with the launch floor 20 % slower, the decode 10 % slower per launch but 10 %
    faster inside a graph, the write 5 % faster, and a write of 128 tokens that the baseline lacks."""
    read, copy, launch, decode, skipped, write = fake_rows()
    decode = {**with_median(decode, 14.5 * 1.1), "in_graph_us": decode["in_graph_us"] * 0.9}
    return [read, copy, with_median(launch, 3.0), decode, skipped,
            with_median(write, 3.0 * 0.95), timed_row(WRITE_128, 5.0)]


@pytest.fixture
def files(tmp_path):
    """The paths of the baseline and candidate files, both written by `bench.rows.write_json`."""
    baseline, candidate = tmp_path / "main.json", tmp_path / "branch.json"
    bench.rows.write_json(baseline, baseline_rows(), DEVICE, bench.config.Config())
    bench.rows.write_json(candidate, candidate_rows(), DEVICE, bench.config.Config())
    return str(baseline), str(candidate)


# ---- Records ---------------------------------------------------------------------------------------


def test_rows_match_by_what_they_measure(files):
    records = compare.compare_files(*files).rows
    assert [(r.describe(), r.only_in) for r in records] == [
        ("read 2 GiB read", ""), ("copy 2 GiB DtoD", ""), ("launch empty-kernel graph", ""),
        ("decode 3b D128 1x32768", ""), ("decode 4b D128 32x32768", ""),
        ("write 3b D128 16 tok", ""), ("decode 3b D128 8x8192", "baseline"),
        ("write 3b D128 128 tok", "candidate")]
    read, copy, launch, decode, skipped, write, baseline_only, candidate_only = records
    assert (decode.baseline_us, decode.candidate_us) == (14.5, pytest.approx(15.95))
    assert decode.change_pct == pytest.approx(10.0) and write.change_pct == pytest.approx(-5.0)
    assert launch.change_pct == pytest.approx(20.0) and not launch.is_case and decode.is_case
    assert read.change_pct == 0.0 and copy.change_pct == 0.0 and not read.is_case
    assert (baseline_only.baseline_us, baseline_only.candidate_us, baseline_only.ratio) == (40.0, None, None)
    assert (candidate_only.baseline_us, candidate_only.candidate_us) == (None, 5.0)
    assert skipped.ratio is None and skipped.note == (
        "not measured in baseline (skipped: needs 200.0 GiB, 100.0 GiB free); "
        "not measured in candidate (skipped: needs 200.0 GiB, 100.0 GiB free)")
    assert decode.note == "" and baseline_only.note == ""
    # In-graph times: the decode's (12.75 µs in fake_rows) changed apart from its time per launch;
    # the write has none, and a row of one file only has no change.
    assert (decode.baseline_in_graph_us, decode.candidate_in_graph_us) == (12.75,
                                                                           pytest.approx(11.475))
    assert decode.in_graph_change_pct == pytest.approx(-10.0)
    assert launch.in_graph_change_pct == pytest.approx(0.0)
    assert write.in_graph_change_pct is None and baseline_only.in_graph_change_pct is None


def test_query_tokens_and_heads_make_different_measurements():
    one_token = timed_row(DECODE_8X8K, 40.0)
    four_tokens = timed_row(dataclasses.replace(DECODE_8X8K, q_len=4), 41.0)
    fewer_heads = timed_row(dataclasses.replace(DECODE_8X8K, num_kv_heads=4), 20.0)
    records = compare.compare_rows([one_token], [four_tokens, fewer_heads])
    assert [(r.shape, r.only_in) for r in records] == [
        ("8x8192", "baseline"), ("8x8192 q4", "candidate"), ("8x8192", "candidate")]
    (matched,) = compare.compare_rows([four_tokens], [with_median(four_tokens, 45.1)])
    assert matched.describe() == "decode 3b D128 8x8192 q4"
    assert matched.change_pct == pytest.approx(10.0)


def test_lengths_and_table_rows_make_different_measurements():
    ramp = timed_row(dataclasses.replace(DECODE_8X8K, lengths="ramp"), 30.0)
    slice_rows = timed_row(dataclasses.replace(DECODE_8X8K, table_positions=131072), 40.5)
    whole_rows = timed_row(dataclasses.replace(DECODE_8X8K, table_positions=131072,
                                                     whole_table_rows=True), 80.0)
    records = compare.compare_rows([timed_row(DECODE_8X8K, 40.0)], [ramp, slice_rows, whole_rows])
    assert [(r.shape, r.only_in) for r in records] == [
        ("8x8192", "baseline"), ("8x8192 ramp", "candidate"), ("8x8192 rows 131072", "candidate"),
        ("8x8192 rows 131072 whole", "candidate")]
    four_token_ramp = dataclasses.replace(DECODE_8X8K, q_len=4, lengths="ramp", table_positions=65536)
    assert compare.shape_text(timed_row(four_token_ramp, 1.0)) == "8x8192 q4 ramp rows 65536"


def test_rows_of_files_without_query_tokens_match_one_token_decodes():
    """Bench files of library 0.2 have no q_len, and older files none of the fields that came
    later: their decode rows are one token per sequence of equal lengths in compact tables."""
    later = compare.LATER_DECODE_FIELDS
    old_decode, old_write = ({k: v for k, v in timed_row(shape, 40.0).items() if k not in later}
                             for shape in (DECODE_8X8K, WRITE_128))
    four_tokens = timed_row(dataclasses.replace(DECODE_8X8K, q_len=4), 41.0)
    records = compare.compare_rows([old_decode, old_write],
                                   [timed_row(DECODE_8X8K, 44.0), timed_row(WRITE_128, 40.0), four_tokens])
    assert [(r.describe(), r.only_in) for r in records] == [
        ("decode 3b D128 8x8192", ""), ("write 3b D128 128 tok", ""), ("decode 3b D128 8x8192 q4", "candidate")]
    assert records[0].change_pct == pytest.approx(10.0)
    assert records[0].in_graph_change_pct is None  # older files have no in-graph times


def test_repeated_rows_pair_in_order():
    rows = [timed_row(DECODE_8X8K, 40.0), timed_row(DECODE_8X8K, 50.0)]
    records = compare.compare_rows(rows, [with_median(rows[0], 44.0)])
    assert [(r.baseline_us, r.candidate_us, r.only_in) for r in records] == [
        (40.0, 44.0, ""), (50.0, None, "baseline")]


def test_only_decode_and_write_rows_count_as_slowdowns(files):
    records = compare.compare_files(*files).rows
    # The launch floor is 20 % slower, the decode 10 %: only the decode is a slowdown.
    assert [r.describe() for r in compare.slower_than(records, 5.0)] == ["decode 3b D128 1x32768"]
    assert compare.slower_than(records, 10.5) == []
    assert [r.describe() for r in compare.slower_than(records, 0.0)] == ["decode 3b D128 1x32768"]


# ---- Rounds ----------------------------------------------------------------------------------------

#: Per round: the decode's baseline time and the candidate's change, the write's change, %.
ROUNDS = [(14.5, 10.0, 30.0), (14.0, -1.0, -1.0), (15.0, 2.0, 0.0)]


@pytest.fixture
def round_files(tmp_path):
    """Three rounds of two builds, as (baseline, candidate) path pairs: fake_rows with the decode
    and write of `ROUNDS` (the candidate's decode 10 % faster in a graph in every round), and in
    rounds 1 and 2 a decode 8x8192 of the baseline only."""
    pairs = []
    for index, (decode_us, decode_change, write_change) in enumerate(ROUNDS, start=1):
        read, copy, launch, decode, skipped, write = fake_rows()
        baseline = [read, copy, launch, with_median(decode, decode_us), skipped, write]
        candidate = [read, copy, launch,
                     {**with_median(decode, decode_us * (1 + decode_change / 100)),
                      "in_graph_us": decode["in_graph_us"] * 0.9},
                     skipped, with_median(write, write["median_us"] * (1 + write_change / 100))]
        if index < 3:
            baseline.append(timed_row(DECODE_8X8K, 40.0))
        paths = tmp_path / f"main-{index}.json", tmp_path / f"branch-{index}.json"
        for path, rows in zip(paths, (baseline, candidate)):
            bench.rows.write_json(path, rows, DEVICE, bench.config.Config())
        pairs.append(tuple(map(str, paths)))
    return pairs


def with_power_cap(row: dict, share: float) -> dict:
    """``row`` with clock-limit counters: ``share`` of its timing under the power cap."""
    return {**row, "clock_limited": {"power cap": share, "thermal": 0.0}}


def test_power_cap_shares_are_shown_where_the_files_have_them(files, tmp_path):
    baseline, candidate = baseline_rows(), candidate_rows()
    baseline[3], candidate[3] = with_power_cap(baseline[3], 0.84), with_power_cap(candidate[3], 0.0)
    paths = tmp_path / "capped-main.json", tmp_path / "capped-branch.json"
    for path, rows in zip(paths, (baseline, candidate)):
        bench.rows.write_json(path, rows, DEVICE, bench.config.Config())
    comparison = compare.compare_files(*paths)
    decode, write = comparison.rows[3], comparison.rows[5]
    assert (decode.baseline_power_cap, decode.candidate_power_cap) == (0.84, 0.0)
    assert (write.baseline_power_cap, write.candidate_power_cap) == (None, None)
    lines = compare.format_comparison(comparison).splitlines()
    assert lines[3].endswith("in-graph change %  power cap %")
    assert lines[5].split()[-1] == "84/0"  # the decode
    assert lines[7].split()[-1] == "-/-"   # the write, without counters in either file
    # Files without counters (older ones, or NVML absent) have no such column.
    assert compare.POWER_CAP_COLUMN not in compare.format_comparison(compare.compare_files(*files))


def test_power_cap_shares_of_rounds_are_their_medians(tmp_path):
    pairs = []
    for index, share in enumerate((1.0, 0.25, 0.5)):
        read, copy, launch, decode, skipped, write = fake_rows()
        paths = tmp_path / f"main-{index}.json", tmp_path / f"branch-{index}.json"
        for path, decode_share in zip(paths, (share, 0.0)):
            bench.rows.write_json(path, [read, copy, launch, with_power_cap(decode, decode_share), write], DEVICE,
                             bench.config.Config())
        pairs.append(paths)
    decode = next(r for r in compare.compare_runs(pairs).rows if r.op == "decode")
    assert (decode.baseline_power_cap, decode.candidate_power_cap) == (0.5, 0.0)


def test_rounds_combine_into_medians_and_each_rounds_change(round_files):
    comparison = compare.compare_runs(round_files)
    assert comparison.rounds == 3
    records = {r.describe(): r for r in comparison.rows}
    assert list(records) == ["read 2 GiB read", "copy 2 GiB DtoD", "launch empty-kernel graph",
                             "decode 3b D128 1x32768", "decode 4b D128 32x32768",
                             "write 3b D128 16 tok", "decode 3b D128 8x8192"]
    decode = records["decode 3b D128 1x32768"]
    # Medians: 14.5 of (14.5, 14.0, 15.0); 15.3 of (15.95, 13.86, 15.3). The change is theirs.
    assert (decode.baseline_us, decode.candidate_us) == (14.5, pytest.approx(15.3))
    assert decode.change_pct == pytest.approx(100 * (15.3 / 14.5 - 1))
    assert decode.round_changes_pct == pytest.approx((10.0, -1.0, 2.0))
    assert decode.in_graph_change_pct == pytest.approx(-10.0)
    write = records["write 3b D128 16 tok"]
    assert write.change_pct == pytest.approx(0.0)  # one round's +30 % is not the median's
    assert write.round_changes_pct == pytest.approx((30.0, -1.0, 0.0))
    skipped = records["decode 4b D128 32x32768"]
    assert skipped.ratio is None and skipped.round_changes_pct == (None, None, None)
    assert skipped.note.count("not measured in baseline") == 1  # the rounds' equal notes, once
    # A row of the baseline only in the rounds that have it stays one of the baseline only.
    baseline_only = records["decode 3b D128 8x8192"]
    assert (baseline_only.only_in, baseline_only.baseline_us, baseline_only.candidate_us) == (
        "baseline", 40.0, None)
    assert baseline_only.round_changes_pct == (None, None, None)


def test_rounds_judge_slowdowns_by_the_medians(round_files):
    records = compare.compare_runs(round_files).rows
    # The decode's median is 5.5 % slower; the write's worst round (+30 %) does not count.
    assert [r.describe() for r in compare.slower_than(records, 5.0)] == ["decode 3b D128 1x32768"]
    assert compare.slower_than(records, 6.0) == []


def test_one_round_is_a_comparison_of_two_files(files):
    assert compare.compare_runs([files]) == compare.compare_files(*files)
    assert all(r.round_changes_pct == () for r in compare.compare_files(*files).rows)
    with pytest.raises(ValueError, match="no files"):
        compare.compare_runs([])


def test_rounds_warn_once_per_difference(tmp_path):
    pairs = []
    for index in (1, 2):
        paths = tmp_path / f"a{index}.json", tmp_path / f"b{index}.json"
        bench.rows.write_json(paths[0], fake_rows(), DEVICE, bench.config.Config())
        bench.rows.write_json(paths[1], fake_rows(), DEVICE, bench.config.Config(sinks=True))
        pairs.append(paths)
    assert compare.compare_runs(pairs).warnings == ["warning: the configs differ (sinks False vs True)"]


# ---- Warnings and invalid files ----------------------------------------------------------------------


def _document(device=DEVICE, **config) -> dict:
    return {"device": device, "config": dataclasses.asdict(bench.config.Config(**config))}


def test_no_warning_for_equal_devices_and_configs_or_other_cases():
    assert compare.context_warnings(_document(), _document()) == []
    # Other cases are listed as rows of one file only, not warned about.
    assert compare.context_warnings(_document(), _document(shapes=((8, 8192),), bits=(3,))) == []


def test_different_gpus_and_options_are_warnings():
    other_gpu = {**DEVICE, "name": "Other GPU", "timing_gate": False}
    assert compare.context_warnings(_document(), _document(other_gpu)) == [
        "warning: the devices differ (name Test GPU vs Other GPU, timing_gate True vs False): "
        "the times may not be comparable"]
    assert compare.context_warnings(_document(), _document(checked=True, iters=50)) == [
        "warning: the configs differ (iters 200 vs 50, checked False vs True)"]


@pytest.mark.parametrize("text, message", [
    ('{"schema": "fp8kturbov-quality/1", "rows": []}', "schema 'fp8kturbov-quality/1' is not "
                                                       "'fp8kturbov-bench/1'"),
    ('[1, 2]', "schema None is not 'fp8kturbov-bench/1'"),
    ('{"schema": "fp8kturbov-bench/1", "rows": {}}', "'rows' is not a list"),
    ('{"schema": ', "not JSON"),
])
def test_a_file_that_is_not_a_bench_json_is_a_value_error(tmp_path, text, message):
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        compare.load_bench_json(path)


@pytest.mark.parametrize("text, want", [("2", 2.0), ("0", 0.0), ("0.5", 0.5)])
def test_parse_percent(text, want):
    assert compare.parse_percent(text) == want


@pytest.mark.parametrize("text", ["-1", "x", "nan", "inf", ""])
def test_parse_percent_rejects(text):
    with pytest.raises(ValueError, match="is not a percentage >= 0"):
        compare.parse_percent(text)


# ---- Output ----------------------------------------------------------------------------------------


def test_format_has_the_table_the_unmatched_rows_the_machine_and_the_summary(files):
    lines = compare.format_comparison(compare.compare_files(*files)).splitlines()
    context = "Test GPU | driver 580.1 (CUDA 13.0) | 2026-01-01T00:00:00+00:00"
    assert lines[:3] == [f"baseline:  {files[0]}: commit abc1234 | {context}",
                         f"candidate: {files[1]}: commit abc1234 | {context}", ""]
    assert lines[3].split() == ["op", "bits", "shape", "D", "baseline", "us", "candidate", "us",
                                "change", "%", "in-graph", "change", "%"]
    table = [line.split() for line in lines[5:8]]
    assert table == [["decode", "3", "1x32768", "128", "14.50", "15.95", "+10.0", "-10.0"],
                     ["decode", "4", "32x32768", "128", "-", "-", "-", "-"],
                     ["write", "3", "16", "tok", "128", "3.00", "2.85", "-5.0", "-"]]
    assert len({len(line) for line in lines[3:8]}) == 1  # the columns align
    assert lines[8] == ""
    assert lines[9:11] == ["decode 3b D128 8x8192: only in baseline",
                           "write 3b D128 128 tok: only in candidate"]
    assert lines[11].startswith("decode 4b D128 32x32768: not measured in baseline (skipped")
    assert lines[12:16] == ["ceiling and floor (the machine's, not counted as slowdowns):",
                            "  read 2 GiB read: 500.00 -> 500.00 us (+0.0 %)",
                            "  copy 2 GiB DtoD: 1100.00 -> 1100.00 us (+0.0 %)",
                            "  launch empty-kernel graph: 2.50 -> 3.00 us (+20.0 %)"]
    mean = math.sqrt(1.1 * 0.95)
    assert lines[16:] == [f"worst slowdown: +10.0 % (decode 3b D128 1x32768); geometric-mean ratio "
                          f"candidate/baseline over 2 decode/write/prefill rows: {mean:.4f} "
                          f"({100 * (mean - 1):+.1f} %)"]


def test_format_shows_the_warnings_and_a_summary_without_matches(tmp_path):
    baseline, candidate = tmp_path / "a.json", tmp_path / "b.json"
    bench.rows.write_json(baseline, fake_rows()[:2] + [timed_row(DECODE_8X8K, 40.0)], DEVICE, bench.config.Config())
    bench.rows.write_json(candidate, fake_rows()[:2], {**DEVICE, "name": "Other GPU"},
                     bench.config.Config(sinks=True))
    lines = compare.format_comparison(compare.compare_files(baseline, candidate)).splitlines()
    assert lines[2:4] == ["warning: the devices differ (name Test GPU vs Other GPU): the times may "
                          "not be comparable", "warning: the configs differ (sinks False vs True)"]
    assert lines[-1] == "no decode, write or prefill row was measured in both files"


# ---- Command line ----------------------------------------------------------------------------------


def test_cli_prints_the_comparison(files, capsys):
    assert main(["compare", *files]) == 0
    out = capsys.readouterr().out
    assert out == compare.format_comparison(compare.compare_files(*files)) + "\n"
    assert "PASS" not in out and "FAIL" not in out


def test_cli_fails_on_a_slowdown_over_the_limit(files, capsys):
    assert main(["compare", *files, "--max-slowdown", "5"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "FAIL: 1 decode/write row(s) slower by more than 5 %: decode 3b D128 1x32768 (+10.0 %)")
    assert main(["compare", *files, "--max-slowdown", "10.5"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "PASS: no decode, write or prefill row is slower by more than 10.5 %")


def test_format_of_rounds_has_their_files_and_changes(round_files):
    lines = compare.format_comparison(compare.compare_runs(round_files)).splitlines()
    context = "commit abc1234 | Test GPU | driver 580.1 (CUDA 13.0) | 2026-01-01T00:00:00+00:00"
    assert lines[:3] == [
        f"baseline:  {', '.join(b for b, _ in round_files)}: {context}",
        f"candidate: {', '.join(c for _, c in round_files)}: {context}",
        "3 rounds: each time is the median over the rounds, each change that of the medians"]
    assert lines[4].endswith("in-graph change %  change % per round")
    decode, skipped, write = (line.split() for line in lines[6:9])
    assert decode == ["decode", "3", "1x32768", "128", "14.50", "15.30", "+5.5", "-10.0",
                      "+10.0/-1.0/+2.0"]
    assert skipped[-1] == "-/-/-" and write[-1] == "+30.0/-1.0/+0.0"


def test_cli_compares_rounds(round_files, capsys):
    (b1, c1), (b2, c2), (b3, c3) = round_files
    args = ["compare", b1, c1, "--round", b2, c2, "--round", b3, c3]
    assert main([*args, "--max-slowdown", "5"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(compare.format_comparison(compare.compare_runs(round_files)) + "\n")
    assert out.splitlines()[-1] == (
        "FAIL: 1 decode/write row(s) slower by more than 5 %: decode 3b D128 1x32768 (+5.5 %)")
    assert main([*args, "--max-slowdown", "6"]) == 0


def test_cli_a_file_that_is_not_a_bench_json_is_one_line(files, tmp_path, capsys):
    other = tmp_path / "quality.json"
    other.write_text(json.dumps({"schema": "fp8kturbov-quality/1"}))
    assert main(["compare", files[0], str(other)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"python -m fp8kturbov compare: error: {other}: schema 'fp8kturbov-quality/1' is not "
        "'fp8kturbov-bench/1' (the files of 'python -m fp8kturbov bench --json PATH')\n")
    assert main(["compare", files[0], str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_module_exit_status(files):
    done = run_module("compare", *files, "--max-slowdown", "2")
    assert done.returncode == 1 and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[-1].startswith("FAIL: 1 decode/write row(s)")
    assert run_module("compare", files[0], files[0], "--max-slowdown", "0").returncode == 0


def test_compare_quality_and_info_help_need_no_library(files, tmp_path):
    # None of these runs a kernel: on a machine without libfp8kturbov.so they still work.
    package_root = str(Path(bench.__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
           "FP8KTURBOV_LIBRARY": str(tmp_path / "missing" / "libfp8kturbov.so")}

    def run_without_library(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fp8kturbov", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    done = run_without_library("compare", *files, "--max-slowdown", "2")
    assert (done.returncode, done.stderr) == (1, ""), done.stderr
    assert done.stdout == run_module("compare", *files, "--max-slowdown", "2").stdout
    for command in ("quality", "info"):
        done = run_without_library(command, "--help")
        assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m fp8kturbov {command}"), done.stderr

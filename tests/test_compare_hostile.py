"""``compare`` against hostile files, generated from its contract (the exit statuses in
`fp8kturbov.tools.compare`'s docstring) rather than listed: a valid pair of bench JSON files
(those of test_compare) with fields deleted or replaced by values of another type, times that are
no measurement, non-objects, deep nesting, cut or non-UTF-8 text. A file that is not a bench JSON
gives exit status 2 and one line on stderr naming it; the gate (``--max-slowdown``) fails (1) exactly
where a row is slower than allowed or has a time in one file only, and never passes one it cannot
judge."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8kturbov.tools.bench.config
import fp8kturbov.tools.bench.rows
from cli_util import error_line, run_cli
from fp8kturbov.tools import bench, compare
from test_bench import DEVICE, fake_rows
from test_compare import baseline_rows, candidate_rows

EXAMPLES = settings(max_examples=40, deadline=None, database=None)
#: The row fields of the schema (`bench.rows.write_json`) that compare reads, by what each holds;
#: older files lack the optional ones.
STRING_FIELDS = ("op", "shape", "note")
NULLABLE_FIELDS = {"bits": int, "batch": int, "context": int, "head_dim": int, "num_q_heads": int,
                   "num_kv_heads": int, "block_size": int, "q_len": int, "lengths": str,
                   "table_positions": int, "whole_table_rows": bool}
TIME_FIELDS = ("median_us", "in_graph_us")
OPTIONAL_FIELDS = ("q_len", "lengths", "table_positions", "whole_table_rows", "in_graph_us",
                   "clock_limited")
REQUIRED_FIELDS = [name for name in (*STRING_FIELDS, *NULLABLE_FIELDS, *TIME_FIELDS)
                   if name not in OPTIONAL_FIELDS]

nested = st.recursive(st.none() | st.integers() | st.text(max_size=3),
                      lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
                      max_leaves=6)
#: Values of each JSON kind, for replacing a field with one of another kind.
JSON_KINDS = {str: st.text(max_size=8), int: st.integers(), float: st.floats(allow_nan=False),
              bool: st.booleans(), type(None): st.none(),
              list: st.lists(nested, max_size=2), dict: st.dictionaries(st.text(max_size=3), nested, max_size=2)}
#: Times that are no measurement: the bench writes null or a finite number of µs > 0.
bad_times = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0, 0.0, -0.0]),
                      st.floats(max_value=-1e-300, allow_infinity=False), st.integers(max_value=-1))


def other_kinds(*allowed: type) -> st.SearchStrategy[Any]:
    """A JSON value of none of the kinds ``allowed``."""
    return st.one_of(*(values for kind, values in JSON_KINDS.items() if kind not in allowed))


def bad_value(field: str) -> st.SearchStrategy[Any]:
    """A value that ``field`` of a row may not hold."""
    if field in STRING_FIELDS:
        return other_kinds(str)
    if field in NULLABLE_FIELDS:
        return other_kinds(NULLABLE_FIELDS[field], type(None))
    if field == "clock_limited":
        share = st.one_of(bad_times.filter(lambda x: x != 0), st.floats(min_value=1.001),
                          other_kinds(int, float))
        return other_kinds(dict, type(None)) | share.map(lambda x: {"power cap": x}) | st.just({})
    return other_kinds(int, float, type(None)) | bad_times  # a time


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with the valid pair of test_compare: baseline.json and candidate.json."""
    folder = tmp_path_factory.mktemp("hostile")
    bench.rows.write_json(folder / "baseline.json", baseline_rows(), DEVICE, bench.config.Config())
    bench.rows.write_json(folder / "candidate.json", candidate_rows(), DEVICE, bench.config.Config())
    return folder


def compare_with(workdir: Path, hostile: bytes | dict, side: str, *options: str) -> tuple[int, str, str, str]:
    """``compare`` of the valid pair with ``side`` ("baseline" or "candidate") replaced by
    ``hostile`` (a document, or the file's bytes): the status, stdout, stderr and that file's path."""
    path = workdir / f"hostile-{side}.json"
    path.write_bytes(hostile if isinstance(hostile, bytes) else json.dumps(hostile).encode())
    paths = {name: str(workdir / f"{name}.json") for name in ("baseline", "candidate")}
    paths[side] = str(path)
    return (*run_cli("compare", paths["baseline"], paths["candidate"], *options), str(path))


def valid(workdir: Path, side: str) -> dict:
    return json.loads((workdir / f"{side}.json").read_text())


def assert_not_a_bench_json(status: int, out: str, err: str, path: str) -> str:
    assert (status, out) == (2, "") and err.count("\n") == 1, (status, err)
    line = error_line(err, "compare")
    assert path in line
    return line


sides = st.sampled_from(["baseline", "candidate"])
gates = st.sampled_from([(), ("--max-slowdown", "0"), ("--max-slowdown", "1000")])


@EXAMPLES
@given(side=sides, gate=gates, data=st.data())
def test_a_row_field_of_the_wrong_kind_is_exit_2(workdir, side, gate, data):
    doc = valid(workdir, side)
    index = data.draw(st.integers(0, len(doc["rows"]) - 1), label="row")
    field = data.draw(st.sampled_from([*STRING_FIELDS, *NULLABLE_FIELDS, *TIME_FIELDS, "clock_limited"]))
    doc["rows"][index][field] = data.draw(bad_value(field), label="value")
    line = assert_not_a_bench_json(*compare_with(workdir, doc, side, *gate))
    assert f"rows[{index}] {field} " in line


@EXAMPLES
@given(side=sides, gate=gates, data=st.data())
def test_a_time_that_is_no_measurement_in_a_decode_or_write_row_never_passes(workdir, side, gate, data):
    doc = valid(workdir, side)
    cases = [i for i, row in enumerate(doc["rows"]) if row["op"] in bench.config.OPS]
    index = data.draw(st.sampled_from(cases), label="row")
    doc["rows"][index][data.draw(st.sampled_from(TIME_FIELDS))] = data.draw(bad_times, label="time")
    line = assert_not_a_bench_json(*compare_with(workdir, doc, side, *gate))
    assert f"rows[{index}] " in line and "not null or a time > 0 us" in line


@EXAMPLES
@given(side=sides, data=st.data())
def test_a_missing_row_field_is_exit_2_unless_older_files_lack_it(workdir, side, data):
    doc = valid(workdir, side)
    index = data.draw(st.integers(0, len(doc["rows"]) - 1), label="row")
    fields = data.draw(st.sets(st.sampled_from([*REQUIRED_FIELDS, *OPTIONAL_FIELDS]), min_size=1))
    for field in fields:
        doc["rows"][index].pop(field, None)
    status, out, err, path = compare_with(workdir, doc, side, "--max-slowdown", "1000")
    if fields <= set(OPTIONAL_FIELDS):
        assert (status, err) == (0, ""), err  # read as an older file's row: the same measurement
    else:
        assert "has no" in assert_not_a_bench_json(status, out, err, path)


@EXAMPLES
@given(side=sides, data=st.data())
def test_a_document_of_the_wrong_shape_is_exit_2(workdir, side, data):
    doc = valid(workdir, side)
    where = data.draw(st.sampled_from(["top", "schema", "device", "config", "rows", "row",
                                       "device value", "config value"]))
    if where == "top":
        doc = data.draw(other_kinds(dict))
    elif where in ("schema", "device", "config", "rows"):
        kind = {"schema": str, "device": dict, "config": dict, "rows": list}[where]
        if data.draw(st.booleans(), label="delete"):
            del doc[where]
        else:
            doc[where] = data.draw(other_kinds(kind))
    elif where == "row":
        doc["rows"][data.draw(st.integers(0, len(doc["rows"]) - 1))] = data.draw(other_kinds(dict))
    else:
        name = data.draw(st.sampled_from(sorted(DEVICE) if where == "device value"
                                         else compare.COMPARED_CONFIG_FIELDS))
        doc[where.split()[0]][name] = data.draw(other_kinds(str, int, float, bool, type(None)))
    assert_not_a_bench_json(*compare_with(workdir, doc, side, "--max-slowdown", "1000"))


@EXAMPLES
@given(side=sides, data=st.data())
def test_text_that_is_not_utf8_json_is_exit_2(workdir, side, data):
    text = (workdir / f"{side}.json").read_bytes()
    how = data.draw(st.sampled_from(["cut", "bad byte", "deep"]))
    if how == "cut":  # anywhere before its last bracket
        hostile = text[:data.draw(st.integers(0, len(text.rstrip()) - 1))]
    elif how == "bad byte":
        at = data.draw(st.integers(0, len(text)))
        hostile = text[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) + text[at:]
    else:  # well-formed, but nested beyond what the parser's recursion reaches
        depth = data.draw(st.integers(10_000, 200_000))
        opening, closing = data.draw(st.sampled_from([("[", "]"), ('{"a": ', "}")]))
        field = data.draw(st.sampled_from(["rows", "device", "unread"]))
        hostile = (f'{{"schema": "{bench.rows.BENCH_SCHEMA}", "{field}": {opening * depth}null'
                   f'{closing * depth}}}').encode()
    assert_not_a_bench_json(*compare_with(workdir, hostile, side, "--max-slowdown", "1000"))


def test_a_path_that_is_no_file_is_exit_2(workdir):
    for path in (workdir, workdir / "missing.json"):
        status, out, err = run_cli("compare", str(workdir / "baseline.json"), str(path))
        assert (status, out) == (2, "") and str(path) in error_line(err, "compare")


# ---- The gate: valid files ----------------------------------------------------------------------

times = st.floats(min_value=5e-324, max_value=1.7e308)


@EXAMPLES
@given(data=st.data(), limit=st.floats(0, 1e6))
def test_the_gate_fails_exactly_on_slower_rows_and_rows_measured_once(workdir, data, limit):
    """fake_rows in both files, each measured decode/write row given random times on either side
    (any finite time > 0), or skipped on one side; the gate's status follows from them."""
    rows = {side: fake_rows() for side in ("baseline", "candidate")}
    expect_fail = []
    for index, row in enumerate(rows["baseline"]):
        if row["op"] not in bench.config.OPS or row["median_us"] is None:
            continue
        baseline_us, candidate_us = data.draw(times, label="baseline"), data.draw(times, label="candidate")
        skipped = data.draw(st.sampled_from([None, None, "baseline", "candidate"]), label="skipped in")
        for side, value in (("baseline", baseline_us), ("candidate", candidate_us)):
            rows[side][index] = {**row, "median_us": None if side == skipped else value,
                                 "note": "skipped: needs more memory" if side == skipped else row["note"]}
        change = 100.0 * (candidate_us / baseline_us - 1.0)  # as compare computes it
        expect_fail.append(bool(skipped) or change > limit)
    for side, side_rows in rows.items():
        bench.rows.write_json(workdir / f"gate-{side}.json", side_rows, DEVICE, bench.config.Config())
    status, out, err = run_cli("compare", str(workdir / "gate-baseline.json"),
                               str(workdir / "gate-candidate.json"), "--max-slowdown", repr(limit))
    assert err == "" and status == (1 if any(expect_fail) else 0), out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("FAIL: " if any(expect_fail) else "PASS: ")

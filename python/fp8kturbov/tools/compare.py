"""Two benchmark runs side by side: ``python -m fp8kturbov compare BASELINE.json CANDIDATE.json``.

Both files are written by ``python -m fp8kturbov bench --json`` (schema: `bench.rows.write_json`),
typically by two builds on the same GPU. `compare_files` matches their rows by what they measure
(`ROW_IDENTITY`: the op, every `bench.config.Shape` field and the shape text) and gives each match the
change of its median time per launch, ``100 * (candidate / baseline - 1)`` %, positive when the
candidate is slower, and the same change of its in-graph time (per launch with 32 launches in one
graph: what a short launch costs inside an engine's captured step), shown beside it. The ceiling
(read and copy) and the launch floor measure the machine, not the change: they are shown apart and
never count as slowdowns. Rows of one file only, and rows a run skipped, are listed rather than
dropped. Options that change a measurement without being in its row
(checked mode, V encoder, soft cap, sinks, sparse-V threshold, iterations ...) are run-wide: they
are compared as the files' configs, a difference being a warning, as is a different GPU.

Runs of two builds vary by a few per cent from one run to the next, so A/B comparisons repeat
them in interleaved rounds (`ci/bench-compare.sh`). `compare_runs` takes every round's pair of
files: each time is then the median over the rounds that measured it, the change is that of the
medians, and each round's own change is listed beside it. One cause of such variation is the GPU's
power limit holding its clocks down: where the files have the bench's clock-limit counters
(``clock_limited``), each side's share of the row's timing under the power cap is shown too
(`POWER_CAP_COLUMN`), so that a change measured under different caps can be told apart.

Exit statuses of ``compare`` (`fp8kturbov.tools.cli`), with ``--max-slowdown PCT`` as the
regression gate:

- 2: a file is not a bench JSON, in one line on stderr naming it and what is wrong
  (`load_bench_json`): it cannot be read (missing, a directory), is not UTF-8, not JSON or nested
  too deeply to parse, has another schema, or a field that compare reads is absent or of the wrong
  type (`ROW_FIELDS`, the device's and the config's values). A time is null (the row was
  skipped) or a finite number of µs > 0: NaN, inf, 0 or a negative time is no measurement the
  bench writes, so such a file is refused, with or without the gate.
- 1: the gate fails (``FAIL: ...`` on stdout, naming each row): a decode, write or prefill row of both files
  is slower by more than PCT %, or one file measured it and the other skipped it, so that its
  change is unknown (`unjudged_rows`). Rows skipped in both files, and rows of one file only
  (the runs chose other cases), are listed but do not fail it.
- 0: otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import typing
from collections import Counter
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from .bench.config import OPS, Config, Shape
from .bench.rows import BENCH_SCHEMA, context_line
from .console import format_number, format_table

#: The row fields that say what a row measures. The shape text tells apart the ceiling copies
#: of different sizes; for decode and write rows it follows from the `Shape` fields.
ROW_IDENTITY = ("op", "shape", *(f.name for f in dataclasses.fields(Shape) if f.name != "op"))
#: `Shape` fields that older files lack, with the value their decode rows had (write rows:
#: null). Files of library 0.2 lack ``q_len``, those written before the bench's ``--lengths``,
#: ``--table-positions`` and ``--append`` the others.
LATER_DECODE_FIELDS = {"q_len": 1, "lengths": "equal", "table_positions": 0, "whole_table_rows": False,
                       "append": "none"}
#: Config fields that only choose which cases run: not warned about, as a case of one file only
#: is listed as such.
CASE_SELECTION = ("ops", "shapes", "tokens", "chunks", "bits", "head_dims", "appends")
#: The config fields whose difference is a warning.
COMPARED_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in CASE_SELECTION)
#: Device fields that must agree for the times to be comparable: the GPU, and the timing gate
#: (without it short launches include host time).
DEVICE_FIELDS = ("name", "timing_gate")
TABLE_COLUMNS = ("op", "bits", "shape", "D", "baseline us", "candidate us", "change %", "in-graph change %")
#: The column added where several rounds are compared: each round's change, %.
ROUNDS_COLUMN = "change % per round"
#: The column added where either file has clock-limit counters: the share of the row's timing
#: under the power cap, %, baseline/candidate ("-" for a side without counters).
POWER_CAP_COLUMN = "power cap %"


def parse_percent(text: str) -> float:
    """A finite percentage >= 0: ``"2"``, ``"0.5"``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"{text!r} is not a percentage >= 0")
    return value


def _ratio(baseline_us: float | None, candidate_us: float | None) -> float | None:
    return None if baseline_us is None or candidate_us is None else candidate_us / baseline_us


def _change_pct(ratio: float | None) -> float | None:
    return None if ratio is None else 100.0 * (ratio - 1.0)


@dataclass(frozen=True)
class RowComparison:
    """One measurement, matched across the two files.

    Times are the bench's ``median_us``, µs per launch; None where the file lacks the row
    (``only_in`` names the file that has it) or skipped it (``note`` says why). The in-graph times
    are its ``in_graph_us``, µs per launch inside a graph; None also for rows without one (the
    ceiling's read and copy). The power-cap shares are the rows' ``clock_limited["power cap"]``
    (0 to 1; None without counters). Over several rounds (`combine_rounds`) each time and share is
    the median over the rounds that measured it and ``round_changes_pct`` holds each round's change
    of time, % (None in a round without one); it is empty for one round.
    """

    op: str
    bits: int | None
    shape: str  # the bench's shape text and the decode's other fields (`shape_text`)
    head_dim: int | None
    baseline_us: float | None
    candidate_us: float | None
    only_in: str = ""  # "baseline" or "candidate" for a row of one file only
    note: str = ""
    baseline_in_graph_us: float | None = None
    candidate_in_graph_us: float | None = None
    baseline_power_cap: float | None = None
    candidate_power_cap: float | None = None
    round_changes_pct: tuple[float | None, ...] = ()

    @property
    def is_case(self) -> bool:
        """A decode, write or prefill row; not the ceiling's read or copy or the launch floor (the machine's)."""
        return self.op in OPS

    @property
    def ratio(self) -> float | None:
        """Candidate time / baseline time; None unless both files measured the row."""
        return _ratio(self.baseline_us, self.candidate_us)

    @property
    def change_pct(self) -> float | None:
        """The candidate's change of time, % of the baseline's: positive when slower."""
        return _change_pct(self.ratio)

    @property
    def in_graph_change_pct(self) -> float | None:
        """The same for the in-graph times; None unless both files have one."""
        return _change_pct(_ratio(self.baseline_in_graph_us, self.candidate_in_graph_us))

    def describe(self) -> str:
        """As `Shape.describe` for decode and write: ``"decode 3b D128 8x8192"``."""
        if not self.is_case:
            return f"{self.op} {self.shape}"
        return f"{self.op} {self.bits}b D{self.head_dim} {self.shape}"


@dataclass(frozen=True)
class BenchComparison:
    """Two runs compared, in one or more rounds: each side's files with the first one's context
    line, the warnings, one record per measurement (the baseline's rows in order, then those of
    the candidate only)."""

    baseline: str
    candidate: str
    warnings: list[str]
    rows: list[RowComparison]
    rounds: int = 1


# ---- Validation: every field compare reads, checked once, as the file is loaded ----------------

_NULL = type(None)
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", _NULL: "null"}


def _shown(value: Any) -> str:
    """``value`` in a one-line message: a scalar as its repr (shortened), an array or an object by
    its kind (they may be nested far too deep to print)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _of(*types: type) -> Callable[[Any], str | None]:
    """The check of a field whose value is one of ``types`` (exactly: a bool is no integer)."""
    names = " or ".join(_TYPE_NAMES[t] for t in types)
    return lambda value: None if type(value) in types else f"is {_shown(value)}, not {names}"


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _scalar(value: Any) -> str | None:
    """The check of the device's values and the compared config's: JSON scalars, as the bench
    writes them."""
    if value is None or type(value) in (str, bool) or _is_number(value):
        return None
    return f"is {_shown(value)}, not a string, a number, true, false or null"


def _time(value: Any) -> str | None:
    """The check of a time: null where the row was not measured, else a finite number of µs > 0."""
    if value is None or (_is_number(value) and 0 < value < math.inf):
        return None
    return f"is {_shown(value)}, not null or a time > 0 us"


def _clock_limits(value: Any) -> str | None:
    """The check of ``clock_limited``: null, or an object with a ``"power cap"`` share in 0..1."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"is {_shown(value)}, not null or an object"
    share = value.get("power cap")
    if _is_number(share) and 0 <= share <= 1:
        return None
    return f"has a 'power cap' of {_shown(share)}, not a share in 0..1"


_SHAPE_TYPES = typing.get_type_hints(Shape)
#: What compare reads of a row: per field, its check and whether a file may lack it (older files
#: lack the `LATER_DECODE_FIELDS`, the in-graph times and the clock-limit counters). The `Shape`
#: fields are null where they do not apply (write rows, the machine's rows).
ROW_FIELDS: dict[str, tuple[Callable[[Any], str | None], bool]] = {
    "op": (_of(str), False), "shape": (_of(str), False),
    **{name: (_of(_SHAPE_TYPES[name], _NULL), name in LATER_DECODE_FIELDS)
       for name in ROW_IDENTITY if name not in ("op", "shape")},
    "median_us": (_time, False), "in_graph_us": (_time, True), "note": (_of(str), False),
    "clock_limited": (_clock_limits, True)}


def _row_problems(row: Any) -> Iterator[str]:
    """What makes ``row`` (parsed JSON) no row of a bench JSON, in what compare reads."""
    if not isinstance(row, dict):
        yield f"is {_shown(row)}, not an object"
        return
    for name, (check, optional) in ROW_FIELDS.items():
        if name not in row:
            if not optional:
                yield f"has no {name!r}"
            continue
        problem = check(row[name])
        if problem:
            yield f"{name} {problem}"


def _document_problems(document: Any) -> Iterator[str]:
    """What makes ``document`` (parsed JSON) no bench JSON, in what compare reads."""
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema != BENCH_SCHEMA:
        yield (f"schema {_shown(schema)} is not {BENCH_SCHEMA!r} (the files of "
               "'python -m fp8kturbov bench --json PATH')")
        return
    for name, kind, what in (("rows", list, "a list"), ("device", dict, "an object"),
                             ("config", dict, "an object")):
        if name not in document:
            yield f"has no {name!r}"
            return
        if not isinstance(document[name], kind):
            yield f"{name!r} is not {what} but {_shown(document[name])}"
            return
    config = document["config"]
    yield from (f"device {name!r} {problem}" for name, value in document["device"].items()
                if (problem := _scalar(value)))
    yield from (f"config {name!r} {problem}" for name in COMPARED_CONFIG_FIELDS
                if name in config and (problem := _scalar(config[name])))
    for index, row in enumerate(document["rows"]):
        yield from (f"rows[{index}] {problem}" for problem in _row_problems(row))


def load_bench_json(path: str | Path) -> dict[str, Any]:
    """The document that ``bench --json`` wrote to ``path``. Raises ValueError naming ``path``
    where it is not one (see the module docstring), OSError where it cannot be read."""
    try:
        document = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a bench JSON") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise ValueError(f"{path}: not JSON ({exc})") from None
    problem = next(_document_problems(document), None)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return document


def row_identity(row: dict[str, Any]) -> tuple[Any, ...]:
    """What ``row`` measures (`ROW_IDENTITY`): rows of two runs with equal identities match. A
    field of `LATER_DECODE_FIELDS` that an older file lacks takes its value there."""
    older = {name: value if row["op"] == "decode" else None for name, value in LATER_DECODE_FIELDS.items()}
    return tuple(row[name] if name in row else older[name] for name in ROW_IDENTITY)


def _median_us(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row["median_us"]


def _in_graph_us(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row.get("in_graph_us")  # absent from files older than the in-graph times


def _power_cap(row: dict[str, Any] | None) -> float | None:
    held = None if row is None else row.get("clock_limited")  # absent from files older than the counters
    return None if held is None else held["power cap"]


def shape_text(row: dict[str, Any]) -> str:
    """The bench's shape text of ``row``, followed for a prefill row by its chunk (`` chunk <N>``,
    N query tokens per sequence), for a decode row by what else it measures
    where that is not the default: `` q<N>`` for N > 1 query tokens per sequence, `` ramp`` for
    sequences of mixed lengths, `` rows <N>`` (`` rows <N> whole``) for block-table rows of N
    positions passed as a column slice (whole), `` +fused`` / `` +write`` for a step that appends
    its new tokens first."""
    fields = dict(zip(ROW_IDENTITY, row_identity(row)))
    parts = [row["shape"]]
    if row["op"] == "prefill":
        parts.append(f"chunk {fields['q_len']}")
    elif (fields["q_len"] or 1) > 1:
        parts.append(f"q{fields['q_len']}")
    if fields["lengths"] not in (None, "equal"):
        parts.append(fields["lengths"])
    if fields["table_positions"]:
        parts.append(f"rows {fields['table_positions']}" + (" whole" if fields["whole_table_rows"] else ""))
    if fields["append"] not in (None, "none"):
        parts.append(f"+{fields['append']}")
    return " ".join(parts)


def _record(baseline: dict[str, Any] | None, candidate: dict[str, Any] | None) -> RowComparison:
    """The record of a matched pair of rows, or of one row (the other None)."""
    row = baseline if baseline is not None else candidate
    sides = (("baseline", baseline), ("candidate", candidate))
    skipped = [f"not measured in {name} ({side['note']})" for name, side in sides
               if side is not None and side["median_us"] is None]
    return RowComparison(
        op=row["op"], bits=row["bits"], shape=shape_text(row),
        head_dim=row["head_dim"], baseline_us=_median_us(baseline),
        candidate_us=_median_us(candidate),
        only_in="candidate" if baseline is None else "baseline" if candidate is None else "",
        note="; ".join(skipped), baseline_in_graph_us=_in_graph_us(baseline),
        candidate_in_graph_us=_in_graph_us(candidate), baseline_power_cap=_power_cap(baseline),
        candidate_power_cap=_power_cap(candidate))


def compare_rows(baseline_rows: Iterable[dict[str, Any]],
                 candidate_rows: Iterable[dict[str, Any]]) -> list[RowComparison]:
    """One record per measurement of either run, rows matched by `row_identity` (the n-th row of
    a repeated identity with the other run's n-th): in the baseline's order, then the rows of the
    candidate only."""
    groups: dict[tuple[Any, ...], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for side, rows in enumerate((baseline_rows, candidate_rows)):
        for row in rows:
            groups.setdefault(row_identity(row), ([], []))[side].append(row)
    return [_record(baseline, candidate) for pair in groups.values()
            for baseline, candidate in zip_longest(*pair)]


def _median_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _merge_rounds(records: Sequence[RowComparison | None]) -> RowComparison:
    """One measurement's records of every round (None where a round lacks it) as one record."""
    present = [r for r in records if r is not None]
    sides = {r.only_in for r in present}
    return dataclasses.replace(
        present[0],
        baseline_us=_median_of(r.baseline_us for r in present),
        candidate_us=_median_of(r.candidate_us for r in present),
        baseline_in_graph_us=_median_of(r.baseline_in_graph_us for r in present),
        candidate_in_graph_us=_median_of(r.candidate_in_graph_us for r in present),
        baseline_power_cap=_median_of(r.baseline_power_cap for r in present),
        candidate_power_cap=_median_of(r.candidate_power_cap for r in present),
        only_in=sides.pop() if len(sides) == 1 else "",  # of one file only in every round
        note="; ".join(dict.fromkeys(r.note for r in present if r.note)),
        round_changes_pct=tuple(None if r is None else r.change_pct for r in records))


def combine_rounds(rounds: Sequence[Sequence[RowComparison]]) -> list[RowComparison]:
    """The records of several rounds (each a `compare_rows` result of the same two builds' runs)
    merged into one per measurement, matched by what the record describes (and the n-th of a
    repeated one with the other rounds' n-th), in order of first appearance: each time the median
    over the rounds that measured it, ``round_changes_pct`` each round's change. One round is
    returned as it is."""
    if len(rounds) == 1:
        return list(rounds[0])
    merged: dict[tuple[Any, ...], list[RowComparison | None]] = {}
    for index, records in enumerate(rounds):
        seen: Counter[tuple[Any, ...]] = Counter()
        for record in records:
            what = (record.op, record.bits, record.shape, record.head_dim)
            merged.setdefault((*what, seen[what]), [None] * len(rounds))[index] = record
            seen[what] += 1
    return [_merge_rounds(records) for records in merged.values()]


def _differences(baseline: dict[str, Any], candidate: dict[str, Any], names: Iterable[str]) -> str:
    return ", ".join(f"{name} {baseline.get(name)} vs {candidate.get(name)}" for name in names
                     if baseline.get(name) != candidate.get(name))


def context_warnings(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """One warning line where the documents' devices (`DEVICE_FIELDS`) differ, one where their
    configs do (every `Config` field but `CASE_SELECTION`): the times may differ for that."""
    devices = _differences(baseline["device"], candidate["device"], DEVICE_FIELDS)
    options = _differences(baseline["config"], candidate["config"], COMPARED_CONFIG_FIELDS)
    warnings = []
    if devices:
        warnings.append(f"warning: the devices differ ({devices}): the times may not be comparable")
    if options:
        warnings.append(f"warning: the configs differ ({options})")
    return warnings


def compare_runs(rounds: Sequence[tuple[str | Path, str | Path]]) -> BenchComparison:
    """Load each round's baseline and candidate ``bench --json`` files (`load_bench_json`),
    compare each pair row by row and combine the rounds (`combine_rounds`). The warnings are
    those of every round's pair, each once."""
    if not rounds:
        raise ValueError("no files to compare")
    documents = [(load_bench_json(b), load_bench_json(c)) for b, c in rounds]

    def side(index: int) -> str:
        paths = ", ".join(str(pair[index]) for pair in rounds)
        return f"{paths}: {context_line(documents[0][index]['device'])}"

    warnings = [w for baseline, candidate in documents for w in context_warnings(baseline, candidate)]
    return BenchComparison(
        baseline=side(0), candidate=side(1), warnings=list(dict.fromkeys(warnings)),
        rows=combine_rounds([compare_rows(b["rows"], c["rows"]) for b, c in documents]),
        rounds=len(rounds))


def compare_files(baseline_path: str | Path, candidate_path: str | Path) -> BenchComparison:
    """Load two ``bench --json`` files (`load_bench_json`) and compare them row by row."""
    return compare_runs([(baseline_path, candidate_path)])


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def has_power_caps(records: Iterable[RowComparison]) -> bool:
    """Whether either file had clock-limit counters for any of ``records``."""
    return any(r.baseline_power_cap is not None or r.candidate_power_cap is not None for r in records)


def table_rows(records: Iterable[RowComparison], power_caps: bool = False) -> list[tuple[str, ...]]:
    """The cells of the decode and write rows found in both files, in `TABLE_COLUMNS` order, then
    (``power_caps``) `POWER_CAP_COLUMN`, then (over several rounds) `ROUNDS_COLUMN`: the rounds'
    changes, ``/``-separated."""
    return [(r.op, str(r.bits), r.shape, str(r.head_dim), format_number(r.baseline_us, 2),
             format_number(r.candidate_us, 2), _signed(r.change_pct),
             _signed(r.in_graph_change_pct))
            + ((f"{_share(r.baseline_power_cap)}/{_share(r.candidate_power_cap)}",) if power_caps else ())
            + (("/".join(map(_signed, r.round_changes_pct)),) if r.round_changes_pct else ())
            for r in records if r.is_case and not r.only_in]


def summary_line(records: Iterable[RowComparison]) -> str:
    """The worst (largest) change, %, and the geometric mean of candidate / baseline over the
    decode and write rows measured in both files."""
    measured = [r for r in records if r.is_case and r.ratio is not None]
    if not measured:
        return "no decode, write or prefill row was measured in both files"
    worst = max(measured, key=lambda r: r.ratio)
    # From the times' logs: the ratio of two extreme times can underflow to 0, which
    # statistics.geometric_mean refuses.
    log_mean = statistics.fmean(math.log(r.candidate_us) - math.log(r.baseline_us) for r in measured)
    try:
        mean = math.exp(log_mean)
    except OverflowError:  # a mean ratio beyond the floats
        mean = math.inf
    return (f"worst slowdown: {_signed(worst.change_pct)} % ({worst.describe()}); geometric-mean "
            f"ratio candidate/baseline over {len(measured)} decode/write/prefill rows: {mean:.4f} "
            f"({_signed(100.0 * (mean - 1.0))} %)")


def _times_text(record: RowComparison) -> str:
    return (f"{format_number(record.baseline_us, 2)} -> "
            f"{format_number(record.candidate_us, 2)} us ({_signed(record.change_pct)} %)")


def format_comparison(comparison: BenchComparison) -> str:
    """The files, the warnings, the table of the decode and write rows of both files, the rows
    without a change (of one file only, or skipped), the ceiling and floor, and `summary_line`."""
    records = comparison.rows
    power_caps = has_power_caps(records)
    columns = TABLE_COLUMNS + ((POWER_CAP_COLUMN,) if power_caps else ()) + \
        ((ROUNDS_COLUMN,) if comparison.rounds > 1 else ())
    lines = [f"baseline:  {comparison.baseline}", f"candidate: {comparison.candidate}"]
    if comparison.rounds > 1:
        lines.append(f"{comparison.rounds} rounds: each time is the median over the rounds, each "
                     "change that of the medians")
    lines += [*comparison.warnings, "", format_table(table_rows(records, power_caps), columns), ""]
    lines += [f"{r.describe()}: only in {r.only_in}" for r in records if r.only_in]
    lines += [f"{r.describe()}: {r.note}" for r in records if r.note]
    machine = [r for r in records if not r.is_case and not r.only_in]
    if machine:
        lines.append("ceiling and floor (the machine's, not counted as slowdowns):")
        lines += [f"  {r.describe()}: {_times_text(r)}" for r in machine]
    lines.append(summary_line(records))
    return "\n".join(lines)


def slower_than(records: Iterable[RowComparison], max_slowdown_pct: float) -> list[RowComparison]:
    """The decode and write rows whose time grew by more than ``max_slowdown_pct`` %."""
    return [r for r in records
            if r.is_case and r.change_pct is not None and r.change_pct > max_slowdown_pct]


def unjudged_rows(records: Iterable[RowComparison]) -> list[RowComparison]:
    """The decode and write rows of both files that one measured and the other skipped: their
    change is unknown, so the gate fails on them rather than pass them."""
    return [r for r in records
            if r.is_case and not r.only_in and (r.baseline_us is None) != (r.candidate_us is None)]


def verdict_line(slower: Sequence[RowComparison], unjudged: Sequence[RowComparison],
                 max_slowdown_pct: float) -> str:
    """``PASS: ...`` where no row is in ``slower`` (`slower_than`) or ``unjudged``
    (`unjudged_rows`), else ``FAIL: ...`` naming each, with its change, % (or why it has none)."""
    limit = f"{max_slowdown_pct:g} %"
    if not slower and not unjudged:
        return f"PASS: no decode, write or prefill row is slower by more than {limit}"
    failures = []
    if slower:
        named = ", ".join(f"{r.describe()} ({_signed(r.change_pct)} %)" for r in slower)
        failures.append(f"{len(slower)} decode/write row(s) slower by more than {limit}: {named}")
    if unjudged:
        named = ", ".join(f"{r.describe()} ({r.note})" for r in unjudged)
        failures.append(f"{len(unjudged)} decode/write row(s) without a time in one file: {named}")
    return f"FAIL: {'; '.join(failures)}"

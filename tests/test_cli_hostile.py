"""The command line against hostile numbers and ``--kv-file`` archives, generated from its contract
rather than listed: every numeric option of every command (found in the parser, so that a new one
is covered or the test says it is not) given an integer out of its range (`bench.config.MAX_COUNT`,
`MAX_SEED`, `MAX_Q_LEN`), text that is no number, or a float that is NaN, infinite or negative; and
``demo --kv-file`` given cut archives, arrays of other kinds of numbers and values beyond bf16.
Each gives exit status 2 and one error line on stderr (after argparse's usage, for a usage error)
naming the option or the file."""

from __future__ import annotations

import argparse
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_util import error_line, run_cli
from fp8kturbov.tools import cli
from fp8kturbov.tools.bench.config import APPENDS, MAX_C_FLOAT, MAX_COUNT, MAX_Q_LEN, MAX_SEED

EXAMPLES = settings(max_examples=60, deadline=None, database=None)
#: What each command needs besides the option tried: compare's two files (never read: the option
#: fails first), and the demo on the CPU.
BASE_ARGS = {"bench": [], "compare": ["a.json", "b.json"], "demo": ["--cpu", "--no-progress"], "quality": [],
             "generate": ["--model", "no-model", "--prompt", "p"], "perplexity": ["--model", "no-model", "--text", "t"]}

decimal = re.compile(r"\s*[0-9]+[kK]?\s*")
any_text = st.text(max_size=12)
junk = any_text.filter(lambda t: not decimal.fullmatch(t))
too_large_count = (st.integers(min_value=MAX_COUNT + 1).map(str)
                   | st.integers(min_value=MAX_COUNT // 1024 + 1).map(lambda n: f"{n}k"))
bad_count = st.integers(max_value=0).map(str) | too_large_count | junk
#: A bad count as an item of a list ("N,..." or "BxL,..."): junk that does not split into good ones.
bad_item = bad_count.filter(lambda t: "," not in t and "x" not in t.lower())
good_count = st.integers(1, 4096).map(str)


def float_taken(text: str) -> bool:
    """Whether some float option may take ``text``: a finite number >= 0."""
    try:
        return 0 <= float(text) < math.inf
    except ValueError:
        return False


def int_of(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


#: Floats no option takes: each must be finite and >= 0.
bad_float = (st.sampled_from(["nan", "inf", "-inf", "1e999", "-1e999"])
             | st.floats(max_value=-5e-324, allow_infinity=False).map(repr)
             | any_text.filter(lambda t: not float_taken(t)))


def _with_one_bad(items: st.SearchStrategy[list[str]], bad: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return st.tuples(items, bad, st.integers(0, 8)).map(lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])


#: An out-of-range or malformed value of each kind of numeric option, by its argparse type's name.
HOSTILE = {
    "parse_count": bad_count,
    "parse_count_or_zero": st.integers(max_value=-1).map(str) | too_large_count | junk,
    "parse_counts": _with_one_bad(st.lists(good_count, max_size=3), bad_item).map(",".join),
    "parse_q_len": st.integers(max_value=0).map(str) | st.integers(min_value=MAX_Q_LEN + 1).map(str),
    "parse_shapes": _with_one_bad(st.lists(st.tuples(good_count, good_count).map("x".join), max_size=2),
                                  st.tuples(good_count, bad_item).map("x".join)
                                  | st.tuples(bad_item, good_count).map("x".join)).map(",".join),
    "parse_seed": st.integers(max_value=-1).map(str) | st.integers(min_value=MAX_SEED + 1).map(str) | junk,
    "parse_percent": bad_float,
    "parse_appends": any_text.filter(lambda t: any(m.strip() not in APPENDS for m in t.split(","))),
    "float": bad_float,
}


def numeric_options() -> list[tuple[str, str, argparse.Action]]:
    """(command, option, action) of every option of every command that takes a number."""
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(command, action.option_strings[-1], action)
            for command, parser in subparsers.choices.items() for action in parser._actions
            if action.type is not None and action.option_strings]


def hostile_value(action: argparse.Action) -> st.SearchStrategy[str]:
    if action.type is int:  # an integer among a few choices
        assert action.choices, f"{action.option_strings} is an int of any range"
        return st.integers().filter(lambda n: n not in action.choices).map(str) | any_text.filter(
            lambda t: int_of(t) not in action.choices)
    return HOSTILE[action.type.__name__]


def normalised(text: str) -> str:
    return text.replace("-", "_")


def test_every_numeric_option_is_tried():
    options = numeric_options()
    assert {option for _, option, _ in options} >= {"--shapes", "--seq-lens", "--seed", "--tokens",
                                                    "--sparse-v-threshold", "--max-slowdown"}
    for _, _, action in options:
        hostile_value(action)  # a kind without hostile values fails here


@EXAMPLES
@given(option=st.sampled_from(numeric_options()), data=st.data())
def test_a_numeric_option_out_of_range_is_exit_2_in_one_line(option, data):
    command, flag, action = option
    value = data.draw(hostile_value(action), label="value")
    status, out, err = run_cli(command, *BASE_ARGS[command], f"{flag}={value}")
    assert (status, out) == (2, ""), (status, out, err)
    line = error_line(err, command)
    # A usage error names the argument; a float is checked by the command (Config, the demo's
    # case), which names the option or its field.
    assert f"argument {flag}" in line or normalised(flag.lstrip("-")) in normalised(line), line


@EXAMPLES
@given(command=st.sampled_from(["bench", "demo"]), flag=st.sampled_from(["--sparse-v-threshold", "--soft-cap"]),
       value=st.floats(min_value=MAX_C_FLOAT, exclude_min=True, allow_infinity=False))
def test_a_float_beyond_the_c_abi_float32_is_exit_2(command, flag, value):
    status, out, err = run_cli(command, *BASE_ARGS[command], f"{flag}={value!r}")
    assert (status, out) == (2, "") and normalised(flag.lstrip("-")) in normalised(error_line(err, command))


@pytest.mark.parametrize("argv", [
    ["bench", "--shapes", "1x3000000000"], ["bench", "--shapes", "3000000000x1"],
    ["demo", "--seq-lens", "99999999999"], ["quality", "--seed", "-1"],
    ["quality", "--tokens", "99999999999"], ["demo", "--cpu", "--sparse-v-threshold", "inf"],
    ["bench", "--warmup", "-1"], ["bench", "--table-positions", "2097152k"],
])
def test_the_reported_command_lines_are_exit_2(argv):
    status, out, err = run_cli(*argv)
    assert (status, out) == (2, "") and error_line(err, argv[0])


# ---- demo --kv-file ---------------------------------------------------------------------------------


def kv_arrays() -> dict[str, np.ndarray]:
    """A valid --kv-file's arrays: two sequences of 10 and 6 tokens, 2 KV heads, 4 query heads."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((16, 2, 64)).astype(np.float32) for _ in range(2))
    return {"k": k, "v": v, "q": rng.standard_normal((2, 4, 64)).astype(np.float32),
            "seq_lens": np.array([10, 6])}


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    np.savez(folder / "valid.npz", **kv_arrays())
    return folder


def demo_with(path) -> tuple[int, str, str]:
    return run_cli("demo", "--cpu", "--no-progress", "--kv-file", str(path))


def assert_bad_kv_file(result: tuple[int, str, str], path) -> None:
    status, out, err = result
    assert (status, out) == (2, ""), (status, err)
    assert str(path) in error_line(err, "demo")


@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data())
def test_a_cut_kv_file_is_exit_2(kv_dir, data):
    valid = (kv_dir / "valid.npz").read_bytes()
    path = kv_dir / "cut.npz"
    path.write_bytes(valid[:data.draw(st.integers(0, len(valid) - 1))])
    assert_bad_kv_file(demo_with(path), path)


OTHER_DTYPES = {"k": ["complex64", "complex128", "int32", "bool", "U3"], "v": ["complex64", "int8", "bool"],
                "q": ["complex128", "uint8"], "seq_lens": ["float64", "complex128", "bool"]}


@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data())
def test_a_kv_file_of_other_numbers_or_values_beyond_bf16_is_exit_2(kv_dir, data):
    arrays = kv_arrays()
    name = data.draw(st.sampled_from(sorted(OTHER_DTYPES)))
    if name != "seq_lens" and data.draw(st.booleans(), label="a value beyond bf16"):
        array = arrays[name].astype(np.float64)
        array.flat[data.draw(st.integers(0, array.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf]) | st.floats(min_value=3.4e38) | st.floats(max_value=-3.4e38))
        arrays[name] = array
    else:
        arrays[name] = arrays[name].astype(data.draw(st.sampled_from(OTHER_DTYPES[name])))
    path = kv_dir / "hostile.npz"
    np.savez(path, **arrays)
    assert_bad_kv_file(demo_with(path), path)

"""The command line run in this process, and the one-line error it must give a bad input (shared by
test_cli_hostile and test_compare_hostile)."""

from __future__ import annotations

import contextlib
import io

from fp8kturbov.tools.cli import PROG, main


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``python -m fp8kturbov ARGV`` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            status = exc.code
    return status, out.getvalue(), err.getvalue()


def error_line(err: str, command: str) -> str:
    """The one ``<prog> <command>: error: ...`` line that ``err`` (a run's stderr) ends with,
    after nothing but argparse's usage (for a usage error); fails where it holds anything else,
    a traceback or a warning say."""
    *before, last = err.splitlines() or [""]
    assert last.startswith(f"{PROG} {command}: error: ") and last != f"{PROG} {command}: error: ", err
    assert all(line.startswith(("usage: ", " ")) for line in before), err
    assert not before or before[0].startswith("usage: "), err
    return last

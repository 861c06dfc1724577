"""A new user's first run, as README.md prints it: every ``python -m fp8kturbov`` command works
with the base dependencies alone (a plain ``pip install .``), the README's planning example runs
as printed, its ``cc`` line links a program that starts, and the build folders it names are
ignored by git (so that ci/build-wheels.sh does not copy them into a wheel's source)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fp8kturbov
from fp8kturbov.tools.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _base_distributions() -> set[str]:
    """The distributions a plain install brings: pyproject's dependencies and theirs (installed
    ones only; requirements behind an extra or a marker left out)."""
    listed = re.search(r"^dependencies = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.S | re.M)
    pending = [_name(r) for r in re.findall(r'"([^"]+)"', listed.group(1))]
    found: set[str] = set()
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        pending += [_name(r) for r in requires if ";" not in r]
    return found


def _allowed_imports() -> list[str]:
    """Top-level import names of the base distributions, the standard library and the package."""
    base = _base_distributions()
    provided = {top for top, dists in md.packages_distributions().items()
                if any(_name(d) in base for d in dists)}
    return sorted(provided | set(sys.stdlib_module_names) | {"fp8kturbov", "__main__"})


# Run in a fresh interpreter: any import outside the allowed names fails as if not installed.
_ONLY_BASE = """
import importlib.abc, json, os, sys
allowed = set(json.loads(os.environ["ALLOWED_IMPORTS"]))
class OnlyBase(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (not a base dependency)", name=name)
        return None
sys.meta_path.insert(0, OnlyBase())
from fp8kturbov.tools.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.exit(code or 0)
"""


def _run_with_base_only(*args: str) -> subprocess.CompletedProcess:
    if not hasattr(sys, "stdlib_module_names"):
        pytest.skip("needs Python 3.10's sys.stdlib_module_names")
    env = {**os.environ, "ALLOWED_IMPORTS": json.dumps(_allowed_imports())}
    return subprocess.run([sys.executable, "-c", _ONLY_BASE, *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)


def _commands() -> list[str]:
    parser = build_parser()
    choices = next(a.choices for a in parser._actions if getattr(a, "choices", None) and a.dest == "command")
    return sorted(choices)


@pytest.mark.parametrize("command", _commands())
def test_every_command_starts_with_the_base_dependencies_only(command):
    done = _run_with_base_only(command, "--help")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "usage:" in done.stdout


def test_info_runs_with_the_base_dependencies_only():
    done = _run_with_base_only("info")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith(f"fp8kturbov library {fp8kturbov.version()}")


def test_the_planning_example_runs_as_printed():
    (block,) = [b for b in _code_blocks("python") if "calibrate_k_scale(" in b]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    keys = namespace["sample_keys"]
    assert namespace["k_scale"] == fp8kturbov.calibrate_k_scale(keys) > 0


def test_the_cc_line_builds_a_program_that_starts(tmp_path):
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    (block,) = [b for b in _code_blocks("sh") if "cc -I" in b]
    lines = [line.split("#")[0] for line in block.splitlines()
             if line.startswith(("lib=", "cc "))]
    assert len(lines) == 2, block
    (tmp_path / "app.c").write_text(
        '#include <stdio.h>\n#include <fp8kturbov.h>\n'
        'int main(void) {\n  printf("%d\\n", fp8kturbov_version());\n'
        '  return fp8kturbov_version() == FP8KTURBOV_VERSION ? 0 : 1;\n}\n')
    python = tmp_path / "bin" / "python"  # the README's `python` is this interpreter
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    built = subprocess.run(["bash", "-euc", "\n".join(lines)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(tmp_path / "a.out")], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    major, minor, patch = (int(part) for part in fp8kturbov.version().split("."))
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    assert ran.stdout.strip() == str(major * 10000 + minor * 100 + patch)


def test_the_build_folders_the_readme_names_are_ignored():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    folders = sorted({f"{folder}/" for folder in re.findall(r"-B (\S+)", README)})
    assert "build-example/" in folders, folders
    done = subprocess.run(["git", "check-ignore", *folders], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert sorted(done.stdout.split()) == folders, done.stdout

"""CPU tests of the package's import structure: no import cycle among its modules, the modules
that need no library import on a machine without one (the library loads on first use), and the
load checks the ABI version before anything else."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fp8kturbov
from fp8kturbov import _lib

PACKAGE = Path(fp8kturbov.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """Every module of the package (subpackages included), by dotted name."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("fp8kturbov", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its code (a function-level or
    TYPE_CHECKING import is an edge too: it only moves where a cycle bites)."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # ``from X import y``: the submodule X.y where there is one, else X itself.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "fp8kturbov.cache" in graph["fp8kturbov.arrays"]  # the walker does see imports
    assert "fp8kturbov._device" in graph["fp8kturbov.checked"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# Run in a fresh interpreter: what imports and works without the library, and what the first
# call that needs it raises.
WITHOUT_LIBRARY = textwrap.dedent("""\
    import fp8kturbov, fp8kturbov.reference, fp8kturbov.layout, fp8kturbov.planning
    from fp8kturbov import _lib, _limits
    assert fp8kturbov.ABI_VERSION == 1 and fp8kturbov.VEncoder.MSE == 1
    assert fp8kturbov.VRotation.HADAMARD == 1 and fp8kturbov.arrays.MAX_Q_LEN == _limits.MAX_Q_LEN
    assert fp8kturbov.planning.calibrate_k_scale([448.0]) == 1.0
    assert fp8kturbov.reference.v_page_bytes(16, 1, 128, 3) > 0
    assert _lib._loaded is None
    for call in (fp8kturbov.version, lambda: fp8kturbov.CacheLayout(1, 16, 1, 128)):
        try:
            call()
        except Exception as exc:
            print(type(exc).__name__, exc)
        else:
            raise AssertionError("the library loaded")
    print("version", getattr(fp8kturbov, "__version__", None))
    """)


def run_without_library(env: dict[str, str], path: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", WITHOUT_LIBRARY], env={**env, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_package_imports_with_the_library_path_pointing_nowhere(tmp_path):
    missing = tmp_path / "libfp8kturbov.so"
    env = {**os.environ, "FP8KTURBOV_LIBRARY": str(missing)}
    lines = run_without_library(env, str(PACKAGE.parent))
    assert len(lines) == 3 and all(line == f"ImportError FP8KTURBOV_LIBRARY={str(missing)!r}: no such file"
                                   for line in lines[:2]), lines
    header = PACKAGE.parents[1] / "cuda" / "include" / "fp8kturbov.h"
    if header.exists():  # a checkout: the version comes from its header
        assert lines[2] == f"version {fp8kturbov.__version__}"


def test_the_package_imports_with_no_library_beside_it(tmp_path):
    """A copy of the package without the library, its header or metadata: everything of
    WITHOUT_LIBRARY imports; the library's functions raise the ImportError naming what to do, and
    ``__version__`` is unknown (an AttributeError, so that ``hasattr`` says False)."""
    shutil.copytree(PACKAGE, tmp_path / "fp8kturbov",
                    ignore=shutil.ignore_patterns("*.so", "include", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "FP8KTURBOV_LIBRARY"}
    lines = run_without_library(env, str(tmp_path))
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert line.startswith("ImportError libfp8kturbov.so is not in the fp8kturbov package"), line
        assert "FP8KTURBOV_LIBRARY" in line
    assert lines[2] == "version None"


def test_a_library_of_another_abi_is_refused_before_its_symbols_are_bound(tmp_path, monkeypatch):
    """A library exporting only ``fp8kturbov_abi_version`` (returning another version): the load
    names both versions, and no missing symbol was looked up first."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "other_abi.c"
    source.write_text("int fp8kturbov_abi_version(void) { return 99; }\n")
    built = tmp_path / "libother_abi.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(built))
    with pytest.raises(ImportError, match=re.escape(f"FP8KTURBOV_LIBRARY={str(built)!r} has ABI version 99, "
                                                    f"this package needs {_lib.ABI_VERSION}")):
        _lib._load()


def _c_library(tmp_path: Path, source: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "lib.c").write_text(source)
    built = tmp_path / "libsome.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(built), str(tmp_path / "lib.c")], check=True)
    return built


@pytest.mark.parametrize("source, message", [
    ("int unrelated(void) { return 0; }\n", "has no symbol fp8kturbov_abi_version"),
    (f"int fp8kturbov_abi_version(void) {{ return {_lib.ABI_VERSION}; }}\n", "has no symbol fp8kturbov_"),
])
def test_a_library_lacking_a_function_is_refused_by_name(tmp_path, monkeypatch, source, message):
    """Another library, or one of this ABI that lacks a function: an ImportError that names the
    variable and the missing function, not an AttributeError from ctypes."""
    built = _c_library(tmp_path, source)
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(built))
    with pytest.raises(ImportError, match=re.escape(f"FP8KTURBOV_LIBRARY={str(built)!r} is not the fp8kturbov "
                                                    "library this package needs") + ".*" + message):
        _lib._load()


@pytest.mark.parametrize("contents", [b"", b"not a shared library\n", b"\x7fELF\x02\x01\x01" + bytes(64)])
def test_a_file_that_is_no_shared_library_is_refused_naming_the_variable(tmp_path, monkeypatch, contents):
    path = tmp_path / "libfp8kturbov.so"
    path.write_bytes(contents)
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(path))
    with pytest.raises(ImportError, match=re.escape(f"FP8KTURBOV_LIBRARY={str(path)!r} does not load as a shared "
                                                    "library: ")):
        _lib._load()


def test_a_folder_is_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(tmp_path))
    with pytest.raises(ImportError, match=re.escape(f"FP8KTURBOV_LIBRARY={str(tmp_path)!r}: not a file")):
        _lib._load()

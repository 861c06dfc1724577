"""The installed library as C/C++ projects consume it: ``cmake --install`` of a small build (one
architecture, head dim 128, 3-bit V), then

- the installed files (header, library, CMake package config and version file, pkg-config file),
  and an exported target that carries no CUDA dependency;
- a C99 consumer generated here that uses ``find_package(fp8kturbov CONFIG REQUIRED)`` and
  ``fp8kturbov::fp8kturbov`` in a project without CUDA, from a moved copy of the prefix; it runs
  without a GPU;
- ``pkg-config --cflags --libs fp8kturbov`` (when pkg-config exists), compiling the same consumer;
- the same two consumers against the imported ``fp8kturbov`` Python package when it was installed
  from a wheel (``-DCMAKE_PREFIX_PATH=<site-packages>/fp8kturbov``; skipped for a source tree);
- ``examples/c`` built against the prefix (when the CUDA toolkit is found); it runs to exit 0 on a
  GPU (test marked ``gpu``) and exits 77 (skipped) without one.

Needs CMake >= 3.26 (the venv's pip-installed ``cmake`` comes first, then PATH), a C compiler and
``nvcc``; the test skips, saying which is missing, otherwise. The architecture is
``$FP8KTURBOV_CUDA_ARCHITECTURES`` when set, else ``90-real``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from example_util import check_example_without_gpu_contract

from fp8kturbov._lib import header_version

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "c"
MIN_CMAKE = (3, 26)
CONFIGURE_TIMEOUT_S = 300
BUILD_TIMEOUT_S = 900

CONSUMER_C = r"""
#include <stdio.h>
#include <string.h>

#include <fp8kturbov.h>

int main(void) {
  fp8kturbov_decode_params_t p;
  fp8kturbov_status_t st;
  int failed = 0;
  if (fp8kturbov_version() != FP8KTURBOV_VERSION) {
    printf("version %d != header %d\n", fp8kturbov_version(), FP8KTURBOV_VERSION);
    failed = 1;
  }
  if (fp8kturbov_abi_version() != FP8KTURBOV_ABI_VERSION) {
    printf("ABI %d != header %d\n", fp8kturbov_abi_version(), FP8KTURBOV_ABI_VERSION);
    failed = 1;
  }
  /* 16 tokens x 8 KV heads x 128: one byte per K element; 3-bit V is 7/16 byte per element. */
  if (fp8kturbov_k_page_bytes(16, 8, 128) != 16384u) {
    printf("k_page_bytes %llu\n", (unsigned long long)fp8kturbov_k_page_bytes(16, 8, 128));
    failed = 1;
  }
  if (fp8kturbov_v_page_bytes(16, 8, 128, 3) != 7168u ||
      fp8kturbov_v_data_section_bytes(16, 8, 128, 3) != 6144u) {
    printf("v page sizes wrong\n");
    failed = 1;
  }
  if (fp8kturbov_k_page_bytes(16, 8, 100) != 0u) {
    printf("head_dim 100 accepted\n");
    failed = 1;
  }
  /* A rejected launch: host-side validation, nothing reaches a GPU. */
  fp8kturbov_decode_params_init(&p);
  p.num_seqs = 1;
  p.head_dim = 100;
  st = fp8kturbov_paged_decode_attn(&p, NULL);
  if (st == FP8KTURBOV_STATUS_SUCCESS || fp8kturbov_last_error_message()[0] == '\0' ||
      strncmp(fp8kturbov_status_string(st), "FP8KTURBOV_STATUS_", 18) != 0) {
    printf("invalid launch: %s \"%s\"\n", fp8kturbov_status_string(st),
           fp8kturbov_last_error_message());
    failed = 1;
  }
  printf("consumer %s: fp8kturbov %d, K page %llu bytes, rejected launch: %s\n",
         failed ? "FAILED" : "ok", fp8kturbov_version(),
         (unsigned long long)fp8kturbov_k_page_bytes(16, 8, 128), fp8kturbov_status_string(st));
  return failed;
}
"""

CONSUMER_CMAKE = r"""
cmake_minimum_required(VERSION 3.16)
project(fp8kturbov_consumer LANGUAGES C)  # no CUDA

# SameMajorVersion: the next major version is refused, an older minor of this major accepted.
find_package(fp8kturbov @NEXT_MAJOR@.0 CONFIG QUIET)
if(fp8kturbov_FOUND)
  message(FATAL_ERROR "find_package(fp8kturbov @NEXT_MAJOR@.0) accepted ${fp8kturbov_VERSION}")
endif()
find_package(fp8kturbov @MAJOR@.0 CONFIG REQUIRED)
if(NOT fp8kturbov_VERSION VERSION_EQUAL "@VERSION@")
  message(FATAL_ERROR "fp8kturbov_VERSION = ${fp8kturbov_VERSION}")
endif()
if(NOT TARGET fp8kturbov::fp8kturbov)
  message(FATAL_ERROR "no target fp8kturbov::fp8kturbov")
endif()
if(NOT DEFINED fp8kturbov_V_BITS OR NOT DEFINED fp8kturbov_HEAD_DIMS)
  message(FATAL_ERROR "fp8kturbov_V_BITS / fp8kturbov_HEAD_DIMS not set")
endif()
@CHECK_BUILT@
message(STATUS "fp8kturbov_DIR=${fp8kturbov_DIR}")

add_executable(consumer main.c)
set_target_properties(consumer PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
if(CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(consumer PRIVATE -Wall -Wextra -Werror -pedantic)
endif()
target_link_libraries(consumer PRIVATE fp8kturbov::fp8kturbov)
"""

CONSUMER_CHECK_BUILT = r"""
if(NOT fp8kturbov_V_BITS STREQUAL "@V_BITS@" OR NOT fp8kturbov_HEAD_DIMS STREQUAL "@HEAD_DIMS@")
  message(FATAL_ERROR "built configuration: ${fp8kturbov_V_BITS} / ${fp8kturbov_HEAD_DIMS}")
endif()
"""


# ---- Tools ----------------------------------------------------------------------------------------

def _tool(name: str) -> str | None:
    """``name`` from the running interpreter's folder (a venv's pip-installed cmake or ninja, also
    when the venv is not activated), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"cmake version (\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def _c_compiler() -> list[str] | None:
    if os.environ.get("CC"):
        cc = shlex.split(os.environ["CC"])
        return cc if shutil.which(cc[0]) else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _nvcc() -> str | None:
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{shlex.join(str(c) for c in cmd)} exited {result.returncode}\n"
        f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result


def _project_version() -> str:
    """The version CMake gives the project: the header's version macros."""
    found = header_version(REPO / "cuda" / "include" / "fp8kturbov.h")
    assert found, "FP8KTURBOV_VERSION_MAJOR/MINOR/PATCH not found in fp8kturbov.h"
    return found


@dataclass
class Tools:
    cmake: str
    generator: list[str]  # -G and -DCMAKE_MAKE_PROGRAM arguments

    def configure(self, source: Path, build: Path, *defines: str,
                  env: dict | None = None) -> subprocess.CompletedProcess:
        return _run([self.cmake, "-S", source, "-B", build, *self.generator, *defines],
                    CONFIGURE_TIMEOUT_S, env=env)

    def build(self, build: Path) -> subprocess.CompletedProcess:
        return _run([self.cmake, "--build", build, "--parallel", "--verbose"], BUILD_TIMEOUT_S)


@dataclass
class Installed:
    prefix: Path
    libdir: Path  # prefix/lib or prefix/lib64 (GNUInstallDirs)
    build: Path
    version: str


@pytest.fixture(scope="module")
def tools() -> Tools:
    cmake = _tool("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    version = _cmake_version(cmake)
    if version is None or version < MIN_CMAKE:
        found = ".".join(map(str, version)) if version else "unknown"
        pytest.skip(f"{cmake} is version {found}; the project needs CMake >= 3.26 "
                    "(pip install 'cmake>=3.26', part of the test extra)")
    if _c_compiler() is None:
        pytest.skip("no C compiler (CC, cc, gcc or clang)")
    if not (REPO / "CMakeLists.txt").exists():
        pytest.skip(f"{REPO} holds no CMakeLists.txt (tests run from a checkout)")
    ninja = _tool("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    return Tools(cmake, generator)


@pytest.fixture(scope="module")
def installed(tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """One small build of the library, installed into a fresh prefix."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no CUDA compiler (CUDACXX, nvcc on PATH or /usr/local/cuda/bin/nvcc)")
    build = tmp_path_factory.mktemp("library-build")
    prefix = tmp_path_factory.mktemp("prefix")
    arch = os.environ.get("FP8KTURBOV_CUDA_ARCHITECTURES") or "90-real"
    tools.configure(REPO, build,
                    "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_CUDA_COMPILER={nvcc}",
                    f"-DFP8KTURBOV_CUDA_ARCHITECTURES={arch}",
                    "-DFP8KTURBOV_HEAD_DIMS=128",
                    "-DFP8KTURBOV_V_BITS=3",
                    # A different prefix at configure time: --prefix at install time must win.
                    f"-DCMAKE_INSTALL_PREFIX={build / 'configure-time-prefix'}")
    tools.build(build)
    _run([tools.cmake, "--install", build, "--prefix", prefix], CONFIGURE_TIMEOUT_S)
    libraries = sorted(prefix.glob("lib*/libfp8kturbov.so"))
    assert len(libraries) == 1, f"libfp8kturbov.so under {prefix}: {libraries}"
    return Installed(prefix, libraries[0].parent, build, _project_version())


def test_architectures_from_the_environment_are_the_caches(tools: Tools, tmp_path: Path):
    """``$FP8KTURBOV_CUDA_ARCHITECTURES`` sets a build's architectures on its first configure and
    the cache holds them (what the build compiles for, as tools read it back); a later configure of
    the same build with another value there keeps the cache's and warns, naming both."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no CUDA compiler (CUDACXX, nvcc on PATH or /usr/local/cuda/bin/nvcc)")
    build = tmp_path / "build"
    common = ("-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DFP8KTURBOV_HEAD_DIMS=128",
              "-DFP8KTURBOV_V_BITS=3")

    def cached() -> str:
        found = re.search(r"^FP8KTURBOV_CUDA_ARCHITECTURES:\w+=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)
        assert found, "FP8KTURBOV_CUDA_ARCHITECTURES not in the cache"
        return found.group(1)

    first = tools.configure(REPO, build, *common, env=dict(os.environ, FP8KTURBOV_CUDA_ARCHITECTURES="90a-real"))
    assert cached() == "90a-real" and "FP8KTURBOV_CUDA_ARCHITECTURES is" not in first.stderr
    again = tools.configure(REPO, build, *common, env=dict(os.environ, FP8KTURBOV_CUDA_ARCHITECTURES="80-real"))
    assert cached() == "90a-real"
    assert '"80-real" in the environment but "90a-real" in this build\'s cache' in " ".join(again.stderr.split())


# ---- The installed files -------------------------------------------------------------------------

def test_installed_files(installed: Installed):
    prefix, libdir = installed.prefix, installed.libdir
    header = prefix / "include" / "fp8kturbov.h"
    assert header.read_bytes() == (REPO / "cuda" / "include" / "fp8kturbov.h").read_bytes()
    cmake_dir = libdir / "cmake" / "fp8kturbov"
    for name in ("fp8kturbovConfig.cmake", "fp8kturbovConfigVersion.cmake",
                 "fp8kturbovTargets.cmake"):
        assert (cmake_dir / name).is_file(), f"{cmake_dir / name} missing"
    assert list(cmake_dir.glob("fp8kturbovTargets-*.cmake")), "per-configuration targets file"
    assert (libdir / "pkgconfig" / "fp8kturbov.pc").is_file()
    assert not (installed.build / "configure-time-prefix").exists()

    version_file = (cmake_dir / "fp8kturbovConfigVersion.cmake").read_text()
    assert f'set(PACKAGE_VERSION "{installed.version}")' in version_file
    # write_basic_package_version_file(... COMPATIBILITY SameMajorVersion)
    assert "requested major version is the same as the current one" in version_file

    targets = "".join(p.read_text() for p in sorted(cmake_dir.glob("fp8kturbovTargets*.cmake")))
    assert "add_library(fp8kturbov::fp8kturbov SHARED IMPORTED)" in targets
    assert 'INTERFACE_INCLUDE_DIRECTORIES "${_IMPORT_PREFIX}/include"' in targets
    # Consumers get the library and the header folder, nothing else: no CUDA runtime, no link
    # language that would make them enable CUDA, and no path of the build or the source tree.
    for forbidden in ("INTERFACE_LINK_LIBRARIES", "IMPORTED_LINK_INTERFACE_LANGUAGES",
                      "IMPORTED_LINK_DEPENDENT_LIBRARIES", "cudart", "CUDA::",
                      str(REPO), str(installed.build), str(prefix)):
        assert forbidden not in targets, f"{forbidden!r} in the exported targets"

    config = (cmake_dir / "fp8kturbovConfig.cmake").read_text()
    assert 'set(fp8kturbov_V_BITS "3")' in config
    assert 'set(fp8kturbov_HEAD_DIMS "128")' in config
    assert "find_dependency" not in config and "CUDAToolkit" not in config

    pc = (libdir / "pkgconfig" / "fp8kturbov.pc").read_text()
    assert f"\nVersion: {installed.version}\n" in pc
    assert "prefix=${pcfiledir}/" in pc and str(prefix) not in pc
    assert "Cflags: -I${includedir}" in pc and "Libs: -L${libdir} -lfp8kturbov" in pc


def test_library_needs_no_cuda_runtime(installed: Installed):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    dynamic = _run([readelf, "-d", installed.libdir / "libfp8kturbov.so"], 60).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed, dynamic
    assert not [n for n in needed if "cudart" in n or n.startswith("libcuda.")], needed


# ---- Consumers -------------------------------------------------------------------------------------

def _relocated_prefix(installed: Installed, dest: Path) -> Path:
    """A copy of the installed prefix elsewhere: nothing in it may point at the original."""
    shutil.copytree(installed.prefix, dest, symlinks=True)
    return dest


def _find_package_consumer(tools: Tools, tmp_path: Path, prefix: Path, cmake_dir: Path,
                           version: str, v_bits: str | None, head_dims: str | None) -> None:
    """Generates, builds and runs the C consumer with CMAKE_PREFIX_PATH=prefix; find_package must
    pick cmake_dir."""
    source = tmp_path / "consumer"
    source.mkdir()
    major = int(version.split(".")[0])
    cmake_lists = (CONSUMER_CMAKE.replace("@NEXT_MAJOR@", str(major + 1))
                   .replace("@MAJOR@", str(major)).replace("@VERSION@", version))
    if v_bits is not None:
        cmake_lists = cmake_lists.replace("@CHECK_BUILT@", CONSUMER_CHECK_BUILT) \
            .replace("@V_BITS@", v_bits).replace("@HEAD_DIMS@", head_dims or "")
    (source / "CMakeLists.txt").write_text(cmake_lists.replace("@CHECK_BUILT@", ""))
    (source / "main.c").write_text(CONSUMER_C)
    build = tmp_path / "consumer-build"
    configured = tools.configure(source, build, f"-DCMAKE_PREFIX_PATH={prefix}",
                                 "-DCMAKE_BUILD_TYPE=Release")
    found = re.search(r"fp8kturbov_DIR=(.*)", configured.stdout)
    assert found and Path(found.group(1).strip()).resolve() == cmake_dir.resolve(), \
        configured.stdout
    built = tools.build(build)
    assert "cudart" not in built.stdout and "libcuda" not in built.stdout, built.stdout
    ran = _run([build / "consumer"], 60)
    assert ran.stdout.startswith("consumer ok"), ran.stdout


def _pkg_config_consumer(tmp_path: Path, pc_dir: Path, include_dir: Path, libdir: Path,
                         version: str) -> None:
    """pkg-config with PKG_CONFIG_PATH=pc_dir names include_dir and libdir; the C consumer
    compiled with its flags runs."""
    pkg_config = shutil.which("pkg-config") or shutil.which("pkgconf")
    if pkg_config is None:
        pytest.skip("no pkg-config")
    env = dict(os.environ, PKG_CONFIG_PATH=str(pc_dir))
    env.pop("PKG_CONFIG_SYSROOT_DIR", None)
    assert _run([pkg_config, "--modversion", "fp8kturbov"], 60, env=env).stdout.strip() == version
    flags = shlex.split(_run([pkg_config, "--cflags", "--libs", "fp8kturbov"], 60,
                             env=env).stdout)
    assert [Path(f[2:]).resolve() for f in flags if f.startswith("-I")] == \
        [include_dir.resolve()], flags
    assert [Path(f[2:]).resolve() for f in flags if f.startswith("-L")] == [libdir.resolve()], \
        flags
    assert "-lfp8kturbov" in flags, flags
    cc = _c_compiler()
    assert cc is not None
    (tmp_path / "main.c").write_text(CONSUMER_C)
    exe = tmp_path / "pkg-config-consumer"
    _run([*cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", tmp_path / "main.c",
          *flags, f"-Wl,-rpath,{libdir}", "-o", exe], 120)
    ran = _run([exe], 60)
    assert ran.stdout.startswith("consumer ok"), ran.stdout


def test_find_package_consumer(tools: Tools, installed: Installed, tmp_path: Path):
    prefix = _relocated_prefix(installed, tmp_path / "relocated-prefix")
    cmake_dir = prefix / installed.libdir.relative_to(installed.prefix) / "cmake" / "fp8kturbov"
    _find_package_consumer(tools, tmp_path, prefix, cmake_dir, installed.version, "3", "128")


def test_pkg_config_consumer(installed: Installed, tmp_path: Path):
    prefix = _relocated_prefix(installed, tmp_path / "relocated-prefix")
    libdir = prefix / installed.libdir.relative_to(installed.prefix)
    _pkg_config_consumer(tmp_path, libdir / "pkgconfig", prefix / "include", libdir,
                         installed.version)


# ---- The Python package ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def python_package() -> Path:
    """The folder of the imported fp8kturbov package, when it was installed from a wheel (which
    carries the CMake package and the .pc file under fp8kturbov/lib/)."""
    try:
        import fp8kturbov
    except ImportError as exc:
        pytest.skip(f"fp8kturbov not importable: {exc}")
    package = Path(fp8kturbov.__file__).resolve().parent
    if not (package / "lib" / "cmake" / "fp8kturbov" / "fp8kturbovConfig.cmake").is_file():
        pytest.skip(f"{package} holds no lib/cmake/fp8kturbov (not installed from a wheel)")
    return package


def test_python_package_find_package(tools: Tools, python_package: Path, tmp_path: Path):
    """-DCMAKE_PREFIX_PATH=<site-packages>/fp8kturbov finds the library inside the package."""
    _find_package_consumer(tools, tmp_path, python_package,
                           python_package / "lib" / "cmake" / "fp8kturbov", _project_version(),
                           None, None)


def test_python_package_pkg_config(python_package: Path, tmp_path: Path):
    _pkg_config_consumer(tmp_path, python_package / "lib" / "pkgconfig",
                         python_package / "include", python_package, _project_version())


# ---- examples/c ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example(tools: Tools, installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/c built against the installed prefix; skips without the CUDA toolkit."""
    build = tmp_path_factory.mktemp("example-build")
    cmd = [tools.cmake, "-S", EXAMPLE, "-B", build, *tools.generator,
           f"-DCMAKE_PREFIX_PATH={installed.prefix}", "-DCMAKE_BUILD_TYPE=Release"]
    configured = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                                timeout=CONFIGURE_TIMEOUT_S)
    if configured.returncode != 0 and "Could NOT find CUDAToolkit" in (
            configured.stdout + configured.stderr):
        pytest.skip("examples/c needs the CUDA toolkit (FindCUDAToolkit found none)")
    assert configured.returncode == 0, configured.stdout + configured.stderr
    tools.build(build)
    exe = build / "fp8kturbov_example"
    assert exe.is_file()
    return exe


def test_example_builds(example: Path):
    check_example_without_gpu_contract(example)


@pytest.mark.gpu
def test_example_runs_on_gpu(example: Path):
    ran = subprocess.run([str(example)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, f"exit {ran.returncode}\n{ran.stdout}{ran.stderr}"
    assert ran.stdout.rstrip().endswith("PASSED"), ran.stdout

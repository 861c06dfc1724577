"""The contract of the example programs (C and Rust) on a machine without a GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

SKIPPED_EXIT = 77  # the automake convention for a skipped test


def check_example_without_gpu_contract(example: Path) -> None:
    """Without a GPU an example says so and exits 77 (with one it runs: the gpu tests); a bad
    argument gets its usage and exit status 2."""
    ran = subprocess.run([str(example)], capture_output=True, text=True, timeout=300)
    assert ran.returncode in (0, SKIPPED_EXIT), ran.stdout + ran.stderr
    if ran.returncode == SKIPPED_EXIT:
        assert "SKIPPED: no usable CUDA GPU" in ran.stdout, ran.stdout
    usage = subprocess.run([str(example), "9"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr

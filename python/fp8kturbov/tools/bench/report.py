"""The run's report: its context (`describe_device`: GPU, driver, versions, the library's build commit), the text tables
of the rows (decode and write; prefill: `prefill_rows`) and their energy (`format_report`), and the roofline plot
(`write_plot`)."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from fp8kturbov import version
from fp8kturbov._lib import build_commit, cuda_runtime_version
from fp8kturbov._device import Device, cu, driver_call

from ..console import format_number, format_table
from .config import BANDWIDTH_OPS, OPS, Config, floor_us, gbps
from .prefill_peers import BF16_PREFILL_PEERS, ROUND_TRIP_PEERS
from .rows import context_line
from .timing import GRAPH_CHAIN

#: The peers' names in the report's column headers, in `peers.PEERS` order.
PEER_LABELS = {"bf16_sdpa": "bf16 sdpa", "fp8_sdpa": "fp8 sdpa", "fp8_flashinfer": "flashinfer fp8",
               "fp8_xqa": "xqa fp8", "bf16_xqa": "xqa bf16"}


def _module_version(name: str) -> str | None:
    """The version of the installed distribution that provides the import package ``name`` (whose
    name may differ: flashinfer comes as ``flashinfer-python``), or None where none does."""
    for distribution in importlib.metadata.packages_distributions().get(name, [name]):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _command_output(*command: str) -> str | None:
    """The first line a command prints, or None where it is missing or fails."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def describe_device(dev: Device) -> dict[str, Any]:
    """The run's context: GPU, driver, software versions, commit and date (schema: `rows.write_json`)."""
    cuda_version = driver_call(cu.cuDriverGetVersion)
    return {
        "name": dev.name,
        "driver": _command_output("nvidia-smi", f"--id={dev.ordinal}", "--query-gpu=driver_version",
                                  "--format=csv,noheader"),
        "cuda_driver_api": f"{cuda_version // 1000}.{cuda_version % 1000 // 10}",
        "memory_bytes": dev.memory()[1],
        "l2_bytes": dev.attribute("L2_CACHE_SIZE"),
        "sm_count": dev.attribute("MULTIPROCESSOR_COUNT"),
        "timing_gate": dev.gated,
        "library_version": version(),
        "library_cuda_runtime": cuda_runtime_version(),
        "commit": build_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": _module_version("torch"),
        "flashinfer": _module_version("flashinfer"),
    }


def _peer_cell(peer: dict[str, Any] | None) -> str:
    if peer is None:
        return "-"
    if peer["status"] == "ok":
        return format_number(peer["median_us"], 2)
    return peer["status"].split(":", 1)[0]  # the reason is listed under the table


TABLE_COLUMNS = ("op", "bits", "shape", "D", "us", "GB/s", "% ceil", "floor us", "read us", "in-graph us",
                 *(f"{label} us" for label in PEER_LABELS.values()), "vs best fp8", "note")


def table_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The cells of the decode and write rows, in `TABLE_COLUMNS` order."""
    return [(row["op"] if row.get("append") in (None, "none") else f"{row['op']}+{row['append']}",
             str(row["bits"]), row["shape"], str(row["head_dim"]),
             format_number(row["median_us"], 2), format_number(row["gbps"], 0),
             format_number(row["pct_of_ceiling"]), format_number(row["floor_us"], 2),
             format_number(row["plain_read_us"], 2), format_number(row["in_graph_us"], 2),
             *(_peer_cell(row["peers"].get(name)) for name in PEER_LABELS),
             _times(row.get("vs_best_fp8")), row["note"].split(":", 1)[0])
            for row in rows if row["op"] in BANDWIDTH_OPS]


def _times(ratio: float | None) -> str:
    """A peer's time over a row's, ``"1.50x"``; ``"-"`` where there is none."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def _fastest_cell(row: dict[str, Any], best: str | None, names: Sequence[str]) -> str:
    """The time of the fastest of a pair of peers, with its flashinfer backend (``"812.40 fa3"``);
    where neither ran, the first one's status (`_peer_cell`)."""
    if best is None:
        return _peer_cell(row["peers"].get(names[0]))
    return f"{format_number(row['peers'][best]['median_us'], 2)} {best.rsplit('_', 1)[1]}"


PREFILL_COLUMNS = ("op", "bits", "shape", "chunk", "D", "us", "in-graph us", "TFLOP/s", "MB", "bf16 prefill us",
                   "dequant+bf16 us", "vs round trip", "vs bf16 alone", "note")


def prefill_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The cells of the prefill rows, in `PREFILL_COLUMNS` order: ours, the faster of flashinfer's
    BF16 prefills and of the round trips (`prefill_peers`), each one's time over ours."""
    return [(row["op"], str(row["bits"]), row["shape"], str(row["q_len"]), str(row["head_dim"]),
             format_number(row["median_us"], 2), format_number(row["in_graph_us"], 2),
             format_number(row["tflops"]), format_number(row["bytes"] / 1e6),
             _fastest_cell(row, row["best_bf16_prefill_peer"], BF16_PREFILL_PEERS),
             _fastest_cell(row, row["best_round_trip_peer"], ROUND_TRIP_PEERS),
             _times(row["vs_round_trip"]), _times(row["vs_bf16_prefill"]), row["note"].split(":", 1)[0])
            for row in rows if row["op"] == "prefill"]


def _shape_cell(row: dict[str, Any]) -> str:
    """A row's shape, and a prefill's chunk: ``"1x8192 chunk 512"``."""
    return f"{row['shape']} chunk {row['q_len']}" if row["op"] == "prefill" else row["shape"]


def _energy_cell(result: dict[str, Any] | None) -> str:
    """``"mJ (W)"`` of a row or peer whose power was measured, else ``"-"``."""
    if result is None or result.get("power_w") is None:
        return "-"
    return f"{format_number(result['energy_mj'])} ({result['power_w']:.0f})"


ENERGY_COLUMNS = ("op", "bits", "shape", "D", "mJ (W)", *(f"{label} mJ (W)" for label in PEER_LABELS.values()))


def energy_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The cells of the case rows whose power was measured (or a peer's), in `ENERGY_COLUMNS` order."""
    return [(row["op"], str(row["bits"]), _shape_cell(row), str(row["head_dim"]), _energy_cell(row),
             *(_energy_cell(row["peers"].get(name)) for name in PEER_LABELS))
            for row in rows if row["op"] in OPS and
            any(r.get("power_w") is not None for r in (row, *row["peers"].values()))]


def format_report(rows: Sequence[dict[str, Any]], device: dict[str, Any], config: Config) -> str:
    """The table, why any cell is empty, the ceiling and launch-floor lines, the parameters and
    the run's context (commit, GPU, driver, date)."""
    by_op = {row["op"]: row for row in rows}
    bandwidth, prefill = table_rows(rows), prefill_rows(rows)
    lines = [format_table(bandwidth, TABLE_COLUMNS), ""] if bandwidth or not prefill else []
    if prefill:
        lines += [format_table(prefill, PREFILL_COLUMNS), ""]
    lines += _reasons(rows)
    energy = energy_rows(rows)
    if energy:
        lines += [f"energy per launch, mJ (the board's mean power, W, over about {config.power_window_s:g} s of "
                  f"back-to-back launches: ours in graphs of {GRAPH_CHAIN}, the peers one per graph replay):",
                  format_table(energy, ENERGY_COLUMNS), ""]
    elif config.power_window_s > 0:
        lines.append("power not measured: NVML's energy counter was not available or did not move")
    if "read" in by_op:
        read = by_op["read"]
        lines.append(f"read bandwidth: {format_number(read['gbps'], 0)} GB/s ({read['shape']}, median "
                     f"of {read['samples']}): the ceiling of '% ceil' and 'floor us'; its kernel over a row's "
                     "bytes, one launch per graph replay, the row's 'read us'")
    if "copy" in by_op:
        copy = by_op["copy"]
        lines.append(f"copy bandwidth (read+write): {format_number(copy['gbps'], 0)} GB/s "
                     f"({copy['shape']}, median of {copy['samples']})")
    if "launch" in by_op:
        launch = by_op["launch"]
        lines.append(f"launch floor: {format_number(launch['median_us'], 2)} us ({launch['shape']}); "
                     f"in a graph of {GRAPH_CHAIN} launches {format_number(launch['in_graph_us'], 2)} us "
                     "per launch, the 'in-graph us' of the rows")
    if prefill:
        lines.append(PREFILL_LEGEND)
    lines.append(f"q_heads {config.num_q_heads}, kv_heads {config.num_kv_heads}, block_size "
                 f"{config.block_size}, sparse V threshold {config.sparse_v_threshold:g}, "
                 f"{'checked mode' if config.checked else 'unchecked'}{_options_text(config)}; "
                 f"median of {config.iters} graph replays rotating {config.sets} input sets; "
                 "L2: all sets fit in L2 together; sets N %: the sets' own medians N % apart; "
                 "power cap / thermal N %: that limit held the GPU's clocks down for N % of the row's timing")
    if "read" in by_op and by_op["read"].get("clock_limited") is None:
        lines.append("clock limits not known: NVML's counters were not available")
    if not device.get("timing_gate", True):
        lines.append("timing gate unsupported by this driver: short launches include host time")
    lines.append(context_line(device))
    return "\n".join(lines)


#: What the prefill table's columns are.
PREFILL_LEGEND = (
    "prefill: each sequence's chunk of N query tokens (the last N of its context, written before the timing) "
    "attends its context causally; TFLOP/s: 4 x q_heads x head_dim per (token, attended position), the "
    "causal triangle exact; MB: the bytes the format obliges the launch to move (the context's cache bytes "
    "once, q, the output, the table); bf16 prefill: flashinfer's paged prefill (causal) over a BF16 cache "
    "of as many tokens; dequant+bf16: the library's dequantize of the context into BF16 pages, then that "
    "prefill, in one graph; each the faster of flashinfer's fa2 and fa3 backends (named beside the time); "
    "vs: that time over ours (> 1: ours faster)")


def _options_text(config: Config) -> str:
    """The options that are on, for the report (nothing when all are off)."""
    on = ([f"V encoder {config.v_encoder}"] if config.v_encoder != "matched_norm" else []) + \
         ([f"soft cap {config.soft_cap:g}"] if config.soft_cap else []) + (["sinks"] if config.sinks else []) + \
         ([f"V rotation {config.v_rotation}"] if config.v_rotation != "none" else [])
    if config.lengths == "ramp":
        on.append("sequence i of B holding ceil(context * (i + 1) / B) tokens"
                  + (" (dense peers not run: one length per batch)" if config.peers else ""))
    if config.table_positions:
        on.append(f"block-table rows of {config.table_positions} positions, "
                  + ("passed whole (the plan sized for them)" if config.whole_table_rows
                     else "passed as a column slice (block_tables_stride)"))
    if config.q_len > 1:
        on.append(f"{config.q_len} query tokens per sequence"
                  + (" (peers not run: they decode one)" if config.peers else ""))
    return "".join(f", {text}" for text in on)


def _reasons(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Why table cells are empty: skipped cases, and peers skipped or failed (once per shape,
    as the peers' results repeat over the bits)."""
    found = []
    for row in rows:
        where = f"{row['op']} {_shape_cell(row)} D{row['head_dim']}"
        if row["note"].startswith("skipped"):
            found.append(f"{where} {row['bits']}b: {row['note']}")
        found += [f"{where} {name}: {peer['status']}" for name, peer in row["peers"].items()
                  if ":" in peer["status"]]
    return list(dict.fromkeys(found))


def write_plot(path: str | Path, rows: Sequence[dict[str, Any]]) -> str | None:
    """A roofline-style PNG: bytes per launch (log x) against achieved GB/s (log y), one marker
    series per op/bits/head_dim with each point named by its shape, peers as separate markers,
    the plain read of each point's bytes (where measured) as a dash, the ceiling as a horizontal
    line and the ceiling-plus-launch-floor curve. Returns None when
    written, else why it was not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the package's [plot] extra)"
    by_op = {row["op"]: row for row in rows}
    cases = [row for row in rows if row["op"] in BANDWIDTH_OPS and row["gbps"] is not None]
    if "read" not in by_op or not cases:
        return "no measured cases to plot"
    ceiling = by_op["read"]["gbps"]
    figure, axes = plt.subplots(figsize=(9, 6))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in cases:
        series.setdefault(f"{row['op']} {row['bits']}b D{row['head_dim']}", []).append(row)
    for label, members in series.items():
        axes.plot([r["bytes"] for r in members], [r["gbps"] for r in members], "o", label=label)
        for r in members:  # shapes of equal bytes differ in speed: name each point
            axes.annotate(r["shape"], (r["bytes"], r["gbps"]), fontsize=6, xytext=(3, 3),
                          textcoords="offset points")
    plotted = list(cases)
    for name, marker in zip(PEER_LABELS, ("x", "s", "^")):
        peers = [row["peers"][name] for row in cases
                 if row["peers"].get(name, {}).get("status") == "ok"]
        if peers:
            axes.scatter([p["bytes"] for p in peers], [p["gbps"] for p in peers], marker=marker,
                         s=60, color="black", label=f"peer {name}", zorder=3)
        plotted += peers
    reads = [r for r in plotted if r.get("plain_read_us")]
    if reads:
        axes.scatter([r["bytes"] for r in reads], [gbps(r["bytes"], r["plain_read_us"]) for r in reads],
                     marker="_", s=120, color="gray", label="plain read of the same bytes", zorder=2)
    axes.axhline(ceiling, color="red", linestyle="--", label=f"read ceiling {ceiling:.0f} GB/s")
    if "launch" in by_op:
        launch_us = by_op["launch"]["median_us"]
        xs = np.logspace(np.log10(min(r["bytes"] for r in plotted)),
                         np.log10(max(r["bytes"] for r in plotted)), 200)
        axes.plot(xs, [gbps(x, floor_us(x, ceiling) + launch_us) for x in xs], ":", color="gray",
                  label=f"ceiling + launch floor {launch_us:.1f} us")
    axes.set(xscale="log", yscale="log", xlabel="bytes moved per launch",
             ylabel="achieved GB/s (1e9 B/s)", title="fp8kturbov: decode and write vs read ceiling")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None

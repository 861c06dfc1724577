"""What a run returns: one `Result` per row (the ceiling, the copy, the launch floor, the cases),
the numbers of a timing (`measured`), and the JSON document that holds them (`write_json`,
`BENCH_SCHEMA`, the run's context in one line: `context_line`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .config import Config, Shape, floor_us, gbps, launch_bytes, prefill_flops
from .power import clock_limit_note, energy_mj
from .timing import Timing

#: The ``"schema"`` of the JSON that `write_json` writes.
BENCH_SCHEMA = "fp8kturbov-bench/1"
#: `Shape` fields that do not apply to a write row: null in its `Result`.
WRITE_UNSET_FIELDS = ("context", "q_len", "lengths", "table_positions", "whole_table_rows", "append")


def measured(nbytes: int, timing: Timing, ceiling_gbps: float) -> dict[str, Any]:
    """The numbers of ``timing`` for a launch moving ``nbytes``: times (µs), GB/s, % of ceiling,
    and where measured the mean power (W) and the energy per launch (mJ)."""
    achieved = gbps(nbytes, timing.median_us)
    return {"bytes": nbytes, "median_us": timing.median_us, "min_us": timing.min_us,
            "samples": timing.samples, "set_medians_us": list(timing.set_medians_us), "gbps": achieved,
            "pct_of_ceiling": 100.0 * achieved / ceiling_gbps, "power_w": timing.power_w,
            "energy_mj": energy_mj(timing.power_w, timing.median_us)}


@dataclass
class Result:
    """One output row; `run.run_benchmarks` returns these as dicts (schema: `write_json`)."""

    op: str
    shape: str
    bits: int | None = None
    batch: int | None = None
    context: int | None = None
    head_dim: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    block_size: int | None = None
    q_len: int | None = None
    lengths: str | None = None
    table_positions: int | None = None
    whole_table_rows: bool | None = None
    append: str | None = None
    bytes: int = 0
    median_us: float | None = None
    min_us: float | None = None
    samples: int = 0
    set_medians_us: list[float] = field(default_factory=list)
    gbps: float | None = None
    pct_of_ceiling: float | None = None
    floor_us: float | None = None
    plain_read_us: float | None = None  # the ceiling's read kernel over its bytes (`timing.time_plain_read`)
    in_graph_us: float | None = None  # per launch, GRAPH_CHAIN of them in one graph (median)
    clock_limited: dict[str, float] | None = None  # see `power.clock_limits_held`; None: not known
    power_w: float | None = None  # mean board power, W (`power.mean_power_w`); None: not measured
    energy_mj: float | None = None  # per launch, mJ: power_w over in_graph_us (measured in a graph)
    note: str = ""
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)
    best_fp8_peer: str | None = None  # the fastest FP8 peer of the row (`peers.best_fp8_peer`)
    vs_best_fp8: float | None = None  # its median over the row's: > 1 where the row is faster
    flops: int | None = None  # prefill: floating-point operations per launch (`config.prefill_flops`)
    tflops: float | None = None  # prefill: flops / median, 1e12 per second
    best_bf16_prefill_peer: str | None = None  # prefill: the faster BF16 prefill peer (`prefill_peers`)
    vs_bf16_prefill: float | None = None  # its median over the row's
    best_round_trip_peer: str | None = None  # prefill: the faster dequantize + BF16 prefill peer
    vs_round_trip: float | None = None  # its median over the row's

    @classmethod
    def for_shape(cls, shape: Shape) -> Result:
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(Shape)}
        if shape.op == "write":
            fields.update(dict.fromkeys(WRITE_UNSET_FIELDS))
        flops = prefill_flops(shape) if shape.op == "prefill" else None
        return cls(shape=shape.label, bytes=launch_bytes(shape), flops=flops, **fields)

    def record(self, timing: Timing, ceiling_gbps: float) -> None:
        for name, value in measured(self.bytes, timing, ceiling_gbps).items():
            setattr(self, name, value)
        self.floor_us = floor_us(self.bytes, ceiling_gbps)
        if self.flops is not None:
            self.tflops = self.flops / timing.median_us / 1e6

    def mark_clock_limits(self, shares: dict[str, float]) -> None:
        """Keep the shares of `power.clock_limits_held` (None where not known) and add the note of those
        above `power.CLOCK_LIMIT_NOTE` to the row's."""
        self.clock_limited = shares or None
        self.note = ", ".join(filter(None, [self.note, clock_limit_note(shares)]))


def context_line(device: dict[str, Any]) -> str:
    """The run's context (`report.describe_device`) in one line: commit, GPU, driver and date."""
    return (f"commit {device.get('commit') or 'unknown'} | {device.get('name')} | driver "
            f"{device.get('driver') or 'unknown'} (CUDA {device.get('cuda_driver_api')}) | "
            f"{device.get('date')}")


def write_json(path: str | Path, rows: Sequence[dict[str, Any]], device: dict[str, Any],
               config: Config) -> None:
    """Write every number of a run to ``path`` as JSON.

    Schema (``"schema": "fp8kturbov-bench/1"``)::

        {"schema": str,
         "device": {"name": str, "driver": str|null, "cuda_driver_api": "13.0",
                    "memory_bytes": int, "l2_bytes": int, "sm_count": int,
                    "timing_gate": bool, "library_version": str,
                    "library_cuda_runtime": "12.4"  the CUDA runtime the library was built with,
                    "commit": str|null  the source commit the library was built from,
                    "date": ISO 8601 UTC, "python": str, "torch": str|null,
                    "flashinfer": str|null},
         "config": the `Config` fields,
         "rows": [{"op": "read"|"copy"|"launch"|"decode"|"write"|"prefill",
                   "shape": "8x8192" | "128 tok" | description,
                   "bits", "batch", "context", "head_dim", "num_q_heads", "num_kv_heads",
                   "block_size", "q_len": int|null  (null where not applicable; for write,
                                           "batch" is the token rows written, "context" and
                                           "q_len" are null; "q_len": query tokens per
                                           sequence of the decode, the chunk of the prefill:
                                           the last q_len of each sequence's context tokens),
                   "lengths": "equal"|"ramp"|null  the decode's sequence lengths (LENGTHS),
                   "table_positions": int|null  the decode's block-table row width in
                                           positions, 0 for rows of the context's pages,
                   "whole_table_rows": bool|null  whether the decode planned for the whole
                                           rows (else they were a column slice),
                   "append": "none"|"fused"|"write"|null  how the decode's step wrote its new
                                           tokens first (APPENDS; their bytes are counted),
                   "bytes": int            bytes the launch must move (see launch_bytes),
                   "median_us", "min_us": float|null  per launch, µs (null: skipped),
                   "samples": int,
                   "set_medians_us": [float]  per launch, the median of each input set's samples
                                           (sample i is of set i mod sets), µs ([] where skipped),
                   "gbps": float|null      bytes / median, 1e9 B/s,
                   "pct_of_ceiling": float|null,
                   "floor_us": float|null  bytes / ceiling, µs,
                   "in_graph_us": float|null  per launch, median over replays of one graph of
                                           GRAPH_CHAIN (32) launches back to back, µs,
                   "clock_limited": {"power cap": float, "thermal": float}|null  the share
                                           (0 to 1) of the row's timing (both kinds of
                                           launch, host time included) during which that limit
                                           held the GPU's clocks down, from NVML's counters
                                           (null: not available, or skipped),
                   "power_w": float|null   the board's mean power, W, over about
                                           Config.power_window_s of the row's launches back to
                                           back in graphs of GRAPH_CHAIN (null: not measured),
                   "energy_mj": float|null  per launch, mJ: power_w x in_graph_us,
                   "note": "" or, joined by ", ": "L2", "sets <N> %", "power cap <N> %",
                           "thermal <N> %" (a limit's share above 1 %); or "skipped: <why>",
                   "peers": {"bf16_sdpa"|"fp8_sdpa"|"fp8_flashinfer"|"fp8_xqa"|"bf16_xqa" (decode),
                             "bf16_fa2"|"bf16_fa3"|"dequant_bf16_fa2"|"dequant_bf16_fa3" (prefill):
                             {"status": "ok"|"absent"|
                             "skipped: <why>"|"error: <why>", and when "ok": "bytes",
                             "median_us", "min_us", "samples", "set_medians_us", "gbps",
                             "pct_of_ceiling", "clock_limited", "power_w" (over its graph replays,
                             one launch each), "energy_mj" (power_w x median_us)}},
                   "best_fp8_peer": "fp8_sdpa"|"fp8_flashinfer"|"fp8_xqa"|null  the fastest FP8
                                           peer that ran,
                   "vs_best_fp8": float|null  its median_us over the row's (> 1: the row is
                                           faster),
                   "flops": int|null       a prefill's floating-point operations per launch,
                                           4 x num_q_heads x head_dim per (query token,
                                           attended position), the causal triangle exact,
                   "tflops": float|null    flops / median, 1e12 per second,
                   "best_bf16_prefill_peer": "bf16_fa2"|"bf16_fa3"|null  the faster flashinfer
                                           BF16 prefill that ran, "vs_bf16_prefill": float|null
                                           its median_us over the row's,
                   "best_round_trip_peer": "dequant_bf16_fa2"|"dequant_bf16_fa3"|null  the faster
                                           dequantize + BF16 prefill that ran,
                                           "vs_round_trip": float|null  its median_us over the
                                           row's}]}

    The first row is the ceiling (``op == "read"``), the second the copy, the third the launch
    floor.
    """
    document = {"schema": BENCH_SCHEMA, "device": device,
                "config": dataclasses.asdict(config), "rows": list(rows)}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")

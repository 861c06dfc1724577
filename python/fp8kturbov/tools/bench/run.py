"""A benchmark run tied together: the ceiling and the launch floor, then each case's launches timed
(`record_launches`) with its plain read (decode) and its peers (decode, prefill) (`run_benchmarks`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from fp8kturbov._device import BenchError, Device

from ..console import GiB, progress
from . import kernels, launches, peers, prefill_peers, timing
from .config import Config, Shape, build_cases, device_bytes, fits_in_l2, fits_in_memory, gbps
from .launches import Chunk
from .nvml import NvmlCounters
from .power import PowerProbe, clock_limits_held, energy_mj, mean_power_w
from .rows import Result

COPY_ITERS, COPY_WARMUP = 30, 3  # timed and warm-up runs of the ceiling's read and copy

# A row whose input sets' medians are further apart than this is marked: its median is then mostly
# one set's time, and moves between runs with the sets.
SET_SPREAD_NOTE = 0.05


def measure_ceiling(dev: Device, config: Config, counters: NvmlCounters | None = None) -> tuple[Result, Result]:
    """The ceiling, a read of ``config.ceiling_bytes`` by the bench's read kernel (bytes read), and
    beside it a DtoD copy of as many bytes (bytes read plus bytes written): ``(read, copy)``, each
    marked where a clock limit held (``counters``; see `clock_limits_held`)."""
    n = config.ceiling_bytes
    read = Result(op="read", shape=f"{n / GiB:g} GiB read", bytes=n)
    copy = Result(op="copy", shape=f"{n / GiB:g} GiB DtoD", bytes=2 * n)
    free, _ = dev.memory()
    if not fits_in_memory(2 * n, free):
        raise BenchError(f"the ceiling needs 2 x {n / GiB:g} GiB, {free / GiB:.1f} GiB free")
    with dev.scope():
        src, dst, sink = dev.alloc(n), dev.alloc(n), dev.alloc(4)
        dev.memset(src, 1, n)  # touch both buffers before timing
        dev.memset(dst, 0, n)
        read_once = timing.read_enqueue(dev, src, n, sink)
        with clock_limits_held(counters) as held:
            timed = timing.time_launches(dev, [read_once], COPY_ITERS, COPY_WARMUP)
        read.record(timed, gbps(read.bytes, timed.median_us))
        read.mark_clock_limits(held)
        with clock_limits_held(counters) as held:
            timed = timing.time_launches(dev, [functools.partial(dev.copy, dst, src, n)], COPY_ITERS, COPY_WARMUP)
        copy.record(timed, read.gbps)
        copy.mark_clock_limits(held)
    return read, copy


def record_launches(result: Result, dev: Device, enqueues: Sequence[Callable[[], None]],
                    config: Config, ceiling_gbps: float, counters: NvmlCounters | None = None,
                    power: PowerProbe | None = None) -> None:
    """Time ``enqueues`` (one per input set) one launch per graph replay, the row's times, and
    `timing.GRAPH_CHAIN` launches per graph, its ``in_graph_us``. Marks a row whose sets' medians are
    more than `SET_SPREAD_NOTE` apart ("sets N %"), and one during whose timing a clock limit held
    (``counters``; `Result.mark_clock_limits`). With ``power``, then the row's mean power and
    energy per launch."""
    with clock_limits_held(counters) as held:
        timed = timing.time_graphs(dev, enqueues, config.iters, config.warmup)
        chain = timing.time_graph_chain(dev, enqueues, max(1, config.iters // 4), min(config.warmup, 2))
    result.record(timed, ceiling_gbps)
    if timed.set_spread() > SET_SPREAD_NOTE:
        result.note = f"sets {100 * timed.set_spread():.0f} %"
    result.in_graph_us = chain.median_us
    result.mark_clock_limits(held)
    if power is not None:  # over replays of a chain graph: single launches would leave the GPU gaps
        replay = functools.partial(dev.launch, timing.chain_graph(dev, enqueues))
        result.power_w = mean_power_w(dev, replay, timing.GRAPH_CHAIN * result.in_graph_us, power)
        result.energy_mj = energy_mj(result.power_w, result.in_graph_us)


def measure_launch_floor(dev: Device, config: Config, ceiling_gbps: float,
                         counters: NvmlCounters | None = None) -> Result:
    """The launch floor: one empty kernel, timed like the library's launches."""
    result = Result(op="launch", shape="empty-kernel graph", bytes=0)
    with dev.scope():
        record_launches(result, dev, [functools.partial(kernels.empty, int(dev.stream))], config,
                        ceiling_gbps, counters)
    return result


class _Runner:
    """State shared by the cases of one run: the ceiling, NVML's counters (None: not available),
    the power probe (None: power not measured), encoded chunks, peer results."""

    def __init__(self, dev: Device, config: Config, ceiling_gbps: float,
                 counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> None:
        self.dev, self.config, self.ceiling, self.counters = dev, config, ceiling_gbps, counters
        self.power = power
        self.rng = np.random.default_rng(config.seed)
        self.l2_bytes = dev.attribute("L2_CACHE_SIZE")
        self._chunks: dict[tuple[int, ...], Chunk] = {}
        self._peers: dict[Shape, dict[str, dict[str, Any]]] = {}
        self._prefill_peers: dict[tuple[str, Shape], dict[str, Any]] = {}
        self._plain_reads: dict[int, float | None] = {}

    def plain_read_us(self, nbytes: int) -> float | None:
        """`timing.time_plain_read` of ``nbytes``, once per byte count of the run."""
        if nbytes not in self._plain_reads:
            self._plain_reads[nbytes] = timing.time_plain_read(self.dev, nbytes, self.config)
        return self._plain_reads[nbytes]

    def chunk(self, shape: Shape) -> Chunk:
        key = (shape.bits, shape.head_dim, shape.num_kv_heads, shape.block_size)  # the chunk depends on the layout only
        if key not in self._chunks:
            self._chunks[key] = launches.encode_chunk(shape, self.config.chunk_tokens, self.rng)
        return self._chunks[key]

    def case(self, shape: Shape) -> Result:
        result = Result.for_shape(shape)
        needed, (free, _) = device_bytes(shape, self.config.sets), self.dev.memory()
        if not fits_in_memory(needed, free):
            result.note = f"skipped: needs {needed / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
            return result
        with self.dev.scope():
            if shape.op == "decode":
                enqueues = launches.decode_enqueues(self.dev, shape, self.config, self.chunk(shape), self.rng)
            elif shape.op == "prefill":
                enqueues = launches.prefill_enqueues(self.dev, shape, self.config, self.chunk(shape), self.rng)
            else:
                enqueues = launches.write_enqueues(self.dev, shape, self.config, self.rng)
            record_launches(result, self.dev, enqueues, self.config, self.ceiling, self.counters, self.power)
        if fits_in_l2(result.bytes, self.config.sets, self.l2_bytes):
            result.note = ", ".join(filter(None, ["L2", result.note]))
        if shape.op == "decode":
            result.plain_read_us = self.plain_read_us(result.bytes)
            if self.config.peers and shape.q_len == 1 and shape.append == "none":  # peers decode alone
                result.peers = self.peer_results(shape)
                result.best_fp8_peer, result.vs_best_fp8 = _against(result, peers.FP8_PEERS)
        if shape.op == "prefill" and self.config.peers:
            result.peers = self.prefill_peer_results(shape)
            result.best_bf16_prefill_peer, result.vs_bf16_prefill = _against(result, prefill_peers.BF16_PREFILL_PEERS)
            result.best_round_trip_peer, result.vs_round_trip = _against(result, prefill_peers.ROUND_TRIP_PEERS)
        return result

    def peer_results(self, shape: Shape) -> dict[str, dict[str, Any]]:
        """`peers.run_peer` of every peer for ``shape``, once per shape whatever the V bits."""
        key = dataclasses.replace(shape, bits=0)  # peers do not depend on the V bits
        if key not in self._peers:
            results = {name: peers.run_peer(name, self.dev, shape, self.config, self.ceiling, self.counters,
                                            self.power)
                       for name in peers.PEERS}
            for peer in results.values():
                if peer["status"] == "ok":
                    peer["plain_read_us"] = self.plain_read_us(peer["bytes"])
            self._peers[key] = results
        return self._peers[key]

    def prefill_peer_results(self, shape: Shape) -> dict[str, dict[str, Any]]:
        """`prefill_peers.run_peer` of every prefill peer for ``shape``: the round trip's once per
        case, the BF16 prefill's once per shape and chunk whatever the V bits."""
        results = {}
        for name in prefill_peers.PEERS:
            key = (name, shape if name in prefill_peers.ROUND_TRIP_PEERS else dataclasses.replace(shape, bits=0))
            if key not in self._prefill_peers:
                self._prefill_peers[key] = prefill_peers.run_peer(
                    name, self.dev, shape, self.config, self.chunk(shape), self.ceiling, self.counters, self.power)
            results[name] = self._prefill_peers[key]
        return results


def _against(result: Result, names: Sequence[str]) -> tuple[str | None, float | None]:
    """The fastest of the peers ``names`` that ran for ``result`` (`peers.fastest_peer`) and its
    median over the row's (> 1 where the row is faster); (None, None) where none ran or the row
    was not measured."""
    best = peers.fastest_peer(result.peers, names)
    if best is None or not result.median_us:
        return None, None
    return best[0], best[1] / result.median_us


def run_benchmarks(config: Config, *, device: Device | None = None,
                   show_progress: bool = True) -> list[dict[str, Any]]:
    """Measure the ceiling, the launch floor and every case of ``config``.

    Returns one dict per row (schema: `rows.write_json`): first ``op == "read"`` (the ceiling), then
    ``op == "copy"`` and ``op == "launch"`` (the launch floor), then the cases in `build_cases`
    order. ``device``: an open `Device` to use; by default one is opened on GPU 0 and closed at
    the end.
    """
    cases = build_cases(config)
    dev = device if device is not None else Device()
    counters = None
    try:
        counters = NvmlCounters.open(dev.pci_bus_id)
        read, copy = measure_ceiling(dev, config, counters)
        rows = [read, copy, measure_launch_floor(dev, config, read.gbps, counters)]
        power = None
        if counters is not None and config.power_window_s > 0:
            power = PowerProbe(counters, config.power_window_s)
        runner = _Runner(dev, config, read.gbps, counters, power)
        rows += [runner.case(shape) for shape in progress(cases, Shape.describe, show_progress)]
    finally:
        if counters is not None:
            counters.close()
        if device is None:
            dev.close()
    return [dataclasses.asdict(row) for row in rows]

"""The benchmark harness: its GPU-free parts here, and one tiny end-to-end run on a GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import fp8kturbov
import fp8kturbov.tools.bench.config
import fp8kturbov.tools.bench.launches
import fp8kturbov.tools.bench.peers
import fp8kturbov.tools.bench.power
import fp8kturbov.tools.bench.report
import fp8kturbov.tools.bench.rows
import fp8kturbov.tools.bench.run
import fp8kturbov.tools.bench.timing
from fp8kturbov._device import BenchError, Device
from fp8kturbov.tools import bench, cli, console
from fp8kturbov.tools.bench import kernels
from fp8kturbov.tools.bench.nvml import NvmlCounters
from fp8kturbov.tools.cli import build_parser, config_from_args, main

D128_3BIT = bench.config.Shape("decode", 3, 1, 32768, 128, 32, 8, 16)


# ---- Parsing and configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [("32768", 32768), ("32k", 32768), (" 8K ", 8192), ("1", 1)])
def test_parse_count(text, want):
    assert bench.config.parse_count(text) == want


@pytest.mark.parametrize("text", ["0", "-1", "x", "1.5", "", "k", "2m"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError, match="not a positive integer"):
        bench.config.parse_count(text)


@pytest.mark.parametrize("text, want", [("1", 1), ("4", 4), ("16", 16)])
def test_parse_q_len(text, want):
    assert bench.config.parse_q_len(text) == want


@pytest.mark.parametrize("text, message", [("0", "not a positive integer"),
                                           ("17", "more than 16 query tokens"),
                                           ("1k", "more than 16 query tokens")])
def test_parse_q_len_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        bench.config.parse_q_len(text)


def test_parse_shapes_and_counts():
    assert bench.config.parse_shapes("1x32768,8x8k") == ((1, 32768), (8, 8192))
    assert bench.config.parse_shapes("128X2048") == ((128, 2048),)
    assert bench.config.parse_counts("128,256") == (128, 256)
    for bad in ("1", "1x2x3", "8x", "x8", "1x32768,"):
        with pytest.raises(ValueError):
            bench.config.parse_shapes(bad)


def test_default_config_is_the_issue_table():
    config = bench.config.Config()
    assert set(config.shapes) == {(1, 32768), (1, 131072), (8, 8192), (32, 8192), (128, 2048),
                                  (32, 32768), (1, 1024), (8, 4096)}
    assert config.tokens == (1, 16, 128, 32768)
    assert (config.num_q_heads, config.num_kv_heads, config.block_size) == (32, 8, 16)
    assert config.bits == (2, 3, 4) and config.head_dims == (128,)
    assert config.ceiling_bytes >= 2 * console.GiB and config.sparse_v_threshold == 1e-3


@pytest.mark.parametrize("changes, message", [
    ({"bits": (5,)}, "V bits 5"),
    ({"head_dims": (100,)}, "head_dim 100"),
    ({"num_q_heads": 30}, "not a multiple of num_kv_heads"),
    ({"iters": 0}, "iters = 0"),
    ({"sets": 0}, "sets = 0"),
    ({"warmup": -1}, "warmup"),
    ({"ops": ("verify",)}, "op 'verify'"),
    ({"sparse_v_threshold": -1.0}, "sparse_v_threshold"),
    ({"v_encoder": "MSE"}, "v_encoder 'MSE'"),
    ({"v_rotation": "HADAMARD"}, "v_rotation 'HADAMARD'"),
    ({"v_rotation": "hadamard", "head_dims": (64, 128)}, "needs a head_dim in (128, 256, 512), not 64"),
    ({"soft_cap": -1.0}, "soft_cap"),
    ({"soft_cap": float("inf")}, "soft_cap"),
    ({"q_len": 0}, "q_len = 0 must be in 1..16"),
    ({"q_len": 17}, "q_len = 17 must be in 1..16"),
    ({"q_len": 4, "shapes": ((8, 8192), (2, 3))}, "decode shape 2x3 has a sequence of fewer than q_len = 4 tokens"),
    # Ramp lengths: the shortest of 8 x 24 holds ceil(24 / 8) = 3 tokens.
    ({"q_len": 4, "lengths": "ramp", "shapes": ((8, 24),)}, "decode shape 8x24 has a sequence of fewer than q_len = 4"),
    ({"lengths": "zipf"}, "lengths 'zipf' is not one of ('equal', 'ramp')"),
    ({"table_positions": -1}, "table_positions = -1 must be >= 0"),
    ({"table_positions": 4096, "shapes": ((1, 4096), (8, 8192))},
     "table_positions = 4096 is shorter than the context of decode shape 8x8192"),
    ({"whole_table_rows": True}, "whole_table_rows needs table_positions"),
    ({"ceiling_bytes": 0}, "ceiling_bytes = 0 must be >= 1"),
    ({"ceiling_bytes": console.MiB + 8}, "ceiling_bytes = 1048584 is not a multiple of 16"),
])
def test_config_rejects(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.config.Config(**changes)


def test_cases_run_decode_then_write_with_bits_adjacent():
    cases = bench.config.build_cases(bench.config.Config())
    assert len(cases) == 8 * 3 + 4 * 3
    assert [c.op for c in cases] == ["decode"] * 24 + ["write"] * 12
    assert [c.bits for c in cases[:6]] == [2, 3, 4, 2, 3, 4]
    assert cases[0].label == "1x32768" and cases[-1].label == "32768 tok"
    assert bench.config.build_cases(bench.config.Config(ops=("write",), head_dims=(128, 256)))[-1].head_dim == 256


def test_cases_take_q_len_for_the_decode_only():
    cases = bench.config.build_cases(bench.config.Config(shapes=((8, 8192),), tokens=(16,), bits=(3,), q_len=4))
    assert [(c.op, c.q_len) for c in cases] == [("decode", 4), ("write", 1)]
    # A write-only run does not look at the decode shapes' lengths.
    assert bench.config.Config(ops=("write",), shapes=((1, 2),), q_len=4).q_len == 4


def test_cases_take_the_lengths_and_table_rows_for_the_decode_only():
    config = bench.config.Config(shapes=((8, 8192),), tokens=(16,), bits=(3,), lengths="ramp",
                          table_positions=131072, whole_table_rows=True)
    decode, write = bench.config.build_cases(config)
    assert (decode.lengths, decode.table_positions, decode.whole_table_rows) == ("ramp", 131072, True)
    assert (write.lengths, write.table_positions, write.whole_table_rows) == ("equal", 0, False)


@pytest.mark.parametrize("batch, context, lengths, want", [
    (4, 10, "ramp", [3, 5, 8, 10]),  # ceil(10 (i + 1) / 4): 2.5, 5, 7.5, 10 rounded up
    (1, 7, "ramp", [7]),
    (3, 9, "equal", [9, 9, 9]),
])
def test_sequence_lengths(batch, context, lengths, want):
    got = bench.config.sequence_lengths(batch, context, lengths)
    assert got.dtype == np.int32 and got.tolist() == want


def test_ramp_of_a_large_shape_ends_at_its_context_with_about_half_the_tokens():
    shape = bench.config.Shape("decode", 3, 32, 32768, 128, 32, 8, 16, lengths="ramp")
    assert shape.seq_lens[0] == 1024 and shape.seq_lens[-1] == 32768
    assert shape.attended_tokens == 1024 * (32 * 33 // 2)  # each length a multiple of 1024


# ---- Byte counts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cache_bytes_per_token_match_the_library_layout(bits, head_dim):
    shape = bench.config.Shape("decode", bits, 1, 16, head_dim, 8, 8, 16)
    layout = fp8kturbov.CacheLayout(4, 16, 8, head_dim, bits)
    assert bench.config.cache_bytes_per_token(shape) == layout.bytes_per_token


def test_decode_bytes():
    # 32768 tokens x 8 heads x (128 K + 48 V codes + 8 V scales), q and out in bf16, 2048 page
    # entries and one seq_len.
    assert bench.config.launch_bytes(D128_3BIT) == 32768 * 8 * 184 + 2 * 32 * 128 * 2 + (2048 + 1) * 4


def test_multi_token_decode_reads_the_cache_once():
    """q_len query tokens per sequence: q and the output grow by q_len rows per sequence and
    query_start (int32 [batch + 1]) is read; the cache bytes stay those of one step."""
    shape = bench.config.Shape("decode", 3, 2, 300, 128, 32, 8, 16, q_len=4)
    one_token = dataclasses.replace(shape, q_len=1)
    assert (shape.query_rows, shape.q_elems) == (8, 8 * 32 * 128)
    extra_q_and_out = 2 * (8 - 2) * 32 * 128 * 2
    assert bench.config.launch_bytes(shape) == bench.config.launch_bytes(one_token) + extra_q_and_out + 3 * 4
    assert bench.config.device_bytes(shape, 3) == bench.config.device_bytes(one_token, 3) + 3 * (extra_q_and_out + 3 * 4)
    assert np.array_equal(shape.query_start, [0, 4, 8]) and shape.query_start.dtype == np.int32
    assert one_token.query_start is None and one_token.query_start_bytes == 0


def test_mixed_lengths_count_the_tokens_and_pages_they_attend():
    # Lengths 10, 20, 30, 40 on pages of 16: 1 + 2 + 2 + 3 pages in use, 100 tokens.
    shape = bench.config.Shape("decode", 3, 4, 40, 128, 32, 8, 16, lengths="ramp")
    assert shape.seq_lens.tolist() == [10, 20, 30, 40] and shape.seq_blocks.tolist() == [1, 2, 2, 3]
    assert (shape.attended_tokens, shape.used_blocks, shape.blocks_per_seq) == (100, 8, 3)
    q_and_out = 2 * 4 * 32 * 128 * 2
    assert bench.config.launch_bytes(shape) == 100 * 8 * 184 + q_and_out + (8 + 4) * 4
    assert bench.config.peer_bytes(shape, 1) == 2 * 100 * 8 * 128 + q_and_out
    # The pools still hold every sequence's pages for the longest one.
    equal = dataclasses.replace(shape, lengths="equal")
    assert shape.num_blocks == equal.num_blocks == 12
    assert bench.config.device_bytes(shape, 2) == bench.config.device_bytes(equal, 2)


def test_write_bytes():
    shape = bench.config.Shape("write", 3, 128, 0, 128, 32, 8, 16)
    read = 128 * 1024 * (2 + 2)  # bf16 K and V rows
    written = 128 * (1024 + 1024 * 3 // 8 + 1024 // 16)
    assert bench.config.launch_bytes(shape) == read + written + 128 * 8


def test_peer_bytes():
    assert bench.config.peer_bytes(D128_3BIT, 2) == 2 * 32768 * 8 * 128 * 2 + 2 * 32 * 128 * 2
    assert bench.config.peer_bytes(D128_3BIT, 1) == 2 * 32768 * 8 * 128 + 2 * 32 * 128 * 2


def test_device_bytes_cover_the_pools_of_every_set():
    shape = bench.config.Shape("decode", 4, 2, 300, 128, 32, 8, 16)  # a partial last page
    assert shape.blocks_per_seq == 19 and shape.num_blocks == 38
    layout = fp8kturbov.CacheLayout(38, 16, 8, 128, 4)
    inputs = 2 * 2 * 32 * 128 * 2 + (38 + 2) * 4
    assert bench.config.device_bytes(shape, 3) == 3 * (layout.k_pool_bytes + layout.v_pool_bytes + inputs)
    write = bench.config.Shape("write", 2, 17, 0, 128, 32, 8, 16)
    assert write.num_blocks == 2


def test_bandwidth_floor_and_fits():
    assert bench.config.gbps(4.3e9, 1000.0) == pytest.approx(4300.0)
    assert bench.config.floor_us(4.3e9, 4300.0) == pytest.approx(1000.0)
    assert bench.config.floor_us(bench.config.launch_bytes(D128_3BIT), 4000.0) == pytest.approx(
        bench.config.launch_bytes(D128_3BIT) / 4e12 * 1e6)
    assert bench.config.fits_in_l2(20 << 20, 3, 60 << 20) and not bench.config.fits_in_l2(21 << 20, 3, 60 << 20)
    assert bench.config.fits_in_memory(90, 100) and not bench.config.fits_in_memory(91, 100)


def test_result_records_a_timing():
    result = bench.rows.Result.for_shape(D128_3BIT)
    result.record(bench.timing.Timing.of([30.0, 10.0, 20.0, 40.0]), ceiling_gbps=4000.0)
    assert (result.median_us, result.min_us, result.samples) == (25.0, 10.0, 4)
    assert result.gbps == pytest.approx(result.bytes / 25e-6 / 1e9)
    assert result.pct_of_ceiling == pytest.approx(100 * result.gbps / 4000.0)
    assert result.floor_us == pytest.approx(result.bytes / 4e12 * 1e6)
    assert (result.op, result.shape, result.context, result.q_len) == ("decode", "1x32768", 32768, 1)
    write = bench.rows.Result.for_shape(bench.config.Shape("write", 3, 16, 0, 128, 32, 8, 16))
    assert write.context is None and write.q_len is None
    assert bench.rows.Result.for_shape(bench.config.Shape("decode", 3, 1, 64, 128, 32, 8, 16, 4)).q_len == 4


# ---- Timing loop and pool filling, with stand-ins for the device ------------------------------------


class FakeDevice:
    """The part of `Device` that `time_launches` and `replicate` use, on a fake clock and
    a host byte array."""

    def __init__(self, nbytes: int = 0) -> None:
        self.clock, self.stamps, self.log = 0.0, {}, []
        self.memory = np.zeros(nbytes, np.uint8)

    def synchronize(self):
        self.log.append("sync")

    def events(self, count):
        return list(range(count))

    def record(self, event):
        self.stamps[event] = self.clock

    def elapsed_us(self, start, end):
        return self.stamps[end] - self.stamps[start]

    @contextlib.contextmanager
    def gate(self):
        self.log.append("hold")
        yield
        self.log.append("open")

    def write(self, address, host):
        self.memory[address:address + host.nbytes] = host

    def copy(self, dst, src, nbytes):
        assert dst >= src + nbytes, "overlapping copy"
        self.memory[dst:dst + nbytes] = self.memory[src:src + nbytes]
        self.log.append("copy")


def test_time_launches_rotates_sets_and_gates_chunks():
    dev, order = FakeDevice(), []

    def launch(index, duration):
        order.append(index)
        dev.clock += duration

    launches = [lambda: launch(0, 1.0), lambda: launch(1, 3.0)]
    timing = bench.timing.time_launches(dev, launches, iters=70, warmup=3)
    assert order == [0, 1, 0] + [i % 2 for i in range(70)]
    assert (timing.median_us, timing.min_us, timing.samples) == (2.0, 1.0, 70)
    # The median falls between the two sets; each set's own median is kept.
    assert timing.set_medians_us == (1.0, 3.0) and timing.set_spread() == 2.0
    assert dev.log.count("hold") == dev.log.count("open") == -(-70 // bench.timing.GATE_CHUNK)


def test_timing_keeps_each_sets_median():
    # Samples of three sets rotating, set 1 slower than the others by 10 %.
    samples = [[100.0, 110.0, 100.5][i % 3] + 0.1 * (i % 5) for i in range(31)]
    timing = bench.timing.Timing.of(samples, sets=3)
    assert timing.set_medians_us == tuple(statistics.median(samples[k::3]) for k in range(3))
    assert timing.set_spread() == pytest.approx(max(timing.set_medians_us) / min(timing.set_medians_us) - 1)
    assert 0.09 < timing.set_spread() < 0.11
    per_launch = timing.per_launch(4)
    assert per_launch.set_medians_us == tuple(t / 4 for t in timing.set_medians_us)
    assert per_launch.set_spread() == pytest.approx(timing.set_spread())
    assert bench.timing.Timing.of([5.0, 7.0]).set_medians_us == (6.0,)  # one set: the median itself
    assert bench.timing.Timing.of([5.0], sets=3).set_medians_us == (5.0,)  # fewer samples than sets
    assert bench.timing.Timing(1.0, 1.0, 1).set_spread() == 0.0


@pytest.mark.parametrize("set_times, l2, note", [
    ((100.0, 100.0, 104.0), False, ""),             # 4 % apart: not marked
    ((100.0, 111.0, 100.0), False, "sets 11 %"),
    ((2.0, 2.2, 2.0), True, "L2, sets 10 %"),
    ((2.0, 2.0, 2.0), True, "L2"),
])
def test_rows_whose_sets_differ_are_marked(monkeypatch, set_times, l2, note):
    samples = [set_times[i % 3] for i in range(30)]
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of(samples, 3))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([7.0]))
    config = bench.config.Config(ops=("decode",), shapes=((1, 64),) if l2 else ((32, 32768),), bits=(3,), peers=False)
    (shape,) = bench.config.build_cases(config)
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)
    assert result.note == note
    assert result.set_medians_us == list(set_times)
    assert bench.report.table_rows([dataclasses.asdict(result)])[0][-1] == note


class FakeNvmlCounters:
    """`NvmlCounters` whose clock-limit counters grow by ``steps_ns`` (per limit) at each reading."""

    def __init__(self, steps_ns: dict[str, int]) -> None:
        self.steps_ns, self.readings = steps_ns, 0

    def held_ns(self) -> dict[str, int]:
        self.readings += 1
        return {name: step * self.readings for name, step in self.steps_ns.items()}


class SilentNvmlCounters:
    """`NvmlCounters` after NVML stopped answering."""

    def held_ns(self) -> None:
        return None


def test_clock_limits_held_gives_each_limits_share_of_the_block():
    clock = iter([1_000_000, 3_000_000]).__next__  # the block takes 2 ms
    with bench.power.clock_limits_held(FakeNvmlCounters({"power cap": 500_000, "thermal": 0}), clock) as held:
        assert held == {}  # filled once the block has run
    assert held == {"power cap": 0.25, "thermal": 0.0}
    clock = iter([0, 1000]).__next__  # a counter running ahead of the host clock counts as all of it
    with bench.power.clock_limits_held(FakeNvmlCounters({"power cap": 5000, "thermal": 0}), clock) as held:
        pass
    assert held == {"power cap": 1.0, "thermal": 0.0}
    for counters in (None, SilentNvmlCounters()):
        with bench.power.clock_limits_held(counters) as held:
            pass
        assert held == {}


class FakePowerDevice:
    """The part of `Device` that `mean_power_w` uses: each replay takes one poll to finish."""

    def __init__(self) -> None:
        self.replays, self.queries, self.synced = 0, 0, False

    def events(self, count):
        return list(range(count))

    def record(self, event):
        pass

    def done(self, event):
        self.queries += 1
        return self.queries % 2 == 0

    def synchronize(self):
        self.synced = True


class FakeEnergy:
    """An energy counter stepping every ``step_s`` of a fake clock (1 ms per reading of the clock)
    by ``watts`` x ``step_s``, as NVML's does; None once ``answers`` readings are used up."""

    def __init__(self, watts: float, step_s: float = 0.1, answers: int | None = None) -> None:
        self.watts, self.step_s, self.answers, self.now = watts, step_s, answers, 0.0

    def clock(self) -> float:
        self.now += 0.001
        return self.now

    def energy_mj(self) -> int | None:
        if self.answers is not None:
            if self.answers == 0:
                return None
            self.answers -= 1
        return 7 + round(1e3 * self.watts * self.step_s) * int(self.now / self.step_s + 1e-9)


def test_mean_power_w_is_the_counters_growth_between_its_steps():
    dev, energy = FakePowerDevice(), FakeEnergy(watts=500.0)
    probe = bench.power.PowerProbe(energy, window_s=0.5)
    replay_us = 1000.0  # 20 replays per batch of POWER_BATCH_S
    power = bench.power.mean_power_w(dev, lambda: setattr(dev, "replays", dev.replays + 1), replay_us, probe, energy.clock)
    assert power == pytest.approx(500.0, rel=0.01)
    assert 0.6 <= energy.now < 0.7  # from the first step (0.1 s) to the first one 0.5 s after it
    per_batch = round(bench.power.POWER_BATCH_S * 1e6 / replay_us)
    assert dev.replays % per_batch == 0 and dev.replays > bench.power.POWER_QUEUE * per_batch  # batches, refilled
    assert dev.synced  # and drained at the end


@pytest.mark.parametrize("energy", [FakeEnergy(watts=0.0), FakeEnergy(watts=500.0, answers=0),
                                    FakeEnergy(watts=500.0, answers=150)],
                         ids=["counter does not move", "no counter", "counter stops answering"])
def test_mean_power_w_is_none_where_the_counter_does_not_serve(energy):
    dev = FakePowerDevice()
    assert bench.power.mean_power_w(dev, lambda: None, 50.0, bench.power.PowerProbe(energy, window_s=0.5), energy.clock) is None
    assert dev.synced
    assert energy.now < 0.5 + bench.power.ENERGY_STEP_TIMEOUT_S + 0.01  # it gave up in time
    if energy.watts == 0.0:  # no step at all: it waits for the first one only so long
        assert energy.now < bench.power.ENERGY_STEP_TIMEOUT_S + 0.01


def test_rows_and_peers_get_power_and_energy_per_launch(monkeypatch):
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([9.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([8.0]))
    monkeypatch.setattr(bench.timing, "chain_graph", lambda dev, enqueues: "graph")
    monkeypatch.setattr(bench.run, "mean_power_w",
                        lambda dev, replay, replay_us, probe: replay() or (replay_us == 32 * 8.0 and 600.0))
    probes = []
    monkeypatch.setattr(bench.peers, "PEERS", {"bf16_sdpa": lambda dev, shape, config, power: probes.append(power) or (
        1000, bench.timing.Timing(50.0, 50.0, 1, (), power_w=400.0))})
    config = bench.config.Config(ops=("decode",), shapes=((32, 32768),), bits=(3,), power_window_s=2.0)
    (shape,) = bench.config.build_cases(config)
    probe = bench.power.PowerProbe(FakeEnergy(watts=1.0), 2.0)
    dev = FakeRunnerDevice()
    result = bench.run._Runner(dev, config, 4000.0, power=probe).case(shape)
    assert (result.power_w, result.energy_mj) == (600.0, pytest.approx(600.0 * 8.0e-3))  # at the in-graph time
    assert dev.launched == ["graph"]  # the chain graph's replays ran for it
    assert probes == [probe]
    peer = result.peers["bf16_sdpa"]
    assert (peer["power_w"], peer["energy_mj"]) == (400.0, pytest.approx(400.0 * 50.0e-3))
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)  # no probe: nothing measured
    assert result.power_w is None and result.energy_mj is None


def test_report_lists_energy_per_launch_where_measured():
    rows = fake_rows()
    config = bench.config.Config(power_window_s=2.0)
    assert "power not measured" in bench.report.format_report(rows, DEVICE, config)
    assert "energy per launch" not in bench.report.format_report(rows, DEVICE, bench.config.Config())
    decode = rows[3]
    decode["power_w"], decode["energy_mj"] = 612.4, 7.8
    decode["peers"]["bf16_sdpa"].update(power_w=401.0, energy_mj=20.05)
    report = bench.report.format_report(rows, DEVICE, config)
    assert "power not measured" not in report
    assert bench.report.energy_rows(rows) == [("decode", "3", "1x32768", "128", "7.8 (612)", "20.1 (401)",
                                               *["-"] * (len(bench.peers.PEERS) - 1))]
    assert "energy per launch" in report and "7.8 (612)" in report


def test_power_window_option_reaches_the_config():
    args = build_parser().parse_args(["bench", "--power-window", "2.5"])
    assert config_from_args(args).power_window_s == 2.5
    assert config_from_args(build_parser().parse_args(["bench"])).power_window_s == 0.0
    with pytest.raises(ValueError, match="power_window_s"):
        bench.config.Config(power_window_s=-1.0)


def test_clock_limit_notes_join_the_rows_notes():
    row = bench.rows.Result(op="decode", shape="32x32768", note="sets 12 %")
    row.mark_clock_limits({"power cap": 0.404, "thermal": 0.005})  # 0.5 %: under CLOCK_LIMIT_NOTE
    assert row.note == "sets 12 %, power cap 40 %"
    assert row.clock_limited == {"power cap": 0.404, "thermal": 0.005}
    row = bench.rows.Result(op="decode", shape="32x32768")
    row.mark_clock_limits({"power cap": 0.0, "thermal": 0.5})
    assert row.note == "thermal 50 %"
    row = bench.rows.Result(op="decode", shape="32x32768")
    row.mark_clock_limits({})  # not known
    assert row.note == "" and row.clock_limited is None


def test_rows_and_peers_held_by_a_clock_limit_are_marked(monkeypatch):
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([9.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([7.0]))
    monkeypatch.setattr(bench.peers, "PEERS",
                        {"bf16_sdpa": lambda dev, shape, config, power: (1000, bench.timing.Timing.of([50.0]))})
    config = bench.config.Config(ops=("decode",), shapes=((32, 32768),), bits=(3,))
    (shape,) = bench.config.build_cases(config)
    # Counters that grow by 1000 s per reading: the power limit held through every block.
    counters = FakeNvmlCounters({"power cap": 10**12, "thermal": 0})
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0, counters).case(shape)
    assert result.note == "power cap 100 %"
    assert result.clock_limited == result.peers["bf16_sdpa"]["clock_limited"] == {"power cap": 1.0, "thermal": 0.0}
    assert counters.readings == 4  # before and after the row's timing, and the peer's
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)
    assert result.note == "" and result.clock_limited is None
    assert result.peers["bf16_sdpa"]["clock_limited"] is None


class FakeGraphDevice(FakeDevice):
    """FakeDevice with graphs: a graph is the list of the nodes enqueued while it was captured;
    replaying it advances the clock by their durations."""

    def __init__(self, durations) -> None:
        super().__init__()
        self.durations, self.graphs, self._captured = durations, [], None

    def node(self, index):
        self._captured.append(index)

    def capture(self, enqueue):
        self._captured = []
        enqueue()
        self.graphs.append(self._captured)
        return self._captured

    def launch(self, graph):
        self.clock += sum(self.durations[i] for i in graph)


def test_time_graph_chain_times_one_graph_of_many_launches_per_launch():
    dev = FakeGraphDevice([1.0, 3.0])
    timing = bench.timing.time_graph_chain(dev, [lambda: dev.node(0), lambda: dev.node(1)], iters=8, warmup=1)
    assert dev.graphs == [[0, 1] * (bench.timing.GRAPH_CHAIN // 2)]  # the input sets rotate inside it
    assert timing == bench.timing.Timing(2.0, 2.0, 8, (2.0,))
    # A replay queues GRAPH_CHAIN kernels: one per gate, as many as a gate's chunk of single launches.
    assert dev.log.count("hold") == dev.log.count("open") == 8


def test_replicate_fills_with_few_copies():
    pattern = np.arange(3 * 16, dtype=np.uint8)  # three 16-byte "pages"
    dev = FakeDevice(1000 * 16 + 64)
    bench.launches.replicate(dev, 64, 1000 * 16, pattern)
    filled = dev.memory[64:].reshape(1000, 16)
    assert np.array_equal(filled, pattern.reshape(3, 16)[np.arange(1000) % 3])
    assert dev.log.count("copy") <= 10  # doubling: log2(1000 / 3) + 1
    assert not dev.memory[:64].any()


def test_encode_chunk_is_whole_reference_pages():
    pytest.importorskip("ml_dtypes")
    from fp8kturbov import reference as ref

    shape = bench.config.Shape("decode", 3, 1, 1, 128, 4, 2, 16)
    chunk = bench.launches.encode_chunk(shape, 20, np.random.default_rng(1))
    layout = fp8kturbov.CacheLayout(2, 16, 2, 128, 3)  # 20 tokens round up to 2 pages
    assert chunk.k_pages.nbytes == layout.k_pool_bytes
    assert chunk.v_pages.nbytes == layout.v_pool_bytes
    # k_scale = max|K| / 448: the largest K decodes back to max|K| exactly.
    assert np.abs(ref.decode_k(chunk.k_pages, chunk.k_scale)).max() == pytest.approx(448 * chunk.k_scale)
    assert chunk.v_pages.any()


# ---- Peers -----------------------------------------------------------------------------------------


def test_report_has_a_column_per_peer_in_their_order():
    assert list(bench.report.PEER_LABELS) == list(bench.peers.PEERS)


def test_peer_failures_become_statuses(monkeypatch):
    def broken(dev, shape, config, power):
        raise RuntimeError("kernel exploded\nsecond line")

    def unavailable(dev, shape, config, power):
        raise bench.peers.PeerUnavailable("skipped: needs 9.0 GiB, 1.0 GiB free")

    monkeypatch.setattr(bench.peers, "PEERS", {"a": broken, "b": unavailable})
    config = bench.config.Config()
    assert bench.peers.run_peer("a", None, D128_3BIT, config, 4000.0) == {"status": "error: kernel exploded"}
    assert bench.peers.run_peer("b", None, D128_3BIT, config, 4000.0)["status"].startswith("skipped:")


@pytest.mark.parametrize("name", list(fp8kturbov.tools.bench.peers.PEERS))
def test_missing_peer_module_is_absent(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert bench.peers.run_peer(name, None, D128_3BIT, bench.config.Config(), 4000.0) == {"status": "absent"}


def test_peer_versions_come_from_the_distribution_that_provides_the_module(monkeypatch):
    """flashinfer is installed as the distribution flashinfer-python: its version is that one's."""
    versions = {"flashinfer-python": "0.5.3", "torch": "2.11.0"}

    def version(distribution):
        if distribution not in versions:
            raise bench.report.importlib.metadata.PackageNotFoundError(distribution)
        return versions[distribution]

    monkeypatch.setattr(bench.report.importlib.metadata, "packages_distributions",
                        lambda: {"flashinfer": ["flashinfer-python"], "torch": ["torch"]})
    monkeypatch.setattr(bench.report.importlib.metadata, "version", version)
    assert bench.report._module_version("flashinfer") == "0.5.3"
    assert bench.report._module_version("torch") == "2.11.0"
    assert bench.report._module_version("absent_module") is None


# ---- Output ----------------------------------------------------------------------------------------


def fake_rows() -> list[dict]:
    """The rows of a small run, as run_benchmarks would return them."""
    read = bench.rows.Result(op="read", shape="2 GiB read", bytes=2 * console.GiB)
    read.record(bench.timing.Timing.of([500.0] * 30), bench.config.gbps(read.bytes, 500.0))
    copy = bench.rows.Result(op="copy", shape="2 GiB DtoD", bytes=4 * console.GiB)
    copy.record(bench.timing.Timing.of([1100.0] * 30), read.gbps)
    launch = bench.rows.Result(op="launch", shape="empty-kernel graph", bytes=0, in_graph_us=1.25)
    launch.record(bench.timing.Timing.of([2.5]), read.gbps)
    decode = bench.rows.Result.for_shape(D128_3BIT)
    decode.record(bench.timing.Timing.of([14.0, 15.0]), read.gbps)
    decode.in_graph_us = 12.75
    decode.plain_read_us = 12.5
    decode.peers = {"bf16_sdpa": {"status": "ok", **bench.rows.measured(
        bench.config.peer_bytes(D128_3BIT, 2), bench.timing.Timing.of([50.0]), read.gbps)},
        "fp8_sdpa": {"status": "ok", **bench.rows.measured(bench.config.peer_bytes(D128_3BIT, 1), bench.timing.Timing.of([30.0]),
                                                      read.gbps)},
        "fp8_flashinfer": {"status": "absent"}}
    skipped = bench.rows.Result.for_shape(bench.config.Shape("decode", 4, 32, 32768, 128, 32, 8, 16))
    skipped.note = "skipped: needs 200.0 GiB, 100.0 GiB free"
    skipped.peers = {"bf16_sdpa": {"status": "skipped: needs 24.0 GiB, 1.0 GiB free"},
                     "fp8_flashinfer": {"status": "absent"}}
    write = bench.rows.Result.for_shape(bench.config.Shape("write", 3, 16, 0, 128, 32, 8, 16))
    write.record(bench.timing.Timing.of([3.0]), read.gbps)
    write.note = "L2"
    return [dataclasses.asdict(r) for r in (read, copy, launch, decode, skipped, write)]


@pytest.mark.parametrize("baked, want", [(b"0a1b2c3", "0a1b2c3"), (b"0a1b2c3-dirty", "0a1b2c3-dirty"),
                                          (b"unknown", None)])
def test_the_commit_is_the_one_baked_into_the_library(monkeypatch, baked, want):
    # The library's own record, not whatever repository encloses the working directory.
    monkeypatch.setattr(fp8kturbov._lib, "_loaded", types.SimpleNamespace(fp8kturbov_build_commit=lambda: baked))
    monkeypatch.setattr(bench.report, "_command_output", lambda *command: pytest.fail(f"asked {command}"))
    assert bench.report.build_commit() == want


def test_the_loaded_library_names_its_build_commit():
    commit = fp8kturbov._lib.library().fp8kturbov_build_commit().decode()
    assert commit == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit), commit


DEVICE = {"name": "Test GPU", "driver": "580.1", "cuda_driver_api": "13.0", "commit": "abc1234",
          "date": "2026-01-01T00:00:00+00:00", "timing_gate": True}


def test_report_has_the_table_ceiling_floor_and_context():
    report = bench.report.format_report(fake_rows(), DEVICE, bench.config.Config())
    lines = report.splitlines()
    assert lines[0].split() == ["op", "bits", "shape", "D", "us", "GB/s", "%", "ceil", "floor",
                                "us", "read", "us", "in-graph", "us", "bf16", "sdpa", "us", "fp8", "sdpa", "us",
                                "flashinfer", "fp8", "us", "xqa", "fp8", "us", "xqa", "bf16", "us", "vs", "best",
                                "fp8", "note"]
    decode = next(line for line in lines if "1x32768" in line).split()
    assert decode[:5] == ["decode", "3", "1x32768", "128", "14.50"]
    assert decode[-8:] == ["12.50", "12.75", "50.00", "30.00", "absent", "-", "-", "-"]
    assert any(line.split()[:3] == ["write", "3", "16"] and line.endswith("L2") for line in lines)
    assert "decode 32x32768 D128 4b: skipped: needs 200.0 GiB, 100.0 GiB free" in lines
    assert "decode 32x32768 D128 bf16_sdpa: skipped: needs 24.0 GiB, 1.0 GiB free" in lines
    assert any(line.startswith("read bandwidth: 4295 GB/s (2 GiB read, median of 30): the ceiling")
               for line in lines)
    assert "copy bandwidth (read+write): 3905 GB/s (2 GiB DtoD, median of 30)" in lines
    assert ("launch floor: 2.50 us (empty-kernel graph); in a graph of 32 launches 1.25 us per "
            "launch, the 'in-graph us' of the rows") in lines
    assert lines[-1] == ("commit abc1234 | Test GPU | driver 580.1 (CUDA 13.0) | "
                         "2026-01-01T00:00:00+00:00")
    assert not any("timing gate" in line for line in lines)


def test_report_says_where_clock_limits_were_not_known():
    rows = fake_rows()
    assert "clock limits not known: NVML's counters were not available" in bench.report.format_report(rows, DEVICE,
                                                                                               bench.config.Config())
    rows[0]["clock_limited"] = {"power cap": 0.0, "thermal": 0.0}  # the ceiling's row
    assert "clock limits not known" not in bench.report.format_report(rows, DEVICE, bench.config.Config())


def test_report_names_the_mode_and_the_options():
    assert ", unchecked;" in bench.report.format_report(fake_rows(), DEVICE, bench.config.Config())
    assert ", checked mode;" in bench.report.format_report(fake_rows(), DEVICE, bench.config.Config(checked=True))
    config = bench.config.Config(v_encoder="mse", soft_cap=30.0, sinks=True)
    assert ", unchecked, V encoder mse, soft cap 30, sinks;" in bench.report.format_report(fake_rows(), DEVICE, config)
    report = bench.report.format_report(fake_rows(), DEVICE, bench.config.Config(q_len=4))
    assert ", unchecked, 4 query tokens per sequence (peers not run: they decode one);" in report
    report = bench.report.format_report(fake_rows(), DEVICE, bench.config.Config(q_len=4, peers=False))
    assert ", unchecked, 4 query tokens per sequence;" in report
    report = bench.report.format_report(fake_rows(), DEVICE, bench.config.Config(lengths="ramp", table_positions=131072))
    assert (", unchecked, sequence i of B holding ceil(context * (i + 1) / B) tokens (dense peers not run: "
            "one length per batch), block-table rows of 131072 positions, passed as a column slice "
            "(block_tables_stride);") in report
    report = bench.report.format_report(fake_rows(), DEVICE, bench.config.Config(table_positions=131072, whole_table_rows=True))
    assert ", unchecked, block-table rows of 131072 positions, passed whole (the plan sized for them);" in report


class FakeMemoryDevice:
    """Records the allocations, memsets and uploads of `bench.launches.launch_options`."""

    def __init__(self) -> None:
        self.allocs, self.memsets, self.uploads = [], [], []

    def alloc(self, nbytes: int) -> int:
        self.allocs.append(nbytes)
        return 0x1000 * len(self.allocs)

    def memset(self, address: int, value: int, nbytes: int) -> None:
        self.memsets.append((address, value, nbytes))

    def upload(self, host: np.ndarray) -> int:
        self.uploads.append(host.copy())
        return 0x9000 + len(self.uploads)


DECODE_SHAPE = bench.config.Shape("decode", 3, 2, 300, 128, 32, 8, 16)
WRITE_SHAPE = bench.config.Shape("write", 3, 16, 0, 128, 32, 8, 16)


def test_launch_options_give_each_set_a_zeroed_word_in_checked_mode():
    layout = fp8kturbov.CacheLayout(37, 16, 8, 128, 3)
    dev = FakeMemoryDevice()
    assert bench.launches.launch_options(dev, DECODE_SHAPE, layout, bench.config.Config()) == {}
    assert bench.launches.launch_options(dev, WRITE_SHAPE, layout, bench.config.Config()) == {}
    assert dev.allocs == [] and dev.memsets == [] and dev.uploads == []
    first = bench.launches.launch_options(dev, DECODE_SHAPE, layout, bench.config.Config(checked=True))
    second = bench.launches.launch_options(dev, WRITE_SHAPE, layout, bench.config.Config(checked=True))
    assert first == {"num_blocks": 37, "error_flags": 0x1000}
    assert second == {"num_blocks": 37, "error_flags": 0x2000}
    assert dev.allocs == [4, 4] and dev.memsets == [(0x1000, 0, 4), (0x2000, 0, 4)]


def test_launch_options_of_the_decode_and_the_write():
    layout = fp8kturbov.CacheLayout(37, 16, 8, 128, 3)
    dev = FakeMemoryDevice()
    config = bench.config.Config(v_encoder="mse", soft_cap=30.0, sinks=True)
    assert bench.launches.launch_options(dev, DECODE_SHAPE, layout, config) == {"sinks": 0x9001, "soft_cap": 30.0}
    assert dev.uploads[0].dtype == np.float32 and np.array_equal(dev.uploads[0], np.zeros(32))
    assert bench.launches.launch_options(dev, WRITE_SHAPE, layout, config) == {"v_encoder": fp8kturbov.VEncoder.MSE}
    projection = bench.config.Config(v_encoder="projection")
    assert bench.launches.launch_options(dev, WRITE_SHAPE, layout, projection) == \
        {"v_encoder": fp8kturbov.VEncoder.PROJECTION}
    rotated = bench.config.Config(v_rotation="hadamard")
    for shape in (DECODE_SHAPE, WRITE_SHAPE):  # a rotated cache is written and decoded rotated
        assert bench.launches.launch_options(dev, shape, layout, rotated) == {"v_rotation": fp8kturbov.VRotation.HADAMARD}


@pytest.mark.parametrize("whole, planned, stride", [(False, 3, {"block_tables_stride": 7}), (True, 7, {})])
def test_wide_table_rows_are_passed_as_a_slice_or_whole(whole, planned, stride):
    # Rows of 100 positions are 7 pages of 16; a sequence of 40 tokens fills 3.
    shape = bench.config.Shape("decode", 3, 2, 40, 128, 32, 8, 16, table_positions=100, whole_table_rows=whole)
    layout = fp8kturbov.CacheLayout(shape.num_blocks, 16, 8, 128, 3)
    assert (shape.blocks_per_seq, shape.table_blocks, shape.planned_blocks) == (3, 7, planned)
    assert bench.launches.decode_scalars(shape, layout, 0.1, 0.0)["max_blocks_per_seq"] == planned
    assert bench.launches.launch_options(FakeMemoryDevice(), shape, layout, bench.config.Config()) == stride
    compact = dataclasses.replace(shape, table_positions=0, whole_table_rows=False)
    assert bench.config.launch_bytes(shape) == bench.config.launch_bytes(compact)  # the entries read are the same
    assert bench.config.device_bytes(shape, 1) == bench.config.device_bytes(compact, 1) + 2 * (7 - 3) * 4
    table = bench.launches.block_table(shape, np.random.default_rng(5))
    assert table.dtype == np.int32 and table.shape == (2, 7)
    assert sorted(table[:, :3].ravel().tolist()) == list(range(6)) and not table[:, 3:].any()
    assert np.array_equal(table[:, :3], bench.launches.block_table(compact, np.random.default_rng(5)))


def test_launch_options_pass_the_query_rows_of_a_multi_token_decode():
    layout = fp8kturbov.CacheLayout(37, 16, 8, 128, 3)
    dev = FakeMemoryDevice()
    shape = dataclasses.replace(DECODE_SHAPE, q_len=4)
    options = bench.launches.launch_options(dev, shape, layout, bench.config.Config(q_len=4))
    assert options == {"query_start": 0x9001, "num_query_rows": 8}
    assert dev.uploads[0].dtype == np.int32 and np.array_equal(dev.uploads[0], [0, 4, 8])
    assert bench.launches.decode_scalars(shape, layout, 0.1, 0.0)["max_q_len"] == 4
    assert bench.launches.decode_scalars(DECODE_SHAPE, layout, 0.1, 0.0)["max_q_len"] == 1


class FakeRunnerDevice:
    """The part of `Device` that `_Runner.case` asks directly (the launches are stubbed; a
    graph launch is logged)."""

    stream = 7  # a raw CUstream handle as int() reads it

    def __init__(self) -> None:
        self.launched, self.allocated, self.memsets = [], [], []

    def launch(self, graph) -> None:
        self.launched.append(graph)

    def attribute(self, name: str) -> int:
        return {"MULTIPROCESSOR_COUNT": 132}.get(name, 60 << 20)  # else the L2's size

    def alloc(self, nbytes: int) -> int:
        self.allocated.append(nbytes)
        return 0x1000 * len(self.allocated)

    def memset(self, address: int, value: int, nbytes: int) -> None:
        self.memsets.append((address, value, nbytes))

    def memory(self) -> tuple[int, int]:
        return 100 << 30, 141 << 30

    @contextlib.contextmanager
    def scope(self):
        yield


def test_plain_read_times_the_read_kernel_over_the_bytes_of_each_set(monkeypatch):
    reads = []
    monkeypatch.setattr(kernels, "read", lambda stream, src, nbytes, sink, ctas: reads.append(
        (stream, src, nbytes, sink, ctas)))

    def time_graphs(dev, enqueues, iters, warmup):
        assert (iters, warmup) == (config.iters, config.warmup)
        for enqueue in enqueues:
            enqueue()
        return bench.timing.Timing.of([14.0, 15.0, 17.0])

    monkeypatch.setattr(bench.timing, "time_graphs", time_graphs)
    dev, config = FakeRunnerDevice(), bench.config.Config(sets=3)
    assert bench.timing.time_plain_read(dev, 1000, config) == 15.0
    sink, *buffers = [0x1000 * (i + 1) for i in range(4)]
    assert dev.allocated == [4, 1008, 1008, 1008]  # the sink, then a set's bytes rounded up to 16
    assert dev.memsets == [(buffer, 1, 1008) for buffer in buffers]
    assert reads == [(7, buffer, 1008, sink, bench.timing.READ_CTAS_PER_SM * 132) for buffer in buffers]
    # 3 sets of 40 GiB do not fit in the 100 GiB free: nothing allocated, nothing timed
    dev = FakeRunnerDevice()
    assert bench.timing.time_plain_read(dev, 40 * console.GiB, config) is None and dev.allocated == []


def test_decode_rows_and_their_peers_get_a_plain_read_of_their_bytes(monkeypatch):
    def absent(dev, shape, config, power):
        raise bench.peers.PeerUnavailable("absent")

    plain_reads = []
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.launches, "write_enqueues", lambda dev, shape, config, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([9.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([7.0]))
    monkeypatch.setattr(bench.timing, "time_plain_read", lambda dev, nbytes, config: plain_reads.append(nbytes) or
                        nbytes / 1e6)
    monkeypatch.setattr(bench.peers, "PEERS", {"bf16_sdpa": lambda dev, shape, config, power: (5_000_000, bench.timing.Timing.of(
        [50.0])), "fp8_flashinfer": absent})
    config = bench.config.Config(ops=("decode", "write"), shapes=((32, 8192),), bits=(2, 3), tokens=(16,))
    runner = bench.run._Runner(FakeRunnerDevice(), config, 4000.0)
    cases = bench.config.build_cases(config)
    two, three = (runner.case(shape) for shape in cases if shape.op == "decode")
    write = runner.case(next(shape for shape in cases if shape.op == "write"))
    assert (two.plain_read_us, three.plain_read_us) == (two.bytes / 1e6, three.bytes / 1e6)
    assert two.peers["bf16_sdpa"]["plain_read_us"] == 5.0 and "plain_read_us" not in two.peers["fp8_flashinfer"]
    assert write.plain_read_us is None
    assert plain_reads == [two.bytes, 5_000_000, three.bytes]  # the peers' once for the shape
    assert bench.report.table_rows([dataclasses.asdict(two)])[0][8] == f"{two.bytes / 1e6:.2f}"


@pytest.mark.parametrize("name", ["bf16_sdpa", "fp8_sdpa"])
def test_dense_peers_skip_mixed_lengths_before_importing_anything(monkeypatch, name):
    monkeypatch.setattr(bench.peers, "_optional", lambda module: pytest.fail(f"imported {module}"))
    shape = bench.config.Shape("decode", 3, 4, 40, 128, 32, 8, 16, lengths="ramp")
    result = bench.peers.run_peer(name, FakeRunnerDevice(), shape, bench.config.Config(), 4000.0)
    assert result == {"status": "skipped: dense K/V hold sequences of one length"}


def test_peers_run_only_for_one_query_token(monkeypatch):
    peer_runs = []
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([9.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([7.0]))
    monkeypatch.setattr(bench.peers, "run_peer", lambda name, dev, shape, config, ceiling, counters=None, power=None:
                        peer_runs.append((name, shape.q_len)) or {"status": "absent"})
    for q_len, peers_run in [(4, []), (1, [(name, 1) for name in bench.peers.PEERS])]:
        peer_runs.clear()
        config = bench.config.Config(ops=("decode",), shapes=((2, 300),), bits=(3,), q_len=q_len)
        (shape,) = bench.config.build_cases(config)
        result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)
        assert (result.q_len, result.median_us, result.in_graph_us) == (q_len, 9.0, 7.0)
        assert peer_runs == peers_run
        assert set(result.peers) == {name for name, _ in peers_run}


def test_table_columns_align():
    table = console.format_table([("a", "1.5"), ("bbb", "10.25")], ("name", "us"))
    assert table.splitlines() == ["name     us", "----  -----", "a       1.5", "bbb   10.25"]


def test_json_schema(tmp_path):
    rows = fake_rows()
    config = bench.config.Config(shapes=((1, 32768),), bits=(3,))
    bench.rows.write_json(tmp_path / "out.json", rows, DEVICE, config)
    document = json.loads((tmp_path / "out.json").read_text())
    assert set(document) == {"schema", "device", "config", "rows"}
    assert document["schema"] == "fp8kturbov-bench/1" and document["device"] == DEVICE
    assert document["config"]["shapes"] == [[1, 32768]] and document["config"]["bits"] == [3]
    assert [row["op"] for row in document["rows"]] == ["read", "copy", "launch", "decode", "decode",
                                                       "write"]
    keys = {f.name for f in dataclasses.fields(bench.rows.Result)}
    assert all(set(row) == keys for row in document["rows"])
    peer = document["rows"][3]["peers"]["bf16_sdpa"]
    assert set(peer) == {"status", "bytes", "median_us", "min_us", "samples", "set_medians_us", "gbps",
                         "pct_of_ceiling", "power_w", "energy_mj"}
    assert document["rows"][3]["set_medians_us"] == [14.5] and document["rows"][4]["set_medians_us"] == []
    assert document["rows"][4]["median_us"] is None
    assert [row["q_len"] for row in document["rows"]] == [None, None, None, 1, 1, None]
    assert [(row["lengths"], row["table_positions"], row["whole_table_rows"]) for row in document["rows"][3:]] \
        == [("equal", 0, False), ("equal", 0, False), (None, None, None)]
    bench.rows.write_json(tmp_path / "q4.json", rows, DEVICE, bench.config.Config(q_len=4))
    assert json.loads((tmp_path / "q4.json").read_text())["config"]["q_len"] == 4


def test_plot(tmp_path, monkeypatch):
    path = tmp_path / "roofline.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.report.write_plot(path, fake_rows()) .startswith("matplotlib is not installed")
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert bench.report.write_plot(path, fake_rows()) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_without_tqdm_counts_on_stderr(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert list(console.progress(["a", "b"], str.upper)) == ["a", "b"]
    assert capsys.readouterr().err.splitlines() == ["[1/2] A", "[2/2] B"]
    assert list(console.progress(["a"], str.upper, enabled=False)) == ["a"]
    assert capsys.readouterr().err == ""


# ---- Command line ----------------------------------------------------------------------------------


def test_cli_options_become_a_config():
    args = build_parser().parse_args(
        ["bench", "--op", "decode", "--shapes", "1x32768,8x8k", "--bits", "3", "--head-dim",
         "128,256", "--q-heads", "16", "--kv-heads", "4", "--block-size", "32", "--iters", "50",
         "--warmup", "5", "--sets", "2", "--sparse-v-threshold", "0", "--checked", "--v-encoder",
         "mse", "--soft-cap", "30", "--sinks", "--v-rotation", "hadamard", "--q-len", "4", "--no-peers",
         "--lengths", "ramp", "--table-positions", "128k", "--whole-table-rows",
         "--ceiling-mib", "256", "--json", "out.json",
         "--plot", "out.png"])
    assert config_from_args(args) == bench.config.Config(
        ops=("decode",), shapes=((1, 32768), (8, 8192)), bits=(3,), head_dims=(128, 256),
        num_q_heads=16, num_kv_heads=4, block_size=32, iters=50, warmup=5, sets=2,
        sparse_v_threshold=0.0, checked=True, v_encoder="mse", soft_cap=30.0, sinks=True,
        v_rotation="hadamard", q_len=4, lengths="ramp", table_positions=131072, whole_table_rows=True,
        peers=False, ceiling_bytes=256 << 20)
    assert (args.json, args.plot) == ("out.json", "out.png")
    assert config_from_args(build_parser().parse_args(["bench"])) == bench.config.Config()


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shapes", "8x"], "argument --shapes"),
    (["bench", "--bits", "3,x"], "argument --bits"),
    (["bench", "--op", "verify"], "argument --op"),
    (["bench", "--q-len", "0"], "argument --q-len: '0' is not a positive integer"),
    (["bench", "--q-len", "17"], "argument --q-len: '17' is more than 16 query tokens per sequence"),
    (["bench", "--ceiling-mib", "0"], "argument --ceiling-mib: '0' is not a positive integer"),
    (["bench", "--lengths", "zipf"], "argument --lengths: invalid choice: 'zipf'"),
    (["bench", "--table-positions", "0"], "argument --table-positions: '0' is not a positive integer"),
    ([], "required: COMMAND"),
    (["compare", "a.json"], "required: CANDIDATE.json"),
    (["compare", "a.json", "b.json", "--max-slowdown", "-1"],
     "argument --max-slowdown: '-1' is not a percentage >= 0"),
])
def test_cli_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_read_kernel_needs_16_byte_multiples():
    # Checked before the bench library is loaded: no GPU needed.
    for nbytes, src in ((1000, 0x1000), (1024, 0x1008)):
        with pytest.raises(BenchError, match="the read needs 16-byte multiples"):
            kernels.read(0, src, nbytes, 0x2000, 1)


def test_a_missing_bench_library_is_a_bench_error(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "libfp8kturbov.so")
    kernels._library.cache_clear()
    try:
        with pytest.raises(BenchError, match=re.escape(
                f"the bench kernels ({tmp_path / kernels.BENCH_LIBRARY_NAME}) are not loadable: ")):
            kernels.empty(0)
    finally:
        kernels._library.cache_clear()


def test_cli_reports_an_invalid_config_in_one_line(capsys):
    assert main(["bench", "--q-heads", "30"]) == 2
    assert capsys.readouterr().err == (
        "python -m fp8kturbov bench: error: num_q_heads = 30 is not a multiple of num_kv_heads = 8\n")
    assert main(["bench", "--whole-table-rows"]) == 2
    assert capsys.readouterr().err == "python -m fp8kturbov bench: error: whole_table_rows needs table_positions\n"


@pytest.mark.parametrize("flags, timing_gate", [([], True), (["--no-timing-gate"], False)])
def test_cli_without_a_gpu_is_one_line(monkeypatch, capsys, flags, timing_gate):
    asked = []

    def no_gpu(**options):
        asked.append(options)
        raise BenchError("no usable CUDA GPU: cuInit failed: CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(cli, "Device", no_gpu)
    assert main(["bench", "--no-progress", *flags]) == 1
    assert asked == [{"timing_gate": timing_gate}]
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("python -m fp8kturbov bench: error: no usable CUDA GPU: cuInit failed: "
                            "CUDA_ERROR_NO_DEVICE\n")


def _run_module(*args: str) -> subprocess.CompletedProcess:
    package_root = str(Path(fp8kturbov.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "fp8kturbov", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})


def test_module_help():
    done = _run_module("bench", "--help")
    assert done.returncode == 0 and "--sparse-v-threshold" in done.stdout and "--q-len N" in done.stdout


def test_module_without_a_gpu_fails_in_one_line():
    from conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present")
    done = _run_module("bench", "--no-progress")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("python -m fp8kturbov bench: error: no usable CUDA GPU")
    assert len(done.stderr.splitlines()) == 1


# ---- On a GPU --------------------------------------------------------------------------------------


#: Off under compute-sanitizer (ci/gpu-test.sh sets the variable): with the gate, these tests never
#: finished under its initcheck tool.
TIMING_GATE = os.environ.get("FP8KTURBOV_TEST_NO_TIMING_GATE") != "1"


@pytest.mark.gpu
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_gpu_smoke_one_tiny_shape(tmp_path, checked):
    # A small ceiling (its numbers are the L2's): compute-sanitizer tracks every byte copied.
    config = bench.config.Config(shapes=((2, 300),), tokens=(16,), bits=(3,), iters=5, warmup=2, sets=2,
                          ceiling_bytes=8 * console.MiB, checked=checked)
    with Device(timing_gate=TIMING_GATE) as dev:
        assert TIMING_GATE or not dev.gated  # on only where the driver supports it
        device = bench.report.describe_device(dev)
        rows = bench.run.run_benchmarks(config, device=dev, show_progress=False)
    assert [row["op"] for row in rows] == ["read", "copy", "launch", "decode", "write"]
    assert [row["samples"] for row in rows] == [bench.run.COPY_ITERS, bench.run.COPY_ITERS, 5, 5, 5]
    assert all(row["median_us"] > 0 for row in rows)
    assert all(row["gbps"] > 0 for row in rows if row["op"] != "launch")  # an empty kernel moves 0 bytes
    assert [row["in_graph_us"] is not None and row["in_graph_us"] > 0 for row in rows] == [False, False, True,
                                                                                          True, True]
    assert rows[3]["bytes"] == bench.config.launch_bytes(bench.config.build_cases(config)[0])
    assert [row["plain_read_us"] is not None and row["plain_read_us"] > 0 for row in rows] == [False, False, False,
                                                                                              True, False]
    for row in rows:  # None where NVML's counters are not available
        held = row["clock_limited"]
        assert held is None or (set(held) == {"power cap", "thermal"} and all(0 <= s <= 1 for s in held.values()))
    assert set(rows[3]["peers"]) == set(bench.peers.PEERS)
    for peer in rows[3]["peers"].values():
        assert peer["status"] == "absent" or peer["status"] == "ok", peer["status"]
        assert peer["status"] != "ok" or peer["plain_read_us"] > 0
    assert device["l2_bytes"] > 0 and device["name"]
    report = bench.report.format_report(rows, device, config)
    assert "read bandwidth" in report and "copy bandwidth (read+write)" in report and "launch floor" in report
    bench.rows.write_json(tmp_path / "bench.json", rows, device, config)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][3]["op"] == "decode"


@pytest.mark.gpu
def test_gpu_power_window_one_tiny_shape():
    config = bench.config.Config(ops=("decode",), shapes=((2, 300),), bits=(3,), iters=5, warmup=2, sets=2,
                          ceiling_bytes=8 * console.MiB, peers=False, power_window_s=0.3)
    with Device(timing_gate=TIMING_GATE) as dev:
        counters = NvmlCounters.open(dev.pci_bus_id)
        has_energy = counters is not None and counters.energy_mj() is not None
        if counters is not None:
            counters.close()
        rows = bench.run.run_benchmarks(config, device=dev, show_progress=False)
        report = bench.report.format_report(rows, bench.report.describe_device(dev), config)
    decode = rows[3]
    if not has_energy:  # no energy counter here: nothing measured, and the report says so
        assert decode["power_w"] is None and "power not measured" in report
        return
    assert decode["power_w"] > 0, "the energy counter answers, so it moves under load"
    assert decode["energy_mj"] == pytest.approx(decode["power_w"] * decode["in_graph_us"] * 1e-3)
    assert "energy per launch" in report


@pytest.mark.gpu
def test_gpu_cli_multi_token_decode_one_tiny_shape(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--op", "decode", "--shapes", "2x300", "--bits", "3", "--iters", "5",
                 "--warmup", "2", "--sets", "2", "--q-len", "4", "--ceiling-mib", "8", "--no-progress",
                 "--json", str(path), *([] if TIMING_GATE else ["--no-timing-gate"])]) == 0
    assert "4 query tokens per sequence" in capsys.readouterr().out
    document = json.loads(path.read_text())
    assert document["config"]["q_len"] == 4
    decode = document["rows"][3]
    assert (decode["op"], decode["q_len"], decode["samples"], decode["peers"]) == ("decode", 4, 5, {})
    # Where the sets' own medians differ (a sanitizer's timing) or a clock limit held, the note
    # says so: no other note is due.
    assert decode["median_us"] > 0
    assert all(re.fullmatch(r"L2|sets \d+ %|(power cap|thermal) \d+ %", part)
               for part in decode["note"].split(", ") if part), decode["note"]
    assert decode["bytes"] == bench.config.launch_bytes(bench.config.Shape("decode", 3, 2, 300, 128, 32, 8, 16, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("whole", [False, True], ids=["slice", "whole"])
def test_gpu_mixed_lengths_in_wide_table_rows_one_tiny_shape(whole):
    config = bench.config.Config(ops=("decode",), shapes=((3, 300),), bits=(3,), iters=5, warmup=2, sets=2,
                          ceiling_bytes=8 * console.MiB, lengths="ramp", table_positions=1000,
                          whole_table_rows=whole)
    with Device(timing_gate=TIMING_GATE) as dev:
        rows = bench.run.run_benchmarks(config, device=dev, show_progress=False)
    decode = rows[3]
    (shape,) = bench.config.build_cases(config)
    assert decode["median_us"] > 0 and decode["bytes"] == bench.config.launch_bytes(shape)
    assert (decode["lengths"], decode["table_positions"], decode["whole_table_rows"]) == ("ramp", 1000, whole)
    peers = decode["peers"]
    assert peers["bf16_sdpa"]["status"] in ("absent", "skipped: dense K/V hold sequences of one length")
    assert peers["fp8_flashinfer"]["status"] in ("absent", "ok"), peers["fp8_flashinfer"]["status"]


def test_the_best_fp8_peer_is_the_fastest_fp8_peer_that_ran():
    ok = lambda us: {"status": "ok", "median_us": us}  # noqa: E731
    results = {"bf16_sdpa": ok(5.0), "bf16_xqa": ok(6.0), "fp8_sdpa": ok(90.0), "fp8_flashinfer": ok(40.0),
               "fp8_xqa": ok(30.0)}
    assert bench.peers.best_fp8_peer(results) == ("fp8_xqa", 30.0)  # the faster BF16 peers do not count
    results["fp8_xqa"] = {"status": "error: output differs from float64 attention over its cache"}
    assert bench.peers.best_fp8_peer(results) == ("fp8_flashinfer", 40.0)
    assert bench.peers.best_fp8_peer({"bf16_sdpa": ok(5.0), "fp8_xqa": {"status": "absent"}}) is None


def test_decode_rows_are_compared_with_the_best_fp8_peer(monkeypatch):
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: None)
    monkeypatch.setattr(bench.launches, "decode_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([20.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([18.0]))
    medians = {"bf16_sdpa": 10.0, "fp8_sdpa": 80.0, "fp8_flashinfer": 36.0, "fp8_xqa": 30.0, "bf16_xqa": 12.0}
    monkeypatch.setattr(bench.peers, "run_peer", lambda name, dev, shape, config, ceiling, counters=None, power=None:
                        {"status": "ok", "median_us": medians[name], "bytes": 1})
    config = bench.config.Config(ops=("decode",), shapes=((2, 300),), bits=(3,))
    (shape,) = bench.config.build_cases(config)
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)
    assert (result.best_fp8_peer, result.vs_best_fp8) == ("fp8_xqa", 1.5)
    row = dataclasses.asdict(result)
    cells = dict(zip(bench.report.TABLE_COLUMNS, bench.report.table_rows([row])[0]))
    assert cells["vs best fp8"] == "1.50x" and cells["xqa fp8 us"] == "30.00" and cells["xqa bf16 us"] == "12.00"
    monkeypatch.setattr(bench.peers, "run_peer", lambda *args, **kwargs: {"status": "absent"})
    result = bench.run._Runner(FakeRunnerDevice(), config, 4000.0).case(shape)
    assert (result.best_fp8_peer, result.vs_best_fp8) == (None, None)
    assert dict(zip(bench.report.TABLE_COLUMNS, bench.report.table_rows([dataclasses.asdict(result)])[0]))[
        "vs best fp8"] == "-"


def _paged_case(torch, rng, dtype, batch=3, block_size=4, kv_heads=2, group=4, head_dim=16, lengths=(5, 9, 1)):
    """A small paged cache (NHD pages, each sequence's pages in shuffled order), its query and the
    float64 attention over its values, computed with NumPy."""
    pages_per_seq = -(-max(lengths) // block_size)
    k = rng.standard_normal((batch * pages_per_seq, block_size, kv_heads, head_dim))
    v = rng.standard_normal(k.shape)
    q = rng.standard_normal((batch, kv_heads * group, head_dim))
    tables = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    k_t, v_t = torch.tensor(k).to(dtype), torch.tensor(v).to(dtype)
    k_vals, v_vals = k_t.float().double().numpy(), v_t.float().double().numpy()  # what the pages hold
    want = np.zeros(q.shape)
    scale = head_dim ** -0.5
    for s, length in enumerate(lengths):
        rows_k = k_vals[tables[s]].reshape(-1, kv_heads, head_dim)[:length]
        rows_v = v_vals[tables[s]].reshape(-1, kv_heads, head_dim)[:length]
        for h in range(kv_heads * group):
            scores = rows_k[:, h // group] @ q[s, h] * scale
            weights = np.exp(scores - scores.max())
            want[s, h] = weights @ rows_v[:, h // group] / weights.sum()
    return torch.tensor(q), k_t, v_t, torch.tensor(tables), np.array(lengths, dtype=np.int32), want, scale


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_paged_peer_outputs_are_checked_against_float64_attention(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    q, k, v, tables, lengths, want, scale = _paged_case(torch, rng, getattr(torch, dtype))
    check = bench.peers.check_paged_output
    exact = torch.tensor(want)
    assert check(torch, exact, q, k, v, tables.__getitem__, lengths, scale) < 1e-9
    # A peer that read another page order, used another scale or attended fewer positions is caught.
    shuffled = lambda s: tables[s].flip(0)  # noqa: E731
    for wrong in [lambda: check(torch, exact, q, k, v, shuffled, lengths, scale),
                  lambda: check(torch, exact, q, k, v, tables.__getitem__, lengths, 4 * scale),
                  lambda: check(torch, exact, q, k, v, tables.__getitem__, np.array([3, 9, 1], dtype=np.int32), scale)]:
        with pytest.raises(bench.peers.PeerUnavailable, match="^error: output differs"):
            wrong()

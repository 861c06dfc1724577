"""The benchmark harness's prefill rows (``bench --op prefill``): their cases, counts, launches,
peers, report, JSON and comparison without a GPU, and one tiny end-to-end run on a GPU."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import sys
import types

import numpy as np
import pytest

import fp8kturbov.ops
import fp8kturbov.tools.bench.config
import fp8kturbov.tools.bench.launches
import fp8kturbov.tools.bench.prefill_peers
import fp8kturbov.tools.bench.report
import fp8kturbov.tools.bench.rows
import fp8kturbov.tools.bench.run
import fp8kturbov.tools.bench.timing
from fp8kturbov._device import Device
from fp8kturbov.tools import bench, compare, console
from fp8kturbov.tools.cli import build_parser, config_from_args, main
from test_bench import DEVICE, TIMING_GATE, FakeRunnerDevice, fake_rows

Shape, Config = bench.config.Shape, bench.config.Config
PREFILL_2X300 = Shape("prefill", 3, 2, 300, 128, 32, 8, 16, q_len=16)
PREFILL_1X8K = Shape("prefill", 3, 1, 8192, 128, 32, 8, 16, q_len=512)
PEER_NAMES = list(bench.prefill_peers.PEERS)


# ---- Options and cases -----------------------------------------------------------------------------


def test_prefill_options_become_a_config():
    args = build_parser().parse_args(["bench", "--op", "prefill", "--shapes", "1x8k,2x300", "--chunks", "16,300",
                                      "--bits", "2,4", "--head-dim", "64", "--iters", "9", "--sets", "2"])
    assert config_from_args(args) == Config(ops=("prefill",), shapes=((1, 8192), (2, 300)), chunks=(16, 300),
                                            bits=(2, 4), head_dims=(64,), iters=9, sets=2)
    # Without --shapes a prefill run takes shapes whose contexts hold every default chunk; others the decode's.
    config = config_from_args(build_parser().parse_args(["bench", "--op", "prefill"]))
    assert config.shapes == bench.config.DEFAULT_PREFILL_SHAPES and config.chunks == (16, 128, 512, 2048, 8192)
    assert min(context for _, context in config.shapes) >= max(config.chunks)
    assert config_from_args(build_parser().parse_args(["bench"])).shapes == bench.config.DEFAULT_DECODE_SHAPES
    # "all" is the memory-bound ops: the prefill runs only when named.
    assert config_from_args(build_parser().parse_args(["bench"])).ops == ("decode", "write")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--op", "prefill", "--chunks", "0"], "argument --chunks: '0' is not a positive integer"),
    (["bench", "--op", "prefill", "--chunks", "16,x"], "argument --chunks: 'x' is not a positive integer"),
    (["bench", "--op", "prefill", "--chunks", "16,"], "argument --chunks"),
])
def test_cli_rejects_bad_chunks_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_chunk_longer_than_a_context_is_refused(capsys):
    assert main(["bench", "--op", "prefill", "--shapes", "1x8192,2x1024", "--chunks", "512,2048"]) == 2
    assert capsys.readouterr().err == ("python -m fp8kturbov bench: error: chunk 2048 is longer than the context "
                                       "of prefill shape 2x1024\n")
    with pytest.raises(ValueError, match=re.escape("chunk 0 must be >= 1")):
        Config(ops=("prefill",), shapes=((1, 64),), chunks=(0,))
    with pytest.raises(ValueError, match="chunks is empty"):
        Config(ops=("prefill",), shapes=((1, 64),), chunks=())
    with pytest.raises(ValueError, match=re.escape("the prefill needs a head_dim in (64, 128, 256), not 512")):
        Config(ops=("prefill",), shapes=((1, 64),), chunks=(16,), head_dims=(128, 512))
    assert Config(ops=("prefill",), shapes=((1, 64),), chunks=(64,)).chunks == (64,)  # N == L: a whole prefill
    assert Config(ops=("decode",), shapes=((1, 64),)).shapes == ((1, 64),)  # chunks matter to the prefill only


def test_prefill_cases_run_last_a_case_per_chunk_with_the_bits_adjacent():
    config = Config(ops=("decode", "write", "prefill"), shapes=((2, 300),), tokens=(16,), chunks=(16, 300),
                    bits=(2, 3), q_len=4, lengths="ramp", appends=("none", "fused"))
    cases = bench.config.build_cases(config)
    prefill = [c for c in cases if c.op == "prefill"]
    assert [c.op for c in cases][-4:] == ["prefill"] * 4 and len(cases) == 2 * 2 + 2 + 4
    assert [(c.q_len, c.bits) for c in prefill] == [(16, 2), (16, 3), (300, 2), (300, 3)]
    # The decode's own options do not reach it: equal lengths, compact tables, nothing appended.
    assert {(c.lengths, c.table_positions, c.whole_table_rows, c.append) for c in prefill} == {("equal", 0, False, "none")}
    assert prefill[0].label == "2x300" and prefill[0].describe() == "prefill 2b D128 2x300 chunk 16"


# ---- Counts ----------------------------------------------------------------------------------------


def brute_force_flops(shape: Shape) -> int:
    """4 (a multiply and an add in Q·Kᵀ and in P·V) per query head, head element, query token and
    position it attends, counted one token at a time."""
    pairs = 0
    for seq_len in shape.seq_lens.tolist():
        for i in range(shape.q_len):
            pairs += len(range(seq_len - shape.q_len + i + 1))  # positions 0 .. seq_len - q_len + i
    return 4 * shape.num_q_heads * shape.head_dim * pairs


@pytest.mark.parametrize("shape", [PREFILL_2X300, dataclasses.replace(PREFILL_2X300, q_len=300),
                                   dataclasses.replace(PREFILL_2X300, q_len=1, num_q_heads=8, head_dim=64),
                                   Shape("prefill", 4, 3, 77, 256, 16, 2, 32, q_len=33)])
def test_prefill_flops_count_the_causal_triangle(shape):
    assert bench.config.prefill_flops(shape) == brute_force_flops(shape)


def test_prefill_flops_by_hand():
    # A whole prefill of 4 tokens: 1 + 2 + 3 + 4 = 10 (token, position) pairs.
    assert bench.config.prefill_flops(Shape("prefill", 3, 1, 4, 128, 32, 8, 16, q_len=4)) == 4 * 32 * 128 * 10
    # 16 tokens over 300: token i attends 285 + i positions; two sequences.
    assert bench.config.prefill_flops(PREFILL_2X300) == 4 * 32 * 128 * 2 * (16 * 285 + 15 * 16 // 2)
    # 512 over 8192: 512 x 7680 positions before the chunk plus the triangle 512 x 513 / 2.
    assert bench.config.prefill_flops(PREFILL_1X8K) == 4 * 32 * 128 * (512 * 7680 + 131328)


def test_prefill_bytes_read_the_context_once():
    # 2 x 300 tokens x 8 heads x (128 K + 48 V codes + 8 V scales) bytes; q and the output: 32 rows of
    # 32 x 128 bf16; 19 pages per sequence in the table, 2 seq_lens, 3 query_start entries.
    want = 600 * 8 * 184 + 2 * 32 * 32 * 128 * 2 + (2 * 19 + 2) * 4 + 3 * 4
    assert bench.config.launch_bytes(PREFILL_2X300) == want
    # One query token per sequence still passes query_start (the decode of one token does not).
    one = dataclasses.replace(PREFILL_2X300, q_len=1)
    assert one.query_start.tolist() == [0, 1, 2] and one.query_start_bytes == 12
    assert bench.config.launch_bytes(one) == want - 2 * (32 - 2) * 32 * 128 * 2
    # Each input set holds its pools (38 pages of 16 slots), q, the output, the table and query_start.
    pools = 38 * 16 * 8 * 184
    assert bench.config.device_bytes(PREFILL_2X300, 3) == 3 * (pools + 2 * 32 * 32 * 128 * 2 + 2 * 20 * 4 + 12)


# ---- Launches --------------------------------------------------------------------------------------


class FakePoolDevice:
    """The part of `Device` that `launches.prefill_enqueues` uses: allocations, uploads (kept),
    the pools' filling (counted)."""

    stream = 7

    def __init__(self) -> None:
        self.allocs, self.uploads, self.fills = [], {}, 0

    def alloc(self, nbytes: int) -> int:
        self.allocs.append(nbytes)
        return 0x10000 * len(self.allocs)

    def upload(self, host: np.ndarray) -> int:
        address = self.alloc(host.nbytes)
        self.uploads[address] = host.copy()
        return address

    def write(self, address: int, host: np.ndarray) -> None:
        self.fills += 1

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        pass

    def memset(self, address: int, value: int, nbytes: int) -> None:
        pass


def test_prefill_enqueues_launch_the_prefill_of_each_set(monkeypatch):
    pytest.importorskip("ml_dtypes")
    asked, calls = [], []
    monkeypatch.setattr(bench.launches, "paged_prefill_workspace_bytes", lambda **scalars: asked.append(scalars) or 4096)
    monkeypatch.setattr(bench.launches, "paged_prefill_attn", lambda *args, **kwargs: calls.append((args, kwargs)))
    layout = bench.launches.case_layout(PREFILL_2X300)
    chunk = bench.launches.Chunk(np.ones(layout.k_pool_bytes, np.uint8), np.ones(layout.v_pool_bytes, np.uint8), 0.25)
    dev, config = FakePoolDevice(), Config(ops=("prefill",), shapes=((2, 300),), chunks=(16,), sets=2, sinks=True)
    enqueues = bench.launches.prefill_enqueues(dev, PREFILL_2X300, config, chunk, np.random.default_rng(0))
    assert len(enqueues) == 2 and dev.fills == 2 * 2  # each set's two pools written before any launch
    for enqueue in enqueues:
        enqueue()
    (scalars,) = asked
    inspect.signature(fp8kturbov.ops.paged_prefill_workspace_bytes).bind(**scalars)  # the library's query takes them
    assert scalars["num_query_rows"] == 32  # the partials of a split plan grow with them
    assert "sparse_v_threshold" not in scalars and scalars["max_q_len"] == 16 and scalars["k_scale"] == 0.25
    assert scalars["max_blocks_per_seq"] == 19 and scalars["num_seqs"] == 2 and scalars["v_bits"] == 3
    (args, first), (_, second) = calls
    assert first["stream"] == 7 and first["workspace_bytes"] == 4096 and first["workspace"] != second["workspace"]
    assert first["num_query_rows"] == 32 and dev.uploads[first["query_start"]].tolist() == [0, 16, 32]
    assert dev.uploads[first["sinks"]].tolist() == [0.0] * 32
    q, _, _, output, tables, seq_lens = args
    assert dev.uploads[q].dtype == np.uint16 and dev.uploads[q].size == 32 * 32 * 128
    assert dev.uploads[seq_lens].tolist() == [300, 300]
    assert sorted(dev.uploads[tables].ravel().tolist()) == list(range(38))
    assert "sparse_v_threshold" not in first and "append_key" not in first


# ---- Peers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [("flashinfer",), ("torch", "flashinfer")])
@pytest.mark.parametrize("name", PEER_NAMES)
def test_prefill_peers_without_flashinfer_are_absent(monkeypatch, name, missing):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    result = bench.prefill_peers.run_peer(name, None, PREFILL_2X300, Config(), None, 4000.0)
    assert result == {"status": "absent"}


def test_fa3_peers_are_skipped_off_hopper(monkeypatch):
    ampere = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_capability=lambda: (8, 0),
                                                              is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", ampere)
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())
    for name in ("bf16_fa3", "dequant_bf16_fa3"):
        result = bench.prefill_peers.run_peer(name, None, PREFILL_2X300, Config(), None, 4000.0)
        assert result == {"status": "skipped: flashinfer's fa3 needs compute capability 9.x"}


def _paged_prefill_case(rng, shape):
    """Standard normal q and K/V pages (NHD) of ``shape``, each sequence's pages in shuffled order."""
    k, v = (rng.standard_normal((shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim))
            for _ in range(2))
    q = rng.standard_normal((shape.query_rows, shape.num_q_heads, shape.head_dim))
    return q, k, v, rng.permutation(shape.num_blocks).reshape(shape.batch, -1)


def _attention(q, k, v, tables, shape, visible):
    """float64 attention computed with NumPy token by token, token ``i`` of sequence ``s`` over the
    first ``visible(seq_len, i)`` positions."""
    group, scale = shape.num_q_heads // shape.num_kv_heads, shape.head_dim ** -0.5
    out = np.zeros(q.shape)
    for s, seq_len in enumerate(shape.seq_lens.tolist()):
        keys, values = (pages[tables[s]].reshape(-1, shape.num_kv_heads, shape.head_dim) for pages in (k, v))
        for i in range(shape.q_len):
            row, n = s * shape.q_len + i, visible(seq_len, i)
            for h in range(shape.num_q_heads):
                scores = keys[:n, h // group] @ q[row, h] * scale
                weights = np.exp(scores - scores.max())
                out[row, h] = weights @ values[:n, h // group] / weights.sum()
    return out


def test_prefill_peer_outputs_are_checked_against_float64_causal_attention():
    torch = pytest.importorskip("torch")
    shape = Shape("prefill", 3, 2, 9, 16, 8, 2, 4, q_len=5)
    q, k, v, tables = _paged_prefill_case(np.random.default_rng(3), shape)
    causal = _attention(q, k, v, tables, shape, lambda seq_len, i: seq_len - shape.q_len + i + 1)
    check = functools.partial(bench.prefill_peers.check_prefill_output, torch, q=torch.tensor(q), k_pages=torch.tensor(k),
                              v_pages=torch.tensor(v), shape=shape)
    assert check(torch.tensor(causal), tables=torch.tensor(tables)) < 1e-9
    # A peer that attends every position, aligns the causal mask top-left, or reads another page
    # order is caught.
    unmasked = _attention(q, k, v, tables, shape, lambda seq_len, i: seq_len)
    top_left = _attention(q, k, v, tables, shape, lambda seq_len, i: i + 1)
    for got, pages in [(unmasked, tables), (top_left, tables), (causal, tables[:, ::-1].copy())]:
        with pytest.raises(bench.peers.PeerUnavailable, match="^error: output differs"):
            check(torch.tensor(got), tables=torch.tensor(pages))


# ---- The runner, the report, the JSON --------------------------------------------------------------


def ok(median_us: float) -> dict:
    return {"status": "ok", **bench.rows.measured(1000, bench.timing.Timing.of([median_us]), 4000.0)}


FA3_OFF = {"status": "skipped: flashinfer's fa3 needs compute capability 9.x"}


def prefill_runner_result(monkeypatch, config: Config, peer_runs: list) -> list:
    """The results of ``config``'s prefill cases, timed at 1000 µs (in a graph 990 µs), with peers
    that report fixed times (FA3's round trip skipped) and log what they ran."""
    medians = {"bf16_fa2": 900.0, "bf16_fa3": 700.0, "dequant_bf16_fa2": 1500.0}
    monkeypatch.setattr(bench.launches, "encode_chunk", lambda shape, tokens, rng: "chunk")
    monkeypatch.setattr(bench.launches, "prefill_enqueues", lambda dev, shape, config, chunk, rng: [])
    monkeypatch.setattr(bench.timing, "time_graphs", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([1000.0]))
    monkeypatch.setattr(bench.timing, "time_graph_chain", lambda dev, enqueues, iters, warmup: bench.timing.Timing.of([990.0]))
    monkeypatch.setattr(bench.timing, "time_plain_read", lambda *args: pytest.fail("no plain read for the prefill"))

    def run_peer(name, dev, shape, config, chunk, ceiling, counters=None, power=None):
        peer_runs.append((name, shape.bits, shape.q_len, chunk))
        return ok(medians[name]) if name in medians else FA3_OFF

    monkeypatch.setattr(bench.prefill_peers, "run_peer", run_peer)
    runner = bench.run._Runner(FakeRunnerDevice(), config, 4000.0)
    return [runner.case(shape) for shape in bench.config.build_cases(config)]


def test_prefill_rows_get_their_peers_once_per_shape_and_the_round_trip_per_bits(monkeypatch):
    peer_runs = []
    config = Config(ops=("prefill",), shapes=((2, 300),), chunks=(16, 300), bits=(2, 3))
    results = prefill_runner_result(monkeypatch, config, peer_runs)
    assert [(r.q_len, r.bits, r.median_us, r.in_graph_us) for r in results] == [
        (16, 2, 1000.0, 990.0), (16, 3, 1000.0, 990.0), (300, 2, 1000.0, 990.0), (300, 3, 1000.0, 990.0)]
    bf16 = [run for run in peer_runs if run[0].startswith("bf16")]
    trips = [run for run in peer_runs if run[0].startswith("dequant")]
    assert bf16 == [("bf16_fa2", 2, 16, "chunk"), ("bf16_fa3", 2, 16, "chunk"),
                    ("bf16_fa2", 2, 300, "chunk"), ("bf16_fa3", 2, 300, "chunk")]
    assert len(trips) == 2 * 2 * 2 and {(bits, q_len) for _, bits, q_len, _ in trips} == {(2, 16), (3, 16), (2, 300), (3, 300)}
    row = results[1]
    assert (row.best_bf16_prefill_peer, row.vs_bf16_prefill) == ("bf16_fa3", 0.7)
    assert (row.best_round_trip_peer, row.vs_round_trip) == ("dequant_bf16_fa2", 1.5)
    assert row.flops == bench.config.prefill_flops(PREFILL_2X300)
    assert row.tflops == pytest.approx(row.flops / 1e-3 / 1e12)
    assert row.plain_read_us is None and row.best_fp8_peer is None
    peer_runs.clear()
    (alone,) = prefill_runner_result(monkeypatch, dataclasses.replace(config, chunks=(16,), bits=(3,), peers=False), peer_runs)
    assert peer_runs == [] and alone.peers == {} and alone.vs_round_trip is None


def prefill_row() -> dict:
    """A prefill row of 512 tokens over 1 x 8192 at 1000 µs (990 in a graph): its BF16 prefill
    fastest with FA3 (700 µs), its round trip with FA2 (1500 µs; FA3 skipped)."""
    result = bench.rows.Result.for_shape(PREFILL_1X8K)
    result.record(bench.timing.Timing.of([1000.0]), 4000.0)
    result.in_graph_us = 990.0
    result.peers = {"bf16_fa2": ok(900.0), "bf16_fa3": ok(700.0), "dequant_bf16_fa2": ok(1500.0),
                    "dequant_bf16_fa3": FA3_OFF}
    result.best_bf16_prefill_peer, result.vs_bf16_prefill = "bf16_fa3", 0.7
    result.best_round_trip_peer, result.vs_round_trip = "dequant_bf16_fa2", 1.5
    return dataclasses.asdict(result)


def test_prefill_row_renders_in_its_own_table():
    row = prefill_row()
    # 4 x 32 heads x 128 x (512 x 7680 + 512 x 513 / 2) = 66.58e9 operations in 1 ms; 8192 tokens x
    # 1472 cache bytes, 2 x 512 rows of 32 x 128 bf16, 513 table entries, 2 query_start entries.
    assert bench.report.prefill_rows([row]) == [
        ("prefill", "3", "1x8192", "512", "128", "1000.00", "990.00", "66.6", "20.4", "700.00 fa3", "1500.00 fa2",
         "1.50x", "0.70x", "")]
    assert bench.report.table_rows([row]) == []  # not in the roofline table
    read, copy, launch, *_ = fake_rows()
    report = bench.report.format_report([read, copy, launch, row], DEVICE, Config(ops=("prefill",)))
    lines = report.splitlines()
    assert lines[0].split() == " ".join(bench.report.PREFILL_COLUMNS).split()
    assert "prefill 1x8192 chunk 512 D128 dequant_bf16_fa3: skipped: flashinfer's fa3 needs compute capability 9.x" in lines
    assert any(line.startswith("prefill: each sequence's chunk") for line in lines)
    # Beside the decode and write rows, a table of its own after theirs.
    both = bench.report.format_report([*fake_rows(), row], DEVICE, Config(ops=("decode", "write", "prefill"),
                                                                           shapes=((1, 32768),)))
    assert both.splitlines()[0].split()[:4] == ["op", "bits", "shape", "D"]
    assert both.index("vs best fp8") < both.index("vs round trip")


def test_prefill_cell_without_a_peer_says_why():
    row = prefill_row()
    row.update(peers={name: {"status": "absent"} for name in PEER_NAMES}, best_bf16_prefill_peer=None,
               best_round_trip_peer=None, vs_bf16_prefill=None, vs_round_trip=None)
    assert bench.report.prefill_rows([row])[0][-5:] == ("absent", "absent", "-", "-", "")
    row.update(peers={})  # --no-peers
    assert bench.report.prefill_rows([row])[0][-5:] == ("-", "-", "-", "-", "")


def test_prefill_json_rows(tmp_path):
    path = tmp_path / "bench.json"
    bench.rows.write_json(path, [*fake_rows(), prefill_row()], DEVICE, Config(ops=("prefill",), shapes=((1, 8192),)))
    document = json.loads(path.read_text())
    keys = {f.name for f in dataclasses.fields(bench.rows.Result)}
    assert all(set(row) == keys for row in document["rows"])
    row = document["rows"][-1]
    assert (row["op"], row["shape"], row["q_len"], row["context"], row["bits"]) == ("prefill", "1x8192", 512, 8192, 3)
    assert row["flops"] == 4 * 32 * 128 * (512 * 7680 + 131328) and row["tflops"] == pytest.approx(66.576187392)
    assert (row["vs_round_trip"], row["best_round_trip_peer"]) == (1.5, "dequant_bf16_fa2")
    assert set(row["peers"]) == set(PEER_NAMES) and row["peers"]["bf16_fa3"]["median_us"] == 700.0
    assert [r["flops"] for r in document["rows"][:-1]] == [None] * (len(document["rows"]) - 1)
    assert document["config"]["chunks"] == [16, 128, 512, 2048, 8192] and document["config"]["ops"] == ["prefill"]


# ---- compare ---------------------------------------------------------------------------------------


def timed_prefill(shape: Shape, median_us: float) -> dict:
    result = bench.rows.Result.for_shape(shape)
    result.record(bench.timing.Timing.of([median_us]), 4000.0)
    return dataclasses.asdict(result)


def test_compare_matches_prefill_rows_by_their_chunk(tmp_path):
    chunk_2k = dataclasses.replace(PREFILL_1X8K, q_len=2048)
    baseline, candidate = tmp_path / "main.json", tmp_path / "branch.json"
    bench.rows.write_json(baseline, [*fake_rows(), timed_prefill(PREFILL_1X8K, 1000.0), timed_prefill(chunk_2k, 3000.0)],
                          DEVICE, Config(ops=("prefill",), shapes=((1, 8192),), chunks=(512, 2048)))
    bench.rows.write_json(candidate, [*fake_rows(), timed_prefill(PREFILL_1X8K, 1100.0),
                                      timed_prefill(dataclasses.replace(PREFILL_1X8K, q_len=16), 500.0)],
                          DEVICE, Config(ops=("prefill",), shapes=((1, 8192),), chunks=(16, 512)))
    comparison = compare.compare_files(baseline, candidate)
    assert comparison.warnings == []  # the chunks choose the cases: no warning
    prefill = [r for r in comparison.rows if r.op == "prefill"]
    assert [(r.describe(), r.only_in) for r in prefill] == [
        ("prefill 3b D128 1x8192 chunk 512", ""), ("prefill 3b D128 1x8192 chunk 2048", "baseline"),
        ("prefill 3b D128 1x8192 chunk 16", "candidate")]
    assert prefill[0].change_pct == pytest.approx(10.0) and prefill[0].is_case
    assert compare.slower_than(comparison.rows, 2.0) == [prefill[0]]
    assert "prefill 3b D128 1x8192 chunk 512" in compare.format_comparison(comparison)


def test_compare_tells_a_prefill_from_a_decode_of_as_many_query_tokens():
    decode = timed_prefill(dataclasses.replace(PREFILL_1X8K, op="decode", q_len=16), 40.0)
    prefill = timed_prefill(dataclasses.replace(PREFILL_1X8K, q_len=16), 400.0)
    records = compare.compare_rows([decode], [prefill])
    assert [(r.describe(), r.only_in) for r in records] == [("decode 3b D128 1x8192 q16", "baseline"),
                                                             ("prefill 3b D128 1x8192 chunk 16", "candidate")]


# ---- On a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_prefill_one_tiny_shape(tmp_path):
    config = Config(ops=("prefill",), shapes=((2, 300),), chunks=(16, 300), bits=(3,), iters=5, warmup=2, sets=2,
                    ceiling_bytes=8 * console.MiB)
    with Device(timing_gate=TIMING_GATE) as dev:
        device = bench.report.describe_device(dev)
        rows = bench.run.run_benchmarks(config, device=dev, show_progress=False)
    assert [row["op"] for row in rows] == ["read", "copy", "launch", "prefill", "prefill"]
    for row, chunk in zip(rows[3:], (16, 300)):
        assert row["q_len"] == chunk and row["samples"] == 5 and row["median_us"] > 0 and row["in_graph_us"] > 0
        assert row["flops"] == bench.config.prefill_flops(dataclasses.replace(PREFILL_2X300, q_len=chunk))
        assert row["tflops"] > 0 and row["plain_read_us"] is None
        assert set(row["peers"]) == set(PEER_NAMES)
        for name, peer in row["peers"].items():
            assert peer["status"] in ("ok", "absent") or (
                name.endswith("fa3") and peer["status"].startswith("skipped: ")), (name, peer["status"])
        if row["peers"]["bf16_fa2"]["status"] == "ok":
            assert row["vs_bf16_prefill"] > 0 and row["best_bf16_prefill_peer"] in ("bf16_fa2", "bf16_fa3")
    assert "prefill: each sequence's chunk" in bench.report.format_report(rows, device, config)
    bench.rows.write_json(tmp_path / "bench.json", rows, device, config)

"""Command line: ``python -m fp8kturbov COMMAND [options]``.

Commands: ``bench`` (decode and write against the memory roofline; see `fp8kturbov.tools.bench`),
``compare`` (two ``bench --json`` runs row by row, in one or more rounds; see `fp8kturbov.tools.compare`),
``info`` (library, architectures, driver and GPUs; see `fp8kturbov.tools.info`), ``demo`` (write and
decode a ragged batch, checked against the NumPy reference; see `fp8kturbov.tools.demo`), ``quality``
(V quantisation error of each width/encoder/rotation and of FP8/NVFP4 peers on synthetic data, NumPy
reference only; see `fp8kturbov.tools.quality`), ``generate`` and ``perplexity`` (a Hugging Face
model on the compressed cache; see `fp8kturbov.tools.generate`, `fp8kturbov.tools.perplexity`). Top-level
flags for build systems: ``--include-dir`` (the folder holding ``fp8kturbov.h``) and
``--library`` (the path of ``libfp8kturbov.so``). This module holds the parser and the handlers
only. Each command is a subparser with a ``handler(args) -> exit status``; add one to
`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from fp8kturbov import Fp8kturbovError, library_path
from fp8kturbov._device import BenchError, Device, first_line
from fp8kturbov._limits import DEFAULT_SPARSE_V_THRESHOLD

from . import compare, demo, info, model_kv, quality, quality_in_loop
from . import generate, perplexity  # torch and transformers are imported when they run
from .bench.config import (APPENDS, BANDWIDTH_OPS, DEFAULT_PREFILL_SHAPES, LENGTHS, MAX_Q_LEN, MAX_SEED, OPS,
                           V_ENCODER_NAMES, V_ROTATION_NAMES, Config, parse_appends, parse_q_len, parse_seed,
                           parse_shapes)
from .arguments import COUNT, COUNT_OR_ZERO, COUNTS, typed
from .console import MiB

PROG = "python -m fp8kturbov"


def _shapes_text(shapes: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{batch}x{context}" for batch, context in shapes)


def add_head_arguments(parser: argparse.ArgumentParser, num_q_heads: int, num_kv_heads: int,
                       block_size: int) -> None:
    """``--q-heads``, ``--kv-heads`` and ``--block-size`` (tokens per page), with these defaults."""
    parser.add_argument("--q-heads", type=COUNT, metavar="N", default=num_q_heads,
                        help=f"query heads (default: {num_q_heads})")
    parser.add_argument("--kv-heads", type=COUNT, metavar="N", default=num_kv_heads,
                        help=f"KV heads (default: {num_kv_heads})")
    parser.add_argument("--block-size", type=COUNT, metavar="N", default=block_size,
                        help=f"tokens per page (default: {block_size})")


def add_q_len_argument(parser: argparse.ArgumentParser, q_len: int) -> None:
    """``--q-len`` (query tokens per sequence, 1..MAX_Q_LEN) with this default."""
    parser.add_argument("--q-len", type=typed(parse_q_len), metavar="N", default=q_len,
                        help=f"decode N query tokens per sequence (multi-token decode through "
                        f"query_start), 1..{MAX_Q_LEN} (default: {q_len})")


def add_seed_argument(parser: argparse.ArgumentParser, seed: int) -> None:
    """``--seed`` (of NumPy's default_rng, 0..MAX_SEED) with this default."""
    parser.add_argument("--seed", type=typed(parse_seed), metavar="N", default=seed,
                        help=f"random seed, 0..{MAX_SEED} (default: {seed})")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``; the defaults are `fp8kturbov.tools.Config`'s."""
    d = Config()
    join = ",".join
    parser.add_argument("--op", choices=(*OPS, "all"), default="all",
                        help=f"which operation to time; all: {' and '.join(BANDWIDTH_OPS)} (the prefill, "
                        "long and compute-bound, runs only when named) (default: all)")
    parser.add_argument("--shapes", type=typed(parse_shapes), default=None,
                        metavar="BxL,...", help="decode and prefill shapes, batch x context tokens; a 'k' "
                        f"suffix means x1024 (default: {_shapes_text(d.shapes)}; with --op prefill: "
                        f"{_shapes_text(DEFAULT_PREFILL_SHAPES)})")
    parser.add_argument("--chunks", type=COUNTS, default=d.chunks, metavar="N,...",
                        help="prefill chunks, query tokens per sequence: the last N of each shape's L "
                        f"context tokens, N <= L (default: {join(map(str, d.chunks))})")
    parser.add_argument("--tokens", type=COUNTS, default=d.tokens, metavar="N,...",
                        help=f"write shapes, token rows per launch (default: {join(map(str, d.tokens))})")
    parser.add_argument("--bits", type=COUNTS, default=d.bits, metavar="B,...",
                        help=f"V code widths (default: {join(map(str, d.bits))})")
    parser.add_argument("--head-dim", type=COUNTS, default=d.head_dims, metavar="D,...",
                        help=f"head dims (default: {join(map(str, d.head_dims))})")
    add_head_arguments(parser, d.num_q_heads, d.num_kv_heads, d.block_size)
    parser.add_argument("--iters", type=COUNT, metavar="N", default=d.iters,
                        help=f"timed samples per case; the median is reported (default: {d.iters})")
    parser.add_argument("--warmup", type=COUNT_OR_ZERO, metavar="N", default=d.warmup,
                        help=f"untimed launches before them (default: {d.warmup})")
    parser.add_argument("--sets", type=COUNT, metavar="N", default=d.sets,
                        help=f"input sets rotated among, so that replays do not just hit L2 "
                        f"(default: {d.sets})")
    parser.add_argument("--sparse-v-threshold", type=float, metavar="TAU", default=d.sparse_v_threshold,
                        help=f"decode's sparse-V threshold, 0 = exact (default: {d.sparse_v_threshold:g})")
    add_seed_argument(parser, d.seed)
    parser.add_argument("--ceiling-mib", type=COUNT, metavar="N", default=d.ceiling_bytes // MiB,
                        help="MiB read to measure the bandwidth ceiling (and copied beside it); keep "
                        "it well above the L2 size (60 MB on an H200), or the ceiling is the L2's "
                        f"(default: {d.ceiling_bytes // MiB})")
    parser.add_argument("--checked", action="store_true",
                        help="run the library's launches in checked mode (pool capacity and an "
                        "error word), to measure its cost")
    parser.add_argument("--v-encoder", choices=V_ENCODER_NAMES, default=d.v_encoder,
                        help=f"the write's V encoder (default: {d.v_encoder})")
    parser.add_argument("--soft-cap", type=float, metavar="CAP", default=d.soft_cap,
                        help="decode with logit soft-capping at CAP (default: off)")
    parser.add_argument("--sinks", action="store_true", help="decode with attention sinks")
    parser.add_argument("--v-rotation", choices=V_ROTATION_NAMES, default=d.v_rotation,
                        help="write and decode with this V rotation (hadamard: head_dim 128, 256, "
                        f"512; default: {d.v_rotation})")
    add_q_len_argument(parser, d.q_len)
    parser.add_argument("--lengths", choices=LENGTHS, default=d.lengths,
                        help="decode sequence lengths of a shape BxL: all L ('equal'), or sequence i "
                        "of B holding ceil(L * (i + 1) / B) tokens ('ramp': mixed lengths up to L, "
                        f"about half the tokens; the dense peers are not run) (default: {d.lengths})")
    parser.add_argument("--append", type=typed(parse_appends), metavar="MODE,...", default=d.appends,
                        help="decode rows per shape, one per mode, by how the step writes each query row's "
                        "new token before attending it: none (the decode alone), fused (the decode's "
                        "fused append: one launch), write (the cache write, then the decode) "
                        f"(choices: {join(APPENDS)}; default: {join(d.appends)})")
    parser.add_argument("--table-positions", type=COUNT, metavar="N", default=d.table_positions,
                        help="decode block-table rows N positions wide (an engine's longest context; "
                        "N >= every L), passed as a column slice of the shape's pages "
                        "(block_tables_stride) (default: rows of the shape's pages)")
    parser.add_argument("--whole-table-rows", action="store_true",
                        help="with --table-positions, pass the rows whole (max_blocks_per_seq = N / "
                        "block size): the plan is then sized for N positions, not for L")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the BF16 (torch SDPA) and FP8 (flashinfer) decode peers and the "
                        "prefill's flashinfer peers")
    parser.add_argument("--power-window", type=float, metavar="SECONDS", default=d.power_window_s,
                        help="after each row's timing (and each peer's), run its launches back to back "
                        "for about SECONDS more and report the board's mean power and the energy per "
                        "launch, from NVML's energy counter, which moves about every 0.1 s: 2 or more "
                        "give a few per cent (default: off)")
    parser.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    parser.add_argument("--no-timing-gate", action="store_true",
                        help="queue the timed launches without holding the stream (short launches "
                        "then include host time); for runs under tools that keep a launch from returning "
                        "while its stream waits: with the gate, the bench never finished under "
                        "compute-sanitizer --tool initcheck")
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="write a roofline plot (needs matplotlib: the [plot] extra)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The `fp8kturbov.tools.Config` of parsed ``bench`` options (raises ValueError). Without
    ``--shapes``, the `Config`'s default for the op (a prefill's contexts hold every default chunk)."""
    return Config(
        ops=BANDWIDTH_OPS if args.op == "all" else (args.op,), shapes=args.shapes, tokens=args.tokens,
        chunks=args.chunks,
        bits=args.bits, head_dims=args.head_dim, num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads, block_size=args.block_size, iters=args.iters,
        warmup=args.warmup, sets=args.sets, sparse_v_threshold=args.sparse_v_threshold,
        checked=args.checked, v_encoder=args.v_encoder, soft_cap=args.soft_cap, sinks=args.sinks,
        v_rotation=args.v_rotation, q_len=args.q_len, lengths=args.lengths, appends=args.append,
        table_positions=args.table_positions, whole_table_rows=args.whole_table_rows,
        peers=not args.no_peers, seed=args.seed,
        ceiling_bytes=args.ceiling_mib * MiB, power_window_s=args.power_window)


def _error(message: str, command: str = "bench") -> None:
    """``<prog> <command>: error: <message>`` on stderr."""
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    """``bench``: run `fp8kturbov.tools.bench.run.run_benchmarks` on GPU 0, print the report, write the
    JSON and the plot where asked."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        _error(str(exc))
        return 2
    from .bench import report, run  # the harness needs the library: imported where it runs
    from .bench.rows import write_json

    try:
        with Device(timing_gate=not args.no_timing_gate) as dev:
            device = report.describe_device(dev)
            rows = run.run_benchmarks(config, device=dev, show_progress=not args.no_progress)
    except (BenchError, Fp8kturbovError) as exc:
        _error(first_line(exc))
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    print(report.format_report(rows, device, config))
    try:
        if args.json:
            write_json(args.json, rows, device, config)
        why_not = report.write_plot(args.plot, rows) if args.plot else None
    except OSError as exc:
        _error(first_line(exc))
        return 1
    if why_not:
        print(f"{PROG} bench: plot skipped: {why_not}", file=sys.stderr)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """``compare``: print `fp8kturbov.tools.compare.format_comparison` of the two files (and of the
    further rounds' pairs, combined: `fp8kturbov.tools.compare.compare_runs`); with ``--max-slowdown``,
    the verdict too, and exit status 1 where a decode, write or prefill row is slower than the baseline by
    more than that (over several rounds, by the medians) or has a time in one file only. Exit
    status 2 where a file is not a bench JSON (the exit statuses: `fp8kturbov.tools.compare`)."""
    try:
        comparison = compare.compare_runs([(args.baseline, args.candidate), *(args.round or [])])
    except (ValueError, OSError) as exc:
        _error(first_line(exc), "compare")
        return 2
    print(compare.format_comparison(comparison))
    if args.max_slowdown is None:
        return 0
    slower = compare.slower_than(comparison.rows, args.max_slowdown)
    unjudged = compare.unjudged_rows(comparison.rows)
    print(compare.verdict_line(slower, unjudged, args.max_slowdown))
    return 1 if slower or unjudged else 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``compare``."""
    parser.add_argument("baseline", metavar="BASELINE.json",
                        help="the reference run's 'bench --json' file (e.g. a build of main)")
    parser.add_argument("candidate", metavar="CANDIDATE.json",
                        help="the run compared with it (e.g. a build of a branch, same GPU)")
    parser.add_argument("--round", nargs=2, action="append", metavar=("BASELINE.json", "CANDIDATE.json"),
                        help="a further round: the same two builds run again (repeatable). Each time "
                        "is then the median over the rounds, each change that of the medians, and "
                        "every round's change is listed too")
    parser.add_argument("--max-slowdown", type=typed(compare.parse_percent), metavar="PCT",
                        help="exit with status 1 where a decode, write or prefill row is more than PCT %% "
                        "slower than in the baseline (over several rounds: its median), or was "
                        "measured in one file and skipped in the other (default: no limit, status 0)")


def print_paths(args: argparse.Namespace) -> int:
    """``--include-dir`` and/or ``--library``: one path per line, in that order."""
    try:
        lines = [str(info.include_dir())] if args.include_dir else []
    except FileNotFoundError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.library:
        lines.append(str(library_path().resolve()))
    print("\n".join(lines))
    return 0


def run_info(args: argparse.Namespace) -> int:
    """``info``: print `fp8kturbov.tools.info.summary`."""
    print("\n".join(info.summary()))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """``demo``: build the case, run the NumPy reference and (on a GPU) the kernels, print the
    comparison; exit status 1 where the kernels differ from the reference."""
    try:
        case = demo.build_demo_case(args)
    except ImportError as exc:
        _error(f"the demo needs ml-dtypes ({first_line(exc)}); pip install ml-dtypes", "demo")
        return 1
    except (ValueError, OSError) as exc:
        _error(first_line(exc), "demo")
        return 2
    print(demo.describe_case(case, args), flush=True)
    dev, why = (None, "--cpu") if args.cpu else demo.open_device()
    if dev is None:
        print(f"NumPy reference only ({why}): no kernel is run, checked or timed", flush=True)
    tau = args.sparse_v_threshold
    try:
        pools = demo.reference_pools(case, not args.no_progress)
        want = demo.reference_decode(case, *pools, tau)
        lines, ok = ([], True) if dev is None else demo.gpu_report(
            demo.run_kernels(dev, case, tau, args.iters), case, pools, want, args.iters)
    except (BenchError, Fp8kturbovError) as exc:
        _error(first_line(exc), "demo")
        return 1
    except KeyboardInterrupt:
        _error("interrupted", "demo")
        return 130
    finally:
        if dev is not None:
            dev.close()
    error = demo.relative_error_per_head(want, demo.exact_attention(case))
    lines.append(f"format error, reference decode (sparse V threshold {tau:g}) vs unquantised "
                 f"float64 attention: relative error per head {demo.error_text(error)}")
    if dev is not None:
        lines.append("PASS: the kernels match the reference" if ok else
                     "FAIL: the kernels differ from the reference")
    print("\n".join(lines))
    return 0 if ok else 1


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``demo``."""
    parser.add_argument("--bits", type=int, choices=(2, 3, 4), default=3,
                        help="V code width (default: 3)")
    parser.add_argument("--head-dim", type=COUNT, metavar="D", default=128,
                        help="elements per head (default: 128)")
    add_head_arguments(parser, 32, 8, 16)
    parser.add_argument("--seq-lens", type=COUNTS, metavar="L,...",
                        help="tokens per sequence; a 'k' suffix means x1024 (default: "
                        f"{','.join(map(str, demo.DEFAULT_SEQ_LENS))}; with --kv-file: its "
                        "seq_lens or one sequence)")
    add_seed_argument(parser, 0)
    parser.add_argument("--kv-file", metavar="PATH.npz",
                        help="take K and V from arrays k, v [num_tokens, kv_heads, head_dim] "
                        "(sequences back to back; they set --kv-heads and --head-dim), and "
                        "seq_lens and q [num_seqs * q-len, q_heads, head_dim] where present")
    parser.add_argument("--sparse-v-threshold", type=float, metavar="TAU", default=DEFAULT_SPARSE_V_THRESHOLD,
                        help=f"decode's sparse-V threshold, 0 = exact (default: {DEFAULT_SPARSE_V_THRESHOLD:g})")
    parser.add_argument("--v-encoder", choices=V_ENCODER_NAMES, default="matched_norm",
                        help="the write's V encoder (default: matched_norm)")
    parser.add_argument("--soft-cap", type=float, metavar="CAP", default=0.0,
                        help="decode with logit soft-capping at CAP (default: off)")
    parser.add_argument("--sinks", action="store_true",
                        help="decode with attention sinks (random logits, N(0, 4), per query head)")
    parser.add_argument("--v-rotation", choices=V_ROTATION_NAMES, default="none",
                        help="write and decode with this V rotation (hadamard: head_dim 128, 256, "
                        "512; default: none)")
    add_q_len_argument(parser, 1)
    parser.add_argument("--iters", type=COUNT, metavar="N", default=20,
                        help="timed runs per kernel; the median is reported (default: 20)")
    parser.add_argument("--cpu", action="store_true",
                        help="run the NumPy reference only, even where a GPU is usable")
    parser.add_argument("--no-progress", action="store_true", help="no progress output on stderr")


def add_quality_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``quality``; the defaults are `fp8kturbov.tools.quality.Config`'s."""
    d = quality.Config()
    add_seed_argument(parser, d.seed)
    parser.add_argument("--tokens", type=COUNT, metavar="N", default=d.tokens,
                        help=f"cached positions (default: {d.tokens})")
    parser.add_argument("--queries", type=COUNT, metavar="N", default=d.queries,
                        help=f"query vectors per KV head (default: {d.queries})")
    parser.add_argument("--kv-heads", type=COUNT, metavar="N", default=d.num_kv_heads,
                        help=f"KV heads (default: {d.num_kv_heads})")
    parser.add_argument("--head-dim", type=COUNT, metavar="D", default=d.head_dim,
                        help=f"elements per head; the rotation needs 128, 256 or 512 (default: {d.head_dim})")
    parser.add_argument("--bits", type=COUNTS, metavar="B,...", default=d.bits,
                        help=f"V code widths (default: {','.join(map(str, d.bits))})")
    parser.add_argument("--model", action="store_true",
                        help="also the K/V/queries of a real model, SmolLM2-135M run in NumPy (about a "
                             f"minute; install it with: {model_kv.INSTALL_HINT})")
    parser.add_argument("--model-tokens", type=COUNT, metavar="N", default=d.model_tokens,
                        help="run the model over the first N tokens of its text (default: all, about 400; "
                             f"with --in-loop {quality_in_loop.DEFAULT_TOKENS})")
    parser.add_argument("--in-loop", action="store_true",
                        help="with --model: perplexity, KL and top-1 agreement with every layer reading K and V "
                             "through the format (fp8kturbov.tools.quality_in_loop; about twelve minutes)")
    parser.add_argument("--text", metavar="FILE", help="with --in-loop: the UTF-8 text to run the model over "
                        "(default: the bundled chapters of Alice's Adventures in Wonderland)")
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")


def run_quality_in_loop(args: argparse.Namespace) -> int:
    """``quality --model --in-loop``: `fp8kturbov.tools.quality_in_loop.run_in_loop`, its table and JSON."""
    try:
        config = quality_in_loop.InLoopConfig(text=args.text, bits=tuple(args.bits),
                                              tokens=args.model_tokens or quality_in_loop.DEFAULT_TOKENS)
    except (ValueError, OSError) as exc:
        _error(first_line(exc), "quality")
        return 2
    return _quality_report(quality_in_loop, config, args.json)


def run_quality(args: argparse.Namespace) -> int:
    """``quality``: run `fp8kturbov.tools.quality.run_quality`, print the table, write the JSON where asked."""
    if args.in_loop or args.text:
        if not (args.model and args.in_loop):
            _error("--in-loop and --text need --model --in-loop", "quality")
            return 2
        return run_quality_in_loop(args)
    try:
        config = quality.Config(seed=args.seed, tokens=args.tokens, queries=args.queries,
                                num_kv_heads=args.kv_heads, head_dim=args.head_dim, bits=tuple(args.bits),
                                model=args.model, model_tokens=args.model_tokens)
    except ValueError as exc:
        _error(str(exc), "quality")
        return 2
    return _quality_report(quality, config, args.json)


def _quality_report(module: Any, config: Any, json_path: str | None) -> int:
    """Run a quality module (`quality` or `quality_in_loop`: ``main_rows``, ``format_table``,
    ``write_json``) on ``config``, print its table and write its JSON where asked; the exit status."""
    try:
        rows, seconds = module.main_rows(config)
    except (ValueError, OSError, model_kv.ModelUnavailable) as exc:
        _error(first_line(exc), "quality")
        return 2
    except KeyboardInterrupt:
        _error("interrupted", "quality")
        return 130
    print(module.format_table(rows, config, seconds))
    if json_path:
        try:
            module.write_json(json_path, rows, config)
        except OSError as exc:
            _error(first_line(exc), "quality")
            return 1
    return 0


#: The commands: name, one-line help, description, the function adding its options (None: none)
#: and its handler, in the order ``--help`` lists them.
COMMANDS: tuple[tuple[str, str, str, Callable[[argparse.ArgumentParser], None] | None,
                      Callable[[argparse.Namespace], int]], ...] = (
    ("bench", "time decode and write against the memory roofline",
     "Time the paged decode and the cache write with CUDA-graph replays, against "
     "the device's read bandwidth and launch floor (an empty kernel) measured in the same run, "
     "with a BF16 (torch SDPA) and an FP8 (flashinfer) decode peer where importable; with --op "
     "prefill, the paged prefill against flashinfer's BF16 prefill alone and after a dequantize.",
     add_bench_arguments, run_bench),
    ("compare", "compare two 'bench --json' files row by row",
     "Match the rows of two files written by 'bench --json' (e.g. a build of main "
     "and of a branch, run on the same GPU) by op, V bits, shape, head dim and query tokens; "
     "print each decode and write row's median time in both and its change, the rows of one "
     "file only, the ceiling and launch floor apart (the machine's, never slowdowns), "
     "the worst slowdown and the geometric-mean ratio; with --round, over several rounds by "
     "the medians. Warns where the GPUs or the run options differ. Exit status 1 where a decode "
     "or write row is slower than --max-slowdown allows or was measured in one file and skipped "
     "in the other; 2 where a file is not a bench JSON (unreadable, not UTF-8 JSON, another "
     "schema, a field missing or of the wrong type, a time that is not null or a finite number "
     "> 0), in one line naming it; else 0.",
     add_compare_arguments, run_compare),
    ("info", "library, CUDA architectures, driver and GPUs",
     "Print the library's version, ABI, path and header, the CUDA architectures "
     "it holds code for (read from its fatbin headers), the driver's version and each GPU, "
     "or one 'no GPU: <reason>' line.",
     None, run_info),
    ("demo", "write and decode a ragged batch, checked against the NumPy reference",
     "Write a ragged batch of K/V into the cache and decode it with the library, "
     "compare the pools byte for byte and the output with the float64 NumPy reference, "
     "show the format's quantisation error against unquantised attention and time the "
     "kernels. Without a GPU only the reference runs.",
     add_demo_arguments, run_demo),
    ("quality", "V quantisation error per width/encoder/rotation on synthetic and real K/V",
     "With the NumPy reference only (no GPU): for each V width, encoder "
     "(matched_norm, mse, projection) and rotation, on synthetic Gaussian, Student-t(4) and outlier-heavy V "
     "(and, with --model, on the K/V of a real model), print the V normalised MSE and the "
     "attention-output relative error against unquantised float64 attention, with FP8 K+V and "
     "NVFP4-style V peers. With --model --in-loop: the model's perplexity, KL and top-1 agreement "
     "with every layer reading K and V through the format.",
     add_quality_arguments, run_quality),
    ("generate", "greedy generation of a Hugging Face model on the compressed cache",
     "Load a transformers model folder on the fp8kturbov attention and cache (CUDA: the kernels; "
     "CPU: the NumPy reference, slow), generate greedily from the prompts (one left-padded batch), "
     "print the continuations, the decode tokens/s and the cache's bytes. Needs the [transformers] extra.",
     generate.add_arguments, generate.main),
    ("perplexity", "teacher-forced perplexity, KL and top-1 agreement of a model on the cache",
     "Feed a text to a transformers model on its own cache and on the compressed cache of each "
     "--v-bits (and the --baseline caches) side by side; print each cache's perplexity, mean KL "
     "divergence from the own cache's next-token distributions and top-1 agreement with it, with a "
     "progress bar; --json writes them. Needs the [transformers] extra.",
     perplexity.add_arguments, perplexity.main),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each subparser sets ``handler``."""
    parser = argparse.ArgumentParser(prog=PROG, description="fp8kturbov tools.")
    parser.add_argument("--include-dir", action="store_true",
                        help="print the folder holding fp8kturbov.h (for -I) and exit")
    parser.add_argument("--library", action="store_true",
                        help="print the path of libfp8kturbov.so and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary, description, add_arguments, handler in COMMANDS:
        command = commands.add_parser(name, help=summary, description=description)
        if add_arguments is not None:
            add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run its command; the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.include_dir or args.library:
        if args.command is not None:
            parser.error("--include-dir and --library take no COMMAND")
        return print_paths(args)
    if args.command is None:
        parser.error("the following arguments are required: COMMAND (or --include-dir, --library)")
    try:
        return args.handler(args)
    except MemoryError:  # sizes within the limits that this machine cannot hold
        _error("out of memory: the sizes asked for do not fit in this machine's memory", args.command)
        return 1


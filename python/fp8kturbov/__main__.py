"""Command line: ``python -m fp8kturbov COMMAND [options]``.

Commands: ``bench`` (decode and write against the memory roofline; see `fp8kturbov.bench`).
Each command is a subparser with a ``handler(args) -> exit status``; add one in `build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from . import Fp8kturbovError, bench
from .bench import first_line

PROG = "python -m fp8kturbov"


def _typed(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` whose ValueError message reaches the user."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _shapes_text(shapes: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{batch}x{context}" for batch, context in shapes)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``; the defaults are `fp8kturbov.bench.Config`'s."""
    d = bench.Config()
    counts = _typed(bench.parse_counts)
    count = _typed(bench.parse_count)
    join = ",".join
    parser.add_argument("--op", choices=("decode", "write", "all"), default="all",
                        help="which operation to time (default: all)")
    parser.add_argument("--shapes", type=_typed(bench.parse_shapes), default=d.shapes,
                        metavar="BxL,...", help="decode shapes, batch x context tokens; a 'k' "
                        f"suffix means x1024 (default: {_shapes_text(d.shapes)})")
    parser.add_argument("--tokens", type=counts, default=d.tokens, metavar="N,...",
                        help=f"write shapes, token rows per launch (default: {join(map(str, d.tokens))})")
    parser.add_argument("--bits", type=counts, default=d.bits, metavar="B,...",
                        help=f"V code widths (default: {join(map(str, d.bits))})")
    parser.add_argument("--head-dim", type=counts, default=d.head_dims, metavar="D,...",
                        help=f"head dims (default: {join(map(str, d.head_dims))})")
    parser.add_argument("--q-heads", type=count, metavar="N", default=d.num_q_heads,
                        help=f"query heads (default: {d.num_q_heads})")
    parser.add_argument("--kv-heads", type=count, metavar="N", default=d.num_kv_heads,
                        help=f"KV heads (default: {d.num_kv_heads})")
    parser.add_argument("--block-size", type=count, metavar="N", default=d.block_size,
                        help=f"tokens per page (default: {d.block_size})")
    parser.add_argument("--iters", type=count, metavar="N", default=d.iters,
                        help=f"timed samples per case; the median is reported (default: {d.iters})")
    parser.add_argument("--warmup", type=int, metavar="N", default=d.warmup,
                        help=f"untimed launches before them (default: {d.warmup})")
    parser.add_argument("--sets", type=count, metavar="N", default=d.sets,
                        help=f"input sets rotated among, so that replays do not just hit L2 "
                        f"(default: {d.sets})")
    parser.add_argument("--sparse-v-threshold", type=float, metavar="TAU", default=d.sparse_v_threshold,
                        help=f"decode's sparse-V threshold, 0 = exact (default: {d.sparse_v_threshold:g})")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed of the inputs")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the BF16 (torch SDPA) and FP8 (flashinfer) decode peers")
    parser.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="write a roofline plot (needs matplotlib)")


def config_from_args(args: argparse.Namespace) -> bench.Config:
    """The `fp8kturbov.bench.Config` of parsed ``bench`` options (raises ValueError)."""
    return bench.Config(
        ops=bench.OPS if args.op == "all" else (args.op,), shapes=args.shapes, tokens=args.tokens,
        bits=args.bits, head_dims=args.head_dim, num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads, block_size=args.block_size, iters=args.iters,
        warmup=args.warmup, sets=args.sets, sparse_v_threshold=args.sparse_v_threshold,
        peers=not args.no_peers, seed=args.seed)


def _error(message: str) -> None:
    print(f"{PROG} bench: error: {message}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        _error(str(exc))
        return 2
    try:
        with bench.Device() as dev:
            device = bench.describe_device(dev)
            rows = bench.run_benchmarks(config, device=dev, show_progress=not args.no_progress)
    except (bench.BenchError, Fp8kturbovError) as exc:
        _error(first_line(exc))
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    print(bench.format_report(rows, device, config))
    try:
        if args.json:
            bench.write_json(args.json, rows, device, config)
        why_not = bench.write_plot(args.plot, rows) if args.plot else None
    except OSError as exc:
        _error(first_line(exc))
        return 1
    if why_not:
        print(f"{PROG} bench: plot skipped: {why_not}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="fp8kturbov tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_parser = commands.add_parser(
        "bench", help="time decode and write against the memory roofline",
        description="Time the paged decode and the cache write with CUDA-graph replays, against "
        "the device's copy bandwidth (read+write) and launch floor measured in the same run, "
        "with a BF16 (torch SDPA) and an FP8 (flashinfer) decode peer where importable.")
    add_bench_arguments(bench_parser)
    bench_parser.set_defaults(handler=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

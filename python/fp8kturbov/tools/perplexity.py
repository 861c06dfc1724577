"""``perplexity``: a Hugging Face model's teacher-forced perplexity on a text with the compressed
cache, and its distance from the model's own cache.

The text is fed in chunks (``--prefill`` tokens first, then ``--step`` at a time: 1 runs every
later token through the paged decode, 2-16 through the multi-token decode, more through the
prefill path) to every cache side by side: the model's own (its dtype, BF16 on a GPU, attended by
SDPA), each ``--v-bits`` width of `Fp8kturbovCache` and each ``--baseline``: "bf16" (the model's
own cache, the reference: KL 0) and "fp8" (K and V in E4M3 with per-layer scales, through the
NumPy reference's quantise-dequantise). Each row gives the perplexity of the tokens after the
first, the mean KL divergence ``KL(own || cache)`` of the next-token distributions and how often
the top token agrees with the own cache's. The logits are never kept beyond a chunk.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

BASELINES = ("bf16", "fp8")
REFERENCE_ATTENTION = "sdpa"


@dataclass
class Row:
    """One cache's totals over the scored positions; ``cache_bytes`` what it holds at the end."""

    cache: str
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    count: int = 0
    cache_bytes: int = 0

    def result(self) -> dict[str, Any]:
        n = max(self.count, 1)
        return dict(cache=self.cache, perplexity=math.exp(self.nll_sum / n), mean_kl=self.kl_sum / n,
                    top1_agreement=self.agree / n, positions=self.count, cache_bytes=self.cache_bytes)


@dataclass
class Run:
    """A cache fed the text and the attention it needs."""

    row: Row
    cache: Any
    attention: str
    fake_fp8: bool = False


def chunk_sizes(num_tokens: int, prefill: int, step: int) -> list[int]:
    """``prefill`` tokens (at most all), then ``step`` at a time."""
    first = min(prefill, num_tokens)
    rest = num_tokens - first
    return [first] + [min(step, rest - i) for i in range(0, rest, step)]


@contextlib.contextmanager
def attention_of(model: Any, name: str) -> Iterator[None]:
    """The model on attention ``name`` for the block, then back on its own."""
    own = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def teacher_forced_chunks(model: Any, cache: Any, tokens: Any, mask: Any,
                          chunks: Sequence[int]) -> Iterator[tuple[int, Any]]:
    """``(start, logits)`` of each chunk of ``tokens`` (``[B, N]``, with ``mask`` its attention
    mask, left padding allowed) fed to ``model`` over ``cache``, with the positions that
    ``generate`` would give them."""
    import torch

    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    start = 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            out = model(input_ids=tokens[:, start:end], attention_mask=mask[:, :end],
                        position_ids=positions[:, start:end], past_key_values=cache, use_cache=True)
            yield start, out.logits.float()
            start = end


def score(row: Row, logits: Any, reference: Any, targets: Any) -> None:
    """Add a chunk's next-token NLL, KL(reference || logits) and top-1 agreement to ``row``
    (``logits``, ``reference``: ``[T, V]`` for the ``T`` positions with a next token ``targets``)."""
    import torch

    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(logits, dim=-1)
    row.nll_sum += float(-log_q.gather(-1, targets[:, None]).sum())
    row.kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
    row.agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
    row.count += len(targets)


def build_runs(model: Any, v_bits: Sequence[int], baselines: Sequence[str],
               cache_options: dict[str, Any]) -> list[Run]:
    """The own cache (first: the reference), then one run per width and baseline."""
    from transformers import DynamicCache

    from ..integrations import transformers as fkt

    runs = [Run(Row("bf16"), DynamicCache(config=model.config), REFERENCE_ATTENTION)]
    with attention_of(model, fkt.ATTN_IMPLEMENTATION):
        runs += [Run(Row(f"fp8k_turbo{bits}v"), fkt.Fp8kturbovCache(model, v_bits=bits, **cache_options),
                     fkt.ATTN_IMPLEMENTATION) for bits in v_bits]
    if "fp8" in baselines:
        runs.append(Run(Row("fp8"), fkt.ReferenceQuantizedCache(model.config, v_bits=None),
                        REFERENCE_ATTENTION, fake_fp8=True))
    return runs


def cache_bytes(run: Run) -> int:
    """What the run's cache holds: the pools, the own cache's tensors, or (FP8, held in the
    model's dtype by the fake-quantised cache) one byte per element."""
    if hasattr(run.cache, "nbytes"):
        return run.cache.nbytes
    tensors = [t for layer in run.cache.layers for t in (layer.keys, layer.values) if t is not None]
    return sum(t.numel() * (1 if run.fake_fp8 else t.element_size()) for t in tensors)


def measure(model: Any, token_ids: Sequence[int], *, v_bits: Sequence[int], baselines: Sequence[str],
            prefill: int, step: int, cache_options: dict[str, Any], show_progress: bool = True,
            ) -> list[dict[str, Any]]:
    """Every cache's row for ``token_ids`` (at least 2), the own cache's first ("bf16")."""
    import torch

    from .console import progress

    device = next(model.parameters()).device
    tokens = torch.tensor([list(token_ids)], device=device)
    mask = torch.ones_like(tokens)
    chunks = chunk_sizes(tokens.shape[1], prefill, step)
    runs = build_runs(model, v_bits, baselines, cache_options)
    streams = [teacher_forced_chunks(model, run.cache, tokens, mask, chunks) for run in runs]
    for _ in progress(range(len(chunks)), lambda i: f"chunk {i + 1}", show_progress):
        outputs = []
        for run, stream in zip(runs, streams):
            with attention_of(model, run.attention):
                outputs.append(next(stream))
        start, reference = outputs[0]
        size = reference.shape[1]
        scored = min(size, tokens.shape[1] - 1 - start)  # positions with a next token
        targets = tokens[0, start + 1:start + 1 + scored]
        for run, (_, logits) in zip(runs, outputs):
            score(run.row, logits[0, :scored], reference[0, :scored], targets)
    rows = []
    for run in runs:
        run.row.cache_bytes = cache_bytes(run)
        if run.row.cache != "bf16" or "bf16" in baselines:
            rows.append(run.row.result())
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    from .console import format_table

    cells = [[r["cache"], f"{r['perplexity']:.4f}", f"{r['mean_kl']:.5f}", f"{r['top1_agreement']:.4f}",
              str(r["cache_bytes"])] for r in rows]
    return format_table(cells, ["cache", "perplexity", "mean KL", "top-1 agreement", "cache bytes"])


def write_json(path: str, rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump({"settings": settings, "rows": list(rows)}, out, indent=2)
        out.write("\n")


# ---- The command line ---------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    """The options of ``perplexity``."""
    from .arguments import COUNT, COUNTS
    from .generate import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--text", metavar="FILE", required=True, help="the UTF-8 text to score")
    parser.add_argument("--v-bits", type=COUNTS, metavar="B,...", default=(2, 3, 4),
                        help="V code widths (2, 3, 4), one row each (default: 2,3,4)")
    parser.add_argument("--baseline", metavar="NAME,...", default=",".join(BASELINES),
                        help=f"baseline rows: {', '.join(BASELINES)} (default: both; 'none' for neither)")
    parser.add_argument("--max-tokens", type=COUNT, metavar="N", default=1024,
                        help="score the text's first N tokens (default: 1024)")
    parser.add_argument("--prefill", type=COUNT, metavar="N", default=64,
                        help="tokens fed in the first forward (default: 64)")
    parser.add_argument("--step", type=COUNT, metavar="N", default=1,
                        help="tokens per later forward: 1 is the decode, 2-16 the multi-token "
                        "decode, more the prefill path (default: 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", metavar="PATH", help="write the rows and settings to PATH as JSON")


def baselines_of(text: str) -> tuple[str, ...]:
    """The ``--baseline`` names (ValueError naming the option for others)."""
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    if names == ("none",):
        return ()
    if not names or any(name not in BASELINES for name in names):
        raise ValueError(f"--baseline {text!r}: names among {', '.join(BASELINES)}, or none")
    return names


def main(args: Any) -> int:
    """``perplexity``: `measure` on the text's tokens, the table, and the JSON where asked."""
    from .generate import cache_options, check_model_arguments, device_and_dtype, load_model, run_command

    def body() -> None:
        check_model_arguments(args)
        baselines = baselines_of(args.baseline)
        if any(bits not in (2, 3, 4) for bits in args.v_bits):
            raise ValueError(f"--v-bits {','.join(map(str, args.v_bits))}: widths of 2, 3 or 4")
        with open(args.text, encoding="utf-8") as text_file:
            text = text_file.read()
        device, dtype = device_and_dtype(args)
        model, tokenizer = load_model(args.model, device, dtype)
        token_ids = tokenizer(text)["input_ids"][:args.max_tokens]
        if len(token_ids) < 2:
            raise ValueError(f"--text {args.text}: {len(token_ids)} token(s), at least 2 are scored")
        rows = measure(model, token_ids, v_bits=args.v_bits, baselines=baselines,
                       prefill=args.prefill, step=args.step, cache_options=cache_options(args),
                       show_progress=not args.no_progress)
        print(format_rows(rows))
        if args.json:
            settings = dict(model=args.model, text=args.text, tokens=len(token_ids), device=device,
                            dtype=dtype, prefill=args.prefill, step=args.step, **cache_options(args))
            write_json(args.json, rows, settings)

    return run_command("perplexity", body)

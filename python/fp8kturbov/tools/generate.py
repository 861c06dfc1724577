"""``generate``: a Hugging Face model's greedy continuation of prompts on the compressed cache.

`load_model` loads a model folder (no download: ``local_files_only``) on the fp8kturbov attention,
for this command and ``perplexity``. The prompts form one left-padded batch; the command prints
each continuation, the decode tokens per second (new tokens after the first, over the time after
the prefill) and the cache's bytes, and writes them as JSON where asked.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .bench.config import V_ENCODER_NAMES

DTYPES = ("bfloat16", "float16", "float32")


def load_model(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the folder ``path`` on ``device``, weights in ``dtype``, the
    attention "fp8kturbov" (its ``set_attn_implementation`` switches it for the baselines)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..integrations import transformers as fkt

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=fkt.ATTN_IMPLEMENTATION,
        local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return model, tokenizer


def cache_options(args: Any) -> dict[str, Any]:
    """The `Fp8kturbovCache` options of the parsed command line (all but ``v_bits``)."""
    return dict(v_encoder=args.v_encoder, v_rotation=args.v_rotation, block_size=args.block_size,
                k_scale_margin=args.k_scale_margin, sparse_v_threshold=args.sparse_v_threshold)


def run_generate(model: Any, tokenizer: Any, prompts: Sequence[str], *, v_bits: int,
                 max_new_tokens: int, options: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of ``max_new_tokens`` for each prompt on one `Fp8kturbovCache`."""
    import torch

    from ..integrations import transformers as fkt

    device = next(model.parameters()).device
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
    cache = fkt.Fp8kturbovCache(model, v_bits=v_bits, **options)
    first_token_at: list[float] = []

    class FirstToken:  # a streamer: notes when the prefill's token is out
        def put(self, value: Any) -> None:
            if len(first_token_at) < 2:  # the prompt, then the prefill's token
                first_token_at.append(_synchronised_time(device))

        def end(self) -> None:
            pass

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, past_key_values=cache, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, streamer=FirstToken())
    end = _synchronised_time(device)
    new = out[:, batch["input_ids"].shape[1]:]
    decode_seconds = end - first_token_at[-1]
    decoded = (new.shape[1] - 1) * new.shape[0]
    return dict(prompts=list(prompts), continuations=tokenizer.batch_decode(new, skip_special_tokens=True),
                new_tokens=int(new.numel()), prefill_seconds=first_token_at[-1] - start,
                decode_tokens_per_second=decoded / decode_seconds if decode_seconds > 0 and decoded else None,
                cache_bytes=cache.nbytes, v_bits=v_bits)


def _synchronised_time(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def format_result(result: dict[str, Any]) -> str:
    lines = []
    for prompt, text in zip(result["prompts"], result["continuations"]):
        lines += [f"> {prompt}", text, ""]
    speed = result["decode_tokens_per_second"]
    lines.append(f"fp8k_turbo{result['v_bits']}v: {result['new_tokens']} new tokens, prefill "
                 f"{result['prefill_seconds']:.3f} s, decode "
                 f"{'-' if speed is None else f'{speed:.1f}'} tokens/s, cache {result['cache_bytes']} bytes")
    return "\n".join(lines)


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(result, out, indent=2)
        out.write("\n")


# ---- The command line ---------------------------------------------------------------------------
INSTALL_HINT = 'pip install "fp8kturbov[transformers]"'


def add_model_arguments(parser: Any) -> None:
    """``--model``, ``--device``, ``--dtype`` and the cache's options, shared with ``perplexity``."""
    from .arguments import COUNT

    parser.add_argument("--model", metavar="DIR", required=True,
                        help="a Hugging Face model folder (config, weights, tokenizer); nothing is downloaded")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda where available, else cpu: the NumPy reference, slow)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights' dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--v-encoder", choices=V_ENCODER_NAMES, default="matched_norm",
                        help="the write's V encoder (default: matched_norm)")
    parser.add_argument("--v-rotation", choices=("none", "hadamard"), default="none",
                        help="keep V rotated (head_dim 128, 256, 512; default: none)")
    parser.add_argument("--block-size", type=COUNT, metavar="N", default=16, help="tokens per page (default: 16)")
    parser.add_argument("--k-scale-margin", type=float, metavar="M", default=2.0,
                        help="headroom of the K scales calibrated from the prompt: max|k|/448 * M, "
                        "M >= 1; later keys beyond it saturate (default: 2)")
    parser.add_argument("--sparse-v-threshold", type=float, metavar="TAU", default=None,
                        help="the decode's sparse-V threshold, 0 = exact (default: the library's)")


def check_model_arguments(args: Any) -> None:
    """Refuse out-of-range floats by option name (before any model is loaded)."""
    if not (math.isfinite(args.k_scale_margin) and args.k_scale_margin >= 1):
        raise ValueError(f"--k-scale-margin {args.k_scale_margin}: a finite number >= 1")
    threshold = args.sparse_v_threshold
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"--sparse-v-threshold {threshold}: a finite number >= 0")


def add_arguments(parser: Any) -> None:
    """The options of ``generate``."""
    from .arguments import COUNT

    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                        help="a prompt (repeat for a batch, left-padded)")
    parser.add_argument("--max-new-tokens", type=COUNT, metavar="N", default=64,
                        help="tokens to generate per prompt (default: 64)")
    parser.add_argument("--v-bits", type=int, choices=(2, 3, 4), default=3, help="V code width (default: 3)")
    parser.add_argument("--json", metavar="PATH", help="write the continuations and numbers to PATH as JSON")


def device_and_dtype(args: Any) -> tuple[str, str]:
    """The ``--device`` and ``--dtype`` asked for, or their defaults."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, args.dtype or ("float32" if device == "cpu" else "bfloat16")


def run_command(name: str, body: Callable[[], None]) -> int:
    """Run a command's ``body``; its exit status: 0, 2 for what the user can fix (no transformers,
    an unusable model folder or option, a model the cache cannot serve), 1 where the run fails."""
    from fp8kturbov import Fp8kturbovError
    from fp8kturbov._device import first_line

    def error(message: str) -> None:
        print(f"python -m fp8kturbov {name}: error: {message}", file=sys.stderr)

    try:
        body()
    except ImportError as exc:
        error(f"{first_line(exc)} (the command needs torch and transformers: {INSTALL_HINT})")
        return 2
    except (OSError, ValueError) as exc:  # UnsupportedLayerError is a ValueError
        error(first_line(exc))
        return 2
    except (Fp8kturbovError, RuntimeError) as exc:
        error(first_line(exc))
        return 1
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    return 0


def main(args: Any) -> int:
    """``generate``: `run_generate` on the model folder, printed and written as JSON where asked."""
    def body() -> None:
        check_model_arguments(args)
        device, dtype = device_and_dtype(args)
        model, tokenizer = load_model(args.model, device, dtype)
        result = run_generate(model, tokenizer, args.prompt, v_bits=args.v_bits,
                              max_new_tokens=args.max_new_tokens, options=cache_options(args))
        print(format_result(result))
        if args.json:
            write_json(args.json, result)

    return run_command("generate", body)

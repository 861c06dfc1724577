"""The transformers integration on a GPU: the library's kernels behind the cache.

The pools the kernels write are compared byte for byte with the NumPy reference's, their decode
and dequantize with the reference's; the tiny models of each family (tests/
test_transformers_integration.py) run on CUDA against the fake-quantised cache; generate,
assisted generation, beam search and a bf16 model run. Skipped without a GPU, torch or
transformers.

Run as a script, it measures decode speed (not a test; the numbers go to docs/PERFORMANCE.md)::

    PYTHONPATH=python python tests/test_gpu_transformers.py --batch 1,8 --prompt 32768 --new-tokens 256 --json speed.json

a randomly initialised Llama of about 1B parameters (16 layers, hidden 2048, 16 query and 8 KV
heads of head_dim 128) on the compressed cache (each --v-bits), on SDPA with transformers' default
cache, with its static cache, and with QuantizedCache where quanto or HQQ imports: decode tokens/s
after the prefill and the cache's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("ml_dtypes")

from test_transformers_integration import (DECODE_TOLERANCE, ONE_LAYER_CASES, compare_runs,  # noqa: E402
                                           fake_quantised, forced_logits, model_dir, ragged_batch,
                                           readme_example, relative_error, twin_models)

from fp8kturbov.integrations import transformers as fkt  # noqa: E402
from fp8kturbov.integrations._paged_batch import PagedBatch  # noqa: E402
from fp8kturbov.integrations._pools import KernelPools, PoolSpec, ReferencePools  # noqa: E402

pytestmark = pytest.mark.gpu


def _seed() -> int:
    seed = int(os.environ.get("FP8KTURBOV_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"FP8KTURBOV_TEST_SEED={seed}")
    return seed


@pytest.mark.parametrize("v_bits, rotation, encoder", [(2, "none", "matched_norm"), (3, "hadamard", "matched_norm"),
                                                       (4, "none", "mse"), (3, "hadamard", "projection")])
def test_kernel_pools_match_reference_pools(v_bits, rotation, encoder):
    """The same K/V written by the kernels and by the reference: identical pool bytes; the
    kernels' dequantize equal to the reference's; decodes (one token, multi-token) and the
    prefill path within the decode's error of the reference's."""
    rng = np.random.default_rng(_seed())
    heads, q_heads, dim, block = 2, 8, 128, 16
    spec = PoolSpec(heads, dim, v_bits, block, encoder, rotation, 0.0)
    cuda = KernelPools(spec, 0.03, torch.device("cuda", 0))
    cpu = ReferencePools(spec, 0.03)
    batch = PagedBatch(3, block)
    real = np.ones((3, 40), dtype=bool)
    real[1, :13] = False  # left padding
    prefill = batch.plan(real)
    for pools in (cuda, cpu):
        pools.ensure_pages(batch.num_pages)
    cuda.cache.k_pool.zero_()  # the reference's pools start as zeros; compare whole pools
    cuda.cache.v_pool.zero_()
    key, value = (torch.from_numpy(rng.normal(size=(3 * 40, heads, dim))).to(torch.bfloat16) for _ in range(2))
    cuda.write(key.cuda(), value.cuda(), prefill)
    cpu.write(key, value, prefill)
    np.testing.assert_array_equal(cuda.cache.k_pool.cpu().numpy()[:cpu.k_pool.size], cpu.k_pool)
    np.testing.assert_array_equal(cuda.cache.v_pool.cpu().numpy()[:cpu.v_pool.size], cpu.v_pool)
    slots = prefill.sequence_slots(1, 0)
    for got, want in zip(cuda.read(slots), cpu.read(slots)):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    for q_len in (1, 5):
        step = batch.plan(np.ones((3, q_len), dtype=bool))
        new_key, new_value = (torch.from_numpy(rng.normal(size=(3 * q_len, heads, dim))).to(torch.bfloat16)
                              for _ in range(2))
        cuda.ensure_pages(batch.num_pages)
        cpu.ensure_pages(batch.num_pages)
        q = torch.from_numpy(rng.normal(size=(3 * q_len, q_heads, dim))).to(torch.bfloat16)
        sinks = torch.from_numpy(rng.normal(size=q_heads)).float()
        options = dict(scaling=dim ** -0.5, sliding_window=9, soft_cap=3.0, sinks=sinks)
        want = cpu.decode(q, step, appended=(new_key, new_value), **options).float()
        got = cuda.decode(q.cuda(), step, appended=(new_key.cuda(), new_value.cuda()),
                          **{**options, "sinks": sinks.cuda()}).float().cpu()
        # the decode's fused append wrote the new tokens as the reference's write does
        for got_rows, want_rows in zip(cuda.read(step.query_slots), cpu.read(step.query_slots)):
            torch.testing.assert_close(got_rows.cpu(), want_rows, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        if q_len > 1:  # the prefill paths over what the decode's append wrote: the kernel's, the reference's
            paged = cuda.prefill(q.cuda(), step, **{**options, "sinks": sinks.cuda()}).float().cpu()
            dense = cpu.prefill(q, step, **options).float()
            for got_prefill in (paged, dense):
                torch.testing.assert_close(got_prefill, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("family, config", ONE_LAYER_CASES,
                         ids=[f"{f}-{'-'.join(c.get('layer_types', ['default']))}" for f, c in ONE_LAYER_CASES])
def test_family_on_cuda_matches_fake_quantised_cache(family, config):
    """head_dim 64 (Llama, Qwen 2, Mistral, gpt-oss), 128 (Qwen 3), 256 (Gemma 2); windows, soft
    cap, sinks; prefill, multi-token and one-token steps of a ragged batch, on the kernels."""
    got, want, plain, mask, cache = compare_runs(family, [30, 21], [20, 3, 1, 5, 1], device="cuda",
                                                 config=config)
    assert isinstance(cache.layers[0].pools, KernelPools)
    error = relative_error(got, want, mask)
    assert error < DECODE_TOLERANCE
    assert relative_error(got, plain, mask) > 2 * error


def test_bf16_model_generate_assisted_and_beams():
    """A bf16 model on CUDA: greedy tokens within the decode's error of the fake-quantised
    model's choice, prompt-lookup decoding (multi-token decode + crop) and beam search run."""
    model, twin = twin_models("qwen3", device="cuda")
    model, twin = model.to(torch.bfloat16), twin.to(torch.bfloat16)
    tokens, mask = ragged_batch([14, 9], 14, device="cuda")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = fkt.Fp8kturbovCache(model)
    with torch.no_grad():
        out = model.generate(input_ids=tokens, attention_mask=mask, past_key_values=cache, **kwargs)
        assisted = model.generate(input_ids=tokens[:1], attention_mask=mask[:1], prompt_lookup_num_tokens=3,
                                  past_key_values=fkt.Fp8kturbovCache(model), **kwargs)
        beams = model.generate(input_ids=tokens, attention_mask=mask, num_beams=2,
                               past_key_values=fkt.Fp8kturbovCache(model), **kwargs)
    full_mask = torch.cat([mask, torch.ones((2, 8), dtype=mask.dtype, device="cuda")], dim=1)
    want = forced_logits(twin, fake_quantised(twin, cache), out, full_mask, [14] + [1] * 8)
    chosen = want[:, 13:-1].gather(-1, out[:, 14:, None]).squeeze(-1)
    assert torch.all(want[:, 13:-1].amax(-1) - chosen <= 4 * DECODE_TOLERANCE * want.abs().max())
    assert assisted.shape == (1, 22) and beams.shape == (2, 22)


def test_cache_is_not_compileable():
    """generate compiles only caches that say so: this one must not (ctypes launches and host
    bookkeeping per step), so transformers never tries."""
    model, _ = twin_models("llama", device="cuda")
    assert not fkt.Fp8kturbovCache(model).is_compileable


def test_readme_lines_run_as_written(model_dir, capsys):
    """The README's transformers example exactly as printed (CUDA, bf16, 32 new tokens), on the tiny
    model folder: it generates on the compressed cache through the library's kernels."""
    namespace = {}
    exec(compile(readme_example().replace("MODEL_DIR", str(model_dir)), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    prompt_tokens = namespace["inputs"]["input_ids"].shape[1]
    assert namespace["model"].config._attn_implementation == "fp8kturbov"
    assert "device='cuda:0'" in printed and printed.count(",") >= prompt_tokens, printed


# ---- Speed (a script, not a test) ---------------------------------------------------------------
def _speed_model():
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            tensor = getattr(layer, name, None)
            if hasattr(tensor, "numel"):
                total += tensor.numel() * tensor.element_size()
    return total


def _timed_generate(model, ids, make_cache, new_tokens):
    """Prefill alone, then prefill + ``new_tokens`` (each on a new cache): decode tokens/s from
    the difference."""
    times, cache = [], None
    with torch.no_grad():
        for tokens in (1, new_tokens):
            cache = make_cache()
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    prefill, total = times
    return dict(prefill_s=prefill, decode_tokens_per_s=ids.shape[0] * (new_tokens - 1) / (total - prefill),
                cache_bytes=_cache_bytes(cache))


def speed(argv=None) -> int:
    """The speed measurement of the module docstring; prints a JSON line per row."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[2])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--v-bits", default="3")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model = _speed_model()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    # The process's first generate on each path (CUDA, cuBLAS and the library's set-up) is not timed.
    for attention, cache in (("sdpa", None), (fkt.ATTN_IMPLEMENTATION, fkt.Fp8kturbovCache(model))):
        model.set_attn_implementation(attention)
        with torch.no_grad():
            model.generate(input_ids=torch.ones((1, 16), dtype=torch.long, device="cuda"), past_key_values=cache,
                           max_new_tokens=2, do_sample=False, pad_token_id=0)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device="cuda")
        length = args.prompt + args.new_tokens
        cases = [(f"fp8k_turbo{bits}v", fkt.ATTN_IMPLEMENTATION,
                  lambda bits=int(bits): fkt.Fp8kturbovCache(model, v_bits=bits, max_cache_len=length))
                 for bits in args.v_bits.split(",")]
        cases += [("sdpa, DynamicCache", "sdpa", lambda: transformers.DynamicCache(config=model.config)),
                  ("sdpa, StaticCache", "sdpa",
                   lambda: transformers.StaticCache(config=model.config, max_cache_len=length))]
        for backend in ("quanto", "hqq"):
            cases.append((f"sdpa, QuantizedCache {backend} 4-bit", "sdpa",
                          lambda backend=backend: transformers.QuantizedCache(
                              backend=backend, config=model.config, nbits=4)))
        for name, attention, make_cache in cases:
            model.set_attn_implementation(attention)
            try:
                row = _timed_generate(model, ids, make_cache, args.new_tokens)
            except (ImportError, RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as exc:
                row = dict(skipped=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            row.update(cache=name, batch=batch, prompt=args.prompt, new_tokens=args.new_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(speed())

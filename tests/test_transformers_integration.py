"""The transformers integration on CPU tensors (the NumPy reference behind the cache): tiny
randomly initialised models of each family, compared with the same model whose K and V pass
through the reference's quantise-dequantise (`ReferenceQuantizedCache`) under the model's eager
attention, and with its plain cache. Skipped where transformers or torch is not importable."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("ml_dtypes")

from fp8kturbov.integrations import transformers as fkt  # noqa: E402
from fp8kturbov.integrations._paged_batch import PagedBatch  # noqa: E402

HIDDEN, VOCAB = 128, 96

#: family -> (config class name, what it exercises): head_dim 64/128/256, GQA, windows, soft cap, sinks.
FAMILIES = {
    "llama": ("LlamaConfig", dict(head_dim=64)),
    "qwen2": ("Qwen2Config", dict(head_dim=64)),
    "qwen3": ("Qwen3Config", dict(head_dim=128)),
    "mistral": ("MistralConfig", dict(head_dim=64, sliding_window=6)),
    "gemma2": ("Gemma2Config", dict(head_dim=256, sliding_window=6, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=None, query_pre_attn_scalar=128)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=128, sliding_window=6, query_pre_attn_scalar=64)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=64, sliding_window=6, num_local_experts=2,
                                     num_experts_per_tok=2,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}
#: One-layer cases: family and config overrides. One layer, so that the only difference from the
#: fake-quantised cache is the decode's arithmetic: a second layer would see inputs that differ
#: by that little and quantise some V elements to the neighbouring code, a jump no tolerance of
#: the arithmetic covers (the two-layer test below bounds it against the format's error).
ONE_LAYER_CASES = [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("gemma2", dict(layer_types=["sliding_attention"])),
    ("gemma2", dict(layer_types=["full_attention"])),
    ("gemma3", dict(layer_types=["sliding_attention"])),
    ("gpt_oss", dict(layer_types=["sliding_attention"])),
    ("gpt_oss", dict(layer_types=["full_attention"])),
]
#: Logit error of the compressed cache against the fake-quantised one, relative to the largest
#: logit: the decode's bf16 queries and outputs, bf16 K and V in the prefill, sparse V (1e-3).
DECODE_TOLERANCE = 1e-2


def tiny_config(family: str, attn_implementation: str, **overrides):
    """A tiny config of ``family``: one layer (or one per ``layer_types`` entry), 4 query and 2 KV
    heads, weights drawn with std 0.1 so that the logits are far from uniform."""
    name, options = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    options = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                   num_hidden_layers=len(overrides.get("layer_types", [None])),
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.1, **options)
    options.update(overrides)
    config = getattr(transformers, name)(**options)
    config._attn_implementation = attn_implementation
    return config


def twin_models(family: str, seed: int = 0, device: str = "cpu", **overrides):
    """The same random weights twice: on the fp8kturbov attention and on eager attention."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family, fkt.ATTN_IMPLEMENTATION, **overrides)).eval()
    twin = transformers.AutoModelForCausalLM.from_config(tiny_config(family, "eager", **overrides)).eval()
    twin.load_state_dict(model.state_dict())
    return model.to(device), twin.to(device)


def ragged_batch(lengths, total, seed=1, device="cpu"):
    """Random tokens ``[B, total]``, row b left-padded so that its last ``lengths[b]`` are real."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (len(lengths), total)))
    mask = torch.zeros((len(lengths), total), dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, total - n:] = 1
    return tokens.to(device), mask.to(device)


@torch.no_grad()
def forced_logits(model, cache, tokens, mask, chunks):
    """Teacher-forced logits ``[B, N, V]``: ``tokens`` fed in ``chunks`` (sizes summing to N)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, start = [], 0
    for size in chunks:
        end = start + size
        out = model(input_ids=tokens[:, start:end], attention_mask=mask[:, :end],
                    position_ids=positions[:, start:end], past_key_values=cache, use_cache=True)
        logits.append(out.logits.float())
        start = end
    assert start == tokens.shape[1]
    return torch.cat(logits, dim=1)


def fake_quantised(twin, cache, **options):
    """The reference's quantise-dequantise cache with the compressed cache's K scales."""
    return fkt.ReferenceQuantizedCache(twin.config, k_scale=[layer.k_scale for layer in cache.layers],
                                       **options)


def relative_error(got, want, mask):
    real = mask.bool()
    return float((got[real] - want[real]).abs().max() / want[real].abs().max())


def compare_runs(family, lengths, chunks, seed=0, device="cpu", **options):
    """Logits of the compressed cache, the fake-quantised one and the plain one, fed the same
    ragged batch in ``chunks``; returns them, the mask and the compressed cache."""
    overrides = options.pop("config", {})
    model, twin = twin_models(family, seed, device, **overrides)
    tokens, mask = ragged_batch(lengths, sum(chunks), seed + 1, device)
    cache = fkt.Fp8kturbovCache(model, **options)
    got = forced_logits(model, cache, tokens, mask, chunks)
    fake_options = {k: options[k] for k in ("v_bits", "v_encoder", "v_rotation") if k in options}
    want = forced_logits(twin, fake_quantised(twin, cache, **fake_options), tokens, mask, chunks)
    plain = forced_logits(twin, transformers.DynamicCache(config=twin.config), tokens, mask, chunks)
    return got, want, plain, mask, cache


@pytest.mark.parametrize("family, config", ONE_LAYER_CASES,
                         ids=[f"{f}-{'-'.join(c.get('layer_types', ['default']))}" for f, c in ONE_LAYER_CASES])
def test_family_matches_fake_quantised_cache(family, config):
    """Prefill (> 16 tokens: dequantise + attention), multi-token steps (2-16) and one-token
    steps over a ragged, left-padded batch, against the fake-quantised cache; the plain cache
    differs more (the format's own error)."""
    got, want, plain, mask, cache = compare_runs(family, [30, 21], [20, 3, 1, 5, 1], config=config)
    error = relative_error(got, want, mask)
    assert error < DECODE_TOLERANCE
    assert relative_error(got, plain, mask) > 2 * error
    assert cache.get_seq_length() == 30
    np.testing.assert_array_equal(cache.paged.seq_lens, [30, 21])


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_alternating_windows_two_layers(family):
    """Two layers, the first sliding and the second full (Gemma 2 and 3, gpt-oss): the compressed cache
    stays much closer to the fake-quantised one than the format's error (see ONE_LAYER_CASES)."""
    got, want, plain, mask, cache = compare_runs(
        family, [30, 21], [20, 3, 1, 5, 1],
        config=dict(layer_types=["sliding_attention", "full_attention"]))
    assert [layer.is_sliding for layer in cache.layers] == [True, False]
    assert relative_error(got, want, mask) < 0.25 * relative_error(want, plain, mask)


@pytest.mark.parametrize("options", [
    dict(v_bits=[2, 4]),
    dict(v_bits=lambda layer: 4 if layer == 0 else 2, v_encoder="mse"),
    dict(v_encoder=["projection", "matched_norm"]),
    dict(v_rotation="hadamard", block_size=8),
    dict(k_scale=0.05, max_cache_len=40),
], ids=["v_bits-list", "v_bits-function-mse", "v_encoder-list-projection", "hadamard", "k_scale-max_cache_len"])
def test_cache_options_match_fake_quantised_cache(options):
    """Per-layer V widths and encoders (MSE, projection), the rotation (head_dim 128), a given K scale
    and pages reserved up front, each against the fake-quantised cache with the same options; two
    layers (Qwen 3), hence the looser bound of the two-layer test."""
    got, want, plain, mask, cache = compare_runs("qwen3", [26, 19], [17, 2, 1, 6], **options,
                                                 config=dict(num_hidden_layers=2))
    assert relative_error(got, want, mask) < 0.25 * relative_error(want, plain, mask)
    if "k_scale" in options:
        assert [layer.k_scale for layer in cache.layers] == [0.05, 0.05]
    if "max_cache_len" in options:  # 40 tokens of 16-token pages for each of 2 sequences
        assert cache.paged.num_pages == 2 * 3


def test_calibrated_k_scale_is_the_prompt_maximum_with_margin():
    """k_scale=None: max |k| / 448 of the layer's first (real) keys, times the margin, as the
    fake-quantised cache calibrates from the same keys."""
    model, twin = twin_models("llama")
    tokens, mask = ragged_batch([12, 12], 12)
    cache = fkt.Fp8kturbovCache(model, k_scale_margin=1.5)
    forced_logits(model, cache, tokens, mask, [12])
    fake = fkt.ReferenceQuantizedCache(twin.config, margin=1.5)
    forced_logits(twin, fake, tokens, mask, [12])
    assert cache.layers[0].k_scale == fake.k_scales[0]


def test_greedy_generate_matches_fake_quantised_cache():
    """model.generate on the cache (left-padded batch): each greedy token is the fake-quantised
    model's top token on the same text, or within the decode's error of it."""
    model, twin = twin_models("mistral")
    tokens, mask = ragged_batch([14, 9], 14)
    cache = fkt.Fp8kturbovCache(model)
    with torch.no_grad():
        out = model.generate(input_ids=tokens, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=8, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones((2, 8), dtype=torch.long)], dim=1)
    want = forced_logits(twin, fake_quantised(twin, cache), out, full_mask, [14] + [1] * 8)
    chosen = want[:, 13:-1].gather(-1, out[:, 14:, None]).squeeze(-1)
    best = want[:, 13:-1].amax(-1)
    assert torch.all(best - chosen <= DECODE_TOLERANCE * want.abs().max())
    assert cache.get_seq_length() == 14 + 7  # the last token is not fed back


def test_assisted_generation_crops_and_matches_greedy():
    """Prompt-lookup (assisted) decoding runs candidate chunks through the multi-token decode and
    crops the rejected ones: its tokens are greedy decoding's (the reference decode of a position
    does not depend on the chunk it is in)."""
    model, _ = twin_models("llama")
    tokens, mask = ragged_batch([12], 12)
    kwargs = dict(input_ids=tokens, attention_mask=mask, max_new_tokens=10, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        greedy = model.generate(past_key_values=fkt.Fp8kturbovCache(model), **kwargs)
        assisted = model.generate(past_key_values=fkt.Fp8kturbovCache(model),
                                  prompt_lookup_num_tokens=3, **kwargs)
    torch.testing.assert_close(assisted, greedy, rtol=0, atol=0)


def test_crop_then_refeed_gives_the_same_logits():
    model, _ = twin_models("llama")
    tokens, mask = ragged_batch([15, 10], 15)
    straight = forced_logits(model, fkt.Fp8kturbovCache(model), tokens, mask, [10, 5])
    cache = fkt.Fp8kturbovCache(model)
    forced_logits(model, cache, tokens, mask, [10, 5])
    cache.crop(-3)
    assert cache.get_seq_length() == 12
    np.testing.assert_array_equal(cache.paged.seq_lens, [12, 7])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        again = model(input_ids=tokens[:, 12:], attention_mask=mask, position_ids=positions[:, 12:],
                      past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(again, straight[:, 12:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [[1, 0], [1, 1], [0, 0, 1, 1]], ids=["swap", "duplicate", "repeat"])
def test_reorder_copies_pages(rows):
    """reorder_cache / batch_repeat_interleave: the cache of batch [A, B] made into rows[...]
    decodes as a cache that was filled with those rows in the first place."""
    model, _ = twin_models("llama")
    tokens, mask = ragged_batch([11, 11], 11)
    cache = fkt.Fp8kturbovCache(model, block_size=4)
    forced_logits(model, cache, tokens[:, :9], mask[:, :9], [9])
    if len(rows) == 4:
        cache.batch_repeat_interleave(2)
    else:
        cache.reorder_cache(torch.tensor(rows))
    index = torch.tensor(rows)
    fresh = fkt.Fp8kturbovCache(model, block_size=4)
    want = forced_logits(model, fresh, tokens[index], mask[index], [9, 1, 1])[:, 9:]
    positions = (mask[index].cumsum(-1) - 1)
    steps = []
    with torch.no_grad():
        for i in (9, 10):
            steps.append(model(input_ids=tokens[index][:, i:i + 1], attention_mask=mask[index][:, :i + 1],
                               position_ids=positions[:, i:i + 1], past_key_values=cache,
                               use_cache=True).logits)
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert cache.batch_size == len(rows)


def test_beam_search_runs_and_keeps_its_pages():
    """num_beams=2 reorders the cache every step; the pools stop growing once every beam has its
    pages (reordering copies into a row's own pages)."""
    model, _ = twin_models("llama")
    tokens, mask = ragged_batch([10, 7], 10)
    cache = fkt.Fp8kturbovCache(model, block_size=4)
    with torch.no_grad():
        out = model.generate(input_ids=tokens, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)
    assert cache.batch_size == 4
    assert cache.paged.num_pages <= 4 * -(-16 // 4) + 2 * -(-10 // 4)


# ---- What the cache refuses, by name ------------------------------------------------------------
@pytest.mark.parametrize("config_name, options, words", [
    ("LlamaConfig", dict(head_dim=96), "layer 0 (full_attention): head_dim 96"),
    ("Qwen2Config", dict(layer_types=["full_attention", "chunked_attention"]),
     "layer 1 (chunked_attention): chunked attention"),
    ("Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention"]),
     "layer 0 (linear_attention)"),
    ("DeepseekV3Config", dict(), "MLA"),
    ("T5Config", dict(), "encoder-decoder"),
    ("LlamaConfig", dict(head_dim=64, v_rotation="hadamard"), "v_rotation 'hadamard' needs a head_dim"),
])
def test_unsupported_layers_raise_naming_the_layer(config_name, options, words):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    rotation = options.pop("v_rotation", "none")
    config = getattr(transformers, config_name)(num_hidden_layers=len(options.get("layer_types", [0, 1])),
                                                **options)
    with pytest.raises(fkt.UnsupportedLayerError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fkt.Fp8kturbovCache(config, v_rotation=rotation)


def test_model_on_another_attention_is_refused():
    model, twin = twin_models("llama")
    with pytest.raises(ValueError, match="attn_implementation='fp8kturbov'"):
        fkt.Fp8kturbovCache(twin)


def test_attention_without_the_cache_is_refused():
    model, _ = twin_models("llama")
    tokens, mask = ragged_batch([5], 5)
    with pytest.raises(RuntimeError, match="past_key_values=Fp8kturbovCache"):
        forced_logits(model, transformers.DynamicCache(config=model.config), tokens, mask, [5])


def test_cache_under_another_attention_is_refused():
    """The cache given to a model on eager attention: the next update finds its K/V unread."""
    model, twin = twin_models("llama")
    cache = fkt.Fp8kturbovCache(model.config)
    tokens, mask = ragged_batch([5], 5)
    with pytest.raises(RuntimeError, match="did not read the fp8kturbov cache"):
        forced_logits(twin, cache, tokens, mask, [3, 2])


def test_dropout_is_refused():
    model, _ = twin_models("llama", attention_dropout=0.5)
    tokens, mask = ragged_batch([4], 4)
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        forced_logits(model, fkt.Fp8kturbovCache(model), tokens, mask, [4])


# ---- The pieces ---------------------------------------------------------------------------------
def test_padding_mask_keeps_the_new_columns_only():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(fkt.padding_mask(2, 4, 4, attention_mask=mask), mask)
    assert fkt.padding_mask(2, 3, 4, attention_mask=mask) is None
    assert fkt.padding_mask(2, 2, 4, attention_mask=None) is None


def test_paged_batch_slots_follow_the_block_table():
    batch = PagedBatch(2, block_size=4)
    real = np.array([[False, True, True, True, True, True], [True] * 6])
    step = batch.plan(real)
    np.testing.assert_array_equal(step.seq_lens, [5, 6])
    np.testing.assert_array_equal(step.query_start, [0, 5, 11])
    np.testing.assert_array_equal(step.query_rows, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    # each real token's slot is table[position // 4] * 4 + position % 4, padding -1
    for flat, slot in enumerate(step.slots):
        seq, column = divmod(flat, 6)
        if not real[seq, column]:
            assert slot == -1
            continue
        position = int(real[seq, :column].sum())
        assert slot == step.block_tables[seq, position // 4] * 4 + position % 4
    assert len(set(step.slots[step.slots >= 0])) == 11
    assert not step.fits_multi_token_decode or step.max_new_tokens <= 16
    batch.crop(2)
    np.testing.assert_array_equal(batch.seq_lens, [3, 4])
    pages = batch.num_pages
    source, destination = batch.select(np.array([1, 1]))
    np.testing.assert_array_equal(source, np.repeat(step.block_tables[1, :1], 2))
    np.testing.assert_array_equal(destination, [step.block_tables[0, 0], step.block_tables[1, 0]])
    assert batch.num_pages == pages  # copied into the rows' own pages


@pytest.mark.parametrize("options", [
    dict(), dict(sliding_window=5), dict(soft_cap=1.5), dict(sinks=True), dict(rotation="hadamard"),
], ids=["plain", "window", "soft-cap", "sinks", "hadamard"])
def test_dense_prefill_matches_the_multi_token_decode(options):
    """The prefill's attention over dequantised K/V (`chunk_attention`) against the reference's
    multi-token decode of the same pools and queries (exact sparse V): one rule, two paths."""
    from fp8kturbov.integrations._dense import chunk_attention
    from fp8kturbov.integrations._pools import PoolSpec, ReferencePools

    rng = np.random.default_rng(7)
    heads, q_heads, dim, length, q_len = 2, 4, 128, 23, 9
    rotation = options.pop("rotation", "none")
    pools = ReferencePools(PoolSpec(heads, dim, 3, 4, "matched_norm", rotation, 0.0), k_scale=0.02)
    batch = PagedBatch(1, block_size=4)
    step = batch.plan(np.ones((1, length), dtype=bool))
    pools.ensure_pages(batch.num_pages)
    key, value = (torch.from_numpy(rng.normal(size=(length, heads, dim))).float() for _ in range(2))
    pools.write(key, value, step)
    q = torch.from_numpy(rng.normal(size=(q_len, q_heads, dim))).float()
    sinks = torch.from_numpy(rng.normal(size=q_heads)).float() if options.pop("sinks", False) else None
    attention = dict(scaling=dim ** -0.5, sliding_window=options.get("sliding_window", 0),
                     soft_cap=options.get("soft_cap", 0.0), sinks=sinks)
    decode_step = PagedBatch(1, block_size=4)
    decode_step.plan(np.ones((1, length - q_len), dtype=bool))
    decode_step = decode_step.plan(np.ones((1, q_len), dtype=bool))
    want = pools.decode(q, decode_step, appended=(key[-q_len:], value[-q_len:]), **attention)  # rewritten as they are
    cached_key, cached_value = pools.read(step.slots)
    got = chunk_attention(q, cached_key, cached_value, rotated=rotation == "hadamard", **attention)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


# ---- The commands -------------------------------------------------------------------------------
WORDS = [f"w{i}" for i in range(VOCAB - 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer over WORDS (saved, loaded back)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {word: i for i, word in enumerate(["<unk>", "<pad>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(folder)
    model, _ = twin_models("llama")
    model.save_pretrained(folder)
    return folder


def run_cli(*argv):
    from fp8kturbov.tools import cli

    return cli.main([str(a) for a in argv])


def test_generate_command(model_dir, tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert run_cli("generate", "--model", model_dir, "--device", "cpu", "--prompt", "w1 w2 w3 w4",
                   "--prompt", "w5 w6", "--max-new-tokens", 4, "--json", out) == 0
    result = json.loads(out.read_text())
    assert len(result["continuations"]) == 2 and result["new_tokens"] == 8
    assert result["cache_bytes"] > 0
    assert "tokens/s" in capsys.readouterr().out


def test_generate_command_refuses_a_missing_model(tmp_path, capsys):
    assert run_cli("generate", "--model", tmp_path / "nothing", "--device", "cpu", "--prompt", "x") == 2
    assert "error" in capsys.readouterr().err


def test_perplexity_command(model_dir, tmp_path):
    """The own cache's row is the perplexity of one full forward without a cache; KL 0 and full
    agreement with itself; the compressed and FP8 rows close to it."""
    text = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(40))
    (tmp_path / "text.txt").write_text(text)
    out = tmp_path / "ppl.json"
    assert run_cli("perplexity", "--model", model_dir, "--device", "cpu", "--text", tmp_path / "text.txt",
                   "--v-bits", "2,4", "--max-tokens", 30, "--prefill", 20, "--step", 3, "--no-progress",
                   "--json", out) == 0
    rows = {row["cache"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bf16", "fp8k_turbo2v", "fp8k_turbo4v", "fp8"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt")["input_ids"][:, :30]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, ids[0, 1:, None]).mean()
    assert rows["bf16"]["perplexity"] == pytest.approx(float(nll.exp()), rel=1e-4)
    assert rows["bf16"]["mean_kl"] == pytest.approx(0, abs=1e-6) and rows["bf16"]["top1_agreement"] == 1
    assert all(row["positions"] == 29 for row in rows.values())
    assert 0 < rows["fp8k_turbo4v"]["mean_kl"] < rows["fp8k_turbo2v"]["mean_kl"]
    assert 0 < rows["fp8"]["mean_kl"]


@pytest.mark.parametrize("option", [["--v-bits", "3,5"], ["--baseline", "fp16"], ["--k-scale-margin", "0.5"],
                                    ["--sparse-v-threshold", "nan"]])
def test_perplexity_command_refuses_bad_options_before_loading(tmp_path, capsys, option):
    assert run_cli("perplexity", "--model", tmp_path / "no-model", "--text", tmp_path / "t.txt", *option) == 2
    assert option[0].lstrip("-") in capsys.readouterr().err


def readme_example() -> str:
    """The README's transformers example, as printed."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Hugging Face transformers"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_lines_run(model_dir):
    """The README's transformers example, on the tiny model folder and the CPU (on CUDA as written:
    tests/test_gpu_transformers.py)."""
    code = readme_example().replace("MODEL_DIR", str(model_dir)).replace('"cuda"', '"cpu"')
    code = code.replace("torch.bfloat16", "torch.float32").replace("max_new_tokens=32", "max_new_tokens=3")
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("options, words", [
    (dict(v_bits=[3, 5]), "v_bits of layer 1: 5"), (dict(v_encoder="best"), "v_encoder of layer 0"),
    (dict(v_rotation="random"), "v_rotation of layer 0: 'random'"), (dict(block_size=0), "block_size"),
    (dict(k_scale_margin=0.5), "k_scale_margin"), (dict(v_bits=[3]), "v_bits: 1 values"),
])
def test_bad_cache_options_are_refused_by_name(options, words):
    model, _ = twin_models("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match=words):
        fkt.Fp8kturbovCache(model, **options)

